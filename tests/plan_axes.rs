//! The context- and expert-parallel axes of the search: the planner chooses c > 1
//! for long sequences and c = 1 for ordinary ones on the graph-only Llama-3-70B, e > 1 for the
//! graph-only Mixtral 8×7B, each proven optimal and explained by `inspect`; the flags, SMP keys
//! and their conflicts; the infeasible message's least context degree.

use std::path::Path;

use smp_partition::cost::ClusterSpec;
use smp_partition::ir::{FusedOp, OpKind};
use smp_partition::passes::AnalyzeOptions;
use smp_partition::plan::Plan;
use smp_partition::solve::{PlanOptions, SmpConfig, SolveStatus};
use smp_partition::{Analysed, compile, load_and_analyze};

fn load(name: &str, seq: i64) -> Analysed {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("models/{name}.onnx"));
    load_and_analyze(&path, &AnalyzeOptions { seq_len: Some(seq), ..Default::default() }).unwrap()
}

fn options(batch: u64, seq: u64) -> PlanOptions {
    PlanOptions { global_batch: Some(batch), seq_len: Some(seq), ..Default::default() }
}

fn describe(p: &Plan) -> String {
    let par = &p.parallel;
    format!(
        "pp{} tp{}{} cp{} dp{} ep{} zero{} m{} {} ckpt {}: step {:.3} s, MFU {:.3}, {:?}, {:.2} s, {} solved, {} skipped",
        par.pp,
        par.tp,
        if par.sequence_parallel { " sp" } else { "" },
        par.cp,
        par.dp,
        par.ep,
        par.zero,
        par.microbatches,
        par.schedule,
        p.stages.iter().map(|s| s.checkpointed_layers.len()).sum::<usize>(),
        p.predicted.step_time_s,
        p.predicted.mfu,
        p.solver.status,
        p.solver.wall_s,
        p.solver.candidates.solved,
        p.solver.candidates.skipped
    )
}

fn plan_of(a: &Analysed, cluster: &str, opts: &PlanOptions) -> Plan {
    let spec = ClusterSpec::parse(cluster).unwrap();
    let p = compile(a, &spec, opts).unwrap_or_else(|e| panic!("{cluster}: {e}"));
    eprintln!("{cluster}: {}", describe(&p));
    eprintln!("{}", smp_partition::plan::report::render(&p));
    p
}

/// Every stage lists tp·cp·dp distinct ranks, and all stages together cover the cluster once.
fn ranks_cover_the_mesh(p: &Plan) {
    let par = &p.parallel;
    let mut all: Vec<usize> = Vec::new();
    for s in p.stages.iter().filter(|s| s.index < par.pp) {
        assert_eq!(s.ranks.len(), par.tp * par.cp * par.dp, "stage {}", s.index);
        all.extend(&s.ranks);
    }
    all.sort_unstable();
    assert_eq!(all, (0..par.devices()).collect::<Vec<_>>());
}

fn optimal(p: &Plan) {
    assert_eq!(p.solver.status, smp_partition::plan::schema::PlanStatus::Solved(SolveStatus::Optimal), "{}", describe(p));
    assert!(p.solver.gap <= 1e-6, "{}", describe(p));
}

/// `inspect`'s text for the plan and the line explaining `axis` (`context` or `experts`).
fn explained(p: &Plan, axis: &str, degree: usize) -> String {
    let text = smp_partition::plan::report::render(p);
    let line = text.lines().find(|l| l.starts_with(&format!("{axis} "))).unwrap_or_else(|| panic!("no `{axis}` line in\n{text}")).to_string();
    assert!(line.contains(&format!("= {degree}:")), "{line}");
    assert!(text.contains(&format!("cp {}", p.parallel.cp)) && text.contains(&format!("ep {}", p.parallel.ep)), "{text}");
    line
}

