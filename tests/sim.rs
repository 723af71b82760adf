//! Simulator: deadlocks name the rank and action, collectives synchronise their group,
//! communication delays the receiver, and the trace has the Perfetto JSON structure.

use smp_partition::codegen::{Instr, LowerOptions, Payload, Purpose, RankProgram, lower_schedule};
use smp_partition::cost::{ClusterSpec, CommModel};
use smp_partition::ir::ScheduleKind;
use smp_partition::sim::{CostTable, SimError, chrome_trace, simulate};

fn one_f_one_b(p: usize, m: usize) -> Vec<RankProgram> {
    lower_schedule(ScheduleKind::OneFOneB, p, m, &LowerOptions { boundary_bytes: vec![1 << 20; p], ..Default::default() })
        .unwrap()
}

#[test]
fn a_missing_receive_is_a_deadlock_naming_the_rank() {
    let mut progs = one_f_one_b(4, 8);
    let before = progs[1].instrs.len();
    progs[1].instrs.retain(|i| i.to_string() != "1RECV_F3");
    assert_eq!(progs[1].instrs.len(), before - 1);
    let err = simulate(&progs, &CostTable::uniform(4, 1.0, 2.0, 0.0)).unwrap_err();
    let SimError::Deadlock { stuck } = &err else { panic!("expected a deadlock, got {err}") };
    assert_eq!(stuck[0].rank, 1);
    assert_eq!(stuck[0].at, "1F3");
    let msg = err.to_string();
    assert!(msg.starts_with("deadlock: rank 1 waits at 1F3"), "{msg}");
    assert!(msg.contains("1RECV_F3"), "{msg}");
}

#[test]
fn a_missing_send_is_a_deadlock_saying_nothing_sends_it() {
    let mut progs = one_f_one_b(4, 8);
    progs[0].instrs.retain(|i| i.to_string() != "0SEND_F3");
    let err = simulate(&progs, &CostTable::uniform(4, 1.0, 2.0, 0.0)).unwrap_err().to_string();
    assert!(err.starts_with("deadlock: rank 1 waits at 1RECV_F3, nothing sends it"), "{err}");
}

#[test]
fn a_send_nobody_receives_is_reported() {
    let mut progs = one_f_one_b(2, 2);
    progs[1].instrs.retain(|i| !matches!(i, Instr::Recv { .. } | Instr::Forward { .. } | Instr::Backward { .. } | Instr::Send { .. }));
    progs[0].instrs.retain(|i| !matches!(i, Instr::Recv { .. } | Instr::Backward { .. }));
    let err = simulate(&progs, &CostTable::uniform(2, 1.0, 1.0, 0.0)).unwrap_err().to_string();
    assert!(err.contains("rank 0's 0SEND_F0 to rank 1 is never received"), "{err}");
}

#[test]
fn collectives_wait_for_the_whole_group_and_cost_the_ring_time() {
    let spec = ClusterSpec::parse("h100-80gb:8").unwrap();
    let comm = CommModel::new(&spec);
    let bytes = 1u64 << 30;
    let ar = |group: Vec<usize>| Instr::AllReduce { group, bytes, purpose: Purpose::DpGrads { stage: 0 } };
    let progs = vec![
        RankProgram { rank: 0, instrs: vec![Instr::Forward { stage: 0, mb: 0 }, ar(vec![0, 1]), Instr::OptimizerStep] },
        RankProgram { rank: 1, instrs: vec![ar(vec![0, 1]), Instr::OptimizerStep] },
    ];
    let mut table = CostTable::uniform(1, 3.0, 0.0, 0.0);
    table.comm = Some(comm);
    let r = simulate(&progs, &table).unwrap();
    let expect = 3.0 + (2.0 * 0.5 * bytes as f64 / spec.intra_node_bandwidth + 2.0 * spec.intra_node_latency);
    assert!((r.ranks[1].finish - expect).abs() < 1e-12, "{} vs {expect}", r.ranks[1].finish);
    assert!((r.ranks[0].finish - expect).abs() < 1e-12);

    // A group member that never arrives is named.
    let progs = vec![
        RankProgram { rank: 0, instrs: vec![ar(vec![0, 1])] },
        RankProgram { rank: 1, instrs: vec![Instr::OptimizerStep] },
    ];
    let err = simulate(&progs, &table).unwrap_err().to_string();
    assert!(err.contains("rank 0 waits at ALL_REDUCE(dp-grads:stage0), ranks [1] of its group never reach it"), "{err}");
}

#[test]
fn transfers_delay_the_receiver_by_the_link_time() {
    // Two stages on different nodes: the activation crosses the network.
    let spec = ClusterSpec::parse("h100-80gb:16").unwrap();
    let comm = CommModel::new(&spec);
    let bytes = 64u64 << 20;
    let opts = LowerOptions { ranks: vec![0, 8], boundary_bytes: vec![bytes, 0], epilogue: vec![] };
    let progs = lower_schedule(ScheduleKind::GPipe, 2, 1, &opts).unwrap();
    let mut table = CostTable::uniform(2, 1.0, 2.0, 0.0);
    table.comm = Some(comm);
    let r = simulate(&progs, &table).unwrap();
    let hop = bytes as f64 / spec.inter_node_bandwidth + spec.inter_node_latency;
    // F0 (1) → hop → F1 (1) → B1 (2) → hop → B0 (2).
    assert!((r.step_time - (6.0 + 2.0 * hop)).abs() < 1e-12, "{}", r.step_time);
}

#[test]
fn the_trace_of_a_4_stage_plan_has_the_perfetto_structure() {
    let progs = one_f_one_b(4, 8);
    let r = simulate(&progs, &CostTable::uniform(4, 1e-3, 2e-3, 0.0)).unwrap();
    let trace = chrome_trace(&r);
    let text = serde_json::to_string(&trace).unwrap();
    let back: serde_json::Value = serde_json::from_str(&text).unwrap();
    let events = back["traceEvents"].as_array().expect("traceEvents array");
    let complete: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
    // 4 ranks × 8 microbatches × (F + B) compute events, plus transfers.
    assert_eq!(complete.iter().filter(|e| e["tid"] == 0 && e["cat"] != "optimizer").count(), 64);
    for e in &complete {
        assert!(e["name"].is_string());
        assert!(e["ts"].as_f64().unwrap() >= 0.0);
        assert!(e["dur"].as_f64().unwrap() >= 0.0);
        assert!(e["pid"].as_u64().unwrap() < 4);
        assert!(e["tid"].is_u64());
    }
    // µs: the first F of stage 0 lasts 1 ms.
    let f0 = complete.iter().find(|e| e["name"] == "0F0").unwrap();
    assert_eq!(f0["dur"].as_f64().unwrap(), 1000.0);
    for rank in 0..4u64 {
        assert!(events.iter().any(|e| e["ph"] == "M" && e["name"] == "process_name" && e["pid"] == rank
            && e["args"]["name"] == format!("rank {rank}")));
        assert!(events.iter().any(|e| e["ph"] == "M" && e["name"] == "thread_name" && e["pid"] == rank));
    }
}

#[test]
fn programs_round_trip_through_json() {
    let progs = one_f_one_b(2, 2);
    let text = serde_json::to_string(&progs).unwrap();
    let back: Vec<RankProgram> = serde_json::from_str(&text).unwrap();
    assert_eq!(back, progs);
    assert!(text.contains(r#""op":"send""#) && text.contains(r#""what":"activation""#), "{text}");
    let _ = Payload::Gradient;
}
