//! [`cross_entropy`]: the loss of a classifier over its logits, PyTorch's
//! `F.cross_entropy(logits, targets, ignore_index=…)`, computed on flex and ndarray (f32)
//! as one operation of the backend (a Burn backend extension) that writes its gradient
//! in the same pass over the logits; the backward pass scales it. Elsewhere it is
//! `log_softmax`, a gather and a masked mean.

// Burn 0.22 deprecates ndarray; it is still one of our backends.
#![allow(deprecated)]

use burn::tensor::activation::log_softmax;
use burn::tensor::{Int, Tensor};

/// The mean cross-entropy of `logits` `[N, C]` against class indices `targets` `[N]`,
/// over the rows whose target is not `ignore_index`: `mean(logsumexp(logits[r]) -
/// logits[r, targets[r]])`, a `[1]` tensor, differentiable with respect to the logits.
///
/// Unlike PyTorch's (and Burn's), a batch whose every target is ignored gives a loss of 0
/// and a gradient of 0, not NaN.
///
/// # Panics
/// If `targets` has not `N` rows, or a target (other than `ignore_index`) is not a class
/// index below `C`; the message names the row and the values.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Int, Tensor};
/// use mha::loss::cross_entropy;
///
/// let device = Device::default();
/// let logits = Tensor::<2>::from_floats([[2.0, 0.0], [0.0, 0.0], [5.0, 1.0]], &device);
/// let targets = Tensor::<1, Int>::from_ints([0, 1, 9], &device);
/// let loss = cross_entropy(logits, targets, Some(9)); // the last row is left out
/// let want = ((1.0f32 + (-2.0f32).exp()).ln() + 2.0f32.ln()) / 2.0;
/// assert!((loss.into_scalar::<f32>() - want).abs() < 1e-6);
/// ```
pub fn cross_entropy(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    ignore_index: Option<usize>,
) -> Tensor<1> {
    let [n, classes] = logits.dims();
    let [rows] = targets.dims();
    assert!(
        rows == n,
        "cross_entropy: targets has {rows} rows, logits {n} (shape [{n}, {classes}])"
    );
    let values: Vec<i64> = targets
        .to_data()
        .convert::<i64>()
        .into_vec()
        .expect("integer targets");
    let ignored = |t: i64| ignore_index.is_some_and(|i| i as i64 == t);
    if let Some((row, &t)) = values
        .iter()
        .enumerate()
        .find(|&(_, &t)| !ignored(t) && !(0..classes as i64).contains(&t))
    {
        panic!(
            "cross_entropy: targets[{row}] = {t} is not a class index below {classes} (logits [{n}, {classes}]){}",
            ignore_index.map_or(String::new(), |i| format!(", nor ignore_index {i}"))
        );
    }
    #[cfg(any(feature = "flex", feature = "ndarray"))]
    if crate::attention::dispatch::Cpu::runs_fused(&logits) {
        let targets = values
            .iter()
            .map(|&t| {
                if ignored(t) {
                    crate::cpu::loss::IGNORED
                } else {
                    t
                }
            })
            .collect();
        return cpu::cross_entropy(logits, targets);
    }
    let device = logits.device();
    let kept = match ignore_index {
        Some(i) => targets.clone().not_equal_elem(i as i64),
        None => Tensor::<1, burn::tensor::Bool>::full([n], true, &device),
    };
    let safe = targets.mask_fill(kept.clone().bool_not(), 0);
    let picked = log_softmax(logits, 1)
        .gather(1, safe.reshape([n, 1]))
        .reshape([n])
        .mask_fill(kept.clone().bool_not(), 0.0);
    let count = kept.float().sum().clamp_min(1.0);
    picked.sum().neg() / count
}

#[cfg(any(feature = "flex", feature = "ndarray"))]
mod cpu {
    use std::sync::Arc;

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
    use crate::cpu::loss::{cross_entropy_backward, cross_entropy_forward};

    /// Cross-entropy as one operation, differentiable on `Autodiff<Flex | NdArray>`.
    #[backend_extension(
        Flex: cfg(feature = "flex"),
        NdArray: cfg(feature = "ndarray"),
        Autodiff
    )]
    pub(crate) trait FusedCrossEntropy: Backend {
        /// The mean cross-entropy (`[1, 1, 1, 1]`) of the rows of `logits` (`[1, 1, rows,
        /// classes]`) against `targets` (a class per row, or `IGNORED`).
        fn fused_cross_entropy(logits: FloatTensor<Self>, targets: Arc<[i64]>)
        -> FloatTensor<Self>;
    }

    macro_rules! forward_only {
        ($backend:ty) => {
            impl FusedCrossEntropy for $backend {
                fn fused_cross_entropy(
                    logits: FloatTensor<Self>,
                    targets: Arc<[i64]>,
                ) -> FloatTensor<Self> {
                    cross_entropy_forward::<Self>(&logits, &targets).0
                }
            }
        };
    }

    #[cfg(feature = "flex")]
    forward_only!(Flex);
    #[cfg(feature = "ndarray")]
    forward_only!(NdArray);

    impl<B: FusedCrossEntropy + CpuTensors, C: CheckpointStrategy> FusedCrossEntropy
        for Autodiff<B, C>
    {
        fn fused_cross_entropy(
            logits: FloatTensor<Self>,
            targets: Arc<[i64]>,
        ) -> FloatTensor<Self> {
            let node = logits.node();
            let logits = logits.into_primitive();
            match LossBackward.prepare::<C>([node]).compute_bound().stateful() {
                OpsKind::Tracked(prep) => {
                    let (loss, grad) = cross_entropy_forward::<B>(&logits, &targets);
                    prep.finish(grad, loss)
                }
                OpsKind::UnTracked(prep) => {
                    prep.finish(cross_entropy_forward::<B>(&logits, &targets).0)
                }
            }
        }
    }

    /// The backward step of [`FusedCrossEntropy`]: the gradient the forward pass wrote,
    /// times the loss's.
    #[derive(Debug)]
    struct LossBackward;

    impl<B: CpuTensors> Backward<B, 1> for LossBackward {
        type State = FloatTensor<B>;

        fn backward(
            self,
            ops: Ops<Self::State, 1>,
            grads: &mut Gradients,
            _checkpointer: &mut Checkpointer,
        ) {
            let upstream = grads.consume::<B>(&ops.node);
            let [parent] = ops.parents;
            if let Some(node) = parent {
                let grad = cross_entropy_backward::<B>(&ops.state, &upstream);
                grads.register::<B>(node.id, grad);
            }
        }
    }

    /// The loss through [`FusedCrossEntropy`], the logits laid out as one rank-4 tensor.
    pub(super) fn cross_entropy(logits: Tensor<2>, targets: Arc<[i64]>) -> Tensor<1> {
        let [n, classes] = logits.dims();
        let logits = logits.reshape([1, 1, n, classes]).into_dispatch();
        let loss = <Dispatch as FusedCrossEntropy>::fused_cross_entropy(logits, targets);
        Tensor::<4>::from_dispatch(loss).reshape([1])
    }
}
