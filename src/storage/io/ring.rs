//! [`UringReader`]: O_DIRECT reads through io_uring. The only file that pushes SQEs
//! (house rule 12).
//!
//! One reader is one ring, owned by the thread that built it (`!Send`, house rule 11): the ring
//! is set up with `SINGLE_ISSUER | DEFER_TASKRUN` where the kernel allows, so only that thread may
//! enter it, and completions are posted only when it asks for them (`io_uring_enter` with
//! GETEVENTS, inside [`UringReader::reap`]). Other threads reach the ring through the owner
//! (bounded channels, in the pipeline), never through a lock.
//!
//! Flow: [`UringReader::submit`] only validates and queues a logical read (no syscall);
//! [`UringReader::reap`] pushes as many chunk SQEs as there are free slots (`queue_depth`), enters
//! the kernel once to submit them all and, if asked, wait; then folds CQEs into op outcomes
//! (shared logic in `ops.rs`). `reap(out, 0)` is the non-blocking "issue what is queued and
//! collect what is done" call the prefetcher makes between compute steps.
//!
//! Buffers are registered (READ_FIXED skips the per-I/O page pinning) and files registered
//! (skips the fd table lookup) when the kernel and RLIMIT_MEMLOCK allow; otherwise the reader
//! falls back to plain READ on plain fds with one warning. [`RingInfo`] records what is in use.
//!
//! Allocation: everything in [`UringReader::new`]; `submit` and `reap` allocate only error values
//! (and `out` growing past its capacity).

use std::fmt;
use std::fs::File;
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use io_uring::{opcode, squeue, types, EnterFlags, IoUring};

use super::align::open_direct;
use super::buffer::AlignedBuf;
use super::error::IoError;
use super::ops::{ChunkReq, OpTable, TableLimits};
use super::{Completion, DioAlign, FaultPlan, IoStats, ReadBackend, ReadOp};
use super::{CHUNK_BYTES_MAX, QUEUE_DEPTH_MAX, READS_IN_FLIGHT_MAX, RETRIES_MAX};

/// Largest single registered buffer the kernel accepts (`io_buffer_validate`: 1 GiB); bigger
/// [`AlignedBuf`]s are registered as several consecutive pieces.
pub const FIXED_BUF_BYTES_MAX: usize = 1 << 30;

/// Most buffers one ring may register (`IORING_MAX_REG_BUFFERS`).
pub const FIXED_BUFS_MAX: usize = 1 << 14;

/// How to build a [`UringReader`]. Pass every field explicitly at call sites that matter
/// (house style: no trust in defaults); `Default` is for tests and tools.
#[derive(Clone, Debug)]
pub struct RingOptions {
    /// Chunk SQEs in flight at most; also the ring's SQ size. `1..=QUEUE_DEPTH_MAX`.
    pub queue_depth: u32,
    /// Bytes per SQE; a multiple of the DIO alignment. A logical read bigger than this is split so
    /// several SQEs of it are in flight at once.
    pub chunk_bytes: usize,
    /// Logical reads accepted at once (queued plus in flight). `1..=READS_IN_FLIGHT_MAX`.
    pub ops_max: usize,
    /// Register the files (IORING_REGISTER_FILES) and address them by index.
    pub register_files: bool,
    /// Buffers to register (IORING_REGISTER_BUFFERS) for READ_FIXED. The reader keeps these
    /// `Arc`s, so the memory stays mapped for as long as it is registered.
    pub register_buffers: Vec<Arc<AlignedBuf>>,
    /// Raise the alignment the reader enforces to at least this (0: the device's own).
    pub align_min: u32,
    /// Fault injection for tests.
    pub inject: Option<FaultPlan>,
}

impl Default for RingOptions {
    fn default() -> RingOptions {
        RingOptions {
            queue_depth: 32,
            chunk_bytes: 512 << 10,
            ops_max: 256,
            register_files: true,
            register_buffers: Vec::new(),
            align_min: 0,
            inject: None,
        }
    }
}

/// Which setup flags the kernel accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RingSetup {
    /// `IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_SUBMIT_ALL`.
    SingleIssuerDeferTaskrun,
    /// No setup flags (an older kernel refused the above).
    Plain,
}

