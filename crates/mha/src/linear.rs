//! The linear layers' products (`x W + b`) on flex and ndarray in f32 as one operation of
//! the backend (a Burn backend extension) with a backward of its own, both through
//! `cpu::linear`'s direct calls of the `gemm` crate; elsewhere Burn's `linear`. Burn's
//! `nn::Linear` keeps its parameters and record: only the computation is ours.

// Burn 0.22 deprecates ndarray; it is still one of our backends.
#![allow(deprecated)]

use burn::nn::Linear;
use burn::tensor::Tensor;

/// `linear`'s output for `x` `[.., d_in]`.
pub(crate) fn forward<const D: usize>(linear: &Linear, x: Tensor<D>) -> Tensor<D> {
    let bias = linear.bias.as_ref().map(|b| b.val());
    columns(x, linear.weight.val(), bias, None)
}

/// `x W[:, c] + b[c]` for the columns `c` in `start..start + len` of the weight `[d_in,
/// d_all]` and bias `[d_all]` (all of them when `columns` is `None`).
pub(crate) fn columns<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
    columns: Option<[usize; 2]>,
) -> Tensor<D> {
    let [d_in, _] = weight.dims();
    assert!(
        x.dims()[D - 1] == d_in,
        "Linear: the input's last axis is {} wide (shape {:?}), the layer's d_input is {d_in}",
        x.dims()[D - 1],
        x.dims()
    );
    #[cfg(any(feature = "flex", feature = "ndarray"))]
    if crate::attention::dispatch::Cpu::runs_fused(&x) {
        return cpu::linear(x, weight, bias, columns);
    }
    let (weight, bias) = match columns {
        Some([start, len]) => (
            weight.narrow(1, start, len),
            bias.map(|b| b.narrow(0, start, len)),
        ),
        None => (weight, bias),
    };
    burn::tensor::module::linear(x, weight, bias)
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
    use crate::cpu::linear::{linear_backward, linear_forward};

    /// A linear layer's product as one operation, differentiable on
    /// `Autodiff<Flex | NdArray>`.
    #[backend_extension(
        Flex: cfg(feature = "flex"),
        NdArray: cfg(feature = "ndarray"),
        Autodiff
    )]
    pub(crate) trait FusedLinear: Backend {
        /// `x W + b` for `x` `[1, 1, rows, d_in]`, `weight` `[1, 1, d_in, d_out]` and
        /// `bias` `[1, 1, 1, d_out]`.
        fn fused_linear(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            bias: FloatTensor<Self>,
        ) -> FloatTensor<Self>;

        /// `x W` for `x` `[1, 1, rows, d_in]` and `weight` `[1, 1, d_in, d_out]`.
        fn fused_linear_no_bias(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
    }

    macro_rules! forward_only {
        ($backend:ty) => {
            impl FusedLinear for $backend {
                fn fused_linear(
                    x: FloatTensor<Self>,
                    weight: FloatTensor<Self>,
                    bias: FloatTensor<Self>,
                ) -> FloatTensor<Self> {
                    linear_forward::<Self>(&x, &weight, Some(&bias))
                }

                fn fused_linear_no_bias(
                    x: FloatTensor<Self>,
                    weight: FloatTensor<Self>,
                ) -> FloatTensor<Self> {
                    linear_forward::<Self>(&x, &weight, None)
                }
            }
        };
    }

    #[cfg(feature = "flex")]
    forward_only!(Flex);
    #[cfg(feature = "ndarray")]
    forward_only!(NdArray);

    impl<B: FusedLinear + CpuTensors, C: CheckpointStrategy> FusedLinear for Autodiff<B, C> {
        fn fused_linear(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
            bias: FloatTensor<Self>,
        ) -> FloatTensor<Self> {
            let nodes = [x.node(), weight.node(), bias.node()];
            let [x, weight, bias] = [x, weight, bias].map(|t| t.into_primitive());
            match LinearBackward
                .prepare::<C>(nodes)
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => {
                    let y = linear_forward::<B>(&x, &weight, Some(&bias));
                    prep.finish(State { x, weight }, y)
                }
                OpsKind::UnTracked(prep) => {
                    prep.finish(linear_forward::<B>(&x, &weight, Some(&bias)))
                }
            }
        }

        fn fused_linear_no_bias(
            x: FloatTensor<Self>,
            weight: FloatTensor<Self>,
        ) -> FloatTensor<Self> {
            let nodes = [x.node(), weight.node()];
            let [x, weight] = [x, weight].map(|t| t.into_primitive());
            match LinearBackward
                .prepare::<C>(nodes)
                .compute_bound()
                .stateful()
            {
                OpsKind::Tracked(prep) => {
                    let y = linear_forward::<B>(&x, &weight, None);
                    prep.finish(State { x, weight }, y)
                }
                OpsKind::UnTracked(prep) => prep.finish(linear_forward::<B>(&x, &weight, None)),
            }
        }
    }

    /// The backward step of [`FusedLinear`] over its `N` parents: the input, the weight,
    /// and the bias when there is one.
    #[derive(Debug)]
    struct LinearBackward;

    /// What the backward pass keeps: the input and the weight.
    #[derive(Debug, Clone)]
    struct State<B: CpuTensors> {
        x: FloatTensor<B>,
        weight: FloatTensor<B>,
    }

    impl<B: CpuTensors, const N: usize> Backward<B, N> for LinearBackward {
        type State = State<B>;

        fn backward(
            self,
            ops: Ops<Self::State, N>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let grad = grads.consume::<B>(&ops.node);
            let wanted: [bool; 3] =
                std::array::from_fn(|i| ops.parents.get(i).is_some_and(Option::is_some));
            if !wanted.contains(&true) {
                return;
            }
            let s = &ops.state;
            let out = linear_backward::<B>(&s.x, &s.weight, &grad, wanted);
            for (parent, grad) in ops.parents.into_iter().zip(out) {
                if let (Some(node), Some(grad)) = (parent, grad) {
                    grads.register::<B>(node.id, grad);
                }
            }
        }
    }

    /// The product through [`FusedLinear`]: rows of `x` as one rank-4 tensor, the weight
    /// and bias reshaped whole (views) before their columns are taken (a view too; the
    /// reshape of a column slice would copy it).
    pub(super) fn linear<const D: usize>(
        x: Tensor<D>,
        weight: Tensor<2>,
        bias: Option<Tensor<1>>,
        columns: Option<[usize; 2]>,
    ) -> Tensor<D> {
        let dims = x.dims();
        let [d_in, d_all] = weight.dims();
        let rows = dims.iter().product::<usize>() / d_in.max(1);
        let weight = weight.reshape([1, 1, d_in, d_all]);
        let bias = bias.map(|b| b.reshape([1, 1, 1, d_all]));
        // Narrowed only when asked: a slice, even of every column, records a step whose
        // backward writes the gradient into zeros of the whole.
        let (weight, bias, len) = match columns.filter(|&c| c != [0, d_all]) {
            Some([start, len]) => (
                weight.narrow(3, start, len),
                bias.map(|b| b.narrow(3, start, len)),
                len,
            ),
            None => (weight, bias, d_all),
        };
        let x = x.reshape([1, 1, rows, d_in]).into_dispatch();
        let y = match bias {
            Some(bias) => <Dispatch as FusedLinear>::fused_linear(
                x,
                weight.into_dispatch(),
                bias.into_dispatch(),
            ),
            None => <Dispatch as FusedLinear>::fused_linear_no_bias(x, weight.into_dispatch()),
        };
        let mut out = dims;
        out[D - 1] = len;
        Tensor::<4>::from_dispatch(y).reshape(out)
    }
}
