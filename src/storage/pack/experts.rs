//! Expert checksums. Each of an expert's six tensors (in
//! [`EXPERT_PARTS`](crate::checkpoint::EXPERT_PARTS) order, tensor bytes only, whatever the read
//! windows around them) is cut into blocks of [`EXPERT_BLOCK`] bytes from its start; the checksum
//! is the xxh3-64 of the blocks' xxh3-64 digests (little-endian, in order). Blocks let the store
//! hash one expert on every compute thread at once, which otherwise waits for it. `k3ring pack`
//! reads every expert once to record them in the manifest; the streaming store checks each
//! expert it reads before any compute uses it; `k3ring pack --verify` checks them all against
//! the shards.

use std::fs::File;
use std::os::unix::fs::FileExt;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use super::{io_err, PackError, COPY_CHUNK};
use crate::checkpoint::{CheckpointIndex, ExpertRef};

/// Bytes per hashed block of an expert's tensor.
pub const EXPERT_BLOCK: usize = 1 << 20;
/// Below this many bytes an expert is hashed on the calling thread alone.
const PARALLEL_MIN: usize = 4 * EXPERT_BLOCK;

const _: () = assert!(COPY_CHUNK.is_multiple_of(EXPERT_BLOCK), "pack reads whole blocks");

/// The checksums of one MoE layer's experts, by expert id.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerExpertSums {
    pub layer: usize,
    pub checksums: Vec<u64>,
}

/// Folds block digests, in order, into the expert's checksum.
fn combine(digests: impl IntoIterator<Item = u64>) -> u64 {
    let mut h = Xxh3::new();
    for d in digests {
        h.update(&d.to_le_bytes());
    }
    h.digest()
}

/// The checksum of an expert whose six tensors are `parts`, in `EXPERT_PARTS` order; the blocks
/// are hashed on the current rayon pool when the expert is large.
pub fn expert_checksum(parts: &[&[u8]]) -> u64 {
    use rayon::prelude::*;
    let blocks = parts.iter().flat_map(|p| p.chunks(EXPERT_BLOCK));
    if parts.iter().map(|p| p.len()).sum::<usize>() < PARALLEL_MIN {
        return combine(blocks.map(xxh3_64));
    }
    let blocks: Vec<&[u8]> = blocks.collect();
    let digests: Vec<u64> = blocks.par_iter().map(|b| xxh3_64(b)).collect();
    combine(digests)
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
    fn the_checksum_folds_the_digests_of_each_parts_blocks() {
        let big: Vec<u8> = (0..EXPERT_BLOCK * 9 / 2).map(|i| (i * 7 % 251) as u8).collect();
        let parts: [&[u8]; 3] = [b"abc", &big, b"defgh"];
        let mut digests = vec![xxh3_64(b"abc")];
        for k in 0..5 {
            digests.push(xxh3_64(&big[k * EXPERT_BLOCK..((k + 1) * EXPERT_BLOCK).min(big.len())]));
        }
        digests.push(xxh3_64(b"defgh"));
        let bytes: Vec<u8> = digests.iter().flat_map(|d| d.to_le_bytes()).collect();
        let want = xxh3_64(&bytes);
        assert_eq!(expert_checksum(&parts), want, "the parallel path (above PARALLEL_MIN)");
        let small: [&[u8]; 2] = [b"abc", b"defgh"];
        let bytes: Vec<u8> = [xxh3_64(b"abc"), xxh3_64(b"defgh")].iter().flat_map(|d| d.to_le_bytes()).collect();
        assert_eq!(expert_checksum(&small), xxh3_64(&bytes), "the sequential path");
        // Bytes moved across a part boundary change it.
        assert_ne!(expert_checksum(&[b"ab", b"cdefgh"]), expert_checksum(&[b"abc", b"defgh"]));
    }

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
