//! Twins of elementwise kernels.

use super::*;

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
