//! What the trainer does differently for a synthetic task and for the text task, in one
//! place: [`TaskKind`], implemented by [`Synthetic`] (here) for `copy`, `reverse`, `sort`
//! and `add`, and by [`Text`](crate::lm::Text) for `text`. The configuration, the memory
//! estimate, the training loop, the pictures and the commands ask the run's kind
//! ([`Task::kind`]) rather than which task it is.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;

use burn::data::dataloader::{DataLoader, DataLoaderBuilder};
use burn::tensor::Device;

use crate::backend::Backend;
use crate::batch::{FixedShape, SeqBatch, SeqBatcher};
use crate::config::TrainConfig;
use crate::fields::{self, Field};
use crate::model::Model;
use crate::precision::Mixed;
use crate::run_dir::RunDir;
use crate::tasks::{FIRST, Split, Task, TaskConfig, TaskDataset};
use crate::text::plural;
use crate::training::{self, Summary, TrainStream};

/// A run's examples: the training loader (one pass an epoch), the validation loader, and
/// the tokens a step trains on (for throughput).
pub struct Data {
    /// Each device's share of every step's batch.
    pub train: Arc<dyn DataLoader<SeqBatch>>,
    /// The validation batches, read after each epoch.
    pub valid: Arc<dyn DataLoader<SeqBatch>>,
    /// Tokens (characters) a whole step reads.
    pub tokens_per_step: f64,
}

/// How `generate` answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decoding {
    /// One input, parsed in the task's grammar, answered greedily.
    Greedy,
    /// A prompt continued by sampling, a character at a time.
    Sampling,
}

/// What sets a kind of task apart, from the defaults of its configuration to what
/// `generate` does with its runs.
pub trait TaskKind: Sync {
    /// The defaults of a run of `task`, one of this kind's tasks.
    fn defaults(&self, task: Task) -> TrainConfig;

    /// Checks the task's own values (`config.task`); the error names the flag and the
    /// field.
    fn validate_task(&self, task: &TaskConfig) -> anyhow::Result<()>;

    /// Checks what this kind asks of the rest of the configuration (the model, packing).
    fn validate(&self, config: &TrainConfig) -> anyhow::Result<()>;

    /// The fields no task of this kind reads ([`fields::TEXT_ONLY`] or
    /// [`fields::SYNTHETIC_ONLY`]), and how a message refusing one says whose they are
    /// and what to do: "it is a setting of the text task", ", or train on text with
    /// --task text".
    fn ignored_fields(&self) -> (&'static [Field], &'static str, &'static str);

    /// The most warmup steps a run takes when the configuration sets none.
    fn most_warmup(&self) -> usize;

    /// Tokens in the vocabulary.
    fn vocab_size(&self, task: &TaskConfig) -> usize;

    /// The longest sequence a model reads.
    fn max_len(&self, task: &TaskConfig) -> usize;

    /// The task at longer inputs than any trained on, for the length-generalisation test,
    /// if the kind and the model have one.
    fn longer_task(&self, config: &TrainConfig) -> Option<TaskConfig>;

    /// The fixed batch shape on `backend`, if any.
    fn fixed_shape(&self, config: &TrainConfig, backend: Backend) -> Option<FixedShape>;

    /// The model, initialised (the device already seeded).
    fn init_model(&self, config: &TrainConfig, device: &Device) -> anyhow::Result<Model>;

    /// Parameters of the token embedding and the output head, at vocabulary `v` and width
    /// `d`, for the memory estimate.
    fn head_parameters(&self, v: f64, d: f64) -> f64;

    /// The flags the vocabulary grows with, and the one the sequence length does, for the
    /// memory estimate's advice.
    fn size_flags(&self) -> (&'static [&'static str], &'static str);

    /// Completes a checked configuration before a run starts or resumes (the text task
    /// reads its text's vocabulary).
    fn prepare(&self, config: &mut TrainConfig) -> anyhow::Result<()>;

    /// What a run is about to do, for its first line: "task reverse (lengths 8..=16, 10
    /// symbols), {model}, 5 epochs of 200 steps". `model` describes the model.
    fn describe(&self, config: &TrainConfig, model: &str) -> String;

    /// A note on the model in that line (the text task's tied head).
    fn model_note(&self) -> &'static str;

    /// Warnings about a run's settings, printed before it starts.
    fn warnings(&self, config: &TrainConfig) -> Vec<String>;

    /// The training and validation examples; `epoch` is the epoch being trained (the
    /// training loader's epochs read it), `shares` the devices a step is shared among,
    /// `mixed` the run's half precision (its loss scale the one the run reports).
    fn data(
        &self,
        config: &TrainConfig,
        epoch: Arc<AtomicUsize>,
        shares: usize,
        backend: Backend,
        mixed: Option<&Mixed>,
    ) -> anyhow::Result<Data>;

    /// Whether the learner logs token accuracy beside the loss.
    fn token_accuracy(&self) -> bool;

    /// The evaluation of a run whose epochs are all trained, with its final `model`, into
    /// `summary`, which is then finished (unless a Ctrl-C stops the evaluation).
    fn finish(
        &self,
        model: &Model,
        config: &TrainConfig,
        run: &RunDir,
        backend: Backend,
        device: &Device,
        summary: &mut Summary,
    );

    /// The lines saying what a finished run reached.
    fn result_lines(&self, config: &TrainConfig, run: &RunDir, summary: &Summary) -> Vec<String>;

    /// Draws a finished run's pictures (the fonts registered); returns the attention maps'
    /// files.
    fn draw(
        &self,
        config: &TrainConfig,
        run: &RunDir,
        device: &Device,
    ) -> anyhow::Result<Vec<PathBuf>>;

    /// How `generate` answers a run of this kind.
    fn decoding(&self) -> Decoding;

    /// Why `inspect` does not read runs of this kind, if it does not.
    fn not_inspected(&self) -> Option<&'static str>;
}

impl Task {
    /// What kind of task it is.
    pub fn kind(self) -> &'static dyn TaskKind {
        match self {
            Task::Text => &crate::lm::Text,
            Task::Copy | Task::Reverse | Task::Sort | Task::Add => &Synthetic,
        }
    }
}

