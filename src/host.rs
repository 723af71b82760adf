//! The facts of the machine a binary runs on, for the `cpu` cluster preset: total memory
//! (`/proc/meminfo`), cores, and the calibration file (`$SMP_CPU_CALIBRATION`, else
//! `~/.cache/smp-partition/cpu.toml`, written by `smp-runner calibrate`). Only the binaries
//! call this; the cost model takes the facts as an argument.

use std::path::PathBuf;

use crate::cost::{CalibrationFile, FactSource, MachineFacts};

/// Environment variable naming the CPU calibration file.
pub const CPU_CALIBRATION_ENV: &str = "SMP_CPU_CALIBRATION";

/// Memory assumed where `/proc/meminfo` cannot be read.
const FALLBACK_MEMORY_BYTES: u64 = 8 << 30;

/// Errors gathering the host's facts.
#[derive(Debug, thiserror::Error)]
pub enum HostError {
    /// The calibration file exists but cannot be read.
    #[error("calibration file {path}: {source} (remove it, or point ${CPU_CALIBRATION_ENV} at a readable file)")]
    Calibration {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// The calibration file the `cpu` preset reads: `$SMP_CPU_CALIBRATION`, else
/// `~/.cache/smp-partition/cpu.toml`.
pub fn cpu_calibration_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(CPU_CALIBRATION_ENV) {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/smp-partition/cpu.toml"))
}

/// Reads this machine's facts.
pub fn machine_facts() -> Result<MachineFacts, HostError> {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let memory_bytes = total_memory_bytes().unwrap_or(FALLBACK_MEMORY_BYTES);
    let calibration = match cpu_calibration_path().filter(|p| p.is_file()) {
        Some(path) => {
            let text = std::fs::read_to_string(&path).map_err(|source| HostError::Calibration { path: path.clone(), source })?;
            Some(CalibrationFile::new(path.display().to_string(), text))
        }
        None => None,
    };
    Ok(MachineFacts { memory_bytes, cores, calibration, source: FactSource::Host })
}

fn total_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
