//! Errors a user can cause: through a configuration, a decode cache, a pruning plan, a
//! dtype, or a conversion of Burn's modules.

use core::fmt;

/// A configuration value was rejected by `try_init`.
///
/// The message names the configuration, the field and the values, e.g.
/// `MultiHeadAttentionConfig.d_model: 100 is not divisible by n_heads = 3`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    /// The configuration type, e.g. `MultiHeadAttentionConfig`.
    pub config: &'static str,
    /// The offending field.
    pub field: &'static str,
    /// What is wrong, with the values.
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}: {}", self.config, self.field, self.message)
    }
}

impl std::error::Error for ConfigError {}

/// Checks shared by the configurations; each returns the error naming `config.field`.
pub(crate) struct Check(pub &'static str);

impl Check {
    fn err(&self, field: &'static str, message: String) -> ConfigError {
        ConfigError {
            config: self.0,
            field,
            message,
        }
    }

    /// `value > 0`.
    pub fn nonzero(&self, field: &'static str, value: usize) -> Result<(), ConfigError> {
        if value == 0 {
            return Err(self.err(field, "must be at least 1, got 0".into()));
        }
        Ok(())
    }

    /// `value % by == 0`.
    pub fn divisible(
        &self,
        field: &'static str,
        value: usize,
        by_name: &str,
        by: usize,
    ) -> Result<(), ConfigError> {
        if by != 0 && !value.is_multiple_of(by) {
            return Err(self.err(
                field,
                format!("{value} is not divisible by {by_name} = {by}"),
            ));
        }
        Ok(())
    }

    /// A probability in `[0, 1)`.
    pub fn probability(&self, field: &'static str, value: f64) -> Result<(), ConfigError> {
        if !(0.0..1.0).contains(&value) {
            return Err(self.err(field, format!("must be in [0, 1), got {value}")));
        }
        Ok(())
    }

    /// A finite value of 0 or more.
    pub fn non_negative(&self, field: &'static str, value: f64) -> Result<(), ConfigError> {
        if !(value.is_finite() && value >= 0.0) {
            return Err(self.err(field, format!("must be 0 or more and finite, got {value}")));
        }
        Ok(())
    }

    /// A finite value above 0.
    pub fn positive(&self, field: &'static str, value: f64) -> Result<(), ConfigError> {
        if !(value.is_finite() && value > 0.0) {
            return Err(self.err(field, format!("must be positive and finite, got {value}")));
        }
        Ok(())
    }

    /// `value > 0` and finite, in f32 too (what the kernels compute with).
    pub fn positive_f32(&self, field: &'static str, value: f64) -> Result<(), ConfigError> {
        self.positive(field, value)?;
        let narrow = value as f32;
        if !(narrow.is_finite() && narrow > 0.0) {
            let message = format!("must be positive and finite in f32, got {value:?}");
            return Err(self.err(field, message));
        }
        Ok(())
    }

    /// The product of `factors` (a weight's element count, each factor named) is an
    /// allocation's worth: at most `isize::MAX` bytes of f64.
    pub fn fits(&self, field: &'static str, factors: &[(&str, u128)]) -> Result<(), ConfigError> {
        let most = isize::MAX as u128 / 8;
        let product = factors
            .iter()
            .try_fold(1u128, |product, (_, factor)| product.checked_mul(*factor));
        if product.is_some_and(|product| product <= most) {
            return Ok(());
        }
        let named: Vec<String> = factors
            .iter()
            .map(|(name, value)| format!("{name} = {value}"))
            .collect();
        let message = format!(
            "{} make a weight of more than the {most} elements a tensor can hold",
            named.join(" · ")
        );
        Err(self.err(field, message))
    }
}

/// A call with a [`KvCache`](crate::cache::KvCache) was refused; nothing was written to
/// the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheError {
    /// The new tokens do not fit in the cache's capacity.
    Full {
        /// Positions the cache holds.
        capacity: usize,
        /// The position of the first new token (the tokens cached so far).
        position: usize,
        /// New tokens in the call.
        tokens: usize,
    },
    /// The new keys or values differ in shape from those the cache holds.
    Mismatch {
        /// What differs: `batch`, `key/value heads` or `head width`.
        what: &'static str,
        /// What the cache holds.
        cached: usize,
        /// What the call brought.
        got: usize,
    },
    /// The new keys or values are of another dtype than those the cache holds (a module
    /// cast to another precision mid-sequence).
    DType {
        /// The dtype the cache holds.
        cached: burn::tensor::DType,
        /// The dtype the call brought.
        got: burn::tensor::DType,
    },
    /// The new keys or values are on another device than those the cache holds.
    Device {
        /// The device the cache holds them on.
        cached: String,
        /// The device of the call's.
        got: String,
    },
    /// The module attends to later tokens (bidirectional): decoding token by token would
    /// compute something else than its forward pass.
    NotCausal {
        /// The module, e.g. `EncoderBlock`.
        module: &'static str,
    },
    /// The mask packs several sequences in a row; a cache holds one sequence per row.
    Packed,
    /// Learned absolute positions end before the new tokens' positions.
    PastPositions {
        /// Positions with an embedding.
        max_len: usize,
        /// The position of the first new token.
        position: usize,
        /// New tokens in the call.
        tokens: usize,
    },
    /// The caches belong to a stack of another depth.
    Layers {
        /// The stack's layers.
        layers: usize,
        /// The caches given.
        caches: usize,
    },
    /// A decoder stack's cache holds no memory (the keys and values of the encoder's
    /// output) and the input brings none.
    NoMemory {
        /// The stack, e.g. `Decoder`.
        module: &'static str,
    },
    /// The caches of a stack's layers hold different numbers of positions (caches of
    /// different sequences, or of a call stopped part-way through the stack).
    Uneven {
        /// The positions the first layer's cache holds.
        first: usize,
        /// The first layer whose cache holds another number.
        layer: usize,
        /// The positions it holds.
        len: usize,
    },
    /// A block that attends to a sliding window was given a cache of another window
    /// (or none).
    Window {
        /// The block's window.
        window: usize,
        /// The cache's window, if it slides.
        cache: Option<usize>,
    },
    /// A batch row to keep ([`KvCache::select_rows`](crate::KvCache::select_rows)) is past
    /// the cached batch.
    Row {
        /// Its place in the rows given.
        at: usize,
        /// The row.
        row: usize,
        /// The cached batch.
        batch: usize,
    },
    /// A sliding cache cannot go back to `len` positions
    /// ([`KvCache::truncate`](crate::KvCache::truncate)): the window there needs
    /// positions it has written over.
    Truncate {
        /// The length asked for.
        len: usize,
        /// The positions cached.
        cached: usize,
        /// The shortest length it can go back to.
        earliest: usize,
    },
}

