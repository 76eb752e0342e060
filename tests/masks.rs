//! Masks: every convention means what it says, the fused and explicit paths agree for
//! every mask kind the fused op takes, causal alignment is bottom-right, and rows with
//! no visible key give zeros with finite gradients.

use burn::module::Module;
use burn::tensor::{Bool, Device, Tensor, TensorData};
use mha::{
    AttentionMask, AttentionWeights, MhaInput, MultiHeadAttentionConfig, SdpaOptions,
    scaled_dot_product_attention,
};

use crate::util::{backends, max_abs_diff, randn, to_vec};

fn bool_tensor<const D: usize>(
    values: Vec<bool>,
    shape: [usize; D],
    device: &Device,
) -> Tensor<D, Bool> {
    Tensor::from_data(TensorData::new(values, shape), device)
}

/// A boolean `[Tq, Tk]` pattern from a seed, about a third blocked.
fn pattern(tq: usize, tk: usize, seed: u64, device: &Device) -> Tensor<2, Bool> {
    let mut rng = crate::util::SplitMix(seed);
    bool_tensor(
        (0..tq * tk).map(|_| rng.uniform() < 0.33).collect(),
        [tq, tk],
        device,
    )
}

struct Case {
    name: &'static str,
    q: [usize; 4],
    k: [usize; 4],
    mask: AttentionMask,
    scale: Option<f64>,
}

fn cases(device: &Device) -> Vec<Case> {
    let (b, h, d) = (2, 4, 8);
    let q = |t| [b, h, t, d];
    let kv = |hkv, t| [b, hkv, t, d];
    vec![
        Case {
            name: "none",
            q: q(6),
            k: kv(h, 6),
            mask: AttentionMask::none(),
            scale: None,
        },
        Case {
            name: "causal square",
            q: q(6),
            k: kv(h, 6),
            mask: AttentionMask::causal(),
            scale: None,
        },
        Case {
            name: "causal cache Tq<Tk",
            q: q(3),
            k: kv(h, 9),
            mask: AttentionMask::causal(),
            scale: None,
        },
        Case {
            name: "causal Tq>Tk",
            q: q(7),
            k: kv(h, 4),
            mask: AttentionMask::causal(),
            scale: None,
        },
        Case {
            name: "key lengths",
            q: q(5),
            k: kv(h, 7),
            mask: AttentionMask::key_lengths(&[7, 3], 7, device),
            scale: None,
        },
        Case {
            name: "blocking [Tq, Tk]",
            q: q(5),
            k: kv(h, 7),
            mask: AttentionMask::blocking(pattern(5, 7, 1, device)),
            scale: None,
        },
        Case {
            name: "attending [B, 1, Tq, Tk]",
            q: q(5),
            k: kv(h, 5),
            mask: AttentionMask::attending(
                pattern(5, 5, 2, device)
                    .unsqueeze::<3>()
                    .repeat_dim(0, b)
                    .unsqueeze_dim::<4>(1),
            ),
            scale: None,
        },
        Case {
            name: "bias [H, Tq, Tk]",
            q: q(5),
            k: kv(h, 6),
            mask: AttentionMask::bias(randn([h, 5, 6], 3, device)),
            scale: None,
        },
        Case {
            name: "custom scale",
            q: q(5),
            k: kv(h, 6),
            mask: AttentionMask::none(),
            scale: Some(0.7),
        },
        Case {
            name: "GQA causal",
            q: q(6),
            k: kv(2, 6),
            mask: AttentionMask::causal(),
            scale: None,
        },
        Case {
            name: "MQA padding",
            q: q(6),
            k: kv(1, 8),
            mask: AttentionMask::key_lengths(&[8, 2], 8, device),
            scale: None,
        },
        Case {
            name: "causal + padding + bias",
            q: q(6),
            k: kv(2, 6),
            mask: AttentionMask::causal()
                .and(AttentionMask::key_lengths(&[6, 4], 6, device))
                .and(AttentionMask::bias(randn([6, 6], 4, device))),
            scale: Some(0.2),
        },
    ]
}

