//! The drafted cells of `k3ring bench` (issue 30): per budget, decoding with n-gram drafts
//! (`--draft-ngram`), and with a replay of a recorded plain run whose guesses are kept at a
//! chosen share (`--draft-accept`), so that what drafting gains and what its verify steps cost are
//! known at every acceptance, whatever the model's own text. They run the default pipeline
//! (prediction on) and are compared with its `pipelined` cell.

use std::path::Path;

use crate::engine::draft::{DraftOptions, Replay, DEFAULT_NGRAM_MIN};
use crate::engine::measure::{record_greedy, MeasureError, MeasureSpec};
use crate::error::UsageError;

/// Mode name of the n-gram cells.
pub const NGRAM_MODE: &str = "draft-ngram";
/// Mode name of the cells where every guess is wrong and the drafter backs off as the n-gram
/// drafter does: what the shipped policy costs on text that never repeats itself.
pub const MISS_MODE: &str = "draft-miss";
/// Mode names of the replay cells start with this, then the acceptance in percent.
const REPLAY_PREFIX: &str = "draft-replay-";
/// Mode names of the replay cells whose length the drafter chooses (`--draft-adaptive`).
const ADAPTIVE_PREFIX: &str = "draft-adaptive-";
/// Seed of the replay's corruption (fixed: cells and repeats see the same guesses).
const REPLAY_SEED: u64 = 0x0d7a_f7ed;

/// The drafted cells asked for.
pub struct DraftCells {
    pub len: usize,
    pub ngram: bool,
    /// Acceptance rates in percent.
    pub accept: Vec<u32>,
    /// The replay cells choose their length as the n-gram drafter does.
    pub adaptive: bool,
    /// The prompt and a plain greedy run after it, long enough for every replayed guess.
    pub recorded: Option<(Vec<u32>, Vec<u32>)>,
}

impl DraftCells {
    /// The cells `--draft-ngram`, `--draft-accept` and `--draft-len` ask for.
    pub fn new(len: usize, ngram: bool, accept: &[u32], adaptive: bool) -> Result<DraftCells, UsageError> {
        let cells = DraftCells { len, ngram, accept: accept.to_vec(), adaptive, recorded: None };
        if cells.ngram || !cells.accept.is_empty() {
            DraftOptions::ngram(len, DEFAULT_NGRAM_MIN).check().map_err(|e| UsageError(e.to_string()))?;
        }
        Ok(cells)
    }

    /// Records the plain run the replay cells replay (nothing without them).
    pub fn record(
        &mut self,
        model: &Path,
        kernels: kernels::Kernels,
        threads: usize,
        spec: &MeasureSpec,
    ) -> Result<(), MeasureError> {
        if self.ngram || !self.accept.is_empty() {
            let n = self.recording_len(spec.warmup, spec.tokens);
            let ids = record_greedy(model, kernels, threads, &spec.prompt, n)?;
            self.recorded = Some((spec.prompt.clone(), ids));
        }
        Ok(())
    }

    /// Tokens the recorded run needs for a measurement of `warmup` and `tokens`: the first, the
    /// warm-up, the window, and the guesses of its last step.
    pub fn recording_len(&self, warmup: usize, tokens: usize) -> usize {
        1 + warmup + tokens + self.len + 1
    }

    /// The mode names of the drafted cells, after the plain modes.
    pub fn modes(&self) -> Vec<String> {
        let ngram = [NGRAM_MODE, MISS_MODE].into_iter().filter(|_| self.ngram).map(str::to_owned);
        let prefix = if self.adaptive { ADAPTIVE_PREFIX } else { REPLAY_PREFIX };
        ngram.chain(self.accept.iter().map(|a| format!("{prefix}{a}%"))).collect()
    }

    /// The drafting of cell `mode` (`None` for the plain modes).
    pub fn options(&self, mode: &str) -> Option<DraftOptions> {
        let base = DraftOptions::ngram(self.len, DEFAULT_NGRAM_MIN);
        if mode == NGRAM_MODE {
            return Some(base);
        }
        let runs = || self.recorded.clone().into_iter().collect();
        if mode == MISS_MODE {
            let mut replay = Replay::new(runs(), 0.0, REPLAY_SEED);
            (replay.backoff, replay.adaptive) = (true, true);
            return Some(DraftOptions { replay: Some(replay), ..base });
        }
        let (adaptive, rest) = match mode.strip_prefix(ADAPTIVE_PREFIX) {
            Some(rest) => (true, rest),
            None => (false, mode.strip_prefix(REPLAY_PREFIX)?),
        };
        let pct: f64 = rest.strip_suffix('%')?.parse().ok()?;
        let mut replay = Replay::new(runs(), pct / 100.0, REPLAY_SEED);
        replay.adaptive = adaptive;
        Some(DraftOptions { replay: Some(replay), ..base })
    }
}

/// `--draft-accept`: percentages from 0 to 100.
pub fn parse_percent(s: &str) -> Result<u32, String> {
    match s.trim().parse::<u32>() {
        Ok(p) if p <= 100 => Ok(p),
        _ => Err(format!("{s:?} is not a percentage from 0 to 100")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_name_their_drafting() {
        let mut cells = DraftCells {
            len: 4,
            ngram: true,
            accept: vec![0, 50, 100],
            adaptive: false,
            recorded: Some((vec![1], vec![2, 3])),
        };
        assert_eq!(
            cells.modes(),
            ["draft-ngram", "draft-miss", "draft-replay-0%", "draft-replay-50%", "draft-replay-100%"]
        );
        let miss = cells.options(MISS_MODE).and_then(|o| o.replay);
        assert!(miss.is_some_and(|r| r.backoff && r.accept == 0.0));
        assert_eq!(cells.options("pipelined"), None);
        assert!(cells.options(NGRAM_MODE).is_some_and(|o| o.replay.is_none() && o.len == 4));
        let half = cells.options("draft-replay-50%").and_then(|o| o.replay).map(|r| r.accept);
        assert_eq!(half, Some(0.5));
        assert_eq!(cells.options("draft-replay-100%").and_then(|o| o.replay).map(|r| r.accept), Some(1.0));
        assert_eq!(parse_percent("75"), Ok(75));
        assert!(parse_percent("101").is_err() && parse_percent("x").is_err());
        cells.adaptive = true;
        assert_eq!(cells.modes()[2..], ["draft-adaptive-0%", "draft-adaptive-50%", "draft-adaptive-100%"]);
        let half = cells.options("draft-adaptive-50%").and_then(|o| o.replay);
        assert!(half.is_some_and(|r| r.adaptive && !r.backoff && r.accept == 0.5));
    }
}
