//! Which read backend the I/O stage runs, and with what settings.

use std::path::PathBuf;

use serde::Serialize;

use crate::storage::io::{align::open_direct, modeled::MODELED_ALIGN, sim::SimOptions, DeviceModel, FaultPlan};
use crate::storage::stream::StreamError;

/// Which read backend serves the I/O stage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum IoKind {
    Uring,
    Pread,
    Mmap,
    /// The seeded simulator (tests).
    Sim,
    /// Drives modeled in real time over the page cache (`--io sim:7GB/s,80us x4`).
    Modeled(DeviceModel),
}

impl IoKind {
    /// `uring`, `pread`, `mmap` or a modeled device `sim:RATE[,LATENCY][,qdQ][xN]`; the error
    /// says what is wrong.
    pub fn parse(s: &str) -> Result<IoKind, String> {
        match s {
            "uring" => Ok(IoKind::Uring),
            "pread" => Ok(IoKind::Pread),
            "mmap" => Ok(IoKind::Mmap),
            _ if s.starts_with("sim:") => DeviceModel::parse(s).map(IoKind::Modeled),
            _ => Err(format!("{s:?} is not a read backend: uring, pread, mmap or sim:RATE[,LATENCY][,qdQ][xN]")),
        }
    }

    /// `uring`, `pread`, `mmap`, or the modeled device's spec, as reports name the backend.
    pub fn display_name(self) -> String {
        self.modeled().map_or_else(|| self.name().to_owned(), |m| m.spec())
    }

    /// The modeled device, for `--io sim:`.
    pub fn modeled(self) -> Option<DeviceModel> {
        match self {
            IoKind::Modeled(m) => Some(m),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            IoKind::Uring => "uring",
            IoKind::Pread => "pread",
            IoKind::Mmap => "mmap",
            IoKind::Sim => "sim",
            IoKind::Modeled(_) => "sim-device",
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
    /// The backends of the expert directories' devices, in `pack --experts-to` order
    /// (`--device-io`); devices beyond the list, and all of them when it is empty, use `kind`.
    pub device_kinds: Vec<IoKind>,
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
            device_kinds: Vec::new(),
        }
    }
}

impl IoOptions {
    /// The options of each device's I/O thread: the devices before `first_expert` (the shards
    /// and the trunk) run `kind`, the expert directories' devices `device_kinds` in order, or
    /// `kind` beyond them.
    pub fn per_device(&self, devices: usize, first_expert: usize) -> Vec<IoOptions> {
        (0..devices.max(1))
            .map(|d| {
                let kind =
                    d.checked_sub(first_expert).and_then(|i| self.device_kinds.get(i)).copied().unwrap_or(self.kind);
                IoOptions { kind, device_kinds: Vec::new(), ..self.clone() }
            })
            .collect()
    }
}

/// The alignment every read must have for `files` (the simulator enforces its own).
pub fn read_alignment(files: &[PathBuf], opts: &IoOptions) -> Result<u64, StreamError> {
    if opts.kind == IoKind::Sim {
        return Ok(opts.sim.as_ref().map_or(4096, |s| u64::from(s.align)).max(512));
    }
    if let IoKind::Modeled(_) = opts.kind {
        return Ok(u64::from(MODELED_ALIGN));
    }
    let (_files, align) = open_direct(files, 0)?;
    Ok(u64::from(align.strictest()).max(512))
}
