//! The I/O stage: one thread that owns a read backend (an io_uring ring must be used by the
//! thread that made it), takes batches of reads over a bounded channel, keeps the backend's queue
//! busy with demand reads first, then trunk read-ahead, then guesses, and reports each batch's
//! completion through a ticket table that compute threads test or wait on. It implements the
//! store's [`ReadQueue`].
//!
//! Threads: the `k3ring-io` thread runs the event loop ([`event_loop`]); any thread may submit, test,
//! wait or cancel. Allocation: the queues and the in-backend table grow to their high-water
//! mark; each batch arrives as its own op list.

//!
//! Files: this one holds the handle compute threads use and the ticket table; [`event_loop`] the
//! I/O thread's queues and loop; [`options`] the backend choice.

mod event_loop;
mod options;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::storage::io::{
    sim::SimOptions, AlignedBuf, IoError, IoStats, MappedReader, ModeledReader, PreadOptions, PreadReader, ReadBackend,
    RingOptions, SimReader, UringReader,
};
use crate::storage::stream::reads::{Priority, ReadQueue, SendOp, Ticket};
use crate::trace::Tracer;

use event_loop::{run, Limits};
pub use options::{read_alignment, IoKind, IoOptions};
/// Logical reads the backend accepts at once.
const OPS_IN_BACKEND_MAX: usize = 256;

/// Most batches waiting in the channel.
const CHANNEL_BATCHES_MAX: usize = 1024;

/// How often the backend's counters are copied out while reads complete.
const STATS_PERIOD_MS: u128 = 5;

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
    /// Per lane (device), its backend's counters.
    stats: Vec<Mutex<IoStats>>,
    /// Bytes sent to the I/O thread and not yet completed (queued or in the device).
    outstanding_bytes: AtomicUsize,
    /// Bytes of cancelled reads that never entered the device.
    cancelled_bytes: AtomicU64,
    /// Per lane: nanoseconds (since `epoch`) during which demand or read-ahead reads were
    /// queued or in its device, closed periods only; and the start of the open period (0: none).
    needed: Vec<NeededBusy>,
    epoch: Instant,
    /// Reads completed and recorded in the trace; with `outstanding_bytes` at 0 and the
    /// published stats counting as many ops, the trace and the report agree (see `settle`).
    reads_traced: AtomicU64,
}

#[derive(Default)]
struct NeededBusy {
    closed_ns: AtomicU64,
    since_ns: AtomicU64,
}

