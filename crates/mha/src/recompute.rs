//! Attention for autodiff devices over the CPU backends (flex, ndarray) as one
//! differentiable operation, with a backward pass of its own that recomputes the scores
//! query chunk by query chunk instead of keeping them.
//!
//! Differentiated op by op, attention keeps every chunk's `[B, H, c, Tk]` weights until the
//! backward pass and walks them a dozen times (mask fill, the softmax's five passes, and
//! their backward steps). Here the forward pass keeps only the output `O` and the
//! log-sum-exp of every query row (`[B, H, Tq, 1]`), and the backward pass rebuilds each
//! chunk's weights from them, the way FlashAttention does:
//!
//! ```text
//! P  = exp(S - lse)            S = (Q·scale) Kᵀ, masked
//! dV = Pᵀ dO                   D = rowsum(dO ⊙ O)
//! dS = P ⊙ (dO Vᵀ - D)
//! dQ = dS K · scale            dK = dSᵀ (Q·scale)
//! ```
//!
//! A causal chunk reads only the keys its last row can see, and the row-wise steps
//! ([`RowKernels`]) take the causal mask as a per-row length. A row whose every key is
//! blocked has output zero and passes no gradient, as in the explicit path: its
//! log-sum-exp is [`DEAD_LSE`], which makes every recomputed weight of the row 0.

// Burn 0.22 deprecates ndarray; it is still one of our backends.
#![allow(deprecated)]

use std::ops::Range;

#[cfg(feature = "flex")]
use burn::backend::Flex;
#[cfg(feature = "ndarray")]
use burn::backend::NdArray;
use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, Ops, OpsKind},
};
use burn::backend::{
    Backend, Dispatch, ExtensionType, Scalar, Shape, Slice, TensorMetadata, backend_extension,
    tensor::{BoolTensor, FloatTensor},
};
use burn::tensor::{Bool, Tensor};

use crate::attention::BLOCKED;
use crate::rows::{DEAD_LSE, RowKernels};

/// The boolean part of a mask (`true = blocked`), broadcastable to `[B, H, Tq, Tk]`.
#[derive(ExtensionType)]
pub(crate) enum Blocked<B: Backend> {
    /// Nothing blocked beyond the causal part.
    Nothing,
    /// Rank 4, each axis full or 1.
    Mask(BoolTensor<B>),
}

/// Attention as one operation of the backend, differentiable on `Autodiff<Flex | NdArray>`.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    Autodiff
)]
pub(crate) trait RecomputeAttention: Backend {
    /// `softmax(Q Kᵀ · scale, masked) V` in query chunks of `chunk` rows.
    ///
    /// # Shapes
    /// - `query`: `[B, H, Tq, Dk]`, `key`: `[B, H, Tk, Dk]`, `value`: `[B, H, Tk, Dv]`
    /// - result: `[B, H, Tq, Dv]`
    fn recompute_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        #[extension_type] blocked: Blocked<Self>,
        causal: bool,
        scale: f64,
        chunk: usize,
    ) -> FloatTensor<Self>;
}

/// The forward pass alone, for the backends under autodiff.
macro_rules! forward_only {
    ($backend:ty) => {
        impl RecomputeAttention for $backend {
            fn recompute_attention(
                query: FloatTensor<Self>,
                key: FloatTensor<Self>,
                value: FloatTensor<Self>,
                blocked: Blocked<Self>,
                causal: bool,
                scale: f64,
                chunk: usize,
            ) -> FloatTensor<Self> {
                let problem =
                    Problem::<Self>::new(&query, &key, &value, blocked, causal, scale, chunk);
                problem.forward(&query, &key, &value).0
            }
        }
    };
}

#[cfg(feature = "flex")]
forward_only!(Flex);
#[cfg(feature = "ndarray")]
forward_only!(NdArray);

