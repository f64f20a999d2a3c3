//! Where a forward pass spends its time, per operation class (issue 19): nanoseconds, weight
//! bytes touched and calls, summed over the products and elementwise passes of each class.
//!
//! The forward pass times each product (or each run of small elementwise work) on the thread
//! that calls [`super::Model::forward_batch`]. A parallel bf16 or MXFP4 product also sums the
//! wall time of its row blocks on whichever threads ran them: its class gets that busy time
//! over the pool's thread count, and [`OpClass::ParallelIdle`] the rest of its wall time
//! (fork/join, imbalance, blocks fewer than threads, workers the OS did not run). Timed regions
//! never nest, so their sum is at most the wall time, and the caller names the rest (waits for
//! bytes, copies, bookkeeping, sampling) as [`AttributionTable::other_seconds_per_token`]: the
//! rows then sum to the measured s/token exactly.
//!
//! Off (no [`Attribution`] on the model), a [`Meter`] is one `Option` test per region and the
//! kernels run their plain entry points. On, a region costs an `Instant::now` pair and a few
//! relaxed atomic adds, and a parallel product one more pair per 64-row block: microseconds
//! per token against products over megabytes of weights. Nothing here reads or writes a value
//! of the arithmetic, so outputs are the same bits on or off. Allocates only in
//! [`Attribution::totals`] and the table.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kernels::{KernelError, Kernels};
use serde::Serialize;

use super::weights::{BlockCheck, SourceError, Streamed, TrunkView};

/// What a timed region computes. Each weight tensor is read in the regions of one class only,
/// so a class's bytes per decoded token are the sizes of its tensors (the routed experts: of
/// the experts chosen).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OpClass {
    /// The embedding rows of the step's tokens (bf16 to f32).
    Embedding,
    /// The attention-residual reads before attention, before the FFN, and at the head.
    ResidualReads,
    /// bf16 products of KDA: q, k, v, f_a, f_b, b, g and o projections.
    KdaProjections,
    /// KDA's carried part: short conv with history, SiLU, l2norm, delta-rule recurrence.
    KdaRecurrence,
    /// bf16 products of MLA: q_a, q_b, kv_a, g and o projections.
    MlaProjections,
    /// MLA over the latent cache: latent norm and append, scores, softmax, the absorbed kv_b.
    MlaAttention,
    /// bf16 products of the dense FFN (layer 0).
    DenseFfn,
    /// bf16 products of the fused shared experts.
    SharedExperts,
    /// The bf16 latent down and up projections around the routed experts.
    LatentProjections,
    /// The routed experts' MXFP4 products (w1, w3, w2).
    ExpertProducts,
    /// Router scores (bf16 gate product, sigmoid), the correction bias and the top-k.
    Router,
    /// RMSNorms, gates, SiTU-GLU and SiLU outside the classes above, the experts' weighted sum.
    NormsActivations,
    /// The output head's bf16 product.
    LmHead,
    /// Inside the parallel bf16 and MXFP4 products: their wall time minus the threads' busy
    /// time in their blocks over the thread count. Fork/join, load imbalance, a product of fewer
    /// blocks than threads, and workers the OS did not run.
    ParallelIdle,
}

/// Number of [`OpClass`] variants.
pub const OP_CLASS_COUNT: usize = 14;

impl OpClass {
    pub const ALL: [OpClass; OP_CLASS_COUNT] = [
        OpClass::Embedding,
        OpClass::ResidualReads,
        OpClass::KdaProjections,
        OpClass::KdaRecurrence,
        OpClass::MlaProjections,
        OpClass::MlaAttention,
        OpClass::DenseFfn,
        OpClass::SharedExperts,
        OpClass::LatentProjections,
        OpClass::ExpertProducts,
        OpClass::Router,
        OpClass::NormsActivations,
        OpClass::LmHead,
        OpClass::ParallelIdle,
    ];

