//! Layers: contiguous groups of nodes in execution order, the unit of pipeline cuts,
//! with their per-sample figures. Built by `passes::layers`; read by cost and solve.

use std::collections::BTreeMap;
use std::fmt;

use super::{Graph, NodeId, ValueId};

/// What role a layer plays in the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LayerKind {
    /// Token/patch/position embedding at the start.
    Embedding,
    /// A repeated block (transformer layer, residual stage).
    Block,
    /// The output head (final norm, LM head, classifier, loss).
    Head,
    /// Anything else.
    Other,
}

impl LayerKind {
    /// Lower-case name used in tables and JSON.
    pub fn name(self) -> &'static str {
        match self {
            LayerKind::Embedding => "embedding",
            LayerKind::Block => "block",
            LayerKind::Head => "head",
            LayerKind::Other => "other",
        }
    }
}

impl fmt::Display for LayerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Figures of one node, per sample (batch bound to one sample).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NodeFigures {
    /// Forward floating-point operations.
    pub flops: f64,
    /// Elements of floating-point initializers this node is the first to read.
    pub param_elems: u64,
    /// Bytes of those initializers.
    pub param_bytes: u64,
    /// Elements of those held frozen (`passes::params`): no gradient or optimizer state is kept
    /// for them (0, the default, when every parameter is trained).
    pub frozen_elems: u64,
    /// Bytes of the node's outputs.
    pub output_bytes: f64,
    /// Bytes of the tensors this node keeps for its backward pass.
    pub saved_bytes: f64,
    /// Bytes read and written by the forward pass (for roofline costs).
    pub memory_bytes: f64,
    /// The part of `memory_bytes` that is attention scores: the `[.., s, s']` product of two
    /// activations larger than both (Q·Kᵀ) and the elementwise chain on it up to the matmul
    /// that reads it (scale, mask, softmax, then ·V). A fused attention kernel keeps them on
    /// chip (see `cost::ClusterSpec::fused_attention`).
    pub score_bytes: f64,
    /// The part of `saved_bytes` that is attention scores (the softmax output a fused kernel
    /// does not keep: it recomputes the scores in its backward).
    pub score_saved_bytes: f64,
    /// The part of `saved_bytes` a composite RMS normalisation keeps beside its input (the
    /// normalised copy and its per-row statistic), which a fused kernel does not.
    pub norm_saved_bytes: f64,
    /// The part of `saved_bytes` that is a mixture of experts' activation function (its output
    /// and the gated product), which selective recompute rebuilds (Megatron-Core's `moe_act`).
    pub experts_activation_bytes: f64,
    /// The part of `memory_bytes` moved by the node's own memory-bound kernels that run in turn
    /// with its products, not under them (a mixture of experts' permutation, activation
    /// function and unpermutation between its grouped GEMMs): priced after the products.
    pub serial_bytes: f64,
    /// What those kernels' backwards move (the same bytes' gradients, and what they reread).
    pub serial_bwd_bytes: f64,
    /// The matrix products with a weight operand this node runs (a weight matmul: one; routed
    /// experts: each expert's gate-up and down), for the cost model's GEMM-efficiency surface;
    /// unused entries have `share` 0. A sum of figures has none.
    pub gemms: [GemmShape; 2],
}

/// The training loss the runner computes on a graph output (PyTorch's cross entropy, or the
/// squared error), per sample, each copy in at least f32 (autocast, torchtitan and Megatron
/// compute losses in f32): it keeps one copy of its input (the log-probabilities; counted in
/// the producing node's saved bytes) and, in its backward, makes two more beside it (their
/// gradient and the logits'). Those two are a transient of the stage computing the loss.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossFigures {
    /// The node making the loss's input.
    pub node: NodeId,
    /// What the loss keeps until its backward.
    pub kept_bytes: f64,
    /// The bytes an element of those copies takes in these figures.
    pub width: u64,
}

impl LossFigures {
    /// The copies the loss's backward makes beside what it keeps, each as large.
    pub const WORKING_COPIES: f64 = 2.0;
}

/// One matrix product of a node, `rows × k` by `k × n`, per sample.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct GemmShape {
    /// Rows m per sample (the tokens; per expert for routed experts): they grow with the samples.
    pub rows: f64,
    /// Output columns n.
    pub n: f64,
    /// Contracted dim k.
    pub k: f64,
    /// The fraction of the node's FLOPs this product does (0: no product).
    pub share: f64,
}

