//! Decoding with a cache: a prompt, then tokens one at a time (and a few at once), gives
//! the rows of the forward pass over the whole sequence, on every backend, for every kind
//! of position, GQA, a sliding window kept in a ring, decoder-only and encoder-decoder
//! stacks; beams reordered and spread (`select_rows`) and drafts rolled back (`truncate`)
//! decode as their whole sequences; and bad calls are refused by name, leaving the cache
//! as it was.

use std::ops::Range;

use burn::module::Param;
use burn::tensor::{Device, Tensor};
use mha::{
    AttentionMask, BlockInput, CacheError, DecoderBlockConfig, DecoderConfig, EncoderBlockConfig,
    EncoderConfig, HeadMask, KvCache, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig,
    Positions, RopeLayout, StackInput,
};

use crate::util::{assert_close, backends, randn};

const D_MODEL: usize = 16;
const HEADS: usize = 4;

/// The calls a sequence of 11 tokens is decoded in: a prompt of 4, single tokens, then 3.
const CALLS: [Range<usize>; 6] = [0..4, 4..5, 5..6, 6..7, 7..8, 8..11];

/// Every kind of position attention applies itself.
fn positions() -> Vec<Positions> {
    vec![
        Positions::None,
        Positions::rope(),
        Positions::Rope {
            theta: 500.0,
            layout: RopeLayout::Interleaved,
        },
        Positions::Alibi,
        Positions::Relative { max_distance: 3 },
        Positions::t5(false),
    ]
}

/// Attention with random weights and, for the learned biases, a random table (they start
/// at zero, which would hide a misplaced distance).
fn attention(
    positions: Positions,
    kv_heads: usize,
    seed: u64,
    device: &Device,
) -> MultiHeadAttention {
    let mut m = MultiHeadAttentionConfig::new(D_MODEL, HEADS)
        .with_n_kv_heads(Some(kv_heads))
        .with_positions(positions)
        .init(device);
    if let Some(table) = &m.position_table {
        let dims = table.dims();
        m.position_table = Some(Param::from_tensor(randn(dims, seed, device)));
    }
    m
}

/// `decode` over each range of `calls` of `x` `[B, T, D]`, the outputs put back together.
fn decoded(
    x: &Tensor<3>,
    calls: &[Range<usize>],
    mut decode: impl FnMut(Tensor<3>) -> Tensor<3>,
) -> Tensor<3> {
    let parts = calls
        .iter()
        .map(|r| decode(x.clone().narrow(1, r.start, r.len())))
        .collect();
    Tensor::cat(parts, 1)
}

#[test]
fn decoding_attention_with_a_cache_gives_the_causal_forward() {
    for be in backends() {
        for (n, positions) in positions().into_iter().enumerate() {
            for (kv_heads, fixed) in [(HEADS, false), (1, false), (1, true)] {
                let what = format!(
                    "[{}] {positions:?}, {kv_heads} key/value heads, fixed reads {fixed}",
                    be.name
                );
                let m = attention(positions.clone(), kv_heads, 10 + n as u64, &be.device);
                let x = randn([2, 11, D_MODEL], 20 + n as u64, &be.device);
                let want = m.forward(MhaInput::causal(x.clone())).context;
                // Fixed reads: room for 16, every call reads all 16 slots.
                let mut cache = match fixed {
                    false => KvCache::new(11),
                    true => KvCache::new(16).fixed_reads(),
                };
                let got = decoded(&x, &CALLS, |x| {
                    m.forward_cached(x, &mut cache, AttentionMask::none())
                        .unwrap()
                });
                assert_eq!(cache.len(), 11);
                let slots = if fixed { 16 } else { 11 };
                assert_eq!(cache.dims(), Some([2, kv_heads, slots, D_MODEL / HEADS]));
                assert_close(&what, got, want, be.forward_tol());
            }
        }
    }
}

#[test]
fn a_sliding_cache_gives_sliding_window_attention_of_any_length() {
    // Window 3 over 11 tokens: a prompt longer than the window, single tokens around the
    // ring, a call of 3 across its end; a ring of the window, and one of 2 slots more.
    let calls = [0..5, 5..6, 6..7, 7..8, 8..11];
    for be in backends() {
        for (n, positions) in positions().into_iter().enumerate() {
            for slack in [0, 2] {
                let what = format!("[{}] window 3, slack {slack}, {positions:?}", be.name);
                let m = attention(positions.clone(), 2, 30 + n as u64, &be.device);
                let x = randn([2, 11, D_MODEL], 40 + n as u64, &be.device);
                let window = AttentionMask::sliding_window(3);
                let want = m
                    .forward(MhaInput::self_attn(x.clone()).mask(window))
                    .context;
                let mut cache = KvCache::sliding(3).with_rollback(slack);
                assert_eq!(cache.window(), Some(3));
                let got = decoded(&x, &calls, |x| {
                    m.forward_cached(x, &mut cache, AttentionMask::none())
                        .unwrap()
                });
                let slots = 3 + slack;
                assert_eq!(cache.dims(), Some([2, 2, slots, D_MODEL / HEADS]), "{what}");
                assert_close(&what, got, want, be.forward_tol());
            }
        }
    }
}

