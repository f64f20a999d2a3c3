//! `k3ring run`: generate from a prompt, streaming tokens to stdout, then a summary.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args as _;
use serde::Serialize;

use super::pipeline_flags::PipelineArgs;
use super::{RunArgs, StorageArgs};
use crate::engine::{open_resident, open_streaming, peak_rss_bytes, GenerateOptions, Opened, Sampling, StreamingRun};
use crate::error::UsageError;
use crate::model::weights::WeightSource;
use crate::model::LayerHook;
use crate::pipeline::{IoKind, IoOptions, PipelineOptions};
use crate::storage::plan::{preset_bytes, Plan, GB};
use crate::storage::stream::{StoreOptions, StreamStats};
use crate::tokenizer::{StreamDecoder, Tokenizer};

#[derive(Serialize)]
struct RunReport<'a> {
    model: String,
    isa: &'a str,
    threads: usize,
    prompt_ids: &'a [u32],
    generated_ids: &'a [u32],
    text: String,
    prefill_seconds: f64,
    seconds_per_token: f64,
    peak_rss_bytes: Option<u64>,
    stopped_on_eos: bool,
    plan: Option<&'a Plan>,
    storage: Option<StreamStats>,
    pipeline: crate::trace::Metrics,
    speculation_recall: Option<f64>,
}

pub fn run(args: &RunArgs) -> anyhow::Result<()> {
    let kernels = super::kernels_for(&args.isa)?;
    if args.storage.trunk.is_none() && !args.pipeline.print_placement {
        refuse_streaming_flags(&args.given)?;
    }
    warn_unused_sampling_flags(args);
    let model_dir: PathBuf = match &args.model {
        Some(dir) => dir.clone(),
        None => super::embedded::tiny_model_dir()?,
    };
    let placement = args.pipeline.placement(args.threads)?;
    if args.pipeline.print_placement {
        println!("{}", placement.describe());
        return Ok(());
    }
    let Some(trunk) = &args.storage.trunk else {
        let opened = open_resident(&model_dir, args.threads, kernels)
            .with_context(|| format!("opening model {}", model_dir.display()))?;
        let prompt = prompt_ids(args, &opened.tokenizer)?;
        return generate(args, &model_dir, &opened, &prompt, None, |_| None);
    };
    eprintln!("k3ring: {}", placement.describe());
    // The plan depends on the context length, so the prompt is tokenized first.
    let tokenizer = Tokenizer::from_model_dir(&model_dir)?;
    let prompt = prompt_ids(args, &tokenizer)?;
    let mut run = streaming_run(args, &args.storage, prompt.len() + args.gen.max(1))?;
    run.placement = Some(placement);
    let (opened, plan) =
        open_streaming(&model_dir, trunk, &run, kernels, |plan| eprintln!("k3ring: {}", plan.describe()))
            .with_context(|| format!("opening model {} with trunk pack {}", model_dir.display(), trunk.display()))?;
    let s = opened.engine.src.stats();
    eprintln!("k3ring: reads: {} | buffers: {}", s.backend_info, s.buffers);
    generate(args, &model_dir, &opened, &prompt, Some(&plan), |src| Some(src.stats()))
}

/// Flags of the storage and pipeline groups that a resident run (no `--trunk`) honours. Every
/// other flag of those groups only shapes a streaming run, so it is refused without `--trunk`
/// rather than silently ignored; a flag added to either group is refused until listed here.
const RESIDENT_FLAGS: [&str; 3] = ["trunk", "print_placement", "dump_trace"];

const STREAMING: &str = "--trunk DIR (a streaming run, from a pack made by `k3ring pack`)";

/// Fails (exit 2) when `given` (the ids of the flags on the command line) names a flag that only
/// a streaming run uses. Ids, not values, because `--io uring` looks like no `--io` at all.
fn refuse_streaming_flags(given: &[String]) -> anyhow::Result<()> {
    let groups = PipelineArgs::augment_args(StorageArgs::augment_args(clap::Command::new("run")));
    let refused: Vec<String> = groups
        .get_arguments()
        .filter(|arg| !RESIDENT_FLAGS.contains(&arg.get_id().as_str()))
        .filter(|arg| given.iter().any(|id| id == arg.get_id().as_str()))
        .filter_map(|arg| arg.get_long().map(|long| format!("--{long}")))
        .collect();
    let message = match &refused[..] {
        [] => return Ok(()),
        [one] => format!("{one} needs {STREAMING}; add --trunk DIR or drop the flag"),
        [init @ .., last] => {
            format!("{} and {last} need {STREAMING}; add --trunk DIR or drop these flags", init.join(", "))
        }
    };
    Err(UsageError(message).into())
}

