//! GPT-2's block (`GPT2Block` of `transformers`) as a causal [`EncoderBlock`]: pre-norm
//! with layer norms, one packed `c_attn` projection and `c_proj`, a feed-forward with
//! GELU's tanh approximation (`gelu_new`), biases everywhere; its linears are `Conv1D`s,
//! whose weights are stored `[in, out]` as Burn's are (no transpose). Its positions are a
//! learned table added to the input once (`wpe`), outside the blocks.

use std::path::Path;

use burn::nn::{EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::Device;
use serde::{Deserialize, Serialize};

use super::{CausalLm, read_config};
use crate::block::{EncoderBlock, EncoderBlockConfig, FeedForwardActivation};
use crate::mha::InputProjection;
use crate::norm::NormKind;
use crate::positions::{AbsolutePositions, Positions};
use crate::pytorch::{ImportError, LoadPyTorch, PyTorchWeights, load_param};
use crate::stack::EncoderConfig;

/// The fields of GPT-2's `config.json` that shape a block (the others are read past).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Gpt2Config {
    /// `gpt2` (a configuration without it is taken to be GPT-2's).
    #[serde(default)]
    pub model_type: Option<String>,
    /// Model width.
    pub n_embd: usize,
    /// Heads.
    pub n_head: usize,
    /// Blocks.
    pub n_layer: usize,
    /// The feed-forward's hidden width; `4 · n_embd` when absent.
    #[serde(default)]
    pub n_inner: Option<usize>,
    /// The layer norms' epsilon.
    pub layer_norm_epsilon: f64,
    /// The feed-forward's activation: `gelu_new`, `gelu_pytorch_tanh` or `gelu_fast`
    /// (GELU's tanh approximation), `gelu`, or `relu`.
    #[serde(default = "gelu_new")]
    pub activation_function: String,
    /// Whether the scores are scaled by `1/sqrt(head_dim)` (when `false`, the blocks'
    /// `attention_scale` is 1).
    #[serde(default = "yes")]
    pub scale_attn_weights: bool,
    /// Whether layer `i`'s scores are also divided by `i + 1`.
    #[serde(default)]
    pub scale_attn_by_inverse_layer_idx: bool,
    /// Whether the blocks have cross-attention.
    #[serde(default)]
    pub add_cross_attention: bool,
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Positions with a learned embedding.
    pub n_positions: usize,
    /// Whether the head is the token embedding (`wte`); when `false`, the model's own
    /// `lm_head.weight`.
    #[serde(default = "yes")]
    pub tie_word_embeddings: bool,
}

fn gelu_new() -> String {
    "gelu_new".into()
}

fn yes() -> bool {
    true
}

impl burn::config::Config for Gpt2Config {}

