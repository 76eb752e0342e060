//! The exact GELU, `x Φ(x) = x (1 + erf(x / √2)) / 2`, and its derivative
//! `Φ(x) + x φ(x)`, over f32 rows, with an `erf` that vectorises (the scalar `erff` of
//! the C library does not, and a feed-forward layer calls it for every hidden unit).
//!
//! `erf` is Abramowitz and Stegun's 7.1.26 (absolute error below 1.5e-7), the
//! approximation PyTorch's vectorised CPU `erf` uses; its `exp(-x²/2)` is the density's
//! too, so the derivative costs one `exp`.

use rayon::prelude::*;

use burn::backend::tensor::FloatTensor;

use crate::cpu::isa::{Arch, Isa, Kernel};

use std::mem::MaybeUninit;

use crate::cpu::{CpuTensors, dims_of, written};

use super::{CHUNK, chunks};

/// GELU of a rank-4 f32 tensor (any shape: its rows are read through their strides),
/// and, when `with_slope`, the derivative at each element, computed in the same pass.
pub(crate) fn gelu_forward<B: CpuTensors>(
    x: &FloatTensor<B>,
    with_slope: bool,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let x = B::readable(x);
    let dims = dims_of::<B>(&x);
    let input = B::floats(&x).contiguous(dims);
    let isa = Isa::best();
    let len = input.len();
    let mut slope = with_slope.then(|| Vec::<f32>::with_capacity(len));
    // The slope's chunks beside the output's, or none.
    let slopes = chunks(&mut slope, len);
    let fill = |out: &mut [MaybeUninit<f32>]| {
        out.par_chunks_mut(CHUNK)
            .zip(slopes)
            .zip(input.par_chunks(CHUNK))
            .for_each(|((out, slope), x)| isa.run(Forward { x, out, slope }))
    };
    // SAFETY: the chunks cover `out`, and `Forward` writes each of its elements.
    let out = unsafe { written(len, fill) };
    let slope = slope.map(|mut slope| {
        // SAFETY: the chunks covered the slope's `len` elements too, each written.
        unsafe { slope.set_len(len) };
        B::from_rows(slope, dims)
    });
    (B::from_rows(out, dims), slope)
}

/// The gradient of GELU from the slope [`gelu_forward`] computed and the output's
/// gradient `grad`, both rank 4 of one shape: their product.
pub(crate) fn gelu_backward<B: CpuTensors>(
    slope: &FloatTensor<B>,
    grad: &FloatTensor<B>,
) -> FloatTensor<B> {
    let (slope, grad) = (B::readable(slope), B::readable(grad));
    let dims = dims_of::<B>(&slope);
    let slope = B::floats(&slope).contiguous(dims);
    let upstream = B::floats(&grad).contiguous(dims);
    let fill = |out: &mut [MaybeUninit<f32>]| {
        out.par_chunks_mut(CHUNK)
            .zip(slope.par_chunks(CHUNK).zip(upstream.par_chunks(CHUNK)))
            .for_each(|(out, (s, g))| {
                for ((o, &s), &g) in out.iter_mut().zip(s).zip(g) {
                    o.write(s * g);
                }
            })
    };
    // SAFETY: the chunks cover `out`, and each element is written.
    B::from_rows(unsafe { written(slope.len(), fill) }, dims)
}

/// GELU of the values of `rows` in place, and its derivative into `slope` when given
/// (every element written): the epilogue of a linear layer's product (`cpu::linear`),
/// on the rows its thread has just written, inside that kernel's instruction set.
#[inline(always)]
pub(in crate::cpu) fn gelu_in_place<A: Arch>(
    rows: &mut [f32],
    slope: Option<&mut [MaybeUninit<f32>]>,
) {
    match slope {
        None => {
            for x in rows.iter_mut() {
                *x = gelu_and_slope::<A>(*x).0;
            }
        }
        Some(slope) => {
            for (x, s) in rows.iter_mut().zip(slope.iter_mut()) {
                let (value, derivative) = gelu_and_slope::<A>(*x);
                *x = value;
                s.write(derivative);
            }
        }
    }
}

/// GELU of `x` into `out`, and its derivative into `slope` when given (every element of
/// each written).
struct Forward<'a> {
    x: &'a [f32],
    out: &'a mut [MaybeUninit<f32>],
    slope: Option<&'a mut [MaybeUninit<f32>]>,
}

impl Kernel for Forward<'_> {
    type Output = ();

    #[inline(always)]
    fn run<A: Arch>(self) {
        run_with::<A>(self.x, self.out, self.slope);
    }
}

#[inline(always)]
fn run_with<A: Arch>(
    x: &[f32],
    out: &mut [MaybeUninit<f32>],
    slope: Option<&mut [MaybeUninit<f32>]>,
) {
    match slope {
        None => {
            for (o, &x) in out.iter_mut().zip(x) {
                o.write(gelu_and_slope::<A>(x).0);
            }
        }
        Some(slope) => {
            for ((o, s), &x) in out.iter_mut().zip(slope.iter_mut()).zip(x) {
                let (value, derivative) = gelu_and_slope::<A>(x);
                o.write(value);
                s.write(derivative);
            }
        }
    }
}

