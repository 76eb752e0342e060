//! The matrix kernels of the tiles, one per instruction set ([`Isa`], chosen at run time):
//! plain loops for any CPU ([`Portable`]), on x86-64 with AVX2 and FMA register tiles of
//! 6 x 16 outputs ([`Avx2`]), and with AVX-512 tiles of 8 x 32 ([`Avx512`]). Each is
//! tested against a plain f64 product.

use super::math;

/// The instruction set the kernels are compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Isa {
    /// Plain loops, any CPU.
    Portable,
    /// x86-64 with AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// x86-64 with AVX-512 (F), AVX2 and FMA.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// The best this CPU runs (the standard library caches the detection).
    pub(super) fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            return Isa::Avx2;
        }
        Isa::Portable
    }
}

/// Row work written once over a flag for fused multiply-adds, run compiled for an
/// instruction set by [`Isa::run`] (the elementwise kernels of GELU and layer norm).
pub(super) trait Kernel {
    /// The work; `FMA` when it runs with the fused multiply-add instructions. It is
    /// `#[inline(always)]` in every implementation, so that it is compiled inside the
    /// function that enables the instruction set (its vectors' width too).
    fn run<const FMA: bool>(self);
}

impl Isa {
    /// Runs `kernel` compiled for this instruction set.
    pub(super) fn run<K: Kernel>(self, kernel: K) {
        #[cfg(target_arch = "x86_64")]
        match self {
            // SAFETY: `best` chose the instruction set from the CPU's features.
            Isa::Avx512 => unsafe { run_avx512(kernel) },
            // SAFETY: as above.
            Isa::Avx2 => unsafe { run_avx2(kernel) },
            Isa::Portable => kernel.run::<false>(),
        }
        #[cfg(not(target_arch = "x86_64"))]
        kernel.run::<false>();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn run_avx512<K: Kernel>(kernel: K) {
    kernel.run::<true>();
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn run_avx2<K: Kernel>(kernel: K) {
    kernel.run::<true>();
}

/// A matrix kernel for one instruction set.
pub(super) trait Arch {
    /// `C = A B` (or `C += A B` when `add`) for sizes `[m, n, k]`: A is `(ptr, row
    /// stride, column stride)`, B and C are `(ptr, row stride)` with unit column stride.
    ///
    /// # Safety
    /// Every element of the three matrices is in bounds.
    unsafe fn gemm(
        mnk: [usize; 3],
        a: (*const f32, usize, usize),
        b: (*const f32, usize),
        c: (*mut f32, usize),
        add: bool,
    );

    /// `e^x` ([`math::exp`], with fused multiply-adds where the instruction set has them).
    fn exp(x: f32) -> f32;

    /// `tanh(x) = 1 - 2 / (e^{2x} + 1)` through [`exp`](Self::exp): within 2e-7 of the
    /// true value, and vectorised like it.
    #[inline(always)]
    fn tanh(x: f32) -> f32 {
        1.0 - 2.0 / (Self::exp(2.0 * x) + 1.0)
    }
}

/// Plain loops, for any CPU.
pub(super) struct Portable;

impl Arch for Portable {
    #[inline(always)]
    fn exp(x: f32) -> f32 {
        math::exp(x)
    }

    #[inline(always)]
    unsafe fn gemm(
        [m, n, k]: [usize; 3],
        (a, rsa, csa): (*const f32, usize, usize),
        (b, ldb): (*const f32, usize),
        (c, ldc): (*mut f32, usize),
        add: bool,
    ) {
        // SAFETY: the caller's contract.
        unsafe { gemm_portable([m, n, k], (a, rsa, csa), (b, ldb), (c, ldc), add) }
    }
}

/// [`Arch::gemm`] in plain loops.
///
/// # Safety
/// As [`Arch::gemm`].
#[inline(always)]
unsafe fn gemm_portable(
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
pub(super) struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Arch for Avx2 {
    #[inline(always)]
    fn exp(x: f32) -> f32 {
        math::exp_fma(x)
    }

    #[inline(always)]
    unsafe fn gemm(
        [m, n, k]: [usize; 3],
        a: (*const f32, usize, usize),
        b: (*const f32, usize),
        c: (*mut f32, usize),
        add: bool,
    ) {
        // SAFETY: the caller's contract; only called where the CPU has AVX2 and FMA.
        unsafe { avx2::gemm([m, n, k], a, b, c, add) }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// Rows of C per register tile: 6 x 16 outputs are 12 registers of sums, enough to
    /// keep both FMA units busy through the FMA's latency.
    const MR: usize = 6;

    /// [`super::Arch::gemm`] in tiles of 6 x 16 and 6 x 8 outputs, the last
    /// columns (fewer than 8) as dot products ([`narrow`]) or in plain loops.
    ///
    /// # Safety
    /// As [`super::Arch::gemm`], on a CPU with AVX2 and FMA (as for every function here).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(super) unsafe fn gemm(
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
                super::gemm_portable(
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
            let at = (a.add(i * rsa), rsa, csa);
            let ct = (c.add(i * ldc), ldc);
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
pub(super) struct Avx512;

#[cfg(target_arch = "x86_64")]
impl Arch for Avx512 {
    #[inline(always)]
    fn exp(x: f32) -> f32 {
        math::exp_fma(x)
    }

    #[inline(always)]
    unsafe fn gemm(
        [m, n, k]: [usize; 3],
        a: (*const f32, usize, usize),
        b: (*const f32, usize),
        c: (*mut f32, usize),
        add: bool,
    ) {
        // SAFETY: the caller's contract; only called where the CPU has AVX-512, AVX2, FMA.
        unsafe { avx512::gemm([m, n, k], a, b, c, add) }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// Rows of C per register tile: 8 x 32 outputs are 16 of the 32 registers, sums enough
    /// to keep both FMA units busy through the FMA's latency.
    const MR: usize = 8;

    /// [`super::Arch::gemm`] in tiles of 8 x 32 and 8 x 16 outputs; the last columns
    /// (fewer than 16) through the AVX2 kernel.
    ///
    /// # Safety
    /// As [`super::Arch::gemm`], on a CPU with AVX-512 F, AVX2 and FMA (as for every
    /// function here).
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[inline]
    pub(super) unsafe fn gemm(
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
            let at = (a.add(i * rsa), rsa, csa);
            let ct = (c.add(i * ldc), ldc);
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

/// Whether a test can run the AVX-512 kernels on this CPU. When it cannot, the test says
/// so on stderr and skips them, or fails when the environment variable
/// `MHA_REQUIRE_AVX512` is set (CI sets it on CPUs that have AVX-512).
#[cfg(test)]
pub(super) fn avx512_under_test(test: &str) -> bool {
    if Isa::best() == Isa::Avx512 {
        return true;
    }
    assert!(
        std::env::var_os("MHA_REQUIRE_AVX512").is_none(),
        "{test}: MHA_REQUIRE_AVX512 is set, but this CPU has no AVX-512"
    );
    eprintln!("{test}: skipped the AVX-512 kernel: this CPU has no AVX-512");
    false
}

/// Whether a test can run the AVX2 kernels on this CPU. When it cannot, the test says so
/// on stderr and skips them, or fails when the environment variable `MHA_REQUIRE_AVX2` is
/// set (CI sets it on CPUs that have AVX2 and FMA, so that the kernel is never skipped
/// there unnoticed).
#[cfg(test)]
pub(super) fn avx2_under_test(test: &str) -> bool {
    if Isa::best() != Isa::Portable {
        return true;
    }
    assert!(
        std::env::var_os("MHA_REQUIRE_AVX2").is_none(),
        "{test}: MHA_REQUIRE_AVX2 is set, but this CPU has no AVX2 and FMA"
    );
    eprintln!("{test}: skipped the AVX2 kernel: this CPU has no AVX2 and FMA");
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::tests::random;

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

    fn check<A: Arch>(name: &str) {
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
                        A::gemm(
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

    fn check_tanh<A: Arch>(name: &str) {
        let mut x = -12.0f32;
        while x < 12.0 {
            let (got, want) = (A::tanh(x) as f64, (x as f64).tanh());
            assert!(
                (got - want).abs() <= 2e-7,
                "{name}: tanh({x}) = {got}, want {want}"
            );
            x += 0.000_97;
        }
        assert_eq!((A::tanh(100.0), A::tanh(-100.0)), (1.0, -1.0));
    }

    #[test]
    fn tanh_is_within_2e7_of_f64_on_every_instruction_set() {
        check_tanh::<Portable>("portable");
        if avx2_under_test("tanh_is_within_2e7_of_f64_on_every_instruction_set") {
            #[cfg(target_arch = "x86_64")]
            check_tanh::<Avx2>("avx2");
        }
        if avx512_under_test("tanh_is_within_2e7_of_f64_on_every_instruction_set") {
            #[cfg(target_arch = "x86_64")]
            check_tanh::<Avx512>("avx512");
        }
    }

    #[test]
    fn portable_gemm_matches_f64() {
        check::<Portable>("portable");
    }

    #[test]
    fn avx2_gemm_matches_f64() {
        if avx2_under_test("avx2_gemm_matches_f64") {
            #[cfg(target_arch = "x86_64")]
            check::<Avx2>("avx2");
        }
    }

    #[test]
    fn avx512_gemm_matches_f64() {
        if avx512_under_test("avx512_gemm_matches_f64") {
            #[cfg(target_arch = "x86_64")]
            check::<Avx512>("avx512");
        }
    }
}
