//! Small transformers built from `mha` modules, trained on synthetic sequence tasks with
//! Burn's learner: the library behind the `train` binary (and the trainer benchmark).
//!
//! Modules: [`data`] (tasks, held-out split, batches), [`model`] (decoder-only and
//! encoder-decoder transformers), [`training`] (configuration, Burn's learner, resume,
//! greedy evaluation, summary), [`plots`] (loss curve, attention heatmaps).

pub mod data;
pub mod model;
pub mod plots;
pub mod training;
