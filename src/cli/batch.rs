//! `k3ring batch`: requests from JSONL decoded together (continuous batching), one result line
//! per request as it finishes.
//!
//! The whole input is read first: every line is checked (a bad one gets an error record naming
//! its line and the run goes on), and the longest request sizes the sequence slots. Each
//! sequence's tokens are those of its solo `k3ring run` with the same settings.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;

use super::budget::name_budget_flag;
use super::pipeline_flags::PipelineArgs;
use super::run::{streaming_run, typed_budget_flag};
use super::startup::{start_up, startup_flags, Started};
use super::summary::print_streaming_summary;
use super::StorageArgs;
use crate::chat::calls::declared_calls;
use crate::chat::parse::{Channel, CompletionParser, Event as ParseEvent};
use crate::config::Config;
use crate::engine::requests::{parse_request_line, RequestDefaults};
use crate::engine::{
    open_resident, open_streaming, peak_rss_bytes, BatchOptions, BatchRequest, BatchSink, BatchStats, FinishReason,
    Finished, Opened, Ticket,
};
use crate::error::UsageError;
use crate::files::{Output, OutputWriter};
use crate::model::weights::WeightSource;
use crate::model::LayerHook;
use crate::storage::plan::Plan;
use crate::storage::stream::StreamStats;
use crate::tokenizer::{StreamDecoder, Tokenizer};

#[derive(Debug, clap::Args)]
#[command(allow_negative_numbers = true, args_override_self = true)]
pub struct BatchArgs {
    /// Model directory; without it, the tiny K3 model built into the binary.
    #[arg(short = 'm', long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Requests, one JSON object per line ("-" reads stdin): {"id", "prompt" | "ids",
    /// "max_tokens", "temperature", "top_k", "top_p", "seed", "stop"}.
    #[arg(long, value_name = "FILE")]
    pub input: PathBuf,
    /// Results, one JSON object per line as each request finishes ("-" writes stdout).
    #[arg(long, value_name = "FILE")]
    pub output: PathBuf,
    /// Sequences decoded together at most (fewer when the budget or memory holds fewer).
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = super::parse_batch_size)]
    pub max_batch: usize,
    /// Tokens to generate for a request that gives no max_tokens.
    #[arg(long, value_name = "N", default_value_t = 32)]
    pub max_tokens: usize,
    /// Positions of each sequence slot; a request needing more gets an error record
    /// (default: what the longest request needs).
    #[arg(short = 'c', long, value_name = "N", value_parser = super::parse_slot_positions)]
    pub context: Option<usize>,
    /// Prompt tokens per step, over all sequences being prefilled.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = super::parse_chunk)]
    pub prefill_chunk: usize,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Compute threads (0 = one per core).
    #[arg(short = 't', long, value_name = "N", default_value_t = 0, value_parser = super::parse_threads)]
    pub threads: usize,
    /// Kernel instruction set: auto (the best this CPU has), scalar, avx2 or avx512.
    #[arg(long, value_name = "ISA", default_value = "auto")]
    pub isa: String,
    #[command(flatten)]
    pub storage: StorageArgs,
    #[command(flatten)]
    pub pipeline: PipelineArgs,
    #[command(flatten)]
    pub drafting: super::draft_flags::DraftArgs,
    /// Sequences that may carry a draft in one step. Each holds a journal of the KDA states
    /// while its step runs (about 0.5 GB on the release model), taken from the budget once
    #[arg(long, value_name = "N", default_value_t = crate::engine::draft::DEFAULT_DRAFT_SEQUENCES, value_parser = super::parse_batch_size)]
    pub draft_sequences: usize,
    /// Write the summary as JSON to FILE ("-": to stdout, when --output is a file). Created
    /// before the model is opened.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Ids of the flags given on the command line (filled by `main`).
    #[arg(skip)]
    pub given: Vec<String>,
}

/// A checked request and its line.
struct Parsed {
    id: serde_json::Value,
    line: usize,
    request: BatchRequest,
    stop: Vec<String>,
    chat: Option<crate::engine::requests::ChatReply>,
}

