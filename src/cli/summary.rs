//! The summary lines a run ends with on stderr: tokens and rates, and for a streaming run its
//! storage and pipeline counters (`run`, `batch`).

use crate::engine::Generation;
use crate::storage::plan::{Plan, GB};
use crate::storage::stream::StreamStats;

pub(super) fn print_run_line(g: &Generation, peak: Option<u64>, threads: usize, isa: &str) {
    eprintln!(
        "k3ring: {} prompt + {} generated tokens | prefill {:.3} s | {} | peak RSS {} | {threads} threads, {isa} kernels",
        g.prompt_ids.len(),
        g.generated_ids.len(),
        g.prefill_seconds,
        decode_rate(g.generated_ids.len(), g.seconds_per_token),
        peak.map_or_else(|| "unknown".to_owned(), |b| format!("{:.3} GB", b as f64 / GB)),
    );
}

/// The decode part of the summary: time per token and tokens per second, or none at all when
/// nothing was generated (`--gen 0`), since a rate over no tokens means nothing.
fn decode_rate(generated: usize, seconds_per_token: f64) -> String {
    if generated == 0 || seconds_per_token <= 0.0 {
        return "no tokens decoded".to_owned();
    }
    format!("decode {seconds_per_token:.4} s/token, {:.2} tokens/s", 1.0 / seconds_per_token)
}

/// Share of routed experts the prediction had read ahead, when any were routed.
pub(super) fn recall(s: &StreamStats) -> Option<f64> {
    (s.routed_experts > 0).then(|| s.routed_recalled as f64 / s.routed_experts as f64)
}

/// The storage and pipeline lines of a streaming run's summary.
pub(super) fn print_streaming_summary(s: &StreamStats, p: &Plan, peak: Option<u64>, metrics: &crate::trace::Metrics) {
    let gb = |bytes: u64| format!("{:.4} GB", bytes as f64 / GB);
    eprintln!(
        "k3ring: storage {} | trunk read {} ({} reads, {}/{} units pinned{}) | experts read {} ({} reads, {} hits, {} evictions) | read rate {:.2} GB/s | planned {:.3} GB, peak RSS {}",
        s.backend,
        gb(s.trunk_bytes_read),
        s.trunk_reads,
        s.trunk_pinned_units,
        s.trunk_pinned_units + s.trunk_streamed_units,
        if s.trunk_split_units > 0 {
            let pinned = match s.trunk_pinned_pieces {
                0 => String::new(),
                n => format!(", {n} of them pinned"),
            };
            format!(", {} streamed in {} pieces{pinned}", s.trunk_split_units, s.trunk_pieces)
        } else {
            String::new()
        },
        gb(s.expert_bytes_read),
        s.expert_reads,
        s.expert_hits,
        s.expert_evictions,
        s.read_bytes_per_second / 1e9,
        p.planned_bytes as f64 / GB,
        peak.map_or_else(|| "unknown".to_owned(), |b| format!("{:.3} GB", b as f64 / GB)),
    );
    if !s.devices.is_empty() {
        let per: Vec<String> = s
            .devices
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let wall = metrics.wall_us / 1e6;
                let share = if wall > 0.0 {
                    format!(" ({:.0}% of the run)", 100.0 * d.busy_seconds / wall)
                } else {
                    String::new()
                };
                format!(
                    "{i} {}: {} in {} reads, busy {:.3} s{share} at {:.2} GB/s",
                    d.name,
                    gb(d.bytes_read),
                    d.reads,
                    d.busy_seconds,
                    d.read_bytes_per_second / 1e9
                )
            })
            .collect();
        eprintln!("k3ring: devices | {}", per.join(" | "));
    }
    let recall = recall(s).unwrap_or(0.0);
    eprintln!(
        "k3ring: pipeline | I/O busy {:.0}% | compute busy {:.0}% | overlap {:.0}% | stalled {:.3} s | recall {:.0}% | speculative reads {} ({}, {} wasted, {} cancelled) | layer trials won {} lost {}",
        100.0 * metrics.io_busy_fraction,
        100.0 * metrics.compute_busy_fraction,
        100.0 * metrics.overlap_fraction,
        metrics.stall_us / 1e6,
        100.0 * recall,
        s.spec_reads,
        gb(s.spec_bytes),
        gb(s.spec_wasted_bytes),
        s.spec_cancelled,
        s.spec_trials_won,
        s.spec_trials_lost,
    );
}
