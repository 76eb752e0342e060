//! Two small transformers built only from `mha` modules:
//! - decoder-only: token + position embeddings, N causal blocks, final norm, LM head,
//!   reading `input SEP output`;
//! - encoder-decoder: the encoder reads the input, the decoder writes `output` while
//!   cross-attending to it.
//!
//! The loss counts only output tokens (and the closing EOS).
//!
//! The text task's language model is the decoder-only one with its head tied to the
//! token embedding ([`ModelConfig::init_language_model`]); every position predicts the
//! next character.
//!
//! Each kind in its own file ([`decoder_only`], [`encoder_decoder`]) with its
//! embeddings ([`embed`]); greedy decoding in [`decode`], the text task's decoding in
//! [`text`], looking inside in [`inspect`].

pub mod decode;
pub mod decoder_only;
pub mod embed;
pub mod encoder_decoder;
pub mod inspect;
pub mod text;

use burn::module::Module;
use burn::nn::{EmbeddingConfig, LinearConfig};
use burn::optim::lr_scheduler::module_lr_scheduler::ModuleLearningRate;
use burn::optim::{GradientsParams, ModuleOptimizer};
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
use crate::fields::{D_MODEL, DROPOUT, N_HEADS, N_LAYERS, POSITIONS};
use crate::precision::{compute_copy, unscale};

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
        let head = self.d_model / self.n_heads;
        anyhow::ensure!(
            self.positions != PositionKind::Rope || head.is_multiple_of(2),
            "{} rope needs heads of an even width: {} {} / {} {} = {}",
            POSITIONS.name(),
            D_MODEL.name(),
            self.d_model,
            N_HEADS.name(),
            self.n_heads,
            head
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
                head: Some(head),
                embed_dropout: 0.0,
                stepping: Stepping::default(),
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
                    stepping: Stepping::default(),
                })
            }
        })
    }
}

impl ModelConfig {
    /// The text task's language model, nanoGPT's GPT built from `mha`'s modules, for a
    /// vocabulary of `vocab` characters and windows of `block`: token and position
    /// embeddings (learned by default) with dropout, causal pre-norm blocks (GELU
    /// feed-forward of 4x width, biases), a final norm, and the head tied to the token
    /// embedding. Initialised as nanoGPT's: every weight matrix and embedding N(0, 0.02),
    /// the projections into the residual stream (attention output, second feed-forward
    /// layer) N(0, 0.02 / sqrt(2 · layers)), biases 0, norms 1 and 0.
    ///
    /// # Errors
    /// When `mha` rejects the blocks' configuration.
    pub fn init_language_model(
        &self,
        vocab: usize,
        block: usize,
        device: &Device,
    ) -> anyhow::Result<Model> {
        let embed = Embed {
            tokens: EmbeddingConfig::new(vocab, self.d_model).init(device),
            positions: (self.positions == PositionKind::Learned)
                .then(|| EmbeddingConfig::new(block, self.d_model).init(device)),
            kind: self.positions,
        };
        let block = EncoderBlockConfig::new(self.d_model, self.n_heads)
            .with_dropout(self.dropout)
            .with_positions(self.positions.attention(false))
            .with_causal(true);
        let model = DecoderOnly {
            embed,
            blocks: EncoderConfig::new(block, self.n_layers).try_init(device)?,
            head: None,
            embed_dropout: self.dropout,
            stepping: Stepping::default(),
        };
        let mut init = GptInit {
            path: Vec::new(),
            residual_std: 0.02 / (2.0 * self.n_layers as f64).sqrt(),
        };
        Ok(Model::DecoderOnly(model.map(&mut init)))
    }
}

/// nanoGPT's initialisation (see [`ModelConfig::init_language_model`]), by the names of
/// the parameters and of the modules holding them.
struct GptInit {
    /// The names of the modules entered, then the parameter's.
    path: Vec<String>,
    /// The deviation of the projections into the residual stream.
    residual_std: f64,
}

