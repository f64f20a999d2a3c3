//! Helpers shared by the kernel test binaries: a seeded PRNG, input generators, bit comparison.

#![allow(dead_code)]

use kernels::{Avx512Many, Isa, Kernels};

/// SplitMix64: tiny, seedable, good enough to drive test inputs. The root crate's `src/rng.rs`
/// is the one SplitMix64 of k3ring; this crate may not depend on the root crate, so its tests keep
/// this copy, pinned to the same reference outputs by `rng_matches_the_reference_outputs`.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    pub fn byte(&mut self) -> u8 {
        (self.next_u64() >> 56) as u8
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / (1u64 << 24) as f32)
    }

    /// Uniform in [lo, hi).
    pub fn range(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * self.unit()
    }

    /// Roughly normal with standard deviation `sd` (sum of 4 uniforms).
    pub fn normal(&mut self, sd: f32) -> f32 {
        let s: f32 = (0..4).map(|_| self.unit()).sum();
        (s - 2.0) * 1.732 * sd
    }

    pub fn normals(&mut self, n: usize, sd: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal(sd)).collect()
    }

    /// Finite values that stress rounding: signed zeros, subnormals, huge and tiny normals,
    /// mixed with ordinary values.
    pub fn adversarial(&mut self) -> f32 {
        const POOL: [f32; 16] = [
            0.0,
            -0.0,
            1e-40,
            -1e-40,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
            1e-45,
            1e30,
            -1e30,
            3e38,
            -3e38,
            1e-20,
            -1e-25,
            0.5,
            -2.0,
            65504.0,
        ];
        if self.below(2) == 0 {
            POOL[self.below(POOL.len())]
        } else {
            self.normal(1.0)
        }
    }

    pub fn adversarials(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.adversarial()).collect()
    }

    /// Like `adversarial` but also infinities and NaNs (with assorted payloads and signs).
    pub fn special(&mut self) -> f32 {
        match self.below(8) {
            0 => f32::INFINITY,
            1 => f32::NEG_INFINITY,
            2 => f32::from_bits(0x7FC0_0000 | (self.next_u64() as u32 & 0x3F_FFFF)),
            3 => f32::from_bits(0xFFC0_0001),
            _ => self.adversarial(),
        }
    }

    pub fn specials(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.special()).collect()
    }

    /// A random f32 bit pattern (any class).
    pub fn any_f32(&mut self) -> f32 {
        f32::from_bits(self.next_u64() as u32)
    }

    /// bf16 bytes of `n` ordinary values (normals with standard deviation `sd`, truncated).
    pub fn bf16_plain(&mut self, n: usize, sd: f32) -> Vec<u8> {
        (0..n).flat_map(|_| ((self.normal(sd).to_bits() >> 16) as u16).to_le_bytes()).collect()
    }

    /// bf16 bytes of `n` values: mostly rounded-down normals, some special patterns.
    pub fn bf16_bytes(&mut self, n: usize, specials: bool) -> Vec<u8> {
        const FINITE: [u16; 8] = [0x0000, 0x8000, 0x0001, 0x8001, 0x0080, 0x7F7F, 0xFF7F, 0x3F80];
        const NONFINITE: [u16; 3] = [0x7F80, 0xFF80, 0x7FC1];
        let mut out = Vec::with_capacity(2 * n);
        for _ in 0..n {
            let bits = match self.below(10) {
                0 => FINITE[self.below(FINITE.len())],
                1 if specials => NONFINITE[self.below(NONFINITE.len())],
                _ => (self.normal(0.5).to_bits() >> 16) as u16,
            };
            out.extend_from_slice(&bits.to_le_bytes());
        }
        out
    }
}

/// `bytes` copied into a buffer that starts at an odd address offset: returns the buffer and
/// the offset at which the copy starts (use `&buf[off..]`).
pub fn unaligned(bytes: &[u8]) -> (Vec<u8>, usize) {
    let mut buf = vec![0xA5u8; bytes.len() + 64];
    let addr = buf.as_ptr() as usize;
    // Make the copy start at an address that is 1 (mod 32): misaligned for every vector width.
    let off = (33 - addr % 32) % 32;
    buf[off..off + bytes.len()].copy_from_slice(bytes);
    (buf, off)
}

/// Same value bits, or both NaN (NaN payloads are not part of the contract, see crate docs).
pub fn same_bits(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[track_caller]
pub fn assert_bits(ctx: &str, want: &[f32], got: &[f32]) {
    assert_eq!(want.len(), got.len(), "{ctx}: lengths differ");
    for (i, (&w, &g)) in want.iter().zip(got).enumerate() {
        assert!(
            same_bits(w, g),
            "{ctx}: element {i}: want {w:e} ({:#010x}), got {g:e} ({:#010x})",
            w.to_bits(),
            g.to_bits()
        );
    }
}

/// Exact bits, NaN payload included.
#[track_caller]
pub fn assert_bits_strict(ctx: &str, want: &[f32], got: &[f32]) {
    assert_eq!(want.len(), got.len(), "{ctx}: lengths differ");
    for (i, (&w, &g)) in want.iter().zip(got).enumerate() {
        assert_eq!(
            w.to_bits(),
            g.to_bits(),
            "{ctx}: element {i}: want {w:e} ({:#010x}), got {g:e} ({:#010x})",
            w.to_bits(),
            g.to_bits()
        );
    }
}

pub fn scalar() -> Kernels {
    Kernels::with_isa(Isa::Scalar).unwrap()
}

/// Every ISA this host can run, Scalar first; on AVX-512 also with the many-token loop this CPU
/// did not choose, so the twins cover both [`kernels::Avx512Many`] loops on any AVX-512 host.
pub fn all_kernels() -> Vec<Kernels> {
    let mut ks: Vec<Kernels> = Isa::available().into_iter().map(|i| Kernels::with_isa(i).unwrap()).collect();
    for k in ks.clone() {
        if let Some(v) = k.avx512_many() {
            let other = if v == Avx512Many::Tiles { Avx512Many::Passes } else { Avx512Many::Tiles };
            ks.push(k.with_avx512_many(other));
        }
    }
    if ks.len() == 1 {
        #[allow(clippy::print_stderr)]
        {
            eprintln!("SKIPPED: only the scalar ISA is available on this host; SIMD twins untested");
        }
    }
    ks
}

pub fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap()
}

/// Distance in f32 ulps of `got` from the exact value `want` (ulp taken at `want`).
pub fn ulp_error(got: f32, want: f64) -> f64 {
    let w32 = want as f32;
    let ulp = if w32.is_infinite() {
        f64::from(f32::MAX) - f64::from(f32::from_bits(f32::MAX.to_bits() - 1))
    } else {
        let a = w32.abs();
        let next = f32::from_bits(a.to_bits() + 1);
        f64::from(next) - f64::from(a)
    };
    (f64::from(got) - want).abs() / ulp
}

/// The reference outputs of SplitMix64 seeded with 0, as pinned in the root crate's `src/rng.rs`.
#[test]
fn rng_matches_the_reference_outputs() {
    let mut rng = Rng::new(0);
    let got: Vec<u64> = (0..4).map(|_| rng.next_u64()).collect();
    assert_eq!(got, [0xe220_a839_7b1d_cdaf, 0x6e78_9e6a_a1b9_65f4, 0x06c4_5d18_8009_454f, 0xf88b_b8a8_724c_81ec]);
}
