//! Training with Burn's `Learner` (progress display, metrics, checkpoints, resume), then
//! greedy evaluation on the held-out split and the run's summary.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use burn::config::Config;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::transform::{SamplerDataset, SamplerDatasetOptions};
use burn::module::Module;
use burn::optim::AdamWConfig;
use burn::optim::OptimizerRecord;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::lr_scheduler::LrSchedulerConfig;
use burn::optim::lr_scheduler::LrSchedulerRecord;
use burn::optim::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::optim::lr_scheduler::sequential::SequentialLrSchedulerConfig;
use burn::tensor::Device;
use burn::train::checkpoint::{Checkpoint, KeepLastNCheckpoints};
use burn::train::logger::FileMetricLogger;
use burn::train::metric::store::Split as MetricSplit;
use burn::train::metric::{AccuracyMetric, LearningRateMetric, LossMetric, NumericEntry};
use burn::train::{Learner, SupervisedTraining};
use serde::Serialize;

use crate::data::{FixedShape, PAD, SeqBatcher, Split, TaskConfig, TaskDataset};
use crate::model::{Model, ModelConfig};

/// Every hyperparameter of a run; saved as `config.json` beside the checkpoints.
#[derive(Config, Debug)]
pub struct TrainConfig {
    /// The task.
    pub task: TaskConfig,
    /// The model.
    pub model: ModelConfig,
    /// Sequences per step.
    #[config(default = 64)]
    pub batch_size: usize,
    /// Peak learning rate of AdamW.
    #[config(default = 3e-3)]
    pub lr: f64,
    /// Steps of linear warmup from lr/100 to lr; cosine decay to lr/100 afterwards.
    #[config(default = 50)]
    pub warmup_steps: usize,
    /// AdamW weight decay.
    #[config(default = 0.01)]
    pub weight_decay: f32,
    /// Gradient clipping by global norm.
    #[config(default = 1.0)]
    pub grad_clip: f32,
    /// Steps per epoch (a checkpoint is written after each epoch).
    #[config(default = 100)]
    pub steps_per_epoch: usize,
    /// Epochs.
    #[config(default = 8)]
    pub epochs: usize,
    /// Held-out sequences for the validation loss after each epoch.
    #[config(default = 256)]
    pub valid_examples: usize,
    /// Held-out sequences decoded greedily at the end.
    #[config(default = 1000)]
    pub eval_examples: usize,
    /// Seed of the data and of the initial weights.
    #[config(default = 42)]
    pub seed: u64,
    /// Pad every batch to the longest possible example, so the backend sees one shape.
    /// `None` (the default) turns it on for GPU backends, which compile kernels per shape,
    /// and off on the CPU, where padding only costs time.
    #[config(default = "None")]
    pub fixed_shapes: Option<bool>,
}

impl TrainConfig {
    /// Checks the values; the error names the field.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.task.validate()?;
        for (name, value) in [
            ("batch_size", self.batch_size),
            ("steps_per_epoch", self.steps_per_epoch),
            ("epochs", self.epochs),
            ("valid_examples", self.valid_examples),
            ("eval_examples", self.eval_examples),
        ] {
            anyhow::ensure!(value > 0, "{name} must be at least 1, got 0");
        }
        anyhow::ensure!(
            self.lr > 0.0 && self.lr <= 1.0,
            "lr must be in (0, 1], got {}",
            self.lr
        );
        anyhow::ensure!(
            self.grad_clip > 0.0,
            "grad_clip must be positive, got {}",
            self.grad_clip
        );
        anyhow::ensure!(
            self.warmup_steps < self.total_steps(),
            "warmup_steps = {} must be below epochs x steps_per_epoch = {}",
            self.warmup_steps,
            self.total_steps()
        );
        Ok(())
    }

    fn total_steps(&self) -> usize {
        self.epochs * self.steps_per_epoch
    }

    /// Longest sequence a model reads: `input SEP output EOS`.
    pub fn max_len(&self) -> usize {
        self.task.max_input() + self.task.max_output() + 2
    }

    /// The fixed batch shape on `backend`, if any (see `fixed_shapes`).
    pub fn fixed_shape(&self, backend: Backend) -> Option<FixedShape> {
        self.fixed_shapes
            .unwrap_or(backend.is_gpu())
            .then(|| FixedShape::of(&self.task))
    }

    /// The model, initialised from the seed.
    pub fn init_model(&self, device: &Device) -> anyhow::Result<Model> {
        device.seed(self.seed);
        self.model
            .init(self.task.vocab_size(), self.max_len(), device)
    }
}

/// The files of a run directory.
pub struct RunDir(pub PathBuf);

impl RunDir {
    /// `config.json`.
    pub fn config(&self) -> PathBuf {
        self.0.join("config.json")
    }