impl<B: RecomputeAttention + RowKernels, C: CheckpointStrategy> RecomputeAttention
    for Autodiff<B, C>
{
    fn recompute_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        blocked: Blocked<Self>,
        causal: bool,
        scale: f64,
        chunk: usize,
    ) -> FloatTensor<Self> {
        let blocked = match blocked {
            Blocked::Nothing => Blocked::Nothing,
            Blocked::Mask(mask) => Blocked::Mask(mask),
        };
        let prep = AttentionBackward
            .prepare::<C>([query.node(), key.node(), value.node()])
            .compute_bound()
            .stateful();
        let (q, k, v) = (
            query.into_primitive(),
            key.into_primitive(),
            value.into_primitive(),
        );
        let problem = Problem::<B>::new(&q, &k, &v, blocked, causal, scale, chunk);
        match prep {
            OpsKind::Tracked(prep) => {
                let (output, lse) = problem.forward(&q, &k, &v);
                let state = State {
                    problem,
                    query: q,
                    key: k,
                    value: v,
                    output: output.clone(),
                    lse,
                };
                prep.finish(state, output)
            }
            OpsKind::UnTracked(prep) => prep.finish(problem.forward(&q, &k, &v).0),
        }
    }
}

/// The backward step of [`RecomputeAttention`] on `Autodiff<B>`.
#[derive(Debug)]
struct AttentionBackward;

/// What the backward pass keeps: the inputs, the output and the row log-sum-exp.
#[derive(Debug, Clone)]
struct State<B: RowKernels> {
    problem: Problem<B>,
    query: FloatTensor<B>,
    key: FloatTensor<B>,
    value: FloatTensor<B>,
    output: FloatTensor<B>,
    lse: FloatTensor<B>,
}

impl<B: RowKernels> Backward<B, 3> for AttentionBackward {
    type State = State<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_q, node_k, node_v] = ops.parents;
        let grad = grads.consume::<B>(&ops.node);
        let state = ops.state;
        let (dq, dk, dv) = state.problem.backward(
            &state.query,
            &state.key,
            &state.value,
            &state.output,
            &state.lse,
            grad,
        );
        if let Some(node) = node_q {
            grads.register::<B>(node.id, dq);
        }
        if let Some(node) = node_k {
            grads.register::<B>(node.id, dk);
        }
        if let Some(node) = node_v {
            grads.register::<B>(node.id, dv);
        }
    }
}

/// The sizes and mask of one attention call, and how it is cut into chunks.
#[derive(Debug, Clone)]
struct Problem<B: RowKernels> {
    batch: usize,
    heads: usize,
    queries: usize,
    keys: usize,
    d_k: usize,
    d_v: usize,
    blocked: Option<BoolTensor<B>>,
    causal: bool,
    scale: f32,
    chunk: usize,
    device: B::Device,
}

impl<B: RowKernels> Problem<B> {
    fn new(
        query: &FloatTensor<B>,
        key: &FloatTensor<B>,
        value: &FloatTensor<B>,
        blocked: Blocked<B>,
        causal: bool,
        scale: f64,
        chunk: usize,
    ) -> Self {
        let [batch, heads, queries, d_k] = dims::<B>(query);
        let keys = dims::<B>(key)[2];
        let d_v = dims::<B>(value)[3];
        Self {
            batch,
            heads,
            queries,
            keys,
            d_k,
            d_v,
            blocked: match blocked {
                Blocked::Nothing => None,
                Blocked::Mask(mask) => Some(mask),
            },
            causal,
            scale: scale as f32,
            chunk: chunk.max(1),
            device: query.device(),
        }
    }

