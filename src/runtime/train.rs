//! Single-device training: loss, gradient accumulation over microbatches, gradient clipping
//! and AdamW — each mirroring PyTorch's defaults so losses match a PyTorch run step for step.

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use tch::{Kind, Reduction, Tensor};

use super::RuntimeError;
use super::checkpoint::{self, Checkpointing, Piece, Role, Slice};
use super::executor::Executor;
use super::ops::{DropoutKey, NormStats};
use super::weights::is_trainable;
use super::data::DataSource;
use super::npz;
use super::tensor::{is_float_kind, kind_of};
use crate::ir::{Dim, ValueId, ValueKind};

/// Which scalar is minimised.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LossKind {
    /// The model's own scalar output.
    Model,
    /// Cross-entropy of `logits[:, :-1]` against `input_ids[:, 1:]`.
    CausalLm,
    /// Cross-entropy of the logits against a `labels` array (ignore index −100).
    CrossEntropy,
    /// Mean squared error of the first output against a `targets` (or `labels`) array.
    Mse,
    /// A sequence-to-sequence model's loss: cross-entropy of the decoder's logits against a
    /// `labels` array (ignore index −100), as the model computes it from `labels`; the data's
    /// `decoder_input_ids` must be those labels shifted right by one (the model's
    /// `prepare_decoder_input_ids_from_labels`), which is checked.
    Seq2Seq,
}

impl LossKind {
    /// Parses a `--loss` value.
    pub fn parse(s: &str) -> Option<LossKind> {
        Some(match s {
            "model" => LossKind::Model,
            "causal-lm" => LossKind::CausalLm,
            "cross-entropy" => LossKind::CrossEntropy,
            "mse" => LossKind::Mse,
            "seq2seq" => LossKind::Seq2Seq,
            _ => return None,
        })
    }
}

/// AdamW hyper-parameters (PyTorch's defaults except lr and weight decay, which follow the
/// runner's contract: 1e-3 and 0.01 — also PyTorch's AdamW defaults).
#[derive(Clone, Copy, Debug)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// β₁, β₂.
    pub betas: (f64, f64),
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay, applied to every parameter as `torch.optim.AdamW` does.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig { lr: 1e-3, betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.01 }
    }
}

/// AdamW, as `torch.optim.AdamW`'s single-tensor path (what it runs on CPU).
pub struct AdamW {
    cfg: AdamWConfig,
    step: i32,
    state: Vec<(Tensor, Tensor)>,
}

impl AdamW {
    /// Sets the learning rate of the next steps (a schedule's value).
    pub fn set_lr(&mut self, lr: f64) {
        self.cfg.lr = lr;
    }

    /// Zeroed moments for each parameter.
    pub fn new(params: &[Tensor], cfg: AdamWConfig) -> Result<AdamW, RuntimeError> {
        let state = params
            .iter()
            .map(|p| Ok((p.f_zeros_like()?.f_detach()?, p.f_zeros_like()?.f_detach()?)))
            .collect::<Result<_, tch::TchError>>()?;
        Ok(AdamW { cfg, step: 0, state })
    }

    /// Moments restored from a checkpoint: `state` (first and second moment per parameter)
    /// after `step` updates.
    pub fn with_state(cfg: AdamWConfig, step: usize, state: Vec<(Tensor, Tensor)>) -> AdamW {
        AdamW { cfg, step: step as i32, state }
    }

    /// The moments (`exp_avg`, `exp_avg_sq`) of each parameter.
    pub fn state(&self) -> &[(Tensor, Tensor)] {
        &self.state
    }

    /// Bytes of the moments held.
    pub fn state_bytes(&self) -> u64 {
        self.state.iter().map(|(m, v)| (m.numel() * m.kind().elt_size_in_bytes() + v.numel() * v.kind().elt_size_in_bytes()) as u64).sum()
    }

    /// One update from the parameters' `.grad`; parameters without a gradient are skipped.
    pub fn step(&mut self, params: &[Tensor]) -> Result<(), RuntimeError> {
        let grads: Vec<Tensor> = params.iter().map(|p| p.f_grad()).collect::<Result<_, _>>()?;
        self.step_with(params, &grads)
    }

