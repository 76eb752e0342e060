//! What a trained run's heads learned: the head report on held-out examples, the heads
//! ranked by importance (by the head mask's gradient and by ablation), a map of every
//! attention layer, and pruned models with their held-out accuracy and speed next to the
//! full model's. Everything lands in `<run>/inspect/`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use burn::data::dataloader::batcher::Batcher;
use burn::module::Module;
use burn::tensor::Device;
use mha::analysis::{HeadImportance, HeadReport, Inspect, PrunePlan};
use serde::Serialize;

use crate::batch::SeqBatcher;
use crate::config::TrainConfig;
use crate::model::Model;
use crate::run_dir::{RunDir, install_weights, load_model, remove, verify, write_atomically};
use crate::tasks::{Example, Split};
use crate::text::plural;
use crate::{plots, training};

/// Which importance pruning follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum By {
    /// The loss increase when the head is masked.
    Ablation,
    /// The head mask's gradient, normalised per layer (Michel et al.).
    Gradient,
}

impl By {
    /// Its name, as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            By::Ablation => "ablation",
            By::Gradient => "gradient",
        }
    }
}

/// Held-out examples per batch of the statistics and importance passes, at most.
pub const BATCH: usize = 64;

/// What `inspect` found, as `inspect/heads.json` keeps it.
#[derive(Serialize)]
pub struct Findings {
    /// The statistics of every head.
    pub report: HeadReport,
    /// Importance by the head mask's gradient (Michel et al.), normalised per layer.
    pub gradient: HeadImportance,
    /// Importance by ablation: the loss increase when the head is masked.
    pub ablation: HeadImportance,
    /// The attention layers' names, in the order of the scores.
    pub layers: Vec<String>,
    /// The importance the pruned models follow.
    pub pruned_by: By,
    /// Each `--prune` run.
    pub pruned: Vec<PruneResult>,
}

/// One pruned model against the full one.
#[derive(Clone, Debug, Serialize)]
pub struct PruneResult {
    /// Heads removed.
    pub removed: usize,
    /// Heads left, of how many.
    pub heads: [usize; 2],
    /// The heads removed per attention layer.
    pub plan: PrunePlan,
    /// Held-out exact accuracy of the pruned model (reloaded from its file).
    pub exact_accuracy: f64,
    /// The full model's.
    pub full_exact_accuracy: f64,
    /// Seconds per teacher-forced forward over the held-out batches, best of three:
    /// pruned, full.
    pub forward_seconds: [f64; 2],
    /// Seconds of greedy decoding of the run's evaluation examples, best of three:
    /// pruned, full.
    pub decode_seconds: [f64; 2],
    /// Where the pruned model and its plan are.
    pub dir: PathBuf,
}

