//! MXFP4 weight kernels (spec §4): `matmul_mxfp4`, y = W x for t tokens.
//!
//! Layout: `packed[rows, cols / 2]` u8, element `2j` in the LOW nibble of byte `j` and `2j + 1`
//! in the HIGH nibble; a nibble is E2M1 (bit 3 sign, bits 0-2 index [`E2M1`]).
//! `scales[rows, cols / 32]` u8, E8M0: element `c` of a row is
//! `(sign * E2M1[mag]) * 2^(s - 127)` with `s = scales[row, c / 32]`, one f32 multiplication of
//! the table value by the power of two built exactly (s = 0 is the subnormal 2^-127). Every
//! decoded value is exact except magnitudes 2, 3, 4 and 6 at s = 254 (2 * 2^127 = 2^128 and up),
//! which overflow to inf as the f32 product must. Scale 0xFF (NaN in OCP E8M0) is corrupt data: the matmul returns
//! [`KernelError::BadScale`] naming the first such byte in row-major order. On error, `y` is
//! partly written and must not be used.
//!
//! Each (token, row) is `canonical_dot(decoded row, x[token])` (crate docs): f32, FMA, 16 lanes,
//! fixed tree. Serial or split by fixed row blocks over the current rayon pool, never inside a
//! reduction; a token's result does not depend on `t`, the other tokens, or the thread count.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_xmm;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub(crate) mod scalar;

use std::ops::Range;
use std::sync::atomic::AtomicU64;

use crate::error::KernelError;
use crate::isa::{Avx512Many, Isa};
use crate::out::RowsOut;
use crate::par;

/// E2M1 magnitudes, indexed by bits 0-2 of a nibble.
pub const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Elements per scale group, along the contraction axis.
pub const GROUP: usize = 32;

/// The E8M0 scale byte reserved for NaN, rejected as corrupt.
pub const BAD_SCALE: u8 = 0xFF;

/// `2^(s - 127)` built from bits: s >= 1 is the normal float with exponent field `s`; s = 0 is
/// the subnormal 2^-127 (bits 0x0040_0000). `s = 0xFF` would give +inf; callers reject it first.
#[inline]
pub(crate) const fn e8m0_pow2(s: u8) -> f32 {
    if s == 0 {
        f32::from_bits(0x0040_0000)
    } else {
        f32::from_bits((s as u32) << 23)
    }
}

/// `sign * E2M1[mag]` for a nibble; nibble 8 is -0.0.
#[inline]
pub(crate) const fn e2m1_signed(nibble: u8) -> f32 {
    let mag = E2M1[(nibble & 7) as usize];
    if nibble & 8 == 0 {
        mag
    } else {
        -mag
    }
}

/// Every decoded value, by scale byte then nibble: `SCALED[s].0[n]` is
/// `e2m1_signed(n) * e8m0_pow2(s)`, the definition's own product of the same two operands, so
/// the same bits (computed once at compile time; test `scaled_table_is_the_products`). SIMD
/// decoders look a group's values up here instead of multiplying every element by its power of
/// two. Row 0xFF is zeros and never read: such scales are rejected before any kernel runs.
pub(crate) static SCALED: [Aligned64<[f32; 16]>; 256] = scaled_table();

/// A value on its own 64-byte line (one scale's 16 values fill exactly one).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Aligned64<T>(pub(crate) T);

// The AVX-512 decoder loads a `SCALED` row with an aligned 64-byte load.
const _: () = assert!(size_of::<Aligned64<[f32; 16]>>() == 64 && align_of::<Aligned64<[f32; 16]>>() == 64);

const fn scaled_table() -> [Aligned64<[f32; 16]>; 256] {
    let mut table = [Aligned64([0.0f32; 16]); 256];
    let mut s = 0;
    while s < BAD_SCALE {
        let mut n = 0;
        while n < 16 {
            table[s as usize].0[n as usize] = e2m1_signed(n) * e8m0_pow2(s);
            n += 1;
        }
        s += 1;
    }
    table
}

/// The value of one MXFP4 element: `(sign * E2M1[mag]) * 2^(scale - 127)`, or `None` for the
/// corrupt scale 0xFF. `nibble` must be below 16.
pub fn mxfp4_value(nibble: u8, scale: u8) -> Option<f32> {
    assert!(nibble < 16, "mxfp4_value: nibble {nibble} is not 4 bits");
    if scale == BAD_SCALE {
        return None;
    }
    Some(e2m1_signed(nibble) * e8m0_pow2(scale))
}

