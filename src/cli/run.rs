//! `k3ring run`: generate from a prompt, streaming tokens to stdout, then a summary.

use std::io::{IsTerminal, Write};

use anyhow::Context;
use clap::Args as _;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use super::budget::name_budget_flag;
use super::output::{create_now, JsonOut};
use super::pipeline_flags::PipelineArgs;
use super::startup::{start_up, startup_flags, Started};
use super::summary::{print_run_line, print_streaming_summary, recall};
use super::{RunArgs, StorageArgs};
use crate::engine::DraftStats;
use crate::engine::{
    context_needed, open_resident, open_streaming, peak_rss_bytes, state_file, ChatSession, Fingerprint,
    GenerateOptions, Generation, Opened, ReplyOptions, Sampling, StreamingRun,
};
use crate::error::UsageError;
use crate::interrupt::Interrupted;
use crate::model::attribution::{AttributionTable, Window};
use crate::model::weights::WeightSource;
use crate::model::LayerHook;
use crate::pipeline::{IoKind, IoOptions, PipelineOptions};
use crate::storage::plan::{preset_bytes, Plan, GB, PRESET_AUTO_PERCENT, PRESET_MAX_PERCENT};
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
    /// Stopped by Ctrl-C; the other fields cover the run so far.
    interrupted: bool,
    plan: Option<&'a Plan>,
    storage: Option<StreamStats>,
    pipeline: crate::trace::Metrics,
    speculation_recall: Option<f64>,
    /// Decode steps and drafting (`draft.steps` only, when not drafting).
    draft: DraftReport,
    /// With `--logprobs N`: per generated token, its log-probability and N alternatives.
    #[serde(skip_serializing_if = "Option::is_none")]
    logprobs: Option<&'a [crate::engine::logprobs::TokenLogprob]>,
    /// With `--trace`: the decode's time and weight bytes per operation class (issue 19), the
    /// rows summing to `seconds_per_token`; no triad is measured in a run, so no fractions.
    #[serde(skip_serializing_if = "Option::is_none")]
    attribution: Option<AttributionTable>,
}

/// What drafting did in a run (`--json`'s `draft`).
#[derive(Serialize)]
pub(super) struct DraftReport {
    /// The options, when drafting.
    options: Option<crate::engine::DraftOptions>,
    #[serde(flatten)]
    stats: DraftStats,
    acceptance: f64,
    tokens_per_step: f64,
    /// Bytes read from storage per token of the decode (streamed runs; the first token comes
    /// from the prefill and is not counted).
    bytes_read_per_token: Option<f64>,
}

impl DraftReport {
    pub(super) fn new(
        options: Option<&crate::engine::DraftOptions>,
        stats: DraftStats,
        decode_bytes: Option<u64>,
        decoded: usize,
    ) -> Self {
        DraftReport {
            options: options.cloned(),
            stats,
            acceptance: stats.acceptance(),
            tokens_per_step: stats.tokens_per_step(),
            bytes_read_per_token: decode_bytes.filter(|_| decoded > 0).map(|b| b as f64 / decoded as f64),
        }
    }

    /// The report of `g`, its summary line printed when drafting.
    fn printed(options: Option<&crate::engine::DraftOptions>, g: &Generation, decode_bytes: Option<u64>) -> Self {
        let report = DraftReport::new(options, g.draft, decode_bytes, g.generated_ids.len().saturating_sub(1));
        if let Some(line) = report.line() {
            eprintln!("k3ring: {line}");
        }
        report
    }

    /// The summary line, when drafting.
    pub(super) fn line(&self) -> Option<String> {
        let o = self.options.as_ref()?;
        let s = &self.stats;
        let read = self
            .bytes_read_per_token
            .map_or_else(String::new, |b| format!(" | read {:.4} GB per decoded token", b / GB));
        Some(format!(
            "draft ngram (up to {} tokens, n-gram of {}+) | {} steps, {} with a draft | drafted {}, accepted {} ({:.0}%) | {:.2} tokens per step{read}",
            o.len,
            o.ngram_min,
            s.steps,
            s.drafted_steps,
            s.drafted,
            s.accepted,
            100.0 * self.acceptance,
            self.tokens_per_step,
        ))
    }
}

/// Storage bytes read so far (trunk, embedding rows and experts).
fn bytes_read(s: &StreamStats) -> u64 {
    s.trunk_bytes_read + s.embed_bytes_read + s.expert_bytes_read
}

