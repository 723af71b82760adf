//! Plans written as engine configurations and read back (`smp_partition::engines`): the round
//! trip gives the same plan (degrees, cuts, recompute, schedule, microbatches, step within
//! 0.1 %) on the bundled large models for Megatron-LM, torchtitan and DeepSpeed; what an engine
//! cannot express is named and priced and the configuration written is the nearest plan it can
//! run; configurations the engines refuse are refused naming the engine's check; and Megatron-LM
//! arguments for Llama 3 405B on 8,192 H100s price the published run.
//!
//! The engines' own parsers and validators check the same configurations in
//! tests/engines/test_engine_validators.py (`make test`, in `.venv-engines`).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use smp_partition::compile::{Analysed, analyze_for};
use smp_partition::cost::ClusterSpec;
use smp_partition::engines::{self, Engine, ModelShape, Origin, checkpointed};
use smp_partition::ir::{ExpertDispatch, LayerKind, Placement, Precision, ScheduleKind};
use smp_partition::plan::Plan;
use smp_partition::solve::PlanOptions;

fn model(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join(name)
}

fn analyse(name: &str) -> Analysed {
    analyze_for(&model(name), &PlanOptions::default()).unwrap_or_else(|e| panic!("{name}: {e:#}"))
}

fn compile(a: &Analysed, cluster: &ClusterSpec, opts: &PlanOptions) -> Plan {
    smp_partition::compile(a, cluster, opts).unwrap_or_else(|e| panic!("{}: {:#}", a.model.path, anyhow_chain(&e)))
}

fn anyhow_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        s.push_str(&format!(": {c}"));
        src = c.source();
    }
    s
}

/// Blocks recomputed per stage, and whether any other layer is (Megatron says recompute as a
/// count per stage; which blocks of a stage a plan names is the decoding's choice and costs the
/// same, the blocks being identical).
fn recompute_counts(p: &Plan, kinds: &[LayerKind]) -> (Vec<usize>, bool) {
    let set = checkpointed(p);
    let mut stages: Vec<_> = p.stages.iter().collect();
    stages.sort_by_key(|s| s.index);
    let counts = stages.iter().map(|s| (s.layers[0]..=s.layers[1]).filter(|l| set.contains(l)).count()).collect();
    (counts, set.iter().any(|&l| kinds[l] != LayerKind::Block))
}

/// The round trip holds: `back` (read from the configuration of `sent`) is `sent`. Returns the
/// relative difference of their predicted steps.
fn assert_same(engine: Engine, what: &str, sent: &Plan, back: &Plan, kinds: &[LayerKind]) -> f64 {
    let (a, b) = (&sent.parallel, &back.parallel);
    let ctx = format!("{engine} round trip of {what}");
    assert_eq!((a.pp, a.tp, a.dp, a.cp, a.ep), (b.pp, b.tp, b.dp, b.cp, b.ep), "{ctx}: degrees");
    assert_eq!((a.zero, a.sharded_dp), (b.zero, b.sharded_dp), "{ctx}: ZeRO");
    assert_eq!(a.schedule, b.schedule, "{ctx}: schedule");
    assert_eq!((a.microbatches, sent.global_batch), (b.microbatches, back.global_batch), "{ctx}: batch");
    assert_eq!(a.sequence_parallel, b.sequence_parallel, "{ctx}: sequence parallelism");
    assert_eq!(a.precision, b.precision, "{ctx}: precision");
    assert!(engines::same_ranks(a.placement, b.placement, a), "{ctx}: rank order {} against {}", a.placement, b.placement);
    let cuts = |p: &Plan| {
        let mut s: Vec<_> = p.stages.iter().map(|s| (s.index, s.layers)).collect();
        s.sort();
        s
    };
    assert_eq!(cuts(sent), cuts(back), "{ctx}: cuts");
    assert_eq!(recompute_counts(sent, kinds), recompute_counts(back, kinds), "{ctx}: recompute per stage");
    let off = |p: &Plan| p.stages.iter().map(|s| s.offloaded_layers.len()).sum::<usize>();
    assert_eq!(off(sent), off(back), "{ctx}: offloaded layers");
    let (x, y) = (sent.predicted.step_time_s, back.predicted.step_time_s);
    assert!((y / x - 1.0).abs() <= 1e-3, "{ctx}: step {y} s read back against {x} s");
    (y / x - 1.0).abs()
}

/// Emits `plan` for `engine`, reads every written form back, compiles it and compares.
fn round_trip(engine: Engine, what: &str, plan: &Plan, a: &Analysed, cluster: &ClusterSpec, extra: &dyn Fn(&mut PlanOptions)) -> (engines::Emission, f64) {
    let e = engines::emit(engine, plan, a, cluster).unwrap_or_else(|err| panic!("{engine} emit of {what}: {}", anyhow_chain(&err)));
    let sent = e.nearest.as_ref().unwrap_or(plan);
    let shape = ModelShape::of(&a.lg);
    let kinds: Vec<LayerKind> = a.lg.layers.iter().map(|l| l.kind).collect();
    let file = &e.written.files[0];
    let mut forms = vec![(file.name.clone(), file.text.clone())];
    if engine == Engine::Torchtitan {
        forms.push(("command line".into(), e.written.launch.clone()));
    }
    if engine == Engine::Megatron {
        forms.push(("launch line".into(), e.written.launch.replace("$(cat megatron.args)", &file.text.replace('\n', " "))));
    }
    let mut worst: f64 = 0.0;
    for (form, text) in forms {
        let origin = Origin { what: PathBuf::from(&form) };
        let (reading, world) = engines::read(engine, &text, origin, &shape, Some(cluster.devices)).unwrap_or_else(|err| panic!("{engine} read of {what} ({form}): {err}\n{text}"));
        assert_eq!(world, cluster.devices, "{engine} {what} ({form}): device count");
        // a difference the emission named without a price (DeepSpeed's Ulysses for context
        // parallelism) is named again when read
        let named = e.gaps.iter().filter(|g| g.gap.change.is_none()).count();
        assert_eq!(reading.unpriced.len(), named, "{engine} {what} ({form}): unpriced settings in an emitted configuration: {:?}", reading.unpriced);
        let mut opts = reading.options.clone();
        opts.dims = plan.dims.iter().map(|(k, v)| (k.clone(), *v)).collect();
        opts.memory_limit_gib = Some(sent.cluster.memory_limit_bytes as f64 / (1u64 << 30) as f64);
        extra(&mut opts);
        let opts = opts.resolve(None).unwrap_or_else(|err| panic!("{engine} {what} ({form}): {err}"));
        let back = compile(a, cluster, &opts);
        worst = worst.max(assert_same(engine, &format!("{what} ({form})"), sent, &back, &kinds));
    }
    (e, worst)
}

/// Requests covering what the engines express: the automatic plan, interleaving, uneven
/// cuts, recompute (full and per stage), ZeRO stages, context and expert parallelism, fp16.
/// One of each kind: Llama 3 70B's automatic search (15 s) and a second interleaved plan on
/// Llama 3 405B (34 s) exercised nothing the others do not.
fn requests(name: &str) -> Vec<(&'static str, PlanOptions)> {
    let base = PlanOptions { global_batch: Some(512), ..PlanOptions::default() };
    let mut out = if name == "llama3-70b.onnx" { vec![] } else { vec![("automatic", base.clone())] };
    match name {
        "llama3-8b.onnx" => {
            out.push(("pp 2 tp 4 zero 1 fp16", PlanOptions { pp: Some(2), tp: Some(4), zero: Some(1), precision: Some(Precision::Fp16Mixed), ..base.clone() }));
            out.push(("tp 8 cp 2 zero 3", PlanOptions { pp: Some(1), tp: Some(8), cp: Some(2), zero: Some(3), ..base.clone() }));
            out.push(("pp 2 tp 4 selective recompute", PlanOptions { pp: Some(2), tp: Some(4), checkpointing: Some(smp_partition::solve::CheckpointRule::Selective), ..base.clone() }));
        }
        "llama3-70b.onnx" => {
            out.push((
                "pp 4 interleaved:2 full recompute",
                PlanOptions { pp: Some(4), tp: Some(8), schedule: Some(ScheduleKind::Interleaved { virtual_stages: 2 }), checkpointing: Some(smp_partition::solve::CheckpointRule::Always), ..base.clone() },
            ));
            out.push(("pp 8 tp 4 1f1b", PlanOptions { pp: Some(8), tp: Some(4), schedule: Some(ScheduleKind::OneFOneB), placement: Some(Placement::SPREAD), ..base.clone() }));
        }
        "gpt3-175b.onnx" => {
            out.push(("pp 8 tp 8 1f1b zero 1", PlanOptions { pp: Some(8), tp: Some(8), zero: Some(1), schedule: Some(ScheduleKind::OneFOneB), ..base.clone() }));
        }
        "mixtral-8x7b.onnx" => {
            out.push(("pp 2 ep 8 zero 1", PlanOptions { pp: Some(2), tp: Some(1), ep: Some(8), zero: Some(1), schedule: Some(ScheduleKind::OneFOneB), ..base.clone() }));
        }
        _ => {}
    }
    out
}

fn cluster_for(name: &str) -> ClusterSpec {
    let devices = match name {
        "llama3-405b.onnx" => 2048,
        "llama3-8b.onnx" => 64,
        _ => 512,
    };
    ClusterSpec::parse(&format!("h100-80gb:{devices}")).expect("preset")
}

#[test]
fn round_trips_on_the_bundled_large_models() {
    let mut lines = Vec::new();
    let mut worst: f64 = 0.0;
    for name in ["llama3-8b.onnx", "llama3-70b.onnx", "llama3-405b.onnx", "gpt3-175b.onnx", "mixtral-8x7b.onnx"] {
        let a = analyse(name);
        let cluster = cluster_for(name);
        for (what, req) in requests(name) {
            let start = std::time::Instant::now();
            let plan = compile(&a, &cluster, &req);
            for engine in [Engine::Megatron, Engine::Torchtitan, Engine::DeepSpeed] {
                let (e, delta) = round_trip(engine, &format!("{name} {what}"), &plan, &a, &cluster, &|_| {});
                worst = worst.max(delta);
                lines.push(format!("{name} {what} → {engine}: {} gap(s), {:.3} s against {:.3} s", e.gaps.len(), e.step_s(), e.plan_step_s));
            }
            lines.push(format!("{name} {what}: planned and read back in {:.1} s", start.elapsed().as_secs_f64()));
        }
    }
    for l in &lines {
        eprintln!("{l}");
    }
    eprintln!("largest difference of a step read back: {:.2e} (relative)", worst);
}

#[test]
fn what_an_engine_cannot_express_is_priced_and_the_nearest_plan_is_written() {
    let a = analyse("llama3-70b.onnx");
    let cluster = ClusterSpec::parse("h100-80gb:512").expect("preset");
    let req = PlanOptions { global_batch: Some(512), pp: Some(4), tp: Some(8), schedule: Some(ScheduleKind::ZbH1), ..PlanOptions::default() };
    let plan = compile(&a, &cluster, &req);
    let e = engines::emit(Engine::Torchtitan, &plan, &a, &cluster).expect("emit");
    let lines = e.gap_lines();
    let zb = lines.iter().find(|l| l.contains("cannot express ZB-H1")).unwrap_or_else(|| panic!("{lines:?}"));
    assert!(zb.contains("nearest: 1F1B, predicted") && zb.contains("against the plan's"), "{zb}");
    let nearest = e.nearest.as_ref().expect("a nearest plan");
    assert_eq!(nearest.parallel.schedule, ScheduleKind::OneFOneB);
    // priced as the planner prices 1F1B with the same cuts
    let fixed = PlanOptions { schedule: Some(ScheduleKind::OneFOneB), ..engines::exact_request(&plan) };
    let direct = compile(&a, &cluster, &fixed);
    let alone = e.gaps.iter().find(|g| g.gap.field == engines::PlanField::Schedule).and_then(|g| g.step_s).expect("priced");
    assert!((alone / direct.predicted.step_time_s - 1.0).abs() < 1e-9, "{alone} against {}", direct.predicted.step_time_s);
    // the configuration says 1F1B
    assert!(e.written.files[0].text.contains("pipeline_parallel_schedule = \"1F1B\""), "{}", e.written.files[0].text);
    // and the engine can express the whole nearest plan
    let shape = ModelShape::of(&a.lg);
    assert!(engines::gaps(Engine::Torchtitan, nearest, &shape).expect("gaps").iter().all(|g| g.change.is_none()));
}