#[test]
fn a_mask_with_the_cache_covers_the_keys_it_sees() {
    // Left-padded prompts: row 0 has 2 pads, row 1 none; the padding mask of each call
    // covers every key the call sees.
    for be in backends() {
        let m = attention(Positions::rope(), 2, 50, &be.device);
        let x = randn([2, 9, D_MODEL], 51, &be.device);
        let pads = |keys: usize| {
            // Keys 0 and 1 of row 0 are padding.
            let padding: Vec<bool> = (0..2)
                .flat_map(|b| (0..keys).map(move |j| b == 0 && j < 2))
                .collect();
            let padding = Tensor::<2, burn::tensor::Bool>::from_data(
                burn::tensor::TensorData::new(padding, [2, keys]),
                &be.device,
            );
            AttentionMask::key_padding(padding)
        };
        let want = m
            .forward(MhaInput::causal(x.clone()).mask(pads(9)))
            .context
            .narrow(1, 2, 7);
        let mut cache = KvCache::new(9);
        let got = decoded(&x, &[0..5, 5..6, 6..7, 7..9], |x| {
            let keys = cache.keys_seen(x.dims()[1]);
            m.forward_cached(x, &mut cache, pads(keys)).unwrap()
        })
        .narrow(1, 2, 7);
        assert_close(
            &format!("[{}] padded prompts", be.name),
            got,
            want,
            be.forward_tol(),
        );
    }
}

#[test]
fn a_window_given_with_the_call_places_keys_as_the_cache_does() {
    // A window of 4 with the causal cache, aligned bottom-right or not aligned, over a
    // cache read as it fills and over one read in full (whose last slots are unwritten: its
    // queries stand at the cached positions, not at the last keys). A padding mask aligned
    // top-left places nothing by position: its alignment gives way to the window's.
    for be in backends() {
        for fixed in [false, true] {
            let m = attention(Positions::Alibi, 2, 52, &be.device);
            let x = randn([2, 9, D_MODEL], 53, &be.device);
            let want = m
                .forward(MhaInput::causal(x.clone()).mask(AttentionMask::sliding_window(4)))
                .context;
            for aligned in [false, true] {
                let what = format!(
                    "[{}] window with the call, fixed reads {fixed}, aligned {aligned}",
                    be.name
                );
                let mut cache = match fixed {
                    false => KvCache::new(9),
                    true => KvCache::new(12).fixed_reads(),
                };
                let got = decoded(&x, &[0..5, 5..6, 6..9], |x| {
                    let keys = cache.keys_seen(x.dims()[1]);
                    let nothing = Tensor::<2>::zeros([2, keys], &be.device).equal_elem(1.0);
                    let mut padding = AttentionMask::key_padding(nothing);
                    let mut window = AttentionMask::sliding_window(4);
                    if aligned {
                        padding = padding.aligned(mha::CausalAlignment::TopLeft);
                        window = window.aligned(mha::CausalAlignment::BottomRight);
                    }
                    m.forward_cached(x, &mut cache, window.and(padding))
                        .unwrap()
                });
                assert_close(&what, got, want.clone(), be.forward_tol());
            }
        }
    }
}

/// A padding mask aligned top-left places nothing by position: a module's own position
/// bias (ALiBi, learned relative biases) follows the cache's positions, not that
/// alignment (the bias, joined to the mask, took it and the call was refused).
#[test]
fn a_position_bias_follows_the_cache_whatever_a_padding_mask_is_aligned() {
    for be in backends() {
        for positions in [Positions::Alibi, Positions::Relative { max_distance: 3 }] {
            let m = attention(positions.clone(), 2, 57, &be.device);
            let x = randn([2, 9, D_MODEL], 58, &be.device);
            let want = m.forward(MhaInput::causal(x.clone())).context;
            let mut cache = KvCache::new(9);
            let got = decoded(&x, &[0..5, 5..6, 6..9], |x| {
                let keys = cache.keys_seen(x.dims()[1]);
                let nothing = Tensor::<2>::zeros([2, keys], &be.device).equal_elem(1.0);
                let padding =
                    AttentionMask::key_padding(nothing).aligned(mha::CausalAlignment::TopLeft);
                m.forward_cached(x, &mut cache, padding).unwrap()
            });
            let what = format!(
                "[{}] {positions:?} under a padding aligned top-left",
                be.name
            );
            assert_close(&what, got, want, be.forward_tol());
        }
    }
}

/// A module with attention sinks of its own refuses a mask with sinks too, before the
/// cache changes (the call wrote, then the attention refused).
#[test]
fn sinks_given_twice_are_refused_before_the_cache_changes() {
    let device = crate::util::first_device();
    let m = MultiHeadAttentionConfig::new(D_MODEL, HEADS)
        .with_sinks(true)
        .init(&device);
    let mut cache = KvCache::new(8);
    m.forward_cached(
        randn([1, 3, D_MODEL], 59, &device),
        &mut cache,
        AttentionMask::none(),
    )
    .unwrap();
    let sinks = AttentionMask::sinks(Tensor::zeros([HEADS], &device));
    let message = crate::util::panic_message(|| {
        let _ = m.forward_cached(randn([1, 1, D_MODEL], 60, &device), &mut cache, sinks);
    });
    assert!(message.contains("the mask has sinks too"), "{message}");
    assert_eq!(cache.len(), 3, "the refused call wrote nothing");
}

