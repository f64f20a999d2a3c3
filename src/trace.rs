//! [`Tracer`]: timed spans and counters, on in every run. It is the source of the run report's
//! busy and overlap fractions ([`Tracer::metrics`]) and, with `detail`, of the `--trace FILE`
//! Chrome trace-event JSON that Perfetto and `chrome://tracing` open.
//!
//! Threads: any thread may record (the I/O thread, the rayon compute threads, the scheduler); a
//! tracer is shared by reference or `Arc`. Recording takes one uncontended shard lock: each thread
//! gets an index on first use and records into shard `index % SHARD_COUNT`, so two threads share
//! a lock only when there are more than `SHARD_COUNT` of them. A [`SpanGuard`] is `!Send`: it ends
//! on the thread that opened it, because it is drawn on that thread's track.
//!
//! Metrics. "Busy" for a stage is the measure of the union over time of its spans; overlap is the
//! measure of (union of Io spans) ∩ (union of Compute spans); stall is the union of Scheduler
//! spans named `"wait"`. With `detail` they are computed exactly from the kept events. Without
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

use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError, TryLockError};
use std::time::Instant;

use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

use crate::exit::{Classify, ExitCode};

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

/// The pipeline stage a span belongs to; it is the trace category and half of the track key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    Io,
    Compute,
    Scheduler,
}

impl Stage {
    pub const ALL: [Stage; 3] = [Stage::Io, Stage::Compute, Stage::Scheduler];

    /// The name used as the Chrome `cat` and in track names.
    pub const fn as_str(self) -> &'static str {
        match self {
            Stage::Io => "io",
            Stage::Compute => "compute",
            Stage::Scheduler => "scheduler",
        }
    }

    const fn index(self) -> usize {
        self as usize
    }
}

/// One free-form span argument value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ArgValue {
    U64(u64),
    I64(i64),
    F64(f64),
    Str(&'static str),
}

impl Serialize for ArgValue {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match *self {
            ArgValue::U64(v) => s.serialize_u64(v),
            ArgValue::I64(v) => s.serialize_i64(v),
            ArgValue::F64(v) => s.serialize_f64(v),
            ArgValue::Str(v) => s.serialize_str(v),
        }
    }
}

impl From<u64> for ArgValue {
    fn from(v: u64) -> Self {
        ArgValue::U64(v)
    }
}
impl From<u32> for ArgValue {
    fn from(v: u32) -> Self {
        ArgValue::U64(u64::from(v))
    }
}
impl From<i64> for ArgValue {
    fn from(v: i64) -> Self {
        ArgValue::I64(v)
    }
}
impl From<f64> for ArgValue {
    fn from(v: f64) -> Self {
        ArgValue::F64(v)
    }
}
impl From<&'static str> for ArgValue {
    fn from(v: &'static str) -> Self {
        ArgValue::Str(v)
    }
}

/// Arguments shown with a span in the trace viewer. Fixed-size and `Copy`, so passing them costs
/// nothing when `detail` is off. Build with `SpanArgs::new().layer(3).expert(17).bytes(n)`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpanArgs {
    pub layer: Option<u32>,
    pub expert: Option<u32>,
    pub bytes: Option<u64>,
    /// An arena slot or buffer index.
    pub slot: Option<u32>,
    /// Why a read was issued: `"speculative"` or `"demand"`.
    pub kind: Option<&'static str>,
    /// One more named value (queue depth, token index, ...).
    pub extra: Option<(&'static str, ArgValue)>,
}

impl SpanArgs {
    pub const fn new() -> Self {
        SpanArgs { layer: None, expert: None, bytes: None, slot: None, kind: None, extra: None }
    }
    pub const fn layer(mut self, layer: u32) -> Self {
        self.layer = Some(layer);
        self
    }
    pub const fn expert(mut self, expert: u32) -> Self {
        self.expert = Some(expert);
        self
    }
    pub const fn bytes(mut self, bytes: u64) -> Self {
        self.bytes = Some(bytes);
        self
    }
    pub const fn slot(mut self, slot: u32) -> Self {
        self.slot = Some(slot);
        self
    }
    pub const fn kind(mut self, kind: &'static str) -> Self {
        self.kind = Some(kind);
        self
    }
    pub fn extra(mut self, key: &'static str, value: impl Into<ArgValue>) -> Self {
        self.extra = Some((key, value.into()));
        self
    }
}

impl Serialize for SpanArgs {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(None)?;
        if let Some(v) = self.layer {
            map.serialize_entry("layer", &v)?;
        }
        if let Some(v) = self.expert {
            map.serialize_entry("expert", &v)?;
        }
        if let Some(v) = self.bytes {
            map.serialize_entry("bytes", &v)?;
        }
        if let Some(v) = self.slot {
            map.serialize_entry("slot", &v)?;
        }
        if let Some(v) = self.kind {
            map.serialize_entry("kind", v)?;
        }
        if let Some((k, v)) = self.extra {
            map.serialize_entry(k, &v)?;
        }
        map.end()
    }
}

/// Busy and overlap over the metrics window, in microseconds and as fractions of the wall time.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Metrics {
    pub wall_us: f64,
    pub io_busy_us: f64,
    pub compute_busy_us: f64,
    pub overlap_us: f64,
    pub io_busy_fraction: f64,
    pub compute_busy_fraction: f64,
    /// Time both Io and Compute were busy, over wall.
    pub overlap_fraction: f64,
    /// Time the scheduler spent in spans named `"wait"`.
    pub stall_us: f64,
}

/// Errors from writing a trace file.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error(
        "cannot write trace {}: this tracer keeps no events (it was created with detail off); \
         pass --trace FILE at startup so events are kept",
        path.display()
    )]
    DetailOff { path: PathBuf },
    #[error("cannot write trace {}: check that its directory exists and is writable", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl Classify for TraceError {
    fn exit_code(&self) -> ExitCode {
        match self {
            // The CLI keeps events whenever it will write them, so reaching this from the CLI is a
            // bug; the message still tells a library caller what to change.
            TraceError::DetailOff { .. } => ExitCode::Internal,
            TraceError::Write { .. } => ExitCode::Io,
        }
    }
}

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

// ---------------------------------------------------------------------------------------------
// Metric tracks and interval lists.

/// A metric track: what [`Metrics`] measures a union of.
const TRACK_IO: usize = 0;
const TRACK_COMPUTE: usize = 1;
const TRACK_STALL: usize = 2;
const TRACK_COUNT: usize = 3;

fn track_of(stage: Stage, name: &'static str) -> Option<usize> {
    match stage {
        Stage::Io => Some(TRACK_IO),
        Stage::Compute => Some(TRACK_COMPUTE),
        Stage::Scheduler if name == "wait" => Some(TRACK_STALL),
        Stage::Scheduler => None,
    }
}

/// `(start_us, end_us)` with `start_us < end_us`.
type Interval = (f64, f64);

/// Sorted, disjoint, non-touching intervals. Spans of one thread arrive almost in order, so an
/// insert is usually an append or an extension of the last interval.
#[derive(Debug, Default)]
struct IntervalSet {
    items: Vec<Interval>,
}

impl IntervalSet {
    fn insert(&mut self, start: f64, end: f64) {
        debug_assert!(start < end);
        match self.items.last_mut() {
            Some(last) if start >= last.0 && start <= last.1 => last.1 = last.1.max(end),
            Some(last) if start < last.0 => self.insert_out_of_order(start, end),
            _ => self.items.push((start, end)),
        }
    }

    fn insert_out_of_order(&mut self, start: f64, end: f64) {
        // Intervals lo..hi touch or overlap [start, end]; they become one.
        let lo = self.items.partition_point(|iv| iv.1 < start);
        let hi = self.items.partition_point(|iv| iv.0 <= end);
        assert!(lo <= hi);
        if lo == hi {
            self.items.insert(lo, (start, end));
            return;
        }
        let merged = (start.min(self.items[lo].0), end.max(self.items[hi - 1].1));
        self.items[lo] = merged;
        self.items.drain(lo + 1..hi);
    }

