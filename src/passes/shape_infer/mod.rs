//! Static shape inference: binds symbolic dims, then gives every value a concrete type,
//! evaluating small integer tensors (shape arithmetic) on the way. One file per op family
//! (as `split/` and `runtime/ops/`), each listing its ops; [`infer_node`] dispatches to them.
//! Everything from the file is checked before it is used: axes against the rank they index,
//! sizes for overflow, and every value's dims against [`MAX_RANK`] and [`MAX_ELEMS`], so a
//! damaged model is refused with the node and op, never a panic.

mod attention;
mod bind;
mod constant;
mod context;
pub(crate) use context::norm_axis;
mod einsum;
mod elementwise;
mod index;
mod matmul;
mod moe;
mod nn;
mod reduce;
mod resample;
mod scatter;

pub use einsum::{einsum_contracted, einsum_shape};
pub use reduce::reduced_axes;
pub use resample::{ResizeTarget, resize_target};
mod shape;

use std::collections::BTreeMap;

pub use context::{MAX_ELEMS, MAX_EVAL_ELEMS, MAX_RANK, ShapeInfo, Ty};
use context::{Ctx, Outs, check_dims};

pub use bind::bind_dims;
use bind::resolve;
pub use elementwise::broadcast;
pub use matmul::matmul_shape;
#[cfg(test)]
use reduce::reduce_ints;

use super::PassError;
use crate::ir::{DType, DimBindings, Graph, Op, OpKind, Shape, TensorType, ValueId, ValueKind};
use super::AnalyzeOptions;
#[cfg(test)]
use crate::ir::Dim;

/// Most rows a batch group may hold ([`grouped_batch`]).
pub const MAX_BATCH_GROUP: i64 = 32;

/// Where shapes do not infer at one row of a symbolic batch the user left unbound: the
/// smallest batch (up to [`MAX_BATCH_GROUP`]) at which they do, bound in `dims` as the graph's
/// batch and its row group, with the inferred shapes. `None` when none does (the first error
/// stands). A model that folds rows into groups (codebooks, a fixed number of crops) plans
/// per row with microbatches a multiple of the group.
pub fn grouped_batch(graph: &mut Graph, dims: &mut DimBindings, opts: &AnalyzeOptions) -> Option<ShapeInfo> {
    let sym = dims.batch_symbol.clone().filter(|s| !opts.dims.contains_key(s) && !dims.fixed_batch)?;
    for rows in 2..=MAX_BATCH_GROUP {
        let mut tried = dims.clone();
        tried.values.insert(sym.clone(), rows);
        if infer(graph, &tried.values, false).is_ok()
            && let Ok(info) = infer_shapes(graph, &tried)
        {
            tracing::debug!(rows, "the batch infers in groups of rows");
            *dims = DimBindings { graph_batch: rows, batch_group: rows, ..tried };
            return Some(info);
        }
    }
    None
}

/// Infers every value's type under `dims`, writes the types of intermediates into the graph
/// and returns them with the evaluated small integer tensors.
pub fn infer_shapes(graph: &mut Graph, dims: &DimBindings) -> Result<ShapeInfo, PassError> {
    let info = infer(graph, &dims.values, true)?;
    for v in graph.value_ids().collect::<Vec<_>>() {
        let val = graph.value(v);
        if val.kind != ValueKind::Intermediate || val.producer.is_none() {
            continue;
        }
        let inferred = info.types[v.index()].as_ref().map(|t| TensorType {
            dtype: t.dtype,
            shape: t.shape.as_ref().map(|s| Shape::from_known(s)),
        });
        if let (Some(declared), Some(inf)) = (&val.ty, &inferred)
            && let (Some(ds), Some(is)) = (&declared.shape, &inf.shape)
        {
            let resolved = resolve(ds, &dims.values);
            let agrees = resolved.as_ref().is_none_or(|r| r == &is.known().unwrap_or_default());
            if !agrees || declared.dtype != inf.dtype {
                tracing::warn!(value = %val.name, declared = %declared, inferred = %inf, "declared value_info disagrees with inferred type; using the inferred one");
            }
        }
        if inferred.is_some() {
            graph.value_mut(v).ty = inferred;
        }
    }
    Ok(info)
}

