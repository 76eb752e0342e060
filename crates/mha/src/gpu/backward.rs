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

use super::scores::{
    Block, KEYS_LAST_FIRST, Problem, QUERIES_LAST_FIRST, block, cap_slope, capped, keys_of, masked,
    queries_of,
};
use super::tile::{
    Fragment, Product, Quad, Read, Tile, TileProduct, col0, element, row0, shared_tile, stage,
    write_tile, zero,
};

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
    /// `dQ += dS K`, `bq x dk'` over `bk` (`dk'`: `d_k` rounded up to whole quads per
    /// unit).
    pub(crate) dq: Product,
    /// The scores are soft-capped.
    pub(crate) softcap: bool,
    pub(crate) bias: BiasSums,
    /// The bias by distance's gradient is asked for.
    pub(crate) pd: bool,
    /// The products' cooperative-matrix fragment, or [`Fragment::NONE`].
    pub(crate) frag: Fragment,
}

impl DqTiles {
    /// The tiles for `units` units, `bq` queries and `bk` keys.
    ///
    /// # Panics
    /// If the units cannot share the tiles in whole quads.
    pub(crate) fn new(units: usize, bq: usize, bk: usize, d_k: usize, d_v: usize) -> Self {
        let s = Product::new(bk, bq, d_k, units, false);
        Self {
            units,
            bq,
            bk,
            d_k,
            d_v,
            s,
            dp: Product { k: d_v, ..s },
            dq: Product::new(bq, padded(d_k, units, bq), bk, units, true),
            softcap: false,
            bias: BiasSums::None,
            pd: false,
            frag: Fragment::NONE,
        }
    }

    /// These tiles with their products in fragments of `frag`, if every product fits
    /// them.
    pub(crate) fn cooperative(self, frag: Fragment) -> Option<Self> {
        frag.fits_all(&self.products())
            .then_some(Self { frag, ..self })
    }

    /// The kernel's products.
    fn products(&self) -> [Product; 3] {
        [self.s, self.dp, self.dq]
    }

    /// Bytes of shared memory a cube takes, with inputs of `size` bytes (and dS in them
    /// too, in fragments).
    pub(crate) fn shared_bytes(&self, size: usize) -> usize {
        let inputs =
            self.qt().quads() + self.dot().quads() + self.v().quads().max(self.k().quads());
        let weights = self.frag.weight_bytes(size);
        (inputs * size + self.ds().quads() * weights + self.scratch() * 4) * 4
            + (self.bq + self.bk) * 4
    }

    /// Quads of the products' scratch.
    fn scratch(&self) -> usize {
        self.frag.scratch(&self.products())
    }

    /// The block's queries, transposed: `B` of `Sᵀ`.
    fn qt(&self) -> Tile {
        self.frag.tile(self.d_k.next_multiple_of(4), self.bq)
    }

    /// The block's output gradients, transposed: `B` of `dPᵀ`.
    fn dot(&self) -> Tile {
        self.frag.tile(self.d_v.next_multiple_of(4), self.bq)
    }

    /// A tile's values: `A` of `dPᵀ`.
    fn v(&self) -> Tile {
        self.frag.tile(self.bk, self.d_v)
    }

    /// A tile's keys: `A` of `Sᵀ`, `B` of `dQ`.
    fn k(&self) -> Tile {
        self.frag.tile(self.bk, self.dq.n)
    }

    /// dS, keys by queries: `A` of `dQ`, read transposed.
    fn ds(&self) -> Tile {
        self.frag.tile(self.bk, self.bq)
    }

    /// dS in f32 in the products' scratch, for the bias gradients' sums where `ds`
    /// holds it in the inputs' dtype (the shape of `Sᵀ`'s `C`, which the scratch holds).
    fn sums(&self) -> Tile {
        Tile::new(self.bk, self.bq)
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
    /// The scores are soft-capped.
    pub(crate) softcap: bool,
    /// The products' cooperative-matrix fragment, or [`Fragment::NONE`].
    pub(crate) frag: Fragment,
}

impl DkvTiles {
    /// The tiles for `units` units, `bq` queries and `bk` keys.
    ///
    /// # Panics
    /// If the units cannot share the tiles in whole quads.
    pub(crate) fn new(units: usize, bq: usize, bk: usize, d_k: usize, d_v: usize) -> Self {
        let s = Product::new(bq, bk, d_k, units, false);
        Self {
            units,
            bq,
            bk,
            d_k,
            d_v,
            s,
            dp: Product { k: d_v, ..s },
            dv: Product::new(bk, padded(d_v, units, bk), bq, units, true),
            dk: Product::new(bk, padded(d_k, units, bk), bq, units, true),
            softcap: false,
            frag: Fragment::NONE,
        }
    }

