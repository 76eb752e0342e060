//! Every attention path against attention computed in f64 (`reference.rs`), on every
//! backend compiled in: the CPU tiles (flex and ndarray in f32, without weights), the
//! GPU kernels (wgpu, without weights), the explicit path (with weights, in other
//! dtypes) in one pass and in
//! query chunks, with and without autodiff: outputs, weights and the gradients of the
//! query, key, value and bias.

use burn::tensor::{Device, FloatDType, Tensor, TensorData, bf16, f16};
use mha::positions::alibi_slopes;
use mha::{AttentionWeights, Buckets, SdpaOptions, scaled_dot_product_attention};

use crate::reference::{MaskSpec, Part, Position, Reference, Rule, Sizes, attention};
use crate::util::{Backend, SplitMix, backends, to_vec};

/// One attention call: sizes, scale and mask.
struct Case {
    name: String,
    sizes: Sizes,
    mask: MaskSpec,
}

/// `[B, H, Hkv, Tq, Tk, Dk, Dv]` with the default scale.
fn sizes([batch, heads, kv_heads, queries, keys, d_k, d_v]: [usize; 7]) -> Sizes {
    Sizes {
        batch,
        heads,
        kv_heads,
        queries,
        keys,
        d_k,
        d_v,
        scale: 1.0 / (d_k as f64).sqrt(),
        softcap: None,
    }
}

/// Seeded values: `true` with probability `p`.
fn pattern(len: usize, p: f32, seed: u64) -> Vec<bool> {
    let mut rng = SplitMix(seed);
    (0..len).map(|_| rng.uniform() < p).collect()
}

/// Seeded normal values.
fn normal(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = SplitMix(seed);
    (0..len).map(|_| rng.normal()).collect()
}

/// Key padding `[B, 1, 1, Tk]` from the valid lengths.
fn padding(lengths: &[usize], keys: usize) -> Part<bool> {
    Part {
        values: lengths
            .iter()
            .flat_map(|&len| (0..keys).map(move |j| j >= len))
            .collect(),
        dims: [lengths.len(), 1, 1, keys],
    }
}

