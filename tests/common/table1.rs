//! Megatron-LM's Table 1 (Narayanan et al. 2021): the published configurations and per-GPU
//! figures, equation 3, and the faithful baseline's options. Shared by
//! `tests/published_runs.rs` and `benches/planner.rs`.
#![allow(dead_code)]

use smp_partition::ir::ScheduleKind;
use smp_partition::solve::{Baseline, CheckpointRule, PlanOptions};

/// A Table-1 row: the published configuration and figure.
pub struct Row {
    /// Model name (file `models/megatron/gpt-NAME.onnx`).
    pub name: &'static str,
    /// Hidden size h.
    pub hidden: f64,
    /// Transformer blocks l.
    pub blocks: f64,
    /// Tensor degree.
    pub t: usize,
    /// Pipeline degree.
    pub p: usize,
    /// GPUs n.
    pub gpus: usize,
    /// Global batch B.
    pub batch: usize,
    /// Microbatch size of the authors' script.
    pub mbs: usize,
    /// Virtual stages of the interleaved schedule (1: plain 1F1B).
    pub v: usize,
    /// Published TFLOP/s per GPU.
    pub published: f64,
}

/// Table 1 with the script's microbatch sizes and interleaving (layers per virtual stage
/// 5, 5, 3, 1 on 76.1B, 145.6B, 310.1B, 529.6B: v = l / (p · that)).
pub const TABLE1: [Row; 10] = [
    Row { name: "1.7B", hidden: 2304.0, blocks: 24.0, t: 1, p: 1, gpus: 32, batch: 512, mbs: 16, v: 1, published: 137.0 },
    Row { name: "3.6B", hidden: 3072.0, blocks: 30.0, t: 2, p: 1, gpus: 64, batch: 512, mbs: 16, v: 1, published: 138.0 },
    Row { name: "7.5B", hidden: 4096.0, blocks: 36.0, t: 4, p: 1, gpus: 128, batch: 512, mbs: 16, v: 1, published: 142.0 },
    Row { name: "18.4B", hidden: 6144.0, blocks: 40.0, t: 8, p: 1, gpus: 256, batch: 1024, mbs: 8, v: 1, published: 135.0 },
    Row { name: "39.1B", hidden: 8192.0, blocks: 48.0, t: 8, p: 2, gpus: 512, batch: 1536, mbs: 4, v: 1, published: 138.0 },
    Row { name: "76.1B", hidden: 10240.0, blocks: 60.0, t: 8, p: 4, gpus: 1024, batch: 1792, mbs: 2, v: 3, published: 140.0 },
    Row { name: "145.6B", hidden: 12288.0, blocks: 80.0, t: 8, p: 8, gpus: 1536, batch: 2304, mbs: 2, v: 2, published: 148.0 },
    Row { name: "310.1B", hidden: 16384.0, blocks: 96.0, t: 8, p: 16, gpus: 1920, batch: 2160, mbs: 1, v: 2, published: 155.0 },
    Row { name: "529.6B", hidden: 20480.0, blocks: 105.0, t: 8, p: 35, gpus: 2520, batch: 2520, mbs: 1, v: 3, published: 163.0 },
    Row { name: "1008B", hidden: 25600.0, blocks: 128.0, t: 8, p: 64, gpus: 3072, batch: 3072, mbs: 1, v: 1, published: 163.0 },
];

pub const SEQ: f64 = 2048.0;
pub const VOCAB: f64 = 51200.0;

/// Megatron-LM's equation 3: FLOPs of one step with full recompute.
pub fn eq3_flops(r: &Row) -> f64 {
    let (b, s, l, h) = (r.batch as f64, SEQ, r.blocks, r.hidden);
    96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + VOCAB / (16.0 * l * h))
}

/// The faithful baseline's options for a row (microbatch size `mbs`, `v` virtual stages).
pub fn baseline_options(r: &Row, mbs: usize, v: usize) -> PlanOptions {
    let d = r.gpus / (r.t * r.p);
    PlanOptions {
        global_batch: Some(r.batch as u64),
        seq_len: Some(SEQ as u64),
        baseline: Some(Baseline::Megatron),
        tp: Some(r.t),
        pp: Some(r.p),
        dp: Some(d),
        microbatches: Some(r.batch / (d * mbs)),
        schedule: Some(if v > 1 { ScheduleKind::Interleaved { virtual_stages: v } } else { ScheduleKind::OneFOneB }),
        checkpointing: Some(CheckpointRule::Always),
        // Megatron-LM's mixed precision: a bf16 model beside fp32 masters, not the runner's autocast
        mixed_recipe: Some(smp_partition::ir::MixedRecipe::LowModel),
        ..Default::default()
    }
}

