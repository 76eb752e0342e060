//! Attention computed in f64 on the host, forward and backward, from a description of the
//! mask that can also build the `AttentionMask` under test: the reference every attention
//! path of every backend is compared with.
//!
//! Semantics (mha's contract), written out here independently of the library: query `i`
//! stands at key `p = i + Tk - Tq` (bottom-right) or `p = i` (top-left); key `j` is
//! excluded from its softmax when the causal part hides it (`j > p`), a sliding window of
//! width `w` does (`j <= p - w`), a local window of radius `r` does (`|j - p| > r`), it
//! lies in another packed sequence (or in the padding past the last one), the boolean
//! mask blocks it, or its bias is `-inf`; a row with no key left has output 0, weights 0,
//! and passes no gradient. A soft cap makes the scaled score `cap · tanh(s / cap)` before
//! the bias. A bias by position adds `-slope_h · |j - p|` (ALiBi) or `table[h, bucket(j -
//! p)]` (a learned table; the buckets are the library's, checked against PyTorch's by the
//! parity tests). An attention sink `z_h` adds `exp(z_h)` to the softmax's denominator of
//! every row of head `h` that sees a key; its gradient is its column's: `-p_sink ·
//! rowsum(dO ⊙ O)`.

use burn::tensor::{Bool, Device, FloatDType, Tensor, TensorData};
use mha::{AttentionMask, Buckets, CausalAlignment, PositionBias};

/// Values broadcast to `[B, H, Tq, Tk]` from their own rank-4 shape (each axis full or 1).
#[derive(Clone, Debug)]
pub struct Part<T> {
    pub values: Vec<T>,
    pub dims: [usize; 4],
}

impl<T: Copy> Part<T> {
    fn index(&self, [b, h, i, j]: [usize; 4]) -> usize {
        let [db, dh, di, dj] = self.dims;
        let pick = |x: usize, d: usize| if d == 1 { 0 } else { x };
        ((pick(b, db) * dh + pick(h, dh)) * di + pick(i, di)) * dj + pick(j, dj)
    }

    fn at(&self, at: [usize; 4]) -> T {
        self.values[self.index(at)]
    }
}

/// What blocks by position.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum Rule {
    #[default]
    None,
    Causal,
    /// Causal, at most the last `w` keys.
    Sliding(usize),
    /// `|j - p| <= r`.
    Local(usize),
}

/// A bias by position: ALiBi (its slopes), or a learned table `[H, buckets]`.
#[derive(Clone, Debug)]
pub enum Position {
    Alibi(Vec<f32>),
    Table(Vec<f32>, Buckets),
}

/// A mask as the reference reads it.
#[derive(Clone, Debug, Default)]
pub struct MaskSpec {
    pub position: Option<Position>,
    pub rule: Rule,
    pub top_left: bool,
    /// Per batch row, cumulative sequence lengths.
    pub packed: Option<Vec<Vec<usize>>>,
    /// `true = blocked`.
    pub blocked: Option<Part<bool>>,
    pub bias: Option<Part<f32>>,
    /// Attention sinks' logits, one per query head.
    pub sinks: Option<Vec<f32>>,
}

impl MaskSpec {
    /// A causal mask.
    pub fn causal() -> Self {
        Self {
            rule: Rule::Causal,
            ..Self::default()
        }
    }

    /// The key at query `i`'s own position.
    fn own(&self, s: &Sizes, i: usize) -> i64 {
        match self.top_left {
            true => i as i64,
            false => i as i64 + s.keys as i64 - s.queries as i64,
        }
    }

    /// The bias by position of query `i`, key `j` and head `h`, and the entry of the table
    /// it reads.
    fn by_position(&self, s: &Sizes, h: usize, i: usize, j: usize) -> (f64, Option<usize>) {
        let distance = j as i64 - self.own(s, i);
        match &self.position {
            None => (0.0, None),
            Some(Position::Alibi(slopes)) => (-(slopes[h] as f64) * distance.abs() as f64, None),
            Some(Position::Table(table, buckets)) => {
                let at = h * buckets.len() + buckets.of(distance);
                (table[at] as f64, Some(at))
            }
        }
    }

    /// Whether key `j` is hidden from query `i` of batch row `b` by position.
    fn hides(&self, s: &Sizes, b: usize, i: usize, j: usize) -> bool {
        let p = self.own(s, i);
        let j = j as i64;
        let by_rule = match self.rule {
            Rule::None => false,
            Rule::Causal => j > p,
            Rule::Sliding(w) => j > p || j <= p - w as i64,
            Rule::Local(r) => (j - p).abs() > r as i64,
        };
        let seq = |t: i64| {
            let row = &self.packed.as_ref()?[b];
            (0..row.len() - 1).find(|&s| row[s] as i64 <= t && t < row[s + 1] as i64)
        };
        let across = self.packed.is_some() && (seq(i as i64).is_none() || seq(i as i64) != seq(j));
        by_rule || across
    }
}

