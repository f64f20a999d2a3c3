//! Measuring decode speed for `k3ring bench` and `k3ring tune`: greedy decode after a warm-up,
//! with the store's counters and the tracer's busy intervals taken over the measured tokens only.
#![forbid(unsafe_code)]

use std::path::Path;
use std::time::Instant;

use serde::Serialize;

use super::draft::{DraftOptions, DraftStats};
use super::load::{open_resident, open_streaming, OpenError, StreamingRun};
use super::sampling::argmax;
use super::{Engine, EngineError};
use crate::exit::{Classify, ExitCode};
use crate::model::attribution::{Attribution, Window};
use crate::model::weights::WeightSource;
use crate::model::LogitRows;
use crate::pipeline::Pipeline;
use crate::storage::plan::Plan;
use crate::storage::stream::StreamStats;
use crate::trace::{Metrics, Tracer};

/// What to run.
#[derive(Clone, Debug)]
pub struct MeasureSpec {
    pub prompt: Vec<u32>,
    /// Decode steps before measuring (fill caches, reach steady state).
    pub warmup: usize,
    /// Decode steps measured.
    pub tokens: usize,
    pub prefill_chunk: usize,
}

/// One measured configuration.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Measurement {
    /// Every generated id (warm-up and measured): cells must agree on them.
    pub ids: Vec<u32>,
    pub seconds_per_token: f64,
    pub trunk_bytes_per_token: f64,
    pub expert_bytes_per_token: f64,
    /// Bytes read per second of I/O busy time (what the engine achieved while reading).
    pub read_rate_busy: f64,
    /// Bytes read per second of wall time.
    pub read_rate_wall: f64,
    pub io_busy_fraction: f64,
    pub compute_busy_fraction: f64,
    pub overlap_fraction: f64,
    pub stall_seconds_per_token: f64,
    /// Routed experts already requested when routing was known, over all routed experts.
    pub recall: f64,
    pub spec_wasted_bytes_per_token: f64,
    /// Time spent checking experts against their checksums on the compute path, per token, and
    /// the bytes checked (on either path).
    pub expert_verify_seconds_per_token: f64,
    pub expert_verified_bytes_per_token: f64,
    /// Of the time on the compute path, the hashing the experts' own products did (in cache;
    /// the time it added to them if the threads hashed evenly).
    pub expert_verify_in_products_seconds_per_token: f64,
    /// Time spent hashing experts while compute waited for a read (inside the stalls).
    pub expert_verify_waiting_seconds_per_token: f64,
    /// Resident runs: the compute per token that a layer's expert reads could overlap without
    /// routing prediction (shared and routed experts, after each router; see
    /// [`crate::model::moe::SPANS_READS_CAN_OVERLAP`]). `None` for streaming runs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub overlappable_seconds_per_token: Option<f64>,
    pub plan: Option<Plan>,
    /// Resident runs: time and weight bytes per operation class over the measured window
    /// (issue 19); `k3ring bench` sets it against its triad. `None` for streaming runs.
    #[serde(skip)]
    pub attribution: Option<Window>,
    /// Streaming runs over several devices (`pack --experts-to`): each device's share of the
    /// measured window, in device order (device 0 holds the shards and the trunk).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<DeviceWindow>,
    /// Drafted cells: the measured window's steps, guesses made and kept (its tokens are
    /// `steps + accepted`, at least `tokens`; per-token figures are over them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub draft: Option<DraftStats>,
    /// Streaming runs: the expert bytes read for each layer (index = layer) in each measured
    /// step, in step order, whatever started the read (the router or a guess). What the floor
    /// without prediction needs: a layer's reads overlap only that layer's expert compute.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub expert_bytes_by_step: Vec<Vec<u64>>,
    /// Resident runs: the layers with routed experts, which share
    /// `overlappable_seconds_per_token` equally (0 for streaming runs).
    #[serde(skip_serializing_if = "is_zero")]
    pub moe_layers: usize,
    /// Adaptive speculation's first per-layer trial had decided nothing when the window
    /// opened, so by design part of the measured passes ran without guesses: the cell measured
    /// the trial, not the setting it settles on (a longer `--warmup` measures that). False
    /// where nothing is guessed adaptively.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub speculation_trial_open: bool,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// One device's reads over a measured window.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DeviceWindow {
    /// What it holds: "shards and trunk", or an expert directory.
    pub name: String,
    pub bytes_per_token: f64,
    /// Bytes per second of the time this device had a read in flight.
    pub read_rate_busy: f64,
    /// The share of the window this device had a read in flight.
    pub busy_fraction: f64,
}

