//! The tile product: `C += A · B` on two tiles a cube holds in shared memory, every unit
//! of the cube accumulating its own block of `C` in registers. Every product of the
//! kernels goes through it (`S = Q Kᵀ`, `O += P V`, and the backward's `dP = dO Vᵀ`,
//! `dV += Pᵀ dO`, `dK += dSᵀ Q`, `dQ += dS K`); the softmax, the masks and the loops
//! around it see only the registers it fills, through [`Product`]'s map from a unit and a
//! register to a row and a column of `C`.
//!
//! Shared memory holds tiles in quads, four neighbouring elements of a row read and
//! written at once ([`Quad`], a 128-bit access in f32): a unit owns a block of `C` of
//! whole quads of columns (`tx · cols ..`) and of rows (`ty · rows ..`). [`Registers`]
//! is the portable implementation: for each four steps along the summed dimension a unit
//! reads a quad of `A` per row it owns and a quad of `B` per step and quad of columns,
//! then multiplies every pair from registers, so that one read of four elements feeds
//! `4 · cols` (for `A`) or `4 · rows` (for `B`) multiply-adds. [`Cooperative`] computes
//! the same product on a device's cooperative matrices (tensor cores, through SPIR-V's
//! `SPV_KHR_cooperative_matrix`): each plane multiplies fragments of `A` and `B` read
//! from the tiles into an f32 accumulator, stores it to a scratch tile, and every unit
//! adds its block of `C` from there into the same registers; nothing else changes.

use cubecl::prelude::*;

/// Four neighbouring elements of a row of a tile: the unit of shared memory.
pub(crate) type Quad<E> = Vector<E, Const<4>>;

/// One product's shape and how a cube's units share it: `C` is `m x n`, the sum runs over
/// `k`; `ux` units along the columns and `units / ux` along the rows, each unit holding
/// [`rows`](Self::rows) x [`cols`](Self::cols) elements of `C`, whole quads of columns
/// (and of rows, when `A` is read transposed).
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
    /// that reads the fewest quads per four steps (`rows + cols / 4 · 4`), among those
    /// that give every unit whole quads of columns and, with `quad_rows`, of rows.
    ///
    /// # Panics
    /// If no split does (the tiles are chosen so that one does).
    pub(crate) fn new(m: usize, n: usize, k: usize, units: usize, quad_rows: bool) -> Self {
        let splits = (0..=units.trailing_zeros()).map(|p| 1usize << p);
        let fits = |ux: usize| {
            let uy = units / ux;
            n.is_multiple_of(4 * ux)
                && m.is_multiple_of(uy)
                && (!quad_rows || (m / uy).is_multiple_of(4))
        };
        let ux = splits
            .filter(|&ux| fits(ux))
            .min_by_key(|&ux| (m / (units / ux) + n / ux, usize::MAX - ux))
            .unwrap_or_else(|| panic!("no split of {units} units fits a {m} x {n} tile"));
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

    /// Columns of `C` each unit holds (a multiple of four).
    pub(crate) fn cols(&self) -> usize {
        self.n / self.ux
    }

    /// Elements of `C` each unit holds.
    pub(crate) fn len(&self) -> usize {
        self.rows() * self.cols()
    }
}

/// A tile in shared memory: `rows` rows of `cols` elements, rows `stride` elements apart
/// (`cols` rounded up to a multiple of `align`, a quad or two, and `align` more, so that
/// units reading one column of several rows reach different banks).
#[derive_cube_comptime]
pub(crate) struct Tile {
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    /// Elements the stride is a multiple of: 4, or 8 for the operands of cooperative
    /// matrices in 2-byte elements (whose rows a device reads 16 bytes apart;
    /// [`Fragment::tile`]).
    pub(crate) align: usize,
}

impl Tile {
    /// A tile of `rows` x `cols`, its rows a whole number of quads apart.
    pub(crate) fn new(rows: usize, cols: usize) -> Self {
        Self::aligned(rows, cols, 4)
    }

    /// A tile of `rows` x `cols`, its rows a multiple of `align` elements apart.
    pub(crate) fn aligned(rows: usize, cols: usize, align: usize) -> Self {
        Self { rows, cols, align }
    }

