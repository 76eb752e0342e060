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
//! | [`positions`] | [`Positions`]: absolute embeddings ([`positions::absolute`]), RoPE ([`positions::rotary`]), ALiBi and learned relative biases ([`positions::bias`]) |
//! | `dispatch` (private) | the one place that decides how an operation runs: the path of attention, our row operations or Burn's, the dtype they run in |
//! | `cpu` (private) | the CPU kernels, a file or folder per job: `isa` (instruction set), `tensors` (reading flex's and ndarray's tensors in place), `gemm` (the tiles' matrix kernel), `math`, `attention` (the tiles, forward and backward, tested against f64), `rows` (GELU, layer norm, cross-entropy, AdamW's step, the residual add), `linear` (the `gemm` crate, by blocks of rows), `blocks` (the parallel loop whose caller waits by spinning) |
//! | `problem` (private) | the sizes of an attention call and how its scores are made, which the CPU tiles and the GPU kernels share |
//! | `gpu` (private) | the GPU kernels of our own in CubeCL (wgpu, cuda): `tile` (the tile product), `scores` (what every kernel reads: the call, its blocks, each score), `forward` (output and log-sum-exp), `backward` (recomputing: `D`, `dQ` with the bias gradients' partial sums, `dK`/`dV`), `launch` (tiles, grid, the passes), `ops` (the backend extension on `CubeBackend`, fusion and autodiff) |
//! | `op` (private) | the pattern of an operation of our own, written once: forward, what it keeps, backward, its autodiff node |
//! | `ops` (private) | the operations: attention (backward recomputing the weights), linear (and linear with GELU, for the feed-forward), layer norm, GELU, cross-entropy, AdamW's step, the residual add; one backend extension carries them all |
//! | [`attention`] | [`scaled_dot_product_attention`]: options, output; the explicit path (matmul, mask, softmax, matmul: weights, dropout, query chunks) |
//! | [`dropout`] | Burn's `Dropout` with the mask drawn in parallel on the CPU backends |
//! | [`norm`] | [`LayerNorm`]: Burn's parameters and record, our operation |
//! | [`loss`] | [`loss::cross_entropy`]: PyTorch's, with no NaN when every target is ignored |
//! | [`linear`] | [`linear::linear`]: `x W + b` for a weight of the caller's (a tied head), through the layers' own operation |
//! | [`inspect`] | [`HeadMask`], [`Inspect`]: what a forward can be asked beyond its output |
//! | [`cache`] | [`KvCache`]: decoding token by token, per layer and per stack; the cross-attention's keys and values once |
//! | [`mha`] | [`MultiHeadAttention`]: projections and heads; self, cross, causal |
//! | [`block`] | [`EncoderBlock`], [`DecoderBlock`], their configurations, and the one input and output of blocks and stacks ([`BlockInput`], [`BlockOutput`]) |
//! | [`stack`] | [`Encoder`], [`Decoder`]: N blocks and a final norm |
//! | [`pytorch`] | loading PyTorch `state_dict`s saved as safetensors |
//! | [`analysis`] | looking inside: head statistics ([`HeadReport`]), importance ([`HeadImportance`]), pruning ([`Heads`], [`PrunePlan`]), maps of the weights (feature `plot`) |
//! | [`dtype`] | [`ModuleDType`]: the float dtype of a whole module, and one cast for every module |
//! | [`error`] | [`ConfigError`], [`CacheError`], [`PruneError`], [`DTypeError`] |
//! | `workers` (private) | [`on_cpu_workers`]: a step run on the CPU backends' thread pool, its other workers spinning for its work |
//! | [`optim`] | [`optim::AdamW`]: Burn's AdamW, each parameter's step one parallel pass on the CPU backends; [`optim::clip_grad_norm`]: PyTorch's clipping by the global norm |
//!
//! Dependencies flow one way, down this list read from the bottom: `analysis` and
//! `pytorch` use the modules users import (`stack`, `block`, `mha`, `cache`, `norm`,
//! `loss`, `linear`), which use `attention` and `ops`; those ask `dispatch` and run through `op`
//! over `cpu`; everything may use the leaves (`mask`, `positions`, `problem`, `inspect`, `error`).
//! No module imports one above it.
//!
//! Conventions: shapes are batch-first (`[B, T, d_model]`); masks are `true = blocked`
//! unless the constructor says otherwise; configurations have `try_init` (a `Result`)
//! and `init` (panics with the same message). Zero-sized inputs are ordinary input on
//! every backend: an empty batch or sequence gives an empty output of its shape, a
//! cross-attention over an empty memory (no key) gives zeros before its output
//! projection, cached decoding of an empty prompt changes nothing, cross-entropy over
//! no row is 0; under autodiff each input and parameter gets a gradient of its shape
//! (0 where the loss does not depend on it). `dispatch` decides this once, for
//! attention and for the row operations.
#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

pub mod analysis;
pub mod attention;
pub mod block;
pub mod cache;
#[cfg(any(feature = "flex", feature = "ndarray"))]
mod cpu;
mod dispatch;
pub mod dropout;
pub mod dtype;
mod empty;
pub mod error;
#[cfg(any(feature = "wgpu", feature = "cuda"))]
mod gpu;
pub mod inspect;
pub mod linear;
pub mod loss;
pub mod mask;
pub mod mha;
pub mod norm;
#[cfg(any(
    feature = "flex",
    feature = "ndarray",
    feature = "wgpu",
    feature = "cuda"
))]
mod op;
mod ops;
pub mod optim;
pub mod positions;
mod problem;
pub mod pytorch;
pub mod stack;
mod workers;

pub use analysis::{HeadImportance, HeadReport, Heads, PrunePlan};
pub use attention::{AttentionOutput, AttentionWeights, SdpaOptions, scaled_dot_product_attention};
pub use block::{
    BlockInput, BlockOutput, DecoderBlock, DecoderBlockConfig, EncoderBlock, EncoderBlockConfig,
    FeedForward, FeedForwardActivation, StackInput,
};
pub use cache::{KvCache, MemoryKv, StackCache};
pub use dtype::ModuleDType;
pub use error::{CacheError, ConfigError, DTypeError, PruneError};
pub use inspect::{HeadMask, Inspect};
pub use mask::{AttentionMask, CausalAlignment};
pub use mha::{MhaInput, MhaOutput, MultiHeadAttention, MultiHeadAttentionConfig};
pub use norm::LayerNorm;
pub use positions::{Buckets, PositionBias, Positions, Rope, RopeLayout};
pub use pytorch::{ImportError, LoadPyTorch, PyTorchWeights};
pub use stack::{Decoder, DecoderConfig, Encoder, EncoderConfig};
pub use workers::on_cpu_workers;

/// What the unit tests share.
#[cfg(test)]
pub(crate) mod testing {
    use burn::tensor::Device;

    /// Every device compiled in, with autodiff.
    #[allow(deprecated, clippy::vec_init_then_push)] // Burn 0.22 deprecates ndarray.
    pub(crate) fn devices() -> Vec<Device> {
        let mut all = Vec::new();
        #[cfg(feature = "flex")]
        all.push(Device::flex());
        #[cfg(feature = "ndarray")]
        all.push(Device::ndarray());
        #[cfg(feature = "wgpu")]
        all.push(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice));
        all.into_iter().map(Device::autodiff).collect()
    }
}
