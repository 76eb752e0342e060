//! A character-level GPT on Shakespeare built from `mha`'s blocks, in one file: the data,
//! the model, the training loop and the sampling, to be read top to bottom.
//!
//! ```sh
//! cargo run --release -p gpt                       # on the CPU (flex)
//! cargo run --release -p gpt --features wgpu       # on the GPU
//! cargo run --release -p gpt -- --steps 500 --sample 300 --temperature 1.0
//! ```
//!
//! The defaults are nanoGPT's CPU recipe, as the trainer's `--task text`: 4 causal blocks
//! of 4 heads, width 128, block 64, batch 12, 2000 steps, lr 1e-3 warmed up over 100
//! steps then a cosine down to lr/10, AdamW with betas 0.9/0.99 and weight decay 0.1 on
//! the matrices and embeddings, the gradients' global norm clipped at 1, no dropout.

use std::f64::consts::{LN_2, PI};
use std::str::FromStr;
use std::time::Instant;

use anyhow::{Context, ensure};
use burn::module::{Module, ModuleMapper, Param, ParamGroup};
use burn::nn::{Embedding, EmbeddingConfig};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Distribution, Int, Tensor, TensorData};
use mha::{Encoder, EncoderBlockConfig, EncoderConfig, KvCache, Positions, StackCache, StackInput};

#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Seven of Shakespeare's plays, 1.07 MB (`examples/train/data/README.md` says which).
const SHAKESPEARE: &str = include_str!("../../train/data/shakespeare.txt");

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

/// Every setting; `--flag value` on the command line (see [`Settings::parse`]).
#[derive(Clone, Debug)]
struct Settings {
    steps: usize,
    batch: usize,         // windows per step
    block: usize,         // characters the model reads
    d_model: usize,       // the width
    layers: usize,        // blocks
    heads: usize,         // attention heads
    lr: f64,              // the peak learning rate
    eval_every: usize,    // steps between two validations
    valid_windows: usize, // windows the validation loss is the mean of
    log_every: usize,     // steps between two progress lines
    sample: usize,        // characters sampled at the end
    prompt: String,       // what the sample continues
    temperature: f64,     // 0: the most likely character every time
    top_k: usize,         // draw among the `top_k` most likely characters
    seed: u64,            // of the weights, the batches and the sample
    backend: String,
}

impl Settings {
    fn parse(args: Vec<String>) -> anyhow::Result<Self> {
        let first = BACKENDS.first().context("no backend compiled in")?;
        let readme = "the flags are in examples/gpt/README.md";
        // `--flag value` pairs, read in order: a value is taken as it is, even one that
        // starts with `--` (a prompt may).
        let mut pairs: Vec<(String, String)> = Vec::new();
        let mut args = args.into_iter();
        while let Some(name) = args.next() {
            if name == "--help" || name == "-h" {
                println!("usage: gpt [--flag value]...; {readme}");
                std::process::exit(0);
            }
            ensure!(
                name.starts_with("--") && !name.contains('='),
                "{name:?}: a flag was expected (`--flag value`, not `--flag=value`); {readme}"
            );
            ensure!(pairs.iter().all(|(n, _)| *n != name), "{name} given twice");
            let value = args
                .next()
                .with_context(|| format!("{name} needs a value"))?;
            pairs.push((name, value));
        }
        let (a, first) = (&mut pairs, first.to_string());
        let s = Settings {
            steps: flag(a, "--steps", 2000)?,
            batch: flag(a, "--batch", 12)?,
            block: flag(a, "--block", 64)?,
            d_model: flag(a, "--d-model", 128)?,
            layers: flag(a, "--layers", 4)?,
            heads: flag(a, "--heads", 4)?,
            lr: flag(a, "--lr", 1e-3)?,
            eval_every: flag(a, "--eval-every", 250)?,
            valid_windows: flag(a, "--valid-windows", 1024)?,
            log_every: flag(a, "--log-every", 50)?,
            sample: flag(a, "--sample", 500)?,
            prompt: flag(a, "--prompt", "\n".to_string())?,
            temperature: flag(a, "--temperature", 0.8)?,
            top_k: flag(a, "--top-k", 200)?,
            seed: flag(a, "--seed", 42)?,
            backend: flag(a, "--backend", first)?,
        };
        if let Some((name, _)) = pairs.first() {
            anyhow::bail!("unknown flag {name}; {readme}");
        }
        let (backends, b) = (BACKENDS.join(", "), &&*s.backend);
        ensure!(BACKENDS.contains(b), "--backend: this build has {backends}");
        let counts = [
            ("--steps", s.steps),
            ("--batch", s.batch),
            ("--block", s.block),
            ("--d-model", s.d_model),
            ("--layers", s.layers),
            ("--heads", s.heads),
            ("--eval-every", s.eval_every),
            ("--valid-windows", s.valid_windows),
            ("--log-every", s.log_every),
            ("--top-k", s.top_k),
        ];
        for (name, count) in counts {
            ensure!(count > 0, "{name} must be at least 1, got 0");
        }
        let (d, h) = (s.d_model, s.heads);
        ensure!(d % h == 0, "--d-model {d} is not divisible by --heads {h}");
        ensure!(
            s.lr > 0.0 && s.lr <= 1.0,
            "--lr must be in (0, 1], got {}",
            s.lr
        );
        let t = s.temperature;
        let greedy_or_positive = t == 0.0 || (t.is_finite() && t > 0.0);
        ensure!(
            greedy_or_positive,
            "--temperature must be 0 (greedy) or positive, got {t}"
        );
        Ok(s)
    }
}

