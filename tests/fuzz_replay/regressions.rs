//! Regression tests of the parser bugs found while fuzzing, under the replay's allocation cap
//! (an allocation above 64 MiB aborts the binary): each input once crashed, over-allocated or was
//! accepted wrongly, and must now be refused with a clear error carrying the documented exit code
//! (3 for data files, 2 for the config). docs/FUZZING.md lists them.

use std::path::Path;

use k3ring::checkpoint::safetensors::serialize;
use k3ring::checkpoint::{CheckpointIndex, EXPERT_PARTS};
use k3ring::config::Config;
use k3ring::exit::{Classify, ExitCode};
use k3ring::storage::pack::{Manifest, PackError};
use k3ring::tokenizer::{parse_added, parse_vocab};
use serde_json::{json, Value};

use crate::targets;

fn expert_name(layer: &str, expert: &str, part: &str) -> String {
    format!("language_model.model.layers.{layer}.block_sparse_moe.experts.{expert}.{part}")
}

fn one_shard(tensors: &[(String, &str, Vec<u64>, Vec<u8>)]) -> Vec<u8> {
    let refs: Vec<(&str, &str, &[u64], &[u8])> =
        tensors.iter().map(|(n, d, s, b)| (n.as_str(), *d, s.as_slice(), b.as_slice())).collect();
    serialize(&refs)
}

fn index_of(shard: &[u8]) -> Result<CheckpointIndex, k3ring::checkpoint::CheckpointError> {
    CheckpointIndex::from_memory(Path::new("/m"), None, &[("model.safetensors", shard)])
}

/// Expert tables were dense up to the largest id a name gave: one tensor naming expert 1048575
/// sized a 96 MiB table, and one per layer of 4096 layers asked for 384 GiB.
#[test]
fn expert_ids_far_apart_cost_only_what_the_header_holds() {
    let mut tensors = Vec::new();
    for layer in 0..64 {
        for part in EXPERT_PARTS {
            tensors.push((expert_name(&(layer * 63).to_string(), "1048575", part.suffix()), "U8", vec![1], vec![0]));
        }
    }
    let index = index_of(&one_shard(&tensors)).unwrap();
    assert_eq!(index.experts.len(), 64);
    let r = index.experts.get(63 * 63, 1_048_575).expect("the last layer's expert");
    assert_eq!((r.layer, r.expert), (63 * 63, 1_048_575));
    assert!(index.experts.get(63 * 63, 0).is_none() && index.experts.get(1, 1_048_575).is_none());

    let lone = [(expert_name("4095", "1048575", "w1.weight_packed"), "U8", vec![1], vec![0])];
    let e = index_of(&one_shard(&lone)).unwrap_err();
    assert_eq!(e.exit_code(), ExitCode::Data);
    assert!(e.to_string().contains("experts.1048575.w1.weight_scale: missing"), "{e}");
}

/// `experts.7` and `experts.07` parse to one id: one of them used to win silently.
#[test]
fn two_names_for_one_expert_tensor_are_refused() {
    let mut tensors: Vec<_> =
        EXPERT_PARTS.iter().map(|p| (expert_name("1", "7", p.suffix()), "U8", vec![1], vec![0])).collect();
    tensors.push((expert_name("1", "07", "w2.weight_scale"), "U8", vec![1], vec![0]));
    let e = index_of(&one_shard(&tensors)).unwrap_err();
    assert_eq!(e.exit_code(), ExitCode::Data);
    assert!(e.to_string().contains("names the same expert tensor as"), "{e}");
}

fn tiny_config() -> Value {
    let text = std::fs::read(Path::new(crate::TINY_MODEL).join("config.json")).unwrap();
    serde_json::from_slice(&text).unwrap()
}

fn config_error(v: &Value) -> k3ring::config::ConfigError {
    Config::from_json_bytes(v.to_string().as_bytes(), Path::new("config.json")).unwrap_err()
}

