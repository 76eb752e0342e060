//! Scaled dot-product attention: `softmax(Q Kᵀ · scale + bias, masked) V`.
//!
//! One public function over paths that give the same numbers; the dispatcher
//! (`crate::dispatch`) picks one per call from the device's backend, whether it
//! differentiates, the dtypes, the sizes and whether the weights are wanted:
//! - **tiles** (`ops::attention` over `crate::cpu`): on flex and ndarray in f32, with
//!   autodiff or not, attention is one operation of the backend whose backward pass
//!   recomputes the weights from each row's log-sum-exp instead of keeping them; both
//!   passes run in cache-sized tiles (FlashAttention's scheme on the CPU);
//! - **gpu** (`crate::gpu`): on the CubeCL backends (wgpu, cuda) in f32, f16 and bf16
//!   (computing in f32), the same scheme
//!   in kernels of our own: a forward pass that keeps each row's log-sum-exp and a backward
//!   pass that recomputes the weights, for every mask kind (bias and position-table
//!   gradients included), soft cap and GQA;
//! - **explicit** (`explicit`): matmul, mask, softmax, matmul: when the weights are
//!   wanted or dropout is on, and for other dtypes.
//!   From 256 queries on it runs in query chunks when the mask blocks by position (causal,
//!   windows, packed sequences: a chunk reads
//!   only the keys it can see, forward and backward) or the device does not differentiate
//!   (no more than one chunk's scores exist at a time).
//!
//! - **empty** (`empty`): no key (`Tk = 0`) or an output without elements (`B`, `H`,
//!   `Tq` or `Dv` is 0): zeros (a row without a key is a fully blocked row), with zero
//!   gradients of every input's shape under autodiff, on every backend.
//!
//! Grouped-query attention (GQA/MQA) takes keys and values with fewer heads than queries:
//! query head `h` reads key/value head `h / (H / Hkv)`, PyTorch's `enable_gqa=True`. Every
//! path reads the shared head where it lies instead of copying it per query head.

mod empty;
mod explicit;

use burn::tensor::{Device, Tensor};

pub use explicit::attention_weights;

use crate::dispatch::{self, AttentionCall, AttentionPath};
use crate::mask::AttentionMask;
use crate::problem::Scores;

/// Which attention weights to return.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttentionWeights {
    /// None: the cheapest, and the only mode that can use the CPU tiles and the GPU
    /// kernels.
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
    /// Logit soft-capping (Gemma 2): the scaled scores become `cap · tanh(s / cap)`
    /// before the bias and the mask, which bounds them to `(-cap, cap)`. `None`: no cap.
    pub softcap: Option<f64>,
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

    /// Sets the soft cap of the scores.
    pub fn with_softcap(mut self, cap: f64) -> Self {
        self.softcap = Some(cap);
        self
    }
}

/// The result of attention.
#[derive(Clone, Debug)]
pub struct AttentionOutput {
    /// `[B, H, Tq, Dv]`.
    pub context: Tensor<4>,
    /// The weights that made the context, when asked for: after the softmax and dropout
    /// (as PyTorch's `nn.MultiheadAttention` and Burn's module return them; outside
    /// training, the softmax's), `[B, H, Tq, Tk]` per head or `[B, 1, Tq, Tk]` averaged.
    pub weights: Option<Tensor<4>>,
}

