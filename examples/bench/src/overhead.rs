//! What one call of a module costs around its kernels on a GPU backend (`--overhead`):
//! mha's `MultiHeadAttention` and Burn's built-in module at the same shape (causal
//! self-attention), forward and forward+backward, after two warm-up calls: the kernels
//! launched (all, and those that only copy or cast), the buffers and bytes the call
//! leaves allocated while its result is held, the host's time until the call returns
//! (before the device is done) and until the device is done. A call that reads a tensor
//! back to the host waits for the device inside it: its time to return is its whole time.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use burn::cubecl::logging::{LaunchObservation, LaunchObserver};
use burn::nn::attention::{
    MhaInput as BurnMhaInput, MultiHeadAttentionConfig as BurnMhaConfig,
    generate_autoregressive_mask,
};
use burn::tensor::{Device, FloatDType, Tensor};
use mha::{MhaInput, ModuleDType, MultiHeadAttentionConfig};

use crate::{Shape, dtype_name, randn_as};

/// Counts every kernel launched while installed, by name.
#[derive(Default)]
struct Launches(Mutex<BTreeMap<&'static str, usize>>);

impl LaunchObserver for Launches {
    fn launched(&self, kernel: &'static str) {
        *self.0.lock().unwrap().entry(kernel).or_default() += 1;
    }
}

/// One call's costs.
struct Cost {
    launches: usize,
    copies: usize,
    ours: usize,
    buffers: i64,
    bytes: i64,
    issue_ms: f64,
    total_ms: f64,
}

/// The costs of `call` (which returns what it keeps), after two warm-up calls.
fn cost<T>(device: &Device, call: impl Fn() -> T) -> anyhow::Result<Cost> {
    let sync = || device.sync().map_err(|e| anyhow::anyhow!("{e:?}"));
    for _ in 0..2 {
        drop(call());
        sync()?;
    }
    let before = device.memory_pool_usage().unwrap_or_default();
    let counts = Arc::new(Launches::default());
    let watching = LaunchObservation::new(counts.clone());
    let started = Instant::now();
    let kept = call();
    let issue_ms = started.elapsed().as_secs_f64() * 1e3;
    sync()?;
    let total_ms = started.elapsed().as_secs_f64() * 1e3;
    drop(watching);
    let after = device.memory_pool_usage().unwrap_or_default();
    drop(kept);
    let counts = counts.0.lock().unwrap().clone();
    let of = |parts: &[&str]| -> usize {
        counts
            .iter()
            .filter(|(name, _)| parts.iter().any(|p| name.contains(p)))
            .map(|(_, n)| n)
            .sum()
    };
    Ok(Cost {
        launches: counts.values().sum(),
        copies: of(&["copy", "contiguous", "cast", "into_contiguous"]),
        ours: of(&["mha::gpu"]),
        buffers: after.number_allocs as i64 - before.number_allocs as i64,
        bytes: after.bytes_in_use as i64 - before.bytes_in_use as i64,
        issue_ms,
        total_ms,
    })
}

/// Prints the costs of mha's and Burn's modules at `shape` in `dtype`, forward and
/// forward+backward.
pub fn print_overhead(device: &Device, shape: Shape, dtype: FloatDType) -> anyhow::Result<()> {
    let Shape {
        batch: b,
        seq: t,
        d_model: d,
        heads: h,
        ..
    } = shape;
    let ad = device.clone().autodiff();
    println!(
        "\n## overhead at {} (B {b}, T {t}, D {d}, H {h}) in {}, causal\n",
        shape.name,
        dtype_name(dtype)
    );
    println!(
        "| module | pass | launches | of which copies/casts | mha's kernels | live buffers after | MiB after | host ms to return | ms to finish |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let row = |module: &str, pass: &str, c: Cost| {
        println!(
            "| {module} | {pass} | {} | {} | {} | {} | {:.1} | {:.2} | {:.2} |",
            c.launches,
            c.copies,
            c.ours,
            c.buffers,
            c.bytes as f64 / (1 << 20) as f64,
            c.issue_ms,
            c.total_ms
        );
    };

    let mine = MultiHeadAttentionConfig::new(d, h)
        .init(device)
        .to_dtype(dtype);
    let x = randn_as(dtype, [b, t, d], device);
    row(
        "mha",
        "forward",
        cost(device, || mine.forward(MhaInput::causal(x.clone())).context)?,
    );
    let mine = MultiHeadAttentionConfig::new(d, h)
        .init(&ad)
        .to_dtype(dtype);
    let x = randn_as(dtype, [b, t, d], &ad).require_grad();
    row(
        "mha",
        "forward+backward",
        cost(device, || {
            mine.forward(MhaInput::causal(x.clone()))
                .context
                .sum()
                .backward()
        })?,
    );

    let config = BurnMhaConfig::new(d, h).with_dropout(0.0);
    let theirs = config.init(device).to_dtype(dtype);
    let x = randn_as(dtype, [b, t, d], device);
    let mask = generate_autoregressive_mask(b, t, device);
    row(
        "Burn",
        "forward",
        cost(device, || {
            theirs
                .forward(BurnMhaInput::self_attn(x.clone()).mask_attn(mask.clone()))
                .context
        })?,
    );
    let theirs = config.init(&ad).to_dtype(dtype);
    let x: Tensor<3> = randn_as(dtype, [b, t, d], &ad).require_grad();
    let mask = generate_autoregressive_mask(b, t, &ad);
    row(
        "Burn",
        "forward+backward",
        cost(device, || {
            theirs
                .forward(BurnMhaInput::self_attn(x.clone()).mask_attn(mask.clone()))
                .context
                .sum()
                .backward()
        })?,
    );
    Ok(())
}
