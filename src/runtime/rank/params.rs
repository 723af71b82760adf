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

impl Params {
    /// Elements of parameter `i`.
    pub fn numel(&self, i: usize) -> i64 {
        self.shapes[i].iter().product()
    }

    /// Zeros shaped as parameter `i`.
    pub fn zeros(&self, i: usize) -> Result<Tensor, RuntimeError> {
        Ok(Tensor::f_zeros(self.shapes[i].as_slice(), self.opts)?)
    }

    /// The flat vector of stage `s`'s ZeRO-sharded entries of `ts` (parameters or gradients, by position),
    /// padded to `parts` blocks; with the block length.
    pub fn flat(&self, s: usize, ts: &[Tensor], parts: i64) -> Result<(Tensor, i64), RuntimeError> {
        let owned = &self.sharded[s];
        let mut v: Vec<Tensor> = owned.iter().map(|&i| ts[i].f_detach().and_then(|t| t.f_reshape([-1]))).collect::<Result<_, _>>()?;
        let total: i64 = owned.iter().map(|&i| self.numel(i)).sum();
        let len = (total + parts - 1) / parts.max(1);
        if len * parts > total {
            v.push(Tensor::f_zeros([len * parts - total], self.opts)?);
        }
        Ok((if v.is_empty() { Tensor::f_zeros([0], self.opts)? } else { Tensor::f_cat(&v, 0)? }, len))
    }

    /// Block `index` (of `parts`, each `len` long) of stage `s`'s flat vector of `ts`.
    pub fn block(&self, s: usize, ts: &[Tensor], parts: i64, index: i64) -> Result<Tensor, RuntimeError> {
        let (f, len) = self.flat(s, ts, parts)?;
        Ok(f.f_narrow(0, index * len, len)?)
    }

    /// Block `index` of stage `s`'s flat 1/0 mask of the counted parameters.
    pub fn counted_mask(&self, s: usize, parts: i64, index: i64) -> Result<Tensor, RuntimeError> {
        let ones: Vec<Tensor> = (0..self.tensors.len())
            .map(|i| Tensor::f_full(self.shapes[i].as_slice(), if self.counted[i] { 1.0 } else { 0.0 }, self.opts))
            .collect::<Result<_, _>>()?;
        self.block(s, &ones, parts, index)
    }

    /// Writes the flat vector `flat` into stage `s`'s parameters, by value (`copy`) or by
    /// swapping their storage for views of it.
    pub fn write_flat(&self, s: usize, flat: &Tensor, copy: bool) -> Result<(), RuntimeError> {
        let _guard = tch::no_grad_guard();
        let mut off = 0;
        for &i in &self.sharded[s] {
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

    /// Releases the storage of stage `s`'s parameters (ZeRO 3 between uses).
    pub fn release(&self, s: usize) -> Result<(), RuntimeError> {
        let empty = Tensor::f_empty([0], self.opts)?;
        for &i in &self.sharded[s] {
            self.tensors[i].shallow_clone().f_set_data(&empty)?;
        }
        Ok(())
    }
}

