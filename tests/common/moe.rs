//! Mixture-of-experts models exported through the front door by tests/moe_oracle.py (small
//! Mixtral and Qwen3-MoE at HF's default init, the router's auxiliary loss on), with PyTorch's own
//! training of them, and the steps that plan, launch and compare them: for tests/moe.rs, and for
//! the zoo test's MoE rows.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use super::runner::{json, ok, runner};

/// One exported MoE model with its data and PyTorch's losses.
#[derive(Clone, Debug)]
pub struct MoeCase {
    /// `mixtral`, `qwen3_moe` or `mixtral_clamped`.
    pub name: String,
    /// The front door's export.
    pub onnx: PathBuf,
    /// One global batch of token ids (`.npz`).
    pub data: PathBuf,
    /// Samples and tokens of the batch.
    pub batch: usize,
    /// Tokens per sample.
    pub seq: usize,
    /// PyTorch's 5 f32 step losses, by microbatch count (1 and 2).
    pub losses: BTreeMap<usize, Vec<f64>>,
}

/// The cases, exported once per content of the oracle script and the front door's export code.
pub fn cases() -> &'static [MoeCase] {
    static CASES: OnceLock<Vec<MoeCase>> = OnceLock::new();
    CASES.get_or_init(|| {
        let extra = ["python/smp_partition/_moe.py", "python/smp_partition/export.py", "python/smp_partition/_binaries.py"];
        let dir = super::exports::exported_with("moe_oracle.py", "cases.json", &extra);
        let list: serde_json::Value = serde_json::from_slice(&std::fs::read(dir.join("cases.json")).expect("cases.json")).expect("JSON");
        list.as_array()
            .expect("a list")
            .iter()
            .map(|c| MoeCase {
                name: c["name"].as_str().unwrap().to_string(),
                onnx: PathBuf::from(c["onnx"].as_str().unwrap()),
                data: PathBuf::from(c["data"].as_str().unwrap()),
                batch: c["batch"].as_u64().unwrap() as usize,
                seq: c["seq"].as_u64().unwrap() as usize,
                losses: c["losses"]
                    .as_object()
                    .unwrap()
                    .iter()
                    .map(|(m, l)| (m.parse().unwrap(), l.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()))
                    .collect(),
            })
            .collect()
    })
}

/// The case named `name`.
pub fn case(name: &str) -> &'static MoeCase {
    cases().iter().find(|c| c.name == name).unwrap_or_else(|| panic!("no MoE case `{name}`"))
}

/// Plans `case` on `cpu:pp·tp` at pp × tp × dp 1 with `microbatches` microbatches of the
/// case's batch, Megatron's split forced (so every expert is split at tp > 1), `extra` flags
/// added; writes the plan to `out` and returns it parsed.
pub fn plan(case: &MoeCase, pp: usize, tp: usize, microbatches: usize, extra: &[&str], out: &Path) -> serde_json::Value {
    plan_dp(case, (pp, tp, 1), microbatches, extra, out)
}