    /// The query chunks: each one's rows and the number of keys its rows may see (keys
    /// `0..visible`; zero when every key is in the future of every row).
    fn chunks(&self) -> impl Iterator<Item = (Range<usize>, usize)> + '_ {
        let offset = self.keys as i64 - self.queries as i64;
        (0..self.queries).step_by(self.chunk).map(move |start| {
            let end = (start + self.chunk).min(self.queries);
            let visible = match self.causal {
                true => (end as i64 + offset).clamp(0, self.keys as i64) as usize,
                false => self.keys,
            };
            (start..end, visible)
        })
    }

    /// The causal limit of the chunk starting at query row `start` (see [`RowKernels`]).
    fn causal_first(&self, start: usize) -> Option<i64> {
        let offset = self.keys as i64 - self.queries as i64;
        self.causal.then_some(start as i64 + offset)
    }

    /// The user's boolean mask cut to `rows` and `keys`, where it is not broadcast.
    fn blocked_part(&self, rows: &Range<usize>, keys: &Range<usize>) -> Option<BoolTensor<B>> {
        let mask = self.blocked.as_ref()?;
        let [b, h, tq, tk] = dims_of(&mask.shape());
        let r = if tq == self.queries && tq > 1 {
            rows.clone()
        } else {
            0..tq
        };
        let c = if tk == self.keys && tk > 1 {
            keys.clone()
        } else {
            0..tk
        };
        Some(B::bool_slice(
            mask.clone(),
            &[
                Slice::from(0..b),
                Slice::from(0..h),
                Slice::from(r),
                Slice::from(c),
            ],
        ))
    }

    /// `[0..B, 0..H, rows, cols]`.
    fn slices(&self, rows: Range<usize>, cols: Range<usize>) -> [Slice; 4] {
        [
            Slice::from(0..self.batch),
            Slice::from(0..self.heads),
            Slice::from(rows),
            Slice::from(cols),
        ]
    }

    /// The scores of the scaled query rows `q` (`[B, H, c, Dk]`) over keys `0..visible`,
    /// with the user's boolean mask (the causal one is left to [`RowKernels`]).
    fn scores(
        &self,
        q: &FloatTensor<B>,
        key: &FloatTensor<B>,
        rows: &Range<usize>,
        visible: usize,
    ) -> FloatTensor<B> {
        let k = B::float_slice(key.clone(), &self.slices(0..visible, 0..self.d_k));
        let scores = B::float_matmul(q.clone(), B::float_swap_dims(k, 2, 3));
        match self.blocked_part(rows, &(0..visible)) {
            Some(mask) => B::float_mask_fill(scores, mask, Scalar::from(BLOCKED)),
            None => scores,
        }
    }

    /// The output `[B, H, Tq, Dv]` and the log-sum-exp of every row, `[B, H, Tq, 1]`.
    fn forward(
        &self,
        query: &FloatTensor<B>,
        key: &FloatTensor<B>,
        value: &FloatTensor<B>,
    ) -> (FloatTensor<B>, FloatTensor<B>) {
        let dtype = query.dtype();
        let mut outputs = Vec::new();
        let mut lses = Vec::new();
        for (rows, visible) in self.chunks() {
            let c = rows.len();
            if visible == 0 {
                let shape = Shape::new([self.batch, self.heads, c, self.d_v]);
                outputs.push(B::float_zeros(shape, &self.device, dtype.into()));
                let shape = Shape::new([self.batch, self.heads, c, 1]);
                let zeros = B::float_zeros(shape, &self.device, dtype.into());
                lses.push(B::float_add_scalar(zeros, Scalar::from(DEAD_LSE)));
                continue;
            }
            let q = B::float_slice(query.clone(), &self.slices(rows.clone(), 0..self.d_k));
            let q = B::float_mul_scalar(q, Scalar::from(self.scale));
            let scores = self.scores(&q, key, &rows, visible);
            let (weights, lse) = B::softmax_rows(scores, self.causal_first(rows.start));
            let v = B::float_slice(value.clone(), &self.slices(0..visible, 0..self.d_v));
            outputs.push(B::float_matmul(weights, v));
            lses.push(lse);
        }
        (cat::<B>(outputs), cat::<B>(lses))
    }

    /// The gradients of the query, key and value from the output's gradient `grad`.
    fn backward(
        &self,
        query: &FloatTensor<B>,
        key: &FloatTensor<B>,
        value: &FloatTensor<B>,
        output: &FloatTensor<B>,
        lse: &FloatTensor<B>,
        grad: FloatTensor<B>,
    ) -> (FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) {
        let dtype = query.dtype();
        // D = rowsum(dO ⊙ O): [B, H, Tq, 1].
        let row_dot = B::float_sum_dim(B::float_mul(grad.clone(), output.clone()), 3);
        let zeros = |rows, cols| {
            let shape = Shape::new([self.batch, self.heads, rows, cols]);
            B::float_zeros(shape, &self.device, dtype.into())
        };
        let mut dk = zeros(self.keys, self.d_k);
        let mut dv = zeros(self.keys, self.d_v);
        let mut dqs = Vec::new();
        for (rows, visible) in self.chunks() {
            if visible == 0 {
                dqs.push(zeros(rows.len(), self.d_k));
                continue;
            }
            let q = B::float_slice(query.clone(), &self.slices(rows.clone(), 0..self.d_k));
            let q = B::float_mul_scalar(q, Scalar::from(self.scale));
            let d_out = B::float_slice(grad.clone(), &self.slices(rows.clone(), 0..self.d_v));
            let row_dot = B::float_slice(row_dot.clone(), &self.slices(rows.clone(), 0..1));
            let lse = B::float_slice(lse.clone(), &self.slices(rows.clone(), 0..1));
            let scores = self.scores(&q, key, &rows, visible);
            let weights = B::recompute_rows(scores, lse, self.causal_first(rows.start));
            let k = B::float_slice(key.clone(), &self.slices(0..visible, 0..self.d_k));
            let v = B::float_slice(value.clone(), &self.slices(0..visible, 0..self.d_v));
            // dV += Pᵀ dO
            let dv_part = B::float_matmul(B::float_swap_dims(weights.clone(), 2, 3), d_out.clone());
            dv = accumulate::<B>(dv, &self.slices(0..visible, 0..self.d_v), dv_part);
            // dS = P ⊙ (dO Vᵀ - D)
            let d_weights = B::float_matmul(d_out, B::float_swap_dims(v, 2, 3));
            let d_scores = B::softmax_backward_rows(weights, d_weights, row_dot);
            // dK += dSᵀ (Q·scale); dQ = dS K · scale
            let dk_part = B::float_matmul(B::float_swap_dims(d_scores.clone(), 2, 3), q);
            dk = accumulate::<B>(dk, &self.slices(0..visible, 0..self.d_k), dk_part);
            let dq = B::float_matmul(d_scores, k);
            dqs.push(B::float_mul_scalar(dq, Scalar::from(self.scale)));
        }
        (cat::<B>(dqs), dk, dv)
    }
}

