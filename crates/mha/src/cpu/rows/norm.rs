//! Layer normalisation over the rows of an f32 tensor, forward and backward, each a
//! single pass over the data: a task takes a block of whole rows, and each row is read
//! from memory once and worked on while it is in the cache. Differentiated op by op
//! (mean, centre, square, mean, add, square root, divide, scale, shift), a layer norm
//! walks its input nine times forward and twice as often backward. The RMS norm (Llama's
//! RMSNorm) is the same without centring: `μ = 0` below, and no `Σg / d` term in `dx`.
//!
//! Forward, per row of `d` values: `μ = Σx / d`, `σ⁻¹ = 1 / √(Σ(x - μ)² / d + ε)`,
//! `y = (x - μ) σ⁻¹ γ + β`; `μ` and `σ⁻¹` are kept for the backward pass. Backward, with
//! `x̂ = (x - μ) σ⁻¹` and `g = dy γ`:
//!
//! ```text
//! dx = σ⁻¹ (g - Σg / d - x̂ Σ(g x̂) / d)
//! dγ = Σ_rows dy x̂        dβ = Σ_rows dy
//! ```
//!
//! The sums run in eight lanes whose order does not depend on the number of threads, and
//! the per-task parts of `dγ` and `dβ` are added in task order: results are the same on
//! every run.

use std::mem::MaybeUninit;
use std::sync::Arc;

use burn::backend::tensor::FloatTensor;

use crate::cpu::blocks::{Chunks, for_each_block, map_blocks};
use crate::cpu::isa::{Arch, Isa, Kernel};
use crate::cpu::{CpuTensors, dims_of, written};

use super::CHUNK;

/// Lanes of the sums.
const LANES: usize = 8;

/// Each row's mean and reciprocal standard deviation, kept for the backward pass.
#[derive(Debug, Clone)]
pub(crate) struct RowStats {
    mean: Arc<[f32]>,
    rstd: Arc<[f32]>,
}

/// The gradients of a layer norm: of its input, its scale and its shift.
pub(crate) struct NormGrads<B: CpuTensors> {
    /// `[.., d]`, the input's shape.
    pub(crate) x: FloatTensor<B>,
    /// `[1, 1, 1, d]`.
    pub(crate) gamma: FloatTensor<B>,
    /// `[1, 1, 1, d]`.
    pub(crate) beta: FloatTensor<B>,
}

/// Rows per task for rows of `d` values.
fn rows_per_task(d: usize) -> usize {
    (CHUNK / d.max(1)).max(1)
}

/// The `d` values of a `[1, 1, 1, d]` tensor.
fn vector<B: CpuTensors>(v: &FloatTensor<B>, d: usize) -> Vec<f32> {
    let v = B::readable(v);
    B::floats(&v).contiguous([1, 1, 1, d]).into_owned()
}

/// Layer norm (the RMS norm unless `center`) of the rows of `x` (rank 4, normalised over
/// the last axis) with scale `gamma` and shift `beta` (`[1, 1, 1, d]`): the output and
/// each row's statistics.
pub(crate) fn layer_norm_forward<B: CpuTensors>(
    x: &FloatTensor<B>,
    gamma: &FloatTensor<B>,
    beta: &FloatTensor<B>,
    epsilon: f64,
    center: bool,
) -> (FloatTensor<B>, RowStats) {
    let x = B::readable(x);
    let dims = dims_of::<B>(&x);
    let d = dims[3];
    let input = B::floats(&x).contiguous(dims);
    let gamma = vector::<B>(gamma, d);
    let beta = vector::<B>(beta, d);
    let rows = input.len().checked_div(d).unwrap_or(0);
    let (mut mean, mut rstd) = (vec![0.0f32; rows], vec![0.0f32; rows]);
    let fill = |out: &mut [MaybeUninit<f32>]| {
        if rows == 0 {
            return;
        }
        let per = rows_per_task(d);
        let params = Params {
            gamma: &gamma,
            beta: &beta,
            epsilon: epsilon as f32,
            center,
        };
        let isa = Isa::best();
        let ys = Chunks::new(out, per * d);
        let (means, rstds) = (Chunks::new(&mut mean, per), Chunks::new(&mut rstd, per));
        for_each_block(ys.count(), |c| {
            // SAFETY: each block takes its own chunks, once.
            let (y, mean, rstd) = unsafe { (ys.take(c), means.take(c), rstds.take(c)) };
            let x = &input[c * per * d..][..y.len()];
            isa.run(Forward {
                p: &params,
                x,
                y,
                stats: [mean, rstd],
            })
        });
    };
    // SAFETY: without rows the output has no element (`d` is 0, or the input is empty);
    // otherwise the blocks cover it, and `Forward` writes every row of its block.
    let out = unsafe { written(input.len(), fill) };
    let stats = RowStats {
        mean: mean.into(),
        rstd: rstd.into(),
    };
    (B::from_rows(out, dims), stats)
}

