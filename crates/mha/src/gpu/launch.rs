//! What every kernel launch shares: the tensors of a call as bindings, how its scores are
//! made, the compile-time variant of a kernel, and the run-time arguments of a band.

use cubecl::client::Client;
use cubecl::prelude::*;
use cubecl::server::Handle;

use crate::mask::Band;

/// The most storage buffers one launch binds: `dkv_kernel`'s twelve tensors (an absent
/// optional tensor is bound as a placeholder) and the buffer CubeCL passes the sizes and
/// scalars in. A device that binds fewer to a kernel (a browser's WebGPU binds 8 per
/// stage, of which CubeCL offers 7) takes the explicit path instead (`dispatch`).
pub(crate) const MOST_BINDINGS: u32 = 13;

/// Units per cube: query rows of the forward pass and of `dQ`, key rows of `dK`/`dV`.
pub(crate) const UNITS: usize = 32;
/// Shared memory a cube stages its tiles in, in f32s (16 KiB: half of what the smallest
/// devices give).
const STAGE: usize = 4096;

/// How the scores are made from `Q Kᵀ`, and which keys each query sees.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Scoring {
    /// Multiplies the queries.
    pub(crate) scale: f32,
    /// `cap · tanh(s / cap)` on the scaled scores, before the bias.
    pub(crate) softcap: Option<f32>,
    /// The keys of each query.
    pub(crate) band: Band,
}

/// The tensors of one call, as bindings: `[query, key, value]` (`[B, H, Tq, Dk]`, `[B, Hkv,
/// Tk, Dk]`, `[B, Hkv, Tk, Dv]`), an additive f32 `bias` and a u32 `mask` (nonzero =
/// blocked), each of rank 4 and broadcastable to `[B, H, Tq, Tk]` (an axis of size 1 is
/// read with stride 0); a bias by distance `pd` (f32 `[1, 1, H, Tq + Tk - 1]`, column `c`
/// for the distance `c - (Tq - 1)` from a query's row to a key's) and packed sequences'
/// bounds `seq` (i32 `[B, 1, T, 2]`, see `Visibility::sequences`).
pub(crate) struct Inputs {
    /// The float tensors' element type (f32, f16 or bf16): the kernels compute in f32 and
    /// read and write this one.
    pub(crate) elem: ElemType,
    /// Its size in bytes.
    pub(crate) size: usize,
    /// A row whose largest score is at or below this has no visible key (the dtype's
    /// sentinel, see `crate::mask::Sentinels`).
    pub(crate) dead_row: f32,
    pub(crate) qkv: [TensorBinding; 3],
    pub(crate) bias: Option<TensorBinding>,
    pub(crate) pd: Option<TensorBinding>,
    pub(crate) mask: Option<TensorBinding>,
    pub(crate) seq: Option<TensorBinding>,
}

/// The compile-time shape of a kernel: each distinct value compiles once.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Variant {
    pub(crate) d_k: usize,
    pub(crate) d_v: usize,
    /// Rows per staged tile (keys in the forward pass and `dQ`, queries in `dK`/`dV`).
    pub(crate) tile: usize,
    pub(crate) bias: bool,
    pub(crate) pd: bool,
    pub(crate) mask: bool,
    pub(crate) seq: bool,
}

impl Variant {
    /// The variant of a call of sizes `n` over `inputs`: as many rows per tile as fit
    /// [`STAGE`], at most [`UNITS`] and at least one.
    pub(crate) fn of(n: &Sizes, inputs: &Inputs) -> Self {
        let tile = (STAGE / (n.d_k + n.d_v).max(1)).clamp(1, UNITS);
        Self {
            d_k: n.d_k,
            d_v: n.d_v,
            tile,
            bias: inputs.bias.is_some(),
            pd: inputs.pd.is_some(),
            mask: inputs.mask.is_some(),
            seq: inputs.seq.is_some(),
        }
    }
}

/// The sizes of one call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sizes {
    pub(crate) batch: usize,
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    pub(crate) queries: usize,
    pub(crate) keys: usize,
    pub(crate) d_k: usize,
    pub(crate) d_v: usize,
}

impl Sizes {
    /// The sizes of `[query, key, value]`.
    ///
    /// # Panics
    /// If the shapes disagree or a size passes `i32`.
    pub(crate) fn of([q, k, v]: [&TensorBinding; 3]) -> Self {
        let [batch, heads, queries, d_k] = dims(q);
        let [_, kv_heads, keys, _] = dims(k);
        let d_v = dims(v)[3];
        assert!(
            kv_heads > 0 && heads.is_multiple_of(kv_heads) && dims(k)[3] == d_k,
            "gpu attention: query {:?}, key {:?}, value {:?}",
            q.shape,
            k.shape,
            v.shape
        );
        within(batch * heads.max(kv_heads) * (queries + keys + 1) * (d_k + d_v).max(1));
        Self {
            batch,
            heads,
            kv_heads,
            queries,
            keys,
            d_k,
            d_v,
        }
    }

