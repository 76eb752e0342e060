//! Attention on the CPU in cache-sized tiles, forward and backward, the way FlashAttention
//! does it on a GPU: the scores of a tile of 64 queries by 64 keys are computed, turned
//! into weights and multiplied into the output while they are still in the cache, and the
//! `[Tq, Tk]` scores are never written out. The two products of a tile run through the
//! matrix kernel of `cpu::gemm` (register tiles per instruction set, FMA), the softmax
//! through a vectorised `exp` (`cpu::math`).
//!
//! The tiles are transposed, keys by queries (`Sᵀ = K · (Q·scale)ᵀ`): the key and value
//! rows are read as matrix panels where they lie, and only a tile of queries is packed.
//! The row-wise steps of the softmax then run down the columns, eight queries to a
//! vector. The kernels read slices through strides ([`Grid`]): flex's tensors and
//! ndarray's arrays in place (`cpu::tensors`), except that key and value rows a few KB
//! apart (the heads of a `[B, T, H·Dh]` projection) are first copied next to each other.
//!
//! [`forward`]: each task is one head's block of 64 queries, with a running maximum and
//! sum per query (online softmax); it writes the output and each query's log-sum-exp.
//! [`backward`]: each task is one key/value head's range of keys; it recomputes the
//! weights from the log-sum-exp.
//!
//! The mask is the causal rule (a per-key first visible query, `-inf` before it), the
//! user's boolean mask and additive bias (read through their broadcast strides, a bias
//! clamped at [`BLOCKED`], a blocked score set to it), as in the explicit path: a row that
//! sees no key, or only blocked ones, has output zero, log-sum-exp
//! [`DEAD_LSE`](crate::mask::DEAD_LSE) and passes no gradient.

mod backward;
mod forward;
#[cfg(test)]
mod tests;

use std::ops::Range;

use burn::backend::{
    Backend, TensorMetadata,
    tensor::{BoolTensor, FloatTensor},
};

use super::isa::Arch;
use super::tensors::{CpuTensors, Grid};
use crate::mask::{BLOCKED, Visibility};
use crate::positions::Buckets;
pub(crate) use crate::problem::Dims;
use backward::backward;
use forward::forward;

/// Queries per tile.
const QT: usize = 64;
/// Keys per tile.
const KT: usize = 64;

/// How the tiles make the scores of the softmax from `Q Kᵀ`, besides the user's boolean
/// mask and bias: the scale, a soft cap (`cap · tanh(s / cap)`, before the bias), and
/// which keys each query sees.
#[derive(Clone, Debug)]
pub(crate) struct Scoring {
    /// Multiplies the queries.
    pub(crate) scale: f32,
    pub(crate) softcap: Option<f32>,
    pub(crate) visibility: Visibility,
    /// A bias by position, added with the user's bias.
    pub(crate) position: Option<Positional>,
}

/// A bias by position as the tiles compute it, from the distance `d = key - (query +
/// offset)` of each score (`offset`: the visibility's, so that distances follow the
/// mask's alignment).
#[derive(Clone, Debug)]
pub(crate) enum Positional {
    /// ALiBi: `-slopes[h] · |d|`.
    Alibi { slopes: Vec<f32>, offset: i64 },
    /// A learned `[H, columns]` table: column `bucket[d - first]` of head `h`.
    Learned {
        columns: usize,
        first: i64,
        bucket: Vec<u32>,
        offset: i64,
    },
}

impl Positional {
    /// ALiBi with these slopes, over `visibility`'s problem.
    pub(crate) fn alibi(slopes: Vec<f32>, visibility: &Visibility) -> Self {
        Positional::Alibi {
            slopes,
            offset: visibility.offset,
        }
    }

    /// A learned table with these buckets, over `visibility`'s problem: the bucket of every
    /// distance it has, computed once.
    pub(crate) fn learned(buckets: Buckets, visibility: &Visibility) -> Self {
        let offset = visibility.offset;
        let first = -(visibility.queries as i64 - 1) - offset;
        let last = visibility.keys as i64 - 1 - offset;
        Positional::Learned {
            columns: buckets.len(),
            first,
            bucket: (first..=last.max(first))
                .map(|d| buckets.of(d) as u32)
                .collect(),
            offset,
        }
    }
}

