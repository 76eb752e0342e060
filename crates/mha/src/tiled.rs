//! Attention on the CPU in cache-sized tiles, forward and backward, the way FlashAttention
//! does it on a GPU: the scores of a tile of 64 queries by 64 keys are computed, turned
//! into weights and multiplied into the output while they are still in the cache, and the
//! `[Tq, Tk]` scores are never written out. The two products of a tile run through a small
//! matrix kernel of our own (6 x 16 outputs in AVX2 registers, FMA), the softmax through
//! the vectorised `exp` of [`crate::rows`].
//!
//! The tiles are transposed, keys by queries (`Sᵀ = K · (Q·scale)ᵀ`): the key and value
//! rows are read as matrix panels where they lie, and only a tile of queries is packed.
//! The row-wise steps of the softmax then run down the columns, eight queries to a
//! vector. The kernels read slices through strides ([`Grid`]): flex's tensors and
//! ndarray's arrays in place, except that key, value and output-gradient rows a few KB
//! apart (the heads of a `[B, T, H·Dh]` projection) are first copied next to each other.
//!
//! Forward: each task is one head's block of 64 queries, with a running maximum and sum
//! per query (online softmax); it writes the output and each query's log-sum-exp.
//!
//! Backward: each task is one key/value head's range of keys (the whole head when there
//! are enough heads for the threads). It owns that range's `dK` and `dV`, and walks the
//! query heads of its group (grouped-query attention: keys and values are never copied
//! per query head) and their query tiles that see it:
//!
//! ```text
//! Pᵀ  = exp(Sᵀ - lse)           dV += Pᵀ dO
//! dPᵀ = V dOᵀ                   dSᵀ = Pᵀ ⊙ (dPᵀ - rowsum(dO ⊙ O))
//! dK += dSᵀ (Q·scale)           dQ += dS K        (dQ · scale at the end)
//! ```
//!
//! A key range's `dQ` is a partial sum; the ranges of one head are added at the end.
//! The mask is the causal limit (a per-key first visible query, `-inf` before it), the
//! user's boolean mask and additive bias (read through their broadcast strides, [`BLOCKED`]
//! where blocked), as in the explicit path: a row that sees no key, or only blocked ones,
//! has output zero, log-sum-exp [`DEAD_LSE`] and passes no gradient.

use rayon::prelude::*;

use crate::attention::{BLOCKED, DEAD_ROW};
use crate::rows::{DEAD_LSE, Dims, exp, exp_fma};

/// Queries per tile.
const QT: usize = 64;
/// Keys per tile.
const KT: usize = 64;

/// A rank-4 tensor read through its strides: element `[b, h, i, j]` at
/// `offset + b·s0 + h·s1 + i·s2 + j·s3`. A broadcast axis (size 1) has stride 0.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Grid<'a, T> {
    pub data: &'a [T],
    pub offset: usize,
    pub strides: [usize; 4],
}

impl<T: Copy> Grid<'_, T> {
    fn at(&self, b: usize, h: usize, i: usize, j: usize) -> T {
        let [s0, s1, s2, s3] = self.strides;
        self.data[self.offset + b * s0 + h * s1 + i * s2 + j * s3]
    }

    /// Row `i` of matrix `(b, h)`, `cols` wide (the columns have unit stride).
    fn row(&self, b: usize, h: usize, i: usize, cols: usize) -> &[T] {
        let [s0, s1, s2, _] = self.strides;
        let start = self.offset + b * s0 + h * s1 + i * s2;
        &self.data[start..start + cols]
    }

    /// Rows `row..row + rows` of matrix `(b, h)`, `cols` wide: the first element and the
    /// row stride (the columns have unit stride).
    ///
    /// # Panics
    /// If the block reaches past the data.
    fn rows(&self, b: usize, h: usize, row: usize, [rows, cols]: [usize; 2]) -> (*const T, usize) {
        let [s0, s1, s2, _] = self.strides;
        let start = self.offset + b * s0 + h * s1 + row * s2;
        let end = start + rows.saturating_sub(1) * s2 + cols;
        assert!(
            rows == 0 || end <= self.data.len(),
            "a block of {rows} x {cols} from element {start} (row stride {s2}) reaches past {} elements",
            self.data.len()
        );
        (self.data[start..].as_ptr(), s2)
    }
}

/// The mask beyond the causal limit: a bias (clamped at [`BLOCKED`]) and a boolean mask
/// (nonzero = blocked), each broadcastable to `[B, H, Tq, Tk]`.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Extra<'a> {
    pub bias: Option<Grid<'a, f32>>,
    pub blocked: Option<Grid<'a, u8>>,
}

/// A pointer that tasks write through, each to elements no other task writes.
#[derive(Clone, Copy)]
struct Out(*mut f32);
// SAFETY: the tasks write disjoint elements (see each use).
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// The pointer, through a method so that closures capture the whole `Out`.
    fn at(&self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// Forward pass: `(output, lse)`, the output laid out `[B, Tq, H, Dv]` and the
/// log-sum-exp `[B, H, Tq]`. Query `[B, H, Tq, Dk]`, key `[B, Hkv, Tk, Dk]`, value
/// `[B, Hkv, Tk, Dv]`, each with unit stride along its last axis; query head `h` reads
/// key/value head `h / (H / Hkv)`.
pub(crate) fn forward(
    dims: Dims,
    q: Grid<f32>,
    k: Grid<f32>,
    v: Grid<f32>,
    extra: Extra,
) -> (Vec<f32>, Vec<f32>) {
    forward_on(Isa::best(), dims, q, k, v, extra)
}

fn forward_on(
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
    let mut output = vec![0.0f32; batch * queries * heads * d_v];
    let mut lse = vec![0.0f32; batch * heads * queries];
    let tiles = queries.div_ceil(QT);
    let out = Out(output.as_mut_ptr());
    let lse_out = Out(lse.as_mut_ptr());
    (0..batch * heads * tiles).into_par_iter().for_each_init(
        || Scratch::new(dims),
        |scratch, task| {
            // The last tiles of a causal head see the most keys: they go first.
            let (bh, tile) = (task / tiles, tiles - 1 - task % tiles);
            let (b, h) = (bh / heads, bh % heads);
            let q0 = tile * QT;
            let nq = QT.min(queries - q0);
            let tile = Tile { b, h, q0, nq };
            let (o, l) = scratch.forward(isa, dims, &q, &k, &v, &extra, tile);
            for i in 0..nq {
                let row = ((b * queries + q0 + i) * heads + h) * d_v;
                // SAFETY: row `q0 + i` of head `(b, h)` belongs to this task alone.
                unsafe {
                    std::ptr::copy_nonoverlapping(o[i * d_v..].as_ptr(), out.at(row), d_v);
                    *lse_out.at(bh * queries + q0 + i) = l[i];
                }
            }
        },
    );
    (output, lse)
}

/// Backward pass: `(dq, dk, dv)`, laid out `[B, Tq, H, Dk]`, `[B, Tk, Hkv, Dk]` and `[B,
/// Tk, Hkv, Dv]`, from the inputs, the output, the log-sum-exp `[B, H, Tq]` of
/// [`forward`] and the output's gradient `grad` (`[B, H, Tq, Dv]`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    dims: Dims,
    q: Grid<f32>,
    k: Grid<f32>,
    v: Grid<f32>,
    output: Grid<f32>,
    lse: &[f32],
    grad: Grid<f32>,
    extra: Extra,
    bias_grad: Option<[usize; 4]>,
) -> Gradients {
    let threads = rayon::current_num_threads();
    let inputs = [q, k, v, output, grad];
    backward_on(Isa::best(), threads, dims, inputs, lse, extra, bias_grad)
}

