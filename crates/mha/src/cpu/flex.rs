//! The tiles on flex: its tensors read where they lie, through their strides.

use burn::backend::{BoolStore, DType, Flex, TensorData, flex::FlexTensor};

use super::{CpuTensors, Grid};

impl CpuTensors for Flex {
    fn readable(tensor: &FlexTensor) -> FlexTensor {
        check_f32(tensor);
        in_place_or_copy(tensor)
    }

    fn readable_mask(mask: &FlexTensor) -> FlexTensor {
        let dtype = mask.dtype();
        assert!(
            matches!(dtype, DType::Bool(BoolStore::Native | BoolStore::U8)),
            "the tiles read boolean masks stored as bytes, got {dtype:?}"
        );
        in_place_or_copy(mask)
    }

    fn dense_rows(tensor: &FlexTensor) -> FlexTensor {
        check_f32(tensor);
        let layout = tensor.layout();
        let shape = layout.shape();
        let strides = layout.strides();
        let dense = shape.num_dims() == 4
            && (shape[2] == 1 || strides[2] == shape[3] as isize)
            && (shape[3] == 1 || strides[3] == 1)
            && strides.iter().all(|&s| s >= 0);
        match dense {
            true => tensor.clone(),
            false => tensor.to_contiguous(),
        }
    }

    fn floats(tensor: &FlexTensor) -> Grid<'_, f32> {
        check_f32(tensor);
        grid(tensor, tensor.storage::<f32>())
    }

    fn bytes(mask: &FlexTensor) -> Grid<'_, u8> {
        grid(mask, mask.storage::<u8>())
    }

    fn from_rows(values: Vec<f32>, dims: [usize; 4]) -> FlexTensor {
        FlexTensor::from_data(TensorData::new(values, dims))
    }
}

/// # Panics
/// If `tensor` is not f32 (the dispatcher sends other dtypes to the explicit path).
fn check_f32(tensor: &FlexTensor) {
    let dtype = tensor.dtype();
    assert!(
        dtype == DType::F32,
        "the tiles read f32 tensors, got {dtype:?}"
    );
}

/// The tensor itself where its elements can be read through its strides (rank 4, strides
/// not negative, unit stride along the last axis), else a contiguous copy.
fn in_place_or_copy(tensor: &FlexTensor) -> FlexTensor {
    let layout = tensor.layout();
    let dims = layout.shape().num_dims();
    let strides = layout.strides();
    let inner = dims == 0 || strides[dims - 1] == 1 || layout.shape()[dims - 1] == 1;
    match dims == 4 && inner && strides.iter().all(|&s| s >= 0) {
        true => tensor.clone(),
        false => tensor.to_contiguous(),
    }
}

/// The grid of a readable tensor over its `storage`, with stride 0 along its axes of 1.
fn grid<'a, T>(tensor: &FlexTensor, storage: &'a [T]) -> Grid<'a, T> {
    let layout = tensor.layout();
    Grid {
        data: storage,
        offset: layout.start_offset(),
        strides: std::array::from_fn(|axis| match layout.shape()[axis] {
            1 => 0,
            _ => layout.strides()[axis] as usize,
        }),
    }
}
