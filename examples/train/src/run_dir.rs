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
//! previous version whole. Each weights file (`*.bpk`) has its checksum beside it
//! (`*.bpk.sum`), checked whenever it is read: a file damaged since it was written is
//! named, never used. A directory belongs to one run: a new run refuses a directory
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

/// The name a file being written will have: `x.partial` and `x.partial.png` (a picture,
/// whose extension says its format) are `x` and `x.png`.
fn unwritten(name: &str) -> String {
    let name = name.strip_suffix(".partial").unwrap_or(name);
    match name.rsplit_once(".partial.") {
        Some((stem, ext)) if !ext.contains('.') => format!("{stem}.{ext}"),
        _ => name.to_string(),
    }
}

/// Whether the trainer writes an entry of this name at the top of a run directory.
fn is_trainers(name: &str) -> bool {
    let name = unwritten(name);
    let name = name.as_str();
    ENTRIES.contains(&name)
        || name == "model.bpk.sum"
        || name
            .strip_prefix("attention-layer")
            .and_then(|rest| rest.strip_suffix(".png"))
            .is_some_and(|n| n.parse::<usize>().is_ok())
}

/// Whether the trainer writes a file at `parts` (its path in a run directory, by
/// component): the top's files, a checkpoint's parts, the metric logs, what `inspect`
/// writes.
fn written_by_trainer(parts: &[String]) -> bool {
    let epoch = |name: &str| {
        name.strip_prefix("epoch-")
            .is_some_and(|n| n.parse::<usize>().is_ok())
    };
    // A file being written, or a weights file's checksum (`.sum`).
    let partial = |name: &str| {
        let name = unwritten(name);
        name.strip_suffix(".sum").unwrap_or(&name).to_string()
    };
    let names: Vec<&str> = parts.iter().map(String::as_str).collect();
    match names.as_slice() {
        [top] => is_trainers(top),
        ["checkpoints", e, file] => {
            epoch(e) && PARTS.iter().any(|p| partial(file) == format!("{p}.bpk"))
        }
        ["train" | "valid", e, file] => epoch(e) && file.ends_with(".log"),
        ["inspect", file] => {
            let file = partial(file);
            file == "heads.json"
                || file
                    .strip_prefix("attention-")
                    .and_then(|rest| rest.rsplit_once('.'))
                    .is_some_and(|(n, ext)| {
                        n.parse::<usize>().is_ok() && (ext == "png" || ext == "svg")
                    })
        }
        ["inspect", pruned, file] => {
            pruned
                .strip_prefix("pruned-")
                .is_some_and(|k| k.parse::<usize>().is_ok())
                && ["model.bpk", "plan.json"].contains(&partial(file).as_str())
        }
        _ => false,
    }
}

/// Sorts what is at `parts` under `root` (a path by component) into the files the
/// trainer wrote (`removed`), the others (`kept`, as paths relative to `root`) and the
/// folders on the way (`folders`, parents first), recursively.
fn sort_out(
    root: &Path,
    parts: &[String],
    removed: &mut Vec<PathBuf>,
    kept: &mut Vec<String>,
    folders: &mut Vec<PathBuf>,
) -> anyhow::Result<()> {
    let path = parts.iter().fold(root.to_path_buf(), |p, c| p.join(c));
    let is_folder = std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir());
    if !is_folder {
        match written_by_trainer(parts) {
            true => removed.push(path),
            false => kept.push(parts.join("/")),
        }
        return Ok(());
    }
    folders.push(path.clone());
    let entries =
        std::fs::read_dir(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut names: Vec<String> = entries
        .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
        .collect();
    names.sort();
    for name in names {
        let inner: Vec<String> = parts.iter().cloned().chain([name]).collect();
        sort_out(root, &inner, removed, kept, folders)?;
    }
    Ok(())
}

/// Removes what [`sort_out`] found the trainer wrote under `root`, then its `folders`,
/// deepest first, where nothing of the user's is left in them.
fn remove_sorted(removed: Vec<PathBuf>, folders: &[PathBuf], root: &Path) -> anyhow::Result<()> {
    for path in removal_order(removed, root) {
        remove(&path)?;
    }
    for folder in folders.iter().rev() {
        let _ = std::fs::remove_dir(folder);
    }
    Ok(())
}

