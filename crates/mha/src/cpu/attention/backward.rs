//! The backward pass in tiles. Each task is one key/value head's range of keys (the whole
//! head when there are enough heads for the threads). It owns that range's `dK` and `dV`,
//! and walks the query heads of its group (grouped-query attention: keys and values are
//! never copied per query head) and their query tiles that see it, recomputing the weights
//! from each query's log-sum-exp:
//!
//! ```text
//! Pᵀ  = exp(Sᵀ - lse)           dV += Pᵀ dO
//! dPᵀ = V dOᵀ                   dSᵀ = Pᵀ ⊙ (dPᵀ - rowsum(dO ⊙ O))
//! dK += dSᵀ (Q·scale)           dQ += dS K        (dQ · scale at the end)
//! ```
//!
//! A key range's `dQ` is a partial sum; the ranges of one head are added at the end (with
//! one range per head, a task writes its heads' `dQ` in place).

use std::ops::Range;

use rayon::prelude::*;

use super::{
    Band, Dims, Extra, Gradients, Grid, KT, Positional, QT, Tile, TileRows, mask_tile, soft_cap,
};
use crate::cpu::Out;
use crate::cpu::blocks::{map_blocks_on, threads_for};
use crate::cpu::isa::{Arch, Isa, Kernel};
use crate::cpu::math::dot_product;
use crate::mask::Visibility;

/// Backward pass: the gradients of the inputs `[q, k, v, output, grad]` of [`forward`](super::forward)
/// (`grad`: the output's gradient, `[B, H, Tq, Dv]`) from the log-sum-exp `[B, H, Tq]`
/// it returned, and the bias's and the position table's when `wanted` gives their shapes.
/// The products of a gradient of the query, key or value that `qkv` does not ask for are
/// skipped (its rows come back zeros).
pub(super) fn backward(
    dims: Dims,
    inputs: [Grid<f32>; 5],
    lse: &[f32],
    extra: Extra,
    qkv: [bool; 3],
    wanted: [Option<[usize; 4]>; 2],
) -> Gradients {
    // Cut for the pool's threads whether the call runs on them or, small and outside the
    // pool, on this one: the key ranges, and with them the order dQ's parts are summed in,
    // and so its numbers, are the same inside and outside `on_cpu_workers`.
    let threads = rayon::current_num_threads();
    backward_on(Isa::best(), threads, dims, inputs, lse, extra, qkv, wanted)
}

