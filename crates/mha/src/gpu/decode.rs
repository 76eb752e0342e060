//! Decoding: a few queries over many keys (one new token over a cache). The tiled
//! forward ([`super::forward`]) gives a cube a block of 16 to 64 query rows, so a call
//! of one query computes every score 16 to 64 times, and its `B · H` cubes walk the
//! whole cache each, one after the other; a cache of thousands of keys then keeps a
//! few cubes busy and the rest of the device idle.
//!
//! Here a cube owns one query row and one *split* of the keys ([`DecodeTiles::keys`] of
//! them), so the cubes are `B · H · Tq · splits`: each of its units scores a few keys
//! (a dot product over the head dim from the query in shared memory), the cube reduces
//! the split's maximum and sum through shared memory, and the units sum the weighted
//! values, a quad of head dims and a share of the keys each. A split writes its output
//! (divided by its own sum) and its log-sum-exp; [`combine_kernel`] weighs the splits by
//! their log-sum-exps into the row's output and log-sum-exp, the same as the tiled
//! forward's, so the backward reads them as it reads the tiled one's. A call of one
//! split writes the row's output directly. Scores follow the same rules ([`masked`]):
//! a row that sees no key, or only blocked ones, gets zeros and [`DEAD_LSE`].
//!
//! Every loop of an invocation runs over one split's keys, or once over the splits (in
//! [`combine_kernel`]): lavapipe's cap of 65,535 iterations is 16.7 million keys.

use cubecl::prelude::*;

use super::scores::{INVISIBLE, NO_MAX, Problem, capped, keys_of, masked};
use super::tile::Quad;
use crate::mask::{DEAD_LSE, DEAD_ROW};

/// The compile-time shape of [`decode_kernel`].
#[derive_cube_comptime]
pub(crate) struct DecodeTiles {
    /// Units of a cube: a multiple of 32 (a plane on every device).
    pub(crate) units: usize,
    /// Keys of a split: a multiple of `units`.
    pub(crate) keys: usize,
    pub(crate) d_k: usize,
    pub(crate) d_v: usize,
    /// The scores are soft-capped.
    pub(crate) softcap: bool,
    /// The call has more than one split: the kernel writes each split's output and
    /// log-sum-exp for [`combine_kernel`], not the row's.
    pub(crate) split: bool,
}

impl DecodeTiles {
    /// The tiles of `units` units and splits of `keys` keys at head dims `d_k` and `d_v`.
    ///
    /// # Panics
    /// Unless `units` is a multiple of 32 and `keys` of `units` (every unit scores the
    /// same number of keys, and every score is written).
    pub(crate) fn new(
        units: usize,
        keys: usize,
        [d_k, d_v]: [usize; 2],
        softcap: bool,
        split: bool,
    ) -> Self {
        assert!(
            units.is_multiple_of(32) && keys.is_multiple_of(units),
            "decoding tiles of {units} units and {keys} keys"
        );
        Self {
            units,
            keys,
            d_k,
            d_v,
            softcap,
            split,
        }
    }

    /// Quads of the value's head dim.
    fn quads(&self) -> usize {
        self.d_v.div_ceil(4)
    }

    /// Units along the value's quads of head dims when they sum the weighted values.
    fn span(&self) -> usize {
        self.quads().min(self.units)
    }

    /// Groups of [`Self::span`] units, each summing every `groups`-th key of the split.
    fn groups(&self) -> usize {
        self.units / self.span()
    }

    /// Elements of the query staged in shared memory: its head dim in whole quads (one
    /// at least).
    fn query_len(&self) -> usize {
        self.d_k.next_multiple_of(4).max(4)
    }

    /// Bytes of shared memory a cube takes.
    pub(crate) fn shared_bytes(&self) -> usize {
        let floats =
            self.query_len() + self.keys + 2 * self.units + self.groups() * self.quads() * 4;
        floats * 4
    }
}

/// Element `c` of a row that starts at `at` (in elements), read `N` elements at a time.
#[cube]
fn element<F: Float, N: Size>(src: &Tensor<Vector<F, N>>, at: usize, c: usize) -> f32 {
    let mut x = 0.0f32;
    let width = N::value();
    if comptime!(width == 4) {
        x += f32::cast_from(src[at / 4 + c / 4].extract_dynamic(c % 4));
    } else {
        x += f32::cast_from(src[at + c * src.stride(3)].extract(0usize));
    }
    x
}

/// Elements `4 · c4 ..` of a row that starts at `at`, the ones from `cols` on 0, read `N`
/// elements at a time (a row of whole quads, `N` 4, in one read).
#[cube]
fn quad<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    at: usize,
    c4: usize,
    #[comptime] cols: usize,
) -> Quad<f32> {
    let mut q = Quad::<f32>::empty().fill(0.0f32);
    let width = N::value();
    if comptime!(width == 4) {
        let v = src[at / 4 + c4];
        #[unroll]
        for e in 0..4usize {
            q.insert(e, f32::cast_from(v.extract(e)));
        }
    } else {
        #[unroll]
        for e in 0..4usize {
            let c = c4 * 4 + e;
            if c < cols {
                q.insert(
                    e,
                    f32::cast_from(src[at + c * src.stride(3)].extract(0usize)),
                );
            }
        }
    }
    q
}

