//! The products of a linear layer, `y = x W + b`, and of its backward pass, `dx = dy Wᵀ`,
//! `dW = xᵀ dy`, `db = Σ_rows dy`, through the `gemm` crate (AVX-512 or AVX2 kernels,
//! chosen at run time), reading every operand where it lies (the transposes are strides)
//! and writing each result once into a buffer of its own. The same kernels as flex's
//! matmul, without its allocation of every result (a zeroed buffer, then an aligned copy
//! of it in fresh pages).
//!
//! Large products are split by rows, two blocks of rows per thread, each block's
//! products on one thread ([`blocks`]): the forward pass's rows of `y`, the backward pass's rows of
//! `dx` and each block's share of `dW` and `db` (added up after, in block order). The
//! crate's own split is by columns, each thread reading every row of `x`: half of them
//! from the other core's cache, where the operation before (a layer norm, GELU, split
//! by rows) left them. By rows, each core reads the rows it wrote and writes the rows the
//! next operation reads on it.
//!
//! A second matrix engine beside the tiles' kernel (`super::gemm`), each where it is the
//! faster one, on one thread: a linear layer's products are large (thousands of rows by
//! hundreds), where the crate's packing of both operands pays; a tile's are 64 x 64 by a
//! head's width, fused with the softmax between them, where the crate's packing at every
//! call costs more than it saves. The `engines` test below times both at both sizes;
//! docs/benchmarks.md ("Matrix engines") has its numbers.

use std::mem::MaybeUninit;
use std::ops::Range;

use burn::backend::tensor::FloatTensor;

use super::blocks::{Chunks, SERIAL_BELOW, for_each_block};
use super::isa::{Arch, Isa, Kernel};
use super::rows::gelu::gelu_in_place;
use super::{CpuTensors, Grid, Out, dims_of, written};

/// Rows of a block at least: fewer rows are one block.
const BLOCK_ROWS: usize = 64;

/// Elements per parallel task of the sum of the blocks' shares of `dW`.
const SUM_CHUNK: usize = 1 << 14;

/// Floats the blocks' shares of `dW` may take besides `dW` itself (32 MB); past it, `dW`
/// is computed by blocks of its own rows ([`weight_gradient`]).
const SHARES: usize = 1 << 23;

/// A matrix in memory: its first element and row stride, its column stride 1.
#[derive(Clone, Copy)]
struct Matrix {
    ptr: *const f32,
    row_stride: usize,
}

// SAFETY: a matrix is only read (each task reads rows of it).
unsafe impl Send for Matrix {}
// SAFETY: as for `Send`.
unsafe impl Sync for Matrix {}

impl Matrix {
    /// The `[1, 1, rows, cols]` matrix of `grid`.
    fn of(grid: &Grid<f32>, [rows, cols]: [usize; 2]) -> Self {
        let (ptr, row_stride) = grid.rows(0, 0, 0, [rows, cols]);
        Self { ptr, row_stride }
    }

    /// The matrix from row `row` on.
    fn below(self, row: usize) -> Self {
        Self {
            ptr: self.ptr.wrapping_add(row * self.row_stride),
            ..self
        }
    }

    /// The matrix from column `column` on.
    fn right_of(self, column: usize) -> Self {
        Self {
            ptr: self.ptr.wrapping_add(column),
            ..self
        }
    }

    /// The matrix as an operand of [`product`]: pointer, row stride, column stride.
    fn plain(self) -> (*const f32, usize, usize) {
        (self.ptr, self.row_stride, 1)
    }

    /// The transpose as an operand of [`product`].
    fn transposed(self) -> (*const f32, usize, usize) {
        (self.ptr, 1, self.row_stride)
    }
}

/// The blocks of rows a layer's products over `rows` rows of `x` `[rows, d_in]` and
/// `W` `[d_in, d_out]` are split into: two per thread of the pool when the product is
/// large (a thread done with its blocks takes one of another's, when one core runs
/// slower than the other; in the text task's steps on 2 cores two blocks per thread took
/// 2% less time than one, and three 3% more than two), else one. Every call with the
/// same sizes and threads splits the same way (and so adds `dW`'s shares in the same
/// order), whichever thread takes which block.
fn blocks([rows, d_in, d_out]: [usize; 3]) -> usize {
    if !large([rows, d_in, d_out]) {
        return 1;
    }
    (2 * rayon::current_num_threads())
        .min(rows / BLOCK_ROWS)
        .max(1)
}

