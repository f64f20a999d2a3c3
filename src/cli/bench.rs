//! `k3ring bench`: the engine against the machine's own limits, measured in one invocation.
//!
//! 1. The device: random O_DIRECT reads of one expert's size at queue depths 1, 4, 16, 32 on the
//!    checkpoint's own files (fio's randread method). 2. Memory bandwidth (STREAM triad).
//! 3. Resident compute: s/token with every weight in RAM. 4. For each budget and mode: s/token,
//!    bytes per token, read rate, overlap, the floor max(bytes / device rate, resident compute),
//!    efficiency = floor / measured, speedup = serial / pipelined; and the floor without routing
//!    prediction (`floor*`), which adds that a layer's expert reads can overlap only the
//!    experts' compute (the resident run measures that part from its trace spans). 5. Ids
//!    identical everywhere.

use std::path::PathBuf;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use super::svg::{line_chart, Series};
use crate::checkpoint::CheckpointIndex;
use crate::config::Config;
use crate::engine::measure::{
    drop_page_cache, measure_resident, measure_streaming, triad_bandwidth, warm_page_cache, MeasureSpec, Measurement,
};
use crate::engine::StreamingRun;
use crate::error::UsageError;
use crate::pipeline::{IoKind, IoOptions, Mode, PipelineOptions, Speculation};
use crate::storage::io::probe::random_read_rate;
use crate::storage::plan::GB;
use crate::storage::stream::StoreOptions;
use crate::tokenizer::Tokenizer;

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Model directory.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Trunk pack directory (`k3ring pack`).
    #[arg(long, value_name = "DIR")]
    pub trunk: PathBuf,
    /// Budgets in GB, e.g. 6,9,12.
    #[arg(long, value_name = "GB,...", value_delimiter = ',', required = true)]
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
    /// Tokens decoded before measuring.
    #[arg(long, value_name = "N", default_value_t = 2)]
    pub warmup: usize,
    /// Compute threads (0 = every core).
    #[arg(long, value_name = "N", default_value_t = 0)]
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
    /// Write the results as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write a plot of s/token against budget per mode.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
}

#[derive(Serialize)]
struct Cell {
    budget_gb: f64,
    mode: String,
    #[serde(flatten)]
    m: Measurement,
    /// The device's random-read rate at the engine's queue depth while this budget's cells ran:
    /// the better of the probes taken before each repeat and after the last one.
    device_read_rate_during: f64,
    floor_seconds_per_token: f64,
    efficiency: f64,
    /// The floor without routing prediction (`None` when the resident run measured no spans): a
    /// layer's expert reads start at its router and must end before its weighted sum, so they
    /// overlap only the shared and routed experts' compute. A bound for the cells that do not
    /// predict (serial, no-spec); the predicting ones can beat it.
    /// `max(floor, the rest of the resident compute + expert bytes / device rate)`.
    floor_no_prediction_seconds_per_token: Option<f64>,
    efficiency_no_prediction: Option<f64>,
    read_rate_vs_device: f64,
}

#[derive(Serialize)]
struct Report {
    /// The better of the two probes, per queue depth.
    device_read_rate: Vec<(u32, f64)>,
    device_read_rate_before: Vec<(u32, f64)>,
    device_read_rate_after: Vec<(u32, f64)>,
    memory_bandwidth: f64,
    resident_seconds_per_token: f64,
    /// The part of the resident compute that expert reads can overlap without routing
    /// prediction: the shared and routed experts, after each router.
    resident_overlappable_seconds_per_token: Option<f64>,
    page_cache_dropped: bool,
    cells: Vec<Cell>,
    /// Per budget: serial s/token over pipelined (the default).
    speedups: Vec<(f64, f64)>,
    /// Per budget: no-spec s/token over pipelined (above 1: speculation gained).
    speculation_gains: Vec<(f64, f64)>,
    ids_identical: bool,
}

pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    let kernels = super::kernels_for("auto")?;
    let cfg = Config::from_model_dir(&args.model)?;
    let index = CheckpointIndex::open(&args.model)?;
    let tok = Tokenizer::from_model_dir(&args.model)?;
    let prompt = tok.encode(&args.prompt)?;
    if prompt.is_empty() {
        return Err(UsageError("--prompt encodes to zero tokens".into()).into());
    }
    let spec = MeasureSpec { prompt, warmup: args.warmup, tokens: args.tokens, prefill_chunk: 32 };
    let threads =
        if args.threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { args.threads };
    let cells_total = args.budgets.len() * args.modes.len() * args.repeats.max(1);
    let bar = ProgressBar::new((cells_total + 3) as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} bench [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );

    bar.set_message("device: random reads of one expert");
    let files: Vec<PathBuf> = index.shards.iter().map(|s| s.path.clone()).collect();
    let ranges: Vec<(usize, u64, u64)> =
        index.shards.iter().enumerate().map(|(i, s)| (i, s.data_start, s.file_len)).collect();
    let probe_device = |pass: u64| -> anyhow::Result<Vec<(u32, f64)>> {
        let mut rates = Vec::new();
        for qd in [1u32, 4, 16, 32] {
            let seed = 0x5eed + u64::from(qd) + 1000 * pass;
            let rate = random_read_rate(&files, &ranges, cfg.expert_bytes() as usize, qd, args.device_reads, seed)
                .context("measuring the device")?;
            rates.push((qd, rate));
        }
        Ok(rates)
    };
    let device_before = probe_device(0)?;
    bar.inc(1);
    bar.set_message("memory bandwidth");
    let membw = triad_bandwidth(threads);
    bar.inc(1);
    bar.set_message("resident compute (every weight in RAM)");
    warm_page_cache(&files).context("reading the model into the page cache")?;
    let (resident, residents_agree) = resident_median(args, kernels, &spec)?;
    bar.inc(1);

    // This VM's disk varies by 30% or more over minutes, and up to 2x within a run, so each
    // budget's floor uses the device as probed around its own cells (at the engine's queue
    // depth, before each repeat and after the last), taking the better probe so that
    // efficiencies are not flattered.
    let qd_probe = [1u32, 4, 16, 32].into_iter().rev().find(|q| *q <= args.queue_depth).unwrap_or(1);
    let mut probes = 0u64;
    let mut probe_during = || -> anyhow::Result<f64> {
        probes += 1;
        let seed = 0x0b5e_55ed + probes;
        random_read_rate(&files, &ranges, cfg.expert_bytes() as usize, qd_probe, args.device_reads, seed)
            .context("measuring the device between cells")
    };
    let (cells_raw, dropped) = measure_cells(args, kernels, &spec, &bar, &mut probe_during)?;
    bar.set_message("device again");
    let device_after = probe_device(1)?;
    bar.finish_and_clear();
    let device: Vec<(u32, f64)> = device_before.iter().zip(&device_after).map(|(a, b)| (a.0, a.1.max(b.1))).collect();
    let cells: Vec<Cell> = cells_raw.into_iter().map(|raw| cell(raw, &resident)).collect();
    let ids_identical = residents_agree && cells.iter().all(|c| c.m.ids == resident.ids);
    let (speedups, speculation_gains) = (ratios(args, &cells, "serial"), ratios(args, &cells, "no-spec"));
    let report = Report {
        device_read_rate: device,
        device_read_rate_before: device_before,
        device_read_rate_after: device_after,
        memory_bandwidth: membw,
        resident_seconds_per_token: resident.seconds_per_token,
        resident_overlappable_seconds_per_token: resident.overlappable_seconds_per_token,
        page_cache_dropped: dropped,
        cells,
        speedups,
        speculation_gains,
        ids_identical,
    };
    print_report(&report, &cfg, args);
    write_outputs(&report, args)?;
    if !report.ids_identical {
        anyhow::bail!("generated ids differ between cells: the output must not depend on budget or mode");
    }
    Ok(())
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

/// Per budget: the s/token of mode `over` divided by the default's (pipelined).
fn ratios(args: &BenchArgs, cells: &[Cell], over: &str) -> Vec<(f64, f64)> {
    let get =
        |b: f64, mode: &str| cells.iter().find(|c| c.budget_gb == b && c.mode == mode).map(|c| c.m.seconds_per_token);
    args.budgets.iter().filter_map(|&b| Some((b, get(b, over)? / get(b, "pipelined")?))).collect()
}