/// Infers types without touching the graph. `warn` logs unknown types.
pub fn infer(graph: &Graph, dims: &BTreeMap<String, i64>, warn: bool) -> Result<ShapeInfo, PassError> {
    let n = graph.value_count();
    let mut info = ShapeInfo { types: vec![None; n], ints: vec![None; n] };
    for v in graph.value_ids() {
        let val = graph.value(v);
        let declared = || {
            val.ty.as_ref().map(|ty| Ty { dtype: ty.dtype, shape: ty.shape.as_ref().and_then(|s| resolve(s, dims)) })
        };
        let ty = match val.kind {
            ValueKind::Initializer | ValueKind::Constant => match &val.data {
                Some(t) => {
                    if (t.dtype.is_int() || t.dtype == DType::Bool) && t.numel() as usize <= MAX_EVAL_ELEMS {
                        info.ints[v.index()] = t.to_i64_vec();
                    }
                    Some(Ty { dtype: t.dtype, shape: Some(t.dims.clone()) })
                }
                None => declared(),
            },
            ValueKind::Input => declared(),
            ValueKind::Intermediate => None,
        };
        if let Some(s) = ty.as_ref().and_then(|t| t.shape.as_deref()) {
            check_dims(s).map_err(|msg| PassError::ValueShape { value: val.name.clone(), msg })?;
        }
        info.types[v.index()] = ty;
    }
    let order = graph.topo_order()?;
    for id in order {
        let node = graph.node(id);
        let cx = Ctx { graph, node, info: &info };
        let outs = infer_node(&cx, dims)
            .and_then(|outs| {
                for ((t, _), &o) in outs.iter().zip(&node.outputs) {
                    if let Some(s) = t.as_ref().and_then(|t| t.shape.as_deref()) {
                        check_dims(s).map_err(|msg| format!("output `{}`: {msg}", graph.value(o).name))?;
                    }
                }
                Ok(outs)
            })
            .map_err(|msg| {
                let module = module_near(graph, id);
                let msg = match module {
                    Some(m) => format!("in module `{m}`, {msg}"),
                    None => msg,
                };
                PassError::Shape { node: node.name.clone(), op: node.op.to_string(), msg }
            })?;
        for (i, &o) in node.outputs.iter().enumerate() {
            let (ty, ints) = outs.get(i).cloned().unwrap_or((None, None));
            if ty.is_none() && warn {
                tracing::warn!(node = %node.name, op = %node.op, value = %graph.value(o).name, "output type unknown; figures of its consumers will be incomplete");
            }
            let ints = ints.filter(|v| v.len() <= MAX_EVAL_ELEMS);
            info.types[o.index()] = ty;
            info.ints[o.index()] = ints;
        }
    }
    Ok(info)
}

