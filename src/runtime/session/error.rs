//! Why a run cannot start or did not finish.

use crate::runtime::RuntimeError;

/// A run that cannot start or did not finish, naming the file, flag or rank and the fix.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// Flags that cannot be taken.
    #[error("{0}")]
    Options(String),
    /// The plan cannot be run as asked, or does not fit its model.
    #[error("{0}")]
    Plan(String),
    /// The model file cannot be read or prepared.
    #[error("{0}")]
    Model(String),
    /// Running failed before training started.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
    /// The run failed after it started training (a lost peer, a crash, a checkpoint that could
    /// not be written): a restart from the last checkpoint can resume it.
    #[error(transparent)]
    Interrupted(RuntimeError),
}

impl SessionError {
    /// What an error raised while training means for a restart: a data file or input found bad
    /// mid-run fails again on every restart (not retried), anything else interrupted the run.
    pub fn during_training(e: RuntimeError) -> SessionError {
        match e {
            e @ (RuntimeError::File { .. } | RuntimeError::Input { .. }) => SessionError::Runtime(e),
            e => SessionError::Interrupted(e),
        }
    }
}