    /// Elements from one row to the next (a multiple of four).
    pub(crate) fn stride(&self) -> usize {
        self.cols.next_multiple_of(self.align) + self.align
    }

    /// Quads the tile takes.
    pub(crate) fn quads(&self) -> usize {
        self.rows * self.stride() / 4
    }
}

/// How a product reads its `A` from a tile: as stored (`A[r][k]` at row `r`, column `k`),
/// or transposed (at row `k`, column `r`).
#[derive_cube_comptime]
pub(crate) enum Read {
    AsStored,
    Transposed,
}

/// The unit's first row of `C` under `p`; its rows are `row0 .. row0 + p.rows()`.
#[cube]
pub(crate) fn row0(#[comptime] p: Product) -> usize {
    (UNIT_POS as usize / p.ux) * comptime!(p.rows())
}

/// The unit's first column of `C` under `p`; its columns are `col0 .. col0 + p.cols()`.
#[cube]
pub(crate) fn col0(#[comptime] p: Product) -> usize {
    (UNIT_POS as usize % p.ux) * comptime!(p.cols())
}

/// A way to compute a tile product.
#[cube]
pub(crate) trait TileProduct: Send + Sync + 'static {
    /// `c += a · b` under `p`: `a` holds `A` (`m x k`, read from `a_tile` as `read`
    /// says), `b` holds `B` (`k x n`, as stored in `b_tile`); both zero past `k` up to its
    /// next multiple of four. `c` holds the unit's [`Product::len`] elements of `C`,
    /// element `(i, j)` (row [`row0`] `+ i`, column [`col0`] `+ j`) at `i · cols + j`.
    /// Reads the tiles only: the caller synchronises the cube around it. `scratch` (at
    /// least [`Fragment::scratch`] quads) is the product's own, and `f` the fragment
    /// shape of [`Cooperative`] ([`Fragment::NONE`] for [`Registers`], which uses
    /// neither).
    #[allow(clippy::too_many_arguments)]
    fn product<A: Float, B: Float>(
        a: &Shared<[Quad<A>]>,
        #[comptime] a_tile: Tile,
        #[comptime] read: Read,
        b: &Shared<[Quad<B>]>,
        #[comptime] b_tile: Tile,
        c: &mut Array<f32>,
        #[comptime] p: Product,
        scratch: &mut Shared<[Quad<f32>]>,
        #[comptime] f: Fragment,
    );
}

/// The portable tile product: plain multiply-adds in f32 from registers.
pub(crate) struct Registers;

#[cube]
impl TileProduct for Registers {
    #[allow(unused_variables)]
    fn product<A: Float, B: Float>(
        a: &Shared<[Quad<A>]>,
        #[comptime] a_tile: Tile,
        #[comptime] read: Read,
        b: &Shared<[Quad<B>]>,
        #[comptime] b_tile: Tile,
        c: &mut Array<f32>,
        #[comptime] p: Product,
        scratch: &mut Shared<[Quad<f32>]>,
        #[comptime] f: Fragment,
    ) {
        let rows = comptime!(p.rows());
        let cols = comptime!(p.cols());
        let (a_row, b_row) = comptime!((a_tile.stride() / 4, b_tile.stride() / 4));
        let r0 = row0(p);
        let c0 = col0(p) / 4;
        let mut av = Array::<f32>::new(comptime!(rows * 4));
        let mut bv = Array::<f32>::new(comptime!(4 * cols));
        // Rolled: only the unit's block needs compile-time indices. Unrolled over `k` too,
        // the kernels took several times longer to compile (lavapipe runs no faster).
        for kq in 0..comptime!(p.k.div_ceil(4)) {
            // A's rows at steps 4·kq ..: a quad along the steps, or a quad of rows per step.
            #[comptime]
            match read {
                Read::AsStored =>
                {
                    #[unroll]
                    for i in 0..rows {
                        let q = a[(r0 + i) * a_row + kq];
                        #[unroll]
                        for t in 0..4usize {
                            av[comptime!(i * 4 + t)] = f32::cast_from(q.extract(t));
                        }
                    }
                }
                Read::Transposed =>
                {
                    #[unroll]
                    for t in 0..4usize {
                        #[unroll]
                        for i4 in 0..comptime!(rows / 4) {
                            let q = a[(kq * 4 + t) * a_row + r0 / 4 + i4];
                            #[unroll]
                            for ii in 0..4usize {
                                av[comptime!((i4 * 4 + ii) * 4 + t)] =
                                    f32::cast_from(q.extract(ii));
                            }
                        }
                    }
                }
            }
            #[unroll]
            for t in 0..4usize {
                #[unroll]
                for j4 in 0..comptime!(cols / 4) {
                    let q = b[(kq * 4 + t) * b_row + c0 + j4];
                    #[unroll]
                    for jj in 0..4usize {
                        bv[comptime!(t * cols + j4 * 4 + jj)] = f32::cast_from(q.extract(jj));
                    }
                }
            }
            #[unroll]
            for t in 0..4usize {
                #[unroll]
                for i in 0..rows {
                    #[unroll]
                    for j in 0..cols {
                        c[comptime!(i * cols + j)] +=
                            av[comptime!(i * 4 + t)] * bv[comptime!(t * cols + j)];
                    }
                }
            }
        }
    }
}

