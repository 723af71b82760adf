//! Data-parallel gradient synchronisation and ZeRO state: each stage's flat parameter vector
//! cut into blocks over its data-parallel (or sharding) group, the gradient and optimizer
//! blocks this rank holds, and under ZeRO 3 the parameters themselves, gathered around each
//! use and released after it.

use tch::{Kind, Tensor};

use crate::runtime::RuntimeError;
use crate::runtime::comm::{ProcessGroup, Work};
use crate::runtime::kernels::storage;
use crate::runtime::kernels::tensor::owned_copy;
use crate::runtime::terr;
use super::params::Params;
use super::setup::Rank;
use super::memory;
use super::report::{StateBytes, Tally, bytes_of};
use crate::ir::ValueId;
use crate::runtime::state::checkpoint::{Loaded, Role};
use crate::runtime::state::slice::{self, Slice};
use crate::runtime::train::{AdamW, AdamWConfig};
use crate::codegen::{Instr, Purpose};

/// One stage's ZeRO shard of its parameters: the flat parameter vector cut into `parts`
/// blocks, this rank holding block `index`.
pub(super) struct Shard {
    parts: i64,
    index: i64,
    len: i64,
    grad: Option<Tensor>,
    /// Updated parameter block awaiting its all-gather.
    updated: Option<Tensor>,
    opt: Option<AdamW>,
    /// ZeRO 3: the only copy of this rank's block between uses (AdamW updates it), and the
    /// group that gathers the blocks.
    master: Option<Tensor>,
    members: Vec<usize>,
    /// ZeRO 3, per gather unit: its offset and length in the block, and the tensor it is
    /// gathered into (made once; its storage freed between uses, so autograd's saved views of
    /// the weights read the unit again once it is gathered back).
    units: Vec<GatherUnit>,
}

/// One ZeRO-3 gather unit of a stage: a layer's parameters.
struct GatherUnit {
    /// Offset and length of its share in the rank's block.
    span: (i64, i64),
    /// The unit gathered (`None` before its first use).
    gathered: Option<Tensor>,
    /// Whether `gathered` holds the unit now (its parameters are views of it).
    live: bool,
    /// A gather into `gathered` started ahead of its use (prefetched), not yet waited for.
    pending: Option<Work>,
}

impl Shard {
    /// A ZeRO-1/2 shard: block `index` of `parts`, each `len` long, nothing held yet.
    fn block(parts: i64, index: i64, len: i64) -> Shard {
        Shard { parts, index, len, grad: None, updated: None, opt: None, master: None, members: Vec::new(), units: Vec::new() }
    }
}

/// The optimizer state of a rank and its ZeRO shards.
pub(super) struct Zero {
    /// Per stage: its shard, once it has one.
    shards: Vec<Option<Shard>>,
    /// The plain AdamW of the parameters in no shard.
    full_opt: Option<AdamW>,
    /// `need[s]`: the ZeRO-3 stages whose parameters stage `s` reads (its own, or a weight it
    /// shares with another stage of this rank).
    need: Vec<Vec<usize>>,
    /// By (stage, segment): the ZeRO-3 gather units (stage, unit) the segment's nodes read.
    segment_units: std::collections::HashMap<(usize, usize), Vec<(usize, usize)>>,
    /// The most bytes of gathered units live while the peak of the memory window open now
    /// rose (what the window's peak holds of them).
    pub gathered_at_peak: u64,
    /// Moments restored from a checkpoint, used when each optimizer is made.
    restore: Option<Restore>,
    /// By parameter position: last step's gradient storage, kept for the parameter's first
    /// gradient of this step (PyTorch's `zero_grad(set_to_none=False)`, Megatron's persistent
    /// gradient buffer), so a stage holds its gradients through the whole step, as planned.
    grad_pool: Vec<Option<Tensor>>,
    /// By parameter position: a tied weight summed over pipeline ranks at the step's end, whose
    /// gradient stays whole until then (a microbatch's reduce-scatter leaves it out).
    tied: Vec<bool>,
}

/// AdamW state restored from a checkpoint: the step count, by parameter position the rank's
/// part (tensor-parallel cut) of each moment in no ZeRO block, and by stage the rank's ZeRO
/// block of its moments (read as the block alone: a resumed rank never holds a sharded stage's
/// moments whole). Each optimizer takes its moments out when it is made.
pub(super) struct Restore {
    /// AdamW updates taken.
    pub step: usize,
    /// First moments, by position (`None` in a ZeRO block, or taken).
    pub exp_avg: Vec<Option<Tensor>>,
    /// Second moments, by position.
    pub exp_avg_sq: Vec<Option<Tensor>>,
    /// By stage: its ZeRO block of the first and second moments (`None` without a block, or
    /// taken).
    pub blocks: Vec<Option<(Tensor, Tensor)>>,
}