/// The `status` of a summary read as JSON.
fn status(summary: &serde_json::Value) -> Option<&str> {
    summary.get("status")?.as_str()
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

    /// Whether the directory has a `config.json` (a run's or not: [`Self::stored`] says).
    pub fn holds_run(&self) -> bool {
        self.config().exists()
    }

    /// The run's configuration as its `config.json` holds it (unchecked values included):
    /// `None` without one; an error when the file is not a run's configuration, so that
    /// the directory is not a run.
    pub fn stored(&self) -> Option<anyhow::Result<TrainConfig>> {
        self.holds_run().then(|| TrainConfig::read(&self.config()))
    }

    /// The epochs of the model in `model.bpk` as the summary records them (its
    /// `model_epochs`, or the steps of a finished run); `None` without a model or a record.
    pub fn model_epochs(&self, config: &TrainConfig) -> Option<usize> {
        if !self.model().exists() {
            return None;
        }
        let summary = self.written_summary()?;
        if let Some(epochs) = summary.get("model_epochs").and_then(|v| v.as_u64()) {
            return Some(epochs as usize);
        }
        let finished = status(&summary) == Some("finished");
        let steps = summary.get("steps_done")?.as_u64()? as usize;
        finished.then(|| steps / config.steps_per_epoch.max(1))
    }

    /// Whether the run's summary says its loss became NaN or infinite.
    pub fn diverged(&self) -> bool {
        self.written_summary()
            .is_some_and(|s| status(&s) == Some("diverged"))
    }

    /// `summary.json` as written, read as plain JSON (this layer is below the summary's
    /// type, in `training`); `None` when absent or unreadable.
    fn written_summary(&self) -> Option<serde_json::Value> {
        serde_json::from_str(&std::fs::read_to_string(self.summary()).ok()?).ok()
    }

    /// Checks that every folder the trainer writes in (the directory, `train/`, `valid/`,
    /// `checkpoints/`, `inspect/` and the folders inside them) can be written, and that
    /// none of them is a file: before anything is written or removed, so that a command
    /// either does all it writes or stops with nothing changed.
    ///
    /// # Errors
    /// Naming the folder and why it cannot be written.
    pub fn check_writable(&self) -> anyhow::Result<()> {
        if !self.0.exists() {
            return Ok(());
        }
        let mut folders = vec![self.0.clone()];
        for name in ["train", "valid", "checkpoints", "inspect"] {
            let path = self.0.join(name);
            if path.exists() && !path.is_dir() {
                anyhow::bail!(
                    "{} is a file where the trainer writes a folder: move it away",
                    path.display()
                );
            }
            let Ok(entries) = std::fs::read_dir(&path) else {
                continue;
            };
            folders.push(path);
            folders.extend(
                entries
                    .filter_map(|e| Some(e.ok()?.path()))
                    .filter(|p| p.is_dir()),
            );
        }
        for folder in folders {
            let probe = folder.join(format!(".write-check-{}", std::process::id()));
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&probe)
                .and_then(|_| std::fs::remove_file(&probe))
                .with_context(|| {
                    format!(
                        "cannot write in {} (the trainer writes its files there)",
                        folder.display()
                    )
                })?;
        }
        Ok(())
    }

    /// Checks that Burn's learner can read what it reads at the end of training, when it
    /// counts the epochs for its summary: every entry of the directory and of its folders
    /// (followed where it is a link), and the names of the folders in those (UTF-8). It
    /// panics on one it cannot read (a link to nothing, a folder it may not list): this
    /// names it before anything is written or removed.
    ///
    /// # Errors
    /// Naming the entry and why it cannot be read.
    pub fn check_learner_reads(&self) -> anyhow::Result<()> {
        let unreadable = |path: &Path, why: &str| {
            anyhow::anyhow!(
                "{}: {why}, and Burn's learner reads every entry of the run directory and of \
                 its folders when training ends: move it away",
                path.display()
            )
        };
        let Ok(entries) = std::fs::read_dir(&self.0) else {
            return Ok(()); // Not made yet.
        };
        for entry in entries {
            let path = entry
                .map_err(|e| unreadable(&self.0, &e.to_string()))?
                .path();
            let meta = std::fs::metadata(&path)
                .map_err(|e| unreadable(&path, &format!("cannot be read ({e})")))?;
            if !meta.is_dir() {
                continue;
            }
            let inner = std::fs::read_dir(&path)
                .map_err(|e| unreadable(&path, &format!("cannot be listed ({e})")))?;
            for entry in inner {
                let path = entry.map_err(|e| unreadable(&path, &e.to_string()))?.path();
                let meta = std::fs::metadata(&path)
                    .map_err(|e| unreadable(&path, &format!("cannot be read ({e})")))?;
                let utf8 = path.file_name().is_some_and(|n| n.to_str().is_some());
                if meta.is_dir() && !utf8 {
                    return Err(unreadable(&path, "its name is not UTF-8"));
                }
            }
        }
        Ok(())
    }

    /// Locks the directory for this process (making it if absent) until the lock is
    /// dropped: a second command on the same run is refused while the first runs. The lock
    /// is the operating system's on the file `.lock` (which holds the process id, for the
    /// messages), so it ends with its process, however that ends: a `.lock` left by a
    /// process that was killed is taken over, with a note.
    ///
    /// # Errors
    /// When the directory cannot be made; when a running process holds the lock (naming
    /// it); when `.lock` is not the trainer's (a folder, or a file that does not hold a
    /// process id): it is left as it is.
    pub fn lock(&self) -> anyhow::Result<RunLock> {
        use std::io::{Read, Seek, Write};
        let dir = self.0.display();
        std::fs::create_dir_all(&self.0).with_context(|| format!("cannot create {dir}"))?;
        let path = self.0.join(LOCK);
        let me = std::process::id();
        let not_ours = |what: &str| {
            anyhow::anyhow!(
                "{} is not the trainer's lock ({what}): move it elsewhere, or choose another \
                 --out",
                path.display()
            )
        };
        for _ in 0..3 {
            if std::fs::symlink_metadata(&path).is_ok_and(|m| !m.is_file()) {
                return Err(not_ours("not a file"));
            }
            let mut file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .with_context(|| format!("cannot open {}", path.display()))?;
            let mut holder = String::new();
            match file.try_lock() {
                Ok(()) => {}
                Err(std::fs::TryLockError::WouldBlock) => {
                    let _ = file.read_to_string(&mut holder);
                    let process = match holder.trim().parse::<u32>() {
                        Ok(pid) => format!("process {pid}"),
                        Err(_) => "another process".to_string(),
                    };
                    anyhow::bail!(
                        "{dir} is in use by another command of the trainer ({process}): wait \
                         for it to end, or stop it"
                    );
                }
                Err(std::fs::TryLockError::Error(e)) => {
                    return Err(e).with_context(|| format!("cannot lock {}", path.display()));
                }
            }
            // Locked: unless the file was removed meanwhile by the command that held it,
            // which ended (then lock the file that is there now).
            if !same_file(&file, &path) {
                continue;
            }
            file.read_to_string(&mut holder)
                .map_err(|_| not_ours("not text"))?;
            let holder = holder.trim();
            if !holder.is_empty() {
                if holder.parse::<u32>().is_err() {
                    return Err(not_ours(&format!(
                        "it holds \"{}\", not a process id",
                        crate::text::echo(holder)
                    )));
                }
                eprintln!(
                    "note: {dir} was locked by process {holder}, which no longer runs the \
                     trainer (it was killed or crashed): taking the lock over"
                );
            }
            file.set_len(0)
                .and_then(|()| file.rewind())
                .and_then(|()| writeln!(file, "{me}"))
                .with_context(|| format!("cannot write {}", path.display()))?;
            return Ok(RunLock { path, file });
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
    /// warning for each newer one passed over (damaged: cut short, not Burn's, not its
    /// checksum's, not finite); `None` when there is none.
    ///
    /// # Errors
    /// When a newer checkpoint's file cannot be read at all (permission denied, a folder
    /// in its place, an I/O error): it may be whole, and passing over it would have
    /// `--resume` remove it with the epochs it trains again.
    pub fn newest_usable_checkpoint(
        &self,
        config: &TrainConfig,
        device: &burn::tensor::Device,
    ) -> anyhow::Result<Option<usize>> {
        let mut epochs = self.complete_epochs();
        epochs.sort_unstable_by(|a, b| b.cmp(a));
        for epoch in epochs {
            let usable = self.check_checkpoint(config, epoch, device).map(|_| ());
            match usable {
                Ok(()) => return Ok(Some(epoch)),
                Err(e) if unreadable(&e) => {
                    return Err(e.context(format!(
                        "the checkpoint of epoch {epoch} cannot be read, so whether it is whole \
                         is unknown: make it readable (or move it away) and try again; nothing \
                         was changed"
                    )));
                }
                Err(e) => eprintln!("warning: passing over the checkpoint of epoch {epoch}: {e:#}"),
            }
        }
        Ok(None)
    }

    /// Makes the directory ready for a new run: absent or empty, or (with `overwrite`)
    /// holding a run (a `config.json` that is a run's), whose files are removed: those the
    /// trainer writes, by name and place (a checkpoint's parts, the metric logs, `inspect/`'s
    /// findings), while any other file stays where it is, named. Everything is decided and
    /// every folder checked writable before anything is removed. Call it once every
    /// setting is checked, with the directory's lock held.
    ///
    /// # Errors
    /// When `--out` is a file; when it holds a run and `overwrite` is off (naming
    /// `--resume` and `--overwrite`); when its `config.json` is not a run's, or it holds
    /// no run but other files (never removed); when a folder cannot be written.
    pub fn prepare_new(&self, overwrite: bool) -> anyhow::Result<()> {
        let dir = self.0.display();
        let (ours, others) = self.entries()?;
        match self.stored() {
            None => {
                let all: Vec<String> = ours.into_iter().chain(others).collect();
                anyhow::ensure!(
                    all.is_empty(),
                    "{dir} is not empty ({}) and holds no run (no config.json): choose an empty \
                     or new --out",
                    list(&all)
                );
                return Ok(());
            }
            Some(Err(err)) => anyhow::bail!(
                "{dir} is not a run: its config.json is not a run's configuration ({err:#}); \
                 --overwrite removes only a run, so choose an empty or new --out"
            ),
            Some(Ok(_)) => {}
        }
        anyhow::ensure!(
            overwrite,
            "{dir} already holds a run{}: continue it with --resume, or start a new one with \
             --overwrite (which deletes it) or with another --out",
            self.describe()
        );
        self.check_writable()?;
        self.check_learner_reads()?;
        let (mut removed, mut kept, mut folders) = (Vec::new(), others, Vec::new());
        for name in ours {
            sort_out(&self.0, &[name], &mut removed, &mut kept, &mut folders)?;
        }
        if !kept.is_empty() {
            eprintln!(
                "note: --overwrite removes the run in {dir} and keeps what the trainer did not \
                 write: {}",
                list(&kept)
            );
        }
        remove_sorted(removed, &folders, &self.0)
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
    /// checkpoint), before a resumed run trains them again: the files the trainer writes
    /// there (and a link in place of an epoch's folder, not what it points to), then each
    /// folder left empty; anything else in them is kept, and named.
    pub fn forget_after(&self, epoch: usize) -> anyhow::Result<()> {
        let (mut removed, mut kept, mut folders) = (Vec::new(), Vec::new(), Vec::new());
        for folder in ["train", "valid", "checkpoints"] {
            let Ok(entries) = std::fs::read_dir(self.0.join(folder)) else {
                continue;
            };
            let mut later: Vec<String> = entries
                .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
                .filter(|name| {
                    name.strip_prefix("epoch-")
                        .and_then(|n| n.parse::<usize>().ok())
                        .is_some_and(|n| n > epoch)
                })
                .collect();
            later.sort();
            for name in later {
                let path = self.0.join(folder).join(&name);
                // A link where the epoch's folder goes: the trainer would write through it.
                // The link goes; what it points to stays.
                if std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_symlink()) {
                    removed.push(path);
                    continue;
                }
                let parts = [folder.to_string(), name];
                sort_out(&self.0, &parts, &mut removed, &mut kept, &mut folders)?;
            }
        }
        if !kept.is_empty() {
            eprintln!(
                "warning: kept what the trainer did not write in the epochs it trains again: {}",
                list(&kept)
            );
        }
        remove_sorted(removed, &folders, &self.0)
    }

    /// Writes `config.json`.
    pub fn write_config(&self, config: &TrainConfig) -> anyhow::Result<()> {
        write_atomically(&self.config(), config.to_json()?.as_bytes())
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
        verify(&optim)?;
        <OptimizerRecord as Checkpoint>::load(optim.clone()).map_err(|e| {
            anyhow::anyhow!("{}: cannot load the optimizer state ({e})", optim.display())
        })?;
        let scheduler = self.epoch(epoch).join("scheduler.bpk");
        verify(&scheduler)?;
        <LrSchedulerRecord as Checkpoint>::load(scheduler.clone()).map_err(|e| {
            anyhow::anyhow!(
                "{}: cannot load the scheduler state ({e})",
                scheduler.display()
            )
        })?;
        Ok(model)
    }
}

/// Whether `err` says a file could not be read at all (the system refused, or it is not
/// a file), rather than that what was read is damaged (cut short, not valid).
fn unreadable(err: &anyhow::Error) -> bool {
    use std::io::ErrorKind;
    err.chain()
        .filter_map(|cause| cause.downcast_ref::<std::io::Error>())
        .any(|io| {
            !matches!(
                io.kind(),
                ErrorKind::InvalidData | ErrorKind::UnexpectedEof | ErrorKind::NotFound
            )
        })
}

/// Loads model weights from `path` into a model of `config`, with an error naming the
/// file and what is wrong: one that does not load, or whose weights are not all finite
/// (a damaged file, or a checkpoint of a run that diverged).
pub fn load_model(
    config: &TrainConfig,
    path: &Path,
    device: &burn::tensor::Device,
) -> anyhow::Result<Model> {
    use burn::module::Module;
    // An error the system gives (a folder that may not be read) is not "no such model":
    // `newest_usable_checkpoint` tells it from a damaged checkpoint by its `io::Error`.
    let exists = path
        .try_exists()
        .with_context(|| format!("cannot read {}", path.display()))?;
    anyhow::ensure!(exists, "{}: no such model", path.display());
    verify(path)?;
    let model = config
        .init_model(device)?
        .try_load_file(path)
        .map_err(|e| anyhow::anyhow!("{}: cannot load the model ({e})", path.display()))?;
    // The run directory: the file's folder, or (a checkpoint) two above it.
    let diverged = path
        .ancestors()
        .skip(1)
        .take(3)
        .any(|dir| RunDir(dir.to_path_buf()).diverged());
    anyhow::ensure!(
        is_finite(&model),
        "{}: its weights are not all finite (NaN or infinite): {}",
        path.display(),
        match diverged {
            true => "the run's loss had become NaN or infinite",
            false => "the file is damaged",
        }
    );
    Ok(model)
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

/// The order in which `--overwrite` removes a run's `paths` from `dir`: `config.json`
/// last, so that a command killed midway leaves a run that `--overwrite` removes again
/// (without it the folder holds no run, and the trainer's files in it are never removed).
fn removal_order(mut paths: Vec<PathBuf>, dir: &Path) -> Vec<PathBuf> {
    let config = dir.join("config.json");
    paths.sort_by_key(|path| *path == config);
    paths
}

/// Whether `path` is the file `file` has open (not removed, nor replaced since).
fn same_file(file: &std::fs::File, path: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (file.metadata(), std::fs::metadata(path)) {
            (Ok(open), Ok(there)) => (open.dev(), open.ino()) == (there.dev(), there.ino()),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        // Not checked elsewhere: the file there is taken to be the one open (a command that
        // locks a `.lock` just removed while a third makes a new one is not told).
        let _ = file;
        path.is_file()
    }
}

/// The lock of a run directory (see [`RunDir::lock`]); dropping it unlocks and removes
/// `.lock`.
#[derive(Debug)]
pub struct RunLock {
    path: PathBuf,
    /// The open `.lock`, locked: the lock lasts as long as it is open.
    file: std::fs::File,
}

impl Drop for RunLock {
    fn drop(&mut self) {
        // Removed while still locked, so that no other command locks it meanwhile; one
        // that opened it before is told by `same_file` that it was removed.
        if same_file(&self.file, &self.path) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Writes `bytes` to `path` through a temporary file in the same folder, renamed over
/// `path` once complete and on the disk (synced, then its folder), so that neither a kill
/// nor a power cut leaves `path` half written or empty.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let partial = partial(path);
    let written = || -> std::io::Result<()> {
        use std::io::Write;
        let mut file = std::fs::File::create(&partial)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&partial, path)?;
        sync_folder(path)
    };
    written().with_context(|| format!("cannot write {}", path.display()))
}

/// Syncs the folder of `path`, so that a rename into it is on the disk (where folders can
/// be synced: Unix).
fn sync_folder(path: &Path) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        let folder = match path.parent() {
            Some(folder) if !folder.as_os_str().is_empty() => folder,
            _ => Path::new("."),
        };
        std::fs::File::open(folder)?.sync_all()?;
    }
    #[cfg(not(unix))]
    let _ = path;
    Ok(())
}

