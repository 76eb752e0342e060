//! The command line: train a new run, continue one (`--resume`), answer an input with a
//! trained run's model (`generate`), or look inside it (`inspect`). The defaults `--help` shows are read from the
//! configuration types, the one place they are set.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::backend::Backend;
use crate::config::TrainConfig;
use crate::fields::FIELDS;
use crate::model::{ModelKind, PositionKind};
use crate::progress::LOG_EVERY;
use crate::run_dir::{RunDir, load_model};
use crate::tasks::Task;
use crate::training::{self, Status, Summary};
use crate::{interrupt, plots};

/// Train a transformer built from mha modules on a synthetic sequence task.
#[derive(Parser, Debug)]
#[command(version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Backend, among those compiled in.
    #[arg(long, value_enum, global = true)]
    backend: Option<Backend>,
    #[command(flatten)]
    train: TrainArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Answer one input with a trained run's model (greedy decoding).
    Generate(GenerateArgs),
    /// What a trained run's heads learned: their statistics on held-out examples, their
    /// importance, a map of every attention layer, and with --prune, smaller models
    /// without the least important heads (all written to <run>/inspect/).
    Inspect(InspectArgs),
}

/// The flags of `inspect`.
#[derive(clap::Args, Debug)]
struct InspectArgs {
    /// The run directory [default: runs/<task>].
    #[arg(long)]
    out: Option<PathBuf>,
    /// The task whose default run directory to read, when --out is not given.
    #[arg(long, value_enum)]
    task: Option<Task>,
    /// Held-out examples the statistics and the importance are measured on.
    #[arg(long, default_value_t = 256)]
    examples: usize,
    /// Remove the K least important heads (at least one left per layer), write the
    /// pruned model, and measure its held-out accuracy and speed against the full
    /// model's; several K separated by commas.
    #[arg(long, value_name = "K", value_delimiter = ',')]
    prune: Vec<usize>,
    /// Which importance --prune follows: the loss increase when the head is masked, or
    /// the head mask's gradient (Michel et al.), a first-order estimate of it.
    #[arg(long, value_enum, default_value = "ablation")]
    by: crate::inspect::By,
}

/// The flags of `generate`.
#[derive(clap::Args, Debug)]
struct GenerateArgs {
    /// The run directory [default: runs/<task>].
    #[arg(long)]
    out: Option<PathBuf>,
    /// The task whose default run directory to read, when --out is not given.
    #[arg(long, value_enum)]
    task: Option<Task>,
    /// The input in the run's grammar: symbols separated by spaces ("3 1 4 1 5"), or for
    /// add two operands of as many digits ("123+456").
    input: String,
}

/// The flags of a training run. Each setting overrides `--config`'s value (or the
/// default); with `--resume`, only --epochs, --eval-examples and --fixed-shapes may
/// differ from the run's.
#[derive(clap::Args, Debug)]
struct TrainArgs {
    /// A config.json to start from: any subset of its fields; flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The run directory [default: runs/<task>].
    #[arg(long)]
    out: Option<PathBuf>,
    /// Continue the run in --out from its last complete checkpoint, with its own
    /// configuration. --epochs may extend it (the extra epochs train at lr/100) or shorten
    /// it (its decay then ends with it); --eval-examples and --fixed-shapes may change too.
    #[arg(long, conflicts_with_all = ["config", "overwrite"])]
    resume: bool,
    /// Start the new run in --out even if it holds a run, whose files are deleted.
    #[arg(long)]
    overwrite: bool,
    /// Steps between two progress lines.
    #[arg(long, default_value_t = LOG_EVERY)]
    log_every: usize,
    /// Task.
    #[arg(long, value_enum)]
    task: Option<Task>,
    /// Shortest input (digits per operand for add).
    #[arg(long)]
    min_len: Option<usize>,
    /// Longest input (digits per operand for add).
    #[arg(long)]
    max_len: Option<usize>,
    /// Number of symbols (10 for add).
    #[arg(long)]
    symbols: Option<usize>,
    /// Model.
    #[arg(long, value_enum)]
    model: Option<ModelKind>,
    /// Model width.
    #[arg(long)]
    d_model: Option<usize>,
    /// Blocks.
    #[arg(long)]
    layers: Option<usize>,
    /// Attention heads.
    #[arg(long)]
    heads: Option<usize>,
    /// Dropout.
    #[arg(long)]
    dropout: Option<f64>,
    /// How the model knows where tokens are: absolute positions added to the embeddings
    /// (learned, sinusoidal) or positions inside attention (rope, alibi, relative, t5).
    #[arg(long, value_enum)]
    positions: Option<PositionKind>,
    /// Sequences per step.
    #[arg(long)]
    batch_size: Option<usize>,
    /// Peak learning rate.
    #[arg(long)]
    lr: Option<f64>,
    /// Warmup steps [default: a tenth of the run, at most 50].
    #[arg(long)]
    warmup: Option<usize>,
    /// Epochs.
    #[arg(long)]
    epochs: Option<usize>,
    /// Steps per epoch.
    #[arg(long)]
    steps_per_epoch: Option<usize>,
    /// Held-out sequences decoded at the end.
    #[arg(long)]
    eval_examples: Option<usize>,
    /// Seed of the data and the initial weights.
    #[arg(long)]
    seed: Option<u64>,
    /// Pad every batch to the longest possible example [default: on for wgpu and cuda,
    /// off for the CPU backends].
    #[arg(long)]
    fixed_shapes: Option<bool>,
    /// Pack the decoder-only model's training sequences several to a row (attention kept
    /// within each) instead of padding them.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pack: Option<bool>,
}

