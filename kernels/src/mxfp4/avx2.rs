//! AVX2+FMA MXFP4 kernel. Same bits as `scalar.rs`.
//!
//! A group of 32 elements (16 packed bytes) is decoded with byte shuffles straight into the f32
//! values of the definition, `(sign * E2M1[mag]) * 2^(s-127)`: `vpshufb` looks each nibble up
//! in the group's scale's byte tables ([`SCALED_BYTES`], the top halves of [`super::SCALED`],
//! whose products are the definition's own f32 multiplication), so overflow (s = 254) and
//! subnormal (s = 0) results are identical too. See [`decode32`]: 12 vector operations per 32
//! weights as compiled. `t == 1` decodes a group as its bytes lie instead ([`decode32_lying`]:
//! 10 operations, 4 of them shuffles) into a fixed permutation of the canonical lanes, with `x`
//! put in the same order once per block of rows, and streams 2 rows at once; `t` of 2 to 4
//! decode each group once into registers for every token; more tokens go through
//! [`crate::tiled`].

use std::arch::x86_64::{
    __m256, __m256i, _mm256_and_si256, _mm256_blend_ps, _mm256_broadcastsi128_si256, _mm256_castsi256_ps,
    _mm256_fmadd_ps, _mm256_permutevar8x32_ps, _mm256_set1_epi32, _mm256_set1_epi8, _mm256_setr_epi32,
    _mm256_setr_epi8, _mm256_setzero_ps, _mm256_shuffle_epi8, _mm256_slli_epi32, _mm256_srli_epi16, _mm256_srlv_epi32,
    _mm256_unpackhi_epi8, _mm256_unpacklo_epi16, _mm256_unpacklo_epi8, _mm_loadu_si128, _mm_prefetch, _MM_HINT_T0,
};

use super::{GROUP, SCALED};
use crate::dot::avx2::{load16, reduce16, store16};
use crate::dot::scalar::LANES;
use crate::out::RowsOut;
use crate::tiled::{self, Source, Tile};

/// Bytes of packed data per group of 32 elements.
pub(super) const GROUP_BYTES: usize = GROUP / 2;

/// The two `vpshufb` tables of one scale byte `s`: bytes 0-15 are byte 2 and bytes 16-31 byte 3
/// of `SCALED[s][n]` (n = 0..16), the f32 value's top half; its low half is zero (test
/// `scaled_table_is_the_products`), so the two bytes are the whole value.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
pub(super) struct ByteTables(pub(super) [u8; 32]);

/// [`ByteTables`] for every scale byte.
pub(super) static SCALED_BYTES: [ByteTables; 256] = scaled_bytes();

const fn scaled_bytes() -> [ByteTables; 256] {
    let mut out = [ByteTables([0; 32]); 256];
    let mut s = 0;
    while s < 256 {
        let mut n = 0;
        while n < 16 {
            let bits = SCALED[s].0[n].to_bits();
            out[s].0[n] = (bits >> 16) as u8;
            out[s].0[16 + n] = (bits >> 24) as u8;
            n += 1;
        }
        s += 1;
    }
    out
}