/// The outputs of one node, by op family.
fn infer_node(cx: &Ctx, dims: &BTreeMap<String, i64>) -> Outs {
    let kind = match &cx.node.op {
        Op::Known(k) => *k,
        // a collective's output is typed where codegen inserts it
        Op::Collective { .. } | Op::Placeholder { .. } => {
            let declared = |o: &ValueId| {
                let t = cx.graph.value(*o).ty.as_ref();
                let t = t.map(|t| Ty { dtype: t.dtype, shape: t.shape.as_ref().and_then(|s| resolve(s, dims)) });
                (t, None)
            };
            return Ok(cx.node.outputs.iter().map(declared).collect());
        }
    };
    use OpKind::*;
    match kind {
        Identity => elementwise::identity(cx),
        Abs | Neg | Sign | Not | IsNaN | IsInf | Exp | Log | Sqrt | Reciprocal | Tanh | Sigmoid | Relu | Erf
        | Sin | Cos | Floor | Ceil | Round | Softplus | LeakyRelu | Elu | Gelu | HardSigmoid | HardSwish
        | Clip => elementwise::unary(cx, kind),
        Cast | CastLike => elementwise::cast(cx, kind),
        Add | Sub | Mul | Div | Mod | Pow | Max | Min | Sum | Mean | SwiGlu => elementwise::arithmetic(cx, kind),
        ApplyRotary => elementwise::apply_rotary(cx),
        Equal | Less | LessOrEqual | Greater | GreaterOrEqual | And | Or | Xor => elementwise::compare(cx, kind),
        Where => elementwise::where_(cx),
        MatMul => matmul::matmul(cx),
        Gemm => matmul::gemm(cx),
        ScaledDotProductAttention => attention::scaled_dot_product_attention(cx),
        MixtureOfExperts => moe::mixture_of_experts(cx),
        Conv => nn::conv(cx),
        MaxPool | AveragePool => nn::pool(cx),
        GlobalAveragePool | GlobalMaxPool => nn::global_pool(cx),
        LayerNormalization => nn::layer_norm(cx),
        BatchNormalization => nn::batch_norm(cx),
        InstanceNormalization | LRN | RMSNormalization | Softmax | LogSoftmax => nn::same_as_input(cx),
        Dropout => nn::dropout(cx),
        SoftmaxCrossEntropyLoss | NegativeLogLikelihoodLoss => nn::loss(cx),
        ReduceMean | ReduceSum | ReduceMax | ReduceMin | ReduceProd => reduce::reduce(cx, kind),
        ReduceL1 | ReduceL2 | ReduceLogSumExp | ReduceSumSquare => reduce::reduce(cx, kind),
        LpNormalization => nn::same_as_input(cx),
        Einsum => einsum::einsum(cx),
        Resize => resample::resize(cx),
        GridSample => resample::grid_sample(cx),
        Col2Im => resample::col2im(cx),
        ScatterElements => scatter::scatter_elements(cx),
        OneHot => scatter::one_hot(cx),
        BitShift | BitwiseAnd | BitwiseOr | BitwiseXor => elementwise::arithmetic(cx, kind),
        BitwiseNot => elementwise::bitwise_not(cx),
        ArgMax | ArgMin => reduce::arg(cx),
        TopK => reduce::top_k(cx),
        CumSum => reduce::cumsum(cx),
        Shape => shape::shape(cx),
        Size => shape::size(cx),
        Reshape => shape::reshape(cx),
        Flatten => shape::flatten(cx),
        Transpose => shape::transpose(cx),
        Unsqueeze => shape::unsqueeze(cx),
        Squeeze => shape::squeeze(cx),
        Expand => shape::expand(cx),
        Tile => shape::tile(cx),
        Trilu => shape::trilu(cx),
        Concat => index::concat(cx),
        Split => index::split(cx),
        Slice => index::slice(cx),
        Gather => index::gather(cx),
        GatherElements => index::gather_elements(cx),
        GatherND => index::gather_nd(cx),
        ScatterND => index::scatter_nd(cx),
        Pad => index::pad(cx),
        Constant => constant::constant(cx),
        ConstantOfShape => constant::constant_of_shape(cx),
        Range => constant::range(cx),
    }
}

