//! The sum of the squares of a tensor's elements in one parallel pass, for the global
//! norm of gradient clipping (`crate::optim::clip_grad_norm`).

use burn::backend::tensor::FloatTensor;

use crate::cpu::blocks::map_blocks;
use crate::cpu::{CpuTensors, dims_of};

use super::CHUNK;

/// `Σ x²` over every element of `x` (any shape of rank 4), as `[1, 1, 1, 1]`: each chunk
/// summed in f32 lanes, the chunks in f64, the total rounded to f32 once.
pub(crate) fn square_sum<B: CpuTensors>(x: &FloatTensor<B>) -> FloatTensor<B> {
    let x = B::readable(x);
    let dims = dims_of::<B>(&x);
    let floats = B::floats(&x);
    let values = floats.contiguous(dims);
    let sums = map_blocks(values.len().div_ceil(CHUNK), |c| {
        let chunk = &values[c * CHUNK..values.len().min((c + 1) * CHUNK)];
        f64::from(chunk_square_sum(chunk))
    });
    let total: f64 = sums.iter().sum();
    B::from_rows(vec![total as f32], [1, 1, 1, 1])
}

/// `Σ x²` of one chunk in 16 lanes (which the compiler keeps in vector registers), the
/// lanes added at the end.
fn chunk_square_sum(chunk: &[f32]) -> f32 {
    const LANES: usize = 16;
    let mut lanes = [0.0f32; LANES];
    let mut blocks = chunk.chunks_exact(LANES);
    for block in &mut blocks {
        for (lane, x) in lanes.iter_mut().zip(block) {
            *lane += x * x;
        }
    }
    let tail: f32 = blocks.remainder().iter().map(|x| x * x).sum();
    lanes.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::chunk_square_sum;

    #[test]
    fn a_chunk_sums_every_square_lanes_and_tail() {
        for n in [0, 1, 15, 16, 17, 100] {
            let chunk: Vec<f32> = (0..n).map(|i| i as f32 - 7.5).collect();
            let want: f64 = chunk.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
            let got = f64::from(chunk_square_sum(&chunk));
            assert!((got - want).abs() <= want * 1e-6, "{n}: {got} vs {want}");
        }
    }
}