impl burn::module::ModuleMapper for GptInit {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<Tensor<D>>,
    ) -> burn::module::Param<Tensor<D>> {
        use burn::tensor::Distribution;
        let last = |i: usize| self.path.iter().rev().nth(i).map(String::as_str);
        let in_norm = self.path.iter().any(|p| p.starts_with("norm"));
        let std = match (last(0), last(1)) {
            _ if in_norm => return param,
            (Some("weight"), Some("out_proj" | "linear2")) => self.residual_std,
            (Some("weight"), _) => 0.02,
            (Some("bias"), _) => 0.0,
            _ => return param,
        };
        let (id, tensor, mapper) = param.consume();
        let device = tensor.device();
        let shape = tensor.shape();
        let fresh = match std == 0.0 {
            true => Tensor::zeros(shape, &device),
            false => Tensor::random(shape, Distribution::Normal(0.0, std), &device),
        };
        // A new tensor: tracked by autodiff as the one it replaces was.
        let fresh = fresh.set_require_grad(tensor.is_require_grad());
        burn::module::Param::from_mapped_value(id, fresh, mapper)
    }
}

/// How a model's optimizer steps run ([`TrainStep::optimize`]): not part of its weights
/// or its record.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Stepping {
    /// The norm all the gradients are clipped at together (PyTorch's `clip_grad_norm_`),
    /// if they are: the gradient the step applies, with several devices their sum, as
    /// with one device the whole batch's.
    pub global_clip: Option<f32>,
    /// The devices the steps run on (1 unless Burn's multi-device strategy runs them);
    /// with several, the step waits for the devices' work.
    pub devices: usize,
}

