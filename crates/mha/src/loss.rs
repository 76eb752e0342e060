//! [`cross_entropy`]: the loss of a classifier over its logits, PyTorch's
//! `F.cross_entropy(logits, targets, ignore_index=…)`, computed on flex and ndarray (f32)
//! as one operation that writes its gradient in the same pass over the logits (the loss
//! alone, without a gradient, where none is tracked; see `ops::loss`), elsewhere with
//! Burn's operations.

use burn::tensor::{Int, Tensor};

/// The mean cross-entropy of `logits` `[N, C]` against class indices `targets` `[N]`,
/// over the rows whose target is not `ignore_index`: `mean(logsumexp(logits[r]) -
/// logits[r, targets[r]])`, a `[1]` tensor in the logits' dtype, differentiable with
/// respect to the logits (f16 and bf16 logits reduced in f32, as PyTorch's).
///
/// `ignore_index` is any integer: PyTorch's default `-100` (what Hugging Face's labels
/// use) is `Some(-100)`; `None` ignores nothing. Unlike PyTorch's (and Burn's), a batch
/// whose every target is ignored gives a loss of 0 and a gradient of 0, not NaN. Not
/// offered: PyTorch's `weight`, `label_smoothing`, `reduction` other than the mean, class
/// probabilities as targets, and `[N, C, d1, ..]` logits (flatten them to `[N·d1·.., C]`).
///
/// # Panics
/// If `targets` has not `N` rows, or a target (other than `ignore_index`) is not a class
/// index below `C`; the message names the row and the values.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Int, Tensor};
/// use mha::loss::cross_entropy;
///
/// let device = Device::default();
/// let logits = Tensor::<2>::from_floats([[2.0, 0.0], [0.0, 0.0], [5.0, 1.0]], &device);
/// let targets = Tensor::<1, Int>::from_ints([0, 1, 9], &device);
/// let loss = cross_entropy(logits, targets, Some(9)); // the last row is left out
/// let want = ((1.0f32 + (-2.0f32).exp()).ln() + 2.0f32.ln()) / 2.0;
/// assert!((loss.into_scalar::<f32>() - want).abs() < 1e-6);
/// ```
pub fn cross_entropy(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    ignore_index: Option<i64>,
) -> Tensor<1> {
    let [n, classes] = logits.dims();
    let [rows] = targets.dims();
    assert!(
        rows == n,
        "cross_entropy: targets has {rows} rows, logits {n} (shape [{n}, {classes}])"
    );
    assert!(
        classes > 0 || n == 0,
        "cross_entropy: logits has rows but no class (shape [{n}, {classes}])"
    );
    let values: Vec<i64> = targets
        .to_data()
        .convert::<i64>()
        .try_into_vec::<i64>()
        .expect("integer targets");
    let ignored = |t: i64| ignore_index == Some(t);
    if let Some((row, &t)) = values
        .iter()
        .enumerate()
        .find(|&(_, &t)| !ignored(t) && !(0..classes as i64).contains(&t))
    {
        panic!(
            "cross_entropy: targets[{row}] = {t} is not a class index below {classes} (logits [{n}, {classes}]){}",
            ignore_index.map_or(String::new(), |i| format!(", nor ignore_index {i}"))
        );
    }
    crate::ops::loss::cross_entropy(logits, targets, &values, ignore_index)
}
