//! Folding and the metrics summary. Without `detail`, a fold moves every busy interval older
//! than `now - fold_lag_us` (and the covered part of every open guard) into scalar totals, so
//! memory stays bounded; [`Metrics`] is those totals plus the union of what is left, clipped
//! to the metrics window. With `detail` the summary is computed from the kept events instead.
//!
//! Threads: a fold runs on whichever recording thread found an interval list over its limit
//! (at most one at a time, under the fold lock); the summary runs on the caller of
//! [`Tracer::metrics`]. Allocates the interval vectors it unions, freed before it returns.

use std::sync::atomic::Ordering;
use std::sync::{MutexGuard, TryLockError};

use serde::Serialize;

use super::intervals::{clip, intersect_measure, measure, union, Interval};
use super::kind::{Metric, METRIC_COUNT};
use super::recorder::lock;
use super::Tracer;

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
    /// Time the scheduler spent in [`crate::trace::SpanKind::Wait`] spans.
    pub stall_us: f64,
}

#[derive(Debug)]
pub(super) struct FoldState {
    /// Everything before this is in the totals below; interval parts before it are ignored.
    pub(super) folded_until_us: f64,
    busy_us: [f64; METRIC_COUNT],
    overlap_us: f64,
    pub(super) window_start_us: Option<f64>,
    pub(super) window_end_us: Option<f64>,
    folds_count: u64,
}

impl FoldState {
    pub(super) fn new() -> Self {
        FoldState {
            folded_until_us: f64::NEG_INFINITY,
            busy_us: [0.0; METRIC_COUNT],
            overlap_us: 0.0,
            window_start_us: None,
            window_end_us: None,
            folds_count: 0,
        }
    }
}

const IO: usize = Metric::Io.index();
const COMPUTE: usize = Metric::Compute.index();
const STALL: usize = Metric::Stall.index();

impl Tracer {
    /// Folds unless another thread is folding or a fold ran less than a quarter lag ago.
    /// `recent_us` (a span's end) stands in for the clock in that check, to save a clock read on
    /// every span while lists are over their limit but a fold is not yet due.
    pub(super) fn try_fold(&self, recent_us: f64) {
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
        self.drain_sets_before(horizon, &mut taken);
        let lo = fold.window_start_us.unwrap_or(f64::NEG_INFINITY).max(fold.folded_until_us);
        let hi = fold.window_end_us.unwrap_or(f64::INFINITY).min(horizon);
        let unions = taken.map(|items| clip(union(items), lo, hi));
        for (busy, items) in fold.busy_us.iter_mut().zip(unions.iter()) {
            *busy += measure(items);
        }
        fold.overlap_us += intersect_measure(&unions[IO], &unions[COMPUTE]);
        fold.folded_until_us = horizon;
        fold.folds_count += 1;
        self.folded_until_bits.store(horizon.to_bits(), Ordering::SeqCst);
    }

    /// Forgets every total, mark and unfolded interval; returns the fold lock so a caller can
    /// set a mark before any recording thread folds again.
    pub(super) fn reset_locked(&self) -> MutexGuard<'_, FoldState> {
        let mut fold = lock(&self.fold);
        *fold = FoldState::new();
        self.folded_until_bits.store(f64::NEG_INFINITY.to_bits(), Ordering::SeqCst);
        self.reset_shards();
        fold
    }

    /// See [`Tracer::metrics`].
    pub(super) fn metrics_now(&self) -> Metrics {
        let fold = lock(&self.fold);
        let (lists, first_us, last_us) =
            if self.options.detail { self.lists_from_events() } else { self.lists_from_sets(fold.folded_until_us) };
        summarize(&fold, lists, first_us, last_us)
    }
}

