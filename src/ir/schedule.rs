//! Pipeline schedules as data: the schedule kinds, actions in the contract's text form
//! (`2F0`, `2B0`, `2W0`, `1SEND_F0`, `2RECV_F0`, `2SEND_B0`, `1RECV_B0`) and the compute-only
//! action lists each pipeline rank runs, in the style of torch.distributed.pipelining.
//!
//! Stages are numbered globally: with `v` virtual stages per rank (interleaved), stage
//! `c·p + r` is chunk `c` of pipeline rank `r` (Megatron-LM's layout); otherwise stage = rank.

use std::fmt;
use std::str::FromStr;

/// A pipeline schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (Huang et al. 2019).
    GPipe,
    /// One-forward-one-backward (PipeDream-Flush, Narayanan et al. 2021).
    OneFOneB,
    /// Interleaved 1F1B with `virtual_stages` model chunks per rank (Narayanan et al. 2021).
    /// Build it with [`ScheduleKind::interleaved`], which holds the rule V ≥ 2.
    Interleaved {
        /// Model chunks per pipeline rank (V ≥ [`MIN_VIRTUAL_STAGES`]).
        virtual_stages: usize,
    },
    /// Zero-bubble ZB-H1 (Qi et al. 2024): backward split into input-gradient (B) and
    /// weight-gradient (W) halves, W deferred into bubbles, in-flight microbatches capped at p.
    ZbH1,
}

/// The fewest virtual stages per rank an interleaved schedule has (with one it is 1F1B).
pub const MIN_VIRTUAL_STAGES: usize = 2;

impl ScheduleKind {
    /// Interleaved 1F1B with `v` virtual stages per rank; refused unless
    /// v ≥ [`MIN_VIRTUAL_STAGES`].
    pub fn interleaved(v: usize) -> Result<ScheduleKind, ScheduleError> {
        if v >= MIN_VIRTUAL_STAGES {
            Ok(ScheduleKind::Interleaved { virtual_stages: v })
        } else {
            Err(ScheduleError::VirtualStages(v))
        }
    }

    /// The schedule a plan file names: its name without parameters ([`ScheduleKind::name`])
    /// and its virtual stages per rank (V ≥ 2 for `interleaved`, 1 for the others).
    pub fn from_parts(name: &str, virtual_stages: usize) -> Result<ScheduleKind, ScheduleError> {
        if name == "interleaved" {
            return ScheduleKind::interleaved(virtual_stages);
        }
        let kind: ScheduleKind = name.parse()?;
        if virtual_stages != 1 {
            return Err(ScheduleError::NotInterleaved { kind, virtual_stages });
        }
        Ok(kind)
    }

    /// Model chunks per pipeline rank (1 unless interleaved).
    pub fn virtual_stages(self) -> usize {
        match self {
            ScheduleKind::Interleaved { virtual_stages } => virtual_stages.max(1),
            _ => 1,
        }
    }

    /// Total pipeline stages for `p` ranks (p · v, saturating).
    pub fn stages(self, p: usize) -> usize {
        p.saturating_mul(self.virtual_stages())
    }

    /// The pipeline rank that runs `stage` (stage mod p).
    pub fn rank_of_stage(self, stage: usize, p: usize) -> usize {
        stage % p.max(1)
    }

    /// The share of pipeline rank 0's forwards that Megatron-Core's combined 1F1B
    /// (`--overlap-moe-expert-parallel-comm`) runs merged with another microbatch's backward,
    /// over `p` ranks and `m` microbatches: without a pipeline all but the first; interleaved,
    /// all but the warm-up, which the merged schedule lengthens by one forward; 0 for a pipeline
    /// it does not run (not interleaved). Rank 0 warms up longest.
    pub fn merged_share(self, p: usize, m: usize) -> f64 {
        let (p, m) = (p.max(1), m.max(1));
        if p == 1 {
            return (m - 1) as f64 / m as f64;
        }
        match self {
            ScheduleKind::Interleaved { virtual_stages } => {
                let total = m * virtual_stages.max(1);
                let warmup = ((virtual_stages.max(1) - 1) * interleaved_round_size(p, m) + 2 * (p - 1) + 1).min(total);
                (total - warmup) as f64 / total as f64
            }
            _ => 0.0,
        }
    }

    /// True when backward is split into B and W actions.
    pub fn splits_backward(self) -> bool {
        matches!(self, ScheduleKind::ZbH1)
    }

    /// Name without parameters (`gpipe`, `1f1b`, `interleaved`, `zb-h1`).
    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved { .. } => "interleaved",
            ScheduleKind::ZbH1 => "zb-h1",
        }
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleKind::Interleaved { virtual_stages } => write!(f, "interleaved:{virtual_stages}"),
            other => f.write_str(other.name()),
        }
    }
}

