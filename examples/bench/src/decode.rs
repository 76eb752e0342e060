//! Decoding and long windows: the cost of one new token with mha's cache, by recomputing
//! the prefix, and with Burn's `MhaCache`; sliding-window attention against full causal
//! attention at long lengths, time and peak memory.

use burn::nn::attention::{
    MhaCache, MhaInput as BurnMhaInput, MultiHeadAttentionConfig as BurnMhaConfig,
};
use burn::tensor::Device;
use mha::{AttentionMask, KvCache, MhaInput, MultiHeadAttentionConfig, SdpaOptions};
use train::backend::Backend;

use crate::{Record, Timed, grads_of, randn, time, time_steps, time_synced};

/// Model width and heads of the decoding benchmark (the base shape's).
const D_MODEL: usize = 512;
const HEADS: usize = 8;
/// Positions of the decoding steps unless asked otherwise (`--decode-at`).
pub const CONTEXTS: [usize; 3] = [128, 512, 2048];
pub const BATCHES: [usize; 2] = [1, 8];

/// A record of `tokens` tokens per run over `context` positions in batches of `batch`:
/// a decoding step (`decode-step`, one token per row) or a window measurement.
fn record(
    backend: Backend,
    (subject, pass): (&'static str, &'static str),
    [batch, context, tokens]: [usize; 3],
    timed: Timed,
    peak_mib: Option<f64>,
) -> Record {
    Record {
        tokens_per_second: Some(tokens as f64 / timed.ms * 1e3),
        batch: Some(batch),
        context: Some(context),
        peak_mib,
        ..Record::new(backend.name(), subject, pass, timed)
    }
}

/// A record of one decoding step after `context - 1` positions, or of why it has none
/// (written to the standard error too: a device that refuses one step's memory, as
/// lavapipe refuses Burn's cache its scores at 2048 positions, leaves the others timed).
fn decode_record(
    backend: Backend,
    subject: &'static str,
    [batch, context, tokens]: [usize; 3],
    ms: anyhow::Result<Timed>,
) -> Record {
    let what = (subject, "decode-step");
    match ms {
        Ok(ms) => record(backend, what, [batch, context, tokens], ms, None),
        Err(e) => {
            eprintln!("{backend}: {subject} at {context} positions, batch {batch}: failed: {e:#}");
            let none = Timed {
                ms: f64::NAN,
                runs: 0,
                queued: None,
            };
            Record {
                tokens_per_second: None,
                failed: Some(format!("{e:#}")),
                ..record(backend, what, [batch, context, tokens], none, None)
            }
        }
    }
}

/// One token at position `context - 1` of causal self-attention (`D_MODEL` wide,
/// `HEADS` heads), batch 1 and 8, at each of `contexts`: with mha's cache (`mha-cached`,
/// room for the longest context and the timed steps whatever the context), by
/// recomputing the whole prefix with mha (`mha-recompute`, what decoding without a cache
/// does), and with Burn's `MhaCache` (`burn-cache`: it caches the projections,
/// concatenates them every step and computes the scores of every position again).
/// `contexts` are 2 or more (the caller checks them).
pub fn bench_decode(
    runs: usize,
    backend: Backend,
    device: &Device,
    contexts: &[usize],
    out: &mut Vec<Record>,
) -> anyhow::Result<()> {
    let ours = MultiHeadAttentionConfig::new(D_MODEL, HEADS).init(device);
    let theirs = BurnMhaConfig::new(D_MODEL, HEADS)
        .with_dropout(0.0)
        .init(device);
    let longest = contexts.iter().copied().max().unwrap_or(1);
    for batch in BATCHES {
        for &context in contexts {
            eprintln!("{backend}: decoding at {context} positions, batch {batch} ...");
            // Room for the warm-up and the timed steps after the prompt.
            let x = randn([batch, context + runs + 1, D_MODEL], device);
            let token = x.clone().narrow(1, context - 1, 1);

            // Every cache has the room of the longest context: a step that copied the
            // storage would cost as much at 128 positions as at 2048.
            let mut cache = KvCache::new(longest + runs + 1);
            let prompt = x.clone().narrow(1, 0, context - 1);
            drop(ours.forward_cached(prompt, &mut cache, AttentionMask::none())?);
            let ms = time_steps(runs, device, || {
                ours.forward_cached(token.clone(), &mut cache, AttentionMask::none())
            });
            out.push(decode_record(
                backend,
                "mha-cached",
                [batch, context, batch],
                ms,
            ));

            let prefix = x.clone().narrow(1, 0, context);
            let ms = time(runs, device, || {
                let all = ours.forward(MhaInput::causal(prefix.clone())).context;
                all.narrow(1, context - 1, 1)
            });
            out.push(decode_record(
                backend,
                "mha-recompute",
                [batch, context, batch],
                ms,
            ));

            let mut cache = MhaCache::autoregressive();
            let prompt = x.clone().narrow(1, 0, context - 1);
            drop(theirs.forward_cache(BurnMhaInput::self_attn(prompt), &mut cache));
            // Burn's cache takes the whole sequence so far and projects its last token.
            let mut len = context;
            let ms = time_steps(runs, device, || {
                let input = BurnMhaInput::self_attn(x.clone().narrow(1, 0, len));
                let last = theirs
                    .forward_cache(input, &mut cache)
                    .context
                    .narrow(1, len - 1, 1);
                len += 1;
                last
            });
            out.push(decode_record(
                backend,
                "burn-cache",
                [batch, context, batch],
                ms,
            ));
        }
    }
    Ok(())
}

