//! Cluster specifications: embedded presets (`h100-80gb:64`) and TOML cluster files.
//!
//! Units are SI: FLOP/s, bytes, bytes/s, seconds. Link bandwidths are per GPU and per
//! direction: a preset's NVLink figure is half the datasheet's bidirectional total
//! (H100: 900 GB/s → 450 GB/s), its network figure the NIC rate per GPU (400 Gb/s → 50 GB/s).
//!
//! A cluster file is a TOML table with the fields of [`ClusterSpec`]; with `preset = "NAME"`
//! every field not given is taken from that preset:
//!
//! ```toml
//! preset = "h100-80gb"
//! devices = 64
//! inter_node_bandwidth = 25e9
//! fused_attention = false   # price attention scores as materialised (default per preset)
//! fused_norms = false       # price RMS norms as composite: a normalised copy kept (default per preset)
//! overlapped_gathers = false  # ZeRO-3 gathers paid whole, not hidden behind the layer before (default per preset)
//! price_per_device_hour = 2.99   # USD; the presets' list prices: LIST_PRICES
//! host_bandwidth = 450e9   # device ↔ host, per direction (NVLink-C2C on GH200-class parts)
//! fp8_flops = 1979e12      # dense fp8 rate; none: the device runs no fp8 (Float8 linears refused)
//! ```
//!
//! Compute efficiency: `[efficiency] peak, half_flops` is the curve by FLOPs every op is priced
//! on, `peak` also the plateau of large matrix products; the GPU presets add a GEMM-efficiency
//! surface over (m, n, k) ([`GemmSurface`], XLA's sm_90 table), relative to that plateau, which
//! prices every product with a weight operand. A file may give its own:
//!
//! ```toml
//! [gemm_surface]
//! sizes = [256.0, 4096.0]        # the grid along each of m, n and k
//! relative = [0.01, 0.1, 0.1, 0.5, 0.1, 0.5, 0.5, 1.0]   # [m][n][k], k fastest, 1 at the top
//! ```
//!
//! Files without one take their preset's (none for `cpu` and for files without a preset: their
//! products are priced on the curve at 2·m·n·k FLOPs, which `smp-runner calibrate` fits).
//!
//! The `cpu` preset describes one machine: its memory, its cores and, when one exists, the
//! calibration file `smp-runner calibrate` wrote. This module reads none of these from the
//! host: the binaries gather them ([`MachineFacts`]) and pass them in, and a cluster file can
//! state them instead, to plan for another machine:
//!
//! ```toml
//! preset = "cpu"
//! [machine]
//! memory_bytes = 25769803776
//! cores = 2
//! calibration = "cpu-calibration.toml"   # optional; relative to this file
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::gemm::GemmSurface;
use super::link::Link;
use crate::ir::{DType, Precision};

/// Errors reading a cluster spec.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// Unknown preset name.
    #[error("unknown cluster preset `{0}`: expected one of a100-40gb, a100-80gb, h100-80gb, h200, v100-16gb, cpu, or a FILE.toml")]
    UnknownPreset(String),
    /// Float8 linears were asked of a device without an fp8 rate.
    #[error("cluster `{spec}`: the {device} has no fp8 tensor rate, so Float8 linears cannot be priced on it (use an H100 or H200 preset, or give `fp8_flops` in a cluster file)")]
    NoFp8 {
        /// The preset or file.
        spec: String,
        /// Its device.
        device: String,
    },
    /// The device count after `:` is not a positive integer.
    #[error("cluster `{spec}`: device count `{count}` is not a positive integer (write PRESET:N, e.g. h100-80gb:64)")]
    BadCount {
        /// The whole spec string.
        spec: String,
        /// The text after the colon.
        count: String,
    },
    /// A cluster file could not be read.
    #[error("cluster file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A cluster file is not valid TOML for a cluster.
    #[error("cluster file {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The TOML error.
        message: String,
    },
    /// A field is missing and no preset supplies it.
    #[error("cluster file {path}: field `{field}` is missing (give it, or `preset = \"NAME\"` to take it from a preset)")]
    Missing {
        /// The file.
        path: PathBuf,
        /// The missing field.
        field: &'static str,
    },
    /// The `cpu` preset was asked for without the facts of the machine it describes.
    #[error("cluster `{spec}`: the `cpu` preset describes a machine, and no machine facts were given (a cluster file with `preset = \"cpu\"` can state them in a `[machine]` table: memory_bytes, cores, calibration)")]
    NoMachineFacts {
        /// The spec or file asked for.
        spec: String,
    },
    /// A field has a value no cluster can have.
    #[error("cluster {source_name}: field `{field}` must be {requirement}, got {value}")]
    Invalid {
        /// Preset name or file.
        source_name: String,
        /// The field.
        field: &'static str,
        /// What it must be.
        requirement: &'static str,
        /// The value given.
        value: f64,
    },
}

/// The least-squares line `y = intercept + slope·x` through `(x, y)` points: `(intercept,
/// slope)`, or `None` with fewer than two distinct `x`.
pub fn least_squares_line(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let (mx, my) = (points.iter().map(|p| p.0).sum::<f64>() / n, points.iter().map(|p| p.1).sum::<f64>() / n);
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if sxx <= 0.0 {
        return None;
    }
    let slope = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum::<f64>() / sxx;
    Some((my - slope * mx, slope))
}

/// Achievable fraction of the peak compute rate as a function of the operation's size:
/// `peak · flops / (flops + half_flops)` — small kernels are latency bound, large GEMMs reach
/// `peak`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EfficiencyCurve {
    /// Fraction of the datasheet rate reached by very large operations (0..1].
    pub peak: f64,
    /// FLOPs at which half of `peak` is reached.
    pub half_flops: f64,
}

