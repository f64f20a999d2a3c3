//! The arena: one pre-allocated, aligned (optionally pinned and NUMA-bound) buffer carved into
//! regions for pinned trunk units, trunk ring slots, expert slots and the embedding rows. This is
//! the only file of the store with unsafe code: it hands the kernel raw destinations and compute
//! shared views of the same memory, and the slot states keep the two apart.
//!
//! A [`Slot`] moves `Empty -> InFlight(ticket) -> Filled -> Empty` (or `InFlight -> Empty` once
//! its read is done, when nobody wants the bytes): a read is built only by
//! [`Slot::start_read`], which asserts the slot is not already being written, and bytes are
//! shown only through a [`Filled`] handle, which only a `Filled` slot gives out. The store's
//! users counts keep a slot that a guard reads from being chosen for another read.

use std::sync::Arc;

use super::reads::{OpMeta, SendOp, Ticket};
use crate::storage::io::{ring::FIXED_BUF_BYTES_MAX, AlignedBuf, ReadOp};

/// A byte range of the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub off: usize,
    pub len: usize,
}

/// Where a slot's read goes: its region and the registered buffer that holds it (for
/// READ_FIXED; `None` when buffers are not registered or the region straddles two pieces).
#[derive(Clone, Copy, Debug)]
pub struct ReadTarget {
    region: Region,
    buf_index: Option<u16>,
}

/// Proof that a region holds finished bytes: only a `Filled` slot (or a pinned unit after its
/// load) hands one out.
#[derive(Clone, Copy, Debug)]
pub struct Filled {
    region: Region,
}

impl Filled {
    pub fn region(self) -> Region {
        self.region
    }
}

/// What a slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    Empty,
    /// A read into the slot has been handed to the I/O stage; its bytes belong to the kernel
    /// until the ticket completes.
    InFlight(Ticket),
    Filled,
}

/// A region that reads land in, with its state.
#[derive(Debug)]
pub struct Slot {
    target: ReadTarget,
    state: SlotState,
}

impl Slot {
    pub fn region(&self) -> Region {
        self.target.region
    }

    pub fn state(&self) -> SlotState {
        self.state
    }

    /// The ticket of the read in flight, if any.
    pub fn ticket(&self) -> Option<Ticket> {
        match self.state {
            SlotState::InFlight(t) => Some(t),
            _ => None,
        }
    }

    /// Marks the slot in flight under `ticket` and returns where its read goes. Panics if a read
    /// is already in flight: two reads must never target one slot.
    pub fn start_read(&mut self, ticket: Ticket) -> ReadTarget {
        assert!(!matches!(self.state, SlotState::InFlight(_)), "a second read into a slot in flight");
        self.state = SlotState::InFlight(ticket);
        self.target
    }

    /// The read in flight has completed successfully.
    pub fn landed(&mut self) {
        assert!(matches!(self.state, SlotState::InFlight(_)), "a slot landed without a read in flight");
        self.state = SlotState::Filled;
    }

    /// Forgets the contents of a slot with no read in flight. Panics otherwise.
    pub fn clear(&mut self) {
        assert!(!matches!(self.state, SlotState::InFlight(_)), "clearing a slot whose read is in flight");
        self.state = SlotState::Empty;
    }

    /// Gives up the bytes of a slot whose read failed or was cancelled and has completed.
    pub fn abandon(&mut self) {
        self.state = SlotState::Empty;
    }

    /// The finished bytes, if the slot is filled.
    pub fn filled(&self) -> Option<Filled> {
        (self.state == SlotState::Filled).then_some(Filled { region: self.target.region })
    }
}

/// The store's memory.
pub struct Arena {
    buf: Arc<AlignedBuf>,
    /// Buffers are registered with the ring in pieces of [`FIXED_BUF_BYTES_MAX`].
    fixed_buffers: bool,
}

impl Arena {
    pub fn new(buf: Arc<AlignedBuf>, fixed_buffers: bool) -> Arena {
        Arena { buf, fixed_buffers }
    }

