//! Memory model: model state (weights, gradients, optimizer state) under ZeRO, activations
//! per layer with or without checkpointing, and the microbatches each schedule keeps in
//! flight per stage.
//!
//! Model state follows the ZeRO paper (Rajbhandari et al. 2020): ZeRO-1 divides the optimizer
//! state by the data-parallel degree d, ZeRO-2 the gradients too, ZeRO-3 the weights too. Per
//! parameter, fp32 Adam keeps 4 + 4 + 8 (m, v); pure bf16 Adam 2 + 2 + 4 (bf16 m, v: PyTorch's
//! AdamW keeps its moments in the parameters' dtype); the mixed modes run as `torch.autocast`
//! does (the runner's recipe): fp32 weights that are the masters, fp32 gradients and moments,
//! 4 + 4 + 8. (DeepSpeed's and Megatron's mixed precision, 2 + 2 + 12 with a separate fp32
//! master, is [`StatePrecision::MIXED_ADAM`]; with Megatron's fp32 main grads or FSDP2's fp32
//! reduction, 2 + 4 + 12, [`StatePrecision::MIXED_ADAM_FP32_GRADS`].) Which applies is the plan's [`Precision`]
//! ([`StatePrecision::of`]); docs/precision.md has the table. Activation bytes are the values'
//! in the run's types ([`TrainingBytes`]).
//!
//! The workspace margin (framework, kernel workspace, fragmentation) is
//! [`super::ClusterSpec::workspace_bytes`], subtracted by `ClusterSpec::usable_memory`.

use crate::ir::schedule::{ActionKind, compute_actions, interleaved_round_size};
use crate::ir::{DType, Layer, LayerBytes, LayeredGraph, MixedRecipe, NodeFigures, NodeId, Precision, ScheduleKind};

/// Bytes per parameter of weights, gradients and optimizer state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StatePrecision {
    /// Weight bytes per parameter used in compute.
    pub weight: u32,
    /// Gradient bytes per parameter.
    pub grad: u32,
    /// Optimizer bytes per parameter (master copy and moments).
    pub optimizer: u32,
}

impl StatePrecision {
    /// Mixed-precision Adam with 16-bit weights and gradients beside an fp32 master copy
    /// (DeepSpeed's, Megatron's): 2 + 2 + 12 = 16 bytes per parameter.
    pub const MIXED_ADAM: StatePrecision = StatePrecision { weight: 2, grad: 2, optimizer: 12 };
    /// [`Self::MIXED_ADAM`] with fp32 gradients (Megatron-LM's main grads under bf16, FSDP2's
    /// fp32 reduction): 2 + 4 + 12 = 18 bytes per parameter.
    pub const MIXED_ADAM_FP32_GRADS: StatePrecision = StatePrecision { weight: 2, grad: 4, optimizer: 12 };
    /// fp32 Adam: 4 + 4 + 8 = 16 bytes per parameter.
    pub const FP32_ADAM: StatePrecision = StatePrecision { weight: 4, grad: 4, optimizer: 8 };
    /// Pure bf16 Adam (bf16 weights, gradients and moments, no master copy): 2 + 2 + 4 = 8
    /// bytes per parameter.
    pub const BF16_ADAM: StatePrecision = StatePrecision { weight: 2, grad: 2, optimizer: 4 };

    /// The bytes per parameter of a training precision as the runner executes it: `f32`
    /// [`Self::FP32_ADAM`], `bf16` [`Self::BF16_ADAM`], `bf16-mixed` and `fp16-mixed`
    /// [`Self::FP32_ADAM`] too (autocast: the fp32 weights are the masters, their gradients
    /// and AdamW's moments fp32; the low-type weight copies the products keep are activations).
    pub fn of(precision: Precision) -> StatePrecision {
        StatePrecision::of_recipe(precision, MixedRecipe::Autocast)
    }

