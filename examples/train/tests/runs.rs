//! What the trainer never does to a user's files, and what it never lets pass in silence:
//! a finished model is replaced only with --overwrite, --overwrite removes only what the
//! trainer wrote and refuses a folder that is not a run, every check (paths, permissions,
//! counts) comes before anything is written or removed, a damaged model is named, a
//! setting that would have no effect is refused, and a run's summary says what it is
//! doing. Each test gives the command, its exit code, its message, and the directory's
//! files before and after.

mod common;

use std::path::Path;

use common::*;

/// A finished tiny run of `epochs` of 20 steps in `dir`.
fn finished(dir: &Path, epochs: &str) {
    let out = run(on_flex(TINY)
        .args(["--epochs", epochs, "--steps-per-epoch", "20", "--out"])
        .arg(dir));
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn a_finished_model_is_replaced_only_with_overwrite() {
    let root = scratch("finished");
    // Its checkpoints gone: --resume would have retrained it from scratch.
    let dir = root.join("gone");
    finished(&dir, "1");
    std::fs::remove_dir_all(dir.join("checkpoints")).unwrap();
    let before = checksums(&dir);
    let out = run(on_flex(&["--resume", "--epochs", "3", "--out"]).arg(&dir));
    assert_fails(
        &out,
        &[
            "the run finished 1 epoch (model.bpk), but its checkpoints are gone",
            "replace the finished model",
            "--overwrite",
        ],
    );
    assert_eq!(checksums(&dir), before);

    // Every checkpoint damaged (cut short): the same refusal, after a warning for each.
    let dir = root.join("damaged");
    finished(&dir, "2");
    for epoch in [1, 2] {
        let path = dir.join(format!("checkpoints/epoch-{epoch}/model.bpk"));
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    }
    let before = checksums(&dir);
    let out = run(on_flex(&["--resume", "--epochs", "3", "--out"]).arg(&dir));
    assert_fails(
        &out,
        &[
            "the run finished 2 epochs",
            "none of its checkpoints can be used",
        ],
    );
    assert_eq!(
        stderr(&out).matches("passing over the checkpoint").count(),
        2
    );
    assert_eq!(checksums(&dir), before);
    // Unfinished (killed before its model was installed), with no usable checkpoint:
    // refused too, the checkpoints kept, not removed to train again from the start.
    std::fs::remove_file(dir.join("model.bpk")).unwrap();
    let before = checksums(&dir);
    let out = run(on_flex(&["--resume", "--out"]).arg(&dir));
    assert_fails(
        &out,
        &["none of its checkpoints can be used", "--overwrite"],
    );
    assert_eq!(checksums(&dir), before);

    // Evaluated again on other examples, which --help lists as a change --resume takes.
    let dir = root.join("again");
    finished(&dir, "1");
    let model = std::fs::read(dir.join("model.bpk")).unwrap();
    let out = run(on_flex(&["--resume", "--eval-examples", "32", "--out"]).arg(&dir));
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("evaluating the finished run"), "{text}");
    // The loss it reports is what it is: the last epoch's mean, not the last step's.
    assert!(
        text.contains("the last epoch's mean training loss"),
        "{text}"
    );
    let s = summary(&dir);
    assert_eq!(
        (s["status"].clone(), s["eval_examples"].clone()),
        ("finished".into(), 32.into())
    );
    assert_eq!(std::fs::read(dir.join("model.bpk")).unwrap(), model);
    // The same number again is no change: refused, naming both ways on.
    let out = run(on_flex(&["--resume", "--out"]).arg(&dir));
    assert_fails(
        &out,
        &["already finished", "--eval-examples N (N other than 32)"],
    );
}

