//! AVX2+FMA MXFP4 one-token product in 128-bit operations, for cores that execute every 256-bit
//! operation as two 128-bit halves (AMD Zen 1 and Zen+, Hygon Dhyana: [`Avx2Mxfp4::Xmm`]).
//! Same bits as `scalar.rs`.
//!
//! There, a 256-bit decoder ([`super::avx2`]) spends half its work on lanes it only broadcasts
//! (and its canonical one on picking bytes into canonical order). This one decodes a group of 32 elements from its 16 bytes as
//! they lie: the low nibbles are the even elements, the high nibbles the odd ones; the scale's
//! byte tables ([`SCALED_BYTES`]) give each value's top two bytes, and interleaving those makes,
//! per chunk of 16 columns, four vectors of canonical lanes `{k, k+4, k+8, k+12}` (k = 0 for
//! elements 0, 4, 8, 12; k = 2 for 2, 6, 10, 14; k = 1 and 3 from the high nibbles). A row keeps
//! one accumulator per `k`, `x` is put in the same order once per block of rows, and a row's
//! four accumulators are transposed back to canonical lanes before the fixed tree. Every lane
//! still sums its columns from zero in increasing order with FMA, so the bits are the
//! canonical dot's. 19 operations per 32 weights (the 256-bit canonical decoder: 12, the one
//! that decodes as the bytes lie: 10, each of which costs two on such a core) plus 8 FMAs;
//! measured 1.2-1.3x the 256-bit canonical kernel on a Zen 1 EPYC (`docs/BENCHMARKS.md`; the
//! 10-operation decode bought nothing there).
//!
//! [`Avx2Mxfp4::Xmm`]: crate::mxfp4::Avx2Mxfp4::Xmm

use std::arch::x86_64::{
    __m128, __m128i, _mm256_set_m128, _mm_and_si128, _mm_castsi128_ps, _mm_fmadd_ps, _mm_loadu_ps, _mm_loadu_si128,
    _mm_movehl_ps, _mm_movelh_ps, _mm_set1_epi32, _mm_set1_epi8, _mm_setzero_ps, _mm_shuffle_epi8, _mm_slli_epi32,
    _mm_srli_epi16, _mm_unpackhi_epi8, _mm_unpackhi_ps, _mm_unpacklo_epi8, _mm_unpacklo_ps,
};

use super::avx2::{prefetch, GROUP_BYTES, SCALED_BYTES};
use super::GROUP;
use crate::dot::avx2::reduce16;
use crate::dot::scalar::LANES;
use crate::out::RowsOut;

/// `y = W x` for `t` tokens: one token here when `x` fits the stack copy of [`single_token`]
/// (`cols <= 16 * 512`, every K3 expert product), anything else through the 256-bit kernel.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn matmul(packed: &[u8], scales: &[u8], cols: usize, x: &[f32], t: usize, out: &mut RowsOut<'_>) {
    match (t, cols / LANES) {
        (1, ..=64) => single_token::<64>(packed, scales, cols, x, out),
        (1, ..=128) => single_token::<128>(packed, scales, cols, x, out),
        (1, ..=256) => single_token::<256>(packed, scales, cols, x, out),
        (1, ..=512) => single_token::<512>(packed, scales, cols, x, out),
        _ => super::avx2::matmul(packed, scales, cols, x, t, out),
    }
}

/// One token, at most `N` chunks of 16 columns (the stack copy of `x` in transposed lanes is
/// sized by the caller's bucket, so a small product does not clear a large copy).
#[target_feature(enable = "avx2,fma")]
fn single_token<const N: usize>(packed: &[u8], scales: &[u8], cols: usize, x: &[f32], out: &mut RowsOut<'_>) {
    let (pb, groups) = (cols / 2, cols / GROUP);
    let (x_chunks, _) = x.as_chunks::<LANES>();
    let mut xt = [[0.0f32; LANES]; N];
    for (t, c) in xt.iter_mut().zip(x_chunks) {
        // Position 4k + m holds canonical lane k + 4m.
        *t = std::array::from_fn(|i| c[i / 4 + 4 * (i % 4)]);
    }
    let xt = &xt[..x_chunks.len()];
    let row = |r: usize| [row_dot(&packed[r * pb..][..pb], &scales[r * groups..][..groups], xt)];
    out.fill_token0_by_blocks(row, row);
}

