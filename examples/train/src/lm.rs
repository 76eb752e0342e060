//! The text task (`--task text`): character-level language modelling with the
//! decoder-only model, nanoGPT's Shakespeare recipe by default
//! ([`TrainConfig::defaults`](crate::config::TrainConfig::defaults)).
//!
//! - the data: a training stream whose batch of step `s` is the windows starting at
//!   [`batch_start`]`(seed, s, row)` (the PyTorch reference's, so both train on the same
//!   batches, and a resumed run on those the uninterrupted one would have had), and a
//!   fixed set of validation windows spread evenly over the last 10% ([`valid_starts`]);
//! - [`TextBatcher`]: windows of `block + 1` characters into the batches the model reads
//!   (each position's target is the next character, and every position counts);
//! - [`Sampler`]: the next character from the logits: greedy at temperature 0, else drawn
//!   from the softmax of the logits over the temperature, among the `top_k` best.
//!
//! Decoding itself (a prompt, then one character at a time against a key/value cache) is
//! [`TextDecoder`](crate::model::text::TextDecoder).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::tensor::{Device, Int, Tensor, TensorData};

use std::path::PathBuf;

use burn::data::dataloader::DataLoaderBuilder;
use burn::train::metric::store::Split as MetricSplit;

use crate::backend::Backend;
use crate::batch::{FixedShape, SeqBatch};
use crate::config::TrainConfig;
use crate::corpus::{Corpus, TextSplit, batch_start, splitmix64, valid_starts};
use crate::fields::{self, BLOCK_SIZE, DATA, Field, MODEL_KIND, PACK, TEXT_CHECKSUM, VOCAB};
use crate::kind::{Data, Decoding, TaskKind};
use crate::model::{Model, ModelConfig, ModelKind, PositionKind};
use crate::precision::Mixed;
use crate::run_dir::RunDir;
use crate::tasks::{Task, TaskConfig};
use crate::text::{echo, plural};
use crate::training::{Status, Summary, epoch_finals};

/// A window of `block + 1` characters, as ids.
pub type Window = Vec<u32>;

/// The training windows of the epoch `epoch` holds: item `i` of epoch `e` (from 1) is a
/// row of a step of that epoch ([`crate::training::step_row`]: row `i % batch` of step
/// `(e - 1) · steps_per_epoch + i / batch` on one device), as the loaders batch the items
/// in order.
pub struct TextStream {
    /// The corpus.
    pub corpus: Arc<Corpus>,
    /// Characters a model reads.
    pub block: usize,
    /// The run's seed.
    pub seed: u64,
    /// Windows per step.
    pub batch: usize,
    /// Steps per epoch.
    pub steps_per_epoch: usize,
    /// The epoch being trained, set by the training loader.
    pub epoch: Arc<AtomicUsize>,
    /// The devices each step's batch is shared among ([`crate::training::step_row`]).
    pub shares: usize,
}

impl Dataset<Window> for TextStream {
    fn get(&self, index: usize) -> Result<Window, DatasetError> {
        let epoch = self.epoch.load(Ordering::SeqCst).max(1) - 1;
        let (step, row) =
            crate::training::step_row(index, self.steps_per_epoch, self.batch, self.shares);
        let step = epoch * self.steps_per_epoch + step;
        let windows = self.corpus.windows(TextSplit::Train, self.block);
        let start = batch_start(self.seed, step as u64, row as u64, windows);
        Ok(self
            .corpus
            .window(TextSplit::Train, start, self.block)
            .to_vec())
    }

    fn len(&self) -> usize {
        self.steps_per_epoch * self.batch
    }
}

/// The fixed validation windows: `count` starts spread evenly over the validation split.
pub struct ValidWindows {
    corpus: Arc<Corpus>,
    block: usize,
    starts: Vec<usize>,
}

impl ValidWindows {
    /// `count` windows of the validation split (as many as it has, if fewer).
    pub fn new(corpus: Arc<Corpus>, block: usize, count: usize) -> Self {
        let windows = corpus.windows(TextSplit::Valid, block);
        let starts = valid_starts(count.min(windows), windows);
        Self {
            corpus,
            block,
            starts,
        }
    }
}

