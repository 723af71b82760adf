//! Activation offloading: the inputs a recomputed stage keeps for its backward (what its
//! recompute starts from) move to host memory after its forward and come back
//! `activation_loading_horizon` backwards ahead of their own, copied by a helper thread while
//! the rank computes. On CPU the "device" is an accounted pool: the bytes of kept inputs
//! resident on it and their peak, beside the bytes waiting in host memory, so a run shows what
//! left the device.
//!
//! Kept inputs are counted from the end of their forward to the start of their backward (then
//! the recompute holds them, as every layer's live activations); with offloading off the
//! pool's peak is the plan's in-flight microbatches' inputs.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::JoinHandle;

use tch::Tensor;

use crate::ir::ValueId;
use crate::runtime::RuntimeError;
use crate::runtime::kernels::tensor::owned_copy;
use crate::runtime::terr;

use super::report::{PoolBytes, bytes_of};

type Copied = Result<Vec<Tensor>, String>;

/// A copy in flight on the helper thread.
struct Pending(Receiver<Copied>);

impl Pending {
    fn wait(self) -> Result<Vec<Tensor>, RuntimeError> {
        self.0.recv().map_err(|_| terr("the offloading thread stopped".to_string()))?.map_err(terr)
    }
}

/// One microbatch's kept inputs, wherever they are.
enum Kept {
    /// On the device.
    Device(Vec<(ValueId, Tensor)>),
    /// In host memory: ids, copies, and whether each was a gradient leaf.
    Host(Vec<(ValueId, bool)>, Vec<Tensor>),
    /// Coming back to the device.
    Loading(Vec<(ValueId, bool)>, Pending),
}

/// The helper thread: copies tensors in order, one job at a time.
struct Copier {
    jobs: Option<Sender<(Vec<Tensor>, Sender<Copied>)>>,
    thread: Option<JoinHandle<()>>,
}

impl Copier {
    fn new() -> Copier {
        let (tx, rx) = channel::<(Vec<Tensor>, Sender<Copied>)>();
        let thread = std::thread::Builder::new()
            .name("smp-offload".into())
            .spawn(move || {
                for (ts, reply) in rx {
                    let _ = reply.send(ts.iter().map(owned_copy).collect::<Result<_, _>>().map_err(|e| e.to_string()));
                }
            })
            .ok();
        Copier { jobs: thread.as_ref().map(|_| tx), thread }
    }

