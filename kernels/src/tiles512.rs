//! The AVX-512 many-token driver (blocks of up to 16 tokens) of [`crate::Avx512Many::Tiles`],
//! shared by the bf16 and MXFP4 kernels, which supply only the decode of a tile ([`TileRows`]).
//!
//! Every [`ROWS`] rows, the columns go by tiles of [`TILE_CHUNKS`] 16-column chunks: the tile is
//! decoded once into f32 canonical lanes on the stack (8 KiB, in L1), then the block's tokens
//! run over it in passes of [`PASS`] tokens, 8 rows x 3 tokens = 24 zmm accumulators, their
//! lanes kept on the stack between tiles (8 KiB). Each FMA reads its weight from L1 and the
//! decode happens once per block of tokens (5 to 16), where the few-token loops decode (or
//! widen) once per pass in the FMA ports' own cycles: on an Intel core, whose two zmm FMA ports
//! also run the widening shifts and shuffles, passes of six tokens over four rows held 16-token
//! bf16 products at 0.44-0.51 of the FMA peak on one thread and these tiles at 0.61-0.67
//! (docs/BENCHMARKS.md, "Tiles for many tokens on AVX-512"). Eight rows a pass, not four, since
//! x is read from L2 once per pass and eight rows halve that traffic.
//!
//! The passes prefetch what comes next, spread over their chunks (a burst of prefetches at the
//! decode would wait for the line fill buffers like the loads themselves): the next tile of
//! the encoded weights into L1, its lines dealt over all the passes' chunks (a bf16 tile's 64
//! lines over 96 chunks at 16 tokens), and the next pass's x.
//!
//! Bits: every (row, token) keeps its 16 canonical lanes from +0.0 in increasing column order
//! (tiles in order, chunks in order within a tile, the zero-padded tail last), one FMA per
//! chunk, and reduces them with the canonical tree: the bits of every other path.

use std::arch::x86_64::{__m512, _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_setzero_ps};

use crate::dot::avx512::{load16z, prefetch, reduce16z};
use crate::dot::scalar::{pad16, LANES};
use crate::out::{even_runs, RowsOut};

/// Rows decoded per tile.
const ROWS: usize = 8;
/// Chunks of 16 columns per tile: 8 rows x 16 chunks of f32 = 8 KiB.
pub(crate) const TILE_CHUNKS: usize = 16;
/// Most tokens sharing the tiles (the lanes buffer's size).
const BLOCK: usize = 16;
/// Tokens per pass over a tile: 8 x 3 accumulators, 3 registers of x, 1 of weights.
const PASS: usize = 3;

/// One decoded row of a tile: [`TILE_CHUNKS`] chunks of canonical lanes.
type TileRow = [__m512; TILE_CHUNKS];

/// The rows of a weight matrix in their encoded form, as the tiles need them.
pub(crate) trait TileRows {
    /// 64-byte lines of the encoded data one row of one tile spans (what a pass prefetches).
    const TILE_LINES: usize;

    /// Decodes chunks `c0..c0 + dst.len()` (full chunks of the row) of `row` into `dst`, lane
    /// `l` of `dst[c]` holding column `16 * (c0 + c) + l`.
    ///
    /// # Safety
    /// AVX-512 F + BW + VL must be available.
    unsafe fn decode(&self, row: usize, c0: usize, dst: &mut [__m512]);

    /// The row's last `cols % 16` columns, zero-padded to a chunk; called only when `cols` is
    /// not a multiple of 16.
    ///
    /// # Safety
    /// AVX-512 F + BW + VL must be available.
    unsafe fn decode_tail(&self, row: usize) -> __m512;

    /// An address in line `line < TILE_LINES` of the encoded tile of `row` at chunk `c0`; only
    /// ever prefetched, so it may lie past the data (rows past the matrix): built with
    /// `wrapping_add`, never dereferenced.
    fn tile_line(&self, row: usize, c0: usize, line: usize) -> *const u8;
}

