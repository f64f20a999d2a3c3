//! Twins of softmax.

use super::*;

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
