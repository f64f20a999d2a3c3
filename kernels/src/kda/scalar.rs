//! Scalar KDA step: the definition, one step of the module docs per loop.

use super::Step;

/// `u` is the caller's scratch, `dv` floats.
pub(crate) fn step(st: &Step<'_>, s: &mut [f32], out: &mut [f32], u: &mut [f32]) {
    let Step { dv, alpha, beta, k, v, q, .. } = *st;
    // 1. Decay each key row.
    for (row, &a) in s.chunks_exact_mut(dv).zip(alpha) {
        for sv in row {
            *sv *= a;
        }
    }
    // 2. kS = S^T k, in u.
    u.fill(0.0);
    for (row, &ki) in s.chunks_exact(dv).zip(k) {
        for (acc, &sv) in u.iter_mut().zip(row) {
            *acc = ki.mul_add(sv, *acc);
        }
    }
    // 3. u = beta * (v - kS).
    for (uc, &vc) in u.iter_mut().zip(v) {
        *uc = beta * (vc - *uc);
    }
    // 4. S += k u^T.
    for (row, &ki) in s.chunks_exact_mut(dv).zip(k) {
        for (sv, &uc) in row.iter_mut().zip(u.iter()) {
            *sv = ki.mul_add(uc, *sv);
        }
    }
    // 5. o = S^T q.
    out.fill(0.0);
    for (row, &qi) in s.chunks_exact(dv).zip(q) {
        for (acc, &sv) in out.iter_mut().zip(row) {
            *acc = qi.mul_add(sv, *acc);
        }
    }
}
