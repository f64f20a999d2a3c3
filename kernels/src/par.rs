//! Row-block splitting for the matmuls, serial and on the current rayon pool, and the pool's
//! workers kept awake through a forward step ([`with_workers_awake`]).
//!
//! Threads split output ROWS in fixed blocks of [`ROWS_PER_BLOCK`]; a row's value is computed
//! entirely by one thread with the same code as the serial path, so results never depend on the
//! thread count. Splitting is a `rayon::join` recursion at block-aligned midpoints, which
//! allocates nothing.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::error::KernelError;
use crate::out::RowsOut;

/// Rows per block. A block of a 7168-column bf16 matrix is 0.9 MB of weights, enough to amortise
/// a rayon join, and small enough to balance 12288 rows over many threads.
pub const ROWS_PER_BLOCK: usize = 64;

/// Runs `f` on consecutive blocks of [`ROWS_PER_BLOCK`] rows, in order, stopping at the first
/// error (which is therefore the first in row-major order if `f` reports its own first).
pub(crate) fn serial_blocks<F>(out: RowsOut<'_>, f: &F) -> Result<(), KernelError>
where
    F: Fn(RowsOut<'_>) -> Result<(), KernelError>,
{
    let mut rest = out;
    while rest.rows() > 0 {
        let n = ROWS_PER_BLOCK.min(rest.rows());
        let (head, tail) = rest.split_at(n);
        f(head)?;
        rest = tail;
    }
    Ok(())
}

/// Runs `f`, adding its wall time in nanoseconds to `busy` when given: the busy time of one
/// block of a parallel product, so that a caller can tell the threads' compute from the
/// product's wall time (fork/join, imbalance, descheduled workers). Timing reads no data.
pub(crate) fn timed<R>(busy: Option<&AtomicU64>, f: impl FnOnce() -> R) -> R {
    match busy {
        None => f(),
        Some(b) => {
            let start = std::time::Instant::now();
            let r = f();
            b.fetch_add(u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
            r
        }
    }
}

/// Runs `f` on every block of [`ROWS_PER_BLOCK`] rows, in parallel on the current rayon pool.
/// Every block runs even if another fails; the error returned is the one of the lowest block,
/// so it matches [`serial_blocks`].
pub(crate) fn par_blocks<F>(out: RowsOut<'_>, f: &F) -> Result<(), KernelError>
where
    F: Fn(RowsOut<'_>) -> Result<(), KernelError> + Sync,
{
    let rows = out.rows();
    if rows <= ROWS_PER_BLOCK {
        return f(out);
    }
    let blocks = rows.div_ceil(ROWS_PER_BLOCK);
    let mid = (blocks / 2) * ROWS_PER_BLOCK;
    let (left, right) = out.split_at(mid);
    let (left_res, right_res) = rayon::join(|| par_blocks(left, f), || par_blocks(right, f));
    // The left half holds the lower rows, so its error comes first in row-major order.
    left_res.and(right_res)
}

/// Runs `f` on every block of [`ROWS_PER_BLOCK`] rows, the blocks cut into `runs` stretches of
/// consecutive blocks (as even as whole blocks allow), each stretch in order on one thread of the
/// current rayon pool: one stretch per thread, so that a caller following the weight bytes
/// block by block sees each thread's rows as one stretch, not as the pieces work stealing would
/// cut. Every block runs even if another fails; the error returned is the lowest block's, as
/// [`par_blocks`].
pub(crate) fn par_runs<F>(out: RowsOut<'_>, runs: usize, f: &F) -> Result<(), KernelError>
where
    F: Fn(RowsOut<'_>) -> Result<(), KernelError> + Sync,
{
    let blocks = out.rows().div_ceil(ROWS_PER_BLOCK);
    if runs > 1 && blocks > 1 {
        let left_runs = runs / 2;
        let mid = (blocks * left_runs / runs).max(1) * ROWS_PER_BLOCK;
        let (left, right) = out.split_at(mid);
        let (left_res, right_res) =
            rayon::join(|| par_runs(left, left_runs, f), || par_runs(right, runs - left_runs, f));
        return left_res.and(right_res);
    }
    let mut result = Ok(());
    let mut rest = out;
    while rest.rows() > 0 {
        let n = ROWS_PER_BLOCK.min(rest.rows());
        let (head, tail) = rest.split_at(n);
        let block = f(head);
        if result.is_ok() {
            result = block;
        }
        rest = tail;
    }
    result
}

/// Runs `f` on the current thread while every other worker of the current rayon pool waits for
/// work awake: spinning (and yielding its core to any other runnable thread) instead of
/// sleeping. A rayon worker that finds no work falls asleep within about 20 us and takes 15-50
/// us to wake (a VM's inter-processor interrupt), which every parallel product started after a
/// serial stretch (norms, router, attention) paid: on an Intel Xeon VM (Emerald Rapids, 2 vCPUs)
/// a `rayon::join` of two halves lost 30-90 us of wall time after a gap of 20 us or more, and
/// 1-3 us with the workers kept awake (docs/BENCHMARKS.md, "Workers kept awake through a step").
/// They nap between looks while the step waits for the device ([`while_blocked`]) or has had
/// no work for them for a millisecond. Scheduling only: which thread runs a block
/// never changes its bits. Outside a pool, in a pool of one thread, or while another step of
/// the process keeps workers, `f` just runs.
pub fn with_workers_awake<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    // One step with keepers at a time: two on one pool could each end up running the other's
    // keeper beneath its own step (a worker waiting for a product runs any pending job) and
    // wait for the other's end forever. Per process, as rayon names no pool: a second engine's
    // steps meanwhile only run without keepers.
    if STEP_KEEPING.swap(true, Ordering::Acquire) {
        return f();
    }
    let _done = ClearOnDrop(&STEP_KEEPING);
    with_keepers(&Keepers::default(), |_| f())
}

/// Whether some step of the process runs [`with_workers_awake`]'s keepers now.
static STEP_KEEPING: AtomicBool = AtomicBool::new(false);

/// Clears the flag when dropped, however the step ends.
struct ClearOnDrop<'a>(&'a AtomicBool);

impl Drop for ClearOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// The workers [`with_workers_awake`] keeps: set to stop, how many keepers it offers and how
/// many are awake now, which workers keep (bit `i` for worker `i < 64`), how many naps they
/// took, how long they look for work before napping, and how long a started keeper waits for
/// the others ([`GATHER`]).
struct Keepers {
    stop: AtomicBool,
    wanted: AtomicUsize,
    awake: AtomicUsize,
    workers: AtomicU64,
    naps: AtomicUsize,
    nap_after: Duration,
    gather: Duration,
}

impl Default for Keepers {
    fn default() -> Keepers {
        Keepers {
            stop: AtomicBool::new(false),
            wanted: AtomicUsize::new(0),
            awake: AtomicUsize::new(0),
            workers: AtomicU64::new(0),
            naps: AtomicUsize::new(0),
            nap_after: NAP_AFTER,
            gather: GATHER,
        }
    }
}

fn with_keepers<R: Send>(keepers: &Keepers, f: impl FnOnce(&Keepers) -> R + Send) -> R {
    match rayon::current_thread_index() {
        Some(owner) => {
            let n = rayon::current_num_threads().saturating_sub(1);
            keepers.wanted.store(n, Ordering::Relaxed);
            nest_keepers(n, keepers, owner, f)
        }
        None => f(keepers),
    }
}

/// `n` nested joins, each offering one [`keep_awake`] job for another worker to take; the
/// innermost runs `f` (on the calling thread: inside a worker, a join's first closure runs
/// where it is called) and then stops them, also when `f` panics.
fn nest_keepers<R: Send>(n: usize, keepers: &Keepers, owner: usize, f: impl FnOnce(&Keepers) -> R + Send) -> R {
    if n == 0 {
        let _stop = StopOnDrop(&keepers.stop);
        return f(keepers);
    }
    rayon::join(|| nest_keepers(n - 1, keepers, owner, f), || keep_awake(keepers, owner)).0
}

/// Sets the flag when dropped: the keepers stop however `f` ends.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// How long a keeper looks for work without finding any before it naps between looks: longer
/// than the serial stretches between a step's products (attention and the recurrence run up
/// to about a millisecond a layer). Napping after 200 us gave back part of the resident gain
/// (docs/BENCHMARKS.md, "Workers kept awake through a step").
const NAP_AFTER: Duration = Duration::from_millis(1);

/// A nap between looks: the first product after it starts within about one nap (plus the
/// timer's slack), as a sleeping worker's would.
const NAP: Duration = Duration::from_micros(20);

/// Threads inside [`while_blocked`] now. Keepers nap while there are any: a keeper spinning
/// through the step's waits for the device took the core from the threads that a modeled drive
/// copies on (`--io sim`), and those cells ran 3-8% slower. Global, not per pool: a wait in
/// one engine only makes another engine's keepers nap, which changes no result.
static BLOCKED: AtomicUsize = AtomicUsize::new(0);

/// Runs `f`, which blocks (a wait for the device), with the keepers of
/// [`with_workers_awake`] napping meanwhile instead of spinning.
pub fn while_blocked<R>(f: impl FnOnce() -> R) -> R {
    BLOCKED.fetch_add(1, Ordering::Relaxed);
    let _unblock = Unblock;
    f()
}

/// Leaves [`while_blocked`]'s count however `f` ends.
struct Unblock;

impl Drop for Unblock {
    fn drop(&mut self) {
        BLOCKED.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How long a keeper that has started waits for the others to start before it looks for work:
/// a keeper looking for work would run the next keeper itself (nested, one thread for two)
/// before a sleeping worker woke to take it.
const GATHER: Duration = Duration::from_micros(200);

thread_local! {
    /// Whether this thread runs a keeper now.
    static KEEPING: Cell<bool> = const { Cell::new(false) };
}

/// Until told to stop: runs any job the pool has, else yields the core and looks again; naps
/// between looks instead while some thread is [`while_blocked`] or once idle past the
/// keepers' `nap_after`. Returns at once on the calling worker itself, if it pops its own
/// keeper while it waits for a product, and on a worker that keeps already: such a keeper is
/// lost for the rest of the step (a worker kept asleep), nothing worse.
fn keep_awake(keepers: &Keepers, owner: usize) {
    let index = rayon::current_thread_index();
    if index == Some(owner) || KEEPING.get() {
        return;
    }
    KEEPING.set(true);
    let _keeping = NotKeeping;
    keepers.awake.fetch_add(1, Ordering::Relaxed);
    if let Some(bit) = index.and_then(|i| 1u64.checked_shl(u32::try_from(i).unwrap_or(u32::MAX))) {
        keepers.workers.fetch_or(bit, Ordering::Relaxed);
    }
    let start = Instant::now();
    while keepers.awake.load(Ordering::Relaxed) < keepers.wanted.load(Ordering::Relaxed)
        && !keepers.stop.load(Ordering::Acquire)
        && start.elapsed() < keepers.gather
    {
        std::thread::yield_now();
    }
    let mut idle_since = Instant::now();
    while !keepers.stop.load(Ordering::Acquire) {
        if rayon::yield_now() == Some(rayon::Yield::Executed) {
            idle_since = Instant::now();
        } else if BLOCKED.load(Ordering::Relaxed) == 0 && idle_since.elapsed() < keepers.nap_after {
            std::thread::yield_now();
        } else {
            keepers.naps.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(NAP);
        }
    }
    keepers.awake.fetch_sub(1, Ordering::Relaxed);
}

/// Clears this thread's [`KEEPING`] when its keeper ends.
struct NotKeeping;

impl Drop for NotKeeping {
    fn drop(&mut self) {
        KEEPING.set(false);
    }
}

#[cfg(test)]
#[allow(clippy::expect_used)]
mod tests {
    use super::*;

    fn pool(threads: usize) -> rayon::ThreadPool {
        rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("test pool")
    }

    /// Waits (a liveness bound, not a timing) until `done`, false after 20 s.
    fn eventually(done: impl Fn() -> bool) -> bool {
        let start = Instant::now();
        while !done() {
            if start.elapsed() > Duration::from_secs(20) {
                return false;
            }
            std::thread::yield_now();
        }
        true
    }

    #[test]
    fn every_other_worker_stays_awake_until_f_returns() {
        for threads in [2, 3, 4] {
            // Waiting as long as it takes for the others (a loaded machine may start a worker
            // later than GATHER allows).
            let keepers = Keepers { gather: Duration::from_secs(20), ..Keepers::default() };
            let seen = AtomicUsize::new(0);
            let (awake_during, workers, owner, value) = pool(threads).install(|| {
                with_keepers(&keepers, |k| {
                    assert!(eventually(|| k.awake.load(Ordering::Relaxed) == threads - 1), "{threads} threads");
                    // Work offered meanwhile is still taken: both halves run.
                    rayon::join(|| seen.fetch_add(1, Ordering::Relaxed), || seen.fetch_add(1, Ordering::Relaxed));
                    let owner = rayon::current_thread_index().expect("in the pool");
                    (k.awake.load(Ordering::Relaxed), k.workers.load(Ordering::Relaxed), owner, 7)
                })
            });
            assert_eq!((awake_during, value, seen.into_inner()), (threads - 1, 7, 2), "{threads} threads");
            // One keeper on each worker but the caller's, not several nested on one.
            assert_eq!(workers, ((1u64 << threads) - 1) & !(1 << owner), "{threads} threads");
            assert_eq!(keepers.awake.into_inner(), 0, "every keeper has returned: {threads} threads");
        }
    }

    #[test]
    fn a_napping_keeper_still_takes_work() {
        let keepers = Keepers::default();
        let (b_started, a_saw_b) = (AtomicBool::new(false), AtomicBool::new(false));
        pool(2).install(|| {
            with_keepers(&keepers, |k| {
                assert!(eventually(|| k.awake.load(Ordering::Relaxed) == 1));
                // Idle past NAP_AFTER: the keeper naps between looks.
                std::thread::sleep(NAP_AFTER * 10);
                assert!(k.naps.load(Ordering::Relaxed) > 0 && k.awake.load(Ordering::Relaxed) == 1);
                // The second half can only run on the keeper while the first waits for it.
                rayon::join(
                    || a_saw_b.store(eventually(|| b_started.load(Ordering::Acquire)), Ordering::Relaxed),
                    || b_started.store(true, Ordering::Release),
                );
            })
        });
        assert!(a_saw_b.into_inner(), "the napping keeper took the job");
        assert_eq!(keepers.awake.into_inner(), 0);
    }

    #[test]
    fn keepers_nap_while_the_step_is_blocked_and_look_again_after() {
        // Never idle long enough to nap on their own: only a blocked thread makes them.
        let keepers = Keepers { nap_after: Duration::from_secs(3600), ..Keepers::default() };
        let (b_started, a_saw_b) = (AtomicBool::new(false), AtomicBool::new(false));
        let napped = pool(2).install(|| {
            with_keepers(&keepers, |k| {
                assert!(eventually(|| k.awake.load(Ordering::Relaxed) == 1));
                let napped = while_blocked(|| eventually(|| k.naps.load(Ordering::Relaxed) > 0));
                rayon::join(
                    || a_saw_b.store(eventually(|| b_started.load(Ordering::Acquire)), Ordering::Relaxed),
                    || b_started.store(true, Ordering::Release),
                );
                napped
            })
        });
        assert!(napped, "the keeper napped while the step was blocked");
        assert!(a_saw_b.into_inner(), "and took work after");
    }

    #[test]
    fn a_panic_stops_the_keepers_and_reaches_the_caller() {
        let p = pool(2);
        let keepers = Keepers::default();
        let was_awake = AtomicBool::new(false);
        let caught = p.install(|| {
            std::panic::catch_unwind(|| {
                with_keepers(&keepers, |k| {
                    was_awake.store(eventually(|| k.awake.load(Ordering::Relaxed) == 1), Ordering::Relaxed);
                    panic!("inside the step")
                })
            })
        });
        assert!(caught.is_err());
        assert!(was_awake.into_inner(), "the other worker was kept awake");
        assert_eq!(keepers.awake.into_inner(), 0);
        assert_eq!(p.install(|| with_workers_awake(|| 7)), 7, "the pool still works after a panic");
    }

    #[test]
    fn the_caller_running_its_own_keeper_returns_at_once() {
        let keepers = Keepers::default();
        let returned_before_stop = pool(2).install(|| {
            let owner = rayon::current_thread_index().expect("in the pool");
            let returned = AtomicBool::new(false);
            std::thread::scope(|scope| {
                // Ends a keeper that wrongly kept the caller, so that the test fails, not hangs.
                scope.spawn(|| {
                    if !eventually(|| returned.load(Ordering::Acquire)) {
                        keepers.stop.store(true, Ordering::Release);
                    }
                });
                keep_awake(&keepers, owner);
                let before = !keepers.stop.load(Ordering::Acquire);
                returned.store(true, Ordering::Release);
                before
            })
        });
        assert!(returned_before_stop && keepers.workers.into_inner() == 0);
    }

    #[test]
    fn steps_at_once_on_one_pool_all_end() {
        let p = pool(2);
        let done = AtomicUsize::new(0);
        std::thread::scope(|scope| {
            for _ in 0..4 {
                scope.spawn(|| {
                    for _ in 0..50 {
                        let sum = p.install(|| {
                            with_workers_awake(|| {
                                let (a, b) = rayon::join(|| 1, || 2);
                                a + b
                            })
                        });
                        done.fetch_add(sum, Ordering::Relaxed);
                    }
                });
            }
        });
        assert_eq!(done.into_inner(), 4 * 50 * 3);
    }

    #[test]
    fn outside_a_pool_or_alone_f_just_runs() {
        let keepers = Keepers::default();
        assert_eq!(with_keepers(&keepers, |k| k.awake.load(Ordering::Relaxed)), 0);
        assert_eq!(pool(1).install(|| with_keepers(&keepers, |k| k.awake.load(Ordering::Relaxed))), 0);
        assert_eq!(with_workers_awake(|| 5), 5);
    }
}
