//! AVX-512 helpers for the canonical lanes: all 16 lanes live in one zmm register. The tree's
//! first step (w = 8) adds the register's two 256-bit halves, which are exactly AVX2's
//! (lanes 0-7, lanes 8-15) pair, so the rest of the tree is [`super::avx2::reduce16`].

use std::arch::x86_64::{
    __m512, _mm256_castpd_ps, _mm512_castps512_ps256, _mm512_castps_pd, _mm512_extractf64x4_pd, _mm512_loadu_ps,
    _mm_prefetch, _MM_HINT_T0, _MM_HINT_T1,
};

use super::avx2::reduce16;
use super::scalar::LANES;

/// Loads 16 floats as one register, lane `l` = float `l`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn load16z(chunk: &[f32; LANES]) -> __m512 {
    // SAFETY: `chunk` holds 16 floats; the load is unaligned.
    unsafe { _mm512_loadu_ps(chunk.as_ptr()) }
}

/// The canonical tree over the 16 lanes of `v`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn reduce16z(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    reduce16(lo, hi)
}

/// Hints the cache to fetch the line holding `p` into L1; any address is fine (a prefetch never
/// faults and reads nothing architecturally). Shared by the AVX-512 matmuls.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn prefetch(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T0>(p.cast());
}

/// Like [`prefetch`], into L2 only.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn prefetch_l2(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T1>(p.cast());
}
