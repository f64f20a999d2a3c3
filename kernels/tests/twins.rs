//! Twin tests (house style rule 7): every ISA the host has must give the scalar kernel's bits,
//! on random and adversarial inputs; matmuls must also be batch- and thread-invariant.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{all_kernels, assert_bits, assert_bits_strict, pool, scalar, unaligned, Rng};
use kernels::{mxfp4_value, KernelError, Kernels};

/// Lengths 0..=70 (every residue mod 8 and 16) plus a few long ones.
fn lengths() -> Vec<usize> {
    let mut v: Vec<usize> = (0..=70).collect();
    v.extend([127, 128, 129, 255, 1000, 7168]);
    v
}

#[test]
#[should_panic(expected = "element 1")]
fn comparator_catches_one_ulp() {
    let a = [1.0f32, 2.0];
    let b = [1.0f32, f32::from_bits(2.0f32.to_bits() + 1)];
    assert_bits("one ulp", &a, &b);
}

#[test]
fn with_isa_matches_availability() {
    for isa in kernels::Isa::ALL {
        match Kernels::with_isa(isa) {
            Ok(k) => {
                assert!(isa.is_available());
                assert_eq!(k.isa(), isa);
            }
            Err(e) => {
                assert!(!isa.is_available());
                assert_eq!(e, KernelError::IsaUnavailable(isa));
            }
        }
    }
    assert_eq!(Kernels::detect().isa(), kernels::Isa::best());
    // Shown with --nocapture: the record of which ISAs this run compared against scalar.
    let names: Vec<&str> = kernels::Isa::available().iter().map(|i| i.name()).collect();
    #[allow(clippy::print_stderr)]
    {
        eprintln!("twins cover ISAs: {}", names.join(", "));
    }
}

// ---------------------------------------------------------------- dot, sum_squares

#[test]
fn dot_and_sum_squares_twins() {
    let mut rng = Rng::new(1);
    let s = scalar();
    for k in all_kernels() {
        for n in lengths() {
            for kind in 0..3 {
                let (a, b) = match kind {
                    0 => (rng.normals(n, 1.0), rng.normals(n, 1.0)),
                    1 => (rng.adversarials(n), rng.adversarials(n)),
                    _ => (rng.specials(n), rng.specials(n)),
                };
                let ctx = format!("{:?} n={n} kind={kind}", k.isa());
                assert_bits(&ctx, &[s.dot(&a, &b)], &[k.dot(&a, &b)]);
                assert_bits(&ctx, &[s.sum_squares(&a)], &[k.sum_squares(&a)]);
                assert_bits(&ctx, &[s.dot(&a, &a)], &[k.sum_squares(&a)]);
            }
        }
    }
}

#[test]
fn dot_negative_zero_lanes_and_padding() {
    // Every product underflows to -0.0. With n = 16 there is no padding: all lanes are -0 and
    // the tree keeps -0. With n = 17 the padding turns lanes 1..16 into +0, so the sum is +0.
    for k in all_kernels() {
        for (n, want) in [(16usize, -0.0f32), (32, -0.0), (17, 0.0), (1, 0.0), (15, 0.0)] {
            let a = vec![-1e-30f32; n];
            let b = vec![1e-30f32; n];
            assert_bits(&format!("{:?} n={n}", k.isa()), &[want], &[k.dot(&a, &b)]);
        }
    }
}

#[test]
fn dot_lane_assignment_is_index_mod_16() {
    // Lane 0 gets 1.0 (i = 0) and 2^-24 (i = 16, 32): lane-wise 1 + 2^-24 + 2^-24 rounds to 1 at
    // each step (ties to even). If i = 16 went to another lane, the tree would add
    // 2^-24 + 2^-24 first and produce 1 + 2^-23.
    let tiny = f32::from_bits(0x3380_0000);
    let mut a = vec![0.0f32; 48];
    a[0] = 1.0;
    a[16] = tiny;
    a[32] = tiny;
    let ones = vec![1.0f32; 48];
    for k in all_kernels() {
        assert_eq!(k.dot(&a, &ones), 1.0, "{:?}", k.isa());
    }
}

