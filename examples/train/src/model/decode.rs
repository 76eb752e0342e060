//! Greedy decoding: each row's most likely next token until EOS or `max_output + 1`
//! tokens, with a key/value cache, and without one (the reference the cache is tested
//! against).

use burn::tensor::{Device, Int, Tensor, TensorData};
use mha::{AttentionMask, KvCache};

use super::Model;
use crate::batch::{FixedShape, padded};
use crate::tasks::{EOS, PAD, SEP};

/// The most likely token at every position of logits `[B, T, V]`, row by row.
fn best_tokens(logits: Tensor<3>) -> Vec<usize> {
    let best = logits
        .argmax(2)
        .into_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .expect("argmax gives integers");
    best.into_iter().map(|t| t as usize).collect()
}

impl Model {
    /// Greedy decoding with a key/value cache per layer; stops at EOS or after
    /// `max_output + 1` tokens. Returns each output without EOS. Decoder-only: the prompts
    /// `input SEP` are left-padded to the longest (each row's positions start at its first
    /// real token, the padding is masked from every query), run once, then one token per
    /// step. Encoder-decoder: the memory's keys and values are projected once per layer,
    /// then one token per step. With `fixed` (GPU backends, which compile kernels per
    /// shape), the prompts and the memory are padded to that shape and every step reads
    /// the whole cache ([`KvCache::fixed_reads`]): one shape for every step.
    pub fn generate(
        &self,
        inputs: &[Vec<usize>],
        max_output: usize,
        fixed: Option<FixedShape>,
        device: &Device,
    ) -> Vec<Vec<usize>> {
        let batch = inputs.len();
        let ids = |rows: Vec<Vec<usize>>| {
            let width = rows.first().map_or(0, Vec::len);
            let data: Vec<i64> = rows.into_iter().flatten().map(|t| t as i64).collect();
            Tensor::<2, Int>::from_data(TensorData::new(data, [batch, width]), device)
        };
        let room = "the cache holds the prompt and every output token";
        let cache = |capacity| match fixed {
            None => KvCache::new(capacity),
            Some(_) => KvCache::new(capacity).fixed_reads(),
        };
        let mut outputs = vec![Vec::new(); batch];
        let mut done = vec![false; batch];
        // The next token of each row from logits `[B, 1, V]`; whether every row is done.
        let mut pick = |logits: Tensor<3>| -> (Vec<usize>, bool) {
            let next = best_tokens(logits);
            for (i, &token) in next.iter().enumerate() {
                if !done[i] {
                    match token == EOS {
                        true => done[i] = true,
                        false => outputs[i].push(token),
                    }
                }
            }
            (next, done.iter().all(|&d| d))
        };
        match self {
            Model::DecoderOnly(m) => {
                let prompts: Vec<Vec<usize>> = inputs
                    .iter()
                    .map(|i| i.iter().copied().chain([SEP]).collect())
                    .collect();
                let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
                let width = fixed.map_or(longest, |f| longest.max(f.input + 1));
                let pads: Vec<usize> = prompts.iter().map(|p| width - p.len()).collect();
                let left_padded = prompts
                    .iter()
                    .zip(&pads)
                    .map(|(p, &n)| {
                        std::iter::repeat_n(PAD, n)
                            .chain(p.iter().copied())
                            .collect()
                    })
                    .collect();
                let positions = pads
                    .iter()
                    .map(|&n| (0..width).map(|t| t.saturating_sub(n)).collect())
                    .collect();
                // Keys `0..pads[b]` of row `b` are padding, over every key a call sees;
                // no mask at all when the prompts have one length (the evaluation groups
                // them so).
                let padded_rows = pads.iter().any(|&n| n > 0);
                let padding = |keys: usize| {
                    if !padded_rows {
                        return AttentionMask::none();
                    }
                    let blocked: Vec<bool> = pads
                        .iter()
                        .flat_map(|&n| (0..keys).map(move |j| j < n))
                        .collect();
                    let blocked = TensorData::new(blocked, [batch, keys]);
                    AttentionMask::key_padding(Tensor::from_data(blocked, device))
                };
                let embed = |tokens, positions: Vec<Vec<usize>>| {
                    m.embed.forward_at(ids(tokens), &positions)
                };
                let mut cache = m.blocks.cache(cache(width + max_output + 1));
                let x = embed(left_padded, positions);
                let keys = cache.layers()[0].keys_seen(width);
                let h = m.blocks.forward_cached(x, &mut cache, &padding(keys));
                let mut logits = m.head.forward(h.expect(room).narrow(1, width - 1, 1));
                for step in 0..=max_output {
                    let (next, all_done) = pick(logits);
                    if all_done || step == max_output {
                        break;
                    }
                    let tokens = next.into_iter().map(|t| vec![t]).collect();
                    let positions = prompts.iter().map(|p| vec![p.len() + step]).collect();
                    let keys = cache.layers()[0].keys_seen(1);
                    let h = m.blocks.forward_cached(
                        embed(tokens, positions),
                        &mut cache,
                        &padding(keys),
                    );
                    logits = m.head.forward(h.expect(room));
                }
            }
            Model::EncoderDecoder(m) => {
                let lengths: Vec<usize> = inputs.iter().map(Vec::len).collect();
                let source = padded(inputs, fixed.map(|f| f.input), device);
                let (memory, padding) = m.encode(source, &lengths);
                let mut cache = m.decoder.cache(memory, cache(max_output + 1));
                let mut tokens = vec![vec![SEP]; batch];
                for step in 0..=max_output {
                    let position = vec![vec![step]; batch];
                    let x = m.embed.forward_at(ids(tokens), &position);
                    let h = m.decoder.forward_cached(x, &mut cache, &padding);
                    let (next, all_done) = pick(m.head.forward(h.expect(room)));
                    if all_done || step == max_output {
                        break;
                    }
                    tokens = next.into_iter().map(|t| vec![t]).collect();
                }
            }
        }
        outputs
    }