/// [`backward`] with the given instruction set, its heads cut for `threads` threads (and
/// run on at most as many); `[q, k, v, output, grad]`; `qkv`: the gradients of the
/// query, key and value wanted; `wanted`: the bias's and the table's shapes, when their
/// gradients are wanted.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward_on(
    isa: Isa,
    threads: usize,
    dims: Dims,
    [q, k, v, output, grad]: [Grid<f32>; 5],
    lse: &[f32],
    extra: Extra,
    qkv: [bool; 3],
    [bias_grad, table_grad]: [Option<[usize; 4]>; 2],
) -> Gradients {
    let Dims {
        batch,
        heads,
        kv_heads,
        queries,
        keys,
        d_k,
        d_v,
        ..
    } = dims;
    let group = dims.group();
    // Every query head in a group, or rows of dQ below would be left unwritten.
    assert_eq!(
        heads,
        kv_heads * group,
        "{heads} query heads over {kv_heads} key/value heads"
    );
    let scale = extra.scoring.scale;
    // Not zeroed (a pass over each on this thread while the others wait): the tasks
    // below write every row of dK and dV (each key of each key/value head belongs to one
    // task), and every row of dQ, themselves or summed from their parts after them. Their
    // lengths are set once they are written.
    let lens = [
        batch * queries * heads * d_k,
        batch * keys * kv_heads * d_k,
        batch * keys * kv_heads * d_v,
    ];
    assert!(
        keys > 0 || lens[0] == 0,
        "attention's backward pass over no key (the dispatcher gives it its empty result)"
    );
    let [mut dq, mut dk, mut dv] = lens.map(Vec::<f32>::with_capacity);
    let ranges = key_ranges(dims, &extra.scoring.visibility, threads);
    let run_on = threads.min(threads_for(dims.multiply_adds().saturating_mul(2)));
    let split = ranges.len();
    let dq_out = Out::new(dq.as_mut_ptr());
    let dk_out = Out::new(dk.as_mut_ptr());
    let dv_out = Out::new(dv.as_mut_ptr());
    // Each task: a key range of one key/value head, through every query head of its
    // group; it returns those query heads' partial dQ, one after the other (or, when the
    // range is every key, writes their dQ in place and returns nothing).
    let columns = table_grad.map_or(0, |[_, _, _, c]| c);
    let partials: Vec<(Vec<f32>, Option<BiasPart>, Vec<f64>)> =
        map_blocks_on(run_on, batch * kv_heads * split, |task| {
            let (bkv, range) = (task / split, ranges[task % split].clone());
            let (b, kvh) = (bkv / kv_heads, bkv % kv_heads);
            let mut kv = KeyGrads {
                dk: vec![0.0; range.len() * d_k],
                dv: vec![0.0; range.len() * d_v],
                bias: bias_grad.map(|shape| BiasPart::new(shape, group, &range)),
                table: vec![0.0; group * columns],
            };
            let mut dq = vec![0.0f32; group * queries * d_k];
            for (g, dq) in dq.chunks_mut(queries * d_k).enumerate() {
                let h = kvh * group + g;
                let bh = b * heads + h;
                let lse = &lse[bh * queries..(bh + 1) * queries];
                let head = Head::new(dims, scale, b, h, &q, &output, &grad, lse);
                isa.run(HeadBackward {
                    head: &head,
                    dims,
                    kv_in: [&k, &v],
                    extra: &extra,
                    range: range.clone(),
                    kv: &mut kv,
                    dq,
                    qkv,
                });
            }
            for (j, key) in range.enumerate() {
                let at = (b * keys + key) * kv_heads + kvh;
                // SAFETY: key `key` of head `(b, kvh)` belongs to this task alone.
                unsafe {
                    let dk_row = kv.dk[j * d_k..].as_ptr();
                    std::ptr::copy_nonoverlapping(dk_row, dk_out.at(at * d_k), d_k);
                    let dv_row = kv.dv[j * d_v..].as_ptr();
                    std::ptr::copy_nonoverlapping(dv_row, dv_out.at(at * d_v), d_v);
                }
            }
            if split > 1 {
                return (dq, kv.bias, kv.table);
            }
            for (g, head) in dq.chunks_exact(queries * d_k).enumerate() {
                let h = kvh * group + g;
                for (i, row) in head.chunks_exact(d_k).enumerate() {
                    let at = ((b * queries + i) * heads + h) * d_k;
                    for (j, &x) in row.iter().enumerate() {
                        // SAFETY: the task is head (b, h)'s only one: its dQ rows are its
                        // own, written (not read: not yet initialised) element by element.
                        unsafe { dq_out.at(at + j).write(x * scale) };
                    }
                }
            }
            (Vec::new(), kv.bias, kv.table)
        });
    // The table's gradient: every task's part added to its heads' rows.
    let table = table_grad.map(|_| {
        let mut total = vec![0.0f64; heads * columns];
        for (task, (_, _, part)) in partials.iter().enumerate() {
            let kvh = task / split % kv_heads;
            let rows = &mut total[kvh * group * columns..(kvh + 1) * group * columns];
            rows.iter_mut().zip(part).for_each(|(t, p)| *t += p);
        }
        total.into_iter().map(|x| x as f32).collect()
    });
    // The bias's gradient: every task's part added where it belongs.
    let bias = bias_grad.map(|shape| {
        let mut total = vec![0.0f32; shape.iter().product()];
        for (task, (_, part, _)) in partials.iter().enumerate() {
            let (bkv, range) = (task / split, &ranges[task % split]);
            if let Some(part) = part {
                part.add_to(
                    &mut total,
                    shape,
                    [bkv / kv_heads, bkv % kv_heads],
                    group,
                    range,
                );
            }
        }
        total
    });
    // SAFETY: every task has returned, having written its keys' rows of dK and dV (the
    // ranges cover every key of every key/value head).
    unsafe {
        dk.set_len(lens[1]);
        dv.set_len(lens[2]);
    }
    if split == 1 {
        // SAFETY: each task wrote every row of its query heads' dQ.
        unsafe { dq.set_len(lens[0]) };
        return Gradients {
            dq,
            dk,
            dv,
            bias,
            table,
        };
    }
    // dQ of head (b, h): the sum of its key ranges' partial sums, times the scale (on this
    // thread where the call is small: a hand-over to the pool would cost more).
    let sum_row = |(row, dq_row): (usize, &mut [std::mem::MaybeUninit<f32>])| {
        let (b, i) = (row / queries, row % queries);
        for (h, dq_head) in dq_row.chunks_mut(d_k).enumerate() {
            let bkv = b * kv_heads + h / group;
            let at = ((h % group) * queries + i) * d_k;
            for (j, d) in dq_head.iter_mut().enumerate() {
                let parts = &partials[bkv * split..(bkv + 1) * split];
                let sum = parts
                    .iter()
                    .fold(0.0f32, |sum, (part, _, _)| sum + part[at + j]);
                d.write(sum * scale);
            }
        }
    };
    let rows = &mut dq.spare_capacity_mut()[..lens[0]];
    match run_on {
        1 => rows.chunks_mut(heads * d_k).enumerate().for_each(sum_row),
        _ => rows
            .par_chunks_mut(heads * d_k)
            .enumerate()
            .for_each(sum_row),
    }
    // SAFETY: the loop above wrote every element of every row.
    unsafe { dq.set_len(lens[0]) };
    Gradients {
        dq,
        dk,
        dv,
        bias,
        table,
    }
}

