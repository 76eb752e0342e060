//! AdamW as one of Burn's optimizers ([`burn::optim::Optimizer`]), with Burn's numbers and
//! state, whose step over a parameter is one parallel pass on the CPU backends.
//!
//! Burn's `AdamW` steps each parameter through about fifteen elementwise operations (the
//! two moments, their bias corrections, the square root, the decay, the update), each a
//! new tensor and a pass over memory on one thread: for a small model on the CPU, a share
//! of a training step that grows with the parameters, not with the batch. [`AdamW`]
//! computes the same operations in the same order, so the same numbers to the last bit,
//! in one pass over the parameter, its gradient and its moments, split over the cores, on
//! flex and ndarray in f32. On every other backend and dtype its step is Burn's `AdamW`'s
//! (a parameter without elements is left as it is, on any backend). Its state is Burn's
//! [`AdamWState`]: a checkpoint written with either optimizer resumes with the other, given
//! the same settings ([`AdamWConfig`]'s defaults are PyTorch's, not Burn's).
//!
//! ```
//! use burn::module::Module;
//! use burn::nn::LinearConfig;
//! use burn::optim::GradientsParams;
//! use burn::tensor::{Device, Distribution, Tensor};
//! use mha::optim::AdamWConfig;
//!
//! let device = Device::default().autodiff();
//! let model = LinearConfig::new(8, 4).init(&device);
//! let mut optim = AdamWConfig::new().with_weight_decay(0.1).init();
//! let x = Tensor::<2>::random([16, 8], Distribution::Default, &device);
//! let loss = model.forward(x).powi_scalar(2).mean();
//! let grads = GradientsParams::from_grads(loss.backward(), &model);
//! let model = optim.step(1e-3, model, grads);
//! # let _ = model;
//! ```

use burn::config::Config;
use burn::optim::{AdamWState, AdaptiveMomentumState, LearningRate, ModuleOptimizer, Optimizer};
use burn::tensor::{Device, Tensor};

use crate::error::{Check, ConfigError};
use crate::ops::adamw;

/// The numbers of an [`AdamW`]: the moments' decays, epsilon and the weight decay.
/// Defaults are PyTorch's `torch.optim.AdamW`'s (Burn's `AdamWConfig` has epsilon 1e-5 and
/// a weight decay of 1e-4).
#[derive(Config, Debug)]
pub struct AdamWConfig {
    /// The first moment's decay, in `[0, 1)`. Default: 0.9.
    #[config(default = 0.9)]
    pub beta_1: f32,
    /// The second moment's decay, in `[0, 1)`. Default: 0.999.
    #[config(default = 0.999)]
    pub beta_2: f32,
    /// Added to the square root of the second moment, above 0. Default: 1e-8.
    #[config(default = 1e-8)]
    pub epsilon: f32,
    /// Decoupled weight decay: each step multiplies a parameter by `1 - lr · weight_decay`
    /// before the update; 0 or more. Default: 0.01.
    #[config(default = 0.01)]
    pub weight_decay: f32,
}

impl AdamWConfig {
    /// The optimizer of one parameter group (for `ModuleOptimizer::with_group`), or an
    /// error naming the field and its value.
    pub fn try_build(&self) -> Result<AdamW, ConfigError> {
        let check = Check("AdamWConfig");
        check.probability("beta_1", f64::from(self.beta_1))?;
        check.probability("beta_2", f64::from(self.beta_2))?;
        check.positive("epsilon", f64::from(self.epsilon))?;
        check.non_negative("weight_decay", f64::from(self.weight_decay))?;
        let burn = burn::optim::AdamWConfig::new()
            .with_beta_1(self.beta_1)
            .with_beta_2(self.beta_2)
            .with_epsilon(self.epsilon)
            .with_weight_decay(self.weight_decay)
            .build();
        Ok(AdamW {
            beta_1: self.beta_1,
            beta_2: self.beta_2,
            epsilon: self.epsilon,
            weight_decay: self.weight_decay,
            burn,
        })
    }

    /// [`try_build`](Self::try_build), panicking with its message.
    ///
    /// # Panics
    /// If a field is out of its range.
    pub fn build(&self) -> AdamW {
        self.try_build().unwrap_or_else(|err| panic!("{err}"))
    }

    /// The optimizer of a whole module, without gradient clipping (add it with
    /// `ModuleOptimizer::with_grad_clipping`), or an error naming the field and its value.
    pub fn try_init(&self) -> Result<ModuleOptimizer, ConfigError> {
        Ok(ModuleOptimizer::from(self.try_build()?))
    }

    /// [`try_init`](Self::try_init), panicking with its message.
    ///
    /// # Panics
    /// If a field is out of its range.
    pub fn init(&self) -> ModuleOptimizer {
        ModuleOptimizer::from(self.build())
    }
}

