//! Stacks of N blocks, with the final norm a pre-norm stack needs (its blocks leave the
//! residual stream un-normalised) or any other asked for: PyTorch's
//! `nn.TransformerEncoder(layer, N, norm)` and `nn.TransformerDecoder`.

use burn::module::Module;
use burn::tensor::{Device, Tensor};

use crate::block::Memory;
use crate::block::{
    BlockInput, BlockOutput, DecoderBlock, DecoderBlockConfig, EncoderBlock, EncoderBlockConfig,
    StackInput,
};
use crate::cache::{KvCache, MemoryKv, StackCache};
use crate::error::{CacheError, Check, ConfigError};
use crate::mask::AttentionMask;
use crate::norm::LayerNorm;
use crate::positions::{AbsolutePositions, Positions};

crate::configs::config! {
    /// Configuration of [`Encoder`].
    #[derive(Debug)]
    pub struct EncoderConfig {
        /// Every block's configuration.
        pub block: EncoderBlockConfig,
        /// Number of blocks.
        pub n_layers: usize,
        ;
        /// A norm after the last block (PyTorch's `nn.TransformerEncoder(layer, N, norm)`), of the
        /// blocks' kind and epsilon. Default: `block.norm_first` (a pre-norm stack's blocks
        /// leave the residual stream un-normalised); PyTorch's `norm=None` (its default) is
        /// `Some(false)`, and `nn.Transformer`'s post-norm stacks, which have one, are
        /// `Some(true)`.
        pub final_norm: Option<bool> = None => with_final_norm,
    }
}

crate::configs::config! {
    /// Configuration of [`Decoder`].
    #[derive(Debug)]
    pub struct DecoderConfig {
        /// Every block's configuration.
        pub block: DecoderBlockConfig,
        /// Number of blocks.
        pub n_layers: usize,
        ;
        /// A norm after the last block (PyTorch's `nn.TransformerDecoder(layer, N, norm)`), of the
        /// blocks' kind and epsilon. Default: `block.norm_first` (a pre-norm stack's blocks
        /// leave the residual stream un-normalised); PyTorch's `norm=None` (its default) is
        /// `Some(false)`, and `nn.Transformer`'s post-norm stacks, which have one, are
        /// `Some(true)`.
        pub final_norm: Option<bool> = None => with_final_norm,
    }
}

/// A block configuration a stack repeats.
trait BlockSpec: Clone {
    type Block;
    /// One block.
    fn build(&self, device: &Device) -> Result<Self::Block, ConfigError>;
    /// A norm after the last block, where `wanted` asks for one (by default where the
    /// blocks are pre-norm: they leave the residual stream un-normalised).
    fn final_norm(&self, wanted: Option<bool>, device: &Device) -> Option<LayerNorm>;
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

