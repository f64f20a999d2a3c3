//! `k3ring cache-sim`: replays an expert trace (`run --dump-trace FILE`) through pools of several
//! sizes under each cache policy and Belady's optimum, and prints hit rates and read volume.
//!
//! The simulations run on the rayon pool, one job per (capacity, policy); a progress bar appears
//! on stderr once they have taken more than a second.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rayon::prelude::*;
use serde::Serialize;

use crate::error::UsageError;
use crate::storage::stream::cache_sim::{
    belady_with_progress, default_capacities, read_trace, simulate_with_progress, SimResult, Trace,
};
use crate::storage::stream::policy::{policy_by_name, POLICY_NAMES};

/// How long the simulations run before the progress bar shows.
const PROGRESS_DELAY: Duration = Duration::from_secs(1);
/// Capacities one run may simulate.
const CAPACITIES_MAX: usize = 256;
/// Bytes in the MB of `--expert-mb` (decimal, like `--mem-gb`).
const MB: f64 = 1e6;
/// Below this difference (in hit-rate points) between the best and worst policy the conclusion
/// says the choice of policy hardly matters.
const TIE_POINTS: f64 = 0.5;

#[derive(Debug, clap::Args)]
#[command(allow_negative_numbers = true, args_override_self = true)]
pub struct CacheSimArgs {
    /// Expert trace written by `k3ring run --dump-trace FILE`.
    #[arg(value_name = "FILE")]
    pub trace: PathBuf,
    /// Pool sizes in experts (default: top_k, doubling, up to the distinct experts in the trace).
    #[arg(long, value_name = "N,N,...", value_delimiter = ',', action = clap::ArgAction::Set)]
    pub capacities: Option<Vec<usize>>,
    /// Size of one expert in MB (10^6 bytes), for the read volume per token (default: the size
    /// the trace's header records, `expert_bytes=`).
    #[arg(long, value_name = "MB", value_parser = parse_mb)]
    pub expert_mb: Option<f64>,
    /// Write the report as JSON to FILE ("-": to stdout, instead of the table).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

fn parse_mb(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("{s:?} is not a size in MB (a positive number)")),
    }
}

#[derive(Serialize)]
struct Cell {
    policy: String,
    hits: u64,
    misses: u64,
    hit_rate: f64,
    mb_read_per_token: f64,
}

#[derive(Serialize)]
struct Row {
    capacity: usize,
    /// The policies in `POLICY_NAMES` order, then belady.
    results: Vec<Cell>,
}

#[derive(Serialize)]
struct MeanRate {
    policy: String,
    hit_rate: f64,
}

#[derive(Serialize)]
struct Conclusion {
    best_policy: String,
    /// Mean over the capacities of each policy's hit rate, in table order.
    mean_hit_rates: Vec<MeanRate>,
    /// Belady's hit rate minus the best policy's, in points: mean and largest over capacities.
    gap_points_mean: f64,
    gap_points_max: f64,
    gap_points_max_capacity: usize,
    text: String,
}

#[derive(Serialize)]
struct Report {
    trace: String,
    layers: usize,
    experts: usize,
    top_k: usize,
    tokens: usize,
    requests: u64,
    distinct_experts: usize,
    expert_mb: f64,
    rows: Vec<Row>,
    conclusion: Conclusion,
}

pub fn run(args: &CacheSimArgs) -> anyhow::Result<()> {
    let json = super::output::JsonOut::open(args.json.as_deref())?;
    let trace = read_trace(&args.trace)?;
    let expert_mb = match (args.expert_mb, trace.expert_bytes()) {
        (Some(mb), _) => mb,
        (None, Some(bytes)) => bytes as f64 / MB,
        (None, None) => {
            return Err(UsageError(format!(
                "expert trace {}: its header records no expert size (no expert_bytes=; it was written by an \
                 older k3ring): give --expert-mb",
                args.trace.display()
            ))
            .into())
        }
    };
    let capacities = resolve_capacities(args.capacities.as_deref(), &trace)?;
    let results = simulate_all(&trace, &capacities)?;
    let report = build_report(args, expert_mb, &trace, &capacities, &results);
    if !super::output::JsonOut::is_stdout(json.as_ref()) {
        print_table(&report);
    }
    if let Some(out) = &json {
        out.write(&report)?;
    }
    Ok(())
}

fn resolve_capacities(given: Option<&[usize]>, trace: &Trace) -> anyhow::Result<Vec<usize>> {
    let mut capacities = given.map_or_else(|| default_capacities(trace), <[usize]>::to_vec);
    capacities.sort_unstable();
    capacities.dedup();
    if let Some(&small) = capacities.iter().find(|&&c| c < trace.top_k()) {
        return Err(UsageError(format!(
            "--capacities {small} is below the trace's top_k={}: a pool must hold one routing decision",
            trace.top_k()
        ))
        .into());
    }
    if capacities.len() > CAPACITIES_MAX {
        return Err(
            UsageError(format!("--capacities lists {} sizes; at most {CAPACITIES_MAX}", capacities.len())).into()
        );
    }
    assert!(!capacities.is_empty());
    Ok(capacities)
}

