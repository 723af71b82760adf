//! Where a process's tensors live (`--device cpu|cuda`, `--share-gpu`) and how its ranks talk,
//! decided once before anything runs, against what libtorch sees (csrc/device_shim.cpp).
//!
//! On the device: weights, parameters, optimizer state, data batches and activations. On the
//! host: message headers, scalars reduced between ranks, shape arithmetic, and everything
//! written to disk (checkpoints, npz and safetensors files are copied to the CPU when written).

use std::ffi::{CStr, c_char, c_int};
use std::sync::OnceLock;

use crate::runtime::comm::Backend;

unsafe extern "C" {
    fn smp_device_free_error(e: *mut c_char);
    fn smp_device_load_cuda() -> *mut c_char;
    fn smp_device_set_cuda(index: c_int) -> *mut c_char;
}

/// Takes a shim error message (null: success).
fn taken(err: *mut c_char) -> Option<String> {
    if err.is_null() {
        return None;
    }
    // SAFETY: the shim returns a NUL-terminated malloc'd string, freed here once.
    unsafe {
        let m = CStr::from_ptr(err).to_string_lossy().into_owned();
        smp_device_free_error(err);
        Some(m)
    }
}

/// The device a run asks for (`--device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// The host's CPU.
    Cpu,
    /// The rank's GPU (`LOCAL_RANK`).
    Cuda,
}

impl DeviceKind {
    /// The `--device` spelling.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "cpu",
            DeviceKind::Cuda => "cuda",
        }
    }
}

impl std::fmt::Display for DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DeviceKind {
    type Err = String;
    /// `cpu` or `cuda` (`--device`).
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceKind::Cpu),
            "cuda" => Ok(DeviceKind::Cuda),
            _ => Err(format!("`{s}`: expected cpu or cuda")),
        }
    }
}

/// What a run asks of devices (`--device`, `--share-gpu`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceRequest {
    /// `--device`; none: cuda when libtorch sees a GPU, else cpu.
    pub device: Option<DeviceKind>,
    /// `--share-gpu`: ranks may share a GPU, talking by Gloo through host memory (no NCCL).
    /// Changes nothing for a run on the CPU.
    pub share_gpu: bool,
}

/// What libtorch sees of CUDA on this machine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaView {
    /// GPUs libtorch sees.
    pub gpus: usize,
    /// Why it sees none, when `gpus` is 0.
    pub why_none: Option<String>,
}

impl CudaView {
    /// This machine's view, probed once per process: libtorch's CUDA library is loaded when an
    /// NVIDIA driver is present, then asked how many GPUs it sees.
    pub fn probe() -> &'static CudaView {
        static VIEW: OnceLock<CudaView> = OnceLock::new();
        VIEW.get_or_init(|| {
            // SAFETY: no arguments; the result is taken once.
            if let Some(why) = taken(unsafe { smp_device_load_cuda() }) {
                return CudaView { gpus: 0, why_none: Some(why) };
            }
            let gpus = tch::Cuda::device_count().max(0) as usize;
            let why_none = (gpus == 0).then(|| "libtorch's CUDA library loaded, and it counts 0 devices (CUDA_VISIBLE_DEVICES?)".to_string());
            CudaView { gpus, why_none }
        })
    }

    fn describe(&self) -> String {
        match (self.gpus, &self.why_none) {
            (0, Some(why)) => format!("libtorch sees no GPU: {why}"),
            (0, None) => "libtorch sees no GPU".into(),
            (1, _) => "libtorch sees 1 GPU".into(),
            (n, _) => format!("libtorch sees {n} GPUs"),
        }
    }
}

/// Where a process runs and how its ranks talk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    /// The device its tensors live on.
    pub device: tch::Device,
    /// The backends of its process groups.
    pub backend: Backend,
}

impl Default for Placement {
    fn default() -> Self {
        Placement::cpu()
    }
}

impl Placement {
    /// The CPU, ranks talking by Gloo.
    pub fn cpu() -> Placement {
        Placement { device: tch::Device::Cpu, backend: Backend::Gloo }
    }

    /// Whether tensors live on a GPU.
    pub fn is_cuda(&self) -> bool {
        self.device.is_cuda()
    }

    /// One line for the run's notes, e.g. `cuda:0, ranks talk by NCCL`.
    pub fn describe(&self) -> String {
        let dev = match self.device {
            tch::Device::Cuda(i) => format!("cuda:{i}"),
            _ => "cpu".into(),
        };
        let talk = match (self.backend, self.is_cuda()) {
            (Backend::Nccl, _) => "ranks talk by NCCL (messages by Gloo)",
            (Backend::Gloo, true) => "ranks talk by Gloo through host memory",
            (Backend::Gloo, false) => "ranks talk by Gloo",
        };
        format!("device {dev}, {talk}")
    }
}

