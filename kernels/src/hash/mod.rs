//! XXH3-64 (seed 0, the default secret), the checksum of every unit, piece and expert block the
//! engine reads, with its long-input loop picked at run time.
//!
//! `xxhash-rust` (the reference, and the short-input path here) picks its SIMD loop when it is
//! compiled, so a portable x86-64 build hashes with SSE2: about half of what AVX2 gives on a
//! block already in cache, where the engine hashes experts (inside their products). Here the
//! loop over 64-byte stripes and the scramble after each 1 KiB block are chosen by [`Isa`] like
//! every other kernel; inputs of at most 240 bytes, and the final mix, are the reference's own
//! code or a transcription of it. Every ISA gives the reference's value for every input and every
//! way of splitting it into updates (twin tests below).
//!
//! The algorithm (XXH3 specification, "long" inputs above 240 bytes): eight u64 accumulators;
//! each 64-byte stripe `i` of a block of 16 adds, per lane `l`, the stripe's word `l ^ 1` and the
//! product of the low and high halves of `word l ^ secret[8i + 8l..]`; after 16 stripes the
//! accumulators are scrambled with the secret's last 64 bytes. The last (possibly overlapping)
//! stripe uses the secret from byte 121, and the accumulators are merged with the secret from
//! byte 11 and the input length.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
pub(crate) mod scalar;

use std::sync::OnceLock;

use crate::isa::Isa;

/// Bytes per stripe.
const STRIPE: usize = 64;
/// Stripes between two scrambles: (secret bytes - a stripe) / 8.
const STRIPES_PER_BLOCK: usize = (SECRET.len() - STRIPE) / 8;
/// Bytes the streaming hasher holds back, so that the last stripe can be read whole.
const BUFFER: usize = 256;
/// Inputs up to this long take the reference's short paths.
const MID_SIZE_MAX: usize = 240;
const PRIME32_1: u64 = 0x9E37_79B1;
const PRIME32_2: u64 = 0x85EB_CA77;
const PRIME32_3: u64 = 0xC2B2_AE3D;
const PRIME64_1: u64 = 0x9E37_79B1_85EB_CA87;
const PRIME64_2: u64 = 0xC2B2_AE3D_27D4_EB4F;
const PRIME64_3: u64 = 0x1656_67B1_9E37_79F9;
const PRIME64_4: u64 = 0x85EB_CA77_C2B2_AE63;
const PRIME64_5: u64 = 0x27D4_EB2F_1656_67C5;
const INITIAL_ACC: [u64; 8] = [PRIME32_3, PRIME64_1, PRIME64_2, PRIME64_3, PRIME64_4, PRIME32_2, PRIME64_5, PRIME32_1];

/// The specification's default secret.
const SECRET: [u8; 192] = [
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c, 0xde, 0xd4, 0x6d,
    0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0,
    0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0,
    0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b,
    0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac,
    0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51,
    0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34,
    0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49,
    0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8,
    0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b,
    0x40, 0x7e,
];
/// Where the last stripe's secret starts.
const LAST_STRIPE_SECRET: usize = SECRET.len() - STRIPE - 7;
/// Where the merge's secret starts.
const MERGE_SECRET: usize = 11;

/// `(accumulators, stripes, secret)`: accumulates `stripes.len() / 64` whole stripes (the length
/// is a multiple of 64), stripe `i` with the secret's bytes `8i..8i + 64`.
pub(crate) type AccumulateFn = unsafe fn(&mut [u64; 8], &[u8], &[u8]);
/// `(accumulators, the secret's last 64 bytes)`.
pub(crate) type ScrambleFn = unsafe fn(&mut [u64; 8], &[u8; STRIPE]);

/// The long-input loops of one ISA.
#[derive(Clone, Copy)]
pub(crate) struct Fns {
    accumulate: AccumulateFn,
    scramble: ScrambleFn,
}