/// The gradients of the query, key and value, and (when asked for) of the bias and of a
/// learned position table, as a backend's tensors.
pub(crate) struct Grads<B: Backend> {
    pub(crate) dq: FloatTensor<B>,
    pub(crate) dk: FloatTensor<B>,
    pub(crate) dv: FloatTensor<B>,
    pub(crate) bias: Option<FloatTensor<B>>,
    pub(crate) table: Option<FloatTensor<B>>,
}

/// The output `[B, H, Tq, Dv]` and log-sum-exp `[B, H, Tq, 1]` of attention over `query`
/// `[B, H, Tq, Dk]`, `key` `[B, Hkv, Tk, Dk]` and `value` `[B, Hkv, Tk, Dv]` under
/// `scoring`, the boolean mask `blocked`, the additive `bias` and the learned position
/// `table` of `scoring`'s position bias (`[1, 1, H, buckets]`).
pub(crate) fn tiled_forward<B: CpuTensors>(
    dims: Dims,
    scoring: &Scoring,
    [query, key, value]: [&FloatTensor<B>; 3],
    blocked: Option<&BoolTensor<B>>,
    [bias, table]: [Option<&FloatTensor<B>>; 2],
) -> (FloatTensor<B>, FloatTensor<B>) {
    let mask = Mask::<B>::new(blocked, bias, table);
    let q = B::readable(query);
    let [k, v] = [key, value].map(key_panel::<B>);
    let [q, k, v] = [&q, &k, &v].map(B::floats);
    let (output, lse) = forward(dims, q, k, v, mask.extra(scoring));
    let d = dims;
    (
        from_heads::<B>(output, [d.batch, d.heads, d.queries, d.d_v]),
        B::from_rows(lse, [d.batch, d.heads, d.queries, 1]),
    )
}

/// The gradients of the query, key and value of [`tiled_forward`] from its `output`,
/// `lse` and the output's gradient `grad` (those `qkv` does not ask for are not computed:
/// zeros); the bias's (in its own shape, summed over the axes it broadcasts along) and the
/// table's when asked for.
#[allow(clippy::too_many_arguments)]
pub(crate) fn tiled_backward<B: CpuTensors>(
    dims: Dims,
    scoring: &Scoring,
    [query, key, value]: [&FloatTensor<B>; 3],
    [output, lse, grad]: [&FloatTensor<B>; 3],
    blocked: Option<&BoolTensor<B>>,
    [bias, table]: [Option<&FloatTensor<B>>; 2],
    qkv: [bool; 3],
    [bias_grad, table_grad]: [bool; 2],
) -> Grads<B> {
    let mask = Mask::<B>::new(blocked, bias, table);
    let [q, o, g, lse] = [query, output, grad, lse].map(B::readable);
    let [k, v] = [key, value].map(key_panel::<B>);
    let lse = B::floats(&lse);
    let lse: Vec<f32> = (0..dims.batch * dims.heads * dims.queries)
        .map(|at| {
            lse.at(
                at / (dims.heads * dims.queries),
                at / dims.queries % dims.heads,
                at % dims.queries,
                0,
            )
        })
        .collect();
    let bias_shape = mask.bias.as_ref().filter(|_| bias_grad).map(|b| {
        let shape = b.shape();
        std::array::from_fn(|axis| shape[axis])
    });
    let table_shape = mask.table.as_ref().filter(|_| table_grad).map(|t| {
        let shape = t.shape();
        std::array::from_fn(|axis| shape[axis])
    });
    let inputs = [&q, &k, &v, &o, &g].map(B::floats);
    let wanted = [bias_shape, table_shape];
    let grads = backward(dims, inputs, &lse, mask.extra(scoring), qkv, wanted);
    let d = dims;
    Grads {
        dq: from_heads::<B>(grads.dq, [d.batch, d.heads, d.queries, d.d_k]),
        dk: from_heads::<B>(grads.dk, [d.batch, d.kv_heads, d.keys, d.d_k]),
        dv: from_heads::<B>(grads.dv, [d.batch, d.kv_heads, d.keys, d.d_v]),
        bias: grads
            .bias
            .zip(bias_shape)
            .map(|(values, shape)| B::from_rows(values, shape)),
        table: grads
            .table
            .zip(table_shape)
            .map(|(values, shape)| B::from_rows(values, shape)),
    }
}