    /// The run-time arguments of `band`: the offset and the keys seen before and after the
    /// own position, with "every key" as a bound larger than any distance of the call.
    pub(crate) fn band(&self, band: Band) -> [i32; 3] {
        let far = within(self.queries + self.keys + 1);
        let side =
            |n: Option<usize>| n.map_or(far, |n| within(n.min(self.queries + self.keys + 1)));
        let offset = i32::try_from(band.offset.clamp(-(far as i64), far as i64)).expect("clamped");
        [offset, side(band.before), side(band.after)]
    }

    /// `H / Hkv`.
    pub(crate) fn group(&self) -> u32 {
        (self.heads / self.kv_heads) as u32
    }
}

/// `n` as an `i32`, the kernels' index type for positions.
///
/// # Panics
/// Past `i32::MAX`.
pub(crate) fn within(n: usize) -> i32 {
    i32::try_from(n).expect("gpu attention: a size past i32")
}

/// The four sizes of a rank-4 binding.
pub(crate) fn dims(t: &TensorBinding) -> [usize; 4] {
    assert!(
        t.shape.len() == 4,
        "gpu attention: a tensor of shape {:?}",
        t.shape
    );
    std::array::from_fn(|axis| t.shape[axis])
}

/// A new buffer of `shape` in elements of `size` bytes, laid out contiguously.
pub(crate) fn alloc(client: &Client, shape: [usize; 4], size: usize) -> Handle {
    client.empty(shape.iter().product::<usize>() * size)
}

/// The element type, its size and its dead-row sentinel for the float tensors of a call
/// in `dtype`.
///
/// # Panics
/// Unless `dtype` is f32, f16 or bf16.
pub(crate) fn element(dtype: burn::tensor::DType) -> (ElemType, usize, f32) {
    use burn::tensor::DType;
    let kind = match dtype {
        DType::F32 => cubecl::ir::FloatKind::F32,
        DType::F16 => cubecl::ir::FloatKind::F16,
        DType::BF16 => cubecl::ir::FloatKind::BF16,
        other => panic!("gpu attention: tensors of {other:?}"),
    };
    let dead_row = crate::mask::Sentinels::of(dtype).dead_row;
    (ElemType::Float(kind), dtype.size(), dead_row)
}

/// `handle` as a contiguous tensor of `shape`.
pub(crate) fn contiguous(shape: [usize; 4], handle: &Handle) -> TensorArg {
    let strides = [
        shape[1] * shape[2] * shape[3],
        shape[2] * shape[3],
        shape[3],
        1,
    ];
    // SAFETY: `handle` was allocated for `shape`'s elements, laid out contiguously.
    unsafe {
        TensorArg::from_raw_parts(
            handle.clone(),
            strides.to_vec().into(),
            shape.to_vec().into(),
        )
    }
}

/// `t` as a kernel argument, read as broadcast along its axes of size 1; a one-element
/// placeholder where the call has no such tensor (the kernel, compiled without it, never
/// reads it).
pub(crate) fn optional(client: &Client, t: Option<&TensorBinding>) -> TensorArg {
    match t {
        Some(t) => broadcast(t.clone()).into_tensor_arg(),
        None => {
            let handle = client.create_from_slice(u32::as_bytes(&[0]));
            contiguous([1, 1, 1, 1], &handle)
        }
    }
}

/// `t` with stride 0 along its axes of size 1, so that the kernel reads it as broadcast.
fn broadcast(mut t: TensorBinding) -> TensorBinding {
    let shape = dims(&t);
    let strides: Vec<usize> = (0..4)
        .map(|axis| if shape[axis] == 1 { 0 } else { t.strides[axis] })
        .collect();
    t.strides = strides.into();
    t
}

/// # Panics
/// Unless `t` is a contiguous tensor of `shape` (what the kernels write and read back).
pub(crate) fn assert_contiguous(what: &str, t: &TensorBinding, shape: [usize; 4]) {
    let strides = [
        shape[1] * shape[2] * shape[3],
        shape[2] * shape[3],
        shape[3],
        1,
    ];
    let laid_out = (0..4).all(|a| shape[a] <= 1 || t.strides[a] == strides[a]);
    assert!(
        dims(t) == shape && laid_out,
        "gpu attention: the {what} has shape {:?} and strides {:?}, want {shape:?} contiguous",
        t.shape,
        t.strides
    );
}
