//! Multi-head attention modules for [Burn](https://burn.dev).
//!
//! The same numbers as PyTorch, on every Burn backend (flex, ndarray, wgpu, cuda), with
//! what neither PyTorch's `nn.MultiheadAttention` nor Burn's own module offers together:
//! typed masks whose fully-blocked rows give zeros instead of NaN, grouped-query
//! attention, weights computed only on request, a backward pass that recomputes the
//! scores instead of keeping them (flex, ndarray), long sequences in chunks that skip what
//! a causal mask blocks, and import of PyTorch weights.
//!
//! | file | concept |
//! |---|---|
//! | [`mask`] | [`AttentionMask`]: what is blocked, in every convention |
//! | [`attention`] | [`scaled_dot_product_attention`]: the core, fused or explicit |
//! | [`mha`] | [`MultiHeadAttention`]: projections and heads; self, cross, causal |
//! | [`block`] | [`EncoderBlock`], [`DecoderBlock`]: transformer blocks |
//! | [`stack`] | [`Encoder`], [`Decoder`]: N blocks and a final norm |
//! | [`pytorch`] | loading PyTorch `state_dict`s saved as safetensors |
//! | [`error`] | [`ConfigError`] |
//!
//! Conventions: shapes are batch-first (`[B, T, d_model]`); masks are `true = blocked`
//! unless the constructor says otherwise; configurations have `try_init` (a `Result`)
//! and `init` (panics with the same message).
#![doc = include_str!("../../../README.md")]
#![warn(missing_docs)]

pub mod attention;
pub mod block;
pub mod error;
pub mod mask;
pub mod mha;
pub mod pytorch;
#[cfg(any(feature = "flex", feature = "ndarray"))]
mod recompute;
#[cfg(any(feature = "flex", feature = "ndarray"))]
mod rows;
pub mod stack;
#[cfg(any(feature = "flex", feature = "ndarray"))]
mod tiled;

pub use attention::{AttentionOutput, AttentionWeights, SdpaOptions, scaled_dot_product_attention};
pub use block::{
    DecoderBlock, DecoderBlockConfig, EncoderBlock, EncoderBlockConfig, FeedForward,
    FeedForwardActivation,
};
pub use error::ConfigError;
pub use mask::AttentionMask;
pub use mha::{MhaInput, MhaOutput, MultiHeadAttention, MultiHeadAttentionConfig};
pub use pytorch::{ImportError, LoadPyTorch, PyTorchWeights};
pub use stack::{Decoder, DecoderConfig, Encoder, EncoderConfig};