    /// Moves the parts of all intervals before `horizon` into `out`.
    fn drain_before(&mut self, horizon: f64, out: &mut Vec<Interval>) {
        let whole = self.items.partition_point(|iv| iv.1 <= horizon);
        out.extend(self.items.drain(..whole));
        if let Some(first) = self.items.first_mut() {
            if first.0 < horizon {
                out.push((first.0, horizon));
                first.0 = horizon;
            }
        }
    }
}

/// The union of `items` as sorted, disjoint intervals.
fn union(mut items: Vec<Interval>) -> Vec<Interval> {
    items.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
    let mut out: Vec<Interval> = Vec::with_capacity(items.len());
    for (start, end) in items {
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    }
    out
}

/// `items` (sorted, disjoint) restricted to `[lo, hi]`.
fn clip(items: Vec<Interval>, lo: f64, hi: f64) -> Vec<Interval> {
    items.into_iter().map(|(s, e)| (s.max(lo), e.min(hi))).filter(|(s, e)| s < e).collect()
}

fn measure(items: &[Interval]) -> f64 {
    items.iter().map(|(s, e)| e - s).sum()
}

/// Measure of the intersection of two sorted, disjoint lists.
fn intersect_measure(a: &[Interval], b: &[Interval]) -> f64 {
    let (mut i, mut j, mut total) = (0, 0, 0.0);
    while i < a.len() && j < b.len() {
        let lo = a[i].0.max(b[j].0);
        let hi = a[i].1.min(b[j].1);
        if lo < hi {
            total += hi - lo;
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    total
}

// ---------------------------------------------------------------------------------------------
// Shards, events, open-guard stacks.

#[derive(Clone, Copy, Debug)]
enum EventKind {
    Span { stage: Stage, thread_index: u32, args: SpanArgs },
    Counter { value: f64 },
}

#[derive(Clone, Copy, Debug)]
struct Event {
    ts_us: f64,
    /// Zero for counters.
    dur_us: f64,
    name: &'static str,
    kind: EventKind,
}

#[derive(Debug)]
struct ShardState {
    /// Every event, when events are kept; never trimmed by a metrics reset.
    events: Vec<Event>,
    /// Events before this index belong to before the last metrics reset.
    epoch_index: usize,
    /// Without `detail`: unfolded busy intervals per metric track.
    sets: [IntervalSet; TRACK_COUNT],
    first_us: f64,
    last_us: f64,
    /// `complete` time that arrived already folded and was dropped.
    late_us: f64,
}

impl ShardState {
    fn new() -> Self {
        ShardState {
            events: Vec::new(),
            epoch_index: 0,
            sets: Default::default(),
            first_us: f64::INFINITY,
            last_us: f64::NEG_INFINITY,
            late_us: 0.0,
        }
    }

    fn reset_metrics(&mut self) {
        self.epoch_index = self.events.len();
        self.sets = Default::default();
        self.first_us = f64::INFINITY;
        self.last_us = f64::NEG_INFINITY;
        self.late_us = 0.0;
    }

    fn see(&mut self, start_us: f64, end_us: f64) {
        self.first_us = self.first_us.min(start_us);
        self.last_us = self.last_us.max(end_us);
    }
}

/// Cache-line aligned so two shards never share a line.
#[derive(Debug)]
#[repr(align(128))]
struct Shard(Mutex<ShardState>);

/// Open-guard start values: `PENDING` while a guard is being opened or closed (a fold that sees
/// it gives up and retries later), `CLOSED` for a free entry.
const PENDING: u64 = 0x7ff8_0000_0000_0001; // a NaN
const CLOSED: u64 = 0x7ff0_0000_0000_0000; // +inf
/// End value of a guard that has not read its end time yet.
const STILL_OPEN: u64 = CLOSED;

/// The guards a thread has open on one metric track. Only the owning thread writes; folds read.
/// Every access is SeqCst: the protocol relies on a single order of the owner's publish-then-read-
/// clock steps and the fold's read-clock-then-scan steps (see `Tracer::open_credits`).
#[derive(Debug)]
struct OpenStack {
    depth: AtomicUsize,
    starts: [AtomicU64; OPEN_GUARDS_MAX],
    ends: [AtomicU64; OPEN_GUARDS_MAX],
}

impl OpenStack {
    fn new() -> Self {
        OpenStack {
            depth: AtomicUsize::new(0),
            starts: std::array::from_fn(|_| AtomicU64::new(CLOSED)),
            ends: std::array::from_fn(|_| AtomicU64::new(STILL_OPEN)),
        }
    }

    /// Reserves an entry before the guard reads its start time.
    fn push(&self) -> Option<usize> {
        let pos = self.depth.load(Ordering::SeqCst);
        if pos >= OPEN_GUARDS_MAX {
            return None;
        }
        self.starts[pos].store(PENDING, Ordering::SeqCst);
        self.ends[pos].store(STILL_OPEN, Ordering::SeqCst);
        self.depth.store(pos + 1, Ordering::SeqCst);
        Some(pos)
    }

    fn close(&self, pos: usize) {
        assert!(pos < OPEN_GUARDS_MAX);
        self.starts[pos].store(CLOSED, Ordering::SeqCst);
        let mut depth = self.depth.load(Ordering::SeqCst);
        while depth > 0 && self.starts[depth - 1].load(Ordering::SeqCst) == CLOSED {
            depth -= 1;
        }
        self.depth.store(depth, Ordering::SeqCst);
    }
}

/// One thread's open-guard stacks, one per metric track.
#[derive(Debug)]
struct OpenSlot {
    tracks: [OpenStack; TRACK_COUNT],
}

#[derive(Debug, Default)]
struct ThreadRegistry {
    index_by_serial: HashMap<u64, u32>,
    names: Vec<String>,
}

/// Index shared by the threads past `THREADS_MAX`.
const OVERFLOW_THREAD_INDEX: u32 = THREADS_MAX as u32;
const _: () = assert!(THREADS_MAX < u32::MAX as usize);
const _: () = assert!(SHARD_COUNT.is_power_of_two());

#[derive(Debug)]
struct FoldState {
    /// Everything before this is in the totals below; interval parts before it are ignored.
    folded_until_us: f64,
    busy_us: [f64; TRACK_COUNT],
    overlap_us: f64,
    window_start_us: Option<f64>,
    window_end_us: Option<f64>,
    folds_count: u64,
}

impl FoldState {
    fn new() -> Self {
        FoldState {
            folded_until_us: f64::NEG_INFINITY,
            busy_us: [0.0; TRACK_COUNT],
            overlap_us: 0.0,
            window_start_us: None,
            window_end_us: None,
            folds_count: 0,
        }
    }
}

static NEXT_TRACER_ID: AtomicU64 = AtomicU64::new(1);
static NEXT_THREAD_SERIAL: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static THREAD_SERIAL: u64 = NEXT_THREAD_SERIAL.fetch_add(1, Ordering::Relaxed);
    /// (tracer id, thread index in that tracer) of the last tracer this thread recorded into.
    static THREAD_CACHE: Cell<(u64, u32)> = const { Cell::new((0, 0)) };
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a tracer lock leaves at worst a partly merged list; the metrics of
    // a run that panicked are not worth a second panic.
    m.lock().unwrap_or_else(PoisonError::into_inner)
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
    /// When not NaN, `now_us` returns this: tests drive folds with synthetic time.
    #[cfg(test)]
    fake_now_bits: AtomicU64,
}

/// An open span; it ends when dropped. `!Send`: it belongs to the track of the opening thread.
#[must_use = "a span ends when its guard is dropped"]
#[derive(Debug)]
pub struct SpanGuard<'a> {
    tracer: &'a Tracer,
    stage: Stage,
    name: &'static str,
    args: SpanArgs,
    start_us: f64,
    thread_index: u32,
    /// (metric track, stack position) when the guard is on an open-guard stack.
    open: Option<(usize, usize)>,
    _not_send: PhantomData<*const ()>,
}

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracer").field("id", &self.id).field("options", &self.options).finish_non_exhaustive()
    }
}

