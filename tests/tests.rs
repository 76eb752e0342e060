//! Integration tests of `mha`, run on every backend compiled in (see `util::devices`).

// Shared helpers: devices, fixtures, comparisons, random inputs.
mod util;
// Attention in f64 on the host, forward and backward: the reference of `paths`.
mod reference;

// Forward outputs, weights and gradients against PyTorch fixtures (scripts/golden.py).
mod parity;
// Causality, permutation equivariance, padding invariance, use of every projection.
mod properties;
// Masks in every convention mean what they say; causal alignment; fully blocked rows.
mod masks;
// Every attention path, backend and dtype against attention computed in f64.
mod paths;
// Decoding with a cache gives the forward pass's rows; bad calls are refused.
mod cache;
// Bad configurations, shapes and weight files give errors naming what is wrong.
mod errors;
// Configurations saved as JSON load back, older files with their newer fields at the defaults.
mod configs;
// Whole modules in other dtypes: the cast, half-precision weights, bf16 and f16 against PyTorch.
mod dtypes;
// Head statistics, head masks, importance, pruning, attention maps.
mod analysis;
// Zero-sized inputs through every public forward, on every backend.
mod empty;
// The GPU kernels' launches and memory, each in a process of its own (wgpu).
#[cfg(feature = "wgpu")]
mod gpu;
// The GPU kernels' SPIR-V (the `vulkan` build), compiled without a device, is valid.
#[cfg(feature = "vulkan")]
mod spirv;