/// A process's place among the job's ranks, as far as devices go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ranks {
    /// Its rank on this host (`LOCAL_RANK`).
    pub local_rank: usize,
    /// Ranks on this host (`LOCAL_WORLD_SIZE`).
    pub local_world: usize,
    /// Ranks of the job (`WORLD_SIZE`).
    pub world: usize,
}

impl Ranks {
    /// A process alone.
    pub fn single() -> Ranks {
        Ranks { local_rank: 0, local_world: 1, world: 1 }
    }

    /// Rank `local_rank` of a job of `world` ranks: `LOCAL_WORLD_SIZE` ranks on this host as
    /// torchrun and `launch` set it (without it, at least `local_rank + 1`).
    pub fn on_host(local_rank: usize, world: usize) -> Ranks {
        let local_world = std::env::var("LOCAL_WORLD_SIZE").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(0);
        Ranks { local_rank, local_world: local_world.max(local_rank + 1), world }
    }
}

/// A device request this machine or build cannot serve.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// `--device cuda` and libtorch sees no GPU.
    #[error("--device cuda: {seen}; run with --device cpu, or on a machine whose GPU libtorch sees")]
    NoGpu {
        /// What libtorch sees, and why.
        seen: String,
    },
    /// More ranks on this host than GPUs, without `--share-gpu`.
    #[error(
        "--device cuda: {ranks} ranks on this host, and libtorch sees {gpus} GPU(s): NCCL needs a GPU per rank; start at most {gpus} ranks per host, pass --share-gpu to let ranks share a GPU (Gloo through host memory), or run with --device cpu"
    )]
    TooFewGpus {
        /// Ranks on this host.
        ranks: usize,
        /// GPUs libtorch sees.
        gpus: usize,
    },
    /// Several ranks on GPUs in a build without NCCL, without `--share-gpu`.
    #[error(
        "--device cuda with {world} ranks talks by NCCL, and this smp-runner was built without it; build it with `make check-cuda` (cargo feature `cuda`), pass --share-gpu to talk by Gloo through host memory, or run with --device cpu"
    )]
    NoNccl {
        /// Ranks of the job.
        world: usize,
    },
    /// libtorch refused to make the GPU current.
    #[error("--device cuda: cannot use GPU {index}: {message}")]
    Cuda {
        /// The GPU.
        index: usize,
        /// libtorch's message.
        message: String,
    },
}

impl DeviceRequest {
    /// Where a process at `ranks` runs, given what libtorch sees (`view`) and whether this
    /// build has NCCL: the CPU when asked (or, by default, when no GPU is seen); else GPU
    /// `LOCAL_RANK` (shared round-robin under `--share-gpu`), its ranks talking by NCCL, or by
    /// Gloo through host memory under `--share-gpu`.
    pub fn resolve(&self, view: &CudaView, ranks: Ranks, nccl_built: bool) -> Result<Placement, DeviceError> {
        let cuda = match self.device {
            Some(DeviceKind::Cpu) => false,
            Some(DeviceKind::Cuda) => true,
            None => view.gpus > 0,
        };
        if !cuda {
            return Ok(Placement::cpu());
        }
        if view.gpus == 0 {
            return Err(DeviceError::NoGpu { seen: view.describe() });
        }
        if self.share_gpu {
            return Ok(Placement { device: tch::Device::Cuda(ranks.local_rank % view.gpus), backend: Backend::Gloo });
        }
        let on_host = ranks.local_world.max(ranks.local_rank + 1);
        if on_host > view.gpus {
            return Err(DeviceError::TooFewGpus { ranks: on_host, gpus: view.gpus });
        }
        if ranks.world <= 1 {
            return Ok(Placement { device: tch::Device::Cuda(ranks.local_rank), backend: Backend::Gloo });
        }
        if !nccl_built {
            return Err(DeviceError::NoNccl { world: ranks.world });
        }
        Ok(Placement { device: tch::Device::Cuda(ranks.local_rank), backend: Backend::Nccl })
    }

    /// [`Self::resolve`] on this machine and build (libtorch is asked about CUDA only when the
    /// request is not `--device cpu`).
    pub fn check(&self, ranks: Ranks) -> Result<Placement, DeviceError> {
        if self.device == Some(DeviceKind::Cpu) {
            return Ok(Placement::cpu());
        }
        self.resolve(CudaView::probe(), ranks, cfg!(feature = "cuda"))
    }

    /// [`Self::check`], with the GPU made this process's current device.
    pub fn place(&self, ranks: Ranks) -> Result<Placement, DeviceError> {
        let p = self.check(ranks)?;
        if let tch::Device::Cuda(index) = p.device {
            // SAFETY: a plain index; the result is taken once.
            if let Some(message) = taken(unsafe { smp_device_set_cuda(index as c_int) }) {
                return Err(DeviceError::Cuda { index, message });
            }
        }
        Ok(p)
    }

