//! Multi-head attention: projections, heads, [`scaled_dot_product_attention`], output
//! projection. Self-, cross- and causal self-attention are three ways of filling one
//! [`MhaInput`]; the mechanism is the same.
//!
//! Shapes are batch-first, `[B, T, d_model]` (PyTorch's `batch_first=True`).

use burn::module::{Module, Param};
use burn::nn::{Dropout, DropoutConfig, Initializer, Linear, LinearConfig};
use burn::tensor::{Device, Tensor};

use crate::attention::{AttentionWeights, SdpaOptions, scaled_dot_product_attention};
use crate::cache::{Brought, KvCache, MemoryKv};
use crate::error::{CacheError, Check, ConfigError};
use crate::mask::AttentionMask;
use crate::norm::LayerNorm;
use crate::positions::{PositionBias, Positions, Rope, alibi_slopes};

crate::configs::config! {
    /// Configuration of [`MultiHeadAttention`].
    #[derive(Debug)]
    pub struct MultiHeadAttentionConfig {
        /// Model width (PyTorch's `embed_dim`): width of the query input and of the output.
        pub d_model: usize,
        /// Number of query heads `H`; the head width is `head_dim`, by default
        /// `d_model / n_heads`.
        pub n_heads: usize,
        ;
        /// Number of key/value heads `Hkv`: `n_heads` is classic multi-head attention, fewer
        /// is grouped-query attention (GQA), 1 is multi-query attention (MQA). Default:
        /// `n_heads`.
        pub n_kv_heads: Option<usize> = None => with_n_kv_heads,
        /// Head width `Dh`, when the heads together are not `d_model` wide (Qwen3's and
        /// Gemma's `head_dim`): the queries are `n_heads · head_dim` wide and the output
        /// projection takes them back to `d_model`. Default: `d_model / n_heads`, which must
        /// then divide evenly.
        pub head_dim: Option<usize> = None => with_head_dim,
        /// Width of the key input (PyTorch's `kdim`). Default: `d_model`.
        pub kdim: Option<usize> = None => with_kdim,
        /// Width of the value input (PyTorch's `vdim`). Default: `d_model`.
        pub vdim: Option<usize> = None => with_vdim,
        /// Whether the projections have a bias. Default: `true`, as in PyTorch.
        pub bias: bool = true => with_bias,
        /// Whether the output projection has a bias, when it differs from the input
        /// projections' (Qwen2 has biases on q, k and v, none on o). Default: `bias`.
        pub out_bias: Option<bool> = None => with_out_bias,
        /// An RMS norm over each head's queries and each head's keys, with this epsilon,
        /// before RoPE (Qwen3's `q_norm` and `k_norm`; Hugging Face's `rms_norm_eps`).
        /// Default: none.
        pub qk_norm_eps: Option<f64> = None => with_qk_norm_eps,
        /// Attention sinks: a learned logit per query head that joins every row's softmax
        /// as a key without a value (gpt-oss's `sinks`; see
        /// [`AttentionMask::sinks`]), initialised to 0. Default: none.
        pub sinks: bool = false => with_sinks,
        /// Burn's `quiet_softmax`: sinks of 0, fixed (not trained), so that a row's weights
        /// may sum to less than 1. A module converted from Burn's with `quiet_softmax` has
        /// them; build one this way to load its record (`sinks: true` would train them).
        /// Default: `false`.
        pub quiet_softmax: bool = false => with_quiet_softmax,
        /// Dropout on the attention weights after the softmax, in training only. Default: 0,
        /// as PyTorch's (Burn's module defaults to 0.1).
        pub dropout: f64 = 0.0 => with_dropout,
        /// Multiplies `Q Kᵀ`. Default: `1 / sqrt(head_dim)`.
        pub scale: Option<f64> = None => with_scale,
        /// Logit soft-capping: the scaled scores become `cap · tanh(s / cap)` (Gemma 2 uses
        /// 50). Default: none.
        pub softcap: Option<f64> = None => with_softcap,
        /// How self-attention knows where tokens are: RoPE, ALiBi or a learned relative bias
        /// (absolute positions are added to the input, by a stack or the model). Default: none.
        ///
        /// Positions belong to self-attention: a module with positions refuses to attend to
        /// another sequence ([`MhaInput::cross`], [`MhaInput::new`], [`memory_kv`]), as
        /// Hugging Face's encoder-decoders have no positions in their cross-attention (T5's has
        /// no relative bias, Moonshine's no RoPE). Configure a cross-attention with
        /// `Positions::None`, as [`DecoderBlock`](crate::DecoderBlock) does.
        ///
        /// [`memory_kv`]: MultiHeadAttention::memory_kv
        pub positions: Positions = Positions::None => with_positions,
    }
}

/// The input projection: PyTorch's packed `in_proj` when keys and values have width
/// `d_model`, separate `q/k/v_proj` otherwise.
// One per module: the size of the enum does not matter, and Burn's derive takes no Box.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum InputProjection {
    /// One `[d_model, (H + 2·Hkv)·Dh]` weight whose output columns are Q, then K, then V.
    /// Where self-attention runs on the GPU kernels it projects all three with one
    /// product, whose output the kernels read in place (and whose gradient they give as
    /// one tensor); elsewhere, and where RoPE or `q_norm`/`k_norm` change the queries
    /// and keys, by each third of the weight in turn.
    Packed(Linear),
    /// Separate weights, for key and value inputs of other widths (`kdim`, `vdim`).
    Separate(SeparateProjection),
}

/// Separate Q, K and V projections.
#[derive(Module, Debug)]
pub struct SeparateProjection {
    /// `[d_model, H·Dh]`.
    pub q_proj: Linear,
    /// `[kdim, Hkv·Dh]`.
    pub k_proj: Linear,
    /// `[vdim, Hkv·Dh]`.
    pub v_proj: Linear,
}

