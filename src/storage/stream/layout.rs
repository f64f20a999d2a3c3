//! Where everything is: the trunk pack's units and tensors (checked against the checkpoint), and
//! the arena's regions (pinned units, trunk ring slots, expert slots, embedding rows) as the plan
//! sizes them. Computed once at open; read-only afterwards.

use std::path::PathBuf;

use super::arena::Region;
use super::StreamError;
use crate::checkpoint::CheckpointIndex;
use crate::config::Config;
use crate::model::weights::{TensorId, TrunkUnit};
use crate::storage::pack::{Manifest, PackUnit};
use crate::storage::plan::Plan;

/// Bytes of one expert slot: the largest read window of an expert, for contiguous experts the
/// aligned window, for split ones six aligned windows.
pub fn expert_slot_bytes(cfg: &Config, align: u64) -> u64 {
    (cfg.expert_bytes() + 12 * align).div_ceil(align) * align
}

/// Bytes of the embedding row buffer for `rows` rows.
pub fn embed_buffer_bytes(cfg: &Config, rows: usize, align: u64) -> u64 {
    let row = 2 * cfg.hidden_size as u64;
    rows as u64 * embed_row_window(row, align)
}

/// The aligned window one embedding row of `row` bytes is read through (it may start anywhere
/// inside an alignment unit).
pub fn embed_row_window(row: u64, align: u64) -> u64 {
    align_up(row + 2 * align, align)
}

pub fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// A trunk unit of the pack.
pub struct UnitPlace {
    /// Per-row checksums (the embedding only).
    pub row_checksums: Vec<u64>,
    pub unit: PackUnit,
    pub file_offset: u64,
    pub len: u64,
    pub checksum: String,
}

/// Where a trunk tensor is: unit index and byte range inside the unit.
#[derive(Clone, Copy, Debug)]
pub struct Loc {
    pub unit: usize,
    pub offset: usize,
    pub len: usize,
}

/// The trunk pack as the store reads it.
pub struct PackLayout {
    pub pack_path: PathBuf,
    /// Index of the pack in the I/O stage's file list (after the checkpoint's shards).
    pub pack_file: usize,
    pub units: Vec<UnitPlace>,
    /// Per tensor id: its unit and place, for trunk tensors.
    pub tensor_loc: Vec<Option<Loc>>,
    pub unit_of_layer: Vec<usize>,
    pub head_unit: usize,
    pub embed: Loc,
}

impl PackLayout {
    /// Places every unit and tensor of `manifest`, checking each tensor against `index`.
    pub fn new(
        manifest: &Manifest,
        index: &CheckpointIndex,
        cfg: &Config,
        pack_path: PathBuf,
        pack_file: usize,
    ) -> Result<PackLayout, StreamError> {
        let (units, tensor_loc) = place_units(manifest, index)?;
        // Every trunk tensor must be in the pack: a manifest that lost one would otherwise send
        // its reads through another unit's view.
        for (unit, tensors) in crate::storage::pack::plan_units(cfg) {
            for t in tensors {
                if index.position(&t.name).is_some_and(|id| tensor_loc[id].is_none()) {
                    return Err(StreamError::Mismatch(format!(
                        "the trunk pack lacks {} of unit {}: run `k3ring pack --force`",
                        t.name,
                        unit.name()
                    )));
                }
            }
        }
        let unit_idx = |u: PackUnit| units.iter().position(|p| p.unit == u);
        let missing = |what: &str| StreamError::Mismatch(format!("the trunk pack has no {what} unit"));
        let unit_of_layer = (0..cfg.n_layers)
            .map(|l| unit_idx(PackUnit::Layer(l)).ok_or_else(|| missing("layer")))
            .collect::<Result<Vec<_>, _>>()?;
        let head_unit = unit_idx(PackUnit::Head).ok_or_else(|| missing("head"))?;
        let embed_unit = unit_idx(PackUnit::Embed).ok_or_else(|| missing("embed"))?;
        let embed_tensor = manifest.units.iter().find(|u| u.unit == "embed").and_then(|u| u.tensors.first());
        let embed = Loc {
            unit: embed_unit,
            offset: embed_tensor.map_or(0, |t| t.offset as usize),
            len: embed_tensor.map_or(0, |t| t.len as usize),
        };
        Ok(PackLayout { pack_path, pack_file, units, tensor_loc, unit_of_layer, head_unit, embed })
    }

    /// The unit index of a trunk unit; `None` for a layer the model does not have.
    pub fn unit_index(&self, unit: TrunkUnit) -> Option<usize> {
        match unit {
            TrunkUnit::Head => Some(self.head_unit),
            TrunkUnit::Layer(l) => self.unit_of_layer.get(l).copied(),
        }
    }

    /// The layer a unit belongs to (`None` for the head and the embedding).
    pub fn layer_of_unit(&self, unit: usize) -> Option<usize> {
        match self.units[unit].unit {
            PackUnit::Layer(l) => Some(l),
            _ => None,
        }
    }

    /// Where tensor `id` is inside its unit.
    pub fn loc(&self, id: TensorId) -> Option<Loc> {
        self.tensor_loc.get(id).copied().flatten()
    }
}

