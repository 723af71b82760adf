//! Shared test fixtures.
#![allow(dead_code, unused_imports)]

pub mod interp;
pub mod machine;
pub mod moe;
pub mod exports;
pub mod netns;
pub mod plan_fixture;
pub mod runner;
pub mod synthetic_gpt;

pub use machine::*;
pub use plan_fixture::*;
pub use synthetic_gpt::*;

/// A fixed tensor of `dims` in `kind` with values in [-1, 1] (a sine of the element index and
/// `salt`), for tests that compare two runs: libtorch's global generator is shared by the tests
/// of a binary, which run in parallel, so a seeded draw can differ between two calls.
pub fn fixed_tensor(dims: &[i64], kind: tch::Kind, salt: f64) -> tch::Tensor {
    let n: i64 = dims.iter().product();
    (tch::Tensor::arange(n, (tch::Kind::Double, tch::Device::Cpu)) * 0.7 + salt).sin().to_kind(kind).view(dims)
}
