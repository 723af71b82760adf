//! Mixed precision as PyTorch's own recipe runs it: `torch.autocast` (matrix products in a low
//! type over fp32 weights, whose gradients, clipping and AdamW stay fp32) and, for fp16,
//! `torch.amp.GradScaler`'s dynamic loss scale.

use tch::{Kind, Tensor};

use crate::ir::Precision;
use crate::runtime::RuntimeError;
use crate::runtime::state::checkpoint::LossScaleState;

/// The low type a mixed-precision run computes its matrix products in (`torch.autocast`'s
/// `dtype`). Weights, their gradients and AdamW's state stay fp32: the weights are the masters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Autocast {
    /// bfloat16 (`bf16-mixed`): no loss scaling.
    Bf16,
    /// float16 (`fp16-mixed`): with dynamic loss scaling.
    Fp16,
}

impl Autocast {
    /// The autocast of a plan's precision; `None` for `f32` and `bf16` (one type throughout).
    pub fn of(precision: Precision) -> Option<Autocast> {
        match precision {
            Precision::Bf16Mixed => Some(Autocast::Bf16),
            Precision::Fp16Mixed => Some(Autocast::Fp16),
            Precision::F32 | Precision::Bf16 => None,
        }
    }

    /// The tch kind of the low type.
    pub fn kind(self) -> Kind {
        match self {
            Autocast::Bf16 => Kind::BFloat16,
            Autocast::Fp16 => Kind::Half,
        }
    }

    /// Whether gradients need a loss scale to stay inside the type's range (fp16's 65504).
    pub fn scales_loss(self) -> bool {
        self == Autocast::Fp16
    }
}

/// `GradScaler`'s settings (its defaults: 2¹⁶, ×2 after 2000 steps without overflow, ×½ on one).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaleConfig {
    /// The scale of the first step (`init_scale`).
    pub initial: f64,
    /// Factor after `growth_interval` steps in a row without inf/NaN (`growth_factor`).
    pub growth_factor: f64,
    /// Factor after a step with inf/NaN, which is skipped (`backoff_factor`).
    pub backoff_factor: f64,
    /// Steps without overflow before the scale grows (`growth_interval`).
    pub growth_interval: u64,
}

impl Default for LossScaleConfig {
    fn default() -> Self {
        LossScaleConfig { initial: 65536.0, growth_factor: 2.0, backoff_factor: 0.5, growth_interval: 2000 }
    }
}

/// The dynamic loss scale of an fp16 run: `GradScaler.update` after each step, in fp32 as
/// PyTorch keeps it, so its trajectory is PyTorch's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaler {
    cfg: LossScaleConfig,
    state: LossScaleState,
}

impl LossScaler {
    /// The scaler before the first step, or as a checkpoint left it.
    pub fn new(cfg: LossScaleConfig, restored: Option<LossScaleState>) -> LossScaler {
        let state = restored.unwrap_or(LossScaleState { scale: f64::from(cfg.initial as f32), growth_tracker: 0 });
        LossScaler { cfg, state }
    }

    /// The scale of the next step's loss.
    pub fn scale(&self) -> f64 {
        self.state.scale
    }

    /// What a checkpoint records.
    pub fn state(&self) -> LossScaleState {
        self.state
    }

    /// After a step: back off when it found inf/NaN (the step was skipped), else count it and
    /// grow the scale after `growth_interval` such steps in a row (unless that overflows fp32).
    pub fn update(&mut self, found_inf: bool) {
        let s = &mut self.state;
        if found_inf {
            s.scale = f64::from(s.scale as f32 * self.cfg.backoff_factor as f32);
            s.growth_tracker = 0;
            return;
        }
        s.growth_tracker += 1;
        if s.growth_tracker == self.cfg.growth_interval {
            let grown = s.scale as f32 * self.cfg.growth_factor as f32;
            if grown.is_finite() {
                s.scale = f64::from(grown);
            }
            s.growth_tracker = 0;
        }
    }
}

/// `GradScaler.unscale_`: multiplies every defined gradient of `grads` in place by the fp32
/// reciprocal of `scale`; returns whether any held inf or NaN.
pub fn unscale(grads: &[Tensor], scale: f64) -> Result<bool, RuntimeError> {
    let _guard = tch::no_grad_guard();
    let inv = f64::from((1.0 / scale) as f32);
    let mut found_inf = false;
    for g in grads.iter().filter(|g| g.defined()) {
        // a sum is non-finite exactly when an element is (f64 cannot overflow on fp32 values)
        found_inf |= !g.f_sum(Kind::Double)?.f_double_value(&[])?.is_finite();
        let _ = g.shallow_clone().f_mul_scalar_(inv)?;
    }
    Ok(found_inf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_scale_backs_off_on_overflow_and_grows_after_the_interval() {
        let cfg = LossScaleConfig { initial: 1024.0, growth_interval: 3, ..LossScaleConfig::default() };
        let mut s = LossScaler::new(cfg, None);
        let mut seen = Vec::new();
        for inf in [true, false, false, false, false, true, false] {
            s.update(inf);
            seen.push((s.scale(), s.state().growth_tracker));
        }
        assert_eq!(seen, vec![(512.0, 0), (512.0, 1), (512.0, 2), (1024.0, 0), (1024.0, 1), (512.0, 0), (512.0, 1)]);
    }

    #[test]
    fn growth_stops_where_fp32_ends() {
        let cfg = LossScaleConfig { initial: f64::from(f32::MAX), growth_interval: 1, ..LossScaleConfig::default() };
        let mut s = LossScaler::new(cfg, None);
        s.update(false);
        assert_eq!(s.scale(), f64::from(f32::MAX));
    }

    #[test]
    fn a_restored_state_is_taken_as_it_was() {
        let st = LossScaleState { scale: 8.0, growth_tracker: 7 };
        assert_eq!(LossScaler::new(LossScaleConfig::default(), Some(st)).state(), st);
    }
}