/// Greedy decoding takes the most likely token, which every top-k and top-p set contains, so the
/// filters change nothing at temperature 0. Harmless, hence a warning and not a refusal.
fn warn_unused_sampling_flags(args: &RunArgs) {
    let filters: Vec<&str> = [(args.top_k.is_some(), "--top-k"), (args.top_p.is_some(), "--top-p")]
        .into_iter()
        .filter_map(|(given, name)| given.then_some(name))
        .collect();
    if args.temperature == 0.0 && !filters.is_empty() {
        let verb = if filters.len() == 1 { "has" } else { "have" };
        tracing::warn!(
            "{} {verb} no effect at --temperature 0 (greedy decoding); give a temperature above 0 to sample",
            filters.join(" and ")
        );
    }
}

fn streaming_run(args: &RunArgs, st: &StorageArgs, context: usize) -> anyhow::Result<StreamingRun> {
    let available = crate::engine::mem_available_bytes().unwrap_or(0);
    let budget = match (st.mem_gb, &st.preset) {
        (Some(gb), _) => (gb * GB) as u64,
        (None, Some(name)) => preset_bytes(name, available)?,
        (None, None) => preset_bytes("auto", available)?,
    };
    let io = IoKind::parse(&st.io).ok_or_else(|| UsageError(format!("--io {:?} is unknown", st.io)))?;
    let pipe = &args.pipeline;
    Ok(StreamingRun {
        budget_bytes: budget,
        context,
        chunk: args.prefill_chunk,
        threads: args.threads,
        prefetch_window: None,
        placement: None,
        trace_detail: pipe.trace.is_some(),
        trunk_share: st.trunk_share,
        store: StoreOptions {
            readahead: st.readahead,
            lock_memory: !st.no_mlock,
            verify_every_read: st.verify_reads,
            policy: pipe.policy.clone(),
            ..StoreOptions::default()
        },
        pipeline: PipelineOptions {
            io: IoOptions { kind: io, queue_depth: st.queue_depth, ..IoOptions::default() },
            mode: pipe.mode(),
            speculation: pipe.speculation(),
        },
    })
}

fn generate<S: WeightSource + LayerHook>(
    args: &RunArgs,
    model_dir: &std::path::Path,
    opened: &Opened<S>,
    prompt: &[u32],
    plan: Option<&Plan>,
    storage: impl Fn(&S) -> Option<StreamStats>,
) -> anyhow::Result<()> {
    let (engine, tok) = (&opened.engine, &opened.tokenizer);
    let cfg = &engine.model.cfg;
    if let Some(&bad) = prompt.iter().find(|&&id| id as usize >= cfg.vocab_size) {
        return Err(UsageError(format!("--ids: token {bad} is outside the vocabulary of {}", cfg.vocab_size)).into());
    }
    let mut stop_ids = Vec::new();
    if !args.ignore_eos {
        stop_ids.push(cfg.eos_token_id);
        stop_ids.extend(tok.added_id("[EOS]"));
    }
    let opts = GenerateOptions {
        gen: args.gen,
        sampling: Sampling { temperature: args.temperature, top_k: args.top_k, top_p: args.top_p, seed: args.seed },
        stop_ids,
        full_recompute: args.full_recompute,
        prefill_chunk: args.prefill_chunk,
        keep_logits: false,
        route_log: args.pipeline.dump_trace.clone(),
    };
    let mut stream = StreamDecoder::default();
    let mut stdout = std::io::stdout().lock();
    let mut write_err: Option<std::io::Error> = None;
    let generation = engine.generate(prompt, &opts, |id| {
        let piece = stream.push(tok, id).unwrap_or_else(|_| format!("<{id}>"));
        if write_err.is_none() {
            if let Err(e) = stdout.write_all(piece.as_bytes()).and_then(|()| stdout.flush()) {
                write_err = Some(e);
            }
        }
    })?;
    let tail = stream.finish();
    let _ = writeln!(stdout, "{tail}");
    drop(stdout);
    if let Some(e) = write_err.filter(|e| e.kind() != std::io::ErrorKind::BrokenPipe) {
        return Err(e).context("writing tokens to stdout");
    }
    let peak = peak_rss_bytes();
    let stats = storage(&engine.src);
    let metrics = engine.model.tracer.as_ref().map(|t| t.metrics()).unwrap_or_default();
    if let (Some(path), Some(tracer)) = (&args.pipeline.trace, &engine.model.tracer) {
        tracer.write_chrome_json(path).with_context(|| format!("writing --trace {}", path.display()))?;
        eprintln!("k3ring: trace written to {}", path.display());
    }
    eprintln!(
        "k3ring: {} prompt + {} generated tokens | prefill {:.3} s | decode {:.4} s/token | peak RSS {} | {} threads, {} kernels",
        generation.prompt_ids.len(),
        generation.generated_ids.len(),
        generation.prefill_seconds,
        generation.seconds_per_token,
        peak.map_or_else(|| "unknown".to_owned(), |b| format!("{:.1} MiB", b as f64 / 1048576.0)),
        engine.threads(),
        engine.model.kernels.isa().name(),
    );
    if let (Some(s), Some(p)) = (&stats, plan) {
        print_streaming_summary(s, p, peak, &metrics);
    }
    if let Some(path) = &args.json {
        let report = RunReport {
            model: model_dir.display().to_string(),
            isa: engine.model.kernels.isa().name(),
            threads: engine.threads(),
            prompt_ids: &generation.prompt_ids,
            generated_ids: &generation.generated_ids,
            text: tok.decode(&generation.generated_ids)?,
            prefill_seconds: generation.prefill_seconds,
            seconds_per_token: generation.seconds_per_token,
            peak_rss_bytes: peak,
            stopped_on_eos: generation.stopped_on.is_some(),
            plan,
            speculation_recall: stats
                .as_ref()
                .filter(|s| s.routed_experts > 0)
                .map(|s| s.routed_recalled as f64 / s.routed_experts as f64),
            storage: stats,
            pipeline: metrics,
        };
        std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
            .with_context(|| format!("writing --json {}", path.display()))?;
    }
    Ok(())
}

