//! Cluster specs that do not depend on the host running the tests.

/// The fixed machine of `tests/data/cpu.toml` (2 cores, 24 GiB, uncalibrated).
pub const CPU_MACHINE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/cpu.toml");

/// `--cluster` for `cpu:N` on that machine, and GPU presets unchanged.
pub fn cluster_arg(spec: &str) -> String {
    match spec.strip_prefix("cpu") {
        Some("") => CPU_MACHINE.to_string(),
        Some(count) if count.starts_with(':') => format!("{CPU_MACHINE}{count}"),
        _ => spec.to_string(),
    }
}

/// `cpu:1` on the fixed machine.
pub const CPU1: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/cpu.toml:1");
/// `cpu:2` on the fixed machine.
pub const CPU2: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/cpu.toml:2");
/// `cpu:4` on the fixed machine.
pub const CPU4: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/cpu.toml:4");
