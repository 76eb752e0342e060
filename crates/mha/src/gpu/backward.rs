//! The portable backward pass, FlashAttention-2's scheme: the weights are recomputed per
//! tile from each row's log-sum-exp, never stored.
//!
//! 1. `delta`: `D = rowsum(dO ⊙ O)`, one unit per query row.
//! 2. `dq`: queries outer, as the forward pass (a cube of [`UNITS`] query rows walks the
//!    key/value tiles its rows see): `dQ = scale · Σ_j dS'_ij k_j`.
//! 3. `dkv`: keys outer, a cube of [`UNITS`] key rows of one key/value head walks, for each
//!    query head of its group in turn, the query tiles that see its keys (queries, `dO`,
//!    log-sum-exps and `D` staged in shared memory): `dV = Σ_i P_ij dO_i`,
//!    `dK = Σ_i dS'_ij (q_i · scale)`. Grouped-query attention sums over the group inside
//!    one unit, in a fixed order: no atomics, the same bits on every run.
//!
//! ```text
//! P = exp(S - lse)    dS = P ⊙ (dO Vᵀ - D)    dS' = dS ⊙ (1 - tanh²) under a soft cap
//! ```
//!
//! A fully blocked row has the log-sum-exp `DEAD_LSE`, which recomputes every one of its
//! weights to 0: its gradients are 0. Loop iterations per invocation: `dq` about one per
//! key a row sees; `dkv` about one per query that sees a key, times `H / Hkv`.

use cubecl::client::Client;
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::launch::{
    Inputs, Scoring, Sizes, UNITS, Variant, alloc, assert_contiguous, contiguous, dims, optional,
    within,
};
use super::scores::{cap_slope, capped, intervals, masked, pd_start, stage, stage_rows};

