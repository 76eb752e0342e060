//! `inspect`: head statistics, ablation ranks, pictures and pruning, on both models.

use super::*;

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
