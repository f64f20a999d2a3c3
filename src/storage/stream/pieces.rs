//! What the trunk ring cycles through: whole streamed units, or, for a unit the plan splits,
//! pieces of it: row blocks of each matrix in the order the forward pass reads them, each a
//! whole number of the matrix's granule (so no row's dot product, nor any block one computation
//! needs whole, spans two pieces). A split unit's other tensors (norms, biases, conv weights)
//! are small; they are copied once at open into a resident region.
//!
//! The pack's checksum covers a whole unit, which a split unit never holds at once. At open a
//! split unit is therefore read once, in file order through a ring slot: its checksum is
//! checked against the manifest (exit 3 on a mismatch), and the same pass computes each piece's
//! own checksum and copies the small tensors. Later reads of a piece are checked against that
//! checksum (on first use, or on every read with `verify_every_read`), like units are.
//!
//! Threads: built at open on the opening thread; read-only afterwards (the checksums are set
//! before the store is shared).

use std::ops::Range;

use super::layout::{align_up, PackLayout};
use super::{StreamError, WaitFor};
use crate::config::Config;
use crate::model::weights::{ModelWeights, Streamed, TensorId};
use crate::storage::pack::PackUnit;
use crate::storage::plan::Plan;

/// Rows of one matrix of a split unit.
#[derive(Clone, Debug)]
pub struct RowPiece {
    pub tensor: TensorId,
    pub rows: Range<usize>,
    /// xxh3-64 of the piece's bytes, from the pass at open (0 until then).
    pub checksum: u64,
}

/// One thing the ring reads into a slot.
#[derive(Clone, Debug)]
pub struct RingItem {
    /// Index of the unit in the pack.
    pub unit: usize,
    /// `None`: the whole unit.
    pub rows: Option<RowPiece>,
    /// The aligned window read from the pack: absolute offset and length.
    pub read_offset: u64,
    pub read_len: u64,
    /// Where the item's own bytes start in the slot, and how many there are.
    pub data_at: usize,
    pub data_len: usize,
    /// A piece held resident (the plan's pinned pieces): where its bytes are in that region.
    /// It is copied there at open and never read through the ring.
    pub pinned_at: Option<usize>,
}

/// A unit streamed in pieces.
#[derive(Clone, Debug, Default)]
pub struct SplitUnit {
    /// Per matrix, in use order: its id and the ring items holding its row blocks, in row order.
    pub matrices: Vec<(TensorId, Range<usize>)>,
    /// The unit's other tensors: id, offset in the unit, length, and offset in the small region.
    pub small: Vec<(TensorId, usize, usize, usize)>,
    /// Its router's pieces are all pinned: a prediction can score the layer without a read.
    pub router_resident: bool,
}

impl SplitUnit {
    /// The ring items of matrix `id`, if it is one of this unit's streamed matrices.
    pub fn items_of(&self, id: TensorId) -> Option<Range<usize>> {
        self.matrices.iter().find(|m| m.0 == id).map(|m| m.1.clone())
    }

    /// Where tensor `id` sits in the small region.
    pub fn small_of(&self, id: TensorId) -> Option<Range<usize>> {
        self.small.iter().find(|s| s.0 == id).map(|s| s.3..s.3 + s.2)
    }
}

/// Everything the ring cycles through, in the order a token uses it.
pub struct RingItems {
    pub items: Vec<RingItem>,
    /// Item ids in use order (streamed layers, then the head; wrapping to the next token).
    pub order: Vec<usize>,
    /// Per unit: its item when streamed whole.
    pub whole: Vec<Option<usize>>,
    /// Per unit: its pieces when split.
    pub split: Vec<Option<SplitUnit>>,
    /// Bytes of the small region (the small tensors of every split unit, 64-byte aligned).
    pub small_bytes: usize,
    /// Bytes of the region of pinned pieces (each 64-byte aligned).
    pub pinned_bytes: usize,
}

