//! The tiny K3 model compiled into the binary, so `k3ring run` works on any machine with no
//! download: it is written once to a cache directory and then loaded like any model directory.

use std::path::{Path, PathBuf};

use anyhow::Context;

macro_rules! fixture {
    ($name:literal) => {
        ($name, include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-k3/", $name)) as &[u8])
    };
}

/// The files of the embedded model.
const FILES: [(&str, &[u8]); 7] = [
    fixture!("config.json"),
    fixture!("model.safetensors.index.json"),
    fixture!("model-00001-of-00003.safetensors"),
    fixture!("model-00002-of-00003.safetensors"),
    fixture!("model-00003-of-00003.safetensors"),
    fixture!("tiktoken.model"),
    fixture!("tokenizer_config.json"),
];

/// FNV-1a over every file, so a new build never reuses a stale copy.
fn digest() -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for (name, bytes) in FILES {
        for b in name.as_bytes().iter().chain(bytes) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// `$XDG_CACHE_HOME/k3ring`, else `~/.cache/k3ring`, else the temp dir.
pub fn cache_root() -> PathBuf {
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir).join("k3ring");
    }
    if let Some(home) = std::env::var_os("HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(home).join(".cache").join("k3ring");
    }
    std::env::temp_dir().join("k3ring")
}

/// Writes the embedded model (if not already there) and returns its directory.
pub fn tiny_model_dir() -> anyhow::Result<PathBuf> {
    let dir = cache_root().join(format!("tiny-k3-{:016x}", digest()));
    if FILES.iter().all(|(name, bytes)| same_file(&dir.join(name), bytes)) {
        return Ok(dir);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, bytes) in FILES {
        let target = dir.join(name);
        let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
        std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &target).with_context(|| format!("renaming to {}", target.display()))?;
    }
    Ok(dir)
}

fn same_file(path: &Path, bytes: &[u8]) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.len() == bytes.len() as u64)
}
