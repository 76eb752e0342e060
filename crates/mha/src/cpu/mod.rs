//! The kernels of the CPU backends (flex, ndarray), one file or folder per job, in the
//! manner of matrixmultiply's `kernel` / `packing` / `threading` split:
//!
//! | module | job |
//! |---|---|
//! | `isa` | the instruction set every kernel runs in, chosen once at run time, and what a kernel may use of it |
//! | `tensors` | reading flex's and ndarray's tensors in place, through their strides |
//! | `gemm` | the attention tiles' matrix kernel, per instruction set, tested against f64 |
//! | `math` | a vectorised `exp` and dot product |
//! | `attention` | attention in tiles, forward and backward |
//! | `rows` | the row kernels of the other layers: GELU, layer norm, cross-entropy, AdamW's step, the residual add, the sum of squares |
//! | `linear` | the linear layers' products, through the `gemm` crate |
//! | `blocks` | a parallel loop over a few large blocks whose caller waits by spinning |
//!
//! Two matrix engines, each where it is the faster one: the tiles' kernel for the small,
//! strided products of attention fused with its softmax, the `gemm` crate for the linear
//! layers' large ones (`linear` says why, with the measurement).

pub(crate) mod attention;
mod blocks;
mod gemm;
mod isa;
pub(crate) mod linear;
mod math;
pub(crate) mod rows;
mod tensors;
#[cfg(test)]
mod testing;

pub(crate) use tensors::{CpuTensors, Grid, dims_of};

use std::mem::MaybeUninit;

/// A buffer of `len` floats that `write` fills whole, not zeroed first: an output the
/// kernel writes every element of, where zeroing it would be one more pass over memory
/// only to be overwritten.
///
/// # Safety
/// `write` initialises every element of the slice it is given.
pub(crate) unsafe fn written(len: usize, write: impl FnOnce(&mut [MaybeUninit<f32>])) -> Vec<f32> {
    let mut out = Vec::with_capacity(len);
    write(&mut out.spare_capacity_mut()[..len]);
    // SAFETY: `write` initialised all `len` elements (the contract above); the capacity
    // is at least `len`.
    unsafe { out.set_len(len) };
    out
}

/// A pointer that tasks write through, each to elements no other task writes (the
/// attention tiles' outputs, the linear layers' blocks of rows).
#[derive(Clone, Copy)]
pub(crate) struct Out(*mut f32);

// SAFETY: the tasks write disjoint elements (see each use).
unsafe impl Send for Out {}
// SAFETY: as for `Send`.
unsafe impl Sync for Out {}

impl Out {
    pub(crate) fn new(ptr: *mut f32) -> Self {
        Self(ptr)
    }

    /// The element `offset` on, through a method so that closures capture the whole
    /// `Out`.
    pub(crate) fn at(&self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}