fn summarize(fold: &FoldState, lists: [Vec<Interval>; METRIC_COUNT], first_us: f64, last_us: f64) -> Metrics {
    let lo = fold.window_start_us.unwrap_or(f64::NEG_INFINITY);
    let hi = fold.window_end_us.unwrap_or(f64::INFINITY);
    let unions = lists.map(|items| clip(union(items), lo, hi));
    let busy: [f64; METRIC_COUNT] = std::array::from_fn(|t| fold.busy_us[t] + measure(&unions[t]));
    let overlap_us = fold.overlap_us + intersect_measure(&unions[IO], &unions[COMPUTE]);
    let wall_start = fold.window_start_us.unwrap_or(first_us);
    let wall_end = fold.window_end_us.unwrap_or(last_us);
    let wall_us = if wall_start.is_finite() && wall_end.is_finite() { (wall_end - wall_start).max(0.0) } else { 0.0 };
    let fraction = |x: f64| if wall_us > 0.0 { x / wall_us } else { 0.0 };
    Metrics {
        wall_us,
        io_busy_us: busy[IO],
        compute_busy_us: busy[COMPUTE],
        overlap_us,
        io_busy_fraction: fraction(busy[IO]),
        compute_busy_fraction: fraction(busy[COMPUTE]),
        overlap_fraction: fraction(overlap_us),
        stall_us: busy[STALL],
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::super::testing::set_now;
    use super::super::{ComputeOp, SpanArgs, SpanKind, TracerOptions};
    use super::*;
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
        t.complete(SpanKind::Io("read"), 0.0, 10.0, a);
        t.complete(SpanKind::Io("read"), 5.0, 15.0, a);
        t.complete(ComputeOp::Expert, 12.0, 20.0, a);
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
            t.complete(ComputeOp::Expert, 10.0, 20.0, a);
            t.complete(ComputeOp::Expert, 30.0, 40.0, a);
            t.complete(ComputeOp::Attention, 0.0, 100.0, a);
            t.complete(SpanKind::Io("read"), 90.0, 120.0, a);
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
                        .spawn_scoped(s, move || t.complete(ComputeOp::Expert, start, end, SpanArgs::new()))
                        .unwrap();
                }
            });
            t.complete(SpanKind::Io("read"), 55.0, 75.0, SpanArgs::new());
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
            t.complete(SpanKind::Wait, 0.0, 5.0, a);
            t.complete(SpanKind::Wait, 3.0, 6.0, a);
            t.complete(SpanKind::Scheduler("plan"), 6.0, 10.0, a);
            t.complete(SpanKind::Io("wait"), 20.0, 30.0, a);
            let m = t.metrics();
            assert_eq!(m.stall_us, 6.0);
            assert_eq!(m.io_busy_us, 10.0);
            assert_eq!(m.wall_us, 30.0);
        }
    }

    /// Stall follows the kind chosen when a span opens: a scheduler span that is not a wait
    /// never counts, even when named "wait", recorded whole or as a guard open across folds.
    #[test]
    fn trace_non_wait_scheduler_span_is_never_a_stall() {
        for detail in [true, false] {
            let t = Tracer::new(detail);
            t.complete(SpanKind::Scheduler("wait"), 0.0, 5.0, SpanArgs::new());
            drop(t.span(SpanKind::Scheduler("wait")));
            t.complete(SpanKind::Wait, 10.0, 12.0, SpanArgs::new());
            assert_eq!(t.metrics().stall_us, 2.0);
        }
        let t = folding(1);
        let not_wait = t.span(SpanKind::Scheduler("wait"));
        let wait = t.span(SpanKind::Wait);
        for i in 1..=10 {
            let now = f64::from(i) * 10.0;
            set_now(&t, now);
            t.complete(SpanKind::Io("read"), now - 5.0, now - 4.0, SpanArgs::new());
        }
        assert!(folds_count(&t) > 0);
        drop(not_wait);
        drop(wait);
        assert_eq!(t.metrics().stall_us, 100.0);
    }

    #[test]
    fn trace_marks_clip_and_reset_forgets() {
        for detail in [true, false] {
            let t = Tracer::new(detail);
            t.complete(SpanKind::Io("read"), 0.0, 3.0, SpanArgs::new());
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
            t.complete(ComputeOp::Expert, 100.0, 110.0, SpanArgs::new());
            let m = t.metrics();
            assert_eq!(m.wall_us, 10.0);
            assert_eq!(m.compute_busy_fraction, 1.0);
            assert_eq!(m.io_busy_us, 0.0);
        }
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
            t.complete(SpanKind::Io("read"), io_start, io_start + 1.0 + next() * 4.0, SpanArgs::new());
            let c_start = base + next() * 5.0;
            t.complete(ComputeOp::Expert, c_start, c_start + next() * 4.0, SpanArgs::new());
            if i % 7 == 0 {
                t.complete(SpanKind::Wait, base + 9.0, base + 9.5, SpanArgs::new());
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
        assert!(interval_count(&folded) <= METRIC_COUNT * (max + 1), "{}", interval_count(&folded));
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
        t.complete(SpanKind::Io("read"), 0.0, 10.0, SpanArgs::new());
        t.complete(SpanKind::Io("read"), 20.0, 30.0, SpanArgs::new());
        assert_eq!(folds_count(&t), 1);
        // Folded up to 100: the part of this span before 100 can no longer be counted.
        t.complete(SpanKind::Io("read"), 40.0, 150.0, SpanArgs::new());
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
                    let _read = t.span_args(SpanKind::Io("read"), SpanArgs::new().expert(i).kind("demand"));
                    spin(20.0);
                    drop(_read);
                    std::thread::sleep(Duration::from_micros(50));
                }
            });
            s.spawn(move || {
                let outer = t.span(ComputeOp::Attention);
                for i in 0..200 {
                    let layer = t.span_args(ComputeOp::Router, SpanArgs::new().layer(i));
                    let expert = t.span(ComputeOp::Expert);
                    spin(10.0);
                    drop(layer); // out of order: the outer of the two ends first
                    spin(10.0);
                    drop(expert);
                    let wait = t.span(SpanKind::Wait);
                    std::thread::sleep(Duration::from_micros(30));
                    drop(wait);
                }
                drop(outer);
                std::thread::sleep(Duration::from_micros(300));
                for _ in 0..100 {
                    let _expert = t.span(ComputeOp::Expert);
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
    fn trace_metrics_serialize_as_numbers() {
        let m = serde_json::to_value(Metrics::default()).unwrap();
        assert!(m["overlap_fraction"].is_f64());
    }
}
