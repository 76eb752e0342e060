//! AdamW's step over one parameter, for [`crate::optim::AdamW`]. On the CPU backends (f32)
//! it is one operation: one parallel pass over the parameter, its gradient and its two
//! moments (`cpu::rows::adamw`). Elsewhere the optimizer runs Burn's AdamW.

#[cfg(feature = "cpu-kernels")]
pub(crate) use crate::cpu::rows::adamw::AdamWStep;
#[cfg(feature = "cpu-kernels")]
pub(crate) use cpu::{AdamWOp, adamw_step};

#[cfg(feature = "cpu-kernels")]
mod cpu {
    use burn::backend::tensor::FloatTensor;
    use burn::tensor::Tensor;

    use super::AdamWStep;
    use crate::cpu::CpuTensors;
    use crate::cpu::rows::adamw;
    use crate::op::Op;
    use crate::ops::{FusedOp, run};

    /// The parameter, the first and the second moment after one step, from the parameter,
    /// its gradient and (after the first step) the moments before it, all of one shape.
    /// The three share one buffer.
    pub(crate) fn adamw_step<const D: usize>(
        param: Tensor<D>,
        grad: Tensor<D>,
        moments: Option<[Tensor<D>; 2]>,
        step: AdamWStep,
    ) -> [Tensor<D>; 3] {
        let dims = param.dims();
        let n = dims.iter().product::<usize>();
        let flat = |x: Tensor<D>| x.reshape([1, 1, 1, n]);
        let mut inputs = vec![flat(param), flat(grad)];
        inputs.extend(moments.into_iter().flatten().map(flat));
        let out = run(FusedOp::AdamW(step), inputs, None); // [1, 1, 3, n]
        [0, 1, 2].map(|row| out.clone().narrow(2, row, 1).reshape(dims))
    }

    /// AdamW's step: the tensors are the parameter, its gradient and its moments; the
    /// output their three updates, `[1, 1, 3, n]`.
    pub(crate) struct AdamWOp(pub(crate) AdamWStep);

    impl<B: CpuTensors> Op<B> for AdamWOp {
        type Saved = ();

        fn forward(self, inputs: Vec<FloatTensor<B>>) -> (FloatTensor<B>, ()) {
            (adamw::adamw_step::<B>(&inputs, self.0), ())
        }

        /// An optimizer's step is not differentiated: no gradient.
        fn backward(_: (), _: FloatTensor<B>, wanted: &[bool]) -> Vec<Option<FloatTensor<B>>> {
            wanted.iter().map(|_| None).collect()
        }
    }
}
