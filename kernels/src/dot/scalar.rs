//! Scalar canonical dot: the definition. [`Lanes`] is shared by every scalar reduction.

/// Lane count of the canonical reduction (one AVX-512 register, two AVX2 registers).
pub(crate) const LANES: usize = 16;

/// The 16 canonical f32 accumulators.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Lanes([f32; LANES]);

impl Lanes {
    /// All lanes +0.0.
    pub(crate) const ZERO: Lanes = Lanes([0.0; LANES]);

    /// `acc[l] = fma(a[l], b[l], acc[l])` for every lane.
    #[inline]
    pub(crate) fn fma(&mut self, a: &[f32; LANES], b: &[f32; LANES]) {
        for ((acc, &av), &bv) in self.0.iter_mut().zip(a).zip(b) {
            *acc = av.mul_add(bv, *acc);
        }
    }

    /// `acc[l] = acc[l] + a[l]`, which is bit-identical to `fma(a[l], 1.0, acc[l])`
    /// (`a * 1` is exact, so both round `a + acc` once).
    #[inline]
    pub(crate) fn add(&mut self, a: &[f32; LANES]) {
        for (acc, &av) in self.0.iter_mut().zip(a) {
            *acc += av;
        }
    }

    /// The fixed tree: for w in [8, 4, 2, 1], `acc[l] += acc[l + w]` for `l < w`; returns acc[0].
    pub(crate) fn reduce(mut self) -> f32 {
        for w in [8, 4, 2, 1] {
            for l in 0..w {
                self.0[l] += self.0[l + w];
            }
        }
        self.0[0]
    }
}

/// A tail shorter than [`LANES`], zero-padded to a full chunk.
#[inline]
pub(crate) fn pad16(tail: &[f32]) -> [f32; LANES] {
    assert!(tail.len() <= LANES, "pad16: tail of {} floats", tail.len());
    let mut chunk = [0.0f32; LANES];
    chunk[..tail.len()].copy_from_slice(tail);
    chunk
}

/// Canonical `dot(a, b)`; `a.len() == b.len()` (checked by the caller).
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let (a_chunks, a_tail) = a.as_chunks::<LANES>();
    let (b_chunks, b_tail) = b.as_chunks::<LANES>();
    let mut acc = Lanes::ZERO;
    for (ac, bc) in a_chunks.iter().zip(b_chunks) {
        acc.fma(ac, bc);
    }
    if !a_tail.is_empty() {
        acc.fma(&pad16(a_tail), &pad16(b_tail));
    }
    acc.reduce()
}

/// Canonical `dot(x, x)`.
pub(crate) fn sum_squares(x: &[f32]) -> f32 {
    dot(x, x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_follow_index_mod_16_and_tree() {
        // Lanes 0 and 8 hold 2^-24 each and lane 4 holds 1.0. The tree gives
        // (2^-24 + 2^-24) + 1.0 = 1 + 2^-23 exactly; a sequential sum would round
        // 2^-24 + 1.0 to 1.0 (tie to even) and end at 1.0.
        let tiny = f32::from_bits(0x3380_0000); // 2^-24
        let mut a = vec![0.0f32; 16];
        a[0] = tiny;
        a[8] = tiny;
        a[4] = 1.0;
        let ones = vec![1.0f32; 16];
        assert_eq!(dot(&a, &ones), 1.0 + 2.0 * tiny);
    }

    #[test]
    fn padding_turns_negative_zero_lane_into_positive_zero() {
        // fma(-1e-30, 1e-30, +0) underflows to -0.0; full-length input has no padding.
        let a = [-1e-30f32];
        let b = [1e-30f32];
        // Lane 0 becomes -0.0, then the padding fma(0, 0, -0.0) = +0.0.
        assert_eq!(dot(&a, &b).to_bits(), 0.0f32.to_bits());
        assert_eq!(dot(&[], &[]).to_bits(), 0.0f32.to_bits());
    }

    #[test]
    fn matches_f64_sum_on_integers() {
        let a: Vec<f32> = (0..70).map(|i| (i % 7) as f32 - 3.0).collect();
        let b: Vec<f32> = (0..70).map(|i| (i % 5) as f32).collect();
        let want: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
        assert_eq!(f64::from(dot(&a, &b)), want);
    }
}
