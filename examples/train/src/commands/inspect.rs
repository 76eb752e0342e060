//! `inspect`: what a finished run's heads learned, and pruning them (the work is in
//! [`crate::inspect`]; this prints it and where its files are).

use super::{run_dir, warn_if_software};
use crate::backend::Backend;
use crate::cli::InspectArgs;
use crate::config::TrainConfig;

/// Reports on the heads of a finished run's model, and prunes it if asked.
pub fn inspect(args: &InspectArgs, backend: Option<Backend>) -> anyhow::Result<()> {
    let run = run_dir(&args.out, args.task);
    let dir = run.0.display();
    anyhow::ensure!(
        run.holds_run() && run.model().exists(),
        "{dir}: no finished run here (no config.json and model.bpk); train one, or name its \
         directory with --out"
    );
    let config = TrainConfig::load(&run.config())?;
    let backend = Backend::or_best(backend)?;
    let device = backend.device()?;
    warn_if_software(backend, &device);
    let fixed = config.fixed_shape(backend);
    let findings = crate::inspect::inspect(
        &config,
        &run,
        &run.model(),
        args.examples,
        &args.prune,
        args.by,
        &device,
        fixed,
    )?;
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