/// [`plan`] at pp × tp × dp on `cpu:pp·tp·dp` (each replica `microbatches` microbatches of
/// its share of the batch).
pub fn plan_dp(case: &MoeCase, (pp, tp, dp): (usize, usize, usize), microbatches: usize, extra: &[&str], out: &Path) -> serde_json::Value {
    let cluster = super::cluster_arg(&format!("cpu:{}", pp * tp * dp));
    let r = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .args([case.onnx.to_str().unwrap(), "--cluster", &cluster, "--seq-len", &case.seq.to_string()])
        .args(["--global-batch", &case.batch.to_string(), "--microbatches", &microbatches.to_string()])
        .args(["--pp", &pp.to_string(), "--tp", &tp.to_string(), "--dp", &dp.to_string(), "--baseline", "megatron", "-o", out.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap();
    ok(&format!("planning {} pp{pp} tp{tp} dp{dp}", case.name), r);
    serde_json::from_slice(&std::fs::read(out).unwrap()).unwrap()
}

/// Writes `plan` with expert-parallel degree `ep` to `out` (the planner does not choose ep on
/// its own yet: the degree is set in the plan, which validation checks).
pub fn with_ep(plan: &serde_json::Value, ep: usize, out: &Path) {
    let mut p = plan.clone();
    p["parallel"]["ep"] = serde_json::json!(ep);
    std::fs::write(out, serde_json::to_vec_pretty(&p).unwrap()).unwrap();
}

/// The step losses of `plan` launched on its ranks for 5 steps of the case's batch in `dtype`.
pub fn launch(case: &MoeCase, plan: &Path, nproc: usize, dtype: &str) -> Vec<f64> {
    let r = runner()
        .args(["launch", "--nproc", &nproc.to_string(), plan.to_str().unwrap(), "--data", case.data.to_str().unwrap()])
        .args(["--steps", "5", "--dtype", dtype, "--threads", "1", "--json", "--timeout", "120"])
        .output()
        .unwrap();
    let r = ok(&format!("launching {} ({})", case.name, plan.display()), r);
    super::runner::field(&json(&r), "steps", "loss")
}

/// The step losses of one process training the case 5 steps in `dtype` with `microbatches`.
pub fn one_process(case: &MoeCase, microbatches: usize, dtype: &str) -> Vec<f64> {
    let r = runner()
        .args(["train", case.onnx.to_str().unwrap(), "--data", case.data.to_str().unwrap()])
        .args(["--microbatches", &microbatches.to_string(), "--steps", "5", "--dtype", dtype, "--threads", "1", "--json"])
        .output()
        .unwrap();
    let r = ok(&format!("one process training {}", case.name), r);
    super::runner::field(&json(&r), "steps", "loss")
}

/// The largest relative difference of two loss curves (∞ when their lengths differ).
pub fn max_rel(got: &[f64], want: &[f64]) -> f64 {
    if got.len() != want.len() {
        return f64::INFINITY;
    }
    got.iter().zip(want).map(|(a, b)| (a - b).abs() / b.abs()).fold(0.0, f64::max)
}

/// Plans `case` at pp × tp (2 microbatches), checks its experts are fused (and split at
/// tp > 1), and returns (f32 losses' distance from PyTorch's, f64 losses' distance from one
/// process's).
pub fn check_plan(case: &MoeCase, pp: usize, tp: usize, extra: &[&str]) -> (f64, f64) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.json");
    let p = plan(case, pp, tp, 2, extra, &out);
    let fused = p["codegen"]["fused"].as_array().map_or(0, |f| f.iter().filter(|r| r["op"].get("mixture_of_experts").is_some()).count());
    assert_eq!(fused, 2, "{}: one MixtureOfExperts per block in the plan", case.name);
    if tp > 1 {
        let slices: Vec<&serde_json::Value> = p["codegen"]["shards"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|layer| layer[0]["weight_slices"].as_array().into_iter().flatten())
            .filter(|w| w["initializer"].as_str().is_some_and(|n| n.ends_with("experts.gate_up_proj")))
            .collect();
        assert_eq!(slices.len(), 2, "{}: every block's experts split", case.name);
        for s in slices {
            assert_eq!(s["axis"], 1, "{s}");
            assert_eq!(s["ranges"].as_array().unwrap().len(), 2, "gate and up rows of each expert: {s}");
        }
        // experts with biases: the gate-up bias splits with its rows; the down bias is shared
        // (each rank adds bias / tp) and its gradient all-reduced
        let shards = || p["codegen"]["shards"].as_array().unwrap().iter().map(|layer| &layer[0]);
        let named = |list: &str, key: &str, suffix: &str| shards().flat_map(|s| s[list].as_array().into_iter().flatten().cloned().collect::<Vec<_>>()).filter(|x| x[key].as_str().is_some_and(|n| n.ends_with(suffix))).count();
        let biased = named("weight_slices", "initializer", "experts.gate_up_proj_bias");
        if biased > 0 {
            assert_eq!(biased, 2, "{}: every block's gate-up bias splits", case.name);
            assert_eq!(named("partial_gradients", "value", "experts.down_proj_bias"), 2, "{}: every down bias's gradient is all-reduced", case.name);
            let shared = shards().flat_map(|s| s["rewrites"].as_array().into_iter().flatten().cloned().collect::<Vec<_>>()).filter(|r| r["rewrite"] == "share_expert_bias").count();
            assert_eq!(shared, 2, "{}: every block's down bias is shared", case.name);
        }
    }
    let f32 = launch(case, &out, pp * tp, "f32");
    let f64 = launch(case, &out, pp * tp, "f64");
    (max_rel(&f32, &case.losses[&2]), max_rel(&f64, &one_process(case, 2, "f64")))
}
