//! Mixed-precision plans under every plan kind, through `smp-runner launch`: GPT-2's
//! `bf16-mixed` training under pp 2 (1F1B; GPipe with full recompute; interleaved), tp 2 and
//! dp 2 with ZeRO 3 gives the one-process
//! `bf16-mixed` run's losses within 1e-3 relative; `fp16-mixed` forced to overflow (a huge
//! initial loss scale) skips the same steps with the same scale trajectory under pp 2 (ZB-H1:
//! the weight gradients in their own passes) and dp 2 with ZeRO 2 as in one process, on every
//! rank; a resumed pp 2 × tp 2 run continues bit for bit, and resharded to dp 2 within 1e-3.
#![cfg(feature = "runner")]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::runner::{field, json, ok, plan_into};

const BATCH: &str = "8";

fn model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/gpt2.onnx")
}

/// Plans GPT-2 (sequence 16, global batch 8) in `precision` on `cluster` with `flags`.
fn plan(dir: &Path, name: &str, cluster: &str, precision: &str, flags: &[&str]) -> PathBuf {
    let mut args = vec!["--seq-len", "16", "--global-batch", BATCH, "--precision", precision];
    args.extend_from_slice(flags);
    if flags.windows(2).any(|w| w[0] == "--tp" && w[1] != "1") {
        // Megatron's split, so the matrix products are sliced (the planner replicates them here)
        args.extend_from_slice(&["--baseline", "megatron"]);
    }
    plan_into(&model(), cluster, &args, &dir.join(format!("{name}.json")))
}

/// The `--json` report of `plan` run for `steps` steps on `nproc` processes with `extra` flags.
fn launch(nproc: usize, plan: &Path, steps: usize, extra: &[&str]) -> serde_json::Value {
    let r = Command::new(env!("CARGO_BIN_EXE_smp-runner"))
        .args(["launch", "--nproc", &nproc.to_string()])
        .arg(plan)
        .args(["--steps", &steps.to_string(), "--threads", "1", "--json", "--timeout", "120"])
        .args(extra)
        .output()
        .unwrap();
    json(&ok(&format!("launch of {}", plan.display()), r))
}

fn max_rel(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "step count");
    got.iter().zip(want).map(|(g, w)| ((g - w) / w).abs()).fold(0.0, f64::max)
}

/// Each step's loss scale and whether it was skipped.
fn scaler_trajectory(report: &serde_json::Value) -> Vec<(f64, bool)> {
    report["steps"].as_array().unwrap().iter().map(|s| (s["loss_scale"].as_f64().expect("loss_scale"), s["skipped"].as_bool().unwrap_or(false))).collect()
}

#[test]
fn bf16_mixed_plans_train_as_the_one_process_run() {
    let dir = tempfile::tempdir().unwrap();
    let one = plan(dir.path(), "one", "cpu:1", "bf16-mixed", &["--pp", "1", "--tp", "1", "--dp", "1", "--microbatches", "4"]);
    let want = field(&launch(1, &one, 8, &[]), "steps", "loss");
    // the run computed in bf16: not the f64 verification of the same plan
    let exact = field(&launch(1, &one, 8, &["--dtype", "f64"]), "steps", "loss");
    assert!(max_rel(&want, &exact) > 1e-6, "bf16-mixed losses {want:?} equal the f64 run's");
    for (name, cluster, nproc, flags) in [
        ("pp2", "cpu:2", 2, &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "1f1b", "--microbatches", "4"][..]),
        ("gpipe+recompute", "cpu:2", 2, &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "gpipe", "--microbatches", "4", "--checkpointing", "full"][..]),
        ("interleaved", "cpu:2", 2, &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "interleaved:2", "--microbatches", "4"][..]),
        ("tp2", "cpu:2", 2, &["--pp", "1", "--tp", "2", "--dp", "1", "--microbatches", "4"][..]),
        ("zero3", "cpu:2", 2, &["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "3", "--microbatches", "2"][..]),
    ] {
        let p = plan(dir.path(), name, cluster, "bf16-mixed", flags);
        let got = field(&launch(nproc, &p, 8, &[]), "steps", "loss");
        let worst = max_rel(&got, &want);
        eprintln!("bf16-mixed {name}: max relative loss difference {worst:.2e} from one process");
        assert!(worst <= 1e-3, "bf16-mixed {name}: losses {got:?} vs one process {want:?} ({worst:.2e})");
    }
}