/// The small cases: every mask kind and broadcast shape, GQA, MQA, `Tq != Tk`, `Dk != Dv`,
/// a custom scale, rows that see no key.
fn small_cases() -> Vec<Case> {
    let case = |name: &str, dims, mask| Case {
        name: name.into(),
        sizes: sizes(dims),
        mask,
    };
    let causal = MaskSpec::causal();
    let blocked = |dims: [usize; 4], seed| Part {
        values: pattern(dims.iter().product(), 0.33, seed),
        dims,
    };
    let bias = |dims: [usize; 4], seed| Part {
        values: normal(dims.iter().product(), seed),
        dims,
    };
    // Rows 1 (boolean mask) and 3 (-inf bias) of batch 0 see no key.
    let mut dead = vec![false; 2 * 5 * 5];
    dead[5..10].fill(true);
    let mut dead_bias = vec![0.0f32; 2 * 5 * 5];
    dead_bias[15..20].fill(f32::NEG_INFINITY);
    let mut scaled = case("custom scale", [2, 4, 4, 5, 6, 8, 8], MaskSpec::default());
    scaled.sizes.scale = 0.7;
    let mut all = case(
        "causal + padding + bias, GQA",
        [2, 4, 2, 6, 6, 8, 8],
        MaskSpec {
            blocked: Some(padding(&[6, 4], 6)),
            bias: Some(bias([1, 1, 6, 6], 4)),
            ..MaskSpec::causal()
        },
    );
    all.sizes.scale = 0.2;
    [
        vec![
            case("none", [2, 4, 4, 6, 6, 8, 8], MaskSpec::default()),
            case("causal square", [2, 4, 4, 6, 6, 8, 8], causal.clone()),
            case("causal Tq < Tk", [2, 4, 4, 3, 9, 8, 8], causal.clone()),
            case("causal Tq > Tk", [2, 4, 4, 7, 4, 8, 8], causal.clone()),
            // Heads wider than the GPU kernels' tiles hold in a device's shared memory.
            case(
                "causal, heads 256 wide",
                [1, 2, 1, 5, 7, 256, 256],
                causal.clone(),
            ),
            case(
                "heads 160 wide, values 320",
                [1, 1, 1, 3, 9, 160, 320],
                MaskSpec::default(),
            ),
            case(
                "padding [B, 1, 1, Tk]",
                [2, 4, 4, 5, 7, 8, 8],
                MaskSpec {
                    blocked: Some(padding(&[7, 3], 7)),
                    ..MaskSpec::default()
                },
            ),
            case(
                "boolean [1, 1, Tq, Tk]",
                [2, 4, 4, 5, 7, 8, 8],
                MaskSpec {
                    blocked: Some(blocked([1, 1, 5, 7], 1)),
                    ..MaskSpec::default()
                },
            ),
            case(
                "boolean [B, 1, Tq, Tk]",
                [2, 4, 4, 5, 5, 8, 8],
                MaskSpec {
                    blocked: Some(blocked([2, 1, 5, 5], 2)),
                    ..MaskSpec::default()
                },
            ),
            case(
                "bias [1, H, Tq, Tk]",
                [2, 4, 4, 5, 6, 8, 8],
                MaskSpec {
                    bias: Some(bias([1, 4, 5, 6], 3)),
                    ..MaskSpec::default()
                },
            ),
            scaled,
            case("GQA causal", [2, 4, 2, 6, 6, 8, 8], causal.clone()),
            case(
                "MQA padding",
                [2, 4, 1, 6, 8, 8, 8],
                MaskSpec {
                    blocked: Some(padding(&[8, 2], 8)),
                    ..MaskSpec::default()
                },
            ),
            all,
            case(
                "sinks, GQA causal",
                [2, 4, 2, 6, 6, 8, 8],
                MaskSpec {
                    sinks: Some(vec![-1.0, 0.0, 0.5, 2.0]),
                    ..MaskSpec::causal()
                },
            ),
            case(
                "sinks, bias and rows without a key",
                [2, 2, 2, 5, 5, 4, 4],
                MaskSpec {
                    blocked: Some(Part {
                        values: dead.clone(),
                        dims: [2, 1, 5, 5],
                    }),
                    bias: Some(bias([1, 2, 5, 5], 5)),
                    sinks: Some(vec![1.0, f32::NEG_INFINITY]),
                    ..MaskSpec::default()
                },
            ),
            case("Dk != Dv, causal", [2, 4, 2, 6, 6, 8, 5], causal),
            case(
                "rows without a key (boolean and -inf bias)",
                [2, 2, 2, 5, 5, 4, 4],
                MaskSpec {
                    blocked: Some(Part {
                        values: dead,
                        dims: [2, 1, 5, 5],
                    }),
                    bias: Some(Part {
                        values: dead_bias,
                        dims: [2, 1, 5, 5],
                    }),
                    ..MaskSpec::default()
                },
            ),
        ],
        windows_and_packing(),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// Masks by position beyond the causal part, and soft caps.
fn windows_and_packing() -> Vec<Case> {
    let case = |name: &str, dims, mask, softcap| {
        let mut sizes = sizes(dims);
        sizes.softcap = softcap;
        Case {
            name: name.into(),
            sizes,
            mask,
        }
    };
    let rule = |rule, top_left| MaskSpec {
        rule,
        top_left,
        ..MaskSpec::default()
    };
    vec![
        case(
            "causal top-left, Tq < Tk",
            [2, 4, 2, 4, 9, 8, 8],
            rule(Rule::Causal, true),
            None,
        ),
        case(
            "causal top-left, Tq > Tk",
            [2, 4, 2, 7, 4, 8, 8],
            rule(Rule::Causal, true),
            None,
        ),
        case(
            "sliding window 3, Tq < Tk",
            [2, 4, 2, 5, 9, 8, 8],
            rule(Rule::Sliding(3), false),
            None,
        ),
        case(
            "local 2, top-left",
            [2, 4, 4, 7, 5, 8, 8],
            rule(Rule::Local(2), true),
            None,
        ),
        case(
            "soft cap 1.5 with a bias",
            [2, 4, 2, 6, 6, 8, 8],
            MaskSpec {
                bias: Some(Part {
                    values: normal(6 * 6, 31),
                    dims: [1, 1, 6, 6],
                }),
                ..MaskSpec::causal()
            },
            Some(1.5),
        ),
        case(
            "packed causal, padding past the last sequence",
            [2, 4, 2, 9, 9, 8, 8],
            MaskSpec {
                packed: Some(vec![vec![0, 3, 4, 9], vec![0, 2, 7]]),
                ..MaskSpec::causal()
            },
            None,
        ),
        case(
            "packed, not causal",
            [2, 4, 4, 6, 6, 8, 8],
            MaskSpec {
                packed: Some(vec![vec![0, 4, 6], vec![0, 1, 6]]),
                ..MaskSpec::default()
            },
            None,
        ),
        case(
            "ALiBi, causal, GQA, Tq < Tk",
            [2, 4, 2, 5, 9, 8, 8],
            MaskSpec {
                position: Some(Position::Alibi(alibi_slopes(4))),
                ..MaskSpec::causal()
            },
            None,
        ),
        case(
            "T5 buckets, bidirectional, padding, bias",
            [2, 4, 4, 6, 7, 8, 8],
            MaskSpec {
                position: Some(table(4, t5(true), 41)),
                blocked: Some(padding(&[7, 4], 7)),
                bias: Some(Part {
                    values: normal(7, 42),
                    dims: [1, 1, 1, 7],
                }),
                ..MaskSpec::default()
            },
            None,
        ),
        case(
            "clipped offsets, sliding window 3, soft cap 2",
            [2, 4, 2, 8, 8, 8, 8],
            MaskSpec {
                rule: Rule::Sliding(3),
                position: Some(table(4, Buckets::Clipped { max: 2 }, 43)),
                ..MaskSpec::default()
            },
            Some(2.0),
        ),
        // Query and key head dim 128 in f32: the GPU's dQ kernel takes tiles of 16 or
        // 32 queries and 32 or 16 keys on 32 units, fewer than a tile's 47 diagonals,
        // whose table gradients it sums (the diagonals past the units were left out).
        case(
            "T5 buckets, causal, head dims 128/8",
            [1, 2, 2, 40, 40, 128, 8],
            MaskSpec {
                position: Some(table(2, t5(false), 46)),
                ..MaskSpec::causal()
            },
            None,
        ),
    ]
}

/// T5's buckets at test scale: 8 of them up to distance 20.
fn t5(bidirectional: bool) -> Buckets {
    Buckets::T5 {
        num_buckets: 8,
        max_distance: 20,
        bidirectional,
    }
}

/// A learned table of `heads` rows for `buckets`, seeded.
fn table(heads: usize, buckets: Buckets, seed: u64) -> Position {
    Position::Table(normal(heads * buckets.len(), seed), buckets)
}

/// Long cases: several tiles, query chunks, causal with more and with fewer keys than
/// queries, biases that want a gradient, rows without a key.
fn long_cases() -> Vec<Case> {
    let mut cases = Vec::new();
    for (tq, tk) in [(300, 340), (300, 260), (40, 56), (280, 280)] {
        let dims = [2, 4, 2, tq, tk, 8, 8];
        let pad = || Some(padding(&[tk, tk - tk / 6], tk));
        // A bias over every query and key with a blocked (-inf) key per row.
        let mut full = normal(tq * tk, 7);
        for (row, values) in full.chunks_mut(tk).enumerate() {
            values.iter_mut().for_each(|x| *x *= 0.5);
            values[row % tk] = f32::NEG_INFINITY;
        }
        // Key padding, a third of the pairs blocked, and every key of query rows 3 and 5.
        let padded_pattern = |tk: usize| {
            let pad = padding(&[tk, tk - tk / 6], tk).values;
            let blocked = pattern(tq * tk, 0.33, 11);
            let values = (0..2 * tq * tk).map(|at| {
                let (b, i, j) = (at / (tq * tk), at / tk % tq, at % tk);
                pad[b * tk + j] || blocked[i * tk + j] || i == 3 || i == 5
            });
            Part {
                values: values.collect(),
                dims: [2, 1, tq, tk],
            }
        };
        let masks = [
            ("causal", true, None, None),
            ("causal + padding", true, pad(), None),
            (
                "causal + padding + bias",
                true,
                pad(),
                Some(Part {
                    values: full,
                    dims: [1, 1, tq, tk],
                }),
            ),
            ("padding + boolean", false, Some(padded_pattern(tk)), None),
            (
                "bias per head and key",
                false,
                None,
                Some(Part {
                    values: normal(4 * tk, 8).iter().map(|x| x * 0.5).collect(),
                    dims: [1, 4, 1, tk],
                }),
            ),
        ];
        for (name, causal, blocked, bias) in masks {
            cases.push(Case {
                name: format!("{name}, Tq {tq}, Tk {tk}"),
                sizes: sizes(dims),
                mask: MaskSpec {
                    rule: if causal { Rule::Causal } else { Rule::None },
                    blocked,
                    bias,
                    ..MaskSpec::default()
                },
            });
        }
        // Bands and packed sequences across tiles and chunks, with a soft cap.
        let mut window = sizes(dims);
        window.softcap = Some(3.0);
        cases.push(Case {
            name: format!("sliding window 70, soft cap 3, Tq {tq}, Tk {tk}"),
            sizes: window,
            mask: MaskSpec {
                rule: Rule::Sliding(70),
                blocked: pad(),
                ..MaskSpec::default()
            },
        });
        if (tq, tk) == (300, 260) {
            // Sinks over tiles and chunks, with padding and a window.
            cases.push(Case {
                name: format!("sinks, sliding window 70, padding, Tq {tq}, Tk {tk}"),
                sizes: sizes(dims),
                mask: MaskSpec {
                    rule: Rule::Sliding(70),
                    blocked: pad(),
                    sinks: Some(vec![3.0, -2.0, 0.0, 6.0]),
                    ..MaskSpec::default()
                },
            });
        }
        cases.push(Case {
            name: format!("local 50 top-left, Tq {tq}, Tk {tk}"),
            sizes: sizes(dims),
            mask: MaskSpec {
                rule: Rule::Local(50),
                top_left: true,
                ..MaskSpec::default()
            },
        });
        if tq == tk {
            cases.push(Case {
                name: format!("packed causal, ALiBi, T {tq}"),
                sizes: sizes(dims),
                mask: MaskSpec {
                    packed: Some(vec![vec![0, tq / 3, tq / 3 + 1, tq - 5], vec![0, tq]]),
                    position: Some(Position::Alibi(alibi_slopes(4))),
                    ..MaskSpec::causal()
                },
            });
        }
        cases.push(Case {
            name: format!("causal T5 buckets, Tq {tq}, Tk {tk}"),
            sizes: sizes(dims),
            mask: MaskSpec {
                position: Some(table(4, t5(false), 44)),
                ..MaskSpec::causal()
            },
        });
    }
    // Rows of 2048 keys at head dim 128: past the 65,535 loop iterations after which
    // lavapipe silently stops a kernel that walks every key and head dim in one
    // invocation; a bias per key with its gradient.
    cases.push(Case {
        name: "2048 keys at head dim 128, causal, padding, bias per key".into(),
        sizes: sizes([2, 2, 1, 24, 2048, 128, 128]),
        mask: MaskSpec {
            blocked: Some(padding(&[2048, 1900], 2048)),
            bias: Some(Part {
                values: normal(2 * 2048, 9).iter().map(|x| x * 0.5).collect(),
                dims: [1, 2, 1, 2048],
            }),
            ..MaskSpec::causal()
        },
    });
    // A learned table whose buckets each sum more scores than one unit of the GPU's
    // gradient sums takes (2 x 1100 rows per distance): the sums split and reduced.
    cases.push(Case {
        name: "causal T5 buckets, T 1100".into(),
        sizes: sizes([2, 2, 2, 1100, 1100, 8, 8]),
        mask: MaskSpec {
            position: Some(table(2, t5(false), 45)),
            ..MaskSpec::causal()
        },
    });
    cases
}

/// `values` as a tensor of `dims` on `device`, in `dtype`.
fn tensor(values: &[f32], dims: [usize; 4], device: &Device, dtype: FloatDType) -> Tensor<4> {
    Tensor::<4>::from_data(TensorData::new(values.to_vec(), dims), device).cast(dtype)
}

/// Asserts `|got - want| <= atol + rtol·|want|` everywhere, printing the worst error.
fn close<const D: usize>(what: &str, got: Tensor<D>, want: &[f64], [atol, rtol]: [f64; 2]) {
    // Read in f64, which holds every dtype's values exactly (f32 hid f64's digits).
    let got = got
        .into_data()
        .convert::<f64>()
        .try_into_vec::<f64>()
        .unwrap();
    assert_eq!(got.len(), want.len(), "{what}: sizes differ");
    let mut worst = (0.0f64, 0);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}: element {i} is {g}");
        let excess = (g - w).abs() - rtol * w.abs();
        if excess > worst.0 {
            worst = (excess, i);
        }
    }
    let (excess, i) = worst;
    println!("{what}: worst error beyond rtol·|want| {excess:.2e} (atol {atol:.0e})");
    assert!(
        excess <= atol,
        "{what}: element {i} is {}, want {} (atol {atol:e}, rtol {rtol:e})",
        got[i],
        want[i]
    );
}

