//! The backward pass, FlashAttention-2's scheme: the weights are recomputed per tile from
//! each row's log-sum-exp, never stored.
//!
//! 1. [`delta_kernel`]: `D = rowsum(dO ⊙ O)`.
//! 2. [`dq_kernel`]: queries outer, as the forward pass: a cube owns `bq` query rows of one
//!    head (their queries and `dO` staged once, transposed) and walks the key tiles they
//!    see (values, then keys, staged per tile); per tile `dPᵀ = V dOᵀ` and `Sᵀ = K Qᵀ` by
//!    the tile product, `dS` in registers, written to shared memory, and `dQ += dS K`.
//!    The gradients of an additive bias and of a bias by distance are sums of the same
//!    `dS` tiles: each cube writes its partial sums (per key, per row, per score, or per
//!    diagonal, as the bias broadcasts) to a buffer of partial rows, which
//!    [`reduce_kernel`] sums in a fixed order.
//! 3. [`dkv_kernel`]: keys outer: a cube owns `bk` keys of one key/value head and walks,
//!    for each query head of its group in turn, the query tiles that see them; per tile
//!    `dP = dO Vᵀ` and `S = Q Kᵀ` (keys and values staged per tile, transposed, into one
//!    buffer), then `dV += Pᵀ dO` and `dK += dSᵀ Q`. Grouped-query attention sums over
//!    the group inside one cube, in a fixed order: no atomics, the same bits on every run.
//!
//! ```text
//! P = exp(S - lse)    dS = P ⊙ (dO Vᵀ - D)    dS' = dS ⊙ (1 - tanh²) under a soft cap
//! dQ = scale · dS' K    dK = scale · dS'ᵀ Q    dV = Pᵀ dO
//! ```
//!
//! A fully blocked row has the log-sum-exp `DEAD_LSE`, which recomputes every one of its
//! weights to 0: its gradients are 0. Loop iterations per invocation: one per tile
//! (`dkv`: per tile of each query head of the group), the sums of partial rows at most
//! [`CHUNK`].

use cubecl::prelude::*;

use super::forward::stage_rows;
use super::scores::{
    Block, KEYS_LAST_FIRST, Problem, QUERIES_LAST_FIRST, block, cap_slope, capped, keys_of, masked,
    queries_of,
};
use super::tile::{Layout, Product, TileProduct, col_of, row_of, zero};

/// Partial rows one pass of [`reduce_kernel`] sums at most, so that no invocation nears a
/// driver's cap on loop iterations; more are summed in several passes.
pub(crate) const CHUNK: usize = 2048;

/// How an additive bias broadcasts along the queries and the keys, when its gradient is
/// asked for: what [`dq_kernel`] sums within a cube (see [`BiasSums::rows`]).
#[derive_cube_comptime]
pub(crate) enum BiasSums {
    /// No gradient of a bias.
    None,
    /// A bias with `queries` (more than one row) and `keys` (more than one column).
    Some { queries: bool, keys: bool },
}

/// The compile-time shape of [`dq_kernel`].
#[derive_cube_comptime]
pub(crate) struct DqTiles {
    pub(crate) units: usize,
    pub(crate) bq: usize,
    pub(crate) bk: usize,
    pub(crate) d_k: usize,
    pub(crate) d_v: usize,
    /// `Sᵀ = K Qᵀ`, `bk x bq` over `d_k`.
    pub(crate) s: Product,
    /// `dPᵀ = V dOᵀ`, `bk x bq` over `d_v` (the units hold the elements of `s`).
    pub(crate) dp: Product,
    /// `dQ += dS K`, `bq x dk'` over `bk` (`dk'`: `d_k` rounded up).
    pub(crate) dq: Product,
    pub(crate) bias: BiasSums,
    /// The bias by distance's gradient is asked for.
    pub(crate) pd: bool,
}

impl DqTiles {
    /// The tiles for `units` units, `bq` queries and `bk` keys.
    pub(crate) fn new(units: usize, bq: usize, bk: usize, d_k: usize, d_v: usize) -> Self {
        let s = Product::new(bk, bq, d_k, units);
        Self {
            units,
            bq,
            bk,
            d_k,
            d_v,
            s,
            dp: Product { k: d_v, ..s },
            dq: Product::new(bq, padded(d_k), bk, units),
            bias: BiasSums::None,
            pd: false,
        }
    }

    /// Bytes of shared memory a cube takes, with inputs of `size` bytes.
    pub(crate) fn shared_bytes(&self, size: usize) -> usize {
        let fixed = (self.d_k + self.d_v) * (self.bq + 1);
        let kv = self.bk * (self.d_v.max(self.dq.n) + 1);
        let ds = self.bk * (self.bq + 1);
        let ring = self.bq + self.bk;
        (fixed + kv) * size + (ds + ring) * 4
    }

