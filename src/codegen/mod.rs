//! Codegen: schedules lowered to per-rank programs (compute, sends, receives, collectives).

pub mod lower;
pub mod program;

pub use lower::{LowerError, LowerOptions, lower, lower_schedule};
pub use program::{Instr, Payload, RankProgram};