/// The gradients (in the inputs' dtype, contiguous, of the inputs' shapes) of attention over `inputs` under `scoring`, from its output `out` and
/// log-sum-exp `lse` (contiguous, as [`forward`](super::forward::forward) writes them) and the output's
/// gradient `grad` (`[B, H, Tq, Dv]`, any strides).
///
/// # Panics
/// If the shapes disagree or the sizes pass `i32`.
pub(crate) fn backward(
    client: &Client,
    inputs: &Inputs,
    scoring: Scoring,
    [out, lse]: [&TensorBinding; 2],
    grad: &TensorBinding,
    [bias_grad, pd_grad]: [bool; 2],
) -> Grads {
    let [q, k, v] = &inputs.qkv;
    let n = Sizes::of([q, k, v]);
    let out_shape = [n.batch, n.heads, n.queries, n.d_v];
    let row_shape = [n.batch, n.heads, n.queries, 1];
    assert_contiguous("output", out, out_shape);
    assert_contiguous("log-sum-exp", lse, row_shape);
    let [offset, before, after] = n.band(scoring.band);
    let variant = Variant::of(&n, inputs);
    let dq_shape = [n.batch, n.heads, n.queries, n.d_k];
    let dk_shape = [n.batch, n.kv_heads, n.keys, n.d_k];
    let dv_shape = [n.batch, n.kv_heads, n.keys, n.d_v];
    let delta = alloc(client, row_shape, 4);
    let [dq, dk, dv] =
        [dq_shape, dk_shape, dv_shape].map(|shape| alloc(client, shape, inputs.size));
    let scale = scoring.scale;
    let softcap = scoring.softcap.unwrap_or(0.0);
    let query_cubes = CubeCount::Static(
        within(n.queries.div_ceil(UNITS)) as u32,
        within(n.batch * n.heads) as u32,
        1,
    );
    let key_cubes = CubeCount::Static(
        within(n.keys.div_ceil(UNITS)) as u32,
        within(n.batch * n.kv_heads) as u32,
        1,
    );
    let cube_dim = CubeDim::new_1d(UNITS as u32);

    delta_kernel::launch(
        client,
        query_cubes.clone(),
        cube_dim,
        out.clone().into_tensor_arg(),
        grad.clone().into_tensor_arg(),
        contiguous(row_shape, &delta),
        n.d_v,
        inputs.elem,
    );
    dq_kernel::launch(
        client,
        query_cubes,
        cube_dim,
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        optional(client, inputs.bias.as_ref()),
        optional(client, inputs.pd.as_ref()),
        optional(client, inputs.mask.as_ref()),
        optional(client, inputs.seq.as_ref()),
        grad.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        contiguous(row_shape, &delta),
        contiguous(dq_shape, &dq),
        offset,
        before,
        after,
        n.group(),
        scale,
        softcap,
        variant.d_k,
        variant.d_v,
        variant.tile,
        variant.bias,
        variant.pd,
        variant.mask,
        variant.seq,
        inputs.elem,
    );
    dkv_kernel::launch(
        client,
        key_cubes,
        cube_dim,
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        optional(client, inputs.bias.as_ref()),
        optional(client, inputs.pd.as_ref()),
        optional(client, inputs.mask.as_ref()),
        optional(client, inputs.seq.as_ref()),
        grad.clone().into_tensor_arg(),
        lse.clone().into_tensor_arg(),
        contiguous(row_shape, &delta),
        contiguous(dk_shape, &dk),
        contiguous(dv_shape, &dv),
        offset,
        before,
        after,
        n.group(),
        scale,
        softcap,
        variant.d_k,
        variant.d_v,
        variant.tile,
        variant.bias,
        variant.pd,
        variant.mask,
        variant.seq,
        inputs.elem,
    );
    // The bias's and the bias by distance's gradients: sums of dS over the scores each
    // of their elements adds to.
    let sums = |mode: u32, target: &TensorBinding| {
        let (elements, reduced) = match mode {
            BIAS => {
                let shape = dims(target);
                let full = [n.batch, n.heads, n.queries, n.keys];
                let reduced = (0..4).filter(|&a| shape[a] == 1).map(|a| full[a]).product();
                (shape.iter().product::<usize>(), reduced)
            }
            _ => (n.heads * (n.queries + n.keys - 1), n.batch * n.queries),
        };
        let splits = reduced.div_ceil(CHUNK).max(1);
        let chunk = reduced.div_ceil(splits).max(1);
        let partial = alloc(client, [1, 1, splits, elements], 4);
        let [x, y] = grid(elements);
        dsum_kernel::launch(
            client,
            CubeCount::Static(x, y, within(splits) as u32),
            cube_dim,
            q.clone().into_tensor_arg(),
            k.clone().into_tensor_arg(),
            v.clone().into_tensor_arg(),
            optional(client, inputs.bias.as_ref()),
            optional(client, inputs.pd.as_ref()),
            optional(client, inputs.mask.as_ref()),
            optional(client, inputs.seq.as_ref()),
            grad.clone().into_tensor_arg(),
            lse.clone().into_tensor_arg(),
            contiguous(row_shape, &delta),
            contiguous([1, 1, splits, elements], &partial),
            offset,
            before,
            after,
            n.group(),
            scale,
            softcap,
            within(elements) as u32,
            within(chunk) as u32,
            within(reduced) as u32,
            mode,
            variant.d_k,
            variant.d_v,
            variant.bias,
            variant.pd,
            variant.mask,
            variant.seq,
            inputs.elem,
        );
        let sum = alloc(client, [1, 1, 1, elements], inputs.size);
        reduce_kernel::launch(
            client,
            CubeCount::Static(x, y, 1),
            cube_dim,
            contiguous([1, 1, splits, elements], &partial),
            contiguous([1, 1, 1, elements], &sum),
            inputs.elem,
        );
        sum
    };
    let dbias = inputs
        .bias
        .as_ref()
        .filter(|_| bias_grad)
        .map(|b| sums(BIAS, b));
    let dpd = inputs
        .pd
        .as_ref()
        .filter(|_| pd_grad)
        .map(|pd| sums(DISTANCE, pd));
    Grads {
        dq,
        dk,
        dv,
        dbias,
        dpd,
    }
}

