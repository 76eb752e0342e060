//! How much memory a command will take, estimated from the configuration before anything
//! is built, and the machine's available memory: a run or an inspection that would not
//! fit is refused at once, with the estimate, the memory available and the flags that
//! drive it, instead of swapping or being killed minutes later.
//!
//! The estimate counts the largest tensors: the parameters with their gradients and the
//! two AdamW moments; one step's logits `[B, T, V]` and what the cross-entropy keeps of
//! them; the attention weights `[B, H, T, T]` and the activations `[B, T, d]` of every
//! layer. Each is multiplied by the copies a step holds at once, chosen from the peak
//! resident memory (`/usr/bin/time -v`) of short runs and inspections on flex: a rough
//! bound, meant to catch what cannot fit, not to plan to the last gigabyte. The check is
//! made on the CPU backends, whose tensors live in this memory; a GPU's are on the card.

use crate::backend::Backend;
use crate::config::TrainConfig;
use crate::model::ModelKind;

/// Bytes of one `f32`.
const F32: f64 = 4.0;
/// Copies of each parameter during training: weight, gradient, two AdamW moments in a
/// step; at an epoch's end, the checkpoint's records of the weights and moments and their
/// bytes besides them (the peak of a run of 52M parameters on flex held 7.8 copies' worth,
/// 2026-12-07: 1.9 GB, 4 copies counted 1.1).
const PARAMETER_COPIES: f64 = 8.0;
/// Copies of the logits a training step holds at its peak: the logits, the
/// log-softmax, their gradients, and what the allocator keeps of the last step's.
const LOGIT_COPIES: f64 = 4.0;
/// Copies of a layer's attention weights a training step holds: scores, weights, their
/// gradients.
const ATTENTION_COPIES: f64 = 4.0;
/// Activations `[B, T, d]` a block keeps for its backward pass: its input, the norms,
/// queries, keys, values, context, and the feed-forward's hidden layer (4d) before and
/// after its activation.
const BLOCK_ACTIVATIONS: f64 = 20.0;
/// Copies of a layer's attention weights `inspect` holds while it computes the head
/// statistics: the weights returned, the scores, and the statistics' temporaries.
const INSPECT_ATTENTION_COPIES: f64 = 4.0;
/// Bytes an example of `t` tokens takes, held twice (the list and its batches): its input
/// and output as `usize` tokens and their two vectors' headers.
fn example_bytes(t: f64) -> f64 {
    2.0 * (t * 8.0 + 48.0)
}
/// The process itself: the binary, the backend's pools, the data (a tiny run's peak
/// was 72 to 102 MB on flex, 2026-11-27).
const BASE: f64 = 80e6;

/// A term of an estimate: what it is, its bytes, the flags that make it larger.
#[derive(Clone, Debug)]
pub struct Part {
    /// What it is, for the message: "logits [64, 34, 1000003]".
    pub what: String,
    /// Its bytes.
    pub bytes: f64,
    /// The flags it grows with.
    pub flags: Vec<&'static str>,
}

/// The memory a command is estimated to need, by its largest terms.
#[derive(Clone, Debug)]
pub struct Estimate {
    /// What needs it: "this run", "inspect --examples 100000".
    pub doing: String,
    /// The terms, besides the process's own memory.
    pub parts: Vec<Part>,
}

/// The shapes the estimates read from a configuration.
struct Shape {
    /// Sequence length (the longest a model reads, `input SEP output EOS`).
    t: f64,
    /// Vocabulary.
    v: f64,
    /// Width.
    d: f64,
    /// Heads.
    h: f64,
    /// Attention layers (the encoder-decoder's decoder has two per block).
    attention_layers: f64,
    /// Blocks.
    blocks: f64,
    /// Parameters.
    parameters: f64,
}

impl Shape {
    fn of(config: &TrainConfig) -> Self {
        let m = &config.model;
        let (t, v, d) = (
            config.max_len() as f64,
            config.task.vocab_size() as f64,
            m.d_model as f64,
        );
        let layers = m.n_layers as f64;
        let (blocks, attention_layers, per_block) = match m.kind {
            // Attention 4d², feed-forward 8d².
            ModelKind::DecoderOnly => (layers, layers, 12.0 * d * d),
            // The decoder's blocks have cross-attention too.
            ModelKind::EncoderDecoder => (2.0 * layers, 3.0 * layers, 14.0 * d * d),
        };
        Self {
            t,
            v,
            d,
            h: m.n_heads as f64,
            attention_layers,
            blocks,
            // Token embeddings and the LM head (the text task's is the embedding), then
            // the blocks (and learned positions).
            parameters: config.kind().head_parameters(v, d) + blocks * per_block + t * d,
        }
    }
}

