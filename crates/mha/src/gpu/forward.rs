//! The portable forward pass: a cube of [`QT`] units owns [`QT`] query rows of one head,
//! one row per unit; it walks the key/value tiles its rows see between them, each tile
//! staged in shared memory by every unit of the cube, and each unit keeps its row's
//! running maximum, sum and output in registers (online softmax, f32). It writes the
//! output `[B, H, Tq, Dv]` and the log-sum-exp `[B, H, Tq]` of every row.
//!
//! Per tile a unit loops over the keys of its own interval twice (scores, then weights
//! into the output): its loop iterations grow with the keys it sees, about two per key,
//! and not with the head dims, whose loops are unrolled. Under lavapipe's cap of 65,535
//! loop iterations per invocation, a row may therefore see about 32,000 keys; a caller
//! with longer rows splits the keys (not done yet).

use cubecl::client::Client;
use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::mask::{BLOCKED, Band, DEAD_LSE, DEAD_ROW};

/// Query rows per cube, one per unit.
pub(crate) const QT: usize = 32;
/// Shared memory a cube stages its key and value tiles in, in f32s (16 KiB: half of what
/// the smallest devices give).
const STAGE: usize = 4096;
/// Below every score, blocked ones included: the running maximum before any key.
const NO_MAX: f32 = -3.0e38;
/// Beyond this `|s / cap|`, `tanh` is 1 in f32; the bound keeps its exponentials finite.
const TANH_BOUND: f32 = 15.0;

/// How the scores are made from `Q Kᵀ`, and which keys each query sees.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Scoring {
    /// Multiplies the queries.
    pub(crate) scale: f32,
    /// `cap · tanh(s / cap)` on the scaled scores, before the bias.
    pub(crate) softcap: Option<f32>,
    /// The keys of each query.
    pub(crate) band: Band,
}

/// The tensors of one call, as bindings: `[query, key, value]` (`[B, H, Tq, Dk]`, `[B, Hkv,
/// Tk, Dk]`, `[B, Hkv, Tk, Dv]`), an additive f32 `bias` and a u32 `mask` (nonzero =
/// blocked), each of rank 4 and broadcastable to `[B, H, Tq, Tk]` (an axis of size 1 is
/// read with stride 0).
pub(crate) struct Inputs {
    pub(crate) qkv: [TensorBinding; 3],
    pub(crate) bias: Option<TensorBinding>,
    pub(crate) mask: Option<TensorBinding>,
}

/// The compile-time shape of a kernel: each distinct value compiles once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Variant {
    pub(crate) d_k: usize,
    pub(crate) d_v: usize,
    /// Keys per tile.
    pub(crate) kt: usize,
    pub(crate) bias: bool,
    pub(crate) mask: bool,
}

impl Variant {
    /// The variant for head dims `d_k`, `d_v`: as many keys per tile as fit [`STAGE`], at
    /// most [`QT`] and at least one.
    pub(crate) fn new(d_k: usize, d_v: usize, bias: bool, mask: bool) -> Self {
        let kt = (STAGE / (d_k + d_v).max(1)).clamp(1, QT);
        Self {
            d_k,
            d_v,
            kt,
            bias,
            mask,
        }
    }
}

