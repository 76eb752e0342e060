//! Flags and config files: what each command takes, in which order, and the messages
//! that refuse the rest.

use super::*;

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
    let compiled: Vec<&str> = ::train::backend::Backend::compiled()
        .iter()
        .map(|b| b.name())
        .collect();
    let mut sorted = compiled.clone();
    sorted.sort();
    let mut listed_sorted = listed.clone();
    listed_sorted.sort();
    assert_eq!(listed_sorted, sorted, "{help}");
    // The defaults it shows are the synthetic tasks', then the text task's where they
    // differ (it showed the synthetic ones alone).
    use ::train::config::TrainConfig;
    let (synthetic, text) = (
        TrainConfig::default(),
        TrainConfig::defaults(::train::tasks::Task::Text),
    );
    for wanted in [
        format!("[default: {}; text: {}]", synthetic.lr, text.lr),
        format!(
            "[default: {}; text: {}]",
            synthetic.batch_size, text.batch_size
        ),
        format!(
            "[default: {}; text: {}]",
            synthetic.model.d_model, text.model.d_model
        ),
        {
            use ::train::tasks::Task;
            let most = |task: Task| task.kind().most_warmup();
            let (synthetic, text) = (most(Task::Reverse), most(Task::Text));
            format!("at most {synthetic}; text: at most {text}]")
        },
    ] {
        assert!(help.contains(&wanted), "{wanted:?} missing from {help}");
    }
}
