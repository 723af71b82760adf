//! GEMM efficiency by shape: the fraction of a device's plateau rate a matrix product of
//! `m × k` by `k × n` reaches, as a small grid over (m, n, k) interpolated in log2 of each.
//!
//! The GPU presets' surface is the shape of XLA's published sm_90 (H100 SXM) bf16 table
//! ([`XLA_SM90_BF16_TFLOPS`]): a product at a grid point runs at the table's rate there over its
//! rate at 4,096³, times the preset's `efficiency.peak` (the plateau the published training runs
//! are held to). Between grid points the surface is trilinear in log2 m, n, k; above the grid
//! each dim is clamped to its largest size (the large-GEMM plateau); below it the product takes
//! as long as at the grid's smallest size (a kernel's time does not fall with its size there),
//! so its efficiency falls in proportion.

use serde::{Deserialize, Serialize};

/// bf16 × bf16 → bf16 GEMM rates on one H100 SXM (sm_90), TFLOP/s, batch 1, from OpenXLA's
/// GPU cost model table `xla/service/gpu/model/matmul_interpolator_data.h`
/// (`kDefaultMatmulPTable`, key `sm_90`, as in tensorflow/tensorflow's
/// `third_party/xla/xla/service/gpu/model/matmul_interpolator_data.h`), rounded to 0.1 TFLOP/s.
/// Indexed `[m][n][k]`, each of m, n, k over [`XLA_SIZES`]. 4,096³ runs at 783 TFLOP/s (79 % of
/// the 989 TFLOP/s data sheet), 2,048³ at 632 (64 %), 1,024³ at 236 (24 %).
#[rustfmt::skip]
pub const XLA_SM90_BF16_TFLOPS: [f64; 125] = [
    // m = 256: one line per n = 256 … 4096, k = 256 … 4096 along it
    6.5, 11.5, 19.5, 31.1, 84.3,
    11.5, 22.0, 39.1, 62.4, 91.7,
    22.7, 41.8, 72.5, 119.0, 172.3,
    41.8, 78.2, 138.1, 215.8, 285.9,
    78.0, 138.1, 225.2, 324.6, 412.0,
    // m = 512: one line per n = 256 … 4096, k = 256 … 4096 along it
    11.5, 21.8, 39.3, 60.1, 91.1,
    21.6, 40.7, 71.2, 114.7, 174.5,
    43.5, 80.5, 138.7, 216.5, 309.6,
    79.3, 143.4, 232.6, 342.4, 430.5,
    134.2, 236.3, 373.3, 522.2, 644.1,
    // m = 1024: one line per n = 256 … 4096, k = 256 … 4096 along it
    22.0, 40.9, 68.3, 113.2, 169.7,
    42.9, 82.2, 141.3, 220.0, 298.9,
    82.0, 145.6, 236.3, 350.0, 470.1,
    139.5, 237.6, 373.3, 524.3, 653.5,
    209.7, 338.9, 490.3, 634.2, 738.5,
    // m = 2048: one line per n = 256 … 4096, k = 256 … 4096 along it
    43.6, 77.3, 135.8, 216.1, 307.5,
    83.9, 142.8, 235.9, 347.7, 451.2,
    141.6, 238.4, 373.3, 523.3, 653.1,
    213.0, 345.5, 493.9, 632.0, 738.0,
    299.3, 450.4, 594.2, 715.4, 753.6,
    // m = 4096: one line per n = 256 … 4096, k = 256 … 4096 along it
    82.2, 137.2, 217.2, 304.7, 376.2,
    142.5, 238.8, 370.8, 521.7, 650.0,
    216.5, 343.7, 488.1, 632.0, 738.5,
    304.0, 447.0, 593.2, 716.1, 758.4,
    392.2, 543.1, 677.4, 738.7, 783.3,
];

/// The sizes of each of m, n and k in [`XLA_SM90_BF16_TFLOPS`].
pub const XLA_SIZES: [u64; 5] = [256, 512, 1024, 2048, 4096];