/// The rows of block `p` of `blocks`.
fn bounds(rows: usize, blocks: usize, p: usize) -> Range<usize> {
    rows * p / blocks..rows * (p + 1) / blocks
}

/// `dst (m x n, row stride dst_rs) = lhs · rhs`, each operand a pointer with its (row,
/// column) strides: on this thread, or split by the crate over the pool's threads when
/// `split` (a large product that is one block of rows: few rows, many columns). A
/// product over `k = 0` writes zeros.
///
/// # Safety
/// Every element the sizes and strides name is in bounds.
unsafe fn product(
    split: bool,
    [m, n, k]: [usize; 3],
    (dst, dst_rs): (*mut f32, usize),
    (lhs, lhs_rs, lhs_cs): (*const f32, usize, usize),
    (rhs, rhs_rs, rhs_cs): (*const f32, usize, usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for row in 0..m {
            // SAFETY: row `row` of dst, n elements (the caller's contract).
            unsafe { std::ptr::write_bytes(dst.add(row * dst_rs), 0, n) };
        }
        return;
    }
    // SAFETY: the caller's contract.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_rs as isize,
            false,
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
            match split {
                true => gemm::Parallelism::Rayon(0),
                false => gemm::Parallelism::None,
            },
        );
    }
}

/// Whether a product of these sizes (`[m, n, k]` in any order) is large enough to run
/// on several threads.
fn large(sizes: [usize; 3]) -> bool {
    sizes
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .is_none_or(|n| n >= SERIAL_BELOW)
}

/// `x W + b` for `x` `[1, 1, rows, d_in]`, `weight` `[1, 1, d_in, d_out]` and `bias`
/// `[1, 1, 1, d_out]`, each read through its strides (unit along the last axis).
pub(crate) fn linear_forward<B: CpuTensors>(
    x: &FloatTensor<B>,
    weight: &FloatTensor<B>,
    bias: Option<&FloatTensor<B>>,
) -> FloatTensor<B> {
    linear_then::<B>(x, weight, bias, Then::Nothing).0
}

/// `GELU(x W + b)` as [`linear_forward`] computes `x W + b`, the GELU of each block of
/// rows computed where its product left it, in the cache of its thread; and, when
/// `with_slope`, GELU's derivative at each element (`[1, 1, rows, d_out]`, for
/// [`linear_backward`]).
pub(crate) fn linear_gelu_forward<B: CpuTensors>(
    x: &FloatTensor<B>,
    weight: &FloatTensor<B>,
    bias: Option<&FloatTensor<B>>,
    with_slope: bool,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    linear_then::<B>(x, weight, bias, Then::Gelu { with_slope })
}

/// What a forward product's blocks of rows go through before they are written out.
#[derive(Clone, Copy)]
enum Then {
    Nothing,
    /// The exact GELU, and its derivative too when `with_slope`.
    Gelu {
        with_slope: bool,
    },
}

/// [`linear_forward`] and [`linear_gelu_forward`].
fn linear_then<B: CpuTensors>(
    x: &FloatTensor<B>,
    weight: &FloatTensor<B>,
    bias: Option<&FloatTensor<B>>,
    then: Then,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let (x, weight) = (B::readable(x), B::readable(weight));
    let [_, _, rows, d_in] = dims_of::<B>(&x);
    let d_out = dims_of::<B>(&weight)[3];
    let x = Matrix::of(&B::floats(&x), [rows, d_in]);
    let weight = Matrix::of(&B::floats(&weight), [d_in, d_out]);
    let bias = bias.map(B::readable);
    let bias = bias
        .as_ref()
        .map(|bias| B::floats(bias).contiguous([1, 1, 1, d_out]));
    let sizes = [rows, d_in, d_out];
    let (y, slope) = forward_in(sizes, [x, weight], bias.as_deref(), then, blocks(sizes));
    let dims = [1, 1, rows, d_out];
    (
        B::from_rows(y, dims),
        slope.map(|slope| B::from_rows(slope, dims)),
    )
}

