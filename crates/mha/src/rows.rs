//! The row-wise steps of attention around its matmuls: the softmax of the scores, its
//! recomputation from the log-sum-exp, and its backward step.
//!
//! Every backend has them as Burn tensor ops (a pass over the scores per op). On flex they
//! are also written out over the rows: one row of scores (at most a few thousand floats)
//! stays in the cache while it is masked, exponentiated, summed and normalised, the rows
//! are spread over the threads, the causal mask is a per-row length instead of a boolean
//! tensor, and `exp` is a polynomial the compiler vectorises (Burn's flex backend calls the
//! scalar `expf` element by element, a tenth of attention's time in the profile).
//!
//! Shapes: the scores are `[.., c, n]` for `c` query rows over `n` keys. With a causal
//! limit `Some(first)`, query row `i` (`0..c`) sees keys `j <= i + first` only.

use burn::backend::{
    Backend, Scalar, Shape, TensorData, TensorMetadata, get_or_init_device_settings,
    tensor::{BoolTensor, FloatTensor},
};

use crate::attention::{BLOCKED, DEAD_ROW};

/// The log-sum-exp given to rows with no visible key: every weight of the row recomputes
/// to `exp(BLOCKED - DEAD_LSE) = 0` (finite, far from overflow in f32).
pub(crate) const DEAD_LSE: f32 = 1.0e30;

/// The sizes of one attention call and its causal flag and scale.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dims {
    pub(crate) batch: usize,
    pub(crate) heads: usize,
    /// Key and value heads, a divisor of `heads`: query head `h` reads `h / (heads /
    /// kv_heads)`.
    pub(crate) kv_heads: usize,
    pub(crate) queries: usize,
    pub(crate) keys: usize,
    pub(crate) d_k: usize,
    pub(crate) d_v: usize,
    pub(crate) causal: bool,
    pub(crate) scale: f32,
}

impl Dims {
    /// How many keys (`0..n`) query `q` sees.
    pub(crate) fn row_len(&self, q: usize) -> usize {
        match self.causal {
            true => (q as i64 + self.keys as i64 - self.queries as i64 + 1)
                .clamp(0, self.keys as i64) as usize,
            false => self.keys,
        }
    }

    /// Query heads per key/value head.
    pub(crate) fn group(&self) -> usize {
        self.heads / self.kv_heads.max(1)
    }

    /// The first query that sees key `k`.
    pub(crate) fn first_query(&self, k: usize) -> usize {
        match self.causal {
            true => (k as i64 - (self.keys as i64 - self.queries as i64))
                .clamp(0, self.queries as i64) as usize,
            false => 0,
        }
    }
}

/// The gradients of the query, key, value and (when asked for) bias.
pub(crate) type TiledGrads<B> = (
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
);

/// The row-wise steps of attention; the provided bodies are Burn tensor ops. A backend
/// may also run the whole forward or backward pass in tiles ([`crate::tiled`], on flex and
/// ndarray); the provided `tiled_*` bodies have none and return `None`.
pub(crate) trait RowKernels: Backend {
    /// The output `[B, H, Tq, Dv]` and log-sum-exp `[B, H, Tq, 1]` of attention over
    /// `query` `[B, H, Tq, Dk]`, `key` `[B, Hkv, Tk, Dk]` and `value` `[B, Hkv, Tk, Dv]` under
    /// the causal limit of `dims`, the boolean mask `blocked` and the additive `bias`
    /// (clamped at [`BLOCKED`]), or `None` where the backend has no tiled kernel for them.
    fn tiled_forward(
        _dims: Dims,
        _qkv: [&FloatTensor<Self>; 3],
        _blocked: Option<&BoolTensor<Self>>,
        _bias: Option<&FloatTensor<Self>>,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        None
    }

