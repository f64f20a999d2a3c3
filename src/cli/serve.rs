//! `k3ring serve`: the OpenAI-compatible HTTP server (crate::serve) behind the flags. Opens the
//! model as `batch` does (resident, or streaming under a budget), binds, prints the address on
//! stderr (`k3ring: listening on http://ADDR`), and serves until SIGINT/SIGTERM (exit 0).

use std::net::{IpAddr, TcpListener, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use super::open_model::{ModelJob, OpenModel};
use super::pipeline_flags::PipelineArgs;
use super::run::refuse_streaming_flags;
use super::StorageArgs;
use crate::config::Config;
use crate::engine::prefix_cache::PrefixCacheOptions;
use crate::engine::{BatchOptions, Opened};
use crate::error::UsageError;
use crate::model::weights::WeightSource;
use crate::model::LayerHook;
use crate::serve::limits::ConnLimits;
use crate::serve::{serve, Ready, ServeOptions};
use crate::storage::plan::Plan;
use crate::storage::stream::StreamStats;

#[derive(Debug, clap::Args)]
#[command(allow_negative_numbers = true, args_override_self = true)]
// A server runs until stopped and serves many sequences: it writes no trace of either kind, and
// refuses the flags (exit 2, naming what to use instead), so its help does not offer them.
#[command(mut_arg("trace", |a| a.hide(true)), mut_arg("dump_trace", |a| a.hide(true)))]
pub struct ServeArgs {
    /// Model directory; without it, the tiny K3 model built into the binary.
    #[arg(short = 'm', long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// The model's name in the API (default: the model directory's name).
    #[arg(long, value_name = "NAME")]
    pub model_name: Option<String>,
    /// Address to bind. Loopback by default; any other address is reachable from elsewhere.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1")]
    pub host: String,
    /// Port to bind (0: any free port; the address is printed on stderr).
    #[arg(long, value_name = "N", default_value_t = 8080)]
    pub port: u16,
    /// Sequences decoded together at most (fewer when the budget or memory holds fewer).
    #[arg(long, value_name = "N", default_value_t = 8, value_parser = super::parse_batch_size)]
    pub max_batch: usize,
    /// Requests that may wait for a sequence slot; beyond them a request gets 429.
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub max_queue: usize,
    /// max_tokens at most, and the default for a request that gives none.
    #[arg(long, value_name = "N", default_value_t = 1024)]
    pub max_tokens: usize,
    /// Positions of each sequence slot: prompt plus generated tokens (default: 4096, or the
    /// model's context if smaller).
    #[arg(short = 'c', long, value_name = "N", value_parser = super::parse_slot_positions)]
    pub context: Option<usize>,
    /// Prompt tokens per step, over all sequences being prefilled.
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = super::parse_chunk)]
    pub prefill_chunk: usize,
    /// Every request must carry `Authorization: Bearer KEY` (else 401).
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// Request body bytes at most (else 413).
    #[arg(long, value_name = "BYTES", default_value_t = 1 << 20, value_parser = super::parse_body_bytes)]
    pub max_body: usize,
    /// HTTP connections open at once at most; one more is answered 503 and closed.
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub max_connections: usize,
    /// Seconds a client has to send a request's head (from connecting, or from the first byte
    /// of a later request); a slower one loses its connection.
    #[arg(long, value_name = "S", default_value = "10", value_parser = parse_timeout)]
    pub header_timeout: Duration,
    /// Seconds a client has to send a request's whole body once its head arrived (else 408
    /// and the connection is closed).
    #[arg(long, value_name = "S", default_value = "60", value_parser = parse_timeout)]
    pub body_timeout: Duration,
    /// Seconds a keep-alive connection may sit with no request before it is closed.
    #[arg(long, value_name = "S", default_value = "30", value_parser = parse_timeout)]
    pub idle_timeout: Duration,
    /// Requests one connection may carry; the last is answered with `Connection: close`.
    #[arg(long, value_name = "N", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_requests_per_connection: u64,
    /// GB of prompt-state snapshots kept for later requests that share a prefix (a system
    /// prompt, a conversation's history); with a budget, taken from it. Default: 1, or a tenth
    /// of the budget when that is less; 0: no prefix cache
    #[arg(long, value_name = "GB")]
    pub prefix_cache_gb: Option<f64>,
    /// Positions between a prompt's snapshots: prompts that share only a beginning meet at the
    /// last multiple before they part (each prompt is also kept where it ends)
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    pub prefix_stride: u64,
    /// Seconds requests in flight may go on after SIGINT/SIGTERM before they are cancelled.
    #[arg(long, value_name = "S", default_value_t = 30.0)]
    pub grace: f64,
    /// No line per request on stderr (method, path, status, tokens, time)
    #[arg(long)]
    pub no_access_log: bool,
    /// Ask for the API key on /health too (by default it answers without, as load balancers
    /// probe it)
    #[arg(long)]
    pub health_needs_key: bool,
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
    /// Ids of the flags given on the command line (filled by `main`).
    #[arg(skip)]
    pub given: Vec<String>,
}

