//! Per-node figures, per sample: parameters (each floating-point initializer counted once, at
//! its first reader), forward FLOPs, output and memory bytes, and the activations each node
//! keeps for its backward pass (autograd's saved tensors).

use std::collections::BTreeMap;

use super::PassError;
use crate::ir::{AutocastClass, DType, Dim, DimBindings, GemmShape, Graph, LossFigures, Node, NodeFigures, NodeId, OpKind, ValueId, ValueKind};

/// What one node keeps for its backward pass.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Saved {
    /// Non-parameter, non-constant graph values kept (a value kept by several nodes counts
    /// once in a layer's union).
    pub values: Vec<ValueId>,
    /// Bytes kept that are not graph values (dropout masks, pooling indices), per sample.
    pub extra_bytes: f64,
    /// Bytes kept per microbatch whatever its size: under autocast, the low-type copies of the
    /// weights a matrix product casts and keeps (0 otherwise).
    pub weight_copy_bytes: f64,
    /// Of `extra_bytes`, what a composite RMS normalisation keeps beside its input (the
    /// normalised copy the scale's gradient reads, one statistic per row), which a fused kernel
    /// does not (see `cost::ClusterSpec::fused_norms`), per sample.
    pub norm_bytes: f64,
    /// Of `extra_bytes`, what a mixture of experts keeps of its experts' activation function
    /// (the activation's output and the gated product), which selective recompute rebuilds, per
    /// sample.
    pub experts_activation_bytes: f64,
}

/// Figures of a whole graph.
#[derive(Clone, Debug, Default)]
pub struct Figures {
    /// Per node, indexed by `NodeId::index()`.
    pub per_node: Vec<NodeFigures>,
    /// Saved tensors per node, indexed by `NodeId::index()`.
    pub saved: Vec<Saved>,
    /// For each value (by index), the node that owns it as a parameter, if any.
    pub param_owner: Vec<Option<NodeId>>,
    /// Elements of floating-point initializers, each counted once.
    pub total_params: u64,
    /// Forward FLOPs per sample.
    pub total_flops: f64,
    /// Execution order used.
    pub order: Vec<NodeId>,
    /// Batch size the shapes were inferred at (figures are divided by it).
    pub graph_batch: f64,
    /// The dim bindings used.
    pub dims: BTreeMap<String, i64>,
    /// For each value (by index), whether it carries a gradient (trained parameters and
    /// floating-point values computed from them).
    pub grad: Vec<bool>,
    /// For each value (by index), whether it is an attention score (see `NodeFigures::score_bytes`).
    pub score: Vec<bool>,
    /// For each value (by index), its element type in the run the bytes are of: an autocast
    /// run's ([`super::autocast::dtypes`]), or empty for the graph's own types.
    pub dtypes: Vec<Option<DType>>,
    /// The training loss computed on a graph output, where one is (a scalar output is the
    /// model's own loss: none).
    pub loss: Option<LossFigures>,
}

impl Figures {
    /// Bytes per sample of value `v` (0 if its shape is unknown).
    pub fn value_bytes(&self, graph: &Graph, v: ValueId) -> f64 {
        Sizes { graph, dims: &self.dims, dtypes: &self.dtypes, low: None }.bytes(v) / self.graph_batch
    }
}

/// Sizes of values under the dim bindings (graph inputs keep their symbolic dims).
pub struct Sizes<'a> {
    /// The graph.
    pub graph: &'a Graph,
    /// Symbol → size.
    pub dims: &'a BTreeMap<String, i64>,
    /// Per value, its element type in the run (empty: the graph's own types).
    pub dtypes: &'a [Option<DType>],
    /// The low type of an autocast run, whose matrix products keep low-type casts of their
    /// inputs (`None`: no autocast).
    pub low: Option<DType>,
}

impl<'a> Sizes<'a> {
    /// Sizes at the graph's own types.
    pub fn new(graph: &'a Graph, dims: &'a BTreeMap<String, i64>) -> Sizes<'a> {
        Sizes { graph, dims, dtypes: &[], low: None }
    }

    /// Concrete dims of `v`, if known.
    pub fn dims(&self, v: ValueId) -> Option<Vec<i64>> {
        let shape = self.graph.value(v).ty.as_ref()?.shape.as_ref()?;
        shape
            .0
            .iter()
            .map(|d| match d {
                Dim::Known(x) => Some(*x),
                Dim::Sym(s) => self.dims.get(s).copied(),
            })
            .collect()
    }

    /// Element count of `v` (0 if unknown).
    pub fn numel(&self, v: ValueId) -> f64 {
        self.dims(v).map(|d| d.iter().map(|&x| x.max(0) as f64).product()).unwrap_or(0.0)
    }

    /// The element type of `v` in the run (`None` if unknown).
    pub fn dtype(&self, v: ValueId) -> Option<DType> {
        match self.dtypes.get(v.index()) {
            Some(d) => *d,
            None => self.graph.value(v).ty.as_ref().map(|t| t.dtype),
        }
    }

    /// Bytes of `v` (0 if unknown).
    pub fn bytes(&self, v: ValueId) -> f64 {
        self.numel(v) * self.dtype(v).map_or(0, |d| d.size_bytes()) as f64
    }
}

