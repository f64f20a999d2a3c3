//! `k3ring bench --batch 1,4,16`: cells of B sequences decoding together, per budget, measured
//! in the same alternation as the mode cells. A cell of B runs the first B of one set of
//! distinct prompts (the bench prompt with a suffix per sequence), greedy, `--tokens` steps
//! after `--warmup`, in the default mode. Per cell: aggregate tokens/s, trunk and expert bytes
//! per step and per token, distinct experts per MoE layer per step against the union B uniform
//! routings would give, the bound `max(bytes read per step / device rate, resident compute per
//! step of B rows)`, efficiency = bound / measured, the bound without routing prediction
//! (`bound*`: a layer's expert reads overlap only the expert compute after its router, as the
//! mode cells' `floor*`), and whether every sequence's ids equal its solo run's.

use anyhow::Context;
use serde::Serialize;

use super::bench::{or_dash, print_in_trial, BenchArgs};
use crate::config::Config;
use crate::engine::measure::MeasureSpec;
use crate::engine::measure_batch::{
    expected_distinct_experts, ids_match_solo, measure_resident_batch, measure_streaming_batch, solo_ids,
    BatchMeasurement, BatchSpec,
};
use crate::engine::read_tax::ReadTax;
use crate::engine::StreamingRun;
use crate::error::UsageError;
use crate::model::attribution::{AttributionTable, Window};
use crate::tokenizer::Tokenizer;

/// Sequences of one batch cell at most: every sequence gets a state slot and a solo run, so
/// the limit keeps a typo from planning thousands of them.
pub const BATCH_MAX: usize = 256;

/// The mode the batch cells run in: the default, as `k3ring batch` would.
pub const BATCH_MODE: &str = "pipelined";

/// `--batch` values: 1..=[`BATCH_MAX`].
pub(super) fn parse_batch(s: &str) -> Result<usize, String> {
    super::count_in(s, 1..=BATCH_MAX, &format!("a batch size in 1..={BATCH_MAX}"))
}

/// Refuses a batch size given twice: each size is one cell, and its median would mix two.
pub(super) fn check_sizes(sizes: &[usize]) -> Result<(), UsageError> {
    for (i, b) in sizes.iter().enumerate() {
        if sizes[..i].contains(b) {
            return Err(UsageError(format!("--batch: {b} is given twice; list each batch size once")));
        }
    }
    Ok(())
}

/// The batch cells' workload: the sizes and one prompt per sequence of the largest.
pub(super) struct BatchWork {
    pub sizes: Vec<usize>,
    prompts: Vec<Vec<u32>>,
    warmup: usize,
    steps: usize,
    prefill_chunk: usize,
}

impl BatchWork {
    /// `None` without `--batch`.
    pub fn new(args: &BenchArgs, tok: &Tokenizer, spec: &MeasureSpec) -> anyhow::Result<Option<BatchWork>> {
        let Some(&largest) = args.batch.iter().max() else { return Ok(None) };
        let prompts = (0..largest)
            .map(|i| tok.encode(&format!("{} #{}", args.prompt, i + 1)))
            .collect::<Result<Vec<_>, _>>()
            .context("encoding the batch cells' prompts")?;
        Ok(Some(BatchWork {
            sizes: args.batch.clone(),
            prompts,
            warmup: spec.warmup,
            steps: spec.tokens,
            prefill_chunk: spec.prefill_chunk,
        }))
    }

    pub fn spec(&self, batch: usize) -> BatchSpec {
        BatchSpec {
            prompts: self.prompts[..batch].to_vec(),
            warmup: self.warmup,
            steps: self.steps,
            prefill_chunk: self.prefill_chunk,
        }
    }

    /// The streaming run of a cell of `batch`: `run` (a mode cell's) with a state slot per
    /// sequence, scratch for the widest step and the slots' context.
    pub fn run(&self, mut run: StreamingRun, batch: usize) -> StreamingRun {
        let spec = self.spec(batch);
        run.sequences = batch;
        run.chunk = spec.options().step_rows();
        run.context = spec.context();
        run
    }