impl TrainArgs {
    /// `base` with the settings given on the command line.
    fn apply(&self, mut c: TrainConfig) -> TrainConfig {
        macro_rules! set {
            ($($flag:ident => $($field:ident).+),* $(,)?) => {
                $(if let Some(v) = self.$flag.clone() { c.$($field).+ = v.into(); })*
            };
        }
        set!(
            task => task.task, min_len => task.min_len, max_len => task.max_len,
            symbols => task.n_symbols, model => model.kind, d_model => model.d_model,
            layers => model.n_layers, heads => model.n_heads, dropout => model.dropout,
            positions => model.positions,
            batch_size => batch_size, lr => lr, warmup => warmup_steps, epochs => epochs,
            steps_per_epoch => steps_per_epoch, eval_examples => eval_examples, seed => seed,
            fixed_shapes => fixed_shapes, pack => pack,
        );
        c
    }
}

/// A run's default directory: `runs/<task>`.
fn default_out(task: Option<Task>) -> PathBuf {
    let task = task.unwrap_or(TrainConfig::default().task.task);
    PathBuf::from("runs").join(task.name())
}

impl Cli {
    /// Parses the command line, its help showing the defaults of the configuration.
    pub fn parse_with_defaults() -> Self {
        let defaults = serde_json::to_value(TrainConfig::default()).expect("a config serialises");
        let mut command = Cli::command();
        for field in FIELDS {
            let Some(flag) = field.flag else { continue };
            let value = field
                .path
                .split('.')
                .try_fold(&defaults, |v, key| v.get(key))
                .filter(|v| !v.is_null());
            let Some(value) = value else { continue };
            let value = value
                .as_str()
                .map(str::to_string)
                .unwrap_or(value.to_string());
            let id = flag.trim_start_matches('-').replace('-', "_");
            command = command.mut_arg(id, |arg| {
                let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
                arg.help(format!("{help} [default: {value}]"))
            });
        }
        let best = Backend::compiled()
            .first()
            .map(|b| b.name())
            .unwrap_or("none");
        command = command.mut_arg("backend", |arg| {
            let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
            arg.help(format!("{help} [default: {best}]"))
        });
        let matches = command.get_matches();
        Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
    }

    /// Runs the command: exit code 0 when it did what it was asked, 130 when a Ctrl-C
    /// stopped it, 1 (after a one-line error) otherwise.
    pub fn run(self) -> ExitCode {
        let result = match self.command {
            Some(Command::Generate(args)) => generate(&args, self.backend).map(|()| true),
            Some(Command::Inspect(args)) => inspect(&args, self.backend).map(|()| true),
            None => train(&self.train, self.backend),
        };
        match result {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::from(130),
            Err(err) => {
                eprintln!("error: {err:#}");
                ExitCode::FAILURE
            }
        }
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

/// Trains a new run or resumes one; `false` when a Ctrl-C stopped it.
fn train(args: &TrainArgs, backend: Option<Backend>) -> anyhow::Result<bool> {
    let backend = Backend::or_best(backend)?;
    let run = RunDir(args.out.clone().unwrap_or_else(|| default_out(args.task)));
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
        "{} on {backend}: task {} (lengths {}..={}, {} symbols), model {} (d_model {}, {} \
         layers, {} heads, {} positions), {} epochs of {} steps, in {dir}",
        match start_epoch {
            0 => "training".to_string(),
            e => format!("resuming after epoch {e}"),
        },
        config.task.task.name(),
        config.task.min_len,
        config.task.max_len,
        config.task.n_symbols,
        config.model.kind.name(),
        config.model.d_model,
        config.model.n_layers,
        config.model.n_heads,
        config.model.positions.name(),
        config.epochs,
        config.steps_per_epoch,
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
) -> anyhow::Result<(TrainConfig, usize, burn::tensor::Device)> {
    let base = match &args.config {
        Some(path) => TrainConfig::read(path)?,
        None => TrainConfig::default(),
    };
    let config = args.apply(base);
    config.validate()?;
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
) -> anyhow::Result<(TrainConfig, usize, burn::tensor::Device)> {
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
        "{dir}: the run already finished its {} epochs; extend it with --resume --epochs N \
         (N above {})",
        config.epochs,
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
    device: &burn::tensor::Device,
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
    plots::register_font()?;
    let losses = |split| training::epoch_losses(&run.0, config.epochs, split);
    use burn::train::metric::store::Split;
    let title = format!(
        "{}, {}: loss per step",
        config.task.task.name(),
        config.model.kind.name()
    );
    plots::loss_curve(
        &run.loss_curve(),
        &losses(&Split::Train),
        &losses(&Split::Valid),
        &title,
    )?;
    let heatmaps = plots::attention_heatmaps(config, run, device)?;
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

/// Reports on the heads of a finished run's model, and prunes it if asked.
fn inspect(args: &InspectArgs, backend: Option<Backend>) -> anyhow::Result<()> {
    let run = RunDir(args.out.clone().unwrap_or_else(|| default_out(args.task)));
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

/// Answers one input with the run's model.
fn generate(args: &GenerateArgs, backend: Option<Backend>) -> anyhow::Result<()> {
    let run = RunDir(args.out.clone().unwrap_or_else(|| default_out(args.task)));
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
                .last_complete_epoch()
                .ok_or_else(|| anyhow::anyhow!("{dir}: the run has no model or checkpoint yet"))?;
            eprintln!(
                "warning: the run did not finish; answering with the model of epoch {epoch} of {}",
                config.epochs
            );
            run.checkpoint(epoch)
        }
    };
    let model = load_model(&config, &path, &device)?;
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
