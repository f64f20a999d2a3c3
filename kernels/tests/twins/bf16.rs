//! Twins of bf16 matmul.

use super::*;

/// (rows, cols) pairs: row counts around the 4-, 8- and 64-row blocks, columns around 16 and
/// the 256-column tile.
fn bf16_shapes() -> Vec<(usize, usize)> {
    let mut v = Vec::new();
    for cols in [1, 2, 7, 8, 15, 16, 17, 31, 33, 47, 64, 70, 255, 256, 257, 300, 513] {
        for rows in [1, 3, 4, 5, 9] {
            v.push((rows, cols));
        }
    }
    v.extend([(65, 40), (130, 33), (64, 7168), (17, 513), (23, 257), (8, 1030)]);
    v
}

fn run_bf16(k: &Kernels, par: bool, w: &[u8], rows: usize, cols: usize, x: &[f32], t: usize) -> Vec<f32> {
    let mut y = vec![f32::NAN; t * rows];
    if par {
        k.par_matmul_bf16(w, rows, cols, x, t, &mut y);
    } else {
        k.matmul_bf16(w, rows, cols, x, t, &mut y);
    }
    y
}

#[test]
fn matmul_bf16_twins_unaligned() {
    let mut rng = Rng::new(2);
    let s = scalar();
    for k in all_kernels() {
        for (rows, cols) in bf16_shapes() {
            for t in [1usize, 2, 3, 4, 7, 16, 22] {
                if rows * cols * t > 2_000_000 {
                    continue;
                }
                for specials in [false, true] {
                    let w = rng.bf16_bytes(rows * cols, specials);
                    let x = if specials { rng.specials(t * cols) } else { rng.adversarials(t * cols) };
                    let (buf, off) = unaligned(&w);
                    let w_odd = &buf[off..off + w.len()];
                    let want = run_bf16(&s, false, &w, rows, cols, &x, t);
                    let ctx = format!("{k:?} {rows}x{cols} t={t} specials={specials}");
                    assert_bits(&ctx, &want, &run_bf16(&k, false, w_odd, rows, cols, &x, t));
                }
            }
        }
    }
}

#[test]
fn matmul_bf16_batch_invariance() {
    let mut rng = Rng::new(3);
    for k in all_kernels() {
        for (rows, cols) in [(5, 16), (9, 300), (7, 513), (66, 40), (3, 1)] {
            // Batches of 2 to 33 tokens (the few-token loop; blocks and passes of every size on
            // AVX-512: 5, 7 = 4 + 3, 16 = 6 + 5 + 5, 17 = 9 + 8, 22 = 11 + 11, 33 = 3 x 11; the
            // tile loop's splits into 4, 2 and 1 on AVX2) against one token at a time (issue 18:
            // a batch step's rows).
            for t in [2usize, 3, 4, 5, 7, 16, 17, 22, 33] {
                let w = rng.bf16_bytes(rows * cols, false);
                let x = rng.adversarials(t * cols);
                let batched = run_bf16(&k, false, &w, rows, cols, &x, t);
                for tok in 0..t {
                    let single = run_bf16(&k, false, &w, rows, cols, &x[tok * cols..][..cols], 1);
                    let ctx = format!("{k:?} {rows}x{cols} t={t} tok={tok}");
                    assert_bits_strict(&ctx, &single, &batched[tok * rows..][..rows]);
                }
            }
        }
    }
}

#[test]
fn matmul_bf16_thread_invariance() {
    let mut rng = Rng::new(4);
    let pools = [pool(1), pool(2), pool(3)];
    for k in all_kernels() {
        for (rows, cols, t) in [(200, 48, 1), (200, 48, 3), (129, 257, 1), (64, 17, 2), (3, 5, 1), (133, 70, 16)] {
            let w = rng.bf16_bytes(rows * cols, false);
            let x = rng.adversarials(t * cols);
            let serial = run_bf16(&k, false, &w, rows, cols, &x, t);
            for p in &pools {
                let par = p.install(|| run_bf16(&k, true, &w, rows, cols, &x, t));
                let ctx = format!("{k:?} {rows}x{cols} t={t} threads={}", p.current_num_threads());
                assert_bits_strict(&ctx, &serial, &par);
            }
        }
    }
}

