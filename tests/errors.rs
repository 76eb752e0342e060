//! What a user can get wrong gets an error naming the field or key and the values.

use burn::tensor::Device;
use mha::{
    AttentionMask, BlockInput, DecoderBlockConfig, EncoderBlockConfig, EncoderConfig, ImportError,
    LoadPyTorch, MhaInput, MultiHeadAttentionConfig, Positions, PyTorchWeights,
};

use crate::util::{Fixture, panic_message, randn};

fn dev() -> Device {
    crate::util::first_device()
}

fn mha_error(config: MultiHeadAttentionConfig) -> String {
    config.try_init(&dev()).unwrap_err().to_string()
}

#[test]
fn bad_attention_configs_name_the_field_and_values() {
    let cases = [
        (
            MultiHeadAttentionConfig::new(100, 3),
            "MultiHeadAttentionConfig.d_model: 100 is not divisible by n_heads = 3",
        ),
        (
            MultiHeadAttentionConfig::new(64, 8).with_n_kv_heads(Some(3)),
            "MultiHeadAttentionConfig.n_heads: 8 is not divisible by n_kv_heads = 3",
        ),
        (
            MultiHeadAttentionConfig::new(16, 4)
                .with_sinks(true)
                .with_quiet_softmax(true),
            "MultiHeadAttentionConfig.quiet_softmax: quiet_softmax gives fixed sinks of 0, \
             sinks learned ones: give one of the two",
        ),
        (
            MultiHeadAttentionConfig::new(0, 1),
            "MultiHeadAttentionConfig.d_model: must be at least 1, got 0",
        ),
        (
            MultiHeadAttentionConfig::new(8, 0),
            "MultiHeadAttentionConfig.n_heads: must be at least 1, got 0",
        ),
        (
            MultiHeadAttentionConfig::new(8, 2).with_n_kv_heads(Some(0)),
            "MultiHeadAttentionConfig.n_kv_heads: must be at least 1, got 0",
        ),
        (
            MultiHeadAttentionConfig::new(8, 2).with_kdim(Some(0)),
            "MultiHeadAttentionConfig.kdim: must be at least 1, got 0",
        ),
        (
            MultiHeadAttentionConfig::new(8, 2).with_dropout(1.0),
            "MultiHeadAttentionConfig.dropout: must be in [0, 1), got 1",
        ),
        (
            MultiHeadAttentionConfig::new(8, 2).with_dropout(-0.1),
            "MultiHeadAttentionConfig.dropout: must be in [0, 1), got -0.1",
        ),
        (
            MultiHeadAttentionConfig::new(8, 2).with_scale(Some(0.0)),
            "MultiHeadAttentionConfig.scale: must be positive and finite, got 0",
        ),
        (
            MultiHeadAttentionConfig::new(8, 2).with_scale(Some(f64::NAN)),
            "MultiHeadAttentionConfig.scale: must be positive and finite, got NaN",
        ),
        (
            MultiHeadAttentionConfig::new(8, 2).with_softcap(Some(-1.0)),
            "MultiHeadAttentionConfig.softcap: must be positive and finite, got -1",
        ),
        (
            // 0 in f32.
            MultiHeadAttentionConfig::new(8, 2).with_scale(Some(1e-46)),
            "MultiHeadAttentionConfig.scale: must be positive and finite in f32, got 1e-46",
        ),
        (
            MultiHeadAttentionConfig::new(8, 2).with_qk_norm_eps(Some(1e-50)),
            "MultiHeadAttentionConfig.qk_norm_eps: must be positive and finite in f32, got 1e-50",
        ),
        (
            MultiHeadAttentionConfig::new(8, 2).with_positions(Positions::Sinusoidal),
            "MultiHeadAttentionConfig.positions: Sinusoidal positions are added to the input \
             once, by a stack or the model; attention takes Rope, Alibi, Relative or T5",
        ),
        (
            MultiHeadAttentionConfig::new(6, 2).with_positions(Positions::rope()),
            "MultiHeadAttentionConfig.positions: Rope needs heads of an even width, got 3",
        ),
        (
            MultiHeadAttentionConfig::new(8, 2).with_positions(Positions::T5 {
                num_buckets: 8,
                max_distance: 2,
                bidirectional: true,
            }),
            "MultiHeadAttentionConfig.positions: T5 needs num_buckets of at least 4 and \
             max_distance above the exact buckets (2), got num_buckets 8, max_distance 2",
        ),
        (
            // "No clipping" as the largest distance: the table's length overflowed.
            MultiHeadAttentionConfig::new(8, 2).with_positions(Positions::Relative {
                max_distance: usize::MAX,
            }),
            "MultiHeadAttentionConfig.positions: Relative's max_distance must be at most \
             2147483647 (its table has 2 · max_distance + 1 buckets), got 18446744073709551615",
        ),
        (
            MultiHeadAttentionConfig::new(8, 2)
                .with_kdim(Some(6))
                .with_positions(Positions::Alibi),
            "MultiHeadAttentionConfig.positions: Alibi positions apply to self-attention, \
             whose keys and values are the input itself, d_model = 8 wide; kdim = 6 and \
             vdim = 8 are for cross-attention, which takes Positions::None",
        ),
    ];
    for (config, expected) in cases {
        assert_eq!(mha_error(config), expected);
    }
}

#[test]
fn bad_block_and_stack_configs_name_the_field_and_values() {
    let d = dev();
    let err = |r: Result<_, mha::ConfigError>| r.map(|_: ()| ()).unwrap_err().to_string();
    assert_eq!(
        err(EncoderBlockConfig::new(16, 4)
            .with_layer_norm_eps(0.0)
            .try_init(&d)
            .map(|_| ())),
        "EncoderBlockConfig.layer_norm_eps: must be positive and finite, got 0"
    );
    // 0 in f32, where the norms compute: a constant row would be NaN.
    assert_eq!(
        err(EncoderBlockConfig::new(16, 4)
            .with_layer_norm_eps(1e-50)
            .try_init(&d)
            .map(|_| ())),
        "EncoderBlockConfig.layer_norm_eps: must be positive and finite in f32, got 1e-50"
    );
    assert_eq!(
        err(EncoderBlockConfig::new(16, 4)
            .with_d_ff(Some(0))
            .try_init(&d)
            .map(|_| ())),
        "EncoderBlockConfig.d_ff: must be at least 1, got 0"
    );
    assert_eq!(
        err(DecoderBlockConfig::new(16, 4)
            .with_dropout(1.5)
            .try_init(&d)
            .map(|_| ())),
        "DecoderBlockConfig.dropout: must be in [0, 1), got 1.5"
    );
    // The attention's scale, by the block's name for it.
    assert_eq!(
        err(DecoderBlockConfig::new(16, 4)
            .with_attention_scale(Some(-1.0))
            .try_init(&d)
            .map(|_| ())),
        "DecoderBlockConfig.attention_scale: must be positive and finite, got -1"
    );
    // The default d_ff, 4 d_model, overflowing: named by d_model, which was given.
    assert_eq!(
        err(EncoderBlockConfig::new(1 << 62, 1).try_init(&d).map(|_| ())),
        "EncoderBlockConfig.d_model: 4611686018427387904 is too large: the feed-forward's \
         width, 4 d_model (d_ff, unset), overflows a usize"
    );
    assert_eq!(
        err(EncoderBlockConfig::new(16, 4)
            .with_attention_softcap(Some(0.0))
            .try_init(&d)
            .map(|_| ())),
        "EncoderBlockConfig.attention_softcap: must be positive and finite, got 0"
    );
    assert_eq!(
        err(DecoderBlockConfig::new(15, 4).try_init(&d).map(|_| ())),
        "DecoderBlockConfig.d_model: 15 is not divisible by n_heads = 4"
    );
    // d_ff defaults to 4 d_model: the field set wrong is named, not the default.
    assert_eq!(
        err(EncoderBlockConfig::new(0, 4).try_init(&d).map(|_| ())),
        "EncoderBlockConfig.d_model: must be at least 1, got 0"
    );
    assert_eq!(
        err(EncoderBlockConfig::new(16, 4)
            .with_n_kv_heads(Some(3))
            .try_init(&d)
            .map(|_| ())),
        "EncoderBlockConfig.n_heads: 4 is not divisible by n_kv_heads = 3"
    );
    assert_eq!(
        err(EncoderConfig::new(EncoderBlockConfig::new(16, 4), 0)
            .try_init(&d)
            .map(|_| ())),
        "EncoderConfig.n_layers: must be at least 1, got 0"
    );
}

#[test]
#[should_panic(
    expected = "LayerNorm: the input's last axis is 6 wide (shape [2, 6]), the norm's d_model is 8"
)]
fn layer_norm_refuses_rows_of_another_width() {
    let norm = mha::LayerNorm::new(&burn::nn::LayerNormConfig::new(8), &dev());
    norm.forward(burn::tensor::Tensor::<2>::zeros([2, 6], &dev()));
}