/// Runs `case` on `be` in `dtype` with and without autodiff, with `weights`, and compares
/// the output, the weights and the gradients with `want`.
fn check(
    be: &Backend,
    case: &Case,
    want: &Reference,
    [q, k, v, grad]: &[Vec<f32>; 4],
    dtype: FloatDType,
    weights: AttentionWeights,
) {
    let s = case.sizes;
    let [forward_tol, grad_tol] = be.tolerances(dtype);
    let options = SdpaOptions {
        scale: Some(s.scale),
        weights,
        softcap: s.softcap,
        ..SdpaOptions::default()
    };
    let what = format!("[{} {dtype:?}] {} ({weights:?})", be.name, case.name);
    let device = &be.device;
    let mask = case.mask.build(device, dtype, false).mask;
    let out = scaled_dot_product_attention(
        tensor(q, s.query(), device, dtype),
        tensor(k, s.key(), device, dtype),
        tensor(v, s.value(), device, dtype),
        &mask,
        options,
    );
    close(
        &format!("{what}: output"),
        out.context,
        &want.output,
        forward_tol,
    );
    if let Some(weights) = crate::util::asked_weights(&what, options.weights, out.weights) {
        close(
            &format!("{what}: weights"),
            weights,
            &want.weights,
            forward_tol,
        );
    }

    // The relative rounding of a gradient summed over many scores: f32's (f64's).
    let summed = match dtype {
        FloatDType::F64 => 1e-12,
        _ => 1e-5,
    };
    let device = &be.autodiff();
    let built = case.mask.build(device, dtype, true);
    let (mask, bias, table, sinks) = (built.mask, built.bias, built.table, built.sinks);
    let [q, k, v] = [(q, s.query()), (k, s.key()), (v, s.value())]
        .map(|(x, dims)| tensor(x, dims, device, dtype).require_grad());
    let out = scaled_dot_product_attention(q.clone(), k.clone(), v.clone(), &mask, options);
    let grads = (out.context.clone() * tensor(grad, s.output(), device, dtype))
        .sum()
        .backward();
    close(
        &format!("{what}: output under autodiff"),
        out.context,
        &want.output,
        forward_tol,
    );
    for (name, x, want) in [("q", q, &want.dq), ("k", k, &want.dk), ("v", v, &want.dv)] {
        let got = x
            .grad(&grads)
            .unwrap_or_else(|| panic!("{what}: no gradient of {name}"));
        close(&format!("{what}: d{name}"), got, want, grad_tol);
    }
    if let (Some(bias), Some(want)) = (bias, &want.dbias) {
        let got = bias
            .grad(&grads)
            .unwrap_or_else(|| panic!("{what}: no gradient of the bias"));
        close(&format!("{what}: dbias"), got, want, grad_tol);
    }
    if let (Some(table), Some(want)) = (table, &want.dtable) {
        let got = table
            .grad(&grads)
            .unwrap_or_else(|| panic!("{what}: no gradient of the table"));
        // A bucket's gradient sums every score of its distances (tens of thousands in the
        // long cases): beside the gradients' atol, an rtol of the accumulated rounding.
        let [atol, rtol] = grad_tol;
        let tol = [atol, rtol.max(summed)];
        close(&format!("{what}: dtable"), got, want, tol);
    }
    if let (Some(sinks), Some(want)) = (sinks, &want.dsinks) {
        let got = sinks
            .grad(&grads)
            .unwrap_or_else(|| panic!("{what}: no gradient of the sinks"));
        // Each sums a column over every row of its head, as a bucket does.
        let [atol, rtol] = grad_tol;
        close(
            &format!("{what}: dsinks"),
            got,
            want,
            [atol, rtol.max(summed)],
        );
    }
}

