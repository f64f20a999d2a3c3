//! AVX-512 (F + BW + VL) MXFP4 kernel. Same bits as `scalar.rs`.
//!
//! 1 to 4 tokens stream 4 rows at once ([`rows_dot`], [`rows_dot_tokens`]): each group's 8-byte
//! halves are broadcast to every qword, shifted so that each lane's nibble sits low, and
//! looked up with `vpermps`, which reads only the low 4 bits of each index, in the group's
//! scale's row of [`super::SCALED`] (the decoded values `(sign * E2M1[mag]) * 2^(s - 127)`,
//! built by the definition's own f32 product, -0.0 for nibble 8 included). The lanes come out
//! in a permuted order, undone once per accumulator; each decoded group serves every token
//! from registers. More tokens run in passes of at most four over each block of rows, or, with
//! [`crate::Avx512Many::Tiles`] from 10 tokens, tiles decoded once into L1
//! ([`crate::tiles512`]).

use std::arch::x86_64::{
    __m512, _mm512_fmadd_ps, _mm512_load_ps, _mm512_loadu_ps, _mm512_permutexvar_ps, _mm512_set1_epi64,
    _mm512_setr_epi32, _mm512_setr_epi64, _mm512_setzero_ps, _mm512_srlv_epi64,
};

use super::{GROUP, SCALED};
use crate::dot::avx512::{prefetch, prefetch_l2, reduce16z};
use crate::dot::scalar::LANES;
use crate::out::{token_passes, RowsOut};
use crate::tiles512::{self, TileRows, TILE_CHUNKS};

/// Bytes of packed data per group of 32 elements.
const GROUP_BYTES: usize = GROUP / 2;

/// Blocks of `R` rows ahead whose lines a second prefetch asks into L2, beside the block after
/// next's into L1: on a Zen 4 host one thread streamed 9.6-12.4 GB/s without it and 10.3-13.9
/// with it (medians 11.3 and 12.3; in L2 14.5 either way), and the expert products of a
/// resident decode 26.3 GB/s against 23.6 (medians of six runs each; docs/BENCHMARKS.md,
/// "Prefetch into L2"). Six and 24 blocks ahead did no better.
const L2_AHEAD: usize = 12;

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn matmul(packed: &[u8], scales: &[u8], cols: usize, x: &[f32], t: usize, out: &mut RowsOut<'_>) {
    match t {
        1 => single_token(packed, scales, cols, x, out),
        2 => few_tokens::<2>(packed, scales, cols, x, out),
        3 => few_tokens::<3>(packed, scales, cols, x, out),
        4 => few_tokens::<4>(packed, scales, cols, x, out),
        // Passes over the block: its weights come from DRAM once and from L2 after, and each
        // group is decoded in registers once per pass. The AVX2 tile loop, which decodes each
        // group once per 16 tokens into a stack tile, ran 5-75% slower at every count from 5 to
        // 256 tokens on a Zen 5 host (docs/BENCHMARKS.md, "MXFP4 beyond four tokens"); on Intel
        // the AVX-512 tiles win from 10 tokens ([`matmul_tiles`]).
        _ => {
            for (t0, n) in token_passes(t) {
                matmul(packed, scales, cols, &x[t0 * cols..(t0 + n) * cols], n, &mut out.tokens_mut(t0, n));
            }
        }
    }
}

/// Fewest tokens [`matmul_tiles`] runs as tiles. A 16-column chunk's decode costs a shift and
/// two shuffles (the lookup and the un-permute) against a bf16 chunk's two operations, and is
/// paid once per block of tokens: on one thread of the
/// Intel host a 3072x3584 product ran at 0.52-0.53 of the FMA peak as tiles and 0.55 as passes
/// at 8 tokens, 0.53-0.54 against 0.52 at 10, 0.60-0.61 against 0.55 at 16.
const TILES_MIN_TOKENS: usize = 10;