/// Per stage of `rank`: the ZeRO block (`parts`, this rank's `index`) its optimizer state is
/// cut into, as the program's collectives cut it (the group gathering its ZeRO-3 parameters,
/// else reduce-scattering its gradients, else under ZeRO 1 all-reducing them); `None` for a
/// stage whose optimizer state is whole.
pub(super) fn zero_blocks(rank: &Rank<'_>) -> Result<Vec<Option<(i64, i64)>>, RuntimeError> {
    let mut out: Vec<Option<(i64, i64)>> = vec![None; rank.n_stages];
    let rounds: [&dyn Fn(&Instr) -> Option<(&Vec<usize>, &Purpose)>; 3] = [
        &|i| match i {
            Instr::AllGather { group, purpose: purpose @ Purpose::Zero3Params { .. }, .. } if rank.parallel.params_sharded() => Some((group, purpose)),
            _ => None,
        },
        &|i| match i {
            Instr::ReduceScatter { group, purpose: purpose @ Purpose::DpGrads { .. }, .. } => Some((group, purpose)),
            _ => None,
        },
        &|i| match i {
            Instr::AllReduce { group, purpose: purpose @ Purpose::DpGrads { .. }, .. } if rank.parallel.zero >= 1 => Some((group, purpose)),
            _ => None,
        },
    ];
    for round in rounds {
        for instr in &rank.program.instrs {
            let Some((g, purpose)) = round(instr) else { continue };
            let s = rank.stage_of(purpose)?;
            if out[s].is_none() && !rank.params.sharded[s].is_empty() {
                let pg = rank.groups.get(g)?;
                out[s] = Some((pg.size() as i64, pg.index() as i64));
            }
        }
    }
    Ok(out)
}

/// By (stage, segment) of `rank`'s segmented stages: the ZeRO-3 gather units (stage, unit)
/// among `need`'s that the segment's nodes read.
fn segment_units(rank: &Rank<'_>, need: &[Vec<usize>], shards: &[Option<Shard>]) -> std::collections::HashMap<(usize, usize), Vec<(usize, usize)>> {
    let p = &rank.params;
    let mut unit_of: std::collections::HashMap<usize, (usize, usize)> = std::collections::HashMap::new();
    for (o, sh) in shards.iter().enumerate() {
        if sh.as_ref().is_some_and(|sh| !sh.units.is_empty()) {
            for u in 0..p.unit_count(o) {
                for &i in p.unit_positions(o, u) {
                    unit_of.insert(i, (o, u));
                }
            }
        }
    }
    let mut out = std::collections::HashMap::new();
    for (&s, segs) in &rank.segments {
        for (k, seg) in segs.segments.iter().enumerate() {
            let mut units: Vec<(usize, usize)> = Vec::new();
            for &(o, u) in seg.params.iter().filter_map(|i| unit_of.get(i)) {
                if need[s].contains(&o) && !units.contains(&(o, u)) {
                    units.push((o, u));
                }
            }
            out.insert((s, k), units);
        }
    }
    out
}

/// A part of this rank's state to checkpoint: parameter position `pos`'s `role`, elements
/// `flat` of its (local) tensor flattened or all of it.
pub(super) struct LocalPiece {
    pub pos: usize,
    pub role: Role,
    pub flat: Option<[u64; 2]>,
    pub tensor: Tensor,
}

/// The optimizer of a ZeRO block (of stage `s`) or of every parameter (`block` false), fresh
/// or with the moments restored (taken out of `restore`; zeros where none is left).
fn new_opt(restore: Option<&mut Restore>, s: usize, block: bool, params: &[Tensor], adamw: AdamWConfig) -> Result<AdamW, RuntimeError> {
    let Some(r) = restore else { return AdamW::new(params, adamw) };
    let state = if block {
        let (m, v) = r.blocks.get_mut(s).and_then(Option::take).ok_or_else(|| terr(format!("stage {s}: the checkpoint's moments were not read as a ZeRO block")))?;
        let want = params.first().map_or(0, Tensor::numel);
        if m.numel() != want || v.numel() != want {
            return Err(terr(format!("stage {s}: the restored ZeRO block of moments has {} elements, the optimizer's block {want}", m.numel())));
        }
        vec![(m, v)]
    } else {
        let mut state = Vec::with_capacity(params.len());
        for (i, p) in params.iter().enumerate() {
            state.push(match (r.exp_avg.get_mut(i).and_then(Option::take), r.exp_avg_sq.get_mut(i).and_then(Option::take)) {
                (Some(m), Some(v)) => (m, v),
                // a parameter in a ZeRO block: never stepped here
                _ => (p.f_zeros_like()?.f_detach()?, p.f_zeros_like()?.f_detach()?),
            });
        }
        state
    };
    Ok(AdamW::with_state(adamw, r.step, state))
}

