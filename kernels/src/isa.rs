//! Instruction-set selection (house style rule 8).
//!
//! The ISA is chosen once, at run time, by [`Isa::best`] or by name through [`Isa::from_name`];
//! `is_x86_feature_detected!` checks both the CPU flags and that the OS saves the wide registers.
//! No kernel exists only under `cfg(target_feature)`: every ISA's code is compiled into every
//! x86-64 build and picked here.

use std::fmt;

/// An instruction set a kernel table can be built for.
///
/// Every ISA computes the same bits (see the crate docs); they differ only in speed.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Isa {
    /// Portable Rust, the definition of every kernel.
    Scalar,
    /// x86-64 AVX2 + FMA (256-bit vectors).
    Avx2,
    /// x86-64 AVX-512 F + BW + VL (512-bit vectors: the 16 canonical lanes in one register),
    /// with AVX2 + FMA. The bf16 and MXFP4 matmuls have their own AVX-512 code; every other
    /// kernel runs its AVX2 version, which such a CPU also has.
    Avx512,
}

impl Isa {
    /// Every ISA this build knows, worst to best.
    pub const ALL: [Isa; 3] = [Isa::Scalar, Isa::Avx2, Isa::Avx512];

    /// The ISAs this host can run, worst to best; always starts with [`Isa::Scalar`].
    pub fn available() -> Vec<Isa> {
        Self::ALL.into_iter().filter(|isa| isa.is_available()).collect()
    }

    /// The fastest ISA this host can run.
    pub fn best() -> Isa {
        let mut best = Isa::Scalar;
        for isa in Self::ALL {
            if isa.is_available() {
                best = isa;
            }
        }
        best
    }

