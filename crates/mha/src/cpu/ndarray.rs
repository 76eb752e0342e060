//! The tiles on ndarray: its arrays read where they lie, through the strides of their
//! views.

// Burn 0.22 deprecates ndarray; it is still one of our backends.
#![allow(deprecated)]

use burn::backend::{
    NdArray, TensorData, TensorMetadata,
    ndarray::NdArrayTensor,
    ops::{BoolTensorOps, FloatTensorOps},
    try_read_sync,
};
use rayon::prelude::*;

use super::{CpuTensors, Grid};

impl CpuTensors for NdArray {
    fn readable(tensor: &NdArrayTensor) -> NdArrayTensor {
        match view_of_floats(tensor) {
            Some(_) => tensor.clone(),
            None => NdArrayTensor::from_data(data_of(tensor)),
        }
    }

    fn readable_mask(mask: &NdArrayTensor) -> NdArrayTensor {
        match view_of_bytes(mask) {
            Some(_) => mask.clone(),
            None => NdArrayTensor::from_data(data_of(mask)),
        }
    }

    fn dense_rows(tensor: &NdArrayTensor) -> NdArrayTensor {
        let tensor = Self::readable(tensor);
        let grid = Self::floats(&tensor);
        let NdArrayTensor::F32(storage) = &tensor else {
            unreachable!("floats() checked the dtype");
        };
        let shape: [usize; 4] = storage.shape().try_into().expect("rank 4");
        let [_, heads, len, d] = shape;
        let [s0, s1, s2, _] = grid.strides;
        if len <= 1 || s2 == d {
            return tensor;
        }
        let mut values = vec![0.0f32; shape.iter().product()];
        values
            .par_chunks_mut((len * d).max(1))
            .enumerate()
            .for_each(|(bh, head)| {
                let (b, h) = (bh / heads, bh % heads);
                for (t, row) in head.chunks_mut(d.max(1)).enumerate() {
                    let at = grid.offset + b * s0 + h * s1 + t * s2;
                    row.copy_from_slice(&grid.data[at..at + d]);
                }
            });
        NdArrayTensor::from_data(TensorData::new(values, shape))
    }

    fn floats(tensor: &NdArrayTensor) -> Grid<'_, f32> {
        view_of_floats(tensor).expect("a readable tensor is read in place")
    }

    fn bytes(mask: &NdArrayTensor) -> Grid<'_, u8> {
        view_of_bytes(mask).expect("a readable mask is read in place")
    }

    fn from_rows(values: Vec<f32>, dims: [usize; 4]) -> NdArrayTensor {
        NdArrayTensor::from_data(TensorData::new(values, dims))
    }
}

/// The elements an array view spans (through non-negative strides) as a grid, with
/// stride 0 along its axes of 1, or `None` for other layouts.
fn span<'a, T>(ptr: *const T, shape: &[usize], strides: &[isize]) -> Option<Grid<'a, T>> {
    let (shape, strides): ([usize; 4], [isize; 4]) =
        (shape.try_into().ok()?, strides.try_into().ok()?);
    let inner = shape[3] == 1 || strides[3] == 1;
    if !inner || strides.iter().any(|&s| s < 0) {
        return None;
    }
    let strides: [usize; 4] = std::array::from_fn(|a| match shape[a] {
        1 => 0,
        _ => strides[a] as usize,
    });
    let len = match shape.contains(&0) {
        true => 0,
        false => 1 + (0..4).map(|a| (shape[a] - 1) * strides[a]).sum::<usize>(),
    };
    // SAFETY: the view's elements lie within `len` elements from `ptr` (non-negative
    // strides); the callers tie the slice's lifetime to the array's.
    let data = unsafe { std::slice::from_raw_parts(ptr, len) };
    Some(Grid {
        data,
        offset: 0,
        strides,
    })
}

/// An f32 tensor's grid, borrowing its array; `None` where its view cannot be read in
/// place.
///
/// # Panics
/// If the tensor is not f32 (the dispatcher sends other dtypes to the explicit path).
fn view_of_floats(tensor: &NdArrayTensor) -> Option<Grid<'_, f32>> {
    let NdArrayTensor::F32(storage) = tensor else {
        panic!("the tiles read f32 tensors, got {:?}", tensor.dtype());
    };
    let view = storage.view();
    span(view.as_ptr(), view.shape(), view.strides())
}

/// A boolean tensor's grid as bytes (`bool` is one byte, 0 or 1); `None` where its view
/// cannot be read in place.
fn view_of_bytes(tensor: &NdArrayTensor) -> Option<Grid<'_, u8>> {
    let NdArrayTensor::Bool(storage) = tensor else {
        panic!("expected a boolean mask, got {:?}", tensor.dtype());
    };
    let view = storage.view();
    span(view.as_ptr().cast::<u8>(), view.shape(), view.strides())
}

/// The tensor's data, row-major (a copy).
fn data_of(tensor: &NdArrayTensor) -> TensorData {
    let data = match tensor {
        NdArrayTensor::Bool(_) => try_read_sync(NdArray::bool_into_data(tensor.clone())),
        _ => try_read_sync(NdArray::float_into_data(tensor.clone())),
    };
    data.expect("ndarray reads synchronously")
        .unwrap_or_else(|err| panic!("reading an ndarray tensor: {err:?}"))
}
