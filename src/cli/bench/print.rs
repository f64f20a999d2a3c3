//! `bench`'s text report: the host and tax lines, the conditions the cells ran against, the
//! mode cells' table and what its columns mean. `--json` carries the same [`Report`].

use super::{bench_batch, bench_host, Cell, Report};
use crate::cli::bench::BenchArgs;
use crate::config::Config;

/// The cost of checking experts against their checksums (on by default): the check's time on
/// the compute path over s/token, the median and the worst over the cells, and the share of it
/// the experts' products hashed in cache; the share hashed inside waits for reads (time the
/// cores would otherwise idle, but for a step past a read's end); and the rate at which it
/// hashed.
fn verify_cost_line(cells: &[Cell]) -> String {
    let mut ratios: Vec<f64> = cells
        .iter()
        .filter(|c| c.m.seconds_per_token > 0.0)
        .map(|c| c.m.expert_verify_seconds_per_token / c.m.seconds_per_token)
        .collect();
    ratios.sort_by(f64::total_cmp);
    let (Some(median), Some(worst)) = (ratios.get(ratios.len() / 2), ratios.last()) else {
        return "expert checksums: no cell measured".to_owned();
    };
    let on_path: f64 = cells.iter().map(|c| c.m.expert_verify_seconds_per_token).sum();
    let waiting: f64 = cells.iter().map(|c| c.m.expert_verify_waiting_seconds_per_token).sum();
    let in_products: f64 = cells.iter().map(|c| c.m.expert_verify_in_products_seconds_per_token).sum();
    let all: f64 = cells.iter().map(|c| c.m.seconds_per_token).sum();
    let bytes: f64 = cells.iter().map(|c| c.m.expert_verified_bytes_per_token).sum();
    let seconds = on_path + waiting;
    let rate = if seconds > 0.0 { format!("{:.1} GB/s", bytes / seconds / 1e9) } else { "-".to_owned() };
    let share = |x: f64| if all > 0.0 { 100.0 * x / all } else { 0.0 };
    format!(
        "expert checksums (on by default): {:.2}% of s/token on the compute path (median over the cells; worst \
         {:.2}%; {:.2}% over all cells hashed in cache by the experts' own products), and {:.2}% hashed while \
         compute waited for reads; hashed at {rate}",
        100.0 * median,
        100.0 * worst,
        share(in_products),
        share(waiting)
    )
}

/// The resident runs beside each repeat, by budget, and how far they spread.
fn print_residents_by_repeat(r: &Report) {
    if r.resident_by_repeat.is_empty() {
        println!("resident compute beside the cells: not measured (--resident-once): every floor uses the run above");
        return;
    }
    let mut budgets: Vec<f64> = r.resident_by_repeat.iter().map(|x| x.budget_gb).collect();
    budgets.dedup();
    let per_budget: Vec<String> = budgets
        .iter()
        .map(|b| {
            let runs: Vec<String> = r
                .resident_by_repeat
                .iter()
                .filter(|x| x.budget_gb == *b)
                .map(|x| format!("{:.3}", x.seconds_per_token))
                .collect();
            format!("{b} GB {}", runs.join(", "))
        })
        .collect();
    let all = r.resident_by_repeat.iter().map(|x| x.seconds_per_token);
    let (lo, hi) = all.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    println!(
        "resident compute beside each repeat of the cells (s/token; each cell's floors use the run of its median \
         sample's repeat): {}; spread {:.0}%",
        per_budget.join("; "),
        if lo > 0.0 { 100.0 * (hi / lo - 1.0) } else { 0.0 }
    );
}

pub(super) fn print_report(r: &Report, cfg: &Config, args: &BenchArgs) {
    bench_host::print_host(&r.host, r.read_tax.as_ref());
    print_conditions(r, cfg, args);
    print_cells(r);
    if r.read_tax.is_some() {
        bench_host::print_host_cells(
            r.cells
                .iter()
                .filter_map(|c| Some((c.budget_gb, c.mode.as_str(), c.m.seconds_per_token, c.host.as_ref()?))),
        );
    }
    if r.experts_checked {
        println!("{}", verify_cost_line(&r.cells));
    } else {
        println!("expert checksums: not checked (--no-verify-experts)");
    }
    println!("expert cache policy: {} (--policy)", r.expert_cache_policy);
    println!("ids identical in every cell and resident: {}", if r.ids_identical { "yes" } else { "NO" });
    if let Some(batch) = &r.batch {
        bench_batch::print(batch);
    }
}

