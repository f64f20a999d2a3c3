//! Expert references: the six tensors of each (layer, expert) and whether one read fetches them.
//!
//! The release does not store experts in id order, and nothing guarantees an expert's tensors
//! are adjacent, so both are discovered from the header offsets rather than assumed.

use serde::Serialize;

use super::{CheckpointError, TensorInfo, MODEL_PREFIX};

/// The six tensors of one routed expert, in this fixed order.
pub const EXPERT_PARTS: [ExpertPart; 6] = [
    ExpertPart::W1Packed,
    ExpertPart::W1Scale,
    ExpertPart::W3Packed,
    ExpertPart::W3Scale,
    ExpertPart::W2Packed,
    ExpertPart::W2Scale,
];

/// One of an expert's six tensors. w1 = gate, w3 = up, w2 = down.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum ExpertPart {
    W1Packed,
    W1Scale,
    W3Packed,
    W3Scale,
    W2Packed,
    W2Scale,
}

impl ExpertPart {
    /// The suffix after `experts.{e}.`.
    pub fn suffix(self) -> &'static str {
        match self {
            ExpertPart::W1Packed => "w1.weight_packed",
            ExpertPart::W1Scale => "w1.weight_scale",
            ExpertPart::W3Packed => "w3.weight_packed",
            ExpertPart::W3Scale => "w3.weight_scale",
            ExpertPart::W2Packed => "w2.weight_packed",
            ExpertPart::W2Scale => "w2.weight_scale",
        }
    }

    fn from_suffix(s: &str) -> Option<ExpertPart> {
        EXPERT_PARTS.iter().copied().find(|p| p.suffix() == s)
    }

    /// Position in [`EXPERT_PARTS`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Full tensor name of one part of one expert.
pub fn expert_tensor_name(layer: usize, expert: usize, part: ExpertPart) -> String {
    format!("{MODEL_PREFIX}layers.{layer}.block_sparse_moe.experts.{expert}.{}", part.suffix())
}

/// Where one expert's bytes are.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ExpertRef {
    pub layer: usize,
    pub expert: usize,
    /// Index into the checkpoint's tensor list, per part in [`EXPERT_PARTS`] order.
    pub parts: [usize; 6],
    /// When the six tensors tile one byte range of one shard: (shard, start, end).
    pub contiguous: Option<(usize, u64, u64)>,
}

impl ExpertRef {
    /// The O_DIRECT window around a contiguous expert: start rounded down and end rounded up to
    /// `align` (a power of two).
    pub fn aligned_window(&self, align: u64) -> Option<(usize, u64, u64)> {
        debug_assert!(align.is_power_of_two());
        self.contiguous.map(|(shard, start, end)| (shard, start & !(align - 1), end.div_ceil(align) * align))
    }
}

/// One aligned read of an expert from a shard: `len` bytes at `offset` of shard `shard`, landing
/// `at` bytes into the expert's slot; the first `min_len` must exist (a shard may end inside
/// the alignment after its last tensor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertWindow {
    pub shard: usize,
    pub offset: u64,
    pub len: u64,
    pub min_len: u64,
    pub at: u64,
}

/// How an expert is read at alignment `align` and where its parts land in the slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertImage {
    /// One window for a contiguous expert, else one per part (each aligned on its own).
    pub windows: Vec<ExpertWindow>,
    /// (offset in the slot, length) of each part, in [`EXPERT_PARTS`] order.
    pub parts: [(usize, usize); 6],
    /// Bytes of the slot the windows fill.
    pub len: u64,
}

impl ExpertImage {
    /// The slot image of `r` read with windows aligned to `align` (a power of two): the same
    /// bytes whether read from the shards or from an expert file that holds this image.
    pub fn new(tensors: &[TensorInfo], r: &ExpertRef, align: u64) -> ExpertImage {
        let down = |x: u64| x / align * align;
        let up = |x: u64| x.div_ceil(align) * align;
        let mut parts = [(0usize, 0usize); 6];
        let mut windows = Vec::with_capacity(6);
        if let Some((shard, start, end)) = r.contiguous {
            let ws = down(start);
            for (k, &id) in r.parts.iter().enumerate() {
                let t = &tensors[id];
                parts[k] = ((t.offset - ws) as usize, t.len as usize);
            }
            windows.push(ExpertWindow { shard, offset: ws, len: up(end) - ws, min_len: end - ws, at: 0 });
        } else {
            let mut cursor = 0u64;
            for (k, &id) in r.parts.iter().enumerate() {
                let t = &tensors[id];
                let ws = down(t.offset);
                let len = up(t.offset + t.len) - ws;
                parts[k] = ((cursor + t.offset - ws) as usize, t.len as usize);
                windows.push(ExpertWindow {
                    shard: t.shard,
                    offset: ws,
                    len,
                    min_len: t.offset + t.len - ws,
                    at: cursor,
                });
                cursor += len;
            }
        }
        let len = windows.iter().map(|w| w.len).sum();
        ExpertImage { windows, parts, len }
    }
}

/// All experts of a checkpoint, by layer then expert id (dense: 82k experts in the release).
///
/// Each layer holds only the experts present, sorted by id, so memory follows the header, not
/// the largest id a header names (a hostile header naming expert 1048575 of 4096 layers would
/// otherwise cost hundreds of GB of empty slots).
#[derive(Debug, Default)]
pub struct ExpertTable {
    by_layer: Vec<Vec<ExpertRef>>,
    count: usize,
}

