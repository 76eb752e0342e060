//! Typed attention masks.
//!
//! Every library that does attention has its own convention for "masked": PyTorch's
//! `nn.MultiheadAttention` and Burn use `true = blocked`, PyTorch's
//! `scaled_dot_product_attention` uses `true = may attend`, tokenisers hand out lengths,
//! and relative-position schemes (ALiBi, T5) hand out an additive float bias. An
//! [`AttentionMask`] is one value that says what is blocked, built by a constructor named
//! after the convention the caller came from, so the convention is never guessed.
//!
//! Masks compose with [`AttentionMask::and`]: a key is blocked if any part blocks it, and
//! additive biases add. A query row whose every key is blocked yields zeros (output and
//! weights) with finite gradients, where a plain softmax would yield NaN.
//!
//! Broadcasting follows NumPy/PyTorch: a mask or bias of rank below 4 is aligned to the
//! right of `[B, H, Tq, Tk]` (so `[Tq, Tk]` applies to every batch and head), and every
//! axis is either the full size or 1.

use std::ops::Range;

use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};

/// What a query may not attend to; see the [module docs](self).
///
/// # Causal alignment
///
/// The causal part is aligned to the bottom-right corner of the `[Tq, Tk]` score matrix:
/// query `i` sees keys `j <= i + (Tk - Tq)`. With `Tq == Tk` that is the usual lower
/// triangle; with a cache (`Tq < Tk`) the last query sees every key, which is what
/// incremental decoding needs. This is Burn's fused-op convention and FlashAttention's;
/// PyTorch's `is_causal` aligns top-left instead, which only differs when `Tq != Tk`.
/// When `Tq > Tk` the first `Tq - Tk` queries have no visible key and yield zeros.
#[derive(Clone, Debug, Default)]
pub struct AttentionMask {
    causal: bool,
    /// `true = blocked`, rank 4, broadcastable to `[B, H, Tq, Tk]`.
    blocked: Option<Tensor<4, Bool>>,
    /// Added to the scores, rank 4, broadcastable to `[B, H, Tq, Tk]`.
    bias: Option<Tensor<4>>,
}

impl AttentionMask {
    /// Nothing is blocked.
    pub fn none() -> Self {
        Self::default()
    }

    /// Each query sees itself and earlier keys (bottom-right aligned, see the type docs).
    pub fn causal() -> Self {
        Self {
            causal: true,
            ..Self::default()
        }
    }

    /// A boolean mask where `true` means **blocked**: the convention of PyTorch's
    /// `nn.MultiheadAttention(attn_mask=...)` with a bool mask, and of Burn.
    ///
    /// # Shapes
    /// - `mask`: broadcastable to `[B, H, Tq, Tk]`, e.g. `[Tq, Tk]` or `[B, 1, Tq, Tk]`.
    ///
    /// # Panics
    /// If `D > 4`.
    pub fn blocking<const D: usize>(mask: Tensor<D, Bool>) -> Self {
        Self {
            blocked: Some(to_rank4(mask, "AttentionMask::blocking")),
            ..Self::default()
        }
    }

    /// A boolean mask where `true` means **may attend**: the convention of PyTorch's
    /// `F.scaled_dot_product_attention(attn_mask=...)` with a bool mask.
    ///
    /// # Shapes
    /// - `mask`: broadcastable to `[B, H, Tq, Tk]`.
    ///
    /// # Panics
    /// If `D > 4`.
    pub fn attending<const D: usize>(mask: Tensor<D, Bool>) -> Self {
        Self::blocking(mask.bool_not())
    }

    /// Key padding where `true` means **padding** (blocked): PyTorch's
    /// `key_padding_mask` and Burn's `mask_pad`.
    ///
    /// # Shapes
    /// - `padding`: `[B, Tk]`.
    pub fn key_padding(padding: Tensor<2, Bool>) -> Self {
        let [batch, keys] = padding.dims();
        Self::blocking(padding.reshape([batch, 1, 1, keys]))
    }

    /// Key padding from the number of valid keys of each sequence in the batch: keys
    /// `lengths[b]..key_len` of sequence `b` are blocked.
    ///
    /// # Shapes
    /// - result: blocks `[B, 1, 1, key_len]` with `B = lengths.len()`.
    ///
    /// # Panics
    /// If a length exceeds `key_len`, naming the index and both values.
    pub fn key_lengths(lengths: &[usize], key_len: usize, device: &Device) -> Self {
        let mut blocked = Vec::with_capacity(lengths.len() * key_len);
        for (b, &len) in lengths.iter().enumerate() {
            assert!(
                len <= key_len,
                "AttentionMask::key_lengths: lengths[{b}] = {len} exceeds key_len = {key_len}"
            );
            blocked.extend((0..key_len).map(|j| j >= len));
        }
        let data = TensorData::new(blocked, [lengths.len(), 1, 1, key_len]);
        Self::blocking(Tensor::<4, Bool>::from_data(data, device))
    }

