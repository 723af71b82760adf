//! A rank's trained parameters in one flat order (each belongs to the first of the rank's
//! stages reading it), with the per-stage lists, flat vectors and blocks ZeRO works on.

use std::collections::HashMap;

use tch::{Kind, Tensor};

use crate::ir::ValueId;
use crate::runtime::RuntimeError;

/// This rank's trained parameters: each belongs to the first of the rank's stages reading it.
pub(crate) struct Params {
    // positions index every per-parameter list below
    /// The tensors (autograd leaves; ZeRO 3 swaps their storage).
    pub tensors: Vec<Tensor>,
    /// Shapes as loaded (ZeRO 3 releases the tensors between uses).
    pub shapes: Vec<Vec<i64>>,
    /// `owned[s]`: positions of the parameters stage `s` owns.
    pub owned: Vec<Vec<usize>>,
    /// `sharded[s]`: the positions of `owned[s]` in the stage's ZeRO state (flat vector,
    /// blocks): all but the experts held in part, whose state stays whole on their ranks.
    pub sharded: Vec<Vec<usize>>,
    /// `units[s]`: stage `s`'s gather units, each the end (exclusive) of its run of
    /// `sharded[s]`: one per layer under ZeRO 3 (a layer's parameters are gathered for its
    /// pass alone), else one for the whole stage. Each unit is padded to a multiple of the
    /// ZeRO group on its own, so a rank's block holds its share of every unit.
    pub units: Vec<Vec<usize>>,
    /// `read[s]`: positions of the parameters stage `s` reads.
    pub read: Vec<Vec<usize>>,
    /// Whether this rank counts the parameter's gradient in the global norm (each element once
    /// over the world).
    pub counted: Vec<bool>,
    /// Whether the parameter is a stacked expert weight this rank holds some experts of
    /// (expert parallelism): its gradient sums over the ranks holding the same experts.
    pub expert: Vec<bool>,
    /// Position of each parameter's model value.
    pub pos_of: HashMap<ValueId, usize>,
    /// Kind and device of new parameter-sized tensors.
    pub opts: (Kind, tch::Device),
}

/// One parameter's share of a ZeRO block: its elements `from..to` (flattened) at `at` in the
/// block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BlockPiece {
    /// The parameter's position.
    pub pos: usize,
    /// First element.
    pub from: i64,
    /// One past the last element.
    pub to: i64,
    /// Offset in the block.
    pub at: i64,
}

impl Params {
    /// Elements of parameter `i`.
    pub fn numel(&self, i: usize) -> i64 {
        self.shapes[i].iter().product()
    }

    /// Zeros shaped as parameter `i`.
    pub fn zeros(&self, i: usize) -> Result<Tensor, RuntimeError> {
        Ok(Tensor::f_zeros(self.shapes[i].as_slice(), self.opts)?)
    }

    /// Stage `s`'s units cut into `parts`: each unit's run of `sharded[s]` and its length in
    /// one block.
    fn unit_blocks(&self, s: usize, parts: i64) -> Vec<(std::ops::Range<usize>, i64)> {
        (0..self.unit_count(s))
            .filter_map(|u| self.unit_run(s, u))
            .map(|run| {
                let total: i64 = self.sharded[s][run.clone()].iter().map(|&i| self.numel(i)).sum();
                (run, (total + parts - 1) / parts.max(1))
            })
            .collect()
    }

    /// Length of one of the `parts` blocks of stage `s`'s ZeRO state.
    pub fn block_len(&self, s: usize, parts: i64) -> i64 {
        self.unit_blocks(s, parts).iter().map(|(_, len)| len).sum()
    }

    /// Per unit of stage `s`: its offset and length in a block of `parts`.
    pub fn unit_spans(&self, s: usize, parts: i64) -> Vec<(i64, i64)> {
        let mut at = 0;
        self.unit_blocks(s, parts)
            .into_iter()
            .map(|(_, len)| {
                at += len;
                (at - len, len)
            })
            .collect()
    }

    /// What block `index` of `parts` of stage `s`'s ZeRO state holds, in order: each unit's
    /// share of its parameters' elements (flattened), then zeros up to the unit's length.
    pub fn block_pieces(&self, s: usize, parts: i64, index: i64) -> Vec<BlockPiece> {
        let mut out = Vec::new();
        let mut base = 0;
        for (run, len) in self.unit_blocks(s, parts) {
            let (lo, hi) = (index * len, (index + 1) * len);
            let mut off = 0;
            for &i in &self.sharded[s][run] {
                let n = self.numel(i);
                let (a, b) = (lo.max(off), hi.min(off + n));
                if a < b {
                    out.push(BlockPiece { pos: i, from: a - off, to: b - off, at: base + a - lo });
                }
                off += n;
            }
            base += len;
        }
        out
    }

    /// Block `index` of `parts` of stage `s`, each piece made by `piece` (its parameter
    /// position and elements), the padding zeros.
    pub fn assemble(&self, s: usize, parts: i64, index: i64, mut piece: impl FnMut(&BlockPiece) -> Result<Tensor, RuntimeError>) -> Result<Tensor, RuntimeError> {
        let len = self.block_len(s, parts);
        let mut v: Vec<Tensor> = Vec::new();
        let mut at = 0;
        for pc in self.block_pieces(s, parts, index) {
            if pc.at > at {
                v.push(Tensor::f_zeros([pc.at - at], self.opts)?);
            }
            v.push(piece(&pc)?);
            at = pc.at + pc.to - pc.from;
        }
        if len > at {
            v.push(Tensor::f_zeros([len - at], self.opts)?);
        }
        Ok(if v.is_empty() { Tensor::f_zeros([0], self.opts)? } else { Tensor::f_cat(&v, 0)? })
    }