impl Dataset<Window> for ValidWindows {
    fn get(&self, index: usize) -> Result<Window, DatasetError> {
        let start = self.starts[index];
        Ok(self
            .corpus
            .window(TextSplit::Valid, start, self.block)
            .to_vec())
    }

    fn len(&self) -> usize {
        self.starts.len()
    }
}

/// Stacks windows into the decoder-only model's batch: `joined` is each window but its
/// last character, `joined_targets` each but its first (the next character of every
/// position), no target ignored. The encoder-decoder's fields are placeholders of one
/// PAD each, which the decoder-only model does not read.
#[derive(Clone, Debug)]
pub struct TextBatcher {
    /// The dtype (and loss scale) of the steps that read the batches, when not f32.
    pub mixed: Option<Mixed>,
    /// The devices a step's batch is shared among ([`SeqBatch::loss_weight`]).
    pub shares: usize,
}

impl Default for TextBatcher {
    /// In f32, on one device.
    fn default() -> Self {
        Self {
            mixed: None,
            shares: 1,
        }
    }
}

impl Batcher<Window, SeqBatch> for TextBatcher {
    fn batch(&self, items: Vec<Window>, device: &Device) -> SeqBatch {
        let rows = items.len();
        let block = items.first().map_or(0, |w| w.len().saturating_sub(1));
        let (mut inputs, mut targets) = (
            Vec::with_capacity(rows * block),
            Vec::with_capacity(rows * block),
        );
        for window in &items {
            inputs.extend(window[..block].iter().map(|&c| i64::from(c)));
            targets.extend(window[1..].iter().map(|&c| i64::from(c)));
        }
        let ids = |data: Vec<i64>| {
            Tensor::<2, Int>::from_data(TensorData::new(data, [rows, block]), device)
        };
        let placeholder = || Tensor::<2, Int>::zeros([rows, 1], device);
        SeqBatch {
            joined: ids(inputs),
            joined_targets: ids(targets),
            source: placeholder(),
            source_lengths: vec![1; rows],
            decoder_input: placeholder(),
            decoder_targets: placeholder(),
            packed: None,
            mixed: self.mixed.clone(),
            ignore: None,
            loss_weight: 1.0 / self.shares.max(1) as f32,
        }
    }
}

/// The validation windows of a text run: `valid_examples`, or as many as its validation
/// part has if fewer (0 when its text cannot be read).
pub fn valid_windows(config: &TrainConfig) -> usize {
    corpus(config).map_or(0, |c| {
        config
            .valid_examples
            .min(c.windows(TextSplit::Valid, config.task.block_size))
    })
}

/// The corpus a text run reads: its `--data` file, or the Shakespeare corpus.
///
/// # Errors
/// As [`Corpus::read`] and [`Corpus::new`].
pub fn corpus(config: &TrainConfig) -> anyhow::Result<Corpus> {
    let block = config.task.block_size;
    match &config.task.data {
        Some(path) => Corpus::read(path, block),
        None => Corpus::new(crate::corpus::SHAKESPEARE, SHAKESPEARE_NAME, block),
    }
}

/// What the messages call the built-in text.
const SHAKESPEARE_NAME: &str = "the Shakespeare corpus";

/// The text a run reads, as its messages name it: its `--data` path as given, or the
/// Shakespeare corpus.
fn text_name(config: &TrainConfig) -> String {
    match &config.task.data {
        Some(path) => path.display().to_string(),
        None => SHAKESPEARE_NAME.to_string(),
    }
}

