//! Hugging Face's architectures in mha's modules, each read from the model's own
//! `config.json` and `model.safetensors` under its own names: GPT-2's blocks and language
//! model ([`Gpt2Config`], [`load_gpt2_block`], [`load_gpt2_lm`]), BERT's layers and encoder ([`BertConfig`],
//! [`load_bert_layer`], [`BertModel`]), and the Llama family's decoder layers (`LlamaDecoderLayer`, `MistralDecoderLayer`,
//! `Qwen2DecoderLayer`, `Qwen3DecoderLayer` of `transformers`) as causal
//! [`EncoderBlock`]s: the block's configuration from the model's `config.json`
//! ([`HfConfig::block`]), and a layer's weights under their own names
//! ([`load_decoder_layer`]); the whole language model ([`CausalLm`]: the embedding, the
//! layers, the final norm and the head) with [`load_causal_lm`], or from the model's
//! directory with [`load_pretrained`].
//!
//! ```no_run
//! use burn::tensor::Device;
//! use mha::PyTorchWeights;
//! use mha::hf::{HfConfig, load_decoder_layer};
//!
//! # fn main() -> Result<(), mha::ImportError> {
//! let device = Device::default();
//! let config = HfConfig::from_file("model/config.json")?;
//! let weights = PyTorchWeights::from_file("model/model.safetensors")?;
//! let block = config.block()?.init(&device);
//! let layer0 = load_decoder_layer(block, &weights, "model.layers.0.")?;
//! # Ok(())
//! # }
//! ```
//!
//! A layer is pre-norm: `x + attention(rms_norm(x))`, then `x + mlp(rms_norm(x))`, with a
//! causal self-attention under RoPE in Hugging Face's half-split layout (over Mistral's
//! sliding window, the blocks' `window`) and a gated SiLU feed-forward (SwiGLU). What the
//! modules cannot express is an [`ImportError::Config`] naming the field of
//! `config.json`: RoPE scaling (`rope_type` other than `default`), an activation other
//! than SiLU, Qwen2's and Qwen3's window on some of the layers only (`max_window_layers`
//! between 0 and `num_hidden_layers`, or `layer_types` that disagree with them), RoPE
//! parameters by layer type, RoPE over part of each head (`partial_rotary_factor`). The
//! fields that size the model (`model_type`, `hidden_size`, `intermediate_size`,
//! `num_hidden_layers`, `num_attention_heads`, `rms_norm_eps`, `vocab_size`) are
//! required; of the others, one the file leaves out takes transformers' default for the
//! model type (see [`HfConfig::from_json`]). The padding token (`pad_token_id`, BERT's 0)
//! gets no gradient from the embedding's lookup, as transformers' `padding_idx`.
//!
//! Every import builds its blocks without dropout (`attention_dropout`, BERT's
//! `hidden_dropout_prob` and `attention_probs_dropout_prob`, GPT-2's `resid_pdrop`,
//! `embd_pdrop` and `attn_pdrop` are read past): a block configuration's one `dropout`
//! acts on the attention weights, the feed-forward's hidden layer and each residual
//! branch, where transformers' layers drop out at fewer places (none in the
//! feed-forward's hidden layer; in the Llama family, only on the attention weights).
//! Evaluation is the same. To fine-tune with transformers' dropout, set each loaded
//! block's own, the feed-forward's left at 0: `self_attn.dropout` (the attention weights:
//! `attention_probs_dropout_prob`, `attn_pdrop`, `attention_dropout`), `dropout1` and
//! `dropout2` (the residual branches: `hidden_dropout_prob`, `resid_pdrop`; 0 in the
//! Llama family); the embeddings' dropout (`hidden_dropout_prob` there, `embd_pdrop`) has
//! no counterpart.

use std::path::{Component, Path};

use burn::config::Config;
use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor};
use serde::{Deserialize, Serialize};

use crate::block::{
    BlockInput, EncoderBlock, EncoderBlockConfig, FeedForwardActivation, StackInput,
};
use crate::cache::{KvCache, StackCache};
use crate::error::CacheError;
use crate::mask::AttentionMask;
use crate::norm::{LayerNorm, NormKind};
use crate::positions::{Positions, RopeLayout};
use crate::pytorch::{ImportError, LoadPyTorch, PyTorchWeights, load_param, read_file};
use crate::stack::Encoder;

mod bert;
mod gpt2;

pub use bert::{BertConfig, BertModel, load_bert_layer, load_bert_model};
pub use gpt2::{Gpt2Config, load_gpt2_block, load_gpt2_lm};

/// Reads a `config.json` of `family` into `C`.
fn read_config<C: Config>(path: &Path, family: &str) -> Result<C, ImportError> {
    parse_config(&read_file(path)?, &path.display().to_string(), family)
}

