//! Properties that hold for any weights and inputs, checked on a few hundred seeded
//! random cases each, on every backend.

use burn::tensor::{Device, Tensor};
use mha::{
    AttentionMask, MhaInput, MultiHeadAttention, MultiHeadAttentionConfig, mha::InputProjection,
};

use crate::util::{SplitMix, backends, max_abs_diff, randn};

const CASES: usize = 200;
/// Shapes `(B, T, d_model, heads, kv_heads)`: few, so GPU kernels compile once each.
const SHAPES: [(usize, usize, usize, usize, usize); 3] =
    [(2, 7, 16, 4, 4), (1, 12, 32, 4, 2), (3, 5, 8, 2, 1)];

fn module(shape: usize, device: &Device) -> MultiHeadAttention {
    let (_, _, d, h, hkv) = SHAPES[shape];
    MultiHeadAttentionConfig::new(d, h)
        .with_n_kv_heads(Some(hkv))
        .init(device)
}

/// Rows `rows` of `x` `[B, T, D]` along T, replaced by fresh random values.
fn replace_rows(x: Tensor<3>, rows: std::ops::Range<usize>, seed: u64) -> Tensor<3> {
    let [b, _, d] = x.dims();
    let fresh = randn([b, rows.len(), d], seed, &x.device());
    x.slice_assign([0..b, rows, 0..d], fresh)
}

#[test]
fn causal_attention_ignores_future_tokens() {
    for be in backends() {
        let mut rng = SplitMix(11);
        let modules: Vec<_> = (0..SHAPES.len()).map(|s| module(s, &be.device)).collect();
        for case in 0..CASES {
            let s = case % SHAPES.len();
            let (b, t, d, _, _) = SHAPES[s];
            let cut = rng.range(0, t - 2); // positions 0..=cut are kept
            let x = randn([b, t, d], rng.next_u64(), &be.device);
            let x2 = replace_rows(x.clone(), cut + 1..t, rng.next_u64());
            let y = modules[s].causal_self_attention(x);
            let y2 = modules[s].causal_self_attention(x2);
            let past = max_abs_diff(
                y.clone().narrow(1, 0, cut + 1),
                y2.clone().narrow(1, 0, cut + 1),
            );
            assert!(
                past <= 1e-5,
                "[{}] case {case}: outputs up to {cut} moved by {past}",
                be.name
            );
            let future = max_abs_diff(
                y.narrow(1, cut + 1, t - cut - 1),
                y2.narrow(1, cut + 1, t - cut - 1),
            );
            assert!(
                future > 1e-4,
                "[{}] case {case}: later outputs did not change",
                be.name
            );
        }
    }
}

#[test]
fn unmasked_self_attention_is_permutation_equivariant() {
    for be in backends() {
        let mut rng = SplitMix(12);
        let modules: Vec<_> = (0..SHAPES.len()).map(|s| module(s, &be.device)).collect();
        for case in 0..CASES {
            let s = case % SHAPES.len();
            let (b, t, d, _, _) = SHAPES[s];
            let mut perm: Vec<usize> = (0..t).collect();
            for i in (1..t).rev() {
                perm.swap(i, rng.range(0, i));
            }
            let index = Tensor::<1, burn::tensor::Int>::from_data(
                burn::tensor::TensorData::new(
                    perm.iter().map(|&p| p as i64).collect::<Vec<_>>(),
                    [t],
                ),
                &be.device,
            );
            let x = randn([b, t, d], rng.next_u64(), &be.device);
            let y = modules[s].self_attention(x.clone(), AttentionMask::none());
            let y_perm =
                modules[s].self_attention(x.select(1, index.clone()), AttentionMask::none());
            let err = max_abs_diff(y_perm, y.select(1, index));
            assert!(
                err <= 1e-5,
                "[{}] case {case}: permuted output differs by {err}",
                be.name
            );
        }
    }
}

