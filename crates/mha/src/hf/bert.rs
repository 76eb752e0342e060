//! BERT's layer (`BertLayer` of `transformers`) as a bidirectional post-norm
//! [`EncoderBlock`]: `attention.self.{query,key,value}`, `attention.output.dense` and its
//! `LayerNorm`, `intermediate.dense`, `output.dense` and its `LayerNorm`, exact GELU,
//! biases everywhere. Its positions (learned, with token types) are added to the input
//! once, outside the layers.

use std::path::Path;

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, LayerNormConfig};
use burn::tensor::{Device, Int, Tensor};
use serde::{Deserialize, Serialize};

use super::read_config;
use crate::block::{BlockInput, EncoderBlock, EncoderBlockConfig, FeedForwardActivation};
use crate::mask::AttentionMask;
use crate::norm::{LayerNorm, NormKind};
use crate::pytorch::{ImportError, LoadPyTorch, PyTorchWeights, load_linear, load_param};

/// The fields of BERT's `config.json` that shape a layer (the others are read past).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BertConfig {
    /// `bert` (a configuration without it is taken to be BERT's). Models that share BERT's
    /// keys but not its computation (RoBERTa's positions start past the padding id,
    /// LayoutLM adds boxes, ..) are refused by [`block`](Self::block).
    #[serde(default)]
    pub model_type: Option<String>,
    /// Model width.
    pub hidden_size: usize,
    /// Heads.
    pub num_attention_heads: usize,
    /// Layers.
    pub num_hidden_layers: usize,
    /// The feed-forward's hidden width.
    pub intermediate_size: usize,
    /// The feed-forward's activation: `gelu`, `gelu_new`, `gelu_pytorch_tanh` or
    /// `gelu_fast` (GELU's tanh approximation), or `relu`.
    #[serde(default = "gelu")]
    pub hidden_act: String,
    /// The layer norms' epsilon.
    pub layer_norm_eps: f64,
    /// `absolute` (a learned table added to the input).
    #[serde(default = "absolute")]
    pub position_embedding_type: String,
    /// Whether the layers are a decoder's.
    #[serde(default)]
    pub is_decoder: bool,
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Positions with a learned embedding.
    #[serde(default = "positions")]
    pub max_position_embeddings: usize,
    /// Token types (segments) with a learned embedding.
    #[serde(default = "token_types")]
    pub type_vocab_size: usize,
    /// The padding token, whose embedding row the lookup gives no gradient
    /// (transformers' `nn.Embedding(.., padding_idx)`; BERT's is 0; a negative id counts
    /// from the end).
    #[serde(default = "pad_token")]
    pub pad_token_id: Option<i64>,
}

fn pad_token() -> Option<i64> {
    Some(0)
}

fn positions() -> usize {
    512
}

fn token_types() -> usize {
    2
}

fn gelu() -> String {
    "gelu".into()
}

fn absolute() -> String {
    "absolute".into()
}

impl burn::config::Config for BertConfig {}

impl BertConfig {
    /// Reads BERT's `config.json`.
    ///
    /// # Errors
    /// [`ImportError::Io`] when the file cannot be read, [`ImportError::Config`] when it
    /// is not BERT's configuration.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ImportError> {
        read_config(path.as_ref(), "BERT")
    }

    /// The configuration of one layer as a bidirectional post-norm [`EncoderBlock`].
    ///
    /// # Errors
    /// [`ImportError::Config`] naming the field the blocks cannot express: another model
    /// type, another activation, relative position embeddings, a decoder.
    pub fn block(&self) -> Result<EncoderBlockConfig, ImportError> {
        let refuse = |field: &str, message: String| ImportError::Config {
            what: format!("`{field}` of config.json"),
            message,
        };
        if let Some(other) = self.model_type.as_deref().filter(|&t| t != "bert") {
            return Err(refuse(
                "model_type",
                format!(
                    "`{other}`: this import computes BERT (bert); a model with BERT's keys \
                     computes otherwise (RoBERTa's positions, LayoutLM's boxes, ..)"
                ),
            ));
        }
        let activation = match self.hidden_act.as_str() {
            "gelu" => FeedForwardActivation::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => FeedForwardActivation::GeluTanh,
            "relu" => FeedForwardActivation::Relu,
            other => {
                return Err(refuse(
                    "hidden_act",
                    format!(
                        "`{other}`: the layers take gelu, gelu_new (gelu_pytorch_tanh, \
                         gelu_fast) or relu"
                    ),
                ));
            }
        };
        if self.position_embedding_type != "absolute" {
            return Err(refuse(
                "position_embedding_type",
                format!(
                    "`{}`: BERT's relative position embeddings have no counterpart",
                    self.position_embedding_type
                ),
            ));
        }
        if self.is_decoder {
            return Err(refuse(
                "is_decoder",
                "BERT as a decoder (cross-attention) is not covered".into(),
            ));
        }
        Ok(
            EncoderBlockConfig::new(self.hidden_size, self.num_attention_heads)
                .with_d_ff(Some(self.intermediate_size))
                .with_dropout(0.0)
                .with_activation(activation)
                .with_norm_first(false)
                .with_layer_norm_eps(self.layer_norm_eps),
        )
    }
}

