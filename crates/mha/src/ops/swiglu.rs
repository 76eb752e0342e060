//! The gated feed-forward's SwiGLU, `SiLU(g) · u` (Llama's, Mistral's and Qwen's MLP
//! between `gate_proj`, `up_proj` and `down_proj`). On the CPU backends one operation
//! with a backward of its own, one vectorised pass each way (`cpu::rows::swiglu`);
//! elsewhere Burn's `silu` and a product.

use burn::tensor::{DType, Tensor};

use crate::dispatch::{self, RowCall, RowOp, RowPath};

/// SiLU, `x σ(x)`, elementwise: Burn's, except in f64, where Burn's sigmoid computes in
/// f32 on the backends without one of their own (ndarray: f64 values and gradients to
/// f32's digits); there in Burn's operations, σ from `e = e^-|x|` (at most 1, never
/// overflowing): `1 / (1 + e)` for `x >= 0`, `e / (1 + e)` below, to f64's digits at
/// every `x`.
pub(crate) fn silu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    match x.dtype() {
        DType::F64 => {
            let e = x.clone().abs().neg().exp();
            let inverse = (e.clone() + 1.0).recip();
            let negative = x.clone().lower_elem(0.0);
            x * inverse.clone().mask_where(negative, e * inverse)
        }
        _ => burn::tensor::activation::silu(x),
    }
}

/// `SiLU(gate) · up`, elementwise, with both gradients under autodiff.
///
/// # Panics
/// If the shapes differ (the message gives both).
pub(crate) fn swiglu<const D: usize>(gate: Tensor<D>, up: Tensor<D>) -> Tensor<D> {
    assert_eq!(
        gate.dims(),
        up.dims(),
        "SwiGLU multiplies the gate and the up projection of one shape"
    );
    match dispatch::row(RowCall::of(RowOp::SwiGlu, &gate).with([up.dtype()])) {
        #[cfg(feature = "cpu-kernels")]
        RowPath::Fused => {
            let dims = gate.dims();
            let floats = vec![super::rows(gate), super::rows(up)];
            super::run(super::FusedOp::SwiGlu, floats, None).reshape(dims)
        }
        RowPath::Burn | RowPath::BurnInF32 => silu(gate) * up,
        RowPath::Empty => {
            let (dims, device, dtype) = (gate.dims(), gate.device(), gate.dtype());
            let links = [gate, up].into_iter().map(crate::empty::zero_of);
            crate::empty::zeros(dims, &device, dtype, links)
        }
    }
}

#[cfg(feature = "cpu-kernels")]
pub(crate) use cpu::SwiGluOp;

#[cfg(feature = "cpu-kernels")]
mod cpu {
    use burn::backend::tensor::FloatTensor;

    use crate::cpu::CpuTensors;
    use crate::cpu::rows::swiglu::{swiglu_backward, swiglu_forward};
    use crate::op::{Op, inputs};

    /// `SiLU(g) · u` over its two inputs; the backward pass recomputes `σ(g)` from the
    /// inputs it keeps (two of the shape, as the product's backward alone would keep).
    pub(crate) struct SwiGluOp;

    impl<B: CpuTensors> Op<B> for SwiGluOp {
        type Saved = [FloatTensor<B>; 2];

        fn forward(self, floats: Vec<FloatTensor<B>>) -> (FloatTensor<B>, Self::Saved) {
            let [gate, up] = inputs(floats);
            (swiglu_forward::<B>(&gate, &up), [gate, up])
        }

        fn backward(
            [gate, up]: Self::Saved,
            grad: FloatTensor<B>,
            wanted: &[bool],
        ) -> Vec<Option<FloatTensor<B>>> {
            let want = |i: usize| wanted.get(i).copied().unwrap_or(false);
            swiglu_backward::<B>(&gate, &up, &grad, [want(0), want(1)]).into()
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Tensor, TensorData};

    use crate::testing::devices;

    /// The value and both gradients against f64, on every backend (the CPU's operation
    /// and Burn's `silu` elsewhere), for a transposed (strided) `up`; and with only one
    /// input tracked.
    #[test]
    fn the_value_and_both_gradients_match_f64() {
        let (rows, cols) = (300, 70);
        let n = rows * cols;
        let g: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * 0.25 - 12.0).collect();
        let u: Vec<f32> = (0..n).map(|i| (i % 89) as f32 * 0.05 - 2.2).collect();
        let dy: Vec<f32> = (0..n).map(|i| (i % 13) as f32 * 0.3 - 1.8).collect();
        let reference: Vec<[f64; 3]> = (0..n)
            .map(|i| {
                let (g, u, dy) = (g[i] as f64, u[i] as f64, dy[i] as f64);
                let s = 1.0 / (1.0 + (-g).exp());
                [g * s * u, dy * u * s * (1.0 + g * (1.0 - s)), dy * g * s]
            })
            .collect();
        let check = |what: &str, got: Vec<f32>, at: usize| {
            let worst = got
                .iter()
                .zip(&reference)
                .map(|(&got, want)| (got as f64 - want[at]).abs() / want[at].abs().max(1.0))
                .fold(0.0f64, f64::max);
            // f32's rounding of a few operations (Burn's silu included).
            assert!(worst < 2e-6, "{what}: worst error {worst:e}");
        };
        let floats = |t: Tensor<2>| t.into_data().convert::<f32>().to_vec::<f32>().unwrap();
        for device in devices() {
            let data = |v: Vec<f32>, shape: [usize; 2]| {
                Tensor::<2>::from_data(TensorData::new(v, shape), &device)
            };
            // up laid out transposed, read as [rows, cols].
            let ut: Vec<f32> = (0..n).map(|at| u[(at % rows) * cols + at / rows]).collect();
            for tracked in [[true, true], [true, false], [false, true]] {
                let track = |t: Tensor<2>, yes: bool| if yes { t.require_grad() } else { t };
                let gate = track(data(g.clone(), [rows, cols]), tracked[0]);
                let up = track(data(ut.clone(), [cols, rows]), tracked[1]);
                let out = super::swiglu(gate.clone(), up.clone().transpose());
                let grads = (out.clone() * data(dy.clone(), [rows, cols]))
                    .sum()
                    .backward();
                check(&format!("{device:?}: the value"), floats(out), 0);
                match gate.grad(&grads) {
                    Some(dg) => check(&format!("{device:?}: dg"), floats(dg), 1),
                    None => assert!(!tracked[0], "{device:?}: dg missing"),
                }
                match up.grad(&grads) {
                    Some(du) => check(&format!("{device:?}: du"), floats(du.transpose()), 2),
                    None => assert!(!tracked[1], "{device:?}: du missing"),
                }
            }
        }
    }
}