#[test]
fn a_window_aligned_elsewhere_than_the_cache_is_refused_before_the_cache_changes() {
    let device = crate::util::first_device();
    let m = attention(Positions::None, 2, 54, &device);
    for mut cache in [KvCache::new(8), KvCache::new(8).fixed_reads()] {
        m.forward_cached(
            randn([1, 3, D_MODEL], 55, &device),
            &mut cache,
            AttentionMask::none(),
        )
        .unwrap();
        let top_left = AttentionMask::local(1).aligned(mha::CausalAlignment::TopLeft);
        let call = std::panic::AssertUnwindSafe(|| {
            m.forward_cached(randn([1, 1, D_MODEL], 56, &device), &mut cache, top_left)
        });
        let panic = std::panic::catch_unwind(call).unwrap_err();
        let message = panic.downcast_ref::<String>().unwrap();
        assert!(
            message.contains("aligned TopLeft")
                && message.contains("first query at key 0")
                && message.contains("at key 3"),
            "{message}"
        );
        assert_eq!(cache.len(), 3, "the refused call wrote nothing");
        // At the cache's own position, an offset is the same as the default.
        let x = randn([1, 1, D_MODEL], 56, &device);
        let mut default = cache.clone();
        let want = m
            .forward_cached(x.clone(), &mut default, AttentionMask::local(1))
            .unwrap();
        let here = AttentionMask::local(1).aligned(mha::CausalAlignment::Offset(3));
        let got = m.forward_cached(x, &mut cache, here).unwrap();
        assert_eq!(cache.len(), 4);
        crate::util::assert_close("offset 3 as the default", got, want, 0.0);
    }
}

/// Stacks of 2 pre-norm blocks with `positions`, dropout off.
fn encoder_block(positions: Positions) -> EncoderBlockConfig {
    EncoderBlockConfig::new(D_MODEL, HEADS)
        .with_n_kv_heads(Some(2))
        .with_d_ff(Some(32))
        .with_dropout(0.0)
        .with_causal(true)
        .with_positions(positions)
}

#[test]
fn a_decoder_only_stack_decodes_with_one_cache_per_layer() {
    for be in backends() {
        for positions in [
            Positions::Sinusoidal,
            Positions::Learned { max_len: 12 },
            Positions::rope(),
            Positions::t5(false),
        ] {
            let what = format!("[{}] decoder-only, {positions:?}", be.name);
            let stack = EncoderConfig::new(encoder_block(positions), 2).init(&be.device);
            let x = randn([2, 11, D_MODEL], 60, &be.device);
            let want = stack.forward(StackInput::new(x.clone())).unwrap().output;
            let mut cache = stack.cache(KvCache::new(11));
            let got = decoded(&x, &CALLS, |x| {
                let input = StackInput::new(x).cache(&mut cache);
                stack.forward(input).unwrap().output
            });
            assert_eq!(cache.len(), 11);
            assert_eq!(cache.layers().len(), 2);
            assert_close(&what, got, want, be.forward_tol());
        }
    }
}

#[test]
fn left_padded_prompts_decode_together_as_each_alone() {
    // Row 0: 3 padding tokens, then a sequence of 8; row 1: a sequence of 11. Whole and
    // decoded together (a prompt of 8, single tokens, then 2; caches read as they fill, in
    // full, or a window's ring), each real token's output is that of its row alone: the
    // padding blocked as keys, absolute positions counted from each row's first token.
    let calls = [0..8, 8..9, 9..11];
    for be in backends() {
        for (n, positions) in [
            Positions::Learned { max_len: 11 },
            Positions::Sinusoidal,
            Positions::rope(),
            Positions::Alibi,
        ]
        .into_iter()
        .enumerate()
        {
            for window in [None, Some(4)] {
                let what = format!(
                    "[{}] left padding, {positions:?}, window {window:?}",
                    be.name
                );
                let block = encoder_block(positions.clone()).with_window(window);
                let stack = EncoderConfig::new(block, 2).init(&be.device);
                let x = randn([2, 11, D_MODEL], 65 + n as u64, &be.device);
                let alone = |b: usize, pad: usize| {
                    let row = x.clone().narrow(0, b, 1).narrow(1, pad, 11 - pad);
                    stack.forward(StackInput::new(row)).unwrap().output
                };
                let want = [alone(0, 3), alone(1, 0)];
                let pads = vec![3, 0];
                let whole = stack
                    .forward(StackInput::new(x.clone()).left_padding(pads.clone()))
                    .unwrap()
                    .output;
                let caches = match window {
                    Some(w) => vec![KvCache::sliding(w)],
                    None => vec![KvCache::new(11), KvCache::new(14).fixed_reads()],
                };
                let mut outs = vec![("whole", whole)];
                for kind in caches {
                    let mut cache = stack.cache(kind);
                    let got = decoded(&x, &calls, |x| {
                        let input = StackInput::new(x).left_padding(pads.clone());
                        stack.forward(input.cache(&mut cache)).unwrap().output
                    });
                    // A call of no token changes nothing.
                    let none = Tensor::<3>::zeros([2, 0, D_MODEL], &be.device);
                    let input = StackInput::new(none).left_padding(pads.clone());
                    let out = stack.forward(input.cache(&mut cache)).unwrap().output;
                    assert_eq!(out.dims(), [2, 0, D_MODEL], "{what}");
                    assert_eq!(cache.len(), 11, "{what}");
                    outs.push(("decoded", got));
                }
                for (how, out) in outs {
                    let row =
                        |b: usize, pad: usize| out.clone().narrow(0, b, 1).narrow(1, pad, 11 - pad);
                    let tol = be.forward_tol();
                    assert_close(
                        &format!("{what}, {how}, row 0"),
                        row(0, 3),
                        want[0].clone(),
                        tol,
                    );
                    assert_close(
                        &format!("{what}, {how}, row 1"),
                        row(1, 0),
                        want[1].clone(),
                        tol,
                    );
                }
            }
        }
    }
}

