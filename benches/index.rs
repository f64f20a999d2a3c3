#![allow(clippy::expect_used, clippy::unwrap_used)]
//! Indexing a checkpoint of the release's size: 497,220 tensors in 96 shards (issue 2).
//!
//! Writes K3-shaped shards once into a temp dir: real headers for every tensor of the released
//! config, data regions left sparse (set_len), so the bench measures header parsing and
//! validation, not disk space. Then times `CheckpointIndex::open` (parallel header parsing,
//! duplicate and overlap checks, expert table).

use std::io::Write;
use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion};
use k3ring::checkpoint::{expected_tensors, CheckpointIndex};
use k3ring::config::Config;

const SHARDS: usize = 96;
/// The release holds 497,220 tensors: the 497,052 of the language model (spec section 3) plus
/// the vision tower, which k3ring indexes but does not use.
const VISION_TENSORS: usize = 168;

fn write_release_headers(dir: &Path) -> usize {
    let cfg_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/k3-config.json");
    let cfg = Config::from_file(&cfg_path).expect("k3 config");
    let language = expected_tensors(&cfg);
    assert_eq!(language.len(), 497_052);
    let vision = (0..VISION_TENSORS).map(|i| {
        let mut t = language[1].clone();
        t.name = format!("vision_tower.blocks.{}.part{}.weight", i / 6, i % 6);
        t
    });
    let tensors: Vec<_> = vision.chain(language.iter().cloned()).collect();
    let per_shard = tensors.len().div_ceil(SHARDS);
    let mut weight_map = serde_json::Map::new();
    for (s, chunk) in tensors.chunks(per_shard).enumerate() {
        let shard_name = format!("model-{:05}-of-{SHARDS:05}.safetensors", s + 1);
        let mut header = serde_json::Map::new();
        let mut offset = 0u64;
        for t in chunk {
            let bytes = t.shapes[0].iter().product::<u64>() * t.dtype.size();
            header.insert(
                t.name.clone(),
                serde_json::json!({"dtype": t.dtype.name(), "shape": t.shapes[0], "data_offsets": [offset, offset + bytes]}),
            );
            offset += bytes;
            weight_map.insert(t.name.clone(), serde_json::Value::String(shard_name.clone()));
        }
        let mut json = serde_json::Value::Object(header).to_string().into_bytes();
        while !json.len().is_multiple_of(8) {
            json.push(b' ');
        }
        let path = dir.join(&shard_name);
        let mut f = std::fs::File::create(&path).expect("create shard");
        f.write_all(&(json.len() as u64).to_le_bytes()).expect("write");
        f.write_all(&json).expect("write");
        f.set_len(8 + json.len() as u64 + offset).expect("sparse data");
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).expect("index");
    tensors.len()
}

fn bench_index(c: &mut Criterion) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let n = write_release_headers(tmp.path());
    assert_eq!(n, 497_220, "the released config defines 497,220 tensors");
    let index = CheckpointIndex::open(tmp.path()).expect("index");
    assert_eq!(index.tensors.len(), n);
    assert_eq!(index.experts.len(), 92 * 896);
    let mut group = c.benchmark_group("index");
    group.sample_size(10);
    group.bench_function("release_497220_tensors_96_shards", |b| {
        b.iter(|| CheckpointIndex::open(tmp.path()).expect("index"))
    });
    group.finish();
}

criterion_group!(benches, bench_index);
criterion_main!(benches);