impl Shared {
    fn new(lanes: usize) -> Shared {
        Shared {
            tickets: Mutex::default(),
            done: Condvar::new(),
            stats: (0..lanes).map(|_| Mutex::default()).collect(),
            outstanding_bytes: AtomicUsize::new(0),
            cancelled_bytes: AtomicU64::new(0),
            needed: (0..lanes).map(|_| NeededBusy::default()).collect(),
            epoch: Instant::now(),
            reads_traced: AtomicU64::new(0),
        }
    }

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

/// One device's I/O thread and its channel.
struct Lane {
    tx: SyncSender<Msg>,
    thread: Option<JoinHandle<()>>,
    backend_info: String,
}

/// Handle to the I/O threads: one per device (lane), each owning its backend (an io_uring
/// ring); a batch's reads go to the lanes of their files and its ticket completes when every
/// lane has finished its part.
pub struct IoStage {
    /// What the backends use, as they described themselves (one line per device).
    pub backend_info: String,
    lanes: Vec<Lane>,
    /// Per file index: its lane.
    file_lane: Vec<usize>,
    shared: Arc<Shared>,
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

/// What a backend is built from: the I/O stage's, and the read-tax probe's, which reads through
/// the same backends with the same settings.
pub struct BackendSpec {
    pub files: Vec<PathBuf>,
    pub opts: IoOptions,
    /// Every read's alignment (offset, length and address).
    pub align: u32,
    /// The memory reads target, registered with a ring.
    pub registered: Vec<Arc<AlignedBuf>>,
    /// Logical reads in flight at most.
    pub ops_max: usize,
}

impl BackendSpec {
    /// Builds the backend; call it on the thread that will use it (a ring must live there).
    pub fn build(self) -> Result<Box<dyn ReadBackend>, IoError> {
        let BackendSpec { files, opts, align, registered, ops_max } = self;
        let (qd, chunk) = (opts.queue_depth.max(1), opts.chunk_bytes);
        Ok(match opts.kind {
            IoKind::Uring => Box::new(UringReader::new(
                &files,
                RingOptions {
                    queue_depth: qd,
                    chunk_bytes: chunk,
                    ops_max,
                    register_files: true,
                    register_buffers: registered,
                    align_min: align,
                    inject: opts.inject,
                },
            )?),
            IoKind::Pread => Box::new(PreadReader::new(
                &files,
                PreadOptions {
                    threads: opts.pread_threads.max(1),
                    queue_depth: qd,
                    chunk_bytes: chunk,
                    ops_max,
                    align_min: align,
                    inject: opts.inject,
                },
            )?),
            IoKind::Mmap => Box::new(MappedReader::new(&files, ops_max)?),
            IoKind::Sim => {
                let sim = opts.sim.unwrap_or_else(|| SimOptions::fault_free(0));
                Box::new(SimReader::new(&files, sim)?)
            }
            IoKind::Modeled(model) => Box::new(ModeledReader::new(&files, model, ops_max)?),
        })
    }
}

/// Builds the backend on the I/O thread (a ring must live on the thread that uses it).
type BackendFactory = Box<dyn FnOnce() -> Result<Box<dyn ReadBackend>, IoError> + Send>;

/// What one lane's thread is started with: its backend, the bytes it keeps in the backend,
/// the piece size of read-ahead and guesses, and the CPU it is pinned to.
struct LaneSpec {
    factory: BackendFactory,
    window: usize,
    piece: usize,
    pin_to: Option<usize>,
}

/// Starts lane `index`'s thread and waits until its backend is built.
fn spawn_lane(index: usize, spec: LaneSpec, shared: &Arc<Shared>, tracer: &Arc<Tracer>) -> Result<Lane, IoError> {
    let (tx, rx) = std::sync::mpsc::sync_channel(CHANNEL_BATCHES_MAX);
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let thread_shared = Arc::clone(shared);
    let tracer = Arc::clone(tracer);
    let LaneSpec { factory, window, piece, pin_to } = spec;
    let name = if index == 0 { "k3ring-io".to_owned() } else { format!("k3ring-io{index}") };
    let thread = std::thread::Builder::new()
        .name(name)
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
                    let limits = Limits::new(window, piece);
                    run(backend, rx, &thread_shared, index, limits, &tracer);
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
        .map_err(|source| IoError::Setup { what: "the I/O thread".to_owned(), source })?;
    match ready_rx.recv() {
        Ok(Ok(backend_info)) => Ok(Lane { tx, thread: Some(thread), backend_info }),
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
        IoStage::start_devices(files, &vec![0; files.len()], std::slice::from_ref(opts), arena, align, tracer)
    }

    /// [`IoStage::start`] with one I/O thread and backend per device: `file_devices[f]` is the
    /// device of file `f`, and device d runs `opts[d]` (the last entry for devices beyond).
    pub fn start_devices(
        files: &[PathBuf],
        file_devices: &[usize],
        opts: &[IoOptions],
        arena: &Arc<AlignedBuf>,
        align: u64,
        tracer: Arc<Tracer>,
    ) -> Result<IoStage, IoError> {
        let lanes = file_devices.iter().max().map_or(1, |d| d + 1);
        let mut factories = Vec::with_capacity(lanes);
        for lane in 0..lanes {
            let Some(o) = opts.get(lane).or(opts.last()) else {
                return Err(IoError::Setup {
                    what: "the I/O threads".to_owned(),
                    source: std::io::Error::other("no I/O options"),
                });
            };
            let qd = o.queue_depth.max(1);
            let chunk = (o.chunk_bytes as u64).max(align) / align * align;
            let spec = BackendSpec {
                files: files.to_vec(),
                opts: IoOptions { queue_depth: qd, chunk_bytes: chunk as usize, ..o.clone() },
                align: align as u32,
                registered: vec![Arc::clone(arena)],
                ops_max: OPS_IN_BACKEND_MAX,
            };
            let factory: BackendFactory = Box::new(move || spec.build());
            factories.push(LaneSpec {
                factory,
                window: qd as usize * chunk as usize,
                piece: chunk as usize,
                pin_to: o.io_core,
            });
        }
        IoStage::spawn_lanes(factories, file_devices.to_vec(), tracer, vec![Arc::clone(arena)])
    }

    /// Starts one thread over one backend (tests); it keeps up to `bytes_in_backend_max` bytes
    /// of reads in the backend (at least one read), and hands read-ahead and guesses to it in
    /// pieces of `piece_bytes` (see [`Limits`]).
    #[cfg(test)]
    fn spawn(
        factory: BackendFactory,
        bytes_in_backend_max: usize,
        piece_bytes: usize,
        pin_to: Option<usize>,
        tracer: Arc<Tracer>,
        targets: Vec<Arc<AlignedBuf>>,
    ) -> Result<IoStage, IoError> {
        let lane = LaneSpec { factory, window: bytes_in_backend_max, piece: piece_bytes, pin_to };
        IoStage::spawn_lanes(vec![lane], Vec::new(), tracer, targets)
    }

    /// Starts a thread per lane; each builds its backend, and the stage is up once all have.
    fn spawn_lanes(
        specs: Vec<LaneSpec>,
        file_lane: Vec<usize>,
        tracer: Arc<Tracer>,
        targets: Vec<Arc<AlignedBuf>>,
    ) -> Result<IoStage, IoError> {
        let shared = Arc::new(Shared::new(specs.len()));
        let mut lanes: Vec<Lane> = Vec::with_capacity(specs.len());
        let mut failure = None;
        for (index, spec) in specs.into_iter().enumerate() {
            match spawn_lane(index, spec, &shared, &tracer) {
                Ok(lane) => lanes.push(lane),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        let backend_info = match lanes.len() {
            1 => lanes[0].backend_info.clone(),
            _ => lanes
                .iter()
                .enumerate()
                .map(|(i, l)| format!("device {i}: {}", l.backend_info))
                .collect::<Vec<_>>()
                .join("; "),
        };
        let stage = IoStage { backend_info, lanes, file_lane, shared, _targets: targets };
        match failure {
            // Dropping the stage stops and joins the lanes already started.
            Some(e) => Err(e),
            None => Ok(stage),
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
        // With several devices, their mean: guesses may use what the devices leave on average.
        let now = self.shared.now_ns();
        let lanes = self.shared.needed.len().max(1) as u64;
        let total: u64 = self
            .shared
            .needed
            .iter()
            .map(|n| {
                let closed = n.closed_ns.load(Ordering::Acquire);
                let since = n.since_ns.load(Ordering::Acquire);
                closed + if since > 0 { now.saturating_sub(since) } else { 0 }
            })
            .sum();
        (now, total / lanes)
    }

    /// Tickets held (finished or not), for tests that check the table does not grow.
    pub fn tickets_held(&self) -> usize {
        lock(&self.shared.tickets).states.len()
    }

    /// The backends' counters as of their last reports, summed over the devices (busy and
    /// wait time: the longest device's, as the devices read at once).
    pub fn stats(&self) -> IoStats {
        let per = self.device_stats();
        let mut all = IoStats::default();
        for s in &per {
            all.ops += s.ops;
            all.ops_failed += s.ops_failed;
            all.bytes_read += s.bytes_read;
            all.sqes_submitted += s.sqes_submitted;
            all.submit_syscalls += s.submit_syscalls;
            all.enter_syscalls += s.enter_syscalls;
            all.short_read_resubmits += s.short_read_resubmits;
            all.retries += s.retries;
            all.busy_ns = all.busy_ns.max(s.busy_ns);
            all.wait_ns = all.wait_ns.max(s.wait_ns);
        }
        all
    }

    /// Each device's counters as of its last report.
    pub fn device_stats(&self) -> Vec<IoStats> {
        self.shared.stats.iter().map(|s| *lock(s)).collect()
    }

    /// Devices (lanes) the stage reads from.
    pub fn devices(&self) -> usize {
        self.lanes.len()
    }

    /// The lane of a file; lane 0 for files the map does not name (one-lane stages).
    fn lane_of(&self, file: usize) -> usize {
        self.file_lane.get(file).copied().filter(|&l| l < self.lanes.len()).unwrap_or(0)
    }

    /// Sends `msg` to every lane.
    fn broadcast(&self, msg: impl Fn() -> Msg) {
        for lane in &self.lanes {
            if lane.tx.send(msg()).is_err() {
                self.mark_dead();
            }
        }
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
            return;
        }
        if let [lane] = &self.lanes[..] {
            // One device: the batch goes whole, with no list allocated to split it.
            if lane.tx.send(Msg::Batch { priority, ops }).is_err() {
                self.mark_dead();
            }
            return;
        }
        let mut by_lane: Vec<Vec<(Ticket, SendOp)>> = (0..self.lanes.len()).map(|_| Vec::new()).collect();
        for op in ops {
            by_lane[self.lane_of(op.1.file())].push(op);
        }
        for (lane, ops) in self.lanes.iter().zip(by_lane) {
            if !ops.is_empty() && lane.tx.send(Msg::Batch { priority, ops }).is_err() {
                self.mark_dead();
            }
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
        self.broadcast(|| Msg::Cancel(ticket));
    }

    fn promote(&self, ticket: Ticket) {
        self.broadcast(|| Msg::Promote(ticket));
    }
}

impl Drop for IoStage {
    fn drop(&mut self) {
        for lane in &self.lanes {
            let _ = lane.tx.send(Msg::Stop);
        }
        for lane in &mut self.lanes {
            if let Some(t) = lane.thread.take() {
                let _ = t.join();
            }
        }
    }
}