/// Runs every (capacity, policy) and Belady; results in row-major order, policies as in
/// `POLICY_NAMES` followed by belady.
fn simulate_all(trace: &Trace, capacities: &[usize]) -> anyhow::Result<Vec<SimResult>> {
    let columns = POLICY_NAMES.len() + 1;
    let jobs: Vec<(usize, usize)> = capacities.iter().flat_map(|&c| (0..columns).map(move |p| (c, p))).collect();
    let total = (jobs.len() * trace.batch_count()) as u64;
    let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::hidden());
    bar.set_style(
        ProgressStyle::with_template("simulating [{bar:40}] {percent}% eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let start = Instant::now();
    let shown = AtomicBool::new(false);
    let progress = |n: usize| {
        bar.inc(n as u64);
        if start.elapsed() > PROGRESS_DELAY && !shown.swap(true, Ordering::Relaxed) {
            bar.set_draw_target(ProgressDrawTarget::stderr());
        }
    };
    let results = jobs
        .par_iter()
        .map(|&(capacity, p)| match POLICY_NAMES.get(p) {
            Some(name) => {
                let mut policy =
                    policy_by_name(name, capacity).ok_or_else(|| anyhow::anyhow!("no policy named {name}"))?;
                Ok(simulate_with_progress(trace, capacity, policy.as_mut(), &progress)?)
            }
            None => Ok(belady_with_progress(trace, capacity, &progress)?),
        })
        .collect::<anyhow::Result<Vec<SimResult>>>();
    bar.finish_and_clear();
    let results = results?;
    assert!(results.len() == capacities.len() * columns);
    Ok(results)
}

fn build_report(
    args: &CacheSimArgs,
    expert_mb: f64,
    trace: &Trace,
    capacities: &[usize],
    results: &[SimResult],
) -> Report {
    let columns = POLICY_NAMES.len() + 1;
    let rows: Vec<Row> = capacities
        .iter()
        .zip(results.chunks_exact(columns))
        .map(|(&capacity, cells)| Row {
            capacity,
            results: cells
                .iter()
                .map(|r| Cell {
                    policy: r.policy.clone(),
                    hits: r.hits,
                    misses: r.misses,
                    hit_rate: r.hit_rate,
                    mb_read_per_token: r.bytes_read_per_token(expert_mb * MB) / MB,
                })
                .collect(),
        })
        .collect();
    let conclusion = conclude(&rows);
    Report {
        trace: args.trace.display().to_string(),
        layers: trace.layers(),
        experts: trace.experts(),
        top_k: trace.top_k(),
        tokens: trace.tokens(),
        requests: trace.requests(),
        distinct_experts: trace.distinct_experts(),
        expert_mb,
        rows,
        conclusion,
    }
}

/// The policy with the best mean hit rate over the capacities (ties: the earlier in the table),
/// and how far Belady is above it.
fn conclude(rows: &[Row]) -> Conclusion {
    assert!(!rows.is_empty());
    let n = rows.len() as f64;
    let mean = |p: usize| rows.iter().map(|r| r.results[p].hit_rate).sum::<f64>() / n;
    let means: Vec<MeanRate> = POLICY_NAMES
        .iter()
        .enumerate()
        .map(|(p, name)| MeanRate { policy: (*name).to_owned(), hit_rate: mean(p) })
        .collect();
    let mut best = 0;
    for (p, m) in means.iter().enumerate() {
        if m.hit_rate > means[best].hit_rate {
            best = p;
        }
    }
    let belady_column = POLICY_NAMES.len();
    let gaps: Vec<(f64, usize)> = rows
        .iter()
        .map(|r| (100.0 * (r.results[belady_column].hit_rate - r.results[best].hit_rate), r.capacity))
        .collect();
    let gap_mean = gaps.iter().map(|g| g.0).sum::<f64>() / n;
    let (gap_max, gap_max_capacity) = gaps.iter().copied().fold((f64::MIN, 0), |a, g| if g.0 > a.0 { g } else { a });
    let spread = 100.0
        * (means.iter().map(|m| m.hit_rate).fold(f64::MIN, f64::max)
            - means.iter().map(|m| m.hit_rate).fold(f64::MAX, f64::min));
    let others: Vec<String> = means
        .iter()
        .enumerate()
        .filter(|&(p, _)| p != best)
        .map(|(_, m)| format!("{} {:.2}%", m.policy, 100.0 * m.hit_rate))
        .collect();
    let mut text = format!(
        "{} is best (mean hit rate {:.2}%; {}); Belady is {gap_mean:.2} points higher on average, {gap_max:.2} at most (capacity {gap_max_capacity})",
        means[best].policy,
        100.0 * means[best].hit_rate,
        others.join(", ")
    );
    if spread < TIE_POINTS {
        text.push_str(&format!(
            "; the policies are within {spread:.2} points of each other: routing this flat leaves capacity, not policy, to decide"
        ));
    }
    Conclusion {
        best_policy: means[best].policy.clone(),
        mean_hit_rates: means,
        gap_points_mean: gap_mean,
        gap_points_max: gap_max,
        gap_points_max_capacity: gap_max_capacity,
        text,
    }
}

fn print_table(r: &Report) {
    println!(
        "expert trace {}: {} tokens, {} layers x {} experts, top_k {}, {} requests, {} distinct experts",
        r.trace, r.tokens, r.layers, r.experts, r.top_k, r.requests, r.distinct_experts
    );
    let names: Vec<&str> = POLICY_NAMES.iter().copied().chain(["belady"]).collect();
    let rate_header: String = names.iter().map(|n| format!("{n:>8}")).collect();
    let mb_header: String = names.iter().map(|n| format!("{n:>10}")).collect();
    let rates_width = 8 * names.len();
    println!("{:>8}  {:<rates_width$}  MB read per token ({} MB per expert)", "", "hit rate", r.expert_mb);
    println!("{:>8}  {rate_header}  {mb_header}", "capacity");
    for row in &r.rows {
        let rates: String = row.results.iter().map(|c| format!("{:>7.2}%", 100.0 * c.hit_rate)).collect();
        let mbs: String = row.results.iter().map(|c| format!("{:>10.1}", c.mb_read_per_token)).collect();
        println!("{:>8}  {rates}  {mbs}", row.capacity);
    }
    println!("conclusion: {}", r.conclusion.text);
}
