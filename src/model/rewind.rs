//! Taking back the last rows of a step, for draft verification: a step runs a sequence's pending
//! token and its drafted tokens as rows, and only the rows whose drafts the model confirms are
//! kept. The MLA caches keep their first rows by truncation. The KDA state is a recurrence that
//! a step overwrites in place, so an armed state keeps, per KDA layer, the state before the step
//! and the recurrence's inputs of its rows ([`KdaJournal`]); taking rows back restores the saved
//! state and replays the kept rows with the same operations in the same order, which gives the
//! state bit for bit as if only those rows had run (tested against a run of the kept rows).
//!
//! The choice against its alternative (a per-row copy of every KDA state during the step): the
//! journal costs one copy of the KDA states per verification step and a replay of the kept rows'
//! recurrence (no weights are read); per-row copies would cost rows x the states in memory.

use kernels::Kernels;

use super::kda::KdaJournal;
use super::{LayerState, ModelError, ModelState};
use crate::config::{AttnKind, Config};

/// The journal of one sequence's state (see the module docs).
pub struct Journal {
    /// Per layer: `Some` for KDA layers.
    kda: Vec<Option<KdaJournal>>,
    max_rows: usize,
    /// Position of the armed step's first row; `None` when not armed.
    base: Option<usize>,
}

impl Journal {
    /// A journal for steps of up to `max_rows` rows (allocated here, once).
    pub fn new(cfg: &Config, max_rows: usize) -> Journal {
        let kda =
            cfg.layers.iter().map(|p| (p.attn == AttnKind::Kda).then(|| KdaJournal::new(cfg, max_rows))).collect();
        Journal { kda, max_rows, base: None }
    }

    /// Bytes a journal for steps of up to `max_rows` rows holds (none below two rows: a step
    /// of one row is never taken back).
    pub fn bytes(cfg: &Config, max_rows: usize) -> u64 {
        if max_rows < 2 {
            return 0;
        }
        cfg.layers.iter().filter(|p| p.attn == AttnKind::Kda).map(|_| KdaJournal::bytes(cfg, max_rows)).sum()
    }

    /// The armed journal of layer `l`, when the state is armed and `l` is a KDA layer.
    pub(super) fn kda_mut(&mut self, l: usize) -> Option<&mut KdaJournal> {
        self.base?;
        self.kda.get_mut(l)?.as_mut()
    }
}

impl ModelState {
    /// Arms the state so that the rows of its next step (at most `max_rows`) can be taken back
    /// ([`ModelState::rewind`]). Allocates the journal on first use or when it is too small.
    pub fn arm(&mut self, cfg: &Config, max_rows: usize) {
        let fits = self.journal.as_ref().is_some_and(|j| j.max_rows >= max_rows);
        if !fits {
            self.journal = Some(Journal::new(cfg, max_rows));
        }
        if let Some(j) = &mut self.journal {
            j.base = Some(self.pos);
        }
    }

    /// Lends `journal` to this state, for [`ModelState::arm`] to use when it holds enough rows
    /// (a batcher's pool lends its few journals to the sequences that draft in a step).
    pub fn lend_journal(&mut self, journal: Journal) {
        self.journal = Some(journal);
    }

    /// Takes the state's journal away, disarmed: the rows of a step run since
    /// [`ModelState::arm`] can no longer be taken back.
    pub fn take_journal(&mut self) -> Option<Journal> {
        let mut journal = self.journal.take()?;
        journal.base = None;
        Some(journal)
    }

    /// Whether the next step's rows can be taken back, and how many at most.
    pub fn armed_rows(&self) -> Option<usize> {
        self.journal.as_ref().and_then(|j| j.base.map(|_| j.max_rows))
    }

    /// Keeps all rows of the armed step (nothing to take back) and disarms.
    pub fn commit(&mut self) {
        if let Some(j) = &mut self.journal {
            j.base = None;
        }
    }

    /// Keeps only the first `keep` rows of the step run since [`ModelState::arm`], as if only
    /// they had run, and disarms. Refuses when the state is not armed or `keep` is more rows
    /// than the step ran.
    pub fn rewind(&mut self, k: &Kernels, cfg: &Config, keep: usize) -> Result<(), ModelError> {
        let Some(j) = &mut self.journal else {
            return Err(ModelError::Internal("rewind of a state that was never armed".into()));
        };
        let Some(base) = j.base.take() else {
            return Err(ModelError::Internal("rewind of a state that is not armed".into()));
        };
        let ran = self.pos - base;
        if keep > ran {
            return Err(ModelError::Internal(format!("rewind to {keep} rows of a step of {ran}")));
        }
        if keep == ran {
            return Ok(());
        }
        for (layer, journal) in self.layers.iter_mut().zip(&mut j.kda) {
            match (layer, journal) {
                (LayerState::Kda(s), Some(journal)) => journal.rewind(k, cfg, s, keep),
                (LayerState::Mla(c), None) => c.truncate(base + keep),
                _ => return Err(ModelError::Internal("journal and state disagree".into())),
            }
        }
        self.pos = base + keep;
        Ok(())
    }
}
