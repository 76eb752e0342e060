//! Attention kernels of our own in CubeCL, for the GPU backends (wgpu, cuda).
//!
//! [`forward`]: the portable forward pass (no plane operations, no tensor cores, so it
//! runs on every CubeCL runtime, Mesa's software Vulkan included): one unit owns one
//! query row, a cube of units walks the key/value tiles its rows see, staged in shared
//! memory, with an online softmax in f32; it writes the output and each row's
//! log-sum-exp. The scores follow the CPU tiles' rules (`crate::cpu::attention`): scale,
//! soft cap, a bias clamped at [`BLOCKED`](crate::mask::BLOCKED), a boolean mask that
//! sets a score to it, and each query's key interval from
//! [`Visibility::band`](crate::mask::Visibility::band).
//!
//! Every loop of one invocation is bounded by the number of keys it sees: loops over the
//! head dims are unrolled at compile time (the head dims are compile-time constants), so
//! that no invocation comes near a driver's cap on loop iterations (Mesa's lavapipe stops
//! every loop of an invocation after 65,535 iterations in all, silently).

// Nothing outside the tests calls the kernels until the dispatcher routes to them.
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) mod forward;
#[cfg(all(test, feature = "wgpu"))]
mod tests;