#[test]
#[should_panic(
    expected = "cross_entropy: targets[2] = 7 is not a class index below 4 (logits [3, 4]), nor ignore_index 9"
)]
fn cross_entropy_refuses_a_target_out_of_range() {
    let logits = burn::tensor::Tensor::<2>::zeros([3, 4], &dev());
    let targets = burn::tensor::Tensor::<1, burn::tensor::Int>::from_ints([1, 9, 7], &dev());
    mha::loss::cross_entropy(logits, targets, Some(9));
}

#[test]
#[should_panic(expected = "cross_entropy: targets has 2 rows, logits 3 (shape [3, 4])")]
fn cross_entropy_refuses_targets_of_another_length() {
    let logits = burn::tensor::Tensor::<2>::zeros([3, 4], &dev());
    let targets = burn::tensor::Tensor::<1, burn::tensor::Int>::from_ints([1, 2], &dev());
    mha::loss::cross_entropy(logits, targets, None);
}

#[test]
#[should_panic(expected = "MultiHeadAttentionConfig.d_model: 100 is not divisible by n_heads = 3")]
fn init_panics_with_the_same_message() {
    MultiHeadAttentionConfig::new(100, 3).init(&dev());
}

#[test]
#[should_panic(
    expected = "MultiHeadAttention: expected query of shape [B = 2, T, 16], got [2, 5, 12]"
)]
fn wrong_query_width_panics_naming_the_shapes() {
    let m = MultiHeadAttentionConfig::new(16, 4).init(&dev());
    m.forward(MhaInput::self_attn(randn([2, 5, 12], 1, &dev())));
}

#[test]
#[should_panic(
    expected = "MultiHeadAttention: expected key of shape [B = 2, T, 12], got [3, 7, 12]"
)]
fn wrong_key_batch_panics_naming_the_shapes() {
    let m = MultiHeadAttentionConfig::new(16, 4)
        .with_kdim(Some(12))
        .init(&dev());
    let q = randn([2, 5, 16], 1, &dev());
    m.forward(MhaInput::new(q.clone(), randn([3, 7, 12], 2, &dev()), q));
}

/// One tensor as keys and values where the module's `kdim` and `vdim` differ (or, in
/// self-attention, are not `d_model`) is refused naming the call and the widths, not as
/// a width check of an input the caller did not pass.
#[test]
fn one_source_for_keys_and_values_of_other_widths_is_refused_naming_the_widths() {
    let d = dev();
    let m = MultiHeadAttentionConfig::new(16, 4)
        .with_kdim(Some(12))
        .with_vdim(Some(8))
        .init(&d);
    let x = randn([2, 5, 16], 1, &d);
    let context = randn([2, 7, 12], 2, &d);
    let widths = "this module's keys are kdim = 12 wide and its values vdim = 8";
    let message = panic_message(std::panic::AssertUnwindSafe(|| {
        m.forward(MhaInput::cross(x.clone(), context.clone()));
    }));
    assert!(
        message.contains("MhaInput::cross(x, context) takes one tensor as the keys and the values")
            && message.contains(widths)
            && message.contains("MhaInput::new(query, key, value)"),
        "{message}"
    );
    let message = panic_message(std::panic::AssertUnwindSafe(|| {
        m.memory_kv(context.clone());
    }));
    assert!(
        message.contains("MultiHeadAttention::memory_kv(memory) takes one tensor")
            && message.contains(widths),
        "{message}"
    );
    let message = panic_message(std::panic::AssertUnwindSafe(|| {
        m.forward(MhaInput::self_attn(x.clone()));
    }));
    assert!(
        message.contains("self-attention takes x as the queries, keys and values")
            && message.contains(widths)
            && message.contains("not d_model = 16"),
        "{message}"
    );
    // Keys and values of their own widths are taken.
    let value = randn([2, 7, 8], 3, &d);
    let out = m.forward(MhaInput::new(x, context, value)).context;
    assert_eq!(out.dims(), [2, 5, 16]);
}

#[test]
#[should_panic(
    expected = "the boolean mask of shape [1, 1, 4, 4] does not broadcast to the scores [B, H, Tq, Tk] = [2, 4, 5, 5]"
)]
fn mask_of_the_wrong_size_panics_naming_the_shapes() {
    let d = dev();
    let m = MultiHeadAttentionConfig::new(16, 4).init(&d);
    let mask = burn::tensor::Tensor::<2, burn::tensor::Bool>::from_data(
        burn::tensor::TensorData::new(vec![false; 16], [4, 4]),
        &d,
    );
    m.self_attention(randn([2, 5, 16], 1, &d), mha::AttentionMask::blocking(mask));
}

/// Other libraries' mask shapes, refused with the way to give them: PyTorch's 3-D
/// `[B·H, Tq, Tk]` mask, and a `[B, Tk]` padding mask (Hugging Face's) given as a boolean
/// or additive mask, read as `[Tq, Tk]`.
#[test]
fn masks_of_other_libraries_shapes_name_the_way_to_give_them() {
    let d = dev();
    let m = MultiHeadAttentionConfig::new(16, 4).init(&d);
    let x = randn([2, 5, 16], 1, &d);
    let three_d = burn::tensor::Tensor::<3>::zeros([8, 5, 5], &d);
    let message = panic_message(|| {
        m.self_attention(x.clone(), mha::AttentionMask::bias(three_d));
    });
    assert!(
        message.contains(
            "PyTorch's 3-D mask [B·H, Tq, Tk]: reshape it to [B, H, Tq, Tk] = [2, 4, 5, 5]"
        ),
        "{message}"
    );
    let padding = burn::tensor::Tensor::<2>::zeros([2, 5], &d).equal_elem(1.0);
    let message = panic_message(|| {
        m.self_attention(x, mha::AttentionMask::blocking(padding));
    });
    assert!(
        message.contains("a [B, Tk] padding mask: AttentionMask::key_padding"),
        "{message}"
    );
}

/// The same on the GPU kernels' path, where self-attention keeps its heads packed (one
/// product to Q, K and V, not the split heads `scaled_dot_product_attention` checks).
#[cfg(feature = "wgpu")]
#[test]
#[should_panic(
    expected = "the boolean mask of shape [1, 1, 4, 4] does not broadcast to the scores [B, H, Tq, Tk] = [2, 4, 5, 5]"
)]
fn mask_of_the_wrong_size_panics_naming_the_shapes_on_the_gpu_path() {
    // The GPU's turn: its module draws from wgpu's generator and tunes its product.
    let _turn = crate::util::gpu_turn();
    let d = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
    let m = MultiHeadAttentionConfig::new(16, 4).init(&d);
    let mask = burn::tensor::Tensor::<2, burn::tensor::Bool>::from_data(
        burn::tensor::TensorData::new(vec![false; 16], [4, 4]),
        &d,
    );
    m.self_attention(randn([2, 5, 16], 1, &d), mha::AttentionMask::blocking(mask));
}

#[test]
#[should_panic(
    expected = "EncoderBlock: the input has a memory, and an encoder block has no cross-attention (DecoderBlock has)"
)]
fn an_encoder_block_refuses_a_memory() {
    let block = EncoderBlockConfig::new(16, 4).init(&dev());
    let x = randn([2, 5, 16], 1, &dev());
    let _ = block.forward(BlockInput::new(x.clone()).memory(x));
}

/// An encoder's memory mask (PyTorch's `memory_key_padding_mask` ported to the wrong
/// stack) is refused, not ignored.
#[test]
#[should_panic(
    expected = "EncoderBlock: the input has a memory mask, and an encoder block has no cross-attention to apply it to (its own mask is BlockInput::mask)"
)]
fn an_encoder_refuses_a_memory_mask() {
    let encoder = mha::EncoderConfig::new(EncoderBlockConfig::new(16, 4), 2).init(&dev());
    let padding = burn::tensor::Tensor::<2, burn::tensor::Bool>::from_data(
        burn::tensor::TensorData::new(vec![false, false, false, true, true], [1, 5]),
        &dev(),
    );
    let input = mha::StackInput::new(randn([1, 5, 16], 1, &dev()))
        .memory_mask(mha::AttentionMask::key_padding(padding));
    let _ = encoder.forward(input);
}

#[test]
#[should_panic(
    expected = "DecoderBlock: the input has no memory for the cross-attention (BlockInput::memory or BlockInput::memory_kv)"
)]
fn a_decoder_block_asks_for_its_memory() {
    let block = DecoderBlockConfig::new(16, 4).init(&dev());
    let _ = block.forward(BlockInput::new(randn([2, 5, 16], 1, &dev())));
}

