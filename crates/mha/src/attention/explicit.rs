//! The explicit path: matmul, mask, softmax, matmul, as Burn tensor ops that every
//! backend runs and autodiff differentiates; the weights come from here when they are
//! asked for, and dropout acts here. Long calls run in query chunks (see
//! [`crate::dispatch::AttentionPath::Explicit`]).

use std::ops::Range;

use burn::tensor::{DType, Tensor, activation::softmax};

use super::SdpaOptions;
use crate::mask::{AttentionMask, blocked_score};
use crate::problem::Scores;

/// The attention weights `softmax(cap(Q Kᵀ · scale) + bias, masked)`, `[B, H, Tq, Tk]`,
/// with the scale (default `1 / sqrt(Dk)`) and soft cap of `options`; rows with every key
/// blocked are all zero.
///
/// # Shapes
/// - `query`: `[B, H, Tq, Dk]`, `key`: `[B, Hkv, Tk, Dk]` with `H % Hkv == 0`.
/// - `mask`: broadcastable to `[B, H, Tq, Tk]`; the weights are `[B, H, Tq, Tk]` (empty
///   when one of these is 0).
///
/// # Panics
/// As [`scaled_dot_product_attention`](super::scaled_dot_product_attention): if the
/// shapes disagree, if the mask does not broadcast to the scores, if the dropout is
/// outside `[0, 1)` (it is checked, though weights are computed without it), if the scale
/// or the soft cap is not positive and finite, or if the key or a part of the mask is on
/// another device than the query.
pub fn attention_weights(
    query: Tensor<4>,
    key: Tensor<4>,
    mask: &AttentionMask,
    options: SdpaOptions,
) -> Tensor<4> {
    let [batch, heads, queries, d_k] = query.dims();
    let keys = key.dims()[2];
    super::check_shapes("attention_weights", query.dims(), key.dims(), None);
    let device = query.device();
    super::check_devices("attention_weights", &device, &[("key", &key)]);
    let scores = super::checked_scores(&options, mask, [batch, heads, queries, keys], d_k, &device);
    if batch * heads * queries * keys == 0 {
        let (device, dtype) = (query.device(), query.dtype());
        let links = [query, key].into_iter().map(crate::empty::zero_of);
        return crate::empty::zeros([batch, heads, queries, keys], &device, dtype, links);
    }
    weights(query, key, mask, scores)
}

