//! Whole modules in another float dtype: one cast reaches every parameter of attention,
//! blocks and stacks; half-precision PyTorch weights load as they are stored; a bf16 and an
//! f16 `nn.MultiheadAttention` give PyTorch's numbers.

use burn::module::Module;
use burn::tensor::{DType, FloatDType, Tensor};
use mha::{
    DecoderBlockConfig, DecoderConfig, EncoderBlockConfig, EncoderConfig, LoadPyTorch, ModuleDType,
    MultiHeadAttentionConfig, Positions, StackInput,
};

use crate::util::{
    Backend, Fixture, assert_close, assert_grad_close, backends, max_abs_diff, param_grads,
    param_values, randn,
};

/// The distance from `x` (in `[1, 2)`) to the next value of `dtype`: its unit in the last
/// place at magnitude 1 (bf16 keeps 8 significant bits, f16 11).
fn ulp_at_one(dtype: FloatDType) -> f32 {
    match dtype {
        FloatDType::BF16 => 2f32.powi(-7),
        FloatDType::F16 => 2f32.powi(-10),
        other => panic!("no half precision: {other:?}"),
    }
}

/// `nn.MultiheadAttention(32, 4)` cast to bf16 and to f16 in PyTorch (scripts/golden.py,
/// `half_precision`): its weights stored in that dtype load into a module cast to it, bit
/// for bit, and causal self-attention of the stored (rounded) input gives PyTorch's output.
///
/// Tolerance: 2 units in the last place of the dtype at the output's largest magnitude
/// (about 1.35 here: 2 · 2^-7 · 1.35 = 0.021 for bf16, 2 · 2^-10 · 1.35 = 0.0026 for f16).
/// Each result lies within one ulp of the f64 result of the same rounded weights and input
/// (`io.exact`; measured on flex, bf16: ours 0.8 ulp, PyTorch's 0.55; f16 both 0.5), so
/// the two lie within 2 of each other, however each rounds: PyTorch's CPU kernels
/// accumulate in f32 and round each operation's result once, ours round the projections,
/// the scores, the weights and the context.
///
/// Backends that do not compute in a dtype (ndarray: no f16 nor bf16; wgpu on lavapipe:
/// no bf16) refuse the cast with an error naming the dtype; there, and everywhere, a module left in
/// f32 loads the half-precision weights exactly and matches the f64 result of those
/// weights to f32's tolerance.
#[test]
fn half_precision_attention_loads_as_stored_and_matches_pytorch() {
    for (name, dtype) in [("mha_bf16", FloatDType::BF16), ("mha_f16", FloatDType::F16)] {
        let f = Fixture::load(name);
        let stored = DType::from(dtype);
        assert_eq!(f.weights.dtype("model.in_proj_weight"), Some(stored));
        let config = MultiHeadAttentionConfig::new(32, 4);
        for b in backends() {
            let d = b.device.clone();
            let label = format!("{name} [{}]", b.name);
            // Either path is checked: PyTorch's numbers where the device computes in the
            // dtype, the refusal where it does not. The CPU backends are known (flex
            // computes in both, ndarray in neither); a GPU says (lavapipe: f16, no bf16).
            let computes = d.supports_dtype(dtype);
            if matches!(b.name, "flex" | "ndarray") {
                assert_eq!(b.other_float_dtypes().contains(&dtype), computes, "{label}");
            }
            println!("{label}: the device computes in {dtype:?}: {computes}");

            // In f32: the stored values exactly, and the f64 result of those weights.
            let f32_module = config.init(&d).load_pytorch(&f.weights, "model.").unwrap();
            assert_eq!(f32_module.float_dtypes(), [DType::F32], "{label}");
            let w = f32_module.out_proj.weight.val().transpose();
            let stored_w = f
                .weights
                .tensor_as("model.out_proj.weight", [32, 32], FloatDType::F32, &d)
                .unwrap();
            assert_eq!(max_abs_diff(w, stored_w), 0.0, "{label}: loaded into f32");
            let x = f
                .weights
                .tensor_as("io.x", [2, 12, 32], FloatDType::F32, &d)
                .unwrap();
            let exact = f.io("exact", [2, 12, 32], &d);
            assert_close(
                &format!("{label} f32 module, half weights, against f64"),
                f32_module.causal_self_attention(x),
                exact.clone(),
                b.forward_tol(),
            );

            if !computes {
                let err = config.init(&d).try_to_dtype(dtype).unwrap_err();
                println!("{label}: {err}");
                assert_eq!(err.dtype, stored);
                assert!(
                    err.to_string()
                        .starts_with(&format!("dtype {}: the device", stored.name()))
                );
                let err = f.weights.tensor::<3>("io.x", [2, 12, 32], &d).unwrap_err();
                assert!(err.to_string().contains("does not compute in"), "{err}");
                continue;
            }

            let module = config
                .init(&d)
                .to_dtype(dtype)
                .load_pytorch(&f.weights, "model.")
                .unwrap();
            assert_eq!(module.float_dtypes(), [stored], "{label}");
            // Bit for bit: the loaded weight is the stored one.
            let w = module.out_proj.weight.val().transpose();
            assert_eq!(w.dtype(), stored);
            let stored_w = f
                .weights
                .tensor::<2>("model.out_proj.weight", [32, 32], &d)
                .unwrap();
            assert_eq!(stored_w.dtype(), stored);
            assert_eq!(max_abs_diff(w, stored_w), 0.0, "{label}: loaded as stored");

            let x = f.weights.tensor::<3>("io.x", [2, 12, 32], &d).unwrap();
            let out = module.causal_self_attention(x);
            assert_eq!(out.dtype(), stored, "{label}: the output's dtype");
            let expected = f.weights.tensor::<3>("io.out", [2, 12, 32], &d).unwrap();
            let magnitude = crate::util::to_vec(exact.clone().abs().max()).remove(0);
            let tol = 2.0 * ulp_at_one(dtype) * magnitude.max(1.0);
            let ours_exact = max_abs_diff(out.clone(), exact.clone());
            let torch_exact = max_abs_diff(expected.clone(), exact);
            println!("{label}: against f64, ours {ours_exact:.2e}, PyTorch's {torch_exact:.2e}");
            assert_close(&format!("{label} against PyTorch"), out, expected, tol);
        }
    }
}