impl DeviceWindow {
    /// Each device's reads between `before` and `after`, over `seconds` and `tokens`.
    pub fn of(before: &StreamStats, after: &StreamStats, seconds: f64, tokens: f64) -> Vec<DeviceWindow> {
        after
            .devices
            .iter()
            .enumerate()
            .map(|(i, a)| {
                let b = before.devices.get(i);
                let bytes = a.bytes_read - b.map_or(0, |b| b.bytes_read);
                let busy = a.busy_seconds - b.map_or(0.0, |b| b.busy_seconds);
                DeviceWindow {
                    name: a.name.clone(),
                    bytes_per_token: bytes as f64 / tokens.max(1.0),
                    read_rate_busy: if busy > 0.0 { bytes as f64 / busy } else { 0.0 },
                    busy_fraction: if seconds > 0.0 { busy / seconds } else { 0.0 },
                }
            })
            .collect()
    }
}

/// Errors of a measurement: opening or running.
#[derive(Debug, thiserror::Error)]
pub enum MeasureError {
    #[error(transparent)]
    Open(#[from] OpenError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(
        "the budget holds {got} sequence slots, fewer than the {asked} a batch cell decodes together; lower the batch size to {got} (--batch {got}) or raise the budget"
    )]
    Slots { asked: usize, got: usize },
    #[error(
        "internal error: the measured window of a batch of {batch} ran {decode_rows} decode and {prefill_rows} prefill rows in {steps} steps, not one decode row per sequence per step"
    )]
    Window { batch: usize, steps: usize, decode_rows: u64, prefill_rows: u64 },
}

impl Classify for MeasureError {
    fn exit_code(&self) -> ExitCode {
        match self {
            MeasureError::Open(e) => e.exit_code(),
            MeasureError::Engine(e) => e.exit_code(),
            MeasureError::Slots { .. } => ExitCode::Usage,
            MeasureError::Window { .. } => ExitCode::Internal,
        }
    }
}

/// Decodes greedily: prefill, warm-up, then `tokens` timed steps. Returns the ids and the
/// measured window's seconds, calling `between` right before the window starts.
fn decode<S: WeightSource + crate::model::LayerHook>(
    engine: &Engine<S>,
    spec: &MeasureSpec,
    mut between: impl FnMut(),
) -> Result<(Vec<u32>, f64), EngineError> {
    let capacity = spec.prompt.len() + spec.warmup + spec.tokens + 1;
    let chunk = spec.prefill_chunk.clamp(1, capacity);
    let mut sess = engine.session(capacity, chunk)?;
    let vocab = engine.model.cfg.vocab_size;
    let logits = engine.prefill(&mut sess, &spec.prompt, LogitRows::Last, None)?;
    let mut next = argmax(&logits[..vocab]) as u32;
    let mut ids = vec![next];
    for _ in 0..spec.warmup {
        let logits = engine.prefill(&mut sess, &[next], LogitRows::Last, None)?;
        next = argmax(&logits[..vocab]) as u32;
        ids.push(next);
    }
    // Before every measured step: the first call opens the window, each later one closes a step.
    between();
    let start = Instant::now();
    for token in 0..spec.tokens {
        if token > 0 {
            between();
        }
        let logits = engine.prefill(&mut sess, &[next], LogitRows::Last, None)?;
        next = argmax(&logits[..vocab]) as u32;
        ids.push(next);
    }
    Ok((ids, start.elapsed().as_secs_f64()))
}

