//! Compute cost: a roofline per node — FLOPs over the size-dependent achievable rate, or
//! bytes moved over achievable memory bandwidth, whichever is larger.
//!
//! Backward: matmul-like ops (MatMul, Gemm, Conv) and the routed experts of a
//! `MixtureOfExperts` cost 2× their forward (input gradient and weight gradient, one GEMM
//! each, half of it the weight gradient); every other op costs 1× its
//! forward (elementwise and normalisation backwards read and write about what the forward
//! did), of which none is weight gradient. Recompute (activation checkpointing) adds one
//! forward to the backward.

use crate::ir::{DType, Graph, LayerKind, LayeredGraph, NodeFigures, Op, OpKind};

use super::ClusterSpec;

/// Forward and backward time of a layer (or stage) for one microbatch, seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LayerTimes {
    /// Forward time.
    pub fwd: f64,
    /// Whole backward time (input and weight gradients).
    pub bwd: f64,
    /// The weight-gradient part of `bwd` (what ZB-H1 runs as W).
    pub bwd_weight: f64,
}

impl LayerTimes {
    /// The input-gradient part of the backward (ZB-H1's B).
    pub fn bwd_input(&self) -> f64 {
        self.bwd - self.bwd_weight
    }

    /// Forward plus backward.
    pub fn total(&self) -> f64 {
        self.fwd + self.bwd
    }

    /// The same layer checkpointed: its forward runs again before its backward.
    pub fn with_recompute(&self) -> LayerTimes {
        LayerTimes { fwd: self.fwd, bwd: self.bwd + self.fwd, bwd_weight: self.bwd_weight }
    }
}

impl std::ops::Add for LayerTimes {
    type Output = LayerTimes;
    fn add(self, o: LayerTimes) -> LayerTimes {
        LayerTimes { fwd: self.fwd + o.fwd, bwd: self.bwd + o.bwd, bwd_weight: self.bwd_weight + o.bwd_weight }
    }
}

impl std::ops::AddAssign for LayerTimes {
    fn add_assign(&mut self, o: LayerTimes) {
        *self = *self + o;
    }
}

impl std::iter::Sum for LayerTimes {
    fn sum<I: Iterator<Item = LayerTimes>>(iter: I) -> LayerTimes {
        iter.fold(LayerTimes::default(), |a, b| a + b)
    }
}

/// True for ops whose backward is two GEMMs of the forward's size (input and weight grads).
pub fn is_matmul_like(op: &Op) -> bool {
    matches!(op.kind(), Some(OpKind::MatMul | OpKind::Gemm | OpKind::Conv))
}

/// Backward cost as a multiple of the forward: 2 for matmul-like ops, fused attention (its
/// backward is four matmuls of the forward's two, besides the softmax) and the routed experts
/// (input and weight gradients of each expert's matmuls), 1 otherwise.
pub fn backward_factor(op: &Op) -> f64 {
    if is_matmul_like(op) || op.is(OpKind::ScaledDotProductAttention) || op.is(OpKind::MixtureOfExperts) { 2.0 } else { 1.0 }
}

/// The dtype the products of a node run in: fp8 for the weight matmuls of a block (not the
/// embedding or the head, which Float8 recipes leave in 16 bits, nor the routed experts) where
/// the job runs Float8 linears ([`ClusterSpec::float8_linears`]); `dtype` otherwise.
pub fn product_dtype(op: &Op, fig: &NodeFigures, kind: LayerKind, dtype: DType, spec: &ClusterSpec) -> DType {
    let linear = matches!(op.kind(), Some(OpKind::MatMul | OpKind::Gemm)) && fig.gemms[0].share > 0.0;
    if spec.float8_linears && kind == LayerKind::Block && linear { DType::F8E4M3 } else { dtype }
}

/// Bytes a Float8 linear's casts move, forward and backward, at figures already scaled: with
/// per-tensor dynamic scaling each 16-bit operand is read for its absolute maximum, then read
/// and written as fp8 (5 bytes an element: the input and the weight forward, the output's
/// gradient backward), and the backward's products take the transposed fp8 copies of the
/// input, the weight and that gradient (1 byte read, 1 written an element).
pub fn float8_cast_bytes(fig: &NodeFigures) -> (f64, f64) {
    fig.gemms.iter().filter(|g| g.share > 0.0).fold((0.0, 0.0), |(fwd, bwd), g| {
        let (input, weight, grad) = (g.rows * g.k, g.k * g.n, g.rows * g.n);
        (fwd + 5.0 * (input + weight), bwd + 5.0 * grad + 2.0 * (input + weight + grad))
    })
}

