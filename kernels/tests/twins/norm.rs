//! Twins of `rmsnorm`, `axpy`, `scale`.

use super::*;

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
