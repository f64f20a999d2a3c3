//! AVX-512 (F + BW + VL) bf16 kernels. Same bits as `scalar.rs`.
//!
//! The 16 canonical lanes are one zmm register: 16 bf16 (32 bytes) become 16 f32 with
//! `vpmovzxwd` + `vpslld 16`. `t == 1` streams 4 rows at once (4 independent FMA chains; the
//! kernel is DRAM-bound) and prefetches the next 4 rows into L1 and the 4 after those into L2,
//! like the AVX2 kernel; `t` of 2 to 4 widen each chunk once for every token; more tokens run
//! passes of up to six tokens over every 4 rows (`many_tokens`), or, with
//! [`crate::Avx512Many::Tiles`], tiles widened once into L1 ([`crate::tiles512`]).

use std::arch::x86_64::{
    __m256i, __m512, _mm256_loadu_si256, _mm512_castsi512_ps, _mm512_cvtepu16_epi32, _mm512_fmadd_ps, _mm512_loadu_ps,
    _mm512_set1_ps, _mm512_setzero_ps, _mm512_slli_epi32, _mm512_storeu_ps,
};

use crate::dot::avx512::{load16z, prefetch, prefetch_l2, reduce16z};
use crate::dot::scalar::{pad16, LANES};
use crate::out::{even_runs, RowsOut};
use crate::tiles512::{self, TileRows, TILE_CHUNKS};

/// Widens 16 bf16 in a 256-bit register to 16 f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn widen16(v: __m256i) -> __m512 {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(v)))
}

/// 16 bf16 (32 bytes, any alignment) as the 16 canonical lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn bf16x16(bytes: &[u8; 32]) -> __m512 {
    // SAFETY: `bytes` holds 32 bytes; `_mm256_loadu_si256` has no alignment need.
    widen16(unsafe { _mm256_loadu_si256(bytes.as_ptr().cast()) })
}

/// A row tail of fewer than 16 bf16, zero-padded.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn bf16_tail(tail: &[u8]) -> __m512 {
    let mut padded = [0u8; 32];
    padded[..tail.len()].copy_from_slice(tail);
    bf16x16(&padded)
}

/// Blocks of `R` rows ahead whose lines a second prefetch asks into L2, beside the next block's
/// into L1. With the next block alone one thread streamed 18-20 GB/s on a Zen 4 host (two:
/// 29-37); with this too, 26-31 (two: 34-39); three or four blocks ahead were slower than two
/// (docs/BENCHMARKS.md, "Prefetch into L2").
const L2_AHEAD: usize = 2;

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn matmul(w: &[u8], cols: usize, x: &[f32], t: usize, out: &mut RowsOut<'_>) {
    match t {
        1 => single_token(w, cols, x, out),
        2 => few_tokens::<2>(w, cols, x, out),
        3 => few_tokens::<3>(w, cols, x, out),
        4 => few_tokens::<4>(w, cols, x, out),
        _ => many_tokens(w, cols, x, t, out),
    }
}

/// Fewest tokens [`matmul_tiles`] runs as tiles: from 5 to 16 tokens the tiles ran a
/// 504x7168 product at 0.46-0.67 of the FMA peak on one thread of the Intel host, the passes
/// at 0.38-0.51.
const TILES_MIN_TOKENS: usize = 5;

/// [`matmul`] with [`tiles512`] from [`TILES_MIN_TOKENS`] tokens ([`crate::Avx512Many::Tiles`]);
/// the rows past the last whole block of 8 run [`matmul`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn matmul_tiles(w: &[u8], cols: usize, x: &[f32], t: usize, out: &mut RowsOut<'_>) {
    if t < TILES_MIN_TOKENS {
        return matmul(w, cols, x, t, out);
    }
    let done = tiles512::run(&Bf16Rows { w, cols }, cols, x, t, out);
    if done < out.rows() {
        matmul(&w[done * 2 * cols..], cols, x, t, &mut out.rows_from(done));
    }
}

/// The rows of a bf16 matrix for [`tiles512`]: decoding is widening.
struct Bf16Rows<'a> {
    /// `[rows, cols]` bf16 bytes.
    w: &'a [u8],
    cols: usize,
}