#[test]
fn padded_keys_do_not_change_outputs() {
    for be in backends() {
        let mut rng = SplitMix(13);
        let modules: Vec<_> = (0..SHAPES.len()).map(|s| module(s, &be.device)).collect();
        for case in 0..CASES {
            let s = case % SHAPES.len();
            let (b, t, d, _, _) = SHAPES[s];
            let tk = t + 3;
            let lengths: Vec<usize> = (0..b).map(|_| rng.range(1, tk)).collect();
            let x = randn([b, t, d], rng.next_u64(), &be.device);
            let context = randn([b, tk, d], rng.next_u64(), &be.device);
            // Change every padded key position of every sequence.
            let mut context2 = context.clone();
            for (i, &len) in lengths.iter().enumerate() {
                if len < tk {
                    let fresh = randn([1, tk - len, d], rng.next_u64(), &be.device);
                    context2 = context2.slice_assign([i..i + 1, len..tk, 0..d], fresh);
                }
            }
            let mask = AttentionMask::key_lengths(&lengths, tk, &be.device);
            let y = modules[s].cross_attention(x.clone(), context, mask.clone());
            let y2 = modules[s].cross_attention(x, context2, mask);
            let err = max_abs_diff(y, y2);
            assert!(
                err <= 1e-5,
                "[{}] case {case}: padding changed outputs by {err}",
                be.name
            );
        }
    }
}

/// Adds `delta` to columns `cols` of a `[d_in, d_out]` weight.
fn perturb_cols(w: Tensor<2>, cols: std::ops::Range<usize>, delta: f32) -> Tensor<2> {
    let [d_in, _] = w.dims();
    let block = w.clone().slice([0..d_in, cols.clone()]) + delta;
    w.slice_assign([0..d_in, cols], block)
}

#[test]
fn every_projection_matters() {
    for be in backends() {
        let mut rng = SplitMix(14);
        for case in 0..CASES {
            let s = case % SHAPES.len();
            let (b, t, d, h, hkv) = SHAPES[s];
            let dh = d / h;
            let base = module(s, &be.device);
            let x = randn([b, t, d], rng.next_u64(), &be.device);
            let y = base.causal_self_attention(x.clone());
            let delta = 0.05 + rng.uniform();
            // Q, K and V blocks of the packed projection, then the output projection.
            let blocks = [(0, h * dh), (h * dh, hkv * dh), ((h + hkv) * dh, hkv * dh)];
            for (name, (start, len)) in ["W_q", "W_k", "W_v"].iter().zip(blocks) {
                let mut m = base.clone();
                let InputProjection::Packed(mut proj) = m.in_proj else {
                    unreachable!()
                };
                proj.weight = proj
                    .weight
                    .map(|w| perturb_cols(w, start..start + len, delta));
                m.in_proj = InputProjection::Packed(proj);
                let change = max_abs_diff(m.causal_self_attention(x.clone()), y.clone());
                assert!(
                    change > 1e-4,
                    "[{}] case {case}: perturbing {name} changed nothing",
                    be.name
                );
            }
            let mut m = base.clone();
            m.out_proj.weight = m.out_proj.weight.map(|w| perturb_cols(w, 0..d, delta));
            let change = max_abs_diff(m.causal_self_attention(x), y);
            assert!(
                change > 1e-4,
                "[{}] case {case}: perturbing W_o changed nothing",
                be.name
            );
        }
    }
}

/// Self-attention, the PyTorch `(q, k, v)` form and cross-attention agree given one tensor.
#[test]
fn mha_input_forms_agree() {
    for be in backends() {
        let m = module(0, &be.device);
        let (b, t, d, _, _) = SHAPES[0];
        let x = randn([b, t, d], 5, &be.device);
        let self_form = m.forward(MhaInput::self_attn(x.clone())).context;
        let qkv_form = m
            .forward(MhaInput::new(x.clone(), x.clone(), x.clone()))
            .context;
        let cross_form = m.forward(MhaInput::cross(x.clone(), x)).context;
        assert!(
            max_abs_diff(self_form.clone(), qkv_form) <= 1e-5,
            "[{}] forward(q, k, v)",
            be.name
        );
        assert!(
            max_abs_diff(self_form, cross_form) <= 1e-5,
            "[{}] cross(x, x)",
            be.name
        );
    }
}

