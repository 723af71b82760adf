//! Activation offloading: the inputs an offloaded checkpointed layer keeps for its backward
//! (what its recompute starts from) move to host memory during its stage's forward and come back
//! `activation_loading_horizon` backwards ahead of their own, copied by a helper thread while
//! the rank computes. On CPU the "device" is an accounted pool: the bytes of kept inputs
//! resident on it and their peak, beside the bytes waiting in host memory, so a run shows what
//! left the device.
//!
//! Kept inputs are counted from the end of their forward to the end of their backward's
//! recompute, so as a backward starts the pool holds its own microbatch's inputs beside the
//! horizon's coming back; with offloading off the pool's peak is the plan's in-flight
//! microbatches' inputs.

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

/// One microbatch's offloaded inputs, wherever they are.
enum Kept {
    /// In host memory: ids and copies (detached: every recompute makes its own leaves).
    Host(Vec<ValueId>, Vec<Tensor>),
    /// Coming back to the device.
    Loading(Vec<ValueId>, Pending),
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

/// One microbatch's kept inputs of one recomputed stage: those that stay on the device, and
/// those only offloaded layers keep (moved to host memory outside the loading window).
#[derive(Default)]
struct Record {
    device: Vec<(ValueId, Tensor)>,
    device_bytes: u64,
    moved: Option<(Kept, u64)>,
}

/// Copies to host started during a forward: ids, copy, bytes.
type Outgoing = Vec<(Vec<ValueId>, Pending, u64)>;

/// The kept inputs of a rank's recomputed stages, and where they are.
pub(super) struct Offload {
    /// By global stage: whether any of its layers' kept inputs are offloaded.
    offloaded: Vec<bool>,
    /// Backwards whose inputs are back on the device ahead of their own.
    horizon: usize,
    /// The rank's backwards of recomputed stages, in program order.
    order: Vec<(usize, usize)>,
    /// Position in `order` of the next backward.
    next: usize,
    kept: HashMap<(usize, usize), Record>,
    /// Copies to host started during a forward, by (stage, microbatch).
    outgoing: HashMap<(usize, usize), Outgoing>,
    /// The pools.
    pub pool: PoolBytes,
    /// Bytes of the kept inputs the running backward took, on the device until it releases them.
    taken: u64,
    copier: Option<Copier>,
}

impl Offload {
    /// For a rank whose recomputed stages' backwards run in `order`, offloading the stages
    /// `offloaded` marks with `horizon` microbatches back ahead of their backward.
    pub fn new(offloaded: Vec<bool>, horizon: usize, order: Vec<(usize, usize)>) -> Offload {
        let copier = offloaded.iter().any(|&o| o).then(Copier::new);
        Offload { offloaded, horizon: horizon.max(1), order, next: 0, kept: HashMap::new(), outgoing: HashMap::new(), pool: PoolBytes::default(), taken: 0, copier }
    }

    /// Forgets the last step's inputs (the peaks stay).
    pub fn start_step(&mut self) {
        self.next = 0;
        self.kept.clear();
        self.outgoing.clear();
        self.pool.device = 0;
        self.pool.host = 0;
        self.taken = 0;
    }

    /// Whether (stage, microbatch)'s backward is among the next `horizon` ones.
    fn in_window(&self, key: (usize, usize)) -> bool {
        self.order.iter().skip(self.next).take(self.horizon).any(|&k| k == key)
    }

    fn offloads(&self, key: (usize, usize)) -> bool {
        self.offloaded.get(key.0).copied().unwrap_or(false) && !self.in_window(key)
    }