/// The key or value tensor as the tiles read it: rows next to each other
/// ([`CpuTensors::dense_rows`]) when a head has more keys than one tile, else where they
/// lie: a tile's worth of rows a few hundred bytes apart still fits the L1 cache's sets,
/// and the copy (of every head, at every call) would cost more than it saves.
fn key_panel<B: CpuTensors>(tensor: &FloatTensor<B>) -> FloatTensor<B> {
    match tensor.shape()[2] > KT {
        true => B::dense_rows(tensor),
        false => B::readable(tensor),
    }
}

/// The `[B, H, T, D]` tensor that `[B, T, H, D]` floats hold (a view, no copy).
fn from_heads<B: CpuTensors>(values: Vec<f32>, [b, h, t, d]: [usize; 4]) -> FloatTensor<B> {
    B::float_swap_dims(B::from_rows(values, [b, t, h, d]), 1, 2)
}

/// The mask's parts, readable by the tiles.
struct Mask<B: CpuTensors> {
    blocked: Option<BoolTensor<B>>,
    bias: Option<FloatTensor<B>>,
    /// A learned position table, `[1, 1, H, buckets]`.
    table: Option<FloatTensor<B>>,
}

impl<B: CpuTensors> Mask<B> {
    fn new(
        blocked: Option<&BoolTensor<B>>,
        bias: Option<&FloatTensor<B>>,
        table: Option<&FloatTensor<B>>,
    ) -> Self {
        Self {
            blocked: blocked.map(B::readable_mask),
            bias: bias.map(B::readable),
            table: table.map(B::readable),
        }
    }

    fn extra<'a>(&'a self, scoring: &'a Scoring) -> Extra<'a> {
        Extra {
            scoring,
            bias: self.bias.as_ref().map(B::floats),
            blocked: self.blocked.as_ref().map(B::bytes),
            table: self.table.as_ref().map(B::floats),
        }
    }
}

/// What a tile reads to make its scores: the [`Scoring`], a bias and a boolean mask
/// (nonzero = blocked), each broadcastable to `[B, H, Tq, Tk]`, and the learned table of
/// a position bias (`[1, 1, H, buckets]`).
#[derive(Debug, Clone, Copy)]
struct Extra<'a> {
    scoring: &'a Scoring,
    bias: Option<Grid<'a, f32>>,
    blocked: Option<Grid<'a, u8>>,
    table: Option<Grid<'a, f32>>,
}

/// One tile of queries: head `(b, h)`, queries `q0..q0 + nq`.
#[derive(Debug, Clone, Copy)]
struct Tile {
    b: usize,
    h: usize,
    q0: usize,
    nq: usize,
}

/// Most blocks of rows a tile is cut into for [`Band`] (the smallest register tile has 6
/// rows).
const BLOCKS: usize = KT.div_ceil(6);

/// Columns (or depth) per vector: [`Band`]'s ranges are widened to multiples of it, so
/// that every element a product computes takes the same path through the matrix kernel
/// as in the whole tile, and the same value.
const VECTOR: usize = 8;

/// The rows of a product of a tile's, for [`Band::gemm`].
#[derive(Clone, Copy)]
enum TileRows {
    Keys,
    Queries,
}

/// What the visibility rule lets the products of a tile (keys `k0..k0 + nk` by queries
/// `q0..q0 + nq`) skip, by blocks of `rows` rows (the matrix kernel's register tile):
/// per block of keys, the query columns (from `q0`) its keys see between them; per block
/// of queries, the keys (from `k0`) they see between them. A causal tile on the diagonal
/// computes about half of its scores this way. Elsewhere every range is the whole tile.
///
/// Skipping a score the rule hides skips a weight that is exactly 0: a product over a
/// shortened depth adds the same terms but zeros, and gives the same bits.
struct Band {
    rows: usize,
    /// Per block of `rows` keys: `(first, end)` query columns.
    keys: [(usize, usize); BLOCKS],
    /// Per block of `rows` queries: `(first, end)` keys.
    queries: [(usize, usize); BLOCKS],
}