impl Default for Stepping {
    /// No global clip, one device.
    fn default() -> Self {
        Self {
            global_clip: None,
            devices: 1,
        }
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
    /// The model with its optimizer steps run as `stepping` says (see [`Stepping`]).
    pub fn with_stepping(mut self, stepping: Stepping) -> Self {
        match &mut self {
            Model::DecoderOnly(m) => m.stepping = stepping,
            Model::EncoderDecoder(m) => m.stepping = stepping,
        }
        self
    }

    fn stepping(&self) -> Stepping {
        match self {
            Model::DecoderOnly(m) => m.stepping,
            Model::EncoderDecoder(m) => m.stepping,
        }
    }

    /// Loss and logits of a batch, with the targets the loss compares against.
    pub fn forward_loss(&self, batch: SeqBatch) -> SequenceOutput {
        let ignore = batch.ignore;
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
        output_loss(logits, targets, ignore)
    }
}

/// A stack's output without a cache, which has no cache error to give.
fn uncached(out: Result<BlockOutput, CacheError>) -> BlockOutput {
    out.unwrap_or_else(|err| unreachable!("no cache, yet {err}"))
}

/// The cross-entropy over the output tokens of logits `[B, T, V]` against `targets`
/// `[B, T]` (the `ignore` token left out: PAD for the synthetic tasks, none for text), in
/// f32 whatever the logits' dtype (as PyTorch's autocast computes it).
fn output_loss(
    logits: Tensor<3>,
    targets: Tensor<2, Int>,
    ignore: Option<usize>,
) -> SequenceOutput {
    let logits = match logits.dtype() == DType::F32 {
        true => logits,
        false => logits.cast(FloatDType::F32),
    };
    let [b, t, v] = logits.dims();
    let loss = mha::loss::cross_entropy(
        logits.clone().reshape([b * t, v]),
        targets.clone().reshape([b * t]),
        ignore.map(|id| id as i64),
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
    /// as they are) and halves the scale. The gradients are those of the loss times the
    /// batch's [`loss_weight`](SeqBatch::loss_weight) (a device's share of a step on
    /// several); the output keeps the loss itself. On a worker of the CPU backends' pool
    /// ([`mha::on_cpu_workers`]), as are the optimizer's step and validation's.
    fn step(&self, batch: SeqBatch) -> TrainOutput<SequenceOutput> {
        let device = batch.joined.device();
        mha::on_cpu_workers(&device, || self.train_step(batch))
    }

    /// The optimizer's step, the gradients first clipped together at the model's
    /// [global clip](Stepping::global_clip) when it has one. Burn's multi-device
    /// strategy calls it with the devices' gradients summed on the main device.
    fn optimize(
        self,
        optim: &mut ModuleOptimizer,
        lr_module: ModuleLearningRate,
        grads: GradientsParams,
    ) -> Self {
        let device = self.devices().remove(0);
        mha::on_cpu_workers(&device, || self.optimizer_step(optim, lr_module, grads))
    }
}

impl Model {
    /// [`TrainStep::step`], on the thread it is called on.
    fn train_step(&self, batch: SeqBatch) -> TrainOutput<SequenceOutput> {
        let weight = batch.loss_weight;
        let weighted = |loss: Tensor<1>| match weight == 1.0 {
            true => loss,
            false => loss * weight,
        };
        let (output, grads) = match batch.mixed.clone() {
            None => {
                let output = self.forward_loss(batch);
                let grads =
                    GradientsParams::from_grads(weighted(output.loss.clone()).backward(), self);
                (output, grads)
            }
            Some(mixed) => {
                let output = compute_copy(self, mixed.dtype).forward_loss(batch);
                match mixed.scaler {
                    None => {
                        let grads = GradientsParams::from_grads(
                            weighted(output.loss.clone()).backward(),
                            self,
                        );
                        (output, grads)
                    }
                    Some(scaler) => {
                        let scale = scaler.lock().expect("not poisoned").scale();
                        let scaled = weighted(output.loss.clone()) * scale;
                        let mut grads = GradientsParams::from_grads(scaled.backward(), self);
                        let finite = unscale(&mut grads, self, scale);
                        scaler.lock().expect("not poisoned").update(finite);
                        if !finite {
                            grads = GradientsParams::new();
                        }
                        (output, grads)
                    }
                }
            }
        };
        if weight != 1.0 {
            // A share of a step on several devices: its gradients are complete before Burn
            // moves them to the main device (see `optimize`).
            if let Err(err) = output.loss.device().sync() {
                panic!("the device of a share of the step failed: {err:?}");
            }
        }
        TrainOutput {
            grads,
            item: output,
        }
    }

    /// [`TrainStep::optimize`], on the thread it is called on.
    fn optimizer_step(
        self,
        optim: &mut ModuleOptimizer,
        lr_module: ModuleLearningRate,
        mut grads: GradientsParams,
    ) -> Self {
        let stepping = self.stepping();
        if let Some(max) = stepping.global_clip {
            mha::optim::clip_grad_norm(&mut grads, &self, max);
        }
        let several = stepping.devices > 1;
        let model = optim.step(lr_module, self, grads);
        if several {
            // Burn 0.22.1 copies the weights to the other devices (and their gradients
            // back) through the host. Between two wgpu devices, without a wait for the
            // queued work here and after each share's backward pass, two-device runs
            // ended 1e-3 to 5e-3 away from one device's, a different distance every run
            // (a copy apparently read what was not written yet); with the waits, 4.5e-7.
            for device in model.devices() {
                if let Err(err) = device.sync() {
                    panic!("the main device failed in the optimizer's step: {err:?}");
                }
            }
        }
        model
    }
}

impl InferenceStep for Model {
    type Input = SeqBatch;
    type Output = SequenceOutput;

    /// The batch's loss once per row: Burn's loss metric weighs a batch by the loss's
    /// length, so that a short last batch counts as its rows do and the epoch's loss is
    /// the mean over the rows (a `[1]` loss counted each batch as one).
    fn step(&self, batch: SeqBatch) -> SequenceOutput {
        let device = batch.joined.device();
        let mut out = mha::on_cpu_workers(&device, || match batch.mixed.clone() {
            Some(mixed) => compute_copy(self, mixed.dtype).forward_loss(batch),
            None => self.forward_loss(batch),
        });
        let rows = out.targets.dims()[0];
        out.loss = out.loss.expand([rows]);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;
    use crate::tasks::{Split, TaskConfig};

    #[test]
    fn the_language_model_is_nanogpts_and_every_weight_learns() {
        use burn::data::dataloader::batcher::Batcher;
        let (vocab, block, d, layers) = (17, 8, 64, 2);
        for backend in Backend::compiled() {
            let _turn = crate::backend::gpu_turn(backend);
            let device = backend.device().unwrap().autodiff();
            device.seed(1);
            let config = ModelConfig {
                d_model: d,
                n_layers: layers,
                n_heads: 4,
                positions: PositionKind::Learned,
                ..ModelConfig::default()
            };
            let model = config.init_language_model(vocab, block, &device).unwrap();
            // nanoGPT's parameters: embeddings, 12 d^2 + 13 d per block, the final norm;
            // no head of its own (tied).
            let per_block = 12 * d * d + 13 * d;
            assert_eq!(
                model.num_params(),
                vocab * d + block * d + layers * per_block + 2 * d,
                "{backend}"
            );
            let Model::DecoderOnly(m) = &model else {
                unreachable!()
            };
            assert!(m.head.is_none(), "{backend}: the head is the embedding");
            let std = |t: Tensor<2>| {
                let n = t.dims().iter().product::<usize>();
                let v: Vec<f32> = t.into_data().convert::<f32>().try_to_vec().unwrap();
                let mean = v.iter().sum::<f32>() / n as f32;
                (v.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / n as f32).sqrt()
            };
            let near = |got: f32, want: f32, what: &str| {
                assert!(
                    (got - want).abs() < 0.1 * want,
                    "{backend}: {what}: std {got}, wanted {want}"
                )
            };
            let layer = &m.blocks.layers[0];
            near(std(m.embed.tokens.weight.val()), 0.02, "token embedding");
            near(
                std(layer.feed_forward.linear1.weight.val()),
                0.02,
                "linear1",
            );
            let residual = 0.02 / (2.0 * layers as f32).sqrt();
            near(
                std(layer.feed_forward.linear2.weight.val()),
                residual,
                "linear2",
            );
            near(
                std(layer.self_attn.out_proj.weight.val()),
                residual,
                "out_proj",
            );
            let bias = layer.feed_forward.linear1.bias.as_ref().unwrap().val();
            assert_eq!(
                bias.abs().max().into_scalar::<f32>(),
                0.0,
                "{backend}: bias"
            );
            let gamma = layer.norm1.gamma.val();
            assert_eq!(
                gamma.sum().into_scalar::<f32>(),
                d as f32,
                "{backend}: gamma"
            );
            // One step's gradient reaches every parameter.
            let windows: Vec<Vec<u32>> = (0..3)
                .map(|r| {
                    (0..=block as u32)
                        .map(|i| (i * 5 + r) % vocab as u32)
                        .collect()
                })
                .collect();
            let batch = crate::lm::TextBatcher::default().batch(windows, &device);
            // Validated, the loss is counted once per window (Burn's metric weighs a
            // batch by the loss's length).
            let valid = InferenceStep::step(&model, batch.clone()).loss;
            assert_eq!(
                valid.dims(),
                [3],
                "{backend}: the validation loss per window"
            );
            let out = model.forward_loss(batch);
            let loss = out.loss.clone().into_scalar::<f32>();
            let mean = valid.mean().into_scalar::<f32>();
            assert!(
                (mean - loss).abs() < 1e-5,
                "{backend}: validated {mean}, {loss}"
            );
            // Small logits (h · E^T with E of deviation 0.02): about the uniform guess's
            // loss, ln V; Burn's N(0, 1) embedding would give several times that.
            assert!(
                (loss - (vocab as f32).ln()).abs() < 0.5,
                "{backend}: the first loss {loss} is about ln {vocab}"
            );
            let grads = GradientsParams::from_grads(out.loss.backward(), &model);
            let params = burn::module::list_param_ids(&model).len();
            assert_eq!(grads.len(), params, "{backend}: parameters with a gradient");
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
            let _turn = crate::backend::gpu_turn(backend);
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
                    pack: Some(width),
                    ..Default::default()
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
