//! Typed attention masks.
//!
//! Every library that does attention has its own convention for "masked": PyTorch's
//! `nn.MultiheadAttention` and Burn use `true = blocked`, PyTorch's
//! `scaled_dot_product_attention` uses `true = may attend`, tokenisers hand out lengths,
//! and relative-position schemes (ALiBi, T5) hand out an additive float bias. An
//! [`AttentionMask`] is one value that says what is blocked, built by a constructor named
//! after the convention the caller came from, so the convention is never guessed.
//!
//! Besides tensors, a mask can block by position, without any `[Tq, Tk]` tensor: causal
//! (aligned bottom-right or top-left), a sliding window, a local window, packed sequences.
//! Every path reads these through one rule (`Visibility`): each query sees one
//! contiguous range of keys, and the CPU tiles skip every block outside it.
//!
//! Masks compose with [`AttentionMask::and`]: a key is blocked if any part blocks it, and
//! additive biases add. A query row whose every key is blocked yields zeros (output and
//! weights) with finite gradients, where a plain softmax would yield NaN.
//!
//! Broadcasting follows NumPy/PyTorch: a mask or bias of rank below 4 is aligned to the
//! right of `[B, H, Tq, Tk]` (so `[Tq, Tk]` applies to every batch and head), and every
//! axis is either the full size or 1.

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::{Bool, DType, Device, FloatDType, Tensor, TensorData};

use crate::positions::PositionBias;

mod geometry;

#[cfg(feature = "gpu-kernels")]
pub(crate) use geometry::Band;
#[cfg(any(feature = "cpu-kernels", feature = "gpu-kernels"))]
pub(crate) use geometry::DEAD_LSE;
pub(crate) use geometry::{BLOCKED, DEAD_ROW, Visibility, blocked_score};

/// What a query may not attend to; see the [module docs](self).
///
/// # Causal alignment
///
/// By default the causal part is aligned to the bottom-right corner of the `[Tq, Tk]`
/// score matrix: query `i` sees keys `j <= i + (Tk - Tq)`. With `Tq == Tk` that is the
/// usual lower triangle; with a cache (`Tq < Tk`) the last query sees every key, which is
/// what incremental decoding needs. This is Burn's fused-op convention and
/// FlashAttention's. PyTorch's `is_causal` aligns top-left instead (query `i` sees keys
/// `j <= i`), which only differs when `Tq != Tk`: choose it with
/// [`aligned`](Self::aligned). When a query has no visible key (bottom-right with
/// `Tq > Tk`: the first `Tq - Tk` queries) it yields zeros.
#[derive(Clone, Debug, Default)]
pub struct AttentionMask {
    /// What blocks by position.
    rule: Rule,
    /// `true = blocked`, rank 4, broadcastable to `[B, H, Tq, Tk]`.
    blocked: Option<Tensor<4, Bool>>,
    /// Added to the scores, rank 4, broadcastable to `[B, H, Tq, Tk]`.
    bias: Option<Tensor<4>>,
    /// Added to the scores by position: ALiBi, learned relative biases.
    position: Option<PositionBias>,
    /// One logit per head that joins every row's softmax without a value, `[H]`.
    sinks: Option<Tensor<1>>,
}

/// Where the causal rule and the windows put query `i` among the keys: the key at its own
/// position (see [`AttentionMask`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CausalAlignment {
    /// Query `i` is at key `i + (Tk - Tq)`: the last query sees every key (decoding with
    /// a cache, Burn, FlashAttention). The default.
    #[default]
    BottomRight,
    /// Query `i` is at key `i`: PyTorch's `is_causal`.
    TopLeft,
    /// Query `i` is at key `i + k`: queries that continue a sequence whose first `k`
    /// positions are among the keys, with more keys after them (a decode cache read in
    /// full, its unwritten slots blocked by the causal part).
    Offset(i64),
}

/// The keys around its own position that a query sees: `before` keys before it and `after`
/// after it (the key at its position included).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Window {
    pub(crate) before: usize,
    pub(crate) after: usize,
}

