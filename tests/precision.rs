//! Precision as a planning choice (docs/precision.md): the plan records the mode, and the cost
//! model prices exactly its bytes and rates. Model-state bytes of a planned stage are checked
//! against the formula from the model's own parameter counts, per mode and ZeRO stage; the
//! activations halve from f32 to bf16, and the mixed modes price autocast's types (their
//! measured oracle is tests/memory_measured.rs); a GPU's fp32 rate makes an f32 plan slower.

use std::path::PathBuf;

use smp_partition::compile::{self, AnalyzeOptions};
use smp_partition::cost::{ClusterSpec, FactSource, MachineFacts};
use smp_partition::ir::{CheckpointRule, MixedRecipe, Precision, ScheduleKind};
use smp_partition::plan::Plan;
use smp_partition::solve::PlanOptions;

fn model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/gpt2.onnx")
}

/// GPT-2 planned on `dp` H100s at pp 1 · tp 1 · dp `dp`, ZeRO `zero`, no checkpointing, the
/// mixed modes priced as autocast (the runner's layout).
fn plan(dp: usize, zero: u8, precision: Option<Precision>) -> Plan {
    plan_as(dp, zero, precision, Some(MixedRecipe::Autocast))
}

/// [`plan`] with the mixed modes priced as `recipe` (the cluster's default where `None`).
fn plan_as(dp: usize, zero: u8, precision: Option<Precision>, recipe: Option<MixedRecipe>) -> Plan {
    let cluster = format!("h100-80gb:{dp}");
    let spec = ClusterSpec::parse(&cluster).unwrap();
    let opts = PlanOptions {
        global_batch: Some(8),
        seq_len: Some(16),
        pp: Some(1),
        tp: Some(1),
        dp: Some(dp),
        zero: Some(zero),
        microbatches: Some(2),
        schedule: Some(ScheduleKind::OneFOneB),
        checkpointing: Some(CheckpointRule::Never),
        sequence_parallel: Some(false),
        precision,
        mixed_recipe: recipe,
        ..Default::default()
    };
    compile::compile(&model(), &spec, &opts).unwrap_or_else(|e| panic!("{cluster} dp {dp} zero {zero} {precision:?}: {e}"))
}

/// (parameter elements, trained elements, the most elements of any layer) of the whole model,
/// from the analysed graph.
fn param_counts() -> (f64, f64, f64) {
    let a = compile::load_and_analyze(&model(), &AnalyzeOptions { seq_len: Some(16), ..Default::default() }).unwrap();
    let params: u64 = a.lg.layers.iter().map(|l| l.figures.param_elems).sum();
    let frozen: u64 = a.lg.layers.iter().map(|l| l.figures.frozen_elems).sum();
    let largest = a.lg.layers.iter().map(|l| l.figures.param_elems).max().unwrap_or(0);
    (params as f64, (params - frozen) as f64, largest as f64)
}

/// Bytes per element of each part of the model state, by the types each layout keeps (not the
/// cost model's table): (weight, gradient, AdamW's two moments with any master copy). The mixed
/// modes as autocast runs them: fp32 weights that are the masters, fp32 gradients; as the
/// engines run them: 16-bit weights and gradients beside fp32 masters, or with Megatron's fp32
/// main grads.
fn bytes_of(p: Precision, recipe: MixedRecipe) -> (f64, f64, f64) {
    match (p, recipe) {
        (Precision::F32, _) | (Precision::Bf16Mixed | Precision::Fp16Mixed, MixedRecipe::Autocast) => (4.0, 4.0, 2.0 * 4.0),
        (Precision::Bf16Mixed | Precision::Fp16Mixed, MixedRecipe::LowModel) => (2.0, 2.0, 4.0 + 2.0 * 4.0),
        (Precision::Bf16Mixed | Precision::Fp16Mixed, MixedRecipe::LowModelFp32Grads) => (2.0, 4.0, 4.0 + 2.0 * 4.0),
        (Precision::Bf16, _) => (2.0, 2.0, 2.0 * 2.0),
    }
}

fn close(got: u64, want: f64, what: &str) {
    assert!((got as f64 - want).abs() <= 1.0 + want * 1e-12, "{what}: planned {got} bytes, formula {want}");
}

