//! The forward pass: a cube owns a block of `bq` query rows of one head and walks the key
//! tiles (`bk` keys each) its rows see between them. Per tile: `S = Q Kᵀ` by the tile
//! product (the block's queries staged once, the keys staged per tile,
//! transposed; the scale applied to each sum), the scores made by [`masked`], an online softmax in f32 (each row's
//! maximum reduced across the units that hold its columns, through shared memory), the
//! weights `P` written to shared memory, the values staged over the keys, and `O += P V`
//! by the tile product. A unit holds the same rows of `S` and of `O`, so that rescaling a
//! row to its new maximum needs nothing from other units. It writes the output and each
//! row's log-sum-exp.
//!
//! Tiles that every row of the block sees whole (most of a causal or windowed problem)
//! skip the visibility test; the others (a band's edges, packed sequences' edges, the
//! last keys) test each score. One loop iteration per tile: no invocation nears a
//! driver's cap on loop iterations.

use cubecl::prelude::*;

use super::scores::{
    Block, INVISIBLE, NO_MAX, Problem, QUERIES_LAST_FIRST, block, capped, keys_of, masked,
};
use super::tile::{
    Fragment, Product, Quad, Read, Tile, TileProduct, col0, row0, shared_tile, stage, write_tile,
    zero,
};
use crate::mask::{DEAD_LSE, DEAD_ROW};

/// The compile-time shape of the forward kernel.
#[derive_cube_comptime]
pub(crate) struct ForwardTiles {
    pub(crate) units: usize,
    /// Query rows per cube.
    pub(crate) bq: usize,
    /// Keys per tile.
    pub(crate) bk: usize,
    pub(crate) d_k: usize,
    pub(crate) d_v: usize,
    /// `S = Q Kᵀ`, `bq x bk` over `d_k`.
    pub(crate) s: Product,
    /// `O += P V`, `bq x dv'` over `bk` (`dv'`: `d_v` rounded up to whole quads per unit;
    /// the same rows per unit as `s`).
    pub(crate) o: Product,
    /// The scores are soft-capped.
    pub(crate) softcap: bool,
    /// The products' cooperative-matrix fragment, or [`Fragment::NONE`].
    pub(crate) frag: Fragment,
}