/// The output `[B, H, Tq, Dv]` and the log-sum-exp `[B, H, Tq]` (f32, contiguous) of
/// attention over `inputs` under `scoring`; query head `h` reads key/value head `h / (H /
/// Hkv)`. A row that sees no key, or only blocked ones, gets zeros and the log-sum-exp
/// [`DEAD_LSE`].
///
/// # Panics
/// If the shapes disagree or the sizes pass `i32`.
pub(crate) fn forward(client: &Client, inputs: Inputs, scoring: Scoring) -> (Handle, Handle) {
    let Inputs { qkv, bias, mask } = inputs;
    let [q, k, v] = qkv;
    let [batch, heads, queries, d_k] = dims(&q);
    let [_, kv_heads, keys, _] = dims(&k);
    let d_v = dims(&v)[3];
    assert!(
        kv_heads > 0 && heads.is_multiple_of(kv_heads) && dims(&k)[3] == d_k,
        "gpu attention: query {:?}, key {:?}, value {:?}",
        q.shape,
        k.shape,
        v.shape
    );
    let within = |n: usize| i32::try_from(n).expect("gpu attention: a size past i32");
    // "Every key" on a side of the band: more than any distance of the problem.
    let far = within(queries + keys + 1);
    let band = scoring.band;
    let side = |n: Option<usize>| n.map_or(far, |n| within(n.min(queries + keys + 1)));
    let offset = i32::try_from(band.offset.clamp(-(far as i64), far as i64)).expect("clamped");

    let variant = Variant::new(d_k, d_v, bias.is_some(), mask.is_some());
    let out = client.empty(batch * heads * queries * d_v * size_of::<f32>());
    let lse = client.empty(batch * heads * queries * size_of::<f32>());
    let contiguous = |shape: [usize; 4], handle: &Handle| {
        let strides = [
            shape[1] * shape[2] * shape[3],
            shape[2] * shape[3],
            shape[3],
            1,
        ];
        // SAFETY: `handle` was allocated for `shape`'s elements, laid out contiguously.
        unsafe {
            TensorArg::from_raw_parts(
                handle.clone(),
                strides.to_vec().into(),
                shape.to_vec().into(),
            )
        }
    };
    let placeholder = || {
        let handle = client.create_from_slice(u32::as_bytes(&[0]));
        contiguous([1, 1, 1, 1], &handle)
    };
    let extra =
        |t: Option<TensorBinding>| t.map_or_else(placeholder, |t| broadcast(t).into_tensor_arg());

    let cube_count = CubeCount::Static(
        within(queries.div_ceil(QT)) as u32,
        within(batch * heads) as u32,
        1,
    );
    forward_kernel::launch(
        client,
        cube_count,
        CubeDim::new_1d(QT as u32),
        q.into_tensor_arg(),
        k.into_tensor_arg(),
        v.into_tensor_arg(),
        extra(bias),
        extra(mask),
        contiguous([batch, heads, queries, d_v], &out),
        contiguous([batch, heads, queries, 1], &lse),
        offset,
        side(band.before),
        side(band.after),
        (heads / kv_heads) as u32,
        scoring.scale,
        scoring.softcap.unwrap_or(0.0),
        variant.d_k,
        variant.d_v,
        variant.kt,
        variant.bias,
        variant.mask,
    );
    (out, lse)
}

fn dims(t: &TensorBinding) -> [usize; 4] {
    assert!(
        t.shape.len() == 4,
        "gpu attention: a tensor of shape {:?}",
        t.shape
    );
    std::array::from_fn(|axis| t.shape[axis])
}

/// `t` with stride 0 along its axes of size 1, so that the kernel reads it as broadcast.
fn broadcast(mut t: TensorBinding) -> TensorBinding {
    let shape = dims(&t);
    let strides: Vec<usize> = (0..4)
        .map(|axis| if shape[axis] == 1 { 0 } else { t.strides[axis] })
        .collect();
    t.strides = strides.into();
    t
}

