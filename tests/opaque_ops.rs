//! Ops the planner cannot see into — ops with no tensor-split rule, values of unknown shape,
//! ops the IR does not know — planned at tp 2 and cp 2 through `compile()`: each plan either
//! comes back (the op kept whole) or is refused naming the node, never with "the planner
//! chose a split codegen cannot emit". The ops without a split rule are enumerated from
//! `OpKind::ALL`, so a new op without a rule needs a graph here.

use std::path::{Path, PathBuf};

use prost::Message;
use smp_partition::compile;
use smp_partition::cost::ClusterSpec;
use smp_partition::frontend::onnx::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto, TensorShapeProto, TypeProto, ValueInfoProto,
    attribute_proto::AttributeType, tensor_shape_proto, type_proto,
};
use smp_partition::ir::OpKind;
use smp_partition::solve::PlanOptions;
use smp_partition::split::family::tp_rule;

const F32: i32 = 1;
const I64: i32 = 7;
/// Hidden size, batch, sequence, vocabulary.
const H: i64 = 8;
const B: i64 = 2;
const S: i64 = 8;
const V: i64 = 16;

/// A small token model under construction: `ids` → embedding → `a` = MatMul(h, wa) (a column
/// split candidate) → the nodes under test → `b` [B, S, k] → MatMul(b, wb) → MatMul(·, wh) →
/// `logits`.
#[derive(Default)]
struct Model {
    nodes: Vec<NodeProto>,
    inits: Vec<TensorProto>,
    inputs: Vec<ValueInfoProto>,
    domains: Vec<String>,
}

