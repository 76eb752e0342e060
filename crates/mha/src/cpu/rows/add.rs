//! The sum of two tensors of one shape, in parallel: a block's residual connections, which
//! Burn's `add` computes on one thread below four million elements.

use std::mem::MaybeUninit;

use crate::cpu::blocks::{Chunks, for_each_block};
use crate::cpu::{CpuTensors, dims_of, written};

use super::CHUNK;
use burn::backend::tensor::FloatTensor;

/// `a + b` for two rank-4 f32 tensors of one shape (each read through its strides).
pub(crate) fn add<B: CpuTensors>(a: &FloatTensor<B>, b: &FloatTensor<B>) -> FloatTensor<B> {
    let (a, b) = (B::readable(a), B::readable(b));
    let dims = dims_of::<B>(&a);
    let (x, y) = (
        B::floats(&a).contiguous(dims),
        B::floats(&b).contiguous(dims),
    );
    let fill = |out: &mut [MaybeUninit<f32>]| {
        let outs = Chunks::new(out, CHUNK);
        for_each_block(outs.count(), |c| {
            // SAFETY: each block takes its own chunk, once.
            let out = unsafe { outs.take(c) };
            let (x, y) = (&x[c * CHUNK..][..out.len()], &y[c * CHUNK..][..out.len()]);
            for ((o, &x), &y) in out.iter_mut().zip(x).zip(y) {
                o.write(x + y);
            }
        })
    };
    // SAFETY: the chunks cover `out`, and each element is written.
    B::from_rows(unsafe { written(x.len(), fill) }, dims)
}