/// The gradients of [`layer_norm_forward`] (with the same `center`) given the upstream
/// gradient `grad` (the output's shape); the input's gradient only when `want_x`.
pub(crate) fn layer_norm_backward<B: CpuTensors>(
    x: &FloatTensor<B>,
    gamma: &FloatTensor<B>,
    stats: &RowStats,
    grad: &FloatTensor<B>,
    want_x: bool,
    center: bool,
) -> NormGrads<B> {
    let (x, grad) = (B::readable(x), B::readable(grad));
    let dims = dims_of::<B>(&x);
    let d = dims[3];
    let input = B::floats(&x).contiguous(dims);
    let upstream = B::floats(&grad).contiguous(dims);
    let gamma = vector::<B>(gamma, d);
    let mut dx = Vec::with_capacity(if want_x { input.len() } else { 0 });
    let (mut dgamma, mut dbeta) = (vec![0.0f32; d], vec![0.0f32; d]);
    if !stats.mean.is_empty() {
        let per = rows_per_task(d);
        let isa = Isa::best();
        let task = |rows: Rows, dx: Option<&mut [MaybeUninit<f32>]>| {
            let mut part = vec![0.0f32; 2 * d];
            let (dg, db) = part.split_at_mut(d);
            isa.run(Backward {
                rows,
                gamma: &gamma,
                dx,
                dp: [dg, db],
            });
            part
        };
        let len = input.len();
        let dxs = Chunks::new(
            &mut dx.spare_capacity_mut()[..len * want_x as usize],
            per * d,
        );
        let parts: Vec<Vec<f32>> = map_blocks(len.div_ceil(per * d), |c| {
            let (at, n) = (c * per, per.min(stats.mean.len() - c * per));
            let rows = Rows {
                x: &input[at * d..(at + n) * d],
                dy: &upstream[at * d..(at + n) * d],
                mean: &stats.mean[at..at + n],
                rstd: &stats.rstd[at..at + n],
                center,
            };
            // SAFETY: each block takes its own chunk of dx, once.
            task(rows, want_x.then(|| unsafe { dxs.take(c) }))
        });
        for part in parts {
            let (dg, db) = part.split_at(d);
            add(&mut dgamma, dg);
            add(&mut dbeta, db);
        }
        if want_x {
            // SAFETY: the blocks covered the input's length, and `Backward` wrote every
            // row of its block.
            unsafe { dx.set_len(input.len()) };
        }
    } else if want_x {
        // No row: `d` is 0 or the input is empty, and so is `dx`.
        debug_assert_eq!(input.len(), 0);
    }
    NormGrads {
        x: B::from_rows(dx, if want_x { dims } else { [0, 0, 0, 0] }),
        gamma: B::from_rows(dgamma, [1, 1, 1, d]),
        beta: B::from_rows(dbeta, [1, 1, 1, d]),
    }
}

