//! Stacks of N blocks, with the final LayerNorm a pre-norm stack needs (its blocks leave
//! the residual stream un-normalised): PyTorch's `nn.TransformerEncoder(layer, N, norm)`
//! and `nn.TransformerDecoder`.

use burn::config::Config;
use burn::module::Module;
use burn::tensor::{Device, Tensor};

use crate::analysis::{Heads, Inspect, Inspected};
use crate::block::{DecoderBlock, DecoderBlockConfig, EncoderBlock, EncoderBlockConfig};
use crate::cache::{KvCache, StackCache};
use crate::error::{CacheError, Check, ConfigError};
use crate::mask::AttentionMask;
use crate::norm::LayerNorm;
use crate::positions::{AbsolutePositions, Positions};

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

/// A block configuration a stack repeats.
trait BlockSpec: Clone {
    type Block;
    /// One block.
    fn build(&self, device: &Device) -> Result<Self::Block, ConfigError>;
    /// The final norm a pre-norm stack of these blocks needs (its blocks leave the
    /// residual stream un-normalised), if any.
    fn final_norm(&self, device: &Device) -> Option<LayerNorm>;
    /// The block's positions.
    fn positions(&mut self) -> &mut Positions;
    /// The model width.
    fn d_model(&self) -> usize;
}

impl BlockSpec for EncoderBlockConfig {
    type Block = EncoderBlock;

    fn build(&self, device: &Device) -> Result<EncoderBlock, ConfigError> {
        self.try_init(device)
    }

    fn final_norm(&self, device: &Device) -> Option<LayerNorm> {
        self.final_norm(device)
    }

    fn positions(&mut self) -> &mut Positions {
        &mut self.positions
    }

    fn d_model(&self) -> usize {
        self.d_model
    }
}

impl BlockSpec for DecoderBlockConfig {
    type Block = DecoderBlock;

    fn build(&self, device: &Device) -> Result<DecoderBlock, ConfigError> {
        self.try_init(device)
    }

    fn final_norm(&self, device: &Device) -> Option<LayerNorm> {
        self.final_norm(device)
    }

    fn positions(&mut self) -> &mut Positions {
        &mut self.positions
    }

    fn d_model(&self) -> usize {
        self.d_model
    }
}

/// The parts of a stack: its blocks, the final norm a pre-norm stack needs, and the
/// absolute positions it adds to its input.
type Parts<B> = (Vec<B>, Option<LayerNorm>, Option<AbsolutePositions>);

/// `n_layers` blocks of `block`, the final norm a pre-norm stack needs, and the absolute
/// positions of `block`'s configuration (added once, to the stack's input; its blocks are
/// built without them).
///
/// # Errors
/// A [`ConfigError`] of `config` when `n_layers` is 0, or the block's error.
fn layers<C: BlockSpec>(
    config: &'static str,
    n_layers: usize,
    block: &C,
    device: &Device,
) -> Result<Parts<C::Block>, ConfigError> {
    let check = Check(config);
    check.nonzero("n_layers", n_layers)?;
    let mut block = block.clone();
    let d_model = block.d_model();
    let absolute = match std::mem::take(block.positions()) {
        Positions::Sinusoidal => Some(AbsolutePositions::sinusoidal(d_model)),
        Positions::Learned { max_len } => {
            check.nonzero("block.positions", max_len)?;
            Some(AbsolutePositions::learned(max_len, d_model, device))
        }
        other => {
            *block.positions() = other;
            None
        }
    };
    let layers = (0..n_layers).map(|_| block.build(device));
    let layers = layers.collect::<Result<_, _>>()?;
    Ok((layers, block.final_norm(device), absolute))
}