/// The error of a block or stack built from a `config.json`'s numbers, naming the file's
/// field where `names` maps the block's (or the stack's) field to it, and the file's names
/// of the other fields the message speaks of.
fn unbuildable(err: crate::error::ConfigError, names: &[(&str, &str)]) -> ImportError {
    let theirs = |ours: &str| names.iter().find(|(o, _)| *o == ours).map(|&(_, t)| t);
    let glossary: Vec<String> = names
        .iter()
        .filter(|&&(ours, _)| ours != err.field && err.message.contains(ours))
        .map(|(ours, json)| format!("{ours} is `{json}`"))
        .collect();
    let mut notes = Vec::new();
    let (what, head) = match theirs(err.field) {
        Some(json) => {
            notes.push(format!("as the model's {}.{}", err.config, err.field));
            (format!("`{json}` of config.json"), err.message.clone())
        }
        None => ("config.json".to_string(), err.to_string()),
    };
    if !glossary.is_empty() {
        notes.push(glossary.join(", "));
    }
    let message = match notes.is_empty() {
        true => head,
        false => format!("{head} ({})", notes.join("; ")),
    };
    ImportError::Config { what, message }
}

/// The Llama family's `config.json` names of the blocks' and the stack's fields.
const LLAMA_NAMES: &[(&str, &str)] = &[
    ("d_model", "hidden_size"),
    ("n_heads", "num_attention_heads"),
    ("n_kv_heads", "num_key_value_heads"),
    ("head_dim", "head_dim"),
    ("d_ff", "intermediate_size"),
    ("layer_norm_eps", "rms_norm_eps"),
    ("window", "sliding_window"),
    ("n_layers", "num_hidden_layers"),
];

/// Parses the JSON of a `config.json` of `family`; `source` names it in errors.
fn parse_config<C: Config>(json: &[u8], source: &str, family: &str) -> Result<C, ImportError> {
    C::load_binary(json).map_err(|err| ImportError::Config {
        what: source.to_string(),
        message: format!("not a {family} config.json ({err})"),
    })
}

/// The fields of a Llama-family `config.json` that shape a decoder layer (the others
/// are read past). Field names are Hugging Face's. Read by [`from_json`](Self::from_json)
/// or Burn's `Config::load`, a field the file leaves out takes transformers' default for
/// the model type; serde's `Deserialize` alone reads the fields as the file gives them.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HfConfig {
    /// `llama`, `mistral`, `qwen2` or `qwen3`.
    pub model_type: String,
    /// Model width.
    pub hidden_size: usize,
    /// The feed-forward's hidden width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (GQA). Left out of the file, transformers' default for the model
    /// type ([`from_json`](Self::from_json): Mistral's 8, Qwen2's and Qwen3's 32); `None`
    /// (Llama's absence, or `null`) means `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Head width; when absent, Qwen3's 128 and the others' `hidden_size /
    /// num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// The RMS norms' epsilon.
    pub rms_norm_eps: f64,
    /// RoPE's base, in configurations written before `rope_parameters`.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// RoPE's base and kind, in configurations written by transformers 5.
    #[serde(default)]
    pub rope_parameters: Option<RopeParameters>,
    /// RoPE scaling, in configurations written before `rope_parameters` (`null` or `{}`
    /// when there is none).
    #[serde(default)]
    pub rope_scaling: Option<RopeParameters>,
    /// Biases in the attention's projections (read for Llama and Qwen3; Mistral has none,
    /// Qwen2 has them on q, k and v, whatever this says).
    #[serde(default)]
    pub attention_bias: Option<bool>,
    /// Biases in the feed-forward (read for Llama; the others have none).
    #[serde(default)]
    pub mlp_bias: Option<bool>,
    /// The attention's window, if it slides.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Whether Qwen2's and Qwen3's window is used.
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    /// The first of Qwen2's and Qwen3's layers that slide, when the window is used.
    #[serde(default)]
    pub max_window_layers: Option<usize>,
    /// Each layer's attention, `full_attention` or `sliding_attention`, in configurations
    /// written by transformers 5 (which follows it over the fields above): it must agree
    /// with them.
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// The feed-forward's activation: `silu` (or `swish`, its other name).
    #[serde(default = "silu")]
    pub hidden_act: String,
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Whether the language-model head is the token embedding (no `lm_head.weight`).
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    /// The padding token, whose embedding row the lookup gives no gradient
    /// (transformers' `nn.Embedding(.., padding_idx)`; a negative id counts from the end).
    #[serde(default)]
    pub pad_token_id: Option<i64>,
    /// The longest sequence the model was trained on (left out of the file,
    /// transformers' default for the model type, see [`from_json`](Self::from_json)): the
    /// blocks compute any length; a caller may hold generation to it.
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    /// The share of each head RoPE turns (Phi's, StableLM's): 1 where given at all.
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
}

