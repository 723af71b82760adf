//! `smp-runner calibrate`: measures this machine for the cost model's `cpu` preset — f32
//! matmul rate by size on one thread (square products n³, fitted to the preset's efficiency
//! curve: the `cpu` preset's GEMM efficiency as a function of 2·m·n·k, where the GPU presets
//! have a surface over (m, n, k), `cost::GemmSurface`), the bf16 and
//! fp16 matmul rates (what `bf16-mixed`, `bf16` and `fp16-mixed` plans are priced at), memory
//! bandwidth, Gloo point-to-point latency / bandwidth between two local ranks, and the
//! latency and bandwidth of each collective as tensor parallelism calls it (the shim's
//! autograd functions, copies included), fitted over sizes to `cost::CollectiveLinks`.

use std::path::Path;
use std::time::Instant;

use tch::{Device, Kind, Tensor};

use crate::runtime::RuntimeError;
use crate::runtime::comm::{Backend, ProcessGroup, RankEnv, Store};
use crate::cost::cluster::{CollectiveLinks, EfficiencyCurve};
use crate::cost::Link;

/// What `calibrate` measured.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
pub struct Calibration {
    /// `(flops, FLOP/s)` of square f32 matmuls, one thread.
    pub matmul: Vec<(f64, f64)>,
    /// `(flops, FLOP/s)` of square bf16 matmuls, one thread (none in older calibrations:
    /// the f32 rate is written for bf16 then).
    #[serde(default)]
    pub matmul_bf16: Vec<(f64, f64)>,
    /// `(flops, FLOP/s)` of square fp16 matmuls, one thread.
    #[serde(default)]
    pub matmul_fp16: Vec<(f64, f64)>,
    /// Memory bandwidth of a large elementwise add (bytes read + written per second).
    pub memory_bandwidth: f64,
    /// Half the round-trip time of a 4-byte message between two ranks (seconds).
    pub p2p_latency: f64,
    /// Bytes per second of a large message between two ranks.
    pub p2p_bandwidth: f64,
    /// Bytes per second of a large two-rank all-reduce (buffer size over time).
    pub allreduce_bandwidth: f64,
    /// What one core keeps of its 512 × 512 matmul rate and its memory bandwidth while every
    /// core runs the same work at once (1 on one core).
    #[serde(default)]
    pub concurrent: Option<(f64, f64)>,
    /// Median seconds of each two-rank collective by size: `(kind, bytes, seconds)`, kind one
    /// of `all_reduce`, `all_gather`, `reduce_scatter` (bytes: the buffer, the gathered output,
    /// the scattered input).
    #[serde(default)]
    pub collective_samples: Vec<(String, f64, f64)>,
    /// The links fitted to `collective_samples`.
    #[serde(default)]
    pub collectives: Option<CollectiveLinks>,
}

/// Least-squares line `t = intercept + slope·bytes` through `(bytes, t)`, intercept clamped at
/// 0; `None` with fewer than two sizes or a slope that is not positive.
fn fit_line(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let (intercept, slope) = crate::cost::cluster::least_squares_line(points)?;
    (slope > 0.0).then_some((intercept.max(0.0), slope))
}

/// Two-rank collective times by size → links in `cost::comm`'s terms: an all-reduce of B is
/// 2α + B/bw (two ring steps), an all-gather or reduce-scatter α + B/(2·bw) (one step of
/// half the bytes).
pub fn fit_collectives(samples: &[(String, f64, f64)]) -> Option<CollectiveLinks> {
    let link = |kind: &str, steps: f64, share: f64| {
        let pts: Vec<(f64, f64)> = samples.iter().filter(|s| s.0 == kind).map(|s| (s.1, s.2)).collect();
        fit_line(&pts).map(|(intercept, slope)| Link { bandwidth: share / slope, latency: intercept / steps })
    };
    Some(CollectiveLinks {
        all_reduce: link("all_reduce", 2.0, 1.0)?,
        all_gather: link("all_gather", 1.0, 0.5)?,
        reduce_scatter: link("reduce_scatter", 1.0, 0.5)?,
    })
}

