//! Continuous batching: a [`Batcher`] advances a set of sequences one step at a time. Each step
//! runs every layer once over all active rows: one decode row per running sequence, then
//! prefill pieces of newly admitted ones, so the trunk is read once per step for all of them
//! and each distinct expert once per layer per step. Sequences join between steps and leave on
//! a stop id, on their token limit, or when the caller stops them (a stop string); a finished
//! sequence's slot is reused by the next request in the queue.
//!
//! Every sequence's tokens equal its solo [`Engine::generate`]: the model computes each row as
//! in a solo run whatever else is in the step ([`Model::forward_batch`]), and each sequence has
//! its own state, cache and seeded sampler. Slots are allocated once, when the batcher is made,
//! and a step allocates nothing in steady state.
//!
//! Drafting ([`super::draft`]): a greedy sequence may carry guesses as extra rows of its step,
//! which needs a journal to take back the rows the model does not confirm. The batcher holds a
//! pool of [`DraftOptions::sequences`] journals and lends them, each step, to the first decoding
//! sequences that guess, starting one further along the slots every step so that each gets its
//! turn; the others decode one token. Which sequences draft never changes a token.
#![forbid(unsafe_code)]

mod prefix;

use std::collections::VecDeque;
use std::time::Instant;

use serde::Serialize;

use super::draft::{DraftOptions, DraftStats, Drafter};
use super::logprobs::{token_logprob, TokenLogprob};
use super::prefix_cache::PrefixCache;
use super::{context_needed, sampling, Engine, EngineError, Sampling};
use crate::model::rewind::Journal;
use crate::model::weights::WeightSource;
use crate::model::{LayerHook, ModelError, ModelState, Scratch, Segment};
use crate::rng::SplitMix64;

/// One generation request.
#[derive(Clone, Debug)]
pub struct BatchRequest {
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (0: finish at once, nothing is run).
    pub max_tokens: usize,
    pub sampling: Sampling,
    /// Finish after producing any of these (it is still reported).
    pub stop_ids: Vec<u32>,
    /// Report each chosen token's log-probability with this many alternatives
    /// ([`BatchSink::logprob`]).
    pub logprobs: Option<usize>,
    /// Report the prompt's log-probabilities too, each token's given the ones before it
    /// ([`BatchSink::prompt_logprob`]; with `logprobs`). With `max_tokens` 0 the prompt is then
    /// run and nothing generated.
    pub prompt_logprobs: bool,
    /// Which ids may come next ([`super::constraint`]); such a sequence is not drafted.
    pub constraint: Option<super::Constraint>,
}

/// The batcher's name for a request, in submission order from 0.
pub type Ticket = u64;

/// Why a sequence finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// A stop id was produced, or the caller stopped it (a stop string).
    Stop,
}

/// How a sequence ended.
#[derive(Clone, Debug)]
pub struct Finished {
    pub ticket: Ticket,
    pub reason: FinishReason,
    pub prompt_tokens: usize,
    pub generated: usize,
    /// From submission to the last token (queueing included).
    pub seconds: f64,
    /// The sequence's decode steps and drafting.
    pub draft: DraftStats,
    /// Prompt tokens taken from the prefix cache instead of being prefilled.
    pub cached_tokens: usize,
}

/// Receives what a step produced.
pub trait BatchSink {
    /// `ticket`'s sequence chose `id`. Return true to finish it here (e.g. a stop string).
    fn token(&mut self, ticket: Ticket, id: u32) -> bool;
    /// The log-probability of the token `ticket`'s sequence is about to be given, for a request
    /// that asked for them; called just before [`BatchSink::token`].
    fn logprob(&mut self, _ticket: Ticket, _logprob: TokenLogprob) {}
    /// The log-probability of prompt token `position` (from 1: nothing predicts the first),
    /// in order, for a request with [`BatchRequest::prompt_logprobs`].
    fn prompt_logprob(&mut self, _ticket: Ticket, _position: usize, _logprob: TokenLogprob) {}
    fn finished(&mut self, finished: Finished);
}