/// Multi-head attention with typed masks, GQA, fused kernels and optional weights.
///
/// Build it with [`MultiHeadAttentionConfig::try_init`]; call it with
/// [`forward`](Self::forward) and an [`MhaInput`], or with the shortcuts
/// [`self_attention`](Self::self_attention), [`causal_self_attention`](Self::causal_self_attention)
/// and [`cross_attention`](Self::cross_attention).
#[derive(Module, Debug)]
pub struct MultiHeadAttention {
    /// Q, K, V projections.
    pub in_proj: InputProjection,
    /// Output projection `[H·Dh, d_model]`.
    pub out_proj: Linear,
    /// Dropout on the attention weights (its probability and training flag).
    pub dropout: Dropout,
    /// Query heads `H`.
    pub n_heads: usize,
    /// Key/value heads `Hkv`.
    pub n_kv_heads: usize,
    /// Head width `Dh`.
    pub head_dim: usize,
    /// Width of the key input.
    pub kdim: usize,
    /// Width of the value input.
    pub vdim: usize,
    /// Score scale.
    pub scale: f64,
    /// Soft cap of the scores, if any.
    pub softcap: Option<f64>,
    /// The RMS norm of each query head, `[Dh]`, before RoPE (QK-norm), if any.
    pub q_norm: Option<LayerNorm>,
    /// The RMS norm of each key head, `[Dh]`, before RoPE (QK-norm), if any.
    pub k_norm: Option<LayerNorm>,
    /// How self-attention knows where tokens are (cross-attention refuses a module with
    /// positions, see [`MultiHeadAttentionConfig::positions`]).
    #[module(skip)]
    pub positions: Positions,
    /// The learned relative bias of each head and bucket, `[H, buckets]`, for
    /// [`Positions::Relative`] and [`Positions::T5`]: the score of query `i` and key `j`
    /// of head `h` gets `position_table[h, bucket(j - i)]` (see
    /// [`Buckets`](crate::Buckets): a table indexed by `i - j` is this one flipped).
    /// Hugging Face's T5 stores it transposed, `[buckets, H]`;
    /// [`LoadPyTorch`](crate::LoadPyTorch) reads either.
    pub position_table: Option<Param<Tensor<2>>>,
    /// The attention sinks' logits, `[H]`, if any: each head's softmax over a row's keys
    /// includes `exp(sinks[h])` for a key without a value (see [`AttentionMask::sinks`]).
    pub sinks: Option<Param<Tensor<1>>>,
    /// The sinks are Burn's quiet softmax, fixed at 0 (the configuration's
    /// `quiet_softmax`): not learned, so a weight file's `sinks` is refused, and attention
    /// computes with zeros whatever the parameter holds.
    #[module(skip)]
    pub quiet_softmax: bool,
    /// For a module made by [`Heads::prune`](crate::analysis::Heads::prune), where its
    /// heads came from; `None` otherwise.
    #[module(skip)]
    pub pruned_from: Option<PrunedFrom>,
}

/// Where the heads of a pruned module came from: ALiBi gives each head the slope of its
/// place among the original heads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrunedFrom {
    /// The heads of the module before any pruning.
    pub heads: usize,
    /// The original index of each head left.
    pub kept: Vec<usize>,
}

/// Where keys and values come from.
// Lives for one forward call.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
enum Source {
    /// From the query input.
    SelfAttention,
    /// From one context tensor (keys = values).
    Context(Tensor<3>),
    /// From separate key and value tensors.
    KeyValue(Tensor<3>, Tensor<3>),
}

/// The input of [`MultiHeadAttention::forward`]: what attends to what, the mask, and
/// which weights to return.
#[derive(Clone, Debug)]
pub struct MhaInput {
    query: Tensor<3>,
    source: Source,
    mask: AttentionMask,
    weights: AttentionWeights,
    head_mask: Option<Tensor<1>>,
}

impl MhaInput {
    /// Self-attention: queries, keys and values all come from `x` `[B, T, d_model]`.
    pub fn self_attn(x: Tensor<3>) -> Self {
        Self {
            query: x,
            source: Source::SelfAttention,
            mask: AttentionMask::none(),
            weights: AttentionWeights::None,
            head_mask: None,
        }
    }

    /// Causal self-attention: each position attends to itself and earlier ones.
    pub fn causal(x: Tensor<3>) -> Self {
        Self::self_attn(x).mask(AttentionMask::causal())
    }

    /// Cross-attention: queries from `x` `[B, Tq, d_model]`, keys and values from
    /// `context` `[B, Tk, kdim]` (requires `kdim == vdim`). A module with positions
    /// refuses it (see [`MultiHeadAttentionConfig::positions`]).
    pub fn cross(x: Tensor<3>, context: Tensor<3>) -> Self {
        Self {
            source: Source::Context(context),
            ..Self::self_attn(x)
        }
    }

    /// PyTorch's call `mha(query, key, value)`: `[B, Tq, d_model]`, `[B, Tk, kdim]`,
    /// `[B, Tk, vdim]`. Keys and values may come from another sequence than the queries,
    /// so a module with positions refuses it: PyTorch's self-attention `mha(x, x, x)` is
    /// [`MhaInput::self_attn(x)`](Self::self_attn) (see
    /// [`MultiHeadAttentionConfig::positions`]).
    pub fn new(query: Tensor<3>, key: Tensor<3>, value: Tensor<3>) -> Self {
        Self {
            source: Source::KeyValue(key, value),
            ..Self::self_attn(query)
        }
    }

    /// Adds a mask (combined with any mask already set, see [`AttentionMask::and`]).
    pub fn mask(mut self, mask: AttentionMask) -> Self {
        self.mask = core::mem::take(&mut self.mask).and(mask);
        self
    }

    /// Asks for the attention weights: those that made the context, after dropout in
    /// training (as PyTorch's `nn.MultiheadAttention` and Burn's module return them).
    pub fn weights(mut self, weights: AttentionWeights) -> Self {
        self.weights = weights;
        self
    }

    /// Multiplies each head's output by its weight in `mask` `[H]` before the heads are
    /// merged: 1 keeps a head, 0 drops it (see [`HeadMask`](crate::analysis::HeadMask)).
    /// The gradient flows to `mask` when it requires one. The returned weights are the
    /// softmax's, unchanged by the mask.
    pub fn head_mask(mut self, mask: Tensor<1>) -> Self {
        self.head_mask = Some(mask);
        self
    }
}

/// The output of [`MultiHeadAttention::forward`].
#[derive(Clone, Debug)]
pub struct MhaOutput {
    /// `[B, Tq, d_model]`.
    pub context: Tensor<3>,
    /// `[B, H, Tq, Tk]` or `[B, 1, Tq, Tk]` when asked for (see [`AttentionWeights`]).
    pub weights: Option<Tensor<4>>,
}

