//! `k3ring bench`: the engine against the machine's own limits, measured in one invocation.
//!
//! 1. The device: random O_DIRECT reads of one expert's size at queue depths 1, 4, 16, 32 on the
//!    checkpoint's own files (fio's randread method). 2. Memory bandwidth (STREAM triad).
//! 3. Resident compute: s/token with every weight in RAM. 4. For each budget and mode: s/token,
//!    bytes per token, read rate, overlap, the floor max(bytes / device rate, resident compute),
//!    efficiency = floor / measured, speedup = serial / pipelined; and the floor without routing
//!    prediction (`floor*`), which adds that a layer's expert reads can overlap only the
//!    experts' compute (the resident run measures that part from its trace spans). 5. Ids
//!    identical everywhere. 6. With `--batch`, cells of B sequences decoding together
//!    (`bench_batch`), alternated with the mode cells.

use std::path::PathBuf;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

mod cells;
mod draft_cells;
mod print;

use super::bench_batch::{self, BatchReport, BatchWork};
use super::bench_host::{self, host_floors, ExpertReads, Host, HostFloors};
use super::svg::{line_chart, Series};
use crate::checkpoint::CheckpointIndex;
use crate::config::Config;
use crate::engine::measure::{fma_peak, measure_resident, triad_bandwidth, warm_page_cache, MeasureSpec, Measurement};
use crate::engine::read_tax::ReadTax;
use crate::error::UsageError;
use crate::model::attribution::AttributionTable;
use crate::pipeline::IoKind;
use crate::storage::stream::policy::{DEFAULT_POLICY, POLICY_NAMES};
use crate::tokenizer::Tokenizer;
use cells::{cell_io, measure_cells, CellPlan, CellResult, DeviceRate, RoundResident};
use clap::builder::PossibleValuesParser;
use draft_cells::DraftCells;
use print::print_report;
pub(super) use print::{or_dash, print_in_trial};

