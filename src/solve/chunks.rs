//! Layer → chunk assignments shared by the heuristics and the baselines: equal layer counts,
//! and chunks balancing a per-layer weight.

use super::oracle::min_max_cuts;

/// Equal layer counts over `chunks` (earlier chunks take the remainder).
pub fn uniform_chunks(layers: usize, chunks: usize) -> Vec<usize> {
    let base = layers / chunks.max(1);
    let extra = layers % chunks.max(1);
    let mut out = Vec::with_capacity(layers);
    for c in 0..chunks {
        let n = base + usize::from(c < extra);
        out.extend(std::iter::repeat_n(c, n));
    }
    out
}

/// Chunks balancing parameter counts (the DP oracle minimises the largest chunk's count).
pub fn parameter_chunks(params: &[f64], chunks: usize) -> Option<Vec<usize>> {
    let (_, starts) = min_max_cuts(params, chunks)?;
    let mut out = Vec::with_capacity(params.len());
    for c in 0..chunks {
        let end = starts.get(c + 1).copied().unwrap_or(params.len());
        out.extend(std::iter::repeat_n(c, end - starts[c]));
    }
    Some(out)
}
