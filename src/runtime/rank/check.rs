//! The checks of a plan for one rank that need no process group: the codegen section, the
//! stage layout against the planned graph, the rank's program and its tensor shards. A rank
//! runs them before it joins the others; the fuzzing harness runs them on mutated plans
//! (docs/fuzzing.md).

use super::layout;
use super::setup::Shards;
use crate::ir::{DimBindings, Graph};
use crate::plan::Plan;
use crate::runtime::{RuntimeError, terr};

/// Checks `plan` for rank `me` on `graph`, the graph it was made for
/// ([`layout::planned_graph`], whose dim bindings are `dims`).
pub fn check_rank(plan: &Plan, graph: &Graph, dims: &DimBindings, me: usize) -> Result<(), RuntimeError> {
    let section = layout::codegen_section(plan)?;
    layout::stage_layout(section, graph)?;
    let programs = layout::rank_programs(plan, section)?;
    if !programs.iter().any(|p| p.rank == me) {
        return Err(terr(format!("the plan has no program for rank {me}; {}", layout::REPLAN)));
    }
    Shards::new(plan, graph, dims, me)?;
    Ok(())
}