/// True for floating-point initializers (what counts as a parameter).
pub fn is_param(graph: &Graph, v: ValueId) -> bool {
    let val = graph.value(v);
    val.kind == ValueKind::Initializer
        && val.data.as_ref().map(|t| t.dtype).or(val.ty.as_ref().map(|t| t.dtype)).is_some_and(|d| d.is_float())
}

/// True for parameters that are trained: the decision of [`super::params::decide`] when it
/// ran; otherwise floating point, not a scalar (exporters store constants such as `sqrt(d)` as
/// initializers) and not a well-known buffer name (RoPE tables, masks).
pub fn is_trainable(graph: &Graph, v: ValueId) -> bool {
    super::params::is_trained(graph, v)
}

/// Elements and bytes of the initializer `v` (from its data, else its declared type).
pub fn param_elems(graph: &Graph, v: ValueId) -> (u64, u64) {
    let val = graph.value(v);
    match &val.data {
        Some(t) => (t.numel(), t.numel() * t.dtype.size_bytes()),
        None => {
            let ty = val.ty.as_ref();
            let n = ty.and_then(|t| t.shape.as_ref()).and_then(|s| s.numel()).unwrap_or(0);
            (n, n * ty.map(|t| t.dtype.size_bytes()).unwrap_or(0))
        }
    }
}

/// Computes every node's figures under the bindings used for shape inference.
pub fn compute(graph: &Graph, bindings: &DimBindings) -> Result<Figures, PassError> {
    compute_at(graph, bindings, None)
}

/// [`compute`], its bytes those of an autocast run computing its products in `low` (values in
/// their run types, [`super::autocast::dtypes`]), or of the graph's own types for `None`.
pub fn compute_at(graph: &Graph, bindings: &DimBindings, low: Option<DType>) -> Result<Figures, PassError> {
    let order = graph.topo_order()?;
    let dtypes = low.map(|l| super::autocast::dtypes(graph, &order, l)).unwrap_or_default();
    let sz = Sizes { graph, dims: &bindings.values, dtypes: &dtypes, low };
    let slots = graph.node_ids().map(|n| n.index() + 1).max().unwrap_or(0);
    let batch = bindings.graph_batch.max(1) as f64;
    let mut f = Figures {
        per_node: vec![NodeFigures::default(); slots],
        saved: vec![Saved::default(); slots],
        param_owner: vec![None; graph.value_count()],
        graph_batch: batch,
        dims: bindings.values.clone(),
        ..Figures::default()
    };
    f.total_params = graph.value_ids().filter(|&v| is_param(graph, v)).map(|v| param_elems(graph, v).0).sum();

    // Which values carry a gradient: parameters and float values computed from them.
    let mut grad = vec![false; graph.value_count()];
    for v in graph.value_ids() {
        grad[v.index()] = is_trainable(graph, v);
    }
    // Which values depend on the data (weight views and constant masks are not activations).
    let mut data = vec![false; graph.value_count()];
    for &v in &graph.inputs {
        data[v.index()] = true;
    }
    for &id in &order {
        let node = graph.node(id);
        let any = node.inputs.iter().flatten().any(|v| grad[v.index()]);
        let from_data = node.inputs.iter().flatten().any(|v| data[v.index()]);
        for &o in &node.outputs {
            let float = graph.value(o).ty.as_ref().is_some_and(|t| t.dtype.is_float());
            grad[o.index()] = any && float;
            data[o.index()] = from_data;
        }
    }

    let score = scores(&sz, &order, &data);
    let loss_input = loss_input(&sz, &grad);

    for &id in &order {
        let node = graph.node(id);
        let mut fig = NodeFigures::default();
        for (slot, v) in node.inputs.iter().enumerate() {
            let Some(v) = *v else { continue };
            let built = built_weight(graph, node, slot, v, &data, &grad);
            if (is_param(graph, v) || built) && f.param_owner[v.index()].is_none() {
                f.param_owner[v.index()] = Some(id);
                let (e, b) = param_elems(graph, v);
                fig.param_elems += e;
                fig.param_bytes += b;
                if !built && !is_trainable(graph, v) {
                    fig.frozen_elems += e;
                }
                if built {
                    f.total_params += e;
                }
            }
        }
        fig.flops = flops(&sz, node) / batch;
        fig.gemms = gemms(&sz, node, &data, fig.flops * batch, batch);
        fig.output_bytes = node.outputs.iter().map(|&o| sz.bytes(o)).sum::<f64>() / batch;
        fig.memory_bytes = memory(&sz, node) / batch;
        fig.score_bytes = score_bytes(&sz, node, &score).min(fig.memory_bytes * batch) / batch;
        let mut saved = saved(&sz, node, &grad, &data, batch);
        if let Some((loss_kept, width)) = loss_kept_bytes(&sz, node, loss_input) {
            saved.extra_bytes += loss_kept / batch;
            f.loss = Some(LossFigures { node: id, kept_bytes: loss_kept / batch, width });
        }
        fig.saved_bytes = saved.values.iter().map(|&v| sz.bytes(v)).sum::<f64>() / batch + saved.extra_bytes;
        fig.score_saved_bytes = saved.values.iter().filter(|v| score[v.index()]).map(|&v| sz.bytes(v)).sum::<f64>() / batch;
        fig.norm_saved_bytes = saved.norm_bytes;
        fig.experts_activation_bytes = saved.experts_activation_bytes;
        if node.op.is(OpKind::MixtureOfExperts)
            && let Some(w) = experts_work(&sz, node)
        {
            fig.serial_bytes = w.serial_bytes.min(fig.memory_bytes * batch) / batch;
            fig.serial_bwd_bytes = w.serial_bwd_bytes / batch;
        }
        f.total_flops += fig.flops;
        f.per_node[id.index()] = fig;
        f.saved[id.index()] = saved;
    }
    f.order = order;
    f.grad = grad;
    f.score = score;
    f.dtypes = dtypes;
    Ok(f)
}

