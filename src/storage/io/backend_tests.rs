//! Behaviour both backends must share, run against each: bytes, short reads, EIO, EOF rules,
//! alignment refusals. Ring-only checks (registration, batching) live in `ring.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use super::testutil::{buffer_for, check_plan, pattern_byte, plan, run_plan, write_pattern};
use super::*;
use crate::exit::{Classify, ExitCode};

/// Two pattern files: 3 MiB, and 5 MiB plus 1000 bytes (an unaligned tail).
struct Fixture {
    _dir: tempfile::TempDir,
    paths: Vec<PathBuf>,
    /// `(len, salt)` per file.
    files: Vec<(u64, u64)>,
}

const TAIL_LEN: u64 = (5 << 20) + 1000;

fn fixture() -> Fixture {
    let dir = tempfile::tempdir_in("/tmp").unwrap();
    let files = vec![(3u64 << 20, 0u64), (TAIL_LEN, 77u64)];
    let paths = files
        .iter()
        .enumerate()
        .map(|(i, &(len, salt))| write_pattern(dir.path(), &format!("f{i}.bin"), len, salt))
        .collect();
    Fixture { _dir: dir, paths, files }
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Uring,
    Pread,
}

fn backend(
    kind: Kind,
    paths: &[PathBuf],
    depth: u32,
    chunk: usize,
    align_min: u32,
    inject: Option<FaultPlan>,
) -> Box<dyn ReadBackend> {
    match kind {
        Kind::Uring => {
            let opts = RingOptions {
                queue_depth: depth,
                chunk_bytes: chunk,
                ops_max: 64,
                align_min,
                inject,
                ..RingOptions::default()
            };
            Box::new(UringReader::new(paths, opts).unwrap())
        }
        Kind::Pread => {
            let opts =
                PreadOptions { threads: 3, queue_depth: depth, chunk_bytes: chunk, ops_max: 64, align_min, inject };
            Box::new(PreadReader::new(paths, opts).unwrap())
        }
    }
}

const KINDS: [Kind; 2] = [Kind::Uring, Kind::Pread];

#[test]
fn random_ranges_match_the_pattern_at_depth_1_and_32() {
    let fx = fixture();
    for kind in KINDS {
        for (depth, chunk, window) in
            [(1u32, 64usize << 10, 1usize), (1, 64 << 10, 8), (32, 64 << 10, 32), (32, 1 << 20, 16)]
        {
            let mut b = backend(kind, &fx.paths, depth, chunk, 0, None);
            let align = u64::from(b.dio_align().strictest());
            let planned = plan(depth as u64 * 31 + 7, 48, &fx.files, align, 300 << 10);
            let buf = buffer_for(&planned);
            let got = run_plan(b.as_mut(), &planned, window, None, &buf);
            check_plan(&planned, &got);
            let stats = b.stats();
            assert_eq!(stats.ops, 48, "{kind:?} depth {depth}");
            assert_eq!(stats.bytes_read, planned.iter().map(|p| p.len as u64).sum::<u64>());
            assert!(stats.sqes_submitted >= 48);
            assert_eq!(b.in_flight(), 0);
        }
    }
}

#[test]
fn stricter_4096_alignment_also_reads_right() {
    let fx = fixture();
    for kind in KINDS {
        let mut b = backend(kind, &fx.paths, 8, 16 << 10, 4096, None);
        assert_eq!(b.dio_align().offset_align, 4096);
        let planned = plan(99, 24, &fx.files, 4096, 100 << 10);
        let buf = buffer_for(&planned);
        check_plan(&planned, &run_plan(b.as_mut(), &planned, 8, None, &buf));
        // 512-aligned but not 4096-aligned is refused now.
        let dst = buf.as_mut_ptr();
        // SAFETY: not submitted (refused before queuing).
        let err = unsafe { b.submit(ReadOp::new(0, 512, 4096, dst, 1)) }.unwrap_err();
        assert!(matches!(err, IoError::Unaligned { align: 4096, value: 512, .. }), "{err}");
    }
}

#[test]
fn both_backends_give_identical_bytes() {
    let fx = fixture();
    let planned = plan(2024, 40, &fx.files, 4096, 512 << 10);
    let mut results = Vec::new();
    for kind in KINDS {
        let mut b = backend(kind, &fx.paths, 16, 128 << 10, 4096, None);
        let buf = buffer_for(&planned);
        results.push(run_plan(b.as_mut(), &planned, 16, None, &buf));
    }
    assert_eq!(results[0], results[1]);
    check_plan(&planned, &results[0]);
}

