//! The bookkeeping both backends share: logical reads split into chunks, chunk results folded
//! back into per-op outcomes.
//!
//! A logical [`ReadOp`] is accepted into an op slot and queued; [`OpTable::next_chunk`] hands out
//! chunk reads of at most `chunk_bytes` while chunk slots are free (one chunk slot is one SQE or
//! one pread job in flight, so `chunk_max` is the queue depth). [`OpTable::complete`] takes a
//! chunk's raw result (bytes, or `-errno`) and decides: done, resubmit the remainder of a short
//! read, retry EINTR/EAGAIN, EOF, or fail the op. An op completes when none of its chunks is
//! outstanding and nothing more will be issued for it.
//!
//! Slot states: op slots go Free -> Active -> Free, chunk slots Free -> Kernel (issued) ->
//! Free, or Kernel -> Retry -> Kernel for a resubmission; every transition asserts its
//! predecessor, so a slot is never reused before its result came back (house rule 12).
//!
//! Owner-thread only. All tables are allocated in [`OpTable::new`]; the hot path allocates only
//! error values.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::Instant;

use super::error::IoError;
use super::{Completion, DioAlign, FaultPlan, IoStats, ReadOp, RETRIES_MAX};

/// A chunk read to issue: the backend turns it into an SQE or a pread job and later passes its
/// `id` back to [`OpTable::complete`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct ChunkReq {
    pub id: u32,
    pub file: usize,
    pub offset: u64,
    pub dst: *mut u8,
    pub len: u32,
    pub buf_index: Option<u16>,
}

#[derive(Debug)]
struct OpSlot {
    op: Option<ReadOp>,
    /// Bytes of the op already handed out as chunks (op-relative).
    issued: usize,
    /// Chunks issued and not finished (including ones waiting in the retry queue).
    chunks_out: u32,
    /// Smallest op-relative position at which the file was found to end.
    eof_at: Option<usize>,
    error: Option<IoError>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ChunkState {
    Free,
    /// Issued: an SQE or a pread job exists for it.
    Kernel,
    /// Waiting in the retry queue for resubmission.
    Retry,
}

#[derive(Clone, Copy, Debug)]
struct ChunkSlot {
    state: ChunkState,
    op: u32,
    /// Op-relative start and length of the chunk.
    start: usize,
    len: usize,
    /// Bytes of the chunk read so far.
    done: usize,
    retries: u32,
    resubmits: u32,
}

const CHUNK_FREE: ChunkSlot =
    ChunkSlot { state: ChunkState::Free, op: 0, start: 0, len: 0, done: 0, retries: 0, resubmits: 0 };

/// Limits of an [`OpTable`].
#[derive(Clone, Debug)]
pub(crate) struct TableLimits {
    pub ops_max: usize,
    pub chunk_max: u32,
    pub chunk_bytes: usize,
    pub align: DioAlign,
}

#[derive(Debug)]
pub(crate) struct OpTable {
    paths: Vec<PathBuf>,
    limits: TableLimits,
    ops: Vec<OpSlot>,
    free_ops: Vec<u32>,
    chunks: Vec<ChunkSlot>,
    free_chunks: Vec<u32>,
    /// Op slots with bytes not yet issued, oldest first.
    ready: VecDeque<u32>,
    /// Chunk slots whose remainder must be reissued, oldest first.
    retry: VecDeque<u32>,
    /// Registered buffer ranges `(start, len)` by index, for checking `buf_index`.
    fixed: Vec<(usize, usize)>,
    inject: Option<FaultPlan>,
    results_seen: u64,
    busy_since: Option<Instant>,
    pub stats: IoStats,
}

impl OpTable {
    pub fn new(paths: Vec<PathBuf>, limits: TableLimits, inject: Option<FaultPlan>) -> OpTable {
        assert!(limits.ops_max >= 1);
        assert!(limits.ops_max <= super::READS_IN_FLIGHT_MAX);
        assert!(limits.chunk_max >= 1);
        assert!(limits.chunk_max <= super::QUEUE_DEPTH_MAX);
        assert_eq!(limits.chunk_bytes % limits.align.strictest() as usize, 0);
        assert!(limits.chunk_bytes > 0);
        assert!(limits.chunk_bytes <= super::CHUNK_BYTES_MAX);
        let ops = (0..limits.ops_max).map(|_| OpSlot::free()).collect();
        let free_ops = (0..limits.ops_max as u32).rev().collect();
        let chunks = vec![CHUNK_FREE; limits.chunk_max as usize];
        let free_chunks = (0..limits.chunk_max).rev().collect();
        let ready = VecDeque::with_capacity(limits.ops_max);
        let retry = VecDeque::with_capacity(limits.chunk_max as usize);
        OpTable {
            paths,
            ops,
            free_ops,
            chunks,
            free_chunks,
            ready,
            retry,
            fixed: Vec::new(),
            inject,
            results_seen: 0,
            busy_since: None,
            stats: IoStats::default(),
            limits,
        }
    }

