//! Rotary position embeddings (Su et al., "RoFormer"): each query and key is rotated, pair
//! of features by pair, by angles proportional to its position, so that their dot product
//! depends on the distance between them. Applied after the projections, to the `H` query
//! heads and the `Hkv` key heads alike (grouped-query attention needs nothing more).

use std::cell::RefCell;

use burn::tensor::{Device, Tensor, TensorData};
use serde::{Deserialize, Serialize};

/// Which features of a head rotate together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum RopeLayout {
    /// Feature `i` with feature `i + D/2` (GPT-NeoX, Hugging Face's Llama). The default.
    #[default]
    HalfSplit,
    /// Feature `2i` with feature `2i + 1` (RoFormer, GPT-J, Meta's Llama checkpoints).
    Interleaved,
}

/// Rotary embeddings of heads `head_dim` wide: the pair `k` of a token at position `p`
/// turns by `p · theta^(-2k / head_dim)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// The base of the frequencies (10000 in the paper; larger for long contexts).
    pub theta: f64,
    /// Which features pair up.
    pub layout: RopeLayout,
    /// The width of a head (even).
    pub head_dim: usize,
}

impl Rope {
    /// `x` `[B, H, T, D]` rotated: row `t` of batch row `b` stands at `positions[b][t]`
    /// (`positions` has one row for every batch row, or one row for all).
    ///
    /// # Panics
    /// If `head_dim` is odd or 0, `theta` is not a finite number above 1, `D` is not
    /// `head_dim`, or `positions` do not cover `[B or 1, T]`.
    pub fn apply(&self, x: Tensor<4>, positions: &[Vec<usize>]) -> Tensor<4> {
        let [batch, heads, len, dim] = x.dims();
        assert!(
            self.head_dim > 0 && self.head_dim.is_multiple_of(2),
            "Rope: head_dim must be even and at least 2, got {}",
            self.head_dim
        );
        assert!(
            self.theta.is_finite() && self.theta > 1.0,
            "Rope: theta must be a finite number above 1, got {}",
            self.theta
        );
        assert_eq!(
            dim, self.head_dim,
            "Rope: heads are {} wide, got {dim}",
            self.head_dim
        );
        let rows = positions.len();
        assert!(
            (rows == 1 || rows == batch) && positions.iter().all(|p| p.len() == len),
            "Rope: positions must be [1 or B = {batch}, T = {len}], got {rows} row(s) of {:?} \
             position(s)",
            positions.iter().map(Vec::len).collect::<Vec<_>>()
        );
        if rows == 0 {
            return x; // No batch row: nothing to turn.
        }
        let half = dim / 2;
        let (cos, sin) = self.angles(positions, &x.device()); // [rows, 1, T, D/2]
        let dtype = x.dtype();
        let (cos, sin) = (cos.cast(dtype), sin.cast(dtype));
        match self.layout {
            RopeLayout::HalfSplit => {
                let a = x.clone().narrow(3, 0, half);
                let b = x.narrow(3, half, half);
                let turned_a = a.clone() * cos.clone() - b.clone() * sin.clone();
                let turned_b = b * cos + a * sin;
                Tensor::cat(vec![turned_a, turned_b], 3)
            }
            RopeLayout::Interleaved => {
                let pairs = x.reshape([batch, heads, len, half, 2]);
                let a = pairs.clone().narrow(4, 0, 1).squeeze_dim::<4>(4);
                let b = pairs.narrow(4, 1, 1).squeeze_dim::<4>(4);
                let turned_a = a.clone() * cos.clone() - b.clone() * sin.clone();
                let turned_b = b * cos + a * sin;
                Tensor::stack::<5>(vec![turned_a, turned_b], 4).reshape([batch, heads, len, dim])
            }
        }
    }

    /// The cosines and sines of every position's angles, `[rows, 1, T, D/2]`, computed in
    /// f64 on the host (a device's `sin` of a large angle is far less exact).
    fn angles(&self, positions: &[Vec<usize>], device: &Device) -> (Tensor<4>, Tensor<4>) {
        let (rows, len) = (positions.len(), positions[0].len());
        let (cos, sin) = self.host_angles(positions);
        let half = self.head_dim / 2;
        let tensor =
            |values| Tensor::<4>::from_data(TensorData::new(values, [rows, 1, len, half]), device);
        (tensor(cos), tensor(sin))
    }

