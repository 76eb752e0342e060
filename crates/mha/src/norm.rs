//! [`LayerNorm`]: layer normalisation over the last axis, PyTorch's `nn.LayerNorm` and
//! Burn's `nn::LayerNorm` with the same parameters and record, computed on flex and
//! ndarray (f32) as one operation of the backend (a Burn backend extension) with a
//! backward of its own: one pass over the rows each way instead of the nine elementwise
//! operations autodiff would otherwise record and walk back. Elsewhere it is Burn's
//! `layer_norm` (f16 computed in f32, as Burn's module does).

// Burn 0.22 deprecates ndarray; it is still one of our backends.
#![allow(deprecated)]

use burn::module::{Module, Param};
use burn::nn::{Initializer, LayerNormConfig};
use burn::tensor::{DType, Device, Tensor};

/// Layer normalisation over the last axis: `(x - mean) / √(var + ε) · γ + β`, the mean and
/// (biased) variance taken over each row of `d_model` values.
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
    /// The shift `β`, `[d_model]`, if the norm has one.
    pub beta: Option<Param<Tensor<1>>>,
    epsilon: f64,
}

impl LayerNorm {
    /// A norm as `config` describes it (Burn's configuration: `d_model`, `epsilon`,
    /// `bias`): `γ = 1`, `β = 0`.
    pub fn new(config: &LayerNormConfig, device: &Device) -> Self {
        let gamma = Initializer::Ones.init([config.d_model], device);
        let beta = config
            .bias
            .then(|| Initializer::Zeros.init([config.d_model], device));
        Self {
            gamma,
            beta,
            epsilon: config.epsilon,
        }
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
    /// If the last axis of `x` is not `d_model` wide (the message names both).
    pub fn forward<const D: usize>(&self, x: Tensor<D>) -> Tensor<D> {
        let d_model = self.d_model();
        let width = x.dims()[D - 1];
        assert!(
            width == d_model,
            "LayerNorm: the input's last axis is {width} wide (shape {:?}), the norm's d_model is {d_model}",
            x.dims()
        );
        let gamma = self.gamma.val();
        let beta = self.beta.as_ref().map(Param::val);
        #[cfg(any(feature = "flex", feature = "ndarray"))]
        if crate::attention::dispatch::Cpu::runs_fused(&x) {
            return cpu::layer_norm(x, gamma, beta, self.epsilon);
        }
        match x.dtype() {
            DType::F16 => {
                let dtype = x.dtype();
                let beta = beta.map(|b| b.cast(DType::F32));
                let y = burn::tensor::module::layer_norm(
                    x.cast(DType::F32),
                    gamma.cast(DType::F32),
                    beta,
                    self.epsilon,
                );
                y.cast(dtype)
            }
            _ => burn::tensor::module::layer_norm(x, gamma, beta, self.epsilon),
        }
    }
}

#[cfg(any(feature = "flex", feature = "ndarray"))]
mod cpu {
    #[cfg(feature = "flex")]
    use burn::backend::Flex;
    #[cfg(feature = "ndarray")]
    use burn::backend::NdArray;
    use burn::backend::autodiff::{
        Autodiff,
        checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
        grads::Gradients,
        ops::{Backward, Ops, OpsKind},
    };
    use burn::backend::{Backend, Dispatch, backend_extension, tensor::FloatTensor};
    use burn::tensor::Tensor;

    use crate::cpu::CpuTensors;
    use crate::cpu::norm::{RowStats, layer_norm_backward, layer_norm_forward};