    /// [`Self::of`] with the mixed modes kept as `recipe` does: [`MixedRecipe::LowModel`] is
    /// [`Self::MIXED_ADAM`], [`MixedRecipe::LowModelFp32Grads`] [`Self::MIXED_ADAM_FP32_GRADS`].
    pub fn of_recipe(precision: Precision, recipe: MixedRecipe) -> StatePrecision {
        match (precision, recipe) {
            (Precision::Bf16, _) => StatePrecision::BF16_ADAM,
            (Precision::Bf16Mixed | Precision::Fp16Mixed, MixedRecipe::LowModel) => StatePrecision::MIXED_ADAM,
            (Precision::Bf16Mixed | Precision::Fp16Mixed, MixedRecipe::LowModelFp32Grads) => StatePrecision::MIXED_ADAM_FP32_GRADS,
            (Precision::F32 | Precision::Bf16Mixed | Precision::Fp16Mixed, _) => StatePrecision::FP32_ADAM,
        }
    }
}

/// A model's byte figures at a plan's training precision, per sample: the graph's scaled to
/// the compute type's width for `f32` and `bf16` ([`TrainingBytes::scaled`]), an autocast run's
/// for the mixed modes (each value in the type autocast gives it: `solve::training_bytes`).
/// Made once per plan.
#[derive(Clone, Debug, Default)]
pub struct TrainingBytes {
    /// Per node (by `NodeId::index()`): its figures, the byte ones at the training precision.
    pub nodes: Vec<NodeFigures>,
    /// Per layer.
    pub layers: Vec<LayerBytes>,
}

impl TrainingBytes {
    /// The graph's own figures of `lg` at `dtype`'s width (one type throughout: `f32`, `bf16`,
    /// or another engine's mixed precision, whose model is 16-bit).
    pub fn scaled(lg: &LayeredGraph, dtype: DType) -> TrainingBytes {
        let scale = super::compute::bytes_scale(super::compute::graph_float_dtype(&lg.graph), dtype);
        TrainingBytes { nodes: lg.node_figures.iter().map(|f| super::compute::bytes_scaled(f, scale)).collect(), layers: lg.layers.iter().map(|l| l.bytes().scaled(scale)).collect() }
    }

    /// [`Self::scaled`] to `dtype`, the training loss's copies at `loss_width` bytes an element:
    /// the run's type in one type throughout (the runner widens only under autocast), 4 under
    /// an engine's mixed precision, which keeps the model in 16 bits and computes the loss in f32
    /// (torchtitan's `.float()` before its cross entropy, Megatron's cross entropy).
    pub fn scaled_with_loss(lg: &LayeredGraph, dtype: DType, loss_width: u64) -> TrainingBytes {
        let mut out = TrainingBytes::scaled(lg, dtype);
        let Some(loss) = lg.loss.filter(|l| l.width > 0) else { return out };
        let scale = super::compute::bytes_scale(super::compute::graph_float_dtype(&lg.graph), dtype);
        let wanted = loss_width as f64 / loss.width as f64;
        // what scaling made of the kept copy, set to the wanted width
        let kept = loss.kept_bytes * (wanted - scale);
        if let Some(n) = out.nodes.get_mut(loss.node.index()) {
            n.saved_bytes += kept;
        }
        if let Some(l) = lg.layers.iter().position(|l| l.nodes.contains(&loss.node)).and_then(|i| out.layers.get_mut(i)) {
            l.saved_bytes += kept;
            l.loss_kept_bytes = loss.kept_bytes * wanted;
        }
        out
    }

    /// Figures of node `id` (zero if out of range).
    pub fn node(&self, id: NodeId) -> NodeFigures {
        self.nodes.get(id.index()).copied().unwrap_or_default()
    }

    /// Byte figures of layer `layer` (zero if out of range).
    pub fn layer(&self, layer: usize) -> LayerBytes {
        self.layers.get(layer).copied().unwrap_or_default()
    }
}

/// Model-state bytes per device.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ModelState {
    /// Weights.
    pub params: f64,
    /// Gradients.
    pub grads: f64,
    /// Optimizer state.
    pub optimizer: f64,
}