    /// Greedy decoding that runs the whole prefix at every step, without a cache (the
    /// reference [`generate`](Self::generate) is tested against). Inputs may differ in length: rows are right-padded, which neither
    /// the causal self-attention nor the padded cross-attention lets a real position see.
    /// With `fixed`, every forward pass has that one shape; without, each step reads the
    /// shortest width that fits.
    pub fn generate_recomputed(
        &self,
        inputs: &[Vec<usize>],
        max_output: usize,
        fixed: Option<FixedShape>,
        device: &Device,
    ) -> Vec<Vec<usize>> {
        let batch = inputs.len();
        let mut done = vec![false; batch];
        let mut outputs = vec![Vec::new(); batch];
        // The prompt each step reads: decoder-only `input SEP out..`, encoder-decoder `SEP out..`.
        let mut prompts: Vec<Vec<usize>> = match self {
            Model::DecoderOnly(_) => inputs
                .iter()
                .map(|i| i.iter().copied().chain([SEP]).collect())
                .collect(),
            Model::EncoderDecoder(_) => vec![vec![SEP]; batch],
        };
        let prompt_width = fixed.map(|f| match self {
            Model::DecoderOnly(_) => f.joined(),
            Model::EncoderDecoder(_) => f.output + 1,
        });
        let memory = match self {
            Model::EncoderDecoder(m) => {
                let lengths: Vec<usize> = inputs.iter().map(Vec::len).collect();
                Some(m.encode(padded(inputs, fixed.map(|f| f.input), device), &lengths))
            }
            Model::DecoderOnly(_) => None,
        };
        for _ in 0..=max_output {
            let ids = padded(&prompts, prompt_width, device);
            let logits = match (self, &memory) {
                (Model::DecoderOnly(m), _) => m.logits(ids, None),
                (Model::EncoderDecoder(m), Some((mem, pad))) => m.logits(mem.clone(), pad, ids),
                _ => unreachable!(),
            };
            // Every position's argmax, read at each row's last prompt token.
            let [_, width, _] = logits.dims();
            let best = best_tokens(logits);
            for (i, prompt) in prompts.iter_mut().enumerate() {
                let next = best[i * width + prompt.len() - 1];
                prompt.push(next);
                if !done[i] {
                    if next == EOS {
                        done[i] = true;
                    } else {
                        outputs[i].push(next);
                    }
                }
            }
            if done.iter().all(|&d| d) {
                break;
            }
        }
        outputs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;
    use crate::model::{ModelConfig, ModelKind, PositionKind};
    use crate::tasks::{Split, TaskConfig};

    #[test]
    fn decoding_with_a_cache_or_padding_changes_no_output_or_loss() {
        // Examples up to 6 long, padded to the shape of examples up to 9 long.
        let task = TaskConfig {
            min_len: 3,
            max_len: 9,
            ..TaskConfig::default()
        };
        let fixed = FixedShape::of(&task);
        let short = TaskConfig {
            max_len: 6,
            ..task.clone()
        };
        let examples: Vec<_> = (0..12).map(|i| short.example(5, Split::Valid, i)).collect();
        let inputs: Vec<Vec<usize>> = examples.iter().map(|e| e.input.clone()).collect();
        for backend in Backend::compiled() {
            let device = backend.device().unwrap();
            let kinds = [ModelKind::DecoderOnly, ModelKind::EncoderDecoder];
            let all = [
                PositionKind::Learned,
                PositionKind::Sinusoidal,
                PositionKind::Rope,
                PositionKind::Alibi,
                PositionKind::Relative,
                PositionKind::T5,
            ];
            for (kind, positions) in kinds.into_iter().flat_map(|k| all.map(|p| (k, p))) {
                let max_len = task.max_input() + task.max_output() + 2;
                let config = ModelConfig {
                    kind,
                    d_model: 32,
                    positions,
                    ..ModelConfig::default()
                };
                let what = format!("{backend} {kind:?} {positions:?}");
                // An untrained model whose outputs run to the length limit, so that every
                // step is compared: the first seed that gives one.
                let (model, cached) = (3..20)
                    .map(|seed| {
                        device.seed(seed);
                        let model = config.init(task.vocab_size(), max_len, &device).unwrap();
                        let cached = model.generate(&inputs, task.max_output(), None, &device);
                        (model, cached)
                    })
                    .find(|(_, cached)| cached.iter().any(|o| o.len() == task.max_output() + 1))
                    .unwrap_or_else(|| panic!("{what}: no seed gives a long output"));
                let padded = model.generate(&inputs, task.max_output(), Some(fixed), &device);
                assert_eq!(cached, padded, "{what}: generate with fixed reads");
                let free = model.generate_recomputed(&inputs, task.max_output(), None, &device);
                assert_eq!(cached, free, "{what}: generate without a cache");
                let whole = |f| model.generate_recomputed(&inputs, task.max_output(), f, &device);
                assert_eq!(
                    cached,
                    whole(Some(fixed)),
                    "{what}: without a cache, padded"
                );
                let loss = |fixed| {
                    use burn::data::dataloader::batcher::Batcher;
                    let batch = crate::batch::SeqBatcher { fixed, pack: None }
                        .batch(examples.clone(), &device);
                    let out = model.forward_loss(batch);
                    (out.loss.into_scalar::<f32>(), out.targets.dims())
                };
                let ((free, free_dims), (padded, padded_dims)) = (loss(None), loss(Some(fixed)));
                let width = match kind {
                    ModelKind::DecoderOnly => fixed.joined(),
                    ModelKind::EncoderDecoder => fixed.output + 1,
                };
                assert_eq!(padded_dims, [12, width], "{what}: padded width");
                assert!(free_dims[1] < width, "{what}: the batch was not padded");
                assert!(
                    (free - padded).abs() <= 1e-5 * free.abs(),
                    "{what}: loss {free} unpadded, {padded} padded"
                );
            }
        }
    }
}