/// The flags the run's vocabulary grows with (a synthetic task's `--symbols`; the text
/// task's is its text's), then `more`.
fn with_vocab(config: &TrainConfig, more: Vec<&'static str>) -> Vec<&'static str> {
    let mut flags = config.kind().size_flags().0.to_vec();
    flags.extend(more);
    flags
}

/// `--batch-size` and the flag the sequence length grows with (`--max-len`, or the text
/// task's `--block-size`), then `more`.
fn per_sequence(config: &TrainConfig, more: Vec<&'static str>) -> Vec<&'static str> {
    let mut flags = vec!["--batch-size", config.kind().size_flags().1];
    flags.extend(more);
    flags
}

/// The memory a training run of `config` needs at its peak, one step's.
pub fn training(config: &TrainConfig) -> Estimate {
    let s = Shape::of(config);
    let b = config.batch_size as f64;
    let tokens = b * s.t;
    Estimate {
        doing: "this run".into(),
        parts: vec![
            Part {
                what: format!(
                    "{:.1}M parameters with their gradients, AdamW moments and checkpoints",
                    s.parameters / 1e6
                ),
                bytes: s.parameters * F32 * PARAMETER_COPIES,
                flags: with_vocab(config, vec!["--d-model", "--layers"]),
            },
            Part {
                what: format!(
                    "one step's logits [{}, {}, {}]",
                    config.batch_size,
                    config.max_len(),
                    config.task.vocab_size()
                ),
                bytes: tokens * s.v * F32 * LOGIT_COPIES,
                flags: with_vocab(config, per_sequence(config, vec![])),
            },
            Part {
                what: format!(
                    "attention weights [{}, {}, {}, {}] in {} layers",
                    config.batch_size,
                    config.model.n_heads,
                    config.max_len(),
                    config.max_len(),
                    s.attention_layers
                ),
                bytes: s.attention_layers * b * s.h * s.t * s.t * F32 * ATTENTION_COPIES,
                flags: per_sequence(config, vec!["--heads", "--layers"]),
            },
            Part {
                what: "the blocks' activations".into(),
                bytes: s.blocks * tokens * s.d * F32 * BLOCK_ACTIVATIONS,
                flags: per_sequence(config, vec!["--d-model", "--layers"]),
            },
            Part {
                // Read before the estimate (`check_text` refuses one too large to read),
                // its ids are held through the run.
                what: "the text's character ids".into(),
                bytes: config.task.data.as_deref().map_or(0.0, |path| {
                    let len = std::fs::metadata(path).map_or(0, |m| m.len());
                    text_bytes(len) - len as f64
                }),
                flags: vec![],
            },
        ],
    }
}

/// Bytes a text of `len` bytes takes while it is read: the file, and one `u32` id a
/// character (at most one character a byte); the ids are held through the run.
fn text_bytes(len: u64) -> f64 {
    5.0 * len as f64
}

/// Refuses to read a text (`what`, `len` bytes) that, with its character ids, would not
/// fit in the memory available: whatever the backend, the text is in this memory.
///
/// # Errors
/// Naming the text, its size, the estimate and the memory available.
pub fn check_text(what: &str, len: u64) -> anyhow::Result<()> {
    match available() {
        Some(available) => check_text_against(what, len, available),
        None => Ok(()),
    }
}

/// As [`check_text`], against `available` bytes.
fn check_text_against(what: &str, len: u64, available: u64) -> anyhow::Result<()> {
    let need = BASE + text_bytes(len);
    anyhow::ensure!(
        need <= available as f64,
        "{what} is {} of text: reading it with its character ids needs about {}, more than \
         the {} this machine has available: give a shorter text",
        bytes(len as f64),
        bytes(need),
        bytes(available as f64)
    );
    Ok(())
}

/// The memory `inspect` needs to measure the heads of a run of `config` on `examples`
/// held-out examples: all of them held, and the tensors of one batch of at most
/// [`crate::inspect::BATCH`] (every attention layer's weights kept for the statistics).
pub fn inspecting(config: &TrainConfig, examples: usize) -> Estimate {
    let s = Shape::of(config);
    // Every pass holds one batch's tensors; the examples themselves are all held.
    let batch = examples.min(crate::inspect::BATCH);
    let b = batch as f64;
    Estimate {
        doing: format!("inspect --examples {examples}"),
        parts: vec![
            Part {
                what: format!(
                    "attention weights [{batch}, {}, {}, {}] in {} layers",
                    config.model.n_heads,
                    config.max_len(),
                    config.max_len(),
                    s.attention_layers
                ),
                bytes: s.attention_layers * b * s.h * s.t * s.t * F32 * INSPECT_ATTENTION_COPIES,
                flags: vec!["--examples"],
            },
            Part {
                what: format!(
                    "logits [{batch}, {}, {}]",
                    config.max_len(),
                    config.task.vocab_size()
                ),
                bytes: b * s.t * s.v * F32 * 2.0,
                flags: vec!["--examples"],
            },
            Part {
                // The importance by gradient keeps them for its backward pass.
                what: "the blocks' activations".into(),
                bytes: s.blocks * b * s.t * s.d * F32 * BLOCK_ACTIVATIONS,
                flags: vec!["--examples"],
            },
            Part {
                what: format!("{examples} held-out examples, held twice"),
                bytes: examples as f64 * example_bytes(s.t),
                flags: vec!["--examples"],
            },
        ],
    }
}

impl Estimate {
    /// Bytes in all, the process's own included.
    pub fn total(&self) -> f64 {
        BASE + self.parts.iter().map(|p| p.bytes).sum::<f64>()
    }

    /// Refuses, on a CPU backend, an estimate above the machine's available memory.
    ///
    /// # Errors
    /// With the estimate, its largest terms, the memory available and the flags that
    /// drive it.
    pub fn check(&self, backend: Backend) -> anyhow::Result<()> {
        match (backend.is_gpu(), available()) {
            (false, Some(available)) => self.check_against(available),
            _ => Ok(()),
        }
    }

    /// Refuses an estimate above `available` bytes.
    ///
    /// # Errors
    /// As [`check`](Self::check).
    pub fn check_against(&self, available: u64) -> anyhow::Result<()> {
        let total = self.total();
        if total <= available as f64 {
            return Ok(());
        }
        let mut parts = self.parts.clone();
        parts.sort_by(|a, b| b.bytes.total_cmp(&a.bytes));
        let largest: Vec<String> = parts
            .iter()
            .filter(|p| p.bytes >= 0.1 * total)
            .map(|p| format!("{} {}", p.what, bytes(p.bytes)))
            .collect();
        let mut flags: Vec<&str> = Vec::new();
        for flag in parts.iter().flat_map(|p| &p.flags) {
            if !flags.contains(flag) {
                flags.push(flag);
            }
        }
        anyhow::bail!(
            "{} needs about {} of memory ({}), more than the {} this machine has available: \
             lower {}",
            self.doing,
            bytes(total),
            largest.join(", "),
            bytes(available as f64),
            flags.join(", ")
        )
    }
}

/// The memory this process may still take, in bytes: Linux's `MemAvailable`, or less
/// when a cgroup (a container's limit) allows less; `None` where neither can be read.
pub fn available() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    let machine = kb * 1024;
    let read = |name: &str| -> Option<u64> {
        std::fs::read_to_string(format!("/sys/fs/cgroup/{name}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let cgroup = match (read("memory.max"), read("memory.current")) {
        (Some(max), Some(current)) => Some(max.saturating_sub(current)),
        _ => None,
    };
    Some(cgroup.map_or(machine, |c| c.min(machine)))
}

/// `2.3 GB`, `512 MB`, `1.2 TB`.
fn bytes(n: f64) -> String {
    match n {
        n if n >= 1e12 => format!("{:.1} TB", n / 1e12),
        n if n >= 1e9 => format!("{:.1} GB", n / 1e9),
        n => format!("{:.0} MB", n / 1e6),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_too_large_for_the_memory_is_refused_before_it_is_read() {
        check_text_against("big.txt", 1_000_000_000, 6_000_000_000).unwrap();
        let err = check_text_against("big.txt", 2_000_000_000, 6_000_000_000)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "big.txt is 2.0 GB of text: reading it with its character ids needs about \
             10.1 GB, more than the 6.0 GB this machine has available: give a shorter text"
        );
    }

    #[test]
    fn a_run_that_does_not_fit_is_refused_with_its_estimate_and_flags() {
        let small = TrainConfig::default();
        let estimate = training(&small);
        assert!(estimate.total() < 1e9, "{estimate:?}");
        estimate.check_against(8_000_000_000).unwrap();
        let mut wide = TrainConfig::default();
        wide.task.n_symbols = 1_000_000;
        let err = training(&wide)
            .check_against(23_000_000_000)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("this run needs about ") && err.contains("logits [64, 34, 1000003]"),
            "{err}"
        );
        assert!(
            err.contains(
                "than the 23.0 GB this machine has available: lower --symbols, \
                 --batch-size, --max-len"
            ),
            "{err}"
        );
        // inspect holds one batch's tensors whatever --examples is, and every example.
        inspecting(&small, 256)
            .check_against(1_000_000_000)
            .unwrap();
        let batch = inspecting(&small, 64).total();
        assert_eq!(
            inspecting(&small, 100_000).parts[0].bytes,
            inspecting(&small, 64).parts[0].bytes
        );
        assert!(inspecting(&small, 100_000).total() < batch + 1e8);
        let err = inspecting(&small, 100_000_000)
            .check_against(8_000_000_000)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("inspect --examples 100000000 needs about"),
            "{err}"
        );
        assert!(err.contains("100000000 held-out examples"), "{err}");
        assert!(err.ends_with("lower --examples"), "{err}");
    }

    #[test]
    fn the_available_memory_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            let available = available().expect("MemAvailable");
            assert!(available > 10_000_000, "{available}");
        }
    }
}
