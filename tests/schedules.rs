//! Schedules against the literature on equal stages: bubble ratios, in-flight microbatches,
//! ZB-H1 against 1F1B; and every schedule × (p, m, v) is deadlock-free with F before B.

use proptest::prelude::*;
use smp_partition::codegen::{LowerOptions, lower_schedule};
use smp_partition::cost::in_flight;
use smp_partition::ir::{Action, ScheduleKind, compute_actions};
use smp_partition::sim::{CostTable, EventKind, SimResult, simulate};

fn run(kind: ScheduleKind, p: usize, m: usize, f: f64, b: f64, w: f64) -> SimResult {
    let progs = lower_schedule(kind, p, m, &LowerOptions::default()).unwrap();
    let table = CostTable::uniform(kind.stages(p), f, b, w);
    simulate(&progs, &table).unwrap()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1.0)
}

#[test]
fn one_f_one_b_bubble_is_p_minus_1_over_m() {
    for (p, m) in [(2, 4), (4, 8), (4, 16), (8, 8), (8, 32), (3, 5)] {
        // Stage forward 1, backward 2 (B + W folded into B by 1F1B).
        let r = run(ScheduleKind::OneFOneB, p, m, 1.0, 1.5, 0.5);
        let expect = (p - 1) as f64 / m as f64;
        assert!(close(r.bubble_ratio, expect), "p={p} m={m}: {} vs {expect}", r.bubble_ratio);
        assert!(close(r.step_time, (m + p - 1) as f64 * 3.0));
    }
}

#[test]
fn gpipe_bubble_and_in_flight() {
    for (p, m) in [(2, 4), (4, 8), (8, 3)] {
        let r = run(ScheduleKind::GPipe, p, m, 1.0, 2.0, 0.0);
        assert!(close(r.bubble_ratio, (p - 1) as f64 / m as f64));
        for s in &r.ranks {
            assert_eq!(s.peak_in_flight, m, "GPipe keeps all m microbatches");
            assert_eq!(in_flight(ScheduleKind::GPipe, p, m, s.rank + 1), m as f64);
        }
    }
}

#[test]
fn one_f_one_b_keeps_p_in_flight_on_the_first_stage() {
    for (p, m) in [(4, 8), (8, 16), (4, 2), (1, 3)] {
        let r = run(ScheduleKind::OneFOneB, p, m, 1.0, 2.0, 0.0);
        assert_eq!(r.ranks[0].peak_in_flight, p.min(m));
        for s in &r.ranks {
            assert_eq!(s.peak_in_flight as f64, in_flight(ScheduleKind::OneFOneB, p, m, s.rank + 1));
        }
    }
}

#[test]
fn interleaved_bubble_is_p_minus_1_over_v_m() {
    for (p, m, v) in [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 16, 3), (8, 16, 2)] {
        let kind = ScheduleKind::Interleaved { virtual_stages: v };
        // Each chunk holds 1/v of a rank's layers.
        let r = run(kind, p, m, 1.0 / v as f64, 2.0 / v as f64, 0.0);
        let expect = (p - 1) as f64 / (v * m) as f64;
        assert!(close(r.bubble_ratio, expect), "p={p} m={m} v={v}: {} vs {expect}", r.bubble_ratio);
        for s in &r.ranks {
            let chunks = s.peak_in_flight as f64 / v as f64;
            assert!(close(chunks, in_flight(kind, p, m, s.rank + 1)), "rank {}: {chunks}", s.rank);
        }
    }
}

#[test]
fn zb_h1_beats_1f1b_at_equal_peak_memory() {
    // p = 4, m = 8; F = 1, B (input grad) = 1, W (weight grad) = 1, as in Qi et al.'s setting
    // T_F = T_B = T_W.
    let (p, m) = (4, 8);
    let one = run(ScheduleKind::OneFOneB, p, m, 1.0, 1.0, 1.0);
    let zb = run(ScheduleKind::ZbH1, p, m, 1.0, 1.0, 1.0);
    let peak = |r: &SimResult| r.ranks.iter().map(|s| s.peak_in_flight).max().unwrap();
    assert_eq!(peak(&zb), peak(&one));
    assert_eq!(peak(&one), p);
    assert!(zb.step_time < one.step_time, "ZB-H1 {} vs 1F1B {}", zb.step_time, one.step_time);
    // 1F1B: (m + p − 1)(F + B + W); ZB-H1's paper bound: m(F+B+W) + (p − 1)(F + B − W).
    assert!(close(one.step_time, 33.0));
    assert!(zb.step_time <= 24.0 + 3.0 * (1.0 + 1.0 - 1.0) + 1e-9, "ZB-H1 {}", zb.step_time);
    for s in &zb.ranks {
        assert!(s.peak_in_flight as f64 <= in_flight(ScheduleKind::ZbH1, p, m, s.rank + 1));
    }
}

