//! AVX2+FMA softmax; same steps and bits as `scalar.rs`.

use std::arch::x86_64::{
    _mm256_add_ps, _mm256_castps256_ps128, _mm256_cmp_ps, _mm256_div_ps, _mm256_extractf128_ps, _mm256_max_ps,
    _mm256_movemask_ps, _mm256_or_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_sub_ps, _mm_cvtss_f32, _mm_max_ps,
    _mm_max_ss, _mm_movehl_ps, _mm_shuffle_ps, _CMP_UNORD_Q,
};

use crate::dot::avx2::{load16, reduce16, store16};
use crate::dot::scalar::{pad16, LANES};
use crate::math::avx2::exp8;

/// The largest element plus 0.0, or `None` if any element is NaN. `x` is not empty.
#[target_feature(enable = "avx2,fma")]
fn max_or_nan(x: &[f32]) -> Option<f32> {
    let (chunks, tail) = x.as_chunks::<LANES>();
    let mut padded = [f32::NEG_INFINITY; LANES];
    padded[..tail.len()].copy_from_slice(tail);
    let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut nan = _mm256_setzero_ps();
    for c in chunks.iter().chain(std::iter::once(&padded)) {
        let (lo, hi) = load16(c);
        // Unordered compare: a lane is set when lo or hi holds a NaN there.
        nan = _mm256_or_ps(nan, _mm256_cmp_ps::<_CMP_UNORD_Q>(lo, hi));
        m = _mm256_max_ps(m, _mm256_max_ps(lo, hi));
    }
    if _mm256_movemask_ps(nan) != 0 {
        return None;
    }
    // max is exact and order-free on non-NaN values (up to the sign of zero, fixed by + 0.0).
    let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let m1 = _mm_max_ss(m2, _mm_shuffle_ps::<0b01>(m2, m2));
    Some(_mm_cvtss_f32(m1) + 0.0)
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn softmax(x: &mut [f32]) {
    if x.is_empty() {
        return;
    }
    let Some(m) = max_or_nan(x) else {
        x.fill(f32::NAN);
        return;
    };
    let mv = _mm256_set1_ps(m);
    let (mut s_lo, mut s_hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let (chunks, tail) = x.as_chunks_mut::<LANES>();
    for c in chunks.iter_mut() {
        let (lo, hi) = load16(c);
        let (e_lo, e_hi) = (exp8(_mm256_sub_ps(lo, mv)), exp8(_mm256_sub_ps(hi, mv)));
        store16(c, e_lo, e_hi);
        s_lo = _mm256_add_ps(s_lo, e_lo);
        s_hi = _mm256_add_ps(s_hi, e_hi);
    }
    if !tail.is_empty() {
        let mut padded = pad16(tail);
        let (lo, hi) = load16(&padded);
        store16(&mut padded, exp8(_mm256_sub_ps(lo, mv)), exp8(_mm256_sub_ps(hi, mv)));
        tail.copy_from_slice(&padded[..tail.len()]);
        // Padding lanes must add +0.0, not exp(0 - m).
        let (e_lo, e_hi) = load16(&pad16(tail));
        s_lo = _mm256_add_ps(s_lo, e_lo);
        s_hi = _mm256_add_ps(s_hi, e_hi);
    }
    let s = reduce16(s_lo, s_hi);
    let sv = _mm256_set1_ps(s);
    let (chunks, tail) = x.as_chunks_mut::<LANES>();
    for c in chunks.iter_mut() {
        let (lo, hi) = load16(c);
        store16(c, _mm256_div_ps(lo, sv), _mm256_div_ps(hi, sv));
    }
    for v in tail.iter_mut() {
        *v /= s;
    }
}