/// Figures with FLOPs and bytes multiplied by `factor` (a microbatch size, or 1/t for a
/// tensor-parallel shard), and so the rows of its products (samples; [`split`] for a split
/// that divides another dim). Parameter counts are unchanged.
pub fn scaled(fig: &NodeFigures, factor: f64) -> NodeFigures {
    let mut gemms = fig.gemms;
    for g in &mut gemms {
        g.rows *= factor;
    }
    NodeFigures {
        flops: fig.flops * factor,
        output_bytes: fig.output_bytes * factor,
        saved_bytes: fig.saved_bytes * factor,
        memory_bytes: fig.memory_bytes * factor,
        score_bytes: fig.score_bytes * factor,
        score_saved_bytes: fig.score_saved_bytes * factor,
        norm_saved_bytes: fig.norm_saved_bytes * factor,
        experts_activation_bytes: fig.experts_activation_bytes * factor,
        serial_bytes: fig.serial_bytes * factor,
        serial_bwd_bytes: fig.serial_bwd_bytes * factor,
        gemms,
        ..*fig
    }
}

/// `fig` with its byte figures times `factor` (its FLOPs and products as they are): a graph's
/// figures at another float width.
pub fn bytes_scaled(fig: &NodeFigures, factor: f64) -> NodeFigures {
    NodeFigures { flops: fig.flops, gemms: fig.gemms, ..scaled(fig, factor) }
}

/// Which dim of a node's products a tensor split divides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitDim {
    /// The rows (tokens: sequence parallelism, or any op without products).
    Rows,
    /// The output columns n (a column split).
    Columns,
    /// The contracted dim k (a row split).
    Contracted,
    /// Routed experts split by their intermediate dim: the gate-up product's n and the down
    /// product's k.
    Inner,
}

/// One tensor rank's figures of a node on `samples` samples split `t` ways along `dim`: its
/// FLOPs and bytes ÷ t, its products' `dim` ÷ t.
pub fn split(fig: &NodeFigures, samples: f64, t: f64, dim: SplitDim) -> NodeFigures {
    let mut f = scaled(fig, samples / t);
    if dim != SplitDim::Rows && t != 1.0 {
        for (i, g) in f.gemms.iter_mut().enumerate() {
            g.rows *= t;
            match (dim, i) {
                (SplitDim::Columns, _) | (SplitDim::Inner, 0) => g.n /= t,
                _ => g.k /= t,
            }
        }
    }
    f
}

/// Fraction of `spec`'s peak the compute of a node with these (scaled) figures reaches: each
/// product at the GEMM surface's efficiency for its shape (times the plateau
/// `efficiency.peak`), the rest of its FLOPs on the curve by FLOPs; without a surface, or a
/// product, the curve alone.
pub fn efficiency(fig: &NodeFigures, spec: &ClusterSpec) -> f64 {
    let curve = spec.efficiency.at(fig.flops);
    let Some(surface) = spec.gemm_surface.as_ref().filter(|_| fig.gemms[0].share > 0.0) else { return curve };
    let peak = spec.efficiency.peak;
    let (mut inverse, mut rest) = (0.0, 1.0);
    for g in fig.gemms.iter().filter(|g| g.share > 0.0) {
        inverse += g.share / (peak * surface.at(g.rows, g.n, g.k)).max(1e-12);
        rest -= g.share;
    }
    1.0 / (inverse + rest.max(0.0) / curve.max(1e-12))
}

/// Roofline forward time of one node with these figures (already scaled to the microbatch and
/// shard): max(flops / (peak(dtype) · [`efficiency`]), memory_bytes / (HBM bw · hbm
/// efficiency)), plus the time of the node's serial kernels (`serial_bytes`, which run in turn
/// with its products rather than under them). With a fused attention kernel
/// ([`ClusterSpec::fused_attention`]) the attention scores never reach HBM: their bytes
/// (`score_bytes`) are not charged.
pub fn node_time(fig: &NodeFigures, dtype: DType, spec: &ClusterSpec) -> f64 {
    let (products, serial) = roofline(fig, dtype, spec);
    products + serial
}

