//! Megatron-LM's `pretrain_gpt.py` (Megatron-Core 0.16): the argument list a plan becomes, what
//! those arguments cannot say, and an argument list read back into the planner's request,
//! refused where Megatron-Core refuses it (the checks of `ModelParallelConfig`,
//! `TransformerConfig`, `PipelineParallelLayerLayout`, `initialize_model_parallel` and the
//! microbatch calculator).

use std::collections::BTreeSet;

use crate::ir::{ExpertDispatch, OffloadRule, Placement, Precision, ScheduleKind};
use crate::plan::Plan;
use crate::solve::{Layout, PlanOptions, Setting};

use super::config::{Launcher, Origin, Reading, Unpriced, Written, EmittedFile, shell_quote, split_words};
use super::error::EngineError;
use super::fields::{Change, Engine, Gap, PlanField, checkpointed, megatron_split, offloaded, reader_order, same_ranks, selective};
use super::shape::{Mlp, ModelShape, Norm, Positions};
use super::stages::{StageRoles, all_blocks, roles_of, first_blocks_per_stage, layout_from_blocks, stage_roles, units_whole, whole_units_layout};

const ENGINE: Engine = Engine::Megatron;

/// Megatron's default rank order, `tp-cp-ep-dp-pp`: pipeline outermost, tensor innermost.
pub const DEFAULT_ORDER: Placement = Placement([crate::ir::MeshAxis::P, crate::ir::MeshAxis::D, crate::ir::MeshAxis::T]);

fn gap(field: PlanField, chose: impl Into<String>, why: impl Into<String>, nearest: impl Into<String>, change: Option<Change>) -> Gap {
    Gap { engine: ENGINE, field, chose: chose.into(), why: why.into(), nearest: nearest.into(), change }
}

/// Recompute as Megatron says it: none, every layer, or the first N layers of every (virtual)
/// stage; `None` when the plan's recompute is none of these.
fn recompute_of(plan: &Plan, stages: &[StageRoles], shape: &ModelShape) -> Option<Recompute> {
    let set = checkpointed(plan);
    if set.iter().any(|&l| !shape.is_block(l)) {
        return None;
    }
    if set.is_empty() {
        // Megatron rebuilds the modules it is given in every layer
        let selective = plan.stages.iter().any(|s| !s.selective_layers.is_empty());
        return Some(if selective { Recompute::Selective } else { Recompute::None });
    }
    if set == all_blocks(shape) {
        return Some(Recompute::Full);
    }
    let counts: Vec<usize> = stages.iter().map(|s| (s.layers[0]..=s.layers[1]).filter(|l| set.contains(l)).count()).collect();
    let n = counts.iter().copied().max().unwrap_or(0);
    stages.iter().zip(&counts).all(|(s, &c)| c == n.min(s.blocks)).then_some(Recompute::Block(n))
}

/// Megatron's recompute settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Recompute {
    None,
    /// `--recompute-granularity full --recompute-method uniform --recompute-num-layers 1`.
    Full,
    /// `--recompute-granularity full --recompute-method block --recompute-num-layers N`.
    Block(usize),
    /// `--recompute-granularity selective --recompute-modules layernorm [moe_act]`: the norms'
    /// (and the experts' activation's) outputs discarded and rebuilt.
    Selective,
}

/// The modules Megatron discards and rebuilds as the planner's selective recompute does: the
/// layer norms, and in a mixture of experts the experts' activation.
const SELECTIVE_MODULES: [&str; 2] = ["layernorm", "moe_act"];

/// How Megatron cuts the pipeline for a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Cuts {
    /// One stage.
    None,
    /// Equal blocks per (virtual) stage, the embedding on the first and the loss on the last:
    /// Megatron's default.
    Even,
    /// `--decoder-first-pipeline-num-layers F --decoder-last-pipeline-num-layers L`, the
    /// middle stages equal (no virtual stages).
    FirstLast(Option<usize>, Option<usize>),
    /// `--pipeline-model-parallel-layout`.
    Layout(String),
}

fn cuts_of(plan: &Plan, stages: &[StageRoles]) -> Cuts {
    let p = &plan.parallel;
    let chunks = stages.len();
    if chunks <= 1 {
        return Cuts::None;
    }
    let blocks: Vec<usize> = stages.iter().map(|s| s.blocks).collect();
    let placed = stages[0].embedding && stages[chunks - 1].head && stages[1..].iter().all(|s| !s.embedding) && stages[..chunks - 1].iter().all(|s| !s.head);
    if placed && blocks.iter().all(|&b| b == blocks[0]) {
        return Cuts::Even;
    }
    if placed && p.schedule.virtual_stages() == 1 && chunks >= 2 {
        let middle = &blocks[1..chunks - 1];
        if middle.iter().all(|&b| middle.first() == Some(&b)) {
            let m = middle.first().copied();
            let first = (Some(blocks[0]) != m).then_some(blocks[0]);
            let last = (Some(blocks[chunks - 1]) != m).then_some(blocks[chunks - 1]);
            if m.is_some() && blocks[0] > 0 && blocks[chunks - 1] > 0 {
                return Cuts::FirstLast(first, last);
            }
        }
    }
    Cuts::Layout(layout_string(stages))
}

/// `Et*7|(t*8|)*14t*7L`: Megatron's layout grammar, runs of equal stages folded.
pub fn layout_string(stages: &[StageRoles]) -> String {
    let text: Vec<String> = stages
        .iter()
        .map(|s| {
            let mut t = String::new();
            if s.embedding {
                t.push('E');
            }
            match s.blocks {
                0 => {}
                1 => t.push('t'),
                b => t.push_str(&format!("t*{b}")),
            }
            if s.head {
                t.push('L');
            }
            t
        })
        .collect();
    let n = text.len();
    let mut out = String::new();
    let mut i = 0;
    while i < n {
        let mut j = i + 1;
        while j < n - 1 && text[j] == text[i] {
            j += 1;
        }
        // a run of equal stages that does not include the last one
        let run = j - i;
        if run >= 2 && j < n {
            out.push_str(&format!("({}|)*{run}", text[i]));
        } else {
            for t in &text[i..j] {
                out.push_str(t);
                out.push('|');
            }
        }
        i = j;
    }
    if out.ends_with('|') {
        out.pop();
    }
    out
}

/// Megatron-Core's `PipelineParallelLayerLayout.parse_str_to_list`: commas dropped, `(…)*n`
/// then `x*n` unrolled, stages split at `|`; each stage's layer letters.
pub fn parse_layout(text: &str) -> Result<Vec<Vec<char>>, String> {
    let mut s: String = text.chars().filter(|&c| c != ',').collect();
    // (…)*n
    while let Some(open) = s.find('(') {
        let close = s[open..].find(')').map(|c| open + c).ok_or_else(|| format!("`{text}`: unclosed `(`"))?;
        let rest = &s[close + 1..];
        let Some(digits) = rest.strip_prefix('*') else { return Err(format!("`{text}`: `(…)` must be followed by `*N`")) };
        let len = digits.chars().take_while(char::is_ascii_digit).count();
        let n: usize = digits[..len].parse().map_err(|_| format!("`{text}`: `(…)*` needs a count"))?;
        let inner = s[open + 1..close].repeat(n);
        s = format!("{}{}{}", &s[..open], inner, &digits[len..]);
    }
    // x*n
    let mut out = String::new();
    let chars: Vec<char> = s.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        if i + 1 < chars.len() && chars[i + 1] == '*' {
            let len = chars[i + 2..].iter().take_while(|c| c.is_ascii_digit()).count();
            let n: usize = chars[i + 2..i + 2 + len].iter().collect::<String>().parse().map_err(|_| format!("`{text}`: `{}*` needs a count", chars[i]))?;
            out.extend(std::iter::repeat_n(chars[i], n));
            i += 2 + len;
        } else {
            out.push(chars[i]);
            i += 1;
        }
    }
    out.split('|')
        .map(|stage| {
            stage
                .chars()
                .map(|c| match c {
                    'E' | 'L' | 't' | 'm' => Ok(c),
                    _ => Err(format!("`{text}`: invalid layer character `{c}`, known layer characters: E, L, t, m")),
                })
                .collect()
        })
        .collect()
}

