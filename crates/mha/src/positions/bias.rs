//! Biases on the scores that depend only on the head and on the distance from a query's
//! position to a key's (`key - query`): ALiBi, and learned tables indexed by buckets of
//! the distance (clipped offsets, T5's log-spaced buckets). [`PositionBias`] carries one
//! into attention, where the CPU tiles compute it per score (no `[H, Tq, Tk]` tensor) and
//! the explicit path builds it.

use burn::tensor::{DType, Device, Int, Tensor, TensorData};

/// ALiBi's head slopes (Press et al., "Train Short, Test Long"): for `H` a power of two,
/// `2^(-8h/H)` for `h = 1..=H`; otherwise those of the largest power of two below `H`,
/// then every other slope of twice that power, as the paper's code does.
pub fn alibi_slopes(heads: usize) -> Vec<f32> {
    fn power_of_two(n: usize) -> Vec<f64> {
        let start = 2f64.powf(-(2f64.powf(-((n as f64).log2() - 3.0))));
        (0..n).map(|i| start * start.powi(i as i32)).collect()
    }
    fn slopes(n: usize) -> Vec<f64> {
        if n.is_power_of_two() {
            return power_of_two(n);
        }
        let closest = 1 << n.ilog2();
        let mut all = power_of_two(closest);
        all.extend(slopes(2 * closest).into_iter().step_by(2).take(n - closest));
        all
    }
    match heads {
        0 => Vec::new(),
        n => slopes(n).into_iter().map(|s| s as f32).collect(),
    }
}

/// How a learned relative-position table buckets the distance `key - query`.
///
/// The sign is T5's (`memory_position - context_position`) and tensor2tensor's: keys
/// after the query have positive distances. Much code indexes its table by
/// `query - key` instead; such a table is this one read backwards:
///
/// | a table of `2·max + 1` columns indexed by | in mha's layout `[H, 2·max + 1]` |
/// |---|---|
/// | `clamp(key - query) + max`, `[H, 2·max + 1]` | as it is |
/// | `clamp(query - key) + max`, `[H, 2·max + 1]` | `table.flip(-1)` |
/// | `clamp(query - key) + max`, an `nn.Embedding(2·max + 1, H)` | `emb.weight.T.flip(-1)` |
///
/// T5's buckets are indexed by T5's own rule ([`Buckets::T5`], the same as `transformers`'
/// `_relative_position_bucket`); Hugging Face stores T5's table as an
/// `nn.Embedding(num_buckets, num_heads)`, `[buckets, H]`, the transpose of mha's, which
/// the import transposes ([`crate::pytorch`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Buckets {
    /// One bucket per distance `key - query` in `-max..=max` (Shaw et al.): bucket
    /// `clamp(key - query, -max, max) + max`, so that column 0 is the farthest key
    /// *before* the query; farther distances share the edge buckets: `2·max + 1` buckets.
    /// A table indexed by `query - key` is this one flipped (see [`Buckets`]).
    Clipped {
        /// The largest distance with a bucket of its own.
        max: usize,
    },
    /// T5's buckets: exact for small distances, log-spaced up to `max_distance`, one
    /// bucket beyond; `bidirectional` splits them between keys before and after the query
    /// (the encoder's), else only keys before it count (the decoder's).
    T5 {
        /// Buckets in all.
        num_buckets: usize,
        /// The distance from which every distance shares the last bucket.
        max_distance: usize,
        /// Keys after the query get buckets of their own.
        bidirectional: bool,
    },
}

impl Buckets {
    /// How many buckets there are.
    pub fn len(&self) -> usize {
        match *self {
            Buckets::Clipped { max } => 2 * max + 1,
            Buckets::T5 { num_buckets, .. } => num_buckets,
        }
    }

