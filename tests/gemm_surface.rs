//! GEMM efficiency by shape on graph-only exports: routed experts' products are priced at
//! their per-expert size (tokens · k / E rows), not as one product over every routed pair.

use std::path::Path;

use smp_partition::cost::{ClusterSpec, node_time};
use smp_partition::ir::{DType, OpKind};
use smp_partition::load_and_analyze;
use smp_partition::passes::AnalyzeOptions;

#[test]
fn expert_gemms_are_priced_at_their_per_expert_size() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/qwen3-235b-a22b.onnx");
    let a = load_and_analyze(&path, &AnalyzeOptions { seq_len: Some(4096), ..Default::default() }).unwrap();
    let g = &a.lg.graph;
    let id = g.node_ids().find(|&id| g.node(id).op.is(OpKind::MixtureOfExperts)).expect("a mixture of experts");
    let fig = a.lg.node_figures(id);
    // Qwen3-235B-A22B: 128 experts, top 8, hidden 4096, expert intermediate 1536; at 4,096
    // tokens a sample each expert gets 4096 · 8 / 128 = 256 rows
    let [up, down] = fig.gemms;
    assert_eq!((up.rows, up.n, up.k), (256.0, 3072.0, 4096.0));
    assert_eq!((down.rows, down.n, down.k), (256.0, 4096.0, 1536.0));
    assert!(up.share + down.share > 0.99 && up.share + down.share <= 1.0, "{} + {}", up.share, down.share);
    // priced at that size, against the same work as one product over all 32,768 routed pairs
    let spec = ClusterSpec::preset("h100-80gb").unwrap();
    let per_expert = node_time(&fig, DType::BF16, &spec);
    let mut one = fig;
    for p in &mut one.gemms {
        p.rows *= 128.0;
    }
    let pooled = node_time(&one, DType::BF16, &spec);
    // XLA's table: 256 × 3072 × 4096 at 366 TFLOP/s against 783 on the plateau
    assert!(per_expert > 1.5 * pooled, "per expert {per_expert:.3e} s, pooled {pooled:.3e} s");
}
