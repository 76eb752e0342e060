//! [`linear`]: `x W + b` for a weight that is not a `Linear`'s own (a head tied to an
//! embedding, `h Eᵀ`, say), as the layers of `mha` compute theirs: on flex and ndarray
//! (f32) one operation each way through the `gemm` crate, every operand read where it
//! lies and every result written once; elsewhere Burn's `linear`.

use burn::tensor::Tensor;

/// `x W + b` over the last axis of `x` `[.., d_in]`, with `weight` `[d_in, d_out]` (any
/// view of it: `E.transpose()` of an embedding `E` `[d_out, d_in]` is read in place) and
/// `bias` `[d_out]`; differentiable in all three.
///
/// # Panics
/// If the last axis of `x` is not `d_in`, or the bias is not `d_out` long; the message
/// names the shapes.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Tensor};
///
/// let device = Device::default();
/// let h = Tensor::<3>::from_floats([[[1.0, 2.0]]], &device); // [1, 1, d 2]
/// let table = Tensor::<2>::from_floats([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], &device);
/// let logits = mha::linear::linear(h, table.transpose(), None); // h Eᵀ: [1, 1, 3]
/// assert_eq!(logits.to_data().to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0]);
/// ```
pub fn linear<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
) -> Tensor<D> {
    let [d_in, d_out] = weight.dims();
    assert!(
        x.dims()[D - 1] == d_in,
        "linear: x's last axis is {} wide (shape {:?}), the weight's d_in is {d_in} (shape \
         [{d_in}, {d_out}])",
        x.dims()[D - 1],
        x.dims()
    );
    if let Some(bias) = &bias {
        assert!(
            bias.dims() == [d_out],
            "linear: the bias has shape {:?}, the weight's d_out is {d_out} (shape [{d_in}, \
             {d_out}])",
            bias.dims()
        );
    }
    crate::ops::linear::columns(x, weight, bias, None)
}
