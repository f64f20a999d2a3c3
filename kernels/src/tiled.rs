//! Multi-token matmul driver (more than four tokens) of the AVX2 bf16 and MXFP4 kernels; the
//! ISA supplies only the decode and the tile FMAs ([`TileIsa`]). The AVX-512 kernels run passes
//! of their few-token kernels instead, faster at every count measured (docs/BENCHMARKS.md,
//! "MXFP4 beyond four tokens" and "Many-token bf16 passes").
//!
//! Each weight is decoded once per block of up to [`TOKENS`] tokens: a tile of [`ROWS`] rows x
//! [`TILE_COLS`] columns is decoded to f32 on the stack, then every token of the block runs its
//! FMAs over the tile. Each (token, row) keeps its 16 canonical lanes in a buffer between
//! tiles, so the per-lane FMA order is exactly the canonical one (increasing column) and the
//! result is bit-identical to the single-token and scalar paths. Memory: 84 KiB of stack
//! (4 KiB of decoded tiles, 16 KiB of staged x, 64 KiB of lanes) and no heap allocation; rayon's
//! default 2 MiB worker stacks hold it easily.

use std::arch::x86_64::{_mm256_fmadd_ps, _mm256_setzero_ps};

use crate::dot::avx2::{load16, reduce16, store16};
use crate::dot::scalar::{pad16, LANES};
use crate::mxfp4::GROUP;
use crate::out::RowsOut;

/// Columns per decoded tile; a multiple of [`GROUP`] so MXFP4 tiles hold whole groups.
pub(crate) const TILE_COLS: usize = 256;
/// Rows decoded per tile: 8 ymm accumulators per token.
pub(crate) const ROWS: usize = 4;
/// Tokens sharing one decode of a tile.
pub(crate) const TOKENS: usize = 16;

const _: () = assert!(TILE_COLS.is_multiple_of(GROUP));
const _: () = assert!(TILE_COLS.is_multiple_of(LANES));

/// One decoded row segment: `TILE_COLS` floats as canonical 16-lane chunks.
pub(crate) type Tile = [[f32; LANES]; TILE_COLS / LANES];

/// Cache-line alignment for the stack buffers the inner loop reads: an unaligned 32-byte load
/// that straddles two lines costs two loads, which halves the FMA rate of the tile loop.
#[repr(C, align(64))]
struct Aligned<T>(T);

const _: () = assert!(std::mem::size_of::<Aligned<[Tile; ROWS]>>() == ROWS * TILE_COLS * 4);
const _: () = assert!(std::mem::size_of::<Aligned<[Tile; TOKENS]>>() == TOKENS * TILE_COLS * 4);
const _: () = assert!(std::mem::size_of::<Aligned<Lanes>>() == GROUPS * TOKENS * ROWS * LANES * 4);

/// The weight matrix rows of one block, in their checkpoint format.
pub(crate) enum Source<'a> {
    /// `[rows, cols]` bf16 bytes.
    Bf16 { w: &'a [u8] },
    /// `[rows, cols / 2]` packed nibbles and `[rows, cols / 32]` validated scales.
    Mxfp4 { packed: &'a [u8], scales: &'a [u8] },
}

