//! The long-input loops on AVX2: a stripe's eight lanes in two ymm registers, the accumulators
//! held in registers across a run of stripes. Integer operations only, so the bits are the
//! scalar loops' by construction.

use std::arch::x86_64::{
    __m256i, _mm256_add_epi64, _mm256_loadu_si256, _mm256_mul_epu32, _mm256_set1_epi32, _mm256_shuffle_epi32,
    _mm256_slli_epi64, _mm256_srli_epi64, _mm256_storeu_si256, _mm256_xor_si256,
};

use super::{PRIME32_1, STRIPE};

/// Lanes 0-3 and 4-7 of 64 bytes at `p`.
///
/// # Safety
/// `p` must point at 64 readable bytes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load_stripe(p: *const u8) -> [__m256i; 2] {
    // SAFETY: the caller's 64 bytes; unaligned loads.
    unsafe { [_mm256_loadu_si256(p.cast()), _mm256_loadu_si256(p.add(32).cast())] }
}

/// [`super::scalar::accumulate`]: lane `l` gets the word `l ^ 1` (the shuffle swaps each pair of
/// 32-bit halves' pairs, that is the two u64 of each 128-bit half) and the product of the low and
/// high halves of the keyed word `l`.
#[target_feature(enable = "avx2")]
pub(crate) fn accumulate(acc: &mut [u64; 8], stripes: &[u8], secret: &[u8]) {
    let n = stripes.len() / STRIPE;
    assert!(stripes.len().is_multiple_of(STRIPE) && (n == 0 || secret.len() >= 8 * (n - 1) + STRIPE));
    // SAFETY: `acc` is 64 bytes.
    let mut a = unsafe { load_stripe(acc.as_ptr().cast()) };
    for i in 0..n {
        // SAFETY: stripe `i` is bytes `64i..64i + 64` of `stripes` and its key bytes `8i..8i + 64`
        // of `secret`, both in bounds by the assert.
        let (data, key) =
            unsafe { (load_stripe(stripes.as_ptr().add(STRIPE * i)), load_stripe(secret.as_ptr().add(8 * i))) };
        for h in 0..2 {
            let keyed = _mm256_xor_si256(data[h], key[h]);
            let product = _mm256_mul_epu32(keyed, _mm256_srli_epi64::<32>(keyed));
            let swapped = _mm256_shuffle_epi32::<0b01_00_11_10>(data[h]);
            a[h] = _mm256_add_epi64(a[h], _mm256_add_epi64(product, swapped));
        }
    }
    let p: *mut __m256i = acc.as_mut_ptr().cast();
    // SAFETY: `acc` is 64 bytes: two unaligned stores.
    unsafe {
        _mm256_storeu_si256(p, a[0]);
        _mm256_storeu_si256(p.add(1), a[1]);
    }
}

/// [`super::scalar::scramble`]: the multiply by a 32-bit prime as two 32x32 products.
#[target_feature(enable = "avx2")]
pub(crate) fn scramble(acc: &mut [u64; 8], secret: &[u8; STRIPE]) {
    let prime = _mm256_set1_epi32(PRIME32_1 as i32);
    // SAFETY: `acc` and `secret` are 64 bytes each.
    let (mut a, key) = unsafe { (load_stripe(acc.as_ptr().cast()), load_stripe(secret.as_ptr())) };
    for h in 0..2 {
        let mixed = _mm256_xor_si256(_mm256_xor_si256(a[h], _mm256_srli_epi64::<47>(a[h])), key[h]);
        let low = _mm256_mul_epu32(mixed, prime);
        let high = _mm256_mul_epu32(_mm256_srli_epi64::<32>(mixed), prime);
        a[h] = _mm256_add_epi64(low, _mm256_slli_epi64::<32>(high));
    }
    let p: *mut __m256i = acc.as_mut_ptr().cast();
    // SAFETY: `acc` is 64 bytes: two unaligned stores.
    unsafe {
        _mm256_storeu_si256(p, a[0]);
        _mm256_storeu_si256(p.add(1), a[1]);
    }
}
