//! The plan file from the solver's decision.

use crate::cost::{ClusterSpec, CommModel, GroupSpan, LinkKind};
use crate::ir::{LayeredGraph, Parallelism};
use crate::split::{self, Strategy};
use crate::solve::{PlanDecision, PlanOptions};

use super::schema::*;

/// What the plan records about where the model came from.
#[derive(Clone, Debug)]
pub struct ModelRef {
    /// Path as given.
    pub path: String,
    /// SHA-256 of the file (hex).
    pub sha256: String,
}

fn bytes(x: f64) -> u64 {
    if x.is_finite() && x > 0.0 { x.round() as u64 } else { 0 }
}

/// Builds the plan (without its codegen section) for `decision`, which `opts` asked for;
/// `wall_s` is the planning time to record.
pub fn from_decision(d: &PlanDecision, lg: &LayeredGraph, cluster: &ClusterSpec, opts: &PlanOptions, model: &ModelRef, wall_s: f64) -> Plan {
    let stages: Vec<Stage> = d
        .stages
        .iter()
        .map(|s| {
            let m = &s.memory;
            let mut memory_bytes = StageMemory {
                params: bytes(m.params),
                grads: bytes(m.grads),
                optimizer: bytes(m.optimizer),
                activations: bytes(m.activations),
                recompute: bytes(m.recompute),
                loss: bytes(m.loss),
                workspace: bytes(m.workspace),
                total: 0,
            };
            // Rounded parts, so the total is exactly their sum.
            memory_bytes.total = memory_bytes.sum_of_parts();
            Stage {
                index: s.index,
                pp_rank: s.pp_rank,
                layers: s.layers,
                ranks: s.ranks.clone(),
                tp: d.parallel.tp,
                dp: d.parallel.dp,
                forward_s: s.forward_s,
                backward_s: s.backward_s,
                comm_s: s.comm_s,
                output_bytes: if s.index + 1 < d.stages.len() {
                    d.problem.layers.get(s.layers[1]).map_or(0, |l| bytes(l.output_bytes))
                } else {
                    0
                },
                memory_bytes,
                checkpointed_layers: s.checkpointed_layers.clone(),
                selective_layers: s.selective_layers.clone(),
                offloaded_layers: s.offloaded_layers.clone(),
                offloaded_bytes: bytes(s.offloaded_bytes),
            }
        })
        .collect();
    let mut facts = None;
    // Identical layers (one signature) under the same strategies have the same parts.
    let mut parts_of: std::collections::HashMap<(&str, Vec<Strategy>), Vec<LayerPart>> = Default::default();
    let layer_strategies = d
        .layers
        .iter()
        .map(|l| LayerStrategy {
            layer: l.layer,
            name: lg.layers.get(l.layer).map(|x| x.name.clone()).unwrap_or_default(),
            strategy: l.strategy.clone(),
            nodes: l.nodes.clone(),
            parts: match lg.layers.get(l.layer) {
                Some(x) if x.signature.is_empty() => layer_parts(lg, l.layer, &l.nodes, &d.parallel, &mut facts),
                Some(x) => parts_of
                    .entry((x.signature.as_str(), l.nodes.iter().map(|(_, s)| *s).collect()))
                    .or_insert_with(|| layer_parts(lg, l.layer, &l.nodes, &d.parallel, &mut facts))
                    .clone(),
                None => Vec::new(),
            },
        })
        .collect();
    let global_batch = opts.global_batch_for(lg, cluster);
    let per_microbatch = global_batch / (d.parallel.dp.max(1) * d.parallel.microbatches.max(1)) as u64;
    let mut plan = Plan {
        version: PLAN_VERSION,
        model: ModelInfo {
            path: model.path.clone(),
            sha256: model.sha256.clone(),
            params: lg.params,
            layers: lg.layers.len(),
        },
        cluster: ClusterInfo {
            preset: cluster.name.clone(),
            devices: cluster.devices,
            devices_per_node: cluster.devices_per_node,
            memory_limit_bytes: bytes(d.memory_limit_bytes),
            machine: cluster.machine.clone(),
        },
        parallel: Parallelism { active_microbatches: opts.active_microbatches, ..d.parallel },
        stages,
        layer_strategies,
        communication: Vec::new(),
        predicted: Predicted {
            step_time_s: d.predicted.step_time_s,
            samples_per_s: d.predicted.samples_per_s,
            bubble_ratio: d.predicted.bubble_ratio.max(0.0),
            peak_memory_bytes: 0,
            mfu: d.predicted.mfu,
            hfu: d.predicted.hfu,
        },
        solver: SolverInfo {
            status: match opts.baseline {
                Some(b) => PlanStatus::Baseline(b),
                None => PlanStatus::Solved(d.solver.status),
            },
            objective: d.solver.objective,
            bound: d.solver.bound,
            gap: d.solver.gap,
            wall_s,
            candidates: Candidates { solved: d.candidates_solved, skipped: d.candidates_skipped },
        },
        global_batch,
        seq_len: opts.seq_len,
        dims: opts.dims.iter().cloned().collect(),
        trainable: opts.params.trainable.clone(),
        frozen: opts.params.frozen.clone(),
        batch_statistics: BatchStatistics::of(&lg.graph, per_microbatch),
        request: Some(super::request::PlanRequest::of(opts, &format!("{}:{}", cluster.name, cluster.devices))),
        codegen: None,
        // Where a degree was searched, or the sequence is long enough (a sample's checkpointed
        // activations over an eighth of the device) that c = 1 deserves its reason.
        axes: (d.axes.cp_alternatives.len() > 1
            || d.axes.ep_alternatives.len() > 1
            || d.parallel.cp > 1
            || d.parallel.ep > 1
            || d.parallel.experts_folded()
            || d.axes.sample_input_bytes > d.memory_limit_bytes / 8.0)
            .then(|| AxesInfo {
            sample_input_bytes: bytes(d.axes.sample_input_bytes),
            activation_bytes: bytes(d.axes.activation_bytes),
            kv_transfer_s: d.axes.kv_transfer_s,
            kv_exposed_s: d.axes.kv_exposed_s,
            all_to_all_s: d.axes.all_to_all_s,
            all_to_all_hidden_s: d.axes.all_to_all_hidden_s,
            imbalance_s: d.axes.imbalance_s,
            state_bytes: bytes(d.axes.state_bytes),
            state_bytes_without_ep: bytes(d.axes.state_bytes_without_ep),
            cp_searched: d.axes.cp_alternatives.clone(),
            ep_searched: d.axes.ep_alternatives.clone(),
        }),
    };
    plan.predicted.peak_memory_bytes = (0..d.parallel.pp).map(|r| plan.rank_memory(r).total).max().unwrap_or(0);
    plan.communication = communication(d, cluster, &plan);
    plan
}


