//! The I/O stage: one thread that owns a read backend (an io_uring ring must be used by the
//! thread that made it), takes batches of reads over a bounded channel, keeps the backend's queue
//! busy with demand reads first, and reports each batch's completion through a ticket table that
//! compute threads wait on.

use std::collections::VecDeque;
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::storage::io::{Completion, IoError, IoStats, ReadBackend, ReadOp};
use crate::trace::{SpanArgs, Stage, Tracer};

/// What a read is for, for the trace.
#[derive(Clone, Copy, Debug)]
pub struct OpMeta {
    /// "trunk read", "expert read" or "embedding read".
    pub name: &'static str,
    /// "demand" or "speculative".
    pub kind: &'static str,
    pub layer: Option<u32>,
    pub expert: Option<u32>,
}

/// A read whose destination pointer may cross to the I/O thread.
pub struct SendOp {
    pub op: ReadOp,
    pub meta: OpMeta,
}

// SAFETY: the destination belongs to a buffer slot that the store marks in flight before sending
// and does not touch (nor hand out) until this op's ticket completes; only the I/O thread and the
// kernel write it meanwhile.
unsafe impl Send for SendOp {}

/// Urgency of a batch: demand reads are issued before any queued prefetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Priority {
    /// Bytes compute is waiting for (or will wait for within this layer).
    Demand,
    /// Trunk read-ahead: needed soon, certainly.
    Prefetch,
    /// A guess (speculative experts): enters the device only while no demand read is queued or
    /// in the device, so a wrong guess never delays a needed read.
    Speculative,
}

/// Identifies one batch of reads.
pub type Ticket = u64;

/// How a batch ended.
#[derive(Debug)]
enum TicketState {
    Pending { remaining: usize, error: Option<IoError> },
    Done(Result<(), Arc<IoError>>),
}

#[derive(Default)]
struct Tickets {
    next: Ticket,
    states: std::collections::HashMap<Ticket, TicketState>,
    /// Set when the I/O thread stopped (its backend failed as a whole); waiters get this.
    dead: Option<String>,
}

/// Shared between the store and the I/O thread.
pub struct Shared {
    tickets: Mutex<Tickets>,
    done: Condvar,
    stats: Mutex<IoStats>,
    /// Bytes sent to the I/O thread and not yet completed (queued or in the device).
    outstanding_bytes: std::sync::atomic::AtomicUsize,
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
    Stop,
}

/// Most batches waiting in the channel.
const CHANNEL_BATCHES_MAX: usize = 1024;

/// Handle to the I/O thread.
pub struct IoService {
    /// What the backend uses, as it described itself.
    pub backend_info: String,
    tx: SyncSender<Msg>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// Memory the reads target. Dropped only after `Drop` has joined the I/O thread (which
    /// waits for every read in the backend), so no read can outlive its buffer.
    _targets: Vec<Arc<crate::storage::io::AlignedBuf>>,
}

/// Marks the service dead and wakes every waiter when the I/O thread exits for any reason,
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
pub type BackendFactory = Box<dyn FnOnce() -> Result<Box<dyn ReadBackend>, IoError> + Send>;

