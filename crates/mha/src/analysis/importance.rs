//! Which heads matter: the loss increase when a head is masked (ablation), and the
//! gradient of the loss with respect to the head mask (Michel, Levy and Neubig, 2019,
//! "Are Sixteen Heads Really Better than One?").
//!
//! Both take the model through a closure that computes the loss of batch `i` under a
//! [`HeadMask`], so they work with any model that passes the mask to its attention
//! layers (see [`crate::inspect`]).

use burn::tensor::{Device, Tensor};
use serde::{Deserialize, Serialize};

use super::prune::PrunePlan;
use crate::inspect::HeadMask;

/// How [`HeadImportance`] scored the heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ImportanceMethod {
    /// The loss with the head masked minus the loss with every head kept.
    Ablation,
    /// `Σ_batches |∂loss/∂mask_h|`, divided by the L2 norm of its layer's scores.
    Gradient,
}

/// A score per attention layer and head: larger is more important.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HeadImportance {
    /// How the scores were computed.
    pub method: ImportanceMethod,
    /// `scores[layer][head]`.
    pub scores: Vec<Vec<f64>>,
    /// The loss with every head kept: the mean of the batches' losses.
    pub baseline_loss: f64,
}

impl HeadImportance {
    /// Each head's ablation score: the loss with that head masked (weight 0) minus the loss
    /// with every head kept, each the mean of the losses of `batches` batches (so a score
    /// does not grow with the number of batches; give batches of one size for the mean
    /// over examples). `counts` are the heads per attention layer
    /// ([`Heads::head_counts`](super::Heads::head_counts)); `loss(mask, i)` is the model's
    /// (mean) loss on batch `i` under `mask`. One forward per batch and head, plus one.
    ///
    /// # Panics
    /// If `batches` is 0.
    pub fn by_ablation(
        counts: &[usize],
        device: &Device,
        batches: usize,
        mut loss: impl FnMut(&HeadMask, usize) -> f64,
    ) -> Self {
        check_batches("HeadImportance::by_ablation", batches);
        let n = batches as f64;
        let mut total = |mask: &HeadMask| (0..batches).map(|i| loss(mask, i)).sum::<f64>() / n;
        let baseline = total(&HeadMask::keep_all(counts, device));
        let scores = counts
            .iter()
            .enumerate()
            .map(|(layer, &heads)| {
                (0..heads)
                    .map(|head| {
                        total(&HeadMask::dropping(counts, &[(layer, head)], device)) - baseline
                    })
                    .collect()
            })
            .collect();
        Self {
            method: ImportanceMethod::Ablation,
            scores,
            baseline_loss: baseline,
        }
    }

    /// Each head's gradient score (Michel et al.): the absolute gradient of the loss of
    /// each of `batches` batches with respect to the head's mask weight (all weights 1),
    /// summed over the batches, then divided by the L2 norm of its layer's scores as in
    /// the paper. `loss(mask, i)` is the model's scalar loss `[1]` on batch `i` under
    /// `mask`, computed on the autodiff device `device`. One forward and backward per
    /// batch.
    ///
    /// # Panics
    /// If `batches` is 0, `device` is not an autodiff device, or a loss is not one value.
    pub fn by_gradient(
        counts: &[usize],
        device: &Device,
        batches: usize,
        mut loss: impl FnMut(&HeadMask, usize) -> Tensor<1>,
    ) -> Self {
        check_batches("HeadImportance::by_gradient", batches);
        assert!(
            device.is_autodiff(),
            "HeadImportance::by_gradient: the loss must be computed on an autodiff device \
             (device.autodiff()), got {device:?}"
        );
        let mut scores: Vec<Vec<f64>> = counts.iter().map(|&h| vec![0.0; h]).collect();
        let mut baseline = 0.0;
        for i in 0..batches {
            let mask = HeadMask::keep_all(counts, device).with_gradient();
            let value = loss(&mask, i);
            assert!(
                value.dims() == [1],
                "HeadImportance::by_gradient: the loss of batch {i} must be one value [1] \
                 (a mean, say), got {:?}",
                value.dims()
            );
            baseline += value.clone().into_scalar::<f64>();
            let grads = value.backward();
            for (row, grad) in scores.iter_mut().zip(mask.grads(&grads)) {
                for (s, g) in row.iter_mut().zip(grad) {
                    *s += (g as f64).abs();
                }
            }
        }
        baseline /= batches as f64;
        for row in &mut scores {
            let norm = row.iter().map(|s| s * s).sum::<f64>().sqrt();
            if norm > 0.0 {
                row.iter_mut().for_each(|s| *s /= norm);
            }
        }
        Self {
            method: ImportanceMethod::Gradient,
            scores,
            baseline_loss: baseline,
        }
    }

    /// Every `(layer, head, score)`, most important first.
    pub fn ranking(&self) -> Vec<(usize, usize, f64)> {
        let mut all: Vec<(usize, usize, f64)> = self
            .scores
            .iter()
            .enumerate()
            .flat_map(|(l, row)| row.iter().enumerate().map(move |(h, &s)| (l, h, s)))
            .collect();
        all.sort_by(|a, b| b.2.total_cmp(&a.2).then((a.0, a.1).cmp(&(b.0, b.1))));
        all
    }

    /// A plan removing the `k` least important heads, keeping at least one head in every
    /// attention layer (a layer's last head is passed over for the next least important).
    pub fn prune_least(&self, k: usize) -> PrunePlan {
        let mut left: Vec<usize> = self.scores.iter().map(Vec::len).collect();
        let mut removed = Vec::new();
        for (layer, head, _) in self.ranking().into_iter().rev() {
            if removed.len() == k {
                break;
            }
            if left[layer] > 1 {
                left[layer] -= 1;
                removed.push((layer, head));
            }
        }
        PrunePlan::removing(self.scores.len(), &removed)
    }
}

/// Refuses a score of no batch (every head would score 0), naming `caller`.
fn check_batches(caller: &str, batches: usize) {
    assert!(batches >= 1, "{caller}: batches must be at least 1, got 0");
}