impl Zero {
    /// The state before the first step. Under ZeRO 3 each stage gathered by the program keeps
    /// only its block (the master AdamW updates) and releases its parameter tensors, which
    /// stay the same autograd leaves: their storage is swapped by set_data (gathered before
    /// each Forward and Backward, released after it).
    pub fn new(rank: &Rank<'_>, restore: Option<Restore>) -> Result<Zero, RuntimeError> {
        let n = rank.n_stages;
        let p = &rank.params;
        let mut shards: Vec<Option<Shard>> = (0..n).map(|_| None).collect();
        if rank.parallel.params_sharded() {
            let _guard = tch::no_grad_guard();
            for instr in &rank.program.instrs {
                let Instr::AllGather { group: g, purpose: purpose @ Purpose::Zero3Params { .. }, .. } = instr else { continue };
                let s = rank.stage_of(purpose)?;
                if shards[s].is_some() || p.sharded[s].is_empty() {
                    continue;
                }
                let pg = rank.groups.get(g)?;
                let (parts, index) = (pg.size() as i64, pg.index() as i64);
                // the block alone, read from the model or checkpoint (never the whole stage)
                let len = p.block_len(s, parts);
                let master = rank.read_block(s, parts, index)?;
                for u in 0..p.unit_count(s) {
                    p.release_unit(s, u)?;
                }
                shards[s] = Some(Shard { master: Some(master), members: g.clone(), ..Shard::block(parts, index, len) });
            }
        }
        let need: Vec<Vec<usize>> = (0..n)
            .map(|s| {
                (0..n)
                    .filter(|&o| shards[o].as_ref().is_some_and(|sh| sh.master.is_some()) && p.sharded[o].iter().any(|i| p.read[s].contains(i)))
                    .collect()
            })
            .collect();
        for (o, sh) in shards.iter_mut().enumerate() {
            if let Some(sh) = sh.as_mut().filter(|sh| sh.master.is_some()) {
                sh.units = p.unit_spans(o, sh.parts).into_iter().map(|span| GatherUnit { span, gathered: None, live: false, pending: None }).collect();
            }
        }
        let segment_units = segment_units(rank, &need, &shards);
        let mut tied = vec![false; p.tensors.len()];
        for instr in &rank.program.instrs {
            if let Instr::AllReduce { purpose: Purpose::TiedGrad { weight }, .. } = instr
                && let Some(&i) = rank.graph().value_by_name(weight).and_then(|v| p.pos_of.get(&v))
            {
                tied[i] = true;
            }
        }
        Ok(Zero { shards, full_opt: None, need, segment_units, gathered_at_peak: 0, restore, grad_pool: Vec::new(), tied })
    }

    /// The trained state held now, with `grads` the full gradients.
    pub fn held(&self, params: &Params, grads: &[Option<Tensor>]) -> StateBytes {
        let mut b = StateBytes {
            params: params.tensors.iter().map(bytes_of).sum(),
            grads: grads.iter().chain(&self.grad_pool).flatten().map(bytes_of).sum(),
            optimizer: self.full_opt.as_ref().map_or(0, AdamW::state_bytes),
        };
        for sh in self.shards.iter().flatten() {
            b.params += sh.master.as_ref().map_or(0, bytes_of) + sh.updated.as_ref().map_or(0, bytes_of);
            b.grads += sh.grad.as_ref().map_or(0, bytes_of);
            b.optimizer += sh.opt.as_ref().map_or(0, AdamW::state_bytes);
        }
        b
    }

    /// At a step's start: every full gradient left from the last step moves into the pool
    /// (kept, not freed), and `grads` starts empty, one slot for each of the `n` parameters.
    pub fn pool_grads(&mut self, grads: &mut Vec<Option<Tensor>>, n: usize) {
        grads.resize_with(n, || None);
        self.grad_pool.resize_with(n, || None);
        for (slot, g) in self.grad_pool.iter_mut().zip(grads.iter_mut()) {
            if let Some(g) = g.take() {
                *slot = Some(g);
            }
        }
    }

    /// Parameter `i`'s pooled gradient storage, zeroed, to accumulate its first gradient of
    /// the step into.
    pub fn pooled_grad(&mut self, i: usize) -> Result<Option<Tensor>, RuntimeError> {
        match self.grad_pool.get_mut(i).and_then(Option::take) {
            Some(mut g) => {
                let _ = g.f_zero_()?;
                Ok(Some(g))
            }
            None => Ok(None),
        }
    }