#[test]
fn model_state_per_mode_and_zero_stage_is_the_formula() {
    let (params, trained, largest) = param_counts();
    assert!(params > 0.0 && trained > 0.0 && trained <= params);
    let recipes = [MixedRecipe::Autocast, MixedRecipe::LowModel, MixedRecipe::LowModelFp32Grads];
    for (p, recipe) in Precision::ALL.into_iter().flat_map(|p| recipes.map(|r| (p, r))) {
        let (w, g, o) = bytes_of(p, recipe);
        for (dp, zero) in [(1usize, 0u8), (2, 0), (2, 1), (2, 2), (2, 3)] {
            let planned = plan_as(dp, zero, Some(p), Some(recipe));
            assert_eq!(planned.parallel.precision, p);
            assert_eq!(planned.parallel.fp32_main_grads, p.is_mixed() && recipe == MixedRecipe::LowModelFp32Grads);
            let m = planned.stages[0].memory_bytes;
            let d = dp as f64;
            // ZeRO 1 shards the optimizer state (the moments), 2 the gradients
            // too, 3 the weights too, with two layers at a time gathered whole beside them
            // (one in use, the next prefetched)
            let shard = |stage: u8| if zero >= stage { d } else { 1.0 };
            let gathered = if zero >= 3 { 2.0 * largest * w } else { 0.0 };
            let what = format!("{p} ({recipe:?}) dp {dp} ZeRO {zero}");
            close(m.params, params * w / shard(3) + gathered, &format!("{what} weights"));
            close(m.grads, trained * g / shard(2), &format!("{what} gradients"));
            close(m.optimizer, trained * o / shard(1), &format!("{what} optimizer state"));
        }
    }
}

#[test]
fn activations_are_priced_at_the_modes_types() {
    let act = |p| plan(1, 0, Some(p)).stages[0].memory_bytes.activations as f64;
    let (f32_, bf16) = (act(Precision::F32), act(Precision::Bf16));
    assert!(f32_ > 0.0 && (bf16 - f32_ / 2.0).abs() <= 2.0, "bf16: activations {bf16} vs f32 {f32_}");
    // autocast keeps fp32 values beside 16-bit ones, and 16-bit copies of what its products read
    let (bf16_mixed, fp16_mixed) = (act(Precision::Bf16Mixed), act(Precision::Fp16Mixed));
    assert_eq!(bf16_mixed, fp16_mixed, "the two low types are as wide");
    assert!(bf16_mixed > bf16, "bf16-mixed {bf16_mixed} vs bf16 {bf16}");
    // the engines' layout keeps every activation in the low type, as bf16 does (one microbatch
    // in flight: the log-probabilities are the loss's, not kept activations) ...
    let engines = plan_as(1, 0, Some(Precision::Bf16Mixed), Some(MixedRecipe::LowModel));
    let (low_model, loss) = (engines.stages[0].memory_bytes.activations as f64, engines.stages[0].memory_bytes.loss as f64);
    assert_eq!(low_model, bf16, "bf16-mixed as the engines run it");
    // ... but computes the loss in f32 (torchtitan's `.float()`, Megatron's cross entropy): its
    // copies twice pure bf16's, which the runner computes in bf16 (it widens only under autocast)
    let pure = plan(1, 0, Some(Precision::Bf16)).stages[0].memory_bytes.loss as f64;
    assert!(loss > 0.0 && (pure - loss / 2.0).abs() <= 1.0, "the loss's copies: {loss} under the engines' bf16-mixed, {pure} under bf16");
}

#[test]
fn gpu_presets_price_the_engines_layout_and_cpu_the_runners() {
    let state = |cluster: &str, recipe: Option<MixedRecipe>| {
        let host = MachineFacts { memory_bytes: 16 << 30, cores: 2, calibration: None, source: FactSource::Host };
        let spec = ClusterSpec::parse_on(cluster, &host).unwrap();
        let opts = PlanOptions { global_batch: Some(8), seq_len: Some(16), pp: Some(1), tp: Some(1), dp: Some(1), precision: Some(Precision::Bf16Mixed), mixed_recipe: recipe, ..Default::default() };
        assert_eq!(opts.mixed_recipe_for(&spec), recipe.unwrap_or(if spec.is_cpu() { MixedRecipe::Autocast } else { MixedRecipe::LowModel }));
        compile::compile(&model(), &spec, &opts).unwrap().stages[0].memory_bytes.params
    };
    assert_eq!(state("h100-80gb:1", None), state("h100-80gb:1", Some(MixedRecipe::LowModel)));
    assert_eq!(state("cpu:1", None), state("cpu:1", Some(MixedRecipe::Autocast)));
    assert_eq!(state("cpu:1", None), 2 * state("cpu:1", Some(MixedRecipe::LowModel)), "fp32 weights against 16-bit ones");
}

#[test]
fn compute_is_priced_at_the_modes_rate_and_gpus_default_to_bf16_mixed() {
    let spec = ClusterSpec::parse("h100-80gb:1").unwrap();
    assert!(spec.bf16_flops > spec.fp32_flops);
    let default = plan(1, 0, None);
    assert_eq!(default.parallel.precision, Precision::Bf16Mixed);
    let f32_ = plan(1, 0, Some(Precision::F32));
    // the same configuration, slower at the fp32 rate (and with twice the bytes moved)
    assert!(f32_.stages[0].forward_s > default.stages[0].forward_s * 1.5, "f32 {} s vs bf16-mixed {} s", f32_.stages[0].forward_s, default.stages[0].forward_s);
    // fp16 is priced at the bf16/fp16 tensor rate, like bf16
    let fp16 = plan(1, 0, Some(Precision::Fp16Mixed));
    assert_eq!(fp16.stages[0].forward_s, default.stages[0].forward_s);
}