/// Whether input `slot` of `node` is a weight computed by a constant subgraph (as the onnx
/// wheel's `light_*` models build theirs with `ConstantOfShape`): a floating-point value made
/// by a node from no data and no trained parameter (a view of a weight, such as
/// `Transpose(wte)`, is that weight), read as the weight or bias of a convolution or matrix
/// product.
/// Such values count as parameters for memory and cost.
fn built_weight(graph: &Graph, node: &Node, slot: usize, v: ValueId, data: &[bool], grad: &[bool]) -> bool {
    let val = graph.value(v);
    let weight_slot = match node.op.kind() {
        Some(OpKind::Conv | OpKind::Gemm) => slot == 1 || slot == 2,
        Some(OpKind::MatMul) => slot == 1 && node.inputs.first().copied().flatten().is_some_and(|x| data[x.index()]),
        _ => false,
    };
    weight_slot && !data[v.index()] && !grad[v.index()] && val.producer.is_some() && val.ty.as_ref().is_some_and(|t| t.dtype.is_float())
}

/// Forward FLOPs of one node at the inferred batch.
pub fn flops(sz: &Sizes, node: &Node) -> f64 {
    let Some(kind) = node.op.kind() else { return 0.0 };
    let input = |i: usize| node.inputs.get(i).copied().flatten();
    let out_numel = node.outputs.first().map(|&o| sz.numel(o)).unwrap_or(0.0);
    let in_numel = input(0).map(|v| sz.numel(v)).unwrap_or(0.0);
    use OpKind::*;
    match kind {
        MatMul => {
            let k = input(0).and_then(|v| sz.dims(v)).and_then(|d| d.last().copied()).unwrap_or(0);
            2.0 * out_numel * k as f64
        }
        Gemm => {
            let k = input(0)
                .and_then(|v| sz.dims(v))
                .filter(|d| d.len() == 2)
                .map(|d| if node.attrs.int("transA", 0) != 0 { d[0] } else { d[1] })
                .unwrap_or(0);
            let bias = if input(2).is_some() { out_numel } else { 0.0 };
            2.0 * out_numel * k as f64 + bias
        }
        ScaledDotProductAttention => {
            // the chain's: q·kᵀ and ·v (2 flops a term), scale 1, mask 1, softmax 5 a score
            let (Some(q), Some(v)) = (input(0).and_then(|v| sz.dims(v)), input(2).and_then(|v| sz.dims(v))) else { return 0.0 };
            let (Some(&d), Some(&l), Some(&dv)) = (q.last(), v.get(v.len().wrapping_sub(2)), v.last()) else { return 0.0 };
            let scores = if dv > 0 { out_numel / dv as f64 * l as f64 } else { 0.0 };
            let mask = if input(3).is_some() { 1.0 } else { 0.0 };
            2.0 * scores * d as f64 + 2.0 * scores * dv as f64 + (6.0 + mask) * scores
        }
        MixtureOfExperts => experts_work(sz, node).map_or(0.0, |w| w.flops),
        Conv => {
            let w = input(1).and_then(|v| sz.dims(v)).unwrap_or_default();
            let per_out: f64 = w.iter().skip(1).map(|&x| x as f64).product();
            let bias = if input(2).is_some() { out_numel } else { 0.0 };
            2.0 * out_numel * per_out + bias
        }
        // No arithmetic: views, data movement, indexing, type and constant ops.
        Reshape | Transpose | Concat | Split | Slice | Gather | GatherElements | GatherND | Unsqueeze
        | Squeeze | Expand | Shape | Size | ConstantOfShape | Range | Flatten | Tile | Pad | Trilu
        | ScatterND | Constant | Dropout | Identity | Cast | CastLike | Where => 0.0,
        Gelu => 8.0 * out_numel,
        Sigmoid | HardSwish => 4.0 * out_numel,
        Softplus | HardSigmoid | Elu => 3.0 * out_numel,
        LeakyRelu | Clip => 2.0 * out_numel,
        Sum | Max | Min => (node.inputs.len().saturating_sub(1)).max(1) as f64 * out_numel,
        Mean => node.inputs.len().max(1) as f64 * out_numel,
        Softmax | LogSoftmax => 5.0 * in_numel,
        // the log-softmax, then one pick per target
        SoftmaxCrossEntropyLoss => 5.0 * in_numel,
        NegativeLogLikelihoodLoss => {
            let classes = node.inputs.first().copied().flatten().and_then(|v| sz.dims(v)).and_then(|d| d.get(1).copied()).filter(|&c| c > 0);
            in_numel / classes.unwrap_or(1) as f64
        }
        LayerNormalization | InstanceNormalization => 8.0 * in_numel,
        // square, mean, scale by the inverse root, weight
        RMSNormalization => 4.0 * in_numel,
        // sigmoid (4), its product with the gate and the product with up
        SwiGlu => 6.0 * out_numel,
        // the chain's count: two products, the sum, and the negation of half the channels
        ApplyRotary => 3.5 * out_numel,
        BatchNormalization => 4.0 * in_numel,
        LRN => (node.attrs.int("size", 1) as f64 + 3.0) * in_numel,
        ReduceMean | ReduceSum | ReduceMax | ReduceMin | ReduceProd | ArgMax | ArgMin | CumSum
        | GlobalAveragePool | GlobalMaxPool => in_numel,
        MaxPool | AveragePool => {
            let k: f64 = node.attrs.ints("kernel_shape").map(|k| k.iter().map(|&x| x as f64).product()).unwrap_or(1.0);
            out_numel * k
        }
        // a multiply and an add per output element and contracted label
        Einsum => {
            let shapes: Option<Vec<Vec<i64>>> = node.inputs.iter().map(|v| v.and_then(|v| sz.dims(v))).collect();
            let contracted = shapes.and_then(|s| {
                let refs: Vec<&[i64]> = s.iter().map(Vec::as_slice).collect();
                node.attrs.str("equation").and_then(|e| crate::passes::shape_infer::einsum_contracted(e, &refs))
            });
            2.0 * out_numel * contracted.unwrap_or(1) as f64
        }
        ReduceL1 | ReduceSumSquare => 2.0 * in_numel,
        ReduceL2 | ReduceLogSumExp => 3.0 * in_numel,
        LpNormalization => 4.0 * in_numel,
        // separable taps: a multiply-add per tap per resized axis (linear: 2 taps)
        Resize => 4.0 * out_numel,
        GridSample => 10.0 * out_numel,
        // one add per block element
        Col2Im => in_numel,
        _ if kind.is_elementwise() => out_numel,
        _ => 0.0,
    }
}

