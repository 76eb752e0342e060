//! The feed-forward's exact GELU as one operation of the backend (a Burn backend
//! extension) on flex and ndarray in f32, with a backward of its own: both passes run the
//! vectorised kernels of `cpu::gelu`, one pass each. Elsewhere (other backends, other
//! dtypes) it is written with `erf`, `x (1 + erf(x / √2)) / 2`, so that autodiff derives
//! the exact gradient on every backend (Burn's fused `gelu` backward is the tanh
//! approximation's outside flex, off from PyTorch by about 3e-4): five elementwise passes
//! forward and more backward, each `erf` a scalar call of the C library per element on
//! the CPU.

// Burn 0.22 deprecates ndarray; it is still one of our backends.
#![allow(deprecated)]

use burn::tensor::Tensor;

/// `x Φ(x)`, elementwise, with its gradient under autodiff.
pub(crate) fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    #[cfg(any(feature = "flex", feature = "ndarray"))]
    if crate::attention::dispatch::Cpu::runs_fused(&x) {
        return cpu::gelu(x);
    }
    x.clone() * ((x / core::f64::consts::SQRT_2).erf() + 1.0) * 0.5
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
    use crate::cpu::gelu::{gelu_backward, gelu_forward};

    /// GELU as one operation, differentiable on `Autodiff<Flex | NdArray>`.
    #[backend_extension(
        Flex: cfg(feature = "flex"),
        NdArray: cfg(feature = "ndarray"),
        Autodiff
    )]
    pub(crate) trait FusedGelu: Backend {
        /// `x Φ(x)` of a rank-4 f32 tensor.
        fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self>;
    }

    macro_rules! forward_only {
        ($backend:ty) => {
            impl FusedGelu for $backend {
                fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
                    gelu_forward::<Self>(&x)
                }
            }
        };
    }

    #[cfg(feature = "flex")]
    forward_only!(Flex);
    #[cfg(feature = "ndarray")]
    forward_only!(NdArray);

    impl<B: FusedGelu + CpuTensors, C: CheckpointStrategy> FusedGelu for Autodiff<B, C> {
        fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
            let node = x.node();
            let x = x.into_primitive();
            match GeluBackward.prepare::<C>([node]).compute_bound().stateful() {
                OpsKind::Tracked(prep) => {
                    let out = gelu_forward::<B>(&x);
                    prep.finish(x, out)
                }
                OpsKind::UnTracked(prep) => prep.finish(gelu_forward::<B>(&x)),
            }
        }
    }

    /// The backward step of [`FusedGelu`]: `grad · (Φ(x) + x φ(x))`, from the input kept.
    #[derive(Debug)]
    struct GeluBackward;

    impl<B: CpuTensors> Backward<B, 1> for GeluBackward {
        type State = FloatTensor<B>;

        fn backward(
            self,
            ops: Ops<Self::State, 1>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let grad = grads.consume::<B>(&ops.node);
            let [parent] = ops.parents;
            if let Some(node) = parent {
                grads.register::<B>(node.id, gelu_backward::<B>(&ops.state, &grad));
            }
        }
    }

    /// GELU of `x` through [`FusedGelu`], its rows laid out as one rank-4 tensor.
    pub(super) fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
        let dims = x.dims();
        let cols = dims[D - 1];
        let rows = dims.iter().product::<usize>() / cols.max(1);
        let flat: Tensor<4> = x.reshape([1, 1, rows, cols]);
        let out = <Dispatch as FusedGelu>::fused_gelu(flat.into_dispatch());
        Tensor::<4>::from_dispatch(out).reshape(dims)
    }
}
