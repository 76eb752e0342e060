//! The PyTorch fixtures of scripts/golden.py, loaded through the public import and
//! compared on every backend: forward outputs, attention weights, gradients of the
//! inputs and of every parameter.

use burn::module::{Module, Param};
use burn::tensor::{Device, Gradients, Tensor};
use mha::hf::{
    BertConfig, Gpt2Config, HfConfig, load_bert_layer, load_bert_model, load_causal_lm,
    load_decoder_layer, load_gpt2_block, load_gpt2_lm,
};
use mha::{
    AttentionMask, AttentionWeights, BlockInput, Buckets, DecoderBlockConfig, EncoderBlock,
    EncoderBlockConfig, EncoderConfig, FeedForwardActivation, ImportError, LoadPyTorch, MhaInput,
    MultiHeadAttentionConfig, Positions, RopeLayout, SdpaOptions, scaled_dot_product_attention,
};

use crate::util::{
    Backend, Fixture, asked_weights, assert_close, assert_grad_close, backends, param_grads,
    param_values,
};

/// `(out * grad_out).sum().backward()`, the loss golden.py differentiates.
fn backward<const D: usize>(f: &Fixture, out: &Tensor<D>, device: &Device) -> Gradients {
    let grad_out = f.io("grad_out", out.dims(), device);
    (out.clone() * grad_out).sum().backward()
}

/// Compares the gradient of every parameter of `module` with PyTorch's, loaded into
/// `fresh` (a module of the same configuration) through the same import.
fn check_param_grads<M: Module + LoadPyTorch>(
    b: &Backend,
    f: &Fixture,
    module: &M,
    fresh: M,
    grads: &Gradients,
) {
    let reference = fresh
        .load_pytorch(&f.weights, "io.grad.model.")
        .unwrap_or_else(|e| panic!("{e}"));
    check_grads_against(b, f, module, &reference, grads);
}

/// Compares the gradient of every parameter of `module` with `reference`'s values (a
/// module of the same configuration holding PyTorch's gradients).
fn check_grads_against<M: Module>(
    b: &Backend,
    f: &Fixture,
    module: &M,
    reference: &M,
    grads: &Gradients,
) {
    let ours = param_grads(module, grads);
    let expected = param_values(reference);
    assert_eq!(ours.len(), expected.len());
    for (n, (a, e)) in ours.into_iter().zip(expected).enumerate() {
        let what = format!("{} [{}] parameter {n}'s grad", f.name, b.name);
        assert_grad_close(b, &what, a, e);
    }
}

fn check_input_grad<const D: usize>(
    b: &Backend,
    f: &Fixture,
    name: &str,
    x: &Tensor<D>,
    grads: &Gradients,
) {
    let dev = x.device();
    let grad = x
        .grad(grads)
        .unwrap_or_else(|| panic!("no gradient for {name}"));
    let expected = f.io(&format!("grad.{name}"), x.dims(), &dev);
    assert_grad_close(
        b,
        &format!("{} [{}] grad {name}", f.name, b.name),
        grad,
        expected,
    );
}

fn check_forward<const D: usize>(
    b: &Backend,
    f: &Fixture,
    what: &str,
    actual: Tensor<D>,
    key: &str,
) {
    let expected = f.io(key, actual.dims(), &actual.device());
    assert_close(
        &format!("{} [{}] {what}", f.name, b.name),
        actual,
        expected,
        b.forward_tol(),
    );
}

#[test]
fn mha_causal_self_attention_with_per_head_weights() {
    let f = Fixture::load("mha_causal_self");
    for b in backends() {
        let dev = b.autodiff();
        let config = MultiHeadAttentionConfig::new(16, 4);
        let mha = config
            .init(&dev)
            .load_pytorch(&f.weights, "model.")
            .unwrap();
        let x = f.io("x", [2, 6, 16], &dev).require_grad();
        let out = mha.forward(MhaInput::causal(x.clone()).weights(AttentionWeights::PerHead));
        check_forward(&b, &f, "out", out.context.clone(), "out");
        check_forward(&b, &f, "weights", out.weights.unwrap(), "weights");
        let grads = backward(&f, &out.context, &dev);
        check_input_grad(&b, &f, "x", &x, &grads);
        check_param_grads(&b, &f, &mha, config.init(&dev), &grads);
    }
}

/// Weights imported into a module fine-tuned with Burn's LoRA (`Module::apply_lora`,
/// before the import): the adapters stay, over PyTorch's weights (their second factor
/// starts at 0: PyTorch's output), and are what trains (the bases frozen).
#[test]
fn lora_adapters_stay_through_the_import() {
    use burn::module::Lora;
    use burn::optim::GradientsParams;
    let f = Fixture::load("mha_causal_self");
    for b in backends() {
        let dev = b.autodiff();
        let adapted = MultiHeadAttentionConfig::new(16, 4)
            .init(&dev)
            .apply_lora(Lora::new(2, 4.0));
        let params = adapted.num_params();
        let mha = adapted.load_pytorch(&f.weights, "model.").unwrap();
        assert_eq!(mha.num_params(), params, "[{}]: adapters lost", b.name);
        let x = f.io("x", [2, 6, 16], &dev).require_grad();
        let out = mha.forward(MhaInput::causal(x));
        check_forward(&b, &f, "out", out.context.clone(), "out");
        let grads = GradientsParams::from_grads(backward(&f, &out.context, &dev), &mha);
        // The packed input projection's and the output projection's adapters, two
        // factors each.
        assert_eq!(grads.len(), 4, "[{}]: trained parameters", b.name);
    }
}

/// PyTorch's weights load into a module with Burn's quiet softmax (`quiet_softmax`), whose
/// sinks stay fixed at 0 (a file's learned sinks are refused: see the gpt-oss test).
#[test]
fn a_quiet_softmax_module_loads_pytorch_weights_with_its_sinks_fixed() {
    let f = Fixture::load("mha_causal_self");
    for b in backends() {
        let dev = b.autodiff();
        let quiet = MultiHeadAttentionConfig::new(16, 4)
            .with_quiet_softmax(true)
            .init(&dev)
            .load_pytorch(&f.weights, "model.")
            .unwrap();
        let sinks = quiet.sinks.as_ref().expect("sinks").val();
        assert!(!sinks.is_require_grad(), "[{}]", b.name);
        assert_eq!(sinks.abs().sum().into_scalar::<f32>(), 0.0, "[{}]", b.name);
        // The weights are PyTorch's: its projections' values.
        let plain = MultiHeadAttentionConfig::new(16, 4)
            .init(&dev)
            .load_pytorch(&f.weights, "model.")
            .unwrap();
        let values = |m: &mha::MultiHeadAttention| param_values(m);
        let (got, want) = (values(&quiet), values(&plain));
        // The quiet module has its sinks last, besides.
        assert_eq!(got.len(), want.len() + 1, "[{}]", b.name);
        for (n, (got, want)) in got.into_iter().zip(want).enumerate() {
            assert_close(&format!("[{}] parameter {n}", b.name), got, want, 0.0);
        }
    }
}

/// A quiet-softmax module computes with sinks of 0 whatever its parameter holds: unfrozen
/// whole (Burn's `unfreeze`, the LoRA recipe's `unfreeze_group`), its sinks get no
/// gradient, and sinks loaded into it (a record of a module with learned sinks) change
/// nothing.
#[test]
fn a_quiet_softmax_module_keeps_its_sinks_at_zero_when_unfrozen_or_loaded() {
    for b in backends() {
        let dev = b.autodiff();
        let quiet = MultiHeadAttentionConfig::new(16, 4)
            .with_quiet_softmax(true)
            .init(&dev)
            .unfreeze();
        let x = crate::util::randn([2, 5, 16], 140, &dev);
        let want = quiet.forward(MhaInput::causal(x.clone())).context;
        let grads = want.clone().powi_scalar(2).sum().backward();
        let sinks = quiet.sinks.as_ref().expect("sinks");
        assert!(sinks.val().is_require_grad(), "[{}] unfrozen", b.name);
        assert!(
            sinks.grad(&grads).is_none(),
            "[{}] a gradient of the sinks",
            b.name
        );
        let mut loaded = quiet.clone();
        loaded.sinks = Some(Param::from_tensor(crate::util::randn([4], 141, &dev) * 3.0));
        let got = loaded.forward(MhaInput::causal(x)).context;
        assert_close(&format!("[{}] sinks loaded", b.name), got, want, 0.0);
    }
}

#[test]
fn mha_cross_attention_kdim_vdim_padding_no_bias_averaged_weights() {
    let f = Fixture::load("mha_cross_kdim_vdim");
    for b in backends() {
        let dev = b.autodiff();
        let config = MultiHeadAttentionConfig::new(16, 2)
            .with_bias(false)
            .with_kdim(Some(12))
            .with_vdim(Some(10));
        let mha = config
            .init(&dev)
            .load_pytorch(&f.weights, "model.")
            .unwrap();
        let q = f.io("query", [2, 5, 16], &dev).require_grad();
        let k = f.io("key", [2, 7, 12], &dev).require_grad();
        let v = f.io("value", [2, 7, 10], &dev).require_grad();
        let padding = f.io_mask("key_padding", [2, 7], &dev);
        let input = MhaInput::new(q.clone(), k.clone(), v.clone())
            .mask(AttentionMask::key_padding(padding))
            .weights(AttentionWeights::Averaged);
        let out = mha.forward(input);
        check_forward(&b, &f, "out", out.context.clone(), "out");
        let weights = out.weights.unwrap().squeeze_dim::<3>(1); // [B, Tq, Tk], as PyTorch
        check_forward(&b, &f, "weights", weights, "weights");
        let grads = backward(&f, &out.context, &dev);
        for (name, x) in [("query", &q), ("key", &k), ("value", &v)] {
            check_input_grad(&b, &f, name, x, &grads);
        }
        check_param_grads(&b, &f, &mha, config.init(&dev), &grads);
    }
}

/// Separate projections (`kdim`, `vdim`) with biases: PyTorch packs the three biases in
/// `in_proj_bias` even then, and each projection takes its own rows (the fixture has
/// none: its weights with biases 0, 1, 2, ... added here).
#[test]
fn separate_projections_take_their_rows_of_the_packed_bias() {
    let file =
        std::fs::read(crate::util::root().join("tests/fixtures/mha_cross_kdim_vdim.safetensors"))
            .unwrap();
    let stored = safetensors::SafeTensors::deserialize(&file).unwrap();
    let bias_bytes = |n: usize, first: f32| -> Vec<u8> {
        (0..n)
            .flat_map(|i| (first + i as f32).to_le_bytes())
            .collect()
    };
    let (in_bias, out_bias) = (bias_bytes(48, 0.0), bias_bytes(16, 100.0));
    let mut views: Vec<(String, safetensors::tensor::TensorView)> = stored
        .tensors()
        .into_iter()
        .filter(|(key, _)| key.starts_with("model."))
        .collect();
    for (key, bytes, n) in [
        ("model.in_proj_bias", &in_bias, 48),
        ("model.out_proj.bias", &out_bias, 16),
    ] {
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![n], bytes);
        views.push((key.to_string(), view.unwrap()));
    }
    let bytes = safetensors::serialize(views, None).unwrap();
    let weights = mha::PyTorchWeights::from_bytes(&bytes, "kdim, vdim and biases").unwrap();
    for b in backends() {
        let m = MultiHeadAttentionConfig::new(16, 2)
            .with_kdim(Some(12))
            .with_vdim(Some(10))
            .init(&b.device)
            .load_pytorch(&weights, "model.")
            .unwrap();
        let mha::mha::InputProjection::Separate(p) = &m.in_proj else {
            panic!("kdim and vdim take separate projections")
        };
        let bias = |linear: &burn::nn::Linear| {
            crate::util::to_vec(linear.bias.as_ref().expect("a bias").val())
        };
        let rows =
            |first: usize, n: usize| (first..first + n).map(|i| i as f32).collect::<Vec<_>>();
        assert_eq!(bias(&p.q_proj), rows(0, 16), "[{}] q", b.name);
        assert_eq!(bias(&p.k_proj), rows(16, 16), "[{}] k", b.name);
        assert_eq!(bias(&p.v_proj), rows(32, 16), "[{}] v", b.name);
        assert_eq!(bias(&m.out_proj), rows(100, 16), "[{}] out", b.name);
    }
}

/// An encoder block or stack against its fixture: input `x` `[2, 6, 16]` with key padding.
fn check_encoder<M: Module + LoadPyTorch>(
    fixture: &'static str,
    build: impl Fn(&Device) -> M,
    forward: impl Fn(&M, Tensor<3>, &AttentionMask) -> Tensor<3>,
) {
    let f = Fixture::load(fixture);
    for b in backends() {
        let dev = b.autodiff();
        let module = build(&dev).load_pytorch(&f.weights, "model.").unwrap();
        let x = f.io("x", [2, 6, 16], &dev).require_grad();
        let padding = AttentionMask::key_padding(f.io_mask("key_padding", [2, 6], &dev));
        let out = forward(&module, x.clone(), &padding);
        check_forward(&b, &f, "out", out.clone(), "out");
        let grads = backward(&f, &out, &dev);
        check_input_grad(&b, &f, "x", &x, &grads);
        check_param_grads(&b, &f, &module, build(&dev), &grads);
    }
}

fn encoder_layer(fixture: &'static str, norm_first: bool, activation: FeedForwardActivation) {
    let config = EncoderBlockConfig::new(16, 4)
        .with_d_ff(Some(32))
        .with_dropout(0.0)
        .with_norm_first(norm_first)
        .with_activation(activation);
    check_encoder(
        fixture,
        |dev| config.init(dev),
        |m, x, mask| {
            m.forward(BlockInput::new(x).mask(mask.clone()))
                .unwrap()
                .output
        },
    );
}

#[test]
fn encoder_layer_pre_norm_gelu() {
    encoder_layer("encoder_layer_pre_gelu", true, FeedForwardActivation::Gelu);
}

#[test]
fn encoder_layer_post_norm_relu() {
    encoder_layer(
        "encoder_layer_post_relu",
        false,
        FeedForwardActivation::Relu,
    );
}

