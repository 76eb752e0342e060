//! The decoder-only transformer: token and position embeddings, N causal blocks, a
//! final norm and the LM head, reading `input SEP output` (or, for the text task, a
//! window of characters, the head tied to the token embedding as in GPT-2); and how it
//! decodes: the prompts `input SEP` once, then one token per step.

use burn::module::Module;
use burn::nn::{DropoutConfig, Linear};
use burn::tensor::{Device, Int, Tensor, TensorData};
use mha::{AttentionMask, Encoder, StackCache, StackInput};

use super::decode::{Decode, ROOM, kv_cache};
use super::{Embed, uncached};
use crate::batch::{FixedShape, Packed, padded};
use crate::tasks::{PAD, SEP};

/// Decoder-only transformer.
#[derive(Module, Debug)]
pub struct DecoderOnly {
    /// Tokens and absolute positions.
    pub(super) embed: Embed,
    /// Causal blocks and the final norm.
    pub(super) blocks: Encoder,
    /// The LM head: a logit per token of the vocabulary; `None` when it is tied to the
    /// token embedding (logits `h · E^T`, the text task's language model).
    pub(super) head: Option<Linear>,
    /// Dropout on the embeddings, in training (the text task's, as nanoGPT's).
    #[module(skip)]
    pub(super) embed_dropout: f64,
    /// How its optimizer steps run (see [`Model::with_stepping`](super::Model::with_stepping)).
    #[module(skip)]
    pub(super) stepping: super::Stepping,
}

impl DecoderOnly {
    /// `[B, T]` -> logits `[B, T, V]`; with `packed`, each row holds several sequences,
    /// which attend only within themselves, their positions starting at each one's first
    /// token.
    pub(super) fn logits(&self, ids: Tensor<2, Int>, packed: Option<&Packed>) -> Tensor<3> {
        let (x, mask) = match packed {
            None => (self.embed.forward(ids), AttentionMask::none()),
            Some(packed) => (
                self.embed.forward_at(ids, &packed.positions),
                AttentionMask::packed(&packed.cu_seqlens),
            ),
        };
        let input = StackInput::new(self.drop(x)).mask(mask);
        self.head(uncached(self.blocks.forward(input)).output)
    }

    /// The embeddings with their dropout (in training, when the model has one).
    pub(super) fn drop(&self, x: Tensor<3>) -> Tensor<3> {
        match self.embed_dropout > 0.0 {
            true => mha::dropout::forward(&DropoutConfig::new(self.embed_dropout).init(), x),
            false => x,
        }
    }

    /// The logits `[B, T, V]` of the final hidden states `[B, T, D]`: the head's, or
    /// with a tied head, `h · E^T` against the token embedding `E` `[V, D]`.
    pub(super) fn head(&self, h: Tensor<3>) -> Tensor<3> {
        match &self.head {
            Some(head) => head.forward(h),
            // One product each way through mha's linear operation, the table read in
            // place (a matmul on flex writes its result twice).
            None => mha::linear::linear(h, self.embed.tokens.weight.val().transpose(), None),
        }
    }
}

/// The prompt an output continues: `input SEP`.
pub(super) fn prompt(input: &[usize]) -> Vec<usize> {
    input.iter().copied().chain([SEP]).collect()
}

/// What the decoder-only model keeps between decoding steps.
pub struct DecoderOnlyCache {
    /// Every block's keys and values so far.
    layers: StackCache,
    /// The PAD tokens on the left of each row's prompt.
    pads: Vec<usize>,
    /// The position of each row's next token (counted from its first real token).
    next: Vec<usize>,
    device: Device,
}

impl DecoderOnlyCache {
    /// The mask of the left padding over `keys` keys: keys `0..pads[b]` of row `b` are
    /// padding, over every key a call sees; no mask at all when the prompts have one
    /// length (the evaluation groups them so).
    fn padding(&self, keys: usize) -> AttentionMask {
        if self.pads.iter().all(|&n| n == 0) {
            return AttentionMask::none();
        }
        let blocked: Vec<bool> = self
            .pads
            .iter()
            .flat_map(|&n| (0..keys).map(move |j| j < n))
            .collect();
        let blocked = TensorData::new(blocked, [self.pads.len(), keys]);
        AttentionMask::key_padding(Tensor::from_data(blocked, &self.device))
    }
}

impl Decode for DecoderOnly {
    type Cache = DecoderOnlyCache;

    /// The prompts `input SEP`, left-padded to the longest (or to the fixed shape's), run
    /// at once; each row's positions start at its first real token.
    fn prefill(
        &self,
        inputs: &[Vec<usize>],
        max_output: usize,
        fixed: Option<FixedShape>,
        device: &Device,
    ) -> (DecoderOnlyCache, Tensor<3>) {
        let prompts: Vec<Vec<usize>> = inputs.iter().map(|i| prompt(i)).collect();
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let width = fixed.map_or(longest, |f| longest.max(f.input + 1));
        let pads: Vec<usize> = prompts.iter().map(|p| width - p.len()).collect();
        let left_padded: Vec<Vec<usize>> = prompts
            .iter()
            .zip(&pads)
            .map(|(p, &n)| {
                std::iter::repeat_n(PAD, n)
                    .chain(p.iter().copied())
                    .collect()
            })
            .collect();
        let positions: Vec<Vec<usize>> = pads
            .iter()
            .map(|&n| (0..width).map(|t| t.saturating_sub(n)).collect())
            .collect();
        let mut cache = DecoderOnlyCache {
            layers: self.blocks.cache(kv_cache(width + max_output + 1, fixed)),
            pads,
            next: prompts.iter().map(Vec::len).collect(),
            device: device.clone(),
        };
        let x = self
            .embed
            .forward_at(padded(&left_padded, None, device), &positions);
        let mask = cache.padding(cache.layers.layers()[0].keys_seen(width));
        let input = StackInput::new(x).mask(mask).cache(&mut cache.layers);
        let h = self.blocks.forward(input).expect(ROOM).output;
        let logits = self.head(h.narrow(1, width - 1, 1));
        (cache, logits)
    }

    fn step(&self, cache: &mut DecoderOnlyCache, tokens: &[usize]) -> Tensor<3> {
        let rows: Vec<Vec<usize>> = tokens.iter().map(|&t| vec![t]).collect();
        let positions: Vec<Vec<usize>> = cache.next.iter().map(|&p| vec![p]).collect();
        cache.next.iter_mut().for_each(|p| *p += 1);
        let x = self
            .embed
            .forward_at(padded(&rows, None, &cache.device), &positions);
        let mask = cache.padding(cache.layers.layers()[0].keys_seen(1));
        let input = StackInput::new(x).mask(mask).cache(&mut cache.layers);
        self.head(self.blocks.forward(input).expect(ROOM).output)
    }
}
