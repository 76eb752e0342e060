//! Attention on the CubeCL backends (wgpu, cuda) as one backend extension: the kernels of
//! [`forward`](super::forward) and [`backward`](super::backward) on `CubeBackend`, the
//! same calls deferred as opaque custom operations under Burn's fusion (`Fusion`, which
//! the wgpu and cuda devices run), and under autodiff one node of the graph
//! ([`crate::op`]) that keeps the query, key, value, output, log-sum-exp and the mask's
//! parts, nothing of size `Tq x Tk`.

use burn::backend::autodiff::{Autodiff, checkpoint::strategy::CheckpointStrategy};
use burn::backend::fusion::custom::TensorSpec;
use burn::backend::{
    AutodiffBackend, Backend, Dispatch, ExtensionType, TensorMetadata, backend_extension,
    tensor::{BoolTensor, FloatTensor, IntTensor},
};
use burn::tensor::{BoolStore, DType, Int, Shape, Slice, Tensor, TensorData};
use burn_cubecl::kernel::{cast, untile};
use burn_cubecl::{CubeBackend, tensor::CubeTensor};
use cubecl::prelude::TensorBinding;
use cubecl::zspace::metadata::Metadata;

use super::launch::{self, Scoring};
use crate::mask::{AttentionMask, Band};
use crate::op::{self, Op};
use crate::problem::Scores;

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

/// The heads of a call whose query, key and value come packed side by side in one tensor
/// `[B, T, (H + 2·Hkv)·Dh]`, a packed input projection's output: the query's `H` heads,
/// then the key's `Hkv`, then the value's. The kernels read the three as views of it, and
/// the backward pass gives its gradient as one tensor of its shape, where separate inputs
/// would each be cut from it and their gradients written into zeros of the whole.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Packed {
    /// The query's heads, `H`.
    pub(crate) heads: usize,
    /// The key's and the value's heads, `Hkv`.
    pub(crate) kv_heads: usize,
    /// Each head's width, `Dh`.
    pub(crate) head_dim: usize,
}

impl Packed {
    /// The shapes of the query `[B, H, T, Dh]`, key and value `[B, Hkv, T, Dh]` of a
    /// packed tensor of `batch` rows of `len` positions.
    pub(crate) fn dims(self, batch: usize, len: usize) -> [[usize; 4]; 3] {
        let (heads, kv_heads, d) = (self.heads, self.kv_heads, self.head_dim);
        [
            [batch, heads, len, d],
            [batch, kv_heads, len, d],
            [batch, kv_heads, len, d],
        ]
    }

    /// The query `[B, H, T, Dh]`, key and value `[B, Hkv, T, Dh]` of `qkv`, as views
    /// where the device's alignment allows (Burn's slice copies otherwise).
    fn split<B: Backend>(self, qkv: FloatTensor<B>) -> [FloatTensor<B>; 3] {
        let [batch, len, width] = qkv.shape().dims();
        let Self {
            heads,
            kv_heads,
            head_dim,
        } = self;
        assert_eq!(
            width,
            (heads + 2 * kv_heads) * head_dim,
            "packed attention: {heads} + 2 x {kv_heads} heads of {head_dim} in a width of {width}"
        );
        // The heads split off the whole tensor, then sliced: Burn's reshape of a slice
        // copies it where the batch is 1 (its analysis does not pass over the unit axis).
        let all = heads + 2 * kv_heads;
        let qkv = B::float_reshape(qkv, Shape::new([batch, len, all, head_dim]));
        let parts = [(0, heads), (heads, kv_heads), (heads + kv_heads, kv_heads)];
        parts.map(|(first, count)| {
            let slices = [
                Slice::from(..),
                Slice::from(..),
                Slice::new(first as isize, Some((first + count) as isize), 1),
                Slice::from(..),
            ];
            let part = B::float_slice(qkv.clone(), &slices);
            B::float_swap_dims(part, 1, 2)
        })
    }

    /// The gradient of the packed tensor from those of the query, key and value (laid out
    /// `[B, T, heads, Dh]`, as the kernels write them): their heads side by side.
    fn join<B: Backend>(self, grads: [FloatTensor<B>; 3]) -> FloatTensor<B> {
        let rows = grads.map(|grad| {
            let [batch, heads, len, head_dim] = grad.shape().dims();
            let grad = B::float_swap_dims(grad, 1, 2);
            B::float_reshape(grad, Shape::new([batch, len, heads * head_dim]))
        });
        B::float_cat(rows.into(), 2)
    }
}

/// A float tensor a call may have: an additive bias, a bias by distance, a gradient.
#[derive(ExtensionType)]
#[extension_type(fusion)]
pub(crate) enum Extra<B: Backend> {
    None,
    Some(FloatTensor<B>),
}

impl<B: Backend> Extra<B> {
    fn of(t: Option<FloatTensor<B>>) -> Self {
        t.map_or(Extra::None, Extra::Some)
    }

    fn as_option(&self) -> Option<&FloatTensor<B>> {
        match self {
            Extra::None => None,
            Extra::Some(t) => Some(t),
        }
    }

