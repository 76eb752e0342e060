//! The operations of our own, each with its own backward pass on the CPU backends (flex
//! and ndarray, f32), and the one backend extension that carries them to the backend
//! ([`Fused`]). Each file holds what is its operation's own: the function the modules
//! call (which asks the dispatcher whether to run the operation or Burn's ops), and its
//! [`Op`](crate::op::Op): the forward pass, what it keeps, the backward pass. The
//! pattern every operation follows is written once, in `crate::op`.
//!
//! | operation | what it replaces |
//! |---|---|
//! | [`attention`] | matmul, mask, softmax, matmul and their backward, which keep the `[B, H, Tq, Tk]` weights |
//! | [`linear`] | Burn's `linear` (its matmul allocates each result twice) |
//! | [`norm`] | the nine elementwise steps of Burn's `layer_norm`, and of an RMS norm |
//! | [`gelu`] | `erf` and four elementwise steps, each with a backward |
//! | [`swiglu`] | Burn's `silu` (a scalar `exp` per element) and a product, each with a backward |
//! | [`loss`] | `log_softmax`, a gather and a masked mean |
//! | [`adamw`] | the fifteen elementwise steps of Burn's AdamW over a parameter |
//! | [`squares`] | a square and a sum, for the global norm of gradient clipping |
//! | [`add`] | Burn's `add` of a residual connection (one thread below four million elements) |

// Burn 0.22 deprecates ndarray; it is still one of our backends.
#![allow(deprecated)]

pub(crate) mod adamw;
pub(crate) mod add;
pub(crate) mod attention;
pub(crate) mod gelu;
pub(crate) mod linear;
pub(crate) mod loss;
pub(crate) mod norm;
pub(crate) mod squares;
pub(crate) mod swiglu;

#[cfg(feature = "cpu-kernels")]
use burn::tensor::Tensor;

#[cfg(feature = "cpu-kernels")]
pub(crate) use fused::{FusedOp, run};

#[cfg(feature = "cpu-kernels")]
mod fused {
    use burn::backend::autodiff::{Autodiff, checkpoint::strategy::CheckpointStrategy};
    use burn::backend::{
        Backend, Dispatch, ExtensionType, backend_extension,
        tensor::{BoolTensor, FloatTensor},
    };
    use burn::tensor::{Bool, Tensor};

    use super::{adamw, add, attention, gelu, linear, loss, norm, squares, swiglu};
    use crate::cpu::CpuTensors;
    use crate::op;

    /// Which operation, with what it takes besides its tensors.
    #[derive(Clone, Debug)]
    pub(crate) enum FusedOp {
        /// [`attention::AttentionOp`].
        Attention(attention::Spec),
        /// [`linear::LinearOp`].
        Linear,
        /// [`linear::LinearGeluOp`].
        LinearGelu,
        /// [`norm::LayerNormOp`] (the RMS norm unless `center`).
        LayerNorm { epsilon: f64, center: bool },
        /// [`gelu::GeluOp`].
        Gelu,
        /// [`swiglu::SwiGluOp`].
        SwiGlu,
        /// [`loss::CrossEntropyOp`].
        CrossEntropy { targets: std::sync::Arc<[i64]> },
        /// [`adamw::AdamWOp`].
        AdamW(adamw::AdamWStep),
        /// [`squares::SquareSumOp`].
        SquareSum,
        /// [`add::AddOp`].
        Add,
    }

    /// The tensors an operation differentiates, in its order: one to six (a backend
    /// extension carries tensors in fields, not in a list).
    #[derive(ExtensionType)]
    pub(crate) enum Floats<B: Backend> {
        One(FloatTensor<B>),
        Two(FloatTensor<B>, FloatTensor<B>),
        Three(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>),
        Four(
            FloatTensor<B>,
            FloatTensor<B>,
            FloatTensor<B>,
            FloatTensor<B>,
        ),
        Five(
            FloatTensor<B>,
            FloatTensor<B>,
            FloatTensor<B>,
            FloatTensor<B>,
            FloatTensor<B>,
        ),
        Six(
            FloatTensor<B>,
            FloatTensor<B>,
            FloatTensor<B>,
            FloatTensor<B>,
            FloatTensor<B>,
            FloatTensor<B>,
        ),
    }

    impl<B: Backend> Floats<B> {
        /// # Panics
        /// Unless there are one to six tensors.
        fn new(floats: Vec<FloatTensor<B>>) -> Self {
            let n = floats.len();
            let mut it = floats.into_iter();
            let mut next = || it.next().expect("counted");
            match n {
                1 => Floats::One(next()),
                2 => Floats::Two(next(), next()),
                3 => Floats::Three(next(), next(), next()),
                4 => Floats::Four(next(), next(), next(), next()),
                5 => Floats::Five(next(), next(), next(), next(), next()),
                6 => Floats::Six(next(), next(), next(), next(), next(), next()),
                n => panic!("an operation of {n} inputs (1 to 6 are supported)"),
            }
        }

        fn into_vec(self) -> Vec<FloatTensor<B>> {
            match self {
                Floats::One(a) => vec![a],
                Floats::Two(a, b) => vec![a, b],
                Floats::Three(a, b, c) => vec![a, b, c],
                Floats::Four(a, b, c, d) => vec![a, b, c, d],
                Floats::Five(a, b, c, d, e) => vec![a, b, c, d, e],
                Floats::Six(a, b, c, d, e, f) => vec![a, b, c, d, e, f],
            }
        }
    }

    /// A boolean tensor an operation reads but does not differentiate, if it has one.
    #[derive(ExtensionType)]
    pub(crate) enum Mask<B: Backend> {
        None,
        Bool(BoolTensor<B>),
    }

