//! Decoding: a few queries over many keys (one new token over a cache). The tiled
//! forward ([`super::forward`]) gives a cube a block of 16 to 64 query rows, so a call
//! of one query computes every score 16 to 64 times, and its `B · H` cubes walk the
//! whole cache each, one after the other; a cache of thousands of keys then keeps a
//! few cubes busy and the rest of the device idle.
//!
//! Here a cube owns a few query rows that read one key/value head ([`DecodeTiles::rows`]
//! of them: the query heads of a GQA group times the call's queries) and one *split* of
//! the keys ([`DecodeTiles::keys`] of them), so the cubes are
//! `B · Hkv · ⌈group · Tq / rows⌉ · splits` and each key and value of a split is read
//! once for all of its rows. Each unit scores a few keys for every row (a dot product
//! over the head dim from the queries in shared memory), the cube reduces each row's
//! maximum and sum through shared memory, and the units sum the weighted values, a quad
//! of head dims and a share of the keys each, for every row. A split writes each row's
//! output (divided by its own sum) and log-sum-exp; [`combine_kernel`] weighs the splits
//! by their log-sum-exps into the row's output and log-sum-exp, the same as the tiled
//! forward's, so the backward reads them as it reads the tiled one's. A call of one
//! split writes the rows' outputs directly. Scores follow the same rules ([`masked`]): a
//! row that sees no key, or only blocked ones, gets zeros and [`DEAD_LSE`].
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
    /// Query rows of a cube, all of them reading one key/value head (query heads of one
    /// GQA group, and the call's queries): at most `units`.
    pub(crate) rows: usize,
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
    /// The tiles of `units` units for `rows` query rows and splits of `keys` keys at head
    /// dims `d_k` and `d_v`.
    ///
    /// # Panics
    /// Unless `units` is a multiple of 32, `keys` of `units` (every unit scores the same
    /// number of keys, and every score is written), and `rows` between 1 and `units`
    /// (a unit reduces each row's maximum and sum).
    pub(crate) fn new(
        [units, rows, keys]: [usize; 3],
        [d_k, d_v]: [usize; 2],
        softcap: bool,
        split: bool,
    ) -> Self {
        assert!(
            units.is_multiple_of(32) && keys.is_multiple_of(units) && (1..=units).contains(&rows),
            "decoding tiles of {units} units, {rows} rows and {keys} keys"
        );
        Self {
            units,
            rows,
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

    /// Bytes of shared memory a cube takes: its rows' queries, scores, partial maxima (then
    /// sums), maxima and sums, and weighted values.
    pub(crate) fn shared_bytes(&self) -> usize {
        let per_row =
            self.query_len() + self.keys + self.units + 2 + self.groups() * self.quads() * 4;
        self.rows * per_row * 4
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

/// The query row of slot `slot` of a cube's rows: slot `n` of the `group · Tq` rows that
/// read key/value head `hk` (query head `hk · group + n / Tq`, query `n % Tq`), where `n`
/// is the cube's first slot `n0` plus `slot`. `live`: `n` is one of those rows (a cube
/// of the last chunk may have fewer).
#[derive(CubeType, Clone, Copy)]
struct Slot {
    live: bool,
    h: usize,
    i: usize,
}

#[cube]
fn slot(n0: usize, slot: usize, hk: usize, group: usize, queries: usize) -> Slot {
    let n = n0 + slot;
    Slot {
        live: n < group * queries,
        h: hk * group + n / queries,
        i: n % queries,
    }
}

/// One cube: [`DecodeTiles::rows`] query rows that read one key/value head (chunk `c` of
/// the `group · Tq` rows of key/value head `hk` of batch row `b`: see [`slot`]) over
/// split `s`'s keys `s · keys ..`, cubes numbered chunks fastest, then key/value heads,
/// batch rows, splits; each key and value is read once for the cube's rows. Writes the
/// output `[S·B, H, Tq, Dv]` (any strides; batch row `s · B + b`) in `W` and the
/// log-sum-exp `[S·B, H, Tq, 1]` (any strides) in f32. Each split's output is divided by
/// its own sum; a split (or, with one split, a row) that sees no key, or only blocked
/// ones, writes zeros and the log-sum-exp [`NO_MAX`] (with one split, [`DEAD_LSE`]).
#[cube(launch, launch_unchecked)]
pub(crate) fn decode_kernel<F: Float, M: Int, N: Size, W: Float>(
    p: &Problem<F, M, N>,
    out: &mut Tensor<W>,
    lse: &mut Tensor<f32>,
    #[comptime] t: DecodeTiles,
    #[define(F, M, W)] _dtypes: [ElemType; 3],
) {
    let (batch, kv_heads, queries) = (p.q.shape(0), p.k.shape(1), p.q.shape(2));
    let keys = p.k.shape(2);
    let chunks = (p.group as usize * queries).div_ceil(t.rows);
    let cubes = batch * kv_heads * chunks;
    let id = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let (s, r) = (id / cubes, id % cubes);
    // One split where there is no key (its rows dead), as the launch counts them.
    if s < max(keys.div_ceil(t.keys), 1) {
        let c = r % chunks;
        let bhk = r / chunks;
        decode_rows::<F, M, N, W>(p, out, lse, bhk / kv_heads, bhk % kv_heads, c, s, t);
    }
}

#[cube]
#[allow(clippy::too_many_arguments)]
fn decode_rows<F: Float, M: Int, N: Size, W: Float>(
    p: &Problem<F, M, N>,
    out: &mut Tensor<W>,
    lse: &mut Tensor<f32>,
    b: usize,
    hk: usize,
    c: usize,
    s: usize,
    #[comptime] t: DecodeTiles,
) {
    let unit = UNIT_POS as usize;
    let (group, queries) = (p.group as usize, p.q.shape(2));
    let n0 = c * t.rows;
    let (d_k4, q_len, quads, span, groups, rows, per_unit) = comptime!((
        t.d_k.div_ceil(4),
        t.query_len(),
        t.quads(),
        t.span(),
        t.groups(),
        t.rows,
        t.keys / t.units
    ));

    // The split's keys each row sees, and those any of them sees.
    let first = s * t.keys;
    let mut lo = Array::<i32>::new(rows);
    let mut hi = Array::<i32>::new(rows);
    let mut any_lo = (first + t.keys) as i32;
    let mut any_hi = first as i32;
    // Each row's query head and query, for the masks in the loop over keys.
    let mut heads = Array::<u32>::new(rows);
    let mut query = Array::<u32>::new(rows);
    #[unroll]
    for r in 0..rows {
        let row = slot(n0, r, hk, group, queries);
        heads[r] = row.h as u32;
        query[r] = row.i as u32;
        let seen = keys_of(p, b, row.i);
        lo[r] = max(seen.lo, first as i32);
        hi[r] = select(row.live, min(seen.hi, (first + t.keys) as i32), 0i32);
        if lo[r] < hi[r] {
            any_lo = min(any_lo, lo[r]);
            any_hi = max(any_hi, hi[r]);
        }
    }

    // The queries, in f32: `[rows][q_len]`.
    let mut q = Shared::<[f32]>::new_slice(comptime!(rows * q_len));
    #[unroll]
    for step in 0..comptime!((rows * q_len).div_ceil(t.units)) {
        let e = comptime!(step * t.units) + unit;
        if e < comptime!(rows * q_len) {
            let (r, col) = (e / q_len, e % q_len);
            let row = slot(n0, r, hk, group, queries);
            let mut x = 0.0f32;
            if row.live && col < t.d_k {
                let q_at = b * p.q.stride(0) + row.h * p.q.stride(1) + row.i * p.q.stride(2);
                x = element(&p.q, q_at, col);
            }
            q[e] = x;
        }
    }
    sync_cube();

    // The scores of the unit's keys (every `units`-th) for every row, `[rows][keys]`, and
    // each row's largest of them.
    let mut scores = Shared::<[f32]>::new_slice(comptime!(rows * t.keys));
    let k_at = b * p.k.stride(0) + hk * p.k.stride(1);
    let mut top = Array::<f32>::new(rows);
    #[unroll]
    for r in 0..rows {
        top[r] = f32::new(NO_MAX);
    }
    // Loops over the unit's keys and the head dim's quads, unrolled over the rows only:
    // a cube of 8 rows unrolled whole is thousands of instructions to compile.
    for m in 0..per_unit {
        let j = m * t.units + unit;
        let key = (first + j) as i32;
        let mut dot = Array::<f32>::new(rows);
        #[unroll]
        for r in 0..rows {
            dot[r] = 0.0f32;
        }
        if key >= any_lo && key < any_hi {
            let at = k_at + key as usize * p.k.stride(2);
            for c4 in 0..d_k4 {
                let kq = quad(&p.k, at, c4, t.d_k);
                #[unroll]
                for r in 0..rows {
                    #[unroll]
                    for e in 0..4usize {
                        dot[r] += q[comptime!(r * q_len) + c4 * 4 + e] * kq.extract(e);
                    }
                }
            }
        }
        #[unroll]
        for r in 0..rows {
            let mut x = f32::new(INVISIBLE);
            if key >= lo[r] && key < hi[r] {
                let capped = capped(dot[r] * p.scale, p.softcap, t.softcap);
                x = masked(
                    p,
                    capped,
                    b,
                    heads[r] as usize,
                    query[r] as usize,
                    key as usize,
                );
            }
            scores[comptime!(r * t.keys) + j] = x;
            top[r] = max(top[r], x);
        }
    }
    // Each row's maximum: the units' partial ones `[rows][units]`, reduced by one unit a
    // row into `stats` (`[2][rows]`: maxima, then sums).
    let mut red = Shared::<[f32]>::new_slice(comptime!(rows * t.units));
    let mut stats = Shared::<[f32]>::new_slice(comptime!(2 * rows));
    #[unroll]
    for r in 0..rows {
        red[comptime!(r * t.units) + unit] = top[r];
    }
    sync_cube();
    if unit < rows {
        let mut x = f32::new(NO_MAX);
        for u in 0..t.units {
            x = max(x, red[unit * t.units + u]);
        }
        stats[unit] = x;
    }
    sync_cube();

    // The weights, in place of the scores, and their sums.
    let mut row_max = Array::<f32>::new(rows);
    let mut part = Array::<f32>::new(rows);
    #[unroll]
    for r in 0..rows {
        row_max[r] = stats[r];
        part[r] = 0.0f32;
    }
    for m in 0..per_unit {
        let j = m * t.units + unit;
        #[unroll]
        for r in 0..rows {
            let at = comptime!(r * t.keys) + j;
            let w = (scores[at] - row_max[r]).exp();
            scores[at] = w;
            part[r] += w;
        }
    }
    #[unroll]
    for r in 0..rows {
        red[comptime!(r * t.units) + unit] = part[r];
    }
    sync_cube();
    if unit < rows {
        let mut x = 0.0f32;
        for u in 0..t.units {
            x += red[unit * t.units + u];
        }
        stats[rows + unit] = x;
    }

    // The weighted values: a group of `span` units sums every `groups`-th key, a unit a
    // quad of head dims (then, past `span` quads, the next `span`) for every row, into
    // `sums` `[groups][rows][quads · 4]`.
    let mut sums = Shared::<[f32]>::new_slice(comptime!(groups * rows * quads * 4));
    let v_at = b * p.v.stride(0) + hk * p.v.stride(1);
    let g = unit / span;
    #[unroll]
    for pass in 0..comptime!(quads.div_ceil(span)) {
        let c4 = comptime!(pass * span) + unit % span;
        if g < groups && c4 < quads {
            let mut acc = Array::<f32>::new(comptime!(rows * 4));
            #[unroll]
            for e in 0..comptime!(rows * 4) {
                acc[e] = 0.0f32;
            }
            let mut j = g;
            while j < t.keys {
                let key = (first + j) as i32;
                if key >= any_lo && key < any_hi {
                    let v = quad(&p.v, v_at + key as usize * p.v.stride(2), c4, t.d_v);
                    #[unroll]
                    for r in 0..rows {
                        // 0 where the row does not see the key (its score `INVISIBLE`).
                        let w = scores[comptime!(r * t.keys) + j];
                        #[unroll]
                        for e in 0..4usize {
                            acc[comptime!(r * 4 + e)] += w * v.extract(e);
                        }
                    }
                }
                j += groups;
            }
            #[unroll]
            for r in 0..rows {
                #[unroll]
                for e in 0..4usize {
                    sums[((g * rows + r) * quads + c4) * 4 + e] = acc[comptime!(r * 4 + e)];
                }
            }
        }
    }
    sync_cube();

    // The outputs, divided by their sums (zeros where dead), and the log-sum-exps.
    let split_at = s * p.q.shape(0) + b;
    #[unroll]
    for step in 0..comptime!((rows * t.d_v).div_ceil(t.units)) {
        let e = comptime!(step * t.units) + unit;
        if e < comptime!(rows * t.d_v) {
            let (r, d) = (e / t.d_v, e % t.d_v);
            let row = slot(n0, r, hk, group, queries);
            if row.live {
                let (top, sum) = (stats[r], stats[rows + r]);
                // A NaN score makes the sum NaN: the row is NaN, not dead.
                let dead = (top <= DEAD_ROW || sum <= 0.0f32) && !sum.is_nan();
                let mut x = 0.0f32;
                #[unroll]
                for gg in 0..groups {
                    x += sums[(gg * rows + r) * comptime!(quads * 4) + d];
                }
                let at = split_at * out.stride(0)
                    + row.h * out.stride(1)
                    + row.i * out.stride(2)
                    + d * out.stride(3);
                out[at] = W::cast_from(select(dead, 0.0f32, x / sum));
            }
        }
    }
    if unit < rows {
        let row = slot(n0, unit, hk, group, queries);
        if row.live {
            let (top, sum) = (stats[unit], stats[rows + unit]);
            let dead = (top <= DEAD_ROW || sum <= 0.0f32) && !sum.is_nan();
            let dead_lse = comptime!(if t.split { NO_MAX } else { DEAD_LSE });
            let at = split_at * lse.stride(0) + row.h * lse.stride(1) + row.i * lse.stride(2);
            lse[at] = select(dead, f32::new(dead_lse), top + sum.ln());
        }
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
        // A split of NaN makes the sum NaN: the row is NaN, not dead.
        let dead = top <= DEAD_ROW && !sum.is_nan();
        let o_at = b * out.stride(0) + h * out.stride(1) + i * out.stride(2) + d * out.stride(3);
        out[o_at] = F::cast_from(select(dead, 0.0f32, x / sum));
        if d == 0 {
            let at = b * lse.stride(0) + h * lse.stride(1) + i * lse.stride(2);
            lse[at] = select(dead, f32::new(DEAD_LSE), top + sum.ln());
        }
    }
}
