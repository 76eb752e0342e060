//! The encoder-decoder transformer: the encoder reads the input, the decoder writes
//! `SEP output` while cross-attending to it.

use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{Int, Tensor};
use mha::{AttentionMask, Decoder, Encoder};

use super::Embed;

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
        let memory = self.encoder.forward(self.embed.forward(source), &padding);
        (memory, padding)
    }

    /// Logits `[B, U, V]` of the decoder reading `decoder_input` `[B, U]`.
    pub(super) fn logits(
        &self,
        memory: Tensor<3>,
        padding: &AttentionMask,
        decoder_input: Tensor<2, Int>,
    ) -> Tensor<3> {
        let x = self.embed.forward(decoder_input);
        self.head.forward(
            self.decoder
                .forward(x, memory, &AttentionMask::none(), padding),
        )
    }
}
