//! Transformer blocks: an encoder block (self-attention, feed-forward) and a decoder
//! block (self-attention, causal by default, cross-attention, feed-forward), each with
//! residuals, LayerNorm (pre-norm by default, post-norm as an option) and dropout where
//! PyTorch's `nn.TransformerEncoderLayer` / `nn.TransformerDecoderLayer` put it, so
//! weights import one to one.

mod config;
mod input;

use burn::config::Config;
use burn::module::Module;
use burn::nn::{Dropout, Linear};
use burn::tensor::{Device, Tensor, TensorData};

pub use config::{DecoderBlockConfig, EncoderBlockConfig};
pub use input::{BlockInput, BlockOutput, StackInput};

use crate::attention::AttentionWeights;
use crate::cache::{KvCache, MemoryKv};
use crate::error::CacheError;
use crate::inspect::Inspect;
use crate::mask::AttentionMask;
use crate::mha::{MhaInput, MhaOutput, MultiHeadAttention};
use crate::norm::LayerNorm;
pub(crate) use input::Memory;

/// The feed-forward activation.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum FeedForwardActivation {
    /// Exact (erf) GELU, PyTorch's `"gelu"`.
    Gelu,
    /// ReLU, PyTorch's `"relu"` (its default).
    Relu,
    /// GELU's tanh approximation, `x/2 · (1 + tanh(√(2/π) (x + 0.044715 x³)))`: GPT-2's
    /// `gelu_new`, PyTorch's `gelu(x, approximate="tanh")`.
    GeluTanh,
    /// SiLU (swish), `x · σ(x)`: Llama's, Mistral's and Qwen's `hidden_act = "silu"`, in
    /// a gated feed-forward (SwiGLU).
    Silu,
}

impl FeedForwardActivation {
    /// Applies the activation.
    ///
    /// GELU is exact on every backend, values and gradient: one operation with a backward
    /// of its own on flex and ndarray in f32, written with `erf` elsewhere (see
    /// `ops::gelu`). Both GELUs compute half precision in f32 and round once, as
    /// PyTorch's.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        match self {
            Self::Gelu => crate::ops::gelu::gelu(x),
            Self::Relu => burn::tensor::activation::relu(x),
            Self::GeluTanh => crate::ops::gelu::gelu_tanh(x),
            Self::Silu => crate::ops::swiglu::silu(x),
        }
    }
}

/// `linear2(dropout(activation(linear1(x))))`, or gated (a GLU, SwiGLU with SiLU:
/// Llama's MLP) `linear2(dropout(activation(linear1(x)) · up(x)))`.
#[derive(Module, Debug)]
pub struct FeedForward {
    /// `[d_model, d_ff]` (Hugging Face's `gate_proj` when gated).
    pub linear1: Linear,
    /// The activation of `linear1`'s output.
    #[module(skip)]
    pub activation: FeedForwardActivation,
    /// `[d_model, d_ff]`, the gated feed-forward's other branch (Hugging Face's
    /// `up_proj`); `None` for PyTorch's two-layer feed-forward.
    pub up: Option<Linear>,
    /// Dropout on the hidden layer.
    pub dropout: Dropout,
    /// `[d_ff, d_model]` (Hugging Face's `down_proj` when gated).
    pub linear2: Linear,
}

impl FeedForward {
    /// # Shapes
    /// `[B, T, d_model]` -> `[B, T, d_model]`.
    ///
    /// # Panics
    /// With SiLU and `up`, if `up`'s width is not `linear1`'s (a module built by hand;
    /// the configuration builds them alike).
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let up = self
            .up
            .as_ref()
            .map(|up| crate::ops::linear::forward(up, x.clone()));
        // [B, T, d_ff]; GELU in the first layer's operation (see `ops::linear`), SwiGLU's
        // SiLU and product as one (see `ops::swiglu`).
        let hidden = match (self.activation, up) {
            (FeedForwardActivation::Silu, Some(up)) => {
                crate::ops::swiglu::swiglu(crate::ops::linear::forward(&self.linear1, x), up)
            }
            (FeedForwardActivation::Gelu, up) => {
                gated(crate::ops::linear::forward_gelu(&self.linear1, x), up)
            }
            (activation, up) => gated(
                activation.forward(crate::ops::linear::forward(&self.linear1, x)),
                up,
            ),
        };
        crate::ops::linear::forward(
            &self.linear2,
            crate::dropout::forward(&self.dropout, hidden),
        )
    }
}

