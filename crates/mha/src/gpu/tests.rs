//! The kernels on the wgpu device (Mesa's lavapipe where there is no GPU) against
//! attention computed in f64 on the host: outputs and log-sum-exps, every mask kind the
//! kernel reads, lengths that are not multiples of a tile, GQA, and a key length past which
//! a kernel looping over every key in one invocation would stop early on lavapipe.

use std::collections::HashSet;
use std::sync::Mutex;

use burn::backend::DispatchDevice;
use burn::tensor::{Device, DeviceKind};
use cubecl::client::Client;
use cubecl::prelude::*;

use super::forward::forward;
use super::launch::{Inputs, Scoring, Sizes, Variant};
use crate::mask::{AttentionMask, BLOCKED, CausalAlignment, DEAD_LSE, DEAD_ROW, Visibility};

/// The variants the tests compiled, to count them.
static VARIANTS: Mutex<Option<HashSet<Variant>>> = Mutex::new(None);

/// The client of Burn's default wgpu device.
fn client() -> Client {
    match Device::wgpu(DeviceKind::DefaultDevice).as_dispatch() {
        DispatchDevice::Cube(device) => device.client(),
        other => panic!("the wgpu device is {other:?}"),
    }
}

/// Deterministic values in `[-amp, amp)`.
fn values(n: usize, seed: u64, amp: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * amp
        })
        .collect()
}

/// A host tensor: values laid out row-major in `layout` order of the axes of `shape`
/// (`[0, 1, 2, 3]`: contiguous; `[0, 2, 1, 3]`: the heads of a `[B, T, H, D]` projection).
#[derive(Clone)]
struct Host<T> {
    shape: [usize; 4],
    strides: [usize; 4],
    data: Vec<T>,
}

impl<T: Copy> Host<T> {
    fn new(shape: [usize; 4], layout: [usize; 4], data: Vec<T>) -> Self {
        let mut strides = [0; 4];
        let mut step = 1;
        for &axis in layout.iter().rev() {
            strides[axis] = step;
            step *= shape[axis];
        }
        assert_eq!(data.len(), step);
        Self {
            shape,
            strides,
            data,
        }
    }

    /// The element at `[b, h, i, j]`, read as broadcast along axes of size 1.
    fn at(&self, index: [usize; 4]) -> T {
        let at: usize = (0..4)
            .map(|a| match self.shape[a] {
                1 => 0,
                _ => index[a] * self.strides[a],
            })
            .sum();
        self.data[at]
    }
}

impl<T: CubeElement> Host<T> {
    fn upload(&self, client: &Client) -> TensorBinding {
        let handle = client.create_from_slice(T::as_bytes(&self.data));
        // SAFETY: `data` holds every element of `shape` at `strides`.
        unsafe {
            TensorBinding::from_raw_parts(
                handle,
                self.strides.to_vec().into(),
                self.shape.to_vec().into(),
            )
        }
    }
}

/// One problem: sizes, scoring, mask and how the query is laid out.
#[derive(Clone)]
struct Case {
    name: &'static str,
    batch: usize,
    heads: usize,
    kv_heads: usize,
    queries: usize,
    keys: usize,
    d_k: usize,
    d_v: usize,
    scale: f32,
    softcap: Option<f32>,
    mask: AttentionMask,
    /// The bias's shape, if any (`-inf` at every seventh entry).
    bias: Option<[usize; 4]>,
    /// The boolean mask's shape, if any.
    blocked: Option<[usize; 4]>,
    /// Batch rows whose every key the boolean mask blocks.
    dead_batches: usize,
    /// The query as the heads of a `[B, Tq, H, Dk]` tensor.
    heads_inside: bool,
}

impl Case {
    fn new(
        name: &'static str,
        [batch, heads, kv_heads]: [usize; 3],
        [queries, keys, d]: [usize; 3],
    ) -> Self {
        Self {
            name,
            batch,
            heads,
            kv_heads,
            queries,
            keys,
            d_k: d,
            d_v: d,
            scale: 1.0 / (d as f32).sqrt(),
            softcap: None,
            mask: AttentionMask::none(),
            bias: None,
            blocked: None,
            dead_batches: 0,
            heads_inside: false,
        }
    }

