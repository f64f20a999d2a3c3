//! The checkpoint index and `k3ring inspect`: the tiny model validates; each kind of damage
//! gives the documented exit code and a message naming the culprit (issue 2, sections 3 and 5).

use std::path::{Path, PathBuf};
use std::process::Command;

use k3ring::checkpoint::safetensors::{parse_header_json, serialize};
use k3ring::checkpoint::CheckpointIndex;
use k3ring::config::Config;
use serde_json::{json, Value};

use crate::common::tiny_dir;

const SHARD2: &str = "model-00002-of-00003.safetensors";

/// A writable copy of the tiny model.
pub fn copy_tiny() -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    for entry in std::fs::read_dir(tiny_dir()).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
    }
    (tmp, dir)
}

/// Runs the binary; returns (exit code, stdout, stderr).
pub fn k3ring(args: &[&str]) -> (i32, String, String) {
    // Without RUST_LOG from the caller's shell, so the stderr the tests pin has only warnings.
    let out = Command::new(env!("CARGO_BIN_EXE_k3ring")).args(args).env_remove("RUST_LOG").output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn inspect(dir: &Path) -> (i32, String, String) {
    k3ring(&["inspect", "--model", dir.to_str().unwrap()])
}

/// Rewrites a shard's header with `edit`, keeping the data (and appending `extra` bytes).
fn rewrite_header(path: &Path, extra: &[u8], edit: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Map<String, Value> = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut header);
    let mut json = Value::Object(header).to_string().into_bytes();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend_from_slice(&bytes[8 + n..]);
    out.extend_from_slice(extra);
    std::fs::write(path, out).unwrap();
}

/// Names of the tensors in a shard's header.
fn tensor_names(path: &Path) -> Vec<String> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    parse_header_json(&bytes[8..8 + n]).unwrap().into_iter().map(|(name, _)| name).collect()
}

fn first_matching(path: &Path, suffix: &str) -> String {
    tensor_names(path).into_iter().find(|n| n.ends_with(suffix)).unwrap()
}

#[test]
fn tiny_model_indexes_and_validates() {
    let dir = tiny_dir();
    let cfg = Config::from_model_dir(&dir).unwrap();
    let index = CheckpointIndex::open(&dir).unwrap();
    let v = index.validate(&cfg).unwrap();
    assert!(v.unexpected.is_empty(), "{:?}", v.unexpected);
    assert_eq!(index.experts.len(), cfg.moe_layers().len() * cfg.moe.n_experts);
    assert!(index.experts.non_contiguous().count() >= 1, "the fixture must hold a split expert");
    let r = crate::common::reference_json(&dir);
    for pair in r["noncontiguous_experts"].as_array().unwrap() {
        let (l, e) = (pair[0].as_u64().unwrap() as usize, pair[1].as_u64().unwrap() as usize);
        assert!(index.experts.get(l, e).unwrap().contiguous.is_none(), "expert ({l}, {e})");
    }
    let contiguous = index.experts.iter().find(|r| r.contiguous.is_some()).unwrap();
    let (_, start, end) = contiguous.contiguous.unwrap();
    assert_eq!(end - start, cfg.expert_bytes());
    let (_, a, b) = contiguous.aligned_window(4096).unwrap();
    assert!(a % 4096 == 0 && b % 4096 == 0 && a <= start && b >= end);
    assert_eq!(v.census.expert_bytes, cfg.expert_bytes() * index.experts.len() as u64);
}

#[test]
fn inspect_prints_the_layer_map_and_json() {
    let dir = tiny_dir();
    let (code, out, err) = inspect(&dir);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("layer map   KKKMKKKMKKKMM"), "{out}");
    assert!(out.contains("block starts [0, 3, 6, 9, 12]"), "{out}");
    let (code, out, _) = k3ring(&["inspect", "--model", dir.to_str().unwrap(), "--json", "-"]);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["layer_map"], "KKKMKKKMKKKMM");
    assert_eq!(v["validation"]["census"]["layers"].as_array().unwrap().len(), 13);
}

#[test]
fn truncated_shard_is_a_data_error_naming_shard_and_tensor() {
    let (_tmp, dir) = copy_tiny();
    let path = dir.join(SHARD2);
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len - 100).unwrap();
    let (code, _, err) = inspect(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(SHARD2) && err.contains("run past the end of the data"), "{err}");
    assert!(err.contains("tensor language_model."), "{err}");
}

