//! The tiles against attention computed in f64 from the same inputs: outputs,
//! log-sum-exps and every gradient, on every instruction set this CPU runs.

use super::backward::backward_on;
use super::forward::forward_on;
use super::{Dims, Extra, Grid, Positional, Scoring};
use crate::cpu::testing::{isas_under_test, random};
use crate::mask::{AttentionMask, BLOCKED, CausalAlignment, DEAD_LSE, DEAD_ROW};
use crate::positions::Buckets;

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
    scoring: Scoring,
    /// The bias by position: ALiBi's slopes, or a learned table `[H, columns]`.
    position: Option<Position>,
}

/// A bias by position of a test case.
#[derive(Clone, Debug)]
enum Position {
    Alibi(Vec<f32>),
    Table(Vec<f32>, Buckets),
}

fn dense<T>(data: &[T], [_, h, t, d]: [usize; 4]) -> Grid<'_, T> {
    Grid {
        data,
        offset: 0,
        strides: [h * t * d, t * d, d, 1],
    }
}

impl Case {
    fn new(
        [queries, keys, kv_heads]: [usize; 3],
        mask: &AttentionMask,
        softcap: Option<f32>,
        buckets: Option<Option<Buckets>>,
    ) -> Self {
        let (batch, heads, d_k, d_v) = (2, 4, 20, 12);
        let dims = Dims {
            batch,
            heads,
            kv_heads,
            queries,
            keys,
            d_k,
            d_v,
        };
        let mut blocked: Vec<u8> = random(batch * queries * keys, 5)
            .iter()
            .map(|&x| (x > 0.8) as u8)
            .collect();
        blocked[3 * keys..4 * keys].fill(1); // Query 3 of batch 0 sees no key.
        let visibility = mask.visibility(queries, keys);
        let position = buckets.map(|buckets| match buckets {
            None => Position::Alibi(crate::positions::alibi_slopes(heads)),
            Some(buckets) => Position::Table(random(heads * buckets.len(), 7), buckets),
        });
        Self {
            dims,
            q: random(batch * heads * queries * d_k, 1),
            k: random(batch * kv_heads * keys * d_k, 2),
            v: random(batch * kv_heads * keys * d_v, 3),
            grad: random(batch * heads * queries * d_v, 4),
            bias: random(heads * keys, 6),
            blocked,
            scoring: Scoring {
                scale: 0.3,
                softcap,
                visibility: visibility.clone(),
                position: position.as_ref().map(|p| match p {
                    Position::Alibi(slopes) => Positional::alibi(slopes.clone(), &visibility),
                    Position::Table(_, buckets) => Positional::learned(*buckets, &visibility),
                }),
            },
            position,
        }
    }

    /// The bias by position of query `i`, key `j`, head `h`, and the table entry it reads.
    fn position_bias(&self, h: usize, i: usize, j: usize) -> (f64, Option<usize>) {
        let distance = j as i64 - (i as i64 + self.scoring.visibility.offset);
        match &self.position {
            None => (0.0, None),
            Some(Position::Alibi(slopes)) => (-(slopes[h] as f64) * distance.abs() as f64, None),
            Some(Position::Table(table, buckets)) => {
                let at = h * buckets.len() + buckets.of(distance);
                (table[at] as f64, Some(at))
            }
        }
    }

