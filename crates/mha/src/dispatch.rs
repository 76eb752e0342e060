//! The one place that decides how an operation runs. Each choice is a pure function of a
//! small description of the call (which backend the device is, whether it
//! differentiates, the dtypes, the sizes), unit-tested without devices; nothing else in
//! the crate asks which backend a device is. The choices were measured: the project's
//! `docs/benchmarks.md` gives the numbers.
//!
//! - Attention ([`attention`]): the tiles of our own on flex and ndarray in f32
//!   (`ops::attention` over `cpu::attention`), the kernels of our own on the GPU backends
//!   (`gpu`), else the explicit path (matmul, mask,
//!   softmax, matmul) in query chunks, or in one pass keeping the weights when they are
//!   returned or dropout acts on them.
//! - The row operations ([`row`]: linear, layer norm, GELU, cross-entropy, AdamW's step,
//!   the sum of squares behind gradient clipping, the residual add): one operation
//!   of our own with its own backward on flex and ndarray in f32, else Burn's operations,
//!   in f32 where the input's half precision would lose too much (layer norm in f16, as
//!   Burn's own module does).
//!
//! On the CubeCL devices (wgpu, cuda) attention takes the GPU kernels of our own
//! (`gpu`) in f32, f16 and bf16, else the explicit path.

use burn::backend::DispatchDevice;
use burn::tensor::{DType, Device, Tensor};

use crate::mask::AttentionMask;

/// Smallest query chunk of the explicit path; it chunks from `2 * MIN_CHUNK` queries on.
const MIN_CHUNK: usize = 128;
/// Most chunks the explicit path cuts the queries into (longer sequences, longer chunks).
const MAX_CHUNKS: usize = 16;

/// Which backend runs a device's operations (under autodiff or not), as far as the
/// choices here go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Backend {
    /// Burn's flex: our CPU kernels.
    #[cfg(feature = "flex")]
    Flex,
    /// Burn's ndarray: our CPU kernels.
    #[cfg(feature = "ndarray")]
    NdArray,
    /// A CubeCL backend (wgpu, cuda): attention in our kernels, the rest Burn's operations.
    #[cfg(feature = "gpu-kernels")]
    Gpu,
    /// Any other backend: Burn's operations.
    Other,
}

impl Backend {
    /// The backend of `device`.
    pub(crate) fn of(device: &Device) -> Self {
        Self::of_dispatch(device.as_dispatch())
    }

    fn of_dispatch(device: &DispatchDevice) -> Self {
        #[allow(unreachable_patterns)] // Which variants exist depends on Burn's features.
        match device {
            DispatchDevice::Autodiff(inner) => Self::of_dispatch(inner),
            #[cfg(feature = "flex")]
            DispatchDevice::Flex(_) => Backend::Flex,
            #[cfg(feature = "ndarray")]
            DispatchDevice::NdArray(_) => Backend::NdArray,
            #[cfg(feature = "gpu-kernels")]
            DispatchDevice::Cube(_) => Backend::Gpu,
            _ => Backend::Other,
        }
    }

    /// Whether our CPU kernels (tiles and fused row operations) run on it.
    #[cfg(feature = "cpu-kernels")]
    pub(crate) fn has_cpu_kernels(self) -> bool {
        match self {
            #[cfg(feature = "flex")]
            Backend::Flex => true,
            #[cfg(feature = "ndarray")]
            Backend::NdArray => true,
            _ => false,
        }
    }
}

/// Whether `device`'s work runs on the CPU kernels' thread pool (flex and ndarray): there
/// dropout draws its mask in parallel, and [`crate::on_cpu_workers`] hands a step to one
/// of the pool's workers.
#[cfg(feature = "cpu-kernels")]
pub(crate) fn cpu_pool(device: &Device) -> bool {
    Backend::of(device).has_cpu_kernels()
}