    /// Returns pooled storage `g` that no gradient reached in a pass.
    pub fn return_grad(&mut self, i: usize, g: Tensor) {
        if let Some(slot) = self.grad_pool.get_mut(i) {
            *slot = Some(g);
        }
    }

    /// Gathers the ZeRO-3 parameters stage `s` reads that are not gathered yet (all its units).
    pub fn ensure(&mut self, rank: &Rank<'_>, s: usize) -> Result<(), RuntimeError> {
        for o in self.need[s].clone() {
            for u in 0..self.shards[o].as_ref().map_or(0, |sh| sh.units.len()) {
                self.gather_unit(rank, o, u)?;
            }
        }
        Ok(())
    }

    /// Before segment `seg` of stage `s` runs: the units it reads gathered, every other unit
    /// released; then the gather of the units segment `next` reads started (FSDP's prefetch:
    /// it runs beside this segment's compute, one more layer held meanwhile).
    pub fn for_segment(&mut self, rank: &Rank<'_>, s: usize, seg: usize, next: Option<usize>) -> Result<(), RuntimeError> {
        let wanted = self.segment_units.get(&(s, seg)).cloned().unwrap_or_default();
        for o in 0..self.shards.len() {
            for u in 0..self.shards[o].as_ref().map_or(0, |sh| sh.units.len()) {
                if !wanted.contains(&(o, u)) && self.shards[o].as_ref().is_some_and(|sh| sh.units[u].live) {
                    self.free_unit(rank, o, u)?;
                }
            }
        }
        for &(o, u) in &wanted {
            self.gather_unit(rank, o, u)?;
        }
        for (o, u) in next.and_then(|n| self.segment_units.get(&(s, n)).cloned()).unwrap_or_default() {
            self.start_gather(rank, o, u)?;
        }
        Ok(())
    }

    /// Notes the gathered bytes held now if the memory window's peak rose from `before`.
    pub fn note_peak(&mut self, before: u64) {
        if memory::window_peak() > before {
            self.gathered_at_peak = self.gathered_at_peak.max(self.gathered_bytes());
        }
    }

    /// Bytes of the gathered units held now (gathered or being gathered).
    pub fn gathered_bytes(&self) -> u64 {
        self.shards.iter().flatten().flat_map(|sh| &sh.units).filter(|u| u.live || u.pending.is_some()).filter_map(|u| u.gathered.as_ref()).map(bytes_of).sum()
    }

    /// Starts all-gathering unit `u` of stage `o` into its tensor (refilling the storage it
    /// had), unless it is gathered or on its way.
    fn start_gather(&mut self, rank: &Rank<'_>, o: usize, u: usize) -> Result<(), RuntimeError> {
        let Some(sh) = self.shards[o].as_mut() else { return Ok(()) };
        let master = sh.master.as_ref().ok_or_else(|| terr(format!("stage {o} has no ZeRO-3 block")))?;
        let parts = sh.parts;
        let unit = sh.units.get_mut(u).ok_or_else(|| terr(format!("stage {o} has no gather unit {u}")))?;
        if unit.live || unit.pending.is_some() {
            return Ok(());
        }
        let (at, len) = unit.span;
        let out = match &unit.gathered {
            Some(t) => {
                storage::refill(t)?;
                t.shallow_clone()
            }
            None => unit.gathered.insert(Tensor::f_empty([len * parts], rank.params.opts)?).shallow_clone(),
        };
        unit.pending = Some(rank.groups.get(&sh.members)?.all_gather_start(&out, &master.f_narrow(0, at, len)?)?);
        Ok(())
    }

    /// Gathers unit `u` of stage `o` (waiting for its prefetch, or all of it now) and makes its
    /// parameters views of it.
    fn gather_unit(&mut self, rank: &Rank<'_>, o: usize, u: usize) -> Result<(), RuntimeError> {
        if self.shards[o].as_ref().and_then(|sh| sh.units.get(u)).is_none_or(|unit| unit.live) {
            return Ok(());
        }
        self.start_gather(rank, o, u)?;
        let Some(unit) = self.shards[o].as_mut().and_then(|sh| sh.units.get_mut(u)) else { return Ok(()) };
        if let Some(w) = unit.pending.take() {
            let out = w.wait()?;
            rank.params.write_unit(o, u, &out, false)?;
            unit.live = true;
        }
        Ok(())
    }

    /// Releases unit `u` of stage `o`: its parameters emptied, its gathered storage freed (a
    /// gather still on its way is waited for first).
    fn free_unit(&mut self, rank: &Rank<'_>, o: usize, u: usize) -> Result<(), RuntimeError> {
        let Some(unit) = self.shards[o].as_mut().and_then(|sh| sh.units.get_mut(u)) else { return Ok(()) };
        if let Some(w) = unit.pending.take() {
            let _gathered = w.wait()?;
        } else if !unit.live {
            return Ok(());
        }
        rank.params.release_unit(o, u)?;
        if let Some(t) = &unit.gathered {
            storage::free(t)?;
        }
        unit.live = false;
        Ok(())
    }

