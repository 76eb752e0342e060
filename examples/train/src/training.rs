//! Training with Burn's `Learner` (metrics, checkpoints in the run's layout, resume,
//! a clean stop on Ctrl-C), then greedy evaluation on the held-out split and the run's
//! summary.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, bail};
use std::sync::atomic::{AtomicUsize, Ordering};

use burn::data::dataloader::{DataLoader, DataLoaderIterator};
use burn::data::dataset::{Dataset, DatasetError};
use burn::module::Module;
use burn::module::ParamGroup;
use burn::optim::ModuleOptimizer;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::tensor::Device;
use burn::train::checkpoint::KeepLastNCheckpoints;
use burn::train::logger::FileMetricLogger;
use burn::train::metric::store::Split as MetricSplit;
use burn::train::metric::{AccuracyMetric, LearningRateMetric, LossMetric, NumericEntry};
use burn::train::{
    ExecutionStrategy, Interrupter, Learner, LearningResult, MultiDeviceOptim, SupervisedTraining,
};
use serde::{Deserialize, Serialize};

use mha::optim::AdamWConfig;

use crate::backend::Backend;
use crate::batch::{FixedShape, SeqBatch};
use crate::config::TrainConfig;
use crate::interrupt;
use crate::kind::Data;
use crate::model::{Model, ModelKind, PositionKind, Stepping};
use crate::precision::{Precision, compute_copy};
use crate::progress::{Plan, Progress, Reached};
use crate::run_dir::{RunDir, write_atomically};
use crate::tasks::{Example, PAD, Split, Task, TaskConfig};

/// How a run ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Status {
    /// Every epoch trained and the held-out split decoded.
    Finished,
    /// Stopped early (Ctrl-C): the last complete checkpoint stays, `--resume` continues
    /// (after the last epoch, it finishes the evaluation).
    Interrupted,
    /// Stopped at the first step whose training loss was not finite (NaN or infinite);
    /// `last_checkpoint_epoch` is the newest checkpoint with finite weights.
    Diverged,
    /// Being trained or evaluated by a command now, or killed while it was (then
    /// `--resume` continues it from its last complete checkpoint): written when training
    /// starts, replaced when the command ends.
    Running,
}

/// What a run did, written as `summary.json`.
#[derive(Serialize, Deserialize, Debug, Clone)]
pub struct Summary {
    /// Finished, or interrupted (then the accuracies are absent).
    pub status: Status,
    /// The task.
    pub task: Task,
    /// The model kind.
    pub model: ModelKind,
    /// The backend.
    pub backend: Backend,
    /// The devices of the backend the steps ran on.
    #[serde(default = "one")]
    pub devices: usize,
    /// The optimizer steps done, counted over the whole run (resumed runs included); an
    /// interrupted run restarts from `last_checkpoint_epoch`.
    pub steps_done: usize,
    /// The optimizer steps of the whole run.
    pub steps_total: usize,
    /// The newest complete checkpoint, if any (for a diverged run, the newest with finite
    /// weights).
    pub last_checkpoint_epoch: Option<usize>,
    /// The step whose training loss was not finite, when the run diverged.
    #[serde(default)]
    pub diverged_at_step: Option<usize>,
    /// Training loss of the first step of this invocation (after a resume: of the first
    /// resumed step).
    pub first_loss: Option<f64>,
    /// Mean training loss of the last epoch that ended.
    pub final_loss: Option<f64>,
    /// Held-out sequences entirely right, greedy decoding.
    pub exact_accuracy: Option<f64>,
    /// Held-out output tokens right, greedy decoding.
    pub token_accuracy: Option<f64>,
    /// Held-out sequences decoded (at the training lengths, and as many longer ones).
    pub eval_examples: usize,
    /// Text task: the validation loss after the last epoch, in nats per character (the
    /// mean over the fixed validation windows).
    #[serde(default)]
    pub valid_loss: Option<f64>,
    /// Text task: the same in bits per character.
    #[serde(default)]
    pub valid_bits_per_char: Option<f64>,
    /// How the model knows where tokens are.
    pub positions: PositionKind,
    /// The dtype the steps computed in (the weights are f32 whatever it is).
    #[serde(default)]
    pub dtype: Precision,
    /// f16 only: the steps of this invocation skipped because their scaled gradients
    /// overflowed (each halved the loss scale), and the scale at the end.
    #[serde(default)]
    pub loss_scale: Option<LossScale>,
    /// The input lengths of the length-generalisation test: longer than any trained on
    /// (absent for learned positions, which end at the longest training sequence).
    pub longer_lengths: Option<[usize; 2]>,
    /// Sequences of `longer_lengths` entirely right, greedy decoding.
    pub longer_exact_accuracy: Option<f64>,
    /// Output tokens of `longer_lengths` right, greedy decoding.
    pub longer_token_accuracy: Option<f64>,
    /// The epochs the model in `model.bpk` was trained for, when there is one (a run being
    /// extended keeps its finished model until the new one replaces it).
    #[serde(default)]
    pub model_epochs: Option<usize>,
    /// Training wall time of this invocation, in seconds.
    pub wall_seconds: f64,
    /// Non-padding tokens trained on per second in this invocation.
    pub tokens_per_second: f64,
}

