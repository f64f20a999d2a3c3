//! `k3ring tune`: sweeps the pipeline's knobs at a fixed budget and recommends flags.
//!
//! First a grid of trunk/expert split x trunk read-ahead depth with the default speculation
//! (the plot: s/token against read-ahead per split), then, from the best grid point,
//! speculation (off, then the adaptive default and the fixed setting at each margin), queue
//! depth and I/O backend one at a time. Every point must produce the same ids.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use super::budget::name_budget_flag;
use super::svg::{line_chart, Series};
use crate::engine::measure::{measure_streaming, MeasureSpec};
use crate::engine::read_tax::ReadTax;
use crate::engine::StreamingRun;
use crate::error::UsageError;
use crate::pipeline::{IoKind, IoOptions, PipelineOptions, Speculation};
use crate::storage::plan::GB;
use crate::storage::stream::StoreOptions;
use crate::tokenizer::Tokenizer;

#[derive(Debug, clap::Args)]
#[command(allow_negative_numbers = true, args_override_self = true)]
pub struct TuneArgs {
    /// Model directory.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Trunk pack directory.
    #[arg(long, value_name = "DIR")]
    pub trunk: PathBuf,
    /// The fixed memory budget, GB.
    #[arg(long, value_name = "X", value_parser = super::parse_gb)]
    pub mem_gb: f64,
    /// Shares of the budget for pinned trunk, each in (0, 1] (1 = trunk first).
    #[arg(long, value_name = "F,...", value_delimiter = ',', default_value = "0.25,0.5,1", value_parser = parse_split)]
    pub splits: Vec<f64>,
    /// Trunk read-ahead depths (each 0 to 128).
    #[arg(long, value_name = "N,...", value_delimiter = ',', default_value = "0,1,2", value_parser = super::parse_readahead)]
    pub readahead: Vec<usize>,
    /// Speculation margins (experts beyond top-k), each measured adaptive (the default) and
    /// fixed (every prediction read).
    #[arg(long, value_name = "M,...", value_delimiter = ',', default_value = "0,4")]
    pub spec_margin: Vec<usize>,
    /// Queue depths, each in 1..=4096.
    #[arg(long, value_name = "Q,...", value_delimiter = ',', default_value = "8,32", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub queue_depth: Vec<u32>,
    /// I/O backends: uring, pread, mmap, or a modeled device sim:RATE[,LATENCY][,qdQ][xN] (its
    /// own commas stay with it: `--io uring,sim:7GB/s,80us x4`).
    #[arg(long = "io", value_name = "B,...", default_value = "uring,pread", value_parser = parse_io_list)]
    pub io: IoList,
    /// Tokens measured per point (at least 1).
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = parse_tokens)]
    pub tokens: usize,
    /// Tokens decoded before measuring.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub warmup: usize,
    /// Measurements of each point (1 to 100): its s/token is their median, with the spread,
    /// and the recommendation says whether it leads the next point beyond that spread
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = parse_repeats)]
    pub repeats: usize,
    /// Compute threads (0 = every core).
    #[arg(long, value_name = "N", default_value_t = 0, value_parser = super::parse_threads)]
    pub threads: usize,
    /// Prompt text.
    #[arg(long, value_name = "TEXT", default_value = "The quick brown fox")]
    pub prompt: String,
    /// Write every point as CSV.
    #[arg(long, value_name = "FILE")]
    pub csv: Option<PathBuf>,
    /// Write a plot of s/token against read-ahead depth per split.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
    /// Write the points and the recommendation as JSON to FILE ("-": to stdout, instead of
    /// the table).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Skip the read-tax probe (resident decode quiet and beside a stream of reads through the
    /// first backend; measured by default when the model fits in memory).
    #[arg(long)]
    pub no_read_tax: bool,
}

/// A share of the budget: `--splits 2` (twice the budget) means nothing.
fn parse_split(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x > 0.0 && x <= 1.0 => Ok(x),
        _ => Err(format!("{s:?} is not a share of the budget in (0, 1]")),
    }
}

fn parse_repeats(s: &str) -> Result<usize, String> {
    super::count_in(s, 1..=100, "a number of measurements per point in 1..=100")
}

