//! What one call of a module costs around its kernels on a GPU backend (`--overhead`):
//! mha's `MultiHeadAttention` and Burn's built-in module at the same shape (causal
//! self-attention), forward and forward+backward, after two warm-up calls and more for
//! `WARM_UP` (the device's clocks up, see `time`): the kernels
//! launched (all, and those that only copy or cast), the buffers and bytes the call
//! leaves allocated while its result is held, the host's time until the call returns
//! (before the device is done) and until the device is done. A call that reads a tensor
//! back to the host waits for the device inside it: its time to return is its whole time.
//!
//! Then where one more call spends the device's time: each kernel's own time from the
//! device's timestamps, summed by kernel, against the window from the first kernel's start
//! to the last one's end. The window's rest is time the device sat idle between kernels;
//! in this timed call cubecl submits every kernel on its own between its timestamps, so
//! that share is an upper bound on the untimed call's (whose time to finish, in the first
//! table, is the other bound).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burn::cubecl::future::block_on;
use burn::cubecl::logging::{
    LaunchObservation, LaunchObserver, ProfileDuration, TimingMethod, TimingRequest,
};
use burn::nn::attention::{
    MhaInput as BurnMhaInput, MultiHeadAttentionConfig as BurnMhaConfig,
    generate_autoregressive_mask,
};
use burn::tensor::{Device, FloatDType, Tensor};
use mha::{MhaInput, ModuleDType, MultiHeadAttentionConfig};

use crate::{Outcome, Shape, backward_of, dtype_name, keep_warm, randn_as, sync};

