//! Draft-and-verify decoding with n-gram drafts (prompt lookup). A decode step normally feeds
//! one token; with a draft it feeds the pending token and up to K guessed continuations as rows
//! of one step, and keeps the longest prefix of guesses that greedy decoding confirms, plus the
//! model's own token after it. On a streaming engine a step's cost is mostly its reads, which
//! barely grow with the rows, so every accepted guess is a token for almost no bytes.
//!
//! Exact by construction: each row's logits are the ones a one-row step would give
//! ([`crate::model::Model::forward_batch`]), a guess is kept only when it equals the greedy
//! choice, and the state takes back the rows after the last kept one
//! ([`crate::model::ModelState::rewind`]). Only greedy decoding drafts: a sampled run would need
//! the accept/reject rule of speculative sampling to keep its distribution, and its seeded
//! sampler's draws would no longer match a plain run's; the combination is refused.
#![forbid(unsafe_code)]

use serde::Serialize;

/// Tokens guessed per step at most, when not given. The drafter finds the best length up to it
/// as it goes ([`Drafter::record`]), so a longer cap costs little where long drafts do not pay.
pub const DEFAULT_DRAFT_LEN: usize = 8;
/// Shortest suffix of the context that must recur for a guess, when not given: one token
/// recurs too often in ordinary text to predict what follows.
pub const DEFAULT_NGRAM_MIN: usize = 2;
/// Sequences of a batch (or a server) that may carry a draft in one step, when not given. Each
/// holds a journal of the KDA states while its step runs (435-507 MB on the release model),
/// lent from a pool the batcher allocates once, instead of one journal per slot, which would
/// take that much from every slot's context; a step's drafted rows also add the experts their
/// tokens route to, so a few drafting sequences are what a batch step carries well.
pub const DEFAULT_DRAFT_SEQUENCES: usize = 2;
/// Longest suffix tried: longer matches are rarer and predict no better in practice.
pub const NGRAM_MAX: usize = 8;
/// Guessed tokens per step at most (the rows of a step; the session's chunk must hold them).
pub const MAX_DRAFT_LEN: usize = 16;
/// After a draft that was wholly rejected, the drafter waits this many steps, then guesses one
/// token only; each further rejection doubles the wait, up to [`MAX_COOLDOWN`]; a kept guess
/// restores full drafts at once. A wholly rejected step of four guesses costs about one plain
/// step more, one of one guess much less (docs/BENCHMARKS.md, "Drafting"), so text that never
/// repeats itself pays a few percent at most.
const MIN_COOLDOWN: usize = 8;
const MAX_COOLDOWN: usize = 64;
/// Drafted steps after which the rates of other lengths are forgotten and the best length's
/// neighbours measured again (a step each): what a row costs changes with the cache and the text.
const RATE_MEMORY_STEPS: usize = 32;
/// A longer draft is tried while the longest one measured makes at least this share of the best
/// rate: one guess kept of one can beat one of two while eight of sixteen beat both.
const CLIMB_SHARE: f64 = 0.9;

/// How drafts are made.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DraftOptions {
    /// Tokens guessed per step at most (`--draft-len`).
    pub len: usize,
    /// Shortest recurring suffix that makes a guess (`--ngram-min`).
    pub ngram_min: usize,
    /// Sequences of a batch step that may carry a draft (`--draft-sequences`; a solo run has
    /// one): the batcher's pool of journals ([`DEFAULT_DRAFT_SEQUENCES`] says why).
    #[serde(skip)]
    pub sequences: usize,
    /// Guess from recorded runs instead of the context (benchmarks and tests).
    #[serde(skip)]
    pub replay: Option<Replay>,
}

impl Default for DraftOptions {
    fn default() -> Self {
        DraftOptions::ngram(DEFAULT_DRAFT_LEN, DEFAULT_NGRAM_MIN)
    }
}

impl DraftOptions {
    /// N-gram drafting of up to `len` tokens from suffixes of `ngram_min` tokens or more.
    pub fn ngram(len: usize, ngram_min: usize) -> DraftOptions {
        DraftOptions { len, ngram_min, sequences: DEFAULT_DRAFT_SEQUENCES, replay: None }
    }
}

