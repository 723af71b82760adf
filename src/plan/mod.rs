//! The plan: the versioned on-disk contract (`schema`), building it from the solver's decision
//! (`build`), reading and writing it (`io`), its structural checks (`validate`), its report and
//! DOT views. What the user asks for (flags, SMP configs) is `solve::options`.

pub mod build;
pub mod dot;
pub mod estimate;
pub mod io;
pub mod report;
pub mod request;
pub mod schema;
pub mod validate;

pub use io::{PlanIoError, load, save};
pub use request::{PlanRequest, RequestError};
pub use schema::{PLAN_VERSION, Plan};
pub use validate::{PlanInvalid, validate};