/// Reads the corpus of a text run and sets the run's vocabulary and the text's checksum;
/// those the configuration gives already (a resumed run's) must be the corpus's.
///
/// # Errors
/// As [`corpus`], and when the text's characters are not the run's vocabulary, or the
/// text is not the one the run started on (its checksum).
pub fn load_vocab(config: &mut TrainConfig) -> anyhow::Result<()> {
    let corpus = match corpus(config) {
        Ok(corpus) => corpus,
        // A run's own text (it has a vocabulary): named as the run's setting, and where a
        // relative path is read from (a run started elsewhere).
        Err(err) if config.task.vocab.is_some() => {
            let relative = config.task.data.as_ref().is_some_and(|p| p.is_relative());
            return Err(err.context(format!(
                "the run's text ({} {}{})",
                DATA.name(),
                text_name(config),
                match (relative, std::env::current_dir()) {
                    (true, Ok(here)) => format!(
                        ", a relative path, read from {}: resume from the directory the \
                         run started in",
                        here.display()
                    ),
                    _ => String::new(),
                }
            )));
        }
        Err(err) => return Err(err),
    };
    let vocab: String = corpus.vocab.iter().collect();
    match &config.task.vocab {
        Some(given) if *given != vocab => {
            let given: Vec<char> = given.chars().collect();
            let missing: String = corpus.vocab.iter().filter(|c| !given.contains(c)).collect();
            let extra: String = given.iter().filter(|c| !corpus.vocab.contains(c)).collect();
            anyhow::bail!(
                "{}: its characters are not the run's vocabulary (`task.vocab`, {} characters): \
                 {}{}; the text changed since the run started, or the configuration gives \
                 another text's vocabulary",
                text_name(config),
                given.len(),
                match missing.is_empty() {
                    true => String::new(),
                    false => format!(
                        "new in the text: {}",
                        crate::text::echo(&format!("{missing:?}"))
                    ),
                },
                match extra.is_empty() {
                    true => String::new(),
                    false => format!(
                        "{}gone from the text: {}",
                        if missing.is_empty() { "" } else { "; " },
                        crate::text::echo(&format!("{extra:?}"))
                    ),
                },
            );
        }
        Some(_) => {}
        None => config.task.vocab = Some(vocab),
    }
    match &config.task.text_checksum {
        Some(given) if *given != corpus.checksum => anyhow::bail!(
            "{}: it is not the text the run started on: its checksum is {}, the run's ({}) \
             {given}; the text changed since the run started (its batches would not be the \
             run's), or the configuration gives another text's; train a new run on it",
            text_name(config),
            corpus.checksum,
            TEXT_CHECKSUM.name(),
        ),
        Some(_) => {}
        None => config.task.text_checksum = Some(corpus.checksum),
    }
    Ok(())
}

/// The text task as a kind of task: language modelling on windows of a text with the
/// decoder-only model, its head tied to the embedding, validated by its loss on fixed
/// windows and sampled by `generate`.
pub struct Text;

impl TaskKind for Text {
    /// nanoGPT's CPU recipe for its character-level Shakespeare (4 layers, 4 heads, width
    /// 128, learned positions, block 64, batch 12, 2000 steps (8 epochs of 250, the
    /// validation after each), lr 1e-3 with 100 steps of warmup (a tenth of a shorter
    /// run) and a cosine decay to lr/10, AdamW betas 0.9/0.99 and epsilon 1e-8, weight
    /// decay 0.1 on the matrices and embeddings, the gradients' global norm clipped at 1,
    /// no dropout), validated on 1024 fixed windows.
    fn defaults(&self, task: Task) -> TrainConfig {
        let default = TrainConfig::default();
        TrainConfig {
            task: TaskConfig {
                task,
                ..default.task
            },
            model: ModelConfig {
                d_model: 128,
                n_layers: 4,
                n_heads: 4,
                dropout: 0.0,
                positions: PositionKind::Learned,
                ..default.model
            },
            batch_size: 12,
            lr: 1e-3,
            min_lr_ratio: 0.1,
            adam_beta2: 0.99,
            adam_epsilon: 1e-8,
            weight_decay: 0.1,
            decay_vectors: false,
            grad_clip: 1.0,
            clip_global: true,
            steps_per_epoch: 250,
            epochs: 8,
            valid_examples: 1024,
            ..default
        }
    }

    /// A block of at least one character, and a vocabulary (when given) of distinct
    /// characters in order.
    fn validate_task(&self, task: &TaskConfig) -> anyhow::Result<()> {
        anyhow::ensure!(
            task.block_size >= 1,
            "{} must be at least 1, got 0",
            BLOCK_SIZE.name()
        );
        if let Some(vocab) = &task.vocab {
            let chars: Vec<char> = vocab.chars().collect();
            anyhow::ensure!(
                !chars.is_empty() && chars.windows(2).all(|w| w[0] < w[1]),
                "{} must be distinct characters in order (the text's, as the trainer writes them), got \"{}\"",
                VOCAB.name(),
                echo(vocab)
            );
        }
        Ok(())
    }