#[test]
fn a_prompt_padded_in_every_row_fits_the_positions_its_tokens_take() {
    // Learned positions 0..8; rows of 2 and 3 pads, then 7 and 6 tokens: 9 slots a row,
    // positions 0..7 at most, through a cache as without one. One more token fits; the
    // next is past the table, refused by name.
    let device = crate::util::first_device();
    let stack =
        EncoderConfig::new(encoder_block(Positions::Learned { max_len: 8 }), 1).init(&device);
    let x = randn([2, 10, D_MODEL], 66, &device);
    let pads = vec![2, 3];
    let prompt = || StackInput::new(x.clone().narrow(1, 0, 9)).left_padding(pads.clone());
    let whole = stack.forward(prompt()).unwrap().output;
    let mut cache = stack.cache(KvCache::new(12));
    let got = stack.forward(prompt().cache(&mut cache)).unwrap().output;
    assert_close("padded prompt through a cache", got, whole, 1e-5);
    let next = StackInput::new(x.clone().narrow(1, 9, 1)).left_padding(pads.clone());
    stack.forward(next.cache(&mut cache)).unwrap();
    let past = StackInput::new(x.narrow(1, 9, 1)).left_padding(pads);
    let err = stack.forward(past.cache(&mut cache)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "LearnedPositions: positions 8..9 are past the 8 learned ones"
    );
}

#[test]
fn decoding_returns_the_weights_and_takes_a_head_mask_as_the_whole_forward_does() {
    for be in backends() {
        let what = format!("[{}] decoder-only, cached weights", be.name);
        let stack = EncoderConfig::new(encoder_block(Positions::rope()), 2).init(&be.device);
        let x = randn([2, 11, D_MODEL], 62, &be.device);
        // Head 1 of the first layer dropped, head 2 of the second halved.
        let head_mask = HeadMask::from_rows(
            vec![vec![1.0, 0.0, 1.0, 1.0], vec![1.0, 1.0, 0.5, 1.0]],
            &be.device,
        );
        let input = StackInput::new(x.clone()).head_mask(head_mask.clone());
        let whole = stack.forward(input.weights()).unwrap();
        let mut cache = stack.cache(KvCache::new(11));
        let mut first = 0;
        for calls in CALLS {
            let input = StackInput::new(x.clone().narrow(1, calls.start, calls.len()))
                .head_mask(head_mask.clone())
                .weights()
                .cache(&mut cache);
            let out = stack.forward(input).unwrap();
            let rows = calls.len();
            let want = whole.output.clone().narrow(1, calls.start, rows);
            assert_close(&what, out.output, want, be.forward_tol());
            // The rows of this call, over the keys seen so far: `[B, H, rows, end]`.
            assert_eq!((out.weights.len(), whole.weights.len()), (2, 2), "{what}");
            for (got, all) in out.weights.into_iter().zip(&whole.weights) {
                assert_eq!(got.dims(), [2, HEADS, rows, calls.end]);
                let want = all
                    .clone()
                    .narrow(2, calls.start, rows)
                    .narrow(3, 0, calls.end);
                assert_close(&format!("{what} weights"), got, want, be.forward_tol());
            }
            first += rows;
        }
        assert_eq!(first, 11);
    }
}

#[test]
fn a_sliding_cache_returns_the_weights_in_the_order_of_positions() {
    // Window 3: a call sees the last 2 cached positions (the ring's slots in any order),
    // then its own; the weights name them in the order of their positions, as the whole
    // forward's rows do (one token read the ring as it lies and gave them rotated).
    let calls = [0..4, 4..5, 5..6, 6..7, 7..8, 8..11];
    for be in backends() {
        for positions in [Positions::None, Positions::rope()] {
            let what = format!("[{}] window 3, {positions:?}, cached weights", be.name);
            let block = encoder_block(positions).with_window(Some(3));
            let stack = EncoderConfig::new(block, 2).init(&be.device);
            let x = randn([2, 11, D_MODEL], 63, &be.device);
            let whole = stack.forward(StackInput::new(x.clone()).weights()).unwrap();
            let mut cache = stack.cache(KvCache::sliding(3));
            for call in calls.clone() {
                let input = StackInput::new(x.clone().narrow(1, call.start, call.len()))
                    .weights()
                    .cache(&mut cache);
                let out = stack.forward(input).unwrap();
                let first = call.start - call.start.min(2);
                assert_eq!((out.weights.len(), whole.weights.len()), (2, 2), "{what}");
                for (got, all) in out.weights.into_iter().zip(&whole.weights) {
                    let want = all.clone().narrow(2, call.start, call.len()).narrow(
                        3,
                        first,
                        call.end - first,
                    );
                    let what = format!("{what}, tokens {call:?}");
                    assert_close(&what, got, want, be.forward_tol());
                }
            }
        }
    }
}

#[test]
fn an_encoder_decoder_computes_the_memory_once_and_decodes() {
    for be in backends() {
        for positions in [Positions::Sinusoidal, Positions::Alibi] {
            let what = format!("[{}] encoder-decoder, {positions:?}", be.name);
            let block = DecoderBlockConfig::new(D_MODEL, HEADS)
                .with_n_kv_heads(Some(2))
                .with_d_ff(Some(32))
                .with_dropout(0.0)
                .with_positions(positions);
            let stack = DecoderConfig::new(block, 2).init(&be.device);
            let memory = randn([2, 7, D_MODEL], 70, &be.device);
            // The memory's padding: row 1 has 5 tokens.
            let memory_mask = AttentionMask::key_lengths(&[7, 5], 7, &be.device);
            let x = randn([2, 11, D_MODEL], 71, &be.device);
            let input = StackInput::new(x.clone())
                .memory(memory.clone())
                .memory_mask(memory_mask.clone());
            let want = stack.forward(input).unwrap().output;
            let mut cache = stack.cache(memory, KvCache::new(16));
            let got = decoded(&x, &CALLS, |x| {
                let input = StackInput::new(x)
                    .memory_mask(memory_mask.clone())
                    .cache(&mut cache);
                stack.forward(input).unwrap().output
            });
            assert_close(&what, got, want, be.forward_tol());
        }
    }
}

