//! AVX2+FMA canonical dot. Lanes 0-7 live in one ymm register and lanes 8-15 in another; the
//! tree's first step adds the two registers, the second adds the two 128-bit halves, then
//! `movehl` and a final scalar add (see [`reduce16`]).

use std::arch::x86_64::{
    __m256, _mm256_add_ps, _mm256_castps256_ps128, _mm256_extractf128_ps, _mm256_fmadd_ps, _mm256_loadu_ps,
    _mm256_setzero_ps, _mm256_storeu_ps, _mm_add_ps, _mm_add_ss, _mm_cvtss_f32, _mm_movehl_ps, _mm_shuffle_ps,
};

use super::scalar::{pad16, LANES};

/// Loads 16 floats as (lanes 0-7, lanes 8-15).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn load16(chunk: &[f32; LANES]) -> (__m256, __m256) {
    let p = chunk.as_ptr();
    // SAFETY: `chunk` holds 16 floats; the two unaligned loads read floats 0..8 and 8..16.
    unsafe { (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) }
}

/// Stores (lanes 0-7, lanes 8-15) into 16 floats.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn store16(chunk: &mut [f32; LANES], lo: __m256, hi: __m256) {
    let p = chunk.as_mut_ptr();
    // SAFETY: `chunk` holds 16 floats; the two unaligned stores write floats 0..8 and 8..16.
    unsafe {
        _mm256_storeu_ps(p, lo);
        _mm256_storeu_ps(p.add(8), hi);
    }
}

/// The canonical tree over 16 lanes held as (lanes 0-7, lanes 8-15).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn reduce16(lo: __m256, hi: __m256) -> f32 {
    // w = 8: acc[l] + acc[l + 8], l in 0..8.
    let v8 = _mm256_add_ps(lo, hi);
    // w = 4: acc[l] + acc[l + 4], l in 0..4.
    let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
    // w = 2: acc[l] + acc[l + 2], l in 0..2.
    let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    // w = 1: acc[0] + acc[1].
    let v1 = _mm_add_ss(v2, _mm_shuffle_ps::<0b01>(v2, v2));
    _mm_cvtss_f32(v1)
}

/// Canonical `dot(a, b)`; `a.len() == b.len()` (checked by the caller).
#[target_feature(enable = "avx2,fma")]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let (a_chunks, a_tail) = a.as_chunks::<LANES>();
    let (b_chunks, b_tail) = b.as_chunks::<LANES>();
    let mut lo = _mm256_setzero_ps();
    let mut hi = _mm256_setzero_ps();
    for (ac, bc) in a_chunks.iter().zip(b_chunks) {
        let (al, ah) = load16(ac);
        let (bl, bh) = load16(bc);
        lo = _mm256_fmadd_ps(al, bl, lo);
        hi = _mm256_fmadd_ps(ah, bh, hi);
    }
    if !a_tail.is_empty() {
        let (al, ah) = load16(&pad16(a_tail));
        let (bl, bh) = load16(&pad16(b_tail));
        lo = _mm256_fmadd_ps(al, bl, lo);
        hi = _mm256_fmadd_ps(ah, bh, hi);
    }
    reduce16(lo, hi)
}

/// Canonical `dot(x, x)`, loading `x` once.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn sum_squares(x: &[f32]) -> f32 {
    let (chunks, tail) = x.as_chunks::<LANES>();
    let mut lo = _mm256_setzero_ps();
    let mut hi = _mm256_setzero_ps();
    for c in chunks {
        let (xl, xh) = load16(c);
        lo = _mm256_fmadd_ps(xl, xl, lo);
        hi = _mm256_fmadd_ps(xh, xh, hi);
    }
    if !tail.is_empty() {
        let (xl, xh) = load16(&pad16(tail));
        lo = _mm256_fmadd_ps(xl, xl, lo);
        hi = _mm256_fmadd_ps(xh, xh, hi);
    }
    reduce16(lo, hi)
}