/// [`node_time`] in its two parts: the roofline of the products and the rest of the node's
/// traffic, and the serial kernels' time after them.
fn roofline(fig: &NodeFigures, dtype: DType, spec: &ClusterSpec) -> (f64, f64) {
    let compute = if fig.flops > 0.0 {
        fig.flops / (spec.peak_flops(dtype) * efficiency(fig, spec))
    } else {
        0.0
    };
    let bytes = if spec.fused_attention { (fig.memory_bytes - fig.score_bytes).max(0.0) } else { fig.memory_bytes };
    let bandwidth = spec.hbm_bandwidth * spec.hbm_efficiency;
    let serial = fig.serial_bytes.clamp(0.0, bytes);
    (compute.max((bytes - serial) / bandwidth), serial / bandwidth)
}

/// Bytes `fig` keeps for the backward on `spec`: without the attention scores when attention
/// is fused ([`ClusterSpec::fused_attention`]), without normalisations' copies when they are
/// ([`ClusterSpec::fused_norms`]).
pub fn saved_bytes(fig: &NodeFigures, spec: &ClusterSpec) -> f64 {
    unfused_saved(fig.saved_bytes, fig.score_saved_bytes, fig.norm_saved_bytes, spec)
}

/// [`saved_bytes`] of a layer's byte figures.
pub fn layer_saved_bytes(b: &crate::ir::LayerBytes, spec: &ClusterSpec) -> f64 {
    unfused_saved(b.saved_bytes, b.score_saved_bytes, b.norm_saved_bytes, spec)
}

/// `saved` less the parts `spec`'s fused kernels do not keep.
fn unfused_saved(saved: f64, scores: f64, norms: f64, spec: &ClusterSpec) -> f64 {
    let scores = if spec.fused_attention { scores } else { 0.0 };
    let norms = if spec.fused_norms { norms } else { 0.0 };
    (saved - scores - norms).max(0.0)
}

/// Forward, backward and weight-gradient times of one node at figures already scaled, its
/// products in `dtype` ([`product_dtype`]: an fp8 product also pays its casts).
pub fn node_times(op: &Op, fig: &NodeFigures, dtype: DType, spec: &ClusterSpec) -> LayerTimes {
    let (products, serial) = roofline(fig, dtype, spec);
    let fwd = products + serial;
    if is_matmul_like(op) || op.is(OpKind::MixtureOfExperts) {
        // the products twice over; the serial kernels' backwards move their own bytes
        let bandwidth = spec.hbm_bandwidth * spec.hbm_efficiency;
        let (cast_fwd, cast_bwd) = if dtype.is_fp8() { float8_cast_bytes(fig) } else { (0.0, 0.0) };
        let serial_bwd = (fig.serial_bwd_bytes.max(0.0) + cast_bwd) / bandwidth;
        LayerTimes { fwd: fwd + cast_fwd / bandwidth, bwd: 2.0 * products + serial_bwd, bwd_weight: products }
    } else if op.is(OpKind::ScaledDotProductAttention) {
        // no weights: the whole backward is input gradients
        LayerTimes { fwd, bwd: 2.0 * fwd, bwd_weight: 0.0 }
    } else {
        LayerTimes { fwd, bwd: fwd, bwd_weight: 0.0 }
    }
}

/// Times of layer `layer` of `lg` for a microbatch of `batch` samples, each node's work divided
/// by `tp` (an even tensor-parallel split, its products split by their output columns and
/// experts by their intermediate dim; the planner's strategies refine this per node).
/// Figures are scaled from the graph's float dtype to `dtype` bytes.
pub fn layer_times(
    lg: &LayeredGraph,
    layer: usize,
    spec: &ClusterSpec,
    dtype: DType,
    batch: f64,
    tp: usize,
) -> LayerTimes {
    let scale = bytes_scale(graph_float_dtype(&lg.graph), dtype);
    layer_times_with(lg, layer, spec, dtype, batch, tp, |id| bytes_scaled(&lg.node_figures(id), scale))
}