    pub fn set_fixed_buffers(&mut self, fixed: Vec<(usize, usize)>) {
        self.fixed = fixed;
    }

    /// Logical reads accepted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.limits.ops_max - self.free_ops.len()
    }

    /// Chunks issued to the kernel (or workers) whose result has not come back.
    pub fn chunks_in_kernel(&self) -> usize {
        self.limits.chunk_max as usize - self.free_chunks.len() - self.retry.len()
    }

    /// Whether `next_chunk` would return a chunk now.
    pub fn can_issue(&self) -> bool {
        !self.retry.is_empty() || (!self.ready.is_empty() && !self.free_chunks.is_empty())
    }

    /// Stats with the busy time of an open busy period included.
    pub fn stats_now(&self) -> IoStats {
        let mut stats = self.stats;
        if let Some(since) = self.busy_since {
            stats.busy_ns += since.elapsed().as_nanos() as u64;
        }
        stats
    }

    /// Checks `op` and queues it. Nothing is issued until `next_chunk`.
    pub fn accept(&mut self, op: ReadOp) -> Result<(), IoError> {
        self.validate(&op)?;
        let Some(slot) = self.free_ops.pop() else {
            return Err(IoError::QueueFull { tag: op.tag, queued: self.in_flight(), max: self.limits.ops_max });
        };
        let entry = &mut self.ops[slot as usize];
        assert!(entry.op.is_none(), "op slot {slot} reused while active");
        assert_eq!(entry.chunks_out, 0);
        *entry = OpSlot { op: Some(op), issued: 0, chunks_out: 0, eof_at: None, error: None };
        assert!(self.ready.len() < self.limits.ops_max);
        self.ready.push_back(slot);
        if self.busy_since.is_none() {
            self.busy_since = Some(Instant::now());
        }
        Ok(())
    }

    fn validate(&self, op: &ReadOp) -> Result<(), IoError> {
        validate_op(op, &self.paths, &self.limits.align)?;
        let bad = |why: String| Err(IoError::BadOp { tag: op.tag, why });
        if let Some(index) = op.buf_index.filter(|_| !self.fixed.is_empty()) {
            let Some(&(start, len)) = self.fixed.get(index as usize) else {
                return bad(format!("buf_index {index} but {} buffers are registered", self.fixed.len()));
            };
            let dst = op.dst as usize;
            if dst < start || dst.saturating_add(op.len) > start + len {
                return bad(format!("destination is not inside registered buffer {index}"));
            }
        }
        Ok(())
    }

    /// The next chunk to issue: a resubmission first, else a new chunk of the oldest op with
    /// bytes left, if a chunk slot is free.
    pub fn next_chunk(&mut self) -> Option<ChunkReq> {
        if let Some(id) = self.retry.pop_front() {
            let chunk = &mut self.chunks[id as usize];
            assert_eq!(chunk.state, ChunkState::Retry);
            chunk.state = ChunkState::Kernel;
            return Some(self.request(id));
        }
        let &op_index = self.ready.front()?;
        let id = self.free_chunks.pop()?;
        let slot = &mut self.ops[op_index as usize];
        let Some(op) = slot.op else {
            unreachable!("ready queue holds free op slot {op_index}");
        };
        assert!(slot.issued < op.len);
        assert!(slot.error.is_none());
        assert!(slot.eof_at.is_none());
        let len = self.limits.chunk_bytes.min(op.len - slot.issued);
        let chunk = &mut self.chunks[id as usize];
        assert_eq!(chunk.state, ChunkState::Free, "chunk slot {id} reused while in flight");
        *chunk = ChunkSlot { state: ChunkState::Kernel, op: op_index, start: slot.issued, len, ..CHUNK_FREE };
        slot.issued += len;
        slot.chunks_out += 1;
        if slot.issued == op.len {
            self.ready.pop_front();
        }
        Some(self.request(id))
    }