    pub fn buffer(&self) -> &Arc<AlignedBuf> {
        &self.buf
    }

    /// A slot over `region`, empty.
    pub fn slot(&self, region: Region) -> Slot {
        assert!(region.off + region.len <= self.buf.len(), "slot outside the arena");
        Slot { target: ReadTarget { region, buf_index: self.buf_index(region) }, state: SlotState::Empty }
    }

    /// The bytes of a filled region.
    pub fn bytes(&self, filled: Filled) -> &[u8] {
        let r = filled.region;
        assert!(r.off + r.len <= self.buf.len(), "region outside the arena");
        // SAFETY: the region lies inside the arena (asserted), which lives as long as `self`. A
        // `Filled` handle exists only for a region whose read has completed; the store keeps a
        // slot's users count above zero while a guard shows its bytes, and never starts a read
        // into a slot with users (nor into pinned regions), so no write races this shared view.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr().add(r.off), r.len) }
    }

    /// Copies `from`'s bytes `range` into `to` at `at`, for a region filled by copying while
    /// the store opens (the small tensors of split units). Panics if the two overlap or the copy
    /// leaves either region.
    ///
    /// # Safety
    /// `to` must be a region of its own (no slot, pinned unit or other region covers it),
    /// never a read's target, and no `Filled` handle for it may exist yet: nothing may read or
    /// write it concurrently.
    pub(super) unsafe fn copy_into(&self, to: Region, at: usize, from: Filled, range: std::ops::Range<usize>) {
        let src = from.region;
        assert!(range.end <= src.len && at + range.len() <= to.len, "a copy outside its regions");
        assert!(to.off + to.len <= src.off || src.off + src.len <= to.off, "a copy between overlapping regions");
        assert!(to.off + to.len <= self.buf.len() && src.off + src.len <= self.buf.len(), "a copy outside the arena");
        // SAFETY: both regions lie inside the arena (asserted) and do not overlap (asserted).
        // `from` is filled, so no read writes it; the caller guarantees nothing else touches `to`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.buf.as_ptr().add(src.off + range.start),
                self.buf.as_mut_ptr().add(to.off + at),
                range.len(),
            );
        }
    }

    /// The handle of a region filled by [`Arena::copy_into`].
    ///
    /// # Safety
    /// Every copy into `region` is done and no other write into it will ever happen (the
    /// region is never a read's target), so shared views of it are sound from now on.
    pub(super) unsafe fn copied(&self, region: Region) -> Filled {
        Filled { region }
    }

    /// A read of `len` bytes at `offset` of `file` into `target`, `at` bytes into its region.
    pub fn op(&self, target: ReadTarget, at: usize, read: FileRange, meta: OpMeta) -> SendOp {
        let r = target.region;
        assert!(at + read.len <= r.len, "a read past the end of its slot");
        assert!(r.off + r.len <= self.buf.len(), "slot outside the arena");
        // SAFETY: in bounds of the arena allocation (asserted just above).
        let dst = unsafe { self.buf.as_mut_ptr().add(r.off + at) };
        let mut op = ReadOp::new(read.file, read.offset, read.len, dst, 0);
        op.min_len = read.min_len;
        op.buf_index = target.buf_index;
        SendOp::new(op, meta)
    }

    fn buf_index(&self, r: Region) -> Option<u16> {
        const PIECE: usize = FIXED_BUF_BYTES_MAX;
        let last = r.off + r.len.max(1) - 1;
        (self.fixed_buffers && r.off / PIECE == last / PIECE).then_some((r.off / PIECE) as u16)
    }
}

/// A window of a file to read: `len` bytes at `offset` of file `file`, of which the first
/// `min_len` must exist.
#[derive(Clone, Copy, Debug)]
pub struct FileRange {
    pub file: usize,
    pub offset: u64,
    pub len: usize,
    pub min_len: usize,
}
