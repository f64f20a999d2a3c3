//! The trunk: pinned units read once at open, the other units cycled through a ring of slots, a
//! unit and the `readahead` streamed units after it (in use order, wrapping to the next token)
//! read at once, so the next layers' bytes arrive while this one computes.
//!
//! A ring slot holding a unit that a guard reads is never chosen for another read; a slot whose
//! unwanted read-ahead is still in flight is waited for before reuse. Each unit's checksum is
//! verified on its first read (and on every read with `verify_every_read`).
//!
//! Threads: the scheduler thread, under the ring lock (never held across a demand wait for the
//! unit asked for). Allocation: the read-ahead window's list and one op list per read.

use super::arena::{Filled, Slot};
use super::layout::UnitPlace;
use super::reads::{OpMeta, Priority, Ticket};
use super::{lock, Store};
use crate::model::weights::{SourceError, TensorId, TrunkUnit, TrunkView};
use crate::storage::pack::{PackError, PackUnit};
use crate::storage::stream::arena::FileRange;

pub(super) struct RingSlot {
    slot: Slot,
    unit: Option<usize>,
    /// Guards alive over the slot's bytes.
    users: usize,
}

pub(super) struct TrunkRing {
    slots: Vec<RingSlot>,
    /// Per unit: its checksum has been verified since the pack was opened.
    verified: Vec<bool>,
    /// Streamed units in the order a token uses them.
    streamed_order: Vec<usize>,
    readahead: usize,
}

impl TrunkRing {
    pub fn new(slots: Vec<Slot>, units: usize, streamed_order: Vec<usize>, readahead: usize) -> TrunkRing {
        TrunkRing {
            slots: slots.into_iter().map(|slot| RingSlot { slot, unit: None, users: 0 }).collect(),
            verified: vec![false; units],
            streamed_order,
            readahead,
        }
    }

    pub fn mark_verified(&mut self, unit: usize) {
        self.verified[unit] = true;
    }

    /// `unit` and the `readahead` streamed units after it, in use order (wrapping to the next
    /// token).
    fn window(&self, unit: usize) -> Vec<usize> {
        let n = self.streamed_order.len();
        let Some(pos) = self.streamed_order.iter().position(|&u| u == unit) else { return vec![unit] };
        (0..=self.readahead.min(n.saturating_sub(1))).map(|i| self.streamed_order[(pos + i) % n]).collect()
    }
}

/// A trunk unit made resident: pinned (no slot) or held in a ring slot until dropped.
pub struct TrunkGuard<'a> {
    store: &'a Store,
    unit: usize,
    base: Filled,
    slot: Option<usize>,
}

impl TrunkView for TrunkGuard<'_> {
    fn bytes(&self, id: TensorId) -> &[u8] {
        let Some(loc) = self.store.pack.loc(id).filter(|l| l.unit == self.unit) else {
            panic!("tensor {id} read through the view of another unit")
        };
        &self.store.arena.bytes(self.base)[loc.offset..loc.offset + loc.len]
    }
}

impl Drop for TrunkGuard<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot {
            lock(&self.store.ring).slots[slot].users -= 1;
        }
    }
}

