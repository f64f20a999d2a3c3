//! What the network side and the model thread share: admission count, shutdown flag and the
//! counters behind `GET /metrics` (Prometheus text format 0.0.4).
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

/// Gauges the model thread sets now and then (rates over its recent window).
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Generated tokens per second over the last seconds, all sequences together.
    pub tokens_per_second: f64,
    /// Trunk and expert bytes read so far (streaming runs; 0 when resident).
    pub bytes_read: u64,
    pub read_bytes_per_second: f64,
    /// Share of wall time I/O and compute were both busy (when the pipeline traces it).
    pub overlap: Option<f64>,
    /// Expert lookups that found the expert resident (streaming runs).
    pub expert_hit_rate: Option<f64>,
    /// The prefix cache's counters (when it is on).
    pub prefix: Option<crate::engine::prefix_cache::PrefixStats>,
}

/// State shared by the handlers and the model thread.
#[derive(Debug, Default)]
pub struct Shared {
    /// Requests admitted and not yet answered in full (queued or running).
    pub pending: AtomicUsize,
    pub queued: AtomicUsize,
    pub running: AtomicUsize,
    pub generated_tokens: AtomicU64,
    pub prompt_tokens: AtomicU64,
    /// Decode steps, guesses made and kept (drafting), of finished sequences.
    pub decode_steps: AtomicU64,
    pub drafted_tokens: AtomicU64,
    pub accepted_tokens: AtomicU64,
    pub cancelled: AtomicU64,
    /// Tokens chosen under a response format or forced tool call, and the microseconds their
    /// masks took ([`crate::chat::constrain`]).
    pub constrained_tokens: AtomicU64,
    pub constraint_micros: AtomicU64,
    /// Connections open, and those refused at the cap (`--max-connections`).
    pub connections: AtomicUsize,
    pub connections_refused: AtomicU64,
    /// Connections the server closed under its limits ([`super::limits`]), by reason.
    pub closed: super::limits::Closed,
    /// Set on SIGINT/SIGTERM: nothing new is admitted.
    pub shutting_down: AtomicBool,
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    snapshot: Mutex<Snapshot>,
}

impl Shared {
    /// Counts an answered request by endpoint and status.
    pub fn count_request(&self, endpoint: &'static str, status: u16) {
        let mut map = self.requests.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *map.entry((endpoint, status)).or_default() += 1;
    }

    pub fn set_snapshot(&self, s: Snapshot) {
        *self.snapshot.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = s;
    }

    /// Adds a finished sequence's decode steps and drafting.
    pub fn count_draft(&self, d: &crate::engine::DraftStats) {
        self.decode_steps.fetch_add(d.steps, Ordering::Relaxed);
        self.drafted_tokens.fetch_add(d.drafted, Ordering::Relaxed);
        self.accepted_tokens.fetch_add(d.accepted, Ordering::Relaxed);
    }