impl EfficiencyCurve {
    /// Efficiency for an operation of `flops` floating-point operations.
    pub fn at(&self, flops: f64) -> f64 {
        if flops <= 0.0 {
            return self.peak;
        }
        self.peak * flops / (flops + self.half_flops.max(0.0))
    }

    /// Least-squares fit to measured `(flops, efficiency)` points (what `calibrate` measures:
    /// achieved rate over the rate used as peak), linear in 1/flops:
    /// 1/eff = 1/peak + (half_flops/peak)·(1/flops). `None` with fewer than two distinct sizes
    /// or a fit that is not positive.
    pub fn fit(points: &[(f64, f64)]) -> Option<EfficiencyCurve> {
        let pts: Vec<(f64, f64)> =
            points.iter().filter(|(f, e)| *f > 0.0 && *e > 0.0).map(|&(f, e)| (1.0 / f, 1.0 / e)).collect();
        let (intercept, slope) = least_squares_line(&pts)?;
        if intercept <= 0.0 {
            return None;
        }
        let peak = (1.0 / intercept).min(1.0);
        Some(EfficiencyCurve { peak, half_flops: (slope * peak).max(0.0) })
    }
}

/// A homogeneous cluster: `devices` devices, `devices_per_node` of them per node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSpec {
    /// Preset name or file the spec came from (`h100-80gb`, `cluster.toml`).
    pub name: String,
    /// Device model, for reports.
    pub device: String,
    /// Number of devices.
    pub devices: usize,
    /// Devices per node (sharing the fast intra-node link).
    pub devices_per_node: usize,
    /// Dense bf16/fp16 tensor rate, FLOP/s.
    pub bf16_flops: f64,
    /// Dense fp16 rate where it differs from `bf16_flops` (a calibrated CPU), FLOP/s; none:
    /// the bf16 rate (GPU tensor cores run both alike).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp16_flops: Option<f64>,
    /// fp32 rate, FLOP/s (fp64 is taken as half of it).
    pub fp32_flops: f64,
    /// Memory per device, bytes.
    pub memory_bytes: u64,
    /// Memory bandwidth per device, bytes/s.
    pub hbm_bandwidth: f64,
    /// Achievable fraction of `hbm_bandwidth` for memory-bound kernels.
    pub hbm_efficiency: f64,
    /// Intra-node link (NVLink) bandwidth per device and direction, bytes/s.
    pub intra_node_bandwidth: f64,
    /// Inter-node network bandwidth per device and direction, bytes/s.
    pub inter_node_bandwidth: f64,
    /// Latency (alpha) of one intra-node message, seconds.
    pub intra_node_latency: f64,
    /// Latency (alpha) of one inter-node message, seconds.
    pub inter_node_latency: f64,
    /// Compute efficiency by operation size.
    pub efficiency: EfficiencyCurve,
    /// Efficiency of matrix products with a weight operand by shape, relative to
    /// `efficiency.peak` (GPU presets: XLA's sm_90 table); `None`: those are priced on
    /// `efficiency` too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm_surface: Option<GemmSurface>,
    /// Memory per device kept free for the framework, kernels' workspace and fragmentation,
    /// bytes (subtracted from `memory_bytes` by [`ClusterSpec::usable_memory`]).
    pub workspace_bytes: u64,
    /// Whether attention runs as one fused kernel (FlashAttention) that keeps the `s × s`
    /// scores on chip, so the scores' memory traffic is not charged (`NodeFigures::score_bytes`).
    /// True for the H100 and H200 presets (the kernels training runs on them use: Llama 3),
    /// false for A100, V100 and `cpu` (Megatron-LM's 2021 runs of Table 1 materialised the
    /// scores; the runner's libtorch ops do). A cluster file may set it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fused_attention: bool,
    /// Whether RMS normalisation runs as one fused kernel keeping its input and one statistic
    /// per row (CUDA builds of libtorch, Transformer Engine, Apex), or composite, as libtorch
    /// runs it on a CPU, whose product with the scale also keeps the normalised input
    /// (`NodeFigures::norm_saved_bytes`). True for the GPU presets, false for `cpu`. A cluster
    /// file may set it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fused_norms: bool,
    /// Whether a prefetched ZeRO-3 weight gather runs beside compute: FSDP, Megatron-Core and
    /// the runner start a layer's gather while the layer before it computes, on its own stream
    /// (NCCL on a GPU), so only what exceeds that compute is paid. True for the GPU presets;
    /// false for `cpu`, where Gloo's transfers run on the cores the compute uses. A cluster
    /// file may set it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub overlapped_gathers: bool,
    /// The machine facts a `cpu` spec was derived from; `None` for GPU presets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub machine: Option<MachineFacts>,
    /// Rental price of one device for one hour, USD (presets: [`LIST_PRICES`]; a cluster file
    /// may set its own). `None`: unknown, and costs are not predicted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub price_per_device_hour: Option<f64>,
    /// Measured links of the collectives inside a node, each replacing the intra-node link
    /// for that collective (`smp-runner calibrate` writes them; `None` for the presets).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collectives: Option<CollectiveLinks>,
    /// Effective bandwidth between a device and host memory, per direction, bytes/s: what
    /// activation offloading moves over. Presets: PCIe Gen3 12 GB/s (V100), Gen4 25 GB/s
    /// (A100), Gen5 50 GB/s (H100, H200); a GH200-class part's NVLink-C2C ≈ 450 GB/s goes in a
    /// cluster file; `cpu`: a memcpy (half the memory bandwidth: read and write). `None`: no
    /// host link is known, and nothing is offloaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_bandwidth: Option<f64>,
    /// Streaming multiprocessors per device (NVIDIA's whitepapers: V100 80, A100 108, H100 SXM
    /// and H200 132): what a communication kernel running on some of them takes from compute
    /// beside it ([`ClusterSpec::compute_share_beside`]). `None` (`cpu`): no share priced.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sms: Option<u32>,
    /// Dense fp8 tensor rate, FLOP/s (the H100 and H200 datasheets: 1,979 TFLOP/s, twice
    /// bf16); `None` where the device has no fp8 tensor cores (A100, V100, `cpu`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8_flops: Option<f64>,
    /// Whether the job runs its blocks' linear layers in fp8 with per-tensor dynamic scaling
    /// (torchao's `Float8Linear`, Transformer Engine's fp8 recipes): their products at
    /// `fp8_flops`, beside the casts of their operands (`cost::compute::float8_cast_bytes`).
    /// A setting of the job, not of the cluster file: set from `PlanOptions::float8_linears`
    /// (the plan records it as `parallel.float8_linears`).
    #[serde(skip)]
    pub float8_linears: bool,
}