/// A stack with absolute positions adds them once, before its first block: the same as
/// adding them to the input of a stack without; learned ones past their table are refused.
#[test]
fn stacks_add_absolute_positions_once() {
    use mha::positions::sinusoids;
    use mha::{EncoderBlockConfig, EncoderConfig, Positions, StackInput};
    for be in backends() {
        let dev = &be.device;
        let block = EncoderBlockConfig::new(16, 4).with_dropout(0.0);
        let plain = EncoderConfig::new(block.clone(), 2).init(dev);
        let mut positioned =
            EncoderConfig::new(block.with_positions(Positions::Sinusoidal), 2).init(dev);
        positioned.layers = plain.layers.clone();
        positioned.norm = plain.norm.clone();
        let x = randn([2, 7, 16], 3, dev);
        let by_hand = x.clone() + sinusoids(0, 7, 16, dev).unsqueeze::<3>();
        let causal = |x| StackInput::new(x).mask(AttentionMask::causal());
        let err = max_abs_diff(
            positioned.forward(causal(x)).unwrap().output,
            plain.forward(causal(by_hand)).unwrap().output,
        );
        assert!(err <= 1e-5, "[{}] {err}", be.name);
        let learned =
            EncoderBlockConfig::new(16, 4).with_positions(Positions::Learned { max_len: 5 });
        let stack = EncoderConfig::new(learned, 1).init(dev);
        let message = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = stack.forward(StackInput::new(randn([1, 7, 16], 4, dev)));
        }))
        .expect_err("positions past the table")
        .downcast_ref::<String>()
        .cloned()
        .unwrap_or_default();
        assert!(
            message.contains("positions 0..7 are past the 5 learned ones"),
            "{message}"
        );
    }
}

/// Whether `T` can be shared by threads (a server's `Arc<Model>`) and sent to one.
fn shared_across_threads<T: Send + Sync>() {}

#[test]
fn modules_caches_and_masks_can_be_shared_by_threads() {
    shared_across_threads::<MultiHeadAttention>();
    shared_across_threads::<mha::EncoderBlock>();
    shared_across_threads::<mha::DecoderBlock>();
    shared_across_threads::<mha::Encoder>();
    shared_across_threads::<mha::Decoder>();
    shared_across_threads::<mha::hf::CausalLm>();
    shared_across_threads::<mha::hf::BertModel>();
    shared_across_threads::<mha::KvCache>();
    shared_across_threads::<mha::StackCache>();
    shared_across_threads::<mha::MemoryKv>();
    shared_across_threads::<AttentionMask>();
    shared_across_threads::<mha::PyTorchWeights>();
    // And a module called from two threads at once computes what it computes alone.
    for be in backends() {
        let m = std::sync::Arc::new(module(1, &be.device));
        let x = randn([1, 12, 32], 7, &be.device);
        let at_once = || -> Vec<Tensor<3>> {
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let (m, x) = (m.clone(), x.clone());
                    std::thread::spawn(move || m.forward(MhaInput::causal(x)).context)
                })
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        };
        // Once first, its results read (run), so that every kernel choice the threads
        // make is tuned: two threads asking the autotuner for one choice at once get the
        // winner in one and the first candidate in the other, which rounds differently.
        at_once().into_iter().for_each(|got| drop(got.into_data()));
        let alone = m.forward(MhaInput::causal(x.clone())).context;
        for got in at_once() {
            assert_eq!(max_abs_diff(got, alone.clone()), 0.0, "[{}]", be.name);
        }
    }
}

/// A block's `attention_softcap` caps the scores of its self- and cross-attention as
/// their own `softcap` does: the same outputs as a block whose attentions were given
/// the cap by hand, on every backend (and other outputs than without it).
#[test]
fn a_blocks_attention_softcap_is_its_attentions_softcap() {
    use burn::module::Module;
    use mha::{BlockInput, DecoderBlockConfig};
    for b in backends() {
        let d = b.device.clone();
        let config = DecoderBlockConfig::new(16, 4).with_dropout(0.0);
        let capped = config.clone().with_attention_softcap(Some(0.5)).init(&d);
        assert_eq!(
            (capped.self_attn.softcap, capped.cross_attn.softcap),
            (Some(0.5), Some(0.5)),
            "[{}]",
            b.name
        );
        let plain = config.init(&d).load_record(capped.clone().into_record());
        let mut by_hand = plain.clone();
        by_hand.self_attn.softcap = Some(0.5);
        by_hand.cross_attn.softcap = Some(0.5);
        let x = randn([2, 5, 16], 1, &d) * 4.0;
        let memory = randn([2, 7, 16], 2, &d) * 4.0;
        let out = |block: &mha::DecoderBlock| {
            let input = BlockInput::new(x.clone()).memory(memory.clone());
            block.forward(input).unwrap().output
        };
        assert_eq!(
            max_abs_diff(out(&capped), out(&by_hand)),
            0.0,
            "[{}]",
            b.name
        );
        let apart = max_abs_diff(out(&capped), out(&plain));
        assert!(
            apart > 1e-3,
            "[{}] the cap changed nothing: {apart}",
            b.name
        );
    }
}

