//! Starting a job: the launcher that spawns local ranks with torchrun's environment (one host
//! or several) and watches their heartbeats; under `--elastic`, the job's devices agreed and the
//! model re-planned for them; `verify` (a plan against one process, in f64, before a long job);
//! and `calibrate`, which measures this machine for the cost model.

pub mod calibrate;
pub mod coordinator;
pub mod elastic;
pub mod launcher;
pub mod verify;