/// A schedule or action string that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    /// Unknown schedule name.
    #[error("unknown schedule `{0}`: expected gpipe, 1f1b, interleaved:V (V ≥ 2) or zb-h1")]
    UnknownSchedule(String),
    /// Interleaving with fewer than two virtual stages per rank.
    #[error("interleaved:{0}: interleaving needs V ≥ 2 virtual stages per rank (with one it is 1f1b)")]
    VirtualStages(usize),
    /// Virtual stages given for a schedule without them.
    #[error("schedule {kind} runs 1 virtual stage per rank, not {virtual_stages} (only interleaved:V has more)")]
    NotInterleaved {
        /// The schedule.
        kind: ScheduleKind,
        /// Virtual stages given.
        virtual_stages: usize,
    },
    /// An action string that is not `<stage><KIND><microbatch>`.
    #[error(
        "bad action `{0}`: expected <stage><kind><microbatch> with kind F, B, W, SEND_F, RECV_F, SEND_B or RECV_B (e.g. `2F0`, `1SEND_F3`)"
    )]
    BadAction(String),
    /// Degrees that no schedule can run.
    #[error("schedule {kind} needs p ≥ 1 and m ≥ 1 microbatches, got p = {p}, m = {m}")]
    BadDegrees {
        /// The schedule.
        kind: ScheduleKind,
        /// Pipeline ranks.
        p: usize,
        /// Microbatches.
        m: usize,
    },
}

impl FromStr for ScheduleKind {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let lower = s.trim().to_ascii_lowercase();
        match lower.as_str() {
            "gpipe" => return Ok(ScheduleKind::GPipe),
            "1f1b" => return Ok(ScheduleKind::OneFOneB),
            "zb-h1" | "zbh1" => return Ok(ScheduleKind::ZbH1),
            _ => {}
        }
        if let Some(v) = lower.strip_prefix("interleaved:")
            && let Ok(v) = v.parse::<usize>()
        {
            return ScheduleKind::interleaved(v);
        }
        Err(ScheduleError::UnknownSchedule(s.to_string()))
    }
}

/// What an action does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ActionKind {
    /// Forward of a stage on a microbatch (`F`).
    Forward,
    /// Backward (`B`): the full backward, or only the input-gradient half when the same rank
    /// also has a `W` for that stage and microbatch.
    Backward,
    /// Weight-gradient half of the backward (`W`, ZB-H1).
    BackwardWeight,
    /// Send a stage's forward output to the next stage (`SEND_F`).
    SendForward,
    /// Receive a stage's forward input from the previous stage (`RECV_F`).
    RecvForward,
    /// Send a stage's input gradient to the previous stage (`SEND_B`).
    SendBackward,
    /// Receive a stage's output gradient from the next stage (`RECV_B`).
    RecvBackward,
}

impl ActionKind {
    /// The text code (`F`, `B`, `W`, `SEND_F`, …).
    pub fn code(self) -> &'static str {
        match self {
            ActionKind::Forward => "F",
            ActionKind::Backward => "B",
            ActionKind::BackwardWeight => "W",
            ActionKind::SendForward => "SEND_F",
            ActionKind::RecvForward => "RECV_F",
            ActionKind::SendBackward => "SEND_B",
            ActionKind::RecvBackward => "RECV_B",
        }
    }

    fn from_code(code: &str) -> Option<ActionKind> {
        Some(match code {
            "F" => ActionKind::Forward,
            "B" => ActionKind::Backward,
            "W" => ActionKind::BackwardWeight,
            "SEND_F" => ActionKind::SendForward,
            "RECV_F" => ActionKind::RecvForward,
            "SEND_B" => ActionKind::SendBackward,
            "RECV_B" => ActionKind::RecvBackward,
            _ => return None,
        })
    }

    /// True for F, B and W.
    pub fn is_compute(self) -> bool {
        matches!(self, ActionKind::Forward | ActionKind::Backward | ActionKind::BackwardWeight)
    }
}

/// One schedule action: a stage, a kind and a microbatch (`2F0` = stage 2 forward of
/// microbatch 0).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Action {
    /// Global stage index.
    pub stage: usize,
    /// What it does.
    pub kind: ActionKind,
    /// Microbatch index (0 first).
    pub microbatch: usize,
}

impl Action {
    /// A new action.
    pub fn new(stage: usize, kind: ActionKind, microbatch: usize) -> Action {
        Action { stage, kind, microbatch }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}{}", self.stage, self.kind.code(), self.microbatch)
    }
}

impl FromStr for Action {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ScheduleError::BadAction(s.to_string());
        let t = s.trim();
        let code_start = t.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        let code_end = t.rfind(|c: char| !c.is_ascii_digit()).ok_or_else(bad)? + 1;
        if code_start == 0 || code_end >= t.len() {
            return Err(bad());
        }
        let stage = t[..code_start].parse().map_err(|_| bad())?;
        let kind = ActionKind::from_code(&t[code_start..code_end]).ok_or_else(bad)?;
        let microbatch = t[code_end..].parse().map_err(|_| bad())?;
        Ok(Action { stage, kind, microbatch })
    }
}