    /// These tiles with their products in fragments of `frag`, if every product fits
    /// them.
    pub(crate) fn cooperative(self, frag: Fragment) -> Option<Self> {
        frag.fits_all(&self.products())
            .then_some(Self { frag, ..self })
    }

    /// The kernel's products.
    fn products(&self) -> [Product; 4] {
        [self.s, self.dp, self.dv, self.dk]
    }

    /// Bytes of shared memory a cube takes, with inputs of `size` bytes (and P and dS in
    /// them too, in fragments).
    pub(crate) fn shared_bytes(&self, size: usize) -> usize {
        let inputs = self.q().quads() + self.d_o().quads() + self.x().quads();
        let weights = self.frag.weight_bytes(size);
        (inputs * size + self.pds().quads() * weights + self.scratch() * 4) * 4
    }

    /// Quads of the products' scratch.
    fn scratch(&self) -> usize {
        self.frag.scratch(&self.products())
    }

    /// A tile's queries: `A` of `S`, `B` of `dK`.
    fn q(&self) -> Tile {
        self.frag.tile(self.bq, self.dk.n)
    }

    /// A tile's output gradients: `A` of `dP`, `B` of `dV`.
    fn d_o(&self) -> Tile {
        self.frag.tile(self.bq, self.dv.n)
    }

    /// The block's values, then keys, transposed: `B` of `dP`, then of `S`.
    fn x(&self) -> Tile {
        self.frag
            .tile(self.d_k.max(self.d_v).next_multiple_of(4), self.bk)
    }

    /// P, then dS, queries by keys: `A` of `dV` and `dK`, read transposed.
    fn pds(&self) -> Tile {
        self.frag.tile(self.bq, self.bk)
    }
}

/// A head dim rounded up so that `units` units share an output product of `rows` rows in
/// whole quads of columns (at most 16 columns a unit).
pub(crate) fn padded(d: usize, units: usize, rows: usize) -> usize {
    // The fewest units along the columns that keep the rows in whole quads.
    let ux = (units / (rows / 4)).max(1);
    d.next_multiple_of(4 * ux).max(d.next_multiple_of(16))
}

/// `delta[bh, i] = Σ_d grad[b, h, i, d] · out[b, h, i, d]`: one unit per query row of
/// every head (`B · H · Tq` rows, numbered along the grid's `x`, then `y`).
#[cube(launch, launch_unchecked)]
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
fn grad_at<F: Float, M: Int, N: Size>(
    p: &Problem<F, M, N>,
    raw: f32,
    dp: f32,
    lse: f32,
    delta: f32,
    b: usize,
    h: usize,
    i: usize,
    j: usize,
    visible: bool,
    #[comptime] softcap: bool,
) -> Grad {
    let c = capped(raw * p.scale, p.softcap, softcap);
    let s = masked(p, c, b, h, i, j);
    let w = select(visible, (s - lse).exp(), 0.0f32);
    Grad {
        p: w,
        ds: w * (dp - delta),
        slope: cap_slope(c, p.softcap, softcap),
    }
}

/// `dQ`, queries outer: query rows `block.first ..` of head `block.bh`, over the key tiles
/// they see; writes `dq` (the query's shape, any strides) and, where asked for, the
/// partial rows of the bias's gradient (`dbias`, `[R, E]`, see [`BiasSums`] and
/// `bias_rows`) and of the bias by distance's (`dpd`, `[B · blocks, H · (Tq + Tk -
/// 1)]`, row `b · blocks + block`).
#[cube(launch, launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dq_kernel<F: Float, M: Int, N: Size, W: Float, P: TileProduct>(
    p: &Problem<F, M, N>,
    grad: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<F>,
    dbias: &mut ComptimeOption<OwnedTensor<f32>>,
    dpd: &mut ComptimeOption<OwnedTensor<f32>>,
    #[comptime] t: DqTiles,
    #[define(F, M, W)] _dtypes: [ElemType; 3],
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
        dq_block::<F, M, N, W, P>(p, grad, lse, delta, dq, dbias, dpd, &blk, t);
    }
}

