//! The forward pass in tiles: each task is one head's block of [`QT`] queries, which walks
//! the key tiles it can see with a running maximum and sum per query (online softmax),
//! then writes its output rows and their log-sum-exps.

use super::{Band, Dims, Extra, Grid, KT, QT, Tile, TileRows, mask_tile, soft_cap};
use crate::cpu::Out;
use crate::cpu::blocks::{for_each_block_on, threads_for};
use crate::cpu::isa::{Arch, Isa, Kernel};
use crate::mask::{DEAD_LSE, DEAD_ROW};

/// Forward pass: `(output, lse)`, the output laid out `[B, Tq, H, Dv]` and the
/// log-sum-exp `[B, H, Tq]`. Query `[B, H, Tq, Dk]`, key `[B, Hkv, Tk, Dk]`, value
/// `[B, Hkv, Tk, Dv]`, each with unit stride along its last axis; query head `h` reads
/// key/value head `h / (H / Hkv)`.
pub(super) fn forward(
    dims: Dims,
    q: Grid<f32>,
    k: Grid<f32>,
    v: Grid<f32>,
    extra: Extra,
) -> (Vec<f32>, Vec<f32>) {
    forward_on(Isa::best(), dims, q, k, v, extra)
}

pub(super) fn forward_on(
    isa: Isa,
    dims: Dims,
    q: Grid<f32>,
    k: Grid<f32>,
    v: Grid<f32>,
    extra: Extra,
) -> (Vec<f32>, Vec<f32>) {
    let Dims {
        batch,
        heads,
        queries,
        d_v,
        ..
    } = dims;
    // Not zeroed: the tasks below write every row of both (each query of each head
    // belongs to one tile), through the pointers.
    let (output_len, lse_len) = (batch * queries * heads * d_v, batch * heads * queries);
    let mut output = Vec::<f32>::with_capacity(output_len);
    let mut lse = Vec::<f32>::with_capacity(lse_len);
    let tiles = queries.div_ceil(QT);
    let out = Out::new(output.as_mut_ptr());
    let lse_out = Out::new(lse.as_mut_ptr());
    let tasks = batch * heads * tiles;
    // A few blocks of tasks per thread, each with its buffers; one, on this thread, for
    // little work.
    let threads = threads_for(dims.multiply_adds());
    let blocks = tasks.min(4 * threads);
    for_each_block_on(threads, blocks, |block| {
        let scratch = &mut Scratch::new(dims);
        for task in tasks * block / blocks..tasks * (block + 1) / blocks {
            // The last tiles of a causal head see the most keys: they go first (in the
            // block's tasks).
            let (bh, tile) = (task / tiles, tiles - 1 - task % tiles);
            let (b, h) = (bh / heads, bh % heads);
            let q0 = tile * QT;
            let nq = QT.min(queries - q0);
            let tile = Tile { b, h, q0, nq };
            isa.run(TileForward {
                scratch: &mut *scratch,
                dims,
                qkv: [&q, &k, &v],
                extra: &extra,
                tile,
            });
            let (o, l) = (&scratch.acc, &scratch.lse);
            for i in 0..nq {
                let row = ((b * queries + q0 + i) * heads + h) * d_v;
                // SAFETY: row `q0 + i` of head `(b, h)` belongs to this task alone.
                unsafe {
                    std::ptr::copy_nonoverlapping(o[i * d_v..].as_ptr(), out.at(row), d_v);
                    *lse_out.at(bh * queries + q0 + i) = l[i];
                }
            }
        }
    });
    // SAFETY: the tasks wrote all `output_len` and `lse_len` elements (above); the
    // capacities are those.
    unsafe {
        output.set_len(output_len);
        lse.set_len(lse_len);
    }
    (output, lse)
}

/// A forward task's buffers, kept by a block of tasks from task to task.
struct Scratch {
    /// The tile's scaled queries, transposed: `[Dk, QT]`.
    qt: Vec<f32>,
    /// Scores, then weights: `[KT, QT]`.
    s: Vec<f32>,
    /// Unnormalised output: `[QT, Dv]`.
    acc: Vec<f32>,
    max: [f32; QT],
    sum: [f32; QT],
    lse: [f32; QT],
}

impl Scratch {
    fn new(dims: Dims) -> Self {
        Self {
            qt: vec![0.0; dims.d_k * QT],
            s: vec![0.0; KT * QT],
            acc: vec![0.0; QT * dims.d_v],
            max: [0.0; QT],
            sum: [0.0; QT],
            lse: [0.0; QT],
        }
    }