/// How one attention call runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AttentionPath {
    /// The CPU tiles (`ops::attention`): flex and ndarray, every float tensor f32 and the
    /// boolean mask stored as bytes, with autodiff or not; the backward pass recomputes
    /// the weights.
    #[cfg(feature = "cpu-kernels")]
    Tiles,
    /// Matmul, mask, softmax, matmul, in query chunks of `chunk` rows (`chunk >= Tq`: one
    /// pass). Chunks from `2 * MIN_CHUNK` queries on when the mask blocks by position
    /// (causal, windows, packed sequences: a chunk skips the keys its rows cannot see) or
    /// the device does not differentiate (a chunk's scores are freed before the next one's
    /// exist; under autodiff every chunk's are kept for the backward pass, so chunking
    /// would only add launches).
    Explicit { chunk: usize },
    /// The GPU kernels of our own (`gpu`): a CubeCL device (wgpu, cuda), every float
    /// tensor of one dtype, f32, f16 or bf16 (computing in f32), every mask kind; with autodiff or not, the backward pass recomputing
    /// the weights.
    #[cfg(feature = "gpu-kernels")]
    Gpu,
    /// The explicit path in one pass, keeping the weights: they are returned, or dropout
    /// acts on them (whatever the backend: only this path has the weights).
    Weights,
    /// Nothing to compute, on every backend and whatever else the call asks: no key
    /// (`Tk = 0`, every row fully blocked: zeros) or no output element (`B`, `H`, `Tq` or
    /// `Dv` is 0). Zeros without a Burn operation on an empty tensor (see
    /// `attention::empty`), the weights where they exist.
    Empty,
}

/// What the path of an attention call depends on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttentionCall {
    #[cfg(any(feature = "cpu-kernels", feature = "gpu-kernels"))]
    backend: Backend,
    autodiff: bool,
    /// Every float tensor (a learned position table too) is f32, the boolean mask is
    /// stored as bytes and the queries and keys have features: what the CPU tiles take.
    #[cfg(feature = "cpu-kernels")]
    f32_bytes: bool,
    /// Every float tensor (a learned position table too) is of one dtype, f32, f16 or
    /// bf16, the head dims are not 0 and the kernels' tiles for them fit the device's
    /// shared memory, and every tensor is small enough for the kernels' 32-bit indices:
    /// what the GPU kernels take.
    #[cfg(feature = "gpu-kernels")]
    gpu_kernels: bool,
    /// The storage buffers the device binds to one kernel (0 off the CubeCL devices): the
    /// GPU kernels need [`crate::gpu::MOST_BINDINGS`].
    #[cfg(feature = "gpu-kernels")]
    gpu_bindings: u32,
    queries: usize,
    /// No key, or no output element.
    empty: bool,
    /// The mask blocks by position.
    by_position: bool,
    /// The weights are returned or dropout acts on them.
    weights: bool,
}

impl AttentionCall {
    /// The call over `query` `[B, H, Tq, Dk]`, `key`, `value` and `mask`; `weights` when
    /// the weights are returned or dropout acts on them.
    pub(crate) fn of(
        [query, key, value]: [&Tensor<4>; 3],
        mask: &AttentionMask,
        weights: bool,
    ) -> Self {
        let dims = [query, key, value].map(Tensor::dims);
        let dtypes = [query, key, value].map(Tensor::dtype);
        Self::over(&query.device(), dims, dtypes, mask, weights)
    }

    /// The call over a query, key and value of `dims` `[[B, H, Tq, Dk], [B, Hkv, Tk, Dk],
    /// [B, Hkv, Tk, Dv]]` and `dtypes` on `device` (as [`of`](Self::of), for tensors
    /// not yet cut from the one that holds them).
    pub(crate) fn over(
        device: &Device,
        dims: [[usize; 4]; 3],
        dtypes: [DType; 3],
        mask: &AttentionMask,
        weights: bool,
    ) -> Self {
        let [q_dims, _, v_dims] = dims;
        #[cfg(any(feature = "cpu-kernels", feature = "gpu-kernels"))]
        let backend = Backend::of(device);
        let floats = dtypes
            .into_iter()
            .chain(mask.additive_bias().map(Tensor::dtype));
        // A learned position table and the sinks are read by the kernels' operation too,
        // in its dtype.
        let learned = match mask.position() {
            Some(crate::PositionBias::Learned { table, .. }) => Some(table.dtype()),
            _ => None,
        };
        let sinks = mask.sink_logits().map(|sinks| sinks.dtype());
        let table = [learned, sinks].into_iter().flatten();
        Self {
            #[cfg(any(feature = "cpu-kernels", feature = "gpu-kernels"))]
            backend,
            #[cfg(feature = "gpu-kernels")]
            gpu_bindings: match backend {
                Backend::Gpu => gpu_bindings(device.as_dispatch()),
                _ => 0,
            },
            autodiff: device.is_autodiff(),
            #[cfg(feature = "cpu-kernels")]
            f32_bytes: {
                // And queries and keys with features: the tiles' panels have none to cut.
                let f32 = floats.clone().all(|t| t == DType::F32)
                    && table.clone().all(|t| t == DType::F32)
                    && q_dims[3] > 0;
                let bool_bytes = mask.blocked().is_none_or(|blocked| {
                    matches!(
                        blocked.dtype(),
                        DType::Bool(burn::tensor::BoolStore::Native | burn::tensor::BoolStore::U8)
                    )
                });
                f32 && bool_bytes
            },
            // The GPU kernels read one float dtype, f32, f16 or bf16, and compute in f32.
            #[cfg(feature = "gpu-kernels")]
            gpu_kernels: {
                let dtype = dtypes[0];
                let one_float = matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
                    && floats.clone().all(|t| t == dtype);
                let (d_k, d_v) = (q_dims[3], v_dims[3]);
                let table_too = table.clone().all(|t| t == dtype);
                let indexed = gpu_indexed(dims, mask);
                let heads = [d_k, d_v];
                let fit = || gpu_tiles_fit(device, heads, dtype.size(), device.is_autodiff());
                one_float && table_too && indexed && d_k > 0 && d_v > 0 && fit()
            },
            queries: q_dims[2],
            empty: {
                let [batch, heads, queries, _] = q_dims;
                let [_, _, keys, d_v] = v_dims;
                keys == 0 || [batch, heads, queries, d_v].contains(&0)
            },
            by_position: !mask.rule().is_none(),
            weights,
        }
    }
}

