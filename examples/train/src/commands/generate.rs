//! `generate`: one input, parsed in the task's grammar, answered by greedy decoding with
//! the run's model (or, while the run is unfinished, its last checkpoint's); for a text
//! run, a prompt continued by sampling, each character written as it comes.

use std::io::Write;

use burn::tensor::Device;

use super::{run_dir, warn_if_software};
use crate::backend::Backend;
use crate::cli::GenerateArgs;
use crate::config::TrainConfig;
use crate::corpus::Corpus;
use crate::kind::Decoding;
use crate::lm::Sampler;
use crate::model::Model;
use crate::model::text::TextDecoder;
use crate::precision::compute_copy;
use crate::run_dir::{RunDir, load_model};

/// Answers one input with the run's model.
pub fn generate(args: &GenerateArgs, backend: Option<Backend>) -> anyhow::Result<()> {
    let run = run_dir(&args.out, args.task)?;
    let dir = run.0.display();
    anyhow::ensure!(
        run.holds_run(),
        "{dir}: no run here (no config.json); train one, or name its directory with --out"
    );
    let config = TrainConfig::load(&run.config())?;
    super::check_task(&run, args.task, &config)?;
    if config.kind().decoding() == Decoding::Sampling {
        return sample(args, backend, &run, &config);
    }
    let text_flags = args.text_flags();
    anyhow::ensure!(
        text_flags.is_empty(),
        "{} {} for text runs (sampling); {dir} is a {} run, answered by greedy decoding: \
         give its input as `generate \"...\"`",
        text_flags.join(" "),
        match text_flags.len() {
            1 => "is",
            _ => "are",
        },
        config.task.task.name()
    );
    let input = args.input.as_deref().ok_or_else(|| {
        anyhow::anyhow!(
            "generate: give the input to answer, in the run's grammar (`generate \"3 1 4 1 \
             5\"`)"
        )
    })?;
    // A model whose positions read longer inputs answers those of the run's length test
    // too (as long again as half the longest trained on), with a warning.
    let longer = config.longer_task();
    let reads = longer.as_ref().unwrap_or(&config.task);
    // The grammar alone: the length is checked against what the positions read, below.
    let rules = config.task.task.rules();
    let tokens = rules.parse(&config.task, input)?;
    let len = rules.length_of(&tokens);
    let positions = config.model.positions.name();
    anyhow::ensure!(
        len <= reads.max_len,
        "the input has {}; this run was trained on at most {}{}",
        rules.count(len),
        config.task.max_len,
        match &longer {
            Some(longer) => format!(
                ", and its {positions} positions read up to {}",
                longer.max_len
            ),
            None => String::new(),
        }
    );
    if let Some(warning) = config.task.length_warning(&tokens) {
        eprintln!("warning: {warning}");
    }
    if len > config.task.max_len {
        // The length test is skipped where its lengths have no held-out sequence.
        let tested = match config.length_test() {
            Some(_) => format!(
                ": summary.json has its accuracy on lengths {}..={}",
                reads.min_len, reads.max_len
            ),
            None => ", untested (its length test had no held-out sequence)".into(),
        };
        eprintln!(
            "warning: the input has {}; this run was trained on at most {}, and its {positions} \
             positions read longer inputs{tested}",
            rules.count(len),
            config.task.max_len,
        );
    }
    let backend = Backend::or_best(backend)?;
    let device = backend.device()?;
    warn_if_software(backend, &device);
    let model = load(&run, &config, &device)?;
    let fixed = config
        .fixed_shape(backend)
        .map(|_| crate::batch::FixedShape::of(reads));
    // On a CPU backend's pool: a decoding step is many small operations.
    let output = mha::on_cpu_workers(&device, || {
        model.generate(&[tokens], reads.max_output(), fixed, &device)
    })
    .remove(0);
    match output.is_empty() {
        true => println!("(nothing: the model ended its answer at once)"),
        false => println!("{}", config.task.format_output(&output)),
    }
    Ok(())
}

/// The run's model (or while it is unfinished, its newest usable checkpoint's, with a
/// warning), in the dtype it computed in where the device has it.
fn load(run: &RunDir, config: &TrainConfig, device: &Device) -> anyhow::Result<Model> {
    let dir = run.0.display();
    let path = match run.model().exists() {
        true => run.model(),
        false => {
            let epoch = run
                .newest_usable_checkpoint(config, device)?
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
    let dtype = config.dtype.for_inference(device);
    Ok(compute_copy(&load_model(config, &path, device)?, dtype))
}

/// Continues a prompt with a text run's model: `--tokens` characters, each drawn by the
/// sampler from the logits of the cached decoder and written as it is drawn.
fn sample(
    args: &GenerateArgs,
    backend: Option<Backend>,
    run: &RunDir,
    config: &TrainConfig,
) -> anyhow::Result<()> {
    let vocab: Vec<char> = config.task.vocab.as_deref().unwrap_or("").chars().collect();
    let corpus = Corpus {
        vocab,
        ids: Vec::new(),
        split: 0,
        checksum: String::new(),
    };
    // Without a prompt: a newline where the text has one (a new line of verse), else its
    // first character.
    let default = match corpus.vocab.contains(&'\n') {
        true => "\n".to_string(),
        false => corpus
            .vocab
            .first()
            .map(char::to_string)
            .unwrap_or_default(),
    };
    // Named as the user gave it: `--prompt`, or the text after the flags.
    let (prompt, given_as) = match (args.prompt.as_deref(), args.input.as_deref()) {
        (Some(prompt), _) => (prompt, "--prompt"),
        (None, Some(input)) => (input, "the prompt"),
        (None, None) => (default.as_str(), "the default prompt"),
    };
    anyhow::ensure!(
        !prompt.is_empty(),
        "{given_as} is empty: give the model at least one character to continue"
    );
    let ids: Vec<usize> = corpus
        .encode(prompt)
        .map_err(|e| anyhow::anyhow!("{given_as}: {e}"))?
        .into_iter()
        .map(|id| id as usize)
        .collect();
    let mut sampler = Sampler::new(
        args.temperature.unwrap_or(GenerateArgs::TEMPERATURE),
        args.top_k,
        args.seed.unwrap_or(GenerateArgs::SEED),
    )?;
    let tokens = args.tokens.unwrap_or(GenerateArgs::TOKENS);
    let backend = Backend::or_best(backend)?;
    let device = backend.device()?;
    warn_if_software(backend, &device);
    let model = load(run, config, &device)?;
    // On a CPU backend's pool: a decoding step is many small operations.
    mha::on_cpu_workers(&device, || {
        let mut decoder = TextDecoder::new(&model, config.task.block_size, &device);
        let mut out = std::io::stdout().lock();
        write!(out, "{prompt}")?;
        let mut logits = decoder.feed(&ids);
        for written in 0..tokens {
            let next = sampler.pick(&logits);
            write!(out, "{}", corpus.vocab[next])?;
            out.flush()?;
            if written + 1 < tokens {
                logits = decoder.feed(&[next]);
            }
        }
        writeln!(out)?;
        Ok(())
    })
}