/// What the reader ended up using, for the plan printout.
#[derive(Clone, Debug)]
pub struct RingInfo {
    /// Setup flags in effect.
    pub setup: RingSetup,
    /// Files registered; SQEs use fixed file indices.
    pub registered_files: bool,
    /// Buffers registered; reads with a `buf_index` use READ_FIXED.
    pub registered_buffers: bool,
    /// Pieces registered (each at most [`FIXED_BUF_BYTES_MAX`]).
    pub fixed_buffers: usize,
    /// Chunk SQEs in flight at most.
    pub queue_depth: u32,
    /// SQ size the kernel chose (`queue_depth` rounded up to a power of two).
    pub sq_entries: u32,
    /// CQ size the kernel chose (twice the SQ).
    pub cq_entries: u32,
    /// Bytes per SQE.
    pub chunk_bytes: usize,
    /// Alignment enforced on every read.
    pub dio_align: DioAlign,
}

impl fmt::Display for RingInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let yes_no = |b: bool| if b { "yes" } else { "no" };
        write!(
            f,
            "io_uring {:?}, queue depth {} (SQ {}, CQ {}), {:.2} MB chunks, registered files {}, registered buffers {} ({} pieces), DIO alignment mem {} offset {} from {:?}",
            self.setup,
            self.queue_depth,
            self.sq_entries,
            self.cq_entries,
            self.chunk_bytes as f64 / 1e6,
            yes_no(self.registered_files),
            yes_no(self.registered_buffers),
            self.fixed_buffers,
            self.dio_align.mem_align,
            self.dio_align.offset_align,
            self.dio_align.source,
        )
    }
}

/// Counters only the ring side knows.
#[derive(Clone, Copy, Debug, Default)]
struct EnterStats {
    enter_syscalls: u64,
    submit_syscalls: u64,
    retries: u64,
    wait_ns: u64,
}

/// An io_uring O_DIRECT reader owned by one thread.
///
/// It is used from the thread that made it:
///
/// ```no_run
/// # fn main() -> Result<(), k3ring::storage::io::IoError> {
/// use k3ring::storage::io::{RingOptions, UringReader};
/// let reader = UringReader::new(&["/nvme/k3/shard-00001.safetensors".into()], RingOptions::default())?;
/// tracing::info!("{}", reader.info());
/// # Ok(()) }
/// ```
///
/// It cannot be sent to another thread (the ring is `SINGLE_ISSUER`, and its SQ/CQ are used
/// without locks):
///
/// ```compile_fail
/// fn assert_send<T: Send>() {}
/// assert_send::<k3ring::storage::io::UringReader>();
/// ```
pub struct UringReader {
    // Field order is drop order: the ring (and its registrations) goes before the buffers.
    ring: IoUring,
    files: Vec<File>,
    table: OpTable,
    info: RingInfo,
    /// Registered pieces `(start address, len)`, indexed by `buf_index`.
    fixed: Vec<(usize, usize)>,
    enter: EnterStats,
    /// Keeps registered memory mapped while the ring holds it.
    _buffers: Vec<Arc<AlignedBuf>>,
    _not_send: PhantomData<*const ()>,
}