impl TileRows for Bf16Rows<'_> {
    const TILE_LINES: usize = TILE_CHUNKS * 32 / 64;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    unsafe fn decode(&self, row: usize, c0: usize, dst: &mut [__m512]) {
        let row_bytes = 2 * self.cols;
        let (chunks, _) = self.w[row * row_bytes + c0 * 32..][..dst.len() * 32].as_chunks::<32>();
        for (d, c) in dst.iter_mut().zip(chunks) {
            *d = bf16x16(c);
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    unsafe fn decode_tail(&self, row: usize) -> __m512 {
        let row_bytes = 2 * self.cols;
        bf16_tail(&self.w[row * row_bytes + self.cols / LANES * 32..(row + 1) * row_bytes])
    }

    fn tile_line(&self, row: usize, c0: usize, line: usize) -> *const u8 {
        self.w.as_ptr().wrapping_add(row * 2 * self.cols + c0 * 32 + line * 64)
    }
}

/// Tokens sharing one stream of the weights in [`many_tokens`]: the x of a block (16 tokens
/// of a 7168-column product: 448 KiB) stays in L2 while every row runs over it.
const MANY_BLOCK: usize = 16;

/// Tokens per pass of [`many_tokens`]: 4 rows x 6 tokens = 24 zmm accumulators, beside 6 of x
/// and one of weights: each widened chunk serves 6 FMAs. Passes of four (4 FMAs per widened
/// chunk) ran a 16-token product at 78-88 GFLOP/s on one Zen 4 thread, passes of six 85-102.
const MANY_PASS: usize = 6;

const _: () = assert!(MANY_PASS == 6, "Pass::run has an arm for each pass size");

/// More than four tokens: blocks of up to [`MANY_BLOCK`] tokens, and in each block every 4 rows
/// run passes of up to [`MANY_PASS`] tokens over the whole row, their weights widened in
/// registers once per pass (from DRAM in the first pass, which alone prefetches the rows
/// ahead, and from L1/L2 after). Same lanes, same order, same bits as [`few_tokens`]. At 16
/// tokens on a Zen 4 host one thread ran at 0.85-0.92 of the FMA peak where the tile loop
/// (each tile widened once into a stack buffer for 16 tokens, every token's lanes kept in
/// memory between tiles) ran at 0.68-0.69 (docs/BENCHMARKS.md, "Many-token bf16 passes").
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn many_tokens(w: &[u8], cols: usize, x: &[f32], t: usize, out: &mut RowsOut<'_>) {
    const R: usize = 4;
    let row_bytes = 2 * cols;
    let rows = out.rows();
    for (b0, bn) in even_runs(t, MANY_BLOCK) {
        let mut r = 0;
        while r < rows {
            let n = if r + R <= rows { R } else { 1 };
            let w_rows = &w[r * row_bytes..(r + n) * row_bytes];
            for (i, (p0, pn)) in even_runs(bn, MANY_PASS).enumerate() {
                let x = &x[(b0 + p0) * cols..(b0 + p0 + pn) * cols];
                let pass = Pass { w: w_rows, cols, x, tokens: pn, ahead: i == 0 };
                if n == R {
                    pass.run::<R>(out, r, b0 + p0);
                } else {
                    pass.run::<1>(out, r, b0 + p0);
                }
            }
            r += n;
        }
    }
}

/// One pass of [`many_tokens`]: rows `w` (exactly `R` of them) against the tokens of `x`.
struct Pass<'a> {
    w: &'a [u8],
    cols: usize,
    /// `[tokens, cols]`.
    x: &'a [f32],
    /// 3 to [`MANY_PASS`].
    tokens: usize,
    /// Whether to prefetch the rows after these (the first pass over them does).
    ahead: bool,
}

impl Pass<'_> {
    /// Runs the pass and writes its outputs: rows `row..row + R`, tokens `token..` of `out`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    fn run<const R: usize>(&self, out: &mut RowsOut<'_>, row: usize, token: usize) {
        // Blocks hold 5 to 16 tokens (`many_tokens` runs at 5 and more, and an even split of
        // more than 16 leaves at least 8), so passes hold 3 to 6.
        assert!((3..=MANY_PASS).contains(&self.tokens), "a pass of {} tokens", self.tokens);
        match self.tokens {
            3 => out.set_block(token, row, self.sums::<R, 3>()),
            4 => out.set_block(token, row, self.sums::<R, 4>()),
            5 => out.set_block(token, row, self.sums::<R, 5>()),
            _ => out.set_block(token, row, self.sums::<R, MANY_PASS>()),
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    fn sums<const R: usize, const T: usize>(&self) -> [[f32; R]; T] {
        rows_dot_tokens::<R, T>(self.w, self.cols, self.x, self.ahead)
    }
}

