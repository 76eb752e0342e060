//! The sum of the squares of a tensor's elements, for the global norm of gradient clipping
//! ([`crate::optim::clip_grad_norm`]): on the CPU backends (f32) one parallel pass
//! (`cpu::rows::squares`), where Burn squares into a new tensor and sums it on one thread.

#[cfg(feature = "cpu-kernels")]
pub(crate) use cpu::{SquareSumOp, square_sum};

#[cfg(feature = "cpu-kernels")]
mod cpu {
    use burn::backend::tensor::FloatTensor;
    use burn::tensor::Tensor;

    use crate::cpu::CpuTensors;
    use crate::cpu::rows::squares;
    use crate::op::Op;
    use crate::ops::{FusedOp, run};

    /// `Σ x²` over the elements of `x` (flex or ndarray, f32), on the host.
    pub(crate) fn square_sum<const D: usize>(x: Tensor<D>) -> f32 {
        let n = x.dims().iter().product::<usize>();
        let sum = run(FusedOp::SquareSum, vec![x.reshape([1, 1, 1, n])], None);
        sum.into_scalar::<f32>()
    }

    /// The sum of the squares of the one tensor, `[1, 1, 1, 1]`.
    pub(crate) struct SquareSumOp;

    impl<B: CpuTensors> Op<B> for SquareSumOp {
        type Saved = ();

        fn forward(self, inputs: Vec<FloatTensor<B>>) -> (FloatTensor<B>, ()) {
            (squares::square_sum::<B>(&inputs[0]), ())
        }

        /// A norm for clipping is not differentiated: no gradient.
        fn backward(_: (), _: FloatTensor<B>, wanted: &[bool]) -> Vec<Option<FloatTensor<B>>> {
            wanted.iter().map(|_| None).collect()
        }
    }
}
