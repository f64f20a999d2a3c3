//! Embedding rows: the table is never streamed whole; each forward pass reads the rows of its
//! tokens from the pack (one aligned window per row, one submission) into the embedding buffer,
//! checks each row's checksum and copies it out.
//!
//! The buffer is one arena slot behind its own lock, held from the read until the copy, so
//! concurrent callers take turns instead of sharing it (the store is `Sync`).

use super::arena::Slot;
use super::layout::embed_row_window;
use super::reads::{OpMeta, Priority};
use super::{lock, Store, WaitFor};
use crate::model::weights::{Mat, SourceError};
use crate::storage::stream::arena::FileRange;

impl Store {
    /// Copies the bf16 rows `ids` of the embedding table `table` into `out`
    /// (`ids.len() * table.cols * 2` bytes).
    pub fn embed_rows(&self, table: &Mat, ids: &[u32], out: &mut [u8]) -> Result<(), SourceError> {
        let row = table.cols * 2;
        let a = self.align;
        let unit = &self.pack.units[self.pack.embed.unit];
        let window = embed_row_window(row as u64, a) as usize;
        let mut slot: std::sync::MutexGuard<'_, Slot> = lock(&self.embed);
        if ids.len() * window > slot.region().len || self.pack.embed.len < table.rows * row {
            return Err(SourceError::Internal("embedding buffer smaller than the chunk".to_owned()));
        }
        let ticket = self.reads.reserve();
        let target = slot.start_read(ticket);
        let mut ops = Vec::with_capacity(ids.len());
        let mut starts = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            let at = unit.file_offset + (self.pack.embed.offset + id as usize * row) as u64;
            let ws = at / a * a;
            let we = super::layout::align_up(at + row as u64, a);
            let meta = OpMeta { name: "embedding read", kind: Priority::Demand.kind(), layer: None, expert: None };
            let len = (we - ws) as usize;
            let range = FileRange { file: self.pack.pack_file, offset: ws, len, min_len: len };
            ops.push(self.arena.op(target, i * window, range, meta));
            starts.push(i * window + (at - ws) as usize);
        }
        self.reads.submit(Priority::Demand, vec![(ticket, ops)]);
        let waited = self.wait_io(ticket, WaitFor::Embedding);
        if let Err(e) = waited {
            slot.abandon();
            return Err(self.read_error("embedding rows from the trunk pack".to_owned(), &e));
        }
        slot.landed();
        let filled = slot.filled().ok_or_else(|| SourceError::Internal("embedding buffer not filled".to_owned()))?;
        let buf = self.arena.bytes(filled);
        for ((dst, &s), &id) in out.chunks_exact_mut(row).zip(&starts).zip(ids) {
            let bytes = &buf[s..s + row];
            let want = unit.row_checksums.get(id as usize).copied();
            if want != Some(kernels::hash::xxh3_64(bytes)) {
                return Err(SourceError::Corrupt {
                    what: format!("embedding row {id} read from {}", self.pack.pack_path.display()),
                    message:
                        "fails its checksum: the pack or the read is damaged; run `k3ring pack` again if it persists"
                            .to_owned(),
                });
            }
            dst.copy_from_slice(bytes);
        }
        drop(slot);
        lock(&self.stats).embed_bytes_read += (ids.len() * window) as u64;
        Ok(())
    }
}