impl fmt::Display for CacheError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CacheError::Full {
                capacity,
                position,
                tokens,
            } => write!(
                f,
                "KvCache: {tokens} new token(s) at position {position} do not fit its capacity \
                 of {capacity} positions (positions {position}..{} asked for)",
                position + tokens
            ),
            CacheError::Mismatch { what, cached, got } => write!(
                f,
                "KvCache: it holds {what} {cached}, the call brings {what} {got} (reset it to \
                 start another sequence)"
            ),
            CacheError::DType { cached, got } => write!(
                f,
                "KvCache: it holds keys and values in {cached:?}, the call brings {got:?} \
                 (reset it to start another sequence)"
            ),
            CacheError::Device { cached, got } => write!(
                f,
                "KvCache: it holds keys and values on {cached}, the call brings them on {got} \
                 (reset it to start another sequence)"
            ),
            CacheError::NotCausal { module } => write!(
                f,
                "{module}: not causal; a cache decodes causal attention only (set causal)"
            ),
            CacheError::Packed => write!(
                f,
                "KvCache: the mask packs sequences; a cache holds one sequence per batch row"
            ),
            CacheError::PastPositions {
                max_len,
                position,
                tokens,
            } => write!(
                f,
                "LearnedPositions: positions {position}..{} are past the {max_len} learned ones",
                position + tokens
            ),
            CacheError::Layers { layers, caches } => write!(
                f,
                "StackCache: {caches} layer cache(s) for a stack of {layers} layers"
            ),
            CacheError::NoMemory { module } => write!(
                f,
                "{module}: neither the input nor its cache has the memory to attend to: make the \
                 cache with {module}::cache(memory, ..) or give the input a memory"
            ),
            CacheError::Uneven { first, layer, len } => write!(
                f,
                "StackCache: layer {layer}'s cache holds {len} positions and layer 0's \
                 {first} (caches of different sequences; reset it to start another sequence)"
            ),
            CacheError::Window { window, cache } => write!(
                f,
                "EncoderBlock: it attends to a sliding window of {window} tokens, and its cache \
                 {}: decode it with KvCache::sliding({window})",
                match cache {
                    Some(other) => format!("slides over {other}"),
                    None => "does not slide".into(),
                }
            ),
            CacheError::Row { at, row, batch } => write!(
                f,
                "KvCache: rows[{at}] = {row} is not a row of the cached batch of {batch}"
            ),
            CacheError::Truncate {
                len,
                cached,
                earliest,
            } => write!(
                f,
                "KvCache: a sliding cache of {cached} positions cannot go back to {len}: its \
                 window there needs positions written over since; it can go back to \
                 {earliest} at the earliest"
            ),
        }
    }
}