/// A drafter that knows the answer, for measuring what drafting gains and costs at a chosen
/// acceptance whatever the model's text (`bench --draft-accept`): it replays the tokens a plain
/// greedy run chose after the same prompt, with the guess after the first `accept x n` of a
/// step's `n` guesses replaced by another token (when `accept x n` is not whole, the fraction is
/// the probability of one more right guess, drawn from `seed` and the step's position). A step
/// then keeps `accept` of its guesses on average: the share of guesses kept is `accept`.
#[derive(Clone, Debug, PartialEq)]
pub struct Replay {
    /// (prompt, the tokens a plain greedy run chose after it).
    runs: std::sync::Arc<Vec<(Vec<u32>, Vec<u32>)>>,
    pub accept: f64,
    pub seed: u64,
    /// Back off after rejected drafts as the n-gram drafter does (`bench`'s `draft-miss` cell:
    /// what that policy costs where no guess is ever right).
    pub backoff: bool,
    /// Choose the draft length as the n-gram drafter does (`bench --draft-adaptive`: what the
    /// default policy gives at this acceptance); otherwise every draft is `--draft-len` long (the
    /// verify pass's cost at that length).
    pub adaptive: bool,
}

impl Replay {
    pub fn new(runs: Vec<(Vec<u32>, Vec<u32>)>, accept: f64, seed: u64) -> Replay {
        Replay {
            runs: std::sync::Arc::new(runs),
            accept: accept.clamp(0.0, 1.0),
            seed,
            backoff: false,
            adaptive: false,
        }
    }

    /// The recorded tokens after `prompt`, if it was recorded.
    fn after(&self, prompt: &[u32]) -> Option<&[u32]> {
        self.runs.iter().find(|(p, _)| p == prompt).map(|(_, t)| t.as_slice())
    }

    /// The guesses for the tokens `at..` after the prompt, `recorded` being the recorded ones
    /// from there (as many as guessed): right up to the step's share, then one wrong (a
    /// neighbouring id: never the recorded one, always inside the vocabulary), then right.
    fn guesses(&self, at: usize, recorded: &[u32], out: &mut Vec<u32>) {
        let share = self.accept * recorded.len() as f64;
        let draw = crate::rng::splitmix64_at(self.seed, at as u64) as f64 / (u64::MAX as f64 + 1.0);
        let right = share.floor() as usize + usize::from(draw < share.fract());
        out.extend(recorded.iter().enumerate().map(|(i, &t)| match (i == right, t) {
            (false, _) => t,
            (true, 0) => 1,
            (true, t) => t - 1,
        }));
    }
}

/// Why drafting options were refused (exit 2).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DraftError {
    #[error("--draft-len {0} is out of range: give 1 to {MAX_DRAFT_LEN}")]
    Len(usize),
    #[error("--ngram-min {0} is out of range: give 1 to {NGRAM_MAX}")]
    NgramMin(usize),
    #[error("--draft-sequences 0 is out of range: give 1 or more (or --no-draft)")]
    Sequences,
    #[error("drafting needs greedy decoding (--temperature 0): a sampled run's tokens would differ from the same run without drafts; leave out --draft ngram to sample")]
    NotGreedy,
}

impl crate::exit::Classify for DraftError {
    fn exit_code(&self) -> crate::exit::ExitCode {
        crate::exit::ExitCode::Usage
    }
}

impl DraftOptions {
    pub fn check(&self) -> Result<(), DraftError> {
        if self.len == 0 || self.len > MAX_DRAFT_LEN {
            return Err(DraftError::Len(self.len));
        }
        if self.ngram_min == 0 || self.ngram_min > NGRAM_MAX {
            return Err(DraftError::NgramMin(self.ngram_min));
        }
        if self.sequences == 0 {
            return Err(DraftError::Sequences);
        }
        Ok(())
    }
}

/// Counters of one sequence (or a whole run): what was guessed and what the model confirmed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DraftStats {
    /// Decode steps of the sequence (with or without a draft).
    pub steps: u64,
    /// Steps that carried a draft.
    pub drafted_steps: u64,
    /// Tokens guessed.
    pub drafted: u64,
    /// Guesses kept.
    pub accepted: u64,
}

impl DraftStats {
    pub fn add(&mut self, other: &DraftStats) {
        self.steps += other.steps;
        self.drafted_steps += other.drafted_steps;
        self.drafted += other.drafted;
        self.accepted += other.accepted;
    }

    /// Share of guesses kept (0 when nothing was guessed).
    pub fn acceptance(&self) -> f64 {
        if self.drafted == 0 {
            0.0
        } else {
            self.accepted as f64 / self.drafted as f64
        }
    }

