//! What the planner is told about a streaming run ([`plan_input`]): shared by a run that opens
//! a trunk pack and by `k3ring plan`, which sizes a server from a `config.json` alone (the
//! checkpoint's layout follows from the config: [`crate::checkpoint::CheckpointIndex::for_config`]),
//! so the sizing table and a real run make the same plan.
#![forbid(unsafe_code)]

use super::load::{DraftPlan, OpenError, StreamingRun};
use crate::checkpoint::CheckpointIndex;
use crate::config::Config;
use crate::model::weights::ModelWeights;
use crate::model::{ModelState, Scratch};
use crate::pipeline::Prefetcher;
use crate::storage::pack::{PackUnit, UnitEntry};
use crate::storage::plan::{Plan, PlanInput};
use crate::storage::stream::{embed_buffer_bytes, expert_slot_bytes};

/// The planner's input for `run`, and the step widths it assumed.
pub(super) struct Sized {
    pub input: PlanInput,
    /// Rows of the widest step, and of the widest step without drafting's rows.
    pub chunk: usize,
    pub plain_chunk: usize,
    /// The scratch without drafting's journals and rows.
    pub plain_scratch: u64,
    /// Expert bytes a token reads when the pool holds none of its experts.
    pub expert_read: u64,
}

/// The planner's input for `run` over the trunk `units` (a pack's, or the layout a pack of
/// this config would have) aligned to `align`.
pub(super) fn plan_input(
    cfg: &Config,
    index: &CheckpointIndex,
    weights: &ModelWeights,
    units: &[UnitEntry],
    align: u64,
    run: &StreamingRun,
) -> Sized {
    let trunk: Vec<(PackUnit, Vec<(String, u64)>)> = units
        .iter()
        .filter_map(|u| {
            let unit = PackUnit::parse(&u.unit).filter(|p| *p != PackUnit::Embed)?;
            Some((unit, u.tensors.iter().map(|t| (t.name.clone(), t.len)).collect()))
        })
        .collect();
    let lens = units
        .iter()
        .filter_map(|u| PackUnit::parse(&u.unit).map(|p| (p, u.len)))
        .filter(|(p, _)| *p != PackUnit::Embed)
        .collect();
    // A batch step has a decode row per sequence plus the prefill chunk, which can be more rows
    // than one sequence has positions: the bound is every sequence's positions together.
    let rows_max = run.sequences.max(1).saturating_mul(run.context.max(1));
    let chunk = run.chunk.clamp(1, rows_max);
    // The step without the drafts' rows, for a plan that drops optional drafting.
    let plain_chunk = run.chunk.saturating_sub(run.drafting.step_rows).clamp(1, rows_max);
    let scratch = |chunk: usize| {
        Scratch::bytes(cfg, chunk, run.context)
            + Prefetcher::scratch_bytes(cfg, chunk)
            + 4 * (chunk * cfg.vocab_size) as u64
            + embed_buffer_bytes(cfg, chunk, align)
    };
    let spec = run.pipeline.effective_speculation();
    let input = PlanInput {
        budget: run.budget_bytes,
        mem_available: run.available_memory.clone().or_else(crate::memory::available),
        units: lens,
        expert_slot_bytes: expert_slot_bytes(cfg, align),
        experts_total: index.experts.len(),
        top_k: cfg.moe.top_k,
        prefetch_window: run.prefetch_window.unwrap_or(cfg.moe.top_k + if spec.enabled { spec.margin } else { 0 }),
        readahead: run.pipeline.mode.readahead(run.store.readahead),
        states_bytes: ModelState::bytes(cfg, run.context),
        sequences: run.sequences,
        scratch_bytes: scratch(chunk) + run.drafting.bytes(cfg),
        trunk_share: run.trunk_share,
        pieces: Some(crate::storage::stream::pieces::plan_input(
            weights,
            cfg,
            &trunk,
            index,
            align,
            run.store.piece_bytes,
        )),
        spread_pins: run.store.spread_pins,
    };
    let moe_layers = cfg.layers.iter().filter(|l| l.ffn == crate::config::FfnKind::Moe).count() as u64;
    let expert_read = moe_layers * cfg.moe.top_k as u64 * input.expert_slot_bytes;
    Sized { input, chunk, plain_chunk, plain_scratch: scratch(plain_chunk), expert_read }
}

/// Share of a token's reads that default drafting may add by unpinning trunk for its journals:
/// a kept guess saves a whole step's reads, so a few percent more per step pays off with
/// guesses kept now and then; more than this is left to `--draft ngram`.
const DRAFT_UNPIN_SHARE: f64 = 0.1;