    fn mask(self, mask: AttentionMask) -> Self {
        Self { mask, ..self }
    }
}

/// The inputs of a case on the host.
struct Data {
    q: Host<f32>,
    k: Host<f32>,
    v: Host<f32>,
    bias: Option<Host<f32>>,
    blocked: Option<Host<u32>>,
}

impl Data {
    fn of(case: &Case) -> Self {
        let Case {
            batch: b,
            heads: h,
            kv_heads: hk,
            queries: tq,
            keys: tk,
            d_k,
            d_v,
            ..
        } = *case;
        let layout = match case.heads_inside {
            true => [0, 2, 1, 3],
            false => [0, 1, 2, 3],
        };
        let q = Host::new([b, h, tq, d_k], layout, values(b * h * tq * d_k, 1, 1.0));
        let k = Host::new(
            [b, hk, tk, d_k],
            [0, 1, 2, 3],
            values(b * hk * tk * d_k, 2, 1.0),
        );
        let v = Host::new(
            [b, hk, tk, d_v],
            [0, 1, 2, 3],
            values(b * hk * tk * d_v, 3, 1.0),
        );
        let bias = case.bias.map(|shape| {
            let n = shape.iter().product();
            let mut data = values(n, 4, 2.0);
            data.iter_mut()
                .step_by(7)
                .for_each(|x| *x = f32::NEG_INFINITY);
            Host::new(shape, [0, 1, 2, 3], data)
        });
        let blocked = case.blocked.map(|shape| {
            let n: usize = shape.iter().product();
            let per_batch = n / shape[0];
            let data = (0..n)
                .map(|at| match at / per_batch < case.dead_batches {
                    true => 1,
                    false => u32::from(at % 5 == 3),
                })
                .collect();
            Host::new(shape, [0, 1, 2, 3], data)
        });
        Self {
            q,
            k,
            v,
            bias,
            blocked,
        }
    }
}

/// The output `[B, H, Tq, Dv]` and log-sum-exp `[B, H, Tq]` in f64, by the kernel's rules
/// with the keys of each query from [`Visibility::keys_of`].
fn reference(case: &Case, data: &Data, visibility: &Visibility) -> (Vec<f64>, Vec<f64>) {
    let (tq, dv) = (case.queries, case.d_v);
    let group = case.heads / case.kv_heads;
    let mut out = vec![0.0; case.batch * case.heads * tq * dv];
    let mut lse = vec![0.0; case.batch * case.heads * tq];
    for b in 0..case.batch {
        for h in 0..case.heads {
            for i in 0..tq {
                let keys = visibility.keys_of(b, i);
                let scores: Vec<f64> = keys
                    .clone()
                    .map(|j| {
                        let dot: f64 = (0..case.d_k)
                            .map(|d| {
                                let q = (data.q.at([b, h, i, d]) * case.scale) as f64;
                                q * data.k.at([b, h / group, j, d]) as f64
                            })
                            .sum();
                        let mut s = match case.softcap {
                            Some(cap) => cap as f64 * (dot / cap as f64).tanh(),
                            None => dot,
                        };
                        if let Some(bias) = &data.bias {
                            s += (bias.at([b, h, i, j]) as f64).max(BLOCKED as f64);
                        }
                        if let Some(blocked) = &data.blocked
                            && blocked.at([b, h, i, j]) != 0
                        {
                            s = BLOCKED as f64;
                        }
                        s
                    })
                    .collect();
                let row = (b * case.heads + h) * tq + i;
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if max <= DEAD_ROW as f64 {
                    lse[row] = DEAD_LSE as f64;
                    continue;
                }
                let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = weights.iter().sum();
                lse[row] = max + sum.ln();
                for (j, w) in keys.zip(&weights) {
                    for d in 0..dv {
                        out[row * dv + d] += w / sum * data.v.at([b, h / group, j, d]) as f64;
                    }
                }
            }
        }
    }
    (out, lse)
}

