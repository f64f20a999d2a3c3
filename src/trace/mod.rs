//! [`Tracer`]: timed spans and counters, on in every run. It is the source of the run report's
//! busy and overlap fractions ([`Tracer::metrics`]) and, with `detail`, of the `--trace FILE`
//! Chrome trace-event JSON that Perfetto and `chrome://tracing` open. This file owns the public
//! API and the options; the work is in:
//!
//! - `kind`: [`SpanKind`] and [`ComputeOp`], what a span is, chosen when it opens;
//! - `args`: [`SpanArgs`], the values shown with a span;
//! - `recorder`: shards, the thread registry, open-guard stacks, [`SpanGuard`];
//! - `intervals`: the interval set and union, clip, measure and intersection;
//! - `fold`: folding old intervals into totals, and the [`Metrics`] summary;
//! - `chrome`: the Chrome JSON export.
//!
//! Threads: any thread may record (the I/O thread, the rayon compute threads, the scheduler); a
//! tracer is shared by reference or `Arc`. Recording takes one uncontended shard lock: each thread
//! gets an index on first use and records into shard `index % SHARD_COUNT`, so two threads share
//! a lock only when there are more than `SHARD_COUNT` of them. A [`SpanGuard`] is `!Send`: it ends
//! on the thread that opened it, because it is drawn on that thread's track.
//!
//! Metrics. A span's [`SpanKind`] alone decides what it counts in, never its name. "Busy" for a
//! stage is the measure of the union over time of its spans; overlap is the measure of (union of
//! `Io` spans) ∩ (union of `Compute` spans); stall is the union of `Wait` spans (other scheduler
//! spans count in nothing). With `detail` they are computed exactly from the kept events. Without
//! it, each shard keeps, per metric track, a sorted list of disjoint intervals merged on insert,
//! and a fold periodically moves everything older than `now - fold_lag_us` into scalar totals, so
//! memory stays bounded by the spans of the last lag window. Spans still open at a fold are
//! credited up to the fold horizon through a per-thread stack of open guard starts (they will
//! cover that time when they end), so long outer spans do not pin the horizon. Only a
//! [`Tracer::complete`] span that arrives more than `fold_lag_us` after its start can lose its
//! older part; [`Tracer::late_us`] reports how much.
//!
//! Allocation: [`Tracer::new`] allocates the shards and the thread table; a thread's first span
//! allocates its name and open-guard stack; then recording allocates only when an interval list or
//! (with `detail`) the event list grows. Nothing here prints; errors are [`TraceError`].
#![forbid(unsafe_code)]

mod args;
mod chrome;
mod flows;
mod fold;
mod intervals;
mod kind;
mod recorder;
#[cfg(test)]
mod testing;

use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

pub use args::{ArgValue, SpanArgs};
pub use chrome::TraceError;
pub use fold::Metrics;
pub use kind::{ComputeOp, SpanKind, Stage};
pub use recorder::SpanGuard;

use fold::FoldState;
use recorder::{OpenSlot, Shard, ThreadRegistry};

/// Lock shards; threads beyond this count share locks (never data races, only contention).
pub const SHARD_COUNT: usize = 64;
/// Threads that get their own track and open-guard stack; later threads share one track named
/// `other-threads` and their open guards are not credited at folds.
pub const THREADS_MAX: usize = 1024;
/// Open guards tracked per thread and metric track; deeper guards are still recorded, and are
/// covered at folds by their (tracked) enclosing guards.
pub const OPEN_GUARDS_MAX: usize = 16;
/// Default [`TracerOptions::fold_lag_us`]: an I/O read measured with `complete` must be recorded
/// within this long of its start (NVMe reads take 0.1 to 10 ms, so 1 s leaves a wide margin).
pub const FOLD_LAG_US_DEFAULT: f64 = 1_000_000.0;
/// Default [`TracerOptions::shard_intervals_max`]: a shard's interval list longer than this asks
/// for a fold (16 bytes an interval, so 64 KiB per list before a fold is asked for).
pub const SHARD_INTERVALS_MAX_DEFAULT: usize = 4096;

/// Tracer settings; [`TracerOptions::new`] gives the defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TracerOptions {
    /// Keep every event for [`Tracer::write_chrome_json`]; memory grows with the run.
    pub detail: bool,
    /// Without `detail`: intervals older than `now - fold_lag_us` are folded into totals. A
    /// `complete` span recorded later than this after its start loses its older part.
    pub fold_lag_us: f64,
    /// Without `detail`: an interval list longer than this asks for a fold.
    pub shard_intervals_max: usize,
}

