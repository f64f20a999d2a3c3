//! Elementwise vector kernels and RMSNorm (spec §5).
//!
//! * `axpy`: `y[i] = fma(a, x[i], y[i])`.
//! * `scale`: `x[i] = x[i] * a`.
//! * `rmsnorm`: `ss = canonical_dot(x, x)` (the `dot` kernels), `ms = ss / (n as f32)`,
//!   `inv = 1.0 / (ms + eps).sqrt()` (IEEE division and correctly rounded sqrt, computed once
//!   in scalar code for every ISA), then `out[i] = (x[i] * inv) * w[i]`: two roundings, no FMA.
//!   The bf16-weight variant decodes `w[i]` exactly first.
//!
//! No reductions except the one canonical dot, so SIMD equals scalar bit for bit.
//! Single-threaded.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
pub(crate) mod scalar;

use crate::isa::Isa;

/// `(a, x, y)`.
pub(crate) type AxpyFn = unsafe fn(f32, &[f32], &mut [f32]);
/// `(a, x)`.
pub(crate) type ScaleFn = unsafe fn(f32, &mut [f32]);
/// `(x, inv, w f32, out)`.
pub(crate) type NormF32Fn = unsafe fn(&[f32], f32, &[f32], &mut [f32]);
/// `(x, inv, w bf16 bytes, out)`.
pub(crate) type NormBf16Fn = unsafe fn(&[f32], f32, &[u8], &mut [f32]);

/// The vector kernels of one ISA.
#[derive(Clone, Copy)]
pub(crate) struct Fns {
    axpy: AxpyFn,
    scale: ScaleFn,
    norm_f32: NormF32Fn,
    norm_bf16: NormBf16Fn,
}

/// `1 / sqrt(ss / n + eps)` in f32, the RMSNorm factor.
pub(crate) fn rms_inv(ss: f32, n: usize, eps: f32) -> f32 {
    let ms = ss / (n as f32);
    1.0 / (ms + eps).sqrt()
}

impl Fns {
    /// # Safety
    /// `isa` must be available on this host ([`Isa::is_available`]).
    pub(crate) unsafe fn for_isa(isa: Isa) -> Fns {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => {
                Fns { axpy: avx2::axpy, scale: avx2::scale, norm_f32: avx2::norm_f32, norm_bf16: avx2::norm_bf16 }
            }
            _ => Fns {
                axpy: scalar::axpy,
                scale: scalar::scale,
                norm_f32: scalar::norm_f32,
                norm_bf16: scalar::norm_bf16,
            },
        }
    }

    pub(crate) fn axpy(&self, a: f32, x: &[f32], y: &mut [f32]) {
        assert_eq!(x.len(), y.len(), "axpy: x and y differ in length");
        // SAFETY: `self` was built by `for_isa`, whose caller guaranteed the ISA's features.
        unsafe { (self.axpy)(a, x, y) }
    }

    pub(crate) fn scale(&self, a: f32, x: &mut [f32]) {
        // SAFETY: `self` was built by `for_isa`, whose caller guaranteed the ISA's features.
        unsafe { (self.scale)(a, x) }
    }

    pub(crate) fn rmsnorm(&self, ss: f32, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        assert!(!x.is_empty(), "rmsnorm: x is empty");
        assert_eq!(w.len(), x.len(), "rmsnorm: w and x differ in length");
        assert_eq!(out.len(), x.len(), "rmsnorm: out and x differ in length");
        let inv = rms_inv(ss, x.len(), eps);
        // SAFETY: `self` was built by `for_isa`, whose caller guaranteed the ISA's features.
        unsafe { (self.norm_f32)(x, inv, w, out) }
    }

    pub(crate) fn rmsnorm_bf16w(&self, ss: f32, x: &[f32], w: &[u8], eps: f32, out: &mut [f32]) {
        assert!(!x.is_empty(), "rmsnorm_bf16w: x is empty");
        assert_eq!(w.len(), 2 * x.len(), "rmsnorm_bf16w: w must hold 2 bytes per element of x");
        assert_eq!(out.len(), x.len(), "rmsnorm_bf16w: out and x differ in length");
        let inv = rms_inv(ss, x.len(), eps);
        // SAFETY: `self` was built by `for_isa`, whose caller guaranteed the ISA's features.
        unsafe { (self.norm_bf16)(x, inv, w, out) }
    }
}