    fn into_option(self) -> Option<FloatTensor<B>> {
        match self {
            Extra::None => None,
            Extra::Some(t) => Some(t),
        }
    }
}

/// Packed sequences' bounds (i32 `[B, 1, T, 2]`, see `Visibility::sequences`), if the
/// call has them.
#[derive(ExtensionType)]
#[extension_type(fusion)]
pub(crate) enum Sequences<B: Backend> {
    None,
    Some(IntTensor<B>),
}

/// A boolean mask (`true` = blocked), if the call has one.
#[derive(ExtensionType)]
#[extension_type(fusion)]
pub(crate) enum Blocked<B: Backend> {
    None,
    Some(BoolTensor<B>),
}

/// The tensors of a call: `q` `[B, H, Tq, Dk]`, `k` `[B, Hkv, Tk, Dk]`, `v` `[B, Hkv, Tk,
/// Dv]`, the bias and the mask, each broadcastable to `[B, H, Tq, Tk]`, the bias by
/// distance (`[1, 1, H, Tq + Tk - 1]`), packed sequences' bounds and the sinks' logits
/// (`[1, H, 1, 1]`, applied around the kernels by `crate::sinks`).
#[derive(ExtensionType)]
#[extension_type(fusion)]
pub(crate) struct Inputs<B: Backend> {
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    #[extension_type]
    bias: Extra<B>,
    #[extension_type]
    pd: Extra<B>,
    #[extension_type]
    mask: Blocked<B>,
    #[extension_type]
    seq: Sequences<B>,
    #[extension_type]
    sinks: Extra<B>,
}

/// The output `[B, H, Tq, Dv]` and the log-sum-exp of every row `[B, H, Tq, 1]`.
#[derive(ExtensionType)]
#[extension_type(fusion)]
pub(crate) struct Forward<B: Backend> {
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
}

/// The gradients of the query, key and value, and of the bias, the bias by distance and
/// the sinks when asked for (of their own shapes).
#[derive(ExtensionType)]
#[extension_type(fusion)]
pub(crate) struct Grads<B: Backend> {
    dq: FloatTensor<B>,
    dk: FloatTensor<B>,
    dv: FloatTensor<B>,
    #[extension_type]
    dbias: Extra<B>,
    #[extension_type]
    dpd: Extra<B>,
    #[extension_type]
    dsinks: Extra<B>,
}