/// A GEMM-efficiency surface: relative efficiency (1 at the grid's largest corner) on a grid
/// of sizes shared by m, n and k.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "SurfaceTable")]
pub struct GemmSurface {
    /// The grid's sizes along each of m, n and k, increasing (powers of two in the presets).
    sizes: Vec<f64>,
    /// Relative efficiency at each grid point, indexed `[m][n][k]` (k fastest): `sizes.len()³`
    /// values in (0, 1].
    relative: Vec<f64>,
    /// log2 of `sizes` (derived).
    #[serde(skip)]
    log2: Vec<f64>,
}

/// A surface as a cluster file writes it (checked into a [`GemmSurface`]).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SurfaceTable {
    sizes: Vec<f64>,
    relative: Vec<f64>,
}

impl TryFrom<SurfaceTable> for GemmSurface {
    type Error = SurfaceError;
    fn try_from(t: SurfaceTable) -> Result<GemmSurface, SurfaceError> {
        GemmSurface::new(t.sizes, t.relative)
    }
}

/// Why a surface cannot be used.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SurfaceError {
    /// Sizes not increasing and positive, or fewer than two.
    #[error("gemm_surface.sizes must be at least two increasing positive sizes")]
    Sizes,
    /// Not `sizes.len()³` values.
    #[error("gemm_surface.relative has {got} values; {want} (sizes³, k fastest) were expected")]
    Count {
        /// Values given.
        got: usize,
        /// Values expected.
        want: usize,
    },
    /// A value outside (0, 1].
    #[error("gemm_surface.relative holds {0}; every value must be in (0, 1]")]
    Value(f64),
}

impl GemmSurface {
    /// A surface from measured rates at every grid point (`[m][n][k]`, k fastest), relative to
    /// the rate at the largest corner.
    pub fn from_rates(sizes: &[f64], rates: &[f64]) -> Result<GemmSurface, SurfaceError> {
        let top = rates.last().copied().filter(|&r| r > 0.0).ok_or(SurfaceError::Value(0.0))?;
        GemmSurface::new(sizes.to_vec(), rates.iter().map(|&r| (r / top).min(1.0)).collect())
    }

    /// A surface of relative efficiencies, checked.
    pub fn new(sizes: Vec<f64>, relative: Vec<f64>) -> Result<GemmSurface, SurfaceError> {
        let mut s = GemmSurface { sizes, relative, log2: Vec::new() };
        s.check()?;
        Ok(s)
    }

    /// The XLA sm_90 table's shape ([`XLA_SM90_BF16_TFLOPS`]).
    pub fn xla_sm90() -> GemmSurface {
        let sizes: Vec<f64> = XLA_SIZES.iter().map(|&s| s as f64).collect();
        let top = XLA_SM90_BF16_TFLOPS[124];
        let relative = XLA_SM90_BF16_TFLOPS.iter().map(|&r| r / top).collect();
        let log2 = sizes.iter().map(|s: &f64| s.log2()).collect();
        GemmSurface { sizes, relative, log2 }
    }

    /// The grid's sizes along each of m, n and k.
    pub fn sizes(&self) -> &[f64] {
        &self.sizes
    }

    /// The relative efficiencies at the grid points, `[m][n][k]`, k fastest.
    pub fn relative(&self) -> &[f64] {
        &self.relative
    }

    /// Checks the grid and fills the derived log2 sizes.
    fn check(&mut self) -> Result<(), SurfaceError> {
        let n = self.sizes.len();
        if n < 2 || self.sizes.iter().any(|s| !(*s > 0.0 && s.is_finite())) || self.sizes.windows(2).any(|w| w[1] <= w[0]) {
            return Err(SurfaceError::Sizes);
        }
        if self.relative.len() != n * n * n {
            return Err(SurfaceError::Count { got: self.relative.len(), want: n * n * n });
        }
        if let Some(&v) = self.relative.iter().find(|v| !(**v > 0.0 && **v <= 1.0)) {
            return Err(SurfaceError::Value(v));
        }
        self.log2 = self.sizes.iter().map(|s| s.log2()).collect();
        Ok(())
    }