#[cube]
#[allow(clippy::too_many_arguments)]
fn dq_block<F: Float, M: Int, N: Size, W: Float, P: TileProduct>(
    p: &Problem<F, M, N>,
    grad: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<F>,
    dbias: &mut ComptimeOption<OwnedTensor<f32>>,
    dpd: &mut ComptimeOption<OwnedTensor<f32>>,
    blk: &Block,
    #[comptime] t: DqTiles,
) {
    let (s_rows, s_cols) = comptime!((t.s.rows(), t.s.cols()));
    let (queries, keys) = (p.q.shape(2), p.k.shape(2));
    let h = blk.head;
    let hk = h / p.group as usize;
    let (b, q0) = (blk.b, blk.first);
    // The unit's keys (rows of `Sᵀ`) and queries (columns).
    let (r0, c0) = (row0(t.s), col0(t.s));

    let first = keys_of(p, b, q0);
    let last = keys_of(p, b, blk.last);
    // The unit's queries: their keys, log-sum-exps and `D`; a query past the last has no
    // key.
    let mut lo = Array::<i32>::new(s_cols);
    let mut hi = Array::<i32>::new(s_cols);
    let mut row_lse = Array::<f32>::new(s_cols);
    let mut row_delta = Array::<f32>::new(s_cols);
    #[unroll]
    for j in 0..s_cols {
        let i = q0 + c0 + j;
        let row = min(i, queries - 1);
        let span = keys_of(p, b, row);
        lo[j] = span.lo;
        hi[j] = select(i < queries, span.hi, span.lo);
        row_lse[j] = lse[blk.bh * queries + row];
        row_delta[j] = delta[blk.bh * queries + row];
    }

    // The block's queries and output gradients, transposed; the key tiles' values, then
    // keys, in one buffer; dS.
    let mut qt = shared_tile::<F>(comptime!(t.qt().quads()));
    let mut dot = shared_tile::<F>(comptime!(t.dot().quads()));
    let q_at = b * p.q.stride(0) + h * p.q.stride(1);
    let g_at = b * grad.stride(0) + h * grad.stride(1);
    stage(
        &p.q,
        q_at,
        q0,
        queries,
        &mut qt,
        t.qt(),
        Read::Transposed,
        t.bq,
        t.d_k,
        t.units,
    );
    stage(
        grad,
        g_at,
        q0,
        queries,
        &mut dot,
        t.dot(),
        Read::Transposed,
        t.bq,
        t.d_v,
        t.units,
    );
    let mut kv = shared_tile::<F>(comptime!(max(t.v().quads(), t.k().quads())));
    let mut ds_tile = shared_tile::<W>(comptime!(t.ds().quads()));
    let mut scratch = shared_tile::<f32>(comptime!(t.scratch()));
    let mut ring = Shared::<[f32]>::new_slice(comptime!(t.bq + t.bk));
    let unit = UNIT_POS as usize;
    // Slot `u` zeroed by the unit that sums the first tile's diagonal `u` (`pd_tile`).
    #[unroll]
    for step in 0..comptime!((t.bq + t.bk).div_ceil(t.units)) {
        let slot = comptime!(step * t.units) + unit;
        if slot < comptime!(t.bq + t.bk) {
            ring[slot] = 0.0f32;
        }
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
        let (start, end) = (t0 as usize, last.hi as usize);
        stage(
            &p.v,
            v_at,
            start,
            end,
            &mut kv,
            t.v(),
            Read::AsStored,
            t.bk,
            t.d_v,
            t.units,
        );
        sync_cube();
        zero(&mut dp, t.dp);
        P::product::<F, F>(
            &kv,
            t.v(),
            Read::AsStored,
            &dot,
            t.dot(),
            &mut dp,
            t.dp,
            &mut scratch,
            t.frag,
        );
        sync_cube();
        stage(
            &p.k,
            k_at,
            start,
            end,
            &mut kv,
            t.k(),
            Read::AsStored,
            t.bk,
            t.d_k,
            t.units,
        );
        sync_cube();
        zero(&mut s, t.s);
        P::product::<F, F>(
            &kv,
            t.k(),
            Read::AsStored,
            &qt,
            t.qt(),
            &mut s,
            t.s,
            &mut scratch,
            t.frag,
        );

        let whole = t0 >= last.lo && t0 + t.bk as i32 <= first.hi;
        #[unroll]
        for i in 0..s_rows {
            let key = t0 + (r0 + i) as i32;
            #[unroll]
            for j in 0..s_cols {
                let e = comptime!(i * s_cols + j);
                let query = q0 + c0 + j;
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
                    t.softcap,
                );
                if comptime!(sums) {
                    slope[e] = g.slope;
                    s[e] = g.ds;
                } else {
                    s[e] = g.ds * g.slope;
                }
            }
        }
        // The bias gradients' sums take dS in f32: from `ds_tile`, or, where it holds dS
        // in the inputs' dtype for cooperative matrices, from the products' scratch
        // (free until the next product).
        let sums_apart = comptime!(sums && t.frag.is_some());
        if comptime!(sums_apart) {
            write_tile(&mut scratch, t.sums(), &s, t.s);
        }
        write_tile(&mut ds_tile, t.ds(), &s, t.s);
        sync_cube();
        if comptime!(sums) {
            // dQ takes dS times the cap's slope.
            if comptime!(sums_apart) {
                row_sum += bias_tile(p, dbias, &scratch, t.sums(), blk, t0, t);
                pd_tile(p, dpd, &scratch, t.sums(), &mut ring, blk, t0, n, t);
            } else {
                row_sum += bias_tile(p, dbias, &ds_tile, t.ds(), blk, t0, t);
                pd_tile(p, dpd, &ds_tile, t.ds(), &mut ring, blk, t0, n, t);
            }
            if comptime!(t.softcap) {
                sync_cube();
                #[unroll]
                for e in 0..comptime!(t.s.len()) {
                    s[e] *= slope[e];
                }
                write_tile(&mut ds_tile, t.ds(), &s, t.s);
            }
            sync_cube();
        }
        P::product::<W, F>(
            &ds_tile,
            t.ds(),
            Read::Transposed,
            &kv,
            t.k(),
            &mut acc,
            t.dq,
            &mut scratch,
            t.frag,
        );
        sync_cube();
        t0 += t.bk as i32;
        n += 1;
    }

    pd_rest(p, dpd, &ring, blk, first.lo, n, t);
    bias_rest(p, dbias, blk, row_sum, t);
    write_rows(dq, &acc, b, h, q0, queries, p.scale, t.dq, t.d_k);
}