/// A module whose `positions` field is set by hand to positions that take a learned
/// table, without one, is refused naming the field (it attended with no position bias
/// at all, without a word).
#[test]
fn positions_set_by_hand_without_their_table_are_refused() {
    let d = dev();
    let mut m = MultiHeadAttentionConfig::new(16, 4).init(&d);
    m.positions = Positions::t5(true);
    let message = panic_message(|| {
        let _ = m.forward(MhaInput::self_attn(randn([1, 3, 16], 1, &d)));
    });
    assert!(
        message.contains(
            "MultiHeadAttention: positions T5 { num_buckets: 32, max_distance: 128, \
             bidirectional: true } take a learned table, and the module has none \
             (position_table is None)"
        ),
        "{message}"
    );
    // A cached call (causal: T5's decoder) is refused before it writes.
    m.positions = Positions::t5(false);
    let mut cache = mha::KvCache::new(8);
    let message = panic_message(std::panic::AssertUnwindSafe(|| {
        let x = randn([1, 3, 16], 1, &d);
        let _ = m.forward_cached(x, &mut cache, AttentionMask::none());
    }));
    assert!(message.contains("(position_table is None)"), "{message}");
    assert_eq!(cache.len(), 0);
}

/// A decoder block put together by hand (its `cross_attn` replaced) whose
/// cross-attention cannot take the memory at all (given positions, keys and values of
/// two widths for one tensor, another width than the block's) is refused before its
/// self-attention writes to the cache: the cross-attention panicked after the write,
/// leaving the cache 3 positions ahead of what the caller accepted.
#[test]
fn a_hand_built_decoder_blocks_cross_attention_is_checked_before_the_cache_is_written() {
    let d = dev();
    let x = randn([2, 3, 16], 1, &d);
    let memory = randn([2, 5, 16], 2, &d);
    let kv = DecoderBlockConfig::new(16, 4)
        .init(&d)
        .memory_kv(memory.clone());
    let rope = MultiHeadAttentionConfig::new(16, 4).with_positions(Positions::rope());
    let two_widths = MultiHeadAttentionConfig::new(16, 4).with_vdim(Some(12));
    let cases = [
        (
            rope.init(&d),
            Some(memory.clone()),
            "MultiHeadAttention: DecoderBlock's cross-attention attends to another sequence, \
             and this module's positions (Rope",
        ),
        (
            rope.init(&d),
            None,
            "MultiHeadAttention: DecoderBlock's cross-attention attends to another sequence",
        ),
        (
            two_widths.init(&d),
            Some(memory.clone()),
            "MultiHeadAttention: BlockInput::memory(memory) takes one tensor as the keys and \
             the values, and this module's keys are kdim = 16 wide and its values vdim = 12",
        ),
        (
            MultiHeadAttentionConfig::new(8, 2).init(&d),
            Some(memory.clone()),
            "DecoderBlock: the input is 16 wide and the cross-attention takes 8",
        ),
    ];
    for (cross_attn, memory, expected) in cases {
        let mut block = DecoderBlockConfig::new(16, 4).init(&d);
        block.cross_attn = cross_attn;
        let mut cache = mha::KvCache::new(8);
        let message = panic_message(std::panic::AssertUnwindSafe(|| {
            let input = BlockInput::new(x.clone()).cache(&mut cache);
            let input = match memory {
                Some(memory) => input.memory(memory),
                None => input.memory_kv(&kv),
            };
            let _ = block.forward(input);
        }));
        assert!(message.contains(expected), "{message}");
        assert_eq!(cache.len(), 0, "{expected}");
    }
}

/// A decoder block's memory missing, of another batch or width, is refused before the
/// self-attention writes the call's keys to the cache: the cache keeps its length, and the
/// next call decodes at the right position.
#[test]
fn a_decoder_block_refuses_a_bad_memory_before_writing_to_its_cache() {
    let d = dev();
    let block = DecoderBlockConfig::new(16, 4).init(&d);
    let x = randn([2, 3, 16], 1, &d);
    let mut cache = mha::KvCache::new(8);
    let cases = [
        (
            None,
            "DecoderBlock: the input has no memory for the cross-attention",
        ),
        (
            Some(randn([1, 5, 16], 2, &d)),
            "DecoderBlock: the memory's batch is 1 and the input's 2",
        ),
        (
            Some(randn([2, 5, 12], 3, &d)),
            "DecoderBlock: the memory is 12 wide and the cross-attention takes 16",
        ),
    ];
    for (memory, expected) in cases {
        let message = panic_message(std::panic::AssertUnwindSafe(|| {
            let input = BlockInput::new(x.clone()).cache(&mut cache);
            let input = match memory {
                Some(memory) => input.memory(memory),
                None => input,
            };
            let _ = block.forward(input);
        }));
        assert!(message.contains(expected), "{message}");
        assert_eq!(cache.len(), 0, "{expected}");
    }
    // A memory mask that does not fit the memory.
    let padding = mha::AttentionMask::key_lengths(&[5, 5, 5], 5, &d);
    let message = panic_message(std::panic::AssertUnwindSafe(|| {
        let input = BlockInput::new(x.clone())
            .memory(randn([2, 5, 16], 2, &d))
            .memory_mask(padding)
            .cache(&mut cache);
        let _ = block.forward(input);
    }));
    assert!(
        message.contains("does not broadcast to the scores"),
        "{message}"
    );
    assert_eq!(cache.len(), 0);
    // A projected memory of another batch, or another module's.
    let kv = block.cross_attn.memory_kv(randn([3, 5, 16], 4, &d));
    let message = panic_message(std::panic::AssertUnwindSafe(|| {
        let _ = block.forward(BlockInput::new(x.clone()).memory_kv(&kv).cache(&mut cache));
    }));
    assert!(
        message.contains("the memory's batch is 3 and the input's 2"),
        "{message}"
    );
    let other = DecoderBlockConfig::new(16, 2).init(&d);
    let kv = other.memory_kv(randn([2, 5, 16], 4, &d));
    let message = panic_message(std::panic::AssertUnwindSafe(|| {
        let _ = block.forward(BlockInput::new(x.clone()).memory_kv(&kv).cache(&mut cache));
    }));
    assert!(
        message.contains(
            "the memory's keys and values are 2 heads 8 wide and the cross-attention's 4 \
             heads 4 wide"
        ),
        "{message}"
    );
    assert_eq!(cache.len(), 0);
    // A memory of another dtype, or (where two backends are compiled in) on another
    // device, as it is or projected by a module on that device.
    let half = randn([2, 5, 16], 5, &d).cast(burn::tensor::DType::F16);
    let mut others = vec![(half, "the memory is F16 and the input F32".to_string())];
    let other = crate::util::backends().into_iter().find(|b| b.device != d);
    if let Some(other) = &other {
        let message = format!("the memory is on {:?} and the input on {d:?}", other.device);
        others.push((randn([2, 5, 16], 5, &other.device), message));
    }
    for (memory, expected) in others {
        let message = panic_message(std::panic::AssertUnwindSafe(|| {
            let input = BlockInput::new(x.clone()).memory(memory.clone());
            let _ = block.forward(input.cache(&mut cache));
        }));
        assert!(message.contains(&expected), "{message}");
        assert_eq!(cache.len(), 0, "{expected}");
        if memory.device() != d {
            let there = DecoderBlockConfig::new(16, 4).init(&memory.device());
            let kv = there.cross_attn.memory_kv(memory);
            let message = panic_message(std::panic::AssertUnwindSafe(|| {
                let input = BlockInput::new(x.clone()).memory_kv(&kv);
                let _ = block.forward(input.cache(&mut cache));
            }));
            assert!(message.contains(&expected), "{message}");
            assert_eq!(cache.len(), 0, "{expected}");
        }
    }
}

