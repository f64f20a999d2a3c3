//! `k3ring serve`: an OpenAI-compatible HTTP server on the batching engine.
//!
//! Two threads of our own: the network thread runs a single-threaded tokio runtime with the
//! axum router ([`routes`]); the calling thread runs the model ([`worker`]): the [`Batcher`]
//! loop, exactly as `k3ring batch` does, with the engine's compute pool. They talk over
//! channels: a std channel of submissions into the model thread, and per request an unbounded
//! tokio channel of events back. Request JSON is checked on the network side ([`api`]); the
//! tokenizer and the model are only touched on the model thread.
//!
//! Shutdown: SIGINT or SIGTERM stops the listener and admissions; requests in flight finish
//! within the grace period or are cancelled with a 503; then [`serve`] returns.
//!
//! [`Batcher`]: crate::engine::Batcher
#![forbid(unsafe_code)]

mod access_log;
pub mod api;
pub mod connections;
pub mod error;
mod http;
pub mod limits;
pub mod logprobs;
pub mod metrics;
pub mod routes;
pub mod worker;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::engine::{BatchOptions, EngineError, Opened};
use crate::exit::{Classify, ExitCode};
use crate::model::weights::WeightSource;
use crate::model::LayerHook;
use crate::storage::stream::StreamStats;
use metrics::Shared;
use worker::{Worker, WorkerOptions};

/// How the server is sized and named.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// The model name clients must use (or omit).
    pub model_name: String,
    pub batch: BatchOptions,
    /// Requests that may wait for a slot; one more gets 429.
    pub max_queue: usize,
    /// `max_tokens` at most (and the default).
    pub max_tokens: usize,
    pub api_key: Option<String>,
    /// Request body bytes at most.
    pub body_limit: usize,
    /// Connections open at once at most; one more is answered 503 and closed.
    pub max_connections: usize,
    /// Per-connection timeouts and request cap.
    pub limits: limits::ConnLimits,
    /// Snapshots of prompts' states for later requests to start from (None: off).
    pub prefix_cache: Option<crate::engine::prefix_cache::PrefixCacheOptions>,
    /// How long requests in flight may go on after SIGINT/SIGTERM.
    pub grace: Duration,
    /// A line per request on stderr.
    pub access_log: bool,
    /// `/health` asks for the API key too.
    pub health_needs_key: bool,
}

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("the network side failed: {0}")]
    Network(#[source] std::io::Error),
}

impl Classify for ServeError {
    fn exit_code(&self) -> ExitCode {
        match self {
            ServeError::Engine(e) => e.exit_code(),
            ServeError::Network(_) => ExitCode::Io,
        }
    }
}

/// What the server looks like once it is up (for the caller to print).
#[derive(Clone, Debug)]
pub struct Ready {
    pub addr: SocketAddr,
    pub slots: usize,
    pub context: usize,
}