#[test]
fn decoder_layer_pre_norm_gelu_with_memory_padding() {
    let f = Fixture::load("decoder_layer_pre_gelu");
    for b in backends() {
        let dev = b.autodiff();
        let config = DecoderBlockConfig::new(16, 4)
            .with_d_ff(Some(32))
            .with_dropout(0.0);
        let block = config
            .init(&dev)
            .load_pytorch(&f.weights, "model.")
            .unwrap();
        let x = f.io("x", [2, 5, 16], &dev).require_grad();
        let memory = f.io("memory", [2, 7, 16], &dev).require_grad();
        let padding = AttentionMask::key_padding(f.io_mask("memory_padding", [2, 7], &dev));
        let input = BlockInput::new(x.clone())
            .memory(memory.clone())
            .memory_mask(padding);
        let out = block.forward(input).unwrap().output;
        check_forward(&b, &f, "out", out.clone(), "out");
        let grads = backward(&f, &out, &dev);
        check_input_grad(&b, &f, "x", &x, &grads);
        check_input_grad(&b, &f, "memory", &memory, &grads);
        check_param_grads(&b, &f, &block, config.init(&dev), &grads);
    }
}

/// A decoder block that is not causal (PyTorch's layer with `tgt_mask=None`): the
/// fixture's layer, each position's self-attention seeing every position, equal to its
/// parts composed by hand; refused with a cache, which it leaves as it was.
#[test]
fn a_decoder_block_that_is_not_causal_attends_to_every_position() {
    let f = Fixture::load("decoder_layer_pre_gelu");
    let config = DecoderBlockConfig::new(16, 4)
        .with_d_ff(Some(32))
        .with_dropout(0.0);
    for b in backends() {
        let dev = &b.device;
        let load = |causal| {
            config
                .clone()
                .with_causal(causal)
                .init(dev)
                .load_pytorch(&f.weights, "model.")
                .unwrap()
        };
        let block = load(false);
        let x = f.io("x", [2, 5, 16], dev);
        let memory = f.io("memory", [2, 7, 16], dev);
        let out = block
            .forward(BlockInput::new(x.clone()).memory(memory.clone()))
            .unwrap()
            .output;
        let h = x.clone()
            + block
                .self_attn
                .self_attention(block.norm1.forward(x.clone()), AttentionMask::none());
        let h = h.clone()
            + block.cross_attn.cross_attention(
                block.norm2.forward(h),
                memory.clone(),
                AttentionMask::none(),
            );
        let want = h.clone() + block.feed_forward.forward(block.norm3.forward(h));
        let what = format!("[{}] decoder block, not causal", b.name);
        assert_close(&what, out.clone(), want, b.forward_tol());
        // The causal block's first position sees itself alone: another output.
        let causal = load(true)
            .forward(BlockInput::new(x.clone()).memory(memory.clone()))
            .unwrap()
            .output;
        let first = |t: Tensor<3>| t.narrow(1, 0, 1);
        let apart = crate::util::max_abs_diff(first(causal), first(out));
        assert!(
            apart > 1e-2,
            "{what}: the causal block's first row is {apart} away"
        );
        let mut cache = mha::KvCache::new(8);
        let err = block
            .forward(BlockInput::new(x).memory(memory).cache(&mut cache))
            .map(|_| ())
            .unwrap_err();
        assert_eq!(
            err,
            mha::CacheError::NotCausal {
                module: "DecoderBlock"
            }
        );
        assert_eq!(cache.len(), 0);
    }
}

/// `EncoderBlockConfig::pytorch` is PyTorch's layer (post-norm, ReLU, epsilon 1e-5,
/// biases): the fixture of `nn.TransformerEncoderLayer(16, 4, 32, dropout=0)`.
#[test]
fn the_pytorch_preset_is_pytorchs_encoder_layer() {
    let config = EncoderBlockConfig::pytorch(16, 4)
        .with_d_ff(Some(32))
        .with_dropout(0.0);
    assert_eq!(EncoderBlockConfig::pytorch(16, 4).d_ff, Some(2048));
    assert_eq!(DecoderBlockConfig::pytorch(16, 4).d_ff, Some(2048));
    check_encoder(
        "encoder_layer_post_relu",
        |dev| config.init(dev),
        |m, x, mask| {
            m.forward(BlockInput::new(x).mask(mask.clone()))
                .unwrap()
                .output
        },
    );
}

#[test]
fn encoder_stack_pre_norm_causal_with_final_norm() {
    let block = EncoderBlockConfig::new(16, 4)
        .with_d_ff(Some(32))
        .with_dropout(0.0)
        .with_causal(true);
    let config = EncoderConfig::new(block, 2);
    check_encoder(
        "encoder_stack_pre_gelu",
        |dev| config.init(dev),
        |m, x, mask| {
            m.forward(BlockInput::new(x).mask(mask.clone()))
                .unwrap()
                .output
        },
    );
}

/// A stack's final norm is its configuration's choice: pre-norm layers without one
/// (PyTorch's `nn.TransformerEncoder(layer, N)`, whose `norm` is `None` by default) and
/// post-norm layers with one (`nn.Transformer`'s stacks). Each is the fixture's stack
/// with the norm taken off or put on, and the import names `final_norm` where the
/// weights and the configuration disagree.
#[test]
fn a_stack_has_a_final_norm_where_its_configuration_asks() {
    use mha::{Encoder, ImportError};
    let f = Fixture::load("encoder_stack_pre_gelu");
    let block = EncoderBlockConfig::new(16, 4)
        .with_d_ff(Some(32))
        .with_dropout(0.0)
        .with_causal(true);
    // The fixture's weights without its final norm's.
    let file = std::fs::read(
        crate::util::root().join("tests/fixtures/encoder_stack_pre_gelu.safetensors"),
    )
    .unwrap();
    let stored = safetensors::SafeTensors::deserialize(&file).unwrap();
    let kept: Vec<_> = stored
        .tensors()
        .into_iter()
        .filter(|(key, _)| !key.starts_with("model.norm."))
        .collect();
    assert_eq!(kept.len() + 2, stored.len());
    let bytes = safetensors::serialize(kept, None).unwrap();
    let no_norm = mha::PyTorchWeights::from_bytes(&bytes, "no final norm").unwrap();
    // And with the final norm under TensorFlow's names, gamma and beta.
    let renamed: Vec<_> = stored
        .tensors()
        .into_iter()
        .map(|(key, view)| {
            let key = key
                .replace("model.norm.weight", "model.norm.gamma")
                .replace("model.norm.bias", "model.norm.beta");
            (key, view)
        })
        .collect();
    let bytes = safetensors::serialize(renamed, None).unwrap();
    let legacy = mha::PyTorchWeights::from_bytes(&bytes, "gamma and beta").unwrap();
    for b in backends() {
        let dev = &b.device;
        let x = f.io("x", [2, 6, 16], dev);
        let run = |m: &Encoder| m.forward(BlockInput::new(x.clone())).unwrap().output;
        let stack = |final_norm, norm_first| {
            let block = block.clone().with_norm_first(norm_first);
            EncoderConfig::new(block, 2)
                .with_final_norm(final_norm)
                .init(dev)
        };
        let with = stack(None, true)
            .load_pytorch(&f.weights, "model.")
            .unwrap();
        let norm = with
            .norm
            .clone()
            .expect("a pre-norm stack's final norm by default");
        let without = stack(Some(false), true)
            .load_pytorch(&no_norm, "model.")
            .unwrap();
        assert!(without.norm.is_none());
        let what = format!("[{}] pre-norm stack", b.name);
        assert_close(&what, norm.forward(run(&without)), run(&with), 0.0);
        // Post-norm layers, without a final norm by default, with one when asked.
        let post = stack(None, false).load_pytorch(&no_norm, "model.").unwrap();
        assert!(post.norm.is_none());
        let mut post_normed = stack(Some(true), false)
            .load_pytorch(&f.weights, "model.")
            .unwrap();
        post_normed.layers = post.layers.clone();
        let what = format!("[{}] post-norm stack", b.name);
        assert_close(&what, norm.forward(run(&post)), run(&post_normed), 0.0);
        // Weights and configuration that disagree.
        let err = stack(None, true)
            .load_pytorch(&no_norm, "model.")
            .unwrap_err();
        assert!(
            matches!(&err, ImportError::Convention { key, .. } if key == "model.norm.weight")
                && err
                    .to_string()
                    .contains("configure `final_norm: Some(false)`"),
            "{err}"
        );
        let named = stack(None, true).load_pytorch(&legacy, "model.").unwrap();
        let what = format!("[{}] final norm as gamma and beta", b.name);
        assert_close(&what, run(&named), run(&with), 0.0);
        let err = stack(Some(false), true)
            .load_pytorch(&legacy, "model.")
            .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("unexpected key `model.norm.gamma`"),
            "{err}"
        );
        let err = stack(Some(false), true)
            .load_pytorch(&f.weights, "model.")
            .unwrap_err();
        assert!(
            err.to_string()
                .starts_with("unexpected key `model.norm.weight`")
                && err.to_string().contains("`Some(true)` gives it one"),
            "{err}"
        );
    }
}

/// Both paths of the core: fused (no weights) and explicit (weights asked for).
fn sdpa_paths(
    fixture: &'static str,
    q: [usize; 4],
    k: [usize; 4],
    mask: impl Fn(&Fixture, &Device) -> AttentionMask,
    scale: Option<f64>,
) {
    let f = Fixture::load(fixture);
    for b in backends() {
        let dev = b.autodiff();
        for weights in [AttentionWeights::None, AttentionWeights::PerHead] {
            let path = if weights == AttentionWeights::None {
                "fused"
            } else {
                "explicit"
            };
            let qt = f.io("q", q, &dev).require_grad();
            let kt = f.io("k", k, &dev).require_grad();
            let vt = f.io("v", k, &dev).require_grad();
            let options = SdpaOptions {
                scale,
                weights,
                ..SdpaOptions::default()
            };
            let m = mask(&f, &dev);
            let out = scaled_dot_product_attention(qt.clone(), kt.clone(), vt.clone(), &m, options);
            check_forward(&b, &f, &format!("{path} out"), out.context.clone(), "out");
            if let Some(w) = asked_weights(&format!("{path} [{}]", b.name), weights, out.weights) {
                check_forward(&b, &f, "weights", w, "weights");
            }
            let grads = backward(&f, &out.context, &dev);
            for (name, x) in [("q", &qt), ("k", &kt), ("v", &vt)] {
                check_input_grad(&b, &f, name, x, &grads);
            }
            if let Some(sinks) = m.sink_logits() {
                check_input_grad(&b, &f, "model.sinks", sinks, &grads);
            }
        }
        // Without autodiff the fused op runs the backend's own kernel (flash on flex/wgpu).
        let dev = b.device.clone();
        let out = scaled_dot_product_attention(
            f.io("q", q, &dev),
            f.io("k", k, &dev),
            f.io("v", k, &dev),
            &mask(&f, &dev),
            SdpaOptions {
                scale,
                ..Default::default()
            },
        );
        check_forward(&b, &f, "fused kernel out", out.context, "out");
    }
}

#[test]
fn sdpa_gqa_additive_bias_custom_scale() {
    let mask = |f: &Fixture, dev: &Device| AttentionMask::bias(f.io("bias", [1, 4, 5, 6], dev));
    sdpa_paths(
        "sdpa_gqa_bias_scale",
        [2, 4, 5, 8],
        [2, 2, 6, 8],
        mask,
        Some(0.3),
    );
}

/// Attention sinks against transformers' gpt-oss eager attention: GQA, a causal window,
/// key padding and a row that sees no key (zeros here, as there), with the sinks'
/// gradient, on the fused and explicit paths.
#[test]
fn sdpa_attention_sinks_match_gpt_oss() {
    let mask = |f: &Fixture, dev: &Device| {
        let sinks = f.weights.tensor("model.sinks", [4], dev).unwrap();
        let sinks = match dev.is_autodiff() {
            true => sinks.require_grad(),
            false => sinks,
        };
        AttentionMask::sliding_window(4)
            .and(AttentionMask::blocking(f.io_mask(
                "blocked",
                [2, 1, 9, 9],
                dev,
            )))
            .and(AttentionMask::sinks(sinks))
    };
    sdpa_paths("sdpa_sinks", [2, 4, 9, 8], [2, 2, 9, 8], mask, None);
}

#[test]
fn sdpa_fully_blocked_row_gives_zeros_and_finite_gradients() {
    let mask = |f: &Fixture, dev: &Device| {
        AttentionMask::blocking(f.io_mask("blocked", [2, 1, 4, 4], dev))
    };
    sdpa_paths(
        "sdpa_fully_blocked_row",
        [2, 2, 4, 8],
        [2, 2, 4, 8],
        mask,
        None,
    );
}

/// Causal self-attention with `positions` against the plain torch code of golden.py:
/// output, the input's gradient, and every parameter's (a learned table's included, which
/// the import reads from `position_table`).
fn check_positioned(fixture: &'static str, positions: Positions) {
    let f = Fixture::load(fixture);
    for b in backends() {
        let dev = b.autodiff();
        let config = MultiHeadAttentionConfig::new(24, 6).with_positions(positions.clone());
        let mha = config
            .init(&dev)
            .load_pytorch(&f.weights, "model.")
            .unwrap();
        let x = f.io("x", [2, 12, 24], &dev).require_grad();
        let out = mha.causal_self_attention(x.clone());
        check_forward(&b, &f, "out", out.clone(), "out");
        let grads = backward(&f, &out, &dev);
        check_input_grad(&b, &f, "x", &x, &grads);
        check_param_grads(&b, &f, &mha, config.init(&dev), &grads);
    }
}

/// The first `rows` batch rows of a causal attention fixture's input `x` `[2, 9, 32]`,
/// decoded token by token through `cache` by the module of `config` loaded from it, give
/// the whole forward's output.
fn check_decoded(
    b: &Backend,
    f: &Fixture,
    config: &MultiHeadAttentionConfig,
    mut cache: mha::KvCache,
    rows: usize,
) {
    let mha = config
        .init(&b.device)
        .load_pytorch(&f.weights, "model.")
        .unwrap_or_else(|e| panic!("{e}"));
    let x = f
        .io("x", [2, 9, 32], &b.device)
        .slice([0..rows, 0..9, 0..32]);
    let steps: Vec<Tensor<3>> = (0..9)
        .map(|t| {
            let token = x.clone().slice([0..rows, t..t + 1, 0..32]);
            mha.forward_cached(token, &mut cache, AttentionMask::none())
                .unwrap_or_else(|e| panic!("{e}"))
        })
        .collect();
    let want = f
        .io("out", [2, 9, 32], &b.device)
        .slice([0..rows, 0..9, 0..32]);
    let label = format!("{} [{}] decoded token by token", f.name, b.name);
    assert_close(&label, Tensor::cat(steps, 1), want, b.forward_tol());
}