/// One backward task's share of the bias's gradient: `dS` summed over what the bias
/// broadcasts along, over the slice of the bias the task reaches, `[heads, queries,
/// keys]` with each axis the group's heads, the queries and the task's keys where the
/// bias has that axis, else 1.
struct BiasPart {
    data: Vec<f32>,
    /// The bias has a head, query, key axis (else it broadcasts along it).
    axes: [bool; 3],
    /// The part's sizes.
    sizes: [usize; 3],
    /// The task's first key.
    k_start: usize,
}

impl BiasPart {
    fn new([_, h, q, k]: [usize; 4], group: usize, range: &Range<usize>) -> Self {
        let axes = [h > 1, q > 1, k > 1];
        let sizes = [
            if axes[0] { group } else { 1 },
            if axes[1] { q } else { 1 },
            if axes[2] { range.len() } else { 1 },
        ];
        Self {
            data: vec![0.0; sizes.iter().product()],
            axes,
            sizes,
            k_start: range.start,
        }
    }

    /// Adds the `dSᵀ` tile `ds` (`[nk, nq]`, rows `QT` apart) of the group's head `g`,
    /// queries `q0..q0 + nq`, keys `k0..k0 + nk`.
    fn add(&mut self, g: usize, [q0, nq]: [usize; 2], [k0, nk]: [usize; 2], ds: &[f32]) {
        let [per_head, per_query, per_key] = self.axes;
        let [_, queries, keys] = self.sizes;
        let head = if per_head { g } else { 0 };
        for (j, row) in ds.chunks_exact(QT).take(nk).enumerate() {
            let key = if per_key { k0 + j - self.k_start } else { 0 };
            for (i, &d) in row[..nq].iter().enumerate() {
                let query = if per_query { q0 + i } else { 0 };
                self.data[(head * queries + query) * keys + key] += d;
            }
        }
    }

    /// Adds the part of task `[b, kv head]` over keys `range` to the bias's gradient
    /// `total` (of shape `shape`).
    fn add_to(
        &self,
        total: &mut [f32],
        shape: [usize; 4],
        [b, kvh]: [usize; 2],
        group: usize,
        range: &Range<usize>,
    ) {
        let [sb, sh, sq, sk] = shape;
        let b = if sb > 1 { b } else { 0 };
        let [heads, queries, keys] = self.sizes;
        for g in 0..heads {
            let h = if sh > 1 { kvh * group + g } else { 0 };
            for q in 0..queries {
                let from = (g * queries + q) * keys;
                let key = if sk > 1 { range.start } else { 0 };
                let to = ((b * sh + h) * sq + q) * sk + key;
                for (t, &p) in total[to..to + keys]
                    .iter_mut()
                    .zip(&self.data[from..from + keys])
                {
                    *t += p;
                }
            }
        }
    }
}