/// Ids are parsed from names; anything this large is a corrupt or hostile header, not K3.
const LAYERS_MAX: usize = 4096;
const EXPERTS_PER_LAYER_MAX: usize = 1 << 20;

impl ExpertTable {
    /// Collects expert tensors by parsing names in one pass; an expert missing any of its six
    /// tensors is an error naming the missing one.
    pub fn build(tensors: &[TensorInfo]) -> Result<ExpertTable, CheckpointError> {
        // (layer, expert, part, tensor index): one per expert tensor, whatever its ids.
        let mut found: Vec<(usize, usize, usize, usize)> = Vec::new();
        for (i, t) in tensors.iter().enumerate() {
            let Some((layer, expert, part)) = parse_expert_name(&t.name) else { continue };
            if layer >= LAYERS_MAX || expert >= EXPERTS_PER_LAYER_MAX {
                return Err(CheckpointError::Schema {
                    tensor: t.name.clone(),
                    message: "layer or expert id is implausibly large".to_owned(),
                });
            }
            found.push((layer, expert, part.index(), i));
        }
        found.sort_unstable();
        let layers = found.last().map_or(0, |&(layer, ..)| layer + 1);
        let mut table = ExpertTable { by_layer: (0..layers).map(|_| Vec::new()).collect(), count: 0 };
        for group in found.chunk_by(|a, b| (a.0, a.1) == (b.0, b.1)) {
            let (layer, expert) = (group[0].0, group[0].1);
            let mut slots = [None; 6];
            for &(_, _, part, i) in group {
                // Distinct names can spell one id ("experts.7" and "experts.07"): refuse the
                // ambiguity rather than let one silently win.
                if let Some(first) = slots[part].replace(i) {
                    return Err(CheckpointError::Schema {
                        tensor: tensors[i].name.clone(),
                        message: format!(
                            "names the same expert tensor as {} (layer {layer}, expert {expert})",
                            tensors[first].name
                        ),
                    });
                }
            }
            let mut parts = [0usize; 6];
            for (k, slot) in slots.iter().enumerate() {
                parts[k] = slot.ok_or_else(|| CheckpointError::Schema {
                    tensor: expert_tensor_name(layer, expert, EXPERT_PARTS[k]),
                    message: "missing, while other tensors of this expert are present".to_owned(),
                })?;
            }
            let contiguous = contiguous_range(tensors, &parts);
            table.by_layer[layer].push(ExpertRef { layer, expert, parts, contiguous });
            table.count += 1;
        }
        Ok(table)
    }

    pub fn get(&self, layer: usize, expert: usize) -> Option<&ExpertRef> {
        let refs = self.by_layer.get(layer)?;
        // A complete layer holds expert e at position e; otherwise search the sorted ids.
        match refs.get(expert) {
            Some(r) if r.expert == expert => Some(r),
            _ => refs.binary_search_by_key(&expert, |r| r.expert).ok().map(|i| &refs[i]),
        }
    }

    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Every expert, by layer then id.
    pub fn iter(&self) -> impl Iterator<Item = &ExpertRef> {
        self.by_layer.iter().flatten()
    }

    /// Experts whose tensors need more than one read.
    pub fn non_contiguous(&self) -> impl Iterator<Item = &ExpertRef> {
        self.iter().filter(|r| r.contiguous.is_none())
    }
}

/// `(layer, expert, part)` from `...layers.{L}.block_sparse_moe.experts.{e}.{part}`.
fn parse_expert_name(name: &str) -> Option<(usize, usize, ExpertPart)> {
    let rest = name.strip_prefix(MODEL_PREFIX)?.strip_prefix("layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let rest = rest.strip_prefix("block_sparse_moe.experts.")?;
    let (expert, suffix) = rest.split_once('.')?;
    Some((layer.parse().ok()?, expert.parse().ok()?, ExpertPart::from_suffix(suffix)?))
}

/// The byte range the six tensors tile, if they sit back to back in one shard (in any order).
fn contiguous_range(tensors: &[TensorInfo], parts: &[usize; 6]) -> Option<(usize, u64, u64)> {
    let shard = tensors[parts[0]].shard;
    if parts.iter().any(|&p| tensors[p].shard != shard) {
        return None;
    }
    let mut ranges: Vec<(u64, u64)> = parts.iter().map(|&p| (tensors[p].offset, tensors[p].range().end)).collect();
    ranges.sort_unstable();
    let tiles = ranges.windows(2).all(|w| w[0].1 == w[1].0);
    tiles.then(|| (shard, ranges[0].0, ranges[5].1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_expert_names() {
        let n = expert_tensor_name(7, 123, ExpertPart::W2Scale);
        assert_eq!(parse_expert_name(&n), Some((7, 123, ExpertPart::W2Scale)));
        assert_eq!(parse_expert_name("language_model.model.layers.7.block_sparse_moe.gate.weight"), None);
    }

    #[test]
    fn aligned_window_rounds_outwards() {
        let r = ExpertRef { layer: 1, expert: 0, parts: [0; 6], contiguous: Some((0, 5000, 9000)) };
        assert_eq!(r.aligned_window(4096), Some((0, 4096, 12288)));
    }
}
