//! What a call costs where there is next to nothing to compute (`--floor`): the part of
//! every measurement of the tables that does not depend on its shape. Each call at the
//! tiny shape (batch 2, 16 positions, width 32, 4 heads of 8) is timed two ways: synced
//! after each call, as the tables time every call (the median of the runs, after the
//! same warm-up), and queued, [`QUEUED`] calls issued before one sync, the results held
//! until then (milliseconds per call, the median of the runs). Synced, a call costs its
//! host's work, the device's work and one round trip to the device; queued, the host's
//! work overlaps the device's, which is how a training loop issues its calls.
//!
//! PyTorch's CUDA attention at the base shape takes 0.05 ms forward (an H200,
//! 2026-11-28), where mha's core took 1.01 ms through WGSL and its kernel 0.13 ms of
//! device time: how much of a measurement is the floor decides what a kernel can gain.

use burn::nn::attention::{
    MhaInput as BurnMhaInput, MultiHeadAttentionConfig as BurnMhaConfig,
    generate_autoregressive_mask,
};
use burn::tensor::{Device, FloatDType, Tensor};
use mha::{AttentionMask, MhaInput, ModuleDType, MultiHeadAttentionConfig, SdpaOptions};

use crate::{Outcome, backward_of, dtype_name, grads_of, queued, randn_as, time_synced};

/// Calls issued before one sync in a queued measurement.
const QUEUED: usize = 64;

/// Prints one row: `f` synced after each call ([`time_synced`]) and queued ([`queued`]).
fn row<O: Outcome>(
    what: &str,
    runs: usize,
    device: &Device,
    mut f: impl FnMut() -> O,
) -> anyhow::Result<()> {
    let synced = time_synced(runs, device, &mut f)?.ms;
    let queued = queued(runs, QUEUED, device, f)?;
    println!("| {what} | {synced:.3} | {queued:.3} |");
    Ok(())
}

/// Prints the floor of a call on `device` in `dtype` (see the module's docs).
pub fn print_floor(runs: usize, device: &Device, dtype: FloatDType) -> anyhow::Result<()> {
    let (b, t, d, h) = (2, 16, 32, 4);
    let ad = device.clone().autodiff();
    println!(
        "\n## floor (B {b}, T {t}, D {d}, H {h}) in {}, causal\n",
        dtype_name(dtype)
    );
    println!("| call | ms synced after each | ms per call, {QUEUED} queued before one sync |");
    println!("|---|---|---|");
    // Nothing but the sync: the round trip alone (queued, nothing is issued).
    row("sync alone", runs, device, || ())?;
    let x = randn_as(dtype, [b, t, d], device);
    row("one addition", runs, device, || x.clone() + 1.0)?;

    let causal = AttentionMask::causal();
    let sdpa = |q: &Tensor<4>| {
        let options = SdpaOptions::default();
        let (q, k, v) = (q.clone(), q.clone(), q.clone());
        mha::scaled_dot_product_attention(q, k, v, &causal, options).context
    };
    let heads = [b, h, t, d / h];
    let q = randn_as(dtype, heads, device);
    row("mha core, forward", runs, device, || sdpa(&q))?;
    let q = randn_as(dtype, heads, &ad).require_grad();
    row("mha core, forward+backward", runs, device, || {
        grads_of([&q], &sdpa(&q).sum().backward())
    })?;

    let config = MultiHeadAttentionConfig::new(d, h);
    let ours = config.init(device).to_dtype(dtype);
    row("mha, forward", runs, device, || {
        ours.forward(MhaInput::causal(x.clone())).context
    })?;
    let ours = config.init(&ad).to_dtype(dtype);
    let xa = randn_as(dtype, [b, t, d], &ad).require_grad();
    row("mha, forward+backward", runs, device, || {
        backward_of(
            &xa,
            ours.forward(MhaInput::causal(xa.clone())).context.sum(),
        )
    })?;

    let config = BurnMhaConfig::new(d, h).with_dropout(0.0);
    let theirs = config.init(device).to_dtype(dtype);
    let mask = generate_autoregressive_mask(b, t, device);
    row("Burn, forward", runs, device, || {
        let input = BurnMhaInput::self_attn(x.clone()).mask_attn(mask.clone());
        theirs.forward(input).context
    })?;
    let theirs = config.init(&ad).to_dtype(dtype);
    let mask = generate_autoregressive_mask(b, t, &ad);
    row("Burn, forward+backward", runs, device, || {
        let input = BurnMhaInput::self_attn(xa.clone()).mask_attn(mask.clone());
        backward_of(&xa, theirs.forward(input).context.sum())
    })
}
