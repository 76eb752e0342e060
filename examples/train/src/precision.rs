//! The precision a run computes in (`--dtype`): f32, or f16 / bf16 with f32 master
//! weights.
//!
//! - The weights, the optimizer's moments and the checkpoints stay in f32 (the "master
//!   weights"): an update of 1e-5 to a weight of 0.1 is lost in f16 (whose step there is
//!   6e-5), one of 1e-4 in bf16 (5e-4).
//! - Each step computes in the chosen dtype: the whole model's parameters are cast to it
//!   ([`compute_copy`]), and that cast is part of the autodiff graph, so the gradients
//!   arrive at the f32 weights in f32. Embeddings, the residual stream, attention and
//!   their gradients run in the dtype (on a GPU, `mha`'s kernels in f16/bf16 with f32
//!   accumulation). This is not PyTorch's autocast, which keeps embeddings, residual
//!   additions and softmax in f32: here only the loss (the logits are cast to f32 before
//!   it) and the layer norms' statistics are computed in f32.
//! - f16's range ends at 65,504 and its smallest normal number is 6e-5, so small
//!   gradients would flush to zero: f16 runs scale the loss before the backward pass and
//!   unscale the gradients after it ([`LossScaler`], PyTorch's `GradScaler` with its
//!   defaults). A step whose gradients overflow is skipped and the scale halved. A
//!   forward pass that overflows (a non-finite loss) stops the run as diverged, as in f32,
//!   where `GradScaler` would skip the step. bf16 has f32's range and needs no scaling.
//! - Validation, the final greedy evaluation, `generate` and the decoding accuracy of
//!   `inspect --prune` run the model cast to the dtype ([`Precision::for_inference`]: in
//!   f32 on a backend without it, saying so); `inspect`'s attention maps, head scores and
//!   forward timings read the weights in f32.

use std::sync::{Arc, Mutex};

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, FloatDType, Tensor};
use serde::{Deserialize, Serialize};

use crate::backend::Backend;
use crate::fields::DTYPE;

/// The float dtype a run computes in; spelt in `config.json` as on the command line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    /// Everything in f32.
    #[default]
    F32,
    /// f16 arithmetic, f32 weights, a dynamic loss scale (wgpu, cuda, flex).
    F16,
    /// bf16 arithmetic, f32 weights (cuda, flex; not wgpu, whose shaders have no bf16).
    Bf16,
}

impl<'de> Deserialize<'de> for Precision {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        crate::fields::by_name(deserializer, "dtype")
    }
}

impl Precision {
    /// Its name, as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::F16 => "f16",
            Precision::Bf16 => "bf16",
        }
    }

    /// The dtype the steps compute in.
    pub fn dtype(self) -> FloatDType {
        match self {
            Precision::F32 => FloatDType::F32,
            Precision::F16 => FloatDType::F16,
            Precision::Bf16 => FloatDType::BF16,
        }
    }

    /// Checks that every one of `backend`'s `devices` (those a run trains on) computes in
    /// the dtype, before anything is built or written.
    ///
    /// # Errors
    /// Naming the flag, the dtype, the backend and the device (among several), and the
    /// dtypes it has.
    pub fn check(self, backend: Backend, devices: &[Device]) -> anyhow::Result<()> {
        let Some(device) = devices.iter().find(|d| !d.supports_dtype(self.dtype())) else {
            return Ok(());
        };
        let has: Vec<&str> = [Precision::F32, Precision::F16, Precision::Bf16]
            .into_iter()
            .filter(|p| device.supports_dtype(p.dtype()))
            .map(Precision::name)
            .collect();
        let which = match devices.len() {
            1 => "this device".to_string(),
            n => format!("{device:?}, one of the {n} devices it trains on"),
        };
        anyhow::bail!(
            "{} = {}: the {backend} backend does not compute in {} on {which}; it has {}",
            DTYPE.name(),
            self.name(),
            self.name(),
            has.join(", ")
        )
    }

    /// The dtype to run a trained model in on `device`: the run's, or f32 (the weights'
    /// own dtype) with a warning on stderr where the device does not compute in it.
    pub fn for_inference(self, device: &Device) -> FloatDType {
        if device.supports_dtype(self.dtype()) {
            return self.dtype();
        }
        eprintln!(
            "warning: the run computed in {}, which this device does not; running its f32 \
             weights in f32",
            self.name()
        );
        FloatDType::F32
    }

    /// How a training step computes: `None` for f32.
    pub fn mixed(self) -> Option<Mixed> {
        (self != Precision::F32).then(|| Mixed {
            dtype: self.dtype(),
            scaler: (self == Precision::F16).then(|| Arc::new(Mutex::new(LossScaler::default()))),
        })
    }
}