/// The gradients of [`backward`]: `dq` `[B, Tq, H, Dk]`, `dk` `[B, Tk, Hkv, Dk]`, `dv`
/// `[B, Tk, Hkv, Dv]`, and the bias's (row-major, in its own shape) when asked for.
pub(crate) struct Gradients {
    pub(crate) dq: Vec<f32>,
    pub(crate) dk: Vec<f32>,
    pub(crate) dv: Vec<f32>,
    pub(crate) bias: Option<Vec<f32>>,
}

impl Gradients {
    /// The gradients as a backend's tensors, `(dq, dk, dv, dbias)`: `heads` makes the
    /// `[B, H, T, D]` tensor that `[B, T, H, D]` floats hold, `plain` a tensor of the
    /// given shape from row-major floats (the bias's, of shape `bias_shape`).
    fn into_tensors<T>(
        self,
        dims: Dims,
        bias_shape: Option<[usize; 4]>,
        heads: impl Fn(Vec<f32>, [usize; 4]) -> T,
        plain: impl Fn(Vec<f32>, [usize; 4]) -> T,
    ) -> (T, T, T, Option<T>) {
        let d = dims;
        (
            heads(self.dq, [d.batch, d.heads, d.queries, d.d_k]),
            heads(self.dk, [d.batch, d.kv_heads, d.keys, d.d_k]),
            heads(self.dv, [d.batch, d.kv_heads, d.keys, d.d_v]),
            self.bias
                .zip(bias_shape)
                .map(|(values, shape)| plain(values, shape)),
        )
    }
}

