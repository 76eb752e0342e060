//! Attention on the CPU backends (flex, ndarray) as one operation whose backward pass
//! recomputes the weights instead of keeping them. Both passes are the tiles of
//! `crate::cpu`.
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
//!
//! Attention sinks scale the output and move the log-sum-exp after the forward pass, and
//! take their gradient beside the backward pass (`crate::sinks`); the tiles do not change.

#[cfg(feature = "cpu-kernels")]
pub(crate) use cpu::{AttentionOp, Spec, attention};

#[cfg(feature = "cpu-kernels")]
mod cpu {
    use burn::backend::tensor::{BoolTensor, FloatTensor};
    use burn::tensor::Tensor;

    use crate::cpu::attention::{
        Dims, Positional as TilePositional, Scoring, tiled_backward, tiled_forward,
    };
    use crate::cpu::{CpuTensors, dims_of};
    use crate::mask::{AttentionMask, Rule};
    use crate::op::Op;
    use crate::ops::FusedOp;
    use crate::positions::{Buckets, PositionBias};
    use crate::problem::Scores;

    /// What an attention call takes besides its tensors.
    #[derive(Clone, Debug)]
    pub(crate) struct Spec {
        rule: Rule,
        scores: Scores,
        /// The inputs hold an additive bias after the query, key and value.
        bias: bool,
        position: Position,
        /// The inputs hold the sinks' logits last, `[1, H, 1, 1]`.
        sinks: bool,
    }

    /// The bias by position of a mask.
    #[derive(Clone, Debug)]
    enum Position {
        None,
        /// ALiBi's slope of each query head.
        Alibi(Vec<f32>),
        /// A learned `[H, buckets]` table, the last input, and how distances map to its
        /// columns.
        Learned(Buckets),
    }

    /// Attention through the tiles on a flex or ndarray device, with autodiff or not;
    /// keys and values have `Hkv` heads, a divisor of the queries' `H` (query head `h`
    /// reads key/value head `h / (H / Hkv)`).
    ///
    /// # Shapes
    /// - `query`: `[B, H, Tq, Dk]`, `key`: `[B, Hkv, Tk, Dk]`, `value`: `[B, Hkv, Tk, Dv]`
    /// - result: `[B, H, Tq, Dv]`
    pub(crate) fn attention(
        [query, key, value]: [Tensor<4>; 3],
        mask: &AttentionMask,
        scores: Scores,
    ) -> Tensor<4> {
        let (position, table) = match mask.position() {
            None => (Position::None, None),
            Some(PositionBias::Alibi { slopes }) => (Position::Alibi(slopes.clone()), None),
            Some(PositionBias::Learned { table, buckets }) => {
                let table = table
                    .clone()
                    .reshape([1, 1, table.dims()[0], buckets.len()]);
                (Position::Learned(*buckets), Some(table))
            }
        };
        let bias = mask.additive_bias().cloned();
        let sinks = mask
            .sink_logits()
            .map(|sinks| sinks.clone().reshape([1, sinks.dims()[0], 1, 1]));
        let spec = Spec {
            rule: mask.rule().clone(),
            scores,
            bias: bias.is_some(),
            position,
            sinks: sinks.is_some(),
        };
        let floats = [query, key, value]
            .into_iter()
            .chain(bias)
            .chain(table)
            .chain(sinks);
        let blocked = mask.blocked().cloned();
        crate::ops::run(FusedOp::Attention(spec), floats.collect(), blocked)
    }

    /// Attention over `[query, key, value, bias?, table?, sinks?]` (a learned table as
    /// `[1, 1, H, buckets]`, the sinks as `[1, H, 1, 1]`) and the boolean `mask` (`true` =
    /// blocked), each broadcastable to `[B, H, Tq, Tk]`.
    pub(crate) struct AttentionOp<B: CpuTensors> {
        pub(crate) spec: Spec,
        pub(crate) mask: Option<BoolTensor<B>>,
    }

    /// The sizes, scoring and mask of one call: what both passes read besides the inputs.
    #[derive(Debug, Clone)]
    pub(crate) struct Problem<B: CpuTensors> {
        dims: Dims,
        scoring: Scoring,
        blocked: Option<BoolTensor<B>>,
        bias: Option<FloatTensor<B>>,
        /// A learned position table, `[1, 1, H, buckets]`.
        table: Option<FloatTensor<B>>,
    }

