//! How the engines cut a pipeline, in the plan's terms: per (virtual) stage, its layers and
//! what an engine calls them (the embedding before the first block, transformer blocks, the
//! head and loss after the last block), and the cut as a list of stage sizes.

use std::collections::BTreeSet;

use crate::plan::Plan;
use crate::solve::Layout;

use super::shape::ModelShape;

/// What a (virtual) stage holds in an engine's words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageRoles {
    /// First and last layer of `graph`.
    pub layers: [usize; 2],
    /// It holds layers before the first block (the embedding).
    pub embedding: bool,
    /// Blocks it holds.
    pub blocks: usize,
    /// Its first block's index among the blocks.
    pub first_block: usize,
    /// It holds layers after the last block (the head and loss).
    pub head: bool,
}

/// The stages of `plan` in chunk order, as roles. Fails naming the layer that is neither
/// before the blocks, a block, nor after them.
pub fn stage_roles(plan: &Plan, shape: &ModelShape) -> Result<Vec<StageRoles>, String> {
    shape.check_structure()?;
    let mut stages: Vec<&crate::plan::schema::Stage> = plan.stages.iter().collect();
    stages.sort_by_key(|s| s.index);
    Ok(stages.iter().map(|s| roles_of(s.layers, shape)).collect())
}

/// The roles of the stage holding `layers` of a model of `shape`.
pub fn roles_of(layers: [usize; 2], shape: &ModelShape) -> StageRoles {
    let [first, last] = shape.block_range.unwrap_or([0, 0]);
    StageRoles {
        layers,
        embedding: layers[0] < first,
        blocks: shape.blocks_in(layers),
        first_block: shape.block_index(layers[0].max(first)),
        head: layers[1] > last,
    }
}

/// Whether the embedding (every layer before the first block) lies in one stage and the head
/// (every layer after the last) in one stage: the engines place each as a unit.
pub fn units_whole(stages: &[StageRoles], shape: &ModelShape) -> bool {
    let Some([first, last]) = shape.block_range else { return false };
    let n = shape.kinds.len();
    let before = stages.iter().filter(|s| s.layers[0] < first).count();
    let after = stages.iter().filter(|s| s.layers[1] > last).count();
    (first == 0 || before == 1) && (last + 1 == n || after == 1)
}

/// The plan's cuts with the embedding and the head each moved whole into the stage holding
/// their first (last) layer.
pub fn whole_units_layout(stages: &[StageRoles], shape: &ModelShape) -> Option<Layout> {
    let [first, last] = shape.block_range?;
    let n = shape.kinds.len();
    let mut out: Vec<[usize; 2]> = stages.iter().map(|s| s.layers).collect();
    // the embedding goes with stage 0, the head with the last stage
    for s in out.iter_mut() {
        if s[0] > 0 && s[0] < first {
            s[0] = first;
        }
        if s[1] < n - 1 && s[1] >= last + 1 {
            s[1] = last;
        }
    }
    if let Some(s) = out.first_mut() {
        s[0] = 0;
    }
    if let Some(s) = out.last_mut() {
        s[1] = n - 1;
    }
    // stages emptied by the move keep nothing; fix contiguity
    for i in 1..out.len() {
        out[i][0] = out[i - 1][1] + 1;
    }
    out.iter().all(|s| s[0] <= s[1]).then_some(Layout(out))
}

/// A layout from blocks per stage, with the embedding in the first stage and the head in the
/// last: `blocks[c]` blocks in stage c.
pub fn layout_from_blocks(blocks: &[usize], shape: &ModelShape) -> Option<Layout> {
    let [first, last] = shape.block_range?;
    let n = shape.kinds.len();
    if blocks.iter().sum::<usize>() != shape.blocks {
        return None;
    }
    let mut out = Vec::with_capacity(blocks.len());
    let mut next_block = 0usize;
    for (c, &b) in blocks.iter().enumerate() {
        let start = if c == 0 { 0 } else { shape.layer_of_block(next_block).unwrap_or(last + 1) };
        next_block += b;
        let end = if c + 1 == blocks.len() {
            n - 1
        } else if next_block == 0 {
            first.saturating_sub(1)
        } else {
            shape.layer_of_block(next_block - 1)?
        };
        if end < start {
            return None;
        }
        out.push([start, end]);
    }
    Some(Layout(out))
}

/// The recompute of stages as engines with one count per stage say it: the first `n` blocks of
/// every stage (all of a stage's blocks where it has fewer).
pub fn first_blocks_per_stage(stages: &[StageRoles], n: usize, shape: &ModelShape) -> BTreeSet<usize> {
    let mut out = BTreeSet::new();
    for s in stages {
        for b in s.first_block..s.first_block + s.blocks.min(n) {
            if let Some(l) = shape.layer_of_block(b) {
                out.insert(l);
            }
        }
    }
    out
}

/// Every block of the model.
pub fn all_blocks(shape: &ModelShape) -> BTreeSet<usize> {
    (0..shape.kinds.len()).filter(|&l| shape.is_block(l)).collect()
}
