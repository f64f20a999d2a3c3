//! Command-line edge: clap definitions, dispatch, error printing and exit codes.
//!
//! Library code never prints or exits; this module does both, once, at the end.
#![forbid(unsafe_code)]
#![allow(clippy::print_stdout, clippy::print_stderr)]

mod batch;
mod bench;
mod bench_batch;
mod bench_host;
mod budget;
mod cache_sim;
mod chat;
mod demo;
pub mod draft_flags;
mod embedded;
mod inspect;
mod logging;
mod logits;
mod open_model;
mod output;
mod pack;
pub mod pipeline_flags;
mod plan;
mod run;
mod serve;
mod startup;
mod summary;
mod svg;
mod synth;
mod tune;

use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};

use crate::error::exit_code_for;
use crate::exit::ExitCode;

/// Runs the Kimi K3 model on CPUs by streaming its weights from NVMe.
#[derive(Debug, Parser)]
#[command(name = "k3ring", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// More log output on stderr: -v info, -vv debug, -vvv trace (default: warnings and errors).
    /// RUST_LOG, when set, replaces it (e.g. RUST_LOG=k3ring::storage=debug).
    #[arg(short = 'v', long = "verbose", action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Synthesize a small K3 model (once), then stream it under a budget smaller than itself.
    Demo(demo::DemoArgs),
    /// Validate a model directory and print its config, layer map and byte census.
    Inspect(InspectArgs),
    /// Generate text from a prompt (the embedded tiny model when --model is absent).
    Run(Box<RunArgs>),
    /// Decode many requests together (continuous batching): JSONL in, one JSON result per line out.
    Batch(Box<batch::BatchArgs>),
    /// Talk to the model through its chat template (a REPL; reads turns from stdin).
    Chat(Box<chat::ChatArgs>),
    /// Serve the OpenAI API over HTTP (completions and chat completions, batched).
    Serve(Box<serve::ServeArgs>),
    /// Size a server from a config.json alone: the memory plan and reads per token at each budget.
    Plan(plan::PlanArgs),
    /// Copy every non-expert tensor into one file laid out for streaming (the trunk pack).
    Pack(PackArgs),
    /// Write a seeded random checkpoint in the release layout (k3, small or tiny widths).
    Synth(synth::SynthArgs),
    /// Replay an expert trace (run --dump-trace) through the cache policies and Belady's optimum.
    CacheSim(cache_sim::CacheSimArgs),
    /// Measure the engine against the device, memory bandwidth and resident compute.
    Bench(Box<bench::BenchArgs>),
    /// Sweep read-ahead, speculation, queue depth, backend and trunk/expert split at a budget.
    Tune(Box<tune::TuneArgs>),
}

#[derive(Debug, clap::Args)]
#[command(allow_negative_numbers = true, args_override_self = true)]
pub struct PackArgs {
    /// Model directory to pack.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Directory for trunk.pack and trunk.manifest.json.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Then re-read everything: each trunk unit against its checksum and the shards, each expert
    /// against its checksum (exit 3 naming every mismatch).
    #[arg(long)]
    pub verify: bool,
    /// Pack again even when the pack is up to date (without it, a pack of the same checkpoint is
    /// re-packed only when a unit fails its checksum; with --verify, never: the damage is reported).
    #[arg(long)]
    pub force: bool,
    /// Also copy the routed experts into one file per directory (one directory per drive), so
    /// that runs read them from every drive at once; each expert is striped over them in
    /// proportion to each directory's probed random-read rate.
    #[arg(long, value_name = "DIR,...", value_delimiter = ',')]
    pub experts_to: Vec<PathBuf>,
    /// With --experts-to: cut every expert into equal pieces instead of by probed rate.
    #[arg(long, requires = "experts_to", conflicts_with = "expert_rates")]
    pub even: bool,
    /// With --experts-to: cut every expert in proportion to these rates (GB/s, one per
    /// directory) instead of probing.
    #[arg(long, value_name = "GB/s,...", value_delimiter = ',', requires = "experts_to")]
    pub expert_rates: Vec<f64>,
}