/// `T` tokens, `2 <= T <= 4` (a small batch step): each chunk of 16 weights is widened once in a
/// register and multiplied with every token there, 4 rows at a time, so the weights stream
/// once at the single-token rate. Every (row, token) keeps its own 16 canonical lanes from zero
/// in increasing column order: the bits of the other paths.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn few_tokens<const T: usize>(w: &[u8], cols: usize, x: &[f32], out: &mut RowsOut<'_>) {
    const R: usize = 4;
    let row_bytes = 2 * cols;
    let rows_of = |r: usize, n: usize| &w[r * row_bytes..(r + n) * row_bytes];
    out.fill_tokens_by_blocks(
        |r| rows_dot_tokens::<R, T>(rows_of(r, R), cols, x, true),
        |r| rows_dot_tokens::<1, T>(rows_of(r, 1), cols, x, true),
    );
}

/// Canonical dots of `R` consecutive rows (`w` holds exactly them) with each of the `T` tokens
/// of `x` (`[T, cols]`): `[token][row]`. With `ahead`, also prefetches the next rows (into L1)
/// and the ones after (into L2).
///
/// The loop reads x and the rows through one pointer each at fixed strides: with a slice per
/// token and per row (2T + 2R pointers and lengths), five and six tokens spilled accumulators
/// to the stack and ran at 0.45 of the FMA peak on a Zen 4 host, below four tokens' 0.6-0.7.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn rows_dot_tokens<const R: usize, const T: usize>(w: &[u8], cols: usize, x: &[f32], ahead: bool) -> [[f32; R]; T] {
    assert_eq!(Some(w.len()), cols.checked_mul(2 * R), "rows_dot_tokens: {R} rows of {cols} bf16");
    assert_eq!(Some(x.len()), cols.checked_mul(T), "rows_dot_tokens: {T} tokens of {cols} floats");
    let row_bytes = 2 * cols;
    let full = cols / LANES;
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut acc = [[_mm512_setzero_ps(); R]; T];
    for c in 0..full {
        if ahead && c % 2 == 0 {
            for i in 0..R {
                prefetch(wp.wrapping_add((R + i) * row_bytes + c * 32));
                prefetch_l2(wp.wrapping_add((L2_AHEAD * R + i) * row_bytes + c * 32));
            }
        }
        let mut xv = [_mm512_setzero_ps(); T];
        for (k, v) in xv.iter_mut().enumerate() {
            // SAFETY: k < T and (c + 1) * LANES <= cols, so the 16 floats from k * cols + c * LANES
            // lie inside x (T * cols floats, checked above); the load is unaligned.
            *v = unsafe { _mm512_loadu_ps(xp.add(k * cols + c * LANES)) };
        }
        for i in 0..R {
            // SAFETY: i < R and (c + 1) * 32 <= row_bytes, so the 32 bytes from
            // i * row_bytes + c * 32 lie inside w (R * row_bytes bytes, checked above).
            let wv = widen16(unsafe { _mm256_loadu_si256(wp.add(i * row_bytes + c * 32).cast()) });
            for (a, v) in acc.iter_mut().zip(&xv) {
                a[i] = _mm512_fmadd_ps(wv, *v, a[i]);
            }
        }
    }
    if !cols.is_multiple_of(LANES) {
        let x_tails: [[f32; LANES]; T] = std::array::from_fn(|k| pad16(&x[k * cols + full * LANES..(k + 1) * cols]));
        for i in 0..R {
            let wv = bf16_tail(&w[i * row_bytes + full * 32..(i + 1) * row_bytes]);
            for (a, xt) in acc.iter_mut().zip(&x_tails) {
                a[i] = _mm512_fmadd_ps(wv, load16z(xt), a[i]);
            }
        }
    }
    let mut sums = [[0.0f32; R]; T];
    for k in 0..T {
        for i in 0..R {
            sums[k][i] = reduce16z(acc[k][i]);
        }
    }
    sums
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn single_token(w: &[u8], cols: usize, x: &[f32], out: &mut RowsOut<'_>) {
    const R: usize = 4;
    let row_bytes = 2 * cols;
    let (x_chunks, x_tail) = x.as_chunks::<LANES>();
    let x_tail = pad16(x_tail);
    let rows_of = |r: usize, n: usize| &w[r * row_bytes..(r + n) * row_bytes];
    out.fill_token0_by_blocks(
        |r| rows_dot::<R>(rows_of(r, R), cols, x_chunks, &x_tail),
        |r| rows_dot::<1>(rows_of(r, 1), cols, x_chunks, &x_tail),
    );
}

