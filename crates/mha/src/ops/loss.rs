//! Cross-entropy over rows of logits. On the CPU backends it is one operation that
//! writes its gradient in the same pass over the logits, the backward pass scaling it
//! (where nothing is tracked, the loss alone); elsewhere `log_softmax`, a gather and a
//! masked mean.

use burn::tensor::activation::log_softmax;
use burn::tensor::{Bool, DType, Int, Tensor};

use crate::dispatch::{self, RowCall, RowOp, RowPath};

/// The mean cross-entropy of `logits` `[N, C]` against `targets` `[N]` (whose values,
/// read once by the caller and checked, are `values`) over the rows whose target is not
/// `ignore_index`, as a `[1]` tensor; 0 when every row is ignored.
#[cfg_attr(not(feature = "cpu-kernels"), allow(unused_variables))]
pub(crate) fn cross_entropy(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    values: &[i64],
    ignore_index: Option<i64>,
) -> Tensor<1> {
    let [n, classes] = logits.dims();
    match dispatch::row(RowCall::of(RowOp::CrossEntropy, &logits)) {
        #[cfg(feature = "cpu-kernels")]
        RowPath::Fused => {
            let ignored = crate::cpu::rows::loss::IGNORED;
            let targets = values
                .iter()
                .map(|&t| match ignore_index == Some(t) {
                    true => ignored,
                    false => t,
                })
                .collect();
            let op = super::FusedOp::CrossEntropy { targets };
            let logits = logits.reshape([1, 1, n, classes]);
            super::run(op, vec![logits], None).reshape([1])
        }
        RowPath::Burn | RowPath::BurnInF32 => {
            let (device, dtype) = (logits.device(), logits.dtype());
            // Half precision reduced in f32, as PyTorch's; the loss in the logits' dtype.
            let logits = match dtype {
                DType::F16 | DType::BF16 => logits.cast(DType::F32),
                _ => logits,
            };
            let inner = logits.dtype();
            let kept = match ignore_index {
                Some(i) => targets.clone().not_equal_elem(i),
                None => Tensor::<1, Bool>::full([n], true, &device),
            };
            let safe = targets.mask_fill(kept.clone().bool_not(), 0);
            let picked = log_softmax(logits, 1)
                .gather(1, safe.reshape([n, 1]))
                .reshape([n])
                .mask_fill(kept.clone().bool_not(), 0.0);
            let count = kept.float().cast(inner).sum().clamp_min(1.0);
            (picked.sum().neg() / count).cast(dtype)
        }
        // No row (the public function refuses rows without classes): every row ignored.
        RowPath::Empty => {
            let (device, dtype) = (logits.device(), logits.dtype());
            crate::empty::zeros(
                [1],
                &device,
                dtype,
                core::iter::once_with(|| crate::empty::zero_of(logits)),
            )
        }
    }
}

#[cfg(feature = "cpu-kernels")]
pub(crate) use cpu::CrossEntropyOp;

#[cfg(feature = "cpu-kernels")]
mod cpu {
    use std::sync::Arc;

    use burn::backend::tensor::FloatTensor;

    use crate::cpu::CpuTensors;
    use crate::cpu::rows::loss::{
        cross_entropy_backward, cross_entropy_forward, cross_entropy_loss,
    };
    use crate::op::{Op, inputs};

    /// The mean cross-entropy (`[1, 1, 1, 1]`) of the logits `[1, 1, rows, classes]`
    /// against `targets` (a class per row, or `IGNORED`).
    pub(crate) struct CrossEntropyOp {
        pub(crate) targets: Arc<[i64]>,
    }

    impl<B: CpuTensors> Op<B> for CrossEntropyOp {
        /// The logits' gradient, written by the forward pass.
        type Saved = FloatTensor<B>;

        fn forward(self, logits: Vec<FloatTensor<B>>) -> (FloatTensor<B>, FloatTensor<B>) {
            let [logits] = inputs(logits);
            cross_entropy_forward::<B>(&logits, &self.targets)
        }

        /// Without a backward pass (a validation loss): no gradient of the logits' size.
        fn output(self, logits: Vec<FloatTensor<B>>) -> FloatTensor<B> {
            let [logits] = inputs(logits);
            cross_entropy_loss::<B>(&logits, &self.targets)
        }

        fn backward(
            grad: FloatTensor<B>,
            upstream: FloatTensor<B>,
            _: &[bool],
        ) -> Vec<Option<FloatTensor<B>>> {
            vec![Some(cross_entropy_backward::<B>(&grad, &upstream))]
        }
    }
}