/// A line that cannot run: its record names the line.
#[derive(Serialize)]
struct ErrorRecord {
    id: Option<serde_json::Value>,
    line: usize,
    error: String,
}

#[derive(Serialize)]
struct ResultRecord<'a> {
    id: &'a serde_json::Value,
    prompt_tokens: usize,
    generated_ids: &'a [u32],
    /// A `messages` reply's content (its reasoning apart); otherwise the whole text.
    text: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<&'a str>,
    /// The tool calls of a `messages` reply, in OpenAI's shape.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<serde_json::Value>,
    finish_reason: FinishReason,
    seconds: f64,
}

#[derive(Serialize)]
struct Summary<'a> {
    model: String,
    requests: usize,
    succeeded: usize,
    failed: usize,
    interrupted: bool,
    slots: usize,
    slots_asked: usize,
    context: usize,
    prompt_tokens: u64,
    generated_tokens: u64,
    seconds: f64,
    /// Generated tokens over the seconds from the first step to the last.
    tokens_per_second: f64,
    steps: u64,
    /// Decode rows per step on average (sequences decoding together).
    mean_batch: f64,
    /// Trunk and expert bytes read per generated token (streaming runs).
    bytes_read_per_token: Option<f64>,
    peak_rss_bytes: Option<u64>,
    plan: Option<&'a Plan>,
    storage: Option<StreamStats>,
    /// Decode steps of the finished sequences and their drafting.
    draft: super::run::DraftReport,
    /// Seconds the masks of constrained replies took (`response_format`, forced calls).
    #[serde(skip_serializing_if = "Option::is_none")]
    constraint_seconds: Option<f64>,
}

pub fn run(args: &BatchArgs) -> anyhow::Result<()> {
    args.drafting.check(&crate::engine::Sampling::default(), false)?;
    let flags = startup_flags!(args);
    if args.pipeline.dump_trace.is_some() {
        return Err(UsageError(
            "--dump-trace records the routing of one sequence; use `k3ring run` for it, not batch".into(),
        )
        .into());
    }
    let json_on_stdout = args.json.as_deref() == Some(Path::new(super::output::STDOUT));
    if json_on_stdout && args.output == Path::new(super::output::STDOUT) {
        return Err(UsageError("--json - and --output - would both write stdout; send one to a file".into()).into());
    }
    let Some(Started { kernels, model_dir, placement }) = start_up(&flags)? else {
        return Ok(());
    };
    let json = super::output::JsonOut::open(args.json.as_deref())?;
    if let Some(path) = &args.pipeline.trace {
        super::output::create_now("--trace", path)?;
    }
    let cfg = Config::from_model_dir(&model_dir)?;
    // Token-id requests need no tokenizer files (as `run --ids`): without them a text prompt is
    // refused on its line, and texts are written as `<id>` marks.
    let tokenizer = Tokenizer::from_model_dir_or_ids(&model_dir, cfg.vocab_size)?;
    if let Some(path) = tokenizer.missing_vocab() {
        eprintln!(
            "k3ring: no tokenizer ({} is missing): requests must give \"ids\", and texts are written as <id> marks",
            path.display()
        );
    }
    let text = read_input(&args.input, input_line_max(&cfg, &tokenizer))?;
    let mut out = open_output(&args.output)?;
    let (parsed, errors) = parse_requests(&text, args, &cfg, &tokenizer);
    let lines = parsed.len() + errors.len();
    for e in &errors {
        write_line(&mut out, e)?;
    }
    if parsed.is_empty() {
        let why = if lines == 0 {
            "has no requests".to_owned()
        } else {
            format!("has {lines} requests and every one failed (see the error records)")
        };
        out.finish()?;
        return Err(UsageError(format!("--input {} {why}", args.input.display())).into());
    }
    let needed = parsed.iter().map(|p| p.request.prompt.len() + p.request.max_tokens.max(1)).max().unwrap_or(1);
    let context = args.context.unwrap_or(needed);
    let job = Job { args, json, model_dir: &model_dir, parsed, failed: errors.len(), context };
    let Some(trunk) = &args.storage.trunk else {
        let opened = open_resident(&model_dir, args.threads, kernels)
            .with_context(|| format!("opening model {}", model_dir.display()))?;
        return job.run(&opened, out, None, |_| None);
    };
    if let Some(p) = &placement {
        eprintln!("k3ring: {}", p.describe());
    }
    let flag = typed_budget_flag(&args.storage);
    let shape = BatchOptions {
        max_batch: args.max_batch,
        prefill_chunk: args.prefill_chunk,
        context,
        draft: args.drafting.for_requests(args.draft_sequences),
    };
    let mut run = streaming_run(&args.pipeline, &args.storage, args.threads, shape.step_rows(), context)
        .map_err(|e| name_budget_flag(e, &flag))?;
    run.sequences = args.max_batch;
    run.drafting = shape.draft_plan(args.drafting.draft.is_none());
    run.placement = placement;
    let (opened, plan) =
        open_streaming(&model_dir, trunk, &run, kernels, |plan| eprintln!("k3ring: {}", plan.describe()))
            .with_context(|| format!("opening model {} with trunk pack {}", model_dir.display(), trunk.display()))
            .map_err(|e| name_budget_flag(e, &flag))?;
    job.run(&opened, out, Some(&plan), |src| {
        // Reads still in flight (guesses, read-ahead) land first, so the report and the trace agree.
        src.settle();
        Some(src.stats())
    })
}

