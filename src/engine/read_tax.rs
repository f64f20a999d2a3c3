//! The read tax: what a read in flight costs compute on this host.
//!
//! The floors of `bench` assume an overlapped read costs compute nothing. Hosts differ: on a
//! first-generation EPYC VM resident decode ran 1.55x slower while an O_DIRECT `dd` read beside
//! it, on a Zen 4 VM 1.10-1.13x, and a server whose NVMe sits on PCIe pays less still. So
//! `bench` measures it: resident decode alone, then with a background stream of reads issued
//! through the engine's own backend (the same kind, queue depth and piece size as the cells,
//! reading expert-sized windows of the shards at random), alternated and repeated. Per pair,
//!
//! ```text
//! tau      = (loaded - quiet) / loaded          compute seconds lost per second of reading
//! per byte = (loaded - quiet) / (loaded * rate)  compute seconds lost per byte read
//! ```
//!
//! (the stream reads for the whole loaded run, so every second of it is a second of reading).
//! A floor with the tax charged adds `per byte x bytes read` to the compute; per byte rather
//! than per second, because both a host's disk emulation and the copy that stands in for DMA
//! on a modeled device (`--io sim:`) cost CPU per byte moved.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use serde::Serialize;

use super::measure::{measure_resident, measure_resident_with, MeasureError, MeasureSpec};
use crate::pipeline::{BackendSpec, IoOptions};
use crate::storage::io::stream::{ReadStream, StreamReads};
use crate::storage::io::IoError;

/// What the background stream reads, and through which backend.
#[derive(Clone, Debug)]
pub struct StreamSpec {
    pub files: Vec<PathBuf>,
    /// (file index, first byte, end) windows are drawn from.
    pub ranges: Vec<(usize, u64, u64)>,
    /// Bytes per logical read (one expert, as the cells read).
    pub read_bytes: usize,
    /// The cells' backend, queue depth and piece size.
    pub io: IoOptions,
    /// Alignment of every read (the files' direct-I/O alignment).
    pub align: u64,
}

/// Logical reads the stream keeps in flight: enough to fill the backend's queue of pieces.
fn reads_in_flight(spec: &StreamSpec, len: usize) -> usize {
    let window = spec.io.queue_depth.max(1) as usize * spec.io.chunk_bytes.max(1);
    window.div_ceil(len.max(1)).clamp(2, 64)
}

/// Starts `spec`'s stream through the backend the cells use.
pub fn start_stream(spec: &StreamSpec) -> Result<ReadStream, IoError> {
    let align = spec.align.max(512);
    let len = (spec.read_bytes as u64).div_ceil(align) * align;
    let reads = StreamReads {
        ranges: spec.ranges.clone(),
        read_bytes: len as usize,
        align,
        reads_in_flight: reads_in_flight(spec, len as usize),
    };
    let chunk = (spec.io.chunk_bytes as u64).max(align) / align * align;
    let (files, opts) =
        (spec.files.clone(), IoOptions { chunk_bytes: chunk as usize, inject: None, ..spec.io.clone() });
    ReadStream::start(
        &reads,
        Box::new(move |buf, ops_max| {
            BackendSpec { files, opts, align: align as u32, registered: vec![buf], ops_max }.build()
        }),
    )
}

/// One quiet/loaded pair.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct TaxSample {
    pub quiet_seconds_per_token: f64,
    pub loaded_seconds_per_token: f64,
    /// The stream's rate over the loaded run's timed tokens.
    pub read_rate: f64,
    pub stream_bytes: u64,
    pub stream_busy_seconds: f64,
    pub tau: f64,
    pub seconds_per_gb: f64,
}

/// The read tax: the median and spread of the samples.
#[derive(Clone, Debug, Serialize)]
pub struct ReadTax {
    /// What the stream read through (`uring`, `sim:...`).
    pub backend: String,
    /// Compute seconds lost per second of reading: median, lowest, highest.
    pub tau: f64,
    pub tau_min: f64,
    pub tau_max: f64,
    /// Compute seconds lost per GB read: median, lowest, highest. The floors charge the median,
    /// or nothing when it is negative (noise on a host that charges nothing).
    pub seconds_per_gb: f64,
    pub seconds_per_gb_min: f64,
    pub seconds_per_gb_max: f64,
    /// The stream's median rate while loaded.
    pub read_rate: f64,
    /// Every loaded run produced the quiet runs' ids.
    pub ids_identical: bool,
    pub samples: Vec<TaxSample>,
}

impl ReadTax {
    /// Compute seconds a run that reads `bytes` loses to its reads (never negative).
    pub fn charge(&self, bytes: f64) -> f64 {
        self.seconds_per_gb.max(0.0) * bytes / 1e9
    }
}

fn median_min_max(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match (v.first(), v.last()) {
        (Some(&lo), Some(&hi)) if n % 2 == 1 => (v[n / 2], lo, hi),
        (Some(&lo), Some(&hi)) => ((v[n / 2 - 1] + v[n / 2]) / 2.0, lo, hi),
        _ => (0.0, 0.0, 0.0),
    }
}