fn one() -> usize {
    1
}

/// What f16's dynamic loss scale did in a run.
#[derive(Serialize, Deserialize, Debug, Clone, Copy, PartialEq)]
pub struct LossScale {
    /// Steps skipped because their scaled gradients were not finite.
    pub skipped_steps: usize,
    /// The scale at the end.
    pub final_scale: f32,
}

/// Trains `config` in `run` from the checkpoint of epoch `start_epoch` (0: from scratch)
/// on `devices` (the first the main one: with several, Burn's multi-device strategy),
/// printing a line every `log_every` steps, then saves the model and decodes the held-out
/// split. A Ctrl-C stops after the step it comes in (or between evaluation batches): the
/// summary then says where the run got to.
///
/// # Errors
/// When the learner fails, or a file cannot be written.
pub fn train(
    config: &TrainConfig,
    run: &RunDir,
    start_epoch: usize,
    devices: &[Device],
    backend: Backend,
    log_every: usize,
) -> anyhow::Result<Summary> {
    let device = devices.first().context("no device to train on")?;
    let shares = devices.len();
    let mixed = config.dtype.mixed();
    let train_device = device.clone().autodiff();
    let model = config.init_model(&train_device)?.with_stepping(Stepping {
        global_clip: config.clip_global.then_some(config.grad_clip),
        devices: shares,
    });

    // Fresh examples every epoch, each epoch's a function of the seed and its number
    // alone: a resumed run trains on the batches the uninterrupted one would have.
    let epoch = Arc::new(AtomicUsize::new(start_epoch));
    // Each device's loader batches its share of every step.
    // The batches' loss scale is the run's: the summary reads it back.
    let data = config
        .kind()
        .data(config, epoch.clone(), shares, backend, mixed.as_ref())?;
    let tokens_per_step = data.tokens_per_step;
    let data = Data {
        train: Arc::new(EpochLoader {
            inner: data.train,
            epoch,
            advances: true,
            seed: config.seed,
            device: train_device.clone(),
        }),
        ..data
    };

    let plan = Plan {
        epochs: config.epochs,
        steps_per_epoch: config.steps_per_epoch,
        batch_size: config.batch_size,
        tokens_per_step,
        log_every,
        shares,
    };
    let reached = Arc::new(Mutex::new(Reached {
        step: start_epoch * config.steps_per_epoch,
        ..Reached::default()
    }));
    let progress = Progress::new(plan, run.learner_summary(), reached.clone());
    let learner = Learner::new(model, optimizer(config), config.lr_schedule()?);
    let (result, wall) = launch(config, run, start_epoch, devices, data, progress, learner);
    let reached = *reached.lock().expect("not poisoned");
    if let Some(err) = result.error {
        // Where the run got to, for --resume, before the error.
        let summary = Summary {
            steps_done: reached.step,
            first_loss: reached.first_loss,
            final_loss: reached.epoch_loss,
            ..Summary::unfinished(config, run, backend)
        };
        let written = write_summary(run, &summary)
            .map(|()| format!("; summary: {}", run.summary().display()))
            .unwrap_or_default();
        bail!(
            "training failed at step {} of {}: {err}{written}",
            reached.step,
            config.total_steps()
        );
    }
    let steps = reached
        .step
        .saturating_sub(start_epoch * config.steps_per_epoch);
    let mut summary = Summary {
        steps_done: reached.step,
        first_loss: reached.first_loss,
        final_loss: reached.epoch_loss,
        wall_seconds: wall,
        tokens_per_second: steps as f64 * tokens_per_step / wall.max(1e-9),
        loss_scale: mixed.and_then(|m| m.scaler).map(|scaler| {
            let scaler = scaler.lock().expect("not poisoned");
            LossScale {
                skipped_steps: scaler.skipped(),
                final_scale: scaler.scale(),
            }
        }),
        ..Summary::unfinished(config, run, backend)
    };
    if let Some(step) = reached.diverged {
        summary.status = Status::Diverged;
        summary.diverged_at_step = Some(step);
        summary.last_checkpoint_epoch = run
            .newest_usable_checkpoint(config, device)
            .unwrap_or_else(|err| {
                eprintln!("warning: no checkpoint recorded in the summary: {err:#}");
                None
            });
        return Ok(summary);
    }
    if result.interrupted.is_some() || interrupt::requested() {
        return Ok(summary);
    }
    save_model(&result.model, run)?;
    summary.model_epochs = Some(config.epochs);
    config
        .kind()
        .finish(&result.model, config, run, backend, device, &mut summary);
    Ok(summary)
}