/// A checkpoint that cannot be read at all may be whole (here a folder where its
/// optimizer state's checksum goes, which the system refuses to read as permission denied
/// would): --resume names it and changes nothing. It passed over it as damaged, trained
/// again from the epoch before, and removed it.
#[test]
fn an_unreadable_checkpoint_stops_a_resume_and_is_kept() {
    let root = scratch("unreadable");
    let dir = root.join("run");
    finished(&dir, "2");
    // Stopped before its model was installed: --resume goes to the checkpoints.
    std::fs::remove_file(dir.join("model.bpk")).unwrap();
    let sum = dir.join("checkpoints/epoch-2/optim.bpk.sum");
    std::fs::remove_file(&sum).unwrap();
    std::fs::create_dir(&sum).unwrap();
    let before = checksums(&dir);
    let out = run(on_flex(&["--resume", "--out"]).arg(&dir));
    assert_fails(
        &out,
        &[
            "the checkpoint of epoch 2 cannot be read",
            "make it readable (or move it away) and try again; nothing was changed",
            "optim.bpk.sum",
        ],
    );
    assert_eq!(checksums(&dir), before);
    assert!(sum.is_dir());
}

/// A run extended and stopped between its last checkpoint and installing its model
/// (`model.bpk` still the shorter run's, the summary saying so): --resume installs and
/// evaluates the last epoch's checkpoint (it evaluated, and kept, the shorter run's).
#[test]
fn an_extension_stopped_before_its_model_was_installed_installs_it() {
    let root = scratch("extended");
    let dir = root.join("run");
    finished(&dir, "1");
    let shorter = ["model.bpk", "model.bpk.sum"].map(|f| std::fs::read(dir.join(f)).unwrap());
    let out = run(on_flex(&["--resume", "--epochs", "2", "--out"]).arg(&dir));
    assert!(out.status.success(), "{}", stderr(&out));
    let longer = std::fs::read(dir.join("model.bpk")).unwrap();
    assert_ne!(longer, shorter[0]);
    // What the disk held had the extension stopped after its checkpoint of epoch 2.
    for (file, bytes) in ["model.bpk", "model.bpk.sum"].iter().zip(&shorter) {
        std::fs::write(dir.join(file), bytes).unwrap();
    }
    let mut stopped = summary(&dir);
    stopped["status"] = "interrupted".into();
    stopped["model_epochs"] = 1.into();
    let text = serde_json::to_string_pretty(&stopped).unwrap();
    std::fs::write(dir.join("summary.json"), text).unwrap();
    let out = run(on_flex(&["--resume", "--out"]).arg(&dir));
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("model.bpk holds the model of 1 epoch before the run was extended"),
        "{text}"
    );
    let s = summary(&dir);
    assert_eq!(
        (s["status"].clone(), s["model_epochs"].clone()),
        ("finished".into(), 2.into())
    );
    assert_eq!(std::fs::read(dir.join("model.bpk")).unwrap(), longer);
}

/// --resume removes what the epochs it trains again left, but only what the trainer
/// wrote there: a file of the user's in such a folder stays, and is named.
#[test]
fn resume_removes_only_what_the_trainer_wrote_in_the_epochs_it_trains_again() {
    let root = scratch("forget");
    let dir = root.join("run");
    finished(&dir, "1");
    // What an extension to 2 epochs stopped in its second left, and the user's notes.
    for folder in ["train", "checkpoints"] {
        let epoch = dir.join(folder).join("epoch-2");
        std::fs::create_dir_all(&epoch).unwrap();
        std::fs::write(epoch.join("notes.txt"), "mine").unwrap();
    }
    std::fs::write(dir.join("train/epoch-2/Loss.log"), "1,2.5\n").unwrap();
    std::fs::write(dir.join("checkpoints/epoch-2/optim.bpk"), "cut short").unwrap();
    // A link of the user's where an epoch's logs go: the link goes, what it points to
    // stays (even files named as the trainer's).
    let elsewhere = root.join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    std::fs::write(elsewhere.join("Loss.log"), "theirs").unwrap();
    #[cfg(unix)]
    std::os::unix::fs::symlink(&elsewhere, dir.join("valid/epoch-2")).unwrap();
    let out = run(on_flex(&["--resume", "--epochs", "2", "--out"]).arg(&dir));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("kept what the trainer did not write in"),
        "{}",
        stderr(&out)
    );
    for folder in ["train", "checkpoints"] {
        let notes = dir.join(folder).join("epoch-2/notes.txt");
        assert_eq!(std::fs::read_to_string(notes).unwrap(), "mine");
    }
    assert_eq!(
        std::fs::read_to_string(elsewhere.join("Loss.log")).unwrap(),
        "theirs"
    );
    // The trainer's own files of that epoch were written again.
    let log = std::fs::read_to_string(dir.join("train/epoch-2/Loss.log")).unwrap();
    assert_ne!(log, "1,2.5\n");
    assert_eq!(summary(&dir)["model_epochs"], 2);
}