    /// Tokens of each solo run: the most any cell's sequence can generate.
    fn solo_tokens(&self) -> usize {
        self.sizes.iter().map(|&b| self.spec(b).max_tokens()).max().unwrap_or(1)
    }
}

/// What the resident runs gave: per batch size the median compute per step, the solo runs'
/// ids, and whether the resident batches reproduced them.
pub(super) struct Resident {
    seconds_per_step: Vec<(usize, f64)>,
    /// Per batch size: the part of that median run's step that expert reads can overlap without
    /// prediction, when the trace measured it.
    overlappable_seconds_per_step: Vec<(usize, Option<f64>)>,
    solo: Vec<Vec<u32>>,
    ids_match: bool,
    /// Per batch size: that median run's steps per operation class.
    attribution: Vec<(usize, Window)>,
}

/// Solo runs of every prompt, then each batch size's resident compute per step, `repeats`
/// times with the sizes alternating; the median per size.
pub(super) fn measure_resident(
    args: &BenchArgs,
    kernels: kernels::Kernels,
    work: &BatchWork,
) -> anyhow::Result<Resident> {
    let solo = solo_ids(&args.model, kernels, args.threads, &work.prompts, work.solo_tokens(), work.prefill_chunk)
        .context("solo runs of the batch cells' prompts")?;
    let mut samples: Vec<ResidentSample> = Vec::new();
    let mut windows = Vec::new();
    let mut ids_match = true;
    for _ in 0..args.repeats.max(1) {
        for &b in &work.sizes {
            let m = measure_resident_batch(&args.model, kernels, args.threads, &work.spec(b))
                .with_context(|| format!("resident batch of {b}"))?;
            ids_match &= ids_match_solo(&m.ids, &solo);
            samples.push((b, m.seconds_per_step, m.overlappable_seconds_per_step));
            windows.push(m.attribution);
        }
    }
    let median = median_runs(&samples, &work.sizes);
    let attribution =
        work.sizes.iter().filter_map(|&b| Some((b, windows.get(median_index(&samples, b)?)?.clone()?))).collect();
    let seconds_per_step = median.iter().map(|m| (m.0, m.1)).collect();
    let overlappable_seconds_per_step = median.iter().map(|m| (m.0, m.2)).collect();
    Ok(Resident { seconds_per_step, overlappable_seconds_per_step, solo, ids_match, attribution })
}

/// A resident batch run: (batch size, s/step, overlappable s/step).
type ResidentSample = (usize, f64, Option<f64>);

/// Per size, the median run by s/step, with its own overlappable part (not the median of
/// those, which could come from another run).
fn median_runs(samples: &[ResidentSample], sizes: &[usize]) -> Vec<ResidentSample> {
    sizes.iter().map(|&b| median_index(samples, b).map_or((b, 0.0, None), |i| samples[i])).collect()
}

/// The index in `samples` of size `b`'s median run by s/step.
fn median_index(samples: &[ResidentSample], b: usize) -> Option<usize> {
    let mut runs: Vec<usize> = (0..samples.len()).filter(|&i| samples[i].0 == b).collect();
    runs.sort_by(|&x, &y| samples[x].1.total_cmp(&samples[y].1));
    runs.get(runs.len() / 2).copied()
}

/// One batch cell streaming at `budget`.
pub(super) fn measure_cell(
    args: &BenchArgs,
    kernels: kernels::Kernels,
    work: &BatchWork,
    run: StreamingRun,
    batch: usize,
) -> anyhow::Result<BatchMeasurement> {
    let m = measure_streaming_batch(&args.model, &args.trunk, &work.run(run, batch), kernels, &work.spec(batch))?;
    Ok(m)
}