/// The unit a trunk tensor belongs to, by its name (as `pack` groups them): a layer's tensors in
/// that layer's unit, the embedding in its own, the rest in the head.
fn unit_of_tensor(name: &str) -> PackUnit {
    let embed = format!("{}embed_tokens.weight", crate::checkpoint::MODEL_PREFIX);
    if name == embed {
        return PackUnit::Embed;
    }
    let layer = name.split_once(".layers.").and_then(|(_, rest)| rest.split('.').next()?.parse().ok());
    layer.map_or(PackUnit::Head, PackUnit::Layer)
}

fn place_units(
    manifest: &Manifest,
    index: &CheckpointIndex,
) -> Result<(Vec<UnitPlace>, Vec<Option<Loc>>), StreamError> {
    let mut units = Vec::with_capacity(manifest.units.len());
    let mut tensor_loc = vec![None; index.tensors.len()];
    for (i, u) in manifest.units.iter().enumerate() {
        let unit = PackUnit::parse(&u.unit).ok_or_else(|| StreamError::Mismatch(format!("unknown unit {}", u.unit)))?;
        for t in &u.tensors {
            let id = index.position(&t.name).ok_or_else(|| {
                StreamError::Mismatch(format!(
                    "the trunk pack holds {} which the checkpoint lacks: run `k3ring pack --force`",
                    t.name
                ))
            })?;
            if unit_of_tensor(&t.name) != unit {
                return Err(StreamError::Mismatch(format!(
                    "the trunk pack holds {} in unit {}, where it does not belong: run `k3ring pack --force`",
                    t.name, u.unit
                )));
            }
            if index.tensors[id].len != t.len {
                return Err(StreamError::Mismatch(format!(
                    "{}: the pack and the checkpoint disagree on its size",
                    t.name
                )));
            }
            tensor_loc[id] = Some(Loc { unit: i, offset: t.offset as usize, len: t.len as usize });
        }
        units.push(UnitPlace {
            row_checksums: u.row_checksums.clone(),
            unit,
            file_offset: u.offset,
            len: u.len,
            checksum: u.checksum.clone(),
        });
    }
    Ok((units, tensor_loc))
}

/// Where each part of the arena goes.
pub struct ArenaLayout {
    /// Pinned units: unit index and region.
    pub pinned: Vec<(usize, Region)>,
    pub ring: Vec<Region>,
    pub experts: Vec<Region>,
    pub embed: Region,
    /// The small tensors of split units (see [`super::pieces`]).
    pub small: Region,
    /// The pinned pieces of split units (see [`super::pieces`]).
    pub pinned_pieces: Region,
    pub total: usize,
}

impl ArenaLayout {
    /// Assigns arena regions, each aligned to `align`: pinned units, ring slots, expert slots
    /// (holding an expert read at `expert_align`), the embedding row buffer
    /// (for `chunk_tokens` rows), the small tensors of split units and their pinned pieces
    /// (`(small_bytes, pinned_piece_bytes)`). Whether the
    /// ring slots hold every streamed item is checked by [`super::pieces::RingItems::new`].
    pub fn new(
        pack: &PackLayout,
        cfg: &Config,
        plan: &Plan,
        chunk_tokens: usize,
        (align, expert_align): (u64, u64),
        (small_bytes, pinned_piece_bytes): (usize, usize),
    ) -> Result<ArenaLayout, StreamError> {
        let mut off = 0u64;
        let mut take = |len: u64| {
            let r = Region { off: off as usize, len: len as usize };
            off += align_up(len.max(1), align);
            r
        };
        let mut pinned = Vec::with_capacity(plan.pinned_units.len());
        for want in &plan.pinned_units {
            let i =
                pack.units.iter().position(|u| u.unit == *want).ok_or_else(|| {
                    StreamError::Mismatch(format!("the plan pins {} which the pack lacks", want.name()))
                })?;
            pinned.push((i, take(pack.units[i].len)));
        }
        let ring = (0..plan.ring_slots).map(|_| take(plan.ring_slot_bytes)).collect();
        let slot = expert_slot_bytes(cfg, expert_align);
        if slot > plan.expert_slot_bytes {
            return Err(StreamError::Mismatch(format!(
                "expert slots of {} bytes planned, {slot} needed",
                plan.expert_slot_bytes
            )));
        }
        let experts = (0..plan.expert_slots).map(|_| take(slot)).collect();
        let embed = take(embed_buffer_bytes(cfg, chunk_tokens.max(1), align));
        // Nothing split, nothing allocated: the plan counts no small region then.
        let small = if small_bytes > 0 { take(small_bytes as u64) } else { Region { off: 0, len: 0 } };
        if pinned_piece_bytes as u64 > plan.pinned_piece_bytes {
            return Err(StreamError::Mismatch(format!(
                "pinned pieces of {pinned_piece_bytes} bytes chosen, {} planned",
                plan.pinned_piece_bytes
            )));
        }
        let pinned_pieces =
            if pinned_piece_bytes > 0 { take(pinned_piece_bytes as u64) } else { Region { off: 0, len: 0 } };
        Ok(ArenaLayout { pinned, ring, experts, embed, small, pinned_pieces, total: off as usize })
    }
}
