//! The instruction set every kernel of `cpu` runs in, chosen once at run time ([`Isa`]),
//! and what a kernel may use of it ([`Arch`]: the tiles' matrix kernel, `exp`, `tanh`,
//! fused multiply-adds). A kernel is written once, generic over [`Arch`], and run through
//! [`Isa::run`], which compiles it inside a function that enables the instruction set
//! (so that its vectors are that set's width and its intrinsics inline).

use super::{gemm, math};

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

    /// Runs `kernel` compiled for this instruction set. An `Isa` is [`best`](Self::best)'s
    /// or one below it: the tests make those the CPU has (checked in debug builds).
    pub(super) fn run<K: Kernel>(self, kernel: K) -> K::Output {
        #[cfg(target_arch = "x86_64")]
        match self {
            Isa::Avx512 => {
                debug_assert!(std::arch::is_x86_feature_detected!("avx512f"));
                // SAFETY: the CPU has AVX-512 F, and AVX2 and FMA with it (`best`).
                unsafe { run_avx512(kernel) }
            }
            Isa::Avx2 => {
                debug_assert!(std::arch::is_x86_feature_detected!("avx2"));
                // SAFETY: the CPU has AVX2, and FMA with it (`best`).
                unsafe { run_avx2(kernel) }
            }
            Isa::Portable => kernel.run::<Portable>(),
        }
        #[cfg(not(target_arch = "x86_64"))]
        kernel.run::<Portable>()
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
fn run_avx512<K: Kernel>(kernel: K) -> K::Output {
    kernel.run::<Avx512>()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn run_avx2<K: Kernel>(kernel: K) -> K::Output {
    kernel.run::<Avx2>()
}

/// Work written once over the instruction set `A`, run by [`Isa::run`].
pub(super) trait Kernel {
    /// What the work returns.
    type Output;

    /// The work. It is `#[inline(always)]` in every implementation, so that it is
    /// compiled inside the function that enables `A`'s instruction set.
    fn run<A: Arch>(self) -> Self::Output;
}

/// What a kernel may use of an instruction set.
pub(super) trait Arch {
    /// Whether `mul_add` is one instruction (elsewhere it is a library call).
    const FMA: bool;

    /// Rows of C that [`gemm`](Self::gemm) computes at once (its register tile's): a
    /// product cut into blocks of rows runs as fast as whole when the blocks are
    /// multiples of it.
    const ROWS: usize;

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

    /// `a · b + c`, fused where the instruction set has it.
    #[inline(always)]
    fn madd(a: f32, b: f32, c: f32) -> f32 {
        if Self::FMA {
            a.mul_add(b, c)
        } else {
            a * b + c
        }
    }

    /// `e^x` ([`math::exp`], with fused multiply-adds where the instruction set has them).
    #[inline(always)]
    fn exp(x: f32) -> f32 {
        match Self::FMA {
            true => math::exp_fma(x),
            false => math::exp(x),
        }
    }

    /// `tanh(x) = 1 - 2 / (e^{2x} + 1)` through [`exp`](Self::exp): within 2e-7 of the
    /// true value, and vectorised like it.
    #[inline(always)]
    fn tanh(x: f32) -> f32 {
        1.0 - 2.0 / (Self::exp(2.0 * x) + 1.0)
    }

    /// `a + b` lane by lane: eight lanes of sums (of a row, say) held in one vector
    /// register where the instruction set has them. Written as eight scalar additions,
    /// the compiler keeps eight scalar sums and adds them one by one.
    #[inline(always)]
    fn add8(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        std::array::from_fn(|l| a[l] + b[l])
    }
}

/// Plain loops, for any CPU.
pub(super) struct Portable;

impl Arch for Portable {
    const FMA: bool = false;
    const ROWS: usize = 8;

    #[inline(always)]
    unsafe fn gemm(
        mnk: [usize; 3],
        a: (*const f32, usize, usize),
        b: (*const f32, usize),
        c: (*mut f32, usize),
        add: bool,
    ) {
        // SAFETY: the caller's contract.
        unsafe { gemm::portable(mnk, a, b, c, add) }
    }
}

/// Eight lanes added in one AVX instruction.
///
/// # Safety
/// Only where the CPU has AVX.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn add8_avx(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
    use std::arch::x86_64::{__m256, _mm256_add_ps};
    use std::mem::transmute;
    // SAFETY: `[f32; 8]` and `__m256` are the same 32 bytes; the caller's contract.
    unsafe {
        let (a, b) = (
            transmute::<[f32; 8], __m256>(a),
            transmute::<[f32; 8], __m256>(b),
        );
        transmute::<__m256, [f32; 8]>(_mm256_add_ps(a, b))
    }
}

/// x86-64 with AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
pub(super) struct Avx2;

#[cfg(target_arch = "x86_64")]
impl Arch for Avx2 {
    const FMA: bool = true;
    const ROWS: usize = gemm::avx2::MR;

    #[inline(always)]
    fn add8(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        // SAFETY: only run where the CPU has AVX2 (and AVX with it).
        unsafe { add8_avx(a, b) }
    }

    #[inline(always)]
    unsafe fn gemm(
        mnk: [usize; 3],
        a: (*const f32, usize, usize),
        b: (*const f32, usize),
        c: (*mut f32, usize),
        add: bool,
    ) {
        // SAFETY: the caller's contract; only run where the CPU has AVX2 and FMA.
        unsafe { gemm::avx2::gemm(mnk, a, b, c, add) }
    }
}

/// x86-64 with AVX-512 F, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
pub(super) struct Avx512;

#[cfg(target_arch = "x86_64")]
impl Arch for Avx512 {
    const FMA: bool = true;
    const ROWS: usize = gemm::avx512::MR;

    #[inline(always)]
    fn add8(a: [f32; 8], b: [f32; 8]) -> [f32; 8] {
        // SAFETY: only run where the CPU has AVX2 (and AVX with it).
        unsafe { add8_avx(a, b) }
    }

    #[inline(always)]
    unsafe fn gemm(
        mnk: [usize; 3],
        a: (*const f32, usize, usize),
        b: (*const f32, usize),
        c: (*mut f32, usize),
        add: bool,
    ) {
        // SAFETY: the caller's contract; only run where the CPU has AVX-512, AVX2, FMA.
        unsafe { gemm::avx512::gemm(mnk, a, b, c, add) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testing::isas_under_test;

    /// `tanh` over the line, through [`Isa::run`].
    struct Tanh;

    impl Kernel for Tanh {
        type Output = (f64, f32);

        #[inline(always)]
        fn run<A: Arch>(self) -> (f64, f32) {
            let mut worst = 0.0f64;
            let mut x = -12.0f32;
            while x < 12.0 {
                let (got, want) = (A::tanh(x) as f64, (x as f64).tanh());
                worst = worst.max((got - want).abs());
                x += 0.000_97;
            }
            (worst, A::tanh(100.0) - A::tanh(-100.0))
        }
    }

    #[test]
    fn tanh_is_within_2e7_of_f64_on_every_instruction_set() {
        for isa in isas_under_test("tanh_is_within_2e7_of_f64_on_every_instruction_set") {
            let (worst, span) = isa.run(Tanh);
            assert!(worst <= 2e-7, "{isa:?}: tanh is {worst} off");
            assert_eq!(span, 2.0, "{isa:?}: tanh(±100) is not ±1");
        }
    }
}