    fn request(&mut self, id: u32) -> ChunkReq {
        let chunk = self.chunks[id as usize];
        let Some(op) = self.ops[chunk.op as usize].op else {
            unreachable!("chunk {id} belongs to free op slot {}", chunk.op);
        };
        let at = chunk.start + chunk.done;
        assert!(chunk.done < chunk.len);
        self.stats.sqes_submitted += 1;
        ChunkReq {
            id,
            file: op.file,
            offset: op.offset + at as u64,
            // The op was validated to span `dst..dst+len`, and `at < len`.
            dst: op.dst.wrapping_add(at),
            len: (chunk.len - chunk.done) as u32,
            buf_index: op.buf_index.filter(|_| !self.fixed.is_empty()),
        }
    }

    /// Folds chunk `id`'s result (`res` bytes, or `-errno`) into its op; pushes the op's
    /// completion to `out` if this was its last outstanding chunk. Returns ops completed (0 or 1).
    pub fn complete(&mut self, id: u32, res: i64, out: &mut Vec<Completion>) -> usize {
        assert!((id as usize) < self.chunks.len(), "result for unknown chunk {id}");
        let res = self.inject_fault(res);
        let chunk = &mut self.chunks[id as usize];
        assert_eq!(chunk.state, ChunkState::Kernel, "result for chunk {id} that is not in flight");
        let remaining = chunk.len - chunk.done;
        if res < 0 {
            let errno = (-res) as i32;
            if (errno == libc::EINTR || errno == libc::EAGAIN) && chunk.retries < RETRIES_MAX {
                chunk.retries += 1;
                self.stats.retries += 1;
                self.requeue(id);
                return 0;
            }
            let (op_index, at) = (chunk.op, chunk.start + chunk.done);
            self.fail(op_index, at, remaining, std::io::Error::from_raw_os_error(errno));
            return self.finish_chunk(id, out);
        }
        let got = (res as usize).min(remaining);
        assert_eq!(got as i64, res, "chunk {id} read {res} bytes, more than the {remaining} asked");
        chunk.done += got;
        self.stats.bytes_read += got as u64;
        if chunk.done == chunk.len {
            return self.finish_chunk(id, out);
        }
        let align = self.limits.align.strictest() as usize;
        if got == 0 || !chunk.done.is_multiple_of(align) {
            // O_DIRECT returns whole blocks except at the end of the file, so a zero or unaligned
            // count is EOF (and an unaligned remainder could not be reissued anyway).
            let (op_index, at) = (chunk.op, chunk.start + chunk.done);
            self.note_eof(op_index, at);
            return self.finish_chunk(id, out);
        }
        chunk.resubmits += 1;
        assert!(chunk.resubmits as usize <= chunk.len / align, "chunk {id} resubmitted without progress");
        self.stats.short_read_resubmits += 1;
        self.requeue(id);
        0
    }

    fn inject_fault(&mut self, res: i64) -> i64 {
        let Some(plan) = self.inject else { return res };
        self.results_seen += 1;
        let nth = |every: Option<u32>| every.is_some_and(|n| n > 0 && self.results_seen.is_multiple_of(u64::from(n)));
        if nth(plan.eio_every) {
            return -i64::from(libc::EIO);
        }
        let align = i64::from(self.limits.align.strictest());
        if nth(plan.short_every) && res >= 2 * align {
            return (res / 2) / align * align;
        }
        res
    }

    fn requeue(&mut self, id: u32) {
        let chunk = &mut self.chunks[id as usize];
        assert_eq!(chunk.state, ChunkState::Kernel);
        chunk.state = ChunkState::Retry;
        assert!(self.retry.len() < self.chunks.len());
        self.retry.push_back(id);
    }

