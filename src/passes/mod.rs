//! Passes over the IR, one file each; [`analyze`] runs them in order:
//! decide parameters → bind dims → shape inference → fold shape arithmetic → slice assignments
//! into Concat → DCE → shape inference → fuse op chains → figures → layer grouping, with the graph verifier between them.
//! [`specialise`] is the part up to fusion: the runner applies it to the model it loads, then
//! the plan's recorded fusions (`fuse::apply`).

use crate::ir;

pub mod autocast;
pub mod dce;
mod error;
pub mod figures;
pub mod fold;
pub mod fuse;
pub mod layers;
mod options;
pub mod params;
pub mod rebatch;
pub mod shape_infer;
pub mod slice_assign;
#[cfg(test)]
pub(crate) mod testutil;

pub use error::PassError;
pub use options::AnalyzeOptions;

/// Runs the pass list over an imported graph and returns it with shapes, figures and layers.
/// What is trained is decided by [`params::decide`] with no patterns (a graph already decided,
/// e.g. by the runner with `--trainable`/`--frozen`, keeps its decisions); see [`analyze_with`].
pub fn analyze(graph: ir::Graph, opts: &AnalyzeOptions) -> Result<ir::LayeredGraph, PassError> {
    analyze_with(graph, opts, &params::ParamOptions::default())
}

/// [`analyze`] with `--trainable`/`--frozen` patterns.
pub fn analyze_with(
    mut graph: ir::Graph,
    opts: &AnalyzeOptions,
    param_opts: &params::ParamOptions,
) -> Result<ir::LayeredGraph, PassError> {
    graph.verify()?;
    let decided = params::decide(&mut graph, param_opts)?;
    tracing::debug!(%decided, "parameters decided");
    debug_verify(&graph)?;
    let (mut graph, mut dims) = specialise_decided(graph, opts)?;
    let fused = fuse::fuse(&mut graph);
    debug_verify(&graph)?;
    if !fused.is_empty() {
        tracing::debug!(fused = %fuse::Fused::of(&fused), "op chains fused");
    }
    if dims.fixed_batch {
        match rebatch::check(&graph, opts) {
            Ok(()) => dims.batch_rebinds = true,
            Err(e) => tracing::debug!(%e, "the fixed batch is not rebindable"),
        }
    }
    let figures = figures::compute(&graph, &dims)?;
    let layers = layers::group(&graph, &figures, &dims)?;
    debug_verify(&graph)?;
    Ok(ir::LayeredGraph {
        params: figures.total_params,
        flops_per_sample: figures.total_flops,
        node_figures: figures.per_node,
        loss: figures.loss,
        layers,
        dims,
        graph,
        fused,
    })
}

/// The first half of [`analyze`]: decides what is trained (keeping an earlier decision), binds dims, infers shapes, folds
/// shape arithmetic into constants, rewrites slice assignments that cover an axis into `Concat`
/// ([`slice_assign`]) and removes dead nodes. Node and value ids are kept, so the
/// result is the graph codegen's shards address (the runner applies a plan's shards to it, on a
/// graph whose parameters were decided the same way).
pub fn specialise(mut graph: ir::Graph, opts: &AnalyzeOptions) -> Result<(ir::Graph, ir::DimBindings), PassError> {
    graph.verify()?;
    // a graph already decided (with patterns, by the runner) keeps its decisions
    params::decide(&mut graph, &params::ParamOptions::default())?;
    debug_verify(&graph)?;
    specialise_decided(graph, opts)
}

/// [`specialise`] of a graph whose parameters are decided.
fn specialise_decided(mut graph: ir::Graph, opts: &AnalyzeOptions) -> Result<(ir::Graph, ir::DimBindings), PassError> {
    let mut dims = shape_infer::bind_dims(&graph, opts)?;
    let info = match shape_infer::infer_shapes(&mut graph, &dims) {
        Ok(info) => info,
        Err(e) => shape_infer::grouped_batch(&mut graph, &mut dims, opts).ok_or(e)?,
    };
    debug_verify(&graph)?;
    let folded = fold::fold_constants(&mut graph, &dims, &info)?;
    debug_verify(&graph)?;
    let mut removed = dce::remove_dead_nodes(&mut graph);
    // after dead-node removal: the Shape reads of folded index arithmetic are gone
    let assigned = slice_assign::concat_slice_assignments(&mut graph);
    if assigned > 0 {
        removed += dce::remove_dead_nodes(&mut graph);
    }
    debug_verify(&graph)?;
    if folded > 0 || removed > 0 || assigned > 0 {
        shape_infer::infer_shapes(&mut graph, &dims)?;
        debug_verify(&graph)?;
    }
    tracing::debug!(folded, assigned, removed, nodes = graph.node_count(), "shape arithmetic folded, slice assignments concatenated, dead nodes removed");
    Ok((graph, dims))
}