/// The value of flag `name` among `pairs`, taken out of them, or `default` if they have
/// none.
fn flag<T: FromStr>(
    pairs: &mut Vec<(String, String)>,
    name: &str,
    default: T,
) -> anyhow::Result<T> {
    let Some(at) = pairs.iter().position(|(n, _)| n == name) else {
        return Ok(default);
    };
    let (_, value) = pairs.remove(at);
    let parsed = value.parse().ok();
    parsed.with_context(|| format!("{name} {value}: not valid"))
}

// ---------------------------------------------------------------------------------------
// The data: the characters are the tokens; the first 90% trains, the last 10% validates.

/// The distinct characters of `text`, sorted (token `i` is `vocab[i]`), and the text as
/// tokens: the first 90% (rounded half up) to train on, the rest to validate.
fn tokens(text: &str) -> (Vec<char>, Vec<u32>, Vec<u32>) {
    let mut vocab: Vec<char> = text.chars().collect();
    vocab.sort_unstable();
    vocab.dedup();
    let id = |c| vocab.binary_search(&c).expect("in the vocabulary") as u32;
    let mut train: Vec<u32> = text.chars().map(id).collect();
    let valid = train.split_off((9 * train.len() + 5) / 10);
    (vocab, train, valid)
}

/// The model's input (each window but its last character) and targets (each but its
/// first: every position predicts the next character), `[B, block]` each, for windows of
/// `block + 1` characters of `text` starting at `starts`.
fn batch(text: &[u32], starts: &[usize], block: usize, device: &Device) -> [Tensor<2, Int>; 2] {
    [0, 1].map(|shift| {
        let windows = starts.iter().map(|&s| &text[s + shift..s + shift + block]);
        let ids: Vec<i64> = windows.flatten().map(|&c| i64::from(c)).collect();
        Tensor::from_data(TensorData::new(ids, [starts.len(), block]), device)
    })
}

/// SplitMix64's output for state `x`: the random numbers of the batches and the sampling.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Where row `row` of step `step`'s batch starts among `windows`: the trainer's draw, so
/// that with one seed both train on the same batches.
fn batch_start(seed: u64, step: usize, row: usize, windows: usize) -> usize {
    let h = splitmix64(splitmix64(splitmix64(seed) ^ step as u64) ^ row as u64);
    (h % windows as u64) as usize
}

// ---------------------------------------------------------------------------------------
// The model: token embeddings; `mha`'s stack of causal pre-norm blocks, which adds the
// learned positions first and applies its final norm last; the head tied to the tokens.

#[derive(Module, Debug)]
struct Gpt {
    /// One vector per character, `[V, D]`; the head reads it too (logits `h Eᵀ`).
    tokens: Embedding,
    /// Learned positions, causal blocks (attention, GELU feed-forward), the final norm.
    blocks: Encoder,
    /// The positions it has: the longest context.
    block: usize,
}

impl Gpt {
    fn new(s: &Settings, vocab: usize, device: &Device) -> anyhow::Result<Self> {
        let block = EncoderBlockConfig::new(s.d_model, s.heads) // d_ff: 4 d_model
            .with_causal(true)
            .with_dropout(0.0)
            .with_positions(Positions::Learned { max_len: s.block });
        let model = Gpt {
            tokens: EmbeddingConfig::new(vocab, s.d_model).init(device),
            blocks: EncoderConfig::new(block, s.layers).try_init(device)?,
            block: s.block,
        };
        let residual_std = 0.02 / (2.0 * s.layers as f64).sqrt();
        Ok(model.map(&mut GptInit(Vec::new(), residual_std)))
    }

