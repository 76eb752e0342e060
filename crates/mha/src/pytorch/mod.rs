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
//! `norm_first`, activation, a stack's final norm:
//! [`EncoderBlockConfig::pytorch`](crate::EncoderBlockConfig::pytorch) and
//! [`DecoderBlockConfig::pytorch`](crate::DecoderBlockConfig::pytorch) take PyTorch's
//! defaults; and a decoder layer's self-attention, causal unless configured otherwise, as
//! PyTorch's layer called with a causal `tgt_mask`), then call
//! [`LoadPyTorch::load_pytorch`]. PyTorch stores a linear weight as `[out, in]`; Burn as
//! `[in, out]`: the import transposes. A missing key, a key of these PyTorch modules that
//! the module has no place for (such as `bias_k` of `add_bias_kv=True`, a bias the module
//! was configured without, a decoder layer's `multihead_attn` in an encoder block, a layer
//! past the last), or a shape that differs is an [`ImportError`] naming the key and both
//! shapes; keys of other modules under the same prefix are not read. What leaves no key
//! cannot be checked: the settings above, and `add_zero_attn=True` (a zero key and value
//! appended to every sequence), which these modules do not compute.
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
//! stack and lends it to the others; each mha module has its own, loaded by its own keys:
//! put the first layer's table under each other layer's key before loading it
//! ([`PyTorchWeights::share`]; a layer configured with T5's positions whose weights lack
//! the table is an error, never a random table). The import covers
//! T5's attention, not its blocks (whose table lives in the first layer of a stack and
//! whose feed-forward has no biases), nor its stacks.
//!
//! The attention of Hugging Face's Llama family (`LlamaAttention`, `MistralAttention`,
//! `Qwen2Attention`, `Qwen3Attention`: keys `q_proj.*`, `k_proj.*`, `v_proj.*`,
//! `o_proj.*`, Qwen3's `q_norm.weight`, `k_norm.weight`, and gpt-oss's `sinks` into a
//! module configured `with_sinks(true)`) loads into a
//! [`MultiHeadAttention`] configured as the model computes:
//!
//! ```
//! # use burn::tensor::Device;
//! use mha::{MultiHeadAttentionConfig, Positions, RopeLayout};
//! // Qwen3-0.6B: Qwen3Config(hidden_size=1024, num_attention_heads=16,
//! // num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6); Qwen2's:
//! // with_out_bias(Some(false)) instead of the last two lines (biases on q, k, v only).
//! let qwen3 = MultiHeadAttentionConfig::new(1024, 16)
//!     .with_head_dim(Some(128)) // 16 heads of 128: wider than 1024 / 16
//!     .with_n_kv_heads(Some(8))
//!     .with_positions(Positions::Rope { theta: 1e6, layout: RopeLayout::HalfSplit })
//!     .with_bias(false) // attention_bias = False
//!     .with_qk_norm_eps(Some(1e-6));
//! # qwen3.init(&Device::default());
//! ```
//!
//! Heads of another width than `hidden_size / num_attention_heads` (Qwen3's released
//! models set `head_dim` apart) take `with_head_dim(Some(head_dim))`; heads of another
//! width than the module's are an [`ImportError::Convention`].
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

use burn::module::{Module, ModuleMapper, Param};
use burn::nn::Linear;
use burn::tensor::{DType, Device, Tensor, TensorData, bf16, f16};
use safetensors::{Dtype, SafeTensors};

use crate::block::{DecoderBlock, EncoderBlock, FeedForward};
use crate::mha::{InputProjection, MultiHeadAttention, SeparateProjection};
use crate::norm::{LayerNorm, NormKind};
use crate::positions::Positions;
use crate::stack::{Decoder, Encoder};

mod attention;
mod blocks;