impl MultiHeadAttentionConfig {
    /// Checks the configuration and builds the module, initialised as PyTorch does:
    /// Xavier-uniform input projections, zero input and output biases, and the output
    /// weight uniform in `±1/sqrt(n_heads · head_dim)` (`±1/sqrt(d_model)` unless
    /// `head_dim` is set).
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field and values when a size is zero, `d_model` is
    /// not divisible by `n_heads` (without a `head_dim`), `n_heads` not by `n_kv_heads`,
    /// the dropout is outside `[0, 1)`, the scale, the soft cap or `qk_norm_eps` is not
    /// positive and finite, `positions` do not fit the heads (RoPE over heads of an odd
    /// width or of a base of 1 or less, unusable buckets), are absolute (a stack's) or come
    /// with `kdim`/`vdim`, or both `sinks` and `quiet_softmax` are set.
    pub fn try_init(&self, device: &Device) -> Result<MultiHeadAttention, ConfigError> {
        let check = Check("MultiHeadAttentionConfig");
        let n_kv_heads = self.n_kv_heads.unwrap_or(self.n_heads);
        let kdim = self.kdim.unwrap_or(self.d_model);
        let vdim = self.vdim.unwrap_or(self.d_model);
        check.nonzero("d_model", self.d_model)?;
        check.nonzero("n_heads", self.n_heads)?;
        check.nonzero("n_kv_heads", n_kv_heads)?;
        check.nonzero("kdim", kdim)?;
        check.nonzero("vdim", vdim)?;
        if self.head_dim.is_none() {
            check.divisible("d_model", self.d_model, "n_heads", self.n_heads)?;
        }
        check.divisible("n_heads", self.n_heads, "n_kv_heads", n_kv_heads)?;
        check.probability("dropout", self.dropout)?;
        if let Some(scale) = self.scale {
            check.positive_f32("scale", scale)?;
        }
        if let Some(cap) = self.softcap {
            check.positive_f32("softcap", cap)?;
        }
        if let Some(epsilon) = self.qk_norm_eps {
            check.positive_f32("qk_norm_eps", epsilon)?;
        }
        if self.sinks && self.quiet_softmax {
            return Err(ConfigError {
                config: "MultiHeadAttentionConfig",
                field: "quiet_softmax",
                message: "quiet_softmax gives fixed sinks of 0, sinks learned ones: give one \
                          of the two"
                    .into(),
            });
        }
        let head_dim = self.head_dim.unwrap_or(self.d_model / self.n_heads);
        check.nonzero("head_dim", head_dim)?;
        // The projections' weights: [d_model, (n_heads + 2 n_kv_heads) head_dim] packed,
        // [kdim or vdim, n_kv_heads head_dim] apart.
        let [d_model, kdim_, vdim_, heads, kv_heads, width] =
            [self.d_model, kdim, vdim, self.n_heads, n_kv_heads, head_dim].map(|n| n as u128);
        check.fits(
            "head_dim",
            &[
                ("d_model", d_model),
                ("n_heads + 2 n_kv_heads", heads + 2 * kv_heads),
                ("head_dim", width),
            ],
        )?;
        for (field, dim) in [("kdim", kdim_), ("vdim", vdim_)] {
            let factors = [(field, dim), ("n_kv_heads", kv_heads), ("head_dim", width)];
            check.fits(field, &factors)?;
        }
        self.positions
            .validate("MultiHeadAttentionConfig", head_dim)?;
        if self.positions.is_absolute() {
            return Err(ConfigError {
                config: "MultiHeadAttentionConfig",
                field: "positions",
                message: format!(
                    "{:?} positions are added to the input once, by a stack or the model; \
                     attention takes Rope, Alibi, Relative or T5",
                    self.positions
                ),
            });
        }

        if self.positions != Positions::None && (kdim, vdim) != (self.d_model, self.d_model) {
            return Err(ConfigError {
                config: "MultiHeadAttentionConfig",
                field: "positions",
                message: format!(
                    "{:?} positions apply to self-attention, whose keys and values are the \
                     input itself, d_model = {} wide; kdim = {kdim} and vdim = {vdim} are for \
                     cross-attention, which takes Positions::None",
                    self.positions, self.d_model
                ),
            });
        }

        let q_width = self.n_heads * head_dim;
        let kv_width = n_kv_heads * head_dim;
        let xavier = |d_in, d_out| {
            zero_bias(
                LinearConfig::new(d_in, d_out)
                    .with_bias(self.bias)
                    .with_initializer(Initializer::XavierUniform { gain: 1.0 })
                    .init(device),
            )
        };
        let in_proj = if kdim == self.d_model && vdim == self.d_model {
            InputProjection::Packed(xavier(self.d_model, q_width + 2 * kv_width))
        } else {
            InputProjection::Separate(SeparateProjection {
                q_proj: xavier(self.d_model, q_width),
                k_proj: xavier(kdim, kv_width),
                v_proj: xavier(vdim, kv_width),
            })
        };
        let out_proj = zero_bias(
            LinearConfig::new(q_width, self.d_model)
                .with_bias(self.out_bias.unwrap_or(self.bias))
                .init(device),
        );
        let qk_norm = || {
            self.qk_norm_eps
                .map(|epsilon| LayerNorm::rms(head_dim, epsilon, device))
        };
        Ok(MultiHeadAttention {
            in_proj,
            out_proj,
            dropout: DropoutConfig::new(self.dropout).init(),
            n_heads: self.n_heads,
            n_kv_heads,
            head_dim,
            kdim,
            vdim,
            scale: self.scale.unwrap_or(1.0 / (head_dim as f64).sqrt()),
            softcap: self.softcap,
            q_norm: qk_norm(),
            k_norm: qk_norm(),
            positions: self.positions.clone(),
            // Zeros: every distance starts alike, and training tells them apart.
            position_table: self
                .positions
                .buckets()
                .map(|buckets| Initializer::Zeros.init([self.n_heads, buckets.len()], device)),
            // Quiet softmax's are fixed.
            sinks: (self.sinks || self.quiet_softmax).then(|| {
                Initializer::Zeros
                    .init([self.n_heads], device)
                    .set_require_grad(!self.quiet_softmax)
            }),
            quiet_softmax: self.quiet_softmax,
            pruned_from: None,
        })
    }

    /// Builds the module.
    ///
    /// # Panics
    /// With the message of [`try_init`](Self::try_init)'s error.
    pub fn init(&self, device: &Device) -> MultiHeadAttention {
        self.try_init(device).unwrap_or_else(|err| panic!("{err}"))
    }
}

/// `linear` with its bias starting at zero, as PyTorch's `MultiheadAttention` sets it. Lazy
/// as Burn's initializers: nothing is built until first used (a weight import replaces it
/// without building it). Built as zeros rather than zeroed: a random value zeroed lazily
/// left wgpu's packed forward at a width of 21 launching 6 matrix products for 2
/// (`tests/gpu.rs`).
fn zero_bias(mut linear: Linear) -> Linear {
    linear.bias = linear
        .bias
        .map(|b| Initializer::Zeros.init(b.lazy_shape(), &b.lazy_device()));
    linear
}

