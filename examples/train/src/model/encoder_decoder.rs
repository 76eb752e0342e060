//! The encoder-decoder transformer: the encoder reads the input, the decoder writes
//! `SEP output` while cross-attending to it; and how it decodes: the input encoded once
//! (and its keys and values projected once per layer), then one token per step.

use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{Device, Int, Tensor};
use mha::{AttentionMask, Decoder, Encoder, StackCache, StackInput};

use super::decode::{Decode, ROOM, kv_cache};
use super::{Embed, uncached};
use crate::batch::{FixedShape, padded};
use crate::tasks::SEP;

/// Encoder-decoder transformer.
#[derive(Module, Debug)]
pub struct EncoderDecoder {
    /// Tokens and absolute positions, of the input and of the output alike.
    pub(super) embed: Embed,
    /// Reads the input.
    pub(super) encoder: Encoder,
    /// Writes the output: causal self-attention, cross-attention to the encoder's output.
    pub(super) decoder: Decoder,
    /// The LM head: a logit per token of the vocabulary.
    pub(super) head: Linear,
    /// How its optimizer steps run (see [`Model::with_stepping`](super::Model::with_stepping)).
    #[module(skip)]
    pub(super) stepping: super::Stepping,
}

impl EncoderDecoder {
    /// The encoder's output `[B, S, d_model]` for the right-padded inputs `source`
    /// `[B, S]` of `lengths` real tokens, and the mask of their padding.
    pub(super) fn encode(
        &self,
        source: Tensor<2, Int>,
        lengths: &[usize],
    ) -> (Tensor<3>, AttentionMask) {
        let [_, len] = source.dims();
        let padding = AttentionMask::key_lengths(lengths, len, &source.device());
        let input = StackInput::new(self.embed.forward(source)).mask(padding.clone());
        (uncached(self.encoder.forward(input)).output, padding)
    }

    /// Logits `[B, U, V]` of the decoder reading `decoder_input` `[B, U]`.
    pub(super) fn logits(
        &self,
        memory: Tensor<3>,
        padding: &AttentionMask,
        decoder_input: Tensor<2, Int>,
    ) -> Tensor<3> {
        let x = self.embed.forward(decoder_input);
        let input = StackInput::new(x)
            .memory(memory)
            .memory_mask(padding.clone());
        self.head
            .forward(uncached(self.decoder.forward(input)).output)
    }
}

/// What the encoder-decoder model keeps between decoding steps.
pub struct EncoderDecoderCache {
    /// Every block's self-attention keys and values so far, and its cross-attention's of
    /// the encoded input.
    layers: StackCache,
    /// The mask of the inputs' padding.
    padding: AttentionMask,
    /// The position of the next token, the same in every row.
    next: usize,
    device: Device,
}

impl Decode for EncoderDecoder {
    type Cache = EncoderDecoderCache;

    /// The inputs, right-padded to the longest (or to the fixed shape's), encoded at
    /// once; then SEP, the decoder's first token.
    fn prefill(
        &self,
        inputs: &[Vec<usize>],
        max_output: usize,
        fixed: Option<FixedShape>,
        device: &Device,
    ) -> (EncoderDecoderCache, Tensor<3>) {
        let lengths: Vec<usize> = inputs.iter().map(Vec::len).collect();
        let source = padded(inputs, fixed.map(|f| f.input), device);
        let (memory, padding) = self.encode(source, &lengths);
        let mut cache = EncoderDecoderCache {
            layers: self.decoder.cache(memory, kv_cache(max_output + 1, fixed)),
            padding,
            next: 0,
            device: device.clone(),
        };
        let logits = self.step(&mut cache, &vec![SEP; inputs.len()]);
        (cache, logits)
    }

    fn step(&self, cache: &mut EncoderDecoderCache, tokens: &[usize]) -> Tensor<3> {
        let rows: Vec<Vec<usize>> = tokens.iter().map(|&t| vec![t]).collect();
        let positions = vec![vec![cache.next]; tokens.len()];
        cache.next += 1;
        let x = self
            .embed
            .forward_at(padded(&rows, None, &cache.device), &positions);
        let input = StackInput::new(x)
            .memory_mask(cache.padding.clone())
            .cache(&mut cache.layers);
        self.head
            .forward(self.decoder.forward(input).expect(ROOM).output)
    }
}
