//! `generate`: one input, parsed in the task's grammar, answered by greedy decoding with
//! the run's model (or, while the run is unfinished, its last checkpoint's).

use super::{run_dir, warn_if_software};
use crate::backend::Backend;
use crate::cli::GenerateArgs;
use crate::config::TrainConfig;
use crate::precision::compute_copy;
use crate::run_dir::load_model;

/// Answers one input with the run's model.
pub fn generate(args: &GenerateArgs, backend: Option<Backend>) -> anyhow::Result<()> {
    let run = run_dir(&args.out, args.task)?;
    let dir = run.0.display();
    anyhow::ensure!(
        run.holds_run(),
        "{dir}: no run here (no config.json); train one, or name its directory with --out"
    );
    let config = TrainConfig::load(&run.config())?;
    let tokens = config.task.parse(&args.input)?;
    if let Some(warning) = config.task.length_warning(&tokens) {
        eprintln!("warning: {warning}");
    }
    let backend = Backend::or_best(backend)?;
    let device = backend.device()?;
    warn_if_software(backend, &device);
    let path = match run.model().exists() {
        true => run.model(),
        false => {
            let epoch = run
                .newest_usable_checkpoint(&config, &device)
                .ok_or_else(|| {
                    anyhow::anyhow!("{dir}: the run has no model or usable checkpoint yet")
                })?;
            eprintln!(
                "warning: the run did not finish; answering with the model of epoch {epoch} of {}",
                config.epochs
            );
            run.checkpoint(epoch)
        }
    };
    // The run's weights are f32 whatever it computed in: a backend without its dtype
    // answers in f32, saying so.
    let dtype = config.dtype.for_inference(&device);
    let model = compute_copy(&load_model(&config, &path, &device)?, dtype);
    let fixed = config.fixed_shape(backend);
    let output = model
        .generate(&[tokens], config.task.max_output(), fixed, &device)
        .remove(0);
    match output.is_empty() {
        true => println!("(nothing: the model ended its answer at once)"),
        false => println!("{}", config.task.format_output(&output)),
    }
    Ok(())
}
