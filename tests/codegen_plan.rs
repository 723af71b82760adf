//! The plan's codegen section through the CLI: what each rank runs (checked against the
//! plan's own stage rank lists), and the validator rejecting hand-broken plans with a message
//! naming the rank and the action.

mod common;

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

use serde_json::Value;
use smp_partition::codegen::{Instr, Payload};
use smp_partition::plan::io::{self, PlanIoError};
use smp_partition::plan::Plan;

/// A real plan of the GPT-2 export, as JSON text.
fn plan_text(extra: &[&str]) -> String {
    let mut args = vec!["models/gpt2.onnx", "--cluster", common::CPU4, "--seq-len", "16", "--global-batch", "8", "--memory-limit", "4", "--json"];
    args.extend_from_slice(extra);
    let o = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
        .args(&args)
        .env("SMP_CPU_CALIBRATION", "/nonexistent/cpu.toml")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

fn load(text: &str) -> Result<Plan, PlanIoError> {
    io::from_json(text, Path::new("plan.json"))
}

/// Loads `text` after `edit`, expecting the validator to reject it; returns the message.
fn broken(text: &str, edit: impl FnOnce(&mut Value)) -> String {
    let mut v: Value = serde_json::from_str(text).unwrap();
    edit(&mut v);
    match load(&v.to_string()) {
        Err(e @ PlanIoError::Invalid { .. }) => e.to_string(),
        Err(e) => panic!("rejected, but not by the validator: {e}"),
        Ok(_) => panic!("the broken plan was accepted"),
    }
}

#[test]
fn ranks_see_their_stage_peers_and_groups() {
    let text = plan_text(&["--pp", "2", "--dp", "2", "--tp", "1", "--zero", "1", "--microbatches", "2", "--schedule", "1f1b"]);
    let plan = load(&text).unwrap();
    let section = plan.codegen.as_ref().unwrap();
    // GPT-2's lm_head is tied to the token embedding: first and last stage sum its gradient.
    assert_eq!(section.tied_weights.len(), 1, "{:?}", section.tied_weights);
    assert_eq!(section.tied_weights[0].pp_ranks, vec![0, 1]);
    for (s, stage) in plan.stages.iter().enumerate() {
        for (i, &rank) in stage.ranks.iter().enumerate() {
            let view = plan.rank_view(rank).unwrap();
            assert_eq!(view.stages.iter().map(|v| v.stage()).collect::<Vec<_>>(), vec![s]);
            // The plan lists a stage's ranks replica-major: replica d, tensor rank t at d·tp + t.
            let replicas: Vec<usize> = stage.ranks.clone();
            assert_eq!(view.data_group, replicas, "rank {rank}");
            let other = &plan.stages[1 - s].ranks[i];
            let tied = vec![plan.stages[0].ranks[i], plan.stages[1].ranks[i]];
            assert_eq!(view.tied, vec![(section.tied_weights[0].weight.as_str(), tied)]);
            // Messages go to the same replica of the other stage.
            for instr in &view.program.instrs {
                if let Instr::Send { to: peer, .. } | Instr::Recv { from: peer, .. } = instr {
                    assert_eq!(peer, other, "rank {rank}: {instr}");
                }
            }
            let tags: Vec<String> = view.program.instrs.iter().filter(|i| i.collective().is_some()).map(|i| i.to_string()).collect();
            assert_eq!(
                tags,
                vec![
                    "ALL_REDUCE(tied-grad:model.lm_head.weight)".to_string(),
                    format!("ALL_REDUCE(dp-grads:stage{s})"),
                    format!("ALL_GATHER(zero-params:stage{s})")
                ],
                "ZeRO 1: gradients all-reduced, parameters gathered after the step"
            );
            let step = view.program.instrs.iter().position(|i| *i == Instr::OptimizerStep).unwrap();
            assert_eq!(step, view.program.instrs.len() - 2);
        }
    }
    // What crosses the cut is what layers after it read of layers before it.
    let cut = plan.stages[0].layers[1];
    let sent: BTreeSet<&str> = section.stages[0].outputs_to_next.iter().map(String::as_str).collect();
    assert!(!sent.is_empty());
    let view = plan.rank_view(plan.stages[1].ranks[0]).unwrap();
    assert_eq!(view.stages[0].inputs_from_previous, &section.stages[0].outputs_to_next[..]);
    assert!(section.stages[0].data_inputs.iter().any(|d| d == "input_ids"));
    assert!(cut + 1 == plan.stages[1].layers[0]);
    let acts = view.program.instrs.iter().filter(|i| matches!(i, Instr::Recv { what: Payload::Activation, .. })).count();
    assert_eq!(acts, plan.parallel.microbatches);
}

#[test]
fn zero3_gathers_parameters_before_each_use() {
    let text = plan_text(&["--pp", "1", "--dp", "4", "--tp", "1", "--zero", "3", "--microbatches", "2"]);
    let plan = load(&text).unwrap();
    let view = plan.rank_view(0).unwrap();
    let text: Vec<String> = view.program.instrs.iter().map(ToString::to_string).collect();
    let computes = view.program.instrs.iter().filter(|i| i.is_compute()).count();
    let gathers = text.iter().filter(|t| t.starts_with("ALL_GATHER(zero3-params")).count();
    assert_eq!(gathers, computes, "{text:?}");
    assert!(text.contains(&"REDUCE_SCATTER(dp-grads:stage0)".to_string()), "{text:?}");
    assert_eq!(text.last().map(String::as_str), Some("OPTIMIZER_STEP"));
}

/// Per stage, what follows each instruction that completes a microbatch's parameter gradients
/// (a backward, or its weight half where split): whether it is a `mb-grads` reduce-scatter of
/// that stage.
fn scatters_after_gradients(instrs: &[Instr]) -> Vec<(usize, bool)> {
    let split: BTreeSet<(usize, usize)> = instrs.iter().filter_map(|i| if let Instr::BackwardWeight { stage, mb } = *i { Some((stage, mb)) } else { None }).collect();
    let mut out = Vec::new();
    for (at, i) in instrs.iter().enumerate() {
        let stage = match *i {
            Instr::BackwardWeight { stage, .. } => stage,
            Instr::Backward { stage, mb } if !split.contains(&(stage, mb)) => stage,
            _ => continue,
        };
        let next = instrs.get(at + 1).map(ToString::to_string).unwrap_or_default();
        out.push((stage, next == format!("REDUCE_SCATTER(mb-grads:stage{stage})")));
    }
    out
}

#[test]
fn zero2_and_3_reduce_scatter_each_backward_but_the_last_into_the_block() {
    for (zero, flags) in [
        ("2", &["--pp", "1", "--dp", "4", "--tp", "1", "--zero", "2", "--microbatches", "2"][..]),
        ("3", &["--pp", "1", "--dp", "4", "--tp", "1", "--zero", "3", "--microbatches", "2"][..]),
        ("2 under zb-h1", &["--pp", "2", "--dp", "2", "--tp", "1", "--zero", "2", "--microbatches", "4", "--schedule", "zb-h1"][..]),
    ] {
        let plan = load(&plan_text(flags)).unwrap();
        for pr in 0..plan.parallel.pp {
            let view = plan.rank_view(plan.stages[pr].ranks[0]).unwrap();
            let instrs = &view.program.instrs;
            let after = scatters_after_gradients(instrs);
            let microbatches = plan.parallel.microbatches;
            // every microbatch's gradients but the last are scattered where they are complete
            assert_eq!(after.len(), microbatches, "ZeRO {zero}, pp rank {pr}: {after:?}");
            assert!(after[..microbatches - 1].iter().all(|&(_, s)| s), "ZeRO {zero}, pp rank {pr}: {after:?}");
            assert!(!after[microbatches - 1].1, "ZeRO {zero}, pp rank {pr}: the last backward is left to the step's reduce-scatter");
            let text: Vec<String> = instrs.iter().map(ToString::to_string).collect();
            assert_eq!(text.iter().filter(|t| t.starts_with("REDUCE_SCATTER(mb-grads")).count(), microbatches - 1, "{text:?}");
            assert!(text.iter().any(|t| t.starts_with("REDUCE_SCATTER(dp-grads")), "{text:?}");
        }
    }
    // ZeRO 1 keeps whole gradients to the step's end: no scatter after a backward
    let plan = load(&plan_text(&["--pp", "1", "--dp", "4", "--tp", "1", "--zero", "1", "--microbatches", "2"])).unwrap();
    let view = plan.rank_view(0).unwrap();
    assert!(view.program.instrs.iter().all(|i| !i.to_string().contains("mb-grads")));
}

#[test]
fn validator_rejects_hand_broken_plans() {
    // The Megatron split (on this tiny model the automatic plan replicates every matmul).
    let text = plan_text(&["--pp", "2", "--tp", "2", "--dp", "1", "--microbatches", "2", "--schedule", "1f1b", "--baseline", "megatron"]);
    let plan = load(&text).unwrap();
    let section = plan.codegen.as_ref().unwrap();
    assert_eq!(section.shards.len(), plan.model.layers);
    let r1 = plan.stages[1].ranks[0];

    // A dropped send: stage 0's first activation send.
    let msg = broken(&text, |v| {
        let steps = v["codegen"]["templates"][0]["steps"].as_array_mut().unwrap();
        let at = steps.iter().position(|s| s["op"] == "send" && s["what"] == "activation" && s["mb"] == 0).unwrap();
        steps.remove(at);
    });
    assert!(msg.contains(&format!("rank {r1}: 1RECV_F0 has no matching send")), "{msg}");

    // A mismatched collective: pipeline rank 1 reduces a different size of the tied weight.
    let msg = broken(&text, |v| {
        let steps = v["codegen"]["templates"][1]["steps"].as_array_mut().unwrap();
        let ar = steps.iter_mut().find(|s| s["op"] == "all_reduce").unwrap();
        ar["bytes"] = Value::from(ar["bytes"].as_u64().unwrap() / 2);
    });
    assert!(msg.contains("collective #0 on group") && msg.contains("ALL_REDUCE(tied-grad:model.lm_head.weight)"), "{msg}");
    assert!(msg.contains(&format!("rank {r1}:")) || msg.contains(&format!("rank {}:", plan.stages[1].ranks[1])), "{msg}");

    // An out-of-range slice on tensor rank 1 of layer 1.
    let msg = broken(&text, |v| {
        let slice = &mut v["codegen"]["shards"][1][1]["weight_slices"][0];
        let end = slice["ranges"][0][1].as_u64().unwrap();
        slice["ranges"][0][1] = Value::from(end + 100_000);
    });
    let rank = plan.stages[0].ranks[1];
    assert!(msg.contains(&format!("rank {rank}: layer 1 (tensor rank 1): slice [")) && msg.contains("is out of range"), "{msg}");

    // A forward that no longer covers every microbatch.
    let msg = broken(&text, |v| {
        let steps = v["codegen"]["templates"][0]["steps"].as_array_mut().unwrap();
        let f = steps.iter_mut().find(|s| s["op"] == "forward" && s["mb"] == 1).unwrap();
        f["mb"] = Value::from(0);
    });
    assert!(msg.contains("runs the forward of stage 0 for microbatches [0, 0]"), "{msg}");
}

#[test]
fn plans_without_a_codegen_section_still_load() {
    let text = plan_text(&["--pp", "2", "--tp", "1"]);
    let mut v: Value = serde_json::from_str(&text).unwrap();
    v.as_object_mut().unwrap().remove("codegen");
    let plan = load(&v.to_string()).unwrap();
    assert!(plan.codegen.is_none());
    assert!(plan.rank_view(0).unwrap_err().to_string().contains("no codegen section"));
}

/// Every models/ export plans with a valid codegen section on the contract's clusters, and
/// every rank of every plan gets a program that starts its stages' work and ends in the step.
#[test]
fn every_export_plans_with_codegen_on_small_clusters() {
    for model in ["gpt2", "bert", "llama", "vit"] {
        for cluster in ["cpu:2", "cpu:4", "h100-80gb:8"] {
            let path = format!("models/{model}.onnx");
            let cluster = common::cluster_arg(cluster);
            let mut args = vec![path.as_str(), "--cluster", &cluster, "--json"];
            if model != "vit" {
                args.extend(["--seq-len", "64"]);
            }
            let o = Command::new(env!("CARGO_BIN_EXE_smp-partition"))
                .args(&args)
                .env("SMP_CPU_CALIBRATION", "/nonexistent/cpu.toml")
                .current_dir(env!("CARGO_MANIFEST_DIR"))
                .output()
                .unwrap();
            assert_eq!(o.status.code(), Some(0), "{model} on {cluster}: {}", String::from_utf8_lossy(&o.stderr));
            let plan = load(&String::from_utf8(o.stdout).unwrap()).unwrap_or_else(|e| panic!("{model} on {cluster}: {e}"));
            assert!(plan.codegen.is_some(), "{model} on {cluster}");
            for s in &plan.stages {
                for &rank in &s.ranks {
                    let view = plan.rank_view(rank).unwrap_or_else(|e| panic!("{model} on {cluster}, rank {rank}: {e}"));
                    let forwards = view.program.instrs.iter().filter(|i| matches!(i, Instr::Forward { .. })).count();
                    assert_eq!(forwards, view.stages.len() * plan.parallel.microbatches, "{model} on {cluster}, rank {rank}");
                    assert_eq!(view.program.instrs.iter().filter(|i| **i == Instr::OptimizerStep).count(), 1);
                }
            }
        }
    }
}