/// Decodes one group (16 packed bytes, 32 elements, scale byte `scale`) into canonical order:
/// elements 0-7, 8-15, 16-23, 24-31.
///
/// 1. Broadcast the 16 bytes to both lanes and pick, per lane, the bytes whose elements land
///    there: dword `d` of the first pair of outputs holds elements `d` and `8 + d`, so lane 0
///    takes bytes 0,4,1,5 (elements 0-3, 8-11) and 8,12,9,13 (16-19, 24-27), lane 1 the rest.
/// 2. Split nibbles (`& 0xF`, `>> 4 & 0xF`) and interleave them by 16-bit pairs: element `2j`
///    (low nibble of byte `j`) before `2j + 1` (spec §4).
/// 3. `vpshufb` the nibbles in the scale's two byte tables ([`SCALED_BYTES`]): the top two bytes
///    of each decoded f32 value, which interleave into words `[e_d, e_(8+d)]` per dword.
/// 4. `<< 16` and `& 0xFFFF_0000` make the two f32s of each dword: no widening shuffles, no
///    multiplication (the table holds the definition's products).
///
/// 12 vector operations per 32 weights as compiled (LLVM merges the two `& 0xF` into one after
/// the interleave), 6 of them shuffles. The old decoder, a bf16 table widened by unpacks and
/// multiplied by the power of two, took 17, 10 of them shuffles and 4 multiplies.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn decode32(b: &[u8; GROUP_BYTES], scale: u8) -> [__m256; 4] {
    // SAFETY: `b` holds 16 bytes; the load is unaligned.
    let v = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(b.as_ptr().cast()) });
    let pick = _mm256_setr_epi8(
        0, 4, 1, 5, 8, 12, 9, 13, -1, -1, -1, -1, -1, -1, -1, -1, //
        2, 6, 3, 7, 10, 14, 11, 15, -1, -1, -1, -1, -1, -1, -1, -1,
    );
    let picked = _mm256_shuffle_epi8(v, pick);
    let low4 = _mm256_set1_epi8(0x0F);
    let lo = _mm256_and_si256(picked, low4);
    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(picked), low4);
    // Lane 0: elements 0,8,1,9,2,10,3,11, 16,24,...,19,27; lane 1: the same from 4 and 20.
    let nibbles = _mm256_unpacklo_epi16(lo, hi);
    // Dword d: words [e_d, e_(8+d)] (first pair), [e_(16+d), e_(24+d)] (second).
    values_of(nibbles, scale)
}

/// The f32 values of 32 nibbles (one per byte, each lane's bytes as its own lookup indices) of
/// a group with scale byte `scale`: `vpshufb` in the scale's byte tables ([`SCALED_BYTES`])
/// gives each value's top two bytes; the byte unpacks make words, dword `d` of a lane holding
/// the values of its bytes `2d` and `2d + 1` (first pair: bytes 0-7; second: 8-15), and `<< 16`
/// and `& 0xFFFF_0000` make the two f32s of each dword: `[first's even, first's odd, second's
/// even, second's odd]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn values_of(nibbles: __m256i, scale: u8) -> [__m256; 4] {
    let (t2, t3) = SCALED_BYTES[usize::from(scale)].0.split_at(16);
    // SAFETY: each half holds 16 bytes; the loads are unaligned.
    let (t2, t3) = unsafe { (_mm_loadu_si128(t2.as_ptr().cast()), _mm_loadu_si128(t3.as_ptr().cast())) };
    let byte2 = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(t2), nibbles);
    let byte3 = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(t3), nibbles);
    let first = _mm256_unpacklo_epi8(byte2, byte3);
    let second = _mm256_unpackhi_epi8(byte2, byte3);
    let top = _mm256_set1_epi32(0xFFFF_0000_u32 as i32);
    [
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(first)),
        _mm256_castsi256_ps(_mm256_and_si256(first, top)),
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(second)),
        _mm256_castsi256_ps(_mm256_and_si256(second, top)),
    ]
}

/// Hints the cache to fetch the line holding `p`; any address is fine (a prefetch never faults
/// and reads nothing architecturally).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(super) fn prefetch(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T0>(p.cast());
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn matmul(packed: &[u8], scales: &[u8], cols: usize, x: &[f32], t: usize, out: &mut RowsOut<'_>) {
    match t {
        1 => single_token(packed, scales, cols, x, out),
        // 16 ymm registers: 2 per (row, token) accumulator, 4 for the decoded group.
        2 => few_tokens::<2, 2>(packed, scales, cols, x, out),
        3 => few_tokens::<1, 3>(packed, scales, cols, x, out),
        4 => few_tokens::<1, 4>(packed, scales, cols, x, out),
        _ => {
            // SAFETY: this function's target features are AVX2 + FMA.
            unsafe { tiled::multi_token::<tiled::Avx2>(&Source::Mxfp4 { packed, scales }, cols, x, t, out) };
        }
    }
}

/// One token: through [`single_token_lying`] when `x` fits its stack copy (`cols <= 16 * 512`,
/// every K3 product), else in canonical lanes.
#[target_feature(enable = "avx2,fma")]
fn single_token(packed: &[u8], scales: &[u8], cols: usize, x: &[f32], out: &mut RowsOut<'_>) {
    match cols / LANES {
        0..=64 => single_token_lying::<64>(packed, scales, cols, x, out),
        65..=128 => single_token_lying::<128>(packed, scales, cols, x, out),
        129..=256 => single_token_lying::<256>(packed, scales, cols, x, out),
        257..=512 => single_token_lying::<512>(packed, scales, cols, x, out),
        _ => single_token_canonical(packed, scales, cols, x, out),
    }
}

