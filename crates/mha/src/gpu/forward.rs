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
use super::tile::{Layout, Product, TileProduct, col_of, row_of, zero};
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
    /// `O += P V`, `bq x dv'` over `bk` (`dv'`: `d_v` rounded up; the same rows per unit
    /// as `s`).
    pub(crate) o: Product,
}

impl ForwardTiles {
    /// The tiles for `units` units, `bq` queries and `bk` keys.
    pub(crate) fn new(units: usize, bq: usize, bk: usize, d_k: usize, d_v: usize) -> Self {
        let s = Product::new(bq, bk, d_k, units);
        let o = Product {
            m: bq,
            n: d_v.next_multiple_of(s.ux),
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
        }
    }

    /// Bytes of shared memory a cube takes, with inputs of `size` bytes.
    pub(crate) fn shared_bytes(&self, size: usize) -> usize {
        let q = self.bq * (self.d_k + 1);
        let kv = (self.d_k * (self.bk + 1)).max(self.bk * (self.o.n + 1));
        let p = self.bq * (self.bk + 1);
        let red = self.bq * self.s.ux;
        (q + kv) * size + (p + red) * 4
    }

    fn q_layout(&self) -> Layout {
        Layout::rows_of(self.d_k)
    }

    fn kt_layout(&self) -> Layout {
        Layout::rows_of(self.bk)
    }

    fn v_layout(&self) -> Layout {
        Layout::rows_of(self.o.n)
    }

    fn p_layout(&self) -> Layout {
        Layout::rows_of(self.bk)
    }
}

/// One cube: query rows `block.first ..` of head `block.bh`; writes `out` `[B, H, Tq, Dv]`
/// (any strides) in the inputs' dtype and `lse` `[B, H, Tq]` (contiguous) in f32. A row
/// that sees no key, or only blocked ones (its largest score at or below [`DEAD_ROW`]),
/// gets zeros and the log-sum-exp [`DEAD_LSE`].
#[cube(launch)]
pub(crate) fn forward_kernel<F: Float, M: Int, P: TileProduct>(
    p: &Problem<F, M>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    #[comptime] t: ForwardTiles,
    #[define(F, M)] _dtypes: [ElemType; 2],
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
        forward_block::<F, M, P>(p, out, lse, &blk, t);
    }
}