#[test]
fn megatron_recompute_per_stage_is_a_count_and_one_by_one_is_a_gap() {
    let a = analyse("llama3-70b.onnx");
    let shape = ModelShape::of(&a.lg);
    let cluster = ClusterSpec::parse("h100-80gb:512").expect("preset");
    let n = a.lg.layers.len();
    // blocks 1..=3 of the first stage only: Megatron recomputes a count per stage
    let set: BTreeSet<usize> = [1, 2, 3].into_iter().collect();
    let req = PlanOptions { global_batch: Some(512), pp: Some(4), tp: Some(8), schedule: Some(ScheduleKind::OneFOneB), checkpointed_layers: Some(set.clone()), ..PlanOptions::default() };
    let plan = compile(&a, &cluster, &req);
    assert_eq!(checkpointed(&plan), set, "the planner recomputes exactly the layers asked");
    let e = engines::emit(Engine::Megatron, &plan, &a, &cluster).expect("emit");
    let g = e.gaps.iter().find(|g| g.gap.field == engines::PlanField::Recompute).expect("a recompute gap");
    assert!(g.gap.nearest.contains("--recompute-method block --recompute-num-layers 3"), "{}", g.gap);
    let nearest = e.nearest.as_ref().expect("nearest");
    let (counts, other) = recompute_counts(nearest, &a.lg.layers.iter().map(|l| l.kind).collect::<Vec<_>>());
    assert_eq!(counts, vec![3; 4]);
    assert!(!other);
    assert!(e.written.files[0].text.contains("--recompute-num-layers 3"));
    assert!(engines::gaps(Engine::Megatron, nearest, &shape).expect("gaps").is_empty());
    assert!(n > 80);
}

fn read_err(engine: Engine, text: &str, shape: &ModelShape, devices: usize) -> String {
    match engines::read(engine, text, Origin { what: PathBuf::from("test") }, shape, Some(devices)) {
        Ok((r, _)) => panic!("{engine} accepted {text}: {:?}", r.options),
        Err(e) => e.to_string(),
    }
}