/// A layer norm in half precision accumulates in f32, as PyTorch's, with autodiff or
/// without: the row [1000, 1004] normalises to [-1, 1] (in bf16 under autodiff its mean
/// rounded to 1000, and it gave [0, 1.41]).
#[test]
fn layer_norms_in_half_precision_accumulate_in_f32() {
    for be in backends() {
        for device in [be.device.clone(), be.autodiff()] {
            for dtype in be.other_float_dtypes() {
                let config = burn::nn::LayerNormConfig::new(2);
                let norm = mha::LayerNorm::new(&config, &device).to_dtype(dtype);
                let x = Tensor::<2>::from_floats([[1000.0, 1004.0]], &device).cast(dtype);
                let y: Vec<f64> = norm
                    .forward(x)
                    .into_data()
                    .convert::<f64>()
                    .try_into_vec::<f64>()
                    .unwrap();
                let what = format!("[{}] {dtype:?}, autodiff {}", be.name, device.is_autodiff());
                // ±2/√(4 + 1e-5), to 2 units in the last place of 1 in the dtype.
                let want = 2.0 / (4.0f64 + 1e-5).sqrt();
                let ulp = match dtype {
                    FloatDType::F64 => f64::EPSILON,
                    FloatDType::F16 => 2f64.powi(-10),
                    _ => 2f64.powi(-7),
                };
                assert!(
                    (y[0] + want).abs() <= 2.0 * ulp && (y[1] - want).abs() <= 2.0 * ulp,
                    "{what}: {y:?}, want ±{want}"
                );
            }
        }
    }
}