#[test]
fn matmul_bf16_exact_small_case() {
    // W = [[1, 2, 3], [-0.5, 0, 256]] in bf16; x = [1, 10, 100].
    let w: Vec<u8> = [0x3F80u16, 0x4000, 0x4040, 0xBF00, 0x0000, 0x4380].iter().flat_map(|b| b.to_le_bytes()).collect();
    for k in all_kernels() {
        let mut y = [0.0f32; 2];
        k.matmul_bf16(&w, 2, 3, &[1.0, 10.0, 100.0], 1, &mut y);
        assert_eq!(y, [321.0, 25599.5], "{:?}", k.isa());
    }
}

#[test]
#[should_panic(expected = "matmul_bf16: x must hold")]
fn matmul_bf16_shape_mismatch_panics() {
    let k = Kernels::detect();
    let mut y = [0.0f32; 2];
    k.matmul_bf16(&[0u8; 12], 2, 3, &[1.0, 2.0], 1, &mut y);
}

/// Rows `r0..r1` of a product from only those rows' weights (weights streamed in row blocks)
/// must be the whole product's bits for those rows, on every ISA, with and without the busy
/// counter, and must leave every other entry of `y` as it was.
#[test]
fn matmul_bf16_rows_equal_the_whole_product() {
    const SENTINEL: u32 = 0x7FC0_1234; // a NaN whose payload no kernel produces
    let mut rng = Rng::new(21);
    let pool = pool(3);
    for k in all_kernels() {
        for (rows, cols) in [(200usize, 33usize), (130, 300), (64, 16), (9, 513), (1, 7)] {
            let w = rng.bf16_bytes(rows * cols, false);
            let row_bytes = 2 * cols;
            for t in [1usize, 2, 3, 4, 5, 16] {
                let x = rng.adversarials(t * cols);
                let mut whole = vec![f32::NAN; t * rows];
                pool.install(|| k.par_matmul_bf16(&w, rows, cols, &x, t, &mut whole));
                let ranges = [(0, rows), (0, rows.min(64)), (5.min(rows), rows.min(70)), (63.min(rows), rows.min(130))];
                let more =
                    [(64.min(rows), rows.min(128)), (rows - 1, rows), (rows / 2, rows / 2), (rows.min(100), rows)];
                for (r0, r1) in ranges.into_iter().chain(more) {
                    for busy in [false, true] {
                        let mut y = vec![f32::from_bits(SENTINEL); t * rows];
                        let part = &w[r0 * row_bytes..r1 * row_bytes];
                        let (buf, off) = unaligned(part);
                        let part = &buf[off..off + part.len()];
                        let counter = std::sync::atomic::AtomicU64::new(0);
                        pool.install(|| {
                            if busy {
                                k.par_matmul_bf16_rows_busy(part, r0..r1, rows, cols, &x, t, &mut y, &counter);
                            } else {
                                k.par_matmul_bf16_rows(part, r0..r1, rows, cols, &x, t, &mut y);
                            }
                        });
                        let ctx = format!("{k:?} {rows}x{cols} t={t} rows {r0}..{r1} busy={busy}");
                        for tok in 0..t {
                            let (got, want) = (&y[tok * rows..(tok + 1) * rows], &whole[tok * rows..(tok + 1) * rows]);
                            assert_bits(&format!("{ctx} tok {tok}"), &want[r0..r1], &got[r0..r1]);
                            let outside = got[..r0].iter().chain(&got[r1..]);
                            assert!(outside.clone().all(|v| v.to_bits() == SENTINEL), "{ctx}: wrote outside its rows");
                        }
                    }
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "must lie within")]
fn matmul_bf16_rows_past_the_product_panics() {
    let k = scalar();
    let mut y = vec![0.0f32; 4];
    k.par_matmul_bf16_rows(&[0u8; 8], 3..5, 4, 2, &[0.0; 2], 1, &mut y);
}
