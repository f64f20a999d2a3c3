//! An expert's checksum hashed as its products read it. A streaming store may hand out an
//! expert's bytes before checking them ([`WeightSource::expert_unchecked`]); the MoE block then
//! computes the expert's three products under a [`ProductChecksum`]: each block of a packed
//! weight ([`EXPERT_BLOCK`]) is hashed by the thread that computes the rows starting in it, a
//! row block at a time just after the kernel has read those bytes, so that they are hashed from
//! that core's cache rather than from memory in a pass of their own (the kernel's arithmetic
//! hides its own first touch from memory; a hash that touched first would wait on memory
//! itself). What the products did not
//! hash (the scales, 1/16 of the bytes) is hashed by [`ProductChecksum::finish`]. No result of
//! the products is used before the source has accepted the checksum ([`ExpertView::confirm`]).
//!
//! [`WeightSource::expert_unchecked`]: super::weights::WeightSource::expert_unchecked
//! [`ExpertView::confirm`]: super::weights::ExpertView::confirm

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

use kernels::RowWatch;
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use super::weights::ExpertBytes;
use crate::checkpoint::expert_sums::{combine, EXPERT_BLOCK};

/// The checksum of one expert's six tensors, hashed by its products as they read them.
pub struct ProductChecksum<'a> {
    parts: [&'a [u8]; 6],
    /// Per part, the digest of each block once hashed.
    digests: [Vec<OnceLock<u64>>; 6],
    /// Nanoseconds spent hashing, summed over the threads.
    nanos: AtomicU64,
}

impl<'a> ProductChecksum<'a> {
    pub fn new(b: ExpertBytes<'a>) -> ProductChecksum<'a> {
        let parts = b.parts();
        let digests = parts.map(|p| (0..p.len().div_ceil(EXPERT_BLOCK)).map(|_| OnceLock::new()).collect());
        ProductChecksum { parts, digests, nanos: AtomicU64::new(0) }
    }

    /// The watch for the product of part `part` (a packed weight in
    /// [`EXPERT_PARTS`](crate::checkpoint::EXPERT_PARTS) order) with `rows` rows: its segments
    /// are the rows that start in each block.
    pub fn watch(&self, part: usize, rows: usize) -> PartWatch<'_> {
        let bytes = self.parts[part];
        let row_len = bytes.len().checked_div(rows).unwrap_or(0);
        let blocks = self.digests[part].len();
        let (mut starts, mut first_blocks) = (vec![0], vec![0]);
        for block in 1..blocks {
            // The first row starting at or after the block's first byte, if it starts inside it.
            let row = (block * EXPERT_BLOCK).div_ceil(row_len.max(1));
            if row < rows && row * row_len < (block + 1) * EXPERT_BLOCK && Some(&row) > starts.last() {
                starts.push(row);
                first_blocks.push(block);
            }
        }
        PartWatch { sum: self, bytes, row_len, digests: &self.digests[part], starts, first_blocks }
    }

    /// Hashes what the products did not and returns the expert's checksum
    /// ([`expert_checksum`](crate::checkpoint::expert_sums::expert_checksum)'s value), with the
    /// seconds spent hashing summed over the threads.
    pub fn finish(self) -> (u64, f64) {
        let start = Instant::now();
        let mut digests = Vec::new();
        for (part, blocks) in self.parts.iter().zip(&self.digests) {
            for (i, d) in blocks.iter().enumerate() {
                let block = || &part[i * EXPERT_BLOCK..((i + 1) * EXPERT_BLOCK).min(part.len())];
                digests.push(*d.get_or_init(|| xxh3_64(block())));
            }
        }
        let sum = combine(digests);
        let nanos = self.nanos.load(Ordering::Relaxed) as f64 + start.elapsed().as_nanos() as f64;
        (sum, nanos / 1e9)
    }
}

/// Hashes one packed weight's blocks as its product computes the rows: segment `k` owns the
/// blocks from `first_blocks[k]` to the next segment's, and computes the rows starting in them.
pub struct PartWatch<'a> {
    sum: &'a ProductChecksum<'a>,
    bytes: &'a [u8],
    row_len: usize,
    digests: &'a [OnceLock<u64>],
    starts: Vec<usize>,
    first_blocks: Vec<usize>,
}

/// A segment's hashing: the block being hashed and the next byte to feed it.
pub struct Feed {
    block: usize,
    at: usize,
    /// End of the segment's bytes.
    end: usize,
    hasher: Xxh3,
}

impl PartWatch<'_> {
    /// Feeds the segment's bytes up to `upto` (at most its end), ending each block it fills.
    fn feed(&self, f: &mut Feed, upto: usize) {
        let upto = upto.min(f.end);
        if f.at >= upto {
            return;
        }
        let start = Instant::now();
        while f.at < upto {
            let block_end = ((f.block + 1) * EXPERT_BLOCK).min(self.bytes.len());
            let to = upto.min(block_end);
            f.hasher.update(&self.bytes[f.at..to]);
            f.at = to;
            if to == block_end {
                // Each block belongs to one segment, which ends it once.
                let _ = self.digests[f.block].set(f.hasher.digest());
                f.hasher.reset();
                f.block += 1;
            }
        }
        let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.sum.nanos.fetch_add(nanos, Ordering::Relaxed);
    }
}

