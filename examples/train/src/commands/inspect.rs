//! `inspect`: what a finished run's heads learned, and pruning them (the work is in
//! [`crate::inspect`]; this prints it and where its files are).

use super::{run_dir, warn_if_software};
use crate::backend::Backend;
use crate::cli::InspectArgs;
use crate::config::TrainConfig;
use crate::text::plural;

/// Reports on the heads of a finished run's model, and prunes it if asked.
pub fn inspect(args: &InspectArgs, backend: Option<Backend>) -> anyhow::Result<()> {
    let run = run_dir(&args.out, args.task)?;
    let dir = run.0.display();
    anyhow::ensure!(
        run.holds_run(),
        "{dir}: no run here (no config.json); train one, or name its directory with --out"
    );
    let config = TrainConfig::load(&run.config())?;
    super::check_task(&run, args.task, &config)?;
    // Inspection writes inspect/: one command at a time on a run.
    let _lock = run.lock()?;
    if let Some(why) = config.kind().not_inspected() {
        anyhow::bail!("{dir}: {why}");
    }
    if !run.model().exists() && run.diverged() {
        anyhow::bail!(
            "{dir}: the run diverged (its loss became NaN or infinite) and has no model; \
             start a new run with a lower --lr"
        );
    }
    if !run.model().exists() {
        let checkpoint = match run.last_complete_epoch() {
            Some(epoch) => format!(
                "its last complete checkpoint is epoch {epoch} of {}",
                config.epochs
            ),
            None => format!("none of its {} is complete", plural(config.epochs, "epoch")),
        };
        anyhow::bail!(
            "{dir}: the run did not finish (no model.bpk; {checkpoint}): finish it with \
             --resume --out {dir}, then inspect it"
        );
    }
    run.check_writable()?;
    let examples = examples(&config, args.examples)?;
    let backend = Backend::or_best(backend)?;
    crate::memory::inspecting(&config, examples).check(backend)?;
    let device = backend.device()?;
    warn_if_software(backend, &device);
    let fixed = config.fixed_shape(backend);
    // On a CPU backend's pool: the ablations are many small forward passes.
    let findings = mha::on_cpu_workers(&device, || {
        crate::inspect::inspect(
            &config,
            &run,
            &run.model(),
            examples,
            &args.prune,
            args.by,
            &device,
            fixed,
        )
    })?;
    crate::inspect::print(&findings);
    println!();
    println!(
        "findings: {}",
        run.0.join("inspect").join("heads.json").display()
    );
    println!(
        "attention maps: {}",
        run.0.join("inspect").join("attention-*.png|svg").display()
    );
    Ok(())
}

/// Held-out examples by default, or fewer when the held-out split has fewer.
const EXAMPLES: usize = 256;

/// The held-out examples to inspect: `--examples`, or [`EXAMPLES`], at most the held-out
/// split's distinct inputs (when the task has few enough to count them).
///
/// # Errors
/// On an `--examples` of 0, or above the held-out split's distinct inputs.
fn examples(config: &TrainConfig, asked: Option<usize>) -> anyhow::Result<usize> {
    let held_out = config.task.split_sizes().map(|[_, valid]| valid as usize);
    let Some(examples) = asked else {
        return Ok(held_out.map_or(EXAMPLES, |h| h.min(EXAMPLES)));
    };
    anyhow::ensure!(examples >= 1, "--examples must be at least 1, got 0");
    if let Some(held_out) = held_out {
        anyhow::ensure!(
            examples <= held_out,
            "--examples {examples}: the run's held-out split has only {}; ask for at most \
             {held_out}",
            plural(held_out, "distinct input")
        );
    }
    Ok(examples)
}
