//! Times mha's `MultiHeadAttention` against Burn's built-in
//! `burn::nn::attention::MultiHeadAttention` on the same backend in the same run (causal
//! self-attention, forward and forward+backward), the attention core alone, a 2048 x 2048
//! matmul (the backend's ceiling), and the trainer's default model (tokens per second of
//! whole training steps, without the learner's metrics and validation).
//!
//! ```sh
//! cargo run --release -p bench                                   # flex, every shape
//! cargo run --release -p bench -- --shapes none --no-train --decode --window
//! cargo run --release -p bench --features ndarray,wgpu -- --backend ndarray --backend wgpu
//! cargo run --release -p bench -- --shapes base --runs 9 --json bench.json
//! ```
//!
//! Each number is the median of `--runs` timed runs after a warm-up: two runs, then more
//! for half a second where the second is short (a decoding step, which fills a cache,
//! after one run only); the device is synchronised after each run, so GPU numbers include
//! the kernels, not only their launch. With `--queued` each call of 2 s or less is also
//! timed queued (not a step over a cache, which each call changes, the window's, nor the
//! trainer's; the decoding step recomputed and the core alone in one are): batches of calls issued back to
//! back before one sync (enough to keep the device busy for 25 ms, 2 to 64 calls), the
//! median per call, in a second table and as `queued_ms` in the JSON; on a GPU the synced
//! time holds one round trip to the device.
//! The first run's result and the last run's are read
//! back (outside the timings), and held until the device is done (a dropped tensor is
//! work Burn's fusion may skip): an attention measurement whose call the device did not
//! complete, or whose result is not finite, is `failed` in the tables (in the JSON its
//! `failed` field holds the reason and its median is null), not timed, and the others are
//! still measured; the process then exits with an error. Any other measurement that fails stops the run with its reason.
//! Ratios are "Burn's built-in time / mha's time", measured back to back. GFLOP/s count
//! the useful work of causal attention: the four projections (`8·B·T·D²`) and the two
//! attention products over the visible half of the scores (`2·B·T²·D`), forward; a
//! backward counts twice the forward.
//!
//! `bench train ARGS` is the trainer (`cargo run -p train -- ARGS`), so that one binary
//! carries both to a GPU machine without a toolchain (`scripts/gpu_table.sh --trainer`).
//!
//! `--decode` adds the cost of one decoding step with mha's cache, by recomputing the
//! prefix, and with Burn's `MhaCache`; `--window` adds sliding-window attention against
//! full causal attention at long lengths, time and peak memory (see `decode.rs`);
//! `--prune` adds attention pruned to fewer heads against the full module (`prune.rs`);
//! `--llama` a Llama-family language model through `mha::hf`, a forward and a decoding
//! step (`llama.rs`; `scripts/bench_hf.py` runs it beside transformers); `--floor` what
//! a call costs where there is next to nothing to compute, synced after each call and
//! queued (`floor.rs`).

mod decode;
mod floor;
mod llama;
#[cfg(feature = "wgpu")]
mod overhead;
mod prune;
mod variants;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use burn::data::dataloader::batcher::Batcher;
use burn::nn::attention::{
    MhaInput as BurnMhaInput, MultiHeadAttentionConfig as BurnMhaConfig,
    generate_autoregressive_mask,
};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, Distribution, FloatDType, Tensor};
use clap::Parser;
use mha::{AttentionMask, MhaInput, ModuleDType, MultiHeadAttentionConfig, SdpaOptions};
use serde::Serialize;
use train::backend::Backend;
use train::batch::SeqBatcher;
use train::config::TrainConfig;
use train::tasks::Split;

/// mimalloc keeps freed memory for the next allocation (and, told so by
/// `keep_freed_memory`, never gives it back); the system allocator (glibc) unmaps tensors
/// of a few MB when they are freed, and every step faults them in again (see
/// docs/benchmarks.md, "The system allocator": `--no-default-features` builds without it).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Time mha's attention against Burn's built-in attention, and the trainer's throughput.
#[derive(Parser, Debug)]
#[command(
    version,
    about,
    after_help = "`bench train [ARGS]` runs the trainer instead (`train [ARGS]`; `bench train --help`)."
)]
struct Cli {
    /// Backends to time, among those compiled in (repeatable) [default: every one].
    #[arg(long, value_enum)]
    backend: Vec<Backend>,
    /// Shapes, comma-separated: tiny (2,16,32,4), small (32,128,256,8), base
    /// (8,512,512,8), long (1,4096,512,8), as (B, T, D, H), or any `BxTxDxH` (e.g.
    /// `1x1024x256x4`); `none` for none.
    #[arg(long, value_delimiter = ',', default_value = "small,base,long")]
    shapes: Vec<String>,
    /// Timed runs per measurement (the median is reported); a measurement whose second
    /// warm-up run (a decoding step's only one) takes over 2 s uses at most 3.
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Skip Burn's built-in attention.
    #[arg(long)]
    no_builtin: bool,
    /// Skip the trainer's steps.
    #[arg(long)]
    no_train: bool,
    /// Training steps timed for the trainer's throughput.
    #[arg(long, default_value_t = 20)]
    train_steps: usize,
    /// Also time one decoding step: mha's cache, recomputing the prefix, Burn's MhaCache,
    /// at the positions of `--decode-at`, batch 1 and 8.
    #[arg(long)]
    decode: bool,
    /// Also time the attention core alone in a decoding step, at the positions of
    /// `--decode-at`, batch 1 and 8: 1, 4, 8 and 16 queries (16 is past the decoding
    /// kernels' bound: the tiled forward), with 8 query heads over 8 and over 2 key/value
    /// heads (GQA).
    #[arg(long)]
    decode_core: bool,
    /// Positions of `--decode`'s and `--decode-core`'s steps, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = decode::CONTEXTS)]
    decode_at: Vec<usize>,
    /// Also time sliding-window attention (window 256) against full causal attention at
    /// 4096 and 16384 positions, with peak memory.
    #[arg(long)]
    window: bool,
    /// Also time attention pruned to 6, 4 and 2 of its 8 heads against the full module,
    /// at the base shape.
    #[arg(long)]
    prune: bool,
    /// Also time a 2-layer Llama-family model through `mha::hf` (width 512, 8 query heads
    /// and 2 key/value heads): the forward of 512 tokens, one decoding step after 512.
    #[arg(long)]
    llama: bool,
    /// Float dtypes of the attention measurements, comma-separated: f32, f16, bf16 (a
    /// backend that does not compute in one is skipped for it, saying so).
    #[arg(long, value_delimiter = ',', default_value = "f32")]
    dtype: Vec<String>,
    /// Also time the causal attention core alone, forward+backward, at this many
    /// positions (batch 1, 8 heads of 64), in each dtype, first in the process, with the
    /// device's peak memory (GPU backends: the memory pool's peak, given for the first
    /// dtype only, whose measurement is the process's first).
    #[arg(long)]
    long_core: Option<usize>,
    /// Instead of timing the shapes, print what one call of mha's module and of Burn's
    /// costs around its kernels at each shape and dtype (GPU backends): launches, buffers,
    /// the host's time, and the device's time kernel by kernel.
    #[cfg(feature = "wgpu")]
    #[arg(long)]
    overhead: bool,
    /// Also time what a call costs where there is next to nothing to compute, in each
    /// dtype: a sync alone, one addition, mha's core, mha's module and Burn's at the tiny
    /// shape, forward and forward+backward, each synced after every call (as the tables
    /// time them) and 64 queued before one sync.
    #[arg(long)]
    floor: bool,
    /// With `--long-core`, also print where one of its calls spends the device's time,
    /// kernel by kernel (GPU backends).
    #[cfg(feature = "wgpu")]
    #[arg(long)]
    core_kernels: bool,
    /// Also time, at each shape and dtype, mha's attention core between input
    /// projections made otherwise than the module's: three `Linear` layers of their own
    /// (`core+linear`), and one to Q, K and V whose output is cut in three (`core+qkv`);
    /// and the core alone on inputs laid out as the module's projections give them, `[B,
    /// T, H, Dh]` in memory (`core-bthd`). Nothing is timed with `--overhead`.
    #[arg(long)]
    variants: bool,
    /// Also time each call of 2 s or less queued (not a step over a cache, which each call
    /// changes, the window's, nor the trainer's; the decoding step recomputed and the core
    /// alone in one are):
    /// calls issued back to back before one sync, as a training loop issues them, enough
    /// of them to keep the device busy for 25 ms (2 to 64); the median per call over
    /// `--runs` such batches, beside the synced time (a second table, and `queued_ms` in
    /// the JSON). On a GPU the synced time holds one round trip to the device per call.
    #[arg(long)]
    queued: bool,
    /// Also write every measurement to this JSON file (rewritten whole after each
    /// shape and each trainer measurement, so that a run stopped midway keeps what it measured).
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The name of `dtype` in the tables and the JSON.
fn dtype_name(dtype: FloatDType) -> &'static str {
    match dtype {
        FloatDType::F64 => "f64",
        FloatDType::F16 => "f16",
        FloatDType::BF16 => "bf16",
        _ => "f32",
    }
}

