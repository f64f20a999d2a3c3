//! AVX2+FMA bf16 kernels. Same bits as `scalar.rs`.
//!
//! bf16 -> f32 is `vpmovzxwd` (zero-extend 8 u16 to u32) then `vpslld 16`, from unaligned loads.
//! `t == 1` streams 4 rows at once (8 independent FMA chains hide the FMA latency, and the 4
//! rows share each load of x) and prefetches the next 4 rows' lines into L1 (+3-6% measured,
//! the kernel is DRAM-bound) and the 4 after those into L2; `t` of 2 to 4 widen each chunk once
//! for every token; more tokens go through [`crate::tiled`], which decodes each weight once per
//! 16 tokens.

use std::arch::x86_64::{
    __m128i, __m256, _mm256_broadcast_ss, _mm256_castsi256_ps, _mm256_cvtepu16_epi32, _mm256_fmadd_ps,
    _mm256_setzero_ps, _mm256_slli_epi32, _mm256_storeu_ps, _mm_loadu_si128, _mm_prefetch, _MM_HINT_T0, _MM_HINT_T1,
};

use crate::dot::avx2::{load16, reduce16, store16};
use crate::dot::scalar::{pad16, LANES};
use crate::out::RowsOut;
use crate::tiled::{self, Source, Tile};

/// Widens 8 bf16 in a 128-bit register to 8 f32.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn widen8(v: __m128i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)))
}

/// 8 bf16 (16 bytes, any alignment) as f32.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn bf16x8(bytes: &[u8; 16]) -> __m256 {
    // SAFETY: `bytes` holds 16 bytes; `_mm_loadu_si128` reads 16 bytes with no alignment need.
    let v = unsafe { _mm_loadu_si128(bytes.as_ptr().cast()) };
    widen8(v)
}

/// 16 bf16 (32 bytes, any alignment) as canonical lanes (0-7, 8-15).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn bf16x16(bytes: &[u8; 32]) -> (__m256, __m256) {
    let p = bytes.as_ptr();
    // SAFETY: `bytes` holds 32 bytes; the two unaligned 16-byte loads read bytes 0..16, 16..32.
    let (lo, hi) = unsafe { (_mm_loadu_si128(p.cast()), _mm_loadu_si128(p.add(16).cast())) };
    (widen8(lo), widen8(hi))
}

/// Hints the cache to fetch the line holding `p`; any address is fine (a prefetch never faults
/// and reads nothing architecturally).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn prefetch(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T0>(p.cast());
}

/// Blocks of `R` rows ahead whose lines a second prefetch asks into L2, beside the next block's
/// into L1, as the AVX-512 kernel does: this path (`--isa avx2`) on a Zen 4 host streamed
/// 16-19 GB/s on one thread before and 22-25 after (docs/BENCHMARKS.md, "Prefetch into L2");
/// not measured on a Zen 1 host.
const L2_AHEAD: usize = 2;

/// Like [`prefetch`], into L2 only.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn prefetch_l2(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T1>(p.cast());
}

/// A row tail of fewer than 16 bf16, zero-padded.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn bf16_tail(tail: &[u8]) -> (__m256, __m256) {
    let mut padded = [0u8; 32];
    padded[..tail.len()].copy_from_slice(tail);
    bf16x16(&padded)
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn matmul(w: &[u8], cols: usize, x: &[f32], t: usize, out: &mut RowsOut<'_>) {
    match t {
        1 => single_token(w, cols, x, out),
        // 16 ymm registers: 2 per (row, token) accumulator, 2 for the widened chunk.
        2 => few_tokens::<2, 2>(w, cols, x, out),
        3 => few_tokens::<1, 3>(w, cols, x, out),
        4 => few_tokens::<1, 4>(w, cols, x, out),
        _ => {
            // SAFETY: this function's target features are AVX2 + FMA.
            unsafe { tiled::multi_token::<tiled::Avx2>(&Source::Bf16 { w }, cols, x, t, out) };
        }
    }
}

/// `T` tokens, `2 <= T <= 4` (a small batch step), `R` rows at a time: each chunk of 16 weights
/// is widened once in registers and multiplied with every token there, so the weights stream
/// once at the single-token rate. The tiled path would store the widened tile and reload it
/// per token, which at so few tokens costs more than the FMAs. Every (row, token) keeps its own
/// 16 canonical lanes from zero in increasing column order: the bits of the other paths.
#[target_feature(enable = "avx2,fma")]
fn few_tokens<const R: usize, const T: usize>(w: &[u8], cols: usize, x: &[f32], out: &mut RowsOut<'_>) {
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
#[target_feature(enable = "avx2,fma")]
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
    let mut lo = [[_mm256_setzero_ps(); R]; T];
    let mut hi = [[_mm256_setzero_ps(); R]; T];
    for c in 0..chunks[0].len() {
        if c % 2 == 0 {
            for i in 0..R {
                prefetch(w.as_ptr().wrapping_add((R + i) * row_bytes + c * 32));
                prefetch_l2(w.as_ptr().wrapping_add((L2_AHEAD * R + i) * row_bytes + c * 32));
            }
        }
        for i in 0..R {
            let (wl, wh) = bf16x16(&chunks[i][c]);
            for k in 0..T {
                let (xl, xh) = load16(&x_chunks[k][c]);
                lo[k][i] = _mm256_fmadd_ps(wl, xl, lo[k][i]);
                hi[k][i] = _mm256_fmadd_ps(wh, xh, hi[k][i]);
            }
        }
    }
    if !cols.is_multiple_of(LANES) {
        for i in 0..R {
            let (wl, wh) = bf16_tail(tails[i]);
            for k in 0..T {
                let (xl, xh) = load16(&x_tails[k]);
                lo[k][i] = _mm256_fmadd_ps(wl, xl, lo[k][i]);
                hi[k][i] = _mm256_fmadd_ps(wh, xh, hi[k][i]);
            }
        }
    }
    let mut sums = [[0.0f32; R]; T];
    for k in 0..T {
        for i in 0..R {
            sums[k][i] = reduce16(lo[k][i], hi[k][i]);
        }
    }
    sums
}

