//! The drafting flags of `run`, `chat`, `batch` and `serve` (draft-and-verify decoding,
//! [`crate::engine::draft`]).

use crate::engine::draft::{DraftOptions, DEFAULT_DRAFT_LEN, DEFAULT_NGRAM_MIN};
use crate::engine::Sampling;

/// Whether greedy requests draft without `--draft`: yes, since `bench` measured that drafting
/// costs at most a few percent where no guess is kept (`draft-miss`) and reads up to 2.6x fewer
/// bytes per token where guesses are kept (docs/BENCHMARKS.md, "Drafting"). A batch or a server
/// lends a pool of `--draft-sequences` journals of the KDA states (435-507 MB each on the
/// release model) to the sequences that guess in a step, so its slots' contexts keep their
/// memory ([`crate::engine::draft::DEFAULT_DRAFT_SEQUENCES`]).
pub const DRAFT_BY_DEFAULT: bool = true;

/// Drafting kinds `--draft` accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DraftKind {
    /// Guess by n-gram lookup in the context (prompt lookup).
    Ngram,
    /// No drafting.
    Off,
}

#[derive(Debug, Clone, clap::Args)]
pub struct DraftArgs {
    /// Draft-and-verify decoding (greedy only): guess up to --draft-len tokens by matching the
    /// context's latest tokens against earlier text, and verify them in one step; the tokens
    /// are those of plain greedy decoding. Default: on for greedy requests (sampled ones
    /// decode one token per step)
    #[arg(long, value_name = "KIND", value_enum)]
    pub draft: Option<DraftKind>,
    /// No drafting (the same as --draft off)
    #[arg(long, conflicts_with = "draft")]
    pub no_draft: bool,
    /// Tokens guessed per step at most (1 to 16)
    #[arg(long, value_name = "K", default_value_t = DEFAULT_DRAFT_LEN)]
    pub draft_len: usize,
    /// Shortest run of the context's latest tokens that must occur earlier to make a guess (1 to 8)
    #[arg(long, value_name = "N", default_value_t = DEFAULT_NGRAM_MIN)]
    pub ngram_min: usize,
}

impl DraftArgs {
    /// Refuses, before any work, out-of-range options and `--draft ngram` with `sampling` that
    /// is not greedy (when `refuse_sampling`: a batch or a server drafts its greedy requests
    /// only, whatever the others ask).
    pub fn check(&self, sampling: &Sampling, refuse_sampling: bool) -> Result<(), crate::error::UsageError> {
        let usage = |e: crate::engine::DraftError| crate::error::UsageError(e.to_string());
        DraftOptions::ngram(self.draft_len, self.ngram_min).check().map_err(usage)?;
        if refuse_sampling && self.draft == Some(DraftKind::Ngram) && !sampling.is_greedy() {
            return Err(usage(crate::engine::DraftError::NotGreedy));
        }
        Ok(())
    }

    /// The drafting asked for with `sampling`: `--draft ngram` with sampling is refused (by
    /// the engine); the default drafts greedy runs only.
    pub fn options(&self, sampling: &Sampling) -> Option<DraftOptions> {
        let opts = DraftOptions::ngram(self.draft_len, self.ngram_min);
        match (self.draft, self.no_draft) {
            (_, true) | (Some(DraftKind::Off), _) => None,
            (Some(DraftKind::Ngram), _) => Some(opts),
            (None, false) => (DRAFT_BY_DEFAULT && sampling.is_greedy()).then_some(opts),
        }
    }

    /// Turns default drafting off where the plan holds no journal for it
    /// ([`crate::engine::DraftPlan::optional`]; the plan's line says why).
    pub fn yield_to(&mut self, plan: &crate::storage::plan::Plan) {
        if self.draft.is_none() && plan.draft_journals == 0 {
            self.no_draft = true;
        }
    }

    /// The drafting of a batch or a server, whose requests sample or not one by one: the
    /// greedy ones draft, up to `sequences` of them in a step (`--draft-sequences`), and the
    /// sampled ones decode one token per step ([`DRAFT_BY_DEFAULT`] says why it is on).
    pub fn for_requests(&self, sequences: usize) -> Option<DraftOptions> {
        let on = match (self.draft, self.no_draft) {
            (_, true) | (Some(DraftKind::Off), _) => false,
            (Some(DraftKind::Ngram), _) => true,
            (None, false) => DRAFT_BY_DEFAULT,
        };
        on.then(|| DraftOptions { sequences, ..DraftOptions::ngram(self.draft_len, self.ngram_min) })
    }

    /// The journal of a solo run that drafts with `sampling` (for the memory plan): none when
    /// not drafting; optional when drafting is the default.
    pub fn plan(&self, sampling: &Sampling) -> crate::engine::DraftPlan {
        let rows = self.options(sampling).map_or(0, |o| o.len + 1);
        crate::engine::DraftPlan { rows, sequences: 1, step_rows: 0, optional: self.draft.is_none() }
    }
}
