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

/// The entries a run writes at the top of its directory (with the pictures, `inspect/` and
/// files being written: what `--overwrite` removes).
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
    "inspect",
];

/// The lock file of a run directory, while a command uses it.
const LOCK: &str = ".lock";

/// Whether the trainer writes an entry of this name at the top of a run directory.
fn is_trainers(name: &str) -> bool {
    ENTRIES.contains(&name)
        || name.ends_with(".partial")
        || name
            .strip_prefix("attention-layer")
            .and_then(|rest| rest.strip_suffix(".png"))
            .is_some_and(|n| n.parse::<usize>().is_ok())
}

/// `a, b, c`, or the first few and how many more.
fn list(names: &[String]) -> String {
    const SHOWN: usize = 5;
    let shown: Vec<String> = names
        .iter()
        .take(SHOWN)
        .map(|n| crate::text::echo(n))
        .collect();
    match names.len() > SHOWN {
        true => format!("{} and {} more", shown.join(", "), names.len() - SHOWN),
        false => shown.join(", "),
    }
}

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

    /// Locks the directory for this process (making it if absent) until the lock is
    /// dropped: a second command on the same run is refused while the first runs. A lock
    /// left by a process that no longer runs (killed) is taken over, with a note.
    ///
    /// # Errors
    /// When the directory cannot be made, or when a running process holds the lock
    /// (naming it).
    pub fn lock(&self) -> anyhow::Result<RunLock> {
        let dir = self.0.display();
        std::fs::create_dir_all(&self.0).with_context(|| format!("cannot create {dir}"))?;
        let path = self.0.join(LOCK);
        let me = std::process::id();
        for _ in 0..3 {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut file) => {
                    use std::io::Write;
                    writeln!(file, "{me}")
                        .with_context(|| format!("cannot write {}", path.display()))?;
                    return Ok(RunLock { path, pid: me });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => {
                    return Err(e).with_context(|| format!("cannot create {}", path.display()));
                }
            }
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            let pid = holder.trim().parse::<u32>().ok();
            match pid {
                Some(pid) if pid != me && process_runs(pid) => anyhow::bail!(
                    "{dir} is in use by another command of the trainer (process {pid}): wait \
                     for it to end, or stop it; if no such process runs, delete {}",
                    path.display()
                ),
                // Being written by a process that has just made it: look again.
                None if holder.is_empty() => {
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    if std::fs::read_to_string(&path)
                        .unwrap_or_default()
                        .is_empty()
                    {
                        remove(&path)?;
                    }
                }
                _ => {
                    eprintln!(
                        "note: {dir} was locked by process {}, which no longer runs (it was \
                         killed or crashed): taking the lock over",
                        holder.trim()
                    );
                    remove(&path)?;
                }
            }
        }
        anyhow::bail!("cannot lock {dir}: {} keeps changing", path.display())
    }

    /// Checks that the metric logs of epochs `1..=epochs` read back, as the learner reads
    /// them at the end of a run.
    ///
    /// # Errors
    /// Naming the file, the line and what it holds, and what to do.
    pub fn check_metric_logs(&self, epochs: usize) -> anyhow::Result<()> {
        use burn::train::metric::NumericEntry;
        for split in ["train", "valid"] {
            for epoch in 1..=epochs {
                let folder = self.0.join(split).join(format!("epoch-{epoch}"));
                let Ok(entries) = std::fs::read_dir(&folder) else {
                    continue;
                };
                for entry in entries.filter_map(Result::ok) {
                    let path = entry.path();
                    if path.extension().is_none_or(|e| e != "log") {
                        continue;
                    }
                    let text = std::fs::read(&path)
                        .with_context(|| format!("cannot read {}", path.display()))?;
                    let text = String::from_utf8_lossy(&text);
                    for (n, line) in text.split('\n').enumerate() {
                        if !line.is_empty() && NumericEntry::deserialize(line).is_err() {
                            anyhow::bail!(
                                "{} line {} is damaged (\"{}\"): the learner cannot read the \
                                 epoch's metrics back; delete that line (or the file) and \
                                 --resume again",
                                path.display(),
                                n + 1,
                                crate::text::echo(line),
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The newest complete checkpoint that loads whole and holds finite weights, with a
    /// warning for each newer one passed over; `None` when there is none.
    pub fn newest_usable_checkpoint(
        &self,
        config: &TrainConfig,
        device: &burn::tensor::Device,
    ) -> Option<usize> {
        let mut epochs = self.complete_epochs();
        epochs.sort_unstable_by(|a, b| b.cmp(a));
        for epoch in epochs {
            let usable = self
                .check_checkpoint(config, epoch, device)
                .and_then(|model| {
                    anyhow::ensure!(
                        is_finite(&model),
                        "{}: its weights are not finite (the loss had become NaN or infinite)",
                        self.checkpoint(epoch).display()
                    );
                    Ok(())
                });
            match usable {
                Ok(()) => return Some(epoch),
                Err(e) => eprintln!("warning: passing over the checkpoint of epoch {epoch}: {e:#}"),
            }
        }
        None
    }

    /// Makes the directory ready for a new run: absent or empty, or (with `overwrite`)
    /// holding a run, whose files (the trainer's own: the run's, `inspect/` and the
    /// pictures) are removed, while any other file stays where it is. Everything is
    /// decided before anything is removed. Call it once every setting is checked, with the
    /// directory's lock held.
    ///
    /// # Errors
    /// When `--out` is a file; when it holds a run and `overwrite` is off (naming
    /// `--resume` and `--overwrite`); when it holds no run but other files (never removed).
    pub fn prepare_new(&self, overwrite: bool) -> anyhow::Result<()> {
        let dir = self.0.display();
        let (ours, others) = self.entries()?;
        if self.holds_run() {
            anyhow::ensure!(
                overwrite,
                "{dir} already holds a run{}: continue it with --resume, or start a new one \
                 with --overwrite (which deletes it) or with another --out",
                self.describe()
            );
            if !others.is_empty() {
                eprintln!(
                    "note: --overwrite removes the run in {dir} and keeps what the trainer did \
                     not write: {}",
                    list(&others)
                );
            }
            for name in ours {
                remove(&self.0.join(name))?;
            }
            return Ok(());
        }
        let all: Vec<String> = ours.into_iter().chain(others).collect();
        anyhow::ensure!(
            all.is_empty(),
            "{dir} is not empty ({}) and holds no run: choose an empty or new --out",
            list(&all)
        );
        Ok(())
    }

    /// The names at the top of the directory: (the trainer's own, the others), each
    /// sorted. The lock and the files being written are neither.
    fn entries(&self) -> anyhow::Result<(Vec<String>, Vec<String>)> {
        let entries = match std::fs::read_dir(&self.0) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Default::default()),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", self.0.display())),
        };
        let mut names: Vec<String> = entries
            .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
            .filter(|name| name != LOCK)
            .collect();
        names.sort();
        Ok(names.into_iter().partition(|name| is_trainers(name)))
    }

    /// " (task reverse, 8 epochs, 3 complete)", what the run in the directory is.
    fn describe(&self) -> String {
        let Ok(config) = TrainConfig::load(&self.config()) else {
            return String::new();
        };
        let done = self.last_complete_epoch().unwrap_or(0);
        format!(
            " (task {}, {} of {} complete)",
            config.task.task.name(),
            done,
            crate::text::plural(config.epochs, "epoch")
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
        self.complete_epochs().into_iter().max()
    }

    /// The epochs whose checkpoints are complete (all their parts written).
    fn complete_epochs(&self) -> Vec<usize> {
        let Ok(entries) = std::fs::read_dir(self.0.join("checkpoints")) else {
            return Vec::new();
        };
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
            .collect()
    }

    /// Checks that the parts of epoch `epoch`'s checkpoint load, naming the first that
    /// does not; the model it holds.
    pub fn check_checkpoint(
        &self,
        config: &TrainConfig,
        epoch: usize,
        device: &burn::tensor::Device,
    ) -> anyhow::Result<Model> {
        let model = load_model(config, &self.checkpoint(epoch), device)?;
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
        Ok(model)
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

/// Whether every weight of `model` is finite.
pub fn is_finite(model: &Model) -> bool {
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::tensor::Tensor;
    struct Finite(bool);
    impl ModuleVisitor for Finite {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0 {
                self.0 = param.val().is_finite().all().into_scalar::<bool>();
            }
        }
    }
    let mut finite = Finite(true);
    model.visit(&mut finite);
    finite.0
}

/// Whether a process `pid` runs (on systems without `/proc`, every process is taken to
/// run: a stale lock is then removed by hand, as its error says).
fn process_runs(pid: u32) -> bool {
    let proc = Path::new("/proc");
    !proc.is_dir() || proc.join(pid.to_string()).exists()
}

/// The lock of a run directory (see [`RunDir::lock`]); dropping it unlocks.
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
    pid: u32,
}

impl Drop for RunLock {
    fn drop(&mut self) {
        let ours = std::fs::read_to_string(&self.path)
            .is_ok_and(|holder| holder.trim() == self.pid.to_string());
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
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
