//! AVX-512 (F + BW + VL) bf16 kernels. Same bits as `scalar.rs`.
//!
//! The 16 canonical lanes are one zmm register: 16 bf16 (32 bytes) become 16 f32 with
//! `vpmovzxwd` + `vpslld 16`. `t == 1` streams 4 rows at once (4 independent FMA chains; the
//! kernel is DRAM-bound) and prefetches the next 4 rows into L1 and the 4 after those into L2,
//! like the AVX2 kernel; `t` of 2 to 4 widen each chunk once for every token; more tokens go
//! through [`crate::tiled`] with [`tiled::Avx512`].

use std::arch::x86_64::{
    __m256i, __m512, _mm256_loadu_si256, _mm512_castsi512_ps, _mm512_cvtepu16_epi32, _mm512_fmadd_ps, _mm512_set1_ps,
    _mm512_setzero_ps, _mm512_slli_epi32, _mm512_storeu_ps, _mm_prefetch, _MM_HINT_T0, _MM_HINT_T1,
};

use crate::dot::avx512::{load16z, reduce16z, store16z};
use crate::dot::scalar::{pad16, LANES};
use crate::out::RowsOut;
use crate::tiled::{self, Source, Tile};

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

/// Hints the cache to fetch the line holding `p`; any address is fine (a prefetch never faults
/// and reads nothing architecturally).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn prefetch(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T0>(p.cast());
}

/// Blocks of `R` rows ahead whose lines a second prefetch asks into L2, beside the next block's
/// into L1. With the next block alone one thread streamed 18-20 GB/s on a Zen 4 host (two:
/// 29-37); with this too, 26-31 (two: 34-39); three or four blocks ahead were slower than two
/// (docs/BENCHMARKS.md, "Prefetch into L2").
const L2_AHEAD: usize = 2;

/// Like [`prefetch`], into L2 only.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn prefetch_l2(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T1>(p.cast());
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn matmul(w: &[u8], cols: usize, x: &[f32], t: usize, out: &mut RowsOut<'_>) {
    match t {
        1 => single_token(w, cols, x, out),
        2 => few_tokens::<2>(w, cols, x, out),
        3 => few_tokens::<3>(w, cols, x, out),
        4 => few_tokens::<4>(w, cols, x, out),
        _ => {
            // SAFETY: this function's target features are AVX-512 F + BW + VL and AVX2 + FMA.
            unsafe { tiled::multi_token::<tiled::Avx512>(&Source::Bf16 { w }, cols, x, t, out) };
        }
    }
}

/// `T` tokens, `2 <= T <= 4` (a small batch step): each chunk of 16 weights is widened once in a
/// register and multiplied with every token there, 4 rows at a time, so the weights stream
/// once at the single-token rate. The tiled path would store the widened tile and reload it
/// per token, which at so few tokens costs more than the FMAs. Every (row, token) keeps its own
/// 16 canonical lanes from zero in increasing column order: the bits of the other paths.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn few_tokens<const T: usize>(w: &[u8], cols: usize, x: &[f32], out: &mut RowsOut<'_>) {
    const R: usize = 4;
    let row_bytes = 2 * cols;
    let x_chunks: [&[[f32; LANES]]; T] = std::array::from_fn(|k| x[k * cols..][..cols].as_chunks::<LANES>().0);
    let x_tails: [[f32; LANES]; T] = std::array::from_fn(|k| pad16(x[k * cols..][..cols].as_chunks::<LANES>().1));
    let rows_of = |r: usize, n: usize| &w[r * row_bytes..(r + n) * row_bytes];
    out.fill_tokens_by_blocks(
        |r| rows_dot_tokens::<R, T>(rows_of(r, R), cols, &x_chunks, &x_tails),
        |r| rows_dot_tokens::<1, T>(rows_of(r, 1), cols, &x_chunks, &x_tails),
    );
}

/// Canonical dots of `R` consecutive rows (`w` holds exactly them) with each of `T` tokens:
/// `[token][row]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn rows_dot_tokens<const R: usize, const T: usize>(
    w: &[u8],
    cols: usize,
    x_chunks: &[&[[f32; LANES]]; T],
    x_tails: &[[f32; LANES]; T],
) -> [[f32; R]; T] {
    let row_bytes = 2 * cols;
    let mut chunks: [&[[u8; 32]]; R] = [&[]; R];
    let mut tails: [&[u8]; R] = [&[]; R];
    for i in 0..R {
        let (c, tail) = w[i * row_bytes..][..row_bytes].as_chunks::<32>();
        assert_eq!(c.len(), x_chunks[0].len(), "rows_dot_tokens: row and x disagree");
        chunks[i] = c;
        tails[i] = tail;
    }
    let mut acc = [[_mm512_setzero_ps(); R]; T];
    for c in 0..chunks[0].len() {
        if c % 2 == 0 {
            for i in 0..R {
                prefetch(w.as_ptr().wrapping_add((R + i) * row_bytes + c * 32));
                prefetch_l2(w.as_ptr().wrapping_add((L2_AHEAD * R + i) * row_bytes + c * 32));
            }
        }
        let mut xv = [_mm512_setzero_ps(); T];
        for k in 0..T {
            xv[k] = load16z(&x_chunks[k][c]);
        }
        for i in 0..R {
            let wv = bf16x16(&chunks[i][c]);
            for k in 0..T {
                acc[k][i] = _mm512_fmadd_ps(wv, xv[k], acc[k][i]);
            }
        }
    }
    if !cols.is_multiple_of(LANES) {
        for i in 0..R {
            let wv = bf16_tail(tails[i]);
            for k in 0..T {
                acc[k][i] = _mm512_fmadd_ps(wv, load16z(&x_tails[k]), acc[k][i]);
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

/// Decodes columns `c0..c0 + cn` of one row (`row` = `2 * cols` bytes) into `dst`, the last
/// partial chunk zero-padded. `cn <= TILE_COLS`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn decode_segment(row: &[u8], c0: usize, cn: usize, dst: &mut Tile) {
    let (chunks, tail) = row[2 * c0..2 * (c0 + cn)].as_chunks::<32>();
    // This row's next segments are decoded after every other row of the block has had its
    // turn (32 rows, each a stream of its own: more than the hardware prefetchers follow);
    // asking for the one after next now hides its latency behind the block's FMAs (one ahead
    // gave 0.35 of the FMA roof at 16 tokens on a Zen 5 host, two 0.36-0.39, four 0.36-0.37,
    // none 0.28-0.29).
    let next = row.as_ptr().wrapping_add(2 * (c0 + 2 * cn));
    let far = row.as_ptr().wrapping_add(2 * (c0 + TILE_L2_AHEAD * cn));
    for line in (0..2 * cn).step_by(64) {
        prefetch(next.wrapping_add(line));
        prefetch_l2(far.wrapping_add(line));
    }
    for (d, c) in dst.iter_mut().zip(chunks) {
        store16z(d, bf16x16(c));
    }
    if !tail.is_empty() {
        store16z(&mut dst[chunks.len()], bf16_tail(tail));
    }
}

/// Segments ahead of the one decoded whose lines `decode_segment` also asks into L2: at 16
/// tokens on a Zen 4 host the tiled product ran 54-68 GFLOP/s on one thread with the L1
/// prefetch alone and 66-80 with this too (two threads 107-126 and 131-154; docs/BENCHMARKS.md,
/// "Prefetch into L2"); six segments ahead did no better than four.
const TILE_L2_AHEAD: usize = 4;

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
