//! Softmax in place (spec §5: attention-residual weights, MLA attention scores).
//!
//! 1. NaN-aware max: if any element is NaN the whole output is the canonical quiet NaN
//!    (`f32::NAN`) and nothing else is computed. Otherwise `m` = the largest element, then
//!    `m = m + 0.0` so that a -0.0 maximum becomes +0.0 whichever zero a SIMD `max` kept.
//! 2. `e_i = exp(x_i - m)` with this crate's `exp` (`math` module), stored in place.
//! 3. `s` = canonical 16-lane sum of the `e_i`: `acc[i % 16] += e_i` in increasing `i`, padded
//!    with +0.0, then the fixed tree. This is exactly `canonical_dot(e, ones)`, because
//!    `fma(e, 1, acc)` rounds `e + acc` once, like the add.
//! 4. `x_i = e_i / s` (IEEE division, not multiplication by `1 / s`).
//!
//! Consequences: if any element is +inf the result is all NaN (inf - inf); if every element is
//! -inf (a fully masked row) the result is all NaN too; callers must not pass such rows. An
//! empty slice is left alone. Single-threaded.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
pub(crate) mod scalar;

use crate::isa::Isa;

/// In-place softmax.
pub(crate) type SoftmaxFn = unsafe fn(&mut [f32]);

/// The softmax kernel of one ISA.
#[derive(Clone, Copy)]
pub(crate) struct Fns {
    softmax: SoftmaxFn,
}

impl Fns {
    /// # Safety
    /// `isa` must be available on this host ([`Isa::is_available`]).
    pub(crate) unsafe fn for_isa(isa: Isa) -> Fns {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => Fns { softmax: avx2::softmax },
            _ => Fns { softmax: scalar::softmax },
        }
    }

    pub(crate) fn softmax(&self, x: &mut [f32]) {
        // SAFETY: `self` was built by `for_isa`, whose caller guaranteed the ISA's features.
        unsafe { (self.softmax)(x) }
    }
}