/// transformers' `GptOssAttention`: biases on every projection, attention sinks, a
/// sliding window of 4, GQA 4:2, RoPE with theta 500, key padding; every gradient, the
/// sinks' included; decoded token by token through a sliding cache; and a module without
/// sinks refuses them by name.
#[test]
fn gpt_oss_attention_with_sinks_matches_transformers() {
    let f = Fixture::load("gpt_oss_attention");
    let config = MultiHeadAttentionConfig::new(32, 4)
        .with_n_kv_heads(Some(2))
        .with_positions(Positions::Rope {
            theta: 500.0,
            layout: RopeLayout::HalfSplit,
        })
        .with_sinks(true);
    for b in backends() {
        let dev = b.autodiff();
        let mha = config
            .init(&dev)
            .load_pytorch(&f.weights, "model.")
            .unwrap_or_else(|e| panic!("{e}"));
        let x = f.io("x", [2, 9, 32], &dev).require_grad();
        let padding = f.io_mask("key_padding", [2, 9], &dev);
        let mask = AttentionMask::sliding_window(4).and(AttentionMask::key_padding(padding));
        let out = mha.self_attention(x.clone(), mask);
        check_forward(&b, &f, "out", out.clone(), "out");
        let grads = backward(&f, &out, &dev);
        check_input_grad(&b, &f, "x", &x, &grads);
        check_param_grads(&b, &f, &mha, config.init(&dev), &grads);

        // Batch row 0 (no padding) decoded token by token through a cache of the window.
        check_decoded(&b, &f, &config, mha::KvCache::sliding(4), 1);
    }
    let err = config
        .clone()
        .with_sinks(false)
        .init(&Device::default())
        .load_pytorch(&f.weights, "model.")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.sinks") && err.contains("sinks"),
        "{err}"
    );
    // Burn's quiet softmax has sinks fixed at 0: learned ones are refused, by that name.
    let err = config
        .with_sinks(false)
        .with_quiet_softmax(true)
        .init(&Device::default())
        .load_pytorch(&f.weights, "model.")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.sinks") && err.contains("quiet_softmax"),
        "{err}"
    );
}

/// The attention of transformers' Qwen2 (`qwen2`: biases on q, k and v, none on o) or
/// Qwen3 (QK-norm, no biases): 32 wide, 4 query heads and 2 key/value heads, RoPE with
/// theta 500 in Hugging Face's layout.
fn qwen_attention(qwen3: bool) -> MultiHeadAttentionConfig {
    let config = MultiHeadAttentionConfig::new(32, 4)
        .with_n_kv_heads(Some(2))
        .with_positions(Positions::Rope {
            theta: 500.0,
            layout: RopeLayout::HalfSplit,
        });
    match qwen3 {
        true => config.with_bias(false).with_qk_norm_eps(Some(1e-6)),
        false => config.with_out_bias(Some(false)),
    }
}

#[test]
fn qwen_attention_with_qk_norm_or_biases_on_qkv_matches_transformers() {
    for (fixture, qwen3) in [("qwen2_attention", false), ("qwen3_attention", true)] {
        let f = Fixture::load(fixture);
        let config = qwen_attention(qwen3);
        for b in backends() {
            let dev = b.autodiff();
            let mha = config
                .init(&dev)
                .load_pytorch(&f.weights, "model.")
                .unwrap_or_else(|e| panic!("{e}"));
            let x = f.io("x", [2, 9, 32], &dev).require_grad();
            let out = mha.causal_self_attention(x.clone());
            check_forward(&b, &f, "out", out.clone(), "out");
            let grads = backward(&f, &out, &dev);
            check_input_grad(&b, &f, "x", &x, &grads);
            check_param_grads(&b, &f, &mha, config.init(&dev), &grads);

            // Decoding token by token through the cache gives the whole forward's rows.
            check_decoded(&b, &f, &config, mha::KvCache::new(9), 2);
        }
    }
    // A module without QK-norm refuses Qwen3's norms, and one whose output projection has
    // a bias needs one.
    let device = Device::default();
    let qwen3 = Fixture::load("qwen3_attention");
    let err = qwen_attention(false)
        .with_bias(false)
        .init(&device)
        .load_pytorch(&qwen3.weights, "model.")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.q_norm.weight") && err.contains("qk_norm_eps"),
        "{err}"
    );
    let qwen2 = Fixture::load("qwen2_attention");
    let err = qwen_attention(false)
        .with_out_bias(None)
        .init(&device)
        .load_pytorch(&qwen2.weights, "model.")
        .unwrap_err()
        .to_string();
    assert!(err.contains("model.o_proj.bias"), "{err}");
}

#[test]
fn hugging_face_decoder_layers_match_transformers() {
    // transformers' LlamaDecoderLayer, MistralDecoderLayer, Qwen2DecoderLayer and
    // Qwen3DecoderLayer, configured from their config.json, loaded under their own names.
    for name in ["llama_layer", "mistral_layer", "qwen2_layer", "qwen3_layer"] {
        let f = Fixture::load(name);
        let json = crate::util::root().join(format!("tests/fixtures/{name}.json"));
        let config = HfConfig::from_file(&json).unwrap_or_else(|e| panic!("{e}"));
        let block = config.block().unwrap_or_else(|e| panic!("{e}"));
        for b in backends() {
            let dev = b.autodiff();
            let load = |prefix: &str| {
                load_decoder_layer(block.init(&dev), &f.weights, prefix)
                    .unwrap_or_else(|e| panic!("{e}"))
            };
            let layer = load("model.");
            let x = f.io("x", [2, 9, 32], &dev).require_grad();
            let padding = AttentionMask::key_padding(f.io_mask("key_padding", [2, 9], &dev));
            let out = layer
                .forward(BlockInput::new(x.clone()).mask(padding))
                .unwrap_or_else(|e| panic!("{e}"))
                .output;
            check_forward(&b, &f, "out", out.clone(), "out");
            let grads = backward(&f, &out, &dev);
            check_input_grad(&b, &f, "x", &x, &grads);
            check_grads_against(&b, &f, &layer, &load("io.grad.model."), &grads);
        }
    }
}

#[test]
fn gpt2_blocks_and_bert_layers_match_transformers() {
    // transformers' GPT2Block (Conv1D weights, packed c_attn, gelu_new, causal) and
    // BertLayer (post-norm, bidirectional), configured from their config.json, loaded
    // under their own names, with key padding.
    type Load = fn(EncoderBlock, &mha::PyTorchWeights, &str) -> Result<EncoderBlock, ImportError>;
    let gpt2 = |path: &std::path::Path| Gpt2Config::from_file(path).and_then(|c| c.block());
    let bert = |path: &std::path::Path| BertConfig::from_file(path).and_then(|c| c.block());
    type Block = fn(&std::path::Path) -> Result<EncoderBlockConfig, ImportError>;
    let cases: [(&str, Block, Load); 2] = [
        ("gpt2_block", gpt2, load_gpt2_block),
        ("bert_layer", bert, load_bert_layer),
    ];
    for (name, block, load_block) in cases {
        let f = Fixture::load(name);
        let json = crate::util::root().join(format!("tests/fixtures/{name}.json"));
        let block = block(&json).unwrap_or_else(|e| panic!("{e}"));
        for b in backends() {
            let dev = b.autodiff();
            let load = |prefix: &str| {
                load_block(block.init(&dev), &f.weights, prefix).unwrap_or_else(|e| panic!("{e}"))
            };
            let layer = load("model.");
            let x = f.io("x", [2, 9, 32], &dev).require_grad();
            let padding = AttentionMask::key_padding(f.io_mask("key_padding", [2, 9], &dev));
            let out = layer
                .forward(BlockInput::new(x.clone()).mask(padding))
                .unwrap_or_else(|e| panic!("{e}"))
                .output;
            check_forward(&b, &f, "out", out.clone(), "out");
            let grads = backward(&f, &out, &dev);
            check_input_grad(&b, &f, "x", &x, &grads);
            check_grads_against(&b, &f, &layer, &load("io.grad.model."), &grads);
        }
    }
    // Each refuses a block configured as the other's.
    let device = Device::default();
    let gpt2_json = crate::util::root().join("tests/fixtures/gpt2_block.json");
    let as_gpt2 = gpt2(&gpt2_json).unwrap().init(&device);
    let bert_weights = Fixture::load("bert_layer").weights;
    let err = load_bert_layer(as_gpt2, &bert_weights, "model.")
        .unwrap_err()
        .to_string();
    assert!(err.contains("bidirectional and post-norm"), "{err}");
    // Neither has attention sinks: a block configured with them is refused, not loaded
    // with sinks of 0.
    let bert_json = crate::util::root().join("tests/fixtures/bert_layer.json");
    let with_sinks = bert(&bert_json).unwrap().with_attention_sinks(true);
    let err = load_bert_layer(with_sinks.init(&device), &bert_weights, "model.")
        .unwrap_err()
        .to_string();
    assert!(err.contains("no attention sinks"), "{err}");
    let with_sinks = gpt2(&gpt2_json).unwrap().with_attention_sinks(true);
    let gpt2_weights = Fixture::load("gpt2_block").weights;
    let err = load_gpt2_block(with_sinks.init(&device), &gpt2_weights, "model.")
        .unwrap_err()
        .to_string();
    assert!(err.contains("without QK-norm or attention sinks"), "{err}");
}

#[test]
fn bert_model_matches_transformers() {
    // A 2-layer BertModel: embeddings of tokens, positions and two segments, normalised,
    // then post-norm layers, under key padding; the last hidden state and every gradient.
    let f = Fixture::load("bert_model");
    let json = crate::util::root().join("tests/fixtures/bert_model.json");
    let config = BertConfig::from_file(&json).unwrap_or_else(|e| panic!("{e}"));
    for b in backends() {
        let dev = b.autodiff();
        let load = |prefix: &str| {
            let model = config.init_model(&dev).unwrap_or_else(|e| panic!("{e}"));
            load_bert_model(model, &f.weights, prefix).unwrap_or_else(|e| panic!("{e}"))
        };
        let model = load("model.");
        let ids = f.io::<2>("ids", [2, 9], &dev).int();
        let types = f.io::<2>("types", [2, 9], &dev).int();
        let padding = AttentionMask::key_padding(f.io_mask("key_padding", [2, 9], &dev));
        let out = model.forward(ids, types, padding);
        check_forward(&b, &f, "out", out.clone(), "out");
        let grads = backward(&f, &out, &dev);
        check_grads_against(&b, &f, &model, &load("io.grad.model."), &grads);
    }
    // `bert-base-uncased` stores its layer norms as `gamma` and `beta` (names from
    // TensorFlow): they load as `weight` and `bias` do.
    let file = std::fs::read(crate::util::root().join("tests/fixtures/bert_model.safetensors"));
    let file = file.unwrap();
    let stored = safetensors::SafeTensors::deserialize(&file).unwrap();
    let renamed: Vec<(String, safetensors::tensor::TensorView)> = stored
        .tensors()
        .into_iter()
        .filter(|(key, _)| key.starts_with("model."))
        .map(|(key, view)| {
            let key = match key.contains("LayerNorm.") {
                true => key.replace(".weight", ".gamma").replace(".bias", ".beta"),
                false => key,
            };
            (key, view)
        })
        .collect();
    assert!(
        renamed
            .iter()
            .any(|(key, _)| key.ends_with("LayerNorm.gamma"))
    );
    let bytes = safetensors::serialize(renamed, None).unwrap();
    let legacy = mha::PyTorchWeights::from_bytes(&bytes, "gamma and beta").unwrap();
    let device = Device::default();
    let model = |weights: &mha::PyTorchWeights| {
        let model = config.init_model(&device).unwrap();
        let model = load_bert_model(model, weights, "model.").unwrap_or_else(|e| panic!("{e}"));
        param_values(&model)
            .into_iter()
            .map(crate::util::to_vec)
            .collect::<Vec<_>>()
    };
    assert!(model(&legacy) == model(&f.weights));
}

#[test]
fn hugging_face_causal_lms_match_transformers_and_decode_through_the_cache() {
    // A 2-layer LlamaForCausalLM (its own head), Qwen3ForCausalLM (heads wider than
    // hidden / heads, the head tied to the embedding), GPT2LMHeadModel (learned positions,
    // tied) and MistralForCausalLM (a sliding window of 4 over 9 tokens): the logits and
    // every parameter's gradient, then decoding token by token (Mistral's through a ring
    // of 4).
    for name in ["llama_lm", "qwen3_lm", "gpt2_lm", "mistral_lm"] {
        let f = Fixture::load(name);
        let json = crate::util::root().join(format!("tests/fixtures/{name}.json"));
        for b in backends() {
            let load = |device: &Device, prefix: &str| {
                let loaded = match name {
                    "gpt2_lm" => Gpt2Config::from_file(&json)
                        .and_then(|c| c.init_causal_lm(device))
                        .and_then(|lm| {
                            load_gpt2_lm(lm, &f.weights, &format!("{prefix}transformer."))
                        }),
                    _ => HfConfig::from_file(&json)
                        .and_then(|c| c.init_causal_lm(device))
                        .and_then(|lm| load_causal_lm(lm, &f.weights, prefix)),
                };
                loaded.unwrap_or_else(|e| panic!("{e}"))
            };
            let ids = |device: &Device| f.io::<2>("ids", [2, 9], device).int();
            let dev = b.autodiff();
            let lm = load(&dev, "model.");
            let logits = lm.forward(ids(&dev), AttentionMask::none());
            check_forward(&b, &f, "logits", logits.clone(), "out");
            let grads = backward(&f, &logits, &dev);
            check_grads_against(&b, &f, &lm, &load(&dev, "io.grad.model."), &grads);

            let lm = load(&b.device, "model.");
            let mut cache = lm.cache(9);
            let steps: Vec<Tensor<3>> = (0..9)
                .map(|t| {
                    let token = ids(&b.device).slice([0..2, t..t + 1]);
                    lm.forward_cached(token, &mut cache)
                        .unwrap_or_else(|e| panic!("{e}"))
                })
                .collect();
            let label = format!("{name} [{}] decoded token by token", b.name);
            let want = f.io("out", [2, 9, 50], &b.device);
            assert_close(&label, Tensor::cat(steps, 1), want, b.forward_tol());
        }
    }
}

