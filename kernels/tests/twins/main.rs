//! Twin tests (house style rule 7): every ISA the host has must give the scalar kernel's bits,
//! on random and adversarial inputs; matmuls must also be batch- and thread-invariant.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod bf16;
#[path = "../common/mod.rs"]
mod common;
mod dot;
mod elementwise;
mod hash;
mod kda;
mod matvec_t;
mod mxfp4;
mod norm;
mod softmax;

use common::{all_kernels, assert_bits, assert_bits_strict, pool, scalar, unaligned, Rng};
use kernels::{mxfp4_value, Avx2Mxfp4, KernelError, Kernels};

/// Lengths 0..=70 (every residue mod 8 and 16) plus a few long ones.
fn lengths() -> Vec<usize> {
    let mut v: Vec<usize> = (0..=70).collect();
    v.extend([127, 128, 129, 255, 1000, 7168]);
    v
}

#[test]
#[should_panic(expected = "element 1")]
fn comparator_catches_one_ulp() {
    let a = [1.0f32, 2.0];
    let b = [1.0f32, f32::from_bits(2.0f32.to_bits() + 1)];
    assert_bits("one ulp", &a, &b);
}

#[test]
fn with_isa_matches_availability() {
    for isa in kernels::Isa::ALL {
        match Kernels::with_isa(isa) {
            Ok(k) => {
                assert!(isa.is_available());
                assert_eq!(k.isa(), isa);
            }
            Err(e) => {
                assert!(!isa.is_available());
                assert_eq!(e, KernelError::IsaUnavailable(isa));
            }
        }
    }
    assert_eq!(Kernels::detect().isa(), kernels::Isa::best());
    // Shown with --nocapture: the record of which ISAs this run compared against scalar.
    let names: Vec<&str> = kernels::Isa::available().iter().map(|i| i.name()).collect();
    #[allow(clippy::print_stderr)]
    {
        eprintln!("twins cover ISAs: {}", names.join(", "));
    }
}
