//! The configurations of [`EncoderBlock`] and [`DecoderBlock`]. Their hyperparameters
//! are declared once (`block_config!`), and what both blocks build from them (the
//! attentions, the feed-forward, the norms, the dropouts) is built once, by `Parts`.

use burn::nn::{Dropout, DropoutConfig, LayerNormConfig, LinearConfig};
use burn::tensor::Device;

use super::{DecoderBlock, EncoderBlock, FeedForward, FeedForwardActivation};
use crate::error::{Check, ConfigError};
use crate::mha::{MultiHeadAttention, MultiHeadAttentionConfig};
use crate::norm::{LayerNorm, NormKind};
use crate::positions::Positions;

/// A block configuration: the hyperparameters both blocks share, then `$own` fields.
macro_rules! block_config {
    ($(#[$doc:meta])* $name:ident { $($own:tt)* }) => {
        crate::configs::config! {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name {
            /// Model width.
            pub d_model: usize,
            /// Attention heads.
            pub n_heads: usize,
            ;
            /// Key/value heads (GQA). Default: `n_heads`.
            pub n_kv_heads: Option<usize> = None => with_n_kv_heads,
            /// Head width, when the heads together are not `d_model` wide (see
            /// [`MultiHeadAttentionConfig::head_dim`]). Default: `d_model / n_heads`.
            pub head_dim: Option<usize> = None => with_head_dim,
            /// Hidden width of the feed-forward. Default: `4 · d_model`.
            pub d_ff: Option<usize> = None => with_d_ff,
            /// Dropout on attention weights, the feed-forward hidden layer and each
            /// residual branch, in training only. Default: 0.1, as PyTorch.
            pub dropout: f64 = 0.1 => with_dropout,
            /// Feed-forward activation. Default: GELU.
            pub activation: FeedForwardActivation = FeedForwardActivation::Gelu
                => with_activation,
            /// A gated feed-forward (`linear2(activation(linear1(x)) · up(x))`, SwiGLU
            /// with SiLU: Llama's MLP) instead of PyTorch's two layers. Default: false.
            pub gated: bool = false => with_gated,
            /// Pre-norm (`x + f(norm(x))`, PyTorch's `norm_first=True`) when true,
            /// post-norm (`norm(x + f(x))`) when false. Default: true.
            pub norm_first: bool = true => with_norm_first,
            /// The norms' kind: layer normalisation, or RMS normalisation (Llama's
            /// `RMSNorm`, which has no shift whatever `bias` says). Default: layer.
            pub norm: NormKind = NormKind::Layer => with_norm,
            /// The norms' epsilon (Hugging Face's `layer_norm_eps` or `rms_norm_eps`).
            /// Default: 1e-5.
            pub layer_norm_eps: f64 = 1e-5 => with_layer_norm_eps,
            /// Bias in the linear layers and LayerNorms. Default: true.
            pub bias: bool = true => with_bias,
            /// Bias in the attention's query, key and value projections, when it differs
            /// from `bias` (Qwen2: yes, in a model without other biases). Default: `bias`.
            pub attention_bias: Option<bool> = None => with_attention_bias,
            /// Bias in the attention's output projection, when it differs from the other
            /// projections' (Qwen2: no). Default: as the query, key and value's.
            pub attention_out_bias: Option<bool> = None => with_attention_out_bias,
            /// QK-norm in the self-attention: an RMS norm of each query and key head with
            /// this epsilon, before RoPE (Qwen3's). Default: none.
            pub qk_norm_eps: Option<f64> = None => with_qk_norm_eps,
            /// Attention sinks in the self-attention: a learned logit per head that joins
            /// every row's softmax without a value (gpt-oss's; see
            /// [`MultiHeadAttentionConfig::sinks`]). Default: false.
            pub attention_sinks: bool = false => with_attention_sinks,
            /// Multiplies the attention's `Q Kᵀ`, in the self- and the cross-attention
            /// (GPT-2's `scale_attn_weights: false` is 1). Default: `1 / sqrt(head_dim)`.
            pub attention_scale: Option<f64> = None => with_attention_scale,
            /// Logit soft-capping in the self- and the cross-attention: the scaled scores
            /// become `cap · tanh(s / cap)` (Gemma 2's `attn_logit_softcapping`, 50; see
            /// [`MultiHeadAttentionConfig::softcap`]). Default: none.
            pub attention_softcap: Option<f64> = None => with_attention_softcap,
            $($own)*
        }
        }

        impl $name {
            /// PyTorch's defaults for its layer of `d_model` and `n_heads`
            /// (`nn.TransformerEncoderLayer(d_model, nhead)`, and the decoder's): a
            /// feed-forward 2048 wide, ReLU, post-norm, dropout 0.1, epsilon 1e-5, biases.
            /// ([`new`](Self::new)'s defaults are a modern block's: `4 · d_model`, GELU,
            /// pre-norm.) A layer's settings leave no trace in its weights: build the one
            /// that was trained, then load it.
            pub fn pytorch(d_model: usize, n_heads: usize) -> Self {
                Self::new(d_model, n_heads)
                    .with_d_ff(Some(2048))
                    .with_activation(FeedForwardActivation::Relu)
                    .with_norm_first(false)
            }

            /// The hyperparameters both blocks share.
            fn parts(&self) -> Parts {
                Parts {
                    d_model: self.d_model,
                    n_heads: self.n_heads,
                    n_kv_heads: self.n_kv_heads,
                    head_dim: self.head_dim,
                    d_ff: self.d_ff.unwrap_or(self.d_model.saturating_mul(4)),
                    d_ff_given: self.d_ff.is_some(),
                    dropout: self.dropout,
                    activation: self.activation,
                    gated: self.gated,
                    norm_first: self.norm_first,
                    norm: self.norm,
                    layer_norm_eps: self.layer_norm_eps,
                    bias: self.bias,
                    attention_bias: self.attention_bias.unwrap_or(self.bias),
                    attention_out_bias: self.attention_out_bias,
                    qk_norm_eps: self.qk_norm_eps,
                    attention_sinks: self.attention_sinks,
                    attention_scale: self.attention_scale,
                    attention_softcap: self.attention_softcap,
                }
            }

            /// A stack's norm after its last block of these, where `wanted` asks for one;
            /// by default where they are pre-norm (they leave the residual stream
            /// un-normalised).
            pub(crate) fn final_norm(
                &self,
                wanted: Option<bool>,
                device: &Device,
            ) -> Option<LayerNorm> {
                let parts = self.parts();
                wanted.unwrap_or(parts.norm_first).then(|| parts.norm(device))
            }
        }
    };
}

block_config!(
    /// Configuration of [`EncoderBlock`].
    EncoderBlockConfig {
        /// Whether the self-attention is causal. Default: false.
        pub causal: bool = false => with_causal,
        /// A causal block's sliding window: each token attends to the last `window`
        /// tokens, itself included (Mistral's `sliding_window`); decode it with
        /// [`KvCache::sliding`](crate::KvCache::sliding). Default: none.
        pub window: Option<usize> = None => with_window,
        /// How the self-attention knows where tokens are (see [`Positions`]); a stack
        /// adds absolute positions to its input once. Default: none.
        pub positions: Positions = Positions::None => with_positions,
    }
);

block_config!(
    /// Configuration of [`DecoderBlock`].
    DecoderBlockConfig {
        /// Whether the self-attention is causal (PyTorch's decoder layer called with a
        /// causal `tgt_mask`, as every autoregressive decoder is; `tgt_is_causal=True`
        /// only hints that the mask is causal). A decoder block that is not (DETR's object queries, non-autoregressive
        /// decoding: `tgt_mask=None`) attends to every position and cannot decode through
        /// a cache. Default: true.
        pub causal: bool = true => with_causal,
        /// How the self-attention knows where tokens are (see [`Positions`]; the
        /// cross-attention reads the memory as it is); a stack adds absolute positions to
        /// its input once. Default: none.
        pub positions: Positions = Positions::None => with_positions,
    }
);

/// The hyperparameters both block configurations share, and what they build.
#[derive(Clone, Copy, Debug)]
struct Parts {
    d_model: usize,
    n_heads: usize,
    n_kv_heads: Option<usize>,
    head_dim: Option<usize>,
    d_ff: usize,
    /// Whether `d_ff` was given (else it is 4 `d_model`, saturated).
    d_ff_given: bool,
    dropout: f64,
    activation: FeedForwardActivation,
    gated: bool,
    norm_first: bool,
    norm: NormKind,
    layer_norm_eps: f64,
    bias: bool,
    attention_bias: bool,
    attention_out_bias: Option<bool>,
    qk_norm_eps: Option<f64>,
    attention_sinks: bool,
    attention_scale: Option<f64>,
    attention_softcap: Option<f64>,
}

/// `err` of a block's attention as the block's `config` names it: the same fields, but
/// the sinks (`attention_sinks`), the scale (`attention_scale`) and the soft cap
/// (`attention_softcap`).
fn of_block(config: &'static str, err: ConfigError) -> ConfigError {
    let field = match err.field {
        "sinks" => "attention_sinks",
        "scale" => "attention_scale",
        "softcap" => "attention_softcap",
        field => field,
    };
    ConfigError {
        config,
        field,
        ..err
    }
}

impl Parts {
    fn validate(&self, config: &'static str) -> Result<(), ConfigError> {
        let check = Check(config);
        // `d_model` first: `d_ff` defaults to 4 of it.
        check.nonzero("d_model", self.d_model)?;
        check.nonzero("n_heads", self.n_heads)?;
        check.nonzero("d_ff", self.d_ff)?;
        if !self.d_ff_given && self.d_model.checked_mul(4).is_none() {
            return Err(ConfigError {
                config,
                field: "d_model",
                message: format!(
                    "{} is too large: the feed-forward's width, 4 d_model (d_ff, unset), \
                     overflows a usize",
                    self.d_model
                ),
            });
        }
        let factors = [
            ("d_model", self.d_model as u128),
            ("d_ff", self.d_ff as u128),
        ];
        check.fits("d_ff", &factors)?;
        check.probability("dropout", self.dropout)?;
        check.positive_f32("layer_norm_eps", self.layer_norm_eps)
    }

    /// The self-attention: these hyperparameters, `positions`, the QK-norm and the sinks;
    /// an error names the block's `config` and field.
    fn self_attention(
        &self,
        config: &'static str,
        positions: Positions,
        device: &Device,
    ) -> Result<MultiHeadAttention, ConfigError> {
        self.attention(positions)
            .with_qk_norm_eps(self.qk_norm_eps)
            .with_sinks(self.attention_sinks)
            .try_init(device)
            .map_err(|err| of_block(config, err))
    }

    /// The cross-attention: these hyperparameters, no positions; an error names the
    /// block's `config` and field.
    fn cross_attention(
        &self,
        config: &'static str,
        device: &Device,
    ) -> Result<MultiHeadAttention, ConfigError> {
        self.attention(Positions::None)
            .try_init(device)
            .map_err(|err| of_block(config, err))
    }

    fn attention(&self, positions: Positions) -> MultiHeadAttentionConfig {
        MultiHeadAttentionConfig::new(self.d_model, self.n_heads)
            .with_n_kv_heads(self.n_kv_heads)
            .with_head_dim(self.head_dim)
            .with_bias(self.attention_bias)
            .with_out_bias(self.attention_out_bias)
            .with_dropout(self.dropout)
            .with_scale(self.attention_scale)
            .with_softcap(self.attention_softcap)
            .with_positions(positions)
    }

    fn norm(&self, device: &Device) -> LayerNorm {
        match self.norm {
            NormKind::Layer => {
                let config = LayerNormConfig::new(self.d_model)
                    .with_epsilon(self.layer_norm_eps)
                    .with_bias(self.bias);
                LayerNorm::new(&config, device)
            }
            NormKind::Rms => LayerNorm::rms(self.d_model, self.layer_norm_eps, device),
        }
    }

    fn dropout(&self) -> Dropout {
        DropoutConfig::new(self.dropout).init()
    }

    fn feed_forward(&self, device: &Device) -> FeedForward {
        let linear = |d_in, d_out| {
            LinearConfig::new(d_in, d_out)
                .with_bias(self.bias)
                .init(device)
        };
        FeedForward {
            linear1: linear(self.d_model, self.d_ff),
            activation: self.activation,
            up: self.gated.then(|| linear(self.d_model, self.d_ff)),
            dropout: self.dropout(),
            linear2: linear(self.d_ff, self.d_model),
        }
    }
}

impl EncoderBlockConfig {
    /// Builds an [`EncoderBlock`].
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field and values (see
    /// [`MultiHeadAttentionConfig::try_init`], and `d_ff`, `dropout`, `layer_norm_eps`,
    /// a `window` of 0 or on a block that is not causal).
    pub fn try_init(&self, device: &Device) -> Result<EncoderBlock, ConfigError> {
        const CONFIG: &str = "EncoderBlockConfig";
        let parts = self.parts();
        parts.validate(CONFIG)?;
        if let Some(window) = self.window {
            let check = Check(CONFIG);
            check.nonzero("window", window)?;
            if !self.causal {
                return Err(ConfigError {
                    config: CONFIG,
                    field: "window",
                    message: format!(
                        "a sliding window of {window} slides over the tokens before each one: \
                         the block must be causal"
                    ),
                });
            }
        }
        Ok(EncoderBlock {
            self_attn: parts.self_attention(CONFIG, self.positions.clone(), device)?,
            feed_forward: parts.feed_forward(device),
            norm1: parts.norm(device),
            norm2: parts.norm(device),
            dropout1: parts.dropout(),
            dropout2: parts.dropout(),
            norm_first: self.norm_first,
            causal: self.causal,
            window: self.window,
        })
    }

    /// Builds an [`EncoderBlock`].
    ///
    /// # Panics
    /// With the message of [`try_init`](Self::try_init)'s error.
    pub fn init(&self, device: &Device) -> EncoderBlock {
        self.try_init(device).unwrap_or_else(|err| panic!("{err}"))
    }
}

impl DecoderBlockConfig {
    /// Builds a [`DecoderBlock`].
    ///
    /// # Errors
    /// As [`EncoderBlockConfig::try_init`].
    pub fn try_init(&self, device: &Device) -> Result<DecoderBlock, ConfigError> {
        const CONFIG: &str = "DecoderBlockConfig";
        let parts = self.parts();
        parts.validate(CONFIG)?;
        Ok(DecoderBlock {
            self_attn: parts.self_attention(CONFIG, self.positions.clone(), device)?,
            cross_attn: parts.cross_attention(CONFIG, device)?,
            feed_forward: parts.feed_forward(device),
            norm1: parts.norm(device),
            norm2: parts.norm(device),
            norm3: parts.norm(device),
            dropout1: parts.dropout(),
            dropout2: parts.dropout(),
            dropout3: parts.dropout(),
            norm_first: self.norm_first,
            causal: self.causal,
        })
    }

    /// Builds a [`DecoderBlock`].
    ///
    /// # Panics
    /// With the message of [`try_init`](Self::try_init)'s error.
    pub fn init(&self, device: &Device) -> DecoderBlock {
        self.try_init(device).unwrap_or_else(|err| panic!("{err}"))
    }
}
