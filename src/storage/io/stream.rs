//! [`ReadStream`]: a thread that keeps reads in flight through a backend until stopped, for
//! measuring what reads cost compute (`bench`'s read tax, `engine::read_tax`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use serde::Serialize;

use super::probe::RandomWindows;
use super::{AlignedBuf, BufOptions, IoError, ReadBackend, ReadOp};

/// Builds the stream's backend on its thread, over the buffer the reads target and for that
/// many reads in flight.
pub type BackendBuilder = Box<dyn FnOnce(Arc<AlignedBuf>, usize) -> Result<Box<dyn ReadBackend>, IoError> + Send>;

/// What the stream reads: windows of `read_bytes` (a multiple of `align`) at random aligned
/// offsets of `ranges` (file index, first byte, end), `reads_in_flight` at a time.
#[derive(Clone, Debug)]
pub struct StreamReads {
    pub ranges: Vec<(usize, u64, u64)>,
    pub read_bytes: usize,
    pub align: u64,
    pub reads_in_flight: usize,
}

/// What a stream read while it ran.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct StreamTotals {
    pub bytes: u64,
    /// Seconds with at least one read in flight (the backend's own count).
    pub busy_seconds: f64,
    pub wall_seconds: f64,
}

impl StreamTotals {
    /// Bytes per second of wall time.
    pub fn rate(&self) -> f64 {
        if self.wall_seconds > 0.0 {
            self.bytes as f64 / self.wall_seconds
        } else {
            0.0
        }
    }
}

/// A thread that keeps reads in flight until stopped (or dropped).
pub struct ReadStream {
    stop: Arc<AtomicBool>,
    /// Bytes of the reads completed so far, for measuring a window of the stream's life.
    bytes: Arc<AtomicU64>,
    thread: Option<JoinHandle<Result<StreamTotals, IoError>>>,
}

impl Drop for ReadStream {
    /// A stream dropped without [`ReadStream::stop`] (a panic between the two) stops reading
    /// and is joined, so no thread reads on unseen.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl ReadStream {
    /// Starts reading `reads` through the backend `build` makes (on the stream's thread, over a
    /// buffer of `reads_in_flight` windows); fails if it cannot be built or no range holds a read.
    pub fn start(reads: &StreamReads, build: BackendBuilder) -> Result<ReadStream, IoError> {
        let len = reads.read_bytes as u64;
        let mut windows = RandomWindows::new(&reads.ranges, len, reads.align.max(1), 0x7a5)?;
        let ops = reads.reads_in_flight.max(1);
        let buf = Arc::new(AlignedBuf::new(ops * len as usize, &BufOptions::default())?);
        let registered = Arc::clone(&buf);
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let bytes = Arc::new(AtomicU64::new(0));
        let counted = Arc::clone(&bytes);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("k3ring-read-tax".to_owned())
            .spawn(move || -> Result<StreamTotals, IoError> {
                let mut b = match build(registered, ops) {
                    Ok(b) => {
                        let _ = ready_tx.send(Ok(()));
                        b
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return Err(e);
                    }
                };
                let mut free: Vec<usize> = (0..ops).collect();
                let mut done = Vec::with_capacity(ops);
                let start = Instant::now();
                while !stopped.load(Ordering::Relaxed) {
                    while let Some(slot) = free.pop() {
                        let (file, offset) = windows.next_window();
                        // SAFETY: `slot` is a distinct `len`-byte window of `buf` (sized `ops` windows),
                        // which this closure owns until after the backend is dropped (captures drop
                        // after the body's locals, and a backend's drop waits for its reads).
                        let dst = unsafe { buf.as_mut_ptr().add(slot * len as usize) };
                        let op = ReadOp::new(file, offset, len as usize, dst, slot as u64);
                        // SAFETY: as above; the window is handed out again only after this read's
                        // completion has been reaped.
                        unsafe { b.submit(op)? };
                    }
                    done.clear();
                    b.reap(&mut done, 1)?;
                    for c in done.drain(..) {
                        c.result?;
                        free.push(c.tag as usize);
                        counted.fetch_add(len, Ordering::Relaxed);
                    }
                }
                // Every read must finish before its buffer can go.
                let in_flight = b.in_flight();
                b.reap(&mut done, in_flight)?;
                let s = b.stats();
                Ok(StreamTotals {
                    bytes: s.bytes_read,
                    busy_seconds: s.busy_ns as f64 / 1e9,
                    wall_seconds: start.elapsed().as_secs_f64(),
                })
            })
            .map_err(|source| IoError::Setup { what: "the read-tax stream thread".to_owned(), source })?;
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(ReadStream { stop, bytes, thread: Some(thread) }),
            Ok(Err(_)) | Err(_) => match thread.join() {
                Ok(Err(e)) => Err(e),
                _ => Err(IoError::Setup {
                    what: "the read-tax stream".to_owned(),
                    source: std::io::Error::other("its thread exited before reporting"),
                }),
            },
        }
    }

    /// Bytes of the reads completed so far.
    pub fn bytes_so_far(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Stops issuing, waits for the reads in flight, and says what was read.
    pub fn stop(mut self) -> Result<StreamTotals, IoError> {
        self.stop.store(true, Ordering::Relaxed);
        let joined = self.thread.take().map(JoinHandle::join);
        match joined {
            Some(Ok(r)) => r,
            _ => Err(IoError::Setup {
                what: "the read-tax stream".to_owned(),
                source: std::io::Error::other("its thread panicked"),
            }),
        }
    }
}
