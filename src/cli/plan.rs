//! `k3ring plan`: the sizing table of a model from its `config.json` alone, made by the same
//! planner a run uses ([`crate::engine::sizing::ConfigSizing`]), so a user can size a server
//! before downloading 1.56 TB.
//!
//! For each budget: what is pinned, what a token reads (its share of a step's streamed trunk and
//! distinct experts, less those the pool holds), and the seconds a token's reads take at a few
//! drive rates. The expert
//! reads assume routing spread evenly over all experts (the pool then holds a token's expert
//! with the odds of its share of all experts): K3's router is trained for that, and the public C
//! engine saw no expert-cache reuse below about 36 GB. The time is the reads' alone: a lower
//! bound that counts neither compute nor what reads cost the host (`k3ring bench` measures both).

use std::path::PathBuf;

use anyhow::Context;
use serde::Serialize;

use crate::config::Config;
use crate::engine::draft::DraftOptions;
use crate::engine::sizing::ConfigSizing;
use crate::engine::{BatchOptions, DraftPlan, StreamingRun};
use crate::pipeline::PipelineOptions;
use crate::storage::plan::{fmt_gb, Plan, GB};

/// Drive rates of the table when not given: a PCIe 3 drive, a PCIe 4 drive, two and four of them.
const DEFAULT_RATES: [f64; 4] = [3.0, 7.0, 14.0, 28.0];

/// Unit alignment of the pack assumed: 4096 bytes, what `pack` finds on NVMe drives.
const ALIGN: u64 = 4096;

#[derive(Debug, clap::Args)]
#[command(allow_negative_numbers = true, args_override_self = true)]
pub struct PlanArgs {
    /// The model's config.json (the release's, or any model directory's); nothing else is read
    #[arg(long, value_name = "FILE")]
    pub config: PathBuf,
    /// Positions of each sequence (prompt plus generated tokens)
    #[arg(long, value_name = "N", default_value_t = 4096, value_parser = super::parse_slot_positions)]
    pub context: usize,
    /// Sequences decoded together (as `batch` and `serve --max-batch`)
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = super::parse_batch_size)]
    pub max_batch: usize,
    /// Budgets in GB, comma-separated (default: the minimum, powers of two up to the budget that
    /// pins the whole trunk, and that budget)
    #[arg(long, value_name = "GB,...", value_delimiter = ',')]
    pub budgets: Vec<f64>,
    /// Drive read rates in GB/s for the time columns, comma-separated
    #[arg(long, value_name = "GB/S,...", value_delimiter = ',', default_values_t = DEFAULT_RATES)]
    pub rates: Vec<f64>,
    /// Write the table as JSON to FILE ("-": to stdout, instead of the text)
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// One budget's row.
#[derive(Debug, Serialize)]
pub struct Row {
    pub budget_bytes: u64,
    pub pinned_units: usize,
    pub streamed_units: usize,
    /// Trunk bytes held in memory: whole units and pieces of split units.
    pub pinned_bytes: u64,
    /// Of `pinned_bytes`, pieces of split units (spread over the token, `--trunk-pins spread`).
    pub pinned_piece_bytes: u64,
    /// Trunk bytes read per generated token: a step's, shared by its sequences.
    pub trunk_read_bytes_per_token: u64,
    /// Sequences the budget holds (at most `--max-batch`); each step makes a token for each.
    pub sequences: usize,
    pub expert_slots: usize,
    pub expert_pool_bytes: u64,
    /// Share of a token's experts the pool holds, with routing spread evenly.
    pub expert_hit_share: f64,
    pub expert_read_bytes_per_token: u64,
    pub read_bytes_per_token: u64,
    /// Seconds of reads per token at each of `rates`.
    pub read_seconds_per_token: Vec<f64>,
    /// Whether the run drafts at this budget (default drafting yields to a tight one).
    pub drafting: bool,
    pub plan: Plan,
}

#[derive(Debug, Serialize)]
pub struct Table {
    pub config: String,
    pub context: usize,
    pub sequences: usize,
    pub trunk_bytes: u64,
    pub expert_bytes: u64,
    pub experts: usize,
    pub minimum_bytes: u64,
    /// The smallest budget that pins every trunk unit.
    pub trunk_resident_bytes: u64,
    pub rates_gb_per_s: Vec<f64>,
    pub rows: Vec<Row>,
}