/// Heads one feature wide, the queries made through a reduction over that feature (`q ·
/// mean(q²)` of a `[B, T, H, D]` tensor seen as `[B, H, T, D]`; a module's QK-norm at
/// head dim 1): every backend's input gradients are flex's, through the fused kernels and
/// through the explicit path, bare and in a module. (On wgpu the kernels' dQ, laid out
/// with the heads inside, went through the reduction's backward with values from the
/// wrong places: off by 3 where the largest is 4.)
#[test]
fn one_wide_heads_through_a_reduction_get_every_backends_gradients() {
    use burn::module::{Module, ModuleMapper, Param};
    use mha::{AttentionWeights, SdpaOptions, scaled_dot_product_attention};

    /// Every float parameter replaced by seeded normal values (a weight matrix's scaled
    /// by 1/2, a vector's around 1: gains and biases alike), the seed counting up.
    struct Seeded(u64);
    impl ModuleMapper for Seeded {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            self.0 += 1;
            let seed = self.0;
            param.map(|t| {
                let values = randn(t.dims(), seed, &t.device());
                match D {
                    1 => values * 0.1 + 1.0,
                    _ => values * 0.5,
                }
                .require_grad()
            })
        }
    }

    let (b, t, h, d) = (2, 9, 4, 1);
    // flex's first: the reference of the others.
    let mut reference: Option<Vec<Tensor<4>>> = None;
    let mut reference_module: Option<(MultiHeadAttention, Tensor<3>)> = None;
    for be in backends() {
        let device = be.autodiff();
        let x = randn([b, t, h, d], 3, &device).require_grad();
        let k = randn([b, h, t, d], 4, &device);
        let v = randn([b, h, t, d], 5, &device);
        let grad = |(weights, mask): (bool, AttentionMask)| {
            let q = x.clone().swap_dims(1, 2);
            let q = q.clone() * q.square().mean_dim(3);
            let options = match weights {
                true => SdpaOptions::default().with_weights(AttentionWeights::PerHead),
                false => SdpaOptions::default(),
            };
            let out = scaled_dot_product_attention(q, k.clone(), v.clone(), &mask, options);
            let out = out.context;
            let grad: Tensor<4> = x.grad(&(out.clone() * out).sum().backward()).unwrap();
            grad.to_device(&be.device)
        };
        let grads: Vec<Tensor<4>> = [
            (false, AttentionMask::none()),
            (false, AttentionMask::causal()),
            (true, AttentionMask::causal()),
        ]
        .map(grad)
        .into();
        let reference = reference.get_or_insert_with(|| grads.clone());
        for (n, (grad, want)) in grads.into_iter().zip(reference.iter()).enumerate() {
            let want = want.clone().to_device(&be.device);
            let what = format!("[{}] dx of call {n}", be.name);
            crate::util::assert_grad_close(&be, &what, grad, want);
        }
        // A module of head dim 1 with QK-norm, the same seeded weights on every backend
        // and in every run. The norm's epsilon is large: at one feature a head QK-norm is
        // `q / sqrt(q² + eps)`, whose slope near q = 0 is `1 / sqrt(eps)`, and with a
        // small one a query near 0 turns the backends' rounding differences into
        // gradients apart by more than their tolerance (316 times at 1e-5).
        let (module, input) = reference_module.get_or_insert_with(|| {
            let module = MultiHeadAttentionConfig::new(8, 4)
                .with_n_kv_heads(Some(1))
                .with_head_dim(Some(1))
                .with_qk_norm_eps(Some(0.5))
                .init(&device)
                .map(&mut Seeded(10));
            (module, randn([2, 9, 8], 6, &device))
        });
        let module = module.clone().to_device(&device);
        let input = input.clone().to_device(&device).require_grad();
        let out = module.causal_self_attention(input.clone());
        let dx: Tensor<3> = input.grad(&(out.clone() * out).sum().backward()).unwrap();
        let dx = dx.to_device(&be.device);
        let flex = {
            let (module, input) = reference_module.as_ref().unwrap();
            let input = input.clone().require_grad();
            let out = module.causal_self_attention(input.clone());
            let dx: Tensor<3> = input.grad(&(out.clone() * out).sum().backward()).unwrap();
            dx
        };
        let what = format!("[{}] the module's dx", be.name);
        crate::util::assert_grad_close(&be, &what, dx, flex.to_device(&be.device));
    }
}

