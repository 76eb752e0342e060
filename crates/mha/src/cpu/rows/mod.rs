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