impl MultiHeadAttention {
    /// The heads of its one attention layer: `[n_heads]` (see [`crate::inspect`]).
    pub fn head_counts(&self) -> Vec<usize> {
        vec![self.n_heads]
    }

    /// Model width `d_model`.
    pub fn d_model(&self) -> usize {
        self.out_proj.weight.shape().dims::<2>()[1]
    }

    /// Attention as described by `input`.
    ///
    /// # Shapes
    /// - query: `[B, Tq, d_model]`; key `[B, Tk, kdim]`; value `[B, Tk, vdim]`
    /// - mask: broadcastable to `[B, H, Tq, Tk]`
    /// - context: `[B, Tq, d_model]`; weights `[B, H or 1, Tq, Tk]` when asked for
    ///
    /// # Panics
    /// If an input has the wrong width or batch size, naming the expected and actual
    /// shapes, or if the mask does not broadcast to the scores; if the module has
    /// positions and `input` attends to another sequence ([`MhaInput::cross`],
    /// [`MhaInput::new`]), naming the positions and the call; if the module has attention
    /// sinks and the mask has its own, or adds a position bias (ALiBi, a learned table) and
    /// the mask has one too; if the head mask does not have a weight per head; if the key
    /// and the value differ in length; if an input, a part of the mask or the head mask is
    /// on another device than the module, naming both devices.
    pub fn forward(&self, input: MhaInput) -> MhaOutput {
        let MhaInput {
            query,
            source,
            mask,
            weights,
            head_mask,
        } = input;
        match source {
            Source::SelfAttention => {}
            Source::Context(_) => self.refuse_positions("MhaInput::cross(x, context)"),
            Source::KeyValue(..) => self.refuse_positions("MhaInput::new(query, key, value)"),
        }
        let self_attention = matches!(source, Source::SelfAttention);
        let dropout = crate::dropout::probability(&self.dropout, &query.device());
        let batch = query.dims()[0];
        check_input("query", &query, batch, self.d_model(), &self.device());
        #[cfg(feature = "gpu-kernels")]
        if self_attention && let Some(packed) = self.packed_heads(&query, &mask, weights, dropout) {
            // One product by the whole packed weight, its output the kernels' input.
            let InputProjection::Packed(proj) = &self.in_proj else {
                unreachable!("packed heads come from a packed projection")
            };
            let qkv = crate::ops::linear::forward(proj, query); // [B, T, (H + 2·Hkv)·Dh]
            let mask = self.position_bias(mask);
            // The dropout is 0 here (else the weights' path), or out of range, which
            // `attend` refuses, naming it.
            return self.attend(
                Heads::Packed(qkv, packed),
                &mask,
                weights,
                dropout,
                head_mask,
            );
        }
        let (q, k, v) = self.project(query, source); // [B, T, heads·Dh]
        let q = self.query_heads(q); // [B, H, Tq, Dh]
        let k = self.key_heads(k); // [B, Hkv, Tk, Dh]
        let v = self.split_heads(v, self.n_kv_heads); // [B, Hkv, Tk, Dh]
        let (q, k, mask) = match self_attention {
            true => self.positioned(q, k, mask, [0, 0]),
            false => (q, k, mask),
        };
        self.attend(Heads::Split([q, k, v]), &mask, weights, dropout, head_mask)
    }

    /// Causal self-attention of the next tokens `x` `[B, T, d_model]` with `cache`, which
    /// keeps the keys and values of the tokens before them (see [`crate::cache`]): run a
    /// prompt, then one token per call. Token `t` of the call stands at position
    /// `cache.len() + t`: RoPE turns it there, and the biases by distance count from
    /// there. With a sliding cache each token sees the last `W` positions, itself included.
    /// The outputs equal those rows of [`causal_self_attention`](Self::causal_self_attention)
    /// (or self-attention under [`AttentionMask::sliding_window`]) over the whole sequence.
    ///
    /// `mask` adds to the causal rule, over the keys the call sees
    /// ([`KvCache::keys_seen`]): the padding of prompts of different lengths, say. A
    /// window or causal part in it, aligned bottom-right or not aligned, is placed where
    /// the cache places the call's queries: at their positions, also in a cache read in
    /// full ([`KvCache::fixed_reads`]), whose last keys are slots not yet written.
    /// Dropout does not act.
    ///
    /// # Errors
    /// [`CacheError::Full`] past the cache's capacity, [`CacheError::Mismatch`] when the
    /// batch, the key/value heads or the head width differ from the cached ones
    /// ([`CacheError::DType`] the dtype,
    /// [`CacheError::Device`] the device: a cache reset takes another),
    /// [`CacheError::Packed`] for a packed mask; the cache is then unchanged.
    ///
    /// # Panics
    /// As [`forward`](Self::forward), for inputs of the wrong width or a mask that does
    /// not broadcast to the keys the call sees, or is aligned to put the call's first
    /// query elsewhere than the cache does (before the cache changes).
    pub fn forward_cached(
        &self,
        x: Tensor<3>,
        cache: &mut KvCache,
        mask: AttentionMask,
    ) -> Result<Tensor<3>, CacheError> {
        let out = self.cached(x, cache, mask, AttentionWeights::None, None)?;
        Ok(out.context)
    }

    /// The keys and values a cached self-attention call over `x` `[B, T, d_model]` brings
    /// to its cache, before they are computed.
    pub(crate) fn brought(&self, x: &Tensor<3>) -> [Brought; 2] {
        let [batch, tokens, _] = x.dims();
        let like = || Brought {
            dims: [batch, self.n_kv_heads, tokens, self.head_dim],
            dtype: x.dtype(),
            device: x.device(),
        };
        [like(), like()]
    }

