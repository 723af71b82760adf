//! File formats the runtime's rooms share: numpy's `.npz`/`.npy` arrays (model inputs and
//! outputs, data files, the trained model's arrays).

pub mod npz;
