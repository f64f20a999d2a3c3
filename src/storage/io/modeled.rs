//! [`ModeledReader`] (`--io sim:RATE[,LATENCY][,qdQ][xN]`): a set of NVMe drives modeled in
//! real time, so the scheduler can be measured at server-class rates on any host.
//!
//! A read completes when the modeled drives would have delivered it; its bytes come from the
//! files' pages already in memory (the caller warms them: [`warm_ranges`]) and are copied into
//! the destination when the read falls due, with streaming stores (`Stores::Streaming`). That
//! copy stands in for the DMA a real drive does; it costs the host CPU and memory bandwidth,
//! which `bench`'s read-tax probe measures like any other read, so floors stay honest.
//!
//! # The model
//!
//! The drives form a RAID-0: a file's bytes are striped over them in [`STRIPE_BYTES`] stripes
//! (file `f`'s stripe `s` lives on drive `(s + f) % N`). Each stripe of a read is one command
//! to its drive. A drive accepts `queue_depth` commands at once (a command beyond that waits
//! for the oldest to finish), serves one transfer at a time at `rate`, and starts a command's
//! transfer `latency` after accepting it at the earliest, so latency overlaps other commands'
//! transfers as on a real device:
//!
//! ```text
//! accepted = max(submitted, completion of the command queue_depth places earlier)
//! done     = max(accepted + latency, drive free) + stripe bytes / rate
//! ```
//!
//! A read is due when its last stripe is done. Completions come back in due order, ties in
//! submission order; nothing is random, so the same submissions at the same times complete in
//! the same order, and the bytes are those of the real backends (tested against them).
//!
//! Threads: owned by the I/O thread, like every backend; it sleeps in `reap` until the next read
//! is due (with a 1 ns timer slack on its thread, so the sleep ends within tens of microseconds
//! of the due time instead of the default 50 µs slack), and returns each due read as soon as
//! its copy is done (`wait_for` of them, at least one), as a drive completes each command on
//! its own. Allocation: tables sized in `new`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

use super::{AlignSource, Completion, DioAlign, IoError, IoStats, ReadBackend, ReadOp};
use crate::storage::sigbus::MappedFile;

/// The modeled RAID-0 stripe: each stripe of a read is one command to one drive.
pub const STRIPE_BYTES: u64 = 512 << 10;
/// Bounds on the model's parameters (per drive).
pub const DRIVES_MAX: u32 = 64;
const RATE_MIN: f64 = 1e7;
const RATE_MAX: f64 = 1e12;
const LATENCY_MAX_NS: u64 = 1_000_000_000;
/// Defaults: a PCIe 4 datacenter drive's random-read latency and a typical queue depth.
pub const LATENCY_DEFAULT_NS: u64 = 80_000;
pub const QUEUE_DEPTH_DEFAULT: u32 = 32;
/// The alignment reads to a modeled device keep (the real drives' direct-I/O alignment).
pub const MODELED_ALIGN: u32 = 4096;

/// A set of identical drives: `--io sim:7GB/s,80us,qd32x4`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceModel {
    /// Bytes per second of one drive.
    pub rate_bytes_per_s: u64,
    /// From accepting a command to the start of its transfer.
    pub latency_ns: u64,
    /// Commands one drive accepts at once.
    pub queue_depth: u32,
    pub drives: u32,
}