/// One batch cell's median sample, its bound and checks.
#[derive(Serialize)]
pub(super) struct BatchCell {
    budget_gb: f64,
    mode: &'static str,
    /// The plan pinned every trunk unit (else some stream through the ring every step).
    trunk_pinned: bool,
    #[serde(flatten)]
    m: BatchMeasurement,
    trunk_bytes_per_token: f64,
    expert_bytes_per_token: f64,
    /// `E (1 - (1 - k/E)^B)`: the distinct experts of B tokens each choosing top-k of E
    /// uniformly.
    expected_distinct_experts_per_layer_step: f64,
    device_read_rate_during: f64,
    /// The resident compute of one step of B decode rows (median of the resident runs).
    resident_seconds_per_step: f64,
    /// The part of it that expert reads can overlap without prediction (from the same run).
    resident_overlappable_seconds_per_step: Option<f64>,
    /// `max(bytes read per step / device rate, resident compute per step)`.
    bound_seconds_per_step: f64,
    /// "device" or "compute": the larger part of the bound.
    bound_by: &'static str,
    efficiency: f64,
    /// The bound without routing prediction: a layer's expert reads start at its router, so
    /// they overlap only the compute that follows it (the resident run's shared and routed
    /// expert spans); the rest of the step's compute and the expert reads add up. The mode
    /// cells' `floor*`, per step of B rows.
    bound_no_prediction_seconds_per_step: Option<f64>,
    efficiency_no_prediction: Option<f64>,
    /// The bounds with the read tax charged (`None` with `--no-read-tax`):
    /// `max(bytes / device rate, compute + tax per byte x bytes)`, and the same without
    /// routing prediction.
    bound_host_seconds_per_step: Option<f64>,
    efficiency_host: Option<f64>,
    bound_no_prediction_host_seconds_per_step: Option<f64>,
    efficiency_no_prediction_host: Option<f64>,
    /// The host bound when the device also reads at the read-tax stream's rate beside compute
    /// ([`super::bench_host::shared_floor`]).
    bound_shared_host_seconds_per_step: Option<f64>,
    efficiency_shared_host: Option<f64>,
    /// Every sequence's ids, in every repeat of this cell, equal its solo run's.
    ids_match_solo: bool,
}

/// Aggregate tokens/s of a cell over the batch of 1 at the same budget.
#[derive(Serialize)]
pub(super) struct BatchRatio {
    budget_gb: f64,
    batch: usize,
    tokens_per_second_vs_batch_1: f64,
}

/// The batch part of the report (`batch` in `--json`).
#[derive(Serialize)]
pub(super) struct BatchReport {
    /// Per batch size: the resident compute per step.
    resident_seconds_per_step: Vec<(usize, f64)>,
    /// Per batch size: the median resident run's steps per operation class, against the triad
    /// and the FMA peak (their sum of the classes' roofline times is the step's compute roof).
    resident_attribution: Vec<(usize, AttributionTable)>,
    cells: Vec<BatchCell>,
    ratios: Vec<BatchRatio>,
    /// Every batch cell's and resident batch's sequences equal their solo runs.
    pub ids_match_solo: bool,
}