/// The gradients of one call (in the inputs' dtype, contiguous): of the query, key and
/// value, and, when
/// asked for, of the bias (of its own shape, summed over the axes it broadcasts along)
/// and of the bias by distance (`[1, 1, H, Tq + Tk - 1]`).
pub(crate) struct Grads {
    pub(crate) dq: Handle,
    pub(crate) dk: Handle,
    pub(crate) dv: Handle,
    pub(crate) dbias: Option<Handle>,
    pub(crate) dpd: Option<Handle>,
}

/// Scores one unit of [`dsum_kernel`] sums at most, so that no invocation nears a
/// driver's cap on loop iterations; longer sums are split over cubes along `z` and
/// reduced by [`reduce_kernel`].
const CHUNK: usize = 2048;
/// [`dsum_kernel`]'s mode: the bias's gradient.
const BIAS: u32 = 0;
/// [`dsum_kernel`]'s mode: the bias by distance's gradient.
const DISTANCE: u32 = 1;

/// Cubes along `x` and `y` for `elements` units, [`UNITS`] per cube (a grid's `x` is
/// bounded on some devices).
fn grid(elements: usize) -> [u32; 2] {
    let cubes = elements.div_ceil(UNITS).max(1);
    let x = cubes.min(32_768);
    [within(x) as u32, within(cubes.div_ceil(x)) as u32]
}

/// `delta[row] = Σ_d grad[row, d] · out[row, d]`: one unit per query row, query rows
/// `CUBE_POS_X · UNITS ..` of head `CUBE_POS_Y`.
#[cube(launch)]
fn delta_kernel<F: Float>(
    out: &Tensor<F>,
    grad: &Tensor<F>,
    delta: &mut Tensor<f32>,
    #[comptime] d_v: usize,
    #[define(F)] _dtype: ElemType,
) {
    let heads = grad.shape(1);
    let queries = grad.shape(2);
    let bh = CUBE_POS_Y as usize;
    let row = CUBE_POS_X as usize * UNITS + UNIT_POS_X as usize;
    if row < queries {
        let (b, h) = (bh / heads, bh % heads);
        let g_at = b * grad.stride(0) + h * grad.stride(1) + row * grad.stride(2);
        let o_at = (bh * queries + row) * d_v;
        let mut sum = 0.0f32;
        #[unroll]
        for d in 0..d_v {
            sum += f32::cast_from(grad[g_at + d * grad.stride(3)]) * f32::cast_from(out[o_at + d]);
        }
        delta[bh * queries + row] = sum;
    }
}

