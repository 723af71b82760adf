//! Collectives inserted by tensor-parallel sharding: what they are (plan-file content) and the
//! IR node each becomes (`Op::Collective`).

use serde::{Deserialize, Serialize};

use crate::ir::{Attrs, Node, Op, ValueId};

pub use crate::ir::{CollectiveKind, GroupKind};

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

/// The IR node of a collective reading `input` and writing `output`.
pub fn collective_node(name: String, kind: CollectiveKind, group: GroupKind, input: ValueId, output: ValueId, order: u32) -> Node {
    Node { name, op: Op::Collective { kind, group }, attrs: Attrs::default(), inputs: vec![Some(input)], outputs: vec![output], namespace: None, order }
}