impl Window {
    /// The widest side a window keeps: no sequence has this many positions (the GPU
    /// kernels count them in `i32`), so a wider side (`usize::MAX` for "no bound") blocks
    /// the same keys, and the positions' arithmetic (in `i64`, and in the backend's
    /// integers where the blocked keys are a tensor) cannot overflow.
    const WIDEST: usize = i32::MAX as usize;

    /// A window of `before` and `after` keys, each cut to [`Self::WIDEST`].
    fn new(before: usize, after: usize) -> Self {
        Self {
            before: before.min(Self::WIDEST),
            after: after.min(Self::WIDEST),
        }
    }
}

/// What blocks by position: the causal part, a window, packed sequences.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Rule {
    pub(crate) causal: bool,
    /// `None`: bottom-right, the default, which composes with either.
    pub(crate) alignment: Option<CausalAlignment>,
    pub(crate) window: Option<Window>,
    /// Per batch row, the cumulative lengths of its sequences: `[0, l1, l1 + l2, ..]`.
    pub(crate) packed: Option<Arc<[Vec<usize>]>>,
}

impl Rule {
    /// Both rules: causal if either is, windows intersected.
    ///
    /// # Panics
    /// If they align differently or pack differently.
    fn and(self, other: Self) -> Self {
        let alignment = match (self.alignment, other.alignment) {
            (Some(a), Some(b)) => {
                assert!(
                    a == b,
                    "AttentionMask::and: one mask aligns {a:?}, the other {b:?}"
                );
                Some(a)
            }
            (a, b) => a.or(b),
        };
        let packed = match (self.packed, other.packed) {
            (Some(a), Some(b)) => {
                assert!(
                    a == b,
                    "AttentionMask::and: the masks pack different sequences"
                );
                Some(a)
            }
            (a, b) => a.or(b),
        };
        Self {
            causal: self.causal || other.causal,
            alignment,
            window: merge(self.window, other.window, |a, b| Window {
                before: a.before.min(b.before),
                after: a.after.min(b.after),
            }),
            packed,
        }
    }

    pub(crate) fn is_none(&self) -> bool {
        !self.causal && self.window.is_none() && self.packed.is_none()
    }

    /// Which keys each query of a `[Tq, Tk]` problem sees under the rule.
    pub(crate) fn visibility(&self, queries: usize, keys: usize) -> Visibility {
        let offset = match self.alignment.unwrap_or_default() {
            CausalAlignment::BottomRight => keys as i64 - queries as i64,
            CausalAlignment::TopLeft => 0,
            CausalAlignment::Offset(k) => k,
        };
        Visibility {
            queries,
            keys,
            causal: self.causal,
            offset,
            window: self.window,
            packed: self.packed.clone(),
        }
    }
}

impl AttentionMask {
    /// Nothing is blocked.
    pub fn none() -> Self {
        Self::default()
    }

    /// Each query sees itself and earlier keys (bottom-right aligned, see the type docs).
    pub fn causal() -> Self {
        Self {
            rule: Rule {
                causal: true,
                ..Rule::default()
            },
            ..Self::default()
        }
    }

    /// Sliding-window (local causal) attention: each query sees at most its last `width`
    /// keys, itself included (keys `i + offset - width < j <= i + offset`, with the
    /// alignment's `offset`, see the type docs).
    ///
    /// # Panics
    /// If `width` is 0.
    pub fn sliding_window(width: usize) -> Self {
        assert!(
            width >= 1,
            "AttentionMask::sliding_window: width must be at least 1, got 0"
        );
        let window = Window::new(width - 1, 0);
        Self {
            rule: Rule {
                causal: true,
                window: Some(window),
                ..Rule::default()
            },
            ..Self::default()
        }
    }

    /// A symmetric window without the causal part: each query sees the keys at most
    /// `radius` positions from its own, on either side.
    pub fn local(radius: usize) -> Self {
        let window = Window::new(radius, radius);
        Self {
            rule: Rule {
                window: Some(window),
                ..Rule::default()
            },
            ..Self::default()
        }
    }