#[cube]
fn forward_block<F: Float, M: Int, P: TileProduct>(
    p: &Problem<F, M>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    blk: &Block,
    #[comptime] t: ForwardTiles,
) {
    let s_rows = comptime!(t.s.rows());
    let s_cols = comptime!(t.s.cols());
    let o_cols = comptime!(t.o.cols());
    let queries = p.q.shape(2);
    let h = blk.head;
    let hk = h / p.group as usize;
    let (b, q0) = (blk.b, blk.first);

    // The keys the block's rows see between them, those every row sees, and each of the
    // unit's rows' own.
    let first = keys_of(p, b, q0);
    let last = keys_of(p, b, blk.last);
    let mut lo = Array::<i32>::new(s_rows);
    let mut hi = Array::<i32>::new(s_rows);
    #[unroll]
    for i in 0..s_rows {
        let span = keys_of(p, b, min(q0 + row_of(t.s, i), queries - 1));
        lo[i] = span.lo;
        hi[i] = span.hi;
    }

    // The block's queries, in the inputs' dtype.
    let mut q_tile = Shared::<[F]>::new_slice(comptime!(t.bq * (t.d_k + 1)));
    let q_at = b * p.q.stride(0) + h * p.q.stride(1);
    stage_rows(
        &p.q,
        q_at,
        q0,
        queries,
        &mut q_tile,
        t.bq,
        t.d_k,
        t.d_k,
        t.q_layout(),
        t.units,
    );
    let mut kv_tile =
        Shared::<[F]>::new_slice(comptime!(max(t.d_k * (t.bk + 1), t.bk * (t.o.n + 1))));
    let mut p_tile = Shared::<[f32]>::new_slice(comptime!(t.bq * (t.bk + 1)));
    let mut red = Shared::<[f32]>::new_slice(comptime!(t.bq * t.s.ux));

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
    let tx = UNIT_POS as usize % t.s.ux;

    let mut t0 = first.lo;
    while t0 < last.hi {
        // `S = Q Kᵀ` over the tile's keys.
        stage_rows(
            &p.k,
            k_at,
            t0 as usize,
            last.hi as usize,
            &mut kv_tile,
            t.bk,
            t.d_k,
            t.d_k,
            t.kt_layout().transposed(),
            t.units,
        );
        sync_cube();
        zero(&mut s, t.s);
        P::product::<F, F>(&q_tile, t.q_layout(), &kv_tile, t.kt_layout(), &mut s, t.s);

        // The scores, and each row's largest in the unit's columns.
        let whole = t0 >= last.lo && t0 + t.bk as i32 <= first.hi;
        #[unroll]
        for i in 0..s_rows {
            let row = min(q0 + row_of(t.s, i), queries - 1);
            let (lo, hi) = (lo[i], hi[i]);
            let mut top = f32::new(NO_MAX);
            #[unroll]
            for j in 0..s_cols {
                let key = t0 + col_of(t.s, j) as i32;
                let e = comptime!(i * s_cols + j);
                let mut x = masked(
                    p,
                    capped(s[e] * p.scale, p.softcap),
                    b,
                    h,
                    row,
                    min(key as usize, p.k.shape(2) - 1),
                );
                if !whole && (key < lo || key >= hi) {
                    x = INVISIBLE;
                }
                s[e] = x;
                top = max(top, x);
            }
            red[row_of(t.s, i) * t.s.ux + tx] = top;
        }
        sync_cube();

        // The values over the tile's keys, while each row takes its new maximum: the
        // weights to shared memory, the sums and the output rescaled.
        stage_rows(
            &p.v,
            v_at,
            t0 as usize,
            last.hi as usize,
            &mut kv_tile,
            t.bk,
            t.d_v,
            t.o.n,
            t.v_layout(),
            t.units,
        );
        #[unroll]
        for i in 0..s_rows {
            let r = row_of(t.s, i);
            let mut top = row_max[i];
            #[unroll]
            for x in 0..t.s.ux {
                top = max(top, red[r * t.s.ux + x]);
            }
            let alpha = (row_max[i] - top).exp();
            row_max[i] = top;
            let mut sum = 0.0f32;
            #[unroll]
            for j in 0..s_cols {
                let w = (s[comptime!(i * s_cols + j)] - top).exp();
                sum += w;
                p_tile[r * (t.bk + 1) + col_of(t.s, j)] = w;
            }
            row_sum[i] = row_sum[i] * alpha + sum;
            #[unroll]
            for j in 0..o_cols {
                o[comptime!(i * o_cols + j)] *= alpha;
            }
        }
        sync_cube();

        P::product::<f32, F>(&p_tile, t.p_layout(), &kv_tile, t.v_layout(), &mut o, t.o);
        sync_cube();
        t0 += t.bk as i32;
    }

    // Each row's sum over every unit that holds its columns; then the output.
    #[unroll]
    for i in 0..s_rows {
        red[row_of(t.s, i) * t.s.ux + tx] = row_sum[i];
    }
    sync_cube();
    #[unroll]
    for i in 0..s_rows {
        let r = row_of(t.s, i);
        let row = q0 + r;
        let mut sum = 0.0f32;
        #[unroll]
        for x in 0..t.s.ux {
            sum += red[r * t.s.ux + x];
        }
        let dead = row_max[i] <= DEAD_ROW || sum <= 0.0f32;
        let inv = select(dead, 0.0f32, 1.0f32 / sum);
        if row < queries {
            let at = b * out.stride(0) + h * out.stride(1) + row * out.stride(2);
            let col_stride = out.stride(3);
            #[unroll]
            for j in 0..o_cols {
                let d = col_of(t.o, j);
                if d < t.d_v {
                    out[at + d * col_stride] = F::cast_from(o[comptime!(i * o_cols + j)] * inv);
                }
            }
            if tx == 0 {
                lse[blk.bh * queries + row] = select(dead, DEAD_LSE, row_max[i] + sum.ln());
            }
        }
    }
}

/// Stages rows `first .. first + rows` of one head of `src` (its rows along axis 2, its
/// columns along axis 3, the head at `at`) into `tile` in `layout` as `S`: `cols` columns read, zeros up to `padded`, and zeros in rows from `end` on. Every
/// unit of the cube a share, neighbouring units reading neighbouring columns of a row.
/// The caller synchronises the cube before the tile is read.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage_rows<F: Float, S: Float>(
    src: &Tensor<F>,
    at: usize,
    first: usize,
    end: usize,
    tile: &mut Shared<[S]>,
    #[comptime] rows: usize,
    #[comptime] cols: usize,
    #[comptime] padded: usize,
    #[comptime] layout: Layout,
    #[comptime] units: usize,
) {
    let unit = UNIT_POS as usize;
    let (row_stride, col_stride) = (src.stride(2), src.stride(3));
    #[unroll]
    for step in 0..comptime!((rows * padded).div_ceil(units)) {
        let e = comptime!(step * units) + unit;
        if comptime!((rows * padded).is_multiple_of(units)) || e < comptime!(rows * padded) {
            let r = e / padded;
            let c = e % padded;
            let row = first + r;
            let mut x = 0.0f32;
            if row < end && c < cols {
                x = f32::cast_from(src[at + row * row_stride + c * col_stride]);
            }
            tile[r * layout.row + c * layout.col] = S::cast_from(x);
        }
    }
}