    /// [`forward_cached`](Self::forward_cached) with the weights over the keys the call
    /// sees (`[B, H, T, keys_seen]`) when asked for, and each head's output scaled by its
    /// weight in `head_mask` `[H]`.
    pub(crate) fn cached(
        &self,
        x: Tensor<3>,
        cache: &mut KvCache,
        mask: AttentionMask,
        weights: AttentionWeights,
        head_mask: Option<Tensor<1>>,
    ) -> Result<MhaOutput, CacheError> {
        if mask.rule().packed.is_some() {
            return Err(CacheError::Packed);
        }
        let (q, k, v) = self.project(x, Source::SelfAttention);
        let q = self.query_heads(q); // [B, H, T, Dh]
        let k = self.key_heads(k); // [B, Hkv, T, Dh]
        let v = self.split_heads(v, self.n_kv_heads);
        let offset = cache.len();
        let (q, k, mask) = self.positioned(q, k, mask, [offset, offset]);
        let [batch, _, tokens, _] = q.dims();
        // A mask that does not fit the keys the call sees, or places them from another
        // query, panics before the cache changes.
        let seen = cache.keys_seen(tokens);
        mask.check([batch, self.n_heads, tokens, seen], &q.device());
        // What the attention refuses, refused before the cache changes.
        self.check_attend(&mask, head_mask.as_ref());
        if tokens == 0 {
            // No query: nothing written, nothing attended; the weights over the keys the
            // call sees, none of them weighed.
            let mut out = self.attend(
                Heads::Split([q, k, v]),
                &AttentionMask::none(),
                weights,
                0.0,
                head_mask,
            );
            out.weights = out.weights.map(|w| {
                let [b, h, _, _] = w.dims();
                Tensor::empty([b, h, 0, seen], (&w.device(), w.dtype()))
            });
            return Ok(out);
        }
        let mask = cache.align(mask, tokens);
        // The weights name the keys in the order of their positions: a sliding cache's
        // ring is then read in that order too.
        let ordered = !mask.is_none() || weights != AttentionWeights::None;
        let seen = cache.write(k, v, ordered)?;
        let mask = mask.and(seen.mask);
        let inputs = [q, seen.keys, seen.values];
        Ok(self.attend(Heads::Split(inputs), &mask, weights, 0.0, head_mask))
    }

    /// The cross-attention keys and values of `memory` `[B, Tk, kdim]` (keys = values, as
    /// [`MhaInput::cross`]), for every decoding step of
    /// [`cross_attention_cached`](Self::cross_attention_cached).
    ///
    /// # Panics
    /// If the module's `kdim` and `vdim` differ, if `memory` is not `kdim` wide or is on
    /// another device than the module, or if the module has positions (see
    /// [`MultiHeadAttentionConfig::positions`]).
    pub fn memory_kv(&self, memory: Tensor<3>) -> MemoryKv {
        self.refuse_positions("MultiHeadAttention::memory_kv(memory)");
        let batch = memory.dims()[0];
        let (k, v) = self.project_kv(memory, batch);
        MemoryKv {
            keys: self.key_heads(k),
            values: self.split_heads(v, self.n_kv_heads),
        }
    }

    /// Cross-attention from `x` `[B, Tq, d_model]` to keys and values computed once by
    /// [`memory_kv`](Self::memory_kv), under `mask` (`[B, H, Tq, Tk]`-broadcastable, e.g.
    /// the memory's padding): [`cross_attention`](Self::cross_attention) without
    /// projecting the memory again. Dropout does not act.
    ///
    /// # Panics
    /// If `x` has the wrong width, or another batch or device than the memory, if the
    /// memory's keys and values are of other heads or head width than the module's, if
    /// `mask` does not broadcast to `[B, H, Tq, Tk]`, if both the module and the mask have
    /// sinks, or if the module has positions (see [`MultiHeadAttentionConfig::positions`]).
    pub fn cross_attention_cached(
        &self,
        x: Tensor<3>,
        memory: &MemoryKv,
        mask: AttentionMask,
    ) -> Tensor<3> {
        self.cross_cached(x, memory, mask, AttentionWeights::None, None)
            .context
    }

    /// [`cross_attention_cached`](Self::cross_attention_cached) with the weights when
    /// asked for and each head's output scaled by its weight in `head_mask` `[H]`.
    pub(crate) fn cross_cached(
        &self,
        x: Tensor<3>,
        memory: &MemoryKv,
        mask: AttentionMask,
        weights: AttentionWeights,
        head_mask: Option<Tensor<1>>,
    ) -> MhaOutput {
        self.refuse_positions("MultiHeadAttention::cross_attention_cached(x, memory, mask)");
        let [batch, _, _] = x.dims();
        let memory_batch = memory.keys.dims()[0];
        assert_eq!(
            batch, memory_batch,
            "MultiHeadAttention: the query's batch is {batch}, the memory's {memory_batch}"
        );
        let (at, device) = (memory.keys.device(), x.device());
        assert!(
            at == device,
            "MultiHeadAttention: the memory's keys and values are on {at:?} and the query on \
             {device:?}"
        );
        let [_, heads, _, head_dim] = memory.keys_dims();
        assert!(
            [heads, head_dim] == [self.n_kv_heads, self.head_dim],
            "MultiHeadAttention: the memory's keys and values are {heads} heads {head_dim} \
             wide and the module's {} heads {} wide (MemoryKv of another module)",
            self.n_kv_heads,
            self.head_dim
        );
        let q = self.project_q(x);
        let q = self.query_heads(q);
        let (k, v) = (memory.keys.clone(), memory.values.clone());
        self.attend(Heads::Split([q, k, v]), &mask, weights, 0.0, head_mask)
    }

    /// Panics as a cached self-attention call over `x` `[B, T, d_model]` under `mask` with
    /// `cache` would, before anything is written: a mask that does not fit the keys the
    /// call sees, sinks given twice (a stack checks every layer's before the first writes).
    pub(crate) fn check_cached_call(&self, x: &Tensor<3>, cache: &KvCache, mask: &AttentionMask) {
        self.check_position_table();
        let [batch, tokens, _] = x.dims();
        mask.check(
            [batch, self.n_heads, tokens, cache.keys_seen(tokens)],
            &x.device(),
        );
        self.check_attend(mask, None);
        assert!(
            !self.adds_position_bias() || mask.position().is_none(),
            "MultiHeadAttention: the module adds a position bias of its own ({:?}) and the \
             mask has one too (AttentionMask::position_bias); give one of the two",
            self.positions
        );
    }

    /// Panics, naming them, when the module's positions take a learned table and it has
    /// none (its `positions` field set by hand): it would attend with no position bias at
    /// all, wrong numbers without a word.
    fn check_position_table(&self) {
        if self.positions.buckets().is_some() && self.position_table.is_none() {
            panic!(
                "MultiHeadAttention: positions {:?} take a learned table, and the module has \
                 none (position_table is None): build it with \
                 MultiHeadAttentionConfig::with_positions rather than setting its positions \
                 field",
                self.positions
            );
        }
    }

    /// Whether the module adds a position bias to the mask it is called with (ALiBi, or a
    /// learned table of buckets).
    fn adds_position_bias(&self) -> bool {
        match &self.positions {
            Positions::Alibi => true,
            positions => positions.buckets().is_some() && self.position_table.is_some(),
        }
    }

