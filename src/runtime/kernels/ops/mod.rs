//! ONNX op kernels on tch: one function per `ir::OpKind`, ONNX semantics (broadcasting,
//! attributes in the canonical form the importer writes (no opset differences), integer/bool/fp16/bf16/f64 tensors).

mod args;
mod einsum;
mod elementwise;
pub(crate) mod moe;
mod nn;
mod reduce;
mod resample;
mod scatter;
mod shape;

use tch::Tensor;

pub use crate::ir::AutocastClass;
use crate::ir::{Node, Op, OpKind};

pub(crate) use args::{Args, KResult, axes, axis, bail};
pub use args::{DropoutKey, KernelError, NormStats, OpContext};

/// Whether `kind`'s kernel reads input `i` as host numbers (shapes, axes, sizes, scalars):
/// such an input stays where it is on a GPU run, every other one joins the node's device.
pub fn reads_on_host(kind: OpKind, i: usize) -> bool {
    use OpKind::*;
    match kind {
        ConstantOfShape | Range => true,
        Reshape | Expand | Tile | Unsqueeze | Squeeze | Split | TopK | Trilu | CumSum => i == 1,
        k if k.is_reduction() => i == 1,
        OneHot => i == 1,
        Resize => i >= 1,
        Slice | Pad => i >= 1,
        Dropout => i >= 1,
        _ => false,
    }
}

/// `inputs` with each floating-point tensor whose kind `cast` picks converted to `to`.
fn cast_floats(inputs: &[Option<Tensor>], cast: impl Fn(tch::Kind) -> bool, to: tch::Kind) -> KResult<Vec<Option<Tensor>>> {
    inputs
        .iter()
        .map(|t| match t {
            Some(t) if crate::runtime::kernels::tensor::is_float_kind(t.f_kind()?) && cast(t.f_kind()?) => Ok(Some(t.f_to_kind(to)?)),
            Some(t) => Ok(Some(t.shallow_clone())),
            None => Ok(None),
        })
        .collect()
}

/// True if the runner has a kernel for this op.
pub fn has_kernel(op: &Op) -> bool {
    op.kind().is_some()
}

/// Runs a node whose input `slot` the executor found dead and scratch (`OpKind::in_place_operands`)
/// by writing its result over that input: the same numbers as [`run`] (an elementwise sum in
/// either order is the same sum), one tensor fewer. `None` when the operands do not allow it
/// (the result would be larger, of another type or on another device): run the node as usual.
pub fn run_in_place(node: &Node, inputs: &[Option<Tensor>], slot: usize) -> KResult<Option<Tensor>> {
    let Some(kind) = node.op.kind().filter(|k| k.in_place_operands().contains(&slot)) else { return Ok(None) };
    let (Some(Some(target)), Some(Some(other))) = (inputs.get(slot), inputs.get(1 - slot.min(1))) else { return Ok(None) };
    let (ts, os) = (target.size(), other.size());
    let broadcasts = os.len() <= ts.len() && os.iter().rev().zip(ts.iter().rev()).all(|(&o, &t)| o == t || o == 1);
    if !broadcasts || target.f_kind()? != other.f_kind()? || target.device() != other.device() || (target.is_leaf() && target.requires_grad()) {
        return Ok(None);
    }
    let mut target = target.shallow_clone();
    Ok(Some(match kind {
        OpKind::Add => target.f_add_(other)?,
        OpKind::Sub => target.f_sub_(other)?,
        _ => return Ok(None),
    }))
}