/// RoPE's settings in `config.json` (`rope_parameters`, or the older `rope_scaling`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RopeParameters {
    /// RoPE's base.
    #[serde(default)]
    pub rope_theta: Option<f64>,
    /// `default` (no scaling), or a scaling (`linear`, `dynamic`, `yarn`, `llama3`, ..).
    #[serde(default)]
    pub rope_type: Option<String>,
    /// The older spelling of `rope_type`.
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// The share of each head RoPE turns, where given here: 1 where given at all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub partial_rotary_factor: Option<f64>,
    /// Parameters of the full-attention layers, where they differ by layer type (refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub full_attention: Option<Box<RopeParameters>>,
    /// Parameters of the sliding-window layers, where they differ by layer type (refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sliding_attention: Option<Box<RopeParameters>>,
}

impl RopeParameters {
    /// Whether it gives nothing (`{}`), which transformers reads as no settings.
    fn is_empty(&self) -> bool {
        self.rope_theta.is_none()
            && self.rope_type.is_none()
            && self.kind.is_none()
            && self.partial_rotary_factor.is_none()
            && self.full_attention.is_none()
            && self.sliding_attention.is_none()
    }
}

fn silu() -> String {
    "silu".into()
}

/// Which of the fields whose absence means a default other than `null`'s a
/// `config.json` gives (`null` included).
#[derive(Clone, Debug, Serialize, Deserialize)]
struct GivenFields {
    #[serde(default)]
    sliding_window: Given,
    #[serde(default)]
    max_window_layers: Given,
    #[serde(default)]
    num_key_value_heads: Given,
    #[serde(default)]
    max_position_embeddings: Given,
}

impl Config for GivenFields {}

/// Whether a field is in the file, whatever its value.
#[derive(Clone, Debug, Default, Serialize)]
struct Given(bool);

impl<'de> Deserialize<'de> for Given {
    fn deserialize<D: serde::Deserializer<'de>>(value: D) -> Result<Self, D::Error> {
        serde::de::IgnoredAny::deserialize(value).map(|_| Given(true))
    }
}

/// An [`HfConfig`] as the file gives it, before transformers' defaults.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(transparent)]
struct AsGiven(HfConfig);

impl Config for AsGiven {}

/// Burn's `load` and `load_binary` give transformers' defaults too, as
/// [`HfConfig::from_json`] does.
impl Config for HfConfig {
    fn load<P: AsRef<Path>>(file: P) -> Result<Self, burn::config::ConfigError> {
        let path = file.as_ref();
        let bytes = std::fs::read(path).map_err(|_| {
            burn::config::ConfigError::FileNotFound(path.to_string_lossy().into_owned())
        })?;
        Self::load_binary(&bytes)
    }

    fn load_binary(data: &[u8]) -> Result<Self, burn::config::ConfigError> {
        let AsGiven(mut config) = AsGiven::load_binary(data)?;
        let given = GivenFields::load_binary(data)?;
        config.default_absent(&given);
        Ok(config)
    }
}

