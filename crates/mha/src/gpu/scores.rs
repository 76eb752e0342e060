//! What every kernel reads of a call, and the device functions they share: the call's
//! tensors and scalars as one launch argument ([`Problem`]), a cube's block of rows and
//! the longest-first order of the blocks ([`block`]), each row's interval of keys (or
//! each key's of queries) by the rule of [`Visibility`](crate::mask::Visibility), and one
//! score from `q · k` by the CPU tiles' rules (`crate::cpu::attention`): the soft cap,
//! the bias, the bias by distance, the boolean mask.

use cubecl::prelude::*;

use crate::mask::BLOCKED;

/// Beyond this `|s / cap|`, `tanh` is 1 in f32; the bound keeps its exponentials finite.
const TANH_BOUND: f32 = 15.0;

/// Below every score a visible key can have, [`BLOCKED`] included: the running maximum of
/// a row before its first key.
pub(crate) const NO_MAX: f32 = -3.0e38;
/// The score of a key a row does not see: below [`NO_MAX`] by so much that its weight
/// `exp(INVISIBLE - max)` is 0 whatever the row's maximum.
pub(crate) const INVISIBLE: f32 = -3.4e38;

/// The tensors and scalars of one call, as every kernel reads them.
///
/// The query, key and value are read `N` elements at a time (4 where their rows allow it,
/// else 1: see `launch::Inputs::width`).
///
/// `q` `[B, H, Tq, Dk]`, `k` `[B, Hkv, Tk, Dk]`, `v` `[B, Hkv, Tk, Dv]`, any strides; an
/// additive `bias` and a boolean `mask` (nonzero = blocked), each of rank 4 and read as
/// broadcast to `[B, H, Tq, Tk]` (stride 0 along an axis of size 1); a bias by distance
/// `pd` (`[1, 1, H, Tq + Tk - 1]`, column `c` for the distance `c - (Tq - 1)` from a
/// query's row to a key's) and packed sequences' bounds `seq` (i32 `[B, 1, T, 2]`, see
/// `Visibility::sequences`). The band: query `i` sees keys `i + offset - before ..= i +
/// offset + after`, cut to `0 .. Tk` (`launch::band` passes offset 0 and the band's first
/// and last distances, `-before` and `after`, either of which may be negative; bounds
/// past the problem for "every key").
#[derive(CubeLaunch, CubeType)]
pub(crate) struct Problem<F: Float, M: Int, N: Size> {
    pub(crate) q: OwnedTensor<Vector<F, N>>,
    pub(crate) k: OwnedTensor<Vector<F, N>>,
    pub(crate) v: OwnedTensor<Vector<F, N>>,
    pub(crate) bias: ComptimeOption<OwnedTensor<F>>,
    pub(crate) pd: ComptimeOption<OwnedTensor<F>>,
    pub(crate) mask: ComptimeOption<OwnedTensor<M>>,
    pub(crate) seq: ComptimeOption<OwnedTensor<i32>>,
    pub(crate) offset: i32,
    pub(crate) before: i32,
    pub(crate) after: i32,
    /// `H / Hkv`.
    pub(crate) group: u32,
    /// Multiplies the queries.
    pub(crate) scale: f32,
    /// `cap · tanh(s / cap)` on the scaled scores, before the bias (read where the kernel
    /// is compiled with a cap).
    pub(crate) softcap: f32,
    /// A bias at or below this blocks its score (the dtype's blocked sentinel, see
    /// `crate::mask::blocked_score`: a bias the mask wrote in f16 is `-2^14`, not `-inf`).
    pub(crate) blocked: f32,
    /// Bit 0: walk the query blocks last first; bit 1: the key blocks (the longest rows
    /// first, so that a causal tail does not idle the device).
    pub(crate) order: u32,
}

/// Walk the query blocks last first ([`Problem::order`]).
pub(crate) const QUERIES_LAST_FIRST: u32 = 1;
/// Walk the key blocks last first ([`Problem::order`]).
pub(crate) const KEYS_LAST_FIRST: u32 = 2;

/// A cube's block of rows of one head: rows `first ..= last` (the rows that exist), of
/// head `head` of batch row `b` (`bh = b · heads + head`). `live`: the grid has more cubes
/// than blocks, and this one has none.
#[derive(CubeType, Clone, Copy)]
pub(crate) struct Block {
    pub(crate) live: bool,
    pub(crate) b: usize,
    pub(crate) head: usize,
    pub(crate) bh: usize,
    pub(crate) first: usize,
    pub(crate) last: usize,
}

/// The block of this cube: cubes are numbered along the grid's `x`, then `y` (a grid's
/// dimension is bounded, `B · H` is not), and numbers run over every head's first block,
/// then every head's second, so that the blocks that come first are scheduled first;
/// `last_first` reverses the blocks of a head, so that the longest rows come first.
#[cube]
pub(crate) fn block(
    batch_heads: usize,
    heads: usize,
    rows: usize,
    last_first: bool,
    #[comptime] block_rows: usize,
) -> Block {
    let id = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let blocks = rows.div_ceil(block_rows);
    let rank = id / batch_heads;
    let bh = id % batch_heads;
    let live = rank < blocks;
    let mut index = rank;
    if last_first {
        index = blocks - 1 - min(rank, blocks - 1);
    }
    let first = index * block_rows;
    Block {
        live,
        b: bh / heads,
        head: bh % heads,
        bh,
        first,
        last: min(first + block_rows, rows) - 1,
    }
}

