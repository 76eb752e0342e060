//! Zero-sized inputs through every public forward, on every backend: an empty output of
//! the right shape where the output has no element, zeros where no key exists (so a
//! cross-attention over an empty memory gives its output projection's bias), and under
//! autodiff a gradient of every input's and every parameter's shape, zero where the loss
//! does not depend on it. (The attention function's sweep over sizes and mask kinds, with
//! values against f64, is `paths::zero_and_one_sized_calls_match_f64_attention`.)

use burn::module::Param;
use burn::tensor::{Int, Tensor};
use mha::{
    AttentionMask, AttentionWeights, DecoderBlockConfig, DecoderConfig, EncoderBlockConfig,
    EncoderConfig, FeedForwardActivation, KvCache, LayerNorm, MhaInput, MultiHeadAttention,
    MultiHeadAttentionConfig, Positions, StackCache, StackInput,
};

use crate::util::{Backend, backends, param_grads, randn, to_vec};

/// `[B, T, M]`: batch, sequence and memory lengths, at least one of them 0 (and one
/// ordinary case beside them).
const SHAPES: [[usize; 3]; 6] = [
    [2, 0, 3],
    [0, 3, 3],
    [2, 3, 0],
    [2, 0, 0],
    [0, 0, 0],
    [1, 1, 1],
];

fn finite(t: Tensor<3>) -> Vec<f32> {
    let v = to_vec(t);
    assert!(v.iter().all(|x| x.is_finite()), "{v:?}");
    v
}

/// Every parameter of `module` has a gradient, finite; zero when `zero`.
fn check_params<M: burn::module::Module>(
    what: &str,
    module: &M,
    grads: &burn::tensor::Gradients,
    zero: bool,
) {
    for g in param_grads(module, grads) {
        let g = to_vec(g);
        assert!(g.iter().all(|x| x.is_finite()), "{what}: {g:?}");
        if zero {
            assert!(g.iter().all(|&x| x == 0.0), "{what}: not zero: {g:?}");
        }
    }
}

fn attention(be: &Backend, positions: Positions) -> MultiHeadAttention {
    let mut m = MultiHeadAttentionConfig::new(16, 2)
        .with_positions(positions)
        .init(&be.autodiff());
    // A bias that is not zero: what the output is where no key exists.
    m.out_proj.bias = Some(Param::from_tensor(randn([16], 7, &be.autodiff())));
    m
}

#[test]
fn attention_modules_take_zero_sized_batches_sequences_and_memories() {
    for be in backends() {
        let ad = be.autodiff();
        for [b, t, m] in SHAPES {
            let what = format!("{} [B {b}, T {t}, M {m}]", be.name);
            for positions in [
                Positions::None,
                Positions::rope(),
                Positions::Alibi,
                Positions::t5(true),
            ] {
                let what = format!("{what} self-attention with {positions:?}");
                let module = attention(&be, positions);
                let x = randn([b, t, 16], 1, &ad).require_grad();
                let input = MhaInput::causal(x.clone()).weights(AttentionWeights::PerHead);
                let out = module.forward(input);
                assert_eq!(out.context.dims(), [b, t, 16], "{what}");
                assert_eq!(out.weights.unwrap().dims(), [b, 2, t, t], "{what}");
                finite(out.context.clone());
                let grads = out.context.sum().backward();
                assert_eq!(x.grad(&grads).expect("dx").dims(), [b, t, 16], "{what}");
                check_params(&what, &module, &grads, b * t == 0);
            }
            // Cross-attention: no key gives zeros before the output projection.
            let what = format!("{what} cross-attention");
            let module = attention(&be, Positions::None);
            let x = randn([b, t, 16], 1, &ad).require_grad();
            let memory = randn([b, m, 16], 2, &ad).require_grad();
            let out = module.forward(MhaInput::cross(x.clone(), memory.clone()));
            assert_eq!(out.context.dims(), [b, t, 16], "{what}");
            let got = finite(out.context.clone());
            if m == 0 {
                let bias = to_vec(module.out_proj.bias.as_ref().unwrap().val());
                for (i, g) in got.iter().enumerate() {
                    assert_eq!(*g, bias[i % 16], "{what}: element {i}");
                }
            }
            let grads = out.context.sum().backward();
            assert_eq!(x.grad(&grads).expect("dx").dims(), [b, t, 16], "{what}");
            let dm = memory.grad(&grads).expect("dmemory");
            assert_eq!(dm.dims(), [b, m, 16], "{what}");
            assert!(
                m == 0 || t > 0 || to_vec(dm).iter().all(|&g| g == 0.0),
                "{what}"
            );
            // PyTorch's call form, and the memory projected once for decoding: the same.
            let want = out_context(&module, &x, &memory);
            let form = module.forward(MhaInput::new(x.clone(), memory.clone(), memory.clone()));
            crate::util::assert_close(&what, form.context, want.clone(), be.forward_tol());
            let kv = module.memory_kv(memory.clone());
            let cached = module.cross_attention_cached(x.clone(), &kv, AttentionMask::none());
            crate::util::assert_close(&what, cached, want, be.forward_tol());
        }
    }
}