/// The attention core's calls of `--decode-core`: subject, queries and key/value heads
/// (of `HEADS` query heads).
pub const CORE_CALLS: [(&str, usize, usize); 8] = [
    ("core-q1", 1, HEADS),
    ("core-q4", 4, HEADS),
    ("core-q8", 8, HEADS),
    ("core-gqa-q1", 1, 2),
    ("core-gqa-q4", 4, 2),
    ("core-gqa-q8", 8, 2),
    ("core-q16", 16, HEADS),
    ("core-gqa-q16", 16, 2),
];

/// The attention core alone in a decoding step (forward, causal: the last queries of
/// `context` positions over all of them, `HEADS` query heads of 64), batch 1 and 8, at
/// each of `contexts`, for each of [`CORE_CALLS`]: one query (a token), several (a few
/// tokens checked at once, as speculative decoding does), and GQA (4 query heads a
/// key/value head).
pub fn bench_decode_core(
    runs: usize,
    backend: Backend,
    device: &Device,
    contexts: &[usize],
    out: &mut Vec<Record>,
) {
    let head_dim = D_MODEL / HEADS;
    for batch in BATCHES {
        for &context in contexts {
            eprintln!("{backend}: the core over {context} positions, batch {batch} ...");
            for (subject, queries, kv_heads) in CORE_CALLS {
                let q = randn([batch, HEADS, queries, head_dim], device);
                let [k, v] = [0; 2].map(|_| randn([batch, kv_heads, context, head_dim], device));
                let mask = AttentionMask::causal();
                let ms = time(runs, device, || {
                    let options = SdpaOptions::default();
                    mha::scaled_dot_product_attention(
                        q.clone(),
                        k.clone(),
                        v.clone(),
                        &mask,
                        options,
                    )
                    .context
                });
                out.push(decode_record(
                    backend,
                    subject,
                    [batch, context, batch * queries],
                    ms,
                ));
            }
        }
    }
}

/// Prints the `--decode-core` table: per batch and context, the core's time for each of
/// [`CORE_CALLS`], as Markdown.
pub fn print_decode_core(backend: Backend, records: &[Record]) {
    println!(
        "\n## {backend}: the attention core in a decoding step ({HEADS} query heads of {}, causal), median ms\n",
        D_MODEL / HEADS
    );
    let names: Vec<String> = CORE_CALLS
        .iter()
        .map(|&(_, queries, kv)| {
            format!(
                "{queries} {} ({HEADS}:{kv})",
                match queries {
                    1 => "query",
                    _ => "queries",
                }
            )
        })
        .collect();
    println!("| batch | positions | {} |", names.join(" | "));
    println!("|---|---|{}", "---|".repeat(CORE_CALLS.len()));
    let mut rows: Vec<(usize, usize)> = records
        .iter()
        .filter(|r| CORE_CALLS.iter().any(|c| c.0 == r.subject))
        .filter_map(|r| Some((r.batch?, r.context?)))
        .collect();
    rows.sort_unstable();
    rows.dedup();
    for (batch, context) in rows {
        let cells: Vec<String> = CORE_CALLS
            .iter()
            .map(|c| {
                let found = records.iter().find(|r| {
                    r.subject == c.0 && r.batch == Some(batch) && r.context == Some(context)
                });
                match found {
                    Some(r) if r.failed.is_none() => format!("{:.3}", r.median_ms),
                    Some(_) => "failed".into(),
                    None => "—".into(),
                }
            })
            .collect();
        println!("| {batch} | {context} | {} |", cells.join(" | "));
    }
}

/// Sequence lengths of the window benchmark.
pub const WINDOW_LENGTHS: [usize; 2] = [4096, 16384];
/// The window.
pub const WINDOW: usize = 256;