/// Per-collective alpha-beta links inside a node, as the runtime calls them (Gloo on `cpu`:
/// each call pays a latency many times a message's, and copies in and out of its buffers).
/// `α` is charged per ring step and `bw` on the ring's bytes, as in `cost::comm`: with 2 ranks
/// an all-reduce of B costs 2α + B/bw, an all-gather of a B output or a reduce-scatter of a B
/// input α + B/(2·bw).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CollectiveLinks {
    /// The all-reduce (Megatron's forward *g* and backward *f*, data-parallel gradients).
    pub all_reduce: Link,
    /// The all-gather along an axis (tensor outputs, sequence parallelism, ZeRO weights).
    pub all_gather: Link,
    /// The reduce-scatter along an axis (sequence parallelism, ZeRO gradients).
    pub reduce_scatter: Link,
}

/// What the `cpu` preset needs to know about a machine. Gathered from the host by the binaries,
/// or stated in a cluster file's `[machine]` table; recorded in every plan made from it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MachineFacts {
    /// Total memory of the machine, bytes (split evenly over its devices).
    pub memory_bytes: u64,
    /// Cores: the device count of `cpu` without `:N`.
    pub cores: usize,
    /// The calibration file whose rates override the preset's defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<CalibrationFile>,
    /// Where the facts came from.
    pub source: FactSource,
}

/// A calibration file, identified by path and content hash.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CalibrationFile {
    /// Path as found.
    pub path: String,
    /// SHA-256 of its bytes, hex.
    pub sha256: String,
    /// Its text (TOML cluster fields); not recorded in plans.
    #[serde(skip)]
    pub text: String,
}

impl CalibrationFile {
    /// A calibration file from its path and text (the hash is computed here).
    pub fn new(path: impl Into<String>, text: String) -> CalibrationFile {
        use sha2::{Digest, Sha256};
        let sha256 = Sha256::digest(text.as_bytes()).iter().map(|b| format!("{b:02x}")).collect();
        CalibrationFile { path: path.into(), sha256, text }
    }
}

/// The origin of a spec's [`MachineFacts`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FactSource {
    /// Read from the machine that made the plan.
    Host,
    /// Stated in this cluster file.
    ClusterFile(String),
}

const GB: f64 = 1e9;
const GIB: u64 = 1 << 30;
const MIB: f64 = (1u64 << 20) as f64;

/// A device's list price per hour, and where it comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ListPrice {
    /// The preset it belongs to.
    pub preset: &'static str,
    /// USD per device-hour.
    pub usd_per_device_hour: f64,
    /// The offer the figure is taken from.
    pub source: &'static str,
}

/// Prices per device-hour of the GPU presets: AWS EC2 on-demand list prices (Linux, US East
/// (N. Virginia)) of the 8-GPU instance with that device, divided by 8, as published at the
/// instance's launch. Cloud prices change (AWS has lowered P4 and P5 prices since, and
/// reserved, spot and smaller clouds are cheaper): edit this table, or give
/// `price_per_device_hour` in a cluster file (`preset = "h100-80gb"` plus your price). H200 has
/// no figure here: its instances were sold as capacity blocks, whose prices move monthly.
pub const LIST_PRICES: &[ListPrice] = &[
    ListPrice { preset: "a100-40gb", usd_per_device_hour: 32.7726 / 8.0, source: "AWS p4d.24xlarge, $32.7726/h" },
    ListPrice { preset: "a100-80gb", usd_per_device_hour: 40.9657 / 8.0, source: "AWS p4de.24xlarge, $40.9657/h" },
    ListPrice { preset: "h100-80gb", usd_per_device_hour: 98.32 / 8.0, source: "AWS p5.48xlarge, $98.32/h" },
    ListPrice { preset: "v100-16gb", usd_per_device_hour: 24.48 / 8.0, source: "AWS p3.16xlarge, $24.48/h" },
];

/// The list price of a preset's device, USD per hour ([`LIST_PRICES`]).
pub fn list_price(preset: &str) -> Option<f64> {
    LIST_PRICES.iter().find(|p| p.preset == preset).map(|p| p.usd_per_device_hour)
}

/// The names of the embedded presets.
pub const PRESETS: &[&str] = &["a100-40gb", "a100-80gb", "h100-80gb", "h200", "v100-16gb", "cpu"];