/// Zero-sized calls in another float dtype give their output in that dtype (they gave f32),
/// and differentiate (a sum of links of two dtypes failed inside Burn).
#[test]
fn zero_sized_calls_keep_their_dtype() {
    use burn::tensor::DType;
    use mha::ModuleDType;
    for be in backends() {
        let ad = be.autodiff();
        for dtype in be.other_float_dtypes() {
            for [b, t, m] in SHAPES {
                let what = format!("{} {dtype:?} [B {b}, T {t}, M {m}]", be.name);
                let module = attention(&be, Positions::Alibi).to_dtype(dtype);
                let x = randn([b, t, 16], 1, &ad).cast(dtype).require_grad();
                let memory = randn([b, m, 16], 2, &ad).cast(dtype).require_grad();
                let input = MhaInput::causal(x.clone()).weights(AttentionWeights::PerHead);
                let out = module.forward(input);
                assert_eq!(out.context.dtype(), DType::from(dtype), "{what}: self");
                assert_eq!(out.weights.unwrap().dtype(), DType::from(dtype), "{what}");
                let cross = MhaInput::cross(x.clone(), memory.clone());
                let plain = attention(&be, Positions::None).to_dtype(dtype);
                let cross = plain.forward(cross.weights(AttentionWeights::Averaged));
                assert_eq!(cross.context.dtype(), DType::from(dtype), "{what}: cross");
                assert_eq!(cross.weights.unwrap().dtype(), DType::from(dtype), "{what}");
                let loss = out.context.sum() + cross.context.sum();
                let grads = loss.backward();
                assert_eq!(x.grad(&grads).expect("dx").dims(), [b, t, 16], "{what}");
                let dm = memory.grad(&grads).expect("dmemory");
                assert_eq!(dm.dims(), [b, m, 16], "{what}");
            }
        }
    }
}

/// The cross-attention of `x` to `memory`.
fn out_context(module: &MultiHeadAttention, x: &Tensor<3>, memory: &Tensor<3>) -> Tensor<3> {
    module
        .forward(MhaInput::cross(x.clone(), memory.clone()))
        .context
}

/// Masks over no keys or no queries are made from tensors of any rank (a `[B, 0]` key
/// padding, PyTorch's for an empty memory, failed inside Burn) and change nothing; a bias
/// over nothing keeps its gradient; the rule of a mask over them is an empty boolean
/// tensor.
#[test]
fn masks_over_no_keys_or_no_queries_are_made_and_applied() {
    for be in backends() {
        let d = &be.device;
        for [b, t, m] in SHAPES {
            let what = format!("{} [B {b}, T {t}, M {m}]", be.name);
            let module = attention(&be, Positions::None);
            let x = randn([b, t, 16], 1, d);
            let memory = randn([b, m, 16], 2, d);
            let want = out_context(&module, &x, &memory);
            let nothing = |rows| Tensor::<2>::zeros([rows, m], d).equal_elem(1.0);
            let masks = [
                (
                    "key padding [B, Tk]",
                    AttentionMask::key_padding(nothing(b)),
                ),
                ("blocking [Tq, Tk]", AttentionMask::blocking(nothing(t))),
                (
                    "bias [Tq, Tk]",
                    AttentionMask::bias(Tensor::<2>::zeros([t, m], d)),
                ),
            ];
            for (name, mask) in masks {
                let input = MhaInput::cross(x.clone(), memory.clone()).mask(mask);
                let got = module.forward(input).context;
                let what = format!("{what} {name}");
                crate::util::assert_close(&what, got, want.clone(), be.forward_tol());
            }
            // Under autodiff a bias of any rank over nothing has its gradient, of its shape.
            let ad = be.autodiff();
            let module = attention(&be, Positions::None);
            let (x, memory) = (randn([b, t, 16], 1, &ad), randn([b, m, 16], 2, &ad));
            let rank2 = Tensor::<2>::zeros([t, m], &ad).require_grad();
            let rank4 = Tensor::<4>::zeros([b, 1, t, m], &ad).require_grad();
            let mask = AttentionMask::bias(rank2.clone()).and(AttentionMask::bias(rank4.clone()));
            let out = module
                .forward(MhaInput::cross(x, memory).mask(mask))
                .context;
            let grads = out.sum().backward();
            let dims = |g: Option<Tensor<2>>| g.map(|g| g.dims());
            assert_eq!(dims(rank2.grad(&grads)), Some([t, m]), "{what}");
            let dims = rank4.grad(&grads).map(|g| g.dims());
            assert_eq!(dims, Some([b, 1, t, m]), "{what}");
            let blocked = AttentionMask::causal().to_blocked(t, m, d).unwrap();
            assert_eq!(blocked.dims(), [1, 1, t, m], "{what}");
            // Elsewhere, the keys after each query's, aligned bottom-right.
            let values = to_vec(blocked.float());
            let want: Vec<f32> = (0..t)
                .flat_map(|i| (0..m).map(move |j| f32::from(u8::from(j + t > i + m))))
                .collect();
            assert_eq!(values, want, "{what}");
        }
    }
}