/// A base model saved alone (`Qwen3Model`, `LlamaModel`: `embed_tokens.weight`,
/// `layers.N.*`, `norm.weight`, no `model.`) loads as transformers loads it into its
/// language model: tied, the same logits as the whole model's; untied, with the head's
/// `lm_head.weight` beside it, or its absence named (it failed on `model.embed_tokens`).
#[test]
fn a_base_model_saved_alone_loads_as_transformers_loads_it() {
    for (name, tied) in [("qwen3_lm", true), ("llama_lm", false)] {
        let path = crate::util::root().join(format!("tests/fixtures/{name}.safetensors"));
        let bytes = std::fs::read(&path).unwrap();
        let stored = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let json = crate::util::root().join(format!("tests/fixtures/{name}.json"));
        let config = HfConfig::from_file(&json).unwrap();
        // The base model's keys, and the head's where `head` says.
        let alone = |head: bool| {
            let views: Vec<(String, safetensors::tensor::TensorView)> = stored
                .tensors()
                .into_iter()
                .filter_map(|(key, view)| match key.strip_prefix("model.model.") {
                    Some(inner) => Some((inner.to_string(), view)),
                    None if head && key == "model.lm_head.weight" => {
                        Some(("lm_head.weight".to_string(), view))
                    }
                    None => None,
                })
                .collect();
            let bytes = safetensors::serialize(views, None).unwrap();
            mha::PyTorchWeights::from_bytes(&bytes, "base model").unwrap()
        };
        let f = Fixture::load(name);
        for b in backends() {
            let ids = f.io::<2>("ids", [2, 9], &b.device).int();
            let load = |weights: &mha::PyTorchWeights, prefix: &str| {
                load_causal_lm(config.init_causal_lm(&b.device).unwrap(), weights, prefix)
            };
            let want = load(&f.weights, "model.")
                .unwrap()
                .forward(ids.clone(), AttentionMask::none());
            let got = load(&alone(!tied), "")
                .unwrap_or_else(|e| panic!("{name}: {e}"))
                .forward(ids, AttentionMask::none());
            assert_close(&format!("{name} [{}] base alone", b.name), got, want, 0.0);
            if !tied {
                let err = load(&alone(false), "").map(|_| ()).unwrap_err().to_string();
                assert!(err.contains("lm_head.weight"), "{err}");
            }
        }
    }
}

/// Prompts of different lengths decode together padded on the left
/// (`forward_cached_padded`): each real token's logits are those of its row decoded alone
/// (`forward_cached` read the padding as tokens), for Llama, Qwen3, GPT-2 (whose learned
/// positions count from the first real token, as transformers' `generate` counts them)
/// and Mistral (its window a ring of 4).
#[test]
fn left_padded_prompts_decode_as_each_alone() {
    for name in ["llama_lm", "qwen3_lm", "gpt2_lm", "mistral_lm"] {
        let f = Fixture::load(name);
        let json = crate::util::root().join(format!("tests/fixtures/{name}.json"));
        for b in backends() {
            let d = &b.device;
            let lm = match name {
                "gpt2_lm" => Gpt2Config::from_file(&json)
                    .and_then(|c| c.init_causal_lm(d))
                    .and_then(|lm| load_gpt2_lm(lm, &f.weights, "model.transformer.")),
                _ => HfConfig::from_file(&json)
                    .and_then(|c| c.init_causal_lm(d))
                    .and_then(|lm| load_causal_lm(lm, &f.weights, "model.")),
            };
            let lm = lm.unwrap_or_else(|e| panic!("{e}"));
            let ids = f.io::<2>("ids", [2, 9], d).int();
            // Row 1: its last 6 tokens after 3 pads (id 7, a real token's id).
            let short = ids.clone().slice([1..2, 3..9]);
            let pads = Tensor::<2, burn::tensor::Int>::full([1, 3], 7, d);
            let padded = Tensor::cat(
                vec![
                    ids.clone().slice([0..1, 0..9]),
                    Tensor::cat(vec![pads, short.clone()], 1),
                ],
                0,
            );
            // A prompt of 5 columns, then one token a call.
            let decode =
                |tokens: Tensor<2, burn::tensor::Int>, first: usize, pads: Option<Vec<usize>>| {
                    let [rows, len] = tokens.dims();
                    let mut cache = lm.cache(9);
                    let mut out = Vec::new();
                    let mut at = 0;
                    for end in std::iter::once(first).chain(first + 1..=len) {
                        let call = tokens.clone().slice([0..rows, at..end]);
                        let logits = match &pads {
                            Some(pads) => lm.forward_cached_padded(call, &mut cache, pads.clone()),
                            None => lm.forward_cached(call, &mut cache),
                        };
                        out.push(logits.unwrap_or_else(|e| panic!("{e}")));
                        at = end;
                    }
                    Tensor::cat(out, 1)
                };
            let together = decode(padded, 5, Some(vec![0, 3]));
            let vocab = together.dims()[2];
            let label = |row| format!("{name} [{}] row {row} padded", b.name);
            let alone = decode(short, 2, None);
            let got = together.clone().slice([1..2, 3..9, 0..vocab]);
            assert_close(&label(1), got, alone, b.forward_tol());
            let first = decode(ids.slice([0..1, 0..9]), 5, None);
            let got = together.slice([0..1, 0..9, 0..vocab]);
            assert_close(&label(0), got, first, b.forward_tol());
        }
    }
}

/// Burn's own attention module converts (`From`) with its numbers: its weights, biases
/// (one projection without one), dropout and quiet softmax, under its padding and
/// attention masks (rows with a visible key: Burn's ordinary softmax makes a row with none
/// uniform), in
/// self- and cross-attention, forward and every input's gradient.
#[test]
fn burns_attention_module_converts_with_its_numbers() {
    use burn::nn::attention::{
        MhaInput as BurnInput, MultiHeadAttentionConfig as BurnConfig, generate_autoregressive_mask,
    };
    for b in backends() {
        let d = &b.autodiff();
        for (quiet, query_bias) in [(false, true), (true, false)] {
            let what = format!(
                "[{}] quiet_softmax {quiet}, query_bias {query_bias}",
                b.name
            );
            let burn = BurnConfig::new(16, 4)
                .with_dropout(0.0)
                .with_quiet_softmax(quiet)
                .with_query_bias(query_bias)
                .init(d);
            let ours = mha::MultiHeadAttention::from(burn.clone());
            assert_eq!(ours.sinks.is_some(), quiet, "{what}");
            let x = crate::util::randn([2, 5, 16], 1, d).require_grad();
            let memory = crate::util::randn([2, 7, 16], 2, d).require_grad();
            // Row 0 pads its last 2 keys, row 1 none.
            let pad = Tensor::<2>::from_data(
                burn::tensor::TensorData::new(
                    (0..14)
                        .map(|i| if (5..7).contains(&i) { 1.0f32 } else { 0.0 })
                        .collect::<Vec<_>>(),
                    [2, 7],
                ),
                d,
            )
            .equal_elem(1.0);
            let want = burn
                .forward(
                    BurnInput::new(x.clone(), memory.clone(), memory.clone()).mask_pad(pad.clone()),
                )
                .context;
            let got = ours
                .forward(
                    mha::MhaInput::new(x.clone(), memory.clone(), memory.clone())
                        .mask(AttentionMask::key_padding(pad)),
                )
                .context;
            assert_close(
                &format!("{what} cross"),
                got.clone(),
                want.clone(),
                b.forward_tol(),
            );
            let grads = |out: Tensor<3>| {
                let g = (out * crate::util::randn([2, 5, 16], 3, d))
                    .sum()
                    .backward();
                [x.grad(&g).unwrap(), memory.grad(&g).unwrap()]
            };
            let (got, want) = (grads(got), grads(want));
            for ((name, got), want) in ["dx", "dmemory"].into_iter().zip(got).zip(want) {
                assert_grad_close(&b, &format!("{what} cross {name}"), got, want);
            }
            // Causal self-attention through Burn's mask_attn.
            let causal = generate_autoregressive_mask(2, 5, d);
            let want = burn
                .forward(BurnInput::self_attn(x.clone()).mask_attn(causal))
                .context;
            let got = ours.causal_self_attention(x.clone());
            assert_close(&format!("{what} causal"), got, want, b.forward_tol());
            // Its record loads into the module its configuration builds: the sinks of a
            // quiet softmax stay fixed (`sinks: true` would train them).
            let built = MultiHeadAttentionConfig::new(16, 4)
                .with_bias(true)
                .with_quiet_softmax(quiet)
                .init(d)
                .load_record(ours.clone().into_record());
            let fixed = built.sinks.as_ref().map(|s| s.val().is_require_grad());
            assert_eq!(fixed, quiet.then_some(false), "{what}");
            assert_close(
                &format!("{what} reloaded"),
                built.causal_self_attention(x.clone()),
                ours.causal_self_attention(x.clone()),
                0.0,
            );
        }
    }
}

/// Burn's module converts with its dropout as it is: frozen (no dropout, as Burn's), or
/// dropping as many weights as Burn's in training.
#[test]
fn burns_attention_module_converts_with_its_dropout_frozen_or_not() {
    use burn::nn::attention::{MhaInput as BurnInput, MultiHeadAttentionConfig as BurnConfig};
    for b in backends() {
        let d = &b.autodiff();
        let burn = BurnConfig::new(16, 4).with_dropout(0.5).init(d);
        let x = crate::util::randn([2, 5, 16], 1, d);
        let frozen = burn.clone().freeze();
        let want = frozen.forward(BurnInput::self_attn(x.clone())).context;
        let ours = mha::MultiHeadAttention::from(frozen);
        let got = ours.forward(mha::MhaInput::self_attn(x.clone())).context;
        assert_close(&format!("[{}] frozen", b.name), got, want, b.forward_tol());
        // In training both drop: the output moves away from the frozen module's.
        let ours = mha::MultiHeadAttention::from(burn);
        let want = ours
            .clone()
            .freeze()
            .forward(mha::MhaInput::self_attn(x.clone()))
            .context;
        let got = ours.forward(mha::MhaInput::self_attn(x)).context;
        let moved = (got - want).abs().max().into_scalar::<f32>();
        assert!(moved > 1e-3, "[{}] training: moved {moved}", b.name);
    }
}

/// Burn's layer norm with random parameters (Burn starts them at 1 and 0, where a norm
/// taken for another would not show).
fn shaken(norm: &mut burn::nn::LayerNorm, seed: u64, device: &Device) {
    let d = norm.gamma.dims();
    norm.gamma = Param::from_tensor(crate::util::randn(d, seed, device) * 0.5 + 1.0);
    norm.beta = Some(Param::from_tensor(crate::util::randn(d, seed + 1, device)));
}

/// Burn's transformer encoder and decoder convert (`TryFrom`) with their numbers: post-
/// and pre-norm (whose norms Burn names across the branches), GELU (exact and tanh) and
/// ReLU, a layer norm's epsilon of Burn's choosing, under Burn's padding and causal masks;
/// forward and the inputs' gradients. An activation with no counterpart is refused by
/// name.
#[test]
fn burns_transformer_converts_with_its_numbers() {
    use burn::nn::activation::ActivationConfig;
    use burn::nn::attention::generate_autoregressive_mask;
    use burn::nn::transformer::{
        TransformerDecoderConfig, TransformerDecoderInput, TransformerEncoderConfig,
        TransformerEncoderInput,
    };
    let cases = [
        (false, ActivationConfig::Gelu),
        (false, ActivationConfig::Relu),
        (true, ActivationConfig::Relu),
        (true, ActivationConfig::GeluApproximate),
    ];
    for b in backends() {
        let d = &b.autodiff();
        for (norm_first, activation) in cases.clone() {
            let what = format!("[{}] norm_first {norm_first}, {activation:?}", b.name);
            // Burn's gradient of exact GELU is the tanh approximation's derivative but on
            // flex (Burn's default `gelu_backward`; ours is exact GELU's, checked against
            // PyTorch's in the blocks' tests): its gradients are compared there only.
            let burns_gradient_exact =
                !matches!(activation, ActivationConfig::Gelu) || b.name == "flex";
            let mut encoder = TransformerEncoderConfig::new(16, 32, 4, 2)
                .with_dropout(0.0)
                .with_norm_first(norm_first)
                .with_activation(activation.clone())
                .with_layer_norm_eps(1e-3)
                .init(d);
            let mut decoder = TransformerDecoderConfig::new(16, 32, 4, 2)
                .with_dropout(0.0)
                .with_norm_first(norm_first)
                .with_activation(activation)
                .init(d);
            let mut seed = 10;
            for layer in &mut encoder.layers {
                for norm in [&mut layer.norm_1, &mut layer.norm_2] {
                    shaken(norm, seed, d);
                    seed += 2;
                }
            }
            for layer in &mut decoder.layers {
                for norm in [&mut layer.norm_1, &mut layer.norm_2, &mut layer.norm_3] {
                    shaken(norm, seed, d);
                    seed += 2;
                }
            }
            let ours_encoder = mha::Encoder::try_from(encoder.clone()).unwrap();
            let ours_decoder = mha::Decoder::try_from(decoder.clone()).unwrap();
            assert_eq!(ours_encoder.layers[0].norm1.epsilon(), 1e-3, "{what}");
            let x = crate::util::randn([2, 5, 16], 1, d).require_grad();
            let memory = crate::util::randn([2, 7, 16], 2, d).require_grad();
            // Row 0 pads its last 2 tokens, row 1 none.
            let pad = |len: usize| {
                let values = (0..2 * len)
                    .map(|i| i >= len - 2 && i < len)
                    .collect::<Vec<_>>();
                Tensor::<2, burn::tensor::Bool>::from_data(
                    burn::tensor::TensorData::new(values, [2, len]),
                    d,
                )
            };
            let causal = generate_autoregressive_mask(2, 5, d);
            // The gradients of x, and of the memory where it was read.
            let grads = |out: Tensor<3>| {
                let g = (out * crate::util::randn([2, 5, 16], 3, d))
                    .sum()
                    .backward();
                [x.grad(&g), memory.grad(&g)]
            };
            // The encoder over padded tokens, causal through Burn's attention mask.
            let want = encoder.forward(
                TransformerEncoderInput::new(x.clone())
                    .mask_pad(pad(5))
                    .mask_attn(causal.clone()),
            );
            let mask = AttentionMask::key_padding(pad(5)).and(AttentionMask::blocking(
                causal.clone().unsqueeze_dim::<4>(1),
            ));
            let got = ours_encoder
                .forward(mha::StackInput::new(x.clone()).mask(mask))
                .unwrap()
                .output;
            assert_close(
                &format!("{what} encoder"),
                got.clone(),
                want.clone(),
                b.forward_tol(),
            );
            if burns_gradient_exact {
                let [got, want] = [grads(got), grads(want)].map(|[dx, _]| dx.unwrap());
                assert_grad_close(&b, &format!("{what} encoder dx"), got, want);
            }
            // The decoder, causal, over a padded memory.
            let want = decoder.forward(
                TransformerDecoderInput::new(x.clone(), memory.clone())
                    .target_mask_attn(causal.clone())
                    .memory_mask_pad(pad(7)),
            );
            let got = ours_decoder
                .forward(
                    mha::StackInput::new(x.clone())
                        .memory(memory.clone())
                        .mask(AttentionMask::blocking(causal.unsqueeze_dim::<4>(1)))
                        .memory_mask(AttentionMask::key_padding(pad(7))),
                )
                .unwrap()
                .output;
            assert_close(
                &format!("{what} decoder"),
                got.clone(),
                want.clone(),
                b.forward_tol(),
            );
            if !burns_gradient_exact {
                continue;
            }
            let (got, want) = (grads(got), grads(want));
            for ((name, got), want) in ["dx", "dmemory"].into_iter().zip(got).zip(want) {
                let (got, want) = (got.unwrap(), want.unwrap());
                assert_grad_close(&b, &format!("{what} decoder {name}"), got, want);
            }
        }
        let tanh = TransformerEncoderConfig::new(16, 32, 4, 1)
            .with_activation(ActivationConfig::Tanh)
            .init(d);
        let err = mha::Encoder::try_from(tanh).unwrap_err().to_string();
        assert_eq!(
            err,
            "TransformerEncoderLayer.pwff.activation: Burn's Tanh has no counterpart here \
             (GELU, exact or tanh, and ReLU convert)",
            "[{}]",
            b.name
        );
    }
}

