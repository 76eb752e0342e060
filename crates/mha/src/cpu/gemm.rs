//! The matrix kernel of the attention tiles, `C (+)= A B` with A read through its
//! strides, per instruction set: plain loops for any CPU ([`portable`]), on x86-64 with
//! AVX2 and FMA register tiles of 6 x 16 outputs ([`avx2`]), and with AVX-512 tiles of
//! 8 x 32 ([`avx512`]). `super::isa` chooses among them; each is tested against a plain
//! f64 product.
//!
//! The tiles' products are small (64 x 64 by a head's width) and fused with the softmax
//! between them; the linear layers' large products go through the `gemm` crate instead
//! (`super::linear`, which says why with the measurement).

/// [`gemm`](self) in plain loops, for any CPU.
///
/// # Safety
/// As [`Arch::gemm`](super::isa::Arch::gemm).
#[inline(always)]
pub(super) unsafe fn portable(
    [m, n, k]: [usize; 3],
    (a, rsa, csa): (*const f32, usize, usize),
    (b, ldb): (*const f32, usize),
    (c, ldc): (*mut f32, usize),
    add: bool,
) {
    for i in 0..m {
        // SAFETY: the caller's contract.
        let c_row = unsafe { std::slice::from_raw_parts_mut(c.add(i * ldc), n) };
        if !add {
            c_row.fill(0.0);
        }
        for p in 0..k {
            // SAFETY: the caller's contract.
            let (x, b_row) = unsafe {
                (
                    *a.add(i * rsa + p * csa),
                    std::slice::from_raw_parts(b.add(p * ldb), n),
                )
            };
            for (y, &w) in c_row.iter_mut().zip(b_row) {
                *y += x * w;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use std::arch::x86_64::*;

    /// Rows of C per register tile: 6 x 16 outputs are 12 registers of sums, enough to
    /// keep both FMA units busy through the FMA's latency.
    pub(crate) const MR: usize = 6;

    /// [`Arch::gemm`](crate::cpu::isa::Arch::gemm) in tiles of 6 x 16 and 6 x 8 outputs, the last
    /// columns (fewer than 8) as dot products ([`narrow`]) or in plain loops.
    ///
    /// # Safety
    /// As [`Arch::gemm`](crate::cpu::isa::Arch::gemm), on a CPU with AVX2 and FMA (as for every function here).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(crate) unsafe fn gemm(
        [m, n, k]: [usize; 3],
        (a, rsa, csa): (*const f32, usize, usize),
        (b, ldb): (*const f32, usize),
        (c, ldc): (*mut f32, usize),
        add: bool,
    ) {
        let mut j = 0;
        // SAFETY (throughout): the caller's contract bounds every tile.
        unsafe {
            while j + 16 <= n {
                rows::<2>(m, k, (a, rsa, csa), (b.add(j), ldb), (c.add(j), ldc), add);
                j += 16;
            }
            if j + 8 <= n {
                rows::<1>(m, k, (a, rsa, csa), (b.add(j), ldb), (c.add(j), ldc), add);
                j += 8;
            }
            if j < n && csa == 1 {
                narrow(
                    [m, n - j, k],
                    (a, rsa),
                    (b.add(j), ldb),
                    (c.add(j), ldc),
                    add,
                );
            } else if j < n {
                super::portable(
                    [m, n - j, k],
                    (a, rsa, csa),
                    (b.add(j), ldb),
                    (c.add(j), ldc),
                    add,
                );
            }
        }
    }

    /// Fewer than 8 columns of C with A's rows contiguous (one query decoding over a
    /// cache of keys: `Sᵀ = K qᵀ`): each output a dot product of an A row and a B
    /// column, 16 lanes at a time along `k`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn narrow(
        [m, n, k]: [usize; 3],
        (a, rsa): (*const f32, usize),
        (b, ldb): (*const f32, usize),
        (c, ldc): (*mut f32, usize),
        add: bool,
    ) {
        let mut column = vec![0.0f32; k];
        // SAFETY (throughout): the caller's contract bounds every load and store.
        unsafe {
            for j in 0..n {
                for (p, x) in column.iter_mut().enumerate() {
                    *x = *b.add(p * ldb + j);
                }
                let col = column.as_ptr();
                for i in 0..m {
                    let row = a.add(i * rsa);
                    let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    let mut p = 0;
                    while p + 16 <= k {
                        s0 = _mm256_fmadd_ps(
                            _mm256_loadu_ps(row.add(p)),
                            _mm256_loadu_ps(col.add(p)),
                            s0,
                        );
                        let (r, w) = (row.add(p + 8), col.add(p + 8));
                        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(r), _mm256_loadu_ps(w), s1);
                        p += 16;
                    }
                    let mut lanes = [0.0f32; 8];
                    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(s0, s1));
                    let mut sum: f32 = lanes.iter().sum();
                    for q in p..k {
                        sum += *row.add(q) * *col.add(q);
                    }
                    let out = c.add(i * ldc + j);
                    *out = if add { *out + sum } else { sum };
                }
            }
        }
    }

    /// Columns `0..8·V` of every row, `MR` rows at a time.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn rows<const V: usize>(
        m: usize,
        k: usize,
        (a, rsa, csa): (*const f32, usize, usize),
        (b, ldb): (*const f32, usize),
        (c, ldc): (*mut f32, usize),
        add: bool,
    ) {
        let mut i = 0;
        // SAFETY (throughout): the caller's contract bounds every tile.
        unsafe {
            while i + MR <= m {
                let at = (a.add(i * rsa), rsa, csa);
                tile::<MR, V>(k, at, (b, ldb), (c.add(i * ldc), ldc), add);
                i += MR;
            }
            // Where no row is left (`m` a multiple of `MR`) these point past the panels,
            // and are not used: computed without `add`'s promise to stay inside them.
            let at = (a.wrapping_add(i * rsa), rsa, csa);
            let ct = (c.wrapping_add(i * ldc), ldc);
            match m - i {
                5 => tile::<5, V>(k, at, (b, ldb), ct, add),
                4 => tile::<4, V>(k, at, (b, ldb), ct, add),
                3 => tile::<3, V>(k, at, (b, ldb), ct, add),
                2 => tile::<2, V>(k, at, (b, ldb), ct, add),
                1 => tile::<1, V>(k, at, (b, ldb), ct, add),
                _ => {}
            }
        }
    }

    /// One `R x 8·V` tile of C, its sums in registers over the whole `k`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile<const R: usize, const V: usize>(
        k: usize,
        (a, rsa, csa): (*const f32, usize, usize),
        (b, ldb): (*const f32, usize),
        (c, ldc): (*mut f32, usize),
        add: bool,
    ) {
        // SAFETY (throughout): the caller's contract bounds every load and store.
        unsafe {
            let mut sum = [[_mm256_setzero_ps(); V]; R];
            if add {
                for (r, row) in sum.iter_mut().enumerate() {
                    for (x, s) in row.iter_mut().enumerate() {
                        *s = _mm256_loadu_ps(c.add(r * ldc + 8 * x));
                    }
                }
            }
            for p in 0..k {
                let b_row = b.add(p * ldb);
                let mut w = [_mm256_setzero_ps(); V];
                for (x, w) in w.iter_mut().enumerate() {
                    *w = _mm256_loadu_ps(b_row.add(8 * x));
                }
                for (r, row) in sum.iter_mut().enumerate() {
                    let x = _mm256_set1_ps(*a.add(r * rsa + p * csa));
                    for (s, &w) in row.iter_mut().zip(&w) {
                        *s = _mm256_fmadd_ps(x, w, *s);
                    }
                }
            }
            for (r, row) in sum.iter().enumerate() {
                for (x, &s) in row.iter().enumerate() {
                    _mm256_storeu_ps(c.add(r * ldc + 8 * x), s);
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    use std::arch::x86_64::*;

    /// Rows of C per register tile: 8 x 32 outputs are 16 of the 32 registers, sums enough
    /// to keep both FMA units busy through the FMA's latency.
    pub(crate) const MR: usize = 8;

    /// [`Arch::gemm`](crate::cpu::isa::Arch::gemm) in tiles of 8 x 32 and 8 x 16 outputs; the last columns
    /// (fewer than 16) through the AVX2 kernel.
    ///
    /// # Safety
    /// As [`Arch::gemm`](crate::cpu::isa::Arch::gemm), on a CPU with AVX-512 F, AVX2 and FMA (as for every
    /// function here).
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    pub(crate) unsafe fn gemm(
        [m, n, k]: [usize; 3],
        (a, rsa, csa): (*const f32, usize, usize),
        (b, ldb): (*const f32, usize),
        (c, ldc): (*mut f32, usize),
        add: bool,
    ) {
        let mut j = 0;
        // SAFETY (throughout): the caller's contract bounds every tile.
        unsafe {
            while j + 32 <= n {
                rows::<2>(m, k, (a, rsa, csa), (b.add(j), ldb), (c.add(j), ldc), add);
                j += 32;
            }
            if j + 16 <= n {
                rows::<1>(m, k, (a, rsa, csa), (b.add(j), ldb), (c.add(j), ldc), add);
                j += 16;
            }
            if j < n {
                let rest = [m, n - j, k];
                super::avx2::gemm(rest, (a, rsa, csa), (b.add(j), ldb), (c.add(j), ldc), add);
            }
        }
    }

    /// Columns `0..16·V` of every row, `MR` rows at a time.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    unsafe fn rows<const V: usize>(
        m: usize,
        k: usize,
        (a, rsa, csa): (*const f32, usize, usize),
        (b, ldb): (*const f32, usize),
        (c, ldc): (*mut f32, usize),
        add: bool,
    ) {
        let mut i = 0;
        // SAFETY (throughout): the caller's contract bounds every tile.
        unsafe {
            while i + MR <= m {
                let at = (a.add(i * rsa), rsa, csa);
                tile::<MR, V>(k, at, (b, ldb), (c.add(i * ldc), ldc), add);
                i += MR;
            }
            // Where no row is left (`m` a multiple of `MR`) these point past the panels,
            // and are not used: computed without `add`'s promise to stay inside them.
            let at = (a.wrapping_add(i * rsa), rsa, csa);
            let ct = (c.wrapping_add(i * ldc), ldc);
            match m - i {
                7 => tile::<7, V>(k, at, (b, ldb), ct, add),
                6 => tile::<6, V>(k, at, (b, ldb), ct, add),
                5 => tile::<5, V>(k, at, (b, ldb), ct, add),
                4 => tile::<4, V>(k, at, (b, ldb), ct, add),
                3 => tile::<3, V>(k, at, (b, ldb), ct, add),
                2 => tile::<2, V>(k, at, (b, ldb), ct, add),
                1 => tile::<1, V>(k, at, (b, ldb), ct, add),
                _ => {}
            }
        }
    }

    /// One `R x 16·V` tile of C, its sums in registers over the whole `k`.
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    unsafe fn tile<const R: usize, const V: usize>(
        k: usize,
        (a, rsa, csa): (*const f32, usize, usize),
        (b, ldb): (*const f32, usize),
        (c, ldc): (*mut f32, usize),
        add: bool,
    ) {
        // SAFETY (throughout): the caller's contract bounds every load and store.
        unsafe {
            let mut sum = [[_mm512_setzero_ps(); V]; R];
            if add {
                for (r, row) in sum.iter_mut().enumerate() {
                    for (x, s) in row.iter_mut().enumerate() {
                        *s = _mm512_loadu_ps(c.add(r * ldc + 16 * x));
                    }
                }
            }
            for p in 0..k {
                let b_row = b.add(p * ldb);
                let mut w = [_mm512_setzero_ps(); V];
                for (x, w) in w.iter_mut().enumerate() {
                    *w = _mm512_loadu_ps(b_row.add(16 * x));
                }
                for (r, row) in sum.iter_mut().enumerate() {
                    let x = _mm512_set1_ps(*a.add(r * rsa + p * csa));
                    for (s, &w) in row.iter_mut().zip(&w) {
                        *s = _mm512_fmadd_ps(x, w, *s);
                    }
                }
            }
            for (r, row) in sum.iter().enumerate() {
                for (x, &s) in row.iter().enumerate() {
                    _mm512_storeu_ps(c.add(r * ldc + 16 * x), s);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testing::{avx2_under_test, avx512_under_test, random};

    /// A kernel: sizes, A with its strides, B and C with their row strides, whether to add.
    type Kernel = unsafe fn(
        [usize; 3],
        (*const f32, usize, usize),
        (*const f32, usize),
        (*mut f32, usize),
        bool,
    );

    /// The reference product in f64, A read through its strides.
    fn reference(
        m: usize,
        n: usize,
        k: usize,
        a: &[f32],
        (rsa, csa): (usize, usize),
        b: &[f32],
        ldb: usize,
    ) -> Vec<f64> {
        let mut c = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k)
                    .map(|p| a[i * rsa + p * csa] as f64 * b[p * ldb + j] as f64)
                    .sum();
            }
        }
        c
    }

    fn check(name: &str, gemm: Kernel) {
        // Sizes around the register tiles' edges and the narrow columns' dot products,
        // A both ways round, C = and +=.
        for &(m, n, k) in &[
            (1, 1, 1),
            (4, 16, 64),
            (7, 29, 13),
            (64, 64, 64),
            (3, 8, 0),
            (13, 40, 70),
            (5, 3, 40),
            (64, 1, 64),
            (17, 48, 33),
            (9, 63, 5),
        ] {
            for transposed in [false, true] {
                let a = random(m * k + 1, (m * 31 + n * 7 + k) as u32);
                let strides = if transposed { (1, m) } else { (k, 1) };
                let ldb = n + 3;
                let b = random(k * ldb + 1, (n * 13 + k) as u32);
                let ldc = n + 5;
                let start = random(m * ldc, 99);
                for add in [false, true] {
                    let mut c = start.clone();
                    // SAFETY: the buffers hold every element the sizes and strides name.
                    unsafe {
                        gemm(
                            [m, n, k],
                            (a.as_ptr(), strides.0, strides.1),
                            (b.as_ptr(), ldb),
                            (c.as_mut_ptr(), ldc),
                            add,
                        );
                    }
                    let want = reference(m, n, k, &a, strides, &b, ldb);
                    for i in 0..m {
                        for j in 0..n {
                            let base = if add { start[i * ldc + j] as f64 } else { 0.0 };
                            let got = c[i * ldc + j] as f64;
                            let want = want[i * n + j] + base;
                            assert!(
                                (got - want).abs() <= 1e-5 * (1.0 + k as f64),
                                "{name} [{m}, {n}, {k}] a^T {transposed} add {add}: c[{i}, {j}] = {got}, want {want}"
                            );
                        }
                        // Columns past n are untouched.
                        for j in n..ldc {
                            assert_eq!(
                                c[i * ldc + j],
                                start[i * ldc + j],
                                "{name}: column {j} written"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn portable_gemm_matches_f64() {
        check("portable", portable);
    }

    #[test]
    fn avx2_gemm_matches_f64() {
        if avx2_under_test("avx2_gemm_matches_f64") {
            #[cfg(target_arch = "x86_64")]
            check("avx2", avx2::gemm);
        }
    }

    #[test]
    fn avx512_gemm_matches_f64() {
        if avx512_under_test("avx512_gemm_matches_f64") {
            #[cfg(target_arch = "x86_64")]
            check("avx512", avx512::gemm);
        }
    }
}