    /// Panics, naming them, when the head mask does not have a weight per head, or when
    /// both the module and the mask have attention sinks: what [`attend`](Self::attend)
    /// refuses, checked again before a cached call writes.
    pub(crate) fn check_attend(&self, mask: &AttentionMask, head_mask: Option<&Tensor<1>>) {
        if let Some(head_mask) = head_mask {
            let heads = head_mask.dims()[0];
            assert_eq!(
                heads, self.n_heads,
                "MultiHeadAttention: the head mask has {heads} weights for {} heads",
                self.n_heads
            );
            let (at, device) = (head_mask.device(), self.device());
            assert!(
                at == device,
                "MultiHeadAttention: the head mask is on {at:?} and the module on {device:?}"
            );
        }
        assert!(
            self.sinks.is_none() || mask.sink_logits().is_none(),
            "MultiHeadAttention: the module has attention sinks of its own ({}) and the mask \
             has sinks too (AttentionMask::sinks); give one of the two",
            match self.quiet_softmax {
                true => "`quiet_softmax`: fixed at 0",
                false => "`sinks`",
            }
        );
    }

    /// Attention of the heads (`q` `[B, H, Tq, Dh]`, `k`, `v` `[B, Hkv, Tk, Dh]`, or
    /// packed), each head's output scaled by its weight in `head_mask` `[H]`, heads
    /// merged and projected out.
    fn attend(
        &self,
        heads: Heads,
        mask: &AttentionMask,
        weights: AttentionWeights,
        dropout: f64,
        head_mask: Option<Tensor<1>>,
    ) -> MhaOutput {
        self.check_attend(mask, head_mask.as_ref());
        let (batch, queries) = heads.batch_and_queries();
        let with_sinks;
        let mask = match self.sink_logits() {
            Some(sinks) => {
                with_sinks = mask.clone().and(AttentionMask::sinks(sinks));
                &with_sinks
            }
            None => mask,
        };
        let options = SdpaOptions {
            scale: Some(self.scale),
            dropout,
            weights,
            softcap: self.softcap,
        };
        let (context, weights) = match heads {
            Heads::Split([q, k, v]) => {
                let out = scaled_dot_product_attention(q, k, v, mask, options);
                (out.context, out.weights)
            }
            #[cfg(feature = "gpu-kernels")]
            Heads::Packed(qkv, packed) => {
                // What scaled_dot_product_attention checks of the mask and the options.
                let scores = [batch, self.n_heads, queries, queries];
                let d_k = self.head_dim;
                let device = qkv.device();
                let scores = crate::attention::checked_scores(&options, mask, scores, d_k, &device);
                let context = crate::gpu::packed_attention(qkv, packed, mask, scores);
                (context, None)
            }
        };
        let context = match head_mask {
            Some(m) => {
                let m = m.cast(context.dtype()).reshape([1, self.n_heads, 1, 1]);
                context * m // [B, H, Tq, Dh]
            }
            None => context,
        };
        let context =
            context
                .swap_dims(1, 2)
                .reshape([batch, queries, self.n_heads * self.head_dim]); // [B, Tq, H·Dh]
        MhaOutput {
            context: crate::ops::linear::forward(&self.out_proj, context),
            weights,
        }
    }

    /// The heads of self-attention of `query` under `mask` (its positions' bias not yet
    /// in it) when they can stay packed: the input projection is packed, nothing changes
    /// the queries or keys once projected (RoPE, `q_norm`, `k_norm`), the call takes the
    /// GPU kernels, which read the three as views of the whole projection's output, and
    /// the device binds that output whole to a kernel.
    #[cfg(feature = "gpu-kernels")]
    fn packed_heads(
        &self,
        query: &Tensor<3>,
        mask: &AttentionMask,
        weights: AttentionWeights,
        dropout: f64,
    ) -> Option<crate::gpu::Packed> {
        let packed_projection = matches!(self.in_proj, InputProjection::Packed(_));
        let rope = matches!(self.positions, Positions::Rope { .. });
        let norms = self.q_norm.is_some() || self.k_norm.is_some();
        if !packed_projection || rope || norms || query.dims()[2] != self.d_model() {
            return None;
        }
        let packed = crate::gpu::Packed {
            heads: self.n_heads,
            kv_heads: self.n_kv_heads,
            head_dim: self.head_dim,
        };
        let [batch, len, _] = query.dims();
        let width = (self.n_heads + 2 * self.n_kv_heads) * self.head_dim;
        let bytes = (batch * len * width * query.dtype().size()) as u64;
        if bytes > crate::dispatch::gpu_largest_binding(&query.device()) {
            return None;
        }
        let mask = self.position_bias(mask.clone());
        let mask = match self.sink_logits() {
            Some(sinks) if mask.sink_logits().is_none() => mask.and(AttentionMask::sinks(sinks)),
            _ => mask,
        };
        let keeps_weights = weights != AttentionWeights::None || dropout > 0.0;
        let call = crate::dispatch::AttentionCall::over(
            &query.device(),
            packed.dims(batch, len),
            [query.dtype(); 3],
            &mask,
            keeps_weights,
        );
        let path = crate::dispatch::attention(call);
        matches!(path, crate::dispatch::AttentionPath::Gpu).then_some(packed)
    }

    /// Self-attention of `x` `[B, T, d_model]` under `mask`; returns `[B, T, d_model]`.
    ///
    /// # Panics
    /// As [`forward`](Self::forward).
    pub fn self_attention(&self, x: Tensor<3>, mask: AttentionMask) -> Tensor<3> {
        self.forward(MhaInput::self_attn(x).mask(mask)).context
    }

    /// Causal self-attention of `x` `[B, T, d_model]`; returns `[B, T, d_model]`.
    ///
    /// # Panics
    /// As [`forward`](Self::forward).
    pub fn causal_self_attention(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward(MhaInput::causal(x)).context
    }

    /// Cross-attention from `x` `[B, Tq, d_model]` to `context` `[B, Tk, kdim]` under
    /// `mask`; returns `[B, Tq, d_model]`.
    ///
    /// # Panics
    /// As [`forward`](Self::forward); a module with positions refuses it.
    pub fn cross_attention(
        &self,
        x: Tensor<3>,
        context: Tensor<3>,
        mask: AttentionMask,
    ) -> Tensor<3> {
        self.refuse_positions("MultiHeadAttention::cross_attention(x, context, mask)");
        self.forward(MhaInput::cross(x, context).mask(mask)).context
    }