    /// Packed sequences (FlashAttention's varlen convention, per batch row): row `b` holds
    /// the sequences `cu_seqlens[b][s]..cu_seqlens[b][s + 1]`, one after the other, and no
    /// query attends across a boundary. Positions past a row's last boundary are padding:
    /// they see nothing and nothing sees them. Combine with [`causal`](Self::causal) for
    /// causal attention within each sequence. A sequence of no token (a length repeated)
    /// is allowed, as FlashAttention's varlen allows it. Self-attention only (`Tq == Tk`).
    ///
    /// # Panics
    /// If a row's cumulative lengths do not start at 0 or decrease, naming the row.
    pub fn packed(cu_seqlens: &[Vec<usize>]) -> Self {
        for (b, row) in cu_seqlens.iter().enumerate() {
            assert!(
                row.first() == Some(&0) && row.windows(2).all(|w| w[0] <= w[1]),
                "AttentionMask::packed: cu_seqlens[{b}] = {row:?} must start at 0 and never \
                 decrease"
            );
        }
        Self {
            rule: Rule {
                packed: Some(cu_seqlens.to_vec().into()),
                ..Rule::default()
            },
            ..Self::default()
        }
    }

    /// The same mask with the causal part and the windows aligned as `alignment` says (see
    /// the type docs).
    ///
    /// # Panics
    /// If an [`Offset`](CausalAlignment::Offset) is beyond ±2^40 (positions past any
    /// sequence, whose arithmetic would overflow).
    pub fn aligned(mut self, alignment: CausalAlignment) -> Self {
        if let CausalAlignment::Offset(k) = alignment {
            assert!(
                k.unsigned_abs() <= 1 << 40,
                "AttentionMask::aligned: the offset {k} is beyond ±2^40 positions"
            );
        }
        self.rule.alignment = Some(alignment);
        self
    }

    /// A boolean mask where `true` means **blocked**: the convention of PyTorch's
    /// `nn.MultiheadAttention(attn_mask=...)` with a bool mask, and of Burn.
    ///
    /// # Shapes
    /// - `mask`: broadcastable to `[B, H, Tq, Tk]`, e.g. `[Tq, Tk]` or `[B, 1, Tq, Tk]`;
    ///   a mask of lower rank is aligned from the right, so `[X, Tq, Tk]` is read as
    ///   `[H, Tq, Tk]`: Burn's `[B, Tq, Tk]` attention mask needs `.unsqueeze_dim(1)`.
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
    /// - `mask`: broadcastable to `[B, H, Tq, Tk]`, aligned from the right as in
    ///   [`blocking`](Self::blocking).
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
        Self::blocking(crate::empty::reshape(padding, [batch, 1, 1, keys]))
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
    /// PyTorch's float `attn_mask`. An entry of `-inf` blocks that key like a boolean mask,
    /// as does any at or below the scores' blocked value (-1e30; -16384 in f16). A row
    /// whose every key is blocked, or biased at or below -5e29 (-16384 with f16 queries),
    /// or at or below the blocked value of the bias's own dtype (Hugging Face's f16
    /// `finfo.min` beside f32 queries), gives zeros on every path.
    ///
    /// # Shapes
    /// - `bias`: broadcastable to `[B, H, Tq, Tk]`, aligned from the right as in
    ///   [`blocking`](Self::blocking).
    ///
    /// # Panics
    /// If `D > 4`.
    pub fn bias<const D: usize>(bias: Tensor<D>) -> Self {
        let bias = match bias.dims().contains(&0) {
            // A bias over nothing: zeros of its rank-4 shape that keep its (zero) gradient.
            true => {
                let shape = rank4_shape(bias.dims(), "AttentionMask::bias");
                let (device, dtype) = (bias.device(), bias.dtype());
                let link = std::iter::once_with(|| crate::empty::zero_of(bias));
                crate::empty::zeros(shape, &device, dtype, link)
            }
            false => to_rank4(bias, "AttentionMask::bias"),
        };
        Self {
            bias: Some(bias),
            ..Self::default()
        }
    }

