//! The configuration of a run, as its `config.json` holds it: the task, the model and
//! the training. Every field has a default, so a file may give any subset of them; a
//! field a file gives that the trainer does not know is an error naming the nearest known
//! one, never silently ignored, and a value of the wrong JSON type is an error naming the
//! field and the type it takes. The task and the model are spelt as on the command line
//! (`reverse`, `decoder-only`), and each may stand for its object: `"task": "sort"` is
//! `"task": {"task": "sort"}`, `"model": "encoder-decoder"` is `"model": {"kind":
//! "encoder-decoder"}`.

use std::path::Path;

use anyhow::Context;
use burn::tensor::Device;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::backend::{Backend, Devices};
use crate::batch::FixedShape;
use crate::fields::{
    self, ADAM_BETA2, ADAM_EPSILON, BATCH_SIZE, DATA, DECAY_STEPS, DEVICES, DTYPE, EPOCHS,
    EVAL_EXAMPLES, GRAD_CLIP, LR, MIN_LR_RATIO, MODEL_KIND, PACK, STEPS_PER_EPOCH, VALID_EXAMPLES,
    WARMUP_STEPS, WEIGHT_DECAY,
};
use crate::model::{Model, ModelConfig, ModelKind, PositionKind};
use crate::precision::Precision;
use crate::tasks::{Task, TaskConfig};
use crate::text::{echo, plural};

/// Every hyperparameter of a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainConfig {
    /// The task.
    pub task: TaskConfig,
    /// The model.
    pub model: ModelConfig,
    /// Sequences per step. Default: 64.
    pub batch_size: usize,
    /// Peak learning rate of AdamW. Default: 0.003.
    pub lr: f64,
    /// Steps of linear warmup from lr/100 to lr. Default (`None`): a tenth of the run, at
    /// most 50 steps (100 for the text task).
    pub warmup_steps: Option<usize>,
    /// Steps of the cosine decay from lr to lr x `min_lr_ratio` that follows the warmup.
    /// Default (`None`): the rest of the run. Extending a run (`--resume --epochs`) sets it
    /// to the decay the run had, so that the extra steps train at lr x `min_lr_ratio`.
    pub decay_steps: Option<usize>,
    /// Where the cosine decay ends, as a fraction of lr (the warmup starts at lr/100
    /// whatever it is). Default: 0.01; the text task's: 0.1 (nanoGPT's).
    pub min_lr_ratio: f64,
    /// AdamW's second-moment decay. Default: 0.999 (PyTorch's); the text task's: 0.99
    /// (nanoGPT's).
    pub adam_beta2: f32,
    /// AdamW's epsilon. Default: 1e-5 (Burn's); the text task's: 1e-8 (PyTorch's).
    pub adam_epsilon: f32,
    /// AdamW weight decay. Default: 0.01.
    pub weight_decay: f32,
    /// Whether the weight decay applies to every parameter (true) or only to the weight
    /// matrices and embeddings, not to biases and norms (false, nanoGPT's). Default: true;
    /// the text task's: false.
    pub decay_vectors: bool,
    /// Gradient clipping: the most a gradient's norm may be. Default: 1.
    pub grad_clip: f32,
    /// Whether `grad_clip` bounds the norm of all the gradients together (true, PyTorch's
    /// `clip_grad_norm_`) or of each parameter's gradient (false, Burn's
    /// `GradientClipping::Norm`). Default: false; the text task's: true.
    pub clip_global: bool,
    /// Steps per epoch (a checkpoint is written after each epoch). Default: 100.
    pub steps_per_epoch: usize,
    /// Epochs. Default: 10.
    pub epochs: usize,
    /// Held-out sequences for the validation loss after each epoch. Default: 256.
    pub valid_examples: usize,
    /// Held-out sequences decoded greedily at the end. Default: 1000.
    pub eval_examples: usize,
    /// Seed of the data and of the initial weights. Default: 42.
    pub seed: u64,
    /// Pad every batch to the longest possible example, so the backend sees one shape.
    /// Default (`None`): on for GPU backends, which compile kernels per shape, off on the
    /// CPU, where padding only costs time.
    pub fixed_shapes: Option<bool>,
    /// Pack the decoder-only model's training sequences several to a row of twice the
    /// longest sequence, attention kept within each sequence, instead of padding each to
    /// the longest of its batch. Default: off.
    pub pack: bool,
    /// The float dtype the steps compute in: f32, or f16 / bf16 with the weights kept in
    /// f32 (see [`crate::precision`]). Default: f32.
    pub dtype: Precision,
    /// The devices of the chosen backend the steps run on (see [`Backend::devices`]):
    /// each takes `batch_size / N` sequences of every step, and Burn sums the gradients
    /// of their losses, each weighted 1/N, on the first, where the optimizer steps: the
    /// gradient of the mean of the devices' mean losses (PyTorch DDP's convention), the
    /// whole batch's mean loss when every device's share counts as many target tokens.
    /// Default: 1.
    pub devices: Devices,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            task: TaskConfig::default(),
            model: ModelConfig::default(),
            batch_size: 64,
            lr: 3e-3,
            warmup_steps: None,
            decay_steps: None,
            min_lr_ratio: 0.01,
            adam_beta2: 0.999,
            adam_epsilon: 1e-5,
            weight_decay: 0.01,
            decay_vectors: true,
            grad_clip: 1.0,
            clip_global: false,
            steps_per_epoch: 100,
            epochs: 10,
            valid_examples: 256,
            eval_examples: 1000,
            seed: 42,
            fixed_shapes: None,
            pack: false,
            dtype: Precision::F32,
            devices: Devices::Count(1),
        }
    }
}