#[target_feature(enable = "avx2,fma")]
fn single_token_canonical(packed: &[u8], scales: &[u8], cols: usize, x: &[f32], out: &mut RowsOut<'_>) {
    const R: usize = 2;
    let (pb, groups) = (cols / 2, cols / GROUP);
    let (x_chunks, _) = x.as_chunks::<LANES>();
    let packed_of = |r: usize, n: usize| &packed[r * pb..(r + n) * pb];
    let scales_of = |r: usize, n: usize| &scales[r * groups..(r + n) * groups];
    out.fill_token0_by_blocks(
        |r| rows_dot::<R, false>(packed_of(r, R), scales_of(r, R), cols, x_chunks),
        |r| rows_dot::<1, false>(packed_of(r, 1), scales_of(r, 1), cols, x_chunks),
    );
}

/// Lane `i` of a chunk in the lying order ([`decode32_lying`]) holds canonical lane
/// `2 (i / 8) + (i % 8) / 4 + 4 (i % 4)`: `[0, 4, 8, 12, 1, 5, 9, 13 | 2, 6, 10, 14, 3, 7, 11, 15]`.
#[cfg_attr(not(test), allow(dead_code))]
const fn lying_lane(i: usize) -> usize {
    2 * (i / 8) + (i % 8) / 4 + 4 * (i % 4)
}

/// The position in the lying order of canonical lane `j` (the inverse of [`lying_lane`]).
const fn lying_position(j: usize) -> usize {
    8 * ((j % 4) / 2) + 4 * (j % 2) + j / 4
}

/// One token, at most `N` chunks of 16 columns (the stack copy of `x` in the lying order is
/// sized by the caller's bucket, so a small product does not clear a large copy).
#[target_feature(enable = "avx2,fma")]
fn single_token_lying<const N: usize>(packed: &[u8], scales: &[u8], cols: usize, x: &[f32], out: &mut RowsOut<'_>) {
    let (pb, groups) = (cols / 2, cols / GROUP);
    let (x_chunks, _) = x.as_chunks::<LANES>();
    let mut xl = [[0.0f32; LANES]; N];
    // Positions 0-7 take canonical lanes 0, 4, 1, 5 of the low half and 8, 12, 9, 13 of the
    // high one (blend mask 0b1100_1100), positions 8-15 the same from 2 and 3 ([`lying_lane`]).
    let first = _mm256_setr_epi32(0, 4, 0, 4, 1, 5, 1, 5);
    let second = _mm256_setr_epi32(2, 6, 2, 6, 3, 7, 3, 7);
    for (l, c) in xl.iter_mut().zip(x_chunks) {
        let (lo, hi) = load16(c);
        let a =
            _mm256_blend_ps::<0b1100_1100>(_mm256_permutevar8x32_ps(lo, first), _mm256_permutevar8x32_ps(hi, first));
        let b =
            _mm256_blend_ps::<0b1100_1100>(_mm256_permutevar8x32_ps(lo, second), _mm256_permutevar8x32_ps(hi, second));
        store16(l, a, b);
    }
    let xl = &xl[..x_chunks.len()];
    let packed_of = |r: usize, n: usize| &packed[r * pb..(r + n) * pb];
    let scales_of = |r: usize, n: usize| &scales[r * groups..(r + n) * groups];
    const R: usize = 2;
    out.fill_token0_by_blocks(
        |r| rows_dot::<R, true>(packed_of(r, R), scales_of(r, R), cols, xl),
        |r| rows_dot::<1, true>(packed_of(r, 1), scales_of(r, 1), cols, xl),
    );
}

