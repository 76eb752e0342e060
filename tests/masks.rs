//! Masks: every convention means what it says, causal alignment is bottom-right, rows
//! with no visible key give zeros with finite gradients, dropout acts in training only,
//! and blocks return the weights they used. (`paths.rs` compares every path with attention
//! computed in f64, for every mask kind.)

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
fn windows_wider_than_any_sequence_block_only_what_their_rule_does() {
    // `usize::MAX` says "no bound": a window wider than the keys is no window.
    for be in backends() {
        let dev = &be.device;
        let m = MultiHeadAttentionConfig::new(16, 4).init(dev);
        let x = randn([2, 5, 16], 3, dev);
        let cases = [
            (
                "local(MAX)",
                AttentionMask::local(usize::MAX),
                AttentionMask::none(),
            ),
            (
                "local(MAX / 2 + 1)",
                AttentionMask::local(usize::MAX / 2 + 1),
                AttentionMask::none(),
            ),
            (
                "sliding_window(MAX)",
                AttentionMask::sliding_window(usize::MAX),
                AttentionMask::causal(),
            ),
            (
                "causal and local(MAX)",
                AttentionMask::causal().and(AttentionMask::local(usize::MAX)),
                AttentionMask::causal(),
            ),
        ];
        for (name, wide, same) in cases {
            for weights in [AttentionWeights::None, AttentionWeights::PerHead] {
                let run = |mask: AttentionMask| {
                    let input = MhaInput::self_attn(x.clone()).mask(mask).weights(weights);
                    m.forward(input).context
                };
                let (got, want) = (run(wide.clone()), run(same.clone()));
                let err = max_abs_diff(got, want.clone());
                assert!(
                    err <= 1e-5,
                    "[{}] {name} ({weights:?}) differs from its rule by {err}",
                    be.name
                );
                let size: f32 = to_vec(want).iter().map(|v| v.abs()).sum();
                assert!(size > 0.0, "[{}] {name}: an output of zeros", be.name);
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

/// Rows blocked by low biases give zeros on every path, whatever the weights asked for
/// (the explicit path gave a row biased -7e29 uniform weights where the tiles and the GPU
/// kernels gave zeros): an f32 bias of -7e29 (below the kernels' dead row, -5e29); an f16
/// bias of `finfo(f16).min` (Hugging Face's padding in f16) beside f32 queries; and in f16,
/// a row of scores near -50000 blocked by -inf, whose sum overflowed to -inf in every
/// column (a NaN softmax): zeros, and finite gradients.
#[test]
fn rows_blocked_by_low_biases_give_zeros_on_every_path_and_dtype() {
    use burn::tensor::FloatDType;
    let (b, h, t, d) = (1, 2, 4, 4);
    // Row 2 of every head biased `low` on every key.
    let bias_with = |low: f32, device: &Device| {
        let values: Vec<f32> = (0..t * t)
            .map(|i| if i / t == 2 { low } else { 0.0 })
            .collect();
        Tensor::<4>::from_data(TensorData::new(values, [1, 1, t, t]), device)
    };
    let dead_row = |ctx: Vec<f32>, what: &str| {
        assert!(ctx.iter().all(|x| x.is_finite()), "{what}: {ctx:?}");
        for hi in 0..h {
            let start = (hi * t + 2) * d;
            assert!(
                ctx[start..start + d].iter().all(|&x| x == 0.0),
                "{what}: row 2 of head {hi} is {:?}",
                &ctx[start..start + d]
            );
            let other = &ctx[(hi * t + 1) * d..(hi * t + 2) * d];
            assert!(other.iter().any(|&x| x != 0.0), "{what}: row 1 zero");
        }
    };
    for be in backends() {
        let dev = be.autodiff();
        let mut cases = vec![("f32 bias -7e29", FloatDType::F32, bias_with(-7e29, &dev))];
        // (ndarray has no f16.)
        if be.other_float_dtypes().contains(&FloatDType::F16) {
            let min = bias_with(-65504.0, &dev).cast(FloatDType::F16);
            cases.push(("f16 bias finfo.min, f32 queries", FloatDType::F32, min));
            let inf = bias_with(f32::NEG_INFINITY, &dev).cast(FloatDType::F16);
            cases.push(("f16 scores near -50000, -inf bias", FloatDType::F16, inf));
        }
        for (name, dtype, bias) in cases {
            let mask = AttentionMask::bias(bias);
            // Scores of row 2 near -50000 (queries 100, keys -250, scale 1/2), finite in
            // f16; the other rows' of order 1.
            let (q, k) = match dtype {
                FloatDType::F16 => {
                    let q: Vec<f32> = (0..b * h * t * d)
                        .map(|i| if (i / d) % t == 2 { 100.0 } else { 0.1 })
                        .collect();
                    let q = Tensor::<4>::from_data(TensorData::new(q, [b, h, t, d]), &dev);
                    (q, Tensor::<4>::full([b, h, t, d], -250.0, &dev))
                }
                _ => (randn([b, h, t, d], 1, &dev), randn([b, h, t, d], 2, &dev)),
            };
            let q = q.cast(dtype).require_grad();
            let k = k.cast(dtype).require_grad();
            let v = randn([b, h, t, d], 3, &dev).cast(dtype).require_grad();
            for weights in [AttentionWeights::None, AttentionWeights::PerHead] {
                let what = format!("[{}] {name}, {weights:?}", be.name);
                let options = SdpaOptions::default().with_weights(weights);
                let out =
                    scaled_dot_product_attention(q.clone(), k.clone(), v.clone(), &mask, options);
                dead_row(to_vec(out.context.clone()), &what);
                let grads = out.context.cast(FloatDType::F32).sum().backward();
                for (x, part) in [(&q, "q"), (&k, "k"), (&v, "v")] {
                    let g = to_vec(x.grad(&grads).expect("a gradient"));
                    assert!(g.iter().all(|x| x.is_finite()), "{what}: d{part} {g:?}");
                }
            }
        }
    }
}

/// An f16 bias that blocks its row (Hugging Face's `finfo(f16).min`) still blocks it once
/// joined to a bias in f32 (ALiBi's, made in f32; or another mask's): zeros beside f32
/// queries on every path, the explicit one in query chunks (256 queries, no autodiff) or
/// whole (weights asked for), and the tiles (the joined bias is f32). It was -65504 in
/// f32 once joined, a low score but no block: near-uniform weights.
#[test]
fn an_f16_blocking_bias_joined_to_an_f32_bias_still_blocks() {
    use burn::tensor::FloatDType;
    use mha::{PositionBias, positions::alibi_slopes};
    let (h, t, d) = (2, 256, 4);
    for be in backends() {
        // (ndarray has no f16.)
        if !be.other_float_dtypes().contains(&FloatDType::F16) {
            continue;
        }
        let dev = &be.device;
        let values: Vec<f32> = (0..t * t)
            .map(|i| if i / t == 2 { -65504.0 } else { 0.0 })
            .collect();
        let f16_bias = Tensor::<4>::from_data(TensorData::new(values, [1, 1, t, t]), dev)
            .cast(FloatDType::F16);
        let alibi = PositionBias::Alibi {
            slopes: alibi_slopes(h),
        };
        let joined = [
            ("ALiBi", AttentionMask::position_bias(alibi)),
            (
                "an f32 bias",
                AttentionMask::bias(randn([1, 1, t, t], 4, dev)),
            ),
        ];
        let [q, k, v] = [1, 2, 3].map(|seed| randn([1, h, t, d], seed, dev));
        for (name, other) in joined {
            let mask = AttentionMask::bias(f16_bias.clone()).and(other);
            for weights in [AttentionWeights::None, AttentionWeights::PerHead] {
                let what = format!("[{}] joined to {name}, {weights:?}", be.name);
                let options = SdpaOptions::default().with_weights(weights);
                let out =
                    scaled_dot_product_attention(q.clone(), k.clone(), v.clone(), &mask, options);
                let ctx = to_vec(out.context);
                for hi in 0..h {
                    let row = |r: usize| &ctx[(hi * t + r) * d..(hi * t + r + 1) * d];
                    assert!(
                        row(2).iter().all(|&x| x == 0.0),
                        "{what}: head {hi} row 2 {:?}",
                        row(2)
                    );
                    assert!(
                        row(1).iter().any(|&x| x != 0.0),
                        "{what}: head {hi} row 1 zero"
                    );
                }
            }
        }
    }
}

/// A packed row may hold a sequence of no token (FlashAttention's varlen allows it; it was
/// refused): the same as the row without it, on every path, RoPE restarting as before.
#[test]
fn packed_sequences_of_no_token_change_nothing() {
    for be in backends() {
        let m = MultiHeadAttentionConfig::new(16, 4)
            .with_positions(mha::Positions::rope())
            .init(&be.device);
        let x = randn([2, 6, 16], 11, &be.device);
        let with_empty = [vec![0, 2, 2, 5, 6], vec![0, 0, 6, 6]];
        let without = [vec![0, 2, 5, 6], vec![0, 6]];
        for weights in [AttentionWeights::None, AttentionWeights::PerHead] {
            let run = |rows: &[Vec<usize>]| {
                let mask = AttentionMask::packed(rows).and(AttentionMask::causal());
                let input = MhaInput::self_attn(x.clone()).mask(mask).weights(weights);
                m.forward(input).context
            };
            let (got, want) = (run(&with_empty), run(&without));
            let err = max_abs_diff(got, want.clone());
            assert!(err <= 1e-6, "[{}] {weights:?}: {err}", be.name);
            let size: f32 = to_vec(want).iter().map(|v| v.abs()).sum();
            assert!(size > 0.0, "[{}] an output of zeros", be.name);
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
fn the_weights_returned_under_dropout_are_those_that_made_the_context() {
    // As PyTorch's nn.MultiheadAttention, Burn's module and transformers: each weight is
    // the softmax's dropped (0) or scaled by 1 / (1 - p), and the context is the weights
    // times the values. GQA 4:2, per head and averaged over the heads.
    for be in backends() {
        let dev = &be.device;
        let [q, k, v] =
            [(1, 4), (2, 2), (3, 2)].map(|(seed, heads)| randn([2, heads, 6, 8], seed, dev));
        let options = |dropout, weights| SdpaOptions {
            dropout,
            weights,
            ..SdpaOptions::default()
        };
        let mask = AttentionMask::causal();
        let attend = |dropout, weights| {
            scaled_dot_product_attention(
                q.clone(),
                k.clone(),
                v.clone(),
                &mask,
                options(dropout, weights),
            )
        };
        let softmax = attend(0.0, AttentionWeights::PerHead).weights.unwrap();
        let out = attend(0.5, AttentionWeights::PerHead);
        let weights = out.weights.unwrap();
        let (mut dropped, mut kept) = (0, 0);
        for (&w, &p) in to_vec(weights.clone()).iter().zip(&to_vec(softmax)) {
            match w == 0.0 {
                true => dropped += usize::from(p > 0.0),
                false => {
                    assert!(
                        (w - 2.0 * p).abs() <= 1e-5,
                        "[{}] {w} is not 2 x {p}",
                        be.name
                    );
                    kept += 1;
                }
            }
        }
        assert!(
            dropped > 5 && kept > 5,
            "[{}] {dropped} dropped, {kept} kept",
            be.name
        );
        let values = v
            .clone()
            .repeat_dim(1, 2)
            .reshape([2, 2, 2, 6, 8])
            .swap_dims(1, 2)
            .reshape([2, 4, 6, 8]);
        let made = weights.matmul(values);
        let diff = max_abs_diff(out.context, made);
        assert!(
            diff <= 1e-5,
            "[{}] the context is not the weights' ({diff})",
            be.name
        );

        // Averaged: the mean over the heads of weights that each sum to 0 or to 2 x the
        // softmax's, so rows are no longer distributions.
        let averaged = attend(0.5, AttentionWeights::Averaged).weights.unwrap();
        let sums = to_vec(averaged.sum_dim(3));
        assert!(
            sums.iter().any(|s| (s - 1.0).abs() > 1e-3),
            "[{}] averaged weights of dropout sum to 1 in every row: {sums:?}",
            be.name
        );

        // Values without features (Dv = 0): an empty context, and the weights dropped as
        // anywhere else.
        let no_values = Tensor::<4>::zeros([2, 2, 6, 0], dev);
        let out = scaled_dot_product_attention(
            q.clone(),
            k.clone(),
            no_values,
            &mask,
            options(0.5, AttentionWeights::PerHead),
        );
        assert_eq!(out.context.dims(), [2, 4, 6, 0]);
        let weights = to_vec(out.weights.unwrap());
        let softmax = to_vec(attend(0.0, AttentionWeights::PerHead).weights.unwrap());
        let dropped = weights
            .iter()
            .zip(&softmax)
            .filter(|(w, p)| **w == 0.0 && **p > 0.0);
        assert!(
            dropped.count() > 5,
            "[{}] Dv = 0: no weight dropped",
            be.name
        );
        for (&w, &p) in weights.iter().zip(&softmax) {
            assert!(
                w == 0.0 || (w - 2.0 * p).abs() <= 1e-5,
                "[{}] Dv = 0: {w}, {p}",
                be.name
            );
        }
    }
}

#[test]
fn blocks_return_the_weights_they_used() {
    use mha::{DecoderBlockConfig, DecoderConfig, EncoderBlockConfig, EncoderConfig, StackInput};
    for be in backends() {
        let dev = &be.device;
        let block = EncoderBlockConfig::new(16, 4)
            .with_dropout(0.0)
            .with_causal(true);
        let encoder = EncoderConfig::new(block, 2).init(dev);
        let x = randn([2, 5, 16], 21, dev);
        let out = encoder
            .forward(StackInput::new(x.clone()).weights())
            .unwrap();
        let (y, weights) = (out.output, out.weights);
        let plain = encoder.forward(StackInput::new(x.clone())).unwrap().output;
        assert!(max_abs_diff(y, plain) <= 1e-6);
        assert_eq!(weights.len(), 2);
        // Each layer's weights are its attention module's over its branch's input, the
        // blocks walked by hand (pre-norm, causal).
        let mut h = x.clone();
        for (layer, (block, got)) in encoder.layers.iter().zip(&weights).enumerate() {
            let input = mha::MhaInput::causal(block.norm1.forward(h.clone()))
                .weights(mha::AttentionWeights::PerHead);
            let out = block.self_attn.forward(input);
            let want = out.weights.expect("asked for");
            let what = format!("[{}] encoder weights of layer {layer}", be.name);
            crate::util::assert_close(&what, got.clone(), want, be.forward_tol());
            h = h.clone() + out.context;
            h = h.clone() + block.feed_forward.forward(block.norm2.forward(h));
        }
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
        let input = || {
            StackInput::new(x.clone())
                .memory(memory.clone())
                .memory_mask(padding.clone())
        };
        let out = decoder.forward(input().weights()).unwrap();
        let plain = decoder.forward(input()).unwrap().output;
        assert!(max_abs_diff(out.output, plain) <= 1e-6);
        // The block's self-attention's weights, then its cross-attention's.
        assert_eq!(out.weights.len(), 2);
        let w = to_vec(out.weights[1].clone()); // [2, 4, 5, 7]
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

/// Biases of two dtypes joined by `and` add in the wider one (they panicked inside Burn),
/// and the long calls' chunks add a position bias to an f16 bias in f32 (they rounded
/// ALiBi's to f16): the same numbers as one bias holding the sum, and as the weights'
/// path.
#[test]
fn biases_of_two_dtypes_add_in_the_wider() {
    use burn::tensor::FloatDType;
    for be in backends() {
        let dev = &be.device;
        let [q, k, v] = [1, 2, 3].map(|seed| randn([1, 2, 5, 4], seed, dev));
        let [a, b] = [4, 5].map(|seed| randn([1, 2, 5, 5], seed, dev));
        let attend = |mask: &AttentionMask| {
            scaled_dot_product_attention(
                q.clone(),
                k.clone(),
                v.clone(),
                mask,
                SdpaOptions::default(),
            )
            .context
        };
        for dtype in be.other_float_dtypes() {
            let what = format!("[{}] f32 and {dtype:?} biases", be.name);
            // The other dtype's bias as it holds it, summed in f32 for the reference.
            let other = b.clone().cast(dtype);
            let sum = a.clone() + other.clone().cast(FloatDType::F32);
            let joined = AttentionMask::bias(a.clone()).and(AttentionMask::bias(other));
            let got = attend(&joined);
            let want = attend(&AttentionMask::bias(sum));
            crate::util::assert_close(&what, got, want, be.forward_tol());
        }
        // An f16 bias and ALiBi at a slope f16 cannot hold (0.7), over enough queries to run
        // in chunks (no autodiff: the explicit path's chunks).
        if be.other_float_dtypes().contains(&FloatDType::F16) {
            let t = 300;
            let [q, k, v] = [6, 7, 8].map(|seed| randn([1, 1, t, 8], seed, dev));
            let bias = randn([1, 1, t, t], 9, dev).cast(FloatDType::F16);
            let alibi =
                AttentionMask::position_bias(mha::PositionBias::Alibi { slopes: vec![0.7] });
            let mask = AttentionMask::causal()
                .and(alibi)
                .and(AttentionMask::bias(bias));
            let run = |weights| {
                let options = SdpaOptions::default().with_weights(weights);
                scaled_dot_product_attention(q.clone(), k.clone(), v.clone(), &mask, options)
            };
            let chunked = run(AttentionWeights::None).context;
            let whole = run(AttentionWeights::PerHead);
            let want = whole.weights.unwrap().matmul(v.clone());
            let what = format!("[{}] chunks of an f16 bias and ALiBi", be.name);
            crate::util::assert_close(&what, chunked.clone(), want, be.forward_tol());
            crate::util::assert_close(&what, chunked, whole.context, be.forward_tol());
        }
    }
}

/// A causal rule or a window aligned at the farthest offset a mask takes (±2^40) means
/// what it says on every path, the weights' included (the explicit path made the
/// positions as integers of the device, i32 on wgpu, and panicked): every key seen, or
/// none (zeros).
#[test]
fn masks_aligned_far_away_see_every_key_or_none() {
    use mha::CausalAlignment::Offset;
    for be in backends() {
        let dev = &be.device;
        // 2 queries, 3 keys.
        let q = randn([1, 2, 2, 4], 1, dev);
        let [k, v] = [2, 3].map(|seed| randn([1, 2, 3, 4], seed, dev));
        let far = 1i64 << 40;
        let run = |mask: &AttentionMask, weights| {
            let options = SdpaOptions::default().with_weights(weights);
            scaled_dot_product_attention(q.clone(), k.clone(), v.clone(), mask, options)
        };
        let open = run(&AttentionMask::none(), AttentionWeights::PerHead);
        let cases = [
            (AttentionMask::causal().aligned(Offset(far)), true),
            (AttentionMask::causal().aligned(Offset(3_000_000_000)), true),
            (AttentionMask::causal().aligned(Offset(-far)), false),
            (AttentionMask::sliding_window(2).aligned(Offset(far)), false),
            (AttentionMask::local(1).aligned(Offset(-far)), false),
        ];
        for (mask, sees_all) in cases {
            for weights in [AttentionWeights::None, AttentionWeights::PerHead] {
                let what = format!("[{}] {mask:?}, weights {weights:?}", be.name);
                let out = run(&mask, weights);
                let want = match sees_all {
                    true => open.context.clone(),
                    false => open.context.clone().zeros_like(),
                };
                let diff = max_abs_diff(out.context, want);
                assert!(diff < 1e-5, "{what}: context off by {diff}");
                if let Some(w) = out.weights {
                    let want = match sees_all {
                        true => open.weights.clone().unwrap(),
                        false => w.clone().zeros_like(),
                    };
                    let diff = max_abs_diff(w, want);
                    assert!(diff < 1e-5, "{what}: weights off by {diff}");
                }
            }
        }
    }
}

/// Parts of masks that cannot broadcast together are refused by `and`, naming both
/// shapes (they panicked inside Burn); an offset past any sequence is refused by name.
#[test]
fn masks_that_cannot_join_are_refused_naming_their_shapes() {
    let d = crate::util::backends().next().unwrap().device.clone();
    let message = |f: Box<dyn FnOnce()>| {
        let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).expect_err("refused");
        err.downcast_ref::<String>().cloned().unwrap_or_default()
    };
    let padding = AttentionMask::key_lengths(&[2, 3], 4, &d);
    let other = AttentionMask::blocking(bool_tensor(vec![false; 25], [5, 5], &d));
    let got = message(Box::new(move || {
        let _ = padding.and(other);
    }));
    assert_eq!(
        got,
        "AttentionMask::and: the boolean masks of shapes [2, 1, 1, 4] and [1, 1, 5, 5] do \
         not broadcast together"
    );
    let [a, b] = [[2, 1, 3, 3], [1, 1, 4, 4]].map(|dims| Tensor::<4>::zeros(dims, &d));
    let got = message(Box::new(move || {
        let _ = AttentionMask::bias(a).and(AttentionMask::bias(b));
    }));
    assert!(
        got.contains("the biases of shapes [2, 1, 3, 3] and [1, 1, 4, 4]"),
        "{got}"
    );
    let got = message(Box::new(|| {
        let offset = mha::CausalAlignment::Offset(i64::MAX);
        let _ = AttentionMask::causal().aligned(offset);
    }));
    assert_eq!(
        got,
        format!(
            "AttentionMask::aligned: the offset {} is beyond ±2^40 positions",
            i64::MAX
        )
    );
}
