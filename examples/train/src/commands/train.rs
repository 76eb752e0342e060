//! Training: a new run (every setting checked before its directory is made), or
//! `--resume` of one (the run's own configuration, changed only as
//! [`TrainConfig::resumed`] allows); then how it ended, and its pictures.

use burn::tensor::Device;

use super::{run_dir, warn_if_software};
use crate::backend::Backend;
use crate::cli::TrainArgs;
use crate::config::TrainConfig;
use crate::run_dir::RunDir;
use crate::text::plural;
use crate::training::{self, Status, Summary};
use crate::{interrupt, plots};

/// Trains a new run or resumes one; `false` when a Ctrl-C stopped it.
pub fn train(args: &TrainArgs, backend: Option<Backend>) -> anyhow::Result<bool> {
    let backend = Backend::or_best(backend)?;
    let run = run_dir(&args.out, args.task)?;
    let dir = run.0.display();
    let (config, start_epoch, device) = match args.resume {
        true => prepare_resume(args, &run, backend)?,
        false => prepare_new(args, &run, backend)?,
    };
    warn_if_software(backend, &device);
    if let Some(width) = config.pack_width() {
        let [padded, packed] =
            crate::batch::padding_shares(&config.task, config.seed, config.batch_size, width, 20);
        println!(
            "packing {} sequences per step into rows of {width} tokens: {:.0}% of the positions \
             are padding, against {:.0}% in batches padded to their longest sequence",
            config.batch_size,
            100.0 * packed,
            100.0 * padded
        );
    }
    if let Some([_, valid]) = config.task.split_sizes()
        && valid < 20
    {
        eprintln!(
            "warning: the held-out split has only {valid} distinct inputs; its accuracy says \
             little"
        );
    }
    interrupt::install()?;
    println!(
        "{} on {backend}: task {} (lengths {}..={}, {}), model {} (d_model {}, {}, {}, {} \
         positions), {} of {}, in {dir}",
        match start_epoch {
            0 => "training".to_string(),
            e => format!("resuming after epoch {e}"),
        },
        config.task.task.name(),
        config.task.min_len,
        config.task.max_len,
        plural(config.task.n_symbols, "symbol"),
        config.model.kind.name(),
        config.model.d_model,
        plural(config.model.n_layers, "layer"),
        plural(config.model.n_heads, "head"),
        config.model.positions.name(),
        plural(config.epochs, "epoch"),
        plural(config.steps_per_epoch, "step"),
    );
    let summary = training::train(&config, &run, start_epoch, &device, backend, args.log_every)?;
    training::write_summary(&run, &summary)?;
    report(&config, &run, &summary, &device)?;
    Ok(summary.status == Status::Finished)
}

/// Checks every setting of a new run, then makes its directory and writes its
/// configuration: `(config, 0, device)`.
fn prepare_new(
    args: &TrainArgs,
    run: &RunDir,
    backend: Backend,
) -> anyhow::Result<(TrainConfig, usize, Device)> {
    let base = match &args.config {
        Some(path) => TrainConfig::read(path)?,
        None => TrainConfig::default(),
    };
    let config = args.apply(base);
    config.validate()?;
    crate::memory::training(&config).check(backend)?;
    let device = backend.device()?;
    run.prepare_new(args.overwrite)?;
    run.write_config(&config)?;
    Ok((config, 0, device))
}

/// Checks the run in `run` and what the flags change of it, then records the change:
/// `(config, last complete epoch, device)`.
fn prepare_resume(
    args: &TrainArgs,
    run: &RunDir,
    backend: Backend,
) -> anyhow::Result<(TrainConfig, usize, Device)> {
    let dir = run.0.display();
    anyhow::ensure!(
        run.holds_run(),
        "{dir}: no run to resume (no config.json); start one without --resume"
    );
    let stored = TrainConfig::load(&run.config())?;
    let done = run.last_complete_epoch().unwrap_or(0);
    let config = stored.resumed(args.apply(stored.clone()), done)?;
    anyhow::ensure!(
        done < config.epochs,
        "{dir}: the run already finished its {}; extend it with --resume --epochs N (N \
         above {})",
        plural(config.epochs, "epoch"),
        config.epochs
    );
    let device = backend.device()?;
    if done > 0 {
        run.check_checkpoint(&config, done, &device)?;
    }
    run.forget_after(done)?;
    if config != stored {
        run.write_config(&config)?;
    }
    Ok((config, done, device))
}

/// Prints how the run ended and where its files are; draws the pictures of a finished run.
fn report(
    config: &TrainConfig,
    run: &RunDir,
    summary: &Summary,
    device: &Device,
) -> anyhow::Result<()> {
    let dir = run.0.display();
    if summary.status == Status::Interrupted {
        let resume = match summary.last_checkpoint_epoch {
            Some(epoch) => format!("the last complete checkpoint is epoch {epoch}"),
            None => "no epoch was complete, so it starts over".into(),
        };
        eprintln!(
            "interrupted at step {} of {}: {resume}; continue with --resume --out {dir}",
            summary.steps_done, summary.steps_total
        );
        return Ok(());
    }
    let heatmaps = plots::draw_run(config, run, device)?;
    println!(
        "held-out exact accuracy {:.2}% (token accuracy {:.2}%) on {} sequences; final loss {:.4}; \
         {:.1} s, {:.0} tokens/s on {}",
        100.0 * summary.exact_accuracy.unwrap_or(0.0),
        100.0 * summary.token_accuracy.unwrap_or(0.0),
        summary.eval_examples,
        summary.final_loss.unwrap_or(f64::NAN),
        summary.wall_seconds,
        summary.tokens_per_second,
        summary.backend,
    );
    if let (Some([min, max]), Some(exact)) = (summary.longer_lengths, summary.longer_exact_accuracy)
    {
        println!(
            "longer inputs ({min}..={max}, never trained on): exact accuracy {:.2}% (token \
             accuracy {:.2}%)",
            100.0 * exact,
            100.0 * summary.longer_token_accuracy.unwrap_or(0.0),
        );
    }
    println!("summary: {}", run.summary().display());
    println!(
        "learner summary (model and metrics): {}",
        run.learner_summary().display()
    );
    println!("loss curve: {}", run.loss_curve().display());
    for path in heatmaps {
        println!("attention: {}", path.display());
    }
    Ok(())
}