    /// Layer norm as one operation, differentiable on `Autodiff<Flex | NdArray>`.
    #[backend_extension(
        Flex: cfg(feature = "flex"),
        NdArray: cfg(feature = "ndarray"),
        Autodiff
    )]
    pub(crate) trait FusedLayerNorm: Backend {
        /// The layer norm of the rows of `x` (`[1, 1, rows, d]`) with scale `gamma` and
        /// shift `beta` (both `[1, 1, 1, d]`).
        fn fused_layer_norm(
            x: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            beta: FloatTensor<Self>,
            epsilon: f64,
        ) -> FloatTensor<Self>;
    }

    macro_rules! forward_only {
        ($backend:ty) => {
            impl FusedLayerNorm for $backend {
                fn fused_layer_norm(
                    x: FloatTensor<Self>,
                    gamma: FloatTensor<Self>,
                    beta: FloatTensor<Self>,
                    epsilon: f64,
                ) -> FloatTensor<Self> {
                    layer_norm_forward::<Self>(&x, &gamma, &beta, epsilon).0
                }
            }
        };
    }

    #[cfg(feature = "flex")]
    forward_only!(Flex);
    #[cfg(feature = "ndarray")]
    forward_only!(NdArray);

    impl<B: FusedLayerNorm + CpuTensors, C: CheckpointStrategy> FusedLayerNorm for Autodiff<B, C> {
        fn fused_layer_norm(
            x: FloatTensor<Self>,
            gamma: FloatTensor<Self>,
            beta: FloatTensor<Self>,
            epsilon: f64,
        ) -> FloatTensor<Self> {
            let nodes = [x.node(), gamma.node(), beta.node()];
            let [x, gamma, beta] = [x, gamma, beta].map(|t| t.into_primitive());
            match NormBackward.prepare::<C>(nodes).compute_bound().stateful() {
                OpsKind::Tracked(prep) => {
                    let (y, stats) = layer_norm_forward::<B>(&x, &gamma, &beta, epsilon);
                    prep.finish(State { x, gamma, stats }, y)
                }
                OpsKind::UnTracked(prep) => {
                    prep.finish(layer_norm_forward::<B>(&x, &gamma, &beta, epsilon).0)
                }
            }
        }
    }

    /// The backward step of [`FusedLayerNorm`], from the input, the scale and the rows'
    /// statistics kept.
    #[derive(Debug)]
    struct NormBackward;

    /// What the backward pass keeps.
    #[derive(Debug, Clone)]
    struct State<B: CpuTensors> {
        x: FloatTensor<B>,
        gamma: FloatTensor<B>,
        stats: RowStats,
    }

    impl<B: CpuTensors> Backward<B, 3> for NormBackward {
        type State = State<B>;

        fn backward(
            self,
            ops: Ops<Self::State, 3>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let grad = grads.consume::<B>(&ops.node);
            let [x, gamma, beta] = ops.parents;
            if x.is_none() && gamma.is_none() && beta.is_none() {
                return;
            }
            let s = &ops.state;
            let out = layer_norm_backward::<B>(&s.x, &s.gamma, &s.stats, &grad, x.is_some());
            for (parent, grad) in [x, gamma, beta]
                .into_iter()
                .zip([out.x, out.gamma, out.beta])
            {
                if let Some(node) = parent {
                    grads.register::<B>(node.id, grad);
                }
            }
        }
    }

    /// The layer norm of `x` through [`FusedLayerNorm`], its rows laid out as one rank-4
    /// tensor; a norm without shift passes a shift of zeros, which wants no gradient.
    pub(super) fn layer_norm<const D: usize>(
        x: Tensor<D>,
        gamma: Tensor<1>,
        beta: Option<Tensor<1>>,
        epsilon: f64,
    ) -> Tensor<D> {
        let dims = x.dims();
        let d = dims[D - 1];
        let rows = dims.iter().product::<usize>() / d.max(1);
        let beta = beta.unwrap_or_else(|| Tensor::zeros([d], &gamma.device()));
        let [x, gamma, beta] = [
            x.reshape([1, 1, rows, d]),
            gamma.reshape([1, 1, 1, d]),
            beta.reshape([1, 1, 1, d]),
        ]
        .map(Tensor::into_dispatch);
        let y = <Dispatch as FusedLayerNorm>::fused_layer_norm(x, gamma, beta, epsilon);
        Tensor::<4>::from_dispatch(y).reshape(dims)
    }
}