    /// During a forward, as a checkpointed layer starts: keeps the inputs it will recompute
    /// from. `stay` remain on the device; `movable` (kept by offloaded layers only) start
    /// their copy to host memory now, overlapping the rest of the forward, when their backward
    /// is outside the loading window — from then on they count as host memory, as the device
    /// frees them once the copy lands.
    pub fn keep(&mut self, s: usize, mb: usize, stay: Vec<(ValueId, Tensor)>, movable: Vec<(ValueId, Tensor)>) -> Result<(), RuntimeError> {
        let (stay, moving) = if self.offloads((s, mb)) { (stay, movable) } else { (stay.into_iter().chain(movable).collect(), Vec::new()) };
        let rec = self.kept.entry((s, mb)).or_default();
        let bytes: u64 = stay.iter().map(|(_, t)| bytes_of(t)).sum();
        rec.device_bytes += bytes;
        rec.device.extend(stay);
        self.pool.to_device(bytes);
        if !moving.is_empty() {
            let copier = self.copier.as_ref().ok_or_else(|| terr("offloading without its thread".to_string()))?;
            let bytes: u64 = moving.iter().map(|(_, t)| bytes_of(t)).sum();
            let pending = copier.submit(moving.iter().map(|(_, t)| t.shallow_clone()).collect())?;
            self.pool.to_host(bytes);
            let ids = moving.iter().map(|(v, _)| *v).collect();
            self.outgoing.entry((s, mb)).or_default().push((ids, pending, bytes));
        }
        Ok(())
    }

    /// At the end of a forward: waits for its copies to host memory.
    pub fn end_forward(&mut self, s: usize, mb: usize) -> Result<(), RuntimeError> {
        let Some(out) = self.outgoing.remove(&(s, mb)) else { return Ok(()) };
        let (mut ids, mut copies, mut total) = (Vec::new(), Vec::new(), 0);
        for (i, p, b) in out {
            ids.extend(i);
            copies.extend(p.wait()?);
            total += b;
        }
        self.kept.entry((s, mb)).or_default().moved = Some((Kept::Host(ids, copies), total));
        Ok(())
    }

    /// At the start of a backward: its kept inputs, on the device (waiting for their copy
    /// back if it is under way), counted there until [`Self::release_taken`]. The window moves
    /// on, and the inputs now within it start back.
    pub fn take(&mut self, s: usize, mb: usize) -> Result<Vec<(ValueId, Tensor)>, RuntimeError> {
        let rec = self.kept.remove(&(s, mb)).ok_or_else(|| terr(format!("stage {s} mb {mb}: backward without kept inputs")))?;
        let mut inputs = rec.device;
        self.taken += rec.device_bytes;
        if let Some((kept, bytes)) = rec.moved {
            inputs.extend(match kept {
                Kept::Host(ids, copies) => {
                    // not loaded ahead (a backward out of the window's order): now, in place
                    self.pool.host -= bytes;
                    self.pool.to_device(bytes);
                    restore(ids, copies.iter().map(owned_copy).collect::<Result<_, _>>()?)?
                }
                Kept::Loading(ids, p) => restore(ids, p.wait()?)?,
            });
            self.taken += bytes;
        }
        if let Some(pos) = self.order.iter().skip(self.next).position(|&k| k == (s, mb)) {
            self.next += pos + 1;
        }
        self.prefetch()?;
        Ok(inputs)
    }

    /// At the end of a backward's recompute: the inputs it took leave the device.
    pub fn release_taken(&mut self) {
        self.pool.device -= std::mem::take(&mut self.taken);
    }

    /// Starts bringing back the host-held inputs whose backward is within the window.
    fn prefetch(&mut self) -> Result<(), RuntimeError> {
        let window: Vec<(usize, usize)> = self.order.iter().skip(self.next).take(self.horizon).copied().collect();
        for key in window {
            let Some(rec) = self.kept.get_mut(&key) else { continue };
            let Some((kept, bytes)) = rec.moved.take() else { continue };
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
            rec.moved = Some((kept, bytes));
        }
        Ok(())
    }
}

/// Inputs back on the device, paired with their ids.
fn restore(ids: Vec<ValueId>, copies: Vec<Tensor>) -> Result<Vec<(ValueId, Tensor)>, RuntimeError> {
    if ids.len() != copies.len() {
        return Err(terr(format!("{} kept inputs came back as {} tensors", ids.len(), copies.len())));
    }
    Ok(ids.into_iter().zip(copies).collect())
}
