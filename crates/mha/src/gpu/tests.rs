//! The kernels on the wgpu device (Mesa's lavapipe where there is no GPU) against
//! attention computed in f64 on the host: outputs, log-sum-exps and the gradients of the
//! query, key and value, for every mask kind the kernels read, GQA, lengths that are not
//! multiples of a tile, every tile shape the kernels may take, and the edges: sizes at a
//! tile's edges with every buffer followed by a guard (an out-of-bounds read or write
//! shows), a grid of more than 65,535 heads, a dK/dV cube whose group of query heads
//! would pass lavapipe's cap on loop iterations, and f16 rows whose every score is far
//! below zero.

use std::cell::Cell;
use std::collections::HashSet;
use std::sync::Mutex;

use burn::backend::DispatchDevice;
use burn::tensor::{DType, Device, DeviceKind, f16};
use cubecl::client::Client;
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::launch::{self, Inputs, Scoring};
use crate::mask::{AttentionMask, BLOCKED, CausalAlignment, DEAD_LSE, DEAD_ROW, Visibility};

thread_local! {
    /// Tiles (units, queries, keys) every kernel of this thread takes instead of those
    /// that fit the device (see `launch::tiles`).
    pub(crate) static FORCE_TILES: Cell<Option<(usize, usize, usize)>> = const { Cell::new(None) };
    /// Bytes of guard after every buffer this thread's kernels allocate.
    pub(crate) static GUARD: Cell<usize> = const { Cell::new(0) };
    /// This thread's kernels take the portable tile product, whatever the device has.
    pub(crate) static PORTABLE: Cell<bool> = const { Cell::new(false) };
    /// This thread's kernels take these fragments in the emulated cooperative product
    /// (`tile::Emulated`), whatever the device has.
    pub(crate) static EMULATE: Cell<Option<super::tile::Fragment>> = const { Cell::new(None) };
    /// This thread's forward takes the tiled kernel, whatever the number of queries.
    pub(crate) static TILED: Cell<bool> = const { Cell::new(false) };
}

/// What a guard holds: NaN in f32 and in f16, read back unchanged unless a kernel wrote
/// past its tensor.
const CANARY: u8 = 0xFF;
/// Guard bytes in the edge tests: more than a tile's rows of the widest tensor.
const GUARD_BYTES: usize = 1 << 16;

/// The tiles the tests forced, to count the kernels compiled.
static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);

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

/// The bytes of `data`, followed by this thread's guard.
fn guarded(bytes: &[u8]) -> Vec<u8> {
    let mut out = bytes.to_vec();
    out.resize(bytes.len() + GUARD.get(), CANARY);
    out
}