/// AdamW (Loshchilov and Hutter, decoupled weight decay), built by [`AdamWConfig`]: Burn's
/// `AdamW` step for step (without AMSGrad or cautious decay), in one pass per parameter
/// on flex and ndarray in f32 (see [the module](self)). A state that carries AMSGrad's
/// maximum (saved by Burn's `AdamW` with `amsgrad`) is stepped by Burn's `AdamW` without
/// AMSGrad, the maximum kept as it was.
#[derive(Clone)]
pub struct AdamW {
    beta_1: f32,
    beta_2: f32,
    epsilon: f32,
    weight_decay: f32,
    /// Burn's, for the steps that are not ours.
    burn: burn::optim::AdamW,
}

impl core::fmt::Debug for AdamW {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("AdamW")
            .field("beta_1", &self.beta_1)
            .field("beta_2", &self.beta_2)
            .field("epsilon", &self.epsilon)
            .field("weight_decay", &self.weight_decay)
            .finish()
    }
}

impl Optimizer for AdamW {
    type State<const D: usize> = AdamWState<D>;

    fn step<const D: usize>(
        &self,
        lr: LearningRate,
        tensor: Tensor<D>,
        grad: Tensor<D>,
        state: Option<AdamWState<D>>,
    ) -> (Tensor<D>, Option<AdamWState<D>>) {
        // A parameter without elements: nothing to compute, on any backend (Burn's
        // operations are not all defined on empty tensors). Its moments are as empty.
        if tensor.dims().contains(&0) {
            let time = state.map_or(1, |s| s.momentum.time + 1);
            let momentum = AdaptiveMomentumState::new(time, grad.clone(), grad);
            return (tensor, Some(AdamWState::new(momentum)));
        }
        // A state of AMSGrad's (from Burn's optimizer) keeps a third moment: Burn's step.
        let ours = match &state {
            None => adamw::is_fused(&[&tensor, &grad]),
            Some(AdamWState { momentum }) => {
                momentum.max_moment_2.is_none()
                    && adamw::is_fused(&[&tensor, &grad, &momentum.moment_1, &momentum.moment_2])
            }
        };
        #[cfg(any(feature = "flex", feature = "ndarray"))]
        if ours {
            // Burn's numbers, each rounded to f32 where Burn rounds it.
            let time = state.as_ref().map_or(1, |s| s.momentum.time + 1);
            let t = i32::try_from(time).unwrap_or(i32::MAX);
            let decay = lr * f64::from(self.weight_decay);
            let step = adamw::AdamWStep {
                lr: lr as f32,
                beta_1: self.beta_1,
                beta_2: self.beta_2,
                epsilon: self.epsilon,
                keep: (decay != 0.0).then_some((1.0 - decay) as f32),
                corrections: [1.0 - self.beta_1.powi(t), 1.0 - self.beta_2.powi(t)],
            };
            let moments = state.map(|s| [s.momentum.moment_1, s.momentum.moment_2]);
            let [param, moment_1, moment_2] = adamw::adamw_step(tensor, grad, moments, step);
            let momentum = AdaptiveMomentumState::new(time, moment_1, moment_2);
            return (param, Some(AdamWState::new(momentum)));
        }
        #[cfg(not(any(feature = "flex", feature = "ndarray")))]
        let _ = ours;
        self.burn.step(lr, tensor, grad, state)
    }

    fn to_device<const D: usize>(state: AdamWState<D>, device: &Device) -> AdamWState<D> {
        <burn::optim::AdamW as Optimizer>::to_device(state, device)
    }
}

#[cfg(test)]
mod tests {
    use burn::optim::{AdamWState, Optimizer};
    use burn::tensor::{Distribution, Tensor};

    use super::AdamWConfig;
    use crate::testing::devices;