#[test]
fn fp16_overflow_skips_the_same_steps_on_every_rank_as_in_one_process() {
    let dir = tempfile::tempdir().unwrap();
    // 2^20: the first steps overflow, the scale backs off, then grows again after 3 clean steps
    let scale = ["--loss-scale", "1048576", "--loss-scale-window", "3"];
    let one = plan(dir.path(), "one", "cpu:1", "fp16-mixed", &["--pp", "1", "--tp", "1", "--dp", "1", "--microbatches", "4"]);
    let reference = launch(1, &one, 12, &scale);
    let (want, want_scaler) = (field(&reference, "steps", "loss"), scaler_trajectory(&reference));
    let skipped = want_scaler.iter().filter(|(_, s)| *s).count();
    assert!(skipped >= 2 && skipped < want_scaler.len(), "the reference skipped {skipped} of {} steps: {want_scaler:?}", want_scaler.len());
    for (name, cluster, nproc, flags) in [
        ("zbh1", "cpu:2", 2, &["--pp", "2", "--tp", "1", "--dp", "1", "--schedule", "zb-h1", "--microbatches", "4"][..]),
        ("zero2", "cpu:2", 2, &["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "2", "--microbatches", "2"][..]),
    ] {
        let p = plan(dir.path(), name, cluster, "fp16-mixed", flags);
        let report = launch(nproc, &p, 12, &scale);
        assert_eq!(scaler_trajectory(&report), want_scaler, "fp16-mixed {name}: loss scales and skipped steps differ from one process");
        // a rank that updated alone would part its stage's weights from the rest: losses follow
        let got = field(&report, "steps", "loss");
        let worst = max_rel(&got, &want);
        eprintln!("fp16-mixed {name}: {skipped} skipped steps as in one process, max relative loss difference {worst:.2e}");
        assert!(worst <= 1e-3, "fp16-mixed {name}: losses {got:?} vs one process {want:?} ({worst:.2e})");
    }
}

#[test]
fn mixed_precision_resumes_bit_for_bit_and_reshards() {
    let dir = tempfile::tempdir().unwrap();
    // fp16 twice: forced to overflow before the checkpoint (the AdamW step count and the
    // backed-off scale must come back), and with a scale that grows after 4 clean steps (the
    // checkpoint at step 3 must keep the count towards it). Near the overflow boundary another
    // layout of the same sums may overflow where this one does not, so the resharded run is
    // compared where no step overflows.
    let cases: [(&str, &str, &[&str], bool); 3] = [
        ("bf16-mixed", "bf16", &[], true),
        ("fp16-mixed", "fp16-overflow", &["--loss-scale", "16777216", "--loss-scale-window", "3"], false),
        ("fp16-mixed", "fp16-growth", &["--loss-scale", "16384", "--loss-scale-window", "4"], true),
    ];
    for (precision, name, extra, reshard) in cases {
        let p4 = plan(dir.path(), &format!("{name}-pp2tp2"), "cpu:4", precision, &["--pp", "2", "--tp", "2", "--dp", "1", "--schedule", "1f1b", "--microbatches", "4"]);
        let ckpt = dir.path().join(format!("{name}-ckpt"));
        let mut args = extra.to_vec();
        args.extend_from_slice(&["--checkpoint-dir", ckpt.to_str().unwrap(), "--checkpoint-every", "3"]);
        let whole = launch(4, &p4, 6, &args);
        let whole_losses = field(&whole, "steps", "loss");
        let step3 = ckpt.join("step-00000003");
        let mut resume = extra.to_vec();
        resume.extend_from_slice(&["--resume", step3.to_str().unwrap()]);
        let resumed = launch(4, &p4, 6, &resume);
        assert_eq!(field(&resumed, "steps", "loss"), whole_losses[3..].to_vec(), "{name}: the resumed pp2×tp2 run differs from the uninterrupted one");
        if precision == "fp16-mixed" {
            let (before, after) = (scaler_trajectory(&whole), scaler_trajectory(&resumed));
            assert_eq!(after, before[3..].to_vec(), "{name}: the resumed loss scale differs");
            assert!(before[..3].iter().any(|(_, skipped)| *skipped) != reshard, "{name}: {before:?}");
            if reshard {
                assert_ne!(before[4].0, before[0].0, "{name}: the scale did not grow after its window: {before:?}");
            }
        }
        if !reshard {
            eprintln!("{name}: resumed bit for bit");
            continue;
        }
        // resharded onto two data-parallel ranks
        let p2 = plan(dir.path(), &format!("{name}-dp2"), "cpu:2", precision, &["--pp", "1", "--tp", "1", "--dp", "2", "--zero", "1", "--microbatches", "2"]);
        let resharded = launch(2, &p2, 6, &resume);
        if precision == "fp16-mixed" {
            assert_eq!(scaler_trajectory(&resharded), scaler_trajectory(&whole)[3..].to_vec(), "{name}: the resharded run's loss scale differs");
        }
        let resharded = field(&resharded, "steps", "loss");
        let worst = max_rel(&resharded, &whole_losses[3..]);
        eprintln!("{name}: resumed bit for bit; resharded to dp 2 within {worst:.2e}");
        assert!(worst <= 1e-3, "{name}: resharded losses {resharded:?} vs {:?} ({worst:.2e})", &whole_losses[3..]);
    }
}

/// Without a plan, `--precision` trains as a one-device plan of that precision does; it
/// contradicts a plan's precision, or a `--dtype` other than f64, with a refusal naming both.
#[test]
fn precision_without_a_plan_trains_as_the_one_device_plan() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    let train = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_smp-runner"))
            .arg("train")
            .arg(&m)
            .args(["--batch", BATCH, "--seq-len", "16", "--microbatches", "4", "--steps", "4", "--threads", "1", "--json"])
            .args(extra)
            .output()
            .unwrap()
    };
    for precision in ["bf16-mixed", "fp16-mixed"] {
        let one = plan(dir.path(), precision, "cpu:1", precision, &["--pp", "1", "--tp", "1", "--dp", "1", "--microbatches", "4"]);
        let planned = field(&launch(1, &one, 4, &[]), "steps", "loss");
        let plain = field(&json(&ok(precision, train(&["--precision", precision]))), "steps", "loss");
        assert_eq!(plain, planned, "{precision}: train --precision differs from its one-device plan");
        let r = launch_refused(&one, &["--precision", "f32"]);
        assert!(r.contains("--precision f32") && r.contains(precision) && r.contains("re-plan"), "{r}");
    }
    let r = train(&["--precision", "bf16-mixed", "--dtype", "bf16"]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success() && err.contains("--dtype bf16") && err.contains("--precision bf16-mixed"), "{err}");
    let r = train(&["--loss-scale", "8"]);
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(!r.status.success() && err.contains("--loss-scale") && err.contains("f32"), "{err}");
}

/// The stderr of a one-process `run` of `plan` that must fail.
fn launch_refused(plan: &Path, extra: &[&str]) -> String {
    let r = Command::new(env!("CARGO_BIN_EXE_smp-runner")).arg("run").arg(plan).args(["--steps", "1", "--threads", "1"]).args(extra).output().unwrap();
    assert_eq!(r.status.code(), Some(1), "{}", String::from_utf8_lossy(&r.stderr));
    String::from_utf8_lossy(&r.stderr).to_string()
}
