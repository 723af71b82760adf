//! Validation of per-rank programs and layer shards, run before a plan is written and when it
//! is loaded: every receive has exactly one matching send (and every send a receive),
//! collectives match across their group (kind, bytes, tag, order), and the weight slices of a
//! tensor group are in range and cover each sliced weight exactly once.

use std::collections::{BTreeMap, HashMap};

use super::program::{Instr, Payload, RankProgram};
use super::encode::{CodegenSection, Coord, Mesh, Step};
use super::collectives::CollectiveInsert;
use super::shard::LayerShard;
use crate::ir::Graph;

/// One problem found; the message names the rank and the action or weight.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("rank {rank}: {what}")]
pub struct Invalid {
    /// Global rank (tensor rank for shard problems).
    pub rank: usize,
    /// What is wrong, naming the action (`2RECV_F1`) or the weight.
    pub what: String,
}

/// All problems of a plan's programs or shards (empty vectors never returned).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidationErrors(pub Vec<Invalid>);

impl std::fmt::Display for ValidationErrors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.len();
        for (i, e) in self.0.iter().take(5).enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        if n > 5 {
            write!(f, "; and {} more", n - 5)?;
        }
        Ok(())
    }
}

impl std::error::Error for ValidationErrors {}

fn finish(errs: Vec<Invalid>) -> Result<(), ValidationErrors> {
    if errs.is_empty() { Ok(()) } else { Err(ValidationErrors(errs)) }
}

/// (sender, receiver, payload, sending stage, microbatch) — what identifies a message.
type MsgKey = (usize, usize, Payload, usize, usize);

