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
pub(crate) fn stage<F: Float>(
    src: &Tensor<F>,
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
                x = f32::cast_from(
                    src[at + row as usize * src.stride(2) + (e % cols) * src.stride(3)],
                ) * scale;
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

/// The capped score `s` of key `key` with the bias added (clamped at [`BLOCKED`]), the
/// bias by distance added (`pd`, `[1, 1, H, Tq + Tk - 1]`: column `key - i + Tq - 1` of the
/// query head's row) and the boolean mask applied (a blocked key scores [`BLOCKED`]);
/// `*_at`: the query row's start in each (`pd_at`: the head's row, `Tq - 1 - i` columns
/// in), read only when the kernel is compiled with that tensor.
#[cube]
// `if flag { if read { .. } }`: the flag is known at compile time, and the read of a
// tensor the call does not have must not be emitted.
#[allow(clippy::collapsible_if, clippy::too_many_arguments)]
pub(crate) fn masked<F: Float>(
    s: f32,
    key: usize,
    bias: &Tensor<F>,
    bias_at: usize,
    pd: &Tensor<F>,
    pd_at: usize,
    mask: &Tensor<u32>,
    mask_at: usize,
    #[comptime] has_bias: bool,
    #[comptime] has_pd: bool,
    #[comptime] has_mask: bool,
) -> f32 {
    let mut out = s;
    if has_bias {
        out += max(
            f32::cast_from(bias[bias_at + key * bias.stride(3)]),
            BLOCKED,
        );
    }
    if has_pd {
        out += f32::cast_from(pd[pd_at + key * pd.stride(3)]);
    }
    if has_mask {
        if mask[mask_at + key * mask.stride(3)] != 0u32 {
            out = BLOCKED;
        }
    }
    out
}

/// Where the bias by distance of query head `h`, query row `i` starts (see [`masked`]).
#[cube]
pub(crate) fn pd_start<F: Float>(pd: &Tensor<F>, h: usize, i: usize, queries: usize) -> usize {
    h * pd.stride(2) + (queries - 1 - i) * pd.stride(3)
}

/// The key intervals of a cube of query rows `first ..= last` of batch row `b` (or, by
/// symmetry, the query intervals of a cube of keys, with the band mirrored): what the
/// rows see between them and what row `own_row` sees, the
/// band `own + offset - before ..= own + offset + after` cut to `0..len` and, with packed
/// sequences (`seq`, `[B, 1, T, 2]`), to the row's sequence. Both bounds of a row's
/// interval never decrease along the rows, so the cube's lies in the first row's lower
/// and the last row's upper bound.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn intervals(
    seq: &Tensor<i32>,
    b: usize,
    first: usize,
    last: usize,
    own_row: usize,
    len: usize,
    offset: i32,
    before: i32,
    after: i32,
    #[comptime] has_seq: bool,
) -> Intervals {
    let end = len as i32;
    let mut lo_cube = max(first as i32 + offset - before, 0i32);
    let mut hi_cube = min(last as i32 + offset + after + 1, end);
    let own = own_row as i32 + offset;
    let mut lo = max(own - before, 0i32);
    let mut hi = min(own + after + 1, end);
    if has_seq {
        let at = b * seq.stride(0);
        let (rows, sides) = (seq.stride(2), seq.stride(3));
        lo_cube = max(lo_cube, seq[at + first * rows]);
        hi_cube = min(hi_cube, seq[at + last * rows + sides]);
        lo = max(lo, seq[at + own_row * rows]);
        hi = min(hi, seq[at + own_row * rows + sides]);
    }
    Intervals {
        lo_cube,
        hi_cube,
        lo,
        hi,
    }
}

/// What [`intervals`] gives: the cube's interval and the unit's own.
#[derive(CubeType, Clone, Copy)]
pub(crate) struct Intervals {
    pub(crate) lo_cube: i32,
    pub(crate) hi_cube: i32,
    pub(crate) lo: i32,
    pub(crate) hi: i32,
}
