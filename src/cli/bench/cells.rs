//! `bench`'s cells: each budget's modes and batch sizes, repeated with the modes alternating,
//! each repeat beside a resident run of its own, and the device probed around them; reduced to
//! the median sample per cell.

use anyhow::Context;
use indicatif::ProgressBar;
use serde::Serialize;

use super::draft_cells::DraftCells;
use super::BenchArgs;
use crate::cli::bench_batch::{self, BatchWork};
use crate::cli::budget::name_budget_flag;
use crate::engine::measure::{
    drop_page_cache, measure_resident, measure_streaming_drafted, warm_page_cache, MeasureSpec, Measurement,
};
use crate::engine::measure_batch::BatchMeasurement;
use crate::engine::StreamingRun;
use crate::pipeline::{IoKind, IoOptions, Mode, PipelineOptions, Speculation};
use crate::storage::plan::GB;
use crate::storage::stream::StoreOptions;

/// Budget (GB), mode, repeat, and what was measured.
type CellSample = (f64, String, usize, Measurement);

/// A cell's median sample, its budget's device rate (bytes/s, [`DeviceRate::used`]) and the
/// resident run beside the repeat of that sample (`None` with `--resident-once`).
pub(super) struct CellResult {
    pub budget_gb: f64,
    pub mode: String,
    pub m: Measurement,
    pub rate: DeviceRate,
    pub resident: Option<Measurement>,
}

/// The resident run beside one repeat of a budget's cells.
#[derive(Clone, Serialize)]
pub(super) struct RoundResident {
    pub budget_gb: f64,
    /// 0-based.
    pub repeat: usize,
    pub seconds_per_token: f64,
    #[serde(skip)]
    pub m: Measurement,
}

/// What [`measure_cells`] measured.
pub(super) struct Measured {
    pub cells: Vec<CellResult>,
    /// Every batch cell's every repeat, by budget (the ids check looks at each).
    pub batch_samples: Vec<(f64, BatchMeasurement)>,
    /// Per budget: the device rate its floors and bounds use, and where it came from.
    pub device_rate_sources: Vec<DeviceRate>,
    /// The resident runs beside each repeat (empty with `--resident-once`).
    pub round_residents: Vec<RoundResident>,
    /// The page cache could be dropped before every run.
    pub dropped: bool,
}

/// One budget's device rate. The probe (random reads of one expert's size at the engine's
/// queue depth, before each repeat and after the last) is short and this VM's disk moves by 2x
/// within minutes; a cell's own reads (bytes over the time some read was in flight, sequential
/// trunk pieces among them) have run at up to 1.9x the probes around them. A floor built on a
/// rate the engine beat would flatter its efficiency, so the rate used is the better of the
/// two. The busy rate leans high, if anything (a read in flight when a cell's window opens
/// counts all its bytes and only its time inside the window), which can only lower the
/// efficiencies, never raise them.
#[derive(Clone, Copy, Serialize)]
pub(super) struct DeviceRate {
    pub budget_gb: f64,
    /// The best probe around this budget's cells.
    pub probed: f64,
    /// The best busy read rate of this budget's cells (every mode, batch cell and repeat).
    pub engine_busy: f64,
    /// `max(probed, engine_busy)`: what the floors and bounds of this budget divide by.
    pub used: f64,
}

/// The cells of each budget: the modes (plain, then drafted) and the batch sizes.
pub(super) struct CellPlan<'a> {
    /// The checkpoint's shards, read into the page cache before each resident run when the
    /// cells drop it.
    pub shards: &'a [std::path::PathBuf],
    pub modes: &'a [String],
    pub drafts: &'a DraftCells,
    pub batch: Option<&'a BatchWork>,
}