fn add(sum: &mut [f32], part: &[f32]) {
    for (s, p) in sum.iter_mut().zip(part) {
        *s += p;
    }
}

/// The scale, shift and `ε` of a layer norm, and whether it centres its rows (false: the
/// RMS norm).
struct Params<'a> {
    gamma: &'a [f32],
    beta: &'a [f32],
    epsilon: f32,
    center: bool,
}

/// A block of rows of the input and the upstream gradient, with their statistics, and
/// whether the norm centred them.
struct Rows<'a> {
    x: &'a [f32],
    dy: &'a [f32],
    mean: &'a [f32],
    rstd: &'a [f32],
    center: bool,
}

/// The forward pass over a block of rows: their outputs and statistics.
struct Forward<'a> {
    p: &'a Params<'a>,
    x: &'a [f32],
    /// Written whole.
    y: &'a mut [MaybeUninit<f32>],
    stats: [&'a mut [f32]; 2],
}

impl Kernel for Forward<'_> {
    type Output = ();

    #[inline(always)]
    fn run<A: Arch>(self) {
        forward_with::<A>(self.p, self.x, self.y, self.stats);
    }
}

/// The backward pass over a block of rows: their input gradients (when asked) and their
/// parts of the scale's and shift's.
struct Backward<'a> {
    rows: Rows<'a>,
    gamma: &'a [f32],
    /// Written whole, when asked.
    dx: Option<&'a mut [MaybeUninit<f32>]>,
    dp: [&'a mut [f32]; 2],
}

impl Kernel for Backward<'_> {
    type Output = ();

    #[inline(always)]
    fn run<A: Arch>(self) {
        backward_with::<A>(self.rows, self.gamma, self.dx, self.dp);
    }
}

/// The sum of eight lanes, pairwise.
#[inline(always)]
fn fold(lanes: [f32; LANES]) -> f32 {
    ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6]))
        + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]))
}

/// Rows whose sums run side by side: each sum is a chain of dependent additions, and
/// four independent chains keep the adder busy through its latency.
const INTERLEAVE: usize = 4;

/// For each row `r` of `R`, `Σ_i f(r, a[r]_i, b[r]_i, c_i)` over the `n` elements of `c`,
/// in eight lanes (element `i` in lane `i % 8` up to the last whole eight, the lanes
/// folded pairwise, then the tail in order): a row's sum is the same whichever rows
/// are summed beside it and whatever the instruction set, and each row's lanes are one
/// vector register.
#[inline(always)]
fn lane_sums<A: Arch, const R: usize>(
    a: [&[f32]; R],
    b: [&[f32]; R],
    c: &[f32],
    f: impl Fn(usize, f32, f32, f32) -> f32,
) -> [f32; R] {
    let n = c.len();
    let whole = n / LANES * LANES;
    let a8: [&[[f32; LANES]]; R] = std::array::from_fn(|r| a[r][..whole].as_chunks().0);
    let b8: [&[[f32; LANES]]; R] = std::array::from_fn(|r| b[r][..whole].as_chunks().0);
    let c8: &[[f32; LANES]] = c[..whole].as_chunks().0;
    let mut lanes = [[0.0f32; LANES]; R];
    for (j, c) in c8.iter().enumerate() {
        for (r, lanes) in lanes.iter_mut().enumerate() {
            let (a, b) = (&a8[r][j], &b8[r][j]);
            *lanes = A::add8(*lanes, std::array::from_fn(|l| f(r, a[l], b[l], c[l])));
        }
    }
    std::array::from_fn(|r| {
        let tail = (whole..n).fold(0.0, |sum, i| sum + f(r, a[r][i], b[r][i], c[i]));
        fold(lanes[r]) + tail
    })
}