/// Decodes greedily with drafting: prefill, then steps until `warmup` tokens follow the first
/// one, then timed steps until at least `tokens` more were chosen (a step may choose several,
/// so the window ends at the first step boundary past them). Returns the ids, the window's
/// seconds and its drafting counts (its tokens: `steps + accepted`).
fn decode_drafted<S: WeightSource + crate::model::LayerHook>(
    engine: &Engine<S>,
    spec: &MeasureSpec,
    draft: &DraftOptions,
    between: impl FnMut(),
) -> Result<(Vec<u32>, f64, DraftStats), EngineError> {
    let max = 1 + spec.warmup + spec.tokens + draft.len;
    let capacity = spec.prompt.len() + max + 1;
    let chunk = spec.prefill_chunk.clamp(draft.len + 1, capacity);
    let mut sess = engine.session(capacity, chunk)?;
    engine.prefill(&mut sess, &spec.prompt, LogitRows::Last, None)?;
    let mut drafter = super::Drafter::new(draft.clone(), &spec.prompt);
    let mut io = DraftWindow {
        engine,
        warmup: 1 + spec.warmup,
        tokens: spec.tokens,
        ids: Vec::new(),
        start: None,
        between,
        window: DraftStats::default(),
    };
    let (sampling, mut rng, mut candidates) = (super::Sampling::default(), crate::rng::SplitMix64::new(0), Vec::new());
    let d = super::decode::Decode {
        max,
        sampling: &sampling,
        stop_ids: &[],
        drafter: Some(&mut drafter),
        rng: &mut rng,
        candidates: &mut candidates,
        constraint: None,
    };
    let mut context = spec.prompt.clone();
    super::decode::decode(engine, &mut sess, d, &mut context, &mut io)?;
    let seconds = io.start.map_or(0.0, |s| s.elapsed().as_secs_f64());
    Ok((io.ids, seconds, io.window))
}

/// The timed window of [`decode_drafted`].
struct DraftWindow<'e, S: WeightSource + crate::model::LayerHook, F: FnMut()> {
    engine: &'e Engine<S>,
    /// Tokens chosen before the window opens, and at least in it.
    warmup: usize,
    tokens: usize,
    ids: Vec<u32>,
    start: Option<Instant>,
    between: F,
    window: DraftStats,
}

impl<S: WeightSource + crate::model::LayerHook, F: FnMut()> super::decode::Steps for DraftWindow<'_, S, F> {
    fn chosen(&mut self, id: u32, _logits: &[f32]) -> bool {
        self.ids.push(id);
        true
    }

    fn stopped(&self) -> bool {
        self.start.is_some() && self.window.steps + self.window.accepted >= self.tokens as u64
    }

    fn run(&mut self, sess: &mut super::Session, rows: &[u32], _context: &[u32]) -> Result<(), EngineError> {
        // Before every measured step: the first call opens the window, each later one closes a
        // step.
        if self.start.is_none() && self.ids.len() >= self.warmup {
            (self.between)();
            self.start = Some(Instant::now());
        } else if self.start.is_some() {
            (self.between)();
        }
        if self.start.is_some() {
            self.window.steps += 1;
            self.window.drafted += rows.len() as u64 - 1;
            self.window.drafted_steps += u64::from(rows.len() > 1);
        }
        let logit_rows = if rows.len() == 1 { LogitRows::Last } else { LogitRows::All };
        self.engine.prefill(sess, rows, logit_rows, None)?;
        Ok(())
    }

    fn kept(&mut self, kept: usize) {
        // Called for the step `run` just ran, before the next one.
        if self.start.is_some() {
            self.window.accepted += kept as u64 - 1;
        }
    }
}