    /// The sinks' logits attention adds to its mask, if the module has sinks: Burn's quiet
    /// softmax's are zeros whatever the parameter holds (a module unfrozen whole, or a
    /// record of learned sinks loaded into it, would change them), in its dtype.
    fn sink_logits(&self) -> Option<Tensor<1>> {
        let sinks = crate::dtype::float_value(self.sinks.as_ref()?.val());
        Some(match self.quiet_softmax {
            true => sinks.zeros_like(),
            false => sinks,
        })
    }

    /// The device of the module's parameters (its output projection's), read without
    /// computing the weight (`val` would materialize a LoRA adapter's product at every
    /// check).
    fn device(&self) -> Device {
        self.out_proj.weight.lazy_device()
    }

    /// Projects the inputs to Q `[B, Tq, H·Dh]`, K and V `[B, Tk, Hkv·Dh]`.
    fn project(&self, query: Tensor<3>, source: Source) -> (Tensor<3>, Tensor<3>, Tensor<3>) {
        let d_model = self.d_model();
        let [batch, _, _] = query.dims();
        check_input("query", &query, batch, d_model, &self.device());
        let q_width = self.n_heads * self.head_dim;
        let kv_width = self.n_kv_heads * self.head_dim;
        match (&self.in_proj, source) {
            (InputProjection::Packed(proj), Source::SelfAttention) => (
                linear_columns(proj, query.clone(), 0, q_width),
                linear_columns(proj, query.clone(), q_width, kv_width),
                linear_columns(proj, query, q_width + kv_width, kv_width),
            ),
            (InputProjection::Packed(proj), Source::Context(context)) => {
                let (k, v) = self.project_kv(context, batch);
                (linear_columns(proj, query, 0, q_width), k, v)
            }
            (InputProjection::Packed(proj), Source::KeyValue(key, value)) => {
                check_input("key", &key, batch, d_model, &self.device());
                check_input("value", &value, batch, d_model, &self.device());
                check_same_len(&key, &value);
                (
                    linear_columns(proj, query, 0, q_width),
                    linear_columns(proj, key, q_width, kv_width),
                    linear_columns(proj, value, q_width + kv_width, kv_width),
                )
            }
            (InputProjection::Separate(proj), source) => {
                let (key, value) = match source {
                    Source::SelfAttention => {
                        self.check_one_source("self-attention");
                        (query.clone(), query.clone())
                    }
                    Source::Context(context) => {
                        self.check_one_source("MhaInput::cross(x, context)");
                        (context.clone(), context)
                    }
                    Source::KeyValue(key, value) => (key, value),
                };
                check_input("key", &key, batch, self.kdim, &self.device());
                check_input("value", &value, batch, self.vdim, &self.device());
                check_same_len(&key, &value);
                (
                    crate::ops::linear::forward(&proj.q_proj, query),
                    crate::ops::linear::forward(&proj.k_proj, key),
                    crate::ops::linear::forward(&proj.v_proj, value),
                )
            }
        }
    }

    /// Q `[B, Tq, H·Dh]` alone.
    fn project_q(&self, query: Tensor<3>) -> Tensor<3> {
        let batch = query.dims()[0];
        check_input("query", &query, batch, self.d_model(), &self.device());
        match &self.in_proj {
            InputProjection::Packed(proj) => {
                linear_columns(proj, query, 0, self.n_heads * self.head_dim)
            }
            InputProjection::Separate(proj) => crate::ops::linear::forward(&proj.q_proj, query),
        }
    }

    /// K and V `[B, Tk, Hkv·Dh]` of one context (keys = values).
    fn project_kv(&self, context: Tensor<3>, batch: usize) -> (Tensor<3>, Tensor<3>) {
        let kv_width = self.n_kv_heads * self.head_dim;
        match &self.in_proj {
            InputProjection::Packed(proj) => {
                check_input("context", &context, batch, self.d_model(), &self.device());
                let q_width = self.n_heads * self.head_dim;
                let kv = linear_columns(proj, context, q_width, 2 * kv_width); // [B, Tk, 2·Hkv·Dh]
                (
                    crate::empty::narrow(kv.clone(), 2, 0, kv_width),
                    crate::empty::narrow(kv, 2, kv_width, kv_width),
                )
            }
            InputProjection::Separate(proj) => {
                self.check_one_source("MultiHeadAttention::memory_kv(memory)");
                check_input("key", &context, batch, self.kdim, &self.device());
                check_input("value", &context, batch, self.vdim, &self.device());
                (
                    crate::ops::linear::forward(&proj.k_proj, context.clone()),
                    crate::ops::linear::forward(&proj.v_proj, context),
                )
            }
        }
    }

    /// Queries and keys of self-attention, and its mask, with the positions applied: RoPE
    /// rotates the queries (at `offsets[0] + i`) and the keys (at `offsets[1] + j`),
    /// restarting at each packed sequence; ALiBi and the learned relative biases join the
    /// mask as a bias by position, which follows the mask's alignment where the mask
    /// places keys by position, else the call's own positions (a cache's, when decoding).
    ///
    /// # Shapes
    /// - `q`: `[B, H, Tq, Dh]`, `k`: `[B, Hkv, Tk, Dh]`
    fn positioned(
        &self,
        q: Tensor<4>,
        k: Tensor<4>,
        mask: AttentionMask,
        [q_offset, k_offset]: [usize; 2],
    ) -> (Tensor<4>, Tensor<4>, AttentionMask) {
        match &self.positions {
            Positions::Rope { theta, layout } => {
                let rope = Rope {
                    theta: *theta,
                    layout: *layout,
                    head_dim: self.head_dim,
                };
                let [batch, heads, queries, _] = q.dims();
                let keys = k.dims()[2];
                if mask.rule().packed.is_some() {
                    // The positions restart at each packed sequence: its rows must fit.
                    mask.check([batch, heads, queries, keys], &q.device());
                }
                let q = rope.apply(q, &token_positions(&mask, q_offset, queries));
                let k = rope.apply(k, &token_positions(&mask, k_offset, keys));
                (q, k, mask)
            }
            _ => (q, k, self.position_bias(mask)),
        }
    }

