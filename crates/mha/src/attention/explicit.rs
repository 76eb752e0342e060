//! The explicit path: matmul, mask, softmax, matmul, as Burn tensor ops that every
//! backend runs and autodiff differentiates; the weights come from here when they are
//! asked for, and dropout acts here. Long calls run in query chunks (see
//! [`super::dispatch::Path::Explicit`]).

use burn::tensor::{Distribution, Tensor, activation::softmax};

use crate::mask::{AttentionMask, Sentinels};

/// The attention weights `softmax(Q Kᵀ · scale + bias, masked)`, `[B, H, Tq, Tk]`; rows
/// with every key blocked are all zero.
///
/// # Shapes
/// - `query`: `[B, H, Tq, Dk]`, `key`: `[B, Hkv, Tk, Dk]` with `H % Hkv == 0`.
pub fn attention_weights(
    query: Tensor<4>,
    key: Tensor<4>,
    mask: &AttentionMask,
    scale: f64,
) -> Tensor<4> {
    let queries = query.dims()[2];
    let [_, kv_heads, keys, _] = key.dims();
    let device = query.device();
    let sentinels = Sentinels::of(query.dtype());
    // [B, Hkv, g·Tq, Dk] x [B, Hkv, Dk, Tk]: GQA without copying K. The scale goes on
    // the queries, `Dk` times fewer values than the scores (forward and backward).
    let scores = grouped_matmul(query * scale, key.transpose(), kv_heads); // [B, H, Tq, Tk]
    let scores = match mask.additive_bias() {
        Some(bias) => scores + bias.clone().clamp_min(sentinels.blocked),
        None => scores,
    };
    let scores = match mask.to_blocked(queries, keys, &device) {
        Some(blocked) => scores.mask_fill(blocked, sentinels.blocked),
        None => scores,
    };
    let weights = softmax(scores.clone(), 3);
    if !may_block_rows(mask, queries, keys) {
        return weights;
    }
    // A row whose best score is a blocked one has no visible key: zero it.
    let open = scores.max_dim(3).greater_elem(sentinels.dead_row); // [B, H, Tq, 1]
    let dtype = weights.dtype();
    weights * open.float().cast(dtype)
}

/// The context `[B, H, Tq, Dv]` and the weights `[B, H, Tq, Tk]` (before dropout), with
/// dropout of probability `dropout` on the weights that make the context.
pub(super) fn with_weights(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    mask: &AttentionMask,
    scale: f64,
    dropout: f64,
) -> (Tensor<4>, Tensor<4>) {
    let kv_heads = key.dims()[1];
    let weights = attention_weights(query, key, mask, scale); // [B, H, Tq, Tk]
    let dropped = match dropout > 0.0 {
        true => {
            let keep = 1.0 - dropout;
            weights.clone() * weights.random_like(Distribution::Bernoulli(keep)) / keep
        }
        false => weights.clone(),
    };
    (grouped_matmul(dropped, value, kv_heads), weights)
}

/// The context alone, `[B, H, Tq, Dv]`, in query chunks of `chunk` rows. A causal chunk
/// reads only the keys its last row can see, which skips the blocked upper triangle
/// (about half the score work and memory at long lengths), forward and, under autodiff,
/// backward; the bottom-right causal alignment of that sub-problem is the original one, so
/// each chunk is plain masked attention with its slice of the boolean and additive parts.
pub(super) fn context(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    mask: &AttentionMask,
    scale: f64,
    chunk: usize,
) -> Tensor<4> {
    let [batch, heads, queries, d_k] = query.dims();
    let [_, kv_heads, keys, d_v] = value.dims();
    if chunk >= queries {
        return with_weights(query, key, value, mask, scale, 0.0).0;
    }
    let visibility = mask.visibility(queries, keys);
    let device = query.device();
    let parts = (0..queries).step_by(chunk).map(|start| {
        let end = (start + chunk).min(queries);
        let visible = visibility.keys_of(end - 1);
        if visible == 0 {
            // Every key is in these queries' future: no visible key, zeros.
            let zeros = Tensor::<4>::zeros([batch, heads, end - start, d_v], &device);
            return zeros.cast(query.dtype());
        }
        let q = query
            .clone()
            .slice([0..batch, 0..heads, start..end, 0..d_k]);
        let k = key
            .clone()
            .slice([0..batch, 0..kv_heads, 0..visible, 0..d_k]);
        let v = value
            .clone()
            .slice([0..batch, 0..kv_heads, 0..visible, 0..d_v]);
        let sub = mask.rows_and_keys(start..end, visible, [queries, keys]);
        with_weights(q, k, v, &sub, scale, 0.0).0
    });
    Tensor::cat(parts.collect(), 2)
}

/// Whether some query row may have every key blocked.
fn may_block_rows(mask: &AttentionMask, queries: usize, keys: usize) -> bool {
    mask.blocked().is_some()
        || mask.additive_bias().is_some()
        || mask.visibility(queries, keys).keys_of(0) == 0
}

/// `a @ b` where `a` has `H` heads and `b` has `Hkv`, query head `h` pairing with
/// `b` head `h / (H / Hkv)`: folds the group into the row axis instead of copying `b`.
///
/// # Shapes
/// - `a`: `[B, H, M, K]`, `b`: `[B, Hkv, K, N]`, result `[B, H, M, N]`.
fn grouped_matmul(a: Tensor<4>, b: Tensor<4>, kv_heads: usize) -> Tensor<4> {
    let [batch, heads, rows, inner] = a.dims();
    if heads == kv_heads {
        return a.matmul(b);
    }
    let group = heads / kv_heads;
    let cols = b.dims()[3];
    a.reshape([batch, kv_heads, group * rows, inner])
        .matmul(b)
        .reshape([batch, heads, rows, cols])
}
