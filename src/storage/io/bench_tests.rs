//! Read-rate measurement, ignored by default (it writes a 1 GiB file and drops the page cache):
//!
//! ```sh
//! cargo test --release --lib storage::io::bench_tests -- --ignored --nocapture --test-threads 1
//! ```
//!
//! `K3_BENCH_FILE` names the file to read (default `/tmp/k3ring-bench-1g.bin`, written with the
//! test pattern if missing or the wrong size). Each configuration reads the whole file once, as
//! 17.5 MiB reads (one MXFP4 expert's size) in a shuffled order, after
//! `echo 3 > /proc/sys/vm/drop_caches` (skipped with a note when not root). O_DIRECT bypasses the
//! page cache anyway; the drop is for a host or readahead that might not.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use super::testutil::{pattern_byte, write_pattern, Rng};
use super::*;

const READ_BYTES: usize = 17_920 << 10; // 17.5 MiB
const FILE_BYTES: u64 = 1 << 30;

fn bench_file() -> PathBuf {
    let path =
        std::env::var_os("K3_BENCH_FILE").map_or_else(|| PathBuf::from("/tmp/k3ring-bench-1g.bin"), PathBuf::from);
    let ok = std::fs::metadata(&path).map(|m| m.len() == FILE_BYTES).unwrap_or(false);
    if !ok {
        let dir = path.parent().unwrap();
        let name = path.file_name().unwrap().to_str().unwrap();
        write_pattern(dir, name, FILE_BYTES, 0);
    }
    path
}

fn drop_caches() -> &'static str {
    match std::fs::write("/proc/sys/vm/drop_caches", "3\n") {
        Ok(()) => "caches dropped",
        Err(_) => "caches NOT dropped (not root)",
    }
}

/// Reads every 17.5 MiB slot of the file once, keeping `window` reads submitted; returns MB/s
/// (10^6 bytes per second) and the stats.
fn read_all(backend: &mut dyn ReadBackend, window: usize, buf: &AlignedBuf, buf_index: Option<u16>) -> (f64, IoStats) {
    let reads = (FILE_BYTES as usize / READ_BYTES) as u64;
    let mut order: Vec<u64> = (0..reads).collect();
    let mut rng = Rng(0x9e37_79b9);
    for i in (1..order.len()).rev() {
        order.swap(i, rng.below(i as u64 + 1) as usize);
    }
    let mut free_slots: Vec<usize> = (0..window).collect();
    let mut slot_offsets: Vec<Option<u64>> = vec![None; window];
    let mut out = Vec::with_capacity(window);
    let mut next = 0;
    let mut done = 0;
    let started = Instant::now();
    while done < order.len() {
        while next < order.len() {
            let Some(slot) = free_slots.pop() else { break };
            let dst = buf.as_mut_ptr().wrapping_add(slot * READ_BYTES);
            let offset = order[next] * READ_BYTES as u64;
            slot_offsets[slot] = Some(offset);
            let op = ReadOp { buf_index, ..ReadOp::new(0, offset, READ_BYTES, dst, slot as u64) };
            // SAFETY: each in-flight read has its own slot of `buf`; a slot is reused only after
            // its completion came back.
            unsafe { backend.submit(op) }.unwrap();
            next += 1;
        }
        out.clear();
        backend.reap(&mut out, 1).unwrap();
        for c in &out {
            assert!(c.result.is_ok(), "{:?}", c.result);
            free_slots.push(c.tag as usize);
        }
        done += out.len();
    }
    let secs = started.elapsed().as_secs_f64();
    // Spot-check each slot's last read against the pattern.
    for (slot, offset) in slot_offsets.iter().enumerate() {
        let Some(offset) = *offset else { continue };
        let bytes = &buf.as_slice()[slot * READ_BYTES..(slot + 1) * READ_BYTES];
        for k in (0..READ_BYTES).step_by(4099) {
            assert_eq!(bytes[k], pattern_byte(offset + k as u64), "slot {slot} byte {k}");
        }
    }
    let (bytes, stats) = (reads as f64 * READ_BYTES as f64, backend.stats());
    (bytes / secs / 1e6, stats)
}

fn repeats() -> usize {
    std::env::var("K3_BENCH_REPEATS").ok().and_then(|v| v.parse().ok()).unwrap_or(3)
}

/// "median M MB/s (min A, max B)" of the rates.
fn summary(rates: &mut [f64]) -> String {
    rates.sort_by(f64::total_cmp);
    let median = rates[rates.len() / 2];
    format!("median {median:>5.0} MB/s (min {:>5.0}, max {:>5.0})", rates[0], rates[rates.len() - 1])
}

#[test]
#[ignore = "writes a 1 GiB file and drops caches; run by hand"]
fn bench_read_rate_17_5_mib_reads() {
    let path = bench_file();
    let paths = [path.clone()];
    let depths = [1u32, 4, 16, 32];
    let buf = Arc::new(AlignedBuf::new(32 * READ_BYTES, &BufOptions::default()).unwrap());
    eprintln!("file {} ({} bytes), reads of {} bytes", path.display(), FILE_BYTES, READ_BYTES);
    for &depth in &depths {
        for chunk in [READ_BYTES, 1 << 20] {
            let window = if chunk == READ_BYTES { depth as usize } else { (depth as usize).div_ceil(17) + 1 };
            let opts = RingOptions {
                queue_depth: depth,
                chunk_bytes: chunk,
                ops_max: 64,
                register_files: true,
                register_buffers: vec![Arc::clone(&buf)],
                align_min: 0,
                inject: None,
            };
            let mut rates = Vec::new();
            let mut last = None;
            for _ in 0..repeats() {
                let mut reader = UringReader::new(&paths, opts.clone()).unwrap();
                let index = reader.fixed_buffer_for(buf.as_ptr(), buf.len());
                let note = drop_caches();
                let (rate, stats) = read_all(&mut reader, window, &buf, index);
                rates.push(rate);
                last = Some((stats, note, index.is_some(), reader.info().clone()));
            }
            let (stats, note, fixed, info) = last.unwrap();
            eprintln!(
                "io_uring depth {depth:>2} chunk {:>5} KiB reads in flight {window:>2}: {}  ({note}; {} SQEs, {} submit syscalls, {} enter syscalls, fixed buf {fixed}, fixed files {})",
                chunk >> 10,
                summary(&mut rates),
                stats.sqes_submitted,
                stats.submit_syscalls,
                stats.enter_syscalls,
                info.registered_files,
            );
        }
    }
    for &depth in &depths {
        let chunk = 1 << 20;
        let window = (depth as usize).div_ceil(17) + 1;
        let opts = PreadOptions {
            threads: depth as usize,
            queue_depth: depth,
            chunk_bytes: chunk,
            ops_max: 64,
            align_min: 0,
            inject: None,
        };
        let mut rates = Vec::new();
        let mut note = "";
        for _ in 0..repeats() {
            let mut reader = PreadReader::new(&paths, opts.clone()).unwrap();
            note = drop_caches();
            rates.push(read_all(&mut reader, window, &buf, None).0);
        }
        eprintln!(
            "pread threads {depth:>2} chunk  1024 KiB reads in flight {window:>2}: {}  ({note})",
            summary(&mut rates)
        );
    }
}
