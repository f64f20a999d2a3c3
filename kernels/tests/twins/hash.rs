//! Twins of `xxh3_64` and the streaming `xxh3`: every ISA gives the scalar loops' value, which is
//! the `xxhash-rust` reference's (the module's own tests go through every boundary; this runs the
//! public API on every ISA the host has, including the emulated AVX-512 CPU).

use super::*;

#[test]
fn xxh3_twins() {
    let mut rng = Rng::new(29);
    let data: Vec<u8> = (0..(1 << 20) + 999).map(|_| rng.next_u64() as u8).collect();
    let s = scalar();
    for k in all_kernels() {
        for len in (0..=300).chain([1023, 1024, 1025, 4096, 100_000, 1 << 20, (1 << 20) + 999]) {
            let bytes = &data[data.len() - len..];
            let want = kernels::hash::xxh3_64(bytes);
            let ctx = format!("{:?}, {len} bytes", k.isa());
            assert_eq!(want, xxhash_rust::xxh3::xxh3_64(bytes), "{ctx}: the reference");
            assert_eq!(s.xxh3_64(bytes), want, "{ctx}: scalar");
            assert_eq!(k.xxh3_64(bytes), want, "{ctx}");
            let mut h = k.xxh3();
            for piece in bytes.chunks(777) {
                h.update(piece);
            }
            assert_eq!(h.digest(), want, "{ctx}, streamed in pieces of 777");
        }
    }
}