/// Fills the rows of `out` in whole blocks of [`ROWS`] (`rows / ROWS * ROWS` of them, counted
/// from the first; the caller computes the rest) for all `t` tokens of `x` (`[t, cols]`),
/// in blocks of up to [`BLOCK`] tokens. Returns the rows filled.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn run<S: TileRows>(src: &S, cols: usize, x: &[f32], t: usize, out: &mut RowsOut<'_>) -> usize {
    assert_eq!(Some(x.len()), t.checked_mul(cols), "tiles: {t} tokens of {cols} floats");
    let rows = out.rows() / ROWS * ROWS;
    if rows == 0 {
        return 0;
    }
    let chunks = cols / LANES;
    let mut tile = [[_mm512_setzero_ps(); TILE_CHUNKS]; ROWS];
    for (b0, bn) in even_runs(t, BLOCK) {
        assert!((1..=BLOCK).contains(&bn), "tiles: a block of {bn} tokens");
        let xb = &x[b0 * cols..(b0 + bn) * cols];
        let x_tails: [[f32; LANES]; BLOCK] = std::array::from_fn(|k| {
            if k < bn {
                pad16(&xb[k * cols + chunks * LANES..(k + 1) * cols])
            } else {
                [0.0; LANES]
            }
        });
        for r in (0..rows).step_by(ROWS) {
            let mut lanes = [[_mm512_setzero_ps(); ROWS]; BLOCK];
            let mut c0 = 0;
            while c0 < chunks {
                let n = TILE_CHUNKS.min(chunks - c0);
                for (i, row) in tile.iter_mut().enumerate() {
                    // SAFETY: this function's target features are the decode's requirement.
                    unsafe { src.decode(r + i, c0, &mut row[..n]) };
                }
                // The passes prefetch the next tile of these rows, or the first of the next rows.
                let (next_r, next_c) = if c0 + n < chunks { (r, c0 + n) } else { (r + ROWS, 0) };
                let runs = bn.div_ceil(PASS);
                let slots = runs * n;
                for (p, (t0, tn)) in even_runs(bn, PASS).enumerate() {
                    // The x the next pass reads: the next tokens here, or the first at the next tile.
                    let (x_next, x_next_c) = if t0 + tn < bn { (t0 + tn, c0) } else { (0, next_c) };
                    let pass = Pass {
                        tile: &tile,
                        n,
                        x: &xb[t0 * cols..(t0 + tn) * cols],
                        cols,
                        c0,
                        x_next: xb.as_ptr().wrapping_add(x_next * cols + x_next_c * LANES),
                        w_next: |l: usize| src.tile_line(next_r + l / S::TILE_LINES, next_c, l % S::TILE_LINES),
                        w_lines: ROWS * S::TILE_LINES,
                        slot0: p * n,
                        slots,
                    };
                    let lanes = &mut lanes[t0..t0 + tn];
                    // Blocks of 5 or more tokens make passes of 2 and 3; 1 only for smaller blocks.
                    match tn {
                        3 => pass.run::<3>(lanes),
                        2 => pass.run::<2>(lanes),
                        _ => pass.run::<1>(lanes),
                    }
                }
                c0 += n;
            }
            if !cols.is_multiple_of(LANES) {
                for i in 0..ROWS {
                    // SAFETY: this function's target features are the decode's requirement.
                    let w = unsafe { src.decode_tail(r + i) };
                    for (l, xt) in lanes.iter_mut().zip(&x_tails).take(bn) {
                        l[i] = _mm512_fmadd_ps(w, load16z(xt), l[i]);
                    }
                }
            }
            for (k, l) in lanes.iter().enumerate().take(bn) {
                out.set_block(b0 + k, r, [l.map(|v| reduce16z(v))]);
            }
        }
    }
    rows
}

/// One pass of `T` tokens over a decoded tile.
struct Pass<'a, F> {
    tile: &'a [TileRow; ROWS],
    /// Chunks of the tile.
    n: usize,
    /// `[T, cols]`: the pass's tokens, all columns.
    x: &'a [f32],
    cols: usize,
    /// The tile's first chunk.
    c0: usize,
    /// Token 0 of the next pass's x at its tile's first chunk (prefetched, never read).
    x_next: *const f32,
    /// Line `l < w_lines` of the next tile's encoded weights (prefetched, never read).
    w_next: F,
    w_lines: usize,
    /// This pass's first chunk among all passes' chunks over the tile, and their number: the
    /// next tile's lines are spread over all of them.
    slot0: usize,
    slots: usize,
}

impl<F: Fn(usize) -> *const u8> Pass<'_, F> {
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    fn run<const T: usize>(&self, lanes: &mut [[__m512; ROWS]]) {
        assert!(lanes.len() == T && self.n <= TILE_CHUNKS, "a pass of {} tokens, {} chunks", lanes.len(), self.n);
        assert!((self.c0 + self.n) * LANES <= self.cols, "pass: chunks past the row");
        assert_eq!(Some(self.x.len()), self.cols.checked_mul(T), "pass: {T} tokens of {} floats", self.cols);
        let xp = self.x.as_ptr().wrapping_add(self.c0 * LANES);
        let mut acc: [[__m512; ROWS]; T] = std::array::from_fn(|k| lanes[k]);
        for c in 0..self.n {
            let mut l = self.slot0 + c;
            while l < self.w_lines {
                prefetch((self.w_next)(l));
                l += self.slots;
            }
            for k in 0..T {
                prefetch(self.x_next.wrapping_add(k * self.cols + c * LANES).cast());
            }
            let mut xv = [_mm512_setzero_ps(); T];
            for (k, v) in xv.iter_mut().enumerate() {
                // SAFETY: k < T and c0 + c < c0 + n, with (c0 + n) * 16 <= cols (asserted), so the
                // 16 floats from k * cols + (c0 + c) * 16 lie inside x (T * cols floats, asserted).
                *v = unsafe { _mm512_loadu_ps(xp.add(k * self.cols + c * LANES)) };
            }
            for i in 0..ROWS {
                let w = self.tile[i][c];
                for (a, v) in acc.iter_mut().zip(&xv) {
                    a[i] = _mm512_fmadd_ps(w, *v, a[i]);
                }
            }
        }
        for (l, a) in lanes.iter_mut().zip(acc) {
            *l = a;
        }
    }
}