/// The kernel's output and log-sum-exp for `case`.
fn run(client: &Client, case: &Case, data: &Data, visibility: &Visibility) -> (Vec<f32>, Vec<f32>) {
    let band = visibility.band();
    let (elem, size, dead_row) = super::launch::element(burn::tensor::DType::F32);
    let inputs = Inputs {
        elem,
        size,
        dead_row,
        qkv: [&data.q, &data.k, &data.v].map(|t| t.upload(client)),
        bias: data.bias.as_ref().map(|t| t.upload(client)),
        pd: None,
        mask: data.blocked.as_ref().map(|t| t.upload(client)),
        seq: None,
    };
    let scoring = Scoring {
        scale: case.scale,
        softcap: case.softcap,
        band,
    };
    let sizes = Sizes::of([&inputs.qkv[0], &inputs.qkv[1], &inputs.qkv[2]]);
    let variant = Variant::of(&sizes, &inputs);
    VARIANTS
        .lock()
        .unwrap()
        .get_or_insert_with(HashSet::new)
        .insert(variant);
    let compiled = VARIANTS.lock().unwrap().as_ref().map_or(0, HashSet::len);
    println!(
        "{}: variant {variant:?}, {compiled} variants so far",
        case.name
    );
    let (out, lse) = forward(client, &inputs, scoring);
    let out = f32::from_bytes(&client.read_one(out).expect("output")).to_vec();
    let lse = f32::from_bytes(&client.read_one(lse).expect("lse")).to_vec();
    (out, lse)
}

/// Runs `case` and checks it against [`reference`]: outputs within `1e-5` (plus `1e-5` of
/// their size), log-sum-exps within `1e-5` of their size (plus `1e-5`); returns both
/// largest errors.
fn check(case: &Case) -> (f64, f64) {
    let client = client();
    let data = Data::of(case);
    let visibility = case.mask.visibility(case.queries, case.keys);
    let (want_out, want_lse) = reference(case, &data, &visibility);
    let (out, lse) = run(&client, case, &data, &visibility);
    assert_eq!(out.len(), want_out.len());
    let mut errors = (0.0f64, 0.0f64);
    for (at, (&got, &want)) in out.iter().zip(&want_out).enumerate() {
        let err = (got as f64 - want).abs();
        assert!(
            err <= 1e-5 + 1e-5 * want.abs(),
            "{}: output {at}: {got} != {want}",
            case.name
        );
        errors.0 = errors.0.max(err);
    }
    for (at, (&got, &want)) in lse.iter().zip(&want_lse).enumerate() {
        let err = (got as f64 - want).abs();
        assert!(
            err <= 1e-5 + 1e-5 * want.abs(),
            "{}: log-sum-exp {at}: {got} != {want}",
            case.name
        );
        if want != DEAD_LSE as f64 {
            errors.1 = errors.1.max(err);
        }
    }
    println!(
        "{}: max abs error output {:.2e}, log-sum-exp {:.2e}",
        case.name, errors.0, errors.1
    );
    errors
}

#[test]
fn gpu_forward_without_a_mask_matches_f64() {
    check(&Case {
        heads_inside: true,
        ..Case::new("none d32 B2 H3 T77", [2, 3, 3], [77, 77, 32])
    });
    check(&Case {
        d_v: 32,
        scale: 0.3,
        ..Case::new("none d64/32 Tq33 Tk70 scale 0.3", [1, 2, 2], [33, 70, 64])
    });
}

