//! A block's residual connection, `x + f(x)`. On the CPU backends one operation split over
//! the threads (`cpu::rows::add`): Burn's `add` of a small model's activations runs on one
//! thread, with the other cores waiting, and leaves the whole sum in that core's cache for
//! the layer norm after it, which reads it on every core. Elsewhere Burn's `add`.

use burn::tensor::Tensor;

#[cfg(feature = "cpu-kernels")]
use crate::dispatch::{self, RowCall, RowOp, RowPath};

/// `x + y`, of one shape.
///
/// # Panics
/// If the shapes differ (the message gives both).
pub(crate) fn add<const D: usize>(x: Tensor<D>, y: Tensor<D>) -> Tensor<D> {
    assert_eq!(
        x.dims(),
        y.dims(),
        "a residual connection adds tensors of one shape"
    );
    #[cfg(feature = "cpu-kernels")]
    if dispatch::row(RowCall::of(RowOp::Add, &x).with([y.dtype()])) == RowPath::Fused {
        let dims = x.dims();
        let floats = vec![super::rows(x), super::rows(y)];
        return super::run(super::FusedOp::Add, floats, None).reshape(dims);
    }
    x + y
}

#[cfg(feature = "cpu-kernels")]
pub(crate) use cpu::AddOp;

#[cfg(feature = "cpu-kernels")]
mod cpu {
    use burn::backend::tensor::FloatTensor;

    use crate::cpu::CpuTensors;
    use crate::cpu::rows::add::add;
    use crate::op::{Op, inputs};

    /// The sum of its two inputs; the gradient of each is the output's.
    pub(crate) struct AddOp;

    impl<B: CpuTensors> Op<B> for AddOp {
        type Saved = ();

        fn forward(self, floats: Vec<FloatTensor<B>>) -> (FloatTensor<B>, ()) {
            let [x, y] = inputs(floats);
            (add::<B>(&x, &y), ())
        }

        fn backward(_: (), grad: FloatTensor<B>, wanted: &[bool]) -> Vec<Option<FloatTensor<B>>> {
            let want = |i: usize| wanted.get(i).copied().unwrap_or(false);
            vec![want(0).then(|| grad.clone()), want(1).then_some(grad)]
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Tensor, TensorData};

    use crate::testing::devices;

    /// The sum and both gradients, on every backend, for a transposed (strided) input.
    #[test]
    fn the_sum_and_its_gradients_are_exact() {
        for device in devices() {
            let (rows, cols) = (300, 70);
            let a: Vec<f32> = (0..rows * cols)
                .map(|i| (i % 97) as f32 * 0.25 - 3.0)
                .collect();
            let b: Vec<f32> = (0..rows * cols)
                .map(|i| (i % 89) as f32 * 0.5 - 7.0)
                .collect();
            let g: Vec<f32> = (0..rows * cols).map(|i| (i % 13) as f32 - 6.0).collect();
            let x = Tensor::<2>::from_data(TensorData::new(a.clone(), [rows, cols]), &device)
                .require_grad();
            // y laid out transposed, read as [rows, cols].
            let bt: Vec<f32> = (0..rows * cols)
                .map(|at| b[(at % rows) * cols + at / rows])
                .collect();
            let y =
                Tensor::<2>::from_data(TensorData::new(bt, [cols, rows]), &device).require_grad();
            let sum = super::add(x.clone(), y.clone().transpose());
            let gt = Tensor::<2>::from_data(TensorData::new(g.clone(), [rows, cols]), &device);
            let grads = (sum.clone() * gt).sum().backward();
            let got = sum.into_data().convert::<f32>().to_vec::<f32>().unwrap();
            let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
            assert_eq!(got, want, "{device:?}: the sum");
            let dx = x
                .grad(&grads)
                .unwrap()
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>();
            assert_eq!(dx.unwrap(), g, "{device:?}: dx");
            let dy = y.grad(&grads).unwrap().transpose();
            let dy = dy.into_data().convert::<f32>().to_vec::<f32>().unwrap();
            assert_eq!(dy, g, "{device:?}: dy");
        }
    }
}