/// GELU, exact and tanh's, in half precision computes in f32 and rounds once, as
/// PyTorch's, values and gradients: each within one unit in the last place of the f32
/// result rounded to the dtype (plus f32's own noise near 0) over x in [-6, 6]. Rounded
/// at each step, `1 + erf` cancelled for negative inputs: bf16's GELU(-3) was -0.00586
/// for -0.00405, f16's GELU(-4) 0 for -0.000127.
#[test]
fn gelu_in_half_precision_rounds_once() {
    use mha::FeedForwardActivation;
    let xs: Vec<f32> = (-48..=48).map(|i| i as f32 / 8.0).collect(); // exact in both halves
    let read = |t: Tensor<1>| crate::util::to_vec(t.cast(FloatDType::F32));
    for be in backends() {
        let device = be.autodiff();
        let run = |act: FeedForwardActivation, dtype: FloatDType| {
            let x = Tensor::<1>::from_floats(xs.as_slice(), &device)
                .cast(dtype)
                .require_grad();
            let y = act.forward(x.clone());
            let grad = x.grad(&y.clone().sum().backward()).expect("a gradient");
            (read(y), read(grad))
        };
        for dtype in be.other_float_dtypes() {
            let (round, ulp): (fn(f32) -> f32, f32) = match dtype {
                FloatDType::F16 => (|x| burn::tensor::f16::from_f32(x).to_f32(), 2f32.powi(-10)),
                FloatDType::BF16 => (|x| burn::tensor::bf16::from_f32(x).to_f32(), 2f32.powi(-7)),
                _ => continue,
            };
            for act in [FeedForwardActivation::Gelu, FeedForwardActivation::GeluTanh] {
                let (y32, g32) = run(act, FloatDType::F32);
                let (y, g) = run(act, dtype);
                for (what, got, want) in [("value", &y, &y32), ("gradient", &g, &g32)] {
                    for (i, (&got, &want)) in got.iter().zip(want.iter()).enumerate() {
                        let want = round(want);
                        let bound = ulp * want.abs() + 1e-6;
                        assert!(
                            (got - want).abs() <= bound,
                            "[{}] {dtype:?} {act:?} {what} at x = {}: {got}, want {want}",
                            be.name,
                            xs[i]
                        );
                    }
                }
            }
        }
    }
}

/// SiLU in f64, alone and in SwiGLU, values and gradients, to f64's digits on every
/// backend with f64 (Burn's sigmoid computes in f32 on ndarray: 1e-8 off).
#[test]
fn silu_in_f64_keeps_f64s_digits() {
    use mha::FeedForwardActivation;
    let f64 = FloatDType::F64;
    // Far below 0 too, where e^-x overflows and SiLU is tiny: there the digits are
    // compared relatively (the value was clamped at e^700: -7e-302 at -710 for -3e-306).
    let far = [-710.0, -730.0, -745.0];
    let xs: Vec<f64> = (-60..=60).map(|i| i as f64 / 7.0).chain(far).collect();
    let sigmoid = |x: f64| match x >= 0.0 {
        true => 1.0 / (1.0 + (-x).exp()),
        false => x.exp() / (1.0 + x.exp()),
    };
    let exact = |x: f64| x * sigmoid(x);
    let slope = |x: f64| {
        let s = sigmoid(x);
        s + x * s * (1.0 - s)
    };
    let read = |t: Tensor<1>| {
        t.into_data()
            .convert::<f64>()
            .try_into_vec::<f64>()
            .unwrap()
    };
    for be in backends() {
        if !be.other_float_dtypes().contains(&f64) {
            continue;
        }
        let device = be.autodiff();
        let x = Tensor::<1>::from_data(
            burn::tensor::TensorData::new(xs.clone(), [xs.len()]),
            (&device, burn::tensor::DType::F64),
        )
        .require_grad();
        let y = FeedForwardActivation::Silu.forward(x.clone());
        let grad = x.grad(&y.clone().sum().backward()).expect("a gradient");
        for (what, got, want) in [
            (
                "value",
                read(y.inner()),
                xs.iter().map(|&x| exact(x)).collect::<Vec<_>>(),
            ),
            (
                "gradient",
                read(grad),
                xs.iter().map(|&x| slope(x)).collect(),
            ),
        ] {
            for ((&got, &want), &x) in got.iter().zip(&want).zip(&xs) {
                let scale = match far.contains(&x) {
                    true => want.abs(),
                    false => want.abs().max(1.0),
                };
                assert!(
                    (got - want).abs() <= 1e-14 * scale + f64::from_bits(1),
                    "[{}] SiLU {what} at {x}: {got:e}, want {want:e}",
                    be.name
                );
            }
        }
    }
}

/// T5's relative biases, causal: 8 buckets up to distance 20.
fn t5() -> Positions {
    Positions::T5 {
        num_buckets: 8,
        max_distance: 20,
        bidirectional: false,
    }
}