    /// Records the op's first error and stops issuing more of it.
    fn fail(&mut self, op_index: u32, at: usize, len: usize, source: std::io::Error) {
        let slot = &mut self.ops[op_index as usize];
        let Some(op) = slot.op else { unreachable!("error for free op slot {op_index}") };
        if slot.error.is_none() {
            let path = self.paths[op.file].clone();
            slot.error = Some(IoError::Read { path, offset: op.offset + at as u64, len, source });
        }
        self.stop_issuing(op_index);
    }

    fn note_eof(&mut self, op_index: u32, at: usize) {
        let slot = &mut self.ops[op_index as usize];
        slot.eof_at = Some(slot.eof_at.map_or(at, |e| e.min(at)));
        self.stop_issuing(op_index);
    }

    /// Removes the op from the ready queue: chunks past an error or EOF are not worth issuing.
    /// O(ready) but only on the failure and tail paths.
    fn stop_issuing(&mut self, op_index: u32) {
        let slot = &mut self.ops[op_index as usize];
        if let Some(op) = slot.op {
            if slot.issued < op.len {
                slot.issued = op.len;
                self.ready.retain(|&o| o != op_index);
            }
        }
    }

    fn finish_chunk(&mut self, id: u32, out: &mut Vec<Completion>) -> usize {
        let chunk = &mut self.chunks[id as usize];
        assert_eq!(chunk.state, ChunkState::Kernel);
        let op_index = chunk.op;
        *chunk = CHUNK_FREE;
        assert!(self.free_chunks.len() < self.chunks.len());
        self.free_chunks.push(id);
        let slot = &mut self.ops[op_index as usize];
        assert!(slot.chunks_out > 0);
        slot.chunks_out -= 1;
        let Some(op) = slot.op else { unreachable!("chunk {id} of free op slot {op_index}") };
        if slot.chunks_out > 0 || slot.issued < op.len {
            return 0;
        }
        let result = match (slot.error.take(), slot.eof_at) {
            (Some(e), _) => Err(e),
            (None, Some(got)) if got < op.min_len => Err(IoError::ShortRead {
                path: self.paths[op.file].clone(),
                offset: op.offset,
                wanted: op.min_len,
                got,
            }),
            (None, _) => Ok(()),
        };
        *slot = OpSlot::free();
        self.free_ops.push(op_index);
        self.stats.ops += 1;
        self.stats.ops_failed += u64::from(result.is_err());
        out.push(Completion { tag: op.tag, result });
        if self.in_flight() == 0 {
            if let Some(since) = self.busy_since.take() {
                self.stats.busy_ns += since.elapsed().as_nanos() as u64;
            }
        }
        1
    }
}

impl OpSlot {
    fn free() -> OpSlot {
        OpSlot { op: None, issued: 0, chunks_out: 0, eof_at: None, error: None }
    }
}