    /// An additive bias on the scores (after scaling): ALiBi, relative positions, or
    /// PyTorch's float `attn_mask`. An entry of `-inf` blocks that key like a boolean mask.
    ///
    /// # Shapes
    /// - `bias`: broadcastable to `[B, H, Tq, Tk]`.
    ///
    /// # Panics
    /// If `D > 4`.
    pub fn bias<const D: usize>(bias: Tensor<D>) -> Self {
        Self {
            bias: Some(to_rank4(bias, "AttentionMask::bias")),
            ..Self::default()
        }
    }

    /// Both masks at once: a key is blocked if either blocks it; biases add.
    pub fn and(self, other: Self) -> Self {
        Self {
            causal: self.causal || other.causal,
            blocked: merge(self.blocked, other.blocked, |a, b| a.bool_or(b)),
            bias: merge(self.bias, other.bias, |a, b| a + b),
        }
    }

    /// Whether the mask has a causal part.
    pub fn is_causal(&self) -> bool {
        self.causal
    }

    /// Whether nothing is blocked and there is no bias.
    pub fn is_none(&self) -> bool {
        !self.causal && self.blocked.is_none() && self.bias.is_none()
    }

    /// The boolean part (`true = blocked`), without the causal part, rank 4 broadcastable
    /// to `[B, H, Tq, Tk]`.
    pub fn blocked(&self) -> Option<&Tensor<4, Bool>> {
        self.blocked.as_ref()
    }

    /// The additive part, rank 4 broadcastable to `[B, H, Tq, Tk]`.
    pub fn additive_bias(&self) -> Option<&Tensor<4>> {
        self.bias.as_ref()
    }

    /// Checks that the boolean and additive parts broadcast to `[B, H, Tq, Tk]`.
    ///
    /// # Panics
    /// Naming the part, its shape and the target shape, if they do not broadcast.
    pub(crate) fn check(&self, target: [usize; 4]) {
        if let Some(blocked) = &self.blocked {
            check_broadcast("boolean mask", blocked.dims(), target);
        }
        if let Some(bias) = &self.bias {
            check_broadcast("additive bias", bias.dims(), target);
        }
    }

    /// Everything that blocks, causal part included, as one boolean tensor
    /// broadcastable to `[B, H, Tq, Tk]`; `None` when nothing blocks.
    pub fn to_blocked(
        &self,
        queries: usize,
        keys: usize,
        device: &Device,
    ) -> Option<Tensor<4, Bool>> {
        let causal = self.visibility(queries, keys).blocked(device);
        merge(self.blocked.clone(), causal, |a, b| a.bool_or(b))
    }

    /// Which keys each query of a `[Tq, Tk]` problem sees under the causal part.
    pub(crate) fn visibility(&self, queries: usize, keys: usize) -> Visibility {
        Visibility {
            queries,
            keys,
            causal: self.causal,
        }
    }

    /// The mask of the sub-problem made of query rows `rows` and the first `visible` keys
    /// of a `[.., queries, keys]` problem: the causal flag is kept (its bottom-right
    /// alignment carries over when `visible` is what the last row sees, see
    /// [`Visibility::keys_of`]), the boolean and additive parts are sliced where they are
    /// not broadcast.
    pub(crate) fn rows_and_keys(
        &self,
        rows: Range<usize>,
        visible: usize,
        [queries, keys]: [usize; 2],
    ) -> Self {
        let cut = |dims: [usize; 4]| {
            let [b, h, tq, tk] = dims;
            let r = match tq == queries && tq > 1 {
                true => rows.clone(),
                false => 0..tq,
            };
            let c = match tk == keys && tk > 1 {
                true => 0..visible,
                false => 0..tk,
            };
            [0..b, 0..h, r, c]
        };
        Self {
            causal: self.causal,
            blocked: self
                .blocked
                .as_ref()
                .map(|t| t.clone().slice(cut(t.dims()))),
            bias: self.bias.as_ref().map(|t| t.clone().slice(cut(t.dims()))),
        }
    }
}

