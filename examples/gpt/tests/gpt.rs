//! Runs the binary at a tiny size for a few dozen steps, on every backend compiled in: the
//! validation loss falls well below the untrained model's, and the sample has the
//! requested length, in characters of the text.

use std::process::Command;

/// The backends the binary has (its features are the test's).
const BACKENDS: &[&str] = &[
    #[cfg(feature = "flex")]
    "flex",
    #[cfg(feature = "ndarray")]
    "ndarray",
    #[cfg(feature = "wgpu")]
    "wgpu",
];

/// A tiny model, a short run: the flags, split at the spaces.
const TINY: &str = "--steps 60 --batch 16 --block 32 --d-model 32 --layers 2 --heads 2 --lr 0.01 \
                    --eval-every 30 --valid-windows 128 --log-every 10 --sample 200 --prompt ROMEO:";

#[test]
fn a_tiny_gpt_learns_and_samples() {
    let text = include_str!("../../train/data/shakespeare.txt");
    for backend in BACKENDS {
        let out = Command::new(env!("CARGO_BIN_EXE_gpt"))
            .args(TINY.split_whitespace())
            .args(["--backend", backend])
            .output()
            .expect("the binary runs");
        let stdout = String::from_utf8(out.stdout).expect("UTF-8");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{backend}: {stdout}\n{stderr}");

        // "step    30  validation loss 3.1440 (4.536 bits)", at steps 0, 30 and 60.
        let losses: Vec<f64> = stdout
            .lines()
            .filter_map(|line| line.split("validation loss ").nth(1))
            .map(|rest| rest.split(' ').next().unwrap().parse().unwrap())
            .collect();
        assert_eq!(losses.len(), 3, "{backend}: {stdout}");
        let (first, last) = (losses[0], losses[2]);
        // Untrained: about ln 73 = 4.29 (the logits are small). After 60 steps, about 3.1
        // (the frequencies of the characters alone give 3.25): 0.9 nats lower at least.
        assert!((first - 73f64.ln()).abs() < 0.3, "{backend}: {stdout}");
        assert!(last < first - 0.9, "{backend}: {first} -> {last}\n{stdout}");

        // The sample: the prompt, then 200 characters of the text's, on the last lines.
        let (_, sample) = stdout
            .split_once("sample of 200 characters (temperature 0.8, top-k 200):\n")
            .unwrap_or_else(|| panic!("{backend}: no sample in\n{stdout}"));
        let sample = sample.strip_prefix("ROMEO:").expect("the prompt first");
        let sample = sample.strip_suffix('\n').expect("a line");
        assert_eq!(sample.chars().count(), 200, "{backend}: {sample:?}");
        assert!(sample.chars().all(|c| text.contains(c)), "{sample:?}");
    }
}

#[test]
fn bad_flags_are_refused_by_name_before_any_training() {
    // The text's validation part (its last 10%) and its distinct characters.
    let text = include_str!("../../train/data/shakespeare.txt");
    let n = text.chars().count();
    let most = n - (9 * n + 5) / 10 - 1;
    let mut chars: Vec<char> = text.chars().collect();
    chars.sort_unstable();
    chars.dedup();
    let block = format!(
        "--block {}: at most {most} (the validation part's)",
        most + 1
    );
    let prompt = format!(
        "--prompt \"ROMEOΩ\": 'Ω' is not among the text's {} characters",
        chars.len()
    );
    let (too_long, flag) = (format!("--block {}", most + 1), "--prompt ROMEOΩ");
    let cases: [(&str, &str); 8] = [
        ("--steps 0", "--steps must be at least 1, got 0"),
        ("--heads 0", "--heads must be at least 1, got 0"),
        (
            "--d-model 100 --heads 3",
            "--d-model 100 is not divisible by --heads 3",
        ),
        ("--lr NaN", "--lr must be in (0, 1], got NaN"),
        ("--lr 2", "--lr must be in (0, 1], got 2"),
        (
            "--temperature -1",
            "--temperature must be 0 (greedy) or positive, got -1",
        ),
        (&too_long, &block),
        (flag, &prompt),
    ];
    for (flags, wanted) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_gpt"))
            .args(flags.split_whitespace())
            .output()
            .expect("the binary runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{flags}: {stderr}");
        assert!(
            stderr.contains(wanted),
            "{flags}: {wanted:?} missing from {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{flags}: {stderr}");
        assert!(
            !stdout.contains("parameters"),
            "{flags}: a model was built\n{stdout}"
        );
    }
    // An argument that is not UTF-8 (it panicked).
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let out = Command::new(env!("CARGO_BIN_EXE_gpt"))
            .arg("--prompt")
            .arg(std::ffi::OsStr::from_bytes(b"RO\xffMEO"))
            .output()
            .expect("the binary runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        let wanted = "--prompt: \"RO\\xFFMEO\" is not UTF-8 text";
        assert!(stderr.contains(wanted), "{wanted:?} missing from {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}
