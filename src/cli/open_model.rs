//! Opening a model for a multi-sequence command the way `batch` does: resident (shards mapped)
//! without `--trunk`, else streaming under the budget with a slot per sequence, the plan and
//! placement printed on stderr and a refused plan named after the budget flag. The command's
//! work is a [`ModelJob`], run with either weight source.
//!
//! `serve` uses it; `batch` has the same steps inline and can move onto it.

use std::path::Path;

use anyhow::Context;

use super::budget::name_budget_flag;
use super::pipeline_flags::PipelineArgs;
use super::run::{streaming_run, typed_budget_flag};
use super::StorageArgs;
use crate::engine::{open_resident, open_streaming, Opened};
use crate::model::weights::WeightSource;
use crate::model::LayerHook;
use crate::pipeline::placement::Placement;
use crate::storage::plan::Plan;
use crate::storage::stream::StreamStats;

/// What a command does with the opened model.
pub(super) trait ModelJob {
    /// `plan` is the streaming plan (None when resident); `storage` reads the streaming
    /// counters (None when resident).
    fn run<S: WeightSource + LayerHook>(
        self,
        opened: &Opened<S>,
        plan: Option<&Plan>,
        storage: &dyn Fn(&S) -> Option<StreamStats>,
    ) -> anyhow::Result<()>;
}

/// How to open the model.
pub(super) struct OpenModel<'a> {
    pub model_dir: &'a Path,
    pub storage: &'a StorageArgs,
    pub pipeline: &'a PipelineArgs,
    pub threads: usize,
    pub kernels: kernels::Kernels,
    pub placement: Placement,
    /// Sequences decoded together (a slot each in the plan).
    pub sequences: usize,
    /// Rows of the widest step.
    pub chunk: usize,
    /// Positions of each slot.
    pub context: usize,
    /// The drafting journals to plan for.
    pub drafting: crate::engine::DraftPlan,
    /// Memory the command keeps beside the plan, with the flag that sizes it: taken from a
    /// streaming budget.
    pub reserved: Option<(&'static str, u64)>,
}

impl OpenModel<'_> {
    /// Opens the model and runs `job` on it.
    pub fn run(self, job: impl ModelJob) -> anyhow::Result<()> {
        let dir = self.model_dir;
        let Some(trunk) = &self.storage.trunk else {
            let opened = open_resident(dir, self.threads, self.kernels)
                .with_context(|| format!("opening model {}", dir.display()))?;
            return job.run(&opened, None, &|_| None);
        };
        eprintln!("k3ring: {}", self.placement.describe());
        let flag = typed_budget_flag(self.storage);
        let mut run = streaming_run(self.pipeline, self.storage, self.threads, self.chunk, self.context)
            .map_err(|e| name_budget_flag(e, &flag))?;
        if let Some((reserved_flag, bytes)) = self.reserved {
            let gb = |b: u64| b as f64 / crate::storage::plan::GB;
            run.budget_bytes = run.budget_bytes.checked_sub(bytes).filter(|&b| b > 0).ok_or_else(|| {
                crate::error::UsageError(format!(
                    "{reserved_flag} {:.2} GB leaves nothing of the budget of {:.2} GB ({flag}): lower {reserved_flag} or raise the budget",
                    gb(bytes),
                    gb(run.budget_bytes)
                ))
            })?;
            eprintln!(
                "k3ring: {reserved_flag} takes {:.2} GB of the budget; the plan gets {:.2} GB",
                gb(bytes),
                gb(run.budget_bytes)
            );
        }
        run.sequences = self.sequences;
        run.drafting = self.drafting;
        run.placement = Some(self.placement);
        let (opened, plan) =
            open_streaming(dir, trunk, &run, self.kernels, |plan| eprintln!("k3ring: {}", plan.describe()))
                .with_context(|| format!("opening model {} with trunk pack {}", dir.display(), trunk.display()))
                .map_err(|e| name_budget_flag(e, &flag))?;
        job.run(&opened, Some(&plan), &|src| Some(src.stats()))
    }
}
