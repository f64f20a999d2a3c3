//! The low-level read layer: O_DIRECT reads from NVMe into pinned, NUMA-local buffers.
//!
//! What each file owns:
//! - [`align`]: the device's direct-I/O alignment (`statx(STATX_DIOALIGN)`, then sysfs, then 4096).
//! - [`buffer`]: [`AlignedBuf`], one 2 MiB-aligned anonymous mapping, `mbind`-ed before first
//!   touch, optionally `mlock`-ed, pre-faulted.
//! - [`ring`]: [`UringReader`], the io_uring backend and the only file that pushes SQEs.
//! - [`pread`]: [`PreadReader`], the same API over a small pool of threads calling `pread`; the
//!   baseline the ring is measured against, and a fallback where io_uring is disabled.
//! - `ops` (private): the bookkeeping both backends share: splitting a logical read into chunks,
//!   resubmitting short reads, retrying EINTR/EAGAIN, deciding success at EOF, fault injection.
//! - [`modeled`]: [`ModeledReader`], drives modeled in real time over the page cache (`--io sim:`).
//! - [`topology`]: NUMA nodes and their CPUs from sysfs.
//!
//! Threads: a reader is owned by one thread (the ring's owner is `!Send`, house rule 11); the pread
//! backend's worker threads only ever see raw chunk jobs. Allocation: readers allocate all their
//! bookkeeping in their constructor; `submit` and `reap` allocate nothing except the error values
//! of failed reads and the caller's `out` vector growing past its capacity.
//!
//! Counters ([`IoStats`]) are plain integers bumped on the owner thread; they prove io_uring is in
//! use (`sqes_submitted` grows, `submit_syscalls` stays below `ops` when SQEs are batched).

pub mod align;
pub mod buffer;
pub mod error;
pub mod mapped;
pub mod modeled;
mod ops;
pub mod pread;
pub mod probe;
pub mod ring;
pub mod sim;
pub mod stream;
pub mod topology;

#[cfg(test)]
mod backend_tests;
#[cfg(test)]
mod bench_tests;
#[cfg(test)]
pub(crate) mod gated;
#[cfg(test)]
mod testutil;

pub use align::{dio_alignment, AlignSource, DioAlign};
pub use buffer::{AlignedBuf, BufOptions, LockState, NumaPolicy};
pub use error::IoError;
pub use mapped::MappedReader;
pub use modeled::{DeviceModel, ModeledReader};
pub use pread::{PreadOptions, PreadReader};
pub use ring::{RingInfo, RingOptions, RingSetup, UringReader};
pub use sim::{SimOptions, SimReader};
pub use topology::{NumaNode, Topology};

/// Upper bound on logical reads a reader accepts at once (queued plus in the kernel). Readers
/// reserve their tables for `ops_max <= READS_IN_FLIGHT_MAX` at construction (house rule 17).
pub const READS_IN_FLIGHT_MAX: usize = 4096;

/// Upper bound on SQEs (chunks) in flight per reader: the ring's queue depth.
pub const QUEUE_DEPTH_MAX: u32 = 4096;

/// Upper bound on one chunk: an SQE's length is a `u32`, and a chunk bigger than this only
/// delays the first completed bytes without raising throughput.
pub const CHUNK_BYTES_MAX: usize = 1 << 30;

// An SQE's length is a u32; op and chunk slot indices are u32.
const _: () = assert!(CHUNK_BYTES_MAX <= u32::MAX as usize);
const _: () = assert!(READS_IN_FLIGHT_MAX <= u32::MAX as usize);

/// EINTR/EAGAIN retries allowed per chunk before the read fails with that errno.
pub const RETRIES_MAX: u32 = 16;

/// One logical read: `len` bytes at `offset` of file `file` into `dst`.
///
/// `offset`, `len` and `dst` must be multiples of the reader's DIO alignment (checked by
/// `submit`). `min_len <= len` is how many of those bytes must exist: a window rounded up past
/// the end of the file is fine as long as the file holds the first `min_len` bytes; a read that
/// stops at EOF before `min_len` completes with [`IoError::ShortRead`]. Bytes of `dst` past the
/// end of the file are left as they were.
#[derive(Clone, Copy, Debug)]
pub struct ReadOp {
    /// Index into the reader's file list.
    pub file: usize,
    /// Byte offset in the file.
    pub offset: u64,
    /// Bytes to read (the aligned window).
    pub len: usize,
    /// Bytes that must be read for success; `min_len <= len`.
    pub min_len: usize,
    /// Destination; the kernel writes `dst..dst + len` until the op's completion is returned.
    pub dst: *mut u8,
    /// The registered buffer containing `dst..dst + len`, for READ_FIXED (see
    /// [`UringReader::fixed_buffer_for`]). Ignored when buffers are not registered.
    pub buf_index: Option<u16>,
    /// Returned unchanged in the op's [`Completion`].
    pub tag: u64,
}

