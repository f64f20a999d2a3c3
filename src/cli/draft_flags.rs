//! The drafting flags of `run`, `chat`, `batch` and `serve` (draft-and-verify decoding,
//! [`crate::engine::draft`]).

use crate::engine::draft::{DraftOptions, DEFAULT_DRAFT_LEN, DEFAULT_NGRAM_MIN};
use crate::engine::Sampling;

/// Whether greedy `run` and `chat` draft without `--draft`: yes, since `bench` measured that
/// drafting costs at most a few percent where no guess is kept (`draft-miss`) and reads up to
/// 2.7x fewer bytes per token where guesses are kept (docs/BENCHMARKS.md, "Drafting"). A batch
/// or a server drafts only with `--draft ngram`: each of its slots would hold a journal of the
/// KDA states (435 MB on the release model), which the default should not take from their
/// contexts.
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
    /// are those of plain greedy decoding. Default: on for greedy `run` and `chat`, off for
    /// `batch` and `serve`
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

    /// The drafting of a batch or a server, whose requests sample or not one by one: with
    /// `--draft ngram` the greedy ones draft and the sampled ones decode one token per step;
    /// off by default ([`DRAFT_BY_DEFAULT`] says why).
    pub fn for_requests(&self) -> Option<DraftOptions> {
        (self.draft == Some(DraftKind::Ngram) && !self.no_draft)
            .then(|| DraftOptions::ngram(self.draft_len, self.ngram_min))
    }

    /// Rows of a drafted step (for the memory plan): the last token and the guesses; 0 when
    /// not drafting.
    pub fn rows(&self, sampling: &Sampling) -> usize {
        self.options(sampling).map_or(0, |o| o.len + 1)
    }
}