/// Every (budget, mode) cell, `repeats` times with the modes alternating, reduced to the
/// median sample per cell (slow phases of the VM's disk then hit every mode alike); the batch
/// cells (`--batch`) run after the modes in each repeat, and are reduced by the caller.
/// `probe_device` (bytes/s at the engine's queue depth) runs before each repeat of a budget and
/// after its last; that budget's device rate is the better of those probes and of its cells'
/// busy read rates ([`DeviceRate`]). Unless `--resident-once`, each repeat also measures the
/// resident compute, and a cell's floors use the resident run of its median sample's repeat:
/// this VM's compute speed moves by a third between phases lasting minutes, so a resident run
/// from another moment would misjudge the cells by that much.
pub(super) fn measure_cells(
    args: &BenchArgs,
    io: IoKind,
    kernels: kernels::Kernels,
    spec: &MeasureSpec,
    plan: &CellPlan<'_>,
    bar: &ProgressBar,
    probe_device: &mut dyn FnMut() -> anyhow::Result<f64>,
) -> anyhow::Result<Measured> {
    let mut samples: Vec<CellSample> = Vec::new();
    let mut batch_samples = Vec::new();
    let mut round_residents = Vec::new();
    let mut device_rate_sources = Vec::new();
    let mut dropped = true;
    // A modeled device reads from the page cache: dropping it would send its reads to the disk.
    let drop_caches = !args.no_drop_caches && io.modeled().is_none();
    let repeats = args.repeats.max(1);
    for &budget in &args.budgets {
        let mut best = 0.0f64;
        for rep in 0..repeats {
            if !args.resident_once {
                bar.set_message(format!("{budget} GB: resident compute ({}/{repeats})", rep + 1));
                if drop_caches {
                    // The resident run maps the shards: read them in, or it would time the disk.
                    warm_page_cache(plan.shards).context("reading the model into the page cache")?;
                }
                let m = measure_resident(&args.model, kernels, args.threads, spec)
                    .with_context(|| format!("budget {budget} GB, the resident run beside repeat {}", rep + 1))?;
                let seconds_per_token = m.seconds_per_token;
                round_residents.push(RoundResident { budget_gb: budget, repeat: rep, seconds_per_token, m });
                bar.inc(1);
            }
            // The probe comes after the resident run, right before the cells it is for.
            bar.set_message(format!("{budget} GB: device ({}/{repeats})", rep + 1));
            best = best.max(probe_device()?);
            for mode in plan.modes {
                bar.set_message(format!("{budget} GB {mode} ({}/{repeats})", rep + 1));
                dropped &= drop_caches && drop_page_cache();
                let draft = plan.drafts.options(mode);
                let mut run = cell_run(args, io, spec, budget, mode);
                if let Some(d) = &draft {
                    run.drafting =
                        crate::engine::DraftPlan { rows: d.len + 1, sequences: 1, step_rows: 0, optional: false };
                    run.context += d.len + 1;
                }
                let m = measure_streaming_drafted(&args.model, &args.trunk, &run, kernels, spec, draft.as_ref())
                    .with_context(|| format!("budget {budget} GB, mode {mode}"))
                    .map_err(|e| name_budget_flag(e, &format!("--budgets {budget}")))?;
                samples.push((budget, mode.clone(), rep, m));
                bar.inc(1);
            }
            for (work, &b) in plan.batch.iter().flat_map(|w| w.sizes.iter().map(move |b| (*w, b))) {
                bar.set_message(format!("{budget} GB batch {b} ({}/{repeats})", rep + 1));
                dropped &= drop_caches && drop_page_cache();
                let run = cell_run(args, io, spec, budget, bench_batch::BATCH_MODE);
                let m = bench_batch::measure_cell(args, kernels, work, run, b)
                    .with_context(|| format!("budget {budget} GB, batch {b}"))
                    .map_err(|e| name_budget_flag(e, &format!("--budgets {budget}")))?;
                batch_samples.push((budget, m));
                bar.inc(1);
            }
        }
        bar.set_message(format!("{budget} GB: device after"));
        best = best.max(probe_device()?);
        let engine_busy = samples
            .iter()
            .filter(|s| s.0 == budget)
            .map(|s| s.3.read_rate_busy)
            .chain(batch_samples.iter().filter(|s| s.0 == budget).map(|s| s.1.read_rate_busy))
            .fold(0.0f64, f64::max);
        let used = best.max(engine_busy);
        device_rate_sources.push(DeviceRate { budget_gb: budget, probed: best, engine_busy, used });
    }
    let cells = median_cells(&samples, &round_residents, &device_rate_sources, plan.modes);
    Ok(Measured { cells, batch_samples, device_rate_sources, round_residents, dropped })
}

/// Per budget and mode, the median sample (by s/token) with the resident run of its own
/// repeat of that budget, if any.
fn median_cells(
    samples: &[CellSample],
    round_residents: &[RoundResident],
    rates: &[DeviceRate],
    modes: &[String],
) -> Vec<CellResult> {
    let mut cells = Vec::new();
    for &rate in rates {
        let budget = rate.budget_gb;
        for mode in modes {
            let mut runs: Vec<&CellSample> = samples.iter().filter(|s| s.0 == budget && &s.1 == mode).collect();
            runs.sort_by(|a, b| a.3.seconds_per_token.total_cmp(&b.3.seconds_per_token));
            if let Some(&(_, _, rep, ref m)) = runs.get(runs.len() / 2).copied() {
                let resident =
                    round_residents.iter().find(|r| r.budget_gb == budget && r.repeat == rep).map(|r| r.m.clone());
                cells.push(CellResult { budget_gb: budget, mode: mode.clone(), m: m.clone(), rate, resident });
            }
        }
    }
    cells
}