/// The key ranges each key/value head's backward pass is cut into: one range when there
/// are at least two such heads per thread, else enough ranges of about equal work (a causal
/// key is seen by fewer queries the later it comes) for two tasks per thread, reckoned on
/// batch row 0.
fn key_ranges(dims: Dims, visibility: &Visibility, threads: usize) -> Vec<Range<usize>> {
    let heads = dims.batch * dims.kv_heads;
    let tiles = dims.keys.div_ceil(KT);
    let split = (2 * threads).div_ceil(heads.max(1)).clamp(1, tiles.max(1));
    if split == 1 {
        return std::iter::once(0..dims.keys).collect();
    }
    let work = |tile: usize| {
        let keys = tile * KT..((tile + 1) * KT).min(dims.keys);
        visibility.queries_of_keys(0, keys).len() + 1
    };
    let total: usize = (0..tiles).map(work).sum();
    let mut ranges = Vec::with_capacity(split);
    let (mut start, mut done) = (0, 0);
    for tile in 0..tiles {
        done += work(tile);
        let end = ((tile + 1) * KT).min(dims.keys);
        if done * split >= total * (ranges.len() + 1) || tile + 1 == tiles {
            ranges.push(start..end);
            start = end;
        }
    }
    ranges
}

/// A backward task's inputs of one head, packed: the scaled queries (both ways), the
/// output's gradient (both ways), `rowsum(dO ⊙ O)` and the log-sum-exps.
struct Head<'a> {
    b: usize,
    h: usize,
    /// `[Tq, Dk]`.
    qs: Vec<f32>,
    /// Per tile of `QT` queries, `[Dk, QT]` (a row stride of `Tq` would be a power of
    /// two at common lengths, which puts a panel's rows in one set of the L1 cache).
    qst: Vec<f32>,
    /// `[Tq, Dv]`.
    go: Vec<f32>,
    /// Per tile of `QT` queries, `[Dv, QT]`.
    dot: Vec<f32>,
    /// `rowsum(dO ⊙ O)`, `[Tq]`.
    row_dot: Vec<f32>,
    lse: &'a [f32],
}

/// The gradients of a key range of one key/value head, summed over the query heads of
/// its group: `[len, Dk]` and `[len, Dv]`, and the bias's part when it is wanted.
struct KeyGrads {
    dk: Vec<f32>,
    dv: Vec<f32>,
    bias: Option<BiasPart>,
    /// The position table's part, `[group, columns]` (empty when not wanted), summed in
    /// f64: a bucket gathers up to `Tq · Tk` scores of each head.
    table: Vec<f64>,
}

