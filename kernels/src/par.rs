//! Row-block splitting for the matmuls, serial and on the current rayon pool.
//!
//! Threads split output ROWS in fixed blocks of [`ROWS_PER_BLOCK`]; a row's value is computed
//! entirely by one thread with the same code as the serial path, so results never depend on the
//! thread count. Splitting is a `rayon::join` recursion at block-aligned midpoints, which
//! allocates nothing.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

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

/// A product's output rows cut into segments, each computed whole, in order, on one thread,
/// with the watch told of each block of rows just after the kernel has read its weights. For a
/// caller that must see every weight byte in order on the thread that computes with it while the
/// bytes are in that core's cache (an expert's checksum hashed as its products read it: the
/// kernel's first touch from memory is hidden by its arithmetic, the hash's second from cache is
/// not slowed by memory). The split never changes the bits: each row is computed whole by the
/// same code, whatever block holds it.
pub trait RowWatch: Sync {
    /// What one segment keeps from block to block.
    type State;
    /// Each segment's first row: the first is 0, they increase strictly, and each is below the
    /// product's rows; the last segment runs to the last row.
    fn segment_starts(&self) -> &[usize];
    /// Called on the thread that computes `segment`, before its first block.
    fn begin(&self, segment: usize) -> Self::State;
    /// Called after the kernel has computed `rows` (whether or not it failed): at most
    /// [`ROWS_PER_BLOCK`] rows of the segment, consecutive from its first.
    fn rows(&self, state: &mut Self::State, rows: Range<usize>);
    /// Called after the segment's last block, whether or not a block failed.
    fn end(&self, segment: usize, state: Self::State);
}

/// Checks that `starts` cut `rows` rows as [`RowWatch::segment_starts`] promises.
pub(crate) fn check_segment_starts(starts: &[usize], rows: usize) {
    assert_eq!(starts.first(), Some(&0), "segments must start at row 0");
    assert!(starts.windows(2).all(|w| w[0] < w[1]), "segment starts must increase strictly: {starts:?}");
    assert!(starts.len() == 1 || starts.last() < Some(&rows), "segment starts {starts:?} past {rows} rows");
}

/// Runs `f` on every block of the segments `segments` of `watch` (whose rows `out` holds), each
/// segment's blocks in order on one thread, the segments in parallel on the current rayon pool.
/// Every block runs even if another fails; the error returned is the one of the lowest row, as
/// [`par_blocks`].
pub(crate) fn par_segments<W, F>(out: RowsOut<'_>, watch: &W, segments: Range<usize>, f: &F) -> Result<(), KernelError>
where
    W: RowWatch,
    F: Fn(RowsOut<'_>) -> Result<(), KernelError> + Sync,
{
    if segments.len() > 1 {
        let mid = segments.start + segments.len() / 2;
        let cut = watch.segment_starts()[mid] - out.row_begin();
        let (left, right) = out.split_at(cut);
        let (left_res, right_res) = rayon::join(
            || par_segments(left, watch, segments.start..mid, f),
            || par_segments(right, watch, mid..segments.end, f),
        );
        return left_res.and(right_res);
    }
    let segment = segments.start;
    let mut state = watch.begin(segment);
    let mut result = Ok(());
    let mut rest = out;
    while rest.rows() > 0 {
        let n = ROWS_PER_BLOCK.min(rest.rows());
        let (head, tail) = rest.split_at(n);
        let first = head.row_begin();
        let block = f(head);
        watch.rows(&mut state, first..first + n);
        if result.is_ok() {
            result = block;
        }
        rest = tail;
    }
    watch.end(segment, state);
    result
}