#[derive(Debug, Clone, clap::Args)]
#[command(allow_negative_numbers = true, args_override_self = true)]
// Not required: a run may resume a saved state with no new prompt (`--load-state`); without
// one, an empty input is refused after parsing ("give --prompt, --prompt-file or --ids").
#[command(group(clap::ArgGroup::new("input").required(false).args(["prompt", "prompt_file", "ids"])))]
pub struct RunArgs {
    /// Model directory; without it, the tiny K3 model built into the binary.
    #[arg(short = 'm', long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Prompt text (added tokens such as <|open|> are recognised).
    #[arg(short = 'p', long, value_name = "TEXT")]
    pub prompt: Option<String>,
    /// Read the prompt text from a file ("-": from stdin).
    #[arg(long, value_name = "FILE")]
    pub prompt_file: Option<PathBuf>,
    /// Prompt as comma-separated token ids (spaces after the commas are fine).
    #[arg(long, value_name = "ID,ID,...", value_delimiter = ',', value_parser = parse_token_id)]
    pub ids: Option<Vec<u32>>,
    /// Prepend the model's BOS token (config.json `bos_token_id`).
    #[arg(long)]
    pub bos: bool,
    /// Tokens to generate at most.
    #[arg(short = 'n', long, value_name = "N", default_value_t = 32)]
    pub gen: usize,
    /// Sampling temperature; 0 means greedy.
    #[arg(long, value_name = "T", default_value_t = 0.0, value_parser = parse_temperature)]
    pub temperature: f32,
    /// Sample only among the K most likely tokens (0: off, every token is a candidate, as in
    /// llama.cpp).
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Sample only from the smallest set of tokens whose probability reaches P.
    #[arg(long, value_name = "P", value_parser = parse_probability)]
    pub top_p: Option<f32>,
    /// Seed of the sampler; the same seed reproduces the same tokens.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    /// Compute threads (0 = one per core).
    #[arg(short = 't', long, value_name = "N", default_value_t = 0, value_parser = parse_threads)]
    pub threads: usize,
    /// Re-run the whole prefix at every step (verifies the incremental decode).
    #[arg(long)]
    pub full_recompute: bool,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print added tokens ([EOS], <|reserved_token_N|>, the chat markup) as their spelling in
    /// the text; by default they are left out of it (their ids stay in --json)
    #[arg(long)]
    pub show_special: bool,
    /// Tokens per prefill pass.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = parse_chunk)]
    pub prefill_chunk: usize,
    /// Kernel instruction set: auto (the best this CPU has), scalar, avx2 or avx512.
    #[arg(long, value_name = "ISA", default_value = "auto")]
    pub isa: String,
    #[command(flatten)]
    pub storage: StorageArgs,
    #[command(flatten)]
    pub pipeline: pipeline_flags::PipelineArgs,
    #[command(flatten)]
    pub drafting: draft_flags::DraftArgs,
    /// Write the report (prompt_ids, generated_ids, text, seconds_per_token, peak_rss_bytes,
    /// storage and pipeline counters) as JSON to FILE ("-": to stdout, instead of the text).
    /// Created before the model is opened; written also after Ctrl-C.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write the logits of every prompt position and generated step (f32, with a header of
    /// shape, model fingerprint and ids; the format is in docs/LOGITS.md).
    #[arg(long, value_name = "FILE")]
    pub logits: Option<PathBuf>,
    /// Write each generated token's log-probability (a log-softmax over the whole vocabulary)
    /// and its N likeliest alternatives (0-20) to --json's `logprobs`
    #[arg(long, value_name = "N", requires = "json", value_parser = parse_top_logprobs)]
    pub logprobs: Option<usize>,
    /// With --logits: keep only the N largest logits of each position (their ids and values).
    #[arg(long, value_name = "N", requires = "logits", value_parser = parse_logits_top)]
    pub logits_top: Option<usize>,
    /// Start from a saved session state: its tokens come first, the prompt (if any) after them;
    /// a prefill stopped by Ctrl-C resumes where it stopped.
    #[arg(long, value_name = "FILE")]
    pub load_state: Option<PathBuf>,
    /// Save the session state (prompt, generated tokens, model state) here at the end, also
    /// after Ctrl-C.
    #[arg(long, value_name = "FILE")]
    pub save_state: Option<PathBuf>,
    /// Ids of the flags given on the command line (filled by `main` from clap's matches: a flag
    /// given its default value, such as `--io uring`, is otherwise indistinguishable from none).
    #[arg(skip)]
    pub given: Vec<String>,
}

