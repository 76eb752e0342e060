//! The row kernels of the layers other than attention: each pass reads a block of whole
//! rows once and works on it while it is in the cache, in the instruction set of
//! `cpu::isa`.

pub(crate) mod adamw;
pub(crate) mod add;
pub(crate) mod gelu;
pub(crate) mod loss;
pub(crate) mod norm;
pub(crate) mod squares;
pub(crate) mod swiglu;

use std::mem::MaybeUninit;

/// Elements per parallel task of the elementwise row kernels (GELU, SwiGLU).
pub(crate) const CHUNK: usize = 1 << 14;

/// The chunks of `out`'s first `len` elements (`out` allocated with at least that
/// capacity), or as many `None`s where there is no `out` (a result not wanted).
pub(crate) fn chunks(
    out: &mut Option<Vec<f32>>,
    len: usize,
) -> Vec<Option<&mut [MaybeUninit<f32>]>> {
    match out {
        Some(out) => out.spare_capacity_mut()[..len]
            .chunks_mut(CHUNK)
            .map(Some)
            .collect(),
        None => (0..len.div_ceil(CHUNK)).map(|_| None).collect(),
    }
}
