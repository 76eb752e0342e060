//! Hugging Face's Llama-family decoder layers (`LlamaDecoderLayer`, `MistralDecoderLayer`,
//! `Qwen2DecoderLayer`, `Qwen3DecoderLayer` of `transformers`) as causal
//! [`EncoderBlock`]s: the block's configuration from the model's `config.json`
//! ([`HfConfig::block`]), and a layer's weights under their own names
//! ([`load_decoder_layer`]).
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
//! causal self-attention under RoPE in Hugging Face's half-split layout and a gated SiLU
//! feed-forward (SwiGLU). What the modules cannot express is an [`ImportError::Config`]
//! naming the field of `config.json`: heads of another width than `hidden_size /
//! num_attention_heads`, RoPE scaling (`rope_type` other than `default`), an activation
//! other than SiLU, a sliding window (Mistral's first release; `sliding_window: null` and
//! Qwen2's `use_sliding_window: false` load).

use std::path::Path;

use burn::config::Config;
use burn::tensor::Device;
use serde::{Deserialize, Serialize};

use crate::block::{EncoderBlock, EncoderBlockConfig, FeedForwardActivation};
use crate::norm::{LayerNorm, NormKind};
use crate::positions::{Positions, RopeLayout};
use crate::pytorch::{ImportError, LoadPyTorch, PyTorchWeights};

/// The fields of a Llama-family `config.json` that shape a decoder layer (the others
/// are read past). Field names are Hugging Face's.
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
    /// Key/value heads (GQA); `num_attention_heads` when absent.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Head width; `hidden_size / num_attention_heads` when absent.
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
    /// RoPE scaling, in configurations written before `rope_parameters` (`null` when
    /// there is none).
    #[serde(default)]
    pub rope_scaling: Option<RopeParameters>,
    /// Biases in the attention's projections (Llama, Mistral, Qwen3); Qwen2 has them on
    /// q, k and v whatever this says.
    #[serde(default)]
    pub attention_bias: Option<bool>,
    /// Biases in the feed-forward (Llama's `mlp_bias`).
    #[serde(default)]
    pub mlp_bias: Option<bool>,
    /// The attention's window, if it slides.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Whether Qwen2's window is used.
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    /// The feed-forward's activation: `silu`.
    #[serde(default = "silu")]
    pub hidden_act: String,
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
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
}

fn silu() -> String {
    "silu".into()
}

impl Config for HfConfig {}

impl HfConfig {
    /// Reads a model's `config.json`.
    ///
    /// # Errors
    /// [`ImportError::Io`] when the file cannot be read, [`ImportError::Config`] when it
    /// is not a configuration with the fields above.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ImportError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| ImportError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_json(&bytes, &path.display().to_string())
    }

    /// Parses the JSON of a `config.json`; `source` names it in errors.
    ///
    /// # Errors
    /// [`ImportError::Config`] when it is not a configuration with the fields above.
    pub fn from_json(json: &[u8], source: &str) -> Result<Self, ImportError> {
        Self::load_binary(json).map_err(|err| ImportError::Config {
            what: source.to_string(),
            message: format!("not a Llama-family config.json ({err})"),
        })
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
        if self.hidden_act != "silu" {
            return Err(convention(
                "hidden_act",
                format!("`{}`: the gated feed-forward takes silu", self.hidden_act),
            ));
        }
        let width = self.hidden_size / self.num_attention_heads.max(1);
        if let Some(head_dim) = self.head_dim.filter(|&d| d != width) {
            return Err(convention(
                "head_dim",
                format!(
                    "{head_dim}: heads of another width than hidden_size / \
                     num_attention_heads = {} / {} = {width} have no counterpart",
                    self.hidden_size, self.num_attention_heads
                ),
            ));
        }
        let sliding = match family {
            "qwen2" | "qwen3" => self.use_sliding_window.unwrap_or(false),
            _ => true,
        };
        if let (true, Some(window)) = (sliding, self.sliding_window) {
            return Err(convention(
                "sliding_window",
                format!(
                    "{window}: a layer's window is a mask of the call \
                     (AttentionMask::sliding_window), not of the block; load without it and \
                     pass the mask"
                ),
            ));
        }
        let rope = [&self.rope_parameters, &self.rope_scaling];
        for (field, parameters) in ["rope_parameters", "rope_scaling"].into_iter().zip(rope) {
            let kind = parameters
                .as_ref()
                .and_then(|p| p.rope_type.clone().or(p.kind.clone()));
            if let Some(kind) = kind.filter(|kind| kind != "default") {
                return Err(convention(
                    field,
                    format!("RoPE scaling `{kind}` has no counterpart (plain RoPE only)"),
                ));
            }
        }
        let theta = self
            .rope_parameters
            .as_ref()
            .and_then(|p| p.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(10_000.0);
        let attention_bias = self.attention_bias.unwrap_or(false);
        let config = EncoderBlockConfig::new(self.hidden_size, self.num_attention_heads)
            .with_n_kv_heads(self.num_key_value_heads)
            .with_d_ff(Some(self.intermediate_size))
            .with_dropout(0.0)
            .with_activation(FeedForwardActivation::Silu)
            .with_gated(true)
            .with_norm(NormKind::Rms)
            .with_layer_norm_eps(self.rms_norm_eps)
            .with_bias(self.mlp_bias.unwrap_or(false))
            .with_causal(true)
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

    /// The decoder layers, initialised (load their weights with [`load_decoder_layer`]).
    ///
    /// # Errors
    /// As [`block`](Self::block), and the block's own configuration errors.
    pub fn init_layers(&self, device: &Device) -> Result<Vec<EncoderBlock>, ImportError> {
        let config = self.block()?;
        (0..self.num_hidden_layers)
            .map(|_| {
                config.try_init(device).map_err(|err| ImportError::Config {
                    what: "config.json".into(),
                    message: err.to_string(),
                })
            })
            .collect()
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
