//! The tensor-split engine: one place that knows how each op family splits across the tensor
//! ranks of a stage.
//!
//! Place in the spine: `frontend` → `ir` → `passes` → `cost` → **`split`** → `solve` →
//! `codegen`. It uses `ir`, `passes` (shape inference) and `cost` (to price offers); `solve` asks
//! it what each node can take, `codegen` asks it to emit the chosen strategy. It names nothing
//! from `solve` or `codegen`.
//!
//! - [`offer`]: "which strategies can this node take, at what cost": per layer and tensor
//!   degree, the choosing nodes (weight matmuls, embedding lookups, attention cores), their
//!   priced [`Strategy`] options and the pairs that must split together. The structure behind
//!   it (roles, where a column split flows, attention cores) is [`analyse`]; what a layer's
//!   attention and experts are, in words, is [`describe`].
//! - [`realise`]: "emit this strategy": propagation of placements through the layer, producing
//!   a rank-independent [`SplitPlan`] (weight splits, rewrites, collectives) and, per choosing
//!   node, the strategy it realised. [`Engine::check_offers`] keeps every offer the solver sees
//!   to what emission realises (an offer the emitter does not realise is withdrawn).
//! - One file per op family ([`family`] places every op kind in one) holds everything about how
//!   the family splits, each engine's rule as a method of that engine's type: tensor-parallel
//!   propagation (`Prop`), sequence parallelism's token rules (`SeqLayer`, driven by
//!   [`sequence`]), context parallelism's token rules (`Splitter`, driven by [`context`]), its
//!   offers and their prices (`Pricer`, driven by [`offer`]) and its emission where it rewrites
//!   nodes ([`emit_masked_gather`], [`emit_deferred_bias`]): `matmul` (column/row/heads, the
//!   deferred Gemm bias), `gather` (the vocabulary split, the masked lookup), `view` (reshape,
//!   transpose, squeeze, split, concat, expand), `elementwise`, `norm` (norms, softmaxes,
//!   reductions, scans, slices: the axes they work along are [`axes::touched_axes`]),
//!   `attention` (heads, shared KV heads), `experts` (each expert's intermediate dim). Every
//!   engine dispatches on the family with no catch-all (tests/architecture.rs).

pub mod analyse;
mod attention;
pub mod axes;
pub mod check;
pub mod context;
pub mod describe;
mod elementwise;
pub mod emit;
pub mod error;
mod experts;
pub mod family;
mod gather;
mod matmul;
mod norm;
pub mod offer;
pub mod realise;
pub mod rewrite;
mod sequence;
mod strategy;
mod view;

pub use analyse::{GraphFacts, NodeRole, SplitGraph, analyse, roles};
pub use check::{forced_assignment, isolated_assignment};
pub use describe::{AttentionForm, AttentionPart, ExpertsPart, LayerParts, describe};
pub use error::SplitError;
pub use gather::emit_masked_gather;
pub use matmul::emit_deferred_bias;
pub use offer::{Coupling, LayerOffers, NodeOffers, Offer, StrategyInputs, offers, offers_from};
pub use realise::{CollectiveKind, Engine, SplitPlan, TensorCollective, WeightSplit};
pub use rewrite::{ConstantRewrite, NodeRewrite, PartialGradient, add_bias_name};
pub use strategy::Strategy;