/// The streaming run of one cell: serial is the C engine's order (no read-ahead, no overlap of
/// a layer's reads with its compute); no-spec pipelines without prediction; pipelined is the
/// default (adaptive prediction); fixed-spec reads every prediction.
pub(super) fn cell_run(args: &BenchArgs, io: IoKind, spec: &MeasureSpec, budget: f64, mode: &str) -> StreamingRun {
    let serial = mode == "serial";
    let speculation = match mode {
        "pipelined" => Speculation::default(),
        // The drafted cells run the default pipeline.
        m if m.starts_with("draft-") => Speculation::default(),
        "fixed-spec" => Speculation { adaptive: false, ..Speculation::default() },
        _ => Speculation::OFF,
    };
    StreamingRun {
        drafting: Default::default(),
        budget_bytes: (budget * GB) as u64,
        sequences: 1,
        context: spec.prompt.len() + spec.warmup + spec.tokens + 1,
        chunk: spec.prefill_chunk,
        threads: args.threads,
        store: StoreOptions {
            readahead: 1,
            verify_experts: !args.no_verify_experts,
            policy: args.policy.clone(),
            spread_pins: args.trunk_pins == crate::cli::TrunkPins::Spread,
            ..StoreOptions::default()
        },
        pipeline: PipelineOptions {
            io: cell_io(args, io),
            mode: if serial { Mode::Serial } else { Mode::Pipelined },
            speculation,
        },
        prefetch_window: None,
        placement: None,
        trace_detail: false,
        trunk_share: None,
        available_memory: None,
    }
}

/// The backend and queue depth of every cell (and of the read-tax stream).
pub(super) fn cell_io(args: &BenchArgs, io: IoKind) -> IoOptions {
    // Checked at the start of the run (`check_device_io`).
    let device_kinds = crate::cli::device_kinds(io, &args.device_io).unwrap_or_default();
    IoOptions { kind: io, queue_depth: args.queue_depth, device_kinds, ..IoOptions::default() }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn run(seconds_per_token: f64) -> Measurement {
        Measurement { seconds_per_token, ..Measurement::default() }
    }

    #[test]
    fn a_cell_is_its_median_sample_beside_the_resident_run_of_that_samples_repeat() {
        let modes = vec!["no-spec".to_owned(), "pipelined".to_owned()];
        let rate = |budget_gb| DeviceRate { budget_gb, probed: 1.0, engine_busy: 1.0, used: 1.0 };
        // Two budgets, three repeats; the resident runs differ per budget and repeat.
        let mut samples = Vec::new();
        let mut residents = Vec::new();
        for (budget, base) in [(6.0, 1.0), (9.0, 2.0)] {
            for rep in 0..3 {
                let r = run(base / 8.0 + rep as f64 / 64.0);
                residents.push(RoundResident {
                    budget_gb: budget,
                    repeat: rep,
                    seconds_per_token: r.seconds_per_token,
                    m: r,
                });
            }
            // no-spec: the median (second fastest) ran in repeat 2; pipelined: in repeat 0.
            for (rep, spt) in [(0, 3.0), (1, 1.0), (2, 2.0)] {
                samples.push((budget, "no-spec".to_owned(), rep, run(base + spt)));
            }
            for (rep, spt) in [(0, 2.5), (1, 9.0), (2, 0.5)] {
                samples.push((budget, "pipelined".to_owned(), rep, run(base + spt)));
            }
        }
        let cells = median_cells(&samples, &residents, &[rate(6.0), rate(9.0)], &modes);
        let got: Vec<(f64, &str, f64, f64)> = cells
            .iter()
            .map(|c| {
                (c.budget_gb, c.mode.as_str(), c.m.seconds_per_token, c.resident.as_ref().unwrap().seconds_per_token)
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (6.0, "no-spec", 3.0, 0.15625),
                (6.0, "pipelined", 3.5, 0.125),
                (9.0, "no-spec", 4.0, 0.28125),
                (9.0, "pipelined", 4.5, 0.25),
            ]
        );
        // Without resident runs beside the repeats (--resident-once), none is attached.
        let cells = median_cells(&samples, &[], &[rate(6.0)], &modes);
        assert!(cells.iter().all(|c| c.resident.is_none()) && cells.len() == 2);
    }
}