/// One forward+backward of the causal attention core at `seq` positions (batch 1, 8
/// heads of 64) in `dtype`, on inputs made once: the gradients of Q, K and V.
fn long_core(device: &Device, (seq, dtype): (usize, FloatDType)) -> impl Fn() -> [Tensor<4>; 3] {
    let ad = device.clone().autodiff();
    let dims = [1, 8, seq, 64];
    let grad = || randn(dims, &ad).cast(dtype).require_grad();
    let (q, k, v) = (grad(), grad(), grad());
    let causal = AttentionMask::causal();
    move || {
        let options = SdpaOptions::default();
        let out =
            mha::scaled_dot_product_attention(q.clone(), k.clone(), v.clone(), &causal, options);
        let grads = out.context.sum().backward();
        grads_of([&q, &k, &v], &grads)
    }
}

/// The causal attention core alone at `seq` positions (batch 1, 8 heads of 64),
/// forward+backward in `dtype`, with the device's peak memory where it reports one and
/// the measurement is the process's first (`first`): the memory pool's peak is the most
/// it ever held, the earlier measurements' buffers included (on an H200, 2026-11-28,
/// the core at 16,384 positions in f16 reported 1807 MiB measured after Burn's module at
/// 4096 positions, 140 MiB in a process without Burn's module).
fn bench_long_core(
    cli: &Cli,
    backend: Backend,
    device: &Device,
    (seq, dtype): (usize, FloatDType),
    first: bool,
    out: &mut Vec<Record>,
) {
    let call = long_core(device, (seq, dtype));
    let timed = time_synced(cli.runs.min(3), device, &call);
    // The peak before the queued batches, which hold several calls' gradients at once.
    let peak_mib = device.memory_pool_report().filter(|_| first).map(|pools| {
        let bytes: u64 = pools.iter().map(|p| p.pages_peak * p.page_size).sum();
        bytes as f64 / (1 << 20) as f64
    });
    let timed = timed.map(|t| queued_too(t, device, &call, queue_asked()));
    if !first {
        eprintln!(
            "{backend}: the core at {seq} positions in {}: no peak memory (an earlier \
             measurement's is in the process's; measure one dtype a process)",
            dtype_name(dtype)
        );
    }
    let shape = Shape {
        name: "long-core",
        batch: 1,
        seq,
        d_model: 512,
        heads: 8,
    };
    let flops = 3.0 * shape.core_flops();
    let at = (shape, dtype);
    out.push(Record {
        batch: Some(1),
        context: Some(seq),
        peak_mib,
        heads: Some(8),
        ..Record::attention(
            backend.name(),
            at,
            "mha-core",
            "forward+backward",
            timed,
            flops,
        )
    });
}

/// Where one call of the causal core at `seq` positions (as [`bench_long_core`]) spends
/// the device's time, kernel by kernel (`--core-kernels`).
#[cfg(feature = "wgpu")]
fn print_core_kernels(
    backend: Backend,
    device: &Device,
    (seq, dtype): (usize, FloatDType),
) -> anyhow::Result<()> {
    let one = overhead::breakdown(device, long_core(device, (seq, dtype)))?;
    println!(
        "\n## {backend}: the causal core at {seq} positions in {}, kernel by kernel",
        dtype_name(dtype)
    );
    overhead::print_breakdowns(&[("core", "forward+backward", one)]);
    Ok(())
}

/// An attention shape: batch, sequence length, model width, heads.
#[derive(Clone, Copy, Debug, Serialize)]
struct Shape {
    name: &'static str,
    batch: usize,
    seq: usize,
    d_model: usize,
    heads: usize,
}

const SHAPES: [Shape; 4] = [
    Shape {
        name: "tiny",
        batch: 2,
        seq: 16,
        d_model: 32,
        heads: 4,
    },
    Shape {
        name: "small",
        batch: 32,
        seq: 128,
        d_model: 256,
        heads: 8,
    },
    Shape {
        name: "base",
        batch: 8,
        seq: 512,
        d_model: 512,
        heads: 8,
    },
    Shape {
        name: "long",
        batch: 1,
        seq: 4096,
        d_model: 512,
        heads: 8,
    },
];

impl Shape {
    /// Forward FLOPs of causal multi-head attention (see the crate docs).
    fn mha_flops(self) -> f64 {
        let (b, t, d) = (self.batch as f64, self.seq as f64, self.d_model as f64);
        8.0 * b * t * d * d + self.core_flops()
    }

    /// Forward FLOPs of the causal attention core alone.
    fn core_flops(self) -> f64 {
        let (b, t, d) = (self.batch as f64, self.seq as f64, self.d_model as f64);
        2.0 * b * t * t * d
    }
}

/// One measurement.
#[derive(Debug, Serialize)]
struct Record {
    backend: &'static str,
    shape: Option<Shape>,
    /// `mha`, `burn` (built-in), `mha-core`, `core+linear`, `core+qkv`, `core-bthd`
    /// (`--variants`), `matmul-2048` or `trainer`.
    subject: &'static str,
    /// `forward`, `forward+backward` or `train-step`.
    pass: &'static str,
    /// The median milliseconds of a call, the device synced after each; for the trainer's
    /// `train-step` rows, the mean of `runs` steps issued one after another with one sync
    /// at the end (its throughput, as training runs).
    median_ms: f64,
    /// The calls timed (the trainer's: its steps).
    runs: usize,
    /// The median milliseconds per call queued (`--queued`): `queued_calls` calls issued
    /// before one sync.
    #[serde(skip_serializing_if = "Option::is_none")]
    queued_ms: Option<f64>,
    /// The calls of each queued batch.
    #[serde(skip_serializing_if = "Option::is_none")]
    queued_calls: Option<usize>,
    /// Why the queued batches have no time (the synced one stands).
    #[serde(skip_serializing_if = "Option::is_none")]
    queued_failed: Option<String>,
    gflops: Option<f64>,
    tokens_per_second: Option<f64>,
    /// Batch of the decoding and window measurements.
    #[serde(skip_serializing_if = "Option::is_none")]
    batch: Option<usize>,
    /// Positions of the decoding and window measurements.
    #[serde(skip_serializing_if = "Option::is_none")]
    context: Option<usize>,
    /// Peak resident memory above what the process held before, MiB.
    #[serde(skip_serializing_if = "Option::is_none")]
    peak_mib: Option<f64>,
    /// Heads kept, in the pruning measurements.
    #[serde(skip_serializing_if = "Option::is_none")]
    heads: Option<usize>,
    /// The float dtype of the attention measurements (`f32`, `f16`, `bf16`).
    #[serde(skip_serializing_if = "Option::is_none")]
    dtype: Option<&'static str>,
    /// Why the measurement has no time (its median is then not a number, `null` in the
    /// JSON): the device did not complete the call, or its result was not finite.
    #[serde(skip_serializing_if = "Option::is_none")]
    failed: Option<String>,
}