    /// Releases every gathered ZeRO-3 unit.
    pub fn release(&mut self, rank: &Rank<'_>) -> Result<(), RuntimeError> {
        for o in 0..self.shards.len() {
            for u in 0..self.shards[o].as_ref().map_or(0, |sh| sh.units.len()) {
                self.free_unit(rank, o, u)?;
            }
        }
        Ok(())
    }

    /// Sums stage `s`'s gradients over the data-parallel group `pg`: the reduced ZeRO shard
    /// across sharding groups, or (ZeRO 1) all of them then keeps this rank's block, or
    /// (ZeRO 0) all of them in buckets.
    pub fn all_reduce_grads(&mut self, rank: &Rank<'_>, pg: &ProcessGroup, s: usize, grads: &mut [Option<Tensor>], tally: &mut Tally) -> Result<(), RuntimeError> {
        let p = &rank.params;
        if let Some(sh) = self.shards[s].as_mut().filter(|sh| sh.grad.is_some()) {
            // sharded data parallelism: the reduced shard summed across groups (the experts
            // were summed with the reduce-scatter)
            if let Some(gs) = &sh.grad {
                pg.all_reduce_sum(gs)?;
            }
            return Ok(());
        } else if rank.parallel.zero >= 1 {
            // ZeRO 1: full all-reduce, then this rank's block
            let parts = pg.size() as i64;
            let (f, len) = p.flat(s, &full_grads(p, grads)?, parts)?;
            // the flat copy is all that is left of them
            for &i in &p.sharded[s] {
                grads[i] = None;
            }
            pg.all_reduce_sum(&f)?;
            let mut now = self.held(p, grads);
            now.grads += bytes_of(&f);
            tally.observe(now);
            let index = pg.index() as i64;
            let sh = self.shards[s].get_or_insert_with(|| Shard::block(parts, index, len));
            sh.grad = Some(owned_copy(&f.f_narrow(0, index * len, len)?)?);
        } else {
            // expert parallelism: everything but the experts over the whole data-parallel group
            let dense: Vec<usize> = p.owned[s].iter().copied().filter(|&i| !p.expert[i]).collect();
            reduce_whole(rank, pg, &dense, grads)?;
        }
        reduce_experts(rank, s, grads)
    }

    /// Reduce-scatters stage `s`'s gradients over `pg` (ZeRO 2 and 3) at the step's end: this
    /// rank's block of their sum is added to what the microbatches' reduce-scatters left there.
    pub fn reduce_scatter_grads(&mut self, rank: &Rank<'_>, pg: &ProcessGroup, s: usize, grads: &mut [Option<Tensor>], tally: &mut Tally) -> Result<(), RuntimeError> {
        self.scatter_into_block(rank, pg, s, grads, tally, true)?;
        reduce_experts(rank, s, grads)
    }

    /// Reduce-scatters stage `s`'s gradients so far after a backward (ZeRO 2 and 3, not the
    /// stage's last of the step) into this rank's block, freeing them; tied weights' stay whole
    /// for their sum over pipeline ranks, the experts' for their own group at the step's end.
    pub fn reduce_scatter_microbatch(&mut self, rank: &Rank<'_>, pg: &ProcessGroup, s: usize, grads: &mut [Option<Tensor>], tally: &mut Tally) -> Result<(), RuntimeError> {
        self.scatter_into_block(rank, pg, s, grads, tally, false)
    }

    /// The reduce-scatter of stage `s`'s sharded gradients (`with_tied`: tied weights' too,
    /// else left whole and out of the sum) added into this rank's block.
    fn scatter_into_block(&mut self, rank: &Rank<'_>, pg: &ProcessGroup, s: usize, grads: &mut [Option<Tensor>], tally: &mut Tally, with_tied: bool) -> Result<(), RuntimeError> {
        let p = &rank.params;
        let parts = pg.size() as i64;
        let mut taken = full_grads(p, grads)?;
        for &i in &p.sharded[s] {
            if !with_tied && self.tied[i] {
                taken[i] = p.zeros(i)?;
            } else {
                grads[i] = None;
            }
        }
        let (f, len) = p.flat(s, &taken, parts)?;
        drop(taken);
        let out = Tensor::f_zeros([len], p.opts)?;
        pg.reduce_scatter_sum(&out, &f)?;
        let mut now = self.held(p, grads);
        now.grads += bytes_of(&f) + bytes_of(&out);
        tally.observe(now);
        let index = pg.index() as i64;
        let sh = self.shards[s].get_or_insert_with(|| Shard::block(parts, index, len));
        if (sh.parts, sh.index, sh.len) != (parts, index, len) {
            return Err(terr(format!(
                "stage {s}: gradients are reduce-scattered over {:?}, but its ZeRO-3 parameters are gathered over {:?}",
                pg.members(),
                sh.members
            )));
        }
        sh.grad = Some(match sh.grad.take() {
            Some(mut sum) => {
                let _ = sum.f_add_(&out)?;
                sum
            }
            None => out,
        });
        Ok(())
    }

