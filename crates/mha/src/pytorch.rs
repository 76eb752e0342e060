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
//! Hugging Face's T5 attention (`transformers`' `T5Attention`, keys `q.weight`,
//! `k.weight`, `v.weight`, `o.weight`, and in the first layer of each stack
//! `relative_attention_bias.weight`) loads into a [`MultiHeadAttention`] configured as
//! T5 computes:
//!
//! ```
//! # use burn::tensor::Device;
//! use mha::{MultiHeadAttentionConfig, Positions};
//! // T5Config(d_model=512, num_heads=8, d_kv=64), an encoder's self-attention.
//! let t5 = MultiHeadAttentionConfig::new(512, 8) // heads d_model / num_heads = d_kv wide
//!     .with_bias(false) // no biases in q, k, v, o
//!     .with_scale(Some(1.0)) // T5 does not scale the scores
//!     .with_positions(Positions::T5 {
//!         num_buckets: 32,     // relative_attention_num_buckets
//!         max_distance: 128,   // relative_attention_max_distance
//!         bidirectional: true, // not is_decoder (a decoder's self-attention: false, causal)
//!     });
//! # t5.init(&Device::default());
//! ```
//!
//! A configuration that cannot give T5's numbers (biases, a scale other than 1,
//! `num_heads · d_kv != d_model`, positions other than T5's) is an
//! [`ImportError::Convention`] saying what to change. The table's layouts differ:
//! Hugging Face's embedding is `[buckets, heads]`, [`MultiHeadAttention::position_table`]
//! `[heads, buckets]`; the import transposes. T5 keeps the table in the first layer of a
//! stack and lends it to the others; each mha module has its own: give the others the
//! first one's (`layer.position_table = first.position_table.clone()`). T5's layer norms
//! are RMS norms without a shift, which the blocks do not have: the import covers T5's
//! attention, not its blocks.
//!
//! Learned relative-position tables of other PyTorch code load from the key
//! `position_table`, in mha's layout and convention: `[heads, buckets]`, indexed by the
//! bucket of `key - query` (see [`Buckets`](crate::Buckets) for how to turn a table
//! indexed by `query - key` into this one).
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
use crate::positions::Positions;
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
    /// The weights follow a convention the module's configuration does not match (say
    /// Hugging Face's T5, whose scores are not scaled, in a module that scales them), or
    /// lack what the configuration needs (a learned position table).
    Convention {
        /// The full key.
        key: String,
        /// What differs and what to configure.
        message: String,
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
            Self::Convention { key, message } => write!(f, "key `{key}`: {message}"),
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

    /// The shape of the float tensor under `key`; `None` when the key is absent or not a
    /// float.
    pub fn shape(&self, key: &str) -> Option<Vec<usize>> {
        self.tensors.get(key).map(|data| data.shape().to_vec())
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
    /// Keys of `nn.MultiheadAttention`: `in_proj_weight` (or `q_proj_weight`,
    /// `k_proj_weight`, `v_proj_weight` when `kdim`/`vdim` differ), `in_proj_bias`,
    /// `out_proj.weight`, `out_proj.bias`; or those of Hugging Face's `T5Attention`
    /// (`q.weight`, `k.weight`, `v.weight`, `o.weight`), when `q.weight` is there and
    /// `in_proj_weight` is not (see the [module docs](self) for what T5 needs).
    ///
    /// A module with a learned relative-position table ([`Positions::Relative`],
    /// [`Positions::T5`]) loads it too, from `position_table` `[H, buckets]` or T5's
    /// `relative_attention_bias.weight` `[buckets, H]`: weights without one are an error,
    /// not a table of zeros.
    fn load_pytorch(self, weights: &PyTorchWeights, prefix: &str) -> Result<Self, ImportError> {
        let t5 = weights.contains(&format!("{prefix}q.weight"))
            && !weights.contains(&format!("{prefix}in_proj_weight"));
        let mut mha = match t5 {
            true => load_t5(self, weights, prefix)?,
            false => load_torch_mha(self, weights, prefix)?,
        };
        mha.position_table = load_position_table(&mha, weights, prefix)?;
        Ok(mha)
    }
}

/// The projections of `nn.MultiheadAttention`.
fn load_torch_mha(
    mut mha: MultiHeadAttention,
    weights: &PyTorchWeights,
    prefix: &str,
) -> Result<MultiHeadAttention, ImportError> {
    for extra in ["bias_k", "bias_v"] {
        weights.reject(
            format!("{prefix}{extra}"),
            "add_bias_kv=True has no counterpart in MultiHeadAttention",
        )?;
    }
    let q_width = mha.n_heads * mha.head_dim;
    let kv_width = mha.n_kv_heads * mha.head_dim;
    let total = q_width + 2 * kv_width;
    let bias = format!("{prefix}in_proj_bias");
    mha.in_proj = match mha.in_proj {
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
    mha.out_proj = load_linear(mha.out_proj, weights, &format!("{prefix}out_proj."))?;
    Ok(mha)
}

/// The projections of Hugging Face's `T5Attention` (`transformers`): `q.weight`,
/// `k.weight`, `v.weight` `[num_heads · d_kv, d_model]` and `o.weight`
/// `[d_model, num_heads · d_kv]`, without biases. Its scores are not scaled (T5 folds
/// `1/sqrt(d_kv)` into its initialisation) and its heads are `d_kv` wide: the module must
/// be configured `with_bias(false)` and `with_scale(Some(1.0))`, with heads
/// `d_model / n_heads = d_kv` wide; anything else is an [`ImportError::Convention`]
/// saying what to change, since the numbers would differ.
fn load_t5(
    mut mha: MultiHeadAttention,
    weights: &PyTorchWeights,
    prefix: &str,
) -> Result<MultiHeadAttention, ImportError> {
    let key = |name: &str| format!("{prefix}{name}");
    let convention = |message: String| ImportError::Convention {
        key: key("q.weight"),
        message,
    };
    if mha.out_proj.bias.is_some() {
        return Err(convention(
            "Hugging Face's T5Attention has no biases in q, k, v and o; configure the \
             module with_bias(false)"
                .into(),
        ));
    }
    if mha.scale != 1.0 {
        return Err(convention(format!(
            "Hugging Face's T5Attention does not scale its scores (scale 1: T5 folds \
             1/sqrt(d_kv) into its initialisation); configure the module with_scale(Some(1.0)), \
             it has {}",
            mha.scale
        )));
    }
    let d_model = mha.d_model();
    let q_width = mha.n_heads * mha.head_dim;
    let kv_width = mha.n_kv_heads * mha.head_dim;
    if let Some(&[inner, width]) = weights.shape(&key("q.weight")).as_deref()
        && width == d_model
        && inner != q_width
    {
        return Err(convention(format!(
            "T5's heads are {inner} / {} = d_kv wide ({inner} = num_heads · d_kv), \
             MultiHeadAttention's d_model / n_heads = {d_model} / {} = {}: T5 with \
             num_heads · d_kv != d_model has no counterpart",
            mha.n_heads, mha.n_heads, mha.head_dim
        )));
    }
    let [q, k, v, o] = ["q.", "k.", "v.", "o."].map(key);
    mha.in_proj = match mha.in_proj {
        InputProjection::Packed(proj) => {
            let weight = Place::of(&proj.weight);
            let [d_in, _] = proj.weight.shape().dims::<2>();
            let parts = [(&q, q_width), (&k, kv_width), (&v, kv_width)]
                .into_iter()
                .map(|(at, rows)| weight.load(weights, &format!("{at}weight"), [rows, d_in]))
                .collect::<Result<Vec<_>, _>>()?;
            for at in [&q, &k, &v] {
                weights.reject(format!("{at}bias"), "T5Attention has no biases")?;
            }
            InputProjection::Packed(Linear {
                weight: set(proj.weight, Tensor::cat(parts, 0).transpose()),
                bias: None,
            })
        }
        InputProjection::Separate(p) => InputProjection::Separate(SeparateProjection {
            q_proj: load_linear(p.q_proj, weights, &q)?,
            k_proj: load_linear(p.k_proj, weights, &k)?,
            v_proj: load_linear(p.v_proj, weights, &v)?,
        }),
    };
    mha.out_proj = load_linear(mha.out_proj, weights, &o)?;
    Ok(mha)
}

/// The learned relative-position table of a module with [`Positions::Relative`] or
/// [`Positions::T5`], from `{prefix}position_table` in mha's layout `[H, buckets]`, or
/// from Hugging Face's T5 `{prefix}relative_attention_bias.weight` `[buckets, H]` (an
/// `nn.Embedding(num_buckets, num_heads)`), transposed. A module without a table refuses
/// either key; a module with one needs one of them.
fn load_position_table(
    mha: &MultiHeadAttention,
    weights: &PyTorchWeights,
    prefix: &str,
) -> Result<Option<Param<Tensor<2>>>, ImportError> {
    let ours = format!("{prefix}position_table");
    let hf = format!("{prefix}relative_attention_bias.weight");
    let (table, buckets) = match (&mha.position_table, mha.positions.buckets()) {
        (Some(table), Some(buckets)) => (table.clone(), buckets),
        _ => {
            weights.reject(
                ours,
                "the module has no learned position table (configure Positions::Relative or \
                 Positions::T5)",
            )?;
            weights.reject(
                hf,
                "Hugging Face's T5 relative bias needs Positions::T5 with the layer's \
                 relative_attention_num_buckets, relative_attention_max_distance and \
                 bidirectional = !is_decoder",
            )?;
            return Ok(mha.position_table.clone());
        }
    };
    let [heads, len] = [mha.n_heads, buckets.len()];
    let place = Place::of(&table);
    if weights.contains(&ours) {
        weights.reject(
            hf,
            "the weights also hold position_table; keep one of the two",
        )?;
        return Ok(Some(set(table, place.load(weights, &ours, [heads, len])?)));
    }
    if weights.contains(&hf) {
        if !matches!(mha.positions, Positions::T5 { .. }) {
            return Err(ImportError::Convention {
                key: hf,
                message: format!(
                    "Hugging Face's T5 table indexes T5's buckets; the module's positions are \
                     {:?} (configure Positions::T5)",
                    mha.positions
                ),
            });
        }
        let stored = place.load(weights, &hf, [len, heads])?; // [buckets, H]
        return Ok(Some(set(table, stored.transpose())));
    }
    Err(ImportError::Convention {
        key: ours,
        message: format!(
            "the module's {:?} positions have a learned table of [heads, buckets] = \
             [{heads}, {len}], which the weights lack: store it under this key in that layout \
             (see MultiHeadAttention::position_table), or under relative_attention_bias.weight \
             as Hugging Face's T5 does ([buckets, heads]; T5 keeps it in the first layer of each \
             stack only and the others reuse it: give every layer that table)",
            mha.positions
        ),
    })
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
