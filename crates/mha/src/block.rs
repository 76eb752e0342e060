//! Transformer blocks: an encoder block (self-attention, feed-forward) and a decoder
//! block (causal self-attention, cross-attention, feed-forward), each with residuals,
//! LayerNorm (pre-norm by default, post-norm as an option) and dropout where PyTorch's
//! `nn.TransformerEncoderLayer` / `nn.TransformerDecoderLayer` put it, so weights import
//! one to one.

use burn::config::Config;
use burn::module::Module;
use burn::nn::{Dropout, DropoutConfig, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::{Device, Tensor};

use crate::analysis::{Heads, Inspect, Inspected};
use crate::attention::AttentionWeights;
use crate::cache::{KvCache, MemoryKv};
use crate::error::{CacheError, Check, ConfigError};
use crate::mask::AttentionMask;
use crate::mha::{MhaInput, MultiHeadAttention, MultiHeadAttentionConfig};
use crate::norm::LayerNorm;
use crate::positions::Positions;

/// The feed-forward activation.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum FeedForwardActivation {
    /// Exact (erf) GELU, PyTorch's `"gelu"`.
    Gelu,
    /// ReLU, PyTorch's `"relu"` (its default).
    Relu,
}

impl FeedForwardActivation {
    /// Applies the activation.
    ///
    /// GELU is exact on every backend, values and gradient: one operation with a backward
    /// of its own on flex and ndarray in f32, written with `erf` elsewhere (see
    /// `activation.rs`).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        match self {
            Self::Gelu => crate::activation::gelu(x),
            Self::Relu => burn::tensor::activation::relu(x),
        }
    }
}

/// Configuration of [`EncoderBlock`].
#[derive(Config, Debug)]
pub struct EncoderBlockConfig {
    /// Model width.
    pub d_model: usize,
    /// Attention heads.
    pub n_heads: usize,
    /// Key/value heads (GQA). Default: `n_heads`.
    #[config(default = "None")]
    pub n_kv_heads: Option<usize>,
    /// Hidden width of the feed-forward. Default: `4 · d_model`.
    #[config(default = "None")]
    pub d_ff: Option<usize>,
    /// Dropout on attention weights, the feed-forward hidden layer and each residual
    /// branch, in training only. Default: 0.1, as PyTorch.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Feed-forward activation. Default: GELU.
    #[config(default = "FeedForwardActivation::Gelu")]
    pub activation: FeedForwardActivation,
    /// Pre-norm (`x + f(norm(x))`, PyTorch's `norm_first=True`) when true, post-norm
    /// (`norm(x + f(x))`) when false. Default: true.
    #[config(default = true)]
    pub norm_first: bool,
    /// LayerNorm epsilon. Default: 1e-5.
    #[config(default = 1e-5)]
    pub layer_norm_eps: f64,
    /// Bias in the linear layers and LayerNorms. Default: true.
    #[config(default = true)]
    pub bias: bool,
    /// Whether the self-attention is causal. Default: false.
    #[config(default = false)]
    pub causal: bool,
    /// How the self-attention knows where tokens are (see [`Positions`]); a stack adds
    /// absolute positions to its input once. Default: none.
    #[config(default = "Positions::None")]
    pub positions: Positions,
}

/// Configuration of [`DecoderBlock`]; its self-attention is always causal.
#[derive(Config, Debug)]
pub struct DecoderBlockConfig {
    /// Model width.
    pub d_model: usize,
    /// Attention heads.
    pub n_heads: usize,
    /// Key/value heads (GQA). Default: `n_heads`.
    #[config(default = "None")]
    pub n_kv_heads: Option<usize>,
    /// Hidden width of the feed-forward. Default: `4 · d_model`.
    #[config(default = "None")]
    pub d_ff: Option<usize>,
    /// Dropout on attention weights, the feed-forward hidden layer and each residual
    /// branch, in training only. Default: 0.1, as PyTorch.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Feed-forward activation. Default: GELU.
    #[config(default = "FeedForwardActivation::Gelu")]
    pub activation: FeedForwardActivation,
    /// Pre-norm (`x + f(norm(x))`, PyTorch's `norm_first=True`) when true, post-norm
    /// (`norm(x + f(x))`) when false. Default: true.
    #[config(default = true)]
    pub norm_first: bool,
    /// LayerNorm epsilon. Default: 1e-5.
    #[config(default = 1e-5)]
    pub layer_norm_eps: f64,
    /// Bias in the linear layers and LayerNorms. Default: true.
    #[config(default = true)]
    pub bias: bool,
    /// How the causal self-attention knows where tokens are (see [`Positions`]; the
    /// cross-attention reads the memory as it is); a stack adds absolute positions to its
    /// input once. Default: none.
    #[config(default = "Positions::None")]
    pub positions: Positions,
}