/// Checks point-to-point messages and collectives of a set of rank programs.
pub fn validate_programs(programs: &[RankProgram]) -> Result<(), ValidationErrors> {
    let mut errs = Vec::new();
    let ranks: HashMap<usize, &RankProgram> = programs.iter().map(|p| (p.rank, p)).collect();
    if ranks.len() != programs.len() {
        let mut seen = std::collections::HashSet::new();
        for p in programs {
            if !seen.insert(p.rank) {
                errs.push(Invalid { rank: p.rank, what: "has two programs".into() });
            }
        }
    }
    // Point to point.
    let mut sends: BTreeMap<MsgKey, Vec<(usize, &Instr)>> = BTreeMap::new();
    let mut recvs: BTreeMap<MsgKey, Vec<(usize, &Instr)>> = BTreeMap::new();
    for p in programs {
        for i in &p.instrs {
            match *i {
                Instr::Send { to: peer, what, stage, mb, .. } => {
                    sends.entry((p.rank, peer, what, stage, mb)).or_default().push((p.rank, i));
                    if !ranks.contains_key(&peer) {
                        errs.push(Invalid { rank: p.rank, what: format!("{i} sends to rank {peer}, which has no program") });
                    }
                }
                Instr::Recv { from: peer, what, stage, mb, .. } => {
                    let sending = match what {
                        Payload::Activation => stage.checked_sub(1),
                        Payload::Gradient => stage.checked_add(1),
                    };
                    match sending {
                        Some(s) => recvs.entry((peer, p.rank, what, s, mb)).or_default().push((p.rank, i)),
                        None if what == Payload::Activation => errs.push(Invalid { rank: p.rank, what: format!("{i} receives an activation into the first stage") }),
                        None => errs.push(Invalid { rank: p.rank, what: format!("{i} receives a gradient from stage {stage} + 1, past any stage") }),
                    }
                }
                _ => {}
            }
        }
    }
    for (key, rs) in &recvs {
        let ss = sends.get(key).map_or(&[][..], Vec::as_slice);
        for (k, (rank, instr)) in rs.iter().enumerate() {
            match ss.get(k) {
                None if ss.is_empty() => errs.push(Invalid { rank: *rank, what: format!("{instr} has no matching send") }),
                None => errs.push(Invalid { rank: *rank, what: format!("{instr} is received more often than rank {} sends it", key.0) }),
                Some((_, s)) => {
                    let (Instr::Send { bytes: sb, .. }, Instr::Recv { bytes: rb, .. }) = (s, instr) else { continue };
                    if sb != rb {
                        errs.push(Invalid { rank: *rank, what: format!("{instr} expects {rb} bytes, rank {} sends {sb}", key.0) });
                    }
                }
            }
        }
        if ss.len() > rs.len() {
            errs.push(Invalid { rank: key.0, what: format!("{} is sent {} times but received {} times", ss[0].1, ss.len(), rs.len()) });
        }
    }
    for (key, ss) in &sends {
        if !recvs.contains_key(key) {
            errs.push(Invalid { rank: ss[0].0, what: format!("{} to rank {} has no matching receive", ss[0].1, key.1) });
        }
    }
    // Collectives: each member's sequence on a group, compared with the first member's.
    let mut seqs: BTreeMap<Vec<usize>, BTreeMap<usize, Vec<&Instr>>> = BTreeMap::new();
    for p in programs {
        for i in &p.instrs {
            if let Some((group, _)) = i.collective() {
                if !group.contains(&p.rank) {
                    errs.push(Invalid { rank: p.rank, what: format!("{i} runs over group {group:?}, which does not include it") });
                    continue;
                }
                seqs.entry(group.to_vec()).or_default().entry(p.rank).or_default().push(i);
            }
        }
    }
    for (group, by_rank) in &seqs {
        let Some(&lead) = group.iter().find(|r| by_rank.contains_key(r)) else { continue };
        let reference = &by_rank[&lead];
        for &member in group {
            let empty = Vec::new();
            let mine = by_rank.get(&member).unwrap_or(&empty);
            if !ranks.contains_key(&member) {
                errs.push(Invalid { rank: lead, what: format!("group {group:?} includes rank {member}, which has no program") });
                continue;
            }
            for k in 0..reference.len().max(mine.len()) {
                match (reference.get(k), mine.get(k)) {
                    (Some(a), Some(b)) if !same_collective(a, b) => errs.push(Invalid {
                        rank: member,
                        what: format!("collective #{k} on group {group:?} is {} but rank {lead} runs {}", describe(b), describe(a)),
                    }),
                    (Some(a), None) => errs.push(Invalid {
                        rank: member,
                        what: format!("misses collective #{k} on group {group:?} ({} on rank {lead})", describe(a)),
                    }),
                    (None, Some(b)) => errs.push(Invalid {
                        rank: member,
                        what: format!("runs {} as collective #{k} on group {group:?}, which rank {lead} does not", describe(b)),
                    }),
                    _ => {}
                }
            }
        }
    }
    finish(errs)
}

fn same_collective(a: &Instr, b: &Instr) -> bool {
    std::mem::discriminant(a) == std::mem::discriminant(b) && bytes(a) == bytes(b) && a.collective().map(|c| c.1) == b.collective().map(|c| c.1)
}

fn bytes(i: &Instr) -> u64 {
    match i {
        Instr::AllReduce { bytes, .. } | Instr::ReduceScatter { bytes, .. } | Instr::AllGather { bytes, .. } => *bytes,
        _ => 0,
    }
}

fn describe(i: &Instr) -> String {
    format!("{i} of {} bytes", bytes(i))
}

/// Checks the shards of one layer's tensor group (one per tensor rank): every slice in range
/// of the model's initializer, and the slices of each weight covering it exactly once.
pub fn validate_shards(graph: &Graph, shards: &[LayerShard]) -> Result<(), ValidationErrors> {
    let dims = |name: &str| {
        let val = graph.value(graph.value_by_name(name)?);
        val.data.as_ref().map(|d| d.dims.clone()).or_else(|| val.ty.as_ref().and_then(|t| t.shape.as_ref()).and_then(|s| s.known()))
    };
    validate_shard_group(&dims, shards)
}