fn debug_verify(graph: &ir::Graph) -> Result<(), PassError> {
    if cfg!(debug_assertions) {
        graph.verify()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::testutil::{Gpt, gpt};
    use super::*;
    use crate::ir::{DType, LayerKind, OpKind};

    fn cfg() -> Gpt {
        Gpt {
            blocks: 2,
            hidden: 256,
            heads: 8,
            vocab: 512,
            ffn: 1024,
            batch: Some(2),
            seq: Some(64),
            dtype: DType::BF16,
            namespaces: true,
            layer_names: true,
        }
    }

    fn kinds(lg: &ir::LayeredGraph) -> Vec<LayerKind> {
        lg.layers.iter().map(|l| l.kind).collect()
    }

    #[test]
    fn megatron_block_saves_korthikanti_bytes() {
        // Korthikanti et al. (2022) without dropout: s·b·h·(32 + 2·a·s/h) bytes in bf16, of
        // which 2·a·s² are the softmax probabilities. Attention is fused, and the fused kernel
        // keeps its output (2·s·h) and an f32 logsumexp per query row (4·a·s) instead.
        for (batch, seq, opts) in [
            (Some(2), Some(64), AnalyzeOptions::default()),
            (None, None, AnalyzeOptions { seq_len: Some(64), ..Default::default() }),
        ] {
            let c = Gpt { batch, seq, ..cfg() };
            let lg = analyze(gpt(c), &opts).unwrap();
            assert_eq!(kinds(&lg), vec![LayerKind::Embedding, LayerKind::Block, LayerKind::Block, LayerKind::Head]);
            let (s, h, a) = (64.0, c.hidden as f64, c.heads as f64);
            let want = s * h * (32.0 + 2.0 * a * s / h) - 2.0 * a * s * s + 2.0 * s * h + 4.0 * a * s;
            assert_eq!(lg.fused.iter().filter(|f| matches!(f.op, ir::FusedOp::Attention { .. })).count(), 2);
            for l in &lg.layers[1..3] {
                let got = l.figures.saved_bytes;
                assert!((got - want).abs() / want < 0.05, "{}: saved {got} vs {want}", l.name);
            }
        }
    }

    #[test]
    fn block_matmul_flops_match_closed_form() {
        let c = cfg();
        let lg = analyze(gpt(c), &AnalyzeOptions::default()).unwrap();
        let (s, h, a, f) = (64.0, c.hidden as f64, c.heads as f64, c.ffn as f64);
        let d = h / a;
        // the attention matmuls are inside the fused attention, with its scale (1 flop a
        // score) and softmax (5)
        let want = 2.0 * s * h * 3.0 * h + 2.0 * 2.0 * a * s * s * d + 6.0 * a * s * s + 2.0 * s * h * h + 2.0 * 2.0 * s * h * f;
        for l in &lg.layers[1..3] {
            let got: f64 = l
                .nodes
                .iter()
                .filter(|&&n| lg.graph.node(n).op.is(OpKind::MatMul) || lg.graph.node(n).op.is(OpKind::ScaledDotProductAttention))
                .map(|&n| lg.node_figures(n).flops)
                .sum();
            assert_eq!(got, want, "{}", l.name);
        }
        let head = &lg.layers[3];
        let head_mm: f64 =
            head.nodes.iter().filter(|&&n| lg.graph.node(n).op.is(OpKind::MatMul)).map(|&n| lg.node_figures(n).flops).sum();
        assert_eq!(head_mm, 2.0 * s * h * c.vocab as f64);
    }

    #[test]
    fn params_are_counted_once_and_tied_weights_shared() {
        let c = cfg();
        let lg = analyze(gpt(c), &AnalyzeOptions::default()).unwrap();
        let (h, f, v) = (c.hidden as u64, c.ffn as u64, c.vocab as u64);
        let block = 4 * h + 3 * h * h + 3 * h + h * h + h + 2 * h * f + f + h;
        let want = v * h + 2 * block + 2 * h;
        assert_eq!(lg.params, want);
        let per_layer: u64 = lg.layers.iter().map(|l| l.figures.param_elems).sum();
        assert_eq!(per_layer, want);
        let wte = lg.graph.value_by_name("wte.weight").unwrap();
        assert_eq!(lg.layers[0].params, vec![wte]);
        assert_eq!(lg.layers[3].shared_params, vec![wte]);
        assert_eq!(lg.layers[1].figures.param_elems, block);
    }

    #[test]
    fn identical_blocks_share_a_signature_in_every_grouping_mode() {
        let by_ns = analyze(gpt(cfg()), &AnalyzeOptions::default()).unwrap();
        let names: Vec<_> = by_ns.layers.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, vec!["embedding", "m.h.0", "m.h.1", "head"]);
        assert_eq!(by_ns.layers[1].signature, by_ns.layers[2].signature);
        assert_ne!(by_ns.layers[0].signature, by_ns.layers[1].signature);

        let by_names = analyze(gpt(Gpt { namespaces: false, ..cfg() }), &AnalyzeOptions::default()).unwrap();
        let names: Vec<_> = by_names.layers.iter().map(|l| l.name.as_str()).collect();
        assert_eq!(names, vec!["embedding", "h.0", "h.1", "head"]);
        assert_eq!(by_names.layers[1].signature, by_names.layers[2].signature);
        assert_eq!(by_names.layers[1].signature, by_ns.layers[1].signature);

        let structural =
            analyze(gpt(Gpt { namespaces: false, layer_names: false, ..cfg() }), &AnalyzeOptions::default()).unwrap();
        assert_eq!(
            kinds(&structural),
            vec![LayerKind::Embedding, LayerKind::Block, LayerKind::Block, LayerKind::Block, LayerKind::Block, LayerKind::Head]
        );
        let sig: Vec<_> = structural.layers.iter().map(|l| l.signature.as_str()).collect();
        assert_eq!(sig[1], sig[3]);
        assert_eq!(sig[2], sig[4]);
        assert_ne!(sig[1], sig[2]);
    }

    #[test]
    fn layers_are_contiguous_and_cover_every_node() {
        let lg = analyze(gpt(Gpt { batch: None, seq: None, ..cfg() }), &AnalyzeOptions { seq_len: Some(32), ..Default::default() })
            .unwrap();
        let order: Vec<_> = lg.layers.iter().flat_map(|l| l.nodes.iter().copied()).collect();
        assert_eq!(order.len(), lg.graph.node_count());
        let pos: std::collections::HashMap<_, _> = order.iter().enumerate().map(|(i, &n)| (n, i)).collect();
        for &n in &order {
            for p in lg.graph.predecessors(n) {
                assert!(pos[&p] < pos[&n], "layer order is not topological");
            }
        }
        assert_eq!(lg.layers[1].signature, lg.layers[2].signature);
        // The block boundary activation is [seq, hidden] bf16 per sample.
        assert_eq!(lg.layers[1].output_bytes, 32.0 * 256.0 * 2.0);
    }

    #[test]
    fn unbound_sequence_names_the_dim_and_the_fix() {
        let err = analyze(gpt(Gpt { batch: None, seq: None, ..cfg() }), &AnalyzeOptions::default()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("`seq`") && msg.contains("--seq-len"), "{msg}");
        let ok = AnalyzeOptions { dims: [("seq".to_string(), 16)].into(), ..Default::default() };
        assert!(analyze(gpt(Gpt { batch: None, seq: None, ..cfg() }), &ok).is_ok());
    }

    #[test]
    fn seq_len_against_a_fixed_sequence_names_both() {
        let err = analyze(gpt(cfg()), &AnalyzeOptions { seq_len: Some(128), ..Default::default() }).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("128") && msg.contains("64") && msg.contains("input_ids"), "{msg}");
    }

    #[test]
    fn fixed_batch_figures_are_per_sample() {
        let b4 = analyze(gpt(Gpt { batch: Some(4), ..cfg() }), &AnalyzeOptions::default()).unwrap();
        let b1 = analyze(gpt(Gpt { batch: Some(1), ..cfg() }), &AnalyzeOptions::default()).unwrap();
        assert_eq!(b4.dims.graph_batch, 4);
        assert!(b4.dims.fixed_batch);
        assert_eq!(b4.flops_per_sample, b1.flops_per_sample);
        assert_eq!(b4.layers[1].figures.saved_bytes, b1.layers[1].figures.saved_bytes);
    }

    /// What the runner's `scaled_dot_product_attention` keeps: on its fused path (a mask of
    /// rank 2 or 4) q, kᵀ, v, the mask, the output and a logsumexp per head and query row; on
    /// the math path libtorch takes for a rank-3 mask, q, kᵀ, v and the h × s × s probabilities.
    #[test]
    fn fused_attention_keeps_its_output_and_logsumexp_the_math_path_its_probabilities() {
        use crate::passes::testutil::Builder;
        let (h, s, d) = (4i64, 64i64, 8i64);
        let saved = |mask_dims: &[&str]| {
            let mut b = Builder::new();
            let x = b.input("x", DType::F32, &["1", "4", "64", "8"]);
            let mask = b.input("mask", DType::F32, mask_dims);
            let w = b.param("w", DType::F32, &[d, d]);
            let q = b.node(OpKind::MatMul, &[x, w], &[]);
            let kt = b.node(OpKind::Transpose, &[q], &[("perm", ir::Attr::Ints(vec![0, 1, 3, 2]))]);
            let scale = ir::Attr::Tensor(ir::Tensor::from_f64(vec![], &[0.125]));
            let o = b.node(OpKind::ScaledDotProductAttention, &[q, kt, q, mask], &[("scale", scale)]);
            // not the graph's output, which the loss keeps a copy of
            let y = b.node(OpKind::Add, &[o, x], &[]);
            b.output(y);
            let lg = analyze(b.g, &AnalyzeOptions::default()).unwrap();
            let sdpa = lg.graph.node_ids().find(|&n| lg.graph.node(n).op.is(OpKind::ScaledDotProductAttention)).unwrap();
            lg.node_figures(sdpa).saved_bytes
        };
        let (qb, scores) = ((h * s * d * 4) as f64, (h * s * s * 4) as f64);
        // q is also v: kept once
        let fused = 2.0 * qb + (s * s * 4) as f64 + qb + (h * s * 4) as f64;
        assert_eq!(saved(&["1", "1", "64", "64"]), fused);
        assert_eq!(saved(&["64", "64"]), fused);
        assert_eq!(saved(&["1", "64", "64"]), 2.0 * qb + scores);
    }

    /// What libtorch's composite `rms_norm` keeps (the runner's on a CPU): its input, the
    /// normalised copy its product with the scale reads and one f32 statistic per row; a fused
    /// kernel keeps the input and the statistic alone (`ClusterSpec::fused_norms`).
    #[test]
    fn a_composite_rms_norm_keeps_its_normalised_copy_and_a_statistic_per_row() {
        use crate::passes::testutil::Builder;
        let (rows, h) = (64i64, 32i64);
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["1", "64", "32"]);
        let w = b.param("w", DType::F32, &[h]);
        let m = b.param("m", DType::F32, &[h, h]);
        let n = b.node(OpKind::RMSNormalization, &[x, w], &[]);
        let y = b.node(OpKind::MatMul, &[n, m], &[]);
        let z = b.node(OpKind::Add, &[y, x], &[]);
        b.output(z);
        let lg = analyze(b.g, &AnalyzeOptions::default()).unwrap();
        let norm = lg.graph.node_ids().find(|&n| lg.graph.node(n).op.is(OpKind::RMSNormalization)).unwrap();
        let fig = lg.node_figures(norm);
        let copy = (rows * h * 4 + rows * 4) as f64;
        assert_eq!(fig.norm_saved_bytes, copy);
        assert_eq!(fig.saved_bytes, (rows * h * 4) as f64 + copy, "the input and the copy");
    }
}