impl HfConfig {
    /// Reads a model's `config.json`.
    ///
    /// # Errors
    /// [`ImportError::Io`] when the file cannot be read, [`ImportError::Config`] when it
    /// is not a configuration with the fields above.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ImportError> {
        let path = path.as_ref();
        Self::from_json(&read_file(path)?, &path.display().to_string())
    }

    /// Parses the JSON of a `config.json`; `source` names it in errors. The fields that
    /// size the model are required; an optional field the file leaves out takes
    /// transformers' default for its `model_type` (Mistral's, Qwen2's and Qwen3's
    /// `sliding_window` 4096, which `null` turns off; Qwen2's and Qwen3's
    /// `max_window_layers` 28; `num_key_value_heads` 8 for Mistral, 32 for Qwen2 and
    /// Qwen3, `num_attention_heads` for Llama; `max_position_embeddings` 2048 for Llama,
    /// 131072 for Mistral, 32768 for Qwen2 and Qwen3).
    ///
    /// # Errors
    /// [`ImportError::Config`] when it is not a configuration with the fields above.
    pub fn from_json(json: &[u8], source: &str) -> Result<Self, ImportError> {
        parse_config(json, source, "Llama-family")
    }

    /// Gives each optional field the file leaves out (`given` says which it has, `null`
    /// included) transformers' default for the model type (see
    /// [`from_json`](Self::from_json)).
    fn default_absent(&mut self, given: &GivenFields) {
        let family = self.model_type.as_str();
        if matches!(family, "mistral" | "qwen2" | "qwen3") && !given.sliding_window.0 {
            self.sliding_window = Some(4096);
        }
        if matches!(family, "qwen2" | "qwen3") && !given.max_window_layers.0 {
            self.max_window_layers = Some(28);
        }
        if !given.max_position_embeddings.0 {
            self.max_position_embeddings = match family {
                "llama" => Some(2048),
                "mistral" => Some(131_072),
                "qwen2" | "qwen3" => Some(32_768),
                _ => None,
            };
        }
        if !given.num_key_value_heads.0 {
            self.num_key_value_heads = match family {
                "mistral" => Some(8),
                "qwen2" | "qwen3" => Some(32),
                _ => None,
            };
        }
    }

    /// The configuration of one decoder layer as a causal [`EncoderBlock`].
    ///
    /// # Errors
    /// [`ImportError::Config`] naming the field the modules cannot express (see the
    /// module docs).
    pub fn block(&self) -> Result<EncoderBlockConfig, ImportError> {
        let convention = |field: &str, message: String| ImportError::Config {
            what: format!("`{field}` of config.json"),
            message,
        };
        let family = self.model_type.as_str();
        if !matches!(family, "llama" | "mistral" | "qwen2" | "qwen3") {
            return Err(convention(
                "model_type",
                format!("`{family}`: the layers that load are llama, mistral, qwen2 and qwen3"),
            ));
        }
        if !matches!(self.hidden_act.as_str(), "silu" | "swish") {
            return Err(convention(
                "hidden_act",
                format!(
                    "`{}`: the gated feed-forward takes silu (swish)",
                    self.hidden_act
                ),
            ));
        }
        // Mistral's window covers every layer; Llama has none; Qwen2's and Qwen3's, when
        // used, the layers from `max_window_layers` on.
        let window = match (family, self.sliding_window) {
            (_, None) | ("llama", _) => None,
            ("mistral", window) => window,
            (_, Some(window)) => {
                let layers = self.num_hidden_layers;
                match (self.use_sliding_window, self.max_window_layers) {
                    (Some(true), Some(0)) => Some(window),
                    (Some(true), Some(from)) if from < layers => {
                        return Err(convention(
                            "max_window_layers",
                            format!(
                                "{from}: a window of {window} on layers {from}.. of {layers} \
                                 only has no counterpart; the blocks of one configuration \
                                 share their window"
                            ),
                        ));
                    }
                    (Some(true), None) => {
                        return Err(convention(
                            "max_window_layers",
                            format!(
                                "absent: use_sliding_window is true and which layers slide \
                                 over {window} is not said"
                            ),
                        ));
                    }
                    _ => None,
                }
            }
        };
        if let Some(types) = &self.layer_types {
            let ours = match window {
                Some(_) => "sliding_attention",
                None => "full_attention",
            };
            if types.len() != self.num_hidden_layers || types.iter().any(|t| t != ours) {
                return Err(convention(
                    "layer_types",
                    format!(
                        "{types:?}: use_sliding_window, sliding_window and max_window_layers \
                         make all {} layers {ours}; layers of another kind, or a list that \
                         disagrees, have no counterpart",
                        self.num_hidden_layers
                    ),
                ));
            }
        }
        // transformers 5 reads `rope_scaling` where there is one (an empty one is none),
        // else `rope_parameters`; the base is that one's, else the top level's.
        let scaling = self.rope_scaling.as_ref().filter(|s| !s.is_empty());
        let (field, parameters) = match scaling {
            Some(scaling) => ("rope_scaling", Some(scaling)),
            None => ("rope_parameters", self.rope_parameters.as_ref()),
        };
        if let Some(p) = parameters
            && (p.full_attention.is_some() || p.sliding_attention.is_some())
        {
            return Err(convention(
                field,
                "RoPE parameters by layer type (full_attention, sliding_attention) have \
                 no counterpart: the layers share one RoPE"
                    .into(),
            ));
        }
        let kind = parameters.and_then(|p| p.rope_type.clone().or(p.kind.clone()));
        if let Some(kind) = kind.filter(|kind| kind != "default") {
            return Err(convention(
                field,
                format!("RoPE scaling `{kind}` has no counterpart (plain RoPE only)"),
            ));
        }
        let partial = [
            ("partial_rotary_factor", self.partial_rotary_factor),
            (field, parameters.and_then(|p| p.partial_rotary_factor)),
        ];
        for (field, factor) in partial {
            if let Some(factor) = factor.filter(|&f| f != 1.0) {
                return Err(convention(
                    field,
                    format!(
                        "partial_rotary_factor {factor}: RoPE over part of each head has no \
                         counterpart (whole heads)"
                    ),
                ));
            }
        }
        let theta = parameters
            .and_then(|p| p.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(10_000.0);
        if !(theta.is_finite() && theta > 1.0) {
            let field = match parameters.and_then(|p| p.rope_theta) {
                Some(_) => field,
                None => "rope_theta",
            };
            return Err(convention(
                field,
                format!("RoPE's base must be above 1, got {theta}"),
            ));
        }
        // The fields each family reads: Llama both biases, Qwen3 the attention's, Mistral
        // and Qwen2 neither (transformers fixes theirs).
        let attention_bias = match family {
            "llama" | "qwen3" => self.attention_bias.unwrap_or(false),
            _ => false,
        };
        let mlp_bias = family == "llama" && self.mlp_bias.unwrap_or(false);
        // Qwen3's heads are 128 wide unless the file says otherwise.
        let head_dim = match family {
            "qwen3" => Some(self.head_dim.unwrap_or(128)),
            _ => self.head_dim,
        };
        // RoPE turns pairs of a head's dims (heads that do not divide the width are the
        // blocks' error, named as the file names them).
        let (heads, width) = (self.num_attention_heads, self.hidden_size);
        let odd = match head_dim {
            Some(dim) => (dim % 2 == 1).then(|| ("head_dim", format!("{dim}"))),
            None if heads > 0 && width.is_multiple_of(heads) && (width / heads) % 2 == 1 => {
                let dim = format!("{width} / num_attention_heads {heads} = {}", width / heads);
                Some(("hidden_size", dim))
            }
            None => None,
        };
        if let Some((field, dim)) = odd {
            return Err(convention(
                field,
                format!("RoPE needs heads of an even width, got {dim}"),
            ));
        }
        let config = EncoderBlockConfig::new(self.hidden_size, self.num_attention_heads)
            .with_n_kv_heads(self.num_key_value_heads)
            .with_head_dim(head_dim)
            .with_d_ff(Some(self.intermediate_size))
            .with_dropout(0.0)
            .with_activation(FeedForwardActivation::Silu)
            .with_gated(true)
            .with_norm(NormKind::Rms)
            .with_layer_norm_eps(self.rms_norm_eps)
            .with_bias(mlp_bias)
            .with_causal(true)
            .with_window(window)
            .with_positions(Positions::Rope {
                theta,
                layout: RopeLayout::HalfSplit,
            });
        Ok(match family {
            "qwen2" => config
                .with_attention_bias(Some(true))
                .with_attention_out_bias(Some(false)),
            "qwen3" => config
                .with_attention_bias(Some(attention_bias))
                .with_qk_norm_eps(Some(self.rms_norm_eps)),
            _ => config.with_attention_bias(Some(attention_bias)),
        })
    }
}