    fn final_norm(&self, wanted: Option<bool>, device: &Device) -> Option<LayerNorm> {
        self.final_norm(wanted, device)
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

    fn final_norm(&self, wanted: Option<bool>, device: &Device) -> Option<LayerNorm> {
        self.final_norm(wanted, device)
    }

    fn positions(&mut self) -> &mut Positions {
        &mut self.positions
    }

    fn d_model(&self) -> usize {
        self.d_model
    }
}

/// The parts of a stack: its blocks, its final norm if it has one, and the
/// absolute positions it adds to its input.
type Parts<B> = (Vec<B>, Option<LayerNorm>, Option<AbsolutePositions>);

/// `n_layers` blocks of `block`, the final norm where `final_norm` asks for one (by
/// default a pre-norm stack's), and the absolute positions of `block`'s configuration
/// (added once, to the stack's input; its blocks are built without them).
///
/// # Errors
/// A [`ConfigError`] of `config` when `n_layers` is 0, or the block's error.
fn layers<C: BlockSpec>(
    config: &'static str,
    n_layers: usize,
    final_norm: Option<bool>,
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
    Ok((layers, block.final_norm(final_norm, device), absolute))
}

impl EncoderConfig {
    /// Builds the stack.
    ///
    /// # Errors
    /// A [`ConfigError`] when `n_layers` is 0 or the block configuration is rejected.
    pub fn try_init(&self, device: &Device) -> Result<Encoder, ConfigError> {
        let (layers, norm, positions) = layers(
            "EncoderConfig",
            self.n_layers,
            self.final_norm,
            &self.block,
            device,
        )?;
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
        let (layers, norm, positions) = layers(
            "DecoderConfig",
            self.n_layers,
            self.final_norm,
            &self.block,
            device,
        )?;
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

/// `x` with the stack's absolute positions added, its rows starting at position `offset`
/// (less each batch row's left padding, where given).
fn positioned(
    positions: &Option<AbsolutePositions>,
    x: Tensor<3>,
    offset: usize,
    pads: Option<&[usize]>,
) -> Tensor<3> {
    match (positions, pads) {
        (Some(positions), Some(pads)) => positions.add_padded(x, offset, pads),
        (Some(positions), None) => positions.add(x, offset),
        (None, _) => x,
    }
}

/// Checks that `cache` fits a stack of `layers` layers, that its layers hold the same
/// positions, and that the absolute positions cover the next `tokens` (of the row with the
/// least left padding, `shift`).
///
/// # Errors
/// [`CacheError::Layers`], [`CacheError::Uneven`], [`CacheError::PastPositions`].
fn check_cached(
    positions: &Option<AbsolutePositions>,
    layers: usize,
    cache: &StackCache,
    tokens: usize,
    shift: usize,
) -> Result<(), CacheError> {
    if cache.layers.len() != layers {
        return Err(CacheError::Layers {
            layers,
            caches: cache.layers.len(),
        });
    }
    if let Some((layer, other)) = cache
        .layers
        .iter()
        .enumerate()
        .find(|(_, other)| other.len() != cache.len())
    {
        return Err(CacheError::Uneven {
            first: cache.len(),
            layer,
            len: other.len(),
        });
    }
    // The positions the call's last token reaches, in the row with the least padding.
    let end = (cache.len() + tokens).saturating_sub(shift);
    match positions.as_ref().and_then(AbsolutePositions::max_len) {
        Some(max_len) if end > max_len => Err(CacheError::PastPositions {
            max_len,
            position: end.saturating_sub(tokens),
            tokens,
        }),
        _ => Ok(()),
    }
}

/// A block a stack repeats.
trait Block {
    /// Whether its cross-attention reads a memory (a decoder's blocks).
    const READS_MEMORY: bool;
    /// The block's forward.
    fn forward(&self, input: BlockInput) -> Result<BlockOutput, CacheError>;
    /// The heads of each of its attention layers.
    fn head_counts(&self) -> Vec<usize>;
    /// What its forward over `x` under `mask` with `cache` would refuse before it writes
    /// (errors, and panics over the mask).
    fn check_cache(
        &self,
        cache: &KvCache,
        x: &Tensor<3>,
        mask: &AttentionMask,
    ) -> Result<(), CacheError>;
    /// What its forward refuses of `memory` and `memory_mask` (panicking).
    fn check_memory(&self, memory: &Memory, memory_mask: &AttentionMask, x: &Tensor<3>);
}

/// `Block` for a block type, by its own methods of the same names.
macro_rules! block {
    ($block:ty, reads_memory: $reads:expr) => {
        impl Block for $block {
            const READS_MEMORY: bool = $reads;

            fn forward(&self, input: BlockInput) -> Result<BlockOutput, CacheError> {
                self.forward(input)
            }

            fn head_counts(&self) -> Vec<usize> {
                self.head_counts()
            }

            fn check_cache(
                &self,
                cache: &KvCache,
                x: &Tensor<3>,
                mask: &AttentionMask,
            ) -> Result<(), CacheError> {
                self.check_cache(cache, x, mask)
            }

            fn check_memory(&self, memory: &Memory, memory_mask: &AttentionMask, x: &Tensor<3>) {
                self.check_memory(memory, memory_mask, x)
            }
        }
    };
}

block!(EncoderBlock, reads_memory: false);
block!(DecoderBlock, reads_memory: true);

/// What a stack is made of.
struct Stack<'a, B> {
    /// The stack's name in messages.
    name: &'static str,
    blocks: &'a [B],
    norm: &'a Option<LayerNorm>,
    positions: &'a Option<AbsolutePositions>,
}

impl<B: Block> Stack<'_, B> {
    /// The heads of every attention layer, block by block.
    fn head_counts(&self) -> Vec<usize> {
        self.blocks.iter().flat_map(B::head_counts).collect()
    }

