//! Training on one process without a plan: the model's executor runs every node, gradients
//! accumulate over microbatches, then clipping and AdamW. It runs in the one training loop
//! ([`super::driver::drive`]) as a [`StepRunner`].

use std::time::Instant;

use tch::Tensor;

use super::amp::{self, LossScaler};
use super::driver::{OptimizerProgress, StepRunner, TrainConfig, Trained, drive};
use super::loss::{global_target_count, loss_sum_of};
use super::optim::{AdamW, clip_grad_norm};
use super::records::{Quiet, StepRecord, TrainObserver, process_cpu_s};
use crate::ir::ValueId;
use crate::passes::figures::is_trainable;
use crate::runtime::RuntimeError;
use crate::runtime::data::{Batch, DataSource};
use crate::runtime::kernels::executor::Executor;
use crate::runtime::kernels::ops::{DropoutKey, NormStats};
use crate::runtime::state::checkpoint::{self, Checkpointing, Loaded, Piece, Role};
use crate::runtime::state::slice::{Slice, is_transposed, param_name};

/// One process training the whole model: its executor, trained parameters (in value-id
/// order, the order of `Executor::parameters`), optimizer and data.
pub struct SingleProcess<'e, 'g> {
    exec: &'e Executor<'g>,
    data: &'e DataSource,
    cfg: &'e TrainConfig,
    ids: Vec<ValueId>,
    params: Vec<Tensor>,
    opt: AdamW,
    /// AdamW updates taken (fp16 steps with inf/NaN take none).
    adamw_steps: usize,
    /// The loss scale of an fp16 mixed-precision run.
    scaler: Option<LossScaler>,
}

impl<'e, 'g> SingleProcess<'e, 'g> {
    /// Sets up training of `exec`'s trainable weights on `data`; with `resume`, the AdamW
    /// moments continue from that checkpoint (its parameters are already in `exec`'s weights).
    pub fn new(exec: &'e Executor<'g>, data: &'e DataSource, cfg: &'e TrainConfig, resume: Option<&Loaded>) -> Result<Self, RuntimeError> {
        let graph = exec.graph();
        let mut ids: Vec<ValueId> = exec.weights.keys().copied().filter(|&id| is_trainable(graph, id)).collect();
        ids.sort();
        let params: Vec<Tensor> = ids.iter().map(|id| exec.weights[id].shallow_clone()).collect();
        if params.is_empty() {
            return Err(RuntimeError::Train("the model has no trainable initializers".into()));
        }
        let scaler = cfg.autocast.filter(|a| a.scales_loss()).map(|_| LossScaler::new(cfg.loss_scale, resume.and_then(|l| l.manifest.state.loss_scale)));
        let adamw_steps = resume.map_or(0, |l| l.manifest.state.adamw_step);
        let opt = match resume {
            None => AdamW::new(&params, cfg.adamw)?,
            Some(l) => {
                let mut moments = checkpoint::restore_moments(l, graph, &ids, params[0].kind())?;
                let device = params[0].device();
                let state = ids
                    .iter()
                    .map(|v| {
                        let (m, s) = moments.remove(v).ok_or_else(|| RuntimeError::Train("moment missing".into()))?;
                        Ok((m.f_to_device(device)?, s.f_to_device(device)?))
                    })
                    .collect::<Result<_, RuntimeError>>()?;
                AdamW::with_state(cfg.adamw, l.manifest.state.adamw_step, state)
            }
        };
        Ok(SingleProcess { exec, data, cfg, ids, params, opt, adamw_steps, scaler })
    }

    fn feeds_of(&self, mb: &Batch) -> Result<std::collections::HashMap<ValueId, Tensor>, RuntimeError> {
        self.exec.bind_batch(mb)
    }

    fn microbatches(&self) -> usize {
        self.cfg.microbatches.max(1)
    }
}