impl Gpt2Config {
    /// Reads GPT-2's `config.json`.
    ///
    /// # Errors
    /// [`ImportError::Io`] when the file cannot be read, [`ImportError::Config`] when it
    /// is not GPT-2's configuration.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ImportError> {
        read_config(path.as_ref(), "GPT-2")
    }

    /// The configuration of every block as a causal [`EncoderBlock`]. Unscaled scores
    /// (`scale_attn_weights: false`) give the blocks an `attention_scale` of 1.
    ///
    /// # Errors
    /// [`ImportError::Config`] naming the field the blocks cannot express: another model
    /// type, another activation, cross-attention; and scores scaled by the layer's index
    /// (`scale_attn_by_inverse_layer_idx`), where the blocks differ: see
    /// [`layer_block`](Self::layer_block).
    pub fn block(&self) -> Result<EncoderBlockConfig, ImportError> {
        if self.scale_attn_by_inverse_layer_idx {
            return Err(ImportError::Config {
                what: "`scale_attn_by_inverse_layer_idx` of config.json".into(),
                message: "true: block i divides its scores by i + 1, so the blocks differ; \
                          build each with Gpt2Config::layer_block(i) (init_causal_lm does)"
                    .into(),
            });
        }
        self.shared_block()
    }

    /// The configuration of block `layer` (0 first) as a causal [`EncoderBlock`]:
    /// [`block`](Self::block)'s, but where `scale_attn_by_inverse_layer_idx` is true, its
    /// `attention_scale` also divided by `layer + 1`, as transformers' `GPT2Attention`
    /// divides its scores.
    ///
    /// # Errors
    /// As [`block`](Self::block), but for `scale_attn_by_inverse_layer_idx`.
    pub fn layer_block(&self, layer: usize) -> Result<EncoderBlockConfig, ImportError> {
        let config = self.shared_block()?;
        if !self.scale_attn_by_inverse_layer_idx {
            return Ok(config);
        }
        // The scale before the layer's own factor (a width the heads do not divide is
        // refused when the block is built).
        let scaled = match self.scale_attn_weights {
            true => 1.0 / ((self.n_embd / self.n_head.max(1)).max(1) as f64).sqrt(),
            false => 1.0,
        };
        Ok(config.with_attention_scale(Some(scaled / (layer + 1) as f64)))
    }

    /// What every block shares: [`block`](Self::block) but for the layer's own scale.
    fn shared_block(&self) -> Result<EncoderBlockConfig, ImportError> {
        let refuse = |field: &str, message: String| ImportError::Config {
            what: format!("`{field}` of config.json"),
            message,
        };
        if let Some(other) = self.model_type.as_deref().filter(|&t| t != "gpt2") {
            return Err(refuse(
                "model_type",
                format!("`{other}`: this import reads GPT-2's configuration and keys (gpt2)"),
            ));
        }
        let activation = match self.activation_function.as_str() {
            // gelu_fast is gelu_new's formula (its √(2/π) written to 10 digits).
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => FeedForwardActivation::GeluTanh,
            "gelu" => FeedForwardActivation::Gelu,
            "relu" => FeedForwardActivation::Relu,
            other => {
                return Err(refuse(
                    "activation_function",
                    format!(
                        "`{other}`: the blocks take gelu_new (gelu_pytorch_tanh, gelu_fast), \
                         gelu or relu"
                    ),
                ));
            }
        };
        if self.add_cross_attention {
            return Err(refuse(
                "add_cross_attention",
                "blocks with cross-attention load as DecoderBlock, which this import does not \
                 cover"
                    .into(),
            ));
        }
        // transformers' default width, 4 n_embd, named by n_embd where it overflows.
        let d_ff = match self.n_inner {
            Some(d_ff) => d_ff,
            None => self.n_embd.checked_mul(4).ok_or_else(|| {
                let message = format!(
                    "{} is too large: the feed-forward's width (n_inner, unset: 4 n_embd) \
                     overflows a usize",
                    self.n_embd
                );
                refuse("n_embd", message)
            })?,
        };
        Ok(EncoderBlockConfig::new(self.n_embd, self.n_head)
            .with_d_ff(Some(d_ff))
            .with_dropout(0.0)
            .with_activation(activation)
            .with_norm(NormKind::Layer)
            .with_layer_norm_eps(self.layer_norm_epsilon)
            .with_attention_scale((!self.scale_attn_weights).then_some(1.0))
            .with_causal(true))
    }
}

impl Gpt2Config {
    /// GPT-2's language model (`GPT2LMHeadModel`): the token embedding (`wte`), the learned
    /// positions (`wpe`, added to the input by the stack), the blocks, the final norm
    /// (`ln_f`) and the head, which is the token embedding unless `tie_word_embeddings` is
    /// `false`. Load it with [`load_gpt2_lm`].
    ///
    /// # Errors
    /// As [`layer_block`](Self::layer_block).
    pub fn init_causal_lm(&self, device: &Device) -> Result<CausalLm, ImportError> {
        let block = self.shared_block()?.with_positions(Positions::Learned {
            max_len: self.n_positions,
        });
        let mut model = EncoderConfig::new(block, self.n_layer)
            .try_init(device)
            .map_err(|err| super::unbuildable(err, GPT2_NAMES))?;
        // Scores scaled by each layer's index: the blocks' own scales.
        for (index, layer) in model.layers.iter_mut().enumerate() {
            if let Some(scale) = self.layer_block(index)?.attention_scale {
                layer.self_attn.scale = scale;
            }
        }
        let (vocab, width) = (self.vocab_size, self.n_embd);
        Ok(CausalLm {
            // GPT-2's embedding has no padding row.
            pad_token: None,
            embed_tokens: EmbeddingConfig::new(vocab, width).init(device),
            model,
            lm_head: (!self.tie_word_embeddings).then(|| {
                LinearConfig::new(width, vocab)
                    .with_bias(false)
                    .init(device)
            }),
        })
    }
}

/// Loads GPT-2's language model stored under `prefix` (`""` for the original checkpoint's
/// keys, `transformer.` for `GPT2LMHeadModel`'s): `wte.weight`, `wpe.weight`, each block's
/// `h.N.*` ([`load_gpt2_block`]) and `ln_f.*`. A tied head is `wte` (a `lm_head.weight`
/// beside it is its copy, not read); a head of its own (`tie_word_embeddings: false`) is
/// `lm_head.weight` beside `transformer.` (under `prefix` less its `transformer.`).
///
/// # Errors
/// As [`load_gpt2_block`], for every key; [`ImportError::Convention`] for a model without
/// learned positions (build it with [`Gpt2Config::init_causal_lm`]).
pub fn load_gpt2_lm(
    mut lm: CausalLm,
    weights: &PyTorchWeights,
    prefix: &str,
) -> Result<CausalLm, ImportError> {
    let at = |name: &str| format!("{prefix}{name}");
    if let Some(head) = lm.lm_head {
        let outer = prefix.strip_suffix("transformer.").unwrap_or(prefix);
        let head = crate::pytorch::load_linear(head, weights, &format!("{outer}lm_head."))?;
        lm.lm_head = Some(head);
    }
    lm.embed_tokens.weight = load_param(lm.embed_tokens.weight, weights, &at("wte.weight"))?;
    let Some(AbsolutePositions::Learned(positions)) = &mut lm.model.positions else {
        return Err(ImportError::Convention {
            key: at("wpe.weight"),
            message: "GPT-2 adds learned positions to its input; build the model with \
                      Gpt2Config::init_causal_lm"
                .into(),
        });
    };
    let table = positions.embedding.weight.clone();
    positions.embedding.weight = load_param(table, weights, &at("wpe.weight"))?;
    lm.model.layers = lm
        .model
        .layers
        .into_iter()
        .enumerate()
        .map(|(i, block)| load_gpt2_block(block, weights, &at(&format!("h.{i}."))))
        .collect::<Result<Vec<_>, _>>()?;
    weights.reject_layers_past(&at("h."), lm.model.layers.len())?;
    lm.model.norm = match lm.model.norm {
        Some(norm) => Some(norm.load_pytorch(weights, &at("ln_f."))?),
        None => None,
    };
    Ok(lm)
}

