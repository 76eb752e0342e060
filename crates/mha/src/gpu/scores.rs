//! The device functions every kernel shares: staging rows of a tensor into shared memory,
//! and making one score from `q · k` (the soft cap, the bias, the boolean mask), by the
//! CPU tiles' rules (`crate::cpu::attention`).

use cubecl::prelude::*;

use super::launch::UNITS;
use crate::mask::BLOCKED;

/// Beyond this `|s / cap|`, `tanh` is 1 in f32; the bound keeps its exponentials finite.
const TANH_BOUND: f32 = 15.0;

/// Stages rows `first .. first + rows` of `src` (head at `at`, rows along axis 2, columns
/// along axis 3), times `scale`, into `tile` (`rows × cols`, row-major), every unit of the
/// cube a share; rows from `end` on are zeros. The caller synchronises the cube.
#[cube]
pub(crate) fn stage(
    src: &Tensor<f32>,
    at: usize,
    first: i32,
    end: i32,
    scale: f32,
    tile: &mut Shared<[f32]>,
    #[comptime] rows: usize,
    #[comptime] cols: usize,
) {
    let unit = UNIT_POS_X as usize;
    #[unroll]
    for i in 0..(rows * cols).div_ceil(UNITS) {
        let e = i * UNITS + unit;
        if e < rows * cols {
            let row = first + (e / cols) as i32;
            let mut x = 0.0f32;
            if row < end {
                x = src[at + row as usize * src.stride(2) + (e % cols) * src.stride(3)] * scale;
            }
            tile[e] = x;
        }
    }
}

/// Stages `first .. first + rows` of the per-row values `src` (rows `at ..`, contiguous)
/// into `tile`; rows from `end` on are zeros.
#[cube]
pub(crate) fn stage_rows(
    src: &Tensor<f32>,
    at: usize,
    first: i32,
    end: i32,
    tile: &mut Shared<[f32]>,
    #[comptime] rows: usize,
) {
    let unit = UNIT_POS_X as usize;
    if unit < rows {
        let row = first + unit as i32;
        let mut x = 0.0f32;
        if row < end {
            x = src[at + row as usize];
        }
        tile[unit] = x;
    }
}

/// The raw score `s` (`q · k` with the scale in `q`) soft-capped: `cap · tanh(s / cap)`,
/// or `s` where `softcap` is 0. The cap's slope at `s` is `1 - (capped / cap)²`.
#[cube]
pub(crate) fn capped(s: f32, softcap: f32) -> f32 {
    let mut out = s;
    if softcap > 0.0f32 {
        let x = clamp(s / softcap, -TANH_BOUND, TANH_BOUND);
        out = softcap * x.tanh();
    }
    out
}

/// The slope of [`capped`] at the score whose capped value is `capped`.
#[cube]
pub(crate) fn cap_slope(capped: f32, softcap: f32) -> f32 {
    let mut slope = 1.0f32;
    if softcap > 0.0f32 {
        let t = capped / softcap;
        slope = 1.0f32 - t * t;
    }
    slope
}

/// The capped score `s` of key `key` with the bias added (clamped at [`BLOCKED`]) and the
/// boolean mask applied (a blocked key scores [`BLOCKED`]); `bias_at`, `mask_at`: the
/// row's start in each (read only when the kernel is compiled with them).
#[cube]
// `if flag { if read { .. } }`: the flag is known at compile time, and the read of a
// tensor the call does not have must not be emitted.
#[allow(clippy::collapsible_if)]
pub(crate) fn masked(
    s: f32,
    key: usize,
    bias: &Tensor<f32>,
    bias_at: usize,
    mask: &Tensor<u32>,
    mask_at: usize,
    #[comptime] has_bias: bool,
    #[comptime] has_mask: bool,
) -> f32 {
    let mut out = s;
    if has_bias {
        out += max(bias[bias_at + key * bias.stride(3)], BLOCKED);
    }
    if has_mask {
        if mask[mask_at + key * mask.stride(3)] != 0u32 {
            out = BLOCKED;
        }
    }
    out
}
