//! Attention on the CubeCL backends (wgpu, cuda) as one backend extension: the kernels of
//! [`forward`](super::forward) and [`backward`](super::backward) on `CubeBackend`, the
//! same calls deferred as opaque custom operations under Burn's fusion (`Fusion`, which
//! the wgpu and cuda devices run), and under autodiff one node of the graph
//! ([`crate::op`]) that keeps the query, key, value, output, log-sum-exp and the mask's
//! parts, nothing of size `Tq x Tk`.

use burn::backend::autodiff::{Autodiff, checkpoint::strategy::CheckpointStrategy};
use burn::backend::fusion::custom::TensorSpec;
use burn::backend::{
    AutodiffBackend, Backend, Dispatch, ExtensionType, backend_extension,
    tensor::{BoolTensor, FloatTensor},
};
use burn::tensor::{BoolStore, DType, IntDType, Shape, Tensor};
use burn_cubecl::kernel::{bool_cast, untile};
use burn_cubecl::{CubeBackend, tensor::CubeTensor};
use cubecl::prelude::TensorBinding;

use super::launch::{self, Scoring};
use super::{backward, forward};
use crate::mask::{AttentionMask, Band};
use crate::op::{self, Op};
use crate::ops::attention::Scores;

/// What a call takes besides its tensors: the scores' scale and soft cap, and the band of
/// keys each query sees.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Spec {
    scale: f32,
    softcap: Option<f32>,
    band: Band,
}

impl Spec {
    fn scoring(self) -> Scoring {
        Scoring {
            scale: self.scale,
            softcap: self.softcap,
            band: self.band,
        }
    }
}

/// An additive bias the call reads but does not differentiate, if it has one.
#[derive(ExtensionType)]
#[extension_type(fusion)]
pub(crate) enum Bias<B: Backend> {
    None,
    Some(FloatTensor<B>),
}

/// A boolean mask (`true` = blocked), if the call has one.
#[derive(ExtensionType)]
#[extension_type(fusion)]
pub(crate) enum Blocked<B: Backend> {
    None,
    Some(BoolTensor<B>),
}

/// The tensors of a call: `q` `[B, H, Tq, Dk]`, `k` `[B, Hkv, Tk, Dk]`, `v` `[B, Hkv, Tk,
/// Dv]`, the bias and the mask, each broadcastable to `[B, H, Tq, Tk]`.
#[derive(ExtensionType)]
#[extension_type(fusion)]
pub(crate) struct Inputs<B: Backend> {
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    #[extension_type]
    bias: Bias<B>,
    #[extension_type]
    mask: Blocked<B>,
}

/// The output `[B, H, Tq, Dv]` and the log-sum-exp of every row `[B, H, Tq, 1]`.
#[derive(ExtensionType)]
#[extension_type(fusion)]
pub(crate) struct Forward<B: Backend> {
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
}

/// The gradients of the query, key and value.
#[derive(ExtensionType)]
#[extension_type(fusion)]
pub(crate) struct Grads<B: Backend> {
    dq: FloatTensor<B>,
    dk: FloatTensor<B>,
    dv: FloatTensor<B>,
}

/// The output's metadata: `[B, H, Tq, Dv]` in the query's dtype.
fn output_spec(inputs: &InputsMetadata) -> TensorSpec {
    let [q, v] = [&inputs.q.shape, &inputs.v.shape];
    TensorSpec::new(Shape::new([q[0], q[1], q[2], v[3]]), inputs.q.dtype)
}

fn forward_meta(_spec: &Spec, inputs: &InputsMetadata) -> ForwardMetadata {
    let q = &inputs.q.shape;
    ForwardMetadata {
        out: output_spec(inputs),
        lse: TensorSpec::new(Shape::new([q[0], q[1], q[2], 1]), DType::F32),
    }
}

fn backward_meta(
    _spec: &Spec,
    inputs: &InputsMetadata,
    _out: &TensorSpec,
    _lse: &TensorSpec,
    _grad: &TensorSpec,
) -> GradsMetadata {
    GradsMetadata {
        dq: inputs.q.clone(),
        dk: inputs.k.clone(),
        dv: inputs.v.clone(),
    }
}