fn any_schedule() -> impl Strategy<Value = ScheduleKind> {
    prop_oneof![
        Just(ScheduleKind::GPipe),
        Just(ScheduleKind::OneFOneB),
        Just(ScheduleKind::ZbH1),
        (1usize..5).prop_map(|v| ScheduleKind::Interleaved { virtual_stages: v }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn every_schedule_is_deadlock_free_with_f_before_b(
        kind in any_schedule(), p in 1usize..9, m in 1usize..20,
        f in 0.1f64..3.0, b in 0.1f64..3.0, w in 0.0f64..2.0,
    ) {
        let actions = compute_actions(kind, p, m).unwrap();
        // Every stage runs every microbatch's F and B exactly once (and W once for ZB-H1).
        let stages = kind.stages(p);
        let mut all: Vec<Action> = actions.concat();
        all.sort();
        let per_kind = if kind.splits_backward() { 3 } else { 2 };
        prop_assert_eq!(all.len(), stages * m * per_kind);
        all.dedup();
        prop_assert_eq!(all.len(), stages * m * per_kind);

        let progs = lower_schedule(kind, p, m, &LowerOptions { boundary_bytes: vec![1000; stages], ..Default::default() }).unwrap();
        let table = CostTable::uniform(stages, f, b, w);
        let r = simulate(&progs, &table).map_err(|e| TestCaseError::fail(e.to_string()))?;
        for s in 0..stages {
            for mb in 0..m {
                let end_of = |k: EventKind| r.events.iter()
                    .find(|e| e.kind == k && e.stage_mb == Some((s, mb)))
                    .map(|e| (e.start, e.end)).unwrap();
                let (_, f_end) = end_of(EventKind::Forward);
                let (b_start, b_end) = end_of(EventKind::Backward);
                prop_assert!(f_end <= b_start + 1e-12, "stage {} mb {}: F ends {} after B starts {}", s, mb, f_end, b_start);
                if kind.splits_backward() {
                    let (w_start, _) = end_of(EventKind::BackwardWeight);
                    prop_assert!(b_end <= w_start + 1e-12);
                }
                // Data dependencies across stages.
                if s + 1 < stages {
                    let next_f = r.events.iter().find(|e| e.kind == EventKind::Forward && e.stage_mb == Some((s + 1, mb))).unwrap();
                    prop_assert!(f_end <= next_f.start + 1e-12);
                }
            }
        }
        // The simulated peak never exceeds the memory model's in-flight count.
        for st in &r.ranks {
            let v = kind.virtual_stages() as f64;
            prop_assert!(st.peak_in_flight as f64 / v <= in_flight(kind, p, m, st.rank + 1) + 1e-9,
                "rank {}: {} chunks in flight vs model {}", st.rank, st.peak_in_flight, in_flight(kind, p, m, st.rank + 1));
        }
    }
}

#[test]
fn schedule_text_snapshots() {
    let mut text = String::new();
    for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB, ScheduleKind::Interleaved { virtual_stages: 2 }, ScheduleKind::ZbH1] {
        text.push_str(&format!("{kind} p=4 m=8\n"));
        for (r, list) in compute_actions(kind, 4, 8).unwrap().iter().enumerate() {
            let line: Vec<String> = list.iter().map(|a| a.to_string()).collect();
            text.push_str(&format!("  {r}: {}\n", line.join(" ")));
        }
    }
    insta::assert_snapshot!(text);
}

#[test]
fn lowered_program_json_snapshot() {
    let opts = LowerOptions { ranks: vec![0, 4], boundary_bytes: vec![4096, 0], epilogue: vec![] };
    let progs = lower_schedule(ScheduleKind::ZbH1, 2, 2, &opts).unwrap();
    insta::assert_json_snapshot!(progs);
}
