//! Flow arrows for the Chrome export: from the span that caused an expert read (a layer's router
//! for a demand read, the prefetcher's speculation for a guess) to the read, and from the read to
//! the expert compute that used its bytes. Nothing on the hot path records causes: they are found
//! here, at export time, from the arguments every span already carries (layer, expert, kind) and
//! the order in time, so a run without `--trace` pays nothing for them.
//!
//! Matching rules (documented in the trace's own terms, see `docs/TRACE.md`):
//! - a `demand` expert read of layer L comes from the last `router` span of layer L that started
//!   at or before the read entered the device; a `speculative` one from the last `speculation`
//!   span for layer L (its `layer` argument is the layer it predicts);
//! - an `expert` compute span of (L, E) used the last read of (L, E) that ended at or before it
//!   started and that no earlier compute used; older unused reads of (L, E) (pieces of a split
//!   guess, or a re-read) get no arrow to compute.
//!
//! The trace-event format binds at most one flow id to one event, and one router span causes many
//! reads: each caused read therefore gets a zero-length `route` slice inside its cause span that
//! the arrow starts from. Every flow uses the read's async id as its `bind_id` (flow v2:
//! `flow_out` on the start, both on the read, `flow_in` on the compute).

use std::collections::HashMap;

use super::kind::{ComputeOp, SpanKind};
use super::recorder::{Event, EventKind};

/// A zero-length slice inside a cause span, where a flow starts.
#[derive(Clone, Copy, Debug)]
pub(super) struct Marker {
    pub(super) ts_us: f64,
    /// Index in the event list of the cause span (its track).
    pub(super) cause: usize,
    /// Index in the event list of the read it points to.
    pub(super) read: usize,
    pub(super) bind_id: u64,
}

/// Flow ends per event index.
#[derive(Debug, Default)]
pub(super) struct Flows {
    /// Read event index -> (has an incoming arrow, has an outgoing arrow).
    pub(super) reads: HashMap<usize, (bool, bool)>,
    /// Compute event index -> the bind id of the read it used.
    pub(super) computes: HashMap<usize, u64>,
    pub(super) markers: Vec<Marker>,
}

fn span_of(ev: &Event) -> Option<(SpanKind, &super::args::SpanArgs, u64)> {
    match ev.kind {
        EventKind::Span { kind, ref args, async_id, .. } => Some((kind, args, async_id)),
        EventKind::Counter { .. } => None,
    }
}

/// Finds the flows among `events` (any order).
pub(super) fn link(events: &[Event]) -> Flows {
    // Cause spans per (op, layer), sorted by start.
    let mut causes: HashMap<(ComputeOp, u32), Vec<usize>> = HashMap::new();
    // Reads per (layer, expert), and compute spans per (layer, expert).
    let mut reads: HashMap<(u32, u32), Vec<usize>> = HashMap::new();
    let mut computes: Vec<(usize, (u32, u32))> = Vec::new();
    for (i, ev) in events.iter().enumerate() {
        let Some((kind, args, async_id)) = span_of(ev) else { continue };
        match (kind, args.layer, args.expert) {
            (SpanKind::Compute(op @ (ComputeOp::Router | ComputeOp::Speculation)), Some(l), _) => {
                causes.entry((op, l)).or_default().push(i);
            }
            (SpanKind::Compute(ComputeOp::Expert), Some(l), Some(e)) => computes.push((i, (l, e))),
            (SpanKind::Io(_), Some(l), Some(e)) if async_id != 0 => reads.entry((l, e)).or_default().push(i),
            _ => {}
        }
    }
    let by_start = |a: &usize, b: &usize| events[*a].ts_us.total_cmp(&events[*b].ts_us);
    causes.values_mut().for_each(|v| v.sort_by(by_start));
    let mut flows = Flows::default();
    for list in reads.values() {
        for &r in list {
            let Some((_, args, bind_id)) = span_of(&events[r]) else { continue };
            let op = match args.kind {
                Some("demand") => ComputeOp::Router,
                Some("speculative") => ComputeOp::Speculation,
                _ => continue,
            };
            let Some(layer) = args.layer else { continue };
            let Some(list) = causes.get(&(op, layer)) else { continue };
            let read_ts = events[r].ts_us;
            let n = list.partition_point(|&c| events[c].ts_us <= read_ts);
            let Some(&cause) = n.checked_sub(1).and_then(|k| list.get(k)) else { continue };
            let c = &events[cause];
            // Mid-span nests the marker in its cause for every viewer; it must not come after the
            // read it points to.
            let ts_us = (c.ts_us + c.dur_us / 2.0).min(read_ts).max(c.ts_us);
            flows.markers.push(Marker { ts_us, cause, read: r, bind_id });
            flows.reads.entry(r).or_default().0 = true;
        }
    }
    computes.sort_by(|a, b| by_start(&a.0, &b.0));
    let end = |i: usize| events[i].ts_us + events[i].dur_us;
    let mut by_end: HashMap<(u32, u32), (Vec<usize>, usize)> = reads
        .into_iter()
        .map(|(k, mut v)| {
            v.sort_by(|a, b| end(*a).total_cmp(&end(*b)));
            (k, (v, 0))
        })
        .collect();
    for (c, key) in computes {
        let Some((list, cursor)) = by_end.get_mut(&key) else { continue };
        let start = events[c].ts_us;
        let ready = *cursor + list[*cursor..].partition_point(|&r| end(r) <= start);
        if ready == *cursor {
            continue;
        }
        let used = list[ready - 1];
        *cursor = ready;
        let Some((_, _, bind_id)) = span_of(&events[used]) else { continue };
        flows.reads.entry(used).or_default().1 = true;
        flows.computes.insert(c, bind_id);
    }
    flows
}
