//! The optimizer and its learning rate: AdamW as PyTorch runs it, global gradient-norm
//! clipping, and the learning-rate schedules.

use tch::Tensor;

use crate::runtime::RuntimeError;
use crate::runtime::kernels::grad;

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
        let update = grad::AdamWUpdate { lr, betas, eps, weight_decay, step: i64::from(self.step) };
        grad::fused_adamw(&ps, &gs.iter().collect::<Vec<_>>(), &ms, &vs, update)
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

impl std::str::FromStr for LrShape {
    type Err = String;
    /// `--lr-schedule`: constant, cosine or linear.
    fn from_str(s: &str) -> Result<Self, String> {
        LrShape::parse(s).ok_or_else(|| format!("`{s}`: expected constant, cosine or linear"))
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