    /// Whether there is no bucket (never, for a valid configuration).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What makes the buckets unusable, if anything: clipped distances past `i32::MAX`
    /// (a table of `2 · max + 1` buckets, and distances as `i64`); for T5's, no exact
    /// bucket, or a `max_distance` not past the exact ones (the logarithmic buckets divide
    /// by both).
    pub(crate) fn problem(&self) -> Option<String> {
        let (num_buckets, max_distance, bidirectional) = match *self {
            Buckets::Clipped { max } => {
                return (max > i32::MAX as usize).then(|| {
                    format!(
                        "Relative's max_distance must be at most {} (its table has 2 · \
                         max_distance + 1 buckets), got {max}",
                        i32::MAX
                    )
                });
            }
            Buckets::T5 {
                num_buckets,
                max_distance,
                bidirectional,
            } => (num_buckets, max_distance, bidirectional),
        };
        let exact = match bidirectional {
            true => num_buckets / 2 / 2,
            false => num_buckets / 2,
        };
        (exact == 0 || max_distance <= exact).then(|| {
            format!(
                "T5 needs num_buckets of at least {} and max_distance above the exact \
                 buckets ({exact}), got num_buckets {num_buckets}, max_distance {max_distance}",
                if bidirectional { 4 } else { 2 }
            )
        })
    }

    /// The bucket of the distance `key - query`, as T5's `_relative_position_bucket`
    /// computes it (its logarithm in f32, as PyTorch does).
    pub fn of(&self, distance: i64) -> usize {
        match *self {
            Buckets::Clipped { max } => {
                (distance.clamp(-(max as i64), max as i64) + max as i64) as usize
            }
            Buckets::T5 {
                num_buckets,
                max_distance,
                bidirectional,
            } => {
                let (mut buckets, mut offset) = (num_buckets, 0);
                let distance = match bidirectional {
                    true => {
                        buckets /= 2;
                        offset = usize::from(distance > 0) * buckets;
                        distance.unsigned_abs() as usize
                    }
                    false => (-distance.min(0)) as usize,
                };
                let exact = buckets / 2;
                if distance < exact {
                    return offset + distance;
                }
                let log = (distance as f32 / exact as f32).ln()
                    / (max_distance as f64 / exact as f64).ln() as f32
                    * (buckets - exact) as f32;
                offset + (exact + log as usize).min(buckets - 1)
            }
        }
    }
}

/// A bias on the scores by position: what attention adds to the score of query `i` and
/// key `j` of head `h` from `h` and the distance `d = j - p(i)` alone (`p(i)`: the query's
/// own key, under the mask's alignment).
// One per attention call: the size of the enum does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum PositionBias {
    /// ALiBi: `-slopes[h] · |d|`, symmetric (see [`Positions::Alibi`](crate::Positions::Alibi)).
    Alibi {
        /// One slope per query head (see [`alibi_slopes`]).
        slopes: Vec<f32>,
    },
    /// A learned table: `table[h, buckets.of(d)]`, its gradient trained.
    Learned {
        /// `[H, buckets.len()]` (Hugging Face's T5 stores the transpose).
        table: Tensor<2>,
        /// How distances map to the table's columns.
        buckets: Buckets,
    },
}

impl PositionBias {
    /// Checks that a learned table has a column for each of its buckets, and that the
    /// buckets are usable.
    ///
    /// # Panics
    /// Naming the table's shape and the buckets, if not.
    pub(crate) fn check(&self) {
        if let PositionBias::Learned { table, buckets } = self {
            if let Some(problem) = buckets.problem() {
                panic!("PositionBias::Learned: {problem}");
            }
            assert!(
                table.dims()[1] == buckets.len(),
                "PositionBias::Learned: the table is [H, buckets] = {:?}, and {buckets:?} has \
                 {} buckets",
                table.dims(),
                buckets.len()
            );
        }
    }

    /// The query heads it has a bias for.
    pub fn heads(&self) -> usize {
        match self {
            PositionBias::Alibi { slopes } => slopes.len(),
            PositionBias::Learned { table, .. } => table.dims()[0],
        }
    }