/// Tokens per point: none would measure nothing.
fn parse_tokens(s: &str) -> Result<usize, String> {
    super::count_in(s, 1..=usize::MAX, "a number of tokens (1 or more)")
}

/// The sweep a point belongs to, in the order they run.
const SWEEP_GRID: &str = "split x read-ahead";
const SWEEP_SPEC: &str = "speculation";
const SWEEP_QUEUE: &str = "queue depth";
const SWEEP_IO: &str = "backend";

#[derive(Clone, Debug, PartialEq, Serialize)]
struct Knobs {
    split: f64,
    readahead: usize,
    /// "adaptive" (the default), "fixed" (every prediction read) or "off".
    spec: &'static str,
    spec_margin: usize,
    queue_depth: u32,
    io: String,
}

/// The knobs as `run` flags would set them, for error messages.
impl std::fmt::Display for Knobs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "trunk share {}, read-ahead {}, speculation {} (margin {}), queue depth {}, --io {}",
            self.split, self.readahead, self.spec, self.spec_margin, self.queue_depth, self.io
        )
    }
}

#[derive(Serialize)]
struct Point {
    /// Which sweep measured it: each sweep varies one knob from the best point so far.
    sweep: &'static str,
    #[serde(flatten)]
    knobs: Knobs,
    /// The median of `--repeats` measurements, and their spread.
    seconds_per_token: f64,
    seconds_min: f64,
    seconds_max: f64,
    bytes_per_token: f64,
    overlap_fraction: f64,
    recall: f64,
    same_ids: bool,
}

/// The backends `tune --io` sweeps.
#[derive(Clone, Debug)]
pub struct IoList(pub Vec<String>);

/// Splits `--io` at commas, except the commas inside a `sim:` spec: a piece that does not start
/// a backend name continues the one before it. Every backend is checked here.
fn parse_io_list(s: &str) -> Result<IoList, String> {
    let starts = |p: &str| ["uring", "pread", "mmap", "sim:"].iter().any(|b| p.trim_start().starts_with(b));
    let mut list: Vec<String> = Vec::new();
    for piece in s.split(',') {
        match list.last_mut() {
            Some(last) if !starts(piece) && last.starts_with("sim:") => {
                last.push(',');
                last.push_str(piece);
            }
            _ => list.push(piece.trim().to_owned()),
        }
    }
    // A modeled device is kept in its canonical form (no spaces), as the recommendation prints it.
    let list = list
        .into_iter()
        .map(|io| IoKind::parse(&io).map(|k| k.modeled().map_or(io, |m| m.spec())))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(IoList(list))
}