/// The matrices the forward pass reads from `unit`, in its order.
pub fn streamed_of(weights: &ModelWeights, cfg: &Config, unit: PackUnit) -> Vec<Streamed> {
    match unit {
        PackUnit::Layer(l) => weights.layers.get(l).map_or_else(Vec::new, |w| w.streamed(cfg)),
        PackUnit::Head => weights.globals.head_streamed(),
        PackUnit::Embed => Vec::new(),
    }
}

/// Bytes of the data of a granule block of each matrix: the smallest piece is the largest of
/// these over the model.
pub fn granule_bytes(s: &Streamed) -> u64 {
    (s.granule.min(s.mat.rows).max(1) * s.mat.cols * 2) as u64
}

/// Rows per piece of `s` for pieces of at most `piece` data bytes (at least one granule).
fn rows_per_piece(s: &Streamed, piece: u64) -> usize {
    let row = (s.mat.cols * 2) as u64;
    let granule = s.granule.max(1);
    let granules = (piece / row / granule as u64).max(1) as usize;
    granules * granule
}

impl RingItems {
    /// Lays out the streamed units of `plan`: whole, or cut into pieces of `plan.piece_bytes`.
    /// `slot_bytes` is a ring slot's size; every item must fit one.
    pub fn new(
        pack: &PackLayout,
        weights: &ModelWeights,
        cfg: &Config,
        plan: &Plan,
        pinned: &[usize],
        align: u64,
    ) -> Result<RingItems, StreamError> {
        let n = pack.units.len();
        let mut out = RingItems {
            items: Vec::new(),
            order: Vec::new(),
            whole: vec![None; n],
            split: vec![None; n],
            small_bytes: 0,
            pinned_bytes: 0,
        };
        let mut use_order: Vec<usize> = pack.unit_of_layer.clone();
        use_order.push(pack.head_unit);
        for u in use_order.into_iter().filter(|u| !pinned.contains(u)) {
            let place = &pack.units[u];
            if !plan.split_units.contains(&place.unit) {
                out.whole[u] = Some(out.items.len());
                out.order.push(out.items.len());
                out.items.push(RingItem {
                    unit: u,
                    rows: None,
                    read_offset: place.file_offset,
                    read_len: place.len,
                    data_at: 0,
                    data_len: place.len as usize,
                    pinned_at: None,
                });
                continue;
            }
            let piece = plan.piece_bytes.ok_or_else(|| {
                StreamError::Mismatch(format!("the plan splits {} without a piece size", place.unit.name()))
            })?;
            let mut split = SplitUnit::default();
            let streamed = streamed_of(weights, cfg, place.unit);
            for s in &streamed {
                let loc = pack.loc(s.mat.id).filter(|l| l.unit == u).ok_or_else(|| {
                    StreamError::Mismatch(format!(
                        "tensor {} of {} is not in that unit of the pack: run `k3ring pack --force`",
                        s.mat.id,
                        place.unit.name()
                    ))
                })?;
                let row = s.mat.cols * 2;
                if loc.len != s.mat.rows * row {
                    return Err(StreamError::Mismatch(format!(
                        "tensor {} of {}: {} bytes in the pack, {} x {} bf16 expected",
                        s.mat.id,
                        place.unit.name(),
                        loc.len,
                        s.mat.rows,
                        s.mat.cols
                    )));
                }
                let per = rows_per_piece(s, piece);
                let first = out.items.len();
                let mut r = 0;
                while r < s.mat.rows {
                    let end = (r + per).min(s.mat.rows);
                    let start = place.file_offset + (loc.offset + r * row) as u64;
                    let stop = start + ((end - r) * row) as u64;
                    let read_offset = start / align * align;
                    let read_len = align_up(stop, align) - read_offset;
                    out.order.push(out.items.len());
                    out.items.push(RingItem {
                        unit: u,
                        rows: Some(RowPiece { tensor: s.mat.id, rows: r..end, checksum: 0 }),
                        read_offset,
                        read_len,
                        data_at: (start - read_offset) as usize,
                        data_len: (stop - start) as usize,
                        pinned_at: None,
                    });
                    r = end;
                }
                split.matrices.push((s.mat.id, first..out.items.len()));
            }
            let mut small: Vec<(TensorId, usize, usize)> = (0..pack.tensor_loc.len())
                .filter_map(|id| pack.loc(id).filter(|l| l.unit == u).map(|l| (id, l.offset, l.len)))
                .filter(|(id, _, _)| !streamed.iter().any(|s| s.mat.id == *id))
                .collect();
            small.sort_by_key(|s| s.1);
            for (id, offset, len) in small {
                split.small.push((id, offset, len, out.small_bytes));
                out.small_bytes += len.div_ceil(64) * 64;
            }
            out.split[u] = Some(split);
        }
        out.pin_pieces(weights, plan.pinned_piece_bytes);
        if let Some(big) = out.items.iter().find(|i| i.read_len > plan.ring_slot_bytes) {
            return Err(StreamError::Mismatch(format!(
                "the plan's trunk slots of {} bytes cannot hold a read of {} bytes of {}",
                plan.ring_slot_bytes,
                big.read_len,
                pack.units[big.unit].unit.name()
            )));
        }
        Ok(out)
    }