#[target_feature(enable = "avx2,fma")]
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
#[target_feature(enable = "avx2,fma")]
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
    let mut lo = [_mm256_setzero_ps(); R];
    let mut hi = [_mm256_setzero_ps(); R];
    for (c, xc) in x_chunks.iter().enumerate() {
        if c % 2 == 0 {
            // The next R rows follow these in memory: request their line at this offset now
            // (see the MXFP4 kernel; the hardware prefetcher alone leaves DRAM idle).
            for i in 0..R {
                prefetch(w.as_ptr().wrapping_add((R + i) * row_bytes + c * 32));
                prefetch_l2(w.as_ptr().wrapping_add((L2_AHEAD * R + i) * row_bytes + c * 32));
            }
        }
        let (xl, xh) = load16(xc);
        for i in 0..R {
            let (wl, wh) = bf16x16(&chunks[i][c]);
            lo[i] = _mm256_fmadd_ps(wl, xl, lo[i]);
            hi[i] = _mm256_fmadd_ps(wh, xh, hi[i]);
        }
    }
    if !cols.is_multiple_of(LANES) {
        let (xl, xh) = load16(x_tail);
        for i in 0..R {
            let (wl, wh) = bf16_tail(tails[i]);
            lo[i] = _mm256_fmadd_ps(wl, xl, lo[i]);
            hi[i] = _mm256_fmadd_ps(wh, xh, hi[i]);
        }
    }
    let mut sums = [0.0f32; R];
    for i in 0..R {
        sums[i] = reduce16(lo[i], hi[i]);
    }
    sums
}

/// Decodes columns `c0..c0 + cn` of one row (`row` = `2 * cols` bytes) into `dst`, the last
/// partial chunk zero-padded. `cn <= TILE_COLS`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn decode_segment(row: &[u8], c0: usize, cn: usize, dst: &mut Tile) {
    let (chunks, tail) = row[2 * c0..2 * (c0 + cn)].as_chunks::<32>();
    for (d, c) in dst.iter_mut().zip(chunks) {
        let (lo, hi) = bf16x16(c);
        store16(d, lo, hi);
    }
    if !tail.is_empty() {
        let (lo, hi) = bf16_tail(tail);
        store16(&mut dst[chunks.len()], lo, hi);
    }
}

/// Columns per register block of `matvec_t`: 8 ymm accumulators = 8 independent FMA chains.
const MATVEC_T_BLOCK: usize = 64;

/// `out[c] = fma(x[r], W[r, c], out[c])` for r = 0, 1, ..., from +0.0, vectorised across c.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn matvec_t(w: &[u8], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
    let row_bytes = 2 * cols;
    let row = |r: usize| &w[r * row_bytes..][..row_bytes];
    let mut c0 = 0;
    while c0 + MATVEC_T_BLOCK <= cols {
        let mut acc = [_mm256_setzero_ps(); MATVEC_T_BLOCK / 8];
        for (r, xr) in x.iter().enumerate().take(rows) {
            let xv = _mm256_broadcast_ss(xr);
            let (chunks, _) = row(r)[2 * c0..][..2 * MATVEC_T_BLOCK].as_chunks::<16>();
            for (a, c) in acc.iter_mut().zip(chunks) {
                *a = _mm256_fmadd_ps(xv, bf16x8(c), *a);
            }
        }
        for (j, a) in acc.iter().enumerate() {
            store8(&mut out[c0 + 8 * j..c0 + 8 * j + 8], *a);
        }
        c0 += MATVEC_T_BLOCK;
    }
    while c0 + 8 <= cols {
        let mut acc = _mm256_setzero_ps();
        for (r, xr) in x.iter().enumerate().take(rows) {
            let (chunks, _) = row(r)[2 * c0..][..16].as_chunks::<16>();
            acc = _mm256_fmadd_ps(_mm256_broadcast_ss(xr), bf16x8(&chunks[0]), acc);
        }
        store8(&mut out[c0..c0 + 8], acc);
        c0 += 8;
    }
    for (c, o) in out.iter_mut().enumerate().skip(c0) {
        let mut acc = 0.0f32;
        for (r, &xr) in x.iter().enumerate().take(rows) {
            acc = xr.mul_add(super::bf16_at(row(r), c), acc);
        }
        *o = acc;
    }
}

/// Stores 8 floats into a slice of exactly 8.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn store8(dst: &mut [f32], v: __m256) {
    assert_eq!(dst.len(), 8, "store8 needs 8 floats");
    // SAFETY: `dst` holds exactly 8 floats (asserted); the store is unaligned.
    unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), v) }
}