fn best_of<F: FnMut() -> Result<(), RuntimeError>>(reps: usize, mut f: F) -> Result<f64, RuntimeError> {
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t0 = Instant::now();
        f()?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// `(flops, FLOP/s)` of square `kind` matmuls of each size `n`, the best of several runs.
fn matmul_rates(kind: Kind, sizes: &[i64]) -> Result<Vec<(f64, f64)>, RuntimeError> {
    let mut out = Vec::new();
    for &n in sizes {
        let a = Tensor::f_randn([n, n], (Kind::Float, Device::Cpu))?.f_to_kind(kind)?;
        let b = Tensor::f_randn([n, n], (Kind::Float, Device::Cpu))?.f_to_kind(kind)?;
        let reps = if n <= 256 { 20 } else { 4 };
        let t = best_of(reps, || {
            let _ = a.f_matmul(&b)?;
            Ok(())
        })?;
        let flops = 2.0 * (n * n * n) as f64;
        out.push((flops, flops / t));
    }
    Ok(out)
}

/// Matmul rates by size and memory bandwidth of this process (call with 1 intra-op thread).
pub fn measure_compute() -> Result<Calibration, RuntimeError> {
    let mut cal = Calibration {
        matmul: matmul_rates(Kind::Float, &[32, 64, 128, 256, 512, 1024])?,
        // the low types at the sizes where a rate peaks (their curve is the f32 one's shape)
        matmul_bf16: matmul_rates(Kind::BFloat16, &[256, 512, 1024])?,
        matmul_fp16: matmul_rates(Kind::Half, &[256, 512, 1024])?,
        ..Calibration::default()
    };
    let opts = (Kind::Float, Device::Cpu);
    let x = Tensor::f_randn([16 << 20], opts)?;
    let y = Tensor::f_randn([16 << 20], opts)?;
    let t = best_of(5, || {
        let _ = x.f_add(&y)?;
        Ok(())
    })?;
    cal.memory_bandwidth = 3.0 * (16 << 20) as f64 * 4.0 / t;
    Ok(cal)
}

/// Matmul rate and memory bandwidth per core while `cores` threads (one intra-op thread
/// each) run the same work at once, as fractions of one thread running it alone, both timed
/// the same way: sustained loops (about 0.1 s each), the median of five. Sets
/// `cal.concurrent`.
pub fn measure_concurrency(cal: &mut Calibration, cores: usize) -> Result<(), RuntimeError> {
    if cores < 2 {
        cal.concurrent = Some((1.0, 1.0));
        return Ok(());
    }
    let alone = sustained_rates(1)?;
    let shared = sustained_rates(cores)?;
    // sharing never speeds a core up: a ratio above 1 is noise between the two timings
    cal.concurrent = Some(((shared.0 / alone.0).min(1.0), (shared.1 / alone.1).min(1.0)));
    Ok(())
}

/// Mean per-thread (matmul FLOP/s, memory bytes/s) of `threads` threads working at once.
fn sustained_rates(threads: usize) -> Result<(f64, f64), RuntimeError> {
    const MATMULS: usize = 24;
    const ADDS: usize = 6;
    let start = std::sync::Barrier::new(threads);
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let per_thread: Vec<Result<(f64, f64), RuntimeError>> = std::thread::scope(|sc| {
        let workers: Vec<_> = (0..threads)
            .map(|_| {
                sc.spawn(|| -> Result<(f64, f64), RuntimeError> {
                    let opts = (Kind::Float, Device::Cpu);
                    let (a, b) = (Tensor::f_randn([512, 512], opts)?, Tensor::f_randn([512, 512], opts)?);
                    let (x, y) = (Tensor::f_randn([4 << 20], opts)?, Tensor::f_randn([4 << 20], opts)?);
                    let (mut mm, mut add) = (Vec::new(), Vec::new());
                    for _ in 0..5 {
                        start.wait();
                        let t0 = Instant::now();
                        for _ in 0..MATMULS {
                            let _ = a.f_matmul(&b)?;
                        }
                        mm.push(t0.elapsed().as_secs_f64());
                        start.wait();
                        let t0 = Instant::now();
                        for _ in 0..ADDS {
                            let _ = x.f_add(&y)?;
                        }
                        add.push(t0.elapsed().as_secs_f64());
                    }
                    let flops = MATMULS as f64 * 2.0 * 512f64.powi(3);
                    let bytes = ADDS as f64 * 3.0 * (4 << 20) as f64 * 4.0;
                    Ok((flops / median(mm), bytes / median(add)))
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap_or_else(|_| Err(RuntimeError::Train("a calibration thread panicked".into())))).collect()
    });
    let rates = per_thread.into_iter().collect::<Result<Vec<_>, _>>()?;
    let n = rates.len() as f64;
    Ok(rates.iter().fold((0.0, 0.0), |acc, r| (acc.0 + r.0 / n, acc.1 + r.1 / n)))
}

/// Ping-pong and all-reduce between ranks 0 and 1 of `env` (every rank calls this); returns
/// the measurements on rank 0.
pub fn measure_comm(env: &RankEnv, cal: &mut Calibration) -> Result<(), RuntimeError> {
    let timeout = std::time::Duration::from_secs(60);
    let store = Store::connect(env, timeout)?;
    let pg = ProcessGroup::new(&store, &[0, 1], env.rank, timeout, Backend::Gloo)?;
    let peer = 1 - env.rank;
    let opts = (Kind::Float, Device::Cpu);
    let ping = |elems: i64, reps: usize| -> Result<f64, RuntimeError> {
        let buf = Tensor::f_zeros([elems], opts)?;
        let mut best = f64::INFINITY;
        for i in 0..reps {
            pg.barrier()?;
            let t0 = Instant::now();
            let tag = i as u32;
            if env.rank == 0 {
                let _ = pg.isend(&buf, peer, tag)?.wait()?;
                let _ = pg.irecv(&buf, peer, tag)?.wait()?;
            } else {
                let _ = pg.irecv(&buf, peer, tag)?.wait()?;
                let _ = pg.isend(&buf, peer, tag)?.wait()?;
            }
            best = best.min(t0.elapsed().as_secs_f64() / 2.0);
        }
        Ok(best)
    };
    let small = ping(1, 50)?;
    let big_elems = 4i64 << 20;
    let big = ping(big_elems, 5)?;
    cal.p2p_latency = small;
    cal.p2p_bandwidth = (big_elems * 4) as f64 / (big - small).max(1e-9);
    let buf = Tensor::f_ones([big_elems], opts)?;
    let t = best_of(5, || {
        pg.barrier()?;
        Ok(pg.all_reduce_sum(&buf)?)
    })?;
    cal.allreduce_bandwidth = (big_elems * 4) as f64 / t;
    // The collectives as tensor and sequence parallelism call them: [8, s, 256] activations,
    // split along the sequence axis; medians, as a step meets them.
    let median = |f: &dyn Fn() -> Result<(), RuntimeError>| -> Result<f64, RuntimeError> {
        let mut ts = Vec::new();
        for _ in 0..25 {
            pg.barrier()?;
            let t0 = Instant::now();
            f()?;
            ts.push(t0.elapsed().as_secs_f64());
        }
        ts.sort_by(f64::total_cmp);
        Ok(ts[ts.len() / 2])
    };
    for s in [8i64, 32, 128, 512] {
        let whole = Tensor::f_ones([8, s, 256], opts)?;
        let half = Tensor::f_ones([8, s / 2, 256], opts)?;
        let bytes = (8 * s * 256 * 4) as f64;
        let ar = median(&|| Ok(pg.reduce_from_tensor_region(&whole).map(drop)?))?;
        let ag = median(&|| Ok(pg.gather_along_axis(&half, 1).map(drop)?))?;
        let rs = median(&|| Ok(pg.reduce_scatter_along_axis(&whole, 1).map(drop)?))?;
        for (kind, t) in [("all_reduce", ar), ("all_gather", ag), ("reduce_scatter", rs)] {
            cal.collective_samples.push((kind.to_string(), bytes, t));
        }
    }
    cal.collectives = fit_collectives(&cal.collective_samples);
    Ok(())
}
/// `calibrate`: measures this machine's compute alone and with every core busy, then starts
/// two ranks of `exe calibrate --comm-json` (this runner) to measure Gloo between them, and
/// writes the cluster file `output`; returns its text.
pub fn calibrate(output: &Path, exe: &Path) -> Result<String, RuntimeError> {
    let ferr = |p: &Path, e: std::io::Error| RuntimeError::File { path: p.display().to_string(), message: e.to_string() };
    tch::set_num_threads(1);
    let mut c = measure_compute()?;
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    measure_concurrency(&mut c, cores).map_err(|e| RuntimeError::Train(format!("measuring the rates while every core computes: {e}")))?;
    let dir = std::env::temp_dir().join(format!("smp-calibrate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| ferr(&dir, e))?;
    let json = dir.join("comm.json");
    let args: Vec<std::ffi::OsString> = vec!["calibrate".into(), "-o".into(), output.into(), "--comm-json".into(), json.clone().into()];
    let code = super::launcher::launch_args(exe, 2, &args)?;
    if code != 0 {
        return Err(RuntimeError::Train(format!("the two-rank communication measurement failed (exit {code})")));
    }
    let text = std::fs::read_to_string(&json).map_err(|e| ferr(&json, e))?;
    let comm: Calibration = serde_json::from_str(&text).map_err(|e| RuntimeError::File { path: json.display().to_string(), message: e.to_string() })?;
    let _ = std::fs::remove_dir_all(&dir);
    c.p2p_latency = comm.p2p_latency;
    c.p2p_bandwidth = comm.p2p_bandwidth;
    c.allreduce_bandwidth = comm.allreduce_bandwidth;
    c.collective_samples = comm.collective_samples;
    c.collectives = comm.collectives;
    let text = cluster_toml(&c);
    if let Some(parent) = output.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(|e| ferr(parent, e))?;
    }
    std::fs::write(output, &text).map_err(|e| ferr(output, e))?;
    Ok(text)
}

/// One of the two ranks `calibrate` starts: measures Gloo between them; rank 0 writes the
/// results to `json`.
pub fn calibrate_comm_rank(json: &Path) -> Result<(), RuntimeError> {
    tch::set_num_threads(1);
    let env = RankEnv::from_env()?.ok_or_else(|| RuntimeError::Train("--comm-json is for the ranks calibrate starts itself".into()))?;
    let mut c = Calibration::default();
    measure_comm(&env, &mut c)?;
    if env.rank == 0 {
        let text = serde_json::to_string(&c).map_err(|e| RuntimeError::Train(e.to_string()))?;
        std::fs::write(json, text).map_err(|e| RuntimeError::File { path: json.display().to_string(), message: e.to_string() })?;
    }
    Ok(())
}


/// The cluster file for the `cpu` preset (fields of `cost::ClusterSpec`; unset ones keep the
/// preset's defaults).
pub fn cluster_toml(cal: &Calibration) -> String {
    let peak_rate = cal.matmul.iter().map(|p| p.1).fold(0.0, f64::max);
    let eff: Vec<(f64, f64)> = cal.matmul.iter().map(|&(f, r)| (f, r / peak_rate)).collect();
    let curve = EfficiencyCurve::fit(&eff).unwrap_or(EfficiencyCurve { peak: 1.0, half_flops: 0.0 });
    let mut s = String::new();
    s.push_str("# Written by `smp-runner calibrate` (one thread per device; f32, bf16 and fp16 matmuls; Gloo over loopback).\n");
    for (kind, samples) in [("", &cal.matmul), (" bf16", &cal.matmul_bf16), (" fp16", &cal.matmul_fp16)] {
        if samples.is_empty() {
            continue;
        }
        s.push_str(&format!("# matmul{kind} FLOP/s by size:"));
        for (f, r) in samples {
            s.push_str(&format!(" {f:.3e}:{r:.3e}"));
        }
        s.push('\n');
    }
    s.push_str(&format!("# two-rank all-reduce: {:.3e} B/s\n", cal.allreduce_bandwidth));
    s.push_str("device = \"cpu core\"\n");
    // the low types' peaks, measured; an older calibration without them keeps the f32 rate
    let peak_of = |v: &[(f64, f64)]| Some(v.iter().map(|p| p.1).fold(0.0, f64::max)).filter(|&r| r > 0.0);
    let bf16_rate = peak_of(&cal.matmul_bf16).unwrap_or(peak_rate);
    s.push_str(&format!("fp32_flops = {peak_rate:e}\nbf16_flops = {bf16_rate:e}\n"));
    if let Some(fp16_rate) = peak_of(&cal.matmul_fp16) {
        s.push_str(&format!("fp16_flops = {fp16_rate:e}\n"));
    }
    s.push_str(&format!("hbm_bandwidth = {:e}\nhbm_efficiency = 1.0\n", cal.memory_bandwidth));
    s.push_str(&format!("intra_node_bandwidth = {:e}\ninter_node_bandwidth = {:e}\n", cal.p2p_bandwidth, cal.p2p_bandwidth));
    s.push_str(&format!("intra_node_latency = {:e}\ninter_node_latency = {:e}\n", cal.p2p_latency, cal.p2p_latency));
    s.push_str(&format!("\n[efficiency]\npeak = {:e}\nhalf_flops = {:e}\n", curve.peak, curve.half_flops));
    if let Some((flops, bandwidth)) = cal.concurrent {
        s.push_str("\n# per core while every core computes, as a fraction of one core alone\n");
        s.push_str(&format!("[concurrent]\nflops_factor = {flops:e}\nbandwidth_factor = {bandwidth:e}\n"));
    }
    if let Some(c) = &cal.collectives {
        s.push_str("\n# two-rank collectives, median seconds by bytes:");
        for (kind, bytes, t) in &cal.collective_samples {
            s.push_str(&format!(" {kind} {bytes:.3e}:{t:.3e}"));
        }
        s.push('\n');
        for (name, l) in [("all_reduce", c.all_reduce), ("all_gather", c.all_gather), ("reduce_scatter", c.reduce_scatter)] {
            s.push_str(&format!("[collectives.{name}]\nbandwidth = {:e}\nlatency = {:e}\n", l.bandwidth, l.latency));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{ClusterSpec, CommModel, GroupSpan};

    #[test]
    fn fitted_collectives_price_the_measured_times() {
        // Times of a 2-rank Gloo run on the machine (seconds by bytes).
        let mut samples = Vec::new();
        for (kind, a, b) in [("all_reduce", 6e-4, 1.0e-9), ("all_gather", 5e-4, 1.2e-9), ("reduce_scatter", 9e-4, 1.5e-9)] {
            for bytes in [65536.0, 1048576.0, 4194304.0] {
                samples.push((kind.to_string(), bytes, a + b * bytes));
            }
        }
        let links = fit_collectives(&samples).unwrap();
        let cal = Calibration { collectives: Some(links), collective_samples: samples.clone(), ..Default::default() };
        let toml = cluster_toml(&Calibration { matmul: vec![(1e6, 1e10), (1e9, 5e10)], memory_bandwidth: 1e10, p2p_latency: 5e-5, p2p_bandwidth: 2e9, ..cal });
        let facts = crate::cost::MachineFacts {
            memory_bytes: 1 << 34,
            cores: 2,
            calibration: Some(crate::cost::CalibrationFile::new("cal.toml", toml)),
            source: crate::cost::FactSource::Host,
        };
        let spec = ClusterSpec::cpu(&facts, Some(2)).unwrap();
        assert_eq!(spec.collectives.map(|c| c.all_gather.latency > 0.0), Some(true));
        let comm = CommModel::new(&spec);
        let g = GroupSpan::intra_node(2);
        for (kind, bytes, t) in &samples {
            let priced = match kind.as_str() {
                "all_reduce" => comm.all_reduce(*bytes, &g),
                "all_gather" => comm.all_gather(*bytes, &g),
                _ => comm.reduce_scatter(*bytes, &g),
            };
            assert!((priced / t - 1.0).abs() < 1e-3, "{kind} of {bytes} B: priced {priced}, measured {t}");
        }
        // Point to point keeps the message link.
        assert!((comm.p2p(1e6, crate::cost::LinkKind::IntraNode) - (5e-5 + 1e6 / 2e9)).abs() < 1e-9);
    }

    #[test]
    fn measured_low_precision_rates_are_written_and_priced() {
        let facts = |toml: String| crate::cost::MachineFacts {
            memory_bytes: 1 << 34,
            cores: 1,
            calibration: Some(crate::cost::CalibrationFile::new("cal.toml", toml)),
            source: crate::cost::FactSource::Host,
        };
        let base = Calibration { matmul: vec![(1e6, 1e10), (1e9, 5e10)], memory_bandwidth: 1e10, p2p_latency: 5e-5, p2p_bandwidth: 2e9, ..Default::default() };
        let cal = Calibration { matmul_bf16: vec![(1e8, 2e9), (1e9, 4e9)], matmul_fp16: vec![(1e8, 1e9), (1e9, 3e9)], ..base.clone() };
        let spec = ClusterSpec::cpu(&facts(cluster_toml(&cal)), Some(1)).unwrap();
        assert_eq!((spec.fp32_flops, spec.bf16_flops, spec.fp16_flops), (5e10, 4e9, Some(3e9)));
        use crate::ir::DType;
        assert_eq!((spec.peak_flops(DType::F32), spec.peak_flops(DType::BF16), spec.peak_flops(DType::F16)), (5e10, 4e9, 3e9));
        // a calibration from before these were measured keeps the f32 rate for both
        let old = ClusterSpec::cpu(&facts(cluster_toml(&base)), Some(1)).unwrap();
        assert_eq!((old.bf16_flops, old.fp16_flops, old.peak_flops(DType::F16)), (5e10, None, 5e10));
    }
}