/// The stacks the whole-module tests take: two decoder blocks with T5 relative biases and
/// two causal encoder blocks with learned absolute positions, 16 wide, 4 heads, without
/// dropout.
fn stacks() -> (DecoderConfig, EncoderConfig) {
    let decoder = DecoderConfig::new(
        DecoderBlockConfig::new(16, 4)
            .with_d_ff(Some(32))
            .with_dropout(0.0)
            .with_positions(t5()),
        2,
    );
    let encoder = EncoderConfig::new(
        EncoderBlockConfig::new(16, 4)
            .with_d_ff(Some(32))
            .with_dropout(0.0)
            .with_causal(true)
            .with_positions(Positions::Learned { max_len: 16 }),
        2,
    );
    (decoder, encoder)
}

/// One cast for any module: a decoder stack with T5 relative biases and an encoder stack
/// with learned absolute positions, cast to each other dtype a backend computes in, have
/// every parameter in it (tables and embeddings included), give the f32 stack's output
/// to 4 times that dtype's absolute tolerance (util's, for one attention against f64: a
/// stack is two blocks of attention, feed-forward and norms), and the f32 stack's
/// gradient to each parameter.
#[test]
fn one_cast_reaches_every_parameter_of_a_stack() {
    let (decoder, encoder) = stacks();
    for b in backends() {
        let dev = b.autodiff();
        let x = randn([2, 6, 16], 1, &dev);
        let memory = randn([2, 5, 16], 2, &dev);
        check_cast(&b, "decoder", decoder.init(&dev), |stack, dtype| {
            let input = StackInput::new(x.clone().cast(dtype)).memory(memory.clone().cast(dtype));
            stack.forward(input).unwrap().output
        });
        check_cast(&b, "encoder", encoder.init(&dev), |stack, dtype| {
            stack
                .forward(StackInput::new(x.clone().cast(dtype)))
                .unwrap()
                .output
        });
    }
}

fn check_cast<M: Module>(
    b: &Backend,
    name: &str,
    module: M,
    forward: impl Fn(&M, FloatDType) -> Tensor<3>,
) {
    let reference = forward(&module, FloatDType::F32);
    let params = param_values(&module).len();
    // A loss of every output weighted at random (their plain sum after a final norm is
    // constant, its gradients rounding noise).
    let weights = randn(reference.dims(), 7, &reference.device());
    let loss = |out: Tensor<3>| {
        let dtype = out.dtype();
        (out * weights.clone().cast(dtype)).sum()
    };
    let reference_grads = param_grads(&module, &loss(reference.clone()).backward());
    for dtype in b.other_float_dtypes() {
        let label = format!("{name} [{}] {dtype:?}", b.name);
        let cast = module.clone().to_dtype(dtype);
        assert_eq!(cast.float_dtypes(), [DType::from(dtype)], "{label}");
        let out = forward(&cast, dtype);
        assert_eq!(out.dtype(), DType::from(dtype), "{label}");
        let [[atol, _], _] = b.tolerances_against_f32(dtype);
        assert_close(
            &format!("{label} against f32"),
            out.clone().cast(FloatDType::F32),
            reference.clone(),
            4.0 * atol as f32,
        );
        // Every parameter is still trained: each has the f32 stack's gradient, to the
        // dtype's tolerance of gradients of order 1 scaled by the largest (worst measured
        // on flex: 0.21 of it in f64, the f32 reference's rounding; 0.08 in f16, 0.11 in
        // bf16).
        let grads = param_grads(&cast, &loss(out).backward());
        assert_eq!(grads.len(), params, "{label}");
        let [_, [atol, rtol]] = b.tolerances_against_f32(dtype);
        for (n, (got, want)) in grads.into_iter().zip(&reference_grads).enumerate() {
            let largest = want.clone().abs().max().into_scalar::<f32>() as f64;
            let tol = (atol + rtol) * largest;
            let err = crate::util::max_abs_diff(got.cast(FloatDType::F32), want.clone()) as f64;
            println!(
                "{label}: parameter {n}'s grad, max abs error {err:.2e} (tolerance {tol:.1e}, largest {largest:.1e})"
            );
            assert!(
                err <= tol,
                "{label}: parameter {n}'s grad, {err:e} > {tol:e}"
            );
        }
    }
}

