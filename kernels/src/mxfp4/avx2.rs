//! AVX2+FMA MXFP4 kernel. Same bits as `scalar.rs`.
//!
//! Decoding 8 elements (4 packed bytes): broadcast the 4 bytes as one u32 to all lanes,
//! `vpsrlvd` by [0, 4, ..., 28] so lane k holds nibble k in its low bits (little-endian: element
//! 2j is the low nibble of byte j), `vpermps` into the group's table (which reads only the low 3
//! bits = the magnitude), and xor in the sign (nibble bit 3 shifted to bit 31). The group table
//! is `E2M1 * 2^(s-127)`, one f32 multiplication per entry, which rounds exactly like the scalar
//! `(sign * E2M1[mag]) * 2^(s-127)` because IEEE multiplication is symmetric in sign.
//! `t == 1` streams 2 rows at once; `t > 1` goes through [`crate::tiled`].

use std::arch::x86_64::{
    __m256, __m256i, _mm256_and_si256, _mm256_castsi256_ps, _mm256_fmadd_ps, _mm256_mul_ps,
    _mm256_permutevar8x32_ps, _mm256_set1_epi32, _mm256_set1_ps, _mm256_setr_epi32,
    _mm256_setr_ps, _mm256_setzero_ps, _mm256_slli_epi32, _mm256_srlv_epi32, _mm256_xor_ps,
};

use super::{e8m0_pow2, GROUP};
use crate::dot::avx2::{load16, reduce16, store16};
use crate::dot::scalar::LANES;
use crate::out::RowsOut;
use crate::tiled::{self, Source, Tile};

/// Bytes of packed data per group of 32 elements.
const GROUP_BYTES: usize = GROUP / 2;

/// The group's 8 magnitudes times its scale: `E2M1[m] * 2^(s - 127)`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn group_table(scale: u8) -> __m256 {
    let e2m1 = _mm256_setr_ps(0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0);
    _mm256_mul_ps(e2m1, _mm256_set1_ps(e8m0_pow2(scale)))
}

/// Decodes the 8 elements held by 4 packed bytes with the group table.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn decode8(bytes: [u8; 4], table: __m256) -> __m256 {
    let word: __m256i = _mm256_set1_epi32(i32::from_le_bytes(bytes));
    let nibbles = _mm256_srlv_epi32(word, _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    // vpermps uses only bits 0-2 of each index: the magnitude.
    let magnitude = _mm256_permutevar8x32_ps(table, nibbles);
    let sign = _mm256_and_si256(_mm256_slli_epi32::<28>(nibbles), _mm256_set1_epi32(i32::MIN));
    _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign))
}

/// Decodes one group (16 packed bytes) into canonical lanes: (elements 0-7, 8-15) and
/// (16-23, 24-31).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn decode32(b: &[u8; GROUP_BYTES], table: __m256) -> [__m256; 4] {
    [
        decode8([b[0], b[1], b[2], b[3]], table),
        decode8([b[4], b[5], b[6], b[7]], table),
        decode8([b[8], b[9], b[10], b[11]], table),
        decode8([b[12], b[13], b[14], b[15]], table),
    ]
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn matmul(packed: &[u8], scales: &[u8], cols: usize, x: &[f32], t: usize, out: &mut RowsOut<'_>) {
    if t == 1 {
        single_token(packed, scales, cols, x, out);
    } else {
        tiled::multi_token(&Source::Mxfp4 { packed, scales }, cols, x, t, out);
    }
}

#[target_feature(enable = "avx2,fma")]
fn single_token(packed: &[u8], scales: &[u8], cols: usize, x: &[f32], out: &mut RowsOut<'_>) {
    const R: usize = 2;
    let rows = out.rows();
    let (pb, groups) = (cols / 2, cols / GROUP);
    let (x_chunks, _) = x.as_chunks::<LANES>();
    let mut r = 0;
    while r + R <= rows {
        let sums = rows_dot::<R>(&packed[r * pb..(r + R) * pb], &scales[r * groups..(r + R) * groups], cols, x_chunks);
        for (i, s) in sums.into_iter().enumerate() {
            out.set(0, r + i, s);
        }
        r += R;
    }
    while r < rows {
        let [s] = rows_dot::<1>(&packed[r * pb..(r + 1) * pb], &scales[r * groups..(r + 1) * groups], cols, x_chunks);
        out.set(0, r, s);
        r += 1;
    }
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
        let (xl0, xh0) = load16(&x_chunks[2 * g]);
        let (xl1, xh1) = load16(&x_chunks[2 * g + 1]);
        for i in 0..R {
            let [w0, w1, w2, w3] = decode32(&rows[i][g], group_table(srows[i][g]));
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
        let [w0, w1, w2, w3] = decode32(group, group_table(scale));
        store16(&mut dst[2 * k], w0, w1);
        store16(&mut dst[2 * k + 1], w2, w3);
    }
}
