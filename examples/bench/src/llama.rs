//! A Llama-family language model loaded through `mha::hf` at the 2-layer fixture's shape
//! scaled up (`LLAMA`: width 512, 8 query heads and 2 key/value heads of 64, feed-forward
//! 768, a vocabulary of 50): the forward of 512 tokens, and one decoding step after 512
//! cached positions. `scripts/bench_hf.py` times transformers' `LlamaForCausalLM` at the
//! same configuration and runs this beside it.

use burn::tensor::{Device, Distribution, Int, Tensor};
use mha::AttentionMask;
use mha::hf::HfConfig;
use train::backend::Backend;

use crate::{Record, Timed, time, time_steps};

/// The model's `config.json`, as transformers writes it (`scripts/bench_hf.py` builds
/// its model from the same numbers).
pub const LLAMA: &str = r#"{
  "model_type": "llama",
  "hidden_size": 512,
  "intermediate_size": 768,
  "num_hidden_layers": 2,
  "num_attention_heads": 8,
  "num_key_value_heads": 2,
  "head_dim": 64,
  "rms_norm_eps": 1e-6,
  "rope_theta": 500.0,
  "vocab_size": 50,
  "tie_word_embeddings": false
}"#;

/// Tokens of the forward, and positions before the decoded token.
pub const TOKENS: usize = 512;

/// A record of the model at [`TOKENS`] positions.
fn record(backend: Backend, pass: &'static str, timed: Timed, tokens: usize) -> Record {
    Record {
        tokens_per_second: Some(tokens as f64 / timed.ms * 1e3),
        batch: Some(1),
        context: Some(TOKENS),
        dtype: Some("f32"),
        ..Record::new(backend.name(), "llama", pass, timed)
    }
}

/// The forward of [`TOKENS`] tokens (`forward`) and one decoding step after [`TOKENS`]
/// cached positions (`decode-step`; the cache has room for every timed step, so the
/// context grows by one per run), batch 1, f32, random weights.
pub fn bench_llama(
    runs: usize,
    backend: Backend,
    device: &Device,
    out: &mut Vec<Record>,
) -> anyhow::Result<()> {
    let config = HfConfig::from_json(LLAMA.as_bytes(), "bench's LLAMA")?;
    let lm = config.init_causal_lm(device)?;
    let vocab = config.vocab_size as f64;
    let ids = Tensor::<2, Int>::random([1, TOKENS], Distribution::Uniform(0.0, vocab), device);
    eprintln!("{backend}: llama forward of {TOKENS} tokens ...");
    let ms = time(runs, device, || {
        lm.forward(ids.clone(), AttentionMask::none())
    })?;
    out.push(record(backend, "forward", ms, TOKENS));

    eprintln!("{backend}: llama decoding step after {TOKENS} positions ...");
    let mut cache = lm.cache(TOKENS + runs + 2);
    lm.forward_cached(ids.clone(), &mut cache)?;
    let token = ids.slice([0..1, 0..1]);
    let ms = time_steps(runs, device, || {
        lm.forward_cached(token.clone(), &mut cache)
    })?;
    out.push(record(backend, "decode-step", ms, 1));
    Ok(())
}

/// The table of [`bench_llama`]'s records of `backend`.
pub fn print_llama(backend: Backend, records: &[Record]) {
    let find = |pass: &str| {
        records
            .iter()
            .find(|r| r.backend == backend.name() && r.subject == "llama" && r.pass == pass)
    };
    if let (Some(forward), Some(step)) = (find("forward"), find("decode-step")) {
        println!(
            "\n{backend}: Llama 2 layers, width 512, 8/2 heads of 64, f32: forward of \
             {TOKENS} tokens {:.2} ms; one decoding step after {TOKENS} positions {:.3} ms",
            forward.median_ms, step.median_ms
        );
    }
}
