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

/// Writes the embedded model (if not already there, or damaged) and returns its directory.
pub fn tiny_model_dir() -> anyhow::Result<PathBuf> {
    let dir = cache_root().join(format!("tiny-k3-{:016x}", digest()));
    let rewritten = materialize(&dir, &FILES)?;
    if !rewritten.is_empty() && rewritten.len() < FILES.len() {
        // Some files were there but differ from the embedded bytes: a damaged copy.
        tracing::warn!(
            "the cached copy of the embedded tiny model in {} was damaged ({} differed from the built-in bytes); \
             rewrote it",
            dir.display(),
            rewritten.join(", ")
        );
    }
    Ok(dir)
}

/// Makes `dir` hold exactly `files`: each file whose content differs (missing, another size, or
/// the same size with other bytes) is rewritten through a temporary file and a rename, so that a
/// concurrent run never reads a half-written file. Returns the names rewritten.
fn materialize(dir: &Path, files: &[(&'static str, &[u8])]) -> anyhow::Result<Vec<&'static str>> {
    let stale: Vec<(&'static str, &[u8])> =
        files.iter().copied().filter(|(name, bytes)| !same_file(&dir.join(name), bytes)).collect();
    if stale.is_empty() {
        return Ok(Vec::new());
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    for (name, bytes) in &stale {
        let target = dir.join(name);
        let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
        std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &target).with_context(|| format!("renaming to {}", target.display()))?;
    }
    Ok(stale.into_iter().map(|(name, _)| name).collect())
}

/// Whether `path` holds exactly `bytes`: the size first (cheap), then the xxh3-64 of the content
/// (a copy of the same size with damaged bytes must not run).
fn same_file(path: &Path, bytes: &[u8]) -> bool {
    std::fs::metadata(path).is_ok_and(|m| m.len() == bytes.len() as u64)
        && std::fs::read(path).is_ok_and(|on_disk| kernels::hash::xxh3_64(&on_disk) == kernels::hash::xxh3_64(bytes))
}

/// Whether `dir` holds a model with random weights: a `k3ring synth` output (it has
/// `synth.json`) or a model of the tiny reference generator (it has `reference.json`), like the
/// embedded one.
pub fn has_random_weights(dir: &Path) -> bool {
    dir.join(crate::synth::MARKER_FILE).is_file() || dir.join("reference.json").is_file()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::{materialize, FILES};

    #[test]
    fn a_damaged_cached_copy_of_the_same_size_is_rewritten() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("tiny");
        assert_eq!(materialize(&dir, &FILES).unwrap().len(), FILES.len(), "a fresh cache writes every file");
        assert!(materialize(&dir, &FILES).unwrap().is_empty(), "an intact copy is kept as is");
        let shard = dir.join("model-00002-of-00003.safetensors");
        let mut bytes = std::fs::read(&shard).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x10;
        std::fs::write(&shard, &bytes).unwrap();
        assert_eq!(materialize(&dir, &FILES).unwrap(), vec!["model-00002-of-00003.safetensors"]);
        let (_, embedded) = FILES.iter().find(|(n, _)| *n == "model-00002-of-00003.safetensors").unwrap();
        assert_eq!(&std::fs::read(&shard).unwrap()[..], *embedded, "the damaged file holds the built-in bytes again");
    }
}
