//! Expert parallelism executed by real processes (`smp-runner launch`), on the small Mixtral and
//! Qwen3-MoE of tests/moe_oracle.py (top-2 of 4 experts, the router's auxiliary loss on): the
//! planner's pp/tp/dp plans with `parallel.ep` set to 2 (expert groups of 2 replicas, each
//! holding half the experts, tokens routed to them by all-to-all)
//! - ep 2 × dp 2 trains 5 f64 steps as one process within 1e-9, and 5 f32 steps as PyTorch
//!   trains the module on the same data split (a microbatch per replica) within 1e-5 (also with
//!   DeepSeek-V4's clamped experts);
//! - ep 2 × pp 2, ep 2 × tp 2 (experts also split over their intermediate dim), ep 2 × dp 4 (two
//!   expert groups) and ep 2 under ZeRO 1, 2 and 3 at dp 2 and 4 (dense weights sharded, experts
//!   whole on their ranks) as one process within 1e-9;
//! - a checkpoint written under ep 2 holds whole expert tensors (each rank its experts) and
//!   resumes under ep 1, and one written under ep 1 resumes under ep 2, within 1e-9 of the
//!   uninterrupted run;
//! - bf16-mixed and fp16-mixed plans run under ep 2 within 1e-3 of ep 1 (each expert's rows
//!   gathered from both replicas change only the low-precision matmuls' blocking);
//! - expert groups folded over tensor × data ranks (expert-TP 1) train as one process within
//!   1e-9 (also under pp 2 and ZeRO), their checkpoints resume under the split experts and back,
//!   and a fold with experts split over some tensor ranks is refused at start;
//! - an expert count ep does not divide is refused naming the node.
#![cfg(feature = "runner")]

mod common;

use std::path::{Path, PathBuf};

use common::moe::{self, MoeCase};
use common::runner::{field, json, ok, runner};

/// The planner's plan of `case` at pp × tp × dp (`microbatches` per replica) with ep set, in
/// `dir`.
fn ep_plan(case: &MoeCase, (pp, tp, dp): (usize, usize, usize), microbatches: usize, ep: usize, dir: &Path) -> PathBuf {
    let base = dir.join(format!("{}-pp{pp}-tp{tp}-dp{dp}.json", case.name));
    let p = moe::plan_dp(case, (pp, tp, dp), microbatches, &[], &base);
    assert_eq!(p["parallel"]["dp"], dp, "{}: the plan's dp", case.name);
    let out = dir.join(format!("{}-pp{pp}-tp{tp}-dp{dp}-ep{ep}.json", case.name));
    moe::with_ep(&p, ep, &out);
    out
}

/// The `--json` report of `plan` launched on `nproc` ranks for `steps` steps in `dtype`, with
/// `extra` flags.
fn launch(case: &MoeCase, plan: &Path, nproc: usize, dtype: &str, steps: usize, extra: &[&str]) -> serde_json::Value {
    let r = runner()
        .args(["launch", "--nproc", &nproc.to_string(), plan.to_str().unwrap(), "--data", case.data.to_str().unwrap()])
        .args(["--steps", &steps.to_string(), "--dtype", dtype, "--threads", "1", "--json", "--timeout", "120"])
        .args(extra)
        .output()
        .unwrap();
    json(&ok(&format!("launching {} ({})", case.name, plan.display()), r))
}

/// The step losses of [`launch`] over 5 steps.
fn losses(case: &MoeCase, plan: &Path, nproc: usize, dtype: &str) -> Vec<f64> {
    field(&launch(case, plan, nproc, dtype, 5, &[]), "steps", "loss")
}

fn ep2_dp2(name: &str) {
    let case = moe::case(name);
    let dir = tempfile::tempdir().unwrap();
    // one microbatch per replica: the data split PyTorch's 2-microbatch training sees
    let plan = ep_plan(case, (1, 1, 2), 1, 2, dir.path());
    let f64 = moe::max_rel(&losses(case, &plan, 2, "f64"), &moe::one_process(case, 2, "f64"));
    let f32 = moe::max_rel(&losses(case, &plan, 2, "f32"), &case.losses[&2]);
    eprintln!("{name} ep2 dp2: f64 vs one process {f64:.1e}, f32 vs PyTorch {f32:.1e}");
    assert!(f64 < 1e-9, "{name} ep2 dp2: f64 losses differ from one process's by {f64:.2e}");
    assert!(f32 < 1e-5, "{name} ep2 dp2: f32 losses differ from PyTorch's by {f32:.2e}");
}

