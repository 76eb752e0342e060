//! Layer normalisation over the last axis, and its RMS form (Llama's RMSNorm). On the CPU
//! backends each is one operation with a backward of its own, one pass over the rows
//! each way instead of the nine elementwise operations autodiff would otherwise record
//! and walk back; elsewhere Burn's `layer_norm`, and the RMS norm written with Burn's
//! operations in f32 as Hugging Face's is.

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
    let gamma = crate::dtype::dequantized(gamma, x.dtype());
    let beta = beta.map(|b| crate::dtype::dequantized(b, x.dtype()));
    let others = [Some(gamma.dtype()), beta.as_ref().map(Tensor::dtype)];
    super::check_dtypes("LayerNorm", x.dtype(), others.into_iter().flatten());
    match dispatch::row(RowCall::of(RowOp::LayerNorm, &x)) {
        #[cfg(feature = "cpu-kernels")]
        RowPath::Fused => {
            let dims = x.dims();
            let d = dims[D - 1];
            // A norm without shift passes a shift of zeros, which wants no gradient.
            // In gamma's dtype, whatever the device's default float dtype.
            let beta = beta.unwrap_or_else(|| Tensor::zeros([d], (&gamma.device(), gamma.dtype())));
            let [gamma, beta] = [gamma, beta].map(|p| p.reshape([1, 1, 1, d]));
            let op = super::FusedOp::LayerNorm {
                epsilon,
                center: true,
            };
            super::run(op, vec![super::rows(x), gamma, beta], None).reshape(dims)
        }
        RowPath::Burn => burn::tensor::module::layer_norm(x, gamma, beta, epsilon),
        RowPath::Empty => {
            let (dims, device, dtype) = (x.dims(), x.device(), x.dtype());
            let inputs = once_with(|| zero_of(x))
                .chain(once_with(|| zero_of(gamma)))
                .chain(beta.into_iter().map(zero_of));
            crate::empty::zeros(dims, &device, dtype, inputs)
        }
        RowPath::BurnInF32 => {
            let dtype = x.dtype();
            let [gamma, beta] = [Some(gamma), beta].map(|p| p.map(|p| p.cast(DType::F32)));
            let gamma = gamma.expect("a scale");
            burn::tensor::module::layer_norm(x.cast(DType::F32), gamma, beta, epsilon).cast(dtype)
        }
    }
}

/// `x / √(mean(x²) + ε) · γ` over the last axis of `x` `[.., d]`, with `gamma` `[d]`:
/// Hugging Face's `LlamaRMSNorm`, which normalises in f32 whatever the input's dtype and
/// scales in the input's dtype.
pub(crate) fn rms_norm<const D: usize>(x: Tensor<D>, gamma: Tensor<1>, epsilon: f64) -> Tensor<D> {
    let gamma = crate::dtype::dequantized(gamma, x.dtype());
    super::check_dtypes("RMSNorm", x.dtype(), [gamma.dtype()]);
    match dispatch::row(RowCall::of(RowOp::RmsNorm, &x)) {
        #[cfg(feature = "cpu-kernels")]
        RowPath::Fused => {
            let dims = x.dims();
            let d = dims[D - 1];
            // No shift: zeros, which want no gradient.
            let beta = Tensor::zeros([d], (&gamma.device(), gamma.dtype()));
            let [gamma, beta] = [gamma, beta].map(|p| p.reshape([1, 1, 1, d]));
            let op = super::FusedOp::LayerNorm {
                epsilon,
                center: false,
            };
            super::run(op, vec![super::rows(x), gamma, beta], None).reshape(dims)
        }
        RowPath::Burn => normalise_rms(x, epsilon) * unsqueeze(gamma),
        RowPath::BurnInF32 => {
            let dtype = x.dtype();
            normalise_rms(x.cast(DType::F32), epsilon).cast(dtype) * unsqueeze(gamma)
        }
        RowPath::Empty => {
            let (dims, device, dtype) = (x.dims(), x.device(), x.dtype());
            let inputs = once_with(|| zero_of(x)).chain(once_with(|| zero_of(gamma)));
            crate::empty::zeros(dims, &device, dtype, inputs)
        }
    }
}

/// `x / √(mean(x²) + ε)` over the last axis, in `x`'s dtype.
fn normalise_rms<const D: usize>(x: Tensor<D>, epsilon: f64) -> Tensor<D> {
    let mean_square = x.clone().square().mean_dim(D - 1);
    x * (mean_square + epsilon).sqrt().recip()
}

/// `v` `[d]` as `[1, .., 1, d]`, to scale rows of rank `D`.
fn unsqueeze<const D: usize>(v: Tensor<1>) -> Tensor<D> {
    v.unsqueeze()
}

#[cfg(feature = "cpu-kernels")]
pub(crate) use cpu::LayerNormOp;

#[cfg(feature = "cpu-kernels")]
mod cpu {
    use burn::backend::tensor::FloatTensor;

    use crate::cpu::CpuTensors;
    use crate::cpu::rows::norm::{RowStats, layer_norm_backward, layer_norm_forward};
    use crate::op::{Op, inputs};

    /// Layer norm of `[x, gamma, beta]` (`[1, 1, rows, d]`, `[1, 1, 1, d]` twice); the
    /// RMS norm unless `center`.
    pub(crate) struct LayerNormOp {
        pub(crate) epsilon: f64,
        pub(crate) center: bool,
    }

    /// What the backward pass keeps: the input, the scale and each row's statistics.
    #[derive(Debug, Clone)]
    pub(crate) struct Saved<B: CpuTensors> {
        x: FloatTensor<B>,
        gamma: FloatTensor<B>,
        stats: RowStats,
        center: bool,
    }

    impl<B: CpuTensors> Op<B> for LayerNormOp {
        type Saved = Saved<B>;

        fn forward(self, floats: Vec<FloatTensor<B>>) -> (FloatTensor<B>, Saved<B>) {
            let [x, gamma, beta] = inputs(floats);
            let (y, stats) = layer_norm_forward::<B>(&x, &gamma, &beta, self.epsilon, self.center);
            let center = self.center;
            (
                y,
                Saved {
                    x,
                    gamma,
                    stats,
                    center,
                },
            )
        }

        fn backward(
            s: Saved<B>,
            grad: FloatTensor<B>,
            wanted: &[bool],
        ) -> Vec<Option<FloatTensor<B>>> {
            let out =
                layer_norm_backward::<B>(&s.x, &s.gamma, &s.stats, &grad, wanted[0], s.center);
            vec![Some(out.x), Some(out.gamma), Some(out.beta)]
        }
    }
}