    /// The row name of the tables.
    pub const fn name(self) -> &'static str {
        match self {
            OpClass::Embedding => "embedding rows",
            OpClass::ResidualReads => "attention-residual reads",
            OpClass::KdaProjections => "bf16 KDA projections",
            OpClass::KdaRecurrence => "KDA conv + recurrence",
            OpClass::MlaProjections => "bf16 MLA projections",
            OpClass::MlaAttention => "MLA attention (cache)",
            OpClass::DenseFfn => "bf16 dense FFN",
            OpClass::SharedExperts => "bf16 shared experts",
            OpClass::LatentProjections => "bf16 latent down/up",
            OpClass::ExpertProducts => "MXFP4 expert products",
            OpClass::Router => "router + top-k",
            OpClass::NormsActivations => "norms + activations",
            OpClass::LmHead => "bf16 lm_head",
            OpClass::ParallelIdle => "idle in products (fork/join, imbalance)",
        }
    }

    const fn index(self) -> usize {
        self as usize
    }
}

/// Per-class counters, shared by the threads that run forward passes of one model.
#[derive(Debug, Default)]
pub struct Attribution {
    nanos: [AtomicU64; OP_CLASS_COUNT],
    bytes: [AtomicU64; OP_CLASS_COUNT],
    calls: [AtomicU64; OP_CLASS_COUNT],
    /// Multiply-adds of the class's weight products: weights x rows (tokens) per product.
    macs: [AtomicU64; OP_CLASS_COUNT],
    /// Per class, its products' share of [`OpClass::ParallelIdle`].
    idle: [AtomicU64; OP_CLASS_COUNT],
}

/// One class's counters at a moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ClassTotal {
    pub nanos: u64,
    pub bytes: u64,
    pub calls: u64,
    /// Multiply-adds of the class's weight products (two flops each).
    pub macs: u64,
    /// The class's products' idle time, counted in [`OpClass::ParallelIdle`]'s `nanos`.
    pub idle_nanos: u64,
}

impl Attribution {
    pub fn new() -> Attribution {
        Attribution::default()
    }

    /// Zeroes every counter (the start of a measured window).
    pub fn reset(&self) {
        for a in self.nanos.iter().chain(&self.bytes).chain(&self.calls).chain(&self.macs).chain(&self.idle) {
            a.store(0, Ordering::Relaxed);
        }
    }

    fn add(&self, class: OpClass, nanos: u64, bytes: u64, macs: u64) {
        let i = class.index();
        self.nanos[i].fetch_add(nanos, Ordering::Relaxed);
        self.bytes[i].fetch_add(bytes, Ordering::Relaxed);
        self.calls[i].fetch_add(1, Ordering::Relaxed);
        self.macs[i].fetch_add(macs, Ordering::Relaxed);
    }

    /// The counters of every class, in [`OpClass::ALL`] order.
    pub fn totals(&self) -> Vec<(OpClass, ClassTotal)> {
        OpClass::ALL
            .iter()
            .map(|&c| {
                let i = c.index();
                let load = |a: &[AtomicU64; OP_CLASS_COUNT]| a[i].load(Ordering::Relaxed);
                let (nanos, bytes, calls, macs, idle_nanos) =
                    (load(&self.nanos), load(&self.bytes), load(&self.calls), load(&self.macs), load(&self.idle));
                (c, ClassTotal { nanos, bytes, calls, macs, idle_nanos })
            })
            .collect()
    }
}

/// The forward pass's handle on the counters: `Copy`, and nothing but an `Option` test when off.
#[derive(Clone, Copy, Debug, Default)]
pub struct Meter<'a>(Option<&'a Attribution>);

impl<'a> Meter<'a> {
    pub const OFF: Meter<'static> = Meter(None);

    pub fn new(to: Option<&'a Attribution>) -> Meter<'a> {
        Meter(to)
    }

    /// Runs `f`, counting its wall time and `bytes` of weights touched to `class`.
    #[inline]
    pub fn time<R>(self, class: OpClass, bytes: usize, f: impl FnOnce() -> R) -> R {
        match self.0 {
            None => f(),
            Some(a) => {
                let start = Instant::now();
                let r = f();
                let nanos = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
                a.add(class, nanos, bytes as u64, 0);
                r
            }
        }
    }
}

/// The counters of a measured window: `tokens` decoded in `seconds` of wall time, or `tokens`
/// batch steps when `per` is "step".
#[derive(Clone, Debug, Default)]
pub struct Window {
    pub totals: Vec<(OpClass, ClassTotal)>,
    pub tokens: usize,
    pub seconds: f64,
    /// What the table's rows are per: "token", or "step" (one token of every sequence).
    pub per: &'static str,
}

impl Window {
    /// The window's counters, as they stand, over `tokens` decoded in `seconds`.
    pub fn of(a: &Attribution, tokens: usize, seconds: f64) -> Window {
        Window { totals: a.totals(), tokens, seconds, per: "token" }
    }