impl Band {
    fn new<A: Arch>(
        visibility: &Visibility,
        b: usize,
        [k0, nk]: [usize; 2],
        [q0, nq]: [usize; 2],
    ) -> Self {
        let rows = A::ROWS;
        let mut band = Self {
            rows,
            keys: [(0, nq); BLOCKS],
            queries: [(0, nk); BLOCKS],
        };
        if !visibility.blocks() {
            return band;
        }
        // `seen` (absolute) as a range from `start` cut to `len`, widened to vectors.
        let widen = |seen: Range<usize>, start: usize, len: usize| {
            let first = seen.start.saturating_sub(start).min(len);
            let end = seen.end.saturating_sub(start).clamp(first, len);
            match first < end {
                true => (
                    first / VECTOR * VECTOR,
                    end.next_multiple_of(VECTOR).min(len),
                ),
                false => (0, 0),
            }
        };
        for (block, cols) in band.keys.iter_mut().enumerate().take(nk.div_ceil(rows)) {
            let keys = k0 + block * rows..(k0 + (block + 1) * rows).min(k0 + nk);
            *cols = widen(visibility.queries_of_keys(b, keys), q0, nq);
        }
        for (block, depth) in band.queries.iter_mut().enumerate().take(nq.div_ceil(rows)) {
            let queries = q0 + block * rows..(q0 + (block + 1) * rows).min(q0 + nq);
            *depth = widen(visibility.keys_of_rows(b, queries), k0, nk);
        }
        band
    }

    /// The query columns of key `j` (of the tile) that the products computed.
    #[inline(always)]
    fn columns_of_key(&self, j: usize) -> Range<usize> {
        let (first, end) = self.keys[j / self.rows];
        first..end
    }

    /// Zeroes the first `nq` columns of key `j`'s row `row` outside those the products
    /// computed, and returns those (a weight or gradient there is 0).
    #[inline(always)]
    fn zero_outside(&self, j: usize, row: &mut [f32], nq: usize) -> Range<usize> {
        let cols = self.columns_of_key(j);
        row[..cols.start].fill(0.0);
        row[cols.end..nq].fill(0.0);
        cols
    }

    /// `C (+)= A B` for the `m` rows of a tile, the keys or the queries (`rows`), block
    /// by block: each block of keys over its query columns only (`n` of B and C; the rest
    /// of those rows is left as it was), or with `depth` over its queries as the depth
    /// `k` of A and B; each block of queries over its keys as the depth (`depth` must be
    /// set). Blocks with one range run as one product.
    ///
    /// # Safety
    /// As [`Arch::gemm`] for the whole `[m, n, k]`.
    #[allow(clippy::too_many_arguments)]
    #[inline(always)]
    unsafe fn gemm<A: Arch>(
        &self,
        rows: TileRows,
        depth: bool,
        [m, n, k]: [usize; 3],
        (a, rsa, csa): (*const f32, usize, usize),
        (b, ldb): (*const f32, usize),
        (c, ldc): (*mut f32, usize),
        add: bool,
    ) {
        let ranges = match rows {
            TileRows::Keys => &self.keys,
            TileRows::Queries => &self.queries,
        };
        debug_assert!(
            depth || matches!(rows, TileRows::Keys),
            "queries' blocks cut the depth"
        );
        debug_assert!(add || !depth, "a product over part of its depth adds to C");
        let blocks = m.div_ceil(self.rows);
        let mut block = 0;
        while block < blocks {
            let (first, end) = ranges[block];
            let mut last = block + 1;
            while last < blocks && ranges[last] == (first, end) {
                last += 1;
            }
            let (r0, r1) = (block * self.rows, (last * self.rows).min(m));
            if first < end {
                // SAFETY: rows r0..r1 of C and A, and columns (or depth) first..end, are
                // within the caller's whole product.
                unsafe {
                    let a = a.add(r0 * rsa);
                    let c = c.add(r0 * ldc);
                    match depth {
                        true => A::gemm(
                            [r1 - r0, n, end - first],
                            (a.add(first * csa), rsa, csa),
                            (b.add(first * ldb), ldb),
                            (c, ldc),
                            add,
                        ),
                        false => A::gemm(
                            [r1 - r0, end - first, k],
                            (a, rsa, csa),
                            (b.add(first), ldb),
                            (c.add(first), ldc),
                            add,
                        ),
                    }
                }
            }
            block = last;
        }
    }
}