/// Every case in f32 with and without weights (the fast path and the explicit one).
fn check_cases(cases: Vec<Case>) {
    for (n, case) in cases.iter().enumerate() {
        let s = case.sizes;
        let seed = 100 + 5 * n as u64;
        let inputs = [s.query(), s.key(), s.value(), s.output()].map(|dims| {
            normal(
                dims.iter().product(),
                seed + dims[2] as u64 + dims[3] as u64,
            )
        });
        let [q, k, v, grad] = &inputs;
        let want = attention(s, &case.mask, [q, k, v, grad]);
        for be in backends() {
            for weights in [AttentionWeights::None, AttentionWeights::PerHead] {
                check(&be, case, &want, &inputs, FloatDType::F32, weights);
            }
        }
    }
}

#[test]
fn every_path_matches_f64_attention_for_every_mask_kind() {
    check_cases(small_cases());
}

#[test]
fn long_calls_in_tiles_and_chunks_match_f64_attention() {
    check_cases(long_cases());
}

/// `values` rounded to `dtype`, as a tensor in that dtype holds them.
fn rounded(values: &[f32], dtype: FloatDType) -> Vec<f32> {
    values
        .iter()
        .map(|&x| match dtype {
            FloatDType::F16 => f16::from_f32(x).to_f32(),
            FloatDType::BF16 => bf16::from_f32(x).to_f32(),
            _ => x,
        })
        .collect()
}

