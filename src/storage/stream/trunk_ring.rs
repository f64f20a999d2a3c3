//! The trunk: pinned units read once at open, the other units cycled through a ring of slots, a
//! ring item (a whole unit, or a piece of a split unit: see [`super::pieces`]) and the
//! `readahead` items after it (in use order, wrapping to the next token) read at once, so the
//! next bytes arrive while these compute.
//!
//! A ring slot holding an item that a guard reads is never chosen for another read; a slot whose
//! unwanted read-ahead is still in flight is waited for before reuse. Each item's checksum is
//! verified on its first read (and on every read with `verify_every_read`).
//!
//! Threads: the scheduler thread, under the ring lock (never held across a demand wait for the
//! unit asked for). Allocation: the read-ahead window's list and one op list per read.

use super::arena::{Filled, Slot};
use super::layout::UnitPlace;
use super::pieces::RingItem;
use super::reads::{OpMeta, Priority, Ticket};
use super::{lock, Store, WaitFor};
use crate::model::weights::{Mat, SourceError, TensorId, TrunkUnit, TrunkView};
use crate::storage::pack::{PackError, PackUnit};
use crate::storage::stream::arena::FileRange;

pub(super) struct RingSlot {
    slot: Slot,
    /// The ring item it holds or is reading.
    item: Option<usize>,
    /// Guards alive over the slot's bytes.
    users: usize,
}

pub(super) struct TrunkRing {
    slots: Vec<RingSlot>,
    /// Per ring item: its checksum has been verified since the pack was opened.
    verified: Vec<bool>,
    /// Ring items in the order a token uses them.
    streamed_order: Vec<usize>,
    readahead: usize,
}

impl TrunkRing {
    pub fn new(slots: Vec<Slot>, items: usize, streamed_order: Vec<usize>, readahead: usize) -> TrunkRing {
        TrunkRing {
            slots: slots.into_iter().map(|slot| RingSlot { slot, item: None, users: 0 }).collect(),
            verified: vec![false; items],
            streamed_order,
            readahead,
        }
    }

    pub fn mark_verified(&mut self, item: usize) {
        self.verified[item] = true;
    }

    /// Item `unit` and the `readahead` items after it, in use order (wrapping to the next
    /// token).
    fn window(&self, item: usize) -> Vec<usize> {
        let n = self.streamed_order.len();
        let Some(pos) = self.streamed_order.iter().position(|&u| u == item) else { return vec![item] };
        (0..=self.readahead.min(n.saturating_sub(1))).map(|i| self.streamed_order[(pos + i) % n]).collect()
    }
}

/// A trunk unit made resident: pinned (no slot), held whole in a ring slot until dropped, or
/// split (its small tensors resident, its matrices read piece by piece by `row_blocks`).
pub struct TrunkGuard<'a> {
    store: &'a Store,
    unit: usize,
    held: Held<'a>,
}

enum Held<'a> {
    Pinned(Filled),
    Ring(RingHold<'a>),
    /// `resident_only`: a prediction's view, which must never wait: a streamed piece is an
    /// error instead of a read.
    Split {
        resident_only: bool,
    },
}

/// A ring slot's bytes, held (its users count raised) until dropped.
struct RingHold<'a> {
    store: &'a Store,
    slot: usize,
    base: Filled,
    data: std::ops::Range<usize>,
}

impl RingHold<'_> {
    fn data(&self) -> &[u8] {
        &self.store.arena.bytes(self.base)[self.data.clone()]
    }
}

impl Drop for RingHold<'_> {
    fn drop(&mut self) {
        lock(&self.store.ring).slots[self.slot].users -= 1;
    }
}