    /// The stack over `input`: the absolute positions added (from the cache's length when
    /// decoding), each block over the output of the one before with its part of the cache
    /// and of the head mask, and the memory (the input's, else its keys and values in the
    /// cache), then the final norm.
    fn forward(&self, input: StackInput) -> Result<BlockOutput, CacheError> {
        let BlockInput {
            x,
            memory,
            mask,
            memory_mask,
            cache,
            inspect,
            left_padding,
        } = input;
        if let Some(m) = &inspect.head_mask {
            m.check(self.name, &self.head_counts());
        }
        crate::block::check_pads(self.name, &left_padding, x.dims()[0]);
        let layers = self.blocks.len();
        let shift = left_padding
            .as_ref()
            .map_or(0, |p| p.iter().copied().min().unwrap_or(0));
        // With a cache, the memory's keys and values come from it where the input has no
        // memory.
        let from_cache = cache.is_some() && B::READS_MEMORY && matches!(memory, Memory::None);
        let offset = match &cache {
            Some(cache) => {
                check_cached(self.positions, layers, cache, x.dims()[1], shift)?;
                let kvs = &cache.memory;
                if from_cache && kvs.is_empty() && layers > 0 {
                    return Err(CacheError::NoMemory { module: self.name });
                }
                if from_cache && kvs.len() != layers {
                    return Err(CacheError::Layers {
                        layers,
                        caches: kvs.len(),
                    });
                }
                // Every layer's refusal, of its cache and of its memory, before the first
                // layer writes.
                for (i, (block, layer)) in self.blocks.iter().zip(&cache.layers).enumerate() {
                    block.check_cache(layer, &x, &mask)?;
                    let kv = kvs.get(i).filter(|_| from_cache);
                    block.check_memory(&layer_memory(&memory, kv), &memory_mask, &x);
                }
                cache.len()
            }
            None => 0,
        };
        // Each block's cache, and its keys and values of the memory when they come from
        // the cache.
        let parts: Vec<(Option<&mut KvCache>, Option<&MemoryKv>)> = match cache {
            Some(StackCache {
                layers: caches,
                memory: kvs,
            }) => {
                let kvs = kvs.iter().map(|kv| Some(kv).filter(|_| from_cache));
                caches
                    .iter_mut()
                    .map(Some)
                    .zip(kvs.chain(std::iter::repeat(None)))
                    .collect()
            }
            None => (0..layers).map(|_| (None, None)).collect(),
        };
        // The padding's mask once for every layer (their caches are alike), and the
        // positions from each row's first token.
        let mask = match &left_padding {
            Some(pads) => {
                let first = parts.iter().find_map(|(cache, _)| cache.as_deref());
                let tokens = x.dims()[1];
                crate::block::with_padding(mask, pads, tokens, first, &x.device())
            }
            None => mask,
        };
        let mut x = positioned(self.positions, x, offset, left_padding.as_deref());
        let mut weights = Vec::new();
        let mut first = 0;
        for (block, (cache, kv)) in self.blocks.iter().zip(parts) {
            let attention_layers = block.head_counts().len();
            let out = block.forward(BlockInput {
                x,
                memory: layer_memory(&memory, kv),
                mask: mask.clone(),
                memory_mask: memory_mask.clone(),
                cache,
                inspect: inspect.slice(first, attention_layers),
                left_padding: None,
            })?;
            weights.extend(out.weights);
            x = out.output;
            first += attention_layers;
        }
        Ok(BlockOutput {
            output: norm(self.norm, x),
            weights,
        })
    }
}

/// The memory of one layer of a stack: its keys and values `kv` from the cache, else the
/// input's memory.
fn layer_memory<'a>(memory: &Memory<'a>, kv: Option<&'a MemoryKv>) -> Memory<'a> {
    match (memory, kv) {
        (_, Some(kv)) => Memory::Projected(kv),
        (Memory::Tensor(m), None) => Memory::Tensor(m.clone()),
        (Memory::Projected(kv), None) => Memory::Projected(kv),
        (Memory::None, None) => Memory::None,
    }
}

fn norm(norm: &Option<LayerNorm>, x: Tensor<3>) -> Tensor<3> {
    match norm {
        Some(norm) => norm.forward(x),
        None => x,
    }
}

/// N encoder blocks and a final norm where configured (by default after pre-norm blocks).
#[derive(Module, Debug)]
pub struct Encoder {
    /// The blocks, first to last.
    pub layers: Vec<EncoderBlock>,
    /// The final norm, where the configuration asks for one (`final_norm`).
    pub norm: Option<LayerNorm>,
    /// Absolute positions added to the input, when the blocks' configuration asks for
    /// them.
    pub positions: Option<AbsolutePositions>,
}

impl Encoder {
    /// The stack over `input`: its blocks in turn (see [`EncoderBlock::forward`]), with
    /// the absolute positions added first and the final norm last. With a cache (from
    /// [`cache`](Self::cache); a stack of causal blocks: a decoder-only language model),
    /// the absolute positions continue at the cache's length; the head mask has one
    /// attention layer per block; the weights are every block's, first block first.
    ///
    /// # Shapes
    /// `x`: `[B, T, d_model]` -> output `[B, T, d_model]`; the mask broadcastable to
    /// `[B, H, T, T]` (`[B, H, T, keys seen]` with a cache).
    ///
    /// # Errors
    /// With a cache: [`CacheError::Layers`] for the caches of another stack,
    /// [`CacheError::Uneven`] for layers' caches at different positions,
    /// [`CacheError::PastPositions`] past the learned positions, and the blocks' errors
    /// ([`EncoderBlock::forward`]), every layer's checked before the first writes, so that
    /// a refused call leaves the cache as it was. Without a cache, none.
    ///
    /// # Panics
    /// As [`EncoderBlock::forward`], if the head mask's heads per attention layer are not
    /// the stack's ([`head_counts`](Self::head_counts)), and, without a cache, if the input
    /// runs past the learned positions.
    pub fn forward(&self, input: StackInput) -> Result<BlockOutput, CacheError> {
        self.stack().forward(input)
    }