/// Measures a streaming configuration.
pub fn measure_streaming(
    model: &Path,
    trunk: &Path,
    run: &StreamingRun,
    kernels: kernels::Kernels,
    spec: &MeasureSpec,
) -> Result<Measurement, MeasureError> {
    measure_streaming_drafted(model, trunk, run, kernels, spec, None)
}

/// [`measure_streaming`], decoding with `draft` when given.
pub fn measure_streaming_drafted(
    model: &Path,
    trunk: &Path,
    run: &StreamingRun,
    kernels: kernels::Kernels,
    spec: &MeasureSpec,
    draft: Option<&DraftOptions>,
) -> Result<Measurement, MeasureError> {
    let (opened, plan) = open_streaming(model, trunk, run, kernels, |_| {})?;
    let engine = &opened.engine;
    let ((ids, seconds, drafted), window) = stream_window(engine, |start| match draft {
        Some(d) => decode_drafted(engine, spec, d, start).map(|(ids, s, w)| (ids, s, Some(w))),
        None => decode(engine, spec, start).map(|(ids, s)| (ids, s, None)),
    })?;
    let (before, after, m) = (&window.before, &window.after, &window.metrics);
    let n = drafted.map_or(spec.tokens, |d| (d.steps + d.accepted) as usize).max(1) as f64;
    let routed = (after.routed_experts - before.routed_experts) as f64;
    Ok(Measurement {
        ids,
        seconds_per_token: seconds / n,
        trunk_bytes_per_token: (after.trunk_bytes_read - before.trunk_bytes_read) as f64 / n,
        expert_bytes_per_token: (after.expert_bytes_read - before.expert_bytes_read) as f64 / n,
        read_rate_busy: window.read_rate_busy(),
        read_rate_wall: window.bytes_read() / seconds.max(1e-9),
        io_busy_fraction: m.io_busy_fraction,
        compute_busy_fraction: m.compute_busy_fraction,
        overlap_fraction: m.overlap_fraction,
        stall_seconds_per_token: m.stall_us / 1e6 / n,
        recall: if routed > 0.0 { (after.routed_recalled - before.routed_recalled) as f64 / routed } else { 0.0 },
        spec_wasted_bytes_per_token: (after.spec_wasted_bytes - before.spec_wasted_bytes) as f64 / n,
        expert_verify_seconds_per_token: (after.expert_verify_seconds - before.expert_verify_seconds) / n,
        expert_verified_bytes_per_token: (after.expert_verified_bytes - before.expert_verified_bytes) as f64 / n,
        expert_verify_in_products_seconds_per_token: (after.expert_verify_in_products_seconds
            - before.expert_verify_in_products_seconds)
            / n,
        expert_verify_waiting_seconds_per_token: (after.expert_verify_waiting_seconds
            - before.expert_verify_waiting_seconds)
            / n,
        overlappable_seconds_per_token: None,
        plan: Some(plan),
        attribution: None,
        devices: DeviceWindow::of(before, after, seconds, n),
        draft: drafted,
        expert_bytes_by_step: window.expert_bytes_by_step(),
        moe_layers: 0,
        speculation_trial_open: trial_open(run, before),
    })
}

/// Whether a window that opened at `before` fell in adaptive speculation's first trial.
pub(super) fn trial_open(run: &StreamingRun, before: &StreamStats) -> bool {
    let spec = run.pipeline.effective_speculation();
    spec.enabled && spec.adaptive && before.spec_trials_decided == 0
}

/// The ids of a plain greedy run of `n` tokens after `prompt`, resident (what a replay drafter
/// replays: [`super::Replay`]).
pub fn record_greedy(
    model: &Path,
    kernels: kernels::Kernels,
    threads: usize,
    prompt: &[u32],
    n: usize,
) -> Result<Vec<u32>, MeasureError> {
    let opened = open_resident(model, threads, kernels)?;
    let opts = super::GenerateOptions { gen: n, ..super::GenerateOptions::default() };
    Ok(opened.engine.generate(prompt, &opts, |_| {})?.generated_ids)
}

