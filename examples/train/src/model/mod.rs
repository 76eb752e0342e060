//! Two small transformers built only from `mha` modules:
//! - decoder-only: token + position embeddings, N causal blocks, final norm, LM head,
//!   reading `input SEP output`;
//! - encoder-decoder: the encoder reads the input, the decoder writes `output` while
//!   cross-attending to it.
//!
//! The loss counts only output tokens (and the closing EOS).
//!
//! Each kind in its own file ([`decoder_only`], [`encoder_decoder`]) with its
//! embeddings ([`embed`]); greedy decoding in [`decode`], looking inside in [`inspect`].

pub mod decode;
pub mod decoder_only;
pub mod embed;
pub mod encoder_decoder;
pub mod inspect;

use burn::module::Module;
use burn::nn::{EmbeddingConfig, LinearConfig};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Device, FloatDType, Int, Tensor};
use burn::train::{InferenceStep, SequenceOutput, TrainOutput, TrainStep};
use mha::{
    BlockOutput, CacheError, DecoderBlockConfig, DecoderConfig, EncoderBlockConfig, EncoderConfig,
    Positions,
};
use serde::{Deserialize, Serialize};

pub use decoder_only::DecoderOnly;
pub use embed::Embed;
pub use encoder_decoder::EncoderDecoder;

use crate::batch::SeqBatch;
use crate::fields::{D_MODEL, DROPOUT, N_HEADS, N_LAYERS};
use crate::precision::{compute_copy, unscale};
use crate::tasks::PAD;

/// Which model; spelt in `config.json` as on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ModelKind {
    /// Causal blocks over `input SEP output`.
    DecoderOnly,
    /// An encoder over the input and a decoder with cross-attention.
    EncoderDecoder,
}

impl<'de> Deserialize<'de> for ModelKind {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        crate::fields::by_name(deserializer, "model")
    }
}

impl ModelKind {
    /// Its name, as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            ModelKind::DecoderOnly => "decoder-only",
            ModelKind::EncoderDecoder => "encoder-decoder",
        }
    }
}

/// How the model knows where tokens are; spelt in `config.json` as on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PositionKind {
    /// A learned embedding per position, added to the tokens' (up to the longest training
    /// sequence: longer inputs cannot be read).
    Learned,
    /// Sinusoids added to the tokens' embeddings.
    Sinusoidal,
    /// Rotary embeddings of the queries and keys in every self-attention.
    Rope,
    /// ALiBi: a bias by distance, a slope per head, no parameters.
    Alibi,
    /// A learned bias per head and distance, distances beyond 16 clipped.
    Relative,
    /// T5's learned bias per head and log-spaced bucket of the distance.
    T5,
}

impl<'de> Deserialize<'de> for PositionKind {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        crate::fields::by_name(deserializer, "positions")
    }
}

impl PositionKind {
    /// Its name, as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            PositionKind::Learned => "learned",
            PositionKind::Sinusoidal => "sinusoidal",
            PositionKind::Rope => "rope",
            PositionKind::Alibi => "alibi",
            PositionKind::Relative => "relative",
            PositionKind::T5 => "t5",
        }
    }

    /// The positions attention applies itself, in a stack that attends to later tokens
    /// too (`bidirectional`) or not; none for the absolute kinds, which the model adds to
    /// its embeddings.
    fn attention(self, bidirectional: bool) -> Positions {
        match self {
            PositionKind::Learned | PositionKind::Sinusoidal => Positions::None,
            PositionKind::Rope => Positions::rope(),
            PositionKind::Alibi => Positions::Alibi,
            PositionKind::Relative => Positions::Relative { max_distance: 16 },
            PositionKind::T5 => Positions::t5(bidirectional),
        }
    }

    /// Whether the model reads inputs longer than those it was built for.
    pub fn reads_longer_inputs(self) -> bool {
        self != PositionKind::Learned
    }
}