#[test]
fn a_module_of_one_dtype_refuses_an_input_of_another_by_name() {
    use burn::tensor::Distribution;
    use mha::ModuleDType;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    for b in backends() {
        let device = b.device.clone();
        let x = Tensor::<3>::random([2, 3, 8], Distribution::Default, &device);
        let norm = mha::LayerNorm::new(&burn::nn::LayerNormConfig::new(8), &device);
        let attention = mha::MultiHeadAttentionConfig::new(8, 2).init(&device);
        // A dtype the device computes in other than the input's f32.
        let Some(dtype) = [FloatDType::F16, FloatDType::F64]
            .into_iter()
            .find(|&d| norm.clone().try_to_dtype(d).is_ok())
        else {
            panic!("{}: computes in neither f16 nor f64", b.name);
        };
        let other = format!("{:?}", DType::from(dtype));
        let (norm, attention) = (norm.to_dtype(dtype), attention.to_dtype(dtype));
        let norm = catch_unwind(AssertUnwindSafe(|| norm.forward(x.clone())));
        let attention = catch_unwind(AssertUnwindSafe(|| {
            attention.causal_self_attention(x.clone())
        }));
        for (what, result) in [
            ("LayerNorm", norm.map(|_| ())),
            ("Linear", attention.map(|_| ())),
        ] {
            let message = result.expect_err("a call of mixed dtypes is refused");
            let message = message
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_default();
            assert!(
                message.starts_with(what) && message.contains("F32") && message.contains(&other),
                "{}: {message}",
                b.name
            );
        }
    }
}

/// A Hugging Face checkpoint in bf16 or f16, as models are published: the weights of
/// transformers' Llama layer (scripts/golden.py, `llama_layer`) rounded to the half dtype
/// and stored so. They load into an f32 layer as the stored values exactly (the f32
/// layer's parameters, rounded to the dtype once), and, where the device computes in the
/// dtype, into a layer cast to it bit for bit.
#[test]
fn half_precision_hugging_face_checkpoints_load_as_stored() {
    use mha::hf::{HfConfig, load_decoder_layer};
    let root = crate::util::root();
    let file = std::fs::read(root.join("tests/fixtures/llama_layer.safetensors")).unwrap();
    let json = root.join("tests/fixtures/llama_layer.json");
    let config = HfConfig::from_file(&json).unwrap().block().unwrap();
    let full = mha::PyTorchWeights::from_bytes(&file, "llama_layer").unwrap();
    let stored = safetensors::SafeTensors::deserialize(&file).unwrap();
    for dtype in [FloatDType::BF16, FloatDType::F16] {
        // The model's weights, each rounded to the dtype once (to nearest, ties to even).
        let half: Vec<(String, Vec<usize>, Vec<u8>)> = stored
            .tensors()
            .into_iter()
            .filter(|(key, _)| key.starts_with("model."))
            .map(|(key, view)| {
                let bytes = view
                    .data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .flat_map(|x| match dtype {
                        FloatDType::BF16 => burn::tensor::bf16::from_f32(x).to_le_bytes(),
                        _ => burn::tensor::f16::from_f32(x).to_le_bytes(),
                    })
                    .collect();
                (key, view.shape().to_vec(), bytes)
            })
            .collect();
        let kind = match dtype {
            FloatDType::BF16 => safetensors::Dtype::BF16,
            _ => safetensors::Dtype::F16,
        };
        let views: Vec<(String, safetensors::tensor::TensorView)> = half
            .iter()
            .map(|(key, shape, bytes)| {
                let view = safetensors::tensor::TensorView::new(kind, shape.clone(), bytes);
                (key.clone(), view.unwrap())
            })
            .collect();
        let bytes = safetensors::serialize(views, None).unwrap();
        let weights = mha::PyTorchWeights::from_bytes(&bytes, "llama_layer in half").unwrap();
        // The f32 weights rounded by a cast, on the first device that computes in the
        // dtype (flex computes in both).
        let host = backends()
            .into_iter()
            .find(|b| b.device.supports_dtype(dtype))
            .expect("flex computes in bf16 and f16")
            .device;
        let reference = load_decoder_layer(config.init(&host), &full, "model.")
            .unwrap()
            .to_dtype(dtype);
        let rounded: Vec<Vec<f32>> = param_values(&reference)
            .into_iter()
            .map(crate::util::to_vec)
            .collect();
        let values = |layer: &mha::EncoderBlock| -> Vec<Vec<f32>> {
            param_values(layer)
                .into_iter()
                .map(crate::util::to_vec)
                .collect()
        };
        for b in backends() {
            let d = b.device.clone();
            let label = format!("llama_layer in {dtype:?} [{}]", b.name);
            let layer = load_decoder_layer(config.init(&d), &weights, "model.").unwrap();
            assert_eq!(layer.float_dtypes(), [DType::F32], "{label}");
            assert!(values(&layer) == rounded, "{label}: loaded into f32");
            if !d.supports_dtype(dtype) {
                println!("{label}: the device does not compute in {dtype:?}: loaded into f32 only");
                continue;
            }
            let cast =
                load_decoder_layer(config.init(&d).to_dtype(dtype), &weights, "model.").unwrap();
            assert_eq!(cast.float_dtypes(), [DType::from(dtype)], "{label}");
            assert!(values(&cast) == rounded, "{label}: loaded as stored");
        }
    }
}