/// The module that made node `id` (its namespace), or, for a node the exporter's optimiser made
/// without one, the module of the nearest node before or after it that has one.
fn module_near(graph: &Graph, id: crate::ir::NodeId) -> Option<String> {
    use crate::passes::layers::innermost_module;
    let of = |n: crate::ir::NodeId| graph.node(n).namespace.as_deref().and_then(innermost_module);
    let node = graph.node(id);
    of(id)
        .or_else(|| node.inputs.iter().flatten().filter_map(|&v| graph.value(v).producer).find_map(of))
        .or_else(|| graph.node_ids().filter(|&n| graph.node(n).inputs.iter().flatten().any(|v| node.outputs.contains(v))).find_map(of))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Attr, Tensor};
    use crate::passes::testutil::Builder;

    fn shape_of(g: &Graph, v: ValueId) -> Vec<i64> {
        g.value(v).ty.as_ref().unwrap().shape.as_ref().unwrap().known().unwrap()
    }

    fn run(b: &mut Builder, opts: &AnalyzeOptions) -> ShapeInfo {
        let dims = bind_dims(&b.g, opts).unwrap();
        infer_shapes(&mut b.g, &dims).unwrap()
    }

    #[test]
    fn broadcasting_and_matmul_follow_numpy() {
        assert_eq!(broadcast(&[2, 1, 4], &[3, 1]).unwrap(), vec![2, 3, 4]);
        assert!(broadcast(&[2, 3], &[4, 3]).is_err());
        assert_eq!(matmul_shape(&[5, 1, 2, 3], &[4, 3, 7]).unwrap(), vec![5, 4, 2, 7]);
        assert_eq!(matmul_shape(&[3], &[3, 7]).unwrap(), vec![7]);
        assert_eq!(matmul_shape(&[2, 3], &[3]).unwrap(), vec![2]);
        assert!(matmul_shape(&[2, 3], &[4, 5]).is_err());
    }

    #[test]
    fn a_cross_entropy_loss_is_a_scalar_or_the_labels_shape_and_refuses_labels_that_do_not_fit() {
        let loss = |labels: &[&str], reduction: &str| {
            let mut b = Builder::new();
            let x = b.input("scores", DType::F32, &["2", "5", "3"]);
            let y = b.input("labels", DType::I64, labels);
            let out = b.node_n(OpKind::SoftmaxCrossEntropyLoss, &[Some(x), Some(y)], &[("reduction", Attr::Str(reduction.into()))], 2);
            b.output(out[0]);
            let dims = bind_dims(&b.g, &AnalyzeOptions::default()).unwrap();
            infer_shapes(&mut b.g, &dims).map(|_| (shape_of(&b.g, out[0]), shape_of(&b.g, out[1])))
        };
        assert_eq!(loss(&["2", "3"], "mean").unwrap(), (vec![], vec![2, 5, 3]));
        assert_eq!(loss(&["2", "3"], "none").unwrap(), (vec![2, 3], vec![2, 5, 3]));
        let wrong = loss(&["2", "5"], "sum").unwrap_err().to_string();
        assert!(wrong.contains("labels") && wrong.contains("axis 1"), "{wrong}");
        let unknown = loss(&["2", "3"], "max").unwrap_err().to_string();
        assert!(unknown.contains("`reduction`") && unknown.contains("`max`"), "{unknown}");
    }

    #[test]
    fn reshape_copies_zeros_and_infers_minus_one() {
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["batch", "6", "4"]);
        let t = b.ints(&[0, -1, 2]);
        let y = b.node(OpKind::Reshape, &[x, t], &[]);
        b.output(y);
        run(&mut b, &AnalyzeOptions::default());
        assert_eq!(shape_of(&b.g, y), vec![1, 12, 2]);
    }

    #[test]
    fn shape_arithmetic_over_symbolic_dims_resolves_once_they_are_bound() {
        // tf2onnx's flatten: Reshape(x, Concat([-1], ReduceProd(Gather(Shape(x), [1, 2]))))
        // over `unk__` dims that only --seq-len binds.
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["unk__1", "unk__2", "8"]);
        let shape = b.node(OpKind::Shape, &[x], &[]);
        let tail = b.ints(&[1, 2]);
        let dims = b.node(OpKind::Gather, &[shape, tail], &[]);
        let prod = b.node(OpKind::ReduceProd, &[dims], &[("keepdims", Attr::Int(1))]);
        let minus_one = b.ints(&[-1]);
        let target = b.node(OpKind::Concat, &[minus_one, prod], &[("axis", Attr::Int(0))]);
        let y = b.node(OpKind::Reshape, &[x, target], &[]);
        let m = b.node(OpKind::ReduceMax, &[dims], &[("keepdims", Attr::Int(0))]);
        b.output(y);
        b.output(m);
        let opts = AnalyzeOptions { seq_len: Some(5), ..Default::default() };
        let info = run(&mut b, &opts);
        assert_eq!(info.ints(prod), Some(&[40][..]));
        assert_eq!(info.ints(m), Some(&[8][..]));
        assert_eq!(shape_of(&b.g, y), vec![1, 40]);
    }

    #[test]
    fn integer_reductions_fold_over_the_given_axes() {
        // [[1, 2, 3], [4, 5, 6]]
        let v = [1, 2, 3, 4, 5, 6];
        assert_eq!(reduce_ints(&[2, 3], &v, &[0], i64::wrapping_add), Some(vec![5, 7, 9]));
        assert_eq!(reduce_ints(&[2, 3], &v, &[1], i64::wrapping_mul), Some(vec![6, 120]));
        assert_eq!(reduce_ints(&[2, 3], &v, &[0, 1], i64::max), Some(vec![6]));
        assert_eq!(reduce_ints(&[0], &[], &[0], i64::min), None);
    }

    #[test]
    fn axes_come_from_inputs() {
        let mut b13 = Builder::new();
        let x = b13.input("x", DType::F32, &["3", "4"]);
        let ax = b13.ints(&[0, -1]);
        let y = b13.node(OpKind::Unsqueeze, &[x, ax], &[]);
        let z = b13.node(OpKind::Squeeze, &[y], &[]);
        b13.output(z);
        run(&mut b13, &AnalyzeOptions::default());
        assert_eq!(shape_of(&b13.g, y), vec![1, 3, 4, 1]);
        assert_eq!(shape_of(&b13.g, z), vec![3, 4]);
    }

    #[test]
    fn split_by_sizes_and_by_count() {
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["2", "10"]);
        let sizes = b.ints(&[3, 7]);
        let p = b.node_n(OpKind::Split, &[Some(x), Some(sizes)], &[("axis", Attr::Int(1))], 2);
        let q = b.node_n(OpKind::Split, &[Some(x)], &[("axis", Attr::Int(1)), ("num_outputs", Attr::Int(3))], 3);
        for &v in p.iter().chain(&q) {
            b.output(v);
        }
        run(&mut b, &AnalyzeOptions::default());
        assert_eq!(shape_of(&b.g, p[1]), vec![2, 7]);
        // ONNX 18: ceil(10/3) = 4, 4, 2.
        assert_eq!(q.iter().map(|&v| shape_of(&b.g, v)[1]).collect::<Vec<_>>(), vec![4, 4, 2]);
    }

    #[test]
    fn slice_clamps_like_numpy() {
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["10", "8"]);
        let st = b.ints(&[-3, 100]);
        let en = b.ints(&[i64::MAX, 0]);
        let ax = b.ints(&[0, 1]);
        let sp = b.ints(&[1, -2]);
        let y = b.node(OpKind::Slice, &[x, st, en, ax, sp], &[]);
        b.output(y);
        run(&mut b, &AnalyzeOptions::default());
        // rows 7..10; columns 7,5,3,1
        assert_eq!(shape_of(&b.g, y), vec![3, 4]);
    }

    #[test]
    fn conv_and_pool_output_sizes() {
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["batch", "3", "224", "224"]);
        let w = b.param("w", DType::F32, &[64, 3, 7, 7]);
        let c = b.node(
            OpKind::Conv,
            &[x, w],
            &[("strides", Attr::Ints(vec![2, 2])), ("pads", Attr::Ints(vec![3, 3, 3, 3]))],
        );
        let p = b.node(
            OpKind::MaxPool,
            &[c],
            &[("kernel_shape", Attr::Ints(vec![3, 3])), ("strides", Attr::Ints(vec![2, 2])), ("pads", Attr::Ints(vec![1, 1, 1, 1]))],
        );
        let g = b.node(OpKind::GlobalAveragePool, &[p], &[]);
        b.output(g);
        run(&mut b, &AnalyzeOptions::default());
        assert_eq!(shape_of(&b.g, c), vec![1, 64, 112, 112]);
        assert_eq!(shape_of(&b.g, p), vec![1, 64, 56, 56]);
        assert_eq!(shape_of(&b.g, g), vec![1, 64, 1, 1]);
    }

    #[test]
    fn col2im_folds_blocks_into_the_image_and_refuses_what_does_not_fold() {
        // [N, C·2·3, L] with blocks 2 × 3, stride 2 × 1, pads 1 at the top and bottom of a
        // 5 × 6 image: (5 + 2 − 2) / 2 + 1 = 3 rows × (6 − 3) + 1 = 4 columns of positions
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["2", "24", "12"]);
        let (image, block) = (b.ints(&[5, 6]), b.ints(&[2, 3]));
        let y = b.node(OpKind::Col2Im, &[x, image, block], &[("strides", Attr::Ints(vec![2, 1])), ("pads", Attr::Ints(vec![1, 0, 1, 0]))]);
        b.output(y);
        run(&mut b, &AnalyzeOptions::default());
        assert_eq!(shape_of(&b.g, y), vec![2, 4, 5, 6]);
        refused("3-D Col2Im", "only 2-D images", |b| {
            let x = b.input("x", DType::F32, &["1", "8", "8"]);
            let (image, block) = (b.ints(&[3, 3, 3]), b.ints(&[2, 2, 2]));
            b.node(OpKind::Col2Im, &[x, image, block], &[])
        });
        refused("Col2Im whose positions do not match", "is not [N, C·4, 4]", |b| {
            let x = b.input("x", DType::F32, &["1", "8", "5"]);
            let (image, block) = (b.ints(&[3, 3]), b.ints(&[2, 2]));
            b.node(OpKind::Col2Im, &[x, image, block], &[])
        });
    }

    #[test]
    fn shape_arithmetic_is_evaluated() {
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["batch", "seq", "8"]);
        let s = b.node(OpKind::Shape, &[x], &[]);
        let i = b.constant(Tensor::from_i64(vec![], &[1]));
        let seq = b.node(OpKind::Gather, &[s, i], &[]);
        let zero = b.constant(Tensor::from_i64(vec![], &[0]));
        let one = b.constant(Tensor::from_i64(vec![], &[1]));
        let r = b.node(OpKind::Range, &[zero, seq, one], &[]);
        let shp = b.ints(&[2, 3]);
        let k = b.node(OpKind::ConstantOfShape, &[shp], &[("value", Attr::Tensor(Tensor::from_i64(vec![1], &[7])))]);
        b.output(r);
        b.output(k);
        let info = run(&mut b, &AnalyzeOptions { seq_len: Some(5), ..Default::default() });
        assert_eq!(info.ints(s), Some(&[1, 5, 8][..]));
        assert_eq!(info.ints(r), Some(&[0, 1, 2, 3, 4][..]));
        assert_eq!(info.ints(k), Some(&[7; 6][..]));
        assert_eq!(shape_of(&b.g, r), vec![5]);
    }

    #[test]
    fn placeholder_uses_declared_type_or_stays_unknown() {
        use crate::ir::{Attrs, Node, Op};
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["2"]);
        let ty = TensorType { dtype: DType::F16, shape: Some(Shape(vec![Dim::Sym("batch".into())])) };
        let y = b.g.add_value("y", ValueKind::Intermediate, Some(ty), None).unwrap();
        let z = b.g.add_value("z", ValueKind::Intermediate, None, None).unwrap();
        b.g.add_node(Node {
            name: "custom".into(),
            op: Op::Placeholder { op_type: "FancyOp".into(), domain: "com.x".into() },
            attrs: Attrs::default(),
            inputs: vec![Some(x)],
            outputs: vec![y, z],
            namespace: None,
            order: 0,
        })
        .unwrap();
        let w = b.node(OpKind::Relu, &[z], &[]);
        b.output(y);
        b.output(w);
        let dims = DimBindings { values: [("batch".to_string(), 3)].into(), graph_batch: 1, ..Default::default() };
        let info = infer_shapes(&mut b.g, &dims).unwrap();
        assert_eq!(info.types[y.index()], Some(Ty { dtype: DType::F16, shape: Some(vec![3]) }));
        assert_eq!(info.types[w.index()], None);
    }

    #[test]
    fn a_batch_read_in_groups_of_rows_binds_the_smallest_group() {
        // MusicGen's decoder: `input_ids.reshape(-1, codebooks, seq)` with 4 codebooks
        let graph = |rows: i64| {
            let mut b = Builder::new();
            let x = b.input("x", DType::F32, &["batch", "8"]);
            let to = b.ints(&[-1, rows, 8]);
            let y = b.node(OpKind::Reshape, &[x, to], &[]);
            b.output(y);
            b
        };
        let mut b = graph(4);
        let opts = AnalyzeOptions::default();
        let mut dims = bind_dims(&b.g, &opts).unwrap();
        assert!(infer_shapes(&mut b.g, &dims).is_err(), "one row does not reshape");
        let info = grouped_batch(&mut b.g, &mut dims, &opts).unwrap();
        assert_eq!((dims.graph_batch, dims.batch_group), (4, 4));
        let y = b.g.outputs[0];
        assert_eq!(info.types[y.index()].as_ref().and_then(|t| t.shape.clone()), Some(vec![1, 4, 8]));
        // a batch the user binds is theirs: no group is guessed
        let mut b = graph(4);
        let opts = AnalyzeOptions { dims: [("batch".to_string(), 2)].into(), ..Default::default() };
        let mut dims = bind_dims(&b.g, &opts).unwrap();
        assert!(grouped_batch(&mut b.g, &mut dims, &opts).is_none());
        // beyond the largest group the first error stands
        let mut b = graph(MAX_BATCH_GROUP + 1);
        let opts = AnalyzeOptions::default();
        let mut dims = bind_dims(&b.g, &opts).unwrap();
        assert!(grouped_batch(&mut b.g, &mut dims, &opts).is_none());
        assert_eq!(dims.batch_group, 0);
    }

    /// A graph whose last node is `kind` over `inputs` (built by `make`) must be refused at
    /// that node, naming it and its op, with `phrase` in the message: never a panic.
    fn refused(what: &str, phrase: &str, make: impl FnOnce(&mut Builder) -> ValueId) {
        let mut b = Builder::new();
        let y = make(&mut b);
        b.output(y);
        let dims = bind_dims(&b.g, &AnalyzeOptions::default()).unwrap();
        let last = b.g.node(b.g.value(y).producer.unwrap()).name.clone();
        match infer(&b.g, &dims.values, false) {
            Err(PassError::Shape { node, op, msg }) => {
                assert_eq!(node, last, "{what}");
                assert!(!op.is_empty());
                assert!(msg.contains(phrase), "{what}: `{phrase}` not in `{msg}`");
            }
            other => panic!("{what}: expected a shape error at `{last}`, got {other:?}"),
        }
    }

    #[test]
    fn damaged_graphs_are_refused_at_the_node_never_panicking() {
        let scalar = |b: &mut Builder, v: i64| b.constant(Tensor::from_i64(vec![], &[v]));
        let axis = |a: i64| ("axis", Attr::Int(a));
        // tf2onnx's ReduceProd with keepdims flipped hands Concat a scalar
        refused("scalar into Concat", "scalar (rank 0)", |b| {
            let m = b.ints(&[-1]);
            let s = scalar(b, 40);
            b.node(OpKind::Concat, &[s, m], &[axis(0)])
        });
        refused("scalar into Split", "out of range for rank 0", |b| {
            let s = scalar(b, 4);
            b.node(OpKind::Split, &[s], &[axis(0)])
        });
        // sizes counted from the data (tokens per routed expert, JetMoE): named as such
        refused("split sizes from the data", "computed from the values of the graph's inputs", |b| {
            let (x, counts) = (b.input("x", DType::F32, &["8", "4"]), b.input("counts", DType::I64, &["2"]));
            b.node_n(OpKind::Split, &[Some(x), Some(counts)], &[axis(0)], 2)[0]
        });
        refused("scalar into Gather", "out of range for rank 0", |b| {
            let (s, i) = (scalar(b, 4), b.ints(&[0]));
            b.node(OpKind::Gather, &[s, i], &[axis(0)])
        });
        refused("axis past the rank", "axis 5 is out of range", |b| {
            let x = b.input("x", DType::F32, &["2", "3"]);
            let i = b.ints(&[0]);
            b.node(OpKind::Gather, &[x, i], &[axis(5)])
        });
        refused("Pad axes of a scalar", "out of range for rank 0", |b| {
            let s = scalar(b, 4);
            let (p, v, ax) = (b.ints(&[1, 1]), scalar(b, 0), b.ints(&[0]));
            b.node(OpKind::Pad, &[s, p, v, ax], &[])
        });
        refused("Concat past every device", "more than", |b| {
            let x = b.input("x", DType::F32, &["1"]);
            let shape = b.ints(&[1 << 47]);
            let big = b.node(OpKind::Expand, &[x, shape], &[]);
            let mut ins = vec![big; 300];
            ins.push(big);
            b.node(OpKind::Concat, &ins, &[axis(0)])
        });
        refused("Tile overflowing", "overflow", |b| {
            let x = b.input("x", DType::F32, &["3"]);
            let r = b.ints(&[i64::MAX / 2]);
            b.node(OpKind::Tile, &[x, r], &[])
        });
        refused("Tile by a negative count", "negative count", |b| {
            let x = b.input("x", DType::F32, &["3"]);
            let r = b.ints(&[-2]);
            b.node(OpKind::Tile, &[x, r], &[])
        });
        refused("Pad overflowing", "overflow", |b| {
            let x = b.input("x", DType::F32, &["3"]);
            let p = b.ints(&[i64::MAX, 1]);
            b.node(OpKind::Pad, &[x, p], &[])
        });
        refused("Reshape to more elements than i64 counts", "cannot reshape", |b| {
            let x = b.input("x", DType::F32, &["3"]);
            let t = b.ints(&[i64::MAX, 4, -1]);
            b.node(OpKind::Reshape, &[x, t], &[])
        });
        refused("ConstantOfShape with a negative dim", "negative size", |b| {
            let s = b.ints(&[2, -3]);
            b.node(OpKind::ConstantOfShape, &[s], &[])
        });
        refused("ConstantOfShape past every device", "more than", |b| {
            let s = b.ints(&[1 << 30, 1 << 30]);
            b.node(OpKind::ConstantOfShape, &[s], &[])
        });
        refused("Expand to a negative dim", "negative size", |b| {
            let x = b.input("x", DType::F32, &["1"]);
            let s = b.ints(&[-5]);
            b.node(OpKind::Expand, &[x, s], &[])
        });
        refused("Split sizes with a negative part", "do not cover", |b| {
            let x = b.input("x", DType::F32, &["4"]);
            let s = b.ints(&[-2, 6]);
            b.node_n(OpKind::Split, &[Some(x), Some(s)], &[axis(0)], 2)[1]
        });
        refused("GatherND with a batch_dims past the rank", "too many dims", |b| {
            let x = b.input("x", DType::F32, &["4", "5"]);
            let i = b.input("i", DType::I64, &["3", "1"]);
            b.node(OpKind::GatherND, &[x, i], &[("batch_dims", Attr::Int(i64::MAX))])
        });
        refused("Transpose repeating an axis", "repeats an axis", |b| {
            let x = b.input("x", DType::F32, &["2", "3"]);
            b.node(OpKind::Transpose, &[x], &[("perm", Attr::Ints(vec![0, 0]))])
        });
        refused("MaxPool with a huge dilation", "overflow", |b| {
            let x = b.input("x", DType::F32, &["1", "1", "8"]);
            let attrs = [("kernel_shape", Attr::Ints(vec![3])), ("dilations", Attr::Ints(vec![i64::MAX]))];
            b.node(OpKind::MaxPool, &[x], &attrs)
        });
        refused("Conv with a zero kernel", "must be positive", |b| {
            let x = b.input("x", DType::F32, &["1", "1", "8"]);
            let w = b.param("w", DType::F32, &[1, 1, 3]);
            b.node(OpKind::Conv, &[x, w], &[("kernel_shape", Attr::Ints(vec![0]))])
        });
        refused("Unsqueeze past the most dims", "rank 65", |b| {
            let x = b.input("x", DType::F32, &["2"]);
            let ax = b.ints(&(1..65).collect::<Vec<_>>());
            b.node(OpKind::Unsqueeze, &[x, ax], &[])
        });
        refused("Range of infinitely many", "more than", |b| {
            let (s, l) = (b.constant(Tensor::from_f32(vec![], &[0.0])), b.constant(Tensor::from_f32(vec![], &[f32::INFINITY])));
            let d = b.constant(Tensor::from_f32(vec![], &[1.0]));
            b.node(OpKind::Range, &[s, l, d], &[])
        });
    }

    #[test]
    fn integer_arithmetic_on_extreme_values_wraps_as_int64_kernels_do() {
        let mut b = Builder::new();
        let (min, m1) = (b.ints(&[i64::MIN, i64::MIN, 7]), b.ints(&[-1, 0, -1]));
        let q = b.node(OpKind::Div, &[min, m1], &[]);
        let r = b.node(OpKind::Mod, &[min, m1], &[("fmod", Attr::Int(1))]);
        let a = b.node(OpKind::Abs, &[min], &[]);
        let n = b.node(OpKind::Neg, &[min], &[]);
        let s = b.node(OpKind::Sum, &[min, min], &[]);
        for v in [q, r, a, n, s] {
            b.output(v);
        }
        let info = run(&mut b, &AnalyzeOptions::default());
        assert_eq!(info.ints(q), Some(&[i64::MIN, 0, -7][..]));
        assert_eq!(info.ints(r), Some(&[0, 0, 0][..]));
        assert_eq!(info.ints(a), Some(&[i64::MIN, i64::MIN, 7][..]));
        assert_eq!(info.ints(n), Some(&[i64::MIN, i64::MIN, -7][..]));
        assert_eq!(info.ints(s), Some(&[0, 0, 14][..]));
    }

    #[test]
    fn slicing_an_empty_dim_backwards_is_empty() {
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["0", "5"]);
        let (st, en, ax, sp) = (b.ints(&[-1, 4]), b.ints(&[i64::MIN, -100]), b.ints(&[0, 1]), b.ints(&[-1, i64::MIN]));
        let y = b.node(OpKind::Slice, &[x, st, en, ax, sp], &[]);
        b.output(y);
        run(&mut b, &AnalyzeOptions::default());
        assert_eq!(shape_of(&b.g, y), vec![0, 1]);
    }

    #[test]
    fn inputs_with_negative_or_huge_dims_are_refused_by_name() {
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["2", "-3"]);
        let y = b.node(OpKind::Relu, &[x], &[]);
        b.output(y);
        let err = infer(&b.g, &BTreeMap::new(), false).unwrap_err().to_string();
        assert!(err.contains("value `x`") && err.contains("negative size -3"), "{err}");
        let mut b = Builder::new();
        let x = b.input("x", DType::F32, &["n", "n"]);
        let y = b.node(OpKind::Relu, &[x], &[]);
        b.output(y);
        let err = infer(&b.g, &[("n".to_string(), 1i64 << 40)].into(), false).unwrap_err().to_string();
        assert!(err.contains("value `x`") && err.contains("more than"), "{err}");
    }
}