#[test]
fn fused_and_explicit_paths_agree_for_every_mask_kind() {
    for be in backends() {
        for (i, case) in cases(&be.device).into_iter().enumerate() {
            let seed = 100 + 3 * i as u64;
            let q = randn(case.q, seed, &be.device);
            let k = randn(case.k, seed + 1, &be.device);
            let v = randn(case.k, seed + 2, &be.device);
            let options = SdpaOptions {
                scale: case.scale,
                ..Default::default()
            };
            let fused =
                scaled_dot_product_attention(q.clone(), k.clone(), v.clone(), &case.mask, options);
            let explicit = scaled_dot_product_attention(
                q,
                k,
                v,
                &case.mask,
                options.with_weights(AttentionWeights::PerHead),
            );
            let err = max_abs_diff(fused.context, explicit.context);
            println!(
                "[{}] {}: fused vs explicit max abs diff {err:.2e}",
                be.name, case.name
            );
            assert!(
                err <= 1e-5,
                "[{}] {}: fused and explicit differ by {err}",
                be.name,
                case.name
            );
        }
    }
}

#[test]
fn causal_is_bottom_right_aligned() {
    for be in backends() {
        for (tq, tk) in [(3, 7), (5, 5), (6, 3)] {
            let q = randn([1, 2, tq, 4], 1, &be.device);
            let k = randn([1, 2, tk, 4], 2, &be.device);
            let options = SdpaOptions::default().with_weights(AttentionWeights::PerHead);
            let out =
                scaled_dot_product_attention(q, k.clone(), k, &AttentionMask::causal(), options);
            let w = to_vec(out.weights.unwrap());
            for h in 0..2 {
                for i in 0..tq {
                    let row = &w[(h * tq + i) * tk..(h * tq + i + 1) * tk];
                    for (j, &x) in row.iter().enumerate() {
                        let visible = j as i64 <= i as i64 + tk as i64 - tq as i64;
                        assert_eq!(
                            x > 0.0,
                            visible,
                            "[{}] Tq={tq} Tk={tk} w[{h},{i},{j}] = {x}",
                            be.name
                        );
                    }
                    let sum: f32 = row.iter().sum();
                    let any_visible = i as i64 + tk as i64 - tq as i64 >= 0;
                    let expected = if any_visible { 1.0 } else { 0.0 };
                    assert!(
                        (sum - expected).abs() < 1e-5,
                        "[{}] row {i} sums to {sum}",
                        be.name
                    );
                }
            }
        }
    }
}

#[test]
fn every_convention_blocks_the_same_keys() {
    for be in backends() {
        let dev = &be.device;
        let (b, tq, tk) = (2, 4, 6);
        let lengths = [6, 2];
        let padding: Vec<bool> = lengths
            .iter()
            .flat_map(|&l| (0..tk).map(move |j| j >= l))
            .collect();
        let neg_inf: Vec<f32> = padding
            .iter()
            .map(|&p| if p { f32::NEG_INFINITY } else { 0.0 })
            .collect();
        let masks = [
            ("key_lengths", AttentionMask::key_lengths(&lengths, tk, dev)),
            (
                "key_padding",
                AttentionMask::key_padding(bool_tensor(padding.clone(), [b, tk], dev)),
            ),
            (
                "blocking",
                AttentionMask::blocking(bool_tensor(padding.clone(), [b, 1, 1, tk], dev)),
            ),
            (
                "attending",
                AttentionMask::attending(bool_tensor(
                    padding.iter().map(|p| !p).collect(),
                    [b, 1, 1, tk],
                    dev,
                )),
            ),
            (
                "bias -inf",
                AttentionMask::bias(Tensor::<4>::from_data(
                    TensorData::new(neg_inf, [b, 1, 1, tk]),
                    dev,
                )),
            ),
        ];
        let m = MultiHeadAttentionConfig::new(16, 4).init(dev);
        let x = randn([b, tq, 16], 7, dev);
        let ctx = randn([b, tk, 16], 8, dev);
        let reference = m.cross_attention(x.clone(), ctx.clone(), masks[0].1.clone());
        for (name, mask) in &masks[1..] {
            for weights in [AttentionWeights::None, AttentionWeights::PerHead] {
                let input = MhaInput::cross(x.clone(), ctx.clone())
                    .mask(mask.clone())
                    .weights(weights);
                let err = max_abs_diff(m.forward(input).context, reference.clone());
                assert!(
                    err <= 1e-5,
                    "[{}] {name} ({weights:?}) differs by {err}",
                    be.name
                );
            }
        }
    }
}

