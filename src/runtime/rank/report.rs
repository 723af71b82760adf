//! What a rank of a plan measures: the trained state it holds (parameters, gradients,
//! optimizer moments) and its peaks, step times and resident memory, gathered over the world.

use tch::{Kind, Tensor};

use crate::runtime::RuntimeError;
use crate::runtime::comm::ProcessGroup;

pub use super::memory::StateBytes;
use super::memory::{MemoryParts, PeakTracker};
use crate::runtime::terr;
use crate::runtime::train::{CheckpointRecord, EvalRecord, FailedCheckpoint, StepRecord, StragglerRecord};

/// What one rank measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RankStats {
    /// Mean step time (first step excluded), seconds.
    pub step_time_s: f64,
    /// Peak resident memory of the process.
    pub peak_rss_bytes: u64,
    /// The trained state held when its total peaked (counted between instructions and around
    /// collectives' buffers, as tensors are allocated and released).
    pub peak_state: StateBytes,
    /// The most parameter bytes held at any point (gathered ZeRO-3 stages included).
    pub peak_param_bytes: u64,
    /// Parameter bytes held between uses (after the last step).
    pub resident_param_bytes: u64,
    /// Bytes of weights the rank read (from the model file, its external data or a
    /// checkpoint, or generated): (trained parameters, everything else).
    pub weight_bytes_read: crate::runtime::state::weights::ReadBytes,
    /// Mean CPU time per step (first step excluded), seconds.
    pub cpu_time_s: f64,
    /// Where the mean step's wall time went (first step excluded).
    pub phases: PhaseTimes,
    /// The most bytes of recomputed stages' kept inputs resident on the device.
    pub peak_kept_bytes: u64,
    /// The most bytes of kept inputs offloaded to host memory.
    pub peak_offloaded_bytes: u64,
    /// Context-parallel all-gathers in one forward of the rank's stages (0 without cp).
    pub context_gathers: u64,
    /// The bytes of the tensors held at the rank's peak, by part (none on a GPU, whose
    /// allocator is not read yet).
    pub memory: Option<MemoryParts>,
}

/// Wall seconds of a step by kind of instruction.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PhaseTimes {
    /// Forward, backward and weight-gradient passes (recomputation included).
    pub compute_s: f64,
    /// Posting sends, and waiting for the step's sends to complete at its end.
    pub send_s: f64,
    /// Waiting for received activations and gradients.
    pub recv_s: f64,
    /// All-reduces, reduce-scatters and all-gathers (tensor, data and ZeRO groups).
    pub collective_s: f64,
    /// Gradient clipping and the optimizer update.
    pub optimizer_s: f64,
}

impl PhaseTimes {
    /// The sum of the phases.
    pub fn total(&self) -> f64 {
        self.compute_s + self.send_s + self.recv_s + self.collective_s + self.optimizer_s
    }

    fn as_array(&self) -> [f64; 5] {
        [self.compute_s, self.send_s, self.recv_s, self.collective_s, self.optimizer_s]
    }

    fn from_slice(c: &[f64]) -> PhaseTimes {
        PhaseTimes { compute_s: c[0], send_s: c[1], recv_s: c[2], collective_s: c[3], optimizer_s: c[4] }
    }

    /// Adds `other` into these.
    pub fn add(&mut self, other: &PhaseTimes) {
        let (a, b) = (self.as_array(), other.as_array());
        *self = PhaseTimes::from_slice(&std::array::from_fn::<f64, 5, _>(|i| a[i] + b[i]));
    }
}

/// What a run measured.
#[derive(Clone, Debug)]
pub struct RankReport {
    /// Per step: the global mean loss (identical on every rank) and this rank's step time.
    pub steps: Vec<StepRecord>,
    /// Every rank's measurements, by global rank.
    pub ranks: Vec<RankStats>,
    /// Validation losses (identical on every rank).
    pub eval: Vec<EvalRecord>,
    /// Checkpoints completed (on rank 0, which writes the manifests).
    pub checkpoints: Vec<CheckpointRecord>,
    /// Checkpoints the run went on without.
    pub failed_checkpoints: Vec<FailedCheckpoint>,
    /// Ranks named stragglers, window by window (the same on every rank).
    pub stragglers: Vec<StragglerRecord>,
}

/// Bytes of a tensor's elements (0 when undefined).
pub(super) fn bytes_of(t: &Tensor) -> u64 {
    if t.defined() { (t.numel() * t.kind().elt_size_in_bytes()) as u64 } else { 0 }
}

/// Bytes of the kept-input pools, now and at their peaks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolBytes {
    /// Kept inputs resident on the device (loaded back, or never offloaded).
    pub device: u64,
    /// The most `device` held.
    pub device_peak: u64,
    /// Kept inputs waiting in host memory.
    pub host: u64,
    /// The most `host` held.
    pub host_peak: u64,
}