#[test]
fn stacks_and_cached_decoding_take_zero_sized_inputs() {
    for be in backends() {
        let ad = be.autodiff();
        for [b, t, m] in SHAPES {
            let what = format!("{} [B {b}, T {t}, M {m}]", be.name);
            let block = EncoderBlockConfig::new(16, 2).with_dropout(0.0);
            let encoder = EncoderConfig::new(block, 2).init(&ad);
            let block = DecoderBlockConfig::new(16, 2).with_dropout(0.0);
            let decoder = DecoderConfig::new(block, 2).init(&ad);
            let source = randn([b, m, 16], 1, &ad).require_grad();
            let x = randn([b, t, 16], 2, &ad).require_grad();
            let memory = encoder
                .forward(StackInput::new(source.clone()))
                .unwrap()
                .output;
            assert_eq!(memory.dims(), [b, m, 16], "{what}");
            let input = StackInput::new(x.clone())
                .mask(AttentionMask::causal())
                .memory(memory);
            let out = decoder.forward(input).unwrap().output;
            assert_eq!(out.dims(), [b, t, 16], "{what}");
            finite(out.clone());
            let grads = out.sum().backward();
            assert_eq!(x.grad(&grads).expect("dx").dims(), [b, t, 16], "{what}");
            let ds = source.grad(&grads).expect("dsource");
            assert_eq!(ds.dims(), [b, m, 16], "{what}");
            check_params(&what, &encoder, &grads, b * m == 0 || t == 0);
            check_params(&what, &decoder, &grads, b * t == 0);

            // A gated feed-forward (SwiGLU, Llama's), whose SiLU and product are one
            // operation on the CPU backends.
            let block = EncoderBlockConfig::new(16, 2)
                .with_dropout(0.0)
                .with_activation(FeedForwardActivation::Silu)
                .with_gated(true);
            let gated = EncoderConfig::new(block, 1).init(&ad);
            let x = randn([b, t, 16], 4, &ad).require_grad();
            let out = gated.forward(StackInput::new(x.clone())).unwrap().output;
            assert_eq!(out.dims(), [b, t, 16], "{what}: gated");
            finite(out.clone());
            let grads = out.sum().backward();
            assert_eq!(x.grad(&grads).expect("dx").dims(), [b, t, 16], "{what}");
            check_params(&what, &gated, &grads, b * t == 0);

            // Decoding: an empty prompt, then a token, with a cache by position and a
            // sliding one: the empty prompt changes nothing (the token decodes as with a
            // fresh cache).
            let device = &be.device;
            let rows = b.max(1);
            let module = MultiHeadAttentionConfig::new(16, 2)
                .with_positions(Positions::rope())
                .init(device);
            let token = randn([rows, 1, 16], 3, device);
            for fresh in [KvCache::new(8), KvCache::sliding(4)] {
                let mut cache = fresh.clone();
                let prompt = randn([rows, t, 16], 1, device);
                let out = module.forward_cached(prompt, &mut cache, AttentionMask::causal());
                assert_eq!(out.unwrap().dims(), [rows, t, 16], "{what}");
                assert_eq!(cache.len(), t, "{what}");
                if t == 0 {
                    // Each step queued alone, what came before it run first: on a GPU
                    // backend, operations queued together are fused together, and two
                    // steps fused with different neighbours may take kernels that
                    // round differently.
                    let step = |cache: &mut KvCache| {
                        device.sync().unwrap();
                        let mask = AttentionMask::causal();
                        let out = module.forward_cached(token.clone(), cache, mask).unwrap();
                        device.sync().unwrap();
                        out
                    };
                    let want = step(&mut fresh.clone());
                    crate::util::assert_close(&what, step(&mut cache), want, 0.0);
                }
                // An empty call on a cache that holds positions, its mask over the keys
                // it sees (they are the cache's): nothing written, nothing out.
                let held = cache.len();
                for mask in [
                    AttentionMask::key_lengths(&vec![held; rows], cache.keys_seen(0), device),
                    AttentionMask::causal(),
                ] {
                    let empty = randn([rows, 0, 16], 5, device);
                    let out = module.forward_cached(empty, &mut cache, mask).unwrap();
                    assert_eq!(out.dims(), [rows, 0, 16], "{what}: an empty call");
                    assert_eq!(cache.len(), held, "{what}: an empty call");
                }
            }
            let block = DecoderBlockConfig::new(16, 2)
                .with_dropout(0.0)
                .with_positions(Positions::rope());
            let decoder = DecoderConfig::new(block, 2).init(device);
            let mut cache = StackCache::new(2, KvCache::new(8));
            let input = StackInput::new(randn([rows, t, 16], 1, device))
                .memory(randn([rows, m, 16], 2, device))
                .cache(&mut cache);
            let out = decoder.forward(input).unwrap().output;
            assert_eq!(out.dims(), [rows, t, 16], "{what}");
            finite(out);
            // Then an empty call, asking for the weights: over the keys it sees, none
            // weighed ([B, H, 0, keys seen]).
            let seen = cache.layers()[0].keys_seen(0);
            let input = StackInput::new(randn([rows, 0, 16], 1, device))
                .memory(randn([rows, m, 16], 2, device))
                .mask(AttentionMask::key_lengths(&vec![t; rows], seen, device))
                .weights()
                .cache(&mut cache);
            let out = decoder.forward(input).unwrap();
            assert_eq!(out.output.dims(), [rows, 0, 16], "{what}: an empty call");
            assert_eq!(
                out.weights[0].dims(),
                [rows, 2, 0, seen],
                "{what}: an empty call"
            );
            assert_eq!(cache.len(), t, "{what}: an empty call");
        }
    }
}

