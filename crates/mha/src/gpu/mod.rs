//! Attention kernels of our own in CubeCL, for the GPU backends (wgpu, cuda).
//!
//! - [`forward`]: the portable forward pass (no plane operations, no tensor cores, so it
//!   runs on every CubeCL runtime, Mesa's software Vulkan included): one unit owns one
//!   query row, a cube of units walks the key/value tiles its rows see, staged in shared
//!   memory, with an online softmax in f32; it writes the output and each row's
//!   log-sum-exp.
//! - [`backward`]: FlashAttention-2's recomputing backward pass in three launches (`D`,
//!   `dQ` queries outer, `dK`/`dV` keys outer with GQA summed in one unit).
//! - [`ops`]: the backend extension that runs them on `CubeBackend`, under fusion and
//!   under autodiff, and the function the dispatcher calls.
//!
//! The scores follow the CPU tiles' rules (`crate::cpu::attention`, shared code in
//! `scores`): scale, soft cap, a bias clamped at [`BLOCKED`](crate::mask::BLOCKED), a
//! boolean mask that sets a score to it, and each query's key interval from
//! [`Visibility::band`](crate::mask::Visibility::band); tiles outside every row's interval
//! are never visited.
//!
//! Every loop of one invocation is bounded by the number of keys (or queries) it sees:
//! loops over the head dims are unrolled at compile time (the head dims are compile-time
//! constants), so that no invocation comes near a driver's cap on loop iterations (Mesa's
//! lavapipe stops every loop of an invocation after 65,535 iterations in all, silently).

pub(crate) mod backward;
pub(crate) mod forward;
mod launch;
pub(crate) mod ops;
mod scores;
#[cfg(all(test, feature = "wgpu"))]
mod tests;

pub(crate) use launch::MOST_BINDINGS;
pub(crate) use ops::attention;

/// The storage buffers `device` binds to one kernel, as CubeCL reads them from the device's
/// limits (lavapipe: 31; a browser's WebGPU: 7).
pub(crate) fn max_bindings(device: &cubecl::Device) -> u32 {
    device.client().properties().hardware.max_bindings
}
