//! Twins of MXFP4 matmul.

use super::*;

/// Every ISA's kernels, and on AVX2 also with the one-token kernel this CPU did not choose: the
/// twins cover both [`Avx2Mxfp4`] kernels on any AVX2 host.
fn mxfp4_kernels() -> Vec<Kernels> {
    let mut ks = all_kernels();
    for k in ks.clone() {
        if let Some(v) = k.avx2_mxfp4() {
            let other = if v == Avx2Mxfp4::Xmm { Avx2Mxfp4::Ymm } else { Avx2Mxfp4::Xmm };
            ks.push(k.with_avx2_mxfp4(other));
        }
    }
    ks
}

#[allow(clippy::too_many_arguments)]
fn run_mxfp4(
    k: &Kernels,
    par: bool,
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    t: usize,
) -> Result<Vec<f32>, KernelError> {
    let mut y = vec![f32::NAN; t * rows];
    if par {
        k.par_matmul_mxfp4(packed, scales, rows, cols, x, t, &mut y)?;
    } else {
        k.matmul_mxfp4(packed, scales, rows, cols, x, t, &mut y)?;
    }
    Ok(y)
}

/// Random packed bytes (every nibble value) and scales: around 127, plus the edge scales
/// 0, 1, 127 and 254 (254 makes +-inf weights from magnitudes 2, 3, 4 and 6).
fn mxfp4_data(rng: &mut Rng, rows: usize, cols: usize, edge_scales: bool) -> (Vec<u8>, Vec<u8>) {
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.byte()).collect();
    let scales: Vec<u8> = (0..rows * cols / 32)
        .map(|_| {
            if edge_scales && rng.below(3) == 0 {
                [0u8, 1, 127, 254][rng.below(4)]
            } else {
                117 + rng.below(20) as u8
            }
        })
        .collect();
    (packed, scales)
}

#[test]
fn matmul_mxfp4_twins_unaligned() {
    let mut rng = Rng::new(6);
    let s = scalar();
    for k in mxfp4_kernels() {
        for cols in [32usize, 64, 96, 256, 288, 512, 544] {
            for rows in [1usize, 2, 3, 4, 5, 9, 65] {
                for t in [1usize, 2, 3, 4, 5, 10, 12, 17] {
                    for edge in [false, true] {
                        let (packed, scales) = mxfp4_data(&mut rng, rows, cols, edge);
                        let x = if edge { rng.specials(t * cols) } else { rng.adversarials(t * cols) };
                        let (pbuf, poff) = unaligned(&packed);
                        let (sbuf, soff) = unaligned(&scales);
                        let p_odd = &pbuf[poff..poff + packed.len()];
                        let s_odd = &sbuf[soff..soff + scales.len()];
                        let want = run_mxfp4(&s, false, &packed, &scales, rows, cols, &x, t).unwrap();
                        let got = run_mxfp4(&k, false, p_odd, s_odd, rows, cols, &x, t).unwrap();
                        assert_bits(&format!("{:?} {rows}x{cols} t={t} edge={edge}", k), &want, &got);
                    }
                }
            }
        }
        // One K3 expert row block.
        let (rows, cols) = (64, 3584);
        let (packed, scales) = mxfp4_data(&mut rng, rows, cols, false);
        let x = rng.normals(16 * cols, 1.0);
        for t in [1, 2, 3, 4, 16] {
            let want = run_mxfp4(&s, false, &packed, &scales, rows, cols, &x[..t * cols], t).unwrap();
            let got = run_mxfp4(&k, false, &packed, &scales, rows, cols, &x[..t * cols], t).unwrap();
            assert_bits(&format!("{:?} K3 block t={t}", k), &want, &got);
        }
    }
}