/// Absolute positions add in the input's dtype, whatever the dtype of a learned table
/// (as a sinusoid's, computed in f64, is rounded to it): `add` and `add_padded` of an f32
/// table to an input of each other dtype give that dtype, and the f32 sum of the same
/// (rounded) input to the dtype's tolerance.
#[test]
fn absolute_positions_add_in_the_inputs_dtype() {
    use mha::positions::AbsolutePositions;
    for b in backends() {
        let device = b.device.clone();
        let x = randn([2, 3, 8], 11, &device);
        let learned = AbsolutePositions::learned(8, 8, &device);
        for dtype in b.other_float_dtypes() {
            let label = format!("[{}] {dtype:?}", b.name);
            let input = x.clone().cast(dtype);
            let rounded = input.clone().cast(FloatDType::F32);
            let [[atol, _], _] = b.tolerances_against_f32(dtype);
            for (what, got, want) in [
                (
                    "add",
                    learned.add(input.clone(), 2),
                    learned.add(rounded.clone(), 2),
                ),
                (
                    "add_padded",
                    learned.add_padded(input.clone(), 2, &[0, 1]),
                    learned.add_padded(rounded.clone(), 2, &[0, 1]),
                ),
            ] {
                assert_eq!(got.dtype(), DType::from(dtype), "{what} {label}");
                assert_close(
                    &format!("{what} {label}"),
                    got.cast(FloatDType::F32),
                    want,
                    atol as f32,
                );
            }
        }
    }
}

/// Burn's quantizer of every float parameter to 8 bits, symmetric, one scale per tensor
/// (min-max), on `device`'s quantization settings: what the quantized tests apply.
fn q8(device: &burn::tensor::Device) -> burn::module::Quantizer {
    use burn::tensor::quantization::{Calibration, QuantValue};
    let scheme = device
        .settings()
        .quantization
        .scheme
        .with_value(QuantValue::Q8S);
    burn::module::Quantizer::new(Calibration::MinMax, scheme)
}

