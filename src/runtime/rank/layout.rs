//! What a rank reads of its plan, in runtime terms: the graph the plan was made for, the nodes,
//! boundary values, data inputs and parameters of each stage, and every rank's program.
//!
//! The runner executes the graph the planner planned, rebuilt by codegen from the model it loads
//! and the plan's records ([`crate::codegen::stage_graph::planned_graph`]: the planner's
//! specialisation, the plan's fused ops, its fixed batch rebound). Every stage's lists are read
//! from the plan's codegen section and checked against that graph; nothing the plan holds is
//! derived again.

use std::collections::{HashMap, HashSet};

use crate::runtime::RuntimeError;
use crate::runtime::terr;
use crate::passes::figures::is_trainable;
use crate::codegen::encode::CODEGEN_VERSION;
use crate::codegen::stage_graph::{self, PlannedGraphError};
use crate::codegen::{CodegenSection, RankProgram};
use crate::ir::{DimBindings, Graph, NodeId, ValueId, ValueKind};
use crate::plan::Plan;

/// Which nodes and values each (global) stage of a plan owns, as the plan's codegen section
/// lists them, by id in the planned graph ([`planned_graph`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageLayout {
    /// Nodes of each stage (`StageCode::nodes`), in execution order.
    pub nodes: Vec<Vec<NodeId>>,
    /// `outputs_to_next[s]`: what stage s sends to stage s + 1 per microbatch, in the plan's
    /// order (`StageCode::outputs_to_next`).
    pub outputs_to_next: Vec<Vec<ValueId>>,
    /// `gradients_from_next[s]`: the subset of `outputs_to_next[s]` whose gradients stage s + 1
    /// sends back, in the same order (`StageCode::gradients_from_next`).
    pub gradients_from_next: Vec<Vec<ValueId>>,
    /// Graph inputs each stage reads from the data (`StageCode::data_inputs`).
    pub data_inputs: Vec<Vec<ValueId>>,
    /// Trained parameters each stage holds (`StageCode::params`), by value id ascending (the
    /// order of the rank's flat parameter and gradient buffers).
    pub params: Vec<Vec<ValueId>>,
    /// Stages whose forward is recomputed in the backward, whole layers
    /// (`StageCode::checkpointed_layers`) or selectively (`StageCode::selective_nodes`).
    pub recompute: Vec<bool>,
    /// Per stage, the nodes whose outputs it frees after each forward and rebuilds before the
    /// backward (`StageCode::selective_nodes`) and those whose outputs it holds until then
    /// (`StageCode::selective_kept`), by name.
    pub selective: Vec<super::segments::SelectiveNames>,
}

/// What to do with a plan the runner cannot execute as it is.
pub const REPLAN: &str = "re-plan the model with this smp-partition (`smp-partition MODEL ... -o PLAN.json`)";

/// The graph `plan` was made for, from the model `graph` as imported (parameters decided), as
/// codegen rebuilds it ([`crate::codegen::stage_graph::planned_graph`]: specialised with the
/// plan's dims, its fused ops applied, its fixed batch rebound), with its dim bindings. Its node
/// and value ids are those the plan's codegen section lists; [`stage_layout`] checks them.
pub fn planned_graph(plan: &Plan, graph: Graph) -> Result<(Graph, DimBindings), RuntimeError> {
    let section = codegen_section(plan)?;
    stage_graph::planned_graph(graph, section, (plan.seq_len.map(|s| s as i64), &plan.dims)).map_err(|e| match e {
        e @ PlannedGraphError::Specialise(_) => terr(e.to_string()),
        e => terr(format!("{e}; {REPLAN}")),
    })
}

