//! [`PreadReader`]: the same submit/reap API as [`super::UringReader`], executed by a small pool
//! of threads calling `pread` on O_DIRECT files. It is the baseline the ring is measured
//! against and the fallback where io_uring is disabled; it must produce identical bytes.
//!
//! The owner thread runs the shared op table (`ops.rs`: chunking, short-read resubmission,
//! EINTR/EAGAIN retries, EOF rules, fault injection), sends each chunk as a job on a bounded
//! channel, and folds results from a second bounded channel. Both channels hold `queue_depth`
//! entries and at most `queue_depth` chunks are out, so no send ever blocks. Workers do one
//! `pread` per job and report the raw result, exactly as a CQE would.
//!
//! Allocation: channels and tables in [`PreadReader::new`]; nothing per read but error values.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use super::align::open_direct;
use super::error::IoError;
use super::ops::{OpTable, TableLimits};
use super::{Completion, DioAlign, FaultPlan, IoStats, ReadBackend, ReadOp};
use super::{CHUNK_BYTES_MAX, QUEUE_DEPTH_MAX, READS_IN_FLIGHT_MAX};

/// Most worker threads one reader may start.
pub const PREAD_THREADS_MAX: usize = 256;

/// How to build a [`PreadReader`].
#[derive(Clone, Debug)]
pub struct PreadOptions {
    /// Worker threads, each doing one blocking `pread` at a time. `1..=PREAD_THREADS_MAX`.
    pub threads: usize,
    /// Chunk reads out at most (queued to or running on workers). `1..=QUEUE_DEPTH_MAX`.
    pub queue_depth: u32,
    /// Bytes per `pread`; a multiple of the DIO alignment.
    pub chunk_bytes: usize,
    /// Logical reads accepted at once. `1..=READS_IN_FLIGHT_MAX`.
    pub ops_max: usize,
    /// Raise the enforced alignment to at least this (0: the device's own).
    pub align_min: u32,
    /// Fault injection for tests.
    pub inject: Option<FaultPlan>,
}

impl Default for PreadOptions {
    fn default() -> PreadOptions {
        PreadOptions { threads: 4, queue_depth: 32, chunk_bytes: 512 << 10, ops_max: 256, align_min: 0, inject: None }
    }
}

/// A destination pointer handed to a worker.
struct SendPtr(*mut u8);

// SAFETY: the pointer is only dereferenced by the one worker that received the job, for the
// duration of one `pread`; the owner thread does not touch the range until that job's result has
// come back (the `submit` contract plus the op table's chunk states), so no two threads access it
// at once.
unsafe impl Send for SendPtr {}

struct Job {
    id: u32,
    file: usize,
    offset: u64,
    dst: SendPtr,
    len: u32,
}

/// O_DIRECT reads on a pool of `pread` threads.
pub struct PreadReader {
    table: OpTable,
    jobs: Option<SyncSender<Job>>,
    results: Receiver<(u32, i64)>,
    workers: Vec<JoinHandle<()>>,
    align: DioAlign,
    wait_ns: u64,
}

impl PreadReader {
    /// Opens `files` for O_DIRECT reads and starts the workers.
    pub fn new(files: &[PathBuf], opts: PreadOptions) -> Result<PreadReader, IoError> {
        check_options(files, &opts)?;
        let (opened, align) = open_direct(files, opts.align_min)?;
        let strictest = align.strictest();
        if !opts.chunk_bytes.is_multiple_of(strictest as usize) {
            let what = "chunk_bytes of the pread options".to_string();
            return Err(IoError::Unaligned { what, value: opts.chunk_bytes as u64, align: strictest });
        }
        let depth = opts.queue_depth as usize;
        let (job_tx, job_rx) = sync_channel::<Job>(depth);
        let (result_tx, result_rx) = sync_channel::<(u32, i64)>(depth);
        let job_rx = Arc::new(Mutex::new(job_rx));
        let opened = Arc::new(opened);
        let mut workers = Vec::with_capacity(opts.threads);
        for index in 0..opts.threads {
            let (files, jobs, results) = (Arc::clone(&opened), Arc::clone(&job_rx), result_tx.clone());
            let spawned = std::thread::Builder::new()
                .name(format!("k3-pread-{index}"))
                .spawn(move || worker(&files, &jobs, &results));
            match spawned {
                Ok(handle) => workers.push(handle),
                // Workers already started exit when `job_tx` drops with this function.
                Err(source) => return Err(IoError::Setup { what: format!("pread worker thread {index}"), source }),
            }
        }
        let limits = TableLimits {
            ops_max: opts.ops_max,
            chunk_max: opts.queue_depth,
            chunk_bytes: opts.chunk_bytes,
            align: align.clone(),
        };
        let table = OpTable::new(files.to_vec(), limits, opts.inject);
        Ok(PreadReader { table, jobs: Some(job_tx), results: result_rx, workers, align, wait_ns: 0 })
    }