    /// The window's counters over `steps` batch steps run in `seconds`.
    pub fn of_steps(a: &Attribution, steps: usize, seconds: f64) -> Window {
        Window { per: "step", ..Window::of(a, steps, seconds) }
    }

    /// The table against `triad` (bytes/s) and the FMA peak (flops/s) when measured.
    pub fn table(&self, triad: Option<f64>, fma_peak: Option<f64>) -> AttributionTable {
        let mut t = AttributionTable::new(&self.totals, self.tokens, self.seconds, triad);
        if !self.per.is_empty() {
            t.per = self.per;
        }
        t.with_fma_peak(fma_peak)
    }
}

impl Meter<'_> {
    /// Runs a parallel product `f`, which must pass the busy counter it is given (when on) to
    /// the kernel's `_busy` variant. The threads' busy time in its blocks over the pool's thread
    /// count counts to `class`, with its `bytes`; the rest of its wall time to
    /// [`OpClass::ParallelIdle`].
    #[inline]
    fn time_par<R>(self, class: OpClass, work: Work, f: impl FnOnce(Option<&AtomicU64>) -> R) -> R {
        let Some(a) = self.0 else { return f(None) };
        let busy = AtomicU64::new(0);
        let start = Instant::now();
        let r = f(Some(&busy));
        record_par(a, class, work, busy.load(Ordering::Relaxed), elapsed(start));
        r
    }

    /// The bf16 product `y = W x` of the matrix `s.mat` of `view` ([`Kernels::par_matmul_bf16`]),
    /// one row block at a time as the view hands them over, counted to `class` with the whole
    /// matrix's bytes as one call. Only the blocks' products are timed: a store's wait for its
    /// next block is not compute, and stays in the caller's remainder ("other").
    ///
    /// # Errors
    /// The view's, or [`SourceError::Internal`] for blocks that break its contract.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn bf16(
        self,
        k: &Kernels,
        class: OpClass,
        view: &dyn TrunkView,
        s: Streamed,
        x: &[f32],
        t: usize,
        y: &mut [f32],
    ) -> Result<(), SourceError> {
        let Some(a) = self.0 else { return bf16_product(k, view, s, x, t, y) };
        let m = s.mat;
        let mut check = BlockCheck::new(s);
        let busy = AtomicU64::new(0);
        let mut wall = 0u64;
        let read = view.row_blocks(&m, &mut |rows, w| {
            if check.admit(&rows, w) {
                let start = Instant::now();
                k.par_matmul_bf16_rows_busy(w, rows, m.rows, m.cols, x, t, y, &busy);
                wall = wall.saturating_add(elapsed(start));
            }
        });
        let work = Work { bytes: m.rows * m.cols * 2, macs: m.rows * m.cols * t };
        record_par(a, class, work, busy.load(Ordering::Relaxed), wall);
        read?;
        check.finish()
    }

    /// Runs `f`, adding its wall time in nanoseconds to `nanos` when on: one lap of a region
    /// that a store's waits interrupt, counted with [`Meter::record`] once it is done.
    #[inline]
    pub fn lap<R>(self, nanos: &mut u64, f: impl FnOnce() -> R) -> R {
        if self.0.is_none() {
            return f();
        }
        let start = Instant::now();
        let r = f();
        *nanos = nanos.saturating_add(elapsed(start));
        r
    }

    /// Counts `nanos` (the laps of one region) and `bytes` of weights to `class`, as one call.
    #[inline]
    pub fn record(self, class: OpClass, nanos: u64, bytes: usize) {
        if let Some(a) = self.0 {
            a.add(class, nanos, bytes as u64, 0);
        }
    }

    /// [`Kernels::par_matmul_mxfp4`] of `packed` and `scales`, counted to the expert products.
    ///
    /// # Errors
    /// As [`Kernels::par_matmul_mxfp4`].
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn mxfp4(
        self,
        k: &Kernels,
        (packed, scales): (&[u8], &[u8]),
        rows: usize,
        cols: usize,
        x: &[f32],
        t: usize,
        y: &mut [f32],
    ) -> Result<(), KernelError> {
        let work = Work { bytes: packed.len() + scales.len(), macs: rows * cols * t };
        self.time_par(OpClass::ExpertProducts, work, |busy| match busy {
            None => k.par_matmul_mxfp4(packed, scales, rows, cols, x, t, y),
            Some(b) => k.par_matmul_mxfp4_busy(packed, scales, rows, cols, x, t, y, b),
        })
    }

    /// [`Meter::mxfp4`] that calls `watch` with each block's rows once computed
    /// ([`Kernels::par_matmul_mxfp4_watched`]).
    ///
    /// # Errors
    /// As [`Kernels::par_matmul_mxfp4`].
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn mxfp4_watched<W: Fn(std::ops::Range<usize>) + Sync>(
        self,
        k: &Kernels,
        (packed, scales): (&[u8], &[u8]),
        rows: usize,
        cols: usize,
        x: &[f32],
        t: usize,
        y: &mut [f32],
        watch: &W,
    ) -> Result<(), KernelError> {
        let work = Work { bytes: packed.len() + scales.len(), macs: rows * cols * t };
        self.time_par(OpClass::ExpertProducts, work, |busy| {
            k.par_matmul_mxfp4_watched(packed, scales, rows, cols, x, t, y, busy, watch)
        })
    }
}

