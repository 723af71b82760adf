//! What a user asks of a run (the runner's flags as one typed struct), checked once: each
//! refusal names the flag and the fix.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tch::Kind;

pub use crate::passes::params::ParamOptions;
use crate::ir::Precision;
use crate::runtime::InitMode;
use crate::runtime::device::DeviceRequest;
pub use crate::runtime::state::checkpoint::OnCheckpointError;
use crate::runtime::train::{AdamWConfig, Autocast, LossScaleConfig, EvalConfig, LossKind, LrSchedule, LrShape};

use super::SessionError;

/// The element type floating-point tensors run in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FloatType {
    /// 32-bit floats.
    #[default]
    F32,
    /// 64-bit floats (the verification type: runs equal to the last bits).
    F64,
    /// bfloat16 throughout.
    Bf16,
}

impl FloatType {
    /// The `--dtype` spelling: `f32`, `f64` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            FloatType::F32 => "f32",
            FloatType::F64 => "f64",
            FloatType::Bf16 => "bf16",
        }
    }

    /// The type a plan trained in `precision` keeps its weights in, with `--dtype` as `given`:
    /// - `--dtype f64` is the verification override, taken on any plan (no autocast, no loss
    ///   scale: every equality test runs so);
    /// - otherwise the plan's precision: `f32` runs in f32, `bf16` in bf16 throughout (bf16
    ///   weights, gradients and AdamW moments: the runner's `--dtype bf16`), and the mixed modes
    ///   keep fp32 weights (the masters) under a low-precision autocast ([`Autocast::of`]); a
    ///   `--dtype` that differs from it is refused, naming both and how to re-plan.
    pub fn for_plan(precision: Precision, given: Option<FloatType>, plan: &Path) -> Result<FloatType, String> {
        if given == Some(FloatType::F64) {
            return Ok(FloatType::F64);
        }
        let runs = match precision {
            Precision::F32 | Precision::Bf16Mixed | Precision::Fp16Mixed => FloatType::F32,
            Precision::Bf16 => FloatType::Bf16,
        };
        match given {
            Some(g) if g != runs || precision.is_mixed() => Err(format!(
                "--dtype {g} contradicts plan `{}`, made for {precision} precision (parallel.precision); drop --dtype, or re-plan with `smp-partition … --precision {}`",
                plan.display(),
                Precision::ALL.into_iter().find(|p| p.compute_dtype() == g.dtype() && !p.is_mixed()).unwrap_or(Precision::F32)
            )),
            _ => Ok(runs),
        }
    }

    /// The IR dtype of the type.
    fn dtype(self) -> crate::ir::DType {
        match self {
            FloatType::F32 => crate::ir::DType::F32,
            FloatType::F64 => crate::ir::DType::F64,
            FloatType::Bf16 => crate::ir::DType::BF16,
        }
    }

    /// The tch kind.
    pub(crate) fn kind(self) -> Kind {
        match self {
            FloatType::F32 => Kind::Float,
            FloatType::F64 => Kind::Double,
            FloatType::Bf16 => Kind::BFloat16,
        }
    }
}

impl std::fmt::Display for FloatType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for FloatType {
    type Err = String;
    /// `f32`, `f64` or `bf16` (`--dtype`).
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(FloatType::F32),
            "f64" => Ok(FloatType::F64),
            "bf16" => Ok(FloatType::Bf16),
            _ => Err(format!("`{s}`: expected f32, f64 or bf16")),
        }
    }
}

/// How weights are materialised.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InitChoice {
    /// Read every weight (external files must be present).
    #[default]
    Load,
    /// Seeded random values for external weights, without reading their files (the run's seed).
    Random,
}

impl std::str::FromStr for InitChoice {
    type Err = String;
    /// `load` or `random` (`--init`).
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "load" => Ok(InitChoice::Load),
            "random" => Ok(InitChoice::Random),
            _ => Err(format!("`{s}`: expected load or random")),
        }
    }
}

/// The optimizer and learning rate of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerOptions {
    /// Peak learning rate (`--lr`).
    pub lr: f64,
    /// AdamW's decoupled weight decay (`--weight-decay`).
    pub weight_decay: f64,
    /// Decay after the warm-up (`--lr-schedule`).
    pub schedule: LrShape,
    /// Steps of linear warm-up (`--warmup-steps`).
    pub warmup_steps: usize,
    /// Where cosine and linear schedules decay towards (`--min-lr`).
    pub min_lr: f64,
    /// Global gradient-norm limit; 0 disables clipping (`--clip`).
    pub clip: f64,
}

impl Default for OptimizerOptions {
    fn default() -> Self {
        OptimizerOptions { lr: 1e-3, weight_decay: 0.01, schedule: LrShape::Constant, warmup_steps: 0, min_lr: 0.0, clip: 1.0 }
    }
}

