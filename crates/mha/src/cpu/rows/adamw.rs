//! AdamW's step over one parameter in one pass: each element's moments, bias corrections,
//! decay and update computed where the element is read, in parallel, where Burn's AdamW
//! makes about fifteen elementwise passes, each a tensor of its own, on one thread.

use std::mem::MaybeUninit;

use crate::cpu::blocks::{Chunks, for_each_block};
use crate::cpu::{CpuTensors, dims_of, written};

use super::CHUNK;
use burn::backend::tensor::FloatTensor;

/// The numbers of one step, each in f32 as Burn's AdamW rounds it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct AdamWStep {
    /// The learning rate.
    pub(crate) lr: f32,
    pub(crate) beta_1: f32,
    pub(crate) beta_2: f32,
    pub(crate) epsilon: f32,
    /// `1 - lr · weight decay`, which the parameter is multiplied by before the update;
    /// `None` without decay.
    pub(crate) keep: Option<f32>,
    /// `1 - beta_1^t` and `1 - beta_2^t` at step `t` (from 1): the bias corrections.
    pub(crate) corrections: [f32; 2],
}

/// The step of one parameter: `inputs` are the parameter and its gradient, then, after the
/// first step, the two moments, each `[1, 1, 1, n]`; the output is `[1, 1, 3, n]`: the
/// parameter, the first moment and the second moment after the step.
pub(crate) fn adamw_step<B: CpuTensors>(
    inputs: &[FloatTensor<B>],
    step: AdamWStep,
) -> FloatTensor<B> {
    let readable: Vec<_> = inputs.iter().map(B::readable).collect();
    let dims = dims_of::<B>(&readable[0]);
    let n = dims.iter().product::<usize>();
    let floats: Vec<_> = readable
        .iter()
        .map(|x| B::floats(x).contiguous(dims))
        .collect();
    let (param, grad) = (&floats[0][..], &floats[1][..]);
    let moments = match &floats[2..] {
        [m, v] => Some((&m[..], &v[..])),
        [] => None,
        more => panic!("AdamW's step takes 2 or 4 tensors, got {}", 2 + more.len()),
    };
    let fill = |out: &mut [MaybeUninit<f32>]| {
        let (p_out, rest) = out.split_at_mut(n);
        let (m_out, v_out) = rest.split_at_mut(n);
        let [p_out, m_out, v_out] = [p_out, m_out, v_out].map(|out| Chunks::new(out, CHUNK));
        for_each_block(p_out.count(), |chunk| {
            // SAFETY: each block takes its own chunks, once.
            let outs = unsafe { [p_out.take(chunk), m_out.take(chunk), v_out.take(chunk)] };
            let range = chunk * CHUNK..(chunk * CHUNK + outs[0].len());
            let moments = moments.map(|(m, v)| (&m[range.clone()], &v[range.clone()]));
            run(step, [&param[range.clone()], &grad[range]], moments, outs);
        });
    };
    // SAFETY: the chunks of the three thirds cover `out`, and `run` writes each element.
    B::from_rows(unsafe { written(3 * n, fill) }, [1, 1, 3, n])
}

/// One chunk of the step: every element of the three outputs written. The operations and
/// their order are Burn's AdamW's, so that the results are its own to the last bit.
fn run(
    step: AdamWStep,
    [param, grad]: [&[f32]; 2],
    moments: Option<(&[f32], &[f32])>,
    [p_out, m_out, v_out]: [&mut [MaybeUninit<f32>]; 3],
) {
    let AdamWStep {
        lr,
        beta_1,
        beta_2,
        epsilon,
        keep,
        corrections: [c1, c2],
    } = step;
    let (f1, f2) = (1.0 - beta_1, 1.0 - beta_2);
    let outs = p_out.iter_mut().zip(m_out.iter_mut().zip(v_out.iter_mut()));
    for (i, (p_out, (m_out, v_out))) in outs.enumerate() {
        let g = grad[i];
        let (m, v) = match moments {
            Some((m, v)) => (m[i] * beta_1 + g * f1, v[i] * beta_2 + g * g * f2),
            None => (g * f1, g * g * f2),
        };
        let delta = (m / c1) / ((v / c2).sqrt() + epsilon);
        let p = match keep {
            Some(keep) => param[i] * keep,
            None => param[i],
        };
        p_out.write(p - delta * lr);
        m_out.write(m);
        v_out.write(v);
    }
}