/// What Megatron-LM cannot express of `plan`, each with the nearest setting it can run.
pub fn gaps(plan: &Plan, shape: &ModelShape) -> Result<Vec<Gap>, String> {
    let p = &plan.parallel;
    let stages = stage_roles(plan, shape)?;
    let mut out = Vec::new();
    match p.schedule {
        ScheduleKind::GPipe | ScheduleKind::ZbH1 => out.push(gap(
            PlanField::Schedule,
            p.schedule.to_string(),
            "its schedules are 1F1B and interleaved 1F1B",
            "1F1B",
            Some(Change::Schedule(ScheduleKind::OneFOneB)),
        )),
        ScheduleKind::Interleaved { .. } if p.microbatches < p.pp || p.microbatches % p.pp != 0 => out.push(gap(
            PlanField::Schedule,
            format!("{} with {} microbatches", p.schedule, p.microbatches),
            format!("interleaving runs groups of pp = {} microbatches, so their count must be a multiple of it", p.pp),
            "1F1B",
            Some(Change::Schedule(ScheduleKind::OneFOneB)),
        )),
        _ => {}
    }
    if !units_whole(&stages, shape) {
        let fix = whole_units_layout(&stages, shape);
        out.push(gap(
            PlanField::Cuts,
            "a cut inside the embedding or the head",
            "its layout places the embedding (E) and the loss (L) whole",
            "the embedding with the first stage, the head with the last",
            fix.map(Change::Layout),
        ));
    }
    if !selective(plan).is_empty() && recompute_of(plan, &stages, shape).is_some() {
        if plan.parallel.selective_policy == crate::ir::SelectivePolicy::Ops {
            out.push(gap(
                PlanField::Recompute,
                format!("selective recompute of {} layers' ops by torchtitan's per-op policy", selective(plan).len()),
                "its --recompute-modules rebuild whole modules (norms, activations, attention, MLPs), never every other product",
                "the recomputed layers alone",
                Some(Change::Recompute(checkpointed(plan))),
            ));
        } else if !checkpointed(plan).is_empty() {
            out.push(gap(
                PlanField::Recompute,
                "selective recompute beside whole layers recomputed",
                "its recompute granularity is full or selective for the whole model",
                "the whole layers alone",
                Some(Change::Recompute(checkpointed(plan))),
            ));
        } else if plan.parallel.checkpointing != crate::solve::CheckpointRule::Selective {
            out.push(gap(
                PlanField::Recompute,
                format!("selective recompute of {} of {} layers", selective(plan).len(), shape.kinds.len()),
                "its --recompute-modules apply to every layer",
                "--recompute-granularity selective --recompute-modules layernorm in every layer",
                Some(Change::Checkpointing(crate::solve::CheckpointRule::Selective)),
            ));
        }
    }
    if recompute_of(plan, &stages, shape).is_none() {
        let set = checkpointed(plan);
        let n = stages.iter().map(|s| (s.layers[0]..=s.layers[1]).filter(|l| set.contains(l) && shape.is_block(*l)).count()).max().unwrap_or(0);
        let nearest = if n == 0 { BTreeSet::new() } else { first_blocks_per_stage(&stages, n, shape) };
        let what = if nearest.is_empty() {
            "no recompute".to_string()
        } else {
            format!("--recompute-method block --recompute-num-layers {n}")
        };
        out.push(gap(
            PlanField::Recompute,
            format!("recompute of {} layers chosen one by one ({})", set.len(), per_stage_counts(&stages, &set)),
            "it recomputes the same number of transformer layers in every stage, never the embedding or the head",
            what,
            Some(Change::Recompute(nearest)),
        ));
    }
    if !offloaded(plan).is_empty() {
        out.push(gap(
            PlanField::Offload,
            format!("offloading the kept inputs of {} recomputed layers", offloaded(plan).len()),
            "its --cpu-offloading moves the activations of layers it does not recompute, and refuses recompute with it",
            "no offloading",
            Some(Change::Offload(OffloadRule::Never)),
        ));
    }
    if !megatron_split(plan) {
        out.push(gap(PlanField::TensorSplit, "a tensor split other than Megatron's in some layers", "it splits every layer its one way", "Megatron's split in every layer", Some(Change::MegatronSplit)));
    }
    if p.pp > 1 && p.zero >= 2 {
        out.push(gap(
            PlanField::Zero,
            format!("ZeRO {} with pipeline parallelism", p.zero),
            "Megatron-FSDP, its sharding of gradients and weights, does not run with pipeline parallelism",
            "--use-distributed-optimizer (ZeRO 1)",
            Some(Change::Zero(1)),
        ));
    }
    if let Some(s) = p.sharded_dp {
        out.push(gap(PlanField::ShardedData, format!("ZeRO 3 over groups of {s} replicas"), "it shards over all data-parallel ranks", "sharding over all of them", Some(Change::WholeShardGroups)));
    }
    if p.precision == Precision::Bf16 {
        out.push(gap(PlanField::Precision, "pure bf16 (no fp32 master weights)", "--bf16 keeps fp32 master weights and optimizer state", "--bf16 (bf16-mixed)", Some(Change::Precision(Precision::Bf16Mixed))));
    }
    let dpt = Placement::CLUSTER;
    if !same_ranks(p.placement, DEFAULT_ORDER, p) && !(same_ranks(p.placement, dpt, p) && (p.cp == 1 || p.pp == 1)) {
        out.push(gap(
            PlanField::Placement,
            format!("rank order {}", p.placement),
            "its rank orders are tp-cp-ep-dp-pp (PDT) and, with --use-tp-pp-dp-mapping, tp-cp-ep-pp-dp",
            "tp-cp-ep-dp-pp (PDT)",
            Some(Change::Placement(DEFAULT_ORDER)),
        ));
    }
    if let Some(a) = p.active_microbatches {
        out.push(gap(PlanField::InFlight, format!("at most {a} microbatches in flight"), "it has no such cap", "no cap", Some(Change::NoInFlightCap)));
    }
    if p.zero >= 2 && p.pp == 1 && p.dp * p.cp > 1 && !p.grad_overlap {
        out.push(gap(
            PlanField::GradOverlap,
            "the gradients reduce-scattered after the backward",
            "Megatron-FSDP reduce-scatters them beside the backward whenever it shards them",
            "reduced beside the backward",
            Some(Change::GradOverlap(true)),
        ));
    }
    if p.expert_overlap && !checkpointed(plan).is_empty() {
        out.push(gap(
            PlanField::ExpertOverlap,
            "the expert all-to-alls overlapped (combined 1F1B) beside whole layers recomputed",
            "its combined 1F1B refuses full recompute",
            "the all-to-alls in turn",
            Some(Change::ExpertOverlap(false)),
        ));
    }
    Ok(out)
}

fn per_stage_counts(stages: &[StageRoles], set: &BTreeSet<usize>) -> String {
    let counts: Vec<String> = stages.iter().map(|s| (s.layers[0]..=s.layers[1]).filter(|l| set.contains(l)).count().to_string()).collect();
    format!("per stage {}", counts.join(", "))
}

/// The argument list of `pretrain_gpt.py` for `plan` (which must have no [`gaps`]), one
/// `--flag value` per entry, and the launch line.
pub fn write(plan: &Plan, shape: &ModelShape) -> Result<Written, String> {
    let p = &plan.parallel;
    let stages = stage_roles(plan, shape)?;
    let mut args: Vec<Vec<String>> = Vec::new();
    model_args(&mut args, plan, shape);
    parallel_args(&mut args, plan, shape, &stages);
    training_args(&mut args, plan, shape, &stages);
    let per_node = plan.cluster.devices_per_node.max(1).min(plan.cluster.devices.max(1));
    let nodes = plan.cluster.devices.div_ceil(per_node);
    let text: String = args.iter().map(|a| a.iter().map(|w| shell_quote(w)).collect::<Vec<_>>().join(" ")).collect::<Vec<_>>().join("\n");
    // Megatron-LM's validate_args requires it with tensor or context parallelism before
    // Blackwell, and refuses it with Megatron-FSDP (ZeRO 2, 3)
    let env = if (p.tp > 1 || p.cp > 1) && p.zero < 2 { "CUDA_DEVICE_MAX_CONNECTIONS=1 " } else { "" };
    let launch = format!("{env}torchrun --nnodes {nodes} --nproc-per-node {per_node} pretrain_gpt.py $(cat megatron.args) --data-path DATA");
    Ok(Written {
        files: vec![EmittedFile { name: "megatron.args".into(), text: text + "\n" }],
        launch,
        notes: vec![
            "the data, tokenizer, learning-rate schedule and checkpoints (--save with --save-interval) are yours to add (the plan does not decide them)".into(),
            "rotary base, norm epsilon and initialisation are not read from the graph; set them as your model has them".into(),
        ],
    })
}