/// Attention through the kernels of our own on a CubeCL device.
#[backend_extension(Cube, Fusion, Autodiff)]
pub(crate) trait GpuAttention: Backend {
    /// The output of attention over `inputs` under `spec`.
    #[fusion(meta = |_spec, inputs| output_spec(inputs))]
    fn gpu_attention(spec: Spec, #[extension_type] inputs: Inputs<Self>) -> FloatTensor<Self>;

    /// The output and the log-sum-exp of every row.
    #[fusion(meta = forward_meta)]
    fn gpu_attention_forward(spec: Spec, #[extension_type] inputs: Inputs<Self>) -> Forward<Self>;

    /// The gradients of the query, key and value from the output `out`, the log-sum-exp
    /// `lse` and the output's gradient `grad`.
    #[fusion(meta = backward_meta)]
    fn gpu_attention_backward(
        spec: Spec,
        #[extension_type] inputs: Inputs<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> Grads<Self>;
}

/// A tensor as the kernels read it: laid out in rows (a tensor tiled for a matrix product
/// is un-tiled first).
fn binding(t: CubeTensor) -> TensorBinding {
    untile(t).binding()
}

/// The call's tensors as bindings, the mask as u32 (a boolean tensor is stored as u8 or u32
/// depending on the device).
fn bindings(inputs: Inputs<CubeBackend>) -> launch::Inputs {
    let Inputs {
        q,
        k,
        v,
        bias,
        mask,
    } = inputs;
    let mask = match mask {
        Blocked::None => None,
        Blocked::Some(mask) => Some(match mask.dtype {
            DType::Bool(BoolStore::U32) => mask,
            _ => bool_cast(mask, IntDType::U32.into()),
        }),
    };
    launch::Inputs {
        qkv: [q, k, v].map(binding),
        bias: match bias {
            Bias::None => None,
            Bias::Some(bias) => Some(binding(bias)),
        },
        mask: mask.map(binding),
    }
}

/// A contiguous f32 tensor of `shape` over `handle`, on the device of `like`.
fn tensor_of(like: &CubeTensor, shape: [usize; 4], handle: cubecl::server::Handle) -> CubeTensor {
    CubeTensor::new_contiguous(
        like.client.clone(),
        like.device.clone(),
        Shape::new(shape),
        handle,
        DType::F32,
    )
}

impl GpuAttention for CubeBackend {
    fn gpu_attention(spec: Spec, inputs: Inputs<Self>) -> FloatTensor<Self> {
        Self::gpu_attention_forward(spec, inputs).out
    }

    fn gpu_attention_forward(spec: Spec, inputs: Inputs<Self>) -> Forward<Self> {
        let like = inputs.q.clone();
        let [b, h, tq, _] = dims(&inputs.q);
        let d_v = dims(&inputs.v)[3];
        let (out, lse) = forward::forward(&like.client, &bindings(inputs), spec.scoring());
        Forward {
            out: tensor_of(&like, [b, h, tq, d_v], out),
            lse: tensor_of(&like, [b, h, tq, 1], lse),
        }
    }

    fn gpu_attention_backward(
        spec: Spec,
        inputs: Inputs<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> Grads<Self> {
        let like = inputs.q.clone();
        let shapes = [&inputs.q, &inputs.k, &inputs.v].map(dims);
        let [dq, dk, dv] = backward::backward(
            &like.client,
            &bindings(inputs),
            spec.scoring(),
            [&binding(out), &binding(lse)],
            &binding(grad),
        );
        Grads {
            dq: tensor_of(&like, shapes[0], dq),
            dk: tensor_of(&like, shapes[1], dk),
            dv: tensor_of(&like, shapes[2], dv),
        }
    }
}

fn dims(t: &CubeTensor) -> [usize; 4] {
    let shape = t.meta.shape();
    std::array::from_fn(|axis| shape[axis])
}

/// Under autodiff, attention is one node whose backward pass is the kernels'; the bias and
/// the mask are constants of the node (the dispatcher sends a call whose bias is tracked
/// elsewhere). The forward and backward calls themselves are not differentiated.
impl<B: GpuAttention, C: CheckpointStrategy> GpuAttention for Autodiff<B, C> {
    fn gpu_attention(spec: Spec, inputs: Inputs<Self>) -> FloatTensor<Self> {
        let Inputs {
            q,
            k,
            v,
            bias,
            mask,
        } = inputs;
        let op = AttentionOp::<B> {
            spec,
            bias: match bias {
                Bias::None => None,
                Bias::Some(bias) => Some(Self::inner(bias)),
            },
            mask: match mask {
                Blocked::None => None,
                Blocked::Some(mask) => Some(mask),
            },
        };
        op::autodiff::<B, C, _>(op, vec![q, k, v])
    }

    fn gpu_attention_forward(spec: Spec, inputs: Inputs<Self>) -> Forward<Self> {
        let Forward { out, lse } = B::gpu_attention_forward(spec, inner(inputs));
        Forward {
            out: Self::from_inner(out),
            lse: Self::from_inner(lse),
        }
    }

    fn gpu_attention_backward(
        spec: Spec,
        inputs: Inputs<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
    ) -> Grads<Self> {
        let [out, lse, grad] = [out, lse, grad].map(Self::inner);
        let Grads { dq, dk, dv } = B::gpu_attention_backward(spec, inner(inputs), out, lse, grad);
        Grads {
            dq: Self::from_inner(dq),
            dk: Self::from_inner(dk),
            dv: Self::from_inner(dv),
        }
    }
}

/// The inputs of an autodiff call as its inner backend's, untracked.
fn inner<B: Backend, C: CheckpointStrategy>(inputs: Inputs<Autodiff<B, C>>) -> Inputs<B> {
    let Inputs {
        q,
        k,
        v,
        bias,
        mask,
    } = inputs;
    Inputs {
        q: Autodiff::<B, C>::inner(q),
        k: Autodiff::<B, C>::inner(k),
        v: Autodiff::<B, C>::inner(v),
        bias: match bias {
            Bias::None => Bias::None,
            Bias::Some(bias) => Bias::Some(Autodiff::<B, C>::inner(bias)),
        },
        mask: match mask {
            Blocked::None => Blocked::None,
            Blocked::Some(mask) => Blocked::Some(mask),
        },
    }
}

/// Attention over `[query, key, value]`, with the bias and the mask as constants.
#[derive(Debug)]
struct AttentionOp<B: Backend> {
    spec: Spec,
    bias: Option<FloatTensor<B>>,
    mask: Option<BoolTensor<B>>,
}

impl<B: Backend> AttentionOp<B> {
    fn inputs(&self, [q, k, v]: [FloatTensor<B>; 3]) -> Inputs<B> {
        Inputs {
            q,
            k,
            v,
            bias: self.bias.clone().map_or(Bias::None, Bias::Some),
            mask: self.mask.clone().map_or(Blocked::None, Blocked::Some),
        }
    }
}

/// What the backward pass keeps: the call, the inputs, the output and the log-sum-exp.
#[derive(Clone, Debug)]
struct Saved<B: Backend> {
    spec: Spec,
    bias: Option<FloatTensor<B>>,
    mask: Option<BoolTensor<B>>,
    qkv: [FloatTensor<B>; 3],
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
}

impl<B: GpuAttention> Op<B> for AttentionOp<B> {
    type Saved = Saved<B>;

    fn forward(self, floats: Vec<FloatTensor<B>>) -> (FloatTensor<B>, Saved<B>) {
        let qkv: [FloatTensor<B>; 3] = op::inputs(floats);
        let Forward { out, lse } = B::gpu_attention_forward(self.spec, self.inputs(qkv.clone()));
        let saved = Saved {
            spec: self.spec,
            bias: self.bias,
            mask: self.mask,
            qkv,
            out: out.clone(),
            lse,
        };
        (out, saved)
    }

    fn backward(
        saved: Saved<B>,
        grad: FloatTensor<B>,
        wanted: &[bool],
    ) -> Vec<Option<FloatTensor<B>>> {
        let Saved {
            spec,
            bias,
            mask,
            qkv,
            out,
            lse,
        } = saved;
        let op = AttentionOp::<B> { spec, bias, mask };
        let Grads { dq, dk, dv } = B::gpu_attention_backward(spec, op.inputs(qkv), out, lse, grad);
        [dq, dk, dv]
            .into_iter()
            .zip(wanted)
            .map(|(grad, &wanted)| wanted.then_some(grad))
            .collect()
    }
}

/// Attention through the GPU kernels: `mask` blocks by a band of positions (not packed
/// sequences), has no position bias and its additive bias, if any, is not tracked; every
/// float tensor is f32 (see `crate::dispatch`).
///
/// # Shapes
/// - `query`: `[B, H, Tq, Dk]`, `key`: `[B, Hkv, Tk, Dk]`, `value`: `[B, Hkv, Tk, Dv]`
/// - result: `[B, H, Tq, Dv]`
///
/// # Panics
/// If the mask is not a band of positions.
pub(crate) fn attention(
    [query, key, value]: [Tensor<4>; 3],
    mask: &AttentionMask,
    scores: Scores,
) -> Tensor<4> {
    let (queries, keys) = (query.dims()[2], key.dims()[2]);
    let band = mask
        .rule()
        .visibility(queries, keys)
        .band()
        .expect("the dispatcher sends only bands of positions to the GPU kernels");
    let spec = Spec {
        scale: scores.scale as f32,
        softcap: scores.softcap.map(|cap| cap as f32),
        band,
    };
    let inputs = Inputs {
        q: query.into_dispatch(),
        k: key.into_dispatch(),
        v: value.into_dispatch(),
        bias: match mask.additive_bias() {
            Some(bias) => Bias::Some(bias.clone().into_dispatch()),
            None => Bias::None,
        },
        mask: match mask.blocked() {
            Some(blocked) => Blocked::Some(blocked.clone().into_dispatch()),
            None => Blocked::None,
        },
    };
    Tensor::from_dispatch(<Dispatch as GpuAttention>::gpu_attention(spec, inputs))
}