impl Record {
    /// A measurement of `subject`'s `pass`: the times `timed`, nothing else (the callers
    /// add what they know, `..Record::new(..)`).
    fn new(backend: &'static str, subject: &'static str, pass: &'static str, timed: Timed) -> Self {
        Record {
            backend,
            shape: None,
            subject,
            pass,
            median_ms: timed.ms,
            runs: timed.runs,
            queued_ms: timed
                .queued
                .as_ref()
                .and_then(|q| q.as_ref().ok())
                .map(|q| q.ms),
            queued_calls: timed
                .queued
                .as_ref()
                .and_then(|q| q.as_ref().ok())
                .map(|q| q.calls),
            queued_failed: timed.queued.and_then(Result::err),
            gflops: None,
            tokens_per_second: None,
            batch: None,
            context: None,
            peak_mib: None,
            heads: None,
            dtype: None,
            failed: None,
        }
    }

    /// A measurement of attention at `shape` in `dtype`: the times `timed`, for `flops` of
    /// work, or why there are none (written to the standard error too).
    fn attention(
        backend: &'static str,
        (shape, dtype): (Shape, FloatDType),
        subject: &'static str,
        pass: &'static str,
        timed: anyhow::Result<Timed>,
        flops: f64,
    ) -> Self {
        let (timed, failed) = match timed {
            Ok(timed) => (timed, None),
            Err(e) => {
                eprintln!(
                    "{backend}: {subject} {pass} at {} in {}: failed: {e:#}",
                    shape.name,
                    dtype_name(dtype)
                );
                let none = Timed {
                    ms: f64::NAN,
                    runs: 0,
                    queued: None,
                };
                (none, Some(format!("{e:#}")))
            }
        };
        Record {
            shape: Some(shape),
            gflops: failed.is_none().then(|| flops / timed.ms / 1e6),
            dtype: Some(dtype_name(dtype)),
            failed,
            ..Record::new(backend, subject, pass, timed)
        }
    }

    /// A table's cell: the median milliseconds to `decimals` places, or `failed`.
    fn ms(&self, decimals: usize) -> String {
        match self.failed {
            Some(_) => "failed".into(),
            None => format!("{:.*}", decimals, self.median_ms),
        }
    }

    /// A table's cell: the median milliseconds per call queued and the calls of a batch,
    /// `failed` (the call, or its queued batches), or `—` where not queued.
    fn queued_cell(&self) -> String {
        match (
            &self.failed,
            &self.queued_failed,
            self.queued_ms,
            self.queued_calls,
        ) {
            (Some(_), ..) | (None, Some(_), ..) => "failed".into(),
            (None, None, Some(ms), Some(calls)) => format!("{ms:.2} ({calls})"),
            _ => "—".into(),
        }
    }

    /// A table's cell: the median milliseconds and the GFLOP/s, or `failed`.
    fn ms_gflops(&self) -> String {
        match self.failed {
            Some(_) => "failed".into(),
            None => format!("{:.1} ({:.0})", self.median_ms, self.gflops.unwrap_or(0.0)),
        }
    }
}

/// What a timed call returns: the tensors of its result, which [`time`] reads back after
/// the warm-up run and after the last timed run (outside the timings). A GPU backend
/// reports a call it could not complete (an allocation refused, a kernel that failed)
/// only when a result is read, and syncing says nothing: without this a call that did
/// none of its work would be given a time.
pub trait Outcome {
    /// Reads the result back: an error if the device did not complete the call, or if a
    /// value is not finite.
    fn check(self) -> anyhow::Result<()>;
}

/// Nothing to read back (a sync alone, `--floor`).
impl Outcome for () {
    fn check(self) -> anyhow::Result<()> {
        Ok(())
    }
}

impl<const D: usize> Outcome for Tensor<D> {
    fn check(self) -> anyhow::Result<()> {
        let values = self
            .try_into_vec_as::<f32>()
            .map_err(|e| anyhow::anyhow!("{}", one_line(&e.to_string())))?;
        let bad = values.iter().filter(|v| !v.is_finite()).count();
        anyhow::ensure!(
            bad == 0,
            "{bad} of the {} values of its result are not finite",
            values.len()
        );
        Ok(())
    }
}

impl<const D: usize, const N: usize> Outcome for [Tensor<D>; N] {
    fn check(self) -> anyhow::Result<()> {
        self.into_iter().try_for_each(Outcome::check)
    }
}

/// A call that may refuse (a full cache, say): its error, or its result's check.
impl<O: Outcome, E: std::error::Error + Send + Sync + 'static> Outcome for Result<O, E> {
    fn check(self) -> anyhow::Result<()> {
        self?.check()
    }
}

/// A backward's gradients, held, and what is read back of them.
impl<O: Outcome> Outcome for (burn::tensor::Gradients, O) {
    fn check(self) -> anyhow::Result<()> {
        self.1.check()
    }
}

/// A device error's text on one line: the error and its causes, without the notes on
/// backtraces and skipped operations that follow them.
fn one_line(text: &str) -> String {
    let mut parts = Vec::new();
    for line in text.lines().map(str::trim) {
        let frame = line
            .split_once(": ")
            .is_some_and(|(n, _)| n.parse::<u32>().is_ok());
        if frame || line.starts_with("No backtrace") || line.starts_with("stack backtrace") {
            break;
        }
        let note = line.starts_with("skipped `") || line.starts_with('(');
        if !(line.is_empty() || line == "Caused by:" || note) {
            parts.push(line);
        }
    }
    parts.join(": ")
}

/// The gradient of `x` in `grads`: what a forward+backward measurement reads back.
fn grad_of<const D: usize>(x: &Tensor<D>, grads: &burn::tensor::Gradients) -> Tensor<D> {
    x.grad(grads)
        .expect("the measured input requires its gradient")
}

/// What a module's forward+backward returns to be measured: every gradient (the
/// parameters' too, held until the device is done, as a training step holds them for its
/// optimizer) and the input's, read back.
fn backward_of<const D: usize>(
    x: &Tensor<D>,
    loss: Tensor<1>,
) -> (burn::tensor::Gradients, Tensor<D>) {
    let grads = loss.backward();
    let dx = grad_of(x, &grads);
    (grads, dx)
}

/// The gradients of each of `xs` in `grads`.
fn grads_of<const D: usize, const N: usize>(
    xs: [&Tensor<D>; N],
    grads: &burn::tensor::Gradients,
) -> [Tensor<D>; N] {
    xs.map(|x| grad_of(x, grads))
}

/// Waits for `device`; an error on one line ([`one_line`]).
fn sync(device: &Device) -> anyhow::Result<()> {
    device
        .sync()
        .map_err(|e| anyhow::anyhow!("{}", one_line(&e.to_string())))
}