/// [`layer_times`] with each node's figures at the training bytes given by `figures` (the
/// plan's [`super::memory::TrainingBytes`]: callers pricing many layers compute them once).
pub fn layer_times_with(
    lg: &LayeredGraph,
    layer: usize,
    spec: &ClusterSpec,
    dtype: DType,
    batch: f64,
    tp: usize,
    figures: impl Fn(crate::ir::NodeId) -> NodeFigures,
) -> LayerTimes {
    let Some(l) = lg.layers.get(layer) else { return LayerTimes::default() };
    let t = tp.max(1) as f64;
    l.nodes
        .iter()
        .filter_map(|&id| lg.graph.try_node(id).map(|n| (n, figures(id))))
        .map(|(node, fig)| {
            let dim = if node.op.is(OpKind::MixtureOfExperts) { SplitDim::Inner } else { SplitDim::Columns };
            let fig = split(&fig, batch, t, dim);
            node_times(&node.op, &fig, product_dtype(&node.op, &fig, l.kind, dtype, spec), spec)
        })
        .sum()
}

/// The float dtype most of the graph's initializer elements have (f32 when there are none).
pub fn graph_float_dtype(graph: &Graph) -> DType {
    let mut counts: std::collections::BTreeMap<DType, u64> = Default::default();
    for id in graph.initializers() {
        let v = graph.value(id);
        if let Some(ty) = &v.ty
            && ty.dtype.is_float()
        {
            *counts.entry(ty.dtype).or_default() += ty.shape.as_ref().and_then(|s| s.numel()).unwrap_or(0);
        }
    }
    counts.into_iter().max_by_key(|&(_, n)| n).map(|(d, _)| d).unwrap_or(DType::F32)
}