/// Which one-token MXFP4 kernel the AVX2 kernels use; both give the same bits (the twin tests
/// run both on every AVX2 host).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Avx2Mxfp4 {
    /// 256-bit decode straight into canonical lanes: for cores with 256-bit execution units.
    Ymm,
    /// 128-bit decode into transposed lanes: for cores that split every 256-bit operation in
    /// two (AMD Zen 1 and Zen+, Hygon Dhyana), where it ran 1.2-1.3x the 256-bit kernel.
    Xmm,
}

impl Avx2Mxfp4 {
    /// The kernel for this CPU: [`Avx2Mxfp4::Xmm`] where
    /// [`splits_256_bit_operations`](crate::isa::splits_256_bit_operations), else
    /// [`Avx2Mxfp4::Ymm`].
    pub fn for_this_cpu() -> Avx2Mxfp4 {
        if crate::isa::splits_256_bit_operations() {
            Avx2Mxfp4::Xmm
        } else {
            Avx2Mxfp4::Ymm
        }
    }

    /// `"ymm"` or `"xmm"`.
    pub fn name(self) -> &'static str {
        match self {
            Avx2Mxfp4::Ymm => "ymm",
            Avx2Mxfp4::Xmm => "xmm",
        }
    }
}

/// `(packed rows of this block, scales rows of this block, cols, x [t, cols], t, out)`.
/// Scales are already validated (no 0xFF).
pub(crate) type MatmulFn = unsafe fn(&[u8], &[u8], usize, &[f32], usize, &mut RowsOut<'_>);

/// The MXFP4 kernels of one ISA.
#[derive(Clone, Copy)]
pub(crate) struct Fns {
    matmul: MatmulFn,
}

/// Positional arguments shared by the serial and parallel matmul.
pub(crate) struct Args<'a> {
    pub(crate) packed: &'a [u8],
    pub(crate) scales: &'a [u8],
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) x: &'a [f32],
    pub(crate) t: usize,
}

impl Args<'_> {
    fn check_shapes(&self, y: &[f32]) {
        let Args { packed, scales, rows, cols, x, t } = *self;
        assert_eq!(cols % GROUP, 0, "matmul_mxfp4: cols = {cols} is not a multiple of {GROUP}");
        assert_eq!(
            Some(packed.len()),
            rows.checked_mul(cols / 2),
            "matmul_mxfp4: packed must hold rows * cols / 2 = {rows} * {cols} / 2 bytes"
        );
        assert_eq!(
            Some(scales.len()),
            rows.checked_mul(cols / GROUP),
            "matmul_mxfp4: scales must hold rows * cols / 32 = {rows} * {cols} / 32 bytes"
        );
        assert_eq!(Some(x.len()), t.checked_mul(cols), "matmul_mxfp4: x must hold t * cols = {t} * {cols} floats");
        assert_eq!(Some(y.len()), t.checked_mul(rows), "matmul_mxfp4: y must hold t * rows = {t} * {rows} floats");
    }
}

/// The first 0xFF scale among `scales` (whole rows starting at `row_begin`), as an error.
pub(crate) fn check_scales(scales: &[u8], groups: usize, row_begin: usize) -> Result<(), KernelError> {
    // `contains` on bytes is memchr; the position is only searched once something was found.
    if !scales.contains(&BAD_SCALE) {
        return Ok(());
    }
    let pos = scales.iter().position(|&s| s == BAD_SCALE).unwrap_or(0);
    Err(KernelError::BadScale { row: row_begin + pos / groups, group: pos % groups })
}