impl EncoderBlockConfig {
    fn validate(&self, name: &'static str) -> Result<(), ConfigError> {
        let check = Check(name);
        check.nonzero("d_ff", self.d_ff())?;
        check.probability("dropout", self.dropout)?;
        check.positive("layer_norm_eps", self.layer_norm_eps)
    }

    fn d_ff(&self) -> usize {
        self.d_ff.unwrap_or(4 * self.d_model)
    }

    /// Attention with these hyperparameters and `positions`.
    fn attention(
        &self,
        positions: Positions,
        device: &Device,
    ) -> Result<MultiHeadAttention, ConfigError> {
        MultiHeadAttentionConfig::new(self.d_model, self.n_heads)
            .with_n_kv_heads(self.n_kv_heads)
            .with_bias(self.bias)
            .with_dropout(self.dropout)
            .with_positions(positions)
            .try_init(device)
    }

    fn norm(&self, device: &Device) -> LayerNorm {
        let config = LayerNormConfig::new(self.d_model)
            .with_epsilon(self.layer_norm_eps)
            .with_bias(self.bias);
        LayerNorm::new(&config, device)
    }

    /// The final norm a pre-norm stack of these blocks needs.
    pub(crate) fn final_norm(&self, device: &Device) -> Option<LayerNorm> {
        self.norm_first.then(|| self.norm(device))
    }

    fn dropout(&self) -> Dropout {
        DropoutConfig::new(self.dropout).init()
    }

    fn feed_forward(&self, device: &Device) -> FeedForward {
        FeedForward {
            linear1: LinearConfig::new(self.d_model, self.d_ff())
                .with_bias(self.bias)
                .init(device),
            activation: self.activation,
            dropout: self.dropout(),
            linear2: LinearConfig::new(self.d_ff(), self.d_model)
                .with_bias(self.bias)
                .init(device),
        }
    }