#[test]
fn configurations_the_engines_refuse_are_refused_naming_their_check() {
    let a = analyse("llama3-8b.onnx");
    let shape = ModelShape::of(&a.lg);
    let m = read_err(Engine::Megatron, "--tensor-model-parallel-size 3 --pipeline-model-parallel-size 2 --num-layers 32", &shape, 64);
    assert!(m.contains("initialize_model_parallel") && m.contains("world_size (64) is not divisible"), "{m}");
    let m = read_err(Engine::Megatron, "--pipeline-model-parallel-size 3 --num-layers 32", &shape, 48);
    assert!(m.contains("should be divisible by pipeline_model_parallel_size"), "{m}");
    let m = read_err(Engine::Megatron, "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout 'Et*15|t*16L'", &shape, 8);
    assert!(m.contains("PipelineParallelLayerLayout") && m.contains("must match num_layers 32"), "{m}");
    let m = read_err(Engine::Megatron, "--micro-batch-size 3 --global-batch-size 64", &shape, 8);
    assert!(m.contains("num_microbatches_calculator"), "{m}");
    let m = read_err(Engine::Megatron, "--num-layers 40", &shape, 8);
    assert!(m.contains("--num-layers 40") && m.contains("32 transformer blocks"), "{m}");
    let m = read_err(Engine::Torchtitan, "[parallelism]\ndata_parallel_shard_degree = 3\ntensor_parallel_degree = 2\n", &shape, 8);
    assert!(m.contains("ParallelDims") && m.contains("!= WORLD_SIZE(8)"), "{m}");
    let m = read_err(Engine::Torchtitan, "[parallelism]\npipeline_parallel_degree = 2\npipeline_parallel_schedule = \"Interleaved1F1B\"\nmodule_fqns_per_model_part = [[\"tok_embeddings\", \"layers.0\"], [\"layers.1\"]]\n", &shape, 8);
    assert!(m.contains("pipeline module split"), "{m}");
    let m = read_err(Engine::DeepSpeed, r#"{"train_batch_size": 100, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 4}"#, &shape, 8);
    assert!(m.contains("_batch_assertion"), "{m}");
    let m = read_err(Engine::DeepSpeed, r#"{"train_batch_size": 64, "zero_optimization": {"stage": 3}, "pipeline": {"stages": 2}}"#, &shape, 8);
    assert!(m.contains("ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"), "{m}");
    let m = read_err(Engine::DeepSpeed, r#"{"train_batch_size": 64, "bf16": {"enabled": true}, "fp16": {"enabled": true}}"#, &shape, 8);
    assert!(m.contains("cannot be simultaneously enabled"), "{m}");
}

#[test]
fn settings_the_planner_cannot_price_are_named() {
    let a = analyse("llama3-8b.onnx");
    let shape = ModelShape::of(&a.lg);
    let text = "--tensor-model-parallel-size 8 --recompute-granularity selective --cp-comm-type p2p --context-parallel-size 2 --seq-length 8192 --some-new-flag 3 --lr 1e-4 --overlap-param-gather --overlap-grad-reduce";
    let (r, _) = engines::read(Engine::Megatron, text, Origin { what: PathBuf::from("args") }, &shape, Some(64)).expect("read");
    let named: Vec<&str> = r.unpriced.iter().map(|u| u.setting.as_str()).collect();
    assert!(named.iter().any(|s| s.contains("selective")), "{named:?}");
    assert!(named.iter().any(|s| s.contains("--cp-comm-type p2p")), "{named:?}");
    assert!(named.iter().any(|s| s.contains("--some-new-flag 3")), "{named:?}");
    // an overlap the planner does not price is priced exposed, and said so; the gradients'
    // reduction beside the backward is priced
    let overlap = r.unpriced.iter().find(|u| u.setting == "--overlap-param-gather").expect("--overlap-param-gather named");
    assert!(overlap.why.contains("priced exposed"), "{}", overlap.why);
    assert_eq!(r.options.grad_overlap, Some(true));
    assert!(!named.iter().any(|s| s.contains("--overlap-grad-reduce")), "{named:?}");
    assert!(r.no_effect.iter().any(|s| s == "--lr 1e-4"), "{:?}", r.no_effect);
    // DeepSpeed's 16-bit masters change the model state's bytes; its loss scaling nothing priced
    let ds = r#"{"train_batch_size": 64, "bf16": {"enabled": true, "bf16_master_weights_and_grads": true, "check_grad_overflow": false}, "zero_optimization": {"stage": 2}}"#;
    let (r, _) = engines::read(Engine::DeepSpeed, ds, Origin { what: PathBuf::from("ds_config.json") }, &shape, Some(64)).expect("read");
    assert!(r.unpriced.iter().any(|u| u.setting.starts_with("bf16.bf16_master_weights_and_grads")), "{:?}", r.unpriced);
    assert!(r.no_effect.iter().any(|s| s.starts_with("bf16.check_grad_overflow")), "{:?}", r.no_effect);
}

/// torchtitan before 0.3 reads a job TOML whose selective mode (its default) checkpoints every
/// Nth block a rank builds (`selective_ac_option`, "2" by default), counted over the rank's
/// model parts: read as exactly those layers recomputed; per-op selective is named.
#[test]
fn torchtitan_layer_selective_checkpointing_is_every_nth_block_per_rank() {
    let a = analyse("llama3-8b.onnx");
    let shape = ModelShape::of(&a.lg);
    let blocks: Vec<usize> = (0..shape.kinds.len()).filter(|&l| shape.is_block(l)).collect();
    let read = |extra: &str| {
        let text = format!("[training]\nlocal_batch_size = 8\nseq_len = 8192\n[parallelism]\ndata_parallel_shard_degree = -1\n{extra}");
        engines::read(Engine::Torchtitan, &text, Origin { what: PathBuf::from("job.toml") }, &shape, Some(8)).expect("read").0
    };
    let set = |r: &engines::Reading| r.options.checkpointed_layers.clone().expect("a recompute set");
    // no mode: selective, every second block
    let r = read("");
    assert_eq!(set(&r), blocks.iter().skip(1).step_by(2).copied().collect::<BTreeSet<_>>());
    assert!(r.unpriced.is_empty(), "{:?}", r.unpriced);
    let r = read("[activation_checkpoint]\nmode = \"selective\"\nselective_ac_option = \"3\"\n");
    assert_eq!(set(&r), blocks.iter().skip(2).step_by(3).copied().collect::<BTreeSet<_>>());
    let r = read("[activation_checkpoint]\nmode = \"selective\"\nselective_ac_option = \"0\"\n");
    assert_eq!(set(&r), blocks.iter().copied().collect::<BTreeSet<_>>());
    // per op: every block by the per-op policy, priced
    let r = read("[activation_checkpoint]\nmode = \"selective\"\nselective_ac_option = \"op\"\n");
    assert!(set(&r).is_empty() && r.unpriced.is_empty(), "{:?}", r.unpriced);
    assert_eq!(r.options.selective_layers, Some(blocks.iter().copied().collect::<BTreeSet<_>>()));
    assert_eq!(r.options.selective_policy, Some(smp_partition::ir::SelectivePolicy::Ops));
    // two stages a rank under interleaving: each rank counts its own blocks, stage after stage
    let r = read("pipeline_parallel_degree = 2\npipeline_parallel_schedule = \"Interleaved1F1B\"\n[activation_checkpoint]\nmode = \"selective\"\n");
    let layout = r.options.layout.clone().expect("a layout");
    assert_eq!(layout.0.len(), 4);
    let mut want = BTreeSet::new();
    for rank in 0..2 {
        let mine: Vec<usize> = layout.0.iter().enumerate().filter(|(s, _)| s % 2 == rank).flat_map(|(_, [f, l])| (*f..=*l).filter(|x| blocks.contains(x))).collect();
        want.extend(mine.iter().skip(1).step_by(2).copied());
    }
    assert_eq!(set(&r), want);
}

/// torchtitan's per-op selective checkpointing, planned for every block, is written back as its
/// `mode = "selective"` with `selective_ac_option = "op"` (0.3's selective mode, with no option,
/// on the command line); to Megatron-LM, which has no per-op policy, it is a gap.
#[test]
fn torchtitan_per_op_checkpointing_is_written_back() {
    let a = analyse("llama3-8b.onnx");
    let cluster = cluster_for("llama3-8b.onnx");
    let req = PlanOptions {
        global_batch: Some(64),
        pp: Some(1),
        tp: Some(1),
        checkpointing: Some(smp_partition::solve::CheckpointRule::Selective),
        selective_policy: Some(smp_partition::ir::SelectivePolicy::Ops),
        ..PlanOptions::default()
    };
    let plan = compile(&a, &cluster, &req);
    assert_eq!(plan.parallel.selective_policy, smp_partition::ir::SelectivePolicy::Ops);
    let e = engines::emit(Engine::Torchtitan, &plan, &a, &cluster).expect("emit");
    assert!(!e.gaps.iter().any(|g| g.gap.field == engines::PlanField::Recompute), "{:?}", e.gaps);
    let toml = &e.written.files[0].text;
    assert!(toml.contains("mode = \"selective\"") && toml.contains("selective_ac_option = \"op\""), "{toml}");
    assert!(e.written.launch.contains("activation-checkpoint:selective") && !e.written.launch.contains("selective-ac-option"), "{}", e.written.launch);
    let m = engines::emit(Engine::Megatron, &plan, &a, &cluster).expect("emit");
    let gap = m.gaps.iter().find(|g| g.gap.field == engines::PlanField::Recompute).expect("a recompute gap");
    assert!(gap.gap.chose.contains("per-op policy"), "{}", gap.gap.chose);
    let text = smp_partition::plan::report::render(&plan);
    assert!(text.contains("checkpointing selective (per op)") && text.contains("torchtitan's per-op policy"), "{text}");
    // layers fixed one by one with none recomputed read as none, though Megatron's baseline
    // takes full recompute for its rule
    let none = PlanOptions {
        checkpointing: None,
        selective_policy: None,
        checkpointed_layers: Some(BTreeSet::new()),
        baseline: Some(smp_partition::solve::Baseline::Megatron),
        memory_limit_gib: Some(1e6),
        ..req
    };
    let plan = compile(&a, &cluster, &none);
    assert_eq!(plan.parallel.checkpointing, smp_partition::solve::CheckpointRule::Always);
    let text = smp_partition::plan::report::render(&plan);
    assert!(text.contains("checkpointing none,"), "{text}");
}

/// Megatron's output-discarding recompute of the norms (and the experts' activation) is the
/// planner's selective recompute: read as `--checkpointing selective`; in a mixture of experts
/// the norms alone are named as not what it prices (it rebuilds the experts' activation too); a
/// selective plan is written back as those modules.
#[test]
fn megatron_norm_recompute_is_selective_recompute() {
    let a = analyse("llama3-8b.onnx");
    let shape = ModelShape::of(&a.lg);
    let read = |text: &str| engines::read(Engine::Megatron, text, Origin { what: PathBuf::from("args") }, &shape, Some(64)).expect("read").0;
    let r = read("--tensor-model-parallel-size 8 --recompute-granularity selective --recompute-modules layernorm --seq-length 8192");
    assert_eq!(r.options.checkpointing, Some(smp_partition::solve::CheckpointRule::Selective));
    assert!(r.unpriced.is_empty(), "{:?}", r.unpriced);
    let r = read("--tensor-model-parallel-size 8 --recompute-granularity selective --recompute-modules layernorm moe_act --seq-length 8192");
    assert_eq!(r.options.checkpointing, Some(smp_partition::solve::CheckpointRule::Selective));
    assert!(r.unpriced.is_empty(), "{:?}", r.unpriced);
    let moe = ModelShape::of(&analyse("mixtral-8x7b.onnx").lg);
    let read_moe = |text: &str| engines::read(Engine::Megatron, text, Origin { what: PathBuf::from("args") }, &moe, Some(64)).expect("read").0;
    let r = read_moe("--tensor-model-parallel-size 8 --recompute-granularity selective --recompute-modules layernorm moe_act --seq-length 4096");
    assert!(r.unpriced.is_empty() && r.options.checkpointing == Some(smp_partition::solve::CheckpointRule::Selective), "{:?}", r.unpriced);
    let r = read_moe("--tensor-model-parallel-size 8 --recompute-granularity selective --recompute-modules layernorm --seq-length 4096");
    assert_eq!(r.unpriced.iter().map(|u| u.setting.as_str()).collect::<Vec<_>>(), ["--recompute-modules layernorm"]);
    // its fused cross-entropy is named as priced unfused, not as unknown
    let r = read("--tensor-model-parallel-size 8 --seq-length 8192 --cross-entropy-loss-fusion");
    assert!(r.unpriced.iter().any(|u| u.setting == "--cross-entropy-loss-fusion" && u.why.contains("fused cross-entropy")), "{:?}", r.unpriced);
    // core attention (Megatron's default module) is not what the planner rebuilds
    let r = read("--tensor-model-parallel-size 8 --recompute-granularity selective --recompute-modules core_attn layernorm --seq-length 8192");
    assert_eq!(r.options.checkpointing, None);
    assert!(r.unpriced.iter().any(|u| u.setting.contains("core_attn layernorm")), "{:?}", r.unpriced);
    let cluster = cluster_for("llama3-8b.onnx");
    let req = PlanOptions {
        global_batch: Some(512),
        pp: Some(2),
        tp: Some(4),
        schedule: Some(ScheduleKind::OneFOneB),
        checkpointing: Some(smp_partition::solve::CheckpointRule::Selective),
        ..PlanOptions::default()
    };
    let plan = compile(&a, &cluster, &req);
    assert!(plan.stages.iter().all(|s| !s.selective_layers.is_empty() && s.checkpointed_layers.is_empty()), "every stage selective");
    let e = engines::emit(Engine::Megatron, &plan, &a, &cluster).expect("emit");
    assert!(e.gaps.is_empty(), "{:?}", e.gaps);
    assert!(e.written.files[0].text.contains("--recompute-granularity selective --recompute-modules layernorm\n"), "{}", e.written.files[0].text);
}

/// Llama 3 405B pre-training as a team writes it for Megatron-LM (Llama Team 2024, Table 4):
/// 8,192 H100s, TP 8, PP 16 interleaved, DP 64, sequence 8,192, 16 M tokens per batch, no
/// recompute, the first and last stage one layer lighter (the embedding and the loss counted as
/// layers). Priced within 10 % of the published 43 % MFU, with the automatic plan beside it.
#[test]
fn llama3_405b_megatron_arguments_price_the_published_run() {
    let a = analyze_for(&model("llama3-405b.onnx"), &PlanOptions { seq_len: Some(8192), ..PlanOptions::default() }).expect("analyse");
    let shape = ModelShape::of(&a.lg);
    let args = "torchrun --nnodes 1024 --nproc-per-node 8 pretrain_gpt.py \
        --num-layers 126 --hidden-size 16384 --ffn-hidden-size 53248 --num-attention-heads 128 \
        --group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 \
        --position-embedding-type rope --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights \
        --tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 16 \
        --num-virtual-stages-per-pipeline-rank 2 \
        --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split \
        --micro-batch-size 1 --global-batch-size 2048 --use-distributed-optimizer --bf16";
    let (reading, world) = engines::read(Engine::Megatron, args, Origin { what: PathBuf::from("llama3-405b.args") }, &shape, None).expect("read");
    assert_eq!(world, 8192);
    assert!(reading.unpriced.is_empty(), "{:?}", reading.unpriced);
    let cluster = ClusterSpec::parse("h100-80gb:8192").expect("preset");
    // Megatron-LM's mixed precision as its run kept it: a bf16 model beside fp32 masters
    let recipe = Some(smp_partition::ir::MixedRecipe::LowModel);
    let opts = PlanOptions { mixed_recipe: recipe, ..reading.options.clone() }.resolve(None).expect("resolve");
    let (yours, over) = engines::price(Engine::Megatron, &a, &cluster, &opts).expect("price");
    let p = &yours.parallel;
    assert_eq!((p.tp, p.pp, p.dp, p.schedule, p.microbatches), (8, 16, 64, ScheduleKind::Interleaved { virtual_stages: 2 }, 32));
    // first and last (virtual) stage one layer lighter: 3 blocks beside the embedding and the loss
    let mut stages: Vec<_> = yours.stages.iter().collect();
    stages.sort_by_key(|s| s.index);
    let blocks = |s: &smp_partition::plan::schema::Stage| (s.layers[0]..=s.layers[1]).filter(|&l| a.lg.layers[l].kind == LayerKind::Block).count();
    assert_eq!((blocks(stages[0]), blocks(stages[1]), blocks(stages[31])), (3, 4, 3));
    assert!(checkpointed(&yours).is_empty(), "no recompute");
    let mfu = yours.predicted.mfu;
    let auto = PlanOptions { global_batch: Some(2048), seq_len: Some(8192), precision: opts.precision, mixed_recipe: recipe, time_limit_s: Some(120.0), ..PlanOptions::default() };
    let ours = compile(&a, &cluster, &auto);
    let columns = [
        engines::Column { title: "yours (Megatron-LM arguments)".into(), plan: &yours, over_memory: over },
        engines::Column { title: "ours (searched)".into(), plan: &ours, over_memory: None },
    ];
    eprintln!("{}", engines::side_by_side(&columns));
    eprintln!("{}; {}", engines::summary("yours", &yours), engines::summary("ours", &ours));
    eprintln!("llama3-405b from Megatron-LM arguments: MFU {mfu:.3}, {:.3} of the published 0.43", mfu / 0.43);
    assert!((mfu / 0.43 - 1.0).abs() <= 0.10, "predicted MFU {mfu:.3} against the published 0.43");
}

/// Qwen3-235B-A22B as Megatron-Core's MoE model zoo ran it on 256 H100s
/// (yanring/Megatron-MoE-ModelZoo, `best_practice/Qwen3/readme.md`: bf16, sequence 4,096, global
/// batch 2,048, microbatch 1): TP 4, PP 8 with VPP 4, EP 8, ETP 1, no recompute, the DeepEP
/// dispatcher, 29.0 s per step. The dispatcher is read from the arguments: DeepEP sends a token
/// once per node holding its experts, the all-to-all dispatcher once per token–expert pair.
/// Expert-TP 1 is priced: the expert group of 8 folds over the 4 tensor × 8 data ranks,
/// Megatron-Core's order puts it on 8 consecutive ranks (tensor ranks fastest), one node, where
/// the per-node de-duplication saves nothing; across nodes (the EP 32 row) it does.
///
/// The dispatcher's reading and effect are checked always; the published steps on demand
/// ([`qwen3_moe_megatron_arguments_against_the_published_step`] and the folded rows).
#[test]
fn qwen3_moe_megatron_arguments_price_the_published_run_with_its_dispatcher() {
    let (deepep, all_to_all) = qwen3_zoo_tp4_steps();
    eprintln!("qwen3-235b-a22b TP4 PP8 VPP4 EP8 ETP1: DeepEP {deepep:.2} s ({:.3} of the published 29.0 s), all-to-all dispatcher {all_to_all:.2} s", deepep / 29.0);
    assert!((deepep / all_to_all - 1.0).abs() < 1e-9, "an expert group inside one node: both dispatchers send the same bytes over NVLink");
    let a = analyze_for(&model("qwen3-235b-a22b.onnx"), &PlanOptions { seq_len: Some(4096), ..PlanOptions::default() }).expect("analyse");
    let ep32 = |dispatcher: &str| {
        qwen3_zoo_step(
            &a,
            &format!("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 8 --num-virtual-stages-per-pipeline-rank 4 --expert-model-parallel-size 32 --expert-tensor-parallel-size 1 {dispatcher}"),
            (2, 8, 16, 32, 1, 128),
        )
    };
    let (deepep, all_to_all) = (ep32("--moe-token-dispatcher-type flex --moe-enable-deepep"), ep32("--moe-token-dispatcher-type alltoall"));
    eprintln!("qwen3-235b-a22b TP2 PP8 VPP4 EP32 ETP1 (4 nodes): DeepEP {deepep:.2} s, all-to-all dispatcher {all_to_all:.2} s");
    assert!(deepep < all_to_all, "across nodes the per-node dispatch moves fewer bytes");
}

/// The model zoo's TP 4 row against its published 29.0 s. Not met: 0.762 (22.1 s; 0.740 before
/// the experts' kernels between their products were priced in turn, 0.737 before Megatron's fp32
/// main grads) with
/// GEMMs priced by shape (0.548 before; 0.721 when the experts were split 4 ways and the expert
/// group of 8 spanned four nodes; now it is 8 consecutive ranks of one node, all-to-alls 1.9 s).
/// Attention's products at TP 4 stay on the curve by FLOPs (docs/planner.md). Run on demand:
/// `cargo test --features runner --test engines -- --ignored qwen3`.
#[test]
#[ignore = "not met: 0.762 of the published step (0.548 before GEMMs were priced by shape; the expert group inside one node)"]
fn qwen3_moe_megatron_arguments_against_the_published_step() {
    let (deepep, _) = qwen3_zoo_tp4_steps();
    assert!((deepep / 29.0 - 1.0).abs() <= 0.10, "predicted {deepep:.2} s against the published 29.0 s");
}

/// The model zoo's Qwen3-235B-A22B arguments with `parallel` (degrees, recompute, dispatcher)
/// and the overlaps its `model_configs/benchmarking/Qwen3-235B-A22B.yaml` and
/// `sbatch_benchmarking.sh` add (gradient reduction priced beside the backward; the parameter
/// gather and the tensor collectives named, priced exposed) on 256 H100s: the plan Megatron-LM's reader prices, with its (tp, pp, dp, ep, etp,
/// microbatches) checked against `want`.
fn qwen3_zoo_step(a: &Analysed, parallel: &str, want: (usize, usize, usize, usize, usize, usize)) -> f64 {
    let shape = ModelShape::of(&a.lg);
    let args = format!(
        "torchrun --nnodes 32 --nproc-per-node 8 pretrain_gpt.py \
        --num-layers 94 --hidden-size 4096 --num-attention-heads 64 --group-query-attention --num-query-groups 4 \
        --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 1536 --seq-length 4096 --max-position-embeddings 4096 \
        --position-embedding-type rope --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights \
        --sequence-parallel --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split \
        {parallel} --micro-batch-size 1 --global-batch-size 2048 --use-distributed-optimizer --bf16 \
        --overlap-grad-reduce --overlap-param-gather --tp-comm-overlap"
    );
    let cluster = ClusterSpec::parse("h100-80gb:256").expect("preset");
    let (reading, world) = engines::read(Engine::Megatron, &args, Origin { what: PathBuf::from("qwen3.args") }, &shape, None).expect("read");
    assert_eq!(world, 256);
    let dispatch = if parallel.contains("deepep") { ExpertDispatch::PerNode } else { ExpertDispatch::AllToAll };
    assert_eq!(reading.options.expert_dispatch, Some(dispatch));
    assert!(!reading.unpriced.iter().any(|u| u.setting.starts_with("--expert-tensor-parallel-size")), "{:?}", reading.unpriced);
    let opts = reading.options.clone().resolve(None).expect("resolve");
    let (yours, _) = engines::price(Engine::Megatron, a, &cluster, &opts).expect("price");
    let p = &yours.parallel;
    assert_eq!((p.tp, p.pp, p.dp, p.ep, p.etp, p.microbatches), want);
    let pr = &yours.predicted;
    let (a2a, imbalance) = yours.axes.as_ref().map_or((0.0, 0.0), |x| (x.all_to_all_s, x.imbalance_s));
    eprintln!(
        "{parallel}: step {:.2} s, all-to-alls {a2a:.2} s, imbalance {imbalance:.2} s, bubble {:.3}, MFU {:.3}, peak {:.1} GiB",
        pr.step_time_s,
        pr.bubble_ratio,
        pr.mfu,
        pr.peak_memory_bytes as f64 / (1u64 << 30) as f64
    );
    pr.step_time_s
}

/// The zoo's TP 4 arguments priced with the DeepEP and the all-to-all dispatchers: step seconds.
fn qwen3_zoo_tp4_steps() -> (f64, f64) {
    let a = analyze_for(&model("qwen3-235b-a22b.onnx"), &PlanOptions { seq_len: Some(4096), ..PlanOptions::default() }).expect("analyse");
    let degrees = "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 8 --num-virtual-stages-per-pipeline-rank 4 \
        --expert-model-parallel-size 8 --expert-tensor-parallel-size 1";
    let mut steps = Vec::new();
    for dispatcher in ["--moe-token-dispatcher-type flex --moe-enable-deepep", "--moe-token-dispatcher-type alltoall"] {
        steps.push(qwen3_zoo_step(&a, &format!("{degrees} {dispatcher}"), (4, 8, 8, 8, 1, 256)));
    }
    (steps[0], steps[1])
}

/// The zoo's TP 2 PP 8 VPP 4 EP 32 ETP 1 row's parallel arguments (DeepEP, the norms' and the
/// experts' activation recompute).
const ZOO_EP32: &str = "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 8 --num-virtual-stages-per-pipeline-rank 4 \
    --expert-model-parallel-size 32 --expert-tensor-parallel-size 1 --moe-token-dispatcher-type flex --moe-enable-deepep \
    --recompute-granularity selective --recompute-modules layernorm moe_act";

/// The model zoo's two Qwen3 rows whose expert groups fold over tensor × data ranks with
/// expert-TP 1: TP 2 PP 8 VPP 4 EP 32 (over 2 × 16 ranks) with DeepEP, 19.7 s, and TP 2 PP 32
/// VPP 3 EP 8 (over 2 × 4 ranks) with the all-to-all dispatcher, 24.2 s; both recompute
/// norms and the experts' activation only (`--recompute-granularity selective
/// --recompute-modules layernorm moe_act`: the planner's selective recompute). Predicted steps
/// (seconds) in that order.
fn qwen3_zoo_folded_steps() -> (f64, f64) {
    let a = analyze_for(&model("qwen3-235b-a22b.onnx"), &PlanOptions { seq_len: Some(4096), ..PlanOptions::default() }).expect("analyse");
    let ep32 = qwen3_zoo_step(&a, ZOO_EP32, (2, 8, 16, 32, 1, 128));
    let pp32 = qwen3_zoo_step(
        &a,
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 32 --num-virtual-stages-per-pipeline-rank 3 \
        --expert-model-parallel-size 8 --expert-tensor-parallel-size 1 --moe-token-dispatcher-type alltoall \
        --recompute-granularity selective --recompute-modules layernorm moe_act",
        (2, 32, 4, 8, 1, 512),
    );
    (ep32, pp32)
}

/// The zoo's TP 2 PP 8 VPP 4 EP 32 ETP 1 row (DeepEP) against its published 19.7 s: 0.921
/// (18.1 s; all-to-alls across the 4 nodes of the expert group 5.4 s, with DeepEP's per-node
/// de-duplication and no overlap with compute). Met since GEMMs are priced by shape (each
/// expert's GEMM at the rows its group of 32 gathers; 0.827 before). The norms' selective
/// recompute is priced (0.923 with it), and the experts' kernels between their products in
/// turn (0.963, 18.98 s).
#[test]
fn qwen3_moe_megatron_folded_ep32_against_the_published_step() {
    let (ep32, pp32) = qwen3_zoo_folded_steps();
    eprintln!("qwen3-235b-a22b TP2 PP8 VPP4 EP32 ETP1: {ep32:.2} s ({:.3} of 19.7 s); TP2 PP32 VPP3 EP8 ETP1: {pp32:.2} s ({:.3} of 24.2 s)", ep32 / 19.7, pp32 / 24.2);
    assert!((ep32 / 19.7 - 1.0).abs() <= 0.10, "predicted {ep32:.2} s against the published 19.7 s");
}

/// The zoo's EP 32 row again with combined 1F1B ("+1f1b overlap": `--overlap-moe-expert-
/// parallel-comm`, each steady-phase forward merged with a backward, one's all-to-alls beside
/// the other's compute), published at 17.6 s against 19.7 s without. Not met: 0.834 (14.68 s:
/// 4.99 of the 5.40 s of all-to-alls hidden, less the 20 of 132 SMs DeepEP's kernels take from
/// the compute beside them, where the published runs differ by 2.1 s; 0.752 before the experts'
/// kernels between their products were priced in turn and the SMs counted). With the
/// all-to-alls hidden this row prices what the in-node rows do, and lands near where they land
/// (TP 4 0.762, PP 32 0.778): a term common to them is short, and the exposed EP 32 row's 0.963
/// is that shortfall offset by all-to-alls priced above what the run exposed (docs/planner.md).
/// Run on demand with the other zoo rows.
#[test]
#[ignore = "not met: 0.834 of the published 17.6 s (the all-to-alls hidden; the rows' common shortfall)"]
fn qwen3_moe_megatron_folded_ep32_combined_1f1b_against_the_published_step() {
    let a = analyze_for(&model("qwen3-235b-a22b.onnx"), &PlanOptions { seq_len: Some(4096), ..PlanOptions::default() }).expect("analyse");
    let ep32 = ZOO_EP32;
    let apart = qwen3_zoo_step(&a, ep32, (2, 8, 16, 32, 1, 128));
    // as the zoo's sbatch_benchmarking.sh turns it on (A2A_OVERLAP=1): with the deferred weight
    // gradients, named unpriced
    let merged = qwen3_zoo_step(&a, &format!("{ep32} --overlap-moe-expert-parallel-comm --delay-wgrad-compute"), (2, 8, 16, 32, 1, 128));
    eprintln!("qwen3-235b-a22b TP2 PP8 VPP4 EP32 ETP1: {apart:.2} s in turn, {merged:.2} s with combined 1F1B ({:.3} of 17.6 s; published ratio 1.119, ours {:.3})", merged / 17.6, apart / merged);
    assert!((merged / 17.6 - 1.0).abs() <= 0.10, "predicted {merged:.2} s against the published 17.6 s");
}

/// The same combined-1F1B row as the zoo's H100 recipe runs it (`best_practice/qwen3/
/// run_h100_235b.sh`, "320 TFLOPS"): the router forced to balance (random logits, read as
/// uniform routing) and CUDA graphs over the router and the dispatch's preprocessing (named: the
/// planner prices no host overhead). By Megatron's FLOP formula, which turns the table's
/// 19.7 and 17.6 s into its 245 and 276 TFLOP/s, 320 TFLOP/s is a 15.19 s step. Not met: 0.869
/// (13.19 s; 0.818 before compute beside DeepEP's kernels ran on the SMs they leave). With the
/// routing imbalance and the router's launches taken out of the run, what is left is not priced
/// here: the host's launches and synchronisations of the kernels outside the graphs.
#[test]
#[ignore = "not met: 0.869 of the published 15.19 s (ungraphed launches; see docs/planner.md)"]
fn qwen3_moe_megatron_forced_balance_cuda_graphs_against_the_published_throughput() {
    let a = analyze_for(&model("qwen3-235b-a22b.onnx"), &PlanOptions { seq_len: Some(4096), ..PlanOptions::default() }).expect("analyse");
    let row = format!(
        "{ZOO_EP32} --overlap-moe-expert-parallel-comm --delay-wgrad-compute --moe-router-force-load-balancing \
        --cuda-graph-impl transformer_engine --cuda-graph-scope moe_router moe_preprocess"
    );
    let step = qwen3_zoo_step(&a, &row, (2, 8, 16, 32, 1, 128));
    // Megatron's num_floating_point_operations: 12·L·h²·((1 + g/a + s/h/2)·(a·d/h) + F·k·3/2/h + E/(2h))
    // + 6·h·V, a token; 2,048 × 4,096 tokens a step on 256 GPUs
    let (l, h, s, v) = (94.0, 4096.0, 4096.0, 151_936.0);
    let per_token = 12.0 * l * h * h * ((1.0 + 4.0 / 64.0 + s / h / 2.0) * (64.0 * 128.0 / h) + 1536.0 * 8.0 * 1.5 / h + 128.0 / (2.0 * h)) + 6.0 * h * v;
    let flops = per_token * 2048.0 * s;
    for (published_s, tflops) in [(19.7f64, 245.0f64), (17.6, 276.0)] {
        let ours = flops / 256.0 / published_s / 1e12;
        assert!((ours / tflops - 1.0).abs() < 0.015, "the formula gives {ours:.1} TFLOP/s for the table's {published_s} s, published {tflops}");
    }
    let published = flops / 256.0 / 320e12;
    eprintln!("qwen3-235b-a22b EP32 combined 1F1B, forced balance, CUDA graphs: {step:.2} s ({:.3} of {published:.2} s)", step / published);
    assert!((step / published - 1.0).abs() <= 0.10, "predicted {step:.2} s against the published {published:.2} s");
}

/// The zoo's intra-node FSDP row: TP 2, EP 8 (one node) ETP 1, Megatron-FSDP over the 128
/// data ranks (the experts over their 32 expert-data ranks), microbatch 4 of 4 a step, full
/// recompute, DeepEP, 17.6 s. Not met: 1.372 (24.15 s). Each layer's microbatch moves 13.1 ms of
/// expert weights gathered before its forward and again before its backward, and 25.3 ms of
/// fp32 gradients reduce-scattered beside its backward, all on the expert-data link: 51.5 ms,
/// where the published step allows 46.8 ms for the whole layer (17.6 s over 4 microbatches and
/// 94 layers). The layer's own compute is 3.4 ms forward and 6.0 ms backward, so the link,
/// not the compute, sets this row; it is priced slower than the run found it.
#[test]
#[ignore = "not met: 1.372 of the published 17.6 s (the expert-data link priced busier than the run)"]
fn qwen3_moe_megatron_fsdp_against_the_published_step() {
    let a = analyze_for(&model("qwen3-235b-a22b.onnx"), &PlanOptions { seq_len: Some(4096), ..PlanOptions::default() }).expect("analyse");
    let shape = ModelShape::of(&a.lg);
    let args = "torchrun --nnodes 32 --nproc-per-node 8 pretrain_gpt.py \
        --num-layers 94 --hidden-size 4096 --num-attention-heads 64 --group-query-attention --num-query-groups 4 \
        --num-experts 128 --moe-router-topk 8 --moe-ffn-hidden-size 1536 --seq-length 4096 --max-position-embeddings 4096 \
        --position-embedding-type rope --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --sequence-parallel \
        --tensor-model-parallel-size 2 --expert-model-parallel-size 8 --expert-tensor-parallel-size 1 \
        --moe-token-dispatcher-type flex --moe-enable-deepep --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
        --use-megatron-fsdp --micro-batch-size 4 --global-batch-size 2048 --bf16 --use-distributed-optimizer \
        --overlap-grad-reduce --overlap-param-gather --tp-comm-overlap";
    let cluster = ClusterSpec::parse("h100-80gb:256").expect("preset");
    let (reading, _) = engines::read(Engine::Megatron, args, Origin { what: PathBuf::from("qwen3.args") }, &shape, None).expect("read");
    let (yours, _) = engines::price(Engine::Megatron, &a, &cluster, &reading.options.clone().resolve(None).expect("resolve")).expect("price");
    let p = &yours.parallel;
    assert_eq!((p.tp, p.pp, p.dp, p.ep, p.etp, p.zero, p.microbatches, p.grad_overlap), (2, 1, 128, 8, 1, 3, 4, true));
    let step = yours.predicted.step_time_s;
    eprintln!("qwen3-235b-a22b Megatron-FSDP TP2 EP8: {step:.2} s ({:.3} of the published 17.6 s)", step / 17.6);
    assert!((step / 17.6 - 1.0).abs() <= 0.10, "predicted {step:.2} s against the published 17.6 s");
}

/// The zoo's TP 2 PP 32 VPP 3 EP 8 ETP 1 row (all-to-all dispatcher) against its published
/// 24.2 s. Not met: 0.778 (18.8 s; the expert group of 8 is one node; 0.684 before GEMMs were
/// priced by shape, each expert's GEMM now at the rows its group gathers; 0.754 with the norms'
/// selective recompute priced, 0.757 with the experts' activation rebuilt too, 0.778 with their
/// kernels between the products priced in turn).
#[test]
#[ignore = "not met: 0.778 of the published 24.2 s (0.684 before GEMMs were priced by shape)"]
fn qwen3_moe_megatron_folded_pp32_against_the_published_step() {
    let (_, pp32) = qwen3_zoo_folded_steps();
    assert!((pp32 / 24.2 - 1.0).abs() <= 0.10, "predicted {pp32:.2} s against the published 24.2 s");
}

/// torchtitan's FSDP under a pipeline reduce-scatters gradients once per step, after the last
/// backward (torch.distributed.pipelining turns gradient sync off for the others), holding them
/// whole: ZeRO 1's layout. So a pipelined ZeRO 1 plan is expressed as it is, a pipelined ZeRO 2
/// plan (gradients sharded after every backward) is not, and without a pipeline the reverse.
#[test]
fn torchtitan_fsdp_under_a_pipeline_is_zero_1() {
    let a = analyse("llama3-8b.onnx");
    let cluster = ClusterSpec::parse("h100-80gb:64").expect("preset");
    let shape = ModelShape::of(&a.lg);
    let zero_gap = |pp: usize, zero: u8| {
        let req = PlanOptions { global_batch: Some(512), pp: Some(pp), tp: Some(4), zero: Some(zero), schedule: Some(ScheduleKind::OneFOneB), ..PlanOptions::default() };
        let plan = compile(&a, &cluster, &req);
        assert_eq!(plan.parallel.zero, zero);
        let gaps = engines::gaps(Engine::Torchtitan, &plan, &shape).expect("gaps");
        gaps.into_iter().find(|g| g.field == engines::PlanField::Zero).map(|g| (g.chose, g.change))
    };
    assert_eq!(zero_gap(2, 1), None, "pipelined ZeRO 1 is what torchtitan runs");
    let (chose, change) = zero_gap(2, 2).expect("pipelined ZeRO 2 is a gap");
    assert_eq!((chose.as_str(), change), ("ZeRO 2 with pipeline parallelism", Some(engines::Change::Zero(1))));
    let (chose, change) = zero_gap(1, 1).expect("ZeRO 1 without a pipeline is a gap");
    assert_eq!((chose.as_str(), change), ("ZeRO 1", Some(engines::Change::Zero(2))));
}

/// torchtitan never splits experts over the tensor ranks under expert parallelism: its sparse
/// mesh (pp, dp_replicate, efsdp, ep) re-factors the dense ranks with ep innermost, tensor ranks
/// first (`ParallelDims`, efsdp = dp_shard · cp · tp / ep). Read as the planner's fold at
/// expert-TP 1 (a model state that holds each expert on ep ranks of one replica's tensor and
/// data ranks); a plan whose experts are split over the tensor ranks is a gap whose nearest
/// plan is that fold, which torchtitan writes as it is; with context ranks it is refused.
#[test]
fn torchtitan_expert_parallelism_over_tensor_ranks_is_a_fold_at_expert_tp_1() {
    let a = analyse("mixtral-8x7b.onnx");
    let shape = ModelShape::of(&a.lg);
    let cluster = ClusterSpec::parse("h100-80gb:64").expect("preset");
    let text = |extra: &str| format!("[training]\nlocal_batch_size = 4\nseq_len = 4096\n[parallelism]\ndata_parallel_shard_degree = -1\ntensor_parallel_degree = 2\npipeline_parallel_degree = 4\n{extra}");
    let (r, _) = engines::read(Engine::Torchtitan, &text("expert_parallel_degree = 8\n"), Origin { what: PathBuf::from("job.toml") }, &shape, Some(64)).expect("read");
    assert_eq!((r.options.tp, r.options.dp, r.options.ep, r.options.etp), (Some(2), Some(8), Some(8), Some(1)));
    assert!(r.unpriced.is_empty(), "{:?}", r.unpriced);
    // ep 8 over tp 2 × dp 8 does not divide dp alone: only the fold expresses it
    let opts = r.options.clone().resolve(None).expect("resolve");
    let (priced, _) = engines::price(Engine::Torchtitan, &a, &cluster, &opts).expect("price");
    assert_eq!((priced.parallel.ep, priced.parallel.etp), (8, 1));
    let err = read_err(Engine::Torchtitan, &text("context_parallel_degree = 2\nexpert_parallel_degree = 8\n"), &shape, 64);
    assert!(err.contains("tensor and context ranks"), "{err}");
    // a plan with its experts split over the tensor ranks: nearest, the fold
    let req = PlanOptions { global_batch: Some(256), pp: Some(4), tp: Some(2), ep: Some(4), zero: Some(1), schedule: Some(ScheduleKind::OneFOneB), ..PlanOptions::default() };
    let plan = compile(&a, &cluster, &req);
    assert_eq!((plan.parallel.ep, plan.parallel.etp), (4, 2));
    let e = engines::emit(Engine::Torchtitan, &plan, &a, &cluster).expect("emit");
    let g = e.gaps.iter().find(|g| g.gap.field == engines::PlanField::Expert).expect("an expert gap");
    assert_eq!(g.gap.change, Some(engines::Change::FoldedExperts));
    let nearest = e.nearest.as_ref().expect("a nearest plan");
    assert_eq!((nearest.parallel.ep, nearest.parallel.etp), (4, 1));
    assert!(engines::gaps(Engine::Torchtitan, nearest, &shape).expect("gaps").iter().all(|g| g.field != engines::PlanField::Expert));
    assert!(e.written.files[0].text.contains("expert_parallel_degree = 4"), "{}", e.written.files[0].text);
}

/// Megatron-Core's combined 1F1B (`--overlap-moe-expert-parallel-comm`): each steady-phase
/// forward merged with a backward, one microbatch's expert all-to-alls beside the other's
/// compute. Read (refused where `TransformerConfig` refuses it), priced (the step shorter by no
/// more than the all-to-alls, by the part of them reported hidden), written back, and named as
/// a gap by the engines that run the all-to-alls in turn.
#[test]
fn megatron_combined_1f1b_is_read_priced_and_written() {
    let a = analyse("mixtral-8x7b.onnx");
    let shape = ModelShape::of(&a.lg);
    let cluster = ClusterSpec::parse("h100-80gb:64").expect("preset");
    let args = |extra: &str| {
        format!(
            "--pipeline-model-parallel-size 2 --expert-model-parallel-size 8 --seq-length 4096 --micro-batch-size 1 --global-batch-size 256 \
            --use-distributed-optimizer --bf16 {extra}"
        )
    };
    let interleaved = "--num-virtual-stages-per-pipeline-rank 2 --moe-token-dispatcher-type alltoall";
    let read = |text: &str| engines::read(Engine::Megatron, text, Origin { what: PathBuf::from("args") }, &shape, Some(64)).expect("read").0;
    let price = |r: &engines::Reading| engines::price(Engine::Megatron, &a, &cluster, &r.options.clone().resolve(None).expect("resolve")).expect("price").0;
    let (apart, merged) = (read(&args(interleaved)), read(&args(&format!("{interleaved} --overlap-moe-expert-parallel-comm"))));
    assert_eq!((apart.options.expert_overlap, merged.options.expert_overlap), (None, Some(true)));
    assert!(merged.unpriced.is_empty(), "{:?}", merged.unpriced);
    let (apart, merged) = (price(&apart), price(&merged));
    assert!(!apart.parallel.expert_overlap && merged.parallel.expert_overlap);
    let axes = merged.axes.as_ref().expect("the expert axis reported");
    let saved = apart.predicted.step_time_s - merged.predicted.step_time_s;
    eprintln!("mixtral-8x7b pp 2 interleaved:2 ep 8: {:.3} s in turn, {:.3} s merged; all-to-alls {:.3} s, {:.3} s of it hidden", apart.predicted.step_time_s, merged.predicted.step_time_s, axes.all_to_all_s, axes.all_to_all_hidden_s);
    assert!(axes.all_to_all_hidden_s > 0.0 && axes.all_to_all_hidden_s <= axes.all_to_all_s);
    assert!(saved > 0.0 && saved <= axes.all_to_all_s, "saved {saved} s of {} s of all-to-alls", axes.all_to_all_s);
    // Megatron-Core's own refusals
    for (extra, check) in [
        ("--moe-token-dispatcher-type alltoall --overlap-moe-expert-parallel-comm", "virtual_pipeline_model_parallel_size must be specified"),
        ("--num-virtual-stages-per-pipeline-rank 2 --overlap-moe-expert-parallel-comm", "alltoall/flex token dispatcher"),
        (&format!("{interleaved} --overlap-moe-expert-parallel-comm --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"), "disable full recomputation"),
        (&format!("{interleaved} --delay-wgrad-compute"), "overlap_moe_expert_parallel_comm must be enabled"),
    ] {
        let err = read_err(Engine::Megatron, &args(extra), &shape, 64);
        assert!(err.contains(check), "{extra}: {err}");
    }
    let delayed = read(&args(&format!("{interleaved} --overlap-moe-expert-parallel-comm --delay-wgrad-compute")));
    assert_eq!(delayed.unpriced.iter().map(|u| u.setting.as_str()).collect::<Vec<_>>(), ["--delay-wgrad-compute"]);
    // written back as read; the engines without it name the gap and price the nearest plan
    let text = &engines::emit(Engine::Megatron, &merged, &a, &cluster).expect("emit").written.files[0].text;
    assert!(text.contains("--moe-token-dispatcher-type alltoall") && text.contains("--overlap-moe-expert-parallel-comm"), "{text}");
    let back = price(&read(&text.replace('\n', " ")));
    assert!(back.parallel.expert_overlap && (back.predicted.step_time_s / merged.predicted.step_time_s - 1.0).abs() < 1e-9);
    for engine in [Engine::Torchtitan, Engine::DeepSpeed] {
        let e = engines::emit(engine, &merged, &a, &cluster).expect("emit");
        let g = e.gaps.iter().find(|g| g.gap.field == engines::PlanField::ExpertOverlap).unwrap_or_else(|| panic!("{engine}: {:?}", e.gaps));
        assert_eq!(g.gap.change, Some(engines::Change::ExpertOverlap(false)));
        assert!(!e.nearest.as_ref().expect("nearest").parallel.expert_overlap, "{engine}");
    }
}

/// Megatron's `--moe-router-force-load-balancing` (random router logits, as benchmarks run) is
/// read as uniform routing: the group's busiest rank carries only that draw's spread, which a
/// brute-force draw of the same routing confirms; without it the default imbalance stands.
#[test]
fn forced_load_balancing_is_priced_as_uniform_routing() {
    let a = analyse("mixtral-8x7b.onnx");
    let shape = ModelShape::of(&a.lg);
    let cluster = ClusterSpec::parse("h100-80gb:64").expect("preset");
    let args = |extra: &str| format!("--pipeline-model-parallel-size 2 --expert-model-parallel-size 8 --seq-length 4096 --micro-batch-size 1 --global-batch-size 256 --use-distributed-optimizer --bf16 {extra}");
    let read = |text: &str| engines::read(Engine::Megatron, text, Origin { what: PathBuf::from("args") }, &shape, Some(64)).expect("read").0;
    let price = |r: &engines::Reading| engines::price(Engine::Megatron, &a, &cluster, &r.options.clone().resolve(None).expect("resolve")).expect("price").0;
    let (learned, forced) = (read(&args("")), read(&args("--moe-router-force-load-balancing")));
    assert_eq!(learned.options.expert_imbalance, None, "the default stands");
    assert!(forced.unpriced.is_empty() && forced.no_effect.is_empty(), "{:?} {:?}", forced.unpriced, forced.no_effect);
    // 4,096 tokens a rank, 2 of 8 experts each: 8,192 pairs a rank on average, over 8 ranks
    let imbalance = forced.options.expert_imbalance.expect("read");
    assert!((imbalance - smp_partition::cost::comm::uniform_routing_imbalance(8, 8192.0)).abs() < 1e-12);
    let (learned, forced) = (price(&learned), price(&forced));
    let (l, f) = (learned.axes.as_ref().expect("axes"), forced.axes.as_ref().expect("axes"));
    assert!(f.imbalance_s < 0.3 * l.imbalance_s, "forced {} s of imbalance against {} s", f.imbalance_s, l.imbalance_s);
    assert!(forced.predicted.step_time_s < learned.predicted.step_time_s);
    // the oracle: route every pair of 8 ranks' 256 pairs uniformly, many times over
    let (ranks, pairs, trials) = (8usize, 256usize, 4000);
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut busiest = 0.0;
    for _ in 0..trials {
        let mut load = vec![0u32; ranks];
        for _ in 0..ranks * pairs {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            load[((state >> 32) * ranks as u64 >> 32) as usize] += 1;
        }
        busiest += *load.iter().max().expect("ranks") as f64 / pairs as f64 / trials as f64;
    }
    let priced = smp_partition::cost::comm::uniform_routing_imbalance(ranks, pairs as f64);
    eprintln!("uniform routing, 8 ranks × 256 pairs: drawn {busiest:.4}, priced {priced:.4}");
    assert!(((priced - 1.0) / (busiest - 1.0) - 1.0).abs() < 0.03, "drawn {busiest}, priced {priced}");
    // torchtitan's debug switch routes round-robin: exactly balanced
    let job = |extra: &str| format!("[training]\nlocal_batch_size = 4\nseq_len = 4096\n[parallelism]\ndata_parallel_shard_degree = -1\nexpert_parallel_degree = 8\n{extra}");
    let titan = |text: &str| engines::read(Engine::Torchtitan, text, Origin { what: PathBuf::from("job.toml") }, &shape, Some(64)).expect("read").0;
    assert_eq!(titan(&job("")).options.expert_imbalance, None);
    let balanced = titan(&job("[debug]\nmoe_force_load_balance = true\n"));
    assert_eq!(balanced.options.expert_imbalance, Some(1.0));
    assert!(balanced.unpriced.is_empty(), "{:?}", balanced.unpriced);
}

/// Compute beside DeepEP's hidden all-to-alls runs on the SMs its kernels leave (20 of the
/// H100's 132): the merged schedule's saving shrinks by that share of what it hides, and not at
/// all on a device whose SM count is unknown; another `--moe-deepep-num-sms` is named.
#[test]
fn compute_beside_deepep_runs_on_the_sms_it_leaves() {
    let a = analyse("mixtral-8x7b.onnx");
    let shape = ModelShape::of(&a.lg);
    let h100 = ClusterSpec::parse("h100-80gb:64").expect("preset");
    let unknown = ClusterSpec { sms: None, ..h100.clone() };
    let args = |extra: &str| {
        format!(
            "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 --expert-model-parallel-size 8 --seq-length 4096 \
            --micro-batch-size 1 --global-batch-size 256 --use-distributed-optimizer --bf16 --overlap-moe-expert-parallel-comm {extra}"
        )
    };
    let read = |text: &str| engines::read(Engine::Megatron, text, Origin { what: PathBuf::from("args") }, &shape, Some(64)).expect("read").0;
    let price = |r: &engines::Reading, c: &ClusterSpec| engines::price(Engine::Megatron, &a, c, &r.options.clone().resolve(None).expect("resolve")).expect("price").0;
    let deepep = read(&args("--moe-token-dispatcher-type flex --moe-enable-deepep --moe-deepep-num-sms 20"));
    assert!(deepep.unpriced.is_empty(), "{:?}", deepep.unpriced);
    let (on_h100, unknown_sms) = (price(&deepep, &h100), price(&deepep, &unknown));
    let hidden = on_h100.axes.as_ref().expect("axes").all_to_all_hidden_s;
    assert!(hidden > 0.0 && (hidden - unknown_sms.axes.as_ref().expect("axes").all_to_all_hidden_s).abs() < 1e-12);
    let slower = on_h100.predicted.step_time_s - unknown_sms.predicted.step_time_s;
    let share = 20.0 / 132.0;
    eprintln!("mixtral-8x7b ep 8 combined 1F1B with DeepEP: {hidden:.3} s hidden, the step {slower:.4} s slower beside its kernels");
    // about that share of what is hidden (the busiest stage's, which the bubble repeats)
    assert!(slower > 0.8 * share * hidden && slower < 1.15 * share * hidden, "{slower} s slower, {hidden} s hidden");
    // NCCL's all-to-all holds no fixed SMs here: the same on both
    let nccl = read(&args("--moe-token-dispatcher-type alltoall"));
    assert!((price(&nccl, &h100).predicted.step_time_s - price(&nccl, &unknown).predicted.step_time_s).abs() < 1e-12);
    let other = read(&args("--moe-token-dispatcher-type flex --moe-enable-deepep --moe-deepep-num-sms 24"));
    assert_eq!(other.unpriced.iter().map(|u| u.setting.as_str()).collect::<Vec<_>>(), ["--moe-deepep-num-sms 24"]);
}

/// Each layer's gradient reduction beside the rest of the backward, as the engines' bucketed
/// reductions run it: Megatron's `--overlap-grad-reduce` (and Megatron-FSDP's own whenever it
/// shards gradients), DeepSpeed's `zero_optimization.overlap_comm` (on by default at stage 3,
/// of no effect under its pipeline engine), torchtitan's FSDP and DDP hooks (always). Priced:
/// the step shorter, by no more than the reductions; read, written and read back the same; an
/// engine that cannot run the plan's choice names the gap.
#[test]
fn gradient_reduction_beside_the_backward_is_read_priced_and_written() {
    let a = analyse("llama3-8b.onnx");
    let shape = ModelShape::of(&a.lg);
    let cluster = ClusterSpec::parse("h100-80gb:64").expect("preset");
    let read = |engine: Engine, text: &str| engines::read(engine, text, Origin { what: PathBuf::from("config") }, &shape, Some(64)).expect("read").0;
    let price = |r: &engines::Reading, engine: Engine| engines::price(engine, &a, &cluster, &r.options.clone().resolve(None).expect("resolve")).expect("price").0;
    let megatron = |extra: &str| format!("--tensor-model-parallel-size 8 --seq-length 8192 --micro-batch-size 1 --global-batch-size 256 --use-distributed-optimizer --bf16 {extra}");
    let (after, beside) = (read(Engine::Megatron, &megatron("")), read(Engine::Megatron, &megatron("--overlap-grad-reduce")));
    assert_eq!((after.options.grad_overlap, beside.options.grad_overlap), (None, Some(true)));
    let (after, beside) = (price(&after, Engine::Megatron), price(&beside, Engine::Megatron));
    assert!(beside.parallel.grad_overlap && !after.parallel.grad_overlap);
    let saved = after.predicted.step_time_s - beside.predicted.step_time_s;
    let data: f64 = after.communication.iter().filter(|c| c.kind == smp_partition::plan::schema::Traffic::Data).map(|c| c.time_s).sum();
    eprintln!("llama3-8b tp 8 dp 8 ZeRO 1: {:.3} s reducing after the backward, {:.3} s beside it (data-parallel traffic {data:.3} s)", after.predicted.step_time_s, beside.predicted.step_time_s);
    assert!(saved > 0.0 && saved <= data + 1e-9, "saved {saved} s of {data} s");
    let text = &engines::emit(Engine::Megatron, &beside, &a, &cluster).expect("emit").written.files[0].text;
    assert!(text.contains("--overlap-grad-reduce"), "{text}");
    // Megatron-FSDP, DeepSpeed at stage 3 and torchtitan reduce beside the backward unasked
    let fsdp = read(Engine::Megatron, "--tensor-model-parallel-size 8 --seq-length 8192 --micro-batch-size 1 --global-batch-size 256 --use-megatron-fsdp --bf16");
    assert_eq!(fsdp.options.grad_overlap, Some(true));
    let ds = |zero: u8, extra: &str| format!(r#"{{"train_batch_size": 256, "train_micro_batch_size_per_gpu": 1, "bf16": {{"enabled": true}}, "zero_optimization": {{"stage": {zero}{extra}}}, "tensor_parallel": {{"autotp_size": 8}}}}"#);
    assert_eq!(read(Engine::DeepSpeed, &ds(3, "")).options.grad_overlap, Some(true));
    assert_eq!(read(Engine::DeepSpeed, &ds(1, "")).options.grad_overlap, None);
    assert_eq!(read(Engine::DeepSpeed, &ds(1, r#", "overlap_comm": true"#)).options.grad_overlap, Some(true));
    let titan = read(Engine::Torchtitan, "[training]\nlocal_batch_size = 4\nseq_len = 8192\n[parallelism]\ndata_parallel_shard_degree = -1\ntensor_parallel_degree = 8\n");
    assert_eq!(titan.options.grad_overlap, Some(true));
    // a plan that reduces after the backward: Megatron writes it as is (ZeRO 1), DeepSpeed says
    // overlap_comm false; torchtitan's and Megatron-FSDP's reductions always overlap: a gap
    let z = |zero: u8| compile(&a, &cluster, &PlanOptions { global_batch: Some(256), pp: Some(1), tp: Some(8), zero: Some(zero), ..PlanOptions::default() });
    let (z1, z3) = (z(1), z(3));
    assert!(!engines::emit(Engine::Megatron, &z1, &a, &cluster).expect("emit").written.files[0].text.contains("--overlap-grad-reduce"));
    let e = engines::emit(Engine::DeepSpeed, &z3, &a, &cluster).expect("emit");
    assert!(e.written.files[0].text.contains("\"overlap_comm\": false"), "{}", e.written.files[0].text);
    for (engine, plan) in [(Engine::Torchtitan, &z1), (Engine::Megatron, &z3)] {
        let e = engines::emit(engine, plan, &a, &cluster).expect("emit");
        let g = e.gaps.iter().find(|g| g.gap.field == engines::PlanField::GradOverlap).unwrap_or_else(|| panic!("{engine}: {:?}", e.gaps));
        assert_eq!(g.gap.change, Some(engines::Change::GradOverlap(true)));
        assert!(e.nearest.as_ref().expect("nearest").parallel.grad_overlap, "{engine}");
    }
}

/// DeepSpeed 0.19's AutoEP under AutoTP folds the expert group over a stage's tensor × data
/// ranks with whole experts, and only without a pipeline (`module_inject/auto_ep_folding.py`):
/// read as the planner's fold at expert-TP 1, even where ep does not divide dp; refused as
/// DeepSpeed refuses a pipeline, Ulysses or an expert-tensor size other than 1 there. A plan
/// with its experts split over the tensor ranks is a gap whose nearest plan is the fold; one
/// under a pipeline a gap whose nearest plan leaves the experts to AutoTP (ep 1).
#[test]
fn deepspeed_autoep_under_autotp_is_a_fold_at_expert_tp_1() {
    let a = analyse("mixtral-8x7b.onnx");
    let shape = ModelShape::of(&a.lg);
    let cluster = ClusterSpec::parse("h100-80gb:64").expect("preset");
    let ds = |stages: usize, sp: usize, experts: &str| {
        format!(
            r#"{{"train_batch_size": 256, "train_micro_batch_size_per_gpu": 1, "bf16": {{"enabled": true}}, "zero_optimization": {{"stage": 1}},
            "tensor_parallel": {{"autotp_size": 2}}, "sequence_parallel_size": {sp}, "pipeline": {{"stages": {stages}}}, "expert_parallel": {{"enabled": true{experts}}}}}"#
        )
    };
    let node = ClusterSpec::parse("h100-80gb:8").expect("preset");
    let (r, _) = engines::read(Engine::DeepSpeed, &ds(1, 1, r#", "autoep_size": 8"#), Origin { what: PathBuf::from("ds_config.json") }, &shape, Some(8)).expect("read");
    // ep 8 over tp 2 × dp 4: only the fold expresses it
    assert_eq!((r.options.tp, r.options.dp, r.options.ep, r.options.etp), (Some(2), Some(4), Some(8), Some(1)));
    let priced = engines::price(Engine::DeepSpeed, &a, &node, &r.options.clone().resolve(None).expect("resolve")).expect("price").0;
    assert_eq!((priced.parallel.ep, priced.parallel.etp), (8, 1));
    for (text, check) in [
        (ds(2, 1, r#", "autoep_size": 8"#), "supports pp_size=1 only"),
        (ds(1, 2, r#", "autoep_size": 8"#), "mutually exclusive"),
        (ds(1, 1, r#", "autoep_size": 8, "expert_tensor_parallel_size": 2"#), "expert_tensor_parallel_size=2"),
        (ds(1, 1, r#", "autoep_size": 1"#), "autoep_size > 1"),
    ] {
        let err = read_err(Engine::DeepSpeed, &text, &shape, 64);
        assert!(err.contains(check), "{err}");
    }
    let base = PlanOptions { global_batch: Some(256), tp: Some(2), ep: Some(4), zero: Some(1), ..PlanOptions::default() };
    for (req, change) in [
        (PlanOptions { pp: Some(1), ..base.clone() }, engines::Change::FoldedExperts),
        (PlanOptions { pp: Some(2), etp: Some(1), schedule: Some(ScheduleKind::OneFOneB), ..base.clone() }, engines::Change::ExpertDegree(1)),
    ] {
        let plan = compile(&a, &cluster, &req);
        let e = engines::emit(Engine::DeepSpeed, &plan, &a, &cluster).expect("emit");
        let g = e.gaps.iter().find(|g| g.gap.field == engines::PlanField::Expert).unwrap_or_else(|| panic!("{:?}", e.gaps));
        assert_eq!(g.gap.change.as_ref(), Some(&change));
        let nearest = e.nearest.as_ref().expect("a nearest plan");
        assert!(engines::gaps(Engine::DeepSpeed, nearest, &shape).expect("gaps").iter().all(|g| g.field != engines::PlanField::Expert), "{change:?}");
        assert!(nearest.parallel.ep == 1 || (nearest.parallel.pp, nearest.parallel.etp) == (1, 1), "{:?}", nearest.parallel);
    }
}

/// The gradients' type as each engine keeps it under bf16: Megatron-LM's arguments.py turns on
/// fp32 "main grads" (accumulated and all-reduced in fp32) unless `--grad-reduce-in-bf16`, and
/// torchtitan's FSDP under a pipeline accumulates whole gradients in its fp32 reduce dtype. Priced
/// as 4 bytes of gradient a parameter where they hold 2, the weights and optimizer state alike, and
/// the plan says so (`fp32_main_grads`).
#[test]
fn engines_keep_bf16_gradients_in_fp32_as_their_defaults_say() {
    let a = analyse("llama3-8b.onnx");
    let shape = ModelShape::of(&a.lg);
    let cluster = ClusterSpec::parse("h100-80gb:64").expect("preset");
    let price = |engine: Engine, text: &str| {
        let (reading, _) = engines::read(engine, text, Origin { what: PathBuf::from("job") }, &shape, Some(64)).expect("read");
        let opts = reading.options.clone().resolve(None).expect("resolve");
        engines::price(engine, &a, &cluster, &opts).expect("price").0
    };
    let megatron = |extra: &str| {
        price(
            Engine::Megatron,
            &format!(
                "pretrain_gpt.py --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention \
                --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope --normalization RMSNorm \
                --swiglu --untie-embeddings-and-output-weights --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 \
                --micro-batch-size 1 --global-batch-size 512 --use-distributed-optimizer --bf16 {extra}"
            ),
        )
    };
    let (main, reduced) = (megatron(""), megatron("--grad-reduce-in-bf16"));
    assert!(main.parallel.fp32_main_grads && !reduced.parallel.fp32_main_grads);
    let header = |p: &Plan| smp_partition::plan::report::render(p).lines().find(|l| l.starts_with("parallel")).unwrap_or_default().to_string();
    assert!(header(&main).ends_with("precision bf16-mixed (fp32 main grads)") && header(&reduced).ends_with("precision bf16-mixed"), "{}", header(&main));
    for (m, r) in main.stages.iter().zip(&reduced.stages) {
        let (mm, rm) = (&m.memory_bytes, &r.memory_bytes);
        // ZeRO 1 (the distributed optimizer): the gradients whole
        assert_eq!((mm.params, mm.optimizer), (rm.params, rm.optimizer), "stage {}", m.index);
        assert!((mm.grads as f64 / rm.grads as f64 - 2.0).abs() < 1e-6, "stage {}: {} against {} bytes", m.index, mm.grads, rm.grads);
    }
    assert!(main.predicted.step_time_s > reduced.predicted.step_time_s, "the all-reduce moves fp32");
    let titan = |pp: usize| {
        price(
            Engine::Torchtitan,
            &format!(
                "[model]\nname = \"llama3\"\nflavor = \"8B\"\n[training]\nlocal_batch_size = 8\nseq_len = 8192\n\
                [parallelism]\ndata_parallel_shard_degree = -1\ntensor_parallel_degree = 4\npipeline_parallel_degree = {pp}\n"
            ),
        )
    };
    let (piped, flat) = (titan(2), titan(1));
    assert_eq!((piped.parallel.zero, flat.parallel.zero), (1, 3));
    assert!(piped.parallel.fp32_main_grads && !flat.parallel.fp32_main_grads, "FSDP's fp32 shard is the master without a pipeline");
    // DeepSpeed keeps gradients in the model's type unless data_types.grad_accum_dtype says
    // fp32, which its BF16 optimizer honours at ZeRO 1 alone
    let ds = |zero: u8, accum: &str| {
        format!(r#"{{"train_batch_size": 512, "train_micro_batch_size_per_gpu": 1, "bf16": {{"enabled": true}}, "zero_optimization": {{"stage": {zero}}}{accum}, "tensor_parallel": {{"autotp_size": 4}}}}"#)
    };
    let fp32 = r#", "data_types": {"grad_accum_dtype": "fp32"}"#;
    let (plain, zero1) = (price(Engine::DeepSpeed, &ds(1, "")), price(Engine::DeepSpeed, &ds(1, fp32)));
    assert!(!plain.parallel.fp32_main_grads && zero1.parallel.fp32_main_grads);
    for (m, r) in zero1.stages.iter().zip(&plain.stages) {
        assert!((m.memory_bytes.grads as f64 / r.memory_bytes.grads as f64 - 2.0).abs() < 1e-6, "stage {}", m.index);
    }
    let (reading, _) = engines::read(Engine::DeepSpeed, &ds(2, fp32), Origin { what: PathBuf::from("job") }, &shape, Some(64)).expect("read");
    assert!(reading.options.mixed_recipe.is_none() && reading.no_effect.iter().any(|n| n.contains("grad_accum_dtype")), "ZeRO 2 ignores it: {:?}", reading.no_effect);
    let m = read_err(Engine::DeepSpeed, &ds(0, fp32), &shape, 64);
    assert!(m.contains("_do_optimizer_sanity_check") && m.contains("grad_accum_dtype=fp32"), "{m}");
    // written back: the ZeRO 1 plan says fp32 in its config; Megatron's (fp32 main grads at
    // ZeRO 1, pipelined) as well
    let written = |plan: &Plan| {
        let e = engines::emit(Engine::DeepSpeed, plan, &a, &cluster).expect("emit");
        let cfg: serde_json::Value = serde_json::from_str(&e.written.files[0].text).expect("json");
        (cfg["data_types"]["grad_accum_dtype"].as_str() == Some("fp32"), e.nearest.map(|n| n.parallel.fp32_main_grads))
    };
    assert_eq!(written(&zero1), (true, None));
    assert_eq!(written(&plain), (false, None));
    // torchtitan's flat FSDP plan priced with fp32 gradients at ZeRO 3 cannot say so
    let mut z3 = engines::exact_request(&flat);
    z3.mixed_recipe = Some(smp_partition::ir::MixedRecipe::LowModelFp32Grads);
    let z3 = compile(&a, &cluster, &z3.resolve(None).expect("resolve"));
    assert!(z3.parallel.fp32_main_grads);
    let e = engines::emit(Engine::DeepSpeed, &z3, &a, &cluster).expect("emit");
    assert!(e.gaps.iter().any(|g| g.gap.change == Some(engines::Change::ModelTypeGradients)), "{:?}", e.gaps);
    assert_eq!(e.nearest.map(|n| n.parallel.fp32_main_grads), Some(false));
}

/// Float8 linears as the engines turn them on: torchtitan's converters (0.2's registry name, or
/// `float8` before it) with their `[quantize.linear.float8]` settings, its 2024 `[float8]`
/// section, Megatron-LM's `--fp8-format`. Read, priced (the same plan with its blocks' products
/// at the fp8 rate is faster, and the automatic plan prices the same kernels), written back by
/// Megatron-LM and named as a gap by the engines whose configuration cannot say it.
#[test]
fn float8_linears_are_read_priced_and_written() {
    let a = analyse("llama3-8b.onnx");
    let shape = ModelShape::of(&a.lg);
    let cluster = ClusterSpec::parse("h100-80gb:16").expect("preset");
    let job = |extra: &str| format!("[training]\nlocal_batch_size = 2\nseq_len = 8192\n[parallelism]\ndata_parallel_shard_degree = -1\n{extra}");
    let titan = |text: &str| engines::read(Engine::Torchtitan, text, Origin { what: PathBuf::from("job.toml") }, &shape, Some(16)).expect("read").0;
    let on = titan(&job("[model]\nconverters = [\"quantize.linear.float8\"]\n[quantize.linear.float8]\nfilter_fqns = [\"output\"]\nrecipe_name = \"rowwise\"\n"));
    assert_eq!(on.options.float8_linears, Some(true));
    assert!(on.unpriced.is_empty(), "{:?}", on.unpriced);
    // the output projection converted too: named, the head priced in 16 bits
    let head = titan(&job("[model]\nconverters = [\"float8\"]\n"));
    assert_eq!(head.options.float8_linears, Some(true));
    assert!(head.unpriced.iter().any(|u| u.setting.contains("output projection")), "{:?}", head.unpriced);
    assert_eq!(titan(&job("[float8]\nenable_float8_linear = true\n")).options.float8_linears, Some(true));
    // settings of a converter the job does not apply have no effect
    let off = titan(&job("[quantize.linear.float8]\nfilter_fqns = [\"output\"]\n[quantize.grouped_mm.float8]\nfqns = [\"experts\"]\n"));
    assert_eq!(off.options.float8_linears, None);
    assert!(off.unpriced.is_empty(), "{:?}", off.unpriced);
    // priced: the same request with and without
    let req = |f: Option<bool>| PlanOptions { global_batch: Some(32), tp: Some(1), pp: Some(1), zero: Some(3), microbatches: Some(1), seq_len: Some(8192), float8_linears: f, ..PlanOptions::default() };
    let (plain, fp8) = (compile(&a, &cluster, &req(None)), compile(&a, &cluster, &req(Some(true))));
    assert!(fp8.parallel.float8_linears && !plain.parallel.float8_linears);
    assert!(fp8.predicted.step_time_s < 0.9 * plain.predicted.step_time_s, "{} against {}", fp8.predicted.step_time_s, plain.predicted.step_time_s);
    let a100 = smp_partition::compile(&a, &ClusterSpec::parse("a100-80gb:16").expect("preset"), &req(Some(true)));
    assert!(anyhow_chain(&a100.expect_err("no fp8 on an A100")).contains("no fp8 tensor rate"));
    // Megatron-LM: read and written back; the others name the gap
    let args = "--tensor-model-parallel-size 1 --seq-length 8192 --micro-batch-size 1 --global-batch-size 32 --bf16 --fp8-format hybrid --fp8-amax-history-len 1024";
    let (m, _) = engines::read(Engine::Megatron, args, Origin { what: PathBuf::from("args.txt") }, &shape, Some(16)).expect("read");
    assert_eq!(m.options.float8_linears, Some(true));
    let err = read_err(Engine::Megatron, "--seq-length 8192 --micro-batch-size 1 --global-batch-size 32 --bf16 --fp8-format e5m2", &shape, 16);
    assert!(err.contains("invalid choice"), "{err}");
    let written = engines::emit(Engine::Megatron, &fp8, &a, &cluster).expect("emit");
    assert!(written.written.files[0].text.contains("--fp8-format hybrid"), "{}", written.written.files[0].text);
    for engine in [Engine::Torchtitan, Engine::DeepSpeed] {
        let e = engines::emit(engine, &fp8, &a, &cluster).expect("emit");
        let g = e.gaps.iter().find(|g| g.gap.field == engines::PlanField::Float8).expect("a Float8 gap");
        assert_eq!(g.gap.change, Some(engines::Change::Float8(false)));
        assert!(!e.nearest.as_ref().expect("a nearest plan").parallel.float8_linears);
    }
}

/// A mixture of experts whose first blocks are dense (DeepSeek-V3: three dense blocks, then 58
/// with 256 routed experts): the experts are read from the first block that has them, Megatron-LM
/// is told which blocks have them (`--moe-layer-freq`), and a pattern that disagrees with the
/// model is refused.
#[test]
fn experts_after_dense_blocks_are_read_and_written_as_megatron_lays_them_out() {
    let a = analyse("deepseek-v3.onnx");
    let shape = ModelShape::of(&a.lg);
    assert_eq!((shape.experts, shape.top_k, shape.expert_ffn, shape.dense_blocks), (Some(256), Some(8), Some(2048), 3));
    // the dense blocks' MLP, not latent attention's output projection (128 heads × 128 values)
    assert_eq!(shape.ffn, Some(18432));
    let cluster = ClusterSpec::parse("h100-80gb:256").expect("preset");
    let req = PlanOptions { global_batch: Some(1024), seq_len: Some(4096), pp: Some(16), tp: Some(1), ep: Some(8), zero: Some(1), schedule: Some(ScheduleKind::OneFOneB), memory_limit_gib: Some(1e6), ..PlanOptions::default() };
    let plan = compile(&a, &cluster, &req);
    let e = engines::emit(Engine::Megatron, &plan, &a, &cluster).expect("emit");
    let text = &e.written.files[0].text;
    assert!(text.contains("--moe-layer-freq '([0]*3+[1]*58)'"), "{text}");
    assert!(text.contains("--moe-ffn-hidden-size") && text.contains("2048"), "{text}");
    let base = "--expert-model-parallel-size 8 --seq-length 4096 --micro-batch-size 1 --global-batch-size 1024 --bf16";
    for pattern in ["([0]*3+[1]*58)", "[0,0,0]+[1]*58"] {
        let (r, _) = engines::read(Engine::Megatron, &format!("{base} --moe-layer-freq {pattern}"), Origin { what: PathBuf::from("args.txt") }, &shape, Some(256)).expect("read");
        assert_eq!(r.options.ep, Some(8));
    }
    let err = read_err(Engine::Megatron, &format!("{base} --moe-layer-freq 1"), &shape, 256);
    assert!(err.contains("([0]*3+[1]*58)"), "{err}");
}

/// A job file as torchtitan's own `train_configs/` write them: logging, profiling, checkpoint,
/// validation, optimizer and learning-rate sections are read without effect (not named as
/// unpriced), nested sections are dotted keys, async tensor parallelism is named where the
/// tensor degree uses it, and expert-tensor parallelism is read (1 or the tensor degree,
/// anything else refused as `ParallelDims` refuses it).
#[test]
fn torchtitan_jobs_as_its_repository_writes_them_are_read_without_noise() {
    let a = analyse("mixtral-8x7b.onnx");
    let shape = ModelShape::of(&a.lg);
    let job = |parallelism: &str| {
        format!(
            "[job]\ndump_folder = \"./outputs\"\ndescription = \"a run\"\n[profiling]\nenable_profiling = true\nprofile_freq = 100\n\
             [metrics]\nlog_freq = 10\nenable_tensorboard = true\n[model]\nname = \"mixtral\"\nflavor = \"8x7B\"\nhf_assets_path = \"./assets\"\n\
             [optimizer]\nname = \"AdamW\"\nlr = 3e-4\neps = 1e-8\n[lr_scheduler]\nwarmup_steps = 200\n[training]\nlocal_batch_size = 4\nseq_len = 4096\n\
             max_norm = 1.0\nsteps = 1000\ndataset = \"c4\"\n[parallelism]\ndata_parallel_shard_degree = -1\n{parallelism}\n\
             [checkpoint]\nenable = false\nfolder = \"checkpoint\"\ninterval = 500\n[activation_checkpoint]\nmode = \"full\"\n\
             [compile]\nenable = true\ncomponents = [\"model\", \"loss\"]\n[validation]\nenable = false\nfreq = 500\n"
        )
    };
    let read = |text: &str| engines::read(Engine::Torchtitan, text, Origin { what: PathBuf::from("job.toml") }, &shape, Some(64)).map(|(r, _)| r);
    let plain = read(&job("tensor_parallel_degree = 2")).expect("read");
    assert!(plain.unpriced.is_empty(), "{:?}", plain.unpriced);
    assert!(plain.no_effect.iter().any(|n| n.starts_with("profiling.enable_profiling")) && plain.no_effect.iter().any(|n| n.starts_with("validation.freq")), "{:?}", plain.no_effect);
    let async_tp = read(&job("tensor_parallel_degree = 2\nenable_async_tensor_parallel = true")).expect("read");
    assert!(async_tp.unpriced.iter().any(|u| u.why.contains("async tensor parallelism")), "{:?}", async_tp.unpriced);
    // experts split over the tensor ranks (ETP = TP): expert parallelism over the data ranks
    let split = read(&job("tensor_parallel_degree = 2\nexpert_parallel_degree = 8\nexpert_tensor_parallel_degree = 2")).expect("read");
    assert_eq!((split.options.tp, split.options.ep, split.options.etp), (Some(2), Some(8), Some(2)));
    let folded = read(&job("tensor_parallel_degree = 2\nexpert_parallel_degree = 8\nexpert_tensor_parallel_degree = 1")).expect("read");
    assert_eq!(folded.options.etp, Some(1));
    let err = read(&job("tensor_parallel_degree = 4\nexpert_parallel_degree = 8\nexpert_tensor_parallel_degree = 2")).expect_err("ETP neither 1 nor TP");
    assert!(err.to_string().contains("ETP = TP (4) or ETP = 1"), "{err}");
}