/// How a batcher is sized.
#[derive(Clone, Debug)]
pub struct BatchOptions {
    /// Sequences decoded together at most (slots).
    pub max_batch: usize,
    /// Prompt tokens per step at most, over all sequences being prefilled.
    pub prefill_chunk: usize,
    /// Positions of each slot: prompt plus generated tokens of the longest request admitted.
    pub context: usize,
    /// Draft-and-verify decoding for the greedy requests ([`super::draft`]); sampled requests
    /// decode one token per step.
    pub draft: Option<DraftOptions>,
}

impl BatchOptions {
    /// Rows a decoding sequence has in a step at most: its last token and its guesses.
    pub fn decode_rows(&self) -> usize {
        1 + self.draft.as_ref().map_or(0, |d| d.len)
    }

    /// Sequences that may carry a draft in one step: the journals of the pool (none when not
    /// drafting; never more than the slots).
    pub fn drafting_sequences(&self) -> usize {
        self.draft.as_ref().map_or(0, |d| d.sequences.min(self.max_batch.max(1)))
    }

    /// Decode rows of the widest step: a row per slot plus the guesses of the drafting ones.
    pub fn step_decode_rows(&self) -> usize {
        self.max_batch.max(1) + self.drafting_sequences() * (self.decode_rows() - 1)
    }

    /// Rows of the widest step: its decode rows plus the prefill tokens.
    pub fn step_rows(&self) -> usize {
        self.step_decode_rows() + self.prefill_chunk.max(1)
    }

    /// The drafting journals and rows a streaming run of this batch plans for (`optional`:
    /// drafting is the default, and yields to a tight budget).
    pub fn draft_plan(&self, optional: bool) -> super::DraftPlan {
        super::DraftPlan {
            rows: if self.draft.is_some() { self.decode_rows() } else { 0 },
            sequences: self.drafting_sequences(),
            step_rows: self.step_decode_rows() - self.max_batch.max(1),
            optional,
        }
    }

    /// Bytes of the pool's journals.
    pub fn journal_bytes(&self, cfg: &crate::config::Config) -> u64 {
        self.drafting_sequences() as u64 * Journal::bytes(cfg, self.decode_rows())
    }
}

/// Counters over the batcher's life.
#[derive(Clone, Debug, Default, Serialize)]
pub struct BatchStats {
    pub steps: u64,
    /// Rows of decoding sequences: their last tokens and their guesses.
    pub decode_rows: u64,
    /// Decoding sequences, summed over the steps.
    pub decode_sequences: u64,
    pub prefill_rows: u64,
    /// Tokens chosen (each sequence's first token comes from its last prefill row).
    pub generated: u64,
    /// Decode steps and drafting of the finished sequences, summed.
    pub draft: DraftStats,
    /// Steps that ran `n` decode rows, at index `n`.
    #[serde(skip)]
    pub steps_by_width: Vec<u64>,
    /// Steps in which `n` sequences carried a draft, at index `n` (at most the journals).
    #[serde(skip)]
    pub steps_by_drafting: Vec<u64>,
}

struct Running {
    ticket: Ticket,
    request: BatchRequest,
    /// Prompt tokens run so far.
    prefilled: usize,
    /// The token to feed at the next step (decoding) or `None` (prefilling).
    next: Option<u32>,
    generated: usize,
    rng: SplitMix64,
    submitted: Instant,
    /// Greedy requests when drafting; with the prompt and the tokens chosen so far.
    drafter: Option<(Drafter, Vec<u32>)>,
    /// This step's guesses (with a journal lent to the slot's state when not empty).
    guesses: Vec<u32>,
    /// Decode steps when not drafting.
    steps: u64,
    /// Prompt tokens restored from the prefix cache.
    cached: usize,
    /// Where the prompt parts from the cached prompt it shares most with: a snapshot point.
    shared: Option<usize>,
}

