//! Reading and writing plan files, with the version check and validation.

use std::path::{Path, PathBuf};

use super::schema::{PLAN_VERSION, Plan};
use super::validate::{PlanInvalid, validate};

/// Errors of reading or writing a plan file.
#[derive(Debug, thiserror::Error)]
pub enum PlanIoError {
    /// The file could not be read or written.
    #[error("{path}: {cause}")]
    Io { path: PathBuf, cause: std::io::Error },
    /// Not JSON, or not a plan.
    #[error("{path}: not a plan file: {cause}")]
    Parse { path: PathBuf, cause: serde_json::Error },
    /// No `version` field.
    #[error(
        "{path}: not a plan file: no numeric `version` field (this smp-partition writes version {PLAN_VERSION})"
    )]
    NoVersion { path: PathBuf },
    /// A version this build does not read.
    #[error("{path}: plan version {found}, but this smp-partition reads version {supported}; {hint}")]
    Version { path: PathBuf, found: u64, supported: u32, hint: &'static str },
    /// Structurally inconsistent.
    #[error("{path}: invalid plan: {cause}")]
    Invalid { path: PathBuf, cause: PlanInvalid },
}

/// Writes a plan as pretty JSON (validated first).
pub fn save(plan: &Plan, path: &Path) -> Result<(), PlanIoError> {
    validate(plan).map_err(|cause| PlanIoError::Invalid { path: path.to_path_buf(), cause })?;
    let text = to_json(plan);
    std::fs::write(path, text + "\n").map_err(|cause| PlanIoError::Io { path: path.to_path_buf(), cause })
}

/// The plan as pretty JSON.
pub fn to_json(plan: &Plan) -> String {
    // Serialising plain structs of numbers and strings cannot fail.
    serde_json::to_string_pretty(plan).unwrap_or_default()
}

/// Reads, version-checks and validates a plan file.
pub fn load(path: &Path) -> Result<Plan, PlanIoError> {
    let text =
        std::fs::read_to_string(path).map_err(|cause| PlanIoError::Io { path: path.to_path_buf(), cause })?;
    from_json(&text, path)
}

/// Parses, version-checks and validates plan JSON; `path` names it in errors.
pub fn from_json(text: &str, path: &Path) -> Result<Plan, PlanIoError> {
    let p = || path.to_path_buf();
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|cause| PlanIoError::Parse { path: p(), cause })?;
    let found = value
        .get("version")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| PlanIoError::NoVersion { path: p() })?;
    if found != u64::from(PLAN_VERSION) {
        let hint = if found > u64::from(PLAN_VERSION) {
            "it was written by a newer smp-partition: upgrade this one, or re-plan the model with it"
        } else {
            "re-plan the model with this smp-partition"
        };
        return Err(PlanIoError::Version { path: p(), found, supported: PLAN_VERSION, hint });
    }
    // Parse the text again (not the value) so errors carry line and column.
    let plan: Plan = serde_json::from_str(text).map_err(|cause| PlanIoError::Parse { path: p(), cause })?;
    validate(&plan).map_err(|cause| PlanIoError::Invalid { path: p(), cause })?;
    Ok(plan)
}