    /// One update of `params` (updated in place) from `grads` (undefined ones are skipped),
    /// with libtorch's fused AdamW kernel.
    pub fn step_with(&mut self, params: &[Tensor], grads: &[Tensor]) -> Result<(), RuntimeError> {
        self.step += 1;
        let AdamWConfig { lr, betas, eps, weight_decay } = self.cfg;
        let (mut ps, mut gs, mut ms, mut vs) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for ((p, g), (m, v)) in params.iter().zip(grads).zip(&self.state) {
            if g.defined() {
                ps.push(p);
                // the kernel walks each tensor's memory in order (a no-op for autograd's own)
                gs.push(g.f_contiguous()?);
                ms.push(m);
                vs.push(v);
            }
        }
        let update = super::grad::AdamWUpdate { lr, betas, eps, weight_decay, step: i64::from(self.step) };
        super::grad::fused_adamw(&ps, &gs.iter().collect::<Vec<_>>(), &ms, &vs, update)
    }
}

/// Scales gradients so their global L2 norm is at most `max_norm`, as
/// `torch.nn.utils.clip_grad_norm_` (per-tensor norms, norm of norms, coefficient clamped
/// to 1 and always applied). Returns the norm before clipping.
pub fn clip_grad_norm(params: &[Tensor], max_norm: f64) -> Result<f64, RuntimeError> {
    let _guard = tch::no_grad_guard();
    let grads: Vec<Tensor> = params.iter().map(|p| p.f_grad()).collect::<Result<_, _>>()?;
    let grads: Vec<Tensor> = grads.into_iter().filter(Tensor::defined).collect();
    if grads.is_empty() {
        return Ok(0.0);
    }
    let norms: Vec<Tensor> = grads.iter().map(|g| g.f_norm()).collect::<Result<_, _>>()?;
    let total = Tensor::f_stack(&norms, 0)?.f_norm()?;
    let coef = total.f_full_like(max_norm)?.f_div(&total.f_add_scalar(1e-6)?)?.f_clamp_max(1.0)?;
    for g in grads {
        let mut g = g;
        let _ = g.f_mul_(&coef)?;
    }
    Ok(total.f_double_value(&[])?)
}

/// One step's record (the contract's `steps` entries).
#[derive(Clone, Debug, serde::Serialize)]
pub struct StepRecord {
    /// Step number, from 1.
    pub step: usize,
    /// Mean loss over the global batch, before the update.
    pub loss: f64,
    /// Wall time of the step in seconds.
    pub time_s: f64,
    /// CPU time (user + system, all threads) this process spent in the step, in seconds
    /// (10 ms resolution; 0 where `/proc` is not readable). On a loaded machine it follows
    /// the work done better than the wall time.
    pub cpu_s: f64,
    /// Learning rate of the step's update.
    pub lr: f64,
}

/// CPU time (user + system) of this process so far, in seconds, from `/proc/self/stat`
/// (clock ticks of 1/100 s); 0 where it cannot be read.
pub fn process_cpu_s() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return 0.0 };
    // fields after the command name (which may hold spaces) in parentheses
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else { return 0.0 };
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name
    let tick = |i: usize| f.get(i).and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
    (tick(11) + tick(12)) as f64 / 100.0
}

/// One validation result (the `--json` contract's `eval` entries).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct EvalRecord {
    /// Optimizer steps taken before it (0: the initial weights).
    pub step: usize,
    /// Mean loss over the validation batches (forward only).
    pub loss: f64,
}

/// How the learning rate decays after its warm-up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LrShape {
    /// The base rate throughout.
    #[default]
    Constant,
    /// Half a cosine from the base rate towards `min_lr` (`torch.optim.lr_scheduler.CosineAnnealingLR`).
    Cosine,
    /// A straight line from the base rate towards `min_lr` (`LinearLR`).
    Linear,
}

impl LrShape {
    /// Parses a `--lr-schedule` value.
    pub fn parse(s: &str) -> Option<LrShape> {
        Some(match s {
            "constant" => LrShape::Constant,
            "cosine" => LrShape::Cosine,
            "linear" => LrShape::Linear,
            _ => return None,
        })
    }
}