impl TrunkView for TrunkGuard<'_> {
    fn bytes(&self, id: TensorId) -> &[u8] {
        let base = match &self.held {
            Held::Pinned(base) => *base,
            Held::Ring(hold) => hold.base,
            Held::Split { .. } => {
                let split = self.store.items.split[self.unit].as_ref();
                let (Some(range), Some(small)) = (split.and_then(|s| s.small_of(id)), self.store.small) else {
                    panic!("tensor {id} read whole from a unit streamed in pieces")
                };
                return &self.store.arena.bytes(small)[range];
            }
        };
        let Some(loc) = self.store.pack.loc(id).filter(|l| l.unit == self.unit) else {
            panic!("tensor {id} read through the view of another unit")
        };
        &self.store.arena.bytes(base)[loc.offset..loc.offset + loc.len]
    }

    fn row_blocks(&self, mat: &Mat, f: &mut dyn FnMut(std::ops::Range<usize>, &[u8])) -> Result<(), SourceError> {
        let (items, resident_only) = match &self.held {
            Held::Split { resident_only } => {
                (self.store.items.split[self.unit].as_ref().and_then(|s| s.items_of(mat.id)), *resident_only)
            }
            _ => (None, false),
        };
        let Some(items) = items else {
            f(0..mat.rows, self.bytes(mat.id));
            return Ok(());
        };
        for item in items {
            let it = &self.store.items.items[item];
            let rows = it.rows.as_ref().map_or(0..mat.rows, |p| p.rows.clone());
            if let Some(at) = it.pinned_at {
                let region = self.store.pinned_pieces.ok_or_else(|| {
                    SourceError::Internal(format!(
                        "{} is pinned but no pinned piece was copied",
                        self.store.item_name(item)
                    ))
                })?;
                f(rows, &self.store.arena.bytes(region)[at..at + it.data_len]);
                continue;
            }
            if resident_only {
                return Err(SourceError::Internal(format!(
                    "{} is not resident, and a prediction does not read",
                    self.store.item_name(item)
                )));
            }
            let hold = self.store.acquire_item(item)?;
            f(rows, hold.data());
        }
        Ok(())
    }
}