/// One cube: query rows `CUBE_POS_X · QT ..` of head `CUBE_POS_Y` (`b · H + h`), one per
/// unit. `offset`, `before`, `after`: the band of [`Band`], with every key as a bound
/// larger than the problem; `group`: `H / Hkv`; `softcap`: 0 for none.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
// `if flag { if read { .. } }`: the flag is known at compile time, and the read of a
// tensor the call does not have must not be emitted.
#[allow(clippy::collapsible_if)]
fn forward_kernel(
    q: &Tensor<f32>,
    k: &Tensor<f32>,
    v: &Tensor<f32>,
    bias: &Tensor<f32>,
    mask: &Tensor<u32>,
    out: &mut Tensor<f32>,
    lse: &mut Tensor<f32>,
    offset: i32,
    before: i32,
    after: i32,
    group: u32,
    scale: f32,
    softcap: f32,
    #[comptime] d_k: usize,
    #[comptime] d_v: usize,
    #[comptime] kt: usize,
    #[comptime] has_bias: bool,
    #[comptime] has_mask: bool,
) {
    let heads = q.shape(1);
    let queries = q.shape(2);
    let keys = k.shape(2);
    let bh = CUBE_POS_Y as usize;
    let b = bh / heads;
    let h = bh % heads;
    let hk = h / group as usize;
    let unit = UNIT_POS_X as usize;
    let q0 = CUBE_POS_X as usize * QT;
    let row = q0 + unit;
    let live = row < queries;
    let last = min(q0 + QT, queries) - 1;

    // The keys the cube's rows see between them (each row's interval moves forward with
    // the row), and this row's own.
    let tk = keys as i32;
    let lo_cube = max(q0 as i32 + offset - before, 0i32);
    let hi_cube = min(last as i32 + offset + after + 1, tk);
    let own = row as i32 + offset;
    let lo = max(own - before, 0i32);
    let hi = min(own + after + 1, tk);

    // The row's scaled query (a dead unit reads the last row and writes nothing).
    let q_row = min(row, queries - 1);
    let q_at = b * q.stride(0) + h * q.stride(1) + q_row * q.stride(2);
    let mut query = Array::<f32>::new(d_k);
    #[unroll]
    for d in 0..d_k {
        query[d] = q[q_at + d * q.stride(3)] * scale;
    }
    let mut acc = Array::<f32>::new(d_v);
    #[unroll]
    for d in 0..d_v {
        acc[d] = 0.0f32;
    }
    let mut row_max = f32::new(NO_MAX);
    let mut sum = 0.0f32;
    let mut scores = Array::<f32>::new(kt);

    let mut k_tile = Shared::<[f32]>::new_slice(kt * d_k);
    let mut v_tile = Shared::<[f32]>::new_slice(kt * d_v);
    let k_at = b * k.stride(0) + hk * k.stride(1);
    let v_at = b * v.stride(0) + hk * v.stride(1);
    let bias_at = b * bias.stride(0) + h * bias.stride(1) + q_row * bias.stride(2);
    let mask_at = b * mask.stride(0) + h * mask.stride(1) + q_row * mask.stride(2);

    let mut t0 = lo_cube;
    while t0 < hi_cube {
        // Stage keys t0..t0 + kt (zeros past the cube's keys), every unit a share.
        #[unroll]
        for i in 0..(kt * d_k).div_ceil(QT) {
            let e = i * QT + unit;
            if e < kt * d_k {
                let key = t0 + (e / d_k) as i32;
                let mut x = 0.0f32;
                if key < hi_cube {
                    x = k[k_at + key as usize * k.stride(2) + (e % d_k) * k.stride(3)];
                }
                k_tile[e] = x;
            }
        }
        #[unroll]
        for i in 0..(kt * d_v).div_ceil(QT) {
            let e = i * QT + unit;
            if e < kt * d_v {
                let key = t0 + (e / d_v) as i32;
                let mut x = 0.0f32;
                if key < hi_cube {
                    x = v[v_at + key as usize * v.stride(2) + (e % d_v) * v.stride(3)];
                }
                v_tile[e] = x;
            }
        }
        sync_cube();

        let start = max(lo, t0);
        let end = min(hi, t0 + kt as i32);
        if live && start < end {
            let mut tile_max = f32::new(NO_MAX);
            for key in start..end {
                let j = (key - t0) as usize;
                let mut s = 0.0f32;
                #[unroll]
                for d in 0..d_k {
                    s += query[d] * k_tile[j * d_k + d];
                }
                if softcap > 0.0f32 {
                    let x = max(min(s / softcap, TANH_BOUND), -TANH_BOUND);
                    s = softcap * x.tanh();
                }
                if has_bias {
                    let add = bias[bias_at + key as usize * bias.stride(3)];
                    s += max(add, BLOCKED);
                }
                if has_mask {
                    if mask[mask_at + key as usize * mask.stride(3)] != 0u32 {
                        s = BLOCKED;
                    }
                }
                scores[j] = s;
                tile_max = max(tile_max, s);
            }
            // Rescale the row to the new maximum, then add the tile's weights.
            let new_max = max(row_max, tile_max);
            let alpha = (row_max - new_max).exp();
            sum *= alpha;
            #[unroll]
            for d in 0..d_v {
                acc[d] *= alpha;
            }
            for key in start..end {
                let j = (key - t0) as usize;
                let p = (scores[j] - new_max).exp();
                sum += p;
                #[unroll]
                for d in 0..d_v {
                    acc[d] += p * v_tile[j * d_v + d];
                }
            }
            row_max = new_max;
        }
        sync_cube();
        t0 += kt as i32;
    }

    if live {
        let o_at = (bh * queries + row) * d_v;
        if row_max <= DEAD_ROW || sum <= 0.0f32 {
            #[unroll]
            for d in 0..d_v {
                out[o_at + d] = 0.0f32;
            }
            lse[bh * queries + row] = DEAD_LSE;
        } else {
            let inv = 1.0f32 / sum;
            #[unroll]
            for d in 0..d_v {
                out[o_at + d] = acc[d] * inv;
            }
            lse[bh * queries + row] = row_max + sum.ln();
        }
    }
}