/// Reduces the samples (budget, measurement) to one cell per (budget, size): the median by
/// s/step, with that budget's device rate (`device_rates`: the better of the probes around its
/// cells and their own busy read rates).
pub(super) fn report(
    samples: &[(f64, BatchMeasurement)],
    device_rates: &[(f64, f64)],
    resident: Resident,
    work: &BatchWork,
    cfg: &Config,
    tax: Option<&ReadTax>,
    (triad, fma_peak): (f64, Option<f64>),
) -> BatchReport {
    let mut cells = Vec::new();
    for &(budget, device_rate) in device_rates {
        for &b in &work.sizes {
            let runs: Vec<&BatchMeasurement> =
                samples.iter().filter(|s| s.0 == budget && s.1.batch == b).map(|s| &s.1).collect();
            let ids_match = runs.iter().all(|m| ids_match_solo(&m.ids, &resident.solo));
            let mut sorted = runs.clone();
            sorted.sort_by(|x, y| x.seconds_per_step.total_cmp(&y.seconds_per_step));
            let Some(m) = sorted.get(sorted.len() / 2) else { continue };
            let compute = resident.seconds_per_step.iter().find(|r| r.0 == b).map_or(0.0, |r| r.1);
            let overlappable = resident.overlappable_seconds_per_step.iter().find(|r| r.0 == b).and_then(|r| r.1);
            cells.push(cell(budget, (*m).clone(), device_rate, (compute, overlappable), ids_match, cfg, tax));
        }
    }
    let ratios = ratios(&cells);
    let ids_match_solo = resident.ids_match && cells.iter().all(|c| c.ids_match_solo);
    let resident_attribution = resident.attribution.iter().map(|(b, w)| (*b, w.table(Some(triad), fma_peak))).collect();
    BatchReport {
        resident_seconds_per_step: resident.seconds_per_step,
        resident_attribution,
        cells,
        ratios,
        ids_match_solo,
    }
}

/// A cell from its median sample; `compute` is the resident compute of a step of B rows and
/// the part of it that expert reads can overlap without prediction.
fn cell(
    budget_gb: f64,
    m: BatchMeasurement,
    device_rate: f64,
    (compute, overlappable): (f64, Option<f64>),
    ids_match: bool,
    cfg: &Config,
    tax: Option<&ReadTax>,
) -> BatchCell {
    let b = m.batch.max(1) as f64;
    let Bounds { bound, by, no_prediction } = bounds(&m, device_rate, (compute, overlappable));
    let host = tax.map(|t| {
        let bytes = (m.trunk_bytes_per_step, super::bench_host::ExpertReads::Total(m.expert_bytes_per_step));
        let charged = super::bench_host::charged_floors(bytes, (compute, overlappable), device_rate, t);
        let total = bytes.0 + bytes.1.bytes();
        (charged, super::bench_host::shared_floor(total, compute, device_rate, t))
    });
    let per_step = |v: f64| v / m.seconds_per_step;
    BatchCell {
        budget_gb,
        mode: BATCH_MODE,
        trunk_pinned: m.plan.as_ref().is_some_and(|p| p.streamed.is_empty()),
        trunk_bytes_per_token: m.trunk_bytes_per_step / b,
        expert_bytes_per_token: m.expert_bytes_per_step / b,
        expected_distinct_experts_per_layer_step: expected_distinct_experts(cfg.moe.n_experts, cfg.moe.top_k, m.batch),
        device_read_rate_during: device_rate,
        resident_seconds_per_step: compute,
        resident_overlappable_seconds_per_step: overlappable,
        bound_seconds_per_step: bound,
        bound_by: by,
        efficiency: bound / m.seconds_per_step,
        bound_no_prediction_seconds_per_step: no_prediction,
        efficiency_no_prediction: no_prediction.map(|f| f / m.seconds_per_step),
        bound_host_seconds_per_step: host.map(|((bound, _), _)| bound),
        efficiency_host: host.map(|((bound, _), _)| per_step(bound)),
        bound_no_prediction_host_seconds_per_step: host.and_then(|((_, no_prediction), _)| no_prediction),
        efficiency_no_prediction_host: host.and_then(|((_, no_prediction), _)| no_prediction).map(per_step),
        bound_shared_host_seconds_per_step: host.map(|(_, shared)| shared),
        efficiency_shared_host: host.map(|(_, shared)| per_step(shared)),
        ids_match_solo: ids_match,
        m,
    }
}

/// A cell's bounds, seconds per step.
#[derive(Debug, PartialEq)]
struct Bounds {
    /// `max((trunk + expert bytes) / device rate, compute)`.
    bound: f64,
    /// "device" or "compute": the larger part of `bound`.
    by: &'static str,
    /// `max(bound, compute - overlappable + expert bytes / device rate)`: a layer's expert
    /// reads start at its router, so they overlap only the expert compute after it.
    no_prediction: Option<f64>,
}