impl StepRunner for SingleProcess<'_, '_> {
    fn run_step(&mut self, step: usize) -> Result<StepRecord, RuntimeError> {
        let (exec, cfg, data) = (self.exec, self.cfg, self.data);
        let t0 = Instant::now();
        let c0 = process_cpu_s();
        let m = self.microbatches();
        let micro = data.replica_microbatches(step, 0, 1, m)?;
        for p in &self.params {
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
            let outs = exec.forward(&self.feeds_of(mb)?)?;
            let loss = loss_sum_of(exec, cfg.loss, mb, &outs)?.f_mul_scalar(scale)?;
            match &self.scaler {
                Some(s) => loss.f_mul_scalar(s.scale())?.f_backward()?,
                None => loss.f_backward()?,
            }
            total += loss.f_double_value(&[])?;
        }
        let lr = cfg.schedule.lr(step);
        let loss_scale = self.scaler.as_ref().map(LossScaler::scale);
        let record = |skipped: bool| StepRecord { step, loss: total, time_s: t0.elapsed().as_secs_f64(), cpu_s: process_cpu_s() - c0, lr, loss_scale, skipped };
        if let Some(s) = self.scaler.as_mut() {
            let grads: Vec<Tensor> = self.params.iter().map(|p| p.f_grad()).collect::<Result<_, _>>()?;
            let found_inf = amp::unscale(&grads, s.scale())?;
            s.update(found_inf);
            if found_inf {
                // GradScaler.step: no update at all on a step with inf/NaN
                return Ok(record(true));
            }
        }
        if let Some(c) = cfg.clip {
            clip_grad_norm(&self.params, c)?;
        }
        self.opt.set_lr(lr);
        self.opt.step(&self.params)?;
        self.adamw_steps += 1;
        Ok(record(false))
    }

    fn run_eval(&mut self, data: &DataSource, batches: usize) -> Result<f64, RuntimeError> {
        let exec = self.exec;
        let mut sum = 0.0;
        exec.set_norm_stats(NormStats::Running);
        exec.set_dropout_key(None);
        for k in 1..=batches {
            let scale = 1.0 / global_target_count(exec, self.cfg.loss, data, k)?;
            for mb in data.replica_microbatches(k, 0, 1, self.microbatches())? {
                let outs = tch::no_grad(|| exec.forward(&self.feeds_of(&mb)?))?;
                sum += loss_sum_of(exec, self.cfg.loss, &mb, &outs)?.f_double_value(&[])? * scale;
            }
        }
        Ok(sum / batches.max(1) as f64)
    }

    fn checkpoint_pieces(&self) -> Result<Vec<Piece>, RuntimeError> {
        let graph = self.exec.graph();
        let mut pieces = Vec::with_capacity(3 * self.ids.len());
        for (i, &v) in self.ids.iter().enumerate() {
            let (exp_avg, exp_avg_sq) = &self.opt.state()[i];
            for (role, t) in [(Role::Param, &self.params[i]), (Role::ExpAvg, exp_avg), (Role::ExpAvgSq, exp_avg_sq)] {
                pieces.push(Piece { name: param_name(graph, v), role, shape: t.size(), transposed: is_transposed(graph, v), slice: Slice::whole(), tensor: t.f_detach()? });
            }
        }
        pieces.extend(checkpoint::buffer_pieces(graph, |v| self.exec.weights.get(&v).map(|t| (t.shallow_clone(), Slice::whole())))?);
        Ok(pieces)
    }

    fn rank(&self) -> usize {
        0
    }

    fn world(&self) -> usize {
        1
    }

    fn barrier(&self) -> Result<(), RuntimeError> {
        Ok(())
    }

    fn agree(&self, ok: bool) -> Result<bool, RuntimeError> {
        Ok(ok)
    }

    fn optimizer_progress(&self, _step: usize) -> OptimizerProgress {
        OptimizerProgress { adamw_steps: self.adamw_steps, loss_scale: self.scaler.as_ref().map(LossScaler::state) }
    }
}

/// Trains on one fixed global batch for `cfg.steps` steps; returns one record per step.
pub fn train(exec: &Executor, batch: &Batch, cfg: &TrainConfig) -> Result<Vec<StepRecord>, RuntimeError> {
    let fixed = DataSource::Fixed(batch.iter().map(|(n, t)| (n.clone(), t.shallow_clone())).collect());
    Ok(train_with(exec, &fixed, None, cfg, &Checkpointing::default(), &mut Quiet)?.steps)
}

/// Trains for `cfg.steps` steps on `data` (step k reads its k-th global batch) in the one
/// training loop, validating on `eval_data` as `cfg.eval` says and checkpointing and resuming
/// as `ckpt` says (a resumed run continues with the step after the checkpoint's; its
/// parameters are already in `exec`'s weights), telling `obs` as it goes.
pub fn train_with(
    exec: &Executor,
    data: &DataSource,
    eval_data: Option<&DataSource>,
    cfg: &TrainConfig,
    ckpt: &Checkpointing<'_>,
    obs: &mut dyn TrainObserver,
) -> Result<Trained, RuntimeError> {
    let mut runner = SingleProcess::new(exec, data, cfg, ckpt.resume)?;
    let eval = cfg.eval.zip(eval_data);
    drive(&mut runner, cfg.steps, eval, ckpt, obs)
}