    /// The bias of query rows `rows` and keys `keys` of a `[Tq, Tk]` problem whose query
    /// `i` stands at key `i + offset`, as a `[1, H, rows, keys]` tensor (the explicit
    /// path; the CPU tiles compute it per score instead). It is built from the block's
    /// `rows + keys - 1` distinct distances, one value per head and distance, spread over
    /// the block's diagonals ([`diagonals`]): a learned table's gradient flows through a
    /// select of those few distances, not of every score.
    pub(crate) fn tensor(
        &self,
        rows: std::ops::Range<usize>,
        keys: std::ops::Range<usize>,
        offset: i64,
        device: &Device,
        dtype: DType,
    ) -> Tensor<4> {
        let (r, k, h) = (rows.len(), keys.len(), self.heads());
        if r == 0 || k == 0 {
            return Tensor::zeros([1, h, r, k], device);
        }
        // Column `c` holds the distance `first + c`: the last row's first key at `c = 0`.
        let first = keys.start as i64 - (rows.end as i64 - 1 + offset);
        let per_distance = self.per_distance(first, r + k - 1, device, dtype);
        diagonals(per_distance, r, k).unsqueeze()
    }

    /// The bias of each query head at the `count` distances `first ..` (key minus the
    /// query's own position), `[H, count]`: a learned table's gradient flows through a
    /// select of those columns. ALiBi's is made in f64 for `dtype` f64 (its products of
    /// the slopes and distances exact to f64's precision), else in f32.
    pub(crate) fn per_distance(
        &self,
        first: i64,
        count: usize,
        device: &Device,
        dtype: DType,
    ) -> Tensor<2> {
        let h = self.heads();
        let distances = (0..count as i64).map(|c| first + c);
        match self {
            PositionBias::Alibi { slopes } => {
                // Made in the dtype itself: `from_data` on a device's default float dtype
                // (f32) would round f64 values.
                let dtype = match dtype {
                    DType::F64 => DType::F64,
                    _ => DType::F32,
                };
                let far: Vec<f64> = distances.map(|d| -(d.abs() as f64)).collect();
                let far = Tensor::<2>::from_data(TensorData::new(far, [1, count]), (device, dtype));
                let slopes: Vec<f64> = slopes.iter().map(|&s| s as f64).collect();
                let slopes =
                    Tensor::<2>::from_data(TensorData::new(slopes, [h, 1]), (device, dtype));
                slopes * far
            }
            PositionBias::Learned { table, buckets } => {
                let index: Vec<i64> = distances.map(|d| buckets.of(d) as i64).collect();
                select_columns(table.clone(), &index, device)
            }
        }
    }
}

/// `[H, r, k]` with element `(h, i, j)` equal to `values[h, j + r - 1 - i]`: each of the
/// `r + k - 1` columns of `values` (`[H, r + k - 1]`) along one diagonal. Repeating a row
/// padded to `r + k` values and reading it back in rows of `r + k - 1` shifts each row
/// one place right of the one above it; ops whose gradients every backend has.
fn diagonals(values: Tensor<2>, r: usize, k: usize) -> Tensor<3> {
    let [heads, len] = values.dims();
    debug_assert_eq!(len, r + k - 1);
    let padded = Tensor::cat(vec![values.clone(), values.zeros_like().narrow(1, 0, 1)], 1);
    padded
        .repeat_dim(1, r)
        .narrow(1, 0, r * len)
        .reshape([heads, r, len])
        .narrow(2, r - 1, k)
}

/// Most indices one select takes: on wgpu, Burn 0.22's select backward (a scatter-add)
/// drops every index past the 65,535th.
const MAX_SELECT: usize = 1 << 15;

