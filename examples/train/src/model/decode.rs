//! Greedy decoding: each row's most likely next token, until EOS or `max_output + 1`
//! tokens. One loop, [`greedy`], picks the tokens; the logits come from a model kind's
//! [`Decode`] (the prompts read once, then one token per step against a key/value
//! cache), or, in the reference the cache is tested against
//! ([`Model::generate_recomputed`]), from the whole prefix read again at every step.

use burn::tensor::{Device, Int, Tensor, TensorData};
use mha::KvCache;

use super::Model;
use super::decoder_only::prompt;
use crate::batch::{FixedShape, padded};
use crate::tasks::{EOS, SEP};

/// Why a cached step cannot fail: the cache is made for the prompt and every output token.
pub(super) const ROOM: &str = "the cache holds the prompt and every output token";

/// A model kind's side of greedy decoding with a key/value cache.
pub trait Decode {
    /// What decoding keeps between steps: every layer's keys and values so far, and
    /// where each row is.
    type Cache;

    /// Reads `inputs` (`B` rows) and the SEP that starts each output: the cache, with room
    /// for `max_output + 1` more tokens, and the logits `[B, 1, V]` of each row's first
    /// output token. With `fixed`, the inputs are padded to that shape and every step
    /// reads the whole cache ([`KvCache::fixed_reads`]): one shape for every step.
    fn prefill(
        &self,
        inputs: &[Vec<usize>],
        max_output: usize,
        fixed: Option<FixedShape>,
        device: &Device,
    ) -> (Self::Cache, Tensor<3>);

    /// Reads `tokens`, one per row: the logits `[B, 1, V]` of each row's next token.
    fn step(&self, cache: &mut Self::Cache, tokens: &[usize]) -> Tensor<3>;

    /// Greedy decoding of `inputs`: see [`Model::generate`].
    fn generate(
        &self,
        inputs: &[Vec<usize>],
        max_output: usize,
        fixed: Option<FixedShape>,
        device: &Device,
    ) -> Vec<Vec<usize>> {
        let (mut cache, first) = self.prefill(inputs, max_output, fixed, device);
        greedy(first, max_output, |tokens| self.step(&mut cache, tokens))
    }
}

/// A cache of `capacity` positions; with a fixed shape, one whose every read is the
/// whole cache.
pub(super) fn kv_cache(capacity: usize, fixed: Option<FixedShape>) -> KvCache {
    match fixed {
        None => KvCache::new(capacity),
        Some(_) => KvCache::new(capacity).fixed_reads(),
    }
}

/// The loop of greedy decoding. From `logits` `[B, 1, V]`, takes each row's most likely
/// token, which ends the row's output if it is EOS; while a row goes on and no row has
/// `max_output + 1` tokens, `next` reads every row's token and gives the next logits.
/// Returns each output without EOS.
pub fn greedy(
    mut logits: Tensor<3>,
    max_output: usize,
    mut next: impl FnMut(&[usize]) -> Tensor<3>,
) -> Vec<Vec<usize>> {
    let batch = logits.dims()[0];
    let mut outputs = vec![Vec::new(); batch];
    let mut done = vec![false; batch];
    for step in 0..=max_output {
        let tokens = best_tokens(logits);
        for (i, &token) in tokens.iter().enumerate() {
            if !done[i] {
                match token == EOS {
                    true => done[i] = true,
                    false => outputs[i].push(token),
                }
            }
        }
        if step == max_output || done.iter().all(|&d| d) {
            break;
        }
        logits = next(&tokens);
    }
    outputs
}

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
        match self {
            Model::DecoderOnly(m) => m.generate(inputs, max_output, fixed, device),
            Model::EncoderDecoder(m) => m.generate(inputs, max_output, fixed, device),
        }
    }

    /// Greedy decoding that runs the whole prefix at every step, without a cache (the
    /// reference [`generate`](Self::generate) is tested against). Inputs may differ in
    /// length: rows are right-padded, which neither the causal self-attention nor the
    /// padded cross-attention lets a real position see. With `fixed`, every forward pass
    /// has that one shape; without, each step reads the shortest width that fits.
    pub fn generate_recomputed(
        &self,
        inputs: &[Vec<usize>],
        max_output: usize,
        fixed: Option<FixedShape>,
        device: &Device,
    ) -> Vec<Vec<usize>> {
        match self {
            Model::DecoderOnly(m) => {
                let prompts = inputs.iter().map(|i| prompt(i)).collect();
                let width = fixed.map(FixedShape::joined);
                reread(prompts, width, max_output, device, |ids| {
                    m.logits(ids, None)
                })
            }
            Model::EncoderDecoder(m) => {
                let lengths: Vec<usize> = inputs.iter().map(Vec::len).collect();
                let source = padded(inputs, fixed.map(|f| f.input), device);
                let (memory, padding) = m.encode(source, &lengths);
                let prompts = vec![vec![SEP]; inputs.len()];
                let width = fixed.map(|f| f.output + 1);
                reread(prompts, width, max_output, device, |ids| {
                    m.logits(memory.clone(), &padding, ids)
                })
            }
        }
    }
}