/// The storage buffers a CubeCL device binds to one kernel.
#[cfg(feature = "gpu-kernels")]
fn gpu_bindings(device: &DispatchDevice) -> u32 {
    #[allow(unreachable_patterns)] // Which variants exist depends on Burn's features.
    match device {
        DispatchDevice::Autodiff(inner) => gpu_bindings(inner),
        DispatchDevice::Cube(cube) => crate::gpu::max_bindings(cube),
        _ => 0,
    }
}

/// Whether the GPU kernels' tiles fit `device`'s shared memory at head dims `heads` in
/// elements of `size` bytes, the gradients' too with `backward` (false off the CubeCL
/// devices).
#[cfg(feature = "gpu-kernels")]
fn gpu_tiles_fit(device: &Device, heads: [usize; 2], size: usize, backward: bool) -> bool {
    fn of(device: &DispatchDevice, heads: [usize; 2], size: usize, backward: bool) -> bool {
        #[allow(unreachable_patterns)] // Which variants exist depends on Burn's features.
        match device {
            DispatchDevice::Autodiff(inner) => of(inner, heads, size, backward),
            DispatchDevice::Cube(cube) => crate::gpu::tiles_fit(cube, heads, size, backward),
            _ => false,
        }
    }
    of(device.as_dispatch(), heads, size, backward)
}

/// The most bytes a CubeCL device binds to one kernel as one buffer (0 off the CubeCL
/// devices).
#[cfg(feature = "gpu-kernels")]
pub(crate) fn gpu_largest_binding(device: &Device) -> u64 {
    fn of(device: &DispatchDevice) -> u64 {
        #[allow(unreachable_patterns)] // Which variants exist depends on Burn's features.
        match device {
            DispatchDevice::Autodiff(inner) => of(inner),
            DispatchDevice::Cube(cube) => crate::gpu::largest_binding(cube),
            _ => 0,
        }
    }
    of(device.as_dispatch())
}

#[cfg(feature = "gpu-kernels")]
/// Whether the GPU kernels' 32-bit indices reach every element of a call over `[query,
/// key, value]` shapes and `mask` (the bound `gpu::launch::Sizes` asserts, the bias's and
/// boolean mask's own sizes, and the partial sums of the gradients of a bias and of a
/// learned position table that autodiff tracks, which the backward pass computes): past
/// `i32::MAX` elements a call takes the explicit path. A bias or a table that is not
/// tracked (a constant, a frozen parameter) has no gradient, so no partial sums.
fn gpu_indexed(qkv: [[usize; 4]; 3], mask: &AttentionMask) -> bool {
    let table_grad = match mask.position() {
        Some(crate::PositionBias::Learned { table, .. }) => table.is_tracked(),
        _ => false,
    };
    gpu_indexed_dims(
        qkv,
        mask.additive_bias().map(|t| t.dims()),
        mask.blocked().map(|t| t.dims()),
        [
            mask.additive_bias().is_some_and(Tensor::is_tracked),
            table_grad,
        ],
    )
}