/// The shape of a cooperative matrix multiply-add, `m x k` times `k x n` into `m x n`,
/// as a device reports it, and the units of the subgroup (plane) that holds one: what
/// [`Cooperative`] computes each product in. Zero sizes ([`Fragment::NONE`]): no
/// cooperative matrices, the [`Registers`] product.
#[derive_cube_comptime]
pub(crate) struct Fragment {
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) plane: usize,
}

impl Fragment {
    /// No fragment: the portable product.
    pub(crate) const NONE: Self = Self {
        m: 0,
        n: 0,
        k: 0,
        plane: 1,
    };

    /// Whether this is a fragment (not [`Fragment::NONE`]).
    pub(crate) fn is_some(&self) -> bool {
        self.m > 0
    }

    /// Whether [`Cooperative`] can compute `p` in this fragment: `p` a whole number of
    /// fragments along each of its three sizes, its units whole planes.
    pub(crate) fn fits(&self, p: &Product) -> bool {
        self.is_some()
            && p.units.is_multiple_of(self.plane)
            && p.m.is_multiple_of(self.m)
            && p.n.is_multiple_of(self.n)
            && p.k.is_multiple_of(self.k)
    }

    /// Whether every one of the products `ps` fits this fragment.
    pub(crate) fn fits_all(&self, ps: &[Product]) -> bool {
        ps.iter().all(|p| self.fits(p))
    }

    /// A tile of `rows` x `cols` as the products in this fragment read it: rows 16 bytes
    /// of 2-byte elements apart (8 elements) for a fragment, a quad apart otherwise.
    pub(crate) fn tile(&self, rows: usize, cols: usize) -> Tile {
        Tile::aligned(rows, cols, if self.is_some() { 8 } else { 4 })
    }

    /// Bytes of each weight (`P`, `dS`) the kernels stage for products in this fragment:
    /// in the inputs' dtype (`size` bytes) for a fragment, in f32 otherwise.
    pub(crate) fn weight_bytes(&self, size: usize) -> usize {
        if self.is_some() { size } else { 4 }
    }

    /// Quads of scratch [`Cooperative`] takes for the products `ps`: the largest `C`, as
    /// an f32 tile; one quad for [`Registers`].
    pub(crate) fn scratch(&self, ps: &[Product]) -> usize {
        match self.is_some() {
            true => ps
                .iter()
                .map(|p| Tile::new(p.m, p.n).quads())
                .max()
                .unwrap_or(1),
            false => 1,
        }
    }
}

/// Where a product's fragments lie, for [`Cooperative`] and [`Emulated`] alike: `C`'s
/// fragment `i` (row by row, `across` to a row of `C`) is taken by plane `i % planes`;
/// `A`'s element `(r, k)` lies at `r · along_r + k · along_k` of its tile (row-major as
/// stored, column-major when read transposed), `B`'s `(k, c)` at `k · b_row + c`, `C`'s
/// `(r, c)` at `r · c_row + c` of the scratch (`c_quads` quads).
#[derive_cube_comptime]
pub(crate) struct Fragments {
    pub(crate) a_row: usize,
    pub(crate) along_r: usize,
    pub(crate) along_k: usize,
    pub(crate) b_row: usize,
    pub(crate) c_row: usize,
    pub(crate) c_quads: usize,
    pub(crate) across: usize,
    pub(crate) count: usize,
    pub(crate) planes: usize,
}

