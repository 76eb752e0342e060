//! What the kernels' tests share: seeded inputs, and the instruction sets to test.

use super::isa::Isa;

/// Seeded values in `[-1, 1]`.
pub(super) fn random(len: usize, seed: u32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(2_654_435_761).max(1);
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state as f32 / u32::MAX as f32) * 2.0 - 1.0
        })
        .collect()
}

/// Every instruction set `test` runs on this CPU: the portable one, and AVX2 and AVX-512
/// where [`avx2_under_test`] and [`avx512_under_test`] say so.
pub(super) fn isas_under_test(test: &str) -> Vec<Isa> {
    let mut isas = vec![Isa::Portable];
    if avx2_under_test(test) {
        #[cfg(target_arch = "x86_64")]
        isas.push(Isa::Avx2);
    }
    if avx512_under_test(test) {
        #[cfg(target_arch = "x86_64")]
        isas.push(Isa::Avx512);
    }
    isas
}

/// Whether a test can run the AVX-512 kernels on this CPU. When it cannot, the test says
/// so on stderr and skips them, or fails when the environment variable
/// `MHA_REQUIRE_AVX512` is set (CI sets it on CPUs that have AVX-512).
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