/// Bytes of requests one batch reads at most: all are held (and their prompts tokenized) before
/// the first step, so an endless input must end somewhere.
const INPUT_BYTES_MAX: usize = 1 << 30;

/// The longest request line read: a prompt the context can hold, each byte escaped in JSON at
/// worst as `\u00XX` (6 bytes), and room for the other fields.
fn input_line_max(cfg: &Config, tok: &Tokenizer) -> usize {
    let (_, text) = crate::engine::text_bytes_max(cfg, tok);
    usize::try_from(text.saturating_mul(6).saturating_add(1 << 16)).unwrap_or(usize::MAX)
}

/// `--input`, line by line, each line at most `line_max` bytes (a longer one is refused naming
/// it, having read no more than that), so no input can exhaust memory on one line.
fn read_input(path: &Path, line_max: usize) -> anyhow::Result<String> {
    use crate::files::input::{read_line_capped, LineRead};
    let stdin = path == Path::new("-");
    let mut reader: Box<dyn std::io::BufRead> = if stdin {
        Box::new(std::io::stdin().lock())
    } else {
        let file = std::fs::File::open(path).with_context(|| format!("reading --input {}", path.display()))?;
        Box::new(std::io::BufReader::new(file))
    };
    let (mut text, mut line, mut number) = (String::new(), Vec::new(), 0usize);
    loop {
        let read = read_line_capped(&mut reader, &mut line, line_max).with_context(|| {
            format!("reading --input {}", if stdin { "- (stdin)".into() } else { path.display().to_string() })
        })?;
        number += 1;
        match read {
            LineRead::End => return Ok(text),
            LineRead::TooLong => {
                return Err(UsageError(format!(
                    "--input {}: line {number} is longer than {line_max} bytes, more than a request for this model's \
                     context can hold",
                    path.display()
                ))
                .into())
            }
            LineRead::Line => {}
        }
        if text.len() + line.len() > INPUT_BYTES_MAX {
            return Err(UsageError(format!(
                "--input {}: more than {INPUT_BYTES_MAX} bytes of requests by line {number}; split the input into \
                 several batches",
                path.display()
            ))
            .into());
        }
        let piece = std::str::from_utf8(&line).map_err(|e| {
            let at = e.valid_up_to();
            UsageError(format!(
                "--input {}: line {number} is not UTF-8 text (invalid byte at offset {at} of the line)",
                path.display()
            ))
        })?;
        text.push_str(piece);
    }
}

/// `--output`: stdout as records are made, or a file by the output rule, replaced when the batch
/// ends (also after Ctrl-C or a failed step, with the records made until then).
fn open_output(path: &Path) -> anyhow::Result<OutputWriter> {
    Ok(Output::resolve("--output", path, true)?.create()?)
}

