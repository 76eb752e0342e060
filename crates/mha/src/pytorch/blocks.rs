//! The importers of layers built on attention: layer norm, the feed-forward, PyTorch's
//! transformer encoder and decoder layers and their stacks.

use super::*;

impl LoadPyTorch for LayerNorm {
    /// Keys of `nn.LayerNorm`: `weight` (`γ`), `bias` (`β`; refused when the norm has
    /// none); of an RMS norm (`LlamaRMSNorm`, `nn.RMSNorm`): `weight`. Where `weight` is
    /// absent, the names of checkpoints converted from TensorFlow (`bert-base-uncased`'s),
    /// `gamma` and `beta`, as `transformers` reads them.
    fn load_pytorch(self, weights: &PyTorchWeights, prefix: &str) -> Result<Self, ImportError> {
        let legacy = !weights.contains(&format!("{prefix}weight"))
            && weights.contains(&format!("{prefix}gamma"));
        let [scale, shift] = match legacy {
            true => ["gamma", "beta"],
            false => ["weight", "bias"],
        }
        .map(|name| format!("{prefix}{name}"));
        let mut norm = self;
        norm.gamma = load_param(norm.gamma, weights, &scale)?;
        norm.beta = match norm.beta {
            Some(beta) => Some(load_param(beta, weights, &shift)?),
            None => {
                let reason = match norm.kind() {
                    NormKind::Layer => "the module was configured without bias",
                    NormKind::Rms => "an RMS norm has no shift",
                };
                weights.reject(shift, reason)?;
                None
            }
        };
        Ok(norm)
    }
}

impl LoadPyTorch for FeedForward {
    /// Keys: `linear1.*`, `linear2.*` (PyTorch's layer keeps them at the layer's top), and
    /// a gated feed-forward's `up.*` (refused for one that is not gated).
    fn load_pytorch(mut self, weights: &PyTorchWeights, prefix: &str) -> Result<Self, ImportError> {
        self.linear1 = load_linear(self.linear1, weights, &format!("{prefix}linear1."))?;
        self.up = match self.up {
            Some(up) => Some(load_linear(up, weights, &format!("{prefix}up."))?),
            None => {
                weights.reject(
                    format!("{prefix}up.weight"),
                    "the feed-forward was configured without gating (`gated`)",
                )?;
                None
            }
        };
        self.linear2 = load_linear(self.linear2, weights, &format!("{prefix}linear2."))?;
        Ok(self)
    }
}

impl LoadPyTorch for EncoderBlock {
    /// Keys of `nn.TransformerEncoderLayer`: `self_attn.*`, `linear1.*`, `linear2.*`,
    /// `norm1.*`, `norm2.*`.
    fn load_pytorch(mut self, weights: &PyTorchWeights, prefix: &str) -> Result<Self, ImportError> {
        self.self_attn = self
            .self_attn
            .load_pytorch(weights, &format!("{prefix}self_attn."))?;
        self.feed_forward = self.feed_forward.load_pytorch(weights, prefix)?;
        self.norm1 = self
            .norm1
            .load_pytorch(weights, &format!("{prefix}norm1."))?;
        self.norm2 = self
            .norm2
            .load_pytorch(weights, &format!("{prefix}norm2."))?;
        // A decoder layer's weights have a cross-attention this block lacks.
        for key in ["multihead_attn.out_proj.weight", "norm3.weight"] {
            weights.reject(
                format!("{prefix}{key}"),
                "an encoder block has no cross-attention (a decoder layer loads into \
                 DecoderBlock)",
            )?;
        }
        Ok(self)
    }
}

impl LoadPyTorch for DecoderBlock {
    /// Keys of `nn.TransformerDecoderLayer`: `self_attn.*`, `multihead_attn.*`,
    /// `linear1.*`, `linear2.*`, `norm1.*`, `norm2.*`, `norm3.*`.
    fn load_pytorch(mut self, weights: &PyTorchWeights, prefix: &str) -> Result<Self, ImportError> {
        self.self_attn = self
            .self_attn
            .load_pytorch(weights, &format!("{prefix}self_attn."))?;
        self.cross_attn = self
            .cross_attn
            .load_pytorch(weights, &format!("{prefix}multihead_attn."))?;
        self.feed_forward = self.feed_forward.load_pytorch(weights, prefix)?;
        self.norm1 = self
            .norm1
            .load_pytorch(weights, &format!("{prefix}norm1."))?;
        self.norm2 = self
            .norm2
            .load_pytorch(weights, &format!("{prefix}norm2."))?;
        self.norm3 = self
            .norm3
            .load_pytorch(weights, &format!("{prefix}norm3."))?;
        Ok(self)
    }
}

/// Loads `layers.{i}.*` and, when the stack has one, `norm.*`.
fn load_stack<L: LoadPyTorch>(
    layers: Vec<L>,
    norm: Option<LayerNorm>,
    weights: &PyTorchWeights,
    prefix: &str,
) -> Result<(Vec<L>, Option<LayerNorm>), ImportError> {
    let layers = layers
        .into_iter()
        .enumerate()
        .map(|(i, layer)| layer.load_pytorch(weights, &format!("{prefix}layers.{i}.")))
        .collect::<Result<Vec<_>, _>>()?;
    weights.reject_layers_past(&format!("{prefix}layers."), layers.len())?;
    let norm = match norm {
        Some(_)
            if !weights.contains(&format!("{prefix}norm.weight"))
                && !weights.contains(&format!("{prefix}norm.gamma")) =>
        {
            return Err(ImportError::Convention {
                key: format!("{prefix}norm.weight"),
                message: "missing: the stack has a final norm (pre-norm blocks, or \
                          `final_norm: Some(true)` in its configuration) and the weights \
                          none (PyTorch's `norm=None`): configure `final_norm: Some(false)`"
                    .into(),
            });
        }
        Some(norm) => Some(norm.load_pytorch(weights, &format!("{prefix}norm."))?),
        None => {
            for name in ["weight", "gamma"] {
                weights.reject(
                    format!("{prefix}norm.{name}"),
                    "the stack has no final norm (post-norm blocks, or `final_norm: \
                     Some(false)` in its configuration; `Some(true)` gives it one)",
                )?;
            }
            None
        }
    };
    Ok((layers, norm))
}

impl LoadPyTorch for Encoder {
    /// Keys of `nn.TransformerEncoder`: `layers.{i}.*`, `norm.*` (PyTorch's stack has no
    /// positions: the stack's own, if any, keep their values).
    fn load_pytorch(self, weights: &PyTorchWeights, prefix: &str) -> Result<Self, ImportError> {
        let (layers, norm) = load_stack(self.layers, self.norm, weights, prefix)?;
        Ok(Self {
            layers,
            norm,
            positions: self.positions,
        })
    }
}

impl LoadPyTorch for Decoder {
    /// Keys of `nn.TransformerDecoder`: `layers.{i}.*`, `norm.*` (PyTorch's stack has no
    /// positions: the stack's own, if any, keep their values).
    fn load_pytorch(self, weights: &PyTorchWeights, prefix: &str) -> Result<Self, ImportError> {
        let (layers, norm) = load_stack(self.layers, self.norm, weights, prefix)?;
        Ok(Self {
            layers,
            norm,
            positions: self.positions,
        })
    }
}