/// `dQ`, queries outer: query rows `CUBE_POS_X · UNITS ..` of head `CUBE_POS_Y` (`b · H +
/// h`), one per unit, over the key/value tiles they see. The arguments after the tensors
/// are the forward kernel's.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn dq_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    bias: &Tensor<F>,
    pd: &Tensor<F>,
    mask: &Tensor<u32>,
    seq: &Tensor<i32>,
    grad: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<F>,
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
    #[comptime] has_pd: bool,
    #[comptime] has_mask: bool,
    #[comptime] has_seq: bool,
    #[define(F)] _dtype: ElemType,
) {
    let heads = q.shape(1);
    let queries = q.shape(2);
    let keys = k.shape(2);
    let bh = CUBE_POS_Y as usize;
    let b = bh / heads;
    let h = bh % heads;
    let hk = h / group as usize;
    let unit = UNIT_POS_X as usize;
    let q0 = CUBE_POS_X as usize * UNITS;
    let row = q0 + unit;
    let live = row < queries;
    let last = min(q0 + UNITS, queries) - 1;

    // The row's scaled query, output gradient, log-sum-exp and D (a dead unit reads the
    // last row and writes nothing), and the keys of the cube and of the row.
    let q_row = min(row, queries - 1);
    let seen = intervals(
        seq, b, q0, last, q_row, keys, offset, before, after, has_seq,
    );
    let (lo_cube, hi_cube, lo, hi) = (seen.lo_cube, seen.hi_cube, seen.lo, seen.hi);
    let q_at = b * q.stride(0) + h * q.stride(1) + q_row * q.stride(2);
    let g_at = b * grad.stride(0) + h * grad.stride(1) + q_row * grad.stride(2);
    let mut query = Array::<f32>::new(d_k);
    let mut acc = Array::<f32>::new(d_k);
    #[unroll]
    for d in 0..d_k {
        query[d] = f32::cast_from(q[q_at + d * q.stride(3)]) * scale;
        acc[d] = 0.0f32;
    }
    let mut d_out = Array::<f32>::new(d_v);
    #[unroll]
    for d in 0..d_v {
        d_out[d] = f32::cast_from(grad[g_at + d * grad.stride(3)]);
    }
    let row_lse = lse[bh * queries + q_row];
    let row_delta = delta[bh * queries + q_row];

    let mut k_tile = Shared::<[f32]>::new_slice(kt * d_k);
    let mut v_tile = Shared::<[f32]>::new_slice(kt * d_v);
    let k_at = b * k.stride(0) + hk * k.stride(1);
    let v_at = b * v.stride(0) + hk * v.stride(1);
    let bias_at = b * bias.stride(0) + h * bias.stride(1) + q_row * bias.stride(2);
    let pd_at = pd_start(pd, h, q_row, queries);
    let mask_at = b * mask.stride(0) + h * mask.stride(1) + q_row * mask.stride(2);

    let mut t0 = lo_cube;
    while t0 < hi_cube {
        stage(k, k_at, t0, hi_cube, 1.0f32, &mut k_tile, kt, d_k);
        stage(v, v_at, t0, hi_cube, 1.0f32, &mut v_tile, kt, d_v);
        sync_cube();

        let start = max(lo, t0);
        let end = min(hi, t0 + kt as i32);
        if live && start < end {
            for key in start..end {
                let j = (key - t0) as usize;
                let mut s = 0.0f32;
                #[unroll]
                for d in 0..d_k {
                    s += query[d] * k_tile[j * d_k + d];
                }
                let c = capped(s, softcap);
                let s = masked(
                    c,
                    key as usize,
                    bias,
                    bias_at,
                    pd,
                    pd_at,
                    mask,
                    mask_at,
                    has_bias,
                    has_pd,
                    has_mask,
                );
                let p = (s - row_lse).exp();
                let mut dp = 0.0f32;
                #[unroll]
                for d in 0..d_v {
                    dp += d_out[d] * v_tile[j * d_v + d];
                }
                let ds = p * (dp - row_delta) * cap_slope(c, softcap);
                #[unroll]
                for d in 0..d_k {
                    acc[d] += ds * k_tile[j * d_k + d];
                }
            }
        }
        sync_cube();
        t0 += kt as i32;
    }

    if live {
        let at = (bh * queries + row) * d_k;
        #[unroll]
        for d in 0..d_k {
            dq[at + d] = F::cast_from(acc[d] * scale);
        }
    }
}