// ---------------------------------------------------------------- bf16 matmul

/// (rows, cols) pairs: row counts around the 4-row and 64-row blocks, columns around 16 and
/// the 256-column tile.
fn bf16_shapes() -> Vec<(usize, usize)> {
    let mut v = Vec::new();
    for cols in [1, 2, 7, 8, 15, 16, 17, 31, 33, 47, 64, 70, 255, 256, 257, 300, 513] {
        for rows in [1, 3, 4, 5, 9] {
            v.push((rows, cols));
        }
    }
    v.extend([(65, 40), (130, 33), (64, 7168)]);
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
            for t in [1usize, 2, 3, 17] {
                if rows * cols * t > 2_000_000 {
                    continue;
                }
                for specials in [false, true] {
                    let w = rng.bf16_bytes(rows * cols, specials);
                    let x = if specials { rng.specials(t * cols) } else { rng.adversarials(t * cols) };
                    let (buf, off) = unaligned(&w);
                    let w_odd = &buf[off..off + w.len()];
                    let want = run_bf16(&s, false, &w, rows, cols, &x, t);
                    let ctx = format!("{:?} {rows}x{cols} t={t} specials={specials}", k.isa());
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
            for t in [2usize, 5, 16, 17, 33] {
                let w = rng.bf16_bytes(rows * cols, false);
                let x = rng.adversarials(t * cols);
                let batched = run_bf16(&k, false, &w, rows, cols, &x, t);
                for tok in 0..t {
                    let single = run_bf16(&k, false, &w, rows, cols, &x[tok * cols..][..cols], 1);
                    let ctx = format!("{:?} {rows}x{cols} t={t} tok={tok}", k.isa());
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
        for (rows, cols, t) in [(200, 48, 1), (200, 48, 3), (129, 257, 1), (64, 17, 2), (3, 5, 1)] {
            let w = rng.bf16_bytes(rows * cols, false);
            let x = rng.adversarials(t * cols);
            let serial = run_bf16(&k, false, &w, rows, cols, &x, t);
            for p in &pools {
                let par = p.install(|| run_bf16(&k, true, &w, rows, cols, &x, t));
                let ctx = format!("{:?} {rows}x{cols} t={t} threads={}", k.isa(), p.current_num_threads());
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

// ---------------------------------------------------------------- matvec_t

#[test]
fn matvec_t_bf16_twins_unaligned() {
    let mut rng = Rng::new(5);
    let s = scalar();
    for k in all_kernels() {
        let mut shapes: Vec<(usize, usize)> = (1..=70).map(|c| (3, c)).collect();
        // 150 and 271 take a 128-column block, then 16-column blocks, then a per-column tail.
        shapes.extend([(1, 64), (9, 65), (128, 512), (128, 513), (17, 130), (5, 150), (3, 271), (0, 8)]);
        for (rows, cols) in shapes {
            for specials in [false, true] {
                let w = rng.bf16_bytes(rows * cols, specials);
                let x = if specials { rng.specials(rows) } else { rng.adversarials(rows) };
                let (buf, off) = unaligned(&w);
                let mut want = vec![f32::NAN; cols];
                let mut got = vec![f32::NAN; cols];
                s.matvec_t_bf16(&w, rows, cols, &x, &mut want);
                k.matvec_t_bf16(&buf[off..off + w.len()], rows, cols, &x, &mut got);
                assert_bits(&format!("{:?} {rows}x{cols} specials={specials}", k.isa()), &want, &got);
            }
        }
    }
}

// ---------------------------------------------------------------- MXFP4 matmul

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
    for k in all_kernels() {
        for cols in [32usize, 64, 96, 256, 288, 512, 544] {
            for rows in [1usize, 2, 3, 4, 5, 9, 65] {
                for t in [1usize, 2, 5, 17] {
                    for edge in [false, true] {
                        let (packed, scales) = mxfp4_data(&mut rng, rows, cols, edge);
                        let x = if edge { rng.specials(t * cols) } else { rng.adversarials(t * cols) };
                        let (pbuf, poff) = unaligned(&packed);
                        let (sbuf, soff) = unaligned(&scales);
                        let p_odd = &pbuf[poff..poff + packed.len()];
                        let s_odd = &sbuf[soff..soff + scales.len()];
                        let want = run_mxfp4(&s, false, &packed, &scales, rows, cols, &x, t).unwrap();
                        let got = run_mxfp4(&k, false, p_odd, s_odd, rows, cols, &x, t).unwrap();
                        assert_bits(&format!("{:?} {rows}x{cols} t={t} edge={edge}", k.isa()), &want, &got);
                    }
                }
            }
        }
        // One K3 expert row block.
        let (rows, cols) = (64, 3584);
        let (packed, scales) = mxfp4_data(&mut rng, rows, cols, false);
        let x = rng.normals(2 * cols, 1.0);
        for t in [1, 2] {
            let want = run_mxfp4(&s, false, &packed, &scales, rows, cols, &x[..t * cols], t).unwrap();
            let got = run_mxfp4(&k, false, &packed, &scales, rows, cols, &x[..t * cols], t).unwrap();
            assert_bits(&format!("{:?} K3 block t={t}", k.isa()), &want, &got);
        }
    }
}

#[test]
fn matmul_mxfp4_batch_and_thread_invariance() {
    let mut rng = Rng::new(7);
    let pools = [pool(1), pool(2), pool(3)];
    for k in all_kernels() {
        for (rows, cols) in [(5usize, 32usize), (9, 288), (130, 64), (3, 544)] {
            for t in [2usize, 5, 16, 17] {
                let (packed, scales) = mxfp4_data(&mut rng, rows, cols, true);
                let x = rng.adversarials(t * cols);
                let batched = run_mxfp4(&k, false, &packed, &scales, rows, cols, &x, t).unwrap();
                for tok in 0..t {
                    let xt = &x[tok * cols..][..cols];
                    let single = run_mxfp4(&k, false, &packed, &scales, rows, cols, xt, 1).unwrap();
                    let ctx = format!("{:?} {rows}x{cols} t={t} tok={tok}", k.isa());
                    assert_bits_strict(&ctx, &single, &batched[tok * rows..][..rows]);
                }
                for p in &pools {
                    let par = p.install(|| run_mxfp4(&k, true, &packed, &scales, rows, cols, &x, t)).unwrap();
                    let ctx = format!("{:?} {rows}x{cols} t={t} threads={}", k.isa(), p.current_num_threads());
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
    for k in all_kernels() {
        for scale in [0u8, 1, 127, 254] {
            for pos in 0..cols {
                for nibble in 0..16u8 {
                    let (packed, scales) = one_element_row(cols, pos, nibble, scale);
                    let mut x = vec![0.0f32; 2 * cols];
                    x[pos] = 1.0;
                    x[cols + pos] = 1.0;
                    let value = mxfp4_value(nibble, scale).unwrap();
                    let want = if value == 0.0 { 0.0 } else { value };
                    let ctx = format!("{:?} scale={scale} pos={pos} nibble={nibble:#x}", k.isa());
                    for t in [1usize, 2] {
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
    for k in all_kernels() {
        let y = run_mxfp4(&k, false, &packed, &scales, 1, cols, &x, 1).unwrap();
        assert_eq!(y, [1000.5], "{:?}", k.isa());
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
    for k in all_kernels() {
        let y = run_mxfp4(&k, false, &packed, &scales, 1, cols, &x, 1).unwrap();
        assert_eq!(y, [288.0], "{:?}", k.isa());
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
    for k in all_kernels() {
        for (bad, (row, group)) in cases {
            let (packed, mut scales) = mxfp4_data(&mut rng, rows, cols, false);
            for &(r, g) in bad {
                scales[r * (cols / 32) + g] = 0xFF;
            }
            let want = KernelError::BadScale { row, group };
            for t in [1, 3] {
                let x = rng.normals(t * cols, 1.0);
                let err = run_mxfp4(&k, false, &packed, &scales, rows, cols, &x, t).unwrap_err();
                assert_eq!(err, want, "{:?} serial t={t}", k.isa());
                for p in &pools {
                    let err = p.install(|| run_mxfp4(&k, true, &packed, &scales, rows, cols, &x, t)).unwrap_err();
                    assert_eq!(err, want, "{:?} par threads={} t={t}", k.isa(), p.current_num_threads());
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

// ---------------------------------------------------------------- elementwise

/// Values that hit every branch and clamp of exp/tanh/sigmoid: zeros, subnormals, thresholds,
/// overflow and underflow edges, infinities, NaNs with payloads.
fn elementwise_inputs(rng: &mut Rng) -> Vec<f32> {
    let mut v = vec![
        0.0,
        -0.0,
        1e-45,
        -1e-45,
        1e-40,
        -1e-38,
        0.625,
        -0.625,
        0.624_999_94,
        0.625_000_06,
        88.722_83,
        88.722_84,
        88.0,
        89.0,
        100.0,
        -87.336_55,
        -87.4,
        -103.9,
        -103.97,
        -104.0,
        -104.1,
        -200.0,
        44.0,
        45.0,
        -45.0,
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0x7FC1_2345),
        f32::from_bits(0xFFC0_0007),
        f32::from_bits(0x7F80_0001),
    ];
    for i in -2000..=2000 {
        v.push(i as f32 * 0.06);
    }
    for _ in 0..4000 {
        v.push(rng.range(-120.0, 120.0));
        v.push(rng.any_f32());
    }
    v
}

#[test]
fn elementwise_twins() {
    let mut rng = Rng::new(9);
    let inputs = elementwise_inputs(&mut rng);
    let s = scalar();
    type Op = fn(&Kernels, &mut [f32]);
    let ops: [(&str, Op); 4] = [
        ("exp", |k, x| k.exp(x)),
        ("sigmoid", |k, x| k.sigmoid(x)),
        ("tanh", |k, x| k.tanh(x)),
        ("silu", |k, x| k.silu(x)),
    ];
    for k in all_kernels() {
        for (name, op) in ops {
            // Whole input (NaN payloads pass through untouched, so compare strictly).
            let mut want = inputs.clone();
            let mut got = inputs.clone();
            op(&s, &mut want);
            op(&k, &mut got);
            assert_bits_strict(&format!("{:?} {name}", k.isa()), &want, &got);
            // Every short length, at every offset into the inputs (tails of the 8-lane loop).
            for n in 0..=20 {
                let start = rng.below(inputs.len() - n);
                let mut want = inputs[start..start + n].to_vec();
                let mut got = want.clone();
                op(&s, &mut want);
                op(&k, &mut got);
                assert_bits_strict(&format!("{:?} {name} n={n}", k.isa()), &want, &got);
            }
        }
    }
}

#[test]
fn elementwise_twins_strided_bit_patterns() {
    // Every 4099th f32 bit pattern: about a million values of every class.
    let inputs: Vec<f32> = (0..=u32::MAX).step_by(4099).map(f32::from_bits).collect();
    let s = scalar();
    for k in all_kernels() {
        for name in ["exp", "sigmoid", "tanh", "silu"] {
            let mut want = inputs.clone();
            let mut got = inputs.clone();
            for (kk, buf) in [(&s, &mut want), (&k, &mut got)] {
                match name {
                    "exp" => kk.exp(buf),
                    "sigmoid" => kk.sigmoid(buf),
                    "tanh" => kk.tanh(buf),
                    _ => kk.silu(buf),
                }
            }
            assert_bits_strict(&format!("{:?} {name}", k.isa()), &want, &got);
        }
    }
}

#[test]
fn elementwise_nan_passes_through_unchanged() {
    let nans = [f32::from_bits(0x7FC1_2345), f32::from_bits(0xFFC0_0007)];
    for k in all_kernels() {
        for op in [Kernels::exp, Kernels::sigmoid, Kernels::tanh, Kernels::silu] {
            let mut x = nans.to_vec();
            op(&k, &mut x);
            assert_bits_strict(&format!("{:?}", k.isa()), &nans, &x);
        }
    }
}

#[test]
fn situ_glu_twins() {
    let mut rng = Rng::new(10);
    let s = scalar();
    let a_all = elementwise_inputs(&mut rng);
    let b_all: Vec<f32> =
        (0..a_all.len()).map(|i| if i % 3 == 0 { rng.special() } else { rng.range(-300.0, 300.0) }).collect();
    for k in all_kernels() {
        for b2 in [Some(25.0f32), None, Some(1.0)] {
            for b1 in [4.0f32, 0.75] {
                let mut want = vec![0.0f32; a_all.len()];
                let mut got = vec![0.0f32; a_all.len()];
                s.situ_glu(&a_all, &b_all, b1, b2, &mut want);
                k.situ_glu(&a_all, &b_all, b1, b2, &mut got);
                assert_bits(&format!("{:?} b1={b1} b2={b2:?}", k.isa()), &want, &got);
                for n in 0..=20 {
                    let (a, b) = (&a_all[n..2 * n], &b_all[3 * n..4 * n]);
                    let mut want = vec![0.0f32; n];
                    let mut got = vec![0.0f32; n];
                    s.situ_glu(a, b, b1, b2, &mut want);
                    k.situ_glu(a, b, b1, b2, &mut got);
                    assert_bits(&format!("{:?} n={n} b1={b1} b2={b2:?}", k.isa()), &want, &got);
                }
            }
        }
    }
}

// ---------------------------------------------------------------- softmax

#[test]
fn softmax_twins() {
    let mut rng = Rng::new(11);
    let s = scalar();
    for k in all_kernels() {
        for n in lengths() {
            for kind in 0..5 {
                let x: Vec<f32> = match kind {
                    0 => rng.normals(n, 3.0),
                    1 => (0..n).map(|_| rng.range(-100.0, 100.0)).collect(),
                    2 => rng.adversarials(n),
                    // Masked entries.
                    3 => (0..n).map(|i| if i % 3 == 0 { f32::NEG_INFINITY } else { rng.normal(2.0) }).collect(),
                    _ => rng.specials(n),
                };
                let mut want = x.clone();
                let mut got = x.clone();
                s.softmax(&mut want);
                k.softmax(&mut got);
                assert_bits_strict(&format!("{:?} n={n} kind={kind}", k.isa()), &want, &got);
            }
        }
    }
}

#[test]
fn softmax_documented_edge_cases() {
    for k in all_kernels() {
        let isa = k.isa();
        let mut empty: [f32; 0] = [];
        k.softmax(&mut empty);
        let mut with_nan = [1.0, f32::from_bits(0x7FC0_0042), 2.0];
        k.softmax(&mut with_nan);
        assert!(with_nan.iter().all(|v| v.to_bits() == f32::NAN.to_bits()), "{isa:?} {with_nan:?}");
        let mut all_masked = [f32::NEG_INFINITY; 5];
        k.softmax(&mut all_masked);
        assert!(all_masked.iter().all(|v| v.is_nan()), "{isa:?}");
        let mut with_inf = [0.0, f32::INFINITY];
        k.softmax(&mut with_inf);
        assert!(with_inf.iter().all(|v| v.is_nan()), "{isa:?}");
        let mut zeros = [-0.0f32, 0.0, -0.0];
        k.softmax(&mut zeros);
        let third = 1.0f32 / 3.0;
        assert_bits_strict(&format!("{isa:?}"), &[third; 3], &zeros);
        let mut one = [-1e30f32];
        k.softmax(&mut one);
        assert_eq!(one, [1.0], "{isa:?}");
        let mut masked = [f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY, 0.0];
        k.softmax(&mut masked);
        assert_eq!(masked, [0.0, 0.5, 0.0, 0.5], "{isa:?}");
    }
}

// ---------------------------------------------------------------- rmsnorm, axpy, scale

#[test]
fn rmsnorm_twins() {
    let mut rng = Rng::new(12);
    let s = scalar();
    for k in all_kernels() {
        for n in lengths().into_iter().filter(|&n| n > 0) {
            for kind in 0..3 {
                let x = match kind {
                    0 => rng.normals(n, 1.0),
                    1 => rng.adversarials(n),
                    _ => rng.specials(n),
                };
                let w = rng.normals(n, 1.0);
                let wb = rng.bf16_bytes(n, kind == 2);
                let (buf, off) = unaligned(&wb);
                let ctx = format!("{:?} n={n} kind={kind}", k.isa());
                for eps in [1e-5f32, 1e-6] {
                    let (mut want, mut got) = (vec![0.0f32; n], vec![0.0f32; n]);
                    s.rmsnorm(&x, &w, eps, &mut want);
                    k.rmsnorm(&x, &w, eps, &mut got);
                    assert_bits(&ctx, &want, &got);
                    s.rmsnorm_bf16w(&x, &wb, eps, &mut want);
                    k.rmsnorm_bf16w(&x, &buf[off..off + wb.len()], eps, &mut got);
                    assert_bits(&ctx, &want, &got);
                }
            }
        }
    }
}

#[test]
fn rmsnorm_bf16w_equals_f32_weights() {
    let mut rng = Rng::new(13);
    for k in all_kernels() {
        let n = 77;
        let x = rng.normals(n, 2.0);
        let wb = rng.bf16_bytes(n, false);
        let w: Vec<f32> = wb.chunks(2).map(|b| kernels::bf16_to_f32(u16::from_le_bytes([b[0], b[1]]))).collect();
        let (mut a, mut b) = (vec![0.0f32; n], vec![0.0f32; n]);
        k.rmsnorm(&x, &w, 1e-5, &mut a);
        k.rmsnorm_bf16w(&x, &wb, 1e-5, &mut b);
        assert_bits_strict(&format!("{:?}", k.isa()), &a, &b);
    }
}

#[test]
fn axpy_and_scale_twins() {
    let mut rng = Rng::new(14);
    let s = scalar();
    for k in all_kernels() {
        for n in lengths() {
            for a in [0.0f32, -0.0, 1.5, -3e-39, 1e30, f32::INFINITY] {
                let x = rng.adversarials(n);
                let y0 = rng.adversarials(n);
                let (mut want, mut got) = (y0.clone(), y0.clone());
                s.axpy(a, &x, &mut want);
                k.axpy(a, &x, &mut got);
                assert_bits(&format!("{:?} axpy n={n} a={a}", k.isa()), &want, &got);
                let (mut want, mut got) = (x.clone(), x.clone());
                s.scale(a, &mut want);
                k.scale(a, &mut got);
                assert_bits(&format!("{:?} scale n={n} a={a}", k.isa()), &want, &got);
            }
        }
    }
}

// ---------------------------------------------------------------- KDA

#[test]
fn kda_step_twins_over_several_steps() {
    let mut rng = Rng::new(15);
    let s = scalar();
    for k in all_kernels() {
        for (dk, dv) in [(1, 1), (3, 5), (16, 8), (7, 37), (128, 40), (128, 128), (5, 70)] {
            let mut st_want = vec![0.0f32; dk * dv];
            let mut st_got = vec![0.0f32; dk * dv];
            for step in 0..4 {
                let alpha: Vec<f32> = (0..dk).map(|_| rng.range(0.0067, 1.0)).collect();
                let beta = rng.unit();
                let (kv, v, q) = (rng.normals(dk, 0.1), rng.adversarials(dv), rng.normals(dk, 0.1));
                let (mut o_want, mut o_got) = (vec![0.0f32; dv], vec![0.0f32; dv]);
                let mut scratch = vec![f32::NAN; dv + 3];
                s.kda_step(&mut st_want, dk, dv, &alpha, beta, &kv, &v, &q, &mut o_want, &mut scratch);
                k.kda_step(&mut st_got, dk, dv, &alpha, beta, &kv, &v, &q, &mut o_got, &mut scratch);
                let ctx = format!("{:?} dk={dk} dv={dv} step={step}", k.isa());
                assert_bits(&ctx, &o_want, &o_got);
                assert_bits(&ctx, &st_want, &st_got);
            }
        }
    }
}
