//! Twins of `matvec_t`.

use super::*;

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