/// `--json` and `--svg`.
fn write_outputs(report: &Report, args: &BenchArgs) -> anyhow::Result<()> {
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(report)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
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
        std::fs::write(path, line_chart("k3ring bench: s/token by memory budget", "budget (GB)", "s/token", &series))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// One cell's floors and ratios from its median sample and the resident measurement.
fn cell((budget_gb, mode, m, device_rate): CellResult, resident: &Measurement) -> Cell {
    let bytes = m.trunk_bytes_per_token + m.expert_bytes_per_token;
    let floor = (bytes / device_rate).max(resident.seconds_per_token);
    let floor_no_prediction = resident.overlappable_seconds_per_token.map(|o| {
        let never_overlapped = resident.seconds_per_token - o;
        floor.max(never_overlapped + m.expert_bytes_per_token / device_rate)
    });
    Cell {
        budget_gb,
        efficiency: floor / m.seconds_per_token,
        efficiency_no_prediction: floor_no_prediction.map(|f| f / m.seconds_per_token),
        floor_no_prediction_seconds_per_token: floor_no_prediction,
        mode,
        read_rate_vs_device: m.read_rate_busy / device_rate,
        device_read_rate_during: device_rate,
        floor_seconds_per_token: floor,
        m,
    }
}

/// Budget (GB), mode, and what was measured.
type CellSample = (f64, String, Measurement);

/// A cell's median sample and the device rate (bytes/s) probed around its budget's runs.
type CellResult = (f64, String, Measurement, f64);

/// Every (budget, mode) cell, `repeats` times with the modes alternating, reduced to the
/// median sample per cell (slow phases of the VM's disk then hit every mode alike).
/// `probe_device` (bytes/s at the engine's queue depth) runs before each repeat of a budget and
/// after its last; the better probe is that budget's device rate. Returns the cells and whether
/// the page cache could be dropped before every run.
fn measure_cells(
    args: &BenchArgs,
    kernels: kernels::Kernels,
    spec: &MeasureSpec,
    bar: &ProgressBar,
    probe_device: &mut dyn FnMut() -> anyhow::Result<f64>,
) -> anyhow::Result<(Vec<CellResult>, bool)> {
    let mut samples: Vec<CellSample> = Vec::new();
    let mut device_rates: Vec<(f64, f64)> = Vec::new();
    let mut dropped = true;
    let repeats = args.repeats.max(1);
    for &budget in &args.budgets {
        let mut best = 0.0f64;
        for rep in 0..repeats {
            bar.set_message(format!("{budget} GB: device ({}/{repeats})", rep + 1));
            best = best.max(probe_device()?);
            for mode in &args.modes {
                bar.set_message(format!("{budget} GB {mode} ({}/{repeats})", rep + 1));
                dropped &= drop_page_cache();
                let run = cell_run(args, spec, budget, mode);
                let m = measure_streaming(&args.model, &args.trunk, &run, kernels, spec)
                    .with_context(|| format!("budget {budget} GB, mode {mode}"))?;
                samples.push((budget, mode.clone(), m));
                bar.inc(1);
            }
        }
        bar.set_message(format!("{budget} GB: device after"));
        best = best.max(probe_device()?);
        device_rates.push((budget, best));
    }
    let mut cells = Vec::new();
    for &(budget, device_rate) in &device_rates {
        for mode in &args.modes {
            let mut runs: Vec<Measurement> =
                samples.iter().filter(|s| s.0 == budget && &s.1 == mode).map(|s| s.2.clone()).collect();
            runs.sort_by(|a, b| a.seconds_per_token.total_cmp(&b.seconds_per_token));
            if let Some(m) = runs.get(runs.len() / 2).cloned() {
                cells.push((budget, mode.clone(), m, device_rate));
            }
        }
    }
    Ok((cells, dropped))
}

/// The streaming run of one cell: serial is the C engine's order (no read-ahead, no overlap of
/// a layer's reads with its compute); no-spec pipelines without prediction; pipelined is the
/// default (adaptive prediction); fixed-spec reads every prediction.
fn cell_run(args: &BenchArgs, spec: &MeasureSpec, budget: f64, mode: &str) -> StreamingRun {
    let serial = mode == "serial";
    let speculation = match mode {
        "pipelined" => Speculation::default(),
        "fixed-spec" => Speculation { adaptive: false, ..Speculation::default() },
        _ => Speculation::OFF,
    };
    StreamingRun {
        budget_bytes: (budget * GB) as u64,
        context: spec.prompt.len() + spec.warmup + spec.tokens + 1,
        chunk: spec.prefill_chunk,
        threads: args.threads,
        store: StoreOptions { readahead: 1, ..StoreOptions::default() },
        pipeline: PipelineOptions {
            io: IoOptions { kind: IoKind::Uring, queue_depth: args.queue_depth, ..IoOptions::default() },
            mode: if serial { Mode::Serial } else { Mode::Pipelined },
            speculation,
        },
        prefetch_window: None,
        placement: None,
        trace_detail: false,
        trunk_share: None,
    }
}

fn print_report(r: &Report, cfg: &Config, args: &BenchArgs) {
    let rates =
        |v: &[(u32, f64)]| v.iter().map(|(q, v)| format!("QD{q} {:.2}", v / 1e9)).collect::<Vec<_>>().join(", ");
    println!(
        "device (random O_DIRECT reads of {:.1} MB): {} GB/s (before the cells {}, after {})",
        cfg.expert_bytes() as f64 / 1e6,
        rates(&r.device_read_rate),
        rates(&r.device_read_rate_before),
        rates(&r.device_read_rate_after)
    );
    println!("memory bandwidth (triad): {:.1} GB/s", r.memory_bandwidth / 1e9);
    match r.resident_overlappable_seconds_per_token {
        Some(o) => println!(
            "resident compute: {:.3} s/token ({o:.3} of it shared and routed experts, which expert reads can overlap)",
            r.resident_seconds_per_token
        ),
        None => println!("resident compute: {:.3} s/token", r.resident_seconds_per_token),
    }
    println!(
        "page cache: {}",
        if r.page_cache_dropped { "dropped before every cell" } else { "not dropped (not root); reads are O_DIRECT" }
    );
    println!(
        "{:>7} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7} {:>8} {:>7} {:>7} {:>10}",
        "budget",
        "mode",
        "s/token",
        "trunk/tok",
        "exp/tok",
        "read GB/s",
        "dev GB/s",
        "overlap",
        "floor",
        "effic.",
        "floor*",
        "effic.*",
        "recall",
        "wasted/tok"
    );
    let or_dash = |v: Option<f64>, width: usize, prec: usize| match v {
        Some(v) => format!("{v:>width$.prec$}"),
        None => format!("{:>width$}", "-"),
    };
    for c in &r.cells {
        println!(
            "{:>6}G {:>10} {:>9.3} {:>8.2}G {:>8.2}G {:>9.2} {:>9.2} {:>7.0}% {:>8.3} {:>7.2} {} {} {:>6.0}% {:>9.2}G",
            c.budget_gb,
            c.mode,
            c.m.seconds_per_token,
            c.m.trunk_bytes_per_token / 1e9,
            c.m.expert_bytes_per_token / 1e9,
            c.m.read_rate_busy / 1e9,
            c.device_read_rate_during / 1e9,
            100.0 * c.m.overlap_fraction,
            c.floor_seconds_per_token,
            c.efficiency,
            or_dash(c.floor_no_prediction_seconds_per_token, 8, 3),
            or_dash(c.efficiency_no_prediction, 7, 2),
            100.0 * c.m.recall,
            c.m.spec_wasted_bytes_per_token / 1e9
        );
    }
    for (b, s) in &r.speedups {
        println!("speedup at {b} GB: pipelined is {s:.2}x serial");
    }
    for (b, s) in &r.speculation_gains {
        println!("speculation at {b} GB: pipelined is {s:.2}x no-spec");
    }
    println!("dev GB/s: the device at the engine's queue depth, probed around each budget's cells (the floor uses it)");
    println!(
        "floor*: the floor without routing prediction: a layer's expert reads start at its router, so they overlap \
         only the experts' compute (cells that predict routing can beat it)"
    );
    println!("ids identical in every cell and resident: {}", if r.ids_identical { "yes" } else { "NO" });
    let _ = args;
}
