//! Flags and SMP `--config` → the planner's options: the mapping and every conflict.

use std::path::Path;

use smp_partition::ir::{OffloadRule, Precision, ScheduleKind};
use smp_partition::solve::options::*;
use smp_partition::solve::{Baseline, Optimize, Placement};

fn smp(json: &str) -> SmpConfig {
    SmpConfig::parse(json, Path::new("smp.json")).unwrap()
}

fn smp_err(json: &str) -> ConfigError {
    SmpConfig::parse(json, Path::new("smp.json")).unwrap_err()
}

fn resolve(req: PlanOptions, json: Option<&str>) -> Result<PlanOptions, ConfigError> {
    req.resolve(json.map(smp))
}

fn conflict(req: PlanOptions, json: Option<&str>) -> String {
    let err = resolve(req, json).unwrap_err();
    assert!(matches!(err, ConfigError::Conflict { .. }), "not a conflict: {err}");
    err.to_string()
}

#[test]
fn flag_parsers() {
    assert_eq!(parse_schedule("gpipe"), Ok(ScheduleKind::GPipe));
    assert_eq!(parse_schedule("1f1b"), Ok(ScheduleKind::OneFOneB));
    assert_eq!(parse_schedule("zb-h1"), Ok(ScheduleKind::ZbH1));
    assert_eq!(parse_schedule("interleaved:4"), Ok(ScheduleKind::Interleaved { virtual_stages: 4 }));
    assert!(parse_schedule("interleaved:1").is_err());
    assert!(parse_schedule("interleaved").is_err());
    assert_eq!(ScheduleKind::Interleaved { virtual_stages: 3 }.to_string(), "interleaved:3");
    assert_eq!(parse_checkpointing("none"), Ok(smp_partition::solve::CheckpointRule::Never));
    assert!(parse_checkpointing("some").is_err());
    assert_eq!("cluster".parse::<Placement>(), Ok(Placement::CLUSTER));
    assert_eq!("spread".parse::<Placement>(), Ok(Placement::SPREAD));
    assert_eq!(Placement::CLUSTER.to_string(), "DPT");
    assert_eq!(Placement::SPREAD.to_string(), "TPD");
    assert_eq!("pdt".parse::<Placement>().map(|p| p.to_string()), Ok("PDT".into()));
    for bad in ["DDT", "DP", "DPTX", "xyz"] {
        assert!(bad.parse::<Placement>().is_err(), "{bad}");
    }
    assert_eq!("0-11|12-23".parse::<Layout>(), Ok(Layout(vec![[0, 11], [12, 23]])));
    assert_eq!("0|1-3|4".parse::<Layout>(), Ok(Layout(vec![[0, 0], [1, 3], [4, 4]])));
    let gap = "0-3|5-7".parse::<Layout>().unwrap_err();
    assert!(gap.contains("stage 1") && gap.contains("expected 4"), "{gap}");
    assert!("1-3|4-5".parse::<Layout>().is_err());
    assert!("0-3|3-2".parse::<Layout>().is_err());
    assert!("0-a".parse::<Layout>().is_err());
    assert_eq!(parse_dim("batch=8"), Ok(("batch".into(), 8)));
    assert!(parse_dim("batch").is_err());
    assert!(parse_dim("batch=0").is_err());
    assert!(parse_dim("=3").is_err());
}