impl IoService {
    /// Starts the I/O thread; fails if its backend cannot be built. The thread keeps up to
    /// `bytes_in_backend_max` bytes of reads in the backend (at least one read), so demand
    /// reads queued behind prefetch wait for little more than the device's queue.
    pub fn start(
        factory: BackendFactory,
        ops_in_backend_max: usize,
        bytes_in_backend_max: usize,
        pin_to: Option<usize>,
        tracer: Arc<Tracer>,
        targets: Vec<Arc<crate::storage::io::AlignedBuf>>,
    ) -> Result<IoService, IoError> {
        let (tx, rx) = std::sync::mpsc::sync_channel(CHANNEL_BATCHES_MAX);
        let shared = Arc::new(Shared {
            tickets: Mutex::default(),
            done: Condvar::new(),
            stats: Mutex::default(),
            outstanding_bytes: std::sync::atomic::AtomicUsize::new(0),
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
                        run(backend, rx, &thread_shared, ops_in_backend_max.max(1), bytes_in_backend_max, &tracer);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .map_err(|source| IoError::Setup { what: "the I/O thread".to_owned(), source })?;
        match ready_rx.recv() {
            Ok(Ok(backend_info)) => Ok(IoService { backend_info, tx, shared, thread: Some(thread), _targets: targets }),
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

    /// Sends a batch; returns its ticket. An empty batch completes at once.
    pub fn submit(&self, priority: Priority, ops: Vec<SendOp>) -> Ticket {
        let ticket = self.reserve();
        self.submit_reserved(ticket, priority, ops);
        ticket
    }

    /// A ticket for a batch about to be built: it reads as pending (never done) until
    /// [`Self::submit_reserved`] sends the batch, so slots can be tagged with it as they are
    /// chosen.
    pub fn reserve(&self) -> Ticket {
        let mut t = lock(&self.shared.tickets);
        t.next += 1;
        let ticket = t.next;
        t.states.insert(ticket, TicketState::Pending { remaining: usize::MAX, error: None });
        ticket
    }

    /// Sends the batch of a reserved ticket.
    pub fn submit_reserved(&self, ticket: Ticket, priority: Priority, ops: Vec<SendOp>) {
        self.submit_groups(priority, vec![(ticket, ops)]);
    }

    /// Sends several reserved tickets' reads as one submission (in this order), so that each
    /// ticket completes as soon as its own reads have: a layer's experts are read in one batch
    /// and each is computed as soon as its bytes arrive.
    pub fn submit_groups(&self, priority: Priority, groups: Vec<(Ticket, Vec<SendOp>)>) {
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
        let bytes: usize = ops.iter().map(|o| o.1.op.len).sum();
        self.shared.outstanding_bytes.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed);
        if ops.is_empty() {
            self.shared.done.notify_all();
        } else if self.tx.send(Msg::Batch { priority, ops }).is_err() {
            let mut t = lock(&self.shared.tickets);
            t.dead.get_or_insert_with(|| "the I/O thread has stopped".to_owned());
            drop(t);
            self.shared.done.notify_all();
        }
    }

    /// Bytes of reads sent and not yet completed: above the device's window, the device is
    /// saturated and a speculative read would only delay the reads compute is waiting for.
    pub fn outstanding_bytes(&self) -> usize {
        self.shared.outstanding_bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Forgets a finished, successful batch nobody will wait on (a slot was retagged or
    /// evicted). Failures are kept: whoever needed those bytes must see the error.
    pub fn forget(&self, ticket: Ticket) {
        let mut t = lock(&self.shared.tickets);
        if matches!(t.states.get(&ticket), Some(TicketState::Done(Ok(())))) {
            t.states.remove(&ticket);
        }
    }

    /// Tickets held (finished or not), for tests that check the table does not grow.
    pub fn tickets_held(&self) -> usize {
        lock(&self.shared.tickets).states.len()
    }

    /// Whether a batch has finished (successfully or not), without blocking.
    pub fn is_done(&self, ticket: Ticket) -> bool {
        let t = lock(&self.shared.tickets);
        !matches!(t.states.get(&ticket), Some(TicketState::Pending { .. }))
    }

    /// Blocks until the batch completes. A success is forgotten once seen (several slots may
    /// share a ticket: an unknown ticket is a finished success); a failure stays, so every
    /// waiter on a failed batch sees the error.
    pub fn wait(&self, ticket: Ticket) -> Result<(), Arc<IoError>> {
        let mut t = lock(&self.shared.tickets);
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

    /// The backend's counters as of its last report.
    pub fn stats(&self) -> IoStats {
        *lock(&self.shared.stats)
    }
}

impl Drop for IoService {
    fn drop(&mut self) {
        let _ = self.tx.send(Msg::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The I/O thread's loop: the event loop of the I/O stage (bounded by Stop or a closed channel).
fn run(
    mut backend: Box<dyn ReadBackend>,
    rx: Receiver<Msg>,
    shared: &Shared,
    ops_max: usize,
    bytes_max: usize,
    tracer: &Tracer,
) {
    let mut demand: VecDeque<(Ticket, SendOp)> = VecDeque::new();
    let mut prefetch: VecDeque<(Ticket, SendOp)> = VecDeque::new();
    let mut speculative: VecDeque<(Ticket, SendOp)> = VecDeque::new();
    let mut demand_in_backend = 0usize;
    let mut done: Vec<Completion> = Vec::with_capacity(ops_max);
    // Each op in the backend: its ticket and length, by a per-op tag.
    // Per read in the backend: ticket, length, trace metadata, start time, demand or not.
    let mut in_backend: std::collections::HashMap<u64, (Ticket, usize, OpMeta, f64, bool)> =
        std::collections::HashMap::with_capacity(ops_max);
    let mut bytes_in_backend = 0usize;
    let mut next_tag = 0u64;
    let mut stopping = false;
    let mut last_stats = Instant::now();
    loop {
        // Take new batches: block only when nothing is queued or in flight.
        let idle = demand.is_empty() && prefetch.is_empty() && speculative.is_empty() && backend.in_flight() == 0;
        if stopping && idle {
            break;
        }
        let first = if idle { rx.recv().ok() } else { None };
        if idle && first.is_none() {
            break;
        }
        let mut next = first;
        loop {
            let msg = match next.take() {
                Some(m) => m,
                None => match rx.try_recv() {
                    Ok(m) => m,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        stopping = true;
                        break;
                    }
                },
            };
            match msg {
                Msg::Stop => {
                    // Reads not yet in the backend are dropped: the store is closing.
                    stopping = true;
                    for (ticket, op) in demand.drain(..).chain(prefetch.drain(..)).chain(speculative.drain(..)) {
                        shared.outstanding_bytes.fetch_sub(op.op.len, std::sync::atomic::Ordering::Relaxed);
                        finish_one(
                            shared,
                            ticket,
                            Err(IoError::Setup {
                                what: "a read".to_owned(),
                                source: std::io::Error::other("the store closed"),
                            }),
                        );
                    }
                }
                Msg::Batch { priority, ops } => {
                    let queue = match priority {
                        Priority::Demand => &mut demand,
                        Priority::Prefetch => &mut prefetch,
                        Priority::Speculative => &mut speculative,
                    };
                    queue.extend(ops);
                }
            }
        }
        // Keep the backend busy, demand first, up to the byte limit.
        while backend.in_flight() < ops_max && (bytes_in_backend < bytes_max || backend.in_flight() == 0) {
            let is_demand = !demand.is_empty();
            let guess_may_enter = demand.is_empty() && demand_in_backend == 0;
            let next = demand.pop_front().or_else(|| prefetch.pop_front());
            let next = if next.is_none() && guess_may_enter { speculative.pop_front() } else { next };
            let Some((ticket, send)) = next else { break };
            let (mut op, meta) = (send.op, send.meta);
            next_tag += 1;
            op.tag = next_tag;
            // SAFETY: see `SendOp`: the slot behind `op.dst` is in flight and untouched by the
            // store until this ticket completes, which happens only after the backend returns
            // this op's completion.
            match unsafe { backend.submit(op) } {
                Ok(()) => {
                    in_backend.insert(next_tag, (ticket, op.len, meta, tracer.now_us(), is_demand));
                    demand_in_backend += usize::from(is_demand);
                    bytes_in_backend += op.len;
                    tracer.counter("bytes in flight", bytes_in_backend as f64);
                }
                Err(e) => {
                    shared.outstanding_bytes.fetch_sub(op.len, std::sync::atomic::Ordering::Relaxed);
                    finish_one(shared, ticket, Err(e));
                }
            }
        }
        if backend.in_flight() == 0 {
            continue;
        }
        done.clear();
        let waited = backend.reap(&mut done, 1);
        if let Err(e) = waited {
            // The backend as a whole failed: fail every waiter, loudly.
            let mut t = lock(&shared.tickets);
            t.dead = Some(format!("the read backend failed: {e}"));
            drop(t);
            shared.done.notify_all();
            break;
        }
        let now = tracer.now_us();
        for c in done.drain(..) {
            let entry = in_backend.remove(&c.tag);
            assert!(entry.is_some(), "completion for unknown read tag {}", c.tag);
            if let Some((ticket, len, meta, start, was_demand)) = entry {
                bytes_in_backend -= len;
                demand_in_backend -= usize::from(was_demand);
                shared.outstanding_bytes.fetch_sub(len, std::sync::atomic::Ordering::Relaxed);
                let mut args = SpanArgs::new().bytes(len as u64).kind(meta.kind);
                args.layer = meta.layer;
                args.expert = meta.expert;
                tracer.complete(Stage::Io, meta.name, start, now.max(start), args);
                finish_one(shared, ticket, c.result);
            }
        }
        tracer.counter("bytes in flight", bytes_in_backend as f64);
        if last_stats.elapsed().as_millis() >= 5 || backend.in_flight() == 0 {
            *lock(&shared.stats) = backend.stats();
            last_stats = Instant::now();
        }
    }
    *lock(&shared.stats) = backend.stats();
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
