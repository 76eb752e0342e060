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

/// Elements per parallel task of the row kernels (whole rows of about this many, where a
/// kernel works row by row).
pub(crate) const CHUNK: usize = 1 << 14;

/// The chunks of the first `len` elements of `out`'s spare capacity (`out` an empty
/// vector of at least that capacity, which the caller fills through the chunks and then
/// sets to `len`), or as many `None`s where there is no `out` (a result not wanted).
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
