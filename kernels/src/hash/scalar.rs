//! The long-input loops in portable Rust, the definition the SIMD loops are tested against.

use super::{read64, PRIME32_1, STRIPE};

/// Little-endian word `i` of `bytes`.
fn word(bytes: &[u8], i: usize) -> u64 {
    read64(bytes, 8 * i)
}

/// Stripe `i` of `stripes` with the secret's bytes `8i..8i + 64`.
pub(crate) fn accumulate(acc: &mut [u64; 8], stripes: &[u8], secret: &[u8]) {
    let (stripes, rest) = stripes.as_chunks::<STRIPE>();
    assert!(rest.is_empty(), "whole stripes only");
    for (i, stripe) in stripes.iter().enumerate() {
        let key = &secret[8 * i..8 * i + STRIPE];
        for lane in 0..8 {
            let data = word(stripe, lane);
            let keyed = data ^ word(key, lane);
            acc[lane ^ 1] = acc[lane ^ 1].wrapping_add(data);
            acc[lane] = acc[lane].wrapping_add((keyed & 0xFFFF_FFFF) * (keyed >> 32));
        }
    }
}

pub(crate) fn scramble(acc: &mut [u64; 8], secret: &[u8; STRIPE]) {
    for (lane, a) in acc.iter_mut().enumerate() {
        let mixed = (*a ^ (*a >> 47)) ^ word(secret, lane);
        *a = mixed.wrapping_mul(PRIME32_1);
    }
}