enum A {
    I(i64),
    Is(Vec<i64>),
    F(f32),
    S(&'static str),
}

impl Model {
    fn node(&mut self, op: &str, name: &str, inputs: &[&str], outputs: &[&str], attrs: Vec<(&str, A)>) {
        let attribute = attrs
            .into_iter()
            .map(|(n, a)| {
                let mut p = AttributeProto { name: Some(n.into()), ..Default::default() };
                match a {
                    A::I(i) => (p.i, p.r#type) = (Some(i), Some(AttributeType::Int as i32)),
                    A::Is(v) => (p.ints, p.r#type) = (v, Some(AttributeType::Ints as i32)),
                    A::F(f) => (p.f, p.r#type) = (Some(f), Some(AttributeType::Float as i32)),
                    A::S(s) => (p.s, p.r#type) = (Some(s.as_bytes().to_vec()), Some(AttributeType::String as i32)),
                }
                p
            })
            .collect();
        let (domain, op) = match op.split_once('.') {
            Some((d, o)) => (d.to_string(), o.to_string()),
            None => (String::new(), op.to_string()),
        };
        if !domain.is_empty() && !self.domains.contains(&domain) {
            self.domains.push(domain.clone());
        }
        self.nodes.push(NodeProto {
            op_type: Some(op),
            domain: Some(domain),
            name: Some(name.into()),
            input: inputs.iter().map(|s| (*s).into()).collect(),
            output: outputs.iter().map(|s| (*s).into()).collect(),
            attribute,
            ..Default::default()
        });
    }

    /// A float initializer of varied values.
    fn weight(&mut self, name: &str, dims: &[i64]) {
        let n: i64 = dims.iter().product();
        let raw: Vec<u8> = (0..n).flat_map(|i| (0.05 + 0.01 * (i % 7) as f32).to_le_bytes()).collect();
        self.inits.push(TensorProto { name: Some(name.into()), data_type: Some(F32), dims: dims.to_vec(), raw_data: Some(raw.into()), ..Default::default() });
    }

    fn floats(&mut self, name: &str, dims: &[i64], vals: &[f32]) {
        let raw: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.inits.push(TensorProto { name: Some(name.into()), data_type: Some(F32), dims: dims.to_vec(), raw_data: Some(raw.into()), ..Default::default() });
    }

    fn ints(&mut self, name: &str, dims: &[i64], vals: &[i64]) {
        let raw: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.inits.push(TensorProto { name: Some(name.into()), data_type: Some(I64), dims: dims.to_vec(), raw_data: Some(raw.into()), ..Default::default() });
    }

    fn zeros_i64(&mut self, name: &str, dims: &[i64]) {
        let n: i64 = dims.iter().product();
        self.ints(name, dims, &vec![0; n as usize]);
    }

    /// Writes the model with `b`'s last dim `k` to `dir/name.onnx`.
    fn write(mut self, dir: &Path, name: &str, k: i64) -> PathBuf {
        let mut nodes = Vec::new();
        std::mem::swap(&mut nodes, &mut self.nodes);
        // the embedding and the column candidate before the nodes under test
        self.node("Gather", "embed", &["table", "ids"], &["h"], vec![]);
        self.node("MatMul", "proj_a", &["h", "wa"], &["a"], vec![]);
        self.nodes.extend(nodes);
        self.node("MatMul", "proj_b", &["b", "wb"], &["y"], vec![]);
        self.node("MatMul", "head", &["y", "wh"], &["logits"], vec![]);
        self.weight("table", &[V, H]);
        self.weight("wa", &[H, H]);
        self.weight("wb", &[k, H]);
        self.weight("wh", &[H, V]);
        self.inputs.insert(0, info("ids", I64, Some(&[B, S])));
        let mut opset_import = vec![OperatorSetIdProto { domain: Some(String::new()), version: Some(18) }];
        opset_import.extend(self.domains.iter().map(|d| OperatorSetIdProto { domain: Some(d.clone()), version: Some(1) }));
        let model = ModelProto {
            ir_version: Some(10),
            opset_import,
            graph: Some(GraphProto {
                name: Some(name.into()),
                node: self.nodes,
                initializer: self.inits,
                input: self.inputs,
                output: vec![info("logits", F32, None)],
                ..Default::default()
            }),
            ..Default::default()
        };
        let path = dir.join(format!("{name}.onnx"));
        std::fs::write(&path, model.encode_to_vec()).unwrap();
        path
    }
}

fn info(name: &str, elem: i32, dims: Option<&[i64]>) -> ValueInfoProto {
    let shape = dims.map(|d| TensorShapeProto {
        dim: d.iter().map(|&d| tensor_shape_proto::Dimension { value: Some(tensor_shape_proto::dimension::Value::DimValue(d)), ..Default::default() }).collect(),
    });
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto { value: Some(type_proto::Value::TensorType(type_proto::Tensor { elem_type: Some(elem), shape })), ..Default::default() }),
        ..Default::default()
    }
}

/// Nodes from `a` [B, S, H] to `b` [B, S, k] through one node of `kind` (named `op`), with `k`;
/// `None` for a kind that has a split rule.
fn through(kind: OpKind, m: &mut Model) -> Option<i64> {
    use OpKind::*;
    let op = kind.to_string();
    let op = op.as_str();
    let reduce = |m: &mut Model| {
        m.ints("axes", &[1], &[-1]);
        m.node(op, "op", &["a", "axes"], &["b"], vec![("keepdims", A::I(1))]);
        1
    };
    let same = |m: &mut Model, attrs: Vec<(&str, A)>| {
        m.node(op, "op", &["a"], &["b"], attrs);
        H
    };
    Some(match kind {
        ReduceMin | ReduceProd | ReduceL1 | ReduceL2 | ReduceLogSumExp | ReduceSumSquare => reduce(m),
        ArgMax | ArgMin => {
            m.node(op, "op", &["a"], &["idx"], vec![("axis", A::I(-1)), ("keepdims", A::I(1))]);
            m.node("Cast", "cast", &["idx"], &["b"], vec![("to", A::I(F32 as i64))]);
            1
        }
        TopK => {
            m.ints("k", &[1], &[2]);
            m.node(op, "op", &["a", "k"], &["b", "topk_indices"], vec![("axis", A::I(-1))]);
            2
        }
        LpNormalization => same(m, vec![("axis", A::I(-1)), ("p", A::I(2))]),
        Flatten => {
            m.ints("back", &[3], &[B, S, H]);
            m.node(op, "op", &["a"], &["flat"], vec![("axis", A::I(2))]);
            m.node("Reshape", "unflatten", &["flat", "back"], &["b"], vec![]);
            H
        }
        Shape => {
            m.node(op, "op", &["a"], &["shape"], vec![]);
            m.node("Reshape", "reshape", &["a", "shape"], &["b"], vec![]);
            H
        }
        Size => {
            m.node(op, "op", &["a"], &["size"], vec![]);
            m.node("Cast", "cast", &["size"], &["sizef"], vec![("to", A::I(F32 as i64))]);
            m.node("Div", "div", &["a", "sizef"], &["b"], vec![]);
            H
        }
        ConstantOfShape => {
            m.node("Shape", "shape", &["a"], &["shape"], vec![]);
            m.node(op, "op", &["shape"], &["zeros"], vec![]);
            m.node("Add", "add", &["a", "zeros"], &["b"], vec![]);
            H
        }
        Range => {
            m.floats("start", &[], &[0.0]);
            m.floats("limit", &[], &[H as f32]);
            m.floats("delta", &[], &[1.0]);
            m.node(op, "op", &["start", "limit", "delta"], &["range"], vec![]);
            m.node("Add", "add", &["a", "range"], &["b"], vec![]);
            H
        }
        Constant => {
            m.node(op, "op", &[], &["two"], vec![("value_float", A::F(2.0))]);
            m.node("Mul", "mul", &["a", "two"], &["b"], vec![]);
            H
        }
        Conv => {
            m.weight("conv_w", &[H, S, 1]);
            m.node(op, "op", &["a", "conv_w"], &["b"], vec![]);
            H
        }
        BatchNormalization => {
            for p in ["bn_scale", "bn_bias", "bn_mean"] {
                m.weight(p, &[S]);
            }
            m.floats("bn_var", &[S], &[1.0; S as usize]);
            m.node(op, "op", &["a", "bn_scale", "bn_bias", "bn_mean", "bn_var"], &["b"], vec![]);
            H
        }
        InstanceNormalization => {
            m.weight("in_scale", &[S]);
            m.weight("in_bias", &[S]);
            m.node(op, "op", &["a", "in_scale", "in_bias"], &["b"], vec![]);
            H
        }
        LRN => same(m, vec![("size", A::I(3))]),
        MaxPool | AveragePool => same(m, vec![("kernel_shape", A::Is(vec![1]))]),
        GlobalAveragePool | GlobalMaxPool => {
            m.node(op, "op", &["a"], &["b"], vec![]);
            1
        }
        GatherElements => {
            m.zeros_i64("ge_idx", &[B, S, H]);
            m.node(op, "op", &["a", "ge_idx"], &["b"], vec![("axis", A::I(2))]);
            H
        }
        GatherND => {
            m.zeros_i64("gnd_idx", &[B, S, 1]);
            m.node(op, "op", &["a", "gnd_idx"], &["b"], vec![("batch_dims", A::I(1))]);
            H
        }
        Tile => {
            m.ints("repeats", &[3], &[1, 1, 2]);
            m.node(op, "op", &["a", "repeats"], &["b"], vec![]);
            2 * H
        }
        Pad => {
            m.ints("pads", &[6], &[0, 0, 0, 0, 0, 1]);
            m.node(op, "op", &["a", "pads"], &["b"], vec![]);
            H + 1
        }
        Trilu => same(m, vec![]),
        ScatterND => {
            m.zeros_i64("snd_idx", &[1, 3]);
            m.floats("snd_upd", &[1], &[1.0]);
            m.node(op, "op", &["a", "snd_idx", "snd_upd"], &["b"], vec![]);
            H
        }
        ScatterElements => {
            m.zeros_i64("se_idx", &[B, S, H]);
            m.node(op, "op", &["a", "se_idx", "a"], &["b"], vec![("axis", A::I(2)), ("reduction", A::S("add"))]);
            H
        }
        OneHot => {
            m.node("ArgMax", "argmax", &["a"], &["idx"], vec![("axis", A::I(-1)), ("keepdims", A::I(0))]);
            m.ints("depth", &[], &[H]);
            m.floats("onehot_values", &[2], &[0.0, 1.0]);
            m.node(op, "op", &["idx", "depth", "onehot_values"], &["b"], vec![]);
            H
        }
        Einsum => {
            m.weight("einsum_w", &[H, H]);
            m.node(op, "op", &["a", "einsum_w"], &["b"], vec![("equation", A::S("bsh,hk->bsk"))]);
            H
        }
        Resize => {
            m.floats("scales", &[3], &[1.0, 1.0, 1.0]);
            m.node(op, "op", &["a", "", "scales"], &["b"], vec![("mode", A::S("nearest"))]);
            H
        }
        GridSample => {
            m.ints("to4", &[4], &[B, S, H, 1]);
            m.ints("to3", &[3], &[B, S, H]);
            m.floats("grid", &[B, H, 1, 2], &[0.0; (B * H * 2) as usize]);
            m.node("Reshape", "to4", &["a", "to4"], &["a4"], vec![]);
            m.node(op, "op", &["a4", "grid"], &["g4"], vec![]);
            m.node("Reshape", "to3", &["g4", "to3"], &["b"], vec![]);
            H
        }
        Col2Im => {
            // a [B, S, H] read as [N, C·2·1, L]: blocks of 2 × 1 over an image of 2 × 8 (8 positions)
            m.ints("image", &[2], &[2, 8]);
            m.ints("block", &[2], &[2, 1]);
            m.ints("to3c", &[3], &[B, S, H]);
            m.node(op, "op", &["a", "image", "block"], &["folded"], vec![]);
            m.node("Reshape", "to3c", &["folded", "to3c"], &["b"], vec![]);
            H
        }
        SoftmaxCrossEntropyLoss | NegativeLogLikelihoodLoss => {
            // a per-token loss over the hidden axis read as classes, [B, S] → [B, S, 1]
            let labels: Vec<i64> = (0..B * S).map(|i| i % H).collect();
            m.ints("labels", &[B, S], &labels);
            m.ints("last", &[1], &[-1]);
            m.node("Transpose", "to_classes", &["a"], &["scores"], vec![("perm", A::Is(vec![0, 2, 1]))]);
            m.node(op, "op", &["scores", "labels"], &["per_token"], vec![("reduction", A::S("none"))]);
            m.node("Unsqueeze", "per_token_3d", &["per_token", "last"], &["b"], vec![]);
            1
        }
        k if tp_rule(k) => return None,
        k => panic!("no test graph for `{k}`, an op without a tensor-split rule: add one to `through`"),
    })
}

/// Graphs whose shapes the planner cannot know, and a graph with an op the IR does not know:
/// (name, the node to be named in a refusal, builder).
fn unseeable() -> Vec<(&'static str, &'static str, fn(&mut Model) -> i64)> {
    vec![
        // a MatMul reading a value reshaped to a shape given at run time
        ("runtime_reshape", "op", |m| {
            m.inputs.push(info("target", I64, Some(&[3])));
            m.node("Reshape", "op", &["a", "target"], &["b"], vec![]);
            H
        }),
        // SwinV2's pattern: attention scores of a query divided by a value of unknown shape (a
        // float input declared without one)
        ("scores_of_unknown", "scores", |m| {
            m.inputs.push(info("scale", F32, None));
            m.weight("wk", &[H, H]);
            m.node("MatMul", "proj_k", &["h", "wk"], &["k"], vec![]);
            m.node("Div", "div", &["a", "scale"], &["q"], vec![]);
            m.node("Transpose", "kt", &["k"], &["kt"], vec![("perm", A::Is(vec![0, 2, 1]))]);
            m.node("MatMul", "scores", &["q", "kt"], &["s"], vec![]);
            m.node("Softmax", "softmax", &["s"], &["b"], vec![("axis", A::I(-1))]);
            H
        }),
        // a weight matmul (`proj_b`) and everything after it reading a value of unknown shape
        ("weight_matmul_of_unknown", "proj_b", |m| {
            m.inputs.push(info("scale", F32, None));
            m.node("Mul", "op", &["a", "scale"], &["b"], vec![]);
            H
        }),
        // an op the IR does not know (kept as a placeholder by the importer)
        ("placeholder", "op", |m| {
            m.node("com.example.Fancy", "op", &["a"], &["b"], vec![]);
            H
        }),
    ]
}

/// Plans `model` at tp 2 and at cp 2: each plan comes back at that degree, or the refusal
/// names `node`; neither says the planner chose what codegen cannot emit.
fn plan_both(model: &Path, node: &str) -> Vec<String> {
    let cluster = ClusterSpec::parse("h100-80gb:2").unwrap();
    let base = PlanOptions { global_batch: Some(B as u64), pp: Some(1), microbatches: Some(1), ..Default::default() };
    let mut seen = Vec::new();
    for (what, opts) in [("tp 2", PlanOptions { tp: Some(2), ..base.clone() }), ("cp 2", PlanOptions { tp: Some(1), cp: Some(2), ..base.clone() })] {
        match compile(model, &cluster, &opts) {
            Ok(plan) => {
                assert_eq!((plan.parallel.tp, plan.parallel.cp), if what == "tp 2" { (2, 1) } else { (1, 2) }, "{}", model.display());
                seen.push(format!("{what}: planned"));
            }
            Err(e) => {
                let text = format!("{e:#}");
                let chain = std::iter::successors(Some(&e as &dyn std::error::Error), |e| e.source()).map(ToString::to_string).collect::<Vec<_>>().join(": ");
                assert!(!chain.contains("planner bug") && !chain.contains("codegen cannot emit"), "{} at {what}: {chain}", model.display());
                assert!(chain.contains(&format!("`{node}`")), "{} at {what}: the refusal does not name `{node}`: {chain}", model.display());
                seen.push(format!("{what}: refused: {text}"));
            }
        }
    }
    seen
}

#[test]
fn ops_without_a_split_rule_are_kept_whole_at_tp_2_and_cp_2() {
    let dir = tempfile::tempdir().unwrap();
    let mut covered = 0;
    for &kind in OpKind::ALL {
        let mut m = Model::default();
        let Some(k) = through(kind, &mut m) else { continue };
        let path = m.write(dir.path(), &kind.to_string(), k);
        for line in plan_both(&path, "op") {
            eprintln!("{kind}: {line}");
        }
        covered += 1;
    }
    assert!(covered >= 30, "{covered} ops without a split rule");
}

#[test]
fn values_of_unknown_shape_and_unknown_ops_are_kept_whole_or_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    for (name, node, build) in unseeable() {
        let mut m = Model::default();
        let k = build(&mut m);
        let path = m.write(dir.path(), name, k);
        let seen = plan_both(&path, node);
        for line in &seen {
            eprintln!("{name}: {line}");
        }
        if name == "placeholder" {
            assert!(seen.iter().all(|l| l.contains("refused") && l.contains("com.example.Fancy")), "{seen:?}");
        }
    }
}