/// Sequences in flight and their slots. See the module docs.
pub struct Batcher<'e, S: WeightSource + LayerHook> {
    engine: &'e Engine<S>,
    opts: BatchOptions,
    states: Vec<ModelState>,
    slots: Vec<Option<Running>>,
    /// Occupied slots in admission order (prefill goes first come, first served).
    order: Vec<usize>,
    queue: VecDeque<(Ticket, BatchRequest, Instant)>,
    scratch: Scratch,
    /// [slots x decode rows, V]: a sequence's rows of logits in a step, in row order.
    logits: Vec<f32>,
    tokens: Vec<u32>,
    segments: Vec<Segment>,
    logit_rows: Vec<usize>,
    /// Per sequence with logits this step: its slot, its first row of logits and how many.
    logit_slots: Vec<(usize, usize, usize)>,
    /// Per sequence whose prompt's log-probabilities are asked for: its slot, its first row of
    /// logits, how many, and the prompt position of the first.
    prompt_logit_slots: Vec<(usize, usize, usize, usize)>,
    /// Snapshots of prompts' states, when enabled ([`Batcher::enable_prefix_cache`]).
    prefix_cache: Option<PrefixCache>,
    candidates: Vec<(usize, f64)>,
    /// A constrained sequence's logits with the disallowed ids at -inf.
    masked: Vec<f32>,
    /// Journals not lent this step ([`BatchOptions::drafting_sequences`] in all).
    journals: Vec<Journal>,
    /// Slots holding a lent journal.
    lent: Vec<usize>,
    /// Where the next step starts lending journals: a position in `order`.
    draft_turn: usize,
    next_ticket: Ticket,
    stats: BatchStats,
}

impl<S: WeightSource + LayerHook> Engine<S> {
    /// Bytes of one sequence slot (states and latent cache for `context` positions).
    pub fn slot_bytes(&self, opts: &BatchOptions) -> u64 {
        ModelState::bytes(&self.model.cfg, opts.context.max(1))
    }

    /// Bytes a batcher with `slots` slots allocates besides the slots themselves: the step's
    /// scratch and logits, and the drafting journals.
    pub fn batch_scratch_bytes(&self, opts: &BatchOptions, slots: usize) -> u64 {
        let cfg = &self.model.cfg;
        let opts = BatchOptions { max_batch: slots, ..opts.clone() };
        Scratch::bytes(cfg, opts.step_rows(), opts.context)
            + 4 * (opts.step_decode_rows() * cfg.vocab_size) as u64
            + opts.journal_bytes(cfg)
    }

    /// A batcher with `opts.max_batch` slots, or as many as available memory holds (at least
    /// one, else [`EngineError::Memory`]); [`Batcher::slots`] says how many.
    pub fn batcher(&self, opts: BatchOptions) -> Result<Batcher<'_, S>, EngineError> {
        let cfg = &self.model.cfg;
        let context = opts.context.max(1);
        let wanted = opts.max_batch.max(1);
        if let Some(d) = &opts.draft {
            d.check()?;
        }
        let slot = self.slot_bytes(&opts);
        let fixed = self.batch_scratch_bytes(&opts, wanted);
        let slots = match crate::memory::available() {
            Some(available) => {
                let fit = available.bytes.saturating_sub(fixed) / slot.max(1);
                if fit == 0 {
                    let need = fixed + slot;
                    return Err(EngineError::Memory {
                        positions: context,
                        need,
                        need_gb: need as f64 / 1e9,
                        available: available.bytes,
                        available_gb: available.bytes as f64 / 1e9,
                        limited_by: available.limited_by.to_string(),
                    });
                }
                wanted.min(usize::try_from(fit).unwrap_or(usize::MAX))
            }
            None => wanted,
        };
        let opts = BatchOptions { max_batch: slots, context, ..opts };
        Ok(Batcher {
            engine: self,
            states: (0..slots).map(|_| ModelState::new(cfg, context)).collect(),
            slots: (0..slots).map(|_| None).collect(),
            order: Vec::with_capacity(slots),
            queue: VecDeque::new(),
            scratch: Scratch::new(cfg, opts.step_rows(), context),
            logits: vec![0.0; opts.step_decode_rows() * cfg.vocab_size],
            tokens: Vec::with_capacity(opts.step_rows()),
            segments: Vec::with_capacity(slots),
            logit_rows: Vec::with_capacity(slots),
            logit_slots: Vec::with_capacity(slots),
            prompt_logit_slots: Vec::with_capacity(slots),
            prefix_cache: None,
            candidates: Vec::with_capacity(cfg.vocab_size),
            masked: Vec::new(),
            journals: (0..opts.drafting_sequences()).map(|_| Journal::new(cfg, opts.decode_rows())).collect(),
            lent: Vec::with_capacity(opts.drafting_sequences()),
            draft_turn: 0,
            next_ticket: 0,
            stats: BatchStats {
                steps_by_width: vec![0; slots + 1],
                steps_by_drafting: vec![0; opts.drafting_sequences() + 1],
                ..BatchStats::default()
            },
            opts,
        })
    }
}

