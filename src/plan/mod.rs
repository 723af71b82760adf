//! The plan: the versioned on-disk contract (`schema`), reading and writing it (`io`), its
//! structural checks (`validate`), and turning flags and SMP configs into constraints (`config`).

pub mod build;
pub mod config;
pub mod dot;
pub mod io;
pub mod report;
pub mod schema;
pub mod validate;

pub use config::{Constraints, PlanRequest, SmpConfig};
pub use io::{PlanIoError, load, save};
pub use schema::{PLAN_VERSION, Plan};
pub use validate::{PlanInvalid, validate};