#[allow(clippy::too_many_arguments)]
fn gpu(
    name: &str,
    device: &str,
    bf16_tflops: f64,
    fp32_tflops: f64,
    memory_mib: f64,
    hbm_tb_s: f64,
    nvlink_gb_s_bidir: f64,
    network_gbit_s: f64,
    host_gb_s: f64,
) -> ClusterSpec {
    ClusterSpec {
        name: name.to_string(),
        device: device.to_string(),
        devices: 8,
        devices_per_node: 8,
        bf16_flops: bf16_tflops * 1e12,
        fp16_flops: None,
        fp32_flops: fp32_tflops * 1e12,
        memory_bytes: (memory_mib * MIB) as u64,
        hbm_bandwidth: hbm_tb_s * 1e12,
        hbm_efficiency: 0.8,
        intra_node_bandwidth: nvlink_gb_s_bidir * GB / 2.0,
        inter_node_bandwidth: network_gbit_s * GB / 8.0,
        intra_node_latency: 5e-6,
        inter_node_latency: 15e-6,
        // Large bf16 GEMMs reach ~75 % of the datasheet; half of that at ~2 GFLOP (a 1024³ GEMM).
        efficiency: EfficiencyCurve { peak: 0.75, half_flops: 2e9 },
        // Weight products by shape: XLA's measured H100 table, relative to that 75 % plateau.
        // No published A100 or V100 table was found: theirs take the H100's shape.
        gemm_surface: Some(GemmSurface::xla_sm90()),
        workspace_bytes: 2 * GIB,
        fused_attention: false,
        fused_norms: true,
        overlapped_gathers: true,
        machine: None,
        price_per_device_hour: list_price(name),
        collectives: None,
        host_bandwidth: Some(host_gb_s * GB),
        sms: None,
        fp8_flops: None,
        float8_linears: false,
    }
}

impl ClusterSpec {
    /// An embedded GPU preset with its default device count (one node). `cpu` describes a
    /// machine, so it needs [`ClusterSpec::cpu`] or [`ClusterSpec::parse_on`].
    pub fn preset(name: &str) -> Result<ClusterSpec, ClusterError> {
        Ok(match name {
            // host links: PCIe Gen4 x16 (A100), Gen5 x16 (H100, H200), Gen3 x16 (V100), effective.
            // Memory: the total `nvidia-smi` reports (ECC on), what a process can allocate
            // from before the workspace margin; the names' "80GB" are decimal and round.
            "a100-40gb" => ClusterSpec { sms: Some(108), ..gpu(name, "NVIDIA A100 40GB", 312.0, 19.5, 40_960.0, 1.555, 600.0, 200.0, 25.0) },
            "a100-80gb" => ClusterSpec { sms: Some(108), ..gpu(name, "NVIDIA A100 80GB", 312.0, 19.5, 81_920.0, 2.039, 600.0, 200.0, 25.0) },
            "h100-80gb" => ClusterSpec { fused_attention: true, sms: Some(132), fp8_flops: Some(1979e12), ..gpu(name, "NVIDIA H100 80GB SXM", 989.0, 67.0, 81_559.0, 3.35, 900.0, 400.0, 50.0) },
            "h200" => ClusterSpec { fused_attention: true, sms: Some(132), fp8_flops: Some(1979e12), ..gpu(name, "NVIDIA H200 141GB SXM", 989.0, 67.0, 143_771.0, 4.8, 900.0, 400.0, 50.0) },
            "v100-16gb" => ClusterSpec { sms: Some(80), ..gpu(name, "NVIDIA V100 16GB SXM2", 125.0, 15.7, 16_160.0, 0.9, 300.0, 25.0, 12.0) },
            "cpu" => return Err(ClusterError::NoMachineFacts { spec: name.to_string() }),
            other => return Err(ClusterError::UnknownPreset(other.to_string())),
        })
    }

    /// Parses `PRESET`, `PRESET:N`, `FILE.toml` or `FILE.toml:N` without machine facts: `cpu`
    /// works only through a cluster file that states them.
    pub fn parse(spec: &str) -> Result<ClusterSpec, ClusterError> {
        ClusterSpec::parse_with(spec, None)
    }

    /// Parses like [`ClusterSpec::parse`]; `cpu` (and a `cpu`-based file without a `[machine]`
    /// table) describes the machine `host`.
    pub fn parse_on(spec: &str, host: &MachineFacts) -> Result<ClusterSpec, ClusterError> {
        ClusterSpec::parse_with(spec, Some(host))
    }

    fn parse_with(spec: &str, host: Option<&MachineFacts>) -> Result<ClusterSpec, ClusterError> {
        let spec = spec.trim();
        let (base, count) = match spec.rsplit_once(':') {
            Some((b, c)) if !c.contains('/') && !c.contains('.') => (b, Some(c)),
            _ => (spec, None),
        };
        let count = match count {
            Some(c) => Some(c.parse::<usize>().ok().filter(|&n| n > 0).ok_or_else(|| ClusterError::BadCount {
                spec: spec.to_string(),
                count: c.to_string(),
            })?),
            None => None,
        };
        if base == "cpu" {
            let host = host.ok_or_else(|| ClusterError::NoMachineFacts { spec: spec.to_string() })?;
            return ClusterSpec::cpu(host, count);
        }
        let mut cluster = if base.ends_with(".toml") || Path::new(base).is_file() {
            ClusterSpec::from_file_on(Path::new(base), host, count)?
        } else {
            ClusterSpec::preset(base)?
        };
        if let Some(n) = count {
            cluster.devices = n;
        }
        if cluster.machine.is_some() {
            // a cpu machine is one node
            cluster.devices_per_node = cluster.devices;
        }
        cluster.devices_per_node = cluster.devices_per_node.min(cluster.devices).max(1);
        Ok(cluster)
    }

    /// Reads a TOML cluster file (see the module docs) without host facts.
    pub fn from_file(path: &Path) -> Result<ClusterSpec, ClusterError> {
        ClusterSpec::from_file_on(path, None, None)
    }

