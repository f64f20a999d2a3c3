//! Row-block splitting for the matmuls, serial and on the current rayon pool.
//!
//! Threads split output ROWS in fixed blocks of [`ROWS_PER_BLOCK`]; a row's value is computed
//! entirely by one thread with the same code as the serial path, so results never depend on the
//! thread count. Splitting is a `rayon::join` recursion at block-aligned midpoints, which
//! allocates nothing.

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