/// [`matmul`] with [`tiles512`] from [`TILES_MIN_TOKENS`] tokens ([`crate::Avx512Many::Tiles`]);
/// the rows past the last whole block of 8 run [`matmul`]'s passes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) fn matmul_tiles(packed: &[u8], scales: &[u8], cols: usize, x: &[f32], t: usize, out: &mut RowsOut<'_>) {
    if t < TILES_MIN_TOKENS {
        return matmul(packed, scales, cols, x, t, out);
    }
    let done = tiles512::run(&Mxfp4Rows { packed, scales, cols }, cols, x, t, out);
    if done < out.rows() {
        let (pb, groups) = (cols / 2, cols / GROUP);
        matmul(&packed[done * pb..], &scales[done * groups..], cols, x, t, &mut out.rows_from(done));
    }
}

/// The rows of an MXFP4 matrix for [`tiles512`]: each group decoded as [`rows_dot_tokens`]
/// does, then put back in canonical lane order (the tile's FMAs take x as it is).
struct Mxfp4Rows<'a> {
    /// `[rows, cols / 2]` packed nibbles.
    packed: &'a [u8],
    /// `[rows, cols / 32]` validated scales.
    scales: &'a [u8],
    cols: usize,
}

impl TileRows for Mxfp4Rows<'_> {
    /// The tile's packed bytes (8 a chunk: two lines) and its scales (one line at most).
    const TILE_LINES: usize = TILE_CHUNKS * 8 / 64 + 1;

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    unsafe fn decode(&self, row: usize, c0: usize, dst: &mut [__m512]) {
        let n = dst.len();
        // cols is a multiple of GROUP (checked with the shapes) and TILE_CHUNKS is even, so a
        // tile holds whole groups: chunks 2g and 2g + 1 are group g's halves.
        let (pb, groups) = (self.cols / 2, self.cols / GROUP);
        let (g0, gn) = (c0 / 2, n / 2);
        assert!(c0.is_multiple_of(2) && n.is_multiple_of(2), "mxfp4 tile: chunks {c0}..+{n} split a group");
        let bytes = &self.packed[row * pb + g0 * GROUP_BYTES..][..gn * GROUP_BYTES];
        let scales = &self.scales[row * groups + g0..][..gn];
        let shifts = _mm512_setr_epi64(0, 4, 8, 12, 16, 20, 24, 28);
        let back = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        let (groups_bytes, _) = bytes.as_chunks::<GROUP_BYTES>();
        for ((d, b), &scale) in dst.chunks_exact_mut(2).zip(groups_bytes).zip(scales) {
            let lo = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
            let hi = u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]);
            // SAFETY: a `SCALED` row is 16 floats in an `Aligned64`, 64-byte aligned (checked at
            // compile time in mxfp4/mod.rs), as `_mm512_load_ps` requires.
            let values = unsafe { _mm512_load_ps(SCALED[usize::from(scale)].0.as_ptr()) };
            let w0 = _mm512_permutexvar_ps(_mm512_srlv_epi64(_mm512_set1_epi64(lo as i64), shifts), values);
            let w1 = _mm512_permutexvar_ps(_mm512_srlv_epi64(_mm512_set1_epi64(hi as i64), shifts), values);
            d[0] = _mm512_permutexvar_ps(back, w0);
            d[1] = _mm512_permutexvar_ps(back, w1);
        }
    }

    unsafe fn decode_tail(&self, _row: usize) -> __m512 {
        // The driver asks for a tail only when cols % 16 != 0, and check_shapes asserts
        // cols % 32 == 0 before any kernel runs.
        unreachable!("MXFP4 rows have no tail: cols = {} is a multiple of {GROUP}", self.cols)
    }

    fn tile_line(&self, row: usize, c0: usize, line: usize) -> *const u8 {
        let (pb, groups) = (self.cols / 2, self.cols / GROUP);
        if line + 1 < Self::TILE_LINES {
            self.packed.as_ptr().wrapping_add(row * pb + c0 * 8 + line * 64)
        } else {
            self.scales.as_ptr().wrapping_add(row * groups + c0 / 2)
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn single_token(packed: &[u8], scales: &[u8], cols: usize, x: &[f32], out: &mut RowsOut<'_>) {
    const R: usize = 4;
    let (pb, groups) = (cols / 2, cols / GROUP);
    let packed_of = |r: usize, n: usize| &packed[r * pb..(r + n) * pb];
    let scales_of = |r: usize, n: usize| &scales[r * groups..(r + n) * groups];
    out.fill_token0_by_blocks(
        |r| rows_dot::<R>(packed_of(r, R), scales_of(r, R), cols, x),
        |r| rows_dot::<1>(packed_of(r, 1), scales_of(r, 1), cols, x),
    );
}

/// The one-token decoder's lane order: lane `p` of a decoded 16 holds element `PERM[p]` of its
/// 16 columns (`p / 2 + 8 * (p % 2)`), and so accumulates canonical lane `PERM[p]`.
const PERM: [usize; LANES] = {
    let mut p = [0; LANES];
    let mut i = 0;
    while i < LANES {
        p[i] = i / 2 + 8 * (i % 2);
        i += 1;
    }
    p
};

/// Canonical dots of `R` consecutive rows with one token: the few-token walk at one token
/// (the same decode, prefetch and un-permute; the compiler unrolls its token loops away).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn rows_dot<const R: usize>(packed: &[u8], scales: &[u8], cols: usize, x: &[f32]) -> [f32; R] {
    rows_dot_tokens::<R, 1>(packed, scales, cols, x)[0]
}

/// `t` tokens, `2 <= t <= 4` (the rows a batch step routes to one expert, or one pass of more):
/// each group is decoded once into registers and multiplied with every token there, 4 rows at a
/// time. Every (row, token) keeps its own 16 canonical lanes from zero in increasing column
/// order, so the bits are those of the single-token path and of any split into passes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn few_tokens<const T: usize>(packed: &[u8], scales: &[u8], cols: usize, x: &[f32], out: &mut RowsOut<'_>) {
    const R: usize = 4;
    let (pb, groups) = (cols / 2, cols / GROUP);
    let packed_of = |r: usize, n: usize| &packed[r * pb..(r + n) * pb];
    let scales_of = |r: usize, n: usize| &scales[r * groups..(r + n) * groups];
    out.fill_tokens_by_blocks(
        |r| rows_dot_tokens::<R, T>(packed_of(r, R), scales_of(r, R), cols, x),
        |r| rows_dot_tokens::<1, T>(packed_of(r, 1), scales_of(r, 1), cols, x),
    );
}

