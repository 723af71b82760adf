//! Simulator: replays per-rank programs on the cost model — deadlock check, step time, bubble
//! ratio, per-device peak activation memory, timeline and its Perfetto trace.

pub mod replay;
pub mod timeline;
pub mod trace;

pub use replay::{
    CostTable, Durations, EventKind, RankStats, SimError, SimEvent, SimResult, Stuck, simulate,
};
pub use timeline::{TimelineError, plan_timeline};
pub use trace::chrome_trace;