    /// The decoder-only model, without packing.
    fn validate(&self, config: &TrainConfig) -> anyhow::Result<()> {
        anyhow::ensure!(
            config.model.kind == ModelKind::DecoderOnly,
            "{} = {}: the text task trains the decoder-only model (a language model)",
            MODEL_KIND.name(),
            config.model.kind.name()
        );
        anyhow::ensure!(
            !config.pack,
            "{}: the text task's windows are all --block-size long; there is nothing to \
             pack",
            PACK.name()
        );
        Ok(())
    }

    fn ignored_fields(&self) -> (&'static [Field], &'static str, &'static str) {
        (
            fields::SYNTHETIC_ONLY,
            "it is a setting of the synthetic tasks",
            "",
        )
    }

    /// nanoGPT's.
    fn most_warmup(&self) -> usize {
        100
    }

    /// The text's characters (0 until the run's vocabulary is set).
    fn vocab_size(&self, task: &TaskConfig) -> usize {
        task.vocab.as_ref().map_or(0, |v| v.chars().count())
    }

    /// The block.
    fn max_len(&self, task: &TaskConfig) -> usize {
        task.block_size
    }

    fn longer_task(&self, _config: &TrainConfig) -> Option<TaskConfig> {
        None
    }

    /// The windows all have one shape: none.
    fn fixed_shape(&self, _config: &TrainConfig, _backend: Backend) -> Option<FixedShape> {
        None
    }

    /// nanoGPT's language model (the head tied to the token embedding, its
    /// initialisation) over the run's vocabulary.
    fn init_model(&self, config: &TrainConfig, device: &Device) -> anyhow::Result<Model> {
        anyhow::ensure!(
            config.task.vocab_size() > 0,
            "the text task's model needs the run's vocabulary (`task.vocab`)"
        );
        config
            .model
            .init_language_model(config.task.vocab_size(), config.max_len(), device)
    }

    /// The embedding alone: the head is tied to it.
    fn head_parameters(&self, v: f64, d: f64) -> f64 {
        v * d
    }

