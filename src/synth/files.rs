//! The small files of an output: `config.json` (the release's keys, spec 2), the byte-level
//! tokenizer (`tiktoken.model`, `tokenizer_config.json`, spec 6) and
//! `model.safetensors.index.json`.

use std::collections::HashSet;

use base64::Engine as _;
use serde_json::{json, Map, Value};

use super::layout::ShardPlan;
use super::{SynthError, SynthOptions, ADDED_TOKENS};
use crate::checkpoint::INDEX_FILE;
use crate::rng::SplitMix64;
use crate::tokenizer::{TOKENIZER_CONFIG_FILE, VOCAB_FILE};

pub const CONFIG_FILE: &str = "config.json";
/// Salt of the tokenizer's random stream, so it is independent of the weights'.
const TOKENIZER_SALT: u64 = 0x544f_4b45_4e49_5a45;

/// The nested `config.json` for `opts`: exactly the keys of the release's config
/// (`tests/fixtures/k3-config.json`) with the chosen dims.
pub fn synth_config(opts: &SynthOptions) -> Value {
    let d = &opts.dims;
    let ranks = opts.n_ranks() as u64;
    let (mla, kda) = attention_lists(opts.layers);
    json!({
        "architectures": ["KimiK3ForConditionalGeneration"],
        "bos_token_id": ranks,
        "eos_token_id": ranks + 2,
        "model_type": "kimi_k3",
        "pad_token_id": ranks + ADDED_TOKENS as u64 - 1,
        "text_config": {
            "activation_situ_beta": 4.0,
            "activation_situ_linear_beta": 25.0,
            "attn_res_block_size": opts.attn_res_block_size,
            "first_k_dense_replace": 1,
            "hidden_act": "situ",
            "hidden_size": d.hidden_size,
            "intermediate_size": d.intermediate_size,
            "kv_lora_rank": d.kv_lora_rank,
            "latent_moe_use_norm": true,
            "linear_attn_config": {
                "full_attn_layers": mla,
                "gate_lower_bound": -5.0,
                "head_dim": d.kda_head_dim,
                "kda_layers": kda,
                "num_heads": d.kda_heads,
                "short_conv_kernel_size": 4,
                "use_full_rank_gate": true
            },
            "mla_use_nope": true,
            "mla_use_output_gate": true,
            "model_type": "kimi_linear",
            "moe_intermediate_size": d.moe_intermediate_size,
            "moe_layer_freq": 1,
            "moe_renormalize": true,
            "moe_router_activation_func": "sigmoid",
            "num_attention_heads": d.mla_heads,
            "num_expert_group": 1,
            "num_experts": opts.experts,
            "num_experts_per_token": opts.top_k,
            "num_hidden_layers": opts.layers,
            "num_shared_experts": d.n_shared_experts,
            "q_lora_rank": d.q_lora_rank,
            "qk_nope_head_dim": d.qk_nope_head_dim,
            "qk_rope_head_dim": d.qk_rope_head_dim,
            "quantization_config": quantization_config(),
            "rms_norm_eps": 1e-5,
            "routed_expert_hidden_size": d.routed_expert_hidden_size,
            "routed_scaling_factor": 1.0,
            "topk_group": 1,
            "topk_method": "noaux_tc",
            "v_head_dim": d.v_head_dim,
            "vocab_size": opts.vocab
        },
        "tie_word_embeddings": false,
        "vision_config": {}
    })
}

fn quantization_config() -> Value {
    json!({
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "dynamic": false,
                    "group_size": 32,
                    "num_bits": 4,
                    "strategy": "group",
                    "symmetric": true,
                    "type": "float"
                }
            }
        },
        "format": "mxfp4-pack-quantized",
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*"],
        "quant_method": "compressed-tensors"
    })
}

/// K3's plan as 1-based lists: MLA at every 4th layer and at the last two, KDA elsewhere.
fn attention_lists(layers: usize) -> (Vec<usize>, Vec<usize>) {
    (1..=layers).partition(|&l| l % 4 == 0 || l + 2 > layers)
}

/// Names this module may create (and so may remove when replacing an earlier output).
pub fn is_output_name(name: &str) -> bool {
    if [CONFIG_FILE, VOCAB_FILE, TOKENIZER_CONFIG_FILE, INDEX_FILE].contains(&name) {
        return true;
    }
    let Some(rest) = name.strip_prefix("model-").and_then(|r| r.strip_suffix(".safetensors")) else {
        return false;
    };
    let Some((a, b)) = rest.split_once("-of-") else { return false };
    [a, b].iter().all(|s| s.len() == 5 && s.bytes().all(|c| c.is_ascii_digit()))
}

/// (file name, contents) of every file besides the shards.
pub fn small_files(
    opts: &SynthOptions,
    config: &Value,
    shards: &[ShardPlan],
) -> Result<Vec<(String, Vec<u8>)>, SynthError> {
    let pretty = |v: &Value| -> Result<Vec<u8>, SynthError> {
        let mut v = v.clone();
        v.sort_all_objects();
        let mut text = serde_json::to_vec_pretty(&v).map_err(|e| SynthError::Internal(e.to_string()))?;
        text.push(b'\n');
        Ok(text)
    };
    let ranks = vocab_ranks(opts.n_ranks(), opts.seed)?;
    Ok(vec![
        (CONFIG_FILE.to_owned(), pretty(config)?),
        (VOCAB_FILE.to_owned(), tiktoken_text(&ranks).into_bytes()),
        (TOKENIZER_CONFIG_FILE.to_owned(), pretty(&tokenizer_config(opts.n_ranks()))?),
        (INDEX_FILE.to_owned(), pretty(&index_json(shards))?),
    ])
}

