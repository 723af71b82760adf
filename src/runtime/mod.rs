//! The libtorch runtime (feature `runner`): it executes models and plans. This is the only
//! module that names tch or c10d. Its rooms, bottom up (each uses only those before it):
//!
//! - `allocator.rs`: the host allocator's policy for a training process (freed buffers kept
//!   for the next step);
//! - `comm/`: the c10d shim (TCP store, Gloo/NCCL process groups, point-to-point work);
//! - `device.rs`: where a process's tensors live (`--device`, `--share-gpu`) and how its ranks
//!   talk, checked against what libtorch sees;
//! - `heartbeat.rs`: a rank's signs of life to its launcher (phase, waits), and the launcher's
//!   judgement of them (hung, waiting);
//! - `kernels/`: op kernels on tch, the forward executor with autograd, tensor conversions,
//!   the autograd shim (gradients accumulated in place, fused AdamW);
//! - `formats/`: file formats the rooms share (numpy's npz and npy arrays);
//! - `state/`: what lives on disk or in memory between steps: weights and where they are read
//!   from, checkpoints, the trained model out (export);
//! - `data/`: token files, batches, their order, `prepare-data`;
//! - `train/`: losses, the optimizer and learning rate, records and observers, and the one
//!   training loop (`train::driver::drive`) that a single process and every rank run;
//! - `rank/`: one rank of a plan: its layout read from the plan, its set-up (stages, shards,
//!   parameters, process groups), the program interpreter, ZeRO state, what it measured;
//! - `session/`: the run front door (`RunSession`): the checks of a run against its plan,
//!   model and checkpoint, and the one report a run prints;
//! - `launch/`: starting ranks (one host or several), elastic jobs, and calibrating this
//!   machine.

pub mod allocator;
pub mod comm;
pub mod data;
pub mod device;
mod error;
pub mod formats;
pub mod heartbeat;
pub mod kernels;
pub mod launch;
pub mod rank;
pub mod session;
pub mod state;
pub mod train;

pub use error::RuntimeError;
pub(crate) use error::terr;
pub use kernels::executor::{ExecOptions, Executor, Weights};
pub use state::weights::InitMode;