/// `(x Φ(x), Φ(x) + x φ(x))`, branch-free.
#[inline(always)]
fn gelu_and_slope<A: Arch>(x: f32) -> (f32, f32) {
    let madd = A::madd;
    const P: f32 = 0.327_591_1;
    const COEF: [f32; 5] = [
        0.254_829_6,
        -0.284_496_74,
        1.421_413_7,
        -1.453_152_1,
        1.061_405_4,
    ];
    const FRAC_1_SQRT_2: f32 = std::f32::consts::FRAC_1_SQRT_2;
    // 1 / √(2π)
    const INV_SQRT_2PI: f32 = 0.398_942_3;
    let z = (x * FRAC_1_SQRT_2).abs();
    let t = 1.0 / madd(P, z, 1.0);
    let poly = t * madd(
        madd(madd(madd(COEF[4], t, COEF[3]), t, COEF[2]), t, COEF[1]),
        t,
        COEF[0],
    );
    let gauss = A::exp(-z * z); // e^{-x²/2}
    let erf_abs = 1.0 - poly * gauss;
    let erf = erf_abs.copysign(x);
    let cdf = 0.5 * (1.0 + erf);
    (x * cdf, madd(x * INV_SQRT_2PI, gauss, cdf))
}

#[cfg(test)]
mod tests {
    use std::mem::MaybeUninit;

    use super::{gelu_and_slope, run_with};
    #[cfg(target_arch = "x86_64")]
    use crate::cpu::isa::Avx2;
    use crate::cpu::isa::Portable;

    fn erf64(x: f64) -> f64 {
        // The series to convergence, and the complement's continued fraction far out.
        if x.abs() > 4.0 {
            return x.signum();
        }
        let mut sum = 0.0;
        let mut term = x;
        let mut n = 0.0;
        while term.abs() > 1e-18 {
            sum += term / (2.0 * n + 1.0);
            n += 1.0;
            term *= -x * x / n;
        }
        sum * 2.0 / std::f64::consts::PI.sqrt()
    }

    #[test]
    fn gelu_and_its_slope_match_f64_over_the_line() {
        let mut worst = [0.0f64; 2];
        let mut x = -12.0f32;
        while x <= 12.0 {
            let xd = x as f64;
            let cdf = 0.5 * (1.0 + erf64(xd / std::f64::consts::SQRT_2));
            let pdf = (-xd * xd / 2.0).exp() / (2.0 * std::f64::consts::PI).sqrt();
            let (want_g, want_s) = (xd * cdf, cdf + xd * pdf);
            // Without and with fused multiply-adds (computed in software where the CPU
            // has none).
            #[cfg(target_arch = "x86_64")]
            let both = [gelu_and_slope::<Portable>(x), gelu_and_slope::<Avx2>(x)];
            #[cfg(not(target_arch = "x86_64"))]
            let both = [gelu_and_slope::<Portable>(x)];
            for (g, s) in both {
                let error = |got: f32, want: f64| (got as f64 - want).abs() / want.abs().max(1.0);
                worst[0] = worst[0].max(error(g, want_g));
                worst[1] = worst[1].max(error(s, want_s));
            }
            x += 0.000_97;
        }
        // erf's own error (1.5e-7, halved in Φ) and a few f32 roundings: measured 2.6e-7
        // for the value and 3.3e-7 for the slope.
        assert!(
            worst[0] < 4e-7 && worst[1] < 4e-7,
            "worst relative errors {worst:?}"
        );
    }

    #[test]
    fn every_tail_length_is_computed() {
        for len in [0, 1, 7, 8, 9, 33] {
            let x: Vec<f32> = (0..len).map(|i| i as f32 * 0.37 - 3.0).collect();
            let mut out = vec![MaybeUninit::new(f32::NAN); len];
            run_with::<Portable>(&x, &mut out, None);
            for (o, &x) in out.iter().zip(&x) {
                // SAFETY: initialised (NaN) before the call.
                assert_eq!(unsafe { o.assume_init() }, gelu_and_slope::<Portable>(x).0);
            }
            // With the slope, in the same pass.
            let mut slope = vec![MaybeUninit::new(f32::NAN); len];
            run_with::<Portable>(&x, &mut out, Some(&mut slope));
            for ((o, s), &x) in out.iter().zip(&slope).zip(&x) {
                // SAFETY: initialised (NaN) before the call.
                let (o, s) = unsafe { (o.assume_init(), s.assume_init()) };
                assert_eq!((o, s), gelu_and_slope::<Portable>(x));
            }
        }
    }

    /// GELU at the feed-forward's shape in the text task (768 rows of 512), one thread,
    /// without and with the slope: prints microseconds per call. Run with `cargo test
    /// --release -p mha --lib gelu_speed -- --ignored --nocapture`.
    #[test]
    #[ignore = "a measurement, for release builds"]
    fn gelu_speed() {
        use crate::cpu::isa::Isa;
        let n = 768 * 512;
        let x: Vec<f32> = (0..n)
            .map(|i| ((i * 37 % 101) as f32) * 0.04 - 2.0)
            .collect();
        let mut out = vec![MaybeUninit::new(0.0f32); n];
        let mut slope = vec![MaybeUninit::new(0.0f32); n];
        let reps = 500;
        for with_slope in [false, true] {
            let start = std::time::Instant::now();
            for _ in 0..reps {
                let slope = with_slope.then_some(&mut slope[..]);
                Isa::best().run(super::Forward {
                    x: &x,
                    out: &mut out,
                    slope,
                });
            }
            let us = start.elapsed().as_secs_f64() / reps as f64 * 1e6;
            println!("gelu [768, 512], slope {with_slope}: {us:.1} us");
        }
    }
}