#[test]
fn bad_calls_are_refused_by_name_and_change_nothing() {
    let device = crate::util::first_device();
    let m = attention(Positions::rope(), 2, 80, &device);
    let mut cache = KvCache::new(6);
    let x = randn([1, 4, D_MODEL], 81, &device);
    m.forward_cached(x.clone(), &mut cache, AttentionMask::none())
        .unwrap();
    let err = m
        .forward_cached(x.clone(), &mut cache, AttentionMask::none())
        .unwrap_err();
    assert_eq!(
        err,
        CacheError::Full {
            capacity: 6,
            position: 4,
            tokens: 4
        }
    );
    assert!(err.to_string().contains("capacity of 6"), "{err}");
    assert_eq!(cache.len(), 4);
    let other_batch = randn([2, 1, D_MODEL], 82, &device);
    let err = m
        .forward_cached(other_batch, &mut cache, AttentionMask::none())
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "KvCache: it holds batch 1, the call brings batch 2 (reset it to start another sequence)"
    );
    // After a reset, another batch size is a new sequence.
    cache.reset();
    let other_batch = randn([2, 1, D_MODEL], 82, &device);
    m.forward_cached(other_batch, &mut cache, AttentionMask::none())
        .unwrap();
    let packed = AttentionMask::packed(&[vec![0, 1]]);
    let err = m.forward_cached(x.clone().narrow(1, 0, 1), &mut cache, packed.clone());
    assert_eq!(err.unwrap_err(), CacheError::Packed);
    // Blocks and stacks too, over a cache that holds positions (their check of the mask
    // against the cache's keys came first, and panicked).
    let causal = EncoderConfig::new(encoder_block(Positions::None), 2).init(&device);
    let mut caches = causal.cache(KvCache::new(8));
    causal
        .forward(StackInput::new(x.clone().narrow(1, 0, 2)).cache(&mut caches))
        .unwrap();
    let err = causal.forward(
        StackInput::new(x.clone().narrow(1, 0, 1))
            .mask(packed.clone())
            .cache(&mut caches),
    );
    assert_eq!(err.unwrap_err(), CacheError::Packed);
    let mut one = KvCache::new(8);
    causal.layers[0]
        .forward(BlockInput::new(x.clone().narrow(1, 0, 2)).cache(&mut one))
        .unwrap();
    let err = causal.layers[0].forward(
        BlockInput::new(x.clone().narrow(1, 0, 1))
            .mask(packed)
            .cache(&mut one),
    );
    assert_eq!(err.unwrap_err(), CacheError::Packed);

    let bidirectional =
        EncoderConfig::new(encoder_block(Positions::None).with_causal(false), 1).init(&device);
    let mut caches = bidirectional.cache(KvCache::new(8));
    let err = bidirectional
        .forward(StackInput::new(x.clone()).cache(&mut caches))
        .unwrap_err();
    assert_eq!(
        err,
        CacheError::NotCausal {
            module: "EncoderBlock"
        }
    );

    let learned =
        EncoderConfig::new(encoder_block(Positions::Learned { max_len: 5 }), 2).init(&device);
    let mut caches = learned.cache(KvCache::new(8));
    learned
        .forward(StackInput::new(x.clone()).cache(&mut caches))
        .unwrap();
    let err = learned
        .forward(StackInput::new(x.clone().narrow(1, 0, 2)).cache(&mut caches))
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "LearnedPositions: positions 4..6 are past the 5 learned ones"
    );
    assert_eq!(caches.len(), 4);
    let mut one_layer = mha::StackCache::new(1, KvCache::new(8));
    let err = learned
        .forward(StackInput::new(x.clone()).cache(&mut one_layer))
        .unwrap_err();
    assert_eq!(
        err,
        CacheError::Layers {
            layers: 2,
            caches: 1
        }
    );
    // A decoder's cache made without the memory, and no memory in the input.
    let decoder = DecoderConfig::new(DecoderBlockConfig::new(D_MODEL, HEADS), 2).init(&device);
    let mut no_memory = mha::StackCache::new(2, KvCache::new(8));
    let err = decoder
        .forward(StackInput::new(x).cache(&mut no_memory))
        .unwrap_err();
    assert_eq!(err, CacheError::NoMemory { module: "Decoder" });
    assert_eq!(
        err.to_string(),
        "Decoder: neither the input nor its cache has the memory to attend to: make the cache \
         with Decoder::cache(memory, ..) or give the input a memory"
    );
    assert_eq!(no_memory.len(), 0, "the refused call wrote nothing");
}