/// The gradient of a packed call's query, key and value as one tensor of the packed
/// tensor's shape (see [`Packed`]), and those of the bias, the bias by distance and the
/// sinks when asked for.
#[derive(ExtensionType)]
#[extension_type(fusion)]
pub(crate) struct PackedGrads<B: Backend> {
    dqkv: FloatTensor<B>,
    #[extension_type]
    dbias: Extra<B>,
    #[extension_type]
    dpd: Extra<B>,
    #[extension_type]
    dsinks: Extra<B>,
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

// The backward call's arguments, as the fusion macro passes them.
#[allow(clippy::too_many_arguments)]
fn backward_meta(
    _spec: &Spec,
    inputs: &InputsMetadata,
    _out: &TensorSpec,
    _lse: &TensorSpec,
    _grad: &TensorSpec,
    _q_grad: &bool,
    _kv_grad: &bool,
    bias_grad: &bool,
    pd_grad: &bool,
    sinks_grad: &bool,
) -> GradsMetadata {
    let extra = |t: &ExtraMetadata, wanted: bool| match t {
        ExtraMetadata::Some(spec) if wanted => ExtraMetadata::Some(spec.clone()),
        _ => ExtraMetadata::None,
    };
    GradsMetadata {
        dq: inputs.q.clone(),
        dk: inputs.k.clone(),
        dv: inputs.v.clone(),
        dbias: extra(&inputs.bias, *bias_grad),
        dpd: extra(&inputs.pd, *pd_grad),
        dsinks: extra(&inputs.sinks, *sinks_grad),
    }
}

// The packed backward call's arguments, as the fusion macro passes them.
#[allow(clippy::too_many_arguments)]
fn packed_backward_meta(
    spec: &Spec,
    _packed: &Packed,
    inputs: &InputsMetadata,
    out: &TensorSpec,
    lse: &TensorSpec,
    grad: &TensorSpec,
    q_grad: &bool,
    kv_grad: &bool,
    bias_grad: &bool,
    pd_grad: &bool,
    sinks_grad: &bool,
) -> PackedGradsMetadata {
    let grads = backward_meta(
        spec, inputs, out, lse, grad, q_grad, kv_grad, bias_grad, pd_grad, sinks_grad,
    );
    PackedGradsMetadata {
        // The packed tensor, which the call's query holds.
        dqkv: inputs.q.clone(),
        dbias: grads.dbias,
        dpd: grads.dpd,
        dsinks: grads.dsinks,
    }
}

/// Attention through the kernels of our own on a CubeCL device.
#[backend_extension(Cube, Fusion, Autodiff)]
pub(crate) trait GpuAttention: Backend {
    /// The output of attention over `inputs` under `spec`.
    #[fusion(meta = |_spec, inputs| output_spec(inputs))]
    fn gpu_attention(spec: Spec, #[extension_type] inputs: Inputs<Self>) -> FloatTensor<Self>;

    /// The output of attention over `inputs` under `spec`, whose query, key and value
    /// come packed in one tensor as `packed` says: `inputs.q`, which `inputs.k` and
    /// `inputs.v` repeat. Under autodiff one node whose input is the packed tensor.
    #[fusion(default)]
    fn gpu_attention_packed(
        spec: Spec,
        packed: Packed,
        #[extension_type] inputs: Inputs<Self>,
    ) -> FloatTensor<Self> {
        Self::gpu_attention(spec, unpacked(packed, inputs))
    }

    /// The output and the log-sum-exp of every row.
    #[fusion(meta = forward_meta)]
    fn gpu_attention_forward(spec: Spec, #[extension_type] inputs: Inputs<Self>) -> Forward<Self>;

    /// The gradients of the query, key and value, and of the bias, the bias by distance
    /// and the sinks where `bias_grad`, `pd_grad` and `sinks_grad` ask for them, from the
    /// output `out`, the log-sum-exp `lse` (both with the sinks) and the output's gradient
    /// `grad`. The query's is not computed without `q_grad` (nor the key's and value's
    /// without `kv_grad`): those tensors then hold nothing meaningful.
    #[fusion(meta = backward_meta)]
    #[allow(clippy::too_many_arguments)]
    fn gpu_attention_backward(
        spec: Spec,
        #[extension_type] inputs: Inputs<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        q_grad: bool,
        kv_grad: bool,
        bias_grad: bool,
        pd_grad: bool,
        sinks_grad: bool,
    ) -> Grads<Self>;

    /// [`gpu_attention_backward`](Self::gpu_attention_backward) of a packed call
    /// (`inputs.q` the packed tensor, which `inputs.k` and `inputs.v` repeat), the
    /// gradients of its query, key and value side by side in one tensor of its shape.
    #[fusion(meta = packed_backward_meta)]
    #[allow(clippy::too_many_arguments)]
    fn gpu_attention_backward_packed(
        spec: Spec,
        packed: Packed,
        #[extension_type] inputs: Inputs<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        q_grad: bool,
        kv_grad: bool,
        bias_grad: bool,
        pd_grad: bool,
        sinks_grad: bool,
    ) -> PackedGrads<Self>;
}

/// A tensor as the kernels read it: laid out in rows (a tensor tiled for a matrix product
/// is un-tiled first), over a buffer the kernels' 32-bit indices reach whole
/// ([`Reach`]).
fn binding(t: CubeTensor) -> TensorBinding {
    let mut t = untile(t);
    let elem = t.dtype.size() as u64;
    let used = t.handle.size_in_used();
    match Reach::of(used, elem, t.meta.shape(), t.meta.strides()) {
        Reach::Whole => t.binding(),
        Reach::Trim { bytes } => {
            t.handle = t.handle.clone().offset_end(used - bytes);
            t.binding()
        }
        Reach::Copy => burn_cubecl::kernel::into_contiguous(t).binding(),
    }
}

/// How a view is bound for kernels that index in 32 bits (CubeCL's default addressing:
/// a buffer's length and a tensor's strides are passed as `u32`, and the kernels' sizes
/// are bounded by `i32::MAX` elements, see `dispatch::gpu_indexed`). A view into a larger
/// buffer (a cache's store narrowed to the keys seen, at a batch and capacity past 2^31
/// elements) would be read at wrapped indices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reach {
    /// The buffer's used part holds at most `i32::MAX` elements: bound as it is.
    Whole,
    /// The elements the view reaches (its last one's index, plus one) are within
    /// `i32::MAX`: bound over those `bytes` only (rounded up to 4, a storage binding's
    /// granule, within the buffer).
    Trim {
        /// The bytes bound.
        bytes: u64,
    },
    /// The view reaches past `i32::MAX` elements (its strides do): copied to a tensor of
    /// its own, whose elements the dispatcher bounds (Burn's copy indexes in 64 bits).
    Copy,
}

impl Reach {
    /// The binding of a view of `shape` at `strides` over `used` bytes of elements of
    /// `elem` bytes.
    fn of(used: u64, elem: u64, shape: &[usize], strides: &[usize]) -> Self {
        let most = i32::MAX as u64;
        if used / elem.max(1) <= most {
            return Reach::Whole;
        }
        let reach = match shape.contains(&0) {
            true => 0,
            false => shape
                .iter()
                .zip(strides)
                .map(|(&n, &stride)| (n as u64 - 1).saturating_mul(stride as u64))
                .fold(1u64, u64::saturating_add),
        };
        match reach <= most {
            // (A view of nothing never reaches the kernels; a binding of no bytes is
            // invalid.)
            true if reach == 0 => Reach::Whole,
            true => Reach::Trim {
                bytes: (reach * elem).next_multiple_of(4).min(used),
            },
            false => Reach::Copy,
        }
    }
}

/// The call's tensors as bindings: the mask as the device stores it (u8 or u32), the
/// sequences' bounds as i32.
fn bindings(inputs: Inputs<CubeBackend>) -> launch::Inputs {
    let Inputs {
        q,
        k,
        v,
        bias,
        pd,
        mask,
        seq,
        sinks: _,
    } = inputs;
    let mask = match mask {
        Blocked::None => None,
        Blocked::Some(mask) => Some(mask),
    };
    let mask_elem = match mask.as_ref().map(|m| m.dtype) {
        Some(DType::Bool(BoolStore::U8)) => cubecl::ir::ElemType::UInt(cubecl::ir::UIntKind::U8),
        _ => cubecl::ir::ElemType::UInt(cubecl::ir::UIntKind::U32),
    };
    let seq = match seq {
        Sequences::None => None,
        Sequences::Some(seq) => Some(match seq.dtype {
            DType::I32 => seq,
            _ => cast(seq, DType::I32),
        }),
    };
    let (elem, size, blocked) = launch::element(q.dtype);
    launch::Inputs {
        elem,
        size,
        blocked,
        qkv: [q, k, v].map(binding),
        bias: bias.into_option().map(binding),
        pd: pd.into_option().map(binding),
        mask: mask.map(binding),
        mask_elem,
        seq: seq.map(binding),
    }
}

/// A tensor of `shape` laid out at `strides`, in `dtype` over `handle`, on the device of
/// `like`.
fn tensor_of(
    like: &CubeTensor,
    shape: [usize; 4],
    strides: [usize; 4],
    dtype: DType,
    handle: cubecl::server::Handle,
) -> CubeTensor {
    CubeTensor::new(
        like.client.clone(),
        handle,
        Metadata::new(shape, strides),
        like.device.clone(),
        dtype,
    )
}

/// A contiguous tensor of `shape`.
fn contiguous_of(
    like: &CubeTensor,
    shape: [usize; 4],
    dtype: DType,
    handle: cubecl::server::Handle,
) -> CubeTensor {
    tensor_of(
        like,
        shape,
        launch::contiguous_strides(shape),
        dtype,
        handle,
    )
}

/// A `[B, H, T, D]` tensor laid out `[B, T, H, D]`.
fn heads_inside_of(
    like: &CubeTensor,
    shape: [usize; 4],
    handle: cubecl::server::Handle,
) -> CubeTensor {
    tensor_of(
        like,
        shape,
        launch::heads_inside_strides(shape),
        like.dtype,
        handle,
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
        let sinks = inputs.sinks.as_option().cloned();
        let (out, lse) = launch::forward(&like.client, &bindings(inputs), spec.scoring());
        let out = heads_inside_of(&like, [b, h, tq, d_v], out);
        let lse = contiguous_of(&like, [b, h, tq, 1], DType::F32, lse);
        let (out, lse) = match &sinks {
            Some(sinks) => crate::sinks::apply::<Self>(out, lse, sinks),
            None => (out, lse),
        };
        Forward { out, lse }
    }

    fn gpu_attention_backward(
        spec: Spec,
        inputs: Inputs<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        q_grad: bool,
        kv_grad: bool,
        bias_grad: bool,
        pd_grad: bool,
        sinks_grad: bool,
    ) -> Grads<Self> {
        let like = inputs.q.clone();
        let shapes = [&inputs.q, &inputs.k, &inputs.v].map(dims);
        let wanted = [q_grad, kv_grad, bias_grad, pd_grad, sinks_grad];
        let (grads, extras) = cube_backward(spec, inputs, [out, lse, grad], wanted, false);
        let [dq, dk, dv] = [grads.dq, grads.dk, grads.dv];
        Grads {
            dq: heads_inside_of(&like, shapes[0], dq),
            dk: heads_inside_of(&like, shapes[1], dk),
            dv: heads_inside_of(&like, shapes[2], dv),
            dbias: extras.dbias,
            dpd: extras.dpd,
            dsinks: extras.dsinks,
        }
    }

    fn gpu_attention_backward_packed(
        spec: Spec,
        packed: Packed,
        inputs: Inputs<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        q_grad: bool,
        kv_grad: bool,
        bias_grad: bool,
        pd_grad: bool,
        sinks_grad: bool,
    ) -> PackedGrads<Self> {
        let qkv = inputs.q.clone();
        let heads = [packed.heads, packed.kv_heads, packed.head_dim];
        let inputs = unpacked(packed, inputs);
        let wanted = [q_grad, kv_grad, bias_grad, pd_grad, sinks_grad];
        // Where the key's and value's columns cannot start a binding, the three
        // gradients of their own, then side by side.
        if !launch::packed(&qkv.client, heads, qkv.dtype.size()) {
            let grads = backward_of::<Self>(spec, inputs, [out, lse, grad], wanted);
            return PackedGrads {
                dqkv: packed.join::<Self>([grads.dq, grads.dk, grads.dv]),
                dbias: grads.dbias,
                dpd: grads.dpd,
                dsinks: grads.dsinks,
            };
        }
        let (grads, extras) = cube_backward(spec, inputs, [out, lse, grad], wanted, true);
        let shape: [usize; 3] = std::array::from_fn(|axis| qkv.meta.shape()[axis]);
        let strides = [shape[1] * shape[2], shape[2], 1];
        let dqkv = CubeTensor::new(
            qkv.client.clone(),
            grads.dq,
            Metadata::new(shape, strides),
            qkv.device.clone(),
            qkv.dtype,
        );
        PackedGrads {
            dqkv,
            dbias: extras.dbias,
            dpd: extras.dpd,
            dsinks: extras.dsinks,
        }
    }
}

/// The kernels' backward pass over `inputs` (see [`launch::backward`], which `packed`
/// asks to write dQ, dK and dV side by side): their handles (dQ's computed where `[q,
/// ..]` asks for it, dK's and dV's where `[_, kv, ..]` does), and the gradients of the
/// bias, the bias by distance and the sinks where `[.., bias, pd, sinks]` ask for them.
fn cube_backward(
    spec: Spec,
    inputs: Inputs<CubeBackend>,
    [out, lse, grad]: [CubeTensor; 3],
    [q_grad, kv_grad, bias_grad, pd_grad, sinks_grad]: [bool; 5],
    packed: bool,
) -> (launch::Grads, Extras) {
    let like = inputs.q.clone();
    let dsinks = inputs
        .sinks
        .as_option()
        .filter(|_| sinks_grad)
        .map(|sinks| {
            crate::sinks::grad::<CubeBackend>(grad.clone(), out.clone(), lse.clone(), sinks)
        });
    let extra_shape = |t: &Extra<CubeBackend>| match t {
        Extra::Some(t) => dims(t),
        Extra::None => [0; 4],
    };
    let [bias_shape, pd_shape] = [extra_shape(&inputs.bias), extra_shape(&inputs.pd)];
    let mut grads = launch::backward(
        &like.client,
        &bindings(inputs),
        spec.scoring(),
        [&binding(out), &binding(lse)],
        &binding(grad),
        [q_grad, kv_grad, bias_grad, pd_grad],
        packed,
    );
    let extras = Extras {
        dbias: Extra::of(
            grads
                .dbias
                .take()
                .map(|h| contiguous_of(&like, bias_shape, like.dtype, h)),
        ),
        dpd: Extra::of(
            grads
                .dpd
                .take()
                .map(|h| contiguous_of(&like, pd_shape, like.dtype, h)),
        ),
        dsinks: Extra::of(dsinks),
    };
    (grads, extras)
}

/// The gradients of a call's bias, bias by distance and sinks, where asked for.
struct Extras {
    dbias: Extra<CubeBackend>,
    dpd: Extra<CubeBackend>,
    dsinks: Extra<CubeBackend>,
}

/// `inputs` of a packed call with its query, key and value as views of the packed tensor.
fn unpacked<B: Backend>(packed: Packed, inputs: Inputs<B>) -> Inputs<B> {
    let [q, k, v] = packed.split::<B>(inputs.q);
    Inputs { q, k, v, ..inputs }
}

fn dims(t: &CubeTensor) -> [usize; 4] {
    let shape = t.meta.shape();
    std::array::from_fn(|axis| shape[axis])
}

/// Under autodiff, attention is one node whose backward pass is the kernels': its inputs
/// are the query, key and value (one packed tensor where `packed` says so), then the bias,
/// the bias by distance and the sinks where the call has them (each gets a gradient when
/// tracked); the mask and the sequences are constants. The forward and backward calls
/// themselves are not differentiated.
fn tracked<B: GpuAttention, C: CheckpointStrategy>(
    spec: Spec,
    packed: Option<Packed>,
    inputs: Inputs<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    let Inputs {
        q,
        k,
        v,
        bias,
        pd,
        mask,
        seq,
        sinks,
    } = inputs;
    let (bias, pd, sinks) = (bias.into_option(), pd.into_option(), sinks.into_option());
    let op = AttentionOp::<B> {
        spec,
        packed,
        bias: bias.is_some(),
        pd: pd.is_some(),
        sinks: sinks.is_some(),
        mask: match mask {
            Blocked::None => None,
            Blocked::Some(mask) => Some(mask),
        },
        seq: match seq {
            Sequences::None => None,
            Sequences::Some(seq) => Some(seq),
        },
    };
    // A packed call's query, key and value are one tensor, one input.
    let qkv = match packed {
        Some(_) => vec![q],
        None => vec![q, k, v],
    };
    let floats = qkv.into_iter().chain(bias).chain(pd).chain(sinks).collect();
    op::autodiff::<B, C, _>(op, floats)
}

impl<B: GpuAttention, C: CheckpointStrategy> GpuAttention for Autodiff<B, C> {
    fn gpu_attention(spec: Spec, inputs: Inputs<Self>) -> FloatTensor<Self> {
        tracked::<B, C>(spec, None, inputs)
    }

