//! Loading PyTorch weights: a `state_dict` saved with safetensors
//! (`safetensors.torch.save_file(model.state_dict(), path)`) loads into the matching
//! module, under an optional key prefix.
//!
//! | PyTorch | mha |
//! |---|---|
//! | `nn.MultiheadAttention(batch_first=True)` | [`MultiHeadAttention`] |
//! | `nn.TransformerEncoderLayer` | [`EncoderBlock`] |
//! | `nn.TransformerDecoderLayer` | [`DecoderBlock`] |
//! | `nn.TransformerEncoder` / `nn.TransformerDecoder` | [`Encoder`] / [`Decoder`] |
//!
//! Build the module from a configuration that matches the PyTorch one (sizes, bias,
//! `norm_first`, activation), then call [`LoadPyTorch::load_pytorch`]. PyTorch stores a
//! linear weight as `[out, in]`; Burn as `[in, out]`: the import transposes. A missing
//! key, a key the module has no place for (such as `bias_k` of `add_bias_kv=True`), or a
//! shape that differs is an [`ImportError`] naming the key and both shapes.
//!
//! Dtypes: [`PyTorchWeights`] keeps each tensor as it is stored (f32, f64, f16 or bf16),
//! and the import gives every parameter the dtype the module's parameter already has, as
//! PyTorch's `load_state_dict` copies into the module's dtype. A module cast to bf16
//! ([`ModuleDType::to_dtype`](crate::ModuleDType::to_dtype)) loads a bf16 file bit for
//! bit; an f32 module loads it into f32 exactly (every bf16 value is an f32 value).

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};

use burn::module::Param;
use burn::nn::Linear;
use burn::tensor::{DType, Device, Tensor, TensorData};
use safetensors::{Dtype, SafeTensors};

use crate::block::{DecoderBlock, EncoderBlock, FeedForward};
use crate::mha::{InputProjection, MultiHeadAttention, SeparateProjection};
use crate::norm::LayerNorm;
use crate::stack::{Decoder, Encoder};

/// Why weights could not be imported.
#[derive(Debug)]
pub enum ImportError {
    /// The file could not be read.
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The bytes are not a safetensors file.
    Format {
        /// Where the bytes came from.
        source: String,
        /// What the parser said.
        message: String,
    },
    /// The module needs a key the weights lack.
    MissingKey {
        /// The full key, prefix included.
        key: String,
    },
    /// The weights hold a key the module has no place for.
    UnexpectedKey {
        /// The full key.
        key: String,
        /// Why the module cannot take it.
        reason: &'static str,
    },
    /// A tensor has a different shape than the module expects (in PyTorch's layout).
    Shape {
        /// The full key.
        key: String,
        /// The shape the module expects.
        expected: Vec<usize>,
        /// The shape in the weights.
        found: Vec<usize>,
    },
    /// A tensor is not a floating-point type.
    Dtype {
        /// The full key.
        key: String,
        /// The stored type.
        dtype: String,
    },
    /// A tensor was asked for in a dtype its device does not compute in.
    DeviceDtype {
        /// The full key.
        key: String,
        /// The dtype asked for (the stored one, for [`PyTorchWeights::tensor`]).
        dtype: DType,
        /// The device, as `Debug` prints it.
        device: String,
    },
}

impl fmt::Display for ImportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Io { path, source } => write!(f, "cannot read {}: {source}", path.display()),
            Self::Format { source, message } => {
                write!(f, "{source} is not a safetensors file: {message}")
            }
            Self::MissingKey { key } => write!(f, "missing key `{key}`"),
            Self::UnexpectedKey { key, reason } => write!(f, "unexpected key `{key}`: {reason}"),
            Self::Shape {
                key,
                expected,
                found,
            } => write!(
                f,
                "key `{key}`: expected shape {expected:?}, found {found:?}"
            ),
            Self::Dtype { key, dtype } => {
                write!(f, "key `{key}`: expected a float tensor, found {dtype}")
            }
            Self::DeviceDtype { key, dtype, device } => write!(
                f,
                "key `{key}`: {}, which the device {device} does not compute in (ask for \
                 another dtype with PyTorchWeights::tensor_as)",
                dtype.name()
            ),
        }
    }
}

