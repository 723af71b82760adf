//! Context parallelism's two kernels (see `split::context`): a whole value cut to this
//! rank's tokens, and a local value all-gathered back into the one-process order.

use tch::Tensor;

use crate::split::context::{gathered_order, local_positions};
use crate::runtime::comm::{PendingGather, ProcessGroup};

/// This rank's place in its context group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextRank {
    /// Index in the group.
    pub index: usize,
    /// Ranks in the group (c).
    pub size: usize,
}

/// How a token axis holds its sequences: `outer` blocks at the batch the plan inferred shapes
/// at, and `seq` tokens in one whole block (0: unknown). A token axis flattened with the batch
/// holds as many blocks as the batch run, so the blocks are counted from `seq` where known.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blocks {
    /// Blocks at the inferred batch.
    pub outer: i64,
    /// Tokens of one whole block.
    pub seq: i64,
}

impl Blocks {
    /// The blocks of an axis of `len` tokens holding `per_block` of each block's `seq`
    /// tokens out of `seq` (the whole block, or one rank's share of it).
    fn count(self, len: i64, share: i64) -> i64 {
        let per_block = if share > 0 { self.seq / share } else { 0 };
        if self.seq > 0 && per_block > 0 && self.seq % share == 0 && len % per_block == 0 { len / per_block } else { self.outer }
    }
}

/// `x` viewed `[before, outer, tokens, after]` around `axis` (tokens along `axis` in `outer`
/// blocks).
fn blocked(x: &Tensor, axis: usize, outer: i64) -> Result<(Tensor, Vec<i64>), String> {
    let size = x.size();
    let len = *size.get(axis).ok_or_else(|| format!("token axis {axis} of a tensor of shape {size:?}"))?;
    if outer <= 0 || len % outer != 0 {
        return Err(format!("axis {axis} of shape {size:?} does not hold {outer} sequence blocks"));
    }
    let before: i64 = size[..axis].iter().product();
    let after: i64 = size[axis + 1..].iter().product();
    Ok((x.f_reshape([before, outer, len / outer, after]).map_err(|e| e.to_string())?, size))
}

/// The rank's tokens of the whole `x` along `axis` (sequence blocks as `blocks` says).
pub fn localize(x: &Tensor, axis: usize, blocks: Blocks, me: ContextRank) -> Result<Tensor, String> {
    let len = x.size().get(axis).copied().unwrap_or(0);
    let outer = blocks.count(len, 1);
    let (v, mut size) = blocked(x, axis, outer)?;
    let seq = v.size()[2];
    let chunks = 2 * me.size as i64;
    if seq % chunks != 0 {
        return Err(format!("a sequence of {seq} tokens does not cut into {chunks} chunks"));
    }
    let idx = Tensor::from_slice(&local_positions(seq, me.index, me.size)).to_device(x.device());
    let out = v.f_index_select(2, &idx).map_err(|e| e.to_string())?;
    size[axis] = outer * (seq / me.size as i64);
    out.f_reshape(size.as_slice()).map_err(|e| e.to_string())
}

/// The whole of the local `x` along `axis` over the group `pg`, tokens in one-process order;
/// the backward sums each token's gradient over the group.
pub fn gather(pg: &ProcessGroup, x: &Tensor, axis: usize, blocks: Blocks) -> Result<Tensor, String> {
    gather_many(pg, &[(x.shallow_clone(), axis, blocks)])?.pop().ok_or_else(|| "a gather of one tensor made none".into())
}

/// [`gather`] of several local tensors (each with its token axis and blocks) as one collective:
/// each viewed token-major, concatenated, gathered once, put back in one-process order and
/// split again. The tensors must share a kind.
pub fn gather_many(pg: &ProcessGroup, xs: &[(Tensor, usize, Blocks)]) -> Result<Vec<Tensor>, String> {
    let (rows, layout) = token_rows(pg, xs)?;
    let all = pg.context_gather(&rows, 0).map_err(|e| e.to_string())?;
    layout.split(pg, all)
}

/// [`gather_many`] posted without waiting: the collective travels while the caller computes;
/// [`PendingMany::finish`] waits and gives the gathered tensors.
pub fn gather_many_start<'a>(pg: &'a ProcessGroup, xs: &[(Tensor, usize, Blocks)]) -> Result<PendingMany<'a>, String> {
    let (rows, layout) = token_rows(pg, xs)?;
    let pending = pg.context_gather_start(&rows, 0).map_err(|e| e.to_string())?;
    Ok(PendingMany { pg, pending, layout })
}

