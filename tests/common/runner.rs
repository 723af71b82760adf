//! Running `smp-runner` from tests: the command, success checks and its `--json` report.

use std::process::{Command, Output};

/// `smp-runner`, as cargo built it for this test.
pub fn runner() -> Command {
    Command::new(env!("CARGO_BIN_EXE_smp-runner"))
}

/// `r`, after asserting it succeeded (the message names `what` and carries stderr).
pub fn ok(what: &str, r: Output) -> Output {
    assert!(r.status.success(), "{what} failed: {}", String::from_utf8_lossy(&r.stderr));
    r
}

/// The `--json` report a run printed.
pub fn json(r: &Output) -> serde_json::Value {
    serde_json::from_slice(&r.stdout).unwrap_or_else(|e| panic!("bad JSON ({e}): {}", String::from_utf8_lossy(&r.stdout)))
}

/// `key` of every entry of the report's list `list` (e.g. `steps`, `loss`).
pub fn field(report: &serde_json::Value, list: &str, key: &str) -> Vec<f64> {
    report[list].as_array().unwrap_or_else(|| panic!("no `{list}` in {report}")).iter().map(|s| s[key].as_f64().unwrap()).collect()
}

/// Pseudo-random byte-range ids (a fixed LCG).
pub fn random_tokens(n: usize, seed: u64) -> Vec<u16> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((x >> 33) % 256) as u16
        })
        .collect()
}

/// Plans `model` on `cluster` (a `--cluster` spec such as `cpu:2`, sized for this machine by
/// [`super::cluster_arg`]) with the planner flags `args`, writes the plan to `out` and returns
/// that path.
pub fn plan_into(model: &std::path::Path, cluster: &str, args: &[&str], out: &std::path::Path) -> std::path::PathBuf {
    let r = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .arg(model)
        .args(["--cluster", &super::cluster_arg(cluster), "-o"])
        .arg(out)
        .args(args)
        .output()
        .unwrap();
    ok(&format!("planning {}", out.display()), r);
    out.to_path_buf()
}

/// Plans `model` (sequence 16, batch 8, 2 microbatches) at pp × tp × dp 1 with Megatron's
/// split on `cpu:pp·tp`, writes the plan to `out` and returns it parsed.
pub fn plan_megatron(model: &std::path::Path, pp: usize, tp: usize, out: &std::path::Path) -> serde_json::Value {
    let cluster = super::cluster_arg(&format!("cpu:{}", pp * tp));
    let r = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .args([model.to_str().unwrap(), "--cluster", &cluster, "--seq-len", "16"])
        .args(["-o", out.to_str().unwrap(), "--pp", &pp.to_string(), "--tp", &tp.to_string(), "--dp", "1"])
        .args(["--microbatches", "2", "--global-batch", "8", "--baseline", "megatron"])
        .output()
        .unwrap();
    ok(&format!("planning {} pp{pp} tp{tp}", model.display()), r);
    serde_json::from_slice(&std::fs::read(out).unwrap()).unwrap()
}

/// Writes to `out` the bundled GPT-2 with a training-mode Dropout (ratio 0.25) after each
/// attention softmax, and returns `out`.
pub fn gpt2_with_attention_dropout(out: &std::path::Path) -> std::path::PathBuf {
    let repo = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let script = r#"
import sys, onnx
from onnx import helper, TensorProto
m = onnx.load(sys.argv[1])
g = m.graph
nodes = []
for n in g.node:
    nodes.append(n)
    if n.op_type != "Softmax":
        continue
    src, dst = n.output[0], n.output[0] + "_dropped"
    for c in g.node:
        for i, x in enumerate(c.input):
            if x == src:
                c.input[i] = dst
    ratio, train = n.name + "_dropout_ratio", n.name + "_dropout_training"
    g.initializer.append(helper.make_tensor(ratio, TensorProto.FLOAT, [], [0.25]))
    g.initializer.append(helper.make_tensor(train, TensorProto.BOOL, [], [True]))
    nodes.append(helper.make_node("Dropout", [src, ratio, train], [dst], name=n.name + "_dropout"))
del g.node[:]
g.node.extend(nodes)
onnx.checker.check_model(m)
onnx.save(m, sys.argv[2])
print(sum(n.op_type == "Dropout" for n in g.node))
"#;
    let r = Command::new(repo.join(".venv/bin/python")).args(["-c", script]).arg(repo.join("models/gpt2.onnx")).arg(out).output().unwrap();
    let r = ok("inserting Dropout nodes", r);
    assert_eq!(String::from_utf8_lossy(&r.stdout).trim(), "4", "one Dropout per block");
    out.to_path_buf()
}
