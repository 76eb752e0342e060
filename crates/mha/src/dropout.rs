//! Dropout as Burn's [`Dropout`] does it (in training only: on a device with autodiff, for
//! a layer whose training flag is on; each element kept with probability `1 - p` and
//! scaled by `1 / (1 - p)`, the others zeroed), with the mask drawn faster on the CPU
//! backends.
//!
//! Burn draws a dropout mask one element at a time from a ChaCha generator, which on the
//! CPU costs more than the layer it masks (a fifth of a training step of nanoGPT's GPU
//! recipe, whose attention weights alone are 25 million elements a layer). On flex and
//! ndarray the mask here is SplitMix64 of each element's index from a seed drawn from the
//! backend's generator: every thread writes its part, and after `device.seed(s)` the same
//! draws in the same order give the same masks every run. Elsewhere (wgpu, cuda, whose
//! generators run on the device) it is Burn's.
//!
//! Burn's generator is one per backend for the whole process, not one per device or
//! thread (seeding one device seeds the others of its backend): where several threads
//! draw random numbers on one backend at once (dropout, `Tensor::random`, a module's
//! initialisation), which thread gets which draw depends on their timing, and seeded runs
//! repeat their masks only when they draw on that backend from one thread.

use burn::nn::Dropout;
use burn::tensor::{Device, Distribution, Tensor};

/// `layer` applied to `x`: `x` as it is outside training or at probability 0, else
/// [`apply`].
pub fn forward<const D: usize>(layer: &Dropout, x: Tensor<D>) -> Tensor<D> {
    let prob = probability(layer, &x.device());
    if prob == 0.0 {
        return x;
    }
    apply(x, prob)
}

/// The probability `layer` drops an element with on `device`: its own in training (its
/// training flag on, on a device with autodiff), else 0.
pub fn probability(layer: &Dropout, device: &Device) -> f64 {
    match layer.training.is_enabled() && device.is_autodiff() {
        true => layer.prob,
        false => 0.0,
    }
}

/// `x` with each element kept with probability `1 - prob` and scaled by `1 / (1 - prob)`,
/// the others zeroed (whatever the device; [`forward`] decides when to).
///
/// # Panics
/// If `prob` is not in `[0, 1)`.
pub fn apply<const D: usize>(x: Tensor<D>, prob: f64) -> Tensor<D> {
    assert!(
        (0.0..1.0).contains(&prob),
        "dropout: the probability must be in [0, 1), got {prob}"
    );
    let keep = 1.0 - prob;
    #[cfg(feature = "cpu-kernels")]
    if crate::dispatch::cpu_pool(&x.device()) {
        return cpu::apply(x, keep);
    }
    let mask = x.random_like(Distribution::Bernoulli(keep));
    // A product by the reciprocal (Burn's backward of a division by a scalar takes the
    // reciprocal in f32).
    x * mask * (1.0 / keep)
}

#[cfg(feature = "cpu-kernels")]
mod cpu {
    use burn::tensor::{DType, Distribution, FloatDType, Tensor, TensorData};
    use rayon::prelude::*;

    /// Elements per parallel task.
    const CHUNK: usize = 1 << 14;

