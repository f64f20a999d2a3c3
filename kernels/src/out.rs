//! [`RowsOut`]: the output of a matmul, `y[t, rows]` row-major, split by output rows so that
//! threads can write disjoint row ranges of every token at once.
//!
//! Why unsafe: a row range of `y[t, rows]` is `t` separate strided segments, which no safe slice
//! split can hand to another thread without allocating. `RowsOut` is a `&mut [f32]` restricted to
//! the columns `row_begin..row_end` of the `[t, rows]` matrix; `split_at` hands out disjoint
//! ranges, exactly like `split_at_mut`. This is the only unsafe code outside the SIMD files.

use std::marker::PhantomData;
use std::ptr::NonNull;

/// A unique borrow of the entries `ptr[tok * rows_total + r]` for every token `tok < t` and
/// every row `r` in `row_begin..row_end`, where `ptr` is token 0 of this view: the start of `y`,
/// or of a later token for a window of [`RowsOut::tokens_mut`].
pub(crate) struct RowsOut<'a> {
    /// Token 0 of this view; `ptr..ptr + t * rows_total` lies inside the `y` borrowed for `'a`.
    ptr: NonNull<f32>,
    /// Rows of the whole output; the stride between two tokens.
    rows_total: usize,
    /// Tokens of this view (all of `y`'s, `y.len() == t * rows_total`, unless a window).
    t: usize,
    row_begin: usize,
    row_end: usize,
    _borrow: PhantomData<&'a mut [f32]>,
}

// SAFETY: a RowsOut is a unique borrow of its own entries (split_at only ever produces disjoint
// row ranges and consumes the original; tokens_mut borrows its parent mutably while it lives), so
// sending it to another thread is as sound as sending the `&mut [f32]` it was made from.
unsafe impl Send for RowsOut<'_> {}

impl<'a> RowsOut<'a> {
    /// Borrows all of `y`, which holds `t` tokens of `rows` outputs each.
    pub(crate) fn new(y: &'a mut [f32], t: usize, rows: usize) -> Self {
        let len = t.checked_mul(rows);
        assert_eq!(len, Some(y.len()), "y must hold t * rows = {t} * {rows} floats");
        RowsOut {
            ptr: NonNull::from(y).cast::<f32>(),
            rows_total: rows,
            t,
            row_begin: 0,
            row_end: rows,
            _borrow: PhantomData,
        }
    }

    /// Number of rows this piece owns.
    pub(crate) fn rows(&self) -> usize {
        self.row_end - self.row_begin
    }

    /// Index of this piece's first row in the whole output.
    pub(crate) fn row_begin(&self) -> usize {
        self.row_begin
    }

    /// Splits into rows `[0, mid)` and `[mid, rows)` of this piece.
    pub(crate) fn split_at(self, mid: usize) -> (RowsOut<'a>, RowsOut<'a>) {
        assert!(mid <= self.rows(), "split point {mid} past {} rows", self.rows());
        let cut = self.row_begin + mid;
        let left = RowsOut { row_end: cut, ..self };
        let right = RowsOut { row_begin: cut, ..self };
        (left, right)
    }

    /// Fills token 0 of every row of this piece: `R` rows at a time with `block(r)` (the
    /// outputs of rows `r..r + R`), then the rows left over one at a time with `single(r)`.
    /// The single-token SIMD kernels stream several rows per pass so that each load of x
    /// serves all of them; this is their shared walk over the rows.
    #[inline(always)]
    pub(crate) fn fill_token0_by_blocks<const R: usize>(
        &mut self,
        mut block: impl FnMut(usize) -> [f32; R],
        mut single: impl FnMut(usize) -> [f32; 1],
    ) {
        let rows = self.rows();
        let mut r = 0;
        while r + R <= rows {
            self.set_block(0, r, [block(r)]);
            r += R;
        }
        while r < rows {
            self.set_block(0, r, [single(r)]);
            r += 1;
        }
    }

