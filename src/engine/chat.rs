//! A session that lives across turns: it keeps the KDA states, conv histories and MLA latent
//! caches, and every token of the transcript, so a new turn prefills only its new tokens.
//!
//! The reply loop is [`Engine::generate_with`]'s, step for step (sample, report, stop on a stop
//! id or the token limit, then feed the token), so a reply equals a fresh `generate` over the
//! whole transcript with the same sampling (tests/integration/chat_tests.rs checks it). The last
//! token of a reply is not fed (as in `generate`); it stays pending and opens the next turn's
//! prefill.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use super::decode::{self, Decode, End, Steps};
use super::draft::{DraftOptions, DraftStats, Drafter};
use super::{Engine, EngineError, Sampling, Session};
use crate::model::weights::WeightSource;
use crate::model::{LayerHook, LogitRows, ModelError};
use crate::rng::SplitMix64;

/// How one reply is generated.
#[derive(Clone, Debug)]
pub struct ReplyOptions<'a> {
    pub max_tokens: usize,
    pub sampling: Sampling,
    pub stop_ids: Vec<u32>,
    /// Checked between prefill chunks and between tokens (Ctrl-C).
    pub stop: Option<&'a AtomicBool>,
    /// Draft-and-verify decoding ([`super::draft`]); greedy only, and not with a constraint.
    pub draft: Option<DraftOptions>,
    /// Which ids may come next (a response format, a forced tool call).
    pub constraint: Option<super::Constraint>,
}

/// What one reply did.
#[derive(Clone, Debug, Default)]
pub struct Reply {
    pub ids: Vec<u32>,
    /// Tokens prefilled before the first one was chosen (the turn's new tokens).
    pub prefilled: usize,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    pub stopped_on: Option<u32>,
    /// Stopped by the stop flag, or by the caller's `on_token`.
    pub interrupted: bool,
    /// Stopped because the context was full before `max_tokens`.
    pub context_full: bool,
    /// Decode steps and what drafting guessed and kept.
    pub draft: DraftStats,
}

/// The state of one conversation.
pub struct ChatSession {
    pub(super) sess: Session,
    /// Every token of the transcript, fed or pending.
    pub(super) ids: Vec<u32>,
    /// How many of `ids` the state has consumed (its position).
    pub(super) fed: usize,
    /// `sess.logits[..vocab]` holds the logits after `ids[fed - 1]`.
    pub(super) logits_valid: bool,
    candidates: Vec<(usize, f64)>,
    /// The last reply's drafter: the next reply resumes its draft length ([`Drafter::resume`]).
    drafter: Option<Drafter>,
}

impl ChatSession {
    /// A session for up to `capacity` positions, prefilling `chunk` tokens at a time.
    pub fn new<S: WeightSource + LayerHook>(
        engine: &Engine<S>,
        capacity: usize,
        chunk: usize,
    ) -> Result<ChatSession, EngineError> {
        let sess = engine.session(capacity, chunk.clamp(1, capacity.max(1)))?;
        Ok(ChatSession { sess, ids: Vec::new(), fed: 0, logits_valid: false, candidates: Vec::new(), drafter: None })
    }

    /// Every token of the transcript so far (fed or pending).
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Tokens the state has consumed.
    pub fn fed(&self) -> usize {
        self.fed
    }

    pub fn capacity(&self) -> usize {
        self.sess.state.capacity()
    }

    /// Appends tokens to the transcript; the next reply prefills them.
    pub fn push(&mut self, ids: &[u32]) {
        self.ids.extend_from_slice(ids);
    }

    /// Forgets the conversation (keeps the allocations).
    pub fn reset(&mut self) {
        self.sess.state.reset();
        self.ids.clear();
        self.fed = 0;
        self.logits_valid = false;
    }