/// Why the probe failed: a run, or the stream.
#[derive(Debug, thiserror::Error)]
pub enum TaxError {
    #[error(transparent)]
    Measure(#[from] MeasureError),
    #[error("the read-tax stream: {0}")]
    Stream(#[from] IoError),
}

impl crate::exit::Classify for TaxError {
    fn exit_code(&self) -> crate::exit::ExitCode {
        match self {
            TaxError::Measure(e) => e.exit_code(),
            TaxError::Stream(e) => e.exit_code(),
        }
    }
}

/// Measures the tax: `repeats` pairs of resident decode, quiet then with the stream, alternated.
pub fn measure_read_tax(
    model: &Path,
    kernels: kernels::Kernels,
    threads: usize,
    spec: &MeasureSpec,
    stream: &StreamSpec,
    repeats: usize,
) -> Result<ReadTax, TaxError> {
    let mut samples = Vec::new();
    let mut ids_identical = true;
    for _ in 0..repeats.max(1) {
        let quiet = measure_resident(model, kernels, threads, spec)?;
        let running = start_stream(stream)?;
        let mut window_start = 0;
        let loaded = measure_resident_with(model, kernels, threads, spec, || window_start = running.bytes_so_far());
        let window_bytes = running.bytes_so_far().saturating_sub(window_start);
        let totals = running.stop()?;
        let loaded = loaded?;
        ids_identical &= loaded.ids == quiet.ids;
        let lost = loaded.seconds_per_token - quiet.seconds_per_token;
        // The stream's rate over the timed tokens only (loading the model and the warm-up ran
        // beside it too, at whatever rate they left it).
        let window_seconds = loaded.seconds_per_token * spec.tokens.max(1) as f64;
        let rate = if window_bytes > 0 {
            window_bytes as f64 / window_seconds.max(1e-9)
        } else {
            // A window shorter than one read (a tiny model) saw none complete: the stream's own
            // rate while it was busy stands in.
            totals.bytes as f64 / totals.busy_seconds.max(1e-9)
        };
        samples.push(TaxSample {
            quiet_seconds_per_token: quiet.seconds_per_token,
            loaded_seconds_per_token: loaded.seconds_per_token,
            read_rate: rate,
            stream_bytes: totals.bytes,
            stream_busy_seconds: totals.busy_seconds,
            tau: lost / loaded.seconds_per_token.max(1e-12),
            seconds_per_gb: if rate > 0.0 { lost / (loaded.seconds_per_token * rate / 1e9) } else { 0.0 },
        });
    }
    let (tau, tau_min, tau_max) = median_min_max(samples.iter().map(|s| s.tau).collect());
    let (spg, spg_min, spg_max) = median_min_max(samples.iter().map(|s| s.seconds_per_gb).collect());
    let (read_rate, _, _) = median_min_max(samples.iter().map(|s| s.read_rate).collect());
    let backend = stream.io.kind.display_name();
    Ok(ReadTax {
        backend,
        tau,
        tau_min,
        tau_max,
        seconds_per_gb: spg,
        seconds_per_gb_min: spg_min,
        seconds_per_gb_max: spg_max,
        read_rate,
        ids_identical,
        samples,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_charge_is_per_byte_and_never_negative() {
        let mut t = ReadTax {
            backend: "uring".into(),
            tau: 0.2,
            tau_min: 0.1,
            tau_max: 0.3,
            seconds_per_gb: 0.05,
            seconds_per_gb_min: 0.0,
            seconds_per_gb_max: 0.1,
            read_rate: 4e9,
            ids_identical: true,
            samples: Vec::new(),
        };
        assert!((t.charge(2e9) - 0.1).abs() < 1e-12);
        t.seconds_per_gb = -0.01;
        assert_eq!(t.charge(2e9), 0.0);
        assert_eq!(median_min_max(vec![3.0, 1.0, 2.0]), (2.0, 1.0, 3.0));
        assert_eq!(median_min_max(vec![4.0, 1.0, 2.0, 3.0]), (2.5, 1.0, 4.0));
    }

    /// The stream really reads through the backend it is given, and stops.
    #[test]
    fn a_stream_reads_until_stopped() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("shard");
        std::fs::write(&path, vec![5u8; 8 << 20]).unwrap();
        let io = IoOptions {
            kind: crate::pipeline::IoKind::parse("sim:2GB/s,20us x2").unwrap(),
            queue_depth: 8,
            ..IoOptions::default()
        };
        let spec =
            StreamSpec { files: vec![path], ranges: vec![(0, 0, 8 << 20)], read_bytes: 1 << 20, io, align: 4096 };
        let s = start_stream(&spec).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        let t = s.stop().unwrap();
        assert!(t.bytes >= 8 << 20, "{t:?}");
        assert!(t.rate() <= 4.4e9, "faster than the modeled 4 GB/s: {t:?}");
        assert!(t.busy_seconds > 0.03, "{t:?}");
    }
}