impl SpanGuard<'_> {
    /// Replaces the span's arguments (for values known only at the end, such as bytes read).
    pub fn set_args(&mut self, args: SpanArgs) {
        self.args = args;
    }

    /// When the span started, in [`Tracer::now_us`] time.
    pub fn start_us(&self) -> f64 {
        self.start_us
    }
}

impl Drop for SpanGuard<'_> {
    fn drop(&mut self) {
        let stack = self
            .open
            .and_then(|(track, pos)| self.tracer.open_stack(self.thread_index, track).map(|stack| (stack, pos)));
        if let Some((stack, pos)) = stack {
            stack.ends[pos].store(PENDING, Ordering::SeqCst);
        }
        let end_us = self.tracer.now_us();
        if let Some((stack, pos)) = stack {
            stack.ends[pos].store(end_us.to_bits(), Ordering::SeqCst);
        }
        let t = self.tracer;
        t.record_span(self.thread_index, self.stage, self.name, self.start_us, end_us, self.args, false);
        if let Some((stack, pos)) = stack {
            // Closed only after the interval is in its shard, so a fold that sees the entry
            // closed also sees the interval.
            stack.close(pos);
        }
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
            id: NEXT_TRACER_ID.fetch_add(1, Ordering::Relaxed),
            origin: Instant::now(),
            options,
            keep_events: options.detail,
            shards: (0..SHARD_COUNT).map(|_| Shard(Mutex::new(ShardState::new()))).collect(),
            open_slots: (0..THREADS_MAX).map(|_| OnceLock::new()).collect(),
            threads: Mutex::new(ThreadRegistry::default()),
            fold: Mutex::new(FoldState::new()),
            folded_until_bits: AtomicU64::new(f64::NEG_INFINITY.to_bits()),
            next_fold_bits: AtomicU64::new(f64::NEG_INFINITY.to_bits()),
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
            let fake = f64::from_bits(self.fake_now_bits.load(Ordering::Relaxed));
            if !fake.is_nan() {
                return fake;
            }
        }
        let d = self.origin.elapsed();
        d.as_secs() as f64 * 1e6 + f64::from(d.subsec_nanos()) * 1e-3
    }

    /// Opens a span on the calling thread's `stage` track; it ends when the guard drops.
    pub fn span(&self, stage: Stage, name: &'static str) -> SpanGuard<'_> {
        self.span_args(stage, name, SpanArgs::new())
    }

    /// [`Tracer::span`] with arguments shown in the trace viewer (see also
    /// [`SpanGuard::set_args`]).
    pub fn span_args(&self, stage: Stage, name: &'static str, args: SpanArgs) -> SpanGuard<'_> {
        let thread_index = self.thread_index();
        let track = if self.options.detail { None } else { track_of(stage, name) };
        // The entry is published (as PENDING) before the clock is read; see `open_credits`.
        let open = track.and_then(|track| {
            let stack = self.open_stack(thread_index, track)?;
            stack.push().map(|pos| (stack, track, pos))
        });
        let start_us = self.now_us();
        if let Some((stack, _, pos)) = open {
            stack.starts[pos].store(start_us.to_bits(), Ordering::SeqCst);
        }
        SpanGuard {
            tracer: self,
            stage,
            name,
            args,
            start_us,
            thread_index,
            open: open.map(|(_, track, pos)| (track, pos)),
            _not_send: PhantomData,
        }
    }

    /// Records a span measured elsewhere (an I/O read whose submit and completion times are
    /// known), on the calling thread's `stage` track. Times come from [`Tracer::now_us`].
    ///
    /// # Panics
    /// If `start_us` is not finite or `end_us < start_us`.
    pub fn complete(&self, stage: Stage, name: &'static str, start_us: f64, end_us: f64, args: SpanArgs) {
        assert!(start_us.is_finite(), "span {name}: start {start_us} is not finite");
        assert!(end_us >= start_us, "span {name}: end {end_us} is before start {start_us}");
        self.record_span(self.thread_index(), stage, name, start_us, end_us, args, true);
    }

    /// Records a counter sample (bytes in flight, pool occupancy) at the current time.
    pub fn counter(&self, name: &'static str, value: f64) {
        let ts_us = self.now_us();
        let thread_index = self.thread_index();
        let mut shard = self.shard(thread_index);
        shard.see(ts_us, ts_us);
        if self.keep_events {
            let kind = EventKind::Counter { value };
            shard.events.push(Event { ts_us, dur_us: 0.0, name, kind });
        }
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
        let mut fold = lock(&self.fold);
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
        self.shards.iter().map(|s| lock(&s.0).late_us).sum()
    }

    /// Busy, overlap and stall over the metrics window (see the module doc). Spans still open
    /// are not counted, except (without `detail`) the part already folded.
    pub fn metrics(&self) -> Metrics {
        let fold = lock(&self.fold);
        let (lists, first_us, last_us) =
            if self.options.detail { self.lists_from_events() } else { self.lists_from_sets(fold.folded_until_us) };
        summarize(&fold, lists, first_us, last_us)
    }

    /// The summed durations, in seconds, of the kept compute spans named one of `names` that
    /// ended after the last metrics reset; `None` when events are not kept (created without
    /// `detail`). A sum, not a union like [`Tracer::metrics`]: nested spans, or spans on
    /// several threads at once, count once each; a span open across the reset counts whole.
    pub fn span_seconds(&self, names: &[&str]) -> Option<f64> {
        if !self.keep_events {
            return None;
        }
        let mut us = 0.0;
        for shard in self.shards.iter() {
            let shard = lock(&shard.0);
            for ev in &shard.events[shard.epoch_index..] {
                let compute = matches!(ev.kind, EventKind::Span { stage: Stage::Compute, .. });
                if compute && names.contains(&ev.name) {
                    us += ev.dur_us;
                }
            }
        }
        Some(us / 1e6)
    }

    /// Writes every kept event as Chrome trace-event JSON (open it in Perfetto or
    /// chrome://tracing). Needs `detail`.
    pub fn write_chrome_json(&self, path: &Path) -> Result<(), TraceError> {
        if !self.keep_events {
            return Err(TraceError::DetailOff { path: path.to_path_buf() });
        }
        let err = |source| TraceError::Write { path: path.to_path_buf(), source };
        let file = File::create(path).map_err(err)?;
        let mut out = BufWriter::new(file);
        self.write_chrome_events(&mut out).map_err(err)?;
        out.flush().map_err(err)
    }
}

// ---------------------------------------------------------------------------------------------
// Recording internals.

impl Tracer {
    fn thread_index(&self) -> u32 {
        // `try_with` fails only during thread-local destruction; then skip the cache.
        let cached = THREAD_CACHE.try_with(Cell::get).unwrap_or((0, 0));
        if cached.0 == self.id {
            return cached.1;
        }
        let index = self.register_thread();
        let _ = THREAD_CACHE.try_with(|c| c.set((self.id, index)));
        index
    }

    fn register_thread(&self) -> u32 {
        let serial = THREAD_SERIAL.try_with(|s| *s).unwrap_or(0);
        let mut reg = lock(&self.threads);
        if let Some(&index) = reg.index_by_serial.get(&serial) {
            return index;
        }
        if reg.names.len() >= THREADS_MAX {
            return OVERFLOW_THREAD_INDEX;
        }
        let index = reg.names.len() as u32;
        let name = match std::thread::current().name() {
            Some(name) => name.to_string(),
            None => format!("thread-{serial}"),
        };
        reg.names.push(name);
        reg.index_by_serial.insert(serial, index);
        if !self.options.detail {
            let slot = &self.open_slots[index as usize];
            slot.get_or_init(|| Box::new(OpenSlot { tracks: std::array::from_fn(|_| OpenStack::new()) }));
        }
        assert!(reg.names.len() <= THREADS_MAX);
        index
    }

    fn open_stack(&self, thread_index: u32, track: usize) -> Option<&OpenStack> {
        let slot = self.open_slots.get(thread_index as usize)?.get()?;
        slot.tracks.get(track)
    }

    fn shard(&self, thread_index: u32) -> MutexGuard<'_, ShardState> {
        lock(&self.shards[thread_index as usize % SHARD_COUNT].0)
    }

    #[allow(clippy::too_many_arguments)]
    fn record_span(
        &self,
        thread_index: u32,
        stage: Stage,
        name: &'static str,
        start_us: f64,
        end_us: f64,
        args: SpanArgs,
        from_complete: bool,
    ) {
        debug_assert!(start_us <= end_us);
        let mut shard = self.shard(thread_index);
        shard.see(start_us, end_us);
        if self.keep_events {
            let kind = EventKind::Span { stage, thread_index, args };
            shard.events.push(Event { ts_us: start_us, dur_us: end_us - start_us, name, kind });
        }
        if self.options.detail {
            return;
        }
        let Some(track) = track_of(stage, name) else {
            return;
        };
        let folded_until = f64::from_bits(self.folded_until_bits.load(Ordering::Relaxed));
        if from_complete && start_us < folded_until {
            // Guards need no tally: their folded part was credited while they were open.
            shard.late_us += end_us.min(folded_until) - start_us;
        }
        let start_us = start_us.max(folded_until);
        if start_us < end_us {
            shard.sets[track].insert(start_us, end_us);
        }
        let want_fold = shard.sets[track].items.len() > self.options.shard_intervals_max;
        drop(shard);
        if want_fold {
            self.try_fold(end_us);
        }
    }

    /// Folds unless another thread is folding or a fold ran less than a quarter lag ago.
    /// `recent_us` (a span's end) stands in for the clock in that check, to save a clock read on
    /// every span while lists are over their limit but a fold is not yet due.
    fn try_fold(&self, recent_us: f64) {
        if recent_us < f64::from_bits(self.next_fold_bits.load(Ordering::Relaxed)) {
            return;
        }
        let now_us = self.now_us();
        let mut fold = match self.fold.try_lock() {
            Ok(fold) => fold,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
            Err(TryLockError::WouldBlock) => return,
        };
        let next_us = now_us + self.options.fold_lag_us * 0.25;
        self.next_fold_bits.store(next_us.to_bits(), Ordering::Relaxed);
        self.fold_locked(&mut fold, now_us);
    }

    /// Moves every busy interval before `now_us - fold_lag_us` into the totals.
    fn fold_locked(&self, fold: &mut FoldState, now_us: f64) {
        let horizon = now_us - self.options.fold_lag_us;
        if horizon <= fold.folded_until_us {
            return;
        }
        // Credits are read before the shards are drained: see `open_credits`.
        let Some(mut taken) = self.open_credits(horizon) else {
            return;
        };
        for shard in self.shards.iter() {
            let mut shard = lock(&shard.0);
            for (set, out) in shard.sets.iter_mut().zip(taken.iter_mut()) {
                set.drain_before(horizon, out);
            }
        }
        let lo = fold.window_start_us.unwrap_or(f64::NEG_INFINITY).max(fold.folded_until_us);
        let hi = fold.window_end_us.unwrap_or(f64::INFINITY).min(horizon);
        let unions = taken.map(|items| clip(union(items), lo, hi));
        for (busy, items) in fold.busy_us.iter_mut().zip(unions.iter()) {
            *busy += measure(items);
        }
        fold.overlap_us += intersect_measure(&unions[TRACK_IO], &unions[TRACK_COMPUTE]);
        fold.folded_until_us = horizon;
        fold.folds_count += 1;
        self.folded_until_bits.store(horizon.to_bits(), Ordering::SeqCst);
    }

    /// For every open guard, the part of `[start, horizon]` it is already known to cover; `None`
    /// if a guard is mid-open or mid-close (the fold is retried later).
    ///
    /// Why this is enough: the fold read the clock (`now`) before this scan, and
    /// `horizon <= now`. A guard publishes its entry before reading its start time and marks its
    /// end PENDING before reading its end time. So a guard missing from the scan started after
    /// `now`; a guard seen with end STILL_OPEN ends after `now`; a guard seen CLOSED already put
    /// its interval in its shard, which the fold drains next.
    fn open_credits(&self, horizon: f64) -> Option<[Vec<Interval>; TRACK_COUNT]> {
        let mut credits: [Vec<Interval>; TRACK_COUNT] = Default::default();
        for slot in self.open_slots.iter().filter_map(OnceLock::get) {
            for (stack, out) in slot.tracks.iter().zip(credits.iter_mut()) {
                let depth = stack.depth.load(Ordering::SeqCst).min(OPEN_GUARDS_MAX);
                for pos in 0..depth {
                    let start_bits = stack.starts[pos].load(Ordering::SeqCst);
                    if start_bits == CLOSED {
                        continue;
                    }
                    let end_bits = stack.ends[pos].load(Ordering::SeqCst);
                    if start_bits == PENDING || end_bits == PENDING {
                        return None;
                    }
                    let start = f64::from_bits(start_bits);
                    let end = f64::from_bits(end_bits).min(horizon);
                    if start < end {
                        out.push((start, end));
                    }
                }
            }
        }
        Some(credits)
    }

    fn reset_locked(&self) -> MutexGuard<'_, FoldState> {
        let mut fold = lock(&self.fold);
        *fold = FoldState::new();
        self.folded_until_bits.store(f64::NEG_INFINITY.to_bits(), Ordering::SeqCst);
        for shard in self.shards.iter() {
            lock(&shard.0).reset_metrics();
        }
        fold
    }

    /// Per-track intervals of the spans recorded since the last reset, and first/last times.
    fn lists_from_events(&self) -> ([Vec<Interval>; TRACK_COUNT], f64, f64) {
        let mut lists: [Vec<Interval>; TRACK_COUNT] = Default::default();
        let (mut first_us, mut last_us) = (f64::INFINITY, f64::NEG_INFINITY);
        for shard in self.shards.iter() {
            let shard = lock(&shard.0);
            first_us = first_us.min(shard.first_us);
            last_us = last_us.max(shard.last_us);
            for ev in &shard.events[shard.epoch_index..] {
                let EventKind::Span { stage, .. } = ev.kind else {
                    continue;
                };
                if let Some(track) = track_of(stage, ev.name) {
                    if ev.dur_us > 0.0 {
                        lists[track].push((ev.ts_us, ev.ts_us + ev.dur_us));
                    }
                }
            }
        }
        (lists, first_us, last_us)
    }

    /// Per-track unfolded intervals (parts before `folded_until_us` dropped), first/last times.
    fn lists_from_sets(&self, folded_until_us: f64) -> ([Vec<Interval>; TRACK_COUNT], f64, f64) {
        let mut lists: [Vec<Interval>; TRACK_COUNT] = Default::default();
        let (mut first_us, mut last_us) = (f64::INFINITY, f64::NEG_INFINITY);
        for shard in self.shards.iter() {
            let shard = lock(&shard.0);
            first_us = first_us.min(shard.first_us);
            last_us = last_us.max(shard.last_us);
            for (set, out) in shard.sets.iter().zip(lists.iter_mut()) {
                let kept = set.items.iter().map(|&(s, e)| (s.max(folded_until_us), e));
                out.extend(kept.filter(|(s, e)| s < e));
            }
        }
        (lists, first_us, last_us)
    }
}

