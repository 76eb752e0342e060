//! Reading backend tensors in place: the [`CpuTensors`] of flex and of ndarray, each
//! tensor's elements as a [`Grid`] over its storage, through its strides (no copy where
//! its layout allows one to be read: rank 4, strides not negative, unit stride along the
//! last axis).

// Burn 0.22 deprecates ndarray; it is still one of our backends.
#![allow(deprecated)]

use burn::backend::{
    Backend, TensorMetadata,
    tensor::{BoolTensor, FloatTensor},
};

/// A CPU backend whose tensors the kernels read where they lie. The kernels take f32
/// tensors and boolean masks stored as bytes (the dispatcher sends other dtypes to Burn's
/// operations); the readers panic on others.
pub(crate) trait CpuTensors: Backend {
    /// The tensor itself where its floats can be read through its strides (rank 4, strides
    /// not negative, unit stride along the last axis), else a contiguous copy.
    fn readable(tensor: &FloatTensor<Self>) -> FloatTensor<Self>;

    /// [`readable`](Self::readable) for a boolean mask.
    fn readable_mask(mask: &BoolTensor<Self>) -> BoolTensor<Self>;

    /// A readable tensor whose rows lie next to each other, for the operands read as
    /// panels of a matrix product (K and V): rows a few KB apart (the heads of a `[B, T,
    /// H·Dh]` projection) fall into few sets of the L1 cache, and one copy costs less than
    /// the misses.
    fn dense_rows(tensor: &FloatTensor<Self>) -> FloatTensor<Self>;

    /// The floats of a readable tensor.
    fn floats(tensor: &FloatTensor<Self>) -> Grid<'_, f32>;

    /// The bytes of a readable boolean mask (nonzero = `true`).
    fn bytes(mask: &BoolTensor<Self>) -> Grid<'_, u8>;

    /// A tensor of shape `dims` holding row-major `values`.
    fn from_rows(values: Vec<f32>, dims: [usize; 4]) -> FloatTensor<Self>;
}

/// A rank-4 tensor read through its strides: element `[b, h, i, j]` at
/// `offset + b·s0 + h·s1 + i·s2 + j·s3`. A broadcast axis (size 1) has stride 0.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Grid<'a, T> {
    pub(super) data: &'a [T],
    pub(super) offset: usize,
    pub(super) strides: [usize; 4],
}

impl<T: Copy> Grid<'_, T> {
    pub(super) fn at(&self, b: usize, h: usize, i: usize, j: usize) -> T {
        let [s0, s1, s2, s3] = self.strides;
        self.data[self.offset + b * s0 + h * s1 + i * s2 + j * s3]
    }

    /// Row `i` of matrix `(b, h)`, `cols` wide (the columns have unit stride).
    pub(super) fn row(&self, b: usize, h: usize, i: usize, cols: usize) -> &[T] {
        let [s0, s1, s2, _] = self.strides;
        let start = self.offset + b * s0 + h * s1 + i * s2;
        &self.data[start..start + cols]
    }

    /// Rows `row..row + rows` of matrix `(b, h)`, `cols` wide: the first element and the
    /// row stride (the columns have unit stride).
    ///
    /// # Panics
    /// If the block reaches past the data.
    pub(super) fn rows(
        &self,
        b: usize,
        h: usize,
        row: usize,
        [rows, cols]: [usize; 2],
    ) -> (*const T, usize) {
        let [s0, s1, s2, _] = self.strides;
        let start = self.offset + b * s0 + h * s1 + row * s2;
        let end = start + rows.saturating_sub(1) * s2 + cols;
        assert!(
            rows == 0 || end <= self.data.len(),
            "a block of {rows} x {cols} from element {start} (row stride {s2}) reaches past {} elements",
            self.data.len()
        );
        (self.data[start..].as_ptr(), s2)
    }
}

impl<'a> Grid<'a, f32> {
    /// The elements of a tensor of `dims` in row-major order: the storage itself when it
    /// is contiguous, else a copy.
    pub(crate) fn contiguous(&self, [b, h, r, c]: [usize; 4]) -> std::borrow::Cow<'a, [f32]> {
        let n = b * h * r * c;
        let [s0, s1, s2, _] = self.strides;
        let dense = (b == 1 || s0 == h * r * c) && (h == 1 || s1 == r * c) && (r == 1 || s2 == c);
        if dense && self.offset + n <= self.data.len() {
            return std::borrow::Cow::Borrowed(&self.data[self.offset..self.offset + n]);
        }
        let mut all = Vec::with_capacity(n);
        for bi in 0..b {
            for hi in 0..h {
                for ri in 0..r {
                    all.extend_from_slice(self.row(bi, hi, ri, c));
                }
            }
        }
        std::borrow::Cow::Owned(all)
    }
}

/// The dims of a rank-4 tensor.
pub(crate) fn dims_of<B: Backend>(x: &FloatTensor<B>) -> [usize; 4] {
    let shape: Vec<usize> = x.shape().iter().copied().collect();
    <[usize; 4]>::try_from(shape).expect("rank 4")
}

#[cfg(feature = "flex")]
mod flex {
    //! flex's tensors, read where they lie through their strides.

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
}

#[cfg(feature = "ndarray")]
mod ndarray {
    //! ndarray's arrays, read where they lie through the strides of their views.

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
}