/// A stack's call that a later layer refuses leaves every layer's cache as it was (layer 0
/// wrote, then layer 1 refused): by an error, or by a panic over the mask; caches left
/// uneven by a panic part-way through the stack (any other: a device out of memory, here
/// a norm of another width) are refused by name, not decoded at two positions.
#[test]
fn a_stack_refuses_before_its_first_layer_writes() {
    let device = crate::util::first_device();
    let block = EncoderBlockConfig::new(D_MODEL, HEADS)
        .with_causal(true)
        .with_dropout(0.0);
    let x = randn([1, 5, D_MODEL], 61, &device);
    let lens = |cache: &mha::StackCache| -> Vec<usize> {
        cache.layers().iter().map(KvCache::len).collect()
    };
    // Layer 1 slides over a window the cache does not.
    let mut windowed = EncoderConfig::new(block.clone(), 2).init(&device);
    windowed.layers[1] = block.clone().with_window(Some(4)).init(&device);
    let mut cache = mha::StackCache::new(2, KvCache::new(16));
    let err = windowed
        .forward(StackInput::new(x.clone()).cache(&mut cache))
        .unwrap_err();
    assert_eq!(
        err,
        CacheError::Window {
            window: 4,
            cache: None
        }
    );
    assert_eq!(lens(&cache), [0, 0], "the refused call wrote nothing");
    // Layer 1 has sinks of its own and the mask brings sinks; layer 1 has 2 heads and
    // the bias 4.
    let mut sinks = EncoderConfig::new(block.clone(), 2).init(&device);
    sinks.layers[1] = block.clone().with_attention_sinks(true).init(&device);
    let mut fewer_heads = EncoderConfig::new(block.clone(), 2).init(&device);
    fewer_heads.layers[1] = EncoderBlockConfig::new(D_MODEL, 2)
        .with_causal(true)
        .init(&device);
    // Layer 1 adds ALiBi of its own and the mask brings a position bias.
    let mut alibi = EncoderConfig::new(block.clone(), 2).init(&device);
    alibi.layers[1] = block.clone().with_positions(Positions::Alibi).init(&device);
    let bias = Tensor::<4>::zeros([1, HEADS, 5, 5], &device);
    for (stack, mask, wanted) in [
        (
            &sinks,
            AttentionMask::sinks(Tensor::zeros([HEADS], &device)),
            "the mask has sinks too",
        ),
        (
            &fewer_heads,
            AttentionMask::bias(bias),
            "does not broadcast",
        ),
        (
            &alibi,
            AttentionMask::position_bias(mha::PositionBias::Alibi {
                slopes: vec![0.5; HEADS],
            }),
            "the mask has one too",
        ),
    ] {
        let message = crate::util::panic_message(|| {
            let input = StackInput::new(x.clone()).mask(mask).cache(&mut cache);
            let _ = stack.forward(input);
        });
        assert!(message.contains(wanted), "{message}");
        assert_eq!(
            lens(&cache),
            [0, 0],
            "{wanted}: the refused call wrote nothing"
        );
    }
    // A decoder whose layer 1 cross-attends with 2 heads, and one whose layer 1's
    // cross-attention has sinks of its own: the memory mask refused by layer 1 before
    // layer 0 writes, the memory's keys and values in the cache or given with the input.
    let decoder = DecoderBlockConfig::new(D_MODEL, HEADS).with_dropout(0.0);
    let memory = randn([1, 7, D_MODEL], 62, &device);
    let mut fewer_cross = DecoderConfig::new(decoder.clone(), 2).init(&device);
    fewer_cross.layers[1].cross_attn = MultiHeadAttentionConfig::new(D_MODEL, 2).init(&device);
    let mut cross_sinks = DecoderConfig::new(decoder.clone(), 2).init(&device);
    cross_sinks.layers[1].cross_attn = MultiHeadAttentionConfig::new(D_MODEL, HEADS)
        .with_sinks(true)
        .init(&device);
    let memory_bias = Tensor::<4>::zeros([1, HEADS, 5, 7], &device);
    for (stack, memory_mask, wanted) in [
        (
            &fewer_cross,
            AttentionMask::bias(memory_bias),
            "does not broadcast",
        ),
        (
            &cross_sinks,
            AttentionMask::sinks(Tensor::zeros([HEADS], &device)),
            "the mask has sinks too",
        ),
    ] {
        for given in [false, true] {
            let mut cache = stack.cache(memory.clone(), KvCache::new(16));
            let message = crate::util::panic_message(|| {
                let mut input = StackInput::new(x.clone()).memory_mask(memory_mask.clone());
                if given {
                    input = input.memory(memory.clone());
                }
                let _ = stack.forward(input.cache(&mut cache));
            });
            assert!(message.contains(wanted), "{message}");
            assert_eq!(
                lens(&cache),
                [0, 0],
                "{wanted}, memory given {given}: the refused call wrote nothing"
            );
        }
    }
    // A panic in layer 1 before its attention (its norm is of another width).
    let mut broken = EncoderConfig::new(block.clone(), 2).init(&device);
    broken.layers[1].norm1 = mha::LayerNorm::rms(D_MODEL / 2, 1e-5, &device);
    let message = crate::util::panic_message(|| {
        let _ = broken.forward(StackInput::new(x.clone()).cache(&mut cache));
    });
    assert!(message.contains("wide"), "{message}");
    assert_eq!(lens(&cache), [5, 0]);
    let err = broken
        .forward(StackInput::new(x).cache(&mut cache))
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "StackCache: layer 1's cache holds 0 positions and layer 0's 5 (caches of different \
         sequences; reset it to start another sequence)"
    );
}

/// `x` `[B, T, D]` decoded one token per call after `prompt` tokens were cached.
fn one_by_one(x: &Tensor<3>, mut decode: impl FnMut(Tensor<3>) -> Tensor<3>) -> Tensor<3> {
    let calls: Vec<Range<usize>> = (0..x.dims()[1]).map(|t| t..t + 1).collect();
    decoded(x, &calls, &mut decode)
}

/// The batch rows `rows` of `x`, in that order.
fn rows_of(x: &Tensor<3>, rows: &[usize]) -> Tensor<3> {
    Tensor::cat(rows.iter().map(|&b| x.clone().narrow(0, b, 1)).collect(), 0)
}

