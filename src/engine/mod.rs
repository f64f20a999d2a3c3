//! Sessions and generation: chunked prefill, then incremental decode that carries the KDA state,
//! the conv history and the MLA latent cache; or full recompute of the prefix at every step
//! (used to verify the incremental path). Runs the model inside its own rayon pool so the thread
//! count is explicit; results never depend on it.
#![forbid(unsafe_code)]

pub mod batch;
pub mod chat;
pub mod constraint;
mod decode;
use decode::{Decode, End, Steps};
pub mod draft;
pub mod load;
pub mod logprobs;
pub mod measure;
pub mod measure_batch;
pub mod prefix_cache;
pub mod read_tax;
pub mod requests;
pub mod sampling;
pub mod sizing;
pub mod state_file;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::exit::{Classify, ExitCode};
use crate::model::weights::WeightSource;
use crate::model::{LayerHook, LogitRows, Model, ModelError, ModelState, Probe, Scratch};
pub use batch::{BatchOptions, BatchRequest, BatchSink, BatchStats, Batcher, FinishReason, Finished, Ticket};
pub use chat::{ChatSession, Reply, ReplyOptions};
pub use constraint::{Constraint, TokenConstraint};
pub use draft::{DraftError, DraftOptions, DraftStats, Drafter, Replay};
pub use load::{open_resident, open_streaming, DraftPlan, OpenError, Opened, StreamingRun};
pub use sampling::Sampling;
pub use state_file::{Fingerprint, StateFileError};