impl Store {
    /// Makes a trunk unit resident and returns its bytes, starting the read-ahead after it. A
    /// split unit reads nothing here: its pieces are read as `row_blocks` asks for them.
    pub fn trunk(&self, unit: TrunkUnit) -> Result<TrunkGuard<'_>, SourceError> {
        let u = self.pack.unit_index(unit).ok_or_else(|| SourceError::Internal(format!("no trunk unit {unit:?}")))?;
        if let Some(base) = self.pinned[u] {
            return Ok(TrunkGuard { store: self, unit: u, held: Held::Pinned(base) });
        }
        if self.items.split[u].is_some() {
            return Ok(TrunkGuard { store: self, unit: u, held: Held::Split { resident_only: false } });
        }
        let item = self.items.whole[u]
            .ok_or_else(|| SourceError::Internal(format!("trunk unit {unit:?} is neither pinned nor streamed")))?;
        Ok(TrunkGuard { store: self, unit: u, held: Held::Ring(self.acquire_item(item)?) })
    }

    /// The unit's bytes if its read has completed (pinned, or read whole into the ring),
    /// without waiting or issuing a read: for predictions, which must never stall compute. The
    /// bytes of a unit read for the first time may not have been verified yet. A split unit is
    /// never resident whole: its view serves the small tensors and the pinned pieces (its
    /// router's, when [`super::pieces::SplitUnit::router_resident`]) and refuses the rest.
    pub fn trunk_if_resident(&self, unit: TrunkUnit) -> Option<TrunkGuard<'_>> {
        let u = self.pack.unit_index(unit)?;
        if let Some(base) = self.pinned[u] {
            return Some(TrunkGuard { store: self, unit: u, held: Held::Pinned(base) });
        }
        if self.items.split[u].as_ref().is_some_and(|s| s.router_resident) {
            return Some(TrunkGuard { store: self, unit: u, held: Held::Split { resident_only: true } });
        }
        let item = self.items.whole[u]?;
        let mut ring = lock(&self.ring);
        let slot = ring.slots.iter().position(|s| s.item == Some(item))?;
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
        let it = &self.items.items[item];
        let hold = RingHold { store: self, slot, base, data: it.data_at..it.data_at + it.data_len };
        Some(TrunkGuard { store: self, unit: u, held: Held::Ring(hold) })
    }

    /// Makes a ring item resident, issuing read-ahead for the items after it.
    fn acquire_item(&self, item: usize) -> Result<RingHold<'_>, SourceError> {
        let it = &self.items.items[item];
        let unit = it.unit;
        let (slot, ticket) = {
            let mut ring = lock(&self.ring);
            let window = ring.window(item);
            let slot = match ring.slots.iter().position(|s| s.item == Some(item)) {
                Some(s) => s,
                None => self.start_item_read(&mut ring, item, &window, Priority::Demand)?,
            };
            ring.slots[slot].users += 1;
            let ticket = ring.slots[slot].slot.ticket();
            for &next in window.iter().skip(1) {
                if !ring.slots.iter().any(|s| s.item == Some(next))
                    && self.start_item_read(&mut ring, next, &window, Priority::Prefetch).is_err()
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
            s.item = None;
            if ticket.is_some() && s.slot.ticket() == ticket {
                s.slot.abandon();
            } else {
                s.slot.clear();
            }
        };
        if let Some(t) = ticket {
            if let Err(e) = self.wait_io(t, WaitFor::Trunk(self.pack.layer_of_unit(unit))) {
                release(self);
                return Err(self.read_error(self.item_name(item), &e));
            }
        }
        let (base, verify) = {
            let mut ring = lock(&self.ring);
            let s = &mut ring.slots[slot].slot;
            if ticket.is_some() && s.ticket() == ticket {
                s.landed();
            }
            let base = s.filled();
            (base, self.verify_every_read || !ring.verified[item])
        };
        let Some(base) = base else {
            release(self);
            return Err(SourceError::Internal(format!(
                "{}: its slot is not filled after its read",
                self.item_name(item)
            )));
        };
        let data = it.data_at..it.data_at + it.data_len;
        if verify {
            let checked = match &it.rows {
                None => self.verify_unit(unit, base).map_err(|e| e.to_string()),
                Some(piece) => {
                    let got = kernels::hash::xxh3_64(&self.arena.bytes(base)[data.clone()]);
                    if got == piece.checksum {
                        Ok(())
                    } else {
                        Err(format!(
                            "{}: checksum {got:016x}, {:016x} when the unit was checked at open: the pack changed while in use",
                            self.pack.pack_path.display(),
                            piece.checksum
                        ))
                    }
                }
            };
            if let Err(message) = checked {
                release(self);
                return Err(SourceError::Corrupt { what: self.item_name(item), message });
            }
            lock(&self.ring).mark_verified(item);
        }
        Ok(RingHold { store: self, slot, base, data })
    }

    /// "trunk unit layer.3" or "trunk unit layer.3, rows 0..512 of tensor 41".
    fn item_name(&self, item: usize) -> String {
        let it = &self.items.items[item];
        let unit = self.pack.units[it.unit].unit.name();
        match &it.rows {
            None => format!("trunk unit {unit} of the pack"),
            Some(p) => {
                let name = self.index.tensors.get(p.tensor).map_or_else(|| p.tensor.to_string(), |t| t.name.clone());
                format!("trunk unit {unit} of the pack, rows {}..{} of {name}", p.rows.start, p.rows.end)
            }
        }
    }

    /// Picks a ring slot no guard holds and no item of `window` occupies, and starts reading
    /// ring item `item`.
    fn start_item_read(
        &self,
        ring: &mut TrunkRing,
        item: usize,
        window: &[usize],
        priority: Priority,
    ) -> Result<usize, SourceError> {
        let outside = |s: &RingSlot| s.users == 0 && s.item.is_none_or(|i| !window.contains(&i));
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
            let _ = self.wait_io(t, WaitFor::Trunk(None));
            s.slot.abandon();
        }
        let it: &RingItem = &self.items.items[item];
        let u = &self.pack.units[it.unit];
        let ticket: Ticket = self.reads.reserve();
        let target = s.slot.start_read(ticket);
        let len = it.read_len as usize;
        let range = FileRange { file: self.pack.pack_file, offset: it.read_offset, len, min_len: len };
        let op = self.arena.op(target, 0, range, unit_meta(u, priority));
        self.reads.submit(priority, vec![(ticket, vec![op])]);
        s.item = Some(item);
        let mut stats = lock(&self.stats);
        stats.trunk_bytes_read += it.read_len;
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