/// Puts the complete weights file `written` at `path`, its checksum beside it. The old
/// checksum goes first: a crash between the steps leaves a file without a checksum (read
/// unchecked), never a file beside another's checksum.
///
/// # Errors
/// Naming the file that cannot be read, removed or written.
pub fn install_weights(written: &Path, path: &Path) -> anyhow::Result<()> {
    let bytes =
        std::fs::read(written).with_context(|| format!("cannot read {}", written.display()))?;
    let sum = checksum_file(path);
    remove(&sum)?;
    // Opened to write: syncing a file opened to read fails on Windows.
    std::fs::OpenOptions::new()
        .write(true)
        .open(written)
        .and_then(|file| file.sync_all())
        .and_then(|()| std::fs::rename(written, path))
        .and_then(|()| sync_folder(path))
        .with_context(|| format!("cannot write {}", path.display()))?;
    write_atomically(&sum, checksum(&bytes).as_bytes())
}

/// Checks the weights file `path` against the checksum written with it, when it has one
/// (a file written before checksums were kept has none).
///
/// # Errors
/// When the file or its checksum cannot be read, or they differ: the file was damaged
/// after the trainer wrote it.
pub fn verify(path: &Path) -> anyhow::Result<()> {
    // Readable, checksum or not (an error the system gives, which a caller can tell from
    // a damaged file's).
    let cannot_read = || format!("cannot read {}", path.display());
    let opened = std::fs::File::open(path).and_then(|file| match file.metadata()?.is_dir() {
        true => Err(std::io::Error::other("a folder, not a file")),
        false => Ok(file),
    });
    let mut file = opened.with_context(cannot_read)?;
    let sum = checksum_file(path);
    let expected = match std::fs::read_to_string(&sum) {
        Ok(expected) => expected,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", sum.display())),
    };
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut file, &mut bytes).with_context(cannot_read)?;
    anyhow::ensure!(
        checksum(&bytes).trim() == expected.trim(),
        "{}: the file is damaged: its contents are not what the trainer wrote (their \
         checksum differs from {})",
        path.display(),
        sum.display()
    );
    Ok(())
}

