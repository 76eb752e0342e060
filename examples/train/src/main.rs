//! Trains a small transformer built from `mha` modules on a synthetic sequence task, then
//! decodes the held-out split greedily and draws what it learned.
//!
//! ```sh
//! cargo run --release -p train                      # reverse, decoder-only, on flex
//! cargo run --release -p train --features wgpu      # on the GPU (or lavapipe)
//! cargo run --release -p train -- --task add --model encoder-decoder
//! cargo run --release -p train -- --resume --out runs/reverse
//! cargo run --release -p train -- generate --out runs/reverse "3 1 4 1 5 9 2 6"
//! ```
//!
//! The library (`src/lib.rs`) holds the tasks, models, training and plots; this file is
//! the CLI.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};

use ::train::data::{self, Task, TaskConfig};
use ::train::model::{ModelConfig, ModelKind};
use ::train::plots;
use ::train::training::{self, Backend, RunDir, TrainConfig};

/// mimalloc keeps freed memory for the next allocation; the system allocator (glibc)
/// unmaps tensors of a few MB when they are freed, and every step faults them in again
/// (see the README's benchmarks: `--no-default-features` builds without it).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Train a transformer built from mha modules on a synthetic sequence task.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    /// Backend, among those compiled in [default: wgpu or cuda if compiled in, else flex].
    #[arg(long, value_enum, global = true)]
    backend: Option<Backend>,
    #[command(flatten)]
    train: TrainArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Answer one input with a trained run's model (greedy decoding).
    Generate {
        /// The run directory.
        #[arg(long, default_value = "runs/reverse")]
        out: PathBuf,
        /// The input symbols, e.g. "3 1 4 1 5" (for add: "123+456").
        input: String,
    },
}

/// Training flags; each overrides the value of `--config` (or the default shown).
#[derive(clap::Args, Debug)]
struct TrainArgs {
    /// A config.json to start from.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The run directory: config.json, checkpoints, logs, summary.json and pictures.
    #[arg(long, default_value = "runs/reverse")]
    out: PathBuf,
    /// Continue an interrupted run in --out from its last checkpoint (with its config).
    #[arg(long)]
    resume: bool,
    /// Task [default: reverse].
    #[arg(long, value_enum)]
    task: Option<Task>,
    /// Shortest input [default: 8].
    #[arg(long)]
    min_len: Option<usize>,
    /// Longest input [default: 16].
    #[arg(long)]
    max_len: Option<usize>,
    /// Number of symbols [default: 10].
    #[arg(long)]
    symbols: Option<usize>,
    /// Model [default: decoder-only].
    #[arg(long, value_enum)]
    model: Option<ModelKind>,
    /// Model width [default: 64].
    #[arg(long)]
    d_model: Option<usize>,
    /// Blocks [default: 2].
    #[arg(long)]
    layers: Option<usize>,
    /// Attention heads [default: 4].
    #[arg(long)]
    heads: Option<usize>,
    /// Dropout [default: 0].
    #[arg(long)]
    dropout: Option<f64>,
    /// Sequences per step [default: 64].
    #[arg(long)]
    batch_size: Option<usize>,
    /// Peak learning rate [default: 0.003].
    #[arg(long)]
    lr: Option<f64>,
    /// Warmup steps [default: 50].
    #[arg(long)]
    warmup: Option<usize>,
    /// Epochs [default: 8].
    #[arg(long)]
    epochs: Option<usize>,
    /// Steps per epoch [default: 100].
    #[arg(long)]
    steps_per_epoch: Option<usize>,
    /// Held-out sequences decoded at the end [default: 1000].
    #[arg(long)]
    eval_examples: Option<usize>,
    /// Seed [default: 42].
    #[arg(long)]
    seed: Option<u64>,
    /// Pad every batch to the longest possible example [default: on for wgpu and cuda,
    /// off for the CPU backends].
    #[arg(long)]
    fixed_shapes: Option<bool>,
}