impl std::error::Error for ImportError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Io { source, .. } => Some(source),
            _ => None,
        }
    }
}

/// The tensors of a PyTorch `state_dict`, by key, each in the float dtype it is stored in.
#[derive(Clone, Debug)]
pub struct PyTorchWeights {
    tensors: HashMap<String, TensorData>,
    /// Keys of tensors that are not floating point, with their type: an error only when
    /// a module asks for one (a full model's `state_dict` may hold integer buffers).
    others: HashMap<String, String>,
}

impl PyTorchWeights {
    /// Reads a safetensors file.
    ///
    /// # Errors
    /// [`ImportError::Io`] when it cannot be read, [`ImportError::Format`] when it is not
    /// safetensors.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ImportError> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| ImportError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_bytes(&bytes, &path.display().to_string())
    }

    /// Parses safetensors bytes; `source` names them in errors.
    ///
    /// # Errors
    /// [`ImportError::Format`] when the bytes are not safetensors.
    pub fn from_bytes(bytes: &[u8], source: &str) -> Result<Self, ImportError> {
        let file = SafeTensors::deserialize(bytes).map_err(|err| ImportError::Format {
            source: source.to_string(),
            message: err.to_string(),
        })?;
        let mut tensors = HashMap::new();
        let mut others = HashMap::new();
        for (key, view) in file.tensors() {
            let dtype = match view.dtype() {
                Dtype::F32 => DType::F32,
                Dtype::F64 => DType::F64,
                Dtype::F16 => DType::F16,
                Dtype::BF16 => DType::BF16,
                other => {
                    others.insert(key, format!("{other:?}"));
                    continue;
                }
            };
            let bytes = view.data().to_vec();
            let data = TensorData::from_bytes_vec(bytes, view.shape().to_vec(), dtype);
            tensors.insert(key, data);
        }
        Ok(Self { tensors, others })
    }

    /// The keys, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.tensors
            .keys()
            .chain(self.others.keys())
            .map(String::as_str)
    }

    /// Whether `key` is present.
    pub fn contains(&self, key: &str) -> bool {
        self.tensors.contains_key(key) || self.others.contains_key(key)
    }

    /// The float dtype `key` is stored in; `None` when the key is absent or not a float.
    pub fn dtype(&self, key: &str) -> Option<DType> {
        self.tensors.get(key).map(TensorData::dtype)
    }

    /// The tensor under `key` in the dtype it is stored in, checked to have shape
    /// `expected`.
    ///
    /// # Errors
    /// [`ImportError::MissingKey`], [`ImportError::Dtype`], [`ImportError::Shape`], or
    /// [`ImportError::DeviceDtype`] when `device` does not compute in the stored dtype
    /// (bf16 on ndarray, say).
    pub fn tensor<const D: usize>(
        &self,
        key: &str,
        expected: [usize; D],
        device: &Device,
    ) -> Result<Tensor<D>, ImportError> {
        let dtype = self.data(key, &expected)?.dtype();
        self.tensor_as(key, expected, dtype, device)
    }

    /// The tensor under `key` converted to `dtype` (on the host, before it reaches the
    /// device), checked to have shape `expected`.
    ///
    /// # Errors
    /// As [`tensor`](Self::tensor), [`ImportError::DeviceDtype`] when `device` does not
    /// compute in `dtype`.
    pub fn tensor_as<const D: usize>(
        &self,
        key: &str,
        expected: [usize; D],
        dtype: impl Into<DType>,
        device: &Device,
    ) -> Result<Tensor<D>, ImportError> {
        let data = self.data(key, &expected)?;
        let dtype = dtype.into();
        if !(dtype.is_float() && device.supports_dtype(dtype)) {
            return Err(ImportError::DeviceDtype {
                key: key.to_string(),
                dtype,
                device: format!("{device:?}"),
            });
        }
        Ok(Tensor::from_data(data.clone(), (device, dtype)))
    }

    /// The data under `key`, checked to be a float tensor of shape `expected`.
    fn data(&self, key: &str, expected: &[usize]) -> Result<&TensorData, ImportError> {
        if let Some(dtype) = self.others.get(key) {
            return Err(ImportError::Dtype {
                key: key.to_string(),
                dtype: dtype.clone(),
            });
        }
        let data = self
            .tensors
            .get(key)
            .ok_or_else(|| ImportError::MissingKey {
                key: key.to_string(),
            })?;
        let found = data.shape().to_vec();
        if found != expected {
            return Err(ImportError::Shape {
                key: key.to_string(),
                expected: expected.to_vec(),
                found,
            });
        }
        Ok(data)
    }

    /// Fails with [`ImportError::UnexpectedKey`] if `key` is present.
    fn reject(&self, key: String, reason: &'static str) -> Result<(), ImportError> {
        match self.contains(&key) {
            true => Err(ImportError::UnexpectedKey { key, reason }),
            false => Ok(()),
        }
    }
}