    /// `mask` with the bias by position of ALiBi or the learned relative biases, if the
    /// module has one (RoPE's positions turn the queries and keys instead).
    fn position_bias(&self, mask: AttentionMask) -> AttentionMask {
        // The bias places keys by the call's positions (the cache's, in a cached call),
        // not by the alignment of a mask that placed nothing by position.
        match &self.positions {
            Positions::Alibi => {
                let slopes = match &self.pruned_from {
                    Some(from) => {
                        let all = alibi_slopes(from.heads);
                        from.kept.iter().map(|&h| all[h]).collect()
                    }
                    None => alibi_slopes(self.n_heads),
                };
                let bias = AttentionMask::position_bias(PositionBias::Alibi { slopes });
                mask.without_idle_alignment().and(bias)
            }
            positions => match (positions.buckets(), &self.position_table) {
                (Some(buckets), Some(table)) => {
                    let table = crate::dtype::float_value(table.val());
                    let bias =
                        AttentionMask::position_bias(PositionBias::Learned { table, buckets });
                    mask.without_idle_alignment().and(bias)
                }
                (Some(_), None) => {
                    self.check_position_table();
                    mask
                }
                _ => mask,
            },
        }
    }

    /// Panics, naming the positions and `call`, when the module has positions: `call`
    /// attends to another sequence, where they have no meaning of their own.
    pub(crate) fn refuse_positions(&self, call: &str) {
        if self.positions != Positions::None {
            panic!(
                "MultiHeadAttention: {call} attends to another sequence, and this module's \
                 positions ({:?}) apply to self-attention only. For self-attention call \
                 MhaInput::self_attn(x) or MhaInput::causal(x) (PyTorch's mha(x, x, x)); for \
                 cross-attention configure the module with Positions::None, as DecoderBlock \
                 does (Hugging Face's cross-attention has none: T5's no relative bias, \
                 Moonshine's no RoPE)",
                self.positions
            );
        }
    }

    /// Panics naming `call` where one tensor is to be the keys and the values (and, where
    /// `call` is `"self-attention"`, the queries) and this module's `kdim` and `vdim` make
    /// that impossible, before a width check names an input the caller did not pass.
    pub(crate) fn check_one_source(&self, call: &str) {
        let d_model = self.d_model();
        let (kdim, vdim) = (self.kdim, self.vdim);
        let self_attention = call == "self-attention";
        if self_attention && (kdim, vdim) != (d_model, d_model) {
            panic!(
                "MultiHeadAttention: self-attention takes x as the queries, keys and values, \
                 and this module's keys are kdim = {kdim} wide and its values vdim = {vdim}, \
                 not d_model = {d_model}: pass them with MhaInput::new(query, key, value)"
            );
        }
        if !self_attention && kdim != vdim {
            panic!(
                "MultiHeadAttention: {call} takes one tensor as the keys and the values, and \
                 this module's keys are kdim = {kdim} wide and its values vdim = {vdim}: pass \
                 them with MhaInput::new(query, key, value)"
            );
        }
    }

    /// Queries `[B, T, H·Dh]` as heads `[B, H, T, Dh]`, each normalised by `q_norm`.
    fn query_heads(&self, q: Tensor<3>) -> Tensor<4> {
        let q = self.split_heads(q, self.n_heads);
        match &self.q_norm {
            Some(norm) => norm.forward(q),
            None => q,
        }
    }

    /// Keys `[B, T, Hkv·Dh]` as heads `[B, Hkv, T, Dh]`, each normalised by `k_norm`.
    fn key_heads(&self, k: Tensor<3>) -> Tensor<4> {
        let k = self.split_heads(k, self.n_kv_heads);
        match &self.k_norm {
            Some(norm) => norm.forward(k),
            None => k,
        }
    }

    /// `[B, T, heads·Dh]` -> `[B, heads, T, Dh]`.
    fn split_heads(&self, x: Tensor<3>, heads: usize) -> Tensor<4> {
        let [batch, len, _] = x.dims();
        x.reshape([batch, len, heads, self.head_dim])
            .swap_dims(1, 2)
    }
}

/// The heads an attention call of the module runs over.
// Moved once into `attend` per call: boxing the larger variant would buy nothing.
#[allow(clippy::large_enum_variant)]
enum Heads {
    /// The query `[B, H, Tq, Dh]`, key and value `[B, Hkv, Tk, Dh]`.
    Split([Tensor<4>; 3]),
    /// Self-attention's query, key and value side by side in the packed input
    /// projection's output `[B, T, (H + 2·Hkv)·Dh]`.
    #[cfg(feature = "gpu-kernels")]
    Packed(Tensor<3>, crate::gpu::Packed),
}

impl Heads {
    /// The batch size and the number of queries.
    fn batch_and_queries(&self) -> (usize, usize) {
        match self {
            Heads::Split([q, _, _]) => {
                let [batch, _, queries, _] = q.dims();
                (batch, queries)
            }
            #[cfg(feature = "gpu-kernels")]
            Heads::Packed(qkv, _) => {
                let [batch, len, _] = qkv.dims();
                (batch, len)
            }
        }
    }
}

/// The position of each of `len` tokens starting at `offset`, one row for all the batch, or
/// one per batch row restarting at each of its packed sequences.
fn token_positions(mask: &AttentionMask, offset: usize, len: usize) -> Vec<Vec<usize>> {
    match &mask.rule().packed {
        None => vec![(offset..offset + len).collect()],
        Some(rows) => rows
            .iter()
            .map(|cumulative| {
                (0..len)
                    .map(|t| {
                        let start = cumulative.partition_point(|&s| s <= t).saturating_sub(1);
                        offset + t - cumulative[start].min(t)
                    })
                    .collect()
            })
            .collect(),
    }
}

/// `x W[:, start..start+len] + b[start..start+len]`: one block of a packed projection.
fn linear_columns(proj: &Linear, x: Tensor<3>, start: usize, len: usize) -> Tensor<3> {
    let bias = proj.bias.as_ref().map(|b| b.val());
    crate::ops::linear::columns(x, proj.weight.val(), bias, Some([start, len]))
}

/// Checks that input `name` is `[batch, T, width]` and on the module's `device`.
fn check_input(name: &str, x: &Tensor<3>, batch: usize, width: usize, device: &Device) {
    let dims = x.dims();
    assert!(
        dims[0] == batch && dims[2] == width,
        "MultiHeadAttention: expected {name} of shape [B = {batch}, T, {width}], got {dims:?}"
    );
    let at = x.device();
    assert!(
        at == *device,
        "MultiHeadAttention: the {name} is on {at:?} and the module on {device:?}"
    );
}

fn check_same_len(key: &Tensor<3>, value: &Tensor<3>) {
    assert!(
        key.dims()[1] == value.dims()[1],
        "MultiHeadAttention: key {:?} and value {:?} have different lengths",
        key.dims(),
        value.dims()
    );
}