/// Runs one node: `inputs` in node order (`None` for omitted optional inputs); returns one
/// tensor per node output.
pub fn run(node: &Node, inputs: &[Option<Tensor>], ctx: &OpContext) -> KResult<Vec<Tensor>> {
    let Some(kind) = node.op.kind() else {
        bail!("no kernel for op `{}`", node.op);
    };
    let cast: Vec<Option<Tensor>>;
    let inputs = match (ctx.autocast, kind.autocast_class()) {
        (Some(low), AutocastClass::Low) => {
            cast = cast_floats(inputs, |k| k != low, low)?;
            &cast
        }
        (Some(_), AutocastClass::Fp32) => {
            cast = cast_floats(inputs, |k| matches!(k, tch::Kind::Half | tch::Kind::BFloat16), tch::Kind::Float)?;
            &cast
        }
        _ => inputs,
    };
    let a = Args { node, inputs, ctx };
    use OpKind::*;
    let one = |t: KResult<Tensor>| t.map(|t| vec![t]);
    match kind {
        Abs | Neg | Exp | Log | Sqrt | Reciprocal | Tanh | Sigmoid | Relu | Erf | Sin | Cos | Floor
        | Ceil | Round | Sign | Not | IsNaN | IsInf | Softplus | LeakyRelu | Elu | Gelu
        | HardSigmoid | HardSwish | Identity | BitwiseNot => one(elementwise::unary(kind, &a)),
        Cast => one(elementwise::cast(&a)),
        CastLike => one(elementwise::cast_like(&a)),
        Clip => one(elementwise::clip(&a)),
        Add | Sub | Mul | Div | Pow | Mod | Equal | Less | LessOrEqual | Greater | GreaterOrEqual
        | And | Or | Xor | BitwiseAnd | BitwiseOr | BitwiseXor => one(elementwise::binary(kind, &a)),
        Max | Min | Sum | Mean => one(elementwise::variadic(kind, &a)),
        Where => one(elementwise::where_(&a)),
        MatMul => one(nn::matmul(&a)),
        ScaledDotProductAttention => one(nn::scaled_dot_product_attention(&a)),
        MixtureOfExperts => one(moe::mixture_of_experts(&a)),
        Gemm => one(nn::gemm(&a)),
        Conv => one(nn::conv(&a)),
        LayerNormalization => nn::layer_norm(&a),
        RMSNormalization => one(nn::rms_norm(&a)),
        SwiGlu => one(nn::swiglu(&a)),
        ApplyRotary => one(nn::apply_rotary(&a)),
        BatchNormalization => nn::batch_norm(&a),
        InstanceNormalization => one(nn::instance_norm(&a)),
        LRN => one(nn::lrn(&a)),
        MaxPool => nn::max_pool(&a),
        AveragePool => one(nn::avg_pool(&a)),
        GlobalAveragePool | GlobalMaxPool => one(nn::global_pool(kind, &a)),
        Softmax | LogSoftmax => one(nn::softmax(kind, &a)),
        ReduceMean | ReduceSum | ReduceMax | ReduceMin | ReduceProd => one(reduce::reduce(kind, &a)),
        ReduceL1 | ReduceL2 | ReduceLogSumExp | ReduceSumSquare => one(reduce::reduce_norm(kind, &a)),
        LpNormalization => one(reduce::lp_normalization(&a)),
        Einsum => one(einsum::einsum(&a)),
        Resize => one(resample::resize(&a)),
        GridSample => one(resample::grid_sample(&a)),
        Col2Im => one(resample::col2im(&a)),
        ScatterElements => one(scatter::scatter_elements(&a)),
        OneHot => one(scatter::one_hot(&a)),
        BitShift => one(elementwise::bit_shift(&a)),
        ArgMax | ArgMin => one(reduce::arg(kind, &a)),
        CumSum => one(reduce::cumsum(&a)),
        TopK => reduce::top_k(&a),
        Reshape => one(shape::reshape(&a)),
        Transpose => one(shape::transpose(&a)),
        Concat => one(shape::concat(&a)),
        Split => shape::split(&a),
        Slice => one(shape::slice(&a)),
        Gather => one(shape::gather(&a)),
        GatherElements => one(shape::gather_elements(&a)),
        GatherND => one(shape::gather_nd(&a)),
        Unsqueeze => one(shape::unsqueeze(&a)),
        Squeeze => one(shape::squeeze(&a)),
        Expand => one(shape::expand(&a)),
        Shape => one(shape::shape(&a)),
        Size => one(shape::size(&a)),
        ConstantOfShape => one(shape::constant_of_shape(&a)),
        Range => one(shape::range(&a)),
        Flatten => one(shape::flatten(&a)),
        Tile => one(shape::tile(&a)),
        Pad => one(shape::pad(&a)),
        Trilu => one(shape::trilu(&a)),
        ScatterND => one(shape::scatter_nd(&a)),
        Constant => one(shape::constant(&a)),
        Dropout => nn::dropout(&a),
        SoftmaxCrossEntropyLoss | NegativeLogLikelihoodLoss => nn::loss(kind, &a),
    }
}