    /// Builds an [`EncoderBlock`].
    ///
    /// # Errors
    /// A [`ConfigError`] naming the field and values (see
    /// [`MultiHeadAttentionConfig::try_init`], and `d_ff`, `dropout`, `layer_norm_eps`).
    pub fn try_init(&self, device: &Device) -> Result<EncoderBlock, ConfigError> {
        self.validate("EncoderBlockConfig")?;
        Ok(EncoderBlock {
            self_attn: self.attention(self.positions.clone(), device)?,
            feed_forward: self.feed_forward(device),
            norm1: self.norm(device),
            norm2: self.norm(device),
            dropout1: self.dropout(),
            dropout2: self.dropout(),
            norm_first: self.norm_first,
            causal: self.causal,
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
        let parts = self.parts();
        parts.validate("DecoderBlockConfig")?;
        Ok(DecoderBlock {
            self_attn: parts.attention(self.positions.clone(), device)?,
            cross_attn: parts.attention(Positions::None, device)?,
            feed_forward: parts.feed_forward(device),
            norm1: parts.norm(device),
            norm2: parts.norm(device),
            norm3: parts.norm(device),
            dropout1: parts.dropout(),
            dropout2: parts.dropout(),
            dropout3: parts.dropout(),
            norm_first: self.norm_first,
        })
    }

    /// Builds a [`DecoderBlock`].
    ///
    /// # Panics
    /// With the message of [`try_init`](Self::try_init)'s error.
    pub fn init(&self, device: &Device) -> DecoderBlock {
        self.try_init(device).unwrap_or_else(|err| panic!("{err}"))
    }

    /// The final norm a pre-norm stack of these blocks needs.
    pub(crate) fn final_norm(&self, device: &Device) -> Option<LayerNorm> {
        self.parts().final_norm(device)
    }

    /// The shared hyperparameters, as an encoder block's.
    fn parts(&self) -> EncoderBlockConfig {
        EncoderBlockConfig {
            d_model: self.d_model,
            n_heads: self.n_heads,
            n_kv_heads: self.n_kv_heads,
            d_ff: self.d_ff,
            dropout: self.dropout,
            activation: self.activation,
            norm_first: self.norm_first,
            layer_norm_eps: self.layer_norm_eps,
            bias: self.bias,
            causal: true,
            positions: self.positions.clone(),
        }
    }
}

/// `linear2(dropout(activation(linear1(x))))`.
#[derive(Module, Debug)]
pub struct FeedForward {
    /// `[d_model, d_ff]`.
    pub linear1: Linear,
    /// GELU or ReLU.
    #[module(skip)]
    pub activation: FeedForwardActivation,
    /// Dropout on the hidden layer.
    pub dropout: Dropout,
    /// `[d_ff, d_model]`.
    pub linear2: Linear,
}

impl FeedForward {
    /// # Shapes
    /// `[B, T, d_model]` -> `[B, T, d_model]`.
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let hidden = self
            .activation
            .forward(crate::linear::forward(&self.linear1, x)); // [B, T, d_ff]
        crate::linear::forward(&self.linear2, self.dropout.forward(hidden))
    }
}

/// A residual branch `x + dropout(f(norm(x)))` (pre-norm) or `norm(x + dropout(f(x)))`
/// (post-norm).
fn residual(
    x: Tensor<3>,
    norm: &LayerNorm,
    dropout: &Dropout,
    norm_first: bool,
    f: impl FnOnce(Tensor<3>) -> Tensor<3>,
) -> Tensor<3> {
    let branch = |h| Ok::<_, core::convert::Infallible>(f(h));
    match try_residual(x, norm, dropout, norm_first, branch) {
        Ok(y) => y,
        Err(never) => match never {},
    }
}

/// [`residual`] with a branch that may fail.
fn try_residual<E>(
    x: Tensor<3>,
    norm: &LayerNorm,
    dropout: &Dropout,
    norm_first: bool,
    f: impl FnOnce(Tensor<3>) -> Result<Tensor<3>, E>,
) -> Result<Tensor<3>, E> {
    Ok(match norm_first {
        true => x.clone() + dropout.forward(f(norm.forward(x))?),
        false => norm.forward(x.clone() + dropout.forward(f(x)?)),
    })
}

/// Self-attention and feed-forward, PyTorch's `nn.TransformerEncoderLayer`.
#[derive(Module, Debug)]
pub struct EncoderBlock {
    /// Self-attention.
    pub self_attn: MultiHeadAttention,
    /// Feed-forward.
    pub feed_forward: FeedForward,
    /// Norm of the attention branch.
    pub norm1: LayerNorm,
    /// Norm of the feed-forward branch.
    pub norm2: LayerNorm,
    /// Dropout on the attention branch.
    pub dropout1: Dropout,
    /// Dropout on the feed-forward branch.
    pub dropout2: Dropout,
    /// Pre-norm when true.
    pub norm_first: bool,
    /// Causal self-attention when true.
    pub causal: bool,
}

impl EncoderBlock {
    /// # Shapes
    /// - `x`: `[B, T, d_model]` -> `[B, T, d_model]`
    /// - `mask`: broadcastable to `[B, H, T, T]`, combined with the causal mask when the
    ///   block is causal.
    ///
    /// # Panics
    /// If `x` is not `[B, T, d_model]` or the mask does not broadcast.
    pub fn forward(&self, x: Tensor<3>, mask: &AttentionMask) -> Tensor<3> {
        self.run(x, mask, AttentionWeights::None, None).0
    }

    /// [`forward`](Self::forward) with a head mask (one attention layer) and the weights
    /// when asked for (see [`Inspect`]).
    ///
    /// # Panics
    /// As [`forward`](Self::forward), and if the head mask is not one layer of `H` heads.
    pub fn forward_inspect(
        &self,
        x: Tensor<3>,
        mask: &AttentionMask,
        inspect: &Inspect,
    ) -> Inspected {
        let head = inspect.head_mask.as_ref().map(|m| {
            m.check("EncoderBlock", &self.head_counts());
            m.layer(0).clone()
        });
        let (output, weights) = self.run(x, mask, wanted(inspect), head);
        Inspected {
            output,
            weights: weights.into_iter().collect(),
        }
    }

