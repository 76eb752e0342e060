//! AdamW as one of Burn's optimizers ([`burn::optim::Optimizer`]), with Burn's numbers and
//! state, whose step over a parameter is one parallel pass on the CPU backends; and
//! PyTorch's clipping of all the gradients together by their norm ([`clip_grad_norm`]).
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

use std::collections::HashSet;

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::{
    AdamWState, AdaptiveMomentumState, GradientsParams, LearningRate, ModuleOptimizer, Optimizer,
};
use burn::tensor::{DType, Device, FloatDType, Tensor};

use crate::dispatch::{self, RowCall, RowOp, RowPath};
use crate::error::{Check, ConfigError};
#[cfg(feature = "cpu-kernels")]
use crate::ops::{adamw, squares};

crate::configs::config! {
    /// The numbers of an [`AdamW`]: the moments' decays, epsilon and the weight decay.
    /// Defaults are PyTorch's `torch.optim.AdamW`'s (Burn's `AdamWConfig` has epsilon 1e-5 and
    /// a weight decay of 1e-4).
    #[derive(Debug)]
    pub struct AdamWConfig {
        ;
        /// The first moment's decay, in `[0, 1)`. Default: 0.9.
        pub beta_1: f32 = 0.9 => with_beta_1,
        /// The second moment's decay, in `[0, 1)`. Default: 0.999.
        pub beta_2: f32 = 0.999 => with_beta_2,
        /// Added to the square root of the second moment, above 0. Default: 1e-8.
        pub epsilon: f32 = 1e-8 => with_epsilon,
        /// Decoupled weight decay: each step multiplies a parameter by `1 - lr · weight_decay`
        /// before the update; 0 or more. Default: 0.01.
        pub weight_decay: f32 = 0.01 => with_weight_decay,
    }
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
        check_shapes(&tensor, &grad, state.as_ref());
        // A state of AMSGrad's (from Burn's optimizer) keeps a third moment.
        let (op, moments) = match &state {
            None => (RowOp::AdamW, vec![]),
            Some(AdamWState { momentum }) => (
                match momentum.max_moment_2 {
                    Some(_) => RowOp::AdamWAmsgrad,
                    None => RowOp::AdamW,
                },
                vec![momentum.moment_1.dtype(), momentum.moment_2.dtype()],
            ),
        };
        let call = RowCall::of(op, &tensor).with([grad.dtype()]).with(moments);
        let path = dispatch::row(call);
        // A parameter without elements: nothing to compute, on any backend (Burn's
        // operations are not all defined on empty tensors). Its moments are as empty.
        if path == RowPath::Empty {
            let time = state.map_or(1, |s| s.momentum.time + 1);
            let momentum = AdaptiveMomentumState::new(time, grad.clone(), grad);
            return (tensor, Some(AdamWState::new(momentum)));
        }
        // A tensor autodiff tracks (a step called directly on one, where Burn's optimizers
        // pass the inner tensors) takes Burn's operations, whose step is differentiable.
        #[cfg(feature = "cpu-kernels")]
        if path == RowPath::Fused && ![&tensor, &grad].iter().any(|t| t.is_tracked()) {
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
        self.burn.step(lr, tensor, grad, state)
    }

    fn to_device<const D: usize>(state: AdamWState<D>, device: &Device) -> AdamWState<D> {
        <burn::optim::AdamW as Optimizer>::to_device(state, device)
    }
}

/// Panics, naming both shapes, where a parameter's gradient or its moments in `state`
/// are not of the parameter's shape (a state loaded for another parameter, or for this
/// one before it changed shape): the fused step would read them in the wrong places, and
/// Burn's would broadcast some.
fn check_shapes<const D: usize>(
    param: &Tensor<D>,
    grad: &Tensor<D>,
    state: Option<&AdamWState<D>>,
) {
    let shape = param.dims();
    assert!(
        grad.dims() == shape,
        "AdamW: the gradient has shape {:?} and its parameter {shape:?}",
        grad.dims()
    );
    if let Some(AdamWState { momentum }) = state {
        let moments = [Some(&momentum.moment_1), Some(&momentum.moment_2)];
        for moment in moments
            .into_iter()
            .chain([momentum.max_moment_2.as_ref()])
            .flatten()
        {
            assert!(
                moment.dims() == shape,
                "AdamW: the state's moments have shape {:?} and their parameter {shape:?} (a \
                 state of another parameter, or of this one before it changed shape)",
                moment.dims()
            );
        }
    }
}