/// [`validate_shards`] with initializer dims from `dims` (None: the model has no such weight
/// or its shape is unknown).
pub fn validate_shard_group(dims: &dyn Fn(&str) -> Option<Vec<i64>>, shards: &[LayerShard]) -> Result<(), ValidationErrors> {
    let mut errs = Vec::new();
    let tp = shards.len();
    for (i, s) in shards.iter().enumerate() {
        if s.rank != i || s.tp != tp {
            errs.push(Invalid { rank: s.rank, what: format!("shard {i} of a group of {tp} says rank {} of {}", s.rank, s.tp) });
        }
    }
    // the tensor ranks of a layer run the same collectives, in the same order
    if let Some(lead) = shards.first() {
        for s in &shards[1..] {
            let n = lead.collectives.len().max(s.collectives.len());
            if let Some(k) = (0..n).find(|&k| lead.collectives.get(k) != s.collectives.get(k)) {
                let show = |c: Option<&CollectiveInsert>| match c {
                    Some(c) => format!("{} of `{}`", c.kind.name(), c.after_value),
                    None => "nothing".to_string(),
                };
                errs.push(Invalid {
                    rank: s.rank,
                    what: format!(
                        "collective #{k} of layer {} is {}, but rank {} runs {}",
                        s.layer,
                        show(s.collectives.get(k)),
                        lead.rank,
                        show(lead.collectives.get(k))
                    ),
                });
            }
        }
    }
    // initializer → (rank, axis, ranges, replicas) of every rank
    let mut by_weight: BTreeMap<&str, Vec<(usize, usize, &[[u64; 2]], u64)>> = BTreeMap::new();
    for s in shards {
        for w in &s.weight_slices {
            let Some(dims) = dims(&w.initializer) else {
                errs.push(Invalid { rank: s.rank, what: format!("slices `{}`, which the model does not have (or whose shape is unknown)", w.initializer) });
                continue;
            };
            let Some(&d) = dims.get(w.axis) else {
                errs.push(Invalid { rank: s.rank, what: format!("slices `{}` along axis {}, but it has {} axes", w.initializer, w.axis, dims.len()) });
                continue;
            };
            let mut bad = false;
            for r in &w.ranges {
                if r[0] >= r[1] || r[1] > d as u64 {
                    errs.push(Invalid {
                        rank: s.rank,
                        what: format!("slice [{}, {}) of `{}` along axis {} is out of range (size {d})", r[0], r[1], w.initializer, w.axis),
                    });
                    bad = true;
                }
            }
            if !bad {
                by_weight.entry(&w.initializer).or_default().push((s.rank, w.axis, &w.ranges, w.replicas));
            }
        }
    }
    for (name, parts) in by_weight {
        let axis = parts[0].1;
        if let Some(p) = parts.iter().find(|p| p.1 != axis) {
            errs.push(Invalid { rank: p.0, what: format!("slices `{name}` along axis {}, rank {} along axis {axis}", p.1, parts[0].0) });
            continue;
        }
        for s in shards {
            if !parts.iter().any(|p| p.0 == s.rank) {
                errs.push(Invalid { rank: s.rank, what: format!("holds all of `{name}`, which other tensor ranks slice") });
            }
        }
        // A declared replication factor: consecutive groups of that many ranks hold one slice.
        let k = parts[0].3;
        if let Some(p) = parts.iter().find(|p| p.3 != k) {
            errs.push(Invalid { rank: p.0, what: format!("declares `{name}` shared by {} ranks, rank {} by {k}", p.3, parts[0].0) });
            continue;
        }
        if k == 0 || tp as u64 % k != 0 {
            errs.push(Invalid { rank: parts[0].0, what: format!("declares `{name}` shared by {k} ranks, which does not divide the {tp} tensor ranks") });
            continue;
        }
        let k = k as usize;
        let mut mismatched = false;
        for p in &parts {
            let lead = p.0 - p.0 % k;
            if let Some(q) = parts.iter().find(|q| q.0 == lead)
                && q.2 != p.2
            {
                errs.push(Invalid { rank: p.0, what: format!("shares `{name}` with rank {lead} ({k} ranks per slice) but holds {:?}, rank {lead} {:?}", p.2, q.2) });
                mismatched = true;
            }
        }
        if mismatched {
            continue;
        }
        let d = dims(name).and_then(|dims| dims.get(axis).copied()).unwrap_or(0) as u64;
        let mut all: Vec<(u64, u64, usize)> =
            parts.iter().filter(|p| p.0 % k == 0).flat_map(|p| p.2.iter().map(move |r| (r[0], r[1], p.0))).collect();
        all.sort_unstable();
        let mut at = 0;
        for (s, e, rank) in all {
            if s < at {
                errs.push(Invalid { rank, what: format!("slice [{s}, {e}) of `{name}` overlaps another rank's (covered up to {at})") });
            } else if s > at {
                errs.push(Invalid { rank, what: format!("`{name}` along axis {axis}: [{at}, {s}) is held by no rank") });
            }
            at = at.max(e);
        }
        if at < d {
            errs.push(Invalid { rank: parts[parts.len() - 1].0, what: format!("`{name}` along axis {axis}: [{at}, {d}) is held by no rank") });
        }
    }
    finish(errs)
}