/// A module whose parameters can be replaced by those of the matching PyTorch module.
pub trait LoadPyTorch: Sized {
    /// Replaces every parameter with the one stored under `prefix` (e.g. `"encoder."`,
    /// or `""` for a bare module) and returns the module.
    ///
    /// # Errors
    /// An [`ImportError`] naming the key, when a key is missing, unexpected, or of
    /// another shape than this module's configuration implies.
    fn load_pytorch(self, weights: &PyTorchWeights, prefix: &str) -> Result<Self, ImportError>;
}

/// Replaces a parameter's value, keeping its id and whether it is trained.
fn set<const D: usize>(param: Param<Tensor<D>>, value: Tensor<D>) -> Param<Tensor<D>> {
    param.map(|old| value.set_require_grad(old.is_require_grad()))
}

/// Where a parameter lives: the device and dtype a loaded value takes, as PyTorch's
/// `load_state_dict` copies into the parameter's own dtype.
struct Place {
    device: Device,
    dtype: DType,
}

impl Place {
    fn of<const D: usize>(param: &Param<Tensor<D>>) -> Self {
        let value = param.val();
        Self {
            device: value.device(),
            dtype: value.dtype(),
        }
    }

    /// The tensor under `key`, of shape `shape`, in this place's dtype.
    fn load<const D: usize>(
        &self,
        weights: &PyTorchWeights,
        key: &str,
        shape: [usize; D],
    ) -> Result<Tensor<D>, ImportError> {
        weights.tensor_as(key, shape, self.dtype, &self.device)
    }
}

/// Where a linear parameter is stored: the key, and for packed tensors (PyTorch's
/// `in_proj_*`) the total rows and the first row of this linear's block.
struct Stored<'a> {
    key: &'a str,
    packed: Option<(usize, usize)>,
}

impl<'a> Stored<'a> {
    fn whole(key: &'a str) -> Self {
        Self { key, packed: None }
    }

    fn rows(key: &'a str, total: usize, start: usize) -> Self {
        Self {
            key,
            packed: Some((total, start)),
        }
    }

    /// Loads `[rows, ..rest]`, checked whole, then cuts out this linear's `len` rows.
    fn load<const D: usize>(
        &self,
        weights: &PyTorchWeights,
        len: usize,
        rest: [usize; D],
        place: &Place,
    ) -> Result<Tensor<D>, ImportError> {
        let (total, start) = self.packed.unwrap_or((len, 0));
        let mut shape = rest;
        shape[0] = total;
        Ok(place.load(weights, self.key, shape)?.narrow(0, start, len))
    }
}

/// Loads a linear from PyTorch's `weight` `[out, in]` (transposed into Burn's
/// `[in, out]`) and `bias` `[out]`.
fn load_linear_from(
    linear: Linear,
    weights: &PyTorchWeights,
    weight_at: Stored,
    bias_at: Stored,
) -> Result<Linear, ImportError> {
    let [d_in, d_out] = linear.weight.shape().dims::<2>();
    let Linear { weight, bias } = linear;
    let w = weight_at.load(weights, d_out, [0, d_in], &Place::of(&weight))?;
    let weight = set(weight, w.transpose());
    let bias = match bias {
        Some(bias) => {
            let b = bias_at.load(weights, d_out, [0], &Place::of(&bias))?;
            Some(set(bias, b))
        }
        None => {
            weights.reject(
                bias_at.key.to_string(),
                "the module was configured without bias",
            )?;
            None
        }
    };
    Ok(Linear { weight, bias })
}