    /// The flat vector of stage `s`'s ZeRO-sharded entries of `ts` (parameters or gradients,
    /// by position): its `parts` blocks one after another (what a reduce-scatter cuts); with
    /// the block length.
    pub fn flat(&self, s: usize, ts: &[Tensor], parts: i64) -> Result<(Tensor, i64), RuntimeError> {
        let flat: Vec<Tensor> = self.sharded[s].iter().map(|&i| ts[i].f_detach().and_then(|t| t.f_reshape([-1]))).collect::<Result<_, _>>()?;
        let by_pos: std::collections::HashMap<usize, &Tensor> = self.sharded[s].iter().copied().zip(&flat).collect();
        let blocks: Vec<Tensor> = (0..parts)
            .map(|r| self.assemble(s, parts, r, |pc| Ok(by_pos[&pc.pos].f_narrow(0, pc.from, pc.to - pc.from)?)))
            .collect::<Result<_, _>>()?;
        Ok((if blocks.is_empty() { Tensor::f_zeros([0], self.opts)? } else { Tensor::f_cat(&blocks, 0)? }, self.block_len(s, parts)))
    }

    /// Block `index` (of `parts`) of stage `s`'s flat vector of `ts`.
    pub fn block(&self, s: usize, ts: &[Tensor], parts: i64, index: i64) -> Result<Tensor, RuntimeError> {
        self.assemble(s, parts, index, |pc| Ok(ts[pc.pos].f_detach()?.f_reshape([-1])?.f_narrow(0, pc.from, pc.to - pc.from)?))
    }

    /// Block `index` of stage `s`'s flat 1/0 mask of the counted parameters.
    pub fn counted_mask(&self, s: usize, parts: i64, index: i64) -> Result<Tensor, RuntimeError> {
        let ones: Vec<Tensor> = (0..self.tensors.len())
            .map(|i| Tensor::f_full(self.shapes[i].as_slice(), if self.counted[i] { 1.0 } else { 0.0 }, self.opts))
            .collect::<Result<_, _>>()?;
        self.block(s, &ones, parts, index)
    }

    /// Writes the flat vector `flat` (one unit's parameters one after another, as a gather
    /// of its blocks lays them out) into the parameters of unit `u` of stage `s`, by value
    /// (`copy`) or by swapping their storage for views of it.
    pub fn write_unit(&self, s: usize, u: usize, flat: &Tensor, copy: bool) -> Result<(), RuntimeError> {
        let _guard = tch::no_grad_guard();
        let run = self.unit_run(s, u).ok_or_else(|| crate::runtime::terr(format!("stage {s} has no gather unit {u}")))?;
        let mut off = 0;
        for &i in &self.sharded[s][run] {
            let n = self.numel(i);
            let mut p = self.tensors[i].shallow_clone();
            if copy {
                p.f_copy_(&flat.f_narrow(0, off, n)?.f_view_as(&p)?)?;
            } else {
                p.f_set_data(&flat.f_narrow(0, off, n)?.f_view(self.shapes[i].as_slice())?)?;
            }
            off += n;
        }
        Ok(())
    }

    /// Stage `s`'s gather units: how many.
    pub fn unit_count(&self, s: usize) -> usize {
        self.units.get(s).map_or(1, |u| u.len().max(1))
    }

    /// Where unit `u` of stage `s` runs in `sharded[s]`.
    fn unit_run(&self, s: usize, u: usize) -> Option<std::ops::Range<usize>> {
        let n = self.sharded[s].len();
        match self.units.get(s).filter(|ends| !ends.is_empty()) {
            Some(ends) => ends.get(u).map(|&end| u.checked_sub(1).map_or(0, |p| ends[p])..end),
            None => (u == 0).then_some(0..n),
        }
    }

    /// The positions of unit `u` of stage `s`.
    pub fn unit_positions(&self, s: usize, u: usize) -> &[usize] {
        self.unit_run(s, u).map_or(&[], |run| &self.sharded[s][run])
    }

    /// Cuts stage `s`'s ZeRO state into gather units by `key` (each position's unit: the
    /// first of the stage's passes reading it), ordering `sharded[s]` by it (stable).
    pub fn split_units(&mut self, s: usize, key: impl Fn(usize) -> usize) {
        let sh = &mut self.sharded[s];
        sh.sort_by_key(|&i| key(i));
        let mut ends = Vec::new();
        for j in 1..=sh.len() {
            if j == sh.len() || key(sh[j]) != key(sh[j - 1]) {
                ends.push(j);
            }
        }
        if self.units.len() <= s {
            self.units.resize(s + 1, Vec::new());
        }
        self.units[s] = ends;
    }

    /// Releases the storage of the parameters of unit `u` of stage `s` (ZeRO 3 between uses).
    pub fn release_unit(&self, s: usize, u: usize) -> Result<(), RuntimeError> {
        let empty = Tensor::f_empty([0], self.opts)?;
        for &i in self.unit_positions(s, u) {
            self.tensors[i].shallow_clone().f_set_data(&empty)?;
        }
        Ok(())
    }
}