impl UringReader {
    /// Opens `files` for O_DIRECT reads and builds the ring. Fails only if a file cannot be
    /// opened, an option is out of range, or no ring at all can be made; registrations that fail
    /// fall back with one warning.
    pub fn new(files: &[PathBuf], opts: RingOptions) -> Result<UringReader, IoError> {
        check_options(files, &opts)?;
        let (opened, align) = open_direct(files, opts.align_min)?;
        let strictest = align.strictest();
        if !opts.chunk_bytes.is_multiple_of(strictest as usize) {
            let what = "chunk_bytes of the ring options".to_string();
            return Err(IoError::Unaligned { what, value: opts.chunk_bytes as u64, align: strictest });
        }
        let (ring, setup) = build_ring(opts.queue_depth)?;
        let mut failures = Vec::new();
        let registered_files = opts.register_files && register_files(&ring, &opened, &mut failures);
        let fixed = register_buffers(&ring, &opts.register_buffers, &mut failures);
        if !failures.is_empty() {
            tracing::warn!("io_uring falls back to plain READ: {}", failures.join("; "));
        }
        let info = RingInfo {
            setup,
            registered_files,
            registered_buffers: !fixed.is_empty(),
            fixed_buffers: fixed.len(),
            queue_depth: opts.queue_depth,
            sq_entries: ring.params().sq_entries(),
            cq_entries: ring.params().cq_entries(),
            chunk_bytes: opts.chunk_bytes,
            dio_align: align.clone(),
        };
        // Every chunk slot must fit in the SQ and its CQE in the CQ, so pushes never fail and the
        // CQ never overflows.
        assert!(info.sq_entries >= opts.queue_depth);
        assert!(info.cq_entries >= opts.queue_depth);
        let limits =
            TableLimits { ops_max: opts.ops_max, chunk_max: opts.queue_depth, chunk_bytes: opts.chunk_bytes, align };
        let mut table = OpTable::new(files.to_vec(), limits, opts.inject);
        table.set_fixed_buffers(fixed.clone());
        tracing::debug!("{info}");
        Ok(UringReader {
            ring,
            files: opened,
            table,
            info,
            fixed,
            enter: EnterStats::default(),
            _buffers: opts.register_buffers,
            _not_send: PhantomData,
        })
    }

    /// Queues one read; nothing reaches the kernel until [`UringReader::reap`].
    ///
    /// # Safety
    ///
    /// `op.dst..op.dst + op.len` must stay valid, writable and unaliased (no Rust reference to it
    /// may be used) until the [`Completion`] with `op.tag` has been returned by `reap`, or until
    /// the reader has been dropped (drop waits for every read in the kernel).
    pub unsafe fn submit(&mut self, op: ReadOp) -> Result<(), IoError> {
        self.table.accept(op)
    }

    /// Submits queued chunks and waits until at least `wait_for` logical reads have completed
    /// (`wait_for <= in_flight()`), appending them to `out`. Errors of single reads arrive as
    /// completions; `Err` here means the ring itself failed.
    pub fn reap(&mut self, out: &mut Vec<Completion>, wait_for: usize) -> Result<(), IoError> {
        assert!(
            wait_for <= self.table.in_flight(),
            "waiting for {wait_for} reads, {} in flight",
            self.table.in_flight()
        );
        let mut completed = 0;
        let mut enter_failures = 0;
        // The event loop. Each pass submits, or waits for at least one CQE; every op has a finite
        // number of chunk results (chunks x (RETRIES_MAX + len / alignment)), so it ends.
        loop {
            self.fill_sq();
            let want = usize::from(completed < wait_for);
            let to_submit = self.ring.submission().len();
            assert!(want == 0 || self.table.chunks_in_kernel() > 0, "waiting with nothing in the kernel");
            if to_submit > 0 || want > 0 || self.table.chunks_in_kernel() > 0 {
                match self.enter(to_submit, want) {
                    Ok(()) => enter_failures = 0,
                    Err(e) if enter_failures < RETRIES_MAX && is_transient(&e) => enter_failures += 1,
                    Err(source) => return Err(IoError::Enter { what: "reaping reads", source }),
                }
            }
            completed += self.drain_cq(out);
            if completed >= wait_for && !self.table.can_issue() {
                return Ok(());
            }
        }
    }

    /// Logical reads accepted and not yet returned as completions.
    pub fn in_flight(&self) -> usize {
        self.table.in_flight()
    }

    /// Counters since construction.
    pub fn stats(&self) -> IoStats {
        let mut stats = self.table.stats_now();
        stats.enter_syscalls = self.enter.enter_syscalls;
        stats.submit_syscalls = self.enter.submit_syscalls;
        stats.retries += self.enter.retries;
        stats.wait_ns = self.enter.wait_ns;
        stats
    }

    /// What the ring uses: setup flags, registrations, depth, alignment.
    pub fn info(&self) -> &RingInfo {
        &self.info
    }