    fn fixed_layout(&self) -> Layout {
        Layout::rows_of(self.bq)
    }

    fn v_layout(&self) -> Layout {
        Layout::rows_of(self.d_v)
    }

    fn k_layout(&self) -> Layout {
        Layout::rows_of(self.dq.n)
    }
}

/// The compile-time shape of [`dkv_kernel`].
#[derive_cube_comptime]
pub(crate) struct DkvTiles {
    pub(crate) units: usize,
    pub(crate) bq: usize,
    pub(crate) bk: usize,
    pub(crate) d_k: usize,
    pub(crate) d_v: usize,
    /// `S = Q Kᵀ`, `bq x bk` over `d_k`.
    pub(crate) s: Product,
    /// `dP = dO Vᵀ`, `bq x bk` over `d_v` (the units hold the elements of `s`).
    pub(crate) dp: Product,
    /// `dV += Pᵀ dO`, `bk x dv'` over `bq`.
    pub(crate) dv: Product,
    /// `dK += dSᵀ Q`, `bk x dk'` over `bq`.
    pub(crate) dk: Product,
}

impl DkvTiles {
    /// The tiles for `units` units, `bq` queries and `bk` keys.
    pub(crate) fn new(units: usize, bq: usize, bk: usize, d_k: usize, d_v: usize) -> Self {
        let s = Product::new(bq, bk, d_k, units);
        Self {
            units,
            bq,
            bk,
            d_k,
            d_v,
            s,
            dp: Product { k: d_v, ..s },
            dv: Product::new(bk, padded(d_v), bq, units),
            dk: Product::new(bk, padded(d_k), bq, units),
        }
    }

    /// Bytes of shared memory a cube takes, with inputs of `size` bytes.
    pub(crate) fn shared_bytes(&self, size: usize) -> usize {
        let q = self.bq * (self.dk.n + 1);
        let d_o = self.bq * (self.dv.n + 1);
        let x = self.d_k.max(self.d_v) * (self.bk + 1);
        let pds = self.bq * (self.bk + 1);
        (q + d_o + x) * size + pds * 4
    }

    fn q_layout(&self) -> Layout {
        Layout::rows_of(self.dk.n)
    }

    fn do_layout(&self) -> Layout {
        Layout::rows_of(self.dv.n)
    }

    fn x_layout(&self) -> Layout {
        Layout::rows_of(self.bk)
    }
}

/// A head dim rounded up to a multiple of 16, so that an output product splits over the
/// units.
pub(crate) fn padded(d: usize) -> usize {
    d.next_multiple_of(16)
}

/// `delta[bh, i] = Σ_d grad[b, h, i, d] · out[b, h, i, d]`: one unit per query row of
/// every head (`B · H · Tq` rows, numbered along the grid's `x`, then `y`).
#[cube(launch)]
pub(crate) fn delta_kernel<F: Float>(
    out: &Tensor<F>,
    grad: &Tensor<F>,
    delta: &mut Tensor<f32>,
    #[comptime] d_v: usize,
    #[define(F)] _dtype: ElemType,
) {
    let heads = grad.shape(1);
    let queries = grad.shape(2);
    let row = ((CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X) as usize;
    if row < grad.shape(0) * heads * queries {
        let i = row % queries;
        let bh = row / queries;
        let (b, h) = (bh / heads, bh % heads);
        let g_at = b * grad.stride(0) + h * grad.stride(1) + i * grad.stride(2);
        let o_at = b * out.stride(0) + h * out.stride(1) + i * out.stride(2);
        let mut sum = 0.0f32;
        #[unroll]
        for d in 0..d_v {
            sum += f32::cast_from(grad[g_at + d * grad.stride(3)])
                * f32::cast_from(out[o_at + d * out.stride(3)]);
        }
        delta[row] = sum;
    }
}

/// One score's weight, its gradient and the soft cap's slope at it.
#[derive(CubeType, Clone, Copy)]
struct Grad {
    p: f32,
    /// The gradient of the score after the cap (the bias's and the bias by distance's).
    ds: f32,
    /// The cap's slope: `ds · slope` is the gradient of `q · k · scale`.
    slope: f32,
}

/// The weight `P = exp(S - lse)` of query `i` and key `j` from the raw product `raw`
/// (`q · k`, before the scale), `dS = P (dP - D)` and the cap's slope; `P` and `dS` 0
/// where the query does not see the key (`visible` false).
#[cube]
#[allow(clippy::too_many_arguments)]
fn grad_at<F: Float, M: Int>(
    p: &Problem<F, M>,
    raw: f32,
    dp: f32,
    lse: f32,
    delta: f32,
    b: usize,
    h: usize,
    i: usize,
    j: usize,
    visible: bool,
) -> Grad {
    let c = capped(raw * p.scale, p.softcap);
    let s = masked(p, c, b, h, i, j);
    let w = select(visible, (s - lse).exp(), 0.0f32);
    Grad {
        p: w,
        ds: w * (dp - delta),
        slope: cap_slope(c, p.softcap),
    }
}

/// `dQ`, queries outer: query rows `block.first ..` of head `block.bh`, over the key tiles
/// they see; writes `dq` (the query's shape, any strides) and, where asked for, the
/// partial rows of the bias's gradient (`dbias`, `[R, E]`, see [`BiasSums`] and
/// `bias_rows`) and of the bias by distance's (`dpd`, `[B · blocks, H · (Tq + Tk -
/// 1)]`, row `b · blocks + block`).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dq_kernel<F: Float, M: Int, P: TileProduct>(
    p: &Problem<F, M>,
    grad: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<F>,
    dbias: &mut ComptimeOption<OwnedTensor<f32>>,
    dpd: &mut ComptimeOption<OwnedTensor<f32>>,
    #[comptime] t: DqTiles,
    #[define(F, M)] _dtypes: [ElemType; 2],
) {
    let heads = p.q.shape(1);
    let blk = block(
        p.q.shape(0) * heads,
        heads,
        p.q.shape(2),
        (p.order & QUERIES_LAST_FIRST) != 0,
        t.bq,
    );
    if blk.live {
        dq_block::<F, M, P>(p, grad, lse, delta, dq, dbias, dpd, &blk, t);
    }
}