/// The learning rate of each step: a linear warm-up over `warmup` steps, then `shape` over the
/// remaining `total − warmup`. Equals PyTorch's `SequentialLR([LinearLR(1/warmup, 1,
/// warmup−1), CosineAnnealingLR(total−warmup, min_lr)], [warmup])` (or `LinearLR(1,
/// min_lr/lr, total−warmup)` for `Linear`) stepped once per optimizer step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// The decay after the warm-up.
    pub shape: LrShape,
    /// The peak (base) learning rate.
    pub base: f64,
    /// Warm-up steps.
    pub warmup: usize,
    /// Where `Cosine` and `Linear` decay towards.
    pub min_lr: f64,
    /// Steps of the run.
    pub total: usize,
}

impl LrSchedule {
    /// A constant rate `lr`.
    pub fn constant(lr: f64) -> LrSchedule {
        LrSchedule { shape: LrShape::Constant, base: lr, warmup: 0, min_lr: 0.0, total: 0 }
    }

    /// The rate of step `step` (from 1): with i = step − 1 and W warm-up steps, `base·(i+1)/W`
    /// while i < W; then with j = i − W and D = total − W, `base` (constant), `min + (base −
    /// min)·(1 + cos(πj/D))/2` (cosine) or `base + (min − base)·j/D` (linear).
    pub fn lr(&self, step: usize) -> f64 {
        let i = step.saturating_sub(1);
        let LrSchedule { shape, base, warmup, min_lr, total } = *self;
        if i < warmup {
            return base * (i + 1) as f64 / warmup as f64;
        }
        let j = (i - warmup) as f64;
        let d = total.saturating_sub(warmup).max(1) as f64;
        match shape {
            LrShape::Constant => base,
            LrShape::Cosine => min_lr + (base - min_lr) * (1.0 + (std::f64::consts::PI * j / d).cos()) / 2.0,
            LrShape::Linear => base + (min_lr - base) * j.min(d) / d,
        }
    }
}

/// Sees each step and validation as it completes (the CLI draws its progress from it).
pub trait TrainObserver {
    /// Step `rec.step` is done (its loss is the global mean).
    fn on_step(&mut self, _rec: &StepRecord) {}
    /// A validation is done.
    fn on_eval(&mut self, _rec: &EvalRecord) {}
    /// A checkpoint is complete: its manifest was written to `manifest`.
    fn on_checkpoint(&mut self, _step: usize, _manifest: &Path) {}
}

/// An observer that ignores everything.
pub struct Quiet;

impl TrainObserver for Quiet {}

/// When validation runs: before the first step and after every `every`-th, on `batches`
/// batches of the validation data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EvalConfig {
    /// Steps between evaluations.
    pub every: usize,
    /// Batches per evaluation.
    pub batches: usize,
}

impl EvalConfig {
    /// Whether validation runs after step `step` (0: before training).
    pub fn due(&self, step: usize) -> bool {
        self.every > 0 && step % self.every == 0
    }
}

/// Settings of a training run.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Optimizer steps.
    pub steps: usize,
    /// Microbatches per step (the global batch is split along axis 0).
    pub microbatches: usize,
    /// What is minimised.
    pub loss: LossKind,
    /// Optimizer settings.
    pub adamw: AdamWConfig,
    /// Global gradient-norm limit (`None`: no clipping).
    pub clip: Option<f64>,
    /// Learning rate of each step (its base overrides `adamw.lr`).
    pub schedule: LrSchedule,
    /// Validation, with its data.
    pub eval: Option<EvalConfig>,
    /// The run's seed (Dropout masks, with the step, node and sample).
    pub seed: i64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        let adamw = AdamWConfig::default();
        TrainConfig { steps: 10, microbatches: 1, loss: LossKind::CausalLm, adamw, clip: Some(1.0), schedule: LrSchedule::constant(adamw.lr), eval: None, seed: 0 }
    }
}