/// The storage counters and tracer metrics of the timed part of a streaming measurement.
pub(super) struct StreamWindow {
    pub before: StreamStats,
    pub after: StreamStats,
    pub metrics: Metrics,
    /// Each layer's expert bytes read so far at the window's start, at every step boundary
    /// inside it (each later call of the window's mark) and at its end.
    pub marks: Vec<Vec<u64>>,
}

impl StreamWindow {
    pub fn bytes_read(&self) -> f64 {
        (self.after.io.bytes_read - self.before.io.bytes_read) as f64
    }

    /// The expert bytes read for each layer in each step of the window: the differences of
    /// consecutive marks.
    pub fn expert_bytes_by_step(&self) -> Vec<Vec<u64>> {
        self.marks
            .windows(2)
            .map(|w| {
                let layers = w[1].len().max(w[0].len());
                (0..layers)
                    .map(|l| w[1].get(l).copied().unwrap_or(0).saturating_sub(w[0].get(l).copied().unwrap_or(0)))
                    .collect()
            })
            .collect()
    }

    /// Bytes per second of the time some read was in flight.
    pub fn read_rate_busy(&self) -> f64 {
        let busy_s = self.metrics.io_busy_us / 1e6;
        if busy_s > 0.0 {
            self.bytes_read() / busy_s
        } else {
            0.0
        }
    }
}

/// Runs `measure` on a streaming engine. `measure` calls its argument where timing starts
/// (after the warm-up): that snapshots the counters and restarts the tracer. It may call it
/// again at each later step boundary, which marks each layer's expert bytes there; the window
/// closes when `measure` returns.
pub(super) fn stream_window<T, E>(
    engine: &Engine<Streamed>,
    measure: impl FnOnce(&mut dyn FnMut()) -> Result<T, E>,
) -> Result<(T, StreamWindow), E> {
    let tracer = std::sync::Arc::clone(engine.src.tracer());
    let mut before: Option<StreamStats> = None;
    let mut marks = Vec::new();
    let out = measure(&mut || {
        if before.is_none() {
            let stats = engine.src.stats();
            marks.push(stats.expert_bytes_by_layer());
            before = Some(stats);
            tracer.reset_metrics();
            tracer.mark_start();
        } else {
            marks.push(engine.src.expert_bytes_by_layer());
        }
    })?;
    tracer.mark_end();
    let (before, after) = (before.unwrap_or_default(), engine.src.stats());
    marks.push(after.expert_bytes_by_layer());
    Ok((out, StreamWindow { before, after, metrics: tracer.metrics(), marks }))
}

/// Measures with every weight mapped and already in the page cache (no I/O while timing):
/// the resident compute time per token.
pub fn measure_resident(
    model: &Path,
    kernels: kernels::Kernels,
    threads: usize,
    spec: &MeasureSpec,
) -> Result<Measurement, MeasureError> {
    measure_resident_with(model, kernels, threads, spec, || {})
}

/// [`measure_resident`], calling `at_window` right before the timed tokens start (the read-tax
/// probe counts its stream's bytes from there).
pub fn measure_resident_with(
    model: &Path,
    kernels: kernels::Kernels,
    threads: usize,
    spec: &MeasureSpec,
    mut at_window: impl FnMut(),
) -> Result<Measurement, MeasureError> {
    let mut opened = open_resident(model, threads, kernels)?;
    // Kept events cost about 150 bytes and a lock per span, a few hundred spans per token: far
    // below the resolution of a measurement of matmuls over gigabytes.
    let tracer = std::sync::Arc::new(Tracer::new(true));
    opened.engine.model.tracer = Some(std::sync::Arc::clone(&tracer));
    let attribution = std::sync::Arc::new(Attribution::new());
    opened.engine.model.attribution = Some(std::sync::Arc::clone(&attribution));
    let mut opened_window = false;
    let (ids, seconds) = decode(&opened.engine, spec, || {
        // Called before every measured step; the window opens at the first.
        if !std::mem::replace(&mut opened_window, true) {
            tracer.reset_metrics();
            attribution.reset();
            at_window();
        }
    })?;
    let n = spec.tokens.max(1) as f64;
    let overlappable = tracer.span_seconds(&crate::model::moe::SPANS_READS_CAN_OVERLAP).map(|s| s / n);
    Ok(Measurement {
        ids,
        seconds_per_token: seconds / n,
        overlappable_seconds_per_token: overlappable,
        moe_layers: opened.engine.model.cfg.moe_layers().len(),
        attribution: Some(Window::of(&attribution, spec.tokens, seconds)),
        ..Measurement::default()
    })
}