#[test]
fn gpu_forward_causal_in_both_alignments_matches_f64() {
    let causal = AttentionMask::causal;
    for (queries, keys) in [(40, 100), (70, 45), (65, 65)] {
        check(&Case::new("causal bottom-right d64", [1, 2, 2], [queries, keys, 64]).mask(causal()));
        check(
            &Case::new("causal top-left d64", [1, 2, 2], [queries, keys, 64])
                .mask(causal().aligned(CausalAlignment::TopLeft)),
        );
    }
    // A cache read in full: queries 10.. of a sequence whose first 10 are among the keys.
    check(
        &Case::new("causal offset 10 d64", [1, 1, 1], [20, 64, 64])
            .mask(causal().aligned(CausalAlignment::Offset(10))),
    );
}

#[test]
fn gpu_forward_gqa_8_to_2_matches_f64() {
    check(&Case {
        scale: 0.2,
        ..Case::new("gqa 8:2 causal d128", [1, 8, 2], [37, 53, 128]).mask(AttentionMask::causal())
    });
}

#[test]
fn gpu_forward_bias_and_key_padding_match_f64() {
    // A bias per head and query, `-inf` in places; key padding with every key of the
    // second batch row blocked (its rows give zeros).
    let (b, h, tq, tk) = (2, 2, 35, 41);
    check(&Case {
        bias: Some([1, h, tq, tk]),
        blocked: Some([b, 1, 1, tk]),
        dead_batches: 1,
        ..Case::new("bias + key padding d32", [b, h, h], [tq, tk, 32])
    });
    check(&Case {
        bias: Some([b, 1, 1, tk]),
        ..Case::new("bias [B,1,1,Tk] causal d32", [b, h, h], [tq, tk, 32])
            .mask(AttentionMask::causal())
    });
    // A boolean mask blocking queries' last visible keys: with the causal part, some
    // rows see only blocked keys.
    check(&Case {
        blocked: Some([1, 1, tq, tk]),
        ..Case::new("bool [Tq,Tk] causal top-left d32", [1, h, h], [tq, tk, 32])
            .mask(AttentionMask::causal().aligned(CausalAlignment::TopLeft))
    });
}

#[test]
fn gpu_forward_windows_match_f64() {
    check(
        &Case::new("sliding window 5 d64", [1, 2, 2], [70, 70, 64])
            .mask(AttentionMask::sliding_window(5)),
    );
    check(
        &Case::new("local radius 3 top-left d64", [1, 2, 2], [30, 90, 64])
            .mask(AttentionMask::local(3).aligned(CausalAlignment::TopLeft)),
    );
    check(
        &Case::new(
            "sliding window 40 and local 50 d64",
            [1, 1, 1],
            [50, 100, 64],
        )
        .mask(AttentionMask::sliding_window(40).and(AttentionMask::local(50))),
    );
}

#[test]
fn gpu_forward_softcap_matches_f64() {
    check(&Case {
        scale: 1.0,
        softcap: Some(5.0),
        ..Case::new("softcap 5 scale 1 d32", [1, 2, 2], [33, 47, 32])
    });
}

/// 2048 keys at head dim 128: one invocation looping over every key and head dim would
/// run 2048 · 256 iterations, far past lavapipe's 65,535, and stop early silently.
#[test]
fn gpu_forward_past_the_loop_cap_of_a_naive_kernel_matches_f64() {
    check(&Case::new(
        "loop cap 2048 keys d128",
        [1, 1, 1],
        [8, 2048, 128],
    ));
    // This kernel loops about twice per key its row sees: 20,000 keys are about 41,000
    // iterations of one invocation, still below the cap.
    check(&Case::new(
        "loop cap 20000 keys d128",
        [1, 1, 1],
        [1, 20_000, 128],
    ));
}

#[test]
fn gpu_forward_is_deterministic() {
    let client = client();
    let case = Case::new("determinism", [1, 4, 2], [45, 300, 64]).mask(AttentionMask::causal());
    let data = Data::of(&case);
    let visibility = case.mask.visibility(case.queries, case.keys);
    let first = run(&client, &case, &data, &visibility);
    let second = run(&client, &case, &data, &visibility);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&first.0), bits(&second.0));
    assert_eq!(bits(&first.1), bits(&second.1));
}