impl<'a> Head<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        dims: Dims,
        scale: f32,
        b: usize,
        h: usize,
        q: &Grid<f32>,
        output: &Grid<f32>,
        grad: &Grid<f32>,
        lse: &'a [f32],
    ) -> Self {
        let Dims {
            queries, d_k, d_v, ..
        } = dims;
        let padded = queries.div_ceil(QT) * QT;
        // Column i of the per-tile panels of d rows.
        let panel = |i: usize, d: usize| (i / QT) * d * QT + i % QT;
        let mut qs = vec![0.0f32; queries * d_k];
        let mut qst = vec![0.0f32; d_k * padded];
        for (i, row) in qs.chunks_exact_mut(d_k).enumerate() {
            for (x, &y) in row.iter_mut().zip(q.row(b, h, i, d_k)) {
                *x = y * scale;
            }
            for (t, &x) in qst[panel(i, d_k)..].iter_mut().step_by(QT).zip(&*row) {
                *t = x;
            }
        }
        let mut go = vec![0.0f32; queries * d_v];
        let mut dot = vec![0.0f32; d_v * padded];
        let mut row_dot = vec![0.0f32; queries];
        for (i, row) in go.chunks_exact_mut(d_v).enumerate() {
            row.copy_from_slice(grad.row(b, h, i, d_v));
            for (t, &x) in dot[panel(i, d_v)..].iter_mut().step_by(QT).zip(&*row) {
                *t = x;
            }
            row_dot[i] = dot_product(row, output.row(b, h, i, d_v));
        }
        Self {
            b,
            h,
            qs,
            qst,
            go,
            dot,
            row_dot,
            lse,
        }
    }

    /// Adds this query head's share of the gradients of the keys in `range` to `kv`, and
    /// its partial `dQ` over them (unscaled, `[Tq, Dk]`) to `dq`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn backward_in<A: Arch>(
        &self,
        dims: Dims,
        [k, v]: [&Grid<f32>; 2],
        extra: &Extra,
        range: Range<usize>,
        kv: &mut KeyGrads,
        dq: &mut [f32],
        [want_q, want_k, want_v]: [bool; 3],
    ) {
        let Dims {
            queries, d_k, d_v, ..
        } = dims;
        let (b, h) = (self.b, self.h);
        let kvh = h / dims.group();
        assert!(dq.len() >= queries * d_k, "dQ holds every query");
        let mut p = vec![0.0f32; KT * QT];
        let mut ds = vec![0.0f32; KT * QT];
        let mut slope = match extra.scoring.softcap {
            Some(_) => vec![0.0f32; KT * QT],
            None => Vec::new(),
        };
        for k0 in range.clone().step_by(KT) {
            let nk = KT.min(range.end - k0);
            let (kp, ks) = k.rows(b, kvh, k0, [nk, d_k]);
            let (vp, vs) = v.rows(b, kvh, k0, [nk, d_v]);
            let j0 = k0 - range.start;
            // The queries that see these keys; tiles outside are never visited.
            let seen = extra.scoring.visibility.queries_of_keys(b, k0..k0 + nk);
            for q0 in (seen.start / QT * QT..seen.end).step_by(QT) {
                let nq = QT.min(queries - q0);
                let tile = Tile { b, h, q0, nq };
                let band = Band::new::<A>(&extra.scoring.visibility, b, [k0, nk], [q0, nq]);
                // SAFETY (every product below): K and V rows k0..k0+nk, the packed
                // queries and gradient columns q0..q0+nq, dO rows q0..q0+nq, tiles of
                // KT x QT, and the gradients' rows of this range.
                unsafe {
                    // Sᵀ = K (Q·scale)ᵀ, masked; Pᵀ = exp(Sᵀ - lse).
                    band.gemm::<A>(
                        TileRows::Keys,
                        false,
                        [nk, nq, d_k],
                        (kp, ks, 1),
                        (self.qst.as_ptr().add(q0 * d_k), QT),
                        (p.as_mut_ptr(), QT),
                        false,
                    );
                    if let Some(cap) = extra.scoring.softcap {
                        soft_cap::<A>(cap, [nk, nq], &mut p, Some(&mut slope));
                    }
                    // Every score outside a key's columns is blocked here (`-inf`).
                    mask_tile(extra, tile, k0, nk, &mut p);
                    let lse = &self.lse[q0..q0 + nq];
                    for (j, row) in p.chunks_exact_mut(QT).take(nk).enumerate() {
                        let cols = band.zero_outside(j, row, nq);
                        for (x, &l) in row[cols.clone()].iter_mut().zip(&lse[cols]) {
                            *x = A::exp(*x - l);
                        }
                    }
                    // dV += Pᵀ dO
                    if want_v {
                        band.gemm::<A>(
                            TileRows::Keys,
                            true,
                            [nk, d_v, nq],
                            (p.as_ptr(), QT, 1),
                            (self.go.as_ptr().add(q0 * d_v), d_v),
                            (kv.dv.as_mut_ptr().add(j0 * d_v), d_v),
                            true,
                        );
                    }
                    if !(want_q || want_k || kv.bias.is_some() || !kv.table.is_empty()) {
                        continue; // dS feeds nothing wanted.
                    }
                    // dPᵀ = V dOᵀ; dSᵀ = Pᵀ ⊙ (dPᵀ - rowsum(dO ⊙ O))
                    band.gemm::<A>(
                        TileRows::Keys,
                        false,
                        [nk, nq, d_v],
                        (vp, vs, 1),
                        (self.dot.as_ptr().add(q0 * d_v), QT),
                        (ds.as_mut_ptr(), QT),
                        false,
                    );
                    let row_dot = &self.row_dot[q0..q0 + nq];
                    for (j, (ds_row, p_row)) in ds
                        .chunks_exact_mut(QT)
                        .zip(p.chunks_exact(QT))
                        .take(nk)
                        .enumerate()
                    {
                        let cols = band.zero_outside(j, ds_row, nq);
                        let weights = p_row[cols.clone()].iter().zip(&row_dot[cols.clone()]);
                        for (d, (&w, &r)) in ds_row[cols].iter_mut().zip(weights) {
                            *d = w * (*d - r);
                        }
                    }
                    if let Some(part) = kv.bias.as_mut() {
                        part.add(h % dims.group(), [q0, nq], [k0, nk], &ds);
                    }
                    if let (
                        false,
                        Some(Positional::Learned {
                            columns,
                            first,
                            bucket,
                            offset,
                        }),
                    ) = (kv.table.is_empty(), &extra.scoring.position)
                    {
                        let g = h % dims.group();
                        let row = &mut kv.table[g * columns..(g + 1) * columns];
                        for (j, d) in ds.chunks_exact(QT).take(nk).enumerate() {
                            let d0 = (k0 + j) as i64 - (q0 as i64 + offset) - first;
                            for (i, &x) in d[..nq].iter().enumerate() {
                                row[bucket[(d0 - i as i64) as usize] as usize] += x as f64;
                            }
                        }
                    }
                    // Through the soft cap: dS_raw = dS ⊙ (1 - tanh²).
                    if extra.scoring.softcap.is_some() {
                        for (d, f) in ds.chunks_exact_mut(QT).zip(slope.chunks_exact(QT)).take(nk) {
                            for (d, &f) in d[..nq].iter_mut().zip(f) {
                                *d *= f;
                            }
                        }
                    }
                    // dK += dSᵀ (Q·scale)
                    if want_k {
                        band.gemm::<A>(
                            TileRows::Keys,
                            true,
                            [nk, d_k, nq],
                            (ds.as_ptr(), QT, 1),
                            (self.qs.as_ptr().add(q0 * d_k), d_k),
                            (kv.dk.as_mut_ptr().add(j0 * d_k), d_k),
                            true,
                        );
                    }
                    // dQ += dS K
                    if want_q {
                        band.gemm::<A>(
                            TileRows::Queries,
                            true,
                            [nq, d_k, nk],
                            (ds.as_ptr(), 1, QT),
                            (kp, ks),
                            (dq.as_mut_ptr().add(q0 * d_k), d_k),
                            true,
                        );
                    }
                }
            }
        }
    }
}

