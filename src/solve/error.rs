//! Errors of the planner.

/// Errors of the planner.
#[derive(Debug, thiserror::Error)]
pub enum SolveError {
    /// A flat problem is malformed.
    #[error("solver problem: {0}")]
    Problem(String),
    /// HiGHS failed.
    #[error("ILP solver: {0}")]
    Solver(String),
    /// A fixed setting cannot be honoured (names the setting and the fix).
    #[error("{0}")]
    Setting(String),
    /// Nothing fits; says what would.
    #[error("no plan fits: {reason}; {fix}")]
    Infeasible {
        /// Why (memory per device needed vs available, or too few devices).
        reason: String,
        /// What would fit: the smallest memory per device or device count.
        fix: String,
    },
}