pub fn run(args: &RunArgs) -> anyhow::Result<()> {
    run_naming_budget(args, None)
}

/// `run`, naming `budget_flag` (when given) rather than run's own budget flags if the plan refuses
/// the budget: the demo's budget comes from its `--budget-share`.
pub(super) fn run_naming_budget(args: &RunArgs, budget_flag: Option<&str>) -> anyhow::Result<()> {
    let flags = startup_flags!(args);
    let Some(Started { kernels, model_dir, placement }) = start_up(&flags)? else {
        return Ok(());
    };
    warn_unused_sampling_flags(args);
    args.drafting.check(&run_sampling(args), true)?;
    let outputs = Outputs::open(args)?;
    if args.model.is_none() || super::embedded::has_random_weights(&model_dir) {
        // New users read the reserved-token soup of a random model as a bug: say so first.
        eprintln!(
            "k3ring: note: this model has random weights (a synthetic test model): the text it generates is \
             meaningless by design"
        );
    }
    let Some(trunk) = &args.storage.trunk else {
        let opened = open_resident(&model_dir, args.threads, kernels)
            .with_context(|| format!("opening model {}", model_dir.display()))?;
        let prompt = prompt_ids(args, &opened.tokenizer, &opened.engine.model.cfg)?;
        return generate(args, &outputs, &model_dir, &opened, &prompt, None, |_| None);
    };
    if let Some(p) = &placement {
        eprintln!("k3ring: {}", p.describe());
    }
    // The plan depends on the context length, so the prompt is tokenized first.
    let cfg = crate::config::Config::from_model_dir(&model_dir)?;
    let tokenizer = Tokenizer::from_model_dir_or_ids(&model_dir, cfg.vocab_size)?;
    let prompt = prompt_ids(args, &tokenizer, &cfg)?;
    let flag = budget_flag.map_or_else(|| typed_budget_flag(&args.storage), str::to_owned);
    let saved = match &args.load_state {
        Some(path) => crate::engine::state_file::peek(path).context("reading --load-state")?.ids.len(),
        None => 0,
    };
    let context = context_needed(&cfg, saved + prompt.len(), args.gen)?;
    let mut run = streaming_run(&args.pipeline, &args.storage, args.threads, args.prefill_chunk, context)
        .map_err(|e| name_budget_flag(e, &flag))?;
    run.placement = placement;
    if !args.full_recompute {
        run.drafting = args.drafting.plan(&run_sampling(args));
    }
    let (opened, plan) =
        open_streaming(&model_dir, trunk, &run, kernels, |plan| eprintln!("k3ring: {}", plan.describe()))
            .with_context(|| format!("opening model {} with trunk pack {}", model_dir.display(), trunk.display()))
            .map_err(|e| name_budget_flag(e, &flag))?;
    let s = opened.engine.src.stats();
    eprintln!("k3ring: reads: {} | buffers: {}", s.backend_info, s.buffers);
    if !s.expert_placement.is_empty() {
        eprintln!("k3ring: {}", s.expert_placement);
    }
    let mut args = args.clone();
    args.drafting.yield_to(&plan);
    let args = &args;
    generate(args, &outputs, &model_dir, &opened, &prompt, Some(&plan), |src| {
        // Reads still in flight (guesses, read-ahead) land first, so the report and the trace agree.
        src.settle();
        Some(src.stats())
    })
}

/// Flags of the storage and pipeline groups that a resident run (no `--trunk`) honours. Every
/// other flag of those groups only shapes a streaming run, so it is refused without `--trunk`
/// rather than silently ignored; a flag added to either group is refused until listed here.
const RESIDENT_FLAGS: [&str; 3] = ["trunk", "print_placement", "dump_trace"];

const STREAMING: &str = "--trunk DIR (a streaming run, from a pack made by `k3ring pack`)";