/// Canonical dots of `R` consecutive rows (`packed` and `scales` hold exactly them) with each
/// of the `T` tokens of `x` (`[T, cols]`): `[token][row]`.
///
/// Each 8 packed bytes (16 elements; element `e` is bits `4e..4e + 4` of the little-endian
/// u64) are broadcast to every qword straight from memory (a load, no shuffle), and qword `m`
/// is shifted right by `4m`: its low dword then starts with element `m` and its high dword with
/// element `8 + m`, i.e. lane `p` starts with element `PERM[p]`; `vpermps` reads those 4 bits in
/// the scale's row of `SCALED`. 3 vector operations per 16 weights (shift, permute, FMA) instead
/// of 5. Lane `p` receives the columns of canonical lane `PERM[p]` in increasing order, so
/// un-permuting each accumulator once before the tree gives the canonical bits. Every token's
/// x is put in the same order in registers, once per group for the `R` rows (no buffer: the
/// product must not allocate, `tests/alloc`; putting x in that order once per call in a stack
/// buffer was slower by 2-12% at 2 to 16 tokens on a Zen 4 host). The loop reads x, the rows
/// and their scales through one pointer each at fixed strides, as the bf16 one does: with a
/// slice per token and per row (2T + 4R pointers and lengths) one thread streamed 11.2 GB/s at
/// one token and ran 0.54 of the FMA peak at two, against 13.8 and 0.64 (medians of five;
/// docs/BENCHMARKS.md, "Many-token bf16 passes").
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
fn rows_dot_tokens<const R: usize, const T: usize>(
    packed: &[u8],
    scales: &[u8],
    cols: usize,
    x: &[f32],
) -> [[f32; R]; T] {
    let (pb, groups) = (cols / 2, cols / GROUP);
    assert_eq!(Some(packed.len()), pb.checked_mul(R), "rows_dot_tokens: {R} packed rows of {cols} elements");
    assert_eq!(Some(scales.len()), groups.checked_mul(R), "rows_dot_tokens: {R} scale rows of {cols} elements");
    assert_eq!(Some(x.len()), cols.checked_mul(T), "rows_dot_tokens: {T} tokens of {cols} floats");
    let (pp, sp, xp) = (packed.as_ptr(), scales.as_ptr(), x.as_ptr());
    let shifts = _mm512_setr_epi64(0, 4, 8, 12, 16, 20, 24, 28);
    let to_perm = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    debug_assert!((0..LANES).all(|p| PERM[p] == [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15][p]));
    let mut acc = [[_mm512_setzero_ps(); R]; T];
    for g in 0..groups {
        // The block of R rows after the next one, one line per group in address order (a block
        // is R * groups / 4 lines: exactly one per group at R = 4, a few lines past the rows at
        // R = 1, harmless). One block ahead or one line per row every 4 groups was slower, four
        // blocks ahead too (the lines leave L1 before use); see docs/BENCHMARKS.md.
        for k in 0..R.div_ceil(4) {
            prefetch(pp.wrapping_add(2 * R * pb + (g * R.div_ceil(4) + k) * 64));
            prefetch_l2(pp.wrapping_add(L2_AHEAD * R * pb + (g * R.div_ceil(4) + k) * 64));
        }
        let mut x0 = [_mm512_setzero_ps(); T];
        let mut x1 = [_mm512_setzero_ps(); T];
        for (k, (x0, x1)) in x0.iter_mut().zip(&mut x1).enumerate() {
            // SAFETY: k < T and (g + 1) * GROUP <= cols, so the 32 floats from k * cols + g * GROUP
            // lie inside x (T * cols floats, checked above); the loads are unaligned.
            let (lo, hi) = unsafe {
                let p = xp.add(k * cols + g * GROUP);
                (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(LANES)))
            };
            *x0 = _mm512_permutexvar_ps(to_perm, lo);
            *x1 = _mm512_permutexvar_ps(to_perm, hi);
        }
        for i in 0..R {
            // SAFETY: i < R and (g + 1) * GROUP_BYTES <= pb, so the 16 bytes from
            // i * pb + g * GROUP_BYTES lie inside packed (R * pb bytes), and i * groups + g < R *
            // groups, inside scales (both checked above); the reads are unaligned.
            let (b, scale) = unsafe {
                (pp.add(i * pb + g * GROUP_BYTES).cast::<[u8; GROUP_BYTES]>().read_unaligned(), *sp.add(i * groups + g))
            };
            let lo = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]);
            let hi = u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]);
            // SAFETY: a `SCALED` row is 16 floats in an `Aligned64`, 64-byte aligned (checked at
            // compile time in mxfp4/mod.rs), as `_mm512_load_ps` requires.
            let values = unsafe { _mm512_load_ps(SCALED[usize::from(scale)].0.as_ptr()) };
            let w0 = _mm512_permutexvar_ps(_mm512_srlv_epi64(_mm512_set1_epi64(lo as i64), shifts), values);
            let w1 = _mm512_permutexvar_ps(_mm512_srlv_epi64(_mm512_set1_epi64(hi as i64), shifts), values);
            for ((a, x0), x1) in acc.iter_mut().zip(&x0).zip(&x1) {
                a[i] = _mm512_fmadd_ps(w0, *x0, a[i]);
                a[i] = _mm512_fmadd_ps(w1, *x1, a[i]);
            }
        }
    }
    let back = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    let mut sums = [[0.0f32; R]; T];
    for k in 0..T {
        for i in 0..R {
            sums[k][i] = reduce16z(_mm512_permutexvar_ps(back, acc[k][i]));
        }
    }
    sums
}
