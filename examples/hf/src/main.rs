//! Greedy generation from a Hugging Face model directory on your disk, through `mha`'s
//! modules and decode cache: Llama, Mistral, Qwen2 or Qwen3 (`config.json`, the weights in
//! `model.safetensors` or its shards, `tokenizer.json`).
//!
//! ```sh
//! cargo run --release -p hf -- --model path/to/Qwen2.5-0.5B-Instruct --prompt "The capital of France is"
//! cargo run --release -p hf --features wgpu -- --model DIR --backend wgpu --dtype f16
//! ```
//!
//! The prompt is tokenised as `tokenizer.json` says (its special tokens added, as
//! transformers' tokenizer does by default), read in one call, then each new token is
//! the most likely one (greedy decoding, transformers' `do_sample=False`), fed back one at
//! a time through the cache, until `--tokens` tokens or an end-of-sequence token
//! (`eos_token_id` of `generation_config.json`, else of `config.json`). The text is
//! printed as it grows: what decoding the prompt and the new tokens together adds to the
//! decoded prompt (decoded alone, SentencePiece's first piece would lose its space).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Instant;

use anyhow::{Context, ensure};
use burn::tensor::{Device, FloatDType, Int, Tensor, TensorData};
use mha::ModuleDType;
use mha::hf::{CausalLm, load_pretrained};
use tokenizers::Tokenizer;

/// The backends this build has, the GPU first: `--backend` picks one, else the first.
const BACKENDS: &[&str] = &[
    #[cfg(feature = "wgpu")]
    "wgpu",
    #[cfg(feature = "flex")]
    "flex",
    #[cfg(feature = "ndarray")]
    "ndarray",
];

/// The device of a backend of [`BACKENDS`].
#[allow(deprecated)] // Burn 0.22 deprecates ndarray in favour of flex.
fn device(backend: &str) -> Device {
    match backend {
        #[cfg(feature = "wgpu")]
        "wgpu" => Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
        #[cfg(feature = "flex")]
        "flex" => Device::flex(),
        #[cfg(feature = "ndarray")]
        "ndarray" => Device::ndarray(),
        other => panic!("{other} is not compiled in"),
    }
}

/// Every setting; `--flag value` on the command line.
#[derive(Clone, Debug)]
struct Settings {
    model: PathBuf,
    prompt: String,
    tokens: usize,
    backend: String,
    dtype: String,
    /// Print the prompt's and the generated token ids too.
    ids: bool,
}

impl Settings {
    fn parse(mut args: Vec<String>) -> anyhow::Result<Self> {
        let first = BACKENDS.first().context("no backend compiled in")?;
        let ids = match args.iter().position(|a| a == "--ids") {
            Some(at) => {
                args.remove(at);
                true
            }
            None => false,
        };
        let a = &mut args;
        let s = Settings {
            model: flag(a, "--model", PathBuf::new())?,
            prompt: flag(a, "--prompt", "Once upon a time".to_string())?,
            tokens: flag(a, "--tokens", 64)?,
            backend: flag(a, "--backend", first.to_string())?,
            dtype: flag(a, "--dtype", "f32".to_string())?,
            ids,
        };
        let readme = "the flags are in examples/hf/README.md";
        ensure!(
            args.is_empty(),
            "unknown or repeated flag {}; {readme}",
            args[0]
        );
        ensure!(
            !s.model.as_os_str().is_empty(),
            "--model DIR is needed: a Hugging Face model directory ({readme})"
        );
        let (backends, b) = (BACKENDS.join(", "), &&*s.backend);
        ensure!(
            BACKENDS.contains(b),
            "--backend {b}: this build has {backends}"
        );
        ensure!(s.tokens > 0, "--tokens: at least 1");
        Ok(s)
    }

    /// The dtype the model computes in.
    fn float_dtype(&self) -> anyhow::Result<FloatDType> {
        Ok(match self.dtype.as_str() {
            "f32" => FloatDType::F32,
            "f16" => FloatDType::F16,
            "bf16" => FloatDType::BF16,
            other => anyhow::bail!("--dtype {other}: f32, f16 or bf16"),
        })
    }
}

/// The value after `name` in `args`, taken out of them, or `default` if they have none.
fn flag<T: FromStr>(args: &mut Vec<String>, name: &str, default: T) -> anyhow::Result<T> {
    let Some(at) = args.iter().position(|a| a == name) else {
        return Ok(default);
    };
    ensure!(at + 1 < args.len(), "{name} needs a value");
    let value = args.drain(at..at + 2).nth(1).unwrap_or_default();
    let parsed = value.parse().ok();
    parsed.with_context(|| format!("{name} {value}: not valid"))
}

/// The end-of-sequence tokens: `eos_token_id` (one id or a list) of `generation_config.json`
/// where the directory has one, else of `config.json`.
fn end_tokens(dir: &Path) -> anyhow::Result<Vec<u32>> {
    for name in ["generation_config.json", "config.json"] {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        let ids: Vec<u64> = match &json["eos_token_id"] {
            serde_json::Value::Number(n) => n.as_u64().into_iter().collect(),
            serde_json::Value::Array(list) => list.iter().filter_map(|v| v.as_u64()).collect(),
            _ => continue,
        };
        return Ok(ids.into_iter().map(|id| id as u32).collect());
    }
    Ok(Vec::new())
}

/// The most likely next token after the last position of `logits` `[1, T, vocab]`.
fn greedy(logits: Tensor<3>) -> anyhow::Result<u32> {
    let [_, positions, vocab] = logits.dims();
    let last = logits.slice([0..1, positions - 1..positions, 0..vocab]);
    let best = last.argmax(2).into_data();
    let best = best.convert::<i64>().try_to_vec::<i64>().ok();
    let id = best.and_then(|v| v.first().copied()).context("no logits")?;
    Ok(id as u32)
}