impl DeviceModel {
    /// Parses `sim:RATE[,LATENCY][,qdQ][xN]` (RATE like `7GB/s`, `3500MB/s`, `2GiB/s`; LATENCY
    /// like `80us`, `0.1ms`, `500ns`; N drives, also after a space or comma: `sim:7GB/s,80us x4`).
    pub fn parse(s: &str) -> Result<DeviceModel, String> {
        let usage = "expected sim:RATE[,LATENCY][,qdQ][xN], e.g. sim:7GB/s,80us x4";
        let body = s.trim().strip_prefix("sim:").ok_or_else(|| format!("{s:?}: {usage}"))?;
        let mut fields: Vec<String> =
            body.split([',', ' ']).map(str::trim).filter(|f| !f.is_empty()).map(str::to_owned).collect();
        let mut drives = 1u32;
        // The drive count ends the spec: its own field ("x4") or glued to the last one ("80usx4").
        if let Some(last) = fields.last_mut() {
            if let Some(pos) = last.rfind(['x', 'X']) {
                let count = &last[pos + 1..];
                if !count.is_empty() && count.bytes().all(|b| b.is_ascii_digit()) {
                    drives = count.parse().map_err(|_| format!("{s:?}: drive count {count:?} is not a number"))?;
                    last.truncate(pos);
                }
            }
            if last.is_empty() {
                fields.pop();
            }
        }
        if !(1..=DRIVES_MAX).contains(&drives) {
            return Err(format!("{s:?}: {drives} drives; give 1 to {DRIVES_MAX}"));
        }
        let mut fields = fields.into_iter();
        let rate = fields.next().ok_or_else(|| format!("{s:?}: no rate; {usage}"))?;
        let rate_bytes_per_s = parse_rate(&rate).map_err(|e| format!("{s:?}: {e}"))?;
        let (mut latency_ns, mut queue_depth) = (LATENCY_DEFAULT_NS, QUEUE_DEPTH_DEFAULT);
        for f in fields {
            if let Some(q) = f.strip_prefix("qd") {
                queue_depth = match q.parse::<u32>() {
                    Ok(q) if (1..=4096).contains(&q) => q,
                    _ => return Err(format!("{s:?}: queue depth {q:?} is not 1 to 4096")),
                };
            } else {
                latency_ns = parse_latency(&f).map_err(|e| format!("{s:?}: {e}"))?;
            }
        }
        Ok(DeviceModel { rate_bytes_per_s, latency_ns, queue_depth, drives })
    }

    /// The array's rate in bytes per second.
    pub fn total_rate(&self) -> f64 {
        self.rate_bytes_per_s as f64 * f64::from(self.drives)
    }

    /// The spec as `parse` reads it back.
    pub fn spec(&self) -> String {
        format!(
            "sim:{}GB/s,{}us,qd{}x{}",
            self.rate_bytes_per_s as f64 / 1e9,
            self.latency_ns as f64 / 1e3,
            self.queue_depth,
            self.drives
        )
    }
}

fn parse_rate(s: &str) -> Result<u64, String> {
    let units = [("GiB/s", (1u64 << 30) as f64), ("MiB/s", (1u64 << 20) as f64), ("GB/s", 1e9), ("MB/s", 1e6)];
    let (num, scale) = units
        .iter()
        .find_map(|(u, k)| s.strip_suffix(u).map(|n| (n, *k)))
        .ok_or_else(|| format!("rate {s:?} needs a unit: GB/s, MB/s, GiB/s or MiB/s"))?;
    match num.parse::<f64>() {
        Ok(x) if (x * scale).is_finite() && (RATE_MIN..=RATE_MAX).contains(&(x * scale)) => {
            Ok((x * scale).round() as u64)
        }
        _ => Err(format!("rate {s:?} is not a number of 0.01 to 1000 GB/s per drive")),
    }
}

fn parse_latency(s: &str) -> Result<u64, String> {
    let units = [("ms", 1e6), ("us", 1e3), ("µs", 1e3), ("ns", 1.0)];
    let (num, scale) = units
        .iter()
        .find_map(|(u, k)| s.strip_suffix(u).map(|n| (n, *k)))
        .ok_or_else(|| format!("{s:?} is neither a latency (us, ms, ns) nor a queue depth (qdQ)"))?;
    match num.parse::<f64>() {
        Ok(x) if x.is_finite() && x >= 0.0 && x * scale <= LATENCY_MAX_NS as f64 => Ok((x * scale).round() as u64),
        _ => Err(format!("latency {s:?} is not a number of 0 to 1 s")),
    }
}

/// One drive's state: when its transfer engine frees up, and the completion times of the
/// commands it holds (non-decreasing, so a queue).
struct Drive {
    free_at_ns: u64,
    held: VecDeque<u64>,
}

/// A read waiting for its due time.
struct Pending {
    op: ReadOp,
}

/// Reads by modeling the drives' timing and copying from the page cache.
pub struct ModeledReader {
    paths: Vec<PathBuf>,
    maps: Vec<Option<MappedFile>>,
    model: DeviceModel,
    drives: Vec<Drive>,
    /// (due ns, slot) of every read in flight, earliest first; ties by slot order of submission.
    due: BinaryHeap<Reverse<(u64, u64, usize)>>,
    slots: Vec<Option<Pending>>,
    free_slots: Vec<usize>,
    submitted: u64,
    epoch: Instant,
    busy_since_ns: Option<u64>,
    stats: IoStats,
}

