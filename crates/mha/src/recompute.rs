//! Attention on the CPU backends (flex, ndarray) as one operation of the backend (a Burn
//! backend extension), with a backward pass of its own under autodiff that recomputes the
//! scores instead of keeping them. f32 attention runs in cache-sized tiles
//! ([`crate::tiled`], through [`RowKernels::tiled_forward`] and
//! [`RowKernels::tiled_backward`]), with autodiff or not, an additive bias and its
//! gradient included; what follows is the path of other dtypes: query chunk by query
//! chunk, through Burn's ops.
//!
//! Differentiated op by op, attention keeps every chunk's `[B, H, c, Tk]` weights until the
//! backward pass and walks them a dozen times (mask fill, the softmax's five passes, and
//! their backward steps). Here the forward pass keeps only the output `O` and the
//! log-sum-exp of every query row (`[B, H, Tq, 1]`), and the backward pass rebuilds each
//! chunk's weights from them, the way FlashAttention does:
//!
//! ```text
//! P  = exp(S - lse)            S = (Q·scale) Kᵀ + bias, masked
//! dV = Pᵀ dO                   D = rowsum(dO ⊙ O)
//! dS = P ⊙ (dO Vᵀ - D)
//! dQ = dS K · scale            dK = dSᵀ (Q·scale)
//! dbias = dS, summed over the axes the bias broadcasts along
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
    ops::{Backward, NodeGuard, Ops, OpsKind},
};
use burn::backend::{
    Backend, Dispatch, ExtensionType, Scalar, Shape, Slice, TensorMetadata, backend_extension,
    tensor::{BoolTensor, FloatTensor},
};
use burn::tensor::Tensor;

use crate::mask::AttentionMask;

use crate::attention::BLOCKED;
use crate::rows::{DEAD_LSE, Dims, RowKernels};

/// The boolean part of a mask (`true = blocked`), broadcastable to `[B, H, Tq, Tk]`.
#[derive(ExtensionType)]
pub(crate) enum Blocked<B: Backend> {
    /// Nothing blocked beyond the causal part.
    Nothing,
    /// Rank 4, each axis full or 1.
    Mask(BoolTensor<B>),
}

/// The additive part of a mask, broadcastable to `[B, H, Tq, Tk]`; it may want a gradient.
#[derive(ExtensionType)]
pub(crate) enum Bias<B: Backend> {
    /// No bias.
    Nothing,
    /// Rank 4, each axis full or 1; values at or below [`BLOCKED`] block.
    Add(FloatTensor<B>),
}

/// Attention as one operation of the backend, differentiable on `Autodiff<Flex | NdArray>`.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    Autodiff
)]
pub(crate) trait RecomputeAttention: Backend {
    /// `softmax(Q Kᵀ · scale + bias, masked) V` in query chunks of `chunk` rows.
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
        causal: bool,
        scale: f64,
        chunk: usize,
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
                causal: bool,
                scale: f64,
                chunk: usize,
            ) -> FloatTensor<Self> {
                let bias = match bias {
                    Bias::Nothing => None,
                    Bias::Add(bias) => Some(bias),
                };
                let shape = Shape4::of::<Self>(&query, &key, &value);
                let device = query.device();
                let problem =
                    Problem::<Self>::new(shape, device, blocked, bias, causal, scale, chunk);
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
    #[allow(clippy::too_many_arguments)]
    fn recompute_attention(
        query: FloatTensor<Self>,
        key: FloatTensor<Self>,
        value: FloatTensor<Self>,
        blocked: Blocked<Self>,
        bias: Bias<Self>,
        causal: bool,
        scale: f64,
        chunk: usize,
    ) -> FloatTensor<Self> {
        // `Blocked<Autodiff<B>>` to `Blocked<B>`: boolean tensors are the inner backend's.
        let blocked = match blocked {
            Blocked::Nothing => Blocked::Nothing,
            Blocked::Mask(mask) => Blocked::Mask(mask),
        };
        // The nodes before the primitives, as `Backward::prepare` asks.
        let nodes = [query.node(), key.node(), value.node()];
        let bias = match bias {
            Bias::Nothing => None,
            Bias::Add(bias) => Some((bias.node(), bias.into_primitive())),
        };
        let inputs = [
            query.into_primitive(),
            key.into_primitive(),
            value.into_primitive(),
        ];
        let shape = Shape4::of::<B>(&inputs[0], &inputs[1], &inputs[2]);
        let device = inputs[0].device();
        match bias {
            None => {
                let problem = Problem::new(shape, device, blocked, None, causal, scale, chunk);
                tracked::<B, C, 3>(nodes, problem, inputs)
            }
            Some((node, bias)) => {
                let [q, k, v] = nodes;
                let bias = Some(bias);
                let problem = Problem::new(shape, device, blocked, bias, causal, scale, chunk);
                tracked::<B, C, 4>([q, k, v, node], problem, inputs)
            }
        }
    }
}

