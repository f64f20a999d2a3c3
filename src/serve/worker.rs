//! The model thread: takes submissions from the handlers over a channel, tokenizes and checks
//! them, runs the [`Batcher`] step by step and sends each sequence's text back on its own event
//! channel. No model code runs anywhere else.
//!
//! A sequence whose event receiver is gone (the client disconnected) is cancelled before the
//! next step, so its slot goes to the next request. On shutdown nothing new is admitted; the
//! running and queued requests go on until they finish or the grace period ends, then the rest
//! are cancelled with a 503.
#![forbid(unsafe_code)]

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use super::api::{Job, Prompt, Usage};
use super::error::ApiError;
use super::logprobs::{Echo, Entry};
use super::metrics::{Shared, Snapshot};
use crate::chat::constrain::{reply_constraint, Grammars};
use crate::chat::parse::{Channel, CompletionParser, Event as ParseEvent};
use crate::chat::template::{render_with, to_ids, Specials};
use crate::chat::tools::ResponseFormat;
use crate::config::Config;
use crate::engine::logprobs::TokenLogprob;
use crate::engine::Constraint;
use crate::engine::{BatchRequest, BatchSink, Batcher, EngineError, FinishReason, Finished, Sampling, Ticket};
use crate::model::weights::WeightSource;
use crate::model::LayerHook;
use crate::storage::stream::StreamStats;
use crate::tokenizer::{StreamDecoder, Tokenizer};

/// A request handed to the model thread, with the channel its events go back on.
pub struct Submission {
    pub job: Job,
    pub events: UnboundedSender<Event>,
}

/// What the model thread tells a request's handler, in this order: `Started` or `Refused`,
/// then `Delta`s, then `Done` (or `Aborted`).
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Accepted (queued): the prompt's ids, and what `echo` puts first.
    Started {
        prompt_ids: Vec<u32>,
        echo: Option<Echo>,
    },
    /// The log-probabilities of prompt tokens (from the second), in order (`echo` with
    /// `logprobs`), before the first `Delta`.
    PromptLogprobs(Vec<Entry>),
    Refused(ApiError),
    /// New text of each channel (either may be empty) and the ids generated since the last
    /// delta. Text is held back while it could still be the start of a stop string.
    Delta {
        reasoning: String,
        content: String,
        /// Tool calls completed since the last delta, in OpenAI's shape with their `index`.
        tool_calls: Vec<serde_json::Value>,
        ids: Vec<u32>,
        /// One per id when the request asked for log-probabilities, else empty.
        logprobs: Vec<Entry>,
    },
    Done {
        finish_reason: &'static str,
        usage: Usage,
    },
    /// Ended without an answer (shutdown, or the engine failed).
    Aborted(ApiError),
}

/// How the worker sizes requests.
#[derive(Clone, Debug)]
pub struct WorkerOptions {
    /// `max_tokens` at most, and the default when a request gives none (then limited by the
    /// room the context leaves).
    pub max_tokens: usize,
    /// How long running requests may go on after a shutdown signal.
    pub grace: Duration,
}

/// Text of one channel: decoded, and how much of it was sent.
struct Text {
    decoder: StreamDecoder,
    text: String,
    sent: usize,
}

impl Default for Text {
    /// Added tokens are text here: whether a reply shows them is `skip_special_tokens`'s
    /// business ([`Sequence::skip_special`]).
    fn default() -> Text {
        Text { decoder: StreamDecoder::showing_special(true), text: String::new(), sent: 0 }
    }
}

impl Text {
    fn push(&mut self, tok: &Tokenizer, id: u32) {
        let piece = self.decoder.push(tok, id).unwrap_or_else(|_| format!("<{id}>"));
        self.text.push_str(&piece);
    }

    /// The text from `sent` up to `end` (a char boundary), marked sent.
    fn take(&mut self, end: usize) -> String {
        let end = end.max(self.sent);
        let out = self.text[self.sent..end].to_owned();
        self.sent = end;
        out
    }
}