    fn gpu_attention_packed(spec: Spec, packed: Packed, inputs: Inputs<Self>) -> FloatTensor<Self> {
        tracked::<B, C>(spec, Some(packed), inputs)
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
        q_grad: bool,
        kv_grad: bool,
        bias_grad: bool,
        pd_grad: bool,
        sinks_grad: bool,
    ) -> Grads<Self> {
        let [out, lse, grad] = [out, lse, grad].map(Self::inner);
        let wanted = [q_grad, kv_grad, bias_grad, pd_grad, sinks_grad];
        let grads = backward_of::<B>(spec, inner(inputs), [out, lse, grad], wanted);
        let outer = |t: Extra<B>| Extra::of(t.into_option().map(Self::from_inner));
        Grads {
            dq: Self::from_inner(grads.dq),
            dk: Self::from_inner(grads.dk),
            dv: Self::from_inner(grads.dv),
            dbias: outer(grads.dbias),
            dpd: outer(grads.dpd),
            dsinks: outer(grads.dsinks),
        }
    }

    fn gpu_attention_backward_packed(
        spec: Spec,
        packed: Packed,
        inputs: Inputs<Self>,
        out: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        grad: FloatTensor<Self>,
        q_grad: bool,
        kv_grad: bool,
        bias_grad: bool,
        pd_grad: bool,
        sinks_grad: bool,
    ) -> PackedGrads<Self> {
        let [out, lse, grad] = [out, lse, grad].map(Self::inner);
        let wanted = [q_grad, kv_grad, bias_grad, pd_grad, sinks_grad];
        let grads = packed_backward_of::<B>(spec, packed, inner(inputs), [out, lse, grad], wanted);
        let outer = |t: Extra<B>| Extra::of(t.into_option().map(Self::from_inner));
        PackedGrads {
            dqkv: Self::from_inner(grads.dqkv),
            dbias: outer(grads.dbias),
            dpd: outer(grads.dpd),
            dsinks: outer(grads.dsinks),
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
        pd,
        mask,
        seq,
        sinks,
    } = inputs;
    let inner = |t: Extra<Autodiff<B, C>>| Extra::of(t.into_option().map(Autodiff::<B, C>::inner));
    Inputs {
        q: Autodiff::<B, C>::inner(q),
        k: Autodiff::<B, C>::inner(k),
        v: Autodiff::<B, C>::inner(v),
        bias: inner(bias),
        pd: inner(pd),
        mask: match mask {
            Blocked::None => Blocked::None,
            Blocked::Some(mask) => Blocked::Some(mask),
        },
        seq: match seq {
            Sequences::None => Sequences::None,
            Sequences::Some(seq) => Sequences::Some(seq),
        },
        sinks: inner(sinks),
    }
}

/// [`GpuAttention::gpu_attention_backward`] with its tensors and flags in arrays.
fn backward_of<B: GpuAttention>(
    spec: Spec,
    inputs: Inputs<B>,
    [out, lse, grad]: [FloatTensor<B>; 3],
    [q, kv, bias, pd, sinks]: [bool; 5],
) -> Grads<B> {
    B::gpu_attention_backward(spec, inputs, out, lse, grad, q, kv, bias, pd, sinks)
}

/// [`GpuAttention::gpu_attention_backward_packed`] with its tensors and flags in arrays.
fn packed_backward_of<B: GpuAttention>(
    spec: Spec,
    packed: Packed,
    inputs: Inputs<B>,
    [out, lse, grad]: [FloatTensor<B>; 3],
    [q, kv, bias, pd, sinks]: [bool; 5],
) -> PackedGrads<B> {
    B::gpu_attention_backward_packed(spec, packed, inputs, out, lse, grad, q, kv, bias, pd, sinks)
}

/// Attention over `[query, key, value, bias?, pd?, sinks?]`, with the mask and the
/// sequences as constants.
#[derive(Debug)]
struct AttentionOp<B: Backend> {
    spec: Spec,
    /// The query, key and value are one packed tensor, the first input.
    packed: Option<Packed>,
    /// The inputs hold a bias after the value.
    bias: bool,
    /// The inputs hold a bias by distance after the bias.
    pd: bool,
    /// The inputs hold the sinks' logits last.
    sinks: bool,
    mask: Option<BoolTensor<B>>,
    seq: Option<IntTensor<B>>,
}

/// What the backward pass keeps: the call, its inputs, the output and the log-sum-exp.
#[derive(Clone, Debug)]
struct Saved<B: Backend> {
    spec: Spec,
    packed: Option<Packed>,
    floats: Vec<FloatTensor<B>>,
    /// Which of the bias, the bias by distance and the sinks the inputs hold.
    extras: [bool; 3],
    mask: Option<BoolTensor<B>>,
    seq: Option<IntTensor<B>>,
    out: FloatTensor<B>,
    lse: FloatTensor<B>,
}

/// `[query, key, value, bias?, pd?, sinks?]` (`[packed, bias?, pd?, sinks?]` for a
/// packed call, whose query, key and value are then the packed tensor, as the packed
/// calls take it) and the constants as the kernels' inputs.
fn inputs_of<B: Backend>(
    floats: Vec<FloatTensor<B>>,
    packed: Option<Packed>,
    [bias, pd, sinks]: [bool; 3],
    mask: Option<BoolTensor<B>>,
    seq: Option<IntTensor<B>>,
) -> Inputs<B> {
    let mut floats = floats.into_iter();
    let mut next = || floats.next().expect("attention's inputs");
    let [q, k, v] = match packed {
        Some(_) => {
            let qkv = next();
            [qkv.clone(), qkv.clone(), qkv]
        }
        None => [next(), next(), next()],
    };
    Inputs {
        q,
        k,
        v,
        bias: Extra::of(bias.then(&mut next)),
        pd: Extra::of(pd.then(&mut next)),
        mask: mask.map_or(Blocked::None, Blocked::Some),
        seq: seq.map_or(Sequences::None, Sequences::Some),
        sinks: Extra::of(sinks.then(&mut next)),
    }
}

impl<B: GpuAttention> Op<B> for AttentionOp<B> {
    type Saved = Saved<B>;