    /// Holds pieces resident within `allowance` bytes as [`choose_pins`] picks them: every
    /// router's pieces first, layer by layer (a prediction scores the next layer with them, and
    /// a router is a small part of a layer), then the others spread evenly over the token's use
    /// order. Pinned pieces leave the use order. Nothing when `allowance` is 0.
    fn pin_pieces(&mut self, weights: &ModelWeights, allowance: u64) {
        if allowance == 0 {
            return;
        }
        let aligned = |it: &RingItem| (it.data_len.div_ceil(64) * 64) as u64;
        let router_ids: Vec<TensorId> = weights
            .layers
            .iter()
            .filter_map(|l| match &l.ffn {
                crate::model::weights::FfnWeights::Moe(w) => Some(w.gate.id),
                _ => None,
            })
            .collect();
        let (router_units, groups): (Vec<usize>, Vec<Vec<(usize, u64)>>) = (0..self.split.len())
            .filter_map(|u| {
                let items = router_ids.iter().find_map(|&r| self.split[u].as_ref()?.items_of(r))?;
                Some((u, items.map(|i| (i, aligned(&self.items[i]))).collect()))
            })
            .unzip();
        let router_items: Vec<usize> = groups.iter().flatten().map(|p| p.0).collect();
        let rest: Vec<(usize, u64)> = self
            .order
            .iter()
            .copied()
            .filter(|&i| self.items[i].rows.is_some() && !router_items.contains(&i))
            .map(|i| (i, aligned(&self.items[i])))
            .collect();
        let (pinned, routers_held) = choose_pins(&groups, &rest, allowance);
        for (u, held) in router_units.into_iter().zip(routers_held) {
            if let Some(split) = self.split[u].as_mut() {
                split.router_resident = held;
            }
        }
        for (i, bytes) in pinned {
            self.items[i].pinned_at = Some(self.pinned_bytes);
            self.pinned_bytes += bytes as usize;
        }
        let items = &self.items;
        self.order.retain(|&i| items[i].pinned_at.is_none());
    }

    /// The pieces of split unit `unit` with their data's range inside the unit, by offset.
    pub fn pieces_by_offset(&self, unit: usize, unit_offset: u64) -> Vec<(usize, Range<u64>)> {
        let mut v: Vec<(usize, Range<u64>)> = self
            .items
            .iter()
            .enumerate()
            .filter(|(_, it)| it.unit == unit && it.rows.is_some())
            .map(|(i, it)| {
                let start = it.read_offset + it.data_at as u64 - unit_offset;
                (i, start..start + it.data_len as u64)
            })
            .collect();
        v.sort_by_key(|p| p.1.start);
        v
    }
}