/// Scaled dot-product attention with a typed mask, GQA, an optional soft cap and optional
/// weights.
///
/// # Shapes
/// - `query`: `[B, H, Tq, Dk]`
/// - `key`: `[B, Hkv, Tk, Dk]`, with `H % Hkv == 0`
/// - `value`: `[B, Hkv, Tk, Dv]`
/// - `mask`: broadcastable to `[B, H, Tq, Tk]` (see [`AttentionMask`])
/// - output context: `[B, H, Tq, Dv]`
///
/// # Zero-sized inputs
/// Any of `B`, `H` (with `Hkv = 0` too), `Tq`, `Tk` and `Dv` may be 0, on every backend:
/// an output without elements is an empty tensor of its shape; with no key (`Tk = 0`)
/// every row is a fully blocked row and gives 0; weights, when asked for, are zeros of
/// their shape where they have no key or no element. Under autodiff every input (and
/// the mask's bias, position table and sinks) gets a gradient of its own shape, 0.
///
/// # Panics
/// If the shapes disagree (naming the tensors and their shapes), if `H` is not a multiple
/// of `Hkv`, if the mask does not fit the scores (a part that does not broadcast to
/// `[B, H, Tq, Tk]`, sinks or a position bias of another number of heads, packed
/// sequences of another batch or past `Tk`, or with `Tq != Tk`), if the dropout is outside
/// `[0, 1)` or the scale or the soft cap is not positive and finite, if the key, the value
/// or a part of the mask is on another device than the query (naming both devices).
pub fn scaled_dot_product_attention(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    mask: &AttentionMask,
    options: SdpaOptions,
) -> AttentionOutput {
    let [batch, heads, queries, d_k] = query.dims();
    let keys = key.dims()[2];
    check_shapes(
        "scaled_dot_product_attention",
        query.dims(),
        key.dims(),
        Some(value.dims()),
    );
    let device = query.device();
    let others = [("key", &key), ("value", &value)];
    check_devices("scaled_dot_product_attention", &device, &others);
    let scores = checked_scores(&options, mask, [batch, heads, queries, keys], d_k, &device);

    let keeps_weights = options.weights != AttentionWeights::None || options.dropout > 0.0;
    let call = AttentionCall::of([&query, &key, &value], mask, keeps_weights);
    let inputs = [query, key, value];
    let (context, weights) = match dispatch::attention(call) {
        AttentionPath::Empty => {
            let (context, weights) =
                empty::attention(inputs, mask, scores, options.weights, options.dropout);
            return AttentionOutput { context, weights };
        }
        #[cfg(feature = "cpu-kernels")]
        AttentionPath::Tiles => (crate::ops::attention::attention(inputs, mask, scores), None),
        #[cfg(feature = "gpu-kernels")]
        AttentionPath::Gpu => (crate::gpu::attention(inputs, mask, scores), None),
        AttentionPath::Explicit { chunk } => (explicit::context(inputs, mask, scores, chunk), None),
        AttentionPath::Weights => {
            let (context, weights) = explicit::with_weights(inputs, mask, scores, options.dropout);
            (context, Some(weights))
        }
    };
    let weights = match options.weights {
        AttentionWeights::None => None,
        AttentionWeights::PerHead => weights,
        AttentionWeights::Averaged => weights.map(|w| w.mean_dim(1)),
    };
    AttentionOutput { context, weights }
}

/// The scores' scale and soft cap of a call with `options` over `[B, H, Tq, Tk]` scores
/// of head dim `d_k`, once `mask` and the options are checked.
///
/// # Panics
/// As [`scaled_dot_product_attention`], if the mask does not broadcast to the scores, if
/// the dropout is outside `[0, 1)` or the scale or the soft cap is not positive and finite.
pub(crate) fn checked_scores(
    options: &SdpaOptions,
    mask: &AttentionMask,
    scores: [usize; 4],
    d_k: usize,
    device: &Device,
) -> Scores {
    mask.check(scores, device);
    assert!(
        (0.0..1.0).contains(&options.dropout),
        "scaled_dot_product_attention: dropout must be in [0, 1), got {}",
        options.dropout
    );
    let scale = options.scale.unwrap_or(1.0 / (d_k as f64).sqrt());
    // Positive and finite in f32 too, the kernels' precision (a cap past f32's range
    // became infinite there, its scores NaN).
    let in_f32 = |x: f64| x.is_finite() && x > 0.0 && (x as f32).is_finite() && (x as f32) > 0.0;
    assert!(
        in_f32(scale),
        "scaled_dot_product_attention: scale must be positive and finite in f32, got {scale}"
    );
    if let Some(cap) = options.softcap {
        assert!(
            in_f32(cap),
            "scaled_dot_product_attention: softcap must be positive and finite in f32, got {cap}"
        );
    }
    Scores {
        scale,
        softcap: options.softcap,
    }
}

/// Checks that the tensors `others` (named) of a call of `caller` are on the query's
/// `device`, naming both devices.
pub(crate) fn check_devices(caller: &str, device: &Device, others: &[(&str, &Tensor<4>)]) {
    for &(name, t) in others {
        let at = t.device();
        assert!(
            at == *device,
            "{caller}: the {name} is on {at:?} and the query on {device:?}"
        );
    }
}

/// Checks the shapes of a call of `caller` (its value's, when it has one), naming them.
pub(crate) fn check_shapes(caller: &str, q: [usize; 4], k: [usize; 4], v: Option<[usize; 4]>) {
    let shapes = match v {
        Some(v) => format!("query {q:?}, key {k:?}, value {v:?}"),
        None => format!("query {q:?}, key {k:?}"),
    };
    // Without a value, the key stands for it: the value's checks hold.
    let v = v.unwrap_or(k);
    assert!(
        q[0] == k[0] && k[0] == v[0],
        "{caller}: batch sizes differ: {shapes}"
    );
    assert!(
        k[1] == v[1] && (k[1] > 0 || q[1] == 0) && q[1].is_multiple_of(k[1].max(1)),
        "{caller}: expected key and value heads Hkv to divide query heads H \
         ([B, H, Tq, Dk], [B, Hkv, Tk, Dk], [B, Hkv, Tk, Dv]), got {shapes}"
    );
    assert!(
        q[3] == k[3],
        "{caller}: query and key head dims Dk differ: {shapes}"
    );
    assert!(
        k[2] == v[2],
        "{caller}: key and value lengths Tk differ: {shapes}"
    );
}