/// Clips the gradients of `module`'s parameters in `grads` together, as PyTorch's
/// `torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)`: the L2 norm of all of
/// them as one vector, and when it exceeds `max_norm`, every gradient multiplied by
/// `max_norm / (norm + 1e-6)`. Returns that norm (before clipping), `[1]` in f32, or `None`
/// when no parameter has a gradient in `grads`. Gradients in half precision are squared
/// in f32, gradients in f64 in f64 (a norm past f32's range still clips them), and each
/// is scaled in its own dtype. A parameter met twice (tied) counts once, as in PyTorch's
/// `parameters()`.
///
/// On flex and ndarray in f32, each gradient's squares are summed in one parallel pass
/// and the norm is read on the host, where the decision is made: a step whose norm is
/// within `max_norm` touches no gradient. Elsewhere (a GPU, whose norm is not read back:
/// that would wait for the step's work) the scale, 1 or less, is computed on the device
/// and every gradient multiplied by it.
///
/// ```
/// use burn::module::Module;
/// use burn::nn::LinearConfig;
/// use burn::optim::GradientsParams;
/// use burn::tensor::{Device, Tensor};
///
/// let device = Device::default().autodiff();
/// let model = LinearConfig::new(4, 1).with_bias(false).init(&device);
/// let x = Tensor::<2>::ones([1, 4], &device) * 100.0;
/// let mut grads = GradientsParams::from_grads(model.forward(x).sum().backward(), &model);
/// // The weight's gradient is x: four hundreds, a norm of 200.
/// let norm = mha::optim::clip_grad_norm(&mut grads, &model, 1.0).unwrap();
/// assert_eq!(norm.into_scalar::<f32>(), 200.0);
/// let clipped = grads.get::<2>(model.weight.id).unwrap();
/// let norm_after = clipped.powi_scalar(2).sum().sqrt().into_scalar::<f32>();
/// assert!((norm_after - 1.0).abs() < 1e-5);
/// ```
///
/// # Panics
/// If `max_norm` is not a finite number above 0 (the message gives it).
pub fn clip_grad_norm<M: Module>(
    grads: &mut GradientsParams,
    module: &M,
    max_norm: f32,
) -> Option<Tensor<1>> {
    assert!(
        max_norm.is_finite() && max_norm > 0.0,
        "clip_grad_norm: max_norm must be a finite number above 0, got {max_norm}"
    );
    let mut sum = SquareSums {
        grads: &*grads,
        host: 0.0,
        device: None,
        first: None,
        seen: HashSet::new(),
    };
    module.visit(&mut sum);
    let device = sum.first?;
    let Some(squares) = sum.device else {
        // Every gradient's squares on the host: the norm and the decision there.
        let norm = sum.host.sqrt() as f32;
        let coef = max_norm / (norm + 1e-6);
        // A NaN norm scales by NaN, as on the device and in PyTorch (without
        // `error_if_nonfinite`): the step shows it rather than hide it on some backends.
        if coef < 1.0 || coef.is_nan() {
            module.visit(&mut Scale {
                grads,
                factor: Factor::Host(coef),
                seen: HashSet::new(),
            });
        }
        return Some(Tensor::from_floats([norm], &device));
    };
    // In the dtype of the squares' sum: f64 where a gradient is f64, else f32.
    let norm = squares.add_scalar(sum.host).sqrt();
    let bound = Tensor::<1>::from_floats([max_norm], &norm.device());
    let bound = bound.cast(FloatDType::from(norm.dtype()));
    let coef = bound / norm.clone().add_scalar(1e-6);
    module.visit(&mut Scale {
        grads,
        factor: Factor::Device(Box::new(coef.clamp_max(1.0))),
        seen: HashSet::new(),
    });
    Some(norm.cast(FloatDType::F32))
}

/// The sum of the squares of every gradient: on the host where our kernel sums them (flex
/// and ndarray in f32), else on the device.
struct SquareSums<'a> {
    grads: &'a GradientsParams,
    host: f64,
    device: Option<Tensor<1>>,
    /// The device of the first gradient met.
    first: Option<Device>,
    /// The parameters counted (a tied one is met twice).
    seen: HashSet<ParamId>,
}