/// The weight products of `node` (`flops` its forward FLOPs at the inferred batch, `batch`
/// that batch): a `MatMul` or `Gemm` whose second operand does not depend on the data (a
/// parameter, a view of one, a built weight) and is a matrix, its rows every leading dim of
/// the first operand; a `MixtureOfExperts`, each expert's gate-up (`rows × H` by `H × 2I`) and
/// down (`rows × I` by `I × H`) products at the routed pairs per expert (tokens · k / E).
/// Activation × activation products (attention's) have none.
fn gemms(sz: &Sizes, node: &Node, data: &[bool], flops: f64, batch: f64) -> [GemmShape; 2] {
    let none = [GemmShape::default(); 2];
    if flops <= 0.0 {
        return none;
    }
    let input = |i: usize| node.inputs.get(i).copied().flatten();
    let share = |m: f64, n: f64, k: f64| (2.0 * m * n * k / flops).min(1.0);
    match node.op.kind() {
        Some(OpKind::MatMul | OpKind::Gemm) => {
            let (Some(a), Some(b)) = (input(0), input(1)) else { return none };
            if data.get(b.index()).copied().unwrap_or(true) {
                return none;
            }
            let (Some(ad), Some(bd)) = (sz.dims(a), sz.dims(b)) else { return none };
            if bd.len() != 2 || ad.len() < 2 {
                return none;
            }
            let gemm = node.op.is(OpKind::Gemm);
            let (ta, tb) = (gemm && node.attrs.int("transA", 0) != 0, gemm && node.attrs.int("transB", 0) != 0);
            let (k, n) = if tb { (bd[1], bd[0]) } else { (bd[0], bd[1]) };
            let m = if ta { ad[1] as f64 } else { ad.iter().map(|&x| x.max(0) as f64).product::<f64>() / ad[ad.len() - 1].max(1) as f64 };
            let (n, k) = (n as f64, k as f64);
            if m <= 0.0 || n <= 0.0 || k <= 0.0 {
                return none;
            }
            [GemmShape { rows: m / batch, n, k, share: share(m, n, k) }, GemmShape::default()]
        }
        Some(OpKind::MixtureOfExperts) => {
            let (Some(w), Some(gu)) = (input(1).and_then(|v| sz.dims(v)), input(3).and_then(|v| sz.dims(v))) else { return none };
            let (Some(&tokens), Some(&k), Some(&experts), Some(&i2), Some(&h)) = (w.first(), w.get(1), gu.first(), gu.get(1), gu.get(2)) else { return none };
            if experts <= 0 || tokens <= 0 || k <= 0 {
                return none;
            }
            let rows = (tokens * k) as f64 / experts as f64;
            let (i2, h, e) = (i2 as f64, h as f64, experts as f64);
            // every expert's product runs once: E products of `rows` rows
            let up = GemmShape { rows: rows / batch, n: i2, k: h, share: e * share(rows, i2, h) };
            let down = GemmShape { rows: rows / batch, n: h, k: i2 / 2.0, share: e * share(rows, h, i2 / 2.0) };
            [up, down]
        }
        _ => none,
    }
}

