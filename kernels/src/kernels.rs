//! [`Kernels`]: the kernel table chosen once per process, and the crate's safe API.

use std::fmt;
use std::ops::Range;
use std::sync::atomic::AtomicU64;

use crate::error::KernelError;
use crate::isa::{Avx512Many, Isa};
use crate::mxfp4::Avx2Mxfp4;
use crate::{bf16, dot, hash, kda, math, mxfp4, softmax, vector};

/// The kernels of one ISA, as a table of function pointers filled once by [`Kernels::detect`]
/// or [`Kernels::with_isa`]. Cheap to copy; share it freely across threads.
///
/// Every method gives the same bits on every ISA (crate docs); panics are for shape mismatches,
/// which are programming errors.
#[derive(Clone, Copy)]
pub struct Kernels {
    isa: Isa,
    avx2_mxfp4: Avx2Mxfp4,
    avx512_many: Avx512Many,
    dot: dot::Fns,
    bf16: bf16::Fns,
    mxfp4: mxfp4::Fns,
    math: math::Fns,
    vector: vector::Fns,
    softmax: softmax::Fns,
    kda: kda::Fns,
    hash: hash::Fns,
}

impl fmt::Debug for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kernels")
            .field("isa", &self.isa)
            .field("avx2_mxfp4", &self.avx2_mxfp4)
            .field("avx512_many", &self.avx512_many)
            .finish_non_exhaustive()
    }
}

impl Kernels {
    /// The kernels of the best ISA this host supports ([`Isa::best`]).
    pub fn detect() -> Kernels {
        let isa = Isa::best();
        // SAFETY: Isa::best only returns ISAs for which is_available() is true.
        unsafe { Kernels::build(isa) }
    }

    /// The kernels of `isa`, or [`KernelError::IsaUnavailable`] if this host cannot run it.
    pub fn with_isa(isa: Isa) -> Result<Kernels, KernelError> {
        if !isa.is_available() {
            return Err(KernelError::IsaUnavailable(isa));
        }
        // SAFETY: is_available() was just checked.
        Ok(unsafe { Kernels::build(isa) })
    }

    /// # Safety
    /// `isa.is_available()` must be true.
    unsafe fn build(isa: Isa) -> Kernels {
        // SAFETY: forwarded from this function's contract; each `for_isa` only needs the ISA
        // to be available.
        unsafe {
            let avx2_mxfp4 = Avx2Mxfp4::for_this_cpu();
            let avx512_many = Avx512Many::for_this_cpu();
            Kernels {
                isa,
                avx2_mxfp4,
                avx512_many,
                dot: dot::Fns::for_isa(isa),
                bf16: bf16::Fns::for_isa(isa, avx512_many),
                mxfp4: mxfp4::Fns::for_isa(isa, avx2_mxfp4, avx512_many),
                math: math::Fns::for_isa(isa),
                vector: vector::Fns::for_isa(isa),
                softmax: softmax::Fns::for_isa(isa),
                kda: kda::Fns::for_isa(isa),
                hash: hash::Fns::for_isa(isa),
            }
        }
    }

    /// The ISA these kernels run on.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// These kernels with `v` as the one-token MXFP4 kernel of [`Isa::Avx2`] (built with
    /// [`Avx2Mxfp4::for_this_cpu`]); the same bits, only the speed differs. Other ISAs do not
    /// use it.
    #[must_use]
    pub fn with_avx2_mxfp4(self, v: Avx2Mxfp4) -> Kernels {
        // SAFETY: `self` was built for `self.isa`, so that ISA is available.
        let mxfp4 = unsafe { mxfp4::Fns::for_isa(self.isa, v, self.avx512_many) };
        Kernels { avx2_mxfp4: v, mxfp4, ..self }
    }

    /// These kernels with `v` as the many-token loop of the [`Isa::Avx512`] bf16 and MXFP4
    /// products (built with [`Avx512Many::for_this_cpu`]); the same bits, only the speed
    /// differs. Other ISAs do not use it.
    #[must_use]
    pub fn with_avx512_many(self, v: Avx512Many) -> Kernels {
        // SAFETY: `self` was built for `self.isa`, so that ISA is available.
        let (bf16, mxfp4) =
            unsafe { (bf16::Fns::for_isa(self.isa, v), mxfp4::Fns::for_isa(self.isa, self.avx2_mxfp4, v)) };
        Kernels { avx512_many: v, bf16, mxfp4, ..self }
    }

    /// The many-token loop in use: `Some` on [`Isa::Avx512`], `None` on other ISAs.
    pub fn avx512_many(&self) -> Option<Avx512Many> {
        (self.isa == Isa::Avx512).then_some(self.avx512_many)
    }