    /// Queues one read; nothing reaches a worker until [`PreadReader::reap`].
    ///
    /// # Safety
    ///
    /// `op.dst..op.dst + op.len` must stay valid, writable and unaliased (no Rust reference to it
    /// may be used) until the [`Completion`] with `op.tag` has been returned by `reap`, or until
    /// the reader has been dropped (drop joins the workers).
    pub unsafe fn submit(&mut self, op: ReadOp) -> Result<(), IoError> {
        self.table.accept(op)
    }

    /// Hands queued chunks to the workers and waits until at least `wait_for` logical reads have
    /// completed (`wait_for <= in_flight()`), appending them to `out`.
    pub fn reap(&mut self, out: &mut Vec<Completion>, wait_for: usize) -> Result<(), IoError> {
        assert!(
            wait_for <= self.table.in_flight(),
            "waiting for {wait_for} reads, {} in flight",
            self.table.in_flight()
        );
        let mut completed = 0;
        // The event loop; ends for the same reason as the ring's: each pass issues work or folds
        // at least one result, and every op has finitely many chunk results.
        loop {
            self.issue()?;
            completed += self.collect_ready(out)?;
            if self.table.can_issue() {
                // Results freed slots or asked for resubmissions: issue before deciding.
                continue;
            }
            if completed >= wait_for {
                return Ok(());
            }
            assert!(self.table.chunks_in_kernel() > 0, "waiting with no pread outstanding");
            let started = Instant::now();
            let received = self.results.recv();
            self.wait_ns += started.elapsed().as_nanos() as u64;
            let Ok((id, res)) = received else { return Err(workers_gone()) };
            completed += self.table.complete(id, res, out);
        }
    }

    /// Logical reads accepted and not yet returned as completions.
    pub fn in_flight(&self) -> usize {
        self.table.in_flight()
    }

    /// Counters since construction. `submit_syscalls` counts `pread` calls.
    pub fn stats(&self) -> IoStats {
        let mut stats = self.table.stats_now();
        stats.submit_syscalls = stats.sqes_submitted;
        stats.wait_ns = self.wait_ns;
        stats
    }

    /// Sends every chunk that has a free slot to the workers.
    fn issue(&mut self) -> Result<(), IoError> {
        let Some(jobs) = &self.jobs else { return Err(workers_gone()) };
        // Bounded by the chunk slots (`queue_depth`).
        while let Some(req) = self.table.next_chunk() {
            let job = Job { id: req.id, file: req.file, offset: req.offset, dst: SendPtr(req.dst), len: req.len };
            // Never blocks: the channel holds `queue_depth` jobs and at most that many are out.
            jobs.send(job).map_err(|_| workers_gone())?;
        }
        Ok(())
    }

    /// Folds the results already waiting, without blocking.
    fn collect_ready(&mut self, out: &mut Vec<Completion>) -> Result<usize, IoError> {
        let mut completed = 0;
        // Bounded by the channel capacity plus what workers finish meanwhile (at most the
        // chunks out).
        loop {
            match self.results.try_recv() {
                Ok((id, res)) => completed += self.table.complete(id, res, out),
                Err(TryRecvError::Empty) => return Ok(completed),
                Err(TryRecvError::Disconnected) => return Err(workers_gone()),
            }
        }
    }
}

