//! Scalar softmax: the definition (module docs).

use crate::dot::scalar::{pad16, Lanes, LANES};
use crate::math::scalar::exp;

/// The largest element plus 0.0, or `None` if any element is NaN. `x` is not empty.
pub(crate) fn max_or_nan(x: &[f32]) -> Option<f32> {
    let mut m = f32::NEG_INFINITY;
    for &v in x {
        if v.is_nan() {
            return None;
        }
        if v > m {
            m = v;
        }
    }
    Some(m + 0.0)
}

pub(crate) fn softmax(x: &mut [f32]) {
    if x.is_empty() {
        return;
    }
    let Some(m) = max_or_nan(x) else {
        x.fill(f32::NAN);
        return;
    };
    let mut acc = Lanes::ZERO;
    let (chunks, tail) = x.as_chunks_mut::<LANES>();
    for c in chunks {
        for v in c.iter_mut() {
            *v = exp(*v - m);
        }
        acc.add(c);
    }
    if !tail.is_empty() {
        for v in tail.iter_mut() {
            *v = exp(*v - m);
        }
        acc.add(&pad16(tail));
    }
    let s = acc.reduce();
    for v in x.iter_mut() {
        *v /= s;
    }
}