/// Serves on `listener` until SIGINT/SIGTERM and the grace period; runs the model on the
/// calling thread. `storage` reads the streaming counters (None when resident); `on_ready` is
/// called once the server accepts requests.
pub fn serve<S: WeightSource + LayerHook>(
    opened: &Opened<S>,
    listener: std::net::TcpListener,
    opts: &ServeOptions,
    storage: &dyn Fn(&S) -> Option<StreamStats>,
    on_ready: impl FnOnce(&Ready),
) -> Result<(), ServeError> {
    let (engine, tok) = (&opened.engine, &opened.tokenizer);
    let mut batcher = engine.batcher(opts.batch.clone())?;
    if let Some(cache) = opts.prefix_cache {
        batcher.enable_prefix_cache(cache);
    }
    let slots = batcher.slots();
    let shared = Arc::new(Shared::default());
    let wopts = WorkerOptions { max_tokens: opts.max_tokens, grace: opts.grace };
    let mut worker = Worker::new(batcher, tok, &engine.model.cfg, wopts, Arc::clone(&shared));
    let context = worker.context();
    let addr = listener.local_addr().map_err(ServeError::Network)?;
    listener.set_nonblocking(true).map_err(ServeError::Network)?;
    let (tx, rx) = std::sync::mpsc::channel();
    let app = Arc::new(routes::App {
        submit: Mutex::new(tx),
        shared: Arc::clone(&shared),
        limits: api::Limits { model: opts.model_name.clone(), max_tokens: opts.max_tokens },
        api_key: opts.api_key.clone(),
        body_limit: opts.body_limit,
        slots,
        max_queue: opts.max_queue,
        started: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        next_id: AtomicU64::new(0),
        access_log: opts.access_log,
        health_needs_key: opts.health_needs_key,
    });
    let net_shared = Arc::clone(&shared);
    let (up_tx, up_rx) = std::sync::mpsc::channel();
    let network = std::thread::Builder::new()
        .name("k3ring-http".into())
        .spawn({
            let (max_connections, limits) = (opts.max_connections, opts.limits);
            move || network_thread(listener, max_connections, limits, app, net_shared, up_tx)
        })
        .map_err(ServeError::Network)?;
    // Ready once the signal handlers are in place (a SIGTERM right after the address is printed
    // must shut down cleanly, not kill the process) and the listener is on the runtime.
    if up_rx.recv().is_err() {
        let e = match network.join() {
            Ok(Err(e)) => e,
            _ => std::io::Error::other("the network thread stopped before serving"),
        };
        return Err(ServeError::Network(e));
    }
    on_ready(&Ready { addr, slots, context });
    let overlap = || engine.model.tracer.as_ref().map(|t| t.metrics().overlap_fraction);
    let result = worker.run(&rx, storage, &engine.src, &overlap);
    if let Err(e) = &result {
        tracing::error!("stopping the server: the engine failed while serving: {e}");
    }
    // The model loop is over (shutdown, or the engine failed): stop admitting, and give the
    // network side a moment to finish the responses in flight.
    shared.shutting_down.store(true, Ordering::Relaxed);
    drop(worker);
    drop(rx);
    let wait = Instant::now();
    while !network.is_finished() && wait.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let net = if network.is_finished() {
        network.join().unwrap_or_else(|_| Err(std::io::Error::other("the network thread panicked")))
    } else {
        Ok(())
    };
    result?;
    net.map_err(ServeError::Network)
}

/// The tokio runtime and the axum server, until a signal (or the model thread's end). Sends on
/// `up` once it serves.
fn network_thread(
    listener: std::net::TcpListener,
    max_connections: usize,
    limits: limits::ConnLimits,
    app: Arc<routes::App>,
    shared: Arc<Shared>,
    up: std::sync::mpsc::Sender<()>,
) -> std::io::Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let signal_shared = Arc::clone(&shared);
    let r = rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let listener = connections::CappedListener::new(listener, max_connections, Arc::clone(&signal_shared));
        let int = signal(SignalKind::interrupt())?;
        let term = signal(SignalKind::terminate())?;
        let _ = up.send(());
        let conn_shared = Arc::clone(&signal_shared);
        let stop = async move {
            shutdown_signal(&signal_shared, int, term).await;
            signal_shared.shutting_down.store(true, Ordering::Relaxed);
        };
        http::serve(listener, routes::router(app), limits, conn_shared, stop).await;
        Ok::<(), std::io::Error>(())
    });
    shared.shutting_down.store(true, Ordering::Relaxed);
    r
}

/// SIGINT or SIGTERM; or the model thread's end (the flag set by someone else). A second
/// signal after the first ends the process at once (exit 130).
async fn shutdown_signal(shared: &Shared, mut int: tokio::signal::unix::Signal, mut term: tokio::signal::unix::Signal) {
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = int.recv() => break,
            _ = term.recv() => break,
            _ = tick.tick() => if shared.shutting_down() { return },
        }
    }
    tracing::info!("shutting down: no new requests; those in flight finish within the grace period");
    tokio::spawn(async move {
        tokio::select! {
            _ = int.recv() => {},
            _ = term.recv() => {},
        }
        std::process::exit(i32::from(u8::from(ExitCode::Interrupted)));
    });
}
