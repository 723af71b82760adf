//! The plan file: round trip, version check, structural validation, inspect report.

use std::path::Path;

use smp_partition::plan::io::{self, PlanIoError};
use smp_partition::plan::report::{self, Reason};
use smp_partition::ir::ScheduleKind;
use smp_partition::plan::schema::*;

mod common;
use common::{GIB, fixture};
use smp_partition::plan::validate::{PlanInvalid, validate};

#[test]
fn fixture_is_valid() {
    validate(&fixture()).unwrap();
}

#[test]
fn save_load_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plan.json");
    let plan = fixture();
    io::save(&plan, &path).unwrap();
    assert_eq!(io::load(&path).unwrap(), plan);
}

#[test]
fn json_has_the_contract_fields() {
    let v: serde_json::Value = serde_json::from_str(&io::to_json(&fixture())).unwrap();
    for path in [
        "/version",
        "/model/path",
        "/model/sha256",
        "/model/params",
        "/model/layers",
        "/cluster/preset",
        "/cluster/devices",
        "/cluster/devices_per_node",
        "/parallel/pp",
        "/parallel/tp",
        "/parallel/dp",
        "/parallel/zero",
        "/parallel/microbatches",
        "/parallel/schedule",
        "/parallel/virtual_stages",
        "/parallel/checkpointing",
        "/parallel/precision",
        "/parallel/offload_activations",
        "/parallel/activation_loading_horizon",
        "/stages/0/index",
        "/stages/0/pp_rank",
        "/stages/0/layers/1",
        "/stages/0/ranks",
        "/stages/0/forward_s",
        "/stages/0/backward_s",
        "/stages/0/memory_bytes/params",
        "/stages/0/memory_bytes/grads",
        "/stages/0/memory_bytes/optimizer",
        "/stages/0/memory_bytes/activations",
        "/stages/0/memory_bytes/total",
        "/predicted/step_time_s",
        "/predicted/samples_per_s",
        "/predicted/bubble_ratio",
        "/predicted/peak_memory_bytes",
        "/predicted/mfu",
        "/predicted/hfu",
        "/solver/status",
        "/solver/objective",
        "/solver/bound",
        "/solver/gap",
        "/solver/wall_s",
        "/solver/candidates",
    ] {
        assert!(v.pointer(path).is_some(), "missing {path}");
    }
    assert_eq!(v.pointer("/stages/1/layers"), Some(&serde_json::json!([3, 5])));
    assert_eq!(v.pointer("/parallel/precision"), Some(&serde_json::json!("bf16-mixed")));
}

fn with_version(version: serde_json::Value) -> String {
    let mut v = serde_json::to_value(fixture()).unwrap();
    v["version"] = version;
    v.to_string()
}

#[test]
fn newer_version_is_refused_naming_file_and_both_versions() {
    let err = io::from_json(&with_version(7.into()), Path::new("p.json")).unwrap_err();
    assert!(matches!(err, PlanIoError::Version { found: 7, supported: 4, .. }), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("p.json")
            && msg.contains("version 7")
            && msg.contains("version 4")
            && msg.contains("newer"),
        "{msg}"
    );
}

#[test]
fn older_or_missing_version_is_refused() {
    let err = io::from_json(&with_version(0.into()), Path::new("old.json")).unwrap_err();
    assert!(matches!(err, PlanIoError::Version { found: 0, .. }), "{err}");
    let err = io::from_json(&with_version("one".into()), Path::new("odd.json")).unwrap_err();
    assert!(matches!(err, PlanIoError::NoVersion { .. }), "{err}");
    assert!(err.to_string().contains("odd.json"));
    let err = io::from_json("[1, 2]", Path::new("arr.json")).unwrap_err();
    assert!(matches!(err, PlanIoError::NoVersion { .. }), "{err}");
    let err = io::from_json("{", Path::new("cut.json")).unwrap_err();
    assert!(matches!(err, PlanIoError::Parse { .. }), "{err}");
}