/// The checks every backend makes of a read before accepting it: a file it has, a length that
/// is not zero and holds `min_len`, no overflow, and the alignment `align` asks for.
pub(super) fn validate_op(op: &ReadOp, paths: &[PathBuf], align: &DioAlign) -> Result<(), IoError> {
    let bad = |why: String| Err(IoError::BadOp { tag: op.tag, why });
    if op.file >= paths.len() {
        return bad(format!("file index {} but only {} files are open", op.file, paths.len()));
    }
    let path = paths[op.file].display();
    if op.len == 0 || op.min_len > op.len {
        return bad(format!("len {} and min_len {} at offset {} of {path}", op.len, op.min_len, op.offset));
    }
    if op.dst.is_null() || op.offset.checked_add(op.len as u64).is_none() {
        return bad(format!("null destination or offset overflow at offset {} of {path}", op.offset));
    }
    let unaligned = |what: &str, value: u64, by: u32| IoError::Unaligned {
        what: format!("{what} of read {} at offset {} of {path}", op.tag, op.offset),
        value,
        align: by,
    };
    if !op.offset.is_multiple_of(u64::from(align.offset_align)) {
        return Err(unaligned("offset", op.offset, align.offset_align));
    }
    if !op.len.is_multiple_of(align.offset_align as usize) {
        return Err(unaligned("length", op.len as u64, align.offset_align));
    }
    if !(op.dst as usize).is_multiple_of(align.mem_align as usize) {
        return Err(unaligned("destination address", op.dst as u64, align.mem_align));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::storage::io::AlignSource;

    fn table(chunk_max: u32, chunk_bytes: usize, inject: Option<FaultPlan>) -> OpTable {
        let align = DioAlign { mem_align: 512, offset_align: 512, source: AlignSource::Default };
        let limits = TableLimits { ops_max: 8, chunk_max, chunk_bytes, align };
        OpTable::new(vec![PathBuf::from("/f0")], limits, inject)
    }

    fn op(offset: u64, len: usize, min_len: usize, tag: u64) -> ReadOp {
        // Never dereferenced by the table.
        let dst = 4096usize as *mut u8;
        ReadOp { file: 0, offset, len, min_len, dst, buf_index: None, tag }
    }

    #[test]
    fn splits_an_op_into_chunks_and_completes_once() {
        let mut t = table(2, 1024, None);
        t.accept(op(0, 2560, 2560, 9)).unwrap();
        let a = t.next_chunk().unwrap();
        let b = t.next_chunk().unwrap();
        assert!(t.next_chunk().is_none(), "only two chunk slots");
        assert_eq!((a.offset, a.len, b.offset, b.len), (0, 1024, 1024, 1024));
        let mut out = Vec::new();
        assert_eq!(t.complete(a.id, 1024, &mut out), 0);
        let c = t.next_chunk().unwrap();
        assert_eq!((c.offset, c.len), (2048, 512));
        assert_eq!(t.complete(c.id, 512, &mut out), 0);
        assert_eq!(t.complete(b.id, 1024, &mut out), 1);
        assert_eq!(out.len(), 1);
        assert!(out[0].result.is_ok());
        assert_eq!(t.in_flight(), 0);
        assert_eq!(t.stats.bytes_read, 2560);
    }

    #[test]
    fn short_read_resubmits_the_remainder_and_eof_decides_by_min_len() {
        let mut t = table(4, 4096, None);
        t.accept(op(0, 4096, 1024, 1)).unwrap();
        let a = t.next_chunk().unwrap();
        let mut out = Vec::new();
        t.complete(a.id, 1024, &mut out);
        let again = t.next_chunk().unwrap();
        assert_eq!((again.id, again.offset, again.len), (a.id, 1024, 3072));
        assert_eq!(t.complete(again.id, 100, &mut out), 1);
        assert!(out[0].result.is_ok(), "EOF after min_len is success");

        t.accept(op(0, 4096, 2048, 2)).unwrap();
        let a = t.next_chunk().unwrap();
        t.complete(a.id, 1124, &mut out);
        let e = out[1].result.as_ref().unwrap_err();
        assert!(matches!(e, IoError::ShortRead { wanted: 2048, got: 1124, .. }), "{e}");
        assert_eq!(t.stats.short_read_resubmits, 1);
    }

    #[test]
    fn eintr_is_retried_and_eio_fails_only_its_op() {
        let mut t = table(4, 512, None);
        t.accept(op(0, 1024, 1024, 1)).unwrap();
        t.accept(op(4096, 512, 512, 2)).unwrap();
        let a = t.next_chunk().unwrap();
        let b = t.next_chunk().unwrap();
        let c = t.next_chunk().unwrap();
        let mut out = Vec::new();
        t.complete(a.id, -i64::from(libc::EINTR), &mut out);
        let a2 = t.next_chunk().unwrap();
        assert_eq!(a2.offset, 0);
        t.complete(a2.id, -i64::from(libc::EIO), &mut out);
        t.complete(b.id, 512, &mut out);
        t.complete(c.id, 512, &mut out);
        assert_eq!(out.len(), 2);
        let failed = out.iter().find(|c| c.tag == 1).unwrap();
        let text = failed.result.as_ref().unwrap_err().to_string();
        assert!(text.starts_with("read of 512 bytes at offset 0 of /f0 failed"), "{text}");
        assert!(out.iter().find(|c| c.tag == 2).unwrap().result.is_ok());
        assert_eq!(t.stats.retries, 1);
    }
}
