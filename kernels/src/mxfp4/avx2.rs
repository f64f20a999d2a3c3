//! AVX2+FMA MXFP4 kernel. Same bits as `scalar.rs`.
//!
//! A group of 32 elements (16 packed bytes) is decoded with byte shuffles into the exact bf16
//! patterns of the signed E2M1 values, widened to f32, and multiplied by the group's power of
//! two: the scalar definition's `(sign * E2M1[mag]) * 2^(s-127)`, the same single f32 product,
//! so overflow (s = 254) and subnormal (s = 0) results are identical too. See [`decode32`]:
//! 17 vector operations per 32 weights. `t == 1` streams 2 rows at once; `t > 1` goes through
//! [`crate::tiled`].

use std::arch::x86_64::{
    __m256, __m256i, _mm256_and_si256, _mm256_broadcastsi128_si256, _mm256_castsi256_ps, _mm256_fmadd_ps,
    _mm256_mul_ps, _mm256_set1_epi8, _mm256_set1_ps, _mm256_setr_epi8, _mm256_setzero_ps, _mm256_setzero_si256,
    _mm256_shuffle_epi8, _mm256_srli_epi16, _mm256_unpackhi_epi16, _mm256_unpackhi_epi8, _mm256_unpacklo_epi16,
    _mm256_unpacklo_epi8, _mm_loadu_si128, _mm_prefetch, _MM_HINT_T0,
};

use super::{e8m0_pow2, GROUP};
use crate::dot::avx2::{load16, reduce16, store16};
use crate::dot::scalar::LANES;
use crate::out::RowsOut;
use crate::tiled::{self, Source, Tile};

/// Bytes of packed data per group of 32 elements.
const GROUP_BYTES: usize = GROUP / 2;

/// bf16 bit patterns of the signed E2M1 values, nibble 0..=15 (`e2m1_signed` as bf16; every
/// value has at most 2 significant bits, so bf16 is exact): low bytes and high bytes.
const E2M1_BF16_LO: [u8; 16] =
    [0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0, 0x00, 0x00, 0x80, 0xC0, 0x00, 0x40, 0x80, 0xC0];
const E2M1_BF16_HI: [u8; 16] =
    [0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, 0x80, 0xBF, 0xBF, 0xBF, 0xC0, 0xC0, 0xC0, 0xC0];

/// A 16-byte table in both 128-bit lanes, for `vpshufb`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn table(bytes: &[u8; 16]) -> __m256i {
    // SAFETY: `bytes` holds 16 bytes; the load is unaligned.
    _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) })
}

/// Decodes one group (16 packed bytes, 32 elements) times `pow2` (the group's `2^(s-127)`)
/// into canonical order: elements 0-7, 8-15, 16-23, 24-31.
///
/// 1. Broadcast the 16 bytes to both lanes and pick, per lane, the bytes whose elements the
///    final in-lane unpacks will place there (lane 0: bytes 0,1,4,5,8,9,12,13; lane 1: the
///    others).
/// 2. Split nibbles (`& 0xF`, `>> 4 & 0xF`) and interleave them: element `2j` (low nibble of
///    byte `j`) before `2j + 1` (spec §4).
/// 3. `vpshufb` the nibbles into the bf16 bytes of the signed E2M1 value, interleave low and
///    high bytes into bf16, and bf16 into f32 (`bits << 16`, as zero low halves).
/// 4. Multiply by `pow2`: `(sign * E2M1[mag]) * 2^(s - 127)`, the scalar definition's product.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn decode32(b: &[u8; GROUP_BYTES], pow2: __m256) -> [__m256; 4] {
    // SAFETY: `b` holds 16 bytes; the load is unaligned.
    let v = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(b.as_ptr().cast()) });
    let pick = _mm256_setr_epi8(
        0, 1, 4, 5, 8, 9, 12, 13, -1, -1, -1, -1, -1, -1, -1, -1, //
        2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
    );
    let picked = _mm256_shuffle_epi8(v, pick);
    let low4 = _mm256_set1_epi8(0x0F);
    let lo = _mm256_and_si256(picked, low4);
    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(picked), low4);
    // Lane 0: elements 0-3, 8-11, 16-19, 24-27; lane 1: 4-7, 12-15, 20-23, 28-31.
    let nibbles = _mm256_unpacklo_epi8(lo, hi);
    let bf_lo = _mm256_shuffle_epi8(table(&E2M1_BF16_LO), nibbles);
    let bf_hi = _mm256_shuffle_epi8(table(&E2M1_BF16_HI), nibbles);
    // bf16 per element; lane 0: 0-3, 8-11 | lane 1: 4-7, 12-15 (and 16.. for `second`).
    let first = _mm256_unpacklo_epi8(bf_lo, bf_hi);
    let second = _mm256_unpackhi_epi8(bf_lo, bf_hi);
    let zero = _mm256_setzero_si256();
    let f32s = [
        _mm256_unpacklo_epi16(zero, first),
        _mm256_unpackhi_epi16(zero, first),
        _mm256_unpacklo_epi16(zero, second),
        _mm256_unpackhi_epi16(zero, second),
    ];
    let mut out = [_mm256_setzero_ps(); 4];
    for (o, f) in out.iter_mut().zip(f32s) {
        *o = _mm256_mul_ps(_mm256_castsi256_ps(f), pow2);
    }
    out
}

