//! Two small transformers built only from `mha` modules:
//! - decoder-only: token + position embeddings, N causal blocks, final norm, LM head,
//!   reading `input SEP output`;
//! - encoder-decoder: the encoder reads the input, the decoder writes `output` while
//!   cross-attending to it.
//!
//! The loss counts only output tokens (and the closing EOS).

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::{InferenceStep, SequenceOutput, TrainOutput, TrainStep};
use mha::analysis::{Heads, Inspect, LayerStats, PrunePlan};
use mha::positions::sinusoids;
use mha::{
    AttentionMask, Decoder, DecoderBlockConfig, DecoderConfig, Encoder, EncoderBlockConfig,
    EncoderConfig, KvCache, Positions, PruneError,
};

use serde::{Deserialize, Serialize};

use crate::batch::{FixedShape, Packed, SeqBatch, padded};
use crate::fields::{D_MODEL, DROPOUT, N_HEADS, N_LAYERS};
use crate::tasks::{EOS, Example, PAD, SEP};

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
    /// the default task, see the README).
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

/// Decoder-only transformer.
#[derive(Module, Debug)]
pub struct DecoderOnly {
    embed: Embed,
    /// Causal blocks and the final norm.
    blocks: Encoder,
    head: Linear,
}

/// Encoder-decoder transformer.
#[derive(Module, Debug)]
pub struct EncoderDecoder {
    embed: Embed,
    encoder: Encoder,
    decoder: Decoder,
    head: Linear,
}

/// Token embeddings, and the absolute positions added to them (learned or sinusoidal).
#[derive(Module, Debug)]
pub struct Embed {
    tokens: Embedding,
    /// The learned positions, for [`PositionKind::Learned`].
    positions: Option<Embedding>,
    #[module(skip)]
    kind: PositionKind,
}

impl Embed {
    /// `[B, T]` -> `[B, T, d_model]`, token `t` of every row at position `t`.
    fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let [_, len] = ids.dims();
        let device = ids.device();
        let tokens = self.tokens.forward(ids);
        let d_model = tokens.dims()[2];
        match (&self.positions, self.kind) {
            (Some(learned), _) => {
                let at = Tensor::<1, Int>::arange(0..len as i64, &device).reshape([1, len]);
                tokens + learned.forward(at) // [B, T, D] + [1, T, D]
            }
            (None, PositionKind::Sinusoidal) => {
                tokens + sinusoids(0, len, d_model, &device).unsqueeze::<3>()
            }
            (None, _) => tokens,
        }
    }

    /// `[B, T]` -> `[B, T, d_model]`, token `t` of row `b` at position `at[b][t]`.
    fn forward_at(&self, ids: Tensor<2, Int>, at: &[Vec<usize>]) -> Tensor<3> {
        let [batch, len] = ids.dims();
        let device = ids.device();
        let tokens = self.tokens.forward(ids);
        let d_model = tokens.dims()[2];
        let flat: Vec<i64> = at.iter().flatten().map(|&p| p as i64).collect();
        let index = |shape: [usize; 2]| {
            Tensor::<2, Int>::from_data(TensorData::new(flat.clone(), shape), &device)
        };
        match (&self.positions, self.kind) {
            (Some(learned), _) => tokens + learned.forward(index([batch, len])),
            (None, PositionKind::Sinusoidal) => {
                let longest = at.iter().flatten().max().map_or(0, |&p| p + 1);
                let table = sinusoids(0, longest, d_model, &device); // [P, D]
                let rows = table.select(0, index([1, batch * len]).reshape([batch * len]));
                tokens + rows.reshape([batch, len, d_model])
            }
            (None, _) => tokens,
        }
    }
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

