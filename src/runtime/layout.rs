//! What a rank reads of its plan, in runtime terms: the nodes, boundary values and parameters
//! of each stage, and every rank's program.

use std::collections::{BTreeSet, HashMap};

use super::RuntimeError;
use super::pipeline::terr;
use super::weights::is_trainable;
use crate::codegen::encode::CODEGEN_VERSION;
use crate::codegen::{CodegenSection, RankProgram};
use crate::ir::{Graph, NodeId, ValueId, ValueKind};
use crate::plan::Plan;


/// Which nodes and values each (global) stage of a plan owns.
#[derive(Clone, Debug)]
pub struct StageLayout {
    /// Nodes of each stage, in execution order.
    pub nodes: Vec<Vec<NodeId>>,
    /// `crossing[s]`: values made by stages ≤ s and read by stages > s (what stage s sends).
    pub crossing: Vec<Vec<ValueId>>,
    /// Trainable initializers each stage reads.
    pub params: Vec<Vec<ValueId>>,
    /// Stages whose forward is recomputed in the backward.
    pub recompute: Vec<bool>,
}

/// Assigns the nodes of `graph` (the model as imported) to the plan's stages: each stage runs
/// the nodes its codegen section lists by id; nodes the section does not list (shape
/// arithmetic the planner folded into constants, dead nodes) go with their first consumer.
pub fn stage_layout(section: &CodegenSection, graph: &Graph) -> Result<StageLayout, RuntimeError> {
    let stages = section.stages.len();
    if stages == 0 {
        return Err(terr("the plan has no stages"));
    }
    let by_id: HashMap<usize, NodeId> = graph.node_ids().map(|n| (n.index(), n)).collect();
    let mut stage_of: HashMap<NodeId, usize> = HashMap::new();
    for (s, st) in section.stages.iter().enumerate() {
        if st.stage != s {
            return Err(terr(format!("plan stage {s} has index {}; stages must be listed in order", st.stage)));
        }
        for i in st.node_ids() {
            let n = by_id.get(&i).ok_or_else(|| terr(format!("stage {s} runs node {i}, which the model does not have; {REPLAN}")))?;
            stage_of.insert(*n, s);
        }
    }
    let order = graph.topo_order()?;
    let uses = graph.uses();
    let live = crate::passes::dce::live_nodes(graph);
    // folded helpers: the earliest stage among their consumers; dead nodes (the rest of a
    // fused chain) run nowhere
    let order: Vec<NodeId> = order.into_iter().filter(|n| live[n.index()]).collect();
    for &n in order.iter().rev() {
        if stage_of.contains_key(&n) {
            continue;
        }
        let s = graph
            .node(n)
            .outputs
            .iter()
            .flat_map(|o| uses[o.index()].iter())
            .filter_map(|u| stage_of.get(u).copied())
            .min()
            .unwrap_or(stages - 1);
        stage_of.insert(n, s);
    }
    let mut nodes = vec![Vec::new(); stages];
    for &n in &order {
        nodes[stage_of[&n]].push(n);
    }
    let mut made_in: HashMap<ValueId, usize> = HashMap::new();
    for &n in &order {
        for &o in &graph.node(n).outputs {
            made_in.insert(o, stage_of[&n]);
        }
    }
    let mut crossing: Vec<BTreeSet<ValueId>> = vec![BTreeSet::new(); stages.saturating_sub(1)];
    let mut params: Vec<BTreeSet<ValueId>> = vec![BTreeSet::new(); stages];
    for &n in &order {
        let s = stage_of[&n];
        for &v in graph.node(n).inputs.iter().flatten() {
            if let Some(&from) = made_in.get(&v) {
                if from > s {
                    return Err(terr(format!(
                        "node `{}` in stage {s} reads `{}` made in the later stage {from}",
                        graph.node(n).name,
                        graph.value(v).name
                    )));
                }
                for c in crossing.iter_mut().take(s).skip(from) {
                    c.insert(v);
                }
            } else if graph.value(v).kind != ValueKind::Input && is_trainable(graph, v) {
                params[s].insert(v);
            }
        }
    }
    for &o in &graph.outputs {
        if let Some(&from) = made_in.get(&o) {
            for c in crossing.iter_mut().skip(from) {
                c.insert(o);
            }
        }
    }
    let recompute = section.stages.iter().map(|s| !s.checkpointed_layers.is_empty()).collect();
    Ok(StageLayout {
        nodes,
        crossing: crossing.into_iter().map(|c| c.into_iter().collect()).collect(),
        params: params.into_iter().map(|c| c.into_iter().collect()).collect(),
        recompute,
    })
}

/// What to do with a plan the runner cannot execute as it is.
pub const REPLAN: &str = "re-plan the model with this smp-partition (`smp-partition MODEL ... -o PLAN.json`)";

/// The plan's codegen section, refused when it is missing or of a version this runner does not
/// execute.
pub fn codegen_section(plan: &Plan) -> Result<&CodegenSection, RuntimeError> {
    let replan = || REPLAN.replace("MODEL", &plan.model.path);
    let section = plan
        .codegen
        .as_ref()
        .ok_or_else(|| terr(format!("the plan has no codegen section (what each rank runs); {}", replan())))?;
    if section.version != CODEGEN_VERSION {
        return Err(terr(format!(
            "the plan's codegen section has version {}, but this smp-runner executes version {CODEGEN_VERSION}; {}",
            section.version,
            replan()
        )));
    }
    Ok(section)
}

/// Every rank's program, as codegen emitted them into the plan.
pub fn rank_programs(plan: &Plan, section: &CodegenSection) -> Result<Vec<RankProgram>, RuntimeError> {
    let mut programs = section.all_programs(&plan.mesh(), plan.parallel.sharded_dp).map_err(|e| terr(e.to_string()))?;
    programs.sort_by_key(|p| p.rank);
    Ok(programs)
}
