//! Plans say what machine they assumed: a `cpu` plan records the memory, cores and calibration
//! file (with its hash) it was made for, in the file and in `inspect`, whether the facts came
//! from the host or from a cluster file.

use std::path::Path;
use std::process::{Command, Output};

const MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/models/gpt2.onnx");

fn smp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_smp-partition")).args(args).output().unwrap()
}

fn ok(o: Output) -> String {
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

/// Plans GPT-2 on two devices of `cluster`, writing the plan to `out`; returns its JSON.
fn plan(cluster: &str, out: &Path) -> serde_json::Value {
    let text = ok(smp(&[MODEL, "--cluster", cluster, "--seq-len", "16", "--global-batch", "4", "--json", "-o", out.to_str().unwrap()]));
    serde_json::from_str(&text).unwrap()
}

#[test]
fn two_machines_give_plans_that_say_which() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("cal.toml"), "fp32_flops = 80e9\n").unwrap();
    std::fs::write(d.join("small.toml"), "preset = \"cpu\"\n[machine]\nmemory_bytes = 8589934592\ncores = 2\n").unwrap();
    std::fs::write(
        d.join("big.toml"),
        "preset = \"cpu\"\n[machine]\nmemory_bytes = 68719476736\ncores = 16\ncalibration = \"cal.toml\"\n",
    )
    .unwrap();
    let small = plan(&format!("{}:2", d.join("small.toml").display()), &d.join("small.plan.json"));
    let big = plan(&format!("{}:2", d.join("big.toml").display()), &d.join("big.plan.json"));

    let (sm, bm) = (&small["cluster"]["machine"], &big["cluster"]["machine"]);
    assert_eq!((sm["memory_bytes"].as_u64(), sm["cores"].as_u64()), (Some(8 << 30), Some(2)), "{sm}");
    assert_eq!((bm["memory_bytes"].as_u64(), bm["cores"].as_u64()), (Some(64 << 30), Some(16)), "{bm}");
    assert!(sm.get("calibration").is_none(), "{sm}");
    let cal = &bm["calibration"];
    assert!(cal["path"].as_str().unwrap().ends_with("cal.toml"), "{cal}");
    assert_eq!(cal["sha256"].as_str().map(str::len), Some(64), "{cal}");
    assert!(bm["source"]["cluster_file"].as_str().unwrap().ends_with("big.toml"), "{bm}");
    // the calibrated machine is priced by its calibration: the plans differ in their predictions
    assert_ne!(small["predicted"]["step_time_s"], big["predicted"]["step_time_s"]);

    let show = |p: &str| ok(smp(&["inspect", d.join(p).to_str().unwrap()]));
    let (si, bi) = (show("small.plan.json"), show("big.plan.json"));
    let machine_line = |t: &str| t.lines().find(|l| l.starts_with("machine ")).map(str::to_string);
    let (sl, bl) = (machine_line(&si).expect(&si), machine_line(&bi).expect(&bi));
    assert!(sl.contains("8.00 GiB") && sl.contains("2 cores") && sl.contains("uncalibrated") && sl.contains("small.toml"), "{sl}");
    assert!(bl.contains("64.00 GiB") && bl.contains("16 cores") && bl.contains("cal.toml") && bl.contains(&cal["sha256"].as_str().unwrap()[..12]), "{bl}");
}

#[test]
fn the_host_is_recorded_as_the_source_and_gpu_plans_record_no_machine() {
    let dir = tempfile::tempdir().unwrap();
    let host = plan("cpu:2", &dir.path().join("host.plan.json"));
    let m = &host["cluster"]["machine"];
    assert_eq!(m["source"], "host", "{m}");
    assert!(m["memory_bytes"].as_u64().unwrap() > 0 && m["cores"].as_u64().unwrap() > 0, "{m}");
    let gpu = plan("h100-80gb:2", &dir.path().join("gpu.plan.json"));
    assert!(gpu["cluster"].get("machine").is_none(), "{}", gpu["cluster"]);
}

/// Plans GPT-2 at tp 2 on a 2-core `cpu` machine calibrated by `cal` (TOML), with `extra`
/// flags; returns (predicted step time, sequence parallel).
fn tp2_on(d: &Path, name: &str, cal: &str, extra: &[&str]) -> (f64, bool) {
    let rates = "fp32_flops = 6.7e10\nbf16_flops = 6.7e10\nhbm_bandwidth = 2.5e9\nhbm_efficiency = 1.0\n\
                 intra_node_bandwidth = 2.35e9\ninter_node_bandwidth = 2.35e9\nintra_node_latency = 4.7e-5\n\
                 inter_node_latency = 4.7e-5\n[efficiency]\npeak = 0.72\nhalf_flops = 1.7e5\n";
    std::fs::write(d.join(format!("{name}.cal.toml")), format!("{rates}{cal}")).unwrap();
    let cluster = format!("preset = \"cpu\"\n[machine]\nmemory_bytes = 8589934592\ncores = 2\ncalibration = \"{name}.cal.toml\"\n");
    std::fs::write(d.join(format!("{name}.toml")), cluster).unwrap();
    let out = d.join(format!("{name}{}.plan.json", extra.join("")));
    let spec = format!("{}:2", d.join(format!("{name}.toml")).display());
    let mut args = vec![MODEL, "--cluster", &spec, "--pp", "1", "--tp", "2", "--dp", "1", "--microbatches", "1"];
    args.extend(["--seq-len", "16", "--global-batch", "4", "--json", "-o", out.to_str().unwrap()]);
    args.extend(extra);
    let v: serde_json::Value = serde_json::from_str(&ok(smp(&args))).unwrap();
    (v["predicted"]["step_time_s"].as_f64().unwrap(), v["parallel"]["sequence_parallel"].as_bool().unwrap_or(false))
}

#[test]
fn sequence_parallelism_is_chosen_only_where_the_calibrated_collectives_let_it_win() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let links = |ar: (f64, f64), ag: (f64, f64), rs: (f64, f64)| {
        [("all_reduce", ar), ("all_gather", ag), ("reduce_scatter", rs)]
            .iter()
            .map(|(k, (bw, lat))| format!("[collectives.{k}]\nbandwidth = {bw:e}\nlatency = {lat:e}\n"))
            .collect::<String>()
    };
    // Gloo over loopback on a 2-core machine (medians of `smp-runner calibrate`):
    // hundreds of microseconds per call. Sequence parallelism adds collectives per block (an
    // all-gather per row split and per scatter, partial-gradient all-reduces), which lose
    // against its ÷2 norms here.
    let gloo = links((5e8, 2.5e-4), (4e8, 4e-4), (3e8, 4e-4));
    let (auto, sp) = tp2_on(d, "gloo", &gloo, &[]);
    let (forced, _) = tp2_on(d, "gloo", &gloo, &["--sequence-parallel"]);
    let (plain, _) = tp2_on(d, "gloo", &gloo, &["--no-sequence-parallel"]);
    assert!(!sp && auto == plain, "auto {auto} s (sp {sp}), plain {plain} s");
    assert!(forced > plain * 1.2, "sequence parallel {forced} s vs plain {plain} s");
    // With collectives (nearly) free, the same model and compute rates pick it.
    let free = links((1e13, 0.0), (1e13, 0.0), (1e13, 0.0));
    let (auto, sp) = tp2_on(d, "free", &free, &[]);
    let (plain, _) = tp2_on(d, "free", &free, &["--no-sequence-parallel"]);
    assert!(sp && auto < plain, "auto {auto} s (sp {sp}), plain {plain} s");
}