impl<S: WeightSource + LayerHook> Batcher<'_, S> {
    /// Slots: sequences that run together at most.
    pub fn slots(&self) -> usize {
        self.opts.max_batch
    }

    pub fn options(&self) -> &BatchOptions {
        &self.opts
    }

    pub fn stats(&self) -> &BatchStats {
        &self.stats
    }

    /// Queues a request; it is refused here, not during a step, when it can never run (empty
    /// prompt, a token outside the vocabulary, more positions than a slot holds).
    pub fn submit(&mut self, request: BatchRequest) -> Result<Ticket, EngineError> {
        if request.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let vocab = self.engine.model.weights.globals.embed_tokens.rows;
        if let Some(&id) = request.prompt.iter().find(|&&id| id as usize >= vocab) {
            return Err(ModelError::TokenOutOfRange { id: id as usize, vocab }.into());
        }
        let needed = context_needed(&self.engine.model.cfg, request.prompt.len(), request.max_tokens)?;
        if needed > self.opts.context {
            return Err(EngineError::SlotTooShort {
                prompt: request.prompt.len(),
                gen: request.max_tokens,
                total: needed,
                slot: self.opts.context,
            });
        }
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.queue.push_back((ticket, request, Instant::now()));
        Ok(ticket)
    }

    /// Drops `ticket`'s request: out of the queue, or out of its slot (freed for the next
    /// admission). Nothing is reported to a sink for it. Returns false when the ticket is not
    /// queued or running (already finished, or never issued). The other sequences are not
    /// touched: each has its own state, so their tokens do not change.
    pub fn cancel(&mut self, ticket: Ticket) -> bool {
        if let Some(at) = self.queue.iter().position(|(t, _, _)| *t == ticket) {
            self.queue.remove(at);
            return true;
        }
        let found = self.order.iter().copied().find(|&s| self.slots[s].as_ref().is_some_and(|r| r.ticket == ticket));
        let Some(slot) = found else { return false };
        self.slots[slot] = None;
        self.order.retain(|&s| s != slot);
        true
    }

    /// Whether `ticket` waits in the queue (not yet in a slot).
    pub fn is_queued(&self, ticket: Ticket) -> bool {
        self.queue.iter().any(|(t, _, _)| *t == ticket)
    }

    /// Requests queued (not yet in a slot).
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Requests queued or running.
    pub fn pending(&self) -> usize {
        self.queue.len() + self.order.len()
    }

    /// Sequences running (prefilling or decoding).
    pub fn running(&self) -> usize {
        self.order.len()
    }

    /// Admits what fits, runs one step over every active row and hands the chosen tokens and
    /// finished sequences to `sink`. Returns false when there was nothing to run.
    pub fn step(&mut self, sink: &mut dyn BatchSink) -> Result<bool, EngineError> {
        self.admit(sink);
        if self.order.is_empty() {
            return Ok(false);
        }
        self.compose();
        let engine = self.engine;
        let (states, segments, scratch) = (&mut self.states, &self.segments, &mut self.scratch);
        let (tokens, logit_rows, logits) = (&self.tokens, &self.logit_rows, &mut self.logits);
        let started = Instant::now();
        engine.pool.install(|| {
            let (src, hook) = (&engine.src, &engine.src as &dyn LayerHook);
            engine.model.forward_batch(src, hook, states, segments, scratch, tokens, logit_rows, logits, None)
        })?;
        self.stats.steps += 1;
        self.store_prefixes()?;
        self.choose(sink, started.elapsed().as_secs_f64())?;
        Ok(true)
    }

    /// Moves queued requests into free slots (a request for no tokens finishes at once).
    fn admit(&mut self, sink: &mut dyn BatchSink) {
        while let Some(slot) = self.slots.iter().position(Option::is_none) {
            let Some((ticket, request, submitted)) = self.queue.pop_front() else { break };
            if request.max_tokens == 0 && !(request.prompt_logprobs && request.logprobs.is_some()) {
                sink.finished(Finished {
                    ticket,
                    reason: FinishReason::Length,
                    prompt_tokens: request.prompt.len(),
                    generated: 0,
                    seconds: submitted.elapsed().as_secs_f64(),
                    draft: DraftStats::default(),
                    cached_tokens: 0,
                });
                continue;
            }
            self.states[slot].reset();
            let cached = self.restore_prefix(slot, &request);
            let shared = self.prefix_cache.as_ref().and_then(|c| c.shared(&request.prompt));
            let rng = SplitMix64::new(request.sampling.seed);
            let drafter = match &self.opts.draft {
                Some(d) if request.sampling.is_greedy() && request.constraint.is_none() => {
                    Some((Drafter::new(d.clone(), &request.prompt), request.prompt.clone()))
                }
                _ => None,
            };
            self.slots[slot] = Some(Running {
                ticket,
                request,
                prefilled: cached,
                next: None,
                generated: 0,
                rng,
                submitted,
                drafter,
                guesses: Vec::new(),
                steps: 0,
                cached,
                shared,
            });
            self.order.push(slot);
        }
    }

    /// Lends the pool's journals to the decoding sequences that guess this step, starting one
    /// candidate further than the last step; the guesses go to each sequence's `guesses`.
    fn draft(&mut self) {
        self.return_journals();
        let cfg = &self.engine.model.cfg;
        let n = self.order.len();
        if n == 0 || self.journals.is_empty() {
            return;
        }
        let start = self.draft_turn % n;
        self.draft_turn = start + 1;
        for at in (start..n).chain(0..start) {
            let slot = self.order[at];
            let Some(run) = &mut self.slots[slot] else { continue };
            let (Some((drafter, context)), Some(_)) = (&mut run.drafter, run.next) else { continue };
            // No row chooses a token past the request's limit.
            let left = run.request.max_tokens - run.generated;
            drafter.propose(context, left.saturating_sub(1), &mut run.guesses);
            if run.guesses.is_empty() {
                continue;
            }
            let Some(journal) = self.journals.pop() else {
                run.guesses.clear();
                break;
            };
            self.states[slot].lend_journal(journal);
            self.states[slot].arm(cfg, self.opts.decode_rows());
            self.lent.push(slot);
            if self.journals.is_empty() {
                break;
            }
        }
    }

    /// Takes the lent journals back into the pool (after the step's rewinds, or a failed step).
    fn return_journals(&mut self) {
        for slot in self.lent.drain(..) {
            if let Some(journal) = self.states[slot].take_journal() {
                self.journals.push(journal);
            }
        }
    }

    /// Rows of this step: a decode row per decoding sequence (and its guesses), then prompt
    /// pieces in admission order up to the prefill chunk.
    fn compose(&mut self) {
        self.tokens.clear();
        self.segments.clear();
        self.logit_rows.clear();
        self.logit_slots.clear();
        self.prompt_logit_slots.clear();
        self.draft();
        let mut decode = 0;
        for &slot in &self.order {
            let Some(run) = &mut self.slots[slot] else { continue };
            if let Some(next) = run.next {
                let row = self.tokens.len();
                self.tokens.push(next);
                self.tokens.append(&mut run.guesses);
                let rows = self.tokens.len() - row;
                self.segments.push(Segment { slot, rows: row..row + rows });
                self.logit_slots.push((slot, self.logit_rows.len(), rows));
                self.logit_rows.extend(row..row + rows);
                decode += 1;
            }
        }
        let decode_rows = self.tokens.len();
        let mut budget = self.opts.prefill_chunk.max(1);
        // Rows of logits the buffer holds: a prompt whose log-probabilities are asked for takes
        // what the decoding rows leave (at least one, as it is not decoding itself).
        let logit_capacity = self.logits.len() / self.engine.model.cfg.vocab_size.max(1);
        for &slot in &self.order {
            let Some(run) = &mut self.slots[slot] else { continue };
            if run.next.is_some() || budget == 0 {
                continue;
            }
            let echo = run.request.prompt_logprobs && run.request.logprobs.is_some();
            let mut take = (run.request.prompt.len() - run.prefilled).min(budget);
            // A snapshot point ends the sequence's rows of this step.
            if let Some(point) =
                self.prefix_cache.as_ref().and_then(|c| c.next_point(&run.request.prompt, run.prefilled, run.shared))
            {
                take = take.min(point - run.prefilled);
            }
            if echo {
                take = take.min(logit_capacity.saturating_sub(self.logit_rows.len()));
                if take == 0 {
                    continue;
                }
            }
            let row = self.tokens.len();
            self.tokens.extend_from_slice(&run.request.prompt[run.prefilled..run.prefilled + take]);
            self.segments.push(Segment { slot, rows: row..row + take });
            if echo {
                self.prompt_logit_slots.push((slot, self.logit_rows.len(), take, run.prefilled));
                self.logit_rows.extend(row..row + take);
            }
            run.prefilled += take;
            budget -= take;
            if run.prefilled == run.request.prompt.len() && run.request.max_tokens > 0 {
                if echo {
                    // The prompt's last row is already among the rows of logits.
                    self.logit_slots.push((slot, self.logit_rows.len() - 1, 1));
                } else {
                    self.logit_slots.push((slot, self.logit_rows.len(), 1));
                    self.logit_rows.push(row + take - 1);
                }
            }
        }
        self.stats.decode_rows += decode_rows as u64;
        self.stats.decode_sequences += decode as u64;
        self.stats.prefill_rows += (self.tokens.len() - decode_rows) as u64;
        self.stats.steps_by_width[decode] += 1;
        self.stats.steps_by_drafting[self.lent.len()] += 1;
    }

    /// Hands the prompt log-probabilities of this step's rows to `sink`; a request for no
    /// tokens finishes once its prompt has run.
    fn report_prompt_logprobs(&mut self, sink: &mut dyn BatchSink) {
        let vocab = self.engine.model.cfg.vocab_size;
        for &(slot, first, rows, position) in &self.prompt_logit_slots {
            let Some(run) = &mut self.slots[slot] else { continue };
            let top = run.request.logprobs.unwrap_or(0);
            for r in 0..rows {
                // Row p's logits predict prompt token p + 1.
                let Some(&next) = run.request.prompt.get(position + r + 1) else { break };
                let logits = &self.logits[(first + r) * vocab..(first + r + 1) * vocab];
                sink.prompt_logprob(run.ticket, position + r + 1, token_logprob(logits, next, top));
            }
            if run.prefilled == run.request.prompt.len() && run.request.max_tokens == 0 {
                sink.finished(Finished {
                    ticket: run.ticket,
                    reason: FinishReason::Length,
                    prompt_tokens: run.request.prompt.len(),
                    generated: 0,
                    seconds: run.submitted.elapsed().as_secs_f64(),
                    draft: DraftStats::default(),
                    cached_tokens: run.cached,
                });
                self.slots[slot] = None;
                self.order.retain(|&s| s != slot);
            }
        }
    }

    /// Samples each sequence's next token from its rows of logits (with a draft: from each row
    /// in turn while the token chosen is the next row's guess, then the rows after are taken
    /// back); finishes the sequences that are done and frees their slots. `step_seconds` is how
    /// long the step took: each drafter picks its next length by it.
    fn choose(&mut self, sink: &mut dyn BatchSink, step_seconds: f64) -> Result<(), EngineError> {
        let (cfg, kernels) = (&self.engine.model.cfg, &self.engine.model.kernels);
        let vocab = cfg.vocab_size;
        let (mut guessed, mut guesses_kept) = (0, 0);
        self.report_prompt_logprobs(sink);
        for i in 0..self.logit_slots.len() {
            let (slot, first, rows) = self.logit_slots[i];
            let Some(run) = &mut self.slots[slot] else { continue };
            let step_rows = &self.tokens[self.logit_rows[first]..self.logit_rows[first] + rows];
            let decoding = run.next.is_some();
            let (mut kept, mut reason) = (0, None);
            for r in 0..rows {
                let logits = &self.logits[(first + r) * vocab..(first + r + 1) * vocab];
                let (candidates, rng, s) = (&mut self.candidates, &mut run.rng, &run.request.sampling);
                let id = match &run.request.constraint {
                    None => sampling::sample(logits, s, rng, candidates) as u32,
                    Some(c) => {
                        let pick = |l: &[f32]| sampling::sample(l, s, rng, candidates);
                        match super::constraint::choose_masked(c, logits, &mut self.masked, pick) {
                            Ok(id) => id,
                            Err(why) => {
                                // The sequence ends here; its neighbours go on.
                                tracing::warn!("request {}: {why}; it ends here", run.ticket);
                                reason = Some(FinishReason::Stop);
                                kept = r + 1;
                                break;
                            }
                        }
                    }
                };
                if let Some(top) = run.request.logprobs {
                    sink.logprob(run.ticket, token_logprob(logits, id, top));
                }
                run.generated += 1;
                self.stats.generated += 1;
                kept = r + 1;
                if let Some((_, context)) = &mut run.drafter {
                    context.push(id);
                }
                let stopped = sink.token(run.ticket, id) || run.request.stop_ids.contains(&id);
                reason = if stopped {
                    Some(FinishReason::Stop)
                } else if run.generated == run.request.max_tokens {
                    Some(FinishReason::Length)
                } else {
                    None
                };
                run.next = Some(id);
                if reason.is_some() || step_rows.get(r + 1) != Some(&id) {
                    break;
                }
            }
            if rows > 1 {
                self.states[slot].rewind(kernels, cfg, kept)?;
            }
            if decoding {
                match &mut run.drafter {
                    Some((d, _)) => d.record(rows - 1, kept - 1, step_seconds),
                    None => run.steps += 1,
                }
                guessed += rows - 1;
                guesses_kept += kept - 1;
            }
            if let Some(reason) = reason {
                let draft = run
                    .drafter
                    .as_ref()
                    .map_or(DraftStats { steps: run.steps, ..DraftStats::default() }, |d| d.0.stats);
                self.stats.draft.add(&draft);
                sink.finished(Finished {
                    ticket: run.ticket,
                    reason,
                    prompt_tokens: run.request.prompt.len(),
                    generated: run.generated,
                    seconds: run.submitted.elapsed().as_secs_f64(),
                    draft,
                    cached_tokens: run.cached,
                });
                self.slots[slot] = None;
                self.order.retain(|&s| s != slot);
            }
        }
        if let (Some(t), Some(_)) = (&self.engine.model.tracer, &self.opts.draft) {
            t.counter("draft: tokens guessed", guessed as f64);
            t.counter("draft: guesses kept", guesses_kept as f64);
        }
        self.return_journals();
        Ok(())
    }
}
