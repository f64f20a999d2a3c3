//! Scalar vector kernels: the definitions.

use crate::bf16::bf16_at;

pub(crate) fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (yv, &xv) in y.iter_mut().zip(x) {
        *yv = a.mul_add(xv, *yv);
    }
}

pub(crate) fn scale(a: f32, x: &mut [f32]) {
    for v in x {
        *v *= a;
    }
}

pub(crate) fn norm_f32(x: &[f32], inv: f32, w: &[f32], out: &mut [f32]) {
    for ((o, &xv), &wv) in out.iter_mut().zip(x).zip(w) {
        *o = (xv * inv) * wv;
    }
}

pub(crate) fn norm_bf16(x: &[f32], inv: f32, w: &[u8], out: &mut [f32]) {
    for (i, (o, &xv)) in out.iter_mut().zip(x).enumerate() {
        *o = (xv * inv) * bf16_at(w, i);
    }
}