impl ModelState {
    /// Sum of the three.
    pub fn total(&self) -> f64 {
        self.params + self.grads + self.optimizer
    }
}

/// Model state per device for `params` parameters, `trained` of them trained (frozen ones keep
/// no gradient or optimizer state), held by a data-parallel group of `dp` replicas under ZeRO
/// `zero` (0..=3; larger values act as 3).
pub fn model_state(params: f64, trained: f64, zero: u8, dp: usize, precision: StatePrecision) -> ModelState {
    let d = dp.max(1) as f64;
    let shard = |stage: u8| if zero >= stage { d } else { 1.0 };
    ModelState {
        params: params * precision.weight as f64 / shard(3),
        grads: trained * precision.grad as f64 / shard(2),
        optimizer: trained * precision.optimizer as f64 / shard(1),
    }
}

/// Activation bytes one layer keeps per microbatch of `batch` samples: everything its ops
/// save for backward, or only its input when checkpointed, less the inputs other layers read
/// too (its `shared_input_bytes`, which its stage holds once: [`stage_activation_bytes`]).
/// `bytes_scale` converts the graph's dtype to the training dtype (see `compute::bytes_scale`).
pub fn layer_activation_bytes(layer: &Layer, batch: f64, checkpointed: bool, bytes_scale: f64) -> f64 {
    let per_sample = if checkpointed {
        layer.input_bytes - layer.shared_input_bytes
    } else {
        layer.figures.saved_bytes - layer.shared_saved_bytes
    };
    per_sample.max(0.0) * batch * bytes_scale
}

/// Extra bytes while a checkpointed layer recomputes: its full saved activations for one
/// microbatch, minus the input already kept.
pub fn recompute_extra_bytes(layer: &Layer, batch: f64, bytes_scale: f64) -> f64 {
    ((layer.figures.saved_bytes - layer.input_bytes).max(0.0)) * batch * bytes_scale
}

/// Peak activation bytes of a stage: `in_flight` microbatches of every layer's kept bytes and
/// of the inputs its layers share (a mask, rotary tables: one tensor however many layers read
/// it), plus the largest recompute working set among its checkpointed layers.
pub fn stage_activation_bytes(layers: &[(&Layer, bool)], batch: f64, in_flight: f64, bytes_scale: f64) -> f64 {
    let shared = layers.iter().map(|&(l, _)| l.shared_input_bytes).fold(0.0, f64::max) * batch * bytes_scale;
    let kept: f64 = layers.iter().map(|&(l, ck)| layer_activation_bytes(l, batch, ck, bytes_scale)).sum::<f64>() + shared;
    let recompute = layers
        .iter()
        .filter(|&&(_, ck)| ck)
        .map(|&(l, _)| recompute_extra_bytes(l, batch, bytes_scale))
        .fold(0.0, f64::max);
    kept * in_flight + recompute
}

/// Microbatches whose activations pipeline rank `stage` (1-based, 1..=p) holds at its peak,
/// in units of the rank's whole activation set (all its virtual stages):
///
/// - GPipe: m.
/// - 1F1B: min(p − s + 1, m).
/// - Interleaved with v chunks: Megatron-LM runs min(2(p − s) + (v − 1)g + 1, m·v) chunk
///   forwards before the first backward (its warm-up count + 1; g = p when p divides m, see
///   `interleaved_round_size`), each chunk 1/v of the rank's layers: that count / v. For s = 1
///   and g = p this is p + (p − 1)/v, Korthikanti et al. 2022 §4.2.3's factor
///   p·(1 + (p − 1)/(p·v)). An average over the rank's chunks: the plan counts each chunk's
///   own ([`stage_in_flights`]).
/// - ZB-H1: min(p, m) on every rank (Qi et al. 2024 cap in-flight microbatches at 1F1B's
///   peak, p; later ranks defer W into that room): a layer keeping its activations holds them
///   to its W. A checkpointed layer runs its whole backward in the B, so its inputs are held
///   for [`kept_in_flight`]'s count.
pub fn in_flight(kind: ScheduleKind, p: usize, m: usize, stage: usize) -> f64 {
    let s = stage.clamp(1, p.max(1));
    match kind {
        ScheduleKind::GPipe => m as f64,
        ScheduleKind::OneFOneB => (p - s + 1).min(m) as f64,
        ScheduleKind::Interleaved { virtual_stages } => {
            let v = virtual_stages.max(1);
            let g = interleaved_round_size(p, m);
            (2 * (p - s) + (v - 1) * g + 1).min(m * v) as f64 / v as f64
        }
        ScheduleKind::ZbH1 => p.min(m) as f64,
    }
}

