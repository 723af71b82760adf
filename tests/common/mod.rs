//! Shared test fixtures.
#![allow(dead_code, unused_imports)]

pub mod interp;
pub mod machine;
pub mod moe;
pub mod exports;
pub mod plan_fixture;
pub mod runner;
pub mod synthetic_gpt;

pub use machine::*;
pub use plan_fixture::*;
pub use synthetic_gpt::*;
