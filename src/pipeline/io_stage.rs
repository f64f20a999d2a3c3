//! The I/O stage: one thread that owns a read backend (an io_uring ring must be used by the
//! thread that made it), takes batches of reads over a bounded channel, keeps the backend's queue
//! busy with demand reads first, then trunk read-ahead, then guesses, and reports each batch's
//! completion through a ticket table that compute threads test or wait on. It implements the
//! store's [`ReadQueue`].
//!
//! Threads: the `k3ring-io` thread runs [`run`], the event loop; any thread may submit, test,
//! wait or cancel. Allocation: the queues and the in-backend table grow to their high-water
//! mark; each batch arrives as its own op list.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use serde::Serialize;

use crate::storage::io::{
    align::open_direct, sim::SimOptions, AlignedBuf, Completion, FaultPlan, IoError, IoStats, MappedReader,
    PreadOptions, PreadReader, ReadBackend, RingOptions, SimReader, UringReader,
};
use crate::storage::stream::reads::{OpMeta, Priority, ReadQueue, SendOp, Ticket};
use crate::storage::stream::StreamError;
use crate::trace::{SpanArgs, SpanKind, Tracer};

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

/// Logical reads the backend accepts at once.
const OPS_IN_BACKEND_MAX: usize = 256;

/// Most batches waiting in the channel.
const CHANNEL_BATCHES_MAX: usize = 1024;

/// How often the backend's counters are copied out while reads complete.
const STATS_PERIOD_MS: u128 = 5;

/// The alignment every read must have for `files` (the simulator enforces its own).
pub fn read_alignment(files: &[PathBuf], opts: &IoOptions) -> Result<u64, StreamError> {
    if opts.kind == IoKind::Sim {
        return Ok(opts.sim.as_ref().map_or(4096, |s| u64::from(s.align)).max(512));
    }
    let (_files, align) = open_direct(files, 0)?;
    Ok(u64::from(align.strictest()).max(512))
}

/// How a batch ended.
#[derive(Debug)]
enum TicketState {
    Pending { remaining: usize, error: Option<IoError> },
    Done(Result<(), Arc<IoError>>),
}

#[derive(Default)]
struct Tickets {
    next: Ticket,
    states: HashMap<Ticket, TicketState>,
    /// Set when the I/O thread stopped (its backend failed as a whole); waiters get this.
    dead: Option<String>,
}

/// Shared between the handle and the I/O thread.
struct Shared {
    tickets: Mutex<Tickets>,
    done: Condvar,
    stats: Mutex<IoStats>,
    /// Bytes sent to the I/O thread and not yet completed (queued or in the device).
    outstanding_bytes: AtomicUsize,
    /// Bytes of cancelled reads that never entered the device.
    cancelled_bytes: AtomicU64,
    /// Nanoseconds (since `epoch`) during which demand or read-ahead reads were queued or in
    /// the device, closed periods only; and the start of the open period (0: none).
    needed_busy_ns: AtomicU64,
    needed_busy_since_ns: AtomicU64,
    epoch: Instant,
    /// Reads completed and recorded in the trace; with `outstanding_bytes` at 0 and the
    /// published stats counting as many ops, the trace and the report agree (see `settle`).
    reads_traced: AtomicU64,
}