/// A key and a value shared by the batch (`[1, Hkv, T, D]` expanded to `[B, Hkv, T, D]`,
/// whose backward sums their gradients over the batch) get every backend's gradients
/// equal to flex's, on every path: the fused kernels, the explicit one (weights asked),
/// `attention_weights` alone, with GQA. (On wgpu, with weights asked, the shared key's
/// gradient was off by more than its size: Burn's backward of the explicit path's `Kᵀ`
/// handed back a transposed view, which Burn's wgpu reduction over the batch misreads.)
#[test]
fn a_key_shared_by_the_batch_gets_every_backends_gradients() {
    use mha::attention::attention_weights;
    use mha::{AttentionWeights, SdpaOptions, scaled_dot_product_attention};

    // (B, H, Hkv, T, D)
    let shapes = [(2, 2, 2, 3, 4), (3, 4, 2, 5, 8), (2, 4, 4, 4, 2)];
    let asked = [
        AttentionWeights::None,
        AttentionWeights::PerHead,
        AttentionWeights::Averaged,
    ];
    let mut reference: Vec<Vec<Tensor<4>>> = Vec::new();
    for be in backends() {
        let device = be.autodiff();
        let mut n = 0;
        for (b, h, hkv, t, d) in shapes {
            for mask in [AttentionMask::none(), AttentionMask::causal()] {
                for call in 0..asked.len() + 1 {
                    let shared_k = randn([1, hkv, t, d], 2, &device).require_grad();
                    let shared_v = randn([1, hkv, t, d], 3, &device).require_grad();
                    let q = randn([b, h, t, d], 1, &device).require_grad();
                    let k = shared_k.clone().expand([b, hkv, t, d]);
                    let v = shared_v.clone().expand([b, hkv, t, d]);
                    let (loss, what) = match asked.get(call) {
                        Some(&weights) => {
                            let options = SdpaOptions::default().with_weights(weights);
                            let out = scaled_dot_product_attention(q.clone(), k, v, &mask, options);
                            let w = randn([b, h, t, d], 4, &device);
                            ((out.context * w).sum(), format!("{weights:?}"))
                        }
                        None => {
                            let p = attention_weights(q.clone(), k, &mask, SdpaOptions::default());
                            let w = randn([b, h, t, t], 4, &device);
                            ((p * w).sum(), "attention_weights".to_string())
                        }
                    };
                    let grads = loss.backward();
                    let mut got = vec![q.grad(&grads).unwrap(), shared_k.grad(&grads).unwrap()];
                    if call < asked.len() {
                        got.push(shared_v.grad(&grads).unwrap());
                    }
                    let got: Vec<Tensor<4>> =
                        got.into_iter().map(|g| g.to_device(&be.device)).collect();
                    if reference.len() == n {
                        reference.push(got.clone());
                    }
                    for (grad, (want, name)) in got
                        .into_iter()
                        .zip(reference[n].iter().zip(["dQ", "dK", "dV"]))
                    {
                        let what = format!("[{}] {what} {:?} {name}", be.name, (b, h, hkv, t, d));
                        crate::util::assert_grad_close(
                            &be,
                            &what,
                            grad,
                            want.clone().to_device(&be.device),
                        );
                    }
                    n += 1;
                }
            }
        }
    }
}