/// [`greedy`] on `prompts` read whole at every step, right-padded to `width` (at least
/// the longest), by `logits`: prompts `[B, T]` -> logits `[B, T, V]`.
fn reread(
    mut prompts: Vec<Vec<usize>>,
    width: Option<usize>,
    max_output: usize,
    device: &Device,
    logits: impl Fn(Tensor<2, Int>) -> Tensor<3>,
) -> Vec<Vec<usize>> {
    // The logits `[B, 1, V]` at each row's last prompt token.
    let read = |prompts: &[Vec<usize>]| {
        let all = logits(padded(prompts, width, device));
        let [batch, t, v] = all.dims();
        let last: Vec<i64> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| (i * t + p.len() - 1) as i64)
            .collect();
        let last = Tensor::<1, Int>::from_data(TensorData::new(last, [batch]), device);
        all.reshape([batch * t, v])
            .select(0, last)
            .reshape([batch, 1, v])
    };
    let first = read(&prompts);
    greedy(first, max_output, |tokens| {
        for (prompt, &token) in prompts.iter_mut().zip(tokens) {
            prompt.push(token);
        }
        read(&prompts)
    })
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
            let _turn = crate::backend::gpu_turn(backend);
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
                    let batch = crate::batch::SeqBatcher {
                        fixed,
                        ..Default::default()
                    }
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

    #[test]
    fn greedy_stops_each_row_at_eos_and_all_at_the_limit() {
        let backend = Backend::compiled()[0];
        let _turn = crate::backend::gpu_turn(backend);
        let device = backend.device().unwrap();
        // Logits `[B, 1, V]` whose most likely token is each row's in `tokens`.
        let logits = |tokens: &[usize]| {
            let v = 8;
            let mut data = vec![0.0f32; tokens.len() * v];
            for (i, &t) in tokens.iter().enumerate() {
                data[i * v + t] = 1.0;
            }
            Tensor::<3>::from_data(TensorData::new(data, [tokens.len(), 1, v]), &device)
        };
        // The tokens of steps 0 to 3 (rows across): row 0 ends at once, row 1 after two
        // tokens, row 2 never and stops at `max_output + 1` = 4 tokens.
        let script = [[EOS, 4, 5], [6, 5, 6], [6, EOS, 6], [6, 6, 6]];
        let mut reads = Vec::new();
        let outputs = greedy(logits(&script[0]), 3, |tokens| {
            reads.push(tokens.to_vec());
            logits(&script[reads.len()])
        });
        assert_eq!(outputs, vec![vec![], vec![4, 5], vec![5, 6, 6, 6]]);
        assert_eq!(reads.len(), 3, "no read after the last token");
        assert_eq!(
            reads[0], script[0],
            "every row's token is read, ended or not"
        );
        // Every row ended: no more reads.
        let mut calls = 0;
        let outputs = greedy(logits(&[EOS, EOS]), 5, |_| {
            calls += 1;
            logits(&[4, 4])
        });
        assert_eq!((outputs, calls), (vec![vec![], vec![]], 0));
    }
}