    /// Starts copying `ts` (the copies are detached; on CPU host and device are one memory, so
    /// a copy is a fresh buffer).
    fn submit(&self, ts: Vec<Tensor>) -> Result<Pending, RuntimeError> {
        let (reply, rx) = channel();
        let jobs = self.jobs.as_ref().ok_or_else(|| terr("the offloading thread could not be started".to_string()))?;
        jobs.send((ts, reply)).map_err(|_| terr("the offloading thread stopped".to_string()))?;
        Ok(Pending(rx))
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The kept inputs of a rank's recomputed stages, and where they are.
pub(super) struct Offload {
    /// By global stage: whether its kept inputs are offloaded.
    offloaded: Vec<bool>,
    /// Backwards whose inputs are back on the device ahead of their own.
    horizon: usize,
    /// The rank's backwards of recomputed stages, in program order.
    order: Vec<(usize, usize)>,
    /// Position in `order` of the next backward.
    next: usize,
    kept: HashMap<(usize, usize), (Kept, u64)>,
    /// Copies to host started at a forward's start, by (stage, microbatch).
    outgoing: HashMap<(usize, usize), Pending>,
    /// The pools.
    pub pool: PoolBytes,
    copier: Option<Copier>,
}

impl Offload {
    /// For a rank whose recomputed stages' backwards run in `order`, offloading the stages
    /// `offloaded` marks with `horizon` microbatches back ahead of their backward.
    pub fn new(offloaded: Vec<bool>, horizon: usize, order: Vec<(usize, usize)>) -> Offload {
        let copier = offloaded.iter().any(|&o| o).then(Copier::new);
        Offload { offloaded, horizon: horizon.max(1), order, next: 0, kept: HashMap::new(), outgoing: HashMap::new(), pool: PoolBytes::default(), copier }
    }

    /// Forgets the last step's inputs (the peaks stay).
    pub fn start_step(&mut self) {
        self.next = 0;
        self.kept.clear();
        self.outgoing.clear();
        self.pool.device = 0;
        self.pool.host = 0;
    }

    /// Whether (stage, microbatch)'s backward is among the next `horizon` ones.
    fn in_window(&self, key: (usize, usize)) -> bool {
        self.order.iter().skip(self.next).take(self.horizon).any(|&k| k == key)
    }

    fn offloads(&self, key: (usize, usize)) -> bool {
        self.offloaded.get(key.0).copied().unwrap_or(false) && !self.in_window(key)
    }

    /// At the start of a forward: starts copying the inputs it will keep to host memory when
    /// they are to wait there, so the copy overlaps the forward.
    pub fn forward_starts(&mut self, s: usize, mb: usize, inputs: &[(ValueId, Tensor)]) -> Result<(), RuntimeError> {
        if !self.offloads((s, mb)) || inputs.is_empty() {
            return Ok(());
        }
        let copier = self.copier.as_ref().ok_or_else(|| terr("offloading without its thread".to_string()))?;
        let pending = copier.submit(inputs.iter().map(|(_, t)| t.shallow_clone()).collect())?;
        self.outgoing.insert((s, mb), pending);
        Ok(())
    }

    /// At the end of a forward: keeps its inputs for the backward, on the device or (once the
    /// copy started at its start is done) in host memory.
    pub fn keep(&mut self, s: usize, mb: usize, inputs: Vec<(ValueId, Tensor)>) -> Result<(), RuntimeError> {
        let bytes: u64 = inputs.iter().map(|(_, t)| bytes_of(t)).sum();
        let kept = match self.outgoing.remove(&(s, mb)) {
            Some(p) => {
                let copies = p.wait()?;
                self.pool.to_host(bytes);
                Kept::Host(inputs.iter().map(|(v, t)| (*v, t.requires_grad())).collect(), copies)
            }
            None => {
                self.pool.to_device(bytes);
                Kept::Device(inputs)
            }
        };
        self.kept.insert((s, mb), (kept, bytes));
        Ok(())
    }

    /// At the start of a backward: its kept inputs, on the device (waiting for their copy
    /// back if it is under way). The window moves on, and the inputs now within it start back.
    pub fn take(&mut self, s: usize, mb: usize) -> Result<Vec<(ValueId, Tensor)>, RuntimeError> {
        let (kept, bytes) = self.kept.remove(&(s, mb)).ok_or_else(|| terr(format!("stage {s} mb {mb}: backward without kept inputs")))?;
        let inputs = match kept {
            Kept::Device(inputs) => inputs,
            Kept::Host(ids, copies) => {
                // not loaded ahead (a backward out of the window's order): now, in place
                self.pool.host -= bytes;
                self.pool.to_device(bytes);
                restore(ids, copies.iter().map(owned_copy).collect::<Result<_, _>>()?)?
            }
            Kept::Loading(ids, p) => restore(ids, p.wait()?)?,
        };
        self.pool.device -= bytes;
        if let Some(pos) = self.order.iter().skip(self.next).position(|&k| k == (s, mb)) {
            self.next += pos + 1;
        }
        self.prefetch()?;
        Ok(inputs)
    }

    /// Starts bringing back the host-held inputs whose backward is within the window.
    fn prefetch(&mut self) -> Result<(), RuntimeError> {
        let window: Vec<(usize, usize)> = self.order.iter().skip(self.next).take(self.horizon).copied().collect();
        for key in window {
            let Some((kept, bytes)) = self.kept.remove(&key) else { continue };
            let kept = match kept {
                Kept::Host(ids, copies) => {
                    let copier = self.copier.as_ref().ok_or_else(|| terr("offloading without its thread".to_string()))?;
                    let p = copier.submit(copies)?;
                    self.pool.host -= bytes;
                    self.pool.to_device(bytes);
                    Kept::Loading(ids, p)
                }
                other => other,
            };
            self.kept.insert(key, (kept, bytes));
        }
        Ok(())
    }
}

/// Inputs back on the device, as the forward left them (gradient leaves again where they were).
fn restore(ids: Vec<(ValueId, bool)>, copies: Vec<Tensor>) -> Result<Vec<(ValueId, Tensor)>, RuntimeError> {
    if ids.len() != copies.len() {
        return Err(terr(format!("{} kept inputs came back as {} tensors", ids.len(), copies.len())));
    }
    ids.into_iter()
        .zip(copies)
        .map(|((v, leaf), t)| Ok((v, if leaf { t.f_set_requires_grad(true)? } else { t })))
        .collect()
}