#[test]
fn mixtral_ep2_dp2_trains_as_one_process_and_as_pytorch() {
    ep2_dp2("mixtral");
}

/// DeepSeek-V4's clamped experts: each expert's rank applies the clamp to its tokens.
#[test]
fn clamped_experts_ep2_dp2_train_as_one_process_and_as_pytorch() {
    ep2_dp2("mixtral_clamped");
}

/// gpt-oss's experts: each expert's rank adds its biases (sliced with its experts).
#[test]
fn gpt_oss_experts_ep2_dp2_train_as_one_process_and_as_pytorch() {
    ep2_dp2("gpt_oss");
}

#[test]
fn qwen3_moe_ep2_dp2_trains_as_one_process_and_as_pytorch() {
    ep2_dp2("qwen3_moe");
}

#[test]
fn ep2_composes_with_pp2_tp2_and_dp4() {
    let dir = tempfile::tempdir().unwrap();
    // gpt-oss: at tp 2 each expert's rank adds its share of the down bias
    for name in ["mixtral", "qwen3_moe", "gpt_oss"] {
        let case = moe::case(name);
        // (pp, tp, dp), microbatches per replica, and one process's microbatches (same split)
        // dp 4: two expert groups, each expert's gradient summed over the 2 ranks holding it
        for ((pp, tp, dp), m, one) in [((2, 1, 2), 2, 4), ((1, 2, 2), 1, 2), ((1, 1, 4), 1, 4)] {
            let plan = ep_plan(case, (pp, tp, dp), m, 2, dir.path());
            let d = moe::max_rel(&losses(case, &plan, pp * tp * dp, "f64"), &moe::one_process(case, one, "f64"));
            eprintln!("{name} ep2 pp{pp} tp{tp} dp{dp}: f64 vs one process {d:.1e}");
            assert!(d < 1e-9, "{name} ep2 pp{pp} tp{tp} dp{dp}: f64 losses differ from one process's by {d:.2e}");
        }
    }
}

/// Selective recompute of the experts' activations (Megatron-Core's `moe_act`): each
/// mixture of experts frees what its gated activation made after the forward and rebuilds it
/// from the kept gate and up halves before the backward, every expert on one rank (pp 2), the
/// tensor-parallel stage's (tp 2) and under ep 2, for each gate (SwiGLU, DeepSeek-V4's clamped one, gpt-oss's clamped swish).
#[test]
fn experts_activations_rebuilt_in_the_backward_train_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["mixtral", "mixtral_clamped", "gpt_oss"] {
        let case = moe::case(name);
        for ((pp, tp, dp), ep, one) in [((2, 1, 1), 1, 2), ((1, 2, 1), 1, 2), ((1, 1, 2), 2, 2)] {
            let base = dir.path().join(format!("{name}-sel-pp{pp}-tp{tp}-dp{dp}.json"));
            let p = moe::plan_dp(case, (pp, tp, dp), if dp > 1 { 1 } else { 2 }, &["--checkpointing", "selective"], &base);
            // the fused node keeps the name of the node that made its output (`node_<output>`)
            let named: Vec<String> = p["codegen"]["stages"].as_array().unwrap().iter().flat_map(|s| s["selective_nodes"].as_array().into_iter().flatten()).filter_map(|n| n.as_str().map(str::to_string)).collect();
            let experts: Vec<String> = p["codegen"]["fused"].as_array().unwrap().iter().filter(|f| f["op"].get("mixture_of_experts").is_some()).map(|f| format!("node_{}", f["output"].as_str().unwrap())).collect();
            assert!(!experts.is_empty() && experts.iter().all(|e| named.contains(e)), "{name}: every mixture of experts rebuilds its activations: {named:?} against {experts:?}");
            let plan = if ep > 1 {
                let out = dir.path().join(format!("{name}-sel-dp{dp}-ep{ep}.json"));
                moe::with_ep(&p, ep, &out);
                out
            } else {
                base
            };
            let d = moe::max_rel(&losses(case, &plan, pp * tp * dp, "f64"), &moe::one_process(case, one, "f64"));
            eprintln!("{name} selective pp{pp} tp{tp} dp{dp} ep{ep}: f64 vs one process {d:.1e}");
            assert!(d < 1e-9, "{name} selective pp{pp} tp{tp} dp{dp} ep{ep}: f64 losses differ from one process's by {d:.2e}");
        }
    }
}

