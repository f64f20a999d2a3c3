//! [`SimReader`]: the simulated twin of the real readers (house rule 15, after TigerBeetle's
//! `src/testing/storage.zig`). Same [`ReadBackend`] API, same validation, same op table
//! (`ops.rs`: chunking, short-read resubmission, EOF rules), but the "kernel" under the table is a
//! seeded simulation: a virtual clock in ticks, a latency per read, and faults drawn from one
//! SplitMix64 stream.
//!
//! # The fault model
//!
//! Every fault is one a real NVMe read path can produce, and each has a chance out of 1_000_000
//! per logical read ([`SimOptions`]):
//!
//! - **Latency and reordering** (`latency_min..=latency_max` ticks). A read completes when the
//!   clock reaches its due tick; ties are broken by a seeded order, so completions come back out
//!   of submission order, as they do from io_uring. This is not a fault but the normal condition:
//!   it must never change a result. A run with any latencies must produce the same output as a run
//!   with none.
//! - **EIO** (`eio_ppm`): the device failed the read. The completion is [`IoError::Read`] naming
//!   the path, offset and length, with `EIO` as its source; `dst` is left untouched.
//! - **ECANCELED** (`ecanceled_ppm`): the read was cancelled under us (a ring torn down, a device
//!   reset). Also [`IoError::Read`], with `ECANCELED`.
//! - **Short read** (`short_ppm`): the first piece of the read returns an aligned prefix, as the
//!   kernel may; the op table resubmits the remainder (fault-free). Invisible to the engine when
//!   the readers are right: the bytes are the same, `IoStats::short_read_resubmits` grows. Reads of
//!   a single alignment unit cannot be cut and are never short.
//! - **Corruption** (`corrupt_ppm`): the read "succeeds" but one to four bytes of what it read
//!   are flipped (XOR with a non-zero mask, at seeded distinct positions; bytes past EOF are never
//!   touched). Only for files whose index is in `corruptible_files`.
//! - **EOF** is not injected: the files are real and a window past their end behaves exactly as
//!   with the real readers (success if `min_len` bytes exist, else [`IoError::ShortRead`]).
//!
//! What the engine can detect, and how: EIO and ECANCELED are errors; they must stop the run with
//! a clean message naming the file (exit 4), never a panic and never wrong output. `ShortRead` is a
//! file shorter than the index says (exit 3). Corrupted bytes are invisible to the read layer and
//! only detectable by a checksum, which is why corruption is restricted to `corruptible_files`:
//! files the engine verifies (the trunk pack, whose checksum is checked on load, and the shards,
//! which the store reads only for experts, each checked against its checksum before use), where
//! it must end in a checksum error (exit 3). Corrupting an unverified file would only prove that
//! unverified bytes are unverified. So a simulated run must end in exactly one of two ways: output
//! equal to the fault-free run, or a clean named error.
//!
//! # Determinism and replay
//!
//! All randomness comes from the seed: each chunk read the sim issues draws a fixed number of
//! values (latency, tie-break, one roll per fault, the cut point and the corruption positions) at
//! the moment it is issued, whatever its fate. So the same seed and the same sequence of `submit`
//! and `reap` calls give the same completions in the same order with the same faults. A failing
//! test prints its seed; replay it with `K3_SIM_SEED=n cargo test sim_` (tests build their options
//! with [`SimOptions::from_env_or`], and their names start with `sim_`).
//!
//! # Bounds and allocation
//!
//! `ops_max <= READS_IN_FLIGHT_MAX` is checked in [`SimReader::new`] and asserted by the op table
//! on every `submit` (house rule 17); the due-tick heap and the chunk table are sized once for it
//! and every push is behind a capacity assert. `reap` never sleeps: it moves the virtual clock to
//! the next due tick instead. Reads are plain buffered `pread`s (`FileExt::read_at`, not O_DIRECT)
//! done inside `reap` when a read falls due, so the sim works on tmpfs and writes into `dst` only
//! on the owner thread, before the completion is returned. Logical reads above
//! [`CHUNK_BYTES_MAX`] (which the engine never issues) are split into chunks by the table, and
//! faults are then drawn per chunk.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use super::align::{AlignSource, DIO_ALIGN_DEFAULT, DIO_ALIGN_MIN};
use super::error::IoError;
use super::ops::{ChunkReq, OpTable, TableLimits};
use super::{Completion, DioAlign, IoStats, ReadBackend, ReadOp};
use super::{CHUNK_BYTES_MAX, QUEUE_DEPTH_MAX, READS_IN_FLIGHT_MAX, RETRIES_MAX};
use crate::rng::SplitMix64;

