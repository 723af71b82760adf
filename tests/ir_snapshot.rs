//! Snapshot of the IR dump of the GPT-2 export after the passes (shapes inferred, shape
//! arithmetic folded where it does not depend on the batch or sequence, dead nodes removed).

use std::path::Path;

use smp_partition::frontend::onnx::load_model;
use smp_partition::passes::{AnalyzeOptions, analyze};

#[test]
fn gpt2_ir_dump_after_analyze() {
    let m = load_model(Path::new("models/gpt2.onnx")).expect("models/gpt2.onnx imports");
    let lg = analyze(m.graph, &AnalyzeOptions { seq_len: Some(16), ..Default::default() }).expect("analyze");
    let mut dump = format!("{}", lg.graph);
    dump.push_str("\nlayers\n");
    for l in &lg.layers {
        dump.push_str(&format!(
            "  {} {} {} nodes, {} params, {} flops, {} saved bytes, signature {}\n",
            l.name,
            l.kind,
            l.nodes.len(),
            l.figures.param_elems,
            l.figures.flops,
            l.figures.saved_bytes,
            l.signature
        ));
    }
    insta::assert_snapshot!("gpt2_ir_dump", dump);
}
