//! Sessions and generation: chunked prefill, then incremental decode that carries the KDA state,
//! the conv history and the MLA latent cache; or full recompute of the prefix at every step
//! (used to verify the incremental path). Runs the model inside its own rayon pool so the thread
//! count is explicit; results never depend on it.
#![forbid(unsafe_code)]

pub mod load;
pub mod measure;
pub mod sampling;

use std::time::Instant;

use crate::exit::{Classify, ExitCode};
use crate::model::weights::WeightSource;
use crate::model::{LayerHook, LogitRows, Model, ModelError, ModelState, Probe, Scratch};
pub use load::{open_resident, open_streaming, OpenError, Opened, StreamingRun};
pub use sampling::Sampling;

/// Why generation stopped early.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(
        "the states and KV cache for {positions} positions need {need} bytes ({need_gib:.2} GiB) but only {available} bytes ({available_gib:.2} GiB) are available; use a shorter prompt or --gen"
    )]
    Memory { positions: usize, need: u64, need_gib: f64, available: u64, available_gib: f64 },
    #[error("cannot build a thread pool of {threads} threads: {message}")]
    Threads { threads: usize, message: String },
    #[error("the prompt is empty: give at least one token")]
    EmptyPrompt,
    #[error(transparent)]
    RouteLog(#[from] crate::storage::stream::cache_sim::TraceError),
}

impl Classify for EngineError {
    fn exit_code(&self) -> ExitCode {
        match self {
            EngineError::Model(e) => e.exit_code(),
            EngineError::Memory { .. } | EngineError::EmptyPrompt => ExitCode::Usage,
            EngineError::Threads { .. } => ExitCode::Internal,
            EngineError::RouteLog(e) => e.exit_code(),
        }
    }
}

/// Options of one generation.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Tokens to generate at most.
    pub gen: usize,
    pub sampling: Sampling,
    /// Stop after producing any of these (it is still reported).
    pub stop_ids: Vec<u32>,
    /// Re-run the whole prefix at every step instead of carrying state.
    pub full_recompute: bool,
    /// Tokens per prefill pass.
    pub prefill_chunk: usize,
    /// Keep the logits that chose each generated token (tests).
    pub keep_logits: bool,
    /// Write every routing decision here (`--dump-trace`).
    pub route_log: Option<std::path::PathBuf>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            gen: 32,
            sampling: Sampling::default(),
            stop_ids: Vec::new(),
            full_recompute: false,
            prefill_chunk: 32,
            keep_logits: false,
            route_log: None,
        }
    }
}

/// What a generation produced and how long it took.
#[derive(Clone, Debug, Default)]
pub struct Generation {
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    /// Decode seconds per generated token (the first token comes from the prefill).
    pub seconds_per_token: f64,
    pub stopped_on: Option<u32>,
    /// `[generated, V]` when `keep_logits` was set.
    pub logits: Vec<Vec<f32>>,
}

/// A model with its weight store (which is also the model's hook: the streaming pipeline
/// prefetches from it) and thread pool.
pub struct Engine<S: WeightSource + LayerHook> {
    pub model: Model,
    pub src: S,
    pool: rayon::ThreadPool,
    threads: usize,
}

/// State, scratch and logits of one conversation.
pub struct Session {
    pub state: ModelState,
    scratch: Scratch,
    logits: Vec<f32>,
}

impl<S: WeightSource + LayerHook> Engine<S> {
    /// `threads` compute threads (0 = one per available core).
    pub fn new(model: Model, src: S, threads: usize) -> Result<Engine<S>, EngineError> {
        Engine::pinned(model, src, threads, &[])
    }

    /// Like [`Engine::new`], with compute thread `i` pinned to `cores[i]` at spawn (one thread per
    /// core when `cores` is not empty).
    pub fn pinned(model: Model, src: S, threads: usize, cores: &[usize]) -> Result<Engine<S>, EngineError> {
        let threads = if cores.is_empty() { threads } else { cores.len() };
        let cores = cores.to_vec();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("k3ring-compute-{i}"))
            .start_handler(move |i| {
                if let Some(&cpu) = cores.get(i) {
                    if !crate::pipeline::placement::pin_current(cpu) {
                        tracing::warn!("could not pin compute thread {i} to CPU {cpu}");
                    }
                }
            })
            .build()
            .map_err(|e| EngineError::Threads { threads, message: e.to_string() })?;
        let threads = pool.current_num_threads();
        Ok(Engine { model, src, pool, threads })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Bytes a session for `capacity` positions and chunks of `chunk` allocates.
    pub fn session_bytes(&self, capacity: usize, chunk: usize) -> u64 {
        let cfg = &self.model.cfg;
        ModelState::bytes(cfg, capacity) + Scratch::bytes(cfg, chunk, capacity) + 4 * (chunk * cfg.vocab_size) as u64
    }

    /// Allocates a session after checking it fits in available memory.
    pub fn session(&self, capacity: usize, chunk: usize) -> Result<Session, EngineError> {
        let need = self.session_bytes(capacity, chunk);
        if let Some(available) = mem_available_bytes() {
            if need > available {
                let gib = |b: u64| b as f64 / f64::from(1u32 << 30);
                return Err(EngineError::Memory {
                    positions: capacity,
                    need,
                    need_gib: gib(need),
                    available,
                    available_gib: gib(available),
                });
            }
        }
        let cfg = &self.model.cfg;
        Ok(Session {
            state: ModelState::new(cfg, capacity),
            scratch: Scratch::new(cfg, chunk, capacity),
            logits: vec![0.0; chunk * cfg.vocab_size],
        })
    }