impl EncoderConfig {
    /// Builds the stack.
    ///
    /// # Errors
    /// A [`ConfigError`] when `n_layers` is 0 or the block configuration is rejected.
    pub fn try_init(&self, device: &Device) -> Result<Encoder, ConfigError> {
        let (layers, norm, positions) =
            layers("EncoderConfig", self.n_layers, &self.block, device)?;
        Ok(Encoder {
            layers,
            norm,
            positions,
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
        let (layers, norm, positions) =
            layers("DecoderConfig", self.n_layers, &self.block, device)?;
        Ok(Decoder {
            layers,
            norm,
            positions,
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

/// `x` with the stack's absolute positions added, its rows starting at position `offset`.
fn positioned(positions: &Option<AbsolutePositions>, x: Tensor<3>, offset: usize) -> Tensor<3> {
    match positions {
        Some(positions) => positions.add(x, offset),
        None => x,
    }
}

/// Checks that `caches` fit a stack of `layers` layers and that the absolute positions
/// cover the next `tokens`.
///
/// # Errors
/// [`CacheError::Layers`], [`CacheError::PastPositions`].
fn check_cached(
    positions: &Option<AbsolutePositions>,
    layers: usize,
    caches: &[KvCache],
    tokens: usize,
) -> Result<(), CacheError> {
    if caches.len() != layers {
        return Err(CacheError::Layers {
            layers,
            caches: caches.len(),
        });
    }
    let position = caches.first().map_or(0, KvCache::len);
    match positions.as_ref().and_then(AbsolutePositions::max_len) {
        Some(max_len) if position + tokens > max_len => Err(CacheError::PastPositions {
            max_len,
            position,
            tokens,
        }),
        _ => Ok(()),
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
    /// Absolute positions added to the input, when the blocks' configuration asks for
    /// them.
    pub positions: Option<AbsolutePositions>,
}

impl Encoder {
    /// # Shapes
    /// `x`: `[B, T, d_model]` -> `[B, T, d_model]`; `mask` broadcastable to `[B, H, T, T]`.
    pub fn forward(&self, x: Tensor<3>, mask: &AttentionMask) -> Tensor<3> {
        let x = positioned(&self.positions, x, 0);
        let x = self
            .layers
            .iter()
            .fold(x, |x, layer| layer.forward(x, mask));
        norm(&self.norm, x)
    }

    /// Caches for every layer, each like `cache` (e.g. [`KvCache::new`] with the longest
    /// sequence to decode), for [`forward_cached`](Self::forward_cached).
    pub fn cache(&self, cache: KvCache) -> StackCache {
        StackCache::new(self.layers.len(), cache)
    }

    /// [`forward`](Self::forward) of the next tokens `x` `[B, T, d_model]` of a stack of
    /// causal blocks (a decoder-only language model), with `cache` keeping every layer's
    /// keys and values of the tokens before them: a prompt, then one token per call. The
    /// absolute positions, if any, continue at `cache.len()`.
    ///
    /// # Errors
    /// [`CacheError::Layers`] for the caches of another stack,
    /// [`CacheError::PastPositions`] past the learned positions, and the blocks' errors
    /// ([`EncoderBlock::forward_cached`]).
    pub fn forward_cached(
        &self,
        x: Tensor<3>,
        cache: &mut StackCache,
        mask: &AttentionMask,
    ) -> Result<Tensor<3>, CacheError> {
        let tokens = x.dims()[1];
        check_cached(&self.positions, self.layers.len(), &cache.layers, tokens)?;
        let mut x = positioned(&self.positions, x, cache.len());
        for (layer, cache) in self.layers.iter().zip(&mut cache.layers) {
            x = layer.forward_cached(x, cache, mask)?;
        }
        Ok(norm(&self.norm, x))
    }

    /// [`forward`](Self::forward) with a head mask (one attention layer per block) and
    /// every block's weights when asked for (see [`Inspect`]).
    ///
    /// # Panics
    /// As [`forward`](Self::forward), and if the head mask's heads per attention layer
    /// are not the stack's ([`Heads::head_counts`]).
    pub fn forward_inspect(
        &self,
        x: Tensor<3>,
        mask: &AttentionMask,
        inspect: &Inspect,
    ) -> Inspected {
        if let Some(m) = &inspect.head_mask {
            m.check("Encoder", &self.head_counts());
        }
        let mut x = positioned(&self.positions, x, 0);
        let mut weights = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            let out = layer.forward_inspect(x, mask, &inspect.slice(i, 1));
            weights.extend(out.weights);
            x = out.output;
        }
        Inspected {
            output: norm(&self.norm, x),
            weights,
        }
    }

    /// [`forward`](Self::forward), also returning each block's self-attention weights
    /// `[B, H, T, T]`, first block first.
    pub fn forward_with_weights(
        &self,
        x: Tensor<3>,
        mask: &AttentionMask,
    ) -> (Tensor<3>, Vec<Tensor<4>>) {
        let x = positioned(&self.positions, x, 0);
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
    /// Absolute positions added to the input, when the blocks' configuration asks for
    /// them.
    pub positions: Option<AbsolutePositions>,
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
        let x = positioned(&self.positions, x, 0);
        let x = self.layers.iter().fold(x, |x, layer| {
            layer.forward(x, memory.clone(), self_mask, memory_mask)
        });
        norm(&self.norm, x)
    }

    /// Caches for decoding against `memory` `[B, Tk, d_model]` (the encoder's output):
    /// every layer's cross-attention keys and values, computed here once, and a
    /// self-attention cache per layer like `cache`; for
    /// [`forward_cached`](Self::forward_cached).
    pub fn cache(&self, memory: Tensor<3>, cache: KvCache) -> StackCache {
        let mut caches = StackCache::new(self.layers.len(), cache);
        caches.memory = self
            .layers
            .iter()
            .map(|layer| layer.memory_kv(memory.clone()))
            .collect();
        caches
    }

    /// [`forward`](Self::forward) of the next tokens `x` `[B, T, d_model]`, with `cache`
    /// (from [`cache`](Self::cache)) keeping every layer's self-attention keys and values
    /// of the tokens before them and its cross-attention's of the memory. The absolute
    /// positions, if any, continue at `cache.len()`.
    ///
    /// # Errors
    /// [`CacheError::Layers`] for the caches of another stack (or without a memory),
    /// [`CacheError::PastPositions`] past the learned positions, and the caches' errors.
    pub fn forward_cached(
        &self,
        x: Tensor<3>,
        cache: &mut StackCache,
        memory_mask: &AttentionMask,
    ) -> Result<Tensor<3>, CacheError> {
        let tokens = x.dims()[1];
        let layers = self.layers.len();
        check_cached(&self.positions, layers, &cache.layers, tokens)?;
        if cache.memory.len() != layers {
            return Err(CacheError::Layers {
                layers,
                caches: cache.memory.len(),
            });
        }
        let mut x = positioned(&self.positions, x, cache.len());
        let parts = self.layers.iter().zip(&mut cache.layers).zip(&cache.memory);
        for ((layer, cache), memory) in parts {
            x = layer.forward_cached(x, memory, cache, memory_mask)?;
        }
        Ok(norm(&self.norm, x))
    }

    /// [`forward`](Self::forward) with a head mask (two attention layers per block: its
    /// self-attention, then its cross-attention) and their weights when asked for (see
    /// [`Inspect`]).
    ///
    /// # Panics
    /// As [`forward`](Self::forward), and if the head mask's heads per attention layer
    /// are not the stack's ([`Heads::head_counts`]).
    pub fn forward_inspect(
        &self,
        x: Tensor<3>,
        memory: Tensor<3>,
        self_mask: &AttentionMask,
        memory_mask: &AttentionMask,
        inspect: &Inspect,
    ) -> Inspected {
        if let Some(m) = &inspect.head_mask {
            m.check("Decoder", &self.head_counts());
        }
        let mut x = positioned(&self.positions, x, 0);
        let mut weights = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            let part = inspect.slice(2 * i, 2);
            let out = layer.forward_inspect(x, memory.clone(), self_mask, memory_mask, &part);
            weights.extend(out.weights);
            x = out.output;
        }
        Inspected {
            output: norm(&self.norm, x),
            weights,
        }
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
        let x = positioned(&self.positions, x, 0);
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
