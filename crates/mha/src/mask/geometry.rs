//! The kernels' geometry of a mask: which keys each query sees by position
//! ([`Visibility`], and [`Band`], its form for the GPU kernels), and the blocked-score
//! sentinels every path writes ([`BLOCKED`], [`DEAD_ROW`], [`DEAD_LSE`], [`blocked_score`]).
//! The public mask is in the parent module.

use std::ops::Range;
use std::sync::Arc;

use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};

use super::Window;

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
    pub(super) causal: bool,
    /// The key at query 0's own position.
    pub(crate) offset: i64,
    pub(super) window: Option<Window>,
    pub(super) packed: Option<Arc<[Vec<usize>]>>,
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

    /// Where the sequence of query `query` of batch row `b` starts, in keys: its packed
    /// sequence's first position (its own position past the row's last sequence), else 0.
    pub(crate) fn sequence_start(&self, b: usize, query: usize) -> usize {
        match &self.packed {
            Some(packed) => {
                let row = &packed[b.min(packed.len().saturating_sub(1))];
                sequence(row, query).map_or(query, |seq| seq.start)
            }
            None => 0,
        }
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
    pub(super) fn blocked(
        &self,
        rows: Range<usize>,
        keys: Range<usize>,
        device: &Device,
    ) -> Option<Tensor<4, Bool>> {
        if !self.blocks() {
            return None;
        }
        let (r, k) = (rows.len(), keys.len());
        if r == 0 || k == 0 {
            // Nothing to block; made as it is (Burn's reshapes read a 0 as "keep this
            // axis").
            let batch = self.packed.as_ref().map_or(1, |packed| packed.len());
            return Some(Tensor::empty([batch, 1, r, k], device));
        }
        let int = |range: Range<i64>, shape: [usize; 2]| {
            Tensor::<1, Int>::arange(range, device).reshape(shape)
        };
        // Key j minus query i's row, small whatever the offset; the rule's bounds on the
        // distance from the own position, `i + offset`, become bounds on it, cut to one
        // past every key of every query (an offset may reach 2^40, past the device's
        // integers: i32 on some).
        let own = int(rows.start as i64..rows.end as i64, [r, 1]);
        let distance = int(keys.start as i64..keys.end as i64, [1, k]) - own; // [r, k]
        let far = (self.queries + self.keys + 1) as i64;
        let bound = |d: i64| self.offset.saturating_add(d).clamp(-far, far);
        let mut blocked: Option<Tensor<2, Bool>> = None;
        let mut block = |b: Tensor<2, Bool>| {
            blocked = Some(match blocked.take() {
                Some(a) => a.bool_or(b),
                None => b,
            })
        };
        if self.causal {
            block(distance.clone().greater_elem(bound(0)));
        }
        if let Some(w) = self.window {
            let [after, before] = [w.after, w.before].map(|n| i64::try_from(n).unwrap_or(i64::MAX));
            block(distance.clone().greater_elem(bound(after)));
            block(distance.lower_elem(bound(before.saturating_neg())));
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
/// `exp(BLOCKED - DEAD_LSE) = 0`. [`blocked_score`] gives the blocked score of each dtype.
pub(crate) const BLOCKED: f32 = -1.0e30;
/// See [`BLOCKED`].
pub(crate) const DEAD_ROW: f32 = -5.0e29;
/// See [`BLOCKED`].
#[cfg(any(feature = "cpu-kernels", feature = "gpu-kernels"))]
pub(crate) const DEAD_LSE: f32 = 1.0e30;

/// The blocked score of one float dtype: [`BLOCKED`] where it fits (f32, f64, bf16); for
/// f16, whose largest finite value is 65504, `-2^14` (a score plus `-2^14` stays finite).
/// Which rows have no visible key is told from the masks, not from this value (a real f16
/// score may be as low).
pub(crate) fn blocked_score(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => -16384.0,
        _ => BLOCKED,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mask::{AttentionMask, CausalAlignment};

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
