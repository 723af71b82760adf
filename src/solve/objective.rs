//! What the planner is asked to optimise, and the peers' ways of planning it can imitate.

use std::fmt;
use std::str::FromStr;

/// `--optimize`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Optimize {
    /// Shortest step time.
    #[default]
    Speed,
    /// Least peak memory among plans within 5 % of the fastest step.
    Memory,
}

impl Optimize {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Optimize::Speed => "speed",
            Optimize::Memory => "memory",
        }
    }
}

impl fmt::Display for Optimize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Optimize {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "speed" => Ok(Optimize::Speed),
            "memory" => Ok(Optimize::Memory),
            _ => Err(format!("`{s}`: expected speed or memory")),
        }
    }
}

/// A peer's way of planning, for comparison (`--baseline`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Baseline {
    /// Megatron-LM as Narayanan et al. (2021) ran Table 1: t = GPUs per node, p the smallest
    /// that fits and divides the blocks, d the rest; equal blocks per stage with the embedding
    /// on the first and the head on the last; 1F1B (interleaved when `--schedule` says so),
    /// microbatch size 1, full recompute, no ZeRO, Megatron's tensor split (docs/baselines.md).
    Megatron,
    /// DeepSpeed `partition_method=uniform`: equal layer counts per stage.
    Uniform,
    /// DeepSpeed `partition_method=parameters`: stages balanced by parameter count.
    Parameters,
}

impl Baseline {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Baseline::Megatron => "megatron",
            Baseline::Uniform => "uniform",
            Baseline::Parameters => "parameters",
        }
    }
}

impl fmt::Display for Baseline {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Baseline {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "megatron" => Ok(Baseline::Megatron),
            "uniform" => Ok(Baseline::Uniform),
            "parameters" => Ok(Baseline::Parameters),
            _ => Err(format!("`{s}`: expected megatron, uniform or parameters")),
        }
    }
}