/// Trains `learner` on `data` from the checkpoint of epoch `start_epoch` (0: none) on
/// `devices`, with Burn's learner and the run's metrics (the loss, the token accuracy if
/// the task's kind logs it, the learning rate), checkpoints, progress lines and Ctrl-C;
/// returns what it learned and the seconds it took.
fn launch(
    config: &TrainConfig,
    run: &RunDir,
    start_epoch: usize,
    devices: &[Device],
    data: Data,
    progress: Progress,
    learner: Learner<Model>,
) -> (LearningResult<Model>, f64) {
    let interrupter = Interrupter::new();
    let mut training = SupervisedTraining::new(&run.0, data.train, data.valid)
        .num_epochs(config.epochs)
        .metric_train_numeric(LossMetric::new())
        .metric_valid_numeric(LossMetric::new());
    if config.kind().token_accuracy() {
        training = training
            .metric_train_numeric(AccuracyMetric::new().with_pad_token(PAD))
            .metric_valid_numeric(AccuracyMetric::new().with_pad_token(PAD));
    }
    let mut training = training
        .metric_train_numeric(LearningRateMetric::new())
        .with_custom_checkpointers(
            run.checkpointer("model"),
            run.checkpointer("optim"),
            run.checkpointer("scheduler"),
        )
        .with_checkpointing_strategy(KeepLastNCheckpoints::new(2))
        .with_interrupter(interrupter.clone())
        .renderer(Box::new(progress))
        .summary();
    if start_epoch > 0 {
        training = training.checkpoint(start_epoch);
    }
    if devices.len() > 1 {
        // Burn's data-parallel strategy: a worker per device steps on its share, and the
        // gradients are summed on the first device, where the optimizer steps and the
        // validation runs.
        training = training.with_training_strategy(
            ExecutionStrategy::multi(devices.to_vec(), MultiDeviceOptim::OptimMainDevice).into(),
        );
    }
    interrupt::watch(&interrupter);
    let started = Instant::now();
    let result = training.launch(learner);
    let wall = started.elapsed().as_secs_f64();
    interrupt::unwatch();
    (result, wall)
}

/// Writes the trained model to `model.bpk`.
///
/// # Errors
/// When the file cannot be written.
pub fn save_model(model: &Model, run: &RunDir) -> anyhow::Result<()> {
    let partial = run.0.join("model.bpk.partial");
    model
        .clone()
        .save_file(&partial)
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", partial.display()))?;
    crate::run_dir::install_weights(&partial, &run.model())
}

/// The final evaluation of a trained model: the held-out accuracies at the training
/// lengths and (when the model reads them) longer ones, into `summary`, whose status
/// becomes finished unless a Ctrl-C stops it first.
pub fn finish(
    model: &Model,
    config: &TrainConfig,
    fixed: Option<FixedShape>,
    device: &Device,
    summary: &mut Summary,
) {
    summary.status = Status::Interrupted;
    // An earlier evaluation's (another count of examples): absent until measured again.
    summary.clear_evaluation();
    let Some((exact, token)) = evaluate(model, config, &config.task, fixed, device) else {
        return;
    };
    summary.exact_accuracy = Some(exact);
    summary.token_accuracy = Some(token);
    if let Some(longer) = config.length_test() {
        let fixed = fixed.map(|_| FixedShape::of(&longer));
        let Some((exact, token)) = evaluate(model, config, &longer, fixed, device) else {
            return;
        };
        summary.longer_lengths = Some([longer.min_len, longer.max_len]);
        summary.longer_exact_accuracy = Some(exact);
        summary.longer_token_accuracy = Some(token);
    }
    summary.status = Status::Finished;
}