impl<T: CubeElement> Host<T> {
    fn upload(&self, client: &Client) -> TensorBinding {
        let handle = client.create_from_slice(&guarded(T::as_bytes(&self.data)));
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

/// One problem: sizes, scoring, mask, how the query is laid out and the dtype.
#[derive(Clone)]
struct Case {
    name: String,
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
    /// f32 or f16 (the inputs rounded to it, the reference computed from them).
    dtype: DType,
    /// The bias's gradient is asked for too (read back, not checked against f64).
    bias_grad: bool,
}

impl Case {
    fn new(
        name: &str,
        [batch, heads, kv_heads]: [usize; 3],
        [queries, keys, d]: [usize; 3],
    ) -> Self {
        Self {
            name: name.into(),
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
            dtype: DType::F32,
            bias_grad: false,
        }
    }

    fn mask(self, mask: AttentionMask) -> Self {
        Self { mask, ..self }
    }
}

/// The inputs of a case on the host (rounded to its dtype), and the output's gradient.
struct Data {
    q: Host<f32>,
    k: Host<f32>,
    v: Host<f32>,
    grad: Host<f32>,
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
        let round = |x: Vec<f32>| match case.dtype {
            DType::F16 => x.into_iter().map(|x| f16::from_f32(x).to_f32()).collect(),
            _ => x,
        };
        let layout = match case.heads_inside {
            true => [0, 2, 1, 3],
            false => [0, 1, 2, 3],
        };
        let q = Host::new(
            [b, h, tq, d_k],
            layout,
            round(values(b * h * tq * d_k, 1, 1.0)),
        );
        let k = Host::new(
            [b, hk, tk, d_k],
            [0, 1, 2, 3],
            round(values(b * hk * tk * d_k, 2, 1.0)),
        );
        let v = Host::new(
            [b, hk, tk, d_v],
            [0, 1, 2, 3],
            round(values(b * hk * tk * d_v, 3, 1.0)),
        );
        let grad = Host::new(
            [b, h, tq, d_v],
            [0, 1, 2, 3],
            round(values(b * h * tq * d_v, 5, 1.0)),
        );
        let bias = case.bias.map(|shape| {
            let n = shape.iter().product();
            let mut data = round(values(n, 4, 2.0));
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
            grad,
            bias,
            blocked,
        }
    }
}

/// Attention in f64 by the kernels' rules, with the keys of each query from
/// [`Visibility::keys_of`]: the output `[B, H, Tq, Dv]`, the log-sum-exp `[B, H, Tq]`, and
/// the gradients of the query, key and value (each of its input's shape, contiguous) for
/// the output's gradient `data.grad`.
struct Reference {
    out: Vec<f64>,
    lse: Vec<f64>,
    dq: Vec<f64>,
    dk: Vec<f64>,
    dv: Vec<f64>,
}

fn reference(case: &Case, data: &Data, visibility: &Visibility) -> Reference {
    let (tq, tk, dk_, dv_) = (case.queries, case.keys, case.d_k, case.d_v);
    let group = case.heads / case.kv_heads;
    let scale = case.scale as f64;
    let mut r = Reference {
        out: vec![0.0; case.batch * case.heads * tq * dv_],
        lse: vec![0.0; case.batch * case.heads * tq],
        dq: vec![0.0; case.batch * case.heads * tq * dk_],
        dk: vec![0.0; case.batch * case.kv_heads * tk * dk_],
        dv: vec![0.0; case.batch * case.kv_heads * tk * dv_],
    };
    for b in 0..case.batch {
        for h in 0..case.heads {
            let hk = h / group;
            for i in 0..tq {
                let keys: Vec<usize> = visibility.keys_of(b, i).collect();
                // Each score, and the soft cap's slope at it.
                let scored: Vec<(f64, f64)> = keys
                    .iter()
                    .map(|&j| {
                        let dot: f64 = (0..dk_)
                            .map(|d| {
                                data.q.at([b, h, i, d]) as f64 * data.k.at([b, hk, j, d]) as f64
                            })
                            .sum::<f64>()
                            * scale;
                        let (mut s, slope) = match case.softcap {
                            Some(cap) => {
                                let t = (dot / cap as f64).tanh();
                                (cap as f64 * t, 1.0 - t * t)
                            }
                            None => (dot, 1.0),
                        };
                        if let Some(bias) = &data.bias {
                            let x = bias.at([b, h, i, j]) as f64;
                            s = if x <= BLOCKED as f64 {
                                BLOCKED as f64
                            } else {
                                s + x
                            };
                        }
                        if let Some(blocked) = &data.blocked
                            && blocked.at([b, h, i, j]) != 0
                        {
                            s = BLOCKED as f64;
                        }
                        (s, slope)
                    })
                    .collect();
                let row = (b * case.heads + h) * tq + i;
                let max = scored.iter().map(|s| s.0).fold(f64::NEG_INFINITY, f64::max);
                if max <= DEAD_ROW as f64 {
                    r.lse[row] = DEAD_LSE as f64;
                    continue;
                }
                let sum: f64 = scored.iter().map(|s| (s.0 - max).exp()).sum();
                r.lse[row] = max + sum.ln();
                let p: Vec<f64> = scored.iter().map(|s| (s.0 - r.lse[row]).exp()).collect();
                for (&j, &w) in keys.iter().zip(&p) {
                    for d in 0..dv_ {
                        r.out[row * dv_ + d] += w * data.v.at([b, hk, j, d]) as f64;
                    }
                }
                let d_o = |d: usize| data.grad.at([b, h, i, d]) as f64;
                let delta: f64 = (0..dv_).map(|d| d_o(d) * r.out[row * dv_ + d]).sum();
                for ((&j, &w), &(_, slope)) in keys.iter().zip(&p).zip(&scored) {
                    let dp: f64 = (0..dv_)
                        .map(|d| d_o(d) * data.v.at([b, hk, j, d]) as f64)
                        .sum();
                    let ds = w * (dp - delta) * slope * scale;
                    let kv_row = (b * case.kv_heads + hk) * tk + j;
                    for d in 0..dk_ {
                        r.dq[row * dk_ + d] += ds * data.k.at([b, hk, j, d]) as f64;
                        r.dk[kv_row * dk_ + d] += ds * data.q.at([b, h, i, d]) as f64;
                    }
                    for d in 0..dv_ {
                        r.dv[kv_row * dv_ + d] += w * d_o(d);
                    }
                }
            }
        }
    }
    r
}

/// What the kernels give for a case, each tensor `[B, heads, T, D]` contiguous.
struct Run {
    out: Vec<f32>,
    lse: Vec<f32>,
    dq: Vec<f32>,
    dk: Vec<f32>,
    dv: Vec<f32>,
    /// The bias's gradient, where the case asks for it (else empty).
    dbias: Vec<f32>,
}

/// The elements of `handle` (laid out as the heads of a `[B, T, heads·D]` tensor) as a
/// contiguous `[B, heads, T, D]` tensor, checking the guard after them.
fn read_heads(client: &Client, handle: Handle, [b, h, t, d]: [usize; 4], size: usize) -> Vec<f32> {
    let bytes = read_guarded(client, handle, b * h * t * d * size);
    let values = to_f32(&bytes, size);
    let mut out = vec![0.0; b * h * t * d];
    for bi in 0..b {
        for hi in 0..h {
            for ti in 0..t {
                for di in 0..d {
                    out[((bi * h + hi) * t + ti) * d + di] =
                        values[((bi * t + ti) * h + hi) * d + di];
                }
            }
        }
    }
    out
}

/// The query's, key's and value's heads (`[B, heads, T, D]` each, contiguous) of the
/// packed tensor `[B, T, (H + 2·Hkv)·D]` in `handle`, checking the guard after it.
fn read_packed(
    client: &Client,
    handle: Handle,
    [b, t, d]: [usize; 3],
    [h, hk]: [usize; 2],
    size: usize,
) -> [Vec<f32>; 3] {
    let width = (h + 2 * hk) * d;
    let values = to_f32(&read_guarded(client, handle, b * t * width * size), size);
    let part = |first: usize, heads: usize| {
        let mut out = Vec::with_capacity(b * heads * t * d);
        for bi in 0..b {
            for hi in 0..heads {
                for ti in 0..t {
                    let at = (bi * t + ti) * width + (first + hi) * d;
                    out.extend_from_slice(&values[at..at + d]);
                }
            }
        }
        out
    };
    [part(0, h), part(h, hk), part(h + hk, hk)]
}

/// The first `len` bytes of `handle`, after checking that its guard is untouched.
fn read_guarded(client: &Client, handle: Handle, len: usize) -> Vec<u8> {
    let bytes = client.read_one(handle).expect("a buffer").to_vec();
    assert!(bytes.len() >= len, "{} bytes, want {len}", bytes.len());
    if let Some(at) = bytes[len..].iter().position(|&x| x != CANARY) {
        panic!(
            "a kernel wrote {} bytes past its tensor of {len} bytes",
            at + 1
        );
    }
    bytes[..len].to_vec()
}

fn to_f32(bytes: &[u8], size: usize) -> Vec<f32> {
    match size {
        4 => f32::from_bytes(bytes).to_vec(),
        _ => bytes
            .chunks(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
    }
}

fn upload_as(client: &Client, host: &Host<f32>, dtype: DType) -> TensorBinding {
    match dtype {
        DType::F16 => {
            Host::new_strided(host, host.data.iter().map(|&x| f16::from_f32(x)).collect())
                .upload(client)
        }
        _ => host.upload(client),
    }
}

impl<T: Copy> Host<T> {
    fn new_strided<U>(like: &Host<U>, data: Vec<T>) -> Self {
        Self {
            shape: like.shape,
            strides: like.strides,
            data,
        }
    }
}

/// Runs the forward and backward kernels on `case`.
fn run(client: &Client, case: &Case, data: &Data, visibility: &Visibility) -> Run {
    let (elem, size, blocked) = launch::element(case.dtype);
    let inputs = Inputs {
        elem,
        size,
        blocked,
        qkv: [&data.q, &data.k, &data.v].map(|t| upload_as(client, t, case.dtype)),
        bias: data.bias.as_ref().map(|t| upload_as(client, t, case.dtype)),
        pd: None,
        mask: data.blocked.as_ref().map(|t| t.upload(client)),
        mask_elem: ElemType::UInt(cubecl::ir::UIntKind::U32),
        seq: None,
    };
    let scoring = Scoring {
        scale: case.scale,
        softcap: case.softcap,
        band: visibility.band(),
    };
    let n = inputs.dims();
    SEEN.lock()
        .unwrap()
        .get_or_insert_with(HashSet::new)
        .insert(format!(
            "{:?}",
            launch::tiles(
                &n,
                size,
                1 << 20,
                case.softcap.is_some(),
                launch::cooperative(client, elem)
            )
        ));
    let (b, h, hk, tq, tk) = (n.batch, n.heads, n.kv_heads, n.queries, n.keys);
    let (out, lse) = launch::forward(client, &inputs, scoring);
    let out_shape = [b, h, tq, n.d_v];
    let lse_shape = [b, h, tq, 1];
    // SAFETY: the forward pass wrote these tensors in these layouts.
    let (out_binding, lse_binding) = unsafe {
        (
            TensorBinding::from_raw_parts(
                out.clone(),
                launch::heads_inside_strides(out_shape).to_vec().into(),
                out_shape.to_vec().into(),
            ),
            TensorBinding::from_raw_parts(
                lse.clone(),
                launch::contiguous_strides(lse_shape).to_vec().into(),
                lse_shape.to_vec().into(),
            ),
        )
    };
    let grad = upload_as(client, &data.grad, case.dtype);
    let backward = |packed| {
        launch::backward(
            client,
            &inputs,
            scoring,
            [&out_binding, &lse_binding],
            &grad,
            [true, true, case.bias_grad, false],
            packed,
        )
    };
    let grads = backward(false);
    let dq = read_heads(client, grads.dq, [b, h, tq, n.d_k], size);
    let dk = read_heads(client, grads.dk, [b, hk, tk, n.d_k], size);
    let dv = read_heads(client, grads.dv, [b, hk, tk, n.d_v], size);
    // Where the call could be a packed projection's, the kernels write the same
    // gradients side by side into one tensor, within it (its guard checked).
    if tq == tk && n.d_k == n.d_v && launch::packed(client, [h, hk, n.d_k], size) {
        let packed = backward(true);
        let parts = read_packed(client, packed.dq, [b, tq, n.d_k], [h, hk], size);
        for (what, got, want) in [
            ("dq", &parts[0], &dq),
            ("dk", &parts[1], &dk),
            ("dv", &parts[2], &dv),
        ] {
            assert!(got == want, "{}: {what} written packed differs", case.name);
        }
    }
    let dbias = match (grads.dbias, case.bias) {
        (Some(handle), Some(shape)) => {
            let len = shape.iter().product::<usize>();
            to_f32(&read_guarded(client, handle, len * size), size)
        }
        _ => Vec::new(),
    };
    Run {
        out: read_heads(client, out, out_shape, size),
        lse: to_f32(&read_guarded(client, lse, b * h * tq * 4), 4),
        dq,
        dk,
        dv,
        dbias,
    }
}

/// `got` against `want` within `atol + rtol · |want|`; the largest error.
fn close(case: &Case, what: &str, got: &[f32], want: &[f64], [atol, rtol]: [f64; 2]) -> f64 {
    assert_eq!(got.len(), want.len(), "{}: {what}", case.name);
    let mut worst = 0.0f64;
    for (at, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= atol + rtol * w.abs(),
            "{}: {what} {at}: {g} != {w}",
            case.name
        );
        if w != DEAD_LSE as f64 {
            worst = worst.max(err);
        }
    }
    worst
}

/// Runs `case` forward and backward and checks every result against [`reference`].
fn check(case: &Case) {
    check_data(case, &Data::of(case));
}

/// [`check`] on inputs of the caller's.
fn check_data(case: &Case, data: &Data) {
    let client = client();
    let visibility = case.mask.visibility(case.queries, case.keys);
    let want = reference(case, data, &visibility);
    let got = run(&client, case, data, &visibility);
    let (forward, grads) = match case.dtype {
        DType::F16 => ([2e-3, 2e-3], [5e-3, 5e-3]),
        _ => ([1e-5, 1e-5], [2e-5, 1e-4]),
    };
    let errors = [
        close(case, "output", &got.out, &want.out, forward),
        close(case, "log-sum-exp", &got.lse, &want.lse, [1e-5, 1e-5]),
        close(case, "dq", &got.dq, &want.dq, grads),
        close(case, "dk", &got.dk, &want.dk, grads),
        close(case, "dv", &got.dv, &want.dv, grads),
    ];
    println!(
        "{}: largest errors: output {:.1e}, lse {:.1e}, dq {:.1e}, dk {:.1e}, dv {:.1e}",
        case.name, errors[0], errors[1], errors[2], errors[3], errors[4]
    );
}

/// Runs `body` with the kernels' tiles forced to `tiles`.
fn with_tiles(tiles: (usize, usize, usize), body: impl FnOnce()) {
    FORCE_TILES.set(Some(tiles));
    body();
    FORCE_TILES.set(None);
}

#[test]
fn gpu_attention_without_a_mask_matches_f64() {
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
fn gpu_attention_causal_in_both_alignments_matches_f64() {
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
    // Offsets past the keys: every query sees every key (the band's open side was a
    // bound the offset moved inside the keys).
    check(
        &Case::new("causal offset 7 past 4 keys d32", [1, 2, 2], [13, 4, 32])
            .mask(causal().aligned(CausalAlignment::Offset(7))),
    );
    check(
        &Case::new("causal offset 100 d32", [1, 1, 1], [4, 3, 32])
            .mask(causal().aligned(CausalAlignment::Offset(100))),
    );
    check(
        &Case::new("window 60 offset -40 d32", [1, 1, 1], [5, 30, 32])
            .mask(AttentionMask::local(60).aligned(CausalAlignment::Offset(-40))),
    );
    // The decoding kernels' band.
    check(
        &Case::new("decoding: window 60 offset -30 d32", [1, 2, 2], [2, 20, 32])
            .mask(AttentionMask::local(60).aligned(CausalAlignment::Offset(-30))),
    );
}

#[test]
fn gpu_attention_gqa_8_to_2_matches_f64() {
    check(&Case {
        scale: 0.2,
        ..Case::new("gqa 8:2 causal d128", [1, 8, 2], [37, 53, 128]).mask(AttentionMask::causal())
    });
    // Self-attention's lengths: its gradients written packed too (see `run`).
    check(
        &Case::new("gqa 8:2 causal d64 T53", [1, 8, 2], [53, 53, 64]).mask(AttentionMask::causal()),
    );
}

#[test]
fn gpu_attention_bias_and_key_padding_match_f64() {
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
fn gpu_attention_windows_match_f64() {
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
fn gpu_attention_softcap_matches_f64() {
    check(&Case {
        scale: 1.0,
        softcap: Some(5.0),
        ..Case::new("softcap 5 scale 1 d32", [1, 2, 2], [33, 47, 32])
    });
}

/// Calls of at most `launch::DECODE_QUERIES` queries take the decoding kernels (a cube
/// per split of 256 keys and up to 8 query rows that read one key/value head, the
/// splits then weighed): one split and several (keys not a multiple of a split), cubes
/// of one row, of several, and a last cube with fewer, every mask kind (causal in both alignments,
/// a window whose first splits see no key, a bias with `-inf`, key padding with a
/// batch row whose every split is dead, a boolean mask), GQA, the soft cap, head dims
/// read one element at a time, the query as the heads of a projection, f16 (scores far
/// below zero included); against f64 and against the tiled forward on the same inputs,
/// every buffer followed by a guard.
#[test]
fn gpu_decoding_matches_the_tiled_forward_and_f64() {
    let client = client();
    let shared = client.properties().hardware.max_shared_memory_size;
    let causal = AttentionMask::causal;
    let cases = [
        Case::new("decode Tq1 Tk1 d64", [1, 2, 2], [1, 1, 64]),
        Case::new(
            "decode gqa 8:2 Tq1 Tk700 causal d64",
            [2, 8, 2],
            [1, 700, 64],
        )
        .mask(causal()),
        Case {
            bias: Some([1, 2, 3, 600]),
            blocked: Some([2, 1, 1, 600]),
            dead_batches: 1,
            ..Case::new(
                "decode Tq3 Tk600 bias + key padding d32",
                [2, 2, 2],
                [3, 600, 32],
            )
            .mask(causal())
        },
        Case {
            blocked: Some([1, 1, 4, 530]),
            heads_inside: true,
            ..Case::new(
                "decode Tq4 Tk530 bool top-left d64",
                [1, 3, 1],
                [4, 530, 64],
            )
            .mask(causal().aligned(CausalAlignment::TopLeft))
        },
        Case::new(
            "decode gqa 8:1 Tq4 Tk600 causal d64 (four cubes of 8 rows)",
            [2, 8, 1],
            [4, 600, 64],
        )
        .mask(causal()),
        Case {
            bias: Some([2, 3, 3, 300]),
            ..Case::new(
                "decode gqa 3:1 Tq3 Tk300 bias d16 (two cubes of 5 rows, one empty)",
                [2, 3, 1],
                [3, 300, 16],
            )
            .mask(causal())
        },
        Case::new(
            "decode Tq8 Tk520 causal d64 (a cube of 8 rows)",
            [1, 2, 2],
            [8, 520, 64],
        )
        .mask(causal()),
        Case::new("decode Tq2 Tk1000 window 100 d64", [1, 2, 2], [2, 1000, 64])
            .mask(AttentionMask::sliding_window(100)),
        Case::new(
            "decode Tq4 Tk300 local 20 offset 200 d64",
            [1, 1, 1],
            [4, 300, 64],
        )
        .mask(AttentionMask::local(20).aligned(CausalAlignment::Offset(200))),
        Case {
            scale: 1.0,
            softcap: Some(5.0),
            d_v: 9,
            ..Case::new("decode Tq1 Tk513 softcap d7/9", [1, 2, 2], [1, 513, 7])
        },
        Case {
            dtype: DType::F16,
            ..Case::new("decode f16 Tq3 Tk777 causal d128", [1, 4, 2], [3, 777, 128]).mask(causal())
        },
    ];
    GUARD.set(GUARD_BYTES);
    for case in &cases {
        let visibility = case.mask.visibility(case.queries, case.keys);
        let scoring = Scoring {
            scale: case.scale,
            softcap: case.softcap,
            band: visibility.band(),
        };
        let dims = crate::problem::Dims::of([
            [case.batch, case.heads, case.queries, case.d_k],
            [case.batch, case.kv_heads, case.keys, case.d_k],
            [case.batch, case.kv_heads, case.keys, case.d_v],
        ]);
        assert!(
            launch::decoding(&dims, scoring, shared).is_some(),
            "{}: not on the decoding kernels",
            case.name
        );
        let data = Data::of(case);
        check_data(case, &data);
        let decoded = run(&client, case, &data, &visibility);
        TILED.set(true);
        let tiled = run(&client, case, &data, &visibility);
        TILED.set(false);
        let tol = match case.dtype {
            DType::F16 => 2e-3,
            _ => 1e-5,
        };
        for (what, a, b) in [
            ("output", &decoded.out, &tiled.out),
            ("log-sum-exp", &decoded.lse, &tiled.lse),
        ] {
            for (at, (&x, &y)) in a.iter().zip(b.iter()).enumerate() {
                assert!(
                    (x - y).abs() <= tol * (1.0 + y.abs()),
                    "{}: {what} {at}: decoded {x}, tiled {y}",
                    case.name
                );
            }
        }
    }
    GUARD.set(0);

    // Scores far below zero (below -2^13) in f16 over several splits: real rows.
    check_very_low_scores("decode f16 scores below -8192 Tk600", [1, 600]);
}

/// Every tile shape the kernels may take (whatever the device's shared memory picks), on
/// a head dim that is not a multiple of 16 and lengths that are not multiples of a tile,
/// causal with a bias and a boolean mask: in f32 at the widest head dims the device's
/// shared memory holds the tiles at, else in f16 (f16 kernels take CubeCL several times
/// longer to compile).
#[test]
fn gpu_attention_in_every_tile_shape_matches_f64() {
    let shared = client().properties().hardware.max_shared_memory_size;
    for tiles in launch::CANDIDATES {
        let (u, q, k) = tiles;
        let fits = |(dtype, d_k, d_v): (DType, usize, usize)| {
            let size = dtype.size();
            let needs = [
                launch::ForwardTiles::new(u, q, k, d_k, d_v).shared_bytes(size),
                launch::DqTiles::new(u, q, k, d_k, d_v).shared_bytes(size),
                launch::DkvTiles::new(u, q, k, d_k, d_v).shared_bytes(size),
            ];
            println!("tiles {tiles:?} in {dtype:?} at d{d_k}/{d_v} need {needs:?} bytes");
            needs.iter().all(|&n| n <= shared)
        };
        // The widest head dims first (24 is not a multiple of 16; 12 not of 8).
        let (dtype, d_k, d_v) = [
            (DType::F32, 24, 32),
            (DType::F16, 24, 32),
            (DType::F32, 12, 16),
            (DType::F16, 12, 16),
        ]
        .into_iter()
        .find(|&c| fits(c))
        .unwrap_or_else(|| panic!("tiles {tiles:?} fit the device's {shared} bytes nowhere"));
        with_tiles(tiles, || {
            check(&Case {
                bias: Some([1, 2, 1, 75]),
                blocked: Some([1, 1, 70, 75]),
                dtype,
                d_v,
                ..Case::new(
                    &format!("tiles {tiles:?} {dtype:?} causal bias bool d{d_k}/{d_v}"),
                    [1, 2, 1],
                    [70, 75, d_k],
                )
                .mask(AttentionMask::causal())
            })
        });
    }
}

/// Lengths 1, 63, 65, 127 and 129 (a tile's edges), every buffer followed by a guard of
/// NaN: a read past a tensor gives NaN, a write past one changes the guard.
#[test]
fn gpu_attention_at_the_tiles_edges_stays_within_its_tensors() {
    GUARD.set(GUARD_BYTES);
    for len in [1, 63, 65, 127, 129] {
        check(&Case::new(
            &format!("edge T{len} d64"),
            [1, 2, 1],
            [len, len, 64],
        ));
        check(&Case {
            bias: Some([1, 1, len, len]),
            ..Case::new(
                &format!("edge causal bias T{len} d16"),
                [2, 1, 1],
                [len, len, 16],
            )
            .mask(AttentionMask::causal())
        });
        check(&Case::new(
            &format!("edge Tq{len} Tk3 d8"),
            [1, 1, 1],
            [len, 3, 8],
        ));
    }
    GUARD.set(0);
}

/// An f16 call whose scores all lie far below zero (large logits, below -2^13, near
/// f16's blocked score of -2^14): rows with a real softmax, not blocked rows.
#[test]
fn gpu_attention_in_f16_keeps_rows_of_very_low_scores() {
    check_very_low_scores("f16 scores below -8192", [16, 24]);
}

/// Checks `[queries, keys]` of one head of 32 in f16 whose every score is about -12,800
/// (queries in [16, 24], keys in [-24, -16]): every row's log-sum-exp below -2^13, and
/// every row a real one.
fn check_very_low_scores(name: &str, [queries, keys]: [usize; 2]) {
    let case = Case {
        dtype: DType::F16,
        scale: 1.0,
        ..Case::new(name, [1, 1, 1], [queries, keys, 32])
    };
    let mut data = Data::of(&case);
    let shift = |x: &mut f32, sign: f32| *x = f16::from_f32(sign * (20.0 + 4.0 * *x)).to_f32();
    data.q.data.iter_mut().for_each(|x| shift(x, 1.0));
    data.k.data.iter_mut().for_each(|x| shift(x, -1.0));
    let visibility = case.mask.visibility(case.queries, case.keys);
    let want = reference(&case, &data, &visibility);
    let highest = want.lse.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    assert!(
        highest < -8192.0,
        "{name}: the case's highest log-sum-exp: {highest}"
    );
    check_data(&case, &data);
}

/// More query heads than a grid's dimension has cubes (65,535 on lavapipe): the grid
/// folds them.
#[test]
fn gpu_attention_over_more_heads_than_a_grid_dimension_matches_f64() {
    check(&Case::new("B·H = 66,000", [2, 33_000, 33_000], [2, 3, 4]));
}

/// Grouped-query attention 8:1 over 9,000 queries: one dK/dV cube walks every query of
/// its eight heads; a cube that looped once per query would pass lavapipe's 65,535
/// iterations and stop early, silently.
#[test]
fn gpu_attention_gqa_8_to_1_over_9000_queries_matches_f64() {
    check(&Case::new(
        "gqa 8:1 Tq 9000 Tk 8 d4",
        [1, 8, 1],
        [9000, 8, 4],
    ));
}

#[test]
fn gpu_attention_is_deterministic() {
    let client = client();
    let case = Case::new("determinism", [1, 4, 2], [45, 300, 64]).mask(AttentionMask::causal());
    let data = Data::of(&case);
    let visibility = case.mask.visibility(case.queries, case.keys);
    let first = run(&client, &case, &data, &visibility);
    let second = run(&client, &case, &data, &visibility);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (a, b) in [
        (&first.out, &second.out),
        (&first.lse, &second.lse),
        (&first.dq, &second.dq),
        (&first.dk, &second.dk),
        (&first.dv, &second.dv),
    ] {
        assert_eq!(bits(a), bits(b));
    }
}

/// 20,000 keys at head dim 128: one invocation looping over every key and head dim would
/// pass lavapipe's 65,535 iterations and stop early, silently.
#[test]
fn gpu_forward_past_the_loop_cap_of_a_naive_kernel_matches_f64() {
    let client = client();
    let case = Case::new("loop cap 20000 keys d128", [1, 1, 1], [1, 20_000, 128]);
    let data = Data::of(&case);
    let visibility = case.mask.visibility(case.queries, case.keys);
    let want = reference(&case, &data, &visibility);
    let got = run(&client, &case, &data, &visibility);
    close(&case, "output", &got.out, &want.out, [1e-5, 1e-5]);
    close(&case, "dk", &got.dk, &want.dk, [2e-5, 1e-4]);
}

/// The tile product on cooperative matrices (tensor cores), where the device multiplies
/// f16 on them: every kernel's products in fragments, against f64 and against the
/// portable product on the same inputs, on every mask kind the suite covers (none,
/// causal in both alignments and at an offset, windows, a bias and its gradient, key
/// padding, a boolean mask, the soft cap), GQA, and lengths that are not multiples of
/// a tile. Skipped, with the reason printed, on a device without them (a WGSL device,
/// Mesa's lavapipe before it had them), where the SPIR-V of these kernels is still
/// validated (`tests/spirv.rs`) and [`emulated_cooperative_tile_product_matches_the_portable_one_and_f64`]
/// runs everything around the cooperative operations.
#[test]
fn gpu_cooperative_tile_product_matches_the_portable_one_and_f64() {
    let client = client();
    let (elem, _, _) = launch::element(DType::F16);
    match launch::fragment(client.properties(), elem) {
        Ok(frag) => {
            println!("cooperative matrices: {frag:?}");
            check_cooperative(&client, frag, &cooperative_cases());
        }
        Err(why) => println!("skipped: no cooperative matrices here: {why}"),
    }
}

/// [`gpu_cooperative_tile_product_matches_the_portable_one_and_f64`] on the emulated
/// cooperative product (`tile::Emulated`), which any device runs: the fragments of
/// NVIDIA's drivers (16 x 16 x 16 in subgroups of 32) on every case, lavapipe's
/// (8 x 8 x 8 in subgroups of 8) on two, so that everything around the cooperative
/// operations (the planes' fragments, their offsets and layouts, the scratch, the
/// weights in f16, the bias gradients' sums, the tiles) is tested in CI.
#[test]
fn emulated_cooperative_tile_product_matches_the_portable_one_and_f64() {
    let client = client();
    let cases = cooperative_cases();
    for (frag, cases) in [
        (fragment(16, 32), &cases[..]),
        (fragment(8, 8), &cases[3..5]),
    ] {
        EMULATE.set(Some(frag));
        check_cooperative(&client, frag, cases);
        EMULATE.set(None);
    }
}

/// Fragments of `n x n x n` in planes of `plane` units.
fn fragment(n: usize, plane: usize) -> super::tile::Fragment {
    super::tile::Fragment {
        m: n,
        n,
        k: n,
        plane,
    }
}

/// The cases of the cooperative product's tests, in f16 at head dims that are whole
/// fragments.
fn cooperative_cases() -> Vec<Case> {
    let causal = AttentionMask::causal;
    let (b, h, tq, tk) = (2, 2, 35, 41);
    let cases = [
        Case::new("none", [2, 3, 3], [77, 77, 64]),
        Case::new("causal bottom-right", [1, 2, 2], [70, 45, 64]).mask(causal()),
        Case::new("causal top-left", [1, 2, 2], [40, 100, 64])
            .mask(causal().aligned(CausalAlignment::TopLeft)),
        Case::new("gqa 8:2 causal", [1, 8, 2], [37, 53, 128]).mask(causal()),
        Case::new("sliding window 5", [1, 2, 2], [70, 70, 64])
            .mask(AttentionMask::sliding_window(5)),
        Case::new("local radius 3 top-left", [1, 2, 2], [30, 90, 64])
            .mask(AttentionMask::local(3).aligned(CausalAlignment::TopLeft)),
        Case::new("sliding window 40 and local 50", [1, 1, 1], [50, 100, 64])
            .mask(AttentionMask::sliding_window(40).and(AttentionMask::local(50))),
        Case::new("causal offset 10", [1, 1, 1], [20, 64, 64])
            .mask(causal().aligned(CausalAlignment::Offset(10))),
        Case {
            bias: Some([1, h, tq, tk]),
            blocked: Some([b, 1, 1, tk]),
            dead_batches: 1,
            bias_grad: true,
            ..Case::new("bias + key padding", [b, h, h], [tq, tk, 64])
        },
        // The bias's gradient summed over the queries (from dS in f32, not in f16).
        Case {
            bias: Some([b, 1, 1, tk]),
            bias_grad: true,
            ..Case::new("bias [B,1,1,Tk] causal", [b, h, h], [tq, tk, 64]).mask(causal())
        },
        Case {
            blocked: Some([1, 1, tq, tk]),
            ..Case::new("bool [Tq,Tk] causal top-left", [1, h, h], [tq, tk, 64])
                .mask(causal().aligned(CausalAlignment::TopLeft))
        },
        Case {
            scale: 1.0,
            softcap: Some(5.0),
            ..Case::new("softcap 5 scale 1", [1, 2, 2], [33, 47, 64])
        },
    ];
    cases
        .into_iter()
        .map(|case| Case {
            dtype: DType::F16,
            name: format!("cooperative f16 {} d{}", case.name, case.d_k),
            ..case
        })
        .collect()
}

/// Runs `cases` forward and backward with the kernels in fragments of `frag` (on
/// cooperative matrices, or emulated where the test asks), against f64 and against the
/// portable product.
fn check_cooperative(client: &Client, frag: super::tile::Fragment, cases: &[Case]) {
    let size = 2;
    let shared = client.properties().hardware.max_shared_memory_size;
    for case in cases {
        let case = &Case {
            name: format!("{} in {}x{}x{}", case.name, frag.m, frag.n, frag.k),
            ..case.clone()
        };
        // The kernels whose tiles the device's shared memory holds in fragments take
        // them (every one on NVIDIA's 48 KiB: `launch::tests`; lavapipe's 32 KiB leaves
        // dK/dV at head dim 128 portable).
        let dims = crate::problem::Dims::of([
            [case.batch, case.heads, case.queries, case.d_k],
            [case.batch, case.kv_heads, case.keys, case.d_k],
            [case.batch, case.kv_heads, case.keys, case.d_v],
        ]);
        let (forward, dq, dkv) = launch::tiles(&dims, size, shared, case.softcap.is_some(), frag);
        let taken = [
            ("forward", forward.frag),
            ("dQ", dq.frag),
            ("dK/dV", dkv.frag),
        ]
        .into_iter()
        .filter(|(_, f)| f.is_some())
        .map(|(kernel, _)| kernel)
        .collect::<Vec<_>>();
        assert!(!taken.is_empty(), "{}: no kernel in fragments", case.name);
        println!("{}: in fragments: {}", case.name, taken.join(", "));
        let data = Data::of(case);
        check_data(case, &data);
        let visibility = case.mask.visibility(case.queries, case.keys);
        let cooperative = run(client, case, &data, &visibility);
        PORTABLE.set(true);
        let portable = run(client, case, &data, &visibility);
        PORTABLE.set(false);
        let f64s = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
        for (what, got, want, tolerance) in [
            (
                "output vs portable",
                &cooperative.out,
                &portable.out,
                [2e-3, 2e-3],
            ),
            (
                "lse vs portable",
                &cooperative.lse,
                &portable.lse,
                [1e-5, 1e-5],
            ),
            (
                "dq vs portable",
                &cooperative.dq,
                &portable.dq,
                [5e-3, 5e-3],
            ),
            (
                "dk vs portable",
                &cooperative.dk,
                &portable.dk,
                [5e-3, 5e-3],
            ),
            (
                "dv vs portable",
                &cooperative.dv,
                &portable.dv,
                [5e-3, 5e-3],
            ),
            (
                "dbias vs portable",
                &cooperative.dbias,
                &portable.dbias,
                [5e-3, 5e-3],
            ),
        ] {
            let worst = close(case, what, got, &f64s(want), tolerance);
            println!("{}: {what}: largest difference {worst:.1e}", case.name);
        }
    }
}