/// The attention core (`[1, HEADS, T, 64]`) forward and backward under a sliding window of
/// `WINDOW` positions and under full causal attention, at each of `WINDOW_LENGTHS`: time
/// and the process's peak resident memory above what it held before (Linux; the host's
/// memory, so for the CPU backends).
pub fn bench_window(
    runs: usize,
    backend: Backend,
    device: &Device,
    out: &mut Vec<Record>,
) -> anyhow::Result<()> {
    let ad = device.clone().autodiff();
    let head_dim = D_MODEL / HEADS;
    for len in WINDOW_LENGTHS {
        // The window first: the full run's buffers, kept by the allocator, would hide its
        // peak.
        for (subject, mask) in [
            ("window-256", AttentionMask::sliding_window(WINDOW)),
            ("causal", AttentionMask::causal()),
        ] {
            eprintln!("{backend}: {subject} at {len} ...");
            let dims = [1, HEADS, len, head_dim];
            let grad = || randn(dims, &ad).require_grad();
            let (q, k, v) = (grad(), grad(), grad());
            let before = peak::reset();
            let call = || {
                let out = mha::scaled_dot_product_attention(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    &mask,
                    SdpaOptions::default(),
                );
                let grads = out.context.sum().backward();
                grads_of([&q, &k, &v], &grads)
            };
            // Never queued: queued batches hold several calls' gradients, and the memory
            // they took stays with the process (mimalloc keeps it), under the next peak.
            let ms = time_synced(runs, device, call)?;
            let peak_mib = before.and_then(|before| Some(peak::read()? - before));
            let what = (subject, "forward+backward");
            out.push(record(backend, what, [1, len, len], ms, peak_mib));
        }
    }
    Ok(())
}

/// The process's peak resident memory (Linux's `VmHWM`), in MiB.
mod peak {
    /// Resets the peak to the memory held now and returns that, if the system allows.
    pub fn reset() -> Option<f64> {
        std::fs::write("/proc/self/clear_refs", "5").ok()?;
        read()
    }

    /// The peak since the last reset.
    pub fn read() -> Option<f64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib / 1024.0)
    }
}

/// Prints the decoding table: per batch and context, the time of one step (and tokens/s)
/// and the cache's speed-ups, as Markdown.
pub fn print_decode(backend: Backend, records: &[Record]) {
    let find = |subject: &str, batch: usize, context: usize| {
        records
            .iter()
            .find(|r| r.subject == subject && r.batch == Some(batch) && r.context == Some(context))
    };
    let mut contexts: Vec<usize> = records
        .iter()
        .filter(|r| r.pass == "decode-step")
        .filter_map(|r| r.context)
        .collect();
    contexts.sort_unstable();
    contexts.dedup();
    println!("\n## {backend}: one decoding step (D {D_MODEL}, H {HEADS}), median ms (tokens/s)\n");
    println!(
        "| batch | positions | mha cached | mha recompute | Burn MhaCache | recompute/cached | Burn/cached |"
    );
    println!("|---|---|---|---|---|---|---|");
    for batch in BATCHES {
        for &context in &contexts {
            let [Some(cached), Some(recompute), Some(burn)] =
                ["mha-cached", "mha-recompute", "burn-cache"].map(|s| find(s, batch, context))
            else {
                continue;
            };
            let cell = |r: &Record| match r.failed {
                Some(_) => "failed".to_string(),
                None => format!(
                    "{:.3} ({:.0})",
                    r.median_ms,
                    r.tokens_per_second.unwrap_or(0.0)
                ),
            };
            let ratio = |r: &Record| match (r.failed.is_some(), cached.failed.is_some()) {
                (false, false) => format!("{:.1}x", r.median_ms / cached.median_ms),
                _ => "—".to_string(),
            };
            println!(
                "| {batch} | {context} | {} | {} | {} | {} | {} |",
                cell(cached),
                cell(recompute),
                cell(burn),
                ratio(recompute),
                ratio(burn)
            );
        }
    }
}

/// Prints the window table, time and peak memory per length and how they grow, as
/// Markdown.
pub fn print_window(backend: Backend, records: &[Record]) {
    let find = |subject: &str, len: usize| {
        records
            .iter()
            .find(|r| r.subject == subject && r.context == Some(len))
    };
    println!(
        "\n## {backend}: attention core [1, {HEADS}, T, 64] forward+backward, window {WINDOW} vs causal\n"
    );
    println!("| T | window ms | window peak MiB | causal ms | causal peak MiB |");
    println!("|---|---|---|---|---|");
    let mib = |r: &Record| r.peak_mib.map_or("—".into(), |m| format!("{m:.0}"));
    for len in WINDOW_LENGTHS {
        if let (Some(w), Some(c)) = (find("window-256", len), find("causal", len)) {
            println!(
                "| {len} | {:.1} | {} | {:.1} | {} |",
                w.median_ms,
                mib(w),
                c.median_ms,
                mib(c)
            );
        }
    }
    let [short, long] = WINDOW_LENGTHS;
    for subject in ["window-256", "causal"] {
        if let (Some(a), Some(b)) = (find(subject, short), find(subject, long)) {
            println!(
                "\n{subject}: T {long} takes {:.2}x the time of T {short} ({}x the length)",
                b.median_ms / a.median_ms,
                long / short
            );
        }
    }
}
