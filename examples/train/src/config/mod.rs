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
use burn::optim::lr_scheduler::LrSchedulerConfig;
use burn::optim::lr_scheduler::cosine::CosineAnnealingLrSchedulerConfig;
use burn::optim::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLrScheduler;
use burn::optim::lr_scheduler::sequential::SequentialLrSchedulerConfig;
use burn::tensor::Device;
use serde::{Deserialize, Serialize};

use crate::backend::{Backend, Devices};
use crate::batch::FixedShape;
use crate::kind::TaskKind;
use crate::model::{Model, ModelConfig};
use crate::precision::Precision;
use crate::tasks::{Task, TaskConfig};

mod json;
mod resume;
mod validate;

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
    /// nanoGPT's recipe (see [`crate::lm::Text`]).
    pub fn defaults(task: Task) -> Self {
        task.kind().defaults(task)
    }

    /// What kind of task the run trains.
    pub fn kind(&self) -> &'static dyn TaskKind {
        self.task.task.kind()
    }

    /// Optimizer steps of the whole run.
    pub fn total_steps(&self) -> usize {
        // Saturating: `validate` refuses a run whose steps overflow, and may come after.
        self.epochs.saturating_mul(self.steps_per_epoch)
    }

    /// Steps of warmup: as set (0: none, the first step at lr), or a tenth of the run, at
    /// least 1 and at most 50 (at most 100 for the text task, nanoGPT's).
    pub fn warmup(&self) -> usize {
        self.warmup_steps.unwrap_or_else(|| {
            (self.total_steps() / 10)
                .min(self.kind().most_warmup())
                .max(1)
        })
    }

    /// Steps of cosine decay after the warmup: as set, or the rest of the run.
    pub fn decay(&self) -> usize {
        self.decay_steps
            .unwrap_or(self.total_steps().saturating_sub(self.warmup()))
            .max(1)
    }

    /// The learning-rate schedule: a linear warmup from lr/100 to lr, a cosine decay to
    /// lr x `min_lr_ratio`, and that for any steps after it (those of an extended run).
    /// Built when the configuration is checked, before anything is written.
    ///
    /// # Errors
    /// Where Burn's schedulers refuse the rates (an lr whose hundredth is 0), or the
    /// warmup and decay steps together overflow.
    pub fn lr_schedule(&self) -> anyhow::Result<ModuleLrScheduler> {
        let (start, floor) = (self.lr / 100.0, self.lr * self.min_lr_ratio);
        let (warmup, decay) = (self.warmup(), self.decay());
        let end = warmup.checked_add(decay).with_context(|| {
            format!(
                "{} = {decay} after {warmup} warmup steps: more steps than can be counted",
                crate::fields::DECAY_STEPS.name()
            )
        })?;
        let cosine = LrSchedulerConfig::Cosine(
            CosineAnnealingLrSchedulerConfig::new(self.lr, decay).with_min_lr(floor),
        );
        // Without warmup (`--warmup 0`) the first step is at lr.
        let (mut schedulers, mut milestones) = match warmup {
            0 => (vec![cosine], vec![]),
            _ => (
                vec![
                    LrSchedulerConfig::Linear(LinearLrSchedulerConfig::new(start, self.lr, warmup)),
                    cosine,
                ],
                vec![warmup],
            ),
        };
        if self.total_steps() > end {
            schedulers.push(LrSchedulerConfig::Constant(floor));
            milestones.push(end);
        }
        SequentialLrSchedulerConfig::new(schedulers, milestones)
            .init()
            .map_err(|e| {
                anyhow::anyhow!(
                    "the learning-rate schedule of {} = {:e} (a warmup from {start:e}, a \
                     decay to {floor:e}): {e}",
                    crate::fields::LR.name(),
                    self.lr
                )
            })
    }

    /// Longest sequence a model reads: `input SEP output EOS`; for the text task, the
    /// block.
    pub fn max_len(&self) -> usize {
        self.kind().max_len(&self.task)
    }

    /// The task at longer inputs than any trained on, for the length-generalisation test:
    /// lengths `max_len + 1 ..= max_len * 3 / 2` (17..=24 for 8..=16); `None` for a model
    /// that cannot read them (learned absolute positions).
    pub fn longer_task(&self) -> Option<TaskConfig> {
        self.kind().longer_task(self)
    }

    /// The length test the final evaluation runs: [`longer_task`](Self::longer_task)'s
    /// held-out inputs, `None` when it has none (a task of few inputs at those lengths).
    pub fn length_test(&self) -> Option<TaskConfig> {
        self.longer_task()
            .filter(|longer| !matches!(longer.split_sizes(), Some([_, 0])))
    }

    /// The width of a packed row (twice the longest sequence), when packing.
    pub fn pack_width(&self) -> Option<usize> {
        self.pack.then_some(2 * self.max_len())
    }

    /// The fixed batch shape on `backend`, if any (see `fixed_shapes`).
    /// The text task's windows all have one shape: none.
    pub fn fixed_shape(&self, backend: Backend) -> Option<FixedShape> {
        self.kind().fixed_shape(self, backend)
    }

    /// The model, initialised from the seed.
    /// For the text task: nanoGPT's language model (the head tied to the token
    /// embedding, its initialisation) over the run's vocabulary.
    pub fn init_model(&self, device: &Device) -> anyhow::Result<Model> {
        device.seed(self.seed);
        self.kind().init_model(self, device)
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

    /// As [`read`](Self::read), with the task `task` (the `--task` flag, which overrides
    /// the file's) or else the file's: the fields the file leaves out take that task's
    /// defaults, else (no task named) the synthetic defaults.
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
}