#[test]
fn matmul_mxfp4_one_and_few_tokens_at_every_width() {
    // Both AVX2 one-token kernels copy x to the stack in buckets of 64, 128, 256 and 512 chunks
    // of 16 columns (the 128-bit one transposed, the 256-bit one in the order its bytes lie) and
    // hand wider rows to the 256-bit canonical loop: both sides of each edge, and the few-token
    // loops (2 to 4 tokens) at the same widths. Ordinary scales and values: over so many
    // columns the edge ones make most sums infinite or NaN, which would hide a wrong lane.
    let mut rng = Rng::new(61);
    let s = scalar();
    for k in mxfp4_kernels() {
        for cols in [1024usize, 1056, 2048, 2080, 4096, 4128, 8192, 8224] {
            let rows = 3;
            let (packed, scales) = mxfp4_data(&mut rng, rows, cols, false);
            for t in 1..=4 {
                let x = rng.normals(cols * t, 1.0);
                let want = run_mxfp4(&s, false, &packed, &scales, rows, cols, &x, t).unwrap();
                let got = run_mxfp4(&k, false, &packed, &scales, rows, cols, &x, t).unwrap();
                assert_bits(&format!("{k:?} 3x{cols} t={t}"), &want, &got);
            }
        }
    }
}

#[test]
fn matmul_mxfp4_batch_and_thread_invariance() {
    let mut rng = Rng::new(7);
    let pools = [pool(1), pool(2), pool(3)];
    for k in mxfp4_kernels() {
        for (rows, cols) in [(5usize, 32usize), (9, 288), (130, 64), (3, 544)] {
            for t in [2usize, 3, 4, 5, 6, 7, 9, 13, 16, 17, 22] {
                let (packed, scales) = mxfp4_data(&mut rng, rows, cols, true);
                let x = rng.adversarials(t * cols);
                let batched = run_mxfp4(&k, false, &packed, &scales, rows, cols, &x, t).unwrap();
                for tok in 0..t {
                    let xt = &x[tok * cols..][..cols];
                    let single = run_mxfp4(&k, false, &packed, &scales, rows, cols, xt, 1).unwrap();
                    let ctx = format!("{:?} {rows}x{cols} t={t} tok={tok}", k);
                    assert_bits_strict(&ctx, &single, &batched[tok * rows..][..rows]);
                }
                for p in &pools {
                    let par = p.install(|| run_mxfp4(&k, true, &packed, &scales, rows, cols, &x, t)).unwrap();
                    let ctx = format!("{:?} {rows}x{cols} t={t} threads={}", k, p.current_num_threads());
                    assert_bits_strict(&ctx, &batched, &par);
                }
            }
        }
    }
}

/// A row of `cols` zeros except `nibble` at element `pos`, scale `scale` everywhere.
fn one_element_row(cols: usize, pos: usize, nibble: u8, scale: u8) -> (Vec<u8>, Vec<u8>) {
    let mut packed = vec![0u8; cols / 2];
    packed[pos / 2] = if pos.is_multiple_of(2) { nibble } else { nibble << 4 };
    (packed, vec![scale; cols / 32])
}

#[test]
fn mxfp4_every_nibble_at_every_position() {
    // y = W e_pos extracts element `pos` exactly: for a nonzero weight w, fma(w, 1, 0) = w and
    // the other lanes and elements add zeros. Zero magnitudes give +0.
    let cols = 64;
    for k in mxfp4_kernels() {
        for scale in [0u8, 1, 127, 254] {
            for pos in 0..cols {
                for nibble in 0..16u8 {
                    let (packed, scales) = one_element_row(cols, pos, nibble, scale);
                    let mut x = vec![0.0f32; 4 * cols];
                    for tok in 0..4 {
                        x[tok * cols + pos] = 1.0;
                    }
                    let value = mxfp4_value(nibble, scale).unwrap();
                    let want = if value == 0.0 { 0.0 } else { value };
                    let ctx = format!("{:?} scale={scale} pos={pos} nibble={nibble:#x}", k);
                    for t in [1usize, 2, 3, 4] {
                        let y = run_mxfp4(&k, false, &packed, &scales, 1, cols, &x[..t * cols], t).unwrap();
                        assert_bits_strict(&ctx, &vec![want; t], &y);
                    }
                }
            }
        }
    }
}