/// How long the untimed calls before a measurement keep the device busy, past the first
/// (which compiles, tunes and allocates): a device that sat idle while the host compiled
/// for a new shape may run below its clocks at first. On an H200 (2026-11-28, one warm-up
/// call), mha's module, measured first at the long shape in f16, took 7.37 ms, where its
/// core between the same two products, measured later in the process, took 2.02; its
/// attention kernel's own device time was 3.27 ms in a forward measured first and 2.39
/// in the forward+backward measured next. The warm-up tells a slow kernel from a cold
/// device.
const WARM_UP: Duration = Duration::from_millis(500);

/// Calls `f` (syncing the device after each) for [`WARM_UP`], dropping each result once
/// the device is done.
fn keep_warm<O>(device: &Device, f: &mut impl FnMut() -> O) -> anyhow::Result<()> {
    let from = Instant::now();
    while from.elapsed() < WARM_UP {
        // Held until the device is done: Burn's fusion may skip the work of a tensor
        // dropped before.
        let result = f();
        sync(device)?;
        drop(result);
    }
    Ok(())
}

/// A measurement's times (see [`time`]).
#[derive(Clone, Debug)]
pub struct Timed {
    /// The median milliseconds of a call, the device synced after each.
    pub ms: f64,
    /// The timed runs.
    pub runs: usize,
    /// Queued, where `--queued` asks for it ([`QUEUE`]), or why the queued batches
    /// have no time.
    pub queued: Option<Result<Queued, String>>,
}

/// The time of a call queued: `calls` calls issued before one sync.
#[derive(Clone, Copy, Debug)]
pub struct Queued {
    /// The median milliseconds per call.
    pub ms: f64,
    /// Calls issued before each sync.
    pub calls: usize,
}

/// Whether [`time`] also times each call queued (`--queued`), set once before any
/// measurement.
static QUEUE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// How long the calls of one queued batch keep the device busy, in milliseconds, at
/// their synced time: long enough that one round trip is a small part of it.
const QUEUE_SPAN_MS: f64 = 25.0;

/// The fewest and the most calls of one queued batch.
const QUEUE_CALLS: (usize, usize) = (2, 64);

/// Calls of one queued batch of a call that takes `ms` synced: [`QUEUE_SPAN_MS`] of
/// them, within [`QUEUE_CALLS`].
fn queue_calls(ms: f64) -> usize {
    let (fewest, most) = QUEUE_CALLS;
    match ms > 0.0 {
        true => ((QUEUE_SPAN_MS / ms).ceil() as usize).clamp(fewest, most),
        false => most,
    }
}

/// Median milliseconds per call of `f` issued `calls` times before one sync, over `runs`
/// such batches, every result held until the sync, on a device already warm. The last
/// batch's results are read back ([`Outcome`]).
fn queued<O: Outcome>(
    runs: usize,
    calls: usize,
    device: &Device,
    mut f: impl FnMut() -> O,
) -> anyhow::Result<f64> {
    let mut samples = Vec::with_capacity(runs);
    for run in 0..runs {
        let started = Instant::now();
        let results: Vec<O> = (0..calls).map(|_| f()).collect();
        sync(device)?;
        samples.push(started.elapsed().as_secs_f64() * 1e3 / calls as f64);
        if run + 1 == runs {
            results
                .into_iter()
                .try_for_each(Outcome::check)
                .context("the last queued batch")?;
        }
    }
    samples.sort_by(f64::total_cmp);
    Ok(samples[samples.len() / 2])
}

/// Median milliseconds of `f` over `runs` runs after a warm-up, syncing the device: one
/// run (which compiles), then one more, then more for [`WARM_UP`] where that one took
/// under 2 s (else at most 3 timed runs). The first run's and the last run's results are
/// read back ([`Outcome`]), an error if the call did not complete or produced a value
/// that is not finite. Then [`queued_too`], where `--queued` asks ([`QUEUE`]).
fn time<O: Outcome>(
    runs: usize,
    device: &Device,
    mut f: impl FnMut() -> O,
) -> anyhow::Result<Timed> {
    let timed = timed(runs, device, true, &mut f)?;
    Ok(queued_too(timed, device, f, queue_asked()))
}

/// [`time`] without the queued batches: for a measurement that reads something the
/// batches would change first (a peak of memory: they hold several results at once),
/// then calls [`queued_too`].
fn time_synced<O: Outcome>(
    runs: usize,
    device: &Device,
    f: impl FnMut() -> O,
) -> anyhow::Result<Timed> {
    timed(runs, device, true, f)
}

/// Whether `--queued` asks for queued times ([`QUEUE`]).
fn queue_asked() -> bool {
    QUEUE.load(std::sync::atomic::Ordering::Relaxed)
}

/// The longest synced call that is also timed queued, in milliseconds: past it a round
/// trip to the device is nothing beside the call, and batches would take long.
const QUEUE_MOST_MS: f64 = 2000.0;

/// `timed` (a call's synced times, the device warm) with the call's queued time where
/// `queue` says and the call takes at most [`QUEUE_MOST_MS`]: `timed.runs` batches of
/// [`queue_calls`] calls ([`queued`]). Batches that fail (a result that is not finite,
/// memory refused for the results they hold) leave the synced time standing, with why
/// they failed (written to the standard error too).
fn queued_too<O: Outcome>(
    timed: Timed,
    device: &Device,
    f: impl FnMut() -> O,
    queue: bool,
) -> Timed {
    if !queue || timed.ms > QUEUE_MOST_MS {
        return timed;
    }
    let calls = queue_calls(timed.ms);
    let queued = queued(timed.runs, calls, device, f)
        .map(|ms| Queued { ms, calls })
        .map_err(|e| {
            eprintln!("the queued batches failed (the synced time stands): {e:#}");
            format!("{e:#}")
        });
    Timed {
        queued: Some(queued),
        ..timed
    }
}

/// [`time`] of a call that moves a state on (a decoding step, which fills a cache
/// position each time): after one warm-up run only (at most 3 timed runs where it took
/// over 2 s), so that the runs are the ones the caller made room for; never queued.
fn time_steps<O: Outcome>(
    runs: usize,
    device: &Device,
    f: impl FnMut() -> O,
) -> anyhow::Result<Timed> {
    timed(runs, device, false, f)
}

/// The synced times of [`time`], with the warm-up past the first run where `keep` says.
fn timed<O: Outcome>(
    runs: usize,
    device: &Device,
    keep: bool,
    mut f: impl FnMut() -> O,
) -> anyhow::Result<Timed> {
    let started = Instant::now();
    let warm_up = f();
    sync(device)?;
    let mut one = started.elapsed();
    warm_up.check().context("the warm-up run")?;
    if keep {
        // The first run's time may be mostly compiling (SPIR-V on an H200, 2026-11-28:
        // over 2 s for each of mha's calls at the small shape, whose runs then took 1 to
        // 3 ms): the second says whether a run is slow.
        let started = Instant::now();
        let result = f();
        sync(device)?;
        one = started.elapsed();
        drop(result);
    }
    let slow = one > Duration::from_secs(2);
    let runs = match slow {
        true => runs.min(3),
        false => runs,
    };
    if keep && !slow {
        keep_warm(device, &mut f)?;
    }
    let mut samples = Vec::with_capacity(runs);
    for run in 0..runs {
        let started = Instant::now();
        let result = f();
        sync(device)?;
        samples.push(started.elapsed().as_secs_f64() * 1e3);
        if run + 1 == runs {
            result.check().context("the last timed run")?;
        }
    }
    samples.sort_by(f64::total_cmp);
    Ok(Timed {
        ms: samples[samples.len() / 2],
        runs,
        queued: None,
    })
}

fn randn<const D: usize>(dims: [usize; D], device: &Device) -> Tensor<D> {
    Tensor::random(dims, Distribution::Normal(0.0, 1.0), device)
}