/// Where the checksum of the weights file `path` is kept.
fn checksum_file(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".sum");
    path.with_file_name(name)
}

/// `bytes`' checksum as written beside a weights file: the 64-bit FNV-1a hash and the
/// length, `fnv1a-64 <hash> <bytes>`.
pub(crate) fn checksum(bytes: &[u8]) -> String {
    let hash = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("fnv1a-64 {hash:016x} {}\n", bytes.len())
}

/// Where `path` is written before it is renamed into place.
fn partial(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    path.with_file_name(name)
}

/// Removes a file or a folder, if it is there.
///
/// # Errors
/// When it is there and cannot be removed.
pub fn remove(path: &Path) -> anyhow::Result<()> {
    // A link goes, not what it points to: as a file, or (a Windows link to a folder) as
    // an empty folder.
    let kind = std::fs::symlink_metadata(path).map(|m| m.file_type());
    let removed = match kind {
        Ok(kind) if kind.is_symlink() => {
            std::fs::remove_file(path).or_else(|_| std::fs::remove_dir(path))
        }
        Ok(kind) if kind.is_dir() => std::fs::remove_dir_all(path),
        _ => std::fs::remove_file(path),
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
        let named = |what: &Path, e: &dyn std::fmt::Display| {
            CheckpointerError::Unknown(format!("cannot write {}: {e}", what.display()))
        };
        let folder = self.run.epoch(epoch);
        std::fs::create_dir_all(&folder).map_err(|e| named(&folder, &e))?;
        record
            .save(partial(&path))
            .map_err(|e| named(&partial(&path), &e))?;
        install_weights(&partial(&path), &path)
            .map_err(|e| CheckpointerError::Unknown(format!("{e:#}")))
    }

    fn restore(&self, epoch: usize) -> Result<R, CheckpointerError> {
        let path = self.path(epoch);
        verify(&path).map_err(|e| CheckpointerError::Unknown(format!("{e:#}")))?;
        R::load(path)
    }

    fn delete(&self, epoch: usize) -> Result<(), CheckpointerError> {
        let path = self.path(epoch);
        // The weights, then their checksum (weights without one still load).
        let sum = checksum_file(&path);
        for file in [&path, &sum] {
            remove(file).map_err(|e| CheckpointerError::Unknown(format!("{e:#}")))?;
        }
        // The last part out removes the epoch's folder.
        let _ = std::fs::remove_dir(self.run.epoch(epoch));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overwrite_removes_the_runs_config_last() {
        let dir = Path::new("runs/x");
        let names = ["attention-layer1.png", "config.json", "model.bpk", "train"];
        let paths: Vec<PathBuf> = names.iter().map(|n| dir.join(n)).collect();
        let order = removal_order(paths, dir);
        assert_eq!(order.last(), Some(&dir.join("config.json")), "{order:?}");
        assert_eq!(order.len(), 4);
        assert_eq!(
            order[..3],
            [dir.join(names[0]), dir.join(names[2]), dir.join(names[3])]
        );
    }

    fn trainers(path: &str) -> bool {
        let parts: Vec<String> = path.split('/').map(str::to_string).collect();
        written_by_trainer(&parts)
    }

    #[test]
    fn the_trainers_files_are_known_by_name_and_place() {
        for ours in [
            "config.json",
            "model.bpk",
            "model.bpk.sum",
            "model.bpk.partial",
            "model.bpk.sum.partial",
            "loss.partial.png",
            "attention-layer1.png",
            "attention-layer1.partial.png",
            "checkpoints/epoch-3/optim.bpk",
            "checkpoints/epoch-3/optim.bpk.sum",
            "checkpoints/epoch-3/model.bpk.partial",
            "train/epoch-2/Loss.log",
            "inspect/heads.json.partial",
            "inspect/attention-0.partial.svg",
            "inspect/pruned-2/model.bpk.sum",
        ] {
            assert!(trainers(ours), "{ours}");
        }
        for theirs in [
            "notes.txt",
            "notes.txt.partial",
            "notes.partial.txt",
            "model.pt",
            "checkpoints/epoch-3/mine.pt",
            "checkpoints/mine/model.bpk",
            "inspect/plan.json",
            "inspect/pruned-2/notes.sum",
            "loss.partial.png.bak",
        ] {
            assert!(!trainers(theirs), "{theirs}");
        }
    }
}