/// `hidden · up` for a gated feed-forward, `hidden` for PyTorch's two-layer one.
fn gated(hidden: Tensor<3>, up: Option<Tensor<3>>) -> Tensor<3> {
    match up {
        Some(up) => hidden * up,
        None => hidden,
    }
}

/// A residual branch `x + dropout(f(norm(x)))` (pre-norm) or `norm(x + dropout(f(x)))`
/// (post-norm).
fn residual(
    x: Tensor<3>,
    norm: &LayerNorm,
    dropout: &Dropout,
    norm_first: bool,
    f: impl FnOnce(Tensor<3>) -> Result<Tensor<3>, CacheError>,
) -> Result<Tensor<3>, CacheError> {
    Ok(match norm_first {
        true => {
            let branch = crate::dropout::forward(dropout, f(norm.forward(x.clone()))?);
            crate::ops::add::add(x, branch)
        }
        false => {
            let branch = crate::dropout::forward(dropout, f(x.clone())?);
            norm.forward(crate::ops::add::add(x, branch))
        }
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
    /// The causal self-attention's sliding window, if it has one.
    pub window: Option<usize>,
}

impl EncoderBlock {
    /// The block over `input`: its tokens, its self-attention mask (with the causal rule
    /// when the block is causal), a cache when decoding (a causal block only), a head
    /// mask (one attention layer) and the weights when asked for.
    ///
    /// # Shapes
    /// - `x`: `[B, T, d_model]` -> output `[B, T, d_model]`
    /// - mask: broadcastable to `[B, H, T, T]` (`[B, H, T, keys seen]` with a cache)
    /// - weights: `[B, H, T, T]` (`[B, H, T, keys seen]`), when asked for
    ///
    /// # Errors
    /// With a cache: [`CacheError::NotCausal`] for a block that is not causal,
    /// [`CacheError::Window`] for a block with a window and a cache that does not slide
    /// over it (a block without a window decoded through a sliding cache attends to the
    /// cache's window: a context that slides past the lengths it was trained on), and the
    /// cache's errors ([`MultiHeadAttention::forward_cached`]). Without a
    /// cache, none.
    ///
    /// # Panics
    /// If `x` is not `[B, T, d_model]`, the mask does not broadcast, the input has a
    /// memory or a memory mask (an encoder block has no cross-attention), or the head mask
    /// is not one layer of `H` heads; as the attention's [`forward`](MultiHeadAttention::forward)
    /// for the mask (sinks or a position bias given twice, another device) and, with a
    /// cache, as [`forward_cached`](MultiHeadAttention::forward_cached) for its alignment.
    pub fn forward(&self, input: BlockInput) -> Result<BlockOutput, CacheError> {
        let weights = input.attention_weights();
        let BlockInput {
            x,
            memory,
            mask,
            memory_mask,
            cache,
            inspect,
            left_padding,
        } = input;
        check_pads("EncoderBlock", &left_padding, x.dims()[0]);
        check_no_memory(&memory, &memory_mask);
        if let Some(cache) = cache.as_deref() {
            self.check_cache(cache, &x, &mask)?;
        }
        let [head] = head_masks(&inspect, "EncoderBlock", &self.head_counts());
        let rule = match (self.causal, self.window) {
            (true, Some(window)) => Some(AttentionMask::sliding_window(window)),
            (true, None) => Some(AttentionMask::causal()),
            (false, _) => None,
        };
        let attention = SelfAttention {
            rule,
            weights,
            head,
            left_padding,
        };
        let mut all = Vec::new();
        let x = residual(x, &self.norm1, &self.dropout1, self.norm_first, |h| {
            let out = attention.run(&self.self_attn, h, mask, cache)?;
            all.extend(out.weights);
            Ok(out.context)
        })?;
        let output = residual(x, &self.norm2, &self.dropout2, self.norm_first, |h| {
            Ok(self.feed_forward.forward(h))
        })?;
        Ok(BlockOutput {
            output,
            weights: all,
        })
    }

    /// The heads of its one attention layer (see [`crate::inspect`]).
    pub fn head_counts(&self) -> Vec<usize> {
        self.self_attn.head_counts()
    }

    /// What a call of `x` under `mask` with `cache` would refuse before it writes: a block
    /// that is not causal, a window the cache does not slide over, the cache's own
    /// refusals; and, panicking, what its self-attention refuses of the mask.
    pub(crate) fn check_cache(
        &self,
        cache: &KvCache,
        x: &Tensor<3>,
        mask: &AttentionMask,
    ) -> Result<(), CacheError> {
        let block = CachedBlock {
            module: "EncoderBlock",
            causal: self.causal,
            window: self.window,
            attention: &self.self_attn,
        };
        block.check(cache, x, mask)
    }

    /// Panics as its forward does over a memory or a memory mask (it has no
    /// cross-attention).
    pub(crate) fn check_memory(
        &self,
        memory: &Memory,
        memory_mask: &AttentionMask,
        _x: &Tensor<3>,
    ) {
        check_no_memory(memory, memory_mask);
    }
}

/// Self-attention (causal unless configured otherwise), cross-attention to an encoded
/// memory, and feed-forward: PyTorch's `nn.TransformerDecoderLayer` (called with a causal
/// `tgt_mask`, which `tgt_is_causal=True` only hints at; `tgt_mask=None` where not causal).
#[derive(Module, Debug)]
pub struct DecoderBlock {
    /// Self-attention (causal where `causal`).
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
    /// Causal self-attention when true.
    pub causal: bool,
}

impl DecoderBlock {
    /// The block over `input`: its tokens, the memory its cross-attention reads (a
    /// tensor, or its keys and values from [`memory_kv`](Self::memory_kv)), the
    /// self-attention's mask (with the causal rule when the block is causal) and the
    /// memory's, a cache when decoding (a causal block only), a head mask (two attention
    /// layers: the self-attention, then the cross-attention) and both attentions' weights
    /// when asked for.
    ///
    /// # Shapes
    /// - `x`: `[B, Tq, d_model]` -> output `[B, Tq, d_model]`; memory `[B, Tk, d_model]`
    /// - mask: broadcastable to `[B, H, Tq, Tq]` (`[B, H, Tq, keys seen]` with a cache);
    ///   memory mask: to `[B, H, Tq, Tk]` (e.g. the memory's padding)
    /// - weights: the self-attention's `[B, H, Tq, Tq]`, then the cross-attention's
    ///   `[B, H, Tq, Tk]`, when asked for
    ///
    /// # Errors
    /// With a cache: [`CacheError::NotCausal`] for a block that is not causal, and the
    /// cache's errors ([`MultiHeadAttention::forward_cached`]); without a cache, none.
    ///
    /// # Panics
    /// If the shapes disagree, a mask does not broadcast, the input has no memory (or one
    /// on another device or of another dtype than `x`), or the head mask does not have
    /// the block's two attention layers; as the attention's
    /// [`forward`](MultiHeadAttention::forward) for the masks (sinks or a position bias
    /// given twice, another device) and, with a cache, as
    /// [`forward_cached`](MultiHeadAttention::forward_cached) for its alignment.
    pub fn forward(&self, input: BlockInput) -> Result<BlockOutput, CacheError> {
        let weights = input.attention_weights();
        let BlockInput {
            x,
            memory,
            mask,
            memory_mask,
            cache,
            inspect,
            left_padding,
        } = input;
        check_pads("DecoderBlock", &left_padding, x.dims()[0]);
        check_memory(&memory, &memory_mask, &self.cross_attn, &x);
        if let Some(cache) = cache.as_deref() {
            self.check_cache(cache, &x, &mask)?;
        }
        let [head, cross_head] = head_masks(&inspect, "DecoderBlock", &self.head_counts());
        let attention = SelfAttention {
            rule: self.causal.then(AttentionMask::causal),
            weights,
            head,
            left_padding,
        };
        let mut all = Vec::new();
        let x = residual(x, &self.norm1, &self.dropout1, self.norm_first, |h| {
            let out = attention.run(&self.self_attn, h, mask, cache)?;
            all.extend(out.weights);
            Ok(out.context)
        })?;
        let x = residual(x, &self.norm2, &self.dropout2, self.norm_first, |h| {
            let out = match memory {
                Memory::Tensor(memory) => {
                    let input = MhaInput::cross(h, memory).mask(memory_mask);
                    self.cross_attn
                        .forward(with_head(input.weights(weights), cross_head))
                }
                Memory::Projected(kv) => {
                    let attn = &self.cross_attn;
                    attn.cross_cached(h, kv, memory_mask, weights, cross_head)
                }
                Memory::None => unreachable!("`check_memory` refuses a missing memory"),
            };
            all.extend(out.weights);
            Ok(out.context)
        })?;
        let output = residual(x, &self.norm3, &self.dropout3, self.norm_first, |h| {
            Ok(self.feed_forward.forward(h))
        })?;
        Ok(BlockOutput {
            output,
            weights: all,
        })
    }

    /// The cross-attention's keys and values of `memory` `[B, Tk, d_model]`, computed once
    /// for every decoding step ([`BlockInput::memory_kv`]).
    ///
    /// # Panics
    /// As [`MultiHeadAttention::memory_kv`]: if `memory` is not `d_model` wide or is on
    /// another device than the block.
    pub fn memory_kv(&self, memory: Tensor<3>) -> MemoryKv {
        self.cross_attn.memory_kv(memory)
    }

    /// The heads of its two attention layers: the self-attention's, then the
    /// cross-attention's (see [`crate::inspect`]).
    pub fn head_counts(&self) -> Vec<usize> {
        vec![self.self_attn.n_heads, self.cross_attn.n_heads]
    }

    /// What a call of `x` under `mask` with `cache` would refuse before it writes: a block
    /// that is not causal, the cache's own refusals; and, panicking, what its
    /// self-attention refuses of the mask.
    pub(crate) fn check_cache(
        &self,
        cache: &KvCache,
        x: &Tensor<3>,
        mask: &AttentionMask,
    ) -> Result<(), CacheError> {
        let block = CachedBlock {
            module: "DecoderBlock",
            causal: self.causal,
            window: None,
            attention: &self.self_attn,
        };
        block.check(cache, x, mask)
    }

    /// Panics as its forward does over the memory of its cross-attention and its mask
    /// (see [`check_memory`]).
    pub(crate) fn check_memory(&self, memory: &Memory, memory_mask: &AttentionMask, x: &Tensor<3>) {
        check_memory(memory, memory_mask, &self.cross_attn, x);
    }
}

/// What a block's cached call depends on: its name in errors, whether it is causal, its
/// window, its self-attention.
struct CachedBlock<'a> {
    module: &'static str,
    causal: bool,
    window: Option<usize>,
    attention: &'a MultiHeadAttention,
}

impl CachedBlock<'_> {
    /// What a call of `x` under `mask` with `cache` would refuse before it writes: a block
    /// that is not causal, a window the cache does not slide over, the cache's own
    /// refusals; and, panicking, what the self-attention refuses of the mask.
    fn check(
        &self,
        cache: &KvCache,
        x: &Tensor<3>,
        mask: &AttentionMask,
    ) -> Result<(), CacheError> {
        if !self.causal {
            return Err(CacheError::NotCausal {
                module: self.module,
            });
        }
        if let Some(window) = self.window
            && cache.window() != Some(window)
        {
            return Err(CacheError::Window {
                window,
                cache: cache.window(),
            });
        }
        // First, as the module's cached call refuses it (and before the mask's shape is
        // checked against the cache's keys, which a packed mask's never fits).
        if mask.rule().packed.is_some() {
            return Err(CacheError::Packed);
        }
        cache.check_write(&self.attention.brought(x))?;
        self.attention.check_cached_call(x, cache, mask);
        Ok(())
    }
}

