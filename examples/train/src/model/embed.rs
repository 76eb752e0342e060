//! The model's input: token embeddings, and the absolute positions added to them
//! (learned or sinusoidal; the other kinds of positions act inside attention).

use burn::module::Module;
use burn::nn::Embedding;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use mha::positions::sinusoids;

use super::PositionKind;

/// Token embeddings, and the absolute positions added to them (learned or sinusoidal).
#[derive(Module, Debug)]
pub struct Embed {
    /// One vector per token.
    pub(super) tokens: Embedding,
    /// The learned positions, for [`PositionKind::Learned`].
    pub(super) positions: Option<Embedding>,
    /// Which positions the model uses.
    #[module(skip)]
    pub(super) kind: PositionKind,
}

impl Embed {
    /// `[B, T]` -> `[B, T, d_model]`, token `t` of every row at position `t`.
    pub(super) fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        let [_, len] = ids.dims();
        let device = ids.device();
        let tokens = self.tokens.forward(ids);
        let d_model = tokens.dims()[2];
        match (&self.positions, self.kind) {
            (Some(learned), _) => {
                let at = Tensor::<1, Int>::arange(0..len as i64, &device).reshape([1, len]);
                tokens + learned.forward(at) // [B, T, D] + [1, T, D]
            }
            (None, PositionKind::Sinusoidal) => {
                let dtype = FloatDType::from(tokens.dtype());
                tokens
                    + sinusoids(0, len, d_model, &device)
                        .cast(dtype)
                        .unsqueeze::<3>()
            }
            (None, _) => tokens,
        }
    }

    /// `[B, T]` -> `[B, T, d_model]`, token `t` of row `b` at position `at[b][t]`.
    pub(super) fn forward_at(&self, ids: Tensor<2, Int>, at: &[Vec<usize>]) -> Tensor<3> {
        let [batch, len] = ids.dims();
        let device = ids.device();
        let tokens = self.tokens.forward(ids);
        let d_model = tokens.dims()[2];
        // Positions from `first`: the sinusoids' rows are made for the positions asked for
        // only (not from 0, which grew with every decoded token).
        let first = match self.kind {
            PositionKind::Sinusoidal => at.iter().flatten().min().copied().unwrap_or(0),
            _ => 0,
        };
        let flat: Vec<i64> = at.iter().flatten().map(|&p| (p - first) as i64).collect();
        let index = |shape: [usize; 2]| {
            Tensor::<2, Int>::from_data(TensorData::new(flat.clone(), shape), &device)
        };
        match (&self.positions, self.kind) {
            (Some(learned), _) => tokens + learned.forward(index([batch, len])),
            (None, PositionKind::Sinusoidal) => {
                let end = at.iter().flatten().max().map_or(first, |&p| p + 1);
                let dtype = FloatDType::from(tokens.dtype());
                let table = sinusoids(first, end - first, d_model, &device).cast(dtype);
                let rows = table.select(0, index([1, batch * len]).reshape([batch * len]));
                tokens + rows.reshape([batch, len, d_model])
            }
            (None, _) => tokens,
        }
    }
}
