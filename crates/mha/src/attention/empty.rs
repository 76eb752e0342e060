//! Attention where there is nothing to compute: no key (`Tk = 0`: every row is a fully
//! blocked row, whose output is 0), or an output without elements (`B`, `H`, `Tq` or `Dv`
//! is 0): zeros of the output's shape through `crate::empty`, with a zero gradient into
//! the query, key, value, bias, position table and sinks.

use burn::tensor::Tensor;

use crate::empty::zero_of;

use super::AttentionWeights;
use crate::mask::AttentionMask;
use crate::positions::PositionBias;
use crate::problem::Scores;

/// The output `[B, H, Tq, Dv]` of attention over `query`, `key`, `value` under `mask`
/// when there is no key or no output element, and the weights `weights` asks for: `[B,
/// H, Tq, Tk]`, or averaged over the heads `[B, 1, Tq, Tk]` (zeros when there is no head
/// to average), after `dropout` as the other paths' weights.
pub(super) fn attention(
    [query, key, value]: [Tensor<4>; 3],
    mask: &AttentionMask,
    scores: Scores,
    weights: AttentionWeights,
    dropout: f64,
) -> (Tensor<4>, Option<Tensor<4>>) {
    let [batch, heads, queries, _] = query.dims();
    let [_, _, keys, d_v] = value.dims();
    let (device, dtype) = (query.device(), query.dtype());
    let shape = [batch, heads, queries, d_v];
    let full = [batch, heads, queries, keys];
    let weights = match weights {
        AttentionWeights::None => None,
        // Only the values are empty (Dv = 0): the weights exist.
        _ if !full.contains(&0) => {
            let per_head = super::explicit::weights(query.clone(), key.clone(), mask, scores);
            let per_head = match dropout > 0.0 {
                true => crate::dropout::apply(per_head, dropout),
                false => per_head,
            };
            Some(match weights {
                AttentionWeights::Averaged => per_head.mean_dim(1),
                _ => per_head,
            })
        }
        AttentionWeights::PerHead => Some(Tensor::zeros(full, (&device, dtype))),
        AttentionWeights::Averaged => {
            Some(Tensor::zeros([batch, 1, queries, keys], (&device, dtype)))
        }
    };
    let table = match mask.position() {
        Some(PositionBias::Learned { table, .. }) => Some(table.clone()),
        _ => None,
    };
    // Lazy: the links are made only under autodiff.
    let inputs = [query, key, value]
        .into_iter()
        .chain(mask.additive_bias().cloned())
        .map(zero_of)
        .chain(table.into_iter().map(zero_of))
        .chain(mask.sink_logits().cloned().map(zero_of));
    (crate::empty::zeros(shape, &device, dtype, inputs), weights)
}
