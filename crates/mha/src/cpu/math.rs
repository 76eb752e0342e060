//! Vector math of the tiles: an `exp` that vectorises (the scalar `expf` of the standard
//! library does not, and the softmax calls it for every score) and a dot product in eight
//! lanes.

/// `e^x` to within 2 ulp in `[-87.3, 88.3]`, 0 below, infinite above 88.37 (where
/// `2^n` leaves f32: the softmax's arguments are at most 0) (Cephes' `expf`: `x = n ln 2 +
/// r`, a degree-6 polynomial for `e^r`, `2^n` through the exponent bits); branch-free
/// so that loops over it vectorise.
#[inline(always)]
pub(super) fn exp(x: f32) -> f32 {
    exp_with::<false>(x)
}

/// [`exp`] with its multiply-adds fused, for code compiled with FMA (elsewhere `mul_add`
/// is a library call).
#[inline(always)]
pub(super) fn exp_fma(x: f32) -> f32 {
    exp_with::<true>(x)
}

#[inline(always)]
fn exp_with<const FMA: bool>(x: f32) -> f32 {
    let madd = |a: f32, b: f32, c: f32| if FMA { a.mul_add(b, c) } else { a * b + c };
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    const ROUND: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer.
    let clamped = x.clamp(-87.3, 88.7);
    let shifted = madd(clamped, LOG2E, ROUND);
    let n = shifted - ROUND;
    let bits = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let r = madd(-n, LN2_LO, madd(-n, LN2_HI, clamped));
    let p = 1.987_569_1e-4;
    let p = madd(p, r, 1.398_199_9e-3);
    let p = madd(p, r, 8.333_452e-3);
    let p = madd(p, r, 4.166_579_6e-2);
    let p = madd(p, r, 1.666_666_5e-1);
    let p = madd(p, r, 0.5);
    let y = madd(p, r * r, r + 1.0);
    let scale = f32::from_bits(((bits + 127) << 23) as u32);
    if x < -87.3 { 0.0 } else { y * scale }
}

/// `Σ a·b` in eight lanes (the compiler vectorises them; one running sum would wait on
/// each addition).
pub(super) fn dot_product(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0.0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a8.zip(b8) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::{dot_product, exp, exp_fma};

    #[test]
    fn exp_is_within_two_ulp_of_std() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let want = (x as f64).exp();
            for got in [exp(x), exp_fma(x)] {
                worst = worst.max(((got as f64 - want) / want).abs());
            }
            x += 0.001_3;
        }
        assert!(worst < 2.5e-7, "relative error {worst}");
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(0.0), 1.0);
        for exp in [exp, exp_fma] {
            assert_eq!(exp(f32::NEG_INFINITY), 0.0);
            assert_eq!(exp(-1.0e30), 0.0);
        }
    }

    #[test]
    fn dot_product_matches_f64_at_every_tail_length() {
        for len in [0, 1, 7, 8, 9, 64, 67] {
            let a: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..len).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            let got = dot_product(&a, &b) as f64;
            assert!(
                (got - want).abs() <= 1e-5,
                "len {len}: {got} against {want}"
            );
        }
    }
}
