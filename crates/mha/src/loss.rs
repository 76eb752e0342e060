//! [`cross_entropy`]: the loss of a classifier over its logits, PyTorch's
//! `F.cross_entropy(logits, targets, ignore_index=…)`, computed on flex and ndarray (f32)
//! as one operation that writes its gradient in the same pass over the logits (the loss
//! alone, without a gradient, where none is tracked; see `ops::loss`), elsewhere with
//! Burn's operations. [`cross_entropy_with`] takes PyTorch's other arguments too: class
//! weights, label smoothing and the reduction.

use burn::tensor::activation::log_softmax;
use burn::tensor::{Bool, DType, FloatDType, Int, Tensor, TensorData};

/// The mean cross-entropy of `logits` `[N, C]` against class indices `targets` `[N]`,
/// over the rows whose target is not `ignore_index`: `mean(logsumexp(logits[r]) -
/// logits[r, targets[r]])`, a `[1]` tensor in the logits' dtype, differentiable with
/// respect to the logits (f16 and bf16 logits reduced in f32, as PyTorch's).
///
/// `ignore_index` is any integer: PyTorch's default `-100` (what Hugging Face's labels
/// use) is `Some(-100)`; `None` ignores nothing. Unlike PyTorch's (and Burn's), a batch
/// whose every target is ignored gives a loss of 0 and a gradient of 0, not NaN.
/// PyTorch's `weight`, `label_smoothing` and `reduction`: [`cross_entropy_with`]. Not
/// offered: class probabilities as targets, and `[N, C, d1, ..]` logits (flatten them to
/// `[N·d1·.., C]`).
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
    let values = checked_targets("cross_entropy", &logits, &targets, ignore_index);
    crate::ops::loss::cross_entropy(logits, targets, &values, ignore_index)
}

/// The targets' values, once there is one per row of `logits` `[N, C]` and each is a
/// class index below `C` or `ignore_index`.
///
/// # Panics
/// Naming `function` and the shapes, or the row and the values.
fn checked_targets(
    function: &str,
    logits: &Tensor<2>,
    targets: &Tensor<1, Int>,
    ignore_index: Option<i64>,
) -> Vec<i64> {
    let [n, classes] = logits.dims();
    let [rows] = targets.dims();
    assert!(
        rows == n,
        "{function}: targets has {rows} rows, logits {n} (shape [{n}, {classes}])"
    );
    assert!(
        classes > 0 || n == 0,
        "{function}: logits has rows but no class (shape [{n}, {classes}])"
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
            "{function}: targets[{row}] = {t} is not a class index below {classes} (logits [{n}, {classes}]){}",
            ignore_index.map_or(String::new(), |i| format!(", nor ignore_index {i}"))
        );
    }
    values
}

/// How [`cross_entropy_with`] reduces the rows' losses: PyTorch's `reduction`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Reduction {
    /// Their sum divided by the sum of the kept rows' class weights (by the number of kept
    /// rows without weights): a `[1]` tensor. PyTorch's default.
    #[default]
    Mean,
    /// Their sum: a `[1]` tensor.
    Sum,
    /// Each row's loss, 0 for an ignored row: a `[N]` tensor.
    None,
}

/// PyTorch's `F.cross_entropy` arguments beyond the logits and the targets, for
/// [`cross_entropy_with`]: by default its defaults, but for `ignore_index` (PyTorch's
/// -100 is `Some(-100)`).
#[derive(Clone, Debug, Default)]
pub struct CrossEntropyOptions {
    /// The target that marks a row to leave out; `None`: every row counts.
    pub ignore_index: Option<i64>,
    /// A weight per class `[C]`, scaling the loss of each row by its target's weight (and
    /// each class's share of the smoothed part by its own); `None`: 1 for every class.
    pub weight: Option<Tensor<1>>,
    /// Label smoothing `ε` in `[0, 1]`: the target becomes `1 - ε` on the class and
    /// `ε / C` spread over every class.
    pub label_smoothing: f64,
    /// How the rows' losses are reduced.
    pub reduction: Reduction,
}

impl CrossEntropyOptions {
    /// With `ignore_index`.
    pub fn with_ignore_index(mut self, ignore_index: Option<i64>) -> Self {
        self.ignore_index = ignore_index;
        self
    }

    /// With class weights `[C]`.
    pub fn with_weight(mut self, weight: Tensor<1>) -> Self {
        self.weight = Some(weight);
        self
    }

    /// With label smoothing `ε`.
    pub fn with_label_smoothing(mut self, label_smoothing: f64) -> Self {
        self.label_smoothing = label_smoothing;
        self
    }

    /// With `reduction`.
    pub fn with_reduction(mut self, reduction: Reduction) -> Self {
        self.reduction = reduction;
        self
    }
}

