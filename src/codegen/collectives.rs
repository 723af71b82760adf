//! Collectives inserted by tensor-parallel sharding: what they are (plan-file content) and the
//! IR node each becomes (`Op::Placeholder { domain: "smp", .. }`).

use serde::{Deserialize, Serialize};

use crate::ir::{Attr, Attrs, Node, Op, ValueId};

/// The ONNX domain of inserted collective nodes.
pub const SMP_DOMAIN: &str = "smp";

/// `op_type` of the node the runner inserts where codegen lists a partial gradient (Megatron's
/// *f*: identity forward, gradient all-reduced over the tensor group).
pub const COPY_TO_TENSOR_REGION: &str = "CopyToTensorRegion";

pub use crate::split::CollectiveKind;

/// Which process group a collective runs over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GroupKind {
    /// The stage's tensor-parallel ranks.
    Tensor,
    /// The data-parallel replicas of a tensor rank.
    Data,
    /// The stages sharing a tied weight.
    TiedWeight,
}

impl GroupKind {
    /// The name written into the node's `group` attribute.
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::Tensor => "tensor",
            GroupKind::Data => "data",
            GroupKind::TiedWeight => "tied_weight",
        }
    }
}

/// A collective inserted into a layer's shard.
///
/// `after_value` names a model value: in the shard graph its producer yields the rank's local
/// part (named `{after_value}.local`), and the name `after_value` holds the collective's result,
/// so every consumer, inside the layer or after it, reads the combined tensor.
///
/// With `readers`, the collective instead reads `after_value` as the layer has it and only the
/// listed node inputs read its result (`{after_value}.{op_type}`); the value may then come from
/// outside the layer (sequence parallelism's scatter of the residual input).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CollectiveInsert {
    /// The model value that is combined.
    pub after_value: String,
    /// What the collective computes.
    pub kind: CollectiveKind,
    /// Over which group.
    pub group: GroupKind,
    /// The only node inputs that read the result (empty: every reader of `after_value`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub readers: Vec<InputRef>,
    /// The full tensor's shape as the collective sees it, when it runs on a reshaped view
    /// (tokens flattened into one axis are viewed as `[-1, seq, ..]`; `axis` is the view's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub view: Option<Vec<i64>>,
}

impl CollectiveInsert {
    /// A collective whose result every reader of `value` reads.
    pub fn after(value: impl Into<String>, kind: CollectiveKind, group: GroupKind) -> CollectiveInsert {
        CollectiveInsert { after_value: value.into(), kind, group, readers: Vec::new(), view: None }
    }
}

/// One input slot of a node.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct InputRef {
    /// The reading node.
    pub node: String,
    /// Its input slot.
    pub input: usize,
}

/// True if the node is a collective inserted by codegen.
pub fn is_collective(op: &Op) -> bool {
    matches!(op, Op::Placeholder { domain, .. } if domain == SMP_DOMAIN)
}

/// The IR node of a collective reading `input` and writing `output`.
pub fn collective_node(name: String, kind: CollectiveKind, group: GroupKind, input: ValueId, output: ValueId, order: u32) -> Node {
    let mut attrs = Attrs::default();
    attrs.set("group", Attr::Str(group.name().to_string()));
    if let Some(axis) = kind.axis() {
        attrs.set("axis", Attr::Int(axis as i64));
    }
    Node {
        name,
        op: Op::Placeholder { op_type: kind.op_type().to_string(), domain: SMP_DOMAIN.to_string() },
        attrs,
        inputs: vec![Some(input)],
        outputs: vec![output],
        namespace: None,
        order,
    }
}
