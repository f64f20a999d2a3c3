//! An expert's checksum hashed as its products read it. A streaming store may hand out an
//! expert's bytes before checking them ([`WeightSource::expert_unchecked`]); the MoE block then
//! computes the expert's three products under a [`ProductChecksum`]: once the kernel has
//! computed a block of rows, the thread that computed it feeds the rows' packed bytes to the
//! hash of the checksum block ([`EXPERT_BLOCK`]) they lie in, so that they are hashed from that
//! core's cache rather than from memory in a pass of their own (the kernel's arithmetic hides its
//! own first touch of memory; a hash that touched first would wait on memory itself). A block's
//! hash takes its bytes in order: where the threads' halves of a product split a block, the
//! thread whose rows come later first hashes the bytes before them that no thread has fed yet
//! (from memory), and the other thread's rows then find them hashed. The rows' scales (1/16 of
//! the bytes, read by the kernel with the rows) are fed the same way.
//! [`ProductChecksum::finish`] hashes whatever the products did not read (products that never
//! ran). No result of the products is used before the source has accepted the checksum
//! ([`ExpertView::confirm`]). The hash's loop is the kernels crate's ([`kernels::hash`]), picked
//! by ISA at run time.
//!
//! Allocation: the blocks' hash states live in the MoE scratch ([`CheckScratch`]), sized once
//! for the config's experts.
//!
//! [`WeightSource::expert_unchecked`]: super::weights::WeightSource::expert_unchecked
//! [`ExpertView::confirm`]: super::weights::ExpertView::confirm

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use kernels::hash::{xxh3_64, Xxh3};

use super::buffers::Buffers;
use super::weights::ExpertBytes;
use crate::checkpoint::expert_sums::{combine, EXPERT_BLOCK};
use crate::config::Config;

/// How far one checksum block's hash has got.
struct BlockHash {
    /// Bytes of the block fed so far, in order from its start.
    fed: usize,
    hasher: Xxh3,
    /// Its digest, once every byte was fed.
    digest: Option<u64>,
}

impl BlockHash {
    fn new() -> BlockHash {
        BlockHash { fed: 0, hasher: Xxh3::new(), digest: None }
    }

    fn reset(&mut self) {
        self.fed = 0;
        self.hasher.reset();
        self.digest = None;
    }
}

/// The hash states of one expert's blocks, per part in
/// [`EXPERT_PARTS`](crate::checkpoint::EXPERT_PARTS) order; reused from expert to expert.
pub struct CheckScratch {
    blocks: [Vec<Mutex<BlockHash>>; 6],
}

impl CheckScratch {
    pub fn new(cfg: &Config, b: &mut impl Buffers) -> CheckScratch {
        let (lat, f) = (cfg.moe.latent, cfg.moe.expert_hidden);
        let (packed, scales) = (f * lat / 2, f * lat / 32);
        let lens = [packed, scales, packed, scales, packed, scales];
        CheckScratch { blocks: lens.map(|len| b.each(len.div_ceil(EXPERT_BLOCK), |_| Mutex::new(BlockHash::new()))) }
    }

    /// Starts the checksum of the expert `b`. Parts longer than the config's (a checkpoint the
    /// config does not describe) get more block states, the one allocation here.
    pub fn begin<'a>(&'a mut self, b: ExpertBytes<'a>) -> ProductChecksum<'a> {
        let parts = b.parts();
        for (blocks, part) in self.blocks.iter_mut().zip(parts) {
            let n = part.len().div_ceil(EXPERT_BLOCK);
            if blocks.len() < n {
                blocks.resize_with(n, || Mutex::new(BlockHash::new()));
            }
            for block in &mut blocks[..n] {
                block.get_mut().unwrap_or_else(PoisonError::into_inner).reset();
            }
        }
        ProductChecksum { parts, blocks: &self.blocks, nanos: AtomicU64::new(0) }
    }
}

fn lock(m: &Mutex<BlockHash>) -> MutexGuard<'_, BlockHash> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The checksum of one expert's six tensors, hashed by its products as they read them.
pub struct ProductChecksum<'a> {
    parts: [&'a [u8]; 6],
    blocks: &'a [Vec<Mutex<BlockHash>>; 6],
    /// Nanoseconds the products spent hashing, summed over the threads.
    nanos: AtomicU64,
}

