//! `train`: what a run learns and writes, on one device or several, in each precision;
//! what it prints; what it refuses before it starts.

use super::*;

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
fn a_task_with_no_held_out_input_at_longer_lengths_leaves_that_test_out() {
    // Inputs of one symbol out of 3: one held out. Of two symbols (the length test's): 9
    // inputs, none held out by the hash.
    let root = scratch("no-longer");
    let dir = root.join("run");
    let small = tiny(&[("--symbols", "3"), ("--min-len", "1"), ("--max-len", "1")]);
    let out = run(on_flex(&small)
        .args(["--epochs", "1", "--steps-per-epoch", "5", "--out"])
        .arg(&dir));
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains(
            "inputs of 2 to 2 symbols have no held-out input: the test at longer inputs is left \
             out"
        ),
        "{err}"
    );
    let s = summary(&dir);
    assert_eq!(s["status"], "finished", "{s}");
    assert!(s["exact_accuracy"].is_number(), "{s}");
    assert!(s["longer_lengths"].is_null(), "{s}");
    // Evaluated again on resuming, the same.
    let out = run(on_flex(&["--resume", "--eval-examples", "32", "--out"]).arg(&dir));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(summary(&dir)["longer_lengths"].is_null());
}

#[test]
fn a_short_run_on_the_best_backend_learns_and_writes_its_files() {
    let root = scratch("short");
    let dir = root.join("run");
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
    // The last two epochs' checkpoints are kept, and only they (their folders whole).
    let mut kept: Vec<String> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    kept.sort();
    assert_eq!(kept, ["epoch-2", "epoch-3"]);
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
    use ::train::backend::Backend;
    use ::train::precision::Precision;
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
fn a_task_without_a_held_out_split_is_refused_at_once() {
    let root = scratch("split");
    let dir = root.join("run");
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

#[test]
fn the_output_is_readable_lines_when_not_a_terminal() {
    let root = scratch("lines");
    let dir = root.join("run");
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
fn warmup_0_trains_its_first_step_at_the_peak_learning_rate() {
    let root = scratch("warmup-0");
    let first_lr = |warmup: &str| {
        let dir = root.join(warmup);
        let out = run(on_flex(TINY)
            .args([
                "--epochs",
                "1",
                "--steps-per-epoch",
                "4",
                "--log-every",
                "1",
            ])
            .args(["--lr", "0.002", "--warmup", warmup, "--out"])
            .arg(&dir));
        assert!(out.status.success(), "{}", stderr(&out));
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let line = stdout
            .lines()
            .find(|l| l.starts_with("step 1/"))
            .unwrap_or_default();
        let lr = line
            .split("lr ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next());
        lr.unwrap_or_else(|| panic!("no learning rate in {stdout}"))
            .to_string()
    };
    assert_eq!(first_lr("0"), "2.00e-3");
    // One step of warmup starts at lr/100.
    assert_eq!(first_lr("1"), "2.00e-5");
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
    // Nor a resume: the same settings would diverge again.
    let out = run(on_flex(&["--resume", "--out"]).arg(&dir));
    assert_error(
        &out,
        &[
            "the run diverged",
            "--resume would train it again with the same settings",
        ],
    );
    assert_eq!(summary(&dir)["status"], "diverged");
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

/// With wgpu compiled in: the trainer names a software adapter (lavapipe in CI), and only
/// then.
#[cfg(feature = "wgpu")]
#[test]
fn a_software_gpu_is_named() {
    use ::train::backend::Backend;
    let root = scratch("software");
    let dir = root.join("run");
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

/// Reads the trainer's first line of stdout, then closes the pipe while it still prints.
#[cfg(unix)]
#[test]
fn a_closed_pipe_ends_the_trainer_quietly() {
    use std::io::BufRead;
    use std::os::unix::process::ExitStatusExt;
    let root = scratch("pipe");
    let dir = root.join("run");
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
