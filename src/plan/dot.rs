//! Graphviz DOT of the graph a plan runs: one cluster per stage holding what the first rank of
//! its pipeline rank executes (tensor rank 0, data replica 0): the stage's nodes of the planned
//! graph, or, under tensor or context parallelism, its subgraph with the rank's shards and the
//! collectives and context conversions codegen inserted. Nothing is analysed again: the graph
//! is the one the runner builds from the plan.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

use crate::codegen::stage_graph::{StageGraphError, rank_graphs};
use crate::ir::{DimBindings, Graph, NodeId};

use super::schema::Plan;

/// Fill colours cycled over stages (Graphviz X11 names, light enough for black text).
const COLOURS: [&str; 8] = ["lightblue", "lightsalmon", "palegreen", "plum", "khaki", "lightcyan", "pink", "wheat"];

/// Why a plan's graph cannot be drawn.
#[derive(Debug, thiserror::Error)]
pub enum DotError {
    /// The plan does not resolve a rank's stages.
    #[error("the plan does not say what its ranks run: {0}; re-plan it")]
    View(String),
    /// The stage subgraphs cannot be built on this graph.
    #[error(transparent)]
    Stages(#[from] StageGraphError),
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

fn quote(s: &str) -> String {
    format!("\"{}\"", escape(s))
}

/// The DOT text of what `plan` runs on `graph`, its planned graph (with `dims`).
pub fn to_dot(plan: &Plan, graph: &Graph, dims: &DimBindings) -> Result<String, DotError> {
    let mesh = plan.mesh();
    // per stage: the graph its first rank runs and the nodes of it that are the stage's
    let mut drawn: HashMap<usize, (Graph, Vec<NodeId>)> = HashMap::new();
    for q in 0..mesh.pp() {
        let Some(&rank) = mesh.ranks.get(q).and_then(|r| r.first()).and_then(|r| r.first()) else { continue };
        let view = plan.rank_view(rank).map_err(|e| DotError::View(e.to_string()))?;
        let built = rank_graphs(&view, graph, dims, (&mesh, &plan.parallel, plan.stages.len()))?;
        if built.stages.is_empty() {
            for sv in &view.stages {
                let nodes = graph.node_ids().filter(|n| sv.code.runs(n.index())).collect();
                drawn.insert(sv.stage(), (graph.clone(), nodes));
            }
        }
        for s in built.stages {
            let nodes = s.graph.node_ids().collect();
            drawn.insert(s.stage, (s.graph, nodes));
        }
    }
    let mut out = String::new();
    let _ = writeln!(out, "digraph {} {{", quote(&graph.name));
    let _ = writeln!(out, "  rankdir=TB;\n  node [shape=box, style=filled, fontsize=10];");
    for st in &plan.stages {
        let Some((g, nodes)) = drawn.get(&st.index) else { continue };
        let colour = COLOURS[st.index % COLOURS.len()];
        let _ = writeln!(out, "  subgraph cluster_stage{} {{", st.index);
        let label = format!("stage {} (pp rank {}, layers {}-{})", st.index, st.pp_rank, st.layers[0], st.layers[1]);
        let _ = writeln!(out, "    label={}; style=filled; fillcolor=white; color={colour};", quote(&label));
        for &n in nodes {
            let node = g.node(n);
            // what codegen inserted (collectives, context conversions) stands out
            let fill = if node.op.collective().is_some() { "white" } else { colour };
            let label = format!("\"{}\\n{}\"", escape(&node.name), escape(&node.op.to_string()));
            let _ = writeln!(out, "    s{}_{} [label={label}, fillcolor={fill}];", st.index, n.index());
        }
        let _ = writeln!(out, "  }}");
        let inside: HashSet<NodeId> = nodes.iter().copied().collect();
        for &n in nodes {
            let mut succ: Vec<NodeId> = g.successors(n).filter(|m| inside.contains(m)).collect();
            succ.sort();
            succ.dedup();
            for m in succ {
                let _ = writeln!(out, "  s{0}_{1} -> s{0}_{2};", st.index, n.index(), m.index());
            }
        }
    }
    // what each stage sends on: from its producer to the next stage's readers, by name
    for (s, st) in plan.stages.iter().enumerate() {
        let (Some((g, nodes)), Some((h, next))) = (drawn.get(&st.index), drawn.get(&(s + 1))) else { continue };
        let Some(code) = plan.codegen.as_ref().and_then(|c| c.stages.get(s)) else { continue };
        for name in &code.outputs_to_next {
            let from = nodes.iter().find(|&&n| g.node(n).outputs.iter().any(|&o| g.value(o).name == *name));
            let to = next.iter().filter(|&&n| h.node(n).inputs.iter().flatten().any(|&i| h.value(i).name == *name));
            if let Some(from) = from {
                for m in to {
                    let _ = writeln!(out, "  s{}_{} -> s{}_{} [style=dashed];", s, from.index(), s + 1, m.index());
                }
            }
        }
    }
    out.push_str("}\n");
    Ok(out)
}