#[derive(Debug, clap::Args)]
#[command(allow_negative_numbers = true, args_override_self = true)]
pub struct BenchArgs {
    /// Model directory.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Trunk pack directory (`k3ring pack`).
    #[arg(long, value_name = "DIR")]
    pub trunk: PathBuf,
    /// Budgets in GB, e.g. 6,9,12.
    #[arg(long, value_name = "GB,...", value_delimiter = ',', required = true, value_parser = super::parse_gb)]
    pub budgets: Vec<f64>,
    /// Modes to compare: serial (the C engine's order), no-spec (pipelined, experts read once
    /// routed), pipelined (the default: plus adaptive expert prediction), fixed-spec (every
    /// prediction read, no admission control).
    #[arg(long, value_name = "MODE,...", value_delimiter = ',', default_value = "serial,no-spec,pipelined", value_parser = ["serial", "no-spec", "pipelined", "fixed-spec"])]
    pub modes: Vec<String>,
    /// Measure each cell, and the resident compute, this many times (the modes alternating) and
    /// keep the median.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub repeats: usize,
    /// Tokens measured per cell.
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub tokens: usize,
    /// Tokens decoded before measuring (default: until speculation's first trial has decided,
    /// so that pipelined cells measure the setting each layer settles on).
    #[arg(long, value_name = "N", default_value_t = crate::pipeline::trial::DECODE_PASSES_TO_FIRST_DECISION)]
    pub warmup: usize,
    /// Compute threads (0 = every core).
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = super::parse_threads)]
    pub threads: usize,
    /// Engine queue depth.
    #[arg(long, value_name = "Q", default_value_t = 32)]
    pub queue_depth: u32,
    /// Random reads per queue depth when measuring the device.
    #[arg(long, value_name = "N", default_value_t = 128)]
    pub device_reads: usize,
    /// Prompt text.
    #[arg(long, value_name = "TEXT", default_value = "The quick brown fox")]
    pub prompt: String,
    /// Write the results as JSON to FILE ("-": to stdout, instead of the table).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Keep the page cache: by default, when run as root, bench drops the whole system's page
    /// cache (`/proc/sys/vm/drop_caches`) before every cell, so no cell reads what an earlier
    /// one left cached.
    #[arg(long)]
    pub no_drop_caches: bool,
    /// Write a plot of s/token against budget per mode.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Batch sizes, e.g. 1,4,16: adds a cell per budget and size of that many sequences decoding
    /// together (distinct prompts, greedy, --tokens steps after --warmup), alternated with the
    /// mode cells, with each sequence's ids checked against its solo run.
    #[arg(long, value_name = "B,...", value_delimiter = ',', value_parser = bench_batch::parse_batch)]
    pub batch: Vec<usize>,
    /// Do not check experts read from the shards against their checksums (as `run
    /// --no-verify-experts`), to see what the check costs.
    #[arg(long)]
    pub no_verify_experts: bool,
    /// How every cell holds the trunk its budget pins (as `run --trunk-pins`).
    #[arg(long, value_name = "HOW", value_enum, default_value_t = super::TrunkPins::Spread)]
    pub trunk_pins: super::TrunkPins,
    /// Expert cache policy of every cell (as `run --policy`).
    #[arg(long, value_name = "NAME", default_value = DEFAULT_POLICY, value_parser = PossibleValuesParser::new(POLICY_NAMES))]
    pub policy: String,
    /// The backend every cell and probe reads through: uring (the disk), or drives modeled in
    /// real time over the page cache, sim:RATE[,LATENCY][,qdQ][xN] (e.g. `sim:7GB/s,80us x4`).
    #[arg(long = "io", value_name = "BACKEND", default_value = "uring", value_parser = super::parse_io)]
    pub io: String,
    /// With `pack --experts-to` files and `--io sim:`: the modeled drives of each expert
    /// directory, one flag per directory in the pack's order (as `run --device-io`).
    #[arg(long = "device-io", value_name = "BACKEND", value_parser = super::parse_io)]
    pub device_io: Vec<String>,
    /// Measure the resident compute once, before the cells, instead of beside each repeat of
    /// each budget's cells (faster; every cell's floors then use that one run, whatever the
    /// host's speed when the cell ran).
    #[arg(long)]
    pub resident_once: bool,
    /// Skip the read-tax probe (resident decode with and without a stream of reads beside it);
    /// the host floors are then not computed.
    #[arg(long)]
    pub no_read_tax: bool,
    /// Adds a cell per budget that drafts by n-gram lookup (`run --draft ngram`), and one whose
    /// every guess is wrong under the n-gram drafter's back-off (`draft-miss`: what drafting
    /// costs on text that never repeats itself), compared with the pipelined cell.
    #[arg(long)]
    pub draft_ngram: bool,
    /// Adds a cell per budget and acceptance (percent, e.g. 0,25,50,75,100) that drafts by
    /// replaying a recorded plain run with one guess of each step wrong so that that share of
    /// the guesses is kept: what drafting gains and costs whatever the model's own text.
    #[arg(long, value_name = "PCT,...", value_delimiter = ',', value_parser = draft_cells::parse_percent)]
    pub draft_accept: Vec<u32>,
    /// Tokens guessed per step in the drafted cells (at most, with --draft-adaptive).
    #[arg(long, value_name = "K", default_value_t = crate::engine::draft::DEFAULT_DRAFT_LEN)]
    pub draft_len: usize,
    /// The --draft-accept cells choose their draft length as the shipped drafter does (by tokens
    /// per second, up to --draft-len; named draft-adaptive-P%) rather than drafting --draft-len
    /// tokens every step (the verify pass's cost at that length).
    #[arg(long)]
    pub draft_adaptive: bool,
}