#[cube]
#[allow(clippy::too_many_arguments)]
fn dq_block<F: Float, M: Int, P: TileProduct>(
    p: &Problem<F, M>,
    grad: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<F>,
    dbias: &mut ComptimeOption<OwnedTensor<f32>>,
    dpd: &mut ComptimeOption<OwnedTensor<f32>>,
    blk: &Block,
    #[comptime] t: DqTiles,
) {
    let (s_rows, s_cols) = comptime!((t.s.rows(), t.s.cols()));
    let queries = p.q.shape(2);
    let keys = p.k.shape(2);
    let h = blk.head;
    let hk = h / p.group as usize;
    let (b, q0) = (blk.b, blk.first);

    let first = keys_of(p, b, q0);
    let last = keys_of(p, b, blk.last);
    // The unit's queries (columns of `Sᵀ`): their keys, log-sum-exps and `D`; a query
    // past the last has no key.
    let mut lo = Array::<i32>::new(s_cols);
    let mut hi = Array::<i32>::new(s_cols);
    let mut row_lse = Array::<f32>::new(s_cols);
    let mut row_delta = Array::<f32>::new(s_cols);
    #[unroll]
    for j in 0..s_cols {
        let i = q0 + col_of(t.s, j);
        let span = keys_of(p, b, min(i, queries - 1));
        lo[j] = span.lo;
        hi[j] = select(i < queries, span.hi, span.lo);
        row_lse[j] = lse[blk.bh * queries + min(i, queries - 1)];
        row_delta[j] = delta[blk.bh * queries + min(i, queries - 1)];
    }

    // The block's queries and output gradients, transposed; the key tiles' values, then
    // keys, in one buffer; dS.
    let fixed = comptime!(t.bq + 1);
    let mut qt = Shared::<[F]>::new_slice(comptime!(t.d_k * fixed));
    let mut dot = Shared::<[F]>::new_slice(comptime!(t.d_v * fixed));
    let q_at = b * p.q.stride(0) + h * p.q.stride(1);
    let g_at = b * grad.stride(0) + h * grad.stride(1);
    stage_rows(
        &p.q,
        q_at,
        q0,
        queries,
        &mut qt,
        t.bq,
        t.d_k,
        t.d_k,
        t.fixed_layout().transposed(),
        t.units,
    );
    stage_rows(
        grad,
        g_at,
        q0,
        queries,
        &mut dot,
        t.bq,
        t.d_v,
        t.d_v,
        t.fixed_layout().transposed(),
        t.units,
    );
    let mut kv = Shared::<[F]>::new_slice(comptime!(t.bk * (max(t.d_v, t.dq.n) + 1)));
    let mut ds_tile = Shared::<[f32]>::new_slice(comptime!(t.bk * fixed));
    let mut ring = Shared::<[f32]>::new_slice(comptime!(t.bq + t.bk));
    let unit = UNIT_POS as usize;
    if unit < comptime!(t.bq + t.bk) {
        ring[unit] = 0.0f32;
    }
    // The unit's query's sum over the keys, for a bias without keys.
    let mut row_sum = 0.0f32;

    let mut s = Array::<f32>::new(comptime!(t.s.len()));
    let mut dp = Array::<f32>::new(comptime!(t.s.len()));
    // With a bias gradient, the soft cap's slope of each score, applied after the sums.
    let sums = comptime!(t.pd || !matches!(t.bias, BiasSums::None));
    let mut slope = Array::<f32>::new(comptime!(if sums { t.s.len() } else { 1 }));
    let mut acc = Array::<f32>::new(comptime!(t.dq.len()));
    zero(&mut acc, t.dq);
    let k_at = b * p.k.stride(0) + hk * p.k.stride(1);
    let v_at = b * p.v.stride(0) + hk * p.v.stride(1);
    let mut t0 = first.lo;
    let mut n = 0usize;
    while t0 < last.hi {
        let end = last.hi as usize;
        stage_rows(
            &p.v,
            v_at,
            t0 as usize,
            end,
            &mut kv,
            t.bk,
            t.d_v,
            t.d_v,
            t.v_layout(),
            t.units,
        );
        sync_cube();
        zero(&mut dp, t.dp);
        P::product::<F, F>(&kv, t.v_layout(), &dot, t.fixed_layout(), &mut dp, t.dp);
        sync_cube();
        stage_rows(
            &p.k,
            k_at,
            t0 as usize,
            end,
            &mut kv,
            t.bk,
            t.d_k,
            t.dq.n,
            t.k_layout(),
            t.units,
        );
        sync_cube();
        zero(&mut s, t.s);
        P::product::<F, F>(&kv, t.k_layout(), &qt, t.fixed_layout(), &mut s, t.s);

        let whole = t0 >= last.lo && t0 + t.bk as i32 <= first.hi;
        #[unroll]
        for i in 0..s_rows {
            let key = t0 + row_of(t.s, i) as i32;
            #[unroll]
            for j in 0..s_cols {
                let e = comptime!(i * s_cols + j);
                let query = q0 + col_of(t.s, j);
                let visible = query < queries && (whole || (key >= lo[j] && key < hi[j]));
                let g = grad_at(
                    p,
                    s[e],
                    dp[e],
                    row_lse[j],
                    row_delta[j],
                    b,
                    h,
                    min(query, queries - 1),
                    min(key as usize, keys - 1),
                    visible,
                );
                let at = row_of(t.s, i) * fixed + col_of(t.s, j);
                if comptime!(sums) {
                    slope[e] = g.slope;
                    ds_tile[at] = g.ds;
                } else {
                    ds_tile[at] = g.ds * g.slope;
                }
            }
        }
        sync_cube();
        if comptime!(sums) {
            // The bias gradients' sums take dS; dQ takes it times the cap's slope.
            row_sum += bias_tile(p, dbias, &ds_tile, blk, t0, t);
            pd_tile(p, dpd, &ds_tile, &mut ring, blk, t0, n, t);
            sync_cube();
            if p.softcap > 0.0f32 {
                #[unroll]
                for i in 0..s_rows {
                    #[unroll]
                    for j in 0..s_cols {
                        ds_tile[row_of(t.s, i) * fixed + col_of(t.s, j)] *=
                            slope[comptime!(i * s_cols + j)];
                    }
                }
            }
            sync_cube();
        }
        P::product::<f32, F>(
            &ds_tile,
            t.fixed_layout().transposed(),
            &kv,
            t.k_layout(),
            &mut acc,
            t.dq,
        );
        sync_cube();
        t0 += t.bk as i32;
        n += 1;
    }

    pd_rest(p, dpd, &ring, blk, first.lo, n, t);
    bias_rest(p, dbias, blk, row_sum, t);

    let scale = p.scale;
    let (dq_rows, dq_cols) = comptime!((t.dq.rows(), t.dq.cols()));
    #[unroll]
    for i in 0..dq_rows {
        let row = q0 + row_of(t.dq, i);
        if row < queries {
            let at = b * dq.stride(0) + h * dq.stride(1) + row * dq.stride(2);
            let col_stride = dq.stride(3);
            #[unroll]
            for j in 0..dq_cols {
                let d = col_of(t.dq, j);
                if d < t.d_k {
                    dq[at + d * col_stride] = F::cast_from(acc[comptime!(i * dq_cols + j)] * scale);
                }
            }
        }
    }
}