    /// Relative efficiency of an `m × k` by `k × n` product.
    pub fn at(&self, m: f64, n: f64, k: f64) -> f64 {
        let g = self.log2.len();
        if g < 2 || self.relative.len() != g * g * g {
            return 1.0;
        }
        let (lo, hi) = (self.sizes[0], self.sizes[g - 1]);
        // below the grid: the smallest size's time, so efficiency in proportion to the size
        let mut below = 1.0;
        let mut pos = [(0usize, 0.0f64); 3];
        for (p, &x) in pos.iter_mut().zip(&[m, n, k]) {
            let x = x.max(1e-9);
            if x < lo {
                below *= x / lo;
            }
            let l = x.clamp(lo, hi).log2();
            let i = self.log2.partition_point(|&s| s <= l).clamp(1, g - 1) - 1;
            *p = (i, ((l - self.log2[i]) / (self.log2[i + 1] - self.log2[i])).clamp(0.0, 1.0));
        }
        let idx = |a: usize, b: usize, c: usize| (a * g + b) * g + c;
        let mut v = 0.0;
        for corner in 0..8usize {
            let mut w = 1.0;
            let mut ix = [0usize; 3];
            for d in 0..3 {
                let up = corner >> d & 1 == 1;
                let (i, f) = pos[d];
                ix[d] = i + usize::from(up);
                w *= if up { f } else { 1.0 - f };
            }
            if w > 0.0 {
                v += w * self.relative[idx(ix[0], ix[1], ix[2])];
            }
        }
        v * below
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(m: usize, n: usize, k: usize) -> f64 {
        XLA_SM90_BF16_TFLOPS[(m * 5 + n) * 5 + k]
    }

    #[test]
    fn the_surface_reproduces_the_cited_points() {
        let s = GemmSurface::xla_sm90();
        let top = rate(4, 4, 4);
        for (a, &m) in XLA_SIZES.iter().enumerate() {
            for (b, &n) in XLA_SIZES.iter().enumerate() {
                for (c, &k) in XLA_SIZES.iter().enumerate() {
                    let got = s.at(m as f64, n as f64, k as f64);
                    assert!((got - rate(a, b, c) / top).abs() < 1e-12, "({m}, {n}, {k}): {got}");
                }
            }
        }
        // the figures: 4096³ 79 %, 2048³ 64 %, 1024³ 24 % of 989 TFLOP/s
        for (i, pct) in [(4, 0.79), (3, 0.64), (2, 0.24)] {
            assert!((rate(i, i, i) / 989.0 - pct).abs() < 0.005, "{i}: {}", rate(i, i, i) / 989.0);
        }
    }

    #[test]
    fn interpolation_is_monotone_where_the_data_are_and_clamped_above() {
        let s = GemmSurface::xla_sm90();
        // the table rises along every axis; so does the surface between its points
        let mut last = 0.0;
        for i in 0..=64 {
            let x = 256.0 * 2f64.powf(i as f64 / 16.0);
            let v = s.at(x, x / 2.0, x);
            assert!(v >= last - 1e-12, "{x}: {v} < {last}");
            last = v;
        }
        // halfway in log2 between two points: their mean
        let mid = s.at(1024.0 * 2f64.sqrt(), 1024.0, 1024.0);
        assert!((mid - (rate(2, 2, 2) + rate(3, 2, 2)) / 2.0 / rate(4, 4, 4)).abs() < 1e-12);
        // above the grid: the plateau
        assert_eq!(s.at(65536.0, 16384.0, 12288.0), 1.0);
        assert_eq!(s.at(8192.0, 2048.0, 8192.0), s.at(4096.0, 2048.0, 4096.0));
        // below: the smallest size's time
        assert!((s.at(128.0, 256.0, 256.0) - s.at(256.0, 256.0, 256.0) / 2.0).abs() < 1e-15);
    }

    #[test]
    fn bad_grids_are_refused() {
        assert_eq!(GemmSurface::new(vec![256.0], vec![1.0]), Err(SurfaceError::Sizes));
        assert_eq!(GemmSurface::new(vec![256.0, 512.0], vec![1.0; 7]), Err(SurfaceError::Count { got: 7, want: 8 }));
        assert_eq!(GemmSurface::new(vec![256.0, 512.0], vec![0.0; 8]), Err(SurfaceError::Value(0.0)));
        let s = GemmSurface::from_rates(&[256.0, 512.0], &[1.0, 2.0, 2.0, 3.0, 2.0, 3.0, 3.0, 4.0]).unwrap();
        assert_eq!(s.at(256.0, 256.0, 256.0), 0.25);
    }
}