#[test]
fn overwrite_removes_only_a_run_and_only_what_the_trainer_wrote() {
    let root = scratch("not-a-run");
    // A project folder whose config.json is not a run's: not a run, never removed.
    let dir = root.join("project");
    for (path, text) in [
        ("config.json", r#"{"name":"my project"}"#),
        ("train/cat001.jpg", "cat"),
        ("valid/dog001.jpg", "dog"),
        ("checkpoints/mine.pt", "weights"),
        ("summary.json", "{}"),
    ] {
        let path = dir.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    let before = checksums(&dir);
    let out = run(on_flex(TINY).arg("--overwrite").arg("--out").arg(&dir));
    assert_fails(
        &out,
        &[
            "is not a run",
            "unknown field `name`",
            "--overwrite removes only a run",
        ],
    );
    assert_eq!(checksums(&dir), before);
    let out = run(on_flex(&["--resume", "--out"]).arg(&dir));
    assert_fails(&out, &["is not a run", "unknown field `name`"]);
    assert_eq!(checksums(&dir), before);

    // Inside a run, the user's files in the trainer's folders stay, named.
    let dir = root.join("run");
    finished(&dir, "1");
    let mine = [
        "train/notes.txt",
        "checkpoints/mine.pt",
        "checkpoints/epoch-1/extra.txt",
        "inspect/mine.svg",
    ];
    for path in mine {
        let path_in = dir.join(path);
        std::fs::create_dir_all(path_in.parent().unwrap()).unwrap();
        std::fs::write(path_in, path).unwrap();
    }
    let out = run(on_flex(TINY)
        .args([
            "--epochs",
            "1",
            "--steps-per-epoch",
            "5",
            "--overwrite",
            "--out",
        ])
        .arg(&dir));
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    for path in mine {
        assert_eq!(std::fs::read_to_string(dir.join(path)).unwrap(), path);
        assert!(err.contains(path), "{path} not named in: {err}");
    }
    // The old run's checkpoint parts went; the new run wrote its own.
    assert_eq!(summary(&dir)["steps_total"], 5);
    assert!(dir.join("checkpoints/epoch-1/model.bpk").exists());
}

#[test]
fn every_check_comes_before_anything_is_written_or_removed() {
    let root = scratch("checks-first");
    let dir = root.join("run");
    finished(&dir, "1");
    let before = checksums(&dir);
    // A path config.json cannot hold (not UTF-8): refused, the old run untouched.
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let bad = std::ffi::OsStr::from_bytes(b"bad\xffname/x.txt");
        let out = run(on_flex(&["--task", "text", "--overwrite", "--data"])
            .arg(bad)
            .arg("--out")
            .arg(&dir));
        assert_fails(&out, &["`--data` (`task.data`)", "not UTF-8"]);
        assert_eq!(checksums(&dir), before);
        let fresh = root.join("fresh");
        let out = run(on_flex(&["--task", "text", "--data"])
            .arg(bad)
            .arg("--out")
            .arg(&fresh));
        assert_fails(&out, &["not UTF-8"]);
        assert!(!fresh.exists(), "a refused run left its directory");
    }
    // More steps than can be counted: refused before the directory is made.
    let fresh = root.join("huge");
    let out = run(on_flex(&[
        "--epochs",
        "18446744073709551615",
        "--steps-per-epoch",
        "2",
        "--out",
    ])
    .arg(&fresh));
    assert_fails(
        &out,
        &[
            "`--epochs` (`epochs`) 18446744073709551615",
            "can be counted",
        ],
    );
    assert!(!fresh.exists());
    // A learning-rate schedule Burn refuses (an lr whose hundredth, the warmup's start, is
    // 0) or whose steps overflow: refused before --overwrite removes the old run.
    let out = run(on_flex(&["--lr", "1e-322", "--overwrite", "--out"]).arg(&dir));
    assert_fails(
        &out,
        &["the learning-rate schedule of `--lr` (`lr`) = 1e-322"],
    );
    assert_eq!(checksums(&dir), before);
    let config = root.join("decay.json");
    let decay = r#"{"epochs": 50, "steps_per_epoch": 100, "warmup_steps": 4096,
                    "decay_steps": 18446744073709549568}"#;
    std::fs::write(&config, decay).unwrap();
    let out = run(on_flex(&["--overwrite", "--config"])
        .arg(&config)
        .arg("--out")
        .arg(&dir));
    assert_fails(
        &out,
        &["decay_steps", "18446744073709549568", "can be counted"],
    );
    assert_eq!(checksums(&dir), before);
    // Resumed for more epochs than can be counted: refused, not an overflow.
    let out = run(on_flex(&["--resume", "--epochs", "18446744073709551615", "--out"]).arg(&dir));
    assert_fails(
        &out,
        &[
            "`--epochs` (`epochs`) 18446744073709551615",
            "can be counted",
        ],
    );
    assert_eq!(checksums(&dir), before);

    // A folder the run writes in that it cannot write: named, nothing changed. A file
    // where the run writes its metric logs stops even a root user.
    let logs = root.join("train-logs");
    std::fs::rename(dir.join("train"), &logs).unwrap();
    std::fs::write(dir.join("train"), "mine").unwrap();
    let before = checksums(&dir);
    let out = run(on_flex(&["--resume", "--epochs", "2", "--out"]).arg(&dir));
    assert_fails(&out, &["train is a file where the trainer writes a folder"]);
    assert_eq!(checksums(&dir), before);
    std::fs::remove_file(dir.join("train")).unwrap();
    std::fs::rename(&logs, dir.join("train")).unwrap();
    // A link to nothing among the user's files, which Burn's learner would read (and
    // panic on) when training ends: named before anything is written, --resume and
    // --overwrite alike.
    let before = checksums(&dir);
    #[cfg(unix)]
    for place in ["latest.bpk", "checkpoints/latest.bpk"] {
        let link = dir.join(place);
        std::os::unix::fs::symlink(root.join("gone.bpk"), &link).unwrap();
        for flags in [&["--resume", "--epochs", "2"][..], &["--overwrite"]] {
            let out = run(on_flex(flags).arg("--out").arg(&dir));
            assert_fails(&out, &[place, "cannot be read", "move it away"]);
        }
        std::fs::remove_file(&link).unwrap();
        assert_eq!(checksums(&dir), before);
    }
    // A read-only folder. The permission bits bind every user but root: as root, the
    // trainer runs as `nobody` (a copy of it that user can run, in a run directory it can
    // lock).
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        use std::os::unix::process::CommandExt;
        let mode = |path: &std::path::Path, mode: u32| {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap()
        };
        let train = dir.join("train");
        mode(&train, 0o555);
        let root_user = std::fs::write(train.join("probe"), "").is_ok();
        let _ = std::fs::remove_file(train.join("probe"));
        let mut resume = match root_user {
            false => on_flex(&[]),
            true => {
                let copy = root.join("trainer");
                std::fs::copy(env!("CARGO_BIN_EXE_train"), &copy).unwrap();
                mode(&copy, 0o755);
                mode(&dir, 0o777);
                let mut cmd = std::process::Command::new(&copy);
                cmd.uid(65534).gid(65534).args(["--backend", "flex"]);
                cmd
            }
        };
        let before = checksums(&dir);
        let out = run(resume
            .args(["--resume", "--epochs", "2", "--out"])
            .arg(&dir));
        assert_fails(&out, &["cannot write in", "train"]);
        assert_eq!(checksums(&dir), before);
        mode(&train, 0o755);
        mode(&dir, 0o755);
    }
    // With the folder back, the run resumes and extends.
    let out = run(on_flex(&["--resume", "--epochs", "2", "--out"]).arg(&dir));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(summary(&dir)["steps_done"], 40);
}