/// Soft-caps the scores tile `s` (`[nk, nq]`, rows `QT` apart): `cap · tanh(s / cap)`;
/// `slope`, when given, receives the derivative `1 - tanh²` of each score.
#[inline(always)]
fn soft_cap<A: Arch>(cap: f32, [nk, nq]: [usize; 2], s: &mut [f32], slope: Option<&mut [f32]>) {
    let inv = 1.0 / cap;
    for row in s.chunks_exact_mut(QT).take(nk) {
        for x in &mut row[..nq] {
            *x = cap * A::tanh(*x * inv);
        }
    }
    if let Some(slope) = slope {
        for (d, row) in slope.chunks_exact_mut(QT).zip(s.chunks_exact(QT)).take(nk) {
            for (d, &x) in d[..nq].iter_mut().zip(row) {
                let t = x * inv;
                *d = 1.0 - t * t;
            }
        }
    }
}

/// Adds the bias (clamped at [`BLOCKED`]) and blocks what the boolean mask and the
/// visibility rule block in the scores tile `s` (`[nk, nq]`, rows `QT` apart) of keys
/// `k0..k0 + nk`.
#[inline(always)]
fn mask_tile(extra: &Extra, tile: Tile, k0: usize, nk: usize, s: &mut [f32]) {
    let Tile { b, h, q0, nq } = tile;
    match &extra.scoring.position {
        Some(Positional::Alibi { slopes, offset }) => {
            let slope = slopes[h];
            for (j, row) in s.chunks_exact_mut(QT).take(nk).enumerate() {
                let d0 = (k0 + j) as i64 - (q0 as i64 + offset);
                for (i, x) in row[..nq].iter_mut().enumerate() {
                    *x -= slope * (d0 - i as i64).abs() as f32;
                }
            }
        }
        Some(Positional::Learned {
            first,
            bucket,
            offset,
            ..
        }) => {
            let table = extra
                .table
                .as_ref()
                .expect("a learned position bias has its table");
            for (j, row) in s.chunks_exact_mut(QT).take(nk).enumerate() {
                let d0 = (k0 + j) as i64 - (q0 as i64 + offset) - first;
                for (i, x) in row[..nq].iter_mut().enumerate() {
                    let column = bucket[(d0 - i as i64) as usize] as usize;
                    *x += table.at(0, 0, h, column);
                }
            }
        }
        None => {}
    }
    if let Some(bias) = &extra.bias {
        for (j, row) in s.chunks_exact_mut(QT).take(nk).enumerate() {
            for (i, x) in row[..nq].iter_mut().enumerate() {
                let add = bias.at(b, h, q0 + i, k0 + j);
                *x += if add < BLOCKED { BLOCKED } else { add };
            }
        }
    }
    if let Some(blocked) = &extra.blocked {
        for (j, row) in s.chunks_exact_mut(QT).take(nk).enumerate() {
            for (i, x) in row[..nq].iter_mut().enumerate() {
                if blocked.at(b, h, q0 + i, k0 + j) != 0 {
                    *x = BLOCKED;
                }
            }
        }
    }
    let visibility = &extra.scoring.visibility;
    if visibility.blocks() {
        for (j, row) in s.chunks_exact_mut(QT).take(nk).enumerate() {
            let seen = visibility.queries_of(b, k0 + j);
            let first = seen.start.saturating_sub(q0).min(nq);
            let end = seen.end.saturating_sub(q0).clamp(first, nq);
            row[..first].fill(f32::NEG_INFINITY);
            row[end..nq].fill(f32::NEG_INFINITY);
        }
    }
}

/// The gradients of [`backward`]: `dq` `[B, Tq, H, Dk]`, `dk` `[B, Tk, Hkv, Dk]`, `dv`
/// `[B, Tk, Hkv, Dv]`, and the bias's and the position table's (row-major, in their own
/// shapes) when asked for.
struct Gradients {
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    bias: Option<Vec<f32>>,
    table: Option<Vec<f32>>,
}
