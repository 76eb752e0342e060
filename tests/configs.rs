//! Configurations saved as JSON (Burn's `Config::save`) load back as they were, and a
//! file saved before a field was added loads with that field at its default.

use burn::config::Config;
use mha::optim::AdamWConfig;
use mha::{
    DecoderBlockConfig, DecoderConfig, EncoderBlockConfig, EncoderConfig, MultiHeadAttentionConfig,
    Positions,
};
use serde_json::{Map, Value};

/// The fields of `config`'s JSON.
fn fields<C: Config>(config: &C) -> Map<String, Value> {
    match serde_json::to_value(config).unwrap() {
        Value::Object(map) => map,
        other => panic!("not an object: {other}"),
    }
}

/// `config` saved, each of `defaulted` fields left out in turn (and all of them at once),
/// loads back equal to `config`; each of `required` left out is an error naming it.
fn check<C: Config>(what: &str, config: C, defaulted: &[&str], required: &[&str]) {
    let saved = fields(&config);
    let load = |map: &Map<String, Value>| {
        let json = serde_json::to_vec(map).unwrap();
        C::load_binary(&json).map(|c| fields(&c))
    };
    assert_eq!(load(&saved).unwrap(), saved, "{what}: saved and loaded");
    // Every field of the file is one of those named here.
    let mut named: Vec<&str> = [defaulted, required].concat();
    named.sort_unstable();
    let mut keys: Vec<&str> = saved.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(keys, named, "{what}: the fields");
    let mut all = saved.clone();
    for field in defaulted {
        let mut older = saved.clone();
        older.remove(*field);
        all.remove(*field);
        assert_eq!(load(&older).unwrap(), saved, "{what} without {field}");
    }
    assert_eq!(
        load(&all).unwrap(),
        saved,
        "{what} without its defaulted fields"
    );
    for field in required {
        let mut broken = saved.clone();
        broken.remove(*field);
        let err = load(&broken).map(|_| ()).unwrap_err().to_string();
        assert!(
            err.contains(&format!("missing field `{field}`")),
            "{what}: {err}"
        );
    }
}

#[test]
fn configs_saved_without_their_newer_fields_load_with_the_defaults() {
    let attention = [
        "n_kv_heads",
        "head_dim",
        "kdim",
        "vdim",
        "bias",
        "out_bias",
        "qk_norm_eps",
        "sinks",
        "quiet_softmax",
        "dropout",
        "scale",
        "softcap",
        "positions",
    ];
    check(
        "MultiHeadAttentionConfig",
        MultiHeadAttentionConfig::new(64, 4),
        &attention,
        &["d_model", "n_heads"],
    );
    let block = [
        "n_kv_heads",
        "head_dim",
        "d_ff",
        "dropout",
        "activation",
        "gated",
        "norm_first",
        "norm",
        "layer_norm_eps",
        "bias",
        "attention_bias",
        "attention_out_bias",
        "qk_norm_eps",
        "attention_sinks",
        "attention_scale",
        "attention_softcap",
        "causal",
        "positions",
    ];
    let encoder_block = [&block[..], &["window"]].concat();
    check(
        "EncoderBlockConfig",
        EncoderBlockConfig::new(16, 4),
        &encoder_block,
        &["d_model", "n_heads"],
    );
    check(
        "DecoderBlockConfig",
        DecoderBlockConfig::new(16, 4),
        &block,
        &["d_model", "n_heads"],
    );
    check(
        "EncoderConfig",
        EncoderConfig::new(EncoderBlockConfig::new(16, 4), 2),
        &["final_norm"],
        &["block", "n_layers"],
    );
    check(
        "DecoderConfig",
        DecoderConfig::new(DecoderBlockConfig::new(16, 4), 2),
        &["final_norm"],
        &["block", "n_layers"],
    );
    check(
        "AdamWConfig",
        AdamWConfig::new(),
        &["beta_1", "beta_2", "epsilon", "weight_decay"],
        &[],
    );
    // The first version's file of attention (before positions, sinks, soft caps, ...).
    let first = br#"{"d_model":64,"n_heads":4,"n_kv_heads":null,"kdim":null,"vdim":null,
        "bias":true,"dropout":0.0,"scale":null}"#;
    let loaded = MultiHeadAttentionConfig::load_binary(first).unwrap();
    assert_eq!(
        fields(&loaded),
        fields(&MultiHeadAttentionConfig::new(64, 4))
    );
}

#[test]
fn configs_load_back_the_values_they_were_saved_with() {
    // Values other than the defaults, nested configurations, enums with fields, a `null`
    // for an optional field.
    let block = EncoderBlockConfig::new(32, 8)
        .with_n_kv_heads(Some(2))
        .with_d_ff(Some(48))
        .with_dropout(0.25)
        .with_gated(true)
        .with_norm_first(false)
        .with_norm(mha::NormKind::Rms)
        .with_attention_scale(Some(1.0 / 24f64.sqrt()))
        .with_causal(true)
        .with_window(Some(5))
        .with_positions(Positions::t5(true));
    let stack = EncoderConfig::new(block, 3).with_final_norm(Some(true));
    let loaded = EncoderConfig::load_binary(stack.to_string().as_bytes()).unwrap();
    assert_eq!(fields(&loaded), fields(&stack));
    assert_eq!(loaded.block.window, Some(5));
    assert_eq!(loaded.block.d_ff, Some(48));
    assert!(loaded.block.gated && !loaded.block.norm_first);
    let attention = MultiHeadAttentionConfig::new(8, 2)
        .with_bias(false)
        .with_out_bias(Some(true))
        .with_positions(Positions::Relative { max_distance: 3 });
    let mut saved = fields(&attention);
    saved.insert("out_bias".into(), Value::Null);
    let json = serde_json::to_vec(&saved).unwrap();
    let loaded = MultiHeadAttentionConfig::load_binary(&json).unwrap();
    assert_eq!(loaded.out_bias, None);
    assert!(!loaded.bias);
    assert_eq!(fields(&loaded), saved);
}