#[test]
fn a_plan_written_before_the_recompute_part_reads_with_none() {
    // version 4 before `memory_bytes.recompute`: its activations held the working set
    let mut v = serde_json::to_value(fixture()).unwrap();
    for s in v["stages"].as_array_mut().unwrap() {
        let m = s["memory_bytes"].as_object_mut().unwrap();
        assert_eq!(m.remove("recompute"), Some(0.into()), "the fixture writes the part");
    }
    let plan = io::from_json(&v.to_string(), Path::new("before.json")).unwrap();
    validate(&plan).unwrap();
    assert!(plan.stages.iter().all(|s| s.memory_bytes.recompute == 0 && s.memory_bytes.total == s.memory_bytes.sum_of_parts()));
}

#[test]
fn the_recompute_part_is_in_the_total() {
    let mut plan = fixture();
    let m = &mut plan.stages[0].memory_bytes;
    m.recompute = GIB;
    assert_eq!(m.sum_of_parts(), m.params + m.grads + m.optimizer + m.activations + m.workspace + GIB);
    m.total = m.sum_of_parts();
    let rank = plan.stages[0].pp_rank;
    assert_eq!(plan.rank_memory(rank).recompute, GIB);
    // the peak the plan states must count it too
    let needed = (0..plan.parallel.pp).map(|r| plan.rank_memory(r).total).max().unwrap();
    assert!(matches!(validate(&plan), Err(PlanInvalid::PeakMemory { expected, .. }) if expected == needed));
    plan.predicted.peak_memory_bytes = needed;
    validate(&plan).unwrap();
}

#[test]
fn the_loss_part_and_the_recompute_part_count_once_the_larger() {
    let mut plan = fixture();
    let m = &mut plan.stages[1].memory_bytes;
    let base = m.sum_of_parts();
    // two transients at different moments: the loss's at the loss, the rebuild in a backward
    m.loss = 3 * GIB;
    assert_eq!(m.sum_of_parts(), base + 3 * GIB);
    m.recompute = 2 * GIB;
    assert_eq!(m.sum_of_parts(), base + 3 * GIB);
    m.recompute = 5 * GIB;
    assert_eq!(m.sum_of_parts(), base + 5 * GIB);
    m.total = m.sum_of_parts();
    // a plan written before the part reads with none
    let mut v = serde_json::to_value(fixture()).unwrap();
    for s in v["stages"].as_array_mut().unwrap() {
        assert_eq!(s["memory_bytes"].as_object_mut().unwrap().remove("loss"), Some(0.into()), "the fixture writes the part");
    }
    let before = io::from_json(&v.to_string(), Path::new("before.json")).unwrap();
    validate(&before).unwrap();
    assert!(before.stages.iter().all(|s| s.memory_bytes.loss == 0));
}

