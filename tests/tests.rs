//! Integration tests of `mha`, run on every backend compiled in (see `util::devices`).

// Shared helpers: devices, fixtures, comparisons, random inputs.
mod util;

// Forward outputs, weights and gradients against PyTorch fixtures (scripts/golden.py).
mod parity;
// Causality, permutation equivariance, padding invariance, use of every projection.
mod properties;
// Masks in every convention; fused and explicit paths agree; fully blocked rows.
mod masks;
// Bad configurations, shapes and weight files give errors naming what is wrong.
mod errors;
