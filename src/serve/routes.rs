//! The HTTP side (axum on tokio): routes, the API key check, body limit, admission (429), and
//! turning a request's events into a JSON response or server-sent events. Nothing here runs
//! the model: requests go to the model thread over a channel.
#![forbid(unsafe_code)]

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use http_body::Frame;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::access_log::{StreamLog, Streamed, Tokens};
use super::api::{chat_job, completion_job, Limits, Usage};
use super::error::ApiError;
use super::logprobs::{self, Entry};
use super::metrics::Shared;
use super::worker::{Event, Submission};

/// What every handler sees.
pub struct App {
    pub submit: Mutex<Sender<Submission>>,
    pub shared: Arc<Shared>,
    pub limits: Limits,
    pub api_key: Option<String>,
    /// Request body bytes at most.
    pub body_limit: usize,
    pub slots: usize,
    pub max_queue: usize,
    /// Unix seconds the server started (the model's `created`).
    pub started: u64,
    pub next_id: AtomicU64,
    /// A line per request on stderr ([`super::access_log`]).
    pub access_log: bool,
    /// `/health` asks for the API key too (by default it answers anyone, as load balancers
    /// probe it without credentials).
    pub health_needs_key: bool,
}

type AppState = State<Arc<App>>;

/// The router with every endpoint.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(Arc::clone(&app), super::access_log::middleware))
        .with_state(app)
}

fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let mut r = (status, axum::Json(e.body())).into_response();
    if let Some(s) = e.retry_after {
        r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
    }
    if e.status == 408 {
        r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    if e.status == 401 {
        r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    r
}

/// Checks `Authorization: Bearer KEY` when the server has a key (in time independent of where
/// a wrong key differs).
fn authorize(app: &App, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &app.api_key else { return Ok(()) };
    let given = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    let Some(given) = given else {
        return Err(ApiError::unauthorized("no API key: send the header `Authorization: Bearer KEY`"));
    };
    // The scheme is case-insensitive (RFC 9110 §11.1): `bearer KEY` is the same header.
    let token = match given.trim_start().split_once(' ') {
        Some((scheme, key)) if scheme.eq_ignore_ascii_case("bearer") => key.trim().as_bytes(),
        _ => b"",
    };
    let want = key.as_bytes();
    let mut diff = u8::from(token.len() != want.len());
    for (i, &b) in want.iter().enumerate() {
        diff |= b ^ token.get(i).copied().unwrap_or(0);
    }
    if diff != 0 {
        return Err(ApiError::unauthorized("the API key is wrong"));
    }
    Ok(())
}

/// Answers, counting the status by endpoint.
fn counted(app: &App, endpoint: &'static str, r: Result<Response, ApiError>) -> Response {
    let response = r.unwrap_or_else(|e| error_response(&e));
    app.shared.count_request(endpoint, response.status().as_u16());
    response
}

async fn health(State(app): AppState, headers: HeaderMap) -> Response {
    let checked = if app.health_needs_key { authorize(&app, &headers) } else { Ok(()) };
    let r = checked.map(|()| {
        if app.shared.shutting_down() {
            (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": "shutting_down"}))).into_response()
        } else {
            axum::Json(json!({"status": "ok"})).into_response()
        }
    });
    counted(&app, "health", r)
}

async fn metrics(State(app): AppState, headers: HeaderMap) -> Response {
    let r = authorize(&app, &headers).map(|()| {
        let text = app.shared.render(app.slots, app.max_queue);
        ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
    });
    counted(&app, "metrics", r)
}

fn model_object(app: &App) -> Value {
    json!({"id": app.limits.model, "object": "model", "created": app.started, "owned_by": "k3ring"})
}

async fn models(State(app): AppState, headers: HeaderMap) -> Response {
    let r = authorize(&app, &headers)
        .map(|()| axum::Json(json!({"object": "list", "data": [model_object(&app)]})).into_response());
    counted(&app, "models", r)
}

async fn model(State(app): AppState, headers: HeaderMap, Path(id): Path<String>) -> Response {
    let r = authorize(&app, &headers).and_then(|()| {
        if id == app.limits.model {
            Ok(axum::Json(model_object(&app)).into_response())
        } else {
            Err(ApiError::not_found("model_not_found", format!("the model {id:?} does not exist here")))
        }
    });
    counted(&app, "models", r)
}

async fn not_found(State(app): AppState, uri: axum::http::Uri) -> Response {
    let e = ApiError::not_found("not_found", format!("no endpoint {}", uri.path()));
    counted(&app, "other", Err(e))
}

async fn method_not_allowed(State(app): AppState, method: axum::http::Method, uri: axum::http::Uri) -> Response {
    let e = ApiError::method_not_allowed(format!("{method} is not allowed on {}", uri.path()));
    counted(&app, "other", Err(e))
}

async fn completions(State(app): AppState, headers: HeaderMap, body: Body) -> Response {
    let r = generate(&app, &headers, body, Kind::Completion).await;
    counted(&app, "completions", r)
}

async fn chat_completions(State(app): AppState, headers: HeaderMap, body: Body) -> Response {
    let r = generate(&app, &headers, body, Kind::Chat).await;
    counted(&app, "chat_completions", r)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

async fn read_body(app: &App, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let limit = app.body_limit;
    let too_large =
        || ApiError::too_large(format!("the request body is larger than this server's limit of {limit} bytes"));
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        // Only the limit is 413; a malformed chunk or an upload the client broke off is 400.
        // The body's own errors come wrapped once or twice (axum's body, then `to_bytes`).
        let chain = || std::iter::successors(std::error::Error::source(&e), |s| s.source());
        if chain().any(|s| s.is::<http_body_util::LengthLimitError>()) {
            too_large()
        } else if let Some(late) = chain().find_map(|s| s.downcast_ref::<super::limits::BodyTimeout>()) {
            ApiError::request_timeout(late.to_string())
        } else {
            ApiError::invalid(format!("the request body could not be read: {e}"))
        }
    })
}

async fn generate(app: &App, headers: &HeaderMap, body: Body, kind: Kind) -> Result<Response, ApiError> {
    let started = std::time::Instant::now();
    authorize(app, headers)?;
    let capacity = app.slots.saturating_add(app.max_queue);
    let full = || {
        ApiError::queue_full(
            format!(
                "the server is full: {} requests running and {} waiting (--max-queue); retry later",
                app.slots, app.max_queue
            ),
            1,
        )
    };
    // A full server refuses before reading the body: it spends neither time nor memory on an
    // upload it would refuse. Admission itself comes after parsing, so a malformed request
    // never holds a place.
    if app.shared.shutting_down() {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    if app.shared.is_full(capacity) {
        return Err(full());
    }
    let body = read_body(app, headers, body).await?;
    let job = match kind {
        Kind::Completion => completion_job(&body, &app.limits)?,
        Kind::Chat => chat_job(&body, &app.limits)?,
    };
    if app.shared.shutting_down() {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    if !app.shared.try_admit(capacity) {
        return Err(full());
    }
    let (tx, mut rx) = unbounded_channel();
    let (stream, include_usage, return_ids) = (job.stream, job.include_usage, job.return_token_ids);
    let with_logprobs = job.logprobs.is_some();
    let sent = app.submit.lock().map(|s| s.send(Submission { job, events: tx }).is_ok()).unwrap_or(false);
    if !sent {
        app.shared.release();
        return Err(ApiError::unavailable("the model thread has stopped"));
    }
    let (prompt_ids, echo) = match rx.recv().await {
        Some(Event::Started { prompt_ids, echo }) => (prompt_ids, echo),
        Some(Event::Refused(e) | Event::Aborted(e)) => return Err(e),
        _ => return Err(ApiError::unavailable("the model thread has stopped")),
    };
    let n = app.next_id.fetch_add(1, Ordering::Relaxed);
    let id = match kind {
        Kind::Completion => format!("cmpl-{:x}-{n}", app.started),
        Kind::Chat => format!("chatcmpl-{:x}-{n}", app.started),
    };
    let created = now_secs();
    let head = Head { id, created, model: app.limits.model.clone(), kind };
    if stream {
        let log = app.access_log.then(|| StreamLog {
            path: if kind == Kind::Chat { "/v1/chat/completions" } else { "/v1/completions" },
            started,
            done: false,
        });
        let body =
            SseBody { rx, head, include_usage, with_logprobs, text_offset: 0, started: false, finished: false, log };
        let mut r = Response::new(Body::new(body));
        r.extensions_mut().insert(Streamed);
        let h = r.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        return Ok(r);
    }
    let ask = Whole { head, echo, with_logprobs, prompt_ids: return_ids.then_some(prompt_ids) };
    whole_reply(rx, ask).await
}

/// What a non-streamed reply is built from, besides its events.
struct Whole {
    head: Head,
    echo: Option<logprobs::Echo>,
    with_logprobs: bool,
    /// `return_token_ids`: the prompt's ids go in the reply.
    prompt_ids: Option<Vec<u32>>,
}

/// Collects a request's events into its non-streamed reply.
async fn whole_reply(mut rx: UnboundedReceiver<Event>, ask: Whole) -> Result<Response, ApiError> {
    let Whole { head, echo, with_logprobs, prompt_ids } = ask;
    let (mut reasoning, mut content, mut ids, mut entries) = (String::new(), String::new(), Vec::new(), Vec::new());
    let mut prompt_entries = Vec::new();
    let mut calls: Vec<Value> = Vec::new();
    loop {
        match rx.recv().await {
            Some(Event::PromptLogprobs(lps)) => prompt_entries.extend(lps),
            Some(Event::Delta { reasoning: r, content: c, tool_calls, ids: i, logprobs }) => {
                calls.extend(tool_calls.into_iter().map(|mut call| {
                    // `index` belongs to streamed deltas only.
                    if let Some(o) = call.as_object_mut() {
                        o.remove("index");
                    }
                    call
                }));
                reasoning.push_str(&r);
                content.push_str(&c);
                ids.extend(i);
                entries.extend(logprobs);
            }
            Some(Event::Done { finish_reason, usage }) => {
                let tokens = Tokens(usage.prompt_tokens, usage.completion_tokens);
                let mut v = match &echo {
                    None => {
                        let logprobs = with_logprobs.then(|| head.logprobs(&entries, 0).0);
                        let mut v = head.whole(&reasoning, &content, &ids, finish_reason, usage, logprobs);
                        if !calls.is_empty() {
                            let message = &mut v["choices"][0]["message"];
                            message["tool_calls"] = Value::from(calls.clone());
                            if content.is_empty() {
                                message["content"] = Value::Null;
                            }
                        }
                        v
                    }
                    Some(echo) => {
                        let logprobs = with_logprobs.then(|| echoed_logprobs(echo, prompt_entries, &entries));
                        let text = format!("{}{content}", echo.text);
                        head.whole(&reasoning, &text, &ids, finish_reason, usage, logprobs)
                    }
                };
                if let Some(prompt_ids) = &prompt_ids {
                    v["prompt_token_ids"] = json!(prompt_ids);
                }
                let mut r = axum::Json(v).into_response();
                r.extensions_mut().insert(tokens);
                return Ok(r);
            }
            Some(Event::Aborted(e)) => return Err(e),
            Some(Event::Started { .. } | Event::Refused(_)) => {}
            None => return Err(ApiError::unavailable("the model thread has stopped")),
        }
    }
}

/// A completion's `logprobs` with `echo`: the prompt's tokens first (the first with none, as
/// nothing predicts it), then the generated ones.
fn echoed_logprobs(echo: &logprobs::Echo, prompt: Vec<Entry>, generated: &[Entry]) -> Value {
    let entries: Vec<Option<Entry>> =
        std::iter::once(None).chain(prompt.into_iter().map(Some)).chain(generated.iter().cloned().map(Some)).collect();
    let tokens: Vec<logprobs::Piece> =
        echo.tokens.iter().cloned().chain(generated.iter().map(|e| e.token.clone())).collect();
    logprobs::completion_object(&entries, &tokens, 0).0
}

fn now_secs() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The fields every response object of one request shares.
struct Head {
    id: String,
    created: u64,
    model: String,
    kind: Kind,
}

impl Head {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    /// The `logprobs` object of the generated tokens in `entries` (a completion's offsets
    /// counted from `offset`), and the offset after them.
    fn logprobs(&self, entries: &[Entry], offset: usize) -> (Value, usize) {
        match self.kind {
            Kind::Chat => (logprobs::chat_object(entries), offset),
            Kind::Completion => {
                let tokens: Vec<_> = entries.iter().map(|e| e.token.clone()).collect();
                let entries: Vec<_> = entries.iter().cloned().map(Some).collect();
                logprobs::completion_object(&entries, &tokens, offset)
            }
        }
    }

    /// The non-streamed response.
    fn whole(
        &self,
        reasoning: &str,
        content: &str,
        ids: &[u32],
        finish: &str,
        usage: Usage,
        logprobs: Option<Value>,
    ) -> Value {
        let logprobs = logprobs.unwrap_or(Value::Null);
        let choice = match self.kind {
            Kind::Completion => {
                json!({"index": 0, "text": content, "logprobs": logprobs, "finish_reason": finish, "token_ids": ids})
            }
            Kind::Chat => {
                let mut message = json!({"role": "assistant", "content": content});
                if !reasoning.is_empty() {
                    message["reasoning_content"] = Value::from(reasoning);
                }
                json!({"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish, "token_ids": ids})
            }
        };
        json!({
            "id": self.id, "object": self.object(false), "created": self.created, "model": self.model,
            "choices": [choice], "usage": usage,
        })
    }

    /// One streamed chunk; `delta` is the chat delta or the completion text.
    fn chunk(&self, delta: Value, ids: &[u32], finish: Option<&str>, usage: Option<Usage>) -> Value {
        let mut choice = match self.kind {
            Kind::Completion => json!({"index": 0, "text": delta, "logprobs": null, "finish_reason": finish}),
            Kind::Chat => json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}),
        };
        choice["token_ids"] = json!(ids);
        let mut v = json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "choices": [choice],
        });
        if let Some(u) = usage {
            v["usage"] = json!(u);
        }
        v
    }

    fn usage_chunk(&self, usage: Usage) -> Value {
        json!({
            "id": self.id, "object": self.object(true), "created": self.created, "model": self.model,
            "choices": [], "usage": usage,
        })
    }
}

/// A chunk's `logprobs`, when the request asked for them.
trait WithLogprobs {
    fn with_logprobs(self, logprobs: Option<Value>) -> Self;
}

impl WithLogprobs for Value {
    fn with_logprobs(mut self, logprobs: Option<Value>) -> Value {
        if let Some(lp) = logprobs {
            self["choices"][0]["logprobs"] = lp;
        }
        self
    }
}

fn sse(v: &Value) -> Vec<u8> {
    let mut out = b"data: ".to_vec();
    out.extend(serde_json::to_vec(v).unwrap_or_default());
    out.extend(b"\n\n");
    out
}

/// Server-sent events from a request's event channel: a chunk per delta, the finish chunk
/// (with the usage, unless a separate usage chunk was asked for), then `data: [DONE]`.
/// Dropping it (the client left) drops the receiver, which cancels the sequence.
struct SseBody {
    rx: UnboundedReceiver<Event>,
    head: Head,
    include_usage: bool,
    /// The request asked for log-probabilities: each chunk carries its tokens'.
    with_logprobs: bool,
    /// A completion's characters streamed so far (`text_offset` of the next token).
    text_offset: usize,
    started: bool,
    finished: bool,
    /// The access log's line, written when the stream ends.
    log: Option<StreamLog>,
}

impl SseBody {
    /// The bytes an event becomes (None: nothing to send for it).
    fn encode(&mut self, event: Event) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        if !self.started && self.head.kind == Kind::Chat {
            out.extend(sse(&self.head.chunk(json!({"role": "assistant", "content": ""}), &[], None, None)));
        }
        self.started = true;
        match event {
            Event::Delta { reasoning, content, tool_calls, ids, logprobs } => {
                let logprobs = self.with_logprobs.then(|| {
                    let (v, next) = self.head.logprobs(&logprobs, self.text_offset);
                    self.text_offset = next;
                    v
                });
                if self.head.kind == Kind::Chat {
                    // The ids (and their log-probabilities) go with the first chunk of the two
                    // (reasoning, content) sent.
                    let mut ids = Some((ids, logprobs));
                    if !reasoning.is_empty() {
                        let (ids, lp) =
                            if content.is_empty() { ids.take().unwrap_or_default() } else { Default::default() };
                        let delta = json!({"reasoning_content": reasoning});
                        out.extend(sse(&self.head.chunk(delta, &ids, None, None).with_logprobs(lp)));
                    }
                    if let Some((ids, lp)) = ids.filter(|(i, _)| !i.is_empty() || !content.is_empty()) {
                        out.extend(sse(&self
                            .head
                            .chunk(json!({"content": content}), &ids, None, None)
                            .with_logprobs(lp)));
                    }
                    if !tool_calls.is_empty() {
                        out.extend(sse(&self.head.chunk(json!({"tool_calls": tool_calls}), &[], None, None)));
                    }
                } else {
                    out.extend(sse(&self.head.chunk(Value::from(content), &ids, None, None).with_logprobs(logprobs)));
                }
            }
            Event::Done { finish_reason, usage } => {
                let delta = if self.head.kind == Kind::Chat { json!({}) } else { Value::from("") };
                let inline = (!self.include_usage).then_some(usage);
                out.extend(sse(&self.head.chunk(delta, &[], Some(finish_reason), inline)));
                if self.include_usage {
                    out.extend(sse(&self.head.usage_chunk(usage)));
                }
                out.extend(b"data: [DONE]\n\n");
                self.finished = true;
                if let Some(log) = &mut self.log {
                    log.end(Some(Tokens(usage.prompt_tokens, usage.completion_tokens)), "streamed");
                }
            }
            Event::Aborted(e) => {
                if let Some(log) = &mut self.log {
                    log.end(None, &format!("streamed; ended by an error: {}", e.message));
                }
                out.extend(sse(&e.body()));
                out.extend(b"data: [DONE]\n\n");
                self.finished = true;
            }
            Event::Started { .. } | Event::Refused(_) | Event::PromptLogprobs(_) => {}
        }
        (!out.is_empty()).then_some(out)
    }
}

impl http_body::Body for SseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        loop {
            if self.finished {
                return Poll::Ready(None);
            }
            match self.rx.poll_recv(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    // The model thread dropped the request without a word: end the stream with
                    // an error event rather than a silent truncation.
                    self.finished = true;
                    if let Some(log) = &mut self.log {
                        log.end(None, "streamed; the model thread stopped");
                    }
                    let e = ApiError::unavailable("the model thread has stopped");
                    let mut out = sse(&e.body());
                    out.extend(b"data: [DONE]\n\n");
                    return Poll::Ready(Some(Ok(Frame::data(Bytes::from(out)))));
                }
                Poll::Ready(Some(event)) => {
                    if let Some(bytes) = self.encode(event) {
                        return Poll::Ready(Some(Ok(Frame::data(Bytes::from(bytes)))));
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.finished
    }
}