impl ReadBackend for PreadReader {
    fn describe(&self) -> String {
        format!(
            "pread: {} worker threads, O_DIRECT, DIO alignment mem {} offset {}",
            self.workers.len(),
            self.align.mem_align,
            self.align.offset_align
        )
    }

    unsafe fn submit(&mut self, op: ReadOp) -> Result<(), IoError> {
        // SAFETY: the trait's contract is this method's contract, passed on unchanged.
        unsafe { PreadReader::submit(self, op) }
    }

    fn reap(&mut self, out: &mut Vec<Completion>, wait_for: usize) -> Result<(), IoError> {
        PreadReader::reap(self, out, wait_for)
    }

    fn in_flight(&self) -> usize {
        PreadReader::in_flight(self)
    }

    fn stats(&self) -> IoStats {
        PreadReader::stats(self)
    }

    fn dio_align(&self) -> DioAlign {
        self.align.clone()
    }
}

impl Drop for PreadReader {
    /// Closes the job channel and joins the workers, so no `pread` writes into a caller's buffer
    /// after the reader is gone. Jobs still queued are run first (they are at most `queue_depth`).
    fn drop(&mut self) {
        self.jobs = None;
        for worker in self.workers.drain(..) {
            if worker.join().is_err() {
                tracing::error!("a pread worker panicked");
            }
        }
    }
}

fn workers_gone() -> IoError {
    IoError::Setup {
        what: "pread workers (all exited)".to_string(),
        source: std::io::Error::from(std::io::ErrorKind::BrokenPipe),
    }
}

fn check_options(files: &[PathBuf], opts: &PreadOptions) -> Result<(), IoError> {
    let bad = |why: String| Err(IoError::Setup { what: why, source: std::io::Error::from_raw_os_error(libc::EINVAL) });
    if files.is_empty() {
        return bad("a pread reader over no files".to_string());
    }
    if opts.threads == 0 || opts.threads > PREAD_THREADS_MAX {
        return bad(format!("{} pread threads (allowed 1..={PREAD_THREADS_MAX})", opts.threads));
    }
    if opts.queue_depth == 0 || opts.queue_depth > QUEUE_DEPTH_MAX {
        return bad(format!("pread queue depth {} (allowed 1..={QUEUE_DEPTH_MAX})", opts.queue_depth));
    }
    if opts.ops_max == 0 || opts.ops_max > READS_IN_FLIGHT_MAX {
        return bad(format!("{} reads in flight (allowed 1..={READS_IN_FLIGHT_MAX})", opts.ops_max));
    }
    if opts.chunk_bytes == 0 || opts.chunk_bytes > CHUNK_BYTES_MAX {
        return bad(format!("pread chunk of {} bytes (allowed 1..={CHUNK_BYTES_MAX})", opts.chunk_bytes));
    }
    Ok(())
}

/// A worker's loop: one `pread` per job, raw result back. Ends when the job channel closes.
fn worker(files: &[File], jobs: &Mutex<Receiver<Job>>, results: &SyncSender<(u32, i64)>) {
    // The worker's event loop; it ends when the reader drops the job sender.
    loop {
        let job = {
            let Ok(receiver) = jobs.lock() else { return };
            match receiver.recv() {
                Ok(job) => job,
                Err(_) => return,
            }
        };
        // SAFETY: `job.dst..job.dst + job.len` is part of a `ReadOp` whose submitter promised it
        // stays valid, writable and unaliased until the op completes; the op cannot complete
        // before this job's result is folded in, and this worker is the only accessor meanwhile
        // (see `SendPtr`). The slice lives only for this one call.
        let dst = unsafe { std::slice::from_raw_parts_mut(job.dst.0, job.len as usize) };
        let res = match files[job.file].read_at(dst, job.offset) {
            Ok(n) => n as i64,
            Err(e) => -i64::from(e.raw_os_error().unwrap_or(libc::EIO)),
        };
        if results.send((job.id, res)).is_err() {
            return;
        }
    }
}
