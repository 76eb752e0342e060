//! The products of a linear layer, `y = x W + b`, and of its backward pass, `dx = dy Wᵀ`,
//! `dW = xᵀ dy`, `db = Σ_rows dy`, through the `gemm` crate (AVX-512 or AVX2 kernels,
//! chosen at run time), reading every operand where it lies (the transposes are strides)
//! and writing each result once into a buffer of its own. The same kernels as flex's
//! matmul, without its allocation of every result (a zeroed buffer, then an aligned copy
//! of it in fresh pages).
//!
//! A second matrix engine beside the tiles' kernel (`super::gemm`), each where it is the
//! faster one, on one thread: a linear layer's products are large (thousands of rows by
//! hundreds), where the crate's packing of both operands pays, and the crate splits them
//! over the threads itself (the tiles' kernel leaves threads to its callers); a tile's
//! are 64 x 64 by a head's width, fused with the softmax between them, where the crate's
//! packing at every call costs more than it saves. The `engines` test below times both
//! at both sizes; docs/benchmarks.md ("Matrix engines") has its numbers.

use burn::backend::tensor::FloatTensor;
use rayon::prelude::*;

use super::{CpuTensors, Grid, dims_of};

/// The product `m x n x k` above which the kernels run on every thread (flex's threshold).
const PARALLEL: usize = 192 * 192 * 192;

/// Elements of the output per parallel task of the bias's addition (whole rows).
const BIAS_CHUNK: usize = 1 << 14;

/// A matrix read through a [`Grid`] of shape `[1, 1, rows, cols]` with unit column stride:
/// its first element and row stride.
struct Matrix {
    ptr: *const f32,
    row_stride: usize,
}

impl Matrix {
    fn of(grid: &Grid<f32>, [rows, cols]: [usize; 2]) -> Self {
        let (ptr, row_stride) = grid.rows(0, 0, 0, [rows, cols]);
        Self { ptr, row_stride }
    }
}