/// The model's shape.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    /// Which model. Default: decoder-only.
    pub kind: ModelKind,
    /// Width. Default: 64.
    pub d_model: usize,
    /// Blocks (in each stack of the encoder-decoder). Default: 2.
    pub n_layers: usize,
    /// Attention heads. Default: 4.
    pub n_heads: usize,
    /// Dropout in the blocks. Default: 0.
    pub dropout: f64,
    /// How the model knows where tokens are. Default: sinusoidal (the best of the six on
    /// the default task: docs/benchmarks.md, "Positions on the default task").
    pub positions: PositionKind,
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            kind: ModelKind::DecoderOnly,
            d_model: 64,
            n_layers: 2,
            n_heads: 4,
            dropout: 0.0,
            positions: PositionKind::Sinusoidal,
        }
    }
}

impl ModelConfig {
    /// Checks the values before anything is built or written; the error names the flag
    /// and the field.
    pub fn validate(&self) -> anyhow::Result<()> {
        for (field, value) in [
            (D_MODEL, self.d_model),
            (N_LAYERS, self.n_layers),
            (N_HEADS, self.n_heads),
        ] {
            anyhow::ensure!(value >= 1, "{} must be at least 1, got 0", field.name());
        }
        anyhow::ensure!(
            self.d_model.is_multiple_of(self.n_heads),
            "{} = {} is not divisible by {} = {}",
            D_MODEL.name(),
            self.d_model,
            N_HEADS.name(),
            self.n_heads
        );
        anyhow::ensure!(
            (0.0..1.0).contains(&self.dropout),
            "{} must be in [0, 1), got {}",
            DROPOUT.name(),
            self.dropout
        );
        Ok(())
    }

    /// Builds the model for a vocabulary of `vocab` tokens and sequences up to `max_len`.
    pub fn init(&self, vocab: usize, max_len: usize, device: &Device) -> anyhow::Result<Model> {
        let embed = Embed {
            tokens: EmbeddingConfig::new(vocab, self.d_model).init(device),
            positions: (self.positions == PositionKind::Learned)
                .then(|| EmbeddingConfig::new(max_len, self.d_model).init(device)),
            kind: self.positions,
        };
        let head = LinearConfig::new(self.d_model, vocab).init(device);
        let block = |bidirectional| {
            EncoderBlockConfig::new(self.d_model, self.n_heads)
                .with_dropout(self.dropout)
                .with_positions(self.positions.attention(bidirectional))
        };
        Ok(match self.kind {
            ModelKind::DecoderOnly => Model::DecoderOnly(DecoderOnly {
                embed,
                blocks: EncoderConfig::new(block(false).with_causal(true), self.n_layers)
                    .try_init(device)?,
                head,
            }),
            ModelKind::EncoderDecoder => {
                let dec = DecoderBlockConfig::new(self.d_model, self.n_heads)
                    .with_dropout(self.dropout)
                    .with_positions(self.positions.attention(false));
                Model::EncoderDecoder(EncoderDecoder {
                    embed,
                    encoder: EncoderConfig::new(block(true), self.n_layers).try_init(device)?,
                    decoder: DecoderConfig::new(dec, self.n_layers).try_init(device)?,
                    head,
                })
            }
        })
    }
}

/// Either model.
// One per run: the size of the enum does not matter, and Burn's derive takes no Box.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Model {
    /// See [`DecoderOnly`].
    DecoderOnly(DecoderOnly),
    /// See [`EncoderDecoder`].
    EncoderDecoder(EncoderDecoder),
}

impl Model {
    /// Loss and logits of a batch, with the targets the loss compares against.
    pub fn forward_loss(&self, batch: SeqBatch) -> SequenceOutput {
        let (logits, targets) = match self {
            Model::DecoderOnly(m) => (
                m.logits(batch.joined, batch.packed.as_ref()),
                batch.joined_targets,
            ),
            Model::EncoderDecoder(m) => {
                let (memory, padding) = m.encode(batch.source, &batch.source_lengths);
                (
                    m.logits(memory, &padding, batch.decoder_input),
                    batch.decoder_targets,
                )
            }
        };
        output_loss(logits, targets)
    }
}

/// A stack's output without a cache, which has no cache error to give.
fn uncached(out: Result<BlockOutput, CacheError>) -> BlockOutput {
    out.unwrap_or_else(|err| unreachable!("no cache, yet {err}"))
}

