//! Stacks of N blocks, with the final LayerNorm a pre-norm stack needs (its blocks leave
//! the residual stream un-normalised): PyTorch's `nn.TransformerEncoder(layer, N, norm)`
//! and `nn.TransformerDecoder`.

use burn::config::Config;
use burn::module::Module;
use burn::nn::{LayerNorm, LayerNormConfig};
use burn::tensor::{Device, Tensor};

use crate::block::{DecoderBlock, DecoderBlockConfig, EncoderBlock, EncoderBlockConfig};
use crate::error::{Check, ConfigError};
use crate::mask::AttentionMask;

/// Configuration of [`Encoder`].
#[derive(Config, Debug)]
pub struct EncoderConfig {
    /// Every block's configuration.
    pub block: EncoderBlockConfig,
    /// Number of blocks.
    pub n_layers: usize,
}

/// Configuration of [`Decoder`].
#[derive(Config, Debug)]
pub struct DecoderConfig {
    /// Every block's configuration.
    pub block: DecoderBlockConfig,
    /// Number of blocks.
    pub n_layers: usize,
}

/// The final norm: present for pre-norm stacks.
fn final_norm(
    norm_first: bool,
    d_model: usize,
    eps: f64,
    bias: bool,
    device: &Device,
) -> Option<LayerNorm> {
    norm_first.then(|| {
        LayerNormConfig::new(d_model)
            .with_epsilon(eps)
            .with_bias(bias)
            .init(device)
    })
}

impl EncoderConfig {
    /// Builds the stack.
    ///
    /// # Errors
    /// A [`ConfigError`] when `n_layers` is 0 or the block configuration is rejected.
    pub fn try_init(&self, device: &Device) -> Result<Encoder, ConfigError> {
        Check("EncoderConfig").nonzero("n_layers", self.n_layers)?;
        let b = &self.block;
        Ok(Encoder {
            layers: (0..self.n_layers)
                .map(|_| b.try_init(device))
                .collect::<Result<_, _>>()?,
            norm: final_norm(b.norm_first, b.d_model, b.layer_norm_eps, b.bias, device),
        })
    }

    /// Builds the stack.
    ///
    /// # Panics
    /// With the message of [`try_init`](Self::try_init)'s error.
    pub fn init(&self, device: &Device) -> Encoder {
        self.try_init(device).unwrap_or_else(|err| panic!("{err}"))
    }
}

impl DecoderConfig {
    /// Builds the stack.
    ///
    /// # Errors
    /// A [`ConfigError`] when `n_layers` is 0 or the block configuration is rejected.
    pub fn try_init(&self, device: &Device) -> Result<Decoder, ConfigError> {
        Check("DecoderConfig").nonzero("n_layers", self.n_layers)?;
        let b = &self.block;
        Ok(Decoder {
            layers: (0..self.n_layers)
                .map(|_| b.try_init(device))
                .collect::<Result<_, _>>()?,
            norm: final_norm(b.norm_first, b.d_model, b.layer_norm_eps, b.bias, device),
        })
    }

    /// Builds the stack.
    ///
    /// # Panics
    /// With the message of [`try_init`](Self::try_init)'s error.
    pub fn init(&self, device: &Device) -> Decoder {
        self.try_init(device).unwrap_or_else(|err| panic!("{err}"))
    }
}

fn norm(norm: &Option<LayerNorm>, x: Tensor<3>) -> Tensor<3> {
    match norm {
        Some(norm) => norm.forward(x),
        None => x,
    }
}

/// N encoder blocks and, for pre-norm, a final LayerNorm.
#[derive(Module, Debug)]
pub struct Encoder {
    /// The blocks, first to last.
    pub layers: Vec<EncoderBlock>,
    /// The final norm (pre-norm stacks only).
    pub norm: Option<LayerNorm>,
}

impl Encoder {
    /// # Shapes
    /// `x`: `[B, T, d_model]` -> `[B, T, d_model]`; `mask` broadcastable to `[B, H, T, T]`.
    pub fn forward(&self, x: Tensor<3>, mask: &AttentionMask) -> Tensor<3> {
        let x = self
            .layers
            .iter()
            .fold(x, |x, layer| layer.forward(x, mask));
        norm(&self.norm, x)
    }

    /// [`forward`](Self::forward), also returning each block's self-attention weights
    /// `[B, H, T, T]`, first block first.
    pub fn forward_with_weights(
        &self,
        x: Tensor<3>,
        mask: &AttentionMask,
    ) -> (Tensor<3>, Vec<Tensor<4>>) {
        let mut all = Vec::with_capacity(self.layers.len());
        let x = self.layers.iter().fold(x, |x, layer| {
            let (y, weights) = layer.forward_with_weights(x, mask);
            all.push(weights);
            y
        });
        (norm(&self.norm, x), all)
    }
}

/// N decoder blocks and, for pre-norm, a final LayerNorm.
#[derive(Module, Debug)]
pub struct Decoder {
    /// The blocks, first to last.
    pub layers: Vec<DecoderBlock>,
    /// The final norm (pre-norm stacks only).
    pub norm: Option<LayerNorm>,
}

impl Decoder {
    /// # Shapes
    /// - `x`: `[B, Tq, d_model]` -> `[B, Tq, d_model]`; `memory`: `[B, Tk, d_model]`
    /// - `self_mask` broadcastable to `[B, H, Tq, Tq]` (combined with causal),
    ///   `memory_mask` to `[B, H, Tq, Tk]`
    pub fn forward(
        &self,
        x: Tensor<3>,
        memory: Tensor<3>,
        self_mask: &AttentionMask,
        memory_mask: &AttentionMask,
    ) -> Tensor<3> {
        let x = self.layers.iter().fold(x, |x, layer| {
            layer.forward(x, memory.clone(), self_mask, memory_mask)
        });
        norm(&self.norm, x)
    }

    /// [`forward`](Self::forward), also returning each block's cross-attention weights
    /// `[B, H, Tq, Tk]`, first block first.
    pub fn forward_with_weights(
        &self,
        x: Tensor<3>,
        memory: Tensor<3>,
        self_mask: &AttentionMask,
        memory_mask: &AttentionMask,
    ) -> (Tensor<3>, Vec<Tensor<4>>) {
        let mut all = Vec::with_capacity(self.layers.len());
        let x = self.layers.iter().fold(x, |x, layer| {
            let (y, weights) =
                layer.forward_with_weights(x, memory.clone(), self_mask, memory_mask);
            all.push(weights);
            y
        });
        (norm(&self.norm, x), all)
    }
}
