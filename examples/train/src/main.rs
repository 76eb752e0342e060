//! Trains a small transformer built from `mha` modules on a synthetic sequence task, then
//! decodes the held-out split greedily and draws what it learned; or trains a
//! character-level language model on text and samples from it.
//!
//! ```sh
//! cargo run --release -p train                      # reverse, decoder-only, on flex
//! cargo run --release -p train --features wgpu      # on the GPU
//! cargo run --release -p train -- --task add --model encoder-decoder
//! cargo run --release -p train -- --resume --out runs/add
//! cargo run --release -p train -- generate "3 1 4 1 5 9 2 6"
//! cargo run --release -p train -- --task text       # a character-level Shakespeare
//! cargo run --release -p train -- generate --out runs/text --prompt "ROMEO:"
//! ```
//!
//! This file parses the command line and runs its command (`src/lib.rs` is the library).

use std::process::ExitCode;

/// mimalloc keeps freed memory for the next allocation (and, told so by
/// `keep_freed_memory`, never gives it back); the system allocator (glibc) unmaps tensors
/// of a few MB when they are freed, and every step faults them in again (see
/// docs/benchmarks.md, "The system allocator": `--no-default-features` builds without it).
#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    end_quietly_on_a_closed_pipe();
    train::alloc::keep_freed_memory();
    train::commands::run(train::cli::Cli::parse_with_defaults())
}

/// Restores SIGPIPE's default action, which Rust sets to "ignore": a write to a closed pipe
/// (`train | head -1`) then ends the process quietly, as it ends `cat`, instead of making
/// every `println!` panic. A run ended so is left as a kill leaves it: `--resume` continues
/// it from its last complete checkpoint.
fn end_quietly_on_a_closed_pipe() {
    // SAFETY: called first in `main`, before any other thread exists; SIG_DFL is a valid
    // action for SIGPIPE, and no handler of ours is replaced.
    #[cfg(unix)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
