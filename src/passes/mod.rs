//! Passes over the IR, one file each; [`analyze`] runs them in order:
//! bind dims → shape inference → fold shape arithmetic → DCE → shape inference → figures →
//! layer grouping.

use std::collections::BTreeMap;

use crate::ir::{self, GraphError};

pub mod dce;
pub mod figures;
pub mod fold;
pub mod layers;
pub mod shape_infer;

/// Options of [`analyze`]: how to bind symbolic dims.
#[derive(Clone, Debug, Default)]
pub struct AnalyzeOptions {
    /// Binds the symbolic sequence dim (second dim of the first graph input).
    pub seq_len: Option<i64>,
    /// Binds any symbolic dim by name (`--dim NAME=V`).
    pub dims: BTreeMap<String, i64>,
}

/// Errors of the passes. Each names the node, value or dim concerned.
#[derive(Debug, thiserror::Error)]
pub enum PassError {
    /// A symbolic dim is needed but nothing binds it.
    #[error("symbolic dim `{dim}` of input `{input}` is unbound: {fix}")]
    UnboundDim {
        /// The symbol.
        dim: String,
        /// The graph input that has it.
        input: String,
        /// How to bind it.
        fix: String,
    },
    /// `--seq-len` asks for another sequence length than the graph's fixed one.
    #[error("--seq-len {requested} conflicts with input `{input}`, whose sequence dim is fixed at {fixed}; drop --seq-len or re-export with a symbolic sequence dim")]
    SeqLenConflict {
        /// The graph input.
        input: String,
        /// Its fixed size.
        fixed: i64,
        /// What was asked.
        requested: i64,
    },
    /// A binding that makes no sense (non-positive size, unknown name).
    #[error("bad dim binding: {0}")]
    BadBinding(String),
    /// Shape inference failed at a node.
    #[error("shape inference failed at node `{node}` ({op}): {msg}")]
    Shape {
        /// Node name.
        node: String,
        /// Op type.
        op: String,
        /// What went wrong.
        msg: String,
    },
    /// The graph is structurally broken.
    #[error(transparent)]
    Graph(#[from] GraphError),
}

/// Runs the pass list over an imported graph and returns it with shapes, figures and layers.
pub fn analyze(mut graph: ir::Graph, opts: &AnalyzeOptions) -> Result<ir::LayeredGraph, PassError> {
    graph.verify()?;
    let dims = shape_infer::bind_dims(&graph, opts)?;
    let info = shape_infer::infer_shapes(&mut graph, &dims)?;
    debug_verify(&graph)?;
    let folded = fold::fold_constants(&mut graph, &dims, &info)?;
    debug_verify(&graph)?;
    let removed = dce::remove_dead_nodes(&mut graph);
    debug_verify(&graph)?;
    if folded > 0 || removed > 0 {
        shape_infer::infer_shapes(&mut graph, &dims)?;
        debug_verify(&graph)?;
    }
    tracing::debug!(folded, removed, nodes = graph.node_count(), "shape arithmetic folded, dead nodes removed");
    let figures = figures::compute(&graph, &dims)?;
    let layers = layers::group(&graph, &figures, &dims)?;
    debug_verify(&graph)?;
    Ok(ir::LayeredGraph {
        params: figures.total_params,
        flops_per_sample: figures.total_flops,
        node_figures: figures.per_node,
        layers,
        dims,
        graph,
    })
}

fn debug_verify(graph: &ir::Graph) -> Result<(), PassError> {
    if cfg!(debug_assertions) {
        graph.verify()?;
    }
    Ok(())
}
