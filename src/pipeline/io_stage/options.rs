//! Which read backend the I/O stage runs, and with what settings.

use std::path::PathBuf;

use serde::Serialize;

use crate::storage::io::{align::open_direct, sim::SimOptions, FaultPlan};
use crate::storage::stream::StreamError;

/// Which read backend serves the I/O stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum IoKind {
    Uring,
    Pread,
    Mmap,
    /// The seeded simulator (tests).
    Sim,
}

impl IoKind {
    pub fn parse(s: &str) -> Option<IoKind> {
        match s {
            "uring" => Some(IoKind::Uring),
            "pread" => Some(IoKind::Pread),
            "mmap" => Some(IoKind::Mmap),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            IoKind::Uring => "uring",
            IoKind::Pread => "pread",
            IoKind::Mmap => "mmap",
            IoKind::Sim => "sim",
        }
    }
}

/// How to run the I/O stage.
#[derive(Clone, Debug)]
pub struct IoOptions {
    pub kind: IoKind,
    /// Reads in flight at most (SQEs, or pread calls).
    pub queue_depth: u32,
    /// Bytes per read the backend issues (a multiple of the alignment).
    pub chunk_bytes: usize,
    /// CPU the I/O thread is pinned to.
    pub io_core: Option<usize>,
    /// Fault injection for the real backends (tests).
    pub inject: Option<FaultPlan>,
    /// Options of the simulator when `kind` is `Sim`.
    pub sim: Option<SimOptions>,
    pub pread_threads: usize,
}

impl Default for IoOptions {
    fn default() -> Self {
        IoOptions {
            kind: IoKind::Uring,
            queue_depth: 32,
            chunk_bytes: 1 << 20,
            io_core: None,
            inject: None,
            sim: None,
            pread_threads: 4,
        }
    }
}

/// The alignment every read must have for `files` (the simulator enforces its own).
pub fn read_alignment(files: &[PathBuf], opts: &IoOptions) -> Result<u64, StreamError> {
    if opts.kind == IoKind::Sim {
        return Ok(opts.sim.as_ref().map_or(4096, |s| u64::from(s.align)).max(512));
    }
    let (_files, align) = open_direct(files, 0)?;
    Ok(u64::from(align.strictest()).max(512))
}
