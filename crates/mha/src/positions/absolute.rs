//! Absolute positions added to the input embeddings: the fixed sinusoids of "Attention Is
//! All You Need", or a learned embedding per position.

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig};
use burn::tensor::{Device, Int, Tensor, TensorData};

/// The sinusoidal encodings of positions `offset..offset + len`, `[len, d_model]`:
/// `sin(p / 10000^(2i / d))` at feature `2i`, `cos` of the same at `2i + 1`.
pub fn sinusoids(offset: usize, len: usize, d_model: usize, device: &Device) -> Tensor<2> {
    let mut values = Vec::with_capacity(len * d_model);
    for p in offset..offset + len {
        for i in 0..d_model {
            let angle = p as f64 / 10_000f64.powf((i / 2 * 2) as f64 / d_model as f64);
            values.push(match i % 2 {
                0 => angle.sin() as f32,
                _ => angle.cos() as f32,
            });
        }
    }
    Tensor::from_data(TensorData::new(values, [len, d_model]), device)
}

/// Absolute positions added to `[B, T, d_model]` inputs.
#[derive(Module, Debug)]
pub enum AbsolutePositions {
    /// The fixed sinusoids of any position.
    Sinusoidal(SinusoidalPositions),
    /// A learned embedding of each position up to a maximum length.
    Learned(LearnedPositions),
}

/// Sinusoidal positions of `d_model` features (no parameters).
#[derive(Module, Debug)]
pub struct SinusoidalPositions {
    /// The model width.
    pub d_model: usize,
}

/// A learned embedding of positions `0..max_len`.
#[derive(Module, Debug)]
pub struct LearnedPositions {
    /// `[max_len, d_model]`.
    pub embedding: Embedding,
}

impl AbsolutePositions {
    /// Sinusoids of `d_model` features.
    pub fn sinusoidal(d_model: usize) -> Self {
        Self::Sinusoidal(SinusoidalPositions { d_model })
    }

    /// A learned embedding of `max_len` positions of `d_model` features, initialised as
    /// Burn's `Embedding` (normal).
    pub fn learned(max_len: usize, d_model: usize, device: &Device) -> Self {
        Self::Learned(LearnedPositions {
            embedding: EmbeddingConfig::new(max_len, d_model).init(device),
        })
    }

    /// The positions with an embedding of a learned table; `None` for sinusoids (any).
    pub fn max_len(&self) -> Option<usize> {
        match self {
            AbsolutePositions::Sinusoidal(_) => None,
            AbsolutePositions::Learned(l) => Some(l.embedding.weight.dims()[0]),
        }
    }

    /// `x` with the positions of its rows added: row `t` stands at `offset + t`. The sum
    /// is in `x`'s dtype, whatever the learned table's (it is cast to `x`'s).
    ///
    /// # Shapes
    /// `[B, T, d_model]` -> `[B, T, d_model]`.
    ///
    /// # Panics
    /// If `x` is not as wide as the positions, or for learned positions past the table,
    /// naming the table's length and the positions.
    pub fn add(&self, x: Tensor<3>, offset: usize) -> Tensor<3> {
        let [_, len, d_model] = x.dims();
        let device = x.device();
        if len == 0 {
            // No position (Burn's reshapes read a 0 as "keep this axis").
            return x;
        }
        self.check(d_model, offset..offset + len);
        let positions = match self {
            AbsolutePositions::Sinusoidal(_) => {
                sinusoids(offset, len, d_model, &device).cast(x.dtype())
            }
            AbsolutePositions::Learned(l) => {
                let ids = Tensor::<1, Int>::arange(offset as i64..(offset + len) as i64, &device);
                l.embedding
                    .forward(ids.reshape([1, len]))
                    .squeeze_dim::<2>(0)
                    .cast(x.dtype())
            }
        };
        x + positions.unsqueeze::<3>() // [B, T, D] + [1, T, D]
    }

    /// `x` with the positions of its rows added, row `t` of batch row `b` at
    /// `offset + t - pads[b]` (0 for the padding before it): batch rows that begin with
    /// `pads[b]` padding tokens, each counting from its first real token.
    ///
    /// # Shapes
    /// `[B, T, d_model]` -> `[B, T, d_model]`, `pads` of `B`.
    ///
    /// # Panics
    /// As [`add`](Self::add), naming the positions of the row with the least padding.
    pub fn add_padded(&self, x: Tensor<3>, offset: usize, pads: &[usize]) -> Tensor<3> {
        let [batch, len, d_model] = x.dims();
        assert_eq!(
            pads.len(),
            batch,
            "AbsolutePositions::add_padded: {} pads for a batch of {batch} rows",
            pads.len()
        );
        let least = pads.iter().copied().min().unwrap_or(0);
        if len == 0 || batch == 0 {
            return x;
        }
        if pads.iter().all(|&pad| pad == least) && offset >= least {
            return self.add(x, offset - least);
        }
        let device = x.device();
        let ids: Vec<i64> = pads
            .iter()
            .flat_map(|&pad| (offset..offset + len).map(move |p| p.saturating_sub(pad) as i64))
            .collect();
        let end = (offset + len).saturating_sub(least);
        self.check(d_model, offset.saturating_sub(least)..end);
        let table = match self {
            // At least position 0, which rows of padding alone read.
            AbsolutePositions::Sinusoidal(_) => {
                sinusoids(0, end.max(1), d_model, &device).cast(x.dtype())
            }
            AbsolutePositions::Learned(l) => {
                crate::dtype::float_value(l.embedding.weight.val()).cast(x.dtype())
            }
        };
        let ids = Tensor::<1, Int>::from_data(TensorData::new(ids, [batch * len]), &device);
        x + table.select(0, ids).reshape([batch, len, d_model])
    }

    /// Checks that the positions are `d_model` wide and, learned, cover `positions`.
    ///
    /// # Panics
    /// Naming the widths, or the positions and the table's length.
    fn check(&self, d_model: usize, positions: std::ops::Range<usize>) {
        match self {
            AbsolutePositions::Sinusoidal(s) => assert_eq!(
                s.d_model, d_model,
                "SinusoidalPositions: the input is {d_model} wide, not {}",
                s.d_model
            ),
            AbsolutePositions::Learned(l) => {
                let [max_len, width] = l.embedding.weight.dims();
                assert_eq!(
                    width, d_model,
                    "LearnedPositions: the input is {d_model} wide, not {width}"
                );
                assert!(
                    positions.end <= max_len,
                    "LearnedPositions: positions {}..{} are past the {max_len} learned ones",
                    positions.start,
                    positions.end
                );
            }
        }
    }
}
