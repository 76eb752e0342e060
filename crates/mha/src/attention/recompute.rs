//! Attention on the CPU backends (flex, ndarray) as one operation of the backend (a Burn
//! backend extension) whose backward pass, under autodiff, recomputes the weights instead
//! of keeping them. Both passes are the tiles of [`crate::cpu`].
//!
//! Differentiated op by op, attention keeps its `[B, H, Tq, Tk]` weights until the
//! backward pass and walks them a dozen times (mask fill, the softmax's five passes, and
//! their backward steps). Here the forward pass keeps only the output `O` and the
//! log-sum-exp of every query row (`[B, H, Tq, 1]`), and the backward pass rebuilds the
//! weights from them, the way FlashAttention does:
//!
//! ```text
//! P  = exp(S - lse)            S = cap((Q·scale) Kᵀ) + bias + position bias, masked
//! dV = Pᵀ dO                   D = rowsum(dO ⊙ O)
//! dS = P ⊙ (dO Vᵀ - D)
//! dQ = dS' K · scale           dK = dS'ᵀ (Q·scale)      dS' = dS ⊙ cap'
//! dbias = dS, summed over the axes the bias broadcasts along
//! dtable[h, c] = dS summed over the scores whose distance falls in bucket c
//! ```

// Burn 0.22 deprecates ndarray; it is still one of our backends.
#![allow(deprecated)]

#[cfg(feature = "flex")]
use burn::backend::Flex;
#[cfg(feature = "ndarray")]
use burn::backend::NdArray;
use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, NodeGuard, Ops, OpsKind},
};
use burn::backend::{
    Backend, Dispatch, ExtensionType, TensorMetadata, backend_extension,
    tensor::{BoolTensor, FloatTensor},
};
use burn::tensor::Tensor;

use super::Scores;
use crate::cpu::{
    CpuTensors, Dims, Positional as TilePositional, Scoring, tiled_backward, tiled_forward,
};
use crate::mask::{AttentionMask, Rule};
use crate::positions::{Buckets, PositionBias};

/// The boolean part of a mask (`true = blocked`), broadcastable to `[B, H, Tq, Tk]`.
#[derive(ExtensionType)]
pub(crate) enum Blocked<B: Backend> {
    /// Nothing blocked beyond what blocks by position.
    Nothing,
    /// Rank 4, each axis full or 1.
    Mask(BoolTensor<B>),
}

/// The additive part of a mask, broadcastable to `[B, H, Tq, Tk]`; it may want a gradient.
#[derive(ExtensionType)]
pub(crate) enum Bias<B: Backend> {
    /// No bias.
    Nothing,
    /// Rank 4, each axis full or 1; values at or below the blocked sentinel block.
    Add(FloatTensor<B>),
}

/// The bias by position of a mask; a learned table may want a gradient.
#[derive(ExtensionType)]
pub(crate) enum Positional<B: Backend> {
    /// None.
    Nothing,
    /// ALiBi's slope of each query head.
    Alibi(Vec<f32>),
    /// A learned `[H, buckets]` table and how distances map to its columns.
    Learned(FloatTensor<B>, Buckets),
}

/// Attention as one operation of the backend, differentiable on `Autodiff<Flex | NdArray>`.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    Autodiff
)]
pub(crate) trait RecomputeAttention: Backend {
    /// `softmax(cap(Q Kᵀ · scale) + bias + position bias, masked) V`, with the scale and
    /// the soft cap of `scores` (`cap(s) = softcap · tanh(s / softcap)`), and `rule`
    /// masking by position.
    ///
    /// # Shapes
    /// - `query`: `[B, H, Tq, Dk]`, `key`: `[B, Hkv, Tk, Dk]`, `value`: `[B, Hkv, Tk, Dv]`,
    ///   `Hkv` a divisor of `H`
    /// - `blocked`, `bias`: broadcastable to `[B, H, Tq, Tk]`
    /// - result: `[B, H, Tq, Dv]`
    #[allow(clippy::too_many_arguments)]
    fn recompute_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        #[extension_type] blocked: Blocked<Self>,
        #[extension_type] bias: Bias<Self>,
        #[extension_type] position: Positional<Self>,
        rule: Rule,
        scores: Scores,
    ) -> FloatTensor<Self>;
}

