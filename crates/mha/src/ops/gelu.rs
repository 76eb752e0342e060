//! The feed-forward's exact GELU, `x Φ(x) = x (1 + erf(x / √2)) / 2`. On the CPU backends
//! it is one operation with a backward of its own, one pass each way over the vectorised
//! kernels of `cpu::rows::gelu`. Elsewhere it is written with `erf`, so that autodiff derives
//! the exact gradient on every backend (Burn's fused `gelu` backward is the tanh
//! approximation's outside flex, off from PyTorch by about 3e-4): five elementwise passes
//! forward and more backward, each `erf` a scalar call of the C library per element on
//! the CPU. Half precision computes in f32 and rounds once, as PyTorch's.

use burn::tensor::Tensor;

use crate::dispatch::{self, RowCall, RowOp, RowPath};

/// `x Φ(x)`, elementwise, with its gradient under autodiff.
pub(crate) fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    match dispatch::row(RowCall::of(RowOp::Gelu, &x)) {
        #[cfg(feature = "cpu-kernels")]
        RowPath::Fused => {
            let dims = x.dims();
            let out = super::run(super::FusedOp::Gelu, vec![super::rows(x)], None);
            out.reshape(dims)
        }
        RowPath::Burn => gelu_burn(x),
        // Half precision in f32, rounded once, as PyTorch's.
        RowPath::BurnInF32 => {
            let dtype = x.dtype();
            gelu_burn(x.cast(burn::tensor::FloatDType::F32)).cast(dtype)
        }
        RowPath::Empty => {
            let (dims, device, dtype) = (x.dims(), x.device(), x.dtype());
            crate::empty::zeros(
                dims,
                &device,
                dtype,
                core::iter::once_with(|| crate::empty::zero_of(x)),
            )
        }
    }
}

/// GELU's tanh approximation, `x/2 · (1 + tanh(√(2/π) (x + 0.044715 x³)))`, in Burn's
/// operations: in `x`'s dtype, or in f32 where the exact GELU's row path says so (half
/// precision, rounded once, as PyTorch's: `1 + tanh` cancels for negative inputs).
pub(crate) fn gelu_tanh<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    // √(2/π); x³ as a product (a power of a negative base is NaN on some GPUs).
    const SQRT_2_OVER_PI: f64 =
        core::f64::consts::FRAC_2_SQRT_PI * core::f64::consts::FRAC_1_SQRT_2;
    let formula = |x: Tensor<D>| {
        let cube = x.clone() * x.clone() * x.clone();
        let inner = (x.clone() + cube * 0.044715) * SQRT_2_OVER_PI;
        x * (inner.tanh() + 1.0) * 0.5
    };
    match dispatch::row(RowCall::of(RowOp::Gelu, &x)) {
        RowPath::BurnInF32 => {
            let dtype = x.dtype();
            formula(x.cast(burn::tensor::FloatDType::F32)).cast(dtype)
        }
        _ => formula(x),
    }
}

/// `x Φ(x)` in Burn's operations, in `x`'s dtype. The products by constants (not a
/// division: Burn's backward of a division by a scalar takes its reciprocal in f32, which
/// an f64 gradient shows).
fn gelu_burn<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    x.clone() * ((x * core::f64::consts::FRAC_1_SQRT_2).erf() + 1.0) * 0.5
}

#[cfg(feature = "cpu-kernels")]
pub(crate) use cpu::GeluOp;

#[cfg(feature = "cpu-kernels")]
mod cpu {
    use burn::backend::tensor::FloatTensor;

    use crate::cpu::CpuTensors;
    use crate::cpu::rows::gelu::{gelu_backward, gelu_forward};
    use crate::op::{Op, inputs};

    /// GELU over the rows of its one input. Where a backward pass will run, the forward
    /// pass computes the slope `Φ(x) + x φ(x)` of every element with its value (they
    /// share their `erf` and `exp`) and keeps it, in place of the input: the backward
    /// pass is then one product.
    pub(crate) struct GeluOp;

    impl<B: CpuTensors> Op<B> for GeluOp {
        type Saved = FloatTensor<B>;

        fn forward(self, x: Vec<FloatTensor<B>>) -> (FloatTensor<B>, FloatTensor<B>) {
            let [x] = inputs(x);
            let (out, slope) = gelu_forward::<B>(&x, true);
            (out, slope.expect("the slope, asked for"))
        }

        fn output(self, x: Vec<FloatTensor<B>>) -> FloatTensor<B> {
            let [x] = inputs(x);
            gelu_forward::<B>(&x, false).0
        }

        fn backward(
            slope: FloatTensor<B>,
            grad: FloatTensor<B>,
            _: &[bool],
        ) -> Vec<Option<FloatTensor<B>>> {
            vec![Some(gelu_backward::<B>(&slope, &grad))]
        }
    }
}