#[test]
fn a_damaged_model_is_named_not_used() {
    let root = scratch("damaged-model");
    let dir = root.join("run");
    finished(&dir, "1");
    // Bytes overwritten in the middle of a weights file with `fill`.
    let damage = |path: &Path, fill: u8| {
        let mut bytes = std::fs::read(path).unwrap();
        let (middle, len) = (bytes.len() / 2, 5000.min(bytes.len() / 4));
        bytes[middle..middle + len].fill(fill);
        std::fs::write(path, bytes).unwrap();
    };
    let path = dir.join("model.bpk");
    let whole = std::fs::read(&path).unwrap();
    // 0x3f bytes decode to finite weights (0.747 as f32): only the checksum written with
    // the file shows the damage.
    damage(&path, 0x3f);
    let before = checksums(&dir);
    let generate = || run(on_flex(&["generate", "--out"]).arg(&dir).arg("1 2 3 4"));
    let inspect = || run(on_flex(&["inspect", "--out"]).arg(&dir));
    for out in [generate(), inspect()] {
        assert_fails(&out, &["model.bpk", "the file is damaged", "model.bpk.sum"]);
    }
    assert_eq!(checksums(&dir), before);
    // A file without its checksum (as written before they were kept) is read only with
    // finite weights: NaN bit patterns (0xff bytes) are named.
    std::fs::remove_file(dir.join("model.bpk.sum")).unwrap();
    std::fs::write(&path, &whole).unwrap();
    damage(&path, 0xff);
    let before = checksums(&dir);
    for out in [generate(), inspect()] {
        assert_fails(
            &out,
            &["model.bpk", "not all finite", "the file is damaged"],
        );
    }
    assert_eq!(checksums(&dir), before);
    // A checkpoint's optimizer state damaged the same way: named, not resumed from, and
    // the finished model kept.
    std::fs::write(&path, &whole).unwrap();
    let optim = dir.join("checkpoints/epoch-1/optim.bpk");
    damage(&optim, 0x3f);
    let before = checksums(&dir);
    let out = run(on_flex(&["--resume", "--epochs", "2", "--out"]).arg(&dir));
    assert_fails(&out, &["the run finished", "but none of its checkpoints"]);
    let named = format!("{}: the file is damaged", optim.display());
    assert!(stderr(&out).contains(&named), "{}", stderr(&out));
    assert_eq!(checksums(&dir), before);
}