    impl<B: Backend> Mask<B> {
        /// The tensor (under autodiff, boolean tensors are the inner backend's).
        fn into_option(self) -> Option<BoolTensor<B>> {
            match self {
                Mask::None => None,
                Mask::Bool(mask) => Some(mask),
            }
        }
    }

    /// Every operation of ours as one operation of the backend, differentiable on
    /// `Autodiff<Flex | NdArray>`.
    #[backend_extension(
        Flex: cfg(feature = "flex"),
        NdArray: cfg(feature = "ndarray"),
        Autodiff
    )]
    pub(crate) trait Fused: Backend {
        /// `op` over `floats` (the tensors it differentiates, in its order) and `mask` (a
        /// boolean tensor it reads but does not differentiate).
        fn fused(
            op: FusedOp,
            #[extension_type] floats: Floats<Self>,
            #[extension_type] mask: Mask<Self>,
        ) -> FloatTensor<Self>;
    }

    /// What runs an operation once [`FusedOp::run`] has built it: its forward pass alone
    /// ([`Plain`]), or one autodiff node ([`Tracked`]).
    trait Runner<B: Backend> {
        type Output;
        fn run<O: op::Op<B>>(self, op: O) -> Self::Output;
    }

    /// The inputs of an operation on a backend without autodiff.
    struct Plain<B: Backend>(Vec<FloatTensor<B>>);

    impl<B: Backend> Runner<B> for Plain<B> {
        type Output = FloatTensor<B>;
        fn run<O: op::Op<B>>(self, op: O) -> FloatTensor<B> {
            op::forward::<B, O>(op, self.0)
        }
    }

    /// The inputs of an operation under autodiff.
    struct Tracked<B: Backend, C: CheckpointStrategy>(Vec<FloatTensor<Autodiff<B, C>>>);

    impl<B: Backend, C: CheckpointStrategy> Runner<B> for Tracked<B, C> {
        type Output = FloatTensor<Autodiff<B, C>>;
        fn run<O: op::Op<B>>(self, op: O) -> Self::Output {
            op::autodiff::<B, C, O>(op, self.0)
        }
    }

    impl FusedOp {
        /// Builds the operation (its `mask` read by attention alone) and hands it to
        /// `runner`: the one place that maps each `FusedOp` to its [`op::Op`].
        fn run<B: CpuTensors, R: Runner<B>>(
            self,
            mask: Option<BoolTensor<B>>,
            runner: R,
        ) -> R::Output {
            match self {
                FusedOp::Attention(spec) => runner.run(attention::AttentionOp::<B> { spec, mask }),
                FusedOp::Linear => runner.run(linear::LinearOp),
                FusedOp::LinearGelu => runner.run(linear::LinearGeluOp),
                FusedOp::LayerNorm { epsilon, center } => {
                    runner.run(norm::LayerNormOp { epsilon, center })
                }
                FusedOp::Gelu => runner.run(gelu::GeluOp),
                FusedOp::SwiGlu => runner.run(swiglu::SwiGluOp),
                FusedOp::CrossEntropy { targets } => runner.run(loss::CrossEntropyOp { targets }),
                FusedOp::AdamW(step) => runner.run(adamw::AdamWOp(step)),
                FusedOp::SquareSum => runner.run(squares::SquareSumOp),
                FusedOp::Add => runner.run(add::AddOp),
            }
        }
    }

    impl<B: CpuTensors> Fused for B {
        fn fused(op: FusedOp, floats: Floats<B>, mask: Mask<B>) -> FloatTensor<B> {
            op.run::<B, _>(mask.into_option(), Plain(floats.into_vec()))
        }
    }

    /// Under autodiff, each operation is one node whose backward pass is its own.
    impl<B: CpuTensors, C: CheckpointStrategy> Fused for Autodiff<B, C> {
        fn fused(op: FusedOp, floats: Floats<Self>, mask: Mask<Self>) -> FloatTensor<Self> {
            op.run::<B, _>(mask.into_option(), Tracked::<B, C>(floats.into_vec()))
        }
    }

    /// `op` over `floats` and `mask` through [`Fused`], on whatever device they are.
    pub(crate) fn run(
        op: FusedOp,
        floats: Vec<Tensor<4>>,
        mask: Option<Tensor<4, Bool>>,
    ) -> Tensor<4> {
        let floats = Floats::new(floats.into_iter().map(Tensor::into_dispatch).collect());
        let mask = match mask {
            Some(mask) => Mask::Bool(mask.into_dispatch()),
            None => Mask::None,
        };
        Tensor::from_dispatch(<Dispatch as Fused>::fused(op, floats, mask))
    }
}

/// Panics unless every one of `params` is `input`'s dtype, naming `layer` and both: a
/// module and its input in two dtypes are the caller's mistake, named here rather than
/// deep inside a backend.
pub(crate) fn check_dtypes(
    layer: &str,
    input: burn::tensor::DType,
    params: impl IntoIterator<Item = burn::tensor::DType>,
) {
    for dtype in params {
        assert!(
            dtype == input,
            "{layer}: the input is {input:?} and the layer's parameters {dtype:?}; cast the \
             input, or the module (`ModuleDType::to_dtype`), to one dtype"
        );
    }
}

/// `x` `[.., cols]` as the `[1, 1, rows, cols]` the row operations take.
#[cfg(feature = "cpu-kernels")]
fn rows<const D: usize>(x: Tensor<D>) -> Tensor<4> {
    let dims = x.dims();
    let cols = dims[D - 1];
    let rows = dims.iter().product::<usize>() / cols.max(1);
    x.reshape([1, 1, rows, cols])
}