/// Where the bias's partial row `x` of `xs` for batch row `b` and head `h` starts: the
/// partial rows run over the axes the bias broadcasts along (its batch axis of size 1:
/// every batch row a row of its own; its head axis of size 1: every head), then over the
/// `xs` sums a cube makes (its query block, or its query), each row as long as the bias.
#[cube]
fn bias_row<F: Float, M: Int>(p: &Problem<F, M>, b: usize, h: usize, x: usize, xs: usize) -> usize {
    let mut at = 0usize;
    #[comptime]
    match &p.bias {
        ComptimeOption::Some(bias) => {
            let (sb, sh) = (bias.shape(0), bias.shape(1));
            let elements = sb * sh * bias.shape(2) * bias.shape(3);
            let heads = select(sh == 1, p.q.shape(1), 1usize);
            let row = (select(sb == 1, b, 0usize) * heads + select(sh == 1, h, 0usize)) * xs + x;
            at = row * elements;
        }
        ComptimeOption::None => {}
    }
    at
}

/// The index of the bias's element that score `(b, h, i, j)` reads, in the bias's own
/// shape (0 along its axes of size 1).
#[cube]
fn bias_element<F: Float, M: Int>(
    p: &Problem<F, M>,
    b: usize,
    h: usize,
    i: usize,
    j: usize,
) -> usize {
    let mut at = 0usize;
    #[comptime]
    match &p.bias {
        ComptimeOption::Some(bias) => {
            let (sb, sh, sq, sk) = (bias.shape(0), bias.shape(1), bias.shape(2), bias.shape(3));
            let b = select(sb > 1, b, 0usize);
            let h = select(sh > 1, h, 0usize);
            let i = select(sq > 1, i, 0usize);
            let j = select(sk > 1, j, 0usize);
            at = ((b * sh + h) * sq + i) * sk + j;
        }
        ComptimeOption::None => {}
    }
    at
}

