//! The text task: it learns on every backend and samples; a user's text is checked
//! before anything is written.

use super::*;

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
    use ::train::backend::Backend;
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
        // Given after the flags, it is named as the prompt, not as a flag never typed.
        for (prompt, wanted) in [("", "the prompt is empty"), ("☺", "the prompt: ")] {
            let out = run(trainer()
                .args(["--backend", backend.name(), "generate", "--out"])
                .arg(&dir)
                .arg(prompt));
            assert_error(&out, &[wanted]);
            assert!(!stderr(&out).contains("--prompt"), "{}", stderr(&out));
        }
    }
}

/// `--data`: a user's text trains as the corpus does (its own vocabulary, kept by the
/// run); an empty file, a file that is not UTF-8 (the offset of the first bad byte), a
/// text too short for one block in each split and a missing file are clear errors that
/// write nothing; settings the text task cannot take are refused; a resumed text run
/// retraces the uninterrupted one (resumed from another directory, a text given by a
/// relative path is still the run's), and refuses a text that changed (its characters,
/// or its order alone).
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
    // The second started in `root` with the text's relative path.
    for (dir, data) in [(&whole, own.as_path()), (&resumed, Path::new("own.txt"))] {
        let out = run(on_flex(TINY_TEXT)
            .args(["--epochs", "2", "--steps-per-epoch", "10", "--data"])
            .arg(data)
            .arg("--out")
            .arg(dir)
            .current_dir(&root));
        assert!(out.status.success());
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(whole.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["task"]["vocab"], "\n abcdefghijklmnopqrstuvwxyz");
    // As if killed after epoch 1's checkpoint.
    std::fs::remove_dir_all(resumed.join("checkpoints/epoch-2")).unwrap();
    std::fs::remove_file(resumed.join("model.bpk")).unwrap();
    std::fs::remove_file(resumed.join("summary.json")).unwrap();
    // Resumed from another directory, which holds an `own.txt` of the same characters in
    // another order: the run reads its own.
    let elsewhere = root.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    let reversed: String = text.chars().rev().collect();
    std::fs::write(elsewhere.join("own.txt"), &reversed).unwrap();
    let out = run(on_flex(&["--resume", "--out"])
        .arg(&resumed)
        .current_dir(&elsewhere));
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
    // The text changed under the run, its characters the same: not its batches.
    std::fs::write(&own, &reversed).unwrap();
    let before = checksums(&whole);
    let out = run(on_flex(&["--resume", "--epochs", "3", "--out"]).arg(&whole));
    assert_error(
        &out,
        &[
            "own.txt: it is not the text the run started on",
            "`task.text_checksum`",
        ],
    );
    assert_eq!(
        checksums(&whole),
        before,
        "a refused resume changes nothing"
    );
    // Its characters are no longer the vocabulary.
    std::fs::write(&own, text.replace('z', "Z")).unwrap();
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
