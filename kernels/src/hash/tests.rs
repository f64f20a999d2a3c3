//! Twin tests: every ISA's loops give the reference's XXH3-64 (`xxhash-rust`) for every length
//! and every way of splitting the input into updates.

#![allow(clippy::unwrap_used)]

use super::*;
use crate::testutil::bytes;

fn every_isa() -> Vec<(Isa, Fns)> {
    // SAFETY: only the ISAs this host has.
    Isa::available().into_iter().map(|isa| (isa, unsafe { Fns::for_isa(isa) })).collect()
}

/// Lengths around every boundary the algorithm has: the short paths (16, 128, 240), a stripe,
/// the buffer (256), a block of 16 stripes (1024), and a block of the engine's checksums.
fn lengths() -> Vec<usize> {
    let mut out: Vec<usize> = (0..=1100).collect();
    for base in [2048, 4096, 16 * 1024, 1 << 20] {
        out.extend(base - 65..base + 66);
    }
    out.push(3 * (1 << 20) + 12_345);
    out
}

#[test]
fn every_isa_gives_the_references_hash_for_every_length() {
    let data = bytes(3 * (1 << 20) + 12_345, 1);
    for (isa, fns) in every_isa() {
        for len in lengths() {
            let want = xxhash_rust::xxh3::xxh3_64(&data[..len]);
            assert_eq!(fns.xxh3_64(&data[..len]), want, "{isa}, {len} bytes");
            // Not aligned to anything.
            let shifted = &data[3..3 + len.min(data.len() - 3)];
            assert_eq!(fns.xxh3_64(shifted), xxhash_rust::xxh3::xxh3_64(shifted), "{isa}, {len} bytes at offset 3");
        }
    }
    assert_eq!(xxh3_64(&data), xxhash_rust::xxh3::xxh3_64(&data), "the best ISA's");
}

#[test]
fn the_loops_of_every_isa_match_the_scalar_definition() {
    let data = bytes(16 * STRIPE, 2);
    let scalar = every_isa()[0].1;
    for (isa, fns) in every_isa() {
        for n in 0..=STRIPES_PER_BLOCK {
            for offset in [0, 8, 8 * (STRIPES_PER_BLOCK - n)] {
                let (mut want, mut got) = (INITIAL_ACC, INITIAL_ACC);
                // SAFETY: ISAs this host has.
                unsafe {
                    (scalar.accumulate)(&mut want, &data[..n * STRIPE], &SECRET[offset..]);
                    (fns.accumulate)(&mut got, &data[..n * STRIPE], &SECRET[offset..]);
                }
                assert_eq!(got, want, "{isa}: accumulate {n} stripes, secret from {offset}");
                // SAFETY: as above.
                unsafe {
                    (scalar.scramble)(&mut want, last_stripe_of_secret());
                    (fns.scramble)(&mut got, last_stripe_of_secret());
                }
                assert_eq!(got, want, "{isa}: scramble after {n} stripes");
            }
        }
    }
}

/// Splits `len` bytes into updates by `sizes`, cycling.
fn streamed(fns: Fns, data: &[u8], sizes: &[usize]) -> u64 {
    let mut h = Xxh3::with_fns(fns);
    let (mut at, mut k) = (0, 0);
    while at < data.len() {
        let n = sizes[k % sizes.len()].min(data.len() - at);
        h.update(&data[at..at + n]);
        at += n;
        k += 1;
    }
    h.digest()
}

#[test]
fn streaming_gives_the_one_shot_hash_however_the_input_is_split() {
    let data = bytes((1 << 20) + 4321, 3);
    let splits: [&[usize]; 9] =
        [&[1], &[7], &[63, 1], &[64], &[65], &[200, 56], &[256], &[257, 3, 1000], &[114_688, 5, 999_999]];
    for (isa, fns) in every_isa() {
        for len in [0, 1, 17, 129, 240, 241, 255, 256, 257, 300, 1023, 1024, 1025, 5000, 70_000, data.len()] {
            let want = xxhash_rust::xxh3::xxh3_64(&data[..len]);
            for sizes in splits {
                // Single-byte updates over a megabyte are slow in debug builds; a few KB show it.
                if sizes == [1] && len > 5000 {
                    continue;
                }
                assert_eq!(streamed(fns, &data[..len], sizes), want, "{isa}, {len} bytes in updates of {sizes:?}");
            }
        }
        // A digest in the middle does not disturb what follows; reset starts again.
        let mut h = Xxh3::with_fns(fns);
        h.update(&data[..1000]);
        assert_eq!(h.digest(), xxhash_rust::xxh3::xxh3_64(&data[..1000]));
        h.update(&data[1000..70_000]);
        assert_eq!(h.digest(), xxhash_rust::xxh3::xxh3_64(&data[..70_000]), "{isa}");
        h.reset();
        h.update(&data[..300]);
        assert_eq!(h.digest(), xxhash_rust::xxh3::xxh3_64(&data[..300]), "{isa}: after reset");
    }
}

#[test]
fn the_hasher_agrees_with_the_references_streaming_hasher_on_random_splits() {
    let data = bytes(600_000, 4);
    let mut seed = 12_345u64;
    for (isa, fns) in every_isa() {
        for _ in 0..40 {
            let (mut ours, mut reference) = (Xxh3::with_fns(fns), xxhash_rust::xxh3::Xxh3::new());
            let mut at = 0;
            while at < data.len() {
                seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                let n = match (seed >> 60) % 4 {
                    0 => (seed >> 20) as usize % 70,
                    1 => (seed >> 20) as usize % 600,
                    _ => (seed >> 20) as usize % 60_000,
                }
                .min(data.len() - at);
                ours.update(&data[at..at + n]);
                reference.update(&data[at..at + n]);
                at += n;
                if seed.is_multiple_of(7) {
                    assert_eq!(ours.digest(), reference.digest(), "{isa} at {at}");
                }
            }
            assert_eq!(ours.digest(), reference.digest(), "{isa}");
        }
    }
}