    /// The model checkpoint of `epoch`.
    pub fn checkpoint(&self, epoch: usize) -> PathBuf {
        self.0.join("checkpoint").join(format!("model-{epoch}.bpk"))
    }

    /// The final model.
    pub fn model(&self) -> PathBuf {
        self.0.join("model.bpk")
    }

    /// A checkpoint file of `epoch`: `kind` is `model`, `optim` or `scheduler`.
    fn checkpoint_file(&self, kind: &str, epoch: usize) -> PathBuf {
        self.0
            .join("checkpoint")
            .join(format!("{kind}-{epoch}.bpk"))
    }

    /// The newest epoch whose model, optimizer and scheduler checkpoints are all there (a
    /// run killed while writing one falls back to the epoch before), if any.
    pub fn last_checkpoint(&self) -> Option<usize> {
        let entries = std::fs::read_dir(self.0.join("checkpoint")).ok()?;
        entries
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                name.strip_prefix("model-")?
                    .strip_suffix(".bpk")?
                    .parse()
                    .ok()
            })
            .filter(|&epoch| {
                ["optim", "scheduler"]
                    .iter()
                    .all(|k| self.checkpoint_file(k, epoch).exists())
            })
            .max()
    }

    /// Checks that the three checkpoint files of `epoch` load, naming the first that
    /// does not.
    pub fn check_checkpoint(
        &self,
        config: &TrainConfig,
        epoch: usize,
        device: &Device,
    ) -> anyhow::Result<()> {
        load_model(config, &self.checkpoint(epoch), device)?;
        let optim = self.checkpoint_file("optim", epoch);
        <OptimizerRecord as Checkpoint>::load(optim.clone()).map_err(|e| {
            anyhow::anyhow!("{}: cannot load the optimizer state ({e})", optim.display())
        })?;
        let scheduler = self.checkpoint_file("scheduler", epoch);
        <LrSchedulerRecord as Checkpoint>::load(scheduler.clone()).map_err(|e| {
            anyhow::anyhow!(
                "{}: cannot load the scheduler state ({e})",
                scheduler.display()
            )
        })?;
        Ok(())
    }
}

/// Loads `config.json` of a run, with an error naming the file.
pub fn load_config(path: &Path) -> anyhow::Result<TrainConfig> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let config: TrainConfig = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a training configuration", path.display()))?;
    config
        .validate()
        .with_context(|| format!("{}", path.display()))?;
    Ok(config)
}

/// Loads model weights from `path` into a model of `config`, with an error naming the
/// file and what is wrong.
pub fn load_model(config: &TrainConfig, path: &Path, device: &Device) -> anyhow::Result<Model> {
    anyhow::ensure!(path.exists(), "{}: no such checkpoint", path.display());
    config
        .init_model(device)?
        .try_load_file(path)
        .map_err(|e| anyhow::anyhow!("{}: cannot load the model ({e})", path.display()))
}

/// What a run produced, written as `summary.json`.
#[derive(Serialize, Debug)]
pub struct Summary {
    /// The task.
    pub task: String,
    /// The model kind.
    pub model: String,
    /// The backend.
    pub backend: String,
    /// Optimizer steps, over all (resumed) runs.
    pub steps: usize,
    /// Training loss of the first step of this invocation (after a resume: of the first
    /// resumed step).
    pub first_loss: f64,
    /// Mean training loss of the last epoch.
    pub final_loss: f64,
    /// Held-out sequences entirely right, greedy decoding.
    pub exact_accuracy: f64,
    /// Held-out output tokens right, greedy decoding.
    pub token_accuracy: f64,
    /// Training wall time of this invocation, in seconds.
    pub wall_seconds: f64,
    /// Non-padding tokens trained on per second.
    pub tokens_per_second: f64,
    /// Held-out sequences decoded.
    pub eval_examples: usize,
}