    /// Tokens each decode step produced on average: one of its own plus its kept guesses.
    pub fn tokens_per_step(&self) -> f64 {
        if self.steps == 0 {
            0.0
        } else {
            (self.steps + self.accepted) as f64 / self.steps as f64
        }
    }
}

/// The guesses of one sequence: n-gram lookup with a back-off after rejected drafts, or a
/// [`Replay`] of recorded tokens (no back-off unless [`Replay::backoff`]: its rate is the
/// point).
#[derive(Clone, Debug)]
pub struct Drafter {
    opts: DraftOptions,
    /// With a replay: the prompt's length and its recorded tokens.
    replay: Option<(usize, Vec<u32>)>,
    /// Steps to skip before the next guess, and the length of the next back-off.
    skip: usize,
    cooldown: usize,
    /// Guesses of the next draft at most: one at first and after a rejected draft, until one
    /// is kept; then the length whose recent steps made the most tokens per second.
    len_now: usize,
    /// Tokens per second of recent drafted steps, by draft length (0: not measured lately).
    rates: [f64; MAX_DRAFT_LEN + 1],
    /// Drafted steps since the rates were last forgotten.
    rated_steps: usize,
    /// Lengths to draft next, a step each, before choosing again.
    probes: Vec<usize>,
    pub stats: DraftStats,
}

impl Drafter {
    /// The drafter of a sequence that starts after `prompt`.
    pub fn new(opts: DraftOptions, prompt: &[u32]) -> Drafter {
        let replay = opts.replay.as_ref().map(|r| (prompt.len(), r.after(prompt).unwrap_or_default().to_vec()));
        // A run starts with one-token guesses: a full draft comes once a guess was kept, so text
        // that never repeats itself never pays for a full wrong draft.
        Drafter {
            opts,
            replay,
            skip: 0,
            cooldown: 0,
            len_now: 1,
            rates: [0.0; MAX_DRAFT_LEN + 1],
            rated_steps: 0,
            probes: Vec::new(),
            stats: DraftStats::default(),
        }
    }

    /// Appends to `out` up to `limit` (and `--draft-len`) tokens guessed to follow `context`:
    /// what followed the most recent earlier occurrence of the longest suffix of `context` (of
    /// `--ngram-min` to [`NGRAM_MAX`] tokens) that occurs earlier. Nothing while backing off.
    pub fn propose(&mut self, context: &[u32], limit: usize, out: &mut Vec<u32>) {
        let backoff = self.opts.replay.as_ref().is_none_or(|r| r.backoff);
        let adaptive = self.opts.replay.as_ref().is_none_or(|r| r.adaptive);
        let limit = limit.min(if backoff || adaptive { self.len_now } else { self.opts.len });
        if limit == 0 {
            return;
        }
        if backoff && self.skip > 0 {
            self.skip -= 1;
            return;
        }
        if let (Some((offset, recorded)), Some(r)) = (&self.replay, &self.opts.replay) {
            // `context` is the prompt and the tokens chosen so far, the last not yet fed.
            let at = context.len().saturating_sub(*offset);
            let end = (at + limit).min(recorded.len());
            r.guesses(at, &recorded[at.min(end)..end], out);
            return;
        }
        lookup(context, self.opts.ngram_min, limit, out);
    }

    /// Continues what `previous` (the last reply's drafter, same options) learned: the draft
    /// length its step times chose, the rates behind it and its back-off. A chat reply then
    /// starts where the conversation's drafting left off instead of climbing from one guess
    /// again, which costs a short reply on a trunk whose rows cost compute. The counts start
    /// at zero. Nothing changes with other options (another `--draft-len`, a replay).
    pub fn resume(&mut self, previous: &Drafter) {
        if previous.opts != self.opts || self.opts.replay.is_some() {
            return;
        }
        self.skip = previous.skip;
        self.cooldown = previous.cooldown;
        self.len_now = previous.len_now;
        self.rates = previous.rates;
        self.rated_steps = previous.rated_steps;
        self.probes.clone_from(&previous.probes);
    }

    /// Rows of the longest step this drafter makes: the last token and its guesses.
    pub fn max_rows(&self) -> usize {
        self.opts.len + 1
    }