#[test]
fn fully_blocked_rows_give_zeros_and_finite_gradients_on_both_paths() {
    for be in backends() {
        let dev = be.autodiff();
        let (b, h, t, d) = (2, 2, 5, 4);
        // Row 1 of batch 0 blocks everything through the bool mask; row 3 of batch 1
        // through a -inf bias; causal with Tq > Tk leaves the first rows without keys too.
        let mut blocked = vec![false; b * t * t];
        blocked[t..2 * t].iter_mut().for_each(|x| *x = true);
        let mut bias = vec![0.0f32; b * t * t];
        bias[(t + 3) * t..(t + 4) * t]
            .iter_mut()
            .for_each(|x| *x = f32::NEG_INFINITY);
        let mask = AttentionMask::blocking(bool_tensor(blocked, [b, 1, t, t], &dev)).and(
            AttentionMask::bias(Tensor::<4>::from_data(
                TensorData::new(bias, [b, 1, t, t]),
                &dev,
            )),
        );
        for weights in [AttentionWeights::None, AttentionWeights::PerHead] {
            let q = randn([b, h, t, d], 1, &dev).require_grad();
            let k = randn([b, h, t, d], 2, &dev).require_grad();
            let v = randn([b, h, t, d], 3, &dev).require_grad();
            let options = SdpaOptions::default().with_weights(weights);
            let out = scaled_dot_product_attention(q.clone(), k.clone(), v.clone(), &mask, options);
            let ctx = to_vec(out.context.clone());
            for (bi, row) in [(0, 1), (1, 3)] {
                for hi in 0..h {
                    let start = ((bi * h + hi) * t + row) * d;
                    assert!(
                        ctx[start..start + d].iter().all(|&x| x == 0.0),
                        "[{}] {weights:?}: dead row not zero",
                        be.name
                    );
                }
            }
            assert!(
                ctx.iter().all(|x| x.is_finite()),
                "[{}] {weights:?}: non-finite output",
                be.name
            );
            let grads = (out.context * randn([b, h, t, d], 4, &dev))
                .sum()
                .backward();
            for (name, x) in [("q", &q), ("k", &k), ("v", &v)] {
                let g = to_vec(x.grad(&grads).unwrap());
                assert!(
                    g.iter().all(|x| x.is_finite()),
                    "[{}] {weights:?}: non-finite grad of {name}",
                    be.name
                );
            }
        }
        // Causal with more queries than keys, on the plain device (backend kernels).
        let q = randn([1, h, 6, d], 5, &be.device);
        let k = randn([1, h, 3, d], 6, &be.device);
        let out = scaled_dot_product_attention(
            q,
            k.clone(),
            k,
            &AttentionMask::causal(),
            SdpaOptions::default(),
        );
        let ctx = to_vec(out.context);
        for hi in 0..h {
            let first = &ctx[hi * 6 * d..(hi * 6 + 3) * d];
            assert!(
                first.iter().all(|&x| x == 0.0),
                "[{}] causal Tq>Tk: rows without keys not zero: {first:?}",
                be.name
            );
        }
    }
}

#[test]
fn attention_dropout_acts_in_training_only() {
    for be in backends() {
        let config = MultiHeadAttentionConfig::new(16, 4).with_dropout(0.5);
        let train_dev = be.autodiff();
        let m = config.init(&train_dev);
        let x = randn([2, 6, 16], 9, &train_dev);
        let train = m.self_attention(x.clone(), AttentionMask::none());
        let eval_module = m.valid();
        let eval = eval_module.self_attention(x.clone().inner(), AttentionMask::none());
        let no_dropout = {
            let mut m0 = m.clone();
            m0.dropout.prob = 0.0;
            m0.self_attention(x, AttentionMask::none())
        };
        let diff_train = max_abs_diff(train.inner(), no_dropout.clone().inner());
        let diff_eval = max_abs_diff(eval, no_dropout.inner());
        assert!(
            diff_train > 1e-3,
            "[{}] dropout did nothing in training",
            be.name
        );
        assert!(
            diff_eval <= 1e-5,
            "[{}] dropout acted in eval: {diff_eval}",
            be.name
        );
    }
}

