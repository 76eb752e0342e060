//! What a block's or a stack's forward takes ([`BlockInput`]) and gives ([`BlockOutput`]):
//! one forward for every use, as [`MhaInput`](crate::MhaInput) is for attention.

use burn::tensor::Tensor;

use crate::attention::AttentionWeights;
use crate::cache::{KvCache, MemoryKv, StackCache};
use crate::inspect::{HeadMask, Inspect};
use crate::mask::AttentionMask;

/// The input of [`EncoderBlock::forward`](crate::EncoderBlock::forward) and
/// [`DecoderBlock::forward`](crate::DecoderBlock::forward) (`C` = [`KvCache`]), and of the
/// stacks' (`C` = [`StackCache`], [`StackInput`]): the tokens, the memory a decoder
/// attends to, the masks, a decode cache, and what to return beyond the output.
///
/// ```
/// use burn::tensor::{Device, Distribution, Tensor};
/// use mha::{BlockInput, EncoderBlockConfig, KvCache};
///
/// let device = Device::default();
/// let block = EncoderBlockConfig::new(16, 2).with_causal(true).init(&device);
/// let x = Tensor::<3>::random([1, 5, 16], Distribution::Default, &device);
/// let whole = block.forward(BlockInput::new(x.clone()).weights()).unwrap();
/// assert_eq!(whole.weights[0].dims(), [1, 2, 5, 5]);
///
/// // The same outputs token by token through a cache.
/// let mut cache = KvCache::new(5);
/// for t in 0..5 {
///     let token = x.clone().narrow(1, t, 1);
///     let out = block.forward(BlockInput::new(token).cache(&mut cache)).unwrap();
///     let want = whole.output.clone().narrow(1, t, 1);
///     assert!(out.output.sub(want).abs().max().into_scalar::<f32>() < 1e-5);
/// }
/// ```
#[derive(Debug)]
pub struct BlockInput<'c, C = KvCache> {
    pub(crate) x: Tensor<3>,
    pub(crate) memory: Memory<'c>,
    pub(crate) mask: AttentionMask,
    pub(crate) memory_mask: AttentionMask,
    pub(crate) cache: Option<&'c mut C>,
    pub(crate) inspect: Inspect,
    /// The padding tokens each batch row begins with.
    pub(crate) left_padding: Option<Vec<usize>>,
}

/// The input of [`Encoder::forward`](crate::Encoder::forward) and
/// [`Decoder::forward`](crate::Decoder::forward): a [`BlockInput`] whose cache holds every
/// layer's.
pub type StackInput<'c> = BlockInput<'c, StackCache>;

/// What a decoder's cross-attention reads.
// Lives for one forward call.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum Memory<'c> {
    /// Nothing: an encoder's input.
    None,
    /// The encoder's output `[B, Tk, d_model]`, projected at each call.
    Tensor(Tensor<3>),
    /// Its keys and values, projected once
    /// ([`DecoderBlock::memory_kv`](crate::DecoderBlock::memory_kv)).
    Projected(&'c MemoryKv),
}

impl<'c, C> BlockInput<'c, C> {
    /// The tokens `x` `[B, T, d_model]`, with no mask, no memory, no cache, and nothing
    /// asked beyond the output.
    pub fn new(x: Tensor<3>) -> Self {
        Self {
            x,
            memory: Memory::None,
            mask: AttentionMask::none(),
            memory_mask: AttentionMask::none(),
            cache: None,
            inspect: Inspect::new(),
            left_padding: None,
        }
    }

    /// The memory `[B, Tk, d_model]` a decoder's cross-attention reads (the encoder's
    /// output).
    pub fn memory(mut self, memory: Tensor<3>) -> Self {
        self.memory = Memory::Tensor(memory);
        self
    }

    /// Adds a mask of the self-attention, broadcastable to `[B, H, T, T]` (to `[B, H, T,
    /// keys seen]` with a cache: [`KvCache::keys_seen`]), combined with any mask already
    /// set and with the causal rule of a causal block.
    pub fn mask(mut self, mask: AttentionMask) -> Self {
        self.mask = core::mem::take(&mut self.mask).and(mask);
        self
    }

    /// Adds a mask of a decoder's cross-attention, broadcastable to `[B, H, T, Tk]` (the
    /// memory's padding, say), combined with any already set.
    pub fn memory_mask(mut self, mask: AttentionMask) -> Self {
        self.memory_mask = core::mem::take(&mut self.memory_mask).and(mask);
        self
    }

    /// Row `b` of the batch begins with `pads[b]` padding tokens: prompts of different
    /// lengths padded on the left, to be decoded together. Its padding is blocked as keys
    /// of the self-attention (in every call of a decode: the keys it sees include the
    /// prompt's), and a stack's absolute positions count from its first real token, as
    /// transformers' `position_ids` of a left-padded batch (the positions of RoPE, ALiBi
    /// and relative biases depend on distances only). Each real token's output is then
    /// that of its row alone; a padding token's is finite and not meant to be read (in a
    /// causal block its self-attention sees no key; the residual and the feed-forward
    /// still act).
    ///
    /// # Panics
    /// In the forward, if `pads` does not have one entry per batch row.
    pub fn left_padding(mut self, pads: Vec<usize>) -> Self {
        self.left_padding = Some(pads);
        self
    }

    /// Decodes with `cache`, which keeps the self-attentions' keys and values of the
    /// tokens before `x` (see [`crate::cache`]): a prompt, then one token per call.
    pub fn cache(mut self, cache: &'c mut C) -> Self {
        self.cache = Some(cache);
        self
    }

    /// Asks what `inspect` says: a head mask, the weights.
    pub fn inspect(mut self, inspect: Inspect) -> Self {
        self.inspect = inspect;
        self
    }

    /// Multiplies each head's output by its weight in `mask` (one attention layer per
    /// self- or cross-attention, in order: see [`crate::inspect`]).
    pub fn head_mask(mut self, mask: HeadMask) -> Self {
        self.inspect.head_mask = Some(mask);
        self
    }

    /// Returns the weights `[B, H, T, keys]` of every attention layer.
    pub fn weights(mut self) -> Self {
        self.inspect.weights = true;
        self
    }

    /// The weights the attentions return.
    pub(crate) fn attention_weights(&self) -> AttentionWeights {
        match self.inspect.weights {
            true => AttentionWeights::PerHead,
            false => AttentionWeights::None,
        }
    }
}

impl<'c> BlockInput<'c, KvCache> {
    /// The cross-attention's keys and values of the memory, projected once by
    /// [`DecoderBlock::memory_kv`](crate::DecoderBlock::memory_kv) for every decoding
    /// step (instead of [`memory`](Self::memory)). For decoding: the cross-attention's
    /// dropout does not act on them, in training too.
    pub fn memory_kv(mut self, memory: &'c MemoryKv) -> Self {
        self.memory = Memory::Projected(memory);
        self
    }
}

/// The output of a block's or a stack's forward.
#[derive(Clone, Debug)]
pub struct BlockOutput {
    /// `[B, T, d_model]`.
    pub output: Tensor<3>,
    /// Each attention layer's weights `[B, H, T, keys]`, in the order of the module's
    /// attention layers (see [`crate::inspect`]), when asked for
    /// ([`BlockInput::weights`]); empty otherwise.
    pub weights: Vec<Tensor<4>>,
}