    /// Logits `[B, T, V]` of the next character at every position of `ids` `[B, T]`;
    /// with a cache, `ids` come after the positions it holds (and are added to it).
    fn forward(&self, ids: Tensor<2, Int>, cache: Option<&mut StackCache>) -> Tensor<3> {
        let x = self.tokens.forward(ids); // [B, T, D]
        let input = match cache {
            Some(cache) => StackInput::new(x).cache(cache),
            None => StackInput::new(x),
        };
        let h = self.blocks.forward(input).expect("positions left").output;
        mha::linear::linear(h, self.tokens.weight.val().transpose(), None) // [B, T, V]
    }
}

/// nanoGPT's initialisation: every weight N(0, 0.02), those of the projections into the
/// residual stream (attention output, second feed-forward layer) N(0, 0.02 / √(2 ·
/// layers)), the biases 0; the norms keep γ = 1, β = 0. It holds the path of the
/// parameter being mapped (`["blocks", "layers", "0", "self_attn", "out_proj", "weight"]`).
struct GptInit(Vec<String>, f64);

impl ModuleMapper for GptInit {
    fn enter_module(&mut self, name: &str, _: &str) {
        self.0.push(name.into());
    }

    fn exit_module(&mut self, _: &str, _: &str) {
        self.0.pop();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let last = |i: usize| self.0.iter().rev().nth(i).map(String::as_str);
        let std = match (last(1), last(0)) {
            (Some("out_proj" | "linear2"), Some("weight")) => self.1,
            (_, Some("weight")) => 0.02,
            (_, Some("bias")) => 0.0,
            _ => return param, // the norms' gamma and beta
        };
        let (id, tensor, mapper) = param.consume();
        let (shape, device) = (tensor.shape(), tensor.device());
        let fresh = match std > 0.0 {
            true => Tensor::random(shape, Distribution::Normal(0.0, std), &device),
            false => Tensor::zeros(shape, &device),
        };
        let fresh = fresh.set_require_grad(tensor.is_require_grad());
        Param::from_mapped_value(id, fresh, mapper)
    }
}

// ---------------------------------------------------------------------------------------
// Training.