/// The synthetic tasks: examples drawn from rules ([`crate::tasks::TaskRules`]),
/// sequence to sequence, evaluated by greedy decoding on the held-out split.
pub struct Synthetic;

impl TaskKind for Synthetic {
    fn defaults(&self, task: Task) -> TrainConfig {
        let default = TrainConfig::default();
        TrainConfig {
            task: TaskConfig {
                task,
                ..default.task
            },
            ..default
        }
    }

    fn validate_task(&self, task: &TaskConfig) -> anyhow::Result<()> {
        task.validate_synthetic()
    }

    fn validate(&self, _config: &TrainConfig) -> anyhow::Result<()> {
        Ok(())
    }

    fn ignored_fields(&self) -> (&'static [Field], &'static str, &'static str) {
        (
            fields::TEXT_ONLY,
            "it is a setting of the text task",
            ", or train on text with --task text",
        )
    }

    fn most_warmup(&self) -> usize {
        50
    }

    fn vocab_size(&self, task: &TaskConfig) -> usize {
        FIRST + task.n_symbols + task.task.rules().own_tokens().len()
    }

    /// `input SEP output EOS`.
    fn max_len(&self, task: &TaskConfig) -> usize {
        task.max_input() + task.max_output() + 2
    }

    /// Lengths `max_len + 1 ..= max_len * 3 / 2` (17..=24 for 8..=16); `None` for a model
    /// that cannot read them (learned absolute positions).
    fn longer_task(&self, config: &TrainConfig) -> Option<TaskConfig> {
        let max = config.task.max_len;
        config
            .model
            .positions
            .reads_longer_inputs()
            .then(|| TaskConfig {
                min_len: max + 1,
                max_len: (max * 3 / 2).max(max + 1),
                ..config.task.clone()
            })
    }

    /// See `fixed_shapes`.
    fn fixed_shape(&self, config: &TrainConfig, backend: Backend) -> Option<FixedShape> {
        config
            .fixed_shapes
            .unwrap_or(backend.is_gpu())
            .then(|| FixedShape::of(&config.task))
    }

    fn init_model(&self, config: &TrainConfig, device: &Device) -> anyhow::Result<Model> {
        config
            .model
            .init(config.task.vocab_size(), config.max_len(), device)
    }

    /// The embedding, and the head's weights and bias.
    fn head_parameters(&self, v: f64, d: f64) -> f64 {
        2.0 * v * d + v
    }