/// Stacks with absolute positions (sinusoidal, learned) take sequences of 0 tokens (a
/// reshape inside Burn failed on them), and a linear without input features gives its
/// bias on every row, as PyTorch's `F.linear` (it gave zeros), with the bias's gradient.
#[test]
fn absolute_positions_and_linears_without_inputs_take_zero_sizes() {
    for be in backends() {
        let ad = be.autodiff();
        for positions in [Positions::Sinusoidal, Positions::Learned { max_len: 8 }] {
            let block = EncoderBlockConfig::new(16, 2)
                .with_dropout(0.0)
                .with_positions(positions.clone());
            let stack = EncoderConfig::new(block, 1).init(&ad);
            for [b, t, _] in SHAPES {
                let what = format!("{} [B {b}, T {t}] {positions:?}", be.name);
                let x = randn([b, t, 16], 1, &ad).require_grad();
                let out = stack.forward(StackInput::new(x.clone())).unwrap().output;
                assert_eq!(out.dims(), [b, t, 16], "{what}");
                finite(out.clone());
                let grads = out.sum().backward();
                assert_eq!(x.grad(&grads).expect("dx").dims(), [b, t, 16], "{what}");
            }
        }
        let x = Tensor::<2>::zeros([2, 0], &ad).require_grad();
        let weight = Tensor::<2>::zeros([0, 3], &ad).require_grad();
        let bias = Tensor::<1>::from_floats([1.0, 2.0, 3.0], &ad).require_grad();
        let y = mha::linear::linear(x.clone(), weight.clone(), Some(bias.clone()));
        assert_eq!(to_vec(y.clone()), [1., 2., 3., 1., 2., 3.], "{}", be.name);
        let upstream = Tensor::<2>::from_floats([[1., 2., 3.], [4., 5., 6.]], &ad);
        let grads = (y * upstream).sum().backward();
        let db = to_vec(bias.grad(&grads).expect("dbias"));
        assert_eq!(db, [5., 7., 9.], "{}", be.name);
        assert_eq!(x.grad(&grads).expect("dx").dims(), [2, 0]);
        assert_eq!(weight.grad(&grads).expect("dweight").dims(), [0, 3]);
        // No output feature (`d_out = 0`): no output, and zero gradients for x and the
        // weight, as PyTorch's `F.linear` (it panicked inside Burn on flex and ndarray).
        for bias in [None, Some(Tensor::<1>::zeros([0], &ad).require_grad())] {
            let what = format!("{} d_out 0, bias {}", be.name, bias.is_some());
            let x = randn([2, 4], 3, &ad).require_grad();
            let weight = Tensor::<2>::zeros([4, 0], &ad).require_grad();
            let y = mha::linear::linear(x.clone(), weight.clone(), bias.clone());
            assert_eq!(y.dims(), [2, 0], "{what}");
            let grads = y.sum().backward();
            let dx = x.grad(&grads).expect("dx");
            assert_eq!(to_vec(dx), vec![0.0; 8], "{what}");
            assert_eq!(
                weight.grad(&grads).expect("dweight").dims(),
                [4, 0],
                "{what}"
            );
            if let Some(bias) = &bias {
                assert_eq!(bias.grad(&grads).expect("dbias").dims(), [0], "{what}");
            }
        }
    }
}