#[test]
fn beams_reordered_and_spread_decode_as_each_sequence_alone() {
    // Two prompts of 5 cached, then beam search's reordering: row 1 kept twice, row 0
    // once; 3 tokens more for each of the 3 beams. Each beam's outputs are those of the
    // whole sequence it holds (its prompt's row, then its own tokens).
    let rows = [1, 0, 1];
    for be in backends() {
        for (n, positions) in [
            Positions::Learned { max_len: 8 },
            Positions::rope(),
            Positions::t5(false),
            Positions::Alibi,
        ]
        .into_iter()
        .enumerate()
        {
            for window in [None, Some(4)] {
                let what = format!("[{}] beams, {positions:?}, window {window:?}", be.name);
                let block = encoder_block(positions.clone()).with_window(window);
                let stack = EncoderConfig::new(block, 2).init(&be.device);
                let prompt = randn([2, 5, D_MODEL], 90 + n as u64, &be.device);
                let next = randn([3, 3, D_MODEL], 95 + n as u64, &be.device);
                let whole = Tensor::cat(vec![rows_of(&prompt, &rows), next.clone()], 1);
                let want = stack
                    .forward(StackInput::new(whole))
                    .unwrap()
                    .output
                    .narrow(1, 5, 3);
                let mut cache = stack.cache(match window {
                    Some(w) => KvCache::sliding(w),
                    None => KvCache::new(8),
                });
                stack
                    .forward(StackInput::new(prompt).cache(&mut cache))
                    .unwrap();
                cache.select_rows(&rows).unwrap();
                assert_eq!(cache.len(), 5, "{what}");
                let slots = window.unwrap_or(8);
                let dims = Some([3, 2, slots, D_MODEL / HEADS]);
                assert!(cache.layers().iter().all(|l| l.dims() == dims), "{what}");
                let got = one_by_one(&next, |x| {
                    let input = StackInput::new(x).cache(&mut cache);
                    stack.forward(input).unwrap().output
                });
                assert_close(&what, got, want, be.forward_tol());
            }
        }
    }
}

#[test]
fn an_encoder_decoders_beams_keep_their_sources() {
    // Each beam attends to its own source: the memory (and the mask of its padding,
    // which the caller reorders as it reorders the beams) follows the rows kept.
    let rows = [1, 1, 0];
    for be in backends() {
        let what = format!("[{}] encoder-decoder beams", be.name);
        let block = DecoderBlockConfig::new(D_MODEL, HEADS)
            .with_n_kv_heads(Some(2))
            .with_d_ff(Some(32))
            .with_dropout(0.0)
            .with_positions(Positions::rope());
        let stack = DecoderConfig::new(block, 2).init(&be.device);
        let memory = randn([2, 7, D_MODEL], 100, &be.device);
        let lengths = [7, 5];
        let prompt = randn([2, 4, D_MODEL], 101, &be.device);
        let next = randn([3, 2, D_MODEL], 102, &be.device);
        let beam_mask = || {
            let lengths: Vec<usize> = rows.iter().map(|&b| lengths[b]).collect();
            AttentionMask::key_lengths(&lengths, 7, &be.device)
        };
        let whole = Tensor::cat(vec![rows_of(&prompt, &rows), next.clone()], 1);
        let input = StackInput::new(whole)
            .memory(rows_of(&memory, &rows))
            .memory_mask(beam_mask());
        let want = stack.forward(input).unwrap().output.narrow(1, 4, 2);
        let mut cache = stack.cache(memory, KvCache::new(6));
        let mask = AttentionMask::key_lengths(&lengths, 7, &be.device);
        let input = StackInput::new(prompt).memory_mask(mask);
        stack.forward(input.cache(&mut cache)).unwrap();
        cache.select_rows(&rows).unwrap();
        let got = one_by_one(&next, |x| {
            let input = StackInput::new(x).memory_mask(beam_mask());
            stack.forward(input.cache(&mut cache)).unwrap().output
        });
        assert_close(&what, got, want, be.forward_tol());
    }
}