/// One cube: query row `i` of head `h` of batch row `b` (cube `r` of a split's `B · H ·
/// Tq`, rows fastest) over split `s`'s keys `s · keys ..`; writes the output `[S·B, H,
/// Tq, Dv]` (any strides; batch row `s · B + b`) in `W` and the log-sum-exp `[S·B, H,
/// Tq, 1]` (any strides) in f32. Each split's output is divided by its own sum; a split
/// (or, with one split, a row) that sees no key, or only blocked ones, writes zeros and
/// the log-sum-exp [`NO_MAX`] (with one split, [`DEAD_LSE`]).
#[cube(launch, launch_unchecked)]
pub(crate) fn decode_kernel<F: Float, M: Int, N: Size, W: Float>(
    p: &Problem<F, M, N>,
    out: &mut Tensor<W>,
    lse: &mut Tensor<f32>,
    #[comptime] t: DecodeTiles,
    #[define(F, M, W)] _dtypes: [ElemType; 3],
) {
    let (batch, heads, queries) = (p.q.shape(0), p.q.shape(1), p.q.shape(2));
    let keys = p.k.shape(2);
    let rows = batch * heads * queries;
    let id = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let (s, r) = (id / rows, id % rows);
    // One split where there is no key (its rows dead), as the launch counts them.
    if s < max(keys.div_ceil(t.keys), 1) {
        let i = r % queries;
        let bh = r / queries;
        let (b, h) = (bh / heads, bh % heads);
        decode_row::<F, M, N, W>(p, out, lse, b, h, i, s, t);
    }
}

#[cube]
#[allow(clippy::too_many_arguments)]
fn decode_row<F: Float, M: Int, N: Size, W: Float>(
    p: &Problem<F, M, N>,
    out: &mut Tensor<W>,
    lse: &mut Tensor<f32>,
    b: usize,
    h: usize,
    i: usize,
    s: usize,
    #[comptime] t: DecodeTiles,
) {
    let unit = UNIT_POS as usize;
    let hk = h / p.group as usize;
    let (d_k4, q_len, quads, span, groups) = comptime!((
        t.d_k.div_ceil(4),
        t.query_len(),
        t.quads(),
        t.span(),
        t.groups()
    ));

    // The split's keys this row sees.
    let seen = keys_of(p, b, i);
    let first = s * t.keys;
    let lo = max(seen.lo, first as i32);
    let hi = min(seen.hi, (first + t.keys) as i32);

    // The query, in f32.
    let mut q = Shared::<[f32]>::new_slice(q_len);
    let q_at = b * p.q.stride(0) + h * p.q.stride(1) + i * p.q.stride(2);
    #[unroll]
    for step in 0..comptime!(q_len.div_ceil(t.units)) {
        let c = comptime!(step * t.units) + unit;
        if c < q_len {
            let mut x = 0.0f32;
            if c < t.d_k {
                x = element(&p.q, q_at, c);
            }
            q[c] = x;
        }
    }
    sync_cube();

    // The scores of the unit's keys (every `units`-th), and their largest.
    let mut scores = Shared::<[f32]>::new_slice(t.keys);
    let mut red = Shared::<[f32]>::new_slice(comptime!(2 * t.units));
    let k_at = b * p.k.stride(0) + hk * p.k.stride(1);
    let mut top = f32::new(NO_MAX);
    #[unroll]
    for m in 0..comptime!(t.keys / t.units) {
        let j = comptime!(m * t.units) + unit;
        let key = (first + j) as i32;
        let mut x = f32::new(INVISIBLE);
        if key >= lo && key < hi {
            let row = k_at + key as usize * p.k.stride(2);
            let mut dot = 0.0f32;
            #[unroll]
            for c4 in 0..d_k4 {
                let kq = quad(&p.k, row, c4, t.d_k);
                #[unroll]
                for e in 0..4usize {
                    dot += q[comptime!(c4 * 4 + e)] * kq.extract(e);
                }
            }
            x = masked(
                p,
                capped(dot * p.scale, p.softcap, t.softcap),
                b,
                h,
                i,
                key as usize,
            );
        }
        scores[j] = x;
        top = max(top, x);
    }
    red[unit] = top;
    sync_cube();
    let mut row_max = f32::new(NO_MAX);
    for u in 0..t.units {
        row_max = max(row_max, red[u]);
    }

    // The weights, in place of the scores, and their sum.
    let mut sum = 0.0f32;
    #[unroll]
    for m in 0..comptime!(t.keys / t.units) {
        let j = comptime!(m * t.units) + unit;
        let w = (scores[j] - row_max).exp();
        scores[j] = w;
        sum += w;
    }
    red[t.units + unit] = sum;
    sync_cube();
    let mut row_sum = 0.0f32;
    for u in 0..t.units {
        row_sum += red[t.units + u];
    }
    let dead = row_max <= DEAD_ROW || row_sum <= 0.0f32;

    // The weighted values: a group of `span` units sums every `groups`-th key, a unit
    // a quad of head dims (then, past `span` quads, the next `span`).
    let mut sums = Shared::<[f32]>::new_slice(comptime!(groups * quads * 4));
    let v_at = b * p.v.stride(0) + hk * p.v.stride(1);
    let g = unit / span;
    #[unroll]
    for pass in 0..comptime!(quads.div_ceil(span)) {
        let c4 = comptime!(pass * span) + unit % span;
        if g < groups && c4 < quads {
            let mut acc = Array::<f32>::new(4usize);
            #[unroll]
            for e in 0..4usize {
                acc[e] = 0.0f32;
            }
            let mut j = g;
            while j < t.keys {
                let key = (first + j) as i32;
                if key >= lo && key < hi {
                    let w = scores[j];
                    let v = quad(&p.v, v_at + key as usize * p.v.stride(2), c4, t.d_v);
                    #[unroll]
                    for e in 0..4usize {
                        acc[e] += w * v.extract(e);
                    }
                }
                j += groups;
            }
            #[unroll]
            for e in 0..4usize {
                sums[(g * quads + c4) * 4 + e] = acc[e];
            }
        }
    }
    sync_cube();

    // The output, divided by the sum (zeros where dead), and the log-sum-exp.
    let inv = select(dead, 0.0f32, 1.0f32 / row_sum);
    let o_at = (s * p.q.shape(0) + b) * out.stride(0) + h * out.stride(1) + i * out.stride(2);
    let col_stride = out.stride(3);
    #[unroll]
    for step in 0..comptime!(t.d_v.div_ceil(t.units)) {
        let d = comptime!(step * t.units) + unit;
        if d < t.d_v {
            let mut x = 0.0f32;
            #[unroll]
            for gg in 0..groups {
                x += sums[comptime!(gg * quads * 4) + d];
            }
            out[o_at + d * col_stride] = W::cast_from(x * inv);
        }
    }
    if unit == 0 {
        let dead_lse = comptime!(if t.split { NO_MAX } else { DEAD_LSE });
        let at = (s * p.q.shape(0) + b) * lse.stride(0) + h * lse.stride(1) + i * lse.stride(2);
        lse[at] = select(dead, f32::new(dead_lse), row_max + row_sum.ln());
    }
}