    /// The registered buffer piece that holds `ptr..ptr + len`, to put in [`ReadOp::buf_index`];
    /// None when buffers are not registered or the range is in none (or straddles two pieces).
    pub fn fixed_buffer_for(&self, ptr: *const u8, len: usize) -> Option<u16> {
        let start = ptr as usize;
        let index = self.fixed.iter().position(|&(base, n)| start >= base && start.saturating_add(len) <= base + n)?;
        u16::try_from(index).ok()
    }

    /// Pushes chunk SQEs while the SQ and the chunk slots have room.
    fn fill_sq(&mut self) {
        let mut sq = self.ring.submission();
        // Bounded by the SQ capacity.
        while !sq.is_full() {
            let Some(req) = self.table.next_chunk() else { break };
            let entry = build_entry(&req, self.files[req.file].as_raw_fd(), self.info.registered_files);
            // SAFETY: the SQE writes `req.dst..req.dst + req.len`, which lies inside a `ReadOp`
            // accepted by `submit`; the caller of `submit` owns that buffer and promised it stays
            // valid, writable and unaliased until the op's Completion is returned. The op cannot
            // complete before this chunk's CQE is folded in by `drain_cq` (the chunk slot stays
            // `Kernel` until then), and `Drop` waits for every outstanding CQE. The fd, or fixed
            // file index, is one of `self.files`, open for the ring's lifetime; a fixed buffer
            // index was checked by `OpTable::validate` to contain the whole op.
            let pushed = unsafe { sq.push(&entry) };
            assert!(pushed.is_ok(), "SQ push failed although the SQ had room");
        }
    }

    /// One `io_uring_enter`: submits `to_submit` SQEs, waits for `want` CQEs, and always runs
    /// deferred task work (GETEVENTS) so finished reads post their CQEs.
    fn enter(&mut self, to_submit: usize, want: usize) -> std::io::Result<()> {
        let started = (want > 0).then(Instant::now);
        // SAFETY: no extended argument is passed (`None`), so the kernel reads no pointer from us;
        // `to_submit` SQEs were pushed and published when the `SubmissionQueue` of `fill_sq` was
        // dropped, and each one's buffer is covered by the argument in `fill_sq`.
        let res = unsafe {
            self.ring.submitter().enter::<libc::sigset_t>(
                to_submit as u32,
                want as u32,
                EnterFlags::GETEVENTS.bits(),
                None,
            )
        };
        self.enter.enter_syscalls += 1;
        self.enter.submit_syscalls += u64::from(to_submit > 0);
        if let Some(started) = started {
            self.enter.wait_ns += started.elapsed().as_nanos() as u64;
        }
        if let Err(e) = &res {
            if is_transient(e) {
                self.enter.retries += 1;
            }
        }
        res.map(|_| ())
    }

    /// Folds every available CQE into the op table. Returns logical reads completed.
    fn drain_cq(&mut self, out: &mut Vec<Completion>) -> usize {
        let mut completed = 0;
        // Bounded by the CQ capacity: the iterator ends at the tail it loaded.
        for cqe in self.ring.completion() {
            let id = cqe.user_data();
            assert!(id <= u64::from(u32::MAX), "CQE with foreign user_data {id}");
            completed += self.table.complete(id as u32, i64::from(cqe.result()), out);
        }
        completed
    }
}

impl ReadBackend for UringReader {
    fn describe(&self) -> String {
        self.info.to_string()
    }

    unsafe fn submit(&mut self, op: ReadOp) -> Result<(), IoError> {
        // SAFETY: the trait's contract is this method's contract, passed on unchanged.
        unsafe { UringReader::submit(self, op) }
    }

    fn reap(&mut self, out: &mut Vec<Completion>, wait_for: usize) -> Result<(), IoError> {
        UringReader::reap(self, out, wait_for)
    }

    fn in_flight(&self) -> usize {
        UringReader::in_flight(self)
    }

    fn stats(&self) -> IoStats {
        UringReader::stats(self)
    }

    fn dio_align(&self) -> DioAlign {
        self.info.dio_align.clone()
    }
}