/// The compute-only action lists (F, B, W) of each of the `p` pipeline ranks, in the order
/// each rank runs them, for `m` microbatches.
///
/// - GPipe: all forwards, then all backwards (microbatch order).
/// - 1F1B: rank r runs min(p−1−r, m) warm-up forwards, then alternates F and B, then the
///   remaining backwards; at most min(p−r, m) microbatches in flight.
/// - Interleaved (Megatron-LM): forwards walk microbatch rounds through the chunks
///   (chunk-major inside a round), backwards the same with chunks reversed; rank r runs
///   min(2(p−1−r) + (v−1)g, m·v) warm-up forwards (g = p when p divides m), then alternates.
/// - ZB-H1: 1F1B's warm-up, W deferred up to min(p, m) in flight, deferred W's fill the
///   cool-down (see `zb_h1`).
pub fn compute_actions(kind: ScheduleKind, p: usize, m: usize) -> Result<Vec<Vec<Action>>, ScheduleError> {
    if p == 0 || m == 0 || kind.virtual_stages() == 0 {
        return Err(ScheduleError::BadDegrees { kind, p, m });
    }
    Ok((0..p).map(|r| rank_actions(kind, p, m, r)).collect())
}

fn rank_actions(kind: ScheduleKind, p: usize, m: usize, r: usize) -> Vec<Action> {
    use ActionKind::*;
    let f = |mb| Action::new(r, Forward, mb);
    let b = |mb| Action::new(r, Backward, mb);
    match kind {
        ScheduleKind::GPipe => (0..m).map(f).chain((0..m).map(b)).collect(),
        ScheduleKind::OneFOneB => {
            let warmup = (p - 1 - r).min(m);
            let mut out: Vec<Action> = (0..warmup).map(f).collect();
            for k in 0..m - warmup {
                out.push(f(warmup + k));
                out.push(b(k));
            }
            out.extend((m - warmup..m).map(b));
            out
        }
        ScheduleKind::Interleaved { virtual_stages: v } => interleaved(p, m, v, r),
        ScheduleKind::ZbH1 => zb_h1(p, m, r),
    }
}

/// ZB-H1 (Qi et al. 2024, Fig. 3): rank r runs 1F1B's min(p−1−r, m) warm-up forwards; in the
/// steady state F then B, with each W deferred until a forward would exceed min(p, m)
/// microbatches in flight (F done, W not done — 1F1B's first-stage peak), so rank r defers
/// up to r W's; in the cool-down each B is preceded by the oldest deferred W, which fills the
/// wait for the next gradient; the remaining W's close the list.
fn zb_h1(p: usize, m: usize, r: usize) -> Vec<Action> {
    let cap = p.min(m);
    let warmup = (p - 1 - r).min(m);
    let f = |mb| Action::new(r, ActionKind::Forward, mb);
    let b = |mb| Action::new(r, ActionKind::Backward, mb);
    let w = |mb| Action::new(r, ActionKind::BackwardWeight, mb);
    let mut out: Vec<Action> = (0..warmup).map(f).collect();
    let mut pending = std::collections::VecDeque::new();
    let mut in_flight = warmup;
    for k in 0..m {
        let next_f = warmup + k;
        if next_f < m {
            if in_flight == cap
                && let Some(mb) = pending.pop_front()
            {
                out.push(w(mb));
                in_flight -= 1;
            }
            out.push(f(next_f));
            in_flight += 1;
        } else if let Some(mb) = pending.pop_front() {
            out.push(w(mb));
            in_flight -= 1;
        }
        out.push(b(k));
        pending.push_back(k);
    }
    out.extend(pending.into_iter().map(w));
    out
}

/// Microbatches per round of the interleaved schedule: m split into max(1, ⌊m/p⌋) rounds of
/// near-equal size (the first rounds one larger), so every round has at least p microbatches
/// when m ≥ p — as torch.distributed.pipelining's rounds, without its m % rounds == 0
/// restriction. Returns the largest round (p when p divides m: Megatron-LM's groups of p).
pub fn interleaved_round_size(p: usize, m: usize) -> usize {
    let rounds = (m / p.max(1)).max(1);
    m.div_ceil(rounds)
}