impl ForwardTiles {
    /// The tiles for `units` units, `bq` queries and `bk` keys.
    ///
    /// # Panics
    /// If the units cannot share the tiles in whole quads.
    pub(crate) fn new(units: usize, bq: usize, bk: usize, d_k: usize, d_v: usize) -> Self {
        let s = Product::new(bq, bk, d_k, units, true);
        let o = Product {
            m: bq,
            n: d_v.next_multiple_of(4 * s.ux),
            k: bk,
            ux: s.ux,
            units,
        };
        Self {
            units,
            bq,
            bk,
            d_k,
            d_v,
            s,
            o,
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
    fn products(&self) -> [Product; 2] {
        [self.s, self.o]
    }

    /// Bytes of shared memory a cube takes, with inputs of `size` bytes (and the weights
    /// in them too, in fragments).
    pub(crate) fn shared_bytes(&self, size: usize) -> usize {
        let inputs = self.q().quads() + self.kt().quads().max(self.v().quads());
        let weights = self.frag.weight_bytes(size);
        (inputs * size + self.p().quads() * weights + self.scratch() * 4) * 4
            + self.bq * self.s.ux * 4
    }

    /// Quads of the products' scratch.
    fn scratch(&self) -> usize {
        self.frag.scratch(&self.products())
    }

    /// The block's queries: `A` of `S`.
    pub(crate) fn q(&self) -> Tile {
        self.frag.tile(self.bq, self.d_k)
    }

    /// A tile's keys, transposed: `B` of `S`.
    fn kt(&self) -> Tile {
        self.frag.tile(self.d_k.next_multiple_of(4), self.bk)
    }

    /// A tile's values: `B` of `O`.
    fn v(&self) -> Tile {
        self.frag.tile(self.bk, self.o.n)
    }

    /// The weights: `A` of `O` (in f32, or in the inputs' dtype in fragments).
    fn p(&self) -> Tile {
        self.frag.tile(self.bq, self.bk)
    }
}

/// One cube: query rows `block.first ..` of head `block.bh`; writes `out` `[B, H, Tq, Dv]`
/// (any strides) in the inputs' dtype and `lse` `[B, H, Tq]` (contiguous) in f32. A row
/// that sees no key, or only blocked ones (its largest score at or below [`DEAD_ROW`]),
/// gets zeros and the log-sum-exp [`DEAD_LSE`]. The weights `P` go to shared memory in
/// `W`: f32 for [`super::tile::Registers`], the inputs' dtype for
/// [`super::tile::Cooperative`].
#[cube(launch, launch_unchecked)]
pub(crate) fn forward_kernel<F: Float, M: Int, N: Size, W: Float, P: TileProduct>(
    p: &Problem<F, M, N>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    #[comptime] t: ForwardTiles,
    #[define(F, M, W)] _dtypes: [ElemType; 3],
) {
    let heads = p.q.shape(1);
    let queries = p.q.shape(2);
    let blk = block(
        p.q.shape(0) * heads,
        heads,
        queries,
        (p.order & QUERIES_LAST_FIRST) != 0,
        t.bq,
    );
    if blk.live {
        forward_block::<F, M, N, W, P>(p, out, lse, &blk, t);
    }
}

#[cube]
fn forward_block<F: Float, M: Int, N: Size, W: Float, P: TileProduct>(
    p: &Problem<F, M, N>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    blk: &Block,
    #[comptime] t: ForwardTiles,
) {
    let (s_rows, s_cols, o_cols) = comptime!((t.s.rows(), t.s.cols(), t.o.cols()));
    let (queries, keys) = (p.q.shape(2), p.k.shape(2));
    let h = blk.head;
    let hk = h / p.group as usize;
    let (b, q0) = (blk.b, blk.first);
    let (r0, c0) = (row0(t.s), col0(t.s));
    let ux = comptime!(t.s.ux);
    let tx = UNIT_POS as usize % ux;

    // The keys the block's rows see between them, those every row sees, and each of the
    // unit's rows' own.
    let first = keys_of(p, b, q0);
    let last = keys_of(p, b, blk.last);
    let mut lo = Array::<i32>::new(s_rows);
    let mut hi = Array::<i32>::new(s_rows);
    #[unroll]
    for i in 0..s_rows {
        let span = keys_of(p, b, min(q0 + r0 + i, queries - 1));
        lo[i] = span.lo;
        hi[i] = span.hi;
    }

    // The block's queries, in the inputs' dtype.
    let mut q_tile = shared_tile::<F>(comptime!(t.q().quads()));
    let q_at = b * p.q.stride(0) + h * p.q.stride(1);
    stage(
        &p.q,
        q_at,
        q0,
        queries,
        &mut q_tile,
        t.q(),
        Read::AsStored,
        t.bq,
        t.d_k,
        t.units,
    );
    let mut kv_tile = shared_tile::<F>(comptime!(max(t.kt().quads(), t.v().quads())));
    let mut p_tile = shared_tile::<W>(comptime!(t.p().quads()));
    let mut scratch = shared_tile::<f32>(comptime!(t.scratch()));
    // Each unit's partial row maxima (then sums), a quad of rows at a time: `[ux][bq / 4]`.
    let mut red = Shared::<[Quad<f32>]>::new_slice(comptime!(t.bq / 4 * t.s.ux));
    let quads = comptime!(t.bq / 4);
    let mut part = Array::<f32>::new(s_rows);

    let mut s = Array::<f32>::new(comptime!(t.s.len()));
    let mut o = Array::<f32>::new(comptime!(t.o.len()));
    zero(&mut o, t.o);
    let mut row_max = Array::<f32>::new(s_rows);
    let mut row_sum = Array::<f32>::new(s_rows);
    #[unroll]
    for i in 0..s_rows {
        row_max[i] = f32::new(NO_MAX);
        row_sum[i] = 0.0f32;
    }
    let k_at = b * p.k.stride(0) + hk * p.k.stride(1);
    let v_at = b * p.v.stride(0) + hk * p.v.stride(1);

    let mut t0 = first.lo;
    while t0 < last.hi {
        let (start, end) = (t0 as usize, last.hi as usize);
        // `S = Q Kᵀ` over the tile's keys.
        stage(
            &p.k,
            k_at,
            start,
            end,
            &mut kv_tile,
            t.kt(),
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
            &kv_tile,
            t.kt(),
            &mut s,
            t.s,
            &mut scratch,
            t.frag,
        );

        // The scores, and each row's largest in the unit's columns.
        let whole = t0 >= last.lo && t0 + t.bk as i32 <= first.hi;
        #[unroll]
        for i in 0..s_rows {
            let row = min(q0 + r0 + i, queries - 1);
            let (lo, hi) = (lo[i], hi[i]);
            let mut top = f32::new(NO_MAX);
            #[unroll]
            for j in 0..s_cols {
                let key = t0 + (c0 + j) as i32;
                let e = comptime!(i * s_cols + j);
                let mut x = masked(
                    p,
                    capped(s[e] * p.scale, p.softcap, t.softcap),
                    b,
                    h,
                    row,
                    min(key as usize, keys - 1),
                );
                if !whole && (key < lo || key >= hi) {
                    x = INVISIBLE;
                }
                s[e] = x;
                top = max(top, x);
            }
            part[i] = top;
        }
        write_rows_of(&mut red, &part, tx * quads + r0 / 4, s_rows);
        sync_cube();

        // The values over the tile's keys, while each row takes its new maximum: the
        // weights to shared memory, the sums and the output rescaled.
        stage(
            &p.v,
            v_at,
            start,
            end,
            &mut kv_tile,
            t.v(),
            Read::AsStored,
            t.bk,
            t.d_v,
            t.units,
        );
        #[unroll]
        for i in 0..s_rows {
            part[i] = row_max[i];
        }
        #[unroll]
        for x in 0..ux {
            #[unroll]
            for i4 in 0..comptime!(s_rows / 4) {
                let q = red[x * quads + r0 / 4 + i4];
                #[unroll]
                for ii in 0..4usize {
                    let i = comptime!(i4 * 4 + ii);
                    part[i] = max(part[i], q.extract(ii));
                }
            }
        }
        #[unroll]
        for i in 0..s_rows {
            let top = part[i];
            let alpha = (row_max[i] - top).exp();
            row_max[i] = top;
            let mut sum = 0.0f32;
            #[unroll]
            for j in 0..s_cols {
                let e = comptime!(i * s_cols + j);
                let w = (s[e] - top).exp();
                s[e] = w;
                sum += w;
            }
            row_sum[i] = row_sum[i] * alpha + sum;
            #[unroll]
            for j in 0..o_cols {
                o[comptime!(i * o_cols + j)] *= alpha;
            }
        }
        write_tile(&mut p_tile, t.p(), &s, t.s);
        sync_cube();

        P::product::<W, F>(
            &p_tile,
            t.p(),
            Read::AsStored,
            &kv_tile,
            t.v(),
            &mut o,
            t.o,
            &mut scratch,
            t.frag,
        );
        sync_cube();
        t0 += t.bk as i32;
    }

    // Each row's sum over every unit that holds its columns; then the output.
    write_rows_of(&mut red, &row_sum, tx * quads + r0 / 4, s_rows);
    sync_cube();
    #[unroll]
    for i in 0..s_rows {
        part[i] = 0.0f32;
    }
    #[unroll]
    for x in 0..ux {
        #[unroll]
        for i4 in 0..comptime!(s_rows / 4) {
            let q = red[x * quads + r0 / 4 + i4];
            #[unroll]
            for ii in 0..4usize {
                let i = comptime!(i4 * 4 + ii);
                part[i] += q.extract(ii);
            }
        }
    }
    #[unroll]
    for i in 0..s_rows {
        let row = q0 + r0 + i;
        let sum = part[i];
        // A NaN score makes its row's sum NaN (the maxima pass over it): that row is NaN,
        // as PyTorch's, not a row of no visible key.
        let dead = (row_max[i] <= DEAD_ROW || sum <= 0.0f32) && !sum.is_nan();
        let inv = select(dead, 0.0f32, 1.0f32 / sum);
        if row < queries {
            let at = b * out.stride(0) + h * out.stride(1) + row * out.stride(2);
            let col_stride = out.stride(3);
            let c0_o = col0(t.o);
            #[unroll]
            for j in 0..o_cols {
                let d = c0_o + j;
                if d < t.d_v {
                    // A dead row is zeros even where a value it summed is not finite
                    // (`inf · 0` is NaN), as on the CPU.
                    let value = select(dead, 0.0f32, o[comptime!(i * o_cols + j)] * inv);
                    out[at + d * col_stride] = F::cast_from(value);
                }
            }
            if tx == 0 {
                lse[blk.bh * queries + row] = select(dead, DEAD_LSE, row_max[i] + sum.ln());
            }
        }
    }
}

/// Writes `values` (`rows` of them, a multiple of four) to `red` as quads from quad `at`.
#[cube]
fn write_rows_of(
    red: &mut Shared<[Quad<f32>]>,
    values: &Array<f32>,
    at: usize,
    #[comptime] rows: usize,
) {
    #[unroll]
    for i4 in 0..comptime!(rows / 4) {
        let mut q = Quad::<f32>::empty();
        #[unroll]
        for ii in 0..4usize {
            q.insert(ii, values[comptime!(i4 * 4 + ii)]);
        }
        red[at + i4] = q;
    }
}