/// A step in half precision: the dtype, and for f16 the loss scale it shares with the
/// other steps of its run.
#[derive(Clone, Debug)]
pub struct Mixed {
    /// The dtype the step computes in.
    pub dtype: FloatDType,
    /// The run's loss scale (f16 training steps only).
    pub scaler: Option<Arc<Mutex<LossScaler>>>,
}

impl Mixed {
    /// The same dtype without a loss scale: a step that computes no gradient.
    pub fn inference(&self) -> Self {
        Self {
            dtype: self.dtype,
            scaler: None,
        }
    }
}

/// A copy of `module` whose float parameters are cast to `dtype`, differentiably: each
/// keeps its id, and under autodiff the cast is an operation of the graph, so the
/// gradients of a loss computed with the copy arrive at `module`'s own (f32) parameters,
/// in their dtype. Parameters already in `dtype` are shared, not copied.
pub fn compute_copy<M: Module>(module: &M, dtype: FloatDType) -> M {
    struct Cast(FloatDType);
    impl ModuleMapper for Cast {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let dtype = self.0;
            param.map(|tensor| match tensor.dtype() == dtype.into() {
                true => tensor,
                false => tensor.cast(dtype),
            })
        }
    }
    module.clone().map(&mut Cast(dtype))
}

/// A dynamic loss scale for f16, PyTorch's `GradScaler` with its defaults: it starts at
/// 2^16, is halved at every step whose gradients are not finite (that step is skipped),
/// and doubled after 2000 steps in a row whose gradients are.
#[derive(Clone, Debug, PartialEq)]
pub struct LossScaler {
    scale: f32,
    finite_in_a_row: usize,
    skipped: usize,
}

impl Default for LossScaler {
    fn default() -> Self {
        Self {
            scale: LossScaler::INITIAL,
            finite_in_a_row: 0,
            skipped: 0,
        }
    }
}

impl LossScaler {
    /// The first scale.
    pub const INITIAL: f32 = 65536.0;
    /// Finite steps in a row after which the scale doubles.
    pub const GROWTH_INTERVAL: usize = 2000;

    /// The scale the next step multiplies its loss by.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Steps skipped so far because their gradients were not finite.
    pub fn skipped(&self) -> usize {
        self.skipped
    }

    /// Records whether a step's gradients were finite, and sets the next scale.
    pub fn update(&mut self, finite: bool) {
        if !finite {
            self.scale = (self.scale / 2.0).max(f32::MIN_POSITIVE);
            self.finite_in_a_row = 0;
            self.skipped += 1;
            return;
        }
        self.finite_in_a_row += 1;
        if self.finite_in_a_row == Self::GROWTH_INTERVAL {
            self.scale = (self.scale * 2.0).min(f32::MAX / 2.0);
            self.finite_in_a_row = 0;
        }
    }
}