    /// The one-token MXFP4 kernel in use: `Some` on [`Isa::Avx2`], `None` on other ISAs (each has
    /// a single one).
    pub fn avx2_mxfp4(&self) -> Option<Avx2Mxfp4> {
        (self.isa == Isa::Avx2).then_some(self.avx2_mxfp4)
    }

    /// The FMA peak probe: `iters` iterations of independent chains of this ISA's widest FMA
    /// (`x = fma(x, m, a)` per lane, from 0) on the calling thread. Returns the lanes' sum (the
    /// same bits as the scalar twin with as many lanes) and the flops done, two per lane and
    /// iteration. Timing it on every thread of a pool gives the roof that multi-token products
    /// are held against.
    pub fn fma_chains(&self, iters: usize, m: f32, a: f32) -> (f32, u64) {
        // SAFETY: `self` was built for `self.isa`, so that ISA is available.
        let sum = unsafe { crate::peak::chains(self.isa, iters, m, a) };
        (sum, (2 * crate::peak::lanes(self.isa) * iters) as u64)
    }

    /// `y[tok, r] = canonical_dot(W[r, :] as f32, x[tok, :])` for every token and row
    /// (spec §3, §5: every BF16 projection).
    ///
    /// `w`: `[rows, cols]` bf16, raw little-endian checkpoint bytes, any alignment.
    /// `x`: `[t, cols]` f32. `y`: `[t, rows]` f32, overwritten.
    /// Float contract: f32 accumulators, canonical 16-lane FMA order and fixed tree (crate
    /// docs); a token's row does not depend on `t` or the other tokens. Runs on the calling
    /// thread. Panics if the slice lengths disagree with `rows`, `cols`, `t`.
    pub fn matmul_bf16(&self, w: &[u8], rows: usize, cols: usize, x: &[f32], t: usize, y: &mut [f32]) {
        self.bf16.matmul(w, rows, cols, x, t, y);
    }

    /// [`Kernels::matmul_bf16`] with output rows split in fixed blocks of 64 over the current
    /// rayon pool; the same bits for any thread count.
    pub fn par_matmul_bf16(&self, w: &[u8], rows: usize, cols: usize, x: &[f32], t: usize, y: &mut [f32]) {
        self.bf16.par_matmul(w, rows, cols, x, t, y, None);
    }

    /// [`Kernels::par_matmul_bf16`] that also adds to `busy` the wall time, in nanoseconds, of
    /// every block it computed, on whichever thread (the threads' busy time within the product,
    /// for attributing a product's wall time; the arithmetic is the same).
    #[allow(clippy::too_many_arguments)]
    pub fn par_matmul_bf16_busy(
        &self,
        w: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        t: usize,
        y: &mut [f32],
        busy: &AtomicU64,
    ) {
        self.bf16.par_matmul(w, rows, cols, x, t, y, Some(busy));
    }

    /// Rows `rows` of [`Kernels::par_matmul_bf16`] of a `[rows_total, cols]` matrix, from only
    /// those rows' weights `w` (`[rows.len(), cols]` bf16): writes `y[tok * rows_total + r]` for
    /// every token and every `r` in `rows`, the same bits as the whole product, and leaves the
    /// other entries of `y` (`[t, rows_total]`) untouched. For weights that arrive in row blocks.
    /// Panics if the slice lengths disagree with the shapes or `rows` is not within `rows_total`.
    #[allow(clippy::too_many_arguments)]
    pub fn par_matmul_bf16_rows(
        &self,
        w: &[u8],
        rows: Range<usize>,
        rows_total: usize,
        cols: usize,
        x: &[f32],
        t: usize,
        y: &mut [f32],
    ) {
        self.bf16.par_matmul_rows(w, rows, rows_total, cols, x, t, y, None);
    }

    /// [`Kernels::par_matmul_bf16_rows`] that also adds its blocks' wall time to `busy`, as
    /// [`Kernels::par_matmul_bf16_busy`].
    #[allow(clippy::too_many_arguments)]
    pub fn par_matmul_bf16_rows_busy(
        &self,
        w: &[u8],
        rows: Range<usize>,
        rows_total: usize,
        cols: usize,
        x: &[f32],
        t: usize,
        y: &mut [f32],
        busy: &AtomicU64,
    ) {
        self.bf16.par_matmul_rows(w, rows, rows_total, cols, x, t, y, Some(busy));
    }