#[test]
fn mxfp4_nibble_order_low_first() {
    // Packed byte 0x21 at column pair 0: element 0 = low nibble 1 = 0.5, element 1 = high
    // nibble 2 = 1.0 (scale 127). With x = [1, 1000, 0, ...] the row gives 0.5 + 1000 = 1000.5;
    // the swapped order would give 1.0 + 500 = 501.
    let cols = 32;
    let mut packed = vec![0u8; cols / 2];
    packed[0] = 0x21;
    let scales = vec![127u8; 1];
    let mut x = vec![0.0f32; cols];
    x[0] = 1.0;
    x[1] = 1000.0;
    for k in mxfp4_kernels() {
        let y = run_mxfp4(&k, false, &packed, &scales, 1, cols, &x, 1).unwrap();
        assert_eq!(y, [1000.5], "{:?}", k);
    }
    assert_eq!(mxfp4_value(0x21 & 0xF, 127), Some(0.5));
    assert_eq!(mxfp4_value(0x21 >> 4, 127), Some(1.0));
}

#[test]
fn mxfp4_scale_applies_per_group_of_32() {
    // Element c uses scale[c / 32]: put magnitude 1.0 (nibble 2) everywhere and scales
    // 127 (x1) then 130 (x8); x = 1 everywhere: 32 * 1 + 32 * 8 = 288.
    let cols = 64;
    let packed = vec![0x22u8; cols / 2];
    let scales = vec![127u8, 130];
    let x = vec![1.0f32; cols];
    for k in mxfp4_kernels() {
        let y = run_mxfp4(&k, false, &packed, &scales, 1, cols, &x, 1).unwrap();
        assert_eq!(y, [288.0], "{:?}", k);
    }
}

