//! The runner reads its stage layout and fused ops from the plan: on models/gpt2.onnx, pp 2 and
//! pp 2 × tp 2 plans, the graph the runner builds for a plan (`planned_graph`) is the graph the
//! planner analysed, node for node, and every stage's lists equal an independent derivation on
//! it. Plans whose node lists or fused-op records do not fit the model are refused, naming the
//! node and saying to re-plan.
#![cfg(feature = "runner")]

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use smp_partition::cost::ClusterSpec;
use smp_partition::frontend::onnx::load_model;
use smp_partition::ir::{FusedOp, Graph, NodeId, OpKind, ValueId, ValueKind};
use smp_partition::passes::figures::is_trainable;
use smp_partition::passes::params::{self, ParamOptions};
use smp_partition::plan::Plan;
use smp_partition::runtime::rank::{planned_graph, stage_layout};
use smp_partition::solve::PlanOptions;
use smp_partition::{compile, compile::analyze_options, load_and_analyze};

fn model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/gpt2.onnx")
}

fn options(pp: usize, tp: usize) -> PlanOptions {
    PlanOptions {
        seq_len: Some(16),
        global_batch: Some(8),
        pp: Some(pp),
        tp: Some(tp),
        dp: Some(1),
        microbatches: Some(4),
        ..Default::default()
    }
}

fn plan(pp: usize, tp: usize) -> Plan {
    let cluster = ClusterSpec::parse(&format!("h100-80gb:{}", pp * tp)).unwrap();
    compile(&model(), &cluster, &options(pp, tp)).unwrap()
}

/// The model as the runner imports it (parameters decided as the plan says).
fn imported() -> Graph {
    let mut g = load_model(&model()).unwrap().graph;
    params::decide(&mut g, &ParamOptions::default()).unwrap();
    g
}

/// Value names of `ids`.
fn names(g: &Graph, ids: &[ValueId]) -> Vec<String> {
    ids.iter().map(|&v| g.value(v).name.clone()).collect()
}

#[test]
fn the_runners_layout_is_the_plans_on_the_planners_graph() {
    for (pp, tp) in [(2, 1), (2, 2)] {
        let plan = plan(pp, tp);
        let section = plan.codegen.as_ref().unwrap();
        assert_eq!(section.stages.len(), 2);
        // the plan carries the fused GELU chains and attentions (one each per block of the
        // 4-block export)
        assert_eq!(section.fused.len(), 8, "pp {pp} tp {tp}");
        let (g, _) = planned_graph(&plan, imported()).unwrap();
        // the planner's graph, node for node
        let analysed = load_and_analyze(&model(), &analyze_options(&options(pp, tp))).unwrap().lg.graph;
        let nodes = |g: &Graph| -> Vec<(usize, String, String)> {
            g.node_ids().map(|n| (n.index(), g.node(n).name.clone(), g.node(n).op.to_string())).collect()
        };
        assert_eq!(nodes(&g), nodes(&analysed), "pp {pp} tp {tp}: the runner's graph is not the planner's");
        assert_eq!(g.node_ids().filter(|&n| g.node(n).op.is(OpKind::Gelu)).count(), 4);
        assert_eq!(g.node_ids().filter(|&n| g.node(n).op.is(OpKind::ScaledDotProductAttention)).count(), 4);

        let layout = stage_layout(section, &g).unwrap();
        // an independent derivation on the planned graph: which stage makes each value, which
        // stages read it
        let stage_of: HashMap<NodeId, usize> =
            layout.nodes.iter().enumerate().flat_map(|(s, ns)| ns.iter().map(move |&n| (n, s))).collect();
        let mut made: HashMap<ValueId, usize> = HashMap::new();
        for (&n, &s) in &stage_of {
            for &o in &g.node(n).outputs {
                made.insert(o, s);
            }
        }
        let last = section.stages.len() - 1;
        let mut crossing: Vec<BTreeSet<ValueId>> = vec![BTreeSet::new(); last];
        let mut data: Vec<BTreeSet<ValueId>> = vec![BTreeSet::new(); last + 1];
        let mut held: Vec<BTreeSet<ValueId>> = vec![BTreeSet::new(); last + 1];
        let reads = stage_of.iter().flat_map(|(&n, &s)| g.node(n).inputs.iter().flatten().map(move |&v| (s, v)));
        for (s, v) in reads.chain(g.outputs.iter().map(|&o| (last, o))) {
            if let Some(&a) = made.get(&v) {
                for c in &mut crossing[a..s] {
                    c.insert(v);
                }
            } else if g.inputs.contains(&v) {
                data[s].insert(v);
            } else if g.value(v).kind == ValueKind::Initializer && is_trainable(&g, v) {
                held[s].insert(v);
            }
        }
        for (s, code) in section.stages.iter().enumerate() {
            let listed: BTreeSet<usize> = code.node_ids().collect();
            let run: BTreeSet<usize> = layout.nodes[s].iter().map(|n| n.index()).collect();
            assert_eq!(run, listed, "stage {s} nodes");
            assert_eq!(names(&g, &layout.data_inputs[s]), code.data_inputs, "stage {s} data inputs");
            assert_eq!(names(&g, &layout.data_inputs[s]), names(&g, &data[s].iter().copied().collect::<Vec<_>>()));
            let params: BTreeSet<String> = names(&g, &layout.params[s]).into_iter().collect();
            assert_eq!(params, code.params.iter().cloned().collect(), "stage {s} params");
            assert_eq!(params, names(&g, &held[s].iter().copied().collect::<Vec<_>>()).into_iter().collect());
            if s < last {
                assert_eq!(names(&g, &layout.outputs_to_next[s]), code.outputs_to_next, "stage {s} sends");
                let want: Vec<ValueId> = crossing[s].iter().copied().collect();
                assert_eq!(layout.outputs_to_next[s], want, "stage {s} sends what later stages read");
                assert!(!want.is_empty());
                assert_eq!(names(&g, &layout.gradients_from_next[s]), code.gradients_from_next);
                // gradients come back for exactly the crossing values that have a trained
                // parameter among their ancestors (found walking producers backwards)
                let want: Vec<ValueId> = crossing[s].iter().copied().filter(|&v| has_trained_ancestor(&g, v)).collect();
                assert_eq!(layout.gradients_from_next[s], want, "pp {pp} tp {tp} stage {s} gradients");
                // GPT-2's causal mask is a float that crosses but gets no gradient
                assert!(
                    crossing[s].iter().any(|&v| float(&g, v) && !want.contains(&v)),
                    "pp {pp} tp {tp} stage {s}: no constant float crosses"
                );
            }
        }
    }
}