impl ModuleVisitor for SquareSums<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        let Some(grad) = self.grads.get::<D>(param.id) else {
            return;
        };
        if !self.seen.insert(param.id) {
            return;
        }
        self.first.get_or_insert_with(|| grad.device());
        match dispatch::row(RowCall::of(RowOp::SquareSum, &grad)) {
            RowPath::Empty => return,
            #[cfg(feature = "cpu-kernels")]
            RowPath::Fused => {
                self.host += f64::from(squares::square_sum(grad));
                return;
            }
            RowPath::Burn | RowPath::BurnInF32 => {}
        }
        // f64 squared in f64 (f32 overflows past 1.8e19); half precision in f32.
        let wide = match grad.dtype() {
            DType::F64 => FloatDType::F64,
            _ => FloatDType::F32,
        };
        let sum = grad.cast(wide).square().sum();
        self.device = Some(match self.device.take() {
            Some(total) if total.dtype() == sum.dtype() => total + sum,
            Some(total) => total.cast(FloatDType::F64) + sum.cast(FloatDType::F64),
            None => sum,
        });
    }
}

/// The factor the gradients are multiplied by.
enum Factor {
    Host(f32),
    /// `[1]`, in f32 or in f64 where a gradient is f64.
    Device(Box<Tensor<1>>),
}

/// Multiplies every gradient by the factor.
struct Scale<'a> {
    grads: &'a mut GradientsParams,
    factor: Factor,
    /// The parameters scaled (a tied one is met twice).
    seen: HashSet<ParamId>,
}