struct Sequence<'t> {
    events: UnboundedSender<Event>,
    prompt_tokens: usize,
    stop: Vec<String>,
    /// The ids that end this sequence (end-of-sequence, and a chat's end of message): counted
    /// and in `token_ids`, never in the text, as OpenAI's and vLLM's servers do.
    end_ids: Vec<u32>,
    /// `skip_special_tokens`: special (added) tokens' text is left out too.
    skip_special: bool,
    /// The chat parser (chat completions); completions put every id in the content.
    parser: Option<CompletionParser<'t>>,
    reasoning: Text,
    content: Text,
    ids: Vec<u32>,
    /// The log-probabilities of `ids` (requests that asked for them).
    logprobs: Vec<Entry>,
    /// Prompt log-probabilities not yet sent (`echo` with `logprobs`).
    prompt_logprobs: Vec<Entry>,
    /// Where a stop string begins in the content: the content ends there.
    cut: Option<usize>,
    generated: usize,
    /// Calls read and not yet sent; how many were read in all.
    calls: Vec<serde_json::Value>,
    calls_read: usize,
    /// Calls sent (those to declared tools), and the declared tools' names.
    calls_sent: usize,
    declared: Vec<String>,
    /// How many of the parser's stray tool-markup ids are in the content.
    stray_shown: usize,
    ticket: Ticket,
    /// The reply's constraint (response format, forced call), for its cost.
    constraint: Option<Constraint>,
}

impl<'t> Sequence<'t> {
    /// A sequence that has generated nothing yet, with no stop strings, end ids or constraint.
    fn new(
        events: UnboundedSender<Event>,
        prompt_tokens: usize,
        parser: Option<CompletionParser<'t>>,
        ticket: Ticket,
    ) -> Sequence<'t> {
        Sequence {
            events,
            prompt_tokens,
            stop: Vec::new(),
            end_ids: Vec::new(),
            skip_special: true,
            parser,
            reasoning: Text::default(),
            content: Text::default(),
            ids: Vec::new(),
            logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
            cut: None,
            generated: 0,
            calls: Vec::new(),
            calls_read: 0,
            calls_sent: 0,
            declared: Vec::new(),
            stray_shown: 0,
            ticket,
            constraint: None,
        }
    }

    /// Where the content may be sent up to: before any text that could begin a stop string.
    fn safe_end(&self) -> usize {
        if let Some(cut) = self.cut {
            return cut;
        }
        let longest = self.stop.iter().map(String::len).max().unwrap_or(0);
        let mut end = self.content.text.len().saturating_sub(longest.saturating_sub(1));
        while !self.content.text.is_char_boundary(end) {
            end -= 1;
        }
        end
    }

    /// Sends what can be sent; false when the receiver is gone.
    fn flush(&mut self) -> bool {
        if !self.prompt_logprobs.is_empty() {
            let lps = std::mem::take(&mut self.prompt_logprobs);
            if self.events.send(Event::PromptLogprobs(lps)).is_err() {
                return false;
            }
        }
        let end = self.safe_end();
        let content = self.content.take(end);
        let reasoning = self.reasoning.take(self.reasoning.text.len());
        if content.is_empty() && reasoning.is_empty() && self.ids.is_empty() && self.calls.is_empty() {
            return !self.events.is_closed();
        }
        let ids = std::mem::take(&mut self.ids);
        let logprobs = std::mem::take(&mut self.logprobs);
        let tool_calls = std::mem::take(&mut self.calls);
        self.events.send(Event::Delta { reasoning, content, tool_calls, ids, logprobs }).is_ok()
    }

    /// Takes what the parser read of tool calls: new calls to send, stray markup as content.
    fn take_tool_markup(&mut self, tok: &Tokenizer, call_ids: &str, also_pending: bool) {
        let Some(parser) = &self.parser else { return };
        let c = parser.completion();
        // A call to a tool the request did not declare is not OpenAI's to return: it is content.
        let mut stray = String::new();
        let prefix = format!("{call_ids}{}", self.ticket);
        let new = &c.calls[self.calls_read..];
        for mut v in crate::chat::calls::declared_calls(new, &self.declared, &prefix, self.calls_sent, &mut stray) {
            v["index"] = serde_json::Value::from(self.calls_sent);
            self.calls.push(v);
            self.calls_sent += 1;
        }
        self.calls_read = c.calls.len();
        stray.push_str(&tok.decode_or_mark(&c.stray_ids[self.stray_shown..], true));
        self.stray_shown = c.stray_ids.len();
        if also_pending {
            stray.push_str(&tok.decode_or_mark(parser.pending_tool_ids(), true));
        }
        if !stray.is_empty() {
            tracing::warn!("a reply's tool-call markup is returned as content: {stray:?}");
            let tail = self.content.decoder.finish();
            self.content.text.push_str(&tail);
            self.content.text.push_str(&stray);
        }
    }
}

