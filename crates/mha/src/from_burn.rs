//! Burn's own attention module ([`burn::nn::attention::MultiHeadAttention`]) as this
//! crate's: its weights, its dropout, its biases and its `quiet_softmax`, so that a model
//! trained with Burn's module moves here without training again; and Burn's transformer
//! (its encoder and decoder, their layers, position-wise feed-forward and layer norm) as
//! this crate's blocks and stacks, with the same numbers.
//!
//! Burn's `query`, `key` and `value` linears (`[d_model, d_model]` each, Burn's `[in, out]`
//! layout, as this crate's) become the columns of one packed projection, in that order;
//! `output` is the output projection. A projection Burn built without a bias gets zeros in
//! the packed bias: the same numbers (trained further, they may move). `quiet_softmax`
//! (`exp(s) / (1 + Σ exp)`) is a sink logit of 0 in every head, kept fixed (not trained):
//! the configuration's `quiet_softmax`, which a module built to load the converted one's
//! record takes too.
//! The packed projection is a parameter of its own (a leaf, as after a load), trained
//! whether Burn's were or not.
//! Burn puts `min_float` (-1e4 by default) in place of a blocked score: a row whose keys
//! are all blocked is uniform over them there with the ordinary softmax (0 with its quiet
//! one), and 0 here. Every other row is the same where Burn's blocked keys get no weight,
//! `exp(min_float - m)` rounding to 0 for the row's largest visible score `m`: in f32
//! where `m > min_float + 104` (with the default, every score above -9896); a
//! `min_float` near the scores (-10, say) leaves Burn's blocked keys some weight, which
//! here they never have.

use burn::module::{Content, DisplaySettings, ModuleDisplay, Param};
use burn::nn::Linear;
use burn::nn::activation::Activation;
use burn::nn::attention::MultiHeadAttention as BurnAttention;
use burn::nn::transformer::{
    PositionWiseFeedForward, TransformerDecoder, TransformerDecoderLayer, TransformerEncoder,
    TransformerEncoderLayer,
};
use burn::tensor::Tensor;

use crate::block::{DecoderBlock, EncoderBlock, FeedForward, FeedForwardActivation};
use crate::error::ConversionError;
use crate::mha::{InputProjection, MultiHeadAttention, MultiHeadAttentionConfig};
use crate::norm::LayerNorm;
use crate::stack::{Decoder, Encoder};

/// Burn's attention module with its weights and settings (see the module docs: the packed
/// projection, the biases, `quiet_softmax` as fixed sinks of 0). Of a quantized module
/// (`quantize_weights`), the query, key and value projections are packed dequantized (a
/// concatenation of quantized tensors would quantize them again, on one new scale); the
/// output projection stays as it is.
impl From<BurnAttention> for MultiHeadAttention {
    fn from(burn: BurnAttention) -> Self {
        let value = |param: &Param<Tensor<_>>| crate::dtype::float_value(param.val());
        let weight = value(&burn.query.weight);
        let (device, dtype) = (weight.device(), weight.dtype());
        let [d_model, n_heads] = [burn.d_model, burn.n_heads];
        let linears = [&burn.query, &burn.key, &burn.value];
        let any_bias = linears.iter().any(|l| l.bias.is_some());
        let mut module = MultiHeadAttentionConfig::new(d_model, n_heads)
            .with_dropout(burn.dropout.prob)
            .with_bias(any_bias)
            .with_out_bias(Some(burn.output.bias.is_some()))
            .with_quiet_softmax(burn.quiet_softmax)
            .init(&device);
        let weights = linears.iter().map(|l| value(&l.weight)).collect();
        let bias = any_bias.then(|| {
            let biases = linears.iter().map(|l| match &l.bias {
                Some(bias) => crate::dtype::float_value(bias.val()),
                None => Tensor::zeros([d_model], (&device, dtype)),
            });
            Param::from_tensor(Tensor::cat(biases.collect(), 0).detach())
        });
        module.in_proj = InputProjection::Packed(Linear {
            weight: Param::from_tensor(Tensor::cat(weights, 1).detach()),
            bias,
        });
        module.out_proj = burn.output;
        // Burn's dropout itself: its probability and whether it behaves as in training
        // (cleared by `freeze`).
        module.dropout = burn.dropout;
        // Fixed logits of 0 (the configuration's `quiet_softmax`), in the weights' dtype.
        module.sinks = module.sinks.map(|_| {
            let zeros = Tensor::zeros([n_heads], (&device, dtype));
            Param::from_tensor(zeros).set_require_grad(false)
        });
        module
    }
}

/// Burn's layer norm with its parameters and epsilon (read from what the module displays:
/// Burn keeps it private).
impl From<burn::nn::LayerNorm> for LayerNorm {
    fn from(burn: burn::nn::LayerNorm) -> Self {
        let content = burn
            .custom_content(Content::new(DisplaySettings::new()))
            .expect("Burn's LayerNorm displays its settings");
        let epsilon = content
            .attributes
            .iter()
            .find(|a| a.name == "epsilon")
            .and_then(|a| a.value.parse::<f64>().ok())
            .expect("Burn's LayerNorm displays its epsilon as a number");
        LayerNorm::layer(burn.gamma, burn.beta, epsilon)
    }
}