impl ModeledReader {
    /// Maps every file (an empty one gets no mapping) and sets the calling thread's timer slack
    /// to 1 ns, so that sleeping until a read is due wakes close to it.
    pub fn new(files: &[PathBuf], model: DeviceModel, ops_max: usize) -> Result<ModeledReader, IoError> {
        let maps = super::mapped::map_all(files)?;
        // SAFETY: PR_SET_TIMERSLACK takes a plain integer and only changes this thread's timer
        // slack; no memory is passed.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0) };
        let qd = model.queue_depth as usize;
        Ok(ModeledReader {
            paths: files.to_vec(),
            maps,
            model,
            drives: (0..model.drives).map(|_| Drive { free_at_ns: 0, held: VecDeque::with_capacity(qd) }).collect(),
            due: BinaryHeap::with_capacity(ops_max),
            slots: (0..ops_max).map(|_| None).collect(),
            free_slots: (0..ops_max).rev().collect(),
            submitted: 0,
            epoch: Instant::now(),
            busy_since_ns: None,
            stats: IoStats::default(),
        })
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// When a read of `len` bytes at `offset` of file `file`, submitted at `now`, is delivered.
    fn schedule(&mut self, file: usize, offset: u64, len: u64, now: u64) -> u64 {
        let n = self.drives.len() as u64;
        let ns_per_byte = 1e9 / self.model.rate_bytes_per_s as f64;
        let (latency, qd) = (self.model.latency_ns, self.model.queue_depth as usize);
        let mut due = now;
        let mut at = offset;
        let end = offset + len.max(1);
        while at < end {
            let stripe = at / STRIPE_BYTES;
            let upto = ((stripe + 1) * STRIPE_BYTES).min(end);
            let d = &mut self.drives[((stripe + file as u64) % n) as usize];
            while d.held.front().is_some_and(|&t| t <= now) {
                d.held.pop_front();
            }
            let accepted = if d.held.len() >= qd { d.held.pop_front().unwrap_or(now) } else { now };
            let done = (accepted + latency).max(d.free_at_ns) + ((upto - at) as f64 * ns_per_byte) as u64;
            d.free_at_ns = done;
            d.held.push_back(done);
            due = due.max(done);
            at = upto;
        }
        due
    }

    fn complete(&mut self, slot: usize, out: &mut Vec<Completion>) {
        let Some(Pending { op }) = self.slots[slot].take() else { return };
        self.free_slots.push(slot);
        let result = copy_counted(&self.paths, &self.maps, &op, Stores::Streaming, &mut self.stats);
        out.push(Completion { tag: op.tag, result });
    }
}

/// The stores [`copy_from_maps`] writes the destination with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stores {
    /// Regular stores (`copy_from_slice`): what a `read(2)` from the page cache does.
    Plain,
    /// Streaming stores ([`kernels::copy_streaming`]): a drive's DMA stand-in, 1.5x a plain
    /// copy's rate on one thread of the Intel host (docs/BENCHMARKS.md, "Streaming copies for
    /// modeled drives").
    Streaming,
}

/// [`copy_from_maps`], counted in `stats` as one completed read (its bytes, or a failure).
pub(super) fn copy_counted(
    paths: &[PathBuf],
    maps: &[Option<MappedFile>],
    op: &ReadOp,
    how: Stores,
    stats: &mut IoStats,
) -> Result<(), IoError> {
    stats.ops += 1;
    match copy_from_maps(paths, maps, op, how) {
        Ok(n) => {
            stats.bytes_read += n as u64;
            Ok(())
        }
        Err(e) => {
            stats.ops_failed += 1;
            Err(e)
        }
    }
}