impl PoolBytes {
    /// Adds `b` bytes to the device pool.
    pub(super) fn to_device(&mut self, b: u64) {
        self.device += b;
        self.device_peak = self.device_peak.max(self.device);
    }

    /// Adds `b` bytes to the host pool.
    pub(super) fn to_host(&mut self, b: u64) {
        self.host += b;
        self.host_peak = self.host_peak.max(self.host);
    }
}

/// Peaks of the held state.
#[derive(Default)]
pub(super) struct Tally {
    peak: StateBytes,
    peak_params: u64,
    /// Parameter bytes held after the last step.
    pub resident: u64,
    /// Phase times summed over the steps after the first.
    pub phases: PhaseTimes,
    /// The kept-input pools (their peaks over the run).
    pub kept: PoolBytes,
    /// Context-parallel all-gathers in one forward of the rank's stages.
    pub context_gathers: u64,
    /// The highest instruction window of the tensors' bytes and its parts.
    pub memory: PeakTracker,
    /// Whether the rank's tensors are on a GPU (the counting allocator sees only the CPU's).
    pub on_gpu: bool,
}

impl Tally {
    /// An empty tally of a rank whose stages hold `n` context-parallel all-gathers, its tensors
    /// on a GPU or not.
    pub fn new(n: u64, on_gpu: bool) -> Tally {
        Tally { context_gathers: n, on_gpu, ..Tally::default() }
    }

    /// Counts `now` towards the peaks.
    pub fn observe(&mut self, now: StateBytes) {
        if now.total() > self.peak.total() {
            self.peak = now;
        }
        self.peak_params = self.peak_params.max(now.params);
    }
}

/// Every rank's measurements, gathered over `world` (each rank passes its own records).
pub(super) fn gather(world: &ProcessGroup, size: usize, records: Vec<StepRecord>, tally: &Tally, read: crate::runtime::state::weights::ReadBytes) -> Result<RankReport, RuntimeError> {
    let timed: Vec<f64> = records.iter().skip(usize::from(records.len() > 1)).map(|s| s.time_s).collect();
    let mean = timed.iter().sum::<f64>() / timed.len().max(1) as f64;
    let cpu: Vec<f64> = records.iter().skip(usize::from(records.len() > 1)).map(|s| s.cpu_s).collect();
    let cpu_mean = cpu.iter().sum::<f64>() / cpu.len().max(1) as f64;
    let phases = tally.phases.as_array().map(|x| x / timed.len().max(1) as f64);
    const STATS: usize = 27;
    let p = tally.peak;
    let mine = Tensor::from_slice(&[
        mean,
        peak_rss_bytes() as f64,
        p.params as f64,
        p.grads as f64,
        p.optimizer as f64,
        tally.peak_params as f64,
        tally.resident as f64,
        read.params as f64,
        read.other as f64,
        cpu_mean,
        phases[0],
        phases[1],
        phases[2],
        phases[3],
        phases[4],
        tally.kept.device_peak as f64,
        tally.kept.host_peak as f64,
        tally.context_gathers as f64,
        f64::from(u8::from(tally.memory.seen && !tally.on_gpu)),
    ]
    .into_iter()
    .chain(tally.memory.peak.to_array().map(|b| b as f64))
    .collect::<Vec<f64>>());
    let all = Tensor::f_zeros([(STATS * size) as i64], (Kind::Double, tch::Device::Cpu))?;
    world.all_gather(&all, &mine)?;
    let all: Vec<f64> = Vec::<f64>::try_from(&all).map_err(|e| terr(e.to_string()))?;
    let ranks = all
        .chunks(STATS)
        .map(|c| RankStats {
            step_time_s: c[0],
            peak_rss_bytes: c[1] as u64,
            peak_state: StateBytes { params: c[2] as u64, grads: c[3] as u64, optimizer: c[4] as u64 },
            peak_param_bytes: c[5] as u64,
            resident_param_bytes: c[6] as u64,
            weight_bytes_read: crate::runtime::state::weights::ReadBytes { params: c[7] as u64, other: c[8] as u64 },
            cpu_time_s: c[9],
            phases: PhaseTimes::from_slice(&c[10..15]),
            peak_kept_bytes: c[15] as u64,
            peak_offloaded_bytes: c[16] as u64,
            context_gathers: c[17] as u64,
            memory: (c[18] > 0.5).then(|| MemoryParts::from_slice(&c[19..27].iter().map(|&b| b as u64).collect::<Vec<u64>>())),
        })
        .collect();
    world.barrier()?;
    Ok(RankReport { steps: records, ranks, eval: Vec::new(), checkpoints: Vec::new(), failed_checkpoints: Vec::new(), stragglers: Vec::new() })
}

/// Peak resident memory of this process (bytes), from /proc.
pub fn peak_rss_bytes() -> u64 {
    let Ok(status) = std::fs::read_to_string("/proc/self/status") else { return 0 };
    status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|k| k.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}