/// Trains (from scratch or from the last checkpoint) and evaluates.
pub fn train(
    config: &TrainConfig,
    dir: &RunDir,
    resume: bool,
    device: &Device,
    backend: Backend,
) -> anyhow::Result<Summary> {
    let fixed = config.fixed_shape(backend);
    let start_epoch = if resume {
        let epoch = dir.last_checkpoint().with_context(|| {
            format!(
                "{}: no checkpoint to resume from",
                dir.0.join("checkpoint").display()
            )
        })?;
        // Fails here, with the file named, rather than inside the learner.
        dir.check_checkpoint(config, epoch, device)?;
        if epoch >= config.epochs {
            bail!(
                "{}: the run already finished its {} epochs",
                dir.checkpoint(epoch).display(),
                config.epochs
            );
        }
        Some(epoch)
    } else {
        std::fs::create_dir_all(&dir.0)
            .with_context(|| format!("cannot create {}", dir.0.display()))?;
        config
            .save(dir.config())
            .with_context(|| format!("cannot write {}", dir.config().display()))?;
        None
    };

    let train_device = device.clone().autodiff();
    let model = config.init_model(&train_device)?;
    let optim = AdamWConfig::new()
        .with_weight_decay(config.weight_decay)
        .with_grad_clipping(Some(GradientClippingConfig::Norm(config.grad_clip)))
        .init();
    let floor = config.lr / 100.0;
    let warmup = config.warmup_steps.max(1);
    let scheduler = SequentialLrSchedulerConfig::new(
        vec![
            LrSchedulerConfig::Linear(LinearLrSchedulerConfig::new(floor, config.lr, warmup)),
            LrSchedulerConfig::Cosine(
                CosineAnnealingLrSchedulerConfig::new(config.lr, config.total_steps() - warmup)
                    .with_min_lr(floor),
            ),
        ],
        vec![warmup],
    )
    .init()
    .map_err(|e| anyhow::anyhow!("learning-rate schedule: {e}"))?;

    // Fresh examples every epoch: a sampler over a practically endless training split.
    let train_set = SamplerDataset::new(
        TaskDataset::new(config.task.clone(), config.seed, Split::Train, 1 << 40),
        SamplerDatasetOptions::default()
            .with_replacement()
            .with_fixed_size(config.steps_per_epoch * config.batch_size)
            .with_seed(config.seed + start_epoch.unwrap_or(0) as u64),
    );
    let valid_set = TaskDataset::new(
        config.task.clone(),
        config.seed,
        Split::Valid,
        config.valid_examples,
    );
    let loader_train = DataLoaderBuilder::new(SeqBatcher { fixed })
        .batch_size(config.batch_size)
        .build(train_set);
    let loader_valid = DataLoaderBuilder::new(SeqBatcher { fixed })
        .batch_size(config.batch_size)
        .build(valid_set);

    let mut training = SupervisedTraining::new(&dir.0, loader_train, loader_valid)
        .num_epochs(config.epochs)
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new())
        .metric_train_numeric(AccuracyMetric::new().with_pad_token(PAD))
        .metric_valid_numeric(AccuracyMetric::new().with_pad_token(PAD))
        .metric_train_numeric(LearningRateMetric::new())
        .with_default_checkpointers()
        .with_checkpointing_strategy(KeepLastNCheckpoints::new(2))
        .summary();
    if let Some(epoch) = start_epoch {
        training = training.checkpoint(epoch);
    }

    let started = Instant::now();
    let result = training.launch(Learner::new(model, optim, scheduler));
    let wall = started.elapsed().as_secs_f64();
    if let Some(err) = result.error {
        bail!("training failed: {err}");
    }
    let model = result.model;
    model
        .clone()
        .save_file(dir.model())
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", dir.model().display()))?;

    let trained_epochs = config.epochs - start_epoch.unwrap_or(0);
    let tokens = trained_epochs as f64
        * config.steps_per_epoch as f64
        * config.batch_size as f64
        * mean_tokens(&config.task);
    let (exact, token) = evaluate(&model, config, fixed, device);
    let losses = epoch_losses(&dir.0, config.epochs, &MetricSplit::Train);
    let first_loss = losses
        .get(start_epoch.unwrap_or(0))
        .and_then(|l| l.first().copied())
        .unwrap_or(f64::NAN);
    let final_loss = losses
        .last()
        .map(|l| l.iter().sum::<f64>() / l.len().max(1) as f64)
        .unwrap_or(f64::NAN);
    Ok(Summary {
        task: format!("{:?}", config.task.task),
        model: format!("{:?}", config.model.kind),
        backend: backend.name().to_string(),
        steps: config.total_steps(),
        first_loss,
        final_loss,
        exact_accuracy: exact,
        token_accuracy: token,
        wall_seconds: wall,
        tokens_per_second: tokens / wall,
        eval_examples: config.eval_examples,
    })
}

/// Mean tokens per sequence a model processes (`input SEP output EOS`), for throughput.
fn mean_tokens(task: &TaskConfig) -> f64 {
    let mean_len = (task.min_len + task.max_len) as f64 / 2.0;
    let (input, output) = match task.task {
        crate::data::Task::Add => (2.0 * mean_len + 1.0, mean_len + 1.0),
        _ => (mean_len, mean_len),
    };
    input + output + 2.0
}

