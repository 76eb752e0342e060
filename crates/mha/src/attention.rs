//! Scaled dot-product attention: `softmax(Q Kᵀ · scale + bias, masked) V`.
//!
//! One function, paths with the same numbers, chosen per device by measurement (when no
//! weights are asked for and dropout is off; otherwise always the explicit path):
//! - **recompute** (`recompute.rs`): on flex and ndarray, with autodiff or not, attention
//!   is one operation whose backward pass recomputes the scores from the row log-sum-exp
//!   instead of keeping them. Both passes run in cache-sized tiles (`tiled.rs`,
//!   FlashAttention's scheme on the CPU); for other dtypes chunk by chunk through Burn's
//!   ops (`rows.rs`);
//! - **fused**: Burn's `burn::tensor::module::attention`, for zero queries on the CPU;
//! - **explicit**: matmul, mask, softmax, dropout, matmul: when the weights are wanted or
//!   dropout is on (the fused op has neither), on autodiff devices the recompute path
//!   does not cover, and on the CubeCL backends (wgpu, cuda), where it is faster than
//!   their f32 flash kernel;
//! - **chunked**: from 256 queries on, causal attention (and any attention on CubeCL, to
//!   bound the scores' memory) is cut into query chunks; a causal chunk reads only the
//!   keys it can see (the tiles do the same per tile).
//!
//! Grouped-query attention (GQA/MQA) takes keys and values with fewer heads than queries:
//! query head `h` reads key/value head `h / (H / Hkv)`, PyTorch's `enable_gqa=True`. The
//! tiles and the explicit path read the shared head where it lies; the chunked paths
//! repeat it for each query head of its group (and sum their gradients back).

use burn::tensor::{
    Device, Distribution, Tensor, module::attention as fused_attention, ops::AttentionModuleOptions,
};

use crate::mask::AttentionMask;

/// Scores at or below this are treated as blocked. Blocked scores are filled with
/// [`BLOCKED`], a finite value, so that a row whose every key is blocked has a finite
/// softmax (and finite gradients) which is then zeroed.
pub(crate) const BLOCKED: f32 = -1.0e30;
pub(crate) const DEAD_ROW: f32 = -5.0e29;

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
        let device = query.device();
        let kernel = Kernel::of(&device, queries);
        let fused_scale = (scale != default_scale).then_some(scale);
        #[cfg(any(feature = "flex", feature = "ndarray"))]
        if kernel == Kernel::Recompute {
            let chunk = match queries >= 2 * MIN_CHUNK {
                true => MIN_CHUNK.max(queries.div_ceil(MAX_CHUNKS)),
                false => queries,
            };
            let context = crate::recompute::attention(query, key, value, mask, scale, chunk);
            return AttentionOutput {
                context,
                weights: None,
            };
        }
        let chunked = queries >= 2 * MIN_CHUNK && (mask.is_causal() || kernel == Kernel::Explicit);
        let context = match (chunked, kernel) {
            (true, _) => attention_in_chunks(query, key, value, mask, scale, fused_scale, kernel),
            (false, Kernel::Fused) => fused(query, key, value, mask, fused_scale),
            (false, _) => explicit(query, key, value, mask, scale),
        };
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
    // [B, Hkv, g·Tq, Dk] x [B, Hkv, Dk, Tk]: GQA without copying K. The scale goes on
    // the queries, `Dk` times fewer values than the scores (forward and backward).
    let scores = grouped_matmul(query * scale, key.transpose(), kv_heads); // [B, H, Tq, Tk]
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

/// The CPU backend under `device` (autodiff or not), if it is flex or ndarray: their fused
/// op takes a mask that broadcasts over heads and queries, and [`crate::recompute`] runs
/// on them. The CubeCL flash kernels (wgpu, cuda) read the mask with the scores' shape
/// (and are slower than the explicit path).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cpu {
    Flex,
    NdArray,
}

impl Cpu {
    fn of(device: &Device) -> Option<Self> {
        let name = format!("{:?}", device.clone().inner());
        if name.starts_with("Device<Flex") {
            Some(Cpu::Flex)
        } else if name.starts_with("Device<NdArray") {
            Some(Cpu::NdArray)
        } else {
            None
        }
    }
}

/// Burn's fused attention op, for the devices of [`Kernel::Fused`] (flex, ndarray), which
/// take a mask that broadcasts over heads and queries as it is; `scale` is `None` for the
/// default `1 / sqrt(Dk)`.
///
/// # Shapes
/// - `query`: `[B, H, Tq, Dk]`, `key`: `[B, Hkv, Tk, Dk]`, `value`: `[B, Hkv, Tk, Dv]`
/// - result: `[B, H, Tq, Dv]`
fn fused(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    mask: &AttentionMask,
    scale: Option<f64>,
) -> Tensor<4> {
    let group = query.dims()[1] / key.dims()[1];
    let key = repeat_kv(key, group); // [B, H, Tk, Dk]
    let value = repeat_kv(value, group); // [B, H, Tk, Dv]
    let options = AttentionModuleOptions {
        scale,
        softcap: None,
        is_causal: mask.is_causal(),
    };
    let blocked = mask.blocked().cloned();
    let bias = mask.additive_bias().cloned();
    fused_attention(query, key, value, blocked, bias, options)
}

/// Smallest query chunk of [`attention_in_chunks`]; it runs from `2 * MIN_CHUNK` queries on.
const MIN_CHUNK: usize = 128;
/// Most chunks [`attention_in_chunks`] cuts the queries into (longer sequences, longer
/// chunks).
const MAX_CHUNKS: usize = 16;

