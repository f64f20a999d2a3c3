//! One line per request on stderr (`--no-access-log` turns it off): method, path, status,
//! tokens and time, as a person watching a server wants to see it. A streamed response is
//! logged when its stream ends (its tokens are known then), or when the client leaves first.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;

use super::routes::App;

/// A response's tokens (prompt, completion), for its log line.
#[derive(Clone, Copy, Debug)]
pub struct Tokens(pub usize, pub usize);

/// Marks a streamed response: its stream writes the line ([`StreamLog`]).
#[derive(Clone, Copy, Debug)]
pub struct Streamed;

/// The line of one request.
pub fn line(method: &str, path: &str, status: u16, tokens: Option<Tokens>, took: Duration, note: &str) -> String {
    let tokens = tokens.map_or(String::new(), |Tokens(p, c)| format!(" | {p} prompt + {c} completion tokens"));
    let note = if note.is_empty() { String::new() } else { format!(" | {note}") };
    format!("k3ring: {method} {path} {status}{tokens} | {:.3} s{note}", took.as_secs_f64())
}

/// Writes one line to stderr, whole (lines of concurrent requests never interleave); a failed
/// write (stderr closed) loses the line, never the request.
fn emit(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// The middleware: logs every response that is not streamed.
pub async fn middleware(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    if !app.access_log {
        return next.run(req).await;
    }
    let (method, path) = (req.method().to_string(), req.uri().path().to_owned());
    let started = Instant::now();
    let response = next.run(req).await;
    if response.extensions().get::<Streamed>().is_none() {
        let tokens = response.extensions().get::<Tokens>().copied();
        emit(&line(&method, &path, response.status().as_u16(), tokens, started.elapsed(), ""));
    }
    response
}

/// What a streamed response needs to write its line when it ends.
pub struct StreamLog {
    pub path: &'static str,
    pub started: Instant,
    pub done: bool,
}

impl StreamLog {
    /// The stream ended: with the usage's tokens, or with an error event.
    pub fn end(&mut self, tokens: Option<Tokens>, note: &str) {
        if !self.done {
            self.done = true;
            emit(&line("POST", self.path, 200, tokens, self.started.elapsed(), note));
        }
    }
}

impl Drop for StreamLog {
    fn drop(&mut self) {
        self.end(None, "streamed; the client left before the end");
    }
}