/// A global batch: arrays keyed by graph input name, plus `labels`/`targets` if given.
pub type Batch = Vec<(String, Tensor)>;

/// Synthetic, seeded data for every required graph input: token ids in `[0, vocab)` for
/// integer inputs (masks get ones, position ids `0..S`), N(0, 1) for float inputs. Symbolic
/// axis 0 is the batch, other symbolic axes the sequence length.
pub fn synthetic_batch(exec: &Executor, batch: i64, seq_len: i64, seed: i64) -> Result<Batch, RuntimeError> {
    let graph = exec.graph();
    tch::manual_seed(seed);
    let vocab = vocab_size(exec);
    let mut out = Vec::new();
    for id in exec.required_inputs() {
        let v = graph.value(id);
        let terr = |m: String| RuntimeError::Train(format!("input `{}`: {m}", v.name));
        let Some(ty) = &v.ty else { return Err(terr("has no declared type; pass --data".into())) };
        let Some(shape) = &ty.shape else { return Err(terr("has no declared shape; pass --data".into())) };
        let dims: Vec<i64> = shape
            .0
            .iter()
            .enumerate()
            .map(|(i, d)| match d {
                Dim::Known(k) if i == 0 => batch.max(*k),
                Dim::Known(k) => *k,
                Dim::Sym(_) if i == 0 => batch,
                Dim::Sym(_) => seq_len,
            })
            .collect();
        let kind = kind_of(ty.dtype).map_err(terr)?;
        let name = v.name.to_lowercase();
        let cpu = tch::Device::Cpu;
        let t = if is_float_kind(kind) {
            Tensor::f_randn(&dims, (Kind::Float, cpu))?.f_to_kind(kind)?
        } else if name.contains("mask") {
            Tensor::f_ones(&dims, (kind, cpu))?
        } else if name.contains("position") {
            let s = *dims.last().unwrap_or(&1);
            Tensor::f_arange(s, (kind, cpu))?.f_expand(&dims, false)?.f_contiguous()?
        } else if name.contains("token_type") {
            Tensor::f_zeros(&dims, (kind, cpu))?
        } else {
            let Some(vocab) = vocab else {
                return Err(terr("cannot tell the vocabulary size for synthetic ids; pass --data".into()));
            };
            Tensor::f_randint_low(0, vocab, &dims, (Kind::Int64, cpu))?.f_to_kind(kind)?
        };
        out.push((v.name.clone(), t));
    }
    Ok(out)
}

/// The vocabulary: the last axis of a rank-3 float output if known, else the row count of the
/// largest 2-D float initializer (the embedding).
pub(super) fn vocab_size(exec: &Executor) -> Option<i64> {
    let graph = exec.graph();
    for &o in &graph.outputs {
        if let Some(ty) = &graph.value(o).ty {
            if let Some(s) = &ty.shape {
                if s.rank() == 3 && ty.dtype.is_float() {
                    if let Some(Dim::Known(v)) = s.0.last() {
                        return Some(*v);
                    }
                }
            }
        }
    }
    graph
        .initializers()
        .filter_map(|id| graph.value(id).data.as_ref())
        .filter(|d| d.dims.len() == 2 && d.dtype.is_float())
        .max_by_key(|d| d.dims[0] * d.dims[1])
        .map(|d| d.dims[0])
}

/// Reads a data file: `.npz` (arrays by name), `.safetensors` (tensors by name) or `.npy` (the
/// single required input).
pub fn read_batch(exec: &Executor, path: &Path) -> Result<Batch, RuntimeError> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let ferr = |m: String| RuntimeError::File { path: path.display().to_string(), message: m };
    match ext {
        "npz" => npz::read_npz(path),
        "safetensors" => Tensor::read_safetensors(path).map_err(|e| ferr(format!("not readable safetensors: {e}"))),
        "npy" => {
            let inputs = exec.required_inputs();
            let [only] = inputs.as_slice() else {
                return Err(ferr(format!(
                    "a .npy holds one array but the graph has {} inputs; use .npz keyed by input name",
                    inputs.len()
                )));
            };
            Ok(vec![(exec.graph().value(*only).name.clone(), npz::read_npy(path)?)])
        }
        _ => Err(ferr("data must be .npy, .npz or .safetensors".into())),
    }
}