/// Inspects the model in `run` on `examples` held-out examples; prunes `prune[i]` heads
/// for each entry of `prune`, the least important `by` one measure. Each phase says on
/// stderr how long it took, and while it takes more than a second, how far it is.
///
/// # Errors
/// On a `--prune` K of 0, or above the heads that can go with one left per layer
/// (before anything is written); when the model cannot be loaded or a file written.
#[allow(clippy::too_many_arguments)]
pub fn inspect(
    config: &TrainConfig,
    run: &RunDir,
    model_path: &Path,
    examples: usize,
    prune: &[usize],
    by: By,
    device: &Device,
    fixed: Option<crate::batch::FixedShape>,
) -> anyhow::Result<Findings> {
    let model = load_model(config, model_path, device)?.valid();
    let counts = model.head_counts();
    check_prune(&counts, prune)?;
    let dir = run.0.join("inspect");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // Drawn after the held-out examples the accuracies are measured on (the first
    // `eval_examples`): other draws rank the heads for pruning than those that score the
    // pruned model (on a small held-out split the same inputs recur among both).
    let first = config.eval_examples;
    let held_out: Vec<Example> = (first..first.saturating_add(examples.max(1)))
        .map(|i| config.task.example(config.seed, Split::Valid, i))
        .collect();
    // Batches of one size (within one example): the importances are means over batches.
    let batches = held_out.len().div_ceil(BATCH);
    let chunks: Vec<Vec<Example>> = (0..batches)
        .map(|b| {
            let at = |b: usize| b * held_out.len() / batches;
            held_out[at(b)..at(b + 1)].to_vec()
        })
        .collect();
    let batcher = SeqBatcher::default();

    let what = plural(held_out.len(), "held-out example");
    // A batch at a time: the weights of every layer, [B, H, T, T], are held for one.
    let mut phase = Phase::new(format!("head statistics on {what}"), chunks.len());
    let mut layers = Vec::new();
    for chunk in &chunks {
        phase.step();
        model.head_stats(batcher.batch(chunk.clone(), device), chunk, &mut layers);
    }
    let report = HeadReport::new(layers.into_iter().map(|l| l.finish()).collect());
    phase.end();
    let heads: usize = counts.iter().sum();
    let mut phase = Phase::new(
        format!("importance by ablation ({heads} heads masked in turn)"),
        chunks.len() * (heads + 1),
    );
    let ablation = HeadImportance::by_ablation(&counts, device, chunks.len(), |mask, i| {
        phase.step();
        let inspect = Inspect::new().head_mask(mask.clone());
        let (out, _) = model.forward_inspect(batcher.batch(chunks[i].clone(), device), &inspect);
        out.loss.into_scalar::<f64>()
    });
    phase.end();
    let autodiff = device.clone().autodiff();
    // Frozen: no parameter gradients, no dropout; the head mask's gradient still flows.
    let tracked = load_model(config, model_path, &autodiff)?.freeze();
    let mut phase = Phase::new("importance by gradient".into(), chunks.len());
    let gradient = HeadImportance::by_gradient(&counts, &autodiff, chunks.len(), |mask, i| {
        phase.step();
        let inspect = Inspect::new().head_mask(mask.clone());
        let batch = batcher.batch(chunks[i].clone(), &autodiff);
        tracked.forward_inspect(batch, &inspect).0.loss
    });
    phase.end();
    let phase = Phase::new("attention maps".into(), 1);
    draw_maps(config, &model, &held_out[0], &dir, device)?;
    phase.end();

    let importance = match by {
        By::Gradient => &gradient,
        By::Ablation => &ablation,
    };
    let mut pruned = Vec::new();
    for &k in prune {
        let phase = Phase::new(format!("pruning {} and measuring", plural(k, "head")), 1);
        pruned.push(prune_and_compare(
            config, &model, model_path, importance, k, &chunks, &dir, device, fixed,
        )?);
        phase.end();
    }
    let findings = Findings {
        report,
        gradient,
        ablation,
        layers: model.attention_layer_names(),
        pruned_by: by,
        pruned,
    };
    let json = serde_json::to_string_pretty(&findings).context("the findings serialise")?;
    write_atomically(&dir.join("heads.json"), json.as_bytes())?;
    Ok(findings)
}

/// Refuses a `--prune` K of 0, or above the heads that can be removed with one left in
/// each attention layer (`counts`: the heads of each).
fn check_prune(counts: &[usize], prune: &[usize]) -> anyhow::Result<()> {
    let heads: usize = counts.iter().sum();
    let most = heads - counts.len();
    for &k in prune {
        anyhow::ensure!(
            k >= 1,
            "--prune 0: K is how many heads to remove; give at least 1"
        );
        anyhow::ensure!(
            k <= most,
            "--prune {k}: at most {most} of the model's {heads} heads can be removed (one is left \
             in each of its {})",
            plural(counts.len(), "attention layer")
        );
    }
    Ok(())
}

/// One phase of `inspect`, on stderr: once it has run a second, how far it is (in place
/// in a terminal, else a line every five seconds), and at its end how long it took.
struct Phase {
    what: String,
    total: usize,
    done: usize,
    started: Instant,
    shown: Option<Instant>,
    interactive: bool,
}

impl Phase {
    /// A phase of `total` steps; in a terminal, its name shows while it runs.
    fn new(what: String, total: usize) -> Self {
        use std::io::IsTerminal;
        let interactive = std::io::stderr().is_terminal();
        if interactive {
            eprint!("\r\x1b[2K{what}…");
        }
        Self {
            what,
            total,
            done: 0,
            started: Instant::now(),
            shown: None,
            interactive,
        }
    }