/// The summary of a run whose epochs are all trained: the one it wrote, or when it wrote
/// none (killed during the final evaluation), one from its metric logs.
pub fn trained_summary(config: &TrainConfig, run: &RunDir, backend: Backend) -> Summary {
    let written = std::fs::read_to_string(run.summary())
        .ok()
        .and_then(|text| serde_json::from_str::<Summary>(&text).ok());
    // A summary written while the run trained has no figures yet; one written while its
    // trained model was evaluated (every step done) has them.
    let figures = |s: &Summary| s.status != Status::Running || s.steps_done == config.total_steps();
    if let Some(summary) = written.filter(figures) {
        return Summary {
            backend,
            eval_examples: config.eval_examples,
            last_checkpoint_epoch: run.last_complete_epoch(),
            ..summary
        };
    }
    let losses = epoch_losses(
        &run.0,
        config.epochs,
        &MetricSplit::Train,
        config.devices.count(),
    );
    let mean = |steps: &Vec<f64>| steps.iter().sum::<f64>() / steps.len() as f64;
    Summary {
        steps_done: config.total_steps(),
        first_loss: losses.first().and_then(|steps| steps.first().copied()),
        final_loss: losses.last().map(mean),
        ..Summary::unfinished(config, run, backend)
    }
}

impl Summary {
    /// The summary written while a command trains the run from epoch `start_epoch`.
    pub fn running(
        config: &TrainConfig,
        run: &RunDir,
        backend: Backend,
        start_epoch: usize,
    ) -> Self {
        Self {
            status: Status::Running,
            steps_done: start_epoch * config.steps_per_epoch,
            ..Self::unfinished(config, run, backend)
        }
    }

    /// Forgets the held-out accuracies (those of an earlier evaluation).
    pub fn clear_evaluation(&mut self) {
        self.exact_accuracy = None;
        self.token_accuracy = None;
        self.longer_lengths = None;
        self.longer_exact_accuracy = None;
        self.longer_token_accuracy = None;
    }

    /// The summary of a run of `config` in `run` that has not finished: interrupted,
    /// nothing done or measured yet.
    fn unfinished(config: &TrainConfig, run: &RunDir, backend: Backend) -> Self {
        Self {
            status: Status::Interrupted,
            task: config.task.task,
            model: config.model.kind,
            backend,
            devices: config.devices.count(),
            steps_done: 0,
            steps_total: config.total_steps(),
            last_checkpoint_epoch: run.last_complete_epoch(),
            diverged_at_step: None,
            first_loss: None,
            final_loss: None,
            exact_accuracy: None,
            token_accuracy: None,
            eval_examples: config.eval_examples,
            valid_loss: None,
            valid_bits_per_char: None,
            positions: config.model.positions,
            dtype: config.dtype,
            loss_scale: None,
            longer_lengths: None,
            longer_exact_accuracy: None,
            longer_token_accuracy: None,
            model_epochs: run.model_epochs(config),
            wall_seconds: 0.0,
            tokens_per_second: 0.0,
        }
    }
}

/// AdamW as the configuration sets it (`mha`'s: Burn's numbers, each parameter's step one
/// pass on the CPU backends): its second moment's decay and epsilon, the weight decay on
/// every parameter or (`decay_vectors` off) on the matrices and embeddings only (the
/// biases and the norms' gains and shifts in a group without it), and each parameter's
/// gradient clipped, unless the step clips them all together (`clip_global`,
/// [`SeqBatch::clip`]). The configuration's values were checked when it was read.
pub fn optimizer(config: &TrainConfig) -> ModuleOptimizer {
    let clipping = (!config.clip_global).then_some(GradientClippingConfig::Norm(config.grad_clip));
    let adam = |decay| {
        AdamWConfig::new()
            .with_beta_2(config.adam_beta2)
            .with_epsilon(config.adam_epsilon)
            .with_weight_decay(decay)
    };
    let mut optim = adam(config.weight_decay).init();
    if let Some(clipping) = &clipping {
        optim = optim.with_grad_clipping(clipping.init());
    }
    match config.decay_vectors {
        true => optim,
        false => optim.with_group(
            ParamGroup::from_any_predicates(vec![".bias", ".gamma", ".beta"]),
            adam(0.0).build(),
            clipping.as_ref().map(GradientClippingConfig::init),
        ),
    }
}

/// Writes `summary.json`.
pub fn write_summary(run: &RunDir, summary: &Summary) -> anyhow::Result<()> {
    let json = serde_json::to_string_pretty(summary).expect("a summary serialises") + "\n";
    write_atomically(&run.summary(), json.as_bytes())
}