impl std::error::Error for CacheError {}

/// A [`PrunePlan`](crate::analysis::PrunePlan) did not fit the module it was applied to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PruneError {
    /// The plan has another number of attention layers than the module.
    Layers {
        /// The module, e.g. `Encoder`.
        module: &'static str,
        /// The module's attention layers.
        layers: usize,
        /// The plan's.
        plan: usize,
    },
    /// The plan names a head the layer does not have.
    Head {
        /// The attention layer.
        layer: usize,
        /// The head named.
        head: usize,
        /// The layer's heads.
        heads: usize,
    },
    /// The plan removes every head of a layer.
    Empty {
        /// The attention layer.
        layer: usize,
        /// Its heads.
        heads: usize,
    },
}

impl PruneError {
    /// The same error, its layer counted `offset` layers further: the layer's place in
    /// a stack rather than in its block, or in a model rather than in one of its stacks.
    pub fn at_layer(self, offset: usize) -> Self {
        match self {
            PruneError::Head { layer, head, heads } => PruneError::Head {
                layer: layer + offset,
                head,
                heads,
            },
            PruneError::Empty { layer, heads } => PruneError::Empty {
                layer: layer + offset,
                heads,
            },
            other => other,
        }
    }
}

impl fmt::Display for PruneError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PruneError::Layers {
                module,
                layers,
                plan,
            } => write!(
                f,
                "prune: the plan has {plan} attention layers, the {module} {layers}"
            ),
            PruneError::Head { layer, head, heads } => write!(
                f,
                "prune: attention layer {layer} has heads 0..{heads}, the plan removes head {head}"
            ),
            PruneError::Empty { layer, heads } => write!(
                f,
                "prune: the plan removes all {heads} heads of attention layer {layer}; keep at \
                 least one"
            ),
        }
    }
}

impl std::error::Error for PruneError {}

/// A module or a tensor was asked for a float dtype its device does not compute in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DTypeError {
    /// The dtype asked for.
    pub dtype: burn::tensor::DType,
    /// The device, as `Debug` prints it.
    pub device: String,
}

impl fmt::Display for DTypeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "dtype {}: the device {} does not compute in it (Device::supports_dtype is false; \
             ndarray has no f16 or bf16, a Vulkan device often no bf16 arithmetic)",
            self.dtype.name(),
            self.device
        )
    }
}

impl std::error::Error for DTypeError {}

/// A Burn module with a part this crate has no counterpart for, refused by its `TryFrom`
/// (Burn's transformer layers and stacks, see [`EncoderBlock`](crate::EncoderBlock)'s).
///
/// The message names the module, the part and what it is, e.g.
/// `TransformerEncoderLayer.pwff.activation: Burn's Tanh has no counterpart here (GELU, exact or tanh, and ReLU convert)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConversionError {
    /// The Burn module, e.g. `TransformerEncoderLayer`.
    pub module: &'static str,
    /// Its part, e.g. `pwff.activation`.
    pub field: &'static str,
    /// What it is, and what converts.
    pub message: String,
}

impl fmt::Display for ConversionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}: {}", self.module, self.field, self.message)
    }
}

impl std::error::Error for ConversionError {}