    /// One of its `total` steps is starting.
    fn step(&mut self) {
        self.done += 1;
        let every = match self.interactive {
            true => Duration::from_millis(100),
            false => Duration::from_secs(5),
        };
        let due = self.shown.map_or(Duration::from_secs(1), |_| every);
        let since = self.shown.unwrap_or(self.started);
        if since.elapsed() < due {
            return;
        }
        let line = format!(
            "{}: {} of {} ({:.0} s)",
            self.what,
            self.done,
            self.total,
            self.started.elapsed().as_secs_f64()
        );
        match self.interactive {
            true => eprint!("\r\x1b[2K{line}"),
            false => eprintln!("{line}"),
        }
        self.shown = Some(Instant::now());
    }

    /// Says how long it took.
    fn end(self) {
        let clear = match self.interactive {
            true => "\r\x1b[2K",
            false => "",
        };
        eprintln!(
            "{clear}{}: {:.1} s",
            self.what,
            self.started.elapsed().as_secs_f64()
        );
    }
}

/// A map of every attention layer on `example`: `inspect/attention-<layer>.png` and
/// `.svg`.
fn draw_maps(
    config: &TrainConfig,
    model: &Model,
    example: &Example,
    dir: &Path,
    device: &Device,
) -> anyhow::Result<Vec<PathBuf>> {
    let layers = model.every_attention_map(example, device);
    plots::attention_maps(&config.task, &example.input, layers, |i| {
        ["png", "svg"]
            .map(|extension| dir.join(format!("attention-{i}.{extension}")))
            .to_vec()
    })
}

/// Removes the `k` least important heads by `importance`, writes the pruned model and its
/// plan to `inspect/pruned-<k>/`, reloads it from there, and measures it against `model`.
#[allow(clippy::too_many_arguments)]
fn prune_and_compare(
    config: &TrainConfig,
    model: &Model,
    model_path: &Path,
    importance: &HeadImportance,
    k: usize,
    chunks: &[Vec<Example>],
    dir: &Path,
    device: &Device,
    fixed: Option<crate::batch::FixedShape>,
) -> anyhow::Result<PruneResult> {
    let plan = importance.prune_least(k);
    let total: usize = model.head_counts().iter().sum();
    let out = dir.join(format!("pruned-{k}"));
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let pruned = model.prune(&plan)?;
    let file = out.join("model.bpk");
    let written = out.join("model.bpk.partial");
    pruned
        .clone()
        .save_file(&written)
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", written.display()))?;
    let json = serde_json::to_string_pretty(&plan).context("a plan serialises")?;
    // The old plan goes first: a crash before the new one is written leaves a model
    // without a plan (which `load_pruned` refuses, saying so), never a model beside the
    // plan of another (whose heads it would name, whose ALiBi slopes it would take).
    let plan_path = out.join("plan.json");
    remove(&plan_path)?;
    install_weights(&written, &file)?;
    write_atomically(&plan_path, json.as_bytes())?;
    let reloaded = load_pruned(config, model_path, &out, device)?;

    let forward = |m: &Model| {
        let batcher = SeqBatcher::default();
        let start = Instant::now();
        for chunk in chunks {
            let (out, _) = m.forward_inspect(batcher.batch(chunk.clone(), device), &Inspect::new());
            out.loss.into_scalar::<f32>();
        }
        start.elapsed().as_secs_f64()
    };
    let decode = |m: &Model| {
        let start = Instant::now();
        let accuracy = training::evaluate(m, config, &config.task, fixed, device);
        (accuracy.map_or(0.0, |a| a.0), start.elapsed().as_secs_f64())
    };
    // Once each to warm up, then timed alternately, best of three (decoding too).
    forward(model);
    forward(&reloaded);
    let (mut f_full, mut f_pruned) = (f64::MAX, f64::MAX);
    for _ in 0..3 {
        f_full = f_full.min(forward(model));
        f_pruned = f_pruned.min(forward(&reloaded));
    }
    let (mut full_accuracy, mut accuracy) = (0.0, 0.0);
    let (mut d_full, mut d_pruned) = (f64::MAX, f64::MAX);
    for _ in 0..3 {
        let (a, t) = decode(model);
        (full_accuracy, d_full) = (a, d_full.min(t));
        let (a, t) = decode(&reloaded);
        (accuracy, d_pruned) = (a, d_pruned.min(t));
    }
    Ok(PruneResult {
        removed: plan.removed(),
        heads: [total - plan.removed(), total],
        plan,
        exact_accuracy: accuracy,
        full_exact_accuracy: full_accuracy,
        forward_seconds: [f_pruned, f_full],
        decode_seconds: [d_pruned, d_full],
        dir: out,
    })
}