/// Flags of the streaming store (`run --trunk DIR ...`).
#[derive(Debug, Clone, clap::Args)]
pub struct StorageArgs {
    /// Stream from the trunk pack in DIR (made by `k3ring pack`); without it, weights are mapped.
    #[arg(long, value_name = "DIR")]
    pub trunk: Option<PathBuf>,
    /// Memory budget in GB (10^9 bytes) for trunk, experts, states and scratch.
    #[arg(long, value_name = "X", value_parser = parse_gb, conflicts_with = "preset")]
    pub mem_gb: Option<f64>,
    /// Budget preset: laptop, desktop, workstation, server, max (95% of MemAvailable), auto (80%).
    #[arg(long, value_name = "NAME")]
    pub preset: Option<String>,
    /// Read backend: uring (io_uring, O_DIRECT), pread (thread pool, O_DIRECT), mmap (page cache),
    /// or drives modeled in real time over the page cache: sim:RATE[,LATENCY][,qdQ][xN], e.g.
    /// `sim:7GB/s,80us x4` (docs/BENCHMARKS.md).
    #[arg(long = "io", value_name = "BACKEND", default_value = "uring", value_parser = parse_io)]
    pub io: String,
    /// With `pack --experts-to` files and `--io sim:`: the modeled drives of each expert
    /// directory, in the pack's order, one flag per directory (e.g. `--device-io sim:2GB/s
    /// --device-io sim:8GB/s`); directories beyond them read through `--io`.
    #[arg(long = "device-io", value_name = "BACKEND", value_parser = parse_io)]
    pub device_io: Vec<String>,
    /// Reads in flight at most (io_uring SQEs, or pread calls).
    #[arg(long, value_name = "Q", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub queue_depth: u32,
    /// Streamed trunk layers read ahead of the one computing (0 to 128).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = parse_readahead)]
    pub readahead: usize,
    /// Do not mlock the buffers.
    #[arg(long)]
    pub no_mlock: bool,
    /// Check every streamed trunk unit's checksum on every read (default: first read of each).
    #[arg(long)]
    pub verify_reads: bool,
    /// Do not check experts against their checksums (by default each expert read from the shards
    /// is checked before use; a mismatch stops the run with exit 3). For those who accept the risk.
    #[arg(long)]
    pub no_verify_experts: bool,
    /// At most this share (0-1) of the budget left after the fixed parts goes to pinned trunk
    /// (default: trunk first, as much as fits).
    #[arg(long, value_name = "F", value_parser = parse_share)]
    pub trunk_share: Option<f64>,
    /// Stream trunk units through a ring of pieces of this many MB (10^6 bytes), whatever the
    /// budget: those larger are read in row blocks of each matrix; the largest units that fit
    /// are still pinned (default: whole units or pieces of up to 32 MiB, whichever pins more).
    #[arg(long, value_name = "MB", value_parser = parse_gb)]
    pub piece_mb: Option<f64>,
    /// Where units stream in pieces: hold the trunk the budget pins as pieces of every unit
    /// spread over the token, every router's first (`spread`, the default), so the drive reads
    /// the streamed rest while any layer computes, or as whole units, largest first (`units`).
    #[arg(long, value_name = "HOW", value_enum, default_value_t = TrunkPins::Spread)]
    pub trunk_pins: TrunkPins,
}

/// How a budget that streams units in pieces holds the trunk it pins (`--trunk-pins`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum TrunkPins {
    /// Whole units, largest first.
    Units,
    /// Pieces of every unit, routers first, the rest spread over the token.
    Spread,
}