    /// Runs `tokens` through the model in chunks; returns the logits of the requested rows of
    /// the LAST chunk ([rows, V]). With `LogitRows::All` and a probe, `tokens` must fit in one
    /// chunk for the rows to cover the whole prompt.
    pub fn prefill<'s>(
        &self,
        sess: &'s mut Session,
        tokens: &[u32],
        rows: LogitRows,
        mut probe: Option<&mut (dyn Probe + '_)>,
    ) -> Result<&'s [f32], EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let chunk = sess.scratch.chunk();
        let vocab = self.model.cfg.vocab_size;
        let mut last_rows = 0;
        for piece in tokens.chunks(chunk) {
            let probe = probe.as_deref_mut();
            self.pool.install(|| {
                let (src, hook) = (&self.src, &self.src as &dyn LayerHook);
                self.model.forward(src, hook, &mut sess.state, &mut sess.scratch, piece, rows, &mut sess.logits, probe)
            })?;
            last_rows = if rows == LogitRows::All { piece.len() } else { 1 };
        }
        Ok(&sess.logits[..last_rows * vocab])
    }

    /// Prefill (or decode) `tokens`, handing the routing to the log when there is one. The log
    /// gets one chunk at a time, so its token numbers follow each chunk's start.
    fn prefill_logged(
        &self,
        sess: &mut Session,
        tokens: &[u32],
        log: &mut Option<RouteLog>,
    ) -> Result<(), EngineError> {
        let Some(log) = log else {
            self.prefill(sess, tokens, LogitRows::Last, None)?;
            return Ok(());
        };
        let chunk = sess.scratch.chunk();
        for piece in tokens.chunks(chunk) {
            log.base = sess.state.pos() as u64;
            self.prefill(sess, piece, LogitRows::Last, Some(log))?;
        }
        Ok(())
    }

    /// Prefill then decode up to `opts.gen` tokens, calling `on_token` as each is chosen.
    pub fn generate(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
        mut on_token: impl FnMut(u32),
    ) -> Result<Generation, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let capacity = prompt.len() + opts.gen.max(1);
        let chunk = opts.prefill_chunk.clamp(1, capacity);
        let mut sess = self.session(capacity, chunk)?;
        let mut out = Generation { prompt_ids: prompt.to_vec(), ..Default::default() };
        let mut rng = crate::rng::SplitMix64::new(opts.sampling.seed);
        let mut candidates = Vec::new();
        let cfg = &self.model.cfg;
        let mut log = match &opts.route_log {
            Some(path) => Some(RouteLog {
                writer: crate::storage::stream::cache_sim::TraceWriter::create(
                    path,
                    cfg.n_layers,
                    cfg.moe.n_experts,
                    cfg.moe.top_k,
                )?,
                base: 0,
                error: None,
            }),
            None => None,
        };
        let start = Instant::now();
        self.prefill_logged(&mut sess, prompt, &mut log)?;
        out.prefill_seconds = start.elapsed().as_secs_f64();
        let decode_start = Instant::now();
        let vocab = self.model.cfg.vocab_size;
        let mut context: Vec<u32> = prompt.to_vec();
        for step in 0..opts.gen {
            let logits = &sess.logits[..vocab];
            if opts.keep_logits {
                out.logits.push(logits.to_vec());
            }
            let next = sampling::sample(logits, &opts.sampling, &mut rng, &mut candidates) as u32;
            out.generated_ids.push(next);
            on_token(next);
            if opts.stop_ids.contains(&next) {
                out.stopped_on = Some(next);
                break;
            }
            if step + 1 == opts.gen {
                break;
            }
            context.push(next);
            if opts.full_recompute {
                sess.state.reset();
                self.prefill(&mut sess, &context, LogitRows::Last, None)?;
            } else {
                self.prefill_logged(&mut sess, &[next], &mut log)?;
            }
        }
        if let Some(log) = log {
            if let Some(e) = log.error {
                return Err(e.into());
            }
            log.writer.finish()?;
        }
        out.decode_seconds = decode_start.elapsed().as_secs_f64();
        let steps = out.generated_ids.len().saturating_sub(1).max(1);
        out.seconds_per_token = out.decode_seconds / steps as f64;
        Ok(out)
    }
}

/// Writes the routing of every token (a [`Probe`] that only listens to routes).
struct RouteLog {
    writer: crate::storage::stream::cache_sim::TraceWriter,
    /// Position of the chunk's first token.
    base: u64,
    error: Option<crate::storage::stream::cache_sim::TraceError>,
}

impl Probe for RouteLog {
    fn tensor(&mut self, _layer: Option<usize>, _what: &'static str, _t: usize, _data: &[f32]) {}

    fn routes(&mut self, layer: usize, routes: &[crate::model::moe::Route]) {
        for (i, r) in routes.iter().enumerate() {
            if self.error.is_none() {
                if let Err(e) = self.writer.record(self.base + i as u64, layer, &r.experts) {
                    self.error = Some(e);
                }
            }
        }
    }
}

/// `MemAvailable` from /proc/meminfo, in bytes.
pub fn mem_available_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    meminfo_field(&text, "MemAvailable:")
}

/// Peak resident set size of this process (VmHWM), in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    meminfo_field(&text, "VmHWM:")
}

fn meminfo_field(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line[key.len()..].trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kib * 1024)
}