pub fn run(args: &PlanArgs) -> anyhow::Result<()> {
    if let Some(bad) = args.rates.iter().find(|r| !(r.is_finite() && **r > 0.0)) {
        return Err(crate::error::UsageError(format!("--rates {bad}: give read rates in GB/s above 0")).into());
    }
    if let Some(bad) = args.budgets.iter().find(|b| !(b.is_finite() && **b > 0.0)) {
        return Err(crate::error::UsageError(format!("--budgets {bad}: give budgets in GB above 0")).into());
    }
    let json = super::output::JsonOut::open(args.json.as_deref())?;
    let cfg = Config::from_file(&args.config)?;
    let table = table(&cfg, args).with_context(|| format!("planning for {}", args.config.display()))?;
    if !super::output::JsonOut::is_stdout(json.as_ref()) {
        print(&table);
    }
    if let Some(out) = &json {
        out.write(&table)?;
    }
    Ok(())
}

/// Rows a prefill step takes at most, as `run`, `batch` and `serve` default to.
const PREFILL_CHUNK: usize = 32;

/// The run `plan` sizes at `budget` bytes, on a server with that much memory: greedy decoding
/// with the default pipeline and default drafting, as `run` plans one sequence
/// (`--max-batch 1`) and as `batch` and `serve` plan more (their journal pool and step rows);
/// `drafting: false` plans the same run without drafting.
fn sizing_run(args: &PlanArgs, budget: u64, drafting: bool) -> StreamingRun {
    let (chunk, draft) = if args.max_batch == 1 {
        let rows = crate::engine::draft::DEFAULT_DRAFT_LEN + 1;
        (PREFILL_CHUNK, DraftPlan { rows, sequences: 1, step_rows: 0, optional: true })
    } else {
        let batch = BatchOptions {
            max_batch: args.max_batch,
            prefill_chunk: PREFILL_CHUNK,
            context: args.context,
            draft: Some(DraftOptions::default()),
        };
        (batch.step_rows(), batch.draft_plan(true))
    };
    // Without drafting the step has no guess rows, as `batch` and `serve` then make it.
    let (chunk, draft) = if drafting { (chunk, draft) } else { (chunk - draft.step_rows, DraftPlan::default()) };
    StreamingRun { sequences: args.max_batch, drafting: draft, ..StreamingRun::new(budget, args.context, chunk, 1) }
}

fn plan_at(sizing: &ConfigSizing<'_>, args: &PlanArgs, budget: u64) -> Result<Plan, crate::engine::OpenError> {
    sizing.plan(&sizing_run(args, budget, true))
}

/// The sizing table of `cfg` for `args`.
pub fn table(cfg: &Config, args: &PlanArgs) -> anyhow::Result<Table> {
    let sizing = ConfigSizing::new(cfg, ALIGN)?;
    // A budget no model reaches gives the minimum and the whole trunk's size; the minimum is
    // that of the run without drafting, which default drafting yields to.
    let roomy = plan_at(&sizing, args, u64::MAX / 4)?;
    let minimum = sizing.plan(&sizing_run(args, u64::MAX / 4, false))?.minimum_bytes;
    let trunk_bytes = roomy.pinned_bytes;
    let resident = smallest_resident_budget(&sizing, args, minimum, roomy.planned_bytes)?;
    let budgets: Vec<u64> = if args.budgets.is_empty() {
        default_budgets(minimum, resident)
    } else {
        args.budgets.iter().map(|gb| (gb * GB) as u64).collect()
    };
    let experts = sizing.experts();
    let expert_bytes = crate::storage::stream::expert_slot_bytes(cfg, ALIGN);
    let mut rows = Vec::with_capacity(budgets.len());
    for budget in budgets {
        let plan = plan_at(&sizing, args, budget)?;
        rows.push(row(cfg, &plan, experts, &args.rates));
    }
    Ok(Table {
        config: args.config.display().to_string(),
        context: args.context,
        sequences: args.max_batch,
        trunk_bytes,
        expert_bytes: experts as u64 * expert_bytes,
        experts,
        minimum_bytes: minimum,
        trunk_resident_bytes: resident,
        rates_gb_per_s: args.rates.clone(),
        rows,
    })
}

