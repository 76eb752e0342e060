//! Training: a new run (every setting checked before its directory is made), or
//! `--resume` of one (the run's own configuration, changed only as
//! [`TrainConfig::resumed`] allows); then how it ended, and its pictures.

use anyhow::Context;
use burn::tensor::Device;

use super::{run_dir, warn_if_software};
use crate::backend::Backend;
use crate::cli::TrainArgs;
use crate::config::TrainConfig;
use crate::precision::{LossScaler, Precision};
use crate::run_dir::{RunDir, RunLock, load_model};
use crate::text::plural;
use crate::training::{self, Status, Summary};
use crate::{interrupt, plots};

/// Where a command on a run starts.
enum Start {
    /// Training, after the checkpoint of this epoch (0: from scratch).
    Train(usize),
    /// Every epoch is trained but the final evaluation did not finish: it alone runs,
    /// completing this summary.
    Evaluate(Box<Summary>),
}

/// Trains a new run or resumes one; `false` when a Ctrl-C stopped it.
pub fn train(args: &TrainArgs, backend: Option<Backend>) -> anyhow::Result<bool> {
    anyhow::ensure!(
        args.log_every >= 1,
        "--log-every must be at least 1 (steps between two progress lines), got 0"
    );
    let backend = Backend::or_best(backend)?;
    // The default directory is the task's: the flag's, else the config file's.
    let task = args.task.or_else(|| {
        let path = args.config.as_ref()?;
        Some(TrainConfig::read(path).ok()?.task.task)
    });
    let run = run_dir(&args.out, task)?;
    let dir = run.0.display();
    let (config, start, devices, _lock) = match args.resume {
        true => prepare_resume(args, &run, backend)?,
        false => prepare_new(args, &run, backend)?,
    };
    let device = devices[0].clone();
    warn_if_software(backend, &device);
    interrupt::install()?;
    let start_epoch = match start {
        Start::Train(epoch) => epoch,
        Start::Evaluate(summary) => {
            return evaluate_trained(&config, &run, *summary, backend, &device);
        }
    };
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
    for warning in config.kind().warnings(&config) {
        eprintln!("warning: {warning}");
    }
    let start = match start_epoch {
        0 => "training".to_string(),
        e => format!("resuming after epoch {e}"),
    };
    let model = format!(
        "model {} (d_model {}, {}, {}, {} positions{})",
        config.model.kind.name(),
        config.model.d_model,
        plural(config.model.n_layers, "layer"),
        plural(config.model.n_heads, "head"),
        config.model.positions.name(),
        config.kind().model_note()
    );
    println!(
        "{start} on {backend}: {}, in {dir}",
        config.kind().describe(&config, &model)
    );
    match config.dtype {
        Precision::F32 => {}
        Precision::F16 => println!(
            "computing in f16 with f32 weights, the loss scaled (from {}) against underflow",
            LossScaler::INITIAL
        ),
        Precision::Bf16 => println!("computing in bf16 with f32 weights"),
    }
    if devices.len() > 1 {
        println!("{}", devices_line(backend, &devices, config.batch_size));
    }
    training::write_summary(&run, &Summary::running(&config, &run, backend, start_epoch))?;
    let summary = training::train(
        &config,
        &run,
        start_epoch,
        &devices,
        backend,
        args.log_every,
    )?;
    training::write_summary(&run, &summary)?;
    report(&config, &run, &summary, &device)?;
    Ok(summary.status == Status::Finished)
}

/// Checks every setting of a new run, then locks and makes its directory and writes its
/// configuration.
fn prepare_new(
    args: &TrainArgs,
    run: &RunDir,
    backend: Backend,
) -> anyhow::Result<(TrainConfig, Start, Vec<Device>, RunLock)> {
    let base = match &args.config {
        Some(path) => TrainConfig::read_as(path, args.task)?,
        None => TrainConfig::defaults(args.task.unwrap_or(TrainConfig::default().task.task)),
    };
    let mut config = args.apply(base);
    // The text kept by its whole path (checked as the others: UTF-8, for config.json): a
    // run resumed from another directory reads it.
    if let Some(data) = &config.task.data {
        let whole = std::path::absolute(data)
            .with_context(|| format!("--data {:?}: no such file", data.display()))?;
        config.task.data = Some(whole);
    }
    config.validate()?;
    config.kind().prepare(&mut config)?;
    crate::memory::training(&config).check(backend)?;
    let devices = backend.devices(&config.devices)?;
    config.dtype.check(backend, &devices)?;
    let lock = run.lock()?;
    run.prepare_new(args.overwrite)?;
    run.write_config(&config)?;
    Ok((config, Start::Train(0), devices, lock))
}