    /// Fills every token (`T` of them, all this output holds) of every row of this piece: `R`
    /// rows at a time with `block(r)` (`[token][i]`: the outputs of rows `r..r + R`), then the
    /// rows left over one at a time with `single(r)`. The few-token SIMD kernels' walk: each
    /// decoded weight serves all `T` tokens from registers.
    #[inline(always)]
    pub(crate) fn fill_tokens_by_blocks<const R: usize, const T: usize>(
        &mut self,
        mut block: impl FnMut(usize) -> [[f32; R]; T],
        mut single: impl FnMut(usize) -> [[f32; 1]; T],
    ) {
        assert_eq!(self.t, T, "the walk fills all {} tokens", self.t);
        let rows = self.rows();
        let mut r = 0;
        while r + R <= rows {
            self.set_block(0, r, block(r));
            r += R;
        }
        while r < rows {
            self.set_block(0, r, single(r));
            r += 1;
        }
    }

    /// Writes `sums` (`[token][i]`) to tokens `token..token + T` of rows `row..row + R`.
    #[inline(always)]
    pub(crate) fn set_block<const R: usize, const T: usize>(&mut self, token: usize, row: usize, sums: [[f32; R]; T]) {
        for (k, sums) in sums.into_iter().enumerate() {
            for (i, s) in sums.into_iter().enumerate() {
                self.set(token + k, row + i, s);
            }
        }
    }

    /// Tokens `t0..t0 + n` of this piece's rows, borrowed: a pass of a few-token kernel over
    /// part of a larger batch.
    pub(crate) fn tokens_mut(&mut self, t0: usize, n: usize) -> RowsOut<'_> {
        assert!(t0.checked_add(n).is_some_and(|end| end <= self.t), "tokens {t0}..+{n} out of {}", self.t);
        // SAFETY: t0 <= t, so the offset t0 * rows_total is at most t * rows_total == y.len():
        // within (or one past the end of) the slice `ptr` came from. The result owns entries
        // (t0 + tok) * rows_total + r for tok < n and r in row_begin..row_end, a subset of
        // this piece's, and borrows `self` mutably for as long as it lives.
        let ptr = unsafe { self.ptr.add(t0 * self.rows_total) };
        RowsOut { ptr, t: n, _borrow: PhantomData, ..*self }
    }

    /// Rows `r0..` of this piece, borrowed: the rows a kernel leaves to another loop.
    pub(crate) fn rows_from(&mut self, r0: usize) -> RowsOut<'_> {
        assert!(r0 <= self.rows(), "rows from {r0} past {}", self.rows());
        RowsOut { row_begin: self.row_begin + r0, _borrow: PhantomData, ..*self }
    }

    /// Writes output `(token, row)`, `row` counted from this piece's first row.
    #[inline]
    pub(crate) fn set(&mut self, token: usize, row: usize, value: f32) {
        assert!(token < self.t, "token {token} out of {}", self.t);
        assert!(row < self.rows(), "row {row} out of {}", self.rows());
        let index = token * self.rows_total + self.row_begin + row;
        // SAFETY: token < t and row_begin + row < row_end <= rows_total, so
        // index < t * rows_total: inside `ptr..ptr + t * rows_total`, which lies in the slice
        // borrowed mutably for 'a. The entry's row lies in row_begin..row_end, which no other
        // RowsOut owns (split_at hands out disjoint ranges; a token window borrows its parent),
        // so the write races with nothing.
        unsafe { self.ptr.add(index).write(value) }
    }
}

/// The passes of `t` tokens through the few-token kernels, as (first token, tokens): four at a
/// time, and five left as three and two (a one-token pass would stream the weights once more for
/// a single token).
pub(crate) fn token_passes(t: usize) -> impl Iterator<Item = (usize, usize)> {
    let mut t0 = 0;
    std::iter::from_fn(move || {
        let n = match t - t0 {
            0 => return None,
            5 => 3,
            left => left.min(4),
        };
        t0 += n;
        Some((t0 - n, n))
    })
}

/// `t` tokens as consecutive runs of at most `most` (`most >= 1`), as (first token, tokens):
/// as few runs as that allows, their lengths differing by at most one, the longer first. The
/// many-token bf16 kernel's token blocks and passes: an even split never leaves a short run
/// that streams the weights again for one or two tokens.
pub(crate) fn even_runs(t: usize, most: usize) -> impl Iterator<Item = (usize, usize)> {
    let runs = t.div_ceil(most.max(1));
    let (base, longer) = (t.checked_div(runs).unwrap_or(0), t.checked_rem(runs).unwrap_or(0));
    (0..runs).map(move |i| (i * base + i.min(longer), base + usize::from(i < longer)))
}

