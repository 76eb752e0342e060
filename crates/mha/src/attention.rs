//! Scaled dot-product attention: `softmax(Q Kᵀ · scale + bias, masked) V`.
//!
//! One function, two paths with the same numbers:
//! - **fused**: when no weights are asked for and dropout is off, the work goes to Burn's
//!   `burn::tensor::module::attention`, so flex and the CubeCL backends (wgpu, cuda) run
//!   their flash kernels and never hold the `[Tq, Tk]` scores of all heads at once;
//! - **explicit**: matmul, mask, softmax, dropout, matmul, when the weights are wanted or
//!   dropout is on (the fused op has neither).
//!
//! Grouped-query attention (GQA/MQA) takes keys and values with fewer heads than queries:
//! query head `h` reads key/value head `h / (H / Hkv)`, PyTorch's `enable_gqa=True`.

use burn::tensor::{
    Device, Distribution, Tensor, module::attention as fused_attention, ops::AttentionModuleOptions,
};

use crate::mask::AttentionMask;

/// Scores at or below this are treated as blocked. Blocked scores are filled with
/// [`BLOCKED`], a finite value, so that a row whose every key is blocked has a finite
/// softmax (and finite gradients) which is then zeroed.
const BLOCKED: f32 = -1.0e30;
const DEAD_ROW: f32 = -5.0e29;

/// Which attention weights to return.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionWeights {
    /// None: the cheapest, and the only mode that can use the fused kernels.
    #[default]
    None,
    /// Per head: `[B, H, Tq, Tk]`.
    PerHead,
    /// Averaged over heads: `[B, 1, Tq, Tk]` (PyTorch's `average_attn_weights=True`,
    /// with the head axis kept so the rank is always 4).
    Averaged,
}

/// Options of [`scaled_dot_product_attention`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SdpaOptions {
    /// Multiplies `Q Kᵀ`; `None` is `1 / sqrt(Dk)`.
    pub scale: Option<f64>,
    /// Dropout probability applied to the attention weights after the softmax. Applied
    /// whenever it is above 0, as PyTorch's `dropout_p`: pass 0 outside training.
    pub dropout: f64,
    /// Which weights to return.
    pub weights: AttentionWeights,
}

impl SdpaOptions {
    /// Sets the scale.
    pub fn with_scale(mut self, scale: f64) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Sets the dropout probability on the weights.
    pub fn with_dropout(mut self, dropout: f64) -> Self {
        self.dropout = dropout;
        self
    }

    /// Sets which weights to return.
    pub fn with_weights(mut self, weights: AttentionWeights) -> Self {
        self.weights = weights;
        self
    }
}

/// The result of attention.
#[derive(Clone, Debug)]
pub struct AttentionOutput {
    /// `[B, H, Tq, Dv]`.
    pub context: Tensor<4>,
    /// The weights after the softmax (before dropout), when asked for:
    /// `[B, H, Tq, Tk]` per head or `[B, 1, Tq, Tk]` averaged.
    pub weights: Option<Tensor<4>>,
}

