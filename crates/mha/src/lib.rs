// The user's page is the crate's README; the map of the modules, for whoever changes
// them, is the repository's docs/architecture.md.
#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

pub mod analysis;
pub mod attention;
pub mod block;
pub mod cache;
mod configs;
#[cfg(feature = "cpu-kernels")]
mod cpu;
mod dispatch;
pub mod dropout;
pub mod dtype;
mod empty;
pub mod error;
mod from_burn;
#[cfg(feature = "gpu-kernels")]
mod gpu;
pub mod hf;
pub mod inspect;
pub mod linear;
pub mod loss;
pub mod mask;
pub mod mha;
pub mod norm;
#[cfg(any(feature = "cpu-kernels", feature = "gpu-kernels"))]
mod op;
mod ops;
pub mod optim;
pub mod positions;
mod problem;
pub mod pytorch;
#[cfg(any(feature = "cpu-kernels", feature = "gpu-kernels"))]
mod sinks;
#[cfg(feature = "vulkan")]
pub mod spirv;
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
pub use error::{CacheError, ConfigError, ConversionError, DTypeError, PruneError};
pub use inspect::{HeadMask, Inspect};
pub use mask::{AttentionMask, CausalAlignment};
pub use mha::{MhaInput, MhaOutput, MultiHeadAttention, MultiHeadAttentionConfig};
pub use norm::{LayerNorm, NormKind};
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

    /// Runs the ignored test `name` (its full path, `module::tests::name`) of this test
    /// binary in a process of its own, and fails with its output if it fails: for a test
    /// that seeds a backend's generator, which every test drawing random values on another
    /// thread of this process shares.
    pub(crate) fn in_own_process(name: &str) {
        let out = std::process::Command::new(std::env::current_exe().expect("the test binary"))
            .args([name, "--exact", "--ignored", "--test-threads=1"])
            .output()
            .expect("the test binary runs");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success(),
            "{name} failed in its own process:\n{text}"
        );
        assert!(text.contains("1 passed"), "{name} did not run: {text}");
    }
}