#[test]
fn ep2_composes_with_zero() {
    let case = moe::case("mixtral");
    let dir = tempfile::tempdir().unwrap();
    for (dp, zero) in [(2, "1"), (2, "2"), (2, "3"), (4, "1"), (4, "3")] {
        let base = dir.path().join(format!("dp{dp}-zero{zero}.json"));
        let p = moe::plan_dp(case, (1, 1, dp), 1, &["--zero", zero], &base);
        assert_eq!(p["parallel"]["zero"].to_string(), zero, "the plan's ZeRO stage");
        let plan = dir.path().join(format!("dp{dp}-zero{zero}-ep2.json"));
        moe::with_ep(&p, 2, &plan);
        let d = moe::max_rel(&losses(case, &plan, dp, "f64"), &moe::one_process(case, dp, "f64"));
        eprintln!("mixtral ep2 dp{dp} ZeRO {zero}: f64 vs one process {d:.1e}");
        assert!(d < 1e-9, "mixtral ep2 dp{dp} ZeRO {zero}: f64 losses differ from one process's by {d:.2e}");
    }
}

#[test]
fn checkpoints_reshard_across_ep() {
    let case = moe::case("mixtral");
    let dir = tempfile::tempdir().unwrap();
    let ep2 = ep_plan(case, (1, 1, 2), 1, 2, dir.path());
    let ep1 = ep_plan(case, (1, 1, 2), 1, 1, dir.path());
    for (from, to, what) in [(&ep2, &ep1, "ep 2 → ep 1"), (&ep1, &ep2, "ep 1 → ep 2")] {
        let ck = dir.path().join(format!("ckpt-{}", what.replace(' ', "").replace('→', "-")));
        let all = launch(case, from, 2, "f64", 5, &["--checkpoint-dir", ck.to_str().unwrap(), "--checkpoint-every", "3"]);
        let all = field(&all, "steps", "loss");
        let step3 = ck.join("step-00000003");
        let m: serde_json::Value = serde_json::from_slice(&std::fs::read(step3.join("manifest.json")).unwrap()).unwrap();
        let gate_up: Vec<&serde_json::Value> = m["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["role"] == "param" && t["name"].as_str().is_some_and(|n| n.contains("layers.0.") && n.ends_with("experts.gate_up_proj")))
            .collect();
        if from == &ep2 {
            // each member of the expert group writes its half of the experts
            let mut held: Vec<String> = gate_up.iter().map(|t| t["experts"].to_string()).collect();
            held.sort();
            assert_eq!(held, vec!["[0,2]", "[2,4]"], "{what}: expert pieces {gate_up:?}");
        } else {
            assert!(gate_up.len() == 1 && gate_up[0].get("experts").is_none(), "{what}: one whole piece {gate_up:?}");
        }
        let tail = field(&launch(case, to, 2, "f64", 5, &["--resume", step3.to_str().unwrap()]), "steps", "loss");
        let d = moe::max_rel(&tail, &all[3..]);
        eprintln!("mixtral {what}: resumed steps 4-5 vs the uninterrupted run {d:.1e}");
        assert!(d < 1e-9, "{what}: resumed losses {tail:?} vs {:?}", &all[3..]);
    }
}

#[test]
fn an_expert_count_ep_does_not_divide_is_refused() {
    let case = moe::case("mixtral");
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("dp3.json");
    let cluster = common::cluster_arg("cpu:3");
    let r = std::process::Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .args([case.onnx.to_str().unwrap(), "--cluster", &cluster, "--seq-len", &case.seq.to_string(), "--global-batch", "3"])
        .args(["--pp", "1", "--tp", "1", "--dp", "3", "--baseline", "megatron", "-o", base.to_str().unwrap()])
        .output()
        .unwrap();
    ok("planning mixtral dp3", r);
    let p: serde_json::Value = serde_json::from_slice(&std::fs::read(&base).unwrap()).unwrap();
    let plan = dir.path().join("dp3-ep3.json");
    moe::with_ep(&p, 3, &plan);
    let r = runner().args(["launch", "--nproc", "3", plan.to_str().unwrap(), "--steps", "1", "--timeout", "60"]).output().unwrap();
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success() && err.contains("4 experts") && err.contains("ep 3") && err.contains("MixtureOfExperts"), "{err}");
}