#[cfg(feature = "gpu-kernels")]
/// [`gpu_indexed`] of the sizes alone: the bias's and the boolean mask's dims, and whether
/// the partial sums of the bias's gradient and of a learned position table's count.
fn gpu_indexed_dims(
    [q, k, v]: [[usize; 4]; 3],
    bias: Option<[usize; 4]>,
    blocked: Option<[usize; 4]>,
    [bias_grad, table_grad]: [bool; 2],
) -> bool {
    use crate::gpu::launch::{bias_sums, most_query_blocks, table_sums};
    let within = |n: Option<usize>| n.is_some_and(|n| n <= i32::MAX as usize);
    let [batch, heads, queries, d_k] = q;
    let [_, kv_heads, keys, _] = k;
    let d_v = v[3];
    let qkv = (batch * heads.max(kv_heads))
        .checked_mul(queries + keys + 1)
        .and_then(|n| n.checked_mul((d_k + d_v).max(1)));
    let size = |dims: [usize; 4]| dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    let blocks = most_query_blocks(queries);
    let sums = [
        bias.filter(|_| bias_grad)
            .map(|dims| bias_sums([batch, heads, queries], blocks, dims)),
        table_grad.then(|| table_sums([batch, heads, queries, keys], blocks)),
    ];
    let parts = bias.into_iter().chain(blocked).map(size);
    within(qkv) && parts.chain(sums.into_iter().flatten()).all(within)
}

/// The path of an attention call.
pub(crate) fn attention(call: AttentionCall) -> AttentionPath {
    if call.empty {
        return AttentionPath::Empty;
    }
    if call.weights {
        return AttentionPath::Weights;
    }
    #[cfg(feature = "cpu-kernels")]
    if call.backend.has_cpu_kernels() && call.f32_bytes {
        return AttentionPath::Tiles;
    }
    #[cfg(feature = "gpu-kernels")]
    if call.backend == Backend::Gpu
        && call.gpu_kernels
        && call.gpu_bindings >= crate::gpu::MOST_BINDINGS
    {
        return AttentionPath::Gpu;
    }
    let long = call.queries >= 2 * MIN_CHUNK;
    let chunk = match long && (call.by_position || !call.autodiff) {
        true => MIN_CHUNK.max(call.queries.div_ceil(MAX_CHUNKS)),
        false => call.queries,
    };
    AttentionPath::Explicit { chunk }
}