impl TrainArgs {
    /// The configuration: `--config` (or the defaults), then the flags.
    fn config(&self) -> anyhow::Result<TrainConfig> {
        let mut c = match &self.config {
            Some(path) => training::load_config(path)?,
            None => TrainConfig::new(TaskConfig::new(), ModelConfig::new()),
        };
        macro_rules! set {
            ($($flag:ident => $($field:ident).+),* $(,)?) => {
                $(if let Some(v) = self.$flag.clone() { c.$($field).+ = v; })*
            };
        }
        set!(
            task => task.task, min_len => task.min_len, max_len => task.max_len,
            symbols => task.n_symbols, model => model.kind, d_model => model.d_model,
            layers => model.n_layers, heads => model.n_heads, dropout => model.dropout,
            batch_size => batch_size, lr => lr, warmup => warmup_steps, epochs => epochs,
            steps_per_epoch => steps_per_epoch, eval_examples => eval_examples, seed => seed,
        );
        if self.fixed_shapes.is_some() {
            c.fixed_shapes = self.fixed_shapes;
        }
        c.validate()?;
        Ok(c)
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let backend = match cli.backend.or_else(|| Backend::compiled().first().copied()) {
        Some(b) => b,
        None => anyhow::bail!(
            "this build has no backend: build with `--features flex` (or ndarray, wgpu, cuda)"
        ),
    };
    let device = backend.device()?;
    plots::register_font()?;
    match cli.command {
        Some(Command::Generate { out, input }) => generate(&RunDir(out), &input, &device, backend),
        None => train(&cli.train, &device, backend),
    }
}

fn train(args: &TrainArgs, device: &burn::tensor::Device, backend: Backend) -> anyhow::Result<()> {
    let dir = RunDir(args.out.clone());
    let config = if args.resume {
        anyhow::ensure!(
            args.config.is_none(),
            "--resume takes the run's own {}, not --config",
            dir.config().display()
        );
        training::load_config(&dir.config())?
    } else {
        args.config()?
    };
    println!(
        "training: task {:?} (lengths {}..={}, {} symbols), model {:?} (d_model {}, {} layers, {} heads), \
         backend {backend}, run directory {}",
        config.task.task,
        config.task.min_len,
        config.task.max_len,
        config.task.n_symbols,
        config.model.kind,
        config.model.d_model,
        config.model.n_layers,
        config.model.n_heads,
        dir.0.display(),
    );
    let summary = training::train(&config, &dir, args.resume, device, backend)?;

    let summary_path = dir.0.join("summary.json");
    std::fs::write(
        &summary_path,
        serde_json::to_string_pretty(&summary)? + "\n",
    )
    .with_context(|| format!("cannot write {}", summary_path.display()))?;
    let train_losses = training::epoch_losses(
        &dir.0,
        config.epochs,
        &burn::train::metric::store::Split::Train,
    );
    let valid_losses = training::epoch_losses(
        &dir.0,
        config.epochs,
        &burn::train::metric::store::Split::Valid,
    );
    let loss_png = dir.0.join("loss.png");
    let title = format!(
        "{:?}, {:?}: loss per step",
        config.task.task, config.model.kind
    );
    plots::loss_curve(&loss_png, &train_losses, &valid_losses, &title)?;
    let heatmaps = draw_heatmaps(&config, &dir, device)?;

    println!(
        "held-out exact accuracy {:.2}% (token accuracy {:.2}%) on {} sequences; final loss {:.4}; \
         {:.1} s, {:.0} tokens/s on {backend}",
        100.0 * summary.exact_accuracy,
        100.0 * summary.token_accuracy,
        summary.eval_examples,
        summary.final_loss,
        summary.wall_seconds,
        summary.tokens_per_second,
    );
    println!("summary: {}", summary_path.display());
    println!("loss curve: {}", loss_png.display());
    for path in heatmaps {
        println!("attention: {}", path.display());
    }
    Ok(())
}

/// Heatmaps of the first held-out example, one PNG per layer.
fn draw_heatmaps(
    config: &TrainConfig,
    dir: &RunDir,
    device: &burn::tensor::Device,
) -> anyhow::Result<Vec<PathBuf>> {
    let model = training::load_model(config, &dir.model(), device)?;
    let ex = config.task.example(config.seed, data::Split::Valid, 0);
    let (layers, rows, cols) = model.attention_maps(&ex.input, &ex.output, device);
    let label = |ts: &[usize]| {
        ts.iter()
            .map(|&t| config.task.token_label(t))
            .collect::<Vec<_>>()
    };
    let (rows, cols) = (label(&rows), label(&cols));
    let what = match config.model.kind {
        ModelKind::DecoderOnly => "self-attention",
        ModelKind::EncoderDecoder => "decoder cross-attention",
    };
    let mut paths = Vec::new();
    for (i, w) in layers.into_iter().enumerate() {
        let [heads, r, c] = w.dims();
        let values = w
            .into_data()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let grid: Vec<Vec<Vec<f32>>> = (0..heads)
            .map(|h| {
                (0..r)
                    .map(|y| values[(h * r + y) * c..(h * r + y + 1) * c].to_vec())
                    .collect()
            })
            .collect();
        let path = plots::heatmap_path(&dir.0, i);
        let title = format!(
            "layer {i} {what}: {:?} of {}",
            config.task.task,
            cols.concat()
        );
        plots::heatmap(&path, &title, &grid, &rows, &cols)?;
        paths.push(path);
    }
    Ok(paths)
}

fn generate(
    dir: &RunDir,
    input: &str,
    device: &burn::tensor::Device,
    backend: Backend,
) -> anyhow::Result<()> {
    let config = training::load_config(&dir.config())?;
    let path = match dir.model().exists() {
        true => dir.model(),
        false => dir
            .last_checkpoint()
            .map(|e| dir.checkpoint(e))
            .with_context(|| format!("{}: no model or checkpoint", dir.0.display()))?,
    };
    let model = training::load_model(&config, &path, device)?;
    let tokens = config.task.parse(input)?;
    anyhow::ensure!(!tokens.is_empty(), "the input is empty");
    anyhow::ensure!(
        tokens.len() <= config.task.max_input(),
        "the input has {} symbols; the model was trained on at most {}",
        tokens.len(),
        config.task.max_input()
    );
    let output = model
        .generate(
            &[tokens],
            config.task.max_output(),
            config.fixed_shape(backend),
            device,
        )
        .remove(0);
    let text: Vec<String> = output.iter().map(|&t| config.task.token_label(t)).collect();
    println!("{}", text.join(" "));
    Ok(())
}