    pub fn shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }

    /// Admits one more request unless `limit` are already pending; false when full.
    pub fn try_admit(&self, limit: usize) -> bool {
        self.pending.fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| (p < limit).then_some(p + 1)).is_ok()
    }

    /// Whether `limit` requests are already pending (a hint: [`Shared::try_admit`] decides).
    pub fn is_full(&self, limit: usize) -> bool {
        self.pending.load(Ordering::Acquire) >= limit
    }

    /// A request admitted by [`Shared::try_admit`] is done.
    pub fn release(&self) {
        let _ = self.pending.fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| p.checked_sub(1));
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self, slots: usize, max_queue: usize) -> String {
        let snap = self.snapshot.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let requests = self.requests.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        let mut out = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (labels, v) in samples {
                let _ = writeln!(out, "{name}{labels} {v}");
            }
        };
        let one = |v: f64| vec![(String::new(), v)];
        let req: Vec<(String, f64)> = requests
            .iter()
            .map(|((endpoint, status), n)| (format!("{{endpoint=\"{endpoint}\",status=\"{status}\"}}"), *n as f64))
            .collect();
        metric("k3ring_requests_total", "counter", "HTTP requests answered, by endpoint and status.", &req);
        let load = |a: &AtomicUsize| a.load(Ordering::Relaxed) as f64;
        let load64 = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        metric("k3ring_queue_length", "gauge", "Requests waiting for a sequence slot.", &one(load(&self.queued)));
        metric(
            "k3ring_active_sequences",
            "gauge",
            "Sequences running (prefilling or decoding).",
            &one(load(&self.running)),
        );
        metric("k3ring_slots", "gauge", "Sequence slots (sequences decoded together at most).", &one(slots as f64));
        metric(
            "k3ring_max_queue",
            "gauge",
            "Requests that may wait beyond the slots (--max-queue).",
            &one(max_queue as f64),
        );
        self.render_connections(&mut metric);
        metric("k3ring_generated_tokens_total", "counter", "Tokens generated.", &one(load64(&self.generated_tokens)));
        metric("k3ring_prompt_tokens_total", "counter", "Prompt tokens admitted.", &one(load64(&self.prompt_tokens)));
        self.render_constraints(&mut metric);
        metric(
            "k3ring_decode_steps_total",
            "counter",
            "Decode steps of finished sequences, summed per sequence (a batch step of n sequences counts n; a drafted step may give a sequence several tokens).",
            &one(load64(&self.decode_steps)),
        );
        metric(
            "k3ring_draft_tokens_total",
            "counter",
            "Tokens guessed by drafting, of finished sequences.",
            &one(load64(&self.drafted_tokens)),
        );
        metric(
            "k3ring_draft_accepted_tokens_total",
            "counter",
            "Guessed tokens the model confirmed, of finished sequences.",
            &one(load64(&self.accepted_tokens)),
        );
        metric(
            "k3ring_cancelled_total",
            "counter",
            "Sequences cancelled (client gone, or shutdown).",
            &one(load64(&self.cancelled)),
        );
        metric(
            "k3ring_tokens_per_second",
            "gauge",
            "Generated tokens per second over the last 10 s, all sequences together.",
            &one(snap.tokens_per_second),
        );
        metric(
            "k3ring_bytes_read_total",
            "counter",
            "Trunk and expert bytes read from storage.",
            &one(snap.bytes_read as f64),
        );
        metric(
            "k3ring_read_bytes_per_second",
            "gauge",
            "Bytes read from storage per second over the last 10 s.",
            &one(snap.read_bytes_per_second),
        );
        if let Some(o) = snap.overlap {
            metric(
                "k3ring_io_compute_overlap_ratio",
                "gauge",
                "Share of wall time with I/O and compute both busy.",
                &one(o),
            );
        }
        if let Some(p) = snap.prefix {
            render_prefix(&mut metric, &p);
        }
        if let Some(h) = snap.expert_hit_rate {
            metric("k3ring_expert_hit_ratio", "gauge", "Expert lookups that found the expert resident.", &one(h));
        }
        out
    }

    /// Connections: open, refused at the cap, closed under the limits.
    fn render_constraints(&self, metric: &mut impl FnMut(&str, &str, &str, &[(String, f64)])) {
        let one = |v: f64| vec![(String::new(), v)];
        let load64 = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        metric(
            "k3ring_constrained_tokens_total",
            "counter",
            "Tokens generated under a response_format or a forced tool call, of finished sequences.",
            &one(load64(&self.constrained_tokens)),
        );
        metric(
            "k3ring_constraint_seconds_total",
            "counter",
            "Seconds spent computing those tokens' masks (the grammar's cost; the model's is apart).",
            &one(load64(&self.constraint_micros) / 1e6),
        );
    }

    fn render_connections(&self, metric: &mut impl FnMut(&str, &str, &str, &[(String, f64)])) {
        let one = |v: f64| vec![(String::new(), v)];
        let load = |a: &AtomicUsize| a.load(Ordering::Relaxed) as f64;
        let load64 = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        metric("k3ring_open_connections", "gauge", "HTTP connections open.", &one(load(&self.connections)));
        metric(
            "k3ring_refused_connections_total",
            "counter",
            "Connections answered 503 at the cap (--max-connections).",
            &one(load64(&self.connections_refused)),
        );
        let closed: Vec<(String, f64)> = super::limits::CloseReason::ALL
            .iter()
            .map(|r| (format!("{{reason=\"{}\"}}", r.label()), self.closed.get(*r) as f64))
            .collect();
        metric(
            "k3ring_connections_closed_total",
            "counter",
            "Connections the server closed under its limits: a head or body not whole in time (--header-timeout, --body-timeout), idle keep-alive (--idle-timeout), requests per connection (--max-requests-per-connection).",
            &closed,
        );
    }
}

/// The prefix cache's counters.
fn render_prefix(
    metric: &mut impl FnMut(&str, &str, &str, &[(String, f64)]),
    p: &crate::engine::prefix_cache::PrefixStats,
) {
    let one = |v: u64| vec![(String::new(), v as f64)];
    metric("k3ring_prefix_cache_hits_total", "counter", "Sequences started from a cached prefix.", &one(p.hits));
    metric("k3ring_prefix_cache_misses_total", "counter", "Sequences that found no cached prefix.", &one(p.misses));
    metric(
        "k3ring_prefix_cache_cached_tokens_total",
        "counter",
        "Prompt tokens taken from the prefix cache instead of prefilled.",
        &one(p.cached_tokens),
    );
    metric("k3ring_prefix_cache_stored_total", "counter", "Snapshots taken into the prefix cache.", &one(p.stored));
    metric(
        "k3ring_prefix_cache_evictions_total",
        "counter",
        "Snapshots dropped to make room (least recently used first).",
        &one(p.evictions),
    );
    metric(
        "k3ring_prefix_cache_bytes",
        "gauge",
        "Bytes the prefix cache holds (--prefix-cache-gb at most).",
        &one(p.bytes),
    );
    metric("k3ring_prefix_cache_entries", "gauge", "Snapshots the prefix cache holds.", &one(p.entries as u64));
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn admission_is_bounded_and_released() {
        let s = Shared::default();
        assert!(s.try_admit(2) && s.try_admit(2));
        assert!(!s.try_admit(2));
        s.release();
        assert!(s.try_admit(2));
        s.release();
        s.release();
        s.release();
        assert_eq!(s.pending.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn render_is_prometheus_text() {
        let s = Shared::default();
        s.count_request("completions", 200);
        s.generated_tokens.fetch_add(7, Ordering::Relaxed);
        let text = s.render(4, 8);
        assert!(text.contains("k3ring_requests_total{endpoint=\"completions\",status=\"200\"} 1\n"));
        assert!(text.contains("# TYPE k3ring_generated_tokens_total counter\nk3ring_generated_tokens_total 7\n"));
        assert!(text.contains("k3ring_slots 4\n"));
        s.closed.count(super::super::limits::CloseReason::IdleTimeout);
        let text = s.render(4, 8);
        assert!(text.contains("k3ring_connections_closed_total{reason=\"idle_timeout\"} 1\n"));
        assert!(text.contains("k3ring_connections_closed_total{reason=\"header_timeout\"} 0\n"));
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (_, v) = line.rsplit_once(' ').unwrap();
            v.parse::<f64>().unwrap();
        }
    }
}