    /// [`forward`](Self::forward) of the next tokens `x` `[B, T, d_model]` of a causal
    /// block, with `cache` keeping the keys and values of the tokens before them (see
    /// [`MultiHeadAttention::forward_cached`]): a prompt, then one token per call.
    ///
    /// # Errors
    /// [`CacheError::NotCausal`] for a block that is not causal, and the cache's errors.
    pub fn forward_cached(
        &self,
        x: Tensor<3>,
        cache: &mut KvCache,
        mask: &AttentionMask,
    ) -> Result<Tensor<3>, CacheError> {
        if !self.causal {
            return Err(CacheError::NotCausal {
                module: "EncoderBlock",
            });
        }
        let x = try_residual(x, &self.norm1, &self.dropout1, self.norm_first, |h| {
            self.self_attn.forward_cached(h, cache, mask.clone())
        })?;
        Ok(residual(
            x,
            &self.norm2,
            &self.dropout2,
            self.norm_first,
            |h| self.feed_forward.forward(h),
        ))
    }

    /// [`forward`](Self::forward), also returning the self-attention weights
    /// `[B, H, T, T]`.
    pub fn forward_with_weights(
        &self,
        x: Tensor<3>,
        mask: &AttentionMask,
    ) -> (Tensor<3>, Tensor<4>) {
        let (y, weights) = self.run(x, mask, AttentionWeights::PerHead, None);
        (y, weights.expect("weights were asked for"))
    }

    fn run(
        &self,
        x: Tensor<3>,
        mask: &AttentionMask,
        weights: AttentionWeights,
        head_mask: Option<Tensor<1>>,
    ) -> (Tensor<3>, Option<Tensor<4>>) {
        let mask = match self.causal {
            true => mask.clone().and(AttentionMask::causal()),
            false => mask.clone(),
        };
        let mut attn_weights = None;
        let x = residual(x, &self.norm1, &self.dropout1, self.norm_first, |h| {
            let input = MhaInput::self_attn(h).mask(mask).weights(weights);
            let out = self.self_attn.forward(with_head_mask(input, head_mask));
            attn_weights = out.weights;
            out.context
        });
        let y = residual(x, &self.norm2, &self.dropout2, self.norm_first, |h| {
            self.feed_forward.forward(h)
        });
        (y, attn_weights)
    }
}

/// Causal self-attention, cross-attention to an encoded memory, and feed-forward:
/// PyTorch's `nn.TransformerDecoderLayer` with `tgt_is_causal=True`.
#[derive(Module, Debug)]
pub struct DecoderBlock {
    /// Causal self-attention.
    pub self_attn: MultiHeadAttention,
    /// Cross-attention to the memory (PyTorch's `multihead_attn`).
    pub cross_attn: MultiHeadAttention,
    /// Feed-forward.
    pub feed_forward: FeedForward,
    /// Norm of the self-attention branch.
    pub norm1: LayerNorm,
    /// Norm of the cross-attention branch.
    pub norm2: LayerNorm,
    /// Norm of the feed-forward branch.
    pub norm3: LayerNorm,
    /// Dropout on the self-attention branch.
    pub dropout1: Dropout,
    /// Dropout on the cross-attention branch.
    pub dropout2: Dropout,
    /// Dropout on the feed-forward branch.
    pub dropout3: Dropout,
    /// Pre-norm when true.
    pub norm_first: bool,
}

impl DecoderBlock {
    /// # Shapes
    /// - `x`: `[B, Tq, d_model]` -> `[B, Tq, d_model]`
    /// - `memory`: `[B, Tk, d_model]`
    /// - `self_mask`: broadcastable to `[B, H, Tq, Tq]`, combined with the causal mask
    /// - `memory_mask`: broadcastable to `[B, H, Tq, Tk]` (e.g. the memory's padding)
    ///
    /// # Panics
    /// If the shapes disagree or a mask does not broadcast.
    pub fn forward(
        &self,
        x: Tensor<3>,
        memory: Tensor<3>,
        self_mask: &AttentionMask,
        memory_mask: &AttentionMask,
    ) -> Tensor<3> {
        let none = AttentionWeights::None;
        self.run(
            x,
            memory,
            [self_mask, memory_mask],
            [none, none],
            [None, None],
        )
        .0
    }

