//! [`LayerNorm`]: layer normalisation over the last axis, PyTorch's `nn.LayerNorm` and
//! Burn's `nn::LayerNorm` with the same parameters and record, computed on flex and
//! ndarray (f32) as one operation with a backward of its own (see `ops::norm`): one pass
//! over the rows each way instead of the nine elementwise operations autodiff would
//! otherwise record and walk back. Elsewhere it is Burn's `layer_norm` (f16 and bf16
//! computed in f32; Burn's module widens f16 only). Its RMS form ([`NormKind::Rms`], [`LayerNorm::rms`]) is
//! Llama's `RMSNorm`, as Hugging Face computes it.

use burn::config::Config;
use burn::module::{Module, Param};
use burn::nn::{Initializer, LayerNormConfig};
use burn::tensor::{Device, Tensor};

/// Which normalisation a [`LayerNorm`] is.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum NormKind {
    /// Layer normalisation: `(x - mean) / √(var + ε) · γ + β`, PyTorch's `nn.LayerNorm`.
    Layer,
    /// RMS normalisation: `x / √(mean(x²) + ε) · γ`, no centring and no shift; Llama's
    /// `RMSNorm` (Hugging Face's `LlamaRMSNorm`, `torch.nn.RMSNorm`), normalised in f32
    /// whatever the input's dtype and scaled in the input's, as Hugging Face does.
    Rms,
}

/// Layer normalisation over the last axis: `(x - mean) / √(var + ε) · γ + β`, the mean and
/// (biased) variance taken over each row of `d_model` values; or, built by
/// [`rms`](Self::rms), RMS normalisation `x / √(mean(x²) + ε) · γ` (see [`NormKind`]).
///
/// The same parameters as Burn's `nn::LayerNorm` and PyTorch's `nn.LayerNorm` (`gamma` is
/// PyTorch's `weight`, `beta` its `bias`), and a record with the same fields, so records
/// saved from either module load into the other.
///
/// # Example
/// ```
/// use burn::nn::LayerNormConfig;
/// use burn::tensor::{Device, Tensor};
/// use mha::norm::LayerNorm;
///
/// let device = Device::default();
/// let norm = LayerNorm::new(&LayerNormConfig::new(4), &device);
/// let x = Tensor::<2>::from_floats([[1.0, 2.0, 3.0, 4.0]], &device);
/// let y = norm.forward(x);
/// assert!(y.sum().into_scalar::<f32>().abs() < 1e-5);
/// ```
#[derive(Module, Debug)]
pub struct LayerNorm {
    /// The scale `γ`, `[d_model]`.
    pub gamma: Param<Tensor<1>>,
    /// The shift `β`, `[d_model]`, if the norm has one (an RMS norm has none).
    pub beta: Option<Param<Tensor<1>>>,
    epsilon: f64,
    /// Layer or RMS normalisation; not in the record, which is the same for both.
    #[module(skip)]
    kind: NormKind,
}

/// Refuses an epsilon that would make a row's root NaN (negative) or the norm's output
/// NaN or 0 (not finite), naming `caller` and the value.
fn check_epsilon(caller: &str, epsilon: f64) {
    assert!(
        epsilon.is_finite() && epsilon >= 0.0,
        "{caller}: epsilon must be finite and at least 0, got {epsilon}"
    );
}

impl LayerNorm {
    /// A norm as `config` describes it (Burn's configuration: `d_model`, `epsilon`,
    /// `bias`): `γ = 1`, `β = 0`.
    ///
    /// # Panics
    /// If `config.epsilon` is negative or not finite.
    pub fn new(config: &LayerNormConfig, device: &Device) -> Self {
        check_epsilon("LayerNorm::new", config.epsilon);
        let gamma = Initializer::Ones.init([config.d_model], device);
        let beta = config
            .bias
            .then(|| Initializer::Zeros.init([config.d_model], device));
        Self {
            gamma,
            beta,
            epsilon: config.epsilon,
            kind: NormKind::Layer,
        }
    }

    /// An RMS norm over rows of `d_model` with `epsilon` (Llama's is 1e-6 or 1e-5, from
    /// `rms_norm_eps`): `γ = 1`, no shift.
    ///
    /// ```
    /// use burn::tensor::{Device, Tensor};
    /// use mha::norm::LayerNorm;
    ///
    /// let device = Device::default();
    /// let norm = LayerNorm::rms(2, 0.0, &device);
    /// let y = norm.forward(Tensor::<2>::from_floats([[3.0, -4.0]], &device));
    /// // The row's root mean square is √12.5.
    /// let want = [3.0 / 12.5f32.sqrt(), -4.0 / 12.5f32.sqrt()];
    /// for (y, want) in y.into_data().to_vec::<f32>().unwrap().into_iter().zip(want) {
    ///     assert!((y - want).abs() < 1e-6);
    /// }
    /// ```
    ///
    /// # Panics
    /// If `epsilon` is negative or not finite.
    pub fn rms(d_model: usize, epsilon: f64, device: &Device) -> Self {
        check_epsilon("LayerNorm::rms", epsilon);
        Self {
            gamma: Initializer::Ones.init([d_model], device),
            beta: None,
            epsilon,
            kind: NormKind::Rms,
        }
    }

    /// A layer norm of `gamma` and `beta` with `epsilon` (a module converted from
    /// another's parameters).
    ///
    /// # Panics
    /// If `epsilon` is negative or not finite.
    pub(crate) fn layer(
        gamma: Param<Tensor<1>>,
        beta: Option<Param<Tensor<1>>>,
        epsilon: f64,
    ) -> Self {
        check_epsilon("LayerNorm", epsilon);
        Self {
            gamma,
            beta,
            epsilon,
            kind: NormKind::Layer,
        }
    }

    /// Layer or RMS normalisation.
    pub fn kind(&self) -> NormKind {
        self.kind
    }

    /// The `ε` added to the variance.
    pub fn epsilon(&self) -> f64 {
        self.epsilon
    }

    /// The width of the rows it normalises.
    pub fn d_model(&self) -> usize {
        self.gamma.dims()[0]
    }

    /// # Shapes
    /// `[.., d_model]` -> `[.., d_model]`.
    ///
    /// # Panics
    /// If the last axis of `x` is not `d_model` wide (the message names both), or `x` and
    /// the parameters are of two dtypes.
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let d_model = self.d_model();
        let width = x.dims()[D - 1];
        let name = match self.kind {
            NormKind::Layer => "LayerNorm",
            NormKind::Rms => "RMSNorm",
        };
        assert!(
            width == d_model,
            "{name}: the input's last axis is {width} wide (shape {:?}), the norm's d_model is {d_model}",
            x.dims()
        );
        match self.kind {
            NormKind::Layer => {
                let beta = self.beta.as_ref().map(Param::val);
                crate::ops::norm::layer_norm(x, self.gamma.val(), beta, self.epsilon)
            }
            NormKind::Rms => crate::ops::norm::rms_norm(x, self.gamma.val(), self.epsilon),
        }
    }
}