/// `x W + b` (`sizes`: rows, d_in, d_out) in `blocks` blocks of rows, each through
/// `then`; with GELU's slope when asked for.
fn forward_in(
    [rows, d_in, d_out]: [usize; 3],
    [x, weight]: [Matrix; 2],
    bias: Option<&[f32]>,
    then: Then,
    blocks: usize,
) -> (Vec<f32>, Option<Vec<f32>>) {
    let isa = Isa::best();
    let mut slope = match then {
        Then::Gelu { with_slope: true } => Some(Vec::<f32>::with_capacity(rows * d_out)),
        _ => None,
    };
    let slope_out = slope.as_mut().map(|slope| Out::new(slope.as_mut_ptr()));
    let split = blocks == 1 && large([rows, d_in, d_out]);
    let fill = |out: &mut [MaybeUninit<f32>]| {
        let out = Out::new(out.as_mut_ptr().cast());
        for_each_block(blocks, |p| {
            let range = bounds(rows, blocks, p);
            let len = range.len() * d_out;
            let y = out.at(range.start * d_out);
            // SAFETY: the matrices hold their rows; the block's rows of y are its own.
            unsafe {
                let x = x.below(range.start).plain();
                product(
                    split,
                    [range.len(), d_out, d_in],
                    (y, d_out),
                    x,
                    weight.plain(),
                );
            }
            // SAFETY: the block's rows of y, written just now.
            let y = unsafe { std::slice::from_raw_parts_mut(y, len) };
            let gelu = match then {
                Then::Nothing => None,
                // SAFETY: the block's rows of the slope are its own.
                Then::Gelu { .. } => Some(slope_out.map(|s| unsafe {
                    std::slice::from_raw_parts_mut(s.at(range.start * d_out).cast(), len)
                })),
            };
            if bias.is_some() || gelu.is_some() {
                isa.run(Epilogue {
                    y,
                    cols: d_out,
                    bias,
                    gelu,
                });
            }
        });
    };
    // SAFETY: the blocks' rows cover y, and each block writes its rows whole.
    let y = unsafe { written(rows * d_out, fill) };
    if let Some(slope) = slope.as_mut() {
        // SAFETY: as for y: the blocks wrote every row of the slope.
        unsafe { slope.set_len(rows * d_out) };
    }
    (y, slope)
}

/// The gradients of [`linear_forward`] from the output's gradient `grad` `[1, 1, rows,
/// d_out]`: of the input (`[1, 1, rows, d_in]`), the weight (`[1, 1, d_in, d_out]`) and
/// the bias (`[1, 1, 1, d_out]`), each only when `wanted`.
///
/// After [`linear_gelu_forward`], `slope` is the GELU's derivative it returned, and
/// `grad` the gradient of the GELU's output: the gradient of `x W + b` is their product,
/// computed block by block before the block's products.
pub(crate) fn linear_backward<B: CpuTensors>(
    x: &FloatTensor<B>,
    weight: &FloatTensor<B>,
    grad: &FloatTensor<B>,
    slope: Option<&FloatTensor<B>>,
    wanted: [bool; 3],
) -> [Option<FloatTensor<B>>; 3] {
    let (x, weight, grad) = (B::readable(x), B::readable(weight), B::readable(grad));
    let slope = slope.map(B::readable);
    let [_, _, rows, d_in] = dims_of::<B>(&x);
    let d_out = dims_of::<B>(&weight)[3];
    let x = Matrix::of(&B::floats(&x), [rows, d_in]);
    let weight = Matrix::of(&B::floats(&weight), [d_in, d_out]);
    let dy = Matrix::of(&B::floats(&grad), [rows, d_out]);
    let slope = slope
        .as_ref()
        .map(|slope| Matrix::of(&B::floats(slope), [rows, d_out]));
    let sizes = [rows, d_in, d_out];
    let split = [blocks(sizes), SHARES];
    let [dx, dw, db] = backward_in(sizes, [x, weight, dy], slope, wanted, split);
    [
        dx.map(|dx| B::from_rows(dx, [1, 1, rows, d_in])),
        dw.map(|dw| B::from_rows(dw, [1, 1, d_in, d_out])),
        db.map(|db| B::from_rows(db, [1, 1, 1, d_out])),
    ]
}