#[test]
fn masks_by_position_that_cannot_hold_panic_naming_the_values() {
    use mha::{AttentionMask, CausalAlignment, SdpaOptions, scaled_dot_product_attention};
    let d = dev();
    let x = randn([2, 1, 6, 4], 1, &d);
    let run = |mask: AttentionMask, options: SdpaOptions| {
        let (x, mask) = (x.clone(), mask.clone());
        panic_message(move || {
            scaled_dot_product_attention(x.clone(), x.clone(), x, &mask, options);
        })
    };
    let cases = [
        (
            run(
                AttentionMask::packed(&[vec![0, 6], vec![0, 3, 7]]),
                SdpaOptions::default(),
            ),
            "packed sequences of row 1 end at 7, past Tk = 6",
        ),
        (
            run(AttentionMask::packed(&[vec![0, 6]]), SdpaOptions::default()),
            "packed sequences for 1 rows need self-attention over 1 rows, got [B, H, Tq, Tk] = [2, 1, 6, 6]",
        ),
        (
            run(
                AttentionMask::causal(),
                SdpaOptions::default().with_softcap(0.0),
            ),
            "softcap must be positive and finite in f32, got 0",
        ),
        (
            // Past f32's range: infinite in the kernels, every score NaN.
            run(
                AttentionMask::causal(),
                SdpaOptions::default().with_softcap(1e39),
            ),
            "softcap must be positive and finite in f32, got 1000000000000000000000000000000000000000",
        ),
        (
            run(
                AttentionMask::sinks(randn([3], 2, &d)),
                SdpaOptions::default(),
            ),
            "the attention sinks have 3 logits, one per head of the scores [B, H, Tq, Tk] = [2, 1, 6, 6]",
        ),
    ];
    for (message, expected) in cases {
        assert!(message.contains(expected), "{message:?} lacks {expected:?}");
    }
    let sinks = [randn([1], 2, &d), randn([1], 3, &d)];
    let message = panic_message(move || {
        let [a, b] = sinks;
        let _ = AttentionMask::sinks(a).and(AttentionMask::sinks(b));
    });
    assert!(
        message.contains("AttentionMask::and: both masks have attention sinks"),
        "{message:?}"
    );
    let message = panic_message(|| {
        AttentionMask::sliding_window(0);
    });
    assert!(
        message.contains("width must be at least 1, got 0"),
        "{message}"
    );
    let message = panic_message(|| {
        AttentionMask::packed(&[vec![0, 4, 3]]);
    });
    assert!(
        message.contains("cu_seqlens[0] = [0, 4, 3] must start at 0 and never decrease"),
        "{message}"
    );
    let message = panic_message(|| {
        let top = AttentionMask::causal().aligned(CausalAlignment::TopLeft);
        top.and(AttentionMask::local(2).aligned(CausalAlignment::BottomRight));
    });
    assert!(
        message.contains("one mask aligns TopLeft, the other BottomRight"),
        "{message}"
    );
}

#[test]
fn import_errors_name_the_key_and_shapes() {
    let d = dev();
    let f = Fixture::load("mha_causal_self");
    // Wrong size: the fixture has d_model 16.
    let err = MultiHeadAttentionConfig::new(32, 4)
        .init(&d)
        .load_pytorch(&f.weights, "model.")
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "key `model.in_proj_weight`: expected shape [96, 32], found [48, 16]"
    );
    // Wrong prefix.
    let err = MultiHeadAttentionConfig::new(16, 4)
        .init(&d)
        .load_pytorch(&f.weights, "encoder.")
        .unwrap_err();
    assert_eq!(err.to_string(), "missing key `encoder.in_proj_weight`");
    // A bias the module was configured without.
    let err = MultiHeadAttentionConfig::new(16, 4)
        .with_bias(false)
        .init(&d)
        .load_pytorch(&f.weights, "model.")
        .unwrap_err();
    assert!(matches!(err, ImportError::UnexpectedKey { .. }));
    assert_eq!(
        err.to_string(),
        "unexpected key `model.in_proj_bias`: the module was configured without bias"
    );
    // GQA has no PyTorch counterpart: the packed weight has the wrong number of rows.
    let err = MultiHeadAttentionConfig::new(16, 4)
        .with_n_kv_heads(Some(2))
        .init(&d)
        .load_pytorch(&f.weights, "model.")
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "key `model.in_proj_weight`: expected shape [32, 16], found [48, 16]"
    );
    // A post-norm encoder block given a pre-norm layer loads (same keys); a missing layer key fails.
    let err = EncoderBlockConfig::new(16, 4)
        .with_d_ff(Some(32))
        .init(&d)
        .load_pytorch(&f.weights, "model.")
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "missing key `model.self_attn.in_proj_weight`"
    );
}

#[test]
fn unreadable_files_name_the_file() {
    let err = PyTorchWeights::from_file("/nonexistent/weights.safetensors").unwrap_err();
    assert!(
        err.to_string()
            .starts_with("cannot read /nonexistent/weights.safetensors: "),
        "{err}"
    );
    let err = PyTorchWeights::from_bytes(b"not a safetensors file", "garbage.bin").unwrap_err();
    assert!(
        err.to_string()
            .starts_with("garbage.bin is not a safetensors file: "),
        "{err}"
    );
    // A truncated file.
    let path = crate::util::root().join("tests/fixtures/mha_causal_self.safetensors");
    let bytes = std::fs::read(path).unwrap();
    let err =
        PyTorchWeights::from_bytes(&bytes[..bytes.len() / 2], "half.safetensors").unwrap_err();
    assert!(
        err.to_string()
            .starts_with("half.safetensors is not a safetensors file: "),
        "{err}"
    );
}

/// A call of attention, for its panic's message.
type Call<'a> = Box<dyn Fn() + 'a>;

/// Positions belong to self-attention: a module with positions refuses every call that
/// attends to another sequence, naming the positions and the call, instead of ignoring
/// them; the same module's self-attention runs.
#[test]
fn positions_refuse_cross_attention_naming_the_kind_and_the_call() {
    let kinds = [
        (
            Positions::rope(),
            "Rope { theta: 10000.0, layout: HalfSplit }",
        ),
        (Positions::Alibi, "Alibi"),
        (
            Positions::Relative { max_distance: 4 },
            "Relative { max_distance: 4 }",
        ),
        (
            Positions::t5(true),
            "T5 { num_buckets: 32, max_distance: 128, bidirectional: true }",
        ),
    ];
    for b in crate::util::backends() {
        let d = b.device.clone();
        let x = randn([2, 5, 16], 1, &d);
        let context = randn([2, 7, 16], 2, &d);
        for (positions, kind) in &kinds {
            let m = MultiHeadAttentionConfig::new(16, 4)
                .with_positions(positions.clone())
                .init(&d);
            let calls: [(&str, Call); 4] = [
                (
                    "MhaInput::cross(x, context)",
                    Box::new(|| {
                        m.forward(MhaInput::cross(x.clone(), context.clone()));
                    }),
                ),
                (
                    "MhaInput::new(query, key, value)",
                    Box::new(|| {
                        m.forward(MhaInput::new(x.clone(), x.clone(), x.clone()));
                    }),
                ),
                (
                    "MultiHeadAttention::cross_attention(x, context, mask)",
                    Box::new(|| {
                        m.cross_attention(x.clone(), context.clone(), AttentionMask::none());
                    }),
                ),
                (
                    "MultiHeadAttention::memory_kv(memory)",
                    Box::new(|| {
                        m.memory_kv(context.clone());
                    }),
                ),
            ];
            for (call, run) in calls {
                let message = panic_message(std::panic::AssertUnwindSafe(run));
                println!("[{}] {message}", b.name);
                for part in [
                    call,
                    kind,
                    "apply to self-attention only",
                    "Positions::None",
                ] {
                    assert!(
                        message.contains(part),
                        "[{}] {message:?} lacks {part:?}",
                        b.name
                    );
                }
            }
            // Self-attention with the same module runs.
            assert_eq!(m.causal_self_attention(x.clone()).dims(), [2, 5, 16]);
        }
    }
}

/// What a T5 or position-table import cannot match is an error saying what to configure,
/// never numbers that silently differ: biases, the scale, heads of another width, a table
/// the module has no place for or of another kind, a table the module needs and the
/// weights lack.
#[test]
fn t5_and_position_table_imports_name_what_cannot_match() {
    let d = dev();
    let t5 = Fixture::load("mha_t5_hf_encoder");
    let positions = Positions::T5 {
        num_buckets: 8,
        max_distance: 20,
        bidirectional: true,
    };
    let load = |config: MultiHeadAttentionConfig, f: &Fixture| {
        config
            .init(&d)
            .load_pytorch(&f.weights, "model.")
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let cases = [
        (
            load(MultiHeadAttentionConfig::new(24, 6), &t5),
            "key `model.q.weight`: Hugging Face's T5Attention has no biases in q, k, v and o; \
             configure the module with_bias(false)",
        ),
        (
            load(MultiHeadAttentionConfig::new(24, 6).with_bias(false), &t5),
            "configure the module with_scale(Some(1.0)), it has 0.5",
        ),
        (
            load(
                MultiHeadAttentionConfig::new(24, 6)
                    .with_bias(false)
                    .with_scale(Some(1.0)),
                &t5,
            ),
            "unexpected key `model.relative_attention_bias.weight`: Hugging Face's T5 relative \
             bias needs Positions::T5",
        ),
        (
            load(
                MultiHeadAttentionConfig::new(24, 6)
                    .with_bias(false)
                    .with_scale(Some(1.0))
                    .with_positions(Positions::Relative { max_distance: 4 }),
                &t5,
            ),
            "key `model.relative_attention_bias.weight`: Hugging Face's T5 table indexes T5's \
             buckets; the module's positions are Relative { max_distance: 4 } (configure \
             Positions::T5)",
        ),
        (
            load(
                MultiHeadAttentionConfig::new(16, 4).with_positions(positions.clone()),
                &Fixture::load("mha_causal_self"),
            ),
            "key `model.position_table`: the module's T5 { num_buckets: 8, max_distance: 20, \
             bidirectional: true } positions have a learned table of [heads, buckets] = [4, 8], \
             which the weights lack",
        ),
        (
            load(
                MultiHeadAttentionConfig::new(24, 6),
                &Fixture::load("mha_relative_clipped"),
            ),
            "unexpected key `model.position_table`: the module has no learned position table",
        ),
    ];
    for (message, expected) in cases {
        assert!(message.contains(expected), "{message:?} lacks {expected:?}");
    }

    // T5 with num_heads · d_kv != d_model: q is [48, 24] for d_model 24.
    let zeros = |shape: &[usize]| vec![0u8; 4 * shape.iter().product::<usize>()];
    let tensors: Vec<(String, Vec<usize>, Vec<u8>)> = [
        ("q.weight", vec![48, 24]),
        ("k.weight", vec![48, 24]),
        ("v.weight", vec![48, 24]),
        ("o.weight", vec![24, 48]),
    ]
    .into_iter()
    .map(|(k, s)| (k.to_string(), s.clone(), zeros(&s)))
    .collect();
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(k, s, b)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b);
            (k.clone(), view.unwrap())
        })
        .collect();
    let bytes = safetensors::serialize(views, None).unwrap();
    let weights = PyTorchWeights::from_bytes(&bytes, "t5-wide-heads").unwrap();
    let err = MultiHeadAttentionConfig::new(24, 6)
        .with_bias(false)
        .with_scale(Some(1.0))
        .init(&d)
        .load_pytorch(&weights, "")
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "key `q.weight`: T5's heads are 48 / 6 = d_kv wide (48 = num_heads · d_kv), \
         MultiHeadAttention's are 4: configure the module with_head_dim(Some(d_kv))"
    );
}