/// Burn's position-wise feed-forward with its weights, dropout and activation: GELU
/// (exact or tanh) and ReLU convert, its other activations are refused by name.
impl TryFrom<PositionWiseFeedForward> for FeedForward {
    type Error = ConversionError;

    fn try_from(burn: PositionWiseFeedForward) -> Result<Self, ConversionError> {
        let activation = match &burn.activation {
            Activation::Gelu(gelu) if gelu.approximate => FeedForwardActivation::GeluTanh,
            Activation::Gelu(_) => FeedForwardActivation::Gelu,
            Activation::Relu(_) => FeedForwardActivation::Relu,
            other => {
                // The variant's name, as `Debug` begins it (`Tanh(Tanh)`, `LeakyRelu(..)`).
                let debug = format!("{other:?}");
                let name = debug.split(['(', ' ', '{']).next().unwrap_or(&debug);
                return Err(ConversionError {
                    module: "PositionWiseFeedForward",
                    field: "activation",
                    message: format!(
                        "Burn's {name} has no counterpart here (GELU, exact or tanh, and ReLU \
                         convert)"
                    ),
                });
            }
        };
        Ok(FeedForward {
            linear1: burn.linear_inner,
            activation,
            up: None,
            dropout: burn.dropout,
            linear2: burn.linear_outer,
        })
    }
}

/// The error of a layer's feed-forward, named as the layer's part.
fn layer_part(module: &'static str, error: ConversionError) -> ConversionError {
    ConversionError {
        module,
        field: "pwff.activation",
        message: error.message,
    }
}

/// Burn's encoder layer with its numbers: its attention (see [`MultiHeadAttention`]'s
/// `From`), feed-forward (GELU or ReLU; another activation is refused), norms and
/// dropout, post-norm or pre-norm as it was. Burn's pre-norm layer normalises the
/// attention's input with `norm_2` and the feed-forward's with `norm_1`: here they are
/// `norm1` and `norm2`, the norms of those branches. Not causal (Burn's layer is causal
/// only through the mask it is given): set `causal` to decode with a cache.
impl TryFrom<TransformerEncoderLayer> for EncoderBlock {
    type Error = ConversionError;

    fn try_from(burn: TransformerEncoderLayer) -> Result<Self, ConversionError> {
        let feed_forward = FeedForward::try_from(burn.pwff)
            .map_err(|e| layer_part("TransformerEncoderLayer", e))?;
        let (norm1, norm2) = match burn.norm_first {
            true => (burn.norm_2, burn.norm_1),
            false => (burn.norm_1, burn.norm_2),
        };
        Ok(EncoderBlock {
            self_attn: burn.mha.into(),
            feed_forward,
            norm1: norm1.into(),
            norm2: norm2.into(),
            dropout1: burn.dropout.clone(),
            dropout2: burn.dropout,
            norm_first: burn.norm_first,
            causal: false,
            window: None,
        })
    }
}

/// Burn's decoder layer with its numbers, as its encoder layer's (see [`EncoderBlock`]'s
/// `TryFrom`): Burn's pre-norm layer normalises the self-attention's input with `norm_3`,
/// the cross-attention's with `norm_1` and the feed-forward's with `norm_2`; here they are
/// `norm1`, `norm2` and `norm3`, in the order of the branches. Not causal (Burn's decoder
/// is causal only through the `target_mask_attn` it is given): set `causal`, in place of
/// that mask, to decode with a cache.
impl TryFrom<TransformerDecoderLayer> for DecoderBlock {
    type Error = ConversionError;

    fn try_from(burn: TransformerDecoderLayer) -> Result<Self, ConversionError> {
        let feed_forward = FeedForward::try_from(burn.pwff)
            .map_err(|e| layer_part("TransformerDecoderLayer", e))?;
        let (norm1, norm2, norm3) = match burn.norm_first {
            true => (burn.norm_3, burn.norm_1, burn.norm_2),
            false => (burn.norm_1, burn.norm_2, burn.norm_3),
        };
        Ok(DecoderBlock {
            self_attn: burn.self_attn.into(),
            cross_attn: burn.cross_attn.into(),
            feed_forward,
            norm1: norm1.into(),
            norm2: norm2.into(),
            norm3: norm3.into(),
            dropout1: burn.dropout.clone(),
            dropout2: burn.dropout.clone(),
            dropout3: burn.dropout,
            norm_first: burn.norm_first,
            causal: false,
        })
    }
}

/// Burn's encoder: its layers (see [`EncoderBlock`]'s `TryFrom`), no final norm and no
/// positions, as Burn's.
impl TryFrom<TransformerEncoder> for Encoder {
    type Error = ConversionError;

    fn try_from(burn: TransformerEncoder) -> Result<Self, ConversionError> {
        Ok(Encoder {
            layers: burn
                .layers
                .into_iter()
                .map(EncoderBlock::try_from)
                .collect::<Result<_, _>>()?,
            norm: None,
            positions: None,
        })
    }
}

/// Burn's decoder: its layers (see [`DecoderBlock`]'s `TryFrom`), no final norm and no
/// positions, as Burn's.
impl TryFrom<TransformerDecoder> for Decoder {
    type Error = ConversionError;

    fn try_from(burn: TransformerDecoder) -> Result<Self, ConversionError> {
        Ok(Decoder {
            layers: burn
                .layers
                .into_iter()
                .map(DecoderBlock::try_from)
                .collect::<Result<_, _>>()?,
            norm: None,
            positions: None,
        })
    }
}