/// `[dx, dW, db]`, each when wanted, from `[x, W, dy]` (`sizes`: rows, d_in, d_out), in
/// `blocks` blocks of rows: each block's rows of `dx` and its shares of `dW` (`x_pᵀ
/// dy_p`) and `db`, block 0's in the results themselves, the others' added to them
/// after, in block order. Where the other blocks' shares of `dW` would take more than
/// `shares` floats (a wide layer on many threads), `dW` is computed after, by blocks of
/// its own rows, each over every row of `dy`. With a `slope` (`[rows, d_out]`), `dy ⊙
/// slope` in place of `dy`, each block's rows multiplied first.
fn backward_in(
    [rows, d_in, d_out]: [usize; 3],
    [x, weight, dy]: [Matrix; 3],
    slope: Option<Matrix>,
    [want_x, want_weight, want_bias]: [bool; 3],
    [blocks, shares]: [usize; 2],
) -> [Option<Vec<f32>>; 3] {
    let split = blocks == 1 && large([rows, d_in, d_out]);
    let shared_dw = want_weight && (blocks - 1).saturating_mul(d_in * d_out) <= shares;
    let (dw_len, db_len) = (
        d_in * d_out * shared_dw as usize,
        d_out * want_bias as usize,
    );
    let share = dw_len + db_len;
    let dx_len = rows * d_in * want_x as usize;
    let mut dx = Vec::<f32>::with_capacity(dx_len);
    let mut first = Vec::<f32>::with_capacity(share);
    let mut others = Vec::<f32>::with_capacity((blocks - 1) * share);
    // `dy ⊙ slope` of every row, for a dW computed after the blocks.
    let mut through_all = (slope.is_some() && want_weight && !shared_dw)
        .then(|| Vec::<f32>::with_capacity(rows * d_out));
    let (dx_out, first_out) = (Out::new(dx.as_mut_ptr()), Out::new(first.as_mut_ptr()));
    let others_out = Out::new(others.as_mut_ptr());
    let through_out = through_all.as_mut().map(|t| Out::new(t.as_mut_ptr()));
    let isa = Isa::best();
    for_each_block(blocks, |p| {
        let range = bounds(rows, blocks, p);
        let (n, dy) = (range.len(), dy.below(range.start));
        let share_out = match p {
            0 => first_out,
            _ => Out::new(others_out.at((p - 1) * share)),
        };
        // Through the GELU: the block's `dy ⊙ slope`, in its thread's cache (or in its
        // rows of `through_all`); and its share of db, in the same pass.
        let mut own = slope
            .filter(|_| through_out.is_none())
            .map(|_| Vec::<f32>::with_capacity(n * d_out));
        // The pointer first, the slice `Prepare` writes made from it: read through the
        // pointer once the slice is gone (a pointer taken from the slice would not stay
        // valid past its writes).
        let through_ptr: Option<*mut MaybeUninit<f32>> = match (&mut own, through_out) {
            (Some(own), _) => Some(own.spare_capacity_mut()[..n * d_out].as_mut_ptr()),
            (None, Some(all)) => Some(all.at(range.start * d_out).cast()),
            (None, None) => None,
        };
        // SAFETY: either holds n·d_out floats of the block's own (its cache's capacity, or
        // its rows of `through_all`), which nothing else reads or writes meanwhile.
        let through =
            through_ptr.map(|ptr| unsafe { std::slice::from_raw_parts_mut(ptr, n * d_out) });
        let through_ptr = through_ptr.map(|ptr| ptr.cast_const().cast::<f32>());
        // SAFETY: the block's share of db is its own, zeroed (its buffer's spare capacity
        // is not yet initialised) before a slice of it is made.
        let db = want_bias.then(|| unsafe {
            share_out.at(dw_len).write_bytes(0, d_out);
            std::slice::from_raw_parts_mut(share_out.at(dw_len), d_out)
        });
        isa.run(Prepare {
            dy,
            slope: slope.map(|slope| slope.below(range.start)),
            size: [n, d_out],
            through,
            db,
        });
        let dy = match through_ptr {
            // `Prepare` wrote every row of it.
            Some(ptr) => Matrix {
                ptr,
                row_stride: d_out,
            },
            None => dy,
        };
        if want_x {
            // dx = dy Wᵀ over the block's rows.
            // SAFETY: the matrices hold their rows; the block's rows of dx are its own.
            unsafe {
                let dx = (dx_out.at(range.start * d_in), d_in);
                product(split, [n, d_in, d_out], dx, dy.plain(), weight.transposed());
            }
        }
        if shared_dw {
            // The block's share of dW = xᵀ dy: x_pᵀ dy_p.
            // SAFETY: as above; the block's share is its own.
            unsafe {
                let x = x.below(range.start).transposed();
                product(
                    split,
                    [d_in, d_out, n],
                    (share_out.at(0), d_out),
                    x,
                    dy.plain(),
                );
            }
        }
        drop(own);
    });
    // SAFETY: the blocks wrote every row of dx (when wanted), every share, and every row
    // of `through_all`.
    unsafe {
        dx.set_len(dx_len);
        first.set_len(share);
        others.set_len((blocks - 1) * share);
        if let Some(t) = through_all.as_mut() {
            t.set_len(rows * d_out);
        }
    }
    if blocks > 1 && share > 0 {
        let sums = Chunks::new(&mut first, SUM_CHUNK);
        for_each_block(sums.count(), |c| {
            // SAFETY: each block takes its own chunk, once.
            let sum = unsafe { sums.take(c) };
            let at = c * SUM_CHUNK;
            for part in others.chunks_exact(share) {
                let part = &part[at..at + sum.len()];
                sum.iter_mut().zip(part).for_each(|(s, &x)| *s += x);
            }
        });
    }
    let db = want_bias.then(|| first.split_off(dw_len));
    let dw = match (want_weight, shared_dw) {
        (false, _) => None,
        (true, true) => Some(first),
        (true, false) => {
            let dy = through_all.as_ref().map_or(dy, |t| Matrix {
                ptr: t.as_ptr(),
                row_stride: d_out,
            });
            Some(weight_gradient([rows, d_in, d_out], x, dy))
        }
    };
    [want_x.then_some(dx), dw, db]
}