#[test]
fn injected_short_reads_are_resubmitted_and_bytes_stay_right() {
    let fx = fixture();
    for kind in KINDS {
        let inject = Some(FaultPlan { short_every: Some(3), eio_every: None });
        let mut b = backend(kind, &fx.paths, 16, 64 << 10, 0, inject);
        let align = u64::from(b.dio_align().strictest());
        let planned = plan(5, 40, &fx.files, align, 256 << 10);
        let buf = buffer_for(&planned);
        check_plan(&planned, &run_plan(b.as_mut(), &planned, 16, None, &buf));
        let stats = b.stats();
        assert!(stats.short_read_resubmits > 0, "{kind:?}: {stats:?}");
        assert_eq!(stats.ops_failed, 0);
        assert!(stats.sqes_submitted > stats.short_read_resubmits);
    }
}

#[test]
fn injected_eio_fails_only_its_read_and_names_path_and_offset() {
    let fx = fixture();
    for kind in KINDS {
        let inject = Some(FaultPlan { short_every: None, eio_every: Some(5) });
        // One chunk per read, so exactly every 5th read fails.
        let mut b = backend(kind, &fx.paths, 8, 64 << 10, 4096, inject);
        let buf = AlignedBuf::new(20 * 4096, &BufOptions::default()).unwrap();
        for i in 0..20u64 {
            let op = ReadOp::new(1, i * 8192, 4096, buf.as_mut_ptr().wrapping_add(i as usize * 4096), i);
            // SAFETY: each read has its own 4 KiB of `buf`, which outlives the reader's use.
            unsafe { b.submit(op) }.unwrap();
        }
        let mut out = Vec::new();
        b.reap(&mut out, 20).unwrap();
        assert_eq!(out.len(), 20);
        let failed: Vec<&Completion> = out.iter().filter(|c| c.result.is_err()).collect();
        assert_eq!(failed.len(), 4, "{kind:?}");
        let path = fx.paths[1].display().to_string();
        for c in &failed {
            let text = c.result.as_ref().unwrap_err().to_string();
            let want = format!("read of 4096 bytes at offset {} of {path} failed: ", c.tag * 8192);
            assert!(text.starts_with(&want), "{kind:?}: {text}");
            assert!(c.result.as_ref().unwrap_err().raw_os_error() == Some(libc::EIO));
        }
        for c in out.iter().filter(|c| c.result.is_ok()) {
            let i = c.tag as usize;
            let bytes = &buf.as_slice()[i * 4096..(i + 1) * 4096];
            assert!(bytes.iter().enumerate().all(|(k, &v)| v == pattern_byte(c.tag * 8192 + k as u64 + 77)));
        }
        // The same reader stays usable: the next 4 results (21st to 24th) are not multiples of 5.
        assert_eq!(b.stats().ops_failed, 4);
        let more = AlignedBuf::new(4 * 4096, &BufOptions::default()).unwrap();
        for i in 0..4u64 {
            let op = ReadOp::new(0, i * 4096, 4096, more.as_mut_ptr().wrapping_add(i as usize * 4096), 100 + i);
            // SAFETY: each read has its own 4 KiB of `more`, which outlives the reader's use.
            unsafe { b.submit(op) }.unwrap();
        }
        out.clear();
        b.reap(&mut out, 4).unwrap();
        assert!(out.iter().all(|c| c.result.is_ok()), "{kind:?}: {out:?}");
        assert!(more.as_slice().iter().enumerate().all(|(k, &v)| v == pattern_byte(k as u64)));
    }
}