/// One JSON object and a newline, flushed so a reader of stdout or a FIFO sees each record as it
/// is made (a file is replaced whole when the batch ends: the output rule).
fn write_line(out: &mut dyn Write, record: &impl Serialize) -> anyhow::Result<()> {
    let mut line = serde_json::to_vec(record)?;
    line.push(b'\n');
    out.write_all(&line).and_then(|()| out.flush()).context("writing --output")
}

/// Checks every non-blank line; returns the requests that can run and an error record for each
/// line that cannot. A line without an id is named by its line number.
fn parse_requests(text: &str, args: &BatchArgs, cfg: &Config, tok: &Tokenizer) -> (Vec<Parsed>, Vec<ErrorRecord>) {
    let mut stop_ids = Vec::new();
    if !args.ignore_eos {
        stop_ids.push(cfg.eos_token_id);
        stop_ids.extend(tok.added_id("[EOS]"));
    }
    let defaults = RequestDefaults { max_tokens: args.max_tokens, context: args.context, stop_ids };
    let (mut parsed, mut errors) = (Vec::new(), Vec::new());
    // Each id names one record of the output: a second line with an id already used is refused
    // (its line's record says whose id it is).
    let mut ids: HashMap<String, usize> = HashMap::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        match parse_request_line(line, &defaults, cfg, tok) {
            Ok(p) => {
                let id = p.id.unwrap_or(serde_json::Value::from(i + 1));
                if let Some(first) = ids.get(&id.to_string()) {
                    let error = format!("id {id} is already the id of line {first}: give each request its own id");
                    errors.push(ErrorRecord { id: Some(id), line: i + 1, error });
                    continue;
                }
                ids.insert(id.to_string(), i + 1);
                parsed.push(Parsed { id, line: i + 1, request: p.request, stop: p.stop, chat: p.chat });
            }
            Err(e) => errors.push(ErrorRecord { id: e.id, line: i + 1, error: e.message }),
        }
    }
    (parsed, errors)
}

/// What is known once the input is read.
struct Job<'a> {
    args: &'a BatchArgs,
    json: Option<super::output::JsonOut>,
    model_dir: &'a Path,
    parsed: Vec<Parsed>,
    failed: usize,
    context: usize,
}

/// The output side of a batch: decodes each sequence's text, watches its stop strings, writes a
/// record when it finishes.
struct Results<'a> {
    tok: &'a Tokenizer,
    out: OutputWriter,
    running: HashMap<Ticket, Sequence<'a>>,
    write_error: Option<anyhow::Error>,
    succeeded: usize,
    bar: ProgressBar,
    /// The constrained replies' constraints (for their cost).
    constraints: Vec<crate::engine::Constraint>,
}

impl<'a> Results<'a> {
    fn new(tok: &'a Tokenizer, out: OutputWriter, bar: ProgressBar) -> Results<'a> {
        Results { tok, out, running: HashMap::new(), write_error: None, succeeded: 0, bar, constraints: Vec::new() }
    }

    /// What the constrained replies' masks took, if there were any.
    fn constraint_seconds(&self) -> Option<f64> {
        (!self.constraints.is_empty()).then(|| self.constraints.iter().map(crate::engine::Constraint::seconds).sum())
    }
}

struct Sequence<'t> {
    id: serde_json::Value,
    stop: Vec<String>,
    ids: Vec<u32>,
    decoder: StreamDecoder,
    text: String,
    /// A `messages` request's reply is read through the template's markup: the reasoning
    /// apart, the content in `text`, the markup in neither.
    chat: Option<ChatText<'t>>,
    /// Where a stop string begins: the text ends there.
    cut: Option<usize>,
}

/// The reasoning side of a chat reply, and the parser that tells the channels apart.
struct ChatText<'t> {
    parser: CompletionParser<'t>,
    decoder: StreamDecoder,
    reasoning: String,
    /// How many of the parser's stray tool-markup ids are in the text; the tools the line
    /// declared (calls to others are text).
    stray_shown: usize,
    declared: Vec<String>,
    /// The reply's end id came (with `--ignore-eos` generation goes on): later tokens are in
    /// `generated_ids` but no part of the reply's text.
    ended: bool,
}