/// Locks the run in `run` and checks it and what the flags change of it (its metric logs,
/// the newest usable checkpoint), then records the change and removes what later epochs
/// left.
fn prepare_resume(
    args: &TrainArgs,
    run: &RunDir,
    backend: Backend,
) -> anyhow::Result<(TrainConfig, Start, Vec<Device>, RunLock)> {
    let dir = run.0.display();
    let stored = match run.stored() {
        None => {
            anyhow::bail!("{dir}: no run to resume (no config.json); start one without --resume")
        }
        Some(Err(err)) => anyhow::bail!(
            "{dir} is not a run: its config.json is not a run's configuration ({err:#})"
        ),
        Some(Ok(_)) => TrainConfig::load(&run.config())?,
    };
    let lock = run.lock()?;
    run.check_writable()?;
    run.check_learner_reads()?;
    // `--resume` changes nothing that decides the loss: the run would diverge again.
    anyhow::ensure!(
        !run.diverged(),
        "{dir}: the run diverged (its loss became NaN or infinite; summary: {}), and \
         --resume would train it again with the same settings: start a new run with a \
         lower --lr or weight_decay (--overwrite replaces this one)",
        run.summary().display()
    );
    let device = backend.device()?;
    let complete = run.last_complete_epoch();
    let done = run.newest_usable_checkpoint(&stored, &device)?.unwrap_or(0);
    // A finished model is replaced only by training past it, never by training it again.
    // (Without the summary's record of its epochs: at least one.)
    let recorded = run.model_epochs(&stored);
    if run.model().exists() && done < recorded.unwrap_or(1) {
        let why = match complete {
            None => "its checkpoints are gone".to_string(),
            Some(_) if done == 0 => "none of its checkpoints can be used".to_string(),
            Some(_) => format!("its newest usable checkpoint is epoch {done}"),
        };
        anyhow::bail!(
            "{dir}: the run finished{} (model.bpk), but {why}: --resume would train again \
             from epoch {done} and replace the finished model; keep it and start a new run \
             with another --out, or replace it with --overwrite",
            recorded.map_or(String::new(), |n| format!(" {}", plural(n, "epoch")))
        );
    }
    if complete.is_some_and(|epoch| epoch > done) {
        // Training again from the start would remove every checkpoint (which another
        // build might read): the user decides.
        anyhow::ensure!(
            done > 0,
            "{dir}: none of its checkpoints can be used (the warnings above say why): \
             --resume would train again from the start and remove them; start over with \
             --overwrite, or move them elsewhere first"
        );
        eprintln!(
            "warning: resuming from the checkpoint of epoch {done}, the newest that can be used"
        );
    }
    let mut config = stored.resumed(args.apply(stored.clone()), done)?;
    let devices = backend.devices(&config.devices)?;
    config.kind().prepare(&mut config)?;
    // On the devices it trains on (`device` is the backend's default).
    config.dtype.check(backend, &devices).map_err(|err| {
        let others: Vec<&str> = Backend::compiled()
            .into_iter()
            .filter(|b| *b != backend)
            .filter(|b| {
                b.device()
                    .is_ok_and(|d| d.supports_dtype(config.dtype.dtype()))
            })
            .map(Backend::name)
            .collect();
        match others.is_empty() {
            true => err.context(format!(
                "{dir}: the run computes in {}",
                config.dtype.name()
            )),
            false => anyhow::anyhow!(
                "{err}; the run computes in {}: resume it with --backend {}",
                config.dtype.name(),
                others.join(" or --backend ")
            ),
        }
    })?;
    run.check_metric_logs(done)?;
    if done == config.epochs {
        let summary = training::trained_summary(&config, run, backend);
        // A finished run is evaluated again when asked to on other examples.
        let again = config.eval_examples != stored.eval_examples;
        anyhow::ensure!(
            summary.status != Status::Finished || again,
            "{dir}: the run already finished its {}; extend it with --resume --epochs N (N \
             above {}), or evaluate it again with --resume --eval-examples N (N other than {})",
            plural(config.epochs, "epoch"),
            config.epochs,
            config.eval_examples
        );
        // Running until the new evaluation is written, as a run in training is, before
        // config.json takes the new count: a kill meanwhile leaves a summary that agrees
        // with it (its training figures kept), and a run that `--resume` evaluates again.
        let mut running = Summary {
            status: Status::Running,
            eval_examples: config.eval_examples,
            ..summary.clone()
        };
        running.clear_evaluation();
        training::write_summary(run, &running)?;
        if config != stored {
            run.write_config(&config)?;
        }
        return Ok((config, Start::Evaluate(Box::new(summary)), devices, lock));
    }
    // On this machine, which may not be the one the run started on; before anything of
    // the run is removed.
    crate::memory::training(&config).check(backend)?;
    run.forget_after(done)?;
    if config != stored {
        run.write_config(&config)?;
    }
    Ok((config, Start::Train(done), devices, lock))
}