/// The batcher's sink: decodes, watches stop strings and the chat markup, sends events.
struct Outputs<'t> {
    tok: &'t Tokenizer,
    seqs: HashMap<Ticket, Sequence<'t>>,
    shared: Arc<Shared>,
    /// The server drafts (greedy requests): usages report what was guessed and kept.
    drafting: bool,
    /// The batcher keeps a prefix cache: usages report the prompt tokens it gave.
    prefix_cache: bool,
    /// What every call id of this server starts with (after `call_`), so that ids do not
    /// repeat across restarts within a client's conversation.
    call_ids: String,
}

impl BatchSink for Outputs<'_> {
    fn prompt_logprob(&mut self, ticket: Ticket, _position: usize, logprob: TokenLogprob) {
        if let Some(seq) = self.seqs.get_mut(&ticket) {
            seq.prompt_logprobs.push(Entry::new(self.tok, &logprob));
        }
    }

    fn logprob(&mut self, ticket: Ticket, logprob: TokenLogprob) {
        if let Some(seq) = self.seqs.get_mut(&ticket) {
            seq.logprobs.push(Entry::new(self.tok, &logprob));
        }
    }

    fn token(&mut self, ticket: Ticket, id: u32) -> bool {
        let Some(seq) = self.seqs.get_mut(&ticket) else { return true };
        seq.ids.push(id);
        seq.generated += 1;
        self.shared.generated_tokens.fetch_add(1, Ordering::Relaxed);
        let mut stop = false;
        let channel = match &mut seq.parser {
            None => Some(Channel::Content),
            Some(parser) => match parser.push(id) {
                Ok(ParseEvent::Payload(ch)) => Some(ch),
                Ok(ParseEvent::Markup | ParseEvent::End) => None,
                Ok(ParseEvent::Call | ParseEvent::Stray) => {
                    seq.take_tool_markup(self.tok, &self.call_ids, false);
                    None
                }
                Err(e) => {
                    tracing::warn!("a reply broke the chat template ({e}); it ends there");
                    seq.take_tool_markup(self.tok, &self.call_ids, true);
                    stop = true;
                    None
                }
            },
        };
        let silent = seq.end_ids.contains(&id) || (seq.skip_special && self.tok.is_special(id));
        let channel = channel.filter(|_| !silent);
        match channel {
            Some(Channel::Reasoning) => seq.reasoning.push(self.tok, id),
            Some(Channel::Content) => {
                // The reasoning is over: its held-back bytes (if any) go now.
                let tail = seq.reasoning.decoder.finish();
                seq.reasoning.text.push_str(&tail);
                let before = seq.content.text.len();
                seq.content.push(self.tok, id);
                if !seq.stop.is_empty() {
                    let longest = seq.stop.iter().map(String::len).max().unwrap_or(0);
                    let mut from = before.saturating_sub(longest.saturating_sub(1));
                    while !seq.content.text.is_char_boundary(from) {
                        from -= 1;
                    }
                    let text = &seq.content.text;
                    seq.cut = seq.stop.iter().filter_map(|s| text[from..].find(s.as_str()).map(|at| from + at)).min();
                    stop |= seq.cut.is_some();
                }
            }
            None => {}
        }
        // A client that left finishes its sequence here (the slot is freed after this step).
        let gone = !seq.flush();
        stop || gone
    }

    fn finished(&mut self, f: Finished) {
        let Some(mut seq) = self.seqs.remove(&f.ticket) else { return };
        self.shared.release();
        if seq.events.is_closed() {
            // Finished because its client left (see `token`).
            self.shared.cancelled.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if seq.cut.is_none() {
            let tail = seq.content.decoder.finish();
            seq.content.text.push_str(&tail);
            let tail = seq.reasoning.decoder.finish();
            seq.reasoning.text.push_str(&tail);
            // No stop string matched, and none can now: the bytes held back for one go too.
            seq.cut = Some(seq.content.text.len());
        }
        seq.flush();
        if f.reason == FinishReason::Length && seq.parser.as_ref().is_some_and(|p| !p.pending_tool_ids().is_empty()) {
            // Cut inside a call: what it wrote is content.
            seq.take_tool_markup(self.tok, &self.call_ids, true);
            seq.cut = Some(seq.content.text.len());
        }
        seq.flush();
        let finish_reason = match f.reason {
            FinishReason::Length => "length",
            FinishReason::Stop if seq.calls_sent > 0 => "tool_calls",
            FinishReason::Stop => "stop",
        };
        let mut usage = Usage::new(seq.prompt_tokens, f.generated);
        if self.prefix_cache {
            usage.prompt_tokens_details = Some(super::api::PromptDetails { cached_tokens: f.cached_tokens });
        }
        if self.drafting {
            usage.completion_tokens_details = Some(super::api::CompletionDetails {
                accepted_prediction_tokens: f.draft.accepted,
                rejected_prediction_tokens: f.draft.drafted - f.draft.accepted,
                decode_steps: f.draft.steps,
            });
        }
        self.shared.count_draft(&f.draft);
        if let Some(c) = &seq.constraint {
            let micros = (c.seconds() * 1e6) as u64;
            self.shared.constrained_tokens.fetch_add(f.generated as u64, Ordering::Relaxed);
            self.shared.constraint_micros.fetch_add(micros, Ordering::Relaxed);
            tracing::debug!("constrained reply: {} tokens, masks {micros} us", f.generated);
        }
        let _ = seq.events.send(Event::Done { finish_reason, usage });
    }
}