/// Greedy decoding of `eval_examples` held-out sequences: (exact, token) accuracy.
/// Without a fixed shape, inputs of one length are decoded together (no padding); with
/// one, every batch has `batch_size` rows of the fixed width (the last one filled up with
/// repeats that are not counted).
pub fn evaluate(
    model: &Model,
    config: &TrainConfig,
    fixed: Option<FixedShape>,
    device: &Device,
) -> (f64, f64) {
    let model = model.valid().to_device(device);
    let examples: Vec<_> = (0..config.eval_examples)
        .map(|i| config.task.example(config.seed, Split::Valid, i))
        .collect();
    let rows = config.batch_size.max(64);
    let groups: Vec<Vec<&crate::data::Example>> = match fixed {
        Some(_) => examples.chunks(rows).map(|c| c.iter().collect()).collect(),
        None => {
            let mut by_len: std::collections::BTreeMap<usize, Vec<&crate::data::Example>> =
                Default::default();
            for ex in &examples {
                by_len.entry(ex.input.len()).or_default().push(ex);
            }
            by_len
                .into_values()
                .flat_map(|g| g.chunks(rows).map(<[_]>::to_vec).collect::<Vec<_>>())
                .collect()
        }
    };
    let (mut exact, mut right, mut total) = (0usize, 0usize, 0usize);
    for chunk in groups {
        let mut inputs: Vec<Vec<usize>> = chunk.iter().map(|e| e.input.clone()).collect();
        if fixed.is_some() {
            inputs.resize(rows, inputs[0].clone());
        }
        let outputs = model.generate(&inputs, config.task.max_output(), fixed, device);
        for (ex, out) in chunk.iter().zip(outputs) {
            exact += usize::from(out == ex.output);
            right += ex.output.iter().zip(&out).filter(|(a, b)| a == b).count();
            total += ex.output.len();
        }
    }
    (
        exact as f64 / examples.len() as f64,
        right as f64 / total.max(1) as f64,
    )
}

/// Per-step values of the `Loss` metric of each epoch `1..=epochs`, from the learner's logs.
pub fn epoch_losses(dir: &Path, epochs: usize, split: &MetricSplit) -> Vec<Vec<f64>> {
    let mut logger = FileMetricLogger::new(dir);
    (1..=epochs)
        .map_while(|epoch| {
            use burn::train::logger::MetricLogger;
            let entries = logger.read_numeric("Loss", epoch, split).ok()?;
            // Per-step entries; the epoch's closing aggregate is left out.
            let steps: Vec<f64> = entries
                .iter()
                .filter(|e| !matches!(e, NumericEntry::Final(_)))
                .map(|e| e.current())
                .collect();
            (!steps.is_empty()).then_some(steps)
        })
        .collect()
}

/// A backend compiled into this build.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// Burn's pure-Rust CPU backend.
    Flex,
    /// The ndarray CPU backend.
    Ndarray,
    /// wgpu: Vulkan, Metal or DX12 (lavapipe without a GPU).
    Wgpu,
    /// CUDA.
    Cuda,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl Backend {
    /// Those this build has, best first: a GPU if compiled in, then flex, then ndarray.
    pub fn compiled() -> Vec<Backend> {
        let all = [
            (Backend::Cuda, cfg!(feature = "cuda")),
            (Backend::Wgpu, cfg!(feature = "wgpu")),
            (Backend::Flex, cfg!(feature = "flex")),
            (Backend::Ndarray, cfg!(feature = "ndarray")),
        ];
        all.into_iter()
            .filter(|(_, on)| *on)
            .map(|(b, _)| b)
            .collect()
    }

    /// Whether it runs on a GPU (where kernels are compiled per shape).
    pub fn is_gpu(self) -> bool {
        matches!(self, Backend::Wgpu | Backend::Cuda)
    }

    /// Its name, as printed and written to the summary.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Flex => "flex",
            Backend::Ndarray => "ndarray",
            Backend::Wgpu => "wgpu",
            Backend::Cuda => "cuda",
        }
    }

    /// Its device, or an error if this build does not have it.
    #[allow(deprecated, unreachable_code)]
    pub fn device(self) -> anyhow::Result<Device> {
        match self {
            #[cfg(feature = "flex")]
            Backend::Flex => return Ok(Device::flex()),
            #[cfg(feature = "ndarray")]
            Backend::Ndarray => return Ok(Device::ndarray()),
            #[cfg(feature = "wgpu")]
            Backend::Wgpu => return Ok(Device::wgpu(burn::tensor::DeviceKind::DefaultDevice)),
            #[cfg(feature = "cuda")]
            Backend::Cuda => return Ok(Device::cuda(0)),
            _ => {}
        }
        anyhow::bail!(
            "--backend {}: this build has {:?}; build with `--features {}`",
            self.name(),
            Backend::compiled()
                .iter()
                .map(|b| b.name())
                .collect::<Vec<_>>(),
            self.name()
        )
    }
}
