//! Cross-entropy over the rows of f32 logits and its gradient, in one pass: each row's
//! log-sum-exp gives both its loss, `lse - logit[target]`, and its gradient,
//! `(softmax - onehot(target)) / count`, written while the row is in the cache, so the
//! backward pass only scales what the forward pass kept by the upstream gradient.

use burn::backend::tensor::FloatTensor;

use crate::cpu::blocks::{Chunks, map_blocks};
use crate::cpu::{CpuTensors, dims_of};

/// Rows per parallel task.
const ROWS: usize = 256;

/// A target index that is left out of the loss.
pub(crate) const IGNORED: i64 = -1;

/// The mean cross-entropy of the rows of `logits` (`[1, 1, rows, classes]`) against
/// `targets` (one class index per row, or [`IGNORED`]) over the rows not ignored (0 when
/// every row is), as a `[1, 1, 1, 1]` tensor, and its gradient with respect to the logits
/// (the logits' shape).
pub(crate) fn cross_entropy_forward<B: CpuTensors>(
    logits: &FloatTensor<B>,
    targets: &[i64],
) -> (FloatTensor<B>, FloatTensor<B>) {
    let logits = B::readable(logits);
    let dims = dims_of::<B>(&logits);
    let classes = dims[3];
    let values = B::floats(&logits).contiguous(dims);
    let scale = scale(targets);
    let mut grad = vec![0.0f32; values.len()];
    let per = ROWS * classes.max(1);
    let grads = Chunks::new(&mut grad, per);
    let losses: Vec<f64> = map_blocks(grads.count(), |c| {
        // SAFETY: each block takes its own chunk, once.
        let grad = unsafe { grads.take(c) };
        let logits = &values[c * per..][..grad.len()];
        let targets = &targets[c * ROWS..targets.len().min((c + 1) * ROWS)];
        rows(classes, logits, targets, scale, grad)
    });
    let loss = losses.iter().sum::<f64>() as f32 * scale;
    (
        B::from_rows(vec![loss], [1, 1, 1, 1]),
        B::from_rows(grad, dims),
    )
}

/// [`cross_entropy_forward`]'s loss alone, where no gradient is wanted (a validation
/// loss): no gradient of the logits' size written.
pub(crate) fn cross_entropy_loss<B: CpuTensors>(
    logits: &FloatTensor<B>,
    targets: &[i64],
) -> FloatTensor<B> {
    let logits = B::readable(logits);
    let dims = dims_of::<B>(&logits);
    let classes = dims[3].max(1);
    let values = B::floats(&logits).contiguous(dims);
    let scale = scale(targets);
    let blocks = values.len().div_ceil(ROWS * classes);
    let losses: Vec<f64> = map_blocks(blocks, |c| {
        let logits = &values[c * ROWS * classes..values.len().min((c + 1) * ROWS * classes)];
        let targets = &targets[c * ROWS..targets.len().min((c + 1) * ROWS)];
        logits
            .chunks_exact(classes)
            .zip(targets)
            .map(|(row, &target)| row_lse_loss(row, target))
            .sum()
    });
    let loss = losses.iter().sum::<f64>() as f32 * scale;
    B::from_rows(vec![loss], [1, 1, 1, 1])
}

/// One over the rows counted (those not [`IGNORED`]), 1 when none is.
fn scale(targets: &[i64]) -> f32 {
    let counted = targets.iter().filter(|&&t| t != IGNORED).count();
    1.0 / counted.max(1) as f32
}

/// The summed loss of a block of rows; writes their gradients.
fn rows(classes: usize, logits: &[f32], targets: &[i64], scale: f32, grad: &mut [f32]) -> f64 {
    logits
        .chunks_exact(classes)
        .zip(targets)
        .zip(grad.chunks_exact_mut(classes))
        .map(|((row, &target), grad)| row_loss(row, target, scale, grad))
        .sum()
}

/// The loss of one row (0 for an [`IGNORED`] target) without its gradient: as
/// [`row_loss`] computes it.
fn row_lse_loss(row: &[f32], target: i64) -> f64 {
    if target == IGNORED {
        return 0.0;
    }
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let total: f32 = row.iter().map(|&l| (l - max).exp()).sum();
    (total.ln() - (row[target as usize] - max)) as f64
}

/// The loss of one row (0 for an [`IGNORED`] target), its gradient written to `grad`
/// (left as it is for an ignored row).
fn row_loss(row: &[f32], target: i64, scale: f32, grad: &mut [f32]) -> f64 {
    if target == IGNORED {
        return 0.0;
    }
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut total = 0.0f32;
    for (g, &l) in grad.iter_mut().zip(row) {
        *g = (l - max).exp();
        total += *g;
    }
    let target = target as usize;
    let weight = scale / total;
    for g in grad.iter_mut() {
        *g *= weight;
    }
    grad[target] -= scale;
    // `ln Σ - (x_t - max)`: the maximum added back to a sum in f32 would round the loss
    // to f32's spacing at the logits' size (0 for logits near 10^4).
    (total.ln() - (row[target] - max)) as f64
}

/// `grad` (the logits' gradient kept by the forward pass) times the upstream gradient of
/// the loss, `upstream` (`[1, 1, 1, 1]`).
pub(crate) fn cross_entropy_backward<B: CpuTensors>(
    grad: &FloatTensor<B>,
    upstream: &FloatTensor<B>,
) -> FloatTensor<B> {
    let upstream = B::readable(upstream);
    let g = B::floats(&upstream).contiguous([1, 1, 1, 1])[0];
    let grad = B::readable(grad);
    let dims = dims_of::<B>(&grad);
    let values = B::floats(&grad).contiguous(dims);
    B::from_rows(values.iter().map(|v| v * g).collect(), dims)
}

#[cfg(test)]
mod tests {
    use super::{IGNORED, rows};

    #[test]
    fn a_row_gives_its_loss_and_gradient_and_an_ignored_row_nothing() {
        let logits = [
            1.0f32, 2.0, -1.0, 0.5, 9.0, 9.0, 9.0, 9.0, -3.0, 0.0, 3.0, 100.0,
        ];
        let targets = [1, IGNORED, 3];
        let mut grad = [0.0f32; 12];
        let sum = rows(4, &logits, &targets, 0.5, &mut grad);
        let mut want_sum = 0.0f64;
        for (r, &t) in targets.iter().enumerate() {
            if t == IGNORED {
                assert_eq!(grad[4 * r..4 * r + 4], [0.0; 4]);
                continue;
            }
            let row: Vec<f64> = logits[4 * r..4 * r + 4].iter().map(|&v| v as f64).collect();
            let lse = row.iter().map(|v| v.exp()).sum::<f64>().ln();
            want_sum += lse - row[t as usize];
            for (c, &v) in row.iter().enumerate() {
                let want = 0.5 * ((v - lse).exp() - f64::from(u8::from(c == t as usize)));
                assert!(
                    (grad[4 * r + c] as f64 - want).abs() < 1e-7,
                    "row {r} class {c}"
                );
            }
        }
        assert!((sum - want_sum).abs() < 1e-5, "{sum} vs {want_sum}");
    }
}
