//! SplitMix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", 2014):
//! the crate's one seeded PRNG. The sampler, the simulated storage, the synthetic checkpoints and
//! the tests all draw from it, so a seed means the same stream everywhere and on every platform.
//!
//! A leaf: it depends on nothing else in the crate. Every seed, including 0, is fine. Changing any
//! constant or operation here changes synthetic checkpoints, sampled tokens and simulator runs,
//! so the first outputs are pinned by a test. The kernels crate cannot depend on this one, so its
//! test helper (`kernels/tests/common/mod.rs`) keeps its own copy, pinned to the same values.

/// The SplitMix64 increment: 2^64 divided by the golden ratio, made odd.
pub const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output function (a variant of MurmurHash3's 64-bit finaliser).
#[inline(always)]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Output `index` (from 0) of the stream seeded with `seed`, without computing the ones before
/// it: equal to the `index + 1`-th [`SplitMix64::next_u64`] of `SplitMix64::new(seed)`. This is
/// what lets synthetic tensors be filled in parallel segments with identical bytes.
#[inline(always)]
pub fn splitmix64_at(seed: u64, index: u64) -> u64 {
    mix64(seed.wrapping_add(index.wrapping_add(1).wrapping_mul(GOLDEN_GAMMA)))
}

/// A sequential SplitMix64 stream.
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub const fn new(seed: u64) -> SplitMix64 {
        SplitMix64 { state: seed }
    }

    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix64(self.state)
    }

    /// Uniform in `[0, 1)` from the top 53 bits of one output.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` by Lemire's multiply-shift (one output per call, no rejection: the bias
    /// is below `n / 2^64`, under 2^-32 for every `n` used in this crate). `n` must be non-zero.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0) has no value to return");
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// A uniform index into a slice of `len` (non-zero) elements, by [`SplitMix64::below`].
    pub fn index(&mut self, len: usize) -> usize {
        self.below(len as u64) as usize
    }

    /// Fisher-Yates, from the last element down, drawing with [`SplitMix64::index`].
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.index(i + 1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference outputs of SplitMix64 seeded with 0 (as in Vigna's `splitmix64.c`).
    const SEED_0: [u64; 4] =
        [0xe220_a839_7b1d_cdaf, 0x6e78_9e6a_a1b9_65f4, 0x06c4_5d18_8009_454f, 0xf88b_b8a8_724c_81ec];

    #[test]
    fn the_stream_matches_the_reference_outputs() {
        let mut rng = SplitMix64::new(0);
        let got: Vec<u64> = (0..4).map(|_| rng.next_u64()).collect();
        assert_eq!(got, SEED_0);
    }

    #[test]
    fn position_addressed_outputs_equal_the_stream() {
        for seed in [0, 1, 42, u64::MAX] {
            let mut rng = SplitMix64::new(seed);
            for index in 0..100 {
                assert_eq!(splitmix64_at(seed, index), rng.next_u64(), "seed {seed} index {index}");
            }
        }
    }

    #[test]
    fn derived_draws_stay_in_range() {
        let mut rng = SplitMix64::new(7);
        for n in [1, 2, 3, 1000, u64::MAX] {
            assert!(rng.below(n) < n);
        }
        let x = rng.next_f64();
        assert!((0.0..1.0).contains(&x));
        let mut v: Vec<u32> = (0..50).collect();
        rng.shuffle(&mut v);
        v.sort_unstable();
        assert_eq!(v, (0..50).collect::<Vec<_>>());
    }
}
