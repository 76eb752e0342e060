//! A run directory: one run's files, laid out by the trainer.
//!
//! ```text
//! config.json                 the run's configuration, written before training starts
//! checkpoints/epoch-N/        model.bpk, optim.bpk, scheduler.bpk after epoch N; an epoch
//!                             with all three is complete (the last two are kept)
//! train/, valid/              the learner's metric logs, one folder per epoch
//! experiment.log              the learner's log
//! learner.txt                 the learner's summary: the model and its metrics
//! model.bpk                   the trained model
//! summary.json                what the run did: finished or interrupted, losses, accuracy
//! loss.png, attention-layer*.png
//! ```
//!
//! Every file is written to a temporary name and renamed, so a crash or a kill leaves the
//! previous version whole. A directory belongs to one run: a new run refuses a directory
//! that holds another (unless told to overwrite it) or that holds anything else.

use std::path::{Path, PathBuf};

use anyhow::Context;
use burn::train::checkpoint::{Checkpoint, Checkpointer, CheckpointerError};

use crate::config::TrainConfig;
use crate::model::Model;

/// The files of one run.
#[derive(Clone, Debug)]
pub struct RunDir(pub PathBuf);

/// What a checkpoint of an epoch holds, one file each.
const PARTS: [&str; 3] = ["model", "optim", "scheduler"];

/// The entries a run writes at the top of its directory (what `--overwrite` removes).
const ENTRIES: &[&str] = &[
    "config.json",
    "checkpoints",
    "train",
    "valid",
    "experiment.log",
    "learner.txt",
    "model.bpk",
    "summary.json",
    "loss.png",
];

impl RunDir {
    /// `config.json`.
    pub fn config(&self) -> PathBuf {
        self.0.join("config.json")
    }

    /// The trained model.
    pub fn model(&self) -> PathBuf {
        self.0.join("model.bpk")
    }

    /// `summary.json`.
    pub fn summary(&self) -> PathBuf {
        self.0.join("summary.json")
    }

    /// The learner's summary (the model and its metrics).
    pub fn learner_summary(&self) -> PathBuf {
        self.0.join("learner.txt")
    }

    /// The loss curve.
    pub fn loss_curve(&self) -> PathBuf {
        self.0.join("loss.png")
    }

    /// The attention heatmap of `layer`.
    pub fn heatmap(&self, layer: usize) -> PathBuf {
        self.0.join(format!("attention-layer{layer}.png"))
    }

    /// The folder of epoch `epoch`'s checkpoint.
    fn epoch(&self, epoch: usize) -> PathBuf {
        self.0.join("checkpoints").join(format!("epoch-{epoch}"))
    }

    /// The model file of epoch `epoch`'s checkpoint.
    pub fn checkpoint(&self, epoch: usize) -> PathBuf {
        self.epoch(epoch).join("model.bpk")
    }

    /// Whether the directory holds a run (its `config.json`).
    pub fn holds_run(&self) -> bool {
        self.config().exists()
    }

    /// Makes the directory ready for a new run: absent or empty, or (with `overwrite`)
    /// holding a run, whose files are removed. Call it once every setting is checked.
    ///
    /// # Errors
    /// When it holds a run and `overwrite` is off (naming `--resume` and `--overwrite`),
    /// or holds files that are not a run's (never removed).
    pub fn prepare_new(&self, overwrite: bool) -> anyhow::Result<()> {
        let dir = self.0.display();
        if self.holds_run() {
            anyhow::ensure!(
                overwrite,
                "{dir} already holds a run{}: continue it with --resume, or start a new one \
                 with --overwrite (which deletes it) or with another --out",
                self.describe()
            );
            for entry in ENTRIES {
                remove(&self.0.join(entry))?;
            }
            for layer in 0.. {
                let path = self.heatmap(layer);
                if !path.exists() {
                    break;
                }
                remove(&path)?;
            }
        }
        let others: Vec<String> = match std::fs::read_dir(&self.0) {
            Ok(entries) => entries
                .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
                .collect(),
            Err(_) => Vec::new(),
        };
        anyhow::ensure!(
            others.is_empty(),
            "{dir} is not empty ({}) and holds no run: choose an empty or new --out",
            others.join(", ")
        );
        std::fs::create_dir_all(&self.0).with_context(|| format!("cannot create {dir}"))
    }

    /// " (task reverse, 8 epochs, 3 complete)", what the run in the directory is.
    fn describe(&self) -> String {
        let Ok(config) = TrainConfig::load(&self.config()) else {
            return String::new();
        };
        let done = self.last_complete_epoch().unwrap_or(0);
        format!(
            " (task {}, {} of {} epochs complete)",
            config.task.task.name(),
            done,
            config.epochs
        )
    }