/// The rows' outputs and log-sum-exps from their splits' (as [`decode_kernel`] writes
/// them for several splits: `part` `[S·B, H, Tq, Dv]` and `part_lse` `[S·B, H, Tq, 1]`,
/// any strides): one unit per element of the output `out` `[B, H, Tq, Dv]` (any strides,
/// numbered along the grid's `x`, then `y`), whose unit of head dim 0 also writes the
/// log-sum-exp `lse` `[B, H, Tq, 1]`. Each split weighs `exp(lse_s - max)`; a row whose
/// every split is dead gets zeros and [`DEAD_LSE`].
#[cube(launch, launch_unchecked)]
pub(crate) fn combine_kernel<F: Float>(
    part: &Tensor<f32>,
    part_lse: &Tensor<f32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    #[define(F)] _dtype: ElemType,
) {
    let (batch, heads, queries, d_v) = (out.shape(0), out.shape(1), out.shape(2), out.shape(3));
    let n = ((CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X) as usize;
    if n < batch * heads * queries * d_v {
        let d = n % d_v;
        let row = n / d_v;
        let i = row % queries;
        let bh = row / queries;
        let (b, h) = (bh / heads, bh % heads);
        let splits = part.shape(0) / batch;
        let lse_row = h * part_lse.stride(1) + i * part_lse.stride(2);
        let row = h * part.stride(1) + i * part.stride(2) + d * part.stride(3);
        // One pass, the sums rescaled to each new maximum (a dead split before the first
        // live one weighs 1 until then, and 0 after).
        let mut top = f32::new(NO_MAX);
        let mut sum = 0.0f32;
        let mut x = 0.0f32;
        for s in 0..splits {
            let l = part_lse[(s * batch + b) * part_lse.stride(0) + lse_row];
            let new_top = max(top, l);
            let alpha = (top - new_top).exp();
            let w = (l - new_top).exp();
            sum = sum * alpha + w;
            x = x * alpha + w * part[(s * batch + b) * part.stride(0) + row];
            top = new_top;
        }
        let dead = top <= DEAD_ROW;
        let o_at = b * out.stride(0) + h * out.stride(1) + i * out.stride(2) + d * out.stride(3);
        out[o_at] = F::cast_from(select(dead, 0.0f32, x / sum));
        if d == 0 {
            let at = b * lse.stride(0) + h * lse.stride(1) + i * lse.stride(2);
            lse[at] = select(dead, f32::new(DEAD_LSE), top + sum.ln());
        }
    }
}
