//! Cost model: cluster specs and presets, per-node and per-layer compute time (roofline),
//! alpha-beta collectives on the links a group spans, and the memory model (model state under
//! ZeRO, activations, in-flight microbatches per schedule).

pub mod cluster;
pub mod comm;
pub mod compute;
pub mod gemm;
mod link;
pub mod memory;

pub use cluster::{CalibrationFile, CollectiveLinks, ClusterError, ClusterSpec, EfficiencyCurve, FactSource, LIST_PRICES, ListPrice, MachineFacts, PRESETS, list_price};
pub use comm::{CommModel, GroupSpan, Link, LinkKind};
pub use compute::{LayerTimes, SplitDim, layer_times, node_time, node_times};
pub use gemm::GemmSurface;
pub use memory::{ModelState, StatePrecision, TrainingBytes, in_flight, kept_in_flight, model_state, rank_moments, stage_in_flights};
