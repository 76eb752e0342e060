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
    Inputs, Scoring, Sizes, UNITS, Variant, alloc, assert_contiguous, contiguous, optional, within,
};
use super::scores::{cap_slope, capped, masked, stage, stage_rows};

/// The gradients `[dQ, dK, dV]` (f32, contiguous, of the query's, key's and value's
/// shapes) of attention over `inputs` under `scoring`, from its output `out` and
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
) -> [Handle; 3] {
    let [q, k, v] = &inputs.qkv;
    let n = Sizes::of([q, k, v]);
    let out_shape = [n.batch, n.heads, n.queries, n.d_v];
    let row_shape = [n.batch, n.heads, n.queries, 1];
    assert_contiguous("output", out, out_shape);
    assert_contiguous("log-sum-exp", lse, row_shape);
    let [offset, before, after] = n.band(scoring.band);
    let variant = Variant::new(n.d_k, n.d_v, inputs.bias.is_some(), inputs.mask.is_some());
    let dq_shape = [n.batch, n.heads, n.queries, n.d_k];
    let dk_shape = [n.batch, n.kv_heads, n.keys, n.d_k];
    let dv_shape = [n.batch, n.kv_heads, n.keys, n.d_v];
    let delta = alloc(client, row_shape);
    let [dq, dk, dv] = [dq_shape, dk_shape, dv_shape].map(|shape| alloc(client, shape));
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
    );
    dq_kernel::launch(
        client,
        query_cubes,
        cube_dim,
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        optional(client, inputs.bias.as_ref()),
        optional(client, inputs.mask.as_ref()),
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
        variant.mask,
    );
    dkv_kernel::launch(
        client,
        key_cubes,
        cube_dim,
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        optional(client, inputs.bias.as_ref()),
        optional(client, inputs.mask.as_ref()),
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
        variant.mask,
    );
    [dq, dk, dv]
}

/// `delta[row] = Σ_d grad[row, d] · out[row, d]`: one unit per query row, query rows
/// `CUBE_POS_X · UNITS ..` of head `CUBE_POS_Y`.
#[cube(launch)]
fn delta_kernel(
    out: &Tensor<f32>,
    grad: &Tensor<f32>,
    delta: &mut Tensor<f32>,
    #[comptime] d_v: usize,
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
            sum += grad[g_at + d * grad.stride(3)] * out[o_at + d];
        }
        delta[bh * queries + row] = sum;
    }
}

/// `dQ`, queries outer: query rows `CUBE_POS_X · UNITS ..` of head `CUBE_POS_Y` (`b · H +
/// h`), one per unit, over the key/value tiles they see. The arguments after the tensors
/// are the forward kernel's.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn dq_kernel(
    q: &Tensor<f32>,
    k: &Tensor<f32>,
    v: &Tensor<f32>,
    bias: &Tensor<f32>,
    mask: &Tensor<u32>,
    grad: &Tensor<f32>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dq: &mut Tensor<f32>,
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
    let q0 = CUBE_POS_X as usize * UNITS;
    let row = q0 + unit;
    let live = row < queries;
    let last = min(q0 + UNITS, queries) - 1;

    let tk = keys as i32;
    let lo_cube = max(q0 as i32 + offset - before, 0i32);
    let hi_cube = min(last as i32 + offset + after + 1, tk);
    let own = row as i32 + offset;
    let lo = max(own - before, 0i32);
    let hi = min(own + after + 1, tk);

    // The row's scaled query, output gradient, log-sum-exp and D (a dead unit reads the
    // last row and writes nothing).
    let q_row = min(row, queries - 1);
    let q_at = b * q.stride(0) + h * q.stride(1) + q_row * q.stride(2);
    let g_at = b * grad.stride(0) + h * grad.stride(1) + q_row * grad.stride(2);
    let mut query = Array::<f32>::new(d_k);
    let mut acc = Array::<f32>::new(d_k);
    #[unroll]
    for d in 0..d_k {
        query[d] = q[q_at + d * q.stride(3)] * scale;
        acc[d] = 0.0f32;
    }
    let mut d_out = Array::<f32>::new(d_v);
    #[unroll]
    for d in 0..d_v {
        d_out[d] = grad[g_at + d * grad.stride(3)];
    }
    let row_lse = lse[bh * queries + q_row];
    let row_delta = delta[bh * queries + q_row];

    let mut k_tile = Shared::<[f32]>::new_slice(kt * d_k);
    let mut v_tile = Shared::<[f32]>::new_slice(kt * d_v);
    let k_at = b * k.stride(0) + hk * k.stride(1);
    let v_at = b * v.stride(0) + hk * v.stride(1);
    let bias_at = b * bias.stride(0) + h * bias.stride(1) + q_row * bias.stride(2);
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
                    mask,
                    mask_at,
                    has_bias,
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
            dq[at + d] = acc[d] * scale;
        }
    }
}

/// `dK` and `dV`, keys outer: key rows `CUBE_POS_X · UNITS ..` of key/value head
/// `CUBE_POS_Y` (`b · Hkv + hk`), one per unit, over the query tiles of each query head
/// of the group in turn. The arguments after the tensors are the forward kernel's.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn dkv_kernel(
    q: &Tensor<f32>,
    k: &Tensor<f32>,
    v: &Tensor<f32>,
    bias: &Tensor<f32>,
    mask: &Tensor<u32>,
    grad: &Tensor<f32>,
    lse: &Tensor<f32>,
    delta: &Tensor<f32>,
    dk: &mut Tensor<f32>,
    dv: &mut Tensor<f32>,
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
    #[comptime] has_mask: bool,
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

    // The queries that see the cube's keys between them, and this key's own: query `i`
    // sees key `j` when `i + offset - before <= j <= i + offset + after`.
    let tq = queries as i32;
    let lo_cube = max(k0 as i32 - offset - after, 0i32);
    let hi_cube = min(last as i32 - offset + before + 1, tq);
    let lo = max(key as i32 - offset - after, 0i32);
    let hi = min(key as i32 - offset + before + 1, tq);

    // The key's own key and value rows (a dead unit reads the last key and writes nothing).
    let k_row = min(key, keys - 1);
    let k_at = b * k.stride(0) + hk * k.stride(1) + k_row * k.stride(2);
    let v_at = b * v.stride(0) + hk * v.stride(1) + k_row * v.stride(2);
    let mut own_k = Array::<f32>::new(d_k);
    let mut acc_k = Array::<f32>::new(d_k);
    #[unroll]
    for d in 0..d_k {
        own_k[d] = k[k_at + d * k.stride(3)];
        acc_k[d] = 0.0f32;
    }
    let mut own_v = Array::<f32>::new(d_v);
    let mut acc_v = Array::<f32>::new(d_v);
    #[unroll]
    for d in 0..d_v {
        own_v[d] = v[v_at + d * v.stride(3)];
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
                        mask,
                        mask_head + i as usize * mask.stride(2),
                        has_bias,
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
            dk[k_out + d] = acc_k[d];
        }
        let v_out = (bhk * keys + key) * d_v;
        #[unroll]
        for d in 0..d_v {
            dv[v_out + d] = acc_v[d];
        }
    }
}
