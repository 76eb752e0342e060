//! What the trainer's integration tests share: the trainer as a user runs it, scratch
//! directories, and what a test reads of a run (its files, their checksums, its summary).
// Each test file uses its share of these.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// A tiny configuration that learns `copy` in a second or two.
pub const TINY: &[&str] = &[
    "--task",
    "copy",
    "--min-len",
    "4",
    "--max-len",
    "4",
    "--symbols",
    "6",
    "--d-model",
    "32",
    "--layers",
    "1",
    "--heads",
    "2",
    "--batch-size",
    "32",
    "--eval-examples",
    "64",
];

/// The tiny configuration with some of its values replaced.
pub fn tiny<'a>(replaced: &[(&str, &'a str)]) -> Vec<&'a str> {
    let mut args: Vec<&str> = TINY.to_vec();
    for (flag, value) in replaced {
        let at = args.iter().position(|a| a == flag).expect("a flag of TINY");
        args[at + 1] = value;
    }
    args
}

pub fn trainer() -> Command {
    Command::new(env!("CARGO_BIN_EXE_train"))
}

/// The trainer on flex, with `args`.
pub fn on_flex(args: &[&str]) -> Command {
    let mut cmd = trainer();
    cmd.args(["--backend", "flex"]).args(args);
    cmd
}

/// An empty scratch directory of this test process, removed when the test that made it
/// passes (kept, and named on stderr, when it fails).
pub fn scratch(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("mha-train-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Scratch(dir)
}

/// A scratch directory (see [`scratch`]): a path while it lives, gone when dropped.
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("the failed test's files are kept in {}", self.0.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

pub fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("the trainer runs");
    println!("{}", String::from_utf8_lossy(&out.stdout));
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    out
}

pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts that `generate` answers each input with exit code 1 and an error containing
/// the text paired with it.
pub fn assert_rejected(dir: &Path, cases: &[(&str, &str)]) {
    for (input, wanted) in cases {
        let out = run(on_flex(&["generate", "--out"]).arg(dir).arg(input));
        assert_error(&out, &[wanted]);
    }
}

/// Asserts exit code 1 and one error line containing every one of `wanted`.
pub fn assert_error(out: &Output, wanted: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line: {err}");
    for w in wanted {
        assert!(err.contains(w), "{w:?} missing from: {err}");
    }
}

/// Asserts exit code 1, no panic, and a last line `error: ...` containing every one of
/// `wanted` (warnings may come before it).
pub fn assert_fails(out: &Output, wanted: &[&str]) {
    let err = stderr(out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let last = err
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    assert!(last.starts_with("error: "), "{err}");
    for w in wanted {
        assert!(last.contains(w), "{w:?} missing from: {err}");
    }
}

/// Every file under `dir` and a hash of its bytes.
pub fn checksums(dir: &Path) -> BTreeMap<PathBuf, u64> {
    let mut sums = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(path) = stack.pop() {
        match path.is_dir() {
            true => stack.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path())),
            false => {
                let bytes = std::fs::read(&path).unwrap();
                let hash = bytes.iter().fold(0xCBF2_9CE4_8422_2325u64, |h, &b| {
                    (h ^ b as u64).wrapping_mul(0x100_0000_01B3)
                });
                sums.insert(path, hash);
            }
        }
    }
    sums
}

pub fn summary(dir: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("summary.json")).expect("summary.json");
    serde_json::from_str(&text).unwrap()
}

/// Trains the tiny configuration on flex for `epochs` of 40 steps into `dir`.
pub fn tiny_run(dir: &Path, epochs: &str) {
    let out = run(on_flex(TINY)
        .args(["--epochs", epochs, "--steps-per-epoch", "40", "--out"])
        .arg(dir));
    assert!(out.status.success());
}

/// Sends `child` a Ctrl-C (SIGINT).
pub fn ctrl_c(child: &std::process::Child) {
    let kill = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    assert!(kill.unwrap().success());
}

/// Waits until `path` exists (while `child` runs), then a moment for it to be complete.
pub fn wait_for(path: &Path, child: &mut std::process::Child) {
    let started = Instant::now();
    while !path.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "{} never came",
            path.display()
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
}

/// Starts `cmd` with its output piped, and returns it once it has printed a line that
/// starts with `prefix` (its standard output is then no longer read).
pub fn spawn_until(cmd: &mut Command, prefix: &str) -> std::process::Child {
    use std::io::BufRead;
    let mut child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    for line in stdout.lines() {
        if line.unwrap().starts_with(prefix) {
            break;
        }
    }
    child
}

/// The tiny configuration for `epochs` of `steps` on flex into `dir`, spawned with its
/// output piped.
pub fn spawn_tiny(dir: &Path, epochs: &str, steps: &str) -> std::process::Child {
    on_flex(TINY)
        .args(["--epochs", epochs, "--steps-per-epoch", steps, "--out"])
        .arg(dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap()
}