/// `dW = xᵀ dy` (`sizes`: rows, d_in, d_out) by blocks of the rows of `dW`, each over
/// every row of `x` and `dy`.
fn weight_gradient([rows, d_in, d_out]: [usize; 3], x: Matrix, dy: Matrix) -> Vec<f32> {
    let blocks = blocks([d_in, rows, d_out]);
    let split = blocks == 1 && large([rows, d_in, d_out]);
    let fill = |out: &mut [MaybeUninit<f32>]| {
        let out = Out::new(out.as_mut_ptr().cast());
        for_each_block(blocks, |p| {
            let range = bounds(d_in, blocks, p);
            // The columns `range` of x, transposed: rows of xᵀ.
            let xt = x.right_of(range.start).transposed();
            // SAFETY: the matrices hold their rows; the block's rows of dW are its own.
            unsafe {
                let dst = (out.at(range.start * d_out), d_out);
                product(split, [range.len(), d_out, rows], dst, xt, dy.plain());
            }
        });
    };
    // SAFETY: the blocks' rows cover dW, each written whole (zeros over no row).
    unsafe { written(d_in * d_out, fill) }
}

/// A forward block's pass over its rows of `y` (`cols` wide) after the product: the
/// bias added, then GELU (and its slope, when given) when asked for, row after row.
struct Epilogue<'a> {
    y: &'a mut [f32],
    cols: usize,
    bias: Option<&'a [f32]>,
    gelu: Option<Option<&'a mut [MaybeUninit<f32>]>>,
}

impl Kernel for Epilogue<'_> {
    type Output = ();

    #[inline(always)]
    fn run<A: Arch>(self) {
        let Self {
            y,
            cols,
            bias,
            mut gelu,
        } = self;
        if cols == 0 {
            return;
        }
        for (r, row) in y.chunks_exact_mut(cols).enumerate() {
            if let Some(bias) = bias {
                row.iter_mut().zip(bias).for_each(|(o, b)| *o += b);
            }
            match gelu.as_mut() {
                Some(Some(slope)) => {
                    gelu_in_place::<A>(row, Some(&mut slope[r * cols..(r + 1) * cols]))
                }
                Some(None) => gelu_in_place::<A>(row, None),
                None => {}
            }
        }
    }
}

/// A backward block's pass over its rows of `dy` (`size`: rows, columns) before the
/// products: `dy ⊙ slope` into `through` when there is a slope, and the column sums of
/// that (or of `dy`) into `db` when wanted, row after row.
struct Prepare<'a> {
    dy: Matrix,
    slope: Option<Matrix>,
    size: [usize; 2],
    through: Option<&'a mut [MaybeUninit<f32>]>,
    db: Option<&'a mut [f32]>,
}

