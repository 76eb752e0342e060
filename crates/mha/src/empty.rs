//! Results of operations that have nothing to compute (an input or the output without
//! elements), made without running a Burn operation on an empty tensor: several backends
//! fail on them inside Burn (a reshape to a shape with a 0 reads the 0 as "keep this
//! axis"), or leave garbage in a product over an empty axis. [`crate::dispatch`] decides
//! when an operation takes this path; `narrow` and `reshape` test their own empty
//! case.
//!
//! Under autodiff the result depends on every input through a term that is exactly 0, so
//! that each input's gradient exists, in its own shape, and is 0.

use burn::tensor::kind::Basic;
use burn::tensor::{Bool, DType, Device, Tensor};

/// `t` in `shape` (of as many elements): Burn's reshape, or for a tensor without elements
/// whose shape changes, a new one of `shape` in its dtype on its device (Burn's reshape
/// reads a 0 in `shape` as "keep this axis", which fails where `t` has fewer axes, or
/// keeps the wrong one). The new one is not linked to `t` under autodiff (a tensor whose
/// shape does not change is passed on, gradient and all).
pub(crate) fn reshape<const D: usize, const D2: usize, K: Basic>(
    t: Tensor<D, K>,
    shape: [usize; D2],
) -> Tensor<D2, K> {
    let same = t.dims().as_slice() == shape.as_slice();
    match shape.contains(&0) && !same {
        true => Tensor::empty(shape, (&t.device(), t.dtype())),
        false => t.reshape(shape),
    }
}

/// A one-element 0 that depends on `x`, whose gradient into `x` is 0 in `x`'s shape,
/// whatever `x` holds (infinities and NaN included).
pub(crate) fn zero_of<const D: usize>(x: Tensor<D>) -> Tensor<1> {
    match x.dims().contains(&0) {
        // The sum of nothing is 0.
        true => x.sum(),
        false => {
            let all: Tensor<D, Bool> = x.zeros_like().equal_elem(0.0);
            x.mask_fill(all, 0.0).sum()
        }
    }
}

/// Zeros of `shape` in `dtype` on `device`; under autodiff, depending on each of `inputs`
/// with a zero gradient (`inputs` is read only under autodiff: pass a lazy iterator of
/// [`zero_of`] calls, so that no link is computed for nothing; they may be of other
/// dtypes).
pub(crate) fn zeros<const D: usize>(
    shape: [usize; D],
    device: &Device,
    dtype: DType,
    inputs: impl IntoIterator<Item = Tensor<1>>,
) -> Tensor<D> {
    let link = match device.is_autodiff() {
        true => inputs
            .into_iter()
            .map(|x| x.cast(dtype))
            .reduce(|a, b| a + b),
        false => None,
    };
    let Some(link) = link else {
        return Tensor::zeros(shape, (device, dtype));
    };
    let link = link.reshape([1; D]);
    match shape.contains(&0) {
        true => Tensor::zeros(shape, (device, dtype)) + link,
        false => link.expand(shape),
    }
}

/// `x.narrow(dim, start, len)`, which Burn refuses for `len = 0` and leaves outside the
/// autodiff graph when `x` has no element: then zeros of the narrowed shape depending on
/// `x`.
pub(crate) fn narrow<const D: usize>(
    x: Tensor<D>,
    dim: usize,
    start: usize,
    len: usize,
) -> Tensor<D> {
    match len == 0 || x.dims().contains(&0) {
        false => x.narrow(dim, start, len),
        true => {
            let mut dims = x.dims();
            dims[dim] = len;
            let (device, dtype) = (x.device(), x.dtype());
            zeros(dims, &device, dtype, core::iter::once_with(|| zero_of(x)))
        }
    }
}
