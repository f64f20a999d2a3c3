//! Opening a model directory for a run: resident (shards mapped) or streaming (trunk pack plus
//! experts read in place, under a memory plan).
#![forbid(unsafe_code)]

use std::path::Path;
use std::sync::Arc;

use super::{Engine, EngineError};
use crate::checkpoint::CheckpointIndex;
use crate::config::Config;
use crate::exit::{Classify, ExitCode};
use crate::model::attribution::Attribution;
use crate::model::rewind::Journal;
use crate::model::weights::{ModelWeights, WeightSource};
use crate::model::{LayerHook, Model};
use crate::pipeline::{Pipeline, PipelineOptions};
use crate::storage::mmap::MmapSource;
use crate::storage::pack::Manifest;
use crate::storage::plan::{Plan, PlanError};
use crate::storage::stream::StoreOptions;
use crate::tokenizer::Tokenizer;
use crate::trace::Tracer;

/// An opened model: engine and tokenizer.
pub struct Opened<S: WeightSource + LayerHook = MmapSource> {
    pub engine: Engine<S>,
    pub tokenizer: Tokenizer,
}

/// Why a model directory could not be opened; each source keeps its own error type so the CLI
/// maps it to the right exit code.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    #[error(transparent)]
    Store(#[from] crate::storage::mmap::StoreError),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Pack(#[from] crate::storage::pack::PackError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error(transparent)]
    Stream(#[from] crate::storage::stream::StreamError),
}

impl Classify for OpenError {
    fn exit_code(&self) -> ExitCode {
        match self {
            OpenError::Config(e) => e.exit_code(),
            OpenError::Checkpoint(e) => e.exit_code(),
            OpenError::Store(e) => e.exit_code(),
            OpenError::Tokenizer(e) => e.exit_code(),
            OpenError::Engine(e) => e.exit_code(),
            OpenError::Pack(e) => e.exit_code(),
            OpenError::Plan(e) => e.exit_code(),
            OpenError::Stream(e) => e.exit_code(),
        }
    }
}

struct Common {
    cfg: Config,
    index: Arc<CheckpointIndex>,
    weights: ModelWeights,
    tokenizer: Tokenizer,
}

fn common(dir: &Path) -> Result<Common, OpenError> {
    let cfg = Config::from_model_dir(dir)?;
    let index = Arc::new(CheckpointIndex::open(dir)?);
    index.validate(&cfg)?;
    let weights = ModelWeights::resolve(&cfg, &index)?;
    // Without tokenizer files a run can still take token ids: the stand-in refuses text.
    let tokenizer = Tokenizer::from_model_dir_or_ids(dir, cfg.vocab_size)?;
    Ok(Common { cfg, index, weights, tokenizer })
}

/// Opens `dir`: validates config and checkpoint, maps the shards, loads the tokenizer.
pub fn open_resident(dir: &Path, threads: usize, kernels: kernels::Kernels) -> Result<Opened, OpenError> {
    let c = common(dir)?;
    let src = MmapSource::open(c.index)?;
    let model = Model { cfg: c.cfg, weights: c.weights, kernels, tracer: None, attribution: None };
    Ok(Opened { engine: Engine::new(model, src, threads)?, tokenizer: c.tokenizer })
}

/// What a streaming run is sized for.
#[derive(Clone, Debug)]
pub struct StreamingRun {
    pub budget_bytes: u64,
    /// Prompt plus generated tokens (of the longest sequence).
    pub context: usize,
    /// Sequences decoded together (`k3ring batch`): the plan reserves states for this many, or
    /// as many as the budget holds; 1 for `run`.
    pub sequences: usize,
    pub chunk: usize,
    pub threads: usize,
    pub store: StoreOptions,
    pub pipeline: PipelineOptions,
    /// Expert slots for the reads of one layer plus those ahead of compute (default: top-k,
    /// plus the speculation margin when predicting).
    pub prefetch_window: Option<usize>,
    /// Cores and node; `None` resolves the default from the topology.
    pub placement: Option<crate::pipeline::Placement>,
    /// Keep every span for a Chrome trace file (otherwise only the busy intervals).
    pub trace_detail: bool,
    /// Cap on the budget share for pinned trunk units (`None`: trunk first).
    pub trunk_share: Option<f64>,
    /// The memory the budget was derived from, so a preset and its check see one reading
    /// (`None`: read it when planning).
    pub available_memory: Option<crate::memory::Available>,
    /// The journals drafting holds (none by default).
    pub drafting: DraftPlan,
}

impl StreamingRun {
    /// One sequence of `context` positions in `budget_bytes`, prompts in chunks of `chunk`, on
    /// `threads` compute threads (0: every core), with every other choice at its default.
    pub fn new(budget_bytes: u64, context: usize, chunk: usize, threads: usize) -> StreamingRun {
        StreamingRun {
            budget_bytes,
            context,
            sequences: 1,
            chunk,
            threads,
            store: StoreOptions::default(),
            pipeline: PipelineOptions::default(),
            prefetch_window: None,
            placement: None,
            trace_detail: false,
            trunk_share: None,
            available_memory: None,
            drafting: DraftPlan::default(),
        }
    }
}

/// The journals of draft-and-verify decoding, which take rows back ([`crate::model::rewind`]):
/// one per sequence that may draft in a step.
#[derive(Clone, Copy, Debug, Default)]
pub struct DraftPlan {
    /// Rows of a drafted step: the last token and the guesses (0 or 1: no drafting).
    pub rows: usize,
    /// Journals held at once (a batcher's pool; a solo run has one).
    pub sequences: usize,
    /// Rows the drafts add to the widest step (a batch's guesses; 0 for a solo run, whose
    /// chunk holds its draft already).
    pub step_rows: usize,
    /// Drafting is the default rather than asked for: it yields, and the plan holds no journal
    /// ([`Plan::draft_journals`] 0), where its journals would leave fewer sequence slots than
    /// plain decoding, a budget too small to run, or unpin trunk worth more than a tenth of a
    /// token's reads (`sizing::plan_drafting`).
    pub optional: bool,
}

impl DraftPlan {
    pub(super) fn bytes(&self, cfg: &crate::config::Config) -> u64 {
        self.sequences.max(1) as u64 * Journal::bytes(cfg, self.rows)
    }

    pub(super) fn journals(&self) -> usize {
        if self.rows < 2 {
            0
        } else {
            self.sequences.max(1)
        }
    }
}

/// Opens `dir` for streaming from the trunk pack in `trunk_dir` under a memory budget: makes the
/// plan (before any large allocation), then the store.
pub fn open_streaming(
    dir: &Path,
    trunk_dir: &Path,
    run: &StreamingRun,
    kernels: kernels::Kernels,
    on_plan: impl FnOnce(&Plan),
) -> Result<(Opened<Pipeline>, Plan), OpenError> {
    let c = common(dir)?;
    let manifest = Manifest::load(trunk_dir)?;
    // Identity before sizes: another model's pack is refused as such (exit 3), not for memory.
    manifest.check_source(trunk_dir, dir, &c.index)?;
    let mut sized = super::sizing::plan_input(&c.cfg, &c.index, &c.weights, &manifest.units, manifest.alignment, run);
    if run.available_memory.is_none() {
        // This machine runs it: wait for memory a run that just ended is still returning.
        sized.input.mem_available = crate::memory::available_for(crate::memory::need_for_budget(run.budget_bytes));
    }
    let (chunk, plain_chunk) = (sized.chunk, sized.plain_chunk);
    let plan = super::sizing::plan_drafting(sized, &run.drafting)?;
    on_plan(&plan);
    let mut store = run.store.clone();
    store.chunk_tokens = if plan.draft_journals > 0 { chunk } else { plain_chunk };
    let mut pipeline = run.pipeline.clone();
    if let Some(p) = &run.placement {
        store.numa_node = Some(p.numa_node);
        pipeline.io.io_core = Some(p.io_core);
    }
    let tracer = Arc::new(Tracer::new(run.trace_detail));
    let index = Arc::clone(&c.index);
    let src = Pipeline::open(dir, trunk_dir, index, &c.cfg, &plan, &store, &pipeline, Arc::clone(&tracer))?;
    // A traced run also attributes its decode time per operation class (the trace report's
    // table); it costs an Instant pair per product.
    let attribution = run.trace_detail.then(|| Arc::new(Attribution::new()));
    let model = Model { cfg: c.cfg, weights: c.weights, kernels, tracer: Some(tracer), attribution };
    let cores = run.placement.as_ref().map_or(&[][..], |p| &p.compute_cores[..]);
    Ok((Opened { engine: Engine::pinned(model, src, run.threads, cores)?, tokenizer: c.tokenizer }, plan))
}