/// The ISA-specific halves of [`multi_token`].
pub(crate) trait TileIsa {
    /// Decodes columns `c0..c0 + cn` of `row` of `src` into `dst`.
    ///
    /// # Safety
    /// The ISA must be available on this host.
    unsafe fn decode(src: &Source<'_>, row: usize, cols: usize, c0: usize, cn: usize, dst: &mut Tile);

    /// For every token `k < x.len()`: continues the canonical lanes `acc[k][i]` of rows
    /// `i < ROWS` over the first `chunks` chunks of one decoded tile and the token's staged
    /// segment `x[k]`. `x` and `acc` have the same length.
    ///
    /// # Safety
    /// The ISA must be available on this host.
    unsafe fn tile_fma(tiles: &[Tile; ROWS], x: &[Tile], chunks: usize, acc: &mut [TokenLanes]);

    /// The canonical tree over one (token, row)'s 16 lanes.
    ///
    /// # Safety
    /// The ISA must be available on this host.
    unsafe fn reduce(lanes: &[f32; LANES]) -> f32;
}

/// AVX2 + FMA: lanes as two ymm registers.
pub(crate) struct Avx2;

impl TileIsa for Avx2 {
    #[inline(always)]
    unsafe fn decode(src: &Source<'_>, row: usize, cols: usize, c0: usize, cn: usize, dst: &mut Tile) {
        // SAFETY: the caller guarantees AVX2 + FMA.
        unsafe {
            match *src {
                Source::Bf16 { w } => crate::bf16::avx2::decode_segment(bf16_row(w, row, cols), c0, cn, dst),
                Source::Mxfp4 { packed, scales } => {
                    let (p, s) = mxfp4_row(packed, scales, row, cols);
                    crate::mxfp4::avx2::decode_segment(p, s, c0, cn, dst);
                }
            }
        }
    }

    #[inline(always)]
    unsafe fn tile_fma(tiles: &[Tile; ROWS], x: &[Tile], chunks: usize, acc: &mut [TokenLanes]) {
        for (xk, acck) in x.iter().zip(acc) {
            // SAFETY: the caller guarantees AVX2 + FMA.
            unsafe { tile_fma_avx2(tiles, xk, chunks, acck) }
        }
    }

    #[inline(always)]
    unsafe fn reduce(lanes: &[f32; LANES]) -> f32 {
        // SAFETY: the caller guarantees AVX2 + FMA.
        unsafe {
            let (lo, hi) = load16(lanes);
            reduce16(lo, hi)
        }
    }
}

/// Row `row` of a `[rows, cols]` bf16 matrix, as bytes.
#[inline(always)]
fn bf16_row(w: &[u8], row: usize, cols: usize) -> &[u8] {
    &w[row * 2 * cols..][..2 * cols]
}

/// Row `row` of an MXFP4 matrix: its packed bytes and its scales.
#[inline(always)]
fn mxfp4_row<'a>(packed: &'a [u8], scales: &'a [u8], row: usize, cols: usize) -> (&'a [u8], &'a [u8]) {
    let (pb, groups) = (cols / 2, cols / GROUP);
    (&packed[row * pb..][..pb], &scales[row * groups..][..groups])
}

/// Row groups of [`ROWS`] sharing one staged x tile: a whole block of the parallel split
/// (`par::ROWS_PER_BLOCK`), so each tile of x is staged once per block. Staging it twice (8
/// groups, whose lanes fit L1 where 16 groups' do not) ran 10% slower at 16 tokens on a Zen 5
/// host with the AVX-512 tile loop this driver then also ran; its AVX2 path moved bf16 from
/// 0.44-0.46 to 0.49-0.50 of the ymm peak and MXFP4 from 0.63 to 0.60.
const GROUPS: usize = 16;

const _: () = assert!(GROUPS * ROWS == crate::par::ROWS_PER_BLOCK);

/// One token's canonical lanes for the [`ROWS`] rows of a row group.
pub(crate) type TokenLanes = [[f32; LANES]; ROWS];

/// Per (row group, token, row) canonical lanes, kept between tiles. 64 KiB.
type Lanes = [[TokenLanes; TOKENS]; GROUPS];

