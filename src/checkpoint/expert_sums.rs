//! Expert checksums. Each of an expert's six tensors (in [`EXPERT_PARTS`](super::EXPERT_PARTS)
//! order, tensor bytes only, whatever the read windows around them) is cut into blocks of
//! [`EXPERT_BLOCK`] bytes from its start; the checksum is the xxh3-64 of the blocks' xxh3-64
//! digests (little-endian, in order). Blocks let several threads hash one expert at once, and
//! let each block be hashed by the thread whose product reads it, while the bytes are in its
//! cache (`model::expert_check`). `k3ring pack` records every expert's checksum in the manifest
//! (`storage::pack::experts`); the streaming store checks each expert it reads before a result
//! computed from it is used; `k3ring pack --verify` checks them all against the shards.

use kernels::hash::{xxh3_64, Xxh3};

/// Bytes per hashed block of an expert's tensor.
pub const EXPERT_BLOCK: usize = 1 << 20;
/// Below this many bytes an expert is hashed on the calling thread alone.
const PARALLEL_MIN: usize = 4 * EXPERT_BLOCK;

/// Folds block digests, in order, into the expert's checksum.
pub(crate) fn combine(digests: impl IntoIterator<Item = u64>) -> u64 {
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

/// An expert's checksum hashed a few blocks at a time: the store hashes landed experts in the
/// gaps while compute waits for a read, and finishes on first use what those gaps left. Holds
/// the fold of the digests so far, so it allocates nothing.
pub struct PartialChecksum {
    combined: Xxh3,
    /// Blocks hashed so far (their digests are in `combined`).
    hashed: usize,
}

impl Default for PartialChecksum {
    fn default() -> PartialChecksum {
        PartialChecksum { combined: Xxh3::new(), hashed: 0 }
    }
}

/// Blocks hashed between two folds of their digests.
const DIGESTS_PER_FOLD: usize = 64;

impl PartialChecksum {
    /// Hashes up to `blocks` more blocks of `parts` (the same parts every call), on the current
    /// rayon pool when there are several blocks of at least a block's bytes; returns whether
    /// every block is hashed.
    pub fn advance(&mut self, parts: &[&[u8]], blocks: usize) -> bool {
        use rayon::prelude::*;
        let total: usize = parts.iter().map(|p| p.len().div_ceil(EXPERT_BLOCK)).sum();
        let to = self.hashed.saturating_add(blocks).min(total);
        let block = |mut i: usize| -> &[u8] {
            for p in parts {
                let n = p.len().div_ceil(EXPERT_BLOCK);
                if i < n {
                    return &p[i * EXPERT_BLOCK..((i + 1) * EXPERT_BLOCK).min(p.len())];
                }
                i -= n;
            }
            &[]
        };
        while self.hashed < to {
            let from = self.hashed;
            let n = (to - from).min(DIGESTS_PER_FOLD);
            let mut digests = [0u64; DIGESTS_PER_FOLD];
            let bytes: usize = (from..from + n).map(|i| block(i).len()).sum();
            if n > 1 && bytes >= EXPERT_BLOCK {
                digests[..n].par_iter_mut().enumerate().for_each(|(j, d)| *d = xxh3_64(block(from + j)));
            } else {
                for (j, d) in digests[..n].iter_mut().enumerate() {
                    *d = xxh3_64(block(from + j));
                }
            }
            for d in &digests[..n] {
                self.combined.update(&d.to_le_bytes());
            }
            self.hashed += n;
        }
        to == total
    }

    /// Blocks hashed so far.
    pub fn blocks_hashed(&self) -> usize {
        self.hashed
    }

    /// Hashes what is left and returns the checksum ([`expert_checksum`]'s value).
    pub fn finish(mut self, parts: &[&[u8]]) -> u64 {
        self.advance(parts, usize::MAX);
        self.combined.digest()
    }
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
    fn a_checksum_hashed_a_few_blocks_at_a_time_is_the_whole_ones() {
        let big: Vec<u8> = (0..EXPERT_BLOCK * 9 / 2).map(|i| (i * 13 % 241) as u8).collect();
        let parts: [&[u8]; 4] = [b"abc", &big, b"", &big[..EXPERT_BLOCK + 5]];
        let want = expert_checksum(&parts);
        for step in [1, 2, 3, 7, 100] {
            let mut sum = PartialChecksum::default();
            let mut steps = 0;
            while !sum.advance(&parts, step) {
                steps += 1;
                assert!(steps < 100, "advance never finishes at step {step}");
            }
            assert_eq!(sum.blocks_hashed(), 1 + 5 + 2, "blocks at step {step}");
            assert_eq!(sum.finish(&parts), want, "step {step}");
        }
        // Finished part-way, and from nothing.
        let mut sum = PartialChecksum::default();
        assert!(!sum.advance(&parts, 3));
        assert_eq!(sum.blocks_hashed(), 3);
        assert_eq!(sum.finish(&parts), want);
        assert_eq!(PartialChecksum::default().finish(&parts), want);
        // Other bytes, another checksum.
        let mut other = big.clone();
        other[EXPERT_BLOCK * 2 + 1] ^= 1;
        let mut sum = PartialChecksum::default();
        sum.advance(&parts, 2);
        assert_ne!(sum.finish(&[b"abc", &other, b"", &big[..EXPERT_BLOCK + 5]]), want);
    }
}
