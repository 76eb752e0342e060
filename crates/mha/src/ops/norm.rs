//! Layer normalisation over the last axis. On the CPU backends it is one operation with
//! a backward of its own, one pass over the rows each way instead of the nine elementwise
//! operations autodiff would otherwise record and walk back; elsewhere Burn's
//! `layer_norm`.

use core::iter::once_with;

use burn::tensor::{DType, Tensor};

use crate::dispatch::{self, RowCall, RowOp, RowPath};
use crate::empty::zero_of;

/// `(x - mean) / √(var + ε) · γ + β` over the last axis of `x` `[.., d]`, with `gamma`
/// and `beta` `[d]`.
pub(crate) fn layer_norm<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Option<Tensor<1>>,
    epsilon: f64,
) -> Tensor<D> {
    let others = [Some(gamma.dtype()), beta.as_ref().map(Tensor::dtype)];
    super::check_dtypes("LayerNorm", x.dtype(), others.into_iter().flatten());
    match dispatch::row(RowCall::of(RowOp::LayerNorm, &x)) {
        #[cfg(feature = "cpu-kernels")]
        RowPath::Fused => {
            let dims = x.dims();
            let d = dims[D - 1];
            // A norm without shift passes a shift of zeros, which wants no gradient.
            let beta = beta.unwrap_or_else(|| Tensor::zeros([d], &gamma.device()));
            let [gamma, beta] = [gamma, beta].map(|p| p.reshape([1, 1, 1, d]));
            let op = super::FusedOp::LayerNorm { epsilon };
            super::run(op, vec![super::rows(x), gamma, beta], None).reshape(dims)
        }
        RowPath::Burn => burn::tensor::module::layer_norm(x, gamma, beta, epsilon),
        RowPath::Empty => {
            let (dims, device) = (x.dims(), x.device());
            let inputs = once_with(|| zero_of(x))
                .chain(once_with(|| zero_of(gamma)))
                .chain(beta.into_iter().map(zero_of));
            crate::empty::zeros(dims, &device, inputs)
        }
        RowPath::BurnInF32 => {
            let dtype = x.dtype();
            let [gamma, beta] = [Some(gamma), beta].map(|p| p.map(|p| p.cast(DType::F32)));
            let gamma = gamma.expect("a scale");
            burn::tensor::module::layer_norm(x.cast(DType::F32), gamma, beta, epsilon).cast(dtype)
        }
    }
}

#[cfg(feature = "cpu-kernels")]
pub(crate) use cpu::LayerNormOp;

#[cfg(feature = "cpu-kernels")]
mod cpu {
    use burn::backend::tensor::FloatTensor;

    use crate::cpu::CpuTensors;
    use crate::cpu::rows::norm::{RowStats, layer_norm_backward, layer_norm_forward};
    use crate::op::{Op, inputs};

    /// Layer norm of `[x, gamma, beta]` (`[1, 1, rows, d]`, `[1, 1, 1, d]` twice).
    pub(crate) struct LayerNormOp {
        pub(crate) epsilon: f64,
    }

    /// What the backward pass keeps: the input, the scale and each row's statistics.
    #[derive(Debug, Clone)]
    pub(crate) struct Saved<B: CpuTensors> {
        x: FloatTensor<B>,
        gamma: FloatTensor<B>,
        stats: RowStats,
    }

    impl<B: CpuTensors> Op<B> for LayerNormOp {
        type Saved = Saved<B>;

        fn forward(self, floats: Vec<FloatTensor<B>>) -> (FloatTensor<B>, Saved<B>) {
            let [x, gamma, beta] = inputs(floats);
            let (y, stats) = layer_norm_forward::<B>(&x, &gamma, &beta, self.epsilon);
            (y, Saved { x, gamma, stats })
        }

        fn backward(
            s: Saved<B>,
            grad: FloatTensor<B>,
            wanted: &[bool],
        ) -> Vec<Option<FloatTensor<B>>> {
            let out = layer_norm_backward::<B>(&s.x, &s.gamma, &s.stats, &grad, wanted[0]);
            vec![Some(out.x), Some(out.gamma), Some(out.beta)]
        }
    }
}