/// Loads the weights of a Llama-family decoder layer stored under `prefix` (such as
/// `model.layers.0.`) into `block`: `input_layernorm.weight`, `self_attn.{q,k,v,o}_proj.*`
/// (with Qwen3's `self_attn.q_norm.weight`, `self_attn.k_norm.weight`),
/// `post_attention_layernorm.weight`, `mlp.{gate,up,down}_proj.*`.
///
/// # Errors
/// [`ImportError::Convention`] when `block` is not configured as such a layer computes
/// (causal, pre-norm, RMS norms, a gated feed-forward: see [`HfConfig::block`]), and the
/// import's errors naming a key that is missing, unexpected or of another shape.
pub fn load_decoder_layer(
    mut block: EncoderBlock,
    weights: &PyTorchWeights,
    prefix: &str,
) -> Result<EncoderBlock, ImportError> {
    let convention = |message: &str| ImportError::Convention {
        key: format!("{prefix}input_layernorm.weight"),
        message: format!(
            "a Llama-family decoder layer is {message}; configure the block as \
             HfConfig::block does"
        ),
    };
    let rms = |norm: &LayerNorm| norm.kind() == NormKind::Rms;
    if !block.causal || !block.norm_first {
        return Err(convention("causal and pre-norm"));
    }
    if !rms(&block.norm1) || !rms(&block.norm2) {
        return Err(convention("normalised by RMS norms (NormKind::Rms)"));
    }
    if block.feed_forward.up.is_none() {
        return Err(convention("a gated feed-forward (gated = true)"));
    }
    let at = |name: &str| format!("{prefix}{name}");
    block.self_attn = block.self_attn.load_pytorch(weights, &at("self_attn."))?;
    block.norm1 = block.norm1.load_pytorch(weights, &at("input_layernorm."))?;
    block.norm2 = block
        .norm2
        .load_pytorch(weights, &at("post_attention_layernorm."))?;
    let ff = &mut block.feed_forward;
    let load = |linear, name: &str| crate::pytorch::load_linear(linear, weights, &at(name));
    ff.linear1 = load(ff.linear1.clone(), "mlp.gate_proj.")?;
    ff.up = Some(load(ff.up.take().expect("gated"), "mlp.up_proj.")?);
    ff.linear2 = load(ff.linear2.clone(), "mlp.down_proj.")?;
    Ok(block)
}

/// A Llama-family causal language model (`LlamaForCausalLM` and its kin): the token
/// embedding, the decoder layers with the final RMS norm, and the head (the embedding
/// itself when `tie_word_embeddings`). Build it with [`HfConfig::init_causal_lm`], load it
/// with [`load_causal_lm`].
#[derive(Module, Debug)]
pub struct CausalLm {
    /// `[vocab_size, hidden_size]` (`model.embed_tokens.weight`).
    pub embed_tokens: Embedding,
    /// The decoder layers and the final norm (`model.layers.N.*`, `model.norm.weight`).
    pub model: Encoder,
    /// The head `[hidden_size, vocab_size]` (`lm_head.weight`), or `None` when it is the
    /// embedding.
    pub lm_head: Option<Linear>,
    /// The padding token (`pad_token_id`), whose embedding row the lookup gives no
    /// gradient.
    #[module(skip)]
    pub pad_token: Option<usize>,
}