    /// The vocabulary is the text's.
    fn size_flags(&self) -> (&'static [&'static str], &'static str) {
        (&[], "--block-size")
    }

    /// Reads the text's vocabulary into the run's (or checks it against the run's).
    fn prepare(&self, config: &mut TrainConfig) -> anyhow::Result<()> {
        load_vocab(config)
    }

    fn describe(&self, config: &TrainConfig, model: &str) -> String {
        format!(
            "task text ({}, a vocabulary of {}, windows of {}), {model}, {} of {} ({} each), \
             validating on {} after each",
            text_name(config),
            plural(config.task.vocab_size(), "character"),
            plural(config.task.block_size, "character"),
            plural(config.epochs, "epoch"),
            plural(config.steps_per_epoch, "step"),
            plural(config.batch_size, "window"),
            plural(valid_windows(config), "fixed window"),
        )
    }

    fn model_note(&self) -> &'static str {
        ", head tied to the embedding"
    }

    fn warnings(&self, _config: &TrainConfig) -> Vec<String> {
        Vec::new()
    }

    fn data(
        &self,
        config: &TrainConfig,
        epoch: Arc<AtomicUsize>,
        shares: usize,
        _backend: Backend,
        mixed: Option<&Mixed>,
    ) -> anyhow::Result<Data> {
        let corpus = Arc::new(corpus(config)?);
        let block = config.task.block_size;
        let stream = TextStream {
            corpus: corpus.clone(),
            block,
            seed: config.seed,
            batch: config.batch_size,
            steps_per_epoch: config.steps_per_epoch,
            epoch,
            shares,
        };
        let valid = ValidWindows::new(corpus, block, config.valid_examples);
        let batcher = |mixed, shares| TextBatcher { mixed, shares };
        Ok(Data {
            train: DataLoaderBuilder::new(batcher(mixed.cloned(), shares))
                .batch_size(config.batch_size / shares)
                .build(stream),
            // Validation batches of 64 whatever the training's: the loss is the mean over
            // the windows either way, and larger batches cost less per window.
            valid: DataLoaderBuilder::new(batcher(mixed.map(Mixed::inference), 1))
                .batch_size(64)
                .build(valid),
            tokens_per_step: (config.batch_size * block) as f64,
        })
    }

    /// The loss says it all.
    fn token_accuracy(&self) -> bool {
        false
    }

    /// The validation loss of the last epoch (on the fixed windows, with the final
    /// weights).
    fn finish(
        &self,
        _model: &Model,
        config: &TrainConfig,
        run: &RunDir,
        _backend: Backend,
        _device: &Device,
        summary: &mut Summary,
    ) {
        let valid = epoch_finals(&run.0, config.epochs, &MetricSplit::Valid);
        summary.valid_loss = valid.last().copied();
        summary.valid_bits_per_char = summary.valid_loss.map(|l| l / std::f64::consts::LN_2);
        summary.status = Status::Finished;
    }

    fn result_lines(&self, config: &TrainConfig, run: &RunDir, summary: &Summary) -> Vec<String> {
        let loss = summary.valid_loss.unwrap_or(f64::NAN);
        vec![
            format!(
                "validation loss {loss:.4} nats per character ({:.3} bits) on {}; the last \
                 epoch's mean training loss {:.4}; {:.1} s, {:.0} characters/s on {}",
                loss / std::f64::consts::LN_2,
                plural(valid_windows(config), "window"),
                summary.final_loss.unwrap_or(f64::NAN),
                summary.wall_seconds,
                summary.tokens_per_second,
                summary.backend,
            ),
            format!(
                "sample it: train generate --out {}{} --tokens 500",
                run.0.display(),
                match config.task.data {
                    None => " --prompt \"ROMEO:\"",
                    Some(_) => "",
                }
            ),
        ]
    }

    /// The training loss per step and the validation loss of each epoch, over its fixed
    /// windows; no attention maps.
    fn draw(
        &self,
        config: &TrainConfig,
        run: &RunDir,
        _device: &Device,
    ) -> anyhow::Result<Vec<PathBuf>> {
        let valid: Vec<Vec<f64>> = epoch_finals(&run.0, config.epochs, &MetricSplit::Valid)
            .into_iter()
            .map(|loss| vec![loss])
            .collect();
        let title = format!(
            "text, {} characters: loss per step (nats per character)",
            config.task.block_size
        );
        crate::plots::loss_curve(
            &run.loss_curve(),
            &crate::plots::losses(config, run, &MetricSplit::Train),
            &valid,
            &title,
        )?;
        Ok(Vec::new())
    }

    fn decoding(&self) -> Decoding {
        Decoding::Sampling
    }

    fn not_inspected(&self) -> Option<&'static str> {
        Some(
            "a text run; inspect measures heads on a synthetic task's held-out examples and \
             does not read text runs (sample this one with `generate --prompt`)",
        )
    }
}

/// Chooses the next character from a position's logits.
#[derive(Clone, Debug)]
pub struct Sampler {
    /// 0: the most likely character (greedy); else the logits are divided by it.
    pub temperature: f64,
    /// Draw among the `k` most likely characters only (and any tied with the `k`-th).
    pub top_k: Option<usize>,
    /// SplitMix64's state.
    state: u64,
}

impl Sampler {
    /// A sampler whose draws are a function of `seed` alone.
    ///
    /// # Errors
    /// When the temperature is negative or not finite, or `top_k` is 0.
    pub fn new(temperature: f64, top_k: Option<usize>, seed: u64) -> anyhow::Result<Self> {
        anyhow::ensure!(
            temperature.is_finite() && temperature >= 0.0,
            "--temperature must be 0 (greedy) or positive, got {temperature}"
        );
        anyhow::ensure!(top_k != Some(0), "--top-k must be at least 1, got 0");
        Ok(Self {
            temperature,
            top_k,
            state: splitmix64(seed),
        })
    }

