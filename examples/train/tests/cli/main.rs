//! The trainer as a user runs it, one test per thing that must hold, one module per
//! command: [`train`] (what a run learns, writes and prints), [`run_dir`] (a directory
//! belongs to one run), [`resume`] (Ctrl-C, kills, corrupt checkpoints), [`config`] (flags,
//! config files, messages), [`generate`], [`inspect`] and [`text`] (the text task). Most
//! train on flex (every build has it) with tiny configurations that take a second or two;
//! the first trains on the build's best backend (wgpu, on lavapipe, in CI's second build).

#[path = "../common/mod.rs"]
mod common;

mod config;
mod generate;
mod inspect;
mod resume;
mod run_dir;
mod text;
mod train;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

/// Leaves the finished three-epoch run in `dir` as if killed after epoch 2's checkpoint.
fn killed_after_epoch_2(dir: &Path) {
    for path in ["checkpoints/epoch-3", "model.bpk", "summary.json"] {
        let path = dir.join(path);
        match path.is_dir() {
            true => std::fs::remove_dir_all(path).unwrap(),
            false => std::fs::remove_file(path).unwrap(),
        }
    }
}