    fn forward(self, floats: Vec<FloatTensor<B>>) -> (FloatTensor<B>, Saved<B>) {
        let extras = [self.bias, self.pd, self.sinks];
        let inputs = inputs_of(
            floats.clone(),
            self.packed,
            extras,
            self.mask.clone(),
            self.seq.clone(),
        );
        let inputs = match self.packed {
            Some(packed) => unpacked(packed, inputs),
            None => inputs,
        };
        let Forward { out, lse } = B::gpu_attention_forward(self.spec, inputs);
        let saved = Saved {
            spec: self.spec,
            packed: self.packed,
            floats,
            extras,
            mask: self.mask,
            seq: self.seq,
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
            packed,
            floats,
            extras,
            mask,
            seq,
            out,
            lse,
        } = saved;
        // The inputs after the query, key and value (or the packed tensor): the bias, the
        // bias by distance, the sinks, each where the call has it.
        let mut position = match packed {
            Some(_) => 1,
            None => 3,
        };
        let extra_wanted = extras.map(|present| {
            let wanted = present && wanted[position];
            position += usize::from(present);
            wanted
        });
        // The query's gradient, and the key's and value's, only where asked for (the
        // packed tensor's, all three).
        let [q_grad, kv_grad] = match packed {
            Some(_) => [wanted[0]; 2],
            None => [wanted[0], wanted[1] || wanted[2]],
        };
        let [bias_grad, pd_grad, sinks_grad] = extra_wanted;
        let flags = [q_grad, kv_grad, bias_grad, pd_grad, sinks_grad];
        let inputs = inputs_of(floats, packed, extras, mask, seq);
        let tensors = [out, lse, grad];
        let (mut in_order, others) = match packed {
            Some(packed) => {
                let grads = packed_backward_of::<B>(spec, packed, inputs, tensors, flags);
                let others = [grads.dbias, grads.dpd, grads.dsinks];
                (vec![Some(grads.dqkv)], others)
            }
            None => {
                let grads = backward_of::<B>(spec, inputs, tensors, flags);
                let others = [grads.dbias, grads.dpd, grads.dsinks];
                (vec![Some(grads.dq), Some(grads.dk), Some(grads.dv)], others)
            }
        };
        for (present, grad) in extras.into_iter().zip(others) {
            if present {
                in_order.push(grad.into_option());
            }
        }
        in_order
            .into_iter()
            .zip(wanted)
            .map(|(grad, &wanted)| grad.filter(|_| wanted))
            .collect()
    }
}

/// Attention through the GPU kernels, every float tensor of one dtype, f32, f16 or bf16
/// (see `crate::dispatch`): the
/// band of positions and packed sequences of the mask's rule, its boolean and additive
/// parts and its position bias (ALiBi, a learned table: given to the kernels as one value
/// per query head and distance, through which a learned table's gradient flows).
///
/// # Shapes
/// - `query`: `[B, H, Tq, Dk]`, `key`: `[B, Hkv, Tk, Dk]`, `value`: `[B, Hkv, Tk, Dv]`
/// - result: `[B, H, Tq, Dv]`
pub(crate) fn attention(
    [query, key, value]: [Tensor<4>; 3],
    mask: &AttentionMask,
    scores: Scores,
) -> Tensor<4> {
    let dims = [&query, &key, &value].map(Tensor::dims);
    let device = query.device();
    let qkv = [query, key, value].map(Tensor::into_dispatch);
    call(qkv, None, dims, &device, mask, scores)
}

/// [`attention`] over the query, key and value packed in `qkv` `[B, T, (H + 2·Hkv)·Dh]`
/// as `packed` says (a packed input projection's output): the kernels read them as views
/// of it, and under autodiff its gradient is one tensor of its shape (see [`Packed`]).
///
/// # Shapes
/// - `qkv`: `[B, T, (H + 2·Hkv)·Dh]`
/// - result: `[B, H, T, Dh]`
pub(crate) fn packed_attention(
    qkv: Tensor<3>,
    packed: Packed,
    mask: &AttentionMask,
    scores: Scores,
) -> Tensor<4> {
    let [batch, len, _] = qkv.dims();
    let device = qkv.device();
    let qkv = qkv.into_dispatch();
    let dims = packed.dims(batch, len);
    call(
        [qkv.clone(), qkv.clone(), qkv],
        Some(packed),
        dims,
        &device,
        mask,
        scores,
    )
}

/// The call of [`attention`] or [`packed_attention`] over `qkv` (three times the packed
/// tensor where `packed` says so) of the query's, key's and value's `dims`.
fn call(
    [q, k, v]: [FloatTensor<Dispatch>; 3],
    packed: Option<Packed>,
    [q_dims, k_dims, _]: [[usize; 4]; 3],
    device: &burn::tensor::Device,
    mask: &AttentionMask,
    scores: Scores,
) -> Tensor<4> {
    // On the caller's thread: the kernels are launched on the device's, where a panic
    // would not reach the caller.
    launch::check_settings();
    let (queries, keys) = (q_dims[2], k_dims[2]);
    let visibility = mask.rule().visibility(queries, keys);
    let spec = Spec {
        scale: scores.scale as f32,
        softcap: scores.softcap.map(|cap| cap as f32),
        band: visibility.band(),
    };
    // Column `c` of the bias by distance: the distance `c - (Tq - 1)` from a query's own
    // position (`i + offset`) to a key, `j - i - offset`.
    // In the queries' dtype, as the kernels read it (ALiBi's is made in f32).
    let dtype = q.dtype();
    let pd = mask.position().map(|position| {
        let first = -(queries as i64 - 1) - visibility.offset;
        let per_distance = position
            .per_distance(first, queries + keys - 1, device, DType::F32)
            .cast(dtype);
        let [heads, columns] = per_distance.dims();
        per_distance.reshape([1, 1, heads, columns])
    });
    let seq = visibility.sequences().map(|bounds| {
        // One row of bounds per row of sequences: the batch's, or one for every row.
        let rows = bounds.len() / (2 * queries);
        let data = TensorData::new(bounds, [rows, 1, queries, 2]);
        Tensor::<4, Int>::from_data(data, device)
    });
    let inputs = Inputs {
        q,
        k,
        v,
        bias: Extra::of(
            mask.additive_bias()
                .map(|bias| bias.clone().into_dispatch()),
        ),
        pd: Extra::of(pd.map(Tensor::into_dispatch)),
        mask: match mask.blocked() {
            Some(blocked) => Blocked::Some(blocked.clone().into_dispatch()),
            None => Blocked::None,
        },
        seq: match seq {
            Some(seq) => Sequences::Some(seq.into_dispatch()),
            None => Sequences::None,
        },
        sinks: Extra::of(mask.sink_logits().map(|sinks| {
            let heads = sinks.dims()[0];
            sinks.clone().reshape([1, heads, 1, 1]).into_dispatch()
        })),
    };
    Tensor::from_dispatch(match packed {
        Some(packed) => <Dispatch as GpuAttention>::gpu_attention_packed(spec, packed, inputs),
        None => <Dispatch as GpuAttention>::gpu_attention(spec, inputs),
    })
}

#[cfg(test)]
mod reach_tests {
    use super::Reach;