/// The cases of [`other_dtypes_match_f64_attention_at_their_precision`] run in f64 only:
/// names, queries and keys.
const F64_ALIBI: [(&str, usize, usize); 2] = [
    ("causal, ALiBi of 12 heads, Tq 300, Tk 260", 300, 260),
    ("causal, ALiBi of 12 heads, Tq 40, Tk 50", 40, 50),
];

#[test]
fn other_dtypes_match_f64_attention_at_their_precision() {
    // Long calls in query chunks (causal, a band with a soft cap, a band with sinks) and
    // one with rows that see no key; the reference
    // takes the inputs as the dtype holds them, so that the comparison measures the
    // computation, not the rounding of its inputs.
    let cases: Vec<Case> = long_cases()
        .into_iter()
        .filter(|c| {
            c.name == "causal + padding + bias, Tq 300, Tk 260"
                || c.name == "sliding window 70, soft cap 3, Tq 300, Tk 260"
                || c.name == "sinks, sliding window 70, padding, Tq 300, Tk 260"
        })
        .chain(
            small_cases()
                .into_iter()
                .filter(|c| c.name.starts_with("rows without")),
        )
        // ALiBi's biases are made in f32, cast for the chunks and the kernels (they failed
        // inside Burn, and the kernels read f32 as f16).
        .chain([Case {
            name: "causal, ALiBi, Tq 300, Tk 260".into(),
            sizes: sizes([2, 4, 2, 300, 260, 8, 8]),
            mask: MaskSpec {
                position: Some(Position::Alibi(alibi_slopes(4))),
                ..MaskSpec::causal()
            },
        }])
        // And in f64 for f64 queries: 12 heads, whose slopes (those of 16 heads among
        // them, powers of 2^(-1/2)) are not powers of two, so that f32 rounds their
        // products by the distances (f64 was 1e-7 off). In f64 only: in f16 such a bias
        // (down to -180 here) is itself rounded by up to 0.06, which f16's tolerance
        // does not allow for.
        // In query chunks and in one call.
        .chain(F64_ALIBI.map(|(name, queries, keys)| Case {
            name: name.into(),
            sizes: sizes([2, 12, 4, queries, keys, 8, 8]),
            mask: MaskSpec {
                position: Some(Position::Alibi(alibi_slopes(12))),
                ..MaskSpec::causal()
            },
        }))
        .collect();
    assert_eq!(cases.len(), 7);
    for (n, case) in cases.iter().enumerate() {
        let s = case.sizes;
        let inputs = [s.query(), s.key(), s.value(), s.output()]
            .map(|dims| normal(dims.iter().product(), 900 + n as u64 + dims[2] as u64));
        for be in backends() {
            for dtype in be.other_float_dtypes() {
                let f64_only = F64_ALIBI.iter().any(|(name, ..)| case.name == *name);
                if f64_only && dtype != FloatDType::F64 {
                    continue;
                }
                let inputs = inputs.clone().map(|x| rounded(&x, dtype));
                let mut case = Case {
                    name: case.name.clone(),
                    sizes: case.sizes,
                    mask: case.mask.clone(),
                };
                if let Some(bias) = case.mask.bias.as_mut() {
                    bias.values = rounded(&bias.values, dtype);
                }
                let [q, k, v, grad] = &inputs;
                let want = attention(s, &case.mask, [q, k, v, grad]);
                check(&be, &case, &want, &inputs, dtype, AttentionWeights::None);
            }
        }
    }
}