fn parse_share(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if (0.0..=1.0).contains(&x) => Ok(x),
        _ => Err(format!("{s:?} is not a share between 0 and 1")),
    }
}

/// Above this many GB a size is a typo, not a machine (and its bytes would not fit a u64).
const GB_MAX: f64 = 1e6;

/// `--io`: a backend name or a modeled device, checked here so a typo is a usage error at once.
/// The backends of `--device-io`: modeled drives only, and only beside a modeled `--io` (the
/// reads' alignment and the page-cache warm-up are the modeled devices').
pub(crate) fn device_kinds(
    io: crate::pipeline::IoKind,
    device_io: &[String],
) -> Result<Vec<crate::pipeline::IoKind>, crate::error::UsageError> {
    use crate::error::UsageError;
    if device_io.is_empty() {
        return Ok(Vec::new());
    }
    if io.modeled().is_none() {
        return Err(UsageError("--device-io models the expert directories' drives; give --io sim:... too".to_owned()));
    }
    device_io
        .iter()
        .map(|d| match crate::pipeline::IoKind::parse(d) {
            Ok(k) if k.modeled().is_some() => Ok(k),
            Ok(_) => Err(UsageError(format!("--device-io {d}: give a modeled device, sim:RATE[,LATENCY][,qdQ][xN]"))),
            Err(e) => Err(UsageError(format!("--device-io {e}"))),
        })
        .collect()
}

fn parse_io(s: &str) -> Result<String, String> {
    crate::pipeline::IoKind::parse(s).map(|_| s.to_owned())
}

fn parse_gb(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 && x <= GB_MAX => Ok(x),
        _ => Err(format!("{s:?} is not a size in GB (a positive number up to {GB_MAX})")),
    }
}

/// Compute threads: 0 is one per core; beyond 1024 is a typo (each thread is spawned and pinned
/// before the run starts: 5000 took a minute on 2 cores to do nothing).
fn parse_threads(s: &str) -> Result<usize, String> {
    count_in(s, 0..=1024, "a number of compute threads (0 = one per core, up to 1024)")
}

/// Trunk layers read ahead: K3 has 93 layers, so more than 128 is never meant.
fn parse_readahead(s: &str) -> Result<usize, String> {
    count_in(s, 0..=128, "a number of layers to read ahead (0 to 128)")
}

/// `s` as a whole number in `range`, or the error `"s" is not {what}`.
fn count_in(s: &str, range: std::ops::RangeInclusive<usize>, what: &str) -> Result<usize, String> {
    s.parse::<usize>().ok().filter(|n| range.contains(n)).ok_or_else(|| format!("{s:?} is not {what}"))
}

fn parse_temperature(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(t) if t.is_finite() && t >= 0.0 => Ok(t),
        _ => Err(format!("{s:?} is not a temperature (a number >= 0)")),
    }
}

fn parse_top_logprobs(s: &str) -> Result<usize, String> {
    count_in(s, 0..=crate::engine::logprobs::MAX_TOP_LOGPROBS, "a number of alternatives per token in 0..=20")
}

fn parse_logits_top(s: &str) -> Result<usize, String> {
    count_in(s, 1..=usize::MAX, "a number of logits per position (1 or more)")
}

/// A token id of `--ids`, with the spaces a hand-typed list has after its commas.
fn parse_token_id(s: &str) -> Result<u32, String> {
    s.trim().parse().map_err(|_| format!("{s:?} is not a token id (a whole number)"))
}

fn parse_batch_size(s: &str) -> Result<usize, String> {
    count_in(s, 1..=4096, "a number of sequences in 1..=4096")
}

fn parse_slot_positions(s: &str) -> Result<usize, String> {
    count_in(s, 2..=usize::MAX, "a number of positions (2 or more: a prompt token and a generated one)")
}

fn parse_body_bytes(s: &str) -> Result<usize, String> {
    count_in(s, 1..=usize::MAX, "a number of bytes (1 or more)")
}

fn parse_chunk(s: &str) -> Result<usize, String> {
    count_in(s, 1..=4096, "a chunk size in 1..=4096")
}