impl Kernel for Prepare<'_> {
    type Output = ();

    #[inline(always)]
    fn run<A: Arch>(self) {
        let Self {
            dy,
            slope,
            size: [rows, cols],
            mut through,
            mut db,
        } = self;
        if let Some(db) = db.as_mut() {
            db.fill(0.0);
        }
        for r in 0..rows {
            // SAFETY: row r of the block's dy, `cols` long (the caller's matrices).
            let g = unsafe { std::slice::from_raw_parts(dy.ptr.add(r * dy.row_stride), cols) };
            let row = match (slope, through.as_mut()) {
                (Some(slope), Some(through)) => {
                    // SAFETY: as for dy.
                    let s = unsafe {
                        std::slice::from_raw_parts(slope.ptr.add(r * slope.row_stride), cols)
                    };
                    let out = &mut through[r * cols..(r + 1) * cols];
                    for ((o, &g), &s) in out.iter_mut().zip(g).zip(s) {
                        o.write(g * s);
                    }
                    // SAFETY: written just now.
                    unsafe { std::slice::from_raw_parts(out.as_ptr().cast::<f32>(), cols) }
                }
                _ => g,
            };
            if let Some(db) = db.as_mut() {
                db.iter_mut().zip(row).for_each(|(s, &x)| *s += x);
            }
        }
    }
}

/// The products split by rows against one block, on sizes that split: `y` and `dx` the
/// same to the bit (each row's products are the same), `dW` and `db` the same sums in
/// another order.
#[cfg(test)]
mod split {
    use super::super::testing::random;
    use super::{Matrix, SHARES, Then, backward_in, forward_in};

    /// Seeded `[x, W, dy, b]` of a layer of these sizes.
    fn layer([rows, d_in, d_out]: [usize; 3], seed: u32) -> [Vec<f32>; 4] {
        let lens = [rows * d_in, d_in * d_out, rows * d_out, d_out];
        std::array::from_fn(|i| random(lens[i], seed + i as u32))
    }

    /// `data` as a matrix of rows `cols` long.
    fn m(data: &[f32], cols: usize) -> Matrix {
        Matrix {
            ptr: data.as_ptr(),
            row_stride: cols,
        }
    }

    #[test]
    fn blocks_of_rows_compute_what_one_block_computes() {
        let [rows, d_in, d_out] = [200, 24, 40];
        let sizes = [rows, d_in, d_out];
        let [x, w, dy, bias] = layer(sizes, 1);
        let operands = [m(&x, d_in), m(&w, d_out), m(&dy, d_out)];
        let xw = [m(&x, d_in), m(&w, d_out)];
        let y1 = forward_in(sizes, xw, Some(&bias), Then::Nothing, 1).0;
        let [dx1, dw1, db1] =
            backward_in(sizes, operands, None, [true; 3], [1, SHARES]).map(Option::unwrap);
        // The reference sums of dW and db, in f64.
        let mut dw = vec![0.0f64; d_in * d_out];
        let mut db = vec![0.0f64; d_out];
        for r in 0..rows {
            for o in 0..d_out {
                let g = dy[r * d_out + o] as f64;
                db[o] += g;
                for i in 0..d_in {
                    dw[i * d_out + o] += x[r * d_in + i] as f64 * g;
                }
            }
        }
        for blocks in [2, 3, 7] {
            let y = forward_in(sizes, xw, Some(&bias), Then::Nothing, blocks).0;
            assert_eq!(y, y1, "y in {blocks} blocks");
            let [dx, dwb, dbb] = backward_in(sizes, operands, None, [true; 3], [blocks, SHARES]);
            assert_eq!(dx.unwrap(), dx1, "dx in {blocks} blocks");
            for (got, want) in [(dwb.unwrap(), &dw), (dbb.unwrap(), &db)] {
                for (g, w) in got.iter().zip(want.iter()) {
                    assert!(
                        (*g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()),
                        "{g} against {w}"
                    );
                }
            }
            // Only what is wanted is computed.
            let [dx, dwb, dbb] = backward_in(
                sizes,
                operands,
                None,
                [false, true, false],
                [blocks, SHARES],
            );
            assert!(dx.is_none() && dbb.is_none());
            assert_eq!(dwb.unwrap().len(), d_in * d_out);
        }
        for (got, want) in [(&dw1, &dw), (&db1, &db)] {
            for (g, w) in got.iter().zip(want.iter()) {
                assert!(
                    (*g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()),
                    "{g} against {w}"
                );
            }
        }
    }

