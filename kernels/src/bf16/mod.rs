//! BF16 weight kernels: `matmul_bf16` (y = W x for t tokens) and `matvec_t_bf16` (out = W^T x).
//!
//! Weights are raw little-endian bytes straight from the checkpoint, row-major `[rows, cols]`,
//! with no alignment promise. A bf16 `b` is the f32 with bits `b << 16` (exact).
//!
//! `matmul`: for every (token, row), `y = canonical_dot(W[row] as f32, x[token])` (crate docs).
//! f32 accumulators, FMA, 16 lanes, fixed tree. The serial version runs on the calling thread;
//! the parallel one splits rows in fixed blocks over the current rayon pool (never a reduction).
//! A token's result does not depend on `t` or on the other tokens. Spec §3 (every BF16
//! projection), §5.
//!
//! `matvec_t`: `out[c] = sum_r x[r] * W[r, c]`, f32, sequential in increasing `r` with
//! `out[c] = fma(x[r], W[r, c], out[c])` from +0.0; vectorised across `c`, no horizontal
//! reduction. Single-threaded. Spec §5 (MLA absorption of `kv_b_proj`).

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;
pub(crate) mod scalar;

use std::sync::atomic::AtomicU64;

use crate::isa::{Avx512Many, Isa};
use crate::out::RowsOut;
use crate::par;

/// Converts a bf16 bit pattern to f32, exactly (`bits << 16`).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Reads bf16 number `index` from little-endian bytes.
#[inline]
pub(crate) fn bf16_at(bytes: &[u8], index: usize) -> f32 {
    bf16_to_f32(u16::from_le_bytes([bytes[2 * index], bytes[2 * index + 1]]))
}