/// `y[tok, r] = canonical_dot(W[r], x[tok])` for all rows of `out` and all `t` tokens.
///
/// Loop order: blocks of `GROUPS * ROWS` rows, blocks of [`TOKENS`] tokens, tiles of
/// [`TILE_COLS`] columns; per tile the tokens' x segments are copied (zero-padded) into a
/// contiguous stage that stays in L1 while each group of [`ROWS`] rows is decoded and run
/// against every token. Columns are visited in increasing order for every lane.
///
/// # Safety
/// `I`'s ISA must be available on this host.
#[inline(always)]
pub(crate) unsafe fn multi_token<I: TileIsa>(
    src: &Source<'_>,
    cols: usize,
    x: &[f32],
    t: usize,
    out: &mut RowsOut<'_>,
) {
    let rows = out.rows();
    let mut tiles = Aligned([[[0.0f32; LANES]; TILE_COLS / LANES]; ROWS]);
    let mut stage = Aligned([[[0.0f32; LANES]; TILE_COLS / LANES]; TOKENS]);
    let mut lanes = Aligned([[[[0.0f32; LANES]; ROWS]; TOKENS]; GROUPS]);
    let (tiles, stage, lanes) = (&mut tiles.0, &mut stage.0, &mut lanes.0);
    for r0 in (0..rows).step_by(GROUPS * ROWS) {
        let rb = (GROUPS * ROWS).min(rows - r0);
        let groups = rb.div_ceil(ROWS);
        for t0 in (0..t).step_by(TOKENS) {
            let tn = TOKENS.min(t - t0);
            *lanes = [[[[0.0; LANES]; ROWS]; TOKENS]; GROUPS];
            for c0 in (0..cols).step_by(TILE_COLS) {
                let cn = TILE_COLS.min(cols - c0);
                let chunks = cn.div_ceil(LANES);
                for (tt, st) in stage.iter_mut().enumerate().take(tn) {
                    stage_x(&x[(t0 + tt) * cols + c0..][..cn], st);
                }
                for (g, group_lanes) in lanes.iter_mut().enumerate().take(groups) {
                    let rn = ROWS.min(rb - g * ROWS);
                    // Rows past `rn` keep stale tiles; their sums are computed and discarded.
                    for (i, tile) in tiles.iter_mut().enumerate().take(rn) {
                        // SAFETY: forwarded from this function's contract.
                        unsafe { I::decode(src, r0 + g * ROWS + i, cols, c0, cn, tile) };
                    }
                    // SAFETY: forwarded from this function's contract.
                    unsafe { I::tile_fma(tiles, &stage[..tn], chunks, &mut group_lanes[..tn]) };
                }
            }
            for (g, group_lanes) in lanes.iter().enumerate().take(groups) {
                let rn = ROWS.min(rb - g * ROWS);
                for (tt, acc) in group_lanes.iter().enumerate().take(tn) {
                    for (i, lane) in acc.iter().enumerate().take(rn) {
                        // SAFETY: forwarded from this function's contract.
                        out.set(t0 + tt, r0 + g * ROWS + i, unsafe { I::reduce(lane) });
                    }
                }
            }
        }
    }
}

/// Copies one token's segment (`x.len() <= TILE_COLS`) into `dst`, zero-padding the last
/// partial chunk (the canonical padding).
#[inline]
fn stage_x(x: &[f32], dst: &mut Tile) {
    let (chunks, tail) = x.as_chunks::<LANES>();
    dst[..chunks.len()].copy_from_slice(chunks);
    if !tail.is_empty() {
        dst[chunks.len()] = pad16(tail);
    }
}

/// [`TileIsa::tile_fma`] on AVX2: 8 ymm accumulators.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn tile_fma_avx2(tiles: &[Tile; ROWS], x: &Tile, chunks: usize, acc: &mut TokenLanes) {
    let mut lo = [_mm256_setzero_ps(); ROWS];
    let mut hi = [_mm256_setzero_ps(); ROWS];
    for i in 0..ROWS {
        (lo[i], hi[i]) = load16(&acc[i]);
    }
    for (c, xc) in x.iter().enumerate().take(chunks) {
        let (xl, xh) = load16(xc);
        for i in 0..ROWS {
            let (wl, wh) = load16(&tiles[i][c]);
            lo[i] = _mm256_fmadd_ps(wl, xl, lo[i]);
            hi[i] = _mm256_fmadd_ps(wh, xh, hi[i]);
        }
    }
    for i in 0..ROWS {
        store16(&mut acc[i], lo[i], hi[i]);
    }
}