/// An interval of positions `lo .. hi`.
#[derive(CubeType, Clone, Copy)]
pub(crate) struct Span {
    pub(crate) lo: i32,
    pub(crate) hi: i32,
}

/// The keys query `row` of batch row `b` sees: the band cut to `0 .. keys` and, with
/// packed sequences, to the row's sequence. Both bounds never decrease along the rows.
#[cube]
pub(crate) fn keys_of<F: Float, M: Int, N: Size>(
    p: &Problem<F, M, N>,
    b: usize,
    row: usize,
) -> Span {
    let own = row as i32 + p.offset;
    let lo = max(own - p.before, 0i32);
    let hi = min(own + p.after + 1, p.k.shape(2) as i32);
    in_sequence(p, b, row, lo, hi)
}

/// The queries that see key `key` of batch row `b`: the band mirrored (query `i` sees key
/// `j` when `j - offset - after <= i <= j - offset + before`), cut to `0 .. queries` and,
/// with packed sequences (self-attention: a position's sequence is the same as a query and
/// as a key), to the key's sequence. Both bounds never decrease along the keys.
#[cube]
pub(crate) fn queries_of<F: Float, M: Int, N: Size>(
    p: &Problem<F, M, N>,
    b: usize,
    key: usize,
) -> Span {
    let own = key as i32 - p.offset;
    let lo = max(own - p.after, 0i32);
    let hi = min(own + p.before + 1, p.q.shape(2) as i32);
    in_sequence(p, b, key, lo, hi)
}

/// `lo .. hi` cut, with packed sequences, to the sequence of position `at` of batch row
/// `b`.
#[cube]
fn in_sequence<F: Float, M: Int, N: Size>(
    p: &Problem<F, M, N>,
    b: usize,
    at: usize,
    lo: i32,
    hi: i32,
) -> Span {
    let mut span = Span { lo, hi };
    #[comptime]
    match &p.seq {
        ComptimeOption::Some(seq) => {
            let at = b * seq.stride(0) + at * seq.stride(2);
            span.lo = max(lo, seq[at]);
            span.hi = min(hi, seq[at + seq.stride(3)]);
        }
        ComptimeOption::None => {}
    }
    span
}

/// The scaled score `s` soft-capped: `cap · tanh(s / cap)` where the kernel is compiled
/// with a cap (`on`), else `s`.
#[cube]
pub(crate) fn capped(s: f32, softcap: f32, #[comptime] on: bool) -> f32 {
    let mut out = s;
    if comptime!(on) {
        let x = clamp(s / softcap, -TANH_BOUND, TANH_BOUND);
        out = softcap * x.tanh();
    }
    out
}

/// The slope of [`capped`] at the score whose capped value is `capped`: `1 - (capped /
/// cap)²`, or 1 without a cap.
#[cube]
pub(crate) fn cap_slope(capped: f32, softcap: f32, #[comptime] on: bool) -> f32 {
    let mut slope = 1.0f32;
    if comptime!(on) {
        let t = capped / softcap;
        slope = 1.0f32 - t * t;
    }
    slope
}

/// The score of query `i` (of query head `h`, batch row `b`) and key `j` from its capped
/// value: the bias added (a bias at or below [`Problem::blocked`] blocks the score), the
/// bias by distance added, and a key the boolean mask blocks set to [`BLOCKED`].
#[cube]
pub(crate) fn masked<F: Float, M: Int, N: Size>(
    p: &Problem<F, M, N>,
    capped: f32,
    b: usize,
    h: usize,
    i: usize,
    j: usize,
) -> f32 {
    let mut out = capped;
    #[comptime]
    match &p.bias {
        ComptimeOption::Some(bias) => {
            let at = b * bias.stride(0) + h * bias.stride(1) + i * bias.stride(2);
            let x = f32::cast_from(bias[at + j * bias.stride(3)]);
            out += x;
            if x <= p.blocked {
                out = BLOCKED;
            }
        }
        ComptimeOption::None => {}
    }
    #[comptime]
    match &p.pd {
        ComptimeOption::Some(pd) => {
            let column = p.q.shape(2) - 1 - i + j;
            out += f32::cast_from(pd[h * pd.stride(2) + column * pd.stride(3)]);
        }
        ComptimeOption::None => {}
    }
    #[comptime]
    match &p.mask {
        ComptimeOption::Some(mask) => {
            let at = b * mask.stride(0) + h * mask.stride(1) + i * mask.stride(2);
            if mask[at + j * mask.stride(3)] != M::from_int(0) {
                out = BLOCKED;
            }
        }
        ComptimeOption::None => {}
    }
    out
}