/// Loads a `BertLayer` stored under `prefix` (such as `bert.encoder.layer.0.`):
/// `attention.self.{query,key,value}.*`, `attention.output.dense.*`,
/// `attention.output.LayerNorm.*`, `intermediate.dense.*`, `output.dense.*`,
/// `output.LayerNorm.*`.
///
/// # Errors
/// [`ImportError::Convention`] when `block` is not configured as BERT's (bidirectional,
/// post-norm, layer norms, not gated, without QK-norm or attention sinks: see
/// [`BertConfig::block`]), and the import's errors naming a key.
pub fn load_bert_layer(
    mut block: EncoderBlock,
    weights: &PyTorchWeights,
    prefix: &str,
) -> Result<EncoderBlock, ImportError> {
    let at = |name: &str| format!("{prefix}{name}");
    let gated = block.feed_forward.up.is_some();
    let extra = block.self_attn.q_norm.is_some() || block.self_attn.sinks.is_some();
    if block.causal || block.norm_first || gated || extra || block.norm1.kind() != NormKind::Layer {
        return Err(ImportError::Convention {
            key: at("attention.self.query.weight"),
            message: "BERT's layer is bidirectional and post-norm, with layer norms, a \
                      feed-forward of two layers, no QK-norm and no attention sinks; \
                      configure the block as BertConfig::block does"
                .into(),
        });
    }
    // BERT's names, under the ones the attention's import reads.
    let attention = at("attention.");
    block.self_attn = crate::pytorch::load_projections(
        block.self_attn,
        weights,
        [
            format!("{attention}self.query."),
            format!("{attention}self.key."),
            format!("{attention}self.value."),
            format!("{attention}output.dense."),
        ],
    )?;
    block.norm1 = block
        .norm1
        .load_pytorch(weights, &at("attention.output.LayerNorm."))?;
    block.norm2 = block
        .norm2
        .load_pytorch(weights, &at("output.LayerNorm."))?;
    let ff = &mut block.feed_forward;
    ff.linear1 = load_linear(ff.linear1.clone(), weights, &at("intermediate.dense."))?;
    ff.linear2 = load_linear(ff.linear2.clone(), weights, &at("output.dense."))?;
    Ok(block)
}

/// BERT's encoder (`BertModel` without its pooler): the sum of the token, position and
/// token-type embeddings, normalised, then the layers. Build it with
/// [`BertConfig::init_model`], load it with [`load_bert_model`].
#[derive(Module, Debug)]
pub struct BertModel {
    /// `[vocab_size, hidden_size]` (`embeddings.word_embeddings.weight`).
    pub word_embeddings: Embedding,
    /// `[max_position_embeddings, hidden_size]`.
    pub position_embeddings: Embedding,
    /// `[type_vocab_size, hidden_size]`.
    pub token_type_embeddings: Embedding,
    /// The norm of the summed embeddings (`embeddings.LayerNorm`).
    pub embeddings_norm: LayerNorm,
    /// The layers (`encoder.layer.N`).
    pub layers: Vec<EncoderBlock>,
    /// The padding token (`pad_token_id`), whose embedding row the lookup gives no
    /// gradient.
    #[module(skip)]
    pub pad_token: Option<usize>,
}