/// Training and validation data of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct DataOptions {
    /// A token file, or one batch repeated every step; none: seeded synthetic data (`--data`).
    pub train: Option<PathBuf>,
    /// Validation data (`--eval-data`).
    pub eval: Option<PathBuf>,
    /// Validate before the first step and after every N-th (`--eval-every`; default: before
    /// and after the run).
    pub eval_every: Option<usize>,
    /// Global batches per validation (`--eval-batches`).
    pub eval_batches: usize,
}

impl Default for DataOptions {
    fn default() -> Self {
        DataOptions { train: None, eval: None, eval_every: None, eval_batches: 8 }
    }
}

/// Checkpoints of a run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CheckpointOptions {
    /// Where to write them (`--checkpoint-dir`).
    pub dir: Option<PathBuf>,
    /// After every N-th step (`--checkpoint-every`; default: after the last).
    pub every: Option<usize>,
    /// Keep only the K newest (`--keep`).
    pub keep: Option<usize>,
    /// Continue from this checkpoint (`--resume`: a `step-N` directory, or a checkpoint
    /// directory, its newest complete one).
    pub resume: Option<PathBuf>,
    /// What to do when a checkpoint cannot be written (`--on-checkpoint-error`).
    pub on_error: OnCheckpointError,
}

/// Everything a run is asked (`smp-runner train`/`run`).
#[derive(Clone, Debug, PartialEq)]
pub struct RunOptions {
    /// Optimizer steps of the whole run (`--steps`; a resumed run continues to it).
    pub steps: usize,
    /// Global batch without a plan (`--batch`; a plan's run takes the plan's).
    pub batch: i64,
    /// Sequence length of token windows and synthetic data (`--seq-len`; a plan's run takes
    /// the plan's, and another value is refused).
    pub seq_len: Option<i64>,
    /// Microbatches per step without a plan (`--microbatches`).
    pub microbatches: usize,
    /// What is minimised (`--loss`; default [`LossKind::infer`]).
    pub loss: Option<LossKind>,
    /// Optimizer and learning rate.
    pub optimizer: OptimizerOptions,
    /// Floating-point type of the run (`--dtype`); none: a plan's precision
    /// ([`FloatType::for_plan`]), f32 without a plan.
    pub dtype: Option<FloatType>,
    /// Data.
    pub data: DataOptions,
    /// Seed of random weights, synthetic data, the sample order and dropout masks (`--seed`).
    pub seed: i64,
    /// How weights are materialised (`--init`).
    pub init: InitChoice,
    /// Intra-op threads (`--threads`; default: libtorch's choice).
    pub threads: Option<i32>,
    /// Seconds any collective or receive may wait (`--timeout`).
    pub timeout: Duration,
    /// Each rank prints `[rank R] step N` on stderr after every step (`--progress`).
    pub progress: bool,
    /// A rank whose busy time per step exceeds the median rank's by this factor is named a
    /// straggler (`--straggler-factor`).
    pub straggler_factor: f64,
    /// Steps per straggler window (`--straggler-window`; 0: no straggler watch).
    pub straggler_window: usize,
    /// `--trainable`/`--frozen` patterns.
    pub params: ParamOptions,
    /// After training, write the trained model's tensors under module parameter names
    /// (`--save-weights FILE`, `.safetensors` or `.npz`), whatever the plan.
    pub save_weights: Option<PathBuf>,
    /// Checkpoints.
    pub checkpoints: CheckpointOptions,
    /// Training precision (`--precision`): a run without a plan trains in it; a plan's run
    /// takes the plan's and refuses another.
    pub precision: Option<Precision>,
    /// Mixed precision: set from the precision when the session opens (never under
    /// `--dtype f64`).
    pub autocast: Option<Autocast>,
    /// fp16's loss scale (`--loss-scale`, `--loss-scale-window`).
    pub loss_scale: LossScaleConfig,
    /// Where tensors live and how ranks talk (`--device`, `--share-gpu`).
    pub device: DeviceRequest,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            steps: 10,
            batch: 8,
            seq_len: None,
            microbatches: 1,
            loss: None,
            optimizer: OptimizerOptions::default(),
            dtype: None,
            data: DataOptions::default(),
            seed: 0,
            init: InitChoice::Load,
            threads: None,
            timeout: Duration::from_secs(300),
            progress: false,
            straggler_factor: 1.5,
            straggler_window: 5,
            params: ParamOptions::default(),
            save_weights: None,
            checkpoints: CheckpointOptions::default(),
            precision: None,
            autocast: None,
            loss_scale: LossScaleConfig::default(),
            device: DeviceRequest::default(),
        }
    }
}

/// Sequence length of synthetic data and token windows without a plan or `--seq-len`.
pub const DEFAULT_SEQ_LEN: i64 = 128;

fn refuse(m: impl Into<String>) -> SessionError {
    SessionError::Options(m.into())
}