#[test]
fn header_length_past_eof_is_a_data_error() {
    let (_tmp, dir) = copy_tiny();
    let path = dir.join(SHARD2);
    let mut bytes = std::fs::read(&path).unwrap();
    let too_long = (bytes.len() as u64).to_le_bytes();
    bytes[..8].copy_from_slice(&too_long);
    std::fs::write(&path, bytes).unwrap();
    let (code, _, err) = inspect(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(SHARD2) && err.contains("header length prefix says"), "{err}");
}

#[test]
fn malformed_header_json_is_a_data_error() {
    let (_tmp, dir) = copy_tiny();
    let path = dir.join(SHARD2);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8] = b'[';
    std::fs::write(&path, bytes).unwrap();
    let (code, _, err) = inspect(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(SHARD2) && err.contains("not valid safetensors JSON"), "{err}");
}

#[test]
fn overlapping_ranges_are_a_data_error_naming_both_tensors() {
    let (_tmp, dir) = copy_tiny();
    let path = dir.join(SHARD2);
    let a = first_matching(&path, "input_layernorm.weight");
    let b = first_matching(&path, "post_attention_layernorm.weight");
    rewrite_header(&path, &[], |h| {
        let offsets = h[&a]["data_offsets"].clone();
        h.get_mut(&b).unwrap()["data_offsets"] = offsets;
    });
    let (code, _, err) = inspect(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("overlap") && err.contains(&a) && err.contains(&b), "{err}");
}

#[test]
fn unknown_dtype_is_a_data_error() {
    let (_tmp, dir) = copy_tiny();
    let path = dir.join(SHARD2);
    let a = first_matching(&path, "input_layernorm.weight");
    rewrite_header(&path, &[], |h| h.get_mut(&a).unwrap()["dtype"] = json!("Q4_K"));
    let (code, _, err) = inspect(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(&a) && err.contains("unknown dtype \"Q4_K\""), "{err}");
}

#[test]
fn byte_count_mismatch_is_a_data_error() {
    let (_tmp, dir) = copy_tiny();
    let path = dir.join(SHARD2);
    let a = first_matching(&path, "input_layernorm.weight");
    rewrite_header(&path, &[], |h| h.get_mut(&a).unwrap()["shape"] = json!([65]));
    let (code, _, err) = inspect(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(&a) && err.contains("needs 130 bytes"), "{err}");
}

#[test]
fn misshaped_tensor_is_a_data_error_naming_it() {
    let (_tmp, dir) = copy_tiny();
    let path = dir.join(SHARD2);
    let a = first_matching(&path, "input_layernorm.weight");
    rewrite_header(&path, &[], |h| h.get_mut(&a).unwrap()["shape"] = json!([32, 2]));
    let (code, _, err) = inspect(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(&a) && err.contains("shape is [32, 2] but the config requires [64]"), "{err}");
}

#[test]
fn wrong_dtype_is_a_data_error_naming_it() {
    let (_tmp, dir) = copy_tiny();
    let path = dir.join(SHARD2);
    let a = first_matching(&path, "input_layernorm.weight");
    rewrite_header(&path, &[], |h| {
        let e = h.get_mut(&a).unwrap();
        e["dtype"] = json!("F16");
    });
    let (code, _, err) = inspect(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(&a) && err.contains("dtype is F16 but the config requires BF16"), "{err}");
}

#[test]
fn missing_tensor_is_a_data_error_naming_it() {
    let (_tmp, dir) = copy_tiny();
    let path = dir.join(SHARD2);
    let a = first_matching(&path, "self_attn.o_proj.weight");
    rewrite_header(&path, &[], |h| {
        h.remove(&a);
    });
    // Without the index, the shards alone define the checkpoint.
    std::fs::remove_file(dir.join("model.safetensors.index.json")).unwrap();
    std::fs::remove_file(dir.join("reference.safetensors")).unwrap();
    let (code, _, err) = inspect(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(&format!("tensor {a}: missing from the checkpoint")), "{err}");
}

#[test]
fn index_and_headers_must_agree() {
    let (_tmp, dir) = copy_tiny();
    let path = dir.join(SHARD2);
    let a = first_matching(&path, "self_attn.o_proj.weight");
    rewrite_header(&path, &[], |h| {
        h.remove(&a);
    });
    let (code, _, err) = inspect(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(&a) && err.contains("lacks it"), "{err}");
}