    /// What the step did with a draft of `drafted` tokens: `accepted` were kept; the step took
    /// `seconds`. Picks the next draft's length: after a wholly rejected draft, one token after
    /// a wait (the back-off); otherwise the length (up to `--draft-len`) whose recent steps made
    /// the most tokens (kept guesses and the model's own) per second. Lengths double from one
    /// while the longest tried is nearly the best; every 32 drafted steps the best's neighbours
    /// (half and twice it) are measured again, a step each. Longer drafts pay where a
    /// step's cost is its reads (a streamed trunk) and cost where it is compute (a resident
    /// trunk, rows that each add experts): the rates tell which, on this host and budget.
    /// Exactness does not depend on it: every length gives the same tokens.
    pub fn record(&mut self, drafted: usize, accepted: usize, seconds: f64) {
        self.stats.steps += 1;
        if drafted == 0 {
            return;
        }
        self.stats.drafted_steps += 1;
        self.stats.drafted += drafted as u64;
        self.stats.accepted += accepted as u64;
        let backoff = self.opts.replay.as_ref().is_none_or(|r| r.backoff);
        if accepted == 0 && backoff {
            self.cooldown = (self.cooldown * 2).clamp(MIN_COOLDOWN, MAX_COOLDOWN);
            self.skip = self.cooldown;
            self.len_now = 1;
            return;
        }
        self.cooldown = 0;
        self.adapt(drafted, accepted, seconds);
    }

    /// The choice of [`Self::record`] among draft lengths, by tokens per second.
    fn adapt(&mut self, drafted: usize, accepted: usize, seconds: f64) {
        let drafted = drafted.min(MAX_DRAFT_LEN);
        if seconds > 0.0 && seconds.is_finite() {
            let rate = (1 + accepted) as f64 / seconds;
            let r = &mut self.rates[drafted];
            *r = if *r > 0.0 { 0.5 * (*r + rate) } else { rate };
        }
        self.rated_steps += 1;
        if let Some(n) = self.probes.pop() {
            self.len_now = n;
            return;
        }
        let max = self.opts.len.clamp(1, MAX_DRAFT_LEN);
        let measured = || (1..=max).filter(|&n| self.rates[n] > 0.0);
        // Ties keep the longer draft.
        let best = measured().fold(drafted, |b, n| if self.rates[n] >= self.rates[b] { n } else { b });
        // Climb: twice the longest length measured, while that one makes nearly the best rate
        // (the rate need not rise at every doubling: one guess kept of one can beat one of two,
        // and eight of sixteen beat both).
        let top = measured().max().unwrap_or(drafted);
        let next = (top * 2).min(max);
        if next > top && self.rates[next] <= 0.0 && self.rates[top] >= CLIMB_SHARE * self.rates[best] {
            self.len_now = next;
            return;
        }
        if self.rated_steps >= RATE_MEMORY_STEPS {
            // Measure the best's neighbours again (one step each); the rest is forgotten.
            self.rated_steps = 0;
            let keep = self.rates[best];
            self.rates = [0.0; MAX_DRAFT_LEN + 1];
            self.rates[best] = keep;
            let (down, up) = ((best / 2).max(1), (best * 2).min(max));
            self.probes = [down, up].into_iter().filter(|&n| n != best).collect();
            if let Some(n) = self.probes.pop() {
                self.len_now = n;
                return;
            }
        }
        self.len_now = best;
    }
}

