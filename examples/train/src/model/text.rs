//! Decoding the text task's language model: a prompt read once, then one character per
//! step against a key/value cache per layer ([`TextDecoder`]), and the same logits
//! computed without a cache, the whole context read again at every step
//! ([`recomputed_logits`], the reference the cache is tested against).
//!
//! A model reads at most `block` characters, what it was trained on. With learned
//! positions (the default, nanoGPT's), there are no positions past the block: once the
//! text is longer, the decoder starts over from the last `block / 2` characters (rounded
//! up), read again as positions `0..`, and goes on from there one character at a time
//! until the block is full again (nanoGPT crops to the last `block` characters and reads
//! them all at every step; here one step in `block / 2` reads again). With positions that
//! read any length (sinusoidal, rope, alibi, relative, t5), the cache is a sliding one
//! ([`KvCache::sliding`]): each position attends to the last `block` positions, itself
//! included, whatever the length, and nothing is read twice.

use burn::tensor::{Device, Tensor};
use mha::{AttentionMask, KvCache, StackCache, StackInput};

use super::{DecoderOnly, Model, uncached};
use crate::batch::padded;

/// Where the model's context starts once `len` characters are read, `fed` of them in the
/// last call, when it started at `start`: the same start while the context holds at most
/// `block`; else, for a read of several characters (a prompt), the last `block` of them,
/// and for one character, the last `block / 2` (rounded up).
pub fn context_start(start: usize, len: usize, fed: usize, block: usize) -> usize {
    match len - start <= block {
        true => start,
        false if fed > 1 => len - block,
        false => len - block.div_ceil(2),
    }
}

/// A text being decoded: how many characters were read, the context the model sees, and
/// its cache. What it holds is bounded by the block whatever the length of the text.
pub struct TextDecoder<'a> {
    model: &'a DecoderOnly,
    block: usize,
    /// Positions past the block are read through a sliding cache (all but learned).
    sliding: bool,
    cache: StackCache,
    /// The characters of the context (the cache's position 0 first), as ids; empty with a
    /// sliding cache, which needs none of them again.
    context: Vec<usize>,
    /// Characters read so far.
    read: usize,
    device: Device,
}

impl<'a> TextDecoder<'a> {
    /// A decoder of `model` (the text task's: decoder-only) over contexts of `block`.
    ///
    /// # Panics
    /// If `model` is the encoder-decoder, or `block` is 0.
    pub fn new(model: &'a Model, block: usize, device: &Device) -> Self {
        let Model::DecoderOnly(model) = model else {
            panic!("the text task's model is decoder-only");
        };
        assert!(block > 0, "a block of 0 characters");
        let sliding = model.embed.kind.reads_longer_inputs();
        let cache = match sliding {
            true => KvCache::sliding(block),
            false => KvCache::new(block),
        };
        Self {
            cache: model.blocks.cache(cache),
            model,
            block,
            sliding,
            context: Vec::new(),
            read: 0,
            device: device.clone(),
        }
    }

    /// How many characters were read so far.
    pub fn read(&self) -> usize {
        self.read
    }

    /// Reads `ids` (at least one) after the text so far: the logits of the next
    /// character, one per character of the vocabulary. A sliding model reads a long input
    /// a block at a time (the same logits as in one pass, in memory bounded by the
    /// block); a model with learned positions reads at most the last block of it.
    ///
    /// # Panics
    /// If `ids` is empty.
    pub fn feed(&mut self, ids: &[usize]) -> Vec<f32> {
        assert!(!ids.is_empty(), "nothing to read");
        if self.sliding {
            let mut chunks = ids.chunks(self.block).peekable();
            while let Some(chunk) = chunks.next() {
                let positions: Vec<usize> = (self.read..self.read + chunk.len()).collect();
                self.read += chunk.len();
                let h = self.forward(chunk, positions);
                if chunks.peek().is_none() {
                    return last_logits(self.model, h);
                }
            }
            unreachable!("at least one chunk");
        }
        self.read += ids.len();
        self.context.extend_from_slice(ids);
        let len = self.context.len();
        let mut first = len - ids.len();
        let start = context_start(0, len, ids.len(), self.block);
        if start != 0 {
            self.context.drain(..start);
            self.cache.reset();
            first = 0;
        }
        let read = self.context[first..].to_vec();
        let positions: Vec<usize> = (first..self.context.len()).collect();
        let h = self.forward(&read, positions);
        last_logits(self.model, h)
    }

    /// The hidden states `[1, T, D]` of `ids` read at `positions` after the cache.
    fn forward(&mut self, ids: &[usize], positions: Vec<usize>) -> Tensor<3> {
        let x = self
            .model
            .embed
            .forward_at(padded(&[ids.to_vec()], None, &self.device), &[positions]);
        let input = StackInput::new(x).cache(&mut self.cache);
        self.model
            .blocks
            .forward(input)
            .expect("the context never outgrows the cache")
            .output
    }
}

