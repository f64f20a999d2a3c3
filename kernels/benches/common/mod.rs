//! Shared by the kernel benches.

use kernels::{Isa, Kernels};

/// The host's best kernels, or those of the ISA `K3_BENCH_ISA` names.
#[allow(dead_code)] // the roofline bench times every ISA instead
pub fn kernels_under_test() -> Kernels {
    match std::env::var("K3_BENCH_ISA") {
        Ok(name) => Kernels::with_isa(Isa::from_name(&name).expect("K3_BENCH_ISA: scalar|avx2|avx512")).unwrap(),
        Err(_) => Kernels::detect(),
    }
}

/// Deterministic filler: normal-range bf16 values or random bytes.
pub struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self) -> u32 {
        self.0 = self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 32) as u32
    }

    pub fn f32(&mut self) -> f32 {
        (self.next() >> 8) as f32 / (1u32 << 24) as f32 - 0.5
    }

    pub fn bf16_bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).flat_map(|_| ((self.f32().to_bits() >> 16) as u16).to_le_bytes()).collect()
    }

    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| (self.next() >> 24) as u8).collect()
    }

    /// `copies` distinct MXFP4 matrices `[rows, cols]` as (packed nibbles, scales), scales near
    /// 2^-3 so products stay in a normal range. Rotating through them makes every call stream
    /// from DRAM, as an expert read from storage would.
    pub fn mxfp4_copies(&mut self, copies: usize, rows: usize, cols: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
        (0..copies)
            .map(|_| {
                let packed = self.bytes(rows * cols / 2);
                let scales = (0..rows * cols / 32).map(|_| 120 + (self.next() % 10) as u8).collect();
                (packed, scales)
            })
            .collect()
    }
}