/// Sequence 131,072, 64 sequences a step on 1,024 H100s (Llama 3's long-context stage): a
/// sequence is 34 GB of activations per tensor group before checkpointing, and 64 sequences
/// leave at most 64 replicas, so splitting the sequence is what keeps the pipeline short.
#[test]
fn llama3_70b_at_sequence_131072_chooses_context_parallelism() {
    let a = load("llama3-70b-128k", 131_072);
    let p = plan_of(&a, "h100-80gb:1024", &options(64, 131_072));
    assert!(p.parallel.cp > 1, "{}", describe(&p));
    optimal(&p);
    ranks_cover_the_mesh(&p);
    let line = explained(&p, "context", p.parallel.cp);
    assert!(line.contains("K/V all-gathers") && line.contains("1: "), "{line}");
    // The bound of every other degree searched is no better than the chosen plan's step.
    let axes = p.axes.as_ref().unwrap();
    for &(c, lb) in &axes.cp_searched {
        if c != p.parallel.cp && let Some(lb) = lb {
            assert!(lb >= p.predicted.step_time_s * (1.0 - 1e-9) || p.solver.candidates.solved > 0, "c = {c}: bound {lb}");
        }
    }
}

/// Sequence 8,192, 1,024 sequences a step: one sample's checkpointed activations (21 GB)
/// take less than half a device, so memory needs no split of the sequence and c = 1.
#[test]
fn llama3_70b_at_sequence_8192_keeps_the_sequence_whole() {
    let a = load("llama3-70b-8k", 8192);
    let p = plan_of(&a, "h100-80gb:1024", &options(1024, 8192));
    assert_eq!(p.parallel.cp, 1, "{}", describe(&p));
    optimal(&p);
    ranks_cover_the_mesh(&p);
    let line = explained(&p, "context", 1);
    assert!(line.contains("checkpointed activations"), "{line}");
}

/// Mixtral 8×7B (graph-only, its experts fused to `MixtureOfExperts`) at sequence 4,096, 96
/// sequences on 24 H100s (three nodes): the experts are 45 of its 47B parameters, and
/// splitting them over an expert group divides their state, which the ranks need (on 32 H100s
/// a pipeline of 8 stages holds them at e = 1 since the RMSNorm chains are fused).
#[test]
fn mixtral_8x7b_chooses_expert_parallelism() {
    let a = load("mixtral-8x7b", 4096);
    let fused = a.lg.fused.iter().filter(|f| matches!(f.op, FusedOp::MixtureOfExperts { experts: 8, .. })).count();
    assert_eq!(fused, 32, "every block's experts are recognised");
    let moe_nodes = a.lg.layers.iter().flat_map(|l| &l.nodes).filter(|&&id| a.lg.graph.try_node(id).is_some_and(|n| n.op.is(OpKind::MixtureOfExperts))).count();
    assert_eq!(moe_nodes, 32);
    let p = plan_of(&a, "h100-80gb:24", &options(96, 4096));
    assert!(p.parallel.ep > 1, "{}", describe(&p));
    assert_eq!(p.parallel.dp % p.parallel.ep, 0);
    optimal(&p);
    ranks_cover_the_mesh(&p);
    let line = explained(&p, "experts", p.parallel.ep);
    assert!(line.contains("all-to-alls") && line.contains("1: "), "{line}");
}

/// A dense model is searched at e = 1 only, and forcing e > 1 on it is refused by name.
#[test]
fn dense_models_take_no_expert_degree() {
    let a = load("llama3-8b", 8192);
    let spec = ClusterSpec::parse("h100-80gb:64").unwrap();
    let cands = smp_partition::solve::search::enumerate(&a.lg, &spec, &options(512, 8192)).unwrap();
    assert!(cands.iter().all(|c| c.parallel.ep == 1));
    let err = compile(&a, &spec, &PlanOptions { ep: Some(2), ..options(512, 8192) }).unwrap_err();
    assert!(error_text(&err).contains("--ep 2: the model has no mixture-of-experts layer"), "{}", error_text(&err));
    // nor is there an all-to-all to overlap
    let err = compile(&a, &spec, &PlanOptions { expert_overlap: Some(true), ..options(512, 8192) }).unwrap_err();
    assert!(error_text(&err).contains("--overlap-expert-comm: the model has no mixture-of-experts layer"), "{}", error_text(&err));
}

fn error_text(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        s.push_str(&format!(": {c}"));
        cause = c.source();
    }
    s
}