/// What a `MixtureOfExperts` node computes at the inferred batch: only the routed token-expert
/// pairs (N·k of them) run, so work scales with k, not with the expert count E.
struct ExpertsWork {
    /// Forward FLOPs: per routed pair the gate and up projections (2·H·2I), the SiLU and the
    /// gated product (5·I), the down projection (2·I·H), the weighted add back (2·H) and, with
    /// biases, their adds (2I + H).
    flops: f64,
    /// Bytes of the routed intermediates written once and read once (gathered tokens, gate and
    /// up halves, the gated product, the experts' outputs).
    routed_bytes: f64,
    /// Bytes autograd keeps of them (the gathered tokens, gate and up, the activation and the
    /// gated product, the outputs).
    saved_bytes: f64,
    /// Of `saved_bytes`, the activation and the gated product.
    activation_bytes: f64,
    /// Bytes the kernels between the products move (`NodeFigures::serial_bytes`): the
    /// permutation reads the tokens and writes a copy per pair, the activation function reads
    /// gate and up and writes their gated product, the unpermutation reads the experts'
    /// outputs and writes the weighted sum.
    serial_bytes: f64,
    /// Their backwards: the unpermutation's (the outputs reread for the weights' gradient),
    /// the activation's (gate, up and the incoming gradient read, both halves' written) and
    /// the permutation's (the pairs' gradients summed per token).
    serial_bwd_bytes: f64,
}

fn experts_work(sz: &Sizes, node: &Node) -> Option<ExpertsWork> {
    let input = |i: usize| node.inputs.get(i).copied().flatten();
    let w = sz.dims(input(1)?)?;
    let gu = sz.dims(input(3)?)?;
    let (&pairs_k, &tokens) = (w.get(1)?, w.first()?);
    let (i2, h) = (*gu.get(1)? as f64, *gu.get(2)? as f64);
    let i = i2 / 2.0;
    let pairs = (tokens * pairs_k) as f64;
    let elem = sz.dtype(input(0)?).map_or(4, |d| d.size_bytes()) as f64;
    // experts with biases add one after each projection
    let biases = if input(5).is_some() { i2 + h } else { 0.0 };
    Some(ExpertsWork {
        flops: pairs * (2.0 * h * i2 + 5.0 * i + 2.0 * i * h + 2.0 * h + biases),
        routed_bytes: pairs * (h + i2 + i + h) * elem,
        saved_bytes: pairs * (h + i2 + 2.0 * i + h) * elem,
        activation_bytes: pairs * 2.0 * i * elem,
        serial_bytes: (2.0 * tokens as f64 * h + pairs * (2.0 * h + 3.0 * i)) * elem,
        serial_bwd_bytes: (2.0 * tokens as f64 * h + pairs * (3.0 * h + 5.0 * i)) * elem,
    })
}