#[test]
fn duplicate_tensor_across_shards_is_a_data_error() {
    let (_tmp, dir) = copy_tiny();
    std::fs::remove_file(dir.join("model.safetensors.index.json")).unwrap();
    std::fs::remove_file(dir.join("reference.safetensors")).unwrap();
    let path = dir.join(SHARD2);
    let dup = first_matching(&dir.join("model-00001-of-00003.safetensors"), "input_layernorm.weight");
    let data_len = {
        let bytes = std::fs::read(&path).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        (bytes.len() - 8 - n) as u64
    };
    rewrite_header(&path, &[0u8; 128], |h| {
        h.insert(dup.clone(), json!({"dtype": "BF16", "shape": [64], "data_offsets": [data_len, data_len + 128]}));
    });
    let (code, _, err) = inspect(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(&dup) && err.contains("appears in both"), "{err}");
}

#[test]
fn index_naming_a_missing_shard_is_a_data_error() {
    let (_tmp, dir) = copy_tiny();
    std::fs::remove_file(dir.join(SHARD2)).unwrap();
    let (code, _, err) = inspect(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(SHARD2) && err.contains("does not exist"), "{err}");
}

#[test]
fn unreadable_shard_is_an_io_error() {
    let (_tmp, dir) = copy_tiny();
    std::fs::remove_file(dir.join(SHARD2)).unwrap();
    std::fs::create_dir(dir.join(SHARD2)).unwrap();
    let (code, _, err) = inspect(&dir);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains(SHARD2), "{err}");
}

#[test]
fn refused_config_exits_2() {
    let (_tmp, dir) = copy_tiny();
    let path = dir.join("config.json");
    let mut v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    v["text_config"]["num_experts_per_token"] = json!(99);
    std::fs::write(&path, v.to_string()).unwrap();
    let (code, _, err) = inspect(&dir);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("num_experts_per_token 99 exceeds num_experts 16"), "{err}");
}

#[test]
fn shards_without_index_are_indexed_in_name_order() {
    let (_tmp, dir) = copy_tiny();
    std::fs::remove_file(dir.join("model.safetensors.index.json")).unwrap();
    // Every *.safetensors counts when there is no index, so the reference must go too.
    std::fs::remove_file(dir.join("reference.safetensors")).unwrap();
    let with = CheckpointIndex::open(&tiny_dir()).unwrap();
    let without = CheckpointIndex::open(&dir).unwrap();
    assert_eq!(with.tensors.len(), without.tensors.len());
    assert!(with.tensors == without.tensors, "indexing without the index file changed the tensors");
}

#[test]
fn serialize_round_trips_through_the_parser() {
    let bytes = serialize(&[("a", "F32", &[2], &[0u8; 8]), ("b", "U8", &[3], &[1, 2, 3])]);
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!(n % 8, 0);
    let entries = parse_header_json(&bytes[8..8 + n]).unwrap();
    assert_eq!(entries.len(), 2);
    assert_eq!(entries[1].1.data_offsets, [8, 11]);
}

/// Issue 16: tensors outside `language_model.` are not silently ignored.
#[test]
fn inspect_warns_about_tensors_outside_the_expected_prefix() {
    let (_tmp, dir) = copy_tiny();
    let header = br#"{"vision_tower.patch.weight":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header);
    file.extend_from_slice(&[0u8; 8]);
    std::fs::write(dir.join("extra.safetensors"), file).unwrap();
    let index_path = dir.join("model.safetensors.index.json");
    let mut index: Value = serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    index["weight_map"]["vision_tower.patch.weight"] = Value::from("extra.safetensors");
    std::fs::write(&index_path, serde_json::to_vec(&index).unwrap()).unwrap();
    let (code, out, err) = inspect(&dir);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(
            "warning: 1 tensors lie outside the expected prefix language_model. and are not used: \
             vision_tower.patch.weight"
        ),
        "{out}"
    );
    let (code, out, _) = k3ring(&["inspect", "--model", dir.to_str().unwrap(), "--json", "-"]);
    assert_eq!(code, 0);
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["validation"]["outside_prefix"], serde_json::json!(["vision_tower.patch.weight"]));
}