#[test]
fn blocks_return_the_weights_they_used() {
    use mha::{DecoderBlockConfig, DecoderConfig, EncoderBlockConfig, EncoderConfig};
    for be in backends() {
        let dev = &be.device;
        let block = EncoderBlockConfig::new(16, 4)
            .with_dropout(0.0)
            .with_causal(true);
        let encoder = EncoderConfig::new(block, 2).init(dev);
        let x = randn([2, 5, 16], 21, dev);
        let (y, weights) = encoder.forward_with_weights(x.clone(), &AttentionMask::none());
        assert!(max_abs_diff(y, encoder.forward(x.clone(), &AttentionMask::none())) <= 1e-6);
        assert_eq!(weights.len(), 2);
        for w in weights {
            let w = to_vec(w); // [2, 4, 5, 5]
            for (r, row) in w.chunks(5).enumerate() {
                let i = r % 5;
                assert!(
                    (row.iter().sum::<f32>() - 1.0).abs() < 1e-5,
                    "[{}] row sums to 1",
                    be.name
                );
                assert!(
                    row[i + 1..].iter().all(|&v| v == 0.0),
                    "[{}] causal weights see the future",
                    be.name
                );
            }
        }
        let decoder =
            DecoderConfig::new(DecoderBlockConfig::new(16, 4).with_dropout(0.0), 1).init(dev);
        let memory = randn([2, 7, 16], 22, dev);
        let padding = AttentionMask::key_lengths(&[7, 3], 7, dev);
        let none = AttentionMask::none();
        let (y, cross) = decoder.forward_with_weights(x.clone(), memory.clone(), &none, &padding);
        assert!(max_abs_diff(y, decoder.forward(x, memory, &none, &padding)) <= 1e-6);
        let w = to_vec(cross[0].clone()); // [2, 4, 5, 7]
        for (r, row) in w.chunks(7).enumerate() {
            assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
            if r >= 4 * 5 {
                assert!(
                    row[3..].iter().all(|&v| v == 0.0),
                    "[{}] padded memory attended",
                    be.name
                );
            }
        }
    }
}

/// The masks of [`attention_under_autodiff_matches_the_explicit_path`] for `[Tq, Tk]` and
/// `heads`: a name, the mask on `device`, and its additive bias (which requires a
/// gradient on an autodiff device) when it has one.
fn autodiff_masks(
    tq: usize,
    tk: usize,
    heads: usize,
    device: &Device,
) -> Vec<(&'static str, AttentionMask, Option<Tensor<4>>)> {
    let padding = || AttentionMask::key_lengths(&[tk, tk - tk / 6], tk, device);
    // A third of the pairs blocked, and every key of query rows 3 and 5 (rows without a
    // visible key must give zeros and pass no gradient).
    let mut rng = crate::util::SplitMix(11);
    let blocked = (0..tq * tk)
        .map(|i| [3, 5].contains(&(i / tk)) || rng.uniform() < 0.33)
        .collect();
    // A bias over every query and key, with a blocked (-inf) key per row; and one per
    // head and key, broadcast over the batch and the queries.
    let mut full = randn([1, 1, tq, tk], 7, device) * 0.5;
    for row in 0..tq {
        let key = row % tk;
        let cell = [0..1, 0..1, row..row + 1, key..key + 1];
        full = full.slice_assign(cell, Tensor::full([1, 1, 1, 1], f32::NEG_INFINITY, device));
    }
    let per_head = randn([1, heads, 1, tk], 8, device) * 0.5;
    // Leaves of their own (not the outputs of the ops above), so that both runs of a
    // test can differentiate them.
    let leaf = |t: Tensor<4>| {
        let t = Tensor::<4>::from_data(t.into_data(), device);
        if device.is_autodiff() {
            t.require_grad()
        } else {
            t
        }
    };
    let (full, per_head) = (leaf(full), leaf(per_head));
    vec![
        ("causal", AttentionMask::causal(), None),
        (
            "causal + padding",
            AttentionMask::causal().and(padding()),
            None,
        ),
        (
            "causal + padding + bias",
            AttentionMask::causal()
                .and(padding())
                .and(AttentionMask::bias(full.clone())),
            Some(full),
        ),
        (
            "padding + boolean",
            padding().and(AttentionMask::blocking(bool_tensor(
                blocked,
                [tq, tk],
                device,
            ))),
            None,
        ),
        (
            "bias per head and key",
            AttentionMask::bias(per_head.clone()),
            Some(per_head),
        ),
    ]
}