fn parse_probability(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(p) if p > 0.0 && p <= 1.0 => Ok(p),
        _ => Err(format!("{s:?} is not a probability in (0, 1]")),
    }
}

/// The error chain joined by ": ", skipping a cause whose text the previous message already
/// quotes (many errors carry their source in their own message).
fn error_text(err: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in err.chain() {
        let text = cause.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
    }
    out
}

/// The kernels named by `--isa` (auto = the best this CPU has).
pub fn kernels_for(isa: &str) -> anyhow::Result<kernels::Kernels> {
    if isa == "auto" {
        let k = kernels::Kernels::detect();
        tracing::info!("using {} kernels (--isa auto: the best this CPU has)", k.isa().name());
        return Ok(k);
    }
    let names: Vec<&str> = kernels::Isa::available().iter().map(|i| i.name()).collect();
    let chosen = kernels::Isa::from_name(isa).ok_or_else(|| {
        crate::error::UsageError(format!("--isa {isa:?} is unknown; choose from: auto, {}", names.join(", ")))
    })?;
    let k = kernels::Kernels::with_isa(chosen).map_err(|e| crate::error::UsageError(format!("--isa {isa}: {e}")))?;
    tracing::info!("using {} kernels (--isa {isa})", k.isa().name());
    Ok(k)
}

#[derive(Debug, clap::Args)]
#[command(allow_negative_numbers = true, args_override_self = true)]
pub struct InspectArgs {
    /// Model directory (config.json, safetensors shards, tokenizer).
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Write the report as JSON to FILE ("-": to stdout, instead of the text).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// Ids of the arguments in `m` whose value came from the command line (not a default).
fn given_ids(m: &ArgMatches) -> Vec<String> {
    m.ids()
        .map(|id| id.as_str())
        .filter(|id| m.value_source(id) == Some(ValueSource::CommandLine))
        .map(str::to_owned)
        .collect()
}

/// Parses `std::env::args`, runs the command and returns the documented exit code.
pub fn main() -> std::process::ExitCode {
    let parsed = Cli::command().try_get_matches().and_then(|m| Ok((Cli::from_arg_matches(&m)?, m)));
    let (mut cli, matches) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => {
            // clap prints help/version to stdout (exit 0) and usage errors to stderr (exit 2).
            let _ = e.print();
            return (if e.use_stderr() { ExitCode::Usage } else { ExitCode::Ok }).into();
        }
    };
    match (&mut cli.command, matches.subcommand()) {
        (Command::Run(args), Some(("run", m))) => args.given = given_ids(m),
        (Command::Batch(args), Some(("batch", m))) => args.given = given_ids(m),
        (Command::Chat(args), Some(("chat", m))) => args.given = given_ids(m),
        (Command::Serve(args), Some(("serve", m))) => args.given = given_ids(m),
        _ => {}
    }
    logging::install(cli.verbose);
    // Weights are memory-mapped (resident runs, `--io mmap`): a disk error under a mapped page
    // arrives as SIGBUS, which the handler turns into exit 4 naming the file.
    if let Err(e) = crate::storage::sigbus::install_handler() {
        tracing::warn!("cannot install the SIGBUS handler ({e}): a disk error under mapped weights will end k3ring with a bare SIGBUS");
    }
    let result = match cli.command {
        Command::Demo(args) => demo::run(&args),
        Command::Inspect(args) => inspect::run(&args),
        Command::Run(args) => run::run(&args),
        Command::Batch(args) => batch::run(&args),
        Command::Chat(args) => chat::run(&args),
        Command::Serve(args) => serve::run(&args),
        Command::Plan(args) => plan::run(&args),
        Command::Pack(args) => pack::run(&args),
        Command::Synth(args) => synth::run(&args),
        Command::CacheSim(args) => cache_sim::run(&args),
        Command::Bench(args) => bench::run(&args),
        Command::Tune(args) => tune::run(&args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(err) => {
            let code = exit_code_for(&err);
            eprintln!("k3ring: error: {}", error_text(&err));
            code.into()
        }
    }
}