/// The streaming source type measured (for callers that name it).
pub type Streamed = Pipeline;

/// STREAM-like triad `a = b + s * c` on `threads` threads over arrays larger than any cache;
/// returns bytes moved per second (3 arrays x 4 bytes per element), best of several passes.
pub fn triad_bandwidth(threads: usize) -> f64 {
    use rayon::prelude::*;
    const N: usize = 48 << 20; // 48 Mi floats = 192 MiB per array
    let Ok(pool) = rayon::ThreadPoolBuilder::new().num_threads(threads).build() else { return 0.0 };
    pool.install(|| {
        let mut a = vec![0.0f32; N];
        let b = vec![1.0f32; N];
        let c = vec![2.0f32; N];
        let mut best = 0.0f64;
        for _ in 0..5 {
            let start = Instant::now();
            a.par_chunks_mut(1 << 16).zip(b.par_chunks(1 << 16)).zip(c.par_chunks(1 << 16)).for_each(|((a, b), c)| {
                for ((x, y), z) in a.iter_mut().zip(b).zip(c) {
                    *x = *y + 3.0 * *z;
                }
            });
            let secs = start.elapsed().as_secs_f64();
            best = best.max((3 * N * 4) as f64 / secs);
        }
        std::hint::black_box(&a);
        best
    })
}

/// The FMA peak of `kernels`' ISA on `threads` threads, flops per second: every thread runs the
/// kernels' FMA probe ([`kernels::Kernels::fma_chains`]), best of five passes of about 10 ms.
/// `None` for the scalar kernels, which are not held against an FMA roof.
pub fn fma_peak(kernels: kernels::Kernels, threads: usize) -> Option<f64> {
    const ITERS: usize = 4_000_000;
    if kernels.isa() == kernels::Isa::Scalar {
        return None;
    }
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads.max(1)).build().ok()?;
    // Flops are linear in the iterations.
    let per_thread = kernels.fma_chains(1, 1.0, 0.0).1 * ITERS as u64;
    let mut best = 0.0f64;
    for _ in 0..5 {
        let start = Instant::now();
        pool.broadcast(|_| {
            let (m, a) = (std::hint::black_box(0.999_999f32), std::hint::black_box(1e-7f32));
            std::hint::black_box(kernels.fma_chains(ITERS, m, a))
        });
        best = best.max((per_thread * pool.current_num_threads() as u64) as f64 / start.elapsed().as_secs_f64());
    }
    Some(best)
}

/// Drops the page cache (needs root); says whether it did.
pub fn drop_page_cache() -> bool {
    // sync first so dirty pages can be dropped too.
    let _ = std::process::Command::new("sync").status();
    std::fs::write("/proc/sys/vm/drop_caches", b"3\n").is_ok()
}

/// Reads every file once so a mapped model is in the page cache (for resident measurements).
pub fn warm_page_cache(paths: &[std::path::PathBuf]) -> std::io::Result<u64> {
    use std::io::Read;
    let mut buf = vec![0u8; 16 << 20];
    let mut total = 0;
    for p in paths {
        let mut f = std::fs::File::open(p)?;
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            total += n as u64;
        }
    }
    Ok(total)
}