impl Fns {
    /// # Safety
    /// `isa` must be available on this host ([`Isa::is_available`]).
    pub(crate) unsafe fn for_isa(isa: Isa) -> Fns {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => Fns { accumulate: avx2::accumulate, scramble: avx2::scramble },
            _ => Fns { accumulate: scalar::accumulate, scramble: scalar::scramble },
        }
    }

    /// The loops of the best ISA this host has, chosen once per process.
    fn best() -> Fns {
        static BEST: OnceLock<Fns> = OnceLock::new();
        // SAFETY: Isa::best only returns ISAs this host can run.
        *BEST.get_or_init(|| unsafe { Fns::for_isa(Isa::best()) })
    }

    /// Accumulates the whole stripes of `stripes`, `in_block` of the current block's stripes
    /// being done already, scrambling at each block's end; returns the new `in_block`.
    fn consume(self, acc: &mut [u64; 8], mut in_block: usize, stripes: &[u8]) -> usize {
        assert!(stripes.len().is_multiple_of(STRIPE), "whole stripes only, got {} bytes", stripes.len());
        let mut rest = stripes;
        while !rest.is_empty() {
            let n = (STRIPES_PER_BLOCK - in_block).min(rest.len() / STRIPE);
            let (now, later) = rest.split_at(n * STRIPE);
            // SAFETY: `self` was built for an ISA this host has (`for_isa`'s contract); `now` is
            // whole stripes, and the secret from `8 * in_block` holds `8 * (n - 1) + 64` bytes
            // since `in_block + n <= 16`.
            unsafe { (self.accumulate)(acc, now, &SECRET[8 * in_block..]) };
            in_block += n;
            if in_block == STRIPES_PER_BLOCK {
                // SAFETY: as above.
                unsafe { (self.scramble)(acc, last_stripe_of_secret()) };
                in_block = 0;
            }
            rest = later;
        }
        in_block
    }

    /// Accumulates the last stripe, which ends where the input ends.
    fn last_stripe(self, acc: &mut [u64; 8], stripe: &[u8; STRIPE]) {
        // SAFETY: `self` was built for an ISA this host has; one whole stripe, and the secret
        // from `LAST_STRIPE_SECRET` holds 64 bytes.
        unsafe { (self.accumulate)(acc, stripe, &SECRET[LAST_STRIPE_SECRET..]) };
    }

    /// XXH3-64 of `bytes`.
    pub(crate) fn xxh3_64(self, bytes: &[u8]) -> u64 {
        if bytes.len() <= MID_SIZE_MAX {
            return xxhash_rust::xxh3::xxh3_64(bytes);
        }
        let mut acc = INITIAL_ACC;
        let whole = (bytes.len() - 1) / STRIPE * STRIPE;
        self.consume(&mut acc, 0, &bytes[..whole]);
        self.last_stripe(&mut acc, last_64(bytes));
        merge(&acc, bytes.len() as u64)
    }
}

fn last_stripe_of_secret() -> &'static [u8; STRIPE] {
    last_64(&SECRET)
}

/// The last 64 bytes of `bytes`, which a long input's callers guarantee it has.
fn last_64(bytes: &[u8]) -> &[u8; STRIPE] {
    match bytes.last_chunk::<STRIPE>() {
        Some(last) => last,
        None => panic!("a last stripe needs 64 bytes, got {}", bytes.len()),
    }
}

