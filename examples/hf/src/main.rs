//! Greedy generation from a Hugging Face model directory on your disk, through `mha`'s
//! modules and decode cache: Llama, Mistral, Qwen2 or Qwen3 (`config.json`, the weights in
//! `model.safetensors` or its shards, `tokenizer.json`).
//!
//! ```sh
//! cargo run --release -p hf -- --model path/to/Qwen2.5-0.5B-Instruct --prompt "The capital of France is"
//! cargo run --release -p hf --features wgpu -- --model DIR --backend wgpu --dtype f16
//! ```
//!
//! The prompt is tokenised as `tokenizer.json` says (its special tokens added, neither
//! cut nor padded, as transformers' tokenizer does by default), read in one call, then
//! each new token is the most likely one (greedy decoding, transformers' `do_sample=False`,
//! with the `repetition_penalty` of `generation_config.json` where it sets one), fed back
//! one at a time through the cache, until `--tokens` tokens or an end-of-sequence token
//! (`eos_token_id` of `generation_config.json`, else of `config.json`). Other settings
//! there that change transformers' greedy decoding (`no_repeat_ngram_size`,
//! `bad_words_ids`, ...) are not applied: each is named in a warning. The text is
//! printed as it grows: what decoding the prompt and the new tokens together adds to the
//! decoded prompt (decoded alone, SentencePiece's first piece would lose its space).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Instant;

use anyhow::{Context, ensure};
use burn::tensor::{Device, FloatDType, Int, Tensor, TensorData};
use mha::ModuleDType;
use mha::hf::{CausalLm, HfConfig, load_causal_lm, read_pretrained};
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
    fn parse(args: Vec<String>) -> anyhow::Result<Self> {
        let first = BACKENDS.first().context("no backend compiled in")?;
        let readme = "the flags are in examples/hf/README.md";
        // In order: each flag with a value takes the next argument, whatever it is (a
        // prompt may be "--ids").
        let mut values: HashMap<String, String> = HashMap::new();
        let mut ids = false;
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            let repeated = match arg.as_str() {
                "--ids" => std::mem::replace(&mut ids, true),
                "--model" | "--prompt" | "--tokens" | "--backend" | "--dtype" => {
                    let value = args
                        .next()
                        .with_context(|| format!("{arg} needs a value"))?;
                    values.insert(arg.clone(), value).is_some()
                }
                _ => true,
            };
            ensure!(!repeated, "unknown or repeated flag {arg}; {readme}");
        }
        let a = &values;
        let s = Settings {
            model: flag(a, "--model", PathBuf::new())?,
            prompt: flag(a, "--prompt", "Once upon a time".to_string())?,
            tokens: flag(a, "--tokens", 64)?,
            backend: flag(a, "--backend", first.to_string())?,
            dtype: flag(a, "--dtype", "f32".to_string())?,
            ids,
        };
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

/// The value given for `name`, or `default` if none was.
fn flag<T: FromStr>(values: &HashMap<String, String>, name: &str, default: T) -> anyhow::Result<T> {
    let Some(value) = values.get(name) else {
        return Ok(default);
    };
    let parsed = value.parse().ok();
    parsed.with_context(|| format!("{name} {value}: not valid"))
}

/// What `generation_config.json` (else `config.json`) says of greedy decoding: the
/// end-of-sequence tokens (`eos_token_id`, one id or a list) and the repetition penalty
/// (`repetition_penalty`, 1 for none), which transformers applies with `do_sample=False`
/// too; and the settings it names that change greedy decoding in transformers but are not
/// applied here, each with its value, for a warning.
#[derive(Clone, Debug, PartialEq)]
struct Generation {
    end: Vec<u32>,
    repetition_penalty: f32,
    not_applied: Vec<String>,
}