impl ProductChecksum<'_> {
    /// Rows `rows` of part `part` (a packed weight or its scales, of `row_len`-byte rows) were
    /// just read by the kernel: feeds their blocks' hashes up to the rows' end, from where each
    /// block's hash had got (bytes another thread has not fed yet included; bytes already fed
    /// skipped).
    pub fn rows_read(&self, part: usize, row_len: usize, rows: Range<usize>) {
        let start = Instant::now();
        let bytes = self.parts[part];
        let (from, to) = ((rows.start * row_len).min(bytes.len()), (rows.end * row_len).min(bytes.len()));
        let mut at = from;
        while at < to {
            let block = at / EXPERT_BLOCK;
            let block_start = block * EXPERT_BLOCK;
            let block_end = (block_start + EXPERT_BLOCK).min(bytes.len());
            let end = to.min(block_end);
            let mut h = lock(&self.blocks[part][block]);
            let fed_to = block_start + h.fed;
            if fed_to < end {
                h.hasher.update(&bytes[fed_to..end]);
                h.fed = end - block_start;
                if end == block_end {
                    h.digest = Some(h.hasher.digest());
                }
            }
            at = end;
        }
        let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Whether every block of every part has its digest (what the products fed, all of it).
    #[cfg(test)]
    pub(crate) fn fully_fed(&self) -> bool {
        self.parts
            .iter()
            .zip(self.blocks)
            .all(|(part, blocks)| blocks[..part.len().div_ceil(EXPERT_BLOCK)].iter().all(|b| lock(b).digest.is_some()))
    }

    /// Hashes what the products did not (whole blocks) and returns the expert's checksum
    /// ([`expert_checksum`](crate::checkpoint::expert_sums::expert_checksum)'s value), with the
    /// time the hashing added: the products' share over the `threads` that shared it, plus this
    /// call's own.
    pub fn finish(self, threads: usize) -> (u64, f64) {
        let start = Instant::now();
        let digests = self.parts.iter().zip(self.blocks).flat_map(|(part, blocks)| {
            part.chunks(EXPERT_BLOCK).zip(blocks).map(|(bytes, h)| lock(h).digest.unwrap_or_else(|| xxh3_64(bytes)))
        });
        let sum = combine(digests);
        let in_products = self.nanos.load(Ordering::Relaxed) as f64 / 1e9 / threads.max(1) as f64;
        (sum, in_products + start.elapsed().as_secs_f64())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::checkpoint::expert_sums::expert_checksum;

    /// Six parts shaped like an expert's: three packed weights of `rows x row_len` bytes (rows
    /// that do and do not divide a block, rows longer than two blocks) and their scales.
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

    /// A scratch sized for no expert: `begin` grows it for these parts.
    fn scratch() -> CheckScratch {
        CheckScratch { blocks: Default::default() }
    }

    const SHAPES: [(usize, usize); 3] = [(700, 3584), (1000, 1536), (5, 2 * EXPERT_BLOCK + 77)];

    /// Two threads' stretches of `rows` in blocks of 64 rows, the second stretch's first.
    fn halves_second_first(rows: usize) -> impl Iterator<Item = Range<usize>> {
        let half = rows / 2;
        let blocks = |from: usize, to: usize| (from..to).step_by(64).map(move |r| r..(r + 64).min(to));
        blocks(half, rows).chain(blocks(0, half))
    }

    #[test]
    fn hashing_as_the_products_read_gives_the_experts_checksum() {
        let p = parts(SHAPES);
        let want = expert_checksum(&p.iter().map(Vec::as_slice).collect::<Vec<_>>());
        let mut scratch = scratch();
        for step in [1, 64, 1000] {
            let sum = scratch.begin(bytes(&p));
            for (part, (rows, row_len)) in [0, 2, 4].into_iter().zip(SHAPES) {
                for r in (0..rows).step_by(step) {
                    sum.rows_read(part, row_len, r..(r + step).min(rows));
                }
                let blocks = &sum.blocks[part][..p[part].len().div_ceil(EXPERT_BLOCK)];
                assert!(blocks.iter().all(|b| lock(b).digest.is_some()), "part {part} step {step}: hashed in order");
            }
            assert!(lock(&sum.blocks[1][0]).digest.is_none(), "scales not fed are left to finish");
            assert_eq!(sum.finish(2).0, want, "step {step}");
        }
        // Two threads' halves, the second first, in blocks of 64 rows: the second hashes the
        // split block's bytes before its rows, the first finds them hashed.
        let sum = scratch.begin(bytes(&p));
        for (part, (rows, row_len)) in [0, 2, 4].into_iter().zip(SHAPES) {
            for r in halves_second_first(rows) {
                sum.rows_read(part, row_len, r);
            }
            let blocks = &sum.blocks[part][..p[part].len().div_ceil(EXPERT_BLOCK)];
            assert!(blocks.iter().all(|b| lock(b).digest.is_some()), "part {part}: every block hashed");
        }
        assert_eq!(sum.finish(2).0, want);
        // Products that never ran (an earlier one failed): finish hashes their blocks.
        let sum = scratch.begin(bytes(&p));
        sum.rows_read(2, 1536, 0..1000);
        assert_eq!(sum.finish(2).0, want);
        // Other bytes, another checksum, through the same (reset) scratch.
        let mut other = p.clone();
        other[2][EXPERT_BLOCK + 3] ^= 1;
        let sum = scratch.begin(bytes(&other));
        sum.rows_read(2, 1536, 0..1000);
        assert_ne!(sum.finish(2).0, want);
        let sum = scratch.begin(bytes(&p));
        sum.rows_read(2, 1536, 0..1000);
        assert_eq!(sum.finish(2).0, want, "nothing of the last expert left in the scratch");
    }

    #[test]
    fn the_products_hash_the_scales_of_the_rows_they_read_too() {
        // As `moe::expert_products` feeds them: each block of rows, its packed bytes then its
        // scale bytes (a sixteenth of a row), two threads' halves, the second half first.
        // Rows of whole scale groups, as the kernel's are (a row of `cols` values has `cols / 2`
        // packed bytes and `cols / 32` scale bytes).
        const SHAPES: [(usize, usize); 3] = [(700, 3584), (1000, 1536), (5, 2 * EXPERT_BLOCK + 80)];
        let p = parts(SHAPES);
        let want = expert_checksum(&p.iter().map(Vec::as_slice).collect::<Vec<_>>());
        let mut scratch = scratch();
        let sum = scratch.begin(bytes(&p));
        for (part, (rows, row_len)) in [0, 2, 4].into_iter().zip(SHAPES) {
            for r in halves_second_first(rows) {
                sum.rows_read(part, row_len, r.clone());
                sum.rows_read(part + 1, row_len / 16, r);
            }
        }
        for (part, bytes) in p.iter().enumerate() {
            let blocks = &sum.blocks[part][..bytes.len().div_ceil(EXPERT_BLOCK)];
            assert!(blocks.iter().all(|b| lock(b).digest.is_some()), "part {part}: every block hashed by the products");
        }
        assert_eq!(sum.finish(2).0, want);
    }
}