#[test]
fn a_windowed_block_is_causal_and_decodes_through_a_sliding_cache() {
    let d = dev();
    let err = EncoderBlockConfig::new(16, 2)
        .with_window(Some(4))
        .try_init(&d)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("window") && err.contains("must be causal"),
        "{err}"
    );
    let block = EncoderBlockConfig::new(16, 2)
        .with_causal(true)
        .with_window(Some(4))
        .init(&d);
    let x = randn([1, 3, 16], 1, &d);
    for (mut cache, other) in [
        (mha::KvCache::new(8), "does not slide"),
        (mha::KvCache::sliding(3), "slides over 3"),
    ] {
        let err = block
            .forward(BlockInput::new(x.clone()).cache(&mut cache))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            format!(
                "EncoderBlock: it attends to a sliding window of 4 tokens, and its cache \
                 {other}: decode it with KvCache::sliding(4)"
            )
        );
    }
    let mut cache = mha::KvCache::sliding(4);
    assert!(block.forward(BlockInput::new(x).cache(&mut cache)).is_ok());
}

#[test]
fn positions_that_do_not_fit_their_input_panic_naming_the_values() {
    use burn::tensor::{Int, Tensor};
    use mha::positions::{AbsolutePositions, Buckets, PositionBias, Rope, RopeLayout};
    let d = dev();
    let q = randn([1, 2, 3, 8], 1, &d);
    let rope = |theta: f64, head_dim: usize| Rope {
        theta,
        layout: RopeLayout::HalfSplit,
        head_dim,
    };
    let learned = |table: [usize; 2], buckets: Buckets| {
        let table = randn(table, 2, &d);
        move || {
            AttentionMask::position_bias(PositionBias::Learned { table, buckets });
        }
    };
    let t5 = |num_buckets: usize, max_distance: usize| Buckets::T5 {
        num_buckets,
        max_distance,
        bidirectional: true,
    };
    let positions = AbsolutePositions::learned(8, 16, &d);
    let x = randn([2, 5, 12], 3, &d);
    let (q1, q2) = (q.clone(), q.clone());
    let cases = [
        (
            panic_message(std::panic::AssertUnwindSafe(move || {
                rope(1e4, 7).apply(q1, &[vec![0, 1, 2]]);
            })),
            "Rope: head_dim must be even and at least 2, got 7",
        ),
        (
            panic_message(std::panic::AssertUnwindSafe(move || {
                rope(0.0, 8).apply(q2, &[vec![0, 1, 2]]);
            })),
            "Rope: theta must be a finite number above 1, got 0",
        ),
        (
            panic_message(std::panic::AssertUnwindSafe(move || {
                rope(1e4, 8).apply(q, &[vec![0, 1]]);
            })),
            "Rope: positions must be [1 or B = 1, T = 3], got 1 row(s) of [2] position(s)",
        ),
        (
            panic_message(learned([2, 5], Buckets::Clipped { max: 4 })),
            "PositionBias::Learned: the table is [H, buckets] = [2, 5], and Clipped { max: 4 } \
             has 9 buckets",
        ),
        (
            panic_message(learned([2, 1], t5(1, 8))),
            "PositionBias::Learned: T5 needs num_buckets of at least 4 and max_distance above \
             the exact buckets (0), got num_buckets 1, max_distance 8",
        ),
        (
            panic_message(std::panic::AssertUnwindSafe(move || {
                positions.add(x, 0);
            })),
            "LearnedPositions: the input is 12 wide, not 16",
        ),
    ];
    for (message, expected) in cases {
        assert!(message.contains(expected), "{message:?} lacks {expected:?}");
    }
    // A table of the right width is taken.
    learned([2, 9], Buckets::Clipped { max: 4 })();
    // The tokens' types must match the tokens.
    let config: mha::hf::BertConfig = serde_json::from_str(
        r#"{"hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1,
            "intermediate_size": 32, "layer_norm_eps": 1e-12, "vocab_size": 10}"#,
    )
    .unwrap();
    let bert = config.init_model(&d).unwrap();
    let tokens = Tensor::<2, Int>::zeros([2, 8], &d);
    let types = Tensor::<2, Int>::zeros([2, 7], &d);
    let message = panic_message(std::panic::AssertUnwindSafe(move || {
        bert.forward(tokens, types, AttentionMask::none());
    }));
    let expected = "BertModel: token_types must be of the tokens' shape [B, T] = [2, 8]";
    assert!(message.contains(expected), "{message:?} lacks {expected:?}");
}

#[test]
fn packed_sequences_are_checked_before_rope_turns_them() {
    let d = dev();
    let m = MultiHeadAttentionConfig::new(16, 2)
        .with_positions(Positions::rope())
        .init(&d);
    // Two rows of sequences for a batch of 3: the mask is named, not RoPE's positions.
    let (m1, x) = (m.clone(), randn([3, 5, 16], 1, &d));
    let message = panic_message(std::panic::AssertUnwindSafe(move || {
        m1.self_attention(x, AttentionMask::packed(&[vec![0, 2, 5], vec![0, 5]]));
    }));
    let expected = "packed sequences for 2 rows need self-attention over 2 rows, got [B, H, Tq, \
                    Tk] = [3, 2, 5, 5]";
    assert!(message.contains(expected), "{message:?} lacks {expected:?}");
    // No batch row: an empty output of its shape.
    let out = m.self_attention(randn([0, 5, 16], 2, &d), AttentionMask::packed(&[]));
    assert_eq!(out.dims(), [0, 5, 16]);
}

#[test]
fn attention_weights_check_their_inputs_as_attention_does() {
    use mha::SdpaOptions;
    use mha::attention::attention_weights;
    let d = dev();
    let run = |q: [usize; 4], k: [usize; 4], mask: AttentionMask, options: SdpaOptions| {
        let (q, k) = (randn(q, 1, &d), randn(k, 2, &d));
        panic_message(std::panic::AssertUnwindSafe(move || {
            attention_weights(q, k, &mask, options);
        }))
    };
    let o = SdpaOptions::default;
    let cases = [
        (
            run([2, 4, 5, 8], [2, 3, 5, 8], AttentionMask::none(), o()),
            "attention_weights: expected key and value heads Hkv to divide query heads H \
             ([B, H, Tq, Dk], [B, Hkv, Tk, Dk], [B, Hkv, Tk, Dv]), got query [2, 4, 5, 8], key \
             [2, 3, 5, 8]",
        ),
        (
            run([2, 4, 5, 8], [2, 2, 5, 6], AttentionMask::none(), o()),
            "attention_weights: query and key head dims Dk differ: query [2, 4, 5, 8], key \
             [2, 2, 5, 6]",
        ),
        (
            run([2, 4, 5, 8], [1, 2, 5, 8], AttentionMask::none(), o()),
            "attention_weights: batch sizes differ: query [2, 4, 5, 8], key [1, 2, 5, 8]",
        ),
        (
            run(
                [2, 4, 5, 8],
                [2, 2, 5, 8],
                AttentionMask::none(),
                o().with_scale(f64::NAN),
            ),
            "scale must be positive and finite in f32, got NaN",
        ),
        (
            run(
                [2, 4, 5, 8],
                [2, 2, 6, 8],
                AttentionMask::key_lengths(&[5, 3], 5, &d),
                o(),
            ),
            "does not broadcast to the scores [B, H, Tq, Tk] = [2, 4, 5, 6]",
        ),
    ];
    for (message, expected) in cases {
        assert!(message.contains(expected), "{message:?} lacks {expected:?}");
    }
    // No head: weights of their empty shape.
    let w = attention_weights(
        randn([2, 0, 5, 8], 1, &d),
        randn([2, 0, 3, 8], 2, &d),
        &AttentionMask::none(),
        o(),
    );
    assert_eq!(w.dims(), [2, 0, 5, 3]);
}