    fn size_flags(&self) -> (&'static [&'static str], &'static str) {
        (&["--symbols"], "--max-len")
    }

    fn prepare(&self, _config: &mut TrainConfig) -> anyhow::Result<()> {
        Ok(())
    }

    fn describe(&self, config: &TrainConfig, model: &str) -> String {
        format!(
            "task {} (lengths {}..={}, {}), {model}, {} of {}",
            config.task.task.name(),
            config.task.min_len,
            config.task.max_len,
            plural(config.task.n_symbols, "symbol"),
            plural(config.epochs, "epoch"),
            plural(config.steps_per_epoch, "step"),
        )
    }

    fn model_note(&self) -> &'static str {
        ""
    }

    fn warnings(&self, config: &TrainConfig) -> Vec<String> {
        let mut warnings = Vec::new();
        if let Some([_, valid]) = config.task.split_sizes()
            && valid < 20
        {
            warnings.push(format!(
                "the held-out split has only {valid} distinct inputs; its accuracy says little"
            ));
        }
        if let Some(longer) = config.longer_task()
            && config.length_test().is_none()
        {
            warnings.push(format!(
                "inputs of {} to {} symbols have no held-out input: the test at longer \
                 inputs is left out",
                longer.min_len, longer.max_len
            ));
        }
        warnings
    }

    fn data(
        &self,
        config: &TrainConfig,
        epoch: Arc<AtomicUsize>,
        shares: usize,
        backend: Backend,
        mixed: Option<&Mixed>,
    ) -> anyhow::Result<Data> {
        let fixed = config.fixed_shape(backend);
        let train = TrainStream {
            task: config.task.clone(),
            seed: config.seed,
            steps: config.steps_per_epoch,
            batch: config.batch_size,
            shares,
            epoch,
        };
        let valid = TaskDataset::new(
            config.task.clone(),
            config.seed,
            Split::Valid,
            config.valid_examples,
        );
        Ok(Data {
            train: DataLoaderBuilder::new(SeqBatcher {
                fixed,
                pack: config.pack_width(),
                mixed: mixed.cloned(),
                shares,
            })
            .batch_size(config.batch_size / shares)
            .build(train),
            valid: DataLoaderBuilder::new(SeqBatcher {
                fixed,
                pack: None,
                mixed: mixed.map(Mixed::inference),
                shares: 1,
            })
            .batch_size(config.batch_size)
            .build(valid),
            tokens_per_step: config.batch_size as f64 * config.task.mean_tokens(),
        })
    }

    fn token_accuracy(&self) -> bool {
        true
    }

    /// The held-out accuracies at the training lengths and (when the model reads them)
    /// longer ones.
    fn finish(
        &self,
        model: &Model,
        config: &TrainConfig,
        _run: &RunDir,
        backend: Backend,
        device: &Device,
        summary: &mut Summary,
    ) {
        training::finish(model, config, config.fixed_shape(backend), device, summary)
    }

    fn result_lines(&self, _config: &TrainConfig, _run: &RunDir, summary: &Summary) -> Vec<String> {
        vec![format!(
            "held-out exact accuracy {:.2}% (token accuracy {:.2}%) on {} sequences; the last \
             epoch's mean training loss {:.4}; {:.1} s, {:.0} tokens/s on {}",
            100.0 * summary.exact_accuracy.unwrap_or(0.0),
            100.0 * summary.token_accuracy.unwrap_or(0.0),
            summary.eval_examples,
            summary.final_loss.unwrap_or(f64::NAN),
            summary.wall_seconds,
            summary.tokens_per_second,
            summary.backend,
        )]
    }

    /// The loss curves of both splits, and the attention maps.
    fn draw(
        &self,
        config: &TrainConfig,
        run: &RunDir,
        device: &Device,
    ) -> anyhow::Result<Vec<PathBuf>> {
        use burn::train::metric::store::Split as MetricSplit;
        let title = format!(
            "{}, {}: loss per step",
            config.task.task.name(),
            config.model.kind.name()
        );
        crate::plots::loss_curve(
            &run.loss_curve(),
            &crate::plots::losses(config, run, &MetricSplit::Train),
            &crate::plots::losses(config, run, &MetricSplit::Valid),
            &title,
        )?;
        crate::plots::attention_heatmaps(config, run, device)
    }

    fn decoding(&self) -> Decoding {
        Decoding::Greedy
    }

    fn not_inspected(&self) -> Option<&'static str> {
        None
    }
}