    /// `devices`: the count after the file's `:`, which a `cpu` machine's memory is split over.
    fn from_file_on(path: &Path, host: Option<&MachineFacts>, devices: Option<usize>) -> Result<ClusterSpec, ClusterError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ClusterError::Io { path: path.to_path_buf(), source })?;
        ClusterSpec::from_toml_on(&text, path, host, devices)
    }

    /// Parses TOML text; `path` names the source in errors and anchors a relative calibration path.
    pub fn from_toml(text: &str, path: &Path) -> Result<ClusterSpec, ClusterError> {
        ClusterSpec::from_toml_on(text, path, None, None)
    }

    fn from_toml_on(
        text: &str,
        path: &Path,
        host: Option<&MachineFacts>,
        devices: Option<usize>,
    ) -> Result<ClusterSpec, ClusterError> {
        let mut file: ClusterFile = toml::from_str(text)
            .map_err(|e| ClusterError::Parse { path: path.to_path_buf(), message: e.to_string() })?;
        let base = match file.preset.as_deref() {
            Some("cpu") => {
                let facts = match file.machine.take() {
                    Some(stated) => stated.resolve(path)?,
                    None => host.cloned().ok_or_else(|| ClusterError::NoMachineFacts { spec: path.display().to_string() })?,
                };
                Some(ClusterSpec::cpu(&facts, devices.or(file.devices))?)
            }
            Some(p) => Some(ClusterSpec::preset(p)?),
            None => None,
        };
        if file.machine.is_some() {
            return Err(ClusterError::Parse {
                path: path.to_path_buf(),
                message: "a `[machine]` table belongs to `preset = \"cpu\"` files only".to_string(),
            });
        }
        if file.concurrent.is_some() {
            return Err(ClusterError::Parse {
                path: path.to_path_buf(),
                message: "a `[concurrent]` table belongs to the calibration file a `cpu` machine names (`smp-runner calibrate` writes it)".to_string(),
            });
        }
        let name = file
            .name
            .clone()
            .unwrap_or_else(|| path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default());
        let spec = file.resolve(name, base.as_ref(), path)?;
        spec.validate()?;
        Ok(spec)
    }

    /// Writes this spec as a cluster file (all fields).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_default()
    }

    /// Checks that rates, sizes and counts are positive.
    pub fn validate(&self) -> Result<(), ClusterError> {
        let checks: [(&'static str, f64); 11] = [
            ("devices", self.devices as f64),
            ("devices_per_node", self.devices_per_node as f64),
            ("bf16_flops", self.bf16_flops),
            ("fp32_flops", self.fp32_flops),
            ("memory_bytes", self.memory_bytes as f64),
            ("hbm_bandwidth", self.hbm_bandwidth),
            ("hbm_efficiency", self.hbm_efficiency),
            ("intra_node_bandwidth", self.intra_node_bandwidth),
            ("inter_node_bandwidth", self.inter_node_bandwidth),
            ("efficiency.peak", self.efficiency.peak),
            ("efficiency.half_flops", self.efficiency.half_flops + 1.0),
        ];
        let fp16 = self.fp16_flops.map(|f| ("fp16_flops", f));
        let host = self.host_bandwidth.map(|b| ("host_bandwidth", b));
        let fp8 = self.fp8_flops.map(|f| ("fp8_flops", f));
        for (field, value) in checks.into_iter().chain(fp16).chain(host).chain(fp8) {
            if !(value > 0.0) || !value.is_finite() {
                return Err(ClusterError::Invalid {
                    source_name: self.name.clone(),
                    field,
                    requirement: "a positive number",
                    value,
                });
            }
        }
        if let Some(price) = self.price_per_device_hour
            && !(price >= 0.0 && price.is_finite())
        {
            return Err(ClusterError::Invalid {
                source_name: self.name.clone(),
                field: "price_per_device_hour",
                requirement: "a non-negative number of USD",
                value: price,
            });
        }
        let c = self.collectives;
        let links = [("collectives.all_reduce", c.map(|c| c.all_reduce)), ("collectives.all_gather", c.map(|c| c.all_gather)), ("collectives.reduce_scatter", c.map(|c| c.reduce_scatter))];
        for (field, link) in links.iter().filter_map(|(f, l)| l.map(|l| (*f, l))) {
            if !(link.bandwidth > 0.0) || !link.bandwidth.is_finite() {
                return Err(ClusterError::Invalid {
                    source_name: self.name.clone(),
                    field,
                    requirement: "a link with a positive bandwidth",
                    value: link.bandwidth,
                });
            }
        }
        let latencies = links.iter().filter_map(|(f, l)| l.map(|l| (*f, l.latency)));
        for (field, value) in [
            ("intra_node_latency", self.intra_node_latency),
            ("inter_node_latency", self.inter_node_latency),
        ]
        .into_iter()
        .chain(latencies)
        {
            if !(value >= 0.0) || !value.is_finite() {
                return Err(ClusterError::Invalid {
                    source_name: self.name.clone(),
                    field,
                    requirement: "a non-negative number of seconds",
                    value,
                });
            }
        }
        Ok(())
    }

    /// Number of nodes (devices rounded up to whole nodes).
    pub fn nodes(&self) -> usize {
        self.devices.div_ceil(self.devices_per_node.max(1))
    }

    /// Memory per device left after the workspace margin.
    pub fn usable_memory(&self) -> u64 {
        self.memory_bytes.saturating_sub(self.workspace_bytes)
    }

    /// Peak compute rate for arithmetic in `dtype`, FLOP/s.
    pub fn peak_flops(&self, dtype: DType) -> f64 {
        match dtype {
            DType::F16 => self.fp16_flops.unwrap_or(self.bf16_flops),
            DType::BF16 => self.bf16_flops,
            DType::F8E4M3 | DType::F8E5M2 | DType::F8E4M3Fnuz | DType::F8E5M2Fnuz => self.fp8_flops.unwrap_or(self.bf16_flops),
            DType::F64 => self.fp32_flops / 2.0,
            _ => self.fp32_flops,
        }
    }

    /// This spec with its blocks' linear layers run in fp8 ([`ClusterSpec::float8_linears`]);
    /// refused where the device has no fp8 rate.
    pub fn with_float8_linears(&self) -> Result<ClusterSpec, ClusterError> {
        if self.fp8_flops.is_none() {
            return Err(ClusterError::NoFp8 { spec: self.name.clone(), device: self.device.clone() });
        }
        Ok(ClusterSpec { float8_linears: true, ..self.clone() })
    }

    /// The training precision of plans that do not name one: bf16 mixed precision on GPUs,
    /// f32 on `cpu`.
    pub fn default_precision(&self) -> Precision {
        Precision::default_for(self.is_cpu())
    }

    /// True for the `cpu` preset and files based on it.
    pub fn is_cpu(&self) -> bool {
        self.device.starts_with("cpu")
    }

    /// The fraction of compute a communication kernel holding `sms` of the device's SMs takes
    /// from the compute running beside it (0 where the device's SM count is unknown).
    pub fn compute_share_beside(&self, sms: u32) -> f64 {
        self.sms.filter(|&n| n > 0).map_or(0.0, |n| (sms as f64 / n as f64).min(1.0))
    }

    /// The node of a global rank (ranks fill nodes in order).
    pub fn node_of(&self, rank: usize) -> usize {
        rank / self.devices_per_node.max(1)
    }
}