impl TracerOptions {
    pub const fn new(detail: bool) -> Self {
        TracerOptions { detail, fold_lag_us: FOLD_LAG_US_DEFAULT, shard_intervals_max: SHARD_INTERVALS_MAX_DEFAULT }
    }
}

/// Records spans and counters; see the module doc. `Send + Sync`.
pub struct Tracer {
    id: u64,
    origin: Instant,
    options: TracerOptions,
    /// `options.detail`, or forced on by tests that check folding against exact metrics.
    keep_events: bool,
    shards: Box<[Shard]>,
    /// Per thread index; filled when the thread first records (only without `detail`).
    open_slots: Box<[OnceLock<Box<OpenSlot>>]>,
    threads: Mutex<ThreadRegistry>,
    fold: Mutex<FoldState>,
    /// `FoldState::folded_until_us` as f64 bits, read without the fold lock when recording.
    folded_until_bits: AtomicU64,
    /// Earliest `now_us` at which recording may ask for another fold (f64 bits).
    next_fold_bits: AtomicU64,
    /// The next id of a [`Tracer::complete_async`] span (from 1: 0 means a thread-track span).
    next_async_id: AtomicU64,
    /// When not NaN, `now_us` returns this: tests drive folds with synthetic time.
    #[cfg(test)]
    fake_now_bits: AtomicU64,
}

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracer").field("id", &self.id).field("options", &self.options).finish_non_exhaustive()
    }
}

impl Tracer {
    /// A tracer whose clock starts now. `detail` keeps every event for
    /// [`Tracer::write_chrome_json`]; without it memory stays bounded.
    pub fn new(detail: bool) -> Self {
        Self::with_options(TracerOptions::new(detail))
    }

    /// # Panics
    /// If `fold_lag_us` is negative or not finite, or `shard_intervals_max` is 0.
    pub fn with_options(options: TracerOptions) -> Self {
        assert!(options.fold_lag_us.is_finite(), "fold_lag_us must be finite");
        assert!(options.fold_lag_us >= 0.0, "fold_lag_us must not be negative");
        assert!(options.shard_intervals_max > 0, "shard_intervals_max must be positive");
        Tracer {
            id: recorder::next_tracer_id(),
            origin: Instant::now(),
            options,
            keep_events: options.detail,
            shards: (0..SHARD_COUNT).map(|_| Shard::new()).collect(),
            open_slots: (0..THREADS_MAX).map(|_| OnceLock::new()).collect(),
            threads: Mutex::new(ThreadRegistry::default()),
            fold: Mutex::new(FoldState::new()),
            folded_until_bits: AtomicU64::new(f64::NEG_INFINITY.to_bits()),
            next_fold_bits: AtomicU64::new(f64::NEG_INFINITY.to_bits()),
            next_async_id: AtomicU64::new(1),
            #[cfg(test)]
            fake_now_bits: AtomicU64::new(f64::NAN.to_bits()),
        }
    }

    /// The options this tracer was created with.
    pub fn options(&self) -> TracerOptions {
        self.options
    }

    /// Microseconds since the tracer started (monotonic: `Instant`).
    pub fn now_us(&self) -> f64 {
        #[cfg(test)]
        {
            let fake = f64::from_bits(self.fake_now_bits.load(std::sync::atomic::Ordering::Relaxed));
            if !fake.is_nan() {
                return fake;
            }
        }
        let d = self.origin.elapsed();
        d.as_secs() as f64 * 1e6 + f64::from(d.subsec_nanos()) * 1e-3
    }