/// The partial sums of one dS tile (rows: keys `t0 ..`, columns: the block's queries, in
/// shared memory) for the bias's gradient, by how the bias broadcasts: every score (a
/// bias with queries and keys), the block's sum per key (keys only), or, returned, the
/// unit's query's sum over the tile's keys (no keys; 0 otherwise).
#[cube]
fn bias_tile<F: Float, M: Int>(
    p: &Problem<F, M>,
    dbias: &mut ComptimeOption<OwnedTensor<f32>>,
    ds_tile: &Shared<[f32]>,
    blk: &Block,
    t0: i32,
    #[comptime] t: DqTiles,
) -> f32 {
    let mut row_sum = 0.0f32;
    let fixed = comptime!(t.bq + 1);
    let unit = UNIT_POS as usize;
    let (queries, keys) = (p.q.shape(2), p.k.shape(2));
    #[comptime]
    match dbias {
        ComptimeOption::Some(dbias) =>
        {
            #[comptime]
            match t.bias {
                BiasSums::Some {
                    queries: true,
                    keys: true,
                } => {
                    let at = bias_row(p, blk.b, blk.head, 0, 1);
                    #[unroll]
                    for step in 0..comptime!((t.bq * t.bk).div_ceil(t.units)) {
                        let e = comptime!(step * t.units) + unit;
                        let (r, c) = (e / t.bk, e % t.bk);
                        let (i, j) = (blk.first + r, t0 as usize + c);
                        if e < comptime!(t.bq * t.bk) && i < queries && j < keys {
                            dbias[at + bias_element(p, blk.b, blk.head, i, j)] =
                                ds_tile[c * fixed + r];
                        }
                    }
                }
                BiasSums::Some {
                    queries: false,
                    keys: true,
                } => {
                    let blocks = queries.div_ceil(t.bq);
                    let at = bias_row(p, blk.b, blk.head, blk.first / t.bq, blocks);
                    let j = t0 as usize + unit;
                    if unit < t.bk && j < keys {
                        let mut sum = 0.0f32;
                        #[unroll]
                        for r in 0..t.bq {
                            sum += ds_tile[unit * fixed + r];
                        }
                        dbias[at + bias_element(p, blk.b, blk.head, 0, j)] = sum;
                    }
                }
                BiasSums::Some { .. } => {
                    if unit < t.bq {
                        let mut sum = 0.0f32;
                        #[unroll]
                        for c in 0..t.bk {
                            sum += ds_tile[c * fixed + unit];
                        }
                        row_sum = sum;
                    }
                }
                BiasSums::None => {}
            }
        }
        ComptimeOption::None => {}
    }
    row_sum
}