impl TrainConfig {
    /// The defaults of `task`: [`Default`]'s for the synthetic tasks; for the text task,
    /// nanoGPT's CPU recipe for its character-level Shakespeare (4 layers, 4 heads, width
    /// 128, learned positions, block 64, batch 12, 2000 steps (8 epochs of 250, the
    /// validation after each), lr 1e-3 with 100 steps of warmup (a tenth of a shorter
    /// run) and a cosine decay to
    /// lr/10, AdamW betas 0.9/0.99 and epsilon 1e-8, weight decay 0.1 on the matrices and
    /// embeddings, the gradients' global norm clipped at 1, no dropout),
    /// validated on 1024 fixed windows.
    pub fn defaults(task: Task) -> Self {
        let default = Self::default();
        if !task.is_text() {
            return Self {
                task: TaskConfig {
                    task,
                    ..default.task
                },
                ..default
            };
        }
        Self {
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

    /// Checks every value, the task's and the model's included, before anything is built
    /// or written; the error names the flag and the field.
    pub fn validate(&self) -> anyhow::Result<()> {
        self.check_paths()?;
        self.check_scope()?;
        self.task.validate()?;
        self.model.validate()?;
        if self.task.task.is_text() {
            anyhow::ensure!(
                self.model.kind == ModelKind::DecoderOnly,
                "{} = {}: the text task trains the decoder-only model (a language model)",
                MODEL_KIND.name(),
                self.model.kind.name()
            );
            anyhow::ensure!(
                !self.pack,
                "{}: the text task's windows are all --block-size long; there is nothing to \
                 pack",
                PACK.name()
            );
        }
        anyhow::ensure!(
            self.min_lr_ratio > 0.0 && self.min_lr_ratio <= 1.0,
            "{} must be in (0, 1], got {}",
            MIN_LR_RATIO.name(),
            self.min_lr_ratio
        );
        anyhow::ensure!(
            self.adam_epsilon > 0.0 && self.adam_epsilon.is_finite(),
            "{} must be positive and finite, got {}",
            ADAM_EPSILON.name(),
            self.adam_epsilon
        );
        anyhow::ensure!(
            self.adam_beta2 > 0.0 && self.adam_beta2 < 1.0,
            "{} must be in (0, 1), got {}",
            ADAM_BETA2.name(),
            self.adam_beta2
        );
        for (field, value) in [
            (BATCH_SIZE, self.batch_size),
            (STEPS_PER_EPOCH, self.steps_per_epoch),
            (EPOCHS, self.epochs),
            (VALID_EXAMPLES, self.valid_examples),
            (EVAL_EXAMPLES, self.eval_examples),
        ] {
            anyhow::ensure!(value >= 1, "{} must be at least 1, got 0", field.name());
        }
        anyhow::ensure!(
            self.lr > 0.0 && self.lr <= 1.0,
            "{} must be in (0, 1], got {}",
            LR.name(),
            self.lr
        );
        anyhow::ensure!(
            self.grad_clip > 0.0,
            "{} must be positive, got {}",
            GRAD_CLIP.name(),
            self.grad_clip
        );
        anyhow::ensure!(
            self.weight_decay >= 0.0 && self.weight_decay.is_finite(),
            "{} must be finite and not negative, got {}",
            WEIGHT_DECAY.name(),
            self.weight_decay
        );
        // Every step's examples are numbered: (epoch x steps + step) x batch + row.
        let examples = self
            .epochs
            .checked_mul(self.steps_per_epoch)
            .and_then(|steps| steps.checked_mul(self.batch_size))
            .filter(|&n| n < 1 << 53);
        anyhow::ensure!(
            examples.is_some(),
            "{} {} x {} {} x {} {} is more training examples than can be counted (at most \
             2^53)",
            EPOCHS.name(),
            self.epochs,
            STEPS_PER_EPOCH.name(),
            self.steps_per_epoch,
            BATCH_SIZE.name(),
            self.batch_size
        );
        if let Some(warmup) = self.warmup_steps {
            anyhow::ensure!(
                warmup < self.total_steps(),
                "{} = {warmup} must be below the run's {} steps ({} x {}); leave it out for \
                 a tenth of the run",
                WARMUP_STEPS.name(),
                self.total_steps(),
                EPOCHS.name(),
                STEPS_PER_EPOCH.name(),
            );
        }
        anyhow::ensure!(
            !self.pack || self.model.kind == ModelKind::DecoderOnly,
            "{} packs the decoder-only model's sequences; the encoder-decoder ({}) trains on \
             padded batches",
            PACK.name(),
            MODEL_KIND.name(),
        );
        if let Some(decay) = self.decay_steps {
            anyhow::ensure!(decay >= 1, "{} must be at least 1", DECAY_STEPS.name());
        }
        let n = self.devices.count();
        anyhow::ensure!(
            n >= 1,
            "{} must name at least one device, got {}",
            DEVICES.name(),
            self.devices
        );
        if n > 1 {
            anyhow::ensure!(
                self.batch_size.is_multiple_of(n),
                "{} = {}: the batch is shared among {} {}, which needs a multiple of {n}",
                BATCH_SIZE.name(),
                self.batch_size,
                DEVICES.name(),
                self.devices
            );
            anyhow::ensure!(
                self.dtype != Precision::F16,
                "{} f16 with {} {}: f16's loss scale is one for the whole step, and the \
                 devices would each change it; use bf16 (no loss scale) or one device",
                DTYPE.name(),
                DEVICES.name(),
                self.devices
            );
        }
        Ok(())
    }

    /// Refuses a field that has no effect on the run's task (`--block-size` on a synthetic
    /// task, `--max-len` on text, ...; the table is [`fields::TEXT_ONLY`] and
    /// [`fields::SYNTHETIC_ONLY`]): set to anything but the task's default, it would be
    /// stored and ignored.
    fn check_scope(&self) -> anyhow::Result<()> {
        let text = self.task.task.is_text();
        let (ignored, task) = match text {
            true => (fields::SYNTHETIC_ONLY, "the text task".to_string()),
            false => (
                fields::TEXT_ONLY,
                format!("the {} task", self.task.task.name()),
            ),
        };
        let [given, defaults] = [self, &Self::defaults(self.task.task)]
            .map(|c| serde_json::to_value(c).unwrap_or(Value::Null));
        for field in ignored {
            let value = lookup(&given, field.path);
            if value == lookup(&defaults, field.path) {
                continue;
            }
            let value = value.map(|v| match v {
                Value::String(text) => echo(text),
                v => echo(&v.to_string()),
            });
            anyhow::bail!(
                "{} = {}: has no effect on {task} ({}); leave it out{}",
                field.name(),
                value.unwrap_or_default(),
                match text {
                    true => "it is a setting of the synthetic tasks",
                    false => "it is a setting of the text task",
                },
                match text {
                    true => "",
                    false => ", or train on text with --task text",
                }
            );
        }
        Ok(())
    }

    /// Optimizer steps of the whole run.
    pub fn total_steps(&self) -> usize {
        self.epochs * self.steps_per_epoch
    }

    /// Steps of warmup: as set, or a tenth of the run, at most 50 (at most 100 for the
    /// text task, nanoGPT's).
    pub fn warmup(&self) -> usize {
        let most = match self.task.task.is_text() {
            true => 100,
            false => 50,
        };
        self.warmup_steps
            .unwrap_or((self.total_steps() / 10).min(most))
            .max(1)
    }

    /// Steps of cosine decay after the warmup: as set, or the rest of the run.
    pub fn decay(&self) -> usize {
        self.decay_steps
            .unwrap_or(self.total_steps().saturating_sub(self.warmup()))
            .max(1)
    }

    /// Longest sequence a model reads: `input SEP output EOS`; for the text task, the
    /// block.
    pub fn max_len(&self) -> usize {
        match self.task.task.is_text() {
            true => self.task.block_size,
            false => self.task.max_input() + self.task.max_output() + 2,
        }
    }

    /// The task at longer inputs than any trained on, for the length-generalisation test:
    /// lengths `max_len + 1 ..= max_len * 3 / 2` (17..=24 for 8..=16); `None` for a model
    /// that cannot read them (learned absolute positions).
    pub fn longer_task(&self) -> Option<TaskConfig> {
        if self.task.task.is_text() {
            return None;
        }
        let max = self.task.max_len;
        self.model
            .positions
            .reads_longer_inputs()
            .then(|| TaskConfig {
                min_len: max + 1,
                max_len: (max * 3 / 2).max(max + 1),
                ..self.task.clone()
            })
    }

    /// The width of a packed row (twice the longest sequence), when packing.
    pub fn pack_width(&self) -> Option<usize> {
        self.pack.then_some(2 * self.max_len())
    }

    /// The fixed batch shape on `backend`, if any (see `fixed_shapes`).
    /// The text task's windows all have one shape: none.
    pub fn fixed_shape(&self, backend: Backend) -> Option<FixedShape> {
        if self.task.task.is_text() {
            return None;
        }
        self.fixed_shapes
            .unwrap_or(backend.is_gpu())
            .then(|| FixedShape::of(&self.task))
    }

    /// The model, initialised from the seed.
    /// For the text task: nanoGPT's language model (the head tied to the token
    /// embedding, its initialisation) over the run's vocabulary.
    pub fn init_model(&self, device: &Device) -> anyhow::Result<Model> {
        device.seed(self.seed);
        match self.task.task.is_text() {
            true => {
                anyhow::ensure!(
                    self.task.vocab_size() > 0,
                    "the text task's model needs the run's vocabulary (`task.vocab`)"
                );
                self.model
                    .init_language_model(self.task.vocab_size(), self.max_len(), device)
            }
            false => self
                .model
                .init(self.task.vocab_size(), self.max_len(), device),
        }
    }

    /// Reads a run's configuration file and checks it.
    ///
    /// # Errors
    /// As [`read`](Self::read), and naming a value [`validate`](Self::validate) rejects.
    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let config = Self::read(path)?;
        config
            .validate()
            .with_context(|| format!("{}", path.display()))?;
        Ok(config)
    }

    /// Reads a configuration file: any subset of the fields, each known (the values are
    /// checked once the command line's flags are applied to them).
    ///
    /// # Errors
    /// Naming the file, and as [`from_json`](Self::from_json).
    pub fn read(path: &Path) -> anyhow::Result<Self> {
        Self::read_as(path, None)
    }

    /// As [`read`](Self::read), the fields the file leaves out taking the defaults of its
    /// task, or when it names none, of `task` (the `--task` flag), else the synthetic
    /// defaults.
    ///
    /// # Errors
    /// As [`read`](Self::read).
    pub fn read_as(path: &Path, task: Option<Task>) -> anyhow::Result<Self> {
        let what = path.display();
        let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {what}"))?;
        // A byte-order mark, which some editors write first, is not part of the JSON.
        let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
        Self::from_json_as(text, task).with_context(|| format!("{what}"))
    }

    /// Parses a configuration: a JSON object with any subset of the fields, the task and
    /// the model given as objects or by name.
    ///
    /// # Errors
    /// When it is not JSON or not an object; naming the field: an unknown one (with the
    /// nearest known field), or a value of the wrong type (with the type it takes).
    pub fn from_json(text: &str) -> anyhow::Result<Self> {
        Self::from_json_as(text, None)
    }

    /// As [`from_json`](Self::from_json), the fields left out taking the defaults of the
    /// task the text names, or else of `task` ([`defaults`](Self::defaults)).
    ///
    /// # Errors
    /// As [`from_json`](Self::from_json).
    pub fn from_json_as(text: &str, task: Option<Task>) -> anyhow::Result<Self> {
        let mut given: Value =
            serde_json::from_str(text).context("not JSON (a training configuration)")?;
        check_unique_keys(text)?;
        if let Value::Object(fields) = &mut given {
            for (key, inner) in [("task", "task"), ("model", "kind")] {
                if let Some(name @ Value::String(_)) = fields.get_mut(key) {
                    let object = Value::Object(Map::from_iter([(inner.into(), name.take())]));
                    *name = object;
                }
            }
        }
        check_fields(&given, &Self::shape(), "")?;
        let named = lookup(&given, "task.task")
            .cloned()
            .map(serde_json::from_value::<Task>)
            .transpose()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let Some(task) = named.or(task) else {
            return serde_json::from_value(given).map_err(|e| anyhow::anyhow!("{e}"));
        };
        let mut full = serde_json::to_value(Self::defaults(task)).expect("a config serialises");
        overlay(&mut full, given);
        serde_json::from_value(full).map_err(|e| anyhow::anyhow!("{e}"))
    }

    /// The configuration as JSON with every optional field given, so that each field's
    /// JSON type can be read off it.
    fn shape() -> Value {
        let config = Self {
            task: TaskConfig {
                data: Some("corpus.txt".into()),
                vocab: Some("ab".into()),
                ..TaskConfig::default()
            },
            warmup_steps: Some(1),
            decay_steps: Some(1),
            fixed_shapes: Some(false),
            ..Self::default()
        };
        serde_json::to_value(config).expect("a config serialises")
    }

    /// The configuration as `config.json` holds it.
    ///
    /// # Errors
    /// When a path in it is not UTF-8, which JSON cannot hold (naming the flag).
    pub fn to_json(&self) -> anyhow::Result<String> {
        self.check_paths()?;
        serde_json::to_string_pretty(self)
            .map(|json| json + "\n")
            .map_err(|e| anyhow::anyhow!("the configuration cannot be written as JSON: {e}"))
    }

    /// Checks that the paths of the configuration are UTF-8, as `config.json` must hold
    /// them.
    fn check_paths(&self) -> anyhow::Result<()> {
        if let Some(data) = &self.task.data {
            anyhow::ensure!(
                data.to_str().is_some(),
                "{} {}: the path is not UTF-8, and a run's config.json (JSON) cannot hold it; \
                 rename the file or a folder on its path",
                DATA.name(),
                echo(&data.to_string_lossy())
            );
        }
        Ok(())
    }

    /// The dotted paths of the fields whose values differ between `self` and `other`.
    pub fn changed_fields(&self, other: &Self) -> Vec<String> {
        let [a, b] = [self, other].map(|c| serde_json::to_value(c).expect("a config serialises"));
        let mut changed = Vec::new();
        diff(&a, &b, "", &mut changed);
        changed
    }

    /// The configuration a `--resume` continues the run with: `requested`, the run's
    /// configuration (`self`) with the flags of the `--resume` applied, checked against the
    /// run, which has done `done` epochs. Only what [`check_resume`](Self::check_resume)
    /// allows may change. A changed `--epochs` keeps the run's warmup (within the new
    /// length); an extended run keeps its decay too, so that its extra steps train at the
    /// floor (lr x `min_lr_ratio`), and a shortened one decays to the floor by its end.
    ///
    /// # Errors
    /// As [`check_resume`](Self::check_resume); when `--epochs` asks for no more epochs
    /// than are done; and naming a value [`validate`](Self::validate) rejects.
    pub fn resumed(&self, mut requested: Self, done: usize) -> anyhow::Result<Self> {
        anyhow::ensure!(
            requested.epochs >= 1,
            "{} must be at least 1, got 0",
            EPOCHS.name()
        );
        self.check_resume(&requested)?;
        if requested.epochs != self.epochs {
            anyhow::ensure!(
                requested.epochs > done,
                "--epochs {}: the run has done {} already",
                requested.epochs,
                plural(done, "epoch")
            );
            requested.warmup_steps = Some(self.warmup().min(requested.total_steps() - 1));
            if requested.epochs > self.epochs {
                requested.decay_steps = Some(self.decay());
            }
        }
        requested.validate()?;
        Ok(requested)
    }

    /// Checks that `requested` (the run's configuration with the flags of a `--resume`
    /// applied) changes only what `--resume` may change: how long the run goes on, how it
    /// is evaluated and how its batches are padded.
    ///
    /// # Errors
    /// Naming the first flag that would change the run, its value and the run's.
    pub fn check_resume(&self, requested: &Self) -> anyhow::Result<()> {
        let allowed: Vec<&str> = fields::FIELDS
            .iter()
            .filter(|f| f.on_resume)
            .filter_map(|f| f.flag)
            .collect();
        let [stored, asked] =
            [self, requested].map(|c| serde_json::to_value(c).expect("a config serialises"));
        for path in self.changed_fields(requested) {
            let field = fields::at(&path);
            if field.on_resume {
                continue;
            }
            let value = |v: &Value| lookup(v, &path).map(Value::to_string).unwrap_or_default();
            anyhow::bail!(
                "{} {} would change the run, which was trained with {}; --resume continues a \
                 run as it was (it takes only {}: start a new run for other settings)",
                field.flag.unwrap_or(field.path),
                value(&asked),
                value(&stored),
                allowed.join(", "),
            );
        }
        Ok(())
    }
}

/// Checks that `given` is an object whose every key is a key of `known` (at the same
/// place), recursively, with a value of the JSON type of `known`'s.
fn check_fields(given: &Value, known: &Value, path: &str) -> anyhow::Result<()> {
    let Value::Object(known) = known else {
        return check_type(given, known, path);
    };
    let Value::Object(given) = given else {
        match path.is_empty() {
            true => anyhow::bail!(
                "a configuration must be a JSON object of fields (`{{\"lr\": 0.001}}`), got {}",
                json_type(given)
            ),
            false => anyhow::bail!("`{path}` must be an object, got {}", json_type(given)),
        }
    };
    for (key, value) in given {
        let full = join(path, key);
        match known.get(key) {
            Some(inner) => check_fields(value, inner, &full)?,
            None => anyhow::bail!(
                "unknown field `{}`{}",
                echo(&full),
                match fields::nearest(key) {
                    Some(field) => format!(" (did you mean `{}`?)", field.path),
                    None => format!("; the fields here are {}", names(known, path)),
                }
            ),
        }
    }
    Ok(())
}

/// Checks that the value of the field at `path` has the JSON type of `known` (an example
/// value); `null` is taken where the default is `null`.
fn check_type(given: &Value, known: &Value, path: &str) -> anyhow::Result<()> {
    if path == DEVICES.path {
        let index = |v: &Value| v.is_u64();
        anyhow::ensure!(
            index(given) || given.as_array().is_some_and(|list| list.iter().all(index)),
            "`{path}` must be a whole number (how many) or an array of them (which), got {}",
            json_type(given)
        );
        return Ok(());
    }
    let defaults = serde_json::to_value(TrainConfig::default()).expect("a config serialises");
    let optional = lookup(&defaults, path).is_some_and(Value::is_null);
    if known.is_u64()
        && let Some(big) = given
            .as_f64()
            .filter(|v| *v >= u64::MAX as f64 && v.fract() == 0.0)
    {
        anyhow::bail!(
            "`{path}` = {}: too large, at most {}",
            echo(&format!("{big:.0}")),
            u64::MAX
        );
    }
    let (fits, wanted) = match known {
        Value::Bool(_) => (given.is_boolean(), "true or false"),
        Value::Number(n) if n.is_u64() => (given.is_u64(), "a whole number, 0 or more"),
        Value::Number(_) => (given.is_number(), "a number"),
        Value::String(_) => (given.is_string(), "a string"),
        _ => (true, ""),
    };
    anyhow::ensure!(
        fits || (optional && given.is_null()),
        "`{path}` must be {wanted}{}, got {}",
        match optional {
            true => " or null",
            false => "",
        },
        json_type(given)
    );
    Ok(())
}

/// Refuses a key given twice in one object of the JSON `text` (which a JSON reader would
/// otherwise settle silently, the last one winning), naming it.
fn check_unique_keys(text: &str) -> anyhow::Result<()> {
    use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
    /// Walks a value, failing on a repeated key; `path` is where it is.
    struct Unique(String);
    impl<'de> DeserializeSeed<'de> for Unique {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }
    impl<'de> Visitor<'de> for Unique {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            while seq.next_element_seed(Unique(self.0.clone()))?.is_some() {}
            Ok(())
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            let mut seen = std::collections::HashSet::new();
            while let Some(key) = map.next_key::<String>()? {
                let full = join(&self.0, &key);
                if !seen.insert(key) {
                    return Err(serde::de::Error::custom(format!(
                        "`{}` is given twice; give each field once",
                        echo(&full)
                    )));
                }
                map.next_value_seed(Unique(full))?;
            }
            Ok(())
        }
    }
    let mut reader = serde_json::Deserializer::from_str(text);
    Unique(String::new())
        .deserialize(&mut reader)
        .map_err(|e| anyhow::anyhow!("{e}"))
}

