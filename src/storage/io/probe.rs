//! Measuring the device the way fio's `randread` does: random O_DIRECT reads of one size at a
//! fixed queue depth, through the same io_uring reader the engine uses.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use super::{AlignedBuf, BufOptions, IoError, ReadBackend, ReadOp, RingOptions, UringReader};

/// Reads `reads` random windows of `read_bytes` (rounded up to the alignment) from `ranges`
/// (file index, first byte, end) with `queue_depth` reads in flight; returns bytes per second.
pub fn random_read_rate(
    files: &[PathBuf],
    ranges: &[(usize, u64, u64)],
    read_bytes: usize,
    queue_depth: u32,
    reads: usize,
    seed: u64,
) -> Result<f64, IoError> {
    let qd = queue_depth.max(1) as usize;
    let probe = UringReader::new(
        files,
        RingOptions { queue_depth: 1, chunk_bytes: 4096, ops_max: 1, register_files: false, ..RingOptions::default() },
    )?;
    let align = u64::from(probe.dio_align().strictest()).max(4096);
    drop(probe);
    let (len, buf) = windows_buffer(read_bytes, align, qd)?;
    let opts = RingOptions {
        queue_depth: queue_depth.max(1),
        chunk_bytes: len as usize,
        ops_max: qd,
        register_files: true,
        register_buffers: vec![Arc::clone(&buf)],
        align_min: align as u32,
        inject: None,
    };
    let mut ring = UringReader::new(files, opts)?;
    let fixed = |ring: &UringReader, dst: *mut u8| ring.fixed_buffer_for(dst, len as usize);
    random_reads(&mut ring, &buf, fixed, ranges, len, align, qd, reads, seed)
}

/// As [`random_read_rate`], through any backend (a modeled device's, say), with its alignment.
pub fn random_read_rate_through(
    backend: Box<dyn ReadBackend>,
    ranges: &[(usize, u64, u64)],
    read_bytes: usize,
    queue_depth: u32,
    reads: usize,
    seed: u64,
) -> Result<f64, IoError> {
    let qd = queue_depth.max(1) as usize;
    let align = u64::from(backend.dio_align().strictest()).max(4096);
    let (len, buf) = windows_buffer(read_bytes, align, qd)?;
    // Declared after `buf`, so dropped before it on every path (a failed read leaves others in
    // flight, and the backend's drop waits for them).
    let mut backend = backend;
    random_reads(backend.as_mut(), &buf, |_, _| None, ranges, len, align, qd, reads, seed)
}

/// The window of a read of `read_bytes` rounded up to `align`, and a buffer of `count` of them.
fn windows_buffer(read_bytes: usize, align: u64, count: usize) -> Result<(u64, Arc<AlignedBuf>), IoError> {
    let len = (read_bytes as u64).div_ceil(align) * align;
    Ok((len, Arc::new(AlignedBuf::new(count * len as usize, &BufOptions::default())?)))
}

/// Random aligned `len`-byte windows of `ranges` (file index, first byte, end), drawn from a
/// seeded xorshift: where the probes and the read-tax stream ([`super::stream`]) read.
pub(super) struct RandomWindows {
    usable: Vec<(usize, u64, u64)>,
    len: u64,
    align: u64,
    rng: u64,
}

impl RandomWindows {
    /// Fails when no range holds an aligned window of `len` bytes.
    pub(super) fn new(ranges: &[(usize, u64, u64)], len: u64, align: u64, seed: u64) -> Result<RandomWindows, IoError> {
        let usable: Vec<(usize, u64, u64)> = ranges
            .iter()
            .map(|&(f, a, b)| (f, a.div_ceil(align) * align, b))
            .filter(|&(_, a, b)| b >= a + len)
            .collect();
        if usable.is_empty() || len == 0 || !len.is_multiple_of(align) {
            return Err(IoError::BadOp { tag: 0, why: format!("no file range holds an aligned {len}-byte read") });
        }
        Ok(RandomWindows { usable, len, align, rng: seed.max(1) })
    }

    fn next_u64(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    /// The next window: (file index, offset).
    pub(super) fn next_window(&mut self) -> (usize, u64) {
        let pick = (self.next_u64() % self.usable.len() as u64) as usize;
        let (file, a, b) = self.usable[pick];
        let blocks = (b - a - self.len) / self.align;
        (file, a + (self.next_u64() % (blocks + 1)) * self.align)
    }
}

/// `reads` random `len`-byte windows of `ranges`, `qd` at a time into `buf`; bytes per second.
#[allow(clippy::too_many_arguments)]
fn random_reads<B: ReadBackend + ?Sized>(
    ring: &mut B,
    buf: &AlignedBuf,
    fixed: impl Fn(&B, *mut u8) -> Option<u16>,
    ranges: &[(usize, u64, u64)],
    len: u64,
    align: u64,
    qd: usize,
    reads: usize,
    seed: u64,
) -> Result<f64, IoError> {
    let mut windows = RandomWindows::new(ranges, len, align, seed)?;
    let mut done = Vec::with_capacity(qd);
    let mut free: Vec<usize> = (0..qd).collect();
    let (mut issued, mut completed, mut bytes) = (0usize, 0usize, 0u64);
    let start = Instant::now();
    // Bounded: every pass completes at least one read until `reads` have completed.
    while completed < reads {
        while issued < reads {
            let Some(slot) = free.pop() else { break };
            let (file, offset) = windows.next_window();
            // SAFETY: `slot` is a distinct `len`-byte window of `buf` (`qd` windows), which outlives
            // every read: all are reaped before this returns, or the error return drops the
            // caller's backend, which waits for its reads, before the caller drops `buf`.
            let dst = unsafe { buf.as_mut_ptr().add(slot * len as usize) };
            let mut op = ReadOp::new(file, offset, len as usize, dst, slot as u64);
            op.buf_index = fixed(ring, dst);
            // SAFETY: as above: the window stays valid and untouched until its completion.
            unsafe { ring.submit(op)? };
            issued += 1;
        }
        done.clear();
        ring.reap(&mut done, 1)?;
        for c in done.drain(..) {
            c.result?;
            free.push(c.tag as usize);
            completed += 1;
            bytes += len;
        }
    }
    Ok(bytes as f64 / start.elapsed().as_secs_f64())
}
