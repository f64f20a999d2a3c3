//! Expert checksums in the pack: `k3ring pack` reads every expert once to record its checksum
//! (defined in [`crate::checkpoint::expert_sums`]) in the manifest, and `k3ring pack --verify`
//! checks them all against the shards.

use std::fs::File;
use std::os::unix::fs::FileExt;

use kernels::hash::xxh3_64;
use serde::{Deserialize, Serialize};

use super::{io_err, PackError, COPY_CHUNK};
use crate::checkpoint::expert_sums::{combine, EXPERT_BLOCK};
use crate::checkpoint::{CheckpointIndex, ExpertRef};

const _: () = assert!(COPY_CHUNK.is_multiple_of(EXPERT_BLOCK), "pack reads whole blocks");

/// The checksums of one MoE layer's experts, by expert id.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerExpertSums {
    pub layer: usize,
    pub checksums: Vec<u64>,
}

/// Tensor bytes of one expert.
pub fn expert_len(index: &CheckpointIndex, r: &ExpertRef) -> u64 {
    r.parts.iter().map(|&id| index.tensors[id].len).sum()
}

/// Reads one expert's parts from the shards (`files`, opened in index order) through `buf` and
/// returns its checksum; `progress` gets the bytes read.
pub fn read_expert_checksum(
    index: &CheckpointIndex,
    files: &[File],
    r: &ExpertRef,
    buf: &mut Vec<u8>,
    progress: &mut dyn FnMut(u64),
) -> Result<u64, PackError> {
    let mut digests = Vec::new();
    for &id in &r.parts {
        let t = &index.tensors[id];
        let path = &index.shards[t.shard].path;
        let mut at = 0;
        // Reads start on block boundaries of the tensor (COPY_CHUNK is a multiple of a block).
        while at < t.len {
            let n = (t.len - at).min(COPY_CHUNK as u64) as usize;
            buf.resize(n, 0);
            files[t.shard].read_exact_at(&mut buf[..n], t.offset + at).map_err(io_err("read", path))?;
            digests.extend(buf[..n].chunks(EXPERT_BLOCK).map(xxh3_64));
            progress(n as u64);
            at += n as u64;
        }
    }
    Ok(combine(digests))
}

/// Opens every shard of `index` for reading.
pub fn open_shards(index: &CheckpointIndex) -> Result<Vec<File>, PackError> {
    index.shards.iter().map(|s| File::open(&s.path).map_err(io_err("open", &s.path))).collect()
}

/// Every expert in disk order (shard, offset of its first byte), so that threads taking runs
/// of this list read the shards forwards.
pub fn experts_in_disk_order(index: &CheckpointIndex) -> Vec<&ExpertRef> {
    let mut experts: Vec<&ExpertRef> = index.experts.iter().collect();
    experts.sort_by_key(|r| {
        let first = r.parts.iter().map(|&id| &index.tensors[id]).min_by_key(|t| (t.shard, t.offset));
        first.map(|t| (t.shard, t.offset))
    });
    experts
}

/// The checksums of every expert of `index`, read on the current rayon pool; `progress` gets
/// the bytes read.
pub fn checksum_all(
    index: &CheckpointIndex,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Vec<LayerExpertSums>, PackError> {
    use rayon::prelude::*;
    let files = open_shards(index)?;
    let experts = experts_in_disk_order(index);
    let sums: Vec<(usize, usize, u64)> = experts
        .par_iter()
        .with_min_len(16)
        .map_init(Vec::new, |buf, r| {
            let sum = read_expert_checksum(index, &files, r, buf, &mut |n| progress(n))?;
            Ok((r.layer, r.expert, sum))
        })
        .collect::<Result<_, PackError>>()?;
    Ok(by_layer(sums))
}

/// Groups (layer, expert, checksum) into per-layer lists indexed by expert id, layers ascending.
fn by_layer(sums: Vec<(usize, usize, u64)>) -> Vec<LayerExpertSums> {
    let mut out: Vec<LayerExpertSums> = Vec::new();
    let mut sorted = sums;
    sorted.sort_unstable();
    for (layer, expert, sum) in sorted {
        if out.last().is_none_or(|l| l.layer != layer) {
            out.push(LayerExpertSums { layer, checksums: Vec::new() });
        }
        if let Some(l) = out.last_mut() {
            if l.checksums.len() <= expert {
                l.checksums.resize(expert + 1, 0);
            }
            l.checksums[expert] = sum;
        }
    }
    out
}

/// Per layer, the checksums by expert id (empty for layers without experts): the store's
/// lookup table.
pub fn lookup_table(sums: &[LayerExpertSums]) -> Vec<Vec<u64>> {
    let layers = sums.iter().map(|l| l.layer + 1).max().unwrap_or(0);
    let mut table = vec![Vec::new(); layers];
    for l in sums {
        table[l.layer].clone_from(&l.checksums);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_are_grouped_by_layer_and_indexed_by_expert() {
        let sums = by_layer(vec![(3, 1, 31), (1, 0, 10), (3, 0, 30), (1, 1, 11)]);
        assert_eq!(
            sums,
            vec![
                LayerExpertSums { layer: 1, checksums: vec![10, 11] },
                LayerExpertSums { layer: 3, checksums: vec![30, 31] }
            ]
        );
        let table = lookup_table(&sums);
        assert_eq!(table.len(), 4);
        assert!(table[0].is_empty() && table[2].is_empty());
        assert_eq!(table[3][1], 31);
    }
}