/// Probabilities are in parts per million.
pub const PPM: u32 = 1_000_000;

/// Largest alignment a [`SimReader`] enforces (a huge page).
pub const SIM_ALIGN_MAX: u32 = 2 << 20;

/// The environment variable [`SimOptions::from_env_or`] reads the seed from.
pub const SEED_ENV: &str = "K3_SIM_SEED";

/// How to build a [`SimReader`]: the seed, the latency range and the chance of each fault.
#[derive(Clone, Debug, PartialEq)]
pub struct SimOptions {
    /// Seed of the one PRNG stream every decision is drawn from.
    pub seed: u64,
    /// Latency of each logical read in ticks, drawn uniformly from `[latency_min, latency_max]`;
    /// completions come back in tick order (so reads complete out of submission order).
    pub latency_min: u32,
    /// Upper end of the latency range; `latency_min <= latency_max`.
    pub latency_max: u32,
    /// Chance (ppm) that a read fails with [`IoError::Read`] (EIO) naming path and offset.
    pub eio_ppm: u32,
    /// Chance (ppm) that a read fails with [`IoError::Read`] (ECANCELED).
    pub ecanceled_ppm: u32,
    /// Chance (ppm) that a read is done in two pieces (a short read, then a resubmission of the
    /// remainder); bytes stay right and `IoStats::short_read_resubmits` counts it.
    pub short_ppm: u32,
    /// Chance (ppm) that a read of a file in `corruptible_files` "succeeds" with some bytes of
    /// `dst` flipped.
    pub corrupt_ppm: u32,
    /// Indices of the files whose bytes may be corrupted: files the engine verifies by checksum.
    pub corruptible_files: Vec<usize>,
    /// The DIO alignment enforced on `offset`, `len` and `dst`: a power of two in
    /// `DIO_ALIGN_MIN..=SIM_ALIGN_MAX`.
    pub align: u32,
    /// Logical reads accepted at once. `1..=READS_IN_FLIGHT_MAX`.
    pub ops_max: usize,
}

impl SimOptions {
    /// No faults, latencies of 0 to 16 ticks (so completions are still reordered), alignment
    /// 4096, 256 reads in flight.
    pub fn fault_free(seed: u64) -> SimOptions {
        SimOptions {
            seed,
            latency_min: 0,
            latency_max: 16,
            eio_ppm: 0,
            ecanceled_ppm: 0,
            short_ppm: 0,
            corrupt_ppm: 0,
            corruptible_files: Vec::new(),
            align: DIO_ALIGN_DEFAULT,
            ops_max: 256,
        }
    }

    /// [`SimOptions::fault_free`] with the seed from `K3_SIM_SEED` if it is set, else `seed`.
    /// Set faults on the result: `SimOptions { eio_ppm: 1000, ..SimOptions::from_env_or(7) }`.
    ///
    /// # Panics
    ///
    /// If `K3_SIM_SEED` is set but is not a decimal or `0x` hexadecimal u64: a replay must never
    /// silently run a different seed. This is test-harness API, never called by the engine.
    pub fn from_env_or(seed: u64) -> SimOptions {
        let Some(text) = std::env::var_os(SEED_ENV) else { return SimOptions::fault_free(seed) };
        let text = text.to_string_lossy();
        match parse_seed(&text) {
            Some(from_env) => SimOptions::fault_free(from_env),
            None => panic!("{SEED_ENV}={text:?} is not a seed: give a decimal or 0x-hexadecimal u64"),
        }
    }
}