/// An f16 row whose every score lies far below zero (large logits: -10,000 here, where
/// f16's blocked score is -2^14) is a real row, uniform weights over the keys it sees,
/// on every path: not zeros, as a row with no visible key.
#[test]
fn f16_rows_of_very_low_scores_are_real_rows() {
    let (t, dims) = (6, [1, 1, 6, 1]);
    let values: Vec<f32> = (1..=t).map(|j| j as f32).collect();
    for be in backends() {
        if !be.other_float_dtypes().contains(&FloatDType::F16) {
            continue;
        }
        let device = &be.device;
        let f16 = FloatDType::F16;
        let q = tensor(&vec![100.0; t], dims, device, f16);
        let k = tensor(&vec![-100.0; t], dims, device, f16);
        let v = tensor(&values, dims, device, f16);
        let padding = mha::AttentionMask::key_lengths(&[4], t, device);
        let masks = [
            ("causal", mha::AttentionMask::causal(), t),
            (
                "causal + padding",
                mha::AttentionMask::causal().and(padding),
                4,
            ),
        ];
        for (name, mask, keys) in masks {
            // Query `i` sees keys `0..=min(i, keys - 1)`: the mean of their values.
            let seen = |i: usize| i.min(keys - 1) + 1;
            let want: Vec<f64> = (0..t)
                .map(|i| (1..=seen(i)).sum::<usize>() as f64 / seen(i) as f64)
                .collect();
            let weights: Vec<f64> = (0..t * t)
                .map(|at| match at % t < seen(at / t) {
                    true => 1.0 / seen(at / t) as f64,
                    false => 0.0,
                })
                .collect();
            for asked in [AttentionWeights::None, AttentionWeights::PerHead] {
                let options = SdpaOptions {
                    scale: Some(1.0),
                    weights: asked,
                    ..SdpaOptions::default()
                };
                let out =
                    scaled_dot_product_attention(q.clone(), k.clone(), v.clone(), &mask, options);
                let what = format!("[{}] {name} ({asked:?})", be.name);
                let tol = be.tolerances(f16)[0];
                close(&format!("{what}: output"), out.context, &want, tol);
                if let Some(got) = crate::util::asked_weights(&what, asked, out.weights) {
                    close(&format!("{what}: weights"), got, &weights, tol);
                }
            }
        }
    }
}

