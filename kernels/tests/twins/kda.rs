//! Twins of the KDA step.

use super::*;

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