/// The cluster file as written: every field optional, filled from `preset`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterFile {
    preset: Option<String>,
    name: Option<String>,
    device: Option<String>,
    devices: Option<usize>,
    devices_per_node: Option<usize>,
    bf16_flops: Option<f64>,
    fp16_flops: Option<f64>,
    fp32_flops: Option<f64>,
    memory_bytes: Option<u64>,
    hbm_bandwidth: Option<f64>,
    hbm_efficiency: Option<f64>,
    intra_node_bandwidth: Option<f64>,
    inter_node_bandwidth: Option<f64>,
    intra_node_latency: Option<f64>,
    inter_node_latency: Option<f64>,
    efficiency: Option<EfficiencyCurve>,
    gemm_surface: Option<GemmSurface>,
    workspace_bytes: Option<u64>,
    fused_attention: Option<bool>,
    fused_norms: Option<bool>,
    overlapped_gathers: Option<bool>,
    price_per_device_hour: Option<f64>,
    collectives: Option<CollectiveLinks>,
    host_bandwidth: Option<f64>,
    sms: Option<u32>,
    fp8_flops: Option<f64>,
    machine: Option<MachineTable>,
    /// Calibration files only: the fractions of one core's matmul rate and memory bandwidth it
    /// keeps while every core of the machine runs at once (shared caches and memory).
    concurrent: Option<ConcurrentRates>,
}

/// What one core keeps of its rates while all cores compute (`smp-runner calibrate`).
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ConcurrentRates {
    flops_factor: f64,
    bandwidth_factor: f64,
}

/// A cluster file's `[machine]` table.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MachineTable {
    memory_bytes: u64,
    cores: usize,
    /// A calibration file, relative to the cluster file.
    calibration: Option<PathBuf>,
}

impl MachineTable {
    fn resolve(self, file: &Path) -> Result<MachineFacts, ClusterError> {
        let calibration = match self.calibration {
            Some(rel) => {
                let p = file.parent().unwrap_or(Path::new(".")).join(rel);
                Some(CalibrationFile::new(p.display().to_string(), read_calibration(file, &p)?))
            }
            None => None,
        };
        Ok(MachineFacts {
            memory_bytes: self.memory_bytes,
            cores: self.cores,
            calibration,
            source: FactSource::ClusterFile(file.display().to_string()),
        })
    }
}

/// The most bytes a calibration file may have (`smp-runner calibrate` writes a few hundred).
const MAX_CALIBRATION_BYTES: u64 = 1 << 20;

/// Reads the calibration file `p` that cluster file `file` names: a regular file of at most
/// [`MAX_CALIBRATION_BYTES`] (a device or a pipe named by mistake would be read forever).
fn read_calibration(file: &Path, p: &Path) -> Result<String, ClusterError> {
    use std::io::Read;
    let bad = |message: String| ClusterError::Parse { path: file.to_path_buf(), message };
    let io = |source| ClusterError::Io { path: p.to_path_buf(), source };
    let meta = std::fs::metadata(p).map_err(io)?;
    if !meta.is_file() {
        return Err(bad(format!("its calibration `{}` is not a regular file; name the file `smp-runner calibrate` wrote", p.display())));
    }
    let mut text = String::new();
    std::fs::File::open(p).map_err(io)?.take(MAX_CALIBRATION_BYTES + 1).read_to_string(&mut text).map_err(io)?;
    if text.len() as u64 > MAX_CALIBRATION_BYTES {
        return Err(bad(format!("its calibration `{}` is over {MAX_CALIBRATION_BYTES} bytes; a calibration file `smp-runner calibrate` writes is a few hundred", p.display())));
    }
    Ok(text)
}

