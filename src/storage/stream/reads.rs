//! What the store needs from the I/O stage: a queue of reads in three priorities, each batch
//! completing a ticket that compute threads can test or wait on.
//!
//! The I/O stage itself (the thread that owns the ring) is part of the pipeline
//! (`crate::pipeline::io_stage`), which implements [`ReadQueue`]; the store only builds reads into
//! its own slots and hands them over, so storage never depends on the pipeline.

use std::sync::Arc;

use crate::storage::io::{IoError, ReadBackend, ReadOp};

/// Identifies one batch of reads.
pub type Ticket = u64;

/// Urgency of a batch at the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Priority {
    /// Bytes compute is waiting for (or will wait for within this layer).
    Demand,
    /// Trunk read-ahead: needed soon, certainly.
    Prefetch,
    /// A guess (predicted experts): enters the device only while no demand read is queued or
    /// in the device, so a wrong guess never delays a needed read by more than what is already
    /// in the device.
    Guess,
}

impl Priority {
    /// The trace's name for reads of this priority.
    pub fn kind(self) -> &'static str {
        match self {
            Priority::Demand => "demand",
            Priority::Prefetch => "read-ahead",
            Priority::Guess => "speculative",
        }
    }
}

/// What a read is for, for the trace.
#[derive(Clone, Copy, Debug)]
pub struct OpMeta {
    /// "trunk read", "expert read" or "embedding read".
    pub name: &'static str,
    /// "demand", "read-ahead" or "speculative".
    pub kind: &'static str,
    pub layer: Option<u32>,
    pub expert: Option<u32>,
}

/// A read into an arena slot, which may cross to the I/O thread. Only the arena builds one, for a
/// slot it has just marked in flight.
pub struct SendOp {
    op: ReadOp,
    meta: OpMeta,
}

// SAFETY: the destination belongs to an arena slot that the store marks in flight before sending
// and does not touch (nor hand out, nor reuse) until this op's ticket completes; only the I/O
// thread and the kernel write it meanwhile.
unsafe impl Send for SendOp {}

impl SendOp {
    /// Built by [`super::arena::Arena::op`] only.
    pub(super) fn new(op: ReadOp, meta: OpMeta) -> SendOp {
        SendOp { op, meta }
    }

    /// Bytes the read asks for.
    pub fn len(&self) -> usize {
        self.op.len
    }

    pub fn is_empty(&self) -> bool {
        self.op.len == 0
    }

    /// Index of the file it reads, in the run's file list.
    pub fn file(&self) -> usize {
        self.op.file
    }

    pub fn meta(&self) -> OpMeta {
        self.meta
    }

    /// Splits the read into reads of at most `piece` bytes (a multiple of the alignment), in
    /// file order, into the same slot; each must find the bytes the whole read had to find.
    pub fn split(self, piece: usize) -> Vec<SendOp> {
        assert!(piece > 0, "pieces of zero bytes");
        if self.op.len <= piece {
            return vec![self];
        }
        let mut pieces = Vec::with_capacity(self.op.len.div_ceil(piece));
        let mut at = 0;
        while at < self.op.len {
            let len = piece.min(self.op.len - at);
            let mut op = self.op;
            op.offset += at as u64;
            op.len = len;
            op.min_len = len.min(self.op.min_len.saturating_sub(at));
            // The pieces tile the original destination, which lies in one slot (see `SendOp`).
            op.dst = self.op.dst.wrapping_add(at);
            pieces.push(SendOp { op, meta: self.meta });
            at += len;
        }
        pieces
    }

    /// Hands the read to `backend` under `tag`.
    pub fn submit(self, backend: &mut dyn ReadBackend, tag: u64) -> Result<(), IoError> {
        let mut op = self.op;
        op.tag = tag;
        // SAFETY: `op.dst` lies in an arena slot in flight (see `SendOp`): the store neither
        // reads nor reuses it until the op's ticket completes, and the I/O stage completes a
        // ticket only after the backend has returned this op's completion (or has been dropped,
        // which waits for the kernel). The arena outlives the backend: the I/O stage holds it
        // until its thread has joined.
        unsafe { backend.submit(op) }
    }
}

/// The I/O stage as the store sees it.
pub trait ReadQueue: Send + Sync {
    /// A ticket for a batch about to be built: it reads as pending (never done) until
    /// [`ReadQueue::submit`] sends its reads, so slots can be tagged with it as they are chosen.
    fn reserve(&self) -> Ticket;

    /// Sends several reserved tickets' reads as one submission, in this order, so that each
    /// ticket completes as soon as its own reads have. A ticket with no reads completes at once.
    fn submit(&self, priority: Priority, groups: Vec<(Ticket, Vec<SendOp>)>);

    /// Whether a batch has finished (successfully or not), without blocking.
    fn is_done(&self, ticket: Ticket) -> bool;

    /// Blocks until the batch completes. A failure is kept, so every waiter on a failed batch
    /// sees the error.
    fn wait(&self, ticket: Ticket) -> Result<(), Arc<IoError>>;

    /// Forgets a finished, successful batch nobody will wait on (a slot was retagged or
    /// evicted).
    fn forget(&self, ticket: Ticket);

    /// The batch's bytes are needed now: its reads that have not entered the device yet go
    /// ahead of every other queued read.
    fn promote(&self, ticket: Ticket);

    /// Drops the reads of a batch that have not entered the device yet; the ticket then
    /// completes (successfully) when the reads already in the device have. Its bytes are then
    /// incomplete: only a slot nobody will read may be cancelled.
    fn cancel(&self, ticket: Ticket);
}

/// Submits one batch under a fresh ticket.
pub fn submit_one(queue: &dyn ReadQueue, priority: Priority, ops: Vec<SendOp>) -> Ticket {
    let ticket = queue.reserve();
    queue.submit(priority, vec![(ticket, ops)]);
    ticket
}