/// Loads the pruned model in `dir` (`model.bpk` and `plan.json`): the run's model built
/// from its configuration, pruned by the plan, then the pruned weights loaded into it.
pub fn load_pruned(
    config: &TrainConfig,
    model_path: &Path,
    dir: &Path,
    device: &Device,
) -> anyhow::Result<Model> {
    let plan_path = dir.join("plan.json");
    let plan: PrunePlan =
        serde_json::from_str(&std::fs::read_to_string(&plan_path).with_context(|| {
            format!(
                "cannot read {} (a pruning interrupted before writing its plan leaves its \
                 model without one: run inspect --prune again)",
                plan_path.display()
            )
        })?)
        .with_context(|| format!("{}: not a pruning plan", plan_path.display()))?;
    let file = dir.join("model.bpk");
    verify(&file)?;
    let skeleton = load_model(config, model_path, device)?.prune(&plan)?;
    skeleton
        .try_load_file(&file)
        .map_err(|e| anyhow::anyhow!("{}: cannot load the pruned model ({e})", file.display()))
}

/// Prints the report, the ranking and the pruning results.
pub fn print(findings: &Findings) {
    println!("head statistics on the held-out examples (means over their positions):");
    print!("{}", findings.report);
    println!();
    println!(
        "heads by importance (ablation: the loss increase when the head is masked; gradient: \
         of the loss by the head's mask, normalised per layer), ranked by {}:",
        findings.pruned_by.name()
    );
    let (ablation, gradient) = (&findings.ablation.scores, &findings.gradient.scores);
    let ranking = match findings.pruned_by {
        By::Ablation => findings.ablation.ranking(),
        By::Gradient => findings.gradient.ranking(),
    };
    for (rank, (layer, head, _)) in ranking.into_iter().enumerate() {
        println!(
            "{:>3}. {:<18} head {head}  ablation {:+.4}  gradient {:.3}",
            rank + 1,
            findings.layers[layer],
            ablation[layer][head],
            gradient[layer][head]
        );
    }
    for p in &findings.pruned {
        println!();
        println!(
            "pruned {} of {} heads by {} ({}): held-out exact accuracy {:.2}% (full model {:.2}%); \
             teacher-forced forward {:.1} ms against {:.1} ms ({:.2}x); greedy decoding {:.2} s \
             against {:.2} s ({:.2}x); model in {}",
            p.removed,
            p.heads[1],
            findings.pruned_by.name(),
            describe(&p.plan, &findings.layers),
            100.0 * p.exact_accuracy,
            100.0 * p.full_exact_accuracy,
            1e3 * p.forward_seconds[0],
            1e3 * p.forward_seconds[1],
            p.forward_seconds[1] / p.forward_seconds[0],
            p.decode_seconds[0],
            p.decode_seconds[1],
            p.decode_seconds[1] / p.decode_seconds[0],
            p.dir.display()
        );
    }
}

/// `layer 0: 1, 3; layer 1: 2`.
fn describe(plan: &PrunePlan, layers: &[String]) -> String {
    plan.remove
        .iter()
        .zip(layers)
        .filter(|(heads, _)| !heads.is_empty())
        .map(|(heads, name)| {
            let heads: Vec<String> = heads.iter().map(usize::to_string).collect();
            format!("{name}: {}", heads.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}
