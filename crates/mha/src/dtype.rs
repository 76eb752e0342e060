//! The float dtype of a whole module: one cast for attention, blocks, stacks and any Burn
//! module built from them, as PyTorch's `module.to(torch.bfloat16)`.
//!
//! [`ModuleDType::to_dtype`] casts every float parameter (projections, norms, learned
//! positions and relative-bias tables) and keeps each parameter's id and whether it is
//! trained. The forward pass then runs in the dtype of its input: give it inputs of the
//! same dtype (`x.cast(FloatDType::BF16)`). What attention computes beside the parameters
//! (RoPE's angles, ALiBi's slopes, sinusoids) is computed in f64 or f32 and cast to the
//! input's dtype; layer norms compute their statistics in f32, as PyTorch's do.
//!
//! Loading PyTorch weights into a cast module keeps its dtype, as PyTorch's
//! `load_state_dict` does (see [`crate::pytorch`]): cast, then load, and half-precision
//! weights arrive as they are stored. A Burn record (`save_file`, `load_file`) is the
//! other way round: by default its tensors keep the dtype they were saved in, whatever
//! the module they load into holds (an f32 record loaded into a bf16 module makes it f32
//! again): load, then cast. To load into the module's own dtypes instead, cast the
//! record as it loads: `module.try_load_record(ModuleRecord::load(path)?.cast_to_module_dtype())`
//! (Burn's `burn::store::ModuleRecord`), which also loads a half-precision record on a
//! device that has no arithmetic in that dtype (ndarray), where loading it as it is
//! fails inside the backend.
//!
//! A module quantized with Burn's `Module::quantize_weights` keeps its parameters
//! quantized at rest and dequantizes each where it is read, into the input's dtype (a
//! position table and sinks into the device's float dtype): it computes what the module
//! with the dequantized parameters computes, in float, and under autodiff its parameters
//! are constants, as Burn's quantized tensors are.

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{DType, FloatDType, Tensor};

use crate::error::DTypeError;

/// The float dtype of a module's parameters, and a cast of all of them. Every Burn
/// [`Module`] has it: [`MultiHeadAttention`](crate::MultiHeadAttention), the blocks, the
/// stacks, and a user's model made of them.
///
/// ```
/// use burn::tensor::{Device, Distribution, FloatDType, Tensor};
/// use mha::{EncoderBlockConfig, ModuleDType};
///
/// let device = Device::default();
/// // bf16 where the device computes in it (flex, CUDA), else f16 (most Vulkan devices).
/// let dtype = match device.supports_dtype(FloatDType::BF16) {
///     true => FloatDType::BF16,
///     false => FloatDType::F16,
/// };
/// let block = EncoderBlockConfig::new(64, 4).init(&device).try_to_dtype(dtype)?;
/// assert_eq!(block.float_dtypes(), [dtype.into()]);
/// let x = Tensor::<3>::random([2, 10, 64], Distribution::Default, &device);
/// let y = block.forward(mha::BlockInput::new(x.cast(dtype))).unwrap().output;
/// assert_eq!(y.dtype(), dtype.into());
/// # Ok::<(), mha::DTypeError>(())
/// ```
pub trait ModuleDType: Module + Sized {
    /// The distinct dtypes of its float parameters, in the order first met (one for a
    /// module cast as a whole, none for a module without parameters).
    fn float_dtypes(&self) -> Vec<DType> {
        struct Dtypes(Vec<DType>);
        impl ModuleVisitor for Dtypes {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let dtype = param.val().dtype();
                if !self.0.contains(&dtype) {
                    self.0.push(dtype);
                }
            }
        }
        let mut dtypes = Dtypes(Vec::new());
        self.visit(&mut dtypes);
        dtypes.0
    }

    /// Every float parameter cast to `dtype`, each keeping its id and whether it is
    /// trained (a cast parameter is a leaf of its own, as after PyTorch's `module.to`).
    /// Quantized parameters stay as they are: they are read in the input's dtype.
    ///
    /// # Errors
    /// [`DTypeError`] naming the dtype and the device when a device of the module's
    /// parameters does not compute in `dtype` (Burn's [`Device::supports_dtype`](burn::tensor::Device::supports_dtype): ndarray
    /// has no f16 or bf16; a Vulkan device often stores bf16 without arithmetic).
    /// [`Device::supports_dtype`](burn::tensor::Device::supports_dtype) tells beforehand.
    fn try_to_dtype(self, dtype: FloatDType) -> Result<Self, DTypeError> {
        let wanted = DType::from(dtype);
        if let Some(device) = self
            .devices()
            .into_iter()
            .find(|device| !device.supports_dtype(wanted))
        {
            return Err(DTypeError {
                dtype: wanted,
                device: format!("{device:?}"),
            });
        }
        struct Cast(FloatDType);
        impl ModuleMapper for Cast {
            fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
                let dtype = self.0;
                if matches!(param.val().dtype(), DType::QFloat(_)) {
                    return param;
                }
                param.map(|tensor| {
                    let require_grad = tensor.is_require_grad();
                    let cast = tensor.cast(dtype).detach();
                    match require_grad {
                        true => cast.require_grad(),
                        false => cast,
                    }
                })
            }
        }
        Ok(self.map(&mut Cast(dtype)))
    }

    /// [`try_to_dtype`](Self::try_to_dtype), panicking with its error's message.
    ///
    /// # Panics
    /// When a device of the module's parameters does not compute in `dtype`.
    fn to_dtype(self, dtype: FloatDType) -> Self {
        self.try_to_dtype(dtype)
            .unwrap_or_else(|err| panic!("{err}"))
    }
}

impl<M: Module> ModuleDType for M {}

/// A parameter's value as the computation with an input of `dtype` reads it: a quantized
/// one (Burn's `Module::quantize_weights`) dequantized and cast to `dtype`; any other as it
/// is (its dtype is checked where it meets the input). Dequantized whole, before any part
/// is cut from it: a slice of a quantized tensor may be quantized again on some backends.
pub(crate) fn dequantized<const D: usize>(param: Tensor<D>, dtype: DType) -> Tensor<D> {
    match param.dtype() {
        DType::QFloat(_) => float_value(param).cast(dtype),
        _ => param,
    }
}

/// A parameter's value read where no input gives a dtype (a position table, sinks): a
/// quantized one dequantized to the device's float dtype, any other as it is.
pub(crate) fn float_value<const D: usize>(param: Tensor<D>) -> Tensor<D> {
    match param.dtype() {
        DType::QFloat(_) => param.dequantize(),
        _ => param,
    }
}