    #[test]
    fn gelu_after_the_product_is_gelu_of_the_product_and_its_slope_goes_into_dy() {
        let [rows, d_in, d_out] = [130, 16, 24];
        let sizes = [rows, d_in, d_out];
        let [x, w, dy, bias] = layer(sizes, 5);
        let xw = [m(&x, d_in), m(&w, d_out)];
        let pre = forward_in(sizes, xw, Some(&bias), Then::Nothing, 1).0;
        let isa = super::Isa::best();
        for blocks in [1, 2] {
            let (y, slope) = forward_in(
                sizes,
                xw,
                Some(&bias),
                Then::Gelu { with_slope: true },
                blocks,
            );
            let slope = slope.expect("asked for");
            let (alone, none) = forward_in(
                sizes,
                xw,
                Some(&bias),
                Then::Gelu { with_slope: false },
                blocks,
            );
            assert!(none.is_none());
            assert_eq!(alone, y, "the value does not depend on the slope");
            // The same kernel over the product: the same bits.
            let mut want = pre.clone();
            let mut want_slope = vec![std::mem::MaybeUninit::new(0.0f32); want.len()];
            isa.run(super::Epilogue {
                y: &mut want,
                cols: d_out,
                bias: None,
                gelu: Some(Some(&mut want_slope)),
            });
            assert_eq!(y, want);
            // SAFETY: initialised above.
            let want_slope: Vec<f32> = want_slope
                .iter()
                .map(|s| unsafe { s.assume_init() })
                .collect();
            assert_eq!(slope, want_slope);
            // Backward through the slope: the products of dy ⊙ slope.
            let through: Vec<f32> = dy.iter().zip(&slope).map(|(g, s)| g * s).collect();
            let plain = [m(&x, d_in), m(&w, d_out), m(&through, d_out)];
            let want = backward_in(sizes, plain, None, [true; 3], [blocks, SHARES]);
            let operands = [m(&x, d_in), m(&w, d_out), m(&dy, d_out)];
            let got = backward_in(
                sizes,
                operands,
                Some(m(&slope, d_out)),
                [true; 3],
                [blocks, SHARES],
            );
            assert_eq!(got, want, "in {blocks} blocks");
            // With no room for the blocks' shares, dW by blocks of its own rows after
            // them: the same dx and db, dW the same sums in another order.
            let after = backward_in(
                sizes,
                operands,
                Some(m(&slope, d_out)),
                [true; 3],
                [blocks, 0],
            );
            assert_eq!(
                [&after[0], &after[2]],
                [&want[0], &want[2]],
                "in {blocks} blocks"
            );
            let [Some(got), Some(want)] = [&after[1], &want[1]] else {
                panic!("dW asked for");
            };
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "{g} against {w}");
            }
        }
    }

    /// A layer without outputs or without inputs, with a bias and GELU: empty results,
    /// or zeros, without a panic.
    #[test]
    fn layers_of_no_width_give_empty_or_zero_results() {
        for [rows, d_in, d_out] in [[130, 8, 0], [130, 0, 8], [0, 8, 8]] {
            let sizes = [rows, d_in, d_out];
            let [x, w, dy, bias] = layer(sizes, 9);
            let xw = [m(&x, d_in), m(&w, d_out)];
            for blocks in [1, 2] {
                let (y, slope) = forward_in(
                    sizes,
                    xw,
                    Some(&bias),
                    Then::Gelu { with_slope: true },
                    blocks,
                );
                assert_eq!(y.len(), rows * d_out);
                assert_eq!(slope.map(|s| s.len()), Some(rows * d_out));
                let operands = [m(&x, d_in), m(&w, d_out), m(&dy, d_out)];
                for shares in [SHARES, 0] {
                    let [dx, dw, db] =
                        backward_in(sizes, operands, None, [true; 3], [blocks, shares]);
                    assert_eq!(dx.unwrap(), vec![0.0; rows * d_in], "{sizes:?}");
                    assert_eq!(dw.unwrap(), vec![0.0; d_in * d_out], "{sizes:?}");
                    let db = db.unwrap();
                    assert_eq!(db.len(), d_out);
                    assert!(
                        d_in > 0 || rows == 0 || db.iter().any(|&x| x != 0.0),
                        "{sizes:?}"
                    );
                }
            }
        }
    }
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