#[test]
fn window_past_eof_succeeds_when_min_len_is_inside_the_file() {
    let fx = fixture();
    for kind in KINDS {
        let mut b = backend(kind, &fx.paths, 4, 4096, 4096, None);
        let buf = AlignedBuf::new(64 << 10, &BufOptions::default()).unwrap();
        let last_block = (TAIL_LEN / 4096) * 4096;
        let tail = (TAIL_LEN - last_block) as usize;
        let ok = ReadOp { min_len: 4096 + tail, ..ReadOp::new(1, last_block - 4096, 16384, buf.as_mut_ptr(), 1) };
        let short = ReadOp {
            min_len: 4096 + tail + 1,
            ..ReadOp::new(1, last_block - 4096, 16384, buf.as_mut_ptr().wrapping_add(32768), 2)
        };
        // SAFETY: the two reads use disjoint halves of `buf`, which outlives the reader's use.
        unsafe {
            b.submit(ok).unwrap();
            b.submit(short).unwrap();
        }
        let mut out = Vec::new();
        b.reap(&mut out, 2).unwrap();
        out.sort_by_key(|c| c.tag);
        assert!(out[0].result.is_ok(), "{kind:?}: {:?}", out[0].result);
        let got = &buf.as_slice()[..4096 + tail];
        assert!(got.iter().enumerate().all(|(k, &v)| v == pattern_byte(last_block - 4096 + k as u64 + 77)));
        let err = out[1].result.as_ref().unwrap_err();
        assert!(matches!(err, IoError::ShortRead { got, .. } if *got == 4096 + tail), "{kind:?}: {err}");
        assert!(err.to_string().starts_with(&format!("{} ends early", fx.paths[1].display())), "{err}");
        assert_eq!(err.exit_code(), ExitCode::Data);
    }
}

#[test]
fn read_wholly_past_eof_is_a_short_read() {
    let fx = fixture();
    for kind in KINDS {
        let mut b = backend(kind, &fx.paths, 4, 4096, 4096, None);
        let buf = AlignedBuf::new(8192, &BufOptions::default()).unwrap();
        // SAFETY: `buf` outlives the reader's use of it.
        unsafe { b.submit(ReadOp::new(0, 8 << 20, 8192, buf.as_mut_ptr(), 5)) }.unwrap();
        let mut out = Vec::new();
        b.reap(&mut out, 1).unwrap();
        let err = out[0].result.as_ref().unwrap_err();
        assert!(matches!(err, IoError::ShortRead { got: 0, wanted: 8192, offset, .. } if *offset == 8 << 20), "{err}");
    }
}

#[test]
fn unaligned_or_malformed_ops_are_refused_without_panic() {
    let fx = fixture();
    for kind in KINDS {
        let mut b = backend(kind, &fx.paths, 4, 4096, 4096, None);
        let buf = AlignedBuf::new(16384, &BufOptions::default()).unwrap();
        let p = buf.as_mut_ptr();
        let cases = [
            (ReadOp::new(0, 100, 4096, p, 1), "offset"),
            (ReadOp::new(0, 0, 1000, p, 2), "length"),
            (ReadOp::new(0, 0, 4096, p.wrapping_add(1), 3), "destination address"),
        ];
        for (op, what) in cases {
            // SAFETY: refused before queuing; nothing is written.
            let err = unsafe { b.submit(op) }.unwrap_err();
            match &err {
                IoError::Unaligned { what: w, .. } => assert!(w.starts_with(what), "{w}"),
                other => panic!("{kind:?}: expected Unaligned for {what}, got {other}"),
            }
            assert!(err.to_string().contains(&fx.paths[0].display().to_string()), "{err}");
            assert_eq!(err.exit_code(), ExitCode::Internal);
        }
        let bad = [
            ReadOp::new(9, 0, 4096, p, 4),
            ReadOp { min_len: 8192, ..ReadOp::new(0, 0, 4096, p, 5) },
            ReadOp::new(0, 0, 4096, std::ptr::null_mut(), 6),
        ];
        for op in bad {
            // SAFETY: refused before queuing; nothing is written.
            let err = unsafe { b.submit(op) }.unwrap_err();
            assert!(matches!(err, IoError::BadOp { .. }), "{err}");
        }
        assert_eq!(b.in_flight(), 0);
    }
}

#[test]
fn queue_limit_is_enforced() {
    let fx = fixture();
    for kind in KINDS {
        let mut b = backend(kind, &fx.paths, 2, 4096, 4096, None);
        let buf = AlignedBuf::new(65 * 4096, &BufOptions::default()).unwrap();
        for i in 0..64u64 {
            // SAFETY: each read has its own 4 KiB of `buf`, which outlives the reader's use.
            unsafe { b.submit(ReadOp::new(0, i * 4096, 4096, buf.as_mut_ptr().wrapping_add(i as usize * 4096), i)) }
                .unwrap();
        }
        // SAFETY: refused before queuing.
        let err =
            unsafe { b.submit(ReadOp::new(0, 0, 4096, buf.as_mut_ptr().wrapping_add(64 * 4096), 64)) }.unwrap_err();
        assert!(matches!(err, IoError::QueueFull { max: 64, .. }), "{err}");
        let mut out = Vec::new();
        b.reap(&mut out, 64).unwrap();
        assert!(out.iter().all(|c| c.result.is_ok()));
    }
}