/// The little-endian u64 at byte `at` of `bytes`.
fn read64(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

fn mul128_fold64(a: u64, b: u64) -> u64 {
    let product = u128::from(a) * u128::from(b);
    (product as u64) ^ ((product >> 64) as u64)
}

fn avalanche(mut h: u64) -> u64 {
    h ^= h >> 37;
    h = h.wrapping_mul(0x1656_6791_9E37_79F9);
    h ^ (h >> 32)
}

/// The final mix of a long input's accumulators.
fn merge(acc: &[u64; 8], len: u64) -> u64 {
    let mut result = len.wrapping_mul(PRIME64_1);
    for i in 0..4 {
        let s = MERGE_SECRET + 16 * i;
        result = result
            .wrapping_add(mul128_fold64(acc[2 * i] ^ read64(&SECRET, s), acc[2 * i + 1] ^ read64(&SECRET, s + 8)));
    }
    avalanche(result)
}

/// XXH3-64 of `bytes` (seed 0, default secret), on the best ISA this host has: the same value as
/// `xxhash_rust::xxh3::xxh3_64`.
pub fn xxh3_64(bytes: &[u8]) -> u64 {
    Fns::best().xxh3_64(bytes)
}

/// A streaming XXH3-64: the digest of all the updates' bytes, in order, equals [`xxh3_64`] of
/// them joined, however they were split. Holds the last up to 256 bytes it was given, so an
/// update's bytes need not outlive the call.
#[derive(Clone)]
pub struct Xxh3 {
    fns: Fns,
    acc: [u64; 8],
    /// Bytes not yet accumulated (`buffered` of them, from the start), and, past them, the end of
    /// what was accumulated last: the digest reads its last stripe across the two.
    buffer: [u8; BUFFER],
    buffered: usize,
    /// Stripes of the current block accumulated.
    in_block: usize,
    total_len: u64,
}

impl Default for Xxh3 {
    fn default() -> Xxh3 {
        Xxh3::new()
    }
}

impl Xxh3 {
    /// A hasher on the best ISA this host has.
    pub fn new() -> Xxh3 {
        Xxh3::with_fns(Fns::best())
    }

    pub(crate) fn with_fns(fns: Fns) -> Xxh3 {
        Xxh3 { fns, acc: INITIAL_ACC, buffer: [0; BUFFER], buffered: 0, in_block: 0, total_len: 0 }
    }

    /// Starts again, as new.
    pub fn reset(&mut self) {
        *self = Xxh3::with_fns(self.fns);
    }

    /// Hashes `bytes` after everything given before.
    pub fn update(&mut self, mut bytes: &[u8]) {
        self.total_len = self.total_len.wrapping_add(bytes.len() as u64);
        if self.buffered + bytes.len() <= BUFFER {
            self.buffer[self.buffered..self.buffered + bytes.len()].copy_from_slice(bytes);
            self.buffered += bytes.len();
            return;
        }
        if self.buffered > 0 {
            let fill = BUFFER - self.buffered;
            self.buffer[self.buffered..].copy_from_slice(&bytes[..fill]);
            bytes = &bytes[fill..];
            self.in_block = self.fns.consume(&mut self.acc, self.in_block, &self.buffer);
            self.buffered = 0;
        }
        // `bytes` is not empty: the update overflowed the buffer. Keep 1..=256 bytes back (the
        // reference's split, which the digest's last stripe depends on).
        if bytes.len() > BUFFER {
            let consumed = (bytes.len() - 1) / BUFFER * BUFFER;
            self.in_block = self.fns.consume(&mut self.acc, self.in_block, &bytes[..consumed]);
            self.buffer[BUFFER - STRIPE..].copy_from_slice(&bytes[consumed - STRIPE..consumed]);
            bytes = &bytes[consumed..];
        }
        self.buffer[..bytes.len()].copy_from_slice(bytes);
        self.buffered = bytes.len();
    }

    /// The hash of everything given so far (the hasher can go on taking updates).
    pub fn digest(&self) -> u64 {
        if self.total_len <= MID_SIZE_MAX as u64 {
            return xxhash_rust::xxh3::xxh3_64(&self.buffer[..self.buffered]);
        }
        let mut acc = self.acc;
        let pending = &self.buffer[..self.buffered];
        if pending.len() >= STRIPE {
            let whole = (pending.len() - 1) / STRIPE * STRIPE;
            self.fns.consume(&mut acc, self.in_block, &pending[..whole]);
            self.fns.last_stripe(&mut acc, last_64(pending));
        } else {
            // The last stripe starts in bytes already accumulated, kept at the buffer's end.
            let mut stripe = [0u8; STRIPE];
            let catch_up = STRIPE - pending.len();
            stripe[..catch_up].copy_from_slice(&self.buffer[BUFFER - catch_up..]);
            stripe[catch_up..].copy_from_slice(pending);
            self.fns.last_stripe(&mut acc, &stripe);
        }
        merge(&acc, self.total_len)
    }
}

#[cfg(test)]
mod tests;