/// Factor turning byte figures of a graph in `graph_dtype` into bytes at `dtype`.
pub fn bytes_scale(graph_dtype: DType, dtype: DType) -> f64 {
    let g = graph_dtype.size_bytes();
    if g == 0 { 1.0 } else { dtype.size_bytes() as f64 / g as f64 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roofline_takes_the_larger_bound() {
        let spec = ClusterSpec::preset("h100-80gb").unwrap();
        let big = NodeFigures { flops: 1e15, memory_bytes: 1e6, ..Default::default() };
        let eff = spec.efficiency.at(1e15);
        assert!((node_time(&big, DType::BF16, &spec) - 1e15 / (989e12 * eff)).abs() < 1e-12);
        let mem = NodeFigures { flops: 1e6, memory_bytes: 1e10, ..Default::default() };
        assert!((node_time(&mem, DType::BF16, &spec) - 1e10 / (3.35e12 * 0.8)).abs() < 1e-12);
        // Larger ops run at higher efficiency.
        assert!(spec.efficiency.at(1e12) > spec.efficiency.at(1e8));
    }

    /// Forward efficiency (FLOPs over time at the bf16 peak) of a hand-built GPT block of
    /// hidden size `hidden` at tensor degree `tp`, sequence 2048, one sample.
    fn block_efficiency(hidden: i64, heads: i64, tp: usize, spec: &ClusterSpec) -> f64 {
        use crate::passes::testutil::{Gpt, gpt};
        let g = gpt(Gpt { blocks: 1, hidden, heads, vocab: 1024, ffn: 4 * hidden, batch: None, seq: Some(2048), dtype: DType::BF16, namespaces: true, layer_names: true });
        let lg = crate::passes::analyze(g, &Default::default()).unwrap();
        let block = lg.layers.iter().find(|l| l.kind == crate::ir::LayerKind::Block).unwrap();
        let t = layer_times(&lg, block.index, spec, DType::BF16, 1.0, tp);
        block.figures.flops / tp as f64 / (t.fwd * spec.peak_flops(DType::BF16))
    }

    #[test]
    fn a_split_small_hidden_size_runs_at_a_lower_gemm_efficiency() {
        let h100 = ClusterSpec::preset("h100-80gb").unwrap();
        let curve = ClusterSpec { gemm_surface: None, ..h100.clone() };
        let drop = |h: i64, heads: i64, spec: &ClusterSpec| block_efficiency(h, heads, 8, spec) / block_efficiency(h, heads, 1, spec);
        // hidden 1024: the eight-way shards' GEMMs (2048 × 512 × 1024 and the like) run at a
        // third of the whole block's rate (XLA's table: 236 of 594 TFLOP/s)
        let small = drop(1024, 16, &h100);
        assert!(small < 0.6, "hidden 1024: tp 8 keeps {small:.3} of the tp 1 efficiency");
        // the curve by FLOPs alone priced the same shards too cheaply
        let by_flops = drop(1024, 16, &curve);
        assert!(small < 0.9 * by_flops, "curve {by_flops:.3}, surface {small:.3}");
        // hidden 12288: every shard is still on the plateau
        let large = drop(12288, 96, &h100);
        assert!(large > 0.95, "hidden 12288: tp 8 keeps {large:.3}");
    }

    #[test]
    fn serial_kernels_add_to_the_products_instead_of_hiding_under_them() {
        let h100 = ClusterSpec::preset("h100-80gb").unwrap();
        let bw = h100.hbm_bandwidth * h100.hbm_efficiency;
        let experts = Op::Known(OpKind::MixtureOfExperts);
        // compute-bound: the products' traffic hides under their FLOPs, the serial kernels' not
        let products = NodeFigures { flops: 1e12, memory_bytes: 1e8, ..Default::default() };
        let with = NodeFigures { memory_bytes: 1e8 + 4e8, serial_bytes: 4e8, serial_bwd_bytes: 6e8, ..products };
        let (p, w) = (node_times(&experts, &products, DType::BF16, &h100), node_times(&experts, &with, DType::BF16, &h100));
        assert!((w.fwd - p.fwd - 4e8 / bw).abs() < 1e-12, "forward {} against {}", w.fwd, p.fwd);
        assert!((w.bwd - p.bwd - 6e8 / bw).abs() < 1e-12, "backward {} against {}", w.bwd, p.bwd);
        assert_eq!(w.bwd_weight, p.bwd_weight, "the weight gradients are the products' alone");
        // the old roofline would have hidden them: the larger of compute and all the bytes
        assert!(p.fwd > (1e8 + 4e8) / bw);
        // memory-bound: the rest of the traffic is paid in full beside the serial kernels
        let light = NodeFigures { flops: 1e6, memory_bytes: 1e9, serial_bytes: 4e8, ..Default::default() };
        assert!((node_time(&light, DType::BF16, &h100) - 1e9 / bw).abs() < 1e-12);
    }

    #[test]
    fn fused_kernels_drop_what_they_do_not_keep() {
        let h100 = ClusterSpec::preset("h100-80gb").unwrap();
        let fig = NodeFigures { saved_bytes: 100.0, score_saved_bytes: 30.0, norm_saved_bytes: 20.0, ..Default::default() };
        assert_eq!(saved_bytes(&fig, &ClusterSpec { fused_attention: false, fused_norms: false, ..h100.clone() }), 100.0);
        assert_eq!(saved_bytes(&fig, &ClusterSpec { fused_attention: true, fused_norms: false, ..h100.clone() }), 70.0);
        assert_eq!(saved_bytes(&fig, &ClusterSpec { fused_attention: false, fused_norms: true, ..h100.clone() }), 80.0);
        assert_eq!(saved_bytes(&fig, &h100), 50.0, "the H100 preset fuses both");
    }

    #[test]
    fn splits_divide_the_dim_they_name() {
        use crate::ir::GemmShape;
        let spec = ClusterSpec::preset("h100-80gb").unwrap();
        let g = GemmShape { rows: 2048.0, n: 4096.0, k: 1024.0, share: 1.0 };
        let fig = NodeFigures { flops: 2.0 * 2048.0 * 4096.0 * 1024.0, gemms: [g, GemmShape::default()], ..Default::default() };
        let col = split(&fig, 2.0, 8.0, SplitDim::Columns);
        assert_eq!((col.gemms[0].rows, col.gemms[0].n, col.gemms[0].k), (4096.0, 512.0, 1024.0));
        assert_eq!(col.flops, fig.flops * 2.0 / 8.0);
        let row = split(&fig, 2.0, 8.0, SplitDim::Contracted);
        assert_eq!((row.gemms[0].rows, row.gemms[0].n, row.gemms[0].k), (4096.0, 4096.0, 128.0));
        let seq = split(&fig, 2.0, 8.0, SplitDim::Rows);
        assert_eq!((seq.gemms[0].rows, seq.gemms[0].n, seq.gemms[0].k), (512.0, 4096.0, 1024.0));
        // at a grid point the efficiency is the table's there, at the preset's plateau
        let surface = spec.gemm_surface.as_ref().unwrap();
        let e = efficiency(&scaled(&fig, 1.0), &spec);
        assert!((e - 0.75 * surface.at(2048.0, 4096.0, 1024.0)).abs() < 1e-12);
        assert!((surface.at(2048.0, 4096.0, 1024.0) - 594.2 / 783.3).abs() < 1e-12);
    }

    #[test]
    fn matmul_backward_is_twice_the_forward() {
        let spec = ClusterSpec::preset("a100-80gb").unwrap();
        let fig = NodeFigures { flops: 1e12, ..Default::default() };
        let t = node_times(&Op::Known(OpKind::MatMul), &fig, DType::BF16, &spec);
        assert_eq!(t.bwd, 2.0 * t.fwd);
        assert_eq!(t.bwd_weight, t.fwd);
        let t = node_times(&Op::Known(OpKind::Gelu), &fig, DType::BF16, &spec);
        assert_eq!((t.bwd, t.bwd_weight), (t.fwd, 0.0));
        assert_eq!(t.with_recompute().bwd, 2.0 * t.fwd);
    }

    #[test]
    fn float8_linears_run_the_blocks_products_at_the_fp8_rate_beside_their_casts() {
        let h100 = ClusterSpec::preset("h100-80gb").unwrap();
        let fp8 = h100.with_float8_linears().unwrap();
        // an 8,192-token product 4,096 × 14,336 with its weight
        let (rows, k, n) = (8192.0, 4096.0, 14336.0);
        let fig = NodeFigures {
            flops: 2.0 * rows * k * n,
            memory_bytes: 2.0 * (rows * k + k * n + rows * n),
            gemms: [crate::ir::GemmShape { rows, n, k, share: 1.0 }, Default::default()],
            ..Default::default()
        };
        let matmul = Op::Known(OpKind::MatMul);
        let block = product_dtype(&matmul, &fig, LayerKind::Block, DType::BF16, &fp8);
        assert_eq!(block, DType::F8E4M3);
        // the head, a weightless product and a job without Float8 stay in 16 bits
        assert_eq!(product_dtype(&matmul, &fig, LayerKind::Head, DType::BF16, &fp8), DType::BF16);
        let weightless = NodeFigures { gemms: Default::default(), ..fig };
        assert_eq!(product_dtype(&matmul, &weightless, LayerKind::Block, DType::BF16, &fp8), DType::BF16);
        assert_eq!(product_dtype(&matmul, &fig, LayerKind::Block, DType::BF16, &h100), DType::BF16);
        let (plain, eight) = (node_times(&matmul, &fig, DType::BF16, &fp8), node_times(&matmul, &fig, block, &fp8));
        // the products at the datasheets' fp8 rate (1,979 against 989 TFLOP/s) and the same
        // efficiency; the casts by hand: 5 bytes an
        // element of the input and the weight forward, of the output's gradient backward, and
        // 2 bytes an element of all three for the backward's transposed copies
        let bw = 3.35e12 * 0.8;
        let products = eight.bwd_weight;
        assert!((plain.bwd_weight / products - 1979.0 / 989.0).abs() < 1e-9, "{plain:?} against {eight:?}");
        let (cast_fwd, cast_bwd) = (5.0 * (rows * k + k * n), 5.0 * rows * n + 2.0 * (rows * k + k * n + rows * n));
        assert_eq!(float8_cast_bytes(&fig), (cast_fwd, cast_bwd));
        assert!((eight.fwd / (products + cast_fwd / bw) - 1.0).abs() < 1e-9, "{eight:?}");
        assert!((eight.bwd / (2.0 * products + cast_bwd / bw) - 1.0).abs() < 1e-9, "{eight:?}");
        assert!((plain.fwd / eight.fwd - 1.0) > 0.5, "fp8 forward {:.3} of bf16's", eight.fwd / plain.fwd);
        // a device without an fp8 rate refuses the setting
        let a100 = ClusterSpec::preset("a100-80gb").unwrap();
        assert!(a100.with_float8_linears().unwrap_err().to_string().contains("no fp8 tensor rate"));
    }
}