/// The learning rate of `step`: a linear warmup from lr/100 over a tenth of the run (at
/// most 100 steps), then a cosine decay to lr/10 at the last step.
fn learning_rate(s: &Settings, step: usize) -> f64 {
    let (start, floor, warmup) = (s.lr / 100.0, s.lr / 10.0, (s.steps / 10).clamp(1, 100));
    if step < warmup {
        return start + (s.lr - start) * step as f64 / warmup as f64;
    }
    let progress = (step - warmup) as f64 / (s.steps - warmup).max(1) as f64;
    floor + 0.5 * (s.lr - floor) * (1.0 + (PI * progress).cos())
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
    let (vocab, train, valid) = tokens(SHAKESPEARE);
    let (t, v, n) = (train.len(), valid.len(), vocab.len());
    println!("{t} characters to train on, {v} to validate, {n} distinct");
    let most = v - 1; // a validation window is `block + 1` characters
    ensure!(
        s.block <= most,
        "--block {}: at most {most} (the validation part's)",
        s.block
    );
    // What the sample continues, checked before the training.
    let id = |c| vocab.binary_search(&c).ok();
    let not_in = |c| {
        format!(
            "--prompt {:?}: {c:?} is not among the text's {n} characters",
            s.prompt
        )
    };
    let prompt: Vec<usize> = s
        .prompt
        .chars()
        .map(|c| id(c).with_context(|| not_in(c)))
        .collect::<anyhow::Result<_>>()?;
    ensure!(!prompt.is_empty(), "--prompt: at least one character");
    // The windows of `block + 1` characters: any of the training part's; for validation,
    // `valid_windows` spread evenly over the validation part, the same every time.
    let (windows, last) = (train.len() - s.block, valid.len() - s.block - 1);
    let count = s.valid_windows.min(last + 1);
    let valid_starts: Vec<usize> = (0..count).map(|i| i * last / (count - 1).max(1)).collect();

    // The backend's device, and the same with autodiff for training.
    let device = device(&s.backend);
    let train_device = device.clone().autodiff();
    train_device.seed(s.seed);
    let mut model = Gpt::new(&s, vocab.len(), &train_device)?;
    println!("{} parameters, on {}", model.num_params(), s.backend);

    // Burn's AdamW, without weight decay on the biases and the norms' gains and shifts.
    let adamw = |decay| {
        let adamw = AdamWConfig::new().with_beta_2(0.99).with_epsilon(1e-8);
        adamw.with_weight_decay(decay)
    };
    let vectors = ParamGroup::from_any_predicates(vec![".bias", ".gamma", ".beta"]);
    let no_decay = adamw(0.0).build();
    let mut optim = adamw(0.1).init().with_group(vectors, no_decay, None);

    // The mean loss (nats per character) of the validation windows, without autodiff.
    let validate = |model: &Gpt, step: usize| {
        let (model, mut total) = (model.valid(), 0.0);
        for rows in valid_starts.chunks(64) {
            let [x, y] = batch(&valid, rows, s.block, &device);
            let logits = model.forward(x, None).flatten(0, 1); // [B·T, V]
            let loss = mha::loss::cross_entropy(logits, y.flatten(0, 1), None);
            total += f64::from(loss.into_scalar::<f32>()) * rows.len() as f64;
        }
        let (loss, bits) = (total / count as f64, total / count as f64 / LN_2);
        println!("step {step:>5}  validation loss {loss:.4} ({bits:.3} bits)");
    };
    mha::on_cpu_workers(&device, || validate(&model, 0));
    // The time spent in steps (validations left out), up to step `timed`.
    let (started, mut since, mut in_steps, mut timed) = (Instant::now(), Instant::now(), 0.0, 0);
    for step in 0..s.steps {
        let starts = (0..s.batch).map(|row| batch_start(s.seed, step, row, windows));
        let [x, y] = batch(&train, &starts.collect::<Vec<_>>(), s.block, &train_device);
        let lr = learning_rate(&s, step);
        // A step: forward, backward, the gradients' global norm clipped at 1, AdamW. On
        // the CPU backends, on a worker of their thread pool, whose other workers wait for
        // its work by spinning (see `mha::on_cpu_workers`).
        let (next, loss) = mha::on_cpu_workers(&device, || {
            let logits = model.forward(x, None).flatten(0, 1); // [B·T, V]
            let loss = mha::loss::cross_entropy(logits, y.flatten(0, 1), None);
            let mut grads = GradientsParams::from_grads(loss.backward(), &model);
            mha::optim::clip_grad_norm(&mut grads, &model, 1.0);
            (optim.step(lr, model, grads), loss)
        });
        model = next;
        let done = step + 1;
        if done % s.log_every == 0 || done == s.steps {
            let loss = loss.into_scalar::<f32>(); // waits for the step's work
            let seconds = since.elapsed().as_secs_f64();
            let rate = ((done - timed) * s.batch * s.block) as f64 / seconds;
            println!("step {done:>5}  loss {loss:.4}  lr {lr:.2e}  {rate:.0} tokens/s");
            (in_steps, timed, since) = (in_steps + seconds, done, Instant::now());
        }
        if done % s.eval_every == 0 || done == s.steps {
            let validation = Instant::now();
            mha::on_cpu_workers(&device, || validate(&model, done));
            since += validation.elapsed(); // not a step's time
        }
    }
    let wall = started.elapsed().as_secs_f64();
    let rate = (s.steps * s.batch * s.block) as f64 / wall;
    let ms = 1e3 * in_steps / s.steps as f64;
    println!("{wall:.1} s: {rate:.0} tokens/s with the validations, {ms:.1} ms a step");

    // Sampling, without autodiff: the prompt read once, then a character at a time.
    let sample = model.valid().generate(&prompt, &s);
    let (n, t, k) = (s.sample, s.temperature, s.top_k);
    println!("sample of {n} characters (temperature {t}, top-k {k}):");
    let text: String = sample.iter().map(|&i| vocab[i]).collect();
    println!("{}{text}", s.prompt);
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Sampling.

impl Gpt {
    /// The logits of the character after `ids`, which are read after what `cache` holds.
    fn next_logits(&self, ids: &[usize], cache: &mut StackCache) -> Vec<f32> {
        let device = self.tokens.weight.device();
        let ids: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
        let len = ids.len();
        let ids = Tensor::from_data(TensorData::new(ids, [1, len]), &device);
        let logits = self.forward(ids, Some(cache)).narrow(1, len - 1, 1); // [1, 1, V]
        logits.try_into_vec_as::<f32>().expect("f32 logits")
    }

    /// `s.sample` characters after `prompt` (its last `block` characters), drawn with
    /// `s`'s temperature, top-k and seed. The learned positions end at the block: once
    /// the cache holds a block, it starts over from the last half block, read again as
    /// positions 0.., and goes on a character at a time from there.
    fn generate(&self, prompt: &[usize], s: &Settings) -> Vec<usize> {
        let (n, mut rng) = (s.sample, splitmix64(s.seed));
        let mut cache = self.blocks.cache(KvCache::new(self.block));
        let mut context = prompt[prompt.len().saturating_sub(self.block)..].to_vec();
        let mut logits = self.next_logits(&context, &mut cache);
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let next = pick(&logits, s.temperature, s.top_k, &mut rng);
            out.push(next);
            context.push(next);
            let read = match cache.len() < self.block {
                true => &context[context.len() - 1..],
                false => {
                    cache.reset();
                    context.drain(..context.len() - self.block.div_ceil(2));
                    &context[..]
                }
            };
            logits = self.next_logits(read, &mut cache);
        }
        out
    }
}

