//! A run directory: it belongs to one run, is locked while in use, is written only once
//! every check passed, and `--overwrite` deletes only what the trainer wrote.

#[cfg(unix)]
use std::process::Command;

use super::*;

#[test]
fn a_run_directory_belongs_to_one_run() {
    let root = scratch("owner");
    let dir = root.join("run");
    tiny_run(&dir, "2");
    let before = checksums(&dir);
    // Another run into it, of another task: refused, naming --resume and --overwrite.
    let out = run(on_flex(&["--task", "sort", "--epochs", "1", "--out"]).arg(&dir));
    assert_error(&out, &["already holds a run", "--resume", "--overwrite"]);
    assert_eq!(checksums(&dir), before);
    // --overwrite replaces it with the new run.
    let out = run(
        on_flex(&["--task", "reverse", "--min-len", "2", "--max-len", "3"])
            .args([
                "--d-model",
                "32",
                "--epochs",
                "1",
                "--steps-per-epoch",
                "10",
            ])
            .args(["--eval-examples", "8", "--overwrite", "--out"])
            .arg(&dir),
    );
    assert!(out.status.success());
    assert_eq!(summary(&dir)["task"], "reverse");
    assert!(!dir.join("checkpoints").join("epoch-2").exists());
    // A directory with other files is never a run's, not even with --overwrite.
    let other = root.join("notes");
    std::fs::create_dir_all(&other).unwrap();
    std::fs::write(other.join("todo.txt"), "keep me").unwrap();
    let out = run(on_flex(&["--overwrite", "--out"]).arg(&other));
    assert_error(&out, &["is not empty (todo.txt) and holds no run"]);
    assert_eq!(
        std::fs::read_to_string(other.join("todo.txt")).unwrap(),
        "keep me"
    );
    // Nor is a `.lock` of the user's taken for a lock the trainer left: a folder, or a
    // file that holds no process id (both were deleted), alone or beside other files.
    std::fs::create_dir_all(other.join(".lock")).unwrap();
    std::fs::write(other.join(".lock/owner.txt"), "mine").unwrap();
    let before = checksums(&other);
    let out = run(on_flex(&["--overwrite", "--out"]).arg(&other));
    assert_error(&out, &[".lock is not the trainer's lock (not a file)"]);
    assert_eq!(checksums(&other), before);
    let alone = root.join("alone");
    std::fs::create_dir_all(&alone).unwrap();
    std::fs::write(alone.join(".lock"), "hello").unwrap();
    for args in [&["--out"][..], &["--overwrite", "--out"]] {
        let out = run(on_flex(TINY).args(args).arg(&alone));
        assert_error(
            &out,
            &[".lock is not the trainer's lock (it holds \"hello\", not a process id)"],
        );
        assert_eq!(
            std::fs::read_to_string(alone.join(".lock")).unwrap(),
            "hello"
        );
    }
    // The default directory is the task's.
    let help = run(trainer().arg("--help"));
    assert!(String::from_utf8_lossy(&help.stdout).contains("[default: runs/<task>]"));
}

#[test]
fn a_rejected_setting_writes_nothing() {
    let root = scratch("rejected");
    let dir = root.join("run");
    tiny_run(&dir, "1");
    let before = checksums(&dir);
    for (flags, wanted) in [
        (
            &["--d-model", "65"][..],
            "`--d-model` (`model.d_model`) = 65 is not divisible by `--heads`",
        ),
        (
            &["--heads", "0"][..],
            "`--heads` (`model.n_heads`) must be at least 1, got 0",
        ),
        (
            &["--dropout", "1.5"][..],
            "`--dropout` (`model.dropout`) must be in [0, 1), got 1.5",
        ),
        (
            &["--max-len", "4294967296"][..],
            "`--max-len` (`task.max_len`) must be at most 1048576, got 4294967296",
        ),
        (
            &["--max-len", "9223372036854775807"][..],
            "`--max-len` (`task.max_len`) must be at most 1048576, got 9223372036854775807",
        ),
        (
            &["--symbols", "18446744073709551615"][..],
            "`--symbols` (`task.n_symbols`) must be at most 4294967296, got 18446744073709551615",
        ),
        (
            &["--task", "text", "--block-size", "18446744073709551615"][..],
            "too short for a block size of 18446744073709551615",
        ),
        (
            &["--task", "text", "--block-size", "1000000000000"][..],
            "too short for a block size of 1000000000000, whose windows of 1000000000001 must \
             fit in the validation split (the last 10%) as in the training split; give at least \
             10000000000006 characters",
        ),
    ] {
        let out = run(on_flex(flags).args(["--overwrite", "--out"]).arg(&dir));
        assert_error(&out, &[wanted]);
        assert_eq!(checksums(&dir), before, "{flags:?} changed the run");
    }
    // The finished run still answers.
    let out = run(on_flex(&["generate", "--out"]).arg(&dir).arg("1 2 3 4"));
    assert!(out.status.success());
}

