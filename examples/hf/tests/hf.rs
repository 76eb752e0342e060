//! Runs the binary on a tiny random Llama saved by transformers (`scripts/golden.py
//! hf_tiny_llama`: `config.json`, `model.safetensors`, a byte-level BPE `tokenizer.json`),
//! on every backend compiled in: the prompt's tokens and the 24 generated greedily are
//! transformers' own (`expected.json`, from its `generate`), and so is the text.

use std::path::PathBuf;
use std::process::{Command, Output};

/// The backends the binary has (its features are the test's).
const BACKENDS: &[&str] = &[
    #[cfg(feature = "flex")]
    "flex",
    #[cfg(feature = "ndarray")]
    "ndarray",
    #[cfg(feature = "wgpu")]
    "wgpu",
];

fn model_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf_tiny_llama")
}

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hf"))
        .args(args)
        .output()
        .expect("the binary runs")
}

/// `"name: 1 2 3"`'s numbers, from the line of `stdout` that starts with `name: `.
fn ids(stdout: &str, name: &str) -> Vec<u64> {
    let line = stdout
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{name}: ")))
        .unwrap_or_else(|| panic!("no {name} in\n{stdout}"));
    line.split(' ').map(|id| id.parse().unwrap()).collect()
}

#[test]
fn greedy_generation_gives_transformers_tokens_on_every_backend() {
    let dir = model_dir();
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let numbers = |key: &str| -> Vec<u64> {
        let list = expected[key].as_array().unwrap();
        list.iter().map(|v| v.as_u64().unwrap()).collect()
    };
    let prompt = expected["prompt"].as_str().unwrap();
    let text = expected["text"].as_str().unwrap();
    let tokens = expected["tokens"].as_u64().unwrap().to_string();
    let model = dir.to_str().unwrap();
    for backend in BACKENDS {
        let out = run(&[
            "--model",
            model,
            "--prompt",
            prompt,
            "--tokens",
            &tokens,
            "--backend",
            backend,
            "--ids",
        ]);
        let stdout = String::from_utf8(out.stdout).expect("UTF-8");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{backend}: {stdout}\n{stderr}");
        assert_eq!(
            ids(&stdout, "prompt ids"),
            numbers("prompt_ids"),
            "{backend}"
        );
        assert_eq!(
            ids(&stdout, "generated ids"),
            numbers("generated_ids"),
            "{backend}"
        );
        assert!(
            stdout.starts_with(&format!("{prompt}{text}\n")),
            "{backend}: {stdout:?} does not start with the prompt and {text:?}"
        );
        assert!(stderr.contains("24 generated"), "{backend}: {stderr}");
    }
}

#[test]
fn a_missing_file_or_dtype_is_named() {
    let empty = std::env::temp_dir().join(format!("hf-empty-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let out = run(&["--model", empty.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("tokenizer.json"), "{stderr}");
    std::fs::remove_dir_all(&empty).unwrap();

    let model = model_dir();
    let out = run(&["--model", model.to_str().unwrap(), "--dtype", "f8"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("--dtype f8: f32, f16 or bf16"), "{stderr}");
    #[cfg(feature = "ndarray")]
    {
        let args = ["--model", model.to_str().unwrap(), "--backend", "ndarray"];
        let out = run(&[&args[..], &["--dtype", "bf16"]].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            stderr.contains("--dtype bf16") && stderr.contains("does not compute in it"),
            "{stderr}"
        );
    }
    let out = run(&[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--model DIR is needed"), "{stderr}");
    // A path that is not UTF-8 (it panicked).
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let out = Command::new(env!("CARGO_BIN_EXE_hf"))
            .arg("--model")
            .arg(std::ffi::OsStr::from_bytes(b"/models/caf\xe9"))
            .output()
            .expect("the binary runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        let wanted = "--model: \"/models/caf\\xE9\" is not UTF-8 text";
        assert!(stderr.contains(wanted), "{wanted:?} missing from {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    // Past the context of config.json's max_position_embeddings (the prompt's tokens
    // counted), or past any count.
    let context = std::fs::read_to_string(model.join("config.json")).unwrap();
    let context: serde_json::Value = serde_json::from_str(&context).unwrap();
    let context = context["max_position_embeddings"].as_u64().unwrap();
    for tokens in [context.to_string(), usize::MAX.to_string()] {
        let args = ["--model", model.to_str().unwrap(), "--tokens", &tokens];
        let out = run(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains(&format!("--tokens {tokens}: with the prompt's "))
                && stderr.contains(&format!(
                    "past the model's context of {context} positions (max_position_embeddings \
                     in config.json)"
                )),
            "{stderr}"
        );
    }
}

#[test]
fn a_model_of_another_family_is_refused_before_it_loads() {
    // GPT-2's config.json (model_type gpt2) beside the tiny Llama's tokenizer.
    let dir = std::env::temp_dir().join(format!("hf-gpt2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fixtures = model_dir().join("..");
    std::fs::copy(fixtures.join("gpt2_lm.json"), dir.join("config.json")).unwrap();
    std::fs::copy(
        model_dir().join("tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    let out = run(&["--model", dir.to_str().unwrap(), "--backend", BACKENDS[0]]);
    std::fs::remove_dir_all(&dir).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains(
            "config.json: model_type `gpt2`: this example generates with llama, mistral, \
             qwen2, qwen3 models; GPT-2 loads in the library (mha::hf::load_gpt2_lm)"
        ),
        "{stderr}"
    );
}

/// Flags are read in order, each value the argument after its flag: a prompt may be
/// "--ids" (that flag was taken out wherever it stood, and the prompt left without a
/// value); a flag given twice is refused by name.
#[test]
fn flags_are_read_in_order() {
    let model = model_dir();
    let model = model.to_str().unwrap();
    let out = run(&["--model", model, "--tokens", "1", "--prompt", "--ids"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.starts_with("--ids"), "{stdout}");
    assert!(!stdout.contains("prompt ids:"), "{stdout}");
    for repeated in [&["--ids", "--ids"][..], &["--tokens", "1", "--tokens", "2"]] {
        let out = run(&[&["--model", model][..], repeated].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        let flag = repeated[0];
        assert!(
            stderr.contains(&format!("unknown or repeated flag {flag}")),
            "{stderr}"
        );
    }
    let out = run(&["--model", model, "--prompt"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--prompt needs a value"), "{stderr}");
}