/// `dst (m x n, row-major, read when `add`) (+)= lhs · rhs`, each operand a pointer with
/// its (row, column) strides.
///
/// # Safety
/// Every element the sizes and strides name is in bounds.
unsafe fn product(
    [m, n, k]: [usize; 3],
    dst: *mut f32,
    add: bool,
    (lhs, lhs_rs, lhs_cs): (*const f32, usize, usize),
    (rhs, rhs_rs, rhs_cs): (*const f32, usize, usize),
) {
    let parallelism = match m.saturating_mul(n).saturating_mul(k) >= PARALLEL {
        true => gemm::Parallelism::Rayon(0),
        false => gemm::Parallelism::None,
    };
    // SAFETY: the caller's contract.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            n as isize,
            add,
            lhs,
            lhs_cs as isize,
            lhs_rs as isize,
            rhs,
            rhs_cs as isize,
            rhs_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// A buffer of `len` floats that `write` fills whole through the pointer it is given (a
/// [`product`] without `add` writes every element of its `m x n` result and reads none),
/// not zeroed first ([`super::written`]). A product over `k = 0` writes nothing (its
/// result is zeros): that buffer is zeroed.
///
/// # Safety
/// Unless `k` is 0, `write` initialises all `len` elements behind the pointer.
unsafe fn written_whole(len: usize, k: usize, write: impl FnOnce(*mut f32)) -> Vec<f32> {
    if k == 0 {
        return vec![0.0f32; len];
    }
    // SAFETY: the caller's contract.
    unsafe { super::written(len, |out| write(out.as_mut_ptr().cast())) }
}

/// `x W + b` for `x` `[1, 1, rows, d_in]`, `weight` `[1, 1, d_in, d_out]` and `bias`
/// `[1, 1, 1, d_out]`, each read through its strides (unit along the last axis).
pub(crate) fn linear_forward<B: CpuTensors>(
    x: &FloatTensor<B>,
    weight: &FloatTensor<B>,
    bias: Option<&FloatTensor<B>>,
) -> FloatTensor<B> {
    let (x, weight) = (B::readable(x), B::readable(weight));
    let [_, _, rows, d_in] = dims_of::<B>(&x);
    let d_out = dims_of::<B>(&weight)[3];
    let xm = Matrix::of(&B::floats(&x), [rows, d_in]);
    let wm = Matrix::of(&B::floats(&weight), [d_in, d_out]);
    let run = |out: *mut f32| {
        // SAFETY: the grids bound both operands; `out` holds rows x d_out.
        unsafe {
            product(
                [rows, d_out, d_in],
                out,
                false,
                (xm.ptr, xm.row_stride, 1),
                (wm.ptr, wm.row_stride, 1),
            );
        }
    };
    // SAFETY: a product without `add` writes its whole rows x d_out result.
    let mut out = unsafe { written_whole(rows * d_out, d_in, run) };
    if let Some(bias) = bias {
        // Added to the product in parallel (the product written first, then the bias:
        // filling every row with the bias for the product to add to was a pass over the
        // output on one thread while the others waited).
        let bias = B::readable(bias);
        let bias = B::floats(&bias).contiguous([1, 1, 1, d_out]);
        let per = (BIAS_CHUNK / d_out.max(1)).max(1) * d_out.max(1);
        out.par_chunks_mut(per).for_each(|block| {
            for row in block.chunks_exact_mut(d_out) {
                row.iter_mut().zip(bias.iter()).for_each(|(o, b)| *o += b);
            }
        });
    }
    B::from_rows(out, [1, 1, rows, d_out])
}

/// The gradients of [`linear_forward`] from the output's gradient `grad` `[1, 1, rows,
/// d_out]`: of the input (`[1, 1, rows, d_in]`), the weight (`[1, 1, d_in, d_out]`) and
/// the bias (`[1, 1, 1, d_out]`), each only when `wanted`.
pub(crate) fn linear_backward<B: CpuTensors>(
    x: &FloatTensor<B>,
    weight: &FloatTensor<B>,
    grad: &FloatTensor<B>,
    [want_x, want_weight, want_bias]: [bool; 3],
) -> [Option<FloatTensor<B>>; 3] {
    let (x, weight, grad) = (B::readable(x), B::readable(weight), B::readable(grad));
    let [_, _, rows, d_in] = dims_of::<B>(&x);
    let d_out = dims_of::<B>(&weight)[3];
    let xm = Matrix::of(&B::floats(&x), [rows, d_in]);
    let wm = Matrix::of(&B::floats(&weight), [d_in, d_out]);
    let dy = Matrix::of(&B::floats(&grad), [rows, d_out]);
    let dx = want_x.then(|| {
        // dx = dy Wᵀ: Wᵀ[p, j] = W[j, p].
        let write = |dx| {
            // SAFETY: the grids bound the operands; `dx` holds rows x d_in.
            unsafe {
                product(
                    [rows, d_in, d_out],
                    dx,
                    false,
                    (dy.ptr, dy.row_stride, 1),
                    (wm.ptr, 1, wm.row_stride),
                );
            }
        };
        // SAFETY: a product without `add` writes its whole result.
        let dx = unsafe { written_whole(rows * d_in, d_out, write) };
        B::from_rows(dx, [1, 1, rows, d_in])
    });
    let dw = want_weight.then(|| {
        // dW = xᵀ dy: xᵀ[i, p] = x[p, i].
        let write = |dw| {
            // SAFETY: as above; `dw` holds d_in x d_out.
            unsafe {
                product(
                    [d_in, d_out, rows],
                    dw,
                    false,
                    (xm.ptr, 1, xm.row_stride),
                    (dy.ptr, dy.row_stride, 1),
                );
            }
        };
        // SAFETY: a product without `add` writes its whole result.
        let dw = unsafe { written_whole(d_in * d_out, rows, write) };
        B::from_rows(dw, [1, 1, d_in, d_out])
    });
    let db = want_bias.then(|| {
        let ones = vec![1.0f32; rows];
        let mut db = vec![0.0f32; d_out];
        // db = 1ᵀ dy.
        // SAFETY: as above; `ones` holds 1 x rows, `db` 1 x d_out.
        unsafe {
            product(
                [1, d_out, rows],
                db.as_mut_ptr(),
                false,
                (ones.as_ptr(), rows, 1),
                (dy.ptr, dy.row_stride, 1),
            );
        }
        B::from_rows(db, [1, 1, 1, d_out])
    });
    [dx, dw, db]
}

/// The two matrix engines at the sizes each serves, one thread: the tiles' kernel
/// (`super::gemm`, through `super::isa`) and the `gemm` crate, on a tile's product (64
/// keys by 64 queries over a head's 64 dimensions, the keys' rows strided as in a `[B, T,
/// H·Dh]` projection) and on a linear layer's (4096 rows, 512 by 512). Prints the time
/// per product and GFLOP/s; asserts only that both agree. Run with
/// `cargo test --release -p mha --lib engines -- --ignored --nocapture`.
#[cfg(test)]
mod engines {
    use std::time::Instant;

    use super::super::isa::{Arch, Isa, Kernel};
    use super::super::testing::random;

    /// `reps` products `c = a b` with the tiles' kernel (`a` with row stride `lda`).
    struct Ours<'a> {
        mnk: [usize; 3],
        a: (&'a [f32], usize),
        b: &'a [f32],
        c: &'a mut [f32],
        reps: usize,
    }

    impl Kernel for Ours<'_> {
        type Output = ();

        #[inline(always)]
        fn run<A: Arch>(self) {
            let [_, n, _] = self.mnk;
            for _ in 0..self.reps {
                // SAFETY: the buffers hold the sizes (see `measure`).
                unsafe {
                    let a = (self.a.0.as_ptr(), self.a.1, 1);
                    let c = (self.c.as_mut_ptr(), n);
                    A::gemm(self.mnk, a, (self.b.as_ptr(), n), c, false);
                }
            }
        }
    }

    /// Seconds per product of each engine, and the largest difference between them.
    fn measure([m, n, k]: [usize; 3], lda: usize, reps: usize) -> [f64; 3] {
        let a = random(m * lda, 1);
        let b = random(k * n, 2);
        let (mut ours, mut theirs) = (vec![0.0f32; m * n], vec![0.0f32; m * n]);
        let mut best = [f64::INFINITY; 2];
        for _ in 0..3 {
            let start = Instant::now();
            Isa::best().run(Ours {
                mnk: [m, n, k],
                a: (&a, lda),
                b: &b,
                c: &mut ours,
                reps,
            });
            best[0] = best[0].min(start.elapsed().as_secs_f64() / reps as f64);
            let start = Instant::now();
            for _ in 0..reps {
                // SAFETY: as above.
                unsafe {
                    gemm::gemm(
                        m,
                        n,
                        k,
                        theirs.as_mut_ptr(),
                        1,
                        n as isize,
                        false,
                        a.as_ptr(),
                        1,
                        lda as isize,
                        b.as_ptr(),
                        1,
                        n as isize,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
            }
            best[1] = best[1].min(start.elapsed().as_secs_f64() / reps as f64);
        }
        let diff = ours
            .iter()
            .zip(&theirs)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        [best[0], best[1], diff as f64]
    }

    #[test]
    #[ignore = "a measurement, for release builds"]
    fn engines() {
        for (what, mnk, lda, reps) in [
            (
                "tile 64 x 64 x 64, keys 512 apart",
                [64, 64, 64],
                512,
                20_000,
            ),
            ("linear 4096 x 512 x 512", [4096, 512, 512], 512, 5),
        ] {
            let [ours, theirs, diff] = measure(mnk, lda, reps);
            let flop = 2.0 * mnk.iter().product::<usize>() as f64;
            println!(
                "{what} ({:?}): tiles' kernel {:.2} us ({:.1} GFLOP/s), gemm crate {:.2} us \
                 ({:.1} GFLOP/s); max difference {diff:.1e}",
                Isa::best(),
                ours * 1e6,
                flop / ours * 1e-9,
                theirs * 1e6,
                flop / theirs * 1e-9,
            );
            assert!(diff <= 1e-3, "{what}: the engines differ by {diff}");
        }
    }
}