impl ClusterFile {
    fn resolve(self, name: String, base: Option<&ClusterSpec>, path: &Path) -> Result<ClusterSpec, ClusterError> {
        macro_rules! field {
            ($f:ident) => {
                match (self.$f, base) {
                    (Some(v), _) => v,
                    (None, Some(b)) => b.$f.clone(),
                    (None, None) => {
                        return Err(ClusterError::Missing { path: path.to_path_buf(), field: stringify!($f) })
                    }
                }
            };
        }
        Ok(ClusterSpec {
            name,
            device: field!(device),
            devices: field!(devices),
            devices_per_node: field!(devices_per_node),
            bf16_flops: field!(bf16_flops),
            fp16_flops: self.fp16_flops.or(base.and_then(|b| b.fp16_flops)),
            fp32_flops: field!(fp32_flops),
            memory_bytes: field!(memory_bytes),
            hbm_bandwidth: field!(hbm_bandwidth),
            hbm_efficiency: field!(hbm_efficiency),
            intra_node_bandwidth: field!(intra_node_bandwidth),
            inter_node_bandwidth: field!(inter_node_bandwidth),
            intra_node_latency: field!(intra_node_latency),
            inter_node_latency: field!(inter_node_latency),
            efficiency: field!(efficiency),
            gemm_surface: self.gemm_surface.or(base.and_then(|b| b.gemm_surface.clone())),
            workspace_bytes: field!(workspace_bytes),
            fused_attention: self.fused_attention.or(base.map(|b| b.fused_attention)).unwrap_or(false),
            fused_norms: self.fused_norms.or(base.map(|b| b.fused_norms)).unwrap_or(false),
            overlapped_gathers: self.overlapped_gathers.or(base.map(|b| b.overlapped_gathers)).unwrap_or(false),
            machine: base.and_then(|b| b.machine.clone()),
            price_per_device_hour: self.price_per_device_hour.or(base.and_then(|b| b.price_per_device_hour)),
            collectives: self.collectives.or(base.and_then(|b| b.collectives)),
            host_bandwidth: self.host_bandwidth.or(base.and_then(|b| b.host_bandwidth)),
            sms: self.sms.or(base.and_then(|b| b.sms)),
            fp8_flops: self.fp8_flops.or(base.and_then(|b| b.fp8_flops)),
            float8_linears: false,
        })
    }
}