/// Hints the cache to fetch the line holding `p`; any address is fine (a prefetch never faults
/// and reads nothing architecturally).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn prefetch(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T0>(p.cast());
}

/// The group's `2^(s - 127)` in every lane.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn group_pow2(scale: u8) -> __m256 {
    _mm256_set1_ps(e8m0_pow2(scale))
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn matmul(packed: &[u8], scales: &[u8], cols: usize, x: &[f32], t: usize, out: &mut RowsOut<'_>) {
    if t == 1 {
        single_token(packed, scales, cols, x, out);
    } else {
        // SAFETY: this function's target features are AVX2 + FMA.
        unsafe { tiled::multi_token::<tiled::Avx2>(&Source::Mxfp4 { packed, scales }, cols, x, t, out) };
    }
}

#[target_feature(enable = "avx2,fma")]
fn single_token(packed: &[u8], scales: &[u8], cols: usize, x: &[f32], out: &mut RowsOut<'_>) {
    const R: usize = 2;
    let (pb, groups) = (cols / 2, cols / GROUP);
    let (x_chunks, _) = x.as_chunks::<LANES>();
    let packed_of = |r: usize, n: usize| &packed[r * pb..(r + n) * pb];
    let scales_of = |r: usize, n: usize| &scales[r * groups..(r + n) * groups];
    out.fill_token0_by_blocks(
        |r| rows_dot::<R>(packed_of(r, R), scales_of(r, R), cols, x_chunks),
        |r| rows_dot::<1>(packed_of(r, 1), scales_of(r, 1), cols, x_chunks),
    );
}

/// Canonical dots of `R` consecutive rows with one token.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn rows_dot<const R: usize>(packed: &[u8], scales: &[u8], cols: usize, x_chunks: &[[f32; LANES]]) -> [f32; R] {
    let (pb, groups) = (cols / 2, cols / GROUP);
    let mut rows: [&[[u8; GROUP_BYTES]]; R] = [&[]; R];
    let mut srows: [&[u8]; R] = [&[]; R];
    for i in 0..R {
        rows[i] = packed[i * pb..][..pb].as_chunks::<GROUP_BYTES>().0;
        srows[i] = &scales[i * groups..][..groups];
    }
    let mut lo = [_mm256_setzero_ps(); R];
    let mut hi = [_mm256_setzero_ps(); R];
    for g in 0..groups {
        if g % 4 == 0 {
            // The next R rows follow these ones in memory: request their line at this group's
            // offset now, so it arrives while this pair computes. Without it the loop waits on
            // DRAM (measured: 4.3 -> 5.3 GB/s streaming a 46 MB rotation of K3 experts).
            for i in 0..R {
                prefetch(packed.as_ptr().wrapping_add((R + i) * pb + g * GROUP_BYTES));
            }
        }
        let (xl0, xh0) = load16(&x_chunks[2 * g]);
        let (xl1, xh1) = load16(&x_chunks[2 * g + 1]);
        for i in 0..R {
            let [w0, w1, w2, w3] = decode32(&rows[i][g], group_pow2(srows[i][g]));
            lo[i] = _mm256_fmadd_ps(w0, xl0, lo[i]);
            hi[i] = _mm256_fmadd_ps(w1, xh0, hi[i]);
            lo[i] = _mm256_fmadd_ps(w2, xl1, lo[i]);
            hi[i] = _mm256_fmadd_ps(w3, xh1, hi[i]);
        }
    }
    let mut sums = [0.0f32; R];
    for i in 0..R {
        sums[i] = reduce16(lo[i], hi[i]);
    }
    sums
}

/// Decodes columns `c0..c0 + cn` of one row into `dst`; `c0` and `cn` are multiples of 32 and
/// `cn <= TILE_COLS`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn decode_segment(packed_row: &[u8], scale_row: &[u8], c0: usize, cn: usize, dst: &mut Tile) {
    let (g0, gn) = (c0 / GROUP, cn / GROUP);
    let (groups, _) = packed_row[g0 * GROUP_BYTES..(g0 + gn) * GROUP_BYTES].as_chunks::<GROUP_BYTES>();
    for (k, (group, &scale)) in groups.iter().zip(&scale_row[g0..g0 + gn]).enumerate() {
        let [w0, w1, w2, w3] = decode32(group, group_pow2(scale));
        store16(&mut dst[2 * k], w0, w1);
        store16(&mut dst[2 * k + 1], w2, w3);
    }
}

#[cfg(test)]
mod tests {
    use super::{E2M1_BF16_HI, E2M1_BF16_LO};
    use crate::mxfp4::e2m1_signed;

    #[test]
    fn bf16_tables_are_the_signed_e2m1_values() {
        for n in 0..16u8 {
            let i = usize::from(n);
            let bits = u32::from(u16::from_le_bytes([E2M1_BF16_LO[i], E2M1_BF16_HI[i]])) << 16;
            assert_eq!(bits, e2m1_signed(n).to_bits(), "nibble {n}");
        }
    }
}
