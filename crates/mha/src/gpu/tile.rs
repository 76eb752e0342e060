//! The tile product: `C += A · B` on two tiles a cube holds in shared memory, every unit
//! of the cube accumulating its own block of `C` in registers. Every product of the
//! kernels goes through it (`S = Q Kᵀ`, `O += P V`, and the backward's `dP = dO Vᵀ`,
//! `dV += Pᵀ dO`, `dK += dSᵀ Q`, `dQ += dS K`); the softmax, the masks and the loops
//! around it see only the registers it fills, through [`Product`]'s map from a unit and a
//! register to a row and a column of `C`.
//!
//! [`Registers`] is the portable implementation: for each step along the summed dimension
//! a unit reads its rows' elements of `A` and its columns' elements of `B` once into
//! registers and multiplies every pair, so that each shared-memory read feeds as many
//! multiply-adds as the unit has columns (for `A`) or rows (for `B`). A cube's units own
//! rows `ty + uy · i` and columns `tx + ux · j` (`tx = unit % ux`, `ty = unit / ux`):
//! neighbouring units read neighbouring columns of `B`, and the few rows of `A` a plane
//! reads are the same for many of its units. An implementation on cooperative matrices
//! (tensor cores) computes the same product on fragments and leaves `C` in the same
//! registers; nothing else changes.

use cubecl::prelude::*;

/// One product's shape and how a cube's units share it: `C` is `m x n`, the sum runs over
/// `k`; `ux` units along the columns and `units / ux` along the rows, each unit holding
/// [`rows`](Self::rows) x [`cols`](Self::cols) elements of `C`.
#[derive_cube_comptime]
pub(crate) struct Product {
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) ux: usize,
    pub(crate) units: usize,
}

impl Product {
    /// The product `m x n` over `k` shared by `units` units (a power of two): the split
    /// that reads the fewest elements per step, `m / uy + n / ux`, among those that divide
    /// `m` and `n` (ties: more units along the columns, whose reads are contiguous).
    ///
    /// # Panics
    /// If no split divides both (the tiles are chosen so that one does).
    pub(crate) fn new(m: usize, n: usize, k: usize, units: usize) -> Self {
        let splits = (0..=units.trailing_zeros()).map(|p| 1usize << p);
        let ux = splits
            .filter(|&ux| n.is_multiple_of(ux) && m.is_multiple_of(units / ux))
            .min_by_key(|&ux| (m / (units / ux) + n / ux, usize::MAX - ux))
            .unwrap_or_else(|| panic!("no split of {units} units divides a {m} x {n} tile"));
        Self { m, n, k, ux, units }
    }

    /// Units along the rows.
    pub(crate) fn uy(&self) -> usize {
        self.units / self.ux
    }

    /// Rows of `C` each unit holds.
    pub(crate) fn rows(&self) -> usize {
        self.m / self.uy()
    }

    /// Columns of `C` each unit holds.
    pub(crate) fn cols(&self) -> usize {
        self.n / self.ux
    }

    /// Elements of `C` each unit holds.
    pub(crate) fn len(&self) -> usize {
        self.rows() * self.cols()
    }
}

/// Where a tile's elements lie in a shared array: element `(r, c)` at `r · row + c ·
/// col`. A tile stored row by row has `col = 1`; read transposed, `row = 1`.
#[derive_cube_comptime]
pub(crate) struct Layout {
    pub(crate) row: usize,
    pub(crate) col: usize,
}

impl Layout {
    /// Rows of `cols` elements, one padding element after each, so that units reading one
    /// column of several rows hit different banks.
    pub(crate) fn rows_of(cols: usize) -> Self {
        Self {
            row: cols + 1,
            col: 1,
        }
    }

    /// The same elements read transposed: element `(r, c)` of the result is `(c, r)`.
    pub(crate) fn transposed(self) -> Self {
        Self {
            row: self.col,
            col: self.row,
        }
    }
}