/// [`attention_weights`] with the scale resolved.
pub(super) fn weights(
    query: Tensor<4>,
    key: Tensor<4>,
    mask: &AttentionMask,
    scores: Scores,
) -> Tensor<4> {
    let queries = query.dims()[2];
    let [_, kv_heads, keys, _] = key.dims();
    let device = query.device();
    let query_dtype = query.dtype();
    let blocked_score = blocked_score(query_dtype);
    // [B, Hkv, g·Tq, Dk] x [B, Hkv, Dk, Tk]: GQA without copying K. The scale goes on
    // the queries, `Dk` times fewer values than the scores (forward and backward).
    let s = grouped_matmul(query * scores.scale, transposed(key), kv_heads); // [B, H, Tq, Tk]
    let s = match scores.softcap {
        // A product by the reciprocal: Burn's backward of a division by a scalar takes
        // the reciprocal in f32, which an f64 gradient shows.
        Some(cap) => (s * (1.0 / cap)).tanh() * cap,
        None => s,
    };
    // In the queries' dtype, cast once (the blocked rows below read it too).
    let bias = mask
        .additive_bias()
        .map(|bias| bias.clone().cast(query_dtype));
    let s = match &bias {
        Some(bias) => s + bias.clone().clamp_min(blocked_score),
        None => s,
    };
    let s = match mask.position() {
        Some(position) => {
            let offset = mask.visibility(queries, keys).offset;
            let bias = position.tensor(0..queries, 0..keys, offset, &device, query_dtype);
            s + bias.cast(query_dtype)
        }
        None => s,
    };
    let blocked = mask.to_blocked(queries, keys, &device);
    let s = match &blocked {
        Some(blocked) => s.mask_fill(blocked.clone(), blocked_score),
        None => s,
    };
    // A row whose every key is blocked has no visible key, and gives zeros, as on the
    // tiles and the GPU kernels: blocked by the boolean parts or the rule, or by a bias
    // at or below what blocks a row there (`DEAD_ROW`, -5e29, for scores computed in f32
    // or wider; -2^14, the blocked score, in f16) or below its own dtype's blocked score
    // (an f16 mask's -2^14 or `finfo.min` blocks f32 queries too). Told from the masks,
    // not from the scores: in f16 a real row's best score may lie as low as that.
    // (A mask without a boolean part or a bias closes a row only where its rule leaves
    // the row no key: told on the host, no tensor made otherwise.)
    let may_close = blocked.is_some() && mask.has_boolean_part()
        || bias.is_some()
        || mask.rule_empties_a_row(queries, keys);
    let closed = match (blocked, mask.blocking_bias(query_dtype)) {
        _ if !may_close => None,
        (Some(a), Some(b)) => Some(a.bool_or(b)),
        (Some(closed), None) | (None, Some(closed)) => Some(closed),
        (None, None) => None,
    };
    let dims = s.dims();
    let dead = closed.map(|closed| closed.bool_not().any_dim(3).bool_not().expand(dims));
    // In f16 such rows' scores are made 0 before the softmax, so that its values and
    // gradients are finite whatever the scores were (a blocked row of very low scores
    // overflows to -inf in every column, whose softmax is NaN); wider dtypes hold the
    // blocked score and the scores' sum.
    let s = match (&dead, query_dtype) {
        (Some(dead), DType::F16) => s.mask_fill(dead.clone(), 0.0),
        _ => s,
    };
    let weights = match mask.sink_logits() {
        // The sinks join the softmax as one more column, dropped after it.
        Some(sinks) => {
            let [batch, heads, queries, keys] = s.dims();
            let sinks = sinks
                .clone()
                .cast(query_dtype)
                .reshape([1, heads, 1, 1])
                .expand([batch, heads, queries, 1]);
            let with_sinks = softmax(Tensor::cat(vec![s.clone(), sinks], 3), 3);
            with_sinks.slice([0..batch, 0..heads, 0..queries, 0..keys])
        }
        None => softmax(s.clone(), 3),
    };
    match dead {
        Some(dead) => weights.mask_fill(dead, 0.0),
        None => weights,
    }
}

/// The context `[B, H, Tq, Dv]` and the weights `[B, H, Tq, Tk]` that make it: after
/// dropout of probability `dropout`, as PyTorch's `nn.MultiheadAttention`, Burn's module
/// and `transformers` return them.
pub(super) fn with_weights(
    [query, key, value]: [Tensor<4>; 3],
    mask: &AttentionMask,
    scores: Scores,
    dropout: f64,
) -> (Tensor<4>, Tensor<4>) {
    let kv_heads = key.dims()[1];
    let weights = weights(query, key, mask, scores); // [B, H, Tq, Tk]
    let weights = match dropout > 0.0 {
        true => crate::dropout::apply(weights, dropout),
        false => weights,
    };
    (grouped_matmul(weights.clone(), value, kv_heads), weights)
}