#[test]
fn a_setting_without_effect_is_refused() {
    let root = scratch("no-effect");
    let text = root.join("corpus.txt");
    std::fs::write(
        &text,
        "to be or not to be, that is the question\n".repeat(100),
    )
    .unwrap();
    let fresh = root.join("fresh");
    // Flags of the other kind of task.
    for (args, wanted) in [
        (
            vec!["--data", text.to_str().unwrap()],
            "`--data` (`task.data`) = ",
        ),
        (
            vec!["--block-size", "32"],
            "`--block-size` (`task.block_size`) = 32",
        ),
        (
            vec!["--task", "text", "--symbols", "8"],
            "`--symbols` (`task.n_symbols`) = 8",
        ),
        (
            vec!["--task", "text", "--max-len", "9"],
            "`--max-len` (`task.max_len`) = 9",
        ),
        (
            vec!["--task", "text", "--eval-examples", "5"],
            "`--eval-examples` (`eval_examples`) = 5",
        ),
        (vec!["--log-every", "0"], "--log-every must be at least 1"),
    ] {
        let out = run(on_flex(&args).arg("--out").arg(&fresh));
        assert_fails(&out, &[wanted]);
        assert!(!fresh.exists(), "{args:?} made the directory");
    }
    let out = run(on_flex(&["--data", text.to_str().unwrap(), "--out"]).arg(&fresh));
    assert_fails(&out, &["has no effect on the reverse task", "--task text"]);
    // A key given twice in a config file; a number too large for its field; a file that
    // starts with a byte-order mark is read.
    for (json, wanted) in [
        (r#"{"lr": 0.01, "lr": 0.02}"#, "`lr` is given twice"),
        (
            r#"{"model": {"d_model": 32, "d_model": 64}}"#,
            "`model.d_model` is given twice",
        ),
        (
            r#"{"seed": 18446744073709551616}"#,
            "`seed` = 18446744073709551616: too large",
        ),
    ] {
        let file = root.join("config.json");
        std::fs::write(&file, json).unwrap();
        let out = run(on_flex(&["--config"]).arg(&file).arg("--out").arg(&fresh));
        assert_fails(&out, &[wanted]);
        assert!(!fresh.exists());
    }

    // generate: the flags of sampling on a synthetic run, another task's name.
    let dir = root.join("run");
    finished(&dir, "1");
    for (args, wanted) in [
        (vec!["--top-k", "0"], "--top-k 0 is for text runs"),
        (
            vec!["--temperature", "-5", "--tokens", "3", "--seed", "2"],
            "--tokens 3 --temperature -5 --seed 2 are for text runs",
        ),
        (vec!["--task", "add"], "--task add: "),
    ] {
        let out = run(on_flex(&["generate", "--out"])
            .arg(&dir)
            .args(&args)
            .arg("1 2 3 4"));
        assert_fails(&out, &[wanted]);
    }
    let out = run(on_flex(&["inspect", "--task", "sort", "--out"]).arg(&dir));
    assert_fails(&out, &["--task sort: ", "is a copy run"]);
    // --resume --epochs 0 is a value out of range, not an epoch count.
    let out = run(on_flex(&["--resume", "--epochs", "0", "--out"]).arg(&dir));
    assert_fails(&out, &["`--epochs` (`epochs`) must be at least 1, got 0"]);
}

#[test]
fn text_files_may_start_with_a_byte_order_mark() {
    let root = scratch("bom");
    let text = root.join("corpus.txt");
    let body = "to be or not to be, that is the question\n".repeat(100);
    std::fs::write(&text, format!("\u{feff}{body}")).unwrap();
    let config = root.join("tiny.json");
    std::fs::write(
        &config,
        "\u{feff}{\"model\": {\"d_model\": 32, \"n_layers\": 1, \"n_heads\": 2}}",
    )
    .unwrap();
    let dir = root.join("run");
    let out = run(
        on_flex(&["--task", "text", "--block-size", "16", "--batch-size", "4"])
            .args(["--epochs", "1", "--steps-per-epoch", "2", "--data"])
            .arg(&text)
            .arg("--config")
            .arg(&config)
            .arg("--out")
            .arg(&dir),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let stored: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let vocab = stored["task"]["vocab"].as_str().unwrap();
    assert!(!vocab.contains('\u{feff}'), "{vocab:?}");
    assert_eq!(stored["model"]["d_model"], 32);
}

#[test]
fn inputs_longer_than_trained_are_answered_where_the_positions_read_them() {
    let root = scratch("longer-inputs");
    let dir = root.join("run");
    let out = run(on_flex(TINY)
        .args([
            "--positions",
            "sinusoidal",
            "--epochs",
            "1",
            "--steps-per-epoch",
            "20",
        ])
        .arg("--out")
        .arg(&dir));
    assert!(out.status.success(), "{}", stderr(&out));
    // Trained on 4: the length test reads 5..=6.
    let out = run(on_flex(&["generate", "--out"]).arg(&dir).arg("1 2 3 4 5"));
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("sinusoidal positions read longer inputs"),
        "{err}"
    );
    assert!(err.contains("lengths 5..=6"), "{err}");
    let out = run(on_flex(&["generate", "--out"])
        .arg(&dir)
        .arg("1 2 3 4 5 0 1"));
    assert_fails(
        &out,
        &[
            "the input has 7 symbols; this run was trained on at most 4",
            "read up to 6",
        ],
    );
}

#[test]
fn a_runs_summary_says_it_is_running_and_a_stale_lock_of_another_program_is_taken_over() {
    let root = scratch("running");
    let dir = root.join("run");
    let mut child = spawn_tiny(&dir, "3", "200");
    wait_for(&dir.join("checkpoints/epoch-1/scheduler.bpk"), &mut child);
    let s = summary(&dir);
    assert_eq!(s["status"], "running", "{s}");
    child.kill().unwrap();
    child.wait().unwrap();
    // Killed: the summary still says so, and the lock names a process that no longer runs
    // the trainer. Here: this test's own process, which runs but is not the trainer.
    assert_eq!(summary(&dir)["status"], "running");
    std::fs::write(dir.join(".lock"), format!("{}\n", std::process::id())).unwrap();
    let out = run(on_flex(&["--resume", "--out"]).arg(&dir));
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("no longer runs the trainer"), "{err}");
    assert_eq!(summary(&dir)["status"], "finished");
}

