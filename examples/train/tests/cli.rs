//! The trainer as a user runs it: a short training on the backend this build selects
//! (flex by default, wgpu with `--features wgpu`), a run killed with SIGKILL and resumed,
//! and a corrupt checkpoint.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// A tiny, fixed-shape configuration that learns `copy` in seconds.
const TINY: &[&str] = &[
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
    "--warmup",
    "10",
    "--lr",
    "0.003",
    "--eval-examples",
    "64",
];

fn train() -> Command {
    Command::new(env!("CARGO_BIN_EXE_train"))
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("mha-train-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("the trainer runs");
    println!("{}", String::from_utf8_lossy(&out.stdout));
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    out
}

fn summary(dir: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(dir.join("summary.json")).expect("summary.json");
    serde_json::from_str(&text).unwrap()
}

#[test]
fn a_short_run_learns_and_writes_its_files() {
    let dir = scratch("short");
    let out = run(train()
        .args(TINY)
        .args(["--epochs", "3", "--steps-per-epoch", "40", "--out"])
        .arg(&dir));
    assert!(out.status.success());
    let s = summary(&dir);
    let first = s["first_loss"].as_f64().unwrap();
    let last = s["final_loss"].as_f64().unwrap();
    assert!(last < 0.5 * first, "loss did not fall: {first} -> {last}");
    // Chance is 1/6 per token.
    assert!(s["token_accuracy"].as_f64().unwrap() > 0.6, "{s}");
    assert_eq!(s["steps"], 120);
    for file in [
        "config.json",
        "loss.png",
        "model.bpk",
        "attention-layer0.png",
    ] {
        assert!(dir.join(file).exists(), "{file} missing");
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("loss curve: ") && stdout.contains("attention: "),
        "{stdout}"
    );
    // The trained model answers one input.
    let generated = run(train().args(["generate", "--out"]).arg(&dir).arg("1 2 3 4"));
    assert!(generated.status.success());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_killed_run_resumes_where_it_stopped_and_a_corrupt_checkpoint_is_reported() {
    let dir = scratch("resume");
    let mut child = train()
        .args(TINY)
        .args(["--epochs", "4", "--steps-per-epoch", "40", "--out"])
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Kill it (SIGKILL) in the third epoch, once the second epoch's checkpoint (model,
    // optimizer, scheduler; the scheduler's is written last) is there.
    let checkpoint = dir.join("checkpoint").join("scheduler-2.bpk");
    let started = Instant::now();
    while !checkpoint.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "no checkpoint after 10 minutes"
        );
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before it was killed"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!dir.join("summary.json").exists(), "killed too late");

    let config_before = std::fs::read(dir.join("config.json")).unwrap();
    let out = run(train().args(["--resume", "--out"]).arg(&dir));
    assert!(out.status.success());
    let s = summary(&dir);
    assert_eq!(s["steps"], 160);
    // The resumed run started from the checkpoint, not from scratch: its first loss is
    // well below the first loss of the killed run.
    let resumed_first = s["first_loss"].as_f64().unwrap();
    let epoch1_first = first_logged_loss(&dir, 1);
    assert!(
        resumed_first < 0.5 * epoch1_first,
        "restarted from scratch: {epoch1_first} -> {resumed_first}"
    );
    assert_eq!(
        std::fs::read(dir.join("config.json")).unwrap(),
        config_before
    );

    // A truncated checkpoint: one line naming the file, a failure, nothing overwritten.
    let last = (1..=4)
        .rev()
        .map(|e| dir.join("checkpoint").join(format!("model-{e}.bpk")))
        .find(|p| p.exists())
        .unwrap();
    let bytes = std::fs::read(&last).unwrap();
    std::fs::write(&last, &bytes[..bytes.len() / 3]).unwrap();
    std::fs::remove_file(dir.join("summary.json")).unwrap();
    let summary_before: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    let out = run(train()
        .args(["--resume", "--epochs", "6", "--out"])
        .arg(&dir));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains(&last.display().to_string()), "{stderr}");
    let after: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(summary_before, after);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_missing_or_broken_config_is_reported_in_one_line() {
    let dir = scratch("config");
    let out = run(train().args(["--resume", "--out"]).arg(&dir));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.trim().lines().count() == 1 && stderr.contains("config.json"),
        "{stderr}"
    );

    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.json");
    std::fs::write(&bad, "{\"batch_size\": ").unwrap();
    let out = run(train()
        .args(["--config"])
        .arg(&bad)
        .args(["--out"])
        .arg(dir.join("run")));
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.trim().lines().count() == 1 && stderr.contains("bad.json"),
        "{stderr}"
    );
    assert!(!dir.join("run").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The first per-step training loss the learner logged for `epoch`.
fn first_logged_loss(dir: &Path, epoch: usize) -> f64 {
    let text = std::fs::read_to_string(
        dir.join("train")
            .join(format!("epoch-{epoch}"))
            .join("Loss.log"),
    )
    .unwrap();
    let first = text.lines().next().unwrap();
    first.split(',').next().unwrap().trim().parse().unwrap()
}