/// The unit's row `i` of `C` under `p`.
#[cube]
pub(crate) fn row_of(#[comptime] p: Product, #[comptime] i: usize) -> usize {
    UNIT_POS as usize / p.ux + comptime!(p.uy() * i)
}

/// The unit's column `j` of `C` under `p`.
#[cube]
pub(crate) fn col_of(#[comptime] p: Product, #[comptime] j: usize) -> usize {
    UNIT_POS as usize % p.ux + comptime!(p.ux * j)
}

/// A way to compute a tile product.
#[cube]
pub(crate) trait TileProduct: Send + Sync + 'static {
    /// `c += a · b` under `p`, `a` an `m x k` tile of shared memory in `a_layout`, `b` a
    /// `k x n` tile in `b_layout`; `c` holds the unit's [`Product::len`] elements of `C`,
    /// element `(i, j)` (rows [`row_of`], columns [`col_of`]) at `i · cols + j`. Reads
    /// shared memory only: the caller synchronises the cube around it.
    fn product<A: Float, B: Float>(
        a: &Shared<[A]>,
        #[comptime] a_layout: Layout,
        b: &Shared<[B]>,
        #[comptime] b_layout: Layout,
        c: &mut Array<f32>,
        #[comptime] p: Product,
    );
}

/// The portable tile product: plain multiply-adds in f32 from registers.
pub(crate) struct Registers;

#[cube]
impl TileProduct for Registers {
    fn product<A: Float, B: Float>(
        a: &Shared<[A]>,
        #[comptime] a_layout: Layout,
        b: &Shared<[B]>,
        #[comptime] b_layout: Layout,
        c: &mut Array<f32>,
        #[comptime] p: Product,
    ) {
        let rows = comptime!(p.rows());
        let cols = comptime!(p.cols());
        let a_at = (UNIT_POS as usize / p.ux) * a_layout.row;
        let b_at = (UNIT_POS as usize % p.ux) * b_layout.col;
        let mut av = Array::<f32>::new(rows);
        let mut bv = Array::<f32>::new(cols);
        #[unroll]
        for kk in 0..p.k {
            #[unroll]
            for i in 0..rows {
                av[i] = f32::cast_from(
                    a[a_at + comptime!(p.uy() * i * a_layout.row + kk * a_layout.col)],
                );
            }
            #[unroll]
            for j in 0..cols {
                bv[j] = f32::cast_from(
                    b[b_at + comptime!(kk * b_layout.row + p.ux * j * b_layout.col)],
                );
            }
            #[unroll]
            for i in 0..rows {
                #[unroll]
                for j in 0..cols {
                    c[i * cols + j] += av[i] * bv[j];
                }
            }
        }
    }
}

/// Zeros the unit's elements of `C` under `p`.
#[cube]
pub(crate) fn zero(c: &mut Array<f32>, #[comptime] p: Product) {
    #[unroll]
    for e in 0..comptime!(p.len()) {
        c[e] = 0.0f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_reads_the_fewest_elements_per_step() {
        // 32 x 32 over 64 units: 4 x 4 per unit (8 reads per step), not 2 x 8 or 8 x 2.
        let p = Product::new(32, 32, 64, 64);
        assert_eq!((p.ux, p.uy(), p.rows(), p.cols()), (8, 8, 4, 4));
        // 32 rows of 128 columns over 128 units: 8 x 4 (as few reads as 4 x 8, with more
        // units along the columns).
        let p = Product::new(32, 128, 32, 128);
        assert_eq!((p.ux, p.rows(), p.cols()), (32, 8, 4));
        // A tall tile: more units along the rows.
        let p = Product::new(64, 16, 8, 64);
        assert_eq!((p.rows(), p.cols()), (4, 4));
        assert_eq!(p.len(), 16);
    }

    #[test]
    fn a_layout_reads_its_elements_transposed() {
        let rows = Layout::rows_of(32);
        assert_eq!((rows.row, rows.col), (33, 1));
        let t = rows.transposed();
        assert_eq!((t.row, t.col), (1, 33));
    }
}
