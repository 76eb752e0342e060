//! Burn's own attention module ([`burn::nn::attention::MultiHeadAttention`]) as this
//! crate's: its weights, its dropout, its biases and its `quiet_softmax`, so that a model
//! trained with Burn's module moves here without training again.
//!
//! Burn's `query`, `key` and `value` linears (`[d_model, d_model]` each, Burn's `[in, out]`
//! layout, as this crate's) become the columns of one packed projection, in that order;
//! `output` is the output projection. A projection Burn built without a bias gets zeros in
//! the packed bias: the same numbers (trained further, they may move). `quiet_softmax`
//! (`exp(s) / (1 + Σ exp)`) is a sink logit of 0 in every head, kept fixed (not trained).
//! The packed projection is a parameter of its own (a leaf, as after a load), trained
//! whether Burn's were or not.
//! Burn fills blocked scores with `min_float` (-1e4 by default): a row whose keys are all
//! blocked is uniform over them there with the ordinary softmax (0 with its quiet one),
//! and 0 here; every other row is the same.

use burn::module::Param;
use burn::nn::Linear;
use burn::nn::attention::MultiHeadAttention as BurnAttention;
use burn::tensor::Tensor;

use crate::mha::{InputProjection, MultiHeadAttention, MultiHeadAttentionConfig};

/// Burn's attention module with its weights and settings (see the module docs: the packed
/// projection, the biases, `quiet_softmax` as fixed sinks of 0).
impl From<BurnAttention> for MultiHeadAttention {
    fn from(burn: BurnAttention) -> Self {
        let weight = burn.query.weight.val();
        let (device, dtype) = (weight.device(), weight.dtype());
        let [d_model, n_heads] = [burn.d_model, burn.n_heads];
        let linears = [&burn.query, &burn.key, &burn.value];
        let any_bias = linears.iter().any(|l| l.bias.is_some());
        let mut module = MultiHeadAttentionConfig::new(d_model, n_heads)
            .with_dropout(burn.dropout.prob)
            .with_bias(any_bias)
            .with_out_bias(Some(burn.output.bias.is_some()))
            .with_sinks(burn.quiet_softmax)
            .init(&device);
        let weights = linears.iter().map(|l| l.weight.val()).collect();
        let bias = any_bias.then(|| {
            let biases = linears.iter().map(|l| match &l.bias {
                Some(bias) => bias.val(),
                None => Tensor::zeros([d_model], (&device, dtype)),
            });
            Param::from_tensor(Tensor::cat(biases.collect(), 0).detach())
        });
        module.in_proj = InputProjection::Packed(Linear {
            weight: Param::from_tensor(Tensor::cat(weights, 1).detach()),
            bias,
        });
        module.out_proj = burn.output;
        // Fixed logits of 0: Burn's quiet softmax is not learned.
        module.sinks = module.sinks.map(|_| {
            let zeros = Tensor::zeros([n_heads], (&device, dtype));
            Param::from_tensor(zeros).set_require_grad(false)
        });
        module
    }
}