/// [`backward`] with the given instruction set, its heads cut for `threads` threads;
/// `[q, k, v, output, grad]`; `bias_grad`: the bias's shape, when its gradient is wanted.
fn backward_on(
    isa: Isa,
    threads: usize,
    dims: Dims,
    [q, k, v, output, grad]: [Grid<f32>; 5],
    lse: &[f32],
    extra: Extra,
    bias_grad: Option<[usize; 4]>,
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
    let mut dq = vec![0.0f32; batch * queries * heads * d_k];
    let mut dk = vec![0.0f32; batch * keys * kv_heads * d_k];
    let mut dv = vec![0.0f32; batch * keys * kv_heads * d_v];
    let ranges = key_ranges(dims, threads);
    let split = ranges.len();
    let dq_out = Out(dq.as_mut_ptr());
    let dk_out = Out(dk.as_mut_ptr());
    let dv_out = Out(dv.as_mut_ptr());
    // Each task: a key range of one key/value head, through every query head of its
    // group; it returns those query heads' partial dQ, one after the other (or, when the
    // range is every key, writes their dQ in place and returns nothing).
    let partials: Vec<(Vec<f32>, Option<BiasPart>)> = (0..batch * kv_heads * split)
        .into_par_iter()
        .map(|task| {
            let (bkv, range) = (task / split, ranges[task % split].clone());
            let (b, kvh) = (bkv / kv_heads, bkv % kv_heads);
            let mut kv = KeyGrads {
                dk: vec![0.0; range.len() * d_k],
                dv: vec![0.0; range.len() * d_v],
                bias: bias_grad.map(|shape| BiasPart::new(shape, group, &range)),
            };
            let mut dq = vec![0.0f32; group * queries * d_k];
            for (g, dq) in dq.chunks_mut(queries * d_k).enumerate() {
                let h = kvh * group + g;
                let bh = b * heads + h;
                let lse = &lse[bh * queries..(bh + 1) * queries];
                let head = Head::new(dims, b, h, &q, &output, &grad, lse);
                head.backward(isa, dims, [&k, &v], &extra, range.clone(), &mut kv, dq);
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
                return (dq, kv.bias);
            }
            for (g, head) in dq.chunks_exact(queries * d_k).enumerate() {
                let h = kvh * group + g;
                for (i, row) in head.chunks_exact(d_k).enumerate() {
                    let at = ((b * queries + i) * heads + h) * d_k;
                    // SAFETY: the task is head (b, h)'s only one: its dQ rows are its own.
                    let out = unsafe { std::slice::from_raw_parts_mut(dq_out.at(at), d_k) };
                    for (o, &x) in out.iter_mut().zip(row) {
                        *o = x * dims.scale;
                    }
                }
            }
            (Vec::new(), kv.bias)
        })
        .collect();
    // The bias's gradient: every task's part added where it belongs.
    let bias = bias_grad.map(|shape| {
        let mut total = vec![0.0f32; shape.iter().product()];
        for (task, (_, part)) in partials.iter().enumerate() {
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
    if split == 1 {
        return Gradients { dq, dk, dv, bias };
    }
    // dQ of head (b, h): the sum of its key ranges' partial sums, times the scale.
    dq.par_chunks_mut(heads * d_k)
        .enumerate()
        .for_each(|(row, dq_row)| {
            let (b, i) = (row / queries, row % queries);
            for (h, dq_head) in dq_row.chunks_mut(d_k).enumerate() {
                let bkv = b * kv_heads + h / group;
                let at = ((h % group) * queries + i) * d_k;
                for (part, _) in &partials[bkv * split..(bkv + 1) * split] {
                    for (d, &p) in dq_head.iter_mut().zip(&part[at..at + d_k]) {
                        *d += p;
                    }
                }
                dq_head.iter_mut().for_each(|d| *d *= dims.scale);
            }
        });
    Gradients { dq, dk, dv, bias }
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
    fn new([_, h, q, k]: [usize; 4], group: usize, range: &std::ops::Range<usize>) -> Self {
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
        range: &std::ops::Range<usize>,
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
/// are at least two such heads per thread, else enough ranges of about equal work (a causal key is
/// seen by fewer queries the later it comes) for two tasks per thread.
fn key_ranges(dims: Dims, threads: usize) -> Vec<std::ops::Range<usize>> {
    let heads = dims.batch * dims.kv_heads;
    let tiles = dims.keys.div_ceil(KT);
    let split = (2 * threads).div_ceil(heads.max(1)).clamp(1, tiles.max(1));
    if split == 1 {
        return std::iter::once(0..dims.keys).collect();
    }
    let work = |tile: usize| dims.queries - dims.first_query(tile * KT) + 1;
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

/// One tile of queries: head `(b, h)`, queries `q0..q0 + nq`.
#[derive(Debug, Clone, Copy)]
struct Tile {
    b: usize,
    h: usize,
    q0: usize,
    nq: usize,
}

/// A forward task's buffers, kept by each thread from task to task.
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

    /// The output rows `[nq, Dv]` and log-sum-exps of one tile of queries.
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &mut self,
        isa: Isa,
        dims: Dims,
        q: &Grid<f32>,
        k: &Grid<f32>,
        v: &Grid<f32>,
        extra: &Extra,
        tile: Tile,
    ) -> (&[f32], &[f32]) {
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx2 {
            // SAFETY: the CPU has the features the function is compiled for.
            unsafe { self.forward_avx2(dims, q, k, v, extra, tile) };
            return (&self.acc, &self.lse);
        }
        self.forward_in::<Portable>(dims, q, k, v, extra, tile);
        (&self.acc, &self.lse)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn forward_avx2(
        &mut self,
        dims: Dims,
        q: &Grid<f32>,
        k: &Grid<f32>,
        v: &Grid<f32>,
        extra: &Extra,
        tile: Tile,
    ) {
        self.forward_in::<Avx2>(dims, q, k, v, extra, tile);
    }

    #[inline(always)]
    fn forward_in<A: Arch>(
        &mut self,
        dims: Dims,
        q: &Grid<f32>,
        k: &Grid<f32>,
        v: &Grid<f32>,
        extra: &Extra,
        tile: Tile,
    ) {
        let Tile { b, h, q0, nq } = tile;
        let (d_k, d_v) = (dims.d_k, dims.d_v);
        for i in 0..nq {
            let row = q.row(b, h, q0 + i, d_k);
            for (t, &x) in self.qt[i..].iter_mut().step_by(QT).zip(row) {
                *t = x * dims.scale;
            }
        }
        self.max[..nq].fill(f32::NEG_INFINITY);
        self.sum[..nq].fill(0.0);
        self.acc[..nq * d_v].fill(0.0);
        let visible = dims.row_len(q0 + nq - 1);
        for k0 in (0..visible).step_by(KT) {
            let nk = KT.min(visible - k0);
            let (kp, ks) = k.rows(b, h / dims.group(), k0, [nk, d_k]);
            // SAFETY: rows k0..k0+nk of K (d_k columns); the packed queries; `s` holds
            // KT x QT.
            unsafe {
                A::gemm(
                    [nk, nq, d_k],
                    (kp, ks, 1),
                    (self.qt.as_ptr(), QT),
                    (self.s.as_mut_ptr(), QT),
                    false,
                );
            }
            mask_tile(dims, extra, tile, k0, nk, &mut self.s);
            // Online softmax down the columns: the new maximum, the old sum and output
            // rescaled to it, the weights and their sum.
            let mut col_max = [f32::NEG_INFINITY; QT];
            for row in self.s.chunks_exact(QT).take(nk) {
                for (m, &x) in col_max[..nq].iter_mut().zip(row) {
                    *m = m.max(x);
                }
            }
            let mut shift = [0.0f32; QT];
            let mut alpha = [0.0f32; QT];
            for i in 0..nq {
                let max = self.max[i].max(col_max[i]);
                shift[i] = if max == f32::NEG_INFINITY { 0.0 } else { max };
                alpha[i] = A::exp(self.max[i] - shift[i]);
                self.max[i] = max;
            }
            let mut col_sum = [0.0f32; QT];
            for row in self.s.chunks_exact_mut(QT).take(nk) {
                for i in 0..nq {
                    let p = A::exp(row[i] - shift[i]);
                    row[i] = p;
                    col_sum[i] += p;
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
                A::gemm(
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

/// Adds the bias and blocks what the boolean mask and the causal limit block in the
/// scores tile `s` (`[nk, nq]`, rows `QT` apart) of keys `k0..k0 + nk`.
#[inline(always)]
fn mask_tile(dims: Dims, extra: &Extra, tile: Tile, k0: usize, nk: usize, s: &mut [f32]) {
    let Tile { b, h, q0, nq } = tile;
    if let Some(bias) = &extra.bias {
        for (j, row) in s.chunks_exact_mut(QT).take(nk).enumerate() {
            for (i, x) in row[..nq].iter_mut().enumerate() {
                *x += bias.at(b, h, q0 + i, k0 + j);
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
    if dims.causal {
        for (j, row) in s.chunks_exact_mut(QT).take(nk).enumerate() {
            let first = dims.first_query(k0 + j).saturating_sub(q0).min(nq);
            row[..first].fill(f32::NEG_INFINITY);
        }
    }
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
}

impl<'a> Head<'a> {
    #[allow(clippy::too_many_arguments)]
    fn new(
        dims: Dims,
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
                *x = y * dims.scale;
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
    #[allow(clippy::too_many_arguments)]
    fn backward(
        &self,
        isa: Isa,
        dims: Dims,
        kv_in: [&Grid<f32>; 2],
        extra: &Extra,
        range: std::ops::Range<usize>,
        kv: &mut KeyGrads,
        dq: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if isa == Isa::Avx2 {
            // SAFETY: the CPU has the features the function is compiled for.
            unsafe { self.backward_avx2(dims, kv_in, extra, range, kv, dq) };
            return;
        }
        self.backward_in::<Portable>(dims, kv_in, extra, range, kv, dq);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn backward_avx2(
        &self,
        dims: Dims,
        kv_in: [&Grid<f32>; 2],
        extra: &Extra,
        range: std::ops::Range<usize>,
        kv: &mut KeyGrads,
        dq: &mut [f32],
    ) {
        self.backward_in::<Avx2>(dims, kv_in, extra, range, kv, dq);
    }

    #[inline(always)]
    fn backward_in<A: Arch>(
        &self,
        dims: Dims,
        [k, v]: [&Grid<f32>; 2],
        extra: &Extra,
        range: std::ops::Range<usize>,
        kv: &mut KeyGrads,
        dq: &mut [f32],
    ) {
        let Dims {
            queries, d_k, d_v, ..
        } = dims;
        let (b, h) = (self.b, self.h);
        let kvh = h / dims.group();
        assert!(dq.len() >= queries * d_k, "dQ holds every query");
        let mut p = vec![0.0f32; KT * QT];
        let mut ds = vec![0.0f32; KT * QT];
        for k0 in range.clone().step_by(KT) {
            let nk = KT.min(range.end - k0);
            let (kp, ks) = k.rows(b, kvh, k0, [nk, d_k]);
            let (vp, vs) = v.rows(b, kvh, k0, [nk, d_v]);
            let j0 = k0 - range.start;
            let first = dims.first_query(k0) / QT * QT;
            for q0 in (first..queries).step_by(QT) {
                let nq = QT.min(queries - q0);
                let tile = Tile { b, h, q0, nq };
                // SAFETY (every product below): K and V rows k0..k0+nk, the packed
                // queries and gradient columns q0..q0+nq, dO rows q0..q0+nq, tiles of
                // KT x QT, and the gradients' rows of this range.
                unsafe {
                    // Sᵀ = K (Q·scale)ᵀ, masked; Pᵀ = exp(Sᵀ - lse).
                    A::gemm(
                        [nk, nq, d_k],
                        (kp, ks, 1),
                        (self.qst.as_ptr().add(q0 * d_k), QT),
                        (p.as_mut_ptr(), QT),
                        false,
                    );
                    mask_tile(dims, extra, tile, k0, nk, &mut p);
                    let lse = &self.lse[q0..q0 + nq];
                    for row in p.chunks_exact_mut(QT).take(nk) {
                        for (x, &l) in row[..nq].iter_mut().zip(lse) {
                            *x = A::exp(*x - l);
                        }
                    }
                    // dV += Pᵀ dO
                    A::gemm(
                        [nk, d_v, nq],
                        (p.as_ptr(), QT, 1),
                        (self.go.as_ptr().add(q0 * d_v), d_v),
                        (kv.dv.as_mut_ptr().add(j0 * d_v), d_v),
                        true,
                    );
                    // dPᵀ = V dOᵀ; dSᵀ = Pᵀ ⊙ (dPᵀ - rowsum(dO ⊙ O))
                    A::gemm(
                        [nk, nq, d_v],
                        (vp, vs, 1),
                        (self.dot.as_ptr().add(q0 * d_v), QT),
                        (ds.as_mut_ptr(), QT),
                        false,
                    );
                    let row_dot = &self.row_dot[q0..q0 + nq];
                    for (ds_row, p_row) in ds.chunks_exact_mut(QT).zip(p.chunks_exact(QT)).take(nk)
                    {
                        for ((d, &w), &r) in ds_row[..nq].iter_mut().zip(p_row).zip(row_dot) {
                            *d = w * (*d - r);
                        }
                    }
                    if let Some(part) = kv.bias.as_mut() {
                        part.add(h % dims.group(), [q0, nq], [k0, nk], &ds);
                    }
                    // dK += dSᵀ (Q·scale)
                    A::gemm(
                        [nk, d_k, nq],
                        (ds.as_ptr(), QT, 1),
                        (self.qs.as_ptr().add(q0 * d_k), d_k),
                        (kv.dk.as_mut_ptr().add(j0 * d_k), d_k),
                        true,
                    );
                    // dQ += dS K
                    A::gemm(
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

/// `Σ a·b` in eight lanes (the compiler vectorises them; one running sum would wait on
/// each addition).
fn dot_product(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a8.zip(b8) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// Flex tensors read where they lie, through their strides.
#[cfg(feature = "flex")]
mod flex {
    use burn::backend::{BoolStore, DType, TensorData, flex::FlexTensor};

    use super::{Dims, Extra, Grid, backward, forward};

    /// The tensor as it is when its floats (or bytes) can be read through its strides (rank
    /// 4, strides not negative, unit stride along the last axis), else a contiguous copy.
    fn readable(tensor: &FlexTensor) -> FlexTensor {
        let layout = tensor.layout();
        let dims = layout.shape().num_dims();
        let strides = layout.strides();
        let inner = dims == 0 || strides[dims - 1] == 1 || layout.shape()[dims - 1] == 1;
        match dims == 4 && inner && strides.iter().all(|&s| s >= 0) {
            true => tensor.clone(),
            false => tensor.to_contiguous(),
        }
    }

    /// The tensor with its rows next to each other, for the operands read as panels of a
    /// matrix product (K and V; the backward packs dO itself): rows a few KB apart (the
    /// heads of a `[B, T, H·Dh]` projection) fall into few sets of the L1 cache; one copy
    /// costs less (measured at the long shape: 10% of the forward pass, more of the
    /// backward).
    fn dense_rows(tensor: &FlexTensor) -> FlexTensor {
        let layout = tensor.layout();
        let shape = layout.shape();
        let strides = layout.strides();
        let dense = shape.num_dims() == 4
            && (shape[2] == 1 || strides[2] == shape[3] as isize)
            && (shape[3] == 1 || strides[3] == 1)
            && strides.iter().all(|&s| s >= 0);
        match dense {
            true => tensor.clone(),
            false => tensor.to_contiguous(),
        }
    }

    /// The strides of a [`readable`] tensor, 0 along its axes of size 1.
    fn strides_of(tensor: &FlexTensor) -> [usize; 4] {
        let layout = tensor.layout();
        std::array::from_fn(|axis| match layout.shape()[axis] {
            1 => 0,
            _ => layout.strides()[axis] as usize,
        })
    }

    fn floats(tensor: &FlexTensor) -> Grid<'_, f32> {
        Grid {
            data: tensor.storage::<f32>(),
            offset: tensor.layout().start_offset(),
            strides: strides_of(tensor),
        }
    }

    fn bytes(tensor: &FlexTensor) -> Grid<'_, u8> {
        Grid {
            data: tensor.storage::<u8>(),
            offset: tensor.layout().start_offset(),
            strides: strides_of(tensor),
        }
    }

    /// `[B, T, H, D]` floats as the `[B, H, T, D]` tensor they hold (a view, no copy).
    fn heads_view(values: Vec<f32>, [b, h, t, d]: [usize; 4]) -> FlexTensor {
        FlexTensor::from_data(TensorData::new(values, [b, t, h, d])).transpose(1, 2)
    }

    /// Whether the tiled kernels take these tensors: f32 values, a byte-stored boolean mask.
    fn supported(tensors: &[&FlexTensor], blocked: Option<&FlexTensor>) -> bool {
        let bool_bytes = blocked.is_none_or(|mask| {
            matches!(mask.dtype(), DType::Bool(BoolStore::Native | BoolStore::U8))
        });
        bool_bytes && tensors.iter().all(|t| t.dtype() == DType::F32)
    }

    /// [`forward`] on flex tensors: `(output [B, H, Tq, Dv], lse [B, H, Tq, 1])`, or `None`
    /// for other dtypes.
    pub(crate) fn flex_forward(
        dims: Dims,
        [query, key, value]: [&FlexTensor; 3],
        blocked: Option<&FlexTensor>,
        bias: Option<&FlexTensor>,
    ) -> Option<(FlexTensor, FlexTensor)> {
        let mut all = vec![query, key, value];
        all.extend(bias);
        if !supported(&all, blocked) {
            return None;
        }
        let q = readable(query);
        let [k, v] = [key, value].map(dense_rows);
        let blocked = blocked.map(readable);
        let bias = bias.map(readable);
        let extra = Extra {
            bias: bias.as_ref().map(floats),
            blocked: blocked.as_ref().map(bytes),
        };
        let (output, lse) = forward(dims, floats(&q), floats(&k), floats(&v), extra);
        let d = dims;
        let output = heads_view(output, [d.batch, d.heads, d.queries, d.d_v]);
        let lse = FlexTensor::from_data(TensorData::new(lse, [d.batch, d.heads, d.queries, 1]));
        Some((output, lse))
    }

    /// [`backward`] on flex tensors: `(dq, dk, dv, dbias)` shaped as the query, key, value
    /// and bias (`dbias` when `bias_grad`), or `None` for other dtypes.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    pub(crate) fn flex_backward(
        dims: Dims,
        [query, key, value]: [&FlexTensor; 3],
        output: &FlexTensor,
        lse: &FlexTensor,
        grad: &FlexTensor,
        blocked: Option<&FlexTensor>,
        bias: Option<&FlexTensor>,
        bias_grad: bool,
    ) -> Option<(FlexTensor, FlexTensor, FlexTensor, Option<FlexTensor>)> {
        let mut all = vec![query, key, value, output, lse, grad];
        all.extend(bias);
        if !supported(&all, blocked) {
            return None;
        }
        let [q, o, g] = [query, output, grad].map(readable);
        let [k, v] = [key, value].map(dense_rows);
        let lse = lse.to_contiguous();
        let blocked = blocked.map(readable);
        let bias = bias.map(readable);
        let extra = Extra {
            bias: bias.as_ref().map(floats),
            blocked: blocked.as_ref().map(bytes),
        };
        let lse_values = &lse.storage::<f32>()[lse.layout().start_offset()..];
        let bias_shape = bias
            .as_ref()
            .filter(|_| bias_grad)
            .map(|b| shape4(b.layout().shape()));
        let grads = backward(
            dims,
            floats(&q),
            floats(&k),
            floats(&v),
            floats(&o),
            lse_values,
            floats(&g),
            extra,
            bias_shape,
        );
        let plain = |values, shape| FlexTensor::from_data(TensorData::new(values, shape));
        Some(grads.into_tensors(dims, bias_shape, heads_view, plain))
    }

    fn shape4(shape: &burn::backend::Shape) -> [usize; 4] {
        std::array::from_fn(|axis| shape[axis])
    }
}

#[cfg(feature = "flex")]
pub(crate) use flex::{flex_backward, flex_forward};

/// ndarray tensors read where they lie, through the strides of their views.
#[cfg(feature = "ndarray")]
#[allow(deprecated)] // Burn 0.22 deprecates ndarray; it is still one of our backends.
mod ndarray {
    use burn::backend::{
        NdArray, TensorData,
        ndarray::NdArrayTensor,
        ops::{BoolTensorOps, FloatTensorOps},
        try_read_sync,
    };

    use rayon::prelude::*;

    use super::{Dims, Extra, Grid, backward, forward};

    /// The elements an array view spans (through non-negative strides) as a slice, with
    /// its strides (0 along axes of 1), or `None` for other layouts.
    fn span<'a, T>(
        ptr: *const T,
        shape: &[usize],
        strides: &[isize],
    ) -> Option<(&'a [T], [usize; 4])> {
        let (shape, strides): ([usize; 4], [isize; 4]) =
            (shape.try_into().ok()?, strides.try_into().ok()?);
        let inner = shape[3] == 1 || strides[3] == 1;
        if !inner || strides.iter().any(|&s| s < 0) {
            return None;
        }
        let out: [usize; 4] = std::array::from_fn(|a| {
            if shape[a] == 1 {
                0
            } else {
                strides[a] as usize
            }
        });
        let len = match shape.contains(&0) {
            true => 0,
            false => 1 + (0..4).map(|a| (shape[a] - 1) * out[a]).sum::<usize>(),
        };
        // SAFETY: the view's elements lie within `len` elements from `ptr` (non-negative
        // strides); the callers tie the slice's lifetime to the array's.
        Some((unsafe { std::slice::from_raw_parts(ptr, len) }, out))
    }

    /// An f32 tensor's grid, borrowing its array; `None` for other dtypes or layouts.
    fn floats(tensor: &NdArrayTensor) -> Option<Grid<'_, f32>> {
        let NdArrayTensor::F32(storage) = tensor else {
            return None;
        };
        let view = storage.view();
        let (data, strides) = span(view.as_ptr(), view.shape(), view.strides())?;
        Some(Grid {
            data,
            offset: 0,
            strides,
        })
    }

    /// A boolean tensor's grid as bytes (`bool` is one byte, 0 or 1).
    fn bytes(tensor: &NdArrayTensor) -> Option<Grid<'_, u8>> {
        let NdArrayTensor::Bool(storage) = tensor else {
            return None;
        };
        let view = storage.view();
        let (data, strides) = span(view.as_ptr().cast::<u8>(), view.shape(), view.strides())?;
        Some(Grid {
            data,
            offset: 0,
            strides,
        })
    }

    /// The tensor's data, row-major (a copy).
    fn data_of(tensor: &NdArrayTensor) -> Option<TensorData> {
        let data = match tensor {
            NdArrayTensor::Bool(_) => try_read_sync(NdArray::bool_into_data(tensor.clone())),
            _ => try_read_sync(NdArray::float_into_data(tensor.clone())),
        };
        data?.ok()
    }

    /// `tensor` itself, or a contiguous copy where its view cannot be read in place.
    fn readable(tensor: &NdArrayTensor) -> Option<NdArrayTensor> {
        let in_place = match tensor {
            NdArrayTensor::F32(_) => floats(tensor).is_some(),
            NdArrayTensor::Bool(_) => bytes(tensor).is_some(),
            _ => return None,
        };
        match in_place {
            true => Some(tensor.clone()),
            false => Some(NdArrayTensor::from_data(data_of(tensor)?)),
        }
    }

    /// A readable f32 tensor with its rows next to each other (see `dense_rows` on flex),
    /// copied row by row where they are not.
    fn dense_rows(tensor: NdArrayTensor) -> Option<NdArrayTensor> {
        let grid = floats(&tensor)?;
        let NdArrayTensor::F32(storage) = &tensor else {
            return None;
        };
        let shape: [usize; 4] = storage.shape().try_into().ok()?;
        let [_, heads, len, d] = shape;
        let [s0, s1, s2, _] = grid.strides;
        if len <= 1 || s2 == d {
            return Some(tensor);
        }
        let mut values = vec![0.0f32; shape.iter().product()];
        values
            .par_chunks_mut((len * d).max(1))
            .enumerate()
            .for_each(|(bh, head)| {
                let (b, h) = (bh / heads, bh % heads);
                for (t, row) in head.chunks_mut(d.max(1)).enumerate() {
                    let at = grid.offset + b * s0 + h * s1 + t * s2;
                    row.copy_from_slice(&grid.data[at..at + d]);
                }
            });
        Some(NdArrayTensor::from_data(TensorData::new(values, shape)))
    }

    /// The mask's parts `[blocked, bias]`, readable; `None` when one cannot be read (the
    /// call then takes the chunked path).
    fn mask_parts(
        blocked: Option<&NdArrayTensor>,
        bias: Option<&NdArrayTensor>,
    ) -> Option<[Option<NdArrayTensor>; 2]> {
        let read = |part: Option<&NdArrayTensor>| match part {
            Some(tensor) => readable(tensor).map(Some),
            None => Some(None),
        };
        Some([read(blocked)?, read(bias)?])
    }

    /// The mask's parts as the kernels read them.
    fn extra([blocked, bias]: &[Option<NdArrayTensor>; 2]) -> Option<Extra<'_>> {
        Some(Extra {
            bias: match bias {
                Some(bias) => Some(floats(bias)?),
                None => None,
            },
            blocked: match blocked {
                Some(mask) => Some(bytes(mask)?),
                None => None,
            },
        })
    }

    /// `[B, T, H, D]` floats as the `[B, H, T, D]` tensor they hold (a view).
    fn heads_view(values: Vec<f32>, [b, h, t, d]: [usize; 4]) -> NdArrayTensor {
        let tensor = NdArrayTensor::from_data(TensorData::new(values, [b, t, h, d]));
        NdArray::float_swap_dims(tensor, 1, 2)
    }

    /// [`forward`] on ndarray tensors: `(output [B, H, Tq, Dv], lse [B, H, Tq, 1])`, or
    /// `None` for other dtypes.
    pub(crate) fn ndarray_forward(
        dims: Dims,
        qkv: [&NdArrayTensor; 3],
        blocked: Option<&NdArrayTensor>,
        bias: Option<&NdArrayTensor>,
    ) -> Option<(NdArrayTensor, NdArrayTensor)> {
        let [q, k, v] = qkv.map(readable);
        let (q, k, v) = (q?, dense_rows(k?)?, dense_rows(v?)?);
        let parts = mask_parts(blocked, bias)?;
        let extra = extra(&parts)?;
        let (q, k, v) = (floats(&q)?, floats(&k)?, floats(&v)?);
        let (output, lse) = forward(dims, q, k, v, extra);
        let d = dims;
        Some((
            heads_view(output, [d.batch, d.heads, d.queries, d.d_v]),
            NdArrayTensor::from_data(TensorData::new(lse, [d.batch, d.heads, d.queries, 1])),
        ))
    }

    /// [`backward`] on ndarray tensors: `(dq, dk, dv, dbias)` shaped as the query, key,
    /// value and bias (`dbias` when `bias_grad`), or `None` for other dtypes.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    pub(crate) fn ndarray_backward(
        dims: Dims,
        qkv: [&NdArrayTensor; 3],
        output: &NdArrayTensor,
        lse: &NdArrayTensor,
        grad: &NdArrayTensor,
        blocked: Option<&NdArrayTensor>,
        bias: Option<&NdArrayTensor>,
        bias_grad: bool,
    ) -> Option<(
        NdArrayTensor,
        NdArrayTensor,
        NdArrayTensor,
        Option<NdArrayTensor>,
    )> {
        let [q, k, v, o, g] = [qkv[0], qkv[1], qkv[2], output, grad].map(readable);
        let (q, o, g) = (q?, o?, g?);
        let [k, v] = [k?, v?].map(dense_rows);
        let (k, v) = (k?, v?);
        let lse = data_of(lse)?.try_into_vec::<f32>().ok()?;
        let parts = mask_parts(blocked, bias)?;
        let extra = extra(&parts)?;
        let inputs = [
            floats(&q)?,
            floats(&k)?,
            floats(&v)?,
            floats(&o)?,
            floats(&g)?,
        ];
        let [q, k, v, o, g] = inputs;
        let bias_shape = match (&parts[1], bias_grad) {
            (Some(NdArrayTensor::F32(storage)), true) => Some(storage.shape().try_into().ok()?),
            _ => None,
        };
        let grads = backward(dims, q, k, v, o, &lse, g, extra, bias_shape);
        let plain = |values, shape| NdArrayTensor::from_data(TensorData::new(values, shape));
        Some(grads.into_tensors(dims, bias_shape, heads_view, plain))
    }
}

#[cfg(feature = "ndarray")]
pub(crate) use ndarray::{ndarray_backward, ndarray_forward};

/// The instruction set the kernels are compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    /// Plain loops, any CPU.
    Portable,
    /// x86-64 with AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    Avx2,
}

impl Isa {
    /// The best this CPU runs (the standard library caches the detection).
    fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return Isa::Avx2;
        }
        Isa::Portable
    }
}

/// A matrix kernel for one instruction set.
trait Arch {
    /// `C = A B` (or `C += A B` when `add`) for sizes `[m, n, k]`: A is `(ptr, row
    /// stride, column stride)`, B and C are `(ptr, row stride)` with unit column stride.
    ///
    /// # Safety
    /// Every element of the three matrices is in bounds.
    unsafe fn gemm(
        mnk: [usize; 3],
        a: (*const f32, usize, usize),
        b: (*const f32, usize),
        c: (*mut f32, usize),
        add: bool,
    );

    /// `e^x` ([`exp`], with fused multiply-adds where the instruction set has them).
    fn exp(x: f32) -> f32;
}

/// Plain loops, for any CPU.
struct Portable;

impl Arch for Portable {
    #[inline(always)]
    fn exp(x: f32) -> f32 {
        exp(x)
    }

    #[inline(always)]
    unsafe fn gemm(
        [m, n, k]: [usize; 3],
        (a, rsa, csa): (*const f32, usize, usize),
        (b, ldb): (*const f32, usize),
        (c, ldc): (*mut f32, usize),
        add: bool,
    ) {
        // SAFETY: the caller's contract.
        unsafe { gemm_portable([m, n, k], (a, rsa, csa), (b, ldb), (c, ldc), add) }
    }
}

/// [`Arch::gemm`] in plain loops.
#[inline(always)]
unsafe fn gemm_portable(
    [m, n, k]: [usize; 3],
    (a, rsa, csa): (*const f32, usize, usize),
    (b, ldb): (*const f32, usize),
    (c, ldc): (*mut f32, usize),
    add: bool,
) {
    for i in 0..m {
        // SAFETY: the caller's contract.
        let c_row = unsafe { std::slice::from_raw_parts_mut(c.add(i * ldc), n) };
        if !add {
            c_row.fill(0.0);
        }
        for p in 0..k {
            // SAFETY: the caller's contract.
            let (x, b_row) = unsafe {
                (
                    *a.add(i * rsa + p * csa),
                    std::slice::from_raw_parts(b.add(p * ldb), n),
                )
            };
            for (y, &w) in c_row.iter_mut().zip(b_row) {
                *y += x * w;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Arch for Avx2 {
    #[inline(always)]
    fn exp(x: f32) -> f32 {
        exp_fma(x)
    }

    #[inline(always)]
    unsafe fn gemm(
        [m, n, k]: [usize; 3],
        a: (*const f32, usize, usize),
        b: (*const f32, usize),
        c: (*mut f32, usize),
        add: bool,
    ) {
        // SAFETY: the caller's contract; only called where the CPU has AVX2 and FMA.
        unsafe { avx2::gemm([m, n, k], a, b, c, add) }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Rows of C per register tile: 6 x 16 outputs are 12 registers of sums, enough to
    /// keep both FMA units busy through the FMA's latency.
    const MR: usize = 6;

    /// [`super::Arch::gemm`] in tiles of 6 x 16 and 6 x 8 outputs, the last
    /// columns (fewer than 8) as dot products ([`narrow`]) or in plain loops.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) unsafe fn gemm(
        [m, n, k]: [usize; 3],
        (a, rsa, csa): (*const f32, usize, usize),
        (b, ldb): (*const f32, usize),
        (c, ldc): (*mut f32, usize),
        add: bool,
    ) {
        let mut j = 0;
        // SAFETY (throughout): the caller's contract bounds every tile.
        unsafe {
            while j + 16 <= n {
                rows::<2>(m, k, (a, rsa, csa), (b.add(j), ldb), (c.add(j), ldc), add);
                j += 16;
            }
            if j + 8 <= n {
                rows::<1>(m, k, (a, rsa, csa), (b.add(j), ldb), (c.add(j), ldc), add);
                j += 8;
            }
            if j < n && csa == 1 {
                narrow(
                    [m, n - j, k],
                    (a, rsa),
                    (b.add(j), ldb),
                    (c.add(j), ldc),
                    add,
                );
            } else if j < n {
                super::gemm_portable(
                    [m, n - j, k],
                    (a, rsa, csa),
                    (b.add(j), ldb),
                    (c.add(j), ldc),
                    add,
                );
            }
        }
    }

    /// Fewer than 8 columns of C with A's rows contiguous (one query decoding over a
    /// cache of keys: `Sᵀ = K qᵀ`): each output a dot product of an A row and a B
    /// column, 16 lanes at a time along `k`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn narrow(
        [m, n, k]: [usize; 3],
        (a, rsa): (*const f32, usize),
        (b, ldb): (*const f32, usize),
        (c, ldc): (*mut f32, usize),
        add: bool,
    ) {
        let mut column = vec![0.0f32; k];
        // SAFETY (throughout): the caller's contract bounds every load and store.
        unsafe {
            for j in 0..n {
                for (p, x) in column.iter_mut().enumerate() {
                    *x = *b.add(p * ldb + j);
                }
                let col = column.as_ptr();
                for i in 0..m {
                    let row = a.add(i * rsa);
                    let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    let mut p = 0;
                    while p + 16 <= k {
                        s0 = _mm256_fmadd_ps(
                            _mm256_loadu_ps(row.add(p)),
                            _mm256_loadu_ps(col.add(p)),
                            s0,
                        );
                        let (r, w) = (row.add(p + 8), col.add(p + 8));
                        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(r), _mm256_loadu_ps(w), s1);
                        p += 16;
                    }
                    let mut lanes = [0.0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(s0, s1));
                    let mut sum: f32 = lanes.iter().sum();
                    for q in p..k {
                        sum += *row.add(q) * *col.add(q);
                    }
                    let out = c.add(i * ldc + j);
                    *out = if add { *out + sum } else { sum };
                }
            }
        }
    }

    /// Columns `0..8·V` of every row, `MR` rows at a time.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn rows<const V: usize>(
        m: usize,
        k: usize,
        (a, rsa, csa): (*const f32, usize, usize),
        (b, ldb): (*const f32, usize),
        (c, ldc): (*mut f32, usize),
        add: bool,
    ) {
        let mut i = 0;
        // SAFETY (throughout): the caller's contract bounds every tile.
        unsafe {
            while i + MR <= m {
                let at = (a.add(i * rsa), rsa, csa);
                tile::<MR, V>(k, at, (b, ldb), (c.add(i * ldc), ldc), add);
                i += MR;
            }
            let at = (a.add(i * rsa), rsa, csa);
            let ct = (c.add(i * ldc), ldc);
            match m - i {
                5 => tile::<5, V>(k, at, (b, ldb), ct, add),
                4 => tile::<4, V>(k, at, (b, ldb), ct, add),
                3 => tile::<3, V>(k, at, (b, ldb), ct, add),
                2 => tile::<2, V>(k, at, (b, ldb), ct, add),
                1 => tile::<1, V>(k, at, (b, ldb), ct, add),
                _ => {}
            }
        }
    }

    /// One `R x 8·V` tile of C, its sums in registers over the whole `k`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile<const R: usize, const V: usize>(
        k: usize,
        (a, rsa, csa): (*const f32, usize, usize),
        (b, ldb): (*const f32, usize),
        (c, ldc): (*mut f32, usize),
        add: bool,
    ) {
        // SAFETY (throughout): the caller's contract bounds every load and store.
        unsafe {
            let mut sum = [[_mm256_setzero_ps(); V]; R];
            if add {
                for (r, row) in sum.iter_mut().enumerate() {
                    for (x, s) in row.iter_mut().enumerate() {
                        *s = _mm256_loadu_ps(c.add(r * ldc + 8 * x));
                    }
                }
            }
            for p in 0..k {
                let b_row = b.add(p * ldb);
                let mut w = [_mm256_setzero_ps(); V];
                for (x, w) in w.iter_mut().enumerate() {
                    *w = _mm256_loadu_ps(b_row.add(8 * x));
                }
                for (r, row) in sum.iter_mut().enumerate() {
                    let x = _mm256_set1_ps(*a.add(r * rsa + p * csa));
                    for (s, &w) in row.iter_mut().zip(&w) {
                        *s = _mm256_fmadd_ps(x, w, *s);
                    }
                }
            }
            for (r, row) in sum.iter().enumerate() {
                for (x, &s) in row.iter().enumerate() {
                    _mm256_storeu_ps(c.add(r * ldc + 8 * x), s);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random(len: usize, seed: u32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(2_654_435_761).max(1);
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// The reference product in f64, A read through its strides.
    fn reference(
        m: usize,
        n: usize,
        k: usize,
        a: &[f32],
        (rsa, csa): (usize, usize),
        b: &[f32],
        ldb: usize,
    ) -> Vec<f64> {
        let mut c = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|p| a[i * rsa + p * csa] as f64 * b[p * ldb + j] as f64)
                    .sum();
            }
        }
        c
    }

    fn check<A: Arch>(name: &str) {
        // Sizes around the register tiles' edges and the narrow columns' dot products,
        // A both ways round, C = and +=.
        for &(m, n, k) in &[
            (1, 1, 1),
            (4, 16, 64),
            (7, 29, 13),
            (64, 64, 64),
            (3, 8, 0),
            (13, 40, 70),
            (5, 3, 40),
            (64, 1, 64),
        ] {
            for transposed in [false, true] {
                let a = random(m * k + 1, (m * 31 + n * 7 + k) as u32);
                let strides = if transposed { (1, m) } else { (k, 1) };
                let ldb = n + 3;
                let b = random(k * ldb + 1, (n * 13 + k) as u32);
                let ldc = n + 5;
                let start = random(m * ldc, 99);
                for add in [false, true] {
                    let mut c = start.clone();
                    // SAFETY: the buffers hold every element the sizes and strides name.
                    unsafe {
                        A::gemm(
                            [m, n, k],
                            (a.as_ptr(), strides.0, strides.1),
                            (b.as_ptr(), ldb),
                            (c.as_mut_ptr(), ldc),
                            add,
                        );
                    }
                    let want = reference(m, n, k, &a, strides, &b, ldb);
                    for i in 0..m {
                        for j in 0..n {
                            let base = if add { start[i * ldc + j] as f64 } else { 0.0 };
                            let got = c[i * ldc + j] as f64;
                            let want = want[i * n + j] + base;
                            assert!(
                                (got - want).abs() <= 1e-5 * (1.0 + k as f64),
                                "{name} [{m}, {n}, {k}] a^T {transposed} add {add}: c[{i}, {j}] = {got}, want {want}"
                            );
                        }
                        // Columns past n are untouched.
                        for j in n..ldc {
                            assert_eq!(
                                c[i * ldc + j],
                                start[i * ldc + j],
                                "{name}: column {j} written"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn portable_gemm_matches_f64() {
        check::<Portable>("portable");
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_gemm_matches_f64() {
        if Isa::best() == Isa::Avx2 {
            check::<Avx2>("avx2");
        }
    }

    /// Inputs of one attention call, `[B, H, T, D]` contiguous, with a bias broadcast
    /// over batch and queries and a boolean mask broadcast over heads.
    struct Case {
        dims: Dims,
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        grad: Vec<f32>,
        bias: Vec<f32>,
        blocked: Vec<u8>,
    }

    fn dense<T>(data: &[T], [_, h, t, d]: [usize; 4]) -> Grid<'_, T> {
        Grid {
            data,
            offset: 0,
            strides: [h * t * d, t * d, d, 1],
        }
    }

    impl Case {
        fn new(queries: usize, keys: usize, causal: bool, kv_heads: usize) -> Self {
            let (batch, heads, d_k, d_v) = (2, 4, 20, 12);
            let dims = Dims {
                batch,
                heads,
                kv_heads,
                queries,
                keys,
                d_k,
                d_v,
                causal,
                scale: 0.3,
            };
            let mut blocked: Vec<u8> = random(batch * queries * keys, 5)
                .iter()
                .map(|&x| (x > 0.8) as u8)
                .collect();
            blocked[3 * keys..4 * keys].fill(1); // Query 3 of batch 0 sees no key.
            Self {
                dims,
                q: random(batch * heads * queries * d_k, 1),
                k: random(batch * kv_heads * keys * d_k, 2),
                v: random(batch * kv_heads * keys * d_v, 3),
                grad: random(batch * heads * queries * d_v, 4),
                bias: random(heads * keys, 6),
                blocked,
            }
        }

        fn extra(&self) -> Extra<'_> {
            let Dims { queries, keys, .. } = self.dims;
            Extra {
                bias: Some(Grid {
                    data: &self.bias,
                    offset: 0,
                    strides: [0, keys, 0, 1],
                }),
                blocked: Some(Grid {
                    data: &self.blocked,
                    offset: 0,
                    strides: [queries * keys, 0, keys, 1],
                }),
            }
        }

        /// `(output, lse, dq, dk, dv, dbias)` in f64, laid out `[B, H, T, D]` (the bias
        /// `[H, Tk]`).
        #[allow(clippy::type_complexity)]
        fn reference(&self) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
            let d = self.dims;
            let (dk_, dv_) = (d.d_k, d.d_v);
            let mut out = vec![0.0; d.batch * d.heads * d.queries * dv_];
            let mut lse = vec![DEAD_LSE as f64; d.batch * d.heads * d.queries];
            let mut dq = vec![0.0; d.batch * d.heads * d.queries * dk_];
            let mut dk = vec![0.0; d.batch * d.kv_heads * d.keys * dk_];
            let mut dv = vec![0.0; d.batch * d.kv_heads * d.keys * dv_];
            let mut dbias = vec![0.0; d.heads * d.keys];
            for b in 0..d.batch {
                for h in 0..d.heads {
                    let bh = b * d.heads + h;
                    let bkv = b * d.kv_heads + h / d.group(); // The key/value head.
                    for i in 0..d.queries {
                        let qi = &self.q[(bh * d.queries + i) * dk_..][..dk_];
                        let keys = d.row_len(i);
                        let scores: Vec<f64> = (0..keys)
                            .map(|j| {
                                let kj = &self.k[(bkv * d.keys + j) * dk_..][..dk_];
                                let dot: f64 =
                                    qi.iter().zip(kj).map(|(&a, &b)| a as f64 * b as f64).sum();
                                match self.blocked[(b * d.queries + i) * d.keys + j] {
                                    0 => dot * d.scale as f64 + self.bias[h * d.keys + j] as f64,
                                    _ => BLOCKED as f64,
                                }
                            })
                            .collect();
                        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                        if keys == 0 || max <= DEAD_ROW as f64 {
                            continue;
                        }
                        let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                        lse[bh * d.queries + i] = max + sum.ln();
                        let p: Vec<f64> = scores.iter().map(|s| (s - max).exp() / sum).collect();
                        let row = (bh * d.queries + i) * dv_;
                        for (j, &pj) in p.iter().enumerate() {
                            for c in 0..dv_ {
                                out[row + c] += pj * self.v[(bkv * d.keys + j) * dv_ + c] as f64;
                            }
                        }
                        let go = &self.grad[row..row + dv_];
                        let row_dot: f64 = go
                            .iter()
                            .zip(&out[row..])
                            .map(|(&g, &o)| g as f64 * o)
                            .sum();
                        for (j, &pj) in p.iter().enumerate() {
                            let vj = &self.v[(bkv * d.keys + j) * dv_..][..dv_];
                            let dp: f64 =
                                go.iter().zip(vj).map(|(&g, &v)| g as f64 * v as f64).sum();
                            dbias[h * d.keys + j] += pj * (dp - row_dot);
                            let ds = pj * (dp - row_dot) * d.scale as f64;
                            for c in 0..dk_ {
                                let kj = self.k[(bkv * d.keys + j) * dk_ + c] as f64;
                                dq[(bh * d.queries + i) * dk_ + c] += ds * kj;
                                dk[(bkv * d.keys + j) * dk_ + c] += ds * qi[c] as f64;
                            }
                            for c in 0..dv_ {
                                dv[(bkv * d.keys + j) * dv_ + c] += pj * go[c] as f64;
                            }
                        }
                    }
                }
            }
            (out, lse, dq, dk, dv, dbias)
        }
    }

    /// `got` laid out `[B, T, H, D]` against `want` laid out `[B, H, T, D]`.
    fn assert_close(what: &str, got: &[f32], want: &[f64], [b, h, t, d]: [usize; 4]) {
        for bi in 0..b {
            for hi in 0..h {
                for ti in 0..t {
                    for di in 0..d {
                        let g = got[((bi * t + ti) * h + hi) * d + di] as f64;
                        let w = want[((bi * h + hi) * t + ti) * d + di];
                        assert!(
                            (g - w).abs() <= 1e-4 * (1.0 + w.abs()),
                            "{what}[{bi}, {hi}, {ti}, {di}] = {g}, want {w}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn tiles_match_f64_attention_forward_and_backward() {
        let mut isas = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        if Isa::best() == Isa::Avx2 {
            isas.push(Isa::Avx2);
        }
        // Partial tiles; causal with more keys than queries, with fewer (the first 20
        // queries see no key), and not causal; 2 query heads per key/value head, and 1.
        let cases = [(150, 170, true, 2), (150, 130, true, 4), (70, 90, false, 2)];
        for (queries, keys, causal, kv_heads) in cases {
            let case = Case::new(queries, keys, causal, kv_heads);
            let d = case.dims;
            let (out, lse, dq, dk, dv, dbias) = case.reference();
            let q_shape = [d.batch, d.heads, d.queries, d.d_k];
            let k_shape = [d.batch, d.kv_heads, d.keys, d.d_k];
            let v_shape = [d.batch, d.kv_heads, d.keys, d.d_v];
            let o_shape = [d.batch, d.heads, d.queries, d.d_v];
            let (q, k, v) = (
                dense(&case.q, q_shape),
                dense(&case.k, k_shape),
                dense(&case.v, v_shape),
            );
            for &isa in &isas {
                let name = format!("{isa:?} Tq {queries} Tk {keys} causal {causal} Hkv {kv_heads}");
                let (got, got_lse) = forward_on(isa, d, q, k, v, case.extra());
                assert_close(&format!("{name}: output"), &got, &out, o_shape);
                for (i, (&g, &w)) in got_lse.iter().zip(&lse).enumerate() {
                    assert!(
                        (g as f64 - w).abs() <= 1e-4 * (1.0 + w.abs()),
                        "{name}: lse[{i}] = {g}, want {w}"
                    );
                }
                // The output back in [B, H, Tq, Dv] for the backward pass.
                let mut o = vec![0.0f32; got.len()];
                for (bh, rows) in o.chunks_mut(d.queries * d.d_v).enumerate() {
                    let (b, h) = (bh / d.heads, bh % d.heads);
                    for (i, row) in rows.chunks_mut(d.d_v).enumerate() {
                        let at = ((b * d.queries + i) * d.heads + h) * d.d_v;
                        row.copy_from_slice(&got[at..at + d.d_v]);
                    }
                }
                // One key range per head, and several (as on a machine with more threads).
                for threads in [1, 8] {
                    let inputs = [q, k, v, dense(&o, o_shape), dense(&case.grad, o_shape)];
                    let bias_shape = Some([1, d.heads, 1, d.keys]);
                    let extra = case.extra();
                    let grads = backward_on(isa, threads, d, inputs, &got_lse, extra, bias_shape);
                    let name = format!("{name}, {threads} threads");
                    assert_close(&format!("{name}: dq"), &grads.dq, &dq, q_shape);
                    assert_close(&format!("{name}: dk"), &grads.dk, &dk, k_shape);
                    assert_close(&format!("{name}: dv"), &grads.dv, &dv, v_shape);
                    // [1, H, 1, Tk] reads the same as [1, 1, H, Tk] in assert_close's order.
                    let got_bias = grads.bias.expect("the bias's gradient");
                    assert_close(
                        &format!("{name}: dbias"),
                        &got_bias,
                        &dbias,
                        [1, 1, d.heads, d.keys],
                    );
                }
            }
        }
    }

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
            causal: true,
            scale: 1.0,
        };
        let ranges = key_ranges(dims, 8);
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
            8,
        );
        assert_eq!((one.len(), one[0].clone()), (1, 0..1000));
    }
}