    /// Whether this host (CPU and OS) can run kernels built for `self`.
    pub fn is_available(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => avx2_fma_detected(),
            Isa::Avx512 => avx2_fma_detected() && avx512_f_bw_vl_detected(),
        }
    }

    /// The lower-case name used on the command line: `"scalar"`, `"avx2"`, `"avx512"`.
    pub fn name(&self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The inverse of [`Isa::name`] (exact, lower-case match).
    pub fn from_name(name: &str) -> Option<Isa> {
        Self::ALL.into_iter().find(|isa| isa.name() == name)
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_fma_detected() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx2_fma_detected() -> bool {
    false
}

/// The macro also checks that the OS saves the zmm and mask registers (XCR0 bits 5-7).
#[cfg(target_arch = "x86_64")]
fn avx512_f_bw_vl_detected() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

#[cfg(not(target_arch = "x86_64"))]
fn avx512_f_bw_vl_detected() -> bool {
    false
}

/// Whether this CPU executes every 256-bit vector operation as two 128-bit halves: AMD family
/// 17h models below 30h (Zen 1 and Zen+; Zen 2 starts at 30h) and Hygon family 18h (Dhyana, a
/// Zen 1). Only a speed choice ([`crate::mxfp4::Avx2Mxfp4`]): every kernel gives the same bits.
#[cfg(target_arch = "x86_64")]
pub(crate) fn splits_256_bit_operations() -> bool {
    use std::arch::x86_64::{__cpuid, CpuidResult};
    // `__cpuid` is a safe function from Rust 1.94; the workspace's rust-version is older.
    #[allow(unused_unsafe)]
    // SAFETY: every x86-64 CPU has CPUID (leaf 0, and leaf 1 whenever leaf 0 reports it).
    let cpuid = |leaf: u32| -> CpuidResult { unsafe { __cpuid(leaf) } };
    let name = cpu_vendor();
    if cpuid(0).eax < 1 {
        return false;
    }
    let (family, model) = family_model(cpuid(1).eax);
    match &name {
        b"AuthenticAMD" => family == 0x17 && model < 0x30,
        b"HygonGenuine" => family == 0x18,
        _ => false,
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn splits_256_bit_operations() -> bool {
    false
}

/// How the AVX-512 bf16 and MXFP4 products run many tokens at once; both give the same bits
/// (the twin tests run both on every AVX-512 host).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Avx512Many {
    /// Passes of a few tokens over every 4 rows, the weights widened or decoded in registers
    /// once per pass: bf16 at 0.85-0.92 of the FMA peak at 16 tokens on a Zen 4 host, whose zmm
    /// FMAs issue one a cycle.
    Passes,
    /// Tiles of 8 rows decoded once into L1 for up to 16 tokens (bf16 from 5 tokens, MXFP4 from
    /// 10): on an Intel core (an Emerald Rapids VM), whose two zmm FMA ports also run the
    /// widening shifts and shuffles, bf16 ran at 1.3x the passes at 16 tokens and MXFP4 at
    /// 1.1x on one thread, level to slower on two in one shape (docs/BENCHMARKS.md, "Tiles for
    /// many tokens on AVX-512").
    Tiles,
}

impl Avx512Many {
    /// [`Avx512Many::Tiles`] on Intel CPUs (measured on Emerald Rapids only), else
    /// [`Avx512Many::Passes`] (measured on Zen 4 and Zen 5).
    pub fn for_this_cpu() -> Avx512Many {
        if cpu_vendor() == *b"GenuineIntel" {
            Avx512Many::Tiles
        } else {
            Avx512Many::Passes
        }
    }

    /// `"passes"` or `"tiles"`.
    pub fn name(self) -> &'static str {
        match self {
            Avx512Many::Passes => "passes",
            Avx512Many::Tiles => "tiles",
        }
    }

    /// The variant named `name` (as [`Avx512Many::name`] gives it).
    pub fn from_name(name: &str) -> Option<Avx512Many> {
        [Avx512Many::Passes, Avx512Many::Tiles].into_iter().find(|v| v.name() == name)
    }
}

/// CPUID's 12-byte vendor string ("GenuineIntel", "AuthenticAMD", ...).
#[cfg(target_arch = "x86_64")]
fn cpu_vendor() -> [u8; 12] {
    use std::arch::x86_64::__cpuid;
    // `__cpuid` is a safe function from Rust 1.94; the workspace's rust-version is older.
    #[allow(unused_unsafe)]
    // SAFETY: every x86-64 CPU has CPUID leaf 0.
    let vendor = unsafe { __cpuid(0) };
    let mut name = [0u8; 12];
    for (i, r) in [vendor.ebx, vendor.edx, vendor.ecx].into_iter().enumerate() {
        name[4 * i..4 * i + 4].copy_from_slice(&r.to_le_bytes());
    }
    name
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_vendor() -> [u8; 12] {
    [0; 12]
}

/// (display family, display model) from CPUID leaf 1's EAX, as the vendors define them.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn family_model(eax: u32) -> (u32, u32) {
    let base_family = (eax >> 8) & 0xF;
    let base_model = (eax >> 4) & 0xF;
    let family = if base_family == 0xF { base_family + ((eax >> 20) & 0xFF) } else { base_family };
    let model =
        if base_family == 0xF || base_family == 0x6 { base_model | (((eax >> 16) & 0xF) << 4) } else { base_model };
    (family, model)
}

/// Names of the available ISAs, comma separated, for error messages.
pub(crate) fn available_names() -> String {
    let names: Vec<&str> = Isa::available().iter().map(|isa| isa.name()).collect();
    names.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for isa in Isa::ALL {
            assert_eq!(Isa::from_name(isa.name()), Some(isa));
            assert_eq!(isa.to_string(), isa.name());
        }
        assert_eq!(Isa::from_name("AVX2"), None);
        assert_eq!(Isa::from_name("avx512"), Some(Isa::Avx512));
        assert_eq!(Isa::from_name("avx512f"), None);
    }

    #[test]
    fn family_and_model_from_cpuid() {
        // Zen 1 EPYC 7551 (this VM some days), Zen 2 EPYC 7742, Zen 3 EPYC 7763, Skylake-SP.
        assert_eq!(family_model(0x0080_0F12), (0x17, 0x01));
        assert_eq!(family_model(0x0083_0F10), (0x17, 0x31));
        assert_eq!(family_model(0x00A0_0F11), (0x19, 0x01));
        assert_eq!(family_model(0x0005_0654), (0x6, 0x55));
    }

    #[test]
    fn scalar_always_available_and_first() {
        let available = Isa::available();
        assert_eq!(available.first(), Some(&Isa::Scalar));
        assert_eq!(available.last(), Some(&Isa::best()));
    }
}
