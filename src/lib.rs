//! smp-partition: a compiler for model-parallel training.
//!
//! The spine, one direction: `frontend` → `ir` → `passes` → `cost` → `split` → `solve` →
//! `codegen` → `plan` → `sim` → `runtime`; `engines` writes plans as other engines'
//! configurations and reads theirs into requests for `compile`. Every stage may use `ir` and the stages before it.
//! [`compile()`] drives the stages from a model file to a validated plan (docs/architecture.md).

pub mod codegen;
pub mod compile;
pub mod cost;
pub mod engines;
pub mod frontend;
pub mod host;
pub mod ir;
pub mod logging;
pub mod parallel;
pub mod passes;
pub mod plan;
pub mod sim;
pub mod solve;
pub mod split;

#[cfg(feature = "runner")]
pub mod runtime;

pub use compile::{Analysed, CompileError, Model, Observer, PlannedModel, Stage, compile, compile_observed, estimate, load_and_analyze, load_planned};
pub use solve::PlanOptions;