/// Which pieces to pin within `allowance` bytes: each group of `routers` (a router's pieces,
/// `(item, bytes)`) whole or not at all, in order, while it fits; then of `rest` (the other
/// pieces in use order) a piece is pinned while the pinned bytes so far stay within half a piece
/// of the share the allowance left covers of the bytes seen so far, so pinned and streamed pieces
/// alternate evenly. Returns the pinned `(item, bytes)` (routers first, then in use order) and
/// which router groups were pinned.
pub(crate) fn choose_pins(
    routers: &[Vec<(usize, u64)>],
    rest: &[(usize, u64)],
    allowance: u64,
) -> (Vec<(usize, u64)>, Vec<bool>) {
    let mut left = allowance;
    let mut pinned = Vec::new();
    let mut held = Vec::with_capacity(routers.len());
    for group in routers {
        let bytes: u64 = group.iter().map(|p| p.1).sum();
        let fits = bytes <= left;
        if fits {
            left -= bytes;
            pinned.extend_from_slice(group);
        }
        held.push(fits);
    }
    let total: u64 = rest.iter().map(|p| p.1).sum();
    let share = if total == 0 { 0.0 } else { (left as f64 / total as f64).min(1.0) };
    let (mut seen, mut kept) = (0u64, 0u64);
    for &(item, bytes) in rest {
        seen += bytes;
        if kept + bytes <= left && (kept + bytes) as f64 <= share * seen as f64 + bytes as f64 / 2.0 {
            kept += bytes;
            pinned.push((item, bytes));
        }
    }
    (pinned, held)
}

/// What the planner needs to know of pieces: per unit its small tensors' bytes, and the
/// smallest piece (the largest granule block of any matrix).
pub fn plan_input(
    weights: &ModelWeights,
    cfg: &Config,
    units: &[(PackUnit, Vec<(String, u64)>)],
    index: &crate::checkpoint::CheckpointIndex,
    align: u64,
    forced: Option<u64>,
) -> crate::storage::plan::PieceInput {
    let mut min_piece = 0u64;
    let mut small_bytes = Vec::new();
    for (unit, tensors) in units {
        let streamed = streamed_of(weights, cfg, *unit);
        for s in &streamed {
            min_piece = min_piece.max(granule_bytes(s));
        }
        let small: u64 = tensors
            .iter()
            .filter(|(name, _)| index.position(name).is_none_or(|id| !streamed.iter().any(|s| s.mat.id == id)))
            .map(|(_, len)| len.div_ceil(64) * 64)
            .sum();
        small_bytes.push((*unit, small));
    }
    crate::storage::plan::PieceInput { small_bytes, min_piece_bytes: min_piece, slack_bytes: 2 * align, forced }
}