impl Generation {
    /// The settings `generation_config.json` gives where the directory has one, else
    /// `config.json`'s (the end tokens from `config.json` too where the first has none).
    ///
    /// # Errors
    /// When a file is not JSON, `eos_token_id` is not a token id or a list of them, or
    /// `repetition_penalty` is not a positive number (in f32).
    fn read(dir: &Path) -> anyhow::Result<Self> {
        let read = |name: &str| -> anyhow::Result<Option<(PathBuf, serde_json::Value)>> {
            let path = dir.join(name);
            if !path.exists() {
                return Ok(None);
            }
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            let json = serde_json::from_str(&text)
                .with_context(|| format!("{} is not JSON", path.display()))?;
            Ok(Some((path, json)))
        };
        let files: Vec<_> = [read("generation_config.json")?, read("config.json")?]
            .into_iter()
            .flatten()
            .collect();
        // The first file that names the end: one token id or a list of them, each a
        // token's id (a number past u32, negative or not whole is refused, not cut).
        let end = match files
            .iter()
            .find(|(_, json)| !json["eos_token_id"].is_null())
        {
            None => Vec::new(),
            Some((path, json)) => {
                let value = &json["eos_token_id"];
                let ids = match value {
                    serde_json::Value::Array(list) => list.iter().collect(),
                    one => vec![one],
                };
                ids.into_iter()
                    .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .with_context(|| {
                        format!(
                            "{}: eos_token_id {value} is not a token id (or a list of them) \
                             from 0 to {}",
                            path.display(),
                            u32::MAX
                        )
                    })?
            }
        };
        let Some((path, json)) = files.first() else {
            return Ok(Self {
                end: Vec::new(),
                repetition_penalty: 1.0,
                not_applied: Vec::new(),
            });
        };
        // Checked as the f32 it is applied in (1e39 would be infinite there).
        let penalty = match &json["repetition_penalty"] {
            serde_json::Value::Null => 1.0,
            value => value
                .as_f64()
                .map(|p| p as f32)
                .filter(|p| p.is_finite() && *p > 0.0)
                .with_context(|| {
                    format!(
                        "{}: repetition_penalty {value} is not a positive number",
                        path.display()
                    )
                })?,
        };
        Ok(Self {
            end,
            repetition_penalty: penalty,
            not_applied: not_applied(json),
        })
    }
}

/// The settings of `json` that transformers' greedy decoding applies and this example
/// does not, each as `name = value`, where they are set to something that acts.
fn not_applied(json: &serde_json::Value) -> Vec<String> {
    let acts = |name: &str, value: &serde_json::Value| match (name, value) {
        (_, serde_json::Value::Null) => false,
        ("no_repeat_ngram_size" | "min_length" | "min_new_tokens" | "penalty_alpha", v) => {
            v.as_f64().is_some_and(|n| n > 0.0)
        }
        ("num_beams" | "num_beam_groups", v) => v.as_f64().is_some_and(|n| n > 1.0),
        ("encoder_repetition_penalty", v) => v.as_f64().is_some_and(|p| p != 1.0),
        (_, serde_json::Value::Array(list)) => !list.is_empty(),
        (_, serde_json::Value::Object(map)) => !map.is_empty(),
        _ => true,
    };
    [
        "num_beams",
        "num_beam_groups",
        "penalty_alpha",
        "no_repeat_ngram_size",
        "min_length",
        "min_new_tokens",
        "bad_words_ids",
        "suppress_tokens",
        "begin_suppress_tokens",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "sequence_bias",
        "exponential_decay_length_penalty",
        "encoder_repetition_penalty",
    ]
    .into_iter()
    .filter(|name| acts(name, &json[*name]))
    .map(|name| format!("{name} = {}", json[name]))
    .collect()
}

/// `row`, the logits of the next token, with transformers' repetition penalty for the
/// tokens `seen` (the prompt's and those generated): each seen token's logit divided by
/// `penalty` where positive, multiplied by it where negative, once however often it was
/// seen.
fn penalize(row: &mut [f32], seen: &[u32], penalty: f32) {
    let mut done = vec![false; row.len()];
    for &id in seen {
        let id = id as usize;
        if id < row.len() && !done[id] {
            done[id] = true;
            row[id] = match row[id] < 0.0 {
                true => row[id] * penalty,
                false => row[id] / penalty,
            };
        }
    }
}