#[derive(Serialize)]
struct Cell {
    budget_gb: f64,
    mode: String,
    #[serde(flatten)]
    m: Measurement,
    /// The device's rate at the engine's queue depth while this budget's cells ran: the better
    /// of the probes taken before each repeat and after the last one and of the cells' own busy
    /// read rates ([`DeviceRate`]).
    device_read_rate_during: f64,
    floor_seconds_per_token: f64,
    efficiency: f64,
    /// The resident compute the floors use: the resident run beside the repeat of this cell's
    /// median sample, or the one before the cells with `--resident-once`.
    floor_resident_seconds_per_token: f64,
    /// Of that run, the part expert reads can overlap without routing prediction.
    floor_resident_overlappable_seconds_per_token: Option<f64>,
    /// The floor without routing prediction (`None` when the resident run measured no spans): a
    /// layer's expert reads start at its router and must end before its weighted sum, so they
    /// overlap only the shared and routed experts' compute. A bound for the cells that do not
    /// predict (serial, no-spec); the predicting ones can beat it.
    /// `max(floor, the rest of the resident compute + expert bytes / device rate)`.
    floor_no_prediction_seconds_per_token: Option<f64>,
    efficiency_no_prediction: Option<f64>,
    /// The cell's busy read rate over the best probe around its budget's cells (not over the
    /// rate its floor uses, which is at least every cell's busy rate): above 1, the cell read
    /// faster than random expert-sized reads did.
    read_rate_vs_device: f64,
    /// The floors with the read tax charged, and where the time goes (absent with
    /// `--no-read-tax`).
    #[serde(flatten)]
    host: Option<HostFloors>,
}

#[derive(Serialize)]
struct Report {
    /// The CPU, ISA and backend the table was measured with.
    host: Host,
    /// What a read in flight costs compute here (`None` with `--no-read-tax`).
    read_tax: Option<ReadTax>,
    /// The better of the two probes, per queue depth.
    device_read_rate: Vec<(u32, f64)>,
    /// What the probes read: the shards, or the expert files of `pack --experts-to`.
    device_probe_source: String,
    device_read_rate_before: Vec<(u32, f64)>,
    device_read_rate_after: Vec<(u32, f64)>,
    /// The better of the triads measured right before and right after the resident cell.
    memory_bandwidth: f64,
    memory_bandwidth_before: f64,
    memory_bandwidth_after: f64,
    /// The FMA peak of the kernels' ISA on the compute threads (`None` for scalar kernels).
    fma_peak_flops_per_second: Option<f64>,
    resident_seconds_per_token: f64,
    /// The resident runs beside each repeat of each budget's cells (empty with
    /// `--resident-once`), whose floors use them.
    resident_by_repeat: Vec<RoundResident>,
    /// The part of the resident compute that expert reads can overlap without routing
    /// prediction: the shared and routed experts, after each router.
    resident_overlappable_seconds_per_token: Option<f64>,
    /// The layers with routed experts, which share the overlappable compute equally in the
    /// floor without prediction (each layer's reads overlap its own share).
    resident_moe_layers: usize,
    /// The resident run per operation class (issue 19): s/token, weight bytes per token and
    /// GB/s against `memory_bandwidth`; the rows sum to `resident_seconds_per_token`.
    resident_attribution: Option<AttributionTable>,
    page_cache_dropped: bool,
    /// Experts read from the shards were checked against their checksums (the default; false
    /// with `--no-verify-experts`).
    experts_checked: bool,
    /// The expert cache policy of the cells (`--policy`).
    expert_cache_policy: String,
    /// Per budget: the device probe, the cells' own busy read rate and the better of the two,
    /// which that budget's floors and bounds use.
    device_rates_by_budget: Vec<DeviceRate>,
    cells: Vec<Cell>,
    /// Per budget: serial s/token over pipelined (the default).
    speedups: Vec<(f64, f64)>,
    /// Per budget: no-spec s/token over pipelined (above 1: speculation gained).
    speculation_gains: Vec<(f64, f64)>,
    ids_identical: bool,
    /// The batch cells (`--batch`).
    #[serde(skip_serializing_if = "Option::is_none")]
    batch: Option<BatchReport>,
    /// Per budget and drafted cell: what drafting did against the pipelined cell.
    drafting: Vec<DraftGain>,
}