/// The stage layout of `section` on `graph` (the planned graph, [`planned_graph`]), read from
/// the section's lists and checked against the graph: every listed node and value exists and
/// is what the list says (a value sent is made by the stage or an earlier one, a data input is
/// a graph input, a parameter a trained initializer), every node of the graph runs in exactly
/// one stage, and the lists are complete (each value a stage reads from an earlier stage is
/// sent across every boundary in between, graph outputs reach the last stage). A mismatch
/// means the plan was made for another graph and is refused with [`REPLAN`].
pub fn stage_layout(section: &CodegenSection, graph: &Graph) -> Result<StageLayout, RuntimeError> {
    let stages = section.stages.len();
    if stages == 0 {
        return Err(terr("the plan has no stages"));
    }
    let mismatch = |what: String| terr(format!("the plan does not fit the model: {what}; {REPLAN}"));
    let by_id: HashMap<usize, NodeId> = graph.node_ids().map(|n| (n.index(), n)).collect();
    let mut stage_of: HashMap<NodeId, usize> = HashMap::new();
    for (s, st) in section.stages.iter().enumerate() {
        if st.stage != s {
            return Err(terr(format!("plan stage {s} has index {}; stages must be listed in order", st.stage)));
        }
        for i in st.node_ids() {
            let n = *by_id.get(&i).ok_or_else(|| mismatch(format!("stage {s} runs node {i}, which the model as planned does not have")))?;
            if let Some(other) = stage_of.insert(n, s) {
                return Err(mismatch(format!("node `{}` (id {i}) is listed by stages {other} and {s}", graph.node(n).name)));
            }
        }
    }
    let order = graph.topo_order()?;
    if let Some(&n) = order.iter().find(|n| !stage_of.contains_key(n)) {
        return Err(mismatch(format!("node `{}` (id {}, {}) of the model as planned is in no stage", graph.node(n).name, n.index(), graph.node(n).op)));
    }
    let mut nodes = vec![Vec::new(); stages];
    let mut made_in: HashMap<ValueId, usize> = HashMap::new();
    for &n in &order {
        nodes[stage_of[&n]].push(n);
        for &o in &graph.node(n).outputs {
            made_in.insert(o, stage_of[&n]);
        }
    }
    let value = |s: usize, list: &str, name: &str| {
        graph.value_by_name(name).ok_or_else(|| mismatch(format!("stage {s}'s `{list}` names `{name}`, which the model as planned does not have")))
    };
    let carries = crate::passes::params::carries_gradient(graph).map_err(|e| terr(format!("ordering the model as planned: {e}")))?;
    let mut outputs_to_next = Vec::with_capacity(stages);
    let mut gradients_from_next = Vec::with_capacity(stages);
    let mut data_inputs = Vec::with_capacity(stages);
    let mut params = Vec::with_capacity(stages);
    for (s, st) in section.stages.iter().enumerate() {
        let sends = st.outputs_to_next.iter().map(|n| value(s, "outputs_to_next", n)).collect::<Result<Vec<_>, _>>()?;
        if s + 1 == stages && !sends.is_empty() {
            return Err(mismatch(format!("the last stage sends `{}`", st.outputs_to_next[0])));
        }
        for (&v, name) in sends.iter().zip(&st.outputs_to_next) {
            if made_in.get(&v).is_none_or(|&a| a > s) {
                return Err(mismatch(format!("stage {s} sends `{name}`, which no node of stage {s} or an earlier one makes")));
            }
        }
        let grads = st.gradients_from_next.iter().map(|n| value(s, "gradients_from_next", n)).collect::<Result<Vec<_>, _>>()?;
        let carriers: Vec<ValueId> = sends.iter().copied().filter(|&v| carries[v.index()]).collect();
        if grads != carriers {
            return Err(mismatch(format!(
                "stage {s} expects gradients of {:?}, but of what it sends, {:?} are computed from trained parameters",
                st.gradients_from_next,
                carriers.iter().map(|&v| graph.value(v).name.as_str()).collect::<Vec<_>>()
            )));
        }
        let data = st.data_inputs.iter().map(|n| value(s, "data_inputs", n)).collect::<Result<Vec<_>, _>>()?;
        if let Some((_, name)) = data.iter().zip(&st.data_inputs).find(|(v, _)| !graph.inputs.contains(v)) {
            return Err(mismatch(format!("stage {s} reads `{name}` from the data, but it is no graph input")));
        }
        let mut ps = st.params.iter().map(|n| value(s, "params", n)).collect::<Result<Vec<_>, _>>()?;
        if let Some((_, name)) = ps.iter().zip(&st.params).find(|(v, _)| graph.value(**v).kind != ValueKind::Initializer || !is_trainable(graph, **v)) {
            return Err(mismatch(format!("stage {s} holds `{name}` as a trained parameter, but the model does not train it")));
        }
        ps.sort();
        outputs_to_next.push(sends);
        gradients_from_next.push(grads);
        data_inputs.push(data);
        params.push(ps);
    }
    // the lists are complete: what each stage reads is made there, sent to it, a listed data
    // input or parameter, or a constant
    let sent: Vec<HashSet<ValueId>> = outputs_to_next.iter().map(|v| v.iter().copied().collect()).collect();
    let check_read = |t: usize, v: ValueId, reader: &str| -> Result<(), RuntimeError> {
        let name = &graph.value(v).name;
        if let Some(&a) = made_in.get(&v) {
            if a > t {
                return Err(mismatch(format!("{reader} in stage {t} reads `{name}`, made in the later stage {a}")));
            }
            if let Some(s) = (a..t).find(|&s| !sent[s].contains(&v)) {
                return Err(mismatch(format!("{reader} in stage {t} reads `{name}` from stage {a}, but stage {s} does not send it")));
            }
        } else if graph.inputs.contains(&v) {
            if !data_inputs[t].contains(&v) {
                return Err(mismatch(format!("{reader} in stage {t} reads graph input `{name}`, which the stage's `data_inputs` do not list")));
            }
        } else if graph.value(v).kind == ValueKind::Initializer && is_trainable(graph, v) && !params[t].contains(&v) {
            return Err(mismatch(format!("{reader} in stage {t} reads trained parameter `{name}`, which the stage's `params` do not list")));
        }
        Ok(())
    };
    let mut read: Vec<HashSet<ValueId>> = vec![HashSet::new(); stages];
    for &n in &order {
        let t = stage_of[&n];
        for &v in graph.node(n).inputs.iter().flatten() {
            check_read(t, v, &format!("node `{}`", graph.node(n).name))?;
            read[t].insert(v);
        }
    }
    for &o in &graph.outputs {
        check_read(stages - 1, o, "the loss")?;
    }
    for (s, ps) in params.iter().enumerate() {
        if let Some(&v) = ps.iter().find(|v| !read[s].contains(v)) {
            return Err(mismatch(format!("stage {s} holds parameter `{}`, which none of its nodes reads", graph.value(v).name)));
        }
    }
    let recompute = section.stages.iter().map(|s| !s.checkpointed_layers.is_empty() || !s.selective_nodes.is_empty()).collect();
    let selective = section
        .stages
        .iter()
        .map(|s| super::segments::SelectiveNames { rebuilt: s.selective_nodes.iter().cloned().collect(), kept: s.selective_kept.iter().cloned().collect() })
        .collect();
    Ok(StageLayout { nodes, outputs_to_next, gradients_from_next, data_inputs, params, recompute, selective })
}

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