/// The causal rule, bottom-right aligned (see [`AttentionMask`]): query `i` of `Tq` sees
/// key `j` of `Tk` when `j <= i + (Tk - Tq)`; without a causal part, every key. Every path
/// asks it: the explicit path's boolean mask and query chunks, the CPU tiles' masks, the
/// tiles they skip above the diagonal and their backward's key ranges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Visibility {
    /// `Tq`.
    pub(crate) queries: usize,
    /// `Tk`.
    pub(crate) keys: usize,
    /// Whether the causal rule applies.
    pub(crate) causal: bool,
}

impl Visibility {
    /// `Tk - Tq`: the last key query `i` sees is `i + offset`.
    fn offset(self) -> i64 {
        self.keys as i64 - self.queries as i64
    }

    /// How many keys query `query` sees: keys `0..keys_of(query)`.
    pub(crate) fn keys_of(self, query: usize) -> usize {
        match self.causal {
            true => (query as i64 + 1 + self.offset()).clamp(0, self.keys as i64) as usize,
            false => self.keys,
        }
    }

    /// The first query that sees key `key` (`Tq` when none does).
    pub(crate) fn first_query(self, key: usize) -> usize {
        match self.causal {
            true => (key as i64 - self.offset()).clamp(0, self.queries as i64) as usize,
            false => 0,
        }
    }

    /// The causal part as a `[1, 1, Tq, Tk]` tensor, `true` where blocked; `None` without
    /// one.
    fn blocked(self, device: &Device) -> Option<Tensor<4, Bool>> {
        if !self.causal {
            return None;
        }
        let (queries, keys, offset) = (self.queries, self.keys, self.offset());
        // Key j is blocked for query i when j > i + offset.
        let last = Tensor::<1, Int>::arange(offset..offset + queries as i64, device);
        let key = Tensor::<1, Int>::arange(0..keys as i64, device).reshape([1, keys]);
        let blocked = key.greater(last.reshape([queries, 1]));
        Some(blocked.reshape([1, 1, queries, keys]))
    }
}

/// Scores at or below [`DEAD_ROW`] count as blocked. Blocked f32 scores are set to
/// [`BLOCKED`], a finite value, so that a row whose every key is blocked has a finite
/// softmax (and finite gradients), which is then zeroed; the CPU tiles give such a row the
/// log-sum-exp [`DEAD_LSE`], which recomputes every weight of the row to
/// `exp(BLOCKED - DEAD_LSE) = 0`. [`Sentinels::of`] gives the values of other dtypes.
pub(crate) const BLOCKED: f32 = -1.0e30;
/// See [`BLOCKED`].
pub(crate) const DEAD_ROW: f32 = -5.0e29;
/// See [`BLOCKED`].
pub(crate) const DEAD_LSE: f32 = 1.0e30;

/// The blocked-score sentinels of one float dtype: [`BLOCKED`] and [`DEAD_ROW`] where
/// they fit (f32, f64, bf16); for f16, whose largest finite value is 65504, `-2^14` and
/// `-2^13` (a score plus `-2^14` stays finite, and a real score of `-2^13` or below counts
/// as blocked).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Sentinels {
    /// What a blocked score is set to.
    pub(crate) blocked: f32,
    /// A row whose largest score is at or below this has no visible key.
    pub(crate) dead_row: f32,
}

impl Sentinels {
    /// The sentinels of `dtype`.
    pub(crate) fn of(dtype: DType) -> Self {
        match dtype {
            DType::F16 => Self {
                blocked: -16384.0,
                dead_row: -8192.0,
            },
            _ => Self {
                blocked: BLOCKED,
                dead_row: DEAD_ROW,
            },
        }
    }
}

fn merge<T>(a: Option<T>, b: Option<T>, f: impl FnOnce(T, T) -> T) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(f(a, b)),
        (a, b) => a.or(b),
    }
}

fn to_rank4<const D: usize, K: burn::tensor::kind::Basic>(
    tensor: Tensor<D, K>,
    what: &str,
) -> Tensor<4, K> {
    assert!(
        D <= 4,
        "{what}: expected a tensor of rank at most 4, got rank {D}"
    );
    tensor.unsqueeze::<4>()
}

fn check_broadcast(what: &str, dims: [usize; 4], target: [usize; 4]) {
    let fits = dims.iter().zip(target).all(|(&d, t)| d == t || d == 1);
    assert!(
        fits,
        "attention mask: the {what} of shape {dims:?} does not broadcast to the scores [B, H, Tq, Tk] = {target:?}"
    );
}
