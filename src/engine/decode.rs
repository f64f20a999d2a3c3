//! The decode loop that `generate` and a chat reply share: choose a token from the logits,
//! report it, stop on a stop id, the token limit or the caller's word, else feed it (with a
//! draft when drafting, [`super::draft`]) and go on. One loop, so a chat reply equals a fresh
//! generation over its transcript, with and without drafts.
#![forbid(unsafe_code)]

use super::draft::{DraftStats, Drafter};
use super::{sampling, Engine, EngineError, Sampling, Session};
use crate::model::weights::WeightSource;
use crate::model::LayerHook;
use crate::rng::SplitMix64;

/// What one decode loop chooses with.
pub(super) struct Decode<'a> {
    /// Tokens to choose at most (the first from the logits already in the session).
    pub max: usize,
    pub sampling: &'a Sampling,
    pub stop_ids: &'a [u32],
    pub drafter: Option<&'a mut Drafter>,
    pub rng: &'a mut SplitMix64,
    pub candidates: &'a mut Vec<(usize, f64)>,
    /// Which ids may come next (a chat reply's response format; [`super::constraint`]).
    pub constraint: Option<&'a super::Constraint>,
}

/// Why a decode loop ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum End {
    /// `max` tokens chosen.
    Length,
    /// A stop id was chosen (it is reported).
    Stop(u32),
    /// The caller stopped it (its `chosen` returned false, or `stopped`).
    Interrupted,
}

/// What the caller does around the loop.
pub(super) trait Steps {
    /// `id` was chosen from `logits`; false stops the loop after it.
    fn chosen(&mut self, id: u32, logits: &[f32]) -> bool;
    /// Checked before each step.
    fn stopped(&self) -> bool;
    /// Runs `rows` as one step: one row needs only its logits, more need every row's (row
    /// order, in the session's logits; the state is armed to take rows back). `context` is
    /// every token so far, `rows[0]` last.
    fn run(&mut self, sess: &mut Session, rows: &[u32], context: &[u32]) -> Result<(), EngineError>;
    /// A drafted step kept its first `kept` rows.
    fn kept(&mut self, _kept: usize) {}
}

/// Runs the loop; `context` gets each chosen token. The session's first logits row must hold
/// the logits after `context`'s last token. Returns why it ended and the step counts (the
/// drafter's own when drafting).
pub(super) fn decode<S: WeightSource + LayerHook>(
    engine: &Engine<S>,
    sess: &mut Session,
    d: Decode<'_>,
    context: &mut Vec<u32>,
    io: &mut dyn Steps,
) -> Result<(End, DraftStats), EngineError> {
    let Decode { max, sampling, stop_ids, mut drafter, rng, candidates, constraint } = d;
    let mut masked = Vec::new();
    let (cfg, kernels) = (&engine.model.cfg, &engine.model.kernels);
    let vocab = cfg.vocab_size;
    let chunk = sess.scratch.chunk();
    let mut plain = DraftStats::default();
    let stats = |drafter: &Option<&mut Drafter>, plain: DraftStats| drafter.as_ref().map_or(plain, |d| d.stats);
    if max == 0 {
        return Ok((End::Length, plain));
    }
    // The step's rows: the last token chosen, then the guesses. Row i's logits choose the token
    // after row i; while that token is row i+1's guess, row i+1's logits are the ones a plain
    // step would have given, so the next token is chosen from them too.
    let mut rows: Vec<u32> = Vec::new();
    let (mut chosen, mut last) = (0, 0);
    // How long the last step took: the drafter picks its length by tokens per second.
    let mut step_seconds = 0.0;
    loop {
        let (mut kept, mut end) = (0, None);
        for i in 0..rows.len().max(1) {
            let logits = &sess.logits[i * vocab..(i + 1) * vocab];
            let next = match constraint {
                None => sampling::sample(logits, sampling, rng, candidates) as u32,
                Some(c) => {
                    let pick = |l: &[f32]| sampling::sample(l, sampling, rng, candidates);
                    match super::constraint::choose_masked(c, logits, &mut masked, pick) {
                        Ok(id) => id,
                        Err(why) => {
                            tracing::warn!("{why}; the reply ends here");
                            end = Some(End::Interrupted);
                            break;
                        }
                    }
                }
            };
            context.push(next);
            (chosen, last) = (chosen + 1, next);
            kept = i + 1;
            let go_on = io.chosen(next, logits);
            if stop_ids.contains(&next) {
                end = Some(End::Stop(next));
            } else if chosen == max {
                end = Some(End::Length);
            } else if !go_on {
                end = Some(End::Interrupted);
            }
            if end.is_some() || rows.get(i + 1) != Some(&next) {
                break;
            }
        }
        if !rows.is_empty() {
            let drafted = rows.len() - 1;
            if drafted > 0 {
                // Rows past the last one whose token was kept are taken back; the session's
                // first logits row then holds the logits after the last token fed, as after a
                // plain step (a saved state keeps it).
                sess.state.rewind(kernels, cfg, kept)?;
                sess.logits.copy_within((kept - 1) * vocab..kept * vocab, 0);
                io.kept(kept);
            }
            match drafter.as_deref_mut() {
                Some(dr) => {
                    dr.record(drafted, kept - 1, step_seconds);
                    if let Some(t) = &engine.model.tracer {
                        t.counter("draft: tokens guessed", drafted as f64);
                        t.counter("draft: guesses kept", (kept - 1) as f64);
                    }
                }
                None => plain.steps += 1,
            }
        }
        if let Some(end) = end {
            return Ok((end, stats(&drafter, plain)));
        }
        if io.stopped() {
            return Ok((End::Interrupted, stats(&drafter, plain)));
        }
        rows.clear();
        rows.push(last);
        if let Some(dr) = drafter.as_deref_mut() {
            // A step's rows fit the chunk, and no row chooses a token past `max`.
            let left = max - chosen;
            dr.propose(context, left.saturating_sub(1).min(chunk - 1), &mut rows);
        }
        if let (true, Some(dr)) = (rows.len() > 1, drafter.as_deref()) {
            // Armed for the longest draft, so the journal is allocated once.
            sess.state.arm(cfg, dr.max_rows());
        }
        let started = std::time::Instant::now();
        let step = io.run(sess, &rows, context);
        step_seconds = started.elapsed().as_secs_f64();
        if step.is_err() {
            sess.state.commit();
        }
        step?;
    }
}