/// Slot positions when `--context` is not given.
const DEFAULT_CONTEXT: usize = 4096;

pub fn run(args: &ServeArgs) -> anyhow::Result<()> {
    args.drafting.check(&crate::engine::Sampling::default(), false)?;
    let kernels = super::kernels_for(&args.isa)?;
    if args.storage.trunk.is_none() && !args.pipeline.print_placement {
        refuse_streaming_flags(&args.given)?;
    }
    if args.pipeline.dump_trace.is_some() {
        return Err(
            UsageError("--dump-trace records the routing of one sequence; use `k3ring run` for it".into()).into()
        );
    }
    if args.pipeline.trace.is_some() {
        return Err(UsageError(
            "--trace is not written by a server, which runs until stopped; trace the same requests with `k3ring batch --trace`".into(),
        )
        .into());
    }
    if !(args.grace.is_finite() && args.grace >= 0.0 && Duration::try_from_secs_f64(args.grace).is_ok()) {
        return Err(UsageError(format!("--grace {} is not a number of seconds >= 0", args.grace)).into());
    }
    if let Some(gb) = args.prefix_cache_gb.filter(|gb| !(gb.is_finite() && *gb >= 0.0 && *gb <= 1.0e6)) {
        return Err(UsageError(format!("--prefix-cache-gb {gb} is not a size in GB >= 0")).into());
    }
    if args.max_connections == 0 {
        return Err(UsageError("--max-connections 0 would refuse every client".into()).into());
    }
    if args.max_tokens == 0 {
        return Err(UsageError("--max-tokens 0 leaves no room for a reply".into()).into());
    }
    if args.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        return Err(UsageError("--api-key is empty".into()).into());
    }
    let placement = args.pipeline.placement(args.threads)?;
    if args.pipeline.print_placement {
        println!("{}", placement.describe());
        return Ok(());
    }
    let (model_dir, default_name) = match &args.model {
        Some(dir) => {
            let name = dir.canonicalize().unwrap_or_else(|_| dir.clone());
            let name = name.file_name().map_or_else(|| "k3".to_owned(), |n| n.to_string_lossy().into_owned());
            (dir.clone(), name)
        }
        None => (super::embedded::tiny_model_dir()?, "tiny-k3".to_owned()),
    };
    let cfg = Config::from_model_dir(&model_dir)?;
    let context = match (&cfg.context_length, args.context) {
        (Some(c), Some(asked)) if asked > c.positions => {
            return Err(UsageError(format!(
                "--context {asked} is beyond the model's context of {} positions ({})",
                c.positions, c.source
            ))
            .into())
        }
        (_, Some(asked)) => asked.max(2),
        (Some(c), None) => c.positions.min(DEFAULT_CONTEXT),
        (None, None) => DEFAULT_CONTEXT,
    };
    let listener = bind(&args.host, args.port)?;
    let opts = ServeOptions {
        model_name: args.model_name.clone().unwrap_or(default_name),
        batch: BatchOptions {
            max_batch: args.max_batch,
            prefill_chunk: args.prefill_chunk,
            context,
            draft: args.drafting.for_requests(args.draft_sequences),
        },
        max_queue: args.max_queue,
        max_tokens: args.max_tokens,
        api_key: args.api_key.clone(),
        body_limit: args.max_body,
        max_connections: args.max_connections,
        limits: ConnLimits {
            header: args.header_timeout,
            body: args.body_timeout,
            idle: args.idle_timeout,
            max_requests: args.max_requests_per_connection,
        },
        prefix_cache: prefix_cache_bytes(args, context).map(|bytes| PrefixCacheOptions {
            bytes,
            stride: usize::try_from(args.prefix_stride).unwrap_or(usize::MAX),
        }),
        access_log: !args.no_access_log,
        health_needs_key: args.health_needs_key,
        grace: Duration::from_secs_f64(args.grace),
    };
    let open = OpenModel {
        model_dir: &model_dir,
        storage: &args.storage,
        pipeline: &args.pipeline,
        threads: args.threads,
        kernels,
        placement,
        sequences: args.max_batch,
        chunk: opts.batch.step_rows(),
        context,
        drafting: opts.batch.draft_plan(args.drafting.draft.is_none()),
        reserved: opts.prefix_cache.filter(|_| args.storage.trunk.is_some()).map(|c| ("--prefix-cache-gb", c.bytes)),
    };
    open.run(Start { listener, opts })
}

