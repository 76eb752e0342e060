//! The pattern every operation of our own follows, written once: a forward pass on a
//! backend whose kernels run it, what its backward pass keeps, and the backward pass
//! ([`Op`]); run as it is on that backend ([`forward`]), or under autodiff as one node of
//! the graph whose backward pass is the operation's own ([`autodiff`]).
//!
//! Differentiated op by op, Burn would record every elementwise step of an operation and
//! keep what each needs; an [`Op`] is one step that keeps only [`Op::Saved`]. Which
//! operations there are, and the one backend extension that carries them to the backend,
//! are in `ops`; each operation's file there holds only what is its own.

use core::fmt;
use core::marker::PhantomData;

use burn::backend::Backend;
use burn::backend::autodiff::{
    Autodiff,
    checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
    grads::Gradients,
    ops::{Backward, NodeGuard, Ops, OpsKind},
};
use burn::backend::tensor::FloatTensor;

/// An operation with a backward pass of its own, on a backend `B` whose kernels run it.
pub(crate) trait Op<B: Backend>: Sized + 'static {
    /// What the backward pass keeps of the forward pass.
    type Saved: Clone + Send + fmt::Debug + 'static;

    /// The output of `inputs` (the tensors the operation differentiates, in its order)
    /// and what its backward pass keeps (where nothing is tracked, [`output`](Self::output)
    /// runs instead).
    fn forward(self, inputs: Vec<FloatTensor<B>>) -> (FloatTensor<B>, Self::Saved);

    /// The output alone, where no backward pass will run (no input is tracked): an
    /// operation whose [`forward`](Self::forward) computes for its backward pass what the
    /// output does not need skips it here.
    fn output(self, inputs: Vec<FloatTensor<B>>) -> FloatTensor<B> {
        self.forward(inputs).0
    }

    /// The gradients of the inputs, in their order, from the output's gradient `grad`;
    /// `None` where `wanted` is false (an input that wants none).
    fn backward(
        saved: Self::Saved,
        grad: FloatTensor<B>,
        wanted: &[bool],
    ) -> Vec<Option<FloatTensor<B>>>;
}

/// `op` over `inputs` on a backend without autodiff.
#[cfg(feature = "cpu-kernels")]
pub(crate) fn forward<B: Backend, O: Op<B>>(op: O, inputs: Vec<FloatTensor<B>>) -> FloatTensor<B> {
    op.output(inputs)
}

/// `op` over `inputs` under autodiff: one node of the graph, whose backward pass is
/// [`Op::backward`] from what [`Op::forward`] saved, when an input is tracked.
///
/// # Panics
/// If the operation has no input or more than six.
pub(crate) fn autodiff<B: Backend, C: CheckpointStrategy, O: Op<B>>(
    op: O,
    inputs: Vec<FloatTensor<Autodiff<B, C>>>,
) -> FloatTensor<Autodiff<B, C>> {
    // The nodes before the primitives, as `Backward::prepare` asks.
    let nodes: Vec<NodeGuard> = inputs.iter().map(|t| t.node()).collect();
    let inputs = inputs.into_iter().map(|t| t.into_primitive()).collect();
    // Burn's nodes count their parents in a constant.
    match nodes.len() {
        1 => node::<B, C, O, 1>(op, nodes, inputs),
        2 => node::<B, C, O, 2>(op, nodes, inputs),
        3 => node::<B, C, O, 3>(op, nodes, inputs),
        4 => node::<B, C, O, 4>(op, nodes, inputs),
        5 => node::<B, C, O, 5>(op, nodes, inputs),
        6 => node::<B, C, O, 6>(op, nodes, inputs),
        n => panic!("an operation of {n} inputs (1 to 6 are supported)"),
    }
}

/// [`autodiff`] over `N` inputs.
fn node<B: Backend, C: CheckpointStrategy, O: Op<B>, const N: usize>(
    op: O,
    nodes: Vec<NodeGuard>,
    inputs: Vec<FloatTensor<B>>,
) -> FloatTensor<Autodiff<B, C>> {
    let nodes: [NodeGuard; N] = nodes.try_into().unwrap_or_else(|_| unreachable!("N nodes"));
    match Node::<O>(PhantomData)
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (output, saved) = op.forward(inputs);
            prep.finish(saved, output)
        }
        OpsKind::UnTracked(prep) => prep.finish(op.output(inputs)),
    }
}

/// The backward step of an `O` in the autodiff graph.
struct Node<O>(PhantomData<fn() -> O>);

impl<O> fmt::Debug for Node<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Node<{}>", core::any::type_name::<O>())
    }
}

impl<B: Backend, O: Op<B>, const N: usize> Backward<B, N> for Node<O> {
    type State = O::Saved;

    fn backward(
        self,
        ops: Ops<Self::State, N>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let grad = grads.consume::<B>(&ops.node);
        let wanted = ops.parents.each_ref().map(Option::is_some);
        if !wanted.contains(&true) {
            return;
        }
        let out = O::backward(ops.state, grad, &wanted);
        for (parent, grad) in ops.parents.into_iter().zip(out) {
            if let (Some(node), Some(grad)) = (parent, grad) {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// The `N` inputs of an operation that takes exactly `N`.
///
/// # Panics
/// If there are not `N` (a call that does not match its operation).
#[cfg(feature = "cpu-kernels")]
pub(crate) fn inputs<T, const N: usize>(inputs: Vec<T>) -> [T; N] {
    let n = inputs.len();
    inputs
        .try_into()
        .unwrap_or_else(|_| panic!("an operation of {N} inputs was given {n}"))
}