fn bounds(m: &BatchMeasurement, device_rate: f64, (compute, overlappable): (f64, Option<f64>)) -> Bounds {
    let io = (m.trunk_bytes_per_step + m.expert_bytes_per_step) / device_rate;
    let bound = io.max(compute);
    Bounds {
        bound,
        by: if io >= compute { "device" } else { "compute" },
        no_prediction: overlappable.map(|o| bound.max(compute - o + m.expert_bytes_per_step / device_rate)),
    }
}

fn ratios(cells: &[BatchCell]) -> Vec<BatchRatio> {
    let one = |budget: f64| cells.iter().find(|c| c.budget_gb == budget && c.m.batch == 1);
    cells
        .iter()
        .filter(|c| c.m.batch != 1)
        .filter_map(|c| {
            let base = one(c.budget_gb)?;
            Some(BatchRatio {
                budget_gb: c.budget_gb,
                batch: c.m.batch,
                tokens_per_second_vs_batch_1: c.m.tokens_per_second / base.m.tokens_per_second,
            })
        })
        .collect()
}

pub(super) fn print(r: &BatchReport) {
    println!(
        "batch cells ({BATCH_MODE}; B sequences, distinct prompts, greedy; a step is one token of every sequence):"
    );
    println!(
        "{:>7} {:>8} {:>5} {:>8} {:>7} {:>7} {:>10} {:>9} {:>8} {:>9} {:>8} {:>9} {:>9} {:>8} {:>8} {:>7} {:>7} {:>8} {:>7} {:>8} {:>6} {:>6} {:>4}",
        "budget",
        "trunk",
        "batch",
        "s/step",
        "check",
        "tok/s",
        "trunk/step",
        "trunk/tok",
        "exp/tok",
        "experts/L",
        "expected",
        "reads/L",
        "dev GB/s",
        "compute",
        "bound",
        "by",
        "effic.",
        "bound*",
        "effic*",
        "bound_h",
        "eff_h",
        "eff_hs",
        "ids"
    );
    for c in &r.cells {
        println!(
            "{:>6}G {:>8} {:>5} {:>8.3} {:>7.3} {:>7.2} {:>9.2}G {:>8.3}G {:>7.3}G {:>9.1} {:>8.1} {:>9.1} {:>9.2} {:>8.3} {:>8.3} {:>7} {:>7.2} {} {} {} {} {} {:>4}",
            c.budget_gb,
            if c.trunk_pinned { "pinned" } else { "streamed" },
            c.m.batch,
            c.m.seconds_per_step,
            c.m.expert_verify_seconds_per_step,
            c.m.tokens_per_second,
            c.m.trunk_bytes_per_step / 1e9,
            c.trunk_bytes_per_token / 1e9,
            c.expert_bytes_per_token / 1e9,
            c.m.distinct_experts_per_layer_step,
            c.expected_distinct_experts_per_layer_step,
            c.m.expert_reads_per_layer_step,
            c.device_read_rate_during / 1e9,
            c.resident_seconds_per_step,
            c.bound_seconds_per_step,
            c.bound_by,
            c.efficiency,
            or_dash(c.bound_no_prediction_seconds_per_step, 8, 3),
            or_dash(c.efficiency_no_prediction, 7, 2),
            or_dash(c.bound_host_seconds_per_step, 8, 3),
            or_dash(c.efficiency_host, 6, 2),
            or_dash(c.efficiency_shared_host, 6, 2),
            if c.ids_match_solo { "ok" } else { "DIFF" }
        );
    }
    let in_trial = r.cells.iter().filter(|c| c.m.speculation_trial_open);
    print_in_trial(
        "steps",
        &in_trial.map(|c| format!("batch {} at {} GB", c.m.batch, c.budget_gb)).collect::<Vec<_>>(),
    );
    for x in &r.ratios {
        println!(
            "batch at {} GB: batch {} decodes {:.2}x the tokens/s of batch 1",
            x.budget_gb, x.batch, x.tokens_per_second_vs_batch_1
        );
    }
    for c in r.cells.iter().filter(|c| c.m.batch == r.cells.iter().map(|c| c.m.batch).max().unwrap_or(0)) {
        if let Some(plan) = &c.m.plan {
            println!("at {} GB, batch {}: {}", c.budget_gb, c.m.batch, plan.describe());
        }
    }
    println!(
        "experts/L: distinct experts per MoE layer per step as the expert pool counted them (resident, in flight or \
         read); expected: E(1-(1-k/E)^B) for uniform routing; reads/L: those read"
    );
    println!(
        "check: seconds per step the compute threads spent checking experts against their checksums (on by \
         default, --no-verify-experts turns it off; not in the bounds)"
    );
    println!(
        "compute: the resident compute of one step of B rows; bound = max((trunk + expert bytes per step) / dev GB/s, \
         compute); effic. = bound / s/step"
    );
    println!(
        "bound*: the bound without routing prediction (a layer's expert reads overlap only the expert compute after \
         its router: the rest of the resident step plus the expert reads); effic* = bound* / s/step"
    );
    println!(
        "bound_h: the bound with the read tax charged, max(bytes / dev GB/s, compute + s/GB x bytes); eff_h = bound_h / \
         s/step; eff_hs: against the same bound when the device also reads at the read-tax stream's rate beside \
         compute (bound_shared_host_seconds_per_step in --json)"
    );
    print_attribution(r);
    println!(
        "ids of every batch cell (every repeat) and of the resident batches equal their solo runs: {}",
        if r.ids_match_solo { "yes" } else { "NO" }
    );
}

