//! Scalar bf16 kernels: the definition.

use super::bf16_at;
use crate::dot::scalar::{pad16, Lanes, LANES};
use crate::out::RowsOut;

/// Decodes up to 16 bf16 (`bytes.len() <= 32`, even) into a chunk zero-padded to 16 floats.
#[inline]
pub(crate) fn decode_chunk(bytes: &[u8]) -> [f32; LANES] {
    let mut chunk = [0.0f32; LANES];
    for (i, v) in chunk.iter_mut().take(bytes.len() / 2).enumerate() {
        *v = bf16_at(bytes, i);
    }
    chunk
}

/// Canonical dot of one bf16 row (`2 * x.len()` bytes) with `x`.
pub(crate) fn row_dot(row: &[u8], x: &[f32]) -> f32 {
    let mut acc = Lanes::ZERO;
    for (wc, xc) in row.chunks(2 * LANES).zip(x.chunks(LANES)) {
        acc.fma(&decode_chunk(wc), &pad16(xc));
    }
    acc.reduce()
}

/// `y[tok, r] = row_dot(W[r], x[tok])` for the rows of `out`; `w` holds exactly those rows.
pub(crate) fn matmul(w: &[u8], cols: usize, x: &[f32], t: usize, out: &mut RowsOut<'_>) {
    let row_bytes = 2 * cols;
    for tok in 0..t {
        let xt = &x[tok * cols..][..cols];
        for r in 0..out.rows() {
            let row = &w[r * row_bytes..][..row_bytes];
            out.set(tok, r, row_dot(row, xt));
        }
    }
}

/// `out[c] = fma(x[r], W[r, c], out[c])` for r = 0, 1, ..., from out = +0.0.
pub(crate) fn matvec_t(w: &[u8], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    for (r, &xr) in x.iter().enumerate().take(rows) {
        let row = &w[r * 2 * cols..][..2 * cols];
        for (c, o) in out.iter_mut().enumerate() {
            *o = xr.mul_add(bf16_at(row, c), *o);
        }
    }
}