/// Fails (exit 2) when `given` (the ids of the flags on the command line) names a flag that only
/// a streaming run uses. Ids, not values, because `--io uring` looks like no `--io` at all.
pub(super) fn refuse_streaming_flags(given: &[String]) -> anyhow::Result<()> {
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

/// The budget flag as the user gave it (or the default that applied).
pub(super) fn typed_budget_flag(st: &StorageArgs) -> String {
    match (st.mem_gb, &st.preset) {
        (Some(gb), _) => format!("--mem-gb {gb}"),
        (None, Some(name)) => format!("--preset {name}"),
        (None, None) => "--preset auto (the default budget)".to_owned(),
    }
}

/// The streaming run the storage and pipeline flags ask for (one sequence).
pub(super) fn streaming_run(
    pipe: &PipelineArgs,
    st: &StorageArgs,
    threads: usize,
    chunk: usize,
    context: usize,
) -> anyhow::Result<StreamingRun> {
    pipe.refuse_unused_speculation()?;
    // Read once: the preset and the plan's check of it must see the same number. A given budget
    // waits for memory a run that just ended is still returning.
    let available = match st.mem_gb {
        Some(gb) => crate::memory::available_for(crate::memory::need_for_budget((gb * GB) as u64)),
        None => crate::memory::available(),
    };
    let budget = match (st.mem_gb, &st.preset) {
        (Some(gb), _) => (gb * GB) as u64,
        (None, preset) => {
            let name = preset.as_deref().unwrap_or("auto");
            let budget = preset_bytes(name, available.as_ref().map_or(0, |a| a.bytes))?;
            if let Some(a) = available.as_ref().filter(|_| matches!(name, "max" | "auto")) {
                let share = if name == "max" { PRESET_MAX_PERCENT } else { PRESET_AUTO_PERCENT };
                eprintln!("k3ring: --preset {name}: budget {:.3} GB, {share}% of {a}", budget as f64 / GB);
            }
            budget
        }
    };
    let io = IoKind::parse(&st.io).map_err(|e| UsageError(format!("--io {e}")))?;
    let device_kinds = super::device_kinds(io, &st.device_io)?;
    Ok(StreamingRun {
        drafting: Default::default(),
        budget_bytes: budget,
        sequences: 1,
        context,
        chunk,
        threads,
        prefetch_window: None,
        placement: None,
        trace_detail: pipe.trace.is_some(),
        trunk_share: st.trunk_share,
        available_memory: available,
        store: StoreOptions {
            readahead: st.readahead,
            lock_memory: !st.no_mlock,
            verify_every_read: st.verify_reads,
            verify_experts: !st.no_verify_experts,
            policy: pipe.policy.clone(),
            piece_bytes: st.piece_mb.map(|mb| (mb * 1e6).round() as u64),
            spread_pins: st.trunk_pins == super::TrunkPins::Spread,
            ..StoreOptions::default()
        },
        pipeline: PipelineOptions {
            io: IoOptions { kind: io, queue_depth: st.queue_depth, device_kinds, ..IoOptions::default() },
            mode: pipe.mode(),
            speculation: pipe.speculation(),
        },
    })
}

/// The output files of a run, created before the model is opened (see `output`).
struct Outputs {
    json: Option<JsonOut>,
    /// `--dump-trace`: the routing trace, written as the run routes.
    dump_trace: Option<crate::files::Output>,
}

impl Outputs {
    fn open(args: &RunArgs) -> anyhow::Result<Outputs> {
        let json = JsonOut::open(args.json.as_deref())?;
        if args.logits.is_some() && (args.load_state.is_some() || args.save_state.is_some()) {
            return Err(UsageError("--logits does not go with --load-state or --save-state".into()).into());
        }
        if args.logprobs.is_some() && (args.load_state.is_some() || args.save_state.is_some()) {
            return Err(UsageError("--logprobs does not go with --load-state or --save-state".into()).into());
        }
        let files = [("--trace", &args.pipeline.trace), ("--logits", &args.logits)];
        for (flag, path) in files {
            if let Some(path) = path {
                create_now(flag, path)?;
            }
        }
        if let Some(path) = &args.save_state {
            super::output::create_file_now("--save-state", path)?;
        }
        let dump_trace = args.pipeline.dump_trace.as_deref().map(|p| create_now("--dump-trace", p)).transpose()?;
        Ok(Outputs { json, dump_trace })
    }

    /// `--json -`: the report is stdout's only content (it holds the generated text).
    fn json_on_stdout(&self) -> bool {
        JsonOut::is_stdout(self.json.as_ref())
    }
}

fn generate<S: WeightSource + LayerHook>(
    args: &RunArgs,
    outputs: &Outputs,
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
    let opts = GenerateOptions { route_log: outputs.dump_trace.clone(), ..generate_options(args, cfg, tok) };
    if let Some(path) = tok.missing_vocab() {
        eprintln!("k3ring: no tokenizer ({} is missing): printing token ids as <id>, not text", path.display());
    }
    let mut stream = StreamDecoder::showing_special(args.show_special);
    let mut stdout = std::io::stdout().lock();
    let mut write_err: Option<std::io::Error> = None;
    let bar = prefill_bar(prompt.len(), args.prefill_chunk, std::io::stderr().is_terminal());
    let quiet = outputs.json_on_stdout();
    let on_token = |id| {
        let piece = stream.push(tok, id).unwrap_or_else(|_| format!("<{id}>"));
        if write_err.is_none() && !quiet {
            if let Err(e) = stdout.write_all(piece.as_bytes()).and_then(|()| stdout.flush()) {
                write_err = Some(e);
            }
        }
    };
    // The attribution's window is the decode, like s/token: it restarts when the prompt is done.
    let attribution_window_started = std::cell::Cell::new(false);
    let read_at_decode = std::cell::Cell::new(None);
    let on_prefill = |done: usize, total: usize| {
        if done == total {
            attribution_window_started.set(restart_attribution(&engine.model));
            read_at_decode.set(storage(&engine.src).as_ref().map(bytes_read));
        }
        if let Some(bar) = &bar {
            bar.set_position(done as u64);
            if done == total {
                bar.finish_and_clear();
            }
        }
    };
    let generation = if args.load_state.is_some() || args.save_state.is_some() {
        generate_stateful(args, model_dir, opened, prompt, &opts, on_token)
    } else {
        engine.generate_with(prompt, &opts, on_token, on_prefill).map_err(anyhow::Error::from)
    };
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    let generation = generation?;
    let tail = stream.finish();
    if !quiet {
        let _ = writeln!(stdout, "{tail}");
    }
    drop(stdout);
    if let Some(e) = write_err.filter(|e| e.kind() != std::io::ErrorKind::BrokenPipe) {
        return Err(e).context("writing tokens to stdout");
    }
    let peak = peak_rss_bytes();
    let stats = storage(&engine.src);
    let metrics = engine.model.tracer.as_ref().map(|t| t.metrics()).unwrap_or_default();
    write_trace(args, &engine.model)?;
    print_run_line(&generation, peak, engine.threads(), engine.model.kernels.isa().name());
    let decode_bytes = stats.as_ref().zip(read_at_decode.get()).map(|(s, at)| bytes_read(s).saturating_sub(at));
    let draft = DraftReport::printed(opts.draft.as_ref(), &generation, decode_bytes);
    if let (Some(s), Some(p)) = (&stats, plan) {
        print_streaming_summary(s, p, peak, &metrics);
    }
    let attribution = decode_attribution(&engine.model, &generation, attribution_window_started.get());
    if let Some(out) = &outputs.json {
        let report = RunReport {
            model: model_dir.display().to_string(),
            isa: engine.model.kernels.isa().name(),
            threads: engine.threads(),
            prompt_ids: &generation.prompt_ids,
            generated_ids: &generation.generated_ids,
            text: tok.decode_or_mark(&generation.generated_ids, args.show_special),
            prefill_seconds: generation.prefill_seconds,
            seconds_per_token: generation.seconds_per_token,
            peak_rss_bytes: peak,
            stopped_on_eos: generation.stopped_on.is_some(),
            interrupted: generation.interrupted,
            plan,
            speculation_recall: stats.as_ref().and_then(recall),
            storage: stats,
            pipeline: metrics,
            draft,
            logprobs: args.logprobs.map(|_| &generation.logprobs[..]),
            attribution,
        };
        out.write(&report)?;
    }
    if let Some(path) = &args.logits {
        let fp = Fingerprint::of_dir(model_dir)?;
        super::logits::write(path, &generation, cfg.vocab_size, args.logits_top, fp)?;
    }
    if generation.interrupted {
        return Err(Interrupted {
            prompt_done: generation.prompt_done,
            prompt: generation.prompt_ids.len(),
            generated: generation.generated_ids.len(),
        }
        .into());
    }
    Ok(())
}

/// Generation through a [`ChatSession`], which can start from a saved state and be saved: the
/// saved tokens come first, then `prompt`. The session's reply loop is `generate`'s, so the ids
/// equal those of a fresh run over the saved tokens plus the prompt.
fn generate_stateful<S: WeightSource + LayerHook>(
    args: &RunArgs,
    model_dir: &std::path::Path,
    opened: &Opened<S>,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32),
) -> anyhow::Result<Generation> {
    if opts.full_recompute || opts.route_log.is_some() {
        return Err(
            UsageError("--load-state and --save-state do not go with --full-recompute or --dump-trace".into()).into()
        );
    }
    let engine = &opened.engine;
    let fp = Fingerprint::of_dir(model_dir)?;
    let saved = match &args.load_state {
        Some(path) => state_file::peek(path).context("reading --load-state")?.ids.len(),
        None => 0,
    };
    let capacity = context_needed(&engine.model.cfg, saved + prompt.len(), opts.gen)?;
    let mut sess = ChatSession::new(engine, capacity, opts.prefill_chunk)?;
    if let Some(path) = &args.load_state {
        sess.restore(engine, path, fp)?;
        eprintln!("k3ring: state loaded from {} ({} tokens, {} to prefill)", path.display(), saved, saved - sess.fed());
    }
    sess.push(prompt);
    let reply_opts = ReplyOptions {
        constraint: None,
        max_tokens: opts.gen,
        sampling: opts.sampling.clone(),
        stop_ids: opts.stop_ids.clone(),
        stop: opts.stop,
        draft: opts.draft.clone(),
    };
    let reply = sess.reply(engine, &reply_opts, |id| {
        on_token(id);
        true
    })?;
    if let Some(path) = &args.save_state {
        sess.save(&super::output::create_file_now("--save-state", path)?, fp, &[])?;
        eprintln!("k3ring: state saved to {} ({} tokens, {} fed)", path.display(), sess.ids().len(), sess.fed());
    }
    let steps = reply.ids.len().saturating_sub(1).max(1);
    Ok(Generation {
        prompt_ids: prompt.to_vec(),
        // Generated tokens are fed too, hence the cap.
        prompt_done: sess.fed().saturating_sub(saved).min(prompt.len()),
        seconds_per_token: reply.decode_seconds / steps as f64,
        generated_ids: reply.ids,
        prefill_seconds: reply.prefill_seconds,
        decode_seconds: reply.decode_seconds,
        stopped_on: reply.stopped_on,
        interrupted: reply.interrupted,
        logits: Vec::new(),
        logprobs: Vec::new(),
        prompt_logits: Vec::new(),
        draft: reply.draft,
    })
}