    /// What the backward pass keeps: the problem, the inputs, the output and the row
    /// log-sum-exp (both with the sinks, if any), and the sinks.
    #[derive(Debug, Clone)]
    pub(crate) struct Saved<B: CpuTensors> {
        problem: Problem<B>,
        qkv: [FloatTensor<B>; 3],
        output: FloatTensor<B>,
        lse: FloatTensor<B>,
        sinks: Option<FloatTensor<B>>,
    }

    impl<B: CpuTensors> Op<B> for AttentionOp<B> {
        type Saved = Saved<B>;

        fn forward(self, floats: Vec<FloatTensor<B>>) -> (FloatTensor<B>, Saved<B>) {
            let Spec {
                rule,
                scores,
                bias,
                position,
                sinks,
            } = self.spec;
            let mut floats = floats.into_iter();
            let mut next = || floats.next().expect("attention's inputs");
            let qkv = [next(), next(), next()];
            let shapes = qkv.each_ref().map(dims_of::<B>);
            let dims = Dims::of(shapes);
            let visibility = rule.visibility(dims.queries, dims.keys);
            let bias = bias.then(&mut next);
            let (position, table) = match position {
                Position::None => (None, None),
                Position::Alibi(slopes) => (Some(TilePositional::alibi(slopes, &visibility)), None),
                Position::Learned(buckets) => (
                    Some(TilePositional::learned(buckets, &visibility)),
                    Some(next()),
                ),
            };
            let sinks = sinks.then(&mut next);
            let problem = Problem {
                dims,
                scoring: Scoring {
                    scale: scores.scale as f32,
                    softcap: scores.softcap.map(|cap| cap as f32),
                    visibility,
                    position,
                },
                blocked: self.mask,
                bias,
                table,
            };
            let (output, lse) = tiled_forward::<B>(
                problem.dims,
                &problem.scoring,
                qkv.each_ref(),
                problem.blocked.as_ref(),
                [problem.bias.as_ref(), problem.table.as_ref()],
            );
            let (output, lse) = match &sinks {
                Some(sinks) => crate::sinks::apply::<B>(output, lse, sinks),
                None => (output, lse),
            };
            let saved = Saved {
                problem,
                qkv,
                output: output.clone(),
                lse,
                sinks,
            };
            (output, saved)
        }

        fn backward(
            saved: Saved<B>,
            grad: FloatTensor<B>,
            wanted: &[bool],
        ) -> Vec<Option<FloatTensor<B>>> {
            let Saved {
                problem,
                qkv,
                output,
                lse,
                sinks,
            } = saved;
            // The inputs after the query, key and value: the bias, the table, the sinks.
            let has_bias = problem.bias.is_some();
            let has_table = problem.table.is_some();
            let bias_grad = has_bias && wanted[3];
            let table_grad = has_table && wanted[3 + usize::from(has_bias)];
            let sinks_grad = sinks
                .as_ref()
                .filter(|_| wanted[3 + usize::from(has_bias) + usize::from(has_table)])
                .map(|sinks| {
                    crate::sinks::grad::<B>(grad.clone(), output.clone(), lse.clone(), sinks)
                });
            // The tiles' pass only for what it computes: not for the sinks' alone.
            let qkv_grad = [wanted[0], wanted[1], wanted[2]];
            let tiles = (qkv_grad.contains(&true) || bias_grad || table_grad).then(|| {
                tiled_backward::<B>(
                    problem.dims,
                    &problem.scoring,
                    qkv.each_ref(),
                    [&output, &lse, &grad],
                    problem.blocked.as_ref(),
                    [problem.bias.as_ref(), problem.table.as_ref()],
                    qkv_grad,
                    [bias_grad, table_grad],
                )
            });
            let (mut in_order, bias, table) = match tiles {
                Some(grads) => {
                    let [q, k, v] = qkv_grad;
                    let in_order = vec![
                        q.then_some(grads.dq),
                        k.then_some(grads.dk),
                        v.then_some(grads.dv),
                    ];
                    (in_order, grads.bias, grads.table)
                }
                None => (vec![None, None, None], None, None),
            };
            if has_bias {
                in_order.push(bias);
            }
            if has_table {
                in_order.push(table);
            }
            if sinks.is_some() {
                in_order.push(sinks_grad);
            }
            in_order
        }
    }
}
