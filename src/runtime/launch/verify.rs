//! `smp-runner launch --verify K`: a check to run before a long job. The plan's ranks train K
//! steps in f64 on the user's own data and options, one process trains the same model the same
//! K steps in f64 (`smp-runner train`), and the two are compared: the largest relative
//! difference of the losses, and of every parameter and buffer of the trained weights
//! (norm-relative), each naming its worst tensor. Exact arithmetic makes them equal, so f64
//! leaves only rounding (the zoo measures ≤ 1e-12); anything past [`TOLERANCE`] is a wrong
//! result of the plan, except where the plan itself says why (BatchNorm statistics per
//! microbatch or per replica, which the report then names). One process also trains the K
//! steps in f32: how far its losses land from its f64 ones is the model's own sensitivity to
//! f32 rounding, which the report gives, with a warning where it is past
//! [`F32_SENSITIVE`](crate::runtime::session::report::F32_SENSITIVE) (f32 runs of such a model,
//! a plan's or PyTorch's, differ by about that much: compare them in f64).

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;
use std::path::Path;
use std::process::{Command, Stdio};

use tch::{Kind, Tensor};

use crate::frontend::onnx::load_model;
use crate::ir::RecordKind;
use crate::runtime::RuntimeError;
use crate::runtime::session::report::{VerifyDiff, VerifyReport, losses_of_report};

/// The largest difference, relative, that f64 rounding explains.
pub const TOLERANCE: f64 = 1e-9;

/// Options the check sets itself (with whether they take a value): the user's are dropped.
const OWN_FLAGS: &[(&str, bool)] = &[
    ("--steps", true),
    ("--dtype", true),
    ("--save-weights", true),
    ("--json", false),
    ("--progress", false),
    ("--checkpoint-dir", true),
    ("--checkpoint-every", true),
    ("--keep", true),
    ("--resume", true),
    ("--on-checkpoint-error", true),
    ("--eval-data", true),
    ("--eval-every", true),
    ("--eval-batches", true),
    ("--batch", true),
    ("--microbatches", true),
    ("--seq-len", true),
];

fn verr(m: impl std::fmt::Display) -> RuntimeError {
    RuntimeError::Train(format!("--verify: {m}"))
}

/// `args` without the options the check sets itself.
fn user_args(args: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let own = OWN_FLAGS.iter().find(|(f, _)| a == f || a.starts_with(&format!("{f}=")));
        match own {
            Some((f, true)) if a == f => {
                it.next();
            }
            Some(_) => {}
            None => out.push(a.clone()),
        }
    }
    out
}

/// Runs `exe ARGS`, its stdout captured (one JSON report), its stderr passed on; the losses.
fn run_capturing(exe: &Path, args: &[OsString], what: &str) -> Result<Vec<f64>, RuntimeError> {
    let out = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| verr(format!("cannot start {what}: {e}")))?;
    if !out.status.success() {
        return Err(verr(format!("{what} failed ({}); its messages are above", out.status)));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    losses_of_report(&text).ok_or_else(|| verr(format!("{what} printed no JSON report with losses")))
}

/// The tensors of a safetensors file, as f64 (integer tensors as their values).
fn read_weights(path: &Path) -> Result<BTreeMap<String, Tensor>, RuntimeError> {
    let tensors = Tensor::read_safetensors(path).map_err(|e| verr(format!("cannot read `{}`: {e}", path.display())))?;
    Ok(tensors.into_iter().collect())
}

fn norm_rel(got: &Tensor, want: &Tensor) -> Result<f64, RuntimeError> {
    let g = got.f_to_kind(Kind::Double)?;
    let w = want.f_to_kind(Kind::Double)?;
    let diff = g.f_sub(&w)?.f_norm()?.double_value(&[]);
    let scale = w.f_norm()?.double_value(&[]);
    Ok(if scale > 0.0 { diff / scale } else { diff })
}