impl super::Store {
    /// Reads each split unit once, in file order through the first ring slot: checks the unit
    /// against the manifest's checksum, records each piece's checksum and copies the small
    /// tensors into their region (see the module docs).
    pub(super) fn load_split(&mut self, layout: &super::layout::ArenaLayout) -> Result<(), StreamError> {
        use super::reads::Priority;
        let split_units: Vec<usize> = (0..self.items.split.len()).filter(|&u| self.items.split[u].is_some()).collect();
        if split_units.is_empty() {
            return Ok(());
        }
        let region = *layout
            .ring
            .first()
            .ok_or_else(|| StreamError::Mismatch("units are split but the plan has no trunk slot".into()))?;
        let chunk = (region.len as u64 / self.align * self.align).max(self.align);
        let mut slot = self.arena.slot(region);
        let (mut bytes_read, mut reads) = (0u64, 0u64);
        for u in split_units {
            let place = &self.pack.units[u];
            let pieces = self.items.pieces_by_offset(u, place.file_offset);
            let small = self.items.split[u].as_ref().map(|s| s.small.clone()).unwrap_or_default();
            let mut whole = kernels::hash::Xxh3::new();
            let mut piece_hash: Vec<kernels::hash::Xxh3> = pieces.iter().map(|_| kernels::hash::Xxh3::new()).collect();
            let mut at = 0u64;
            while at < place.len {
                let n = chunk.min(place.len - at);
                let ticket = self.reads.reserve();
                let target = slot.start_read(ticket);
                let range = super::arena::FileRange {
                    file: self.pack.pack_file,
                    offset: place.file_offset + at,
                    len: n as usize,
                    min_len: n as usize,
                };
                let op = self.arena.op(target, 0, range, super::trunk_ring::unit_meta(place, Priority::Demand));
                self.reads.submit(Priority::Demand, vec![(ticket, vec![op])]);
                if let Err(e) = self.wait_io(ticket, WaitFor::Trunk(None)) {
                    slot.abandon();
                    return Err(StreamError::SplitRead(e));
                }
                slot.landed();
                let filled = slot.filled().ok_or_else(|| StreamError::Mismatch("a trunk slot is not filled".into()))?;
                let data = &self.arena.bytes(filled)[..n as usize];
                whole.update(data);
                let window = at..at + n;
                for ((item, r), h) in pieces.iter().zip(&mut piece_hash) {
                    let (s, e) = (r.start.max(window.start), r.end.min(window.end));
                    if s < e {
                        h.update(&data[(s - at) as usize..(e - at) as usize]);
                        if let Some(to) = self.items.items[*item].pinned_at {
                            // SAFETY: as for the small region below: the region of pinned
                            // pieces is never a read's target, its `Filled` handle is made only
                            // after this pass, and each piece has its own disjoint range in it
                            // (`pin_pieces` hands out offsets one after the other).
                            unsafe {
                                self.arena.copy_into(
                                    layout.pinned_pieces,
                                    to + (s - r.start) as usize,
                                    filled,
                                    (s - at) as usize..(e - at) as usize,
                                );
                            }
                        }
                    }
                }
                for &(_, offset, len, to) in &small {
                    let (s, e) = ((offset as u64).max(window.start), ((offset + len) as u64).min(window.end));
                    if s < e {
                        let into = to + (s - offset as u64) as usize;
                        // SAFETY: the small region is a region of its own in the layout, never
                        // a read's target, and its `Filled` handle is made only after this loop.
                        unsafe {
                            self.arena.copy_into(layout.small, into, filled, (s - at) as usize..(e - at) as usize);
                        }
                    }
                }
                slot.clear();
                bytes_read += n;
                reads += 1;
                at += n;
            }
            let got = format!("{:016x}", whole.digest());
            if got != place.checksum {
                return Err(StreamError::Pack(crate::storage::pack::PackError::Checksum {
                    path: self.pack.pack_path.clone(),
                    unit: place.unit.name(),
                    want: place.checksum.clone(),
                    got,
                }));
            }
            for ((item, _), h) in pieces.iter().zip(&piece_hash) {
                if let Some(p) = self.items.items[*item].rows.as_mut() {
                    p.checksum = h.digest();
                }
            }
        }
        // SAFETY: every copy into the small region is done, and nothing writes it again.
        self.small = Some(unsafe { self.arena.copied(layout.small) });
        if self.items.pinned_bytes > 0 {
            // SAFETY: every pinned piece was copied whole in the pass above (each lies inside
            // its unit, which the pass read to the end), and nothing writes the region again.
            self.pinned_pieces = Some(unsafe { self.arena.copied(layout.pinned_pieces) });
        }
        let mut stats = super::lock(&self.stats);
        stats.trunk_bytes_read += bytes_read;
        stats.trunk_reads += reads;
        Ok(())
    }
}