/// Serving, once the model is open.
struct Start {
    listener: TcpListener,
    opts: ServeOptions,
}

impl ModelJob for Start {
    fn run<S: WeightSource + LayerHook>(
        self,
        opened: &Opened<S>,
        plan: Option<&Plan>,
        storage: &dyn Fn(&S) -> Option<StreamStats>,
    ) -> anyhow::Result<()> {
        // The plan may hold fewer sequences than asked for.
        let mut opts = self.opts;
        if let Some(p) = plan {
            opts.batch.max_batch = p.sequences;
            if p.draft_journals == 0 {
                opts.batch.draft = None;
            }
        }
        start(opened, self.listener, &opts, storage)
    }
}

/// Binds `host:port`, warning when the address is reachable from elsewhere without a key.
fn bind(host: &str, port: u16) -> anyhow::Result<TcpListener> {
    let addrs: Vec<_> = (host, port)
        .to_socket_addrs()
        .map_err(|e| UsageError(format!("--host {host:?} is not an address this machine can bind ({e})")))?
        .collect();
    let listener = TcpListener::bind(&addrs[..]).with_context(|| format!("binding {host}:{port}"))?;
    Ok(listener)
}

fn start<S: WeightSource + LayerHook>(
    opened: &Opened<S>,
    listener: TcpListener,
    opts: &ServeOptions,
    storage: &dyn Fn(&S) -> Option<StreamStats>,
) -> anyhow::Result<()> {
    let loopback = listener.local_addr().map(|a| is_loopback(a.ip())).unwrap_or(false);
    if !loopback && opts.api_key.is_none() {
        eprintln!(
            "k3ring: warning: serving on a non-loopback address without --api-key: anyone who can reach this machine can use the model"
        );
    }
    let name = opts.model_name.clone();
    serve(opened, listener, opts, storage, |r: &Ready| {
        eprintln!(
            "k3ring: serving model {name:?} with {} sequence slots of {} positions, up to {} waiting",
            r.slots, r.context, opts.max_queue
        );
        eprintln!("k3ring: listening on http://{}", r.addr);
    })?;
    eprintln!("k3ring: server stopped");
    Ok(())
}

/// Default prefix cache: 1 GB, or a tenth of the streaming budget when that is less.
const DEFAULT_PREFIX_CACHE_GB: f64 = 1.0;

/// The prefix cache's bytes (None: off): as given, else the default.
fn prefix_cache_bytes(args: &ServeArgs, context: usize) -> Option<u64> {
    let gb = crate::storage::plan::GB;
    let bytes = match args.prefix_cache_gb {
        Some(given) => (given * gb) as u64,
        None => {
            let default = (DEFAULT_PREFIX_CACHE_GB * gb) as u64;
            let budget = args.storage.trunk.as_ref().and_then(|_| {
                super::run::streaming_run(&args.pipeline, &args.storage, args.threads, args.prefill_chunk, context).ok()
            });
            budget.map_or(default, |r| default.min(r.budget_bytes / 10))
        }
    };
    (bytes > 0).then_some(bytes)
}

/// A connection timeout in seconds: finite and above 0 (a limit of 0 would close every
/// connection before its first byte; a large number is the way to say "practically none").
fn parse_timeout(s: &str) -> Result<Duration, String> {
    let secs: f64 = s.trim().parse().map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(secs.is_finite() && secs > 0.0) {
        return Err(format!("{s} must be a number of seconds above 0"));
    }
    Duration::try_from_secs_f64(secs).map_err(|_| format!("{s} seconds is too long"))
}

fn is_loopback(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_loopback(),
        IpAddr::V6(v6) => v6.is_loopback() || v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()),
    }
}