/// `tensor[slices] += part`.
fn accumulate<B: Backend>(
    tensor: FloatTensor<B>,
    slices: &[Slice],
    part: FloatTensor<B>,
) -> FloatTensor<B> {
    let current = B::float_slice(tensor.clone(), slices);
    B::float_slice_assign(tensor, slices, B::float_add(current, part))
}

/// Concatenates along the query axis.
fn cat<B: Backend>(parts: Vec<FloatTensor<B>>) -> FloatTensor<B> {
    match parts.len() {
        1 => parts.into_iter().next().expect("one part"),
        _ => B::float_cat(parts, 2),
    }
}

fn dims<B: Backend>(tensor: &FloatTensor<B>) -> [usize; 4] {
    dims_of(&tensor.shape())
}

fn dims_of(shape: &Shape) -> [usize; 4] {
    let dims: Vec<usize> = shape.iter().copied().collect();
    dims.try_into().expect("rank 4")
}

/// Attention through [`RecomputeAttention`] on a flex or ndarray device, with autodiff or
/// not; keys and values
/// have as many heads as the queries.
///
/// # Shapes
/// - `query`: `[B, H, Tq, Dk]`, `key`: `[B, H, Tk, Dk]`, `value`: `[B, H, Tk, Dv]`
/// - `blocked`: broadcastable to `[B, H, Tq, Tk]`, `true = blocked`
/// - result: `[B, H, Tq, Dv]`
pub(crate) fn attention(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    blocked: Option<Tensor<4, Bool>>,
    causal: bool,
    scale: f64,
    chunk: usize,
) -> Tensor<4> {
    let blocked = match blocked {
        Some(mask) => Blocked::Mask(mask.into_dispatch()),
        None => Blocked::Nothing,
    };
    let output = <Dispatch as RecomputeAttention>::recompute_attention(
        query.into_dispatch(),
        key.into_dispatch(),
        value.into_dispatch(),
        blocked,
        causal,
        scale,
        chunk,
    );
    Tensor::from_dispatch(output)
}