impl ReadOp {
    /// A read of the whole window (`min_len == len`) with no registered buffer.
    pub fn new(file: usize, offset: u64, len: usize, dst: *mut u8, tag: u64) -> ReadOp {
        ReadOp { file, offset, len, min_len: len, dst, buf_index: None, tag }
    }
}

/// The end of one logical read. Once returned, the kernel and the workers are done with `dst`.
#[derive(Debug)]
pub struct Completion {
    /// The op's tag.
    pub tag: u64,
    /// Success, or the first error of any of the op's chunks.
    pub result: Result<(), IoError>,
}

/// Counters of one reader, for `--stats` and the tests. All are totals since construction.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct IoStats {
    /// Logical reads completed (successfully or not).
    pub ops: u64,
    /// Logical reads completed with an error.
    pub ops_failed: u64,
    /// Bytes the kernel reported read (resubmitted remainders counted once).
    pub bytes_read: u64,
    /// Chunk reads issued: SQEs pushed (io_uring) or `pread` calls (pread backend), including
    /// resubmissions and retries.
    pub sqes_submitted: u64,
    /// Syscalls that submitted work: `io_uring_enter` with `to_submit > 0` (io_uring), or `pread`
    /// calls (pread backend, one syscall per chunk).
    pub submit_syscalls: u64,
    /// `io_uring_enter` calls of any kind (io_uring); 0 for the pread backend.
    pub enter_syscalls: u64,
    /// Short reads (`0 < res < asked`) resubmitted for their remainder.
    pub short_read_resubmits: u64,
    /// EINTR/EAGAIN retries (of chunks and of `io_uring_enter`).
    pub retries: u64,
    /// Nanoseconds during which at least one read was accepted and not yet completed.
    pub busy_ns: u64,
    /// Nanoseconds the owner thread spent blocked waiting for completions inside `reap`.
    pub wait_ns: u64,
}

/// Test-only fault injection, cheap enough to stay compiled in: one `Option` check per completed
/// chunk. Counting is over chunk completions (CQEs, or pread results) in arrival order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultPlan {
    /// Every Nth completion that read at least two alignment units is cut to half its length
    /// (rounded down to the alignment), as if the kernel had returned a short read. The bytes
    /// past the cut were really read; the resubmission reads them again.
    pub short_every: Option<u32>,
    /// Every Nth completion is turned into `-EIO`.
    pub eio_every: Option<u32>,
}

/// What the store needs from a backend. Object-safe so the store can hold `Box<dyn ReadBackend>`.
pub trait ReadBackend {
    /// Queues one read. It may be issued at once or when a chunk slot frees up in `reap`.
    ///
    /// # Safety
    ///
    /// `op.dst..op.dst + op.len` must stay valid, writable and unaliased (no Rust reference to
    /// it may be used) until the [`Completion`] with `op.tag` has been returned by `reap`, or until
    /// the reader has been dropped (drop waits for the kernel and the workers).
    unsafe fn submit(&mut self, op: ReadOp) -> Result<(), IoError>;

    /// Issues queued chunks and waits until at least `wait_for` logical reads have completed,
    /// appending their completions to `out`. `wait_for == 0` only issues and collects some or all
    /// of what is already done (the modeled drives return one: each costs a copy); a poller
    /// calls it until nothing more comes back. `wait_for` must not exceed
    /// [`ReadBackend::in_flight`].
    fn reap(&mut self, out: &mut Vec<Completion>, wait_for: usize) -> Result<(), IoError>;

    /// Logical reads accepted and not yet returned as completions.
    fn in_flight(&self) -> usize;

    /// Counters since construction.
    fn stats(&self) -> IoStats;

    /// The alignment every `offset`, `len` and `dst` must have.
    fn dio_align(&self) -> DioAlign;

    /// One line saying what the backend uses (setup flags, registration, queue depth), for the
    /// plan printout.
    fn describe(&self) -> String {
        String::new()
    }
}

/// Formats a byte count the way messages print it: "8 MiB", "3.2 GiB", "512 B".
pub fn fmt_bytes(bytes: u64) -> String {
    const UNITS: [(u64, &str); 4] = [(1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (unit, name) in UNITS {
        if bytes >= unit {
            if bytes.is_multiple_of(unit) {
                return format!("{} {name}", bytes / unit);
            }
            return format!("{:.1} {name}", bytes as f64 / unit as f64);
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
mod tests {
    use super::fmt_bytes;

    #[test]
    fn fmt_bytes_prints_whole_and_fractional_units() {
        assert_eq!(fmt_bytes(8 << 20), "8 MiB");
        assert_eq!(fmt_bytes(3_435_973_837), "3.2 GiB");
        assert_eq!(fmt_bytes(512), "512 B");
        assert_eq!(fmt_bytes(1536), "1.5 KiB");
    }
}