/// What a call launches while this is installed: every kernel by name, and where
/// `timing`, each launch's measurement, kept unread until the call is over (read at once,
/// as a length, where cubecl's profiling logger takes the measurements too).
#[derive(Default)]
struct Watch {
    timing: bool,
    counts: Mutex<BTreeMap<&'static str, usize>>,
    kept: Mutex<Vec<(&'static str, ProfileDuration)>>,
    read: Mutex<Vec<(&'static str, Duration, TimingMethod)>>,
}

impl LaunchObserver for Watch {
    fn launched(&self, kernel: &'static str) {
        *self.counts.lock().unwrap().entry(kernel).or_default() += 1;
    }

    fn timing(&self) -> TimingRequest {
        match self.timing {
            true => TimingRequest::Deferred,
            false => TimingRequest::None,
        }
    }

    fn profiled(&self, kernel: &'static str, profile: ProfileDuration) {
        self.kept.lock().unwrap().push((kernel, profile));
    }

    fn timed(&self, kernel: &'static str, duration: Duration, method: TimingMethod) {
        self.read.lock().unwrap().push((kernel, duration, method));
    }
}

/// One `call` with `watch` installed, the device synced before and after: what it
/// returned (held until the device was done, for the caller to read back) and the host's
/// milliseconds until the call returned and until the device was done.
fn watched<T>(
    device: &Device,
    watch: &Arc<Watch>,
    call: impl Fn() -> T,
) -> anyhow::Result<(T, f64, f64)> {
    sync(device)?;
    let watching = LaunchObservation::new(watch.clone());
    let started = Instant::now();
    let result = call();
    let issue_ms = started.elapsed().as_secs_f64() * 1e3;
    sync(device)?;
    let total_ms = started.elapsed().as_secs_f64() * 1e3;
    drop(watching);
    Ok((result, issue_ms, total_ms))
}

/// Why `result` could not be read back or was not finite ([`Outcome`]), fit for a table's
/// cell; `None` where it was read.
fn failure(result: impl Outcome) -> Option<String> {
    let why = result.check().err()?;
    Some(format!("{why:#}").replace('|', "/"))
}

/// Where one call spent the device's time.
pub struct Breakdown {
    /// Per kernel (short name): launches and milliseconds, the longest first.
    kernels: Vec<(String, usize, f64)>,
    /// The kernels' times summed.
    busy_ms: f64,
    /// From the first kernel's start to the last one's end (`None` where some
    /// measurements came as lengths only).
    window_ms: Option<f64>,
    /// Launches timed on the host's clock (no device timestamps).
    system_timed: usize,
    /// Launches measured one at a time, as lengths (cubecl's profiling logger is on).
    read_at_once: usize,
    /// Launches without a measurement (refused, or a window that carried none).
    unmeasured: usize,
    /// Why the call's result could not be read back, or was not finite.
    failed: Option<String>,
}

/// The device time of one more `call`, kernel by kernel.
pub fn breakdown<T: Outcome>(device: &Device, call: impl Fn() -> T) -> anyhow::Result<Breakdown> {
    let watch = Arc::new(Watch {
        timing: true,
        ..Watch::default()
    });
    // Kernels are placed by their distance from an instant before any of them.
    let before = Instant::now();
    let epoch = before.checked_sub(Duration::from_secs(1)).unwrap_or(before);
    let (result, _, _) = watched(device, &watch, call)?;
    let failed = failure(result);
    let launches: usize = watch.counts.lock().unwrap().values().sum();
    let profiles = std::mem::take(&mut *watch.kept.lock().unwrap());
    let read = std::mem::take(&mut *watch.read.lock().unwrap());
    let mut spans = Vec::new();
    let mut system_timed = 0;
    for (kernel, profile) in profiles {
        system_timed += usize::from(profile.timing_method() == TimingMethod::System);
        if let Some(ticks) = block_on(profile.resolve()) {
            spans.push((
                kernel,
                ticks.start_duration_since(epoch).as_secs_f64() * 1e3,
                ticks.end_duration_since(epoch).as_secs_f64() * 1e3,
            ));
        }
    }
    let mut by_name: BTreeMap<String, (usize, f64)> = BTreeMap::new();
    for &(kernel, start, end) in &spans {
        let entry = by_name.entry(short_name(kernel)).or_default();
        *entry = (entry.0 + 1, entry.1 + (end - start));
    }
    for &(kernel, duration, method) in &read {
        system_timed += usize::from(method == TimingMethod::System);
        let entry = by_name.entry(short_name(kernel)).or_default();
        *entry = (entry.0 + 1, entry.1 + duration.as_secs_f64() * 1e3);
    }
    let mut kernels: Vec<(String, usize, f64)> =
        by_name.into_iter().map(|(k, (n, ms))| (k, n, ms)).collect();
    kernels.sort_by(|a, b| b.2.total_cmp(&a.2));
    let busy_ms = kernels.iter().map(|k| k.2).sum();
    let window_ms = match (spans.is_empty(), read.is_empty()) {
        (false, true) => {
            let first = spans.iter().map(|s| s.1).fold(f64::INFINITY, f64::min);
            let last = spans.iter().map(|s| s.2).fold(f64::NEG_INFINITY, f64::max);
            Some(last - first)
        }
        _ => None,
    };
    Ok(Breakdown {
        kernels,
        busy_ms,
        window_ms,
        system_timed,
        read_at_once: read.len(),
        unmeasured: launches.saturating_sub(spans.len() + read.len()),
        failed,
    })
}

/// A kernel's name without its paths and without the generic arguments that only carry
/// dtypes; a matrix product as `matmul(partitioned_matmul)<FusedMatmulArgs,
/// Simple<SyncFullCyclic<ColMajor>, ...>>` (its batch strategy, arguments, family and
/// loaders).
fn short_name(kernel: &str) -> String {
    // Every path cut to its last segment.
    let mut out = String::new();
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        out.push_str(word.rsplit("::").next().unwrap_or(word));
        word.clear();
    };
    for c in kernel.chars() {
        match c.is_alphanumeric() || c == '_' || c == ':' {
            true => word.push(c),
            false => {
                flush(&mut word, &mut out);
                out.push(c);
            }
        }
    }
    flush(&mut word, &mut out);
    // The dtype placeholders, `DynamicScalar<__Lhs>, ` and the like.
    for wrapper in ["DynamicScalar<", "DynamicSize<"] {
        while let Some(at) = out.find(wrapper) {
            let end = out[at..].find('>').map_or(out.len(), |e| at + e + 1);
            let end = match out[end..].starts_with(", ") {
                true => end + 2,
                false => end,
            };
            out.replace_range(at..end, "");
        }
    }
    // cubek's matrix products: their batch strategy (the module under `batch`), family and
    // loaders, not the words every one repeats.
    if out.starts_with("MatmulEntry<") {
        let strategy = kernel
            .split("::batch::")
            .nth(1)
            .and_then(|rest| rest.split("::").next())
            .unwrap_or("");
        out = out.replacen("MatmulEntry", &format!("matmul({strategy})"), 1);
        for (long, short) in [
            ("MatmulFamily", ""),
            ("UnitPartitioner, (), ", ""),
            ("Loading", ""),
            ("TilingOrder", ""),
            (", UnitWriterFamily", ""),
            (", RowMajorGlobalPartitionMatmul", ""),
        ] {
            out = out.replace(long, short);
        }
    }
    out.replace(", >", ">")
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
    /// Why the call's result could not be read back, or was not finite.
    failed: Option<String>,
}

/// The costs of `call` (which returns what it keeps, read back after the measurement),
/// after two warm-up calls and more for `WARM_UP` ([`keep_warm`]), and the device time
/// of one more call kernel by kernel.
fn cost<T: Outcome>(device: &Device, call: impl Fn() -> T) -> anyhow::Result<(Cost, Breakdown)> {
    for _ in 0..2 {
        let result = call();
        sync(device)?;
        drop(result);
    }
    keep_warm(device, &mut &call)?;
    let before = device.memory_pool_usage().unwrap_or_default();
    let watch = Arc::new(Watch::default());
    let (kept, issue_ms, total_ms) = watched(device, &watch, &call)?;
    let after = device.memory_pool_usage().unwrap_or_default();
    let failed = failure(kept);
    let counts = watch.counts.lock().unwrap().clone();
    let of = |parts: &[&str]| -> usize {
        counts
            .iter()
            .filter(|(name, _)| parts.iter().any(|p| name.contains(p)))
            .map(|(_, n)| n)
            .sum()
    };
    let cost = Cost {
        launches: counts.values().sum(),
        copies: of(&["copy", "contiguous", "cast", "into_contiguous"]),
        ours: of(&["mha::gpu"]),
        buffers: after.number_allocs as i64 - before.number_allocs as i64,
        bytes: after.bytes_in_use as i64 - before.bytes_in_use as i64,
        issue_ms,
        total_ms,
        failed,
    };
    Ok((cost, breakdown(device, call)?))
}

/// The kernels that took the device's time in each call, the longest first.
pub fn print_breakdowns(breakdowns: &[(&str, &str, Breakdown)]) {
    println!(
        "\n| module | pass | ms in kernels | ms from first start to last end | idle between | kernel (launches): ms, the longest first |"
    );
    println!("|---|---|---|---|---|---|");
    for (module, pass, b) in breakdowns {
        let window = b.window_ms.map_or("—".to_string(), |w| format!("{w:.2}"));
        let idle = b.window_ms.map_or("—".to_string(), |w| match w > 0.0 {
            true => format!("{:.0}%", 100.0 * (w - b.busy_ms).max(0.0) / w),
            false => "—".to_string(),
        });
        let top: Vec<String> = b
            .kernels
            .iter()
            .take(8)
            .map(|(name, n, ms)| format!("`{name}` ({n}): {ms:.2}"))
            .collect();
        let mut notes = String::new();
        if b.system_timed > 0 {
            notes += &format!(" ({} launches timed on the host's clock)", b.system_timed);
        }
        if b.read_at_once > 0 {
            notes += &format!(
                " ({} launches measured one at a time: cubecl's profiling logger is on, no window)",
                b.read_at_once
            );
        }
        if b.unmeasured > 0 {
            notes += &format!(" ({} launches unmeasured)", b.unmeasured);
        }
        if let Some(why) = &b.failed {
            notes += &format!(" (the call failed: {why})");
        }
        println!(
            "| {module} | {pass} | {:.2} | {window} | {idle} | {}{notes} |",
            b.busy_ms,
            top.join("; ")
        );
    }
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
    let mut breakdowns = Vec::new();
    let mut row = |module: &'static str, pass: &'static str, (c, b): (Cost, Breakdown)| {
        breakdowns.push((module, pass, b));
        let failed = c
            .failed
            .map_or(String::new(), |why| format!(" (failed: {why})"));
        println!(
            "| {module} | {pass} | {} | {} | {} | {} | {:.1} | {:.2} | {:.2}{failed} |",
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
            backward_of(&x, mine.forward(MhaInput::causal(x.clone())).context.sum())
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
            let input = BurnMhaInput::self_attn(x.clone()).mask_attn(mask.clone());
            backward_of(&x, theirs.forward(input).context.sum())
        })?,
    );
    print_breakdowns(&breakdowns);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::short_name;