/// Per pipeline stage (0-based, `p`·v of them; stage s runs on rank s mod p), the most
/// microbatches whose activations it holds at once: forwards its rank has run and not yet
/// matched by their backward, in the order [`compute_actions`] gives the rank. Under
/// interleaving each chunk counts its own, which [`in_flight`]'s rank-wide average does not: the
/// last rank runs its last chunk's forward and backward back to back while its first chunk's
/// microbatches pile up (p 2, 4 microbatches, 2 chunks: 3 and 1, not 1.5 each). A rank's chunks
/// may peak at different moments, so their sum bounds its peak from above. Other schedules:
/// [`in_flight`] of the stage's rank.
pub fn stage_in_flights(kind: ScheduleKind, p: usize, m: usize) -> Vec<f64> {
    let stages = kind.stages(p.max(1));
    let ScheduleKind::Interleaved { .. } = kind else {
        return (0..stages).map(|s| in_flight(kind, p, m, s % p.max(1) + 1)).collect();
    };
    let Ok(ranks) = compute_actions(kind, p, m) else {
        return (0..stages).map(|s| in_flight(kind, p, m, s % p.max(1) + 1)).collect();
    };
    let (mut alive, mut most) = (vec![0usize; stages], vec![0usize; stages]);
    for a in ranks.iter().flatten().filter(|a| a.stage < stages) {
        match a.kind {
            ActionKind::Forward => {
                alive[a.stage] += 1;
                most[a.stage] = most[a.stage].max(alive[a.stage]);
            }
            ActionKind::Backward => alive[a.stage] = alive[a.stage].saturating_sub(1),
            _ => {}
        }
    }
    most.into_iter().map(|n| n as f64).collect()
}

/// Per pipeline rank, the moments of its schedule that may be its activation peak: after each
/// forward, how many microbatches each of its chunks holds (forwards run and not yet matched
/// by their backward), indexed by the rank's chunk (0..v), those no other moment holds at least
/// as many of in every chunk left out. A rank's kept activations at a moment are each chunk's
/// count times its bytes per microbatch; the peak is the largest moment, where the sum of each
/// chunk's own most ([`stage_in_flights`]) only bounds it. Only interleaved schedules run more
/// than one chunk per rank; for the others one moment per rank, its [`in_flight`].
pub fn rank_moments(kind: ScheduleKind, p: usize, m: usize) -> Vec<Vec<Vec<f64>>> {
    let p = p.max(1);
    let v = kind.virtual_stages().max(1);
    let single = || (1..=p).map(|s| vec![vec![in_flight(kind, p, m, s)]]).collect();
    if v == 1 {
        return single();
    }
    let Ok(ranks) = compute_actions(kind, p, m) else { return single() };
    ranks
        .iter()
        .enumerate()
        .map(|(r, actions)| {
            let mut alive = vec![0usize; v];
            // the counts after each forward that a backward follows (a forward followed by a
            // forward only adds), distinct
            let mut peaks: Vec<Vec<usize>> = Vec::new();
            let mut rising = false;
            for a in actions.iter().filter(|a| a.stage % p == r && a.stage / p < v) {
                match a.kind {
                    ActionKind::Forward => {
                        alive[a.stage / p] += 1;
                        rising = true;
                    }
                    ActionKind::Backward => {
                        if std::mem::take(&mut rising) {
                            peaks.push(alive.clone());
                        }
                        alive[a.stage / p] = alive[a.stage / p].saturating_sub(1);
                    }
                    _ => {}
                }
            }
            if rising {
                peaks.push(alive);
            }
            peaks.sort_unstable();
            peaks.dedup();
            // none another holds at least as many of in every chunk
            let kept: Vec<&Vec<usize>> = peaks.iter().filter(|a| !peaks.iter().any(|b| b != *a && a.iter().zip(b).all(|(x, y)| x <= y))).collect();
            kept.into_iter().map(|o| o.iter().map(|&n| n as f64).collect()).collect()
        })
        .collect()
}