/// `dK` and `dV`, keys outer: key rows `CUBE_POS_X · UNITS ..` of key/value head
/// `CUBE_POS_Y` (`b · Hkv + hk`), one per unit, over the query tiles of each query head
/// of the group in turn. The arguments after the tensors are the forward kernel's.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn dkv_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    bias: &Tensor<F>,
    pd: &Tensor<F>,
    mask: &Tensor<u32>,
    seq: &Tensor<i32>,
    grad: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<F>,
    dv: &mut Tensor<F>,
    offset: i32,
    before: i32,
    after: i32,
    group: u32,
    scale: f32,
    softcap: f32,
    #[comptime] d_k: usize,
    #[comptime] d_v: usize,
    #[comptime] qt: usize,
    #[comptime] has_bias: bool,
    #[comptime] has_pd: bool,
    #[comptime] has_mask: bool,
    #[comptime] has_seq: bool,
    #[define(F)] _dtype: ElemType,
) {
    let heads = q.shape(1);
    let queries = q.shape(2);
    let kv_heads = k.shape(1);
    let keys = k.shape(2);
    let bhk = CUBE_POS_Y as usize;
    let b = bhk / kv_heads;
    let hk = bhk % kv_heads;
    let unit = UNIT_POS_X as usize;
    let k0 = CUBE_POS_X as usize * UNITS;
    let key = k0 + unit;
    let live = key < keys;
    let last = min(k0 + UNITS, keys) - 1;

    // The key's own key and value rows (a dead unit reads the last key and writes
    // nothing); the queries that see the cube's keys between them, and this key's own:
    // query `i` sees key `j` when `i + offset - before <= j <= i + offset + after`, the
    // band mirrored (packed sequences are self-attention: one position's sequence).
    let k_row = min(key, keys - 1);
    let seen = intervals(
        seq, b, k0, last, k_row, queries, -offset, after, before, has_seq,
    );
    let (lo_cube, hi_cube, lo, hi) = (seen.lo_cube, seen.hi_cube, seen.lo, seen.hi);
    let k_at = b * k.stride(0) + hk * k.stride(1) + k_row * k.stride(2);
    let v_at = b * v.stride(0) + hk * v.stride(1) + k_row * v.stride(2);
    let mut own_k = Array::<f32>::new(d_k);
    let mut acc_k = Array::<f32>::new(d_k);
    #[unroll]
    for d in 0..d_k {
        own_k[d] = f32::cast_from(k[k_at + d * k.stride(3)]);
        acc_k[d] = 0.0f32;
    }
    let mut own_v = Array::<f32>::new(d_v);
    let mut acc_v = Array::<f32>::new(d_v);
    #[unroll]
    for d in 0..d_v {
        own_v[d] = f32::cast_from(v[v_at + d * v.stride(3)]);
        acc_v[d] = 0.0f32;
    }

    let mut q_tile = Shared::<[f32]>::new_slice(qt * d_k);
    let mut g_tile = Shared::<[f32]>::new_slice(qt * d_v);
    let mut lse_tile = Shared::<[f32]>::new_slice(qt);
    let mut delta_tile = Shared::<[f32]>::new_slice(qt);

    for g in 0..group {
        let h = hk * group as usize + g as usize;
        let bh = b * heads + h;
        let q_at = b * q.stride(0) + h * q.stride(1);
        let g_at = b * grad.stride(0) + h * grad.stride(1);
        let bias_head = b * bias.stride(0) + h * bias.stride(1);
        let mask_head = b * mask.stride(0) + h * mask.stride(1);
        let mut t0 = lo_cube;
        while t0 < hi_cube {
            stage(q, q_at, t0, hi_cube, scale, &mut q_tile, qt, d_k);
            stage(grad, g_at, t0, hi_cube, 1.0f32, &mut g_tile, qt, d_v);
            stage_rows(lse, bh * queries, t0, hi_cube, &mut lse_tile, qt);
            stage_rows(delta, bh * queries, t0, hi_cube, &mut delta_tile, qt);
            sync_cube();

            let start = max(lo, t0);
            let end = min(hi, t0 + qt as i32);
            if live && start < end {
                for i in start..end {
                    let r = (i - t0) as usize;
                    let mut s = 0.0f32;
                    #[unroll]
                    for d in 0..d_k {
                        s += q_tile[r * d_k + d] * own_k[d];
                    }
                    let c = capped(s, softcap);
                    let s = masked(
                        c,
                        k_row,
                        bias,
                        bias_head + i as usize * bias.stride(2),
                        pd,
                        pd_start(pd, h, i as usize, queries),
                        mask,
                        mask_head + i as usize * mask.stride(2),
                        has_bias,
                        has_pd,
                        has_mask,
                    );
                    let p = (s - lse_tile[r]).exp();
                    let mut dp = 0.0f32;
                    #[unroll]
                    for d in 0..d_v {
                        let g = g_tile[r * d_v + d];
                        acc_v[d] += p * g;
                        dp += g * own_v[d];
                    }
                    let ds = p * (dp - delta_tile[r]) * cap_slope(c, softcap);
                    #[unroll]
                    for d in 0..d_k {
                        acc_k[d] += ds * q_tile[r * d_k + d];
                    }
                }
            }
            sync_cube();
            t0 += qt as i32;
        }
    }

    if live {
        let k_out = (bhk * keys + key) * d_k;
        #[unroll]
        for d in 0..d_k {
            dk[k_out + d] = F::cast_from(acc_k[d]);
        }
        let v_out = (bhk * keys + key) * d_v;
        #[unroll]
        for d in 0..d_v {
            dv[v_out + d] = F::cast_from(acc_v[d]);
        }
    }
}