    /// A bias on the scores by the distance from each query's position to each key's
    /// (ALiBi, learned relative biases; see [`PositionBias`]): the CPU tiles compute it
    /// per score, so no `[H, Tq, Tk]` tensor exists there. Distances follow the mask's
    /// alignment (see the type docs).
    ///
    /// # Panics
    /// If a learned table has not one column per bucket (`[H, buckets.len()]`), T5's
    /// buckets have no exact bucket or a `max_distance` not past them, or clipped
    /// distances go past `i32::MAX`, naming the values.
    pub fn position_bias(bias: PositionBias) -> Self {
        bias.check();
        Self {
            position: Some(bias),
            ..Self::default()
        }
    }

    /// Attention sinks (gpt-oss's `sinks`, a streaming decoder's sink token): one logit
    /// per head `h` that joins every query row's softmax as a key without a value, so
    /// that the row's weights sum to less than 1 and a row may attend to nothing:
    /// `weights[j] = exp(s[j]) / (exp(sinks[h]) + Σ_k exp(s[k]))`. The logits are
    /// differentiated like the other inputs (a module's learned sinks). A row that sees
    /// no key still gives zeros. Every path computes them from each row's log-sum-exp
    /// (or, where the weights are made, as one more column of the softmax). Weights asked
    /// for are the keys' (as transformers returns them): a row sums to 1 less the sink's
    /// share.
    ///
    /// # Shapes
    /// - `logits`: `[H]`, one per query head, finite (`-inf`: no sink for that head).
    pub fn sinks(logits: Tensor<1>) -> Self {
        Self {
            sinks: Some(logits),
            ..Self::default()
        }
    }

    /// Both masks at once: a key is blocked if either blocks it; biases add (in the wider
    /// of their dtypes: f16 and bf16 meet in f32); windows intersect. The alignment of
    /// either aligns both, but the alignment of a mask that places nothing by position
    /// (no causal part, window, packed sequences or position bias) gives way to the
    /// other's where the other is aligned explicitly (else it aligns the other's causal
    /// part and windows: a padding mask aligned top-left, joined by a block's causal
    /// rule, keeps the causal part top-left).
    ///
    /// # Panics
    /// If both are aligned differently and both place keys by position, if they pack
    /// different sequences, or both have a position bias or both have sinks; if their
    /// boolean parts, or their biases, do not broadcast together (naming both shapes) or
    /// are on different devices (naming both).
    pub fn and(mut self, mut other: Self) -> Self {
        if !self.by_position() && other.rule.alignment.is_some() {
            self.rule.alignment = None;
        }
        if !other.by_position() && self.rule.alignment.is_some() {
            other.rule.alignment = None;
        }
        assert!(
            self.position.is_none() || other.position.is_none(),
            "AttentionMask::and: both masks have a position bias"
        );
        assert!(
            self.sinks.is_none() || other.sinks.is_none(),
            "AttentionMask::and: both masks have attention sinks"
        );
        if let (Some(a), Some(b)) = (&self.blocked, &other.blocked) {
            check_together("boolean masks", a.dims(), b.dims());
            check_same_device("boolean masks", a.device(), b.device());
        }
        if let (Some(a), Some(b)) = (&self.bias, &other.bias) {
            check_together("biases", a.dims(), b.dims());
            check_same_device("biases", a.device(), b.device());
        }
        Self {
            rule: self.rule.and(other.rule),
            blocked: merge(self.blocked, other.blocked, |a, b| a.bool_or(b)),
            bias: merge(self.bias, other.bias, add_biases),
            position: self.position.or(other.position),
            sinks: self.sinks.or(other.sinks),
        }
    }

    /// The mask without its alignment where it places nothing by position (a padding
    /// mask aligned top-left, say), for a part by position joined to it that follows the
    /// call's own positions (a module's position bias, against its cache).
    pub(crate) fn without_idle_alignment(mut self) -> Self {
        if !self.by_position() {
            self.rule.alignment = None;
        }
        self
    }

    /// Whether the mask has a boolean part (a tensor of blocked keys).
    pub(crate) fn has_boolean_part(&self) -> bool {
        self.blocked.is_some()
    }