/// A character drawn from the softmax of `logits` over `temperature`, among the `top_k`
/// most likely (at temperature 0, the most likely one); `rng` is SplitMix64's state.
fn pick(logits: &[f32], temperature: f64, top_k: usize, rng: &mut u64) -> usize {
    let mut best: Vec<usize> = (0..logits.len()).collect();
    best.sort_by(|&a, &b| logits[b].total_cmp(&logits[a])); // stable: ties by index
    best.truncate(top_k);
    if temperature == 0.0 {
        return best[0];
    }
    let top = f64::from(logits[best[0]]);
    let weight = |i: usize| ((f64::from(logits[i]) - top) / temperature).exp();
    let weights: Vec<f64> = best.iter().map(|&i| weight(i)).collect();
    *rng = rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let uniform = (splitmix64(*rng) >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
    let mut left = uniform * weights.iter().sum::<f64>();
    for (&i, w) in best.iter().zip(weights) {
        if left < w {
            return i;
        }
        left -= w;
    }
    best[best.len() - 1] // rounding left a sliver past the last weight
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_are_read_in_order_and_bad_ones_refused_by_name() {
        let args = |a: &[&str]| a.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        // A prompt that looks like a flag is the prompt, and `--steps` after it is read.
        let s = Settings::parse(args(&["--prompt", "--steps", "--steps", "7"])).unwrap();
        assert_eq!((s.prompt.as_str(), s.steps), ("--steps", 7));
        let refused = |a: &[&str]| Settings::parse(args(a)).unwrap_err().to_string();
        let cases: [(&[&str], &str); 6] = [
            (&["--steps", "3", "--steps", "4"], "--steps given twice"),
            (&["--steps"], "--steps needs a value"),
            (&["--stepz", "3"], "unknown flag --stepz"),
            (&["3"], "\"3\": a flag was expected"),
            (
                &["--steps=5", "--lr", "0.01"],
                "\"--steps=5\": a flag was expected",
            ),
            (&["--steps", "x"], "--steps x: not valid"),
        ];
        for (a, want) in cases {
            let got = refused(a);
            assert!(got.contains(want), "{a:?}: {got}");
        }
    }

    #[test]
    fn cached_decoding_gives_the_logits_of_a_whole_forward() {
        let mut s = Settings::parse(Vec::new()).unwrap();
        (s.block, s.d_model, s.layers, s.sample, s.temperature) = (8, 32, 2, 30, 0.0);
        for backend in BACKENDS {
            let device = device(backend);
            device.seed(3);
            let model = Gpt::new(&s, 11, &device).unwrap();
            // A prompt of 3, then a character per call up to the block, against the
            // logits of the 8 read at once.
            let ids = [1, 4, 1, 5, 9, 2, 6, 5];
            let mut cache = model.blocks.cache(KvCache::new(s.block));
            let mut cached = vec![model.next_logits(&ids[..3], &mut cache)];
            cached.extend((3..8).map(|t| model.next_logits(&ids[t..t + 1], &mut cache)));
            let whole = TensorData::new(ids.map(|i| i as i64).to_vec(), [1, 8]);
            let whole = model.forward(Tensor::from_data(whole, &device), None);
            for (i, logits) in cached.iter().enumerate() {
                let want = whole.clone().narrow(1, i + 2, 1).try_into_vec_as::<f32>();
                let worst = logits.iter().zip(want.unwrap()).map(|(a, b)| (a - b).abs());
                let worst = worst.fold(0.0, f32::max);
                assert!(worst < 1e-4, "{backend}: position {}: {worst}", i + 2);
            }
            // Past the block the cache starts over, and the characters keep coming (30,
            // greedily).
            let out = model.generate(&ids[..3], &s);
            assert!(out.len() == 30 && out.iter().all(|&i| i < 11), "{out:?}");
        }
    }
}