/// `(w rows of this block, cols, x [t, cols], t, out)`.
pub(crate) type MatmulFn = unsafe fn(&[u8], usize, &[f32], usize, &mut RowsOut<'_>);
/// `(w, rows, cols, x [rows], out [cols])`.
pub(crate) type MatvecTFn = unsafe fn(&[u8], usize, usize, &[f32], &mut [f32]);

/// The bf16 kernels of one ISA.
#[derive(Clone, Copy)]
pub(crate) struct Fns {
    matmul: MatmulFn,
    matvec_t: MatvecTFn,
}

fn check_matmul_shapes(w: &[u8], rows: usize, cols: usize, x: &[f32], t: usize, y: &[f32]) {
    assert_eq!(
        Some(w.len()),
        rows.checked_mul(cols).and_then(|n| n.checked_mul(2)),
        "matmul_bf16: w must hold rows * cols * 2 = {rows} * {cols} * 2 bytes"
    );
    assert_eq!(Some(x.len()), t.checked_mul(cols), "matmul_bf16: x must hold t * cols = {t} * {cols} floats");
    assert_eq!(Some(y.len()), t.checked_mul(rows), "matmul_bf16: y must hold t * rows = {t} * {rows} floats");
}

impl Fns {
    /// `many` chooses the many-token loop of [`Isa::Avx512`]; other ISAs ignore it.
    ///
    /// # Safety
    /// `isa` must be available on this host ([`Isa::is_available`]).
    pub(crate) unsafe fn for_isa(isa: Isa, many: Avx512Many) -> Fns {
        match (isa, many) {
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2, _) => Fns { matmul: avx2::matmul, matvec_t: avx2::matvec_t },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, Avx512Many::Passes) => Fns { matmul: avx512::matmul, matvec_t: avx512::matvec_t },
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, Avx512Many::Tiles) => Fns { matmul: avx512::matmul_tiles, matvec_t: avx512::matvec_t },
            _ => Fns { matmul: scalar::matmul, matvec_t: scalar::matvec_t },
        }
    }

    /// Runs the kernel on one block of rows; `w` holds the rows from `first_row` on.
    fn block(&self, w: &[u8], first_row: usize, cols: usize, x: &[f32], t: usize, mut out: RowsOut<'_>) {
        let row_bytes = 2 * cols;
        let begin = (out.row_begin() - first_row) * row_bytes;
        let end = begin + out.rows() * row_bytes;
        // SAFETY: `self` was built by `for_isa`, whose caller guaranteed the ISA's features.
        unsafe { (self.matmul)(&w[begin..end], cols, x, t, &mut out) }
    }

    pub(crate) fn matmul(&self, w: &[u8], rows: usize, cols: usize, x: &[f32], t: usize, y: &mut [f32]) {
        check_matmul_shapes(w, rows, cols, x, t, y);
        self.block(w, 0, cols, x, t, RowsOut::new(y, t, rows));
    }

    /// `busy`, when given, gains the summed wall time of the blocks (see [`par::timed`]).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn par_matmul(
        &self,
        w: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        t: usize,
        y: &mut [f32],
        busy: Option<&AtomicU64>,
    ) {
        check_matmul_shapes(w, rows, cols, x, t, y);
        self.par_blocks(w, 0, cols, x, t, RowsOut::new(y, t, rows), busy);
    }

    /// Rows `rows` of the product whose output `y` is `[t, rows_total]`, from those rows'
    /// weights `w` only (`[rows.len(), cols]`). Entries of other rows are not written. Each
    /// row's value is computed whole by the same kernel as in [`Fns::par_matmul`], and a row's
    /// bits do not depend on which rows share its block (the twins pin every ISA to the scalar
    /// kernel, which computes rows independently), so these are the full product's bits.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn par_matmul_rows(
        &self,
        w: &[u8],
        rows: std::ops::Range<usize>,
        rows_total: usize,
        cols: usize,
        x: &[f32],
        t: usize,
        y: &mut [f32],
        busy: Option<&AtomicU64>,
    ) {
        assert!(
            rows.start <= rows.end && rows.end <= rows_total,
            "matmul_bf16 rows: {rows:?} must lie within the product's {rows_total} rows"
        );
        assert_eq!(
            Some(w.len()),
            rows.len().checked_mul(cols).and_then(|n| n.checked_mul(2)),
            "matmul_bf16 rows: w must hold rows * cols * 2 = {} * {cols} * 2 bytes",
            rows.len()
        );
        assert_eq!(Some(x.len()), t.checked_mul(cols), "matmul_bf16: x must hold t * cols = {t} * {cols} floats");
        assert_eq!(
            Some(y.len()),
            t.checked_mul(rows_total),
            "matmul_bf16: y must hold t * rows = {t} * {rows_total} floats"
        );
        let (_, tail) = RowsOut::new(y, t, rows_total).split_at(rows.start);
        let (piece, _) = tail.split_at(rows.len());
        self.par_blocks(w, rows.start, cols, x, t, piece, busy);
    }

    /// Splits `out` in blocks over the current pool; `w` holds the rows from `first_row` on.
    #[allow(clippy::too_many_arguments)]
    fn par_blocks(
        &self,
        w: &[u8],
        first_row: usize,
        cols: usize,
        x: &[f32],
        t: usize,
        out: RowsOut<'_>,
        busy: Option<&AtomicU64>,
    ) {
        let run = |out: RowsOut<'_>| {
            par::timed(busy, || self.block(w, first_row, cols, x, t, out));
            Ok(())
        };
        // The closure never fails, so neither does the split.
        let _infallible = par::par_blocks(out, &run);
    }

    pub(crate) fn matvec_t(&self, w: &[u8], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
        assert_eq!(
            Some(w.len()),
            rows.checked_mul(cols).and_then(|n| n.checked_mul(2)),
            "matvec_t_bf16: w must hold rows * cols * 2 = {rows} * {cols} * 2 bytes"
        );
        assert_eq!(x.len(), rows, "matvec_t_bf16: x must hold rows = {rows} floats");
        assert_eq!(out.len(), cols, "matvec_t_bf16: out must hold cols = {cols} floats");
        // SAFETY: `self` was built by `for_isa`, whose caller guaranteed the ISA's features.
        unsafe { (self.matvec_t)(w, rows, cols, x, out) }
    }
}
