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

use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};

use crate::positions::PositionBias;

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
        let window = Window {
            before: width - 1,
            after: 0,
        };
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
        let window = Window {
            before: radius,
            after: radius,
        };
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
    /// causal attention within each sequence. Self-attention only (`Tq == Tk`).
    ///
    /// # Panics
    /// If a row's cumulative lengths do not start at 0 or do not increase, naming the row.
    pub fn packed(cu_seqlens: &[Vec<usize>]) -> Self {
        for (b, row) in cu_seqlens.iter().enumerate() {
            assert!(
                row.first() == Some(&0) && row.windows(2).all(|w| w[0] < w[1]),
                "AttentionMask::packed: cu_seqlens[{b}] = {row:?} must start at 0 and increase"
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
    pub fn aligned(mut self, alignment: CausalAlignment) -> Self {
        self.rule.alignment = Some(alignment);
        self
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

    /// A bias on the scores by the distance from each query's position to each key's
    /// (ALiBi, learned relative biases; see [`PositionBias`]): the CPU tiles compute it
    /// per score, so no `[H, Tq, Tk]` tensor exists there. Distances follow the mask's
    /// alignment (see the type docs).
    pub fn position_bias(bias: PositionBias) -> Self {
        Self {
            position: Some(bias),
            ..Self::default()
        }
    }

    /// Both masks at once: a key is blocked if either blocks it; biases add; windows
    /// intersect.
    ///
    /// # Panics
    /// If the two align the causal part differently, pack different sequences or both
    /// have a position bias.
    pub fn and(self, other: Self) -> Self {
        assert!(
            self.position.is_none() || other.position.is_none(),
            "AttentionMask::and: both masks have a position bias"
        );
        Self {
            rule: self.rule.and(other.rule),
            blocked: merge(self.blocked, other.blocked, |a, b| a.bool_or(b)),
            bias: merge(self.bias, other.bias, |a, b| a + b),
            position: self.position.or(other.position),
        }
    }

    /// Whether the mask has a causal part.
    pub fn is_causal(&self) -> bool {
        self.rule.causal
    }

    /// Whether nothing is blocked and there is no bias.
    pub fn is_none(&self) -> bool {
        self.rule.is_none()
            && self.blocked.is_none()
            && self.bias.is_none()
            && self.position.is_none()
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

    /// What blocks by position.
    pub(crate) fn rule(&self) -> &Rule {
        &self.rule
    }

    /// Checks that the boolean and additive parts broadcast to `[B, H, Tq, Tk]`, and that
    /// packed sequences fit it.
    ///
    /// # Panics
    /// Naming the part, its shape and the target shape, if they do not fit.
    pub(crate) fn check(&self, target: [usize; 4]) {
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

    /// Everything that blocks, what blocks by position included, as one boolean tensor
    /// broadcastable to `[B, H, Tq, Tk]`; `None` when nothing blocks.
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
    /// broadcast.
    pub(crate) fn sub(
        &self,
        rows: Range<usize>,
        key_range: Range<usize>,
        [queries, keys]: [usize; 2],
        device: &Device,
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
        let position = self
            .position
            .as_ref()
            .map(|p| p.tensor(rows.clone(), key_range.clone(), visibility.offset, device));
        Self {
            rule: Rule::default(),
            blocked: merge(blocked, rule, |a, b| a.bool_or(b)),
            bias: merge(bias, position, |a, b| a + b),
            position: None,
        }
    }
}

/// The rule every path asks which keys a query sees: with the causal part, query `i` of
/// `Tq` sees keys up to its own position `i + offset` (the alignment's offset, see
/// [`AttentionMask`]); a window keeps `before` keys before that position and `after`
/// after it; packed sequences keep the keys of the query's own sequence. Each query sees
/// one contiguous range of keys and each key is seen by one contiguous range of queries,
/// both moving forward with the query or the key: the explicit path's boolean mask and
/// query chunks, the CPU tiles' masks, the tiles they skip and their backward's key
/// ranges all follow from [`keys_of`](Self::keys_of) and [`queries_of`](Self::queries_of).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Visibility {
    /// `Tq`.
    pub(crate) queries: usize,
    /// `Tk`.
    pub(crate) keys: usize,
    causal: bool,
    /// The key at query 0's own position.
    pub(crate) offset: i64,
    window: Option<Window>,
    packed: Option<Arc<[Vec<usize>]>>,
}

impl Visibility {
    /// Whether some query may not see some key.
    pub(crate) fn blocks(&self) -> bool {
        self.causal || self.window.is_some() || self.packed.is_some()
    }

    /// The rule as a band around each query's own position, for kernels that compute
    /// [`keys_of`](Self::keys_of) themselves: query `i` sees keys `i + offset - before
    /// ..= i + offset + after`, cut to `0..Tk` (`None`: no bound on that side), and, with
    /// packed sequences, cut further to its sequence's ([`sequences`](Self::sequences)).
    #[cfg(any(test, feature = "gpu-kernels"))] // The GPU kernels' (and the tests').
    pub(crate) fn band(&self) -> Band {
        // The causal part sees nothing after the own position, whatever the window.
        let after = match self.causal {
            true => Some(0),
            false => self.window.map(|w| w.after),
        };
        Band {
            offset: self.offset,
            before: self.window.map(|w| w.before),
            after,
        }
    }

    /// With packed sequences, the positions of each position's sequence, `[lo, hi]` for
    /// every position `t` of every batch row `b` at `2 · (b · T + t)` (`T = Tq = Tk`):
    /// padding past a row's last sequence has the empty `[T, T]`. Both bounds never
    /// decrease along a row, so the positions that rows `i0 ..= i1` see between them lie
    /// in `lo[i0] .. hi[i1]`. `None` without packed sequences.
    #[cfg(any(test, feature = "gpu-kernels"))] // The GPU kernels' (and the tests').
    pub(crate) fn sequences(&self) -> Option<Vec<i32>> {
        let packed = self.packed.as_ref()?;
        let len = self.queries;
        let bound = |n: usize| i32::try_from(n).expect("a sequence length past i32");
        Some(
            packed
                .iter()
                .flat_map(|row| {
                    (0..len).flat_map(move |t| match sequence(row, t) {
                        Some(seq) => [bound(seq.start), bound(seq.end)],
                        None => [bound(len), bound(len)],
                    })
                })
                .collect(),
        )
    }

    /// The keys query `query` of batch row `b` sees.
    pub(crate) fn keys_of(&self, b: usize, query: usize) -> Range<usize> {
        let own = query as i64 + self.offset;
        let (mut lo, mut hi) = (0i64, self.keys as i64);
        if self.causal {
            hi = hi.min(own + 1);
        }
        if let Some(w) = self.window {
            lo = lo.max(own - w.before as i64);
            hi = hi.min(own + w.after as i64 + 1);
        }
        self.within_sequence(b, query, lo..hi)
    }

    /// The queries of batch row `b` that see key `key`.
    #[cfg(feature = "cpu-kernels")]
    pub(crate) fn queries_of(&self, b: usize, key: usize) -> Range<usize> {
        let k = key as i64;
        let (mut lo, mut hi) = (0i64, self.queries as i64);
        if self.causal {
            lo = lo.max(k - self.offset);
        }
        if let Some(w) = self.window {
            lo = lo.max(k - w.after as i64 - self.offset);
            hi = hi.min(k + w.before as i64 - self.offset + 1);
        }
        self.within_sequence(b, key, lo..hi)
    }

    /// `range` cut to the packed sequence of position `t` of batch row `b` (empty for
    /// padding past the last sequence), as positions.
    fn within_sequence(&self, b: usize, t: usize, range: Range<i64>) -> Range<usize> {
        let (mut lo, mut hi) = (range.start, range.end);
        if let Some(packed) = &self.packed {
            let Some(seq) = sequence(&packed[b], t) else {
                return 0..0;
            };
            lo = lo.max(seq.start as i64);
            hi = hi.min(seq.end as i64);
        }
        match lo < hi {
            true => lo as usize..hi as usize,
            false => 0..0,
        }
    }

    /// The keys the queries `rows` of batch row `b` see between them (each query's range
    /// lies inside).
    pub(crate) fn keys_of_rows(&self, b: usize, rows: Range<usize>) -> Range<usize> {
        span(rows.map(|q| self.keys_of(b, q)))
    }

    /// The queries that see the keys `keys` of batch row `b` between them.
    #[cfg(feature = "cpu-kernels")]
    pub(crate) fn queries_of_keys(&self, b: usize, keys: Range<usize>) -> Range<usize> {
        span(keys.map(|k| self.queries_of(b, k)))
    }

    /// What the rule blocks among query rows `rows` and keys `keys`, as a `[1 or B, 1,
    /// rows, keys]` tensor (`true` = blocked); `None` when it blocks nothing.
    fn blocked(
        &self,
        rows: Range<usize>,
        keys: Range<usize>,
        device: &Device,
    ) -> Option<Tensor<4, Bool>> {
        if !self.blocks() {
            return None;
        }
        let (r, k) = (rows.len(), keys.len());
        let int = |range: Range<i64>, shape: [usize; 2]| {
            Tensor::<1, Int>::arange(range, device).reshape(shape)
        };
        // Key j minus query i's own position.
        let start = rows.start as i64 + self.offset;
        let own = int(start..start + r as i64, [r, 1]);
        let distance = int(keys.start as i64..keys.end as i64, [1, k]) - own; // [r, k]
        let mut blocked: Option<Tensor<2, Bool>> = None;
        let mut block = |b: Tensor<2, Bool>| {
            blocked = Some(match blocked.take() {
                Some(a) => a.bool_or(b),
                None => b,
            })
        };
        if self.causal {
            block(distance.clone().greater_elem(0));
        }
        if let Some(w) = self.window {
            block(distance.clone().greater_elem(w.after as i64));
            block(distance.lower_elem(-(w.before as i64)));
        }
        let by_position = blocked.map(|b| b.reshape([1, 1, r, k]));
        let Some(packed) = &self.packed else {
            return by_position;
        };
        // Sequence ids: padding past the last boundary is -1 among the queries and -2
        // among the keys, so that it matches nothing.
        let ids = |range: &Range<usize>, len: usize, pad: i64| -> Vec<i64> {
            packed
                .iter()
                .flat_map(|row| {
                    range
                        .clone()
                        .map(move |t| match sequence(row, t).filter(|_| t < len) {
                            Some(seq) => seq.start as i64,
                            None => pad,
                        })
                })
                .collect()
        };
        let batch = packed.len();
        let query_ids = Tensor::<2, Int>::from_data(
            TensorData::new(ids(&rows, self.queries, -1), [batch, r]),
            device,
        );
        let key_ids = Tensor::<2, Int>::from_data(
            TensorData::new(ids(&keys, self.keys, -2), [batch, k]),
            device,
        );
        let across = query_ids
            .reshape([batch, 1, r, 1])
            .not_equal(key_ids.reshape([batch, 1, 1, k])); // [B, 1, r, k]
        Some(match by_position {
            Some(b) => across.bool_or(b),
            None => across,
        })
    }
}

/// Which keys each query sees, as a band around its own position (see
/// [`Visibility::band`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg(any(test, feature = "gpu-kernels"))] // The GPU kernels' (and the tests').
pub(crate) struct Band {
    /// The key at query 0's own position.
    pub(crate) offset: i64,
    /// Keys seen before the own position; `None`: every one.
    pub(crate) before: Option<usize>,
    /// Keys seen after the own position; `None`: every one.
    pub(crate) after: Option<usize>,
}

/// The sequence holding position `t` of a row packed as `cumulative` lengths; `None` for
/// padding past the row's last boundary.
fn sequence(cumulative: &[usize], t: usize) -> Option<Range<usize>> {
    let s = cumulative.partition_point(|&start| start <= t);
    (s >= 1 && s < cumulative.len()).then(|| cumulative[s - 1]..cumulative[s])
}

/// The smallest range holding every non-empty range of `ranges`.
fn span(ranges: impl Iterator<Item = Range<usize>>) -> Range<usize> {
    ranges
        .filter(|r| !r.is_empty())
        .reduce(|a, b| a.start.min(b.start)..a.end.max(b.end))
        .unwrap_or(0..0)
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
#[cfg(any(feature = "cpu-kernels", feature = "gpu-kernels"))]
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The keys of query `i` by `band`, as a kernel computes them.
    fn band_keys(band: Band, keys: usize, i: usize) -> Range<usize> {
        let own = i as i64 + band.offset;
        let lo = band.before.map_or(0, |n| (own - n as i64).max(0));
        let hi = band
            .after
            .map_or(keys as i64, |n| (own + n as i64 + 1).min(keys as i64));
        match lo < hi {
            true => lo as usize..hi as usize,
            false => 0..0,
        }
    }

    #[test]
    fn the_band_gives_the_keys_of_every_query() {
        let alignments = [
            CausalAlignment::BottomRight,
            CausalAlignment::TopLeft,
            CausalAlignment::Offset(-3),
            CausalAlignment::Offset(7),
        ];
        let masks = [
            AttentionMask::none(),
            AttentionMask::causal(),
            AttentionMask::sliding_window(1),
            AttentionMask::sliding_window(4),
            AttentionMask::local(0),
            AttentionMask::local(3),
            AttentionMask::local(2).and(AttentionMask::causal()),
            AttentionMask::sliding_window(6).and(AttentionMask::local(2)),
        ];
        for mask in masks {
            for alignment in alignments {
                let mask = mask.clone().aligned(alignment);
                for (queries, keys) in [(9, 9), (4, 13), (13, 4), (1, 1)] {
                    let visibility = mask.visibility(queries, keys);
                    let band = visibility.band();
                    for i in 0..queries {
                        assert_eq!(
                            band_keys(band, keys, i),
                            visibility.keys_of(0, i),
                            "{:?} {alignment:?}, query {i} of [{queries}, {keys}]",
                            mask.rule()
                        );
                    }
                }
            }
        }
        // Packed sequences: the band cut to each position's sequence.
        let rows = [vec![0, 3, 5, 6], vec![0, 2, 7]];
        for mask in [
            AttentionMask::none(),
            AttentionMask::causal(),
            AttentionMask::local(1),
        ] {
            let packed = mask.and(AttentionMask::packed(&rows));
            let visibility = packed.visibility(8, 8);
            let band = visibility.band();
            let sequences = visibility.sequences().expect("packed");
            for b in 0..2 {
                for i in 0..8 {
                    let at = 2 * (b * 8 + i);
                    let (lo, hi) = (sequences[at] as usize, sequences[at + 1] as usize);
                    let keys = band_keys(band, 8, i);
                    let cut = keys.start.max(lo)..keys.end.min(hi);
                    let want = visibility.keys_of(b, i);
                    assert_eq!(
                        if cut.is_empty() { 0..0 } else { cut },
                        want,
                        "{:?}, row {b}, query {i}",
                        packed.rule()
                    );
                }
            }
        }
        assert_eq!(AttentionMask::causal().visibility(4, 4).sequences(), None);
    }
}