impl Store {
    /// Makes a trunk unit resident and returns its bytes, starting the read-ahead after it.
    pub fn trunk(&self, unit: TrunkUnit) -> Result<TrunkGuard<'_>, SourceError> {
        let u = self.pack.unit_index(unit).ok_or_else(|| SourceError::Internal(format!("no trunk unit {unit:?}")))?;
        match self.pinned[u] {
            Some(base) => Ok(TrunkGuard { store: self, unit: u, base, slot: None }),
            None => self.acquire_unit(u),
        }
    }

    /// The unit's bytes if its read has completed (pinned, or read into the ring), without
    /// waiting or issuing a read: for predictions, which must never stall compute. The bytes of
    /// a unit read for the first time may not have been verified yet.
    pub fn trunk_if_resident(&self, unit: TrunkUnit) -> Option<TrunkGuard<'_>> {
        let u = self.pack.unit_index(unit)?;
        if let Some(base) = self.pinned[u] {
            return Some(TrunkGuard { store: self, unit: u, base, slot: None });
        }
        let mut ring = lock(&self.ring);
        let slot = ring.slots.iter().position(|s| s.unit == Some(u))?;
        let s = &mut ring.slots[slot];
        if let Some(t) = s.slot.ticket() {
            // Seen done and successful here, so the next waiter finds it filled; a failure stays
            // in the ticket table for the demand read to report.
            if !self.reads.is_done(t) || self.reads.wait(t).is_err() {
                return None;
            }
            s.slot.landed();
        }
        let base = s.slot.filled()?;
        s.users += 1;
        Some(TrunkGuard { store: self, unit: u, base, slot: Some(slot) })
    }

    /// Makes a streamed unit resident in the ring, issuing read-ahead for the units after it.
    fn acquire_unit(&self, unit: usize) -> Result<TrunkGuard<'_>, SourceError> {
        let (slot, ticket) = {
            let mut ring = lock(&self.ring);
            let window = ring.window(unit);
            let slot = match ring.slots.iter().position(|s| s.unit == Some(unit)) {
                Some(s) => s,
                None => self.start_unit_read(&mut ring, unit, &window, Priority::Demand)?,
            };
            ring.slots[slot].users += 1;
            let ticket = ring.slots[slot].slot.ticket();
            for &next in window.iter().skip(1) {
                if !ring.slots.iter().any(|s| s.unit == Some(next))
                    && self.start_unit_read(&mut ring, next, &window, Priority::Prefetch).is_err()
                {
                    break;
                }
            }
            (slot, ticket)
        };
        let release = |this: &Self| {
            let mut ring = lock(&this.ring);
            let s = &mut ring.slots[slot];
            s.users -= 1;
            s.unit = None;
            if ticket.is_some() && s.slot.ticket() == ticket {
                s.slot.abandon();
            } else {
                s.slot.clear();
            }
        };
        if let Some(t) = ticket {
            if let Err(e) = self.wait_io(t, self.pack.layer_of_unit(unit)) {
                release(self);
                let what = format!("trunk unit {} of the pack", self.pack.units[unit].unit.name());
                return Err(self.read_error(what, &e));
            }
        }
        let (base, verify) = {
            let mut ring = lock(&self.ring);
            let s = &mut ring.slots[slot].slot;
            if ticket.is_some() && s.ticket() == ticket {
                s.landed();
            }
            let base = s.filled();
            (base, self.verify_every_read || !ring.verified[unit])
        };
        let Some(base) = base else {
            release(self);
            return Err(SourceError::Internal(format!("trunk unit {unit}: its slot is not filled after its read")));
        };
        if verify {
            if let Err(e) = self.verify_unit(unit, base) {
                release(self);
                let what = format!("trunk unit {}", self.pack.units[unit].unit.name());
                return Err(SourceError::Corrupt { what, message: e.to_string() });
            }
            lock(&self.ring).mark_verified(unit);
        }
        Ok(TrunkGuard { store: self, unit, base, slot: Some(slot) })
    }

    /// Picks a ring slot no guard holds and no unit of `window` occupies, and starts reading.
    fn start_unit_read(
        &self,
        ring: &mut TrunkRing,
        unit: usize,
        window: &[usize],
        priority: Priority,
    ) -> Result<usize, SourceError> {
        let outside = |s: &RingSlot| s.users == 0 && s.unit.is_none_or(|u| !window.contains(&u));
        let slot = ring
            .slots
            .iter()
            .position(|s| outside(s) && s.slot.ticket().is_none())
            .or_else(|| ring.slots.iter().position(outside))
            .ok_or_else(|| {
                SourceError::Internal("no free trunk slot: the ring is smaller than the read-ahead window".to_owned())
            })?;
        let s = &mut ring.slots[slot];
        if let Some(t) = s.slot.ticket() {
            // An unwanted read-ahead is still in flight into this slot: let it land first.
            let _ = self.wait_io(t, None);
            s.slot.abandon();
        }
        let u = &self.pack.units[unit];
        let ticket: Ticket = self.reads.reserve();
        let target = s.slot.start_read(ticket);
        let op = self.arena.op(target, 0, self.unit_range(u), unit_meta(u, priority));
        self.reads.submit(priority, vec![(ticket, vec![op])]);
        s.unit = Some(unit);
        let mut stats = lock(&self.stats);
        stats.trunk_bytes_read += u.len;
        stats.trunk_reads += 1;
        Ok(slot)
    }

    /// The file window of a unit in the pack.
    pub(super) fn unit_range(&self, u: &UnitPlace) -> FileRange {
        FileRange { file: self.pack.pack_file, offset: u.file_offset, len: u.len as usize, min_len: u.len as usize }
    }

    /// Checks a unit's bytes against the pack's checksum.
    pub(super) fn verify_unit(&self, unit: usize, base: Filled) -> Result<(), PackError> {
        let u = &self.pack.units[unit];
        let got = crate::storage::pack::checksum(&self.arena.bytes(base)[..u.len as usize]);
        if got != u.checksum {
            return Err(PackError::Checksum {
                path: self.pack.pack_path.clone(),
                unit: u.unit.name(),
                want: u.checksum.clone(),
                got,
            });
        }
        Ok(())
    }
}

/// Trace metadata of a unit's read.
pub(super) fn unit_meta(u: &UnitPlace, priority: Priority) -> OpMeta {
    let layer = match u.unit {
        PackUnit::Layer(l) => Some(l as u32),
        _ => None,
    };
    OpMeta { name: "trunk read", kind: priority.kind(), layer, expert: None }
}