/// Modules quantized with Burn's `Module::quantize_weights` (every float parameter, Q8
/// symmetric, per tensor): attention with sinks and a T5 table, a decoder stack (norms,
/// GELU feed-forwards, cross-attention) and a causal encoder stack with learned positions
/// run, and give what the same modules with each parameter dequantized give (their exact
/// meaning), forward and the input's gradient.
#[test]
fn quantized_modules_compute_with_their_dequantized_weights() {
    use burn::module::{ModuleMapper, Param};
    use mha::analysis::Heads;
    use mha::{AttentionMask, MhaInput};

    struct Dequantize;
    impl ModuleMapper for Dequantize {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            param.map(|t| t.dequantize())
        }
    }
    fn check<M: Module>(b: &Backend, name: &str, module: M, run: impl Fn(&M) -> Tensor<3>) {
        let device = b.device.clone();
        let quantized = module.quantize_weights(&mut q8(&device));
        assert!(
            quantized
                .float_dtypes()
                .iter()
                .all(|d| matches!(d, DType::QFloat(_))),
            "{name} [{}]: {:?}",
            b.name,
            quantized.float_dtypes()
        );
        let dequantized = quantized.clone().map(&mut Dequantize);
        assert_eq!(
            dequantized.float_dtypes(),
            [DType::F32],
            "{name} [{}]",
            b.name
        );
        assert_close(
            &format!("{name} [{}] quantized", b.name),
            run(&quantized),
            run(&dequantized),
            b.forward_tol(),
        );
    }

    let (decoder, encoder) = stacks();
    for b in backends() {
        let device = b.device.clone();
        let x = randn([2, 6, 16], 1, &device);
        let memory = randn([2, 5, 16], 2, &device);
        let attention = MultiHeadAttentionConfig::new(16, 4)
            .with_sinks(true)
            .with_positions(t5())
            .init(&device);
        check(&b, "attention", attention, |m| {
            m.forward(MhaInput::causal(x.clone()).mask(AttentionMask::none()))
                .context
        });
        check(&b, "decoder", decoder.init(&device), |m| {
            let input = StackInput::new(x.clone()).memory(memory.clone());
            m.forward(input).unwrap().output
        });
        check(&b, "encoder", encoder.init(&device), |m| {
            m.forward(StackInput::new(x.clone())).unwrap().output
        });
        // Cast to another dtype, the quantized parameters stay quantized, read in it.
        let quantize = |m: mha::MultiHeadAttention| m.quantize_weights(&mut q8(&device));
        let quantized = quantize(MultiHeadAttentionConfig::new(16, 4).init(&device));
        let dtype = b.other_float_dtypes()[0];
        let cast = quantized.clone().to_dtype(dtype);
        assert_eq!(
            cast.float_dtypes(),
            quantized.float_dtypes(),
            "[{}]",
            b.name
        );
        let rounded = x.clone().cast(dtype);
        let out = cast.forward(MhaInput::causal(rounded.clone())).context;
        assert_eq!(out.dtype(), DType::from(dtype), "[{}]", b.name);
        let [[atol, _], _] = b.tolerances_against_f32(dtype);
        let want = quantized
            .forward(MhaInput::causal(rounded.cast(FloatDType::F32)))
            .context;
        let what = format!("attention [{}] quantized, in {dtype:?}", b.name);
        assert_close(&what, out.cast(FloatDType::F32), want, atol as f32);
        // Pruned, from the dequantized values (a selection of quantized values would be
        // quantized again on some backends): the dequantized module pruned.
        let plan = mha::analysis::PrunePlan::removing(1, &[(0, 1)]);
        let pruned = quantized.prune(&plan).unwrap();
        assert_eq!(pruned.float_dtypes(), [DType::F32], "[{}]", b.name);
        let want = quantized.clone().map(&mut Dequantize).prune(&plan).unwrap();
        assert_close(
            &format!("attention [{}] quantized, pruned", b.name),
            pruned.forward(MhaInput::causal(x.clone())).context,
            want.forward(MhaInput::causal(x.clone())).context,
            b.forward_tol(),
        );
        // Burn's own attention, quantized, converts with its numbers.
        let burn = burn::nn::attention::MultiHeadAttentionConfig::new(16, 4)
            .with_dropout(0.0)
            .init(&device);
        let burn = burn.quantize_weights(&mut q8(&device));
        let ours = mha::MultiHeadAttention::from(burn.clone());
        let want = burn
            .forward(burn::nn::attention::MhaInput::self_attn(x.clone()))
            .context;
        assert_close(
            &format!("Burn's attention [{}] quantized, converted", b.name),
            ours.forward(MhaInput::self_attn(x.clone())).context,
            want,
            b.forward_tol(),
        );
        // Under autodiff the parameters are constants (a quantized tensor has no
        // gradient); the input's gradient flows through them.
        let dev = b.autodiff();
        let attention = MultiHeadAttentionConfig::new(16, 4).init(&dev);
        let input = randn([2, 6, 16], 1, &dev).require_grad();
        let weights = randn([2, 6, 16], 3, &dev);
        let quantized = attention.quantize_weights(&mut q8(&dev));
        let dequantized = quantized.clone().map(&mut Dequantize);
        let grad = |m: &mha::MultiHeadAttention| {
            let out = m.forward(MhaInput::causal(input.clone())).context;
            let grads = (out * weights.clone()).sum().backward();
            input.grad(&grads).expect("the input's gradient")
        };
        assert_grad_close(
            &b,
            &format!("attention [{}] quantized, the input's gradient", b.name),
            grad(&quantized),
            grad(&dequantized),
        );
    }
}

/// PyTorch's weights go into float parameters: a quantized module refuses them by key,
/// saying to load before quantizing, and so does a QLoRA module (whose quantized bases
/// the weights would have replaced with dense ones).
#[test]
fn a_quantized_module_refuses_pytorch_weights_saying_to_load_first() {
    use burn::module::{Lora, QLora};
    use mha::LoadPyTorch;
    let f = crate::util::Fixture::load("mha_causal_self");
    for b in backends() {
        let attention = || MultiHeadAttentionConfig::new(16, 4).init(&b.device);
        let quantized = attention().quantize_weights(&mut q8(&b.device));
        let qlora = attention().apply_qlora(QLora::new(Lora::new(2, 4.0), q8(&b.device)));
        for (what, module) in [("quantized", quantized), ("QLoRA", qlora)] {
            let err = module.load_pytorch(&f.weights, "model.").unwrap_err();
            assert_eq!(
                err.to_string(),
                "key `model.in_proj_weight`: the module's parameter is quantized: load \
                 PyTorch's weights into the module before quantizing it \
                 (Module::quantize_weights)",
                "[{}] {what}",
                b.name
            );
        }
    }
}