    #[test]
    fn short_names_keep_what_tells_kernels_apart() {
        let simple = "cubek_matmul::multi_level::components::batch::partitioned_matmul::matmul::matmul_entry::MatmulEntry<cubek_matmul::multi_level::args::TensorArgs, cubecl_core::frontend::element::typemap::DynamicScalar<cubek_matmul::multi_level::args::__Lhs>, cubecl_core::frontend::element::typemap::DynamicSize<cubek_matmul::multi_level::args::__LhsSize>, cubek_matmul::multi_level::components::global::single_stage::simple::setup::SimpleMatmulFamily<cubek_matmul::multi_level::tile::ops::partition::UnitPartitioner, (), cubek_matmul::multi_level::components::global::read::strategy::sync_full_cyclic::SyncFullCyclicLoading<cubek_matmul::multi_level::stage::stage_memory::layout::ColMajorTilingOrder>, cubek_matmul::multi_level::components::global::write::unit::UnitWriterFamily>, cubek_matmul::multi_level::components::batch::partitioned_matmul::partition::matmul::RowMajorGlobalPartitionMatmul>";
        assert_eq!(
            short_name(simple),
            "matmul(partitioned_matmul)<TensorArgs, Simple<SyncFullCyclic<ColMajor>>>"
        );
        let gemm = "cubek_matmul::multi_level::components::batch::gemm::matmul::base::matmul_entry::MatmulEntry<cubek_matmul::multi_level::args::TensorArgs, cubecl_core::frontend::element::typemap::DynamicScalar<cubek_matmul::multi_level::args::__Acc>, cubecl_core::frontend::element::typemap::DynamicSize<cubek_matmul::multi_level::args::__AccSize>>";
        assert_eq!(short_name(gemm), "matmul(gemm)<TensorArgs>");
        assert_eq!(
            short_name("mha::gpu::backward::dkv_kernel::DkvKernel<mha::gpu::tile::Registers>"),
            "DkvKernel<Registers>"
        );
        assert_eq!(
            short_name("cubecl_std::tensor::contiguous::base::copy_kernel::CopyKernel"),
            "CopyKernel"
        );
    }
}
