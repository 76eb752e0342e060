//! Looking inside: what each head does ([`HeadReport`]), switching heads off without
//! touching the weights ([`HeadMask`]), which heads matter ([`HeadImportance`]), removing
//! heads ([`Heads::prune`]), and, with the `plot` feature, pictures of the weights
//! ([`maps`]).
//!
//! The analysis sits above the modules it looks into, which never import it: the head
//! mask and the request for weights they take are `crate::inspect`'s, re-exported here.

pub mod importance;
#[cfg(feature = "plot")]
pub mod maps;
pub mod prune;
pub mod stats;

pub use crate::inspect::{HeadMask, Inspect};
pub use crate::mha::PrunedFrom;
pub use importance::{HeadImportance, ImportanceMethod};
pub use prune::{Heads, PrunePlan};
pub use stats::{HeadReport, HeadStats, LayerStats, LayerStatsBuilder, Link};