/// Loads a `GPT2Block` stored under `prefix` (such as `h.0.` or `transformer.h.0.`):
/// `ln_1.*`, `attn.c_attn.*` (the packed query, key and value projection, `[n_embd, 3 ·
/// n_embd]`), `attn.c_proj.*`, `ln_2.*`, `mlp.c_fc.*`, `mlp.c_proj.*`.
///
/// # Errors
/// [`ImportError::Convention`] when `block` is not configured as GPT-2's (causal,
/// pre-norm, layer norms, biases, a packed projection, not gated, without QK-norm or
/// attention sinks: see
/// [`Gpt2Config::layer_block`]), and the import's errors naming a key.
pub fn load_gpt2_block(
    mut block: EncoderBlock,
    weights: &PyTorchWeights,
    prefix: &str,
) -> Result<EncoderBlock, ImportError> {
    let at = |name: &str| format!("{prefix}{name}");
    let differs = [
        (!block.causal, "causal"),
        (!block.norm_first, "pre-norm (norm_first)"),
        (
            block.feed_forward.up.is_some(),
            "a feed-forward of two layers (not gated)",
        ),
        (
            !matches!(block.self_attn.in_proj, InputProjection::Packed(_)),
            "one packed projection",
        ),
        (
            block.norm1.kind() != NormKind::Layer || block.norm1.beta.is_none(),
            "layer norms with biases",
        ),
        (
            block.self_attn.q_norm.is_some() || block.self_attn.sinks.is_some(),
            "without QK-norm or attention sinks",
        ),
    ];
    let wanted: Vec<&str> = differs.iter().filter(|d| d.0).map(|d| d.1).collect();
    if !wanted.is_empty() {
        return Err(ImportError::Convention {
            key: at("attn.c_attn.weight"),
            message: format!(
                "GPT-2's block is {}, which the block is not; configure it as \
                 Gpt2Config::layer_block does",
                wanted.join(", ")
            ),
        });
    }
    block.norm1 = block.norm1.load_pytorch(weights, &at("ln_1."))?;
    block.norm2 = block.norm2.load_pytorch(weights, &at("ln_2."))?;
    block.self_attn.in_proj = match block.self_attn.in_proj {
        InputProjection::Packed(linear) => {
            InputProjection::Packed(conv1d(linear, weights, &at("attn.c_attn."))?)
        }
        separate => separate,
    };
    let attention = &mut block.self_attn;
    attention.out_proj = conv1d(attention.out_proj.clone(), weights, &at("attn.c_proj."))?;
    let ff = &mut block.feed_forward;
    ff.linear1 = conv1d(ff.linear1.clone(), weights, &at("mlp.c_fc."))?;
    ff.linear2 = conv1d(ff.linear2.clone(), weights, &at("mlp.c_proj."))?;
    Ok(block)
}

/// A linear from a `Conv1D`'s `{prefix}weight` `[in, out]` (Burn's layout) and
/// `{prefix}bias` `[out]`.
fn conv1d(linear: Linear, weights: &PyTorchWeights, prefix: &str) -> Result<Linear, ImportError> {
    let Linear { weight, bias } = linear;
    Ok(Linear {
        weight: load_param(weight, weights, &format!("{prefix}weight"))?,
        bias: match bias {
            Some(bias) => Some(load_param(bias, weights, &format!("{prefix}bias"))?),
            None => None,
        },
    })
}

/// GPT-2's `config.json` names of the blocks' and the stack's fields.
const GPT2_NAMES: &[(&str, &str)] = &[
    ("d_model", "n_embd"),
    ("n_heads", "n_head"),
    ("d_ff", "n_inner"),
    ("layer_norm_eps", "layer_norm_epsilon"),
    ("n_layers", "n_layer"),
    ("block.positions", "n_positions"),
];