#[test]
fn head_statistics_check_the_mask_against_the_weights() {
    let d = dev();
    let weights = randn([2, 2, 4, 4], 1, &d);
    let mask = AttentionMask::key_lengths(&[3, 4, 2], 4, &d);
    let message = panic_message(std::panic::AssertUnwindSafe(move || {
        mha::analysis::LayerStats::from_weights("l0", weights, &mask, None);
    }));
    let expected = "does not broadcast to the scores [B, H, Tq, Tk] = [2, 2, 4, 4]";
    assert!(message.contains(expected), "{message:?} lacks {expected:?}");
}

#[test]
fn a_cache_refuses_another_dtype_mid_sequence_and_takes_it_after_a_reset() {
    use burn::tensor::{DType, FloatDType};
    use mha::{CacheError, KvCache, ModuleDType};
    let d = dev();
    let m = MultiHeadAttentionConfig::new(16, 2).init(&d);
    let Some(half) = [FloatDType::F16, FloatDType::BF16, FloatDType::F64]
        .into_iter()
        .find(|&t| m.clone().try_to_dtype(t).is_ok())
    else {
        panic!("the device computes in no dtype but f32");
    };
    let other = m.clone().to_dtype(half);
    let x = randn([1, 3, 16], 1, &d);
    let mut cache = KvCache::new(8);
    m.forward_cached(x.clone(), &mut cache, AttentionMask::none())
        .unwrap();
    let err = other
        .forward_cached(x.clone().cast(half), &mut cache, AttentionMask::none())
        .unwrap_err();
    assert_eq!(
        err,
        CacheError::DType {
            cached: DType::F32,
            got: DType::from(half)
        }
    );
    assert!(
        err.to_string().contains(&format!(
            "it holds keys and values in F32, the call brings {:?}",
            DType::from(half)
        )),
        "{err}"
    );
    assert_eq!(cache.len(), 3, "the refused call wrote nothing");
    cache.reset();
    let out = other
        .forward_cached(x.cast(half), &mut cache, AttentionMask::none())
        .unwrap();
    assert_eq!(out.dtype(), DType::from(half));
}

#[test]
fn a_cached_call_checks_its_mask_before_it_writes() {
    use mha::KvCache;
    let d = dev();
    let m = MultiHeadAttentionConfig::new(16, 2).init(&d);
    let mut cache = KvCache::new(8);
    m.forward_cached(randn([1, 3, 16], 1, &d), &mut cache, AttentionMask::none())
        .unwrap();
    // Sized for the 3 keys cached so far, where the call sees 4: refused before the cache
    // changes (it wrote the token first, so that a retry wrote it twice).
    let short = AttentionMask::key_lengths(&[3], 3, &d);
    let one = randn([1, 1, 16], 2, &d);
    let message = panic_message(std::panic::AssertUnwindSafe(|| {
        let _ = m.forward_cached(one.clone(), &mut cache, short);
    }));
    let expected = "does not broadcast to the scores [B, H, Tq, Tk] = [1, 2, 1, 4]";
    assert!(message.contains(expected), "{message:?} lacks {expected:?}");
    assert_eq!(cache.len(), 3, "the refused call wrote nothing");
    let fits = AttentionMask::key_lengths(&[4], 4, &d);
    m.forward_cached(one, &mut cache, fits).unwrap();
    assert_eq!(cache.len(), 4);
}

/// Two backends compiled in: a cache filled on one and called on the other.
#[cfg(all(feature = "flex", any(feature = "ndarray", feature = "wgpu")))]
#[test]
fn a_cache_refuses_another_device_mid_sequence_and_takes_it_after_a_reset() {
    use mha::{CacheError, KvCache};
    let devices: Vec<Device> = crate::util::backends().map(|be| be.device).collect();
    assert!(devices.len() >= 2, "{devices:?}");
    for pair in devices.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        let on_a = MultiHeadAttentionConfig::new(16, 2).init(a);
        let on_b = MultiHeadAttentionConfig::new(16, 2).init(b);
        let mut cache = KvCache::new(8);
        on_a.forward_cached(randn([1, 3, 16], 1, a), &mut cache, AttentionMask::none())
            .unwrap();
        let err = on_b
            .forward_cached(randn([1, 1, 16], 2, b), &mut cache, AttentionMask::none())
            .unwrap_err();
        assert_eq!(
            err,
            CacheError::Device {
                cached: format!("{a:?}"),
                got: format!("{b:?}"),
            }
        );
        let expected = format!("it holds keys and values on {a:?}, the call brings them on {b:?}");
        assert!(err.to_string().contains(&expected), "{err}");
        assert_eq!(cache.len(), 3, "the refused call wrote nothing");
        // A new sequence on the other device.
        cache.reset();
        let x = randn([1, 3, 16], 3, b);
        let got = on_b
            .forward_cached(x.clone(), &mut cache, AttentionMask::none())
            .unwrap();
        let want = on_b.causal_self_attention(x);
        crate::util::assert_close("after a reset", got, want, 1e-4);
    }
}

#[test]
fn norms_refuse_an_epsilon_that_gives_nan() {
    let cases = [
        (
            -1e-6,
            "LayerNorm::rms: epsilon must be finite and at least 0, got -0.000001",
        ),
        (
            f64::NAN,
            "LayerNorm::rms: epsilon must be finite and at least 0, got NaN",
        ),
    ];
    for (epsilon, expected) in cases {
        let message = panic_message(std::panic::AssertUnwindSafe(move || {
            mha::norm::LayerNorm::rms(8, epsilon, &dev());
        }));
        assert!(message.contains(expected), "{message:?} lacks {expected:?}");
    }
    let message = panic_message(std::panic::AssertUnwindSafe(|| {
        let config = burn::nn::LayerNormConfig::new(8).with_epsilon(-1e-5);
        mha::norm::LayerNorm::new(&config, &dev());
    }));
    let expected = "LayerNorm::new: epsilon must be finite and at least 0, got -0.00001";
    assert!(message.contains(expected), "{message:?} lacks {expected:?}");
    // 0 is an epsilon (RMS norms without one).
    mha::norm::LayerNorm::rms(8, 0.0, &dev());
}

#[test]
fn imports_refuse_layers_and_sinks_the_module_cannot_take() {
    let d = dev();
    // A stack of one layer given the weights of two.
    let f = Fixture::load("encoder_stack_pre_gelu");
    let block = EncoderBlockConfig::new(16, 4)
        .with_d_ff(Some(32))
        .with_causal(true);
    let err = EncoderConfig::new(block.clone(), 1)
        .init(&d)
        .load_pytorch(&f.weights, "model.")
        .unwrap_err();
    let message = err.to_string();
    assert!(
        message.starts_with("unexpected key `model.layers.1.")
            && message.ends_with(
                "`: a layer past the module's last (configure as many layers as the weights \
                 hold)"
            ),
        "{message}"
    );
    // An encoder block given a decoder layer's weights (its self-attention and
    // feed-forward have the same keys).
    let f = Fixture::load("decoder_layer_pre_gelu");
    let err = EncoderBlockConfig::new(16, 4)
        .with_d_ff(Some(32))
        .init(&d)
        .load_pytorch(&f.weights, "model.")
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "unexpected key `model.multihead_attn.out_proj.weight`: an encoder block has no \
         cross-attention (a decoder layer loads into DecoderBlock)"
    );
    // Sinks of +inf or NaN.
    for (sink, shown) in [(f32::INFINITY, "inf"), (f32::NAN, "NaN")] {
        let floats = |values: &[f32]| values.iter().flat_map(|x| x.to_le_bytes()).collect();
        let tensors: [(&str, Vec<usize>, Vec<u8>); 3] = [
            ("in_proj_weight", vec![24, 8], floats(&[0.1; 192])),
            ("out_proj.weight", vec![8, 8], floats(&[0.1; 64])),
            ("sinks", vec![2], floats(&[0.5, sink])),
        ];
        let views = tensors.iter().map(|(k, s, b)| {
            let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b);
            (k.to_string(), view.unwrap())
        });
        let bytes = safetensors::serialize(views, None).unwrap();
        let weights = PyTorchWeights::from_bytes(&bytes, "sinks").unwrap();
        let err = MultiHeadAttentionConfig::new(8, 2)
            .with_bias(false)
            .with_sinks(true)
            .init(&d)
            .load_pytorch(&weights, "")
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "key `sinks`: the attention sinks' logits must be finite (or -inf: no sink), \
                 head 1's is {shown}"
            )
        );
    }
}