#[test]
fn attention_under_autodiff_matches_the_explicit_path() {
    // Without weights, an autodiff device runs attention as one operation with its own
    // backward (flex, ndarray: recomputed scores; wgpu: the explicit path in chunks), in
    // query chunks from 256 queries on; with weights it takes the explicit path, unchunked.
    for be in backends() {
        let dev = be.autodiff();
        let (b, h, hkv, d) = (2, 4, 2, 8);
        for (tq, tk) in [(300, 340), (300, 260), (40, 40), (40, 56)] {
            let names = autodiff_masks(tq, tk, h, &dev).into_iter().map(|m| m.0);
            for name in names.collect::<Vec<_>>() {
                // A mask holds ops on its bias (a reshape at least): each run builds its own,
                // from the same values, as a training step would.
                let mask_named = |device: &Device| {
                    autodiff_masks(tq, tk, h, device)
                        .into_iter()
                        .find(|(n, _, _)| *n == name)
                        .unwrap()
                };
                let has_bias = mask_named(&dev).2.is_some();
                let case = format!("[{}] {name}, Tq {tq}, Tk {tk}", be.name);
                let q = randn([b, h, tq, d], 1, &dev).require_grad();
                let k = randn([b, hkv, tk, d], 2, &dev).require_grad();
                let v = randn([b, hkv, tk, d], 3, &dev).require_grad();
                let grad_out = randn([b, h, tq, d], 4, &dev);
                let run = |weights| {
                    let (_, mask, bias) = mask_named(&dev);
                    let options = SdpaOptions::default().with_weights(weights);
                    let out = scaled_dot_product_attention(
                        q.clone(),
                        k.clone(),
                        v.clone(),
                        &mask,
                        options,
                    );
                    let grads = (out.context.clone() * grad_out.clone()).sum().backward();
                    let mut g: Vec<_> = [&q, &k, &v].map(|x| x.grad(&grads).unwrap()).into();
                    g.extend(bias.as_ref().map(|b| b.grad(&grads).unwrap()));
                    (out.context, g)
                };
                let (fast, fast_grads) = run(AttentionWeights::None);
                let (explicit, explicit_grads) = run(AttentionWeights::PerHead);
                let err = max_abs_diff(fast.clone(), explicit);
                assert!(err <= be.forward_tol(), "{case}: output differs by {err}");
                if tq > tk && name.starts_with("causal") {
                    let first = to_vec(fast.clone().slice([0..1, 0..1, 0..tq - tk, 0..d]));
                    assert!(
                        first.iter().all(|&x| x == 0.0),
                        "{case}: rows without keys not zero"
                    );
                }
                if name.ends_with("boolean") {
                    let dead = to_vec(fast.slice([0..b, 0..h, 3..4, 0..d]));
                    assert!(
                        dead.iter().all(|&x| x == 0.0),
                        "{case}: a row without keys is not zero"
                    );
                }
                assert_eq!(fast_grads.len(), 3 + has_bias as usize, "{case}");
                let parts = ["q", "k", "v", "bias"];
                for ((part, a), e) in parts.iter().zip(fast_grads).zip(explicit_grads) {
                    let values = to_vec(a.clone());
                    assert!(
                        values.iter().all(|x| x.is_finite()),
                        "{case}: gradient of {part} not finite"
                    );
                    let err = max_abs_diff(a, e);
                    assert!(
                        err <= be.grad_tol(),
                        "{case}: gradient of {part} differs by {err}"
                    );
                }
                // The plain device: flex recomputes from 256 queries on, below that flex and
                // ndarray take the fused op, wgpu the explicit path.
                let plain = |weights| {
                    let options = SdpaOptions::default().with_weights(weights);
                    let (q, k, v) = (q.clone().inner(), k.clone().inner(), v.clone().inner());
                    let mask = mask_named(&be.device).1;
                    scaled_dot_product_attention(q, k, v, &mask, options).context
                };
                let err = max_abs_diff(
                    plain(AttentionWeights::None),
                    plain(AttentionWeights::PerHead),
                );
                assert!(
                    err <= be.forward_tol(),
                    "{case}: output without autodiff differs by {err}"
                );
            }
        }
    }
}
