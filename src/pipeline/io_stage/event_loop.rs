//! The I/O thread's side: its queues by priority, what it lets into the backend and when
//! ([`Limits`]), and the loop that takes batches, fills the backend and folds completions into
//! the ticket table.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use super::{lock, Msg, NeededBusy, Shared, TicketState, OPS_IN_BACKEND_MAX, STATS_PERIOD_MS};
use crate::storage::io::{Completion, IoError, ReadBackend};
use crate::storage::stream::reads::{OpMeta, Priority, SendOp, Ticket};
use crate::trace::{SpanArgs, SpanKind, Tracer};

/// How much the I/O thread keeps in the backend.
///
/// Demand reads enter whole, as soon as they arrive, up to `bytes_max`. Read-ahead and guesses
/// enter in pieces of `piece_bytes` (one chunk of the backend), only while no demand read waits
/// in the queue and only up to `bytes_max` in all, so every piece in the backend is already in
/// the device: a demand read that arrives waits for no queued piece, only for a chunk slot to
/// free, which takes about one chunk. Guesses enter only while no demand read is in the backend
/// either, at most `guess_pieces_max` at once.
#[derive(Clone, Copy, Debug)]
pub(super) struct Limits {
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
    pub(super) fn new(bytes_max: usize, piece_bytes: usize) -> Limits {
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
pub(super) fn run(
    mut backend: Box<dyn ReadBackend>,
    rx: Receiver<Msg>,
    shared: &Shared,
    lane: usize,
    limits: Limits,
    tracer: &Tracer,
) {
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
        account_needed(&q, &shared.needed[lane], shared);
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
        account_needed(&q, &shared.needed[lane], shared);
        tracer.counter("bytes in flight", q.bytes_in_backend as f64);
        if last_stats.elapsed().as_millis() >= STATS_PERIOD_MS || backend.in_flight() == 0 {
            *lock(&shared.stats[lane]) = backend.stats();
            last_stats = Instant::now();
        }
    }
    account_needed(&Queues::new(0), &shared.needed[lane], shared);
    *lock(&shared.stats[lane]) = backend.stats();
}

/// Opens or closes the period during which reads compute needs are outstanding.
fn account_needed(q: &Queues, needed: &NeededBusy, shared: &Shared) {
    let since = needed.since_ns.load(Ordering::Relaxed);
    match (q.needed() > 0, since > 0) {
        (true, false) => needed.since_ns.store(shared.now_ns(), Ordering::Release),
        (false, true) => {
            let now = shared.now_ns();
            needed.closed_ns.fetch_add(now.saturating_sub(since), Ordering::AcqRel);
            needed.since_ns.store(0, Ordering::Release);
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