/// Which values are attention scores: the output of a matmul of two activations that is larger
/// than both its inputs (Q·Kᵀ, `[.., s, d]·[.., d, s'] → [.., s, s']`), and the same-size
/// outputs of elementwise ops, softmax, casts and dropout applied to a score (scale, mask,
/// softmax). The matmul reading them (·V) is where the chain ends.
fn scores(sz: &Sizes, order: &[NodeId], data: &[bool]) -> Vec<bool> {
    let graph = sz.graph;
    let mut score = vec![false; graph.value_count()];
    for &id in order {
        let node = graph.node(id);
        let (Some(kind), Some(&o)) = (node.op.kind(), node.outputs.first()) else { continue };
        let n = sz.numel(o);
        let input = |i: usize| node.inputs.get(i).copied().flatten();
        let activation = |v: ValueId| data[v.index()] && !is_param(graph, v) && sz.numel(v) > 0.0;
        use OpKind::*;
        score[o.index()] = match kind {
            MatMul => match (input(0), input(1)) {
                (Some(a), Some(b)) => {
                    activation(a) && activation(b) && n > sz.numel(a) && n > sz.numel(b) && sz.dims(o).is_some_and(|d| d.len() >= 3)
                }
                _ => false,
            },
            Softmax | LogSoftmax | Cast | Dropout | Identity => input(0).is_some_and(|v| score[v.index()] && sz.numel(v) == n),
            k if k.is_elementwise() => node.inputs.iter().flatten().any(|v| score[v.index()] && sz.numel(*v) == n),
            _ => false,
        };
    }
    score
}

/// The s × s score traffic of the chain a fused attention replaced: q·kᵀ writes the scores,
/// the scale, the mask and the softmax read and write them, the product with v reads them.
/// Charged to the fused node as score bytes, so only a device whose kernel keeps the scores on
/// chip (`ClusterSpec::fused_attention`) drops it; libtorch's CPU kernel streams them through
/// memory and measures as fast as the chain.
fn fused_attention_score_traffic(sz: &Sizes, node: &Node) -> f64 {
    let input = |i: usize| node.inputs.get(i).copied().flatten();
    let (Some(o), Some(v)) = (node.outputs.first().copied(), input(2)) else { return 0.0 };
    let Some(vd) = sz.dims(v) else { return 0.0 };
    let (Some(&keys), Some(&dv)) = (vd.get(vd.len().wrapping_sub(2)), vd.last()) else { return 0.0 };
    if dv <= 0 {
        return 0.0;
    }
    let scores = sz.bytes(o) / dv as f64 * keys as f64;
    let passes = 6.0 + if input(3).is_some() { 2.0 } else { 0.0 };
    passes * scores
}

/// The attention-score part of [`memory`]: score inputs read and score outputs written.
fn score_bytes(sz: &Sizes, node: &Node, score: &[bool]) -> f64 {
    use OpKind::*;
    match node.op.kind() {
        None | Some(Reshape | Unsqueeze | Squeeze | Flatten | Identity | Shape | Size | Constant | Gather | GatherElements | GatherND | Slice | Expand) => 0.0,
        Some(ScaledDotProductAttention) => fused_attention_score_traffic(sz, node),
        Some(_) => node.inputs.iter().flatten().chain(&node.outputs).filter(|v| score[v.index()]).map(|&v| sz.bytes(v)).sum(),
    }
}

/// Activation bytes the node reads and writes (parameter and constant reads excluded).
fn memory(sz: &Sizes, node: &Node) -> f64 {
    let graph = sz.graph;
    let Some(kind) = node.op.kind() else { return 0.0 };
    use OpKind::*;
    let out: f64 = node.outputs.iter().map(|&o| sz.bytes(o)).sum();
    let activation = |v: &ValueId| !matches!(graph.value(*v).kind, ValueKind::Initializer | ValueKind::Constant);
    match kind {
        Reshape | Unsqueeze | Squeeze | Flatten | Identity | Shape | Size | Constant => 0.0,
        Gather | GatherElements | GatherND | Slice | Expand => {
            let idx: f64 = node.inputs.iter().skip(1).flatten().filter(|v| activation(v)).map(|&v| sz.bytes(v)).sum();
            2.0 * out + idx
        }
        ScaledDotProductAttention => {
            node.inputs.iter().flatten().filter(|v| activation(v)).map(|&v| sz.bytes(v)).sum::<f64>() + out + fused_attention_score_traffic(sz, node)
        }
        MixtureOfExperts => {
            let routed = experts_work(sz, node).map_or(0.0, |w| w.routed_bytes);
            node.inputs.iter().flatten().filter(|v| activation(v)).map(|&v| sz.bytes(v)).sum::<f64>() + out + 2.0 * routed
        }
        _ => node.inputs.iter().flatten().filter(|v| activation(v)).map(|&v| sz.bytes(v)).sum::<f64>() + out,
    }
}