/// A JSON value as a message names it: "a string (\"64\")", "an array".
fn json_type(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("{b}"),
        Value::Number(n) => format!("the number {}", echo(&n.to_string())),
        Value::String(text) => format!("a string (\"{}\")", echo(text)),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// The dotted names of the keys of `object` under `path`.
fn names(object: &Map<String, Value>, path: &str) -> String {
    let names: Vec<String> = object
        .keys()
        .map(|k| format!("`{}`", join(path, k)))
        .collect();
    names.join(", ")
}

fn join(path: &str, key: &str) -> String {
    match path.is_empty() {
        true => key.to_string(),
        false => format!("{path}.{key}"),
    }
}

/// Writes the fields of `given` over those of `base`, object by object.
fn overlay(base: &mut Value, given: Value) {
    match (base, given) {
        (Value::Object(base), Value::Object(given)) => {
            for (key, value) in given {
                match base.get_mut(&key) {
                    Some(inner) => overlay(inner, value),
                    None => {
                        base.insert(key, value);
                    }
                }
            }
        }
        (base, given) => *base = given,
    }
}

/// The value at a dotted `path`.
fn lookup<'a>(value: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(value, |v, key| v.get(key))
}

/// Pushes the dotted paths of the leaves that differ between `a` and `b`.
fn diff(a: &Value, b: &Value, path: &str, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            for (key, value) in a {
                diff(
                    value,
                    b.get(key).unwrap_or(&Value::Null),
                    &join(path, key),
                    out,
                );
            }
        }
        (a, b) if a != b => out.push(path.to_string()),
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> anyhow::Result<TrainConfig> {
        let dir = std::env::temp_dir().join(format!("mha-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(format!(
            "{:x}.json",
            text.len() * 31 + text.bytes().map(usize::from).sum::<usize>()
        ));
        std::fs::write(&path, text).unwrap();
        let config = TrainConfig::load(&path);
        std::fs::remove_file(&path).unwrap();
        config
    }

    #[test]
    fn files_give_any_subset_and_unknown_fields_are_named() {
        let config =
            load(r#"{"task": {"task": "sort"}, "model": {"kind": "encoder-decoder"}, "lr": 0.01}"#)
                .unwrap();
        assert_eq!(config.task.task, crate::tasks::Task::Sort);
        assert_eq!(config.model.kind, crate::model::ModelKind::EncoderDecoder);
        assert_eq!(config.lr, 0.01);
        assert_eq!(config.epochs, TrainConfig::default().epochs);
        let err = format!("{:#}", load(r#"{"learning_rate": 0.1}"#).unwrap_err());
        assert!(
            err.contains("unknown field `learning_rate` (did you mean `lr`?)"),
            "{err}"
        );
        let err = format!("{:#}", load(r#"{"model": {"dropuot": 0.1}}"#).unwrap_err());
        assert!(
            err.contains("`model.dropuot` (did you mean `model.dropout`?)"),
            "{err}"
        );
        let err = format!(
            "{:#}",
            load(r#"{"task": {"task": "Palindrome"}}"#).unwrap_err()
        );
        let wanted = "unknown task `Palindrome`: expected copy, reverse, sort, add or text";
        assert!(err.contains(wanted), "{err}");
        // The files of earlier versions spelt the task and model capitalised.
        let old = load(r#"{"task": {"task": "Reverse"}, "model": {"kind": "DecoderOnly"}}"#);
        assert_eq!(old.unwrap().task.task, crate::tasks::Task::Reverse);
    }

    #[test]
    fn the_task_and_the_model_may_be_named_and_anything_else_has_its_type() {
        let config = TrainConfig::from_json(
            r#"{"task": "sort", "model": "encoder-decoder", "warmup_steps": null}"#,
        )
        .unwrap();
        assert_eq!(config.task.task, crate::tasks::Task::Sort);
        assert_eq!(config.model.kind, crate::model::ModelKind::EncoderDecoder);
        for (text, wanted) in [
            (
                "[]",
                "a configuration must be a JSON object of fields (`{\"lr\": 0.001}`), got an \
                 array",
            ),
            (
                "3",
                "must be a JSON object of fields (`{\"lr\": 0.001}`), got the number 3",
            ),
            (r#"{"task": [1]}"#, "`task` must be an object, got an array"),
            (
                r#"{"lr": "0.01"}"#,
                "`lr` must be a number, got a string (\"0.01\")",
            ),
            (
                r#"{"batch_size": 64.5}"#,
                "`batch_size` must be a whole number, 0 or more, got the number 64.5",
            ),
            (
                r#"{"seed": -1}"#,
                "`seed` must be a whole number, 0 or more, got the number -1",
            ),
            (
                r#"{"pack": 1}"#,
                "`pack` must be true or false, got the number 1",
            ),
            (
                r#"{"fixed_shapes": "yes"}"#,
                "`fixed_shapes` must be true or false or null, got a string (\"yes\")",
            ),
            (
                r#"{"model": {"kind": 2}}"#,
                "`model.kind` must be a string, got the number 2",
            ),
        ] {
            let err = format!("{:#}", TrainConfig::from_json(text).unwrap_err());
            assert!(err.contains(wanted), "{text}: {err}");
            for internal in ["struct", "usize", "TaskConfig", "f64", "Option"] {
                assert!(!err.contains(internal), "{text}: {err}");
            }
        }
        // What a file gives is echoed short and escaped.
        let long = format!(r#"{{"task": "{}\u001b[31m"}}"#, "x".repeat(100_000));
        let err = format!("{:#}", TrainConfig::from_json(&long).unwrap_err());
        assert!(err.len() < 300 && !err.contains('\x1b'), "{err}");
    }

    #[test]
    fn every_configuration_the_readme_shows_is_read() {
        let section = include_str!("../README.md");
        let examples: Vec<&str> = section
            .split("```json\n")
            .skip(1)
            .map(|block| &block[..block.find("```").expect("a closed block")])
            .collect();
        assert!(examples.len() >= 2, "{section}");
        for text in examples {
            let config = TrainConfig::from_json(text).unwrap_or_else(|e| panic!("{text}: {e:#}"));
            config
                .validate()
                .unwrap_or_else(|e| panic!("{text}: {e:#}"));
        }
    }

    #[test]
    fn the_text_task_takes_its_own_defaults_and_the_larger_preset_reads() {
        // A file that names the text task starts from its defaults, as `--task text` does.
        let file = TrainConfig::from_json(r#"{"task": "text", "lr": 0.002}"#).unwrap();
        let flag = TrainConfig::from_json_as(r#"{"lr": 0.002}"#, Some(Task::Text)).unwrap();
        let defaults = TrainConfig::defaults(Task::Text);
        assert_eq!(file, flag);
        assert_eq!(
            file,
            TrainConfig {
                lr: 0.002,
                ..defaults.clone()
            }
        );
        // nanoGPT's CPU recipe.
        let m = &defaults.model;
        assert_eq!((m.n_layers, m.n_heads, m.d_model), (4, 4, 128));
        assert_eq!((defaults.task.block_size, defaults.batch_size), (64, 12));
        assert_eq!((defaults.total_steps(), defaults.warmup()), (2000, 100));
        assert_eq!((defaults.adam_beta2, defaults.weight_decay), (0.99, 0.1));
        assert!(!defaults.decay_vectors && defaults.clip_global);
        defaults.validate().unwrap();
        // A synthetic task keeps the synthetic defaults.
        assert_eq!(TrainConfig::defaults(Task::Reverse), TrainConfig::default());
        // The larger preset, nanoGPT's GPU recipe.
        // The clone `cargo test` runs in, which may not be the one a cached build was made in.
        let root = std::env::var_os("CARGO_MANIFEST_DIR")
            .unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
        let path = Path::new(&root).join("configs/text-gpu.json");
        let gpu = TrainConfig::load(&path).unwrap();
        let m = &gpu.model;
        assert_eq!(
            (m.n_layers, m.n_heads, m.d_model, m.dropout),
            (6, 6, 384, 0.2)
        );
        assert_eq!((gpu.task.block_size, gpu.batch_size), (256, 64));
        assert_eq!((gpu.total_steps(), gpu.warmup(), gpu.lr), (5000, 100, 1e-3));
        assert_eq!(gpu.min_lr_ratio, 0.1);
    }

    #[test]
    fn a_round_trip_keeps_every_field() {
        let config = TrainConfig {
            warmup_steps: Some(7),
            fixed_shapes: Some(true),
            ..TrainConfig::default()
        };
        assert_eq!(load(&config.to_json().unwrap()).unwrap(), config);
    }

    #[test]
    fn resume_takes_only_the_flags_that_keep_the_run() {
        let run = TrainConfig::default();
        let longer = TrainConfig {
            epochs: 12,
            eval_examples: 50,
            ..run.clone()
        };
        run.check_resume(&longer).unwrap();
        let mut wider = run.clone();
        wider.model.d_model = 128;
        let err = run.check_resume(&wider).unwrap_err().to_string();
        assert!(
            err.starts_with("--d-model 128 would change the run, which was trained with 64"),
            "{err}"
        );
        assert_eq!(run.changed_fields(&wider), vec!["model.d_model"]);
    }

    #[test]
    fn resuming_with_other_epochs_keeps_the_schedule_it_can() {
        // 400 steps: 40 of warmup, 360 of decay.
        let run = TrainConfig {
            epochs: 4,
            ..TrainConfig::default()
        };
        assert_eq!(run.resumed(run.clone(), 2).unwrap(), run);
        let epochs = |epochs| TrainConfig {
            epochs,
            ..run.clone()
        };
        // Extended: the warmup and the decay as they were, the extra steps at the floor.
        let longer = run.resumed(epochs(6), 2).unwrap();
        assert_eq!(
            (longer.warmup_steps, longer.decay_steps),
            (Some(40), Some(360))
        );
        assert_eq!(longer.total_steps(), 600);
        // Shortened: the warmup as it was, the decay ending with the run.
        let shorter = run.resumed(epochs(3), 2).unwrap();
        assert_eq!(
            (shorter.warmup_steps, shorter.decay_steps),
            (Some(40), None)
        );
        assert_eq!(shorter.decay(), 260);
        // Shortened below its warmup: one step of decay is left.
        let quick = TrainConfig {
            epochs: 2,
            steps_per_epoch: 20,
            warmup_steps: Some(30),
            ..TrainConfig::default()
        };
        let cut = quick
            .resumed(
                TrainConfig {
                    epochs: 1,
                    ..quick.clone()
                },
                0,
            )
            .unwrap();
        assert_eq!((cut.warmup(), cut.decay()), (19, 1));
        // No fewer epochs than are done, and nothing that changes the run.
        let err = run.resumed(epochs(2), 2).unwrap_err().to_string();
        assert_eq!(err, "--epochs 2: the run has done 2 epochs already");
        let mut wider = epochs(6);
        wider.model.d_model = 128;
        let err = run.resumed(wider, 2).unwrap_err().to_string();
        assert!(
            err.starts_with("--d-model 128 would change the run"),
            "{err}"
        );
    }

    #[test]
    fn the_field_table_has_every_field_of_the_file() {
        fn leaves(value: &Value, path: &str, out: &mut Vec<String>) {
            match value {
                Value::Object(map) => map.iter().for_each(|(k, v)| leaves(v, &join(path, k), out)),
                _ => out.push(path.to_string()),
            }
        }
        let mut paths = Vec::new();
        leaves(
            &serde_json::to_value(TrainConfig::default()).unwrap(),
            "",
            &mut paths,
        );
        let mut table: Vec<&str> = fields::FIELDS.iter().map(|f| f.path).collect();
        paths.sort();
        table.sort();
        assert_eq!(paths, table);
    }

    #[test]
    fn the_schedule_fits_short_runs() {
        let quick = TrainConfig {
            epochs: 2,
            steps_per_epoch: 20,
            ..TrainConfig::default()
        };
        quick.validate().unwrap();
        assert_eq!((quick.warmup(), quick.decay()), (4, 36));
        assert_eq!(TrainConfig::default().warmup(), 50);
        let err = TrainConfig {
            warmup_steps: Some(50),
            ..quick
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(
            err.starts_with("`--warmup` (`warmup_steps`) = 50 must be below the run's 40 steps"),
            "{err}"
        );
    }

    #[test]
    fn the_optimizers_numbers_must_be_finite() {
        // A file's 1e39 is an f32 infinity.
        for (field, config) in [
            (
                "adam_epsilon",
                TrainConfig {
                    adam_epsilon: f32::INFINITY,
                    ..TrainConfig::default()
                },
            ),
            (
                "weight_decay",
                TrainConfig {
                    weight_decay: f32::INFINITY,
                    ..TrainConfig::default()
                },
            ),
        ] {
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(field) && err.ends_with("got inf"), "{err}");
        }
    }
}