/// `pad_token_id` of a `config.json` as a row of an embedding of `vocab` rows: a negative
/// id counts from the end, as PyTorch's `padding_idx`.
///
/// # Errors
/// [`ImportError::Config`] naming `pad_token_id`, if it is not a row of the table.
pub(crate) fn pad_row(id: Option<i64>, vocab: usize) -> Result<Option<usize>, ImportError> {
    let Some(id) = id else {
        return Ok(None);
    };
    let row = match id < 0 {
        true => vocab as i64 + id,
        false => id,
    };
    match (0..vocab as i64).contains(&row) {
        true => Ok(Some(row as usize)),
        false => Err(ImportError::Config {
            what: "`pad_token_id` of config.json".into(),
            message: format!("{id} is not a row of the {vocab} token embeddings (vocab_size)"),
        }),
    }
}

/// The embeddings `x` `[B, T, D]` of `tokens` `[B, T]`, those of the padding token `pad`
/// cut from the graph: the lookup gives its row no gradient (PyTorch's `padding_idx`).
/// The values are unchanged; nothing is done outside autodiff.
pub(crate) fn padded_lookup(
    x: Tensor<3>,
    tokens: &Tensor<2, Int>,
    pad: Option<usize>,
) -> Tensor<3> {
    let Some(pad) = pad.filter(|_| x.is_tracked()) else {
        return x;
    };
    let [batch, len, width] = x.dims();
    let padding = tokens
        .clone()
        .equal_elem(pad as i64)
        .reshape([batch, len, 1])
        .expand([batch, len, width]);
    x.clone().mask_where(padding, x.detach())
}

/// Checks that every id of `ids` `[B, T]` (the input `what` of `model`) is an index of a
/// table of `size` rows (the configuration's `field`), reading them back to the host:
/// an embedding's lookup past its table fails inside Burn on the CPU and reads past it,
/// unchecked, on a GPU.
///
/// # Panics
/// Naming the first id out of range, its place, the size and the field.
pub(crate) fn check_ids(model: &str, what: &str, ids: &Tensor<2, Int>, size: usize, field: &str) {
    let [_, len] = ids.dims();
    let values = ids.to_data().convert::<i64>();
    let values = values.try_into_vec::<i64>().expect("integer ids");
    if let Some((at, id)) = values
        .iter()
        .enumerate()
        .find(|(_, id)| !(0..size as i64).contains(id))
    {
        panic!(
            "{model}: {what}[{}, {}] = {id} is not below {field} = {size}",
            at / len.max(1),
            at % len.max(1)
        );
    }
}

impl CausalLm {
    /// The logits of every position of `tokens` `[B, T]` under `mask` (key padding, say;
    /// the layers are causal).
    ///
    /// # Shapes
    /// `tokens`: `[B, T]` -> `[B, T, vocab_size]`.
    ///
    /// # Panics
    /// If an id of `tokens` is not below the vocabulary's size, naming it and its place
    /// (the ids are read back to the host for that, as `cross_entropy` reads its targets);
    /// as [`Encoder::forward`](crate::Encoder::forward) for the mask (one that does not
    /// broadcast to the scores, or on another device) and, for GPT-2's learned positions,
    /// for an input past `n_positions`.
    pub fn forward(&self, tokens: Tensor<2, Int>, mask: AttentionMask) -> Tensor<3> {
        let x = self.embed(tokens);
        let input = BlockInput::new(x).mask(mask);
        let hidden = self
            .model
            .forward(input)
            .expect("a stack without a cache has no cache error")
            .output;
        self.logits(hidden)
    }

    /// The logits of the next tokens `tokens` `[B, T]` against `cache`, which holds the
    /// keys and values of the tokens before them (from [`cache`](Self::cache)): a prompt,
    /// then one token per call; equal to those rows of [`forward`](Self::forward) over the
    /// whole sequence. Every row's tokens are read as real: prompts of different lengths
    /// decode together through [`forward_cached_padded`](Self::forward_cached_padded).
    ///
    /// # Errors
    /// The stack's with a cache ([`Encoder::forward`](crate::Encoder::forward)): the
    /// cache of another model ([`CacheError::Layers`]), layers' caches at different
    /// positions ([`CacheError::Uneven`]), a cache that does not slide over the model's
    /// window ([`CacheError::Window`]), and each layer's
    /// ([`MultiHeadAttention::forward_cached`](crate::MultiHeadAttention::forward_cached)).
    ///
    /// # Panics
    /// As [`forward`](Self::forward), for an id past the vocabulary.
    pub fn forward_cached(
        &self,
        tokens: Tensor<2, Int>,
        cache: &mut StackCache,
    ) -> Result<Tensor<3>, CacheError> {
        self.cached(BlockInput::new(self.embed(tokens)), cache)
    }

