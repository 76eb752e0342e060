//! Looking inside: the model's attention layers, their names, heads and weights, a head
//! mask applied to them, and the model without some of its heads.

use burn::data::dataloader::batcher::Batcher;
use burn::tensor::{Device, Int, Tensor, TensorData};
use burn::train::SequenceOutput;
use mha::analysis::{Heads, Inspect, LayerStatsBuilder, PrunePlan};
use mha::{AttentionMask, PruneError, StackInput};

use super::{DecoderOnly, EncoderDecoder, Model, output_loss, uncached};
use crate::batch::{SeqBatch, SeqBatcher};
use crate::tasks::{EOS, Example, SEP};

/// One attention layer's weights on one example, `[H, rows, cols]`, with the tokens of
/// its rows (queries) and columns (keys), ready to draw.
pub struct LayerWeights {
    /// The layer, as a map's title names it.
    pub name: String,
    /// Every head's weights, `[H, rows, cols]`.
    pub weights: Tensor<3>,
    /// The tokens of the rows.
    pub rows: Vec<usize>,
    /// The tokens of the columns.
    pub cols: Vec<usize>,
}

impl Model {
    /// The attention a finished run shows, on one example, teacher-forced: per block,
    /// decoder-only, the self-attention over `input SEP output` (`layer 0
    /// self-attention`); encoder-decoder, the decoder's cross-attention from `SEP output`
    /// to the input (`layer 0 decoder cross-attention`).
    pub fn attention_maps(
        &self,
        input: &[usize],
        output: &[usize],
        device: &Device,
    ) -> Vec<LayerWeights> {
        let ids = |row: &[usize]| {
            let data: Vec<i64> = row.iter().map(|&t| t as i64).collect();
            Tensor::<2, Int>::from_data(TensorData::new(data, [1, row.len()]), device)
        };
        let (what, weights, rows, cols) = match self {
            Model::DecoderOnly(m) => {
                let seq: Vec<usize> = input
                    .iter()
                    .copied()
                    .chain([SEP])
                    .chain(output.iter().copied())
                    .collect();
                let x = m.embed.forward(ids(&seq));
                let weights = uncached(m.blocks.forward(StackInput::new(x).weights())).weights;
                ("self-attention", weights, seq.clone(), seq)
            }
            Model::EncoderDecoder(m) => {
                let (memory, padding) = m.encode(ids(input), &[input.len()]);
                let rows: Vec<usize> = [SEP].into_iter().chain(output.iter().copied()).collect();
                let x = m.embed.forward(ids(&rows));
                let stack_input = StackInput::new(x)
                    .memory(memory)
                    .memory_mask(padding)
                    .weights();
                let weights = uncached(m.decoder.forward(stack_input)).weights;
                // Each block's self-attention, then its cross-attention: the latter.
                let weights = weights.into_iter().skip(1).step_by(2).collect();
                ("decoder cross-attention", weights, rows, input.to_vec())
            }
        };
        weights
            .into_iter()
            .enumerate()
            .map(|(i, w)| LayerWeights {
                name: format!("layer {i} {what}"),
                weights: w.squeeze_dim(0),
                rows: rows.clone(),
                cols: cols.clone(),
            })
            .collect()
    }