/// Whether libtorch's `scaled_dot_product_attention` on CPU, as the runner calls it (no
/// dropout, no grouped-query flag, unit-stride keys), takes its fused kernel for `node`: q, kᵀ
/// and v of rank 4 with equal batch and head counts and one head size, and a mask, if any, of
/// rank 2 or 4 whose every dim is the scores' or 1 (`sdp_utils_cpp`'s conditions). Otherwise it
/// runs the math path, which materialises the scores.
fn attention_fuses(sz: &Sizes, node: &Node) -> bool {
    let dims = |i: usize| node.inputs.get(i).copied().flatten().and_then(|v| sz.dims(v));
    let (Some(q), Some(kt), Some(v)) = (dims(0), dims(1), dims(2)) else { return true };
    if q.len() != 4 || kt.len() != 4 || v.len() != 4 {
        return false;
    }
    let (b, h, rows, d, keys) = (q[0], q[1], q[2], q[3], kt[3]);
    if kt[0] != b || v[0] != b || kt[1] != h || v[1] != h || kt[2] != d || v[3] != d {
        return false;
    }
    let Some(node_mask) = node.inputs.get(3).copied().flatten() else { return true };
    let Some(m) = sz.dims(node_mask) else { return true };
    let fits = |got: i64, want: i64| got == want || got == 1;
    let n = m.len();
    match n {
        2 => fits(m[0], rows) && fits(m[1], keys),
        4 => fits(m[0], b) && fits(m[1], h) && fits(m[2], rows) && fits(m[3], keys),
        _ => false,
    }
}

/// The graph output a training loss reads: the first one carrying a gradient that is not a
/// scalar (a scalar output is a loss the model computes itself, its saved tensors in the graph).
fn loss_input(sz: &Sizes, grad: &[bool]) -> Option<ValueId> {
    sz.graph.outputs.iter().copied().find(|&o| grad[o.index()] && sz.numel(o) > 1.0)
}

/// What the loss keeps of `node`'s output `loss_input` until its backward, and the bytes an
/// element it is in: one copy in at least f32, as losses compute in f32 (cross entropy's
/// log-probabilities, the squared error's input); the output itself is not kept.
fn loss_kept_bytes(sz: &Sizes, node: &Node, loss_input: Option<ValueId>) -> Option<(f64, u64)> {
    let o = loss_input.filter(|o| node.outputs.contains(o))?;
    let width = sz.graph.value(o).ty.as_ref().map_or(4, |t| t.dtype.size_bytes().max(4));
    Some((sz.numel(o) * width as f64, width))
}