/// The forward pass alone, for the backends under autodiff.
macro_rules! forward_only {
    ($backend:ty) => {
        impl RecomputeAttention for $backend {
            #[allow(clippy::too_many_arguments)]
            fn recompute_attention(
                query: FloatTensor<Self>,
                key: FloatTensor<Self>,
                value: FloatTensor<Self>,
                blocked: Blocked<Self>,
                bias: Bias<Self>,
                position: Positional<Self>,
                rule: Rule,
                scores: Scores,
            ) -> FloatTensor<Self> {
                let bias = match bias {
                    Bias::Nothing => None,
                    Bias::Add(bias) => Some(bias),
                };
                let inputs = [&query, &key, &value];
                let problem = Problem::<Self>::new(inputs, (blocked, bias, position), rule, scores);
                problem.forward(inputs).0
            }
        }
    };
}

#[cfg(feature = "flex")]
forward_only!(Flex);
#[cfg(feature = "ndarray")]
forward_only!(NdArray);

impl<B: RecomputeAttention + CpuTensors, C: CheckpointStrategy> RecomputeAttention
    for Autodiff<B, C>
{
    #[allow(clippy::too_many_arguments)]
    fn recompute_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        blocked: Blocked<Self>,
        bias: Bias<Self>,
        position: Positional<Self>,
        rule: Rule,
        scores: Scores,
    ) -> FloatTensor<Self> {
        // `Blocked<Autodiff<B>>` to `Blocked<B>`: boolean tensors are the inner backend's.
        let blocked = match blocked {
            Blocked::Nothing => Blocked::Nothing,
            Blocked::Mask(mask) => Blocked::Mask(mask),
        };
        // The nodes before the primitives, as `Backward::prepare` asks: the query, key and
        // value, then the bias and the table when there are.
        let mut nodes = vec![query.node(), key.node(), value.node()];
        let bias = match bias {
            Bias::Nothing => None,
            Bias::Add(bias) => {
                nodes.push(bias.node());
                Some(bias.into_primitive())
            }
        };
        let position = match position {
            Positional::Nothing => Positional::Nothing,
            Positional::Alibi(slopes) => Positional::Alibi(slopes),
            Positional::Learned(table, buckets) => {
                nodes.push(table.node());
                Positional::Learned(table.into_primitive(), buckets)
            }
        };
        let inputs = [
            query.into_primitive(),
            key.into_primitive(),
            value.into_primitive(),
        ];
        let [query, key, value] = &inputs;
        let problem = Problem::new([query, key, value], (blocked, bias, position), rule, scores);
        match nodes.len() {
            3 => tracked::<B, C, 3>(nodes, problem, inputs),
            4 => tracked::<B, C, 4>(nodes, problem, inputs),
            _ => tracked::<B, C, 5>(nodes, problem, inputs),
        }
    }
}

/// Runs the forward pass and registers [`AttentionBackward`] over `nodes` (`N` of them):
/// the query, key and value, then the bias and the table when there are.
fn tracked<B: CpuTensors, C: CheckpointStrategy, const N: usize>(
    nodes: Vec<NodeGuard>,
    problem: Problem<B>,
    [query, key, value]: [FloatTensor<B>; 3],
) -> FloatTensor<Autodiff<B, C>> {
    let nodes: [NodeGuard; N] = nodes.try_into().unwrap_or_else(|_| unreachable!("N nodes"));
    match AttentionBackward
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (output, lse) = problem.forward([&query, &key, &value]);
            let state = State {
                problem,
                query,
                key,
                value,
                output: output.clone(),
                lse,
            };
            prep.finish(state, output)
        }
        OpsKind::UnTracked(prep) => prep.finish(problem.forward([&query, &key, &value]).0),
    }
}

/// The backward step of [`RecomputeAttention`] on `Autodiff<B>`.
#[derive(Debug)]
struct AttentionBackward;

/// What the backward pass keeps: the inputs, the output and the row log-sum-exp.
#[derive(Debug, Clone)]
struct State<B: CpuTensors> {
    problem: Problem<B>,
    query: FloatTensor<B>,
    key: FloatTensor<B>,
    value: FloatTensor<B>,
    output: FloatTensor<B>,
    lse: FloatTensor<B>,
}

