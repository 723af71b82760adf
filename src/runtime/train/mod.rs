//! Training, as every run does it: what is minimised (`loss`), the optimizer and learning rate
//! (`optim`), mixed precision and loss scaling (`amp`), what a run reports as it goes (`records`), the one training loop with its
//! checkpoint sequence (`driver`), and one process training without a plan (`single`). Each
//! mirrors PyTorch's defaults so losses match a PyTorch run step for step.

pub mod amp;
pub mod driver;
pub mod loss;
pub mod optim;
pub mod records;
pub mod single;

pub use amp::{Autocast, LossScaleConfig, LossScaler};
pub use driver::{CheckpointRecord, FailedCheckpoint, Leave, OptimizerProgress, StepRunner, TrainConfig, Trained, drive, save_checkpoint};
pub use loss::{IGNORE_INDEX, LossKind, global_target_count, loss_of, loss_sum_of, target_count};
pub use optim::{AdamW, AdamWConfig, LrSchedule, LrShape, clip_grad_norm};
pub use records::{EvalConfig, EvalRecord, Quiet, StepRecord, StragglerRecord, TrainObserver, mean_step_time, process_cpu_s};
pub use single::{SingleProcess, train, train_with};
