//! One KDA delta-rule step for one head (spec §5, KDA step 6).
//!
//! State `s` is `[dk, dv]` row-major (row = key dim `i`, column = value dim `c`). In order:
//! 1. decay: `S[i, c] = S[i, c] * alpha[i]`;
//! 2. `kS[c] = sum_i k[i] * S[i, c]`, sequential in increasing `i`, `kS = fma(k[i], S[i, c], kS)`
//!    from +0.0 (reads the decayed state);
//! 3. `u[c] = beta * (v[c] - kS[c])`;
//! 4. update: `S[i, c] = fma(k[i], u[c], S[i, c])`;
//! 5. read: `o[c] = sum_i q[i] * S[i, c]`, sequential in increasing `i` with FMA from +0.0
//!    (reads the updated state).
//!
//! f32 throughout. Every reduction runs over `i` for a fixed `c`, so vectorising across `c` needs
//! no horizontal reduction and SIMD equals scalar bit for bit; the AVX2 version fuses steps 1-2
//! and 4-5 into one sweep each (same per-element operations, same order). Single-threaded: the
//! model splits heads across threads, never a head.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
pub(crate) mod scalar;

use crate::isa::Isa;

/// The operands of one step; `s` and `out`/`scratch` are passed separately as they are written.
#[derive(Clone, Copy)]
pub(crate) struct Step<'a> {
    pub(crate) dk: usize,
    pub(crate) dv: usize,
    pub(crate) alpha: &'a [f32],
    pub(crate) beta: f32,
    pub(crate) k: &'a [f32],
    pub(crate) v: &'a [f32],
    pub(crate) q: &'a [f32],
}

/// `(step, s, out, scratch)`.
pub(crate) type StepFn = unsafe fn(&Step<'_>, &mut [f32], &mut [f32], &mut [f32]);

/// The KDA kernel of one ISA.
#[derive(Clone, Copy)]
pub(crate) struct Fns {
    step: StepFn,
}

impl Fns {
    /// # Safety
    /// `isa` must be available on this host ([`Isa::is_available`]).
    pub(crate) unsafe fn for_isa(isa: Isa) -> Fns {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 | Isa::Avx512 => Fns { step: avx2::step },
            _ => Fns { step: scalar::step },
        }
    }

    pub(crate) fn step(&self, st: &Step<'_>, s: &mut [f32], out: &mut [f32], scratch: &mut [f32]) {
        let Step { dk, dv, alpha, k, v, q, .. } = *st;
        assert_eq!(Some(s.len()), dk.checked_mul(dv), "kda_step: s must hold dk * dv = {dk} * {dv} floats");
        assert_eq!(alpha.len(), dk, "kda_step: alpha must hold dk = {dk} floats");
        assert_eq!(k.len(), dk, "kda_step: k must hold dk = {dk} floats");
        assert_eq!(q.len(), dk, "kda_step: q must hold dk = {dk} floats");
        assert_eq!(v.len(), dv, "kda_step: v must hold dv = {dv} floats");
        assert_eq!(out.len(), dv, "kda_step: out must hold dv = {dv} floats");
        assert!(scratch.len() >= dv, "kda_step: scratch must hold at least dv = {dv} floats");
        // SAFETY: `self` was built by `for_isa`, whose caller guaranteed the ISA's features.
        unsafe { (self.step)(st, s, out, &mut scratch[..dv]) }
    }
}