impl MaskSpec {
    /// The same mask as an `AttentionMask` on `device`, its bias in `dtype`; the bias
    /// tensor is returned too (a leaf that requires a gradient when `bias_grad` and the
    /// device differentiates).
    pub fn build(&self, device: &Device, dtype: FloatDType, bias_grad: bool) -> Built {
        let mut mask = match self.rule {
            Rule::None => AttentionMask::none(),
            Rule::Causal => AttentionMask::causal(),
            Rule::Sliding(w) => AttentionMask::sliding_window(w),
            Rule::Local(r) => AttentionMask::local(r),
        };
        if self.top_left {
            mask = mask.aligned(CausalAlignment::TopLeft);
        }
        if let Some(packed) = &self.packed {
            mask = mask.and(AttentionMask::packed(packed));
        }
        if let Some(part) = &self.blocked {
            let data = TensorData::new(part.values.clone(), part.dims);
            mask = mask.and(AttentionMask::blocking(Tensor::<4, Bool>::from_data(
                data, device,
            )));
        }
        let bias = self.bias.as_ref().map(|part| {
            let data = TensorData::new(part.values.clone(), part.dims);
            let bias = Tensor::<4>::from_data(data, device).cast(dtype);
            match bias_grad && device.is_autodiff() {
                true => bias.require_grad(),
                false => bias,
            }
        });
        if let Some(bias) = &bias {
            mask = mask.and(AttentionMask::bias(bias.clone()));
        }
        let mut table = None;
        match &self.position {
            None => {}
            Some(Position::Alibi(slopes)) => {
                let alibi = PositionBias::Alibi {
                    slopes: slopes.clone(),
                };
                mask = mask.and(AttentionMask::position_bias(alibi));
            }
            Some(Position::Table(values, buckets)) => {
                let heads = values.len() / buckets.len();
                let data = TensorData::new(values.clone(), [heads, buckets.len()]);
                let t = Tensor::<2>::from_data(data, device).cast(dtype);
                let t = match bias_grad && device.is_autodiff() {
                    true => t.require_grad(),
                    false => t,
                };
                let learned = PositionBias::Learned {
                    table: t.clone(),
                    buckets: *buckets,
                };
                mask = mask.and(AttentionMask::position_bias(learned));
                table = Some(t);
            }
        }
        let sinks = self.sinks.as_ref().map(|values| {
            let data = TensorData::new(values.clone(), [values.len()]);
            let t = Tensor::<1>::from_data(data, device).cast(dtype);
            match bias_grad && device.is_autodiff() {
                true => t.require_grad(),
                false => t,
            }
        });
        if let Some(sinks) = &sinks {
            mask = mask.and(AttentionMask::sinks(sinks.clone()));
        }
        Built {
            mask,
            bias,
            table,
            sinks,
        }
    }
}

/// A mask built for a device, with its bias and table (leaves, for their gradients).
pub struct Built {
    pub mask: AttentionMask,
    pub bias: Option<Tensor<4>>,
    pub table: Option<Tensor<2>>,
    pub sinks: Option<Tensor<1>>,
}

/// Sizes and scale of one call: query `[B, H, Tq, Dk]`, key `[B, Hkv, Tk, Dk]`, value
/// `[B, Hkv, Tk, Dv]`.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub queries: usize,
    pub keys: usize,
    pub d_k: usize,
    pub d_v: usize,
    pub scale: f64,
    pub softcap: Option<f64>,
}

impl Sizes {
    pub fn query(&self) -> [usize; 4] {
        [self.batch, self.heads, self.queries, self.d_k]
    }

    pub fn key(&self) -> [usize; 4] {
        [self.batch, self.kv_heads, self.keys, self.d_k]
    }

    pub fn value(&self) -> [usize; 4] {
        [self.batch, self.kv_heads, self.keys, self.d_v]
    }

    pub fn output(&self) -> [usize; 4] {
        [self.batch, self.heads, self.queries, self.d_v]
    }
}

/// The reference's results, row-major in the shapes of the tensors they stand for.
pub struct Reference {
    pub output: Vec<f64>,
    /// `[B, H, Tq, Tk]`.
    pub weights: Vec<f64>,
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
    /// In the bias's own shape, summed over the axes it broadcasts along.
    pub dbias: Option<Vec<f64>>,
    /// `[H, buckets]`, for a learned table.
    pub dtable: Option<Vec<f64>>,
    /// `[H]`, for sinks.
    pub dsinks: Option<Vec<f64>>,
}

/// Row `at` of `len` values.
fn row(data: &[f64], at: usize, len: usize) -> &[f64] {
    &data[at * len..(at + 1) * len]
}