/// Megatron-LM's interleaved order over rounds (see [`interleaved_round_size`]): forwards walk
/// each round through the chunks (chunk-major inside a round), backwards the same with chunks
/// reversed; rank r runs min((v−1)·g + 2(p−1−r), m·v) warm-up forwards with g the first
/// round's size, then alternates F and B.
fn interleaved(p: usize, m: usize, v: usize, r: usize) -> Vec<Action> {
    let rounds = (m / p).max(1);
    let (base, extra) = (m / rounds, m % rounds);
    let mut order = Vec::with_capacity(m * v);
    let mut start = 0;
    for round in 0..rounds {
        let end = start + base + usize::from(round < extra);
        for chunk in 0..v {
            for mb in start..end {
                order.push((chunk, mb));
            }
        }
        start = end;
    }
    let total = m * v;
    let fwd: Vec<Action> =
        order.iter().map(|&(c, mb)| Action::new(c * p + r, ActionKind::Forward, mb)).collect();
    let bwd: Vec<Action> = order
        .iter()
        .map(|&(c, mb)| Action::new((v - 1 - c) * p + r, ActionKind::Backward, mb))
        .collect();
    let warmup = ((v - 1) * interleaved_round_size(p, m) + 2 * (p - 1 - r)).min(total);
    let mut out: Vec<Action> = fwd[..warmup].to_vec();
    for k in 0..total - warmup {
        out.push(fwd[warmup + k]);
        out.push(bwd[k]);
    }
    out.extend_from_slice(&bwd[total - warmup..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_forms_round_trip() {
        for s in ["2F0", "2B0", "2W0", "1SEND_F0", "2RECV_F0", "3SEND_B12", "0RECV_B7"] {
            let a: Action = s.parse().unwrap();
            assert_eq!(a.to_string(), s);
        }
        for s in ["F0", "2F", "2X0", "", "2SEND0"] {
            assert!(s.parse::<Action>().is_err(), "{s}");
        }
        for s in ["gpipe", "1f1b", "interleaved:3", "zb-h1"] {
            assert_eq!(s.parse::<ScheduleKind>().unwrap().to_string(), s);
        }
        for s in ["interleaved:0", "interleaved:1", "interleaved", "1f1b:2"] {
            assert!(s.parse::<ScheduleKind>().is_err(), "{s}");
        }
    }

    /// Rank 0's own order says which forwards combined 1F1B merges: those after its first
    /// backward (the forward before it, the steady phase's first, is the warm-up's extra one).
    #[test]
    fn merged_forwards_are_rank_zeros_steady_phase_less_one() {
        for (kind, p, m) in [
            (ScheduleKind::Interleaved { virtual_stages: 4 }, 8, 128),
            (ScheduleKind::Interleaved { virtual_stages: 3 }, 32, 512),
            (ScheduleKind::Interleaved { virtual_stages: 2 }, 4, 4),
            (ScheduleKind::Interleaved { virtual_stages: 2 }, 2, 6),
        ] {
            let order = &compute_actions(kind, p, m).unwrap()[0];
            let forwards = order.iter().filter(|a| a.kind == ActionKind::Forward).count();
            let leading = order.iter().take_while(|a| a.kind == ActionKind::Forward).count();
            let want = (forwards - leading) as f64 / forwards as f64;
            assert!((kind.merged_share(p, m) - want).abs() < 1e-12, "{kind} p {p} m {m}: {} against {want}", kind.merged_share(p, m));
        }
        // without a pipeline every forward but the first pairs with the backward before it
        assert_eq!(ScheduleKind::OneFOneB.merged_share(1, 8), 7.0 / 8.0);
        assert_eq!(ScheduleKind::OneFOneB.merged_share(1, 1), 0.0);
        // a pipeline not interleaved: Megatron-Core refuses combined 1F1B there
        for kind in [ScheduleKind::OneFOneB, ScheduleKind::GPipe, ScheduleKind::ZbH1] {
            assert_eq!(kind.merged_share(4, 16), 0.0);
        }
    }

    #[test]
    fn the_plan_form_holds_one_rule_for_virtual_stages() {
        for k in [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::ZbH1, ScheduleKind::Interleaved { virtual_stages: 3 }] {
            assert_eq!(ScheduleKind::from_parts(k.name(), k.virtual_stages()), Ok(k));
        }
        assert_eq!(ScheduleKind::from_parts("interleaved", 1), Err(ScheduleError::VirtualStages(1)));
        assert!(ScheduleKind::from_parts("1f1b", 2).is_err());
        assert!(ScheduleKind::from_parts("interleaved:2", 2).is_err());
    }

    #[test]
    fn one_f_one_b_matches_the_textbook_order() {
        let a = compute_actions(ScheduleKind::OneFOneB, 2, 3).unwrap();
        let text: Vec<String> = a[0].iter().map(|a| a.to_string()).collect();
        assert_eq!(text, ["0F0", "0F1", "0B0", "0F2", "0B1", "0B2"]);
        let text: Vec<String> = a[1].iter().map(|a| a.to_string()).collect();
        assert_eq!(text, ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2"]);
    }
}