    fn extra(&self) -> Extra<'_> {
        let Dims { queries, keys, .. } = self.dims;
        Extra {
            scoring: &self.scoring,
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
            table: match &self.position {
                Some(Position::Table(table, buckets)) => Some(Grid {
                    data: table,
                    offset: 0,
                    strides: [0, 0, buckets.len(), 1],
                }),
                _ => None,
            },
        }
    }

    /// `[output, lse, dq, dk, dv, dbias, dtable]` in f64, laid out `[B, H, T, D]` (the bias
    /// `[H, Tk]`, the table `[H, columns]`).
    fn reference(&self) -> [Vec<f64>; 7] {
        let d = self.dims;
        let (dk_, dv_) = (d.d_k, d.d_v);
        let mut out = vec![0.0; d.batch * d.heads * d.queries * dv_];
        let mut lse = vec![DEAD_LSE as f64; d.batch * d.heads * d.queries];
        let mut dq = vec![0.0; d.batch * d.heads * d.queries * dk_];
        let mut dk = vec![0.0; d.batch * d.kv_heads * d.keys * dk_];
        let mut dv = vec![0.0; d.batch * d.kv_heads * d.keys * dv_];
        let mut dbias = vec![0.0; d.heads * d.keys];
        let mut dtable = vec![0.0; self.table_len()];
        for b in 0..d.batch {
            for h in 0..d.heads {
                let bh = b * d.heads + h;
                let bkv = b * d.kv_heads + h / d.group(); // The key/value head.
                for i in 0..d.queries {
                    let qi = &self.q[(bh * d.queries + i) * dk_..][..dk_];
                    let keys = self.scoring.visibility.keys_of(b, i);
                    // The scores of the visible keys, and the soft cap's slope at each.
                    let (scores, slopes): (Vec<f64>, Vec<f64>) = keys
                        .clone()
                        .map(|j| {
                            let kj = &self.k[(bkv * d.keys + j) * dk_..][..dk_];
                            let dot: f64 =
                                qi.iter().zip(kj).map(|(&a, &b)| a as f64 * b as f64).sum();
                            let raw = dot * self.scoring.scale as f64;
                            let (capped, slope) = match self.scoring.softcap {
                                Some(cap) => {
                                    let t = (raw / cap as f64).tanh();
                                    (cap as f64 * t, 1.0 - t * t)
                                }
                                None => (raw, 1.0),
                            };
                            let by_position = self.position_bias(h, i, j).0;
                            match self.blocked[(b * d.queries + i) * d.keys + j] {
                                0 => (
                                    capped + self.bias[h * d.keys + j] as f64 + by_position,
                                    slope,
                                ),
                                _ => (BLOCKED as f64, slope),
                            }
                        })
                        .unzip();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    if keys.is_empty() || max <= DEAD_ROW as f64 {
                        continue;
                    }
                    let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
                    lse[bh * d.queries + i] = max + sum.ln();
                    let p: Vec<f64> = scores.iter().map(|s| (s - max).exp() / sum).collect();
                    let row = (bh * d.queries + i) * dv_;
                    for (&pj, j) in p.iter().zip(keys.clone()) {
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
                    for ((&pj, &slope), j) in p.iter().zip(&slopes).zip(keys.clone()) {
                        let vj = &self.v[(bkv * d.keys + j) * dv_..][..dv_];
                        let dp: f64 = go.iter().zip(vj).map(|(&g, &v)| g as f64 * v as f64).sum();
                        dbias[h * d.keys + j] += pj * (dp - row_dot);
                        if let (_, Some(at)) = self.position_bias(h, i, j) {
                            dtable[at] += pj * (dp - row_dot);
                        }
                        let ds = pj * (dp - row_dot) * slope * self.scoring.scale as f64;
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
        [out, lse, dq, dk, dv, dbias, dtable]
    }

    /// The entries of the learned table, if any.
    fn table_len(&self) -> usize {
        match &self.position {
            Some(Position::Table(table, _)) => table.len(),
            _ => 0,
        }
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
    let isas = isas_under_test("tiles_match_f64_attention_forward_and_backward");
    // Partial tiles; causal with more keys than queries, with fewer (the first 20
    // queries see no key), and not causal; sliding and local windows narrower than a
    // tile, with a soft cap; packed sequences across tile edges; 2 query heads per
    // key/value head, and 1.
    let causal = AttentionMask::causal();
    let sliding = AttentionMask::sliding_window(40);
    let local = AttentionMask::local(30).aligned(CausalAlignment::TopLeft);
    let packed = AttentionMask::packed(&[vec![0, 50, 61, 140], vec![0, 130]]).and(causal.clone());
    // Biases by position: ALiBi, T5's buckets, clipped offsets.
    let t5 = Buckets::T5 {
        num_buckets: 16,
        max_distance: 40,
        bidirectional: true,
    };
    let clipped = Buckets::Clipped { max: 20 };
    let alibi = Some(None);
    let cases = [
        ("causal", [150, 170, 2], causal.clone(), None, None),
        ("causal, ALiBi", [150, 130, 4], causal, None, alibi),
        (
            "no rule, T5",
            [70, 90, 2],
            AttentionMask::none(),
            None,
            Some(Some(t5)),
        ),
        (
            "sliding 40, softcap 5",
            [150, 200, 2],
            sliding,
            Some(5.0),
            None,
        ),
        (
            "local 30, softcap 2, clipped",
            [150, 150, 4],
            local,
            Some(2.0),
            Some(Some(clipped)),
        ),
        ("packed causal, ALiBi", [150, 150, 2], packed, None, alibi),
    ];
    for (what, sizes, mask, softcap, position) in cases {
        let [queries, keys, kv_heads] = sizes;
        let case = Case::new(sizes, &mask, softcap, position);
        let name = format!("{what}, Tq {queries} Tk {keys} Hkv {kv_heads}");
        let d = case.dims;
        let [out, lse, dq, dk, dv, dbias, dtable] = case.reference();
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
            let name = format!("{isa:?} {name}");
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
                let table_shape =
                    (case.table_len() > 0).then_some([1, 1, d.heads, case.table_len() / d.heads]);
                let extra = case.extra();
                let wanted = [bias_shape, table_shape];
                let grads =
                    backward_on(isa, threads, d, inputs, &got_lse, extra, [true; 3], wanted);
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
                if let Some([_, _, h, c]) = table_shape {
                    let got_table = grads.table.expect("the table's gradient");
                    assert_close(
                        &format!("{name}: dtable"),
                        &got_table,
                        &dtable,
                        [1, 1, h, c],
                    );
                }
            }
        }
    }
}

/// Forward and backward passes at the text task's size (12 sequences of 64 positions, 4
/// heads of 32, causal), on one thread: microseconds per call. Run with `cargo test
/// --release -p mha --lib attention_speed -- --ignored --nocapture`.
#[test]
#[ignore = "a measurement, for release builds"]
fn attention_speed() {
    use crate::cpu::isa::Isa;
    let (batch, heads, t, d) = (12, 4, 64, 32);
    let dims = Dims {
        batch,
        heads,
        kv_heads: heads,
        queries: t,
        keys: t,
        d_k: d,
        d_v: d,
    };
    let scoring = Scoring {
        scale: 1.0 / (d as f32).sqrt(),
        softcap: None,
        visibility: AttentionMask::causal().visibility(t, t),
        position: None,
    };
    let extra = || Extra {
        scoring: &scoring,
        bias: None,
        blocked: None,
        table: None,
    };
    let shape = [batch, heads, t, d];
    let (q, k, v, g) = (
        random(batch * heads * t * d, 1),
        random(batch * heads * t * d, 2),
        random(batch * heads * t * d, 3),
        random(batch * heads * t * d, 4),
    );
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    pool.install(|| {
        let isa = Isa::best();
        let forward = || {
            let [q, k, v] = [&q, &k, &v].map(|x| dense(x, shape));
            forward_on(isa, dims, q, k, v, extra())
        };
        let (out, lse) = forward();
        // The output comes `[B, T, H, D]`.
        let out_grid = Grid {
            data: &out[..],
            offset: 0,
            strides: [t * heads * d, d, heads * d, 1],
        };
        let reps = 200;
        for _ in 0..3 {
            let start = std::time::Instant::now();
            for _ in 0..reps {
                std::hint::black_box(forward());
            }
            let fwd = start.elapsed().as_secs_f64() / reps as f64;
            let start = std::time::Instant::now();
            for _ in 0..reps {
                let inputs = [
                    dense(&q, shape),
                    dense(&k, shape),
                    dense(&v, shape),
                    out_grid,
                    dense(&g, shape),
                ];
                let r = backward_on(isa, 1, dims, inputs, &lse, extra(), [true; 3], [None, None]);
                std::hint::black_box(r.dq);
            }
            let bwd = start.elapsed().as_secs_f64() / reps as f64;
            println!(
                "{isa:?}: forward {:.1} us, backward {:.1} us",
                fwd * 1e6,
                bwd * 1e6
            );
        }
    });
}