impl Fns {
    /// `avx2` chooses the one-token kernel of [`Isa::Avx2`], `many` the many-token loop of
    /// [`Isa::Avx512`]; other ISAs ignore them.
    ///
    /// # Safety
    /// `isa` must be available on this host ([`Isa::is_available`]).
    pub(crate) unsafe fn for_isa(isa: Isa, avx2: Avx2Mxfp4, many: Avx512Many) -> Fns {
        match (isa, avx2, many) {
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, Avx2Mxfp4::Ymm, _) => Fns { matmul: avx2::matmul },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, Avx2Mxfp4::Xmm, _) => Fns { matmul: avx2_xmm::matmul },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, _, Avx512Many::Passes) => Fns { matmul: avx512::matmul },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, _, Avx512Many::Tiles) => Fns { matmul: avx512::matmul_tiles },
            _ => Fns { matmul: scalar::matmul },
        }
    }

    /// Validates then computes one block of rows.
    fn block(&self, a: &Args<'_>, mut out: RowsOut<'_>) -> Result<(), KernelError> {
        let (r0, n) = (out.row_begin(), out.rows());
        let (pb, groups) = (a.cols / 2, a.cols / GROUP);
        let packed = &a.packed[r0 * pb..(r0 + n) * pb];
        let scales = &a.scales[r0 * groups..(r0 + n) * groups];
        check_scales(scales, groups, r0)?;
        // SAFETY: `self` was built by `for_isa`, whose caller guaranteed the ISA's features.
        unsafe { (self.matmul)(packed, scales, a.cols, a.x, a.t, &mut out) };
        Ok(())
    }

    pub(crate) fn matmul(&self, a: &Args<'_>, y: &mut [f32]) -> Result<(), KernelError> {
        a.check_shapes(y);
        par::serial_blocks(RowsOut::new(y, a.t, a.rows), &|out| self.block(a, out))
    }

    /// `busy`, when given, gains the summed wall time of the blocks (see [`par::timed`]).
    pub(crate) fn par_matmul(&self, a: &Args<'_>, y: &mut [f32], busy: Option<&AtomicU64>) -> Result<(), KernelError> {
        a.check_shapes(y);
        par::par_blocks(RowsOut::new(y, a.t, a.rows), &|out| par::timed(busy, || self.block(a, out)))
    }

    /// [`Fns::par_matmul`] in one stretch of blocks per thread ([`par::par_runs`]), calling
    /// `watch` with each block's rows once the block is computed, on the thread that computed
    /// it.
    pub(crate) fn par_matmul_watched<W>(
        &self,
        a: &Args<'_>,
        y: &mut [f32],
        busy: Option<&AtomicU64>,
        watch: &W,
    ) -> Result<(), KernelError>
    where
        W: Fn(Range<usize>) + Sync,
    {
        a.check_shapes(y);
        let runs = rayon::current_num_threads();
        par::par_runs(RowsOut::new(y, a.t, a.rows), runs, &|out| {
            let rows = out.row_begin()..out.row_begin() + out.rows();
            let computed = par::timed(busy, || self.block(a, out));
            watch(rows);
            computed
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn power_of_two_edges() {
        assert_eq!(e8m0_pow2(127), 1.0);
        assert_eq!(e8m0_pow2(128), 2.0);
        assert_eq!(e8m0_pow2(1), f32::MIN_POSITIVE);
        assert_eq!(e8m0_pow2(254), 2f32.powi(127));
        assert_eq!(f64::from(e8m0_pow2(0)), 2f64.powi(-127));
        assert!(e8m0_pow2(0).is_subnormal());
    }

    #[test]
    fn values_cover_table_sign_and_scale() {
        assert_eq!(mxfp4_value(0x1, 127), Some(0.5));
        assert_eq!(mxfp4_value(0x7, 128), Some(12.0));
        assert_eq!(mxfp4_value(0xF, 127), Some(-6.0));
        assert_eq!(mxfp4_value(0x8, 127).map(f32::to_bits), Some((-0.0f32).to_bits()));
        assert_eq!(mxfp4_value(0x0, 127).map(f32::to_bits), Some(0));
        assert_eq!(mxfp4_value(0x7, 254), Some(f32::INFINITY));
        assert_eq!(mxfp4_value(0x1, 0).map(f64::from), Some(2f64.powi(-128)));
        assert_eq!(mxfp4_value(0x3, BAD_SCALE), None);
    }

    #[test]
    fn scaled_table_is_the_products() {
        for s in 0..BAD_SCALE {
            for n in 0..16u8 {
                // The public definition of an element's value, computed at run time.
                let got = SCALED[usize::from(s)].0[usize::from(n)];
                assert_eq!(Some(got.to_bits()), mxfp4_value(n, s).map(f32::to_bits), "scale {s}, nibble {n}");
                // Every value has at most 2 significant bits, so it is exactly a bf16 (the AVX2
                // decoder relies on it); inf at s = 254 and the subnormals at s = 0 included.
                assert_eq!(got.to_bits() & 0xFFFF, 0, "scale {s}, nibble {n}");
            }
        }
        assert_eq!(SCALED[usize::from(BAD_SCALE)].0, [0.0; 16]);
    }

    #[test]
    fn check_scales_reports_first_in_row_major_order() {
        let mut s = vec![127u8; 4 * 3];
        s[2 * 3 + 1] = BAD_SCALE;
        s[3 * 3] = BAD_SCALE;
        assert_eq!(check_scales(&s, 3, 10), Err(KernelError::BadScale { row: 12, group: 1 }));
        assert_eq!(check_scales(&s[..6], 3, 0), Ok(()));
    }
}