/// A block's self-attention: causal or not, the weights it returns, its head mask, the
/// padding its rows begin with.
struct SelfAttention {
    /// The mask by position a causal block adds (causal, or a sliding window).
    rule: Option<AttentionMask>,
    weights: AttentionWeights,
    head: Option<Tensor<1>>,
    left_padding: Option<Vec<usize>>,
}

impl SelfAttention {
    /// `attention` of `h` under `mask` (and the causal rule), through `cache` when
    /// decoding (whose rule is causal: `mask` adds to it).
    fn run(
        self,
        attention: &MultiHeadAttention,
        h: Tensor<3>,
        mask: AttentionMask,
        cache: Option<&mut KvCache>,
    ) -> Result<MhaOutput, CacheError> {
        let mask = match &self.left_padding {
            Some(pads) => with_padding(mask, pads, h.dims()[1], cache.as_deref(), &h.device()),
            None => mask,
        };
        if let Some(cache) = cache {
            return attention.cached(h, cache, mask, self.weights, self.head);
        }
        let mask = match self.rule {
            Some(rule) => mask.and(rule),
            None => mask,
        };
        let input = MhaInput::self_attn(h).mask(mask).weights(self.weights);
        Ok(attention.forward(with_head(input, self.head)))
    }
}

/// `mask` and the left padding `pads` of a self-attention call of `tokens` tokens through
/// `cache` (or none): the keys it sees blocked where they are padding (a call of no token
/// weighs no key: `mask` as it is).
///
/// # Panics
/// Naming both devices, if a part of `mask` is on another device than the input's
/// (`device`).
pub(crate) fn with_padding(
    mask: AttentionMask,
    pads: &[usize],
    tokens: usize,
    cache: Option<&KvCache>,
    device: &Device,
) -> AttentionMask {
    if tokens == 0 {
        return mask;
    }
    mask.check_device(device, "the input");
    let (first, keys) = match cache {
        Some(cache) => (cache.first_key_position(tokens), cache.keys_seen(tokens)),
        None => (0, tokens),
    };
    mask.and(padding_mask(pads, first, keys, device))
}