    /// The gradients of the query, key and value of [`RowKernels::tiled_forward`] from
    /// its `output`, `lse` and the output's gradient `grad`, and the bias's (in its own
    /// shape, summed over the axes it broadcasts along) when `bias_grad`; or `None`.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn tiled_backward(
        _dims: Dims,
        _qkv: [&FloatTensor<Self>; 3],
        _output: &FloatTensor<Self>,
        _lse: &FloatTensor<Self>,
        _grad: &FloatTensor<Self>,
        _blocked: Option<&BoolTensor<Self>>,
        _bias: Option<&FloatTensor<Self>>,
        _bias_grad: bool,
    ) -> Option<TiledGrads<Self>> {
        None
    }

    /// The softmax of every row of `scores` and its log-sum-exp: `(weights [.., c, n],
    /// lse [.., c, 1])`. Keys beyond the causal limit have weight 0; a row without a
    /// visible key (or whose every score is blocked) has zero weights and lse
    /// [`DEAD_LSE`].
    fn softmax_rows(
        scores: FloatTensor<Self>,
        causal: Option<i64>,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        softmax_rows_ops::<Self>(scores, causal)
    }

    /// The weights again from the scores and the log-sum-exp: `exp(scores - lse)`, 0
    /// beyond the causal limit.
    fn recompute_rows(
        scores: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        causal: Option<i64>,
    ) -> FloatTensor<Self> {
        recompute_rows_ops::<Self>(scores, lse, causal)
    }

    /// The softmax's backward step: `weights ⊙ (d_weights - row_dot)`, with `row_dot =
    /// rowsum(dO ⊙ O)` (`[.., c, 1]`).
    fn softmax_backward_rows(
        weights: FloatTensor<Self>,
        d_weights: FloatTensor<Self>,
        row_dot: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        softmax_backward_rows_ops::<Self>(weights, d_weights, row_dot)
    }
}

/// ndarray: the tiles of [`crate::tiled`], reading its arrays where they lie (the
/// row-wise steps stay Burn's ops, for the chunked path).
#[cfg(feature = "ndarray")]
#[allow(deprecated)] // Burn 0.22 deprecates ndarray; it is still one of our backends.
impl RowKernels for burn::backend::NdArray {
    fn tiled_forward(
        dims: Dims,
        qkv: [&FloatTensor<Self>; 3],
        blocked: Option<&BoolTensor<Self>>,
        bias: Option<&FloatTensor<Self>>,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        crate::tiled::ndarray_forward(dims, qkv, blocked, bias)
    }

    fn tiled_backward(
        dims: Dims,
        qkv: [&FloatTensor<Self>; 3],
        output: &FloatTensor<Self>,
        lse: &FloatTensor<Self>,
        grad: &FloatTensor<Self>,
        blocked: Option<&BoolTensor<Self>>,
        bias: Option<&FloatTensor<Self>>,
        bias_grad: bool,
    ) -> Option<TiledGrads<Self>> {
        crate::tiled::ndarray_backward(dims, qkv, output, lse, grad, blocked, bias, bias_grad)
    }
}

/// `[.., c, n]` as `(c, n)`.
fn rows_and_cols(shape: &Shape) -> (usize, usize) {
    let dims: Vec<usize> = shape.iter().copied().collect();
    let rank = dims.len();
    (dims[rank - 2], dims[rank - 1])
}

/// Blocks the keys beyond the causal limit with [`BLOCKED`].
fn mask_causal<B: Backend>(scores: FloatTensor<B>, causal: Option<i64>) -> FloatTensor<B> {
    let Some(first) = causal else {
        return scores;
    };
    let (c, n) = rows_and_cols(&scores.shape());
    if first >= n as i64 - 1 {
        return scores; // Row 0, and so every row, sees every key.
    }
    let blocked: Vec<bool> = (0..c as i64)
        .flat_map(|i| (0..n as i64).map(move |j| j > i + first))
        .collect();
    let rank = scores.shape().num_dims();
    let mut dims = vec![1; rank];
    dims[rank - 2] = c;
    dims[rank - 1] = n;
    let mask = B::bool_from_data(TensorData::new(blocked, dims), &scores.device());
    B::float_mask_fill(scores, mask, Scalar::from(BLOCKED))
}