/// A drafted cell against the pipelined cell of its budget.
#[derive(Serialize)]
struct DraftGain {
    budget_gb: f64,
    mode: String,
    /// The measured window's steps and guesses.
    stats: crate::engine::DraftStats,
    /// Pipelined s/token over this cell's (above 1: drafting is faster).
    speedup: f64,
    /// Pipelined bytes read per token over this cell's (above 1: drafting reads less).
    bytes_ratio: f64,
}

/// The drafted cells against their budgets' pipelined cells.
fn draft_gains(cells: &[Cell]) -> Vec<DraftGain> {
    let bytes = |c: &Cell| c.m.trunk_bytes_per_token + c.m.expert_bytes_per_token;
    cells
        .iter()
        .filter_map(|c| {
            let stats = c.m.draft?;
            let plain = cells.iter().find(|p| p.budget_gb == c.budget_gb && p.mode == "pipelined")?;
            Some(DraftGain {
                budget_gb: c.budget_gb,
                mode: c.mode.clone(),
                stats,
                speedup: plain.m.seconds_per_token / c.m.seconds_per_token,
                bytes_ratio: bytes(plain) / bytes(c).max(1.0),
            })
        })
        .collect()
}

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    bench_batch::check_sizes(&args.batch)?;
    let json = open_outputs(args)?;
    let kernels = super::kernels_for("auto")?;
    let cfg = Config::from_model_dir(&args.model)?;
    let index = CheckpointIndex::open(&args.model)?;
    // Before the device probe reads expert-sized blocks: the sizes must match the checkpoint.
    index.validate(&cfg)?;
    let tok = Tokenizer::from_model_dir(&args.model)?;
    let prompt = tok.encode(&args.prompt)?;
    if prompt.is_empty() {
        return Err(UsageError("--prompt encodes to zero tokens".into()).into());
    }
    let spec = MeasureSpec { prompt, warmup: args.warmup, tokens: args.tokens, prefill_chunk: 32 };
    let batch = BatchWork::new(args, &tok, &spec)?;
    let threads =
        if args.threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { args.threads };
    let mut drafts = DraftCells::new(args.draft_len, args.draft_ngram, &args.draft_accept, args.draft_adaptive)?;
    let modes: Vec<String> = args.modes.iter().cloned().chain(drafts.modes()).collect();
    let bar = progress_bar(args, modes.len(), batch.is_some());
    let io = bench_io(&args.io, &args.device_io)?;
    let host = Host::detect(kernels, io);

    bar.set_message("device: random reads of one expert");
    let (files, ranges): (Vec<PathBuf>, _) =
        (index.shards.iter().map(|s| s.path.clone()).collect(), bench_host::probe_ranges(&index, io));
    let probed = bench_host::probe_target(&index, &args.trunk, io)?;
    bench_host::warm_for_probes(&probed.files, &probed.ranges, io, cfg.expert_bytes())?;
    let probe_device = |pass| probe_queue_depths(&probed, io, cfg.expert_bytes() as usize, args.device_reads, pass);
    let device_before = probe_device(0)?;
    bar.inc(1);
    bar.set_message("memory bandwidth and FMA peak");
    let (membw_before, fma_peak) = (triad_bandwidth(threads), fma_peak(kernels, threads));
    bar.inc(1);
    bar.set_message("resident compute (every weight in RAM)");
    warm_page_cache(&files).context("reading the model into the page cache")?;
    let (resident, residents_agree) = resident_median(args, kernels, &spec)?;
    // The VM's memory bandwidth moves by 20% or more over minutes: the resident cell's floor
    // takes the better of the triads on either side of it, so that its fraction of the floor
    // is not flattered by a slow moment of the triad.
    let membw_after = triad_bandwidth(threads);
    let membw = membw_before.max(membw_after);
    bar.inc(1);
    bar.set_message("read tax: resident compute quiet and beside a stream of reads");
    let tax = (!args.no_read_tax)
        .then(|| {
            let stream = (&files[..], &ranges[..], &cell_io(args, io), cfg.expert_bytes() as usize);
            bench_host::read_tax(&args.model, kernels, args.threads, &spec, stream, args.repeats)
        })
        .transpose()?;
    bar.inc(1);
    bar.set_message("a plain run for the replayed drafts, solo runs and resident batches");
    drafts.record(&args.model, kernels, args.threads, &spec)?;
    let resident_batch = batch.as_ref().map(|work| bench_batch::measure_resident(args, kernels, work)).transpose()?;
    bar.inc(u64::from(batch.is_some()));

    // This VM's disk varies by 30% or more over minutes, and up to 2x within a run, so each
    // budget's floor uses the device as probed around its own cells (at the engine's queue
    // depth, before each repeat and after the last) or as its cells read it, whichever was
    // faster, so that efficiencies are not flattered ([`DeviceRate`]).
    let qd_probe = [1u32, 4, 16, 32].into_iter().rev().find(|q| *q <= args.queue_depth).unwrap_or(1);
    let mut probes = 0u64;
    let mut probe_during = || -> anyhow::Result<f64> {
        probes += 1;
        let seed = 0x0b5e_55ed + probes;
        bench_host::device_rate(&probed, io, cfg.expert_bytes() as usize, qd_probe, args.device_reads, seed)
            .context("measuring the device between cells")
    };
    let plan = CellPlan { shards: &files, modes: &modes, drafts: &drafts, batch: batch.as_ref() };
    let measured = measure_cells(args, io, kernels, &spec, &plan, &bar, &mut probe_during)?;
    bar.set_message("device again");
    let device_after = probe_device(1)?;
    bar.finish_and_clear();
    let device: Vec<(u32, f64)> = device_before.iter().zip(&device_after).map(|(a, b)| (a.0, a.1.max(b.1))).collect();
    let cells: Vec<Cell> = measured.cells.into_iter().map(|raw| cell(raw, &resident, tax.as_ref())).collect();
    let batch_report = batch.as_ref().zip(resident_batch).map(|(work, r)| {
        let rates: Vec<(f64, f64)> = measured.device_rate_sources.iter().map(|d| (d.budget_gb, d.used)).collect();
        bench_batch::report(&measured.batch_samples, &rates, r, work, &cfg, tax.as_ref(), (membw, fma_peak))
    });
    let report = Report {
        ids_identical: residents_agree
            && measured.round_residents.iter().all(|r| r.m.ids == resident.ids)
            && cells.iter().all(|c| same_ids(&c.m, &resident)),
        speedups: ratios(args, &cells, "serial"),
        speculation_gains: ratios(args, &cells, "no-spec"),
        drafting: draft_gains(&cells),
        host,
        read_tax: tax,
        device_read_rate: device,
        device_probe_source: probed.source.clone(),
        device_read_rate_before: device_before,
        device_read_rate_after: device_after,
        memory_bandwidth: membw,
        memory_bandwidth_before: membw_before,
        memory_bandwidth_after: membw_after,
        resident_seconds_per_token: resident.seconds_per_token,
        resident_by_repeat: measured.round_residents,
        resident_overlappable_seconds_per_token: resident.overlappable_seconds_per_token,
        resident_moe_layers: resident.moe_layers,
        fma_peak_flops_per_second: fma_peak,
        resident_attribution: resident.attribution.as_ref().map(|w| w.table(Some(membw), fma_peak)),
        page_cache_dropped: measured.dropped,
        experts_checked: !args.no_verify_experts,
        expert_cache_policy: args.policy.clone(),
        device_rates_by_budget: measured.device_rate_sources.clone(),
        cells,
        batch: batch_report,
    };
    write_outputs(&report, &cfg, args, json.as_ref())?;
    check_ids(&report)
}