// RowsOut must never be Clone or Copy: two copies would alias the same rows. `split_at` copies
// its (Copy) fields with `..self`, which consumes the original.
#[cfg(test)]
impl RowsOut<'_> {
    fn tokens(&self) -> usize {
        self.t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_pieces_write_their_own_rows() {
        let mut y = vec![0.0f32; 3 * 5];
        let out = RowsOut::new(&mut y, 3, 5);
        assert_eq!(out.tokens(), 3);
        let (mut a, mut b) = out.split_at(2);
        assert_eq!((a.row_begin(), a.rows()), (0, 2));
        assert_eq!((b.row_begin(), b.rows()), (2, 3));
        for tok in 0..3 {
            for r in 0..2 {
                a.set(tok, r, (tok * 10 + r) as f32);
            }
            for r in 0..3 {
                b.set(tok, r, (tok * 10 + r + 2) as f32);
            }
        }
        let want: Vec<f32> = (0..3).flat_map(|tok| (0..5).map(move |r| (tok * 10 + r) as f32)).collect();
        assert_eq!(y, want);
    }

    #[test]
    fn a_token_window_writes_its_tokens_of_the_pieces_rows() {
        let mut y = vec![0.0f32; 4 * 5];
        let (_a, mut b) = RowsOut::new(&mut y, 4, 5).split_at(3);
        let mut w = b.tokens_mut(1, 2);
        assert_eq!((w.tokens(), w.row_begin(), w.rows()), (2, 3, 2));
        w.set(0, 0, 1.0);
        w.set(1, 1, 2.0);
        let mut want = vec![0.0f32; 20];
        (want[5 + 3], want[10 + 4]) = (1.0, 2.0);
        assert_eq!(y, want);
    }

    #[test]
    #[should_panic(expected = "tokens 3..+2 out of 4")]
    fn a_token_window_past_the_tokens_panics() {
        let mut y = vec![0.0f32; 4];
        let _ = RowsOut::new(&mut y, 4, 1).tokens_mut(3, 2);
    }

    #[test]
    fn passes_cover_the_tokens_in_order_four_at_a_time_and_never_one_after_the_first() {
        let passes = |t| token_passes(t).collect::<Vec<_>>();
        assert_eq!(passes(5), [(0, 3), (3, 2)]);
        assert_eq!(passes(9), [(0, 4), (4, 3), (7, 2)]);
        assert_eq!(passes(16), [(0, 4), (4, 4), (8, 4), (12, 4)]);
        for t in 1..100 {
            let p = passes(t);
            assert_eq!(p.iter().map(|q| q.1).sum::<usize>(), t);
            assert!(p.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0), "{t}: {p:?}");
            assert!(p.iter().all(|q| (1..=4).contains(&q.1)) && (t == 1 || p.iter().all(|q| q.1 > 1)), "{t}: {p:?}");
        }
    }

    #[test]
    fn even_runs_cover_the_tokens_in_order_in_the_fewest_runs_of_near_equal_length() {
        let runs = |t, most| even_runs(t, most).collect::<Vec<_>>();
        assert_eq!(runs(16, 6), [(0, 6), (6, 5), (11, 5)]);
        assert_eq!(runs(7, 6), [(0, 4), (4, 3)]);
        assert_eq!(runs(17, 16), [(0, 9), (9, 8)]);
        assert_eq!(runs(0, 6), []);
        for most in 1..20 {
            for t in 0..100 {
                let r = runs(t, most);
                assert_eq!(r.len(), t.div_ceil(most), "{t}/{most}: {r:?}");
                assert_eq!(r.iter().map(|q| q.1).sum::<usize>(), t);
                assert!(r.first().is_none_or(|q| q.0 == 0), "{t}/{most}: {r:?}");
                assert!(r.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0 && w[0].1 >= w[1].1), "{t}/{most}: {r:?}");
                assert!(r.iter().all(|q| q.1 <= most && q.1 + 1 >= r[0].1 && q.1 > 0), "{t}/{most}: {r:?}");
            }
        }
    }

    #[test]
    #[should_panic(expected = "row 2 out of 2")]
    fn set_outside_piece_panics() {
        let mut y = vec![0.0f32; 4];
        let (mut a, _b) = RowsOut::new(&mut y, 1, 4).split_at(2);
        a.set(0, 2, 1.0);
    }
}