    /// [`forward_cached`](Self::forward_cached) for a batch of prompts padded on the left:
    /// row `b` begins with `pads[b]` padding tokens (any ids below the vocabulary's size),
    /// the same `pads` at every call of the decode. Each real token's logits are those of
    /// its row decoded alone, as transformers' `generate` gives them for a left-padded
    /// batch (its padding masked, its positions counted from its first real token: GPT-2's
    /// learned ones too); a padding token's are not meant to be read.
    ///
    /// # Errors
    /// As [`forward_cached`](Self::forward_cached).
    ///
    /// # Panics
    /// As [`forward_cached`](Self::forward_cached), and if `pads` does not have one entry
    /// per row.
    pub fn forward_cached_padded(
        &self,
        tokens: Tensor<2, Int>,
        cache: &mut StackCache,
        pads: Vec<usize>,
    ) -> Result<Tensor<3>, CacheError> {
        let x = self.embed(tokens);
        self.cached(BlockInput::new(x).left_padding(pads), cache)
    }

    /// The logits of `input` through the stack and `cache`.
    fn cached<'c>(
        &self,
        input: StackInput<'c>,
        cache: &'c mut StackCache,
    ) -> Result<Tensor<3>, CacheError> {
        let hidden = self.model.forward(input.cache(cache))?.output;
        Ok(self.logits(hidden))
    }

    /// Caches for every layer, each holding up to `capacity` tokens; the last `window`
    /// tokens, in a ring, when the layers attend to a sliding window (for speculative
    /// decoding, build the caches with [`KvCache::with_rollback`] through
    /// `self.model.cache`).
    ///
    /// # Panics
    /// If `capacity` is 0 and the layers have no window.
    pub fn cache(&self, capacity: usize) -> StackCache {
        let window = self.model.layers.first().and_then(|layer| layer.window);
        self.model.cache(match window {
            Some(window) => KvCache::sliding(window),
            None => KvCache::new(capacity),
        })
    }

    /// The embeddings of `tokens` `[B, T]`, once their ids are checked ([`check_ids`]).
    fn embed(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let vocab = self.vocab_size();
        check_ids("CausalLm", "tokens", &tokens, vocab, "vocab_size");
        let x = self.embed_tokens.forward(tokens.clone());
        padded_lookup(x, &tokens, self.pad_token)
    }

    /// The tokens it reads and predicts.
    pub fn vocab_size(&self) -> usize {
        self.embed_tokens.weight.dims()[0]
    }

    /// `[B, T, hidden_size]` -> `[B, T, vocab_size]`.
    fn logits(&self, hidden: Tensor<3>) -> Tensor<3> {
        match &self.lm_head {
            Some(head) => crate::ops::linear::forward(head, hidden),
            None => {
                let embedding = self.embed_tokens.weight.val().transpose();
                crate::linear::linear(hidden, embedding, None)
            }
        }
    }
}

impl HfConfig {
    /// The causal language model, initialised (load its weights with
    /// [`load_causal_lm`]).
    ///
    /// # Errors
    /// As [`block`](Self::block); [`ImportError::Config`] naming the field of config.json
    /// when the stack cannot be built of these numbers (no layers, a width its heads do
    /// not divide, ..) or `pad_token_id` is not a row of the embedding.
    pub fn init_causal_lm(&self, device: &Device) -> Result<CausalLm, ImportError> {
        let block = self.block()?;
        let model = crate::stack::EncoderConfig::new(block, self.num_hidden_layers)
            .try_init(device)
            .map_err(|err| unbuildable(err, LLAMA_NAMES))?;
        let (vocab, width) = (self.vocab_size, self.hidden_size);
        let pad_token = pad_row(self.pad_token_id, vocab)?;
        Ok(CausalLm {
            pad_token,
            embed_tokens: EmbeddingConfig::new(vocab, width).init(device),
            model,
            lm_head: (!self.tie_word_embeddings.unwrap_or(false)).then(|| {
                LinearConfig::new(width, vocab)
                    .with_bias(false)
                    .init(device)
            }),
        })
    }
}

/// The index of a checkpoint in shards (`model.safetensors.index.json`): which file holds
/// each key.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct ShardIndex {
    weight_map: std::collections::BTreeMap<String, String>,
}

impl Config for ShardIndex {}

/// A Llama-family causal language model from a directory as `save_pretrained` writes it
/// (or as the Hugging Face Hub holds it): its `config.json`, and its weights in
/// `model.safetensors` or in the shards `model.safetensors.index.json` lists; the
/// parameters in f32, loaded from the stored dtype (to compute in another dtype without
/// holding the model in f32 first, build it from [`read_pretrained`], cast it, then
/// [`load_causal_lm`]). Returns the configuration with the model.
///
/// # Errors
/// [`ImportError::Io`] naming a file that cannot be read, and the errors of
/// [`read_pretrained`], [`HfConfig::init_causal_lm`] and [`load_causal_lm`].
pub fn load_pretrained(
    dir: impl AsRef<Path>,
    device: &Device,
) -> Result<(HfConfig, CausalLm), ImportError> {
    let (config, weights) = read_pretrained(dir)?;
    let lm = load_causal_lm(config.init_causal_lm(device)?, &weights, "")?;
    Ok((config, lm))
}