/// Splits each array of a batch into `m` equal microbatches along axis 0.
pub fn split_batch(batch: &Batch, m: usize) -> Result<Vec<Batch>, RuntimeError> {
    let mut out: Vec<Batch> = (0..m).map(|_| Vec::new()).collect();
    for (name, t) in batch {
        let b = t.size().first().copied().unwrap_or(0);
        if b % m as i64 != 0 {
            return Err(RuntimeError::Train(format!(
                "array `{name}` has batch {b}, not divisible into {m} microbatches"
            )));
        }
        for (i, part) in t.f_split(b / m as i64, 0)?.into_iter().enumerate() {
            out[i].push((name.clone(), part));
        }
    }
    Ok(out)
}

/// The loss of one microbatch from the model's outputs: the mean over its counted targets.
pub fn loss_of(exec: &Executor, kind: LossKind, mb: &Batch, outs: &[Tensor]) -> Result<Tensor, RuntimeError> {
    Ok(loss_sum_of(exec, kind, mb, outs)?.f_div_scalar(target_count(exec, kind, mb)?)?)
}

/// The loss of one microbatch summed over its counted targets (tokens whose label is not
/// -100, squared errors, or the model's own mean loss times its rows). A step's loss is the sum
/// over its microbatches and replicas divided by [`global_target_count`], so it is the mean over
/// the whole global batch whatever the microbatch count (as PyTorch computes it on the whole
/// batch, and as Hugging Face's `num_items_in_batch` does under gradient accumulation).
pub fn loss_sum_of(exec: &Executor, kind: LossKind, mb: &Batch, outs: &[Tensor]) -> Result<Tensor, RuntimeError> {
    let first_float = outs.iter().find(|t| is_float_kind(t.kind())).ok_or_else(|| train_err("the model has no float output"))?;
    Ok(match kind {
        LossKind::Model => {
            let t = outs
                .iter()
                .find(|t| t.numel() == 1 && is_float_kind(t.kind()))
                .ok_or_else(|| train_err("the model has no scalar output; pass --loss causal-lm|cross-entropy|mse"))?;
            // the model's loss is a mean over its rows
            t.f_reshape([0i64; 0])?.f_mul_scalar(batch_rows(mb)?)?
        }
        LossKind::CausalLm => {
            let logits = outs
                .iter()
                .find(|t| t.dim() == 3 && is_float_kind(t.kind()))
                .ok_or_else(|| train_err("causal-lm needs a [batch, seq, vocab] logits output"))?;
            let (_, s, v) = logits.size3()?;
            let pred = logits.f_narrow(1, 0, s - 1)?.f_reshape([-1, v])?;
            let target = causal_targets(exec, mb)?;
            pred.f_cross_entropy_loss(&target, None::<&Tensor>, Reduction::Sum, IGNORE_INDEX, 0.0)?
        }
        LossKind::CrossEntropy | LossKind::Seq2Seq => {
            if kind == LossKind::Seq2Seq {
                check_decoder_inputs(mb)?;
            }
            let v = *first_float.size().last().unwrap_or(&1);
            let pred = first_float.f_reshape([-1, v])?;
            pred.f_cross_entropy_loss(&class_labels(mb)?, None::<&Tensor>, Reduction::Sum, IGNORE_INDEX, 0.0)?
        }
        LossKind::Mse => {
            let target = regression_targets(mb)?;
            first_float.f_mse_loss(&target.f_to_kind(first_float.kind())?, Reduction::Sum)?
        }
    })
}

/// Label value that no loss counts (PyTorch's `ignore_index` default).
pub const IGNORE_INDEX: i64 = -100;