/// Checks a plan's codegen section against its mesh: one template per pipeline rank, every
/// stage run by exactly one, each stage's forward and backward once per microbatch, the shards
/// of every layer's tensor group in range and covering each sliced weight once, and the
/// concrete programs of all ranks (messages and collectives) consistent.
///
/// Messages name a global rank; shard problems name the first global rank running the shard.
pub fn validate_section(section: &CodegenSection, mesh: &Mesh, microbatches: usize, sharded_dp: Option<usize>) -> Result<(), ValidationErrors> {
    let mut errs = Vec::new();
    let first_rank = |pp: usize, tp: usize| first_rank(mesh, pp, tp);
    if section.tp != mesh.tp() {
        errs.push(Invalid { rank: 0, what: format!("codegen section is for tp = {}, the plan's tp is {}", section.tp, mesh.tp()) });
        return finish(errs);
    }
    let runner_of_stage = check_templates(section, mesh, microbatches, &mut errs);
    for s in 0..section.stages.len() {
        if !runner_of_stage.contains_key(&s) {
            errs.push(Invalid { rank: 0, what: format!("stage {s} is run by no pipeline rank") });
        }
        let code = &section.stages[s];
        let rank = runner_of_stage.get(&s).map_or(0, |&pp| first_rank(pp, 0));
        if code.stage != s {
            errs.push(Invalid { rank, what: format!("stage entry {s} says stage {}", code.stage) });
        }
        if let Some(g) = code.gradients_from_next.iter().find(|g| !code.outputs_to_next.contains(g)) {
            errs.push(Invalid { rank, what: format!("stage {s} expects the gradient of `{g}`, which it does not send") });
        }
    }
    // Node ranges: non-empty, and no node in two ranges (the runner checks them against the
    // graph; they are never expanded here, as a damaged plan may span billions of ids).
    let mut spans: Vec<(usize, usize, usize)> = section.stages.iter().flat_map(|st| st.nodes.iter().map(move |r| (r[0], r[1], st.stage))).collect();
    spans.sort_unstable();
    for (k, &(a, b, s)) in spans.iter().enumerate() {
        if a >= b {
            errs.push(Invalid { rank: 0, what: format!("stage {s} lists the empty node range [{a}, {b})") });
        }
        if let Some(&(_, prev_end, prev_stage)) = k.checked_sub(1).and_then(|j| spans.get(j))
            && a < prev_end
        {
            errs.push(Invalid { rank: 0, what: format!("node {a} is listed twice (stages {prev_stage} and {s})") });
        }
    }
    if !errs.is_empty() {
        return finish(errs);
    }
    let stage_of = |n: usize| {
        let i = spans.partition_point(|&(a, _, _)| a <= n);
        i.checked_sub(1).map(|i| spans[i]).filter(|&(_, b, _)| n < b).map(|(_, _, s)| s)
    };
    check_fused(section, &stage_of, &mut errs);
    for (i, t) in section.tied_weights.iter().enumerate() {
        if let Some(&p) = t.pp_ranks.iter().find(|&&p| p >= mesh.pp()) {
            errs.push(Invalid { rank: 0, what: format!("tied weight #{i} `{}` names pipeline rank {p}, but pp = {}", t.weight, mesh.pp()) });
        }
    }
    check_shards(section, mesh, &runner_of_stage, &mut errs);
    if !errs.is_empty() {
        return finish(errs);
    }
    // Replicas and tensor ranks of a pipeline rank share its template, and their peers and
    // groups resolve within the same replica and tensor rank (or to groups whose members all
    // run that template), so above a few hundred ranks checking replica 0, tensor rank 0 of
    // every pipeline rank is as strong as checking all ranks.
    let world = mesh.world();
    let checked = if world <= FULL_CHECK_RANKS {
        mesh.clone()
    } else {
        Mesh { ranks: (0..mesh.pp()).map(|pp| vec![vec![first_rank(pp, 0)]]).collect() }
    };
    match section.all_programs(&checked, sharded_dp) {
        Ok(programs) => validate_programs(&programs),
        Err(e) => finish(vec![Invalid { rank: 0, what: e.to_string() }]),
    }
}