/// Decodes one group as its bytes lie: vector 0 holds elements `[0, 4, 8, 12, 1, 5, 9, 13]`,
/// vector 1 `[2, 6, 10, 14, 3, 7, 11, 15]`, vectors 2 and 3 the same plus 16 (the canonical
/// lanes of [`lying_lane`]).
///
/// The 16 bytes go to both lanes; shifting the high lane's dwords right by 4 and `& 0xF` leaves
/// the low nibbles (even elements) in lane 0 and the high ones (odd elements) in lane 1, byte `j`
/// holding element `2j` or `2j + 1` (spec §4). The scale's byte tables ([`SCALED_BYTES`]) give
/// each value's top two bytes, which interleave into words, dword `d` of a lane holding the
/// elements `4d` and `4d + 2` of its parity; `<< 16` and `& 0xFFFF_0000` make the f32s. 10
/// vector operations per 32 weights, 4 of them shuffles: [`decode32`]'s pick and word unpack
/// are gone, and `x` is put in this order instead, once per block of rows.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn decode32_lying(b: &[u8; GROUP_BYTES], scale: u8) -> [__m256; 4] {
    // SAFETY: `b` holds 16 bytes; the load is unaligned.
    let v = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(b.as_ptr().cast()) });
    let high_lane_by_4 = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    let nibbles = _mm256_and_si256(_mm256_srlv_epi32(v, high_lane_by_4), _mm256_set1_epi8(0x0F));
    values_of(nibbles, scale)
}

/// Canonical dots of `R` consecutive rows with one token: `x_chunks` in canonical lanes, or,
/// when `LYING`, in the lying order of [`decode32_lying`] (each vector lane then still sums its
/// canonical lane's columns from zero in increasing order with FMA, and the lanes are put back
/// in canonical order before the fixed tree).
#[inline]
#[target_feature(enable = "avx2,fma")]
fn rows_dot<const R: usize, const LYING: bool>(
    packed: &[u8],
    scales: &[u8],
    cols: usize,
    x_chunks: &[[f32; LANES]],
) -> [f32; R] {
    let (pb, groups) = (cols / 2, cols / GROUP);
    let mut rows: [&[[u8; GROUP_BYTES]]; R] = [&[]; R];
    let mut srows: [&[u8]; R] = [&[]; R];
    for i in 0..R {
        rows[i] = packed[i * pb..][..pb].as_chunks::<GROUP_BYTES>().0;
        srows[i] = &scales[i * groups..][..groups];
    }
    let mut lo = [_mm256_setzero_ps(); R];
    let mut hi = [_mm256_setzero_ps(); R];
    for g in 0..groups {
        if g % 4 == 0 {
            // The next R rows follow these ones in memory: request their line at this group's
            // offset now, so it arrives while this pair computes. Without it the loop waits on
            // DRAM (measured: 4.3 -> 5.3 GB/s streaming a 46 MB rotation of K3 experts).
            for i in 0..R {
                prefetch(packed.as_ptr().wrapping_add((R + i) * pb + g * GROUP_BYTES));
            }
        }
        let (xl0, xh0) = load16(&x_chunks[2 * g]);
        let (xl1, xh1) = load16(&x_chunks[2 * g + 1]);
        for i in 0..R {
            let [w0, w1, w2, w3] =
                if LYING { decode32_lying(&rows[i][g], srows[i][g]) } else { decode32(&rows[i][g], srows[i][g]) };
            lo[i] = _mm256_fmadd_ps(w0, xl0, lo[i]);
            hi[i] = _mm256_fmadd_ps(w1, xh0, hi[i]);
            lo[i] = _mm256_fmadd_ps(w2, xl1, lo[i]);
            hi[i] = _mm256_fmadd_ps(w3, xh1, hi[i]);
        }
    }
    let mut sums = [0.0f32; R];
    for i in 0..R {
        if LYING {
            let mut lying = [0.0f32; LANES];
            store16(&mut lying, lo[i], hi[i]);
            let canonical: [f32; LANES] = std::array::from_fn(|j| lying[lying_position(j)]);
            (lo[i], hi[i]) = load16(&canonical);
        }
        sums[i] = reduce16(lo[i], hi[i]);
    }
    sums
}

