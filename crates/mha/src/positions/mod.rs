//! Where tokens are. Attention itself is blind to order; a model tells it positions in
//! one of three ways, all chosen by one [`Positions`] setting:
//!
//! - absolute positions added to the input embeddings ([`absolute`]: sinusoids, or a
//!   learned embedding per position), which a stack adds before its first block;
//! - rotary embeddings of the queries and keys ([`rotary`]: RoPE), which attention applies
//!   after its projections;
//! - a bias on the scores by distance ([`bias`]: ALiBi, learned relative biases with
//!   clipped offsets or T5's buckets), which the CPU tiles compute per score.
//!
//! Positions apply to self-attention; cross-attention reads the memory as it is, and a
//! [`MultiHeadAttention`](crate::MultiHeadAttention) with positions refuses to attend to
//! another sequence rather than ignore them (see
//! [`MultiHeadAttentionConfig::positions`](crate::MultiHeadAttentionConfig::positions)).

pub mod absolute;
pub mod bias;
pub mod rotary;

use serde::{Deserialize, Serialize};

pub use absolute::{AbsolutePositions, LearnedPositions, SinusoidalPositions, sinusoids};
pub use bias::{Buckets, PositionBias, alibi_slopes};
pub use rotary::{Rope, RopeLayout};

use crate::error::{Check, ConfigError};

/// How a model knows where its tokens are (see the [module docs](self)).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub enum Positions {
    /// None: attention sees a set, not a sequence (unless the model adds positions itself).
    #[default]
    None,
    /// Sinusoids added to the input (by a stack).
    Sinusoidal,
    /// A learned embedding of each position added to the input (by a stack).
    Learned {
        /// Positions with an embedding.
        max_len: usize,
    },
    /// Rotary embeddings of the queries and keys.
    Rope {
        /// The base of the frequencies (10000 in the paper).
        theta: f64,
        /// Which features rotate together.
        layout: RopeLayout,
    },
    /// ALiBi: `-slope_h · |key - query|`, no parameters, the slopes of
    /// [`alibi_slopes`].
    ///
    /// Symmetric: keys after the query are penalised as those before it. The paper (a
    /// causal language model) biases by `-slope_h · (query - key)` and BLOOM by
    /// `slope_h · key` (a shift per query row, which the softmax cancels); under a causal
    /// mask, where every key is at or before the query, all three give the same weights.
    /// Without one they differ: the paper's and BLOOM's would favour the keys farthest
    /// after the query, mha's ALiBi penalises distance both ways.
    Alibi,
    /// A learned bias per head and distance `key - query`, distances beyond
    /// `max_distance` clipped (Shaw et al.): the table is
    /// [`MultiHeadAttention::position_table`](crate::MultiHeadAttention::position_table)
    /// `[H, 2·max_distance + 1]`, column `clamp(key - query) + max_distance`. Code that
    /// indexes by `query - key` has the table flipped (see [`Buckets`]).
    Relative {
        /// The largest distance with a bias of its own.
        max_distance: usize,
    },
    /// T5's learned bias per head and log-spaced bucket of the distance `key - query`,
    /// bucketed as `transformers`' `T5Attention._relative_position_bucket` does. The table
    /// is [`MultiHeadAttention::position_table`](crate::MultiHeadAttention::position_table)
    /// `[H, num_buckets]`; Hugging Face's `relative_attention_bias.weight` is its transpose
    /// `[num_buckets, H]`, which [`LoadPyTorch`](crate::LoadPyTorch) transposes. T5's
    /// attention does not scale its scores: configure `with_scale(Some(1.0))` (see
    /// [`crate::pytorch`]).
    T5 {
        /// Buckets in all (T5: 32).
        num_buckets: usize,
        /// The distance from which all share the last bucket (T5: 128).
        max_distance: usize,
        /// Keys after the query get buckets of their own (T5's encoder; its decoder is
        /// causal and has none): Hugging Face's `not config.is_decoder`.
        bidirectional: bool,
    },
}

impl Positions {
    /// RoPE with the paper's base (10000), features paired half with half.
    pub fn rope() -> Self {
        Positions::Rope {
            theta: 10_000.0,
            layout: RopeLayout::HalfSplit,
        }
    }

    /// T5's buckets: 32 of them, up to distance 128.
    pub fn t5(bidirectional: bool) -> Self {
        Positions::T5 {
            num_buckets: 32,
            max_distance: 128,
            bidirectional,
        }
    }

    /// Whether they are added to the input rather than applied by attention.
    pub fn is_absolute(&self) -> bool {
        matches!(self, Positions::Sinusoidal | Positions::Learned { .. })
    }

    /// The buckets of a learned relative bias, if these are one.
    pub fn buckets(&self) -> Option<Buckets> {
        match *self {
            Positions::Relative { max_distance } => Some(Buckets::Clipped { max: max_distance }),
            Positions::T5 {
                num_buckets,
                max_distance,
                bidirectional,
            } => Some(Buckets::T5 {
                num_buckets,
                max_distance,
                bidirectional,
            }),
            _ => None,
        }
    }

    /// Checks the values for heads `head_dim` wide.
    ///
    /// # Errors
    /// A [`ConfigError`] of `config`'s `positions` field naming the value.
    pub(crate) fn validate(
        &self,
        config: &'static str,
        head_dim: usize,
    ) -> Result<(), ConfigError> {
        let check = Check(config);
        let fail = |message: String| ConfigError {
            config,
            field: "positions",
            message,
        };
        match *self {
            Positions::Learned { max_len } => check.nonzero("positions", max_len),
            Positions::Rope { theta, .. } => {
                if !head_dim.is_multiple_of(2) {
                    return Err(fail(format!(
                        "Rope needs heads of an even width, got {head_dim}"
                    )));
                }
                if !(theta.is_finite() && theta > 1.0) {
                    return Err(fail(format!("Rope's theta must be above 1, got {theta}")));
                }
                Ok(())
            }
            Positions::T5 { .. } | Positions::Relative { .. } => {
                match self.buckets().and_then(|b| b.problem()) {
                    Some(problem) => Err(fail(problem)),
                    None => Ok(()),
                }
            }
            _ => Ok(()),
        }
    }
}
