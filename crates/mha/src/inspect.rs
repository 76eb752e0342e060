//! What a forward can be asked beyond its output: a weight per head multiplying what the
//! head contributes ([`HeadMask`]), and the attention weights of every attention layer
//! ([`Inspect`]). The modules read both; `crate::analysis` builds on them.
//!
//! A module's *attention layers* are its attentions in order: one for
//! [`MultiHeadAttention`](crate::MultiHeadAttention) and
//! [`EncoderBlock`](crate::EncoderBlock), two for [`DecoderBlock`](crate::DecoderBlock)
//! (self-attention, then cross-attention), and those of each block in turn for the stacks.
//! A head mask has one row per attention layer, the weights have one tensor per attention
//! layer, both in that order.

use burn::tensor::Gradients;
use burn::tensor::{Device, Tensor, TensorData};

/// One weight per attention layer and head, multiplying the head's output before the
/// heads are merged and projected out: 1 keeps the head, 0 drops it, anything else scales
/// it. Masking a head changes nothing else (the weights a forward returns are those of
/// the softmax, before the mask), so a masked module equals one whose dropped heads are
/// removed (see [`Heads::prune`](crate::analysis::Heads::prune)).
///
/// With [`with_gradient`](Self::with_gradient), the loss's gradient with respect to each
/// weight is the head's importance score of Michel et al. (2019): see
/// [`HeadImportance::by_gradient`](crate::analysis::HeadImportance::by_gradient).
#[derive(Clone, Debug)]
pub struct HeadMask {
    layers: Vec<Tensor<1>>,
}

impl HeadMask {
    /// A mask from one `[H_l]` weight tensor per attention layer.
    pub fn new(layers: Vec<Tensor<1>>) -> Self {
        Self { layers }
    }

    /// Every head kept (all ones), for attention layers of `counts[l]` heads.
    pub fn keep_all(counts: &[usize], device: &Device) -> Self {
        Self::from_rows(counts.iter().map(|&h| vec![1.0; h]).collect(), device)
    }

    /// Every head kept but the `(layer, head)` pairs of `dropped`, which get 0.
    ///
    /// # Panics
    /// If a pair names a layer or a head the counts do not have.
    pub fn dropping(counts: &[usize], dropped: &[(usize, usize)], device: &Device) -> Self {
        let mut rows: Vec<Vec<f32>> = counts.iter().map(|&h| vec![1.0; h]).collect();
        for &(layer, head) in dropped {
            assert!(
                layer < counts.len() && head < counts[layer],
                "HeadMask::dropping: (layer {layer}, head {head}) is outside attention layers \
                 with {counts:?} heads"
            );
            rows[layer][head] = 0.0;
        }
        Self::from_rows(rows, device)
    }

    /// A mask from one row of weights per attention layer.
    pub fn from_rows(rows: Vec<Vec<f32>>, device: &Device) -> Self {
        let layers = rows
            .into_iter()
            .map(|row| {
                let len = row.len();
                Tensor::from_data(TensorData::new(row, [len]), device)
            })
            .collect();
        Self { layers }
    }

    /// The same mask, its weights tracked by autodiff so that
    /// [`grads`](Self::grads) can read the loss's gradient with respect to them (on an
    /// autodiff device).
    pub fn with_gradient(self) -> Self {
        Self {
            layers: self.layers.into_iter().map(|t| t.require_grad()).collect(),
        }
    }

    /// The number of attention layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether the mask has no attention layer.
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }

    /// The heads of each attention layer.
    pub fn counts(&self) -> Vec<usize> {
        self.layers.iter().map(|t| t.dims()[0]).collect()
    }

    /// The weights of attention layer `layer`, `[H]`.
    ///
    /// # Panics
    /// If there is no such layer.
    pub fn layer(&self, layer: usize) -> &Tensor<1> {
        &self.layers[layer]
    }

    /// The weights, one `[H_l]` tensor per attention layer.
    pub fn layers(&self) -> &[Tensor<1>] {
        &self.layers
    }

    /// Attention layers `start..start + len` as a mask of their own: the part of a model's
    /// mask that one of its stacks takes.
    ///
    /// # Panics
    /// If the range passes the last layer.
    pub fn slice(&self, start: usize, len: usize) -> HeadMask {
        assert!(
            start + len <= self.layers.len(),
            "HeadMask::slice: layers {start}..{} of a mask of {} attention layers",
            start + len,
            self.layers.len()
        );
        Self {
            layers: self.layers[start..start + len].to_vec(),
        }
    }

    /// The weights as rows of numbers, one per attention layer.
    pub fn to_rows(&self) -> Vec<Vec<f32>> {
        self.layers.iter().map(|t| values(t.clone())).collect()
    }

    /// The gradient of the loss with respect to each weight, one row per attention layer,
    /// from the gradients of a backward pass over a forward that used this mask (made
    /// [`with_gradient`](Self::with_gradient)). A layer the loss did not reach gets zeros.
    pub fn grads(&self, grads: &Gradients) -> Vec<Vec<f32>> {
        self.layers
            .iter()
            .map(|t| match t.grad(grads) {
                Some(g) => values(g),
                None => vec![0.0; t.dims()[0]],
            })
            .collect()
    }

    /// Checks that the mask has `counts[l]` heads in attention layer `l`.
    ///
    /// # Panics
    /// Naming the module and both shapes when they differ.
    pub(crate) fn check(&self, module: &str, counts: &[usize]) {
        let own = self.counts();
        assert!(
            own == counts,
            "{module}: the head mask has {own:?} heads per attention layer, the module {counts:?}"
        );
    }
}

fn values(t: Tensor<1>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .try_into_vec::<f32>()
        .expect("a float tensor converts to f32")
}

/// What a block's or a stack's forward does beyond its output (see
/// [`BlockInput::inspect`](crate::block::BlockInput::inspect)).
#[derive(Clone, Debug, Default)]
pub struct Inspect {
    /// A weight per attention layer and head (see [`HeadMask`]); `None` keeps every head.
    pub head_mask: Option<HeadMask>,
    /// Whether to return every attention layer's weights `[B, H, Tq, Tk]`.
    pub weights: bool,
}

impl Inspect {
    /// Nothing beyond the output: the plain forward.
    pub fn new() -> Self {
        Self::default()
    }

    /// Multiplies each head's output by its weight in `mask`.
    pub fn head_mask(mut self, mask: HeadMask) -> Self {
        self.head_mask = Some(mask);
        self
    }

    /// Returns the attention weights of every attention layer.
    pub fn weights(mut self) -> Self {
        self.weights = true;
        self
    }

    /// The part of this request for attention layers `start..start + len`: what one
    /// stack of a model takes.
    ///
    /// # Panics
    /// If the head mask has fewer layers.
    pub fn slice(&self, start: usize, len: usize) -> Inspect {
        Inspect {
            head_mask: self.head_mask.as_ref().map(|m| m.slice(start, len)),
            weights: self.weights,
        }
    }
}