/// The model's flags: sizes, positions, norm, MLP, experts, vocabulary.
fn model_args(args: &mut Vec<Vec<String>>, plan: &Plan, shape: &ModelShape) {
    let mut arg = |words: &[&str]| args.push(words.iter().map(|w| w.to_string()).collect());
    arg(&["--num-layers", &shape.blocks.to_string()]);
    if let Some(h) = shape.hidden {
        arg(&["--hidden-size", &h.to_string()]);
    }
    if let Some(f) = shape.ffn {
        arg(&["--ffn-hidden-size", &f.to_string()]);
    }
    if let Some(a) = shape.heads {
        arg(&["--num-attention-heads", &a.to_string()]);
        if let Some(kv) = shape.kv_heads.filter(|&kv| kv != a) {
            arg(&["--group-query-attention"]);
            arg(&["--num-query-groups", &kv.to_string()]);
        }
        if let (Some(h), Some(d)) = (shape.hidden, shape.head_dim)
            && h != a * d
        {
            arg(&["--kv-channels", &d.to_string()]);
        }
    }
    let seq = plan.seq_len.or(shape.seq).unwrap_or(0);
    arg(&["--seq-length", &seq.to_string()]);
    match shape.positions {
        Positions::Learned(n) => {
            arg(&["--max-position-embeddings", &n.to_string()]);
            arg(&["--position-embedding-type", "learned_absolute"]);
        }
        Positions::Rope | Positions::Unknown => {
            arg(&["--max-position-embeddings", &seq.to_string()]);
            arg(&["--position-embedding-type", "rope"]);
        }
    }
    match shape.norm {
        Some(Norm::RmsNorm) => arg(&["--normalization", "RMSNorm"]),
        Some(Norm::LayerNorm) | None => arg(&["--normalization", "LayerNorm"]),
    }
    if shape.mlp == Some(Mlp::SwiGlu) {
        arg(&["--swiglu"]);
    }
    if !shape.tied_embedding {
        arg(&["--untie-embeddings-and-output-weights"]);
    }
    if !shape.linear_bias {
        arg(&["--disable-bias-linear"]);
    }
    if let Some(e) = shape.experts {
        arg(&["--num-experts", &e.to_string()]);
        if let Some(k) = shape.top_k {
            arg(&["--moe-router-topk", &k.to_string()]);
        }
        if let Some(f) = shape.expert_ffn {
            arg(&["--moe-ffn-hidden-size", &f.to_string()]);
        }
        if shape.dense_blocks > 0 {
            arg(&["--moe-layer-freq", &moe_layer_pattern(shape)]);
        }
    }
    if let Some(v) = shape.vocab {
        arg(&["--tokenizer-type", "NullTokenizer"]);
        arg(&["--vocab-size", &v.to_string()]);
    }
}

/// Megatron-Core's `--moe-layer-freq` pattern of `shape`'s blocks: `([0]*D+[1]*M)`, D dense
/// blocks before M with experts.
fn moe_layer_pattern(shape: &ModelShape) -> String {
    format!("([0]*{}+[1]*{})", shape.dense_blocks, shape.blocks.saturating_sub(shape.dense_blocks))
}

/// Which of `blocks` blocks have experts under `--moe-layer-freq` as Megatron-Core reads it:
/// an integer k (every k-th block from the first), a list of 0 and 1, or a pattern of `[x]*n`
/// terms joined by `+`. `None`: none of these, or not `blocks` long.
fn moe_layer_flags(given: &str, blocks: usize) -> Option<Vec<bool>> {
    let text: String = given.chars().filter(|c| !c.is_whitespace() && *c != '"' && *c != '\'').collect();
    if let Ok(k) = text.parse::<usize>() {
        return (k > 0).then(|| (0..blocks).map(|b| b % k == 0).collect());
    }
    let inner = text.strip_prefix('(').and_then(|t| t.strip_suffix(')')).unwrap_or(&text);
    let mut out = Vec::new();
    for term in inner.split('+') {
        let (list, times) = match term.split_once('*') {
            Some((l, n)) => (l, n.parse::<usize>().ok()?),
            None => (term, 1),
        };
        let items: Vec<bool> = list.strip_prefix('[')?.strip_suffix(']')?.split(',').map(|x| match x {
            "0" => Some(false),
            "1" => Some(true),
            _ => None,
        }).collect::<Option<_>>()?;
        for _ in 0..times {
            out.extend(&items);
        }
    }
    (out.len() == blocks).then_some(out)
}

/// The parallelism flags: TP, PP (with its cuts), CP, EP and the rank order.
fn parallel_args(args: &mut Vec<Vec<String>>, plan: &Plan, shape: &ModelShape, stages: &[StageRoles]) {
    let p = &plan.parallel;
    let mut arg = |words: &[&str]| args.push(words.iter().map(|w| w.to_string()).collect());
    arg(&["--tensor-model-parallel-size", &p.tp.to_string()]);
    if p.tp > 1 && p.sequence_parallel {
        arg(&["--sequence-parallel"]);
    }
    arg(&["--pipeline-model-parallel-size", &p.pp.to_string()]);
    let cuts = cuts_of(plan, stages);
    if let ScheduleKind::Interleaved { virtual_stages } = p.schedule
        && !matches!(cuts, Cuts::Layout(_))
    {
        arg(&["--num-virtual-stages-per-pipeline-rank", &virtual_stages.to_string()]);
    }
    match &cuts {
        Cuts::None | Cuts::Even => {}
        Cuts::FirstLast(first, last) => {
            if let Some(f) = first {
                arg(&["--decoder-first-pipeline-num-layers", &f.to_string()]);
            }
            if let Some(l) = last {
                arg(&["--decoder-last-pipeline-num-layers", &l.to_string()]);
            }
        }
        Cuts::Layout(s) => arg(&["--pipeline-model-parallel-layout", s]),
    }
    if p.cp > 1 {
        arg(&["--context-parallel-size", &p.cp.to_string()]);
        arg(&["--cp-comm-type", "all_gather"]);
    }
    if shape.experts.is_some() {
        arg(&["--expert-model-parallel-size", &p.ep.to_string()]);
        arg(&["--expert-tensor-parallel-size", &p.etp.to_string()]);
        if p.ep > 1 {
            // the dispatch the plan priced (Megatron's default, allgather, is neither)
            let per_node = plan.request.as_ref().and_then(|r| r.expert_dispatch.as_deref()) == Some(ExpertDispatch::PerNode.name());
            arg(&["--moe-token-dispatcher-type", if per_node { "flex" } else { "alltoall" }]);
        }
        if p.expert_overlap {
            arg(&["--overlap-moe-expert-parallel-comm"]);
        }
    }
    if !same_ranks(p.placement, DEFAULT_ORDER, p) {
        arg(&["--use-tp-pp-dp-mapping"]);
    }
}

/// The batch, recompute, ZeRO and precision flags.
fn training_args(args: &mut Vec<Vec<String>>, plan: &Plan, shape: &ModelShape, stages: &[StageRoles]) {
    let p = &plan.parallel;
    let mut arg = |words: &[&str]| args.push(words.iter().map(|w| w.to_string()).collect());
    // batch
    let dp = p.dp.max(1) as u64;
    let mbs = plan.global_batch / (dp * p.microbatches.max(1) as u64);
    arg(&["--micro-batch-size", &mbs.to_string()]);
    arg(&["--global-batch-size", &plan.global_batch.to_string()]);
    // recompute
    match recompute_of(plan, stages, shape) {
        Some(Recompute::None) | None => {}
        Some(Recompute::Full) => {
            arg(&["--recompute-granularity", "full"]);
            arg(&["--recompute-method", "uniform"]);
            arg(&["--recompute-num-layers", "1"]);
        }
        Some(Recompute::Block(n)) => {
            arg(&["--recompute-granularity", "full"]);
            arg(&["--recompute-method", "block"]);
            arg(&["--recompute-num-layers", &n.to_string()]);
        }
        Some(Recompute::Selective) => {
            let modules = if shape.experts.is_some() { &SELECTIVE_MODULES[..] } else { &SELECTIVE_MODULES[..1] };
            arg(&[&["--recompute-granularity", "selective", "--recompute-modules"][..], modules].concat());
        }
    }
    // ZeRO, and the gradients reduced beside the backward (Megatron-FSDP's own when it
    // shards them)
    if p.grad_overlap && p.zero < 2 {
        arg(&["--overlap-grad-reduce"]);
    }
    match p.zero {
        0 => {}
        1 => arg(&["--use-distributed-optimizer"]),
        z => {
            arg(&["--use-megatron-fsdp"]);
            arg(&["--data-parallel-sharding-strategy", if z == 2 { "optim_grads" } else { "optim_grads_params" }]);
            // validate_args: Megatron-FSDP saves only this format
            arg(&["--ckpt-format", "fsdp_dtensor"]);
        }
    }
    // precision
    match p.precision {
        // Megatron's default under --bf16 is fp32 main grads; a plan that priced 16-bit ones says so
        Precision::Bf16Mixed | Precision::Bf16 if p.fp32_main_grads => arg(&["--bf16"]),
        Precision::Bf16Mixed | Precision::Bf16 => {
            arg(&["--bf16"]);
            arg(&["--grad-reduce-in-bf16"]);
        }
        Precision::Fp16Mixed => {
            arg(&["--fp16"]);
            if p.fp32_main_grads {
                arg(&["--accumulate-allreduce-grads-in-fp32"]);
            }
            arg(&["--initial-loss-scale", "65536"]);
        }
        Precision::F32 => {}
    }
    // Transformer Engine's fp8 in the blocks' linears: e4m3 forward, e5m2 gradients
    if p.float8_linears {
        arg(&["--fp8-format", "hybrid"]);
    }
}

/// A value of an argument list, by flag.
struct Args {
    origin: Origin,
    values: Vec<(String, Option<String>)>,
    used: BTreeSet<usize>,
}

/// Megatron-LM's flags that take a list of words (argparse `nargs='*'` or `'+'`).
const LIST_FLAGS: [&str; 7] = ["recompute-modules", "cuda-graph-scope", "data-path", "train-data-path", "valid-data-path", "test-data-path", "profile-ranks"];