impl std::ops::AddAssign for NodeFigures {
    fn add_assign(&mut self, o: NodeFigures) {
        self.flops += o.flops;
        self.param_elems += o.param_elems;
        self.param_bytes += o.param_bytes;
        self.frozen_elems += o.frozen_elems;
        self.output_bytes += o.output_bytes;
        self.saved_bytes += o.saved_bytes;
        self.memory_bytes += o.memory_bytes;
        self.score_bytes += o.score_bytes;
        self.score_saved_bytes += o.score_saved_bytes;
        self.norm_saved_bytes += o.norm_saved_bytes;
        self.experts_activation_bytes += o.experts_activation_bytes;
        self.serial_bytes += o.serial_bytes;
        self.serial_bwd_bytes += o.serial_bwd_bytes;
        self.gemms = Default::default();
    }
}

/// A layer: a contiguous run of nodes in execution order.
#[derive(Clone, Debug)]
pub struct Layer {
    /// Position in execution order (0 first).
    pub index: usize,
    /// Module path or a made-up name (`h.3`, `layers.12`, `embedding`).
    pub name: String,
    /// Role.
    pub kind: LayerKind,
    /// Nodes in execution order.
    pub nodes: Vec<NodeId>,
    /// Structural hash, equal for identical blocks (hex).
    pub signature: String,
    /// Floating-point initializers first read in this layer.
    pub params: Vec<ValueId>,
    /// Initializers read here but owned by an earlier layer (tied weights).
    pub shared_params: Vec<ValueId>,
    /// Values read from earlier layers or graph inputs (the layer's input activations).
    pub inputs: Vec<ValueId>,
    /// Values produced here and read by later layers or graph outputs.
    pub outputs: Vec<ValueId>,
    /// Sums of the node figures.
    pub figures: NodeFigures,
    /// Bytes per sample of `inputs` (what checkpointing keeps).
    pub input_bytes: f64,
    /// Bytes per sample of the computed inputs no other layer reads: what offloading this
    /// layer moves to host memory (inputs several layers read stay on the device).
    pub offload_bytes: f64,
    /// Bytes per sample of `outputs` (what a pipeline cut after this layer sends).
    pub output_bytes: f64,
    /// Bytes per sample of the inputs other layers read too (an attention mask, rotary
    /// tables): one tensor per stage however many of its layers read it.
    pub shared_input_bytes: f64,
    /// Of `figures.saved_bytes`, the bytes of those shared inputs.
    pub shared_saved_bytes: f64,
    /// Of `figures.saved_bytes`, the outputs selective recompute rebuilds instead of keeping,
    /// and the experts' activations inside its mixtures of experts.
    pub selective_bytes: f64,
    /// The nodes making them (`passes::layers::selectively_recomputed`, then the mixtures of
    /// experts).
    pub selective_nodes: Vec<NodeId>,
    /// What torchtitan's per-op policy ([`super::SelectivePolicy::Ops`]) rebuilds and keeps.
    pub op_selective: OpSelective,
    /// Of `figures.saved_bytes`, what that policy rebuilds instead of keeping (a SwiGLU's
    /// silu(gate) inside it too).
    pub op_freed_bytes: f64,
    /// What that policy keeps that no backward reads: the kept ops' outputs and what the
    /// rebuilt nodes read beyond the layer's inputs and the saved values.
    pub op_held_bytes: f64,
    /// Of `figures.saved_bytes`, what the training loss keeps, in the layer making its input
    /// ([`LossFigures::kept_bytes`]), else 0.
    pub loss_kept_bytes: f64,
}

/// A layer's nodes under torchtitan's per-op selective recompute (`passes::layers::op_policy`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OpSelective {
    /// Nodes whose outputs are freed after the forward and rebuilt, in execution order, before
    /// the backward.
    pub rebuilt: Vec<NodeId>,
    /// Nodes the policy keeps the outputs of (attention, every other weight product) whether
    /// or not a backward reads them.
    pub kept: Vec<NodeId>,
}

/// The byte figures of a layer in one run's element types, per sample unless said: a
/// [`Layer`]'s own fields are them in the graph's types ([`Layer::bytes`]); `passes::layers::
/// layer_bytes` gives them at any run's (`solve::layer_cost::training_bytes`: a mixed-precision run's).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LayerBytes {
    /// What the layer keeps for its backward (`figures.saved_bytes`).
    pub saved_bytes: f64,
    /// The attention scores among them (`figures.score_saved_bytes`).
    pub score_saved_bytes: f64,
    /// Composite normalisations' copies among them (`figures.norm_saved_bytes`).
    pub norm_saved_bytes: f64,
    /// Its input activations (`input_bytes`).
    pub input_bytes: f64,
    /// What offloading it moves (`offload_bytes`).
    pub offload_bytes: f64,
    /// What a pipeline cut after it sends (`output_bytes`).
    pub output_bytes: f64,
    /// Its inputs other layers read too (`shared_input_bytes`).
    pub shared_input_bytes: f64,
    /// Of `saved_bytes`, those shared inputs (`shared_saved_bytes`).
    pub shared_saved_bytes: f64,
    /// Of `saved_bytes`, the outputs selective recompute rebuilds instead of keeping, and the
    /// experts' activations (`selective_bytes`).
    pub selective_bytes: f64,
    /// Of `saved_bytes`, what torchtitan's per-op policy rebuilds (`op_freed_bytes`).
    pub op_freed_bytes: f64,
    /// What that policy keeps beyond `saved_bytes` (`op_held_bytes`).
    pub op_held_bytes: f64,
    /// Of `saved_bytes`, what the training loss keeps (`loss_kept_bytes`).
    pub loss_kept_bytes: f64,
    /// Per microbatch, whatever its size: the low-type copies of weights its matrix products
    /// keep under autocast (0 in one type throughout).
    pub weight_copy_bytes: f64,
}

