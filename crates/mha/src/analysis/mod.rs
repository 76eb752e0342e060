//! Looking inside: what each head does ([`HeadReport`]), switching heads off without
//! touching the weights ([`HeadMask`]), which heads matter ([`HeadImportance`]), removing
//! heads ([`Heads::prune`]), and, with the `plot` feature, pictures of the weights
//! ([`maps`]).

pub mod importance;
pub mod inspect;
#[cfg(feature = "plot")]
pub mod maps;
pub mod prune;
pub mod stats;

pub use importance::{HeadImportance, ImportanceMethod};
pub use inspect::{HeadMask, Inspect, Inspected};
pub use prune::{Heads, PrunePlan, PrunedFrom};
pub use stats::{HeadReport, HeadStats, LayerStats, Link};