    /// [`angles`](Self::angles)' values, row-major. A model rotates the queries and the
    /// keys of every layer at the same positions: the last table computed on this thread
    /// is kept, and a call for the same rotation and positions copies it (the sines and
    /// cosines took a few percent of a Llama forward's time, computed anew per call). A
    /// table of more than [`KEPT`] values or [`KEPT_POSITIONS`] positions, or of no
    /// value, is not kept: a thread holds at most 10 MiB.
    fn host_angles(&self, positions: &[Vec<usize>]) -> (Vec<f32>, Vec<f32>) {
        thread_local! {
            static LAST: RefCell<Option<Table>> = const { RefCell::new(None) };
        }
        LAST.with_borrow_mut(|last| {
            if let Some(table) = last
                .as_ref()
                .filter(|t| t.rope == *self && t.positions == positions)
            {
                return (table.cos.clone(), table.sin.clone());
            }
            #[cfg(test)]
            tests::COMPUTED.set(tests::COMPUTED.get() + 1);
            let half = self.head_dim / 2;
            let frequencies: Vec<f64> = (0..half)
                .map(|k| self.theta.powf(-2.0 * k as f64 / self.head_dim as f64))
                .collect();
            let (rows, len) = (positions.len(), positions[0].len());
            let mut cos = Vec::with_capacity(rows * len * half);
            let mut sin = Vec::with_capacity(rows * len * half);
            for &p in positions.iter().flatten() {
                for f in &frequencies {
                    let (s, c) = (p as f64 * f).sin_cos();
                    cos.push(c as f32);
                    sin.push(s as f32);
                }
            }
            let table = Table {
                rope: *self,
                positions: positions.to_vec(),
                cos,
                sin,
            };
            let count = positions.iter().map(Vec::len).sum::<usize>();
            if half == 0 || table.cos.len() > KEPT || count > KEPT_POSITIONS {
                *last = None;
                return (table.cos, table.sin);
            }
            let values = (table.cos.clone(), table.sin.clone());
            *last = Some(table);
            values
        })
    }
}

/// The most cosines (and as many sines) a thread keeps of its last table: 4 MiB of each,
/// 16,384 positions of heads 128 wide.
const KEPT: usize = 1 << 20;

/// The most positions a thread keeps with its last table (2 MiB).
const KEPT_POSITIONS: usize = 1 << 18;

/// The sines and cosines of one rotation at some positions (see [`Rope::host_angles`]).
struct Table {
    rope: Rope,
    positions: Vec<Vec<usize>>,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::{Rope, RopeLayout};

    thread_local! {
        /// Tables computed on this thread (not copied from the kept one).
        pub(super) static COMPUTED: Cell<usize> = const { Cell::new(0) };
    }

    /// Each call's table is its own rotation's at its own positions, whatever the call
    /// before it on the thread computed; a call like the one before it copies its table,
    /// any other computes one.
    #[test]
    fn the_kept_table_serves_only_the_same_rotation_and_positions() {
        let rope = |theta, head_dim| Rope {
            theta,
            layout: RopeLayout::HalfSplit,
            head_dim,
        };
        let direct = |r: Rope, positions: &[Vec<usize>]| -> (Vec<f32>, Vec<f32>) {
            let half = r.head_dim / 2;
            let angles = positions.iter().flatten().flat_map(|&p| {
                (0..half).map(move |k| p as f64 * r.theta.powf(-2.0 * k as f64 / r.head_dim as f64))
            });
            let angles: Vec<f64> = angles.collect();
            (
                angles.iter().map(|a| a.cos() as f32).collect(),
                angles.iter().map(|a| a.sin() as f32).collect(),
            )
        };
        // Each call, and whether it computes its table.
        let long = vec![(0..super::KEPT_POSITIONS + 1).collect::<Vec<usize>>()];
        let calls: Vec<(Rope, Vec<Vec<usize>>, bool)> = vec![
            (rope(10_000.0, 8), vec![vec![0, 1, 2, 3]], true),
            (rope(10_000.0, 8), vec![vec![0, 1, 2, 3]], false),
            (rope(10_000.0, 8), vec![vec![0, 1, 2, 4]], true),
            (rope(500.0, 8), vec![vec![0, 1, 2, 4]], true),
            (rope(500.0, 6), vec![vec![0, 1, 2, 4]], true),
            (rope(500.0, 6), vec![vec![0, 1, 2, 4]], false),
            (rope(500.0, 4), vec![vec![0, 1, 2, 4, 5, 6]], true),
            (rope(500.0, 4), vec![vec![0, 1, 2], vec![4, 5, 6]], true),
            (rope(500.0, 4), vec![vec![0, 1, 2], vec![4, 5, 6]], false),
            // Past what a thread keeps: computed each time, the last table dropped.
            (rope(500.0, 2), long.clone(), true),
            (rope(500.0, 2), long, true),
            (rope(500.0, 4), vec![vec![0, 1, 2], vec![4, 5, 6]], true),
        ];
        for (i, (r, positions, computes)) in calls.iter().enumerate() {
            let before = COMPUTED.get();
            assert_eq!(r.host_angles(positions), direct(*r, positions), "call {i}");
            assert_eq!(COMPUTED.get() - before, *computes as usize, "call {i}");
        }
    }
}