/// A query of NaN gives its row NaN on every path, as PyTorch's attention does, and so does
/// a NaN bias on the one key a row sees: not zeros, as a row with no visible key (the CPU
/// tiles' and the GPU kernels' maxima passed over the NaN). The other rows are untouched.
/// 2 queries (the GPU's decoding kernels) and 20 (its tiles).
#[test]
fn a_nan_score_gives_its_row_nan_on_every_path() {
    let context = |be: &Backend, queries: usize, weights: AttentionWeights, bias: bool| {
        let (device, f32) = (&be.device, FloatDType::F32);
        let mut q = normal(queries * 4, 70);
        if !bias {
            q[..4].fill(f32::NAN);
        }
        let q = tensor(&q, [1, 1, queries, 4], device, f32);
        let k = tensor(&normal(3 * 4, 71), [1, 1, 3, 4], device, f32);
        let v = tensor(&normal(3 * 4, 72), [1, 1, 3, 4], device, f32);
        // Row 0 sees key 0 alone (with a NaN bias when `bias`), the others every key.
        let blocked: Vec<bool> = (0..queries * 3).map(|at| at == 1 || at == 2).collect();
        let blocked = burn::tensor::Tensor::<4, burn::tensor::Bool>::from_data(
            TensorData::new(blocked, [1, 1, queries, 3]),
            device,
        );
        let mut mask = mha::AttentionMask::blocking(blocked);
        if bias {
            let mut values = vec![0.0; queries * 3];
            values[0] = f32::NAN;
            let values = tensor(&values, [1, 1, queries, 3], device, f32);
            mask = mask.and(mha::AttentionMask::bias(values));
        }
        let options = SdpaOptions {
            weights,
            ..SdpaOptions::default()
        };
        to_vec(scaled_dot_product_attention(q, k, v, &mask, options).context)
    };
    for be in backends() {
        for (queries, bias) in [(2, false), (2, true), (20, false), (20, true)] {
            for weights in [AttentionWeights::None, AttentionWeights::PerHead] {
                let got = context(&be, queries, weights, bias);
                let what = format!("[{}] Tq {queries}, bias {bias} ({weights:?})", be.name);
                assert!(got[..4].iter().all(|x| x.is_nan()), "{what}: row 0 {got:?}");
                assert!(got[4..].iter().all(|x| x.is_finite()), "{what}: {got:?}");
            }
        }
    }
}

/// Every mask kind at sizes `[B, H, Hkv, Tq, Tk, Dk, Dv]`, any of which may be 0.
fn mask_kinds(dims: [usize; 7]) -> Vec<Case> {
    let [batch, heads, _, queries, keys, ..] = dims;
    let case = |kind: &str, mask| Case {
        name: format!("{kind} at {dims:?}"),
        sizes: sizes(dims),
        mask,
    };
    let part = |dims: [usize; 4], seed| Part {
        values: normal(dims.iter().product(), seed),
        dims,
    };
    let lengths: Vec<usize> = (0..batch).map(|b| keys.saturating_sub(b)).collect();
    let rule = |rule, top_left| MaskSpec {
        rule,
        top_left,
        ..MaskSpec::default()
    };
    vec![
        case("none", MaskSpec::default()),
        case("causal", MaskSpec::causal()),
        case("causal top-left", rule(Rule::Causal, true)),
        case("sliding window 2", rule(Rule::Sliding(2), false)),
        case("local window 1", rule(Rule::Local(1), false)),
        case(
            "padding",
            MaskSpec {
                blocked: Some(padding(&lengths, keys)),
                ..MaskSpec::default()
            },
        ),
        case(
            "boolean",
            MaskSpec {
                blocked: Some(Part {
                    values: pattern(queries * keys, 0.5, 7),
                    dims: [1, 1, queries, keys],
                }),
                ..MaskSpec::default()
            },
        ),
        case(
            "bias",
            MaskSpec {
                bias: Some(part([1, heads, queries, keys], 9)),
                ..MaskSpec::default()
            },
        ),
        case(
            "ALiBi",
            MaskSpec {
                position: Some(Position::Alibi(alibi_slopes(heads))),
                ..MaskSpec::causal()
            },
        ),
        case(
            "T5 table",
            MaskSpec {
                position: Some(table(heads, t5(true), 11)),
                ..MaskSpec::default()
            },
        ),
        case(
            "sinks",
            MaskSpec {
                sinks: Some((0..heads).map(|h| h as f32 - 1.0).collect()),
                ..MaskSpec::causal()
            },
        ),
    ]
    .into_iter()
    .chain((queries == keys).then(|| {
        // Self-attention only; no sequence when there is no token.
        let cu = match keys {
            0 => vec![0],
            _ => vec![0, keys],
        };
        case(
            "packed",
            MaskSpec {
                packed: Some(vec![cu; batch]),
                ..MaskSpec::causal()
            },
        )
    }))
    .collect()
}