/// How a device computes attention when no weights are wanted (chosen by measurement,
/// see the README's benchmarks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    /// Burn's fused op, for zero queries on flex and ndarray.
    Fused,
    /// [`crate::recompute`]: one operation with a backward pass of its own that
    /// recomputes the scores; on flex and ndarray both passes run in cache-sized tiles
    /// ([`crate::tiled`]), with autodiff or not (at 128 queries, 32 x 8 heads of 32,
    /// causal: 4.4 ms against 17 ms for flex's flash kernel and 43 ms for ndarray's
    /// decomposed op).
    Recompute,
    /// An autodiff device over a CubeCL backend: Burn's fused op has no backward of its
    /// own there (it is decomposed and differentiated op
    /// by op, with a few more passes over the scores than the explicit path), so the
    /// explicit path; causal chunks from 256 queries on.
    Autodiff,
    /// Matmul, softmax, matmul: the CubeCL backends (wgpu, cuda), whose f32 flash kernel
    /// is several times slower than these three steps (measured on an H100 through
    /// Vulkan: 16.3 ms against 5.6 ms for causal attention over `[8, 8, 512, 64]`).
    Explicit,
}

impl Kernel {
    fn of(device: &Device, queries: usize) -> Self {
        let cpu = Cpu::of(device);
        let recompute =
            cfg!(any(feature = "flex", feature = "ndarray")) && cpu.is_some() && queries > 0;
        match (device.is_autodiff(), cpu) {
            (true, _) if recompute => Kernel::Recompute,
            (true, _) => Kernel::Autodiff,
            (false, Some(_)) if recompute => Kernel::Recompute,
            (false, Some(_)) => Kernel::Fused,
            (false, None) => Kernel::Explicit,
        }
    }
}

/// Attention without weights or dropout: the explicit path's context only.
fn explicit(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    mask: &AttentionMask,
    scale: f64,
) -> Tensor<4> {
    let kv_heads = key.dims()[1];
    let weights = attention_weights(query, key, mask, scale); // [B, H, Tq, Tk]
    grouped_matmul(weights, value, kv_heads) // [B, H, Tq, Dv]
}

/// Attention in query chunks: a causal chunk reads only the keys it can see, which skips
/// the blocked upper triangle (about half the score work and memory at long lengths),
/// forward and, under autodiff, backward. Each chunk is the explicit path on autodiff
/// devices (Burn differentiates its fused op op by op over the whole `[B, H, Tq, Tk]`
/// scores, and flex's flash kernel computes every key tile, masked or not) and on the
/// CubeCL ones, where chunks also bound the memory of the scores; elsewhere it is Burn's
/// fused op.
///
/// With a causal mask, rows `start..end` see keys `0..end + (Tk - Tq)`, and the
/// bottom-right causal alignment of that sub-problem is the original one, so each chunk
/// is plain masked attention with its slice of the boolean and additive parts.
///
/// # Shapes
/// - `query`: `[B, H, Tq, Dk]`, `key`: `[B, Hkv, Tk, Dk]`, `value`: `[B, Hkv, Tk, Dv]`
/// - result: `[B, H, Tq, Dv]`
fn attention_in_chunks(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    mask: &AttentionMask,
    scale: f64,
    fused_scale: Option<f64>,
    kernel: Kernel,
) -> Tensor<4> {
    let [batch, heads, queries, d_k] = query.dims();
    let [_, kv_heads, keys, d_v] = value.dims();
    let offset = keys as i64 - queries as i64;
    let chunk = MIN_CHUNK.max(queries.div_ceil(MAX_CHUNKS));
    let device = query.device();
    let parts: Vec<Tensor<4>> = (0..queries)
        .step_by(chunk)
        .map(|start| {
            let end = (start + chunk).min(queries);
            let visible = match mask.is_causal() {
                true => (end as i64 + offset).clamp(0, keys as i64) as usize,
                false => keys,
            };
            if visible == 0 {
                // Every key is in these queries' future: no visible key, zeros.
                return Tensor::zeros([batch, heads, end - start, d_v], &device);
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
            let sub = mask.rows_and_keys(start..end, visible, queries, keys);
            match kernel {
                Kernel::Fused => fused(q, k, v, &sub, fused_scale),
                _ => explicit(q, k, v, &sub, scale),
            }
        })
        .collect();
    Tensor::cat(parts, 2)
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
    fn flex_runs_the_tiled_op_with_autodiff_or_not() {
        let (flex, autodiff) = (Device::flex(), Device::flex().autodiff());
        assert_eq!(Cpu::of(&autodiff), Some(Cpu::Flex));
        assert_eq!(Kernel::of(&autodiff, 8), Kernel::Recompute);
        assert_eq!(Kernel::of(&autodiff, 0), Kernel::Autodiff);
        assert_eq!(Kernel::of(&flex, 1), Kernel::Recompute);
        assert_eq!(Kernel::of(&flex, 4096), Kernel::Recompute);
        assert_eq!(Kernel::of(&flex, 0), Kernel::Fused);
    }

    #[cfg(feature = "ndarray")]
    #[allow(deprecated)]
    #[test]
    fn ndarray_runs_the_tiled_op_with_autodiff_or_not() {
        let device = Device::ndarray();
        assert_eq!(Cpu::of(&device), Some(Cpu::NdArray));
        assert_eq!(Kernel::of(&device, 4096), Kernel::Recompute);
        assert_eq!(Kernel::of(&device, 0), Kernel::Fused);
        assert_eq!(Kernel::of(&device.autodiff(), 8), Kernel::Recompute);
    }

    #[cfg(feature = "wgpu")]
    #[test]
    fn wgpu_takes_the_explicit_path() {
        let device = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
        assert_eq!(Cpu::of(&device), None);
        assert_eq!(Kernel::of(&device, 8), Kernel::Explicit);
        assert_eq!(Kernel::of(&device.autodiff(), 8), Kernel::Autodiff);
    }
}