    /// ZeRO 1 and 2: all-gathers stage `s`'s parameter blocks over `pg`. Gathered every time
    /// the program says so; written into the weights only when an update is pending (never
    /// under a live autograd graph).
    pub fn gather_params(&mut self, rank: &Rank<'_>, pg: &ProcessGroup, s: usize, grads: &[Option<Tensor>], tally: &mut Tally) -> Result<(), RuntimeError> {
        let p = &rank.params;
        let parts = pg.size() as i64;
        let index = pg.index() as i64;
        let len = p.block_len(s, parts);
        let sh = self.shards[s].get_or_insert_with(|| Shard::block(parts, index, len));
        let (block, write) = match sh.updated.take() {
            Some(b) => (b, true),
            None => (owned_copy(&p.block(s, &p.tensors, parts, index)?)?, false),
        };
        let out = Tensor::f_empty([len * parts], p.opts)?;
        pg.all_gather(&out, &block)?;
        let mut now = self.held(p, grads);
        now.params += bytes_of(&out) + bytes_of(&block);
        tally.observe(now);
        if write {
            // one unit: the gathered blocks are the parameters one after another
            p.write_unit(s, 0, &out, true)?;
        }
        Ok(())
    }

    /// `GradScaler.unscale_` of the sharded gradient blocks; whether any held inf or NaN.
    pub fn unscale_grads(&self, scale: f64) -> Result<bool, RuntimeError> {
        let blocks: Vec<Tensor> = self.shards.iter().flatten().filter_map(|sh| sh.grad.as_ref().map(Tensor::shallow_clone)).collect();
        crate::runtime::train::amp::unscale(&blocks, scale)
    }

    /// Drops the sharded gradient blocks of a step that is skipped.
    pub fn drop_grads(&mut self) {
        for sh in self.shards.iter_mut().flatten() {
            sh.grad = None;
        }
    }

    /// Squared norm of the sharded gradient blocks this rank counts.
    pub fn grad_sq(&self, rank: &Rank<'_>) -> Result<f64, RuntimeError> {
        let mut sq = 0.0;
        for (s, sh) in self.shards.iter().enumerate() {
            if let Some(sh) = sh
                && let (Some(g), true) = (&sh.grad, rank.replica < rank.parallel.zero_group())
            {
                sq += g.f_mul(&rank.params.counted_mask(s, sh.parts, sh.index)?)?.f_square()?.f_sum(Kind::Double)?.f_double_value(&[])?;
            }
        }
        Ok(sq)
    }

    /// The optimizer step: each shard's block (its gradient scaled by `coef` when clipping),
    /// then the parameters in no shard with their full gradients `grads`; at learning rate `lr`.
    pub fn step(&mut self, rank: &Rank<'_>, grads: &[Option<Tensor>], coef: Option<f64>, lr: f64) -> Result<(), RuntimeError> {
        let p = &rank.params;
        let adamw = rank.cfg.adamw;
        for (s, sh) in self.shards.iter_mut().enumerate() {
            let Some(sh) = sh else { continue };
            let Some(mut g) = sh.grad.take() else { continue };
            if let Some(c) = coef {
                let _ = g.f_mul_scalar_(c)?;
            }
            if let Some(master) = sh.master.as_ref().map(Tensor::shallow_clone) {
                // ZeRO 3: the block is the parameters' only copy
                let opt = match &mut sh.opt {
                    Some(o) => o,
                    None => sh.opt.insert(new_opt(self.restore.as_mut(), s, true, &[master.shallow_clone()], adamw)?),
                };
                opt.set_lr(lr);
                opt.step_with(&[master], &[g])?;
                continue;
            }
            let block = owned_copy(&p.block(s, &p.tensors, sh.parts, sh.index)?)?;
            let opt = match &mut sh.opt {
                Some(o) => o,
                None => sh.opt.insert(new_opt(self.restore.as_mut(), s, true, &[block.shallow_clone()], adamw)?),
            };
            opt.set_lr(lr);
            opt.step_with(&[block.shallow_clone()], &[g])?;
            sh.updated = Some(block);
        }
        // parameters not in any shard: the plain (replicated) AdamW
        if grads.iter().any(Option::is_some) {
            let opt = match &mut self.full_opt {
                Some(o) => o,
                None => self.full_opt.insert(new_opt(self.restore.as_mut(), 0, false, &p.tensors, adamw)?),
            };
            let gs: Vec<Tensor> = grads.iter().map(|g| g.as_ref().map_or_else(Tensor::new, Tensor::shallow_clone)).collect();
            opt.set_lr(lr);
            opt.step_with(&p.tensors, &gs)?;
        }
        Ok(())
    }
}