pub fn run(args: &TuneArgs) -> anyhow::Result<()> {
    let json = super::output::JsonOut::open(args.json.as_deref())?;
    for (flag, path) in [("--csv", &args.csv), ("--svg", &args.svg)] {
        if let Some(path) = path {
            super::output::create_now(flag, path)?;
        }
    }
    let kernels = super::kernels_for("auto")?;
    let tok = Tokenizer::from_model_dir(&args.model)?;
    let prompt = tok.encode(&args.prompt)?;
    if prompt.is_empty() {
        return Err(UsageError("--prompt encodes to zero tokens".into()).into());
    }
    let spec = MeasureSpec { prompt, warmup: args.warmup, tokens: args.tokens, prefill_chunk: 32 };
    let first = |v: &[usize]| v.first().copied().unwrap_or(0);
    let base = Knobs {
        split: 1.0,
        readahead: 1,
        spec: "adaptive",
        spec_margin: first(&args.spec_margin),
        queue_depth: args.queue_depth.last().copied().unwrap_or(32),
        io: args.io.0.first().cloned().unwrap_or_else(|| "uring".into()),
    };
    let total = args.splits.len() * args.readahead.len()
        + 1
        + 2 * args.spec_margin.len()
        + args.queue_depth.len()
        + args.io.0.len();
    let bar = ProgressBar::new(total as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} tune [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut points: Vec<Point> = Vec::new();
    let mut reference: Option<Vec<u32>> = None;
    let mut measure = |sweep: &'static str, k: Knobs, points: &mut Vec<Point>| -> anyhow::Result<()> {
        bar.set_message(format!(
            "split {} readahead {} speculation {} margin {} qd {} {}",
            k.split, k.readahead, k.spec, k.spec_margin, k.queue_depth, k.io
        ));
        let run = streaming_run(args, &k, &spec);
        let mut seconds = Vec::with_capacity(args.repeats);
        let mut same_ids = true;
        let mut last = None;
        for _ in 0..args.repeats {
            let m = measure_streaming(&args.model, &args.trunk, &run, kernels, &spec)
                .with_context(|| format!("tuning point {k}"))
                .map_err(|e| name_budget_flag(e, &format!("--mem-gb {}", args.mem_gb)))?;
            same_ids &= reference.get_or_insert_with(|| m.ids.clone()) == &m.ids;
            seconds.push(m.seconds_per_token);
            last = Some(m);
        }
        let Some(m) = last else { anyhow::bail!("tuning point {k}: no measurement") };
        seconds.sort_by(f64::total_cmp);
        points.push(Point {
            sweep,
            knobs: k,
            // The median; of an even count, the mean of the middle two.
            seconds_per_token: (seconds[(seconds.len() - 1) / 2] + seconds[seconds.len() / 2]) / 2.0,
            seconds_min: seconds[0],
            seconds_max: seconds[seconds.len() - 1],
            bytes_per_token: m.trunk_bytes_per_token + m.expert_bytes_per_token,
            overlap_fraction: m.overlap_fraction,
            recall: m.recall,
            same_ids,
        });
        bar.inc(1);
        Ok(())
    };
    for &split in &args.splits {
        for &readahead in &args.readahead {
            measure(SWEEP_GRID, Knobs { split, readahead, ..base.clone() }, &mut points)?;
        }
    }
    let best_grid = best(&points).knobs.clone();
    measure(SWEEP_SPEC, Knobs { spec: "off", ..best_grid.clone() }, &mut points)?;
    for &m in &args.spec_margin {
        for spec in ["adaptive", "fixed"] {
            measure(SWEEP_SPEC, Knobs { spec, spec_margin: m, ..best_grid.clone() }, &mut points)?;
        }
    }
    let best_spec = best(&points).knobs.clone();
    for &q in &args.queue_depth {
        measure(SWEEP_QUEUE, Knobs { queue_depth: q, ..best_spec.clone() }, &mut points)?;
    }
    let best_qd = best(&points).knobs.clone();
    for io in &args.io.0 {
        measure(SWEEP_IO, Knobs { io: io.clone(), ..best_qd.clone() }, &mut points)?;
    }
    bar.set_message("read tax");
    let tax = read_tax(args, kernels, &spec)?;
    bar.finish_and_clear();
    report(args, json.as_ref(), &points, &tax)?;
    if points.iter().any(|p| !p.same_ids) {
        anyhow::bail!("generated ids differ between tuning points: the output must not depend on the knobs");
    }
    Ok(())
}

fn best(points: &[Point]) -> &Point {
    points.iter().min_by(|a, b| a.seconds_per_token.total_cmp(&b.seconds_per_token)).unwrap_or(&points[0])
}

/// Whether the pick leads the next-fastest point beyond the spread of their measurements, said
/// in words: (within the noise, or `None` when one measurement each cannot tell; the sentence).
fn noise_verdict(points: &[Point], repeats: usize) -> (Option<bool>, String) {
    let b = best(points);
    let runner = points
        .iter()
        // Later sweeps measure the best point's knobs again: the next point has other knobs.
        .filter(|p| p.knobs != b.knobs)
        .min_by(|x, y| x.seconds_per_token.total_cmp(&y.seconds_per_token));
    let Some(r) = runner else {
        return (None, "one point measured: nothing to compare the pick with".to_owned());
    };
    let next = format!("the next point ({}) {:.3} s/token", r.knobs, r.seconds_per_token);
    if repeats < 2 {
        return (
            None,
            format!("one measurement per point: whether the pick's {:.3} s/token against {next} is beyond the noise is not known (--repeats 3 tells)", b.seconds_per_token),
        );
    }
    if b.seconds_max >= r.seconds_min {
        (Some(true), format!("the pick is within the noise: its {repeats} runs took {:.3}..{:.3} s/token, {next} ({:.3}..{:.3}); either will do", b.seconds_min, b.seconds_max, r.seconds_min, r.seconds_max))
    } else {
        (Some(false), format!("the pick leads beyond the noise: its slowest of {repeats} runs, {:.3} s/token, beat the fastest of {next} ({:.3})", b.seconds_max, r.seconds_min))
    }
}

