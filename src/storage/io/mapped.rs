//! [`MappedReader`]: the page-cache backend (`--io mmap`), as llama.cpp reads by default.
//!
//! Every file is mapped read-only; a "read" copies from the mapping into the destination at
//! submit time and completes at once. It exists to compare against the direct-I/O backends and
//! must produce the same bytes; it obeys the same EOF rule (`min_len`) and reports the same
//! errors.

use std::collections::VecDeque;
use std::fs::File;
use std::path::PathBuf;
use std::time::Instant;

use super::modeled::Stores;
use super::{AlignSource, Completion, DioAlign, IoError, IoStats, ReadBackend, ReadOp};
use crate::storage::sigbus::MappedFile;

/// Reads by copying out of read-only mappings.
pub struct MappedReader {
    paths: Vec<PathBuf>,
    maps: Vec<Option<MappedFile>>,
    ready: VecDeque<Completion>,
    ops_max: usize,
    stats: IoStats,
}

impl MappedReader {
    /// Maps every file (an empty file gets no mapping).
    pub fn new(files: &[PathBuf], ops_max: usize) -> Result<MappedReader, IoError> {
        Ok(MappedReader {
            paths: files.to_vec(),
            maps: map_all(files)?,
            ready: VecDeque::with_capacity(ops_max),
            ops_max,
            stats: IoStats::default(),
        })
    }
}

/// Maps every file read-only (an empty file gets no mapping).
pub(super) fn map_all(files: &[PathBuf]) -> Result<Vec<Option<MappedFile>>, IoError> {
    let mut maps = Vec::with_capacity(files.len());
    for path in files {
        let open = |source| IoError::Open { path: path.clone(), source };
        let file = File::open(path).map_err(open)?;
        let len = file.metadata().map_err(open)?.len();
        // A file that shrinks later, or a disk error under a mapped page, faults in the copy;
        // `storage::sigbus` turns that into exit 4 naming the file.
        let map = if len == 0 { None } else { Some(MappedFile::map(&file, path).map_err(open)?) };
        maps.push(map);
    }
    Ok(maps)
}

impl ReadBackend for MappedReader {
    unsafe fn submit(&mut self, op: ReadOp) -> Result<(), IoError> {
        if self.ready.len() >= self.ops_max {
            return Err(IoError::QueueFull { tag: op.tag, queued: self.ready.len(), max: self.ops_max });
        }
        if op.min_len > op.len {
            return Err(IoError::BadOp { tag: op.tag, why: format!("min_len {} > len {}", op.min_len, op.len) });
        }
        let start = Instant::now();
        // A page-cache read's copy, as `read(2)` makes it: regular stores.
        let result = super::modeled::copy_counted(&self.paths, &self.maps, &op, Stores::Plain, &mut self.stats);
        self.stats.sqes_submitted += 1;
        self.stats.busy_ns += start.elapsed().as_nanos() as u64;
        self.ready.push_back(Completion { tag: op.tag, result });
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>, wait_for: usize) -> Result<(), IoError> {
        assert!(wait_for <= self.ready.len(), "waiting for more reads than are in flight");
        out.extend(self.ready.drain(..));
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.ready.len()
    }

    fn stats(&self) -> IoStats {
        self.stats
    }

    fn describe(&self) -> String {
        format!("mmap: {} files mapped, reads copy from the page cache", self.maps.len())
    }

    fn dio_align(&self) -> DioAlign {
        DioAlign { mem_align: 1, offset_align: 1, source: AlignSource::Default }
    }
}