/// The configuration and the weights of a directory as `save_pretrained` writes it: its
/// `config.json`, and `model.safetensors` or the shards `model.safetensors.index.json`
/// lists, read as stored.
///
/// # Errors
/// [`ImportError::Io`] naming a file that cannot be read, the errors of
/// [`HfConfig::from_file`] and [`PyTorchWeights::from_files`], and
/// [`ImportError::Config`] for a directory without weights or an index that is not one.
pub fn read_pretrained(dir: impl AsRef<Path>) -> Result<(HfConfig, PyTorchWeights), ImportError> {
    let dir = dir.as_ref();
    let config = HfConfig::from_file(dir.join("config.json"))?;
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    let weights = match (single.exists(), index.exists()) {
        (true, _) => PyTorchWeights::from_file(&single)?,
        (false, true) => {
            let index_path = index;
            let bytes = read_file(&index_path)?;
            let index = ShardIndex::load_binary(&bytes).map_err(|err| ImportError::Config {
                what: index_path.display().to_string(),
                message: format!("not a safetensors index with a weight_map ({err})"),
            })?;
            // A shard is a file of the model's directory: a path elsewhere (absolute, or
            // through `..`) is refused, as is a device (`/dev/zero` reads without end).
            let elsewhere = index.weight_map.iter().find(|(_, file)| {
                let mut parts = Path::new(file.as_str())
                    .components()
                    .filter(|part| *part != Component::CurDir);
                !matches!(
                    (parts.next(), parts.next()),
                    (Some(Component::Normal(_)), None)
                )
            });
            if let Some((key, file)) = elsewhere {
                return Err(ImportError::Config {
                    what: index_path.display().to_string(),
                    message: format!(
                        "weight_map's `{key}` is in {file:?}, which is not the name of a file \
                         in the model's directory"
                    ),
                });
            }
            let files: std::collections::BTreeSet<&String> = index.weight_map.values().collect();
            PyTorchWeights::from_files(files.into_iter().map(|file| dir.join(file)))?
        }
        (false, false) => {
            return Err(ImportError::Config {
                what: dir.display().to_string(),
                message: "no weights: neither model.safetensors nor model.safetensors.index.json \
                          (PyTorch pickles, .bin, do not load: convert them to safetensors)"
                    .into(),
            });
        }
    };
    Ok((config, weights))
}

/// Loads a Llama-family causal language model stored under `prefix` (`""` for a
/// `model.safetensors` as Hugging Face writes it): `{prefix}model.embed_tokens.weight`,
/// each layer's `{prefix}model.layers.N.*` ([`load_decoder_layer`]),
/// `{prefix}model.norm.weight` and `{prefix}lm_head.weight` (not read when the head is the
/// embedding, whose copy it then is). The base model saved alone (`LlamaModel`,
/// `Qwen3Model`: `{prefix}embed_tokens.weight`, `{prefix}layers.N.*`, `{prefix}norm.weight`
/// and no `model.`) loads too, as transformers loads it into its language model: with a
/// tied head, or naming the `lm_head.weight` an untied one lacks.
///
/// # Errors
/// As [`load_decoder_layer`], for every key.
pub fn load_causal_lm(
    mut lm: CausalLm,
    weights: &PyTorchWeights,
    prefix: &str,
) -> Result<CausalLm, ImportError> {
    let base_alone = !weights.contains(&format!("{prefix}model.embed_tokens.weight"))
        && weights.contains(&format!("{prefix}embed_tokens.weight"));
    let base = match base_alone {
        true => prefix.to_string(),
        false => format!("{prefix}model."),
    };
    let at = |name: &str| match name.strip_prefix("model.") {
        Some(inner) => format!("{base}{inner}"),
        None => format!("{prefix}{name}"),
    };
    let table = lm.embed_tokens.weight;
    lm.embed_tokens.weight = load_param(table, weights, &at("model.embed_tokens.weight"))?;
    lm.model.layers = lm
        .model
        .layers
        .into_iter()
        .enumerate()
        .map(|(i, layer)| load_decoder_layer(layer, weights, &at(&format!("model.layers.{i}."))))
        .collect::<Result<Vec<_>, _>>()?;
    weights.reject_layers_past(&at("model.layers."), lm.model.layers.len())?;
    lm.model.norm = match lm.model.norm {
        Some(norm) => Some(norm.load_pytorch(weights, &at("model.norm."))?),
        None => None,
    };
    // A tied head is the embedding: `save_pretrained` leaves its key out, PyTorch's
    // `state_dict` repeats the embedding under it; either way there is nothing to read.
    if let Some(head) = lm.lm_head {
        lm.lm_head = Some(crate::pytorch::load_linear(head, weights, &at("lm_head."))?);
    }
    Ok(lm)
}
