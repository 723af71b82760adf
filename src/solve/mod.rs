//! The planner: sharding strategies, flat problems, the intra-layer and pipeline ILPs, and the
//! outer search over parallel configurations.

pub mod ilp;
pub mod oracle;
pub mod pipeline;
pub mod problem;

pub use ilp::{SolveReport, SolveStatus, SolverOptions};

/// Errors of the planner.
#[derive(Debug, thiserror::Error)]
pub enum SolveError {
    /// A flat problem is malformed.
    #[error("solver problem: {0}")]
    Problem(String),
    /// HiGHS failed.
    #[error("ILP solver: {0}")]
    Solver(String),
}