    /// A number in [0, 1).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        (splitmix64(self.state) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The next character's id from its logits (one per character of the vocabulary).
    ///
    /// # Panics
    /// If `logits` is empty.
    pub fn pick(&mut self, logits: &[f32]) -> usize {
        let best = argmax(logits);
        if self.temperature == 0.0 {
            return best;
        }
        let floor = match self.top_k {
            Some(k) if k < logits.len() => {
                let mut sorted = logits.to_vec();
                sorted.sort_unstable_by(|a, b| b.total_cmp(a));
                sorted[k - 1]
            }
            _ => f32::NEG_INFINITY,
        };
        let top = f64::from(logits[best]);
        let weights: Vec<f64> = logits
            .iter()
            .map(|&l| match l >= floor {
                true => ((f64::from(l) - top) / self.temperature).exp(),
                false => 0.0,
            })
            .collect();
        let mut left = self.uniform() * weights.iter().sum::<f64>();
        for (i, &w) in weights.iter().enumerate() {
            if w > 0.0 && left < w {
                return i;
            }
            left -= w;
        }
        // Rounding left a sliver past the last weight: the last one that can be drawn.
        weights.iter().rposition(|&w| w > 0.0).unwrap_or(best)
    }
}

/// The index of the largest logit, the first of equals (as Burn's `argmax`).
pub fn argmax(logits: &[f32]) -> usize {
    assert!(!logits.is_empty(), "no logits to choose from");
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn temperature_zero_is_the_argmax_and_top_k_keeps_to_the_best() {
        let logits = [0.5f32, 2.0, -1.0, 2.0, 1.9, -3.0];
        let mut greedy = Sampler::new(0.0, None, 1).unwrap();
        assert_eq!(greedy.pick(&logits), 1, "the first of two equal maxima");
        // Top 3: characters 1, 3 and 4; over many draws each appears, nothing else does.
        let mut sampler = Sampler::new(1.0, Some(3), 7).unwrap();
        let mut seen = [0usize; 6];
        for _ in 0..3000 {
            seen[sampler.pick(&logits)] += 1;
        }
        assert_eq!([seen[0], seen[2], seen[5]], [0, 0, 0], "{seen:?}");
        assert!(seen[1] > 700 && seen[3] > 700 && seen[4] > 600, "{seen:?}");
        // Without top-k, at a high temperature, every character is drawn.
        let mut hot = Sampler::new(5.0, None, 7).unwrap();
        let mut seen = [0usize; 6];
        for _ in 0..3000 {
            seen[hot.pick(&logits)] += 1;
        }
        assert!(seen.iter().all(|&n| n > 100), "{seen:?}");
        // Top-1 is greedy whatever the temperature.
        let mut one = Sampler::new(3.0, Some(1), 9).unwrap();
        assert!((0..200).all(|_| one.pick(&[0.0, 0.1, 5.0, 4.9]) == 2));
    }

    #[test]
    fn draws_follow_the_softmax_and_the_seed() {
        // Two characters, logits 0 and ln 3: probabilities 1/4 and 3/4.
        let logits = [0.0f32, 3f32.ln()];
        let mut sampler = Sampler::new(1.0, None, 11).unwrap();
        let n = 20_000;
        let second = (0..n).filter(|_| sampler.pick(&logits) == 1).count();
        let share = second as f64 / n as f64;
        assert!((share - 0.75).abs() < 0.015, "{share}");
        // At temperature 2: 1 and sqrt(3), a share of sqrt(3) / (1 + sqrt(3)).
        let mut warm = Sampler::new(2.0, None, 11).unwrap();
        let second = (0..n).filter(|_| warm.pick(&logits) == 1).count();
        let wanted = 3f64.sqrt() / (1.0 + 3f64.sqrt());
        assert!((second as f64 / n as f64 - wanted).abs() < 0.015);
        let draws = |seed| {
            let mut s = Sampler::new(0.8, Some(2), seed).unwrap();
            (0..50)
                .map(|_| s.pick(&[0.1, 0.3, 0.2]))
                .collect::<Vec<_>>()
        };
        assert_eq!(draws(5), draws(5));
        assert_ne!(draws(5), draws(6));
    }

    #[test]
    fn bad_settings_are_named() {
        let err = Sampler::new(-0.5, None, 1).unwrap_err().to_string();
        assert_eq!(
            err,
            "--temperature must be 0 (greedy) or positive, got -0.5"
        );
        let err = Sampler::new(f64::NAN, None, 1).unwrap_err().to_string();
        assert!(err.starts_with("--temperature must be"), "{err}");
        let err = Sampler::new(1.0, Some(0), 1).unwrap_err().to_string();
        assert_eq!(err, "--top-k must be at least 1, got 0");
    }
}