#[test]
fn inspect_reports_means_that_do_not_grow_with_the_examples() {
    let root = scratch("inspect-means");
    let dir = root.join("run");
    // 8 symbols: a held-out split of about 400 inputs.
    let out = run(on_flex(&tiny(&[("--symbols", "8")]))
        .args(["--epochs", "2", "--steps-per-epoch", "20", "--out"])
        .arg(&dir));
    assert!(out.status.success(), "{}", stderr(&out));
    let baseline = |examples: &str| {
        let out = run(on_flex(&["inspect", "--examples", examples, "--out"]).arg(&dir));
        assert!(out.status.success(), "{}", stderr(&out));
        let text = std::fs::read_to_string(dir.join("inspect/heads.json")).unwrap();
        let findings: serde_json::Value = serde_json::from_str(&text).unwrap();
        findings["ablation"]["baseline_loss"].as_f64().unwrap()
    };
    // One batch against five: as sums, the second would be about five times the first.
    let (one, five) = (baseline("64"), baseline("320"));
    assert!(
        (0.5..2.0).contains(&(five / one)),
        "baseline loss {one} on 64 examples, {five} on 320"
    );
}

#[test]
fn a_checkpoint_that_cannot_be_written_is_named_and_the_run_summarised() {
    let root = scratch("checkpoint-error");
    let dir = root.join("run");
    finished(&dir, "1");
    // A folder of the user's where epoch 1's optimizer state goes: --overwrite keeps it,
    // and the new run cannot write its checkpoint there.
    let optim = dir.join("checkpoints/epoch-1/optim.bpk");
    std::fs::remove_file(&optim).unwrap();
    std::fs::create_dir(&optim).unwrap();
    std::fs::write(optim.join("mine.txt"), "mine").unwrap();
    let out = run(on_flex(TINY)
        .args([
            "--epochs",
            "1",
            "--steps-per-epoch",
            "20",
            "--overwrite",
            "--out",
        ])
        .arg(&dir));
    assert_fails(
        &out,
        &[
            "training failed at step 20 of 20",
            "epoch-1/optim.bpk",
            "summary: ",
        ],
    );
    let s = summary(&dir);
    assert_eq!(
        (s["status"].clone(), s["steps_done"].clone()),
        ("interrupted".into(), 20.into())
    );
    assert_eq!(
        std::fs::read_to_string(optim.join("mine.txt")).unwrap(),
        "mine"
    );
}