#[cfg(test)]
mod tests {
    use super::json::join;
    use super::*;
    use crate::fields;
    use serde_json::Value;

    fn load(text: &str) -> anyhow::Result<TrainConfig> {
        // A file of its own for each call (the tests run in parallel), removed after.
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!(
            "mha-config-test-{}-{call}.json",
            std::process::id()
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
        // The largest seed is a seed (it rounds to 2^64 as a float), one past it is not: a
        // run's own config.json, written with its seed, reads back.
        let max = TrainConfig::from_json(r#"{"seed": 18446744073709551615}"#).unwrap();
        assert_eq!(max.seed, u64::MAX);
        let written = TrainConfig::from_json(&max.to_json().unwrap()).unwrap();
        assert_eq!(written.seed, u64::MAX);
        let err = format!(
            "{:#}",
            TrainConfig::from_json(r#"{"seed": 18446744073709551616}"#).unwrap_err()
        );
        assert!(
            err.contains("`seed` = 18446744073709551616: too large"),
            "{err}"
        );
        // What a file gives is echoed short and escaped.
        let long = format!(r#"{{"task": "{}\u001b[31m"}}"#, "x".repeat(100_000));
        let err = format!("{:#}", TrainConfig::from_json(&long).unwrap_err());
        assert!(err.len() < 300 && !err.contains('\x1b'), "{err}");
    }

    #[test]
    fn every_configuration_the_readme_shows_is_read() {
        let section = include_str!("../../README.md");
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
        // The flag's task over the file's, its defaults too, as every flag overrides it.
        let both = r#"{"task": "reverse", "lr": 0.002}"#;
        assert_eq!(
            TrainConfig::from_json_as(both, Some(Task::Text)).unwrap(),
            flag
        );
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
        // Numbers that take 17 digits, which serde_json's default parser reads one unit
        // in the last place off: a resumed run would train with another learning rate.
        let config = TrainConfig {
            warmup_steps: Some(7),
            fixed_shapes: Some(true),
            lr: 0.00037839831809023813,
            min_lr_ratio: 0.39764443279911005,
            ..TrainConfig::default()
        };
        let read = load(&config.to_json().unwrap()).unwrap();
        assert_eq!(read.lr.to_bits(), config.lr.to_bits());
        assert_eq!(read.min_lr_ratio.to_bits(), config.min_lr_ratio.to_bits());
        assert_eq!(read, config);
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
            (
                "grad_clip",
                TrainConfig {
                    grad_clip: f32::INFINITY,
                    ..TrainConfig::default()
                },
            ),
        ] {
            let err = config.validate().unwrap_err().to_string();
            assert!(err.contains(field) && err.ends_with("got inf"), "{err}");
        }
    }
}