/// The device, the memory, the resident compute and the page cache the cells ran against.
fn print_conditions(r: &Report, cfg: &Config, args: &BenchArgs) {
    let rates =
        |v: &[(u32, f64)]| v.iter().map(|(q, v)| format!("QD{q} {:.2}", v / 1e9)).collect::<Vec<_>>().join(", ");
    println!(
        "device (random {} reads of {:.1} MB from {}): {} GB/s (before the cells {}, after {})",
        if args.io.starts_with("sim:") { "modeled" } else { "O_DIRECT" },
        cfg.expert_bytes() as f64 / 1e6,
        r.device_probe_source,
        rates(&r.device_read_rate),
        rates(&r.device_read_rate_before),
        rates(&r.device_read_rate_after)
    );
    let alone = r.device_read_rate.iter().map(|&(_, v)| v).fold(0.0, f64::max);
    if let Some(tax) = r.read_tax.as_ref().filter(|_| alone > 0.0) {
        println!(
            "reads beside compute: the read-tax stream ran at {:.2} GB/s while resident decode computed, {:.2} of the \
             device alone (what the host leaves the device while the cores compute; the floors do not use it)",
            tax.read_rate / 1e9,
            tax.read_rate / alone
        );
    }
    println!(
        "memory bandwidth (triad): {:.1} GB/s (the better of {:.1} before the resident cell and {:.1} after it)",
        r.memory_bandwidth / 1e9,
        r.memory_bandwidth_before / 1e9,
        r.memory_bandwidth_after / 1e9
    );
    if let Some(peak) = r.fma_peak_flops_per_second {
        println!(
            "FMA peak: {:.1} GFLOP/s (independent chains of the kernels' widest FMA on every compute thread)",
            peak / 1e9
        );
    }
    if let Some(moved) = bandwidth_moved(r.memory_bandwidth_before, r.memory_bandwidth_after) {
        println!(
            "warning: the memory bandwidth moved by {:.0}% between before and after the resident cell: the host's speed \
             changed during this run (a shared or throttled machine), so cells measured at different times differ by \
             that much too; compare the modes of one budget (they alternate), repeat, or run on a quieter host",
            100.0 * moved
        );
    }
    match r.resident_overlappable_seconds_per_token {
        Some(o) => println!(
            "resident compute: {:.3} s/token ({o:.3} of it shared and routed experts, which expert reads can overlap)",
            r.resident_seconds_per_token
        ),
        None => println!("resident compute: {:.3} s/token", r.resident_seconds_per_token),
    }
    print_residents_by_repeat(r);
    if let Some(table) = &r.resident_attribution {
        println!(
            "resident decode by operation class (GB/s, GFLOP/s: weight bytes and flops over the class's time; triad, \
             FMA: of the triad and the FMA peak above; roof s: the longer of the two limits):"
        );
        for line in table.lines() {
            println!("  {line}");
        }
    }
    println!(
        "page cache: {}",
        if r.page_cache_dropped {
            "dropped before every cell"
        } else if args.io.starts_with("sim:") {
            "kept: the modeled device (--io sim) copies its reads from it"
        } else if args.no_drop_caches {
            "kept (--no-drop-caches); reads are O_DIRECT"
        } else {
            "not dropped (not root); reads are O_DIRECT"
        }
    );
}

