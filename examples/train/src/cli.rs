//! The command line, parsed by clap: train a new run, continue one (`--resume`), answer
//! an input with a trained run's model (`generate`), or look inside it (`inspect`). The
//! defaults `--help` shows are read from the configuration types, the one place they are
//! set. Flags may come before a subcommand or after it (`--out DIR generate`, `generate
//! --out DIR`); a flag of training before `generate` or `inspect` is refused. What each
//! command does is in [`commands`](crate::commands).

// The doc comments below are clap's help text, where `<task>` is a placeholder, not HTML.
#![allow(rustdoc::invalid_html_tags)]

use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::backend::Backend;
use crate::config::TrainConfig;
use crate::fields::FIELDS;
use crate::model::{ModelKind, PositionKind};
use crate::precision::Precision;
use crate::progress::LOG_EVERY;
use crate::tasks::Task;
use crate::text::echo;

/// Train a transformer built from mha modules on a synthetic sequence task or on text.
#[derive(Parser, Debug)]
#[command(version, about, allow_negative_numbers = true)]
pub struct Cli {
    // What to do: a subcommand, or without one, train.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Backend, among those compiled in.
    #[arg(long, value_enum, global = true)]
    pub backend: Option<Backend>,
    // The flags of training.
    #[command(flatten)]
    pub train: TrainArgs,
}

/// The commands besides training.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Answer one input with a trained run's model (greedy decoding); continue a prompt
    /// with a text run's model (sampling).
    Generate(GenerateArgs),
    /// What a trained run's heads learned: their statistics on held-out examples, their
    /// importance, a map of every attention layer, and with --prune, smaller models
    /// without the least important heads (all written to <run>/inspect/).
    Inspect(InspectArgs),
}

/// The flags of `inspect`.
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// The run directory [default: runs/<task>].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The task whose default run directory to read, when --out is not given.
    #[arg(long, value_enum)]
    pub task: Option<Task>,
    /// Held-out examples the statistics and the importance are measured on, at most the
    /// held-out split's distinct inputs [default: 256, or all of them if fewer].
    #[arg(long)]
    pub examples: Option<usize>,
    /// Remove the K least important heads (at least one left per layer), write the
    /// pruned model, and measure its held-out accuracy and speed against the full
    /// model's; several K separated by commas.
    #[arg(long, value_name = "K", value_delimiter = ',')]
    pub prune: Vec<usize>,
    /// Which importance --prune follows: the loss increase when the head is masked, or
    /// the head mask's gradient (Michel et al.), a first-order estimate of it.
    #[arg(long, value_enum, default_value = "ablation")]
    pub by: crate::inspect::By,
}

/// The flags of `generate`.
#[derive(clap::Args, Debug)]
#[command(allow_negative_numbers = true)]
pub struct GenerateArgs {
    /// The run directory [default: runs/<task>].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The task whose default run directory to read, when --out is not given.
    #[arg(long, value_enum)]
    pub task: Option<Task>,
    /// The input in the run's grammar: symbols separated by spaces ("3 1 4 1 5"), or for
    /// add two operands of as many digits ("123+456"); for a text run, the prompt.
    pub input: Option<String>,
    /// Text runs: the text the model continues [default: a newline].
    #[arg(long, conflicts_with = "input")]
    pub prompt: Option<String>,
    /// Text runs: characters to write after the prompt [default: 500].
    #[arg(long)]
    pub tokens: Option<usize>,
    /// Text runs: the logits are divided by it before the softmax; 0 is greedy (the most
    /// likely character every time) [default: 0.8].
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Text runs: draw among the K most likely characters only, and any tied with the K-th
    /// (as nanoGPT and transformers keep them) [default: all].
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Text runs: the seed of the draws (the same seed, the same text) [default: 1].
    #[arg(long)]
    pub seed: Option<u64>,
}

impl GenerateArgs {
    /// Characters written after the prompt.
    pub const TOKENS: usize = 500;
    /// The sampling temperature.
    pub const TEMPERATURE: f64 = 0.8;
    /// The seed of the draws.
    pub const SEED: u64 = 1;