/// Microbatches stage `stage` holds between a forward and its backward's B: what a
/// checkpointed layer keeps its inputs for (on the device or, offloaded, in host memory).
/// [`in_flight`], but under ZB-H1 1F1B's count (its B run where 1F1B's backwards do).
pub fn kept_in_flight(kind: ScheduleKind, p: usize, m: usize, stage: usize) -> f64 {
    match kind {
        ScheduleKind::ZbH1 => in_flight(ScheduleKind::OneFOneB, p, m, stage),
        other => in_flight(other, p, m, stage),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_divides_as_the_paper() {
        let psi = 7.5e9;
        let m = |z, d| model_state(psi, psi, z, d, StatePrecision::MIXED_ADAM).total();
        assert_eq!(m(0, 64), 16.0 * psi);
        assert_eq!(m(1, 64), 4.0 * psi + 12.0 * psi / 64.0);
        assert_eq!(m(2, 64), 2.0 * psi + 14.0 * psi / 64.0);
        assert_eq!(m(3, 64), 16.0 * psi / 64.0);
    }

    #[test]
    fn state_bytes_per_mode_and_stage() {
        // Derived from the mode's types: fp32 4 bytes, bf16 2; Adam's two moments; no master
        // copy (the mixed modes' weights are fp32 under autocast: they are the masters).
        let (psi, d) = (1.0e6, 8usize);
        for p in Precision::ALL {
            let low = if p == Precision::Bf16 { 2.0 } else { 4.0 };
            let (master, moments) = match p {
                Precision::Bf16 => (0.0, 2.0 * 2.0),
                Precision::F32 | Precision::Bf16Mixed | Precision::Fp16Mixed => (0.0, 2.0 * 4.0),
            };
            let sp = StatePrecision::of(p);
            let opt = master + moments;
            let df = d as f64;
            let st = |z| model_state(psi, psi, z, d, sp);
            assert_eq!(st(0).total(), psi * (low + low + opt), "{p}");
            assert_eq!(st(1).total(), psi * (low + low) + psi * opt / df, "{p}");
            assert_eq!(st(2).total(), psi * low + psi * (low + opt) / df, "{p}");
            assert_eq!(st(3).total(), psi * (low + low + opt) / df, "{p}");
        }
    }

    fn block(saved: f64, input: f64, shared: f64) -> Layer {
        Layer {
            index: 1,
            name: "layers.0".into(),
            kind: crate::ir::LayerKind::Block,
            nodes: Vec::new(),
            signature: String::new(),
            params: Vec::new(),
            shared_params: Vec::new(),
            inputs: Vec::new(),
            outputs: Vec::new(),
            figures: crate::ir::NodeFigures { saved_bytes: saved, ..Default::default() },
            input_bytes: input,
            offload_bytes: input - shared,
            output_bytes: input - shared,
            shared_input_bytes: shared,
            shared_saved_bytes: shared,
            selective_bytes: 0.0,
            selective_nodes: Vec::new(),
            op_selective: Default::default(),
            op_freed_bytes: 0.0,
            op_held_bytes: 0.0,
            loss_kept_bytes: 0.0,
        }
    }

    #[test]
    fn a_mask_every_layer_reads_is_held_once_per_stage() {
        // four blocks, each saving 100 bytes of its own and the 400-byte mask they all read
        let l = block(500.0, 410.0, 400.0);
        let stage = [(&l, false), (&l, false), (&l, false), (&l, false)];
        // 2 microbatches in flight of batch 3: 4 × 100 + one mask, not four
        assert_eq!(stage_activation_bytes(&stage, 3.0, 2.0, 1.0), 2.0 * 3.0 * (4.0 * 100.0 + 400.0));
        // checkpointed, each keeps its own 10-byte input and the stage the mask once; the
        // recompute set is the layer's saved bytes beyond its input
        let ck = [(&l, true), (&l, true)];
        assert_eq!(stage_activation_bytes(&ck, 1.0, 1.0, 1.0), 2.0 * 10.0 + 400.0 + 90.0);
    }

    #[test]
    fn a_rank_peaks_at_one_moment_of_its_chunks() {
        let il = ScheduleKind::Interleaved { virtual_stages: 2 };
        let moments = rank_moments(il, 2, 4);
        // every moment is within each chunk's own most, and some moment reaches each chunk's own
        let own = stage_in_flights(il, 2, 4);
        for (r, ms) in moments.iter().enumerate() {
            for (c, &most) in [own[r], own[r + 2]].iter().enumerate() {
                assert!(ms.iter().all(|o| o[c] <= most), "rank {r}: {ms:?} against {own:?}");
                assert!(ms.iter().any(|o| o[c] == most), "rank {r}: {ms:?} against {own:?}");
            }
            // none dominated by another
            for (i, a) in ms.iter().enumerate() {
                assert!(!ms.iter().enumerate().any(|(j, b)| i != j && a.iter().zip(b).all(|(x, y)| x <= y)), "{ms:?}");
            }
        }
        // rank 0 never holds its first chunk's 4 and its second chunk's 3 together
        assert!(moments[0].iter().all(|o| o[0] + o[1] < own[0] + own[2]), "{:?}", moments[0]);
        // one chunk per rank: one moment, the in-flight count
        assert_eq!(rank_moments(ScheduleKind::OneFOneB, 3, 8), vec![vec![vec![3.0]], vec![vec![2.0]], vec![vec![1.0]]]);
    }

    #[test]
    fn each_chunk_counts_its_own_microbatches_under_interleaving() {
        // p 2, 4 microbatches, 2 chunks (stages 0 and 2 on rank 0, 1 and 3 on rank 1): rank 1
        // runs its last stage's forward and backward back to back, its first stage's pile up
        let il = ScheduleKind::Interleaved { virtual_stages: 2 };
        assert_eq!(stage_in_flights(il, 2, 4), vec![4.0, 3.0, 2.0, 1.0]);
        // the rank-wide average it replaces: 2.5 and 1.5 for every chunk of the rank
        assert_eq!((in_flight(il, 2, 4, 1), in_flight(il, 2, 4, 2)), (2.5, 1.5));
        // without chunks, a stage's count is its rank's
        for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::ZbH1] {
            for (p, m) in [(1, 1), (2, 4), (4, 8), (4, 2)] {
                let want: Vec<f64> = (1..=p).map(|s| in_flight(kind, p, m, s)).collect();
                assert_eq!(stage_in_flights(kind, p, m), want, "{kind} p {p} m {m}");
            }
        }
    }

    #[test]
    fn in_flight_counts() {
        assert_eq!(in_flight(ScheduleKind::GPipe, 4, 8, 1), 8.0);
        assert_eq!(in_flight(ScheduleKind::OneFOneB, 4, 8, 1), 4.0);
        assert_eq!(in_flight(ScheduleKind::OneFOneB, 4, 8, 4), 1.0);
        assert_eq!(in_flight(ScheduleKind::OneFOneB, 4, 2, 1), 2.0);
        assert_eq!(in_flight(ScheduleKind::Interleaved { virtual_stages: 2 }, 4, 8, 1), 4.0 + 3.0 / 2.0);
    }
}