/// One query head's share of a backward task, run through [`Isa::run`].
struct HeadBackward<'a> {
    head: &'a Head<'a>,
    dims: Dims,
    kv_in: [&'a Grid<'a, f32>; 2],
    extra: &'a Extra<'a>,
    range: Range<usize>,
    kv: &'a mut KeyGrads,
    dq: &'a mut [f32],
    /// The gradients of the query, key and value wanted.
    qkv: [bool; 3],
}

impl Kernel for HeadBackward<'_> {
    type Output = ();

    #[inline(always)]
    fn run<A: Arch>(self) {
        let Self {
            head,
            dims,
            kv_in,
            extra,
            range,
            kv,
            dq,
            qkv,
        } = self;
        head.backward_in::<A>(dims, kv_in, extra, range, kv, dq, qkv);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_key_ranges_cover_every_key_once_with_even_work() {
        let dims = Dims {
            batch: 1,
            heads: 2,
            kv_heads: 2,
            queries: 1000,
            keys: 1000,
            d_k: 8,
            d_v: 8,
        };
        let causal = crate::mask::AttentionMask::causal().visibility(1000, 1000);
        let ranges = key_ranges(dims, &causal, 8);
        assert_eq!(ranges.len(), 8);
        assert_eq!(ranges[0].start, 0);
        assert_eq!(ranges.last().map(|r| r.end), Some(1000));
        for pair in ranges.windows(2) {
            assert_eq!(pair[0].end, pair[1].start);
        }
        // Early keys are seen by more queries: the first range is the shortest.
        assert!(ranges[0].len() < ranges[7].len(), "{ranges:?}");
        let one = key_ranges(
            Dims {
                heads: 16,
                kv_heads: 16,
                ..dims
            },
            &causal,
            8,
        );
        assert_eq!((one.len(), one[0].clone()), (1, 0..1000));
    }
}