/// [`randn`] in `dtype`.
fn randn_as<const D: usize>(dtype: FloatDType, dims: [usize; D], device: &Device) -> Tensor<D> {
    randn(dims, device).cast(dtype)
}

/// mha's and Burn's multi-head attention, forward and forward+backward, at one shape.
fn bench_mha(
    cli: &Cli,
    backend: Backend,
    device: &Device,
    (shape, dtype): (Shape, FloatDType),
    out: &mut Vec<Record>,
) {
    let Shape {
        batch: b,
        seq: t,
        d_model: d,
        heads: h,
        ..
    } = shape;
    let ad = device.clone().autodiff();
    let mut record = |subject, pass, timed, flops| {
        out.push(Record::attention(
            backend.name(),
            (shape, dtype),
            subject,
            pass,
            timed,
            flops,
        ));
    };
    let fwd = shape.mha_flops();

    let config = MultiHeadAttentionConfig::new(d, h);
    let ours = config.init(device).to_dtype(dtype);
    let x = randn_as(dtype, [b, t, d], device);
    let ms = time(cli.runs, device, || {
        ours.forward(MhaInput::causal(x.clone())).context
    });
    record("mha", "forward", ms, fwd);
    let ours = config.init(&ad).to_dtype(dtype);
    let x = randn_as(dtype, [b, t, d], &ad).require_grad();
    let ms = time(cli.runs, device, || {
        backward_of(&x, ours.forward(MhaInput::causal(x.clone())).context.sum())
    });
    record("mha", "forward+backward", ms, 3.0 * fwd);

    if !cli.no_builtin {
        let config = BurnMhaConfig::new(d, h).with_dropout(0.0);
        let theirs = config.init(device).to_dtype(dtype);
        let x = randn_as(dtype, [b, t, d], device);
        let mask = generate_autoregressive_mask(b, t, device);
        let ms = time(cli.runs, device, || {
            let input = BurnMhaInput::self_attn(x.clone()).mask_attn(mask.clone());
            theirs.forward(input).context
        });
        record("burn", "forward", ms, fwd);
        let theirs = config.init(&ad).to_dtype(dtype);
        let x = randn_as(dtype, [b, t, d], &ad).require_grad();
        let mask = generate_autoregressive_mask(b, t, &ad);
        let ms = time(cli.runs, device, || {
            let input = BurnMhaInput::self_attn(x.clone()).mask_attn(mask.clone());
            backward_of(&x, theirs.forward(input).context.sum())
        });
        record("burn", "forward+backward", ms, 3.0 * fwd);
    }

    let core = shape.core_flops();
    let dims = [b, h, t, d / h];
    let causal = AttentionMask::causal();
    let sdpa = |q: &Tensor<4>, k: &Tensor<4>, v: &Tensor<4>| {
        let options = SdpaOptions::default();
        mha::scaled_dot_product_attention(q.clone(), k.clone(), v.clone(), &causal, options).context
    };
    let (q, k, v) = (
        randn_as(dtype, dims, device),
        randn_as(dtype, dims, device),
        randn_as(dtype, dims, device),
    );
    let ms = time(cli.runs, device, || sdpa(&q, &k, &v));
    record("mha-core", "forward", ms, core);
    let grad = || randn_as(dtype, dims, &ad).require_grad();
    let (q, k, v) = (grad(), grad(), grad());
    let ms = time(cli.runs, device, || {
        let grads = sdpa(&q, &k, &v).sum().backward();
        grads_of([&q, &k, &v], &grads)
    });
    record("mha-core", "forward+backward", ms, 3.0 * core);
}

/// The backend's 2048 x 2048 f32 matrix product: the ceiling attention's GFLOP/s are
/// compared against.
fn bench_matmul(
    cli: &Cli,
    backend: Backend,
    device: &Device,
    out: &mut Vec<Record>,
) -> anyhow::Result<()> {
    let n = 2048;
    let (a, b) = (randn([n, n], device), randn([n, n], device));
    let flops = 2.0 * (n as f64).powi(3);
    let timed = time(cli.runs, device, || a.clone().matmul(b.clone()))?;
    out.push(Record {
        gflops: Some(flops / timed.ms / 1e6),
        ..Record::new(backend.name(), "matmul-2048", "forward", timed)
    });
    Ok(())
}

/// The trainer's measurements: its default model and task (`trainer`), the same with
/// packed batches (the trainer's `--pack`), both on mixed lengths (inputs of 1 to 16
/// tokens, whose padded batches are about 45% padding), and the model at the size of the
/// PyTorch reference (`trainer-reference`: d_model 128, 3 layers, 4 heads, feed-forward
/// 512, learning rate 1e-3), which `scripts/bench_pytorch.py --trainer` builds in
/// PyTorch.
const TRAINER_RUNS: [TrainerRun; 5] = [
    TrainerRun::new("trainer", false, 8),
    TrainerRun::new("trainer-packed", true, 8),
    TrainerRun::new("trainer-mixed", false, 1),
    TrainerRun::new("trainer-mixed-packed", true, 1),
    TrainerRun {
        reference: true,
        ..TrainerRun::new("trainer-reference", false, 8)
    },
];

/// One trainer measurement.
#[derive(Clone, Copy)]
struct TrainerRun {
    subject: &'static str,
    /// Packed batches.
    pack: bool,
    /// The shortest input (the longest is 16).
    min_len: usize,
    /// The reference size instead of the default.
    reference: bool,
}

impl TrainerRun {
    const fn new(subject: &'static str, pack: bool, min_len: usize) -> Self {
        Self {
            subject,
            pack,
            min_len,
            reference: false,
        }
    }
}

/// Whole training steps (batching, forward, loss, backward, clipping, AdamW) of the
/// trainer's model, on its task with inputs of `min_len` to 16 tokens, its batches
/// padded or packed.
fn bench_trainer(
    cli: &Cli,
    backend: Backend,
    device: &Device,
    run: TrainerRun,
    out: &mut Vec<Record>,
) -> anyhow::Result<()> {
    let mut config = TrainConfig {
        pack: run.pack,
        ..TrainConfig::default()
    };
    config.task.min_len = run.min_len;
    if run.reference {
        config.model.d_model = 128;
        config.model.n_layers = 3;
        config.lr = 1e-3;
    }
    let subject = run.subject;
    let ad = device.clone().autodiff();
    let mut model = config.init_model(&ad)?;
    // The trainer's optimizer: `mha`'s AdamW, its settings and groups.
    let mut optim = train::training::optimizer(&config);
    let batcher = SeqBatcher {
        fixed: config.fixed_shape(backend),
        pack: config.pack_width(),
        mixed: None,
        shares: 1,
    };
    // One step on batch `n` of the training split: the model after it and the batch's
    // real tokens.
    let mut step = |model: train::model::Model, n: usize| {
        let first = n * config.batch_size;
        let examples: Vec<_> = (first..first + config.batch_size)
            .map(|i| config.task.example(config.seed, Split::Train, i))
            .collect();
        let tokens: usize = examples
            .iter()
            .map(|e| e.input.len() + e.output.len() + 2)
            .sum();
        let loss = model.forward_loss(batcher.batch(examples, &ad)).loss;
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        (optim.step(config.lr, model, grads), tokens, loss.inner())
    };
    // The timed batches once untimed first: each new batch length is a new shape, which a
    // GPU backend compiles and tunes for the first time it meets it (on an H200, 40 steps
    // after a single warm-up step took 77 ms each, where the trainer's own run went at
    // 17). Each step on a worker of the CPU backends' pool, as the trainer runs it.
    for n in 0..cli.train_steps {
        let (warm, _, warm_loss) = mha::on_cpu_workers(device, || step(model, n));
        model = warm;
        if n == 0 {
            sync(device)?;
            warm_loss.check().context("the warm-up step's loss")?;
        }
    }
    sync(device)?;
    let mut tokens = 0;
    let mut loss = None;
    let started = Instant::now();
    for batch in 0..cli.train_steps {
        let (next_model, n, last) = mha::on_cpu_workers(device, || step(model, batch));
        model = next_model;
        tokens += n;
        loss = Some(last);
    }
    sync(device)?;
    let seconds = started.elapsed().as_secs_f64();
    // Read back outside the timing.
    if let Some(loss) = loss {
        loss.check().context("the last step's loss")?;
    }
    drop(model);
    let timed = Timed {
        ms: seconds * 1e3 / cli.train_steps as f64,
        runs: cli.train_steps,
        queued: None,
    };
    out.push(Record {
        tokens_per_second: Some(tokens as f64 / seconds),
        batch: Some(config.batch_size),
        ..Record::new(backend.name(), subject, "train-step", timed)
    });
    Ok(())
}

