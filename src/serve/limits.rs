//! Per-connection limits: a slow or idle client loses its connection, not the server's capacity.
//!
//! - **Header timeout** (`--header-timeout`): a request's head must arrive whole within it,
//!   counted from the connection's start for the first request and from the first byte of each
//!   later one. A client trickling header lines (slowloris) is closed when it runs out.
//! - **Body timeout** (`--body-timeout`): the whole body within it, counted from the end of the
//!   head; a late body is answered 408 and the connection closed.
//! - **Idle timeout** (`--idle-timeout`): a keep-alive connection with no request in flight and
//!   no byte of a new one is closed after it.
//! - **Requests per connection** (`--max-requests-per-connection`): the last one allowed is
//!   answered with `Connection: close`.
//!
//! Nothing here touches a request once its body is read: generation, however long, and a
//! streamed reply are never cut by these limits. The connection's state lives in a [`Watch`]
//! that three parties update: the socket ([`super::connections::Counted`]) sees bytes arrive, the service
//! wrapper ([`Tracked`]) sees heads parsed and replies finished, and the connection's task in
//! [`super::http`] sleeps until the next deadline.
#![forbid(unsafe_code)]

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, Request, Response};
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::service::TowerToHyperService;
use tokio::sync::Notify;
use tokio::time::{Instant, Sleep};

use super::metrics::Shared;

/// The limits every connection gets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    pub header: Duration,
    pub body: Duration,
    pub idle: Duration,
    pub max_requests: u64,
}

impl Default for ConnLimits {
    /// nginx waits 60 s for a head and between body reads and 75 s on an idle keep-alive
    /// connection; hyper's header timeout is 30 s; llama-server's HTTP library closes idle
    /// connections after 5 s and after 5 requests. A model server's requests are few and long,
    /// and its heads are small: 10 s for a head (a client on any real network sends one in
    /// milliseconds), 60 s for a body of at most `--max-body`, 30 s idle (longer than the
    /// 5 s most HTTP client pools keep an idle connection, so the client closes first), and
    /// nginx's 1,000 requests per connection.
    fn default() -> ConnLimits {
        ConnLimits {
            header: Duration::from_secs(10),
            body: Duration::from_secs(60),
            idle: Duration::from_secs(30),
            max_requests: 1000,
        }
    }
}

/// Why the server closed a connection (the `reason` label of
/// `k3ring_connections_closed_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CloseReason {
    HeaderTimeout,
    BodyTimeout,
    IdleTimeout,
    MaxRequests,
}

impl CloseReason {
    pub const ALL: [CloseReason; 4] =
        [CloseReason::HeaderTimeout, CloseReason::BodyTimeout, CloseReason::IdleTimeout, CloseReason::MaxRequests];

    pub fn label(self) -> &'static str {
        match self {
            CloseReason::HeaderTimeout => "header_timeout",
            CloseReason::BodyTimeout => "body_timeout",
            CloseReason::IdleTimeout => "idle_timeout",
            CloseReason::MaxRequests => "max_requests",
        }
    }
}

/// Connections closed by reason.
#[derive(Debug, Default)]
pub struct Closed([AtomicU64; 4]);

impl Closed {
    pub fn count(&self, reason: CloseReason) {
        self.0[reason as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self, reason: CloseReason) -> u64 {
        self.0[reason as usize].load(Ordering::Relaxed)
    }
}

/// One connection's state. Times are nanoseconds since `base` plus one, 0 meaning "none".
#[derive(Debug)]
pub struct Watch {
    base: Instant,
    /// Requests whose head was parsed and whose reply is not finished.
    in_flight: AtomicUsize,
    /// When the head being read started (the connection's start for the first request).
    head_since: AtomicU64,
    /// When the last reply finished (no request in flight).
    idle_since: AtomicU64,
    requests: AtomicU64,
    changed: Notify,
}

impl Watch {
    pub fn new() -> Arc<Watch> {
        Arc::new(Watch {
            base: Instant::now(),
            in_flight: AtomicUsize::new(0),
            head_since: AtomicU64::new(1),
            idle_since: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            changed: Notify::new(),
        })
    }

    fn stamp(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_nanos()).unwrap_or(u64::MAX - 1) + 1
    }

    fn at(&self, stamp: u64) -> Instant {
        self.base + Duration::from_nanos(stamp - 1)
    }

    /// Bytes arrived (the socket, [`super::connections::Counted`], says so): with no request in
    /// flight they start a new head.
    pub(super) fn bytes_read(&self) {
        if self.in_flight.load(Ordering::Relaxed) == 0 && self.head_since.load(Ordering::Relaxed) == 0 {
            self.head_since.store(self.stamp(), Ordering::Relaxed);
            self.idle_since.store(0, Ordering::Relaxed);
            self.changed.notify_one();
        }
    }

    /// A head was parsed; returns the request's number on this connection (from 1).
    fn request_started(&self) -> u64 {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.head_since.store(0, Ordering::Relaxed);
        self.idle_since.store(0, Ordering::Relaxed);
        self.changed.notify_one();
        self.requests.fetch_add(1, Ordering::Relaxed) + 1
    }

    fn request_finished(&self) {
        if self.in_flight.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.idle_since.store(self.stamp(), Ordering::Relaxed);
            self.changed.notify_one();
        }
    }

    /// When the connection is due to be closed, and why (none while a request is in flight).
    pub fn deadline(&self, limits: &ConnLimits) -> Option<(Instant, CloseReason)> {
        if self.in_flight.load(Ordering::Relaxed) > 0 {
            return None;
        }
        let head = self.head_since.load(Ordering::Relaxed);
        if head != 0 {
            return Some((self.at(head) + limits.header, CloseReason::HeaderTimeout));
        }
        let idle = self.idle_since.load(Ordering::Relaxed);
        (idle != 0).then(|| (self.at(idle) + limits.idle, CloseReason::IdleTimeout))
    }

    /// Resolves when the state changed since the last call (the deadline may have moved).
    pub async fn changed(&self) {
        self.changed.notified().await;
    }
}