#[test]
fn overwrite_decides_before_deleting_and_keeps_what_the_trainer_did_not_write() {
    let root = scratch("overwrite");
    let dir = root.join("run");
    let quick = ["--epochs", "1", "--steps-per-epoch", "5", "--out"];
    let out = run(on_flex(TINY).args(quick).arg(&dir));
    assert!(out.status.success());
    std::fs::write(dir.join("my-notes.txt"), "n\n").unwrap();
    // A model mha would refuse is refused before anything is deleted.
    let before = checksums(&dir);
    let out = run(on_flex(&tiny(&[("--d-model", "30"), ("--heads", "2")]))
        .args(["--positions", "rope"])
        .args(quick)
        .arg(&dir)
        .arg("--overwrite"));
    assert_error(
        &out,
        &[
            "`--positions` (`model.positions`) rope needs heads of an even width: `--d-model` \
           (`model.d_model`) 30 / `--heads` (`model.n_heads`) 2 = 15",
        ],
    );
    assert_eq!(checksums(&dir), before, "a refused command changed the run");
    // What inspect writes is the run's too.
    std::fs::create_dir_all(dir.join("inspect/pruned-1")).unwrap();
    std::fs::write(dir.join("inspect/heads.json"), "{}").unwrap();
    let out = run(on_flex(&tiny(&[("--task", "reverse")]))
        .args(quick)
        .arg(&dir)
        .arg("--overwrite"));
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("keeps what the trainer did not write: my-notes.txt"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("my-notes.txt")).unwrap(),
        "n\n"
    );
    assert!(!dir.join("inspect").exists());
    let s = summary(&dir);
    assert_eq!(
        (s["task"].clone(), s["status"].clone()),
        ("reverse".into(), "finished".into())
    );
    assert!(dir.join("model.bpk").exists() && dir.join("loss.png").exists());
    assert!(!dir.join(".lock").exists(), "the lock outlived the run");
}

#[cfg(unix)]
#[test]
fn a_run_directory_is_locked_and_a_damaged_metric_log_is_named() {
    let root = scratch("lock");
    let dir = root.join("run");
    let mut first = spawn_tiny(&dir, "3", "400");
    wait_for(&dir.join("checkpoints/epoch-1/scheduler.bpk"), &mut first);
    // A second command on the run is refused while the first trains, naming it.
    let before = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let pid = first.id().to_string();
    for args in [&["--resume", "--out"][..], &["--overwrite", "--out"]] {
        let out = run(on_flex(TINY).args(args).arg(&dir));
        assert_error(&out, &["is in use by another command", &pid]);
    }
    assert_eq!(
        std::fs::read_to_string(dir.join("config.json")).unwrap(),
        before
    );
    // inspect too, before it looks at the run (which has no model yet).
    let out = run(on_flex(&["inspect", "--out"]).arg(&dir));
    assert_error(&out, &["is in use by another command", &pid]);
    // And by the trainer built elsewhere (another executable: another build, `bench
    // train`), which took the lock over and deleted the running run's files.
    let copy = root.join("train-copy");
    std::fs::copy(env!("CARGO_BIN_EXE_train"), &copy).unwrap();
    let mut other = Command::new(&copy);
    other.args(["--backend", "flex"]).args(TINY);
    let out = run_copied(other.args(["--overwrite", "--out"]).arg(&dir));
    assert_error(&out, &["is in use by another command", &pid]);
    assert_eq!(
        std::fs::read_to_string(dir.join("config.json")).unwrap(),
        before
    );
    // Killed, it leaves its lock, which the next command takes over.
    first.kill().unwrap();
    first.wait().unwrap();
    assert!(dir.join(".lock").exists());
    // A damaged line in a metric log: named with its file, nothing changed.
    let log = dir.join("train/epoch-1/Loss.log");
    let mut text = std::fs::read_to_string(&log).unwrap();
    text.push_str("garbage\n");
    std::fs::write(&log, &text).unwrap();
    let before = checksums(&dir);
    let out = run(on_flex(&["--resume", "--out"]).arg(&dir));
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("locked by process {pid}, which no longer runs")),
        "{err}"
    );
    let error = err.lines().find(|l| l.starts_with("error: ")).unwrap();
    for wanted in [
        &log.display().to_string(),
        "line 402 is damaged (\"garbage\")",
    ] {
        assert!(error.contains(wanted), "{wanted:?} missing from: {err}");
    }
    let mut after = checksums(&dir);
    after.remove(&dir.join(".lock"));
    let mut before = before;
    before.remove(&dir.join(".lock"));
    assert_eq!(after, before);
    // Repaired, the run finishes.
    std::fs::write(&log, text.replace("garbage\n", "")).unwrap();
    let out = run(on_flex(&["--resume", "--epochs", "2", "--out"]).arg(&dir));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(summary(&dir)["status"], "finished");
    assert!(!dir.join(".lock").exists());
}

#[test]
fn missing_runs_and_quick_runs_are_handled() {
    let root = scratch("missing");
    let out = run(on_flex(&["--resume", "--out"]).arg(root.join("none")));
    assert_error(&out, &["no run to resume", "config.json"]);
    let out = run(on_flex(&["generate", "--out"])
        .arg(root.join("none"))
        .arg("1 2"));
    assert_error(&out, &["no run here"]);
    // A quick run: the default warmup fits any length of run.
    let out = run(on_flex(&[
        "--epochs",
        "2",
        "--steps-per-epoch",
        "20",
        "--d-model",
        "32",
    ])
    .args(["--eval-examples", "8", "--out"])
    .arg(root.join("quick")));
    assert!(out.status.success());
    let out = run(on_flex(&[
        "--epochs",
        "2",
        "--steps-per-epoch",
        "20",
        "--warmup",
        "50",
        "--out",
    ])
    .arg(root.join("slow")));
    assert_error(
        &out,
        &["`--warmup` (`warmup_steps`) = 50 must be below the run's 40 steps"],
    );
}

/// Runs a copy of the trainer just written: while another test's thread forks, the copy
/// may still be open for writing in the child for a moment (`ETXTBSY`), so the start is
/// tried again.
#[cfg(unix)]
fn run_copied(cmd: &mut Command) -> std::process::Output {
    for _ in 0..50 {
        match cmd.output() {
            Err(e) if e.raw_os_error() == Some(26) => {
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            out => {
                let out = out.expect("the copied trainer runs");
                eprintln!("{}", String::from_utf8_lossy(&out.stderr));
                return out;
            }
        }
    }
    panic!("the copied trainer stayed busy (ETXTBSY)")
}