/// `T` tokens, `2 <= T <= 4` (the rows a batch step routes to one expert), `R` rows at a time:
/// each group is decoded once into registers and multiplied with every token there. The tiled
/// path would store the decoded tile and reload it per token, which at so few tokens costs more
/// than the FMAs. Every (row, token) keeps its own 16 canonical lanes from zero in increasing
/// column order, so the bits are those of the single-token and tiled paths.
#[target_feature(enable = "avx2,fma")]
fn few_tokens<const R: usize, const T: usize>(
    packed: &[u8],
    scales: &[u8],
    cols: usize,
    x: &[f32],
    out: &mut RowsOut<'_>,
) {
    let (pb, groups) = (cols / 2, cols / GROUP);
    let x_chunks: [&[[f32; LANES]]; T] = std::array::from_fn(|k| x[k * cols..][..cols].as_chunks::<LANES>().0);
    let packed_of = |r: usize, n: usize| &packed[r * pb..(r + n) * pb];
    let scales_of = |r: usize, n: usize| &scales[r * groups..(r + n) * groups];
    out.fill_tokens_by_blocks(
        |r| rows_dot_tokens::<R, T>(packed_of(r, R), scales_of(r, R), cols, &x_chunks),
        |r| rows_dot_tokens::<1, T>(packed_of(r, 1), scales_of(r, 1), cols, &x_chunks),
    );
}

/// Canonical dots of `R` consecutive rows with each of `T` tokens: `[token][row]`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn rows_dot_tokens<const R: usize, const T: usize>(
    packed: &[u8],
    scales: &[u8],
    cols: usize,
    x_chunks: &[&[[f32; LANES]]; T],
) -> [[f32; R]; T] {
    let (pb, groups) = (cols / 2, cols / GROUP);
    let mut rows: [&[[u8; GROUP_BYTES]]; R] = [&[]; R];
    let mut srows: [&[u8]; R] = [&[]; R];
    for i in 0..R {
        rows[i] = packed[i * pb..][..pb].as_chunks::<GROUP_BYTES>().0;
        srows[i] = &scales[i * groups..][..groups];
    }
    let mut lo = [[_mm256_setzero_ps(); R]; T];
    let mut hi = [[_mm256_setzero_ps(); R]; T];
    for g in 0..groups {
        if g % 4 == 0 {
            for i in 0..R {
                prefetch(packed.as_ptr().wrapping_add((R + i) * pb + g * GROUP_BYTES));
            }
        }
        for i in 0..R {
            let [w0, w1, w2, w3] = decode32(&rows[i][g], srows[i][g]);
            for k in 0..T {
                let (xl0, xh0) = load16(&x_chunks[k][2 * g]);
                let (xl1, xh1) = load16(&x_chunks[k][2 * g + 1]);
                lo[k][i] = _mm256_fmadd_ps(w0, xl0, lo[k][i]);
                hi[k][i] = _mm256_fmadd_ps(w1, xh0, hi[k][i]);
                lo[k][i] = _mm256_fmadd_ps(w2, xl1, lo[k][i]);
                hi[k][i] = _mm256_fmadd_ps(w3, xh1, hi[k][i]);
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

/// Decodes columns `c0..c0 + cn` of one row into `dst`; `c0` and `cn` are multiples of 32 and
/// `cn <= TILE_COLS`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn decode_segment(packed_row: &[u8], scale_row: &[u8], c0: usize, cn: usize, dst: &mut Tile) {
    let (g0, gn) = (c0 / GROUP, cn / GROUP);
    let (groups, _) = packed_row[g0 * GROUP_BYTES..(g0 + gn) * GROUP_BYTES].as_chunks::<GROUP_BYTES>();
    for (k, (group, &scale)) in groups.iter().zip(&scale_row[g0..g0 + gn]).enumerate() {
        let [w0, w1, w2, w3] = decode32(group, scale);
        store16(&mut dst[2 * k], w0, w1);
        store16(&mut dst[2 * k + 1], w2, w3);
    }
}

#[cfg(test)]
mod tests {
    use super::SCALED_BYTES;
    use crate::mxfp4::SCALED;

    #[test]
    fn lying_positions_invert_lying_lanes() {
        let lanes: Vec<usize> = (0..16).map(super::lying_lane).collect();
        assert_eq!(lanes, [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15]);
        for j in 0..16 {
            assert_eq!(super::lying_lane(super::lying_position(j)), j);
        }
    }

    #[test]
    fn byte_tables_are_the_top_halves_of_the_scaled_values() {
        for (s, (bytes, values)) in SCALED_BYTES.iter().zip(&SCALED).enumerate() {
            for (n, v) in values.0.iter().enumerate() {
                let bits = u32::from(u16::from_le_bytes([bytes.0[n], bytes.0[16 + n]])) << 16;
                assert_eq!(bits, v.to_bits(), "scale {s}, nibble {n}");
            }
        }
    }
}