/// The canonical dot of one row with `xt` (one token's chunks in transposed lanes).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn row_dot(packed_row: &[u8], scale_row: &[u8], xt: &[[f32; LANES]]) -> f32 {
    let (row, _) = packed_row.as_chunks::<GROUP_BYTES>();
    let mut acc = [_mm_setzero_ps(); 4];
    for (g, (bytes, &scale)) in row.iter().zip(scale_row).enumerate() {
        if g % 4 == 0 {
            // The next row follows this one: request its line at this group's offset now (a
            // line is 4 groups), as the 256-bit kernel does.
            prefetch(packed_row.as_ptr().wrapping_add(packed_row.len() + g * GROUP_BYTES));
        }
        let w = decode32(bytes, scale);
        for (c, chunk) in xt[2 * g..2 * g + 2].iter().enumerate() {
            for k in 0..4 {
                // SAFETY: a chunk holds 16 floats; an unaligned load of floats 4k..4k + 4.
                let xk = unsafe { _mm_loadu_ps(chunk.as_ptr().add(4 * k)) };
                acc[k] = _mm_fmadd_ps(w[4 * c + k], xk, acc[k]);
            }
        }
    }
    let [l0, l1, l2, l3] = transpose4(acc);
    reduce16(_mm256_set_m128(l1, l0), _mm256_set_m128(l3, l2))
}

/// Decodes one group into `[chunk 0: k = 0, 1, 2, 3, chunk 1: k = 0, 1, 2, 3]`, vector `k`
/// holding the chunk's canonical lanes `k, k+4, k+8, k+12`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn decode32(b: &[u8; GROUP_BYTES], scale: u8) -> [__m128; 8] {
    // SAFETY: `b` holds 16 bytes; the load is unaligned.
    let v = unsafe { _mm_loadu_si128(b.as_ptr().cast()) };
    let low4 = _mm_set1_epi8(0x0F);
    // Byte j: element 2j (low nibble, spec §4) and element 2j + 1 (high nibble).
    let even = _mm_and_si128(v, low4);
    let odd = _mm_and_si128(_mm_srli_epi16::<4>(v), low4);
    let (t2, t3) = SCALED_BYTES[usize::from(scale)].0.split_at(16);
    // SAFETY: each half holds 16 bytes; the loads are unaligned.
    let (t2, t3): (__m128i, __m128i) =
        unsafe { (_mm_loadu_si128(t2.as_ptr().cast()), _mm_loadu_si128(t3.as_ptr().cast())) };
    let top = _mm_set1_epi32(0xFFFF_0000_u32 as i32);
    // Dword d of `w` holds the top halves of two values as words [a, b]: `<< 16` makes a,
    // `& 0xFFFF_0000` makes b.
    let split = |w: __m128i| (_mm_castsi128_ps(_mm_slli_epi32::<16>(w)), _mm_castsi128_ps(_mm_and_si128(w, top)));
    let (e2, e3) = (_mm_shuffle_epi8(t2, even), _mm_shuffle_epi8(t3, even));
    let (o2, o3) = (_mm_shuffle_epi8(t2, odd), _mm_shuffle_epi8(t3, odd));
    // Even elements 0..16 as words: 0, 2, 4, ..., 14; dwords [0, 2], [4, 6], [8, 10], [12, 14].
    let (a0, a2) = split(_mm_unpacklo_epi8(e2, e3));
    let (b0, b2) = split(_mm_unpackhi_epi8(e2, e3));
    let (a1, a3) = split(_mm_unpacklo_epi8(o2, o3));
    let (b1, b3) = split(_mm_unpackhi_epi8(o2, o3));
    [a0, a1, a2, a3, b0, b1, b2, b3]
}

/// 4x4 transpose: vector `m` of the result holds element `m` of each input, in input order.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn transpose4(r: [__m128; 4]) -> [__m128; 4] {
    let t0 = _mm_unpacklo_ps(r[0], r[1]);
    let t1 = _mm_unpacklo_ps(r[2], r[3]);
    let t2 = _mm_unpackhi_ps(r[0], r[1]);
    let t3 = _mm_unpackhi_ps(r[2], r[3]);
    [_mm_movelh_ps(t0, t1), _mm_movehl_ps(t1, t0), _mm_movelh_ps(t2, t3), _mm_movehl_ps(t3, t2)]
}