impl BatchSink for Results<'_> {
    fn token(&mut self, ticket: Ticket, id: u32) -> bool {
        let Some(seq) = self.running.get_mut(&ticket) else { return false };
        seq.ids.push(id);
        if let Some(chat) = &mut seq.chat {
            if chat.ended {
                return false;
            }
            match chat.parser.push(id) {
                Ok(ParseEvent::Payload(Channel::Reasoning)) => {
                    let piece = chat.decoder.push(self.tok, id).unwrap_or_else(|_| format!("<{id}>"));
                    chat.reasoning.push_str(&piece);
                    return false;
                }
                Ok(ParseEvent::Payload(Channel::Content)) => {}
                Ok(ParseEvent::Markup | ParseEvent::Call) => return false,
                Ok(ParseEvent::Stray) => {
                    // Tool markup that is no call is returned as text, its specials spelled.
                    let stray = &chat.parser.completion().stray_ids;
                    seq.text.push_str(&self.tok.decode_or_mark(&stray[chat.stray_shown..], true));
                    chat.stray_shown = stray.len();
                    return false;
                }
                Ok(ParseEvent::End) => {
                    chat.ended = true;
                    return false;
                }
                Err(e) => {
                    eprintln!("k3ring: request {}: the reply broke the chat template ({e}); it ends there", seq.id);
                    return true;
                }
            }
        }
        let piece = seq.decoder.push(self.tok, id).unwrap_or_else(|_| format!("<{id}>"));
        let before = seq.text.len();
        seq.text.push_str(&piece);
        // A stop string can only end in the new piece: search from where it could begin.
        let longest = seq.stop.iter().map(String::len).max().unwrap_or(0);
        let mut from = before.saturating_sub(longest.saturating_sub(1));
        while !seq.text.is_char_boundary(from) {
            from -= 1;
        }
        seq.cut = seq.stop.iter().filter_map(|s| seq.text[from..].find(s.as_str()).map(|at| from + at)).min();
        seq.cut.is_some()
    }

    fn finished(&mut self, f: Finished) {
        let Some(mut seq) = self.running.remove(&f.ticket) else { return };
        match seq.cut {
            Some(cut) => seq.text.truncate(cut),
            None => {
                let tail = seq.decoder.finish();
                seq.text.push_str(&tail);
            }
        }
        let mut tool_calls = Vec::new();
        if let Some(chat) = &mut seq.chat {
            let tail = chat.decoder.finish();
            chat.reasoning.push_str(&tail);
            let calls = &chat.parser.completion().calls;
            tool_calls = declared_calls(calls, &chat.declared, &f.ticket.to_string(), 0, &mut seq.text);
        }
        let record = ResultRecord {
            id: &seq.id,
            prompt_tokens: f.prompt_tokens,
            generated_ids: &seq.ids,
            text: &seq.text,
            reasoning_content: seq.chat.as_ref().map(|c| c.reasoning.as_str()).filter(|r| !r.is_empty()),
            tool_calls,
            finish_reason: f.reason,
            seconds: f.seconds,
        };
        if self.write_error.is_none() {
            if let Err(e) = write_line(&mut self.out, &record) {
                self.write_error = Some(e);
            }
        }
        self.succeeded += 1;
        self.bar.inc(1);
    }
}

