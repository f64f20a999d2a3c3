//! Scalar MXFP4 kernel: the definition.

use super::{e2m1_signed, e8m0_pow2, GROUP};
use crate::dot::scalar::{Lanes, LANES};
use crate::out::RowsOut;

/// Decodes the 16 elements of chunk `c` (columns 16c..16c+16) of one row.
#[inline]
pub(crate) fn decode_chunk(packed_row: &[u8], scale_row: &[u8], c: usize) -> [f32; LANES] {
    let pow2 = e8m0_pow2(scale_row[c * LANES / GROUP]);
    let bytes = &packed_row[c * LANES / 2..][..LANES / 2];
    let mut chunk = [0.0f32; LANES];
    for (j, v) in chunk.iter_mut().enumerate() {
        let byte = bytes[j / 2];
        // Element 2j is the low nibble, 2j + 1 the high one (spec §4).
        let nibble = if j % 2 == 0 { byte & 0x0F } else { byte >> 4 };
        *v = e2m1_signed(nibble) * pow2;
    }
    chunk
}

/// Canonical dot of one decoded row with `x` (`x.len()` a multiple of 32, so no padding).
pub(crate) fn row_dot(packed_row: &[u8], scale_row: &[u8], x: &[f32]) -> f32 {
    let (x_chunks, _) = x.as_chunks::<LANES>();
    let mut acc = Lanes::ZERO;
    for (c, xc) in x_chunks.iter().enumerate() {
        acc.fma(&decode_chunk(packed_row, scale_row, c), xc);
    }
    acc.reduce()
}

/// `y[tok, r] = row_dot(W[r], x[tok])` for the rows of `out`; `packed`/`scales` hold exactly
/// those rows.
pub(crate) fn matmul(packed: &[u8], scales: &[u8], cols: usize, x: &[f32], t: usize, out: &mut RowsOut<'_>) {
    let (row_bytes, groups) = (cols / 2, cols / GROUP);
    for tok in 0..t {
        let xt = &x[tok * cols..][..cols];
        for r in 0..out.rows() {
            let p = &packed[r * row_bytes..][..row_bytes];
            let s = &scales[r * groups..][..groups];
            out.set(tok, r, row_dot(p, s, xt));
        }
    }
}