#[inline(always)]
fn forward_with<A: Arch>(
    p: &Params,
    x: &[f32],
    y: &mut [MaybeUninit<f32>],
    [means, rstds]: [&mut [f32]; 2],
) {
    let d = p.gamma.len();
    if d == 0 {
        return;
    }
    let rows = x.len() / d;
    let whole = rows / INTERLEAVE * INTERLEAVE;
    for first in (0..whole).step_by(INTERLEAVE) {
        forward_rows::<A, INTERLEAVE>(p, x, y, [means, rstds], first);
    }
    for first in whole..rows {
        forward_rows::<A, 1>(p, x, y, [means, rstds], first);
    }
}

/// [`forward_with`] for rows `first..first + R`.
#[inline(always)]
fn forward_rows<A: Arch, const R: usize>(
    p: &Params,
    x: &[f32],
    y: &mut [MaybeUninit<f32>],
    [means, rstds]: [&mut [f32]; 2],
    first: usize,
) {
    let d = p.gamma.len();
    // Divided, not multiplied by 1/d: a constant row's mean is then its value exactly, and
    // its normalised values are 0 rather than a rounding error times 1/√ε.
    let n = d as f32;
    let (gamma, beta) = (p.gamma, &p.beta[..d]);
    let rows: [&[f32]; R] = std::array::from_fn(|r| &x[(first + r) * d..(first + r + 1) * d]);
    let mu = match p.center {
        true => lane_sums::<A, R>(rows, rows, gamma, |_, x, _, _| x).map(|s| s / n),
        false => [0.0; R],
    };
    let var = lane_sums::<A, R>(rows, rows, gamma, |r, x, _, _| (x - mu[r]) * (x - mu[r]));
    for r in 0..R {
        let rstd = 1.0 / (var[r] / n + p.epsilon).sqrt();
        let (mu, row) = (mu[r], first + r);
        let y = &mut y[row * d..(row + 1) * d];
        for (((y, &x), &g), &b) in y.iter_mut().zip(rows[r]).zip(gamma).zip(beta) {
            y.write(A::madd((x - mu) * rstd, g, b));
        }
        (means[row], rstds[row]) = (mu, rstd);
    }
}

#[inline(always)]
fn backward_with<A: Arch>(
    rows: Rows,
    gamma: &[f32],
    mut dx: Option<&mut [MaybeUninit<f32>]>,
    [dgamma, dbeta]: [&mut [f32]; 2],
) {
    let d = gamma.len();
    if d == 0 {
        return;
    }
    let count = rows.x.len() / d;
    let whole = count / INTERLEAVE * INTERLEAVE;
    for first in (0..whole).step_by(INTERLEAVE) {
        let dx = dx.as_deref_mut();
        backward_rows::<A, INTERLEAVE>(&rows, gamma, dx, [dgamma, dbeta], first);
    }
    for first in whole..count {
        backward_rows::<A, 1>(&rows, gamma, dx.as_deref_mut(), [dgamma, dbeta], first);
    }
}

