//! The shared vocabulary of every stage: graph, ops, tensor types, layers.

mod collective;
mod display;
mod dtype;
mod fusion;
mod graph;
mod layer;
mod op;
mod param;
mod parallel;
pub mod schedule;
mod shape;
mod tensor;

pub use collective::{CollectiveKind, GroupKind};
pub use dtype::DType;
pub use fusion::{AttentionMask, AttentionScale, ClampLimit, Epsilon, ExpertActivation, ExpertWeighting, FusedOp, Fusion, GeluApproximation, SwishScale};
pub use graph::{AuxLoss, Graph, GraphError, Node, NodeId, Value, ValueId, ValueKind};
pub use layer::{DimBindings, GemmShape, Layer, LayerBytes, LayerKind, LayeredGraph, LossFigures, NodeFigures, OpSelective};
pub use op::{Attr, Attrs, AutocastClass, Op, OpKind, PADDING_ROWS};
pub use parallel::{CheckpointRule, ExpertDispatch, MeshAxis, MixedRecipe, OffloadRule, Parallelism, Placement, Precision, SelectivePolicy, limits};
pub use param::{DecisionSource, FrozenReason, ParamRecord, ParamTransform, RecordKind, Training};
pub use schedule::{Action, ActionKind, ScheduleError, ScheduleKind, compute_actions};
pub use shape::{Dim, Shape, TensorType};
pub use tensor::{ExternalData, Storage, Tensor};