/// Runs the forward pass and registers [`AttentionBackward`] over `nodes`: the query, key
/// and value, then the bias when there is one.
fn tracked<B: RowKernels, C: CheckpointStrategy, const N: usize>(
    nodes: [NodeGuard; N],
    problem: Problem<B>,
    [query, key, value]: [FloatTensor<B>; 3],
) -> FloatTensor<Autodiff<B, C>> {
    match AttentionBackward
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (output, lse) = problem.forward(&query, &key, &value);
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
        OpsKind::UnTracked(prep) => prep.finish(problem.forward(&query, &key, &value).0),
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

impl<B: RowKernels, const N: usize> Backward<B, N> for AttentionBackward {
    type State = State<B>;

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let state = ops.state;
        let bias_grad = ops.parents.get(3).is_some_and(Option::is_some);
        let (dq, dk, dv, d_bias) = state.problem.backward(
            [&state.query, &state.key, &state.value],
            &state.output,
            &state.lse,
            grad,
            bias_grad,
        );
        let grads_in_order = [Some(dq), Some(dk), Some(dv), d_bias];
        for (parent, grad) in ops.parents.into_iter().zip(grads_in_order) {
            if let (Some(node), Some(grad)) = (parent, grad) {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// `[B, H, Tq, Dk]`, `Tk` and `Dv` of one attention call.
#[derive(Debug, Clone, Copy)]
struct Shape4 {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    queries: usize,
    keys: usize,
    d_k: usize,
    d_v: usize,
}

impl Shape4 {
    fn of<B: Backend>(
        query: &FloatTensor<B>,
        key: &FloatTensor<B>,
        value: &FloatTensor<B>,
    ) -> Self {
        let [batch, heads, queries, d_k] = dims_of(&query.shape());
        Self {
            batch,
            heads,
            kv_heads: dims_of(&key.shape())[1],
            queries,
            keys: dims_of(&key.shape())[2],
            d_k,
            d_v: dims_of(&value.shape())[3],
        }
    }
}

/// The sizes and mask of one attention call, and how it is cut into chunks.
#[derive(Debug, Clone)]
struct Problem<B: RowKernels> {
    /// The sizes, the causal flag and the scale.
    dims: Dims,
    blocked: Option<BoolTensor<B>>,
    /// Clamped at [`BLOCKED`], as the explicit path does.
    bias: Option<FloatTensor<B>>,
    chunk: usize,
    device: B::Device,
}

impl<B: RowKernels> Problem<B> {
    fn new(
        shape: Shape4,
        device: B::Device,
        blocked: Blocked<B>,
        bias: Option<FloatTensor<B>>,
        causal: bool,
        scale: f64,
        chunk: usize,
    ) -> Self {
        Self {
            dims: Dims {
                batch: shape.batch,
                heads: shape.heads,
                kv_heads: shape.kv_heads,
                queries: shape.queries,
                keys: shape.keys,
                d_k: shape.d_k,
                d_v: shape.d_v,
                causal,
                scale: scale as f32,
            },
            blocked: match blocked {
                Blocked::Nothing => None,
                Blocked::Mask(mask) => Some(mask),
            },
            bias: bias.map(|bias| B::float_clamp_min(bias, Scalar::from(BLOCKED))),
            chunk: chunk.max(1),
            device,
        }
    }

    /// The query chunks: each one's rows and the number of keys its rows may see (keys
    /// `0..visible`; zero when every key is in the future of every row).
    fn chunks(&self) -> impl Iterator<Item = (Range<usize>, usize)> + '_ {
        let offset = self.dims.keys as i64 - self.dims.queries as i64;
        (0..self.dims.queries)
            .step_by(self.chunk)
            .map(move |start| {
                let end = (start + self.chunk).min(self.dims.queries);
                let visible = match self.dims.causal {
                    true => (end as i64 + offset).clamp(0, self.dims.keys as i64) as usize,
                    false => self.dims.keys,
                };
                (start..end, visible)
            })
    }

    /// The causal limit of the chunk starting at query row `start` (see [`RowKernels`]).
    fn causal_first(&self, start: usize) -> Option<i64> {
        let offset = self.dims.keys as i64 - self.dims.queries as i64;
        self.dims.causal.then_some(start as i64 + offset)
    }

    /// The slices of a mask part of shape `[b, h, tq, tk]` (broadcastable to `[B, H, Tq,
    /// Tk]`) that cover query rows `rows` and keys `keys`: the full range of an axis of 1.
    fn part_slices(
        &self,
        dims: [usize; 4],
        rows: &Range<usize>,
        keys: &Range<usize>,
    ) -> [Slice; 4] {
        let [b, h, tq, tk] = dims;
        let r = if tq == self.dims.queries && tq > 1 {
            rows.clone()
        } else {
            0..tq
        };
        let c = if tk == self.dims.keys && tk > 1 {
            keys.clone()
        } else {
            0..tk
        };
        [
            Slice::from(0..b),
            Slice::from(0..h),
            Slice::from(r),
            Slice::from(c),
        ]
    }

    /// The user's boolean mask cut to `rows` and `keys`, where it is not broadcast.
    fn blocked_part(&self, rows: &Range<usize>, keys: &Range<usize>) -> Option<BoolTensor<B>> {
        let mask = self.blocked.as_ref()?;
        let slices = self.part_slices(dims_of(&mask.shape()), rows, keys);
        Some(B::bool_slice(mask.clone(), &slices))
    }

    /// The bias cut to `rows` and `keys`, where it is not broadcast.
    fn bias_part(&self, rows: &Range<usize>, keys: &Range<usize>) -> Option<FloatTensor<B>> {
        let bias = self.bias.as_ref()?;
        let slices = self.part_slices(dims_of(&bias.shape()), rows, keys);
        Some(B::float_slice(bias.clone(), &slices))
    }

    /// `[0..B, 0..H, rows, cols]`.
    fn slices(&self, rows: Range<usize>, cols: Range<usize>) -> [Slice; 4] {
        [
            Slice::from(0..self.dims.batch),
            Slice::from(0..self.dims.heads),
            Slice::from(rows),
            Slice::from(cols),
        ]
    }

    /// The scores of the scaled query rows `q` (`[B, H, c, Dk]`) over keys `0..visible`,
    /// with the bias and the user's boolean mask (the causal one is left to
    /// [`RowKernels`]).
    fn scores(
        &self,
        q: &FloatTensor<B>,
        key: &FloatTensor<B>,
        rows: &Range<usize>,
        visible: usize,
    ) -> FloatTensor<B> {
        let k = B::float_slice(key.clone(), &self.slices(0..visible, 0..self.dims.d_k));
        let mut scores = B::float_matmul(q.clone(), B::float_swap_dims(k, 2, 3));
        if let Some(bias) = self.bias_part(rows, &(0..visible)) {
            scores = B::float_add(scores, bias);
        }
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
        let tiled = B::tiled_forward(
            self.dims,
            [query, key, value],
            self.blocked.as_ref(),
            self.bias.as_ref(),
        );
        if let Some(result) = tiled {
            return result;
        }
        let (key, value) = (&self.repeat_kv(key), &self.repeat_kv(value));
        let dtype = query.dtype();
        let mut outputs = Vec::new();
        let mut lses = Vec::new();
        for (rows, visible) in self.chunks() {
            let c = rows.len();
            if visible == 0 {
                let shape = Shape::new([self.dims.batch, self.dims.heads, c, self.dims.d_v]);
                outputs.push(B::float_zeros(shape, &self.device, dtype.into()));
                let shape = Shape::new([self.dims.batch, self.dims.heads, c, 1]);
                let zeros = B::float_zeros(shape, &self.device, dtype.into());
                lses.push(B::float_add_scalar(zeros, Scalar::from(DEAD_LSE)));
                continue;
            }
            let q = B::float_slice(query.clone(), &self.slices(rows.clone(), 0..self.dims.d_k));
            let q = B::float_mul_scalar(q, Scalar::from(self.dims.scale));
            let scores = self.scores(&q, key, &rows, visible);
            let (weights, lse) = B::softmax_rows(scores, self.causal_first(rows.start));
            let v = B::float_slice(value.clone(), &self.slices(0..visible, 0..self.dims.d_v));
            outputs.push(B::float_matmul(weights, v));
            lses.push(lse);
        }
        (cat::<B>(outputs), cat::<B>(lses))
    }

    /// The gradients of the query, key and value from the output's gradient `grad`, and
    /// the bias's when `bias_grad` (summed over the axes it broadcasts along).
    #[allow(clippy::type_complexity)]
    fn backward(
        &self,
        [query, key, value]: [&FloatTensor<B>; 3],
        output: &FloatTensor<B>,
        lse: &FloatTensor<B>,
        grad: FloatTensor<B>,
        bias_grad: bool,
    ) -> (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        Option<FloatTensor<B>>,
    ) {
        let tiled = B::tiled_backward(
            self.dims,
            [query, key, value],
            output,
            lse,
            &grad,
            self.blocked.as_ref(),
            self.bias.as_ref(),
            bias_grad,
        );
        if let Some(grads) = tiled {
            return grads;
        }
        let (key, value) = (&self.repeat_kv(key), &self.repeat_kv(value));
        let dtype = query.dtype();
        // D = rowsum(dO ⊙ O): [B, H, Tq, 1].
        let row_dot = B::float_sum_dim(B::float_mul(grad.clone(), output.clone()), 3);
        let zeros = |rows, cols| {
            let shape = Shape::new([self.dims.batch, self.dims.heads, rows, cols]);
            B::float_zeros(shape, &self.device, dtype.into())
        };
        let mut dk = zeros(self.dims.keys, self.dims.d_k);
        let mut dv = zeros(self.dims.keys, self.dims.d_v);
        let mut d_bias = match (&self.bias, bias_grad) {
            (Some(bias), true) => Some(B::float_zeros(bias.shape(), &self.device, dtype.into())),
            _ => None,
        };
        let mut dqs = Vec::new();
        for (rows, visible) in self.chunks() {
            if visible == 0 {
                dqs.push(zeros(rows.len(), self.dims.d_k));
                continue;
            }
            let q = B::float_slice(query.clone(), &self.slices(rows.clone(), 0..self.dims.d_k));
            let q = B::float_mul_scalar(q, Scalar::from(self.dims.scale));
            let d_out = B::float_slice(grad.clone(), &self.slices(rows.clone(), 0..self.dims.d_v));
            let row_dot = B::float_slice(row_dot.clone(), &self.slices(rows.clone(), 0..1));
            let lse = B::float_slice(lse.clone(), &self.slices(rows.clone(), 0..1));
            let scores = self.scores(&q, key, &rows, visible);
            let weights = B::recompute_rows(scores, lse, self.causal_first(rows.start));
            let k = B::float_slice(key.clone(), &self.slices(0..visible, 0..self.dims.d_k));
            let v = B::float_slice(value.clone(), &self.slices(0..visible, 0..self.dims.d_v));
            // dV += Pᵀ dO
            let dv_part = B::float_matmul(B::float_swap_dims(weights.clone(), 2, 3), d_out.clone());
            dv = accumulate::<B>(dv, &self.slices(0..visible, 0..self.dims.d_v), dv_part);
            // dS = P ⊙ (dO Vᵀ - D)
            let d_weights = B::float_matmul(d_out, B::float_swap_dims(v, 2, 3));
            let d_scores = B::softmax_backward_rows(weights, d_weights, row_dot);
            // dK += dSᵀ (Q·scale); dQ = dS K · scale
            if let Some(acc) = d_bias.take() {
                d_bias = Some(self.add_bias_grad(acc, d_scores.clone(), &rows, visible));
            }
            let dk_part = B::float_matmul(B::float_swap_dims(d_scores.clone(), 2, 3), q);
            dk = accumulate::<B>(dk, &self.slices(0..visible, 0..self.dims.d_k), dk_part);
            let dq = B::float_matmul(d_scores, k);
            dqs.push(B::float_mul_scalar(dq, Scalar::from(self.dims.scale)));
        }
        (
            cat::<B>(dqs),
            self.sum_groups(dk),
            self.sum_groups(dv),
            d_bias,
        )
    }

    /// Key or value heads `[B, Hkv, Tk, D]` repeated for every query head of their group,
    /// `[B, H, Tk, D]` (the chunked path's products want as many heads as the queries).
    fn repeat_kv(&self, x: &FloatTensor<B>) -> FloatTensor<B> {
        let group = self.dims.group();
        if group == 1 {
            return x.clone();
        }
        let [batch, kv_heads, len, dim] = dims_of(&x.shape());
        let x = B::float_reshape(x.clone(), Shape::new([batch, kv_heads, 1, len, dim]));
        let x = B::float_expand(x, Shape::new([batch, kv_heads, group, len, dim]));
        B::float_reshape(x, Shape::new([batch, kv_heads * group, len, dim]))
    }

    /// The gradient of [`Problem::repeat_kv`]: `[B, H, Tk, D]` summed over each group,
    /// `[B, Hkv, Tk, D]`.
    fn sum_groups(&self, x: FloatTensor<B>) -> FloatTensor<B> {
        let group = self.dims.group();
        if group == 1 {
            return x;
        }
        let [batch, _, len, dim] = dims_of(&x.shape());
        let shape = Shape::new([batch, self.dims.kv_heads, group, len, dim]);
        let summed = B::float_sum_dim(B::float_reshape(x, shape), 2);
        B::float_reshape(summed, Shape::new([batch, self.dims.kv_heads, len, dim]))
    }

    /// Adds a chunk's `dS` (`[B, H, c, visible]`) to the bias's gradient `acc`, summed
    /// over the axes the bias broadcasts along.
    fn add_bias_grad(
        &self,
        acc: FloatTensor<B>,
        d_scores: FloatTensor<B>,
        rows: &Range<usize>,
        visible: usize,
    ) -> FloatTensor<B> {
        let dims = dims_of(&acc.shape());
        let mut part = d_scores;
        for (axis, &size) in dims.iter().enumerate() {
            if size == 1 && dims_of(&part.shape())[axis] != 1 {
                part = B::float_sum_dim(part, axis);
            }
        }
        let slices = self.part_slices(dims, rows, &(0..visible));
        accumulate::<B>(acc, &slices, part)
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

fn dims_of(shape: &Shape) -> [usize; 4] {
    let dims: Vec<usize> = shape.iter().copied().collect();
    dims.try_into().expect("rank 4")
}

/// Attention through [`RecomputeAttention`] on a flex or ndarray device, with autodiff or
/// not; keys and values have `Hkv` heads, a divisor of the queries' `H` (query head `h`
/// reads key/value head `h / (H / Hkv)`).
///
/// # Shapes
/// - `query`: `[B, H, Tq, Dk]`, `key`: `[B, Hkv, Tk, Dk]`, `value`: `[B, Hkv, Tk, Dv]`
/// - result: `[B, H, Tq, Dv]`
pub(crate) fn attention(
    query: Tensor<4>,
    key: Tensor<4>,
    value: Tensor<4>,
    mask: &AttentionMask,
    scale: f64,
    chunk: usize,
) -> Tensor<4> {
    let blocked = match mask.blocked() {
        Some(blocked) => Blocked::Mask(blocked.clone().into_dispatch()),
        None => Blocked::Nothing,
    };
    let bias = match mask.additive_bias() {
        Some(bias) => Bias::Add(bias.clone().into_dispatch()),
        None => Bias::Nothing,
    };
    let output = <Dispatch as RecomputeAttention>::recompute_attention(
        query.into_dispatch(),
        key.into_dispatch(),
        value.into_dispatch(),
        blocked,
        bias,
        mask.is_causal(),
        scale,
        chunk,
    );
    Tensor::from_dispatch(output)
}