    /// The flags given that only text runs take, as typed (`--top-k 0`).
    pub fn text_flags(&self) -> Vec<String> {
        [
            self.prompt
                .as_ref()
                .map(|p| format!("--prompt {}", echo(p))),
            self.tokens.map(|n| format!("--tokens {n}")),
            self.temperature.map(|t| format!("--temperature {t}")),
            self.top_k.map(|k| format!("--top-k {k}")),
            self.seed.map(|s| format!("--seed {s}")),
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}

/// The flags of a training run. Each setting overrides `--config`'s value (or the
/// default); with `--resume`, only --epochs, --eval-examples and --fixed-shapes may
/// differ from the run's.
#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    /// A config.json to start from: any subset of its fields; flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The run directory [default: runs/<task>].
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Continue the run in --out from its last complete checkpoint, with its own
    /// configuration. --epochs may extend it (the extra epochs train at the schedule's floor,
    /// lr/100 for the synthetic tasks, lr/10 for text) or shorten
    /// it (its decay then ends with it); --eval-examples and --fixed-shapes may change too
    /// (a finished run given another --eval-examples is evaluated again).
    #[arg(long, conflicts_with_all = ["config", "overwrite"])]
    pub resume: bool,
    /// Start the new run in --out even if it holds a run, whose files (those the trainer
    /// wrote; yours stay) are deleted. A folder that holds no run is never touched.
    #[arg(long)]
    pub overwrite: bool,
    /// Steps between two progress lines.
    #[arg(long, default_value_t = LOG_EVERY)]
    pub log_every: usize,
    /// Task: a synthetic one, or text (language modelling, with its own defaults:
    /// nanoGPT's character-level Shakespeare recipe, 4 layers of width 128, block 64,
    /// batch 12, 2000 steps).
    #[arg(long, value_enum)]
    pub task: Option<Task>,
    /// Shortest input (digits per operand for add).
    #[arg(long)]
    pub min_len: Option<usize>,
    /// Longest input (digits per operand for add).
    #[arg(long)]
    pub max_len: Option<usize>,
    /// Number of symbols (10 for add).
    #[arg(long)]
    pub symbols: Option<usize>,
    /// Text task: characters the model reads at once (its context).
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Text task: a UTF-8 file to train on [default: the Shakespeare corpus in the
    /// repository].
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Model.
    #[arg(long, value_enum)]
    pub model: Option<ModelKind>,
    /// Model width.
    #[arg(long)]
    pub d_model: Option<usize>,
    /// Blocks.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Attention heads.
    #[arg(long)]
    pub heads: Option<usize>,
    /// Dropout.
    #[arg(long)]
    pub dropout: Option<f64>,
    /// How the model knows where tokens are: absolute positions added to the embeddings
    /// (learned, sinusoidal) or positions inside attention (rope, alibi, relative, t5).
    #[arg(long, value_enum)]
    pub positions: Option<PositionKind>,
    /// Sequences per step.
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Peak learning rate.
    #[arg(long)]
    pub lr: Option<f64>,
    /// Warmup steps [default: a tenth of the run, at most 50; text: at most 100].
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Epochs.
    #[arg(long)]
    pub epochs: Option<usize>,
    /// Steps per epoch.
    #[arg(long)]
    pub steps_per_epoch: Option<usize>,
    /// Held-out sequences decoded at the end.
    #[arg(long)]
    pub eval_examples: Option<usize>,
    /// Seed of the data and the initial weights.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Pad every batch to the longest possible example [default: on for wgpu and cuda,
    /// off for the CPU backends].
    #[arg(long)]
    pub fixed_shapes: Option<bool>,
    /// Pack the decoder-only model's training sequences several to a row (attention kept
    /// within each) instead of padding them.
    #[arg(long, num_args = 0..=1, default_missing_value = "true")]
    pub pack: Option<bool>,
    /// The float dtype the steps compute in: f32, or f16 / bf16 with the weights, the
    /// optimizer and the checkpoints kept in f32 (f16 with a dynamic loss scale).
    #[arg(long, value_enum)]
    pub dtype: Option<Precision>,
    /// Devices of the backend to train on, each with its share of every batch (Burn's
    /// multi-device strategy): how many (`2`: the first two the backend lists) or which
    /// (`0,2`); on flex and ndarray, workers sharing the one CPU.
    #[arg(long, value_name = "N")]
    pub devices: Option<crate::backend::Devices>,
}

impl TrainArgs {
    /// `base` with the settings given on the command line.
    pub fn apply(&self, mut c: TrainConfig) -> TrainConfig {
        macro_rules! set {
            ($($flag:ident => $($field:ident).+),* $(,)?) => {
                $(if let Some(v) = self.$flag.clone() { c.$($field).+ = v.into(); })*
            };
        }
        set!(
            task => task.task, min_len => task.min_len, max_len => task.max_len,
            symbols => task.n_symbols, block_size => task.block_size, data => task.data,
            model => model.kind, d_model => model.d_model,
            layers => model.n_layers, heads => model.n_heads, dropout => model.dropout,
            positions => model.positions,
            batch_size => batch_size, lr => lr, warmup => warmup_steps, epochs => epochs,
            steps_per_epoch => steps_per_epoch, eval_examples => eval_examples, seed => seed,
            fixed_shapes => fixed_shapes, pack => pack, dtype => dtype, devices => devices,
        );
        c
    }
}

impl Cli {
    /// Parses the command line, its help showing the defaults of the configuration. Exits
    /// as clap does on a malformed command line (code 2), and with a one-line error (code
    /// 1) on a flag before a subcommand that the subcommand does not take.
    pub fn parse_with_defaults() -> Self {
        Self::parse_with_defaults_from(std::env::args_os())
    }

    /// [`parse_with_defaults`](Self::parse_with_defaults) of `args` (the program's name
    /// first): how another program runs the trainer as a command of its own (`bench
    /// train ...`).
    pub fn parse_with_defaults_from<I, T>(args: I) -> Self
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let defaults = serde_json::to_value(TrainConfig::default()).expect("a config serialises");
        let text = serde_json::to_value(TrainConfig::defaults(Task::Text)).expect("serialises");
        let mut command = Cli::command();
        for field in FIELDS {
            let Some(flag) = field.flag else { continue };
            let of = |config| {
                let value = field
                    .path
                    .split('.')
                    .try_fold(config, |v: &serde_json::Value, key| v.get(key))
                    .filter(|v| !v.is_null())?;
                Some(
                    value
                        .as_str()
                        .map(str::to_string)
                        .unwrap_or(value.to_string()),
                )
            };
            let Some(value) = of(&defaults) else { continue };
            // The text task's, where they differ (the task is a field of both).
            let value = match of(&text) {
                Some(text) if text != value && field.path != "task.task" => {
                    format!("{value}; text: {text}")
                }
                _ => value,
            };
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
        let matches = command.get_matches_from(args);
        let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
        cli.with_flags_before_the_subcommand(&matches)
            .unwrap_or_else(|err| {
                eprintln!("error: {err:#}");
                std::process::exit(1)
            })
    }

    /// The command line with the flags typed before a subcommand (which clap gives to
    /// training, the command without one) given to the subcommand: `--out` and `--task`,
    /// which `generate` and `inspect` take too. `--backend` is every command's.
    ///
    /// # Errors
    /// On `--out` or `--task` given both before and after the subcommand with different
    /// values, and on a flag only training takes, naming it and the right order.
    pub fn with_flags_before_the_subcommand(
        mut self,
        matches: &ArgMatches,
    ) -> anyhow::Result<Self> {
        let Some((name, _)) = matches.subcommand() else {
            return Ok(self);
        };
        let (out, task) = match &mut self.command {
            Some(Command::Generate(args)) => (&mut args.out, &mut args.task),
            Some(Command::Inspect(args)) => (&mut args.out, &mut args.task),
            None => return Ok(self),
        };
        let mut command = Cli::command();
        let usage = command
            .find_subcommand_mut(name)
            .map(|c| c.render_usage().to_string())
            .unwrap_or_default();
        let usage = format!("train {}", usage.trim_start_matches("Usage: ").trim());
        let sub = matches
            .subcommand_matches(name)
            .expect("the subcommand's matches");
        for arg in command.get_arguments() {
            let id = arg.get_id().as_str();
            if matches.value_source(id) != Some(ValueSource::CommandLine) || id == "backend" {
                continue;
            }
            let flag = format!("--{}", arg.get_long().unwrap_or(id));
            let takes_values = arg.get_action().takes_values();
            let typed = |m: &ArgMatches| -> Option<String> {
                let values = m.try_get_raw(id).ok()??.filter(|_| takes_values);
                let values: Vec<String> = values.map(|v| echo(&v.to_string_lossy())).collect();
                Some(
                    [flag.clone()]
                        .into_iter()
                        .chain(values)
                        .collect::<Vec<_>>()
                        .join(" "),
                )
            };
            let before = typed(matches).unwrap_or_else(|| flag.clone());
            let clash = || match typed(sub) {
                Some(after) => anyhow::anyhow!(
                    "`{before}` before `{name}` and `{after}` after it differ: give {flag} once"
                ),
                None => anyhow::anyhow!("{flag} differs before and after `{name}`: give it once"),
            };
            match id {
                "out" => moved(out, self.train.out.take()).map_err(|()| clash())?,
                "task" => moved(task, self.train.task.take()).map_err(|()| clash())?,
                _ => anyhow::bail!(
                    "`{before}` is a flag of training, which `{name}` does not take; the flags \
                     of `{name}` come after it: `{usage}`"
                ),
            }
        }
        Ok(self)
    }
}

/// Gives the subcommand's flag (`after`) the value typed before the subcommand; `Err`
/// when it has another.
fn moved<T: PartialEq>(after: &mut Option<T>, before: Option<T>) -> Result<(), ()> {
    match (after.as_ref(), before) {
        (Some(a), Some(b)) if *a != b => Err(()),
        (None, before) => {
            *after = before;
            Ok(())
        }
        _ => Ok(()),
    }
}