    /// `y[tok, r] = canonical_dot(W[r, :], x[tok, :])` with `W` in MXFP4 (spec §4; routed
    /// experts' w1, w3, w2).
    ///
    /// `packed`: `[rows, cols / 2]`, element `2j` in the low nibble of byte `j`, `2j + 1` in the
    /// high nibble. `scales`: `[rows, cols / 32]` E8M0. An element is
    /// `(sign * E2M1[mag]) * 2^(s - 127)`, one f32 product ([`mxfp4_value`](crate::mxfp4_value)).
    /// `cols` must be a multiple of 32. Float contract as [`Kernels::matmul_bf16`].
    ///
    /// # Errors
    /// [`KernelError::BadScale`] for the first scale byte 0xFF in row-major order; `y` is then
    /// partly written and must not be used.
    // The argument list is the checkpoint's own shape (two byte tensors, their dims, the
    // activations and the output); bundling it into a struct would only rename the problem.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_mxfp4(
        &self,
        packed: &[u8],
        scales: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        t: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        self.mxfp4.matmul(&mxfp4::Args { packed, scales, rows, cols, x, t }, y)
    }

    /// [`Kernels::matmul_mxfp4`] with output rows split in fixed blocks of 64 over the current
    /// rayon pool; the same bits and the same error for any thread count.
    ///
    /// # Errors
    /// As [`Kernels::matmul_mxfp4`].
    #[allow(clippy::too_many_arguments)]
    pub fn par_matmul_mxfp4(
        &self,
        packed: &[u8],
        scales: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        t: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        self.mxfp4.par_matmul(&mxfp4::Args { packed, scales, rows, cols, x, t }, y, None)
    }

    /// [`Kernels::par_matmul_mxfp4`] that also adds to `busy` the blocks' wall time, as
    /// [`Kernels::par_matmul_bf16_busy`].
    ///
    /// # Errors
    /// As [`Kernels::matmul_mxfp4`].
    #[allow(clippy::too_many_arguments)]
    pub fn par_matmul_mxfp4_busy(
        &self,
        packed: &[u8],
        scales: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        t: usize,
        y: &mut [f32],
        busy: &AtomicU64,
    ) -> Result<(), KernelError> {
        self.mxfp4.par_matmul(&mxfp4::Args { packed, scales, rows, cols, x, t }, y, Some(busy))
    }

    /// [`Kernels::par_matmul_mxfp4`] (`busy` as [`Kernels::par_matmul_mxfp4_busy`] when
    /// given) that calls `watch` with the rows of each block (of
    /// [`ROWS_PER_BLOCK`](crate::ROWS_PER_BLOCK)) once the kernel has computed it, on the thread
    /// that computed it, whether or not it failed: for a caller that must see the weight bytes
    /// while they are in that core's cache (an expert's checksum hashed as its products read
    /// it). The blocks are cut into one stretch of consecutive blocks per thread, each run in
    /// order, so that the caller sees each thread's rows as one stretch. The same bits and
    /// error as the plain product.
    ///
    /// # Errors
    /// As [`Kernels::matmul_mxfp4`].
    #[allow(clippy::too_many_arguments)]
    pub fn par_matmul_mxfp4_watched<W>(
        &self,
        packed: &[u8],
        scales: &[u8],
        rows: usize,
        cols: usize,
        x: &[f32],
        t: usize,
        y: &mut [f32],
        busy: Option<&AtomicU64>,
        watch: &W,
    ) -> Result<(), KernelError>
    where
        W: Fn(Range<usize>) + Sync,
    {
        self.mxfp4.par_matmul_watched(&mxfp4::Args { packed, scales, rows, cols, x, t }, y, busy, watch)
    }

    /// `out[c] = sum_r x[r] * W[r, c]` (W^T x) with `W` `[rows, cols]` bf16 bytes (spec §5:
    /// MLA absorption of `kv_b_proj`). `x` has `rows` floats, `out` `cols`.
    ///
    /// Float contract: f32, sequential over `r` in increasing order,
    /// `out[c] = fma(x[r], W[r, c], out[c])` from +0.0; vectorised across `c` (no horizontal
    /// reduction). Calling thread only.
    pub fn matvec_t_bf16(&self, w: &[u8], rows: usize, cols: usize, x: &[f32], out: &mut [f32]) {
        self.bf16.matvec_t(w, rows, cols, x, out);
    }

    /// Canonical dot product (crate docs): 16 f32 lanes, FMA, fixed tree. Panics if the lengths
    /// differ.
    pub fn dot(&self, a: &[f32], b: &[f32]) -> f32 {
        self.dot.dot(a, b)
    }

    /// Canonical `dot(x, x)`.
    pub fn sum_squares(&self, x: &[f32]) -> f32 {
        self.dot.sum_squares(x)
    }

    /// `y[i] = fma(a, x[i], y[i])`. Panics if the lengths differ.
    pub fn axpy(&self, a: f32, x: &[f32], y: &mut [f32]) {
        self.vector.axpy(a, x, y);
    }

    /// `x[i] = x[i] * a`.
    pub fn scale(&self, a: f32, x: &mut [f32]) {
        self.vector.scale(a, x);
    }

    /// RMSNorm (spec §5): `out[i] = (x[i] * inv) * w[i]` with
    /// `inv = 1.0 / (sum_squares(x) / (n as f32) + eps).sqrt()`, all f32, the sum canonical.
    /// Panics if `x` is empty or the lengths differ.
    pub fn rmsnorm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        let ss = self.dot.sum_squares(x);
        self.vector.rmsnorm(ss, x, w, eps, out);
    }

    /// [`Kernels::rmsnorm`] with the weight as raw bf16 bytes (`2 * x.len()` bytes, any
    /// alignment), decoded exactly.
    pub fn rmsnorm_bf16w(&self, x: &[f32], w_bf16: &[u8], eps: f32, out: &mut [f32]) {
        let ss = self.dot.sum_squares(x);
        self.vector.rmsnorm_bf16w(ss, x, w_bf16, eps, out);
    }

    /// `x[i] = exp(x[i])` with this crate's exp ([`math`](crate::math) module docs: ~1 ulp).
    pub fn exp(&self, x: &mut [f32]) {
        self.math.unary(self.math.exp, x);
    }

    /// `x[i] = 1 / (1 + exp(-x[i]))`.
    pub fn sigmoid(&self, x: &mut [f32]) {
        self.math.unary(self.math.sigmoid, x);
    }

    /// `x[i] = x[i] * sigmoid(x[i])`.
    pub fn silu(&self, x: &mut [f32]) {
        self.math.unary(self.math.silu, x);
    }

    /// `x[i] = tanh(x[i])`, built from exp ([`math`](crate::math) module docs).
    pub fn tanh(&self, x: &mut [f32]) {
        self.math.unary(self.math.tanh, x);
    }

    /// SiTU-GLU (spec §5): `out[i] = ((b1 * tanh(a[i] / b1)) * sigmoid(a[i])) * up[i]` with
    /// `up[i] = b2 * tanh(b[i] / b2)`, or `b[i]` when `b2` is `None`; exactly this order, IEEE
    /// division. Panics if lengths differ or `b1`/`b2` is not finite and positive.
    pub fn situ_glu(&self, a: &[f32], b: &[f32], b1: f32, b2: Option<f32>, out: &mut [f32]) {
        self.math.situ_glu(a, b, b1, b2, out);
    }

    /// Softmax in place ([`softmax`](crate::softmax) module docs): NaN anywhere gives all NaN;
    /// `e_i = exp(x_i - max)`, canonical 16-lane sum, `x_i = e_i / sum`.
    pub fn softmax(&self, x: &mut [f32]) {
        self.softmax.softmax(x);
    }

    /// One KDA delta-rule step for one head (spec §5, KDA step 6; [`kda`](crate::kda) module
    /// docs for the exact order). `s`: `[dk, dv]` state, updated. `alpha`, `k`, `q`: `[dk]`;
    /// `v`, `out`: `[dv]`; `scratch`: at least `dv` floats, clobbered.
    // The signature mirrors the spec's symbols one to one; see `kda::Step` for the bundle used
    // inside.
    #[allow(clippy::too_many_arguments)]
    pub fn kda_step(
        &self,
        s: &mut [f32],
        dk: usize,
        dv: usize,
        alpha: &[f32],
        beta: f32,
        k: &[f32],
        v: &[f32],
        q: &[f32],
        out: &mut [f32],
        scratch: &mut [f32],
    ) {
        let step = kda::Step { dk, dv, alpha, beta, k, v, q };
        self.kda.step(&step, s, out, scratch);
    }

    /// XXH3-64 of `bytes` ([`hash`](crate::hash) module docs) on this ISA: the same value on
    /// every ISA. [`hash::xxh3_64`] uses the best ISA without a table.
    pub fn xxh3_64(&self, bytes: &[u8]) -> u64 {
        self.hash.xxh3_64(bytes)
    }

    /// A streaming XXH3-64 on this ISA ([`hash::Xxh3`]).
    pub fn xxh3(&self) -> hash::Xxh3 {
        hash::Xxh3::with_fns(self.hash)
    }
}
