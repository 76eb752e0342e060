//! Attention kernels of our own in CubeCL, for the GPU backends (wgpu, cuda).
//!
//! - [`tile`]: the tile product, `C += A · B` on tiles in shared memory with each unit's
//!   block of `C` in registers: every product of the kernels, behind one interface
//!   ([`tile::TileProduct`]), portable ([`tile::Registers`]) or on a device's
//!   cooperative matrices, its tensor cores ([`tile::Cooperative`], SPIR-V only).
//! - [`scores`]: what every kernel reads: the call as one launch argument, a cube's block
//!   of rows (the longest first), each row's keys, each score (soft cap, bias, bias by
//!   distance, boolean mask) by the CPU tiles' rules.
//! - [`forward`]: a cube of query rows walks the key tiles they see with an online softmax
//!   in f32; it writes the output and each row's log-sum-exp.
//! - [`decode`]: a few queries over many keys (decoding over a cache): a cube per few
//!   query rows of one key/value head and split of the keys (each key read once for
//!   them all), then the splits weighed by their log-sum-exps.
//! - [`backward`]: FlashAttention-2's recomputing backward pass (`D`; `dQ` queries outer,
//!   with the bias gradients' partial sums; `dK`/`dV` keys outer with GQA summed in the
//!   cube; the partial sums reduced in order).
//! - [`launch`]: the host side: the fragment the device offers, the tiles that fit its
//!   shared memory, the grid, the passes.
//! - [`ops`]: the backend extension that runs them on `CubeBackend`, under fusion and
//!   under autodiff, and the function the dispatcher calls.
//!
//! No plane (subgroup) operations, and tensor cores only where the device reports
//! cooperative matrices (the portable product elsewhere): the kernels run on every
//! CubeCL runtime, Mesa's software Vulkan included. The scores follow the CPU tiles' rules
//! (`crate::cpu::attention`): a fully blocked row gives zeros, never NaN. Every loop of
//! an invocation runs once per tile (loops over head dims and tile rows are unrolled at
//! compile time), so that no invocation nears a driver's cap on loop iterations (Mesa's
//! lavapipe stops every loop of an invocation after 65,535 iterations in all, silently).

pub(crate) mod backward;
pub(crate) mod decode;
pub(crate) mod forward;
pub(crate) mod launch;
pub(crate) mod ops;
pub(crate) mod scores;
#[cfg(feature = "vulkan")]
pub(crate) mod spirv;
#[cfg(all(test, feature = "wgpu"))]
mod tests;
pub(crate) mod tile;

pub(crate) use launch::MOST_BINDINGS;
pub(crate) use ops::{Packed, attention, packed_attention};

/// The most bytes `device` binds to one kernel as one buffer (the smaller of its limits on
/// a binding and on a buffer, as CubeCL reads them).
pub(crate) fn largest_binding(device: &cubecl::Device) -> u64 {
    device.client().properties().memory.max_page_size
}

/// Whether the kernels' smallest tiles fit `device`'s shared memory at head dims `d_k`
/// and `d_v` in elements of `size` bytes: the forward's, and with `backward` the
/// gradients' too. Where not (heads too wide for the device), a call takes the explicit
/// path.
pub(crate) fn tiles_fit(
    device: &cubecl::Device,
    heads: [usize; 2],
    size: usize,
    backward: bool,
) -> bool {
    let shared = device.client().properties().hardware.max_shared_memory_size;
    launch::smallest_fit(heads, size, shared, backward)
}

/// The storage buffers `device` binds to one kernel, as CubeCL reads them from the device's
/// limits (lavapipe: 31; a browser's WebGPU: 7).
pub(crate) fn max_bindings(device: &cubecl::Device) -> u32 {
    device.client().properties().hardware.max_bindings
}