/// The sampling `args` ask for; `--top-k 0` is "off", as in llama.cpp.
fn run_sampling(args: &RunArgs) -> Sampling {
    Sampling { temperature: args.temperature, top_k: args.top_k.filter(|&k| k > 0), top_p: args.top_p, seed: args.seed }
}

/// The generation `args` ask for; Ctrl-C stops it.
fn generate_options(args: &RunArgs, cfg: &crate::config::Config, tok: &Tokenizer) -> GenerateOptions {
    let mut stop_ids = Vec::new();
    if !args.ignore_eos {
        stop_ids.push(cfg.eos_token_id);
        stop_ids.extend(tok.added_id("[EOS]"));
    }
    let sampling = run_sampling(args);
    GenerateOptions {
        gen: args.gen,
        // Full recompute re-runs the prefix every step: nothing to draft.
        draft: args.drafting.options(&sampling).filter(|_| !args.full_recompute),
        sampling,
        stop_ids,
        full_recompute: args.full_recompute,
        prefill_chunk: args.prefill_chunk,
        keep_logits: args.logits.is_some(),
        logprobs: args.logprobs,
        prompt_logits: args.logits.is_some(),
        route_log: None,
        stop: Some(crate::interrupt::flag()),
    }
}

/// Prompts of more chunks than this get a prefill progress bar (on a terminal).
const PREFILL_BAR_MIN_CHUNKS: usize = 4;

