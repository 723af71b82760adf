//! Shard descriptions for GPT-3 175B at t = 8: time to produce them for every layer, and the
//! serialized size of their plan encoding for 1024 ranks (t = 8, p = 16, d = 8; data-parallel
//! replicas reference their (layer, tensor rank) shards instead of copying them).
//! Goals: < 1 s, < 20 MB. Run: `cargo bench --bench codegen [-- MODEL.onnx]`.

use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;
use smp_partition::codegen::{LayerShard, Sharder};
use smp_partition::frontend::onnx::load_model;
use smp_partition::passes::{AnalyzeOptions, analyze};

#[derive(Serialize)]
struct RankRef {
    rank: usize,
    stage: usize,
    tp_rank: usize,
    dp_rank: usize,
}

#[derive(Serialize)]
struct Encoded<'a> {
    /// Index: layer, then tensor rank; stored once.
    shards: &'a [Vec<LayerShard>],
    /// Each global rank names its stage and tensor rank.
    ranks: Vec<RankRef>,
}

fn main() -> anyhow::Result<()> {
    let path = std::env::args()
        .skip(1)
        .find(|a| a.ends_with(".onnx"))
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("models/gpt3-175b.onnx"));
    let (tp, pp, dp) = (8usize, 16usize, 8usize);
    let t0 = Instant::now();
    let model = load_model(&path)?;
    let lg = analyze(model.graph, &AnalyzeOptions::default())?;
    let prep = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let sharder = Sharder::new(&lg)?;
    let shards: Vec<Vec<LayerShard>> = (0..lg.layers.len()).map(|l| sharder.shard_layer(l, tp)).collect::<Result<_, _>>()?;
    let shard_s = t1.elapsed().as_secs_f64();

    let t2 = Instant::now();
    let layers_per_stage = lg.layers.len().div_ceil(pp);
    let _ = layers_per_stage;
    let ranks = (0..tp * pp * dp)
        .map(|rank| RankRef { rank, stage: rank / (tp * dp), dp_rank: (rank / tp) % dp, tp_rank: rank % tp })
        .collect();
    let json = serde_json::to_vec(&Encoded { shards: &shards, ranks })?;
    let ser_s = t2.elapsed().as_secs_f64();

    let slices: usize = shards.iter().flatten().map(|s| s.weight_slices.len()).sum();
    let collectives: usize = shards.iter().flatten().map(|s| s.collectives.len()).sum();
    println!("model: {} ({} layers, {} nodes; load + analyze {prep:.2} s)", path.display(), lg.layers.len(), lg.graph.node_count());
    println!("shard descriptions, t={tp}: {shard_s:.3} s for {} layers × {tp} ranks ({slices} weight slices, {collectives} collectives)", lg.layers.len());
    println!(
        "encoded for {} ranks (t={tp}, p={pp}, d={dp}): {:.2} MB in {ser_s:.3} s  (goals: < 1 s, < 20 MB)",
        tp * pp * dp,
        json.len() as f64 / 1e6
    );
    Ok(())
}