#[test]
fn a_cache_rolled_back_decodes_as_if_the_rejected_tokens_never_came() {
    // Speculative decoding: a prompt of 5, a draft of 3 tokens checked in one call, the
    // first `accepted` of them kept (the cache truncated), then 2 tokens one by one: the
    // outputs of the whole accepted sequence. A sliding cache of 4 has written the draft
    // over the oldest positions: it goes back one position, or one more than the
    // positions it keeps beyond its window.
    for be in backends() {
        for (n, positions) in [Positions::Learned { max_len: 10 }, Positions::rope()]
            .into_iter()
            .enumerate()
        {
            for (window, slack, accepted) in [
                (None, 0, 1),
                (None, 0, 0),
                (Some(4), 0, 2),
                (Some(4), 1, 1),
                (Some(4), 2, 0),
            ] {
                let what = format!(
                    "[{}] rollback, {positions:?}, window {window:?} with {slack} more, \
                     {accepted} accepted",
                    be.name
                );
                let block = encoder_block(positions.clone()).with_window(window);
                let stack = EncoderConfig::new(block, 2).init(&be.device);
                let prompt = randn([2, 5, D_MODEL], 110 + n as u64, &be.device);
                let draft = randn([2, 3, D_MODEL], 112 + n as u64, &be.device);
                let next = randn([2, 2, D_MODEL], 114 + n as u64, &be.device);
                let mut parts = vec![prompt.clone()];
                if accepted > 0 {
                    parts.push(draft.clone().narrow(1, 0, accepted));
                }
                parts.push(next.clone());
                let whole = Tensor::cat(parts, 1);
                let want = stack
                    .forward(StackInput::new(whole))
                    .unwrap()
                    .output
                    .narrow(1, 5 + accepted, 2);
                let mut cache = stack.cache(match window {
                    Some(w) => KvCache::sliding(w).with_rollback(slack),
                    None => KvCache::new(8),
                });
                for x in [prompt, draft] {
                    stack.forward(StackInput::new(x).cache(&mut cache)).unwrap();
                }
                // One position further back would need one written over: back to 6 in a
                // ring of 4, positions 3..6 (3 written over by 7); and so would a second
                // step back.
                let len = 5 + accepted - 1;
                let too_far = |cached| CacheError::Truncate {
                    len,
                    cached,
                    earliest: 7 - slack,
                };
                if window.is_some() {
                    assert_eq!(cache.truncate(len), Err(too_far(8)), "{what}");
                    assert_eq!(cache.len(), 8, "{what}: a refusal changes nothing");
                }
                cache.truncate(5 + accepted).unwrap();
                assert_eq!(cache.len(), 5 + accepted, "{what}");
                if window.is_some() {
                    assert_eq!(cache.truncate(len), Err(too_far(5 + accepted)), "{what}");
                }
                let got = one_by_one(&next, |x| {
                    let input = StackInput::new(x).cache(&mut cache);
                    stack.forward(input).unwrap().output
                });
                assert_close(&what, got, want, be.forward_tol());
            }
        }
    }
}

#[test]
fn rows_past_the_batch_are_refused_and_change_nothing() {
    let device = crate::util::first_device();
    let stack = EncoderConfig::new(encoder_block(Positions::rope()), 2).init(&device);
    let mut cache = stack.cache(KvCache::new(8));
    // Nothing cached: nothing to select, whatever the rows.
    cache.select_rows(&[7]).unwrap();
    let prompt = randn([2, 3, D_MODEL], 120, &device);
    stack
        .forward(StackInput::new(prompt).cache(&mut cache))
        .unwrap();
    let err = cache.select_rows(&[0, 2, 1]).unwrap_err();
    assert_eq!(
        err,
        CacheError::Row {
            at: 1,
            row: 2,
            batch: 2
        }
    );
    assert_eq!(
        err.to_string(),
        "KvCache: rows[1] = 2 is not a row of the cached batch of 2"
    );
    let dims = Some([2, 2, 8, D_MODEL / HEADS]);
    assert!(
        cache
            .layers()
            .iter()
            .all(|l| l.dims() == dims && l.len() == 3)
    );
    // Keeping more positions than are cached changes nothing; no row at all is a batch
    // of none.
    cache.truncate(5).unwrap();
    assert_eq!(cache.len(), 3);
    cache.select_rows(&[]).unwrap();
    let dims = Some([0, 2, 8, D_MODEL / HEADS]);
    assert!(cache.layers().iter().all(|l| l.dims() == dims));
    // A rollback is given to a cache before it decodes, and set, not added.
    let m = attention(Positions::None, 2, 121, &device);
    let x = randn([1, 2, D_MODEL], 122, &device);
    let mut again = KvCache::sliding(4).with_rollback(2).with_rollback(1);
    m.forward_cached(x.clone(), &mut again, AttentionMask::none())
        .unwrap();
    assert_eq!(again.window(), Some(4));
    assert_eq!(again.dims(), Some([1, 2, 5, D_MODEL / HEADS]));
    let mut sliding = KvCache::sliding(4);
    m.forward_cached(x, &mut sliding, AttentionMask::none())
        .unwrap();
    let message = crate::util::panic_message(move || {
        let _ = sliding.with_rollback(2);
    });
    assert!(
        message.contains("KvCache::with_rollback: the cache holds 2 positions"),
        "{message}"
    );
    // More slots than a usize counts: named (it overflowed: "attempt to add with
    // overflow" in a debug build; in a release build a ring of 3 slots).
    let message = crate::util::panic_message(|| {
        let _ = KvCache::sliding(4).with_rollback(usize::MAX);
    });
    assert!(
        message.contains(
            "KvCache::with_rollback: a window of 4 and 18446744073709551615 positions of \
             rollback are more slots than a usize counts"
        ),
        "{message}"
    );
}

#[test]
fn a_cached_call_under_autodiff_gives_the_gradient_of_the_whole_forward() {
    // The last token's gradient through a cached call is its gradient through the whole
    // causal forward (the cached tokens are constants of both).
    for be in backends() {
        let device = be.autodiff();
        let what = format!("[{}] cached call under autodiff", be.name);
        let m = attention(Positions::rope(), 2, 130, &device);
        let prompt = randn([2, 3, D_MODEL], 131, &device);
        let token = || randn([2, 1, D_MODEL], 132, &device).require_grad();
        let mut cache = KvCache::new(4);
        m.forward_cached(prompt.clone(), &mut cache, AttentionMask::none())
            .unwrap();
        let last = token();
        let y = m
            .forward_cached(last.clone(), &mut cache, AttentionMask::none())
            .unwrap();
        let got = last.grad(&(y * 3.0).sum().backward()).unwrap();
        let last = token();
        let whole = Tensor::cat(vec![prompt, last.clone()], 1);
        let y = m.forward(MhaInput::causal(whole)).context.narrow(1, 3, 1);
        let want = last.grad(&(y * 3.0).sum().backward()).unwrap();
        assert_close(&what, got, want, be.grad_tol());
    }
}