/// Weights that are NaN or infinite, or finite but past the range of the dtype they load
/// into (70000 into f16, 1e39 into f32), are refused naming the key, the element and its
/// value (they loaded, as PyTorch's `load_state_dict` copies them: a NaN weight made every
/// output NaN); the largest value a dtype holds loads.
#[test]
fn imports_refuse_weights_that_are_not_finite_in_the_modules_dtype() {
    use mha::ModuleDType;
    use safetensors::Dtype;
    let floats =
        |values: &[f32]| -> Vec<u8> { values.iter().flat_map(|x| x.to_le_bytes()).collect() };
    // An attention module's weights: `out_proj.weight` [8, 8] as `out` (of `dtype`), and
    // sinks where given.
    let weights = |dtype: Dtype, out: Vec<u8>, sinks: Option<[f32; 2]>| {
        let mut tensors = vec![
            (
                "in_proj_weight",
                Dtype::F32,
                vec![24, 8],
                floats(&[0.1; 192]),
            ),
            ("out_proj.weight", dtype, vec![8, 8], out),
        ];
        if let Some(sinks) = sinks {
            tensors.push(("sinks", Dtype::F32, vec![2], floats(&sinks)));
        }
        let views = tensors.iter().map(|(key, dtype, shape, bytes)| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes);
            (key.to_string(), view.unwrap())
        });
        PyTorchWeights::from_bytes(&safetensors::serialize(views, None).unwrap(), "t").unwrap()
    };
    let f32s = |at: usize, x: f32| -> Vec<u8> {
        let mut values = [0.25f32; 64];
        values[at] = x;
        floats(&values)
    };
    let f64s = |at: usize, x: f64| -> Vec<u8> {
        let mut values = [0.25f64; 64];
        values[at] = x;
        values.iter().flat_map(|x| x.to_le_bytes()).collect()
    };
    let load = |weights: &PyTorchWeights, device: &Device, half: bool| {
        let sinks = weights.contains("sinks");
        let module = MultiHeadAttentionConfig::new(8, 2)
            .with_bias(false)
            .with_sinks(sinks)
            .init(device);
        let module = match half {
            true => module.to_dtype(burn::tensor::FloatDType::F16),
            false => module,
        };
        module.load_pytorch(weights, "").map(|_| ())
    };
    let d = dev();
    let cases = [
        (
            weights(Dtype::F32, f32s(21, f32::NAN), None),
            "key `out_proj.weight`: element [2, 5] is NaN: weights must be finite",
        ),
        (
            weights(Dtype::F32, f32s(0, f32::NEG_INFINITY), None),
            "key `out_proj.weight`: element [0, 0] is -inf: weights must be finite",
        ),
        (
            weights(Dtype::F64, f64s(63, 1e39), None),
            "key `out_proj.weight`: element [7, 7] is 1e39, past the range of f32, the dtype \
             it loads into (load it into a wider one)",
        ),
    ];
    for (weights, want) in cases {
        let err = load(&weights, &d, false).unwrap_err();
        assert!(matches!(err, ImportError::Value { .. }), "{err:?}");
        assert_eq!(err.to_string(), want);
        // Read alone, the values are as they are.
        let read =
            weights.tensor_as::<2>("out_proj.weight", [8, 8], burn::tensor::FloatDType::F32, &d);
        assert!(read.is_ok(), "{want}");
    }
    // f32's largest value loads, and a sink of -inf (no sink).
    load(
        &weights(Dtype::F64, f64s(5, f32::MAX.into()), None),
        &d,
        false,
    )
    .unwrap();
    let no_sink = Some([0.5, f32::NEG_INFINITY]);
    load(&weights(Dtype::F32, f32s(5, 1.0), no_sink), &d, false).unwrap();
    // Into f16, on each device that computes in it: 65504 (f16's largest) loads, 70000
    // does not, in a weight or a sink.
    let mut tried = 0;
    for b in crate::util::backends().filter(|b| b.device.supports_dtype(burn::tensor::DType::F16)) {
        tried += 1;
        let label = b.name;
        let fits = weights(
            Dtype::F32,
            f32s(10, -65504.0),
            Some([65504.0, f32::NEG_INFINITY]),
        );
        load(&fits, &b.device, true).unwrap_or_else(|e| panic!("[{label}] {e}"));
        let err = load(
            &weights(Dtype::F32, f32s(10, 70000.0), None),
            &b.device,
            true,
        );
        assert_eq!(
            err.unwrap_err().to_string(),
            "key `out_proj.weight`: element [1, 2] is 70000.0, past the range of f16, the \
             dtype it loads into (load it into a wider one)",
            "[{label}]"
        );
        let sink = weights(Dtype::F32, f32s(10, 1.0), Some([0.5, 1e5]));
        assert_eq!(
            load(&sink, &b.device, true).unwrap_err().to_string(),
            "key `sinks`: element [1] is 100000.0, past the range of f16, the dtype it loads \
             into (load it into a wider one)",
            "[{label}]"
        );
        // Below it: -inf in f16, no sink, as the stored value acts.
        let below = weights(Dtype::F32, f32s(10, 1.0), Some([0.5, -1e5]));
        load(&below, &b.device, true).unwrap_or_else(|e| panic!("[{label}] {e}"));
    }
    assert!(tried > 0, "no backend computes in f16 (flex does)");
}

