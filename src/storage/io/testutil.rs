//! Shared test helpers: pattern files, a tiny seeded PRNG, and a backend-generic read check.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::{Path, PathBuf};

use super::{AlignedBuf, BufOptions, Completion, ReadBackend, ReadOp};

/// The byte a pattern file holds at `offset`.
pub fn pattern_byte(offset: u64) -> u8 {
    (offset.wrapping_mul(2_654_435_761) >> 13) as u8
}

/// Writes a pattern file of `len` bytes (salted by `salt` so files differ) and returns its path.
pub fn write_pattern(dir: &Path, name: &str, len: u64, salt: u64) -> PathBuf {
    let path = dir.join(name);
    let mut file = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    let mut block = vec![0u8; 1 << 16];
    let mut at = 0u64;
    while at < len {
        let n = block.len().min((len - at) as usize);
        for (i, b) in block[..n].iter_mut().enumerate() {
            *b = pattern_byte(at + i as u64 + salt);
        }
        file.write_all(&block[..n]).unwrap();
        at += n as u64;
    }
    file.flush().unwrap();
    path
}

/// xorshift64*: reproducible ranges without a rand dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// One planned read: file index, offset and length (all aligned), with its file's salt.
#[derive(Clone, Copy, Debug)]
pub struct Planned {
    pub file: usize,
    pub offset: u64,
    pub len: usize,
    pub salt: u64,
}

/// `count` random aligned ranges over files of `file_len` bytes each.
pub fn plan(seed: u64, count: usize, files: &[(u64, u64)], align: u64, len_max: u64) -> Vec<Planned> {
    let mut rng = Rng(seed | 1);
    (0..count)
        .map(|_| {
            let file = rng.below(files.len() as u64) as usize;
            let (file_len, salt) = files[file];
            let units = file_len / align;
            let len_units = 1 + rng.below((len_max / align).min(units));
            let start = rng.below(units - len_units + 1);
            Planned { file, offset: start * align, len: (len_units * align) as usize, salt }
        })
        .collect()
}

/// Reads every planned range through `backend` into one buffer (each range at an aligned
/// slot), keeping up to `window` reads submitted at once, and returns the bytes of each read.
pub fn run_plan(
    backend: &mut dyn ReadBackend,
    planned: &[Planned],
    window: usize,
    buf_index: Option<u16>,
    buf: &AlignedBuf,
) -> Vec<Vec<u8>> {
    let slot = planned.iter().map(|p| p.len).max().unwrap();
    assert!(slot * planned.len() <= buf.len());
    let mut out: Vec<Completion> = Vec::new();
    let mut next = 0;
    let mut done = 0;
    while done < planned.len() {
        while next < planned.len() && backend.in_flight() < window {
            let p = planned[next];
            let dst = buf.as_mut_ptr().wrapping_add(next * slot);
            let op =
                ReadOp { file: p.file, offset: p.offset, len: p.len, min_len: p.len, dst, buf_index, tag: next as u64 };
            // SAFETY: each read has its own slot of `buf`, which outlives the backend's use of it
            // (every op is reaped below before `buf` is read).
            unsafe { backend.submit(op) }.unwrap();
            next += 1;
        }
        let before = out.len();
        backend.reap(&mut out, 1).unwrap();
        done += out.len() - before;
    }
    for c in &out {
        assert!(c.result.is_ok(), "read {} failed: {:?}", c.tag, c.result);
    }
    let bytes = buf.as_slice();
    planned.iter().enumerate().map(|(i, p)| bytes[i * slot..i * slot + p.len].to_vec()).collect()
}

/// Asserts that `got` equals the pattern at each planned range.
pub fn check_plan(planned: &[Planned], got: &[Vec<u8>]) {
    for (p, bytes) in planned.iter().zip(got) {
        for (i, &b) in bytes.iter().enumerate() {
            let want = pattern_byte(p.offset + i as u64 + p.salt);
            assert_eq!(b, want, "file {} offset {}: byte {i} is {b}, pattern says {want}", p.file, p.offset);
        }
    }
}

/// A buffer big enough for `planned` read back to back in slots of the largest read.
pub fn buffer_for(planned: &[Planned]) -> AlignedBuf {
    let slot = planned.iter().map(|p| p.len).max().unwrap();
    AlignedBuf::new(slot * planned.len(), &BufOptions::default()).unwrap()
}