fn float(g: &Graph, v: ValueId) -> bool {
    g.value(v).ty.as_ref().is_some_and(|t| t.dtype.is_float())
}

/// Whether a trained initializer is among `v`'s ancestors, only through floating-point values.
fn has_trained_ancestor(g: &Graph, v: ValueId) -> bool {
    let producer: HashMap<ValueId, NodeId> = g.node_ids().flat_map(|n| g.node(n).outputs.iter().map(move |&o| (o, n))).collect();
    let mut stack = vec![v];
    let mut seen = BTreeSet::new();
    while let Some(v) = stack.pop() {
        if !seen.insert(v) || !float(g, v) {
            continue;
        }
        if g.value(v).kind == ValueKind::Initializer && is_trainable(g, v) {
            return true;
        }
        if let Some(&n) = producer.get(&v) {
            stack.extend(g.node(n).inputs.iter().flatten().copied());
        }
    }
    false
}

fn edited(plan: &Plan, edit: impl Fn(&mut serde_json::Value)) -> Plan {
    let mut v = serde_json::to_value(plan).unwrap();
    edit(&mut v);
    serde_json::from_value(v).unwrap()
}

#[test]
fn a_node_list_that_does_not_fit_the_model_is_refused_naming_the_node() {
    let plan = plan(2, 1);
    let (g, _) = planned_graph(&plan, imported()).unwrap();
    let first = plan.codegen.as_ref().unwrap().stages[0].nodes[0];
    let name = g.node_ids().find(|n| n.index() == first[0]).map(|n| g.node(n).name.clone()).unwrap();
    // stage 0 leaves its first node out: it runs nowhere
    let short = edited(&plan, |v| v["codegen"]["stages"][0]["nodes"][0][0] = (first[0] + 1).into());
    let err = stage_layout(short.codegen.as_ref().unwrap(), &g).unwrap_err().to_string();
    assert!(err.contains(&format!("`{name}`")) && err.contains("in no stage") && err.contains("re-plan"), "{err}");
    // stage 1 lists a node the model does not have
    let extra = edited(&plan, |v| v["codegen"]["stages"][1]["nodes"].as_array_mut().unwrap().push(serde_json::json!([100000, 100001])));
    let err = stage_layout(extra.codegen.as_ref().unwrap(), &g).unwrap_err().to_string();
    assert!(err.contains("node 100000") && err.contains("re-plan"), "{err}");
    // stage 0 does not send what stage 1 reads
    let unsent = edited(&plan, |v| {
        let gone = v["codegen"]["stages"][0]["outputs_to_next"].as_array_mut().unwrap().pop().unwrap();
        v["codegen"]["stages"][0]["gradients_from_next"].as_array_mut().unwrap().retain(|g| *g != gone);
    });
    let err = stage_layout(unsent.codegen.as_ref().unwrap(), &g).unwrap_err().to_string();
    assert!(err.contains("does not send") && err.contains("re-plan"), "{err}");
}