/// The columns `index` of `table` (`[H, N]`), `[H, index.len()]`, in selects of at most
/// [`MAX_SELECT`] indices.
fn select_columns(table: Tensor<2>, index: &[i64], device: &Device) -> Tensor<2> {
    let parts: Vec<Tensor<2>> = index
        .chunks(MAX_SELECT)
        .map(|part| {
            let part =
                Tensor::<1, Int>::from_data(TensorData::new(part.to_vec(), [part.len()]), device);
            table.clone().select(1, part)
        })
        .collect();
    Tensor::cat(parts, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alibi_slopes_follow_the_papers_formula() {
        let eight = alibi_slopes(8);
        for (h, &s) in eight.iter().enumerate() {
            assert_eq!(s, 2f32.powi(-(h as i32 + 1)));
        }
        // Not a power of two: the 4 slopes of 4 heads, then slopes 1 and 3 of 8 heads.
        let four = alibi_slopes(4);
        assert_eq!(
            alibi_slopes(6),
            [four.as_slice(), &[eight[0], eight[2]]].concat()
        );
    }

    #[cfg(feature = "flex")]
    #[test]
    fn a_blocks_bias_is_the_bias_of_each_distance() {
        let device = Device::flex();
        let buckets = Buckets::T5 {
            num_buckets: 16,
            max_distance: 40,
            bidirectional: true,
        };
        let values: Vec<f32> = (0..3 * 16).map(|i| (i as f32 * 0.37).sin()).collect();
        let table = Tensor::<2>::from_data(TensorData::new(values.clone(), [3, 16]), &device);
        let learned = PositionBias::Learned { table, buckets };
        let alibi = PositionBias::Alibi {
            slopes: alibi_slopes(3),
        };
        for (rows, keys, offset) in [(0..1, 0..1, 0), (5..12, 0..30, 4), (3..40, 10..13, -7)] {
            let (r, k) = (rows.len(), keys.len());
            let got = learned.tensor(rows.clone(), keys.clone(), offset, &device, DType::F32);
            let got_alibi = alibi.tensor(rows.clone(), keys.clone(), offset, &device, DType::F32);
            let got: Vec<f32> = got.into_data().try_into_vec::<f32>().unwrap();
            let got_alibi: Vec<f32> = got_alibi.into_data().try_into_vec::<f32>().unwrap();
            for h in 0..3 {
                for (a, i) in rows.clone().enumerate() {
                    for (b, j) in keys.clone().enumerate() {
                        let d = j as i64 - (i as i64 + offset);
                        let at = (h * r + a) * k + b;
                        assert_eq!(got[at], values[h * 16 + buckets.of(d)], "{h} {i} {j}");
                        let want = -alibi_slopes(3)[h] * d.abs() as f32;
                        assert_eq!(got_alibi[at], want, "{h} {i} {j}");
                    }
                }
            }
        }
    }

    /// A select of more indices than wgpu's select backward takes at once: every
    /// gradient arrives, on every backend compiled in.
    #[test]
    fn long_selects_pass_every_gradient_back() {
        let n = 70_000; // past 65,535, in three selects
        let index: Vec<i64> = (0..n).map(|i| (i * 7 % 5) as i64).collect();
        for device in crate::testing::devices() {
            let table = Tensor::<2>::zeros([2, 5], &device).require_grad();
            let picked = select_columns(table.clone(), &index, &device);
            let weights = Tensor::<2>::ones([2, n], &device);
            let grads = (picked * weights).sum().backward();
            let got: Vec<f32> = table
                .grad(&grads)
                .unwrap()
                .into_data()
                .try_into_vec::<f32>()
                .unwrap();
            // Every bucket is picked n / 5 times; each pick adds 1 to its gradient.
            assert_eq!(got, vec![(n / 5) as f32; 10], "{device:?}");
        }
    }

    #[test]
    fn buckets_clip_and_space_logarithmically() {
        let clipped = Buckets::Clipped { max: 3 };
        let got: Vec<usize> = (-5..=5).map(|d| clipped.of(d)).collect();
        assert_eq!(got, [0, 0, 0, 1, 2, 3, 4, 5, 6, 6, 6]);
        // T5's defaults: exact up to 8 either side, log-spaced up to 128.
        let t5 = Buckets::T5 {
            num_buckets: 32,
            max_distance: 128,
            bidirectional: true,
        };
        assert_eq!(
            [t5.of(0), t5.of(-7), t5.of(7), t5.of(-1000), t5.of(1000)],
            [0, 7, 23, 15, 31]
        );
        let causal = Buckets::T5 {
            num_buckets: 32,
            max_distance: 128,
            bidirectional: false,
        };
        assert_eq!(
            [causal.of(5), causal.of(-5), causal.of(-15), causal.of(-500)],
            [0, 5, 15, 31]
        );
    }
}