impl Args {
    fn parse(words: &[String], origin: Origin) -> Result<Args, EngineError> {
        let mut values = Vec::new();
        let mut i = 0;
        while i < words.len() {
            let w = &words[i];
            let Some(flag) = w.strip_prefix("--") else {
                return Err(EngineError::Syntax { engine: ENGINE, what: origin.name(), why: format!("`{w}` is not a `--flag` (a value without its flag?)") });
            };
            match flag.split_once('=') {
                Some((f, v)) => {
                    values.push((f.replace('_', "-"), Some(v.to_string())));
                    i += 1;
                }
                None if LIST_FLAGS.contains(&flag.replace('_', "-").as_str()) => {
                    // argparse's nargs='*': every word up to the next flag, space-separated
                    let list: Vec<&str> = words[i + 1..].iter().take_while(|n| !n.starts_with("--")).map(String::as_str).collect();
                    values.push((flag.replace('_', "-"), (!list.is_empty()).then(|| list.join(" "))));
                    i += 1 + list.len();
                }
                None => {
                    let next = words.get(i + 1).filter(|n| !n.starts_with("--"));
                    values.push((flag.replace('_', "-"), next.cloned()));
                    i += if next.is_some() { 2 } else { 1 };
                }
            }
        }
        Ok(Args { origin, values, used: BTreeSet::new() })
    }

    fn find(&mut self, flag: &str) -> Option<(String, Option<String>)> {
        let i = self.values.iter().rposition(|(f, _)| f == flag)?;
        for (j, (f, _)) in self.values.iter().enumerate() {
            if f == flag {
                self.used.insert(j);
            }
        }
        Some(self.values[i].clone())
    }

    fn has(&mut self, flag: &str) -> bool {
        self.find(flag).is_some()
    }

    fn text(&mut self, flag: &str) -> Result<Option<String>, EngineError> {
        match self.find(flag) {
            None => Ok(None),
            Some((_, Some(v))) => Ok(Some(v)),
            Some((f, None)) => Err(EngineError::Syntax { engine: ENGINE, what: self.origin.name(), why: format!("`--{f}` needs a value") }),
        }
    }

    fn count(&mut self, flag: &str) -> Result<Option<usize>, EngineError> {
        match self.text(flag)? {
            None => Ok(None),
            Some(v) => v.parse::<usize>().map(Some).map_err(|_| EngineError::Syntax { engine: ENGINE, what: self.origin.name(), why: format!("`--{flag} {v}`: expected a whole number") }),
        }
    }

    fn source(&self, flag: &str, value: impl ToString) -> crate::solve::Source {
        self.origin.source(&format!("--{flag}"), value)
    }

    fn unused(&self) -> Vec<(String, Option<String>)> {
        self.values.iter().enumerate().filter(|(i, _)| !self.used.contains(i)).map(|(_, v)| v.clone()).collect()
    }
}

/// Flags that overlap communication with compute where the planner prices it exposed (the runner
/// issues these collectives unoverlapped): the step is overstated by up to what they hide.
const OVERLAP_UNPRICED: &[(&str, &str)] = &[
    ("overlap-param-gather", "the distributed optimizer's parameter all-gather overlapping the next forward"),
    ("tp-comm-overlap", "the tensor-parallel collectives overlapping their products (Transformer Engine's userbuffers)"),
];

/// Fused kernels the planner prices unfused (flag, what is overstated).
const FUSION_UNPRICED: &[(&str, &str)] = &[
    ("cross-entropy-loss-fusion", "the fused cross-entropy keeps no fp32 copy of the logits; priced unfused, so the loss's memory and time are overstated"),
    ("cross-entropy-fusion-impl", "the fused cross-entropy's implementation; priced unfused"),
];

/// CUDA graphs: they take the host's kernel launches off the step, and the planner prices no
/// host overhead at all (every kernel as if launched ahead of the device).
const CUDA_GRAPHS: &[&str] = &["cuda-graph-impl", "cuda-graph-scope", "enable-cuda-graph", "external-cuda-graph", "cuda-graph-warmup-steps"];

/// Flags that decide nothing a plan prices (data, paths, logging, optimizer hyperparameters,
/// initialisation, kernels): read and listed, without effect.
const NO_EFFECT: &[&str] = &[
    "data-path", "split", "train-data-path", "valid-data-path", "test-data-path", "data-cache-path", "mock-data", "tokenizer-model", "vocab-file",
    "merge-file", "save", "load", "save-interval", "eval-interval", "eval-iters", "log-interval", "tensorboard-dir", "wandb-project", "wandb-exp-name",
    "lr", "min-lr", "lr-decay-style", "lr-warmup-iters", "lr-warmup-fraction", "lr-decay-iters", "lr-decay-samples", "lr-warmup-samples", "train-iters",
    "train-samples", "weight-decay", "clip-grad", "adam-beta1", "adam-beta2", "adam-eps", "init-method-std", "seed", "hidden-dropout", "attention-dropout",
    "rotary-base", "rotary-percent", "norm-epsilon", "make-vocab-size-divisible-by", "distributed-backend", "use-mcore-models", "transformer-impl",
    "use-flash-attn", "attention-softmax-in-fp32", "no-masked-softmax-fusion", "log-throughput", "log-timers-to-tensorboard", "no-load-optim",
    "no-load-rng", "exit-interval", "distributed-timeout-minutes", "timing-log-level", "use-rotary-position-embeddings", "no-position-embedding",
    "manual-gc", "ckpt-format", "use-dist-ckpt", "async-save", "micro-batch-size-per-gpu",
    "bf16-reduce", "moe-grouped-gemm", "moe-router-load-balancing-type", "moe-aux-loss-coeff",
    "moe-router-dtype", "hysteresis", "loss-scale-window", "min-loss-scale", "initial-loss-scale", "group-query-attention",
    "tokenizer-type", "vocab-size", "position-embedding-type", "normalization", "swiglu", "untie-embeddings-and-output-weights", "disable-bias-linear",
    "max-position-embeddings", "kv-channels", "apply-layernorm-1p", "decoupled-lr", "decoupled-min-lr", "calculate-per-token-loss",
    "empty-unused-memory-level", "exit-duration-in-mins", "no-create-attention-mask-in-dataloader", "no-mmap-bin-files", "num-workers", "profile",
    "profile-step-start", "profile-step-end", "moe-router-pre-softmax", "moe-router-score-function", "fp8-amax-history-len", "fp8-amax-compute-algo", "fp8-margin", "fp8-recipe", "fp8-param-gather", "no-rope-fusion", "no-gradient-accumulation-fusion", "no-bias-swiglu-fusion", "no-bias-dropout-fusion",
];

/// Reads `pretrain_gpt.py` arguments (optionally after a launcher, `torchrun … pretrain_gpt.py`)
/// into the planner's request for a model of `shape` on `devices` devices (`None`: from the
/// launcher line). Refused as Megatron-Core refuses it, naming the check.
pub fn read(text: &str, origin: Origin, shape: &ModelShape, devices: Option<usize>) -> Result<(Reading, Option<usize>), EngineError> {
    let (words, world) = words_and_world(text, &origin, devices)?;
    let mut r = ArgsReading { a: Args::parse(&words, origin.clone())?, origin, shape, o: PlanOptions { megatron_split: true, ..PlanOptions::default() }, reading: Reading::default(), microbatch_size: 1 };
    let sizes = r.parallel(world)?;
    r.model()?;
    r.moe_layers()?;
    r.attention_backend()?;
    let m = r.batch(&sizes)?;
    r.schedule(&sizes, m)?;
    r.recompute()?;
    r.sequence_parallel(&sizes)?;
    r.dispatcher()?;
    r.zero_and_precision(&sizes)?;
    r.expert_overlap(&sizes)?;
    r.placement(&sizes);
    r.leftovers();
    r.reading.options = r.o;
    Ok((r.reading, Some(world)))
}

/// A refusal by Megatron-Core's `check`.
fn refuse(check: &str, why: String) -> EngineError {
    EngineError::Refused { engine: ENGINE, check: check.into(), why }
}

/// The arguments after an optional launcher, and the device count (given, or the launcher's).
fn words_and_world(text: &str, origin: &Origin, devices: Option<usize>) -> Result<(Vec<String>, usize), EngineError> {
    let words = split_words(text).map_err(|why| EngineError::Syntax { engine: ENGINE, what: origin.name(), why })?;
    let (launcher, words) = if words.iter().any(|w| w.ends_with(".py")) || words.first().is_some_and(|w| !w.starts_with("--")) {
        let (l, rest) = Launcher::read(&words).map_err(|why| EngineError::Syntax { engine: ENGINE, what: origin.name(), why })?;
        (l, rest)
    } else {
        (Launcher::default(), words)
    };
    let world = match (devices, launcher.devices()) {
        (Some(d), Some(l)) if d != l => {
            return Err(EngineError::Missing {
                engine: ENGINE,
                why: format!("the launcher starts {l} processes but --cluster has {d} devices; give --cluster PRESET:{l}"),
            });
        }
        (Some(d), _) | (None, Some(d)) => d,
        (None, None) => return Err(EngineError::Missing { engine: ENGINE, why: "no device count: give --cluster PRESET:N or the launcher line (torchrun --nnodes … --nproc-per-node …)".into() }),
    };
    Ok((words, world))
}

/// The parallel sizes an argument list sets, on `world` ranks.
struct Sizes {
    tp: usize,
    pp: usize,
    cp: usize,
    dp: usize,
}