/// Declares [`RowOp`] and, for the tests, `RowOp::ALL`, the list of every variant: a row
/// operation is registered here once.
macro_rules! row_ops {
    ($($(#[doc = $doc:literal])* $(#[cfg($cfg:meta)])? $op:ident,)*) => {
        /// An operation over rows with an operation of its own on the CPU backends.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(crate) enum RowOp {
            $($(#[doc = $doc])* $(#[cfg($cfg)])? $op,)*
        }

        impl RowOp {
            /// Every row operation (of this build): the dispatcher's tests go over this list.
            #[cfg(test)]
            const ALL: &[RowOp] = &[$($(#[cfg($cfg)])? RowOp::$op,)*];
        }
    };
}

row_ops! {
    /// `x W + b`.
    Linear,
    /// `GELU(x W + b)`, the feed-forward's first layer: one operation where it is ours.
    LinearGelu,
    /// Layer normalisation.
    LayerNorm,
    /// RMS normalisation (Llama's RMSNorm): in f32 whatever the input's dtype, as Hugging
    /// Face computes it.
    RmsNorm,
    /// The exact GELU.
    Gelu,
    /// `SiLU(g) · u`, the gated feed-forward's SwiGLU.
    SwiGlu,
    /// Cross-entropy over rows of logits.
    CrossEntropy,
    /// AdamW's step over a parameter (an optimizer's, outside autodiff).
    AdamW,
    /// AdamW's step over a state that keeps AMSGrad's maximum (saved by Burn's optimizer):
    /// always Burn's step, which has AMSGrad (ours has not).
    AdamWAmsgrad,
    /// The sum of the squares of a gradient's elements (gradient clipping's norm, outside
    /// autodiff).
    SquareSum,
    /// The sum of two tensors of one shape (a residual connection); asked only where the
    /// CPU kernels are built (elsewhere it is Burn's `+`).
    #[cfg(feature = "cpu-kernels")]
    Add,
}

/// How a row operation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RowPath {
    /// One operation of our own with its own backward (`ops`): flex and ndarray in f32.
    #[cfg(feature = "cpu-kernels")]
    Fused,
    /// Burn's operations in the input's dtype.
    Burn,
    /// Burn's operations in f32, the result cast back to the input's dtype.
    BurnInF32,
    /// The input has no element, on every backend: the output (empty, or for
    /// cross-entropy over no row, 0) without a Burn operation on an empty tensor (see
    /// `crate::empty`).
    Empty,
}

/// What the path of a row operation depends on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowCall {
    op: RowOp,
    #[cfg(feature = "cpu-kernels")]
    backend: Backend,
    dtype: DType,
    /// Another tensor of the call (a weight, a bias, the other summand, a moment) is of
    /// another dtype than the input.
    mixed: bool,
    /// The input has no element.
    empty: bool,
}

impl RowCall {
    /// `op` over `x`.
    pub(crate) fn of<const D: usize>(op: RowOp, x: &Tensor<D>) -> Self {
        Self {
            op,
            #[cfg(feature = "cpu-kernels")]
            backend: Backend::of(&x.device()),
            dtype: x.dtype(),
            mixed: false,
            empty: x.dims().contains(&0),
        }
    }

    /// The call empty where `empty` says so though its input is not (a linear layer
    /// without output features).
    pub(crate) fn empty_if(mut self, empty: bool) -> Self {
        self.empty |= empty;
        self
    }

    /// The call with the dtypes of its other tensors (a weight, a bias, the other
    /// summand, the moments): one unlike the input's makes it mixed, which our operations
    /// do not take.
    pub(crate) fn with(mut self, dtypes: impl IntoIterator<Item = DType>) -> Self {
        self.mixed |= dtypes.into_iter().any(|dtype| dtype != self.dtype);
        self
    }
}

/// The path of a row operation.
pub(crate) fn row(call: RowCall) -> RowPath {
    if call.empty {
        return RowPath::Empty;
    }
    #[cfg(feature = "cpu-kernels")]
    if call.backend.has_cpu_kernels()
        && call.dtype == DType::F32
        && !call.mixed
        && call.op != RowOp::AdamWAmsgrad
    {
        return RowPath::Fused;
    }
    match (call.op, call.dtype) {
        // Burn's layer norm sums the squares in the input's dtype: f16 overflows past 256,
        // and bf16 rounds the mean (PyTorch's accumulates both in f32).
        (RowOp::LayerNorm, DType::F16 | DType::BF16) => RowPath::BurnInF32,
        // Hugging Face's RMSNorm normalises in f32, then scales in the input's dtype.
        (RowOp::RmsNorm, DType::F16 | DType::BF16) => RowPath::BurnInF32,
        // PyTorch's GELU computes in f32 and rounds once: `1 + erf` in half precision
        // cancels for negative inputs (bf16's GELU(-3) was 44% off).
        (RowOp::Gelu | RowOp::LinearGelu, DType::F16 | DType::BF16) => RowPath::BurnInF32,
        _ => RowPath::Burn,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(backend: Backend, autodiff: bool, queries: usize, by_position: bool) -> AttentionCall {
        #[cfg(not(any(feature = "cpu-kernels", feature = "gpu-kernels")))]
        let _ = backend;
        AttentionCall {
            #[cfg(any(feature = "cpu-kernels", feature = "gpu-kernels"))]
            backend,
            autodiff,
            #[cfg(feature = "cpu-kernels")]
            f32_bytes: true,
            #[cfg(feature = "gpu-kernels")]
            gpu_kernels: true,
            #[cfg(feature = "gpu-kernels")]
            gpu_bindings: 31,
            queries,
            empty: false,
            by_position,
            weights: false,
        }
    }

    /// `op` over a non-empty input of `dtype` on `backend`.
    fn row_call(op: RowOp, backend: Backend, dtype: DType) -> RowCall {
        #[cfg(not(feature = "cpu-kernels"))]
        let _ = backend;
        RowCall {
            op,
            #[cfg(feature = "cpu-kernels")]
            backend,
            dtype,
            mixed: false,
            empty: false,
        }
    }

    /// Every backend kind compiled in.
    fn every_backend() -> Vec<Backend> {
        let mut backends = vec![Backend::Other];
        #[cfg(feature = "flex")]
        backends.push(Backend::Flex);
        #[cfg(feature = "ndarray")]
        backends.push(Backend::NdArray);
        #[cfg(feature = "gpu-kernels")]
        backends.push(Backend::Gpu);
        backends
    }

    #[test]
    fn calls_without_a_key_or_an_output_element_take_the_empty_path_everywhere() {
        for backend in every_backend() {
            for (autodiff, weights) in [(false, false), (true, false), (true, true)] {
                let call = AttentionCall {
                    empty: true,
                    weights,
                    ..call(backend, autodiff, 300, true)
                };
                assert_eq!(attention(call), AttentionPath::Empty);
            }
        }
    }

    #[test]
    fn the_explicit_path_chunks_long_causal_calls_and_long_calls_without_autodiff() {
        let whole = |queries| AttentionPath::Explicit { chunk: queries };
        for autodiff in [false, true] {
            for causal in [false, true] {
                // Short calls are one pass.
                let short = call(Backend::Other, autodiff, 255, causal);
                assert_eq!(attention(short), whole(255));
                let path = attention(call(Backend::Other, autodiff, 256, causal));
                match causal || !autodiff {
                    true => assert_eq!(path, AttentionPath::Explicit { chunk: 128 }),
                    false => assert_eq!(path, whole(256)),
                }
            }
        }
        // At most 16 chunks.
        let path = attention(call(Backend::Other, false, 4096, true));
        assert_eq!(path, AttentionPath::Explicit { chunk: 256 });
    }

    #[test]
    fn weights_and_dropout_take_the_weights_path_on_every_backend() {
        for backend in every_backend() {
            for queries in [1, 4096] {
                let call = AttentionCall {
                    weights: true,
                    ..call(backend, true, queries, true)
                };
                assert_eq!(attention(call), AttentionPath::Weights);
            }
        }
    }

    #[cfg(feature = "cpu-kernels")]
    #[test]
    fn the_cpu_backends_take_the_tiles_and_fused_rows_in_f32_only() {
        let mut backends = Vec::new();
        #[cfg(feature = "flex")]
        backends.push(Backend::Flex);
        #[cfg(feature = "ndarray")]
        backends.push(Backend::NdArray);
        for backend in backends {
            for autodiff in [false, true] {
                assert_eq!(
                    attention(call(backend, autodiff, 300, true)),
                    AttentionPath::Tiles
                );
                let other_dtypes = AttentionCall {
                    f32_bytes: false,
                    ..call(backend, autodiff, 300, true)
                };
                assert_eq!(
                    attention(other_dtypes),
                    AttentionPath::Explicit { chunk: 128 }
                );
            }
            for &op in RowOp::ALL {
                let empty = RowCall {
                    empty: true,
                    ..row_call(op, backend, DType::F32)
                };
                assert_eq!(row(empty), RowPath::Empty);
                // Ours in f32, but for a state of AMSGrad's, which only Burn's AdamW steps.
                let f32 = match op {
                    RowOp::AdamWAmsgrad => RowPath::Burn,
                    _ => RowPath::Fused,
                };
                assert_eq!(row(row_call(op, backend, DType::F32)), f32, "{op:?}");
                assert_eq!(row(row_call(op, backend, DType::F64)), RowPath::Burn);
                // A weight, bias, summand or moment of another dtype than the input:
                // Burn's, whose operations take mixed dtypes.
                let mixed = row_call(op, backend, DType::F32).with([DType::F16]);
                assert_eq!(row(mixed), RowPath::Burn, "{op:?}");
                let same = row_call(op, backend, DType::F32).with([DType::F32, DType::F32]);
                assert_eq!(row(same), f32, "{op:?}");
            }
        }
    }

    #[cfg(feature = "gpu-kernels")]
    #[test]
    fn calls_past_the_gpu_kernels_32_bit_indices_are_not_theirs() {
        let none = AttentionMask::none();
        let small = [1, 8, 16384, 128];
        assert!(gpu_indexed([small; 3], &none));
        // 64 x 32 heads x 8193 positions x 256 values: past i32::MAX elements.
        let large = [64, 32, 4096, 128];
        assert!(!gpu_indexed([large; 3], &none));
        // A bias shared by the batch, [1, H, T, T]: within i32 itself, but the partial sums
        // of its gradient hold one copy for each batch row: 7 rows of 2^28 elements are
        // within, 8 past, where a backward may follow (without one, within).
        let [seven, eight] = [7, 8].map(|batch| [[batch, 16, 4096, 64]; 3]);
        let shared = Some([1, 16, 4096, 4096]);
        assert!(gpu_indexed_dims(seven, shared, None, [true; 2]));
        assert!(!gpu_indexed_dims(eight, shared, None, [true, false]));
        assert!(gpu_indexed_dims(eight, shared, None, [false; 2]));
        // A learned table's sums: a row of every distance for each block of queries.
        let [one, many] = [1, 2].map(|batch| [[batch, 64, 16384, 64]; 3]);
        assert!(gpu_indexed_dims(one, None, None, [true; 2]));
        assert!(!gpu_indexed_dims(many, None, None, [true; 2]));
        assert!(gpu_indexed_dims(many, None, None, [true, false]));
    }

    /// Only a bias or a table that autodiff tracks has the partial sums of a gradient
    /// counted: a constant one (a padding bias, a frozen table) of the same sizes on an
    /// autodiff device keeps the kernels (where counting them sent it to the explicit
    /// path, which keeps every score for the backward pass).
    #[cfg(all(feature = "gpu-kernels", feature = "flex"))]
    #[test]
    fn untracked_biases_and_tables_count_no_gradient_sums() {
        let device = Device::flex().autodiff();
        // Broadcast views: the sizes the call sees, one element stored.
        let bias = |tracked: bool| {
            let one = Tensor::<4>::zeros([1, 1, 1, 1], &device).set_require_grad(tracked);
            AttentionMask::bias(one.expand([1, 16, 4096, 4096]))
        };
        let eight = [[8, 16, 4096, 64]; 3];
        assert!(gpu_indexed(eight, &bias(false)));
        // Tracked through the expand (not a leaf): its gradient's sums count.
        assert!(!gpu_indexed(eight, &bias(true)));
        let table = |tracked: bool| {
            let table = Tensor::<2>::zeros([1, 1], &device).set_require_grad(tracked);
            AttentionMask::position_bias(crate::PositionBias::Learned {
                table: table.expand([64, 31]),
                buckets: crate::positions::Buckets::Clipped { max: 15 },
            })
        };
        let many = [[2, 64, 16384, 64]; 3];
        assert!(gpu_indexed(many, &table(false)));
        assert!(!gpu_indexed(many, &table(true)));
    }

    #[test]
    fn half_precision_norms_and_gelu_run_in_f32_elsewhere() {
        for &op in RowOp::ALL {
            let row_of = |dtype| row(row_call(op, Backend::Other, dtype));
            assert_eq!(row_of(DType::F32), RowPath::Burn);
            // Both norms in both halves: Burn's layer norm overflows past 256 in f16 and
            // rounds its mean in bf16 (PyTorch's accumulates in f32); Hugging Face's RMS
            // norm normalises in f32; PyTorch's GELU computes in f32.
            let [f16, bf16] = match op {
                RowOp::LayerNorm | RowOp::RmsNorm | RowOp::Gelu | RowOp::LinearGelu => {
                    [RowPath::BurnInF32; 2]
                }
                _ => [RowPath::Burn; 2],
            };
            assert_eq!(row_of(DType::F16), f16, "{op:?}");
            assert_eq!(row_of(DType::BF16), bf16, "{op:?}");
        }
    }

    #[cfg(feature = "flex")]
    #[test]
    fn flex_devices_are_flex_with_autodiff_or_not() {
        use burn::tensor::Distribution;
        for device in [Device::flex(), Device::flex().autodiff()] {
            assert_eq!(Backend::of(&device), Backend::Flex);
            assert!(cpu_pool(&device));
            let x = Tensor::<4>::random([1, 2, 300, 4], Distribution::Default, &device);
            let causal = AttentionMask::causal();
            let call = AttentionCall::of([&x, &x, &x], &causal, false);
            assert_eq!(attention(call), AttentionPath::Tiles);
            let x64 = x.clone().cast(DType::F64);
            let call = AttentionCall::of([&x, &x64, &x], &causal, false);
            assert!(!call.f32_bytes);
            let bias = AttentionMask::bias(x64.slice([0..1, 0..1, 0..300, 0..1]));
            let call = AttentionCall::of([&x, &x, &x], &bias, false);
            assert!(!call.f32_bytes && !call.by_position);
            assert_eq!(call.autodiff, device.is_autodiff());
            // A learned position table is read by the tiles too: in f32 only.
            let table = |dtype| {
                AttentionMask::position_bias(crate::PositionBias::Learned {
                    table: Tensor::<2>::zeros([2, 9], &device).cast(dtype),
                    buckets: crate::Buckets::Clipped { max: 4 },
                })
            };
            let call = AttentionCall::of([&x, &x, &x], &table(DType::F32), false);
            assert_eq!(attention(call), AttentionPath::Tiles);
            let call = AttentionCall::of([&x, &x, &x], &table(DType::F64), false);
            assert!(!call.f32_bytes);
            assert!(matches!(attention(call), AttentionPath::Explicit { .. }));
        }
    }

    #[cfg(feature = "ndarray")]
    #[allow(deprecated)] // Burn 0.22 deprecates ndarray; it is still one of our backends.
    #[test]
    fn ndarray_devices_are_ndarray_and_take_the_tiles() {
        for device in [Device::ndarray(), Device::ndarray().autodiff()] {
            assert_eq!(Backend::of(&device), Backend::NdArray);
            let x = Tensor::<4>::zeros([1, 1, 3, 4], &device);
            let mask = AttentionMask::key_lengths(&[2], 3, &device);
            let call = AttentionCall::of([&x, &x, &x], &mask, false);
            assert_eq!(attention(call), AttentionPath::Tiles);
        }
    }

    #[cfg(feature = "gpu-kernels")]
    #[test]
    fn devices_binding_too_few_buffers_for_the_gpu_kernels_take_the_explicit_path() {
        let fits = call(Backend::Gpu, true, 100, true);
        assert_eq!(attention(fits), AttentionPath::Gpu);
        let enough = AttentionCall {
            gpu_bindings: crate::gpu::MOST_BINDINGS,
            ..fits
        };
        assert_eq!(attention(enough), AttentionPath::Gpu);
        // A browser's WebGPU: 8 storage buffers per stage, 7 of them CubeCL's.
        let browser = AttentionCall {
            gpu_bindings: 7,
            ..fits
        };
        assert_eq!(attention(browser), AttentionPath::Explicit { chunk: 100 });
    }

    #[cfg(feature = "wgpu")]
    #[test]
    fn wgpu_devices_take_the_gpu_kernels_in_one_float_dtype() {
        let device = Device::wgpu(burn::tensor::DeviceKind::DefaultDevice);
        for device in [device.clone(), device.autodiff()] {
            assert_eq!(Backend::of(&device), Backend::Gpu);
            #[cfg(feature = "cpu-kernels")]
            assert!(!cpu_pool(&device));
            // Read from the device: lavapipe binds 31.
            let bindings = gpu_bindings(device.as_dispatch());
            assert!(bindings >= crate::gpu::MOST_BINDINGS, "{bindings}");
            let x = Tensor::<4>::zeros([1, 1, 3, 4], &device);
            let path = |mask: &AttentionMask, x: &Tensor<4>| {
                attention(AttentionCall::of([x, x, x], mask, false))
            };
            let causal = AttentionMask::causal();
            assert_eq!(path(&causal, &x), AttentionPath::Gpu);
            assert_eq!(
                path(&AttentionMask::sliding_window(2), &x),
                AttentionPath::Gpu
            );
            let bias = AttentionMask::bias(Tensor::<4>::zeros([1, 1, 3, 3], &device));
            assert_eq!(
                path(&bias.clone().and(causal.clone()), &x),
                AttentionPath::Gpu
            );
            let packed = AttentionMask::packed(&[vec![0, 2, 3]]);
            assert_eq!(path(&packed, &x), AttentionPath::Gpu);
            let alibi =
                AttentionMask::position_bias(crate::PositionBias::Alibi { slopes: vec![0.5] });
            assert_eq!(path(&alibi, &x), AttentionPath::Gpu);
            if device.is_autodiff() {
                let tracked = Tensor::<4>::zeros([1, 1, 3, 3], &device).require_grad();
                assert_eq!(path(&AttentionMask::bias(tracked), &x), AttentionPath::Gpu);
            }
            // f16 too (wgpu has no bf16 arithmetic), but not mixed dtypes.
            let half = x.clone().cast(DType::F16);
            let call = AttentionCall::of([&half, &half, &half], &causal, false);
            assert_eq!(attention(call), AttentionPath::Gpu);
            let call = AttentionCall::of([&half, &x, &half], &causal, false);
            assert_eq!(attention(call), AttentionPath::Explicit { chunk: 3 });
            assert_eq!(row(RowCall::of(RowOp::Gelu, &x)), RowPath::Burn);
        }
    }
}