fn index_json(shards: &[ShardPlan]) -> Value {
    let mut map = Map::new();
    let mut total = 0u64;
    for s in shards {
        for t in &s.tensors {
            map.insert(t.name.clone(), Value::String(s.file_name.clone()));
            total += t.len;
        }
    }
    json!({"metadata": {"total_size": total}, "weight_map": map})
}

/// Printable ASCII: the alphabet of the extra tokens.
const PRINTABLE: std::ops::RangeInclusive<u8> = b' '..=b'~';

/// The byte strings of ranks 0..n_ranks: the 256 single bytes in a seeded order, then distinct
/// printable 2-byte tokens, then 3-byte tokens that extend a 2-byte one (so BPE can reach them).
pub fn vocab_ranks(n_ranks: usize, seed: u64) -> Result<Vec<Vec<u8>>, SynthError> {
    assert!(n_ranks >= 256, "the vocabulary must hold every byte");
    let mut rng = SplitMix64::new(seed ^ TOKENIZER_SALT);
    let mut bytes: Vec<u8> = (0..=255).collect();
    rng.shuffle(&mut bytes);
    let mut out: Vec<Vec<u8>> = bytes.into_iter().map(|b| vec![b]).collect();
    let alphabet: Vec<u8> = PRINTABLE.collect();
    let n_extra = n_ranks - 256;
    // At most half of all printable pairs, so a new pair is drawn with probability >= 1/2, and a
    // new 3-byte extension (from 95 x 4512 = 428,640 candidates for at most 257,120 needed, at
    // VOCAB_MAX) with probability > 0.4 even at the last draw.
    // At least one pair when any extra token is wanted: the 3-byte tokens extend pairs.
    let n_pairs = (n_extra / 2).clamp(n_extra.min(1), alphabet.len() * alphabet.len() / 2);
    let mut seen: HashSet<Vec<u8>> = HashSet::with_capacity(n_extra);
    let mut pairs: Vec<Vec<u8>> = Vec::with_capacity(n_pairs);
    // With every draw succeeding at > 0.4, 64 attempts per token are never needed by a correct
    // generator; the bound keeps a bug from spinning forever.
    let attempts_max = 64 * n_extra + 1024;
    let mut attempts = 0;
    while out.len() < n_ranks {
        attempts += 1;
        if attempts > attempts_max {
            return Err(SynthError::Internal(format!("could not draw {n_extra} distinct extra tokens")));
        }
        let c = alphabet[rng.index(alphabet.len())];
        let token = if pairs.len() < n_pairs {
            vec![alphabet[rng.index(alphabet.len())], c]
        } else {
            let mut t = pairs[rng.index(pairs.len())].clone();
            t.push(c);
            t
        };
        if seen.insert(token.clone()) {
            if token.len() == 2 {
                pairs.push(token.clone());
            }
            out.push(token);
        }
    }
    Ok(out)
}

fn tiktoken_text(ranks: &[Vec<u8>]) -> String {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut text = String::with_capacity(ranks.len() * 12);
    for (rank, bytes) in ranks.iter().enumerate() {
        text.push_str(&b64.encode(bytes));
        text.push(' ');
        text.push_str(&rank.to_string());
        text.push('\n');
    }
    text
}

/// Added token names as in the tiny fixture (and K3): ids R..R+255.
pub fn added_token_names(n_ranks: usize) -> Vec<(u64, String)> {
    const NAMED: [&str; 6] = ["[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"];
    (0..ADDED_TOKENS)
        .map(|offset| {
            let id = (n_ranks + offset) as u64;
            let name = NAMED.get(offset).map_or_else(|| format!("<|reserved_token_{id}|>"), |s| (*s).to_owned());
            (id, name)
        })
        .collect()
}

fn tokenizer_config(n_ranks: usize) -> Value {
    let mut added = Map::new();
    for (id, content) in added_token_names(n_ranks) {
        added.insert(
            id.to_string(),
            json!({
                "content": content,
                "lstrip": false,
                "normalized": false,
                "rstrip": false,
                "single_word": false,
                "special": true
            }),
        );
    }
    json!({
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"],
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": false,
        "eos_token": "<|end_of_msg|>",
        "model_max_length": 4096,
        "pad_token": format!("<|reserved_token_{}|>", n_ranks + ADDED_TOKENS - 1),
        "tokenizer_class": "TikTokenTokenizer"
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::HashSet;

    use super::vocab_ranks;

    #[test]
    fn every_extra_token_count_gives_distinct_ranks() {
        // One extra token once panicked: it wanted a 3-byte token but had no pair to extend.
        for n in [256, 257, 258, 259, 300, 1024, 1025] {
            let ranks = vocab_ranks(n, 7).unwrap();
            assert_eq!(ranks.len(), n);
            assert_eq!(ranks.iter().collect::<HashSet<_>>().len(), n, "{n} ranks");
        }
    }
}
