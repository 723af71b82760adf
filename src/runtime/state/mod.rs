//! State that outlives a step: weights and the sources they are read from (model file,
//! external data, checkpoint, seeded random values), checkpoints (sharded safetensors and a
//! manifest, resharded on resume), and the trained model out (`export`). `slice` is
//! the leaf they share: where a piece lies in the whole tensor and what it is named.

pub mod checkpoint;
pub mod export;
pub mod slice;
pub mod weights;