impl LayerBytes {
    /// Every per-sample figure times `factor` (a graph-to-training byte ratio); the per
    /// microbatch weight copies too.
    pub fn scaled(&self, factor: f64) -> LayerBytes {
        LayerBytes {
            saved_bytes: self.saved_bytes * factor,
            score_saved_bytes: self.score_saved_bytes * factor,
            norm_saved_bytes: self.norm_saved_bytes * factor,
            input_bytes: self.input_bytes * factor,
            offload_bytes: self.offload_bytes * factor,
            output_bytes: self.output_bytes * factor,
            shared_input_bytes: self.shared_input_bytes * factor,
            shared_saved_bytes: self.shared_saved_bytes * factor,
            selective_bytes: self.selective_bytes * factor,
            op_freed_bytes: self.op_freed_bytes * factor,
            op_held_bytes: self.op_held_bytes * factor,
            loss_kept_bytes: self.loss_kept_bytes * factor,
            weight_copy_bytes: self.weight_copy_bytes * factor,
        }
    }
}

impl Layer {
    /// The layer's byte figures in the graph's own types.
    pub fn bytes(&self) -> LayerBytes {
        LayerBytes {
            saved_bytes: self.figures.saved_bytes,
            score_saved_bytes: self.figures.score_saved_bytes,
            norm_saved_bytes: self.figures.norm_saved_bytes,
            input_bytes: self.input_bytes,
            offload_bytes: self.offload_bytes,
            output_bytes: self.output_bytes,
            shared_input_bytes: self.shared_input_bytes,
            shared_saved_bytes: self.shared_saved_bytes,
            selective_bytes: self.selective_bytes,
            op_freed_bytes: self.op_freed_bytes,
            op_held_bytes: self.op_held_bytes,
            loss_kept_bytes: self.loss_kept_bytes,
            weight_copy_bytes: 0.0,
        }
    }
}

/// How symbolic dims were bound and how figures relate to samples.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DimBindings {
    /// Symbol → size used for shape inference.
    pub values: BTreeMap<String, i64>,
    /// The batch symbol, if the batch dim is symbolic.
    pub batch_symbol: Option<String>,
    /// Batch size the shapes were inferred at (1 when symbolic; the fixed size otherwise).
    /// Figures are divided by it to get per-sample numbers.
    pub graph_batch: i64,
    /// Whether the graph's batch is fixed (microbatches must then be exactly that size, unless
    /// `batch_rebinds`).
    pub fixed_batch: bool,
    /// Whether a fixed batch is proven rebindable to any microbatch size
    /// (`passes::rebatch`; codegen then rewrites the graph for the plan's microbatches).
    pub batch_rebinds: bool,
    /// A symbolic batch the graph reads in groups of this many rows (MusicGen's codebooks:
    /// `reshape(-1, codebooks, seq)`), found when one row does not infer: a microbatch must
    /// hold a multiple of it. 0 or 1: any number of rows.
    pub batch_group: i64,
}

/// A graph with inferred shapes, grouped into layers, with figures.
#[derive(Clone, Debug)]
pub struct LayeredGraph {
    /// The graph (shapes inferred, shape arithmetic folded, dead nodes removed).
    pub graph: Graph,
    /// Layers in execution order.
    pub layers: Vec<Layer>,
    /// Figures per node, indexed by `NodeId::index()`.
    pub node_figures: Vec<NodeFigures>,
    /// Dim bindings used.
    pub dims: DimBindings,
    /// Elements of floating-point initializers, each counted once.
    pub params: u64,
    /// Forward FLOPs per sample.
    pub flops_per_sample: f64,
    /// The chains analysis fused into one op (`passes::fuse`), in the order applied.
    pub fused: Vec<super::Fusion>,
    /// The training loss on a graph output, if the model does not compute its own.
    pub loss: Option<LossFigures>,
}

impl LayeredGraph {
    /// Figures of a node (zero if out of range).
    pub fn node_figures(&self, id: NodeId) -> NodeFigures {
        self.node_figures.get(id.index()).copied().unwrap_or_default()
    }
}