/// After the tiles: a bias without keys gets each query's sum over them, `row_sum` (the
/// partial rows start at zeros: a bias with keys has what the tiles wrote).
#[cube]
fn bias_rest<F: Float, M: Int>(
    p: &Problem<F, M>,
    dbias: &mut ComptimeOption<OwnedTensor<f32>>,
    blk: &Block,
    row_sum: f32,
    #[comptime] t: DqTiles,
) {
    let unit = UNIT_POS as usize;
    let queries = p.q.shape(2);
    let (b, h, i) = (blk.b, blk.head, blk.first + unit);
    #[comptime]
    match dbias {
        ComptimeOption::Some(dbias) => {
            if unit < t.bq && i < queries {
                #[comptime]
                match t.bias {
                    BiasSums::Some {
                        queries: true,
                        keys: false,
                    } => {
                        dbias[bias_row(p, b, h, 0, 1) + bias_element(p, b, h, i, 0)] = row_sum;
                    }
                    BiasSums::Some {
                        queries: false,
                        keys: false,
                    } => {
                        dbias[bias_row(p, b, h, i, queries) + bias_element(p, b, h, 0, 0)] =
                            row_sum;
                    }
                    _ => {}
                }
            }
        }
        ComptimeOption::None => {}
    }
}

/// The diagonal sums of one dS tile (keys `t0 ..`, the `n`-th tile of the cube) for the
/// bias by distance's gradient: unit `u` sums the tile's diagonal `u` (key − query =
/// `t0 - first - (bq - 1) + u`) and adds what earlier tiles left of it in `ring`; a
/// diagonal no later tile reaches (`u < bk`) is written to the cube's partial row, the
/// others carried in `ring`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn pd_tile<F: Float, M: Int>(
    p: &Problem<F, M>,
    dpd: &mut ComptimeOption<OwnedTensor<f32>>,
    ds_tile: &Shared<[f32]>,
    ring: &mut Shared<[f32]>,
    blk: &Block,
    t0: i32,
    n: usize,
    #[comptime] t: DqTiles,
) {
    let fixed = comptime!(t.bq + 1);
    let unit = UNIT_POS as usize;
    #[comptime]
    match dpd {
        ComptimeOption::Some(dpd) => {
            let (at, columns) = pd_row(p, blk, t);
            if unit < comptime!(t.bq + t.bk - 1) {
                let mut sum = 0.0f32;
                #[unroll]
                for r in 0..t.bq {
                    let c = unit as i32 + comptime!(r as i32 - (t.bq as i32 - 1));
                    if c >= 0 && c < t.bk as i32 {
                        sum += ds_tile[c as usize * fixed + r];
                    }
                }
                let slot = (n * t.bk + unit) % comptime!(t.bq + t.bk);
                let total = ring[slot] + sum;
                if unit < t.bk {
                    let column = t0 - blk.first as i32 - comptime!(t.bq as i32 - 1)
                        + unit as i32
                        + p.q.shape(2) as i32
                        - 1;
                    if column >= 0 && column < columns as i32 {
                        dpd[at + column as usize] = total;
                    }
                    ring[slot] = 0.0f32;
                } else {
                    ring[slot] = total;
                }
            }
        }
        ComptimeOption::None => {}
    }
}

/// After the `n` tiles from key `lo` on: the last tile's diagonals still open written
/// (the partial rows start at zeros: nothing else to write where no tile reached).
#[cube]
fn pd_rest<F: Float, M: Int>(
    p: &Problem<F, M>,
    dpd: &mut ComptimeOption<OwnedTensor<f32>>,
    ring: &Shared<[f32]>,
    blk: &Block,
    lo: i32,
    n: usize,
    #[comptime] t: DqTiles,
) {
    let unit = UNIT_POS as usize;
    #[comptime]
    match dpd {
        ComptimeOption::Some(dpd) => {
            let (at, columns) = pd_row(p, blk, t);
            // The column of the cube's first diagonal.
            let first =
                lo - comptime!(t.bq as i32 - 1) + p.q.shape(2) as i32 - 1 - blk.first as i32;
            if n > 0 && unit >= t.bk && unit < comptime!(t.bq + t.bk - 1) {
                let at_ring = (n - 1) * t.bk + unit;
                let column = first + at_ring as i32;
                if column >= 0 && column < columns as i32 {
                    dpd[at + column as usize] = ring[at_ring % comptime!(t.bq + t.bk)];
                }
            }
        }
        ComptimeOption::None => {}
    }
}

/// Where the cube's partial row of the bias by distance's gradient starts (row `b ·
/// blocks + block`, element `h · columns + column`), and `columns = Tq + Tk - 1`.
#[cube]
fn pd_row<F: Float, M: Int>(
    p: &Problem<F, M>,
    blk: &Block,
    #[comptime] t: DqTiles,
) -> (usize, usize) {
    let (heads, queries) = (p.q.shape(1), p.q.shape(2));
    let columns = queries + p.k.shape(2) - 1;
    let blocks = queries.div_ceil(t.bq);
    let row = blk.b * blocks + blk.first / t.bq;
    ((row * heads + blk.head) * columns, columns)
}