#[test]
fn configurations_the_blocks_cannot_compute_are_named() {
    let json = std::fs::read(crate::util::root().join("tests/fixtures/llama_layer.json")).unwrap();
    let base: serde_json::Value = serde_json::from_slice(&json).unwrap();
    let with = |key: &str, value: serde_json::Value| {
        let mut config = base.clone();
        config[key] = value;
        let bytes = serde_json::to_vec(&config).unwrap();
        HfConfig::from_json(&bytes, "config.json")
            .and_then(|c| c.block())
            .map(|_| ())
            .unwrap_err()
            .to_string()
    };
    let err = with("hidden_act", "gelu".into());
    assert!(
        err.contains("`hidden_act`") && err.contains("silu"),
        "{err}"
    );
    let err = with("model_type", "gpt2".into());
    assert!(
        err.contains("`model_type`") && err.contains("gpt2"),
        "{err}"
    );
    // Mistral's window is every block's; Llama has none; Qwen2's covers the layers from
    // max_window_layers on: every layer (0) or none load, some only is refused.
    let window = |changes: serde_json::Value| {
        let mut config = base.clone();
        config["sliding_window"] = 4096.into();
        for (key, value) in changes.as_object().unwrap() {
            config[key] = value.clone();
        }
        let bytes = serde_json::to_vec(&config).unwrap();
        HfConfig::from_json(&bytes, "config.json").and_then(|c| c.block())
    };
    use serde_json::json;
    assert_eq!(
        window(json!({"model_type": "mistral"})).unwrap().window,
        Some(4096)
    );
    assert_eq!(window(json!({})).unwrap().window, None);
    let qwen2 = |from: usize| {
        window(json!({"model_type": "qwen2", "use_sliding_window": true,
                      "max_window_layers": from, "num_hidden_layers": 4}))
    };
    assert_eq!(qwen2(0).unwrap().window, Some(4096));
    assert_eq!(qwen2(4).unwrap().window, None);
    let err = qwen2(2).unwrap_err().to_string();
    assert!(
        err.contains("`max_window_layers` of config.json: 2") && err.contains("4096"),
        "{err}"
    );
    // transformers 5 follows `layer_types` over the fields it is made from: a list that
    // disagrees with them is refused (it was read past), one that agrees loads.
    let listed = |changes: serde_json::Value, kind: &str| {
        let mut changes = changes;
        changes["layer_types"] = json!(vec![kind; 4]);
        window(changes)
    };
    let qwen2_listed = |from: usize, kind| {
        let changes = json!({"model_type": "qwen2", "use_sliding_window": true,
                             "max_window_layers": from, "num_hidden_layers": 4});
        listed(changes, kind)
    };
    assert_eq!(
        qwen2_listed(0, "sliding_attention").unwrap().window,
        Some(4096)
    );
    assert_eq!(qwen2_listed(4, "full_attention").unwrap().window, None);
    for (from, kind, ours) in [
        (4, "sliding_attention", "full_attention"),
        (0, "full_attention", "sliding_attention"),
    ] {
        let err = qwen2_listed(from, kind).unwrap_err().to_string();
        let want = format!("make all 4 layers {ours}");
        assert!(
            err.contains("`layer_types` of config.json") && err.contains(&want),
            "{err}"
        );
    }
    let err = listed(json!({"num_hidden_layers": 3}), "full_attention")
        .unwrap_err()
        .to_string();
    assert!(err.contains("`layer_types`"), "{err}");
    let by_layer = json!({"full_attention": {"rope_type": "default", "rope_theta": 1e6}});
    let err = with("rope_parameters", by_layer);
    assert!(
        err.contains("`rope_parameters`") && err.contains("by layer type"),
        "{err}"
    );
    let yarn = serde_json::json!({"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0});
    let err = with("rope_parameters", yarn);
    assert!(
        err.contains("`rope_parameters`") && err.contains("yarn"),
        "{err}"
    );
    let mut missing = base.clone();
    missing.as_object_mut().unwrap().remove("hidden_size");
    let bytes = serde_json::to_vec(&missing).unwrap();
    let err = HfConfig::from_json(&bytes, "config.json")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("config.json") && err.contains("`hidden_size`"),
        "{err}"
    );
    // A block that is not configured as such a layer is refused before any key is read.
    let f = Fixture::load("llama_layer");
    let block = EncoderBlockConfig::new(32, 4).init(&Device::default());
    let err = load_decoder_layer(block, &f.weights, "model.")
        .unwrap_err()
        .to_string();
    assert!(err.contains("causal and pre-norm"), "{err}");
}

#[test]
fn models_that_share_bert_or_gpt2_keys_but_compute_otherwise_are_named() {
    for (name, other) in [("bert_model", "roberta"), ("gpt2_lm", "gpt_neo")] {
        let path = crate::util::root().join(format!("tests/fixtures/{name}.json"));
        let mut config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        config["model_type"] = other.into();
        let err = match name {
            "bert_model" => serde_json::from_value::<BertConfig>(config)
                .unwrap()
                .block()
                .map(|_| ()),
            _ => serde_json::from_value::<Gpt2Config>(config)
                .unwrap()
                .block()
                .map(|_| ()),
        };
        let err = err.unwrap_err().to_string();
        let want = format!("`model_type` of config.json: `{other}`");
        assert!(err.contains(&want), "{err}");
    }
    // Each refusal names its own field; activations the blocks compute under another
    // name load.
    let path = crate::util::root().join("tests/fixtures/gpt2_lm.json");
    let base: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let gpt2 = |key: &str, value: serde_json::Value| {
        let mut config = base.clone();
        config[key] = value;
        serde_json::from_value::<Gpt2Config>(config)
            .unwrap()
            .block()
    };
    for (name, activation) in [
        ("gelu_fast", FeedForwardActivation::GeluTanh),
        ("relu", FeedForwardActivation::Relu),
    ] {
        let block = gpt2("activation_function", name.into()).unwrap();
        assert_eq!(block.activation, activation, "{name}");
    }
}

/// Fields a Llama-family `config.json` leaves out take transformers' defaults for its
/// model type: Mistral's, Qwen2's and Qwen3's window of 4096 (which `null` turns off),
/// Qwen2's first sliding layer 28, Mistral's 8 key/value heads; RoPE's base is
/// `rope_scaling`'s first, as transformers 5 reads it; a partial rotation is refused.
#[test]
fn llama_family_fields_left_out_take_transformers_defaults() {
    use serde_json::json;
    let json = std::fs::read(crate::util::root().join("tests/fixtures/llama_layer.json")).unwrap();
    let base: serde_json::Value = serde_json::from_slice(&json).unwrap();
    let parse = |changes: serde_json::Value, removed: &[&str]| {
        let mut config = base.clone();
        for key in removed {
            config.as_object_mut().unwrap().remove(*key);
        }
        for (key, value) in changes.as_object().unwrap() {
            config[key] = value.clone();
        }
        let bytes = serde_json::to_vec(&config).unwrap();
        let parsed = HfConfig::from_json(&bytes, "config.json");
        // Read by Burn's `Config::load_binary` (and `load`), the same defaults (they
        // had none).
        if let Ok(config) = &parsed {
            let burns = <HfConfig as burn::config::Config>::load_binary(&bytes).unwrap();
            assert_eq!(
                serde_json::to_value(burns).unwrap(),
                serde_json::to_value(config).unwrap()
            );
        }
        parsed
    };
    let block = |changes, removed: &[&str]| parse(changes, removed).and_then(|c| c.block());
    let window = |changes, removed: &[&str]| block(changes, removed).unwrap().window;
    let none: &[&str] = &["sliding_window"];
    assert_eq!(window(json!({"model_type": "mistral"}), none), Some(4096));
    // As Burn's `Config::load` reads a file.
    let path = std::env::temp_dir().join(format!("mha-mistral-{}.json", std::process::id()));
    let mut mistral = base.clone();
    mistral["model_type"] = "mistral".into();
    mistral.as_object_mut().unwrap().remove("sliding_window");
    std::fs::write(&path, mistral.to_string()).unwrap();
    let loaded = <HfConfig as burn::config::Config>::load(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(loaded.sliding_window, Some(4096));
    let off = json!({"model_type": "mistral", "sliding_window": null});
    assert_eq!(window(off, &[]), None);
    assert_eq!(window(json!({"model_type": "llama"}), none), None);
    // Qwen2: used, its 4096 slides from layer 28 by default: none of 4 layers.
    let qwen2 = |changes: serde_json::Value| {
        let mut all = json!({"model_type": "qwen2", "use_sliding_window": true,
                             "num_hidden_layers": 4});
        for (key, value) in changes.as_object().unwrap() {
            all[key] = value.clone();
        }
        all
    };
    let absent: &[&str] = &["sliding_window", "max_window_layers"];
    assert_eq!(window(qwen2(json!({})), absent), None);
    assert_eq!(
        window(qwen2(json!({"max_window_layers": 0})), none),
        Some(4096)
    );
    let err = block(qwen2(json!({"max_window_layers": 2})), none).unwrap_err();
    assert!(
        err.to_string()
            .contains("`max_window_layers` of config.json: 2"),
        "{err}"
    );
    assert_eq!(window(json!({"model_type": "qwen2"}), absent), None);
    // Key/value heads.
    let kv = |family: &str| {
        parse(json!({"model_type": family}), &["num_key_value_heads"])
            .unwrap()
            .num_key_value_heads
    };
    assert_eq!(
        [kv("llama"), kv("mistral"), kv("qwen2"), kv("qwen3")],
        [None, Some(8), Some(32), Some(32)]
    );
    // The context: transformers' default for each, left out (the example's check of
    // --tokens against it took no bound); `null` is none.
    let context = |changes| {
        parse(changes, &["max_position_embeddings"])
            .unwrap()
            .max_position_embeddings
    };
    let family = |name: &str| context(json!({"model_type": name}));
    assert_eq!(
        [
            family("llama"),
            family("mistral"),
            family("qwen2"),
            family("qwen3")
        ],
        [Some(2048), Some(131_072), Some(32_768), Some(32_768)]
    );
    assert_eq!(context(json!({"max_position_embeddings": null})), None);
    // RoPE's base: rope_scaling's, then rope_parameters', then the top level's.
    let theta = |changes| match block(changes, &["rope_theta", "rope_parameters"])
        .unwrap()
        .positions
    {
        Positions::Rope { theta, .. } => theta,
        other => panic!("{other:?}"),
    };
    let scaling = json!({"rope_scaling": {"rope_type": "default", "rope_theta": 1e6}});
    assert_eq!(theta(scaling), 1e6);
    assert_eq!(theta(json!({"rope_theta": 5e5})), 5e5);
    let both = json!({"rope_theta": 5e5, "rope_parameters": {"rope_theta": 500.0}});
    assert_eq!(theta(both), 500.0);
    assert_eq!(theta(json!({})), 10_000.0);
    // rope_scaling, where there is one, in place of rope_parameters.
    let both = json!({"rope_theta": 5e5, "rope_parameters": {"rope_theta": 500.0},
                      "rope_scaling": {"rope_type": "default"}});
    assert_eq!(theta(both), 5e5);
    // An empty rope_scaling is none: rope_parameters', whose scaling is refused.
    let empty = json!({"rope_parameters": {"rope_theta": 500.0}, "rope_scaling": {}});
    assert_eq!(theta(empty), 500.0);
    let linear = json!({"rope_scaling": {},
                        "rope_parameters": {"rope_type": "linear", "factor": 2.0}});
    let err = block(linear, &[]).unwrap_err();
    assert!(
        err.to_string()
            .contains("`rope_parameters` of config.json: RoPE scaling `linear`"),
        "{err}"
    );
    let err = block(json!({"partial_rotary_factor": 0.5}), &[]).unwrap_err();
    assert!(
        err.to_string()
            .contains("`partial_rotary_factor` of config.json: partial_rotary_factor 0.5"),
        "{err}"
    );
    let nested = json!({"rope_parameters": {"rope_theta": 500.0, "partial_rotary_factor": 0.25}});
    let err = block(nested, &[]).unwrap_err();
    assert!(
        err.to_string()
            .contains("`rope_parameters` of config.json: partial_rotary_factor 0.25"),
        "{err}"
    );
    assert!(block(json!({"partial_rotary_factor": 1.0}), &[]).is_ok());
}

/// GPT-2 with a head of its own (`tie_word_embeddings: false`): `lm_head.weight` is read
/// (it was ignored for the embedding). The fixture's head made twice its embedding
/// doubles its logits.
#[test]
fn gpt2_with_a_head_of_its_own_reads_it() {
    let path = crate::util::root().join("tests/fixtures/gpt2_lm.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let stored = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let wte = stored.tensor("model.transformer.wte.weight").unwrap();
    let doubled: Vec<u8> = wte
        .data()
        .chunks(4)
        .flat_map(|b| (2.0 * f32::from_le_bytes(b.try_into().unwrap())).to_le_bytes())
        .collect();
    let mut views: Vec<(String, safetensors::tensor::TensorView)> = stored
        .tensors()
        .into_iter()
        .filter(|(key, _)| key != "model.lm_head.weight")
        .collect();
    let head = safetensors::tensor::TensorView::new(wte.dtype(), wte.shape().to_vec(), &doubled);
    views.push(("model.lm_head.weight".into(), head.unwrap()));
    let untied_bytes = safetensors::serialize(views, None).unwrap();
    let untied = mha::PyTorchWeights::from_bytes(&untied_bytes, "untied").unwrap();
    let json = crate::util::root().join("tests/fixtures/gpt2_lm.json");
    let tied_config = Gpt2Config::from_file(&json).unwrap();
    let untied_config = Gpt2Config {
        tie_word_embeddings: false,
        ..tied_config.clone()
    };
    let f = Fixture::load("gpt2_lm");
    for b in backends() {
        let load = |config: &Gpt2Config, weights, prefix: &str| {
            config
                .init_causal_lm(&b.device)
                .and_then(|lm| load_gpt2_lm(lm, weights, prefix))
                .unwrap_or_else(|e| panic!("{e}"))
        };
        let tied = load(&tied_config, &f.weights, "model.transformer.");
        let own = load(&untied_config, &untied, "model.transformer.");
        assert!(own.lm_head.is_some() && tied.lm_head.is_none());
        let ids = f.io::<2>("ids", [2, 9], &b.device).int();
        let want = tied.forward(ids.clone(), AttentionMask::none()) * 2.0;
        let got = own.forward(ids, AttentionMask::none());
        assert_close(
            &format!("[{}] untied head", b.name),
            got,
            want,
            b.forward_tol(),
        );
    }
}

/// GPT-2's other scales of the scores, against GPT-2's own scale with larger or smaller
/// queries: `scale_attn_weights: false` (scores `Q Kᵀ`) computes what the scaled model
/// computes from queries `sqrt(head_dim)` times larger; `scale_attn_by_inverse_layer_idx`
/// (block `i`'s scores also divided by `i + 1`) what it computes from block `i`'s queries
/// divided by `i + 1`; the fixture's query columns of `c_attn` (weight and bias) so scaled
/// load as the other model. Compared: every block's attention weights and the last hidden
/// state. (The key columns are made 30 times larger in both, so that the scores, small at
/// the fixture's initialisation, are not all near 0 and the scale shows.)
#[test]
fn gpt2_scales_of_scores_are_gpt2_with_scaled_queries() {
    let path = crate::util::root().join("tests/fixtures/gpt2_lm.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    let stored = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let json = crate::util::root().join("tests/fixtures/gpt2_lm.json");
    let scaled_config = Gpt2Config::from_file(&json).unwrap();
    let width = scaled_config.n_embd;
    let sqrt_head_dim = ((width / scaled_config.n_head) as f32).sqrt();
    // `c_attn` is `[in, 3 · width]` (Conv1D's layout), its bias `[3 · width]`: each row's
    // first `width` columns make the queries, the next `width` the keys.
    let weights = |query_factor: &dyn Fn(usize) -> f32| {
        let changed: Vec<(String, Vec<u8>)> = stored
            .tensors()
            .into_iter()
            .filter(|(key, _)| key.starts_with("model.") && key.contains(".attn.c_attn."))
            .map(|(key, view)| {
                let layer = key["model.transformer.h.".len()..].split('.').next();
                let layer: usize = layer.unwrap().parse().unwrap();
                let data = view
                    .data()
                    .chunks(4)
                    .enumerate()
                    .flat_map(|(i, b)| {
                        let value = f32::from_le_bytes(b.try_into().unwrap());
                        let factor = match (i % (3 * width)) / width {
                            0 => query_factor(layer),
                            1 => 30.0,
                            _ => 1.0,
                        };
                        (value * factor).to_le_bytes()
                    })
                    .collect();
                (key, data)
            })
            .collect();
        assert_eq!(changed.len(), 2 * scaled_config.n_layer);
        let mut views: Vec<(String, safetensors::tensor::TensorView)> = stored
            .tensors()
            .into_iter()
            .filter(|(key, _)| !changed.iter().any(|(k, _)| k == key))
            .collect();
        for (key, data) in &changed {
            let view = stored.tensor(key).unwrap();
            let view =
                safetensors::tensor::TensorView::new(view.dtype(), view.shape().to_vec(), data);
            views.push((key.clone(), view.unwrap()));
        }
        let bytes = safetensors::serialize(views, None).unwrap();
        mha::PyTorchWeights::from_bytes(&bytes, "c_attn scaled").unwrap()
    };
    let plain = weights(&|_| 1.0);
    let f = Fixture::load("gpt2_lm");
    for (scale_attn_weights, by_layer) in [(false, false), (true, true), (false, true)] {
        let config = Gpt2Config {
            scale_attn_weights,
            scale_attn_by_inverse_layer_idx: by_layer,
            ..scaled_config.clone()
        };
        let factor = |layer: usize| {
            let unscaled = if scale_attn_weights {
                1.0
            } else {
                sqrt_head_dim
            };
            let by_layer = if by_layer { (layer + 1) as f32 } else { 1.0 };
            unscaled / by_layer
        };
        let what = format!("scale_attn_weights {scale_attn_weights}, by layer {by_layer}");
        // Each block's scale, and the blocks' shared configuration where there is one.
        for layer in 0..scaled_config.n_layer {
            let scale = config.layer_block(layer).unwrap().attention_scale.unwrap();
            let want = (factor(layer) / sqrt_head_dim) as f64;
            assert!((scale - want).abs() < 1e-7 * want, "{what}: {scale}");
        }
        match by_layer {
            false => assert_eq!(config.block().unwrap().attention_scale, Some(1.0)),
            true => {
                let err = config.block().map(|_| ()).unwrap_err().to_string();
                assert!(
                    err.contains("`scale_attn_by_inverse_layer_idx`")
                        && err.contains("Gpt2Config::layer_block(i)"),
                    "{err}"
                );
            }
        }
        let larger = weights(&factor);
        for b in backends() {
            let load = |config: &Gpt2Config, weights| {
                config
                    .init_causal_lm(&b.device)
                    .and_then(|lm| load_gpt2_lm(lm, weights, "model.transformer."))
                    .unwrap_or_else(|e| panic!("{e}"))
            };
            let ids = f.io::<2>("ids", [2, 9], &b.device).int();
            // Every block's attention weights, and the last hidden state (after `ln_f`, of
            // order 1, where the head's logits are small).
            let run = |config, weights| {
                let lm = load(config, weights);
                let x = lm.embed_tokens.forward(ids.clone());
                let out = lm.model.forward(BlockInput::new(x).weights()).unwrap();
                (Tensor::cat(out.weights, 0), out.output)
            };
            let (want_weights, want) = run(&scaled_config, &larger);
            let (got_weights, got) = run(&config, &plain);
            // The scale moves the weights well beyond the tolerance (the comparison can
            // fail).
            let (plain_weights, _) = run(&scaled_config, &plain);
            let moved = crate::util::max_abs_diff(plain_weights, got_weights.clone());
            println!(
                "[{}] {what}: the scale moved the weights by {moved:.2e}",
                b.name
            );
            assert!(
                moved > 10.0 * b.forward_tol(),
                "[{}] {what}: {moved}",
                b.name
            );
            let name = |part| format!("[{}] {what}: {part}", b.name);
            assert_close(&name("weights"), got_weights, want_weights, b.forward_tol());
            assert_close(&name("hidden state"), got, want, b.forward_tol());
        }
    }
}

#[test]
fn rope_in_both_layouts_matches_pytorch() {
    let rope = |theta, layout| Positions::Rope { theta, layout };
    check_positioned("mha_rope_half_split", rope(10_000.0, RopeLayout::HalfSplit));
    check_positioned("mha_rope_interleaved", rope(500.0, RopeLayout::Interleaved));
}

#[test]
fn alibi_with_six_heads_matches_pytorch() {
    check_positioned("mha_alibi", Positions::Alibi);
}

#[test]
fn learned_relative_biases_match_pytorch() {
    check_positioned(
        "mha_relative_clipped",
        Positions::Relative { max_distance: 4 },
    );
    for (fixture, bidirectional) in [("mha_t5_bidirectional", true), ("mha_t5_causal", false)] {
        let t5 = Positions::T5 {
            num_buckets: 8,
            max_distance: 20,
            bidirectional,
        };
        check_positioned(fixture, t5);
    }
}

/// Hugging Face's `T5Attention` (transformers) with its relative bias, loaded by its own
/// names and layout (`q/k/v/o.weight`, `relative_attention_bias.weight` `[buckets,
/// heads]`) into a module configured as T5 computes (no biases, scale 1, T5's buckets):
/// the encoder's self-attention with key padding, the decoder's causal one. Output and
/// the gradients of the input and of every parameter, the table's included.
#[test]
fn hugging_face_t5_attention_matches_transformers() {
    for (fixture, decoder) in [("mha_t5_hf_encoder", false), ("mha_t5_hf_decoder", true)] {
        let f = Fixture::load(fixture);
        let config = MultiHeadAttentionConfig::new(24, 6)
            .with_bias(false)
            .with_scale(Some(1.0))
            .with_positions(Positions::T5 {
                num_buckets: 8,
                max_distance: 20,
                bidirectional: !decoder,
            });
        for b in backends() {
            let dev = b.autodiff();
            let mha = config
                .init(&dev)
                .load_pytorch(&f.weights, "model.")
                .unwrap_or_else(|e| panic!("{e}"));
            let x = f.io("x", [2, 12, 24], &dev).require_grad();
            let mask = match decoder {
                true => AttentionMask::causal(),
                false => AttentionMask::key_padding(f.io_mask("key_padding", [2, 12], &dev)),
            };
            let out = mha.self_attention(x.clone(), mask);
            check_forward(&b, &f, "out", out.clone(), "out");
            let grads = backward(&f, &out, &dev);
            check_input_grad(&b, &f, "x", &x, &grads);
            check_param_grads(&b, &f, &mha, config.init(&dev), &grads);
            let table = mha.position_table.as_ref().expect("a table").val();
            let hf = f.io("grad.model.relative_attention_bias.weight", [8, 6], &dev);
            assert_grad_close(
                &b,
                &format!("{fixture} [{}] grad of the table, [heads, buckets]", b.name),
                table.grad(&grads).expect("the table has a gradient"),
                hf.transpose(),
            );
            // A later layer of T5's stack: its own projections, no table (T5 lends it the
            // first layer's). Refused until the table is shared under its key, then the
            // same numbers.
            let mut weights = f.weights.clone();
            for key in ["q.weight", "k.weight", "v.weight", "o.weight"] {
                weights
                    .share(&format!("model.{key}"), &format!("layer.1.{key}"))
                    .unwrap();
            }
            let later =
                |weights: &mha::PyTorchWeights| config.init(&dev).load_pytorch(weights, "layer.1.");
            let refused = later(&weights).map(|_| ()).unwrap_err().to_string();
            assert!(refused.contains("PyTorchWeights::share"), "{refused}");
            let table = "relative_attention_bias.weight";
            weights
                .share(&format!("model.{table}"), &format!("layer.1.{table}"))
                .unwrap();
            let shared = later(&weights).unwrap_or_else(|e| panic!("{e}"));
            let x = f.io("x", [2, 12, 24], &dev);
            let mask = match decoder {
                true => AttentionMask::causal(),
                false => AttentionMask::key_padding(f.io_mask("key_padding", [2, 12], &dev)),
            };
            check_forward(&b, &f, "out", shared.self_attention(x, mask), "out");
            // Shared under a key that holds a tensor, or from one that holds none: refused.
            let taken = weights
                .share("model.q.weight", "layer.1.q.weight")
                .unwrap_err();
            assert!(
                taken.to_string().contains("holds a tensor already"),
                "{taken}"
            );
            let absent = weights
                .share("model.nothing", "layer.2.q.weight")
                .unwrap_err();
            assert!(
                matches!(absent, mha::ImportError::MissingKey { .. }),
                "{absent}"
            );
        }
    }
}

#[test]
fn buckets_sinusoids_and_slopes_are_pytorchs() {
    let f = Fixture::load("position_tables");
    let dev = &crate::util::first_device();
    for bidirectional in [true, false] {
        for (num_buckets, max_distance) in [(32, 128), (8, 20)] {
            let key = format!(
                "t5.{}.{num_buckets}.{max_distance}",
                if bidirectional { "bi" } else { "causal" }
            );
            let want = crate::util::to_vec(f.io(&key, [601], dev));
            let buckets = Buckets::T5 {
                num_buckets,
                max_distance,
                bidirectional,
            };
            for (d, &w) in (-300..=300).zip(&want) {
                assert_eq!(buckets.of(d) as f32, w, "{key}: distance {d}");
            }
        }
    }
    let ours = mha::positions::sinusoids(3, 7, 10, dev);
    assert_close("sinusoids", ours, f.io("sinusoids", [7, 10], dev), 1e-6);
    for heads in 1..=16 {
        let want = crate::util::to_vec(f.io(&format!("alibi.{heads}"), [heads], dev));
        assert_eq!(mha::positions::alibi_slopes(heads), want, "{heads} heads");
    }
}

#[test]
fn gelu_values_and_gradient_match_pytorch_with_and_without_autodiff() {
    // The fused operation on flex and ndarray, written with erf on wgpu.
    let f = Fixture::load("gelu");
    let shape = [3, 5, 67];
    for b in backends() {
        let gelu = FeedForwardActivation::Gelu;
        let x = f.io("x", shape, &b.device);
        let out = gelu.forward(x);
        assert_close(
            &format!("[{}] gelu", b.name),
            out,
            f.io("out", shape, &b.device),
            b.forward_tol(),
        );

        let device = b.autodiff();
        let x = f.io("x", shape, &device).require_grad();
        let out = gelu.forward(x.clone());
        let grads = backward(&f, &out, &device);
        assert_close(
            &format!("[{}] gelu under autodiff", b.name),
            out,
            f.io("out", shape, &device),
            b.forward_tol(),
        );
        assert_grad_close(
            &b,
            &format!("[{}] gelu gradient", b.name),
            x.grad(&grads).expect("x has a gradient"),
            f.io("grad.x", shape, &device),
        );
        // A view that is not contiguous (the transpose of the last two axes) reads the same.
        let x = f.io("x", shape, &b.device).swap_dims(1, 2);
        let want = f.io("out", shape, &b.device).swap_dims(1, 2);
        assert_close(
            &format!("[{}] gelu of a view", b.name),
            gelu.forward(x),
            want,
            b.forward_tol(),
        );
    }
}

/// A norm of `fixture` over rows of `d`, built by `norm` and loaded from the fixture: its
/// values with and without autodiff, the gradients of the input and the parameters, and
/// a view that is not contiguous (the first two axes swapped).
fn check_norm(fixture: &'static str, d: usize, norm: impl Fn(&Device) -> mha::LayerNorm) {
    let f = Fixture::load(fixture);
    let shape = [3, 5, d];
    for b in backends() {
        let load = |device: &Device| {
            norm(device)
                .load_pytorch(&f.weights, "model.")
                .unwrap_or_else(|e| panic!("{e}"))
        };
        let layer = load(&b.device);
        check_forward(
            &b,
            &f,
            "norm",
            layer.forward(f.io("x", shape, &b.device)),
            "out",
        );

        let device = b.autodiff();
        let layer = load(&device);
        let x = f.io("x", shape, &device).require_grad();
        let out = layer.forward(x.clone());
        let grads = backward(&f, &out, &device);
        check_forward(&b, &f, "norm under autodiff", out, "out");
        check_input_grad(&b, &f, "x", &x, &grads);
        check_param_grads(&b, &f, &layer, norm(&device), &grads);

        let x = f.io("x", shape, &b.device).swap_dims(0, 1);
        let want = f.io("out", shape, &b.device).swap_dims(0, 1);
        let label = format!("[{}] {fixture} of a view", b.name);
        assert_close(&label, load(&b.device).forward(x), want, b.forward_tol());
    }
}

#[test]
fn layer_norm_values_and_gradients_match_pytorch_with_and_without_autodiff() {
    // The fused operation on flex and ndarray, Burn's layer_norm on wgpu; with and without
    // a shift, a row whose variance is 0, rows of 67 and 128.
    for (name, d, bias) in [("layer_norm", 67, true), ("layer_norm_no_bias", 128, false)] {
        let config = burn::nn::LayerNormConfig::new(d).with_bias(bias);
        check_norm(name, d, |device| mha::LayerNorm::new(&config, device));
    }
}

#[test]
fn tanh_gelu_and_silu_match_transformers_with_and_without_autodiff() {
    // GPT-2's gelu_new and Llama's SiLU, written with Burn's operations on every backend.
    for (name, activation) in [
        ("gelu_tanh", FeedForwardActivation::GeluTanh),
        ("silu", FeedForwardActivation::Silu),
    ] {
        let f = Fixture::load(name);
        let shape = [3, 5, 67];
        for b in backends() {
            check_forward(
                &b,
                &f,
                name,
                activation.forward(f.io("x", shape, &b.device)),
                "out",
            );
            let device = b.autodiff();
            let x = f.io("x", shape, &device).require_grad();
            let out = activation.forward(x.clone());
            let grads = backward(&f, &out, &device);
            check_forward(&b, &f, &format!("{name} under autodiff"), out, "out");
            check_input_grad(&b, &f, "x", &x, &grads);
        }
    }
}

#[test]
fn rms_norm_matches_transformers_with_and_without_autodiff() {
    // Hugging Face's LlamaRMSNorm: the fused operation (not centred) on flex and ndarray,
    // Burn's operations on wgpu; rows of 67 at scales 0.3 to 3.3.
    check_norm("rms_norm", 67, |device| {
        mha::LayerNorm::rms(67, 1e-6, device)
    });
}

#[test]
fn gated_feed_forward_matches_llamas_mlp() {
    // transformers' LlamaMLP (SwiGLU, no biases) as a block's gated feed-forward.
    let f = Fixture::load("gated_feed_forward");
    let shape = [2, 7, 24];
    let feed_forward = |device: &Device| {
        EncoderBlockConfig::new(24, 4)
            .with_d_ff(Some(40))
            .with_dropout(0.0)
            .with_activation(FeedForwardActivation::Silu)
            .with_gated(true)
            .with_bias(false)
            .init(device)
            .feed_forward
    };
    for b in backends() {
        let load = |device: &Device| {
            feed_forward(device)
                .load_pytorch(&f.weights, "model.")
                .unwrap_or_else(|e| panic!("{e}"))
        };
        let ff = load(&b.device);
        check_forward(
            &b,
            &f,
            "gated feed-forward",
            ff.forward(f.io("x", shape, &b.device)),
            "out",
        );

        let device = b.autodiff();
        let ff = load(&device);
        let x = f.io("x", shape, &device).require_grad();
        let out = ff.forward(x.clone());
        let grads = backward(&f, &out, &device);
        check_input_grad(&b, &f, "x", &x, &grads);
        check_param_grads(&b, &f, &ff, feed_forward(&device), &grads);
    }
    // A feed-forward that is not gated refuses the weights of one that is.
    let err = EncoderBlockConfig::new(24, 4)
        .with_d_ff(Some(40))
        .with_bias(false)
        .init(&Device::default())
        .feed_forward
        .load_pytorch(&f.weights, "model.")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.up.weight") && err.contains("gated"),
        "{err}"
    );
}

#[test]
fn layer_norm_files_load_across_burn_and_mha() {
    // A model saved with Burn's LayerNorm (as blocks were before they had their own) loads
    // into mha's, and back.
    let device = Device::default();
    let config = burn::nn::LayerNormConfig::new(5);
    let dir = std::env::temp_dir().join(format!("mha-norm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut burns = config.init(&device);
    burns.gamma = Param::from_tensor(crate::util::randn([5], 1, &device));
    burns.beta = Some(Param::from_tensor(crate::util::randn([5], 2, &device)));
    burns.clone().save_file(dir.join("burn")).unwrap();
    let ours = mha::LayerNorm::new(&config, &device)
        .try_load_file(dir.join("burn"))
        .unwrap();
    let x = crate::util::randn([4, 5], 3, &device);
    assert_close(
        "burn -> mha",
        ours.forward(x.clone()),
        burns.forward(x.clone()),
        1e-6,
    );
    ours.save_file(dir.join("mha")).unwrap();
    let back = config.init(&device).try_load_file(dir.join("mha")).unwrap();
    assert_close(
        "mha -> burn",
        back.forward(x.clone()),
        burns.forward(x),
        0.0,
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// Without autodiff the loss is computed without its gradient (a validation loss wrote a
/// gradient of the logits' size): the same loss as under autodiff, over rows in several
/// parallel blocks, some ignored.
#[test]
fn cross_entropy_without_autodiff_is_the_loss_under_it() {
    for b in backends() {
        let (rows, classes) = (1000, 7);
        let values: Vec<i64> = (0..rows as i64).map(|r| (r * 5 % 8) - 1).collect();
        let targets = |device: &Device| {
            let data = burn::tensor::TensorData::new(values.clone(), [rows]);
            Tensor::<1, burn::tensor::Int>::from_data(data, device)
        };
        let logits = |device: &Device| crate::util::randn([rows, classes], 21, device) * 3.0;
        let plain = mha::loss::cross_entropy(logits(&b.device), targets(&b.device), Some(-1));
        let ad = b.autodiff();
        let tracked = logits(&ad).require_grad();
        let want = mha::loss::cross_entropy(tracked, targets(&ad), Some(-1)).inner();
        let label = format!("[{}] cross-entropy without autodiff", b.name);
        assert_close(&label, plain, want, 1e-6);
    }
}

/// `F.cross_entropy`'s other arguments against PyTorch: label smoothing, class weights,
/// both, and the sum and per-row reductions (rows ignored at -100), the loss and the
/// logits' gradient on every backend; and a mean over no weight is 0, not NaN.
#[test]
fn cross_entropy_with_weights_smoothing_and_reductions_matches_pytorch() {
    use mha::loss::{CrossEntropyOptions, Reduction, cross_entropy_with};
    let f = Fixture::load("cross_entropy_options");
    let shape = [23, 7];
    for b in backends() {
        let device = b.autodiff();
        let weight = f.io::<1>("weight", [7], &device);
        let targets = f.io::<1>("targets", [23], &device).int();
        let base = CrossEntropyOptions::default().with_ignore_index(Some(-100));
        let cases = [
            ("smooth", base.clone().with_label_smoothing(0.1), 1),
            ("weight", base.clone().with_weight(weight.clone()), 1),
            (
                "weight_smooth",
                base.clone()
                    .with_weight(weight.clone())
                    .with_label_smoothing(0.25),
                1,
            ),
            (
                "sum",
                base.clone()
                    .with_label_smoothing(0.1)
                    .with_reduction(Reduction::Sum),
                1,
            ),
            (
                "none",
                base.clone()
                    .with_weight(weight.clone())
                    .with_label_smoothing(0.1)
                    .with_reduction(Reduction::None),
                23,
            ),
            ("plain_sum", base.clone().with_reduction(Reduction::Sum), 1),
        ];
        for (case, options, len) in cases {
            let what = format!("[{}] cross-entropy, {case}", b.name);
            let logits = f.io::<2>("logits", shape, &device).require_grad();
            let loss = cross_entropy_with(logits.clone(), targets.clone(), &options);
            let want = f.io::<1>(&format!("{case}.out"), [len], &device);
            assert_close(&what, loss.clone(), want, b.forward_tol());
            let grad_out = f.io::<1>(&format!("{case}.grad_out"), [len], &device);
            let grads = (loss * grad_out).sum().backward();
            let grad = logits.grad(&grads).expect("a gradient");
            let want = f.io::<2>(&format!("{case}.grad.logits"), shape, &b.device);
            assert_grad_close(&b, &format!("{what}, gradient"), grad, want);
        }
        // In every other float dtype: the loss in that dtype, PyTorch's to its precision.
        for dtype in b.other_float_dtypes() {
            let what = format!("[{} {dtype:?}] cross-entropy, weight_smooth", b.name);
            let logits = f.io::<2>("logits", shape, &device).cast(dtype);
            let options = base
                .clone()
                .with_weight(weight.clone())
                .with_label_smoothing(0.25);
            let loss = cross_entropy_with(logits, targets.clone(), &options);
            assert_eq!(loss.dtype(), dtype.into(), "{what}");
            let want = f.io::<1>("weight_smooth.out", [1], &device);
            let [atol, rtol] = b.tolerances_against_f32(dtype)[0];
            let largest = want.clone().abs().max().into_scalar::<f32>() as f64;
            let tol = (atol + rtol * largest) as f32;
            assert_close(&what, loss.cast(burn::tensor::FloatDType::F32), want, tol);
        }
        // Weights of 0 on every kept row's class: a mean over no weight, 0 and a
        // gradient of 0 (PyTorch's is NaN).
        let logits = f.io::<2>("logits", shape, &device).require_grad();
        let zero_on_targets = Tensor::<1>::zeros([7], &device);
        let options = base.clone().with_weight(zero_on_targets);
        let loss = cross_entropy_with(logits.clone(), targets.clone(), &options);
        let grads = loss.clone().backward();
        let what = format!("[{}] cross-entropy over no weight", b.name);
        assert_close(&what, loss, Tensor::zeros([1], &device), 0.0);
        let grad = logits.grad(&grads).expect("a gradient");
        assert_close(&what, grad, Tensor::zeros(shape, &device), 0.0);
    }
}

/// An ignored row counts for nothing whatever its logits (one of -inf gave NaN through a
/// product by 0; PyTorch replaces the row), and f64 logits are computed in f64.
#[test]
fn cross_entropy_with_leaves_ignored_rows_out_and_computes_f64_in_f64() {
    use burn::tensor::{FloatDType, Int, TensorData};
    use mha::loss::{CrossEntropyOptions, Reduction, cross_entropy_with};
    for b in backends() {
        let d = &b.device;
        let logits = Tensor::<2>::from_data(
            TensorData::new(vec![f32::NEG_INFINITY, 0.0, 0.0, 0.0], [2, 2]),
            d,
        );
        let targets = Tensor::<1, Int>::from_data(TensorData::new(vec![-100i64, 1], [2]), d);
        for smoothing in [0.0, 0.3] {
            let options = CrossEntropyOptions::default()
                .with_ignore_index(Some(-100))
                .with_label_smoothing(smoothing)
                .with_reduction(Reduction::Sum);
            let got = cross_entropy_with(logits.clone(), targets.clone(), &options);
            let got = got.into_scalar::<f32>();
            let want = std::f32::consts::LN_2; // row 1 alone: uniform over 2 classes
            assert!(
                (got - want).abs() < 1e-6,
                "[{}] smoothing {smoothing}: {got}, want {want}",
                b.name
            );
        }
        if b.other_float_dtypes().contains(&FloatDType::F64) {
            // ln(1 + e^1e-9): 1e-9 is lost in f32.
            let data = TensorData::new(vec![1e-9f64, 0.0], [1, 2]);
            let logits = Tensor::<2>::from_data(data, (d, burn::tensor::DType::F64));
            let targets = Tensor::<1, Int>::from_data(TensorData::new(vec![1i64], [1]), d);
            let options = CrossEntropyOptions::default().with_reduction(Reduction::Sum);
            let got = cross_entropy_with(logits, targets, &options).into_scalar::<f64>();
            let want = (1.0f64 + 1e-9f64.exp()).ln();
            assert!(
                (got - want).abs() < 1e-15,
                "[{}] f64: {got:e}, want {want:e}",
                b.name
            );
        }
    }
}

/// Bad class weights and label smoothing are refused by name.
#[test]
fn cross_entropy_with_refuses_bad_weights_and_smoothing() {
    use mha::loss::{CrossEntropyOptions, cross_entropy_with};
    let d = crate::util::first_device();
    let logits = || Tensor::<2>::zeros([3, 4], &d);
    let targets = || Tensor::<1, burn::tensor::Int>::zeros([3], &d);
    let refused = |options: CrossEntropyOptions| {
        crate::util::panic_message(|| {
            let _ = cross_entropy_with(logits(), targets(), &options);
        })
    };
    let weight = |values: Vec<f32>| {
        let n = values.len();
        Tensor::<1>::from_data(burn::tensor::TensorData::new(values, [n]), &d)
    };
    let cases = [
        (
            refused(CrossEntropyOptions::default().with_label_smoothing(1.5)),
            "cross_entropy_with: label_smoothing must be in [0, 1], got 1.5",
        ),
        (
            refused(CrossEntropyOptions::default().with_weight(weight(vec![1.0; 3]))),
            "cross_entropy_with: weight has shape [3], not [C] = [4] (logits [3, 4])",
        ),
        (
            refused(CrossEntropyOptions::default().with_weight(weight(vec![1.0, -1.0, 1.0, 1.0]))),
            "cross_entropy_with: weight[1] = -1: class weights must be finite and not negative",
        ),
    ];
    for (got, want) in cases {
        assert_eq!(got, want);
    }
}

/// PyTorch's default `ignore_index`, -100 (Hugging Face's labels), is given as it is:
/// the fixture's loss with the ignored rows' targets made -100 (it could not be written).
#[test]
fn cross_entropy_takes_pytorchs_ignore_index_of_minus_100() {
    let f = Fixture::load("cross_entropy");
    for b in backends() {
        let targets = f.io::<1>("targets", [37], &b.device).int();
        let minus_100 = targets
            .clone()
            .mask_fill(targets.clone().equal_elem(0), -100);
        let logits = || f.io::<2>("logits", [37, 13], &b.device);
        let got = mha::loss::cross_entropy(logits(), minus_100, Some(-100));
        check_forward(&b, &f, "cross-entropy, ignore_index -100", got, "out");
    }
}

#[test]
fn cross_entropy_loss_and_gradient_match_pytorch_with_and_without_autodiff() {
    // The fused operation on flex and ndarray, log_softmax and a gather on wgpu; rows whose
    // target is the ignored index 0 count for nothing.
    let f = Fixture::load("cross_entropy");
    let shape = [37, 13];
    for b in backends() {
        let targets = |device: &Device| f.io::<1>("targets", [37], device).int();
        let loss = mha::loss::cross_entropy(
            f.io("logits", shape, &b.device),
            targets(&b.device),
            Some(0),
        );
        check_forward(&b, &f, "cross-entropy", loss, "out");

        let device = b.autodiff();
        let logits = f.io("logits", shape, &device).require_grad();
        let loss = mha::loss::cross_entropy(logits.clone(), targets(&device), Some(0));
        let grads = backward(&f, &loss, &device);
        check_forward(&b, &f, "cross-entropy under autodiff", loss, "out");
        check_input_grad(&b, &f, "logits", &logits, &grads);

        // Every row ignored: 0 and a gradient of 0, not NaN.
        let logits = f.io("logits", shape, &device).require_grad();
        let none = Tensor::<1, burn::tensor::Int>::zeros([37], &device);
        let loss = mha::loss::cross_entropy(logits.clone(), none, Some(0));
        let grads = loss.clone().backward();
        let zeros = Tensor::<2>::zeros(shape, &device);
        assert_close(
            &format!("[{}] all ignored", b.name),
            loss,
            Tensor::zeros([1], &device),
            0.0,
        );
        let grad = logits.grad(&grads).expect("a gradient");
        assert_close(
            &format!("[{}] all ignored, gradient", b.name),
            grad,
            zeros,
            0.0,
        );
    }
}

/// Cross-entropy of logits in another float dtype: PyTorch's loss at the dtype's precision
/// (half precision reduced in f32), forward and backward (a count in f32 divided a sum in
/// the logits' dtype inside Burn); and logits near 10^4 keep the loss's small value (the
/// fused operation gave 0, its maximum added back in f32).
#[test]
fn cross_entropy_takes_every_float_dtype_and_large_logits() {
    use burn::tensor::FloatDType;
    let f = Fixture::load("cross_entropy");
    let shape = [37, 13];
    for b in backends() {
        for dtype in b.other_float_dtypes() {
            let what = format!("[{} {dtype:?}] cross-entropy", b.name);
            let device = b.autodiff();
            let logits = f.io("logits", shape, &device).cast(dtype).require_grad();
            let targets = f.io::<1>("targets", [37], &device).int();
            let loss = mha::loss::cross_entropy(logits.clone(), targets, Some(0));
            assert_eq!(loss.dtype(), dtype.into(), "{what}");
            let grad_out = f.io::<1>("grad_out", [1], &device).cast(dtype);
            let grad = logits
                .grad(&(loss.clone() * grad_out).sum().backward())
                .expect("a gradient");
            assert_eq!(grad.dtype(), dtype.into(), "{what}");
            // The gradient is held to the dtype's tolerances of gradients of order 1,
            // scaled by its largest value (at most 1.4e-3 here).
            let want = f.io::<2>("grad.logits", shape, &b.device);
            let largest = want.clone().abs().max().into_scalar::<f32>();
            let [atol, rtol] = b.tolerances_against_f32(dtype)[1];
            let err = crate::util::max_abs_diff(grad.cast(FloatDType::F32), want) as f64;
            let tol = (atol + rtol) * largest as f64;
            println!("{what}, gradient: max abs error {err:.2e} (tolerance {tol:.1e})");
            assert!(err <= tol, "{what}, gradient: {err:e} > {tol:e}");
            let [atol, rtol] = b.tolerances_against_f32(dtype)[0];
            let want = f.io::<1>("out", [1], &b.device).into_scalar::<f32>() as f64;
            let got = loss.cast(FloatDType::F32).into_scalar::<f32>() as f64;
            assert!(
                (got - want).abs() <= atol + rtol * want.abs(),
                "{what}: {got} vs {want}"
            );
        }
        let logits = Tensor::<2>::from_floats([[10000.0, 9990.0]], &b.device);
        let target = Tensor::<1, burn::tensor::Int>::from_ints([0], &b.device);
        let loss = mha::loss::cross_entropy(logits, target, None).into_scalar::<f32>() as f64;
        let want = (-10.0f64).exp().ln_1p();
        assert!(
            (loss - want).abs() < 1e-3 * want,
            "[{}] large logits: {loss} vs {want}",
            b.name
        );
    }
}

/// A checkpoint in shards (`model.safetensors.index.json` and the files it names) loads
/// as the single file does, parameter for parameter; a key in two shards, or a directory
/// with neither form, is an error that names it.
#[test]
fn a_checkpoint_in_shards_loads_as_its_single_file() {
    use mha::hf::load_pretrained;
    let model = crate::util::root().join("tests/fixtures/hf_tiny_llama");
    let file = std::fs::read(model.join("model.safetensors")).unwrap();
    let stored = safetensors::SafeTensors::deserialize(&file).unwrap();
    let dir = std::env::temp_dir().join(format!("mha-shards-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(model.join("config.json"), dir.join("config.json")).unwrap();
    // Layer 0 and the embedding in the first shard, the rest in the second; the embedding
    // in both when `twice`.
    let write = |twice: bool| {
        let mut map = serde_json::Map::new();
        for (n, name) in ["model-00001-of-00002", "model-00002-of-00002"]
            .iter()
            .enumerate()
        {
            let first = |key: &str| key.contains("layers.0.") || key.contains("embed_tokens");
            let views: Vec<_> = stored
                .tensors()
                .into_iter()
                .filter(|(key, _)| first(key) == (n == 0) || (twice && key.contains("embed")))
                .collect();
            for (key, _) in &views {
                map.insert(key.clone(), format!("{name}.safetensors").into());
            }
            let bytes = safetensors::serialize(views, None).unwrap();
            std::fs::write(dir.join(format!("{name}.safetensors")), bytes).unwrap();
        }
        let index = serde_json::json!({ "metadata": {}, "weight_map": map });
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    };
    let device = Device::default();
    let values = |lm: &mha::hf::CausalLm| -> Vec<Vec<f32>> {
        param_values(lm)
            .into_iter()
            .map(crate::util::to_vec)
            .collect()
    };
    write(false);
    let (_, whole) = load_pretrained(&model, &device).unwrap();
    let (_, sharded) = load_pretrained(&dir, &device).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(values(&sharded), values(&whole));

    write(true);
    let err = load_pretrained(&dir, &device).unwrap_err().to_string();
    assert!(
        err.contains("model.embed_tokens.weight") && err.contains("is also in"),
        "{err}"
    );
    std::fs::write(dir.join("model.safetensors.index.json"), "{}").unwrap();
    let err = load_pretrained(&dir, &device).unwrap_err().to_string();
    assert!(
        err.contains("model.safetensors.index.json: not a safetensors index with a weight_map"),
        "{err}"
    );
    // A shard is a file of the directory: one elsewhere (a path out of it, absolute, or
    // a device, which reads without end) is refused by its key and name.
    for file in [
        "../model.safetensors",
        "/dev/null",
        "shards/a.safetensors",
        "",
    ] {
        let index = serde_json::json!({ "weight_map": { "lm_head.weight": file } });
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
        let err = load_pretrained(&dir, &device).unwrap_err().to_string();
        assert!(
            err.ends_with(&format!(
                "model.safetensors.index.json: weight_map's `lm_head.weight` is in {file:?}, \
                 which is not the name of a file in the model's directory"
            )),
            "{err}"
        );
    }
    // A device or a folder given as the weights' file is named, not read.
    for path in [std::path::Path::new("/dev/zero"), &dir] {
        let err = mha::PyTorchWeights::from_file(path).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "cannot read {}: not a regular file (a directory, a device or a pipe)",
                path.display()
            )
        );
    }
    std::fs::remove_file(dir.join("model.safetensors.index.json")).unwrap();
    let err = load_pretrained(&dir, &device).unwrap_err().to_string();
    assert!(
        err.contains("neither model.safetensors nor model.safetensors.index.json"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A `config.json` whose sizes the weights do not have is refused by the first weight's
/// shape, without building the model's random weights of the configured sizes first: a
/// vocabulary of 2^40 tokens aborted the process (it allocated the table, terabytes,
/// before comparing shapes).
#[test]
fn a_config_larger_than_its_weights_is_refused_by_shape_without_allocating() {
    use mha::hf::load_pretrained;
    let model = crate::util::root().join("tests/fixtures/hf_tiny_llama");
    let dir = std::env::temp_dir().join(format!("mha-huge-vocab-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        model.join("model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(model.join("config.json")).unwrap()).unwrap();
    let width = config["hidden_size"].as_u64().unwrap();
    let vocab = config["vocab_size"].as_u64().unwrap();
    config["vocab_size"] = (1u64 << 40).into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    for b in backends() {
        let err = load_pretrained(&dir, &b.device).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "key `model.embed_tokens.weight`: expected shape [{}, {width}], found \
                 [{vocab}, {width}]",
                1u64 << 40
            ),
            "[{}]",
            b.name
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A Llama-family model's `pad_token_id` (transformers' `nn.Embedding(.., padding_idx)`):
/// the lookup gives the padding token's row no gradient, the other rows theirs, and the
/// logits are those of the same model without one (to the backend's rounding); a negative
/// id counts from the end, one past the table is refused by name.
#[test]
fn the_padding_tokens_embedding_row_gets_no_gradient_from_the_lookup() {
    let config = |pad: &str| -> HfConfig {
        serde_json::from_str(&format!(
            r#"{{"model_type": "llama", "hidden_size": 16, "intermediate_size": 32,
                "num_hidden_layers": 1, "num_attention_heads": 2, "rms_norm_eps": 1e-6,
                "vocab_size": 10, "pad_token_id": {pad}}}"#
        ))
        .unwrap()
    };
    for b in backends() {
        let dev = b.autodiff();
        let plain = config("null").init_causal_lm(&dev).unwrap();
        for (pad, row) in [("3", 3), ("-1", 9)] {
            let what = format!("[{}] pad_token_id {pad}", b.name);
            let made = config(pad).init_causal_lm(&dev).unwrap();
            assert_eq!(made.pad_token, Some(row), "{what}");
            let lm = mha::hf::CausalLm {
                pad_token: Some(row),
                ..plain.clone()
            };
            let ids = [1, row as i64, 4, row as i64, 9 - row as i64, 2];
            let ids = burn::tensor::TensorData::new(ids.to_vec(), [2, 3]);
            let ids = Tensor::<2, burn::tensor::Int>::from_data(ids, &dev);
            let logits = lm.forward(ids.clone(), AttentionMask::none());
            let want = plain.forward(ids, AttentionMask::none());
            assert_close(&what, logits.clone(), want, b.forward_tol());
            let grads = logits.powi_scalar(2).sum().backward();
            let table = lm.embed_tokens.weight.grad(&grads).unwrap();
            let rows = crate::util::to_vec(table.abs().sum_dim(1));
            for (r, total) in rows.iter().enumerate() {
                match r {
                    r if r == row => assert_eq!(*total, 0.0, "{what}: row {r}"),
                    1 | 2 | 4 => assert!(*total > 0.0, "{what}: row {r}"),
                    r if r == 9 - row => assert!(*total > 0.0, "{what}: row {r}"),
                    _ => assert_eq!(*total, 0.0, "{what}: row {r}, not read"),
                }
            }
        }
    }
    let err = config("10").init_causal_lm(&Device::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "`pad_token_id` of config.json: 10 is not a row of the 10 token embeddings (vocab_size)"
    );
}
