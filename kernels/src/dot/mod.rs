//! The canonical dot product, the one reduction every kernel uses (crate docs, "Canonical dot").
//!
//! Contract: f32 accumulators, 16 lanes starting at +0.0; element `i` goes to lane `i % 16` with
//! `acc = fma(a_i, b_i, acc)` in increasing `i`; the length is zero-padded to a multiple of 16
//! (padding does `fma(0, 0, acc)`, which turns a -0.0 lane into +0.0); then the fixed tree
//! `for w in [8, 4, 2, 1] { acc[l] = acc[l] + acc[l + w] for l < w }`; the result is `acc[0]`.
//! Single-threaded. Spec §5 (every projection, RMSNorm's mean square).

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub(crate) mod scalar;

use crate::isa::Isa;

/// `dot(a, b)`, `a.len() == b.len()`.
pub(crate) type DotFn = unsafe fn(&[f32], &[f32]) -> f32;
/// `dot(x, x)`.
pub(crate) type SumSquaresFn = unsafe fn(&[f32]) -> f32;

/// The dot kernels of one ISA.
#[derive(Clone, Copy)]
pub(crate) struct Fns {
    dot: DotFn,
    sum_squares: SumSquaresFn,
}

impl Fns {
    /// # Safety
    /// `isa` must be available on this host ([`Isa::is_available`]).
    pub(crate) unsafe fn for_isa(isa: Isa) -> Fns {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => Fns { dot: avx2::dot, sum_squares: avx2::sum_squares },
            _ => Fns { dot: scalar::dot, sum_squares: scalar::sum_squares },
        }
    }

    pub(crate) fn dot(&self, a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len(), "dot: operands differ in length");
        // SAFETY: `self` was built by `for_isa`, whose caller guaranteed the ISA's features.
        unsafe { (self.dot)(a, b) }
    }

    pub(crate) fn sum_squares(&self, x: &[f32]) -> f32 {
        // SAFETY: `self` was built by `for_isa`, whose caller guaranteed the ISA's features.
        unsafe { (self.sum_squares)(x) }
    }
}