/// The context alone, `[B, H, Tq, Dv]`, in query chunks of `chunk` rows. A chunk reads
/// only the keys its rows can see (causal: the blocked upper triangle is never computed,
/// about half the work and memory at long lengths; a window: only the band), forward and,
/// under autodiff, backward; what blocks by position within the chunk becomes its boolean
/// mask.
pub(super) fn context(
    [query, key, value]: [Tensor<4>; 3],
    mask: &AttentionMask,
    scores: Scores,
    chunk: usize,
) -> Tensor<4> {
    let [batch, heads, queries, d_k] = query.dims();
    let [_, kv_heads, keys, d_v] = value.dims();
    if chunk >= queries {
        return with_weights([query, key, value], mask, scores, 0.0).0;
    }
    let visibility = mask.visibility(queries, keys);
    let rows_of_batch = mask.rule().packed.as_ref().map_or(1, |p| p.len());
    let device = query.device();
    let parts = (0..queries).step_by(chunk).map(|start| {
        let rows = start..(start + chunk).min(queries);
        let seen: Range<usize> = (0..rows_of_batch)
            .map(|b| visibility.keys_of_rows(b, rows.clone()))
            .filter(|r| !r.is_empty())
            .reduce(|a, b| a.start.min(b.start)..a.end.max(b.end))
            .unwrap_or(0..0);
        if seen.is_empty() {
            // No query of the chunk sees a key: zeros.
            let zeros = Tensor::<4>::zeros([batch, heads, rows.len(), d_v], &device);
            return zeros.cast(query.dtype());
        }
        let q = query
            .clone()
            .slice([0..batch, 0..heads, rows.clone(), 0..d_k]);
        let k = key
            .clone()
            .slice([0..batch, 0..kv_heads, seen.clone(), 0..d_k]);
        let v = value
            .clone()
            .slice([0..batch, 0..kv_heads, seen.clone(), 0..d_v]);
        let sub = mask.sub(rows, seen, [queries, keys], &device, query.dtype());
        with_weights([q, k, v], &sub, scores, 0.0).0
    });
    Tensor::cat(parts.collect(), 2)
}

/// `key` `[B, Hkv, Tk, Dk]` as `Kᵀ` `[B, Hkv, Dk, Tk]`, its gradient handed back laid out
/// contiguously. Burn's backward of a transpose hands `dK` back as a transposed view, and
/// Burn's wgpu reduction over an outer axis of such a view reads the wrong elements (the
/// vector width it picks assumes the view's fastest axis is the output's): a key broadcast
/// over the batch (`expand`), whose backward sums `dK` over the batch, got a gradient off
/// by more than its size. Through a reshape merging its last two axes, which a transposed
/// view cannot make without a copy, `dK` comes back as a contiguous copy (`Tk · Dk` values
/// a head: the scores are `Tq` times more).
fn transposed(key: Tensor<4>) -> Tensor<4> {
    let [batch, heads, keys, d_k] = key.dims();
    if keys * d_k == 0 {
        // Nothing to misread; and Burn's reshape reads a 0 as "this axis as it is".
        return key.transpose();
    }
    key.reshape([batch, heads, keys * d_k])
        .reshape([batch, heads, keys, d_k])
        .transpose()
}

/// `a @ b` where `a` has `H` heads and `b` has `Hkv`, query head `h` pairing with
/// `b` head `h / (H / Hkv)`: folds the group into the row axis instead of copying `b`.
///
/// # Shapes
/// - `a`: `[B, H, M, K]`, `b`: `[B, Hkv, K, N]`, result `[B, H, M, N]`.
fn grouped_matmul(a: Tensor<4>, b: Tensor<4>, kv_heads: usize) -> Tensor<4> {
    let [batch, heads, rows, inner] = a.dims();
    let cols = b.dims()[3];
    if inner == 0 {
        // A sum of nothing (queries and keys without features), which some backends'
        // products divide by: zeros, each factor's gradient 0.
        let (device, dtype) = (a.device(), a.dtype());
        let links = [a, b].map(crate::empty::zero_of);
        return crate::empty::zeros([batch, heads, rows, cols], &device, dtype, links);
    }
    if heads == kv_heads {
        return a.matmul(b);
    }
    let group = heads / kv_heads;
    a.reshape([batch, kv_heads, group * rows, inner])
        .matmul(b)
        .reshape([batch, heads, rows, cols])
}
