//! Multi-head attention modules for [Burn](https://burn.dev).
//!
//! The same numbers as PyTorch, on every Burn backend (flex, ndarray, wgpu, cuda), with
//! what neither PyTorch's `nn.MultiheadAttention` nor Burn's own module offers together:
//! typed masks whose fully-blocked rows give zeros instead of NaN, grouped-query
//! attention, weights computed only on request, a backward pass that recomputes the
//! scores instead of keeping them (flex, ndarray), long sequences in chunks that skip what
//! a causal mask blocks, positions (RoPE, ALiBi, relative biases), a decode cache written
//! in place, and import of PyTorch weights.
//!
//! | module | concept |
//! |---|---|
//! | [`mask`] | [`AttentionMask`]: what is blocked, in every convention; the causal rule and the blocked-score sentinels every path uses |
//! | [`attention`] | [`scaled_dot_product_attention`]: options, output, and the choice of path |
//! | `attention::dispatch` (private) | the path of a call, from the device's backend, autodiff, dtypes and sizes |
//! | `attention::explicit` (private) | matmul, mask, softmax, matmul; the weights, dropout, query chunks |
//! | `attention::recompute` (private) | the CPU op (a Burn backend extension) and its autodiff node, whose backward recomputes the weights |
//! | `cpu` (private) | the tiles' entry points over any CPU backend's tensors, their shared types, the mask of a tile |
//! | `cpu::forward` (private) | the forward pass in tiles: online softmax, output and log-sum-exp |
//! | `cpu::backward` (private) | the backward pass in tiles: weights recomputed from the log-sum-exp, key ranges per task |
//! | `cpu::gemm` (private) | the matrix kernels per instruction set (portable, AVX2 + FMA) and their tests |
//! | `cpu::math` (private) | the vectorised `exp` and dot product |
//! | `cpu::flex` (private) | how the tiles read flex's tensors in place |
//! | `cpu::ndarray` (private) | how the tiles read ndarray's arrays in place |
//! | `cpu::tests` (private) | the tiles against attention computed in f64, on every instruction set |
//! | [`positions`] | [`Positions`]: absolute embeddings, RoPE, ALiBi, learned relative biases |
//! | [`positions::absolute`] | sinusoidal and learned absolute positions, added to the input |
//! | [`positions::rotary`] | rotary embeddings of queries and keys, both layouts |
//! | [`positions::bias`] | biases by distance: ALiBi's slopes, clipped and T5 buckets, [`PositionBias`] |
//! | [`mha`] | [`MultiHeadAttention`]: projections and heads; self, cross, causal |
//! | [`cache`] | [`KvCache`]: decoding token by token, per layer and per stack; the cross-attention's keys and values once |
//! | [`block`] | [`EncoderBlock`], [`DecoderBlock`]: transformer blocks |
//! | `activation` (private) | the feed-forward's exact GELU: one operation with its own backward on the CPU backends |
//! | `cpu::gelu` (private) | GELU and its derivative over rows, with an `erf` that vectorises |
//! | `linear` (private) | the linear layers' products: one operation with its own backward on the CPU backends |
//! | `cpu::linear` (private) | those products and their gradients through the `gemm` crate |
//! | [`loss`] | [`loss::cross_entropy`]: one operation that writes its gradient in the same pass on the CPU backends |
//! | `cpu::loss` (private) | cross-entropy and its gradient over rows of logits |
//! | [`norm`] | [`LayerNorm`]: layer normalisation, one operation with its own backward on the CPU backends |
//! | `cpu::norm` (private) | layer norm and its gradients over rows, one pass each way |
//! | [`stack`] | [`Encoder`], [`Decoder`]: N blocks and a final norm |
//! | [`pytorch`] | loading PyTorch `state_dict`s saved as safetensors |
//! | [`analysis`] | looking inside: head masks and the weights of every layer, head statistics, importance, pruning |
//! | [`analysis::inspect`] | [`HeadMask`], [`Inspect`]: what a forward can be asked beyond its output |
//! | [`analysis::stats`] | [`HeadReport`]: entropy, distance, strongest link, same/previous/first shares per head |
//! | [`analysis::importance`] | [`HeadImportance`]: by ablation and by the head mask's gradient |
//! | [`analysis::prune`] | [`Heads`], [`PrunePlan`]: smaller modules equal to the masked ones |
//! | `analysis::maps` (feature `plot`) | heatmaps of the weights, PNG and SVG |
//! | [`error`] | [`ConfigError`], [`CacheError`], [`PruneError`] |
//!
//! Dependencies flow one way: `analysis`'s importance and pruning, then the modules users
//! import, then `attention`, then `cpu`, then `mask`; the head mask
//! (`analysis::inspect`) is a leaf the modules read.
//!
//! Conventions: shapes are batch-first (`[B, T, d_model]`); masks are `true = blocked`
//! unless the constructor says otherwise; configurations have `try_init` (a `Result`)
//! and `init` (panics with the same message).
#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod activation;
pub mod analysis;
pub mod attention;
pub mod block;
pub mod cache;
#[cfg(any(feature = "flex", feature = "ndarray"))]
mod cpu;
pub mod error;
mod linear;
pub mod loss;
pub mod mask;
pub mod mha;
pub mod norm;
pub mod positions;
pub mod pytorch;
pub mod stack;

pub use analysis::{HeadImportance, HeadMask, HeadReport, Heads, Inspect, Inspected, PrunePlan};
pub use attention::{AttentionOutput, AttentionWeights, SdpaOptions, scaled_dot_product_attention};
pub use block::{
    DecoderBlock, DecoderBlockConfig, EncoderBlock, EncoderBlockConfig, FeedForward,
    FeedForwardActivation,
};
pub use cache::{KvCache, MemoryKv, StackCache};
pub use error::{CacheError, ConfigError, PruneError};
pub use mask::{AttentionMask, CausalAlignment};
pub use mha::{MhaInput, MhaOutput, MultiHeadAttention, MultiHeadAttentionConfig};
pub use norm::LayerNorm;
pub use positions::{Buckets, PositionBias, Positions, Rope, RopeLayout};
pub use pytorch::{ImportError, LoadPyTorch, PyTorchWeights};
pub use stack::{Decoder, DecoderConfig, Encoder, EncoderConfig};