#[test]
#[cfg(unix)]
fn ctrl_c_stops_inspect_at_once_and_the_next_inspect_runs() {
    use std::os::unix::process::ExitStatusExt;
    use std::time::{Duration, Instant};
    let root = scratch("inspect-ctrl-c");
    let dir = root.join("run");
    finished(&dir, "1");
    // What inspect does not write: the run's own files.
    let runs = |dir: &Path| {
        let mut sums = checksums(dir);
        sums.retain(|path, _| !path.starts_with(dir.join("inspect")) && !path.ends_with(".lock"));
        sums
    };
    let before = runs(&dir);
    let mut child = on_flex(&["inspect", "--prune", "1", "--out"])
        .arg(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // The lock is its first write; the ablations come after it.
    wait_for(&dir.join(".lock"), &mut child);
    ctrl_c(&child);
    let sent = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(
            sent.elapsed() < Duration::from_secs(10),
            "inspect ignored Ctrl-C"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        status.signal(),
        Some(2),
        "inspect ended before the Ctrl-C reached it: {status}"
    );
    assert_eq!(runs(&dir), before);
    // Its lock left behind names a process that is gone: the next inspect takes it over
    // and writes whole findings.
    let out = run(on_flex(&["inspect", "--out"]).arg(&dir));
    assert!(out.status.success(), "{}", stderr(&out));
    let heads = std::fs::read_to_string(dir.join("inspect/heads.json")).unwrap();
    let heads: serde_json::Value = serde_json::from_str(&heads).unwrap();
    assert!(
        heads["ablation"]["baseline_loss"]
            .as_f64()
            .unwrap()
            .is_finite(),
        "{heads}"
    );
    assert_eq!(runs(&dir), before);
}