/// Greedy decoding of `eval_examples` held-out sequences of `task` (the run's, or
/// [`TrainConfig::longer_task`]): (exact, token) accuracy, or `None` when a Ctrl-C stops
/// it. Without a fixed shape, inputs of one length are decoded
/// together (no padding); with one, every batch has `batch_size` rows of the fixed width
/// (the last one filled up with repeats that are not counted).
pub fn evaluate(
    model: &Model,
    config: &TrainConfig,
    task: &TaskConfig,
    fixed: Option<FixedShape>,
    device: &Device,
) -> Option<(f64, f64)> {
    let dtype = config.dtype.for_inference(device);
    let model = compute_copy(&model.valid().to_device(device), dtype);
    let n = config.eval_examples;
    let rows = config.batch_size.max(64);
    // The examples are made a window at a time (memory bounded whatever their number),
    // and without a fixed shape decoded by input length within each window (no padding).
    let window = rows * 16;
    let (mut exact, mut right, mut total) = (0usize, 0usize, 0usize);
    println!(
        "evaluating {n} held-out sequences (inputs of {}..={}), greedy decoding",
        task.min_len, task.max_len
    );
    let (started, mut shown) = (Instant::now(), Instant::now());
    for first in (0..n).step_by(window) {
        let examples: Vec<Example> = (first..n.min(first + window))
            .map(|i| task.example(config.seed, Split::Valid, i))
            .collect();
        let groups: Vec<Vec<&Example>> = match fixed {
            Some(_) => examples.chunks(rows).map(|c| c.iter().collect()).collect(),
            None => {
                let mut by_len: std::collections::BTreeMap<usize, Vec<&Example>> =
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
        let mut done = first;
        for chunk in groups {
            if interrupt::requested() {
                return None;
            }
            if shown.elapsed().as_secs_f64() >= 2.0 {
                println!(
                    "evaluated {done} of {n} ({:.0} s)",
                    started.elapsed().as_secs_f64()
                );
                shown = Instant::now();
            }
            done += chunk.len();
            let mut inputs: Vec<Vec<usize>> = chunk.iter().map(|e| e.input.clone()).collect();
            if fixed.is_some() {
                inputs.resize(rows, inputs[0].clone());
            }
            let outputs = model.generate(&inputs, task.max_output(), fixed, device);
            for (ex, out) in chunk.iter().zip(outputs) {
                exact += usize::from(out == ex.output);
                right += ex.output.iter().zip(&out).filter(|(a, b)| a == b).count();
                total += ex.output.len();
            }
        }
    }
    Some((exact as f64 / n as f64, right as f64 / total.max(1) as f64))
}

/// Where item `index` of an epoch's training items goes: `(step, row)` of the epoch's
/// `steps` steps of `batch` rows. On one device, item `i` is row `i % batch` of step
/// `i / batch`. On `shares` devices, Burn's multi-device strategy gives device `d` the
/// items `d · len / shares ..` (`len = steps · batch`) in batches of `batch / shares`:
/// its `k`-th item is row `d · batch / shares + k % (batch / shares)` of step
/// `k / (batch / shares)`, so that the devices' batches of a step are together the one
/// device's batch of that step.
pub fn step_row(index: usize, steps: usize, batch: usize, shares: usize) -> (usize, usize) {
    if shares <= 1 {
        return (index / batch, index % batch);
    }
    let (per_device, share) = (steps * batch / shares, batch / shares);
    let (device, k) = (index / per_device, index % per_device);
    (k / share, device * share + k % share)
}

/// The training examples of the epoch `epoch` holds: example `(step, row)` of epoch `e`
/// (from 1) is the task's training example number `((e - 1) · steps + step) · batch +
/// row` ([`step_row`]), a function of the seed, the epoch and the item alone.
pub struct TrainStream {
    /// The task.
    pub task: TaskConfig,
    /// The run's seed.
    pub seed: u64,
    /// Steps per epoch.
    pub steps: usize,
    /// Sequences per step.
    pub batch: usize,
    /// The devices each step's batch is shared among.
    pub shares: usize,
    /// The epoch being trained, set by [`EpochLoader`].
    pub epoch: Arc<AtomicUsize>,
}

impl Dataset<Example> for TrainStream {
    fn get(&self, index: usize) -> Result<Example, DatasetError> {
        let epoch = self.epoch.load(Ordering::SeqCst).max(1) - 1;
        let (step, row) = step_row(index, self.steps, self.batch, self.shares);
        let number = (epoch * self.steps + step) * self.batch + row;
        Ok(self.task.example(self.seed, Split::Train, number))
    }

    fn len(&self) -> usize {
        self.steps * self.batch
    }
}

/// The training loader: each pass over it (one per epoch, in order) trains the next
/// epoch, whose number it gives [`TrainStream`]; it seeds the device's random numbers
/// (dropout) from the seed and the epoch, so a resumed epoch draws what it drew before.
/// Burn's multi-device strategy slices it, a slice per device, and starts a pass over
/// every slice each epoch: the first slice's pass advances the epoch, the others' read it.
struct EpochLoader {
    inner: Arc<dyn DataLoader<SeqBatch>>,
    epoch: Arc<AtomicUsize>,
    /// Whether a pass over it starts the next epoch (the whole loader, or the first slice).
    advances: bool,
    seed: u64,
    device: Device,
}

impl DataLoader<SeqBatch> for EpochLoader {
    fn iter<'a>(&'a self) -> Box<dyn DataLoaderIterator<SeqBatch> + 'a> {
        let epoch = match self.advances {
            true => self.epoch.fetch_add(1, Ordering::SeqCst) + 1,
            false => self.epoch.load(Ordering::SeqCst),
        };
        self.device
            .seed(self.seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        self.inner.iter()
    }

    fn num_items(&self) -> usize {
        self.inner.num_items()
    }

    fn to_device(&self, device: &Device) -> Arc<dyn DataLoader<SeqBatch>> {
        Arc::new(Self {
            inner: self.inner.to_device(device),
            epoch: self.epoch.clone(),
            advances: self.advances,
            seed: self.seed,
            device: device.clone(),
        })
    }

    fn slice(&self, start: usize, end: usize) -> Arc<dyn DataLoader<SeqBatch>> {
        Arc::new(Self {
            inner: self.inner.slice(start, end),
            epoch: self.epoch.clone(),
            advances: self.advances && start == 0,
            seed: self.seed,
            device: self.device.clone(),
        })
    }
}

/// The `Loss` metric of each epoch `1..=epochs` that has one, as the learner logged it at
/// the epoch's end (over the whole split, each batch weighted by its size).
pub fn epoch_finals(dir: &Path, epochs: usize, split: &MetricSplit) -> Vec<f64> {
    use burn::train::logger::MetricLogger;
    let mut logger = FileMetricLogger::new(dir);
    (1..=epochs)
        .map_while(|epoch| {
            let entries = logger.read_numeric("Loss", epoch, split).ok()?;
            entries.iter().find_map(|e| match e {
                NumericEntry::Final(v) => Some(*v),
                _ => None,
            })
        })
        .collect()
}

/// Per-step values of the `Loss` metric of each epoch `1..=epochs`, from the learner's
/// logs: on `devices` devices (training; 1 for validation), the mean of each step's
/// entries, one per device's share.
pub fn epoch_losses(
    dir: &Path,
    epochs: usize,
    split: &MetricSplit,
    devices: usize,
) -> Vec<Vec<f64>> {
    let mut logger = FileMetricLogger::new(dir);
    (1..=epochs)
        .map_while(|epoch| {
            use burn::train::logger::MetricLogger;
            let entries = logger.read_numeric("Loss", epoch, split).ok()?;
            // Per-step entries; the epoch's closing aggregate is left out.
            let shares: Vec<f64> = entries
                .iter()
                .filter(|e| !matches!(e, NumericEntry::Final(_)))
                .map(|e| e.current())
                .collect();
            let steps: Vec<f64> = shares
                .chunks(devices.max(1))
                .map(|step| step.iter().sum::<f64>() / step.len() as f64)
                .collect();
            (!steps.is_empty()).then_some(steps)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_row_gives_each_device_its_rows_of_every_step() {
        // One device: items in order.
        assert_eq!(step_row(13, 3, 8, 1), (1, 5));
        // Two devices, 3 steps of 8: device 0 has items 0..12, device 1 items 12..24,
        // each in batches of 4.
        let mut seen = vec![vec![false; 8]; 3];
        for index in 0..24 {
            let (step, row) = step_row(index, 3, 8, 2);
            let device = index / 12;
            assert_eq!(step, (index % 12) / 4, "item {index}");
            assert_eq!(row / 4, device, "item {index}: device {device}'s rows");
            assert!(!seen[step][row], "item {index}: ({step}, {row}) twice");
            seen[step][row] = true;
        }
        assert!(seen.iter().flatten().all(|&s| s));
    }
}