/// The first index of the largest value of `row` (as `torch.argmax`).
fn argmax(row: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in row.iter().enumerate() {
        if best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.map(|(i, _)| i as u32)
}

/// The `model_type` values of the models this example runs (`mha::hf::read_pretrained`).
const LLAMA_FAMILY: [&str; 4] = ["llama", "mistral", "qwen2", "qwen3"];

/// The `model_type` of the `config.json` at `path`, where it can be read.
fn model_type(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let json: serde_json::Value = serde_json::from_str(&text).ok()?;
    json["model_type"].as_str().map(str::to_string)
}

/// The logits `[1, 1, vocab]` of the last position of `logits` `[1, T, vocab]`.
fn last_position(logits: Tensor<3>) -> Tensor<3> {
    let [_, positions, vocab] = logits.dims();
    logits.slice([0..1, positions - 1..positions, 0..vocab])
}

/// The most likely next token after the last position of `logits` `[1, T, vocab]`.
fn greedy(logits: Tensor<3>) -> anyhow::Result<u32> {
    let best = last_position(logits).argmax(2).into_data();
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

/// The next token after the last position of `logits` `[1, T, vocab]`: the most likely,
/// after the repetition penalty of `generation` for the tokens `seen`.
fn next_token(logits: Tensor<3>, seen: &[u32], generation: &Generation) -> anyhow::Result<u32> {
    if generation.repetition_penalty == 1.0 {
        return greedy(logits);
    }
    let last = last_position(logits).into_data();
    let row = last.convert::<f32>().try_into_vec::<f32>().ok();
    let mut row = row.context("no logits")?;
    penalize(&mut row, seen, generation.repetition_penalty);
    argmax(&row).context("no logits")
}

/// Generates up to `tokens` tokens after `prompt` greedily, calling `each` with the ids so
/// far after every one; returns the generated ids.
fn generate(
    lm: &CausalLm,
    prompt: &[u32],
    tokens: usize,
    generation: &Generation,
    device: &Device,
    mut each: impl FnMut(&[u32]),
) -> anyhow::Result<Vec<u32>> {
    let mut cache = lm.cache(prompt.len() + tokens);
    let mut logits = lm.forward_cached(batch(prompt, device), &mut cache)?;
    let mut generated = Vec::with_capacity(tokens);
    let mut seen = prompt.to_vec();
    loop {
        let next = next_token(logits, &seen, generation)?;
        seen.push(next);
        let end = &generation.end;
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
    let mut tokenizer = Tokenizer::from_file(&tokenizer_path)
        .map_err(|err| anyhow::anyhow!("{}: {err}", tokenizer_path.display()))?;
    // The prompt as transformers' tokenizer reads it by default: neither cut nor padded
    // to the lengths `tokenizer.json` may name.
    tokenizer
        .with_truncation(None)
        .map_err(|err| anyhow::anyhow!("{}: {err}", tokenizer_path.display()))?
        .with_padding(None);
    let generation = Generation::read(dir)?;
    for setting in &generation.not_applied {
        eprintln!(
            "warning: {setting} (generation settings) is not applied here: transformers' \
             greedy decoding of this model applies it"
        );
    }

    // Checked before the weights load: the model's family, the prompt's tokens, the
    // context and the vocabulary.
    let config_path = dir.join("config.json");
    if let Some(family) = model_type(&config_path)
        && !LLAMA_FAMILY.contains(&family.as_str())
    {
        anyhow::bail!(
            "{}: model_type `{family}`: this example generates with {} models{}",
            config_path.display(),
            LLAMA_FAMILY.join(", "),
            match family.as_str() {
                "gpt2" => "; GPT-2 loads in the library (mha::hf::load_gpt2_lm)",
                _ => "",
            }
        );
    }
    let config = HfConfig::from_file(&config_path)?;
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

    let start = Instant::now();
    // Built, cast, then loaded: the parameters are never all in f32 at once for another
    // dtype, and a dtype the device does not compute in is named before any weight is
    // read.
    let lm = match dtype {
        FloatDType::F32 => config.init_causal_lm(&device)?,
        other => config
            .init_causal_lm(&device)?
            .try_to_dtype(other)
            .with_context(|| format!("--dtype {}", s.dtype))?,
    };
    let (config, weights) = read_pretrained(dir)?;
    let lm = load_causal_lm(lm, &weights, "")?;
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

    // A decoder's error is an error, not an empty text. (An id the tokenizer does not
    // know, past its vocabulary in a model's padded one, it leaves out of the text.)
    let decode = |ids: &[u32]| {
        tokenizer
            .decode(ids, true)
            .map_err(|err| anyhow::anyhow!("the tokenizer cannot decode the ids: {err}"))
    };
    let prompt_text = decode(&prompt)?;
    // The text the generated `ids` add after the prompt.
    let added = |ids: &[u32]| -> anyhow::Result<String> {
        let text = decode(&[&prompt[..], ids].concat())?;
        match text.strip_prefix(prompt_text.as_str()) {
            Some(added) => Ok(added.to_string()),
            None => decode(ids),
        }
    };
    let mut out = std::io::stdout().lock();
    write!(out, "{}", s.prompt)?;
    out.flush()?;
    let mut shown = String::new();
    let start = Instant::now();
    let generated = generate(&lm, &prompt, s.tokens, &generation, &device, |ids| {
        // Print what the text gained; a token that ends inside a character waits for the
        // next one, and ids the tokenizer cannot decode for the end, which reports it.
        let Ok(text) = added(ids) else { return };
        if let Some(new) = text.strip_prefix(shown.as_str())
            && !new.ends_with('\u{FFFD}')
        {
            let _ = write!(out, "{new}");
            let _ = out.flush();
            shown = text;
        }
    })?;
    let text = added(&generated)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_repetition_penalty_acts_once_on_each_token_seen() {
        let mut row = vec![2.0, -1.0, 0.5, 3.0];
        // Token 7 is past the row; tokens 0 and 1 are seen twice.
        penalize(&mut row, &[0, 1, 1, 0, 7], 2.0);
        assert_eq!(row, vec![1.0, -2.0, 0.5, 3.0]);
        assert_eq!(argmax(&row), Some(3));
        assert_eq!(
            argmax(&[1.0, 3.0, 3.0]),
            Some(1),
            "the first of equal logits"
        );
        assert_eq!(argmax(&[]), None);
    }

    #[test]
    fn generation_settings_are_read_where_transformers_reads_them() {
        let dir = std::env::temp_dir().join(format!("hf-generation-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, text: &str| std::fs::write(dir.join(name), text).unwrap();
        write(
            "config.json",
            r#"{"eos_token_id": [2, 5], "repetition_penalty": 3.0}"#,
        );
        assert_eq!(
            Generation::read(&dir).unwrap(),
            Generation {
                end: vec![2, 5],
                repetition_penalty: 3.0,
                not_applied: vec![],
            }
        );
        // generation_config.json first; the end tokens from config.json where it has none.
        write(
            "generation_config.json",
            r#"{"repetition_penalty": 1.1, "no_repeat_ngram_size": 3, "min_length": 0,
                "bad_words_ids": null, "suppress_tokens": [], "do_sample": true,
                "num_beams": 4, "num_beam_groups": 1}"#,
        );
        assert_eq!(
            Generation::read(&dir).unwrap(),
            Generation {
                end: vec![2, 5],
                repetition_penalty: 1.1,
                not_applied: vec![
                    "num_beams = 4".to_string(),
                    "no_repeat_ngram_size = 3".to_string()
                ],
            }
        );
        // A penalty past f32's range, an end token past u32's, negative or not whole: named
        // (they became an infinite penalty and token 2).
        let cases = [
            (
                r#"{"repetition_penalty": 0}"#,
                "generation_config.json: repetition_penalty 0 is not a positive number",
            ),
            (
                r#"{"repetition_penalty": 1e39}"#,
                "generation_config.json: repetition_penalty 1e+39 is not a positive number",
            ),
            (
                r#"{"eos_token_id": 4294967298}"#,
                "generation_config.json: eos_token_id 4294967298 is not a token id (or a list \
                 of them) from 0 to 4294967295",
            ),
            (
                r#"{"eos_token_id": [2, -1]}"#,
                "generation_config.json: eos_token_id [2,-1] is not a token id (or a list of \
                 them) from 0 to 4294967295",
            ),
            (
                r#"{"eos_token_id": 2.5}"#,
                "generation_config.json: eos_token_id 2.5 is not a token id (or a list of \
                 them) from 0 to 4294967295",
            ),
        ];
        for (text, want) in cases {
            write("generation_config.json", text);
            let err = Generation::read(&dir).unwrap_err().to_string();
            assert!(err.ends_with(want), "{err} (want {want})");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