    /// The floats of `x`, as bits.
    fn bits<const D: usize>(x: &Tensor<D>) -> Vec<u32> {
        let values: Vec<f32> = x.to_data().convert::<f32>().try_to_vec::<f32>().unwrap();
        values.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn steps_are_burns_adamw_to_the_last_bit() {
        for device in devices() {
            // 37,000 elements: two whole parallel chunks and a part of one.
            let shape = [37, 1000];
            for decay in [0.1, 0.0] {
                let ours = AdamWConfig::new()
                    .with_beta_2(0.99)
                    .with_weight_decay(decay)
                    .build();
                let burns = burn::optim::AdamWConfig::new()
                    .with_beta_2(0.99)
                    .with_epsilon(1e-8)
                    .with_weight_decay(decay)
                    .build();
                let param = Tensor::<2>::random(shape, Distribution::Default, &device).inner();
                let (mut p_ours, mut p_burns) = (param.clone(), param.clone());
                let (mut s_ours, mut s_burns): (Option<AdamWState<2>>, _) = (None, None);
                for (step, lr) in [1e-3, 5e-4, 2e-3].into_iter().enumerate() {
                    let grad = Tensor::<2>::random(shape, Distribution::Normal(0.0, 1e-2), &device)
                        .inner();
                    (p_ours, s_ours) = ours.step(lr, p_ours, grad.clone(), s_ours);
                    (p_burns, s_burns) = burns.step(lr, p_burns, grad, s_burns);
                    let (a, b) = (
                        &s_ours.as_ref().unwrap().momentum,
                        &s_burns.as_ref().unwrap().momentum,
                    );
                    let what = format!("{device:?}, decay {decay}, step {}", step + 1);
                    assert_eq!(a.time, b.time, "{what}: time");
                    assert!(bits(&p_ours) == bits(&p_burns), "{what}: parameter");
                    assert!(
                        bits(&a.moment_1) == bits(&b.moment_1),
                        "{what}: first moment"
                    );
                    assert!(
                        bits(&a.moment_2) == bits(&b.moment_2),
                        "{what}: second moment"
                    );
                    assert!(a.max_moment_2.is_none());
                }
                // The steps moved the parameter: the comparison is of something.
                let moved = (p_ours - param).abs().max().into_scalar::<f32>();
                assert!(moved > 1e-3, "{device:?}: moved by {moved}");
            }
        }
    }

    #[test]
    fn a_run_saved_with_burns_adamw_goes_on_with_ours() {
        use burn::nn::{Linear, LinearConfig};
        use burn::optim::GradientsParams;

        for device in devices() {
            let x = Tensor::<2>::random([16, 8], Distribution::Default, &device);
            let grads = |model: &Linear| {
                let loss = model.forward(x.clone()).powi_scalar(2).mean();
                GradientsParams::from_grads(loss.backward(), model)
            };
            let burns = || {
                burn::optim::AdamWConfig::new()
                    .with_epsilon(1e-8)
                    .with_weight_decay(0.01)
                    .init()
            };
            let start = LinearConfig::new(8, 4).init(&device);
            let mut first = burns();
            let saved = first.step(1e-2, start.clone(), grads(&start));
            // From the saved state, two more steps with Burn's AdamW and with ours.
            let mut theirs = burns().load_record(first.to_record());
            let mut ours = AdamWConfig::new().init().load_record(first.to_record());
            let (mut a, mut b) = (saved.clone(), saved);
            for _ in 0..2 {
                a = theirs.step(1e-2, a.clone(), grads(&a));
                b = ours.step(1e-2, b.clone(), grads(&b));
            }
            let (wa, wb) = (a.weight.val().inner(), b.weight.val().inner());
            assert!(bits(&wa) == bits(&wb), "{device:?}: the weights differ");
            let ba = a.bias.as_ref().unwrap().val().inner();
            let bb = b.bias.as_ref().unwrap().val().inner();
            assert!(bits(&ba) == bits(&bb), "{device:?}: the biases differ");
            let moved = (wa - start.weight.val().inner()).abs().max();
            assert!(
                moved.into_scalar::<f32>() > 1e-3,
                "{device:?}: nothing moved"
            );
        }
    }

    #[test]
    fn a_parameter_moves_against_its_gradient() {
        for device in devices() {
            let optim = AdamWConfig::new().with_weight_decay(0.0).build();
            let param = Tensor::<1>::from_floats([1.0, -2.0, 0.5, 0.0], &device).inner();
            let grad = Tensor::<1>::from_floats([0.3, -0.1, 0.0, 2.0], &device).inner();
            let (moved, state) = optim.step(0.01, param.clone(), grad, None);
            // First step: m̂ = g, v̂ = g², so each element moves by lr · g / (|g| + ε).
            let moved: Vec<f32> = moved
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .unwrap();
            let expected = [1.0 - 0.01, -2.0 + 0.01, 0.5, 0.0 - 0.01];
            for (got, want) in moved.iter().zip(expected) {
                assert!(
                    (got - want).abs() < 1e-6,
                    "{device:?}: {moved:?} against {expected:?}"
                );
            }
            assert_eq!(state.unwrap().momentum.time, 1);
        }
    }

    #[test]
    fn an_empty_parameter_steps_to_itself() {
        for device in devices() {
            let optim = AdamWConfig::new().build();
            let param = Tensor::<2>::zeros([0, 8], &device).inner();
            let (param, state) = optim.step(1e-3, param.clone(), param.clone(), None);
            let (param, state) = optim.step(1e-3, param.clone(), param, state);
            assert_eq!(param.dims(), [0, 8]);
            let momentum = state.unwrap().momentum;
            assert_eq!((momentum.time, momentum.moment_1.dims()), (2, [0, 8]));
        }
    }

    #[test]
    fn numbers_out_of_range_are_refused_by_name() {
        let refused = |config: AdamWConfig| config.try_build().unwrap_err().to_string();
        let message = refused(AdamWConfig::new().with_beta_1(1.0));
        assert_eq!(message, "AdamWConfig.beta_1: must be in [0, 1), got 1");
        let message = refused(AdamWConfig::new().with_beta_2(-0.5));
        assert_eq!(message, "AdamWConfig.beta_2: must be in [0, 1), got -0.5");
        let message = refused(AdamWConfig::new().with_epsilon(0.0));
        assert_eq!(
            message,
            "AdamWConfig.epsilon: must be positive and finite, got 0"
        );
        let message = refused(AdamWConfig::new().with_weight_decay(f32::NAN));
        assert_eq!(
            message,
            "AdamWConfig.weight_decay: must be 0 or more and finite, got NaN"
        );
        assert!(AdamWConfig::new().try_init().is_ok());
    }
}
