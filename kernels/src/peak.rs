//! The FMA peak probe: independent chains of the widest FMA each ISA's products issue, the roof
//! that `k3ring bench` and the roofline bench hold the products' flops against.
//!
//! Each lane runs `x = fma(x, m, a)` from `x = 0`, `iters` times; the lanes' final values are
//! summed in lane order by scalar code. Every lane computes the same one-rounding sequence, so
//! every ISA returns the bits of the scalar twin with the same number of lanes.

use crate::isa::Isa;

/// Independent 256-bit chains on AVX2: enough to cover the FMA latency on two pipes, few enough
/// that they and the two operands stay in AVX2's 16 registers (16 chains spilled, and measured
/// 1.6x below the real peak on a Zen 5 host).
const CHAINS_YMM: usize = 12;
/// Independent 512-bit chains on AVX-512 (32 registers).
const CHAINS_ZMM: usize = 16;
/// Lanes of the scalar version: one canonical chunk.
const LANES_SCALAR: usize = 16;

/// The lanes one iteration of `isa`'s chains updates (each lane one FMA, two flops).
pub(crate) fn lanes(isa: Isa) -> usize {
    match isa {
        Isa::Scalar => LANES_SCALAR,
        Isa::Avx2 => CHAINS_YMM * 8,
        Isa::Avx512 => CHAINS_ZMM * 16,
    }
}

/// Runs `iters` iterations of `isa`'s chains; returns the sum of the lanes.
///
/// # Safety
/// `isa` must be available on this host.
pub(crate) unsafe fn chains(isa: Isa, iters: usize, m: f32, a: f32) -> f32 {
    match isa {
        Isa::Scalar => scalar(LANES_SCALAR, iters, m, a),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded from this function's contract.
        Isa::Avx2 => unsafe { avx2(iters, m, a) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded from this function's contract.
        Isa::Avx512 => unsafe { avx512(iters, m, a) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => scalar(lanes(isa), iters, m, a),
    }
}

/// The definition: `lanes` chains of `f32::mul_add`, summed in lane order.
pub(crate) fn scalar(lanes: usize, iters: usize, m: f32, a: f32) -> f32 {
    let mut acc = vec![0.0f32; lanes];
    for _ in 0..iters {
        for x in &mut acc {
            *x = x.mul_add(m, a);
        }
    }
    acc.iter().fold(0.0, |s, &x| s + x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn avx2(iters: usize, m: f32, a: f32) -> f32 {
    use std::arch::x86_64::{_mm256_fmadd_ps, _mm256_set1_ps, _mm256_storeu_ps};
    let (mv, av) = (_mm256_set1_ps(m), _mm256_set1_ps(a));
    let mut acc = [_mm256_set1_ps(0.0); CHAINS_YMM];
    for _ in 0..iters {
        for x in &mut acc {
            *x = _mm256_fmadd_ps(*x, mv, av);
        }
    }
    let mut out = [0.0f32; CHAINS_YMM * 8];
    for (x, lanes) in acc.iter().zip(out.chunks_exact_mut(8)) {
        // SAFETY: `lanes` holds 8 floats; the store is unaligned.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *x) };
    }
    out.iter().fold(0.0, |s, &x| s + x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn avx512(iters: usize, m: f32, a: f32) -> f32 {
    use std::arch::x86_64::{_mm512_fmadd_ps, _mm512_set1_ps, _mm512_storeu_ps};
    let (mv, av) = (_mm512_set1_ps(m), _mm512_set1_ps(a));
    let mut acc = [_mm512_set1_ps(0.0); CHAINS_ZMM];
    for _ in 0..iters {
        for x in &mut acc {
            *x = _mm512_fmadd_ps(*x, mv, av);
        }
    }
    let mut out = [0.0f32; CHAINS_ZMM * 16];
    for (x, lanes) in acc.iter().zip(out.chunks_exact_mut(16)) {
        // SAFETY: `lanes` holds 16 floats; the store is unaligned.
        unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), *x) };
    }
    out.iter().fold(0.0, |s, &x| s + x)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Kernels;

    #[test]
    fn every_isa_returns_the_scalar_twins_bits_and_counts_its_flops() -> Result<(), crate::KernelError> {
        for isa in Isa::available() {
            let k = Kernels::with_isa(isa)?;
            for (iters, m, a) in [(0, 0.5, 1.0), (1, 0.5, 1.0), (1000, 0.999_999, 1e-7), (77, -1.5, 3.25)] {
                let (sum, flops) = k.fma_chains(iters, m, a);
                assert_eq!(sum.to_bits(), scalar(lanes(isa), iters, m, a).to_bits(), "{isa} {iters} {m} {a}");
                assert_eq!(flops, (2 * lanes(isa) * iters) as u64);
            }
        }
        Ok(())
    }
}