/// Global rank of replica 0 at (pipeline rank, tensor rank).
fn first_rank(mesh: &Mesh, pp: usize, tp: usize) -> usize {
    mesh.rank(Coord { pp, dp: 0, tp }).unwrap_or(0)
}

/// One program template per pipeline rank, each running its own stages only, each stage's
/// forward and backward once per microbatch, one optimizer step last. Returns the pipeline
/// rank running each stage.
fn check_templates(section: &CodegenSection, mesh: &Mesh, microbatches: usize, errs: &mut Vec<Invalid>) -> BTreeMap<usize, usize> {
    let first_rank = |pp: usize, tp: usize| first_rank(mesh, pp, tp);
    let mut runner_of_stage: BTreeMap<usize, usize> = BTreeMap::new();
    for pp in 0..mesh.pp() {
        let found: Vec<_> = section.templates.iter().filter(|t| t.pp_rank == pp).collect();
        if found.len() != 1 {
            errs.push(Invalid { rank: first_rank(pp, 0), what: format!("pipeline rank {pp} has {} program templates, expected 1", found.len()) });
        }
    }
    for t in &section.templates {
        if t.pp_rank >= mesh.pp() {
            errs.push(Invalid { rank: 0, what: format!("program template for pipeline rank {}, but pp = {}", t.pp_rank, mesh.pp()) });
            continue;
        }
        let rank = first_rank(t.pp_rank, 0);
        for &s in &t.stages {
            if s >= section.stages.len() {
                errs.push(Invalid { rank, what: format!("runs stage {s}, but the plan has {} stages", section.stages.len()) });
            } else if let Some(other) = runner_of_stage.insert(s, t.pp_rank) {
                errs.push(Invalid { rank, what: format!("runs stage {s}, which pipeline rank {other} runs too") });
            }
        }
        // Forward and backward once per microbatch for each of its stages, only its stages.
        let mut fwd: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        let mut bwd: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        let mut steps_after_opt = false;
        for step in &t.steps {
            let (stage, mb, map) = match *step {
                Step::Forward { stage, mb } => (stage, mb, &mut fwd),
                Step::Backward { stage, mb } => (stage, mb, &mut bwd),
                Step::OptimizerStep => {
                    if steps_after_opt {
                        errs.push(Invalid { rank, what: "runs OPTIMIZER_STEP twice".into() });
                    }
                    steps_after_opt = true;
                    continue;
                }
                _ => continue,
            };
            if steps_after_opt {
                errs.push(Invalid { rank, what: format!("{} runs after the optimizer step", describe_step(step)) });
            }
            if !t.stages.contains(&stage) {
                errs.push(Invalid { rank, what: format!("{} runs stage {stage}, which pipeline rank {} does not own", describe_step(step), t.pp_rank) });
            }
            map.entry(stage).or_default().push(mb);
        }
        if !steps_after_opt {
            errs.push(Invalid { rank, what: "has no OPTIMIZER_STEP".into() });
        }
        for &s in &t.stages {
            for (name, map) in [("forward", &fwd), ("backward", &bwd)] {
                let mut mbs = map.get(&s).cloned().unwrap_or_default();
                mbs.sort_unstable();
                if mbs.len() != microbatches || mbs.iter().enumerate().any(|(i, &mb)| i != mb) {
                    errs.push(Invalid {
                        rank,
                        what: format!("runs the {name} of stage {s} for microbatches {mbs:?}, expected each of 0..{microbatches} once"),
                    });
                }
            }
        }
    }
    runner_of_stage
}