fn summarize(fold: &FoldState, lists: [Vec<Interval>; TRACK_COUNT], first_us: f64, last_us: f64) -> Metrics {
    let lo = fold.window_start_us.unwrap_or(f64::NEG_INFINITY);
    let hi = fold.window_end_us.unwrap_or(f64::INFINITY);
    let unions = lists.map(|items| clip(union(items), lo, hi));
    let busy: [f64; TRACK_COUNT] = std::array::from_fn(|t| fold.busy_us[t] + measure(&unions[t]));
    let overlap_us = fold.overlap_us + intersect_measure(&unions[TRACK_IO], &unions[TRACK_COMPUTE]);
    let wall_start = fold.window_start_us.unwrap_or(first_us);
    let wall_end = fold.window_end_us.unwrap_or(last_us);
    let wall_us = if wall_start.is_finite() && wall_end.is_finite() { (wall_end - wall_start).max(0.0) } else { 0.0 };
    let fraction = |x: f64| if wall_us > 0.0 { x / wall_us } else { 0.0 };
    Metrics {
        wall_us,
        io_busy_us: busy[TRACK_IO],
        compute_busy_us: busy[TRACK_COMPUTE],
        overlap_us,
        io_busy_fraction: fraction(busy[TRACK_IO]),
        compute_busy_fraction: fraction(busy[TRACK_COMPUTE]),
        overlap_fraction: fraction(overlap_us),
        stall_us: busy[TRACK_STALL],
    }
}