impl Fragments {
    /// The fragments of `p` in `f`, `A` in `a_tile` read as `read`, `B` in `b_tile`.
    ///
    /// # Panics
    /// Unless `p` is whole fragments of `f` ([`Fragment::fits`]).
    pub(crate) fn of(a_tile: Tile, read: Read, b_tile: Tile, p: Product, f: Fragment) -> Self {
        assert!(f.fits(&p), "a {p:?} in fragments of {f:?}");
        let a_row = a_tile.stride();
        let (along_r, along_k) = match read {
            Read::AsStored => (a_row, 1),
            Read::Transposed => (1, a_row),
        };
        let c = Tile::new(p.m, p.n);
        Self {
            a_row,
            along_r,
            along_k,
            b_row: b_tile.stride(),
            c_row: c.stride(),
            c_quads: c.quads(),
            across: p.n / f.n,
            count: p.m / f.m * (p.n / f.n),
            planes: p.units / f.plane,
        }
    }
}

/// The tile product on cooperative matrices: `A` and `B` in f16 or bf16 (the dtypes a
/// device multiplies, [`Fragment`] the shape it reports for them), the sums in f32. The
/// cube's planes (units `plane · i ..` of the subgroup size the device reports, known
/// when the kernel is compiled: cubecl 0.11.3 reads `PLANE_DIM` without declaring the
/// capability SPIR-V asks for it) take `C`'s fragments in turn ([`Fragments`]), each
/// summing its fragment over `k` from fragments of `A` (row-major
/// as stored, column-major when read transposed) and `B` read from the tiles in place;
/// it stores the sum to `scratch` (`C` as an f32 [`Tile`] of `m x n`), and after a
/// barrier every unit adds its block of `C` (the same map as [`Registers`]) into `c`.
/// Every tile it reads starts on 32 bytes with rows a multiple of 16 bytes apart
/// ([`Fragment::tile`]).
pub(crate) struct Cooperative;

#[cube]
impl TileProduct for Cooperative {
    fn product<A: Float, B: Float>(
        a: &Shared<[Quad<A>]>,
        #[comptime] a_tile: Tile,
        #[comptime] read: Read,
        b: &Shared<[Quad<B>]>,
        #[comptime] b_tile: Tile,
        c: &mut Array<f32>,
        #[comptime] p: Product,
        scratch: &mut Shared<[Quad<f32>]>,
        #[comptime] f: Fragment,
    ) {
        let g = comptime!(Fragments::of(a_tile, read, b_tile, p, f));
        // A fragment names the layout it is read in (SPIR-V reads the load's, CUDA's wmma
        // and Metal the fragment's): row-major as stored, column-major when read
        // transposed.
        let layout = comptime!(match read {
            Read::AsStored => cmma::MatrixLayout::RowMajor,
            Read::Transposed => cmma::MatrixLayout::ColMajor,
        });
        let mut at = UNIT_POS as usize / f.plane;
        while at < g.count {
            let (r, col) = ((at / g.across) * f.m, (at % g.across) * f.n);
            let acc = cmma::Matrix::<f32>::from_value(
                cmma::MatrixIdent::Accumulator,
                f.m,
                f.n,
                f.k,
                cmma::MatrixLayout::Undefined,
                0.0f32,
            );
            for step in 0..comptime!(p.k / f.k) {
                let kk = step * f.k;
                let mut fa = unsafe {
                    cmma::Matrix::<A>::uninitialized(cmma::MatrixIdent::A, f.m, f.n, f.k, layout)
                };
                cmma::load_with_layout(
                    &mut fa,
                    &a[(r * g.along_r + kk * g.along_k) / 4..comptime!(a_tile.quads())],
                    g.a_row as u32,
                    layout,
                );
                let mut fb = unsafe {
                    cmma::Matrix::<B>::uninitialized(
                        cmma::MatrixIdent::B,
                        f.m,
                        f.n,
                        f.k,
                        cmma::MatrixLayout::RowMajor,
                    )
                };
                cmma::load_with_layout(
                    &mut fb,
                    &b[(kk * g.b_row + col) / 4..comptime!(b_tile.quads())],
                    g.b_row as u32,
                    cmma::MatrixLayout::RowMajor,
                );
                cmma::execute(&fa, &fb, &acc, &acc);
            }
            cmma::store(
                &mut scratch[(r * g.c_row + col) / 4..g.c_quads],
                &acc,
                g.c_row as u32,
                cmma::MatrixLayout::RowMajor,
            );
            at += g.planes;
        }
        add_scratch(c, scratch, p);
    }
}