/// `dK` and `dV`, keys outer: keys `block.first ..` of key/value head `block.bh`, over
/// the query tiles of each query head of its group in turn; writes `dk` and `dv` (the
/// key's and the value's shapes, any strides).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dkv_kernel<F: Float, M: Int, P: TileProduct>(
    p: &Problem<F, M>,
    grad: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    #[comptime] t: DkvTiles,
    #[define(F, M)] _dtypes: [ElemType; 2],
) {
    let kv_heads = p.k.shape(1);
    let blk = block(
        p.k.shape(0) * kv_heads,
        kv_heads,
        p.k.shape(2),
        (p.order & KEYS_LAST_FIRST) != 0,
        t.bk,
    );
    if blk.live {
        dkv_block::<F, M, P>(p, grad, lse, delta, dk, dv, &blk, t);
    }
}

#[cube]
#[allow(clippy::too_many_arguments)]
fn dkv_block<F: Float, M: Int, P: TileProduct>(
    p: &Problem<F, M>,
    grad: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    blk: &Block,
    #[comptime] t: DkvTiles,
) {
    let (s_rows, s_cols) = comptime!((t.s.rows(), t.s.cols()));
    let (heads, queries, keys) = (p.q.shape(1), p.q.shape(2), p.k.shape(2));
    let (b, hk, k0) = (blk.b, blk.head, blk.first);
    // The queries that see the block's keys between them.
    let first = queries_of(p, b, k0);
    let last = queries_of(p, b, blk.last);

    let mut q_tile = Shared::<[F]>::new_slice(comptime!(t.bq * (t.dk.n + 1)));
    let mut do_tile = Shared::<[F]>::new_slice(comptime!(t.bq * (t.dv.n + 1)));
    let mut x_tile = Shared::<[F]>::new_slice(comptime!(max(t.d_k, t.d_v) * (t.bk + 1)));
    let mut pds = Shared::<[f32]>::new_slice(comptime!(t.bq * (t.bk + 1)));
    let mut s = Array::<f32>::new(comptime!(t.s.len()));
    let mut dp = Array::<f32>::new(comptime!(t.s.len()));
    let mut acc_k = Array::<f32>::new(comptime!(t.dk.len()));
    let mut acc_v = Array::<f32>::new(comptime!(t.dv.len()));
    zero(&mut acc_k, t.dk);
    zero(&mut acc_v, t.dv);
    let k_at = b * p.k.stride(0) + hk * p.k.stride(1);
    let v_at = b * p.v.stride(0) + hk * p.v.stride(1);
    let block_end = blk.last + 1;
    let whole_keys = k0 + t.bk <= keys;

    for g in 0..p.group {
        let h = hk * p.group as usize + g as usize;
        let bh = b * heads + h;
        let q_at = b * p.q.stride(0) + h * p.q.stride(1);
        let g_at = b * grad.stride(0) + h * grad.stride(1);
        let mut t0 = first.lo;
        while t0 < last.hi {
            let (start, end) = (t0 as usize, last.hi as usize);
            stage_rows(
                grad,
                g_at,
                start,
                end,
                &mut do_tile,
                t.bq,
                t.d_v,
                t.dv.n,
                t.do_layout(),
                t.units,
            );
            stage_rows(
                &p.q,
                q_at,
                start,
                end,
                &mut q_tile,
                t.bq,
                t.d_k,
                t.dk.n,
                t.q_layout(),
                t.units,
            );
            stage_rows(
                &p.v,
                v_at,
                k0,
                block_end,
                &mut x_tile,
                t.bk,
                t.d_v,
                t.d_v,
                t.x_layout().transposed(),
                t.units,
            );
            sync_cube();
            zero(&mut dp, t.dp);
            P::product::<F, F>(
                &do_tile,
                t.do_layout(),
                &x_tile,
                t.x_layout(),
                &mut dp,
                t.dp,
            );
            sync_cube();
            stage_rows(
                &p.k,
                k_at,
                k0,
                block_end,
                &mut x_tile,
                t.bk,
                t.d_k,
                t.d_k,
                t.x_layout().transposed(),
                t.units,
            );
            sync_cube();
            zero(&mut s, t.s);
            P::product::<F, F>(&q_tile, t.q_layout(), &x_tile, t.x_layout(), &mut s, t.s);

            // Every query of the tile sees every key of the block, or each score is tested.
            let tile_last = min(start + t.bq, queries) - 1;
            let whole = whole_keys
                && start + t.bq <= queries
                && keys_of(p, b, tile_last).lo <= k0 as i32
                && keys_of(p, b, start).hi >= (k0 + t.bk) as i32;
            #[unroll]
            for i in 0..s_rows {
                let query = start + row_of(t.s, i);
                let row = min(query, queries - 1);
                let span = keys_of(p, b, row);
                let row_lse = lse[bh * queries + row];
                let row_delta = delta[bh * queries + row];
                #[unroll]
                for j in 0..s_cols {
                    let e = comptime!(i * s_cols + j);
                    let key = k0 + col_of(t.s, j);
                    let visible = whole
                        || (query < queries && key as i32 >= span.lo && (key as i32) < span.hi);
                    let g = grad_at(
                        p,
                        s[e],
                        dp[e],
                        row_lse,
                        row_delta,
                        b,
                        h,
                        row,
                        min(key, keys - 1),
                        visible,
                    );
                    s[e] = g.p;
                    dp[e] = g.ds * g.slope;
                }
            }
            write_tile(&mut pds, &s, t.s, t.bk + 1);
            sync_cube();
            P::product::<f32, F>(
                &pds,
                t.x_layout().transposed(),
                &do_tile,
                t.do_layout(),
                &mut acc_v,
                t.dv,
            );
            sync_cube();
            write_tile(&mut pds, &dp, t.s, t.bk + 1);
            sync_cube();
            P::product::<f32, F>(
                &pds,
                t.x_layout().transposed(),
                &q_tile,
                t.q_layout(),
                &mut acc_k,
                t.dk,
            );
            sync_cube();
            t0 += t.bq as i32;
        }
    }

    let scale = p.scale;
    write_rows(dk, &acc_k, b, hk, k0, keys, scale, t.dk, t.d_k);
    write_rows(dv, &acc_v, b, hk, k0, keys, 1.0f32, t.dv, t.d_v);
}