/// The keys at positions `first..first + keys` blocked where they are padding: before
/// position `pads[b]` of batch row `b`.
fn padding_mask(pads: &[usize], first: usize, keys: usize, device: &Device) -> AttentionMask {
    let blocked: Vec<bool> = pads
        .iter()
        .flat_map(|&pad| (first..first + keys).map(move |position| position < pad))
        .collect();
    let data = TensorData::new(blocked, [pads.len(), keys]);
    AttentionMask::key_padding(Tensor::from_data(data, device))
}

/// Checks that `pads` has one entry for each of the `batch` rows of `x`.
///
/// # Panics
/// Naming `module`, both counts.
pub(crate) fn check_pads(module: &str, pads: &Option<Vec<usize>>, batch: usize) {
    if let Some(pads) = pads {
        assert!(
            pads.len() == batch,
            "{module}: left_padding has {} entries for a batch of {batch} rows",
            pads.len()
        );
    }
}

/// Each attention layer's row of the head mask of `inspect`, checked against the module's
/// `counts` (one per attention layer).
///
/// # Panics
/// Naming `module` and both shapes when the head mask has other layers or heads.
fn head_masks<const N: usize>(
    inspect: &Inspect,
    module: &str,
    counts: &[usize],
) -> [Option<Tensor<1>>; N] {
    match &inspect.head_mask {
        Some(m) => {
            m.check(module, counts);
            std::array::from_fn(|layer| Some(m.layer(layer).clone()))
        }
        None => std::array::from_fn(|_| None),
    }
}