fn find<'a>(records: &[&'a Record], shape: &str, subject: &str, pass: &str) -> Option<&'a Record> {
    records
        .iter()
        .find(|r| {
            r.shape.is_some_and(|s| s.name == shape) && r.subject == subject && r.pass == pass
        })
        .copied()
}

/// Why each failed measurement of `records` has no time.
fn print_failures(records: &[&Record]) {
    for r in records {
        if let (Some(why), Some(shape)) = (&r.failed, r.shape) {
            let at = match shape.name {
                "long-core" => format!("{} positions", shape.seq),
                name => name.to_string(),
            };
            println!("\n{} {} at {at} failed: {why}", r.subject, r.pass);
        }
    }
}

/// The causal core's lines at a long length, if it was measured.
fn print_long_core(backend: Backend, records: &[Record]) {
    let long: Vec<&Record> = records
        .iter()
        .filter(|r| r.shape.is_some_and(|s| s.name == "long-core"))
        .collect();
    if long.is_empty() {
        return;
    }
    println!(
        "\n## {backend}: causal attention core alone, batch 1, 8 heads of 64, forward+backward\n"
    );
    let queued = long.iter().any(|r| r.queued_ms.is_some());
    let (column, rule) = match queued {
        true => (" queued ms (calls) |", "---|"),
        false => ("", ""),
    };
    println!("| positions | dtype | median ms | GFLOP/s | peak memory (MiB) |{column}");
    println!("|---|---|---|---|---|{rule}");
    for r in &long {
        let gflops = r.gflops.map_or("—".into(), |g| format!("{g:.0}"));
        let queued = match queued {
            true => format!(" {} |", r.queued_cell()),
            false => String::new(),
        };
        println!(
            "| {} | {} | {} | {gflops} | {} |{queued}",
            r.context.unwrap_or(0),
            r.dtype.unwrap_or("f32"),
            r.ms(1),
            r.peak_mib.map_or("—".into(), |m| format!("{m:.0}"))
        );
    }
    print_failures(&long);
}

fn print_table(backend: Backend, dtype: &str, records: &[&Record], shapes: &[Shape]) {
    if shapes.is_empty() {
        return print_trainer(records);
    }
    println!("\n## {backend}, {dtype}: causal self-attention, median ms (GFLOP/s)\n");
    print_rows(records, shapes, Record::ms_gflops, |r| Some(r.median_ms));
    if records.iter().any(|r| r.queued_ms.is_some()) {
        println!(
            "\n## {backend}, {dtype}: the same calls queued, median ms per call (calls issued \
             before one sync)\n"
        );
        print_rows(records, shapes, Record::queued_cell, |r| r.queued_ms);
    }
    if let Some(r) = records.iter().find(|r| r.subject == "matmul-2048") {
        println!(
            "\n2048 x 2048 f32 matmul: {:.1} ms, {:.0} GFLOP/s",
            r.median_ms,
            r.gflops.unwrap_or(0.0)
        );
    }
    print_trainer(records);
}