/// Copies `op`'s bytes out of `maps` into `op.dst` with the real backends' EOF rule (`min_len`);
/// returns the bytes copied.
pub(super) fn copy_from_maps(
    paths: &[PathBuf],
    maps: &[Option<MappedFile>],
    op: &ReadOp,
    how: Stores,
) -> Result<usize, IoError> {
    let Some(map) = maps.get(op.file) else {
        return Err(IoError::BadOp { tag: op.tag, why: format!("file index {} out of range", op.file) });
    };
    let file_len = map.as_ref().map_or(0, |m| m.len() as u64);
    let available = file_len.saturating_sub(op.offset).min(op.len as u64) as usize;
    if available < op.min_len {
        let path = paths.get(op.file).cloned().unwrap_or_default();
        return Err(IoError::ShortRead { path, offset: op.offset, wanted: op.min_len, got: available });
    }
    if let Some(m) = map.as_ref().filter(|_| available > 0) {
        let src = &m[op.offset as usize..op.offset as usize + available];
        // SAFETY: the `submit` contract gives the reader exclusive use of `dst..dst + len` until
        // the completion is returned, and `available <= len`.
        let dst = unsafe { std::slice::from_raw_parts_mut(op.dst, available) };
        match how {
            Stores::Plain => dst.copy_from_slice(src),
            Stores::Streaming => kernels::copy_streaming(dst, src),
        }
    }
    Ok(available)
}

impl ReadBackend for ModeledReader {
    unsafe fn submit(&mut self, op: ReadOp) -> Result<(), IoError> {
        // The real backends' checks, so that a read refused there is refused here too.
        super::ops::validate_op(&op, &self.paths, &self.dio_align())?;
        let Some(slot) = self.free_slots.pop() else {
            return Err(IoError::QueueFull { tag: op.tag, queued: self.slots.len(), max: self.slots.len() });
        };
        let now = self.now_ns();
        let due = self.schedule(op.file, op.offset, op.len as u64, now);
        self.slots[slot] = Some(Pending { op });
        self.due.push(Reverse((due, self.submitted, slot)));
        self.submitted += 1;
        self.stats.sqes_submitted += op.len.div_ceil(STRIPE_BYTES as usize).max(1) as u64;
        self.stats.submit_syscalls += 1;
        self.busy_since_ns.get_or_insert(now);
        Ok(())
    }

    fn reap(&mut self, out: &mut Vec<Completion>, wait_for: usize) -> Result<(), IoError> {
        assert!(wait_for <= self.in_flight(), "waiting for more reads than are in flight");
        // A due read is returned as soon as its copy is done, not after every other due read's:
        // a drive's DMA completes each command on its own, and the caller should wake the read's
        // waiter and refill the queue between copies (with four or more drives, up to the queue
        // depth of reads fall due together, and copying them all first held each one back).
        let enough = wait_for.max(1);
        let mut got = 0;
        loop {
            let now = self.now_ns();
            while let Some(&Reverse((due, _, slot))) = self.due.peek() {
                if due > now || got >= enough {
                    break;
                }
                self.due.pop();
                self.complete(slot, out);
                got += 1;
            }
            if self.due.is_empty() {
                if let Some(since) = self.busy_since_ns.take() {
                    self.stats.busy_ns += self.now_ns().saturating_sub(since);
                }
            }
            if got >= wait_for {
                return Ok(());
            }
            let Some(&Reverse((due, _, _))) = self.due.peek() else { return Ok(()) };
            let sleep_from = self.now_ns();
            std::thread::sleep(Duration::from_nanos(due.saturating_sub(sleep_from)));
            self.stats.wait_ns += self.now_ns().saturating_sub(sleep_from);
        }
    }

    fn in_flight(&self) -> usize {
        self.due.len()
    }

    fn stats(&self) -> IoStats {
        // The open busy period counts, as the real backends' `stats_now` does: the prefetcher
        // takes the device's rate from these counters while reads are still in flight.
        let mut stats = self.stats;
        if let Some(since) = self.busy_since_ns {
            stats.busy_ns += self.now_ns().saturating_sub(since);
        }
        stats
    }

    fn describe(&self) -> String {
        format!(
            "{}: {} modeled drives of {:.2} GB/s ({:.2} GB/s in all), {} us latency, queue depth {} each, \
             striped by {}; bytes copied from the page cache",
            self.model.spec(),
            self.model.drives,
            self.model.rate_bytes_per_s as f64 / 1e9,
            self.model.total_rate() / 1e9,
            self.model.latency_ns as f64 / 1e3,
            self.model.queue_depth,
            super::fmt_bytes(STRIPE_BYTES)
        )
    }

    fn dio_align(&self) -> DioAlign {
        DioAlign { mem_align: MODELED_ALIGN, offset_align: MODELED_ALIGN, source: AlignSource::Default }
    }
}

