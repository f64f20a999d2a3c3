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
    fn scalar_always_available_and_first() {
        let available = Isa::available();
        assert_eq!(available.first(), Some(&Isa::Scalar));
        assert_eq!(available.last(), Some(&Isa::best()));
    }
}