impl<B: CpuTensors, const N: usize> Backward<B, N> for AttentionBackward {
    type State = State<B>;

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let state = ops.state;
        let problem = &state.problem;
        // The parents after the query, key and value: the bias, then the table.
        let has_bias = problem.bias.is_some();
        let wanted = |index: usize| ops.parents.get(index).is_some_and(Option::is_some);
        let bias_grad = has_bias && wanted(3);
        let table_grad = problem.table.is_some() && wanted(3 + usize::from(has_bias));
        let grads_out = tiled_backward::<B>(
            problem.dims,
            &problem.scoring,
            [&state.query, &state.key, &state.value],
            [&state.output, &state.lse, &grad],
            problem.blocked.as_ref(),
            [problem.bias.as_ref(), problem.table.as_ref()],
            [bias_grad, table_grad],
        );
        let mut in_order = vec![Some(grads_out.dq), Some(grads_out.dk), Some(grads_out.dv)];
        if has_bias {
            in_order.push(grads_out.bias);
        }
        if problem.table.is_some() {
            in_order.push(grads_out.table);
        }
        for (parent, grad) in ops.parents.into_iter().zip(in_order) {
            if let (Some(node), Some(grad)) = (parent, grad) {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// The sizes, scoring and mask of one attention call.
#[derive(Debug, Clone)]
struct Problem<B: CpuTensors> {
    dims: Dims,
    scoring: Scoring,
    blocked: Option<BoolTensor<B>>,
    bias: Option<FloatTensor<B>>,
    /// A learned position table `[H, buckets]`.
    table: Option<FloatTensor<B>>,
}

impl<B: CpuTensors> Problem<B> {
    fn new(
        [query, key, value]: [&FloatTensor<B>; 3],
        (blocked, bias, position): (Blocked<B>, Option<FloatTensor<B>>, Positional<B>),
        rule: Rule,
        scores: Scores,
    ) -> Self {
        let shapes = [query, key, value].map(|t| {
            let dims: Vec<usize> = t.shape().iter().copied().collect();
            <[usize; 4]>::try_from(dims).expect("rank 4")
        });
        let dims = Dims::new(shapes, scores.scale);
        let visibility = rule.visibility(dims.queries, dims.keys);
        let (position, table) = match position {
            Positional::Nothing => (None, None),
            Positional::Alibi(slopes) => (Some(TilePositional::alibi(slopes, &visibility)), None),
            Positional::Learned(table, buckets) => (
                Some(TilePositional::learned(buckets, &visibility)),
                Some(table),
            ),
        };
        Self {
            dims,
            scoring: Scoring {
                softcap: scores.softcap.map(|cap| cap as f32),
                visibility,
                position,
            },
            blocked: match blocked {
                Blocked::Nothing => None,
                Blocked::Mask(mask) => Some(mask),
            },
            bias,
            table,
        }
    }

    /// The output `[B, H, Tq, Dv]` and the log-sum-exp of every row, `[B, H, Tq, 1]`.
    fn forward(&self, qkv: [&FloatTensor<B>; 3]) -> (FloatTensor<B>, FloatTensor<B>) {
        let (blocked, biases) = (
            self.blocked.as_ref(),
            [self.bias.as_ref(), self.table.as_ref()],
        );
        tiled_forward::<B>(self.dims, &self.scoring, qkv, blocked, biases)
    }
}

/// Attention through [`RecomputeAttention`] on a flex or ndarray device, with autodiff or
/// not; keys and values have `Hkv` heads, a divisor of the queries' `H` (query head `h`
/// reads key/value head `h / (H / Hkv)`).
///
/// # Shapes
/// - `query`: `[B, H, Tq, Dk]`, `key`: `[B, Hkv, Tk, Dk]`, `value`: `[B, Hkv, Tk, Dv]`
/// - result: `[B, H, Tq, Dv]`
pub(super) fn attention(
    [query, key, value]: [Tensor<4>; 3],
    mask: &AttentionMask,
    scores: Scores,
) -> Tensor<4> {
    let blocked = match mask.blocked() {
        Some(blocked) => Blocked::Mask(blocked.clone().into_dispatch()),
        None => Blocked::Nothing,
    };
    let bias = match mask.additive_bias() {
        Some(bias) => Bias::Add(bias.clone().into_dispatch()),
        None => Bias::Nothing,
    };
    let position = match mask.position() {
        None => Positional::Nothing,
        Some(PositionBias::Alibi { slopes }) => Positional::Alibi(slopes.clone()),
        Some(PositionBias::Learned { table, buckets }) => {
            Positional::Learned(table.clone().into_dispatch(), *buckets)
        }
    };
    let output = <Dispatch as RecomputeAttention>::recompute_attention(
        query.into_dispatch(),
        key.into_dispatch(),
        value.into_dispatch(),
        blocked,
        bias,
        position,
        mask.rule().clone(),
        scores,
    );
    Tensor::from_dispatch(output)
}