/// The step losses of `plan` on `nproc` ranks over 5 steps at the plan's own precision.
fn losses_at_plan_precision(case: &MoeCase, plan: &Path, nproc: usize) -> Vec<f64> {
    let r = runner()
        .args(["launch", "--nproc", &nproc.to_string(), plan.to_str().unwrap(), "--data", case.data.to_str().unwrap()])
        .args(["--steps", "5", "--threads", "1", "--json", "--timeout", "120"])
        .output()
        .unwrap();
    field(&json(&ok(&format!("launching {} ({})", case.name, plan.display()), r)), "steps", "loss")
}

/// bf16-mixed and fp16-mixed plans run under ep 2 as under ep 1 (the same dp 2 split and
/// autocast; only where the experts run differs): within 1e-3 relative, and not the f32 run.
#[test]
fn ep2_runs_every_mixed_precision_mode() {
    let case = moe::case("mixtral");
    let dir = tempfile::tempdir().unwrap();
    let full = losses(case, &ep_plan(case, (1, 1, 2), 1, 1, dir.path()), 2, "f32");
    for precision in ["bf16-mixed", "fp16-mixed"] {
        let base = dir.path().join(format!("{precision}.json"));
        let p = moe::plan_dp(case, (1, 1, 2), 1, &["--precision", precision], &base);
        assert_eq!(p["parallel"]["precision"], precision, "the plan's precision");
        let (one, two) = (dir.path().join(format!("{precision}-ep1.json")), dir.path().join(format!("{precision}-ep2.json")));
        moe::with_ep(&p, 1, &one);
        moe::with_ep(&p, 2, &two);
        let (a, b) = (losses_at_plan_precision(case, &one, 2), losses_at_plan_precision(case, &two, 2));
        let d = moe::max_rel(&b, &a);
        let low = moe::max_rel(&a, &full);
        eprintln!("mixtral {precision}: ep 2 vs ep 1 {d:.1e}; ep 1 vs f32 {low:.1e}");
        assert!(d < 1e-3, "mixtral {precision}: ep 2 losses {b:?} vs ep 1 {a:?}");
        assert!(low > 0.0, "mixtral {precision}: the run is the f32 one");
    }
}