/// How many targets of `mb` the loss counts: labels other than [`IGNORE_INDEX`], regression
/// target elements, or the rows of a model that computes its own (mean) loss.
pub fn target_count(exec: &Executor, kind: LossKind, mb: &Batch) -> Result<f64, RuntimeError> {
    let counted = |t: &Tensor| -> Result<f64, RuntimeError> { Ok(t.f_ne(IGNORE_INDEX)?.f_sum(Kind::Int64)?.f_int64_value(&[])? as f64) };
    match kind {
        LossKind::Model => batch_rows(mb),
        LossKind::CausalLm => counted(&causal_targets(exec, mb)?),
        LossKind::CrossEntropy | LossKind::Seq2Seq => counted(&class_labels(mb)?),
        LossKind::Mse => Ok(regression_targets(mb)?.numel() as f64),
    }
}

/// The targets counted in global batch `k` of `data`, over every replica and microbatch.
pub fn global_target_count(exec: &Executor, kind: LossKind, data: &DataSource, k: usize) -> Result<f64, RuntimeError> {
    let whole = data.replica_microbatches(k, 0, 1, 1)?;
    let n = whole.iter().map(|mb| target_count(exec, kind, mb)).sum::<Result<f64, _>>()?;
    if n <= 0.0 {
        return Err(train_err(&format!("batch {k} of the data has no counted target (every label is {IGNORE_INDEX}); its loss is undefined")));
    }
    Ok(n)
}

fn train_err(m: &str) -> RuntimeError {
    RuntimeError::Train(m.to_string())
}

/// Samples in a batch: the first dim of its arrays.
fn batch_rows(mb: &Batch) -> Result<f64, RuntimeError> {
    let (_, t) = mb.first().ok_or_else(|| train_err("a model that computes its own loss needs --data with its inputs"))?;
    Ok(t.size().first().copied().unwrap_or(1) as f64)
}

fn find_array<'b>(mb: &'b Batch, keys: &[&str]) -> Option<&'b Tensor> {
    mb.iter().find(|(n, _)| keys.contains(&n.as_str())).map(|(_, t)| t)
}

/// The next-token targets of a causal LM: the token ids shifted by one, flattened.
fn causal_targets(exec: &Executor, mb: &Batch) -> Result<Tensor, RuntimeError> {
    let graph = exec.graph();
    let ids = exec
        .required_inputs()
        .into_iter()
        .filter(|&id| {
            let v = graph.value(id);
            v.kind == ValueKind::Input && v.ty.as_ref().is_some_and(|t| t.dtype.is_int())
        })
        .max_by_key(|&id| graph.value(id).name.contains("input_ids"))
        .ok_or_else(|| train_err("causal-lm needs an integer token-id input"))?;
    let name = &graph.value(ids).name;
    let ids = mb.iter().find(|(n, _)| n == name).map(|(_, t)| t).ok_or_else(|| train_err("token ids missing"))?;
    let s = ids.size().get(1).copied().ok_or_else(|| train_err("causal-lm needs [batch, seq] token ids"))?;
    Ok(ids.f_narrow(1, 1, s - 1)?.f_reshape([-1])?.f_to_kind(Kind::Int64)?)
}

fn class_labels(mb: &Batch) -> Result<Tensor, RuntimeError> {
    let labels = find_array(mb, &["labels", "label", "targets"]).ok_or_else(|| train_err("cross-entropy needs a `labels` array in --data"))?;
    Ok(labels.f_reshape([-1])?.f_to_kind(Kind::Int64)?)
}

/// Graph input of a sequence-to-sequence model's decoder tokens (Hugging Face's name).
pub const DECODER_INPUT_IDS: &str = "decoder_input_ids";

/// Refuses a batch whose `decoder_input_ids` (where it holds them) are not its `labels`
/// shifted right by one: the decoder would be taught to predict other tokens than it reads.
fn check_decoder_inputs(mb: &Batch) -> Result<(), RuntimeError> {
    let (Some(dec), Some(labels)) = (find_array(mb, &[DECODER_INPUT_IDS]), find_array(mb, &["labels"])) else {
        return Ok(());
    };
    let (d, l) = (dec.size(), labels.size());
    if d.len() != 2 || d != l {
        return Err(train_err(&format!("seq2seq: `{DECODER_INPUT_IDS}` is {d:?} and `labels` {l:?}; both must be [batch, target length]")));
    }
    let s = l[1];
    let prev = labels.f_narrow(1, 0, s - 1)?.f_to_kind(Kind::Int64)?;
    let next = dec.f_narrow(1, 1, s - 1)?.f_to_kind(Kind::Int64)?;
    let counted = prev.f_ne(IGNORE_INDEX)?;
    let wrong = next.f_ne_tensor(&prev)?.f_logical_and(&counted)?.f_sum(Kind::Int64)?.f_int64_value(&[])?;
    if wrong > 0 {
        return Err(train_err(&format!(
            "seq2seq: `{DECODER_INPUT_IDS}` are not `labels` shifted right by one ({wrong} tokens differ); make them with the model's \
             `prepare_decoder_input_ids_from_labels(labels=labels)`"
        )));
    }
    Ok(())
}

