//! Elementwise transcendental functions (spec §5: SiLU in the KDA short conv, sigmoid gates and
//! router, SiTU-GLU in every FFN, exp in the KDA decay and softmax).
//!
//! There is no libm here: `exp` is our own, and every other function is built from it with IEEE
//! `+ - * /` only, so the scalar and AVX2 versions execute the same operation sequence per
//! element and give identical bits. The scalar functions in this module are the definitions and
//! are public for the model's one-off scalars (e.g. `exp(A_log[h])`).
//!
//! * `exp(x)`: NaN in -> the same NaN out. Otherwise `x` is clamped to [-104, 89] (exp(-104) is
//!   below half the smallest subnormal, exp(89) above `f32::MAX`, so the clamp changes nothing
//!   but keeps the exponent arithmetic in range); `n = round_ties_even(x * log2(e))`;
//!   `r = fma(-n, LN2_HI, x)`, `r = fma(-n, LN2_LO, r)` (Cody-Waite, LN2_HI has 9 bits so the
//!   first step is exact); Cephes `expf` polynomial in Horner form with FMA,
//!   `p = fma(p, r, c)` for c = P1..P5, `y = fma(p, r * r, r) + 1`; then
//!   `(y * 2^(n >> 1)) * 2^(n - (n >> 1))`, two exact-power multiplications so results that
//!   underflow to subnormals are rounded once (gradual underflow) and `n = 128` overflows to
//!   +inf correctly. Accuracy (tests/accuracy.rs, against f64 `exp`): below 1 ulp (measured
//!   0.996) on [-87.3, 88.7], where the result is normal; subnormal results within one
//!   subnormal step; -inf -> +0, +inf -> +inf.
//! * `sigmoid(x) = 1 / (1 + exp(-x))`: NaN passes through. Within 1e-7 absolute everywhere
//!   (measured 8.9e-8) and 2.5 ulp relative for x <= 0 (measured 2.38); sigmoid(-inf) = 0,
//!   sigmoid(+inf) = 1.
//! * `tanh(x)`: NaN passes through; on `a = |x|`: for `a < 0.625` the Cephes odd polynomial
//!   `fma(p(a*a) * (a*a), a, a)`, otherwise `1 - 2 / (exp(a + a) + 1)`; the sign of `x` is then
//!   or-ed in (so tanh(-0) = -0). Within 1 ulp for |x| < 0.625 (measured 0.68), 1.5 ulp above
//!   (measured 1.26), 1e-7 absolute.
//! * `silu(x) = x * sigmoid(x)`: NaN passes through; within 3 ulp (measured 2.85) where the
//!   result is normal. silu(-inf) = -inf * 0 = NaN (documented, not special-cased: an infinite
//!   activation is already a bug upstream).
//! * `situ_glu(a, b) = ((b1 * tanh(a / b1)) * sigmoid(a)) * (b2 * tanh(b / b2))`, in exactly
//!   this order, with IEEE division by `b1`/`b2` (not multiplication by a reciprocal); the up
//!   factor is plain `b` when `b2` is `None`. NaN inputs give NaN (payload unspecified).
//!
//! All are single-threaded, elementwise (no reduction), FMA only where written above.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
pub(crate) mod scalar;

pub use scalar::{exp, sigmoid, silu, situ_glu, tanh};

use crate::isa::Isa;

/// In-place elementwise function.
pub(crate) type UnaryFn = unsafe fn(&mut [f32]);
/// `(a, b, b1, b2, out)`.
pub(crate) type SituGluFn = unsafe fn(&[f32], &[f32], f32, Option<f32>, &mut [f32]);

/// The elementwise kernels of one ISA.
#[derive(Clone, Copy)]
pub(crate) struct Fns {
    pub(crate) exp: UnaryFn,
    pub(crate) sigmoid: UnaryFn,
    pub(crate) silu: UnaryFn,
    pub(crate) tanh: UnaryFn,
    situ_glu: SituGluFn,
}

impl Fns {
    /// # Safety
    /// `isa` must be available on this host ([`Isa::is_available`]).
    pub(crate) unsafe fn for_isa(isa: Isa) -> Fns {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => Fns {
                exp: avx2::exp_slice,
                sigmoid: avx2::sigmoid_slice,
                silu: avx2::silu_slice,
                tanh: avx2::tanh_slice,
                situ_glu: avx2::situ_glu_slice,
            },
            _ => Fns {
                exp: scalar::exp_slice,
                sigmoid: scalar::sigmoid_slice,
                silu: scalar::silu_slice,
                tanh: scalar::tanh_slice,
                situ_glu: scalar::situ_glu_slice,
            },
        }
    }

    /// Runs one of this table's unary kernels.
    pub(crate) fn unary(&self, f: UnaryFn, x: &mut [f32]) {
        // SAFETY: `f` is a field of `self`, built by `for_isa`, whose caller guaranteed the ISA's
        // features.
        unsafe { f(x) }
    }

    pub(crate) fn situ_glu(&self, a: &[f32], b: &[f32], b1: f32, b2: Option<f32>, out: &mut [f32]) {
        assert_eq!(a.len(), b.len(), "situ_glu: a and b differ in length");
        assert_eq!(a.len(), out.len(), "situ_glu: out and a differ in length");
        assert!(b1.is_finite() && b1 > 0.0, "situ_glu: b1 = {b1} must be finite and positive");
        if let Some(b2) = b2 {
            assert!(b2.is_finite() && b2 > 0.0, "situ_glu: b2 = {b2} must be finite and positive");
        }
        // SAFETY: `self` was built by `for_isa`, whose caller guaranteed the ISA's features.
        unsafe { (self.situ_glu)(a, b, b1, b2, out) }
    }
}