/// Each fused node runs in a stage, the nodes it replaces in none and in no other fused op.
fn check_fused(section: &CodegenSection, stage_of: &dyn Fn(usize) -> Option<usize>, errs: &mut Vec<Invalid>) {
    let mut replaced: BTreeMap<usize, usize> = BTreeMap::new();
    for f in &section.fused {
        let mut bad = |what: String| errs.push(Invalid { rank: 0, what: format!("fused op at node {} ({}): {what}", f.node, f.op) });
        if !f.replaces.contains(&f.node) {
            bad("the node is not among the nodes it replaces".into());
        }
        if f.inputs.len() != f.op.arity() {
            bad(format!("lists {} inputs; {} reads {}", f.inputs.len(), f.op, f.op.arity()));
        }
        if f.output.is_empty() || f.inputs.iter().any(|i| i.is_empty() || *i == f.output) {
            bad(format!("reads {:?} and makes `{}`; each must be named, and the output differ from the inputs", f.inputs, f.output));
        }
        if stage_of(f.node).is_none() {
            bad("the fused node runs in no stage".into());
        }
        for &n in &f.replaces {
            if let Some(other) = replaced.insert(n, f.node) {
                bad(format!("node {n} is replaced by fused node {other} too"));
            }
            if let Some(s) = stage_of(n).filter(|_| n != f.node) {
                bad(format!("replaced node {n} still runs in stage {s}"));
            }
        }
    }
}

/// Every layer has `tp` shards that agree with each other and with the sliced weights' dims.
fn check_shards(section: &CodegenSection, mesh: &Mesh, runner_of_stage: &BTreeMap<usize, usize>, errs: &mut Vec<Invalid>) {
    let first_rank = |pp: usize, tp: usize| first_rank(mesh, pp, tp);
    if section.tp > 1 {
        let layers = section.stages.last().map_or(0, |s| s.layers[1] + 1);
        if section.shards.len() != layers {
            errs.push(Invalid { rank: 0, what: format!("{} layers have shards, the stages cover {layers}", section.shards.len()) });
        }
        let dims = |name: &str| section.weight_dims.get(name).cloned();
        for (l, group) in section.shards.iter().enumerate() {
            let pp = section.stages.iter().find(|s| s.layers[0] <= l && l <= s.layers[1]).and_then(|s| runner_of_stage.get(&s.stage)).copied().unwrap_or(0);
            for (k, s) in group.iter().enumerate() {
                if s.layer != l {
                    errs.push(Invalid { rank: first_rank(pp, k), what: format!("shard {k} of layer {l} says layer {}", s.layer) });
                }
            }
            if group.len() != section.tp {
                errs.push(Invalid { rank: first_rank(pp, 0), what: format!("layer {l} has {} shards for tp = {}", group.len(), section.tp) });
                continue;
            }
            if let Err(ValidationErrors(es)) = validate_shard_group(&dims, group) {
                errs.extend(es.into_iter().map(|e| Invalid { rank: first_rank(pp, e.rank), what: format!("layer {l} (tensor rank {}): {}", e.rank, e.what) }));
            }
        }
    }
}