    /// A cache's store `[64, 8, 65536, 128]` in f16 (2^32 elements) narrowed to its first
    /// keys: its strides reach past 2^31 elements, so it is copied; the same store with a
    /// batch of 1 narrowed to 4096 keys reaches 2^29 + ... elements: bound over those.
    #[test]
    fn views_into_buffers_past_32_bits_are_trimmed_or_copied() {
        let store = [64usize, 8, 65536, 128];
        let strides = [8 * 65536 * 128, 65536 * 128, 128, 1];
        let used = store.iter().product::<usize>() as u64 * 2;
        let view = [64, 8, 4096, 128];
        assert_eq!(Reach::of(used, 2, &view, &strides), Reach::Copy);
        let one = [1, 8, 4096, 128];
        let reach = 7 * 65536 * 128 + 4095 * 128 + 127 + 1;
        let bytes = (reach as u64 * 2).next_multiple_of(4);
        assert_eq!(Reach::of(used, 2, &one, &strides), Reach::Trim { bytes });
        // Within 2^31 elements, as it is; a view of nothing as it is too.
        assert_eq!(Reach::of(1 << 30, 4, &one, &strides), Reach::Whole);
        assert_eq!(
            Reach::of(used, 2, &[0, 8, 4096, 128], &strides),
            Reach::Whole
        );
        // An odd number of f16 elements: rounded up to 4 bytes, within the buffer.
        assert_eq!(Reach::of(used, 2, &[3], &[1]), Reach::Trim { bytes: 8 });
    }
}