impl Job<'_> {
    fn run<S: WeightSource + LayerHook>(
        self,
        opened: &Opened<S>,
        out: OutputWriter,
        plan: Option<&Plan>,
        storage: impl Fn(&S) -> Option<StreamStats>,
    ) -> anyhow::Result<()> {
        let (engine, tok) = (&opened.engine, &opened.tokenizer);
        let slots_asked = self.args.max_batch;
        let max_batch = plan.map_or(slots_asked, |p| p.sequences);
        let opts = BatchOptions {
            max_batch,
            prefill_chunk: self.args.prefill_chunk,
            context: self.context,
            draft: self
                .args
                .drafting
                .for_requests(self.args.draft_sequences)
                .filter(|_| plan.is_none_or(|p| p.draft_journals > 0)),
        };
        let mut batcher = engine.batcher(opts)?;
        if batcher.slots() < slots_asked {
            eprintln!(
                "k3ring: {} of the {slots_asked} sequence slots asked for fit ({} each for {} positions); the other requests wait in the queue",
                batcher.slots(),
                crate::storage::plan::fmt_gb(engine.slot_bytes(batcher.options())),
                self.context
            );
        }
        let total = self.parsed.len();
        let bar = progress_bar(total);
        let mut results = Results::new(tok, out, bar.clone());
        let (submit_failed, prompt_tokens) =
            submit_all(self.parsed, &mut batcher, &mut results, engine.model.cfg.vocab_size)?;
        let failed = self.failed + submit_failed;
        let start = Instant::now();
        let mut interrupted = false;
        let bytes_read = |src: &S| storage(src).map(|s| s.trunk_bytes_read + s.expert_bytes_read);
        let read_before = bytes_read(&engine.src);
        while batcher.pending() > 0 {
            if crate::interrupt::interrupted() {
                interrupted = true;
                break;
            }
            if let Err(e) = batcher.step(&mut results) {
                // The records written so far are whole answers: they are kept.
                results.out.finish()?;
                return Err(e.into());
            }
            if let Some(e) = results.write_error.take() {
                return Err(e);
            }
            let per_token = per_token_bytes(bytes_read(&engine.src), read_before, batcher.stats());
            bar.set_message(progress_message(batcher.stats(), start, batcher.running(), per_token));
        }
        bar.finish_and_clear();
        let (succeeded, constraint_seconds) = (results.succeeded, results.constraint_seconds());
        results.out.finish()?;
        let seconds = start.elapsed().as_secs_f64();
        let stats = batcher.stats().clone();
        let bytes_read_per_token = per_token_bytes(bytes_read(&engine.src), read_before, &stats);
        let peak = peak_rss_bytes();
        let store = storage(&engine.src);
        let summary = Summary {
            model: self.model_dir.display().to_string(),
            requests: total + self.failed,
            succeeded,
            failed,
            interrupted,
            slots: batcher.slots(),
            slots_asked,
            context: self.context,
            prompt_tokens,
            generated_tokens: stats.generated,
            seconds,
            tokens_per_second: if seconds > 0.0 { stats.generated as f64 / seconds } else { 0.0 },
            steps: stats.steps,
            mean_batch: if stats.steps > 0 { stats.decode_sequences as f64 / stats.steps as f64 } else { 0.0 },
            bytes_read_per_token,
            peak_rss_bytes: peak,
            plan,
            storage: store.clone(),
            draft: super::run::DraftReport::new(batcher.options().draft.as_ref(), stats.draft, None, 0),
            constraint_seconds,
        };
        print_summary(&summary, engine.threads(), engine.model.kernels.isa().name());
        if let Some(line) = summary.draft.line() {
            eprintln!("k3ring: {line}");
        }
        if let (Some(s), Some(p)) = (&store, plan) {
            let metrics = engine.model.tracer.as_ref().map(|t| t.metrics()).unwrap_or_default();
            print_streaming_summary(s, p, peak, &metrics);
        }
        if let (Some(path), Some(tracer)) = (&self.args.pipeline.trace, &engine.model.tracer) {
            tracer.write_chrome_json(&super::output::create_now("--trace", path)?)?;
            eprintln!("k3ring: trace written to {}", path.display());
        }
        if let Some(out) = &self.json {
            out.write(&summary)?;
        }
        if interrupted {
            let done = summary.succeeded;
            return Err(crate::interrupt::InterruptedBatch { done, total }.into());
        }
        if summary.succeeded == 0 {
            return Err(UsageError("every request failed (see the error records in --output)".into()).into());
        }
        Ok(())
    }
}