#[test]
fn smp_names_map_to_settings() {
    let c = resolve(
        PlanOptions::default(),
        Some(
            r#"{"partitions": 2, "tensor_parallel_degree": 4, "microbatches": 8, "pipeline": "interleaved",
                "placement_strategy": "spread", "optimize": "memory", "active_microbatches": 3,
                "ddp": true, "bf16": true}"#,
        ),
    )
    .unwrap();
    assert_eq!(c.pp, Some(2));
    assert_eq!(c.tp, Some(4));
    assert_eq!(c.microbatches, Some(8));
    // SMP's "interleaved" pipeline is 1F1B, not Megatron's virtual stages.
    assert_eq!(c.schedule, Some(ScheduleKind::OneFOneB));
    assert_eq!(c.placement, Some(Placement::SPREAD));
    assert_eq!(c.optimize, Some(Optimize::Memory));
    assert_eq!(c.active_microbatches, Some(3));
    // `bf16` is a setting now (the training precision); `ddp` still changes nothing
    assert_eq!(c.precision, Some(Precision::Bf16Mixed));
    assert_eq!(c.ignored_config_keys, vec!["ddp".to_string()]);

    let c = resolve(PlanOptions::default(), Some(r#"{"pipeline_parallel_degree": 4, "pipeline": "simple"}"#))
        .unwrap();
    assert_eq!(c.pp, Some(4));
    assert_eq!(c.schedule, Some(ScheduleKind::GPipe));
}

#[test]
fn sharded_dp_implies_zero_3() {
    let c = resolve(PlanOptions::default(), Some(r#"{"sharded_data_parallel_degree": 4}"#)).unwrap();
    assert_eq!(c.sharded_dp, Some(4));
    assert_eq!(c.zero, Some(3));
    let c = resolve(PlanOptions { sharded_dp: Some(2), zero: Some(3), ..Default::default() }, None).unwrap();
    assert_eq!(c.zero, Some(3));
}

#[test]
fn sagemaker_distribution_wrapping_is_accepted() {
    let c = resolve(
        PlanOptions::default(),
        Some(r#"{"smdistributed": {"modelparallel": {"enabled": true, "parameters": {"partitions": 2}}}}"#),
    );
    // `enabled` sits beside `parameters`, which is what is read.
    assert_eq!(c.unwrap().pp, Some(2));
    let c =
        resolve(PlanOptions::default(), Some(r#"{"parameters": {"tensor_parallel_degree": 2}}"#)).unwrap();
    assert_eq!(c.tp, Some(2));
}

#[test]
fn equal_flag_and_config_agree() {
    let c = resolve(PlanOptions { pp: Some(2), ..Default::default() }, Some(r#"{"partitions": 2}"#)).unwrap();
    assert_eq!(c.source(Setting::Pp), Source::Flag("--pp 2".into()));
}

#[test]
fn flag_versus_config_conflicts_name_both() {
    let cases: Vec<(PlanOptions, &str, &str, &str)> = vec![
        (
            PlanOptions { pp: Some(4), ..Default::default() },
            r#"{"pipeline_parallel_degree": 2}"#,
            "--pp 4",
            "pipeline_parallel_degree",
        ),
        (PlanOptions { pp: Some(4), ..Default::default() }, r#"{"partitions": 2}"#, "--pp 4", "partitions"),
        (
            PlanOptions { tp: Some(2), ..Default::default() },
            r#"{"tensor_parallel_degree": 4}"#,
            "--tp 2",
            "tensor_parallel_degree",
        ),
        (
            PlanOptions { sharded_dp: Some(2), ..Default::default() },
            r#"{"sharded_data_parallel_degree": 4}"#,
            "--sharded-dp 2",
            "sharded_data_parallel_degree",
        ),
        (
            PlanOptions { microbatches: Some(2), ..Default::default() },
            r#"{"microbatches": 4}"#,
            "--microbatches 2",
            "microbatches",
        ),
        (
            PlanOptions { schedule: Some(ScheduleKind::ZbH1), ..Default::default() },
            r#"{"pipeline": "simple"}"#,
            "--schedule zb-h1",
            "pipeline",
        ),
        (
            PlanOptions { placement: Some(Placement::CLUSTER), ..Default::default() },
            r#"{"placement_strategy": "spread"}"#,
            "--placement DPT",
            "placement_strategy",
        ),
        (
            PlanOptions { optimize: Some(Optimize::Speed), ..Default::default() },
            r#"{"optimize": "memory"}"#,
            "--optimize speed",
            "optimize",
        ),
        (
            PlanOptions { precision: Some(Precision::F32), ..Default::default() },
            r#"{"bf16": true}"#,
            "--precision f32",
            "bf16",
        ),
        (
            PlanOptions { precision: Some(Precision::Bf16Mixed), ..Default::default() },
            r#"{"fp16": true}"#,
            "--precision bf16-mixed",
            "fp16",
        ),
        (
            PlanOptions { offload: Some(OffloadRule::Never), ..Default::default() },
            r#"{"offload_activations": true}"#,
            "--offload-activations off",
            "offload_activations",
        ),
        (
            PlanOptions { offload: Some(OffloadRule::Always), ..Default::default() },
            r#"{"sm_activation_offloading": false}"#,
            "--offload-activations on",
            "sm_activation_offloading",
        ),
        (
            PlanOptions { offload: Some(OffloadRule::Auto), ..Default::default() },
            r#"{"offload_activations": true}"#,
            "--offload-activations auto",
            "offload_activations",
        ),
        (
            PlanOptions { loading_horizon: Some(2), ..Default::default() },
            r#"{"activation_loading_horizon": 4}"#,
            "--activation-loading-horizon 2",
            "activation_loading_horizon",
        ),
    ];
    for (req, json, flag, key) in cases {
        let msg = conflict(req, Some(json));
        assert!(msg.contains(flag) && msg.contains(key) && msg.contains("smp.json"), "{msg}");
    }
}

#[test]
fn precision_flag_and_config_merge() {
    let c = resolve(PlanOptions { precision: Some(Precision::Fp16Mixed), ..Default::default() }, Some(r#"{"fp16": true}"#)).unwrap();
    assert_eq!(c.precision, Some(Precision::Fp16Mixed));
    let c = resolve(PlanOptions::default(), Some(r#"{"fp16": false, "bf16": false}"#)).unwrap();
    assert_eq!(c.precision, Some(Precision::F32));
    assert!(c.source(Setting::Precision).to_string().contains("smp.json"));
    // no key and no flag: the cluster decides
    let c = resolve(PlanOptions::default(), None).unwrap();
    assert_eq!(c.precision, None);
    let gpu = smp_partition::cost::ClusterSpec::preset("h100-80gb").unwrap();
    assert_eq!(c.precision_for(&gpu), Precision::Bf16Mixed);
}

#[test]
fn offload_flag_and_config_merge() {
    let c = resolve(PlanOptions::default(), Some(r#"{"offload_activations": true, "activation_loading_horizon": 2}"#)).unwrap();
    assert_eq!((c.offload, c.loading_horizon), (Some(OffloadRule::Always), Some(2)));
    assert!(c.source(Setting::Offload).to_string().contains("offload_activations"));
    assert!(c.ignored_config_keys.is_empty());
    let c = resolve(PlanOptions { offload: Some(OffloadRule::Never), ..Default::default() }, Some(r#"{"sm_activation_offloading": false}"#))
        .unwrap();
    assert_eq!(c.offload, Some(OffloadRule::Never));
    // no key and no flag: auto, where the cluster has a host link
    let c = resolve(PlanOptions::default(), None).unwrap();
    let gpu = smp_partition::cost::ClusterSpec::preset("h100-80gb").unwrap();
    assert_eq!(c.offload_for(&gpu), OffloadRule::Auto);
    let no_link = smp_partition::cost::ClusterSpec { host_bandwidth: None, ..gpu.clone() };
    assert_eq!(c.offload_for(&no_link), OffloadRule::Never);
    // forced on without a host link: refused naming the flag, the cluster and the field
    let on = resolve(PlanOptions { offload: Some(OffloadRule::Always), ..Default::default() }, None).unwrap();
    on.check_host_link(&gpu, "h100-80gb:8").unwrap();
    let msg = on.check_host_link(&no_link, "c.toml").unwrap_err().to_string();
    assert!(msg.contains("--offload-activations on") && msg.contains("--cluster c.toml") && msg.contains("host_bandwidth"), "{msg}");
}

#[test]
fn offload_without_checkpointing_is_refused_naming_both() {
    let req = PlanOptions {
        offload: Some(OffloadRule::Always),
        checkpointing: Some(smp_partition::solve::CheckpointRule::Never),
        ..Default::default()
    };
    let msg = conflict(req, None);
    assert!(msg.contains("--offload-activations on") && msg.contains("--checkpointing none"), "{msg}");
    let req = PlanOptions { checkpointing: Some(smp_partition::solve::CheckpointRule::Never), ..Default::default() };
    let msg = conflict(req, Some(r#"{"offload_activations": true}"#));
    assert!(msg.contains("offload_activations") && msg.contains("--checkpointing none"), "{msg}");
    // off (or auto) with no checkpointing is fine: nothing to offload
    let req = PlanOptions { offload: Some(OffloadRule::Never), checkpointing: Some(smp_partition::solve::CheckpointRule::Never), ..Default::default() };
    resolve(req, None).unwrap();
    let e = resolve(PlanOptions { loading_horizon: Some(0), ..Default::default() }, None).unwrap_err().to_string();
    assert!(e.contains("--activation-loading-horizon 0") && e.contains("at least 1"), "{e}");
}

#[test]
fn config_internal_conflict() {
    let err = smp_err(r#"{"partitions": 2, "pipeline_parallel_degree": 3}"#);
    let msg = err.to_string();
    assert!(msg.contains("partitions") && msg.contains("pipeline_parallel_degree"), "{msg}");
}

#[test]
fn unknown_and_bad_config_keys() {
    let err = smp_err(r#"{"pipeline_paralel_degree": 2}"#);
    assert!(matches!(&err, ConfigError::UnknownKey { key, .. } if key == "pipeline_paralel_degree"), "{err}");
    assert!(err.to_string().contains("smp.json") && err.to_string().contains("pipeline_parallel_degree"));
    for bad in [
        r#"{"partitions": 0}"#,
        r#"{"partitions": "2"}"#,
        r#"{"microbatches": -1}"#,
        r#"{"pipeline": "fast"}"#,
        r#"{"placement_strategy": "DDP"}"#,
        r#"{"optimize": 1}"#,
        r#"{"auto_partition": "no"}"#,
        r#"{"default_partition": 1.5}"#,
    ] {
        let err = smp_err(bad);
        assert!(matches!(err, ConfigError::BadValue { .. }), "{bad}: {err}");
        assert!(err.to_string().starts_with("smp.json: `"), "{err}");
    }
    assert!(matches!(smp_err("[1]"), ConfigError::Parse { .. }));
    assert!(matches!(smp_err("{"), ConfigError::Parse { .. }));
    let missing = SmpConfig::load(Path::new("/nonexistent/smp.json")).unwrap_err();
    assert!(
        matches!(missing, ConfigError::Read { .. }) && missing.to_string().contains("/nonexistent/smp.json")
    );
}

#[test]
fn sharded_dp_with_other_zero_conflicts() {
    for zero in [0u8, 1, 2] {
        let msg = conflict(PlanOptions { sharded_dp: Some(2), zero: Some(zero), ..Default::default() }, None);
        assert!(msg.contains("--sharded-dp 2") && msg.contains(&format!("--zero {zero}")), "{msg}");
    }
    let msg = conflict(
        PlanOptions { zero: Some(1), ..Default::default() },
        Some(r#"{"sharded_data_parallel_degree": 2}"#),
    );
    assert!(msg.contains("sharded_data_parallel_degree") && msg.contains("--zero 1"), "{msg}");
    let msg = conflict(PlanOptions { sharded_dp: Some(4), dp: Some(6), ..Default::default() }, None);
    assert!(msg.contains("--sharded-dp 4") && msg.contains("--dp 6"), "{msg}");
}

#[test]
fn layout_sets_or_must_match_pp() {
    let layout: Layout = "0-1|2-3|4-5".parse().unwrap();
    let c = resolve(PlanOptions { layout: Some(layout.clone()), ..Default::default() }, None).unwrap();
    assert_eq!(c.pp, Some(3));
    let msg = conflict(PlanOptions { layout: Some(layout.clone()), pp: Some(2), ..Default::default() }, None);
    assert!(msg.contains("--layout 0-1|2-3|4-5") && msg.contains("--pp 2"), "{msg}");
    let msg = conflict(
        PlanOptions { layout: Some(layout.clone()), ..Default::default() },
        Some(r#"{"partitions": 2}"#),
    );
    assert!(msg.contains("--layout") && msg.contains("partitions"), "{msg}");
    // Interleaved: the layout lists pp·V virtual stages.
    let four: Layout = "0|1|2|3-5".parse().unwrap();
    let c = resolve(
        PlanOptions {
            layout: Some(four.clone()),
            schedule: Some(ScheduleKind::Interleaved { virtual_stages: 2 }),
            ..Default::default()
        },
        None,
    )
    .unwrap();
    assert_eq!(c.pp, Some(2));
    let msg = conflict(
        PlanOptions {
            layout: Some(layout.clone()),
            schedule: Some(ScheduleKind::Interleaved { virtual_stages: 2 }),
            ..Default::default()
        },
        None,
    );
    assert!(msg.contains("--layout") && msg.contains("--schedule interleaved:2"), "{msg}");
    let msg = conflict(
        PlanOptions { layout: Some(layout), baseline: Some(Baseline::Uniform), ..Default::default() },
        None,
    );
    assert!(msg.contains("--layout") && msg.contains("--baseline uniform"), "{msg}");
}

#[test]
fn layout_must_cover_the_model() {
    let c = resolve(PlanOptions { layout: Some("0-1|2-3".parse().unwrap()), ..Default::default() }, None)
        .unwrap();
    c.check_layers(4, "m.onnx").unwrap();
    let err = c.check_layers(6, "m.onnx").unwrap_err().to_string();
    assert!(err.contains("--layout 0-1|2-3") && err.contains("m.onnx (6 layers"), "{err}");
    let c = resolve(PlanOptions { pp: Some(8), ..Default::default() }, None).unwrap();
    let err = c.check_layers(6, "m.onnx").unwrap_err().to_string();
    assert!(err.contains("--pp 8") && err.contains("6 layers"), "{err}");
}

#[test]
fn degrees_against_devices() {
    let c = resolve(PlanOptions { tp: Some(4), pp: Some(4), ..Default::default() }, None).unwrap();
    let err = c.check_devices(8, "h100-80gb:8").unwrap_err().to_string();
    assert!(
        err.contains("--pp 4") && err.contains("--tp 4") && err.contains("--cluster h100-80gb:8"),
        "{err}"
    );
    c.check_devices(16, "h100-80gb:16").unwrap();
    let err = c.check_devices(24, "h100-80gb:24").unwrap_err().to_string();
    assert!(err.contains("does not divide"), "{err}");
    let c =
        resolve(PlanOptions { tp: Some(2), pp: Some(2), dp: Some(1), ..Default::default() }, None).unwrap();
    let err = c.check_devices(8, "cpu:8").unwrap_err().to_string();
    assert!(err.contains("--dp 1") && err.contains("must equal"), "{err}");
    c.check_devices(4, "cpu:4").unwrap();
    let c =
        resolve(PlanOptions { tp: Some(2), ..Default::default() }, Some(r#"{"tensor_parallel_degree": 2}"#))
            .unwrap();
    let err = c.check_devices(1, "cpu:1").unwrap_err().to_string();
    assert!(err.contains("--tp 2") && err.contains("cpu:1"), "{err}");
    let c = resolve(PlanOptions { sharded_dp: Some(8), tp: Some(2), ..Default::default() }, None).unwrap();
    let err = c.check_devices(8, "cpu:8").unwrap_err().to_string();
    assert!(err.contains("--sharded-dp 8") && err.contains("at most 4"), "{err}");
}

#[test]
fn auto_partition_false() {
    let c = resolve(PlanOptions::default(), Some(r#"{"auto_partition": false, "default_partition": 0}"#))
        .unwrap();
    assert_eq!(c.pp, Some(1));
    let msg =
        conflict(PlanOptions { pp: Some(2), ..Default::default() }, Some(r#"{"auto_partition": false}"#));
    assert!(msg.contains("auto_partition") && msg.contains("--pp 2") && msg.contains("--layout"), "{msg}");
    // --layout says otherwise: its cuts are taken.
    let c = resolve(
        PlanOptions { layout: Some("0-1|2-3".parse().unwrap()), ..Default::default() },
        Some(r#"{"auto_partition": false, "default_partition": 1, "partitions": 2}"#),
    )
    .unwrap();
    assert_eq!(c.pp, Some(2));
    let err = resolve(PlanOptions::default(), Some(r#"{"auto_partition": false, "default_partition": 1}"#))
        .unwrap_err();
    assert!(err.to_string().contains("default_partition"), "{err}");
}

#[test]
fn batch_arithmetic() {
    let msg = conflict(PlanOptions { global_batch: Some(10), dp: Some(4), ..Default::default() }, None);
    assert!(msg.contains("--global-batch 10") && msg.contains("--dp 4"), "{msg}");
    let msg = conflict(
        PlanOptions { global_batch: Some(16), dp: Some(2), microbatches: Some(3), ..Default::default() },
        None,
    );
    assert!(msg.contains("--microbatches 3") && msg.contains("--global-batch 16"), "{msg}");
    resolve(
        PlanOptions { global_batch: Some(16), dp: Some(2), microbatches: Some(8), ..Default::default() },
        None,
    )
    .unwrap();
    let msg = conflict(
        PlanOptions { microbatches: Some(2), ..Default::default() },
        Some(r#"{"active_microbatches": 4}"#),
    );
    assert!(msg.contains("active_microbatches") && msg.contains("--microbatches 2"), "{msg}");
    let msg = conflict(
        PlanOptions { pp: Some(1), schedule: Some(ScheduleKind::Interleaved { virtual_stages: 2 }), ..Default::default() },
        None,
    );
    assert!(msg.contains("--pp 1") && msg.contains("interleaved:2"), "{msg}");
}

#[test]
fn out_of_range_flags() {
    for req in [
        PlanOptions { pp: Some(0), ..Default::default() },
        PlanOptions { global_batch: Some(0), ..Default::default() },
        PlanOptions { zero: Some(4), ..Default::default() },
        PlanOptions { memory_limit_gib: Some(-1.0), ..Default::default() },
        PlanOptions { time_limit_s: Some(0.0), ..Default::default() },
    ] {
        let err = resolve(req, None).unwrap_err();
        assert!(matches!(err, ConfigError::Invalid { .. }), "{err}");
    }
    let c = resolve(PlanOptions { memory_limit_gib: Some(1.5), ..Default::default() }, None).unwrap();
    assert_eq!(c.memory_limit_bytes(), Some(3 << 29));
}

#[test]
fn placement_ranks() {
    // cluster = DPT: tensor ranks adjacent, then pipeline, data replicas outermost.
    let dims = [2, 2, 2]; // dp, pp, tp
    assert_eq!(Placement::CLUSTER.stage_ranks(0, dims), vec![0, 1, 4, 5]);
    assert_eq!(Placement::CLUSTER.stage_ranks(1, dims), vec![2, 3, 6, 7]);
    // spread = TPD: data replicas adjacent.
    assert_eq!(Placement::SPREAD.stage_ranks(0, dims), vec![0, 4, 1, 5]);
    // Every placement is a bijection onto 0..8.
    for s in ["DPT", "DTP", "PDT", "PTD", "TDP", "TPD"] {
        let pl: Placement = s.parse().unwrap();
        let mut all: Vec<usize> = (0..2).flat_map(|p| pl.stage_ranks(p, [3, 2, 2])).collect();
        all.sort();
        assert_eq!(all, (0..12).collect::<Vec<_>>(), "{s}");
    }
}