    /// Removes what epochs after `epoch` left (their metric logs, an incomplete
    /// checkpoint), before a resumed run trains them again.
    pub fn forget_after(&self, epoch: usize) -> anyhow::Result<()> {
        for folder in ["train", "valid", "checkpoints"] {
            let Ok(entries) = std::fs::read_dir(self.0.join(folder)) else {
                continue;
            };
            for entry in entries.filter_map(Result::ok) {
                let name = entry.file_name().to_string_lossy().into_owned();
                let later = name
                    .strip_prefix("epoch-")
                    .and_then(|n| n.parse::<usize>().ok())
                    .is_some_and(|n| n > epoch);
                if later {
                    remove(&entry.path())?;
                }
            }
        }
        Ok(())
    }

    /// Writes `config.json`.
    pub fn write_config(&self, config: &TrainConfig) -> anyhow::Result<()> {
        write_atomically(&self.config(), config.to_json().as_bytes())
    }

    /// The checkpointer of one part (`model`, `optim` or `scheduler`) of each epoch's
    /// checkpoint, for the learner.
    pub fn checkpointer(&self, part: &'static str) -> PartCheckpointer {
        PartCheckpointer {
            run: self.clone(),
            part,
        }
    }

    /// The newest epoch whose checkpoint is complete (all its parts written), if any.
    pub fn last_complete_epoch(&self) -> Option<usize> {
        let entries = std::fs::read_dir(self.0.join("checkpoints")).ok()?;
        entries
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                name.strip_prefix("epoch-")?.parse().ok()
            })
            .filter(|&epoch| {
                PARTS
                    .iter()
                    .all(|part| self.epoch(epoch).join(format!("{part}.bpk")).exists())
            })
            .max()
    }

    /// Checks that the parts of epoch `epoch`'s checkpoint load, naming the first that
    /// does not.
    pub fn check_checkpoint(
        &self,
        config: &TrainConfig,
        epoch: usize,
        device: &burn::tensor::Device,
    ) -> anyhow::Result<()> {
        load_model(config, &self.checkpoint(epoch), device)?;
        use burn::optim::OptimizerRecord;
        use burn::optim::lr_scheduler::LrSchedulerRecord;
        let optim = self.epoch(epoch).join("optim.bpk");
        <OptimizerRecord as Checkpoint>::load(optim.clone()).map_err(|e| {
            anyhow::anyhow!("{}: cannot load the optimizer state ({e})", optim.display())
        })?;
        let scheduler = self.epoch(epoch).join("scheduler.bpk");
        <LrSchedulerRecord as Checkpoint>::load(scheduler.clone()).map_err(|e| {
            anyhow::anyhow!(
                "{}: cannot load the scheduler state ({e})",
                scheduler.display()
            )
        })?;
        Ok(())
    }
}

/// Loads model weights from `path` into a model of `config`, with an error naming the
/// file and what is wrong.
pub fn load_model(
    config: &TrainConfig,
    path: &Path,
    device: &burn::tensor::Device,
) -> anyhow::Result<Model> {
    use burn::module::Module;
    anyhow::ensure!(path.exists(), "{}: no such model", path.display());
    config
        .init_model(device)?
        .try_load_file(path)
        .map_err(|e| anyhow::anyhow!("{}: cannot load the model ({e})", path.display()))
}

/// Writes `bytes` to `path` through a temporary file in the same folder, renamed over
/// `path` once complete.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let partial = partial(path);
    std::fs::write(&partial, bytes)
        .and_then(|()| std::fs::rename(&partial, path))
        .with_context(|| format!("cannot write {}", path.display()))
}

/// Where `path` is written before it is renamed into place.
fn partial(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    path.with_file_name(name)
}

/// Removes a file or a folder, if it is there.
fn remove(path: &Path) -> anyhow::Result<()> {
    let removed = match path.is_dir() {
        true => std::fs::remove_dir_all(path),
        false => std::fs::remove_file(path),
    };
    match removed {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("cannot remove {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// The learner's checkpointer of one part of each epoch's checkpoint, in the run's layout.
pub struct PartCheckpointer {
    run: RunDir,
    part: &'static str,
}

impl PartCheckpointer {
    fn path(&self, epoch: usize) -> PathBuf {
        self.run.epoch(epoch).join(format!("{}.bpk", self.part))
    }
}

impl<R: Checkpoint> Checkpointer<R> for PartCheckpointer {
    fn save(&self, epoch: usize, record: R) -> Result<(), CheckpointerError> {
        let path = self.path(epoch);
        std::fs::create_dir_all(self.run.epoch(epoch)).map_err(CheckpointerError::IOError)?;
        record.save(partial(&path))?;
        std::fs::rename(partial(&path), &path).map_err(CheckpointerError::IOError)
    }

    fn restore(&self, epoch: usize) -> Result<R, CheckpointerError> {
        R::load(self.path(epoch))
    }

    fn delete(&self, epoch: usize) -> Result<(), CheckpointerError> {
        remove(&self.path(epoch)).map_err(|e| CheckpointerError::Unknown(format!("{e:#}")))?;
        // The last part out removes the epoch's folder.
        let _ = std::fs::remove_dir(self.run.epoch(epoch));
        Ok(())
    }
}
