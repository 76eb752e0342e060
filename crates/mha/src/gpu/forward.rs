//! The portable forward pass: a cube of [`UNITS`] units owns as many query rows of one
//! head, one row per unit; it walks the key/value tiles its rows see between them, each
//! tile staged in shared memory by every unit of the cube, and each unit keeps its row's
//! running maximum, sum and output in registers (online softmax, f32). It writes the
//! output `[B, H, Tq, Dv]` and the log-sum-exp `[B, H, Tq]` of every row.
//!
//! Per tile a unit loops over the keys of its own interval twice (scores, then weights
//! into the output): its loop iterations grow with the keys it sees, about two per key,
//! and not with the head dims, whose loops are unrolled. Under lavapipe's cap of 65,535
//! loop iterations per invocation, a row may therefore see about 32,000 keys.

use cubecl::client::Client;
use cubecl::prelude::*;
use cubecl::server::Handle;

use super::launch::{Inputs, Scoring, Sizes, UNITS, Variant, alloc, contiguous, optional, within};
use super::scores::{capped, intervals, masked, pd_start, stage};
use crate::mask::DEAD_LSE;

/// Below every score, blocked ones included: the running maximum before any key.
const NO_MAX: f32 = -3.0e38;

/// The output `[B, H, Tq, Dv]` (in the inputs' dtype) and the log-sum-exp `[B, H, Tq]`
/// (f32), both contiguous, of attention over `inputs` under `scoring`; query head `h`
/// reads key/value head `h / (H / Hkv)`. A row that sees no key, or only blocked ones
/// (its largest score at or below the dtype's dead-row sentinel), gets zeros and the
/// log-sum-exp [`DEAD_LSE`].
///
/// # Panics
/// If the shapes disagree or the sizes pass `i32`.
pub(crate) fn forward(client: &Client, inputs: &Inputs, scoring: Scoring) -> (Handle, Handle) {
    let [q, k, v] = &inputs.qkv;
    let n = Sizes::of([q, k, v]);
    let [offset, before, after] = n.band(scoring.band);
    let variant = Variant::of(&n, inputs);
    let out_shape = [n.batch, n.heads, n.queries, n.d_v];
    let lse_shape = [n.batch, n.heads, n.queries, 1];
    let (out, lse) = (
        alloc(client, out_shape, inputs.size),
        alloc(client, lse_shape, 4),
    );
    let cube_count = CubeCount::Static(
        within(n.queries.div_ceil(UNITS)) as u32,
        within(n.batch * n.heads) as u32,
        1,
    );
    forward_kernel::launch(
        client,
        cube_count,
        CubeDim::new_1d(UNITS as u32),
        q.clone().into_tensor_arg(),
        k.clone().into_tensor_arg(),
        v.clone().into_tensor_arg(),
        optional(client, inputs.bias.as_ref()),
        optional(client, inputs.pd.as_ref()),
        optional(client, inputs.mask.as_ref()),
        optional(client, inputs.seq.as_ref()),
        contiguous(out_shape, &out),
        contiguous(lse_shape, &lse),
        offset,
        before,
        after,
        n.group(),
        scoring.scale,
        scoring.softcap.unwrap_or(0.0),
        inputs.dead_row,
        variant.d_k,
        variant.d_v,
        variant.tile,
        variant.bias,
        variant.pd,
        variant.mask,
        variant.seq,
        inputs.elem,
    );
    (out, lse)
}

/// One cube: query rows `CUBE_POS_X · UNITS ..` of head `CUBE_POS_Y` (`b · H + h`), one
/// per unit. `offset`, `before`, `after`: the band of [`Band`](crate::mask::Band), with
/// every key as a bound larger than the problem; `group`: `H / Hkv`; `softcap`: 0 for none.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn forward_kernel<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    bias: &Tensor<F>,
    pd: &Tensor<F>,
    mask: &Tensor<u32>,
    seq: &Tensor<i32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    offset: i32,
    before: i32,
    after: i32,
    group: u32,
    scale: f32,
    softcap: f32,
    dead_row: f32,
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

    // The row's scaled query (a dead unit reads the last row and writes nothing).
    let q_row = min(row, queries - 1);
    // The keys the cube's rows see between them (each row's interval moves forward with
    // the row), and this row's own.
    let seen = intervals(
        seq, b, q0, last, q_row, keys, offset, before, after, has_seq,
    );
    let (lo_cube, hi_cube, lo, hi) = (seen.lo_cube, seen.hi_cube, seen.lo, seen.hi);
    let q_at = b * q.stride(0) + h * q.stride(1) + q_row * q.stride(2);
    let mut query = Array::<f32>::new(d_k);
    #[unroll]
    for d in 0..d_k {
        query[d] = f32::cast_from(q[q_at + d * q.stride(3)]) * scale;
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
            let mut tile_max = f32::new(NO_MAX);
            for key in start..end {
                let j = (key - t0) as usize;
                let mut s = 0.0f32;
                #[unroll]
                for d in 0..d_k {
                    s += query[d] * k_tile[j * d_k + d];
                }
                let s = masked(
                    capped(s, softcap),
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
        if row_max <= dead_row || sum <= 0.0f32 {
            #[unroll]
            for d in 0..d_v {
                out[o_at + d] = F::cast_from(0.0f32);
            }
            lse[bh * queries + row] = DEAD_LSE;
        } else {
            let inv = 1.0f32 / sum;
            #[unroll]
            for d in 0..d_v {
                out[o_at + d] = F::cast_from(acc[d] * inv);
            }
            lse[bh * queries + row] = row_max + sum.ln();
        }
    }
}