/// Why generation stopped early.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(
        "the states and KV cache for {positions} positions need {need} bytes ({need_gb:.2} GB) but only {available} bytes ({available_gb:.2} GB) are available (limited by {limited_by}); use a shorter prompt or --gen"
    )]
    Memory { positions: usize, need: u64, need_gb: f64, available: u64, available_gb: f64, limited_by: String },
    #[error(
        "the prompt's {prompt} tokens plus --gen {gen} need {total} positions, beyond the model's context of {context} positions ({stated_by}); shorten the prompt or lower --gen"
    )]
    ContextTooLong { prompt: usize, gen: usize, total: usize, context: usize, stated_by: String },
    #[error("--gen {gen} is too large: the prompt's {prompt} tokens plus {gen} overflow the position count")]
    ContextOverflow { prompt: usize, gen: usize },
    #[error("cannot build a thread pool of {threads} threads: {message}")]
    Threads { threads: usize, message: String },
    #[error(
        "the prompt's {prompt} tokens plus {gen} to generate need {total} positions, beyond the {slot} of a batch slot; raise --context to {total} or more, or lower max_tokens"
    )]
    SlotTooShort { prompt: usize, gen: usize, total: usize, slot: usize },
    #[error("the prompt is empty: give at least one token")]
    EmptyPrompt,
    #[error(transparent)]
    RouteLog(#[from] crate::storage::stream::cache_sim::TraceError),
    #[error(transparent)]
    Draft(#[from] DraftError),
}

impl Classify for EngineError {
    fn exit_code(&self) -> ExitCode {
        match self {
            EngineError::Model(e) => e.exit_code(),
            EngineError::Memory { .. }
            | EngineError::EmptyPrompt
            | EngineError::ContextTooLong { .. }
            | EngineError::ContextOverflow { .. }
            | EngineError::SlotTooShort { .. } => ExitCode::Usage,
            EngineError::Threads { .. } => ExitCode::Internal,
            EngineError::RouteLog(e) => e.exit_code(),
            EngineError::Draft(e) => e.exit_code(),
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
    /// Keep the logits that chose each generated token (tests, `run --logits`).
    pub keep_logits: bool,
    /// Report each generated token's log-probability with this many alternatives
    /// ([`Generation::logprobs`]; `run --logprobs N`).
    pub logprobs: Option<usize>,
    /// Keep the logits of every prompt position (`run --logits`). The head then runs on every
    /// prompt row; a row's logits do not depend on the other rows, so the tokens are unchanged.
    pub prompt_logits: bool,
    /// Write every routing decision here (`--dump-trace`).
    pub route_log: Option<crate::files::Output>,
    /// Checked between prefill chunks and between tokens: once set, generation stops and
    /// returns what it has, with [`Generation::interrupted`] (Ctrl-C: [`crate::interrupt::flag`]).
    pub stop: Option<&'static AtomicBool>,
    /// Draft-and-verify decoding ([`draft`]); greedy only. Ignored with `full_recompute`.
    pub draft: Option<DraftOptions>,
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
            logprobs: None,
            prompt_logits: false,
            route_log: None,
            stop: None,
            draft: None,
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
    /// One per generated token when [`GenerateOptions::logprobs`] was set.
    pub logprobs: Vec<logprobs::TokenLogprob>,
    /// `[prompt_done, V]`, row-major, when `prompt_logits` was set: row i follows prompt token i.
    pub prompt_logits: Vec<f32>,
    /// Prompt tokens run through the model (all of them unless interrupted during prefill).
    pub prompt_done: usize,
    /// Stopped by [`GenerateOptions::stop`] before the end.
    pub interrupted: bool,
    /// Decode steps and what drafting guessed and kept (steps only, without drafting).
    pub draft: DraftStats,
}

/// Positions a generation of `gen` tokens after `prompt` tokens needs (`prompt + max(gen, 1)`),
/// refused when it overflows or exceeds the model's context length.
pub fn context_needed(cfg: &crate::config::Config, prompt: usize, gen: usize) -> Result<usize, EngineError> {
    let total = prompt.checked_add(gen.max(1)).ok_or(EngineError::ContextOverflow { prompt, gen })?;
    match &cfg.context_length {
        Some(ctx) if total > ctx.positions => Err(EngineError::ContextTooLong {
            prompt,
            gen,
            total,
            context: ctx.positions,
            stated_by: ctx.source.clone(),
        }),
        _ => Ok(total),
    }
}

/// Positions assumed for bounding text reads when a model states no context length.
pub const UNSTATED_CONTEXT: usize = 1 << 20;

/// The model's context in positions ([`UNSTATED_CONTEXT`] when it states none), and the most
/// bytes of text that context can hold: no token is longer than the tokenizer's longest, so text
/// beyond that many bytes cannot fit and is refused before it is read whole.
pub fn text_bytes_max(cfg: &crate::config::Config, tok: &crate::tokenizer::Tokenizer) -> (usize, u64) {
    let positions = cfg.context_length.as_ref().map_or(UNSTATED_CONTEXT, |c| c.positions);
    (positions, (positions as u64).saturating_mul(tok.max_token_bytes() as u64))
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
        // Threads start on their own time: wait until every one has (pinned itself, done the
        // runtime's per-thread set-up, which allocates), so that no step pays for a start-up
        // and a decode step allocates nothing from the first one on.
        pool.broadcast(|_| ());
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
        self.session_with(capacity, chunk, 0)
    }

    /// [`Engine::session`], checking room for `extra` bytes more (a drafting journal).
    fn session_with(&self, capacity: usize, chunk: usize, extra: u64) -> Result<Session, EngineError> {
        let need = self.session_bytes(capacity, chunk) + extra;
        if let Some(available) = crate::memory::available() {
            if need > available.bytes {
                return Err(EngineError::Memory {
                    positions: capacity,
                    need,
                    need_gb: need as f64 / 1e9,
                    available: available.bytes,
                    available_gb: available.bytes as f64 / 1e9,
                    limited_by: available.limited_by.to_string(),
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
    /// With `all_rows`, the logits of every token are appended to `all_rows`.
    fn prefill_logged(
        &self,
        sess: &mut Session,
        tokens: &[u32],
        log: &mut Option<RouteLog>,
        mut all_rows: Option<&mut Vec<f32>>,
    ) -> Result<(), EngineError> {
        let rows = if all_rows.is_some() { LogitRows::All } else { LogitRows::Last };
        let chunk = sess.scratch.chunk();
        for piece in tokens.chunks(chunk) {
            let logits = match log {
                Some(log) => {
                    log.base = sess.state.pos() as u64;
                    self.prefill(sess, piece, rows, Some(log))?
                }
                None => self.prefill(sess, piece, rows, None)?,
            };
            if let Some(out) = all_rows.as_deref_mut() {
                out.extend_from_slice(logits);
            }
        }
        // `generate_with` reads the next token's logits from the first row.
        if rows == LogitRows::All {
            let vocab = self.model.cfg.vocab_size;
            // Rows of the last chunk.
            let n = tokens.len() - (tokens.len() - 1) / chunk * chunk;
            sess.logits.copy_within((n - 1) * vocab..n * vocab, 0);
        }
        Ok(())
    }

    /// Runs a drafted step (`rows`: the last token chosen, then the guesses), leaving every
    /// row's logits in the session, in row order. The route log holds the step's routes until
    /// the kept rows are known ([`RouteLog::release`]).
    fn verify_step(&self, sess: &mut Session, rows: &[u32], log: &mut Option<RouteLog>) -> Result<(), EngineError> {
        match log {
            Some(log) => {
                log.base = sess.state.pos() as u64;
                log.held = Some(Vec::new());
                self.prefill(sess, rows, LogitRows::All, Some(log))?;
            }
            None => {
                self.prefill(sess, rows, LogitRows::All, None)?;
            }
        }
        Ok(())
    }

    /// Prefill then decode up to `opts.gen` tokens, calling `on_token` as each is chosen.
    pub fn generate(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: impl FnMut(u32),
    ) -> Result<Generation, EngineError> {
        self.generate_with(prompt, opts, on_token, |_, _| {})
    }

    /// [`Engine::generate`], also calling `on_prefill(done, total)` after each prefill chunk.
    /// Refuses a prompt plus `opts.gen` beyond the model's context ([`context_needed`]).
    pub fn generate_with(
        &self,
        prompt: &[u32],
        opts: &GenerateOptions,
        mut on_token: impl FnMut(u32),
        mut on_prefill: impl FnMut(usize, usize),
    ) -> Result<Generation, EngineError> {
        if prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let capacity = context_needed(&self.model.cfg, prompt.len(), opts.gen)?;
        let chunk = opts.prefill_chunk.clamp(1, capacity);
        // Refused before any work; the journal counts in the memory check.
        let mut drafter = drafter_for(opts.draft.as_ref(), &opts.sampling, opts.full_recompute, prompt)?;
        let journal =
            drafter.as_ref().map_or(0, |d| crate::model::rewind::Journal::bytes(&self.model.cfg, d.max_rows()));
        let mut sess = self.session_with(capacity, chunk, journal)?;
        let mut out = Generation { prompt_ids: prompt.to_vec(), ..Default::default() };
        let mut rng = crate::rng::SplitMix64::new(opts.sampling.seed);
        let mut candidates = Vec::new();
        let cfg = &self.model.cfg;
        let mut log = match &opts.route_log {
            Some(path) => Some(RouteLog {
                writer: crate::storage::stream::cache_sim::TraceWriter::create_sized(
                    path,
                    cfg.n_layers,
                    cfg.moe.n_experts,
                    cfg.moe.top_k,
                    Some(cfg.expert_bytes()),
                )?,
                base: 0,
                error: None,
                held: None,
            }),
            None => None,
        };
        let stopped = || opts.stop.is_some_and(|s| s.load(Ordering::Relaxed));
        let start = Instant::now();
        // Chunk by chunk here (the same chunks `prefill` makes), to report progress and stop.
        for piece in prompt.chunks(chunk) {
            if stopped() {
                out.interrupted = true;
                break;
            }
            let rows = if opts.prompt_logits { Some(&mut out.prompt_logits) } else { None };
            self.prefill_logged(&mut sess, piece, &mut log, rows)?;
            out.prompt_done += piece.len();
            on_prefill(out.prompt_done, prompt.len());
        }
        out.prefill_seconds = start.elapsed().as_secs_f64();
        let decode_start = Instant::now();
        let mut context: Vec<u32> = prompt.to_vec();
        let gen = if out.interrupted { 0 } else { opts.gen };
        let decode = Decode {
            max: gen,
            sampling: &opts.sampling,
            stop_ids: &opts.stop_ids,
            drafter: drafter.as_mut(),
            rng: &mut rng,
            candidates: &mut candidates,
            constraint: None,
        };
        let mut io = GenerateSteps {
            engine: self,
            opts,
            log: &mut log,
            logits: &mut out.logits,
            logprobs: &mut out.logprobs,
            generated: &mut out.generated_ids,
            on_token: &mut on_token,
        };
        let (end, draft) = decode::decode(self, &mut sess, decode, &mut context, &mut io)?;
        match end {
            End::Length => {}
            End::Stop(id) => out.stopped_on = Some(id),
            End::Interrupted => out.interrupted = true,
        }
        out.draft = draft;
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

/// [`Engine::generate_with`]'s side of the decode loop.
struct GenerateSteps<'a, 'f, S: WeightSource + LayerHook> {
    engine: &'a Engine<S>,
    opts: &'a GenerateOptions,
    log: &'a mut Option<RouteLog>,
    logits: &'a mut Vec<Vec<f32>>,
    logprobs: &'a mut Vec<logprobs::TokenLogprob>,
    generated: &'a mut Vec<u32>,
    on_token: &'a mut (dyn FnMut(u32) + 'f),
}

impl<S: WeightSource + LayerHook> Steps for GenerateSteps<'_, '_, S> {
    fn chosen(&mut self, id: u32, logits: &[f32]) -> bool {
        if self.opts.keep_logits {
            self.logits.push(logits.to_vec());
        }
        if let Some(top) = self.opts.logprobs {
            self.logprobs.push(logprobs::token_logprob(logits, id, top));
        }
        self.generated.push(id);
        (self.on_token)(id);
        true
    }

    fn stopped(&self) -> bool {
        self.opts.stop.is_some_and(|s| s.load(Ordering::Relaxed))
    }

    fn run(&mut self, sess: &mut Session, rows: &[u32], context: &[u32]) -> Result<(), EngineError> {
        if self.opts.full_recompute {
            sess.state.reset();
            self.engine.prefill(sess, context, LogitRows::Last, None)?;
            return Ok(());
        }
        if rows.len() == 1 {
            return self.engine.prefill_logged(sess, rows, self.log, None);
        }
        self.engine.verify_step(sess, rows, self.log)
    }

    fn kept(&mut self, kept: usize) {
        if let Some(log) = self.log.as_mut() {
            log.release(kept);
        }
    }
}

/// The drafter a generation asks for: refused with sampling (the CLI's default drafts greedy
/// runs only) and out-of-range options; none with full recompute.
pub(crate) fn drafter_for(
    draft: Option<&DraftOptions>,
    sampling: &Sampling,
    full_recompute: bool,
    prompt: &[u32],
) -> Result<Option<Drafter>, EngineError> {
    match draft {
        None => Ok(None),
        Some(_) if full_recompute => Ok(None),
        Some(_) if !sampling.is_greedy() => Err(DraftError::NotGreedy.into()),
        Some(d) => {
            d.check()?;
            Ok(Some(Drafter::new(d.clone(), prompt)))
        }
    }
}

/// Writes the routing of every token (a [`Probe`] that only listens to routes).
struct RouteLog {
    writer: crate::storage::stream::cache_sim::TraceWriter,
    /// Position of the chunk's first token.
    base: u64,
    error: Option<crate::storage::stream::cache_sim::TraceError>,
    /// A drafted step's routes (position, layer, experts), written once its kept rows are known.
    held: Option<Vec<(u64, usize, Vec<usize>)>>,
}

impl RouteLog {
    fn write(&mut self, token: u64, layer: usize, experts: &[usize]) {
        if self.error.is_none() {
            if let Err(e) = self.writer.record(token, layer, experts) {
                self.error = Some(e);
            }
        }
    }

    /// Writes the held routes of the step's first `kept` rows, in the order they came.
    fn release(&mut self, kept: usize) {
        let end = self.base + kept as u64;
        for (token, layer, experts) in self.held.take().unwrap_or_default() {
            if token < end {
                self.write(token, layer, &experts);
            }
        }
    }
}

impl Probe for RouteLog {
    fn tensor(&mut self, _layer: Option<usize>, _what: &'static str, _t: usize, _data: &[f32]) {}

    fn routes(&mut self, layer: usize, routes: &[crate::model::moe::Route]) {
        for (i, r) in routes.iter().enumerate() {
            let token = self.base + i as u64;
            match &mut self.held {
                Some(held) => held.push((token, layer, r.experts.clone())),
                None => self.write(token, layer, &r.experts),
            }
        }
    }
}

/// Peak resident set size of this process (VmHWM), in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    crate::memory::kib_field(&text, "VmHWM:")
}