#[test]
fn an_edited_fused_op_record_is_refused() {
    let plan = plan(2, 1);
    let fused = &plan.codegen.as_ref().unwrap().fused;
    let of = |attention: bool| -> Vec<usize> {
        (0..fused.len()).filter(|&i| matches!(fused[i].op, smp_partition::ir::FusedOp::Attention { .. }) == attention).collect()
    };
    let (gelus, attentions) = (of(false), of(true));
    assert!(gelus.len() >= 2 && attentions.len() >= 2, "{fused:?}");
    let (g0, g1, a0) = (gelus[0], gelus[1], attentions[0]);
    let node = fused[g0].node;
    // another input (the second chain's): refused when the runner applies it to the model
    let other = fused[g1].inputs.clone();
    let wrong = edited(&plan, |v| v["codegen"]["fused"][g0]["inputs"] = serde_json::json!(other.clone()));
    let err = planned_graph(&wrong, imported()).unwrap_err().to_string();
    assert!(err.contains(&format!("fused op at node {node}")) && err.contains("re-plan"), "{err}");
    // the other approximation: refused too
    let erf = edited(&plan, |v| v["codegen"]["fused"][g0]["op"] = serde_json::json!({"gelu": {"approximate": "none"}}));
    let err = planned_graph(&erf, imported()).unwrap_err().to_string();
    assert!(err.contains(&format!("fused op at node {node}")) && err.contains("re-plan"), "{err}");
    // an attention with another scale, or its q and v swapped: refused
    let anode = fused[a0].node;
    let FusedOp::Attention { scale, mask } = fused[a0].op else { unreachable!() };
    let rescaled = edited(&plan, |v| v["codegen"]["fused"][a0]["op"] = serde_json::json!({"attention": {"scale": scale.0 * 2.0, "mask": mask}}));
    let err = planned_graph(&rescaled, imported()).unwrap_err().to_string();
    assert!(err.contains(&format!("fused op at node {anode}")) && err.contains("scale by") && err.contains("re-plan"), "{err}");
    let unmasked = edited(&plan, |v| v["codegen"]["fused"][a0]["op"] = serde_json::json!({"attention": {"scale": scale.0}}));
    let err = smp_partition::plan::io::from_json(&serde_json::to_string(&unmasked).unwrap(), Path::new("edited.json")).map(|_| ()).unwrap_err();
    let chain = std::iter::successors(Some(&err as &dyn std::error::Error), |e| e.source()).map(|e| e.to_string()).collect::<Vec<_>>().join(": ");
    assert!(chain.contains("lists 4 inputs"), "{chain}");
    // a replaced node that still runs in a stage: refused when the plan is read
    let mut v = serde_json::to_value(&plan).unwrap();
    let replaced = fused[g0].replaces.iter().copied().find(|&n| n != node).unwrap();
    v["codegen"]["stages"][0]["nodes"].as_array_mut().unwrap().push(serde_json::json!([replaced, replaced + 1]));
    let err = smp_partition::plan::io::from_json(&v.to_string(), Path::new("edited.json")).unwrap_err();
    let msg = format!("{err:#}");
    let chain = std::iter::successors(Some(&err as &dyn std::error::Error), |e| e.source()).map(|e| e.to_string()).collect::<Vec<_>>().join(": ");
    assert!(chain.contains(&format!("replaced node {replaced} still runs")), "{msg} / {chain}");
    // an unknown op is refused by the typed contract
    let mut v = serde_json::to_value(&plan).unwrap();
    v["codegen"]["fused"][g0]["op"] = serde_json::json!({"gelu": {"approximate": "fast"}});
    assert!(smp_partition::plan::io::from_json(&v.to_string(), Path::new("edited.json")).is_err());
}