impl Zero {
    /// What this rank checkpoints: parameters and moments, each element once over the world
    /// (tied, tensor-replicated and data-replicated copies on the rank that counts them in
    /// the gradient norm; ZeRO blocks on the first shard group).
    pub fn pieces(&self, rank: &Rank<'_>) -> Result<Vec<LocalPiece>, RuntimeError> {
        let p = &rank.params;
        let n = p.tensors.len();
        let mut out = Vec::new();
        // positions whose moments (and under ZeRO 3 values) live in a block
        let mut in_block = vec![false; n];
        let mut master_held = vec![false; n];
        for (s, sh) in self.shards.iter().enumerate() {
            let Some(sh) = sh else { continue };
            if sh.opt.is_none() && sh.master.is_none() {
                continue;
            }
            let writes = rank.replica < rank.parallel.zero_group();
            for &i in &p.sharded[s] {
                in_block[i] = sh.opt.is_some() || sh.master.is_some();
                master_held[i] = sh.master.is_some();
            }
            if !writes {
                continue;
            }
            let (m, v) = match &sh.opt {
                Some(o) => (o.state()[0].0.shallow_clone(), o.state()[0].1.shallow_clone()),
                None => match self.restore.as_ref().and_then(|r| r.blocks.get(s)).and_then(Option::as_ref) {
                    // resumed and not stepped yet
                    Some((m, v)) => (m.shallow_clone(), v.shallow_clone()),
                    None => (Tensor::f_zeros([sh.len], p.opts)?, Tensor::f_zeros([sh.len], p.opts)?),
                },
            };
            for pc in p.block_pieces(s, sh.parts, sh.index).into_iter().filter(|pc| p.counted[pc.pos]) {
                let flat = Some([pc.from as u64, pc.to as u64]);
                let part = |t: &Tensor| -> Result<Tensor, RuntimeError> { Ok(owned_copy(&t.f_narrow(0, pc.at, pc.to - pc.from)?)?) };
                if let Some(master) = &sh.master {
                    out.push(LocalPiece { pos: pc.pos, role: Role::Param, flat, tensor: part(master)? });
                }
                out.push(LocalPiece { pos: pc.pos, role: Role::ExpAvg, flat, tensor: part(&m)? });
                out.push(LocalPiece { pos: pc.pos, role: Role::ExpAvgSq, flat, tensor: part(&v)? });
            }
        }
        for i in 0..n {
            if !p.counted[i] || !rank.writes_replica(i) {
                continue;
            }
            if !master_held[i] {
                out.push(LocalPiece { pos: i, role: Role::Param, flat: None, tensor: p.tensors[i].f_detach()?.f_contiguous()? });
            }
            if !in_block[i] {
                let restored = self.restore.as_ref().and_then(|r| Some((r.exp_avg.get(i)?.as_ref()?, r.exp_avg_sq.get(i)?.as_ref()?)));
                let (m, v) = match (&self.full_opt, restored) {
                    (Some(o), _) => (o.state()[i].0.shallow_clone(), o.state()[i].1.shallow_clone()),
                    (None, Some((m, v))) => (m.shallow_clone(), v.shallow_clone()),
                    (None, None) => (p.zeros(i)?, p.zeros(i)?),
                };
                out.push(LocalPiece { pos: i, role: Role::ExpAvg, flat: None, tensor: m });
                out.push(LocalPiece { pos: i, role: Role::ExpAvgSq, flat: None, tensor: v });
            }
        }
        Ok(out)
    }
}

/// Sums the gradients of positions `which` over `pg` in buckets, zeros where none arrived.
fn reduce_whole(rank: &Rank<'_>, pg: &ProcessGroup, which: &[usize], grads: &mut [Option<Tensor>]) -> Result<(), RuntimeError> {
    let p = &rank.params;
    let mine: Vec<Tensor> = which.iter().map(|&i| grads[i].as_ref().map_or_else(|| p.zeros(i), |g| Ok(g.shallow_clone()))).collect::<Result<_, _>>()?;
    let reduced = all_reduce_bucketed(pg, mine, rank.opts.bucket_bytes)?;
    for (&i, g) in which.iter().zip(reduced) {
        grads[i] = Some(g);
    }
    Ok(())
}