fn with_head(input: MhaInput, head_mask: Option<Tensor<1>>) -> MhaInput {
    match head_mask {
        Some(mask) => input.head_mask(mask),
        None => input,
    }
}

/// Panics when an encoder block's input has a memory or a memory mask: it has no
/// cross-attention to give them to (a memory mask ignored would leave padding attended).
pub(crate) fn check_no_memory(memory: &Memory, memory_mask: &AttentionMask) {
    assert!(
        matches!(memory, Memory::None),
        "EncoderBlock: the input has a memory, and an encoder block has no \
         cross-attention (DecoderBlock has)"
    );
    assert!(
        memory_mask.is_none(),
        "EncoderBlock: the input has a memory mask, and an encoder block has no \
         cross-attention to apply it to (its own mask is BlockInput::mask)"
    );
}

/// Panics naming the memory of a decoder block's cross-attention before its
/// self-attention writes to a cache: a memory missing, of another batch, device or dtype
/// than the input `x`'s, a tensor not as wide as `attention` takes, keys and values of
/// another module's heads, a memory mask that does not broadcast to the
/// cross-attention's scores `[B, H, tokens, memory length]`, or one with attention sinks
/// where the cross-attention has its own; and a cross-attention that cannot take the
/// memory whatever it is (one given positions, or `kdim` and `vdim` that differ for one
/// tensor, in a block put together by hand) or not as wide as `x`.
pub(crate) fn check_memory(
    memory: &Memory,
    memory_mask: &AttentionMask,
    attention: &MultiHeadAttention,
    x: &Tensor<3>,
) {
    let [batch, tokens, width] = x.dims();
    attention.refuse_positions("DecoderBlock's cross-attention");
    assert!(
        width == attention.d_model(),
        "DecoderBlock: the input is {width} wide and the cross-attention takes {}",
        attention.d_model()
    );
    let (memory_batch, length, device, dtype) = match memory {
        Memory::None => panic!(
            "DecoderBlock: the input has no memory for the cross-attention \
             (BlockInput::memory or BlockInput::memory_kv)"
        ),
        Memory::Tensor(memory) => {
            attention.check_one_source("BlockInput::memory(memory)");
            let [b, length, width] = memory.dims();
            assert!(
                width == attention.kdim,
                "DecoderBlock: the memory is {width} wide and the cross-attention takes {}",
                attention.kdim
            );
            (b, length, memory.device(), memory.dtype())
        }
        Memory::Projected(kv) => {
            let [b, heads, length, head_dim] = kv.keys_dims();
            let ours = [attention.n_kv_heads, attention.head_dim];
            assert!(
                [heads, head_dim] == ours,
                "DecoderBlock: the memory's keys and values are {heads} heads {head_dim} wide \
                 and the cross-attention's {} heads {} wide (MemoryKv of another module)",
                ours[0],
                ours[1]
            );
            (b, length, kv.keys.device(), kv.keys.dtype())
        }
    };
    assert!(
        device == x.device(),
        "DecoderBlock: the memory is on {device:?} and the input on {:?}",
        x.device()
    );
    assert!(
        dtype == x.dtype(),
        "DecoderBlock: the memory is {dtype:?} and the input {:?}",
        x.dtype()
    );
    assert!(
        memory_batch == batch,
        "DecoderBlock: the memory's batch is {memory_batch} and the input's {batch}"
    );
    memory_mask.check([batch, attention.n_heads, tokens, length], &x.device());
    attention.check_attend(memory_mask, None);
}