/// `--cp`/`--ep` force the degrees; `context_parallel_degree` and `expert_parallel_degree` in
/// an SMP config give them too, and a config key that disagrees with a flag is a conflict
/// naming both.
#[test]
fn flags_and_config_keys_force_the_degrees() {
    let file = Path::new("smp.json");
    let cfg = SmpConfig::parse(r#"{"context_parallel_degree": 4, "expert_parallel_degree": 2}"#, file).unwrap();
    let merged = PlanOptions::default().resolve(Some(cfg.clone())).unwrap();
    assert_eq!((merged.cp, merged.ep), (Some(4), Some(2)));
    let same = PlanOptions { cp: Some(4), ..Default::default() }.resolve(Some(cfg.clone())).unwrap();
    assert_eq!(same.cp, Some(4));
    let err = PlanOptions { cp: Some(2), ..Default::default() }.resolve(Some(cfg.clone())).unwrap_err().to_string();
    assert!(err.contains("`--cp 2`") && err.contains("\"context_parallel_degree\": 4") && err.contains("context-parallel degree"), "{err}");
    let err = PlanOptions { ep: Some(8), ..Default::default() }.resolve(Some(cfg)).unwrap_err().to_string();
    assert!(err.contains("`--ep 8`") && err.contains("\"expert_parallel_degree\": 2"), "{err}");
    let err = PlanOptions { ep: Some(3), dp: Some(8), ..Default::default() }.resolve(None).unwrap_err().to_string();
    assert!(err.contains("`--ep 3`") && err.contains("`--dp 8`") && err.contains("must divide"), "{err}");
    let err = PlanOptions { cp: Some(0), ..Default::default() }.resolve(None).unwrap_err().to_string();
    assert!(err.contains("`--cp 0`") && err.contains("at least 1"), "{err}");
    let err = PlanOptions { expert_imbalance: Some(0.5), ..Default::default() }.resolve(None).unwrap_err().to_string();
    assert!(err.contains("--expert-imbalance 0.5"), "{err}");
    let bad = SmpConfig::parse(r#"{"context_parallel_degree": 0}"#, file).unwrap_err().to_string();
    assert!(bad.contains("context_parallel_degree") && bad.contains("positive integer"), "{bad}");

    // Forced degrees are what the search plans.
    let a = load("mixtral-8x7b", 4096);
    let p = plan_of(&a, "h100-80gb:256", &PlanOptions { cp: Some(2), ep: Some(4), ..options(512, 4096) });
    assert_eq!((p.parallel.cp, p.parallel.ep), (2, 4));
    ranks_cover_the_mesh(&p);
    // A context degree whose double does not divide the sequence is refused by name.
    let err = compile(&a, &ClusterSpec::parse("h100-80gb:24").unwrap(), &PlanOptions { cp: Some(3), ..options(48, 4096) }).unwrap_err();
    assert!(error_text(&err).contains("--cp 3: the sequence of 4096 tokens"), "{}", error_text(&err));
}

/// With c forced to 1 and nothing fitting, the error names the least context degree that
/// fits, found by the same memory bounds the search uses (and that degree does plan).
#[test]
fn infeasible_at_cp_1_names_the_least_context_degree_that_fits() {
    let a = load("llama3-70b-128k", 131_072);
    let spec = ClusterSpec::parse("h100-80gb:64").unwrap();
    let opts = PlanOptions { cp: Some(1), memory_limit_gib: Some(32.0), offload: Some(smp_partition::ir::OffloadRule::Never), ..options(8, 131_072) };
    let err = error_text(&compile(&a, &spec, &opts).unwrap_err());
    eprintln!("{err}");
    let c: usize = err.split("--cp ").nth(2).and_then(|t| t.split_whitespace().next()).and_then(|t| t.parse().ok()).unwrap_or_else(|| panic!("{err}"));
    assert!(c > 1, "{err}");
    // The named degree fits; every smaller one does not.
    let p = plan_of(&a, "h100-80gb:64", &PlanOptions { cp: Some(c), ..opts.clone() });
    assert_eq!(p.parallel.cp, c);
    for smaller in (2..c).filter(|s| 64 % s == 0 && 131_072 % (2 * s) == 0) {
        assert!(compile(&a, &spec, &PlanOptions { cp: Some(smaller), ..opts.clone() }).is_err(), "--cp {smaller} fits too");
    }
}