/// `names` of `got` against `want` as one vector, norm-relative (a tensor near zero in `want`
/// weighs by its size, not by its own scale).
fn norm_rel_over(names: &BTreeSet<String>, got: &BTreeMap<String, Tensor>, want: &BTreeMap<String, Tensor>) -> Result<f64, RuntimeError> {
    let (mut diff, mut scale) = (0.0, 0.0);
    for name in names {
        let (Some(g), Some(w)) = (got.get(name), want.get(name)) else { continue };
        let w = w.f_to_kind(Kind::Double)?;
        diff += g.f_to_kind(Kind::Double)?.f_sub(&w)?.f_square()?.f_sum(Kind::Double)?.double_value(&[]);
        scale += w.f_square()?.f_sum(Kind::Double)?.double_value(&[]);
    }
    Ok(if scale > 0.0 { (diff / scale).sqrt() } else { diff.sqrt() })
}

/// The worst of `names` (norm-relative) between the plan's weights and one process's.
fn worst_of(names: &BTreeSet<String>, plan: &BTreeMap<String, Tensor>, one: &BTreeMap<String, Tensor>) -> Result<Option<VerifyDiff>, RuntimeError> {
    let mut worst: Option<VerifyDiff> = None;
    for name in names {
        let (Some(g), Some(w)) = (plan.get(name), one.get(name)) else { continue };
        if g.size() != w.size() {
            return Err(verr(format!("`{name}` is {:?} in the plan's weights and {:?} in one process's", g.size(), w.size())));
        }
        let rel = norm_rel(g, w)?;
        if worst.as_ref().is_none_or(|d| rel > d.rel || rel.is_nan()) {
            worst = Some(VerifyDiff { name: name.clone(), rel });
        }
    }
    Ok(worst)
}

/// Runs the check: the plan's `nproc` ranks (`exe launch`) and one process (`exe train`), each
/// `steps` f64 steps with the user's `run_args`, in `work` (created; left for inspection).
pub fn verify(exe: &Path, nproc: usize, plan_path: &Path, run_args: &[String], steps: usize, work: &Path) -> Result<VerifyReport, RuntimeError> {
    let plan = crate::plan::io::load(plan_path).map_err(|e| verr(e.to_string()))?;
    let model = plan.model_file(plan_path);
    std::fs::create_dir_all(work).map_err(|e| verr(format!("cannot create `{}`: {e}", work.display())))?;
    let (plan_weights, one_weights) = (work.join("plan.safetensors"), work.join("one-process.safetensors"));
    let user = user_args(run_args);
    let common = |weights: &Path| -> Vec<OsString> {
        let mut a: Vec<OsString> = user.iter().map(OsString::from).collect();
        a.extend(["--steps".into(), steps.to_string().into(), "--dtype".into(), "f64".into(), "--json".into(), "--save-weights".into(), weights.as_os_str().to_owned()]);
        a
    };

    let mut ranks: Vec<OsString> = vec!["launch".into(), "--nproc".into(), nproc.to_string().into(), plan_path.as_os_str().to_owned()];
    ranks.extend(common(&plan_weights));
    let plan_losses = run_capturing(exe, &ranks, &format!("the plan's {nproc} ranks"))?;

    // one process: the plan's global batch and sequence; its microbatches where BatchNorm
    // statistics depend on them (elsewhere one process computes the same sums in one pass)
    let p = &plan.parallel;
    let microbatches = if plan.batch_statistics.is_some() { p.microbatches * p.dp } else { 1 };
    let mut one: Vec<OsString> = vec!["train".into(), model.as_os_str().to_owned()];
    one.extend(common(&one_weights));
    one.extend(["--batch".into(), plan.global_batch.to_string().into(), "--microbatches".into(), microbatches.to_string().into()]);
    if let Some(s) = plan.seq_len {
        one.extend(["--seq-len".into(), s.to_string().into()]);
    }
    let one_losses = run_capturing(exe, &one, "one process")?;
    // the model's own f32 sensitivity: the same one-process run in f32
    let f32_weights = work.join("one-process-f32.safetensors");
    let mut one32 = one.clone();
    if let Some(at) = one32.iter().position(|a| a == "--dtype") {
        one32[at + 1] = "f32".into();
    }
    if let Some(at) = one32.iter().position(|a| a == "--save-weights") {
        one32[at + 1] = f32_weights.as_os_str().to_owned();
    }
    let f32_losses = run_capturing(exe, &one32, "one process in f32")?;

    let (loss, f32_drift) = (worst_step(&plan_losses, &one_losses), worst_step(&f32_losses, &one_losses));
    if plan_losses.len() != one_losses.len() {
        return Err(verr(format!("the plan ran {} steps, one process {}", plan_losses.len(), one_losses.len())));
    }

    let got = read_weights(&plan_weights)?;
    let want = read_weights(&one_weights)?;
    let missing: Vec<&String> = want.keys().filter(|k| !got.contains_key(*k)).collect();
    if let Some(first) = missing.first() {
        return Err(verr(format!("the plan's trained weights lack `{first}` ({} tensors in all), which one process trained", missing.len())));
    }
    // what is a buffer, by the export's record (the rest are parameters)
    let imported = load_model(&model).map_err(|e| verr(format!("model `{}`: {e}", model.display())))?;
    let graph = &imported.graph;
    let buffers: BTreeSet<String> = graph
        .initializers()
        .filter_map(|v| graph.value(v).record.as_ref())
        .filter(|r| r.kind == RecordKind::Buffer)
        .flat_map(|r| r.params.iter().flatten().cloned())
        .collect();
    let (buffer_names, param_names): (BTreeSet<String>, BTreeSet<String>) = want.keys().cloned().partition(|k| buffers.contains(k));
    let parameters = worst_of(&param_names, &got, &want)?;
    let f32_parameter_drift = Some(VerifyDiff { name: "all parameters together".into(), rel: norm_rel_over(&param_names, &read_weights(&f32_weights)?, &want)? });
    let buffer = worst_of(&buffer_names, &got, &want)?;
    let worst = [&loss, &parameters, &buffer].into_iter().flatten().map(|d| d.rel).fold(0.0, f64::max);
    let explained = plan.batch_statistics_warning();
    let passed = worst <= TOLERANCE;
    Ok(VerifyReport {
        steps,
        tolerance: TOLERANCE,
        plan_losses,
        one_process_losses: one_losses,
        loss,
        parameters,
        buffers: buffer,
        tensors: want.len(),
        passed,
        expected_difference: if passed { None } else { explained },
        f32_drift,
        f32_parameter_drift,
    })
}