/// The logits of the last position of the hidden states `h` `[1, T, D]`, on the host.
fn last_logits(model: &DecoderOnly, h: Tensor<3>) -> Vec<f32> {
    let len = h.dims()[1];
    model
        .head(h.narrow(1, len - 1, 1))
        .into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("f32 logits")
}

/// The logits [`TextDecoder::feed`] gives after each call of `calls` (each a list of ids
/// read after the previous ones), computed without a cache: at every call, the whole
/// context read again from its first character (for a sliding model, the whole text with
/// the sliding window as its mask).
pub fn recomputed_logits(
    model: &Model,
    calls: &[Vec<usize>],
    block: usize,
    device: &Device,
) -> Vec<Vec<f32>> {
    let Model::DecoderOnly(model) = model else {
        panic!("the text task's model is decoder-only");
    };
    let sliding = model.embed.kind.reads_longer_inputs();
    let (mut text, mut start) = (Vec::new(), 0);
    calls
        .iter()
        .map(|ids| {
            text.extend_from_slice(ids);
            if !sliding {
                start = context_start(start, text.len(), ids.len(), block);
            }
            let x = model
                .embed
                .forward(padded(&[text[start..].to_vec()], None, device));
            let mask = match sliding {
                true => AttentionMask::sliding_window(block),
                false => AttentionMask::none(),
            };
            let h = uncached(model.blocks.forward(StackInput::new(x).mask(mask))).output;
            last_logits(model, h)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;
    use crate::lm::{Sampler, argmax};
    use crate::model::{ModelConfig, PositionKind};

    #[test]
    fn the_context_starts_over_past_the_block() {
        assert_eq!(context_start(0, 8, 8, 8), 0);
        assert_eq!(context_start(0, 9, 1, 8), 5, "the last 4 of 9");
        assert_eq!(context_start(5, 12, 1, 8), 5);
        assert_eq!(context_start(5, 13, 1, 8), 5);
        assert_eq!(context_start(5, 14, 1, 8), 10);
        assert_eq!(
            context_start(0, 20, 20, 8),
            12,
            "a long prompt: its last block"
        );
        assert_eq!(context_start(0, 2, 1, 1), 1);
    }

    /// The largest difference between two lists of logits.
    fn worst(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    }

    #[test]
    fn cached_and_recomputed_decoding_give_the_same_logits_past_the_block() {
        let (vocab, block) = (11, 8);
        for backend in Backend::compiled() {
            let _turn = crate::backend::gpu_turn(backend);
            let device = backend.device().unwrap();
            for positions in [
                PositionKind::Learned,
                PositionKind::Sinusoidal,
                PositionKind::Rope,
                PositionKind::Alibi,
            ] {
                device.seed(3);
                let config = ModelConfig {
                    d_model: 32,
                    positions,
                    ..ModelConfig::default()
                };
                let model = config.init_language_model(vocab, block, &device).unwrap();
                // A prompt of 5, then 19 characters one at a time (past two blocks),
                // each the greedy choice: temperature 0 equals argmax decoding.
                let mut decoder = TextDecoder::new(&model, block, &device);
                let mut greedy = Sampler::new(0.0, None, 1).unwrap();
                let mut calls = vec![vec![1, 4, 1, 5, 9]];
                let mut cached = vec![decoder.feed(&calls[0])];
                for _ in 0..19 {
                    let next = greedy.pick(cached.last().unwrap());
                    assert_eq!(next, argmax(cached.last().unwrap()));
                    calls.push(vec![next]);
                    cached.push(decoder.feed(&[next]));
                    // What it holds stays within the block however long the text grows.
                    assert!(decoder.context.len() <= block);
                }
                assert_eq!(decoder.read(), 24);
                let recomputed = recomputed_logits(&model, &calls, block, &device);
                for (step, (a, b)) in cached.iter().zip(&recomputed).enumerate() {
                    assert_eq!(a.len(), vocab);
                    let worst = worst(a, b);
                    assert!(
                        worst <= 1e-4,
                        "{backend} {positions:?}: step {step}: logits differ by {worst}"
                    );
                }
                // A prompt longer than the block: its last block (learned positions), or
                // a block at a time (a sliding model: 20 is two blocks and a half).
                let long: Vec<usize> = (0..20).map(|i| i % vocab).collect();
                let mut decoder = TextDecoder::new(&model, block, &device);
                let calls = [long, vec![3], vec![7], vec![2]];
                let cached: Vec<Vec<f32>> = calls.iter().map(|ids| decoder.feed(ids)).collect();
                assert_eq!(decoder.read(), 23);
                let again = recomputed_logits(&model, &calls, block, &device);
                for (step, (a, b)) in cached.iter().zip(&again).enumerate() {
                    let worst = worst(a, b);
                    assert!(
                        worst <= 1e-4,
                        "{backend} {positions:?}: long prompt, step {step}: {worst}"
                    );
                }
            }
        }
    }
}