/// Asks the kernel to drop `path`'s clean pages from the page cache (best effort: a file that
/// cannot be opened, or a kernel that ignores the advice, changes nothing but memory use).
pub fn drop_cached(path: &Path) {
    use std::os::fd::AsRawFd;
    if let Ok(file) = File::open(path) {
        // SAFETY: the descriptor is open for the duration of the call; the advice reads no
        // memory of ours.
        unsafe {
            libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
        }
    }
}

/// Reads `ranges` (file index, first byte, end) of `files` once through the page cache, so a
/// modeled device finds them in memory; returns the bytes read.
pub fn warm_ranges(files: &[PathBuf], ranges: &[(usize, u64, u64)]) -> Result<u64, IoError> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 8 << 20];
    let mut total = 0u64;
    let mut opened: Vec<Option<File>> = files.iter().map(|_| None).collect();
    for &(f, start, end) in ranges {
        let path =
            files.get(f).ok_or_else(|| IoError::BadOp { tag: 0, why: format!("file index {f} out of range") })?;
        let file = match &mut opened[f] {
            Some(file) => file,
            slot => slot.insert(File::open(path).map_err(|source| IoError::Open { path: path.clone(), source })?),
        };
        let mut at = start;
        while at < end {
            let want = ((end - at) as usize).min(buf.len());
            let n = file.read_at(&mut buf[..want], at).map_err(|source| IoError::Read {
                path: path.clone(),
                offset: at,
                len: want,
                source,
            })?;
            if n == 0 {
                break;
            }
            at += n as u64;
            total += n as u64;
        }
    }
    Ok(total)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    use crate::storage::io::{AlignedBuf, BufOptions};

    #[test]
    fn specs_parse_with_defaults_units_and_drive_counts() {
        let m = DeviceModel::parse("sim:7GB/s,80us x4").unwrap();
        assert_eq!(m, DeviceModel { rate_bytes_per_s: 7_000_000_000, latency_ns: 80_000, queue_depth: 32, drives: 4 });
        assert_eq!(DeviceModel::parse("sim:7GB/s,80usx4").unwrap(), m);
        assert_eq!(DeviceModel::parse("sim:7GB/s,80us,x4").unwrap(), m);
        assert_eq!(DeviceModel::parse("sim:7GB/s x4").unwrap(), m);
        let one = DeviceModel::parse("sim:3500MB/s").unwrap();
        assert_eq!((one.rate_bytes_per_s, one.latency_ns, one.drives), (3_500_000_000, LATENCY_DEFAULT_NS, 1));
        let q = DeviceModel::parse("sim:2GiB/s,0.1ms,qd8").unwrap();
        assert_eq!((q.rate_bytes_per_s, q.latency_ns, q.queue_depth), (2 << 30, 100_000, 8));
        assert_eq!(DeviceModel::parse(&m.spec()).unwrap(), m, "spec() reads back");
        let odd = DeviceModel::parse("sim:1.009GB/s,1.009us").unwrap();
        assert_eq!((odd.rate_bytes_per_s, odd.latency_ns), (1_009_000_000, 1009), "rounded, not truncated");
        assert_eq!(DeviceModel::parse(&odd.spec()).unwrap(), odd);
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        for (s, says) in [
            ("sim:", "no rate"),
            ("sim:7", "needs a unit"),
            ("sim:0GB/s", "0.01 to 1000"),
            ("sim:7GB/s x0", "1 to 64"),
            ("sim:7GB/s x65", "1 to 64"),
            ("sim:7GB/s,fast", "neither a latency"),
            ("sim:7GB/s,2s", "neither a latency"),
            ("sim:7GB/s,-5us", "0 to 1 s"),
            ("sim:7GB/s,qd0", "queue depth"),
            ("uring", "expected sim:"),
        ] {
            let e = DeviceModel::parse(s).unwrap_err();
            assert!(e.contains(says), "{s}: {e}");
        }
    }

    /// Reads through the model complete when the model says, with the file's bytes.
    #[test]
    fn reads_arrive_at_the_modeled_rate_with_the_files_bytes() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("shard");
        let data: Vec<u8> = (0..(16u32 << 20)).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        // 2 drives of 1 GB/s: 16 MiB take 8.4 ms, 1 drive would take 16.8 ms.
        let model = DeviceModel::parse("sim:1GB/s,50us x2").unwrap();
        let mut r = ModeledReader::new(std::slice::from_ref(&path), model, 64).unwrap();
        let len = 1usize << 20;
        let dst = AlignedBuf::new(16 * len, &BufOptions::default()).unwrap();
        let start = Instant::now();
        for i in 0..16 {
            // SAFETY: within `dst`, which outlives the reads.
            let at = unsafe { dst.as_mut_ptr().add(i * len) };
            let op = ReadOp::new(0, (i * len) as u64, len, at, i as u64);
            // SAFETY: each op has its own window of `dst`, untouched until reaped below.
            unsafe { r.submit(op).unwrap() };
        }
        let mut out = Vec::new();
        r.reap(&mut out, 16).unwrap();
        let secs = start.elapsed().as_secs_f64();
        assert_eq!(out.len(), 16);
        assert!(out.iter().all(|c| c.result.is_ok()));
        assert_eq!(dst.as_slice(), &data[..]);
        assert!(secs >= 16.0 * len as f64 / 2e9, "delivered faster than 2 GB/s: {secs} s");
        let s = r.stats();
        assert_eq!(s.bytes_read, 16 * len as u64);
        assert!(s.busy_ns as f64 / 1e9 >= 16.0 * len as f64 / 2e9);
        // Completions come back in due order: the stripes alternate drives, so the reads are
        // due in submission order.
        let tags: Vec<u64> = out.iter().map(|c| c.tag).collect();
        assert_eq!(tags, (0..16).collect::<Vec<_>>());
    }

    /// The model's arithmetic, without the clock: stripes alternate drives, a drive serves one
    /// transfer at a time, latency overlaps earlier transfers, and a full queue delays acceptance.
    #[test]
    fn due_times_follow_the_model_exactly() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        std::fs::write(&path, vec![0u8; 4 << 20]).unwrap();
        // 1 GB/s = 1 ns per byte; a stripe (524288 bytes) takes 524288 ns.
        let stripe = STRIPE_BYTES;
        let mut two =
            ModeledReader::new(std::slice::from_ref(&path), DeviceModel::parse("sim:1GB/s,10us x2").unwrap(), 8)
                .unwrap();
        // Two stripes at time 0: one per drive, both done after latency + one stripe.
        assert_eq!(two.schedule(0, 0, 2 * stripe, 0), 10_000 + stripe);
        // The next two stripes queue behind them on the same drives.
        assert_eq!(two.schedule(0, 2 * stripe, 2 * stripe, 0), 10_000 + 2 * stripe);
        // File 1's stripe 0 lives on drive 1, whose transfer engine is busy until then too.
        assert_eq!(two.schedule(1, 0, 4096, 0), 10_000 + 2 * stripe + 4096);
        let mut one =
            ModeledReader::new(std::slice::from_ref(&path), DeviceModel::parse("sim:1GB/s,10us x1").unwrap(), 8)
                .unwrap();
        // The same four stripes on one drive take twice as long.
        assert_eq!(one.schedule(0, 0, 4 * stripe, 0), 10_000 + 4 * stripe);
        // Queue depth 1: each command is accepted when the one before it is done, so every one
        // pays the latency.
        let mut qd1 =
            ModeledReader::new(std::slice::from_ref(&path), DeviceModel::parse("sim:1GB/s,10us,qd1").unwrap(), 8)
                .unwrap();
        assert_eq!(qd1.schedule(0, 0, 4096, 0), 10_000 + 4096);
        assert_eq!(qd1.schedule(0, 4096, 4096, 0), 2 * (10_000 + 4096));
        // A command submitted after the drive went idle starts from its own submission.
        assert_eq!(qd1.schedule(0, 0, 4096, 1_000_000), 1_000_000 + 10_000 + 4096);
    }

    #[test]
    fn a_read_past_the_end_fails_as_on_the_real_backends() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("short");
        std::fs::write(&path, vec![1u8; 5000]).unwrap();
        let mut r =
            ModeledReader::new(std::slice::from_ref(&path), DeviceModel::parse("sim:5GB/s").unwrap(), 4).unwrap();
        let dst = AlignedBuf::new(8192, &BufOptions::default()).unwrap();
        let mut op = ReadOp::new(0, 4096, 4096, dst.as_mut_ptr(), 1);
        op.min_len = 904;
        // SAFETY: `dst` outlives the reap below and is not touched before it.
        unsafe { r.submit(op).unwrap() };
        // SAFETY: within `dst`.
        let second = unsafe { dst.as_mut_ptr().add(4096) };
        let op = ReadOp::new(0, 4096, 4096, second, 2);
        // SAFETY: as above, a distinct window.
        unsafe { r.submit(op).unwrap() };
        let mut out = Vec::new();
        r.reap(&mut out, 2).unwrap();
        assert!(out[0].result.is_ok());
        assert!(matches!(out[1].result, Err(IoError::ShortRead { got: 904, .. })), "{:?}", out[1].result);
        assert_eq!(r.stats().ops_failed, 1);
        // What the real backends refuse, it refuses: a misaligned offset, a file it has not.
        let op = ReadOp::new(0, 100, 4096, dst.as_mut_ptr(), 3);
        // SAFETY: refused before anything is written.
        assert!(matches!(unsafe { r.submit(op) }, Err(IoError::Unaligned { .. })));
        let op = ReadOp::new(3, 0, 4096, dst.as_mut_ptr(), 4);
        // SAFETY: as above.
        assert!(matches!(unsafe { r.submit(op) }, Err(IoError::BadOp { .. })));
    }

    /// The queue depth and latency are modeled: one drive at queue depth 1 pays the latency per
    /// command, so 8 commands of 4 KiB take 8 latencies.
    #[test]
    fn queue_depth_one_pays_the_latency_per_command() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        std::fs::write(&path, vec![3u8; 1 << 20]).unwrap();
        let model = DeviceModel::parse("sim:100GB/s,2ms,qd1").unwrap();
        let mut r = ModeledReader::new(std::slice::from_ref(&path), model, 8).unwrap();
        let dst = AlignedBuf::new(8 * 4096, &BufOptions::default()).unwrap();
        let start = Instant::now();
        for i in 0..8 {
            // SAFETY: within `dst`, which outlives the reads.
            let at = unsafe { dst.as_mut_ptr().add(i * 4096) };
            let op = ReadOp::new(0, (i * 4096) as u64, 4096, at, i as u64);
            // SAFETY: distinct windows of `dst`, untouched until reaped.
            unsafe { r.submit(op).unwrap() };
        }
        let mut out = Vec::new();
        r.reap(&mut out, 8).unwrap();
        assert!(start.elapsed() >= Duration::from_millis(16), "{:?}", start.elapsed());
    }
    /// Reads that fall due together come back one per `reap(out, 1)` (and at most one per
    /// `reap(out, 0)`), each as soon as its copy is done, so the I/O thread wakes its waiter and
    /// refills the queue between copies; the rest stay in flight, in due order.
    #[test]
    fn due_reads_come_back_one_copy_at_a_time() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        let data: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let model = DeviceModel::parse("sim:100GB/s,1us").unwrap();
        let mut r = ModeledReader::new(std::slice::from_ref(&path), model, 8).unwrap();
        let len = 128usize << 10;
        let dst = AlignedBuf::new(8 * len, &BufOptions::default()).unwrap();
        for i in 0..8 {
            // SAFETY: within `dst`, which outlives the reads.
            let at = unsafe { dst.as_mut_ptr().add(i * len) };
            let op = ReadOp::new(0, (i * len) as u64, len, at, i as u64);
            // SAFETY: distinct windows of `dst`, untouched until reaped.
            unsafe { r.submit(op).unwrap() };
        }
        // Every read is due long before this sleep ends (8 x 128 KiB at 100 GB/s: ~11 us).
        std::thread::sleep(Duration::from_millis(20));
        let mut out = Vec::new();
        r.reap(&mut out, 1).unwrap();
        assert_eq!((out.len(), r.in_flight()), (1, 7));
        r.reap(&mut out, 0).unwrap();
        assert_eq!((out.len(), r.in_flight()), (2, 6));
        r.reap(&mut out, 6).unwrap();
        assert_eq!((out.len(), r.in_flight()), (8, 0));
        let tags: Vec<u64> = out.iter().map(|c| c.tag).collect();
        assert_eq!(tags, (0..8).collect::<Vec<_>>());
        assert!(out.iter().all(|c| c.result.is_ok()));
        assert_eq!(dst.as_slice(), &data[..8 * len]);
    }
}
