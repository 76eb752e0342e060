//! The products of a linear layer, `y = x W + b`, and of its backward pass, `dx = dy Wᵀ`,
//! `dW = xᵀ dy`, `db = Σ_rows dy`, through the `gemm` crate (AVX-512 or AVX2 kernels,
//! chosen at run time), reading every operand where it lies (the transposes are strides)
//! and writing each result once into a buffer of its own. The same kernels as flex's
//! matmul, without its allocation of every result (a zeroed buffer, then an aligned copy
//! of it in fresh pages).

use burn::backend::tensor::FloatTensor;

use super::{CpuTensors, Grid, dims_of};

/// The product `m x n x k` above which the kernels run on every thread (flex's threshold).
const PARALLEL: usize = 192 * 192 * 192;

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
    let mut out = vec![0.0f32; rows * d_out];
    if let Some(bias) = bias {
        let bias = B::readable(bias);
        let bias = B::floats(&bias).contiguous([1, 1, 1, d_out]);
        for row in out.chunks_exact_mut(d_out.max(1)) {
            row.copy_from_slice(&bias);
        }
    }
    let xm = Matrix::of(&B::floats(&x), [rows, d_in]);
    let wm = Matrix::of(&B::floats(&weight), [d_in, d_out]);
    // SAFETY: the grids bound both operands; `out` holds rows x d_out.
    unsafe {
        product(
            [rows, d_out, d_in],
            out.as_mut_ptr(),
            bias.is_some(),
            (xm.ptr, xm.row_stride, 1),
            (wm.ptr, wm.row_stride, 1),
        );
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
        let mut dx = vec![0.0f32; rows * d_in];
        // dx = dy Wᵀ: Wᵀ[p, j] = W[j, p].
        // SAFETY: the grids bound the operands; `dx` holds rows x d_in.
        unsafe {
            product(
                [rows, d_in, d_out],
                dx.as_mut_ptr(),
                false,
                (dy.ptr, dy.row_stride, 1),
                (wm.ptr, 1, wm.row_stride),
            );
        }
        B::from_rows(dx, [1, 1, rows, d_in])
    });
    let dw = want_weight.then(|| {
        let mut dw = vec![0.0f32; d_in * d_out];
        // dW = xᵀ dy: xᵀ[i, p] = x[p, i].
        // SAFETY: as above; `dw` holds d_in x d_out.
        unsafe {
            product(
                [d_in, d_out, rows],
                dw.as_mut_ptr(),
                false,
                (xm.ptr, 1, xm.row_stride),
                (dy.ptr, dy.row_stride, 1),
            );
        }
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