impl RunOptions {
    /// Refuses flags that cannot be taken together or out of range, naming them.
    pub fn check(&self) -> Result<(), SessionError> {
        let o = &self.optimizer;
        if !(o.lr > 0.0 && o.lr.is_finite()) {
            return Err(refuse(format!("--lr {} must be a positive number", o.lr)));
        }
        if !(0.0..=o.lr).contains(&o.min_lr) {
            return Err(refuse(format!("--min-lr {} must lie between 0 and --lr {}", o.min_lr, o.lr)));
        }
        if self.data.eval.is_none() && self.data.eval_every.is_some() {
            return Err(refuse("--eval-every needs --eval-data (the validation data)"));
        }
        if self.data.eval.is_some() && self.data.eval_batches == 0 {
            return Err(refuse("--eval-batches must be at least 1"));
        }
        let c = &self.checkpoints;
        if c.dir.is_none() && (c.every.is_some() || c.keep.is_some()) {
            return Err(refuse("--checkpoint-every and --keep need --checkpoint-dir"));
        }
        if c.every == Some(0) || c.keep == Some(0) {
            return Err(refuse("--checkpoint-every and --keep must be at least 1"));
        }
        let ls = &self.loss_scale;
        if !(ls.initial > 0.0 && ls.initial.is_finite() && (ls.initial as f32).is_finite()) {
            return Err(refuse(format!("--loss-scale {} must be a positive number within fp32's range", ls.initial)));
        }
        if ls.growth_interval == 0 {
            return Err(refuse("--loss-scale-window must be at least 1"));
        }
        if !(self.straggler_factor > 1.0 && self.straggler_factor.is_finite()) {
            return Err(refuse(format!("--straggler-factor {} must be a number above 1", self.straggler_factor)));
        }
        if let Some(p) = &self.save_weights {
            if !matches!(p.extension().and_then(|e| e.to_str()), Some("safetensors" | "npz")) {
                return Err(refuse(format!("--save-weights writes `.safetensors` or `.npz`, not `{}`", p.display())));
            }
        }
        Ok(())
    }

    /// The floating-point type the run computes in: `--dtype`, else f32 (a plan's run has it
    /// set from the plan's precision when the session opens).
    pub fn float_type(&self) -> FloatType {
        self.dtype.unwrap_or_default()
    }

    /// The learning rate of each step.
    pub fn schedule(&self) -> LrSchedule {
        let o = &self.optimizer;
        LrSchedule { shape: o.schedule, base: o.lr, warmup: o.warmup_steps, min_lr: o.min_lr, total: self.steps }
    }

    /// When validation runs, if there is validation data.
    pub fn eval(&self) -> Option<EvalConfig> {
        self.data.eval.as_ref().map(|_| EvalConfig { every: self.data.eval_every.unwrap_or(self.steps).max(1), batches: self.data.eval_batches })
    }

    /// AdamW's settings.
    pub fn adamw(&self) -> AdamWConfig {
        AdamWConfig { lr: self.optimizer.lr, weight_decay: self.optimizer.weight_decay, ..AdamWConfig::default() }
    }

    /// The gradient-norm limit, if clipping.
    pub fn clip(&self) -> Option<f64> {
        (self.optimizer.clip > 0.0).then_some(self.optimizer.clip)
    }

    /// How initializers are materialised.
    pub fn init_mode(&self) -> InitMode {
        match self.init {
            InitChoice::Load => InitMode::Load,
            InitChoice::Random => InitMode::Random { seed: self.seed },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plans_precision_decides_the_run_type() {
        let p = Path::new("plan.json");
        assert_eq!(FloatType::for_plan(Precision::F32, None, p), Ok(FloatType::F32));
        assert_eq!(FloatType::for_plan(Precision::F32, Some(FloatType::F32), p), Ok(FloatType::F32));
        assert_eq!(FloatType::for_plan(Precision::Bf16, None, p), Ok(FloatType::Bf16));
        // the verification override, on every plan
        for prec in Precision::ALL {
            assert_eq!(FloatType::for_plan(prec, Some(FloatType::F64), p), Ok(FloatType::F64));
        }
        let e = FloatType::for_plan(Precision::F32, Some(FloatType::Bf16), p).unwrap_err();
        assert!(e.contains("--dtype bf16") && e.contains("f32 precision") && e.contains("plan.json") && e.contains("--precision bf16"), "{e}");
        let e = FloatType::for_plan(Precision::Bf16, Some(FloatType::F32), p).unwrap_err();
        assert!(e.contains("--dtype f32") && e.contains("bf16 precision") && e.contains("--precision f32"), "{e}");
        for prec in [Precision::Bf16Mixed, Precision::Fp16Mixed] {
            // the masters are fp32; autocast is the session's
            assert_eq!(FloatType::for_plan(prec, None, p), Ok(FloatType::F32));
            let e = FloatType::for_plan(prec, Some(FloatType::F32), p).unwrap_err();
            assert!(e.contains("--dtype f32") && e.contains(prec.name()), "{e}");
            let e = FloatType::for_plan(prec, Some(FloatType::Bf16), p).unwrap_err();
            assert!(e.contains("--dtype bf16") && e.contains(prec.name()), "{e}");
        }
    }
}