// ---------------------------------------------------------------------------------------------
// Chrome trace-event JSON.

const TRACE_PID: u32 = 1;

#[derive(Serialize)]
struct ChromeSpan<'a> {
    ph: &'static str,
    name: &'a str,
    cat: &'static str,
    ts: f64,
    dur: f64,
    pid: u32,
    tid: u32,
    args: &'a SpanArgs,
}

#[derive(Serialize)]
struct ChromeCounter<'a> {
    ph: &'static str,
    name: &'a str,
    ts: f64,
    pid: u32,
    args: CounterArgs,
}

#[derive(Serialize)]
struct CounterArgs {
    value: f64,
}

#[derive(Serialize)]
struct ChromeMeta<A: Serialize> {
    ph: &'static str,
    name: &'static str,
    pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    tid: Option<u32>,
    args: A,
}

#[derive(Serialize)]
struct NameArg<'a> {
    name: &'a str,
}

#[derive(Serialize)]
struct SortArg {
    sort_index: u32,
}

impl Tracer {
    /// Writes `{"traceEvents":[metadata..., events sorted by ts...],"displayTimeUnit":"ms"}`.
    fn write_chrome_events(&self, out: &mut dyn Write) -> io::Result<()> {
        let mut events: Vec<Event> = Vec::new();
        for shard in self.shards.iter() {
            events.extend_from_slice(&lock(&shard.0).events);
        }
        // Parents before children at equal start, so viewers nest them.
        events.sort_by(|a, b| a.ts_us.total_cmp(&b.ts_us).then(b.dur_us.total_cmp(&a.dur_us)));
        let names = lock(&self.threads).names.clone();
        let tids = track_tids(&events);
        out.write_all(b"{\"traceEvents\":[")?;
        write_metadata(out, &tids, &names)?;
        for ev in &events {
            out.write_all(b",\n")?;
            write_event(out, ev, &tids)?;
        }
        out.write_all(b"],\"displayTimeUnit\":\"ms\"}\n")
    }
}

/// Chrome tid per (stage index, thread index) track, numbered from 1 in that order so viewers
/// group the tracks by stage.
fn track_tids(events: &[Event]) -> BTreeMap<(usize, u32), u32> {
    let mut tids: BTreeMap<(usize, u32), u32> = BTreeMap::new();
    for ev in events {
        if let EventKind::Span { stage, thread_index, .. } = ev.kind {
            tids.entry((stage.index(), thread_index)).or_insert(0);
        }
    }
    for (n, tid) in tids.values_mut().enumerate() {
        *tid = n as u32 + 1;
    }
    tids
}

/// The process name, then a name (`"<thread>/<stage>"`) and sort index for every track.
fn write_metadata(out: &mut dyn Write, tids: &BTreeMap<(usize, u32), u32>, names: &[String]) -> io::Result<()> {
    let args = NameArg { name: "k3ring" };
    let process = ChromeMeta { ph: "M", name: "process_name", pid: TRACE_PID, tid: None, args };
    serde_json::to_writer(&mut *out, &process)?;
    for (&(stage_index, thread_index), &tid) in tids {
        let thread = names.get(thread_index as usize).map_or("other-threads", String::as_str);
        let track = format!("{thread}/{}", Stage::ALL[stage_index].as_str());
        let args = NameArg { name: &track };
        let name = ChromeMeta { ph: "M", name: "thread_name", pid: TRACE_PID, tid: Some(tid), args };
        out.write_all(b",\n")?;
        serde_json::to_writer(&mut *out, &name)?;
        let args = SortArg { sort_index: tid };
        let sort = ChromeMeta { ph: "M", name: "thread_sort_index", pid: TRACE_PID, tid: Some(tid), args };
        out.write_all(b",\n")?;
        serde_json::to_writer(&mut *out, &sort)?;
    }
    Ok(())
}