/// The rows of [`print_table`]'s tables at `shapes`: each measurement's `cell`, and the
/// ratios of the times `ms` gives.
fn print_rows(
    records: &[&Record],
    shapes: &[Shape],
    cell: fn(&Record) -> String,
    ms: fn(&Record) -> Option<f64>,
) {
    println!(
        "| shape (B, T, D, H) | mha fwd | Burn fwd | Burn/mha | mha fwd+bwd | Burn fwd+bwd | Burn/mha | core fwd | core fwd+bwd |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let cell = |r: Option<&Record>| r.map_or("—".into(), cell);
    let ms = |r: Option<&Record>| r.filter(|r| r.failed.is_none()).and_then(ms);
    let ratio = |a: Option<&Record>, b: Option<&Record>| match (ms(a), ms(b)) {
        (Some(a), Some(b)) => format!("{:.2}x", b / a),
        _ => "—".into(),
    };
    for s in shapes {
        let get = |subject, pass| find(records, s.name, subject, pass);
        let (f, bf) = (get("mha", "forward"), get("burn", "forward"));
        let (fb, bfb) = (
            get("mha", "forward+backward"),
            get("burn", "forward+backward"),
        );
        println!(
            "| {} ({}, {}, {}, {}) | {} | {} | {} | {} | {} | {} | {} | {} |",
            s.name,
            s.batch,
            s.seq,
            s.d_model,
            s.heads,
            cell(f),
            cell(bf),
            ratio(f, bf),
            cell(fb),
            cell(bfb),
            ratio(fb, bfb),
            cell(get("mha-core", "forward")),
            cell(get("mha-core", "forward+backward")),
        );
    }
}

/// The trainer's lines, if it was measured.
fn print_trainer(records: &[&Record]) {
    let find = |subject: &str| records.iter().find(|r| r.subject == subject);
    if let Some(r) = find("trainer") {
        println!(
            "\ntrainer (default model and task, batch 64): {:.1} ms per step, {:.0} tokens/s",
            r.median_ms,
            r.tokens_per_second.unwrap_or(0.0)
        );
    }
    if let Some(r) = find("trainer-reference") {
        println!(
            "trainer at the reference size (d_model 128, 3 layers, 4 heads, feed-forward 512, \
             batch 64): {:.1} ms per step, {:.0} tokens/s",
            r.median_ms,
            r.tokens_per_second.unwrap_or(0.0)
        );
    }
    for (padded, packed, what) in [
        ("trainer", "trainer-packed", "inputs of 8 to 16"),
        ("trainer-mixed", "trainer-mixed-packed", "inputs of 1 to 16"),
    ] {
        if let (Some(a), Some(b)) = (find(padded), find(packed)) {
            println!(
                "{what}: padded {:.1} ms per step ({:.0} tokens/s), packed (--pack) {:.1} ms \
                 ({:.0} tokens/s): {:.2}x the tokens/s",
                a.median_ms,
                a.tokens_per_second.unwrap_or(0.0),
                b.median_ms,
                b.tokens_per_second.unwrap_or(0.0),
                b.tokens_per_second.unwrap_or(0.0) / a.tokens_per_second.unwrap_or(1.0)
            );
        }
    }
}

/// A shape of [`SHAPES`] by name, or `BxTxDxH` (batch, sequence, model width, heads).
fn shape_named(name: &str) -> anyhow::Result<Shape> {
    if let Some(shape) = SHAPES.iter().find(|s| s.name == name) {
        return Ok(*shape);
    }
    let unknown =
        || format!("--shapes: unknown shape {name:?} (tiny, small, base, long, BxTxDxH, none)");
    let sizes: Vec<usize> = name
        .split('x')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .with_context(unknown)?;
    let [batch, seq, d_model, heads] = sizes[..] else {
        anyhow::bail!(unknown());
    };
    anyhow::ensure!(
        batch > 0 && seq > 0 && heads > 0 && d_model % heads == 0 && d_model > 0,
        "--shapes {name}: B, T, D and H must be positive, with D a multiple of H"
    );
    Ok(Shape {
        name: Box::leak(name.to_owned().into_boxed_str()),
        batch,
        seq,
        d_model,
        heads,
    })
}

/// Whether `--overhead` asked for the costs around the kernels in place of the timings.
fn overhead_only(cli: &Cli) -> bool {
    #[cfg(feature = "wgpu")]
    return cli.overhead;
    #[cfg(not(feature = "wgpu"))]
    {
        let _ = cli;
        false
    }
}

fn main() -> ExitCode {
    train::alloc::keep_freed_memory();
    // `bench train ARGS` is the trainer, `train ARGS`: one binary to carry to a GPU
    // machine without a toolchain (`scripts/gpu_table.sh --trainer`).
    if std::env::args_os()
        .nth(1)
        .is_some_and(|command| command == "train")
    {
        let args = std::env::args_os().skip(1);
        return train::commands::run(train::cli::Cli::parse_with_defaults_from(args));
    }
    match bench(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn bench(cli: Cli) -> anyhow::Result<()> {
    let shapes: Vec<Shape> = cli
        .shapes
        .iter()
        .filter(|name| name.as_str() != "none")
        .map(|name| shape_named(name))
        .collect::<anyhow::Result<_>>()?;
    anyhow::ensure!(cli.runs > 0, "--runs must be at least 1, got 0");
    anyhow::ensure!(
        cli.train_steps > 0 || cli.no_train,
        "--train-steps must be at least 1, got 0 (--no-train skips the trainer's steps)"
    );
    if let Some(short) = cli.decode_at.iter().find(|&&c| c < 2) {
        anyhow::bail!("--decode-at {short}: a decoding step needs a position before it");
    }
    let most = decode::CORE_CALLS.iter().map(|c| c.1).max().unwrap_or(1);
    if let Some(short) = cli.decode_at.iter().find(|&&c| cli.decode_core && c < most) {
        anyhow::bail!(
            "--decode-at {short} with --decode-core: its calls take up to {most} queries"
        );
    }
    QUEUE.store(cli.queued, std::sync::atomic::Ordering::Relaxed);
    let dtypes: Vec<FloatDType> = cli
        .dtype
        .iter()
        .map(|name| match name.as_str() {
            "f32" => Ok(FloatDType::F32),
            "f16" => Ok(FloatDType::F16),
            "bf16" => Ok(FloatDType::BF16),
            other => anyhow::bail!("--dtype: unknown dtype {other:?} (f32, f16, bf16)"),
        })
        .collect::<anyhow::Result<_>>()?;
    let backends = match cli.backend.is_empty() {
        true => Backend::compiled(),
        false => cli.backend.clone(),
    };
    anyhow::ensure!(!backends.is_empty(), "this build has no backend");
    let mut records = Vec::new();
    for backend in backends {
        let device = backend.device()?;
        // Which adapter the numbers are of (a GPU build may open a software one where the
        // card's driver is missing).
        let software = match backend.software_adapter(&device) {
            Some(_) => " (a software adapter: no GPU behind it)",
            None => "",
        };
        println!(
            "\n{backend} runs on {}{software}",
            train::backend::device_name(&device)
        );
        let mut mine = Vec::new();
        let timed = match overhead_only(&cli) {
            true => &[][..],
            false => &shapes[..],
        };
        // The dtypes the device computes in; the others are named and skipped.
        let mut computed = Vec::new();
        for &dtype in &dtypes {
            match device.supports_dtype(DType::from(dtype)) {
                true => computed.push(dtype),
                false => println!(
                    "\n{backend} does not compute in {}: skipped for it",
                    dtype_name(dtype)
                ),
            }
        }
        // The long core first: the memory pool's peak is the process's, so only the first
        // measurement's is its own.
        if let Some(seq) = cli.long_core {
            for (n, &dtype) in computed.iter().enumerate() {
                eprintln!(
                    "{backend}: causal core at {seq} positions in {} ...",
                    dtype_name(dtype)
                );
                bench_long_core(&cli, backend, &device, (seq, dtype), n == 0, &mut mine);
                write_json(cli.json.as_deref(), &records, &mine)?;
                #[cfg(feature = "wgpu")]
                if cli.core_kernels {
                    print_core_kernels(backend, &device, (seq, dtype))?;
                }
            }
        }
        if !timed.is_empty() {
            bench_matmul(&cli, backend, &device, &mut mine)?;
        }
        for &dtype in &computed {
            for &shape in timed {
                eprintln!("{backend}: {} in {} ...", shape.name, dtype_name(dtype));
                bench_mha(&cli, backend, &device, (shape, dtype), &mut mine);
                if cli.variants {
                    let at = (shape, dtype);
                    variants::bench_variants(cli.runs, backend.name(), &device, at, &mut mine);
                }
                write_json(cli.json.as_deref(), &records, &mine)?;
            }
        }
        if !cli.no_train {
            for run in TRAINER_RUNS {
                eprintln!("{backend}: {} ...", run.subject);
                bench_trainer(&cli, backend, &device, run, &mut mine)?;
                write_json(cli.json.as_deref(), &records, &mine)?;
            }
        }
        #[cfg(feature = "wgpu")]
        if cli.overhead {
            for &dtype in &computed {
                for &shape in &shapes {
                    eprintln!(
                        "{backend}: overhead at {} in {} ...",
                        shape.name,
                        dtype_name(dtype)
                    );
                    overhead::print_overhead(&device, shape, dtype)?;
                }
            }
        }
        if cli.floor {
            for &dtype in &computed {
                eprintln!(
                    "{backend}: the floor of a call in {} ...",
                    dtype_name(dtype)
                );
                floor::print_floor(cli.runs, &device, dtype)?;
            }
        }
        // Each of these printed and written as soon as it is measured: a run stopped by a
        // time limit keeps them.
        if cli.decode {
            decode::bench_decode(cli.runs, backend, &device, &cli.decode_at, &mut mine)?;
            decode::print_decode(backend, &mine);
            write_json(cli.json.as_deref(), &records, &mine)?;
        }
        if cli.decode_core {
            decode::bench_decode_core(cli.runs, backend, &device, &cli.decode_at, &mut mine);
            decode::print_decode_core(backend, &mine);
            write_json(cli.json.as_deref(), &records, &mine)?;
        }
        if cli.window {
            decode::bench_window(cli.runs, backend, &device, &mut mine)?;
            decode::print_window(backend, &mine);
            write_json(cli.json.as_deref(), &records, &mine)?;
        }
        if cli.prune {
            prune::bench_prune(cli.runs, backend, &device, &mut mine)?;
            prune::print_prune(backend, &mine);
            write_json(cli.json.as_deref(), &records, &mine)?;
        }
        if cli.llama {
            llama::bench_llama(cli.runs, backend, &device, &mut mine)?;
            llama::print_llama(backend, &mine);
            write_json(cli.json.as_deref(), &records, &mine)?;
        }
        for (n, &dtype) in computed.iter().enumerate() {
            // The measurements without a dtype (matmul, trainer) once, after the first.
            let name = dtype_name(dtype);
            let these: Vec<&Record> = mine
                .iter()
                .filter(|r| match r.dtype {
                    Some(d) => d == name && r.shape.is_none_or(|s| s.name != "long-core"),
                    None => n == 0,
                })
                .collect();
            print_table(backend, name, &these, timed);
            variants::print_variants(backend.name(), name, &these);
            print_failures(&these);
        }
        if computed.is_empty() {
            print_trainer(&mine.iter().collect::<Vec<_>>());
        }
        print_long_core(backend, &mine);
        records.extend(mine);
    }
    write_json(cli.json.as_deref(), &records, &[])?;
    let failed = records.iter().filter(|r| r.failed.is_some()).count();
    anyhow::ensure!(
        failed == 0,
        "{failed} of the {} measurements failed (each said why above)",
        records.len()
    );
    Ok(())
}

/// Writes the measurements `done` and `current` to `path` (if any) as one JSON list,
/// through a file beside it renamed into place: the file is always a whole list.
fn write_json(path: Option<&Path>, done: &[Record], current: &[Record]) -> anyhow::Result<()> {
    let Some(path) = path else {
        return Ok(());
    };
    let all: Vec<&Record> = done.iter().chain(current).collect();
    let part = path.with_extension("json.part");
    std::fs::write(&part, serde_json::to_string_pretty(&all)? + "\n")
        .with_context(|| format!("cannot write {}", part.display()))?;
    std::fs::rename(&part, path)
        .with_context(|| format!("cannot rename {} to {}", part.display(), path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_device_error_is_told_on_one_line_without_its_notes() {
        let text = "An error happened during execution\nCaused by:\n  Several failures at once\n\
            Caused by:\n  The bytes were never written (failure #14347, still claiming 3 buffer(s))\n  \
            skipped `ElemwiseFuse`: it needed memory ManagedMemoryId { value: 563 }, which carried the failure\n  \
            (9 older skip record(s) were dropped; the walk may stop before the root)\n\
            Caused by:\n  An IO error happened\nCaused by:\n  can't allocate buffer of size: 536870912\n\
            No backtrace available\nAsked at:\nNo backtrace available";
        assert_eq!(
            one_line(text),
            "An error happened during execution: Several failures at once: The bytes were never \
             written (failure #14347, still claiming 3 buffer(s)): An IO error happened: can't \
             allocate buffer of size: 536870912"
        );
        let framed = "An IO error happened\nCaused by:\n  can't allocate\n   0: cubecl_runtime::x\n  at y.rs:1";
        assert_eq!(one_line(framed), "An IO error happened: can't allocate");
    }

    /// [`queued`] 3 batches of 4 calls of `f`.
    #[cfg(feature = "flex")]
    fn queued_of<O: Outcome>(device: &Device, f: impl FnMut() -> O) -> anyhow::Result<f64> {
        queued(3, 4, device, f)
    }

    #[test]
    fn a_queued_batch_keeps_the_device_busy_for_its_span_within_its_bounds() {
        let (fewest, most) = QUEUE_CALLS;
        assert_eq!(queue_calls(QUEUE_SPAN_MS / 5.0), 5);
        assert_eq!(queue_calls(QUEUE_SPAN_MS / 4.5), 5);
        assert_eq!(queue_calls(QUEUE_SPAN_MS), fewest);
        assert_eq!(queue_calls(1e3), fewest);
        assert_eq!(queue_calls(1e-3), most);
        assert_eq!(queue_calls(0.0), most);
    }

    #[test]
    fn a_queued_time_goes_to_its_own_table_cell_and_json_fields() {
        let shape = shape_named("tiny").unwrap();
        let record = |queued| {
            let timed = Timed {
                ms: 2.0,
                runs: 3,
                queued,
            };
            let at = (shape, FloatDType::F32);
            Record::attention("wgpu", at, "mha", "forward", Ok(timed), 4e6)
        };
        let queued = record(Some(Ok(Queued {
            ms: 0.25,
            calls: 64,
        })));
        assert_eq!(queued.queued_cell(), "0.25 (64)");
        let json = serde_json::to_value(&queued).unwrap();
        assert_eq!(
            (json["queued_ms"].as_f64(), json["queued_calls"].as_u64()),
            (Some(0.25), Some(64))
        );
        assert_eq!(json["median_ms"].as_f64(), Some(2.0));
        let synced = record(None);
        assert_eq!(synced.queued_cell(), "—");
        let json = serde_json::to_value(&synced).unwrap();
        assert!(
            json.get("queued_ms").is_none() && json.get("queued_calls").is_none(),
            "{json}"
        );
        // Queued batches that failed: their reason, the synced time standing.
        let failed = record(Some(Err("refused".into())));
        assert_eq!(
            (failed.queued_cell(), failed.ms(2)),
            ("failed".into(), "2.00".into())
        );
        let json = serde_json::to_value(&failed).unwrap();
        assert_eq!(json["queued_failed"], "refused");
        assert!(
            json.get("queued_ms").is_none() && json["failed"].is_null(),
            "{json}"
        );
    }

    #[cfg(feature = "flex")]
    #[test]
    fn a_call_whose_result_is_not_finite_gets_no_time() {
        let device = Device::flex();
        let x = Tensor::<1>::from_floats([1.0, 0.0, -1.0], &device);
        let timed = time(3, &device, || x.clone().div_scalar(0.0));
        let why = format!("{:#}", timed.expect_err("1/0 is not finite"));
        assert!(
            why.contains("the warm-up run") && why.contains("3 of the 3 values"),
            "{why}"
        );
        let synced = time(3, &device, || x.clone().mul_scalar(2.0)).unwrap();
        assert!(synced.ms >= 0.0 && synced.runs == 3 && synced.queued.is_none());
        // Queued too where asked, as many calls a batch as the synced time says.
        let double = || x.clone().mul_scalar(2.0);
        let both = queued_too(synced.clone(), &device, double, true);
        let queued = both.queued.clone().expect("asked for").expect("finite");
        assert!(
            queued.ms >= 0.0 && queued.calls == queue_calls(synced.ms),
            "{both:?}"
        );
        assert_eq!((both.ms, both.runs), (synced.ms, synced.runs));
        assert!(
            queued_too(synced.clone(), &device, double, false)
                .queued
                .is_none()
        );
        let why = queued_of(&device, || x.clone().div_scalar(0.0)).expect_err("not finite");
        assert!(
            format!("{why:#}").contains("the last queued batch"),
            "{why:#}"
        );
        // Batches that fail leave the synced time standing, and say why.
        let failing = queued_too(synced.clone(), &device, || x.clone().div_scalar(0.0), true);
        assert_eq!(failing.ms, synced.ms);
        let why = failing.queued.expect("asked for").expect_err("not finite");
        assert!(why.contains("the last queued batch"), "{why}");

        let shape = shape_named("tiny").unwrap();
        let failed = Record::attention(
            "flex",
            (shape, FloatDType::F32),
            "mha",
            "forward",
            Err(anyhow::anyhow!("refused")),
            1.0,
        );
        assert_eq!(
            (failed.ms(2), failed.ms_gflops()),
            ("failed".into(), "failed".into())
        );
        let json = serde_json::to_value(&failed).unwrap();
        assert!(
            json["median_ms"].is_null() && json["gflops"].is_null(),
            "{json}"
        );
        assert_eq!(json["failed"], "refused");
        let timed = Record::attention(
            "flex",
            (shape, FloatDType::F32),
            "mha",
            "forward",
            Ok(Timed {
                ms: 2.0,
                runs: 3,
                queued: None,
            }),
            4e6,
        );
        assert_eq!(
            (timed.ms(2), timed.ms_gflops()),
            ("2.00".into(), "2.0 (2)".into())
        );
        assert!(
            serde_json::to_value(&timed)
                .unwrap()
                .get("failed")
                .is_none()
        );
    }
}