pub(crate) use attention::load_projections;

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
    /// A model's configuration (`config.json`) could not be read, or asks for what the
    /// modules cannot compute (see [`crate::hf`]); or a model's files do not fit together
    /// (a checkpoint's shards that hold one key twice, a directory without weights).
    Config {
        /// The file, or the field: "`head_dim` of config.json".
        what: String,
        /// What is wrong, and what the modules take.
        message: String,
    },
    /// A weight is NaN or infinite, or a finite value past the range of the dtype it loads
    /// into (70000 into f16), which the conversion would make infinite.
    Value {
        /// The full key.
        key: String,
        /// Where in the stored tensor (its own layout, PyTorch's).
        index: Vec<usize>,
        /// The value as stored.
        value: f64,
        /// The dtype it loads into.
        dtype: DType,
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
            Self::Config { what, message } => write!(f, "{what}: {message}"),
            Self::Value {
                key,
                index,
                value,
                dtype,
            } if value.is_finite() => write!(
                f,
                "key `{key}`: element {index:?} is {value:?}, past the range of {}, the dtype \
                 it loads into (load it into a wider one)",
                dtype.name()
            ),
            Self::Value {
                key, index, value, ..
            } => write!(
                f,
                "key `{key}`: element {index:?} is {value:?}: weights must be finite"
            ),
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
        Self::from_bytes(&read_file(path)?, &path.display().to_string())
    }

    /// Reads the shards of one checkpoint (Hugging Face's `model-00001-of-00004.safetensors`
    /// and the others) as one set of weights.
    ///
    /// # Errors
    /// As [`from_file`](Self::from_file) for each file, and [`ImportError::Config`] when
    /// two files hold the same key (naming it and both files).
    pub fn from_files<P: AsRef<Path>>(
        paths: impl IntoIterator<Item = P>,
    ) -> Result<Self, ImportError> {
        let mut all = Self {
            tensors: HashMap::new(),
            others: HashMap::new(),
        };
        let mut origin: HashMap<String, String> = HashMap::new();
        for path in paths {
            let path = path.as_ref();
            let shard = Self::from_file(path)?;
            let name = path.display().to_string();
            for key in shard.keys() {
                if let Some(first) = origin.insert(key.to_string(), name.clone()) {
                    return Err(ImportError::Config {
                        what: name,
                        message: format!("key `{key}` is also in {first}"),
                    });
                }
            }
            all.tensors.extend(shard.tensors);
            all.others.extend(shard.others);
        }
        Ok(all)
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

    /// Puts the tensor under `key` under `under` too: a tensor a model stores once for
    /// several layers, as T5 keeps its relative-position table in the first layer of each
    /// stack (`encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight`) and
    /// the other layers use it, so that each layer loads it by its own keys.
    ///
    /// # Errors
    /// [`ImportError::MissingKey`] when `key` is absent, [`ImportError::Dtype`] when it is
    /// not a float tensor, [`ImportError::Config`] when `under` holds a tensor already
    /// (naming both keys).
    pub fn share(&mut self, key: &str, under: &str) -> Result<(), ImportError> {
        if let Some(dtype) = self.others.get(key) {
            return Err(ImportError::Dtype {
                key: key.to_string(),
                dtype: dtype.clone(),
            });
        }
        if self.contains(under) {
            return Err(ImportError::Config {
                what: format!("PyTorchWeights::share({key:?}, {under:?})"),
                message: format!("key `{under}` holds a tensor already"),
            });
        }
        let data = self
            .tensors
            .get(key)
            .ok_or_else(|| ImportError::MissingKey {
                key: key.to_string(),
            })?
            .clone();
        self.tensors.insert(under.to_string(), data);
        Ok(())
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
    /// device), checked to have shape `expected`. Its values are read as they are: a
    /// value past `dtype`'s range becomes infinite (a module's import refuses it).
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
        on_device(key, self.data(key, &expected)?, dtype.into(), device)
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

    /// Fails with [`ImportError::UnexpectedKey`] naming the first key (in order) of a
    /// layer past the module's `layers`: one under `{prefix}{layers}.`, where `prefix`
    /// numbers the layers (`layers.`, `model.layers.`).
    pub(crate) fn reject_layers_past(
        &self,
        prefix: &str,
        layers: usize,
    ) -> Result<(), ImportError> {
        let past = format!("{prefix}{layers}.");
        match self.keys().filter(|key| key.starts_with(&past)).min() {
            Some(key) => Err(ImportError::UnexpectedKey {
                key: key.to_string(),
                reason: "a layer past the module's last (configure as many layers as the \
                         weights hold)",
            }),
            None => Ok(()),
        }
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
    /// another shape than this module's configuration implies; [`ImportError::Value`] for a
    /// weight that is NaN, infinite, or past the range of the dtype it loads into;
    /// [`ImportError::Convention`] for a quantized parameter (`quantize_weights`,
    /// `apply_qlora`): load before quantizing.
    fn load_pytorch(self, weights: &PyTorchWeights, prefix: &str) -> Result<Self, ImportError>;
}

/// `data` (stored under `key`) as a tensor of `dtype` on `device`, or
/// [`ImportError::DeviceDtype`] where the device does not compute in it.
fn on_device<const D: usize>(
    key: &str,
    data: &TensorData,
    dtype: DType,
    device: &Device,
) -> Result<Tensor<D>, ImportError> {
    if !(dtype.is_float() && device.supports_dtype(dtype)) {
        return Err(ImportError::DeviceDtype {
            key: key.to_string(),
            dtype,
            device: format!("{device:?}"),
        });
    }
    Ok(Tensor::from_data(data.clone(), (device, dtype)))
}

/// The bytes of the file at `path`, or [`ImportError::Io`] naming it (also for a path that
/// is not a regular file: a device or a pipe may read without end).
pub(crate) fn read_file(path: &Path) -> Result<Vec<u8>, ImportError> {
    let error = |source| ImportError::Io {
        path: path.to_path_buf(),
        source,
    };
    if std::fs::metadata(path).map_err(error)?.is_file() {
        return std::fs::read(path).map_err(error);
    }
    let other = "not a regular file (a directory, a device or a pipe)";
    Err(error(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        other,
    )))
}

/// The first element of `data` (flat index, stored value) that is not a finite number once
/// converted to `dtype`: NaN, an infinity, or a finite value past `dtype`'s range (only a
/// positive one where `stored_ok`).
fn first_unfit(data: &TensorData, dtype: DType, stored_ok: bool) -> Option<(usize, f64)> {
    let fits = |x: f64| match dtype {
        _ if stored_ok && !x.is_finite() => true,
        // Stored as it is, a value below the dtype's range is -inf there, which acts as
        // it does (a sink's weight underflows to 0 either way).
        _ if stored_ok && x < 0.0 => true,
        DType::F64 => x.is_finite(),
        DType::F16 => f16::from_f64(x).is_finite(),
        DType::BF16 => bf16::from_f64(x).is_finite(),
        _ => (x as f32).is_finite(),
    };
    // Read from the bytes (little-endian, as safetensors stores them): no alignment needed.
    fn first<const N: usize>(
        data: &TensorData,
        wide: impl Fn([u8; N]) -> f64,
        fits: impl Fn(f64) -> bool,
    ) -> Option<(usize, f64)> {
        data.as_bytes()
            .chunks_exact(N)
            .map(|bytes| wide(bytes.try_into().expect("chunks of N bytes")))
            .enumerate()
            .find(|(_, x)| !fits(*x))
    }
    match data.dtype() {
        DType::F64 => first(data, f64::from_le_bytes, fits),
        DType::F32 => first(data, |b| f32::from_le_bytes(b).into(), fits),
        DType::F16 => first(data, |b| f16::from_le_bytes(b).into(), fits),
        DType::BF16 => first(data, |b| bf16::from_le_bytes(b).into(), fits),
        _ => None,
    }
}

/// The index of each axis of the element at `flat` in a row-major tensor of `shape`.
fn unravel(mut flat: usize, shape: &[usize]) -> Vec<usize> {
    let mut index = vec![0; shape.len()];
    for (i, len) in index.iter_mut().zip(shape).rev() {
        *i = flat % len;
        flat /= len;
    }
    index
}

/// Replaces a parameter's value, keeping its id, whether it is trained, and what Burn
/// attached to it (a LoRA adapter of `Module::apply_lora` stays, over the new value).
pub(crate) fn set<const D: usize>(param: Param<Tensor<D>>, value: Tensor<D>) -> Param<Tensor<D>> {
    // `Module::map` maps the base value first, then the adapter's own parameters, which
    // stay as they are, and puts the adapter back (`Param::map` would drop it).
    struct Set<const D: usize>(Option<Tensor<D>>);
    impl<const D: usize> ModuleMapper for Set<D> {
        fn map_float<const E: usize>(&mut self, param: Param<Tensor<E>>) -> Param<Tensor<E>> {
            // The base is the parameter mapped first: `E` is `D` (its shape).
            let Some(value) = self.0.take() else {
                return param;
            };
            let value: Tensor<E> = value.reshape(param.lazy_shape());
            match param.is_initialized() {
                true => param.map(|old| value.set_require_grad(old.is_require_grad())),
                // Not built yet: replaced as Burn loads a record into it, without building
                // its random value first.
                false => {
                    let id = param.id;
                    param.transform_for_load(value, id)
                }
            }
        }
    }
    Module::map(param, &mut Set(Some(value)))
}

/// `param` with the value under `key`, of the parameter's own shape, in its dtype and on
/// its device.
pub(crate) fn load_param<const D: usize>(
    param: Param<Tensor<D>>,
    weights: &PyTorchWeights,
    key: &str,
) -> Result<Param<Tensor<D>>, ImportError> {
    let shape = param.lazy_shape().dims::<D>();
    let value = Place::of(&param).load(weights, key, shape)?;
    Ok(set(param, value))
}

/// Where a parameter lives: the device and dtype a loaded value takes, as PyTorch's
/// `load_state_dict` copies into the parameter's own dtype.
pub(crate) struct Place {
    device: Device,
    dtype: DType,
}

impl Place {
    pub(crate) fn of<const D: usize>(param: &Param<Tensor<D>>) -> Self {
        if !param.is_initialized() {
            // Not built yet (Burn's initializers build on first use): it would be built on
            // its device in the device's float dtype. Reading its value would build a
            // random tensor of the whole shape, only to replace it (for a shape a config
            // got wrong, before the weights' shape is checked against it).
            let device = param.lazy_device();
            let dtype = device.settings().float_dtype.into();
            return Self { device, dtype };
        }
        // The stored tensor: an adapted parameter's (LoRA, QLoRA) without its adapter.
        let value = param.base();
        Self {
            device: value.device(),
            dtype: value.dtype(),
        }
    }

    /// The tensor under `key`, of shape `shape`, in this place's dtype.
    ///
    /// # Errors
    /// As [`PyTorchWeights::tensor_as`]; [`ImportError::Convention`] for a quantized
    /// parameter (Burn's `quantize_weights`), which takes no float weights.
    pub(crate) fn load<const D: usize>(
        &self,
        weights: &PyTorchWeights,
        key: &str,
        shape: [usize; D],
    ) -> Result<Tensor<D>, ImportError> {
        self.load_checked(weights, key, shape, false)
    }

    /// As [`load`](Self::load), but a value stored NaN or infinite is let through, for a
    /// parameter whose loader gives some a meaning and refuses the others itself (a sink
    /// of -inf is none), and so is one below the dtype's range (-inf there, which acts as
    /// it does); one above it is refused all the same.
    pub(crate) fn load_as_stored<const D: usize>(
        &self,
        weights: &PyTorchWeights,
        key: &str,
        shape: [usize; D],
    ) -> Result<Tensor<D>, ImportError> {
        self.load_checked(weights, key, shape, true)
    }

    /// The tensor under `key` in this place's dtype, refused ([`ImportError::Value`]) at
    /// its first element that is NaN or infinite there (but for one stored so, where
    /// `stored_ok`).
    fn load_checked<const D: usize>(
        &self,
        weights: &PyTorchWeights,
        key: &str,
        shape: [usize; D],
        stored_ok: bool,
    ) -> Result<Tensor<D>, ImportError> {
        self.refuse_quantized(key)?;
        let data = weights.data(key, &shape)?;
        if let Some((at, value)) = first_unfit(data, self.dtype, stored_ok) {
            return Err(ImportError::Value {
                key: key.to_string(),
                index: unravel(at, &shape),
                value,
                dtype: self.dtype,
            });
        }
        on_device(key, data, self.dtype, &self.device)
    }

    fn refuse_quantized(&self, key: &str) -> Result<(), ImportError> {
        match self.dtype {
            DType::QFloat(_) => Err(ImportError::Convention {
                key: key.to_string(),
                message: "the module's parameter is quantized: load PyTorch's weights into \
                          the module before quantizing it (Module::quantize_weights)"
                    .into(),
            }),
            _ => Ok(()),
        }
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
    let [d_in, d_out] = linear.weight.lazy_shape().dims::<2>();
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

pub(crate) fn load_linear(
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
