//! The HTTP/1 loop: the router on hyper connections, accepted through the connection cap.
//!
//! axum's own `serve` runs hyper with half-closes off, so a client that shuts its write side
//! after sending a request (as `curl --no-keepalive`-style tools and some proxies do) loses its
//! answer: hyper sees the end of input and drops the connection. Here a connection whose client
//! has half-closed is answered and then closed. Graceful shutdown is axum's: on the stop signal
//! no new connection is accepted, each open one finishes its request in flight and closes, and
//! the loop returns once every connection is gone.
#![forbid(unsafe_code)]

use std::future::Future;
use std::pin::pin;

use std::sync::Arc;

use hyper_util::rt::TokioIo;
use tokio::sync::watch;

use super::connections::CappedListener;
use super::limits::{ConnLimits, Tracked};
use super::metrics::Shared;

/// Serves `router` on `listener` until `stop` completes and the open connections have closed;
/// each connection under `limits` ([`super::limits`]).
pub async fn serve(
    mut listener: CappedListener,
    router: axum::Router,
    limits: ConnLimits,
    shared: Arc<Shared>,
    stop: impl Future<Output = ()> + Send + 'static,
) {
    let (signal_tx, signal_rx) = watch::channel(());
    tokio::spawn(async move {
        stop.await;
        drop(signal_rx);
    });
    // Each connection task holds a receiver; the loop ends once all are dropped.
    let (close_tx, close_rx) = watch::channel(());
    loop {
        let (io, _addr) = tokio::select! {
            conn = axum::serve::Listener::accept(&mut listener) => conn,
            () = signal_tx.closed() => break,
        };
        let conn_watch = io.watch();
        let service = Tracked::new(router.clone(), Arc::clone(&conn_watch), limits, Arc::clone(&shared));
        let (signal_tx, close_rx, shared) = (signal_tx.clone(), close_rx.clone(), Arc::clone(&shared));
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.half_close(true);
            let mut conn = pin!(builder.serve_connection(TokioIo::new(io), service));
            let mut signalled = pin!(signal_tx.closed());
            let mut shutting_down = false;
            loop {
                let deadline = conn_watch.deadline(&limits);
                let due = async {
                    match deadline {
                        Some((at, _)) => tokio::time::sleep_until(at).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = due => {
                        // Dropping the connection closes the socket; no request is in flight.
                        if let Some((at, reason)) = conn_watch.deadline(&limits) {
                            if at <= tokio::time::Instant::now() {
                                shared.closed.count(reason);
                                tracing::debug!("connection closed: {}", reason.label());
                                break;
                            }
                        }
                    }
                    () = conn_watch.changed() => {}
                    result = conn.as_mut() => {
                        if let Err(e) = result {
                            tracing::debug!("connection ended: {e}");
                        }
                        break;
                    }
                    () = &mut signalled, if !shutting_down => {
                        shutting_down = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
            drop(close_rx);
        });
    }
    drop(close_rx);
    drop(listener);
    close_tx.closed().await;
}
