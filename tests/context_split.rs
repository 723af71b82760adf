//! The context-parallel split of whole models (`split::context`), checked on the graph:
//! - on every bundled language model (GPT-2, Llama with GQA and rotary tables, BERT, OPT, Phi,
//!   RoBERTa) the only all-gathers are each attention's keys and values (two per layer; RoBERTa
//!   adds two for its position ids, a cumulative sum over the tokens), the
//!   residual stream and the logits are local on the token axis, and the masks every layer
//!   reads are built for the rank's rows (no cut of a whole `seq × seq` tensor is left);
//! - the rewritten graph still infers, with the token axes at `seq / c`;
//! - a sequence that does not cut into 2c chunks is refused naming the value and the fix, and
//!   the planner refuses a context degree for a model that reads no token sequence (ViT).

use std::path::PathBuf;

use smp_partition::split::context::{Boundary, ContextError, Tokens, split_context};
use smp_partition::frontend::onnx::load_model;
use smp_partition::ir::{LayeredGraph, OpKind};
use smp_partition::passes::shape_infer;
use smp_partition::passes::{AnalyzeOptions, analyze};

fn analysed(name: &str, seq: i64) -> LayeredGraph {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models").join(format!("{name}.onnx"));
    let graph = load_model(&path).unwrap_or_else(|e| panic!("{name}: {e}")).graph;
    analyze(graph, &AnalyzeOptions { seq_len: Some(seq), dims: Default::default() }).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn collectives(g: &smp_partition::ir::Graph, op: &str) -> Vec<String> {
    g.node_ids()
        .filter_map(|n| {
            let node = g.node(n);
            (node.op.collective().map(|(k, _)| k.name()) == Some(op)).then(|| node.name.clone())
        })
        .collect()
}

#[test]
fn language_models_gather_only_keys_and_values_and_keep_tokens_local() {
    for name in ["gpt2", "llama", "bert", "opt", "phi", "roberta"] {
        let lg = analysed(name, 32);
        let split = split_context(&lg.graph, &lg.dims, 2, &Boundary::default()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let attention = lg.graph.node_ids().filter(|&n| [OpKind::ScaledDotProductAttention, OpKind::Softmax].iter().any(|&k| lg.graph.node(n).op.is(k))).count();
        let gathers = collectives(&split.graph, "TokenGather");
        assert_eq!(split.gathers, gathers.len(), "{name}");
        // RoBERTa's position ids are a cumulative sum over the tokens: its padding mask is gathered
        let extra = if name == "roberta" { 2 } else { 0 };
        assert!(attention > 0, "{name}: no attention found");
        assert_eq!(gathers.len(), 2 * attention + extra, "{name}: {} all-gathers for {attention} attentions: {gathers:?}", gathers.len());
        // logits: local on the token axis
        let out = lg.graph.outputs[0];
        let t = split.tokens[&lg.graph.value(out).name];
        assert!(matches!(t, Tokens::Local { axis: 1, outer: 1 }), "{name}: logits held as {t:?}");
        // the rewritten graph infers, every cut and gather at the local or whole size
        let info = shape_infer::infer(&split.graph, &lg.dims.values, false).unwrap_or_else(|e| panic!("{name}: rewritten graph: {e}"));
        let logits = info.types[out.index()].as_ref().and_then(|t| t.shape.clone()).expect("logits shape");
        assert_eq!(logits[1], 16, "{name}: logits {logits:?} hold {} tokens, not 32 / 2", logits[1]);
        // no whole seq × seq tensor is cut: masks are built for the rank's rows
        for n in collectives(&split.graph, "TokenLocalize") {
            let node = split.graph.node(split.graph.node_ids().find(|&i| split.graph.node(i).name == n).unwrap());
            let x = node.inputs[0].unwrap();
            let s = info.types[x.index()].as_ref().and_then(|t| t.shape.clone()).unwrap_or_default();
            assert!(s.iter().filter(|&&d| d == 32).count() < 2, "{name}: `{n}` cuts a whole {s:?}");
        }
        eprintln!("{name}: {} all-gathers, {} cuts: {gathers:?}", split.gathers, split.localizes);
    }
}

#[test]
fn a_sequence_that_does_not_cut_into_2c_chunks_is_refused_with_the_fix() {
    let lg = analysed("gpt2", 12);
    let Err(e) = split_context(&lg.graph, &lg.dims, 4, &Boundary::default()) else { panic!("cp 4 over 12 tokens was accepted") };
    assert!(matches!(e, ContextError::Indivisible { len: 12, cp: 4, chunks: 8, .. }), "{e}");
    let text = e.to_string();
    assert!(text.contains("input_ids") && text.contains("divisible by 8") && text.contains("--cp"), "{text}");
}

/// A model with a second token sequence of its own fixed length (decoder ids beside the input
/// ids), written by onnx's helpers.
fn two_sequences(dir: &std::path::Path) -> PathBuf {
    let script = r#"
import sys, numpy as np, onnx
from onnx import helper, TensorProto, numpy_helper
V, H = 32, 8
rng = np.random.default_rng(0)
inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n) for n, s in [("embed", (V, H)), ("dec_embed", (V, H)), ("head", (H, V))]]
inits.append(numpy_helper.from_array(np.array([1], dtype=np.int64), "axes"))
nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["h"]),
         helper.make_node("Gather", ["dec_embed", "decoder_ids"], ["d"]),
         helper.make_node("ReduceMean", ["d", "axes"], ["dm"], keepdims=1),
         helper.make_node("Add", ["h", "dm"], ["x"]),
         helper.make_node("MatMul", ["x", "head"], ["logits"])]
g = helper.make_graph(nodes, "two_sequences",
    [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
     helper.make_tensor_value_info("decoder_ids", TensorProto.INT64, ["batch", 12])],
    [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", V])], inits)
onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), sys.argv[1])
"#;
    let path = dir.join("two.onnx");
    let python = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python");
    let st = std::process::Command::new(python).args(["-c", script]).arg(&path).status().expect("python (run `make venv`)");
    assert!(st.success());
    path
}

/// A context-parallel refusal is the planner's: `smp-partition` builds each rank's stage
/// subgraphs under cp when it plans, so a token sequence the split cannot cut into 2c chunks
/// (here a second one, of 12 tokens, beside the 16 the options check) is refused there, naming
/// the value and the fix, not by every rank of the runner at start-up.
#[test]
fn a_context_refusal_is_reported_by_the_planner_naming_the_value_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let model = two_sequences(dir.path());
    let plan = |cp: &str, devices: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_smp-partition"))
            .arg(&model)
            .args(["--cluster", devices, "--cp", cp, "--pp", "1", "--tp", "1", "--dp", "1", "--seq-len", "16", "--global-batch", "8", "--json"])
            .output()
            .unwrap()
    };
    let r = plan("4", "cpu:4");
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success(), "a 12-token sequence was planned at cp 4");
    assert!(err.contains("context parallelism 4") && err.contains("`decoder_ids` has 12 tokens") && err.contains("divisible by 8") && err.contains("--cp"), "{err}");
    // 12 tokens cut into 2·2 chunks
    let r = plan("2", "cpu:2");
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
}

#[test]
fn a_model_without_a_token_sequence_is_refused_a_context_degree() {
    let vit = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/vit.onnx");
    let r = std::process::Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .arg(&vit)
        .args(["--cluster", "cpu:2", "--cp", "2", "--pp", "1", "--tp", "1", "--dp", "1", "--global-batch", "8", "--json"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success(), "ViT was planned at cp 2");
    assert!(err.contains("--cp 2") && err.contains("no token sequence") && err.contains("drop --cp"), "{err}");
}