#[test]
fn dropping_a_reader_with_reads_in_flight_waits_for_them() {
    let fx = fixture();
    for kind in KINDS {
        let buf = AlignedBuf::new(3 << 20, &BufOptions::default()).unwrap();
        {
            let mut b = backend(kind, &fx.paths, 8, 64 << 10, 4096, None);
            // SAFETY: `buf` outlives the reader, whose drop waits for the kernel and workers.
            unsafe { b.submit(ReadOp::new(0, 0, 3 << 20, buf.as_mut_ptr(), 1)) }.unwrap();
            let mut out = Vec::new();
            b.reap(&mut out, 0).unwrap();
        }
        // Whatever was read before the drop is pattern bytes or untouched zeros.
        for (k, &v) in buf.as_slice().iter().enumerate().step_by(4093) {
            assert!(v == 0 || v == pattern_byte(k as u64), "{kind:?} byte {k}");
        }
    }
}

/// The prefetcher's pattern: queue reads, `reap(out, 0)` to start them without blocking, do
/// other work, poll again until all are back.
#[test]
fn reap_zero_starts_reads_and_polls_without_blocking() {
    let fx = fixture();
    for kind in KINDS {
        let mut b = backend(kind, &fx.paths, 8, 64 << 10, 0, None);
        let align = u64::from(b.dio_align().strictest());
        let planned = plan(77, 12, &fx.files, align, 512 << 10);
        let buf = buffer_for(&planned);
        let slot = planned.iter().map(|p| p.len).max().unwrap();
        for (i, p) in planned.iter().enumerate() {
            let op = ReadOp::new(p.file, p.offset, p.len, buf.as_mut_ptr().wrapping_add(i * slot), i as u64);
            // SAFETY: each read has its own slot of `buf`, which outlives the reader's use.
            unsafe { b.submit(op) }.unwrap();
        }
        let mut out = Vec::new();
        let mut polls = 0;
        while out.len() < planned.len() {
            b.reap(&mut out, 0).unwrap();
            polls += 1;
            assert!(polls < 100_000, "{kind:?}: reads never completed by polling");
            std::thread::sleep(std::time::Duration::from_micros(50));
        }
        assert!(b.stats().sqes_submitted > 0);
        assert!(out.iter().all(|c| c.result.is_ok()));
        let got: Vec<Vec<u8>> =
            planned.iter().enumerate().map(|(i, p)| buf.as_slice()[i * slot..i * slot + p.len].to_vec()).collect();
        check_plan(&planned, &got);
    }
}

#[test]
fn faults_and_multi_chunk_reads_at_depth_1() {
    let fx = fixture();
    for kind in KINDS {
        let inject = Some(FaultPlan { short_every: Some(2), eio_every: Some(7) });
        let mut b = backend(kind, &fx.paths, 1, 8192, 4096, inject);
        let planned = plan(3, 16, &fx.files, 4096, 64 << 10);
        let buf = buffer_for(&planned);
        let slot = planned.iter().map(|p| p.len).max().unwrap();
        for (i, p) in planned.iter().enumerate() {
            let op = ReadOp::new(p.file, p.offset, p.len, buf.as_mut_ptr().wrapping_add(i * slot), i as u64);
            // SAFETY: each read has its own slot of `buf`, which outlives the reader's use.
            unsafe { b.submit(op) }.unwrap();
        }
        let mut out = Vec::new();
        b.reap(&mut out, planned.len()).unwrap();
        assert_eq!(out.len(), planned.len());
        let failed = out.iter().filter(|c| c.result.is_err()).count();
        assert!(failed > 0, "{kind:?}: every 7th chunk result is EIO");
        for c in out.iter().filter(|c| c.result.is_ok()) {
            let (i, p) = (c.tag as usize, planned[c.tag as usize]);
            check_plan(&[p], &[buf.as_slice()[i * slot..i * slot + p.len].to_vec()]);
        }
        let stats = b.stats();
        assert!(stats.short_read_resubmits > 0 && stats.ops_failed == failed as u64, "{kind:?}: {stats:?}");
    }
}