/// The error a request body gives when it is not whole within the body timeout.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {} s (--body-timeout)", .0.as_secs_f64())]
pub struct BodyTimeout(pub Duration);

/// A request body with a deadline.
struct TimedBody {
    inner: Incoming,
    deadline: Pin<Box<Sleep>>,
    limit: Duration,
    shared: Arc<Shared>,
    done: bool,
}

impl http_body::Body for TimedBody {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => {
                self.done = true;
                Poll::Ready(Some(Err(Box::new(e))))
            }
            Poll::Ready(Some(Ok(frame))) => Poll::Ready(Some(Ok(frame))),
            Poll::Pending => {
                if self.deadline.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.done = true;
                self.shared.closed.count(CloseReason::BodyTimeout);
                Poll::Ready(Some(Err(Box::new(BodyTimeout(self.limit)))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Marks the reply finished on the connection's [`Watch`] when hyper drops its body (after the
/// last byte is written, or when the connection goes).
struct InFlight(Arc<Watch>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.request_finished();
    }
}

/// A reply body holding its request's [`InFlight`] mark.
struct TrackedBody {
    inner: Body,
    _in_flight: InFlight,
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The router as one connection's hyper service: requests are counted on the [`Watch`], bodies
/// get their deadline, and the last request allowed closes the connection.
#[derive(Clone)]
pub struct Tracked {
    inner: TowerToHyperService<axum::Router>,
    watch: Arc<Watch>,
    limits: ConnLimits,
    shared: Arc<Shared>,
}

impl Tracked {
    pub fn new(router: axum::Router, watch: Arc<Watch>, limits: ConnLimits, shared: Arc<Shared>) -> Tracked {
        Tracked { inner: TowerToHyperService::new(router), watch, limits, shared }
    }
}

impl hyper::service::Service<Request<Incoming>> for Tracked {
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        let number = self.watch.request_started();
        let in_flight = InFlight(Arc::clone(&self.watch));
        let (limit, shared) = (self.limits.body, Arc::clone(&self.shared));
        let req = req.map(|inner| {
            let deadline = Box::pin(tokio::time::sleep(limit));
            Body::new(TimedBody { inner, deadline, limit, shared, done: false })
        });
        let last = number >= self.limits.max_requests;
        let shared = Arc::clone(&self.shared);
        let reply = hyper::service::Service::call(&self.inner, req);
        Box::pin(async move {
            let mut resp = reply.await?;
            let closing =
                resp.headers().get(header::CONNECTION).is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"close"));
            if last && !closing {
                resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
                shared.closed.count(CloseReason::MaxRequests);
            }
            Ok(resp.map(|inner| Body::new(TrackedBody { inner, _in_flight: in_flight })))
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn limits() -> ConnLimits {
        ConnLimits {
            header: Duration::from_secs(2),
            body: Duration::from_secs(3),
            idle: Duration::from_secs(5),
            max_requests: 10,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn deadlines_follow_the_connection_state() {
        let w = Watch::new();
        let start = w.base;
        // A new connection has the header timeout from its start, whatever bytes arrive.
        assert_eq!(w.deadline(&limits()), Some((start + Duration::from_secs(2), CloseReason::HeaderTimeout)));
        tokio::time::advance(Duration::from_secs(1)).await;
        w.bytes_read();
        assert_eq!(w.deadline(&limits()), Some((start + Duration::from_secs(2), CloseReason::HeaderTimeout)));
        // While a request is in flight nothing is due, however long it takes.
        assert_eq!(w.request_started(), 1);
        assert_eq!(w.deadline(&limits()), None);
        tokio::time::advance(Duration::from_secs(100)).await;
        assert_eq!(w.deadline(&limits()), None);
        // Its reply done, the idle timeout runs from then.
        w.request_finished();
        let idle_from = Instant::now();
        assert_eq!(w.deadline(&limits()), Some((idle_from + Duration::from_secs(5), CloseReason::IdleTimeout)));
        // The first byte of a new head starts the header timeout.
        tokio::time::advance(Duration::from_secs(4)).await;
        w.bytes_read();
        let head_from = Instant::now();
        assert_eq!(w.deadline(&limits()), Some((head_from + Duration::from_secs(2), CloseReason::HeaderTimeout)));
        // Pipelined requests: idle only once both are finished.
        assert_eq!(w.request_started(), 2);
        assert_eq!(w.request_started(), 3);
        w.request_finished();
        assert_eq!(w.deadline(&limits()), None);
        w.request_finished();
        assert_eq!(w.deadline(&limits()).map(|d| d.1), Some(CloseReason::IdleTimeout));
    }

    #[test]
    fn close_reasons_have_distinct_labels_and_counters() {
        let closed = Closed::default();
        for (i, r) in CloseReason::ALL.iter().enumerate() {
            assert_eq!(*r as usize, i);
            for _ in 0..=i {
                closed.count(*r);
            }
        }
        for (i, r) in CloseReason::ALL.iter().enumerate() {
            assert_eq!(closed.get(*r), i as u64 + 1, "{}", r.label());
        }
        let labels: std::collections::BTreeSet<_> = CloseReason::ALL.iter().map(|r| r.label()).collect();
        assert_eq!(labels.len(), 4);
    }
}