fn prompt_ids(args: &RunArgs, tok: &Tokenizer) -> anyhow::Result<Vec<u32>> {
    let mut ids = Vec::new();
    if args.bos {
        ids.extend(tok.added_id("[BOS]"));
    }
    if let Some(list) = &args.ids {
        ids.extend_from_slice(list);
    } else {
        let text = match (&args.prompt, &args.prompt_file) {
            (Some(t), _) => t.clone(),
            (None, Some(f)) => {
                std::fs::read_to_string(f).with_context(|| format!("reading --prompt-file {}", f.display()))?
            }
            (None, None) => return Err(UsageError("give --prompt, --prompt-file or --ids".into()).into()),
        };
        ids.extend(tok.encode_with_added(&text)?);
    }
    if ids.is_empty() {
        return Err(UsageError("the prompt encodes to zero tokens".into()).into());
    }
    Ok(ids)
}

/// The storage and pipeline lines of a streaming run's summary.
fn print_streaming_summary(s: &StreamStats, p: &Plan, peak: Option<u64>, metrics: &crate::trace::Metrics) {
    eprintln!(
        "k3ring: storage {} | trunk read {:.1} MiB ({} reads, {}/{} units pinned) | experts read {:.1} MiB ({} reads, {} hits, {} evictions) | read rate {:.0} MB/s | planned {:.3} GB, peak RSS {}",
        s.backend,
        s.trunk_bytes_read as f64 / 1048576.0,
        s.trunk_reads,
        s.trunk_pinned_units,
        s.trunk_pinned_units + s.trunk_streamed_units,
        s.expert_bytes_read as f64 / 1048576.0,
        s.expert_reads,
        s.expert_hits,
        s.expert_evictions,
        s.read_bytes_per_second / 1e6,
        p.planned_bytes as f64 / GB,
        peak.map_or_else(|| "unknown".to_owned(), |b| format!("{:.3} GB", b as f64 / GB)),
    );
    let recall = if s.routed_experts > 0 { s.routed_recalled as f64 / s.routed_experts as f64 } else { 0.0 };
    eprintln!(
        "k3ring: pipeline | I/O busy {:.0}% | compute busy {:.0}% | overlap {:.0}% | stalled {:.3} s | recall {:.0}% | speculative reads {} ({:.1} MiB, {:.1} MiB wasted, {} cancelled) | layer trials won {} lost {}",
        100.0 * metrics.io_busy_fraction,
        100.0 * metrics.compute_busy_fraction,
        100.0 * metrics.overlap_fraction,
        metrics.stall_us / 1e6,
        100.0 * recall,
        s.spec_reads,
        s.spec_bytes as f64 / 1048576.0,
        s.spec_wasted_bytes as f64 / 1048576.0,
        s.spec_cancelled,
        s.spec_trials_won,
        s.spec_trials_lost,
    );
}
