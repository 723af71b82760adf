//! Exact oracles for the tests and for bounds: brute-force enumeration of the pipeline
//! problem, brute force of the intra-layer problem, and a PipeDream-style DP over contiguous
//! cuts minimising the largest stage time.

use super::problem::{IntraLayerProblem, LayerChoice, PipelineEval, PipelineProblem};

/// Enumerates every assignment (contiguous chunks × point × checkpoint and offload flags per
/// layer) and
/// returns the best feasible one by the problem's objective. Exponential: tests only.
pub fn brute_force_pipeline(p: &PipelineProblem) -> Option<(f64, Vec<LayerChoice>, PipelineEval)> {
    let l_n = p.layers.len();
    let v_n = p.chunks();
    if l_n < v_n || v_n == 0 {
        return None;
    }
    let flags: Vec<Vec<(bool, bool)>> = (0..l_n).map(|l| p.flag_options(l)).collect();
    let mut best: Option<(f64, Vec<LayerChoice>, PipelineEval)> = None;
    let mut chunk_of = vec![0usize; l_n];
    // Enumerate chunk assignments as non-decreasing sequences starting at 0, ending at v_n-1,
    // with steps of 0 or 1.
    fn cuts(l: usize, l_n: usize, v_n: usize, chunk_of: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if l == l_n {
            if chunk_of[l_n - 1] == v_n - 1 {
                out.push(chunk_of.clone());
            }
            return;
        }
        let prev = if l == 0 { 0 } else { chunk_of[l - 1] };
        let options: &[usize] = if l == 0 { &[0] } else { &[0, 1] };
        for &step in options {
            let c = prev + step;
            if c < v_n {
                chunk_of[l] = c;
                cuts(l + 1, l_n, v_n, chunk_of, out);
            }
        }
    }
    let mut layouts = Vec::new();
    cuts(0, l_n, v_n, &mut chunk_of, &mut layouts);
    for layout in layouts {
        if let Some(f) = &p.fixed_chunks
            && f != &layout
        {
            continue;
        }
        let per_layer: Vec<usize> = p.layers.iter().enumerate().map(|(l, lay)| lay.points.len() * flags[l].len()).collect();
        let mut idx = vec![0usize; l_n];
        loop {
            let choices: Vec<LayerChoice> = (0..l_n)
                .map(|l| {
                    let f = &flags[l];
                    let (checkpoint, offload) = f[idx[l] % f.len()];
                    LayerChoice { chunk: layout[l], point: idx[l] / f.len(), checkpoint, offload }
                })
                .collect();
            if choices.iter().enumerate().all(|(l, c)| p.combines(l, c.point, c.checkpoint))
                && let Some(e) = p.evaluate(&choices)
                && p.feasible(&e)
            {
                let obj = p.objective_value(&e);
                if best.as_ref().is_none_or(|b| obj < b.0) {
                    best = Some((obj, choices, e));
                }
            }
            // odometer
            let mut l = 0;
            loop {
                if l == l_n {
                    break;
                }
                idx[l] += 1;
                if idx[l] < per_layer[l] {
                    break;
                }
                idx[l] = 0;
                l += 1;
            }
            if l == l_n {
                break;
            }
        }
    }
    best
}

/// Every assignment of the intra-layer problem that `evaluate` accepts (no forbidden edge
/// pair), in odometer order (first node fastest); `visit` returns false to stop.
pub fn for_each_allowed(p: &IntraLayerProblem, mut visit: impl FnMut(&[usize], &super::ilp::IntraSolution) -> bool) {
    let n = p.nodes.len();
    let mut idx = vec![0usize; n];
    loop {
        if let Some(s) = p.evaluate(&idx)
            && !visit(&idx, &s)
        {
            return;
        }
        let mut v = 0;
        while v < n {
            idx[v] += 1;
            if idx[v] < p.nodes[v].options.len() {
                break;
            }
            idx[v] = 0;
            v += 1;
        }
        if v == n {
            return;
        }
    }
}

/// Every assignment of the intra-layer problem; the fastest within the memory cap.
pub fn brute_force_intra(p: &IntraLayerProblem) -> Option<(f64, Vec<usize>)> {
    let mut best: Option<(f64, Vec<usize>)> = None;
    for_each_allowed(p, |idx, s| {
        let fits = p.memory_cap.is_none_or(|c| p.memory_of(s) <= c * (1.0 + 1e-9) + 1e-9);
        let t = s.fwd_s + s.bwd_s;
        if fits && best.as_ref().is_none_or(|b| t < b.0) {
            best = Some((t, idx.to_vec()));
        }
        true
    });
    best
}

/// PipeDream-style DP: splits `times` into `stages` contiguous non-empty parts minimising the
/// largest part's sum. Returns (that sum, the first layer index of every stage).
pub fn min_max_cuts(times: &[f64], stages: usize) -> Option<(f64, Vec<usize>)> {
    let n = times.len();
    if stages == 0 || stages > n {
        return None;
    }
    let mut prefix = vec![0.0; n + 1];
    for i in 0..n {
        prefix[i + 1] = prefix[i] + times[i];
    }
    // best[s][i]: min over splits of the first i layers into s stages of the max stage sum.
    let inf = f64::INFINITY;
    let mut best = vec![vec![inf; n + 1]; stages + 1];
    let mut arg = vec![vec![0usize; n + 1]; stages + 1];
    best[0][0] = 0.0;
    for s in 1..=stages {
        for i in s..=n {
            for j in (s - 1)..i {
                let v = best[s - 1][j].max(prefix[i] - prefix[j]);
                if v < best[s][i] {
                    best[s][i] = v;
                    arg[s][i] = j;
                }
            }
        }
    }
    let mut starts = vec![0usize; stages];
    let mut i = n;
    for s in (1..=stages).rev() {
        let j = arg[s][i];
        starts[s - 1] = j;
        i = j;
    }
    Some((best[stages][n], starts))
}

/// A lower bound on [`min_max_cuts`]'s value in O(n · 60): bisection with the greedy check,
/// returning the largest value proven infeasible (so never above the optimum).
pub fn min_max_lower_bound(times: &[f64], stages: usize) -> f64 {
    if stages == 0 || times.is_empty() {
        return 0.0;
    }
    let fits = |cap: f64| {
        let mut parts = 1;
        let mut acc = 0.0;
        for &t in times {
            if t > cap {
                return false;
            }
            if acc + t > cap {
                parts += 1;
                acc = t;
            } else {
                acc += t;
            }
        }
        parts <= stages
    };
    let total: f64 = times.iter().sum();
    let biggest = times.iter().cloned().fold(0.0, f64::max);
    let lo = (total / stages as f64).max(biggest) * (1.0 - 1e-12);
    if fits(lo) {
        return lo;
    }
    bisect_infeasible(lo, total, 60, fits)
}

/// Bisection between `lo`, which `fits` rejects, and `hi`, which it accepts (`fits` monotone):
/// the largest value it has proven infeasible after `rounds` halvings.
pub(crate) fn bisect_infeasible(mut lo: f64, mut hi: f64, rounds: usize, fits: impl Fn(f64) -> bool) -> f64 {
    for _ in 0..rounds {
        let mid = 0.5 * (lo + hi);
        if fits(mid) {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    lo
}