/// Whether a cell chose the resident run's ids. A drafted cell's last step may choose tokens
/// past the others' last: its ids start with theirs.
fn same_ids(cell: &Measurement, resident: &Measurement) -> bool {
    cell.ids.get(..resident.ids.len()) == Some(&resident.ids[..])
}

/// Fails the run when any measured output differs: reads, budgets, modes and batches must not
/// change a token.
fn check_ids(report: &Report) -> anyhow::Result<()> {
    if report.read_tax.as_ref().is_some_and(|t| !t.ids_identical) {
        anyhow::bail!(
            "generated ids differ with reads in flight beside resident decode: reads must not change the output"
        );
    }
    if !report.ids_identical {
        anyhow::bail!("generated ids differ between cells: the output must not depend on budget or mode");
    }
    if report.batch.as_ref().is_some_and(|b| !b.ids_match_solo) {
        anyhow::bail!(
            "a sequence's ids in a batch differ from its solo run's: the output must not depend on the batch"
        );
    }
    Ok(())
}

/// `--io`: uring or a modeled device. The probes and the read tax read through io_uring or the
/// model, so a table of cells read through another backend would judge it against their rate.
/// `--io` (and the `--device-io` models it allows), checked.
fn bench_io(io: &str, device_io: &[String]) -> Result<IoKind, UsageError> {
    let kind = IoKind::parse(io).map_err(|e| UsageError(format!("--io {e}")))?;
    if matches!(kind, IoKind::Pread | IoKind::Mmap) {
        return Err(UsageError(format!(
            "--io {io}: bench measures the disk through uring, or a modeled device (sim:RATE...); compare backends with tune --io"
        )));
    }
    super::device_kinds(kind, device_io)?;
    Ok(kind)
}