fn regression_targets(mb: &Batch) -> Result<&Tensor, RuntimeError> {
    find_array(mb, &["targets", "target", "labels"]).ok_or_else(|| train_err("mse needs a `targets` array in --data"))
}

/// Trains on one fixed global batch for `cfg.steps` steps; returns one record per step.
pub fn train(exec: &Executor, batch: &Batch, cfg: &TrainConfig) -> Result<Vec<StepRecord>, RuntimeError> {
    let fixed = DataSource::Fixed(batch.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect());
    Ok(train_on(exec, &fixed, None, cfg, &mut Quiet)?.0)
}

/// Trains for `cfg.steps` steps on `data` (step k reads its k-th global batch), validating on
/// `eval_data` as `cfg.eval` says, telling `obs` as it goes; returns one record per step and
/// per evaluation.
pub fn train_on(
    exec: &Executor,
    data: &DataSource,
    eval_data: Option<&DataSource>,
    cfg: &TrainConfig,
    obs: &mut dyn TrainObserver,
) -> Result<(Vec<StepRecord>, Vec<EvalRecord>), RuntimeError> {
    train_with(exec, data, eval_data, cfg, &Checkpointing::default(), obs)
}

/// [`train_on`] writing checkpoints and resuming as `ckpt` says: a resumed run continues with
/// the step after the checkpoint's (its parameters are already in `exec`'s weights; the
/// moments are restored here) and returns records of the steps it ran.
pub fn train_with(
    exec: &Executor,
    data: &DataSource,
    eval_data: Option<&DataSource>,
    cfg: &TrainConfig,
    ckpt: &Checkpointing<'_>,
    obs: &mut dyn TrainObserver,
) -> Result<(Vec<StepRecord>, Vec<EvalRecord>), RuntimeError> {
    let graph = exec.graph();
    // the order of `Executor::parameters`
    let mut ids: Vec<ValueId> = exec.weights.keys().copied().filter(|&id| is_trainable(graph, id)).collect();
    ids.sort();
    let params: Vec<Tensor> = ids.iter().map(|id| exec.weights[id].shallow_clone()).collect();
    if params.is_empty() {
        return Err(RuntimeError::Train("the model has no trainable initializers".into()));
    }
    let start = ckpt.start_step();
    let mut opt = match ckpt.resume {
        None => AdamW::new(&params, cfg.adamw)?,
        Some(l) => {
            let mut moments = checkpoint::restore_moments(l, graph, &ids, params[0].kind())?;
            let state = ids.iter().map(|v| moments.remove(v).ok_or_else(|| RuntimeError::Train("moment missing".into()))).collect::<Result<_, _>>()?;
            AdamW::with_state(cfg.adamw, l.manifest.state.adamw_step, state)
        }
    };
    let m = cfg.microbatches.max(1);
    let input_names: HashMap<&str, ()> = exec.graph().inputs.iter().map(|&v| (exec.graph().value(v).name.as_str(), ())).collect();
    let feeds_of = |mb: &Batch| {
        let feeds: Vec<(String, Tensor)> =
            mb.iter().filter(|(n, _)| input_names.contains_key(n.as_str())).map(|(n, t)| (n.clone(), t.shallow_clone())).collect();
        exec.bind_inputs(feeds)
    };
    let evaluation = match (cfg.eval, eval_data) {
        (Some(e), Some(d)) => Some((e, d)),
        _ => None,
    };
    let mut evals = Vec::new();
    let validate = |step: usize, evals: &mut Vec<EvalRecord>, obs: &mut dyn TrainObserver| -> Result<(), RuntimeError> {
        if let Some((e, d)) = evaluation.filter(|(e, _)| e.due(step)) {
            let mut sum = 0.0;
            exec.set_norm_stats(NormStats::Running);
            exec.set_dropout_key(None);
            for k in 1..=e.batches {
                let scale = 1.0 / global_target_count(exec, cfg.loss, d, k)?;
                for mb in d.replica_microbatches(k, 0, 1, m)? {
                    let outs = tch::no_grad(|| exec.forward(&feeds_of(&mb)?))?;
                    sum += loss_sum_of(exec, cfg.loss, &mb, &outs)?.f_double_value(&[])? * scale;
                }
            }
            let rec = EvalRecord { step, loss: sum / e.batches.max(1) as f64 };
            obs.on_eval(&rec);
            evals.push(rec);
        }
        Ok(())
    };
    if start == 0 {
        validate(0, &mut evals, obs)?;
    }
    let mut records = Vec::with_capacity(cfg.steps.saturating_sub(start));
    for step in start + 1..=cfg.steps {
        let t0 = Instant::now();
        let c0 = process_cpu_s();
        let micro = data.replica_microbatches(step, 0, 1, m)?;
        for p in &params {
            let g = p.f_grad()?;
            if g.defined() {
                let mut g = g;
                let _ = g.f_zero_()?;
            }
        }
        let mut total = 0.0;
        let scale = 1.0 / global_target_count(exec, cfg.loss, data, step)?;
        exec.set_norm_stats(NormStats::Batch { update: true });
        let per = data.global_batch() / m as i64;
        for (i, mb) in micro.iter().enumerate() {
            exec.set_dropout_key(Some(DropoutKey { seed: cfg.seed, step: step as i64, first_sample: i as i64 * per }));
            let feeds = feeds_of(mb)?;
            let outs = exec.forward(&feeds)?;
            let loss = loss_sum_of(exec, cfg.loss, mb, &outs)?.f_mul_scalar(scale)?;
            loss.f_backward()?;
            total += loss.f_double_value(&[])?;
        }
        if let Some(c) = cfg.clip {
            clip_grad_norm(&params, c)?;
        }
        let lr = cfg.schedule.lr(step);
        opt.set_lr(lr);
        opt.step(&params)?;
        let rec = StepRecord { step, loss: total, time_s: t0.elapsed().as_secs_f64(), cpu_s: process_cpu_s() - c0, lr };
        obs.on_step(&rec);
        records.push(rec);
        validate(step, &mut evals, obs)?;
        if let Some(save) = ckpt.save.as_ref().filter(|s| s.due(step)) {
            let dir = checkpoint::step_dir(&save.root, step);
            checkpoint::begin(&dir)?;
            let mut pieces = Vec::with_capacity(3 * ids.len());
            for (i, &v) in ids.iter().enumerate() {
                let (exp_avg, exp_avg_sq) = &opt.state()[i];
                for (role, t) in [(Role::Param, &params[i]), (Role::ExpAvg, exp_avg), (Role::ExpAvgSq, exp_avg_sq)] {
                    pieces.push(Piece {
                        name: checkpoint::param_name(graph, v),
                        role,
                        shape: t.size(),
                        transposed: checkpoint::is_transposed(graph, v),
                        slice: Slice::whole(),
                        tensor: t.f_detach()?,
                    });
                }
            }
            pieces.extend(checkpoint::buffer_pieces(graph, |v| exec.weights.get(&v).map(|w| (w.shallow_clone(), Slice::whole())))?);
            checkpoint::write_shard(&dir, 0, &pieces)?;
            checkpoint::fault_point(0, step);
            let manifest = checkpoint::write_manifest(&dir, save.state(step, 1))?;
            if let Some(k) = save.keep {
                checkpoint::prune(&save.root, k)?;
            }
            obs.on_checkpoint(step, &manifest);
        }
    }
    Ok((records, evals))
}