    /// Caches for every layer, each like `cache` (e.g. [`KvCache::new`] with the longest
    /// sequence to decode), for [`BlockInput::cache`].
    pub fn cache(&self, cache: KvCache) -> StackCache {
        StackCache::new(self.layers.len(), cache)
    }

    /// The heads of every attention layer: one per block (see [`crate::inspect`]).
    pub fn head_counts(&self) -> Vec<usize> {
        self.stack().head_counts()
    }

    fn stack(&self) -> Stack<'_, EncoderBlock> {
        Stack {
            name: "Encoder",
            blocks: &self.layers,
            norm: &self.norm,
            positions: &self.positions,
        }
    }
}

/// N decoder blocks and a final norm where configured (by default after pre-norm blocks).
#[derive(Module, Debug)]
pub struct Decoder {
    /// The blocks, first to last.
    pub layers: Vec<DecoderBlock>,
    /// The final norm, where the configuration asks for one (`final_norm`).
    pub norm: Option<LayerNorm>,
    /// Absolute positions added to the input, when the blocks' configuration asks for
    /// them.
    pub positions: Option<AbsolutePositions>,
}

impl Decoder {
    /// The stack over `input`: its blocks in turn (see [`DecoderBlock::forward`]) over
    /// the input's memory, with the absolute positions added first and the final norm
    /// last. With a cache from [`cache`](Self::cache), the memory's keys and values are
    /// the cache's (when the input has no memory of its own) and the absolute positions
    /// continue at the cache's length. The head mask has two attention layers per block
    /// (its self-attention, then its cross-attention); the weights are theirs, in that
    /// order.
    ///
    /// # Shapes
    /// - `x`: `[B, Tq, d_model]` -> output `[B, Tq, d_model]`; memory `[B, Tk, d_model]`
    /// - the mask broadcastable to `[B, H, Tq, Tq]` (combined with causal where the blocks
    ///   are; `[B, H, Tq, keys seen]` with a cache), the memory mask to `[B, H, Tq, Tk]`
    ///
    /// # Errors
    /// With a cache: [`CacheError::Layers`] for the caches of another stack,
    /// [`CacheError::Uneven`] for layers' caches at different positions,
    /// [`CacheError::NoMemory`] for a cache without a memory and an input without one,
    /// [`CacheError::PastPositions`] past the learned positions, and the blocks' errors
    /// ([`DecoderBlock::forward`]: a block that is not causal, the caches'), every
    /// layer's checked before the first writes. Without a cache, none.
    ///
    /// # Panics
    /// As [`DecoderBlock::forward`], if the head mask's heads per attention layer are not
    /// the stack's ([`head_counts`](Self::head_counts)), and, without a cache, if the input
    /// runs past the learned positions.
    pub fn forward(&self, input: StackInput) -> Result<BlockOutput, CacheError> {
        self.stack().forward(input)
    }

    /// Caches for decoding against `memory` `[B, Tk, d_model]` (the encoder's output):
    /// every layer's cross-attention keys and values, computed here once, and a
    /// self-attention cache per layer like `cache`; for [`BlockInput::cache`].
    ///
    /// # Panics
    /// As [`DecoderBlock::memory_kv`].
    pub fn cache(&self, memory: Tensor<3>, cache: KvCache) -> StackCache {
        let mut caches = StackCache::new(self.layers.len(), cache);
        caches.memory = self
            .layers
            .iter()
            .map(|layer| layer.memory_kv(memory.clone()))
            .collect();
        caches
    }

    /// The heads of every attention layer: two per block, its self-attention's then its
    /// cross-attention's (see [`crate::inspect`]).
    pub fn head_counts(&self) -> Vec<usize> {
        self.stack().head_counts()
    }

    fn stack(&self) -> Stack<'_, DecoderBlock> {
        Stack {
            name: "Decoder",
            blocks: &self.layers,
            norm: &self.norm,
            positions: &self.positions,
        }
    }
}
