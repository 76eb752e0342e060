//! `--resume`: after Ctrl-C, a kill or a corrupt checkpoint, a run continues where it
//! can and retraces the uninterrupted one.

use super::*;

#[cfg(unix)]
#[test]
fn ctrl_c_stops_cleanly_and_resume_continues() {
    let root = scratch("interrupt");
    let dir = root.join("run");
    let mut child = on_flex(TINY)
        .args(["--epochs", "4", "--steps-per-epoch", "100", "--out"])
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(&dir.join("checkpoints/epoch-2/scheduler.bpk"), &mut child);
    ctrl_c(&child);
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted at step"), "{err}");
    assert!(err.contains("continue with --resume"), "{err}");
    let s = summary(&dir);
    assert_eq!(s["status"], "interrupted");
    assert_eq!(s["steps_total"], 400);
    let done = s["steps_done"].as_u64().unwrap();
    assert!((200..400).contains(&done), "{s}");
    assert!(s["exact_accuracy"].is_null(), "{s}");
    let epoch = s["last_checkpoint_epoch"].as_u64().unwrap();
    assert!(epoch >= 2 && epoch * 100 <= done, "{s}");
    // The resumed run starts from that checkpoint, not from scratch, and finishes.
    let out = run(on_flex(&["--resume", "--out"]).arg(&dir));
    assert!(out.status.success());
    let s = summary(&dir);
    assert_eq!(
        (s["status"].clone(), s["steps_done"].clone()),
        ("finished".into(), 400.into())
    );
    assert!(
        s["first_loss"].as_f64().unwrap() < 0.5,
        "restarted from scratch: {s}"
    );
}

#[test]
fn a_killed_run_resumes_and_a_corrupt_checkpoint_is_named() {
    let root = scratch("kill");
    let dir = root.join("run");
    let mut child = on_flex(TINY)
        .args(["--epochs", "4", "--steps-per-epoch", "60", "--out"])
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for(&dir.join("checkpoints/epoch-2/scheduler.bpk"), &mut child);
    child.kill().unwrap();
    child.wait().unwrap();
    // Killed while training: the summary says the run was running.
    assert_eq!(summary(&dir)["status"], "running", "killed too late");
    let out = run(on_flex(&["--resume", "--out"]).arg(&dir));
    assert!(out.status.success());
    assert_eq!(summary(&dir)["steps_done"], 240);

    // A truncated newest checkpoint: passed over, naming the file, for the one before.
    let model = dir.join("checkpoints/epoch-4/model.bpk");
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&model, &bytes[..bytes.len() / 3]).unwrap();
    std::fs::remove_file(dir.join("summary.json")).unwrap();
    let out = run(on_flex(&["--resume", "--epochs", "5", "--out"]).arg(&dir));
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains(&model.display().to_string()), "{err}");
    assert!(
        err.contains("resuming from the checkpoint of epoch 3"),
        "{err}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("resuming after epoch 3"), "{stdout}");
    let s = summary(&dir);
    assert_eq!(
        (s["status"].clone(), s["steps_done"].clone()),
        ("finished".into(), 300.into())
    );
    // Every checkpoint unusable, the summary gone: the finished model is not trained
    // over from scratch (tests/runs.rs has the rest of that rule).
    for epoch in [4, 5] {
        let model = dir.join(format!("checkpoints/epoch-{epoch}/model.bpk"));
        std::fs::write(&model, b"not a model").unwrap();
    }
    std::fs::remove_file(dir.join("summary.json")).unwrap();
    let before = checksums(&dir);
    let out = run(on_flex(&["--resume", "--out"]).arg(&dir));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("the run finished (model.bpk), but none of its checkpoints"),
        "{}",
        stderr(&out)
    );
    assert_eq!(checksums(&dir), before);
}