/// What a token reads under `plan`, with routing spread evenly over the `experts`.
fn row(cfg: &Config, plan: &Plan, experts: usize, rates: &[f64]) -> Row {
    let moe_layers = cfg.layers.iter().filter(|l| l.ffn == crate::config::FfnKind::Moe).count();
    // The prefetch window's slots hold the reads in flight; the rest keep experts for reuse.
    let spec = PipelineOptions::default().effective_speculation();
    let window = cfg.moe.top_k + if spec.enabled { spec.margin } else { 0 };
    let cached = plan.expert_slots.saturating_sub(window);
    // A pool with a slot for every expert holds them all, in flight or not.
    let hit = if plan.expert_slots >= experts { 1.0 } else { (cached as f64 / experts.max(1) as f64).min(1.0) };
    // A step of B sequences reads the trunk once and each distinct expert of a layer once: of
    // E experts, B tokens choosing k each pick E (1 - (1 - k/E)^B) distinct ones on average.
    let b = plan.sequences.max(1) as f64;
    let e = cfg.moe.n_experts.max(1) as f64;
    let distinct = e * (1.0 - (1.0 - cfg.moe.top_k as f64 / e).powf(b));
    let per_token = moe_layers as f64 * distinct / b * plan.expert_slot_bytes as f64;
    let expert_read = (per_token * (1.0 - hit)).round() as u64;
    let trunk_read = (plan.trunk_read_bytes_per_token as f64 / b).round() as u64;
    let read = trunk_read + expert_read;
    Row {
        budget_bytes: plan.budget_bytes,
        pinned_units: plan.pinned.len(),
        streamed_units: plan.streamed.len(),
        pinned_bytes: plan.pinned_bytes + plan.pinned_piece_bytes,
        pinned_piece_bytes: plan.pinned_piece_bytes,
        trunk_read_bytes_per_token: trunk_read,
        sequences: plan.sequences,
        expert_slots: plan.expert_slots,
        expert_pool_bytes: plan.expert_slots as u64 * plan.expert_slot_bytes,
        expert_hit_share: hit,
        expert_read_bytes_per_token: expert_read,
        read_bytes_per_token: read,
        read_seconds_per_token: rates.iter().map(|r| read as f64 / (r * GB)).collect(),
        drafting: plan.draft_journals > 0,
        plan: plan.clone(),
    }
}

/// The smallest budget (to 1 MB) whose plan pins every trunk unit, between `minimum` and
/// `enough` (a budget known to pin it all).
fn smallest_resident_budget(
    sizing: &ConfigSizing<'_>,
    args: &PlanArgs,
    minimum: u64,
    enough: u64,
) -> anyhow::Result<u64> {
    let pins_all = |budget: u64| -> anyhow::Result<bool> { Ok(plan_at(sizing, args, budget)?.streamed.is_empty()) };
    let (mut lo, mut hi) = (minimum, enough.max(minimum));
    if pins_all(lo)? {
        return Ok(lo);
    }
    while hi - lo > 1_000_000 {
        let mid = lo + (hi - lo) / 2;
        if pins_all(mid)? {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    Ok(hi)
}

/// The minimum, then powers of two GB above it below `resident`, then `resident`.
fn default_budgets(minimum: u64, resident: u64) -> Vec<u64> {
    let mut out = vec![minimum];
    let mut gb = 1u64;
    while gb * 1_000_000_000 <= minimum {
        gb *= 2;
    }
    while gb * 1_000_000_000 < resident {
        out.push(gb * 1_000_000_000);
        gb *= 2;
    }
    if resident > minimum {
        out.push(resident);
    }
    out
}

fn print(t: &Table) {
    println!(
        "k3ring plan: {} | trunk {} | {} experts, {} | {} sequence(s) of {} positions",
        t.config,
        fmt_gb(t.trunk_bytes),
        t.experts,
        fmt_gb(t.expert_bytes),
        t.sequences,
        t.context
    );
    println!(
        "minimum budget {} | whole trunk pinned from {} | expert reads assume routing spread evenly; times are reads alone (no compute)",
        fmt_gb(t.minimum_bytes),
        fmt_gb(t.trunk_resident_bytes)
    );
    let rates: Vec<String> = t.rates_gb_per_s.iter().map(|r| format!("s/tok @{r} GB/s")).collect();
    println!(
        "| budget | sequences | drafting | trunk pinned | trunk read/token | expert pool (slots) | experts held | expert read/token | read/token | {} |",
        rates.join(" | ")
    );
    println!("|---|---|---|---|---|---|---|---|---|{}", "---|".repeat(rates.len()));
    for r in &t.rows {
        let times: Vec<String> = r.read_seconds_per_token.iter().map(|s| format!("{s:.2}")).collect();
        println!(
            "| {} | {} | {} | {} ({} of {} units{}) | {} | {} ({}) | {:.1}% | {} | {} | {} |",
            fmt_gb(r.budget_bytes),
            r.sequences,
            if r.drafting { "on" } else { "off" },
            fmt_gb(r.pinned_bytes),
            r.pinned_units,
            r.pinned_units + r.streamed_units,
            if r.pinned_piece_bytes > 0 {
                format!(" whole, {} in pieces", fmt_gb(r.pinned_piece_bytes))
            } else {
                String::new()
            },
            fmt_gb(r.trunk_read_bytes_per_token),
            fmt_gb(r.expert_pool_bytes),
            r.expert_slots,
            100.0 * r.expert_hit_share,
            fmt_gb(r.expert_read_bytes_per_token),
            fmt_gb(r.read_bytes_per_token),
            times.join(" | ")
        );
    }
}