/// The mode cells' table, the ratios between modes and what the floor columns mean.
fn print_cells(r: &Report) {
    println!(
        "{:>7} {:>17} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7} {:>8} {:>7} {:>7} {:>10}",
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
    for c in &r.cells {
        println!(
            "{:>6}G {:>17} {:>9.3} {:>8.2}G {:>8.2}G {:>9.2} {:>9.2} {:>7.0}% {:>8.3} {:>7.2} {} {} {:>6.0}% {:>9.2}G",
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
    print_devices(&r.cells);
    for (b, s) in &r.speedups {
        println!("speedup at {b} GB: pipelined is {s:.2}x serial");
    }
    for (b, s) in &r.speculation_gains {
        println!("speculation at {b} GB: pipelined is {s:.2}x no-spec");
    }
    let in_trial = r.cells.iter().filter(|c| c.m.speculation_trial_open);
    print_in_trial("passes", &in_trial.map(|c| format!("{} at {} GB", c.mode, c.budget_gb)).collect::<Vec<_>>());
    for g in &r.drafting {
        println!(
            "drafting at {} GB, {}: {:.0}% of {} guesses kept, {:.2} tokens per step; s/token {:.2}x and bytes read per token {:.2}x pipelined's",
            g.budget_gb,
            g.mode,
            100.0 * g.stats.acceptance(),
            g.stats.drafted,
            g.stats.tokens_per_step(),
            1.0 / g.speedup,
            1.0 / g.bytes_ratio
        );
    }
    if r.cells.iter().any(|c| c.m.draft.is_some()) && !r.cells.iter().any(|c| c.mode == "pipelined") {
        println!("drafting: add pipelined to --modes to compare the drafted cells with plain decoding");
    }
    println!(
        "dev GB/s: the device at the engine's queue depth, the better of the probes around each budget's cells and the \
         cells' own busy read rates (the floor uses it)"
    );
    for d in &r.device_rates_by_budget {
        println!(
            "  {} GB: probed {:.2} GB/s, cells read up to {:.2} GB/s while busy: {:.2} GB/s used",
            d.budget_gb,
            d.probed / 1e9,
            d.engine_busy / 1e9,
            d.used / 1e9
        );
    }
    println!(
        "floor*: the floor without routing prediction: a layer's expert reads start at its router, so they overlap \
         only that layer's expert compute (per measured token and layer; cells that predict routing can beat it)"
    );
}

/// Each cell's reads per device, when the experts live on several (`pack --experts-to`): on a
/// server with several drives, what each one delivered and how busy it was.
fn print_devices(cells: &[Cell]) {
    for c in cells.iter().filter(|c| !c.m.devices.is_empty()) {
        let per: Vec<String> =
            c.m.devices
                .iter()
                .enumerate()
                .map(|(i, d)| {
                    format!(
                        "{i} {}: {:.3} GB/token, busy {:.0}% at {:.2} GB/s",
                        d.name,
                        d.bytes_per_token / 1e9,
                        100.0 * d.busy_fraction,
                        d.read_rate_busy / 1e9
                    )
                })
                .collect();
        println!("devices at {} GB, {} | {}", c.budget_gb, c.mode, per.join(" | "));
    }
}

/// Names the `cells` measured before adaptive speculation's first trial decided (their
/// `passes` alternate with and without guesses by design), if any.
pub(in crate::cli) fn print_in_trial(passes: &str, cells: &[String]) {
    if !cells.is_empty() {
        println!(
            "measured during speculation's first trial, whose {passes} alternate with and without guesses: {}; \
             --warmup {} or more measures the setting each layer settles on",
            cells.join(", "),
            crate::pipeline::trial::DECODE_PASSES_TO_FIRST_DECISION
        );
    }
}

/// `v` right-aligned in `width` with `prec` decimals, or a dash when it was not measured.
pub(in crate::cli) fn or_dash(v: Option<f64>, width: usize, prec: usize) -> String {
    match v {
        Some(v) => format!("{v:>width$.prec$}"),
        None => format!("{:>width$}", "-"),
    }
}

/// How far apart two triad readings of one run are (as a share of the larger), when more than
/// a fifth: beyond the 5-10% a triad varies on a quiet host.
fn bandwidth_moved(before: f64, after: f64) -> Option<f64> {
    let (lo, hi) = (before.min(after), before.max(after));
    let moved = if hi > 0.0 { 1.0 - lo / hi } else { 0.0 };
    (moved > 0.2).then_some(moved)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_triad_that_moved_by_more_than_a_fifth_is_reported() {
        // This VM on 2026-12-05: 71.4 GB/s before the resident cell, 47.5 after.
        let moved = super::bandwidth_moved(71.4e9, 47.5e9).unwrap_or(0.0);
        assert!((moved - (1.0 - 47.5 / 71.4)).abs() < 1e-12);
        assert_eq!(super::bandwidth_moved(48.2e9, 45.7e9), None);
        assert_eq!(super::bandwidth_moved(0.0, 0.0), None);
    }
}
