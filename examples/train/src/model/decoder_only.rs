//! The decoder-only transformer: token and position embeddings, N causal blocks, a
//! final norm and the LM head, reading `input SEP output`.

use burn::module::Module;
use burn::nn::Linear;
use burn::tensor::{Int, Tensor};
use mha::{AttentionMask, Encoder};

use super::Embed;
use crate::batch::Packed;

/// Decoder-only transformer.
#[derive(Module, Debug)]
pub struct DecoderOnly {
    /// Tokens and absolute positions.
    pub(super) embed: Embed,
    /// Causal blocks and the final norm.
    pub(super) blocks: Encoder,
    /// The LM head: a logit per token of the vocabulary.
    pub(super) head: Linear,
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
        self.head.forward(self.blocks.forward(x, &mask))
    }
}
