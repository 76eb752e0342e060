//! Attention sinks from each row's log-sum-exp, for the paths whose kernels keep it (the
//! CPU tiles and the GPU kernels): the kernels' loops do not change.
//!
//! A sink is one logit `z` per head that joins every row's softmax as a key without a
//! value. With the row's log-sum-exp `lse` over its keys, the softmax with the sink has
//! the log-sum-exp `lse' = logaddexp(lse, z)`, its weights are the kernels' scaled by
//! `σ = exp(lse - lse')`, and so is the output:
//!
//! ```text
//! out' = σ · out                 lse' = lse + softplus(z - lse)
//! ```
//!
//! The kernels' backward pass run on `out'` and `lse'` is then exact: it recomputes the
//! weights as `exp(S - lse') = σ P` and takes `D = rowsum(dO ⊙ out')`, which is the
//! softmax's backward with the sink's column in it. The sink's own gradient is that
//! column's: its weight is `1 - σ = exp(z - lse')`, so
//!
//! ```text
//! dz[h] = -Σ over batch and rows of rowsum(dO ⊙ out') · (1 - σ)
//! ```
//!
//! A row that sees no key keeps the kernels' dead-row log-sum-exp (`1e30`, far above
//! any sink): its output stays 0, its weights 0, and it adds nothing to `dz`.

use burn::backend::{Backend, TensorMetadata, tensor::FloatTensor};
use burn::tensor::{DType, FloatDType};

/// The output and log-sum-exp with the sinks: `out` `[B, H, Tq, Dv]` (any dtype), `lse`
/// `[B, H, Tq, 1]` (f32) and `sinks` `[1, H, 1, 1]` (any float dtype) give `(out',
/// lse')` of the same shapes and dtypes.
pub(crate) fn apply<B: Backend>(
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    sinks: &FloatTensor<B>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let z = f32_of::<B>(sinks.clone());
    // softplus(x) = max(x, 0) + log1p(exp(-|x|)), finite for x = -inf (no sink) and for
    // a dead row's x = z - 1e30.
    let x = B::float_sub(z, lse.clone());
    let positive = B::float_clamp_min(x.clone(), 0.0f32.into());
    let tail = B::float_log1p(B::float_exp(B::float_neg(B::float_abs(x))));
    let softplus = B::float_add(positive, tail);
    let kept = B::float_exp(B::float_neg(softplus.clone())); // σ
    let lse = B::float_add(lse, softplus);
    let dtype = out.dtype();
    let out = B::float_mul(out, cast::<B>(kept, dtype));
    (out, lse)
}

/// The sinks' gradient, of their shape and dtype, from the output's gradient `grad`, the
/// output with the sinks `out` and its log-sum-exp `lse` (as [`apply`] gave them).
pub(crate) fn grad<B: Backend>(
    grad: FloatTensor<B>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
    sinks: &FloatTensor<B>,
) -> FloatTensor<B> {
    let dtype = sinks.dtype();
    let z = f32_of::<B>(sinks.clone());
    // rowsum(dO ⊙ out'), each factor in f32 first (a scaled f16 gradient times the
    // output may not fit in f16).
    let product = B::float_mul(f32_of::<B>(grad), f32_of::<B>(out));
    let dot = B::float_sum_dim(product, 3); // [B, H, Tq, 1]
    let weight = B::float_exp(B::float_sub(z, lse)); // 1 - σ, [B, H, Tq, 1]
    let per_row = B::float_mul(dot, weight);
    let per_head = B::float_sum_dim(B::float_sum_dim(per_row, 2), 0); // [1, H, 1, 1]
    cast::<B>(B::float_neg(per_head), dtype)
}

fn f32_of<B: Backend>(t: FloatTensor<B>) -> FloatTensor<B> {
    cast::<B>(t, DType::F32)
}

fn cast<B: Backend>(t: FloatTensor<B>, dtype: DType) -> FloatTensor<B> {
    match t.dtype() == dtype {
        true => t,
        false => B::float_cast(t, FloatDType::from(dtype)),
    }
}