/// Parses a seed as printed by a failing test: decimal, or hexadecimal with a `0x` prefix.
pub fn parse_seed(text: &str) -> Option<u64> {
    let text = text.trim();
    match text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => text.parse().ok(),
    }
}

/// How many faults of each kind a [`SimReader`] injected so far. A fault counts only when it
/// took effect: a short read only when the read was really cut, a corruption only when bytes
/// were flipped, and EIO wins over ECANCELED, which wins over the other two.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SimFaultCounts {
    /// Reads failed with EIO.
    pub eio: u64,
    /// Reads failed with ECANCELED.
    pub ecanceled: u64,
    /// Reads cut short and resubmitted.
    pub short: u64,
    /// Reads that succeeded with flipped bytes.
    pub corrupt: u64,
}

/// True with chance `ppm` out of [`PPM`].
fn chance(rng: &mut SplitMix64, ppm: u32) -> bool {
    rng.below(u64::from(PPM)) < u64::from(ppm)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Failure {
    None,
    Eio,
    Ecanceled,
}

/// What the sim will do when a scheduled chunk read falls due.
#[derive(Clone, Copy, Debug)]
struct Planned {
    req: ChunkReq,
    failure: Failure,
    /// Read only this many bytes first (an aligned cut inside the chunk).
    cut: Option<usize>,
    /// Seed of the corruption positions, if this read is to be corrupted.
    corrupt: Option<u64>,
}

/// The sim's view of one chunk slot of the op table (indexed by chunk id).
#[derive(Clone, Copy, Debug)]
enum SimChunk {
    /// Not scheduled by the sim (free in the table, or finished).
    Idle,
    /// In the due-tick heap.
    Scheduled(Planned),
    /// Cut short by the sim; the table will reissue its remainder, which is read fault-free.
    AwaitingRemainder,
}

/// A [`ReadBackend`] over real files with simulated latency, reordering and faults. Owner-thread
/// only; all tables are allocated in [`SimReader::new`].
pub struct SimReader {
    opts: SimOptions,
    files: Vec<File>,
    /// `corruptible[i]`: whether file `i` is in `opts.corruptible_files`.
    corruptible: Vec<bool>,
    table: OpTable,
    /// The sim's state of each chunk slot of `table`.
    chunks: Vec<SimChunk>,
    /// Scheduled chunk reads by `(due tick, seeded tie-break, issue sequence, chunk id)`.
    due: BinaryHeap<Reverse<(u64, u64, u64, u32)>>,
    rng: SplitMix64,
    /// The virtual clock, in ticks.
    now: u64,
    /// Chunk reads scheduled so far: the last, total tie-break.
    issued: u64,
    /// `pread` calls made.
    preads: u64,
    injected: SimFaultCounts,
}

impl SimReader {
    /// Opens `files` for plain buffered reads (no O_DIRECT, so tmpfs works) and reserves room for
    /// `opts.ops_max` reads.
    pub fn new(files: &[PathBuf], opts: SimOptions) -> Result<SimReader, IoError> {
        check_options(files, &opts)?;
        let mut opened = Vec::with_capacity(files.len());
        for path in files {
            let file = File::open(path).map_err(|source| IoError::Open { path: path.clone(), source })?;
            opened.push(file);
        }
        let mut corruptible = vec![false; files.len()];
        for &index in &opts.corruptible_files {
            corruptible[index] = true;
        }
        let align = DioAlign { mem_align: opts.align, offset_align: opts.align, source: AlignSource::Default };
        // One chunk slot per read: every accepted read is scheduled at once (reads above
        // CHUNK_BYTES_MAX wait for a slot like in the real readers).
        let chunk_max = opts.ops_max.min(QUEUE_DEPTH_MAX as usize);
        let limits = TableLimits {
            ops_max: opts.ops_max,
            chunk_max: chunk_max as u32,
            chunk_bytes: CHUNK_BYTES_MAX / opts.align as usize * opts.align as usize,
            align,
        };
        let table = OpTable::new(files.to_vec(), limits, None);
        Ok(SimReader {
            rng: SplitMix64::new(opts.seed),
            opts,
            files: opened,
            corruptible,
            table,
            chunks: vec![SimChunk::Idle; chunk_max],
            due: BinaryHeap::with_capacity(chunk_max),
            now: 0,
            issued: 0,
            preads: 0,
            injected: SimFaultCounts::default(),
        })
    }

    /// The seed this reader was built with: print it when a run fails.
    pub fn seed(&self) -> u64 {
        self.opts.seed
    }

    /// How many of each fault were injected so far.
    pub fn injected(&self) -> SimFaultCounts {
        self.injected
    }

    /// The virtual clock, in ticks (advanced by `reap`).
    pub fn now(&self) -> u64 {
        self.now
    }

    /// Schedules every chunk the table will hand out now: remainders of short reads first, then
    /// new reads in submission order.
    fn issue(&mut self) {
        // Bounded by the chunk slots: each call takes one slot out of the table's free or retry
        // list, and the heap holds at most one entry per slot.
        while let Some(req) = self.table.next_chunk() {
            self.schedule(req);
        }
    }

    /// Draws the fate of one chunk read and puts it in the due-tick heap.
    fn schedule(&mut self, req: ChunkReq) {
        let id = req.id as usize;
        assert!(id < self.chunks.len(), "chunk id {id} outside the sim's table");
        let spread = u64::from(self.opts.latency_max - self.opts.latency_min) + 1;
        let latency = u64::from(self.opts.latency_min) + self.rng.below(spread);
        let tie = self.rng.next_u64();
        let planned = match self.chunks[id] {
            SimChunk::Scheduled(_) => unreachable!("chunk {id} scheduled twice"),
            SimChunk::AwaitingRemainder => Planned { req, failure: Failure::None, cut: None, corrupt: None },
            SimChunk::Idle => self.draw_faults(req),
        };
        self.chunks[id] = SimChunk::Scheduled(planned);
        assert!(self.due.len() < self.chunks.len(), "due-tick heap over its {} slots", self.chunks.len());
        self.due.push(Reverse((self.now + latency, tie, self.issued, req.id)));
        self.issued += 1;
    }

    /// Draws the faults of a fresh chunk read: always the same number of draws, whatever applies.
    fn draw_faults(&mut self, req: ChunkReq) -> Planned {
        let eio = chance(&mut self.rng, self.opts.eio_ppm);
        let ecanceled = chance(&mut self.rng, self.opts.ecanceled_ppm);
        let short = chance(&mut self.rng, self.opts.short_ppm);
        let corrupt = chance(&mut self.rng, self.opts.corrupt_ppm);
        let cut_draw = self.rng.next_u64();
        let corrupt_seed = self.rng.next_u64();
        let failure = match (eio, ecanceled) {
            (true, _) => Failure::Eio,
            (false, true) => Failure::Ecanceled,
            (false, false) => Failure::None,
        };
        let align = self.opts.align as usize;
        let units = req.len as usize / align;
        let cut = (short && units >= 2).then(|| align * (1 + (cut_draw % (units as u64 - 1)) as usize));
        let corrupt = (corrupt && self.corruptible[req.file]).then_some(corrupt_seed);
        Planned { req, failure, cut, corrupt }
    }

    /// Performs a due chunk read and folds its result into the table. Returns logical reads
    /// completed (0 or 1).
    fn perform(&mut self, id: u32, out: &mut Vec<Completion>) -> usize {
        let SimChunk::Scheduled(planned) = self.chunks[id as usize] else {
            unreachable!("chunk {id} fell due without being scheduled");
        };
        self.chunks[id as usize] = SimChunk::Idle;
        let res = match planned.failure {
            Failure::Eio => {
                self.injected.eio += 1;
                -i64::from(libc::EIO)
            }
            Failure::Ecanceled => {
                self.injected.ecanceled += 1;
                -i64::from(libc::ECANCELED)
            }
            Failure::None => self.read(&planned),
        };
        self.table.complete(id, res, out)
    }

    /// The successful path of a due read: `pread` (the first piece only, if cut), then the
    /// corruption, if drawn. Returns bytes read or `-errno`, as a CQE would.
    fn read(&mut self, planned: &Planned) -> i64 {
        let req = planned.req;
        let want = planned.cut.unwrap_or(req.len as usize);
        assert!(want <= req.len as usize);
        let res = self.pread(req.file, req.offset, req.dst, want);
        if res <= 0 {
            return res;
        }
        let got = res as usize;
        if let Some(seed) = planned.corrupt {
            // SAFETY: `req.dst..req.dst + req.len` lies inside a submitted `ReadOp`'s `dst` range,
            // which the `submit` contract keeps valid, writable and unaliased until the op's
            // completion is returned; that happens only after this chunk's result is folded in,
            // later in this call chain, and nothing else touches the range meanwhile (the sim is
            // single-threaded and this chunk is the only one covering these bytes). The slice
            // lives only for this call. `got <= want <= req.len`.
            let bytes = unsafe { std::slice::from_raw_parts_mut(req.dst, got) };
            flip_bytes(bytes, seed);
            self.injected.corrupt += 1;
        }
        if planned.cut == Some(got) {
            // Really cut: the table resubmits the remainder, which the sim must read fault-free.
            self.injected.short += 1;
            self.chunks[req.id as usize] = SimChunk::AwaitingRemainder;
        }
        res
    }

    /// Reads up to `len` bytes at `offset` of file `file` into `dst`, stopping early only at EOF;
    /// EINTR is retried up to [`RETRIES_MAX`] times. Returns bytes read or `-errno`.
    fn pread(&mut self, file: usize, offset: u64, dst: *mut u8, len: usize) -> i64 {
        // SAFETY: `dst..dst + len` is (a prefix of) a chunk of a submitted `ReadOp`'s `dst` range,
        // which the `submit` contract keeps valid, writable and unaliased until the op's
        // completion is returned by `reap`; the completion is produced only after this result is
        // folded in, and the sim is single-threaded, so this slice is the only access to those
        // bytes while it lives (this call only).
        let buf = unsafe { std::slice::from_raw_parts_mut(dst, len) };
        let mut got = 0usize;
        let mut retries = 0u32;
        // Bounded: each pass reads at least one byte, returns, or uses up one of RETRIES_MAX.
        while got < len {
            self.preads += 1;
            match self.files[file].read_at(&mut buf[got..], offset + got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted && retries < RETRIES_MAX => retries += 1,
                Err(e) => return -i64::from(e.raw_os_error().unwrap_or(libc::EIO)),
            }
        }
        got as i64
    }
}

/// Flips one to four bytes of `bytes` (non-empty) at seeded distinct positions: each lands in
/// its own equal segment and is XORed with a non-zero mask, so the result always differs.
fn flip_bytes(bytes: &mut [u8], seed: u64) {
    assert!(!bytes.is_empty());
    let mut rng = SplitMix64::new(seed);
    let count = (1 + rng.below(4) as usize).min(bytes.len());
    let segment = bytes.len() / count;
    for k in 0..count {
        let at = k * segment + rng.below(segment as u64) as usize;
        let mask = 1u8 << rng.below(8);
        bytes[at] ^= mask;
    }
}

impl ReadBackend for SimReader {
    /// Validates and queues one read exactly as the real readers do, and schedules it at
    /// `now + latency`. Nothing is written to `dst` until `reap` finds the read due.
    ///
    /// # Safety
    ///
    /// The trait's: `op.dst..op.dst + op.len` must stay valid, writable and unaliased until the
    /// completion with `op.tag` has been returned by `reap`, or until the reader is dropped (the
    /// sim writes only inside `reap`, so a dropped reader never writes).
    unsafe fn submit(&mut self, op: ReadOp) -> Result<(), IoError> {
        self.table.accept(op)?;
        self.issue();
        Ok(())
    }

    /// Advances the virtual clock by one tick, performs every read due by then, and keeps jumping
    /// the clock to the next due tick until at least `wait_for` reads have completed. Never
    /// sleeps.
    fn reap(&mut self, out: &mut Vec<Completion>, wait_for: usize) -> Result<(), IoError> {
        assert!(
            wait_for <= self.table.in_flight(),
            "waiting for {wait_for} reads, {} in flight",
            self.table.in_flight()
        );
        self.now += 1;
        let mut completed = 0;
        // The sim's event loop. Each pass performs one due read or moves the clock forward to a
        // scheduled read; every op has finitely many chunk reads (a short read is cut once, and
        // the table bounds resubmissions), so it ends.
        loop {
            self.issue();
            let Some(&Reverse((due, _, _, id))) = self.due.peek() else {
                assert!(completed >= wait_for, "{} reads in flight but none scheduled", self.table.in_flight());
                return Ok(());
            };
            if due <= self.now {
                self.due.pop();
                completed += self.perform(id, out);
            } else if completed >= wait_for {
                return Ok(());
            } else {
                self.now = due;
            }
        }
    }

    fn in_flight(&self) -> usize {
        self.table.in_flight()
    }

    /// Counters since construction. `sqes_submitted` counts chunk reads scheduled (including
    /// resubmissions), `submit_syscalls` the `pread` calls made; `enter_syscalls` and `wait_ns`
    /// are 0 (the sim never waits).
    fn stats(&self) -> IoStats {
        let mut stats = self.table.stats_now();
        stats.submit_syscalls = self.preads;
        stats
    }

    fn dio_align(&self) -> DioAlign {
        DioAlign { mem_align: self.opts.align, offset_align: self.opts.align, source: AlignSource::Default }
    }
}

fn check_options(files: &[PathBuf], opts: &SimOptions) -> Result<(), IoError> {
    let bad = |why: String| Err(IoError::Setup { what: why, source: std::io::Error::from_raw_os_error(libc::EINVAL) });
    if files.is_empty() {
        return bad("a simulated reader over no files".to_string());
    }
    if opts.ops_max == 0 || opts.ops_max > READS_IN_FLIGHT_MAX {
        return bad(format!("{} reads in flight (allowed 1..={READS_IN_FLIGHT_MAX})", opts.ops_max));
    }
    if !opts.align.is_power_of_two() || opts.align < DIO_ALIGN_MIN || opts.align > SIM_ALIGN_MAX {
        return bad(format!(
            "simulated alignment {} (a power of two in {DIO_ALIGN_MIN}..={SIM_ALIGN_MAX})",
            opts.align
        ));
    }
    if opts.latency_min > opts.latency_max {
        return bad(format!("simulated latency {}..={} ticks (min above max)", opts.latency_min, opts.latency_max));
    }
    let chances = [
        ("eio", opts.eio_ppm),
        ("ecanceled", opts.ecanceled_ppm),
        ("short", opts.short_ppm),
        ("corrupt", opts.corrupt_ppm),
    ];
    for (name, ppm) in chances {
        if ppm > PPM {
            return bad(format!("simulated {name} chance of {ppm} ppm (allowed 0..={PPM})"));
        }
    }
    if let Some(&index) = opts.corruptible_files.iter().find(|&&i| i >= files.len()) {
        return bad(format!("corruptible file index {index} but only {} files", files.len()));
    }
    Ok(())
}

#[cfg(test)]
#[path = "sim_tests.rs"]
mod tests;