/// An argument list being read: its flags, the request so far, and what is not priced.
struct ArgsReading<'s> {
    a: Args,
    origin: Origin,
    shape: &'s ModelShape,
    o: PlanOptions,
    reading: Reading,
    /// `--micro-batch-size`, once read.
    microbatch_size: usize,
}

impl ArgsReading<'_> {
    /// Tensor, pipeline, context, expert and data parallelism, checked as
    /// `initialize_model_parallel` checks them.
    fn parallel(&mut self, world: usize) -> Result<Sizes, EngineError> {
        let (a, o) = (&mut self.a, &mut self.o);
        let tp = a.count("tensor-model-parallel-size")?.unwrap_or(1);
        let pp = a.count("pipeline-model-parallel-size")?.unwrap_or(1);
        let cp = a.count("context-parallel-size")?.unwrap_or(1);
        let ep = a.count("expert-model-parallel-size")?.unwrap_or(1);
        let etp = a.count("expert-tensor-parallel-size")?;
        for (flag, v) in [("tensor-model-parallel-size", tp), ("pipeline-model-parallel-size", pp), ("context-parallel-size", cp), ("expert-model-parallel-size", ep)] {
            if v == 0 {
                return Err(refuse("argument parsing", format!("--{flag} must be at least 1")));
            }
        }
        if world % (tp * pp * cp) != 0 {
            return Err(refuse(
                "parallel_state.initialize_model_parallel",
                format!("world_size ({world}) is not divisible by tensor_model_parallel_size ({tp}) x pipeline_model_parallel_size ({pp}) x context_parallel_size ({cp})"),
            ));
        }
        let dp = world / (tp * pp * cp);
        let etp_v = etp.unwrap_or(tp);
        if world % (etp_v * ep * pp) != 0 {
            return Err(refuse(
                "parallel_state.initialize_model_parallel",
                format!("world_size ({world}) is not divisible by expert_tensor_parallel_size ({etp_v}) x expert_model_parallel_size ({ep}) x pipeline_model_parallel_size ({pp})"),
            ));
        }
        o.tp = Some(tp);
        o.pp = Some(pp);
        o.cp = Some(cp);
        o.dp = Some(dp);
        o.sources.insert(Setting::Tp, a.source("tensor-model-parallel-size", tp));
        o.sources.insert(Setting::Pp, a.source("pipeline-model-parallel-size", pp));
        o.sources.insert(Setting::Cp, a.source("context-parallel-size", cp));
        o.sources.insert(Setting::Dp, crate::solve::Source::Implied(format!("data-parallel size {dp} = {world} ranks / (tp {tp} · pp {pp} · cp {cp})")));
        if ep > 1 || self.shape.experts.is_some() {
            o.ep = Some(ep);
            o.sources.insert(Setting::Ep, a.source("expert-model-parallel-size", ep));
        }
        if (tp * cp * dp) % (etp_v * ep) != 0 {
            return Err(refuse(
                "parallel_state.initialize_model_parallel",
                format!("expert_tensor_parallel_size ({etp_v}) x expert_model_parallel_size ({ep}) must divide tensor_model_parallel_size ({tp}) x context_parallel_size ({cp}) x data_parallel_size ({dp})"),
            ));
        }
        if etp_v != tp {
            if tp % etp_v != 0 || cp > 1 {
                return Err(EngineError::Missing {
                    engine: ENGINE,
                    why: format!(
                        "--expert-tensor-parallel-size {etp_v} with tensor {tp} and context {cp} ranks: the planner folds expert groups over tensor × data ranks only with an expert-tensor degree dividing the tensor degree and no context parallelism"
                    ),
                });
            }
            o.etp = Some(etp_v);
            o.sources.insert(Setting::Etp, a.source("expert-tensor-parallel-size", etp_v));
        } else if ep > 1 && dp % ep != 0 {
            return Err(EngineError::Missing {
                engine: ENGINE,
                why: format!("expert parallelism {ep} over data {dp} × context {cp} ranks spans context groups; the planner carves expert groups from the data-parallel ranks only at expert-tensor = tensor degree (ep must divide {dp})"),
            });
        }
        Ok(Sizes { tp, pp, cp, dp })
    }

    /// The model's sizes, each checked against the graph's.
    fn model(&mut self) -> Result<(), EngineError> {
        let (a, shape) = (&mut self.a, self.shape);
        let layers = a.count("num-layers")?;
        if let Some(n) = layers
            && n != shape.blocks
        {
            return Err(EngineError::Model { engine: ENGINE, why: format!("--num-layers {n}, but the model has {} transformer blocks", shape.blocks) });
        }
        for (flag, ours) in [
            ("hidden-size", shape.hidden),
            ("num-attention-heads", shape.heads),
            ("ffn-hidden-size", shape.ffn),
            ("num-query-groups", shape.kv_heads),
            ("num-experts", shape.experts),
            ("moe-router-topk", shape.top_k),
            ("moe-ffn-hidden-size", shape.expert_ffn),
            ("vocab-size", shape.vocab),
        ] {
            if let (Some(v), Some(ours)) = (a.count(flag)?, ours)
                && v as u64 != ours
            {
                return Err(EngineError::Model { engine: ENGINE, why: format!("--{flag} {v}, but the model's is {ours}") });
            }
        }
        Ok(())
    }

    /// `--attention-backend` (arguments.py's AttnBackend): a fused kernel is what the GPU
    /// presets price; an unfused one is named.
    fn attention_backend(&mut self) -> Result<(), EngineError> {
        let Some(backend) = self.a.text("attention-backend")? else { return Ok(()) };
        match backend.as_str() {
            "flash" | "fused" | "auto" => {}
            "unfused" | "local" => self.reading.unpriced.push(Unpriced { setting: format!("--attention-backend {backend}"), why: "attention with its scores materialised is priced as the cluster's fused kernel".into() }),
            other => return Err(refuse("argument parsing", format!("--attention-backend {other}: invalid choice (choose from 'flash', 'fused', 'unfused', 'local', 'auto')"))),
        }
        Ok(())
    }

    /// `--moe-layer-freq`: which blocks have experts, against the model's.
    fn moe_layers(&mut self) -> Result<(), EngineError> {
        let (a, shape) = (&mut self.a, self.shape);
        let Some(given) = a.text("moe-layer-freq")? else { return Ok(()) };
        let Some(layers) = moe_layer_flags(&given, shape.blocks) else {
            return Err(EngineError::Syntax { engine: ENGINE, what: self.origin.name(), why: format!("--moe-layer-freq {given}: expected an integer, a list of 0 and 1, or a pattern such as ([0]*3+[1]*58)") });
        };
        let ours: Vec<bool> = (0..shape.blocks).map(|b| shape.experts.is_some() && b >= shape.dense_blocks).collect();
        if layers != ours {
            return Err(EngineError::Model { engine: ENGINE, why: format!("--moe-layer-freq {given}, but the model's blocks with experts are {}", moe_layer_pattern(shape)) });
        }
        Ok(())
    }

    /// The sequence length and the batch; the microbatches per step.
    fn batch(&mut self, s: &Sizes) -> Result<usize, EngineError> {
        let (a, o) = (&mut self.a, &mut self.o);
        let (cp, dp) = (s.cp, s.dp);
        let seq = a.count("seq-length")?;
        if let Some(s) = seq {
            o.seq_len = Some(s as u64);
            o.sources.insert(Setting::SeqLen, a.source("seq-length", s));
            if cp > 1 && s % (2 * cp) != 0 {
                return Err(refuse("context parallelism's load balancing", format!("--seq-length {s} must be divisible by 2 × context_parallel_size ({})", 2 * cp)));
            }
        }
        let mbs = a.count("micro-batch-size")?.unwrap_or(1);
        let gbs = a.count("global-batch-size")?.unwrap_or(mbs * dp);
        if mbs == 0 || gbs % (mbs * dp) != 0 {
            return Err(refuse(
                "num_microbatches_calculator",
                format!("global batch size ({gbs}) is not divisible by micro batch size ({mbs}) times data parallel size ({dp})"),
            ));
        }
        let m = gbs / (mbs * dp);
        self.microbatch_size = mbs;
        o.global_batch = Some(gbs as u64);
        o.sources.insert(Setting::GlobalBatch, a.source("global-batch-size", gbs));
        o.microbatches = Some(m);
        o.sources.insert(Setting::Microbatches, crate::solve::Source::Implied(format!("{m} microbatches = --global-batch-size {gbs} / (--micro-batch-size {mbs} · data-parallel {dp})")));
        Ok(m)
    }

    /// The pipeline schedule and the stages' cuts, for `m` microbatches.
    fn schedule(&mut self, s: &Sizes, m: usize) -> Result<(), EngineError> {
        let pp = s.pp;
        let shape = self.shape;
        let (v, layout_text, block_counts) = self.cuts(pp)?;
        let (a, o) = (&mut self.a, &mut self.o);
        let vs = v.unwrap_or(1);
        if vs > 1 && pp == 1 {
            return Err(refuse("argument validation", "virtual pipeline stages need pipeline-model-parallel-size > 1".into()));
        }
        let schedule = if vs > 1 { ScheduleKind::Interleaved { virtual_stages: vs } } else { ScheduleKind::OneFOneB };
        if vs > 1 && (m < pp || m % pp != 0) {
            return Err(refuse(
                "schedules.forward_backward_pipelining_with_interleaving",
                format!("the number of contiguous micro-batches in a virtual pipeline stage should range in [PP={pp}, M={m}], and M a multiple of PP"),
            ));
        }
        o.schedule = Some(schedule);
        if pp * vs > 1 {
            let layout = layout_from_blocks(&block_counts, shape).ok_or_else(|| refuse("layer placement", format!("{} transformer layers in stages {block_counts:?} leave a stage without layers", shape.blocks)))?;
            let text = layout_text.clone().unwrap_or_else(|| format!("{block_counts:?} transformer layers per stage"));
            o.sources.insert(Setting::Layout, a.source("pipeline-model-parallel-layout", text));
            o.layout = Some(layout);
        }
        if pp > 1 {
            o.sources.insert(Setting::Schedule, crate::solve::Source::Implied(format!("{schedule} (Megatron's pipeline schedule)")));
        }
        Ok(())
    }

    /// The virtual stages per rank (if set), the layout text (if given) and the blocks of each
    /// (virtual) stage in chunk order.
    fn cuts(&mut self, pp: usize) -> Result<(Option<usize>, Option<String>, Vec<usize>), EngineError> {
        let a = &mut self.a;
        let layout_text = a.text("pipeline-model-parallel-layout")?;
        let v_flag = a.count("num-virtual-stages-per-pipeline-rank")?;
        let per_vstage = a.count("num-layers-per-virtual-pipeline-stage")?;
        let first = a.count("decoder-first-pipeline-num-layers")?;
        let last = a.count("decoder-last-pipeline-num-layers")?;
        let acc_emb = a.has("account-for-embedding-in-pipeline-split");
        let acc_loss = a.has("account-for-loss-in-pipeline-split");
        let blocks = self.shape.blocks;
        let mut v = match (v_flag, per_vstage) {
            (Some(_), Some(_)) => return Err(refuse("argument validation", "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank cannot be set at the same time".into())),
            (Some(v), None) => Some(v),
            (None, Some(k)) => {
                if k == 0 || blocks % (pp * k) != 0 {
                    return Err(refuse("argument validation", format!("number of layers ({blocks}) must be divisible by pipeline-model-parallel-size ({pp}) × --num-layers-per-virtual-pipeline-stage ({k})")));
                }
                Some(blocks / (pp * k))
            }
            (None, None) => None,
        };
        let block_counts: Vec<usize> = if let Some(text) = &layout_text {
            if first.is_some() || last.is_some() || acc_emb || acc_loss {
                return Err(refuse("TransformerConfig.__post_init__", "pipeline_model_parallel_layout cannot be set with other pipeline layout arguments".into()));
            }
            let stages = parse_layout(text).map_err(|why| EngineError::Syntax { engine: ENGINE, what: self.origin.name(), why })?;
            if stages.len() % pp != 0 {
                return Err(refuse("PipelineParallelLayerLayout", format!("pipeline_model_parallel_layout must be divisible by pipeline_model_parallel_size (len(layout)={}, pipeline_model_parallel_size={pp})", stages.len())));
            }
            let detected = stages.len() / pp;
            if let Some(vf) = v
                && vf != detected
            {
                return Err(refuse("TransformerConfig.__post_init__", format!("virtual_pipeline_model_parallel_size conflicts with pipeline_model_parallel_layout ({vf} against {detected})")));
            }
            v = Some(detected);
            check_layout(&stages, blocks).map_err(|why| refuse("PipelineParallelLayerLayout.validate_layer_layout", why))?;
            stages.iter().map(|s| s.iter().filter(|&&c| c == 't').count()).collect()
        } else {
            let vs = v.unwrap_or(1);
            even_or_uneven(blocks, pp, vs, first, last, acc_emb, acc_loss).map_err(|why| refuse("TransformerConfig.__post_init__", why))?
        };
        Ok((v, layout_text, block_counts))
    }

    /// Activation recompute (full: uniform or block; selective is not priced) and CPU offloading.
    fn recompute(&mut self) -> Result<(), EngineError> {
        let (a, o, reading, shape) = (&mut self.a, &mut self.o, &mut self.reading, self.shape);
        let granularity = a.text("recompute-granularity")?;
        let method = a.text("recompute-method")?;
        let num = a.count("recompute-num-layers")?;
        let modules = a.text("recompute-modules")?;
        let layout = o.layout.clone().unwrap_or_else(|| Layout(vec![[0, shape.kinds.len() - 1]]));
        let mut selective_rule = false;
        let recompute: BTreeSet<usize> = match (granularity.as_deref(), method.as_deref()) {
            (None, _) => BTreeSet::new(),
            (Some("selective"), _) => {
                if num.is_some() {
                    return Err(refuse("TransformerConfig.__post_init__", "When using recompute_granularity: selective recompute_num_layers must be None.".into()));
                }
                let named: Vec<&str> = modules.as_deref().map(|m| m.split_whitespace().collect()).unwrap_or_default();
                if !named.is_empty() && named.iter().all(|m| SELECTIVE_MODULES.contains(m)) {
                    // output-discarding recompute of the norms (and the experts' activation): the
                    // planner's selective recompute, which also rebuilds dense MLP activations and,
                    // in a mixture of experts, the experts' activation
                    if shape.experts.is_some() && !named.contains(&"moe_act") {
                        reading.unpriced.push(Unpriced {
                            setting: format!("--recompute-modules {}", named.join(" ")),
                            why: "the planner's selective recompute also rebuilds the experts' activation (`moe_act`), so memory is understated by it".into(),
                        });
                    }
                    selective_rule = true;
                } else {
                    reading.unpriced.push(Unpriced {
                        setting: format!("--recompute-granularity selective{}", modules.map(|m| format!(" --recompute-modules {m}")).unwrap_or_default()),
                        why: "only the norms and the experts' activation (`layernorm`, `moe_act`) are rebuilt as the planner prices selective recompute; other modules (core attention by default) are priced as no recompute: the step leaves out their forward rerun in the backward and memory counts what they free (under a fused attention kernel core attention frees only its softmax statistics, so memory is about right there)".into(),
                    });
                }
                BTreeSet::new()
            }
            (Some("full"), None) => return Err(refuse("TransformerConfig.__post_init__", "Using recompute_granularity: full so recompute_method must be \"block\" or \"uniform\"".into())),
            (Some("full"), Some(method)) => {
                let Some(n) = num else {
                    return Err(refuse("TransformerConfig.__post_init__", "When using recompute_granularity: full recompute_num_layers must be between 1 and num_layers_per_pipeline_rank".into()));
                };
                match method {
                    "uniform" => {
                        if n > 1 {
                            reading.unpriced.push(Unpriced {
                                setting: format!("--recompute-method uniform --recompute-num-layers {n}"),
                                why: format!("keeping one input per {n} layers is priced as every layer recomputed and keeping its own input"),
                            });
                        }
                        all_blocks(shape)
                    }
                    "block" => {
                        let roles: Vec<StageRoles> = layout.0.iter().map(|&l| roles_of(l, shape)).collect();
                        first_blocks_per_stage(&roles, n, shape)
                    }
                    other => return Err(refuse("TransformerConfig.__post_init__", format!("recompute_method: {other} must be \"block\" or \"uniform\"."))),
                }
            }
            (Some(other), _) => return Err(refuse("TransformerConfig.__post_init__", format!("When using recompute_granularity: {other} must be \"full\" or \"selective\"."))),
        };
        if selective_rule {
            o.sources.insert(Setting::Checkpointing, a.source("recompute-granularity", "selective"));
            o.checkpointing = Some(crate::solve::CheckpointRule::Selective);
        } else {
            o.sources.insert(Setting::CheckpointedLayers, a.source("recompute-granularity", granularity.clone().unwrap_or_else(|| "(none)".into())));
            o.checkpointed_layers = Some(recompute);
        }
        if a.has("cpu-offloading") {
            if granularity.is_some() {
                return Err(refuse("TransformerConfig.__post_init__", "CPU offloading can not be used with activation recompute".into()));
            }
            reading.unpriced.push(Unpriced {
                setting: "--cpu-offloading".into(),
                why: "Megatron's CPU offloading of layers it does not recompute is not priced; priced without offloading".into(),
            });
        }
        o.offload = Some(OffloadRule::Never);
        Ok(())
    }

    /// Sequence parallelism and the context-parallel communication.
    fn sequence_parallel(&mut self, s: &Sizes) -> Result<(), EngineError> {
        let (a, o, reading) = (&mut self.a, &mut self.o, &mut self.reading);
        let sp = a.has("sequence-parallel");
        if sp && s.tp == 1 {
            reading.no_effect.push("--sequence-parallel (Megatron-LM turns it off at tensor-model-parallel-size 1)".into());
        }
        o.sequence_parallel = Some(sp && s.tp > 1);
        if let Some(kind) = a.text("cp-comm-type")?
            && kind != "all_gather"
            && s.cp > 1
        {
            reading.unpriced.push(Unpriced {
                setting: format!("--cp-comm-type {kind}"),
                why: "the planner prices context parallelism as the all-gather of keys and values (--cp-comm-type all_gather)".into(),
            });
        }
        Ok(())
    }

    /// How routed tokens reach their experts: `--moe-token-dispatcher-type alltoall` sends each
    /// token–expert pair, `flex` (DeepEP or HybridEP, `--moe-enable-deepep` or
    /// `--moe-flex-dispatcher-backend`) each token once per node.
    fn dispatcher(&mut self) -> Result<(), EngineError> {
        let (a, o, reading) = (&mut self.a, &mut self.o, &mut self.reading);
        let kind = a.text("moe-token-dispatcher-type")?;
        let deepep = a.has("moe-enable-deepep");
        let backend = a.text("moe-flex-dispatcher-backend")?;
        let dispatch = match (kind.as_deref(), deepep || backend.is_some()) {
            (Some("flex"), _) => Some(ExpertDispatch::PerNode),
            (Some("alltoall"), false) | (None, false) => kind.as_ref().map(|_| ExpertDispatch::AllToAll),
            (Some("alltoall") | None, true) => {
                return Err(refuse("moe_token_dispatcher_type", "DeepEP (--moe-enable-deepep, --moe-flex-dispatcher-backend) needs --moe-token-dispatcher-type flex".into()));
            }
            (Some(other), _) => {
                reading.unpriced.push(Unpriced {
                    setting: format!("--moe-token-dispatcher-type {other}"),
                    why: "the planner prices expert dispatch as all-to-all (alltoall) or once per node (flex)".into(),
                });
                None
            }
        };
        o.expert_dispatch = dispatch.filter(|_| self.shape.experts.is_some());
        if let Some(n) = a.count("moe-deepep-num-sms")?
            && n != crate::cost::comm::DEEPEP_SMS as usize
        {
            reading.unpriced.push(Unpriced {
                setting: format!("--moe-deepep-num-sms {n}"),
                why: format!("compute beside DeepEP's kernels is priced on the SMs its default {} leave", crate::cost::comm::DEEPEP_SMS),
            });
        }
        // router.py under --moe-router-force-load-balancing: random logits, so each token's
        // experts are drawn uniformly; the group's busiest rank carries that draw's spread only
        if a.has("moe-router-force-load-balancing")
            && let (Some(_), Some(k)) = (self.shape.experts, self.shape.top_k)
        {
            let (tp, etp) = (o.tp.unwrap_or(1).max(1), o.etp.unwrap_or(o.tp.unwrap_or(1)).max(1));
            let split = if o.sequence_parallel == Some(true) { tp } else { (tp / etp).max(1) } * o.cp.unwrap_or(1).max(1);
            let tokens = self.microbatch_size * o.seq_len.or(self.shape.seq).unwrap_or(0) as usize / split;
            let imbalance = crate::cost::comm::uniform_routing_imbalance(o.ep.unwrap_or(1), tokens as f64 * k as f64);
            o.expert_imbalance = Some(imbalance);
            o.sources.insert(Setting::ExpertImbalance, a.source("moe-router-force-load-balancing", format!("on: uniform routing, the busiest rank {imbalance:.3}× the mean")));
        }
        Ok(())
    }

    /// ZeRO (the distributed optimizer or Megatron-FSDP) and the precision.
    fn zero_and_precision(&mut self, s: &Sizes) -> Result<(), EngineError> {
        let (a, o, reading) = (&mut self.a, &mut self.o, &mut self.reading);
        let dist_opt = a.has("use-distributed-optimizer");
        let fsdp = a.has("use-megatron-fsdp");
        let strategy = a.text("data-parallel-sharding-strategy")?;
        let zero = if fsdp {
            if s.pp > 1 {
                return Err(refuse("argument validation", "Megatron-FSDP does not run with pipeline parallelism (--pipeline-model-parallel-size > 1)".into()));
            }
            match strategy.as_deref().unwrap_or("optim_grads_params") {
                "no_shard" => 0,
                "optim" => 1,
                "optim_grads" => 2,
                "optim_grads_params" => 3,
                other => return Err(refuse("argument parsing", format!("--data-parallel-sharding-strategy {other}: expected no_shard, optim, optim_grads or optim_grads_params"))),
            }
        } else if dist_opt {
            1
        } else {
            0
        };
        o.zero = Some(zero);
        let zero_flag = if fsdp { "use-megatron-fsdp" } else { "use-distributed-optimizer" };
        o.sources.insert(Setting::Zero, a.source(zero_flag, zero));
        // bucketed gradient reduction beside the backward: asked for, or Megatron-FSDP's own
        // whenever it shards the gradients (MegatronFSDP.__init__ turns it on)
        let overlap = a.has("overlap-grad-reduce");
        if (overlap || fsdp && zero >= 2) && s.dp * s.cp > 1 {
            o.grad_overlap = Some(true);
            let why = if overlap { a.source("overlap-grad-reduce", "on") } else { crate::solve::Source::Implied("Megatron-FSDP reduce-scatters the gradients beside the backward when it shards them".into()) };
            o.sources.insert(Setting::GradOverlap, why);
        }
        let (bf16, fp16) = (a.has("bf16"), a.has("fp16"));
        if bf16 && fp16 {
            return Err(refuse("argument validation", "--bf16 and --fp16 cannot both be set".into()));
        }
        o.precision = Some(if bf16 {
            Precision::Bf16Mixed
        } else if fp16 {
            Precision::Fp16Mixed
        } else {
            Precision::F32
        });
        // arguments.py: under --bf16 gradients accumulate and reduce in fp32 ("main grads")
        // unless --grad-reduce-in-bf16; under --fp16 only with --accumulate-allreduce-grads-in-fp32
        let (in_bf16, in_fp32) = (a.has("grad-reduce-in-bf16"), a.has("accumulate-allreduce-grads-in-fp32"));
        if !in_bf16 && (bf16 || fp16 && in_fp32) {
            o.mixed_recipe = Some(crate::ir::MixedRecipe::LowModelFp32Grads);
        }
        if let Some(s) = a.text("loss-scale")? {
            reading.unpriced.push(Unpriced { setting: format!("--loss-scale {s}"), why: "a static loss scale changes no step time or memory the planner prices".into() });
        }
        // Transformer Engine's fp8: the blocks' linears (the output layer is Megatron's own, in
        // 16 bits); arguments.py takes e4m3 or hybrid (e5m2 gradients)
        if let Some(format) = a.text("fp8-format")? {
            if !matches!(format.as_str(), "e4m3" | "hybrid") {
                return Err(refuse("argument parsing", format!("--fp8-format {format}: invalid choice (choose from 'e4m3', 'hybrid')")));
            }
            if !bf16 && !fp16 {
                return Err(refuse("argument validation", "fp8 training runs under --bf16 or --fp16".into()));
            }
            o.float8_linears = Some(true);
            o.sources.insert(Setting::Float8Linears, a.source("fp8-format", &format));
            if self.shape.experts.is_some() {
                reading.unpriced.push(Unpriced { setting: format!("--fp8-format {format} on the experts"), why: "the routed experts' grouped products in fp8 are not priced: priced in 16 bits".into() });
            }
            reading.unpriced.push(Unpriced { setting: format!("--fp8-format {format}: the linears' saved inputs"), why: "Transformer Engine keeps them in fp8 for the backward; priced in 16 bits, so memory is overstated".into() });
            if a.has("fp8-param-gather") {
                reading.unpriced.push(Unpriced { setting: "--fp8-param-gather".into(), why: "the distributed optimizer's weight gathers are priced in 16 bits".into() });
            }
            if let Some(recipe) = a.text("fp8-recipe")?.filter(|r| r != "delayed" && r != "tensorwise") {
                reading.unpriced.push(Unpriced { setting: format!("--fp8-recipe {recipe}"), why: "priced as per-tensor scaling".into() });
            }
        }
        Ok(())
    }

    /// Combined 1F1B (`--overlap-moe-expert-parallel-comm`): each steady-phase forward merged
    /// with a backward, one's expert all-to-alls beside the other's compute, checked as
    /// `TransformerConfig.__post_init__` checks it; `--delay-wgrad-compute` named unpriced.
    fn expert_overlap(&mut self, s: &Sizes) -> Result<(), EngineError> {
        let (a, o, reading) = (&mut self.a, &mut self.o, &mut self.reading);
        let delay = a.has("delay-wgrad-compute");
        if !a.has("overlap-moe-expert-parallel-comm") {
            if delay {
                return Err(refuse("TransformerConfig.__post_init__", "overlap_moe_expert_parallel_comm must be enabled when enabling delay_wgrad_compute".into()));
            }
            return Ok(());
        }
        let check = |ok: bool, why: &str| if ok { Ok(()) } else { Err(refuse("TransformerConfig.__post_init__", why.into())) };
        check(s.pp == 1 || o.schedule.is_some_and(|k| k.virtual_stages() > 1), "If enabling EP A2A overlap, virtual_pipeline_model_parallel_size must be specified when pipeline_model_parallel_size > 1")?;
        check(o.ep.unwrap_or(1) > 1, "overlap_moe_expert_parallel_comm is only supported with expert model parallelism")?;
        check(o.expert_dispatch.is_some(), "overlap_moe_expert_parallel_comm is supported with alltoall/flex token dispatcher")?;
        check(o.checkpointed_layers.as_ref().is_none_or(BTreeSet::is_empty), "disable full recomputation when enabling overlap_moe_expert_parallel_comm")?;
        check(matches!(o.precision, Some(Precision::Bf16Mixed | Precision::Fp16Mixed)), "overlap_moe_expert_parallel_comm is only supported with bf16 or fp16 model")?;
        o.expert_overlap = Some(true);
        o.sources.insert(Setting::ExpertOverlap, a.source("overlap-moe-expert-parallel-comm", "on"));
        if delay {
            reading.unpriced.push(Unpriced {
                setting: "--delay-wgrad-compute".into(),
                why: "the experts' weight gradients deferred as more work to hide the all-to-alls behind is not priced: priced as computed in place, so the step is overstated by up to the all-to-all time they would hide".into(),
            });
        }
        Ok(())
    }

    /// The rank order.
    fn placement(&mut self, s: &Sizes) {
        let (a, o, reading) = (&mut self.a, &mut self.o, &mut self.reading);
        let order = if a.has("use-tp-pp-dp-mapping") { Placement::CLUSTER } else { DEFAULT_ORDER };
        o.placement = Some(reader_order(order, [s.dp * s.cp, s.pp, s.tp]));
        if a.has("use-tp-pp-dp-mapping") && s.cp > 1 && s.pp > 1 {
            reading.unpriced.push(Unpriced {
                setting: "--use-tp-pp-dp-mapping with context parallelism".into(),
                why: "Megatron places the context ranks inside the pipeline ranks in this order; the planner's DPT order places them inside the data ranks".into(),
            });
        }
    }

    /// The flags no step read: of no effect, or not priced.
    fn leftovers(&mut self) {
        for (flag, value) in self.a.unused() {
            let text = match &value {
                Some(v) => format!("--{flag} {v}"),
                None => format!("--{flag}"),
            };
            if NO_EFFECT.contains(&flag.as_str()) {
                self.reading.no_effect.push(text);
            } else if CUDA_GRAPHS.contains(&flag.as_str()) {
                self.reading.unpriced.push(Unpriced { setting: text, why: "CUDA graphs save the host's kernel launches, which the planner never prices (it prices every kernel as if launched ahead of the device, graphed or not)".into() });
            } else if let Some((_, why)) = FUSION_UNPRICED.iter().find(|(f, _)| *f == flag) {
                self.reading.unpriced.push(Unpriced { setting: text, why: (*why).into() });
            } else if let Some((_, what)) = OVERLAP_UNPRICED.iter().find(|(f, _)| *f == flag) {
                self.reading.unpriced.push(Unpriced { setting: text, why: format!("{what} is not priced: priced exposed, so the step is overstated by up to its time") });
            } else {
                self.reading.unpriced.push(Unpriced { setting: text, why: "not a setting the planner knows; not priced".into() });
            }
        }
    }
}