    /// Whether the rule alone leaves some query row of a `[Tq, Tk]` problem without a key
    /// (causal with more queries than keys, a window past the keys, a packed row's
    /// padding), read on the host.
    pub(crate) fn rule_empties_a_row(&self, queries: usize, keys: usize) -> bool {
        let visibility = self.visibility(queries, keys);
        let rows = self.rule.packed.as_ref().map_or(1, |packed| packed.len());
        (0..rows).any(|b| (0..queries).any(|q| visibility.keys_of(b, q).is_empty()))
    }

    /// Where the additive bias blocks its key, for scores computed in `dtype` (the
    /// queries'): at or below what blocks a row on the tiles and the GPU kernels once cast
    /// to `dtype` ([`DEAD_ROW`], -5e29; the blocked score -2^14 in f16), or at or below the
    /// blocked score of its own dtype (an f16 mask's `finfo.min` blocks f32 queries too).
    /// `None` without a bias.
    pub(crate) fn blocking_bias(&self, dtype: DType) -> Option<Tensor<4, Bool>> {
        let bias = self.bias.as_ref()?;
        let floor = match dtype {
            DType::F16 => blocked_score(dtype),
            _ => DEAD_ROW,
        };
        // Of the scores' own dtype, the floor is at or above the blocked score.
        if bias.dtype() == dtype {
            return Some(bias.clone().lower_equal_elem(floor));
        }
        let own = bias.clone().lower_equal_elem(blocked_score(bias.dtype()));
        let cast = bias.clone().cast(FloatDType::from(dtype));
        Some(cast.lower_equal_elem(floor).bool_or(own))
    }

    /// Whether the alignment counts: something places keys by position.
    pub(crate) fn by_position(&self) -> bool {
        let rule = &self.rule;
        rule.causal || rule.window.is_some() || rule.packed.is_some() || self.position.is_some()
    }

    /// Whether the mask has a causal part.
    pub fn is_causal(&self) -> bool {
        self.rule.causal
    }

    /// Whether the mask was given an alignment ([`aligned`](Self::aligned)).
    pub(crate) fn is_aligned(&self) -> bool {
        self.rule.alignment.is_some()
    }

    /// Whether nothing is blocked and there is no bias and no sink.
    pub fn is_none(&self) -> bool {
        self.rule.is_none()
            && self.blocked.is_none()
            && self.bias.is_none()
            && self.position.is_none()
            && self.sinks.is_none()
    }

    /// The boolean part (`true = blocked`), without what blocks by position, rank 4
    /// broadcastable to `[B, H, Tq, Tk]`.
    pub fn blocked(&self) -> Option<&Tensor<4, Bool>> {
        self.blocked.as_ref()
    }

    /// The additive part, rank 4 broadcastable to `[B, H, Tq, Tk]`.
    pub fn additive_bias(&self) -> Option<&Tensor<4>> {
        self.bias.as_ref()
    }

    /// The bias by position, if any.
    pub fn position(&self) -> Option<&PositionBias> {
        self.position.as_ref()
    }

    /// The attention sinks' logits `[H]`, if any (see [`sinks`](Self::sinks)).
    pub fn sink_logits(&self) -> Option<&Tensor<1>> {
        self.sinks.as_ref()
    }

    /// What blocks by position.
    pub(crate) fn rule(&self) -> &Rule {
        &self.rule
    }

    /// Checks that the mask's tensors are on `device`, that of `against` (named in the
    /// message, e.g. `the scores`).
    ///
    /// # Panics
    /// Naming the part and both devices, if one is on another device.
    pub(crate) fn check_device(&self, device: &Device, against: &str) {
        let devices = [
            ("boolean mask", self.blocked.as_ref().map(|t| t.device())),
            ("additive bias", self.bias.as_ref().map(|t| t.device())),
            ("sinks tensor", self.sinks.as_ref().map(|t| t.device())),
            (
                "position table",
                match &self.position {
                    Some(PositionBias::Learned { table, .. }) => Some(table.device()),
                    _ => None,
                },
            ),
        ];
        for (part, at) in devices {
            if let Some(at) = at {
                assert!(
                    at == *device,
                    "attention mask: the {part} is on {at:?} and {against} on {device:?}"
                );
            }
        }
    }