fn elapsed(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// What one weight product reads and computes.
#[derive(Clone, Copy)]
struct Work {
    /// Weight bytes.
    bytes: usize,
    /// Weights x rows.
    macs: usize,
}

/// Counts a parallel product of `wall` nanoseconds whose blocks were busy `busy` nanoseconds
/// summed over the threads (see [`Meter::time_par`]).
fn record_par(a: &Attribution, class: OpClass, work: Work, busy: u64, wall: u64) {
    // Blocks on one thread never overlap and all lie within the product, so busy time is at
    // most wall x threads; `min` only guards the clock's rounding.
    let threads = rayon::current_num_threads().max(1) as u64;
    let compute = (busy / threads).min(wall);
    a.add(class, compute, work.bytes as u64, work.macs as u64);
    a.add(OpClass::ParallelIdle, wall - compute, 0, 0);
    a.idle[class.index()].fetch_add(wall - compute, Ordering::Relaxed);
}

/// The bf16 product `y = W x` of the matrix `s.mat` of `view`, block by block as the view hands
/// the rows over, unmetered. Each output row is computed whole from its block, with the bits of
/// the whole product ([`Kernels::par_matmul_bf16_rows`]).
///
/// # Errors
/// The view's, or [`SourceError::Internal`] for blocks that break its contract.
pub fn bf16_product(
    k: &Kernels,
    view: &dyn TrunkView,
    s: Streamed,
    x: &[f32],
    t: usize,
    y: &mut [f32],
) -> Result<(), SourceError> {
    let m = s.mat;
    let mut check = BlockCheck::new(s);
    view.row_blocks(&m, &mut |rows, w| {
        if check.admit(&rows, w) {
            k.par_matmul_bf16_rows(w, rows, m.rows, m.cols, x, t, y);
        }
    })?;
    check.finish()
}

/// One row of the table.
#[derive(Clone, Debug, Serialize)]
pub struct AttributionRow {
    /// The [`OpClass`] in snake case, or "other" for the remainder.
    pub class: String,
    pub name: &'static str,
    pub seconds_per_token: f64,
    /// Of the measured s/token.
    pub share: f64,
    pub bytes_per_token: f64,
    pub calls_per_token: f64,
    /// Of the "idle in products" row, the part in this class's products.
    pub idle_seconds_per_token: f64,
    /// Weight bytes over this class's time (0 without bytes or time).
    pub bytes_per_second: f64,
    /// `bytes_per_second` over the triad measured in the same run (`None` without one).
    pub fraction_of_triad: Option<f64>,
    /// Flops of the class's weight products (two per multiply-add).
    pub flops_per_token: f64,
    /// Those flops over this class's time (0 without flops or time).
    pub flops_per_second: f64,
    /// `flops_per_second` over the FMA peak measured in the same run (`None` without one).
    pub fraction_of_fma_peak: Option<f64>,
    /// The class's roofline time: its bytes at the triad or its flops at the FMA peak,
    /// whichever takes longer (`None` without both limits, or for a class with neither).
    pub roof_seconds_per_token: Option<f64>,
}

/// Per-class time and bytes per token of a measured window, with the remainder. For a batch's
/// steps (`per` = "step"), every `_per_token` figure is per step and `tokens` counts steps.
#[derive(Clone, Debug, Serialize)]
pub struct AttributionTable {
    /// "token", or "step" (one token of every sequence of a batch).
    pub per: &'static str,
    pub seconds_per_token: f64,
    pub tokens: usize,
    /// The triad (bytes/s) the fractions are against.
    pub triad_bytes_per_second: Option<f64>,
    /// The classes, then "other": waits for bytes, copies, sampling and bookkeeping between
    /// the timed regions, i.e. the measured time no class counted. Rows sum to
    /// `seconds_per_token`.
    pub rows: Vec<AttributionRow>,
    pub other_seconds_per_token: f64,
    pub bytes_per_token: f64,
    /// Weight bytes per token over the triad: the memory-bandwidth floor.
    pub floor_seconds_per_token: Option<f64>,
    /// The FMA peak (flops/s, every compute thread) the flops are against.
    pub fma_peak_flops_per_second: Option<f64>,
    /// The roofline bound: the classes' roofline times summed (`None` without both limits).
    /// Where products run many tokens it exceeds the memory floor. Only the bf16 and MXFP4
    /// weight products count flops (the router's gate product, MLA attention and the KDA
    /// recurrence are held to their bytes), so it is a lower bound.
    pub roof_seconds_per_token: Option<f64>,
}

impl AttributionTable {
    /// The table of counters `totals` taken over `tokens` tokens decoded in `seconds` of wall
    /// time, against `triad` (bytes/s) when measured.
    pub fn new(totals: &[(OpClass, ClassTotal)], tokens: usize, seconds: f64, triad: Option<f64>) -> AttributionTable {
        let n = tokens.max(1) as f64;
        let per_token = seconds / n;
        let share = |s: f64| if per_token > 0.0 { s / per_token } else { 0.0 };
        let mut rows: Vec<AttributionRow> = totals
            .iter()
            .map(|(c, t)| {
                let s = t.nanos as f64 / 1e9 / n;
                let b = t.bytes as f64 / n;
                let rate = if s > 0.0 { b / s } else { 0.0 };
                let flops = 2.0 * t.macs as f64 / n;
                AttributionRow {
                    class: serde_json::to_value(c).ok().and_then(|v| v.as_str().map(str::to_owned)).unwrap_or_default(),
                    name: c.name(),
                    seconds_per_token: s,
                    share: share(s),
                    bytes_per_token: b,
                    calls_per_token: t.calls as f64 / n,
                    idle_seconds_per_token: t.idle_nanos as f64 / 1e9 / n,
                    bytes_per_second: rate,
                    fraction_of_triad: triad.filter(|&x| x > 0.0 && rate > 0.0).map(|x| rate / x),
                    flops_per_token: flops,
                    flops_per_second: if s > 0.0 { flops / s } else { 0.0 },
                    fraction_of_fma_peak: None,
                    roof_seconds_per_token: None,
                }
            })
            .collect();
        let counted: f64 = rows.iter().map(|r| r.seconds_per_token).sum();
        let other = per_token - counted;
        rows.push(AttributionRow {
            class: "other".to_owned(),
            name: "other (waits, copies, bookkeeping)",
            seconds_per_token: other,
            share: share(other),
            bytes_per_token: 0.0,
            calls_per_token: 0.0,
            idle_seconds_per_token: 0.0,
            bytes_per_second: 0.0,
            fraction_of_triad: None,
            flops_per_token: 0.0,
            flops_per_second: 0.0,
            fraction_of_fma_peak: None,
            roof_seconds_per_token: None,
        });
        let bytes: f64 = rows.iter().map(|r| r.bytes_per_token).sum();
        AttributionTable {
            per: "token",
            seconds_per_token: per_token,
            tokens,
            triad_bytes_per_second: triad,
            rows,
            other_seconds_per_token: other,
            bytes_per_token: bytes,
            floor_seconds_per_token: triad.filter(|&x| x > 0.0).map(|x| bytes / x),
            fma_peak_flops_per_second: None,
            roof_seconds_per_token: None,
        }
    }

    /// The table with each class's flops against `fma_peak` (flops/s) and, with the triad too,
    /// its roofline time and their sum.
    #[must_use]
    pub fn with_fma_peak(mut self, fma_peak: Option<f64>) -> AttributionTable {
        let Some(peak) = fma_peak.filter(|&p| p > 0.0) else { return self };
        self.fma_peak_flops_per_second = Some(peak);
        for r in &mut self.rows {
            r.fraction_of_fma_peak = (r.flops_per_second > 0.0).then(|| r.flops_per_second / peak);
        }
        let Some(triad) = self.triad_bytes_per_second.filter(|&t| t > 0.0) else { return self };
        for r in &mut self.rows {
            let (memory, fma) = (r.bytes_per_token / triad, r.flops_per_token / peak);
            r.roof_seconds_per_token = (memory > 0.0 || fma > 0.0).then_some(memory.max(fma));
        }
        self.roof_seconds_per_token = Some(self.rows.iter().filter_map(|r| r.roof_seconds_per_token).sum());
        self
    }

    /// The table as text lines (for `bench` and `run`'s reports). "idle s" is each class's part
    /// of the "idle in products" row (not included in its own s/token). With an FMA peak, each
    /// class's GFLOP/s, their fraction of the peak ("FMA") and the class's roofline time.
    pub fn lines(&self) -> Vec<String> {
        let per = self.per;
        let fma = self.fma_peak_flops_per_second.is_some();
        let mut head = format!(
            "{:<40} {:>9} {:>6} {:>9} {:>8} {:>7} {:>7} {:>8}",
            "class",
            format!("s/{per}"),
            "share",
            format!("GB/{per}"),
            "GB/s",
            "triad",
            "calls",
            "idle s"
        );
        if fma {
            head += &format!(" {:>8} {:>5} {:>8}", "GFLOP/s", "FMA", "roof s");
        }
        let mut out = vec![head];
        let fraction = |f: Option<f64>| f.map_or_else(|| "-".to_owned(), |f| format!("{f:.2}"));
        for r in &self.rows {
            let rate = if r.bytes_per_second > 0.0 { format!("{:.1}", r.bytes_per_second / 1e9) } else { "-".into() };
            let idle =
                if r.idle_seconds_per_token > 0.0 { format!("{:.4}", r.idle_seconds_per_token) } else { "-".into() };
            let mut line = format!(
                "{:<40} {:>9.4} {:>5.1}% {:>9.3} {:>8} {:>7} {:>7.0} {idle:>8}",
                r.name,
                r.seconds_per_token,
                100.0 * r.share,
                r.bytes_per_token / 1e9,
                rate,
                fraction(r.fraction_of_triad),
                r.calls_per_token
            );
            if fma {
                let gflops =
                    if r.flops_per_second > 0.0 { format!("{:.1}", r.flops_per_second / 1e9) } else { "-".into() };
                let roof = r.roof_seconds_per_token.map_or_else(|| "-".to_owned(), |s| format!("{s:.4}"));
                line += &format!(" {gflops:>8} {:>5} {roof:>8}", fraction(r.fraction_of_fma_peak));
            }
            out.push(line);
        }
        let of = |bound: f64| if self.seconds_per_token > 0.0 { bound / self.seconds_per_token } else { 0.0 };
        let floor = match (self.floor_seconds_per_token, self.triad_bytes_per_second) {
            (Some(f), Some(t)) => {
                format!("; triad {:.1} GB/s, floor {f:.3} s/{per}, decode at {:.2} of the floor", t / 1e9, of(f))
            }
            _ => String::new(),
        };
        let roof = match (self.roof_seconds_per_token, self.fma_peak_flops_per_second) {
            (Some(r), Some(p)) => {
                format!("; FMA peak {:.1} GFLOP/s, roof {r:.3} s/{per}, at {:.2} of the roof", p / 1e9, of(r))
            }
            _ => String::new(),
        };
        out.push(format!(
            "{:<40} {:>9.4} {:>5.1}% {:>9.3}{floor}{roof}",
            "total (measured)",
            self.seconds_per_token,
            100.0,
            self.bytes_per_token / 1e9
        ));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_sum_to_the_measured_time_and_other_is_the_rest() {
        let a = Attribution::new();
        Meter::new(Some(&a)).time(OpClass::LmHead, 100, || std::thread::sleep(std::time::Duration::from_millis(2)));
        Meter::OFF.time(OpClass::LmHead, 100, || ());
        let totals = a.totals();
        let lm = totals.iter().find(|(c, _)| *c == OpClass::LmHead).map(|(_, t)| *t).unwrap_or_default();
        assert_eq!((lm.bytes, lm.calls), (100, 1));
        assert!(lm.nanos >= 2_000_000);
        let table = AttributionTable::new(&totals, 2, 0.01, Some(1e10));
        let sum: f64 = table.rows.iter().map(|r| r.seconds_per_token).sum();
        assert!((sum - 0.005).abs() < 1e-12, "{sum}");
        assert_eq!(table.rows.last().map(|r| r.class.as_str()), Some("other"));
        assert_eq!(table.bytes_per_token, 50.0);
        a.reset();
        assert!(a.totals().iter().all(|(_, t)| *t == ClassTotal::default()));
    }

    #[test]
    fn a_product_counts_its_multiply_adds_and_each_class_is_held_to_its_own_roof() -> Result<(), KernelError> {
        let a = Attribution::new();
        let k = Kernels::detect();
        // 64 rows x 32 columns of MXFP4 (16 packed bytes and one scale per row), 3 tokens.
        let (rows, cols, t) = (64, 32, 3);
        let (packed, scales) = (vec![0x21u8; rows * cols / 2], vec![127u8; rows]);
        let mut y = vec![0.0f32; t * rows];
        Meter::new(Some(&a)).mxfp4(&k, (&packed, &scales), rows, cols, &vec![1.0; t * cols], t, &mut y)?;
        let totals = a.totals();
        let e = totals.iter().find(|(c, _)| *c == OpClass::ExpertProducts).map(|(_, t)| *t).unwrap_or_default();
        assert_eq!((e.bytes, e.macs, e.calls), ((rows * cols / 2 + rows) as u64, (rows * cols * t) as u64, 1));

        // Over 2 steps of 8 s, at 10 GB/s and 100 GFLOP/s: class A reads 20 GB per step and does
        // 10 GFLOP (2 s of memory); class B reads 1 GB and does 200 GFLOP (2 s of flops).
        let mut totals = vec![(OpClass::KdaProjections, ClassTotal::default()); 2];
        totals[0].1 =
            ClassTotal { nanos: 4_000_000_000, bytes: 40_000_000_000, calls: 1, macs: 10_000_000_000, idle_nanos: 0 };
        totals[1] = (
            OpClass::ExpertProducts,
            ClassTotal { nanos: 4_000_000_000, bytes: 2_000_000_000, calls: 1, macs: 200_000_000_000, idle_nanos: 0 },
        );
        let w = Window { totals, tokens: 2, seconds: 16.0, per: "step" };
        let table = w.table(Some(10e9), Some(100e9));
        let roofs: Vec<Option<f64>> = table.rows.iter().map(|r| r.roof_seconds_per_token).collect();
        assert_eq!(roofs, [Some(2.0), Some(2.0), None]);
        assert_eq!(table.roof_seconds_per_token, Some(4.0));
        assert_eq!(table.rows[1].fraction_of_fma_peak, Some(1.0));
        assert_eq!(table.floor_seconds_per_token, Some(2.1));
        let text = table.lines().join("\n");
        assert!(text.contains("s/step") && text.contains("roof 4.000 s/step, at 0.50 of the roof"), "{text}");
        // Without the peak there is no roof, and the table is the one of before.
        let plain = w.table(Some(10e9), None);
        assert!(plain.roof_seconds_per_token.is_none() && !plain.lines().join("\n").contains("GFLOP/s"));
        Ok(())
    }
}
