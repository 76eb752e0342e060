//! The row-wise steps of attention around its matmuls: the softmax of the scores, its
//! recomputation from the log-sum-exp, and its backward step.
//!
//! They are Burn tensor ops (a pass over the scores per op), for the chunked path that
//! takes what the tiles do not (dtypes other than f32, a boolean mask not stored as
//! bytes). flex and ndarray hook their tiles ([`crate::tiled`]) in here, and the tiles'
//! `exp` lives here: a polynomial the compiler vectorises (Burn's flex backend calls the
//! scalar `expf` element by element, a tenth of attention's time in an earlier profile).
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

/// flex: the tiles of [`crate::tiled`], reading its tensors through their strides (the
/// row-wise steps stay Burn's ops, for the chunked path).
#[cfg(feature = "flex")]
impl RowKernels for burn::backend::Flex {
    fn tiled_forward(
        dims: Dims,
        qkv: [&FloatTensor<Self>; 3],
        blocked: Option<&BoolTensor<Self>>,
        bias: Option<&FloatTensor<Self>>,
    ) -> Option<(FloatTensor<Self>, FloatTensor<Self>)> {
        crate::tiled::flex_forward(dims, qkv, blocked, bias)
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
        crate::tiled::flex_backward(dims, qkv, output, lse, grad, blocked, bias, bias_grad)
    }
}

#[cfg(test)]
mod tests {
    use super::{exp, exp_fma};

    #[test]
    fn exp_is_within_two_ulp_of_std() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            for got in [exp(x), exp_fma(x)] {
                worst = worst.max(((got as f64 - want) / want).abs());
            }
            x += 0.001_3;
        }
        assert!(worst < 2.5e-7, "relative error {worst}");
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(0.0), 1.0);
        for exp in [exp, exp_fma] {
            assert_eq!(exp(f32::NEG_INFINITY), 0.0);
            assert_eq!(exp(-1.0e30), 0.0);
        }
    }
}