/// Attention over `q`, `k`, `v` (row-major f32) under `mask`, and the gradients of
/// `sum(output * grad)`.
pub fn attention(s: Sizes, mask: &MaskSpec, [q, k, v, grad]: [&[f32]; 4]) -> Reference {
    let group = s.heads / s.kv_heads.max(1);
    let mut r = Reference {
        output: vec![0.0; s.output().iter().product()],
        weights: vec![0.0; s.batch * s.heads * s.queries * s.keys],
        dq: vec![0.0; q.len()],
        dk: vec![0.0; k.len()],
        dv: vec![0.0; v.len()],
        dbias: mask.bias.as_ref().map(|b| vec![0.0; b.values.len()]),
        dtable: match &mask.position {
            Some(Position::Table(table, _)) => Some(vec![0.0; table.len()]),
            _ => None,
        },
        dsinks: mask.sinks.as_ref().map(|z| vec![0.0; z.len()]),
    };
    let [q, k, v, grad] = [q, k, v, grad].map(|x| x.iter().map(|&x| x as f64).collect::<Vec<_>>());
    for b in 0..s.batch {
        for h in 0..s.heads {
            let kvh = b * s.kv_heads + h / group;
            for i in 0..s.queries {
                let qi_at = (b * s.heads + h) * s.queries + i;
                let qi = row(&q, qi_at, s.d_k);
                // The keys of the softmax and their scores.
                let mut scores: Vec<(usize, f64, f64)> = Vec::new();
                for j in 0..s.keys {
                    let at = [b, h, i, j];
                    let hidden = mask.hides(&s, b, i, j);
                    let blocked = mask.blocked.as_ref().is_some_and(|m| m.at(at));
                    let bias = mask.bias.as_ref().map_or(0.0, |m| m.at(at) as f64);
                    if hidden || blocked || bias == f64::NEG_INFINITY {
                        continue;
                    }
                    let kj = row(&k, kvh * s.keys + j, s.d_k);
                    let dot: f64 = qi.iter().zip(kj).map(|(a, b)| a * b).sum();
                    let (score, slope) = match s.softcap {
                        Some(cap) => {
                            let t = (dot * s.scale / cap).tanh();
                            (cap * t, 1.0 - t * t)
                        }
                        None => (dot * s.scale, 1.0),
                    };
                    let by_position = mask.by_position(&s, h, i, j).0;
                    scores.push((j, score + bias + by_position, slope));
                }
                if scores.is_empty() {
                    continue;
                }
                let sink = mask.sinks.as_ref().map(|z| z[h] as f64);
                let max = scores
                    .iter()
                    .map(|x| x.1)
                    .chain(sink)
                    .fold(f64::NEG_INFINITY, f64::max);
                let sink = sink.map_or(0.0, |z| (z - max).exp());
                let sum: f64 = sink + scores.iter().map(|x| (x.1 - max).exp()).sum::<f64>();
                let p: Vec<(usize, f64, f64)> = scores
                    .iter()
                    .map(|&(j, x, slope)| (j, (x - max).exp() / sum, slope))
                    .collect();
                let out_at = qi_at * s.d_v;
                for &(j, pj, _) in &p {
                    r.weights[qi_at * s.keys + j] = pj;
                    let vj = row(&v, kvh * s.keys + j, s.d_v);
                    for (c, x) in vj.iter().enumerate() {
                        r.output[out_at + c] += pj * x;
                    }
                }
                // Backward: dP = dO Vᵀ, dS = P (dP - rowsum(dO O)).
                let go = row(&grad, qi_at, s.d_v);
                let row_dot: f64 = (0..s.d_v).map(|c| go[c] * r.output[out_at + c]).sum();
                if let Some(dsinks) = r.dsinks.as_mut() {
                    dsinks[h] -= sink / sum * row_dot;
                }
                for &(j, pj, slope) in &p {
                    let vj = row(&v, kvh * s.keys + j, s.d_v);
                    let kj = row(&k, kvh * s.keys + j, s.d_k);
                    let dp: f64 = go.iter().zip(vj).map(|(a, b)| a * b).sum();
                    let ds = pj * (dp - row_dot);
                    if let (Some(dbias), Some(part)) = (r.dbias.as_mut(), mask.bias.as_ref()) {
                        dbias[part.index([b, h, i, j])] += ds;
                    }
                    if let (Some(dtable), (_, Some(at))) =
                        (r.dtable.as_mut(), mask.by_position(&s, h, i, j))
                    {
                        dtable[at] += ds;
                    }
                    // Through the soft cap to the raw score.
                    let ds = ds * slope;
                    for c in 0..s.d_k {
                        r.dq[qi_at * s.d_k + c] += ds * s.scale * kj[c];
                        r.dk[(kvh * s.keys + j) * s.d_k + c] += ds * s.scale * qi[c];
                    }
                    let dv = &mut r.dv[(kvh * s.keys + j) * s.d_v..][..s.d_v];
                    for (d, g) in dv.iter_mut().zip(go) {
                        *d += pj * g;
                    }
                }
            }
        }
    }
    r
}