/// [`RowKernels::recompute_rows`] as Burn tensor ops.
fn recompute_rows_ops<B: Backend>(
    scores: FloatTensor<B>,
    lse: FloatTensor<B>,
    causal: Option<i64>,
) -> FloatTensor<B> {
    let scores = mask_causal::<B>(scores, causal);
    B::float_exp(B::float_sub(scores, lse))
}

/// [`RowKernels::softmax_backward_rows`] as Burn tensor ops.
fn softmax_backward_rows_ops<B: Backend>(
    weights: FloatTensor<B>,
    d_weights: FloatTensor<B>,
    row_dot: FloatTensor<B>,
) -> FloatTensor<B> {
    B::float_mul(weights, B::float_sub(d_weights, row_dot))
}

/// [`RowKernels::softmax_rows`] as Burn tensor ops.
fn softmax_rows_ops<B: Backend>(
    scores: FloatTensor<B>,
    causal: Option<i64>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let device = scores.device();
    let rank = scores.shape().num_dims();
    let scores = mask_causal::<B>(scores, causal);
    let max = B::float_max_dim(scores.clone(), rank - 1);
    let weights = B::float_exp(B::float_sub(scores, max.clone()));
    let sum = B::float_sum_dim(weights.clone(), rank - 1);
    let weights = B::float_div(weights, sum.clone());
    let lse = B::float_add(max.clone(), B::float_log(sum));
    let bool_dtype = get_or_init_device_settings::<B>(&device).bool_dtype;
    let dead = B::float_lower_equal_elem(max, Scalar::from(DEAD_ROW), bool_dtype);
    let weights = B::float_mask_fill(weights, dead.clone(), Scalar::from(0.0f32));
    let lse = B::float_mask_fill(lse, dead, Scalar::from(DEAD_LSE));
    (weights, lse)
}

/// `e^x` to within 2 ulp in `[-87.3, 88.7]`, 0 below (Cephes' `expf`: `x = n ln 2 +
/// r`, a degree-6 polynomial for `e^r`, `2^n` through the exponent bits); branch-free
/// so that loops over it vectorise.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    exp_with::<false>(x)
}

/// [`exp`] with its multiply-adds fused, for code compiled with FMA (elsewhere `mul_add`
/// is a library call).
#[inline(always)]
pub(crate) fn exp_fma(x: f32) -> f32 {
    exp_with::<true>(x)
}

#[inline(always)]
fn exp_with<const FMA: bool>(x: f32) -> f32 {
    let madd = |a: f32, b: f32, c: f32| if FMA { a.mul_add(b, c) } else { a * b + c };
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer.
    let clamped = x.clamp(-87.3, 88.7);
    let shifted = madd(clamped, LOG2E, ROUND);
    let n = shifted - ROUND;
    let bits = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = madd(-n, LN2_LO, madd(-n, LN2_HI, clamped));
    let p = 1.987_569_1e-4;
    let p = madd(p, r, 1.398_199_9e-3);
    let p = madd(p, r, 8.333_452e-3);
    let p = madd(p, r, 4.166_579_6e-2);
    let p = madd(p, r, 1.666_666_5e-1);
    let p = madd(p, r, 0.5);
    let y = madd(p, r * r, r + 1.0);
    let scale = f32::from_bits(((bits + 127) << 23) as u32);
    if x < -87.3 { 0.0 } else { y * scale }
}

#[cfg(feature = "flex")]
mod flex {
    use burn::backend::{
        DType, Shape, TensorData, TensorMetadata,
        flex::{Flex, FlexTensor},
        tensor::FloatTensor,
    };
    use rayon::prelude::*;

    use super::{
        DEAD_LSE, Dims, RowKernels, TiledGrads, exp, exp_fma, recompute_rows_ops, rows_and_cols,
        softmax_backward_rows_ops, softmax_rows_ops,
    };
    use crate::attention::DEAD_ROW;