    /// Feeds the pending tokens, chunk by chunk, stopping early (returning false) when `stop`
    /// is set; what was fed stays fed.
    pub fn feed<S: WeightSource + LayerHook>(
        &mut self,
        engine: &Engine<S>,
        stop: Option<&AtomicBool>,
        mut on_prefill: impl FnMut(usize, usize),
    ) -> Result<bool, EngineError> {
        let chunk = self.sess.scratch.chunk();
        let total = self.ids.len() - self.fed;
        while self.fed < self.ids.len() {
            if stop.is_some_and(|s| s.load(Ordering::Relaxed)) {
                return Ok(false);
            }
            let end = (self.fed + chunk).min(self.ids.len());
            engine.prefill(&mut self.sess, &self.ids[self.fed..end], LogitRows::Last, None)?;
            self.fed = end;
            self.logits_valid = true;
            on_prefill(total - (self.ids.len() - self.fed), total);
        }
        Ok(true)
    }

    /// Prefills the pending tokens, then generates up to `opts.max_tokens`, calling `on_token`
    /// with each chosen id; `on_token` returning false stops the reply after that id (as the
    /// stop flag does). The reply's ids join the transcript.
    pub fn reply<S: WeightSource + LayerHook>(
        &mut self,
        engine: &Engine<S>,
        opts: &ReplyOptions<'_>,
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<Reply, EngineError> {
        let capacity = self.capacity();
        if self.ids.len() >= capacity {
            return Err(EngineError::Model(ModelError::ContextFull { capacity }));
        }
        let mut out = Reply { prefilled: self.ids.len() - self.fed, ..Reply::default() };
        let start = Instant::now();
        let complete = self.feed(engine, opts.stop, |_, _| {})?;
        out.prefill_seconds = start.elapsed().as_secs_f64();
        if !complete {
            out.interrupted = true;
            return Ok(out);
        }
        if !self.logits_valid {
            return Err(EngineError::EmptyPrompt);
        }
        // The last token is never fed, so a reply may reach one past the capacity.
        let room = capacity - self.ids.len() + 1;
        let steps = opts.max_tokens.min(room);
        // A constrained reply is not drafted: its mask follows each chosen token.
        let draft = opts.draft.as_ref().filter(|_| opts.constraint.is_none());
        let mut drafter = super::drafter_for(draft, &opts.sampling, false, &self.ids)?;
        if let (Some(d), Some(previous)) = (&mut drafter, &self.drafter) {
            d.resume(previous);
        }
        let mut rng = SplitMix64::new(opts.sampling.seed);
        let decode_start = Instant::now();
        let decode = Decode {
            max: steps,
            sampling: &opts.sampling,
            stop_ids: &opts.stop_ids,
            drafter: drafter.as_mut(),
            rng: &mut rng,
            candidates: &mut self.candidates,
            constraint: opts.constraint.as_ref(),
        };
        let mut io = ReplySteps { engine, stop: opts.stop, reply: &mut out.ids, on_token: &mut on_token };
        let result = decode::decode(engine, &mut self.sess, decode, &mut self.ids, &mut io);
        // What was fed stays fed, also when a step failed.
        self.fed = self.sess.state.pos();
        if drafter.is_some() {
            self.drafter = drafter;
        }
        let (end, draft) = result?;
        match end {
            End::Length => out.context_full = steps < opts.max_tokens,
            End::Stop(id) => out.stopped_on = Some(id),
            End::Interrupted => out.interrupted = true,
        }
        out.draft = draft;
        out.decode_seconds = decode_start.elapsed().as_secs_f64();
        Ok(out)
    }
}

/// A reply's side of the decode loop.
struct ReplySteps<'a, 'f, S: WeightSource + LayerHook> {
    engine: &'a Engine<S>,
    stop: Option<&'a AtomicBool>,
    reply: &'a mut Vec<u32>,
    on_token: &'a mut (dyn FnMut(u32) -> bool + 'f),
}

impl<S: WeightSource + LayerHook> Steps for ReplySteps<'_, '_, S> {
    fn chosen(&mut self, id: u32, _logits: &[f32]) -> bool {
        self.reply.push(id);
        (self.on_token)(id)
    }

    fn stopped(&self) -> bool {
        self.stop.is_some_and(|s| s.load(Ordering::Relaxed))
    }

    fn run(&mut self, sess: &mut Session, rows: &[u32], _context: &[u32]) -> Result<(), EngineError> {
        let logit_rows = if rows.len() == 1 { LogitRows::Last } else { LogitRows::All };
        self.engine.prefill(sess, rows, logit_rows, None)?;
        Ok(())
    }
}
