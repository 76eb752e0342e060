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
    use std::cell::Cell;
    use std::sync::{Mutex, MutexGuard, PoisonError};

    use burn::tensor::Device;

    /// Every device compiled in, with autodiff, and the GPU's turn where one is among
    /// them (held while the list or its iterator lives).
    #[allow(deprecated, clippy::vec_init_then_push)] // Burn 0.22 deprecates ndarray.
    pub(crate) fn devices() -> Devices {
        let mut all = Vec::new();
        #[cfg(feature = "flex")]
        all.push(Device::flex());
        #[cfg(feature = "ndarray")]
        all.push(Device::ndarray());
        #[cfg(feature = "wgpu")]
        all.push(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice));
        Devices {
            _turn: cfg!(feature = "wgpu").then(GpuTurn::take),
            list: all.into_iter().map(Device::autodiff).collect(),
        }
    }

    /// The devices of [`devices`], with the GPU's turn.
    pub(crate) struct Devices {
        list: Vec<Device>,
        _turn: Option<GpuTurn>,
    }

    impl Devices {
        /// The devices in order.
        pub(crate) fn iter(&self) -> std::slice::Iter<'_, Device> {
            self.list.iter()
        }

        /// The device at `index`, without the GPU's turn: for a test of a CPU device (the
        /// first one where flex or ndarray is compiled in).
        pub(crate) fn remove(mut self, index: usize) -> Device {
            self.list.remove(index)
        }
    }

    impl IntoIterator for Devices {
        type Item = Device;
        type IntoIter = DevicesIter;

        /// The devices, the GPU's turn held until the iterator is dropped.
        fn into_iter(self) -> DevicesIter {
            DevicesIter {
                list: self.list.into_iter(),
                _turn: self._turn,
            }
        }
    }

    /// The devices of [`devices`] one by one, with the GPU's turn.
    pub(crate) struct DevicesIter {
        list: std::vec::IntoIter<Device>,
        _turn: Option<GpuTurn>,
    }

    impl Iterator for DevicesIter {
        type Item = Device;

        fn next(&mut self) -> Option<Device> {
            self.list.next()
        }
    }

    /// The GPU to one test thread at a time: CubeCL's autotuner marks a kernel choice
    /// pending while one thread measures its candidates, and another thread asking for it
    /// meanwhile runs the first candidate instead of the winner, which rounds differently
    /// (a test comparing two runs bit for bit would fail by chance). A thread may take its
    /// turn again while it holds it.
    pub(crate) struct GpuTurn {
        _guard: Option<MutexGuard<'static, ()>>,
    }

    static GPU: Mutex<()> = Mutex::new(());

    thread_local! {
        /// The turns this thread holds.
        static TURNS: Cell<usize> = const { Cell::new(0) };
    }

    impl GpuTurn {
        /// Waits for the GPU's turn (at once if this thread holds it).
        fn take() -> Self {
            let guard =
                (TURNS.get() == 0).then(|| GPU.lock().unwrap_or_else(PoisonError::into_inner));
            TURNS.set(TURNS.get() + 1);
            GpuTurn { _guard: guard }
        }
    }

    impl Drop for GpuTurn {
        fn drop(&mut self) {
            TURNS.set(TURNS.get() - 1);
        }
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
