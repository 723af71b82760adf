//! Codegen: tensor-parallel shards of layers with their collectives, schedules lowered to
//! per-rank programs (compute, sends, receives, collectives), and the validator of both.

pub mod collectives;
pub mod encode;
pub mod lower;
pub mod program;
pub mod rebatch;
pub mod shard;
pub mod stage_graph;
pub mod validate;

pub use collectives::{CollectiveInsert, CollectiveKind, GroupKind, InputRef};
pub use encode::{CodegenInput, CodegenSection, Coord, EncodeError, FusedNode, GroupRef, IntValue, Mesh, RankView, StageContext, StageInput, StageView, Step, TokenAxis};
pub use lower::{LowerError, LowerOptions, lower, lower_schedule};
pub use rebatch::BatchRebind;
pub use program::{Instr, Payload, Purpose, RankProgram};
pub use shard::{CodegenError, ConstantRewrite, LayerShard, NodeRewrite, Sharder, WeightSlice, apply_shard, shard_all};
