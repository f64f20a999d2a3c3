//! Twins of `dot` and `sum_squares`.

use super::*;

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