/// Canonical dots of `R` consecutive rows (`w` holds exactly them) with one token.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn rows_dot<const R: usize>(w: &[u8], cols: usize, x_chunks: &[[f32; LANES]], x_tail: &[f32; LANES]) -> [f32; R] {
    let row_bytes = 2 * cols;
    let mut chunks: [&[[u8; 32]]; R] = [&[]; R];
    let mut tails: [&[u8]; R] = [&[]; R];
    for i in 0..R {
        let (c, tail) = w[i * row_bytes..][..row_bytes].as_chunks::<32>();
        assert_eq!(c.len(), x_chunks.len(), "rows_dot: row and x disagree");
        chunks[i] = c;
        tails[i] = tail;
    }
    let mut acc = [_mm512_setzero_ps(); R];
    for (c, xc) in x_chunks.iter().enumerate() {
        if c % 2 == 0 {
            // One 64-byte line of each of the next R rows, at this offset.
            for i in 0..R {
                prefetch(w.as_ptr().wrapping_add((R + i) * row_bytes + c * 32));
                prefetch_l2(w.as_ptr().wrapping_add((L2_AHEAD * R + i) * row_bytes + c * 32));
            }
        }
        let xv = load16z(xc);
        for i in 0..R {
            acc[i] = _mm512_fmadd_ps(bf16x16(&chunks[i][c]), xv, acc[i]);
        }
    }
    if !cols.is_multiple_of(LANES) {
        let xv = load16z(x_tail);
        for i in 0..R {
            acc[i] = _mm512_fmadd_ps(bf16_tail(tails[i]), xv, acc[i]);
        }
    }
    let mut sums = [0.0f32; R];
    for i in 0..R {
        sums[i] = reduce16z(acc[i]);
    }
    sums
}

/// Columns per register block of `matvec_t`: 8 zmm accumulators = 8 independent FMA chains.
const MATVEC_T_BLOCK: usize = 128;

/// `out[c] = fma(x[r], W[r, c], out[c])` for r = 0, 1, ..., from +0.0, vectorised across c.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn matvec_t(w: &[u8], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    let row_bytes = 2 * cols;
    let row = |r: usize| &w[r * row_bytes..][..row_bytes];
    let mut c0 = 0;
    while c0 + MATVEC_T_BLOCK <= cols {
        let mut acc = [_mm512_setzero_ps(); MATVEC_T_BLOCK / LANES];
        for (r, &xr) in x.iter().enumerate().take(rows) {
            let xv = _mm512_set1_ps(xr);
            let (chunks, _) = row(r)[2 * c0..][..2 * MATVEC_T_BLOCK].as_chunks::<32>();
            for (a, c) in acc.iter_mut().zip(chunks) {
                *a = _mm512_fmadd_ps(xv, bf16x16(c), *a);
            }
        }
        for (j, a) in acc.iter().enumerate() {
            store_block(&mut out[c0 + LANES * j..c0 + LANES * (j + 1)], *a);
        }
        c0 += MATVEC_T_BLOCK;
    }
    while c0 + LANES <= cols {
        let mut acc = _mm512_setzero_ps();
        for (r, &xr) in x.iter().enumerate().take(rows) {
            let (chunks, _) = row(r)[2 * c0..][..2 * LANES].as_chunks::<32>();
            acc = _mm512_fmadd_ps(_mm512_set1_ps(xr), bf16x16(&chunks[0]), acc);
        }
        store_block(&mut out[c0..c0 + LANES], acc);
        c0 += LANES;
    }
    for (c, o) in out.iter_mut().enumerate().skip(c0) {
        let mut acc = 0.0f32;
        for (r, &xr) in x.iter().enumerate().take(rows) {
            acc = xr.mul_add(super::bf16_at(row(r), c), acc);
        }
        *o = acc;
    }
}

/// Stores 16 floats into a slice of exactly 16.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn store_block(dst: &mut [f32], v: __m512) {
    assert_eq!(dst.len(), LANES, "store_block needs 16 floats");
    // SAFETY: `dst` holds exactly 16 floats (asserted); the store is unaligned.
    unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), v) }
}