/// [`backward_with`] for rows `first..first + R`.
#[inline(always)]
fn backward_rows<A: Arch, const R: usize>(
    rows: &Rows,
    gamma: &[f32],
    mut dx: Option<&mut [MaybeUninit<f32>]>,
    [dgamma, dbeta]: [&mut [f32]; 2],
    first: usize,
) {
    let d = gamma.len();
    let inv_d = 1.0 / d as f32;
    let (dgamma, dbeta) = (&mut dgamma[..d], &mut dbeta[..d]);
    let at = |r: usize| (first + r) * d..(first + r + 1) * d;
    let x: [&[f32]; R] = std::array::from_fn(|r| &rows.x[at(r)]);
    let dy: [&[f32]; R] = std::array::from_fn(|r| &rows.dy[at(r)]);
    let mu: [f32; R] = std::array::from_fn(|r| rows.mean[first + r]);
    let s: [f32; R] = std::array::from_fn(|r| rows.rstd[first + r]);
    // Centring makes each output independent of its row's mean: dx loses its mean.
    let sum_g = match rows.center {
        true => lane_sums::<A, R>(dy, x, gamma, |_, dy, _, g| dy * g),
        false => [0.0; R],
    };
    let sum_gx = lane_sums::<A, R>(dy, x, gamma, |r, dy, x, g| dy * g * ((x - mu[r]) * s[r]));
    for r in 0..R {
        let (mu, s) = (mu[r], s[r]);
        let xhat = |x: f32| (x - mu) * s;
        for (((dg, db), &dy), &x) in dgamma.iter_mut().zip(dbeta.iter_mut()).zip(dy[r]).zip(x[r]) {
            *dg = A::madd(dy, xhat(x), *dg);
            *db += dy;
        }
        if let Some(dx) = dx.as_deref_mut() {
            let (a, b) = (sum_g[r] * inv_d, sum_gx[r] * inv_d);
            let dx = &mut dx[at(r)];
            for (((dx, &dy), &g), &x) in dx.iter_mut().zip(dy[r]).zip(gamma).zip(x[r]) {
                dx.write(s * (dy * g - a - xhat(x) * b));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::mem::MaybeUninit;

    use super::{Params, Rows, backward_with, forward_with};
    #[cfg(target_arch = "x86_64")]
    use crate::cpu::isa::Avx2;
    use crate::cpu::isa::Portable;

    /// The values of a buffer filled with NaN before a kernel wrote it.
    fn read(values: &[MaybeUninit<f32>]) -> Vec<f32> {
        // SAFETY: every element was initialised (NaN) before the kernel ran.
        values.iter().map(|x| unsafe { x.assume_init() }).collect()
    }

    /// Layer norm (the RMS norm unless `center`) of one row and its gradients, in f64.
    fn reference(
        x: &[f32],
        dy: &[f32],
        g: &[f32],
        b: &[f32],
        eps: f64,
        center: bool,
    ) -> [Vec<f64>; 4] {
        let d = x.len() as f64;
        let x: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        let mu = match center {
            true => x.iter().sum::<f64>() / d,
            false => 0.0,
        };
        let var = x.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / d;
        let s = 1.0 / (var + eps).sqrt();
        let xhat: Vec<f64> = x.iter().map(|v| (v - mu) * s).collect();
        let y = (0..x.len())
            .map(|i| xhat[i] * g[i] as f64 + b[i] as f64)
            .collect();
        let gg: Vec<f64> = (0..x.len()).map(|i| dy[i] as f64 * g[i] as f64).collect();
        let a = match center {
            true => gg.iter().sum::<f64>() / d,
            false => 0.0,
        };
        let c = (0..x.len()).map(|i| gg[i] * xhat[i]).sum::<f64>() / d;
        let dx = (0..x.len())
            .map(|i| s * (gg[i] - a - xhat[i] * c))
            .collect();
        let dgamma = (0..x.len()).map(|i| dy[i] as f64 * xhat[i]).collect();
        let dbeta = dy.iter().map(|&v| v as f64).collect();
        [y, dx, dgamma, dbeta]
    }

    #[test]
    fn rows_of_every_length_match_f64_centred_or_not() {
        for (d, center) in [1, 3, 8, 13, 64, 127]
            .into_iter()
            .flat_map(|d| [(d, true), (d, false)])
        {
            let x: Vec<f32> = (0..d)
                .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.7 + 3.0)
                .collect();
            let dy: Vec<f32> = (0..d).map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.3).collect();
            let g: Vec<f32> = (0..d).map(|i| 1.0 + i as f32 * 0.01).collect();
            let b: Vec<f32> = (0..d).map(|i| i as f32 * -0.02).collect();
            let want = reference(&x, &dy, &g, &b, 1e-5, center);
            // The AVX2 kernels where the CPU has them (run elsewhere, an illegal instruction).
            #[cfg(target_arch = "x86_64")]
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma");
            #[cfg(not(target_arch = "x86_64"))]
            let avx2 = false;
            for fma in [false, true].into_iter().filter(|&fma| !fma || avx2) {
                let p = Params {
                    gamma: &g,
                    beta: &b,
                    epsilon: 1e-5,
                    center,
                };
                let nan = MaybeUninit::new(f32::NAN);
                let (mut y, mut mean, mut rstd) = (vec![nan; d], [0.0], [0.0]);
                let (mut dx, mut dg, mut db) = (vec![nan; d], vec![0.0; d], vec![0.0; d]);
                let stats = [&mut mean[..], &mut rstd[..]];
                match fma {
                    false => forward_with::<Portable>(&p, &x, &mut y, stats),
                    #[cfg(target_arch = "x86_64")]
                    true => forward_with::<Avx2>(&p, &x, &mut y, stats),
                    #[cfg(not(target_arch = "x86_64"))]
                    true => continue,
                }
                let rows = Rows {
                    x: &x,
                    dy: &dy,
                    mean: &mean,
                    rstd: &rstd,
                    center,
                };
                let dp = [&mut dg[..], &mut db[..]];
                match fma {
                    false => backward_with::<Portable>(rows, &g, Some(&mut dx), dp),
                    #[cfg(target_arch = "x86_64")]
                    true => backward_with::<Avx2>(rows, &g, Some(&mut dx), dp),
                    #[cfg(not(target_arch = "x86_64"))]
                    true => continue,
                }
                let (y, dx) = (read(&y), read(&dx));
                for (got, want) in [&y, &dx, &dg, &db].into_iter().zip(&want) {
                    for (i, (&got, &want)) in got.iter().zip(want).enumerate() {
                        let error = (got as f64 - want).abs() / want.abs().max(1.0);
                        assert!(
                            error < 2e-6,
                            "d {d} center {center} fma {fma} [{i}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

/// The layer norm at the text task's shape (768 rows of 128), one thread: prints
/// microseconds per call. Run with `cargo test --release -p mha --lib norm_speed --
/// --ignored --nocapture`.
#[cfg(test)]
mod speed {
    use std::mem::MaybeUninit;
    use std::time::Instant;

    use super::{Backward, Forward, Params, Rows};
    use crate::cpu::isa::Isa;

    #[test]
    #[ignore = "a measurement, for release builds"]
    fn norm_speed() {
        let (rows, d) = (768usize, 128usize);
        let x: Vec<f32> = (0..rows * d)
            .map(|i| ((i * 37 % 101) as f32) * 0.01)
            .collect();
        let dy: Vec<f32> = (0..rows * d)
            .map(|i| ((i * 13 % 97) as f32) * 0.01)
            .collect();
        let g = vec![1.1f32; d];
        let b = vec![0.1f32; d];
        let mut y = vec![MaybeUninit::new(0.0f32); rows * d];
        let (mut mean, mut rstd) = (vec![0.0f32; rows], vec![0.0f32; rows]);
        let p = Params {
            gamma: &g,
            beta: &b,
            epsilon: 1e-5,
            center: true,
        };
        let reps = 2000;
        let t = Instant::now();
        for _ in 0..reps {
            Isa::best().run(Forward {
                p: &p,
                x: &x,
                y: &mut y,
                stats: [&mut mean, &mut rstd],
            });
        }
        println!(
            "norm forward {:.1} us",
            t.elapsed().as_secs_f64() / reps as f64 * 1e6
        );
        let (mut dg, mut db) = (vec![0.0f32; d], vec![0.0f32; d]);
        let t = Instant::now();
        for _ in 0..reps {
            Isa::best().run(Backward {
                rows: Rows {
                    x: &x,
                    dy: &dy,
                    mean: &mean,
                    rstd: &rstd,
                    center: true,
                },
                gamma: &g,
                dx: Some(&mut y),
                dp: [&mut dg, &mut db],
            });
        }
        println!(
            "norm backward {:.1} us",
            t.elapsed().as_secs_f64() / reps as f64 * 1e6
        );
    }
}