/// The plan of `sized`, whose scratch counts drafting's journals and rows; the plan without
/// them (no drafting) when drafting is optional ([`DraftPlan::optional`]) and would cost the
/// run a sequence slot or the budget's minimum, or unpin trunk that adds more than
/// [`DRAFT_UNPIN_SHARE`] to a token's reads (its streamed trunk and `sized.expert_read`).
pub(super) fn plan_drafting(sized: Sized, drafting: &DraftPlan) -> Result<Plan, OpenError> {
    let Sized { input, plain_scratch, expert_read, .. } = sized;
    let with = Plan::make(&input);
    if !drafting.optional || drafting.journals() == 0 {
        return Ok(Plan { draft_journals: drafting.journals(), ..with? });
    }
    let added = input.scratch_bytes.saturating_sub(plain_scratch);
    let plain = Plan::make(&PlanInput { scratch_bytes: plain_scratch, ..input })?;
    let reads = (plain.trunk_read_bytes_per_token + expert_read) as f64;
    let why = match &with {
        Err(_) => "the budget holds no journal",
        Ok(p) if p.sequences < plain.sequences => "they would take a sequence slot",
        Ok(p)
            if (p.trunk_read_bytes_per_token - plain.trunk_read_bytes_per_token.min(p.trunk_read_bytes_per_token))
                as f64
                > DRAFT_UNPIN_SHARE * reads =>
        {
            "they would unpin trunk worth more than a tenth of a token's reads"
        }
        Ok(p) => return Ok(Plan { draft_journals: drafting.journals(), ..p.clone() }),
    };
    let note = format!(
        "drafting off: its journals and rows ({}) {why} (--draft ngram drafts anyway)",
        crate::storage::plan::fmt_gb(added)
    );
    Ok(Plan { draft_note: Some(note), ..plain })
}

/// A model's layout from its config alone (no checkpoint, no pack), for the plans a streaming
/// run of it would make: the checkpoint's tensors are those the config requires
/// ([`CheckpointIndex::for_config`]) and the pack's layout at `align` (4096 on most NVMe drives)
/// that of [`crate::storage::pack`].
pub struct ConfigSizing<'c> {
    cfg: &'c Config,
    index: CheckpointIndex,
    weights: ModelWeights,
    units: Vec<UnitEntry>,
    align: u64,
}

impl<'c> ConfigSizing<'c> {
    pub fn new(cfg: &'c Config, align: u64) -> Result<ConfigSizing<'c>, OpenError> {
        let index = CheckpointIndex::for_config(cfg)?;
        let weights = ModelWeights::resolve(cfg, &index)?;
        let (units, _) = crate::storage::pack::layout(cfg, &index, align)?;
        Ok(ConfigSizing { cfg, index, weights, units, align })
    }

    /// Routed experts of the model.
    pub fn experts(&self) -> usize {
        self.index.experts.len()
    }

    /// The plan `run` would get.
    pub fn plan(&self, run: &StreamingRun) -> Result<Plan, OpenError> {
        let mut sized = plan_input(self.cfg, &self.index, &self.weights, &self.units, self.align, run);
        // The server being sized is not this machine: its memory is the budget's business.
        sized.input.mem_available = None;
        plan_drafting(sized, &run.drafting)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn input(budget: u64, scratch_bytes: u64) -> PlanInput {
        PlanInput { scratch_bytes, ..crate::storage::plan::tests::input(budget) }
    }

    fn sized(budget: u64, expert_read: u64) -> Sized {
        // Drafting adds 60 bytes of journal and rows to a plain scratch of 50.
        Sized { input: input(budget, 110), chunk: 2, plain_chunk: 1, plain_scratch: 50, expert_read }
    }

    /// Default drafting keeps its journal where the trunk it unpins adds at most a tenth of a
    /// token's reads, and yields (saying so) where it adds more; asked-for drafting never yields.
    #[test]
    fn default_drafting_yields_only_where_unpinned_trunk_costs_over_a_tenth_of_the_reads() {
        let optional = DraftPlan { rows: 9, sequences: 1, step_rows: 1, optional: true };
        // A budget where the journal unpins a unit that plain decoding pins.
        let budget = (700..3000)
            .find(|&b| {
                let (with, plain) = (Plan::make(&input(b, 110)), Plan::make(&input(b, 50)));
                matches!((with, plain), (Ok(w), Ok(p)) if w.sequences == p.sequences && w.pinned_bytes < p.pinned_bytes)
            })
            .expect("some budget where the journal unpins trunk");
        let (with, plain) = (Plan::make(&input(budget, 110)).unwrap(), Plan::make(&input(budget, 50)).unwrap());
        let added = with.trunk_read_bytes_per_token - plain.trunk_read_bytes_per_token;
        assert!(added > 0);
        // Reads of ten times the added trunk and more: drafting stays.
        let many = 10 * added;
        let p = plan_drafting(sized(budget, many), &optional).unwrap();
        assert_eq!((p.draft_journals, p.draft_note.is_none()), (1, true), "{}", p.describe());
        // Few other reads: the unpinned trunk is more than a tenth; drafting yields.
        let p = plan_drafting(sized(budget, 0), &optional).unwrap();
        assert_eq!(p.draft_journals, 0, "{}", p.describe());
        assert!(
            p.draft_note.as_deref().unwrap().contains("would unpin trunk worth more than a tenth"),
            "{:?}",
            p.draft_note
        );
        assert_eq!(p.pinned_bytes, plain.pinned_bytes);
        // Asked for, it keeps the journal whatever it costs.
        let asked = DraftPlan { optional: false, ..optional };
        let p = plan_drafting(sized(budget, 0), &asked).unwrap();
        assert_eq!((p.draft_journals, p.pinned_bytes), (1, with.pinned_bytes));
    }
}