/// The bar over every cell of every repeat (`modes` of them per budget and repeat, the batch
/// sizes and the resident run beside them), the four measurements before them, and the resident
/// batch steps if `batch`.
fn progress_bar(args: &BenchArgs, modes: usize, batch: bool) -> ProgressBar {
    let per_repeat = modes + args.batch.len() + usize::from(!args.resident_once);
    let steps = args.budgets.len() * per_repeat * args.repeats.max(1) + 4 + usize::from(batch);
    let bar = ProgressBar::new(steps as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} bench [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

/// The device's random read rate of `read_bytes` blocks at queue depths 1, 4, 16 and 32; `pass`
/// picks the offsets' seed, so the probes before and after the cells read different blocks.
fn probe_queue_depths(
    probed: &bench_host::ProbeTarget,
    io: IoKind,
    read_bytes: usize,
    reads: usize,
    pass: u64,
) -> anyhow::Result<Vec<(u32, f64)>> {
    let mut rates = Vec::new();
    for qd in [1u32, 4, 16, 32] {
        let seed = 0x5eed + u64::from(qd) + 1000 * pass;
        let rate = bench_host::device_rate(probed, io, read_bytes, qd, reads, seed).context("measuring the device")?;
        rates.push((qd, rate));
    }
    Ok(rates)
}

/// The resident compute, the median of `--repeats` runs like each cell (both floors use it), and
/// whether every run produced the same ids.
fn resident_median(
    args: &BenchArgs,
    kernels: kernels::Kernels,
    spec: &MeasureSpec,
) -> anyhow::Result<(Measurement, bool)> {
    let mut residents = Vec::new();
    for _ in 0..args.repeats.max(1) {
        residents.push(measure_resident(&args.model, kernels, args.threads, spec)?);
    }
    let agree = residents.iter().all(|r| r.ids == residents[0].ids);
    residents.sort_by(|a, b| a.seconds_per_token.total_cmp(&b.seconds_per_token));
    Ok((residents.swap_remove(residents.len() / 2), agree))
}

/// Creates the output files before any work and says what bench will do to the page cache.
fn open_outputs(args: &BenchArgs) -> anyhow::Result<Option<super::output::JsonOut>> {
    let json = super::output::JsonOut::open(args.json.as_deref())?;
    if let Some(path) = &args.svg {
        super::output::create_now("--svg", path)?;
    }
    if !args.no_drop_caches && args.io.starts_with("sim:") {
        eprintln!("k3ring: bench keeps the page cache: --io sim serves its reads from it");
    } else if !args.no_drop_caches {
        // Said before it happens: it affects every process on the machine, not only bench.
        eprintln!(
            "k3ring: bench drops the whole system's page cache before every cell (when run as root); \
             --no-drop-caches keeps it"
        );
    }
    Ok(json)
}

/// Per budget: the s/token of mode `over` divided by the default's (pipelined).
fn ratios(args: &BenchArgs, cells: &[Cell], over: &str) -> Vec<(f64, f64)> {
    let get =
        |b: f64, mode: &str| cells.iter().find(|c| c.budget_gb == b && c.mode == mode).map(|c| c.m.seconds_per_token);
    args.budgets.iter().filter_map(|&b| Some((b, get(b, over)? / get(b, "pipelined")?))).collect()
}

/// The table (unless `--json -` replaces it), `--json` and `--svg`.
fn write_outputs(
    report: &Report,
    cfg: &Config,
    args: &BenchArgs,
    json: Option<&super::output::JsonOut>,
) -> anyhow::Result<()> {
    if !super::output::JsonOut::is_stdout(json) {
        print_report(report, cfg, args);
    }
    if let Some(out) = json {
        out.write(report)?;
    }
    if let Some(path) = &args.svg {
        let series: Vec<Series> = args
            .modes
            .iter()
            .map(|mode| Series {
                name: mode.clone(),
                points: report
                    .cells
                    .iter()
                    .filter(|c| &c.mode == mode)
                    .map(|c| (c.budget_gb, c.m.seconds_per_token))
                    .collect(),
            })
            .collect();
        let chart = line_chart("k3ring bench: s/token by memory budget", "budget (GB)", "s/token", &series);
        super::output::create_now("--svg", path)?.write_all(chart.as_bytes())?;
    }
    Ok(())
}

/// One cell's floors and ratios from its median sample and the resident run beside it (else
/// `resident`, the one before the cells).
fn cell(raw: CellResult, resident: &Measurement, tax: Option<&ReadTax>) -> Cell {
    let CellResult { budget_gb, mode, m, rate, resident: beside } = raw;
    let resident = beside.as_ref().unwrap_or(resident);
    let device_rate = rate.used;
    let bytes = m.trunk_bytes_per_token + m.expert_bytes_per_token;
    let floor = (bytes / device_rate).max(resident.seconds_per_token);
    let floor_no_prediction = resident.overlappable_seconds_per_token.map(|o| {
        let never_overlapped = resident.seconds_per_token - o;
        floor.max(never_overlapped + ExpertReads::of(&m, resident).routed_seconds(o, device_rate))
    });
    Cell {
        budget_gb,
        efficiency: floor / m.seconds_per_token,
        efficiency_no_prediction: floor_no_prediction.map(|f| f / m.seconds_per_token),
        floor_no_prediction_seconds_per_token: floor_no_prediction,
        mode,
        read_rate_vs_device: m.read_rate_busy / rate.probed,
        device_read_rate_during: device_rate,
        floor_seconds_per_token: floor,
        floor_resident_seconds_per_token: resident.seconds_per_token,
        floor_resident_overlappable_seconds_per_token: resident.overlappable_seconds_per_token,
        host: tax.map(|t| host_floors(&m, resident, device_rate, t)),
        m,
    }
}