/// Scaled dot-product attention with a typed mask, GQA and optional weights.
///
/// # Shapes
/// - `query`: `[B, H, Tq, Dk]`
/// - `key`: `[B, Hkv, Tk, Dk]`, with `H % Hkv == 0`
/// - `value`: `[B, Hkv, Tk, Dv]`
/// - `mask`: broadcastable to `[B, H, Tq, Tk]` (see [`AttentionMask`])
/// - output context: `[B, H, Tq, Dv]`
///
/// # Panics
/// If the shapes disagree (naming the tensors and their shapes), if `H` is not a multiple
/// of `Hkv`, if the dropout is outside `[0, 1)` or the scale is not positive and finite.
pub fn scaled_dot_product_attention(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    mask: &AttentionMask,
    options: SdpaOptions,
) -> AttentionOutput {
    let [batch, heads, queries, d_k] = query.dims();
    let [_, kv_heads, keys, _] = key.dims();
    check_shapes(query.dims(), key.dims(), value.dims());
    mask.check([batch, heads, queries, keys]);
    assert!(
        (0.0..1.0).contains(&options.dropout),
        "scaled_dot_product_attention: dropout must be in [0, 1), got {}",
        options.dropout
    );
    let default_scale = 1.0 / (d_k as f64).sqrt();
    let scale = options.scale.unwrap_or(default_scale);
    assert!(
        scale.is_finite() && scale > 0.0,
        "scaled_dot_product_attention: scale must be positive and finite, got {scale}"
    );

    if options.weights == AttentionWeights::None && options.dropout == 0.0 {
        let group = heads / kv_heads;
        let key = repeat_kv(key, group); // [B, H, Tk, Dk]
        let value = repeat_kv(value, group); // [B, H, Tk, Dv]
        let fused_options = AttentionModuleOptions {
            // The CubeCL flash kernels take only the default scale.
            scale: (scale != default_scale).then_some(scale),
            softcap: None,
            is_causal: mask.is_causal(),
        };
        let full = [batch, heads, queries, keys];
        let blocked = mask
            .blocked()
            .map(|m| match fused_mask_broadcasts(&query.device()) {
                true => m.clone(),
                false => m.clone().expand(full),
            });
        let bias = mask.additive_bias().cloned();
        let context = fused_attention(query, key, value, blocked, bias, fused_options);
        return AttentionOutput {
            context,
            weights: None,
        };
    }

    let weights = attention_weights(query, key, mask, scale); // [B, H, Tq, Tk]
    let dropped = if options.dropout > 0.0 {
        let keep = 1.0 - options.dropout;
        let kept = weights.random_like(Distribution::Bernoulli(keep));
        weights.clone() * kept / keep
    } else {
        weights.clone()
    };
    let context = grouped_matmul(dropped, value, kv_heads); // [B, H, Tq, Dv]
    let weights = match options.weights {
        AttentionWeights::None => None,
        AttentionWeights::PerHead => Some(weights),
        AttentionWeights::Averaged => Some(weights.mean_dim(1)),
    };
    AttentionOutput { context, weights }
}

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
    // [B, Hkv, g·Tq, Dk] x [B, Hkv, Dk, Tk]: GQA without copying K.
    let scores = grouped_matmul(query, key.transpose(), kv_heads) * scale; // [B, H, Tq, Tk]
    let scores = match mask.additive_bias() {
        Some(bias) => scores + bias.clone().clamp_min(BLOCKED),
        None => scores,
    };
    let scores = match mask.to_blocked(queries, keys, &device) {
        Some(blocked) => scores.mask_fill(blocked, BLOCKED),
        None => scores,
    };
    let weights = burn::tensor::activation::softmax(scores.clone(), 3);
    if !may_block_rows(mask, queries, keys) {
        return weights;
    }
    // A row whose best score is a blocked one has no visible key: zero it.
    let open = scores.max_dim(3).greater_elem(DEAD_ROW).float(); // [B, H, Tq, 1]
    weights * open
}

/// Whether the backend's fused attention takes a mask that broadcasts over heads and
/// queries. Flex's kernel and the decomposed fallback (ndarray, autodiff) do; the CubeCL
/// flash kernels (wgpu, cuda) read the mask with the scores' shape, so it is expanded for
/// them (a strided view, not a copy).
fn fused_mask_broadcasts(device: &Device) -> bool {
    if device.is_autodiff() {
        return true;
    }
    let name = format!("{device:?}");
    name.starts_with("Device<Flex") || name.starts_with("Device<NdArray")
}

/// Whether some query row may have every key blocked.
fn may_block_rows(mask: &AttentionMask, queries: usize, keys: usize) -> bool {
    mask.blocked().is_some()
        || mask.additive_bias().is_some()
        || (mask.is_causal() && queries > keys)
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

/// Repeats each key/value head `group` times: `[B, Hkv, T, D]` -> `[B, Hkv·group, T, D]`.
fn repeat_kv(x: Tensor<4>, group: usize) -> Tensor<4> {
    if group == 1 {
        return x;
    }
    let [batch, kv_heads, len, dim] = x.dims();
    x.unsqueeze_dim::<5>(2)
        .expand([batch, kv_heads, group, len, dim])
        .reshape([batch, kv_heads * group, len, dim])
}

fn check_shapes(q: [usize; 4], k: [usize; 4], v: [usize; 4]) {
    let shapes = format!("query {q:?}, key {k:?}, value {v:?}");
    assert!(
        q[0] == k[0] && k[0] == v[0],
        "scaled_dot_product_attention: batch sizes differ: {shapes}"
    );
    assert!(
        k[1] == v[1] && k[1] > 0 && q[1].is_multiple_of(k[1]),
        "scaled_dot_product_attention: expected key and value heads Hkv to divide query heads H \
         ([B, H, Tq, Dk], [B, Hkv, Tk, Dk], [B, Hkv, Tk, Dv]), got {shapes}"
    );
    assert!(
        q[3] == k[3],
        "scaled_dot_product_attention: query and key head dims Dk differ: {shapes}"
    );
    assert!(
        k[2] == v[2],
        "scaled_dot_product_attention: key and value lengths Tk differ: {shapes}"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(feature = "flex")]
    #[test]
    fn flex_takes_broadcast_masks_in_the_fused_op() {
        assert!(fused_mask_broadcasts(&Device::flex()));
        assert!(fused_mask_broadcasts(&Device::flex().autodiff()));
    }

    #[cfg(feature = "ndarray")]
    #[allow(deprecated)]
    #[test]
    fn ndarray_takes_broadcast_masks_in_the_fused_op() {
        assert!(fused_mask_broadcasts(&Device::ndarray()));
    }

    #[cfg(feature = "wgpu")]
    #[test]
    fn wgpu_gets_full_masks_in_the_fused_op() {
        let device = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
        assert!(!fused_mask_broadcasts(&device));
    }
}