/// Writes the unit's elements of `c` under `p` to `tile` (row stride `row`).
#[cube]
fn write_tile(
    tile: &mut Shared<[f32]>,
    c: &Array<f32>,
    #[comptime] p: Product,
    #[comptime] row: usize,
) {
    #[unroll]
    for i in 0..comptime!(p.rows()) {
        #[unroll]
        for j in 0..comptime!(p.cols()) {
            tile[row_of(p, i) * row + col_of(p, j)] = c[comptime!(i * p.cols() + j)];
        }
    }
}

/// Writes the unit's elements of `c` under `p` (rows: positions `first ..` of head `head`
/// of batch row `b`, columns: the first `cols` head dims), times `scale`, to `out`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn write_rows<F: Float>(
    out: &mut Tensor<F>,
    c: &Array<f32>,
    b: usize,
    head: usize,
    first: usize,
    rows: usize,
    scale: f32,
    #[comptime] p: Product,
    #[comptime] cols: usize,
) {
    #[unroll]
    for i in 0..comptime!(p.rows()) {
        let row = first + row_of(p, i);
        if row < rows {
            let at = b * out.stride(0) + head * out.stride(1) + row * out.stride(2);
            let col_stride = out.stride(3);
            #[unroll]
            for j in 0..comptime!(p.cols()) {
                let d = col_of(p, j);
                if d < cols {
                    out[at + d * col_stride] = F::cast_from(c[comptime!(i * p.cols() + j)] * scale);
                }
            }
        }
    }
}

/// `out[z, e] = Σ partial[r, e]` over the rows `r` of chunk `z` (`chunk` rows each, in
/// order): unit `e` of the grid's `x`, `y`, chunk `z` of its `z`.
#[cube(launch)]
pub(crate) fn reduce_kernel<O: Float>(
    partial: &Tensor<f32>,
    out: &mut Tensor<O>,
    chunk: u32,
    #[define(O)] _dtype: ElemType,
) {
    let elements = partial.shape(1);
    let e = ((CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X) as usize;
    if e < elements {
        let z = CUBE_POS_Z as usize;
        let start = z * chunk as usize;
        let end = min(start + chunk as usize, partial.shape(0));
        let mut total = 0.0f32;
        for r in start..end {
            total += partial[r * elements + e];
        }
        out[z * elements + e] = O::cast_from(total);
    }
}

/// Zeros `out`'s first `len` elements: unit `e` of the grid's `x`, `y`.
#[cube(launch)]
pub(crate) fn zeros_kernel(out: &mut Tensor<f32>, len: u32) {
    let e = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X;
    if e < len {
        out[e as usize] = 0.0f32;
    }
}