/// The model thread's loop state.
pub struct Worker<'a, S: WeightSource + LayerHook> {
    batcher: Batcher<'a, S>,
    out: Outputs<'a>,
    cfg: &'a Config,
    specials: Option<Specials>,
    opts: WorkerOptions,
    /// `eos_token_id` and `[EOS]`: every request stops on them (as `k3ring run` does).
    eos: Vec<u32>,
    seeds: u64,
    rates: VecDeque<(Instant, u64, u64)>,
    last_snapshot: Option<Instant>,
    /// The grammar compiler of constrained replies, made at the first that needs it.
    grammars: Option<Grammars>,
}

impl<'a, S: WeightSource + LayerHook> Worker<'a, S> {
    pub fn new(
        batcher: Batcher<'a, S>,
        tok: &'a Tokenizer,
        cfg: &'a Config,
        opts: WorkerOptions,
        shared: Arc<Shared>,
    ) -> Worker<'a, S> {
        let mut eos = vec![cfg.eos_token_id];
        eos.extend(tok.added_id("[EOS]"));
        eos.dedup();
        let specials = Specials::of(tok).ok();
        let seeds =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        let drafting = batcher.options().draft.is_some();
        let prefix_cache = batcher.prefix_stats().is_some();
        Worker {
            batcher,
            out: Outputs {
                tok,
                seqs: HashMap::new(),
                shared,
                drafting,
                prefix_cache,
                call_ids: format!("{:08x}", crate::rng::splitmix64_at(seeds, 1) as u32),
            },
            cfg,
            specials,
            opts,
            eos,
            seeds,
            rates: VecDeque::new(),
            last_snapshot: None,
            grammars: None,
        }
    }

    /// Positions of each slot.
    pub fn context(&self) -> usize {
        self.batcher.options().context
    }

    /// Runs until the submissions channel closes, or after a shutdown once every request is
    /// answered or cancelled. `storage` reads the streaming counters (None when resident).
    pub fn run(
        &mut self,
        rx: &Receiver<Submission>,
        storage: &dyn Fn(&S) -> Option<StreamStats>,
        src: &S,
        overlap: &dyn Fn() -> Option<f64>,
    ) -> Result<(), EngineError> {
        let mut deadline: Option<Instant> = None;
        loop {
            let shutting_down = self.out.shared.shutting_down();
            if shutting_down && deadline.is_none() {
                // A grace too long to add to now is no deadline at all.
                deadline = Instant::now().checked_add(self.opts.grace);
            }
            if self.batcher.pending() == 0 {
                if shutting_down {
                    // Answer what raced in, then stop.
                    while let Ok(s) = rx.try_recv() {
                        self.submit(s);
                    }
                    if self.batcher.pending() == 0 {
                        break;
                    }
                } else {
                    match rx.recv_timeout(Duration::from_millis(50)) {
                        Ok(s) => self.submit(s),
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                }
            }
            while let Ok(s) = rx.try_recv() {
                self.submit(s);
            }
            self.cancel_abandoned();
            if deadline.is_some_and(|d| Instant::now() >= d) {
                self.abort_all(ApiError::unavailable("the server is shutting down; the request was cancelled"));
                break;
            }
            if let Err(e) = self.batcher.step(&mut self.out) {
                self.stop_after_fault(&e);
                return Err(e);
            }
            self.publish(storage, src, overlap);
        }
        self.publish(storage, src, overlap);
        Ok(())
    }

    /// Tokenizes and checks a submission, then queues it; the handler hears which.
    fn submit(&mut self, s: Submission) {
        let shared = Arc::clone(&self.out.shared);
        if shared.shutting_down() {
            shared.release();
            let _ = s.events.send(Event::Refused(ApiError::unavailable("the server is shutting down")));
            return;
        }
        match self.prepare(&s.job) {
            Err(e) => {
                shared.release();
                let _ = s.events.send(Event::Refused(e));
            }
            Ok((request, chat)) => {
                let request_constraint = request.constraint.clone();
                let prompt_tokens = request.prompt.len();
                let end_ids = request.stop_ids.clone();
                let skip_special = s.job.skip_special_tokens;
                let prompt_ids = if s.job.return_token_ids { request.prompt.clone() } else { Vec::new() };
                let echo = s.job.echo.then(|| {
                    let text = match &s.job.prompt {
                        Prompt::Text(t) => Some(t.as_str()),
                        _ => None,
                    };
                    Echo::new(self.out.tok, &request.prompt, text, skip_special)
                });
                match self.batcher.submit(request) {
                    Err(e) => {
                        shared.release();
                        let _ = s.events.send(Event::Refused(ApiError::invalid(e.to_string())));
                    }
                    Ok(ticket) => {
                        shared.prompt_tokens.fetch_add(prompt_tokens as u64, Ordering::Relaxed);
                        let _ = s.events.send(Event::Started { prompt_ids, echo });
                        let parser = chat.map(|(sp, thinking)| CompletionParser::new(self.out.tok, sp, thinking));
                        let declared = match &s.job.prompt {
                            Prompt::Chat { tools, .. } => tools.names().into_iter().map(str::to_owned).collect(),
                            _ => Vec::new(),
                        };
                        let seq = Sequence {
                            declared,
                            stop: s.job.stop,
                            end_ids,
                            skip_special,
                            constraint: request_constraint,
                            ..Sequence::new(s.events, prompt_tokens, parser, ticket)
                        };
                        self.out.seqs.insert(ticket, seq);
                    }
                }
            }
        }
    }

    /// The batch request of a job, and for a chat its specials and thinking switch.
    #[allow(clippy::type_complexity)]
    fn prepare(&mut self, job: &Job) -> Result<(BatchRequest, Option<(Specials, bool)>), ApiError> {
        let tok = self.out.tok;
        let mut stop_ids = if job.ignore_eos { Vec::new() } else { self.eos.clone() };
        let mut constraint = None;
        let (prompt, chat) = match &job.prompt {
            Prompt::Text(text) => {
                let ids = tok.encode_with_added(text).map_err(|e| ApiError::param("prompt", format!("prompt: {e}")))?;
                (ids, None)
            }
            Prompt::Ids(ids) => {
                let vocab = self.cfg.vocab_size;
                if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                    return Err(ApiError::param("prompt", format!("token {bad} is outside the vocabulary of {vocab}")));
                }
                (ids.clone(), None)
            }
            Prompt::Chat { messages, thinking, tools } => {
                let Some(sp) = self.specials else {
                    return Err(ApiError::invalid(
                        "this model's tokenizer has no K3 chat template tokens; use /v1/completions",
                    ));
                };
                let pieces = render_with(messages, tools, *thinking, true)
                    .map_err(|e| ApiError::param("messages", e.to_string()))?;
                let ids = to_ids(&pieces, tok, &sp).map_err(|e| ApiError::param("messages", e.to_string()))?;
                if !job.ignore_eos {
                    stop_ids.extend(sp.end_ids());
                    stop_ids.dedup();
                }
                let param = if tools.format == ResponseFormat::Text { "tool_choice" } else { "response_format" };
                constraint =
                    reply_constraint(&mut self.grammars, tok, &sp, self.cfg.vocab_size, tools, thinking.enabled)
                        .map_err(|e| ApiError::param(param, e.to_string()))?;
                (ids, Some((sp, thinking.enabled)))
            }
        };
        if prompt.is_empty() {
            return Err(ApiError::param("prompt", "the prompt is empty: give at least one token"));
        }
        let context = self.context();
        let len = prompt.len();
        if len >= context {
            return Err(ApiError::invalid_code(
                "context_length_exceeded",
                format!(
                    "the prompt has {len} tokens, but this server's context holds {context} positions (prompt plus at least one generated token): at most {} prompt tokens",
                    context - 1
                ),
            ));
        }
        let room = context - len;
        let max_tokens = match job.max_tokens {
            None => self.opts.max_tokens.min(room),
            Some(m) if m > room => {
                return Err(ApiError::invalid_code(
                    "context_length_exceeded",
                    format!(
                        "the prompt's {len} tokens plus max_tokens {m} need {} positions, beyond this server's context of {context}: ask for at most {room} tokens",
                        len + m
                    ),
                ))
            }
            Some(m) => m,
        };
        let seed = job.seed.unwrap_or_else(|| {
            self.seeds = self.seeds.wrapping_add(1);
            crate::rng::splitmix64_at(self.seeds, 0)
        });
        let sampling = Sampling { temperature: job.temperature, top_k: job.top_k, top_p: job.top_p, seed };
        Ok((
            BatchRequest {
                constraint,
                prompt,
                max_tokens,
                sampling,
                stop_ids,
                logprobs: job.logprobs,
                prompt_logprobs: job.echo,
            },
            chat,
        ))
    }

    /// Cancels every sequence whose client has gone.
    fn cancel_abandoned(&mut self) {
        let gone: Vec<Ticket> = self.out.seqs.iter().filter(|(_, s)| s.events.is_closed()).map(|(t, _)| *t).collect();
        for ticket in gone {
            self.batcher.cancel(ticket);
            self.out.seqs.remove(&ticket);
            self.out.shared.release();
            self.out.shared.cancelled.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A step failed (a damaged expert, a failed read): the sequences in it cannot go on, since
    /// the pass that failed left their states part-way; each gets a 500 naming the fault. The
    /// requests still queued get 503 as on SIGTERM, and nothing new is admitted.
    fn stop_after_fault(&mut self, fault: &EngineError) {
        self.out.shared.shutting_down.store(true, Ordering::Relaxed);
        let failed = ApiError::internal(format!("the engine failed: {fault}"));
        let stopping = ApiError::unavailable(format!("the server is stopping after a fault: {fault}"));
        for (ticket, seq) in self.out.seqs.drain() {
            let why = if self.batcher.is_queued(ticket) { stopping.clone() } else { failed.clone() };
            self.batcher.cancel(ticket);
            self.out.shared.release();
            self.out.shared.cancelled.fetch_add(1, Ordering::Relaxed);
            let _ = seq.events.send(Event::Aborted(why));
        }
    }

    /// Cancels everything, telling each handler why.
    fn abort_all(&mut self, why: ApiError) {
        for (ticket, seq) in self.out.seqs.drain() {
            self.batcher.cancel(ticket);
            self.out.shared.release();
            self.out.shared.cancelled.fetch_add(1, Ordering::Relaxed);
            let _ = seq.events.send(Event::Aborted(why.clone()));
        }
    }

    /// Updates the gauges: every step for the counts, every 250 ms for the rates.
    fn publish(&mut self, storage: &dyn Fn(&S) -> Option<StreamStats>, src: &S, overlap: &dyn Fn() -> Option<f64>) {
        let shared = &self.out.shared;
        shared.queued.store(self.batcher.queued(), Ordering::Relaxed);
        shared.running.store(self.batcher.running(), Ordering::Relaxed);
        let now = Instant::now();
        if self.last_snapshot.is_some_and(|t| now - t < Duration::from_millis(250)) {
            return;
        }
        self.last_snapshot = Some(now);
        let stats = storage(src);
        let bytes = stats.as_ref().map_or(0, |s| s.trunk_bytes_read + s.expert_bytes_read);
        let generated = self.batcher.stats().generated;
        self.rates.push_back((now, generated, bytes));
        while self.rates.front().is_some_and(|(t, _, _)| now - *t > Duration::from_secs(10)) {
            self.rates.pop_front();
        }
        let (t0, g0, b0) = self.rates.front().copied().unwrap_or((now, generated, bytes));
        let dt = (now - t0).as_secs_f64();
        let rate = |a: u64, b: u64| if dt > 0.0 { a.saturating_sub(b) as f64 / dt } else { 0.0 };
        let hit_rate = stats.as_ref().and_then(|s| {
            let lookups = s.expert_hits + s.expert_misses;
            (lookups > 0).then(|| s.expert_hits as f64 / lookups as f64)
        });
        shared.set_snapshot(Snapshot {
            tokens_per_second: rate(generated, g0),
            bytes_read: bytes,
            read_bytes_per_second: rate(bytes, b0),
            overlap: overlap(),
            expert_hit_rate: hit_rate,
            prefix: self.batcher.prefix_stats(),
        });
    }
}

#[cfg(test)]
#[path = "worker_tests.rs"]
mod tests;