#[test]
fn mxfp4_bad_scale_reports_first_in_row_major_order() {
    let mut rng = Rng::new(8);
    let pools = [pool(1), pool(2), pool(3)];
    let (rows, cols) = (200usize, 64usize);
    // (bad (row, group) positions, the one reported).
    type Case = (&'static [(usize, usize)], (usize, usize));
    let cases: [Case; 4] = [
        (&[(3, 1)], (3, 1)),
        (&[(150, 0), (70, 1)], (70, 1)),
        (&[(199, 1), (199, 0)], (199, 0)),
        (&[(0, 0), (64, 0), (128, 1)], (0, 0)),
    ];
    for k in mxfp4_kernels() {
        for (bad, (row, group)) in cases {
            let (packed, mut scales) = mxfp4_data(&mut rng, rows, cols, false);
            for &(r, g) in bad {
                scales[r * (cols / 32) + g] = 0xFF;
            }
            let want = KernelError::BadScale { row, group };
            for t in [1, 3] {
                let x = rng.normals(t * cols, 1.0);
                let err = run_mxfp4(&k, false, &packed, &scales, rows, cols, &x, t).unwrap_err();
                assert_eq!(err, want, "{:?} serial t={t}", k);
                for p in &pools {
                    let err = p.install(|| run_mxfp4(&k, true, &packed, &scales, rows, cols, &x, t)).unwrap_err();
                    assert_eq!(err, want, "{:?} par threads={} t={t}", k, p.current_num_threads());
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "not a multiple of 32")]
fn mxfp4_cols_must_be_multiple_of_32() {
    let k = Kernels::detect();
    let mut y = [0.0f32; 1];
    let _ = k.matmul_mxfp4(&[0u8; 8], &[127u8; 1], 1, 16, &[0.0; 16], 1, &mut y);
}

/// The `_busy` entry points (attribution, issue 19) compute the same bits as the plain ones,
/// and count some busy time for every product.
#[test]
fn busy_variants_give_the_same_bits_and_count_time() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let mut rng = Rng::new(19);
    let pools = [pool(1), pool(2), pool(3)];
    for k in mxfp4_kernels() {
        for p in &pools {
            let (rows, cols, t) = (130usize, 288usize, 2usize);
            let (packed, scales) = mxfp4_data(&mut rng, rows, cols, false);
            let x = rng.adversarials(t * cols);
            let want = p.install(|| run_mxfp4(&k, true, &packed, &scales, rows, cols, &x, t)).unwrap();
            let (busy, mut got) = (AtomicU64::new(0), vec![f32::NAN; t * rows]);
            p.install(|| k.par_matmul_mxfp4_busy(&packed, &scales, rows, cols, &x, t, &mut got, &busy)).unwrap();
            let ctx = format!("{:?} mxfp4 threads={}", k, p.current_num_threads());
            assert_bits_strict(&ctx, &want, &got);
            assert!(busy.load(Ordering::Relaxed) > 0, "{ctx}: no busy time counted");
            let w = rng.bf16_bytes(rows * cols, false);
            let mut want = vec![f32::NAN; t * rows];
            p.install(|| k.par_matmul_bf16(&w, rows, cols, &x, t, &mut want));
            let (busy, mut got) = (AtomicU64::new(0), vec![f32::NAN; t * rows]);
            p.install(|| k.par_matmul_bf16_busy(&w, rows, cols, &x, t, &mut got, &busy));
            assert_bits_strict(&format!("{ctx} bf16"), &want, &got);
            assert!(busy.load(Ordering::Relaxed) > 0, "{ctx} bf16: no busy time counted");
        }
    }
}

/// The watched product (an expert's checksum hashed as it is read) gives the plain product's
/// bits and error for any thread count, and tells its watch of every row once, in blocks of
/// `ROWS_PER_BLOCK` rows (the plain split), each on the thread that computed it, even when a
/// block fails.
#[test]
fn watched_products_give_the_plain_bits_and_show_every_row_once() {
    use std::sync::Mutex;
    let mut rng = Rng::new(41);
    let pools = [pool(1), pool(2), pool(3)];
    let (rows, cols) = (300usize, 96usize);
    for k in mxfp4_kernels() {
        for t in [1usize, 3] {
            let (packed, mut scales) = mxfp4_data(&mut rng, rows, cols, true);
            let x = rng.adversarials(t * cols);
            let want = run_mxfp4(&k, false, &packed, &scales, rows, cols, &x, t).unwrap();
            let watched = |p: &rayon::ThreadPool, scales: &[u8], y: &mut [f32]| {
                let seen = Mutex::new(Vec::new());
                let watch = |r: std::ops::Range<usize>| {
                    // The block's rows were computed on this thread: it is one of the pool's.
                    assert!(rayon::current_thread_index().is_some());
                    seen.lock().unwrap().push(r);
                };
                let res = p.install(|| k.par_matmul_mxfp4_watched(&packed, scales, rows, cols, &x, t, y, None, &watch));
                let mut seen = seen.into_inner().unwrap();
                seen.sort_by_key(|r| r.start);
                (res, seen)
            };
            let blocks: Vec<std::ops::Range<usize>> = (0..rows)
                .step_by(kernels::ROWS_PER_BLOCK)
                .map(|r| r..(r + kernels::ROWS_PER_BLOCK).min(rows))
                .collect();
            for p in &pools {
                let ctx = format!("{k:?} t={t} threads={}", p.current_num_threads());
                let mut got = vec![f32::NAN; t * rows];
                let (res, seen) = watched(p, &scales, &mut got);
                res.unwrap();
                assert_bits_strict(&ctx, &want, &got);
                assert_eq!(seen, blocks, "{ctx}");
            }
            // A bad scale: the plain product's error (the lowest row's), every block watched.
            scales[170 * (cols / 32) + 2] = 0xFF;
            scales[260 * (cols / 32)] = 0xFF;
            let want = run_mxfp4(&k, false, &packed, &scales, rows, cols, &x, t).unwrap_err();
            for p in &pools {
                let mut got = vec![f32::NAN; t * rows];
                let (res, seen) = watched(p, &scales, &mut got);
                assert_eq!(res.unwrap_err(), want, "{k:?} t={t}");
                assert_eq!(seen, blocks, "{k:?} t={t}: every block runs and is watched");
            }
        }
    }
}