    /// The flags that ask this of a rank (`launch` passes them on).
    pub fn args(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(d) = self.device {
            out.extend(["--device".to_string(), d.name().to_string()]);
        }
        if self.share_gpu {
            out.push("--share-gpu".into());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(gpus: usize) -> CudaView {
        CudaView { gpus, why_none: (gpus == 0).then(|| "no NVIDIA driver on this machine (libcuda.so.1 does not load)".into()) }
    }

    fn ask(device: Option<DeviceKind>, share_gpu: bool) -> DeviceRequest {
        DeviceRequest { device, share_gpu }
    }

    const TWO_LOCAL: Ranks = Ranks { local_rank: 1, local_world: 2, world: 2 };

    #[test]
    fn the_default_follows_what_libtorch_sees() {
        assert_eq!(ask(None, false).resolve(&view(0), Ranks::single(), false), Ok(Placement::cpu()));
        let p = ask(None, false).resolve(&view(1), Ranks::single(), false).unwrap();
        assert_eq!(p, Placement { device: tch::Device::Cuda(0), backend: Backend::Gloo });
        // two ranks on two GPUs: each its own, NCCL between them
        let p = ask(None, false).resolve(&view(2), TWO_LOCAL, true).unwrap();
        assert_eq!(p, Placement { device: tch::Device::Cuda(1), backend: Backend::Nccl });
    }

    #[test]
    fn cpu_is_cpu_and_share_gpu_changes_nothing_there() {
        for gpus in [0, 1, 4] {
            for share in [false, true] {
                assert_eq!(ask(Some(DeviceKind::Cpu), share).resolve(&view(gpus), TWO_LOCAL, false), Ok(Placement::cpu()));
            }
        }
        // no GPU: the default is the CPU, with or without --share-gpu
        assert_eq!(ask(None, true).resolve(&view(0), TWO_LOCAL, false), Ok(Placement::cpu()));
    }

    #[test]
    fn cuda_without_a_gpu_names_the_flag_and_what_libtorch_sees() {
        let e = ask(Some(DeviceKind::Cuda), false).resolve(&view(0), Ranks::single(), true).unwrap_err();
        let m = e.to_string();
        assert!(m.starts_with("--device cuda:") && m.contains("libtorch sees no GPU") && m.contains("libcuda.so.1") && m.contains("--device cpu"), "{m}");
        // --share-gpu does not make a GPU appear
        assert!(matches!(ask(Some(DeviceKind::Cuda), true).resolve(&view(0), TWO_LOCAL, true), Err(DeviceError::NoGpu { .. })));
    }

    #[test]
    fn more_ranks_than_gpus_names_both_counts_unless_shared() {
        let four = Ranks { local_rank: 0, local_world: 4, world: 4 };
        let e = ask(Some(DeviceKind::Cuda), false).resolve(&view(2), four, true).unwrap_err();
        assert_eq!(e, DeviceError::TooFewGpus { ranks: 4, gpus: 2 });
        let m = e.to_string();
        assert!(m.contains("4 ranks on this host") && m.contains("sees 2 GPU(s)") && m.contains("--share-gpu"), "{m}");
        // a rank past the GPUs without LOCAL_WORLD_SIZE is caught by its own index
        let late = Ranks { local_rank: 2, local_world: 3, world: 3 };
        assert_eq!(ask(Some(DeviceKind::Cuda), false).resolve(&view(2), late, true), Err(DeviceError::TooFewGpus { ranks: 3, gpus: 2 }));
        // shared: round-robin over the GPUs, Gloo through host memory
        for (r, gpu) in [(0, 0), (1, 1), (2, 0), (3, 1)] {
            let at = Ranks { local_rank: r, ..four };
            let p = ask(Some(DeviceKind::Cuda), true).resolve(&view(2), at, false).unwrap();
            assert_eq!(p, Placement { device: tch::Device::Cuda(gpu), backend: Backend::Gloo });
        }
    }

    #[test]
    fn several_ranks_on_gpus_need_nccl_or_share_gpu() {
        let e = ask(Some(DeviceKind::Cuda), false).resolve(&view(2), TWO_LOCAL, false).unwrap_err();
        let m = e.to_string();
        assert!(m.contains("2 ranks") && m.contains("make check-cuda") && m.contains("feature `cuda`") && m.contains("--share-gpu"), "{m}");
        assert!(ask(Some(DeviceKind::Cuda), true).resolve(&view(2), TWO_LOCAL, false).is_ok());
        // one rank needs no NCCL
        assert!(ask(Some(DeviceKind::Cuda), false).resolve(&view(1), Ranks::single(), false).is_ok());
    }

    #[test]
    fn flags_round_trip_and_launch_passes_them_on() {
        assert_eq!("cuda".parse::<DeviceKind>(), Ok(DeviceKind::Cuda));
        assert_eq!("cpu".parse::<DeviceKind>(), Ok(DeviceKind::Cpu));
        assert!("gpu".parse::<DeviceKind>().unwrap_err().contains("expected cpu or cuda"));
        assert_eq!(ask(Some(DeviceKind::Cuda), true).args(), ["--device", "cuda", "--share-gpu"]);
        assert!(ask(None, false).args().is_empty());
    }
}