/// The layer plan was sized by `num_hidden_layers` before the layer lists were checked: 10^12
/// layers asked for a terabyte.
#[test]
fn a_trillion_layers_are_refused_without_allocating() {
    let mut v = tiny_config();
    v["text_config"]["num_hidden_layers"] = json!(1_000_000_000_000u64);
    let e = config_error(&v);
    assert_eq!(e.exit_code(), ExitCode::Usage);
    // Refused by the size bound before the layer lists are walked.
    assert!(e.to_string().contains("num_hidden_layers is 1000000000000, above the largest this engine accepts"), "{e}");
    v["text_config"]["num_hidden_layers"] = json!(u64::MAX);
    assert_eq!(config_error(&v).exit_code(), ExitCode::Usage);
}

/// A config that is not UTF-8 was an I/O failure (exit 4); it is a config that is not JSON.
#[test]
fn a_config_that_is_not_utf8_exits_2() {
    let mut bytes = tiny_config().to_string().into_bytes();
    bytes.insert(1, 0xff);
    let e = Config::from_json_bytes(&bytes, Path::new("config.json")).unwrap_err();
    assert_eq!(e.exit_code(), ExitCode::Usage);
    assert!(e.to_string().starts_with("config.json is not valid JSON"), "{e}");
}

/// One line's rank sized the rank table: `YQ== 16777215` alone asked for 16M slots (400 MB).
#[test]
fn a_rank_beyond_the_entries_is_refused_before_sizing_the_table() {
    let e = parse_vocab("YQ== 16777215\n", Path::new("tiktoken.model")).unwrap_err();
    assert_eq!(e.exit_code(), ExitCode::Data);
    assert_eq!(e.to_string(), "tiktoken.model:1: rank 16777215 is not below the 1 entries: ranks must be 0..n");
}

/// `"300"` and `"0300"` are one added id: the later one used to replace the earlier silently.
#[test]
fn an_added_id_given_twice_is_refused() {
    let text = r#"{"added_tokens_decoder": {"300": {"content": "[BOS]"}, "0300": {"content": "[EOS]"}}}"#;
    let e = parse_added(text, Path::new("tokenizer_config.json"), 256).unwrap_err();
    assert_eq!(e.exit_code(), ExitCode::Data);
    assert!(e.to_string().contains("added token id 300 is given twice"), "{e}");
}

fn manifest_seed() -> Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_corpus/pack_manifest/tiny");
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn parse_manifest(v: &Value) -> Result<Manifest, PackError> {
    let pack = Path::new("trunk.pack");
    Manifest::parse(v.to_string().as_bytes(), Path::new("trunk.manifest.json"), pack, || Ok(targets::PACK_LEN))
}

/// `offset + len` of a unit or a tensor wrapped around: a unit at 2^64 - 4096 was accepted (with
/// overflow checks, a panic).
#[test]
fn unit_and_tensor_ranges_that_wrap_are_refused() {
    let mut v = manifest_seed();
    assert!(parse_manifest(&v).is_ok());
    let last = v["units"].as_array().unwrap().len() - 1;
    v["units"][last]["offset"] = json!(u64::MAX - 4095);
    v["units"][last]["len"] = json!(8192);
    let e = parse_manifest(&v).unwrap_err();
    assert_eq!(e.exit_code(), ExitCode::Data);
    assert!(e.to_string().contains("ends past the pack"), "{e}");

    let mut v = manifest_seed();
    v["units"][1]["tensors"][0]["offset"] = json!(u64::MAX - 1);
    let e = parse_manifest(&v).unwrap_err();
    assert!(e.to_string().contains("is out of bounds or untyped"), "{e}");
}

/// Units are found by name: `layer.01` (never found) and a second `layer.0` were accepted.
#[test]
fn unit_names_must_be_canonical_and_distinct() {
    let mut v = manifest_seed();
    v["units"][2]["unit"] = json!("layer.00");
    assert!(parse_manifest(&v).unwrap_err().to_string().contains("unknown unit \"layer.00\""));
    let mut v = manifest_seed();
    v["units"][3]["unit"] = json!("layer.0");
    assert!(parse_manifest(&v).unwrap_err().to_string().contains("unit layer.0 appears twice"));
}