/// Each size's resident step per operation class.
fn print_attribution(r: &BatchReport) {
    for (b, table) in &r.resident_attribution {
        println!(
            "resident step of {b} sequences by operation class (GB/s, GFLOP/s: weight bytes and flops over the \
             class's time; triad, FMA: of the triad and the FMA peak; roof s: the longer of the two limits):"
        );
        for line in table.lines() {
            println!("  {line}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{bounds, median_runs, BatchMeasurement, Bounds};

    fn step(trunk_bytes: f64, expert_bytes: f64) -> BatchMeasurement {
        BatchMeasurement {
            trunk_bytes_per_step: trunk_bytes,
            expert_bytes_per_step: expert_bytes,
            ..Default::default()
        }
    }

    #[test]
    fn the_bound_without_prediction_puts_expert_reads_after_the_compute_they_cannot_overlap() {
        // Trunk streamed: 5 GB per step at 2 GB/s bounds the step; the expert reads fit in it.
        let streamed = bounds(&step(4e9, 1e9), 2e9, (1.0, Some(0.4)));
        assert_eq!(streamed, Bounds { bound: 2.5, by: "device", no_prediction: Some(2.5) });
        // Trunk pinned: compute bounds the step, but without prediction 0.6 s of it runs
        // before any expert read may start, and the 0.5 s of reads add to it.
        let pinned = bounds(&step(0.0, 1e9), 2e9, (1.0, Some(0.4)));
        assert_eq!(pinned, Bounds { bound: 1.0, by: "compute", no_prediction: Some(1.1) });
        assert_eq!(bounds(&step(0.0, 1e9), 2e9, (1.0, None)).no_prediction, None, "no spans, no bound*");
    }

    #[test]
    fn each_size_keeps_its_median_run_whole() {
        let samples = [(1, 3.0, Some(0.3)), (4, 5.0, Some(2.0)), (1, 1.0, Some(0.9)), (1, 2.0, Some(0.1))];
        // The median run of size 1 is the 2.0 s one, with its own 0.1 s (the median of the
        // overlappable parts alone would be 0.3, from another run).
        assert_eq!(median_runs(&samples, &[1, 4, 16]), [(1, 2.0, Some(0.1)), (4, 5.0, Some(2.0)), (16, 0.0, None)]);
    }
}