    /// Rows per task: enough work per task to amortise the scheduling.
    const MIN_ROWS: usize = 8;

    /// The tensor's floats, contiguous and owned by it alone (copied when they are not).
    fn owned(tensor: FlexTensor) -> FlexTensor {
        let layout = tensor.layout();
        let dense = layout.is_contiguous()
            && layout.start_offset() == 0
            && tensor.bytes().len() == layout.num_elements() * 4;
        if dense {
            tensor
        } else {
            tensor.to_contiguous()
        }
    }

    /// The floats of a small tensor, in row-major order.
    fn values(tensor: &FlexTensor) -> Vec<f32> {
        tensor
            .clone()
            .into_data()
            .try_into_vec::<f32>()
            .expect("an f32 tensor")
    }

    /// Row `r` of `c` query rows: how many of the `n` keys it sees.
    fn visible(r: usize, c: usize, n: usize, causal: Option<i64>) -> usize {
        match causal {
            Some(first) => ((r % c) as i64 + first + 1).clamp(0, n as i64) as usize,
            None => n,
        }
    }

    impl RowKernels for Flex {
        fn tiled_forward(
            dims: Dims,
            qkv: [&FlexTensor; 3],
            blocked: Option<&FlexTensor>,
            bias: Option<&FlexTensor>,
        ) -> Option<(FlexTensor, FlexTensor)> {
            crate::tiled::flex_forward(dims, qkv, blocked, bias)
        }

        fn tiled_backward(
            dims: Dims,
            qkv: [&FlexTensor; 3],
            output: &FlexTensor,
            lse: &FlexTensor,
            grad: &FlexTensor,
            blocked: Option<&FlexTensor>,
            bias: Option<&FlexTensor>,
            bias_grad: bool,
        ) -> Option<TiledGrads<Self>> {
            crate::tiled::flex_backward(dims, qkv, output, lse, grad, blocked, bias, bias_grad)
        }

        fn softmax_rows(
            scores: FloatTensor<Self>,
            causal: Option<i64>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>) {
            if scores.dtype() != DType::F32 {
                return softmax_rows_ops::<Self>(scores, causal);
            }
            let shape = scores.shape();
            let (c, n) = rows_and_cols(&shape);
            let mut scores = owned(scores);
            let data = scores.storage_mut::<f32>();
            let mut lse = vec![0.0f32; data.len() / n.max(1)];
            data.par_chunks_mut(n.max(1))
                .zip(lse.par_iter_mut())
                .enumerate()
                .with_min_len(MIN_ROWS)
                .for_each(|(r, (row, lse))| {
                    *lse = softmax_row(row, visible(r, c, n, causal));
                });
            (scores, column(lse, &shape))
        }

        fn recompute_rows(
            scores: FloatTensor<Self>,
            lse: FloatTensor<Self>,
            causal: Option<i64>,
        ) -> FloatTensor<Self> {
            if scores.dtype() != DType::F32 {
                return recompute_rows_ops::<Self>(scores, lse, causal);
            }
            let (c, n) = rows_and_cols(&scores.shape());
            let lse = values(&lse);
            let mut scores = owned(scores);
            scores
                .storage_mut::<f32>()
                .par_chunks_mut(n.max(1))
                .zip(lse.par_iter())
                .enumerate()
                .with_min_len(MIN_ROWS)
                .for_each(|(r, (row, &lse))| {
                    let (live, dead) = row.split_at_mut(visible(r, c, n, causal));
                    dead.fill(0.0);
                    exp_shifted(live, lse);
                });
            scores
        }