    /// Checks that the boolean and additive parts broadcast to `[B, H, Tq, Tk]`, that
    /// packed sequences fit it, and that the tensors are on the scores' `device`.
    ///
    /// # Panics
    /// Naming the part, its shape and the target shape, if they do not fit; naming the
    /// part and both devices, if it is on another device.
    pub(crate) fn check(&self, target: [usize; 4], device: &Device) {
        self.check_device(device, "the scores");
        if let Some(blocked) = &self.blocked {
            check_broadcast("boolean mask", blocked.dims(), target);
        }
        if let Some(bias) = &self.bias {
            check_broadcast("additive bias", bias.dims(), target);
        }
        if let Some(position) = &self.position {
            assert!(
                position.heads() == target[1],
                "attention mask: the position bias has {} heads, the scores [B, H, Tq, Tk] = \
                 {target:?}",
                position.heads()
            );
        }
        if let Some(sinks) = &self.sinks {
            let [heads] = sinks.dims();
            assert!(
                heads == target[1],
                "attention mask: the attention sinks have {heads} logits, one per head of the \
                 scores [B, H, Tq, Tk] = {target:?}"
            );
        }
        if let Some(packed) = &self.rule.packed {
            let [batch, _, queries, keys] = target;
            assert!(
                packed.len() == batch && queries == keys,
                "attention mask: packed sequences for {} rows need self-attention over {} rows, \
                 got [B, H, Tq, Tk] = {target:?}",
                packed.len(),
                packed.len()
            );
            for (b, row) in packed.iter().enumerate() {
                let end = row.last().copied().unwrap_or(0);
                assert!(
                    end <= keys,
                    "attention mask: packed sequences of row {b} end at {end}, past Tk = {keys}"
                );
            }
        }
    }

    /// The boolean part and what blocks by position, as one boolean tensor broadcastable
    /// to `[B, H, Tq, Tk]`; `None` when neither blocks (a bias that blocks keys is not
    /// in it).
    pub fn to_blocked(
        &self,
        queries: usize,
        keys: usize,
        device: &Device,
    ) -> Option<Tensor<4, Bool>> {
        let rule = self
            .visibility(queries, keys)
            .blocked(0..queries, 0..keys, device);
        merge(self.blocked.clone(), rule, |a, b| a.bool_or(b))
    }

    /// Which keys each query of a `[Tq, Tk]` problem sees under the rule.
    pub(crate) fn visibility(&self, queries: usize, keys: usize) -> Visibility {
        self.rule.visibility(queries, keys)
    }

    /// The mask of the sub-problem made of query rows `rows` and keys `keys` of a
    /// `[.., queries, keys]` problem: what blocks by position becomes a boolean part for
    /// that rectangle, the boolean and additive parts are sliced where they are not
    /// broadcast, a bias by position is made for queries of `dtype`.
    pub(crate) fn sub(
        &self,
        rows: Range<usize>,
        key_range: Range<usize>,
        [queries, keys]: [usize; 2],
        device: &Device,
        dtype: DType,
    ) -> Self {
        let cut = |dims: [usize; 4]| {
            let [b, h, tq, tk] = dims;
            let r = match tq == queries && tq > 1 {
                true => rows.clone(),
                false => 0..tq,
            };
            let c = match tk == keys && tk > 1 {
                true => key_range.clone(),
                false => 0..tk,
            };
            [0..b, 0..h, r, c]
        };
        let visibility = self.visibility(queries, keys);
        let rule = visibility.blocked(rows.clone(), key_range.clone(), device);
        let blocked = self
            .blocked
            .as_ref()
            .map(|t| t.clone().slice(cut(t.dims())));
        let bias = self.bias.as_ref().map(|t| t.clone().slice(cut(t.dims())));
        let position = self.position.as_ref().map(|p| {
            p.tensor(
                rows.clone(),
                key_range.clone(),
                visibility.offset,
                device,
                dtype,
            )
        });
        Self {
            rule: Rule::default(),
            blocked: merge(blocked, rule, |a, b| a.bool_or(b)),
            // In the wider dtype (ALiBi's is made in f32, f64 for f64 queries: an f16 bias
            // rounded it).
            bias: merge(bias, position, add_biases),
            position: None,
            sinks: self.sinks.clone(),
        }
    }
}

