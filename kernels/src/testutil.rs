//! Helpers of the crate's own tests.

/// `len` bytes of an xorshift stream seeded by `salt`: data with no pattern a loop could hide
/// a wrong offset behind.
pub(crate) fn bytes(len: usize, salt: u64) -> Vec<u8> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ salt;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}