fn write_event(out: &mut dyn Write, ev: &Event, tids: &BTreeMap<(usize, u32), u32>) -> io::Result<()> {
    match ev.kind {
        EventKind::Span { stage, thread_index, ref args } => {
            let tid = tids.get(&(stage.index(), thread_index)).copied().unwrap_or(0);
            let span = ChromeSpan {
                ph: "X",
                name: ev.name,
                cat: stage.as_str(),
                ts: ev.ts_us,
                dur: ev.dur_us,
                pid: TRACE_PID,
                tid,
                args,
            };
            serde_json::to_writer(out, &span)?;
        }
        EventKind::Counter { value } => {
            let counter =
                ChromeCounter { ph: "C", name: ev.name, ts: ev.ts_us, pid: TRACE_PID, args: CounterArgs { value } };
            serde_json::to_writer(out, &counter)?;
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stderr)]
mod tests {
    use super::*;
    use std::sync::{Arc, Barrier};
    use std::time::Duration;

    /// Tolerance for comparing sums of the same intervals added in a different order (µs).
    const SUM_TOLERANCE_US: f64 = 1e-6;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= SUM_TOLERANCE_US * (1.0 + a.abs().max(b.abs()))
    }

    fn assert_metrics_eq(a: &Metrics, b: &Metrics) {
        let pairs = [
            ("wall_us", a.wall_us, b.wall_us),
            ("io_busy_us", a.io_busy_us, b.io_busy_us),
            ("compute_busy_us", a.compute_busy_us, b.compute_busy_us),
            ("overlap_us", a.overlap_us, b.overlap_us),
            ("io_busy_fraction", a.io_busy_fraction, b.io_busy_fraction),
            ("compute_busy_fraction", a.compute_busy_fraction, b.compute_busy_fraction),
            ("overlap_fraction", a.overlap_fraction, b.overlap_fraction),
            ("stall_us", a.stall_us, b.stall_us),
        ];
        for (name, x, y) in pairs {
            assert!(close(x, y), "{name}: {x} != {y}\n{a:?}\n{b:?}");
        }
    }

    fn set_now(t: &Tracer, now_us: f64) {
        t.fake_now_bits.store(now_us.to_bits(), Ordering::Relaxed);
    }

    /// Folds as eagerly as possible: lag 0, a fold per list longer than `max`; synthetic clock.
    fn folding(max: usize) -> Tracer {
        let t = Tracer::with_options(TracerOptions { detail: false, fold_lag_us: 0.0, shard_intervals_max: max });
        set_now(&t, 0.0);
        t
    }

    fn interval_count(t: &Tracer) -> usize {
        t.shards.iter().map(|s| lock(&s.0).sets.iter().map(|x| x.items.len()).sum::<usize>()).sum()
    }

    fn folds_count(t: &Tracer) -> u64 {
        lock(&t.fold).folds_count
    }

    /// Exact metrics from the kept events of a non-detail tracer (the fold-free path).
    fn exact(t: &Tracer) -> Metrics {
        assert!(t.keep_events);
        let (lists, first, last) = t.lists_from_events();
        let fold = lock(&t.fold);
        let window =
            FoldState { window_start_us: fold.window_start_us, window_end_us: fold.window_end_us, ..FoldState::new() };
        summarize(&window, lists, first, last)
    }

    fn brief_example(t: &Tracer) {
        let a = SpanArgs::new();
        t.complete(Stage::Io, "read", 0.0, 10.0, a);
        t.complete(Stage::Io, "read", 5.0, 15.0, a);
        t.complete(Stage::Compute, "expert", 12.0, 20.0, a);
    }

    #[test]
    fn span_seconds_sums_named_spans_since_the_reset() {
        let t = Tracer::new(true);
        let a = SpanArgs::new();
        t.complete(Stage::Compute, "expert", 1.0, 4.0, a);
        t.reset_metrics();
        t.complete(Stage::Compute, "expert", 10.0, 12.5, a);
        t.complete(Stage::Compute, "attention", 12.5, 20.0, a);
        t.complete(Stage::Compute, "head", 20.0, 21.0, a);
        t.complete(Stage::Io, "read", 5.0, 15.0, a);
        t.complete(Stage::Io, "expert", 5.0, 15.0, a);
        let got = t.span_seconds(&["expert", "head"]).unwrap();
        assert!((got - 3.5e-6).abs() < 1e-15, "{got}");
        assert_eq!(t.span_seconds(&[]), Some(0.0));
        assert_eq!(Tracer::new(false).span_seconds(&["expert"]), None);
    }

    #[test]
    fn trace_metrics_brief_example() {
        for detail in [true, false] {
            let t = Tracer::new(detail);
            brief_example(&t);
            let m = t.metrics();
            assert_eq!(m.wall_us, 20.0);
            assert_eq!(m.io_busy_us, 15.0);
            assert_eq!(m.compute_busy_us, 8.0);
            assert_eq!(m.overlap_us, 3.0);
            assert_eq!(m.io_busy_fraction, 0.75);
            assert_eq!(m.compute_busy_fraction, 0.4);
            assert_eq!(m.overlap_fraction, 0.15);
            assert_eq!(m.stall_us, 0.0);
        }
    }

    #[test]
    fn trace_metrics_empty_tracer_is_zero() {
        let m = Tracer::new(false).metrics();
        assert_eq!(m.wall_us, 0.0);
        assert_eq!(m.io_busy_fraction, 0.0);
    }

    #[test]
    fn trace_nested_spans_count_once() {
        for detail in [true, false] {
            let t = Tracer::new(detail);
            let a = SpanArgs::new();
            // Inner spans end (and are recorded) before the outer one, as with guards.
            t.complete(Stage::Compute, "expert", 10.0, 20.0, a);
            t.complete(Stage::Compute, "expert", 30.0, 40.0, a);
            t.complete(Stage::Compute, "layer", 0.0, 100.0, a);
            t.complete(Stage::Io, "read", 90.0, 120.0, a);
            let m = t.metrics();
            assert_eq!(m.compute_busy_us, 100.0);
            assert_eq!(m.io_busy_us, 30.0);
            assert_eq!(m.overlap_us, 10.0);
            assert_eq!(m.wall_us, 120.0);
        }
    }

    #[test]
    fn trace_multi_thread_spans_union() {
        for detail in [true, false] {
            let t = Tracer::new(detail);
            std::thread::scope(|s| {
                for (k, (start, end)) in [(0.0, 50.0), (40.0, 60.0), (70.0, 80.0)].into_iter().enumerate() {
                    let t = &t;
                    std::thread::Builder::new()
                        .name(format!("compute-{k}"))
                        .spawn_scoped(s, move || t.complete(Stage::Compute, "expert", start, end, SpanArgs::new()))
                        .unwrap();
                }
            });
            t.complete(Stage::Io, "read", 55.0, 75.0, SpanArgs::new());
            let m = t.metrics();
            assert_eq!(m.compute_busy_us, 70.0);
            assert_eq!(m.overlap_us, 10.0);
            assert_eq!(m.wall_us, 80.0);
        }
    }

    #[test]
    fn trace_stall_is_scheduler_wait_only() {
        for detail in [true, false] {
            let t = Tracer::new(detail);
            let a = SpanArgs::new();
            t.complete(Stage::Scheduler, "wait", 0.0, 5.0, a);
            t.complete(Stage::Scheduler, "wait", 3.0, 6.0, a);
            t.complete(Stage::Scheduler, "plan", 6.0, 10.0, a);
            t.complete(Stage::Io, "wait", 20.0, 30.0, a);
            let m = t.metrics();
            assert_eq!(m.stall_us, 6.0);
            assert_eq!(m.io_busy_us, 10.0);
            assert_eq!(m.wall_us, 30.0);
        }
    }

    #[test]
    fn trace_marks_clip_and_reset_forgets() {
        for detail in [true, false] {
            let t = Tracer::new(detail);
            t.complete(Stage::Io, "read", 0.0, 3.0, SpanArgs::new());
            t.mark_start_at(5.0);
            brief_example(&t);
            t.mark_end_at(15.0);
            let m = t.metrics();
            // Window [5, 15]: Io [5, 15], Compute [12, 15].
            assert_eq!(m.wall_us, 10.0);
            assert_eq!(m.io_busy_us, 10.0);
            assert_eq!(m.compute_busy_us, 3.0);
            assert_eq!(m.overlap_us, 3.0);
            assert_eq!(m.overlap_fraction, 0.3);
            t.reset_metrics();
            assert_eq!(t.metrics().wall_us, 0.0);
            t.complete(Stage::Compute, "expert", 100.0, 110.0, SpanArgs::new());
            let m = t.metrics();
            assert_eq!(m.wall_us, 10.0);
            assert_eq!(m.compute_busy_fraction, 1.0);
            assert_eq!(m.io_busy_us, 0.0);
        }
    }

    #[test]
    fn trace_interval_set_merges() {
        let mut set = IntervalSet::default();
        for (s, e) in [(10.0, 20.0), (30.0, 40.0), (0.0, 5.0), (20.0, 25.0), (50.0, 60.0), (4.0, 31.0)] {
            set.insert(s, e);
        }
        assert_eq!(set.items, vec![(0.0, 40.0), (50.0, 60.0)]);
        set.insert(45.0, 46.0);
        assert_eq!(set.items, vec![(0.0, 40.0), (45.0, 46.0), (50.0, 60.0)]);
        let mut out = Vec::new();
        set.drain_before(55.0, &mut out);
        assert_eq!(out, vec![(0.0, 40.0), (45.0, 46.0), (50.0, 55.0)]);
        assert_eq!(set.items, vec![(55.0, 60.0)]);
    }

    #[test]
    fn trace_intersect_measure_two_pointer() {
        let a = [(0.0, 10.0), (20.0, 30.0), (40.0, 50.0)];
        let b = [(5.0, 25.0), (28.0, 45.0)];
        // [5,10] + [20,25] + [28,30] + [40,45]
        assert_eq!(intersect_measure(&a, &b), 17.0);
        assert_eq!(intersect_measure(&a, &[]), 0.0);
    }

    /// Synthetic spans with gaps, so no interval merges with its neighbour; pseudo-random so the
    /// Io/Compute overlap is irregular. Step `i` covers [10 i, 10 i + 10]; the synthetic clock
    /// is at its start, so a fold (lag 0) takes everything before this step.
    fn synthetic(t: &Tracer, steps: std::ops::Range<usize>) {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15 ^ steps.start as u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 1000) as f64 / 1000.0
        };
        for i in steps {
            let base = i as f64 * 10.0;
            set_now(t, base);
            let io_start = base + next() * 4.0;
            t.complete(Stage::Io, "read", io_start, io_start + 1.0 + next() * 4.0, SpanArgs::new());
            let c_start = base + next() * 5.0;
            t.complete(Stage::Compute, "expert", c_start, c_start + next() * 4.0, SpanArgs::new());
            if i % 7 == 0 {
                t.complete(Stage::Scheduler, "wait", base + 9.0, base + 9.5, SpanArgs::new());
            }
        }
    }

    #[test]
    fn trace_detail_off_is_bounded_and_matches_detail() {
        const STEPS_COUNT: usize = 50_000;
        let max = 64;
        let folded = folding(max);
        synthetic(&folded, 0..STEPS_COUNT);
        let exact_tracer = Tracer::new(true);
        synthetic(&exact_tracer, 0..STEPS_COUNT);
        // All spans come from one thread: one shard, three lists of at most `max + 1`.
        assert!(interval_count(&folded) <= TRACK_COUNT * (max + 1), "{}", interval_count(&folded));
        // About one fold per `max + 1` steps.
        assert!(folds_count(&folded) > 500, "{}", folds_count(&folded));
        assert_eq!(folded.late_us(), 0.0);
        let (a, b) = (folded.metrics(), exact_tracer.metrics());
        assert_metrics_eq(&a, &b);
        assert!(a.overlap_us > 0.0);
        assert!(a.overlap_us < a.io_busy_us);
        assert!(a.stall_us > 0.0);
        // The same run without folding keeps every gap-separated interval.
        let unbounded = Tracer::new(false);
        synthetic(&unbounded, 0..STEPS_COUNT);
        assert!(interval_count(&unbounded) > STEPS_COUNT, "{}", interval_count(&unbounded));
        assert_metrics_eq(&unbounded.metrics(), &b);
    }

    #[test]
    fn trace_folds_respect_marks() {
        let folded = folding(16);
        let exact_tracer = Tracer::new(true);
        for t in [&folded, &exact_tracer] {
            synthetic(t, 0..100);
            t.mark_start_at(1000.5);
            synthetic(t, 100..4000);
            t.mark_end_at(40_000.25);
            synthetic(t, 4000..5000);
        }
        assert!(folds_count(&folded) > 10);
        let (a, b) = (folded.metrics(), exact_tracer.metrics());
        assert_eq!(a.wall_us, 39_000.0 - 0.25);
        assert_metrics_eq(&a, &b);
    }

    #[test]
    fn trace_late_complete_span_is_tallied() {
        let t = folding(1);
        set_now(&t, 100.0);
        t.complete(Stage::Io, "read", 0.0, 10.0, SpanArgs::new());
        t.complete(Stage::Io, "read", 20.0, 30.0, SpanArgs::new());
        assert_eq!(folds_count(&t), 1);
        // Folded up to 100: the part of this span before 100 can no longer be counted.
        t.complete(Stage::Io, "read", 40.0, 150.0, SpanArgs::new());
        assert_eq!(t.late_us(), 60.0);
        assert_eq!(t.metrics().io_busy_us, 20.0 + 50.0);
    }

    /// Real guards, nested and dropped out of order, on two threads, folding every few spans
    /// with a small lag while an outer guard stays open: the folded metrics must equal the exact
    /// ones computed from the same events.
    #[test]
    fn trace_guards_with_folding_match_exact() {
        let options = TracerOptions { detail: false, fold_lag_us: 200.0, shard_intervals_max: 4 };
        let mut t = Tracer::with_options(options);
        t.keep_events = true;
        let t = &t;
        let spin = |us: f64| {
            let end = t.now_us() + us;
            while t.now_us() < end {
                std::hint::spin_loop();
            }
        };
        std::thread::scope(|s| {
            s.spawn(move || {
                for i in 0..300 {
                    let _read = t.span_args(Stage::Io, "read", SpanArgs::new().expert(i).kind("demand"));
                    spin(20.0);
                    drop(_read);
                    std::thread::sleep(Duration::from_micros(50));
                }
            });
            s.spawn(move || {
                let outer = t.span(Stage::Compute, "token");
                for i in 0..200 {
                    let layer = t.span_args(Stage::Compute, "layer", SpanArgs::new().layer(i));
                    let expert = t.span(Stage::Compute, "expert");
                    spin(10.0);
                    drop(layer); // out of order: the outer of the two ends first
                    spin(10.0);
                    drop(expert);
                    let wait = t.span(Stage::Scheduler, "wait");
                    std::thread::sleep(Duration::from_micros(30));
                    drop(wait);
                }
                drop(outer);
                std::thread::sleep(Duration::from_micros(300));
                for _ in 0..100 {
                    let _expert = t.span(Stage::Compute, "expert");
                    spin(5.0);
                    drop(_expert);
                    std::thread::sleep(Duration::from_micros(20));
                }
            });
        });
        assert!(folds_count(t) > 5, "{}", folds_count(t));
        assert_eq!(t.late_us(), 0.0);
        let (a, b) = (t.metrics(), exact(t));
        assert_metrics_eq(&a, &b);
        assert!(a.overlap_us > 0.0);
        assert!(a.stall_us > 0.0);
        // Bounded: what is left unfolded is at most the last lag window plus one list's worth.
        assert!(interval_count(t) <= 64, "{}", interval_count(t));
    }

    #[test]
    fn trace_open_stack_pops_out_of_order() {
        let stack = OpenStack::new();
        let a = stack.push().unwrap();
        let b = stack.push().unwrap();
        stack.starts[a].store(1.0f64.to_bits(), Ordering::SeqCst);
        stack.starts[b].store(2.0f64.to_bits(), Ordering::SeqCst);
        stack.close(a);
        assert_eq!(stack.depth.load(Ordering::SeqCst), 2);
        stack.close(b);
        assert_eq!(stack.depth.load(Ordering::SeqCst), 0);
        for _ in 0..OPEN_GUARDS_MAX {
            assert!(stack.push().is_some());
        }
        assert!(stack.push().is_none());
    }

    fn write_and_parse(t: &Tracer) -> serde_json::Value {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.json");
        t.write_chrome_json(&path).unwrap();
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap()
    }

    fn record_named_threads(t: &Tracer) {
        std::thread::scope(|s| {
            for name in ["io-0", "compute-0", "compute-1", "sched"] {
                std::thread::Builder::new()
                    .name(name.to_string())
                    .spawn_scoped(s, move || {
                        for i in 0..50u32 {
                            let stage = match name {
                                "io-0" => Stage::Io,
                                "sched" => Stage::Scheduler,
                                _ => Stage::Compute,
                            };
                            let args = SpanArgs::new().layer(i).expert(i * 3).bytes(4096).kind("speculative");
                            let _g = t.span_args(stage, "work", args);
                            if name == "sched" {
                                // A second stage on one thread gets its own track.
                                let _w = t.span(Stage::Io, "submit");
                            }
                            t.counter("bytes_in_flight", f64::from(i));
                        }
                    })
                    .unwrap();
            }
        });
    }

    fn check_event_fields(ev: &serde_json::Value) {
        let ph = ev["ph"].as_str().unwrap();
        assert!(ev["name"].is_string(), "{ev}");
        assert_eq!(ev["pid"], 1, "{ev}");
        match ph {
            "X" => {
                assert!(ev["ts"].is_f64() || ev["ts"].is_u64(), "{ev}");
                assert!(ev["dur"].as_f64().unwrap() >= 0.0, "{ev}");
                assert!(ev["tid"].as_u64().unwrap() >= 1, "{ev}");
                assert!(["io", "compute", "scheduler"].contains(&ev["cat"].as_str().unwrap()), "{ev}");
                assert!(ev["args"].is_object(), "{ev}");
            }
            "C" => {
                assert!(ev["ts"].as_f64().is_some(), "{ev}");
                assert!(ev["args"]["value"].as_f64().is_some(), "{ev}");
            }
            "M" => {
                let name = ev["name"].as_str().unwrap();
                assert!(["process_name", "thread_name", "thread_sort_index"].contains(&name), "{ev}");
                if name != "process_name" {
                    assert!(ev["tid"].as_u64().is_some(), "{ev}");
                }
            }
            other => panic!("unexpected ph {other}"),
        }
    }

    #[test]
    fn trace_chrome_json_parses_with_required_fields() {
        let t = Tracer::new(true);
        record_named_threads(&t);
        let json = write_and_parse(&t);
        assert_eq!(json["displayTimeUnit"], "ms");
        let events = json["traceEvents"].as_array().unwrap();
        // 4 threads x 50 spans, plus 50 Io submits, 200 counters, 1 + 2 x 5 metadata events.
        assert_eq!(events.len(), 200 + 50 + 200 + 11);
        events.iter().for_each(check_event_fields);
        let timed: Vec<f64> = events.iter().filter(|e| e["ph"] != "M").map(|e| e["ts"].as_f64().unwrap()).collect();
        assert!(timed.windows(2).all(|w| w[0] <= w[1]), "events not sorted by ts");
        let first_timed = events.iter().position(|e| e["ph"] != "M").unwrap();
        assert!(events[first_timed..].iter().all(|e| e["ph"] != "M"), "metadata after events");
        let span = events.iter().find(|e| e["ph"] == "X" && e["cat"] == "io" && e["name"] == "work").unwrap();
        assert_eq!(span["args"]["kind"], "speculative");
        assert_eq!(span["args"]["bytes"], 4096);
        assert!(span["args"].get("slot").is_none());
    }

    #[test]
    fn trace_chrome_tids_match_thread_names() {
        let t = Tracer::new(true);
        record_named_threads(&t);
        let json = write_and_parse(&t);
        let events = json["traceEvents"].as_array().unwrap();
        let mut track_names: HashMap<u64, String> = HashMap::new();
        for ev in events.iter().filter(|e| e["ph"] == "M" && e["name"] == "thread_name") {
            let old = track_names.insert(ev["tid"].as_u64().unwrap(), ev["args"]["name"].as_str().unwrap().to_string());
            assert!(old.is_none(), "tid named twice");
        }
        let mut names: Vec<&str> = track_names.values().map(String::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, ["compute-0/compute", "compute-1/compute", "io-0/io", "sched/io", "sched/scheduler"]);
        for ev in events.iter().filter(|e| e["ph"] == "X") {
            let track = &track_names[&ev["tid"].as_u64().unwrap()];
            let cat = ev["cat"].as_str().unwrap();
            assert!(track.ends_with(&format!("/{cat}")), "{track} vs {cat}");
            let expected_stage = match track.split('/').next().unwrap() {
                "io-0" => "io",
                "sched" if ev["name"] == "submit" => "io",
                "sched" => "scheduler",
                _ => "compute",
            };
            assert_eq!(cat, expected_stage, "{ev}");
        }
    }

    #[test]
    fn trace_write_without_detail_is_refused() {
        let t = Tracer::new(false);
        t.complete(Stage::Io, "read", 0.0, 1.0, SpanArgs::new());
        let err = t.write_chrome_json(Path::new("/nonexistent/trace.json")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot write trace /nonexistent/trace.json: this tracer keeps no events (it was created \
             with detail off); pass --trace FILE at startup so events are kept"
        );
        assert_eq!(err.exit_code(), ExitCode::Internal);
        let t = Tracer::new(true);
        let err = t.write_chrome_json(Path::new("/nonexistent/trace.json")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot write trace /nonexistent/trace.json: check that its directory exists and is writable"
        );
        assert_eq!(err.exit_code(), ExitCode::Io);
    }

    #[test]
    fn trace_stage_serializes_lowercase() {
        assert_eq!(serde_json::to_string(&Stage::Io).unwrap(), "\"io\"");
        assert_eq!(serde_json::to_string(&Stage::Scheduler).unwrap(), "\"scheduler\"");
        let m = serde_json::to_value(Metrics::default()).unwrap();
        assert!(m["overlap_fraction"].is_f64());
    }

    #[test]
    fn trace_tracer_is_send_sync_and_guard_ends_on_drop() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Tracer>();
        let t = Tracer::new(true);
        {
            let mut g = t.span(Stage::Io, "read");
            g.set_args(SpanArgs::new().bytes(7).extra("queue_depth", 3u64));
            assert!(g.start_us() >= 0.0);
        }
        let events = lock(&t.shards[0].0).events.clone();
        assert_eq!(events.len(), 1);
        assert!(events[0].dur_us >= 0.0);
        let EventKind::Span { args, .. } = events[0].kind else { panic!("not a span") };
        assert_eq!(serde_json::to_string(&args).unwrap(), r#"{"bytes":7,"queue_depth":3}"#);
    }

    /// Many threads recording at once: every span kept, each thread on its own track.
    #[test]
    fn trace_concurrent_spans_from_many_threads() {
        const THREADS_COUNT: usize = 8;
        const SPANS_PER_THREAD: usize = 5_000;
        let t = Tracer::new(true);
        let barrier = Barrier::new(THREADS_COUNT);
        std::thread::scope(|s| {
            for k in 0..THREADS_COUNT {
                let (t, barrier) = (&t, &barrier);
                std::thread::Builder::new()
                    .name(format!("compute-{k}"))
                    .spawn_scoped(s, move || {
                        barrier.wait();
                        for _ in 0..SPANS_PER_THREAD {
                            let _g = t.span(Stage::Compute, "expert");
                        }
                    })
                    .unwrap();
            }
        });
        let json = write_and_parse(&t);
        let events = json["traceEvents"].as_array().unwrap();
        let spans: Vec<_> = events.iter().filter(|e| e["ph"] == "X").collect();
        assert_eq!(spans.len(), THREADS_COUNT * SPANS_PER_THREAD);
        let tracks = events.iter().filter(|e| e["name"] == "thread_name").count();
        assert_eq!(tracks, THREADS_COUNT);
        let m = t.metrics();
        assert!(m.compute_busy_us <= m.wall_us);
        assert!(m.compute_busy_fraction > 0.0);
    }

    /// Mean ns per span (guard open + drop) over `SPANS_PER_THREAD` spans on each of 2 threads
    /// recording at once into a fresh tracer.
    fn span_cost_ns(detail: bool) -> f64 {
        const SPANS_PER_THREAD: usize = 100_000;
        let t = Arc::new(Tracer::new(detail));
        let barrier = Arc::new(Barrier::new(2));
        let handles: Vec<_> = [Stage::Io, Stage::Compute]
            .into_iter()
            .map(|stage| {
                let (t, barrier) = (Arc::clone(&t), Arc::clone(&barrier));
                std::thread::spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    for i in 0..SPANS_PER_THREAD {
                        let _g = t.span_args(stage, "x", SpanArgs::new().expert(i as u32));
                    }
                    start.elapsed().as_nanos() as f64 / SPANS_PER_THREAD as f64
                })
            })
            .collect();
        let ns: Vec<f64> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        ns.iter().sum::<f64>() / ns.len() as f64
    }

    /// Cost of one span with 2 threads recording at once; reported with
    /// `cargo test --release --lib trace_span_cost -- --nocapture`. The best of 3 runs is
    /// checked, so that a loaded host's preemptions do not fail it.
    #[test]
    fn trace_span_cost() {
        const RUNS_COUNT: usize = 3;
        // Budget from the brief: "well under a microsecond".
        const SPAN_NS_MAX: f64 = 1000.0;
        for detail in [false, true] {
            let mut ns: Vec<f64> = (0..RUNS_COUNT).map(|_| span_cost_ns(detail)).collect();
            ns.sort_by(f64::total_cmp);
            eprintln!("trace span cost, 2 threads, detail={detail}: best {:.0} ns/span, runs {ns:.0?}", ns[0]);
            assert!(ns[0] < SPAN_NS_MAX, "{} ns per span", ns[0]);
        }
    }
}