/// dS at one score `(b, h, i, j)`, recomputed from scratch (0 where query `i` does not see
/// key `j`): `P (dO_i · v_j - D_i)` with `P = exp(S - lse_i)`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn ds_at<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    bias: &Tensor<F>,
    pd: &Tensor<F>,
    mask: &Tensor<u32>,
    seq: &Tensor<i32>,
    grad: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    b: usize,
    h: usize,
    i: usize,
    j: usize,
    offset: i32,
    before: i32,
    after: i32,
    group: u32,
    scale: f32,
    softcap: f32,
    #[comptime] d_k: usize,
    #[comptime] d_v: usize,
    #[comptime] has_bias: bool,
    #[comptime] has_pd: bool,
    #[comptime] has_mask: bool,
    #[comptime] has_seq: bool,
) -> f32 {
    let heads = q.shape(1);
    let queries = q.shape(2);
    let own = i as i32 + offset;
    let key = j as i32;
    let mut visible = key >= own - before && key <= own + after;
    if has_seq {
        let at = b * seq.stride(0) + i * seq.stride(2);
        visible = visible && key >= seq[at] && key < seq[at + seq.stride(3)];
    }
    let mut ds = 0.0f32;
    if visible {
        let hk = h / group as usize;
        let q_at = b * q.stride(0) + h * q.stride(1) + i * q.stride(2);
        let k_at = b * k.stride(0) + hk * k.stride(1) + j * k.stride(2);
        let mut s = 0.0f32;
        #[unroll]
        for d in 0..d_k {
            s += f32::cast_from(q[q_at + d * q.stride(3)])
                * scale
                * f32::cast_from(k[k_at + d * k.stride(3)]);
        }
        let s = masked(
            capped(s, softcap),
            j,
            bias,
            b * bias.stride(0) + h * bias.stride(1) + i * bias.stride(2),
            pd,
            pd_start(pd, h, i, queries),
            mask,
            b * mask.stride(0) + h * mask.stride(1) + i * mask.stride(2),
            has_bias,
            has_pd,
            has_mask,
        );
        let row = (b * heads + h) * queries + i;
        let p = (s - lse[row]).exp();
        let g_at = b * grad.stride(0) + h * grad.stride(1) + i * grad.stride(2);
        let v_at = b * v.stride(0) + hk * v.stride(1) + j * v.stride(2);
        let mut dp = 0.0f32;
        #[unroll]
        for d in 0..d_v {
            dp += f32::cast_from(grad[g_at + d * grad.stride(3)])
                * f32::cast_from(v[v_at + d * v.stride(3)]);
        }
        ds = p * (dp - delta[row]);
    }
    ds
}

