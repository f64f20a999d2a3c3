//! AVX2+FMA vector kernels; elementwise, so tails use the scalar code (same operations).

use std::arch::x86_64::{_mm256_fmadd_ps, _mm256_mul_ps, _mm256_set1_ps};

use crate::bf16::avx2::bf16x16;
use crate::dot::avx2::{load16, store16};
use crate::dot::scalar::LANES;

#[target_feature(enable = "avx2,fma")]
pub(crate) fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    let av = _mm256_set1_ps(a);
    let (x_chunks, x_tail) = x.as_chunks::<LANES>();
    let (y_chunks, y_tail) = y.as_chunks_mut::<LANES>();
    for (yc, xc) in y_chunks.iter_mut().zip(x_chunks) {
        let (xl, xh) = load16(xc);
        let (yl, yh) = load16(yc);
        store16(yc, _mm256_fmadd_ps(av, xl, yl), _mm256_fmadd_ps(av, xh, yh));
    }
    super::scalar::axpy(a, x_tail, y_tail);
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn scale(a: f32, x: &mut [f32]) {
    let av = _mm256_set1_ps(a);
    let (chunks, tail) = x.as_chunks_mut::<LANES>();
    for c in chunks {
        let (lo, hi) = load16(c);
        store16(c, _mm256_mul_ps(lo, av), _mm256_mul_ps(hi, av));
    }
    super::scalar::scale(a, tail);
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn norm_f32(x: &[f32], inv: f32, w: &[f32], out: &mut [f32]) {
    let iv = _mm256_set1_ps(inv);
    let (x_chunks, x_tail) = x.as_chunks::<LANES>();
    let (w_chunks, w_tail) = w.as_chunks::<LANES>();
    let (o_chunks, o_tail) = out.as_chunks_mut::<LANES>();
    for ((o, xc), wc) in o_chunks.iter_mut().zip(x_chunks).zip(w_chunks) {
        let (xl, xh) = load16(xc);
        let (wl, wh) = load16(wc);
        store16(o, _mm256_mul_ps(_mm256_mul_ps(xl, iv), wl), _mm256_mul_ps(_mm256_mul_ps(xh, iv), wh));
    }
    super::scalar::norm_f32(x_tail, inv, w_tail, o_tail);
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn norm_bf16(x: &[f32], inv: f32, w: &[u8], out: &mut [f32]) {
    let iv = _mm256_set1_ps(inv);
    let (x_chunks, x_tail) = x.as_chunks::<LANES>();
    let (w_chunks, w_tail) = w.as_chunks::<{ 2 * LANES }>();
    let (o_chunks, o_tail) = out.as_chunks_mut::<LANES>();
    for ((o, xc), wc) in o_chunks.iter_mut().zip(x_chunks).zip(w_chunks) {
        let (xl, xh) = load16(xc);
        let (wl, wh) = bf16x16(wc);
        store16(o, _mm256_mul_ps(_mm256_mul_ps(xl, iv), wl), _mm256_mul_ps(_mm256_mul_ps(xh, iv), wh));
    }
    super::scalar::norm_bf16(x_tail, inv, w_tail, o_tail);
}