impl Drop for UringReader {
    /// Waits for every chunk in the kernel: each writes into a caller's buffer, which the caller
    /// may free as soon as the reader is gone. Queued chunks never issued are dropped unread.
    fn drop(&mut self) {
        let mut discarded = Vec::new();
        let mut failures = 0;
        // Bounded: each pass reaps at least one CQE or counts a failure.
        while self.table.chunks_in_kernel() > 0 && failures <= RETRIES_MAX {
            let to_submit = self.ring.submission().len();
            if self.enter(to_submit, 1).is_err() {
                failures += 1;
            }
            // Chunks a CQE sends back to the retry queue are not reissued: they leave the kernel.
            self.drain_cq(&mut discarded);
        }
        if self.table.chunks_in_kernel() > 0 {
            tracing::error!(
                "io_uring reader dropped with {} reads still in the kernel; their buffers may still be written",
                self.table.chunks_in_kernel()
            );
        }
    }
}

fn check_options(files: &[PathBuf], opts: &RingOptions) -> Result<(), IoError> {
    let bad = |why: String| Err(IoError::Setup { what: why, source: std::io::Error::from_raw_os_error(libc::EINVAL) });
    if files.is_empty() || files.len() > u32::MAX as usize {
        return bad(format!("an io_uring reader over {} files", files.len()));
    }
    if opts.queue_depth == 0 || opts.queue_depth > QUEUE_DEPTH_MAX {
        return bad(format!("io_uring queue depth {} (allowed 1..={QUEUE_DEPTH_MAX})", opts.queue_depth));
    }
    if opts.ops_max == 0 || opts.ops_max > READS_IN_FLIGHT_MAX {
        return bad(format!("{} reads in flight (allowed 1..={READS_IN_FLIGHT_MAX})", opts.ops_max));
    }
    if opts.chunk_bytes == 0 || opts.chunk_bytes > CHUNK_BYTES_MAX {
        return bad(format!("io_uring chunk of {} bytes (allowed 1..={CHUNK_BYTES_MAX})", opts.chunk_bytes));
    }
    Ok(())
}

fn is_transient(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY))
}

/// A ring with `SINGLE_ISSUER | DEFER_TASKRUN | SUBMIT_ALL` (6.1+), else a plain one.
fn build_ring(queue_depth: u32) -> Result<(IoUring, RingSetup), IoError> {
    let fast = IoUring::builder().setup_single_issuer().setup_defer_taskrun().setup_submit_all().build(queue_depth);
    match fast {
        Ok(ring) => Ok((ring, RingSetup::SingleIssuerDeferTaskrun)),
        Err(refused) => {
            tracing::debug!("io_uring SINGLE_ISSUER|DEFER_TASKRUN refused ({refused}); using a plain ring");
            let ring = IoUring::new(queue_depth).map_err(|source| IoError::Setup {
                what: format!("an io_uring with {queue_depth} entries (is io_uring disabled by /proc/sys/kernel/io_uring_disabled?)"),
                source,
            })?;
            Ok((ring, RingSetup::Plain))
        }
    }
}

fn register_files(ring: &IoUring, files: &[File], failures: &mut Vec<String>) -> bool {
    let fds: Vec<RawFd> = files.iter().map(|f| f.as_raw_fd()).collect();
    match ring.submitter().register_files(&fds) {
        Ok(()) => true,
        Err(e) => {
            failures.push(format!("registering {} files failed ({e})", fds.len()));
            false
        }
    }
}