impl ClusterSpec {
    /// The `cpu` preset for `machine`: one device per core (or `devices`, all on one node),
    /// memory = the machine's / devices. Rates come from the machine's calibration file when
    /// it has one (with more than one device, scaled by its `[concurrent]` factors: what a core
    /// keeps while all compute at once), else these defaults (one core, f32, Gloo over loopback): 50 GFLOP/s per core
    /// (bf16 the same: no AMX assumed), 10 GB/s memory bandwidth, 2 GB/s and 50 µs between
    /// ranks, efficiency 0.7 at large sizes, half at 10 MFLOP, 256 MiB workspace; the "host
    /// link" of activation offloading is a memcpy within the machine's memory, at half the
    /// memory bandwidth (each byte is read and written).
    pub fn cpu(machine: &MachineFacts, devices: Option<usize>) -> Result<ClusterSpec, ClusterError> {
        let n = devices.unwrap_or(machine.cores).max(1);
        let defaults = ClusterSpec {
            name: "cpu".to_string(),
            device: "cpu core".to_string(),
            devices: n,
            devices_per_node: n,
            bf16_flops: 50e9,
            fp16_flops: None,
            fp32_flops: 50e9,
            memory_bytes: machine.memory_bytes / n as u64,
            hbm_bandwidth: 10e9,
            hbm_efficiency: 0.8,
            intra_node_bandwidth: 2e9,
            inter_node_bandwidth: 2e9,
            intra_node_latency: 50e-6,
            inter_node_latency: 50e-6,
            efficiency: EfficiencyCurve { peak: 0.7, half_flops: 1e7 },
            gemm_surface: None,
            workspace_bytes: 256 << 20,
            fused_attention: false,
            fused_norms: false,
            overlapped_gathers: false,
            machine: Some(machine.clone()),
            price_per_device_hour: None,
            collectives: None,
            host_bandwidth: Some(5e9),
            sms: None,
            fp8_flops: None,
            float8_linears: false,
        };
        let Some(cal) = &machine.calibration else {
            defaults.validate()?;
            return Ok(defaults);
        };
        let path = PathBuf::from(&cal.path);
        let file: ClusterFile =
            toml::from_str(&cal.text).map_err(|e| ClusterError::Parse { path: path.clone(), message: e.to_string() })?;
        if file.machine.is_some() || file.preset.is_some() {
            return Err(ClusterError::Parse {
                path,
                message: "a calibration file holds measured rates only (no `preset`, no `[machine]`)".to_string(),
            });
        }
        let concurrent = file.concurrent;
        let file_host = file.host_bandwidth;
        // The machine's shape stays the machine's unless the file says otherwise.
        let mut spec = file.resolve("cpu".to_string(), Some(&defaults), &path)?;
        if let Some(n) = devices {
            spec.devices = n;
        }
        spec.devices_per_node = spec.devices;
        // several devices are several cores computing at once: each at its shared rates
        if let Some(c) = concurrent.filter(|_| spec.devices > 1) {
            for (name, f) in [("flops_factor", c.flops_factor), ("bandwidth_factor", c.bandwidth_factor)] {
                if !(f > 0.0 && f <= 1.5) {
                    return Err(ClusterError::Parse { path, message: format!("[concurrent] {name} = {f}: a fraction of the one-core rate (0 < f ≤ 1.5) was expected; re-run `smp-runner calibrate`") });
                }
            }
            spec.fp32_flops *= c.flops_factor;
            spec.bf16_flops *= c.flops_factor;
            spec.fp16_flops = spec.fp16_flops.map(|f| f * c.flops_factor);
            spec.hbm_bandwidth *= c.bandwidth_factor;
        }
        if file_host.is_none() {
            // a memcpy at the (shared) rate calibrated
            spec.host_bandwidth = Some(spec.hbm_bandwidth / 2.0);
        }
        spec.device = if spec.device.starts_with("cpu") { spec.device } else { format!("cpu ({})", spec.device) };
        spec.validate()?;
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_parse_with_counts() {
        let h = ClusterSpec::parse("h100-80gb:64").unwrap();
        assert_eq!((h.devices, h.devices_per_node, h.nodes()), (64, 8, 8));
        assert_eq!(h.bf16_flops, 989e12);
        assert_eq!(h.intra_node_bandwidth, 450e9);
        assert_eq!(h.inter_node_bandwidth, 50e9);
        let small = ClusterSpec::parse("a100-80gb:2").unwrap();
        assert_eq!((small.devices, small.devices_per_node), (2, 2));
        for p in PRESETS.iter().filter(|&&p| p != "cpu") {
            ClusterSpec::preset(p).unwrap().validate().unwrap();
        }
        assert!(matches!(ClusterSpec::preset("cpu"), Err(ClusterError::NoMachineFacts { .. })));
        let e = ClusterSpec::parse("h100:8").unwrap_err().to_string();
        assert!(e.contains("`h100`"), "{e}");
        let e = ClusterSpec::parse("h100-80gb:x").unwrap_err().to_string();
        assert!(e.contains("`x`"), "{e}");
    }

    #[test]
    fn efficiency_fit_recovers_the_curve() {
        let truth = EfficiencyCurve { peak: 0.7, half_flops: 3e8 };
        let pts: Vec<(f64, f64)> = [1e6, 1e7, 1e8, 1e9, 1e10].iter().map(|&f| (f, truth.at(f))).collect();
        let fit = EfficiencyCurve::fit(&pts).unwrap();
        assert!((fit.peak - 0.7).abs() < 1e-9 && (fit.half_flops / 3e8 - 1.0).abs() < 1e-9, "{fit:?}");
        assert!(EfficiencyCurve::fit(&[(1e9, 0.5)]).is_none());
    }

    #[test]
    fn files_fill_from_presets_and_name_missing_fields() {
        let p = Path::new("c.toml");
        let s = ClusterSpec::from_toml("preset = \"h200\"\ndevices = 16\ninter_node_bandwidth = 25e9\n", p).unwrap();
        assert_eq!((s.devices, s.inter_node_bandwidth, s.memory_bytes), (16, 25e9, 143_771 << 20));
        let e = ClusterSpec::from_toml("devices = 4\n", p).unwrap_err().to_string();
        assert!(e.contains("c.toml") && e.contains("`device`"), "{e}");
        let e = ClusterSpec::from_toml("preset = \"h200\"\nbogus = 1\n", p).unwrap_err().to_string();
        assert!(e.contains("bogus"), "{e}");
        let e = ClusterSpec::from_toml("preset = \"h200\"\nhbm_bandwidth = -1.0\n", p).unwrap_err().to_string();
        assert!(e.contains("hbm_bandwidth"), "{e}");
        let priced = ClusterSpec::from_toml("preset = \"h100-80gb\"\nprice_per_device_hour = 2.5\n", p).unwrap();
        assert_eq!(priced.price_per_device_hour, Some(2.5));
        let listed = ClusterSpec::from_toml("preset = \"h100-80gb\"\n", p).unwrap();
        assert_eq!(listed.price_per_device_hour, Some(98.32 / 8.0));
        let e = ClusterSpec::from_toml("preset = \"h200\"\nprice_per_device_hour = -1.0\n", p).unwrap_err().to_string();
        assert!(e.contains("price_per_device_hour"), "{e}");
        let full = ClusterSpec::preset("v100-16gb").unwrap();
        let back = ClusterSpec::from_toml(&full.to_toml(), p).unwrap();
        assert_eq!(back, full);
    }

    #[test]
    fn gemm_surfaces_in_presets_and_files() {
        let p = Path::new("c.toml");
        let h100 = ClusterSpec::preset("h100-80gb").unwrap();
        assert_eq!(h100.gemm_surface, Some(GemmSurface::xla_sm90()));
        // an older file with only the curve still loads: its preset's surface, or none
        let old = "preset = \"h100-80gb\"\n[efficiency]\npeak = 0.6\nhalf_flops = 1e9\n";
        let s = ClusterSpec::from_toml(old, p).unwrap();
        assert_eq!((s.efficiency.peak, s.gemm_surface.as_ref()), (0.6, h100.gemm_surface.as_ref()));
        let mut bare = h100.to_toml().replace("[gemm_surface]", "[unused]");
        bare = bare.split("[unused]").next().unwrap_or_default().to_string();
        assert_eq!(ClusterSpec::from_toml(&bare, p).unwrap().gemm_surface, None);
        // a file's own surface, and one that cannot be
        let own = "preset = \"a100-80gb\"\n[gemm_surface]\nsizes = [256.0, 4096.0]\nrelative = [0.01, 0.1, 0.1, 0.5, 0.1, 0.5, 0.5, 1.0]\n";
        let s = ClusterSpec::from_toml(own, p).unwrap();
        assert_eq!(s.gemm_surface.as_ref().map(|g| g.at(256.0, 4096.0, 4096.0)), Some(0.5));
        let e = ClusterSpec::from_toml(&own.replace("0.01, ", ""), p).unwrap_err().to_string();
        assert!(e.contains("7 values") && e.contains("c.toml"), "{e}");
        // the presets' surface survives a round trip through a file
        assert_eq!(ClusterSpec::from_toml(&h100.to_toml(), p).unwrap(), h100);
    }

    #[test]
    fn host_links_per_preset_and_file() {
        let host = |name: &str| ClusterSpec::preset(name).unwrap().host_bandwidth;
        assert_eq!(host("a100-80gb"), Some(25e9));
        assert_eq!(host("h100-80gb"), Some(50e9));
        assert_eq!(host("h200"), Some(50e9));
        assert_eq!(host("v100-16gb"), Some(12e9));
        let p = Path::new("c.toml");
        let c2c = ClusterSpec::from_toml("preset = \"h200\"\nhost_bandwidth = 450e9\n", p).unwrap();
        assert_eq!(c2c.host_bandwidth, Some(450e9));
        let e = ClusterSpec::from_toml("preset = \"h200\"\nhost_bandwidth = 0.0\n", p).unwrap_err().to_string();
        assert!(e.contains("host_bandwidth"), "{e}");
        let facts = MachineFacts { memory_bytes: 8 << 30, cores: 2, calibration: None, source: FactSource::Host };
        let cpu = ClusterSpec::cpu(&facts, None).unwrap();
        assert_eq!(cpu.host_bandwidth, Some(cpu.hbm_bandwidth / 2.0));
    }
}