/// `ids` as a `[1, T]` batch on `device`.
fn batch(ids: &[u32], device: &Device) -> Tensor<2, Int> {
    let ids: Vec<i64> = ids.iter().map(|&id| id as i64).collect();
    let len = ids.len();
    Tensor::from_data(TensorData::new(ids, [1, len]), device)
}

/// Generates up to `tokens` tokens after `prompt` greedily, calling `each` with the ids so
/// far after every one; returns the generated ids.
fn generate(
    lm: &CausalLm,
    prompt: &[u32],
    tokens: usize,
    end: &[u32],
    device: &Device,
    mut each: impl FnMut(&[u32]),
) -> anyhow::Result<Vec<u32>> {
    let mut cache = lm.cache(prompt.len() + tokens);
    let mut logits = lm.forward_cached(batch(prompt, device), &mut cache)?;
    let mut generated = Vec::with_capacity(tokens);
    loop {
        let next = greedy(logits)?;
        generated.push(next);
        each(&generated);
        if generated.len() == tokens || end.contains(&next) {
            return Ok(generated);
        }
        logits = lm.forward_cached(batch(&[next], device), &mut cache)?;
    }
}

/// The command's arguments as text; one that is not UTF-8 is refused, naming the flag
/// before it (`std::env::args` panics on it).
fn arguments() -> anyhow::Result<Vec<String>> {
    let mut args: Vec<String> = Vec::new();
    for arg in std::env::args_os().skip(1) {
        match arg.into_string() {
            Ok(arg) => args.push(arg),
            Err(arg) => {
                let flag = args.last().filter(|a| a.starts_with("--"));
                anyhow::bail!(
                    "{}: {arg:?} is not UTF-8 text",
                    flag.map_or("an argument", |f| f.as_str())
                )
            }
        }
    }
    Ok(args)
}

fn main() -> anyhow::Result<()> {
    let s = Settings::parse(arguments()?)?;
    let dtype = s.float_dtype()?;
    let device = device(&s.backend);
    let dir = &s.model;
    let tokenizer_path = dir.join("tokenizer.json");
    let tokenizer = Tokenizer::from_file(&tokenizer_path)
        .map_err(|err| anyhow::anyhow!("{}: {err}", tokenizer_path.display()))?;
    let end = end_tokens(dir)?;

    let start = Instant::now();
    let (config, lm) = load_pretrained(dir, &device)?;
    let lm = match dtype {
        FloatDType::F32 => lm,
        other => lm
            .try_to_dtype(other)
            .with_context(|| format!("--dtype {}", s.dtype))?,
    };
    eprintln!(
        "{} ({} layers, width {}, vocabulary {}) loaded on {} in {:.2} s, in {}",
        config.model_type,
        config.num_hidden_layers,
        config.hidden_size,
        config.vocab_size,
        s.backend,
        start.elapsed().as_secs_f64(),
        s.dtype
    );

    let encoding = tokenizer
        .encode(s.prompt.as_str(), true)
        .map_err(|err| anyhow::anyhow!("tokenizing the prompt: {err}"))?;
    let prompt = encoding.get_ids().to_vec();
    ensure!(!prompt.is_empty(), "the prompt has no token");
    let context = config.max_position_embeddings.unwrap_or(usize::MAX);
    let total = prompt.len().checked_add(s.tokens).filter(|&n| n <= context);
    ensure!(
        total.is_some(),
        "--tokens {}: with the prompt's {} tokens, past the model's context of {context} \
         positions (max_position_embeddings in config.json)",
        s.tokens,
        prompt.len()
    );
    if let Some(&id) = prompt.iter().find(|&&id| id as usize >= config.vocab_size) {
        anyhow::bail!(
            "the tokenizer gave token {id}, past the model's vocabulary of {}: is it this \
             model's tokenizer.json?",
            config.vocab_size
        );
    }

    let decode = |ids: &[u32]| tokenizer.decode(ids, true).unwrap_or_default();
    let prompt_text = decode(&prompt);
    // The text the generated `ids` add after the prompt.
    let added = |ids: &[u32]| {
        let text = decode(&[&prompt[..], ids].concat());
        match text.strip_prefix(prompt_text.as_str()) {
            Some(added) => added.to_string(),
            None => decode(ids),
        }
    };
    let mut out = std::io::stdout().lock();
    write!(out, "{}", s.prompt)?;
    out.flush()?;
    let mut shown = String::new();
    let start = Instant::now();
    let generated = generate(&lm, &prompt, s.tokens, &end, &device, |ids| {
        // Print what the text gained; a token that ends inside a character waits for the
        // next one.
        let text = added(ids);
        if let Some(new) = text.strip_prefix(shown.as_str())
            && !new.ends_with('\u{FFFD}')
        {
            let _ = write!(out, "{new}");
            let _ = out.flush();
            shown = text;
        }
    })?;
    let text = added(&generated);
    match text.strip_prefix(shown.as_str()) {
        Some(rest) => writeln!(out, "{rest}")?,
        None => writeln!(out, "\n{text}")?,
    }
    if s.ids {
        let list = |ids: &[u32]| ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
        writeln!(out, "prompt ids: {}", list(&prompt))?;
        writeln!(out, "generated ids: {}", list(&generated))?;
    }
    let seconds = start.elapsed().as_secs_f64();
    eprintln!(
        "{} prompt tokens, {} generated in {seconds:.2} s ({:.1} tokens/s)",
        prompt.len(),
        generated.len(),
        generated.len() as f64 / seconds
    );
    Ok(())
}