        fn softmax_backward_rows(
            weights: FloatTensor<Self>,
            d_weights: FloatTensor<Self>,
            row_dot: FloatTensor<Self>,
        ) -> FloatTensor<Self> {
            if weights.dtype() != DType::F32 || d_weights.dtype() != DType::F32 {
                return softmax_backward_rows_ops::<Self>(weights, d_weights, row_dot);
            }
            let (_, n) = rows_and_cols(&weights.shape());
            let row_dot = values(&row_dot);
            let weights = owned(weights);
            let mut d_weights = owned(d_weights);
            d_weights
                .storage_mut::<f32>()
                .par_chunks_mut(n.max(1))
                .zip(weights.storage::<f32>().par_chunks(n.max(1)))
                .zip(row_dot.par_iter())
                .with_min_len(MIN_ROWS)
                .for_each(|((d, p), &dot)| {
                    for (d, &p) in d.iter_mut().zip(p) {
                        *d = p * (*d - dot);
                    }
                });
            d_weights
        }
    }

    /// `[.., c, n]`'s log-sum-exp column `[.., c, 1]` from its values.
    fn column(values: Vec<f32>, shape: &Shape) -> FlexTensor {
        let mut dims: Vec<usize> = shape.iter().copied().collect();
        let rank = dims.len();
        dims[rank - 1] = 1;
        FlexTensor::from_data(TensorData::new(values, dims))
    }

    /// The softmax of the first `len` entries of `row` in place (the rest set to 0);
    /// returns the log-sum-exp, or [`DEAD_LSE`] (weights all 0) when no entry is open.
    fn softmax_row(row: &mut [f32], len: usize) -> f32 {
        let (live, dead) = row.split_at_mut(len);
        dead.fill(0.0);
        let max = max_of(live);
        if len == 0 || max <= DEAD_ROW {
            live.fill(0.0);
            return DEAD_LSE;
        }
        exp_shifted(live, max);
        let sum = sum_of(live);
        let inv = 1.0 / sum;
        for x in live.iter_mut() {
            *x *= inv;
        }
        max + sum.ln()
    }

    fn max_of(x: &[f32]) -> f32 {
        let mut acc = [f32::NEG_INFINITY; 8];
        let mut chunks = x.chunks_exact(8);
        for chunk in &mut chunks {
            for (a, &v) in acc.iter_mut().zip(chunk) {
                *a = if v > *a { v } else { *a };
            }
        }
        let tail = chunks.remainder().iter().copied();
        acc.into_iter()
            .chain(tail)
            .fold(f32::NEG_INFINITY, |a, v| if v > a { v } else { a })
    }

    fn sum_of(x: &[f32]) -> f32 {
        let mut acc = [0.0f32; 8];
        let mut chunks = x.chunks_exact(8);
        for chunk in &mut chunks {
            for (a, &v) in acc.iter_mut().zip(chunk) {
                *a += v;
            }
        }
        acc.into_iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>()
    }

    /// `x = exp(x - shift)` elementwise, vectorised (AVX2 and FMA where the CPU has them).
    fn exp_shifted(x: &mut [f32], shift: f32) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has the features the function is compiled for.
            unsafe { exp_shifted_avx2(x, shift) };
            return;
        }
        exp_shifted_portable(x, shift);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn exp_shifted_avx2(x: &mut [f32], shift: f32) {
        for v in x.iter_mut() {
            *v = exp_fma(*v - shift);
        }
    }

    #[inline(always)]
    fn exp_shifted_portable(x: &mut [f32], shift: f32) {
        for v in x.iter_mut() {
            *v = exp(*v - shift);
        }
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn exp_is_within_two_ulp_of_std() {
            let mut worst = 0.0f64;
            let mut x = -87.0f32;
            while x < 88.0 {
                let want = (x as f64).exp();
                for got in [super::super::exp(x), super::super::exp_fma(x)] {
                    worst = worst.max(((got as f64 - want) / want).abs());
                }
                x += 0.001_3;
            }
            assert!(worst < 2.5e-7, "relative error {worst}");
            assert_eq!(super::super::exp(-1.0e30), 0.0);
            assert_eq!(super::super::exp(-100.0), 0.0);
            assert_eq!(super::super::exp(0.0), 1.0);
            for exp in [super::super::exp, super::super::exp_fma] {
                assert_eq!(exp(f32::NEG_INFINITY), 0.0);
                assert_eq!(exp(-1.0e30), 0.0);
            }
        }
    }
}
