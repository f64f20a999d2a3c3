//! The strict config reader: both shapes accepted, every refusal named (issue 2, section 2).

use std::path::Path;

use k3ring::config::{AttnKind, Config, ConfigError, FfnKind};
use serde_json::{json, Value};

/// The released K3 config (spec section 2), nested shape.
pub fn k3_config() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/k3-config.json");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// The same config with every key at the root.
fn flatten(nested: &Value) -> Value {
    let mut flat = serde_json::Map::new();
    let root = nested.as_object().unwrap();
    for (k, v) in root {
        if k != "text_config" {
            flat.insert(k.clone(), v.clone());
        }
    }
    for (k, v) in root["text_config"].as_object().unwrap() {
        if k == "linear_attn_config" {
            for (lk, lv) in v.as_object().unwrap() {
                flat.insert(lk.clone(), lv.clone());
            }
        } else {
            flat.insert(k.clone(), v.clone());
        }
    }
    Value::Object(flat)
}

fn parse(v: &Value) -> Result<Config, ConfigError> {
    Config::from_json_str(&v.to_string(), Path::new("config.json"))
}

fn text_mut(v: &mut Value) -> &mut serde_json::Map<String, Value> {
    v["text_config"].as_object_mut().unwrap()
}

fn refusal(v: &Value) -> String {
    match parse(v) {
        Ok(_) => panic!("config was accepted"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn k3_nested_config_gives_the_release_plan() {
    let cfg = parse(&k3_config()).unwrap();
    assert_eq!(cfg.n_layers, 93);
    let map = cfg.layer_map();
    assert_eq!(&map[..8], "KKKMKKKM");
    assert!(map.ends_with("MM"), "the last two layers are MLA: {map}");
    assert_eq!(map.matches('M').count(), 24);
    assert_eq!(cfg.layers[0].ffn, FfnKind::Dense);
    assert!(cfg.layers[1..].iter().all(|l| l.ffn == FfnKind::Moe));
    assert_eq!(cfg.block_starts(), vec![0, 12, 24, 36, 48, 60, 72, 84]);
    assert_eq!(cfg.expert_bytes(), 17_547_264);
    assert_eq!(cfg.mla.cache_width(), 576);
    assert_eq!(cfg.mxfp4_group_size, 32);
    assert_eq!(cfg.situ_linear_beta, Some(25.0));
    assert_eq!(cfg.layers[92].attn, AttnKind::Mla);
}

#[test]
fn flat_config_equals_nested() {
    let nested = parse(&k3_config()).unwrap();
    let flat = parse(&flatten(&k3_config())).unwrap();
    assert_eq!(nested, flat);
}

#[test]
fn missing_keys_are_listed_together() {
    let mut v = k3_config();
    text_mut(&mut v).remove("hidden_size");
    text_mut(&mut v).remove("num_experts");
    v["text_config"]["linear_attn_config"].as_object_mut().unwrap().remove("head_dim");
    v.as_object_mut().unwrap().remove("bos_token_id");
    let msg = refusal(&v);
    for key in [
        "text_config.hidden_size is missing",
        "text_config.num_experts is missing",
        "text_config.linear_attn_config.head_dim is missing",
        "bos_token_id is missing",
    ] {
        assert!(msg.contains(key), "{key:?} not in {msg}");
    }
}

#[test]
fn ill_typed_keys_are_named_with_the_value() {
    let mut v = k3_config();
    text_mut(&mut v).insert("num_experts".into(), json!("896"));
    text_mut(&mut v).insert("rms_norm_eps".into(), json!(null));
    let msg = refusal(&v);
    assert!(msg.contains("text_config.num_experts must be a non-negative integer, found \"896\""), "{msg}");
    assert!(msg.contains("text_config.rms_norm_eps must be a finite number (within f32 range), found null"), "{msg}");
}

#[test]
fn zero_based_layer_index_is_refused() {
    let mut v = k3_config();
    v["text_config"]["linear_attn_config"]["kda_layers"][0] = json!(0);
    let msg = refusal(&v);
    assert!(msg.contains("kda_layers holds 0, outside 1..=93 (the lists are 1-based)"), "{msg}");
}

#[test]
fn out_of_range_layer_index_is_refused() {
    let mut v = k3_config();
    v["text_config"]["linear_attn_config"]["full_attn_layers"][23] = json!(94);
    let msg = refusal(&v);
    assert!(msg.contains("full_attn_layers holds 94, outside 1..=93"), "{msg}");
}

#[test]
fn layer_in_both_or_neither_list_is_refused() {
    let mut v = k3_config();
    v["text_config"]["linear_attn_config"]["kda_layers"][0] = json!(4);
    let msg = refusal(&v);
    assert!(msg.contains("layer 4 (1-based) appears twice"), "{msg}");
    let mut v = k3_config();
    v["text_config"]["linear_attn_config"]["kda_layers"].as_array_mut().unwrap().remove(0);
    let msg = refusal(&v);
    assert!(msg.contains("layer 1 (1-based) is in neither"), "{msg}");
}

#[test]
fn topk_above_experts_is_refused() {
    let mut v = k3_config();
    text_mut(&mut v).insert("num_experts_per_token".into(), json!(897));
    let msg = refusal(&v);
    assert!(msg.contains("num_experts_per_token 897 exceeds num_experts 896"), "{msg}");
}

#[test]
fn bad_group_size_is_refused() {
    let mut v = k3_config();
    v["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = json!(48);
    assert!(refusal(&v).contains("group_size is 48"));
    let mut v = k3_config();
    text_mut(&mut v).insert("moe_intermediate_size".into(), json!(3000));
    let msg = refusal(&v);
    assert!(msg.contains("does not divide the contraction width moe_intermediate_size = 3000"), "{msg}");
}

#[test]
fn unsupported_variants_are_refused_by_name() {
    for (key, value, needle) in [
        ("hidden_act", json!("silu"), "hidden_act is \"silu\""),
        ("mla_use_nope", json!(false), "mla_use_nope is false"),
        ("num_expert_group", json!(8), "num_expert_group 8"),
    ] {
        let mut v = k3_config();
        text_mut(&mut v).insert(key.into(), value);
        let msg = refusal(&v);
        assert!(msg.contains("unsupported model variant") && msg.contains(needle), "{msg}");
    }
}

#[test]
fn head_dims_must_be_positive() {
    let mut v = k3_config();
    text_mut(&mut v).insert("v_head_dim".into(), json!(0));
    assert!(refusal(&v).contains("v_head_dim must be positive"));
}

#[test]
fn bos_outside_vocab_is_refused() {
    let mut v = k3_config();
    v["bos_token_id"] = json!(200000);
    assert!(refusal(&v).contains("bos_token_id 200000 is outside the vocabulary"));
}

#[test]
fn numbers_beyond_f32_and_non_positive_scaling_are_refused() {
    // 1e100 is a finite f64 but an infinite f32: once a panic in the SiTU kernel, or all-zero
    // tokens from an infinite epsilon.
    for key in ["activation_situ_beta", "activation_situ_linear_beta", "rms_norm_eps", "routed_scaling_factor"] {
        let mut v = k3_config();
        text_mut(&mut v).insert(key.into(), json!(1e100));
        let msg = refusal(&v);
        assert!(msg.contains(&format!("text_config.{key} must be a finite number (within f32 range)")), "{msg}");
    }
    for factor in [0.0, -2.5] {
        let mut v = k3_config();
        text_mut(&mut v).insert("routed_scaling_factor".into(), json!(factor));
        let msg = refusal(&v);
        assert!(msg.contains("routed_scaling_factor") && msg.contains("must be positive"), "{msg}");
    }
}

#[test]
fn null_linear_beta_means_uncapped() {
    let mut v = k3_config();
    text_mut(&mut v).insert("activation_situ_linear_beta".into(), json!(null));
    assert_eq!(parse(&v).unwrap().situ_linear_beta, None);
}