/// The console line at the end of a batch.
fn print_summary(summary: &Summary<'_>, threads: usize, isa: &str) {
    if let Some(c) = summary.constraint_seconds {
        eprintln!("k3ring: {}", crate::chat::constrain::cost_line(c, summary.seconds));
    }
    eprintln!(
        "k3ring: {} requests: {} done, {} failed{} | {} prompt + {} generated tokens in {:.2} s: {:.2} tokens/s | {} steps, {:.1} sequences per step, {} slots of {} positions{} | {threads} threads, {isa} kernels",
        summary.requests,
        summary.succeeded,
        summary.failed,
        if summary.interrupted { ", the rest interrupted" } else { "" },
        summary.prompt_tokens,
        summary.generated_tokens,
        summary.seconds,
        summary.tokens_per_second,
        summary.steps,
        summary.mean_batch,
        summary.slots,
        summary.context,
        summary
            .bytes_read_per_token
            .map_or_else(String::new, |b| format!(" | {} read per token", crate::storage::plan::fmt_gb(b as u64))),
    );
}

/// Queues every parsed request; one the batcher refuses gets an error record. Returns the
/// refused count and the prompt tokens queued.
fn submit_all<S: WeightSource + LayerHook>(
    parsed: Vec<Parsed>,
    batcher: &mut crate::engine::Batcher<'_, S>,
    results: &mut Results<'_>,
    vocab_size: usize,
) -> anyhow::Result<(usize, u64)> {
    let (mut failed, mut prompt_tokens) = (0, 0u64);
    let mut grammars = None;
    for mut p in parsed {
        if let Some(c) = &p.chat {
            let (tok, sp) = (results.tok, &c.specials);
            match crate::chat::constrain::reply_constraint(&mut grammars, tok, sp, vocab_size, &c.tools, c.thinking) {
                Ok(constraint) => {
                    results.constraints.extend(constraint.clone());
                    p.request.constraint = constraint;
                }
                Err(e) => {
                    failed += 1;
                    write_line(&mut results.out, &ErrorRecord { id: Some(p.id), line: p.line, error: e.to_string() })?;
                    continue;
                }
            }
        }
        let len = p.request.prompt.len() as u64;
        match batcher.submit(p.request) {
            Ok(ticket) => {
                prompt_tokens += len;
                let seq = Sequence {
                    id: p.id,
                    stop: p.stop,
                    ids: Vec::new(),
                    decoder: StreamDecoder::default(),
                    text: String::new(),
                    cut: None,
                    chat: p.chat.map(|c| ChatText {
                        parser: CompletionParser::new(results.tok, c.specials, c.thinking),
                        decoder: StreamDecoder::default(),
                        reasoning: String::new(),
                        stray_shown: 0,
                        declared: c.tools.names().into_iter().map(str::to_owned).collect(),
                        ended: false,
                    }),
                };
                results.running.insert(ticket, seq);
            }
            Err(e) => {
                failed += 1;
                write_line(&mut results.out, &ErrorRecord { id: Some(p.id), line: p.line, error: e.to_string() })?;
            }
        }
    }
    Ok((failed, prompt_tokens))
}

/// The progress bar's message: throughput, sequences running, bytes read per token.
fn progress_message(stats: &BatchStats, start: Instant, running: usize, per_token: Option<f64>) -> String {
    let seconds = start.elapsed().as_secs_f64().max(1e-9);
    let read =
        per_token.map_or_else(String::new, |b| format!(", {} read per token", crate::storage::plan::fmt_gb(b as u64)));
    format!("{:.2} tokens/s, {running} sequences running{read}", stats.generated as f64 / seconds)
}

fn per_token_bytes(now: Option<u64>, before: Option<u64>, stats: &BatchStats) -> Option<f64> {
    let (now, before) = (now?, before?);
    (stats.generated > 0).then(|| (now - before) as f64 / stats.generated as f64)
}

/// Requests done, with throughput in the message; drawn only on a terminal.
fn progress_bar(total: usize) -> ProgressBar {
    let bar = ProgressBar::new(total as u64);
    bar.set_style(
        ProgressStyle::with_template("{spinner} batch [{bar:30}] {pos}/{len} requests | {msg} | eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar
}