    /// Opens a span of `kind` on the calling thread's track for its stage; it ends when the
    /// guard drops. A [`ComputeOp`] converts: `tracer.span(ComputeOp::Head)`; a scheduler wait
    /// for bytes is `tracer.span(SpanKind::Wait)`.
    pub fn span(&self, kind: impl Into<SpanKind>) -> SpanGuard<'_> {
        self.open_span(kind.into(), SpanArgs::new())
    }

    /// [`Tracer::span`] with arguments shown in the trace viewer (see also
    /// [`SpanGuard::set_args`]).
    pub fn span_args(&self, kind: impl Into<SpanKind>, args: SpanArgs) -> SpanGuard<'_> {
        self.open_span(kind.into(), args)
    }

    /// Records a span measured elsewhere (an I/O read whose submit and completion times are
    /// known, `SpanKind::Io("expert read")`), on the calling thread's track for its stage.
    /// Times come from [`Tracer::now_us`].
    ///
    /// # Panics
    /// If `start_us` is not finite or `end_us < start_us`.
    pub fn complete(&self, kind: impl Into<SpanKind>, start_us: f64, end_us: f64, args: SpanArgs) {
        let kind = kind.into();
        let name = kind.name();
        assert!(start_us.is_finite(), "span {name}: start {start_us} is not finite");
        assert!(end_us >= start_us, "span {name}: end {end_us} is before start {start_us}");
        self.record_span(self.thread_index(), kind, start_us, end_us, args, true, 0);
    }

    /// [`Tracer::complete`] for a span that may overlap others of the calling thread without
    /// nesting (reads in flight on the I/O thread): the trace-event format allows no such `X`
    /// slices on one track, so it is exported as an async slice (`b`/`e` with an id of its own)
    /// named after its `kind` argument and name ("demand expert read"). Counts in the metrics as
    /// [`Tracer::complete`] does.
    ///
    /// # Panics
    /// If `start_us` is not finite or `end_us < start_us`.
    pub fn complete_async(&self, kind: impl Into<SpanKind>, start_us: f64, end_us: f64, args: SpanArgs) {
        let kind = kind.into();
        let name = kind.name();
        assert!(start_us.is_finite(), "span {name}: start {start_us} is not finite");
        assert!(end_us >= start_us, "span {name}: end {end_us} is before start {start_us}");
        let id = self.next_async_id.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.record_span(self.thread_index(), kind, start_us, end_us, args, true, id);
    }

    /// Records a counter sample (bytes in flight, pool occupancy) at the current time.
    pub fn counter(&self, name: &'static str, value: f64) {
        self.record_counter(name, value);
    }

    /// Starts the metrics window now: discards what was measured so far and clips later spans
    /// at this time. Use it (with [`Tracer::mark_end`]) to measure just the decode phase.
    pub fn mark_start(&self) {
        self.mark_start_at(self.now_us());
    }

    /// [`Tracer::mark_start`] at a given time.
    pub fn mark_start_at(&self, t_us: f64) {
        assert!(t_us.is_finite(), "mark_start_at({t_us}): time is not finite");
        let mut fold = self.reset_locked();
        fold.window_start_us = Some(t_us);
    }

    /// Ends the metrics window now: spans are clipped at this time and wall ends here.
    pub fn mark_end(&self) {
        self.mark_end_at(self.now_us());
    }

    /// [`Tracer::mark_end`] at a given time. Without `detail`, a time older than the fold lag
    /// is raised to the folded horizon (that time is already in the totals).
    pub fn mark_end_at(&self, t_us: f64) {
        assert!(t_us.is_finite(), "mark_end_at({t_us}): time is not finite");
        let mut fold = recorder::lock(&self.fold);
        fold.window_end_us = Some(t_us.max(fold.folded_until_us));
    }

    /// Forgets everything measured so far and both marks; later metrics cover only spans
    /// recorded after this call. Kept events (for the trace file) are not touched.
    pub fn reset_metrics(&self) {
        drop(self.reset_locked());
    }

    /// Microseconds of `complete` spans dropped because they arrived after their time was
    /// folded (only without `detail`; raise `fold_lag_us` if this is not 0).
    pub fn late_us(&self) -> f64 {
        self.late_us_total()
    }

    /// Busy, overlap and stall over the metrics window (see the module doc). Spans still open
    /// are not counted, except (without `detail`) the part already folded.
    pub fn metrics(&self) -> Metrics {
        self.metrics_now()
    }

    /// The summed durations, in seconds, of the kept compute spans of one of `ops` that ended
    /// after the last metrics reset; `None` when events are not kept (created without
    /// `detail`). A sum, not a union like [`Tracer::metrics`]: nested spans, or spans on
    /// several threads at once, count once each; a span open across the reset counts whole.
    pub fn span_seconds(&self, ops: &[ComputeOp]) -> Option<f64> {
        if !self.keep_events {
            return None;
        }
        Some(self.kept_compute_us(ops) / 1e6)
    }

    /// Writes every kept event as Chrome trace-event JSON (open it in Perfetto or
    /// chrome://tracing). Needs `detail`.
    pub fn write_chrome_json(&self, out: &crate::files::Output) -> Result<(), TraceError> {
        self.write_chrome_file(out)
    }
}
