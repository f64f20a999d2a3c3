//! The in-memory weight store: every shard mapped read-only, tensors handed out as views.
//!
//! The page cache decides what is resident, as llama.cpp does by default. Built once; views are
//! plain borrows, so the per-token path neither allocates nor copies.

use std::fs::File;
use std::sync::Arc;

use super::sigbus::MappedFile;
use crate::checkpoint::{CheckpointIndex, EXPERT_PARTS};
use crate::exit::{Classify, ExitCode};
use crate::model::weights::{ExpertBytes, ExpertView, Mat, SourceError, TensorId, TrunkUnit, TrunkView, WeightSource};

/// Why the store could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot map {path}: {source}")]
    Map { path: std::path::PathBuf, source: std::io::Error },
    #[error("{path} changed size since it was indexed ({indexed} bytes, now {now})")]
    Changed { path: std::path::PathBuf, indexed: u64, now: u64 },
}

/// 4 when a shard cannot be mapped, 3 when it no longer matches its index.
impl Classify for StoreError {
    fn exit_code(&self) -> ExitCode {
        match self {
            StoreError::Map { .. } => ExitCode::Io,
            StoreError::Changed { .. } => ExitCode::Data,
        }
    }
}

/// All shards mapped.
pub struct MmapSource {
    index: Arc<CheckpointIndex>,
    maps: Vec<MappedFile>,
}

impl MmapSource {
    /// Maps every shard of the index.
    pub fn open(index: Arc<CheckpointIndex>) -> Result<MmapSource, StoreError> {
        let mut maps = Vec::with_capacity(index.shards.len());
        for shard in &index.shards {
            let map_err = |source| StoreError::Map { path: shard.path.clone(), source };
            let file = File::open(&shard.path).map_err(map_err)?;
            let now = file.metadata().map_err(map_err)?.len();
            if now != shard.file_len {
                return Err(StoreError::Changed { path: shard.path.clone(), indexed: shard.file_len, now });
            }
            // A shard that shrinks later, or a disk error under a mapped page, faults on read;
            // `sigbus` turns that into exit 4 naming the shard.
            let map = MappedFile::map(&file, &shard.path).map_err(map_err)?;
            maps.push(map);
        }
        Ok(MmapSource { index, maps })
    }

    pub fn index(&self) -> &CheckpointIndex {
        &self.index
    }

    fn tensor_bytes(&self, id: TensorId) -> &[u8] {
        let t = &self.index.tensors[id];
        // In range: the index checked every tensor against its file's length, and open()
        // checked the length did not change.
        &self.maps[t.shard][t.offset as usize..(t.offset + t.len) as usize]
    }
}

impl TrunkView for &MmapSource {
    fn bytes(&self, id: TensorId) -> &[u8] {
        self.tensor_bytes(id)
    }
}

/// One expert's six tensors, borrowed from the maps.
pub struct MappedExpert<'a> {
    parts: [&'a [u8]; 6],
}

impl ExpertView for MappedExpert<'_> {
    fn parts(&self) -> ExpertBytes<'_> {
        ExpertBytes::from_parts(self.parts)
    }
}

impl WeightSource for MmapSource {
    type Trunk<'a> = &'a MmapSource;
    type Expert<'a> = MappedExpert<'a>;

    fn trunk(&self, _unit: TrunkUnit) -> Result<&MmapSource, SourceError> {
        Ok(self)
    }

    fn embed_rows(&self, table: &Mat, ids: &[u32], out: &mut [u8]) -> Result<(), SourceError> {
        let bytes = self.tensor_bytes(table.id);
        let row = table.cols * 2;
        for (&id, dst) in ids.iter().zip(out.chunks_exact_mut(row)) {
            dst.copy_from_slice(&bytes[id as usize * row..(id as usize + 1) * row]);
        }
        Ok(())
    }

    fn expert(&self, layer: usize, expert: usize) -> Result<MappedExpert<'_>, SourceError> {
        let r = self.index.experts.get(layer, expert).ok_or_else(|| SourceError::Corrupt {
            what: format!("layer {layer} expert {expert}"),
            message: "not in the checkpoint".to_owned(),
        })?;
        let mut parts: [&[u8]; 6] = [&[]; 6];
        for (slot, (&id, _)) in parts.iter_mut().zip(r.parts.iter().zip(EXPERT_PARTS)) {
            *slot = self.tensor_bytes(id);
        }
        Ok(MappedExpert { parts })
    }
}

/// Nothing to prefetch: every byte is mapped.
impl crate::model::LayerHook for MmapSource {}