/// `a + b` in the wider of their dtypes (f16 and bf16 meet in f32). A bias cast wider
/// keeps what blocks in its own dtype blocked ([`AttentionMask::blocking_bias`]): an f16
/// `finfo.min` becomes the wider dtype's blocked score, not -65504.
fn add_biases(a: Tensor<4>, b: Tensor<4>) -> Tensor<4> {
    let dtype = match (a.dtype(), b.dtype()) {
        (x, y) if x == y => return a + b,
        (DType::F64, _) | (_, DType::F64) => FloatDType::F64,
        _ => FloatDType::F32,
    };
    let cast = |t: Tensor<4>| match t.dtype() == dtype.into() {
        true => t,
        false => {
            let blocks = t.clone().lower_equal_elem(blocked_score(t.dtype()));
            t.cast(dtype).mask_fill(blocks, blocked_score(dtype.into()))
        }
    };
    cast(a) + cast(b)
}

/// Panics, naming both devices, when two masks' `what` are on different devices.
fn check_same_device(what: &str, a: Device, b: Device) {
    assert!(
        a == b,
        "AttentionMask::and: the {what} are on {a:?} and {b:?}"
    );
}

/// Checks that two parts of masks joined by [`AttentionMask::and`] broadcast together.
///
/// # Panics
/// Naming `what` and both shapes.
fn check_together(what: &str, a: [usize; 4], b: [usize; 4]) {
    let fits = a.iter().zip(b).all(|(&x, y)| x == y || x == 1 || y == 1);
    assert!(
        fits,
        "AttentionMask::and: the {what} of shapes {a:?} and {b:?} do not broadcast together"
    );
}

fn merge<T>(a: Option<T>, b: Option<T>, f: impl FnOnce(T, T) -> T) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(f(a, b)),
        (a, b) => a.or(b),
    }
}

/// `dims` aligned from the right in four axes.
///
/// # Panics
/// Naming `what`, if there are more than four.
fn rank4_shape<const D: usize>(dims: [usize; D], what: &str) -> [usize; 4] {
    assert!(
        D <= 4,
        "{what}: expected a tensor of rank at most 4, got rank {D}"
    );
    let mut shape = [1; 4];
    shape[4 - D..].copy_from_slice(&dims);
    shape
}

fn to_rank4<const D: usize, K: burn::tensor::kind::Basic>(
    tensor: Tensor<D, K>,
    what: &str,
) -> Tensor<4, K> {
    let shape = rank4_shape(tensor.dims(), what);
    crate::empty::reshape(tensor, shape)
}

fn check_broadcast(what: &str, dims: [usize; 4], target: [usize; 4]) {
    let fits = dims.iter().zip(target).all(|(&d, t)| d == t || d == 1);
    if fits {
        return;
    }
    let [batch, heads, queries, keys] = target;
    // The shapes of other libraries' masks, read here aligned from the right.
    let hint = if dims == [1, batch * heads, queries, keys] {
        format!(
            " (PyTorch's 3-D mask [B·H, Tq, Tk]: reshape it to [B, H, Tq, Tk] = \
             [{batch}, {heads}, {queries}, {keys}])"
        )
    } else if dims == [1, 1, batch, keys] {
        " (a [B, Tk] padding mask: AttentionMask::key_padding, true = padding, or \
         AttentionMask::key_lengths)"
            .to_string()
    } else {
        String::new()
    };
    panic!(
        "attention mask: the {what} of shape {dims:?} does not broadcast to the scores \
         [B, H, Tq, Tk] = {target:?}{hint}"
    );
}