/// Divides every gradient of `module`'s parameters in `grads` by `scale`, and says
/// whether all of them are finite (one read from the device for all of them).
pub fn unscale<M: Module>(grads: &mut GradientsParams, module: &M, scale: f32) -> bool {
    struct Unscale<'a> {
        grads: &'a mut GradientsParams,
        inverse: f32,
        total: Option<Tensor<1>>,
    }
    impl ModuleVisitor for Unscale<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let Some(grad) = self.grads.remove::<D>(param.id) else {
                return;
            };
            let grad = grad.mul_scalar(self.inverse);
            // A sum is not finite when any of its terms is not (f32 gradients do not
            // overflow it otherwise).
            let sum = grad.clone().sum().cast(FloatDType::F32);
            self.total = Some(match self.total.take() {
                Some(total) => total + sum,
                None => sum,
            });
            self.grads.register(param.id, grad);
        }
    }
    let mut visitor = Unscale {
        grads,
        inverse: 1.0 / scale,
        total: None,
    };
    module.visit(&mut visitor);
    visitor
        .total
        .is_none_or(|total| total.into_scalar::<f32>().is_finite())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loss_scale_halves_on_overflow_and_doubles_after_a_run_of_finite_steps() {
        let mut s = LossScaler::default();
        assert_eq!(s.scale(), 65536.0);
        s.update(false);
        s.update(false);
        assert_eq!((s.scale(), s.skipped()), (16384.0, 2));
        for _ in 0..LossScaler::GROWTH_INTERVAL - 1 {
            s.update(true);
        }
        assert_eq!(s.scale(), 16384.0);
        s.update(false);
        for _ in 0..LossScaler::GROWTH_INTERVAL - 1 {
            s.update(true);
        }
        assert_eq!(s.scale(), 8192.0, "an overflow restarts the count");
        s.update(true);
        assert_eq!((s.scale(), s.skipped()), (16384.0, 3));
    }

    #[test]
    fn gradients_reach_the_f32_weights_through_the_cast_copy() {
        use burn::nn::LinearConfig;
        for backend in Backend::compiled() {
            let _turn = crate::backend::gpu_turn(backend);
            let device = backend.device().unwrap();
            let dtypes = [Precision::F16, Precision::Bf16]
                .into_iter()
                .filter(|p| device.supports_dtype(p.dtype()));
            for precision in dtypes {
                let ad = device.clone().autodiff();
                ad.seed(3);
                let linear = LinearConfig::new(8, 4).init(&ad);
                let x = Tensor::<2>::random([5, 8], burn::tensor::Distribution::Default, &ad);
                let copy = compute_copy(&linear, precision.dtype());
                assert_eq!(copy.weight.val().dtype(), precision.dtype().into());
                let y = copy.forward(x.clone().cast(precision.dtype()));
                let loss = y.cast(FloatDType::F32).sum() * 1024.0;
                let mut grads = GradientsParams::from_grads(loss.backward(), &linear);
                assert!(
                    unscale(&mut grads, &linear, 1024.0),
                    "{backend} {precision:?}"
                );
                let dw: Tensor<2> = grads.get(linear.weight.id).expect("a weight gradient");
                assert_eq!(dw.dtype(), FloatDType::F32.into());
                // d(sum(x W + b))/dW = column sums of x, for every output.
                let want = x.clone().inner().sum_dim(0).transpose().repeat_dim(1, 4);
                let diff = (dw - want.clone()).abs().max().into_scalar::<f32>();
                let tol = match precision {
                    // x and the product are each rounded to the dtype.
                    Precision::Bf16 => 2e-2,
                    _ => 3e-3,
                } * want.abs().max().into_scalar::<f32>();
                assert!(diff <= tol, "{backend} {precision:?}: {diff} > {tol}");
                // Overflow: a scale past f16's range makes the sum infinite.
                // (A fresh copy: the first backward consumed the graph's casts.)
                let copy = compute_copy(&linear, precision.dtype());
                let loss = copy
                    .forward(x.cast(precision.dtype()))
                    .sum()
                    .cast(FloatDType::F32)
                    * f32::MAX;
                let mut grads = GradientsParams::from_grads(loss.backward(), &linear);
                assert!(
                    !unscale(&mut grads, &linear, 1.0),
                    "{backend} {precision:?}"
                );
            }
        }
    }
}
