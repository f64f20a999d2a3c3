//! AVX2+FMA transcendental functions: the same operation sequence as `scalar.rs`, per lane.
//! Branches become both-sides-then-blend; NaN inputs are restored at the end with a blend, as
//! the scalar early return does. Tails are zero-padded to 8 lanes and run through the same code.

use std::arch::x86_64::{
    __m256, __m256i, _mm256_add_epi32, _mm256_add_ps, _mm256_and_ps, _mm256_blendv_ps, _mm256_castsi256_ps,
    _mm256_cmp_ps, _mm256_cvtps_epi32, _mm256_div_ps, _mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_loadu_ps,
    _mm256_max_ps, _mm256_min_ps, _mm256_mul_ps, _mm256_or_ps, _mm256_round_ps, _mm256_set1_epi32, _mm256_set1_ps,
    _mm256_slli_epi32, _mm256_srai_epi32, _mm256_storeu_ps, _mm256_sub_epi32, _mm256_sub_ps, _mm256_xor_ps, _CMP_LT_OQ,
    _CMP_UNORD_Q, _MM_FROUND_NO_EXC, _MM_FROUND_TO_NEAREST_INT,
};

use super::scalar::{EXP_P, EXP_X_MAX, EXP_X_MIN, LN2_HI, LN2_LO, LOG2E, SIGN_BIT, TANH_P, TANH_SMALL};

/// 2^k per lane for k in [-126, 127].
#[inline]
#[target_feature(enable = "avx2,fma")]
fn pow2i(k: __m256i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(k, _mm256_set1_epi32(127))))
}

/// Lanes of `x` that are NaN replace the lanes of `y`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn keep_nan(x: __m256, y: __m256) -> __m256 {
    _mm256_blendv_ps(y, x, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x))
}

#[inline]
#[target_feature(enable = "avx2,fma")]
fn sign_mask() -> __m256 {
    _mm256_castsi256_ps(_mm256_set1_epi32(SIGN_BIT as i32))
}

/// e^x per lane; see `scalar::exp`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn exp8(x: __m256) -> __m256 {
    let xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_X_MIN)), _mm256_set1_ps(EXP_X_MAX));
    let n =
        _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(xc, _mm256_set1_ps(LOG2E)));
    // fnmadd(n, c, x) = -(n * c) + x with one rounding, which is fma(-n, c, x).
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), xc);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    let mut p = _mm256_set1_ps(EXP_P[0]);
    for c in &EXP_P[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
    }
    let y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0));
    let k = _mm256_cvtps_epi32(n);
    let k_lo = _mm256_srai_epi32::<1>(k);
    let k_hi = _mm256_sub_epi32(k, k_lo);
    let e = _mm256_mul_ps(_mm256_mul_ps(y, pow2i(k_lo)), pow2i(k_hi));
    keep_nan(x, e)
}

/// 1 / (1 + e^-x) per lane.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn sigmoid8(x: __m256) -> __m256 {
    let one = _mm256_set1_ps(1.0);
    let e = exp8(_mm256_xor_ps(x, sign_mask()));
    keep_nan(x, _mm256_div_ps(one, _mm256_add_ps(one, e)))
}

/// tanh per lane; see `scalar::tanh`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn tanh8(x: __m256) -> __m256 {
    let sign = sign_mask();
    let a = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(!SIGN_BIT as i32)));
    let z = _mm256_mul_ps(a, a);
    let mut p = _mm256_set1_ps(TANH_P[0]);
    for c in &TANH_P[1..] {
        p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(*c));
    }
    let small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), a, a);
    let one = _mm256_set1_ps(1.0);
    let e = exp8(_mm256_add_ps(a, a));
    let large = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0), _mm256_add_ps(e, one)));
    let is_small = _mm256_cmp_ps::<_CMP_LT_OQ>(a, _mm256_set1_ps(TANH_SMALL));
    let y = _mm256_blendv_ps(large, small, is_small);
    keep_nan(x, _mm256_or_ps(y, _mm256_and_ps(x, sign)))
}

/// x * sigmoid(x) per lane.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn silu8(x: __m256) -> __m256 {
    keep_nan(x, _mm256_mul_ps(x, sigmoid8(x)))
}

/// Applies the per-lane function `$f` to the slice `$x` 8 lanes at a time; the tail is
/// zero-padded through the same `$f`. A macro because `#[target_feature]` fns are not `Fn`.
macro_rules! map8 {
    ($x:expr, $f:ident) => {{
        let (chunks, tail) = $x.as_chunks_mut::<8>();
        for c in chunks {
            let v = $f(load8(c));
            store8(c, v);
        }
        if !tail.is_empty() {
            let mut padded = [0.0f32; 8];
            padded[..tail.len()].copy_from_slice(tail);
            let v = $f(load8(&padded));
            store8(&mut padded, v);
            tail.copy_from_slice(&padded[..tail.len()]);
        }
    }};
}

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn load8(c: &[f32; 8]) -> __m256 {
    // SAFETY: `c` holds 8 floats; the load is unaligned.
    unsafe { _mm256_loadu_ps(c.as_ptr()) }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn store8(c: &mut [f32; 8], v: __m256) {
    // SAFETY: `c` holds 8 floats; the store is unaligned.
    unsafe { _mm256_storeu_ps(c.as_mut_ptr(), v) }
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn exp_slice(x: &mut [f32]) {
    map8!(x, exp8);
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn sigmoid_slice(x: &mut [f32]) {
    map8!(x, sigmoid8);
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn silu_slice(x: &mut [f32]) {
    map8!(x, silu8);
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn tanh_slice(x: &mut [f32]) {
    map8!(x, tanh8);
}

/// One SiTU-GLU vector; see `scalar::situ_glu` for the order.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn situ8(a: __m256, b: __m256, b1: f32, b2: Option<f32>) -> __m256 {
    let b1v = _mm256_set1_ps(b1);
    let gate = _mm256_mul_ps(_mm256_mul_ps(b1v, tanh8(_mm256_div_ps(a, b1v))), sigmoid8(a));
    let up = match b2 {
        Some(b2) => {
            let b2v = _mm256_set1_ps(b2);
            _mm256_mul_ps(b2v, tanh8(_mm256_div_ps(b, b2v)))
        }
        None => b,
    };
    _mm256_mul_ps(gate, up)
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn situ_glu_slice(a: &[f32], b: &[f32], b1: f32, b2: Option<f32>, out: &mut [f32]) {
    let (a_chunks, a_tail) = a.as_chunks::<8>();
    let (b_chunks, b_tail) = b.as_chunks::<8>();
    let (o_chunks, o_tail) = out.as_chunks_mut::<8>();
    for ((o, ac), bc) in o_chunks.iter_mut().zip(a_chunks).zip(b_chunks) {
        store8(o, situ8(load8(ac), load8(bc), b1, b2));
    }
    if !a_tail.is_empty() {
        let (mut ap, mut bp, mut op) = ([0.0f32; 8], [0.0f32; 8], [0.0f32; 8]);
        ap[..a_tail.len()].copy_from_slice(a_tail);
        bp[..b_tail.len()].copy_from_slice(b_tail);
        store8(&mut op, situ8(load8(&ap), load8(&bp), b1, b2));
        o_tail.copy_from_slice(&op[..o_tail.len()]);
    }
}
