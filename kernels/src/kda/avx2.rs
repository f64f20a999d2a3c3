//! AVX2+FMA KDA step. Columns are processed in blocks of 32 (4 ymm, 4 independent FMA chains)
//! and then 8; a block runs the whole step for its columns: decay+kS over all rows, u, then
//! update+read over all rows. Per element this is exactly the scalar sequence. Columns left
//! over (dv % 8) use the same scalar operations.

use std::arch::x86_64::{
    __m256, _mm256_fmadd_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_set1_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    _mm256_sub_ps,
};

use super::Step;

/// Loads 8 floats at `s[at..at + 8]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn ld(s: &[f32], at: usize) -> __m256 {
    let c = &s[at..at + 8];
    // SAFETY: `c` is a bounds-checked slice of exactly 8 floats; the load is unaligned.
    unsafe { _mm256_loadu_ps(c.as_ptr()) }
}

/// Stores 8 floats at `s[at..at + 8]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn st(s: &mut [f32], at: usize, v: __m256) {
    let c = &mut s[at..at + 8];
    // SAFETY: `c` is a bounds-checked slice of exactly 8 floats; the store is unaligned.
    unsafe { _mm256_storeu_ps(c.as_mut_ptr(), v) }
}

/// The whole step for columns `c0..c0 + 8 * B`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn block<const B: usize>(p: &Step<'_>, s: &mut [f32], out: &mut [f32], u: &mut [f32], c0: usize) {
    let Step { dk, dv, alpha, beta, k, v, q } = *p;
    let mut acc = [_mm256_setzero_ps(); B];
    for i in 0..dk {
        let (a, ki) = (_mm256_set1_ps(alpha[i]), _mm256_set1_ps(k[i]));
        for (j, ks) in acc.iter_mut().enumerate() {
            let at = i * dv + c0 + 8 * j;
            let decayed = _mm256_mul_ps(ld(s, at), a);
            st(s, at, decayed);
            *ks = _mm256_fmadd_ps(ki, decayed, *ks);
        }
    }
    let bv = _mm256_set1_ps(beta);
    let mut uv = [_mm256_setzero_ps(); B];
    for (j, (uj, ks)) in uv.iter_mut().zip(acc).enumerate() {
        *uj = _mm256_mul_ps(bv, _mm256_sub_ps(ld(v, c0 + 8 * j), ks));
        st(u, c0 + 8 * j, *uj);
    }
    let mut o = [_mm256_setzero_ps(); B];
    for i in 0..dk {
        let (ki, qi) = (_mm256_set1_ps(k[i]), _mm256_set1_ps(q[i]));
        for (j, oj) in o.iter_mut().enumerate() {
            let at = i * dv + c0 + 8 * j;
            let updated = _mm256_fmadd_ps(ki, uv[j], ld(s, at));
            st(s, at, updated);
            *oj = _mm256_fmadd_ps(qi, updated, *oj);
        }
    }
    for (j, oj) in o.iter().enumerate() {
        st(out, c0 + 8 * j, *oj);
    }
}

/// The whole step for one column `c` with scalar operations (the tail).
fn column(p: &Step<'_>, s: &mut [f32], out: &mut [f32], u: &mut [f32], c: usize) {
    let Step { dk, dv, alpha, beta, k, v, q } = *p;
    let mut ks = 0.0f32;
    for i in 0..dk {
        let sv = &mut s[i * dv + c];
        *sv *= alpha[i];
        ks = k[i].mul_add(*sv, ks);
    }
    u[c] = beta * (v[c] - ks);
    let mut o = 0.0f32;
    for i in 0..dk {
        let sv = &mut s[i * dv + c];
        *sv = k[i].mul_add(u[c], *sv);
        o = q[i].mul_add(*sv, o);
    }
    out[c] = o;
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn step(p: &Step<'_>, s: &mut [f32], out: &mut [f32], u: &mut [f32]) {
    let dv = p.dv;
    let mut c0 = 0;
    while c0 + 32 <= dv {
        block::<4>(p, s, out, u, c0);
        c0 += 32;
    }
    while c0 + 8 <= dv {
        block::<1>(p, s, out, u, c0);
        c0 += 8;
    }
    for c in c0..dv {
        column(p, s, out, u, c);
    }
}