#[test]
fn version_1_plan_is_refused_with_the_replan_message() {
    // a plan written before `parallel.precision` (version 1): as this build wrote it then
    let mut v = serde_json::to_value(fixture()).unwrap();
    v["version"] = 1.into();
    v["parallel"].as_object_mut().unwrap().remove("precision");
    let err = io::from_json(&v.to_string(), Path::new("v1.json")).unwrap_err();
    assert!(matches!(err, PlanIoError::Version { found: 1, supported: 4, .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("v1.json") && msg.contains("version 1") && msg.contains("re-plan the model"), "{msg}");
}

#[test]
fn version_2_plan_is_refused_with_the_replan_message() {
    // a plan written before activation offloading (version 2): as this build wrote it then
    let mut v = serde_json::to_value(fixture()).unwrap();
    v["version"] = 2.into();
    let par = v["parallel"].as_object_mut().unwrap();
    par.remove("offload_activations");
    par.remove("activation_loading_horizon");
    let err = io::from_json(&v.to_string(), Path::new("v2.json")).unwrap_err();
    assert!(matches!(err, PlanIoError::Version { found: 2, supported: 4, .. }), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("v2.json") && msg.contains("version 2") && msg.contains("re-plan the model"), "{msg}");
}

#[test]
fn offloading_is_read_and_checked() {
    use smp_partition::ir::OffloadRule;
    for rule in [OffloadRule::Auto, OffloadRule::Never, OffloadRule::Always] {
        let mut plan = fixture();
        plan.parallel.offload = rule;
        plan.parallel.loading_horizon = 2;
        plan.stages[1].offloaded_layers = vec![4];
        plan.stages[1].offloaded_bytes = 1 << 20;
        let text = io::to_json(&plan);
        let back = io::from_json(&text, Path::new("p.json")).unwrap();
        assert_eq!((back.parallel.offload, back.parallel.loading_horizon), (rule, 2));
        assert_eq!((back.stages[1].offloaded_layers.clone(), back.stages[1].offloaded_bytes), (vec![4], 1 << 20));
        validate(&back).unwrap();
    }
    // stages that offload nothing write neither field
    let v = serde_json::to_value(fixture()).unwrap();
    assert!(v["stages"][0].get("offloaded_layers").is_none() && v["stages"][0].get("offloaded_bytes").is_none());
    assert_eq!(v["parallel"]["offload_activations"], "auto");
    assert_eq!(v["parallel"]["activation_loading_horizon"], 4);
    let mut bad = v.clone();
    bad["parallel"]["offload_activations"] = "yes".into();
    let msg = io::from_json(&bad.to_string(), Path::new("p.json")).unwrap_err().to_string();
    assert!(msg.contains("parallel.offload_activations") && msg.contains("auto, on or off"), "{msg}");
    let mut bad = v.clone();
    bad["parallel"]["activation_loading_horizon"] = 0.into();
    let msg = io::from_json(&bad.to_string(), Path::new("p.json")).unwrap_err().to_string();
    assert!(msg.contains("activation_loading_horizon") && msg.contains("at least 1"), "{msg}");
    // offloading only moves what a checkpointed layer keeps
    let mut plan = fixture();
    plan.stages[0].offloaded_layers = vec![1];
    let e = validate(&plan).unwrap_err();
    assert!(matches!(e, PlanInvalid::OffloadNotCheckpointed { stage: 0, layer: 1 }), "{e}");
    assert!(e.to_string().contains("re-plan"), "{e}");
}

#[test]
fn precision_is_read_and_checked() {
    for p in smp_partition::ir::Precision::ALL {
        let mut plan = fixture();
        plan.parallel.precision = p;
        let back = io::from_json(&io::to_json(&plan), Path::new("p.json")).unwrap();
        assert_eq!(back.parallel.precision, p);
    }
    let mut v = serde_json::to_value(fixture()).unwrap();
    v["parallel"]["precision"] = "fp8".into();
    let msg = io::from_json(&v.to_string(), Path::new("p.json")).unwrap_err().to_string();
    assert!(msg.contains("parallel.precision") && msg.contains("fp8") && msg.contains("bf16-mixed"), "{msg}");
    v["parallel"].as_object_mut().unwrap().remove("precision");
    let msg = io::from_json(&v.to_string(), Path::new("p.json")).unwrap_err().to_string();
    assert!(msg.contains("precision"), "{msg}");
}

#[test]
fn unknown_field_is_refused_with_its_name() {
    let mut v = serde_json::to_value(fixture()).unwrap();
    v["stages"][0]["colour"] = "red".into();
    let err = io::from_json(&v.to_string(), Path::new("x.json")).unwrap_err();
    assert!(err.to_string().contains("colour"), "{err}");
}

#[test]
fn unknown_traffic_or_link_is_refused_naming_the_spelling() {
    let v = serde_json::to_value(fixture()).unwrap();
    assert_eq!(v["communication"][0]["kind"], "tensor");
    assert_eq!(v["communication"][0]["link"], "intra-node");
    for (field, bad) in [("kind", "gradients"), ("link", "infiniband")] {
        let mut v = v.clone();
        v["communication"][0][field] = bad.into();
        let err = io::from_json(&v.to_string(), Path::new("traffic.json")).unwrap_err();
        assert!(matches!(err, PlanIoError::Parse { .. }), "{err}");
        assert!(err.to_string().contains(bad) && err.to_string().contains("traffic.json"), "{err}");
    }
}

#[test]
fn load_validates() {
    let mut v = serde_json::to_value(fixture()).unwrap();
    v["stages"][1]["layers"] = serde_json::json!([4, 5]);
    let err = io::from_json(&v.to_string(), Path::new("gap.json")).unwrap_err();
    assert!(
        matches!(
            err,
            PlanIoError::Invalid { cause: PlanInvalid::LayerGap { stage: 1, expected_first: 3, .. }, .. }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("stage 1"), "{err}");
}

fn invalid(edit: impl FnOnce(&mut Plan)) -> PlanInvalid {
    let mut p = fixture();
    edit(&mut p);
    validate(&p).unwrap_err()
}

#[test]
fn validation_errors_name_the_stage() {
    assert_eq!(
        invalid(|p| p.stages[0].layers = [0, 3]),
        PlanInvalid::LayerGap { stage: 1, first: 3, last: 5, expected_first: 4 }
    );
    assert_eq!(
        invalid(|p| p.stages[1].layers = [3, 4]),
        PlanInvalid::LayerCoverage { covered_last: 4, layers: 6 }
    );
    assert_eq!(
        invalid(|p| p.stages[1].layers = [3, 2]),
        PlanInvalid::LayerRange { stage: 1, first: 3, last: 2 }
    );
    assert_eq!(
        invalid(|p| p.stages[1].ranks = vec![2]),
        PlanInvalid::RankCount { stage: 1, found: 1, expected: 2 }
    );
    assert_eq!(
        invalid(|p| p.stages[1].ranks = vec![2, 2]),
        PlanInvalid::RankCount { stage: 1, found: 1, expected: 2 }
    );
    assert_eq!(
        invalid(|p| p.stages[1].ranks = vec![1, 2]),
        PlanInvalid::RankShared { stage: 1, rank: 1, other_pp_rank: 0 }
    );
    assert_eq!(
        invalid(|p| p.stages[1].ranks = vec![2, 4]),
        PlanInvalid::RankRange { stage: 1, rank: 4, world: 4 }
    );
    assert_eq!(
        invalid(|p| p.stages[1].pp_rank = 0),
        PlanInvalid::PpRank { stage: 1, pp_rank: 0, expected: 1 }
    );
    assert_eq!(invalid(|p| p.stages[1].index = 5), PlanInvalid::StageIndex { position: 1, index: 5 });
    assert_eq!(
        invalid(|p| p.stages[0].tp = 1),
        PlanInvalid::StageDegree { stage: 0, field: "tp", found: 1, expected: 2 }
    );
    assert_eq!(
        invalid(|p| p.stages[0].checkpointed_layers = vec![4]),
        PlanInvalid::CheckpointOutside { stage: 0, layer: 4, first: 0, last: 2 }
    );
    let err = invalid(|p| p.stages[1].memory_bytes.total += 1);
    assert!(matches!(err, PlanInvalid::MemorySum { stage: 1, .. }), "{err}");
    assert!(err.to_string().starts_with("stage 1:"), "{err}");
    assert!(matches!(invalid(|p| p.stages[0].forward_s = f64::NAN), PlanInvalid::BadNumber { .. }));
}

#[test]
fn validation_checks_degrees_and_totals() {
    assert_eq!(
        invalid(|p| p.parallel.dp = 2),
        PlanInvalid::TooManyRanks { pp: 2, tp: 2, cp: 1, dp: 2, product: 8, devices: 4 }
    );
    assert!(matches!(invalid(|p| p.parallel.zero = 4), PlanInvalid::Degree { field: "zero", .. }));
    assert!(matches!(
        invalid(|p| p.parallel.microbatches = 0),
        PlanInvalid::Degree { field: "microbatches", .. }
    ));
    assert_eq!(
        invalid(|p| p.parallel.schedule = ScheduleKind::Interleaved { virtual_stages: 2 }),
        PlanInvalid::StageCount { found: 2, pp: 2, v: 2, expected: 4 }
    );
    assert_eq!(invalid(|p| p.stages.clear()), PlanInvalid::NoStages);
    let expected = fixture().predicted.peak_memory_bytes;
    assert_eq!(
        invalid(|p| p.predicted.peak_memory_bytes = 1),
        PlanInvalid::PeakMemory { found: 1, expected, pp_rank: 0 }
    );
}

/// Interleaving: one entry per virtual stage; a pipeline rank's memory is the sum of its entries.
#[test]
fn interleaved_plan_validates_and_sums_memory_per_rank() {
    let mut p = fixture();
    p.parallel.schedule = ScheduleKind::Interleaved { virtual_stages: 2 };
    let base = p.stages[0].clone();
    p.stages = (0..4)
        .map(|i| Stage {
            index: i,
            pp_rank: i % 2,
            layers: [[0, 1], [2, 2], [3, 4], [5, 5]][i],
            ranks: if i % 2 == 0 { vec![0, 1] } else { vec![2, 3] },
            checkpointed_layers: vec![],
            ..base.clone()
        })
        .collect();
    p.predicted.peak_memory_bytes = 2 * base.memory_bytes.total;
    validate(&p).unwrap();
    p.stages[2].ranks = vec![1, 0];
    validate(&p).unwrap();
    p.stages[3].ranks = vec![3, 0];
    assert!(matches!(
        validate(&p).unwrap_err(),
        PlanInvalid::RankShared { stage: 3, rank: 0, .. } | PlanInvalid::VirtualRanks { stage: 3, .. }
    ));
}

#[test]
fn bottleneck_is_the_slowest_rank_and_why() {
    let p = fixture();
    let b = report::bottleneck(&p).unwrap();
    assert_eq!((b.pp_rank, b.reason), (1, Reason::Compute));
    assert!((b.time_s - 0.037).abs() < 1e-12);

    let mut p = fixture();
    p.stages[0].comm_s = 0.5;
    let b = report::bottleneck(&p).unwrap();
    assert_eq!((b.pp_rank, b.reason), (0, Reason::Communication));

    // Stage 1 near its limit and recomputing: memory is why.
    let mut p = fixture();
    p.cluster.memory_limit_bytes = p.stages[1].memory_bytes.total + GIB / 2;
    let b = report::bottleneck(&p).unwrap();
    assert_eq!((b.pp_rank, b.reason), (1, Reason::Memory));
}

#[test]
fn inspect_table_snapshot() {
    insta::assert_snapshot!(report::render(&fixture()));
}

#[test]
fn inspect_json_is_the_plan_plus_findings() {
    let v = report::to_json_with_report(&fixture());
    assert_eq!(v["version"], 4);
    assert_eq!(v["inspect"]["bottleneck"]["pp_rank"], 1);
    assert_eq!(v["inspect"]["bottleneck"]["reason"], "compute");
}

/// Every count the file sets that the runner or the tools allocate from is refused past its
/// bound, naming the field, before anything is allocated (the fuzzer found a plan without a
/// codegen section whose `microbatches` of `usize::MAX` overflowed the schedule's lowering).
#[test]
fn every_count_past_its_bound_is_refused_naming_it() {
    use smp_partition::ir::limits::*;
    let cases: Vec<(&str, Box<dyn Fn(&mut Plan)>)> = vec![
        ("parallel.microbatches = 18446744073709551615", Box::new(|p| p.parallel.microbatches = usize::MAX)),
        ("parallel.microbatches = 3", Box::new(|p| p.parallel.microbatches = 3)),
        ("global_batch = 0", Box::new(|p| p.global_batch = 0)),
        ("global_batch = 4294967296", Box::new(|p| p.global_batch = 1 << 32)),
        ("cluster.devices = 1048577", Box::new(|p| p.cluster.devices = MAX_DEVICES + 1)),
        ("cluster.devices_per_node = 5", Box::new(|p| p.cluster.devices_per_node = 5)),
        ("parallel.active_microbatches = 5", Box::new(|p| p.parallel.active_microbatches = Some(5))),
        ("parallel.sharded_dp = 2", Box::new(|p| p.parallel.sharded_dp = Some(2))),
        ("parallel.activation_loading_horizon = 9", Box::new(|p| p.parallel.loading_horizon = 9)),
        ("model.layers = 1048577", Box::new(|p| {
            p.model.layers = MAX_LAYERS + 1;
            p.stages[1].layers[1] = MAX_LAYERS;
        })),
        ("layer_strategies[].layer = 6", Box::new(|p| p.layer_strategies[0].layer = 6)),
        ("seq_len = 0", Box::new(|p| p.seq_len = Some(0))),
        ("dims.heads = -1", Box::new(|p| {
            p.dims.insert("heads".into(), -1);
        })),
    ];
    for (want, change) in &cases {
        let mut plan = fixture();
        change(&mut plan);
        let msg = validate(&plan).map(|_| "accepted".to_string()).unwrap_or_else(|e| e.to_string());
        assert!(msg.contains(want), "`{want}`: {msg}");
    }
    // the schedule's size: pp·v·m stage-microbatches, even where the batch divides
    let mut plan = fixture();
    plan.global_batch = MAX_STAGE_MICROBATCHES as u64;
    plan.parallel.microbatches = MAX_STAGE_MICROBATCHES;
    let msg = validate(&plan).unwrap_err().to_string();
    assert!(msg.contains("parallel.microbatches = 65536") && msg.contains("2·1·65536"), "{msg}");
    plan.parallel.microbatches = MAX_STAGE_MICROBATCHES / 2;
    validate(&plan).unwrap();
    // a horizon up to a step's backwards, or the default, stands
    let mut plan = fixture();
    plan.parallel.loading_horizon = 8;
    validate(&plan).unwrap_err();
    plan.parallel.loading_horizon = 4;
    validate(&plan).unwrap();
}

/// The planning request a plan records reads back into the planner's options it came from.
#[test]
fn the_planning_request_reads_back_into_its_options() {
    use smp_partition::ir::ScheduleKind;
    use smp_partition::plan::PlanRequest;
    use smp_partition::solve::PlanOptions;
    let options = PlanOptions {
        global_batch: Some(8),
        seq_len: Some(16),
        dims: vec![("heads".into(), 4)],
        pp: Some(2),
        zero: Some(1),
        schedule: Some(ScheduleKind::Interleaved { virtual_stages: 2 }),
        checkpointing: Some(smp_partition::solve::CheckpointRule::Always),
        optimize: Some("memory".parse().unwrap()),
        placement: Some("TPD".parse().unwrap()),
        layout: Some("0-1|2-3|4-4|5-5".parse().unwrap()),
        memory_limit_gib: Some(12.5),
        sequence_parallel: Some(false),
        precision: Some(smp_partition::ir::Precision::Bf16Mixed),
        offload: Some(smp_partition::ir::OffloadRule::Always),
        loading_horizon: Some(2),
        params: smp_partition::compile::ParamOptions { trainable: vec!["*.bias".into()], frozen: vec!["wte".into()] },
        cluster_flag: Some("tests/data/cpu.toml:4".into()),
        ..PlanOptions::default()
    };
    let request = PlanRequest::of(&options, "cpu:4");
    let mut plan = fixture();
    plan.request = Some(request.clone());
    let back = io::from_json(&io::to_json(&plan), Path::new("p.json")).unwrap();
    assert_eq!(back.request.as_ref(), Some(&request));
    assert_eq!(request.options().unwrap(), options);
    assert_eq!(request.cluster_with(2), "tests/data/cpu.toml:2");
    assert_eq!(PlanRequest { cluster: "h100-80gb".into(), ..PlanRequest::default() }.cluster_with(6), "h100-80gb:6");
    let bad = PlanRequest { schedule: Some("ring".into()), ..request };
    assert!(bad.options().unwrap_err().to_string().contains("request.schedule `ring`"));
}