/// Registers `buffers` cut into pieces of at most [`FIXED_BUF_BYTES_MAX`]; returns the pieces, or
/// none when registration failed.
fn register_buffers(ring: &IoUring, buffers: &[Arc<AlignedBuf>], failures: &mut Vec<String>) -> Vec<(usize, usize)> {
    let mut pieces = Vec::new();
    for buf in buffers {
        let (base, len) = (buf.as_mut_ptr() as usize, buf.mapped_len());
        for start in (0..len).step_by(FIXED_BUF_BYTES_MAX) {
            pieces.push((base + start, (len - start).min(FIXED_BUF_BYTES_MAX)));
        }
    }
    if pieces.is_empty() {
        return pieces;
    }
    if pieces.len() > FIXED_BUFS_MAX {
        failures.push(format!("{} buffer pieces exceed the kernel's {FIXED_BUFS_MAX}", pieces.len()));
        return Vec::new();
    }
    let iovecs: Vec<libc::iovec> =
        pieces.iter().map(|&(base, len)| libc::iovec { iov_base: base as *mut libc::c_void, iov_len: len }).collect();
    // SAFETY: every iovec covers part of a live `AlignedBuf` mapping whose `Arc` the reader keeps
    // (`_buffers`) until after the ring, and with it the registration, is dropped.
    match unsafe { ring.submitter().register_buffers(&iovecs) } {
        Ok(()) => pieces,
        Err(e) => {
            let bytes: usize = pieces.iter().map(|p| p.1).sum();
            let hint = if e.raw_os_error() == Some(libc::ENOMEM) {
                match super::buffer::memlock_limit() {
                    Some(have) => format!(": {}", IoError::MemLock { have, need: bytes as u64 }),
                    None => String::new(),
                }
            } else {
                String::new()
            };
            failures.push(format!("registering {} of buffers failed ({e}){hint}", super::fmt_bytes(bytes as u64)));
            Vec::new()
        }
    }
}

fn build_entry(req: &ChunkReq, fd: RawFd, fixed_files: bool) -> squeue::Entry {
    let fixed = types::Fixed(req.file as u32);
    let entry = match (fixed_files, req.buf_index) {
        (true, Some(index)) => opcode::ReadFixed::new(fixed, req.dst, req.len, index).offset(req.offset).build(),
        (false, Some(index)) => {
            opcode::ReadFixed::new(types::Fd(fd), req.dst, req.len, index).offset(req.offset).build()
        }
        (true, None) => opcode::Read::new(fixed, req.dst, req.len).offset(req.offset).build(),
        (false, None) => opcode::Read::new(types::Fd(fd), req.dst, req.len).offset(req.offset).build(),
    };
    entry.user_data(u64::from(req.id))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]
mod tests {
    use super::*;
    use crate::exit::{Classify, ExitCode};
    use crate::storage::io::testutil::{buffer_for, check_plan, plan, run_plan, write_pattern};
    use crate::storage::io::BufOptions;

    fn is_root() -> bool {
        // SAFETY: geteuid has no preconditions and cannot fail.
        unsafe { libc::geteuid() == 0 }
    }