/// Sums of dS per element of the bias (`mode` [`BIAS`]: over the axes it broadcasts
/// along) or of the bias by distance ([`DISTANCE`]: element `(h, c)` over every query `i`
/// of every batch row with key `i + c - (Tq - 1)`): unit `e` of the grid's `x`, `y` sums
/// the `chunk` scores `CUBE_POS_Z · chunk ..` of its `reduced` into `partial[z, e]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn dsum_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    bias: &Tensor<F>,
    pd: &Tensor<F>,
    mask: &Tensor<u32>,
    seq: &Tensor<i32>,
    grad: &Tensor<F>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    partial: &mut Tensor<f32>,
    offset: i32,
    before: i32,
    after: i32,
    group: u32,
    scale: f32,
    softcap: f32,
    elements: u32,
    chunk: u32,
    reduced: u32,
    #[comptime] mode: u32,
    #[comptime] d_k: usize,
    #[comptime] d_v: usize,
    #[comptime] has_bias: bool,
    #[comptime] has_pd: bool,
    #[comptime] has_mask: bool,
    #[comptime] has_seq: bool,
    #[define(F)] _dtype: ElemType,
) {
    let e = ((CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * UNITS as u32 + UNIT_POS_X) as usize;
    if e < elements as usize {
        let (batch, heads, queries, keys) = (q.shape(0), q.shape(1), q.shape(2), k.shape(2));
        let start = CUBE_POS_Z * chunk;
        let end = min(start + chunk, reduced);
        let mut sum = 0.0f32;
        if mode == BIAS {
            // The element's index along each axis of the bias, and the sizes of the axes
            // it broadcasts along (1 elsewhere).
            let (sb, sh, sq, sk) = (bias.shape(0), bias.shape(1), bias.shape(2), bias.shape(3));
            let j0 = e % sk;
            let i0 = (e / sk) % sq;
            let h0 = (e / (sk * sq)) % sh;
            let b0 = e / (sk * sq * sh);
            let mut ob = 1usize;
            let mut oh = 1usize;
            let mut oq = 1usize;
            let mut ok = 1usize;
            if sb == 1 {
                ob = batch;
            }
            if sh == 1 {
                oh = heads;
            }
            if sq == 1 {
                oq = queries;
            }
            if sk == 1 {
                ok = keys;
            }
            for r in start..end {
                let r = r as usize;
                let j = j0 + r % ok;
                let i = i0 + (r / ok) % oq;
                let h = h0 + (r / (ok * oq)) % oh;
                let b = b0 + (r / (ok * oq * oh)) % ob;
                sum += ds_at(
                    q, k, v, bias, pd, mask, seq, grad, lse, delta, b, h, i, j, offset, before,
                    after, group, scale, softcap, d_k, d_v, has_bias, has_pd, has_mask, has_seq,
                );
            }
        } else {
            let columns = queries + keys - 1;
            let h = e / columns;
            let c = (e % columns) as i32;
            for r in start..end {
                let b = r as usize / queries;
                let i = r as usize % queries;
                let j = i as i32 + c - (queries as i32 - 1);
                if j >= 0 && j < keys as i32 {
                    sum += ds_at(
                        q, k, v, bias, pd, mask, seq, grad, lse, delta, b, h, i, j as usize,
                        offset, before, after, group, scale, softcap, d_k, d_v, has_bias, has_pd,
                        has_mask, has_seq,
                    );
                }
            }
        }
        partial[CUBE_POS_Z as usize * elements as usize + e] = sum;
    }
}

/// `sum[e] = Σ_s partial[s, e]`, in order, in the inputs' dtype: unit `e` of the grid's
/// `x`, `y`.
#[cube(launch)]
fn reduce_kernel<F: Float>(
    partial: &Tensor<f32>,
    sum: &mut Tensor<F>,
    #[define(F)] _dtype: ElemType,
) {
    let elements = sum.shape(3);
    let e = ((CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) * UNITS as u32 + UNIT_POS_X) as usize;
    if e < elements {
        let mut total = 0.0f32;
        for s in 0..partial.shape(2) {
            total += partial[s * elements + e];
        }
        sum[e] = F::cast_from(total);
    }
}