/// A progress bar for the prefill of a long prompt, when stderr is a terminal.
fn prefill_bar(prompt: usize, chunk: usize, terminal: bool) -> Option<ProgressBar> {
    if !terminal || prompt <= PREFILL_BAR_MIN_CHUNKS * chunk.max(1) {
        return None;
    }
    let bar = ProgressBar::new(prompt as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} prefill [{bar:40}] {pos}/{len} tokens {per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    Some(bar)
}

/// The prompt's ids; `--bos` prepends the model's `bos_token_id` (config.json) whether or not
/// the tokenizer names it. A prompt file is read up to what the model's context can hold.
fn prompt_ids(args: &RunArgs, tok: &Tokenizer, cfg: &crate::config::Config) -> anyhow::Result<Vec<u32>> {
    let mut ids = Vec::new();
    if args.bos {
        ids.push(cfg.bos_token_id);
    }
    if let Some(list) = &args.ids {
        ids.extend_from_slice(list);
    } else {
        let text = match (&args.prompt, &args.prompt_file) {
            (Some(t), _) => t.clone(),
            (None, Some(f)) => {
                let bytes = read_prompt_file(f, crate::engine::text_bytes_max(cfg, tok), tok.max_token_bytes())?;
                // Not text is a bad argument (exit 2), not a failed read (exit 4).
                String::from_utf8(bytes).map_err(|e| {
                    let at = e.utf8_error().valid_up_to();
                    UsageError(format!("--prompt-file {}: not UTF-8 text (invalid byte at offset {at})", f.display()))
                })?
            }
            (None, None) if args.load_state.is_some() => return Ok(ids),
            (None, None) => return Err(UsageError("give --prompt, --prompt-file or --ids".into()).into()),
        };
        ids.extend(tok.encode_with_added(&text)?);
    }
    if ids.is_empty() {
        return Err(UsageError("the prompt encodes to zero tokens".into()).into());
    }
    Ok(ids)
}

/// The summary line of every run: tokens, times, rates, peak RSS, threads and kernels.
/// Restarts the attribution's counters (at the end of the prompt); false when it is off.
fn restart_attribution(model: &crate::model::Model) -> bool {
    model.attribution.as_ref().map(|a| a.reset()).is_some()
}

/// With `--trace`, the decode's attribution table (issue 19), printed on stderr; `None` when
/// attribution is off or its window (the decode) never started.
fn decode_attribution(
    model: &crate::model::Model,
    generation: &crate::engine::Generation,
    started: bool,
) -> Option<AttributionTable> {
    let a = model.attribution.as_ref().filter(|_| started)?;
    // Every generated token but the last went through a forward pass of the decode.
    let tokens = generation.generated_ids.len().saturating_sub(1);
    let table = Window::of(a, tokens, generation.decode_seconds).table(None, None);
    if table.tokens > 0 {
        eprintln!(
            "k3ring: decode by operation class (GB/s: weight bytes over the class's time; idle: threads idle inside parallel products; other: waits for reads, copies, bookkeeping):"
        );
        for line in table.lines() {
            eprintln!("k3ring:   {line}");
        }
    }
    Some(table)
}

/// `--trace FILE`, when given and the run was traced.
fn write_trace(args: &RunArgs, model: &crate::model::Model) -> anyhow::Result<()> {
    if let (Some(path), Some(tracer)) = (&args.pipeline.trace, &model.tracer) {
        tracer.write_chrome_json(&create_now("--trace", path)?)?;
        eprintln!("k3ring: trace written to {}", path.display());
    }
    Ok(())
}

/// `--prompt-file FILE`, or stdin for `-`, read up to `max` bytes (what `positions` can hold at
/// `per_token` bytes per token at most): anything longer cannot fit and is refused (exit 2)
/// having read one byte more than that, so a device or an endless pipe ends the read too.
fn read_prompt_file(f: &std::path::Path, (positions, max): (usize, u64), per_token: usize) -> anyhow::Result<Vec<u8>> {
    let read = if f.as_os_str() == super::output::STDOUT {
        crate::files::input::read_bounded(std::io::stdin().lock(), max).context("reading --prompt-file - (stdin)")?
    } else {
        let file = std::fs::File::open(f).with_context(|| format!("reading --prompt-file {}", f.display()))?;
        crate::files::input::read_bounded(file, max)
            .with_context(|| format!("reading --prompt-file {}", f.display()))?
    };
    read.ok_or_else(|| {
        UsageError(format!(
            "--prompt-file {}: more than {max} bytes, beyond the model's context of {positions} positions (no token is \
             longer than {per_token} bytes)",
            f.display()
        ))
        .into()
    })
}

#[cfg(test)]
mod tests {
    use super::prefill_bar;

    #[test]
    fn prefill_bar_only_for_long_prompts_on_a_terminal() {
        assert!(prefill_bar(1000, 32, true).is_some());
        assert!(prefill_bar(1000, 32, false).is_none(), "not on a pipe or file");
        assert!(prefill_bar(128, 32, true).is_none(), "four chunks or fewer");
        assert!(prefill_bar(129, 32, true).is_some());
    }
}