/// Expert parallelism: sums the gradients of stage `s`'s experts held in part over the ranks
/// holding the same experts (none when this rank is the only one). ZeRO does not shard them:
/// their gradients and optimizer state stay whole on their ranks.
pub(super) fn reduce_experts(rank: &Rank<'_>, s: usize, grads: &mut [Option<Tensor>]) -> Result<(), RuntimeError> {
    let p = &rank.params;
    let experts: Vec<usize> = p.owned[s].iter().copied().filter(|&i| p.expert[i]).collect();
    match &rank.expert_replicas {
        Some(members) if !experts.is_empty() => reduce_whole(rank, rank.groups.get(members)?, &experts, grads),
        _ => Ok(()),
    }
}

/// Every parameter's gradient, zeros where none arrived.
fn full_grads(p: &Params, grads: &[Option<Tensor>]) -> Result<Vec<Tensor>, RuntimeError> {
    grads
        .iter()
        .enumerate()
        .map(|(i, g)| match g {
            Some(g) => Ok(g.shallow_clone()),
            None => p.zeros(i),
        })
        .collect()
}

/// Sums gradients over `pg` in buckets of about `bucket_bytes`, in parameter order.
fn all_reduce_bucketed(pg: &ProcessGroup, grads: Vec<Tensor>, bucket_bytes: usize) -> Result<Vec<Tensor>, RuntimeError> {
    let mut out: Vec<Tensor> = Vec::with_capacity(grads.len());
    let mut start = 0;
    while start < grads.len() {
        let mut end = start;
        let mut bytes = 0;
        while end < grads.len() && (end == start || bytes + grads[end].numel() * grads[end].kind().elt_size_in_bytes() <= bucket_bytes) {
            bytes += grads[end].numel() * grads[end].kind().elt_size_in_bytes();
            end += 1;
        }
        let flat: Vec<Tensor> = grads[start..end].iter().map(|g| g.f_reshape([-1])).collect::<Result<_, _>>()?;
        let flat = Tensor::f_cat(&flat, 0)?;
        pg.all_reduce_sum(&flat)?;
        let mut off = 0;
        for g in &grads[start..end] {
            let n = g.numel() as i64;
            out.push(flat.f_narrow(0, off, n)?.f_view_as(g)?);
            off += n;
        }
        start = end;
    }
    Ok(out)
}

/// The rank's part of the AdamW moments of a checkpoint: its tensor-parallel cut of each, and
/// of a stage whose optimizer state is a ZeRO block only that block, read from the pieces
/// holding those elements (never a whole tensor it holds a part of).
pub(super) fn restored_moments(rank: &Rank<'_>, ckpt: &Loaded) -> Result<Restore, RuntimeError> {
    let ids = rank.param_ids();
    let graph = rank.graph();
    let (kind, device) = rank.params.opts;
    let blocks = zero_blocks(rank)?;
    let mut in_block = vec![false; ids.len()];
    for (s, b) in blocks.iter().enumerate() {
        if b.is_some() {
            for &i in &rank.params.sharded[s] {
                in_block[i] = true;
            }
        }
    }
    let read = |v: ValueId, role: Role, part: &Slice| -> Result<Tensor, RuntimeError> {
        let dims = graph.value(v).data.as_ref().map(|d| d.dims.clone()).unwrap_or_default();
        Ok(ckpt.read_part(&slice::param_name(graph, v), role, &dims, part)?.f_to_kind(kind)?.f_to_device(device)?)
    };
    let (mut exp_avg, mut exp_avg_sq) = (Vec::with_capacity(ids.len()), Vec::with_capacity(ids.len()));
    for (&v, &blocked) in ids.iter().zip(&in_block) {
        if blocked {
            exp_avg.push(None);
            exp_avg_sq.push(None);
        } else {
            let part = rank.part_of(v);
            exp_avg.push(Some(read(v, Role::ExpAvg, &part)?));
            exp_avg_sq.push(Some(read(v, Role::ExpAvgSq, &part)?));
        }
    }
    let blocks = blocks
        .iter()
        .enumerate()
        .map(|(s, b)| {
            b.map(|(parts, index)| {
                Ok((
                    rank.read_block_with(s, parts, index, |v, part| read(v, Role::ExpAvg, part))?,
                    rank.read_block_with(s, parts, index, |v, part| read(v, Role::ExpAvgSq, part))?,
                ))
            })
            .transpose()
        })
        .collect::<Result<_, RuntimeError>>()?;
    Ok(Restore { step: ckpt.manifest.state.adamw_step, exp_avg, exp_avg_sq, blocks })
}