#[test]
fn layer_and_rms_norms_and_cross_entropy_take_no_rows() {
    for be in backends() {
        let ad = be.autodiff();
        for [b, t, _] in SHAPES {
            let what = format!("{} [B {b}, T {t}]", be.name);
            let layer = LayerNorm::new(&burn::nn::LayerNormConfig::new(16), &ad);
            for norm in [layer, LayerNorm::rms(16, 1e-6, &ad)] {
                let what = format!("{what} {:?}", norm.kind());
                let x = randn([b, t, 16], 1, &ad).require_grad();
                let y = norm.forward(x.clone());
                assert_eq!(y.dims(), [b, t, 16], "{what}");
                let grads = y.sum().backward();
                assert_eq!(x.grad(&grads).expect("dx").dims(), [b, t, 16], "{what}");
                check_params(&what, &norm, &grads, b * t == 0);
            }
            if b * t > 0 {
                continue;
            }
            // No row: a loss of 0, as when every row is ignored, and a gradient of no row.
            let logits = randn([0, 5], 1, &ad).require_grad();
            let targets = Tensor::<1, Int>::zeros([0], &ad);
            let loss = mha::loss::cross_entropy(logits.clone(), targets, None);
            assert_eq!(to_vec(loss.clone()), vec![0.0], "{what}");
            let grads = loss.backward();
            assert_eq!(
                logits.grad(&grads).expect("dlogits").dims(),
                [0, 5],
                "{what}"
            );
        }
        // Rows without classes have no meaning: refused, naming the shape.
        let refused = std::panic::catch_unwind(|| {
            let logits = Tensor::<2>::zeros([3, 0], &be.device);
            mha::loss::cross_entropy(logits, Tensor::<1, Int>::zeros([3], &be.device), None)
        });
        let err = refused.expect_err("refused");
        let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(
            msg.contains("logits has rows but no class (shape [3, 0])"),
            "{msg}"
        );
    }
}

/// The imported models take sequences of no tokens: BERT (its positions' reshape failed
/// inside Burn), GPT-2 and Llama, each an empty output of its width.
#[test]
fn imported_models_take_no_tokens() {
    use mha::hf::{BertConfig, Gpt2Config, HfConfig};
    let fixture = |name: &str| crate::util::root().join(format!("tests/fixtures/{name}.json"));
    for be in backends() {
        let d = &be.device;
        let none = Tensor::<2, Int>::zeros([2, 0], d);
        let bert = BertConfig::from_file(fixture("bert_model")).unwrap();
        let out =
            bert.init_model(d)
                .unwrap()
                .forward(none.clone(), none.clone(), AttentionMask::none());
        assert_eq!(out.dims(), [2, 0, bert.hidden_size], "{} BERT", be.name);
        let gpt2 = Gpt2Config::from_file(fixture("gpt2_lm")).unwrap();
        let out = gpt2
            .init_causal_lm(d)
            .unwrap()
            .forward(none.clone(), AttentionMask::none());
        assert_eq!(out.dims(), [2, 0, gpt2.vocab_size], "{} GPT-2", be.name);
        let llama = HfConfig::from_file(fixture("llama_lm")).unwrap();
        let out = llama
            .init_causal_lm(d)
            .unwrap()
            .forward(none.clone(), AttentionMask::none());
        assert_eq!(out.dims(), [2, 0, llama.vocab_size], "{} Llama", be.name);
    }
}