impl DecoderOnly {
    /// `[B, T]` -> logits `[B, T, V]`; with `packed`, each row holds several sequences,
    /// which attend only within themselves, their positions starting at each one's first
    /// token.
    fn logits(&self, ids: Tensor<2, Int>, packed: Option<&Packed>) -> Tensor<3> {
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

impl EncoderDecoder {
    fn encode(&self, source: Tensor<2, Int>, lengths: &[usize]) -> (Tensor<3>, AttentionMask) {
        let [_, len] = source.dims();
        let padding = AttentionMask::key_lengths(lengths, len, &source.device());
        let memory = self.encoder.forward(self.embed.forward(source), &padding);
        (memory, padding)
    }

    /// Logits `[B, U, V]` of the decoder reading `decoder_input` `[B, U]`.
    fn logits(
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

    /// Attention weights for one example, teacher-forced: per layer `[H, rows, cols]`,
    /// with the row and column tokens. Decoder-only: self-attention over
    /// `input SEP output`; encoder-decoder: the decoder's cross-attention from
    /// `SEP output` to the input.
    pub fn attention_maps(
        &self,
        input: &[usize],
        output: &[usize],
        device: &Device,
    ) -> (Vec<Tensor<3>>, Vec<usize>, Vec<usize>) {
        let ids = |row: &[usize]| {
            let data: Vec<i64> = row.iter().map(|&t| t as i64).collect();
            Tensor::<2, Int>::from_data(TensorData::new(data, [1, row.len()]), device)
        };
        match self {
            Model::DecoderOnly(m) => {
                let seq: Vec<usize> = input
                    .iter()
                    .copied()
                    .chain([SEP])
                    .chain(output.iter().copied())
                    .collect();
                let x = m.embed.forward(ids(&seq));
                let (_, weights) = m.blocks.forward_with_weights(x, &AttentionMask::none());
                (
                    weights.into_iter().map(|w| w.squeeze_dim(0)).collect(),
                    seq.clone(),
                    seq,
                )
            }
            Model::EncoderDecoder(m) => {
                let (memory, padding) = m.encode(ids(input), &[input.len()]);
                let rows: Vec<usize> = [SEP].into_iter().chain(output.iter().copied()).collect();
                let x = m.embed.forward(ids(&rows));
                let (_, weights) =
                    m.decoder
                        .forward_with_weights(x, memory, &AttentionMask::none(), &padding);
                (
                    weights.into_iter().map(|w| w.squeeze_dim(0)).collect(),
                    rows,
                    input.to_vec(),
                )
            }
        }
    }
}

/// The cross-entropy over the output tokens of logits `[B, T, V]` against `targets`
/// `[B, T]` (PAD ignored).
fn output_loss(logits: Tensor<3>, targets: Tensor<2, Int>) -> SequenceOutput {
    let [b, t, v] = logits.dims();
    let loss = mha::loss::cross_entropy(
        logits.clone().reshape([b * t, v]),
        targets.clone().reshape([b * t]),
        Some(PAD),
    );
    SequenceOutput::new(loss, logits, None, targets)
}

/// Looking inside: the model's attention layers are those of its stacks in order
/// (decoder-only: one per block; encoder-decoder: the encoder's blocks, then the decoder's
/// self- and cross-attention block by block).
impl Model {
    /// The heads of each attention layer.
    pub fn head_counts(&self) -> Vec<usize> {
        match self {
            Model::DecoderOnly(m) => m.blocks.head_counts(),
            Model::EncoderDecoder(m) => {
                let mut counts = m.encoder.head_counts();
                counts.extend(m.decoder.head_counts());
                counts
            }
        }
    }

    /// A name per attention layer, for reports: `layer 0`, or `encoder 0`, `decoder 0
    /// self`, `decoder 0 cross`.
    pub fn attention_layer_names(&self) -> Vec<String> {
        match self {
            Model::DecoderOnly(m) => (0..m.blocks.layers.len())
                .map(|i| format!("layer {i}"))
                .collect(),
            Model::EncoderDecoder(m) => (0..m.encoder.layers.len())
                .map(|i| format!("encoder {i}"))
                .chain(
                    (0..m.decoder.layers.len())
                        .flat_map(|i| [format!("decoder {i} self"), format!("decoder {i} cross")]),
                )
                .collect(),
        }
    }

    /// The loss of a padded (not packed) batch, each head's output scaled by its weight in
    /// the request's head mask; with its `weights`, also every attention layer's weights.
    pub fn forward_inspect(
        &self,
        batch: SeqBatch,
        inspect: &Inspect,
    ) -> (SequenceOutput, Vec<Tensor<4>>) {
        match self {
            Model::DecoderOnly(m) => {
                let x = m.embed.forward(batch.joined);
                let out = m.blocks.forward_inspect(x, &AttentionMask::none(), inspect);
                (
                    output_loss(m.head.forward(out.output), batch.joined_targets),
                    out.weights,
                )
            }
            Model::EncoderDecoder(m) => {
                let layers = m.encoder.layers.len();
                let encoder_part = inspect.slice(0, layers);
                let decoder_part = inspect.slice(layers, 2 * m.decoder.layers.len());
                let [_, len] = batch.source.dims();
                let padding =
                    AttentionMask::key_lengths(&batch.source_lengths, len, &batch.source.device());
                let x = m.embed.forward(batch.source);
                let encoded = m.encoder.forward_inspect(x, &padding, &encoder_part);
                let y = m.embed.forward(batch.decoder_input);
                let none = AttentionMask::none();
                let decoded =
                    m.decoder
                        .forward_inspect(y, encoded.output, &none, &padding, &decoder_part);
                let mut weights = encoded.weights;
                weights.extend(decoded.weights);
                (
                    output_loss(m.head.forward(decoded.output), batch.decoder_targets),
                    weights,
                )
            }
        }
    }

    /// The statistics of every attention layer over `batch`, the padded batch of
    /// `examples` (each row's padding and the keys its mask blocks left out).
    pub fn head_stats(&self, batch: SeqBatch, examples: &[Example]) -> Vec<LayerStats> {
        let device = batch.joined.device();
        let names = self.attention_layer_names();
        let source_lengths = batch.source_lengths.clone();
        let [_, source_len] = batch.source.dims();
        let (_, weights) = self.forward_inspect(batch, &Inspect::new().weights());
        let joined: Vec<usize> = examples
            .iter()
            .map(|e| e.input.len() + e.output.len() + 2)
            .collect();
        let decoder: Vec<usize> = examples.iter().map(|e| e.output.len() + 1).collect();
        let padding = AttentionMask::key_lengths(&source_lengths, source_len, &device);
        weights
            .into_iter()
            .zip(names)
            .map(|(w, name)| {
                let (mask, rows) = match (self, name.as_str()) {
                    (Model::DecoderOnly(_), _) => (AttentionMask::causal(), &joined),
                    (_, n) if n.starts_with("encoder") => (padding.clone(), &source_lengths),
                    (_, n) if n.ends_with("self") => (AttentionMask::causal(), &decoder),
                    _ => (padding.clone(), &decoder),
                };
                LayerStats::from_weights(name, w, &mask, Some(rows))
            })
            .collect()
    }

    /// The model without the heads `plan` removes (attention layers in the order of
    /// [`head_counts`](Self::head_counts)).
    pub fn prune(&self, plan: &PrunePlan) -> Result<Model, PruneError> {
        let layers = self.head_counts().len();
        if plan.remove.len() != layers {
            return Err(PruneError::Layers {
                module: "model",
                layers,
                plan: plan.remove.len(),
            });
        }
        Ok(match self {
            Model::DecoderOnly(m) => Model::DecoderOnly(DecoderOnly {
                blocks: m.blocks.prune(plan)?,
                ..m.clone()
            }),
            Model::EncoderDecoder(m) => {
                let n = m.encoder.layers.len();
                let decoder = m
                    .decoder
                    .prune(&plan.slice(n, layers - n))
                    .map_err(|e| e.at_layer(n))?;
                Model::EncoderDecoder(EncoderDecoder {
                    encoder: m.encoder.prune(&plan.slice(0, n))?,
                    decoder,
                    ..m.clone()
                })
            }
        })
    }
}

impl TrainStep for Model {
    type Input = SeqBatch;
    type Output = SequenceOutput;

    fn step(&self, batch: SeqBatch) -> TrainOutput<SequenceOutput> {
        let output = self.forward_loss(batch);
        TrainOutput::new(self, output.loss.backward(), output)
    }
}

impl InferenceStep for Model {
    type Input = SeqBatch;
    type Output = SequenceOutput;

    fn step(&self, batch: SeqBatch) -> SequenceOutput {
        self.forward_loss(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;
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

    #[test]
    fn a_pruned_model_has_the_masked_models_loss_and_the_plain_one_with_all_heads_kept() {
        use burn::data::dataloader::batcher::Batcher;
        use mha::analysis::{HeadMask, Inspect, PrunePlan};
        let task = TaskConfig::default();
        let examples: Vec<_> = (0..6).map(|i| task.example(3, Split::Valid, i)).collect();
        let max_len = task.max_input() + task.max_output() + 2;
        for backend in Backend::compiled() {
            let device = backend.device().unwrap();
            for kind in [ModelKind::DecoderOnly, ModelKind::EncoderDecoder] {
                device.seed(5);
                let config = ModelConfig {
                    kind,
                    d_model: 32,
                    n_layers: 2,
                    n_heads: 4,
                    ..ModelConfig::default()
                };
                let model = config.init(task.vocab_size(), max_len, &device).unwrap();
                let batch = || crate::batch::SeqBatcher::default().batch(examples.clone(), &device);
                let counts = model.head_counts();
                let layers = counts.len();
                assert_eq!(model.attention_layer_names().len(), layers);
                // One head out of every other attention layer, two out of the last.
                let mut removed: Vec<(usize, usize)> =
                    (0..layers).step_by(2).map(|l| (l, l % 4)).collect();
                removed.extend([(layers - 1, 1), (layers - 1, 3)]);
                let plan = PrunePlan::removing(layers, &removed);
                let loss = |m: &Model, mask: Option<HeadMask>| {
                    let inspect = Inspect {
                        head_mask: mask,
                        weights: false,
                    };
                    m.forward_inspect(batch(), &inspect)
                        .0
                        .loss
                        .into_scalar::<f32>()
                };
                let plain = model.forward_loss(batch()).loss.into_scalar::<f32>();
                let kept = loss(&model, Some(HeadMask::keep_all(&counts, &device)));
                assert_eq!(plain, kept, "{backend} {kind:?}: every head kept");
                let masked = loss(&model, Some(HeadMask::dropping(&counts, &removed, &device)));
                let pruned = loss(&model.prune(&plan).unwrap(), None);
                assert!(
                    (masked - pruned).abs() <= 1e-5 * masked.abs(),
                    "{backend} {kind:?}: loss {masked} masked, {pruned} pruned"
                );
                assert!(
                    (masked - plain).abs() > 1e-4,
                    "{backend} {kind:?}: dropping heads changes the loss"
                );
            }
        }
    }
}