impl Shared {
    fn now_ns(&self) -> u64 {
        // At least 1, so that 0 can mean "no open period".
        (self.epoch.elapsed().as_nanos() as u64).max(1)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks leaves plain counters behind; keep going.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

enum Msg {
    /// One submission: reads, each with the ticket that completes when all of its reads have.
    Batch {
        priority: Priority,
        ops: Vec<(Ticket, SendOp)>,
    },
    /// Drop the reads of a ticket that are not in the backend yet.
    Cancel(Ticket),
    /// Move the queued reads of a ticket ahead of every other queued read.
    Promote(Ticket),
    Stop,
}

/// Handle to the I/O thread.
pub struct IoStage {
    /// What the backend uses, as it described itself.
    pub backend_info: String,
    tx: SyncSender<Msg>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// Memory the reads target. Dropped only after `Drop` has joined the I/O thread (which
    /// waits for every read in the backend), so no read can outlive its buffer.
    _targets: Vec<Arc<AlignedBuf>>,
}

/// Marks the stage dead and wakes every waiter when the I/O thread exits for any reason,
/// including a panic, so that no compute thread waits forever.
struct DeadOnExit(Arc<Shared>);

impl Drop for DeadOnExit {
    fn drop(&mut self) {
        let mut t = lock(&self.0.tickets);
        if std::thread::panicking() {
            t.dead = Some("the I/O thread panicked".to_owned());
        } else {
            t.dead.get_or_insert_with(|| "the I/O thread has stopped".to_owned());
        }
        drop(t);
        self.0.done.notify_all();
    }
}

/// Builds the backend on the I/O thread (a ring must live on the thread that uses it).
type BackendFactory = Box<dyn FnOnce() -> Result<Box<dyn ReadBackend>, IoError> + Send>;

impl IoStage {
    /// Starts the I/O thread over `files`, reading into `arena` with reads aligned to `align`;
    /// fails if its backend cannot be built.
    pub fn start(
        files: &[PathBuf],
        opts: &IoOptions,
        arena: &Arc<AlignedBuf>,
        align: u64,
        tracer: Arc<Tracer>,
    ) -> Result<IoStage, IoError> {
        let files = files.to_vec();
        let qd = opts.queue_depth.max(1);
        let chunk = (opts.chunk_bytes as u64).max(align) / align * align;
        let (inject, kind, sim, threads) = (opts.inject, opts.kind, opts.sim.clone(), opts.pread_threads.max(1));
        let registered = Arc::clone(arena);
        let factory: BackendFactory = Box::new(move || -> Result<Box<dyn ReadBackend>, IoError> {
            Ok(match kind {
                IoKind::Uring => Box::new(UringReader::new(
                    &files,
                    RingOptions {
                        queue_depth: qd,
                        chunk_bytes: chunk as usize,
                        ops_max: OPS_IN_BACKEND_MAX,
                        register_files: true,
                        register_buffers: vec![registered],
                        align_min: align as u32,
                        inject,
                    },
                )?),
                IoKind::Pread => Box::new(PreadReader::new(
                    &files,
                    PreadOptions {
                        threads,
                        queue_depth: qd,
                        chunk_bytes: chunk as usize,
                        ops_max: OPS_IN_BACKEND_MAX,
                        align_min: align as u32,
                        inject,
                    },
                )?),
                IoKind::Mmap => Box::new(MappedReader::new(&files, OPS_IN_BACKEND_MAX)?),
                IoKind::Sim => {
                    let opts = sim.unwrap_or_else(|| SimOptions::fault_free(0));
                    Box::new(SimReader::new(&files, opts)?)
                }
            })
        });
        let window = qd as usize * chunk as usize;
        IoStage::spawn(factory, window, chunk as usize, opts.io_core, tracer, vec![Arc::clone(arena)])
    }

    /// Starts the thread; it keeps up to `bytes_in_backend_max` bytes of reads in the backend
    /// (at least one read), and hands read-ahead and guesses to it in pieces of `piece_bytes`
    /// (see [`Limits`]).
    fn spawn(
        factory: BackendFactory,
        bytes_in_backend_max: usize,
        piece_bytes: usize,
        pin_to: Option<usize>,
        tracer: Arc<Tracer>,
        targets: Vec<Arc<AlignedBuf>>,
    ) -> Result<IoStage, IoError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(CHANNEL_BATCHES_MAX);
        let shared = Arc::new(Shared {
            tickets: Mutex::default(),
            done: Condvar::new(),
            stats: Mutex::default(),
            outstanding_bytes: AtomicUsize::new(0),
            cancelled_bytes: AtomicU64::new(0),
            needed_busy_ns: AtomicU64::new(0),
            needed_busy_since_ns: AtomicU64::new(0),
            epoch: Instant::now(),
            reads_traced: AtomicU64::new(0),
        });
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("k3ring-io".to_owned())
            .spawn(move || {
                let _dead_on_exit = DeadOnExit(Arc::clone(&thread_shared));
                if let Some(cpu) = pin_to {
                    if !core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
                        tracing::warn!("could not pin the I/O thread to CPU {cpu}");
                    }
                }
                match factory() {
                    Ok(backend) => {
                        let _ = ready_tx.send(Ok(backend.describe()));
                        let limits = Limits::new(bytes_in_backend_max, piece_bytes);
                        run(backend, rx, &thread_shared, limits, &tracer);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .map_err(|source| IoError::Setup { what: "the I/O thread".to_owned(), source })?;
        match ready_rx.recv() {
            Ok(Ok(backend_info)) => Ok(IoStage { backend_info, tx, shared, thread: Some(thread), _targets: targets }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err(IoError::Setup {
                what: "the I/O thread".to_owned(),
                source: std::io::Error::other("it exited before reporting"),
            }),
        }
    }

    /// Bytes of reads sent and not yet completed: above the device's window, the device is
    /// saturated and a guess would only delay the reads compute is waiting for.
    pub fn outstanding_bytes(&self) -> usize {
        self.shared.outstanding_bytes.load(Ordering::Relaxed)
    }

    /// Bytes of cancelled reads that never reached the device.
    pub fn cancelled_bytes(&self) -> u64 {
        self.shared.cancelled_bytes.load(Ordering::Relaxed)
    }

    /// A clock reading and the device time spent so far on reads compute needs (demand and
    /// trunk read-ahead queued or in the device), both in nanoseconds since the stage started:
    /// between two readings, the difference of the second minus that of the first is the time
    /// the device had for guesses.
    pub fn needed_busy(&self) -> (u64, u64) {
        let now = self.shared.now_ns();
        let closed = self.shared.needed_busy_ns.load(Ordering::Acquire);
        let since = self.shared.needed_busy_since_ns.load(Ordering::Acquire);
        let open = if since > 0 { now.saturating_sub(since) } else { 0 };
        (now, closed + open)
    }

    /// Tickets held (finished or not), for tests that check the table does not grow.
    pub fn tickets_held(&self) -> usize {
        lock(&self.shared.tickets).states.len()
    }

    /// The backend's counters as of its last report.
    pub fn stats(&self) -> IoStats {
        *lock(&self.shared.stats)
    }

    /// Waits (at most `timeout`) until no read is queued or in the device and the published
    /// counters include every read the trace recorded, so that a report taken next agrees with
    /// the trace. Returns whether it settled; a run's end calls it, when nothing sends reads.
    pub fn settle(&self, timeout: std::time::Duration) -> bool {
        let start = Instant::now();
        loop {
            let idle = self.outstanding_bytes() == 0;
            if idle && self.stats().ops == self.shared.reads_traced.load(Ordering::Acquire) {
                return true;
            }
            if start.elapsed() >= timeout {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    fn mark_dead(&self) {
        let mut t = lock(&self.shared.tickets);
        t.dead.get_or_insert_with(|| "the I/O thread has stopped".to_owned());
        drop(t);
        self.shared.done.notify_all();
    }
}

impl ReadQueue for IoStage {
    fn reserve(&self) -> Ticket {
        let mut t = lock(&self.shared.tickets);
        t.next += 1;
        let ticket = t.next;
        t.states.insert(ticket, TicketState::Pending { remaining: usize::MAX, error: None });
        ticket
    }

    fn submit(&self, priority: Priority, groups: Vec<(Ticket, Vec<SendOp>)>) {
        let mut ops = Vec::with_capacity(groups.iter().map(|g| g.1.len()).sum());
        {
            let mut t = lock(&self.shared.tickets);
            for (ticket, group) in groups {
                if group.is_empty() {
                    // An unknown ticket is a finished success: keep nothing.
                    t.states.remove(&ticket);
                } else {
                    t.states.insert(ticket, TicketState::Pending { remaining: group.len(), error: None });
                    ops.extend(group.into_iter().map(|op| (ticket, op)));
                }
            }
        }
        let bytes: usize = ops.iter().map(|o| o.1.len()).sum();
        self.shared.outstanding_bytes.fetch_add(bytes, Ordering::Relaxed);
        if ops.is_empty() {
            self.shared.done.notify_all();
        } else if self.tx.send(Msg::Batch { priority, ops }).is_err() {
            self.mark_dead();
        }
    }

    fn is_done(&self, ticket: Ticket) -> bool {
        let t = lock(&self.shared.tickets);
        !matches!(t.states.get(&ticket), Some(TicketState::Pending { .. }))
    }

    /// A success is forgotten once seen (several slots may share a ticket: an unknown ticket is
    /// a finished success); a failure stays.
    fn wait(&self, ticket: Ticket) -> Result<(), Arc<IoError>> {
        let mut t = lock(&self.shared.tickets);
        // The event loop of a waiter: bounded by the ticket completing or the stage dying.
        loop {
            match t.states.get(&ticket) {
                Some(TicketState::Done(Err(e))) => return Err(Arc::clone(e)),
                Some(TicketState::Done(Ok(()))) => {
                    t.states.remove(&ticket);
                    return Ok(());
                }
                None => return Ok(()),
                Some(TicketState::Pending { .. }) => {
                    if let Some(why) = &t.dead {
                        return Err(Arc::new(IoError::Setup {
                            what: "reads".to_owned(),
                            source: std::io::Error::other(why.clone()),
                        }));
                    }
                    t = self.shared.done.wait(t).unwrap_or_else(PoisonError::into_inner);
                }
            }
        }
    }

    /// Failures are kept: whoever needed those bytes must see the error.
    fn forget(&self, ticket: Ticket) {
        let mut t = lock(&self.shared.tickets);
        if matches!(t.states.get(&ticket), Some(TicketState::Done(Ok(())))) {
            t.states.remove(&ticket);
        }
    }

    fn cancel(&self, ticket: Ticket) {
        if self.tx.send(Msg::Cancel(ticket)).is_err() {
            self.mark_dead();
        }
    }

    fn promote(&self, ticket: Ticket) {
        if self.tx.send(Msg::Promote(ticket)).is_err() {
            self.mark_dead();
        }
    }
}

impl Drop for IoStage {
    fn drop(&mut self) {
        let _ = self.tx.send(Msg::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How much the I/O thread keeps in the backend.
///
/// Demand reads enter whole, as soon as they arrive, up to `bytes_max`. Read-ahead and guesses
/// enter in pieces of `piece_bytes` (one chunk of the backend), only while no demand read waits
/// in the queue and only up to `bytes_max` in all, so every piece in the backend is already in
/// the device: a demand read that arrives waits for no queued piece, only for a chunk slot to
/// free, which takes about one chunk. Guesses enter only while no demand read is in the backend
/// either, at most `guess_pieces_max` at once.
#[derive(Clone, Copy, Debug)]
struct Limits {
    ops_max: usize,
    bytes_max: usize,
    piece_bytes: usize,
    guess_pieces_max: usize,
}

/// Share of the backend's window guesses may fill (as pieces in the device at once). All of
/// it: a demand read still jumps ahead of every queued piece, and a guess read that takes the
/// whole device is over sooner (on a virtual machine, reads in flight slow compute while they
/// last, however many).
const GUESS_WINDOW_DIVISOR: usize = 1;

impl Limits {
    fn new(bytes_max: usize, piece_bytes: usize) -> Limits {
        let piece_bytes = piece_bytes.max(1);
        let pieces = (bytes_max / piece_bytes).max(1);
        Limits {
            ops_max: OPS_IN_BACKEND_MAX,
            bytes_max,
            piece_bytes,
            guess_pieces_max: (pieces / GUESS_WINDOW_DIVISOR).max(1),
        }
    }
}

/// One read in the backend.
struct InBackend {
    ticket: Ticket,
    len: usize,
    meta: OpMeta,
    start_us: f64,
    priority: Priority,
}

/// The I/O thread's queues, by priority, and what is in the backend.
struct Queues {
    demand: VecDeque<(Ticket, SendOp)>,
    prefetch: VecDeque<(Ticket, SendOp)>,
    guess: VecDeque<(Ticket, SendOp)>,
    in_backend: HashMap<u64, InBackend>,
    /// Reads in the backend by priority (demand, read-ahead, guess), and their bytes.
    in_backend_by_priority: [usize; 3],
    bytes_in_backend_by_priority: [usize; 3],
    bytes_in_backend: usize,
    next_tag: u64,
}

fn priority_index(p: Priority) -> usize {
    match p {
        Priority::Demand => 0,
        Priority::Prefetch => 1,
        Priority::Guess => 2,
    }
}

impl Queues {
    fn new(ops_max: usize) -> Queues {
        Queues {
            demand: VecDeque::new(),
            prefetch: VecDeque::new(),
            guess: VecDeque::new(),
            in_backend: HashMap::with_capacity(ops_max),
            in_backend_by_priority: [0; 3],
            bytes_in_backend_by_priority: [0; 3],
            bytes_in_backend: 0,
            next_tag: 0,
        }
    }

    fn queued(&self) -> bool {
        !(self.demand.is_empty() && self.prefetch.is_empty() && self.guess.is_empty())
    }

    /// Reads compute needs (demand and read-ahead) queued or in the backend.
    fn needed(&self) -> usize {
        self.demand.len() + self.prefetch.len() + self.in_backend_by_priority[0] + self.in_backend_by_priority[1]
    }

    fn queue(&mut self, priority: Priority) -> &mut VecDeque<(Ticket, SendOp)> {
        match priority {
            Priority::Demand => &mut self.demand,
            Priority::Prefetch => &mut self.prefetch,
            Priority::Guess => &mut self.guess,
        }
    }

    /// The next read to put in the backend, if the limits let one in (see [`Limits`]).
    fn next(&mut self, limits: &Limits, backend_in_flight: usize) -> Option<(Ticket, SendOp, Priority)> {
        if backend_in_flight >= limits.ops_max {
            return None;
        }
        let empty = backend_in_flight == 0;
        if !self.demand.is_empty() {
            if empty || self.bytes_in_backend_by_priority[0] < limits.bytes_max {
                return self.demand.pop_front().map(|(t, op)| (t, op, Priority::Demand));
            }
            return None;
        }
        let fits = |len: usize| empty || self.bytes_in_backend + len <= limits.bytes_max;
        if self.prefetch.front().is_some_and(|(_, op)| fits(op.len())) {
            return self.prefetch.pop_front().map(|(t, op)| (t, op, Priority::Prefetch));
        }
        let guess_may_enter = self.prefetch.is_empty()
            && self.in_backend_by_priority[0] == 0
            && self.in_backend_by_priority[2] < limits.guess_pieces_max;
        if guess_may_enter && self.guess.front().is_some_and(|(_, op)| fits(op.len())) {
            return self.guess.pop_front().map(|(t, op)| (t, op, Priority::Guess));
        }
        None
    }
}

/// The I/O thread's loop: the event loop of the I/O stage (bounded by Stop or a closed channel).
fn run(mut backend: Box<dyn ReadBackend>, rx: Receiver<Msg>, shared: &Shared, limits: Limits, tracer: &Tracer) {
    let mut q = Queues::new(limits.ops_max);
    let mut done: Vec<Completion> = Vec::with_capacity(limits.ops_max);
    let mut stopping = false;
    let mut last_stats = Instant::now();
    loop {
        // Take new batches: block only when nothing is queued or in flight.
        let idle = !q.queued() && backend.in_flight() == 0;
        if stopping && idle {
            break;
        }
        let first = if idle { rx.recv().ok() } else { None };
        if idle && first.is_none() {
            break;
        }
        stopping |= take_messages(first, &rx, &mut q, shared, &limits);
        account_needed(&q, shared);
        fill_backend(&mut *backend, &mut q, shared, &limits, tracer);
        if backend.in_flight() == 0 {
            continue;
        }
        done.clear();
        if let Err(e) = backend.reap(&mut done, 1) {
            // The backend as a whole failed: fail every waiter, loudly.
            let mut t = lock(&shared.tickets);
            t.dead = Some(format!("the read backend failed: {e}"));
            drop(t);
            shared.done.notify_all();
            break;
        }
        let now = tracer.now_us();
        for c in done.drain(..) {
            let entry = q.in_backend.remove(&c.tag);
            assert!(entry.is_some(), "completion for unknown read tag {}", c.tag);
            if let Some(r) = entry {
                q.bytes_in_backend -= r.len;
                q.in_backend_by_priority[priority_index(r.priority)] -= 1;
                q.bytes_in_backend_by_priority[priority_index(r.priority)] -= r.len;
                shared.outstanding_bytes.fetch_sub(r.len, Ordering::Relaxed);
                let mut args = SpanArgs::new().bytes(r.len as u64).kind(r.meta.kind);
                args.layer = r.meta.layer;
                args.expert = r.meta.expert;
                // Up to the queue depth of reads overlap on this one thread: async slices.
                tracer.complete_async(SpanKind::Io(r.meta.name), r.start_us, now.max(r.start_us), args);
                shared.reads_traced.fetch_add(1, Ordering::Release);
                finish_one(shared, r.ticket, c.result);
            }
        }
        account_needed(&q, shared);
        tracer.counter("bytes in flight", q.bytes_in_backend as f64);
        if last_stats.elapsed().as_millis() >= STATS_PERIOD_MS || backend.in_flight() == 0 {
            *lock(&shared.stats) = backend.stats();
            last_stats = Instant::now();
        }
    }
    account_needed(&Queues::new(0), shared);
    *lock(&shared.stats) = backend.stats();
}

/// Opens or closes the period during which reads compute needs are outstanding.
fn account_needed(q: &Queues, shared: &Shared) {
    let since = shared.needed_busy_since_ns.load(Ordering::Relaxed);
    match (q.needed() > 0, since > 0) {
        (true, false) => shared.needed_busy_since_ns.store(shared.now_ns(), Ordering::Release),
        (false, true) => {
            let now = shared.now_ns();
            shared.needed_busy_ns.fetch_add(now.saturating_sub(since), Ordering::AcqRel);
            shared.needed_busy_since_ns.store(0, Ordering::Release);
        }
        _ => {}
    }
}

/// Moves `first` and every message waiting in the channel into the queues; returns whether the
/// stage is stopping.
fn take_messages(first: Option<Msg>, rx: &Receiver<Msg>, q: &mut Queues, shared: &Shared, limits: &Limits) -> bool {
    let mut stopping = false;
    let mut next = first;
    loop {
        let msg = match next.take() {
            Some(m) => m,
            None => match rx.try_recv() {
                Ok(m) => m,
                Err(TryRecvError::Empty) => return stopping,
                Err(TryRecvError::Disconnected) => return true,
            },
        };
        match msg {
            Msg::Stop => {
                // Reads not yet in the backend are dropped: the store is closing.
                stopping = true;
                for (ticket, op) in q.demand.drain(..).chain(q.prefetch.drain(..)).chain(q.guess.drain(..)) {
                    shared.outstanding_bytes.fetch_sub(op.len(), Ordering::Relaxed);
                    let closed = std::io::Error::other("the store closed");
                    finish_one(shared, ticket, Err(IoError::Setup { what: "a read".to_owned(), source: closed }));
                }
            }
            Msg::Batch { priority: Priority::Demand, ops } => q.demand.extend(ops),
            Msg::Batch { priority, ops } => {
                // Read-ahead and guesses go in pieces, so a demand read that arrives jumps ahead
                // of every piece not yet in the device.
                for (ticket, op) in ops {
                    let pieces = op.split(limits.piece_bytes);
                    add_reads(shared, ticket, pieces.len() - 1);
                    q.queue(priority).extend(pieces.into_iter().map(|p| (ticket, p)));
                }
            }
            Msg::Cancel(ticket) => cancel_queued(q, shared, ticket),
            Msg::Promote(ticket) => promote_queued(q, ticket),
        }
    }
}

/// Drops the queued reads of `ticket`; each counts as done (successfully: nobody reads a
/// cancelled slot, and a success is forgotten when the slot is reused).
fn cancel_queued(q: &mut Queues, shared: &Shared, ticket: Ticket) {
    for queue in [&mut q.demand, &mut q.prefetch, &mut q.guess] {
        let mut dropped = Vec::new();
        queue.retain(|(t, op)| {
            let keep = *t != ticket;
            if !keep {
                dropped.push(op.len());
            }
            keep
        });
        for len in dropped {
            shared.outstanding_bytes.fetch_sub(len, Ordering::Relaxed);
            shared.cancelled_bytes.fetch_add(len as u64, Ordering::Relaxed);
            finish_one(shared, ticket, Ok(()));
        }
    }
}

/// Moves the queued reads of `ticket` to the front of the demand queue, in their order.
fn promote_queued(q: &mut Queues, ticket: Ticket) {
    let mut moved: Vec<(Ticket, SendOp)> = Vec::new();
    for queue in [&mut q.prefetch, &mut q.guess] {
        let mut i = 0;
        while i < queue.len() {
            if queue[i].0 == ticket {
                if let Some(entry) = queue.remove(i) {
                    moved.push(entry);
                }
            } else {
                i += 1;
            }
        }
    }
    for entry in moved.into_iter().rev() {
        q.demand.push_front(entry);
    }
}

/// Keeps the backend busy within the limits.
fn fill_backend(backend: &mut dyn ReadBackend, q: &mut Queues, shared: &Shared, limits: &Limits, tracer: &Tracer) {
    // Bounded: each turn moves one queued read into the backend or stops.
    while let Some((ticket, send, priority)) = q.next(limits, backend.in_flight()) {
        let (len, meta) = (send.len(), send.meta());
        q.next_tag += 1;
        let tag = q.next_tag;
        match send.submit(backend, tag) {
            Ok(()) => {
                let start_us = tracer.now_us();
                q.in_backend.insert(tag, InBackend { ticket, len, meta, start_us, priority });
                q.in_backend_by_priority[priority_index(priority)] += 1;
                q.bytes_in_backend_by_priority[priority_index(priority)] += len;
                q.bytes_in_backend += len;
                tracer.counter("bytes in flight", q.bytes_in_backend as f64);
            }
            Err(e) => {
                shared.outstanding_bytes.fetch_sub(len, Ordering::Relaxed);
                finish_one(shared, ticket, Err(e));
            }
        }
    }
}

/// A read of `ticket` was split: `extra` more reads now complete it.
fn add_reads(shared: &Shared, ticket: Ticket, extra: usize) {
    if extra == 0 {
        return;
    }
    let mut t = lock(&shared.tickets);
    match t.states.get_mut(&ticket) {
        Some(TicketState::Pending { remaining, .. }) => *remaining += extra,
        other => panic!("split a read of ticket {ticket}, which is {other:?}"),
    }
}

fn finish_one(shared: &Shared, ticket: Ticket, result: Result<(), IoError>) {
    let mut t = lock(&shared.tickets);
    let finished = match t.states.get_mut(&ticket) {
        Some(TicketState::Pending { remaining, error }) => {
            assert!(*remaining > 0, "ticket {ticket} completed more reads than it has");
            *remaining -= 1;
            if let Err(e) = result {
                error.get_or_insert(e);
            }
            *remaining == 0
        }
        other => panic!("completion for ticket {ticket}, which is {other:?}"),
    };
    if finished {
        if let Some(TicketState::Pending { error, .. }) = t.states.remove(&ticket) {
            t.states.insert(ticket, TicketState::Done(error.map_or(Ok(()), |e| Err(Arc::new(e)))));
        }
        drop(t);
        shared.done.notify_all();
    }
}

#[cfg(test)]
mod tests {
    //! The I/O stage over a backend whose completions the test releases one at a time, so the
    //! order reads enter the backend in is observable.
    #![allow(clippy::unwrap_used)]

    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::*;
    use crate::storage::io::gated::{Gate, GatedBackend};
    use crate::storage::io::BufOptions;
    use crate::storage::stream::arena::{Arena, FileRange, Region};

    const PIECE: usize = 4096;

    /// A stage whose window is 8 pieces (so guesses may hold 2), and an arena to read into.
    fn stage() -> (IoStage, Arc<Gate>, Arena) {
        let gate = Arc::new(Gate::default());
        let g = Arc::clone(&gate);
        let factory: BackendFactory =
            Box::new(move || Ok(Box::new(GatedBackend::new(g, PIECE as u32)) as Box<dyn ReadBackend>));
        let buf = Arc::new(AlignedBuf::new(1 << 20, &BufOptions::default()).unwrap());
        let tracer = Arc::new(Tracer::new(false));
        let io = IoStage::spawn(factory, 8 * PIECE, PIECE, None, tracer, vec![Arc::clone(&buf)]).unwrap();
        (io, gate, Arena::new(buf, false))
    }

    /// Sends one read of `pieces` pieces at file offset `offset` into its own arena region.
    fn send(io: &IoStage, arena: &Arena, priority: Priority, offset: u64, pieces: usize) -> Ticket {
        let len = pieces * PIECE;
        let mut slot = arena.slot(Region { off: offset as usize, len });
        let ticket = io.reserve();
        let target = slot.start_read(ticket);
        let meta = OpMeta { name: "test read", kind: priority.kind(), layer: None, expert: None };
        let op = arena.op(target, 0, FileRange { file: 0, offset, len, min_len: len }, meta);
        io.submit(priority, vec![(ticket, vec![op])]);
        ticket
    }

    fn wait_done(io: &IoStage, ticket: Ticket) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !io.is_done(ticket) {
            assert!(Instant::now() < deadline, "ticket {ticket} never completed");
            std::thread::sleep(Duration::from_millis(1));
        }
        io.wait(ticket).unwrap();
    }

    #[test]
    fn a_demand_read_jumps_ahead_of_every_guess_piece_not_yet_in_the_device() {
        let (io, gate, arena) = stage();
        let guess = send(&io, &arena, Priority::Guess, 0, 16);
        assert_eq!(gate.offsets_after(8).len(), 8, "guesses fill the window, no more");
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(gate.offsets_after(8).len(), 8);
        let demand = send(&io, &arena, Priority::Demand, 512 << 10, 2);
        // One guess piece completes; the demand read enters before any other guess piece.
        gate.release(1);
        let log = gate.offsets_after(9);
        let first: Vec<u64> = (0..8).map(|i| (i * PIECE) as u64).collect();
        assert_eq!(log[..8], first[..], "{log:?}");
        assert_eq!(log[8], 512 << 10, "{log:?}");
        gate.release(1000);
        wait_done(&io, demand);
        wait_done(&io, guess);
        // 16 guess pieces and the demand read, which enters whole.
        let log = gate.offsets_after(17);
        assert_eq!(log.len(), 17, "{log:?}");
        let guesses: Vec<u64> = log.iter().copied().filter(|&o| o < 512 << 10).collect();
        let want: Vec<u64> = (0..16).map(|i| (i * PIECE) as u64).collect();
        assert_eq!(guesses, want, "every piece read once, in order");
    }

    #[test]
    fn a_cancelled_guess_reads_only_what_was_in_the_device() {
        let (io, gate, arena) = stage();
        let guess = send(&io, &arena, Priority::Guess, 0, 16);
        assert_eq!(gate.offsets_after(8).len(), 8);
        io.cancel(guess);
        gate.release(8);
        wait_done(&io, guess);
        assert_eq!(io.cancelled_bytes(), (8 * PIECE) as u64);
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(gate.offsets_after(8).len(), 8, "nothing more was read");
        assert_eq!(io.outstanding_bytes(), 0);
        assert_eq!(io.tickets_held(), 0);
    }

    #[test]
    fn a_promoted_guess_goes_ahead_of_queued_read_ahead() {
        let (io, gate, arena) = stage();
        let ahead = send(&io, &arena, Priority::Prefetch, 0, 16);
        assert_eq!(gate.offsets_after(8).len(), 8, "read-ahead fills the window");
        let guess = send(&io, &arena, Priority::Guess, 512 << 10, 2);
        io.promote(guess);
        gate.release(1);
        let log = gate.offsets_after(9);
        assert_eq!(log[8], 512 << 10, "the promoted guess is next: {log:?}");
        gate.release(1000);
        wait_done(&io, guess);
        wait_done(&io, ahead);
        // 16 read-ahead pieces and the promoted guess's 2.
        assert_eq!(gate.offsets_after(18).len(), 18);
    }

    /// The needed-busy total once the I/O thread has closed the open period: a ticket is done
    /// before the thread accounts for it, so an open period still grows between two readings.
    fn needed_busy_once_closed(io: &IoStage) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let (_, first) = io.needed_busy();
            std::thread::sleep(Duration::from_millis(2));
            let (_, second) = io.needed_busy();
            if first == second {
                return second;
            }
            assert!(Instant::now() < deadline, "the needed-busy period never closed");
        }
    }

    #[test]
    fn needed_busy_time_counts_demand_and_read_ahead_not_guesses() {
        let (io, gate, arena) = stage();
        let (_, before) = io.needed_busy();
        let demand = send(&io, &arena, Priority::Demand, 0, 1);
        std::thread::sleep(Duration::from_millis(30));
        gate.release(1);
        wait_done(&io, demand);
        let after_demand = needed_busy_once_closed(&io);
        assert!(after_demand - before >= 30_000_000, "the demand read was outstanding 30 ms or more");
        let guess = send(&io, &arena, Priority::Guess, 64 << 10, 1);
        std::thread::sleep(Duration::from_millis(30));
        gate.release(1);
        wait_done(&io, guess);
        let (_, after_guess) = io.needed_busy();
        assert_eq!(after_guess, after_demand, "guesses are not time compute needed the device for");
    }
}