/// PyTorch's `F.cross_entropy(logits, targets, weight, ignore_index, reduction,
/// label_smoothing)` for logits `[N, C]` and class indices `targets` `[N]`: row `r`'s
/// loss is `(1 - ε) · w[t_r] · nll_r + (ε / C) · Σ_c w[c] · (-log p_rc)` with
/// `nll_r = -log p_r,t_r` (0 for a row whose target is `ignore_index`), reduced as
/// `options.reduction` says. Differentiable with respect to the logits (the class weights
/// are constants); in the logits' dtype, computed in f32 for f16 and bf16 logits. With the default options it is
/// [`cross_entropy`] (its fused operation on the CPU backends).
///
/// As [`cross_entropy`], and unlike PyTorch's (NaN), a mean over no weight (every target
/// ignored, or weights of 0 on every kept row's class) is 0, with a gradient of 0.
///
/// # Panics
/// As [`cross_entropy`]; if `weight` is not `[C]`, is not finite or is negative, or if
/// `label_smoothing` is not in `[0, 1]`; the message names the argument and the values.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Int, Tensor};
/// use mha::loss::{CrossEntropyOptions, Reduction, cross_entropy_with};
///
/// let device = Device::default();
/// let logits = Tensor::<2>::from_floats([[2.0, 0.0], [0.0, 0.0]], &device);
/// let targets = Tensor::<1, Int>::from_ints([0, 1], &device);
/// let options = CrossEntropyOptions::default()
///     .with_label_smoothing(0.2)
///     .with_reduction(Reduction::None);
/// let rows = cross_entropy_with(logits, targets, &options).into_data();
/// // Row 0: 0.9 of its weight on class 0 and 0.1 on class 1.
/// let lse = (1.0f32 + (-2.0f32).exp()).ln();
/// let want = 0.9 * lse + 0.1 * (2.0 + lse);
/// assert!((rows.try_to_vec::<f32>().unwrap()[0] - want).abs() < 1e-5);
/// ```
pub fn cross_entropy_with(
    logits: Tensor<2>,
    targets: Tensor<1, Int>,
    options: &CrossEntropyOptions,
) -> Tensor<1> {
    let CrossEntropyOptions {
        ignore_index,
        weight,
        label_smoothing,
        reduction,
    } = options;
    let (ignore_index, smoothing) = (*ignore_index, *label_smoothing);
    assert!(
        (0.0..=1.0).contains(&smoothing),
        "cross_entropy_with: label_smoothing must be in [0, 1], got {smoothing}"
    );
    if weight.is_none() && smoothing == 0.0 && *reduction == Reduction::Mean {
        return cross_entropy(logits, targets, ignore_index);
    }
    let values = checked_targets("cross_entropy_with", &logits, &targets, ignore_index);
    let [n, classes] = logits.dims();
    let device = logits.device();
    let dtype = logits.dtype();
    // f16 and bf16 computed in f32 (as PyTorch's autocast does), f32 and f64 in their own.
    let work = match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        other => other,
    };
    let weight = weight.as_ref().map(|w| {
        let dims = w.dims();
        assert!(
            dims == [classes],
            "cross_entropy_with: weight has shape {dims:?}, not [C] = [{classes}] (logits [{n}, {classes}])"
        );
        let values: Vec<f64> = w.to_data().convert::<f64>().try_to_vec().expect("float weights");
        if let Some((c, w)) = values.iter().enumerate().find(|(_, w)| !(w.is_finite() && **w >= 0.0)) {
            panic!("cross_entropy_with: weight[{c}] = {w}: class weights must be finite and not negative");
        }
        Tensor::<1>::from_data(TensorData::new(values, [classes]), (&device, work))
    });
    let back = |loss: Tensor<1>| match loss.dtype() == dtype {
        true => loss,
        false => loss.cast(FloatDType::from(dtype)),
    };
    if n == 0 {
        // Nothing to reduce (Burn's reductions over no row): 0, or no row.
        let zero = logits.sum().cast(FloatDType::from(work)) * 0.0;
        return back(match reduction {
            Reduction::None => Tensor::empty([0], (&device, work)),
            _ => zero,
        });
    }
    // Ignored rows read class 0, and their losses are replaced by 0 (not multiplied by
    // it: a logit of -inf there would give NaN).
    let ignored: Vec<bool> = values.iter().map(|&t| ignore_index == Some(t)).collect();
    let classes_of: Vec<i64> = values
        .iter()
        .zip(&ignored)
        .map(|(&t, &ignored)| if ignored { 0 } else { t })
        .collect();
    let ignored = Tensor::<1, Bool>::from_data(TensorData::new(ignored, [n]), &device);
    let picked = Tensor::<1, Int>::from_data(TensorData::new(classes_of, [n]), &device);
    let logits = match dtype == work {
        true => logits,
        false => logits.cast(FloatDType::from(work)),
    };
    let log_p = log_softmax(logits, 1); // [N, C]
    let nll = -log_p
        .clone()
        .gather(1, picked.clone().reshape([n, 1]))
        .reshape([n]);
    let nll = nll.mask_fill(ignored.clone(), 0.0);
    // Each kept row's target weight (1 without weights), 0 for an ignored row.
    let row_weight = match &weight {
        Some(w) => w.clone().select(0, picked),
        None => Tensor::ones([n], (&device, work)),
    }
    .mask_fill(ignored.clone(), 0.0);
    let mut loss = nll * row_weight.clone();
    if smoothing > 0.0 {
        let spread = match &weight {
            Some(w) => log_p * w.clone().reshape([1, classes]),
            None => log_p,
        };
        let smooth = -spread.sum_dim(1).reshape([n]);
        let smooth = smooth.mask_fill(ignored, 0.0);
        loss = loss * (1.0 - smoothing) + smooth * (smoothing / classes as f64);
    }
    back(match reduction {
        Reduction::None => loss,
        Reduction::Sum => loss.sum(),
        Reduction::Mean => {
            // Over the kept rows' weights; over none, 0 (not 0 / 0).
            let total = row_weight.sum();
            let none = total
                .clone()
                .equal_elem(0.0)
                .float()
                .cast(FloatDType::from(work));
            loss.sum() * (-none.clone() + 1.0) / (total + none)
        }
    })
}