/// After a barrier, adds the unit's block of `C` under `p` (as [`Registers`] holds it)
/// from `scratch` (`C` as an f32 tile of `m x n`) to `c`; then a barrier, after which
/// `scratch` is free again.
#[cube]
fn add_scratch(c: &mut Array<f32>, scratch: &mut Shared<[Quad<f32>]>, #[comptime] p: Product) {
    sync_cube();
    let c_row = comptime!(Tile::new(p.m, p.n).stride());
    let (rows, cols) = comptime!((p.rows(), p.cols()));
    let (r0, c0) = (row0(p), col0(p) / 4);
    #[unroll]
    for i in 0..rows {
        #[unroll]
        for j4 in 0..comptime!(cols / 4) {
            let q = scratch[(r0 + i) * comptime!(c_row / 4) + c0 + j4];
            #[unroll]
            for jj in 0..4usize {
                c[comptime!(i * cols + j4 * 4 + jj)] += q.extract(jj);
            }
        }
    }
    sync_cube();
}

/// [`Cooperative`] on a device without cooperative matrices, for the tests (Mesa's
/// lavapipe): the same planes and fragments, read at the same offsets in the same
/// layouts, summed in f32 into the same scratch and added back the same way, but each
/// fragment's multiply-adds done by its plane's units (unit `l` of a plane sums the
/// fragment's quads `l`, `l + plane`, ...) from shared memory. Only the cooperative
/// matrix operations themselves differ.
pub(crate) struct Emulated;

#[cube]
impl TileProduct for Emulated {
    fn product<A: Float, B: Float>(
        a: &Shared<[Quad<A>]>,
        #[comptime] a_tile: Tile,
        #[comptime] read: Read,
        b: &Shared<[Quad<B>]>,
        #[comptime] b_tile: Tile,
        c: &mut Array<f32>,
        #[comptime] p: Product,
        scratch: &mut Shared<[Quad<f32>]>,
        #[comptime] f: Fragment,
    ) {
        let g = comptime!(Fragments::of(a_tile, read, b_tile, p, f));
        let quads = comptime!(f.m * f.n / 4);
        let lane = UNIT_POS as usize % f.plane;
        let mut at = UNIT_POS as usize / f.plane;
        while at < g.count {
            let (r, col) = ((at / g.across) * f.m, (at % g.across) * f.n);
            let mut e = lane;
            while e < quads {
                let (i, j4) = (e / comptime!(f.n / 4), e % comptime!(f.n / 4));
                let mut sum = Quad::<f32>::empty().fill(0.0f32);
                for step in 0..comptime!(p.k / f.k) {
                    let kk = step * f.k;
                    // The fragments' first elements, as `Cooperative` loads them.
                    let (a0, b0) = (r * g.along_r + kk * g.along_k, kk * g.b_row + col);
                    #[unroll]
                    for t in 0..f.k {
                        let at_a = a0 + i * g.along_r + t * g.along_k;
                        let x = f32::cast_from(a[at_a / 4].extract_dynamic(at_a % 4));
                        let y = b[(b0 + t * g.b_row) / 4 + j4];
                        #[unroll]
                        for jj in 0..4usize {
                            let v = sum.extract(jj) + x * f32::cast_from(y.extract(jj));
                            sum.insert(jj, v);
                        }
                    }
                }
                scratch[((r + i) * g.c_row + col) / 4 + j4] = sum;
                e += f.plane;
            }
            at += g.planes;
        }
        add_scratch(c, scratch, p);
    }
}

/// A tile of `quads` quads of shared memory, starting on 32 bytes: where cooperative
/// matrices read it (Vulkan asks 16 bytes, CUDA's `wmma` 32).
#[cube]
pub(crate) fn shared_tile<E: Float>(#[comptime] quads: usize) -> Shared<[Quad<E>]> {
    Shared::<[Quad<E>]>::new_aligned_slice(quads, 32usize)
}