/// The cross-entropy over the output tokens of logits `[B, T, V]` against `targets`
/// `[B, T]` (PAD ignored), in f32 whatever the logits' dtype (as PyTorch's autocast
/// computes it).
fn output_loss(logits: Tensor<3>, targets: Tensor<2, Int>) -> SequenceOutput {
    let logits = match logits.dtype() == DType::F32 {
        true => logits,
        false => logits.cast(FloatDType::F32),
    };
    let [b, t, v] = logits.dims();
    let loss = mha::loss::cross_entropy(
        logits.clone().reshape([b * t, v]),
        targets.clone().reshape([b * t]),
        Some(PAD),
    );
    SequenceOutput::new(loss, logits, None, targets)
}

impl TrainStep for Model {
    type Input = SeqBatch;
    type Output = SequenceOutput;

    /// In f32, or with the parameters cast to the batch's
    /// [`Mixed`](crate::precision::Mixed) dtype (the gradients
    /// arriving at the f32 weights), the loss scaled and the gradients unscaled for f16;
    /// a step whose scaled gradients overflow gives none (AdamW then leaves the weights
    /// as they are) and halves the scale.
    fn step(&self, batch: SeqBatch) -> TrainOutput<SequenceOutput> {
        let Some(mixed) = batch.mixed.clone() else {
            let output = self.forward_loss(batch);
            return TrainOutput::new(self, output.loss.backward(), output);
        };
        let output = compute_copy(self, mixed.dtype).forward_loss(batch);
        let Some(scaler) = mixed.scaler else {
            return TrainOutput::new(self, output.loss.backward(), output);
        };
        let scale = scaler.lock().expect("not poisoned").scale();
        let scaled = output.loss.clone() * scale;
        let mut grads = GradientsParams::from_grads(scaled.backward(), self);
        let finite = unscale(&mut grads, self, scale);
        scaler.lock().expect("not poisoned").update(finite);
        if !finite {
            grads = GradientsParams::new();
        }
        TrainOutput {
            grads,
            item: output,
        }
    }
}

impl InferenceStep for Model {
    type Input = SeqBatch;
    type Output = SequenceOutput;

    fn step(&self, batch: SeqBatch) -> SequenceOutput {
        match batch.mixed.clone() {
            Some(mixed) => compute_copy(self, mixed.dtype).forward_loss(batch),
            None => self.forward_loss(batch),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;
    use crate::tasks::{Split, TaskConfig};

    #[test]
    fn packed_batches_give_the_padded_batches_loss() {
        use burn::data::dataloader::batcher::Batcher;
        let task = TaskConfig {
            min_len: 2,
            max_len: 7,
            ..TaskConfig::default()
        };
        let examples: Vec<_> = (0..9).map(|i| task.example(8, Split::Train, i)).collect();
        let width = 2 * (task.max_input() + task.max_output() + 2);
        for backend in Backend::compiled() {
            let device = backend.device().unwrap();
            for positions in [
                PositionKind::Learned,
                PositionKind::Sinusoidal,
                PositionKind::Rope,
                PositionKind::Alibi,
                PositionKind::T5,
            ] {
                device.seed(4);
                let config = ModelConfig {
                    d_model: 32,
                    positions,
                    ..ModelConfig::default()
                };
                let max_len = task.max_input() + task.max_output() + 2;
                let model = config.init(task.vocab_size(), max_len, &device).unwrap();
                let loss = |batcher: crate::batch::SeqBatcher| {
                    let batch = batcher.batch(examples.clone(), &device);
                    let rows = batch.joined.dims()[0];
                    (model.forward_loss(batch).loss.into_scalar::<f32>(), rows)
                };
                let (padded, _) = loss(crate::batch::SeqBatcher::default());
                let packed = crate::batch::SeqBatcher {
                    fixed: None,
                    pack: Some(width),
                    mixed: None,
                };
                let (packed, rows) = loss(packed);
                assert!(
                    rows <= 5,
                    "{backend} {positions:?}: 9 sequences in {rows} rows"
                );
                assert!(
                    (padded - packed).abs() <= 1e-5 * padded.abs(),
                    "{backend} {positions:?}: loss {padded} padded, {packed} packed"
                );
            }
        }
    }
}