/// `PipelineParallelLayerLayout.validate_layer_layout` for a model of `blocks` decoder layers.
fn check_layout(stages: &[Vec<char>], blocks: usize) -> Result<(), String> {
    let flat: Vec<char> = stages.iter().flatten().copied().collect();
    if flat.first() != Some(&'E') {
        return Err(format!("The first layer must be embedding, but got {:?}", flat.first()));
    }
    if flat.last() != Some(&'L') {
        return Err(format!("The last layer must be loss, but got {:?}", flat.last()));
    }
    if flat.iter().filter(|&&c| c == 'E').count() != 1 {
        return Err("Embedding must be specified exactly once".into());
    }
    if flat.iter().filter(|&&c| c == 'L').count() != 1 {
        return Err("Loss must be specified exactly once".into());
    }
    let t = flat.iter().filter(|&&c| c == 't').count();
    if t != blocks {
        return Err(format!("Number of decoder layers {t} must match num_layers {blocks}"));
    }
    if flat.contains(&'m') {
        return Err("multi-token prediction layers (m) are not in this model".into());
    }
    Ok(())
}

/// Blocks per (virtual) stage in chunk order when no layout is given: Megatron's even split,
/// the uneven first and last stages, or the embedding and loss counted as layers.
fn even_or_uneven(blocks: usize, pp: usize, v: usize, first: Option<usize>, last: Option<usize>, acc_emb: bool, acc_loss: bool) -> Result<Vec<usize>, String> {
    // per pipeline rank, then split over its v chunks; chunk c = vstage · pp + rank
    let per_rank: Vec<usize> = if first.is_some() || last.is_some() {
        if acc_emb || acc_loss {
            return Err("num_layers_in_first_pipeline_stage and num_layers_in_last_pipeline_stage cannot be set at the same time with account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split".into());
        }
        let mut left = blocks as i64;
        let mut ranks = pp as i64;
        for (name, x) in [("first", first), ("last", last)] {
            if let Some(x) = x {
                if x == 0 {
                    return Err(format!("num_layers_in_{name}_pipeline_stage must be larger than 0"));
                }
                if v > 1 && x % v != 0 {
                    return Err(format!("number of layers at {name} stage: {x} must be divisible by virtual pipeline parallel degree {v}"));
                }
                left -= x as i64;
                ranks -= 1;
            }
        }
        if left < 0 || (left != 0) != (ranks != 0) {
            return Err(format!("Mismatch: {left} middle layers remaining but {ranks} middle PP stages available."));
        }
        if ranks > 0 && left % ranks != 0 {
            return Err(format!("number of layers at middle stage: {left} must be divisible by the middle pipeline model parallel size {ranks}"));
        }
        let middle = if ranks > 0 { (left / ranks) as usize } else { 0 };
        if ranks > 0 && v > 1 && middle % v != 0 {
            return Err(format!("number of layers on each middle pipeline rank: {middle} must be divisible by virtual pipeline parallel degree {v}"));
        }
        (0..pp)
            .map(|r| match (r, first, last) {
                (0, Some(f), _) => f,
                (r, _, Some(l)) if r + 1 == pp => l,
                _ => middle,
            })
            .collect()
    } else {
        let counted = blocks + usize::from(acc_emb) + usize::from(acc_loss);
        if counted % pp != 0 {
            return Err(format!("num_layers ({counted}) should be divisible by pipeline_model_parallel_size ({pp})"));
        }
        let per = counted / pp;
        if v > 1 && per % v != 0 {
            return Err(format!("number of layers on each pipeline rank: {per} must be divisible by virtual_pipeline_model_parallel_size {v}"));
        }
        (0..pp).map(|_| per).collect()
    };
    let mut chunks = Vec::with_capacity(pp * v);
    for _ in 0..v {
        for &r in &per_rank {
            chunks.push(r / v);
        }
    }
    // the embedding and the loss, counted as layers, take a block's place in the first and
    // last chunk
    if acc_emb && first.is_none() {
        chunks[0] = chunks[0].checked_sub(1).ok_or("the embedding fills the first stage")?;
    }
    if acc_loss && last.is_none() {
        let n = chunks.len() - 1;
        chunks[n] = chunks[n].checked_sub(1).ok_or("the loss fills the last stage")?;
    }
    Ok(chunks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_strings_parse_as_megatron_parses_them() {
        let s = parse_layout("Et*3|(tt|)*2,t*2L").unwrap();
        let text: Vec<String> = s.iter().map(|st| st.iter().collect()).collect();
        assert_eq!(text, ["Ettt", "tt", "tt", "ttL"]);
        assert!(parse_layout("Ex|L").unwrap_err().contains("invalid layer character"));
        assert_eq!(check_layout(&parse_layout("Et|tL").unwrap(), 2), Ok(()));
        assert!(check_layout(&parse_layout("Et|tL").unwrap(), 3).unwrap_err().contains("must match num_layers 3"));
    }

    #[test]
    fn megatron_splits_evenly_or_with_lighter_ends() {
        assert_eq!(even_or_uneven(8, 2, 1, None, None, false, false).unwrap(), [4, 4]);
        // interleaved: chunk c = vstage · pp + rank
        assert_eq!(even_or_uneven(8, 2, 2, None, None, false, false).unwrap(), [2, 2, 2, 2]);
        assert_eq!(even_or_uneven(126, 16, 1, Some(7), Some(7), false, false).unwrap().iter().sum::<usize>(), 126);
        assert!(even_or_uneven(10, 4, 1, None, None, false, false).unwrap_err().contains("should be divisible"));
        assert_eq!(even_or_uneven(10, 4, 1, Some(1), Some(1), false, false).unwrap(), [1, 4, 4, 1]);
        assert!(even_or_uneven(10, 4, 1, Some(1), Some(2), false, false).unwrap_err().contains("middle stage"));
        assert_eq!(even_or_uneven(6, 2, 1, None, None, true, true).unwrap(), [3, 3]);
        assert_eq!(even_or_uneven(6, 4, 1, None, None, true, true).unwrap(), [1, 2, 2, 1]);
    }
}
