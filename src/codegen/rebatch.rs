//! Fixed-batch exports at the plan's microbatch size: codegen rebinds the batch the graph fixed
//! (`passes::rebatch`: inputs, batch-sized shape operands, replicated masks), as shards rewrite
//! head counts, and the plan's codegen section records it ([`BatchRebind`]) for the runner,
//! which applies the same rewrite to the model it loads.

use serde::{Deserialize, Serialize};

use crate::ir::{DimBindings, Graph, LayeredGraph};
use crate::passes::{AnalyzeOptions, PassError, rebatch};

pub use crate::passes::rebatch::Rebatched;

/// The batch a plan's model fixed and the microbatch size its programs run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchRebind {
    /// The batch the model's graph fixes.
    pub fixed: i64,
    /// The plan's microbatch size the graph is rewritten to.
    pub microbatch: i64,
}

/// `lg` rebound to microbatches of `microbatch` samples, if its batch is fixed at another size
/// (layers and figures kept: they are per sample). `None` when nothing changes.
pub fn rebind(lg: &LayeredGraph, microbatch: i64) -> Result<Option<(LayeredGraph, BatchRebind)>, PassError> {
    let mut graph = lg.graph.clone();
    let mut dims = lg.dims.clone();
    let Some(done) = rebind_graph(&mut graph, &mut dims, microbatch)? else { return Ok(None) };
    let rebound = LayeredGraph { graph, dims, ..lg.clone() };
    Ok(Some((rebound, done)))
}

/// Rebinds `graph` (analysed, with `dims`) to microbatches of `microbatch` samples, if its
/// batch is fixed at another size, and records the new batch in `dims`. The one rewrite of
/// codegen and of the runner, which applies it to the graph a plan's section says was rebound.
pub fn rebind_graph(graph: &mut Graph, dims: &mut DimBindings, microbatch: i64) -> Result<Option<BatchRebind>, PassError> {
    if !dims.fixed_batch || microbatch == dims.graph_batch {
        return Ok(None);
    }
    let opts = AnalyzeOptions { seq_len: None, dims: dims.values.clone() };
    let Some(done) = rebatch::rebind_batch(graph, microbatch, &opts)? else { return Ok(None) };
    dims.graph_batch = microbatch;
    Ok(Some(BatchRebind { fixed: done.from, microbatch }))
}

/// The batch `graph` fixes (its first input's), if it fixes one.
pub fn fixed_batch(graph: &Graph) -> Option<i64> {
    rebatch::fixed_batch(graph).map(|(_, b)| b)
}

/// Rebinds the batch `graph` fixes to `microbatch` samples for a run without a plan, with its
/// symbolic sequence (if any) bound to `seq_len`: the same proven rewrite as a plan's.
pub fn rebind_unplanned(graph: &mut Graph, microbatch: i64, seq_len: Option<i64>) -> Result<Option<Rebatched>, PassError> {
    let opts = AnalyzeOptions { seq_len, ..Default::default() };
    rebatch::rebind_batch(graph, microbatch, &opts)
}