/// The tensors autograd keeps for this node's backward.
fn saved(sz: &Sizes, node: &Node, grad: &[bool], data: &[bool], batch: f64) -> Saved {
    let graph = sz.graph;
    let mut s = Saved::default();
    let Some(kind) = node.op.kind() else { return s };
    let input = |i: usize| node.inputs.get(i).copied().flatten();
    let rg = |i: usize| input(i).is_some_and(|v| grad[v.index()]);
    let any_rg = node.inputs.iter().flatten().any(|v| grad[v.index()]);
    let output = node.outputs.first().copied();
    // under autocast a matrix product keeps its low-type casts: a copy of its own of each
    // fp32 input (per sample for activations, per microbatch for weights)
    let low = sz.low.filter(|_| kind.autocast_class() == AutocastClass::Low);
    let mut cast: Vec<ValueId> = Vec::new();
    let mut keep = |v: Option<ValueId>| {
        if let (Some(v), Some(low)) = (v, low)
            && sz.dtype(v).is_some_and(|d| d.is_float() && d != low)
        {
            if !cast.contains(&v) {
                cast.push(v);
                let copy = sz.numel(v) * low.size_bytes() as f64;
                if data[v.index()] { s.extra_bytes += copy / batch } else { s.weight_copy_bytes += copy }
            }
            return;
        }
        if let Some(v) = v
            && matches!(graph.value(v).kind, ValueKind::Input | ValueKind::Intermediate)
            && data[v.index()]
            && !s.values.contains(&v)
        {
            s.values.push(v);
        }
    };
    use OpKind::*;
    match kind {
        MatMul | Gemm | Mul => {
            if rg(1) {
                keep(input(0));
            }
            if rg(0) {
                keep(input(1));
            }
        }
        Conv => {
            if rg(1) {
                keep(input(0));
            }
            if rg(0) {
                keep(input(1));
            }
        }
        Div => {
            if rg(0) || rg(1) {
                keep(input(1));
            }
            if rg(1) {
                keep(input(0));
            }
        }
        Pow => {
            if rg(0) {
                keep(input(0));
            }
            if rg(1) {
                keep(input(0));
                keep(input(1));
                keep(output);
            }
        }
        Gelu | Erf | Log | Sin | Cos | Softplus | LeakyRelu | HardSigmoid | HardSwish | Abs | Clip
        | LayerNormalization | RMSNormalization | BatchNormalization | InstanceNormalization | AveragePool => {
            if any_rg {
                keep(input(0));
            }
            // libtorch's rms_norm off CUDA is composite: its product with the scale keeps the
            // normalised input, and its rsqrt one statistic per row (at least f32)
            if kind == RMSNormalization && any_rg && let (Some(o), Some(x)) = (output, input(0)) {
                // the normalised axes: `axis` on
                let width: f64 = sz.dims(x).map_or(1.0, |d| {
                    let from = super::shape_infer::norm_axis(node.attrs.int("axis", -1), d.len()).unwrap_or(d.len().saturating_sub(1));
                    d[from.min(d.len())..].iter().map(|&n| n.max(1) as f64).product()
                });
                let stat = sz.dtype(o).map_or(4, |t| t.size_bytes().max(4)) as f64;
                let copy = sz.bytes(o) + sz.numel(o) / width.max(1.0) * stat;
                s.extra_bytes += copy / batch;
                s.norm_bytes += copy / batch;
            }
        }
        SwiGlu => {
            // the gate and up, and silu(gate) for up's gradient
            if any_rg {
                keep(input(0));
                keep(input(1));
                if let Some(o) = output {
                    s.extra_bytes += sz.bytes(o) / batch;
                }
            }
        }
        ApplyRotary => {
            // x's gradient needs the tables; the tables' need x
            if rg(0) {
                keep(input(1));
                keep(input(2));
            }
            if rg(1) || rg(2) {
                keep(input(0));
            }
        }
        Tanh | Sigmoid | Exp | Sqrt | Relu | Reciprocal | Elu | Softmax | LogSoftmax => {
            if any_rg {
                keep(output);
            }
        }
        LRN | ReduceMax | ReduceMin | ReduceProd | GlobalMaxPool => {
            if any_rg {
                keep(input(0));
                keep(output);
            }
        }
        Max | Min => {
            if any_rg {
                for v in node.inputs.iter().flatten() {
                    keep(Some(*v));
                }
            }
        }
        Where => {
            if any_rg {
                keep(input(0));
            }
        }
        ScaledDotProductAttention if any_rg && !attention_fuses(sz, node) => {
            // libtorch's math path: the two products keep q and kᵀ (scaled copies), v and the
            // s × s probabilities; the output and the mask are not kept
            for i in 0..3 {
                keep(input(i));
            }
            let dv = input(2).and_then(|v| sz.dims(v)).and_then(|d| d.last().copied()).filter(|&d| d > 0);
            let keys = input(2).and_then(|v| sz.dims(v)).and_then(|d| d.get(d.len().wrapping_sub(2)).copied());
            if let (Some(o), Some(dv), Some(keys)) = (output, dv, keys) {
                s.extra_bytes += sz.bytes(o) / dv as f64 * keys as f64 / batch;
            }
        }
        ScaledDotProductAttention => {
            // the fused kernel keeps its inputs, its output and one logsumexp per query row
            // (at least f32), never the s × s probabilities
            if any_rg {
                for i in 0..4 {
                    keep(input(i));
                }
                keep(output);
                let dv = input(2).and_then(|v| sz.dims(v)).and_then(|d| d.last().copied()).filter(|&d| d > 0);
                if let (Some(o), Some(dv)) = (output, dv) {
                    let elem = graph.value(o).ty.as_ref().map_or(4, |t| t.dtype.size_bytes().max(4));
                    s.extra_bytes += sz.numel(o) / dv as f64 * elem as f64 / batch;
                }
            }
        }
        MixtureOfExperts => {
            // the kernel's autograd keeps the routed copies (tokens, gate and up halves, the
            // activation and the gated product, the experts' outputs) besides the router's
            // weights and indices
            if any_rg {
                keep(input(1));
                keep(input(2));
                if let Some(w) = experts_work(sz, node) {
                    s.extra_bytes += w.saved_bytes / batch;
                    s.experts_activation_bytes = w.activation_bytes / batch;
                }
            }
        }
        Gather | GatherElements | GatherND | ScatterND => {
            if rg(0) {
                keep(input(1));
            }
        }
        MaxPool => {
            if any_rg {
                keep(input(0));
                s.extra_bytes += output.map(|o| sz.numel(o)).unwrap_or(0.0) * 8.0 / batch;
            }
        }
        Dropout => {
            if any_rg {
                s.extra_bytes += output.map(|o| sz.numel(o)).unwrap_or(0.0) / batch;
            }
        }
        SoftmaxCrossEntropyLoss => {
            // the log-softmax's output, which the NLL's backward and its own read
            if any_rg && let Some(x) = input(0) {
                s.extra_bytes += sz.bytes(x) / batch;
            }
        }
        _ => {}
    }
    s
}
