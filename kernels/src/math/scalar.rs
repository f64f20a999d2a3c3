//! Scalar transcendental functions: the definitions (module docs of `math`).

/// Inputs below this give +0 (exp(-104) < 2^-150, half the smallest subnormal).
pub(crate) const EXP_X_MIN: f32 = -104.0;
/// Inputs above this give +inf (exp(89) > f32::MAX).
pub(crate) const EXP_X_MAX: f32 = 89.0;
/// log2(e) rounded to f32.
pub(crate) const LOG2E: f32 = std::f32::consts::LOG2_E;
/// High part of ln 2 (9 significant bits, so `n * LN2_HI` is exact for |n| <= 2^15).
pub(crate) const LN2_HI: f32 = 0.693_359_4;
/// ln 2 - LN2_HI.
pub(crate) const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes `expf` polynomial, highest degree first.
pub(crate) const EXP_P: [f32; 6] = [1.987_569_1e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];
/// Below this |x|, tanh uses the odd polynomial.
pub(crate) const TANH_SMALL: f32 = 0.625;
/// Cephes `tanhf` polynomial in z = x^2, highest degree first.
pub(crate) const TANH_P: [f32; 5] = [-5.704_988_7e-3, 2.063_909e-2, -5.373_971_6e-2, 1.333_144_2e-1, -3.333_328e-1];
/// The f32 sign bit.
pub(crate) const SIGN_BIT: u32 = 0x8000_0000;

/// 2^k for k in [-126, 127], from bits.
#[inline]
fn pow2i(k: i32) -> f32 {
    debug_assert!((-126..=127).contains(&k));
    f32::from_bits(((k + 127) as u32) << 23)
}

/// e^x (module docs of `math`).
#[inline]
pub fn exp(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let x = x.clamp(EXP_X_MIN, EXP_X_MAX);
    let n = (x * LOG2E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = EXP_P[0];
    for c in &EXP_P[1..] {
        p = p.mul_add(r, *c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    // n is an integer in [-151, 129], so the conversion is exact.
    let k = n as i32;
    let k_lo = k >> 1;
    (y * pow2i(k_lo)) * pow2i(k - k_lo)
}

/// 1 / (1 + e^-x).
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    1.0 / (1.0 + exp(-x))
}

/// tanh(x) (module docs of `math`).
#[inline]
pub fn tanh(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let a = x.abs();
    let y = if a < TANH_SMALL {
        let z = a * a;
        let mut p = TANH_P[0];
        for c in &TANH_P[1..] {
            p = p.mul_add(z, *c);
        }
        (p * z).mul_add(a, a)
    } else {
        1.0 - 2.0 / (exp(a + a) + 1.0)
    };
    f32::from_bits(y.to_bits() | (x.to_bits() & SIGN_BIT))
}

/// x * sigmoid(x).
#[inline]
pub fn silu(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    x * sigmoid(x)
}

/// One SiTU-GLU output: `((b1 * tanh(a / b1)) * sigmoid(a)) * up`, with
/// `up = b2 * tanh(b / b2)` or `up = b` when `b2` is `None` (spec §5).
#[inline]
pub fn situ_glu(a: f32, b: f32, b1: f32, b2: Option<f32>) -> f32 {
    let gate = (b1 * tanh(a / b1)) * sigmoid(a);
    let up = match b2 {
        Some(b2) => b2 * tanh(b / b2),
        None => b,
    };
    gate * up
}

pub(crate) fn exp_slice(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = exp(*v));
}

pub(crate) fn sigmoid_slice(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = sigmoid(*v));
}

pub(crate) fn silu_slice(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = silu(*v));
}

pub(crate) fn tanh_slice(x: &mut [f32]) {
    x.iter_mut().for_each(|v| *v = tanh(*v));
}

pub(crate) fn situ_glu_slice(a: &[f32], b: &[f32], b1: f32, b2: Option<f32>, out: &mut [f32]) {
    for ((o, &av), &bv) in out.iter_mut().zip(a).zip(b) {
        *o = situ_glu(av, bv, b1, b2);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_are_what_they_claim() {
        assert_eq!(f64::from(LN2_HI), 0.693_359_375_f64);
        assert_eq!(LN2_HI.to_bits() & 0x7FFF, 0, "LN2_HI needs its low mantissa bits clear");
        let ln2 = f64::from(LN2_HI) + f64::from(LN2_LO);
        assert!((ln2 - std::f64::consts::LN_2).abs() < 1e-11, "{ln2}");
    }

    #[test]
    fn exp_special_values() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        assert_eq!(exp(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp(f32::NEG_INFINITY).to_bits(), 0);
        assert_eq!(exp(89.0), f32::INFINITY);
        assert_eq!(exp(88.8), f32::INFINITY);
        assert!(exp(88.72).is_finite());
        assert_eq!(exp(-200.0).to_bits(), 0);
        assert!(exp(-100.0).is_subnormal());
        let nan = f32::from_bits(0x7FC0_1234);
        assert_eq!(exp(nan).to_bits(), nan.to_bits());
    }

    #[test]
    fn tanh_and_sigmoid_special_values() {
        assert_eq!(tanh(-0.0).to_bits(), (-0.0f32).to_bits());
        assert_eq!(tanh(0.0).to_bits(), 0);
        assert_eq!(tanh(f32::INFINITY), 1.0);
        assert_eq!(tanh(f32::NEG_INFINITY), -1.0);
        assert_eq!(tanh(1e-30), 1e-30);
        assert_eq!(sigmoid(f32::INFINITY), 1.0);
        assert_eq!(sigmoid(f32::NEG_INFINITY), 0.0);
        assert_eq!(sigmoid(0.0), 0.5);
        assert!(silu(f32::NEG_INFINITY).is_nan());
        assert_eq!(silu(-200.0).to_bits(), (-0.0f32).to_bits());
    }
}