    /// [`forward`](Self::forward) with a head mask (two attention layers: the
    /// self-attention, then the cross-attention) and both attentions' weights when asked
    /// for (see [`Inspect`]).
    ///
    /// # Panics
    /// As [`forward`](Self::forward), and if the head mask does not have the block's two
    /// attention layers.
    pub fn forward_inspect(
        &self,
        x: Tensor<3>,
        memory: Tensor<3>,
        self_mask: &AttentionMask,
        memory_mask: &AttentionMask,
        inspect: &Inspect,
    ) -> Inspected {
        let heads = match &inspect.head_mask {
            Some(m) => {
                m.check("DecoderBlock", &self.head_counts());
                [Some(m.layer(0).clone()), Some(m.layer(1).clone())]
            }
            None => [None, None],
        };
        let weights = wanted(inspect);
        let (output, [self_w, cross_w]) = self.run(
            x,
            memory,
            [self_mask, memory_mask],
            [weights, weights],
            heads,
        );
        Inspected {
            output,
            weights: self_w.into_iter().chain(cross_w).collect(),
        }
    }

    /// The cross-attention's keys and values of `memory` `[B, Tk, d_model]`, computed once
    /// for every step of [`forward_cached`](Self::forward_cached).
    pub fn memory_kv(&self, memory: Tensor<3>) -> MemoryKv {
        self.cross_attn.memory_kv(memory)
    }

    /// [`forward`](Self::forward) of the next tokens `x` `[B, T, d_model]`, with `cache`
    /// keeping the self-attention's keys and values of the tokens before them and `memory`
    /// the cross-attention's (see [`MultiHeadAttention::forward_cached`]).
    ///
    /// # Errors
    /// The cache's errors.
    pub fn forward_cached(
        &self,
        x: Tensor<3>,
        memory: &MemoryKv,
        cache: &mut KvCache,
        memory_mask: &AttentionMask,
    ) -> Result<Tensor<3>, CacheError> {
        let x = try_residual(x, &self.norm1, &self.dropout1, self.norm_first, |h| {
            self.self_attn
                .forward_cached(h, cache, AttentionMask::none())
        })?;
        let x = residual(x, &self.norm2, &self.dropout2, self.norm_first, |h| {
            self.cross_attn
                .cross_attention_cached(h, memory, memory_mask.clone())
        });
        Ok(residual(
            x,
            &self.norm3,
            &self.dropout3,
            self.norm_first,
            |h| self.feed_forward.forward(h),
        ))
    }

    /// [`forward`](Self::forward), also returning the cross-attention weights
    /// `[B, H, Tq, Tk]`: which memory positions each output position read.
    pub fn forward_with_weights(
        &self,
        x: Tensor<3>,
        memory: Tensor<3>,
        self_mask: &AttentionMask,
        memory_mask: &AttentionMask,
    ) -> (Tensor<3>, Tensor<4>) {
        let masks = [self_mask, memory_mask];
        let weights = [AttentionWeights::None, AttentionWeights::PerHead];
        let (y, [_, cross]) = self.run(x, memory, masks, weights, [None, None]);
        (y, cross.expect("weights were asked for"))
    }

    /// The block, with the weights of its self- and cross-attention when asked for and
    /// each one's head mask.
    fn run(
        &self,
        x: Tensor<3>,
        memory: Tensor<3>,
        [self_mask, memory_mask]: [&AttentionMask; 2],
        [self_weights, cross_weights]: [AttentionWeights; 2],
        [self_heads, cross_heads]: [Option<Tensor<1>>; 2],
    ) -> (Tensor<3>, [Option<Tensor<4>>; 2]) {
        let self_mask = self_mask.clone().and(AttentionMask::causal());
        let mut weights = [None, None];
        let x = residual(x, &self.norm1, &self.dropout1, self.norm_first, |h| {
            let input = MhaInput::self_attn(h).mask(self_mask).weights(self_weights);
            let out = self.self_attn.forward(with_head_mask(input, self_heads));
            weights[0] = out.weights;
            out.context
        });
        let x = residual(x, &self.norm2, &self.dropout2, self.norm_first, |h| {
            let input = MhaInput::cross(h, memory)
                .mask(memory_mask.clone())
                .weights(cross_weights);
            let out = self.cross_attn.forward(with_head_mask(input, cross_heads));
            weights[1] = out.weights;
            out.context
        });
        let y = residual(x, &self.norm3, &self.dropout3, self.norm_first, |h| {
            self.feed_forward.forward(h)
        });
        (y, weights)
    }
}

/// The weights an [`Inspect`] asks for.
fn wanted(inspect: &Inspect) -> AttentionWeights {
    match inspect.weights {
        true => AttentionWeights::PerHead,
        false => AttentionWeights::None,
    }
}

fn with_head_mask(input: MhaInput, head_mask: Option<Tensor<1>>) -> MhaInput {
    match head_mask {
        Some(mask) => input.head_mask(mask),
        None => input,
    }
}
