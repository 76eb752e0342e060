//! What each command does, one function each: [`train`](train::train) a new run or
//! resume one, [`generate`](generate::generate) an answer to one input,
//! [`inspect`](inspect::inspect) a trained run's heads. [`run`] calls the one the command
//! line asks for, says how long it took, and turns its result into the exit code.

pub mod generate;
pub mod inspect;
pub mod train;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use crate::backend::Backend;
use crate::cli::{Cli, Command};
use crate::config::TrainConfig;
use crate::run_dir::RunDir;
use crate::tasks::Task;

/// Runs the command: exit code 0 when it did what it was asked, 130 when a Ctrl-C
/// stopped it (each after a last line on stderr with the command's wall time), 1 (after
/// a one-line error) otherwise.
pub fn run(cli: Cli) -> ExitCode {
    let started = Instant::now();
    let (name, result) = match cli.command {
        Some(Command::Generate(args)) => (
            "generate",
            generate::generate(&args, cli.backend).map(|()| true),
        ),
        Some(Command::Inspect(args)) => (
            "inspect",
            inspect::inspect(&args, cli.backend).map(|()| true),
        ),
        None => ("train", train::train(&cli.train, cli.backend)),
    };
    let seconds = started.elapsed().as_secs_f64();
    match result {
        Ok(true) => {
            eprintln!("{name} took {seconds:.1} s");
            ExitCode::SUCCESS
        }
        Ok(false) => {
            eprintln!("{name} stopped after {seconds:.1} s");
            ExitCode::from(130)
        }
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

/// The run directory a command reads or writes: `out`, or by default `runs/<task>`.
///
/// # Errors
/// When a file (not a directory) is in its place.
fn run_dir(out: &Option<PathBuf>, task: Option<Task>) -> anyhow::Result<RunDir> {
    let dir = out.clone().unwrap_or_else(|| {
        let task = task.unwrap_or(TrainConfig::default().task.task);
        PathBuf::from("runs").join(task.name())
    });
    anyhow::ensure!(
        !dir.exists() || dir.is_dir(),
        "--out {}: a file, not a directory; --out names a run's directory (a new or empty \
         one for a new run)",
        dir.display()
    );
    Ok(RunDir(dir))
}

/// Refuses a `--task` that is not the task of the run in `--out` (given both, the run
/// would be read whatever `--task` says).
///
/// # Errors
/// Naming both tasks.
fn check_task(run: &RunDir, task: Option<Task>, config: &TrainConfig) -> anyhow::Result<()> {
    match task {
        Some(task) if task != config.task.task => anyhow::bail!(
            "--task {}: {} is a {} run; leave --task out to read it, or name another run's \
             directory with --out",
            task.name(),
            run.0.display(),
            config.task.task.name()
        ),
        _ => Ok(()),
    }
}

/// Warns when a GPU backend runs on a software adapter.
fn warn_if_software(backend: Backend, device: &burn::tensor::Device) {
    if let Some(adapter) = backend.software_adapter(device) {
        let flex = match Backend::compiled().contains(&Backend::Flex) {
            true => "--backend flex",
            false => "a build with the flex feature (the default)",
        };
        eprintln!(
            "warning: {backend} found no GPU and runs on {adapter:?}, a software adapter that \
             emulates one on the CPU: training will be many times slower than with {flex}"
        );
    }
}