/// Zeros the unit's elements of `C` under `p`.
#[cube]
pub(crate) fn zero(c: &mut Array<f32>, #[comptime] p: Product) {
    #[unroll]
    for e in 0..comptime!(p.len()) {
        c[e] = 0.0f32;
    }
}

/// Writes the unit's elements of `c` under `p` to `tile` (`C` as stored, in its dtype), a
/// quad at a time.
#[cube]
pub(crate) fn write_tile<E: Float>(
    tile: &mut Shared<[Quad<E>]>,
    #[comptime] t: Tile,
    c: &Array<f32>,
    #[comptime] p: Product,
) {
    let (rows, cols) = comptime!((p.rows(), p.cols()));
    let row = comptime!(t.stride() / 4);
    let (r0, c0) = (row0(p), col0(p) / 4);
    #[unroll]
    for i in 0..rows {
        #[unroll]
        for j4 in 0..comptime!(cols / 4) {
            let mut q = Quad::<E>::empty();
            #[unroll]
            for jj in 0..4usize {
                q.insert(jj, E::cast_from(c[comptime!(i * cols + j4 * 4 + jj)]));
            }
            tile[(r0 + i) * row + c0 + j4] = q;
        }
    }
}

/// The element at row `r`, column `c` of `tile`, in f32.
#[cube]
pub(crate) fn element<E: Float>(
    tile: &Shared<[Quad<E>]>,
    #[comptime] t: Tile,
    r: usize,
    c: usize,
) -> f32 {
    f32::cast_from(tile[r * comptime!(t.stride() / 4) + c / 4].extract_dynamic(c % 4))
}