impl BertModel {
    /// The last hidden state of `tokens` `[B, T]` of `token_types` `[B, T]` (all 0 for one
    /// segment) under `mask` (key padding, say).
    ///
    /// # Shapes
    /// `tokens`, `token_types`: `[B, T]` -> `[B, T, hidden_size]`.
    ///
    /// # Panics
    /// If `token_types` is not of `tokens`' shape, an id is past its table (`vocab_size`,
    /// `type_vocab_size`: the ids are read back to the host for that) or `T` is past
    /// `max_position_embeddings`, naming both, and as [`EncoderBlock::forward`].
    pub fn forward(
        &self,
        tokens: Tensor<2, Int>,
        token_types: Tensor<2, Int>,
        mask: AttentionMask,
    ) -> Tensor<3> {
        let [batch, len] = tokens.dims();
        assert_eq!(
            token_types.dims(),
            [batch, len],
            "BertModel: token_types must be of the tokens' shape [B, T] = {:?}",
            [batch, len]
        );
        let vocab = self.word_embeddings.weight.dims()[0];
        super::check_ids("BertModel", "tokens", &tokens, vocab, "vocab_size");
        let types = self.token_type_embeddings.weight.dims()[0];
        super::check_ids(
            "BertModel",
            "token_types",
            &token_types,
            types,
            "type_vocab_size",
        );
        let most = self.position_embeddings.weight.dims()[0];
        assert!(
            len <= most,
            "BertModel: {len} tokens, past its {most} learned positions"
        );
        let device = tokens.device();
        let positions = match len {
            // Burn's reshape and expand read a 0 as "keep this axis".
            0 => Tensor::<2, Int>::empty([batch, 0], &device),
            _ => Tensor::<1, Int>::arange(0..len as i64, &device)
                .reshape([1, len])
                .expand([batch, len]),
        };
        let words = self.word_embeddings.forward(tokens.clone());
        let x = super::padded_lookup(words, &tokens, self.pad_token)
            + self.token_type_embeddings.forward(token_types)
            + self.position_embeddings.forward(positions);
        let mut x = self.embeddings_norm.forward(x);
        for layer in &self.layers {
            let input = BlockInput::new(x).mask(mask.clone());
            x = layer
                .forward(input)
                .expect("a block without a cache has no cache error")
                .output;
        }
        x
    }
}

impl BertConfig {
    /// BERT's encoder, initialised (load its weights with [`load_bert_model`]).
    ///
    /// # Errors
    /// As [`block`](Self::block).
    pub fn init_model(&self, device: &Device) -> Result<BertModel, ImportError> {
        let block = self.block()?;
        if self.num_hidden_layers == 0 {
            // Its numbers checked all the same (the embeddings' norm shares its epsilon).
            block
                .try_init(device)
                .map_err(|err| super::unbuildable(err, BERT_NAMES))?;
        }
        let layers = (0..self.num_hidden_layers)
            .map(|_| {
                block
                    .try_init(device)
                    .map_err(|err| super::unbuildable(err, BERT_NAMES))
            })
            .collect::<Result<_, _>>()?;
        let embedding = |n| EmbeddingConfig::new(n, self.hidden_size).init(device);
        let norm = LayerNormConfig::new(self.hidden_size).with_epsilon(self.layer_norm_eps);
        Ok(BertModel {
            pad_token: super::pad_row(self.pad_token_id, self.vocab_size)?,
            word_embeddings: embedding(self.vocab_size),
            position_embeddings: embedding(self.max_position_embeddings),
            token_type_embeddings: embedding(self.type_vocab_size),
            embeddings_norm: LayerNorm::new(&norm, device),
            layers,
        })
    }
}

/// Loads BERT's encoder stored under `prefix` (`bert.` for `BertForMaskedLM` and its kin,
/// `""` for `BertModel`): `embeddings.{word,position,token_type}_embeddings.weight`,
/// `embeddings.LayerNorm.*` and each layer's `encoder.layer.N.*` ([`load_bert_layer`]);
/// the pooler is not read.
///
/// # Errors
/// As [`load_bert_layer`], for every key.
pub fn load_bert_model(
    mut model: BertModel,
    weights: &PyTorchWeights,
    prefix: &str,
) -> Result<BertModel, ImportError> {
    let at = |name: &str| format!("{prefix}embeddings.{name}");
    for (table, name) in [
        (&mut model.word_embeddings, "word_embeddings.weight"),
        (&mut model.position_embeddings, "position_embeddings.weight"),
        (
            &mut model.token_type_embeddings,
            "token_type_embeddings.weight",
        ),
    ] {
        table.weight = load_param(table.weight.clone(), weights, &at(name))?;
    }
    model.embeddings_norm = model
        .embeddings_norm
        .load_pytorch(weights, &at("LayerNorm."))?;
    model.layers = model
        .layers
        .into_iter()
        .enumerate()
        .map(|(i, layer)| load_bert_layer(layer, weights, &format!("{prefix}encoder.layer.{i}.")))
        .collect::<Result<Vec<_>, _>>()?;
    weights.reject_layers_past(&format!("{prefix}encoder.layer."), model.layers.len())?;
    Ok(model)
}

/// BERT's `config.json` names of the blocks' fields.
const BERT_NAMES: &[(&str, &str)] = &[
    ("d_model", "hidden_size"),
    ("n_heads", "num_attention_heads"),
    ("d_ff", "intermediate_size"),
    ("layer_norm_eps", "layer_norm_eps"),
];
