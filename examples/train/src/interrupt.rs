//! Ctrl-C (and SIGTERM): the first one asks the run to stop after the step it is in, so
//! that the learner ends cleanly, the last complete checkpoint stays and the summary says
//! where the run stopped; a second one ends the process at once (exit code 130).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use burn::train::Interrupter;

/// Whether a stop was asked for.
static REQUESTED: AtomicBool = AtomicBool::new(false);
/// The learner's interrupter, while one trains.
static LEARNER: Mutex<Option<Interrupter>> = Mutex::new(None);

/// The reason given to the learner.
const REASON: &str = "interrupted (Ctrl-C)";

/// Installs the handler; once per process (later calls do nothing).
///
/// # Errors
/// When the process's signal handler cannot be set.
pub fn install() -> anyhow::Result<()> {
    static INSTALLED: std::sync::OnceLock<()> = std::sync::OnceLock::new();
    if INSTALLED.set(()).is_err() {
        return Ok(());
    }
    ctrlc::set_handler(|| {
        if REQUESTED.swap(true, Ordering::SeqCst) {
            eprintln!("\nstopped at once");
            std::process::exit(130);
        }
        eprintln!("\nstopping after this step (Ctrl-C again to quit at once)");
        if let Some(learner) = LEARNER.lock().expect("not poisoned").as_ref() {
            learner.stop(Some(REASON));
        }
    })
    .map_err(|e| anyhow::anyhow!("cannot handle Ctrl-C: {e}"))
}

/// Sends stop requests to `learner` until [`unwatch`]; one that came already stops it now.
pub fn watch(learner: &Interrupter) {
    *LEARNER.lock().expect("not poisoned") = Some(learner.clone());
    if requested() {
        learner.stop(Some(REASON));
    }
}

/// Stops the learner being watched, for `reason` (not a Ctrl-C: [`requested`] stays
/// false).
pub fn stop_learner(reason: &str) {
    if let Some(learner) = LEARNER.lock().expect("not poisoned").as_ref() {
        learner.stop(Some(reason));
    }
}

/// Stops sending stop requests to the learner.
pub fn unwatch() {
    *LEARNER.lock().expect("not poisoned") = None;
}

/// Whether a stop was asked for.
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}