/// Expert groups folded over tensor × data ranks (Megatron-Core's layout, expert-TP 1): each
/// tensor rank holds whole experts and routes its own share of the tokens, the outputs gathered
/// back over the tensor group. Planned with `--ep N --etp 1` and run as one process within 1e-9:
/// ep 2 over the 2 tensor ranks (with and without sequence parallelism; gpt-oss's biased
/// experts too), ep 1 (every rank holds every expert, the tokens still shared out), at dp 2
/// ep 4 over all four ranks and ep 2 (two groups, each expert's gradient summed over a tensor
/// rank of each replica), under a pipeline (pp 2) and under ZeRO 1 and 3 (the experts stay out
/// of the blocks).
#[test]
fn folded_expert_groups_train_as_one_process() {
    let dir = tempfile::tempdir().unwrap();
    // (model, (pp, tp, dp), microbatches per replica, ep, extra flags)
    let cases: [(&str, (usize, usize, usize), usize, usize, &[&str]); 9] = [
        ("mixtral", (1, 2, 1), 1, 2, &[]),
        ("mixtral", (1, 2, 1), 1, 2, &["--sequence-parallel"]),
        ("gpt_oss", (1, 2, 1), 1, 2, &[]),
        ("mixtral", (1, 2, 1), 1, 1, &[]),
        ("qwen3_moe", (1, 2, 2), 1, 4, &[]),
        ("mixtral", (1, 2, 2), 1, 2, &["--sequence-parallel"]),
        ("mixtral", (2, 2, 1), 2, 2, &[]),
        ("mixtral", (1, 2, 2), 1, 2, &["--zero", "1"]),
        ("qwen3_moe", (1, 2, 2), 1, 4, &["--zero", "3"]),
    ];
    for (name, (pp, tp, dp), m, ep, extra) in cases {
        let case = moe::case(name);
        let what = format!("{name} folded pp{pp} tp{tp} dp{dp} ep{ep} etp1 {}", extra.join(" "));
        let out = dir.path().join(format!("{}.json", what.replace(' ', "_")));
        let mut args = vec!["--ep".to_string(), ep.to_string(), "--etp".into(), "1".into()];
        args.extend(extra.iter().map(|a| a.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let p = moe::plan_dp(case, (pp, tp, dp), m, &args, &out);
        assert_eq!((&p["parallel"]["ep"], &p["parallel"]["etp"]), (&serde_json::json!(ep), &serde_json::json!(1)), "{}", p["parallel"]);
        let d = moe::max_rel(&losses(case, &out, pp * tp * dp, "f64"), &moe::one_process(case, m * dp, "f64"));
        eprintln!("{what}: f64 vs one process {d:.1e}");
        assert!(d < 1e-9, "{what}: f64 losses differ from one process's by {d:.2e}");
    }
}

/// A checkpoint written by a folded plan (each tensor rank its experts, whole) resumes under the
/// unfolded one at the same degrees (every expert split over the tensor ranks), and the other
/// way, within 1e-9 of the uninterrupted run.
#[test]
fn checkpoints_reshard_between_folded_and_split_experts() {
    let case = moe::case("mixtral");
    let dir = tempfile::tempdir().unwrap();
    let folded = dir.path().join("folded.json");
    let split = dir.path().join("split.json");
    moe::plan_dp(case, (1, 2, 1), 1, &["--ep", "2", "--etp", "1"], &folded);
    moe::plan_dp(case, (1, 2, 1), 1, &[], &split);
    for (from, to, what) in [(&folded, &split, "folded → split"), (&split, &folded, "split → folded")] {
        let ck = dir.path().join(format!("ckpt-{}", what.split(' ').next().unwrap_or("x")));
        let all = field(&launch(case, from, 2, "f64", 5, &["--checkpoint-dir", ck.to_str().unwrap(), "--checkpoint-every", "3"]), "steps", "loss");
        let step3 = ck.join("step-00000003");
        let tail = field(&launch(case, to, 2, "f64", 5, &["--resume", step3.to_str().unwrap()]), "steps", "loss");
        let d = moe::max_rel(&tail, &all[3..]);
        eprintln!("mixtral {what}: resumed steps 4-5 vs the uninterrupted run {d:.1e}");
        assert!(d < 1e-9, "{what}: resumed losses {tail:?} vs {:?}", &all[3..]);
    }
}

/// A folded plan whose experts split over some of the tensor ranks (etp 2 of tp 4) is refused
/// at start, naming the degrees and the fix.
#[test]
fn a_folded_plan_with_experts_split_over_some_tensor_ranks_is_refused_at_start() {
    let case = moe::case("mixtral");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tp4-ep2-etp2.json");
    let p = moe::plan_dp(case, (1, 4, 1), 1, &["--ep", "2", "--etp", "2"], &out);
    assert_eq!(p["parallel"]["etp"], serde_json::json!(2), "{}", p["parallel"]);
    let r = runner()
        .args(["launch", "--nproc", "4", out.to_str().unwrap(), "--data", case.data.to_str().unwrap(), "--steps", "1", "--timeout", "60"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success() && err.contains("(etp 2)") && err.contains("--etp 1 or --etp 4"), "{err}");
}