#[test]
fn zero_and_one_sized_calls_match_f64_attention() {
    let mut cases = Vec::new();
    for dims in [
        [0, 2, 2, 3, 3, 4, 4],
        [2, 0, 0, 3, 3, 4, 4],
        [2, 2, 2, 0, 3, 4, 4],
        [2, 2, 2, 3, 0, 4, 4],
        [2, 2, 2, 0, 0, 4, 4],
        [1, 1, 1, 1, 1, 1, 1],
        [2, 2, 1, 1, 3, 1, 1],
        [1, 1, 1, 3, 1, 4, 4],
        [2, 2, 2, 3, 3, 4, 0],
        // Queries and keys without features: every score 0, the values' mean (PyTorch's
        // default scale 1/sqrt(0) is not finite: scale 1).
        [2, 2, 2, 3, 5, 0, 4],
    ] {
        cases.extend(mask_kinds(dims).into_iter().map(|mut case| {
            if case.sizes.d_k == 0 {
                case.sizes.scale = 1.0;
            }
            case
        }));
    }
    check_cases(cases);
}

/// Gradients asked for some inputs only (a frozen key and value, a bias alone, the sinks
/// alone, ...), on every path that differentiates (the tiles, the GPU kernels, the
/// explicit path in chunks): each one asked for equals the one computed with every
/// input tracked; those not asked for are absent. (The tiles skip the products of a
/// gradient no one asks for, and their whole pass for the sinks alone.)
#[test]
fn gradients_of_some_inputs_equal_those_of_all() {
    use mha::AttentionMask;
    let [b, h, hkv, t, d] = [2, 4, 2, 70, 16];
    for be in backends() {
        let device = be.autodiff();
        let random = |dims: [usize; 4], seed| {
            let len = dims.iter().product();
            tensor(&normal(len, seed), dims, &device, FloatDType::F32)
        };
        let q = random([b, h, t, d], 1);
        let k = random([b, hkv, t, d], 2);
        let v = random([b, hkv, t, d], 3);
        let bias = random([1, h, t, t], 4);
        let sinks = Tensor::<1>::from_floats([0.5, -1.0, 0.0, 2.0], &device);
        let upstream = random([b, h, t, d], 5);
        // Inputs tracked: [q, k, v, bias, sinks].
        let run = |tracked: [bool; 5]| {
            let track = |x: Tensor<4>, on: bool| match on {
                true => x.require_grad(),
                false => x,
            };
            let [q, k, v, bias] = [&q, &k, &v, &bias]
                .into_iter()
                .zip(tracked)
                .map(|(x, on)| track(x.clone(), on))
                .collect::<Vec<_>>()
                .try_into()
                .unwrap();
            let sinks = match tracked[4] {
                true => sinks.clone().require_grad(),
                false => sinks.clone(),
            };
            let mask = AttentionMask::causal()
                .and(AttentionMask::bias(bias.clone()))
                .and(AttentionMask::sinks(sinks.clone()));
            let out = scaled_dot_product_attention(
                q.clone(),
                k.clone(),
                v.clone(),
                &mask,
                SdpaOptions::default(),
            );
            let grads = (out.context * upstream.clone()).sum().backward();
            let four = [&q, &k, &v, &bias].map(|x| x.grad(&grads));
            let sinks = sinks.grad(&grads).map(|g| g.reshape([1, 1, 1, h]));
            [
                four[0].clone(),
                four[1].clone(),
                four[2].clone(),
                four[3].clone(),
                sinks,
            ]
        };
        let all = run([true; 5]);
        let names = ["dq", "dk", "dv", "dbias", "dsinks"];
        for tracked in [
            [true, false, false, false, false],
            [false, true, false, false, false],
            [false, false, true, false, false],
            [false, true, true, false, false],
            [true, false, false, true, false],
            [false, false, false, true, false],
            [false, false, false, false, true],
        ] {
            let some = run(tracked);
            for (i, (got, want)) in some.into_iter().zip(&all).enumerate() {
                let what = format!("[{}] {} of {tracked:?}", be.name, names[i]);
                match (got, tracked[i]) {
                    (Some(got), true) => {
                        let want = want.clone().expect("every gradient with all tracked");
                        crate::util::assert_close(&what, got, want, 0.0);
                    }
                    (None, false) => {}
                    (got, _) => panic!(
                        "{what}: {}",
                        if got.is_some() { "given" } else { "missing" }
                    ),
                }
            }
        }
    }
}