fn load_linear(
    linear: Linear,
    weights: &PyTorchWeights,
    prefix: &str,
) -> Result<Linear, ImportError> {
    let (weight, bias) = (format!("{prefix}weight"), format!("{prefix}bias"));
    load_linear_from(
        linear,
        weights,
        Stored::whole(&weight),
        Stored::whole(&bias),
    )
}

impl LoadPyTorch for LayerNorm {
    /// Keys of `nn.LayerNorm`: `weight` (`γ`), `bias` (`β`; refused when the norm has
    /// none).
    fn load_pytorch(self, weights: &PyTorchWeights, prefix: &str) -> Result<Self, ImportError> {
        let [d] = self.gamma.shape().dims::<1>();
        let mut norm = self;
        let gamma = Place::of(&norm.gamma).load(weights, &format!("{prefix}weight"), [d])?;
        norm.gamma = set(norm.gamma, gamma);
        norm.beta = match norm.beta {
            Some(beta) => {
                let value = Place::of(&beta).load(weights, &format!("{prefix}bias"), [d])?;
                Some(set(beta, value))
            }
            None => {
                weights.reject(
                    format!("{prefix}bias"),
                    "the module was configured without bias",
                )?;
                None
            }
        };
        Ok(norm)
    }
}

impl LoadPyTorch for MultiHeadAttention {
    /// Keys: `in_proj_weight` (or `q_proj_weight`, `k_proj_weight`, `v_proj_weight` when
    /// `kdim`/`vdim` differ), `in_proj_bias`, `out_proj.weight`, `out_proj.bias`.
    fn load_pytorch(mut self, weights: &PyTorchWeights, prefix: &str) -> Result<Self, ImportError> {
        for extra in ["bias_k", "bias_v"] {
            weights.reject(
                format!("{prefix}{extra}"),
                "add_bias_kv=True has no counterpart in MultiHeadAttention",
            )?;
        }
        let q_width = self.n_heads * self.head_dim;
        let kv_width = self.n_kv_heads * self.head_dim;
        let total = q_width + 2 * kv_width;
        let bias = format!("{prefix}in_proj_bias");
        self.in_proj = match self.in_proj {
            InputProjection::Packed(proj) => {
                let weight = format!("{prefix}in_proj_weight");
                InputProjection::Packed(load_linear_from(
                    proj,
                    weights,
                    Stored::rows(&weight, total, 0),
                    Stored::rows(&bias, total, 0),
                )?)
            }
            InputProjection::Separate(p) => {
                // Separate weights, but PyTorch still packs the three biases.
                let (q, k, v) = (
                    format!("{prefix}q_proj_weight"),
                    format!("{prefix}k_proj_weight"),
                    format!("{prefix}v_proj_weight"),
                );
                InputProjection::Separate(SeparateProjection {
                    q_proj: load_linear_from(
                        p.q_proj,
                        weights,
                        Stored::whole(&q),
                        Stored::rows(&bias, total, 0),
                    )?,
                    k_proj: load_linear_from(
                        p.k_proj,
                        weights,
                        Stored::whole(&k),
                        Stored::rows(&bias, total, q_width),
                    )?,
                    v_proj: load_linear_from(
                        p.v_proj,
                        weights,
                        Stored::whole(&v),
                        Stored::rows(&bias, total, q_width + kv_width),
                    )?,
                })
            }
        };
        self.out_proj = load_linear(self.out_proj, weights, &format!("{prefix}out_proj."))?;
        Ok(self)
    }
}

impl LoadPyTorch for FeedForward {
    /// Keys: `linear1.*`, `linear2.*` (PyTorch's layer keeps them at the layer's top).
    fn load_pytorch(mut self, weights: &PyTorchWeights, prefix: &str) -> Result<Self, ImportError> {
        self.linear1 = load_linear(self.linear1, weights, &format!("{prefix}linear1."))?;
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
        .collect::<Result<_, _>>()?;
    let norm = match norm {
        Some(norm) => Some(norm.load_pytorch(weights, &format!("{prefix}norm."))?),
        None => {
            weights.reject(
                format!("{prefix}norm.weight"),
                "the stack has no final norm (post-norm configuration)",
            )?;
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