/// `on 2 devices of wgpu (NVIDIA H100, NVIDIA H100), 32 sequences each per step; ...`.
fn devices_line(backend: Backend, devices: &[Device], batch: usize) -> String {
    let n = devices.len();
    let on = match backend.is_gpu() {
        true => {
            let names: Vec<String> = devices.iter().map(crate::backend::device_name).collect();
            format!("on {n} devices of {backend} ({})", names.join(", "))
        }
        false => format!("on {n} workers sharing {backend}'s one device (the CPU)"),
    };
    let after = match backend.is_gpu() {
        true => " on the first",
        false => ": the steps of one device, not faster",
    };
    format!(
        "{on}, {} each per step; Burn sums their gradients (of the loss / {n}){after}",
        plural(batch / n, "sequence")
    )
}

/// Finishes the final evaluation of a run whose epochs are all trained (a Ctrl-C or a
/// kill stopped the evaluation), without training: its model, its summary and its
/// pictures.
fn evaluate_trained(
    config: &TrainConfig,
    run: &RunDir,
    mut summary: Summary,
    backend: Backend,
    device: &Device,
) -> anyhow::Result<bool> {
    match summary.status {
        Status::Finished => println!(
            "evaluating the finished run in {} again, on {} held-out sequences",
            run.0.display(),
            config.eval_examples
        ),
        _ => println!(
            "finishing the evaluation of the run in {}: its {} epochs are trained",
            run.0.display(),
            config.epochs
        ),
    }
    // `model.bpk` is this run's unless the run was extended and stopped between its last
    // checkpoint and installing its model: it then holds the shorter run's.
    let current = summary
        .model_epochs
        .is_none_or(|epochs| epochs == config.epochs);
    let installed = current.then(|| load_model(config, &run.model(), device));
    let model = match installed {
        Some(Ok(model)) => model,
        other => {
            match (other, summary.model_epochs) {
                (Some(Err(e)), _) if run.model().exists() => {
                    eprintln!("warning: {e:#}; evaluating the checkpoint of the last epoch")
                }
                (None, Some(epochs)) => println!(
                    "model.bpk holds the model of {} before the run was extended: \
                     installing the checkpoint of epoch {}",
                    plural(epochs, "epoch"),
                    config.epochs
                ),
                _ => {}
            }
            let model = load_model(config, &run.checkpoint(config.epochs), device)?;
            training::save_model(&model, run)?;
            summary.model_epochs = Some(config.epochs);
            model
        }
    };
    config
        .kind()
        .finish(&model, config, run, backend, device, &mut summary);
    training::write_summary(run, &summary)?;
    report(config, run, &summary, device)?;
    Ok(summary.status == Status::Finished)
}

/// Prints how the run ended and where its files are; draws the pictures of a finished run.
fn report(
    config: &TrainConfig,
    run: &RunDir,
    summary: &Summary,
    device: &Device,
) -> anyhow::Result<()> {
    let dir = run.0.display();
    if summary.status == Status::Diverged {
        let from = match summary.last_checkpoint_epoch {
            Some(epoch) => format!("the newest checkpoint with finite weights is epoch {epoch}"),
            None => "no checkpoint has finite weights".into(),
        };
        anyhow::bail!(
            "the training loss became NaN or infinite at step {} of {}: training stopped \
             ({from}; summary: {}); the settings diverge, so start a new run with a lower --lr \
             or weight_decay",
            summary.diverged_at_step.unwrap_or(summary.steps_done),
            summary.steps_total,
            run.summary().display()
        );
    }
    if summary.status == Status::Interrupted {
        let resume = match summary.last_checkpoint_epoch {
            Some(epoch) if epoch == config.epochs => {
                "every epoch is trained, and --resume finishes the evaluation".into()
            }
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
    for line in config.kind().result_lines(config, run, summary) {
        println!("{line}");
    }
    if let (Some([min, max]), Some(exact)) = (summary.longer_lengths, summary.longer_exact_accuracy)
    {
        println!(
            "longer inputs ({min}..={max}, never trained on): exact accuracy {:.2}% (token \
             accuracy {:.2}%)",
            100.0 * exact,
            100.0 * summary.longer_token_accuracy.unwrap_or(0.0),
        );
    }
    if let Some(scale) = summary.loss_scale {
        println!(
            "f16 loss scale {} at the end; {} skipped (scaled gradients not finite)",
            scale.final_scale,
            plural(scale.skipped_steps, "step")
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