    #[test]
    fn registered_and_plain_files_and_buffers_all_read_right() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let files = vec![(4u64 << 20, 0u64), (2u64 << 20, 5u64)];
        let paths: Vec<PathBuf> = files
            .iter()
            .enumerate()
            .map(|(i, &(len, salt))| write_pattern(dir.path(), &format!("r{i}"), len, salt))
            .collect();
        for register_files in [false, true] {
            for register_bufs in [false, true] {
                let planned = plan(11, 40, &files, 4096, 256 << 10);
                let buf = Arc::new(buffer_for(&planned));
                let register_buffers = if register_bufs { vec![Arc::clone(&buf)] } else { Vec::new() };
                let opts = RingOptions {
                    queue_depth: 16,
                    chunk_bytes: 32 << 10,
                    register_files,
                    register_buffers,
                    ..RingOptions::default()
                };
                let mut reader = UringReader::new(&paths, opts).unwrap();
                let info = reader.info().clone();
                assert_eq!(info.registered_files, register_files, "{info}");
                if register_bufs && (is_root() || buffer_memlock_unlimited()) {
                    assert!(info.registered_buffers, "{info}");
                }
                let index = reader.fixed_buffer_for(buf.as_ptr(), buf.len());
                assert_eq!(index.is_some(), info.registered_buffers);
                let got = run_plan(&mut reader, &planned, 16, index, &buf);
                check_plan(&planned, &got);
                eprintln!("{info}");
            }
        }
    }

    fn buffer_memlock_unlimited() -> bool {
        crate::storage::io::buffer::memlock_limit().is_none()
    }

    #[test]
    fn fixed_buffer_index_must_contain_the_destination() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let path = write_pattern(dir.path(), "a", 1 << 20, 0);
        let registered = Arc::new(AlignedBuf::new(1 << 20, &BufOptions::default()).unwrap());
        let other = AlignedBuf::new(1 << 20, &BufOptions::default()).unwrap();
        let opts = RingOptions { register_buffers: vec![Arc::clone(&registered)], ..RingOptions::default() };
        let mut reader = UringReader::new(&[path], opts).unwrap();
        if !reader.info().registered_buffers {
            eprintln!("SKIPPED: buffer registration refused here: {}", reader.info());
            return;
        }
        assert_eq!(reader.fixed_buffer_for(other.as_ptr(), 4096), None);
        let op = ReadOp { buf_index: Some(0), ..ReadOp::new(0, 0, 4096, other.as_mut_ptr(), 1) };
        // SAFETY: refused before queuing.
        let err = unsafe { reader.submit(op) }.unwrap_err();
        assert!(err.to_string().contains("not inside registered buffer 0"), "{err}");
        let op = ReadOp { buf_index: Some(3), ..ReadOp::new(0, 0, 4096, registered.as_mut_ptr(), 2) };
        // SAFETY: refused before queuing.
        let err = unsafe { reader.submit(op) }.unwrap_err();
        assert!(err.to_string().contains("buf_index 3 but 1 buffers are registered"), "{err}");
    }

    /// Proof that io_uring does the reads and batches them: 64 single-chunk reads go to the kernel
    /// in a handful of `io_uring_enter` calls.
    #[test]
    fn sqes_are_batched_into_few_submit_syscalls() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let path = write_pattern(dir.path(), "b", 1 << 20, 0);
        let opts = RingOptions { queue_depth: 32, chunk_bytes: 64 << 10, ops_max: 64, ..RingOptions::default() };
        let mut reader = UringReader::new(&[path], opts).unwrap();
        let buf = AlignedBuf::new(64 * 16384, &BufOptions::default()).unwrap();
        for i in 0..64u64 {
            let op = ReadOp::new(0, i * 16384, 16384, buf.as_mut_ptr().wrapping_add(i as usize * 16384), i);
            // SAFETY: each read has its own 16 KiB of `buf`, which outlives the reader's use.
            unsafe { reader.submit(op) }.unwrap();
        }
        assert_eq!(reader.stats().sqes_submitted, 0, "submit only queues");
        let mut out = Vec::with_capacity(64);
        reader.reap(&mut out, 64).unwrap();
        assert!(out.iter().all(|c| c.result.is_ok()));
        let stats = reader.stats();
        eprintln!("{stats:?}");
        assert_eq!(stats.ops, 64);
        assert_eq!(stats.sqes_submitted, 64);
        assert!(stats.submit_syscalls > 0, "{stats:?}");
        assert!(stats.submit_syscalls < stats.ops, "{stats:?}");
        assert!(stats.enter_syscalls >= stats.submit_syscalls);
        assert_eq!(stats.bytes_read, 64 * 16384);
        assert!(stats.busy_ns > 0);
    }

    #[test]
    fn options_out_of_range_are_refused() {
        let dir = tempfile::tempdir_in("/tmp").unwrap();
        let path = write_pattern(dir.path(), "c", 8192, 0);
        let paths = [path];
        let err = UringReader::new(&paths, RingOptions { queue_depth: 0, ..RingOptions::default() }).err().unwrap();
        assert!(err.to_string().starts_with("cannot set up io_uring queue depth 0"), "{err}");
        let err = UringReader::new(&paths, RingOptions { chunk_bytes: 1000, ..RingOptions::default() }).err().unwrap();
        assert!(matches!(err, IoError::Unaligned { value: 1000, .. }), "{err}");
        let missing = [dir.path().join("missing")];
        let err = UringReader::new(&missing, RingOptions::default()).err().unwrap();
        assert!(
            err.to_string().starts_with(&format!("cannot open {} for O_DIRECT reads", missing[0].display())),
            "{err}"
        );
        assert_eq!(err.exit_code(), ExitCode::Io);
    }
}