    /// SplitMix64's output for state `x`.
    fn splitmix64(x: u64) -> u64 {
        let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// `n` values, `scale` where `kept` says so, else 0, in parallel.
    fn scaled<E>(n: usize, scale: E, kept: impl Fn(usize) -> bool + Sync) -> Vec<E>
    where
        E: Copy + Default + Send + Sync,
    {
        let mut mask = Vec::with_capacity(n);
        mask.par_extend(
            (0..n)
                .into_par_iter()
                .with_min_len(CHUNK)
                .map(|i| if kept(i) { scale } else { E::default() }),
        );
        mask
    }

    /// `x` times a mask of `0` and `1 / keep`, element `i` kept when the top 32 bits of
    /// SplitMix64 of `seed + i` fall below `keep · 2^32`.
    pub(super) fn apply<const D: usize>(x: Tensor<D>, keep: f64) -> Tensor<D> {
        let device = x.device();
        let dims = x.dims();
        let n: usize = dims.iter().product();
        // A seed from the backend's generator: seeding it repeats the masks.
        let drawn: Vec<f32> = Tensor::<1>::random([2], Distribution::Default, &device)
            .into_data()
            .convert::<f32>()
            .try_into_vec()
            .expect("f32 values");
        let seed = (u64::from(drawn[0].to_bits()) << 32) ^ u64::from(drawn[1].to_bits());
        let seed = splitmix64(seed);
        let threshold = (keep * 4_294_967_296.0).round() as u64;
        let kept = |i: usize| splitmix64(seed.wrapping_add(i as u64)) >> 32 < threshold;
        // The mask in f64 for f64 (its scale rounded to f32 showed in the gradients),
        // else in f32, cast to the input's dtype.
        let mask = match x.dtype() {
            DType::F64 => (
                TensorData::new(scaled(n, 1.0 / keep, kept), dims),
                DType::F64,
            ),
            _ => (
                TensorData::new(scaled(n, (1.0 / keep) as f32, kept), dims),
                DType::F32,
            ),
        };
        let mask = Tensor::<D>::from_data(mask.0, (&device, mask.1));
        let dtype = FloatDType::from(x.dtype());
        let mask = match mask.dtype() == x.dtype() {
            true => mask,
            false => mask.cast(dtype),
        };
        x * mask
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::devices;

    /// In f64 the kept values are scaled by `1 / keep` in f64, values and gradients (a
    /// scale rounded to f32 was 5e-8 off at p = 0.1).
    #[test]
    fn f64_dropout_scales_in_f64() {
        let f64 = burn::tensor::FloatDType::F64;
        for device in devices().into_iter().filter(|d| d.supports_dtype(f64)) {
            let x = Tensor::<1>::ones([4096], &device).cast(f64).require_grad();
            let y = apply(x.clone(), 0.1);
            let grad = x.grad(&y.clone().sum().backward()).expect("a gradient");
            let scale = 1.0 / (1.0 - 0.1);
            for values in [y.inner(), grad] {
                let values: Vec<f64> = values.into_data().convert::<f64>().try_into_vec().unwrap();
                assert!(values.iter().any(|&v| v != 0.0), "{device:?}: all dropped");
                assert!(
                    values
                        .iter()
                        .all(|&v| v == 0.0 || (v - scale).abs() <= 1e-15),
                    "{device:?}: {:?}",
                    values
                        .iter()
                        .find(|&&v| v != 0.0 && (v - scale).abs() > 1e-15)
                );
            }
        }
    }

    /// Run in a process of its own: a test drawing random values on another thread between
    /// `seed` and the draw (a module's initialisation) would change the mask it repeats.
    #[test]
    fn dropout_keeps_its_share_scaled_and_repeats_with_the_seed() {
        crate::testing::in_own_process(
            "dropout::tests::dropout_keeps_its_share_scaled_and_repeats_with_the_seed_alone",
        );
    }

    #[test]
    #[ignore = "run in a process of its own by dropout_keeps_its_share_scaled_and_repeats_with_the_seed"]
    fn dropout_keeps_its_share_scaled_and_repeats_with_the_seed_alone() {
        for device in devices() {
            let n = 1 << 16;
            let x = Tensor::<2>::ones([4, n / 4], &device);
            for prob in [0.1, 0.5, 0.8] {
                device.seed(3);
                let y = apply(x.clone(), prob);
                let values: Vec<f32> = y.into_data().convert::<f32>().try_into_vec().unwrap();
                let scale = (1.0 / (1.0 - prob)) as f32;
                let kept = values.iter().filter(|&&v| v != 0.0).count();
                assert!(
                    values.iter().all(|&v| v == 0.0 || (v - scale).abs() < 1e-5),
                    "{device:?} {prob}: values are 0 or 1/keep"
                );
                let share = kept as f64 / n as f64;
                assert!(
                    (share - (1.0 - prob)).abs() < 0.01,
                    "{device:?} {prob}: kept {share}"
                );
                device.seed(3);
                let again: Vec<f32> = apply(x.clone(), prob)
                    .into_data()
                    .convert::<f32>()
                    .try_into_vec()
                    .unwrap();
                assert_eq!(values, again, "{device:?} {prob}: a seed repeats the mask");
                let next: Vec<f32> = apply(x.clone(), prob)
                    .into_data()
                    .convert::<f32>()
                    .try_into_vec()
                    .unwrap();
                assert_ne!(values, next, "{device:?} {prob}: each call draws anew");
            }
        }
    }
}
