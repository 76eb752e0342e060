//! The trainer as a user runs it, one test per thing that must hold: a run directory
//! belongs to one run, a rejected setting writes nothing, config files and `--resume`
//! take only what they can honour, `generate` reads its input strictly, a task without a
//! held-out split is refused at once, Ctrl-C stops cleanly and `--resume` continues, the
//! output is readable lines, a kill and a corrupt checkpoint are survived. Most train on
//! flex (every build has it) with tiny configurations that take a second or two; the
//! first trains on the build's best backend (wgpu, on lavapipe, in CI's second build).

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;

#[test]
fn positions_are_a_setting_and_longer_inputs_are_tested_when_the_model_reads_them() {
    let root = scratch("positions");
    // RoPE reads any length: the summary has the longer inputs' accuracy (4 -> 5..=6).
    let rope = root.join("rope");
    let out = run(on_flex(TINY)
        .args([
            "--positions",
            "rope",
            "--epochs",
            "1",
            "--steps-per-epoch",
            "20",
            "--out",
        ])
        .arg(&rope));
    assert!(out.status.success());
    let s = summary(&rope);
    assert_eq!(s["positions"], "rope");
    assert_eq!(s["longer_lengths"], serde_json::json!([5, 6]));
    let longer = s["longer_exact_accuracy"]
        .as_f64()
        .expect("a longer accuracy");
    assert!((0.0..=1.0).contains(&longer), "{s}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("longer inputs (5..=6, never trained on)"),
        "{stdout}"
    );
    let config = std::fs::read_to_string(rope.join("config.json")).unwrap();
    assert!(config.contains(r#""positions": "rope""#), "{config}");
    // Learned positions end at the longest training sequence: no longer test.
    let learned = root.join("learned");
    let out = run(on_flex(TINY)
        .args([
            "--positions",
            "learned",
            "--epochs",
            "1",
            "--steps-per-epoch",
            "20",
        ])
        .arg("--out")
        .arg(&learned));
    assert!(out.status.success());
    let s = summary(&learned);
    assert_eq!(s["positions"], "learned");
    assert!(
        s["longer_lengths"].is_null() && s["longer_exact_accuracy"].is_null(),
        "{s}"
    );
    // A misspelt kind is refused with the known ones.
    let out = run(on_flex(&["--positions", "rotary", "--out"]).arg(root.join("bad")));
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("learned, sinusoidal, rope, alibi, relative, t5"));
}

#[test]
fn packing_trains_the_decoder_only_model_and_is_refused_for_the_other() {
    let root = scratch("pack");
    let dir = root.join("packed");
    let out = run(on_flex(TINY)
        .args([
            "--pack",
            "--positions",
            "learned",
            "--epochs",
            "2",
            "--steps-per-epoch",
            "40",
            "--out",
        ])
        .arg(&dir));
    assert!(out.status.success());
    let s = summary(&dir);
    assert!(s["token_accuracy"].as_f64().unwrap() > 0.6, "{s}");
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    assert!(config.contains(r#""pack": true"#), "{config}");
    // Sequences of 10 tokens, two to a row of 20: no padding, and none padded either.
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("into rows of 20 tokens: 0% of the positions are padding, against 0%"),
        "{stdout}"
    );
    let other = root.join("encoder-decoder");
    let out = run(on_flex(TINY)
        .args(["--pack", "--model", "encoder-decoder", "--out"])
        .arg(&other));
    assert_error(
        &out,
        &["`--pack` (`pack`) packs the decoder-only model's sequences"],
    );
    assert!(!other.exists(), "a refused run writes nothing");
}

#[test]
fn a_short_run_on_the_best_backend_learns_and_writes_its_files() {
    let dir = scratch("short").join("run");
    let out = run(trainer()
        .args(TINY)
        .args(["--epochs", "3", "--steps-per-epoch", "50", "--out"])
        .arg(&dir));
    assert!(out.status.success());
    let s = summary(&dir);
    assert_eq!(s["status"], "finished");
    assert_eq!(s["task"], "copy");
    assert_eq!(s["model"], "decoder-only");
    let first = s["first_loss"].as_f64().unwrap();
    let last = s["final_loss"].as_f64().unwrap();
    assert!(last < 0.5 * first, "loss did not fall: {first} -> {last}");
    // Chance is 1/6 per token.
    assert!(s["token_accuracy"].as_f64().unwrap() > 0.6, "{s}");
    assert_eq!(
        (s["steps_done"].clone(), s["steps_total"].clone()),
        (150.into(), 150.into())
    );
    for file in [
        "config.json",
        "loss.png",
        "model.bpk",
        "learner.txt",
        "attention-layer0.png",
    ] {
        assert!(dir.join(file).exists(), "{file} missing");
    }
    let generated = run(trainer()
        .args(["generate", "--out"])
        .arg(&dir)
        .arg("1 2 3 4"));
    assert!(generated.status.success());
}

/// `--dtype f16` and `bf16` on every backend of the build that computes in them (flex
/// everywhere; wgpu, through `mha`'s GPU kernels, in f16): the run learns as the f32 run
/// of `a_short_run_on_the_best_backend_learns_and_writes_its_files` does and says how it
/// computed; a backend without the dtype is refused before anything is written, and
/// `--resume` does not change a run's dtype.
#[test]
fn half_precision_runs_learn_where_the_backend_computes_in_them() {
    use train::backend::Backend;
    use train::precision::Precision;
    let root = scratch("dtype");
    for backend in Backend::compiled() {
        let device = backend.device().unwrap();
        for precision in [Precision::F16, Precision::Bf16] {
            let dir = root.join(format!("{backend}-{}", precision.name()));
            let mut cmd = trainer();
            cmd.args(["--backend", backend.name(), "--dtype", precision.name()])
                .args(TINY)
                .args(["--epochs", "3", "--steps-per-epoch", "50", "--out"])
                .arg(&dir);
            if !device.supports_dtype(precision.dtype()) {
                let out = run(&mut cmd);
                assert_error(
                    &out,
                    &[
                        &format!("`--dtype` (`dtype`) = {}", precision.name()),
                        &format!("the {backend} backend does not compute in"),
                        "it has f32",
                    ],
                );
                assert!(!dir.exists(), "a refused run writes nothing");
                continue;
            }
            let out = run(&mut cmd);
            assert!(out.status.success(), "{backend} {precision:?}");
            let s = summary(&dir);
            assert_eq!(s["status"], "finished");
            assert_eq!(s["dtype"], precision.name());
            let first = s["first_loss"].as_f64().unwrap();
            let last = s["final_loss"].as_f64().unwrap();
            assert!(
                last < 0.5 * first,
                "{backend} {precision:?}: {first} -> {last}"
            );
            assert!(s["token_accuracy"].as_f64().unwrap() > 0.6, "{s}");
            match precision {
                Precision::F16 => {
                    let scale = s["loss_scale"]["final_scale"].as_f64().unwrap();
                    let skipped = s["loss_scale"]["skipped_steps"].as_u64().unwrap();
                    assert!(scale >= 1.0 && skipped < 10, "{s}");
                    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
                    assert!(
                        printed.contains("computing in f16 with f32 weights"),
                        "{printed}"
                    );
                }
                _ => assert!(s["loss_scale"].is_null(), "{s}"),
            }
            let resumed = run(trainer()
                .args([
                    "--backend",
                    backend.name(),
                    "--resume",
                    "--dtype",
                    "f32",
                    "--out",
                ])
                .arg(&dir));
            assert_error(
                &resumed,
                &[&format!(
                    "--dtype \"f32\" would change the run, which was trained with \"{}\"",
                    precision.name()
                )],
            );
            let generated = run(trainer()
                .args(["--backend", backend.name(), "generate", "--out"])
                .arg(&dir)
                .arg("1 2 3 4"));
            assert!(generated.status.success(), "{backend} {precision:?}");
        }
    }
}

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
    // The default directory is the task's.
    let help = run(trainer().arg("--help"));
    assert!(String::from_utf8_lossy(&help.stdout).contains("[default: runs/<task>]"));
}

#[test]
fn a_rejected_setting_writes_nothing() {
    let dir = scratch("rejected").join("run");
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
fn config_files_and_resume_take_only_what_they_can_honour() {
    let root = scratch("config");
    let file = root.join("config.json");
    for (text, wanted) in [
        (
            r#"{"learning_rate": 0.1}"#,
            "unknown field `learning_rate` (did you mean `lr`?)",
        ),
        (
            r#"{"model": {"dropuot": 0.1}}"#,
            "`model.dropuot` (did you mean `model.dropout`?)",
        ),
        (
            r#"{"task": {"task": "Palindrome"}}"#,
            "unknown task `Palindrome`: expected copy, reverse, sort, add or text",
        ),
        (
            r#"{"batch_size": "64"}"#,
            "`batch_size` must be a whole number, 0 or more, got a string (\"64\")",
        ),
        ("[]", "a configuration must be a JSON object of fields"),
        (
            r#"{"devices": "two"}"#,
            "`devices` must be a whole number (how many) or an array of them (which), got a \
             string (\"two\")",
        ),
    ] {
        std::fs::write(&file, text).unwrap();
        let out = run(on_flex(&["--out"])
            .arg(root.join("run"))
            .arg("--config")
            .arg(&file));
        assert_error(&out, &[wanted, "config.json"]);
        assert!(
            !root.join("run").exists(),
            "{text} created the run directory"
        );
    }
    // Any subset of the fields, spelt as on the command line; flags override it.
    std::fs::write(
        &file,
        r#"{"task": {"task": "sort", "max_len": 5}, "model": "encoder-decoder"}"#,
    )
    .unwrap();
    let dir = root.join("run");
    let out = run(on_flex(&[
        "--min-len",
        "3",
        "--symbols",
        "5",
        "--d-model",
        "32",
        "--layers",
        "1",
    ])
    .args([
        "--epochs",
        "1",
        "--steps-per-epoch",
        "10",
        "--eval-examples",
        "16",
        "--out",
    ])
    .arg(&dir)
    .arg("--config")
    .arg(&file));
    assert!(out.status.success());
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["task"]["task"], "sort");
    assert_eq!(config["task"]["max_len"], 5);
    assert_eq!(config["task"]["min_len"], 3);
    assert_eq!(config["model"]["kind"], "encoder-decoder");
    // --resume with a flag that would change the run: refused, naming the flag.
    let before = checksums(&dir);
    let out = run(on_flex(&["--resume", "--d-model", "128", "--out"]).arg(&dir));
    assert_error(
        &out,
        &["--d-model 128 would change the run, which was trained with 32"],
    );
    let out = run(on_flex(&["--resume", "--out"]).arg(&dir));
    assert_error(
        &out,
        &["already finished its 1 epoch;", "--resume --epochs N"],
    );
    assert_eq!(checksums(&dir), before);
    // --epochs extends it; the extra steps train at the schedule's floor.
    let out = run(on_flex(&["--resume", "--epochs", "2", "--out"]).arg(&dir));
    assert!(out.status.success());
    let s = summary(&dir);
    assert_eq!(
        (s["steps_done"].clone(), s["status"].clone()),
        (20.into(), "finished".into())
    );
}

#[test]
fn generate_reads_the_task_grammar_strictly() {
    let root = scratch("generate");
    let dir = root.join("run");
    tiny_run(&dir, "1");
    assert_rejected(
        &dir,
        &[
            ("99 12", "input token 1 `99` is not a symbol of task copy"),
            ("1 2 x 4", "input token 3 `x`"),
            // Sinusoidal positions read up to 6 (the length test's longest); 7 is refused.
            (
                "1 2 3 4 5 0 1",
                "trained on at most 4, and its sinusoidal positions read up to 6",
            ),
            ("", "the input is empty"),
        ],
    );
    // Shorter than any training input: answered, with a warning.
    let out = run(on_flex(&["generate", "--out"]).arg(&dir).arg("1 2"));
    assert!(out.status.success());
    assert!(
        stderr(&out).contains("warning: the input has 2 symbols; this run was trained on 4 to 4")
    );
    // Addition: two operands of as many digits, of a trained length.
    let add = root.join("add");
    let flags = "--task add --min-len 2 --max-len 3 --d-model 32 --epochs 1 \
                 --steps-per-epoch 5 --eval-examples 8 --out";
    let out = run(on_flex(&flags.split_whitespace().collect::<Vec<_>>()).arg(&add));
    assert!(out.status.success());
    assert_rejected(
        &add,
        &[
            ("123+", "nothing after `+` at character 4"),
            ("1+2+3", "a second `+` at character 4"),
            ("12+345", "2 and 3 digits"),
            ("++++", "`+` at character 1: expected a digit"),
            ("12345+67890", "trained on at most 3"),
        ],
    );
    let out = run(on_flex(&["generate", "--out"]).arg(&add).arg("12 + 34"));
    assert!(out.status.success());
    let answer = String::from_utf8_lossy(&out.stdout);
    assert!(
        answer.trim().chars().all(|c| c.is_ascii_digit()),
        "{answer}"
    );
}

#[test]
fn a_task_without_a_held_out_split_is_refused_at_once() {
    let dir = scratch("split").join("run");
    let started = Instant::now();
    let out = run(on_flex(&[
        "--min-len",
        "1",
        "--max-len",
        "1",
        "--symbols",
        "2",
        "--out",
    ])
    .arg(&dir));
    assert_error(
        &out,
        &[
            "2 distinct inputs, 0 of them held out",
            "--symbols",
            "--max-len",
        ],
    );
    assert!(started.elapsed() < Duration::from_secs(60));
    assert!(!dir.exists());
}

/// Waits until `path` exists, while `child` runs.
#[cfg(unix)]
#[test]
fn ctrl_c_stops_cleanly_and_resume_continues() {
    let dir = scratch("interrupt").join("run");
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
fn the_output_is_readable_lines_when_not_a_terminal() {
    let dir = scratch("lines").join("run");
    let out = run(on_flex(TINY)
        .args([
            "--epochs",
            "2",
            "--steps-per-epoch",
            "30",
            "--log-every",
            "10",
            "--out",
        ])
        .arg(&dir));
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let steps: Vec<&str> = stdout.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(steps.len(), 6, "{stdout}");
    for word in ["epoch 1/2", "loss ", "acc ", "lr ", "tok/s", "ETA "] {
        assert!(steps[1].contains(word), "{word:?} missing: {}", steps[1]);
    }
    let epochs: Vec<&str> = stdout.lines().filter(|l| l.starts_with("epoch ")).collect();
    assert_eq!(epochs.len(), 2, "{stdout}");
    assert!(epochs[0].contains("valid loss"), "{}", epochs[0]);
    // No debug dumps, no model on stdout: the learner's summary is a file.
    assert!(!stdout.contains("Progress"), "{stdout}");
    assert!(stdout.lines().count() < 20, "{stdout}");
    let learner = std::fs::read_to_string(dir.join("learner.txt")).unwrap();
    assert!(learner.contains("Model"), "{learner}");
}

#[test]
fn a_killed_run_resumes_and_a_corrupt_checkpoint_is_named() {
    let dir = scratch("kill").join("run");
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

/// Starts the tiny configuration on flex into `dir` for `epochs` of `steps` steps, its
/// stdout piped.
#[test]
fn overwrite_decides_before_deleting_and_keeps_what_the_trainer_did_not_write() {
    let dir = scratch("overwrite").join("run");
    let quick = ["--epochs", "1", "--steps-per-epoch", "5", "--out"];
    let out = run(on_flex(TINY).args(quick).arg(&dir));
    assert!(out.status.success());
    std::fs::write(dir.join("my-notes.txt"), "n\n").unwrap();
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
    let dir = scratch("lock").join("run");
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

#[cfg(unix)]
#[test]
fn ctrl_c_during_the_final_evaluation_is_finished_by_resume() {
    use std::io::BufRead;
    let dir = scratch("eval-interrupt").join("run");
    // A hundred million held-out sequences: made a window at a time, never all at once.
    let mut child = on_flex(&tiny(&[("--eval-examples", "100000000")]))
        .args(["--epochs", "1", "--steps-per-epoch", "20", "--out"])
        .arg(&dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    for line in stdout.lines() {
        if line.unwrap().starts_with("evaluated ") {
            break;
        }
    }
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
}

#[test]
fn a_non_finite_loss_stops_the_run_at_its_step() {
    let root = scratch("diverge");
    let config = root.join("diverge.json");
    std::fs::write(&config, r#"{"weight_decay": 1e30}"#).unwrap();
    let dir = root.join("run");
    let out = run(on_flex(TINY)
        .args(["--epochs", "2", "--steps-per-epoch", "5", "--config"])
        .arg(&config)
        .arg("--out")
        .arg(&dir));
    assert_error(
        &out,
        &[
            "loss became NaN or infinite at step ",
            "of 10: training stopped",
        ],
    );
    let s = summary(&dir);
    assert_eq!(s["status"], "diverged", "{s}");
    let step = s["diverged_at_step"].as_u64().unwrap();
    assert!((1..=5).contains(&step), "{s}");
    assert!(s["last_checkpoint_epoch"].is_null(), "{s}");
    assert!(!dir.join("model.bpk").exists());
    // No answer from weights that are not finite, and no inspection.
    let out = run(on_flex(&["generate", "--out"]).arg(&dir).arg("1 2 3 4"));
    assert_error(&out, &["no model or usable checkpoint"]);
    let out = run(on_flex(&["inspect", "--out"]).arg(&dir));
    assert_error(
        &out,
        &["the run diverged", "start a new run with a lower --lr"],
    );
}

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
fn several_devices_train_resume_and_refuse_what_they_cannot() {
    let root = scratch("devices");
    let [whole, resumed] = [root.join("whole"), root.join("resumed")];
    let two = |dir: &Path| {
        let out = run(on_flex(TINY)
            .args(["--devices", "2", "--epochs", "3", "--steps-per-epoch", "40"])
            .arg("--out")
            .arg(dir));
        assert!(out.status.success());
        out
    };
    let out = two(&whole);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("on 2 workers sharing flex's one device (the CPU), 16 sequences each"),
        "{stdout}"
    );
    assert_eq!(summary(&whole)["devices"], 2);
    // Inputs of one length: two devices train as one does with the whole batch (to f32
    // rounding; `tests/devices.rs` compares the weights).
    let one = root.join("one");
    tiny_run(&one, "3");
    let [a, b] = [&one, &whole].map(|dir| summary(dir));
    let (la, lb) = (
        a["final_loss"].as_f64().unwrap(),
        b["final_loss"].as_f64().unwrap(),
    );
    assert!(
        (la - lb).abs() < 1e-4 * la,
        "final loss: one device {la}, two {lb}"
    );
    assert_eq!(a["token_accuracy"], b["token_accuracy"]);
    // A loss per device per step, and the epoch's.
    let losses = std::fs::read_to_string(whole.join("train/epoch-1/Loss.log")).unwrap();
    assert_eq!(losses.lines().count(), 2 * 40 + 1, "{losses}");
    // Killed after epoch 2's checkpoint, resumed: the same third epoch.
    two(&resumed);
    killed_after_epoch_2(&resumed);
    let out = run(on_flex(&["--resume", "--out"]).arg(&resumed));
    assert!(out.status.success());
    // The devices' losses of a step are logged in the order the devices finish.
    let steps = |dir: &PathBuf, log: &str, devices: usize| -> Vec<Vec<String>> {
        let text = std::fs::read_to_string(dir.join(log)).unwrap();
        let lines: Vec<String> = text.lines().map(str::to_string).collect();
        lines
            .chunks(devices)
            .map(|step| {
                let mut step = step.to_vec();
                step.sort();
                step
            })
            .collect()
    };
    for (log, devices) in [("train/epoch-3/Loss.log", 2), ("valid/epoch-3/Loss.log", 1)] {
        let [a, b] = [&whole, &resumed].map(|dir| steps(dir, log, devices));
        assert_eq!(a, b, "{log}");
    }
    // What cannot run is refused before anything is written.
    let before = checksums(&whole);
    for (flags, wanted) in [
        (
            &["--devices", "3"][..],
            "`--batch-size` (`batch_size`) = 32: the batch is shared among `--devices` \
             (`devices`) 3, which needs a multiple of 3",
        ),
        (
            &["--devices", "0,1"][..],
            "--devices 0,1: no device 1: flex has one device, the CPU (index 0)",
        ),
        (
            &["--devices", "2", "--dtype", "f16"][..],
            "`--dtype` (`dtype`) f16 with `--devices` (`devices`) 2: f16's loss scale",
        ),
        (
            &["--devices", "0"][..],
            "must name at least one device, got 0",
        ),
    ] {
        let out = run(on_flex(TINY)
            .args(flags)
            .args(["--overwrite", "--out"])
            .arg(&whole));
        assert_error(&out, &[wanted]);
        assert_eq!(checksums(&whole), before, "{flags:?} changed the run");
    }
    let out = run(on_flex(TINY)
        .args(["--devices", "two", "--out"])
        .arg(&whole));
    assert_eq!(out.status.code(), Some(2), "clap's error");
    assert!(stderr(&out).contains("a number of devices (`2`)"));
    let out = run(on_flex(&["--resume", "--devices", "1", "--epochs", "4", "--out"]).arg(&whole));
    assert_error(
        &out,
        &["--devices 1 would change the run, which was trained with 2"],
    );
    assert_eq!(checksums(&whole), before);
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

#[test]
fn symbols_past_the_alphabet_print_as_numbers_that_read_back() {
    let dir = scratch("symbols").join("run");
    let out = run(on_flex(&[
        "--task",
        "copy",
        "--min-len",
        "2",
        "--max-len",
        "3",
        "--symbols",
        "70",
    ])
    .args([
        "--positions",
        "learned",
        "--d-model",
        "32",
        "--epochs",
        "1",
        "--steps-per-epoch",
        "10",
        "--eval-examples",
        "8",
    ])
    .arg("--out")
    .arg(&dir));
    assert!(out.status.success());
    let out = run(on_flex(&["generate", "--out"]).arg(&dir).arg("65 3 69"));
    assert!(out.status.success());
    let answer = String::from_utf8_lossy(&out.stdout);
    assert!(
        answer
            .split_whitespace()
            .all(|w| w.parse::<usize>().is_ok_and(|n| n < 70)),
        "{answer}"
    );
}

/// With wgpu compiled in: the trainer names a software adapter (lavapipe in CI), and only
/// then.
#[cfg(feature = "wgpu")]
#[test]
fn a_software_gpu_is_named() {
    use train::backend::Backend;
    let dir = scratch("software").join("run");
    tiny_run(&dir, "1");
    let device = Backend::Wgpu.device().unwrap();
    let adapter = Backend::Wgpu.software_adapter(&device);
    let out = run(trainer()
        .args(["--backend", "wgpu", "generate", "--out"])
        .arg(&dir)
        .arg("1 2 3 4"));
    assert!(out.status.success());
    let err = stderr(&out);
    match adapter {
        Some(name) => {
            assert!(
                err.contains(&format!("runs on {name:?}, a software adapter")),
                "{err}"
            );
            assert!(err.contains("--backend flex"), "{err}");
        }
        None => assert!(!err.contains("software adapter"), "{err}"),
    }
}

#[test]
fn inspect_reports_ranks_draws_and_prunes_both_models() {
    let root = scratch("inspect");
    let missing = run(on_flex(&["inspect", "--out"]).arg(root.join("nothing")));
    assert_error(&missing, &["no run here (no config.json)"]);
    for model in ["decoder-only", "encoder-decoder"] {
        let dir = root.join(model);
        let out = run(on_flex(TINY)
            .args([
                "--model",
                model,
                "--epochs",
                "1",
                "--steps-per-epoch",
                "40",
                "--out",
            ])
            .arg(&dir));
        assert!(out.status.success());
        // One layer of two heads; the encoder-decoder has its encoder's, its decoder's
        // self- and cross-attention. Each keeps a head per layer.
        let (layers, heads, prune) = match model {
            "decoder-only" => (1, 2, "1"),
            _ => (3, 6, "1,2"),
        };
        let out =
            run(on_flex(&["inspect", "--examples", "40", "--prune", prune, "--out"]).arg(&dir));
        assert!(out.status.success(), "{}", stderr(&out));
        let text = String::from_utf8_lossy(&out.stdout);
        let header = text
            .lines()
            .position(|l| l.starts_with("layer "))
            .expect("a table");
        let rows = text
            .lines()
            .skip(header + 1)
            .take_while(|l| !l.is_empty())
            .count();
        assert_eq!(rows, heads, "a row per head:\n{text}");
        assert!(
            text.contains(&format!("{heads}. ")),
            "every head ranked:\n{text}"
        );
        assert!(
            text.contains(&format!("pruned 1 of {heads} heads")),
            "{text}"
        );

        let inspect = dir.join("inspect");
        let findings: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(inspect.join("heads.json")).unwrap())
                .unwrap();
        assert_eq!(
            findings["report"]["layers"].as_array().unwrap().len(),
            layers
        );
        let scores = findings["gradient"]["scores"].as_array().unwrap();
        assert_eq!(scores.len(), layers);
        let pruned = findings["pruned"].as_array().unwrap();
        assert_eq!(pruned.len(), prune.split(',').count());
        for (p, k) in pruned.iter().zip([1, 2]) {
            assert_eq!(p["removed"], k, "{p}");
            let accuracy = p["exact_accuracy"].as_f64().unwrap();
            assert!((0.0..=1.0).contains(&accuracy), "{p}");
            let plan = inspect.join(format!("pruned-{k}"));
            assert!(plan.join("model.bpk").exists() && plan.join("plan.json").exists());
        }
        for i in 0..layers {
            for ext in ["png", "svg"] {
                let map = inspect.join(format!("attention-{i}.{ext}"));
                assert!(
                    std::fs::metadata(&map).unwrap().len() > 1000,
                    "{}",
                    map.display()
                );
            }
        }
    }
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn flags_before_a_subcommand_are_its_own_or_refused_with_the_right_order() {
    let root = scratch("order");
    let dir = root.join("run");
    tiny_run(&dir, "1");
    // --out (and --backend) before the subcommand are the subcommand's.
    let out = run(on_flex(&["--out"]).arg(&dir).args(["generate", "1 2 3 4"]));
    assert!(out.status.success(), "{}", stderr(&out));
    let out =
        run(on_flex(&["--out"])
            .arg(&dir)
            .args(["--task", "copy", "inspect", "--examples", "8"]));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(dir.join("inspect").join("heads.json").exists());
    // Given on both sides, with the same value: one; with others: refused.
    let out = run(on_flex(&["--out"])
        .arg(&dir)
        .args(["generate", "--out"])
        .arg(&dir)
        .arg("1 2 3 4"));
    assert!(out.status.success(), "{}", stderr(&out));
    let out = run(&mut on_flex(&[
        "--task", "sort", "generate", "--task", "copy", "1 2",
    ]));
    assert_error(
        &out,
        &["`--task sort` before `generate` and `--task copy` after it differ"],
    );
    // A flag of training before a subcommand: refused, naming it and the right order.
    let out = run(on_flex(&["--epochs", "3", "--out"])
        .arg(&dir)
        .args(["generate", "1 2 3 4"]));
    assert_error(
        &out,
        &[
            "`--epochs 3` is a flag of training, which `generate` does not take",
            "train generate [OPTIONS] [INPUT]",
        ],
    );
    let out = run(on_flex(&["--resume", "inspect", "--out"]).arg(&dir));
    assert_error(&out, &["`--resume` is a flag of training", "train inspect"]);
}

/// Reads the trainer's first line of stdout, then closes the pipe while it still prints.
#[cfg(unix)]
#[test]
fn a_closed_pipe_ends_the_trainer_quietly() {
    use std::io::BufRead;
    use std::os::unix::process::ExitStatusExt;
    let dir = scratch("pipe").join("run");
    let mut child = on_flex(TINY)
        .args([
            "--epochs",
            "2",
            "--steps-per-epoch",
            "200",
            "--log-every",
            "1",
        ])
        .arg("--out")
        .arg(&dir)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.starts_with("training on flex"), "{first}");
    // The reader is dropped: the pipe is closed.
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.signal(), Some(13), "ended by SIGPIPE: {err}");
}

#[test]
fn what_would_not_fit_in_memory_is_refused_before_it_starts() {
    let root = scratch("memory");
    // A vocabulary of 100 million: the logits of one step alone are 2.6 TB.
    let big = root.join("big");
    let started = Instant::now();
    let out = run(on_flex(&["--symbols", "100000000", "--out"]).arg(&big));
    assert_error(
        &out,
        &[
            "this run needs about",
            "logits [64, 34, 100000003]",
            "this machine has available: lower --symbols, --batch-size, --max-len",
        ],
    );
    assert!(started.elapsed() < Duration::from_secs(30));
    assert!(!big.exists(), "a refused run writes nothing");
    // inspect: --examples within the held-out split (about a tenth of 6^4 inputs), and
    // not 0; its phases and the whole command say how long they took.
    let dir = root.join("run");
    tiny_run(&dir, "1");
    let out = run(on_flex(&["inspect", "--examples", "5000", "--out"]).arg(&dir));
    assert_error(
        &out,
        &[
            "--examples 5000: the run's held-out split has only",
            "ask for at most",
        ],
    );
    let out = run(on_flex(&["inspect", "--examples", "0", "--out"]).arg(&dir));
    assert_error(&out, &["--examples must be at least 1, got 0"]);
    let out = run(on_flex(&["inspect", "--examples", "16", "--out"]).arg(&dir));
    assert!(out.status.success());
    let err = stderr(&out);
    for phase in [
        "head statistics on 16 held-out examples: ",
        "importance by ablation (2 heads masked in turn): ",
        "importance by gradient: ",
        "attention maps: ",
    ] {
        assert!(err.contains(phase), "{phase:?} missing from: {err}");
    }
    assert!(
        err.trim_end()
            .lines()
            .last()
            .unwrap()
            .starts_with("inspect took "),
        "{err}"
    );
    let out = run(on_flex(&["generate", "--out"]).arg(&dir).arg("1 2 3 4"));
    assert!(
        stderr(&out).starts_with("generate took "),
        "{}",
        stderr(&out)
    );
}

#[test]
fn config_files_are_objects_and_may_name_the_task_and_the_model() {
    let root = scratch("config-shorthand");
    let file = root.join("config.json");
    std::fs::write(&file, "[]").unwrap();
    let out = run(on_flex(&["--out"])
        .arg(root.join("empty"))
        .arg("--config")
        .arg(&file));
    assert_error(&out, &["must be a JSON object of fields", "got an array"]);
    std::fs::write(&file, r#"{"task": "sort", "model": "encoder-decoder"}"#).unwrap();
    let dir = root.join("run");
    let out = run(
        on_flex(&["--min-len", "2", "--max-len", "3", "--symbols", "5"])
            .args(["--d-model", "32", "--layers", "1", "--epochs", "1"])
            .args(["--steps-per-epoch", "5", "--eval-examples", "8", "--out"])
            .arg(&dir)
            .arg("--config")
            .arg(&file),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let s = summary(&dir);
    assert_eq!(
        (s["task"].clone(), s["model"].clone()),
        ("sort".into(), "encoder-decoder".into())
    );
}

#[test]
fn messages_say_what_is_wrong_and_show_input_short() {
    let root = scratch("messages");
    let dir = root.join("run");
    tiny_run(&dir, "1");
    // A symbol out of range: the range of the symbols.
    assert_rejected(
        &dir,
        &[(
            "100",
            "input token 1 `100` is not a symbol of task copy: its symbols are 0 to 5",
        )],
    );
    // Input echoed short, its control characters escaped.
    let long = format!("\x1b[31m{}", "7".repeat(120_000));
    let out = run(on_flex(&["generate", "--out"]).arg(&dir).arg(&long));
    assert_error(&out, &["`\\u{1b}[31m777", "(119945 more characters)"]);
    assert!(stderr(&out).len() < 400 && !stderr(&out).contains('\x1b'));
    // A negative number is a value, which validation names.
    let out = run(on_flex(&["--lr", "-0.01", "--out"]).arg(root.join("lr")));
    assert_error(&out, &["`--lr` (`lr`) must be in (0, 1], got -0.01"]);
    // A file where a directory should be.
    let file = root.join("afile.txt");
    std::fs::write(&file, "notes").unwrap();
    let out = run(on_flex(&["--out"]).arg(&file));
    assert_error(&out, &["afile.txt: a file, not a directory"]);
    // --prune: at least 1, at most what leaves a head per layer; named readably.
    let out = run(on_flex(&["inspect", "--prune", "100", "--out"]).arg(&dir));
    assert_error(
        &out,
        &[
            "--prune 100: at most 1 of the model's 2 heads can be removed (one is left in each of its 1 attention layer)",
        ],
    );
    let out = run(on_flex(&["inspect", "--prune", "0", "--out"]).arg(&dir));
    assert_error(&out, &["--prune 0", "at least 1"]);
    assert!(
        !dir.join("inspect").exists(),
        "a refused inspect writes nothing"
    );
    let out = run(on_flex(&["inspect", "--examples", "8", "--prune", "1", "--out"]).arg(&dir));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("ranked by ablation:"), "{text}");
    assert!(
        text.contains("pruned 1 of 2 heads by ablation (layer 0: "),
        "{text}"
    );
    // One epoch, one layer: no "1 epochs".
    let out = run(on_flex(&["--resume", "--out"]).arg(&dir));
    assert_error(&out, &["already finished its 1 epoch;"]);
    // An unfinished run: what is missing, and how to finish it.
    std::fs::remove_file(dir.join("model.bpk")).unwrap();
    let out = run(on_flex(&["inspect", "--out"]).arg(&dir));
    assert_error(
        &out,
        &[
            "the run did not finish (no model.bpk; its last complete checkpoint is epoch 1 of 1)",
            "--resume --out",
        ],
    );
    // The help lists the backends of this build, and only those.
    let help = run(trainer().arg("--help"));
    let help = String::from_utf8_lossy(&help.stdout);
    let listed: Vec<&str> = help
        .split("--backend <BACKEND>")
        .nth(1)
        .and_then(|h| h.split("Possible values:").nth(1))
        .map(|h| h.split("\n\n").next().unwrap())
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- ")?.split(':').next())
        .collect();
    let compiled: Vec<&str> = train::backend::Backend::compiled()
        .iter()
        .map(|b| b.name())
        .collect();
    let mut sorted = compiled.clone();
    sorted.sort();
    let mut listed_sorted = listed.clone();
    listed_sorted.sort();
    assert_eq!(listed_sorted, sorted, "{help}");
}

/// A text run small enough for a test: 1 layer of width 32, windows of 16 characters.
const TINY_TEXT: &[&str] = &[
    "--task",
    "text",
    "--block-size",
    "16",
    "--d-model",
    "32",
    "--layers",
    "1",
    "--heads",
    "2",
    "--batch-size",
    "16",
];

/// The validation loss each epoch of a text run ended with, from its metric logs.
fn valid_losses(dir: &Path) -> Vec<f64> {
    (1..)
        .map_while(|epoch| {
            let log = std::fs::read_to_string(dir.join(format!("valid/epoch-{epoch}/Loss.log")));
            let log = log.ok()?;
            let last = log.lines().rev().find(|l| l.ends_with(",final"))?;
            last.trim_end_matches(",final").parse().ok()
        })
        .collect()
}

/// The text task on every backend of the build: its validation loss falls from the
/// first epoch to the second and below the uniform guess's, the summary gives it in nats
/// and bits, the run keeps its vocabulary, and `generate` samples from it: greedy at
/// temperature 0, the same text for the same seed, the prompt checked against the
/// vocabulary.
#[test]
fn the_text_task_learns_on_every_backend_and_samples() {
    use train::backend::Backend;
    let root = scratch("text");
    for backend in Backend::compiled() {
        let dir = root.join(backend.name());
        let out = run(trainer()
            .args(["--backend", backend.name()])
            .args(TINY_TEXT)
            .args(["--epochs", "2", "--steps-per-epoch", "30", "--out"])
            .arg(&dir));
        assert!(out.status.success(), "{backend}");
        let s = summary(&dir);
        assert_eq!(
            (s["status"].as_str(), s["task"].as_str()),
            (Some("finished"), Some("text"))
        );
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        let vocab = config["task"]["vocab"].as_str().unwrap().to_string();
        assert_eq!(
            vocab.chars().count(),
            73,
            "{backend}: the corpus's characters"
        );
        let uniform = (73f64).ln();
        let valid = valid_losses(&dir);
        assert_eq!(valid.len(), 2, "{backend}: {valid:?}");
        assert!(
            valid[1] < valid[0] && valid[0] < uniform - 0.3,
            "{backend}: the validation loss did not fall: {valid:?} (uniform {uniform})"
        );
        let loss = s["valid_loss"].as_f64().unwrap();
        assert_eq!(
            loss, valid[1],
            "{backend}: the summary's is the last epoch's"
        );
        let bits = s["valid_bits_per_char"].as_f64().unwrap();
        assert!((bits - loss / std::f64::consts::LN_2).abs() < 1e-9, "{s}");
        assert!(dir.join("loss.png").exists());
        let printed = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(printed.contains("nats per character"), "{printed}");

        let sample = |extra: &[&str]| {
            let out = run(trainer()
                .args(["--backend", backend.name(), "generate", "--out"])
                .arg(&dir)
                .args(["--prompt", "ROMEO:", "--tokens", "40"])
                .args(extra));
            assert!(out.status.success(), "{backend} {extra:?}");
            String::from_utf8(out.stdout).unwrap()
        };
        let greedy = sample(&["--temperature", "0", "--seed", "1"]);
        assert_eq!(
            greedy,
            sample(&["--temperature", "0", "--seed", "2"]),
            "greedy"
        );
        assert!(greedy.starts_with("ROMEO:"), "{greedy:?}");
        assert_eq!(
            greedy.trim_end_matches('\n').chars().count(),
            6 + 40,
            "{greedy:?}"
        );
        let drawn = sample(&["--seed", "7", "--top-k", "5"]);
        assert_eq!(drawn, sample(&["--seed", "7", "--top-k", "5"]), "same seed");
        assert_ne!(
            drawn,
            sample(&["--seed", "8", "--top-k", "5"]),
            "another seed"
        );
        assert!(
            drawn.chars().all(|c| vocab.contains(c) || c == '\n'),
            "{drawn:?}"
        );
        let out = run(trainer()
            .args(["--backend", backend.name(), "generate", "--out"])
            .arg(&dir)
            .args(["--prompt", "Romeo → Juliet ☺"]));
        assert_error(
            &out,
            &[
                "--prompt",
                "2 characters",
                "not in the run's vocabulary",
                "'→', '☺'",
            ],
        );
    }
}

/// `--data`: a user's text trains as the corpus does (its own vocabulary, kept by the
/// run); an empty file, a file that is not UTF-8 (the offset of the first bad byte), a
/// text too short for one block in each split and a missing file are clear errors that
/// write nothing; settings the text task cannot take are refused; a resumed text run
/// retraces the uninterrupted one, and refuses a text whose characters changed.
#[test]
fn text_from_a_file_is_checked_before_anything_is_written() {
    let root = scratch("data");
    let write = |name: &str, bytes: &[u8]| {
        let path = root.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    };
    let empty = write("empty.txt", b"");
    let latin1 = write("latin1.txt", b"na\xefve caf\xe9 ".repeat(100).as_slice());
    let short = write("short.txt", b"To be, or not to be.");
    let missing = root.join("missing.txt");
    let dir = root.join("refused");
    for (path, wanted) in [
        (&empty, vec!["empty.txt is empty: the text task needs text"]),
        (
            &latin1,
            vec!["latin1.txt is not UTF-8 text: the byte at offset 2 (0xef)"],
        ),
        (
            &short,
            vec![
                "short.txt has 20 characters: too short for a block size of 16",
                "at least",
            ],
        ),
        (&missing, vec!["cannot read", "missing.txt"]),
    ] {
        let out = run(on_flex(TINY_TEXT)
            .arg("--data")
            .arg(path)
            .arg("--out")
            .arg(&dir));
        assert_error(&out, &wanted);
        assert!(
            !dir.exists(),
            "{}: a refused run writes nothing",
            path.display()
        );
    }
    for (flags, wanted) in [
        (&["--pack"][..], "there is nothing to pack"),
        (
            &["--model", "encoder-decoder"][..],
            "the text task trains the decoder-only model",
        ),
        (
            &["--dropout", "1.5"][..],
            "`--dropout` (`model.dropout`) must be in [0, 1), got 1.5",
        ),
    ] {
        let out = run(on_flex(TINY_TEXT).args(flags).arg("--out").arg(&dir));
        assert_error(&out, &[wanted]);
        assert!(!dir.exists(), "{flags:?}: a refused run writes nothing");
    }
    for (flags, wanted) in [
        (
            &["--block-size", "0"][..],
            "`--block-size` (`task.block_size`) must be at least 1",
        ),
        (
            &["--block-size", "1000000"][..],
            "too short for a block size of 1000000",
        ),
    ] {
        let out = run(on_flex(&["--task", "text"])
            .args(flags)
            .arg("--out")
            .arg(&dir));
        assert_error(&out, &[wanted]);
        assert!(!dir.exists(), "{flags:?}: a refused run writes nothing");
    }

    // A text of its own: 26 letters, a space and a newline.
    let text: String = (0..4000)
        .map(|i: u32| match i % 37 {
            36 => '\n',
            n if n % 6 == 5 => ' ',
            n => char::from(b'a' + ((i / 37 + n) % 26) as u8),
        })
        .collect();
    let own = write("own.txt", text.as_bytes());
    let [whole, resumed] = [root.join("whole"), root.join("resumed")];
    for dir in [&whole, &resumed] {
        let out = run(on_flex(TINY_TEXT)
            .args(["--epochs", "2", "--steps-per-epoch", "10", "--data"])
            .arg(&own)
            .arg("--out")
            .arg(dir));
        assert!(out.status.success());
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(whole.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["task"]["vocab"], "\n abcdefghijklmnopqrstuvwxyz");
    // As if killed after epoch 1's checkpoint.
    std::fs::remove_dir_all(resumed.join("checkpoints/epoch-2")).unwrap();
    std::fs::remove_file(resumed.join("model.bpk")).unwrap();
    std::fs::remove_file(resumed.join("summary.json")).unwrap();
    let out = run(on_flex(&["--resume", "--out"]).arg(&resumed));
    assert!(out.status.success());
    for log in ["train/epoch-2/Loss.log", "valid/epoch-2/Loss.log"] {
        let [a, b] = [&whole, &resumed].map(|dir| std::fs::read_to_string(dir.join(log)).unwrap());
        assert!(a.lines().count() >= 3, "{log}: {a}");
        assert_eq!(a, b, "{log}");
    }
    // A config file naming the text task starts from the text task's defaults, and its
    // run goes to runs/text (the default directory follows the file's task).
    let config = write(
        "text.json",
        br#"{"task": {"task": "text", "block_size": 16}, "model": {"d_model": 32, "n_layers": 1, "n_heads": 2}, "batch_size": 16, "epochs": 1, "steps_per_epoch": 2, "valid_examples": 16}"#,
    );
    let out = run(on_flex(&["--config"]).arg(&config).current_dir(&root));
    assert!(out.status.success());
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("runs/text/config.json")).unwrap())
            .unwrap();
    assert_eq!(written["task"]["task"], "text");
    assert_eq!(
        written["model"]["positions"], "learned",
        "the text task's default"
    );
    assert_eq!(written["adam_beta2"], 0.99, "the text task's default");
    // The text changed under the run: its characters are no longer the vocabulary.
    std::fs::write(&own, text.replace('z', "Z")).unwrap();
    let before = checksums(&whole);
    let out = run(on_flex(&["--resume", "--epochs", "3", "--out"]).arg(&whole));
    assert_error(
        &out,
        &[
            "not the run's vocabulary",
            "new in the text: \"Z\"",
            "gone from the text: \"z\"",
        ],
    );
    assert_eq!(
        checksums(&whole),
        before,
        "a refused resume changes nothing"
    );
}