/// Up to this many ranks the validator instantiates and checks every rank's program.
pub const FULL_CHECK_RANKS: usize = 256;

fn describe_step(s: &Step) -> String {
    match *s {
        Step::Forward { stage, mb } => format!("{stage}F{mb}"),
        Step::Backward { stage, mb } => format!("{stage}B{mb}"),
        _ => format!("{s:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen::{LowerOptions, lower_schedule};
    use crate::codegen::program::Purpose;
    use crate::codegen::shard::WeightSlice;
    use crate::ir::{DType, ScheduleKind, Shape, TensorType, ValueKind};

    fn programs() -> Vec<RankProgram> {
        let mut opts = LowerOptions { boundary_bytes: vec![1024; 4], ..Default::default() };
        opts.epilogue = (0..4).map(|_| Vec::new()).collect();
        let mut ps = lower_schedule(ScheduleKind::OneFOneB, 4, 8, &opts).unwrap();
        // A tensor-parallel-style all-reduce between ranks 2 and 3, before their optimizer step.
        for r in [2, 3] {
            let at = ps[r].instrs.len() - 1;
            ps[r].instrs.insert(at, Instr::AllReduce { group: vec![2, 3], bytes: 4096, purpose: Purpose::TiedGrad { weight: "wte".into() } });
        }
        ps
    }

    #[test]
    fn lowered_programs_are_valid() {
        validate_programs(&programs()).unwrap();
    }

    #[test]
    fn dropped_send_names_the_receiving_rank_and_action() {
        let mut ps = programs();
        let at = ps[2].instrs.iter().position(|i| matches!(i, Instr::Send { what: Payload::Activation, mb: 1, .. })).unwrap();
        ps[2].instrs.remove(at);
        let err = validate_programs(&ps).unwrap_err();
        let msgs: Vec<String> = err.0.iter().map(ToString::to_string).collect();
        assert!(msgs.contains(&"rank 3: 3RECV_F1 has no matching send".to_string()), "{msgs:?}");
    }

    #[test]
    fn mismatched_collective_is_named() {
        let mut ps = programs();
        for i in ps[3].instrs.iter_mut() {
            if let Instr::AllReduce { bytes, .. } = i {
                *bytes = 2048;
            }
        }
        let err = validate_programs(&ps).unwrap_err();
        let m = err.0[0].to_string();
        assert!(m.starts_with("rank 3: collective #0 on group [2, 3]") && m.contains("2048") && m.contains("4096"), "{m}");
        let mut ps = programs();
        let at = ps[2].instrs.iter().position(|i| i.collective().is_some()).unwrap();
        ps[2].instrs.remove(at);
        let m = validate_programs(&ps).unwrap_err().0[0].to_string();
        assert!(m.starts_with("rank 2: misses collective #0 on group [2, 3] (ALL_REDUCE(tied-grad:wte)"), "{m}");
    }

    fn weight_graph() -> Graph {
        let mut g = Graph::new("w");
        let ty = TensorType { dtype: DType::F32, shape: Some(Shape::from_known(&[8, 6])) };
        g.add_value("w", ValueKind::Initializer, Some(ty), None).unwrap();
        g
    }

    fn shards(ranges: [Vec<[u64; 2]>; 2]) -> Vec<LayerShard> {
        ranges
            .into_iter()
            .enumerate()
            .map(|(rank, r)| LayerShard {
                layer: 0,
                tp: 2,
                rank,
                weight_slices: vec![WeightSlice { initializer: "w".into(), axis: 1, ranges: r, replicas: 1 }],
                constant_rewrites: vec![],
                rewrites: vec![],
                collectives: vec![],
                partial_gradients: vec![],
            })
            .collect()
    }

    #[test]
    fn slices_must_cover_each_weight_once() {
        let g = weight_graph();
        validate_shards(&g, &shards([vec![[0, 1], [2, 4]], vec![[1, 2], [4, 6]]])).unwrap();
        let m = validate_shards(&g, &shards([vec![[0, 3]], vec![[3, 7]]])).unwrap_err().0[0].to_string();
        assert_eq!(m, "rank 1: slice [3, 7) of `w` along axis 1 is out of range (size 6)");
        let m = validate_shards(&g, &shards([vec![[0, 4]], vec![[3, 6]]])).unwrap_err().0[0].to_string();
        assert!(m.starts_with("rank 1: slice [3, 6) of `w` overlaps"), "{m}");
        let m = validate_shards(&g, &shards([vec![[0, 2]], vec![[3, 6]]])).unwrap_err().0[0].to_string();
        assert!(m.contains("[2, 3) is held by no rank"), "{m}");
    }

    /// A shard group whose ranks disagree on a collective (a reduce-scatter of sequence
    /// parallelism against an all-reduce) is named with the rank and the collective.
    #[test]
    fn mismatched_shard_collectives_are_named() {
        use crate::codegen::{CollectiveInsert, CollectiveKind, GroupKind};
        let g = weight_graph();
        let mut s = shards([vec![[0, 3]], vec![[3, 6]]]);
        for x in &mut s {
            x.collectives = vec![CollectiveInsert::after("y", CollectiveKind::ReduceScatter { axis: 1 }, GroupKind::Tensor)];
        }
        validate_shards(&g, &s).unwrap();
        s[1].collectives[0].kind = CollectiveKind::AllReduce;
        let m = validate_shards(&g, &s).unwrap_err().0[0].to_string();
        assert_eq!(m, "rank 1: collective #0 of layer 0 is AllReduce of `y`, but rank 0 runs ReduceScatter of `y`");
        s[1].collectives.clear();
        let m = validate_shards(&g, &s).unwrap_err().0[0].to_string();
        assert_eq!(m, "rank 1: collective #0 of layer 0 is nothing, but rank 0 runs ReduceScatter of `y`");
    }

    /// Two identical slices are a double cover unless they declare that two ranks share them.
    #[test]
    fn declared_replicas_share_a_slice() {
        let g = weight_graph();
        let mut s = shards([vec![[0, 6]], vec![[0, 6]]]);
        let m = validate_shards(&g, &s).unwrap_err().0[0].to_string();
        assert!(m.starts_with("rank 1: slice [0, 6) of `w` overlaps"), "{m}");
        for x in &mut s {
            x.weight_slices[0].replicas = 2;
        }
        validate_shards(&g, &s).unwrap();
        s[1].weight_slices[0].ranges = vec![[0, 3]];
        let m = validate_shards(&g, &s).unwrap_err().0[0].to_string();
        assert!(m.starts_with("rank 1: shares `w` with rank 0 (2 ranks per slice)"), "{m}");
        s[1].weight_slices[0].replicas = 1;
        let m = validate_shards(&g, &s).unwrap_err().0[0].to_string();
        assert!(m.starts_with("rank 1: declares `w` shared by 1 ranks"), "{m}");
        for x in &mut s {
            x.weight_slices[0].replicas = 3;
        }
        let m = validate_shards(&g, &s).unwrap_err().0[0].to_string();
        assert!(m.contains("does not divide the 2 tensor ranks"), "{m}");
    }
}
