//! The errors of writing and reading engine configurations.

use crate::compile::CompileError;

use super::fields::Engine;

/// Why an engine configuration cannot be written or read.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The configuration text is not what the engine reads (syntax, types).
    #[error("{engine} configuration {what}: {why}")]
    Syntax {
        /// The engine.
        engine: Engine,
        /// The file or argument list, as named.
        what: String,
        /// What is wrong, and where.
        why: String,
    },
    /// The engine itself would refuse the configuration: `check` names the engine's check.
    #[error("{engine} refuses this configuration ({check}): {why}")]
    Refused {
        /// The engine.
        engine: Engine,
        /// The engine's check, as it names it.
        check: String,
        /// What does not hold, with the values.
        why: String,
    },
    /// The configuration describes another model than the one given.
    #[error("{engine} configuration describes another model: {why}")]
    Model {
        /// The engine.
        engine: Engine,
        /// What differs.
        why: String,
    },
    /// The model has a structure the engine cannot run (its layers are not an embedding,
    /// transformer layers and a head).
    #[error("{engine} cannot run {model}: {why}")]
    Structure {
        /// The engine.
        engine: Engine,
        /// The model, as named.
        model: String,
        /// Which layer breaks the structure.
        why: String,
    },
    /// The configuration is missing something only the command line can give.
    #[error("{engine} configuration: {why}")]
    Missing {
        /// The engine.
        engine: Engine,
        /// What is missing and how to give it.
        why: String,
    },
    /// Planning the configuration (or the nearest one the engine can run) failed.
    #[error("pricing the {engine} configuration")]
    Compile {
        /// The engine.
        engine: Engine,
        /// Why.
        #[source]
        source: Box<CompileError>,
    },
}