fn streaming_run(args: &TuneArgs, k: &Knobs, spec: &MeasureSpec) -> StreamingRun {
    StreamingRun {
        drafting: Default::default(),
        budget_bytes: (args.mem_gb * GB) as u64,
        sequences: 1,
        context: spec.prompt.len() + spec.warmup + spec.tokens + 1,
        chunk: spec.prefill_chunk,
        threads: args.threads,
        store: StoreOptions { readahead: k.readahead, ..StoreOptions::default() },
        pipeline: PipelineOptions {
            io: IoOptions {
                kind: IoKind::parse(&k.io).unwrap_or(IoKind::Uring), // checked by parse_io_list
                queue_depth: k.queue_depth,
                ..IoOptions::default()
            },
            speculation: match k.spec {
                "off" => Speculation::OFF,
                "fixed" => Speculation { margin: k.spec_margin, adaptive: false, ..Speculation::default() },
                _ => Speculation { margin: k.spec_margin, ..Speculation::default() },
            },
            ..PipelineOptions::default()
        },
        prefetch_window: None,
        placement: None,
        trace_detail: false,
        trunk_share: (k.split < 1.0).then_some(k.split),
        available_memory: None,
    }
}

/// The `run` flags that set exactly the knobs of `k`: every knob tune varied is spelled out,
/// speculation included, so the command runs what was measured whatever run's defaults are.
fn recommended_flags(mem_gb: f64, k: &Knobs) -> String {
    let mut flags = format!("--mem-gb {mem_gb}");
    if k.split < 1.0 {
        let _ = write!(flags, " --trunk-share {}", k.split);
    }
    let _ = write!(flags, " --readahead {}", k.readahead);
    match k.spec {
        "off" => flags.push_str(" --no-spec"),
        "fixed" => flags.push_str(" --spec --spec-fixed"),
        _ => flags.push_str(" --spec"),
    }
    if k.spec != "off" {
        let _ = write!(flags, " --spec-margin {}", k.spec_margin);
    }
    let _ = write!(flags, " --queue-depth {} --io {}", k.queue_depth, k.io);
    flags
}

/// What a read in flight costs compute here (as `bench` measures it, through the first
/// backend swept), or why it was not measured.
fn read_tax(args: &TuneArgs, kernels: kernels::Kernels, spec: &MeasureSpec) -> anyhow::Result<Result<ReadTax, String>> {
    if args.no_read_tax {
        return Ok(Err("not measured (--no-read-tax)".to_owned()));
    }
    let index = crate::checkpoint::CheckpointIndex::open(&args.model)?;
    let cfg = crate::config::Config::from_model_dir(&args.model)?;
    let model_bytes = index.total_bytes();
    if let Some(a) = crate::memory::available().filter(|a| a.bytes < model_bytes) {
        return Ok(Err(format!(
            "not measured: it decodes with every weight in memory, and the model's {:.2} GB exceed the {a}",
            model_bytes as f64 / 1e9
        )));
    }
    let io = IoKind::parse(args.io.0.first().map_or("uring", String::as_str)).unwrap_or(IoKind::Uring);
    let files: Vec<PathBuf> = index.shards.iter().map(|s| s.path.clone()).collect();
    let ranges = super::bench_host::probe_ranges(&index, io);
    super::bench_host::warm_for_probes(&files, &ranges, io, cfg.expert_bytes())?;
    let stream_io =
        IoOptions { kind: io, queue_depth: args.queue_depth.last().copied().unwrap_or(32), ..IoOptions::default() };
    let stream = (&files[..], &ranges[..], &stream_io, cfg.expert_bytes() as usize);
    let tax = super::bench_host::read_tax(&args.model, kernels, args.threads, spec, stream, 3)?;
    Ok(Ok(tax))
}