/// A [`gather_many_start`] in flight.
pub struct PendingMany<'a> {
    pg: &'a ProcessGroup,
    pending: PendingGather,
    layout: RowLayout,
}

impl PendingMany<'_> {
    /// Waits for the gather; the whole tensors, in the order given to [`gather_many_start`].
    pub fn finish(self) -> Result<Vec<Tensor>, String> {
        let all = self.pending.finish().map_err(|e| e.to_string())?;
        self.layout.split(self.pg, all)
    }
}

/// How [`token_rows`] laid tensors side by side: each one's width in the rows, its shape, its
/// token axis and its `[before, outer, after]` blocked view.
struct RowLayout {
    widths: Vec<i64>,
    shapes: Vec<(Vec<i64>, usize, [i64; 3])>,
}

/// The tensors of `xs` viewed token-major (`[tokens, rest]`) and concatenated along the rest.
fn token_rows(pg: &ProcessGroup, xs: &[(Tensor, usize, Blocks)]) -> Result<(Tensor, RowLayout), String> {
    let e = |e: tch::TchError| e.to_string();
    let mut rows = Vec::with_capacity(xs.len());
    let mut shapes = Vec::with_capacity(xs.len());
    for (x, axis, blocks) in xs {
        let len = x.size().get(*axis).copied().unwrap_or(0);
        let (v, size) = blocked(x, *axis, blocks.count(len, pg.size() as i64))?;
        let [before, outer, tokens, after] = v.size()[..] else { return Err("a blocked view has four axes".into()) };
        // [tokens, before · outer · after]
        rows.push(v.f_permute([2, 0, 1, 3]).map_err(e)?.f_reshape([tokens, -1]).map_err(e)?);
        shapes.push((size, *axis, [before, outer, after]));
    }
    let widths: Vec<i64> = rows.iter().map(|r| r.size()[1]).collect();
    Ok((Tensor::f_cat(&rows, 1).map_err(e)?, RowLayout { widths, shapes }))
}

impl RowLayout {
    /// The gathered rows `all` put back in one-process order and split into whole tensors.
    fn split(self, pg: &ProcessGroup, all: Tensor) -> Result<Vec<Tensor>, String> {
        let e = |e: tch::TchError| e.to_string();
        let seq = all.size()[0];
        let idx = Tensor::from_slice(&gathered_order(seq, pg.size())).to_device(all.device());
        let all = all.f_index_select(0, &idx).map_err(e)?;
        let parts = all.f_split_with_sizes(&self.widths, 1).map_err(e)?;
        parts
            .into_iter()
            .zip(self.shapes)
            .map(|(p, (mut size, axis, [before, outer, after]))| {
                let v = p.f_reshape([seq, before, outer, after]).map_err(e)?.f_permute([1, 2, 0, 3]).map_err(e)?;
                size[axis] = outer * seq;
                v.f_reshape(size.as_slice()).map_err(e)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_counted_from_the_tensor_run() {
        // [batch · seq] tokens inferred at batch 1 (outer 1), seq 8 over 2 ranks, run at batch 4
        let b = Blocks { outer: 1, seq: 8 };
        assert_eq!(b.count(32, 1), 4, "a whole axis of 4 sequences");
        assert_eq!(b.count(16, 2), 4, "a rank's 4 halves");
        assert_eq!(b.count(4, 2), 1, "one sequence's half");
        // unknown or inconsistent: the inferred blocks
        assert_eq!(Blocks { outer: 3, seq: 0 }.count(24, 2), 3);
        assert_eq!(Blocks { outer: 2, seq: 8 }.count(12, 1), 2);
    }

    #[test]
    fn a_flattened_axis_gathered_by_blocks_is_the_one_process_order() {
        // 2 sequences of 4 tokens flattened [8]; rank r holds chunks r and 3 − r of each
        let whole = Tensor::from_slice(&[0i64, 1, 2, 3, 10, 11, 12, 13]);
        let blocks = Blocks { outer: 1, seq: 4 };
        let parts: Vec<Tensor> = (0..2).map(|index| localize(&whole, 0, blocks, ContextRank { index, size: 2 }).unwrap()).collect();
        assert_eq!(Vec::<i64>::try_from(&parts[0]).unwrap(), vec![0, 3, 10, 13]);
        assert_eq!(Vec::<i64>::try_from(&parts[1]).unwrap(), vec![1, 2, 11, 12]);
    }
}