    /// Writes the unnormalised output rows `[nq, Dv]` of one tile of queries to `acc`
    /// and their log-sum-exps to `lse`.
    #[inline(always)]
    fn forward_in<A: Arch>(
        &mut self,
        dims: Dims,
        [q, k, v]: [&Grid<f32>; 3],
        extra: &Extra,
        tile: Tile,
    ) {
        let Tile { b, h, q0, nq } = tile;
        let (d_k, d_v) = (dims.d_k, dims.d_v);
        for i in 0..nq {
            let row = q.row(b, h, q0 + i, d_k);
            for (t, &x) in self.qt[i..].iter_mut().step_by(QT).zip(row) {
                *t = x * extra.scoring.scale;
            }
        }
        self.max[..nq].fill(f32::NEG_INFINITY);
        self.sum[..nq].fill(0.0);
        self.acc[..nq * d_v].fill(0.0);
        // The keys the tile's queries see between them; tiles outside are never visited.
        let seen = extra.scoring.visibility.keys_of_rows(b, q0..q0 + nq);
        for k0 in seen.clone().step_by(KT) {
            let nk = KT.min(seen.end - k0);
            let (kp, ks) = k.rows(b, h / dims.group(), k0, [nk, d_k]);
            let band = Band::new::<A>(&extra.scoring.visibility, b, [k0, nk], [q0, nq]);
            // SAFETY: rows k0..k0+nk of K (d_k columns); the packed queries; `s` holds
            // KT x QT.
            unsafe {
                band.gemm::<A>(
                    TileRows::Keys,
                    false,
                    [nk, nq, d_k],
                    (kp, ks, 1),
                    (self.qt.as_ptr(), QT),
                    (self.s.as_mut_ptr(), QT),
                    false,
                );
            }
            if let Some(cap) = extra.scoring.softcap {
                soft_cap::<A>(cap, [nk, nq], &mut self.s, None);
            }
            // Every score outside a key's columns is blocked here (`-inf`).
            mask_tile(extra, tile, k0, nk, &mut self.s);
            // Online softmax down the columns: the new maximum, the old sum and output
            // rescaled to it, the weights and their sum.
            let mut col_max = [f32::NEG_INFINITY; QT];
            for (j, row) in self.s.chunks_exact(QT).take(nk).enumerate() {
                let cols = band.columns_of_key(j);
                for (m, &x) in col_max[cols.clone()].iter_mut().zip(&row[cols]) {
                    *m = nan_max(*m, x);
                }
            }
            let mut shift = [0.0f32; QT];
            let mut alpha = [0.0f32; QT];
            for i in 0..nq {
                let max = nan_max(self.max[i], col_max[i]);
                shift[i] = if max == f32::NEG_INFINITY { 0.0 } else { max };
                alpha[i] = A::exp(self.max[i] - shift[i]);
                self.max[i] = max;
            }
            let mut col_sum = [0.0f32; QT];
            for (j, row) in self.s.chunks_exact_mut(QT).take(nk).enumerate() {
                let cols = band.zero_outside(j, row, nq);
                let sums = col_sum[cols.clone()].iter_mut().zip(&shift[cols.clone()]);
                for (x, (sum, &shift)) in row[cols].iter_mut().zip(sums) {
                    let p = A::exp(*x - shift);
                    *x = p;
                    *sum += p;
                }
            }
            for i in 0..nq {
                self.sum[i] = self.sum[i] * alpha[i] + col_sum[i];
                if alpha[i] != 1.0 {
                    let a = alpha[i];
                    self.acc[i * d_v..(i + 1) * d_v]
                        .iter_mut()
                        .for_each(|x| *x *= a);
                }
            }
            let (vp, vs) = v.rows(b, h / dims.group(), k0, [nk, d_v]);
            // SAFETY: P is the `[nk, nq]` tile in `s` (read transposed); rows k0..k0+nk
            // of V (d_v columns); `acc` holds QT x Dv.
            unsafe {
                band.gemm::<A>(
                    TileRows::Queries,
                    true,
                    [nq, d_v, nk],
                    (self.s.as_ptr(), 1, QT),
                    (vp, vs),
                    (self.acc.as_mut_ptr(), d_v),
                    true,
                );
            }
        }
        for i in 0..nq {
            let row = &mut self.acc[i * d_v..(i + 1) * d_v];
            if self.max[i] <= DEAD_ROW || self.sum[i] <= 0.0 {
                row.fill(0.0);
                self.lse[i] = DEAD_LSE;
            } else {
                let inv = 1.0 / self.sum[i];
                row.iter_mut().for_each(|x| *x *= inv);
                self.lse[i] = self.max[i] + self.sum[i].ln();
            }
        }
    }
}

/// The larger of `a` and `b`, NaN if either is (`f32::max` passes over a NaN): a NaN score
/// makes its row NaN, as the explicit path's and PyTorch's, not a row of no visible key.
#[inline]
fn nan_max(a: f32, b: f32) -> f32 {
    if a > b || a.is_nan() { a } else { b }
}

/// One tile of queries of the forward pass, run through [`Isa::run`].
struct TileForward<'a> {
    scratch: &'a mut Scratch,
    dims: Dims,
    qkv: [&'a Grid<'a, f32>; 3],
    extra: &'a Extra<'a>,
    tile: Tile,
}

impl Kernel for TileForward<'_> {
    type Output = ();

    #[inline(always)]
    fn run<A: Arch>(self) {
        let Self {
            scratch,
            dims,
            qkv,
            extra,
            tile,
        } = self;
        scratch.forward_in::<A>(dims, qkv, extra, tile);
    }
}