/// Numbers of a `config.json` no model can be built with are named as the file names
/// them (they were named by the blocks' fields: `EncoderBlockConfig.d_ff`), with the
/// file's names of the other fields the message speaks of; a BERT of no layers has its
/// numbers checked all the same (a negative epsilon panicked in its embeddings' norm).
#[test]
fn config_numbers_no_model_takes_are_named_as_the_file_names_them() {
    let d = dev();
    let edited = |fixture: &str, edit: &[(&str, serde_json::Value)]| -> Vec<u8> {
        let path = crate::util::root().join(format!("tests/fixtures/{fixture}.json"));
        let mut json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        let object = json.as_object_mut().unwrap();
        for (field, value) in edit {
            match value.is_null() {
                true => object.remove(*field),
                false => object.insert(field.to_string(), value.clone()),
            };
        }
        serde_json::to_vec(&json).unwrap()
    };
    let llama = |edit: &[(&str, serde_json::Value)]| {
        let bytes = edited("mistral_lm", edit);
        mha::hf::HfConfig::from_json(&bytes, "config.json")
            .and_then(|c| c.init_causal_lm(&d))
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let gpt2 = |edit: &[(&str, serde_json::Value)]| {
        let config: mha::hf::Gpt2Config = serde_json::from_slice(&edited("gpt2_lm", edit)).unwrap();
        config
            .init_causal_lm(&d)
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let bert = |edit: &[(&str, serde_json::Value)]| {
        let config: mha::hf::BertConfig =
            serde_json::from_slice(&edited("bert_model", edit)).unwrap();
        config.init_model(&d).map(|_| ()).unwrap_err().to_string()
    };
    let null = serde_json::Value::Null;
    let cases = [
        (
            llama(&[("intermediate_size", 0.into())]),
            "`intermediate_size` of config.json: must be at least 1, got 0 (as the model's \
             EncoderBlockConfig.d_ff)",
        ),
        (
            // Mistral's default of 8 key-value heads, for 4 heads.
            llama(&[
                ("num_attention_heads", 4.into()),
                ("num_key_value_heads", null),
            ]),
            "`num_attention_heads` of config.json: 4 is not divisible by n_kv_heads = 8 (as \
             the model's EncoderBlockConfig.n_heads; n_kv_heads is `num_key_value_heads`)",
        ),
        (
            llama(&[("num_hidden_layers", 0.into())]),
            "`num_hidden_layers` of config.json: must be at least 1, got 0",
        ),
        (
            llama(&[("rope_parameters", serde_json::json!({"rope_theta": 1.0}))]),
            "`rope_parameters` of config.json: RoPE's base must be above 1, got 1",
        ),
        (
            llama(&[
                ("rope_parameters", serde_json::Value::Null),
                ("rope_theta", (-2.0).into()),
            ]),
            "`rope_theta` of config.json: RoPE's base must be above 1, got -2",
        ),
        (
            llama(&[("head_dim", 9.into())]),
            "`head_dim` of config.json: RoPE needs heads of an even width, got 9",
        ),
        (
            llama(&[
                ("hidden_size", 36.into()),
                ("num_attention_heads", 4.into()),
                ("head_dim", serde_json::Value::Null),
            ]),
            "`hidden_size` of config.json: RoPE needs heads of an even width, got 36 / \
             num_attention_heads 4 = 9",
        ),
        (
            gpt2(&[("n_inner", 0.into())]),
            "`n_inner` of config.json: must be at least 1, got 0",
        ),
        // Sizes whose products overflow (in a debug build they panicked, "attempt to
        // multiply with overflow"; in a release build they wrapped).
        (
            llama(&[("head_dim", (1u64 << 62).into())]),
            "`head_dim` of config.json: d_model = 32 · n_heads + 2 n_kv_heads = 8 · \
             head_dim = 4611686018427387904 make a weight of more than the \
             1152921504606846975 elements a tensor can hold",
        ),
        (
            gpt2(&[
                ("n_embd", (1u64 << 62).into()),
                ("n_head", 1.into()),
                ("n_inner", serde_json::Value::Null),
            ]),
            "`n_embd` of config.json: 4611686018427387904 is too large: the feed-forward's \
             width (n_inner, unset: 4 n_embd) overflows a usize",
        ),
        (
            gpt2(&[("n_inner", (1u64 << 62).into())]),
            "`n_inner` of config.json: d_model = 32 · d_ff = 4611686018427387904 make a \
             weight of more than the 1152921504606846975 elements a tensor can hold",
        ),
        (
            bert(&[
                ("num_hidden_layers", 0.into()),
                ("layer_norm_eps", (-1.0).into()),
            ]),
            "`layer_norm_eps` of config.json:",
        ),
    ];
    for (got, want) in cases {
        assert!(got.contains(want), "{got:?} lacks {want:?}");
    }
}

#[test]
fn language_models_refuse_token_ids_past_their_tables_by_place() {
    use burn::tensor::{Int, Tensor, TensorData};
    let d = dev();
    let ids = |values: Vec<i64>, shape: [usize; 2]| {
        Tensor::<2, Int>::from_data(TensorData::new(values, shape), &d)
    };
    let config: mha::hf::HfConfig = serde_json::from_str(
        r#"{"model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "rms_norm_eps": 1e-6,
            "vocab_size": 10}"#,
    )
    .unwrap();
    let lm = config.init_causal_lm(&d).unwrap();
    let (lm1, tokens) = (lm.clone(), ids(vec![1, 2, 3, 4, 5, 10], [2, 3]));
    let message = panic_message(std::panic::AssertUnwindSafe(move || {
        lm1.forward(tokens, AttentionMask::none());
    }));
    let expected = "CausalLm: tokens[1, 2] = 10 is not below vocab_size = 10";
    assert!(message.contains(expected), "{message:?} lacks {expected:?}");
    let tokens = ids(vec![3, -1], [1, 2]);
    let message = panic_message(std::panic::AssertUnwindSafe(move || {
        let mut cache = lm.cache(8);
        let _ = lm.forward_cached(tokens, &mut cache);
    }));
    let expected = "CausalLm: tokens[0, 1] = -1 is not below vocab_size = 10";
    assert!(message.contains(expected), "{message:?} lacks {expected:?}");

    let config: mha::hf::BertConfig = serde_json::from_str(
        r#"{"hidden_size": 16, "num_attention_heads": 2, "num_hidden_layers": 1,
            "intermediate_size": 32, "layer_norm_eps": 1e-12, "vocab_size": 10}"#,
    )
    .unwrap();
    let bert = config.init_model(&d).unwrap();
    let cases = [
        (
            ids(vec![0, 1, 2, 12], [2, 2]),
            ids(vec![0; 4], [2, 2]),
            "BertModel: tokens[1, 1] = 12 is not below vocab_size = 10",
        ),
        (
            ids(vec![0; 4], [2, 2]),
            ids(vec![0, 0, 2, 0], [2, 2]),
            "BertModel: token_types[1, 0] = 2 is not below type_vocab_size = 2",
        ),
    ];
    for (tokens, types, expected) in cases {
        let bert = bert.clone();
        let message = panic_message(std::panic::AssertUnwindSafe(move || {
            bert.forward(tokens, types, AttentionMask::none());
        }));
        assert!(message.contains(expected), "{message:?} lacks {expected:?}");
    }
}

#[test]
fn tensors_on_another_device_are_refused_naming_both_devices() {
    let devices: Vec<Device> = crate::util::backends().map(|b| b.device).collect();
    if devices.len() < 2 {
        eprintln!("one backend compiled in: no other device to refuse");
    }
    // The module and the query on each device in turn, the other tensor on each other.
    for d in &devices {
        for o in devices.iter().filter(|o| *o != d) {
            refused_on(d.clone(), o.clone());
        }
    }
}

/// The calls of a module on `d` (and queries on `d`) given one tensor on `o`.
fn refused_on(d: Device, o: Device) {
    use burn::tensor::Tensor;
    use mha::{SdpaOptions, scaled_dot_product_attention};
    let m = MultiHeadAttentionConfig::new(8, 2).init(&d);
    let x = randn([1, 3, 8], 1, &d);
    let q = randn([1, 2, 3, 4], 2, &d);
    // Nothing blocked: only the device is wrong.
    let blocked = |device: &Device| randn([1, 1, 1, 3], 9, device).greater_elem(1e9);
    let sdpa = |k: Tensor<4>, mask: AttentionMask| {
        let q = q.clone();
        panic_message(move || {
            scaled_dot_product_attention(q, k.clone(), k, &mask, SdpaOptions::default());
        })
    };
    let forward = |input: MhaInput| {
        let m = m.clone();
        panic_message(move || {
            m.forward(input);
        })
    };
    let cases = [
        (
            sdpa(randn([1, 2, 3, 4], 3, &o), AttentionMask::none()),
            format!("scaled_dot_product_attention: the key is on {o:?} and the query on {d:?}"),
        ),
        (
            sdpa(q.clone(), AttentionMask::bias(randn([1, 1, 3, 3], 4, &o))),
            format!("attention mask: the additive bias is on {o:?} and the scores on {d:?}"),
        ),
        (
            sdpa(q.clone(), AttentionMask::blocking(blocked(&o))),
            format!("attention mask: the boolean mask is on {o:?} and the scores on {d:?}"),
        ),
        (
            sdpa(q.clone(), AttentionMask::sinks(randn([2], 5, &o))),
            format!("attention mask: the sinks tensor is on {o:?} and the scores on {d:?}"),
        ),
        (
            forward(MhaInput::self_attn(randn([1, 3, 8], 6, &o))),
            format!("MultiHeadAttention: the query is on {o:?} and the module on {d:?}"),
        ),
        (
            forward(MhaInput::cross(x.clone(), randn([1, 4, 8], 7, &o))),
            format!("MultiHeadAttention: the context is on {o:?} and the module on {d:?}"),
        ),
        (
            forward(MhaInput::causal(x.clone()).mask(AttentionMask::blocking(blocked(&o)))),
            format!("attention mask: the boolean mask is on {o:?} and the scores on {d:?}"),
        ),
        (
            forward(MhaInput::causal(x.clone()).head_mask(randn([2], 8, &o))),
            format!("MultiHeadAttention: the head mask is on {o:?} and the module on {d:?}"),
        ),
        (
            {
                let there = MultiHeadAttentionConfig::new(8, 2).init(&o);
                let kv = there.memory_kv(randn([1, 4, 8], 10, &o));
                let (m, x) = (m.clone(), x.clone());
                panic_message(move || {
                    m.cross_attention_cached(x, &kv, AttentionMask::none());
                })
            },
            format!(
                "MultiHeadAttention: the memory's keys and values are on {o:?} and the query on \
                 {d:?}"
            ),
        ),
        (
            {
                let block = EncoderBlockConfig::new(8, 2).init(&d);
                let padding = randn([1, 3], 11, &o).greater_elem(1e9);
                let input = BlockInput::new(x.clone())
                    .left_padding(vec![1])
                    .mask(AttentionMask::key_padding(padding));
                panic_message(move || {
                    let _ = block.forward(input);
                })
            },
            format!("attention mask: the boolean mask is on {o:?} and the input on {d:?}"),
        ),
        (
            panic_message(|| {
                let _ =
                    AttentionMask::blocking(blocked(&d)).and(AttentionMask::blocking(blocked(&o)));
            }),
            format!("AttentionMask::and: the boolean masks are on {d:?} and {o:?}"),
        ),
    ];
    for (got, want) in cases {
        assert!(got.contains(&want), "{got:?} lacks {want:?}");
    }
}

#[test]
fn cross_attention_refuses_the_memory_of_another_module_by_its_heads() {
    let d = dev();
    let attention = MultiHeadAttentionConfig::new(16, 4).init(&d);
    let grouped = MultiHeadAttentionConfig::new(16, 4)
        .with_n_kv_heads(Some(2))
        .init(&d);
    let memory = grouped.memory_kv(randn([2, 5, 16], 1, &d));
    let x = randn([2, 3, 16], 2, &d);
    let message = panic_message(|| {
        attention.cross_attention_cached(x, &memory, AttentionMask::none());
    });
    let expected = "MultiHeadAttention: the memory's keys and values are 2 heads 4 wide and \
                    the module's 4 heads 4 wide (MemoryKv of another module)";
    assert!(message.contains(expected), "{message:?} lacks {expected:?}");
}