/// Stages rows `first .. first + rows` of one head of `src` (its rows along axis 2, its
/// columns along axis 3, the head at `at`) into `tile` as `S`: as stored (`tile[r][c]`
/// is row `first + r`, column `c`) or transposed (`tile[c][r]`); `cols` columns read, rows
/// from `end` on and every other element of the tile's quads zero. Every unit of the cube
/// a share of the quads, neighbouring units reading neighbouring columns of a row. `src`
/// is read `N` elements at a time: with `N` = 4 (rows of whole quads, one apart) a quad
/// of a row is one read, and a transposed tile is written by blocks of four rows by four
/// columns. The caller synchronises the cube before the tile is read.
#[cube]
#[allow(clippy::too_many_arguments)]
pub(crate) fn stage<F: Float, N: Size, S: Float>(
    src: &Tensor<Vector<F, N>>,
    at: usize,
    first: usize,
    end: usize,
    tile: &mut Shared<[Quad<S>]>,
    #[comptime] t: Tile,
    #[comptime] read: Read,
    #[comptime] rows: usize,
    #[comptime] cols: usize,
    #[comptime] units: usize,
) {
    let unit = UNIT_POS as usize;
    let (row_stride, col_stride) = (src.stride(2), src.stride(3));
    let row = comptime!(t.stride() / 4);
    let width = N::value();
    let quads = comptime!(t.cols.div_ceil(4));
    #[comptime]
    match read {
        Read::AsStored => {
            // Quad `c4` of row `r`: four columns of one source row.
            let total = comptime!(t.rows * quads);
            #[unroll]
            for step in 0..comptime!(total.div_ceil(units)) {
                let e = comptime!(step * units) + unit;
                if comptime!(total.is_multiple_of(units)) || e < total {
                    let (r, c4) = (e / quads, e % quads);
                    let source = first + r;
                    let live = r < rows && source < end;
                    if comptime!(width == 4) {
                        let mut q = Quad::<S>::empty().fill(S::cast_from(0.0f32));
                        if live && c4 * 4 < cols {
                            let v = src[(at + source * row_stride) / 4 + c4];
                            #[unroll]
                            for cc in 0..4usize {
                                q.insert(cc, S::cast_from(v.extract(cc)));
                            }
                        }
                        tile[r * row + c4] = q;
                    } else {
                        let mut q = Quad::<S>::empty();
                        #[unroll]
                        for cc in 0..4usize {
                            let c = c4 * 4 + cc;
                            let mut x = 0.0f32;
                            if live && c < cols {
                                x = f32::cast_from(
                                    src[at + source * row_stride + c * col_stride].extract(0usize),
                                );
                            }
                            q.insert(cc, S::cast_from(x));
                        }
                        tile[r * row + c4] = q;
                    }
                }
            }
        }
        Read::Transposed => {
            if comptime!(width == 4) {
                // Block `(r4, c4)`: four source rows by four columns, four reads, four
                // quads (tile rows `4·c4 ..`, each a column of the four source rows).
                let blocks = comptime!(t.cols.div_ceil(4) * t.rows.div_ceil(4));
                #[unroll]
                for step in 0..comptime!(blocks.div_ceil(units)) {
                    let e = comptime!(step * units) + unit;
                    if comptime!(blocks.is_multiple_of(units)) || e < blocks {
                        let c4s = comptime!(t.rows.div_ceil(4));
                        let (r4, c4) = (e / c4s, e % c4s);
                        let mut v = Array::<Quad<f32>>::new(4usize);
                        #[unroll]
                        for rr in 0..4usize {
                            let r = r4 * 4 + rr;
                            let source = first + r;
                            let mut q = Quad::<f32>::empty().fill(0.0f32);
                            if r < rows && source < end && c4 * 4 < cols {
                                let x = src[(at + source * row_stride) / 4 + c4];
                                #[unroll]
                                for cc in 0..4usize {
                                    q.insert(cc, f32::cast_from(x.extract(cc)));
                                }
                            }
                            v[rr] = q;
                        }
                        #[unroll]
                        for cc in 0..4usize {
                            let mut q = Quad::<S>::empty();
                            #[unroll]
                            for rr in 0..4usize {
                                q.insert(rr, S::cast_from(v[rr].extract(cc)));
                            }
                            tile[(c4 * 4 + cc) * row + r4] = q;
                        }
                    }
                }
            } else {
                // Quad `r4` of row `c`: one column of four source rows.
                let total = comptime!(t.rows * quads);
                #[unroll]
                for step in 0..comptime!(total.div_ceil(units)) {
                    let e = comptime!(step * units) + unit;
                    if comptime!(total.is_multiple_of(units)) || e < total {
                        let (r4, c) = (e / t.rows, e % t.rows);
                        let mut q = Quad::<S>::empty();
                        #[unroll]
                        for rr in 0..4usize {
                            let r = r4 * 4 + rr;
                            let source = first + r;
                            let mut x = 0.0f32;
                            if r < rows && source < end && c < cols {
                                x = f32::cast_from(
                                    src[at + source * row_stride + c * col_stride].extract(0usize),
                                );
                            }
                            q.insert(rr, S::cast_from(x));
                        }
                        tile[c * row + r4] = q;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_split_reads_the_fewest_quads_with_whole_quads_per_unit() {
        // 32 x 32 over 64 units: 4 x 4 per unit.
        let p = Product::new(32, 32, 64, 64, false);
        assert_eq!((p.ux, p.uy(), p.rows(), p.cols()), (8, 8, 4, 4));
        // 64 x 64 over 128 units, rows in quads too: 8 x 4 or 4 x 8, whichever reads less.
        let p = Product::new(64, 64, 32, 128, true);
        assert_eq!(p.len(), 32);
        assert!(p.rows().is_multiple_of(4) && p.cols().is_multiple_of(4));
        // 32 rows of 128 columns over 128 units: whole quads of columns.
        let p = Product::new(32, 128, 32, 128, false);
        assert!(p.cols().is_multiple_of(4), "{p:?}");
        assert_eq!(p.len(), 32);
    }

    #[test]
    #[should_panic(expected = "no split")]
    fn a_tile_too_small_for_whole_quads_has_no_split() {
        // 16 x 16 over 64 units: rows in whole quads leave 4 units for 16 columns.
        Product::new(16, 16, 8, 64, true);
    }

    #[test]
    fn a_tile_pads_its_rows_to_a_quad_and_one_more() {
        let t = Tile::new(3, 10);
        assert_eq!((t.stride(), t.quads()), (16, 12));
        assert_eq!(Tile::new(2, 32).stride(), 36);
    }
}