    /// Every attention layer's weights on `example`, teacher-forced, named as
    /// [`attention_layer_names`](Self::attention_layer_names) names them: the rows and
    /// columns of the decoder-only model are `input SEP output EOS`; the encoder's are the
    /// input, the decoder's self-attention's `SEP output`, its cross-attention's `SEP
    /// output` by the input.
    pub fn every_attention_map(&self, example: &Example, device: &Device) -> Vec<LayerWeights> {
        let batch = SeqBatcher::default().batch(vec![example.clone()], device);
        let (_, weights) = self.forward_inspect(batch, &Inspect::new().weights());
        let joined: Vec<usize> = example
            .input
            .iter()
            .copied()
            .chain([SEP])
            .chain(example.output.iter().copied())
            .chain([EOS])
            .collect();
        let decoder: Vec<usize> = [SEP]
            .into_iter()
            .chain(example.output.iter().copied())
            .collect();
        let input = &example.input;
        weights
            .into_iter()
            .zip(self.attention_layer_names())
            .map(|(w, name)| {
                let (rows, cols) = match self {
                    Model::DecoderOnly(_) => (&joined, &joined),
                    Model::EncoderDecoder(_) if name.starts_with("encoder") => (input, input),
                    Model::EncoderDecoder(_) if name.ends_with("self") => (&decoder, &decoder),
                    Model::EncoderDecoder(_) => (&decoder, input),
                };
                LayerWeights {
                    weights: w.squeeze_dim(0),
                    rows: rows.clone(),
                    cols: cols.clone(),
                    name,
                }
            })
            .collect()
    }
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
                let input = StackInput::new(x).inspect(inspect.clone());
                let out = uncached(m.blocks.forward(input));
                (
                    output_loss(m.head(out.output), batch.joined_targets, batch.ignore),
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
                let input = StackInput::new(x)
                    .mask(padding.clone())
                    .inspect(encoder_part);
                let encoded = uncached(m.encoder.forward(input));
                let y = m.embed.forward(batch.decoder_input);
                let input = StackInput::new(y)
                    .memory(encoded.output)
                    .memory_mask(padding)
                    .inspect(decoder_part);
                let decoded = uncached(m.decoder.forward(input));
                let mut weights = encoded.weights;
                weights.extend(decoded.weights);
                (
                    output_loss(
                        m.head.forward(decoded.output),
                        batch.decoder_targets,
                        batch.ignore,
                    ),
                    weights,
                )
            }
        }
    }

    /// Adds to `layers` (one per attention layer, made on the first call) the statistics
    /// of every attention layer over `batch`, the padded batch of `examples` (each row's
    /// padding and the keys its mask blocks left out).
    pub fn head_stats(
        &self,
        batch: SeqBatch,
        examples: &[Example],
        layers: &mut Vec<LayerStatsBuilder>,
    ) {
        let device = batch.joined.device();
        let names = self.attention_layer_names();
        if layers.is_empty() {
            *layers = names.iter().map(LayerStatsBuilder::new).collect();
        }
        let source_lengths = batch.source_lengths.clone();
        let [_, source_len] = batch.source.dims();
        let (_, weights) = self.forward_inspect(batch, &Inspect::new().weights());
        let joined: Vec<usize> = examples
            .iter()
            .map(|e| e.input.len() + e.output.len() + 2)
            .collect();
        let decoder: Vec<usize> = examples.iter().map(|e| e.output.len() + 1).collect();
        let padding = AttentionMask::key_lengths(&source_lengths, source_len, &device);
        for ((w, name), layer) in weights.into_iter().zip(names).zip(layers.iter_mut()) {
            let (mask, rows) = match (self, name.as_str()) {
                (Model::DecoderOnly(_), _) => (AttentionMask::causal(), &joined),
                (_, n) if n.starts_with("encoder") => (padding.clone(), &source_lengths),
                (_, n) if n.ends_with("self") => (AttentionMask::causal(), &decoder),
                _ => (padding.clone(), &decoder),
            };
            layer.add(w, &mask, Some(rows));
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;
    use crate::model::{ModelConfig, ModelKind};
    use crate::tasks::{Split, TaskConfig};

    #[test]
    fn a_pruned_model_has_the_masked_models_loss_and_the_plain_one_with_all_heads_kept() {
        use burn::data::dataloader::batcher::Batcher;
        use mha::analysis::{HeadMask, Inspect, PrunePlan};
        let task = TaskConfig::default();
        let examples: Vec<_> = (0..6).map(|i| task.example(3, Split::Valid, i)).collect();
        let max_len = task.max_input() + task.max_output() + 2;
        for backend in Backend::compiled() {
            let _turn = crate::backend::gpu_turn(backend);
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