fn report(
    args: &TuneArgs,
    json: Option<&super::output::JsonOut>,
    points: &[Point],
    tax: &Result<ReadTax, String>,
) -> anyhow::Result<()> {
    let b = best(points);
    let flags = recommended_flags(args.mem_gb, &b.knobs);
    let (within_noise, noise) = noise_verdict(points, args.repeats);
    if let Some(out) = json {
        let tax_json = match tax {
            Ok(t) => serde_json::to_value(t)?,
            Err(why) => serde_json::json!({ "not_measured": why }),
        };
        out.write(&serde_json::json!({
            "points": points, "best": b, "recommended_flags": flags, "read_tax": tax_json,
            "repeats": args.repeats, "within_noise": within_noise, "noise": noise,
        }))?;
    }
    if !super::output::JsonOut::is_stdout(json) {
        println!(
            "{:<18} {:>6} {:>9} {:>11} {:>6} {:>5} {:>6} {:>9} {:>10} {:>8} {:>7} {:>5}",
            "sweep",
            "split",
            "readahead",
            "speculation",
            "margin",
            "qd",
            "io",
            "s/token",
            "GB/token",
            "overlap",
            "recall",
            "ids"
        );
        for p in points {
            let k = &p.knobs;
            println!(
                "{:<18} {:>6} {:>9} {:>11} {:>6} {:>5} {:>6} {:>9.3} {:>10.2} {:>7.0}% {:>6.0}% {:>5}",
                p.sweep,
                k.split,
                k.readahead,
                k.spec,
                k.spec_margin,
                k.queue_depth,
                k.io,
                p.seconds_per_token,
                p.bytes_per_token / 1e9,
                100.0 * p.overlap_fraction,
                100.0 * p.recall,
                if p.same_ids { "same" } else { "DIFF" }
            );
        }
    }
    match tax {
        Ok(t) => eprintln!(
            "read tax through {}: tau {:.3} (spread {:.3}..{:.3}) compute s per s of reading, {:.3} s per GB read",
            t.backend, t.tau, t.tau_min, t.tau_max, t.seconds_per_gb
        ),
        Err(why) => eprintln!("read tax: {why}"),
    }
    eprintln!("recommended: k3ring run --model ... --trunk ... {flags}  ({:.3} s/token)", b.seconds_per_token);
    eprintln!("{noise}");
    if let Some(path) = &args.csv {
        write_csv(path, points)?;
    }
    if let Some(path) = &args.svg {
        let series: Vec<Series> = args
            .splits
            .iter()
            .map(|&split| Series {
                name: if split < 1.0 { format!("trunk share {split}") } else { "trunk first".to_owned() },
                points: args
                    .readahead
                    .iter()
                    .filter_map(|&r| {
                        points
                            .iter()
                            .find(|p| p.knobs.split == split && p.knobs.readahead == r)
                            .map(|p| (r as f64, p.seconds_per_token))
                    })
                    .collect(),
            })
            .collect();
        let title = format!("k3ring tune at {} GB: s/token by trunk read-ahead", args.mem_gb);
        let chart = line_chart(&title, "trunk read-ahead depth (layers)", "s/token", &series);
        super::output::create_now("--svg", path)?.write_all(chart.as_bytes())?;
    }
    Ok(())
}

/// Every point as a CSV row (`--csv`).
fn write_csv(path: &std::path::Path, points: &[Point]) -> anyhow::Result<()> {
    let mut csv = String::from("sweep,split,readahead,speculation,spec_margin,queue_depth,io,seconds_per_token,seconds_min,seconds_max,bytes_per_token,overlap_fraction,recall,same_ids\n");
    for p in points {
        let k = &p.knobs;
        let _ = writeln!(
            csv,
            "{},{},{},{},{},{},{},{:.6},{:.6},{:.6},{:.0},{:.4},{:.4},{}",
            p.sweep,
            k.split,
            k.readahead,
            k.spec,
            k.spec_margin,
            k.queue_depth,
            // A modeled device's spec has commas: quoted, as CSV does.
            if k.io.contains(',') { format!("\"{}\"", k.io) } else { k.io.clone() },
            p.seconds_per_token,
            p.seconds_min,
            p.seconds_max,
            p.bytes_per_token,
            p.overlap_fraction,
            p.recall,
            p.same_ids
        );
    }
    super::output::create_now("--csv", path)?.write_all(csv.as_bytes())?;
    Ok(())
}