/// Where the bias's partial row `x` of `xs` for batch row `b` and head `h` starts: the
/// partial rows run over the axes the bias broadcasts along (its batch axis of size 1:
/// every batch row a row of its own; its head axis of size 1: every head), then over the
/// `xs` sums a cube makes (its query block, or its query), each row as long as the bias.
#[cube]
fn bias_row<F: Float, M: Int, N: Size>(
    p: &Problem<F, M, N>,
    b: usize,
    h: usize,
    x: usize,
    xs: usize,
) -> usize {
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
fn bias_element<F: Float, M: Int, N: Size>(
    p: &Problem<F, M, N>,
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
fn bias_tile<F: Float, M: Int, N: Size, W: Float>(
    p: &Problem<F, M, N>,
    dbias: &mut ComptimeOption<OwnedTensor<f32>>,
    ds_tile: &Shared<[Quad<W>]>,
    #[comptime] ds: Tile,
    blk: &Block,
    t0: i32,
    #[comptime] t: DqTiles,
) -> f32 {
    let mut row_sum = 0.0f32;
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
                                element(ds_tile, ds, c, r);
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
                        for r4 in 0..comptime!(t.bq / 4) {
                            let q = ds_tile[unit * comptime!(ds.stride() / 4) + r4];
                            sum += f32::cast_from(q.extract(0usize))
                                + f32::cast_from(q.extract(1usize))
                                + f32::cast_from(q.extract(2usize))
                                + f32::cast_from(q.extract(3usize));
                        }
                        dbias[at + bias_element(p, blk.b, blk.head, 0, j)] = sum;
                    }
                }
                BiasSums::Some { .. } => {
                    if unit < t.bq {
                        let mut sum = 0.0f32;
                        #[unroll]
                        for c in 0..t.bk {
                            sum += element(ds_tile, ds, c, unit);
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
fn bias_rest<F: Float, M: Int, N: Size>(
    p: &Problem<F, M, N>,
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
/// bias by distance's gradient: unit `u` sums the tile's diagonals `u`, `u + units`, ...
/// (diagonal `d`: key − query = `t0 - first - (bq - 1) + d`; a tile has `bq + bk - 1`,
/// which may be more than the units) and adds what earlier tiles left of each in `ring`;
/// a diagonal no later tile reaches (`d < bk`) is written to the cube's partial row, the
/// others carried in `ring`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn pd_tile<F: Float, M: Int, N: Size, W: Float>(
    p: &Problem<F, M, N>,
    dpd: &mut ComptimeOption<OwnedTensor<f32>>,
    ds_tile: &Shared<[Quad<W>]>,
    #[comptime] ds: Tile,
    ring: &mut Shared<[f32]>,
    blk: &Block,
    t0: i32,
    n: usize,
    #[comptime] t: DqTiles,
) {
    let unit = UNIT_POS as usize;
    #[comptime]
    match dpd {
        ComptimeOption::Some(dpd) => {
            let (at, columns) = pd_row(p, blk, t);
            #[unroll]
            for step in 0..comptime!((t.bq + t.bk - 1).div_ceil(t.units)) {
                let d = comptime!(step * t.units) + unit;
                if d < comptime!(t.bq + t.bk - 1) {
                    let mut sum = 0.0f32;
                    #[unroll]
                    for r in 0..t.bq {
                        let c = d as i32 + comptime!(r as i32 - (t.bq as i32 - 1));
                        if c >= 0 && c < t.bk as i32 {
                            sum += element(ds_tile, ds, c as usize, r);
                        }
                    }
                    let slot = (n * t.bk + d) % comptime!(t.bq + t.bk);
                    let total = ring[slot] + sum;
                    if d < t.bk {
                        let column = t0 - blk.first as i32 - comptime!(t.bq as i32 - 1)
                            + d as i32
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
        }
        ComptimeOption::None => {}
    }
}

/// After the `n` tiles from key `lo` on: the last tile's diagonals still open written
/// (the partial rows start at zeros: nothing else to write where no tile reached).
#[cube]
fn pd_rest<F: Float, M: Int, N: Size>(
    p: &Problem<F, M, N>,
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
            // Diagonal `d` of the last tile, summed by the unit `pd_tile` gave it.
            #[unroll]
            for step in 0..comptime!((t.bq + t.bk - 1).div_ceil(t.units)) {
                let d = comptime!(step * t.units) + unit;
                if n > 0 && d >= t.bk && d < comptime!(t.bq + t.bk - 1) {
                    let at_ring = (n - 1) * t.bk + d;
                    let column = first + at_ring as i32;
                    if column >= 0 && column < columns as i32 {
                        dpd[at + column as usize] = ring[at_ring % comptime!(t.bq + t.bk)];
                    }
                }
            }
        }
        ComptimeOption::None => {}
    }
}

/// Where the cube's partial row of the bias by distance's gradient starts (row `b ·
/// blocks + block`, element `h · columns + column`), and `columns = Tq + Tk - 1`.
#[cube]
fn pd_row<F: Float, M: Int, N: Size>(
    p: &Problem<F, M, N>,
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
#[cube(launch, launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn dkv_kernel<F: Float, M: Int, N: Size, W: Float, P: TileProduct>(
    p: &Problem<F, M, N>,
    grad: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    #[comptime] t: DkvTiles,
    #[define(F, M, W)] _dtypes: [ElemType; 3],
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
        dkv_block::<F, M, N, W, P>(p, grad, lse, delta, dk, dv, &blk, t);
    }
}

#[cube]
#[allow(clippy::too_many_arguments)]
fn dkv_block<F: Float, M: Int, N: Size, W: Float, P: TileProduct>(
    p: &Problem<F, M, N>,
    grad: &Tensor<Vector<F, N>>,
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
    // The unit's queries (rows of `S`) and keys (columns).
    let (r0, c0) = (row0(t.s), col0(t.s));
    // The queries that see the block's keys between them.
    let first = queries_of(p, b, k0);
    let last = queries_of(p, b, blk.last);

    let mut q_tile = shared_tile::<F>(comptime!(t.q().quads()));
    let mut do_tile = shared_tile::<F>(comptime!(t.d_o().quads()));
    let mut x_tile = shared_tile::<F>(comptime!(t.x().quads()));
    let mut pds = shared_tile::<W>(comptime!(t.pds().quads()));
    let mut scratch = shared_tile::<f32>(comptime!(t.scratch()));
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
            stage(
                grad,
                g_at,
                start,
                end,
                &mut do_tile,
                t.d_o(),
                Read::AsStored,
                t.bq,
                t.d_v,
                t.units,
            );
            stage(
                &p.q,
                q_at,
                start,
                end,
                &mut q_tile,
                t.q(),
                Read::AsStored,
                t.bq,
                t.d_k,
                t.units,
            );
            stage(
                &p.v,
                v_at,
                k0,
                block_end,
                &mut x_tile,
                t.x(),
                Read::Transposed,
                t.bk,
                t.d_v,
                t.units,
            );
            sync_cube();
            zero(&mut dp, t.dp);
            P::product::<F, F>(
                &do_tile,
                t.d_o(),
                Read::AsStored,
                &x_tile,
                t.x(),
                &mut dp,
                t.dp,
                &mut scratch,
                t.frag,
            );
            sync_cube();
            stage(
                &p.k,
                k_at,
                k0,
                block_end,
                &mut x_tile,
                t.x(),
                Read::Transposed,
                t.bk,
                t.d_k,
                t.units,
            );
            sync_cube();
            zero(&mut s, t.s);
            P::product::<F, F>(
                &q_tile,
                t.q(),
                Read::AsStored,
                &x_tile,
                t.x(),
                &mut s,
                t.s,
                &mut scratch,
                t.frag,
            );

            // Every query of the tile sees every key of the block, or each score is tested.
            let tile_last = min(start + t.bq, queries) - 1;
            let whole = whole_keys
                && start + t.bq <= queries
                && keys_of(p, b, tile_last).lo <= k0 as i32
                && keys_of(p, b, start).hi >= (k0 + t.bk) as i32;
            #[unroll]
            for i in 0..s_rows {
                let query = start + r0 + i;
                let row = min(query, queries - 1);
                let span = keys_of(p, b, row);
                let row_lse = lse[bh * queries + row];
                let row_delta = delta[bh * queries + row];
                #[unroll]
                for j in 0..s_cols {
                    let e = comptime!(i * s_cols + j);
                    let key = k0 + c0 + j;
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
                        t.softcap,
                    );
                    s[e] = g.p;
                    dp[e] = g.ds * g.slope;
                }
            }
            write_tile(&mut pds, t.pds(), &s, t.s);
            sync_cube();
            P::product::<W, F>(
                &pds,
                t.pds(),
                Read::Transposed,
                &do_tile,
                t.d_o(),
                &mut acc_v,
                t.dv,
                &mut scratch,
                t.frag,
            );
            sync_cube();
            write_tile(&mut pds, t.pds(), &dp, t.s);
            sync_cube();
            P::product::<W, F>(
                &pds,
                t.pds(),
                Read::Transposed,
                &q_tile,
                t.q(),
                &mut acc_k,
                t.dk,
                &mut scratch,
                t.frag,
            );
            sync_cube();
            t0 += t.bq as i32;
        }
    }

    write_rows(dk, &acc_k, b, hk, k0, keys, p.scale, t.dk, t.d_k);
    write_rows(dv, &acc_v, b, hk, k0, keys, 1.0f32, t.dv, t.d_v);
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
    let (r0, c0) = (row0(p), col0(p));
    #[unroll]
    for i in 0..comptime!(p.rows()) {
        let row = first + r0 + i;
        if row < rows {
            let at = b * out.stride(0) + head * out.stride(1) + row * out.stride(2);
            let col_stride = out.stride(3);
            #[unroll]
            for j in 0..comptime!(p.cols()) {
                let d = c0 + j;
                if d < cols {
                    out[at + d * col_stride] = F::cast_from(c[comptime!(i * p.cols() + j)] * scale);
                }
            }
        }
    }
}

/// `out[z, e] = Σ partial[r, e]` over the rows `r` of chunk `z` (`chunk` rows each, in
/// order): unit `e` of the grid's `x`, `y`, chunk `z` of its `z`.
#[cube(launch, launch_unchecked)]
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
#[cube(launch, launch_unchecked)]
pub(crate) fn zeros_kernel(out: &mut Tensor<f32>, len: u32) {
    let e = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * CUBE_DIM_X + UNIT_POS_X;
    if e < len {
        out[e as usize] = 0.0f32;
    }
}
