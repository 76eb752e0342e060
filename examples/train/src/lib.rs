//! Small transformers built from `mha` modules, trained on synthetic sequence tasks or
//! on text (a character-level language model) with Burn's learner: the library behind
//! the `train` binary (and the trainer benchmark).
//! Read top to bottom:
//!
//! - [`tasks`]: the tasks (one file each), their held-out split, their input grammar;
//! - [`kind`]: what the trainer does differently for a synthetic task and for the text
//!   task, in one place;
//! - [`corpus`]: a text as characters, its vocabulary, split and windows (Shakespeare's
//!   plays in the repository);
//! - [`lm`]: the text task: its training stream and validation windows, its batches,
//!   sampling the next character;
//! - [`batch`]: examples padded or packed into batches;
//! - [`precision`]: f32, or f16/bf16 steps with f32 weights (`--dtype`);
//! - [`model`]: decoder-only and encoder-decoder transformers (and the text task's
//!   language model, the decoder-only one with a tied head), their decoding, looking
//!   inside them;
//! - [`config`]: a run's configuration (`config.json`), checked before anything runs;
//! - [`memory`]: the memory a run or an inspection will take, checked before it starts;
//! - [`fields`]: which flag sets which field;
//! - [`backend`]: the backends a build has, and the devices a run trains on;
//! - [`run_dir`]: a run directory, its layout and its checkpoints;
//! - [`progress`]: the lines a run prints;
//! - [`interrupt`]: what Ctrl-C does;
//! - [`training`]: Burn's learner (on one device or several), greedy evaluation, the
//!   summary;
//! - [`plots`]: the loss curve, and every attention map drawn;
//! - [`inspect`]: what a trained run's heads learned; pruning them;
//! - [`commands`]: what `train`, `generate` and `inspect` do, one function each;
//! - [`cli`]: the command line (clap);
//! - [`text`]: how messages count things and echo what a user typed;
//! - [`alloc`]: the allocator's settings.

pub mod alloc;
pub mod backend;
pub mod batch;
pub mod cli;
pub mod commands;
pub mod config;
pub mod corpus;
pub mod fields;
pub mod inspect;
pub mod interrupt;
pub mod kind;
pub mod lm;
pub mod memory;
pub mod model;
pub mod plots;
pub mod precision;
pub mod progress;
pub mod run_dir;
pub mod tasks;
pub mod text;
pub mod training;