/// Pipeline and data-parallel traffic per device and step, by link kind (from the solved
/// pipeline problem; tensor-parallel traffic is inside the layer times and not itemised).
fn communication(d: &PlanDecision, cluster: &ClusterSpec, plan: &Plan) -> Vec<CommVolume> {
    let comm = CommModel::new(cluster);
    let mut out: Vec<CommVolume> = Vec::new();
    let mut add = |kind: Traffic, link: LinkKind, bytes: f64, time_s: f64| match out
        .iter_mut()
        .find(|c| c.kind == kind && c.link == link)
    {
        Some(c) => {
            c.bytes = c.bytes.max(bytes);
            c.time_s = c.time_s.max(time_s);
        }
        None => out.push(CommVolume { kind, link, bytes, time_s }),
    };
    let m = d.parallel.microbatches as f64;
    // Pipeline: each boundary sends the activation forward and receives its gradient back,
    // once per microbatch; the busiest boundary per link kind.
    for (c, pair) in plan.stages.windows(2).enumerate() {
        let last = pair[0].layers[1];
        let Some(layer) = d.problem.layers.get(last) else { continue };
        let (Some(&a), Some(&b)) = (pair[0].ranks.first(), pair[1].ranks.first()) else { continue };
        let link = comm.link_between(a, b);
        let per_step = 2.0 * layer.output_bytes * m;
        let time = per_step * d.problem.transfer_s_per_byte.get(c).copied().unwrap_or(0.0);
        add(Traffic::Pipeline, link, per_step, time);
    }
    // Data parallel: gradient all-reduce (or reduce-scatter + all-gather under ZeRO), ring
    // volume 2(d−1)/d of the stage's gradients per device, busiest stage.
    let replicas_n = d.parallel.dp * d.parallel.cp.max(1);
    if replicas_n > 1 {
        for s in &plan.stages {
            // Gradients reduce over every data-parallel and context rank of a tensor rank.
            let replicas: Vec<usize> = s.ranks.iter().step_by(d.parallel.tp.max(1)).copied().collect();
            let span = GroupSpan::of_ranks(&replicas, cluster.devices_per_node);
            let n = replicas_n as f64;
            let grads = if d.parallel.zero >= 2 { s.memory_bytes.grads as f64 * n } else { s.memory_bytes.grads as f64 };
            let volume = 2.0 * (n - 1.0) / n * grads;
            add(Traffic::Data, span.link_kind(), volume, comm.all_reduce(grads, &span));
        }
    }
    out
}

/// The attention cores and mixtures of experts of layer `layer` ([`split::describe`]) and how
/// the plan runs each (`nodes`: the plan's strategy per node); `facts` is the split analysis'
/// graph facts, made on first need.
fn layer_parts(
    lg: &LayeredGraph,
    layer: usize,
    nodes: &[(String, Strategy)],
    par: &Parallelism,
    facts: &mut Option<split::GraphFacts>,
) -> Vec<LayerPart> {
    let facts = facts.get_or_insert_with(|| split::GraphFacts::new(lg));
    let described = split::describe(lg, layer, &split::analyse(lg, layer, facts));
    let strategy = |node: &str| nodes.iter().find(|(n, _)| n == node).map(|(_, s)| *s);
    let mut out = Vec::new();
    for a in described.attention {
        let (form, kv_heads) = match a.form {
            split::AttentionForm::MultiHead => (AttentionKind::MultiHead, None),
            split::AttentionForm::GroupedQuery { kv_heads } => (AttentionKind::GroupedQuery, Some(kv_heads)),
            split::AttentionForm::Latent => (AttentionKind::Latent, None),
        };
        let heads_split = a.nodes.iter().any(|n| strategy(n) == Some(Strategy::Heads));
        let whole_because = (!heads_split).then(|| match a.heads {
            _ if par.tp == 1 => "no tensor parallelism (tp 1)".to_string(),
            _ if !a.splittable => "no head split reaches it (an op on the way has no split rule)".to_string(),
            Some(h) if h % par.tp as i64 != 0 => format!("{h} heads do not divide {} ways", par.tp),
            _ => "the solver replicates it (cheaper than splitting it here)".to_string(),
        });
        out.push(LayerPart::Attention { form, heads: a.heads, kv_heads, split: if heads_split { par.tp } else { 1 }, whole_because });
    }
    for e in described.experts {
        let folded = par.experts_folded();
        let split = if folded { par.etp } else if strategy(&e.node) == Some(Strategy::Experts) { par.tp } else { 1 };
        out.push(LayerPart::Experts { routed: e.routed, top_k: e.top_k, shared: e.shared, ep: par.ep, split, folded });
    }
    out
}