#[cfg(unix)]
#[test]
fn ctrl_c_during_the_final_evaluation_is_finished_by_resume() {
    let root = scratch("eval-interrupt");
    let dir = root.join("run");
    // A hundred million held-out sequences: made a window at a time, never all at once.
    let mut cmd = on_flex(&tiny(&[("--eval-examples", "100000000")]));
    cmd.args(["--epochs", "1", "--steps-per-epoch", "20", "--out"])
        .arg(&dir);
    let child = spawn_until(&mut cmd, "evaluated ");
    // Two seconds into the evaluation, its memory is a small run's.
    let status = std::fs::read_to_string(format!("/proc/{}/status", child.id())).unwrap();
    let peak_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    assert!(peak_kb < 1_000_000, "peak {peak_kb} kB while evaluating");
    ctrl_c(&child);
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(
        err.contains("every epoch is trained, and --resume finishes the evaluation"),
        "{err}"
    );
    let s = summary(&dir);
    assert_eq!(s["status"], "interrupted");
    assert!(s["exact_accuracy"].is_null() && !dir.join("loss.png").exists());
    let checkpoints = checksums(&dir.join("checkpoints"));
    // --resume evaluates, without training.
    let out = run(on_flex(&["--resume", "--eval-examples", "64", "--out"]).arg(&dir));
    assert!(out.status.success(), "{}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("finishing the evaluation"), "{stdout}");
    assert!(!stdout.lines().any(|l| l.starts_with("step ")), "{stdout}");
    assert_eq!(checksums(&dir.join("checkpoints")), checkpoints);
    let s = summary(&dir);
    assert_eq!(s["status"], "finished");
    assert!(
        s["exact_accuracy"].as_f64().is_some() && s["longer_exact_accuracy"].as_f64().is_some(),
        "{s}"
    );
    assert_eq!(s["steps_done"], 20);
    assert!(s["final_loss"].as_f64().is_some(), "{s}");
    assert!(dir.join("loss.png").exists() && dir.join("attention-layer0.png").exists());
    // Finished, it is finished.
    let out = run(on_flex(&["--resume", "--out"]).arg(&dir));
    assert_error(&out, &["already finished"]);
    // Evaluated again on other examples, it is running until the new evaluation is
    // written (it still said finished, with the old accuracies, beside config.json's new
    // count); killed meanwhile, --resume evaluates it again.
    let trained = summary(&dir);
    let mut cmd = on_flex(&["--resume", "--eval-examples", "100000000", "--out"]);
    let mut child = spawn_until(cmd.arg(&dir), "evaluating the finished run");
    let s = summary(&dir);
    assert_eq!(s["status"], "running", "{s}");
    assert!(s["exact_accuracy"].is_null(), "{s}");
    child.kill().unwrap();
    child.wait().unwrap();
    let out = run(on_flex(&["--resume", "--eval-examples", "64", "--out"]).arg(&dir));
    assert!(out.status.success(), "{}", stderr(&out));
    let s = summary(&dir);
    assert_eq!(
        (s["status"].clone(), s["eval_examples"].clone()),
        ("finished".into(), 64.into())
    );
    assert!(s["exact_accuracy"].as_f64().is_some(), "{s}");
    // The training's figures kept through the kill (rebuilt from the logs, they were lost).
    for field in ["tokens_per_second", "wall_seconds", "final_loss"] {
        assert_eq!(s[field], trained[field], "{field}: {s}");
    }
}

#[test]
fn a_resumed_run_retraces_the_uninterrupted_one() {
    let root = scratch("retrace");
    let [whole, resumed] = [root.join("whole"), root.join("resumed")];
    for dir in [&whole, &resumed] {
        tiny_run(dir, "3");
    }
    killed_after_epoch_2(&resumed);
    let out = run(on_flex(&["--resume", "--out"]).arg(&resumed));
    assert!(out.status.success());
    for log in [
        "train/epoch-3/Loss.log",
        "train/epoch-3/Learning_Rate.log",
        "valid/epoch-3/Loss.log",
    ] {
        let [a, b] = [&whole, &resumed].map(|dir| std::fs::read_to_string(dir.join(log)).unwrap());
        assert!(a.lines().count() >= 5, "{log}: {a}");
        assert_eq!(a, b, "{log}");
    }
    assert_eq!(
        summary(&whole)["exact_accuracy"],
        summary(&resumed)["exact_accuracy"]
    );
}

#[test]
fn a_resume_that_would_not_fit_in_memory_is_refused_before_it_changes_the_run() {
    // A run killed in its third epoch (whose metric logs a resume from epoch 2 removes),
    // as a machine with far too little memory sees it: its configuration edited to
    // batches of 100 million sequences (one step's logits alone are terabytes).
    let root = scratch("resume-memory");
    let dir = root.join("run");
    tiny_run(&dir, "3");
    killed_after_epoch_2(&dir);
    assert!(dir.join("train/epoch-3").exists());
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["batch_size"] = 100_000_000.into();
    std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
    let before = checksums(&dir);
    let out = run(on_flex(&["--resume", "--out"]).arg(&dir));
    assert_error(
        &out,
        &["this run needs about", "this machine has available"],
    );
    assert_eq!(checksums(&dir), before, "a refused resume changes nothing");
}