/// QLoRA (Burn's `Module::apply_qlora`: every parameter quantized, a LoRA adapter on each
/// weight matrix) on an encoder block: with the adapters moved off their initial values
/// (the second factor starts at 0, which adds nothing), the block computes what its
/// materialized form (each adapter merged into a dense weight) computes, and what trains
/// is the adapters, two factors for each of its four weight matrices (the packed input
/// projection, the output projection, the feed-forward's two).
#[test]
fn qlora_blocks_compute_their_materialized_weights_and_train_the_adapters() {
    use burn::module::{Lora, ModuleMapper, Param, QLora};
    use burn::optim::GradientsParams;
    use mha::BlockInput;

    /// Adds 0.05 to every float parameter that is not quantized (the adapters' factors).
    struct Shift;
    impl ModuleMapper for Shift {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            param.map(|t| match t.dtype() {
                DType::QFloat(_) => t,
                _ => {
                    let trained = t.is_require_grad();
                    let shifted = (t + 0.05).detach();
                    match trained {
                        true => shifted.require_grad(),
                        false => shifted,
                    }
                }
            })
        }
    }
    for b in backends() {
        let dev = b.autodiff();
        let qlora = QLora::new(Lora::new(2, 4.0), q8(&dev));
        let block = EncoderBlockConfig::new(16, 4)
            .with_d_ff(Some(32))
            .with_dropout(0.0)
            .with_causal(true)
            .init(&dev)
            .apply_qlora(qlora);
        let x = randn([2, 6, 16], 1, &dev).require_grad();
        let before = block.forward(BlockInput::new(x.clone())).unwrap().output;
        let block = block.map(&mut Shift);
        let merged = block.clone().materialize();
        let out = block.forward(BlockInput::new(x.clone())).unwrap().output;
        let moved = max_abs_diff(out.clone(), before);
        assert!(
            moved > 1e-2,
            "[{}]: the adapters moved the output by {moved}",
            b.name
        );
        let want = merged.forward(BlockInput::new(x.clone())).unwrap().output;
        assert_close(
            &format!("QLoRA block [{}] against its materialized form", b.name),
            out.clone(),
            want,
            b.forward_tol(),
        );
        let weights = randn([2, 6, 16], 3, &dev);
        let grads = GradientsParams::from_grads((out * weights).sum().backward(), &block);
        assert_eq!(grads.len(), 8, "[{}]: trained parameters", b.name);
    }
}

/// A half-precision record (an f16 module's, made on flex) loads into an f32 module on
/// every backend, ndarray included (no f16 arithmetic there), cast as it loads
/// (`ModuleRecord::cast_to_module_dtype`, as the `dtype` docs say): the module stays f32,
/// with the record's values.
#[test]
fn a_half_precision_record_loads_cast_into_an_f32_module_everywhere() {
    use burn::store::ModuleRecord;
    let flex = crate::util::first_device();
    let half = MultiHeadAttentionConfig::new(16, 4)
        .init(&flex)
        .to_dtype(FloatDType::F16);
    let want = param_values(&half);
    let bytes = half.into_record().into_bytes().unwrap();
    for b in backends() {
        let record = ModuleRecord::from_bytes(bytes.clone())
            .unwrap()
            .cast_to_module_dtype();
        let module = MultiHeadAttentionConfig::new(16, 4)
            .init(&b.device)
            .try_load_record(record)
            .unwrap_or_else(|e| panic!("[{}]: {e:?}", b.name));
        assert_eq!(module.float_dtypes(), [DType::F32], "[{}]", b.name);
        for (n, (got, want)) in param_values(&module).into_iter().zip(&want).enumerate() {
            let want = want.clone().cast(FloatDType::F32).to_device(&b.device);
            let what = format!("[{}] parameter {n}", b.name);
            assert_close(&what, got, want, 0.0);
        }
    }
}