/// The step whose loss differs most, relative, between `got` and `want`.
fn worst_step(got: &[f64], want: &[f64]) -> Option<VerifyDiff> {
    let mut worst = None::<VerifyDiff>;
    for (k, (a, b)) in got.iter().zip(want).enumerate() {
        let rel = (a - b).abs() / b.abs().max(f64::MIN_POSITIVE);
        if worst.as_ref().is_none_or(|d| rel > d.rel) {
            worst = Some(VerifyDiff { name: format!("step {}", k + 1), rel });
        }
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_sensitive_to_f32_rounding_is_named_so() {
        let report = |drift: f64| VerifyReport {
            steps: 3,
            tolerance: TOLERANCE,
            plan_losses: vec![1.0; 3],
            one_process_losses: vec![1.0; 3],
            loss: None,
            parameters: None,
            buffers: None,
            tensors: 4,
            passed: true,
            expected_difference: None,
            f32_drift: Some(VerifyDiff { name: "step 3".into(), rel: drift }),
            f32_parameter_drift: Some(VerifyDiff { name: "conv.weight".into(), rel: 0.2 }),
        };
        let sensitive = |drift: f64| report(drift).lines().iter().any(|l| l.contains("sensitive to f32 rounding"));
        assert!(sensitive(0.3) && !sensitive(2e-7));
        assert!(report(0.3).lines().iter().any(|l| l.contains("3.00e-1 (step 3), its weights by 2.00e-1 (conv.weight)")));
    }

    #[test]
    fn the_checks_own_options_are_dropped_from_the_users() {
        let args: Vec<String> = ["--lr", "0.01", "--steps", "100", "--dtype=f32", "--json", "--data", "x.npz", "--checkpoint-dir", "c", "--threads", "1"].map(String::from).to_vec();
        assert_eq!(user_args(&args), ["--lr", "0.01", "--data", "x.npz", "--threads", "1"].map(String::from).to_vec());
    }
}
