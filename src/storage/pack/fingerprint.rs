//! The fingerprint of what a trunk pack was made from, by content that is cheap to read: the
//! config and index bytes, and per shard its name, length, header and a few sampled windows of
//! tensor data. Modification times are left out, so a copy (`cp -r`, rsync without `-t`) keeps
//! its pack; a checkpoint with other headers or other weights (a fine-tune changes nearly every
//! byte) gets a new fingerprint. A byte changed in the shards outside the samples is caught for
//! experts (checked against their checksums on every read from the shards) and by `k3ring pack
//! --verify`, but not for the trunk: a trunk unit's checksum covers the pack's own copy, which
//! still holds the old bytes, so a run keeps using them until the pack is made again.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use kernels::hash::Xxh3;

use super::{io_err, PackError};
use crate::checkpoint::{CheckpointIndex, Shard, INDEX_FILE};

/// Sampled windows per shard, spread evenly over its tensor data (first at its start, last at
/// its end).
pub const SAMPLE_WINDOWS: u64 = 16;
/// Bytes per sampled window.
pub const SAMPLE_BYTES: u64 = 4096;
/// Changes whenever what the fingerprint covers changes.
const FINGERPRINT_KIND: &[u8] = b"k3ring-fingerprint-v2: config, index, shard names, lengths, headers, samples";

/// The (offset, len) windows of tensor data sampled in `shard`: the whole data region when it is
/// no longer than the windows together.
pub fn sampled_windows(shard: &Shard) -> Vec<(u64, u64)> {
    let data = shard.file_len.saturating_sub(shard.data_start);
    if data <= SAMPLE_WINDOWS * SAMPLE_BYTES {
        return vec![(shard.data_start, data)];
    }
    let stride = (data - SAMPLE_BYTES) / (SAMPLE_WINDOWS - 1);
    (0..SAMPLE_WINDOWS).map(|i| (shard.data_start + i * stride, SAMPLE_BYTES)).collect()
}

/// The fingerprint of `model_dir` as indexed by `index`.
pub fn fingerprint(model_dir: &Path, index: &CheckpointIndex) -> Result<String, PackError> {
    let mut h = Xxh3::new();
    h.update(FINGERPRINT_KIND);
    let cfg_path = model_dir.join("config.json");
    let cfg = std::fs::read(&cfg_path).map_err(io_err("read", &cfg_path))?;
    h.update(&(cfg.len() as u64).to_le_bytes());
    h.update(&cfg);
    let index_path = model_dir.join(INDEX_FILE);
    match std::fs::read(&index_path) {
        Ok(bytes) => {
            h.update(&(bytes.len() as u64).to_le_bytes());
            h.update(&bytes);
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => h.update(&u64::MAX.to_le_bytes()),
        Err(e) => return Err(PackError::Io { op: "read", path: index_path, source: e }),
    }
    let mut buf = Vec::new();
    for shard in &index.shards {
        let name = shard.path.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default();
        h.update(&(name.len() as u64).to_le_bytes());
        h.update(name);
        h.update(&shard.file_len.to_le_bytes());
        let file = File::open(&shard.path).map_err(io_err("open", &shard.path))?;
        let header = (0, shard.data_start, "read header of");
        let samples = sampled_windows(shard).into_iter().map(|(offset, len)| (offset, len, "read"));
        for (offset, len, op) in std::iter::once(header).chain(samples) {
            buf.resize(len as usize, 0);
            file.read_exact_at(&mut buf, offset).map_err(io_err(op, &shard.path))?;
            h.update(&offset.to_le_bytes());
            h.update(&buf);
        }
    }
    Ok(format!("{:016x}", h.digest()))
}