/// The n-gram lookup of [`Drafter::propose`], without the back-off.
pub fn lookup(context: &[u32], ngram_min: usize, limit: usize, out: &mut Vec<u32>) {
    let n = context.len();
    let longest = NGRAM_MAX.min(n.saturating_sub(1));
    for len in (ngram_min.max(1)..=longest).rev() {
        let suffix = &context[n - len..];
        // The most recent earlier occurrence: recent text predicts the next tokens best.
        if let Some(start) = (0..n - len).rev().find(|&i| &context[i..i + len] == suffix) {
            let from = start + len;
            out.extend_from_slice(&context[from..(from + limit).min(n)]);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guess(context: &[u32], min: usize, limit: usize) -> Vec<u32> {
        let mut out = Vec::new();
        lookup(context, min, limit, &mut out);
        out
    }

    #[test]
    fn the_longest_recurring_suffix_predicts_what_followed_it_last() {
        // "1 2 3" recurs; what followed its last earlier occurrence is "9 9".
        assert_eq!(guess(&[1, 2, 3, 4, 5, 1, 2, 3, 9, 9, 7, 1, 2, 3], 2, 4), vec![9, 9, 7, 1]);
        // A longer suffix wins over a more recent shorter one: "5 6" occurs twice, "4 5 6" once.
        assert_eq!(guess(&[4, 5, 6, 1, 5, 6, 2, 4, 5, 6], 2, 2), vec![1, 5]);
        // The continuation stops at the end of the context.
        assert_eq!(guess(&[7, 8, 7, 8], 2, 4), vec![7, 8]);
    }

    #[test]
    fn no_guess_without_a_recurring_suffix_of_the_minimum_length() {
        assert!(guess(&[1, 2, 3, 4], 2, 4).is_empty());
        assert!(guess(&[1, 2, 1], 2, 4).is_empty());
        assert_eq!(guess(&[1, 2, 1], 1, 4), vec![2, 1]);
        assert!(guess(&[], 1, 4).is_empty());
        assert!(guess(&[5], 1, 4).is_empty());
    }

    #[test]
    fn a_rejected_draft_backs_off_and_an_accepted_one_resets() {
        let mut d = Drafter::new(DraftOptions::ngram(3, 1), &[]);
        let ctx = [1, 2, 3, 1, 2, 3, 1];
        let mut out = Vec::new();
        d.propose(&ctx, 8, &mut out);
        assert_eq!(out, vec![2], "one guess until one is kept: what followed [1, 2, 3, 1]");
        d.record(1, 1, 1.0);
        out.clear();
        d.propose(&ctx, 8, &mut out);
        assert_eq!(out, vec![2, 3], "then longer drafts, twice the length first");
        d.record(2, 0, 1.0);
        // Steps without a guess before the next one (left in `out`).
        let wait = |d: &mut Drafter, out: &mut Vec<u32>| {
            let mut skipped = 0;
            loop {
                out.clear();
                d.propose(&ctx, 8, out);
                if !out.is_empty() {
                    return skipped;
                }
                d.record(0, 0, 1.0);
                skipped += 1;
            }
        };
        // Waits, then guesses one token; each rejection doubles the wait, up to the cap.
        let mut waits = Vec::new();
        for _ in 0..5 {
            waits.push(wait(&mut d, &mut out));
            assert_eq!(out, vec![2], "one guess after a rejection");
            d.record(1, 0, 1.0);
        }
        assert_eq!(waits, [MIN_COOLDOWN, 2 * MIN_COOLDOWN, 4 * MIN_COOLDOWN, MAX_COOLDOWN, MAX_COOLDOWN]);
        assert_eq!(wait(&mut d, &mut out), MAX_COOLDOWN);
        // A kept guess restores longer drafts at once, within the caller's limit.
        d.record(1, 1, 1.0);
        out.clear();
        d.propose(&ctx, 8, &mut out);
        assert_eq!(out, vec![2, 3]);
        out.clear();
        d.propose(&ctx, 1, &mut out);
        assert_eq!(out, vec![2]);
        assert_eq!(d.stats.accepted, 2);
    }

    #[test]
    fn a_resumed_drafter_keeps_the_length_and_the_back_off_but_not_the_counts() {
        let ctx: Vec<u32> = (0..40).map(|i| i % 20).collect();
        let mut first = Drafter::new(DraftOptions::ngram(16, 1), &[]);
        for _ in 0..6 {
            let mut out = Vec::new();
            first.propose(&ctx, 16, &mut out);
            first.record(out.len(), out.len(), 1.0);
        }
        let mut out = Vec::new();
        first.propose(&ctx, 16, &mut out);
        assert_eq!(out.len(), 16, "climbed");
        let mut next = Drafter::new(DraftOptions::ngram(16, 1), &ctx);
        next.resume(&first);
        out.clear();
        next.propose(&ctx, 16, &mut out);
        assert_eq!((out.len(), next.stats), (16, DraftStats::default()), "no climb from one guess again");
        // A wholly rejected draft's wait carries over too.
        next.record(16, 0, 1.0);
        let mut after = Drafter::new(DraftOptions::ngram(16, 1), &ctx);
        after.resume(&next);
        out.clear();
        after.propose(&ctx, 16, &mut out);
        assert!(out.is_empty(), "still waiting after the rejection");
        // Other options start afresh.
        let mut other = Drafter::new(DraftOptions::ngram(8, 1), &ctx);
        other.resume(&first);
        out.clear();
        other.propose(&ctx, 16, &mut out);
        assert_eq!(out.len(), 1);
    }

    /// Runs `steps` drafted steps of a drafter allowed 16 guesses, where a draft of n keeps
    /// `kept(n)` and a step of r rows takes `seconds(r)`; returns the lengths it drafted.
    fn climb(kept: impl Fn(usize) -> usize, seconds: impl Fn(usize) -> f64, steps: usize) -> Vec<usize> {
        let ctx: Vec<u32> = (0..40).map(|i| i % 20).collect();
        let mut d = Drafter::new(DraftOptions::ngram(16, 1), &[]);
        let mut lens = Vec::new();
        for _ in 0..steps {
            let mut out = Vec::new();
            d.propose(&ctx, 16, &mut out);
            let n = out.len();
            lens.push(n);
            d.record(n, kept(n).max(1), seconds(n + 1));
        }
        lens
    }

    #[test]
    fn the_draft_length_follows_tokens_per_second() {
        // A step costs its reads, rows add little: at half the guesses kept, the longest wins.
        let lens = climb(|n| n / 2, |rows| 1.0 + 0.02 * rows as f64, 200);
        assert_eq!(&lens[..5], [1, 2, 4, 8, 16], "it climbs, one doubling a step");
        let at_16 = lens[100..].iter().filter(|&&n| n == 16).count();
        assert!(at_16 >= 85, "{at_16} of 100 at 16: {lens:?}");
        // A step costs its rows (compute): drafts that keep half their guesses lose; the
        // shortest draft stays.
        let lens = climb(|n| n / 2, |rows| rows as f64, 200);
        let at_1 = lens[100..].iter().filter(|&&n| n == 1).count();
        assert!(at_1 >= 85, "{at_1} of 100 at 1: {lens:?}");
        // Rows cost in between: the best length is inside, and found.
        let lens = climb(|n| n, |rows| 1.0 + (rows as f64 / 5.0).powi(2), 200);
        let at_4 = lens[100..].iter().filter(|&&n| n == 4).count();
        assert!(at_4 >= 80, "{at_4} of 100 at 4: {lens:?}");
    }

    #[test]
    fn a_replay_keeps_its_share_of_each_steps_guesses() {
        let recorded: Vec<u32> = (10..1010).collect();
        let prompt = vec![1, 2, 3];
        let opts = |accept: f64| DraftOptions {
            replay: Some(Replay::new(vec![(prompt.clone(), recorded.clone())], accept, 5)),
            ..DraftOptions::ngram(4, 2)
        };
        // The share of 4-token drafts a greedy check would keep: guesses up to the first wrong.
        let kept_share = |accept: f64| {
            let mut d = Drafter::new(opts(accept), &prompt);
            let (mut kept, mut drafted) = (0, 0);
            for i in 0..recorded.len() - 5 {
                let ctx: Vec<u32> = prompt.iter().chain(&recorded[..=i]).copied().collect();
                let mut out = Vec::new();
                d.propose(&ctx, 8, &mut out);
                assert_eq!(out.len(), 4);
                kept += out.iter().zip(&recorded[i + 1..]).take_while(|(g, r)| g == r).count();
                drafted += 4;
            }
            kept as f64 / drafted as f64
        };
        assert_eq!(kept_share(1.0), 1.0);
        assert_eq!(kept_share(0.0), 0.0);
        assert_eq!(kept_share(0.5), 0.5, "two of four, every step");
        let third = kept_share(1.0 / 3.0);
        assert!((0.31..0.36).contains(&third), "{third}");
        // Nothing past the recording; no back-off; another prompt gets no guesses.
        let mut d = Drafter::new(opts(0.0), &prompt);
        let mut out = Vec::new();
        let all: Vec<u32> = prompt.iter().chain(&recorded).copied().collect();
        d.propose(&all, 4, &mut out);
        assert!(out.is_empty());
        d.record(4, 0, 1.0);
        d.propose(&[1, 2, 3, 10], 4, &mut out);
        assert_eq!(out.len(), 4);
        let mut other = Drafter::new(opts(1.0), &[7]);
        out.clear();
        other.propose(&[7, 1, 2], 4, &mut out);
        assert!(out.is_empty());
    }

    #[test]
    fn options_are_checked() {
        assert!(DraftOptions::default().check().is_ok());
        assert_eq!(DraftOptions::ngram(0, 2).check(), Err(DraftError::Len(0)));
        assert_eq!(DraftOptions::ngram(17, 2).check(), Err(DraftError::Len(17)));
        assert_eq!(DraftOptions::ngram(4, 0).check(), Err(DraftError::NgramMin(0)));
        assert_eq!(DraftOptions::ngram(4, 9).check(), Err(DraftError::NgramMin(9)));
    }
}