impl ModuleVisitor for Scale<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if !self.seen.insert(param.id) {
            return;
        }
        let Some(grad) = self.grads.remove::<D>(param.id) else {
            return;
        };
        let scaled = match &self.factor {
            Factor::Host(coef) => grad.mul_scalar(*coef),
            Factor::Device(coef) => {
                let coef = (**coef).clone().cast(FloatDType::from(grad.dtype()));
                grad * coef.reshape([1; D])
            }
        };
        self.grads.register(param.id, scaled);
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

    /// A step called directly on a tracked parameter (Burn's optimizers pass the inner
    /// tensors) is differentiable, as Burn's AdamW's: the parameter's gradient through it
    /// is Burn's (where the fused step gave none, silently).
    #[test]
    fn a_step_on_a_tracked_parameter_is_differentiable_as_burns() {
        for device in devices() {
            let device = device.autodiff();
            let optim = AdamWConfig::new().with_weight_decay(0.1).build();
            let values = [1.0, -2.0, 0.5, 0.0];
            let grad = Tensor::<1>::from_floats([0.3, -0.1, 0.0, 2.0], &device);
            let through = |moved: Tensor<1>, param: &Tensor<1>| {
                let grads = (moved * Tensor::from_floats([1.0, 2.0, 3.0, 4.0], &device))
                    .sum()
                    .backward();
                param
                    .grad(&grads)
                    .map(|g| g.into_data().try_to_vec::<f32>().unwrap())
            };
            let ours = Tensor::<1>::from_floats(values, &device).require_grad();
            let (moved, _) = optim.step(0.01, ours.clone(), grad.clone(), None);
            let burns = Tensor::<1>::from_floats(values, &device).require_grad();
            let (burn_moved, _) = optim.burn.step(0.01, burns.clone(), grad, None);
            let want = through(burn_moved, &burns);
            assert!(want.is_some(), "{device:?}: Burn's step is differentiable");
            assert_eq!(through(moved, &ours), want, "{device:?}");
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

    /// A linear layer of 300 x 200 (60,000 weights: three whole parallel chunks and a part)
    /// and its bias, with the gradients of `scale` times a random loss.
    fn layer_and_grads(
        device: &burn::tensor::Device,
        scale: f32,
    ) -> (burn::nn::Linear, burn::optim::GradientsParams) {
        use burn::nn::LinearConfig;
        use burn::optim::GradientsParams;

        device.seed(5);
        let model = LinearConfig::new(300, 200).init(device);
        let x = Tensor::<2>::random([4, 300], Distribution::Default, device);
        let loss = model.forward(x).sum() * scale;
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        (model, grads)
    }

    /// The gradients of the layer's weight and bias, as f64 on the host.
    fn grad_values(
        model: &burn::nn::Linear,
        grads: &burn::optim::GradientsParams,
    ) -> [Vec<f64>; 2] {
        let weight = grads.get::<2>(model.weight.id).unwrap();
        let bias = grads.get::<1>(model.bias.as_ref().unwrap().id).unwrap();
        let host = |v: Vec<f32>| v.into_iter().map(f64::from).collect();
        [
            host(
                weight
                    .into_data()
                    .convert::<f32>()
                    .try_to_vec::<f32>()
                    .unwrap(),
            ),
            host(
                bias.into_data()
                    .convert::<f32>()
                    .try_to_vec::<f32>()
                    .unwrap(),
            ),
        ]
    }

    fn l2(values: &[Vec<f64>; 2]) -> f64 {
        values.iter().flatten().map(|v| v * v).sum::<f64>().sqrt()
    }

    #[test]
    fn clipping_scales_every_gradient_to_the_global_norm_above_it_only() {
        use super::clip_grad_norm;

        for device in devices() {
            // Norms of about 0.5 (left alone), 490 and 24,000.
            for (scale, clips) in [(0.001, false), (1.0, true), (50.0, true)] {
                let what = format!("{device:?}, loss x {scale}");
                let (model, mut grads) = layer_and_grads(&device, scale);
                let before = grad_values(&model, &grads);
                let want = l2(&before);
                let max_norm = 3.0;
                let norm = clip_grad_norm(&mut grads, &model, max_norm).expect("gradients");
                let norm = f64::from(norm.into_scalar::<f32>());
                assert!(
                    (norm - want).abs() <= want * 1e-6,
                    "{what}: {norm} vs {want}"
                );
                let after = grad_values(&model, &grads);
                // PyTorch's factor, clamped at 1: each gradient multiplied by it.
                let coef = (f64::from(max_norm) / (want + 1e-6)).min(1.0);
                assert_eq!(coef < 1.0, clips, "{what}: a norm of {want}");
                for (a, b) in after.iter().flatten().zip(before.iter().flatten()) {
                    assert!((a - b * coef).abs() <= (b * coef).abs() * 1e-6, "{what}");
                }
                match coef < 1.0 {
                    true => assert!((l2(&after) - 3.0).abs() < 1e-5, "{what}: {}", l2(&after)),
                    false => assert_eq!(after, before, "{what}: a gradient within it changed"),
                }
            }
        }
    }

    /// f64 gradients are squared in f64: a gradient of 1e20 (whose square f32 holds as
    /// inf, which clipped every gradient to 0) clips to the bound as in PyTorch.
    #[test]
    fn f64_gradients_clip_past_f32s_range() {
        use super::clip_grad_norm;
        use crate::ModuleDType;
        use burn::nn::LinearConfig;
        use burn::optim::GradientsParams;
        use burn::tensor::{DType, FloatDType, TensorData};

        for device in devices() {
            if !device.supports_dtype(DType::F64) {
                continue;
            }
            let model = LinearConfig::new(2, 1).with_bias(false).init(&device);
            let model = model.to_dtype(FloatDType::F64);
            let grad = TensorData::new(vec![1e20f64, -1e20], [2, 1]);
            let mut grads = GradientsParams::new();
            let grad = Tensor::<2>::from_data(grad, &device).cast(FloatDType::F64);
            grads.register(model.weight.id, grad);
            let norm = clip_grad_norm(&mut grads, &model, 1.0).expect("gradients");
            let want = 2f64.sqrt() * 1e20;
            let norm = f64::from(norm.into_scalar::<f32>());
            assert!((norm - want).abs() <= want * 1e-6, "{device:?}: {norm}");
            let after = grads.get::<2>(model.weight.id).unwrap();
            assert_eq!(after.dtype(), DType::F64);
            let after = after.into_data().try_to_vec::<f64>().unwrap();
            let half = 0.5f64.sqrt();
            assert!(
                (after[0] - half).abs() < 1e-12 && (after[1] + half).abs() < 1e-12,
                "{device:?}: {after:?}"
            );
        }
    }

    /// A parameter a module holds twice (tied) counts once and is scaled once, as in
    /// PyTorch's `parameters()` (its squares counted twice, its gradient scaled twice).
    #[test]
    fn a_tied_parameter_counts_once() {
        use super::clip_grad_norm;
        use burn::module::Module;
        use burn::nn::{Linear, LinearConfig};
        use burn::optim::GradientsParams;

        #[derive(Module, Debug)]
        struct Tied {
            first: Linear,
            second: Linear,
        }

        for device in devices() {
            let linear = LinearConfig::new(3, 2).with_bias(false).init(&device);
            let tied = Tied {
                first: linear.clone(),
                second: linear.clone(),
            };
            let mut grads = GradientsParams::new();
            let tens = Tensor::<2>::ones([3, 2], &device) * 10.0;
            grads.register(linear.weight.id, tens);
            let norm = clip_grad_norm(&mut grads, &tied, 1.0).expect("gradients");
            let want = 6f32.sqrt() * 10.0;
            let norm = norm.into_scalar::<f32>();
            assert!((norm - want).abs() <= want * 1e-6, "{device:?}: {norm}");
            let after = grads.get::<2>(linear.weight.id).unwrap();
            let after = after
                .into_data()
                .convert::<f32>()
                .try_to_vec::<f32>()
                .unwrap();
            let each = 10.0 / (want + 1e-6);
            assert!(
                after.iter().all(|&g| (g - each).abs() < 1e-6),
                "{device:?}: {after:?}"
            );
        }
    }

    /// A NaN among the gradients makes the norm NaN and every gradient NaN on every
    /// backend, as PyTorch's clipping (the host's decision left them untouched).
    #[test]
    fn a_nan_gradient_clips_every_gradient_to_nan_on_every_backend() {
        use super::clip_grad_norm;

        for device in devices() {
            let (model, mut grads) = layer_and_grads(&device, 1.0);
            let weight = grads.remove::<2>(model.weight.id).unwrap();
            let nan = Tensor::<2>::from_floats([[f32::NAN]], &weight.device());
            let weight = weight.slice_assign([0..1, 0..1], nan);
            grads.register(model.weight.id, weight);
            let norm = clip_grad_norm(&mut grads, &model, 3.0).expect("gradients");
            assert!(norm.into_scalar::<f32>().is_nan(), "{device:?}");
            let [weight, bias] = grad_values(&model, &grads);
            assert!(
                weight.iter().chain(&bias).all(|g| g.is_nan()),
                "{device:?}: a gradient kept its value"
            );
        }
    }

    /// A gradient or a state not of its parameter's shape is refused naming both shapes,
    /// on every backend (flex's fused step read the moments in the wrong places).
    #[test]
    fn a_state_of_another_shape_is_refused_naming_both() {
        use super::AdaptiveMomentumState;

        for device in devices() {
            let optim = AdamWConfig::new().build();
            let param = Tensor::<2>::zeros([4, 8], &device).inner();
            let grad = Tensor::<2>::ones([4, 8], &device).inner();
            let refused = |grad: Tensor<2>, state: Option<AdamWState<2>>| {
                let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let _ = optim.step(1e-3, param.clone(), grad, state);
                }));
                *out.expect_err("refused").downcast::<String>().unwrap()
            };
            let moments = |dims: [usize; 2]| {
                let m = Tensor::<2>::zeros(dims, &device).inner();
                Some(AdamWState::new(AdaptiveMomentumState::new(1, m.clone(), m)))
            };
            let message = refused(grad.clone(), moments([8, 4]));
            assert!(
                message.starts_with(
                    "AdamW: the state's moments have shape [8, 4] and their parameter [4, 8]"
                ),
                "{device:?}: {message}"
            );
            let message = refused(grad.clone(), moments([1, 8]));
            assert!(
                message.contains("have shape [1, 8]"),
                "{device:?}: {message}"
            );
            let message = refused(Tensor::<2>::ones([4, 1], &device).inner(), None);
            assert_eq!(
                message, "AdamW: the gradient has shape [4, 1] and its parameter [4, 8]",
                "{device:?}"
            );
        }
    }

    #[test]
    fn clipping_without_gradients_or_with_a_bad_bound() {
        use super::clip_grad_norm;
        use burn::optim::GradientsParams;

        for device in devices() {
            let (model, _) = layer_and_grads(&device, 1.0);
            let mut none = GradientsParams::new();
            assert!(
                clip_grad_norm(&mut none, &model, 1.0).is_none(),
                "{device:?}"
            );
        }
        let device = devices().remove(0);
        let (model, mut grads) = layer_and_grads(&device, 1.0);
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                clip_grad_norm(&mut grads, &model, bad)
            }));
            let message = *out.expect_err("refused").downcast::<String>().unwrap();
            assert!(
                message.contains("max_norm") && message.contains(&format!("{bad}")),
                "{message}"
            );
        }
    }
}
