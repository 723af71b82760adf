//! Graphviz DOT of a model graph with nodes coloured by the plan's pipeline stage.

use std::fmt::Write as _;

use crate::ir::LayeredGraph;

use super::schema::Plan;

/// Fill colours cycled over stages (Graphviz X11 names, light enough for black text).
const COLOURS: [&str; 8] =
    ["lightblue", "lightsalmon", "palegreen", "plum", "khaki", "lightcyan", "pink", "wheat"];

/// The plan and the graph disagree on the layer count.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("the plan was made for {plan_layers} layers but the model now has {model_layers}; re-plan it")]
pub struct LayerMismatch {
    /// Layers in the plan.
    pub plan_layers: usize,
    /// Layers in the graph.
    pub model_layers: usize,
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"")
}

fn quote(s: &str) -> String {
    format!("\"{}\"", escape(s))
}

/// One DOT cluster per stage, one per layer inside it; edges follow data flow.
pub fn to_dot(graph: &LayeredGraph, plan: &Plan) -> Result<String, LayerMismatch> {
    if graph.layers.len() != plan.model.layers {
        return Err(LayerMismatch { plan_layers: plan.model.layers, model_layers: graph.layers.len() });
    }
    let g = &graph.graph;
    let mut out = String::new();
    let _ = writeln!(out, "digraph {} {{", quote(&g.name));
    let _ = writeln!(out, "  rankdir=TB;\n  node [shape=box, style=filled, fontsize=10];");
    for s in &plan.stages {
        let colour = COLOURS[s.index % COLOURS.len()];
        let _ = writeln!(out, "  subgraph cluster_stage{} {{", s.index);
        let _ = writeln!(
            out,
            "    label={}; style=filled; fillcolor=white; color={colour};",
            quote(&format!(
                "stage {} (pp rank {}, layers {}-{})",
                s.index, s.pp_rank, s.layers[0], s.layers[1]
            ))
        );
        for layer in &graph.layers[s.layers[0]..=s.layers[1]] {
            let recompute = s.checkpointed_layers.contains(&layer.index);
            let _ = writeln!(out, "    subgraph cluster_layer{} {{", layer.index);
            let label =
                format!("{} {}{}", layer.index, layer.name, if recompute { " (recomputed)" } else { "" });
            let _ = writeln!(out, "      label={}; style=dashed;", quote(&label));
            for &n in &layer.nodes {
                if let Some(node) = g.try_node(n) {
                    let _ = writeln!(
                        out,
                        "      {n} [label={}, fillcolor={colour}];",
                        format!("\"{}\\n{}\"", escape(&node.name), escape(&node.op.to_string()))
                    );
                }
            }
            let _ = writeln!(out, "    }}");
        }
        let _ = writeln!(out, "  }}");
    }
    for layer in &graph.layers {
        for &n in &layer.nodes {
            if g.try_node(n).is_none() {
                continue;
            }
            let mut succ: Vec<_> = g.successors(n).collect();
            succ.sort();
            succ.dedup();
            for m in succ {
                let _ = writeln!(out, "  {n} -> {m};");
            }
        }
    }
    out.push_str("}\n");
    Ok(out)
}