impl RowWatch for PartWatch<'_> {
    type State = Feed;

    fn segment_starts(&self) -> &[usize] {
        &self.starts
    }

    fn begin(&self, segment: usize) -> Feed {
        let first = self.first_blocks[segment];
        let end = self.first_blocks.get(segment + 1).map_or(self.bytes.len(), |&b| b * EXPERT_BLOCK);
        let mut f = Feed { block: first, at: first * EXPERT_BLOCK, end, hasher: Xxh3::new() };
        // The block's first bytes may end the previous segment's last row.
        self.feed(&mut f, self.starts[segment] * self.row_len);
        f
    }

    fn rows(&self, f: &mut Feed, rows: Range<usize>) {
        self.feed(f, rows.end * self.row_len);
    }

    fn end(&self, _segment: usize, mut f: Feed) {
        let end = f.end;
        self.feed(&mut f, end);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::checkpoint::expert_sums::expert_checksum;

    /// Six parts shaped like an expert's: three packed weights of `rows x row_len` bytes (rows
    /// that do and do not divide a block, one row longer than a block) and their scales.
    fn parts(shapes: [(usize, usize); 3]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        for (k, (rows, row_len)) in shapes.into_iter().enumerate() {
            out.push((0..rows * row_len).map(|i| ((i * 31 + k * 7) % 253) as u8).collect());
            out.push((0..rows * row_len / 16).map(|i| ((i * 17 + k) % 251) as u8).collect());
        }
        out
    }

    fn bytes(p: &[Vec<u8>]) -> ExpertBytes<'_> {
        ExpertBytes::from_parts([&p[0], &p[1], &p[2], &p[3], &p[4], &p[5]])
    }

    /// Runs a watch's segments as the kernel would, each on its own, blocks of `step` rows.
    fn run(w: &PartWatch<'_>, rows: usize, step: usize, order: &[usize]) {
        for &s in order {
            let mut f = w.begin(s);
            let end = w.starts.get(s + 1).copied().unwrap_or(rows);
            let mut r = w.starts[s];
            while r < end {
                let to = (r + step).min(end);
                w.rows(&mut f, r..to);
                r = to;
            }
            w.end(s, f);
        }
    }

    #[test]
    fn hashing_as_the_products_read_gives_the_experts_checksum() {
        let shapes = [(700, 3584), (1000, 1536), (5, 2 * EXPERT_BLOCK + 77)];
        let p = parts(shapes);
        let want = expert_checksum(&p.iter().map(Vec::as_slice).collect::<Vec<_>>());
        for step in [1, 64] {
            let sum = ProductChecksum::new(bytes(&p));
            for (part, (rows, _)) in [0, 2, 4].into_iter().zip(shapes) {
                let w = sum.watch(part, rows);
                assert!(w.starts.windows(2).all(|s| s[0] < s[1]) && w.starts.last() < Some(&rows));
                // The segments in reverse: each hashes its own blocks whatever runs first.
                let order: Vec<usize> = (0..w.starts.len()).rev().collect();
                run(&w, rows, step, &order);
                assert!(sum.digests[part].iter().all(|d| d.get().is_some()), "part {part} step {step}");
            }
            assert!(sum.digests[1].iter().all(|d| d.get().is_none()), "scales are left to finish");
            assert_eq!(sum.finish().0, want, "step {step}");
        }
        // Products that never ran (an earlier one failed): finish hashes their blocks.
        let sum = ProductChecksum::new(bytes(&p));
        run(&sum.watch(2, 1000), 1000, 64, &[0, 1]);
        assert_eq!(sum.finish().0, want);
        // Other bytes, another checksum.
        let mut other = p.clone();
        other[2][EXPERT_BLOCK + 3] ^= 1;
        let sum = ProductChecksum::new(bytes(&other));
        run(&sum.watch(2, 1000), 1000, 64, &[0, 1]);
        assert_ne!(sum.finish().0, want);
    }

    #[test]
    fn a_weights_segments_are_the_rows_starting_in_each_block() {
        let p = parts([(700, 3584), (1000, 1536), (5, 2 * EXPERT_BLOCK + 77)]);
        let sum = ProductChecksum::new(bytes(&p));
        // 3584-byte rows: block 1 starts inside row 292, so row 293 is its first.
        let w = sum.watch(0, 700);
        assert_eq!(w.starts, vec![0, 293, 586]);
        assert_eq!(w.first_blocks, vec![0, 1, 2]);
        // Rows longer than a block: every row starts in a block of its own, some blocks hold none.
        let w = sum.watch(4, 5);
        assert_eq!(w.starts, vec![0, 1, 2, 3, 4]);
        assert_eq!(w.first_blocks, vec![0, 2, 4, 6, 8]);
    }
}
