//! The config reader's tests.
#![allow(clippy::unwrap_used)]

use super::*;

#[test]
fn layer_map_letters() {
    let raw = RawConfig {
        num_hidden_layers: 3,
        full_attn_layers: vec![3],
        kda_layers: vec![1, 2],
        first_k_dense_replace: 1,
        moe_layer_freq: 1,
        attn_res_block_size: 2,
        ..test_raw()
    };
    let plan = layer_plan(&raw).unwrap();
    assert_eq!(plan[0].ffn, FfnKind::Dense);
    assert_eq!(plan[1].ffn, FfnKind::Moe);
    assert_eq!(plan[2].attn, AttnKind::Mla);
    assert!(plan[0].block_start && !plan[1].block_start && plan[2].block_start);
}

fn test_raw() -> RawConfig {
    RawConfig {
        bos_token_id: 0,
        eos_token_id: 1,
        pad_token_id: None,
        tie_word_embeddings: false,
        vocab_size: 10,
        hidden_size: 8,
        num_hidden_layers: 1,
        intermediate_size: 8,
        hidden_act: "situ".into(),
        activation_situ_beta: 4.0,
        activation_situ_linear_beta: Some(25.0),
        rms_norm_eps: 1e-5,
        num_attention_heads: 1,
        q_lora_rank: 4,
        kv_lora_rank: 4,
        qk_nope_head_dim: 2,
        qk_rope_head_dim: 2,
        v_head_dim: 2,
        mla_use_nope: true,
        mla_use_output_gate: true,
        num_experts: 2,
        num_experts_per_token: 1,
        num_shared_experts: 1,
        moe_intermediate_size: 32,
        routed_expert_hidden_size: 32,
        latent_moe_use_norm: true,
        moe_renormalize: true,
        moe_router_activation_func: "sigmoid".into(),
        routed_scaling_factor: 1.0,
        num_expert_group: 1,
        topk_group: 1,
        first_k_dense_replace: 1,
        moe_layer_freq: 1,
        attn_res_block_size: 1,
        kda_num_heads: 1,
        kda_head_dim: 2,
        short_conv_kernel_size: 4,
        gate_lower_bound: -5.0,
        use_full_rank_gate: true,
        full_attn_layers: vec![1],
        kda_layers: vec![],
        quant_format: "mxfp4-pack-quantized".into(),
        group_size: 32,
        context_length: None,
    }
}

#[test]
fn context_length_comes_from_config_then_tokenizer_config() {
    let tmp = tempfile::tempdir().unwrap();
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-k3");
    let text = std::fs::read_to_string(tiny.join("config.json")).unwrap();
    std::fs::write(tmp.path().join("config.json"), &text).unwrap();
    assert_eq!(Config::from_model_dir(tmp.path()).unwrap().context_length, None, "stated nowhere");
    std::fs::write(tmp.path().join("tokenizer_config.json"), r#"{"model_max_length": 1e30}"#).unwrap();
    assert_eq!(Config::from_model_dir(tmp.path()).unwrap().context_length, None, "the unset placeholder");
    std::fs::copy(tiny.join("tokenizer_config.json"), tmp.path().join("tokenizer_config.json")).unwrap();
    let ctx = Config::from_model_dir(tmp.path()).unwrap().context_length.unwrap();
    assert_eq!((ctx.positions, ctx.source.as_str()), (4096, "model_max_length in tokenizer_config.json"));

    let mut v: Value = serde_json::from_str(&text).unwrap();
    v["text_config"]["max_position_embeddings"] = 262144.into();
    std::fs::write(tmp.path().join("config.json"), v.to_string()).unwrap();
    let ctx = Config::from_model_dir(tmp.path()).unwrap().context_length.unwrap();
    assert_eq!(ctx.positions, 262144, "config.json wins over tokenizer_config.json");
    assert_eq!(ctx.source, "text_config.max_position_embeddings in config.json");

    v["text_config"]["max_position_embeddings"] = (-5).into();
    let err = Config::from_json_str(&v.to_string(), Path::new("config.json")).unwrap_err().to_string();
    assert!(err.contains("text_config.max_position_embeddings must be a positive integer"), "{err}");
}

#[test]
fn read_failures_exit_4_and_refusals_exit_2() {
    let missing = Config::from_model_dir(Path::new("/nonexistent/k3ring-model")).unwrap_err();
    assert!(matches!(missing, ConfigError::Read { .. }), "{missing}");
    assert_eq!(missing.exit_code(), ExitCode::Io);

    let path = Path::new("config.json");
    let not_json = Config::from_json_str("{ not json", path).unwrap_err();
    assert!(matches!(not_json, ConfigError::Json { .. }), "{not_json}");
    assert_eq!(not_json.exit_code(), ExitCode::Usage);

    let keys = Config::from_json_str("{}", path).unwrap_err();
    assert_eq!(keys.exit_code(), ExitCode::Usage, "{keys}");

    let invalid = ConfigError::Invalid { path: path.into(), message: "top-k above the expert count".into() };
    assert_eq!(invalid.exit_code(), ExitCode::Usage);
    let unsupported = ConfigError::Unsupported { path: path.into(), message: "bf16 experts".into() };
    assert_eq!(unsupported.exit_code(), ExitCode::Usage);
}
