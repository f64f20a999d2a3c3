//! Chrome trace-event JSON: [`Tracer::write_chrome_json`] writes every kept event, with one
//! track per (thread, stage) named `"<thread>/<stage>"`, the stage as each span's `cat` and its
//! [`SpanArgs`] as `args`. Perfetto and `chrome://tracing` open the file. Runs on the caller's
//! thread once, at the end of a run; it copies and sorts the events, so it allocates about as
//! much as they hold.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::path::PathBuf;

use serde::Serialize;

use super::args::SpanArgs;
use super::flows::{self, Flows};
use super::kind::{SpanKind, Stage};
use super::recorder::{Event, EventKind};
use super::Tracer;
use crate::exit::{Classify, ExitCode};
use crate::files::{Output, OutputError};

/// Errors from writing a trace file.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error(
        "cannot write trace {}: this tracer keeps no events (it was created with detail off); \
         pass --trace FILE at startup so events are kept",
        path.display()
    )]
    DetailOff { path: PathBuf },
    #[error("cannot write trace: {0}")]
    Write(#[from] OutputError),
}

impl Classify for TraceError {
    fn exit_code(&self) -> ExitCode {
        match self {
            // The CLI keeps events whenever it will write them, so reaching this from the CLI is a
            // bug; the message still tells a library caller what to change.
            TraceError::DetailOff { .. } => ExitCode::Internal,
            TraceError::Write(e) => e.exit_code(),
        }
    }
}

const TRACE_PID: u32 = 1;

#[derive(Serialize)]
struct ChromeCounter<'a> {
    ph: &'static str,
    name: &'a str,
    ts: f64,
    pid: u32,
    args: CounterArgs,
}

#[derive(Serialize)]
struct CounterArgs {
    value: f64,
}

#[derive(Serialize)]
struct ChromeMeta<A: Serialize> {
    ph: &'static str,
    name: &'static str,
    pid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    tid: Option<u32>,
    args: A,
}

#[derive(Serialize)]
struct NameArg<'a> {
    name: &'a str,
}

#[derive(Serialize)]
struct SortArg {
    sort_index: u32,
}

impl Tracer {
    /// See [`Tracer::write_chrome_json`].
    pub(super) fn write_chrome_file(&self, out: &Output) -> Result<(), TraceError> {
        if !self.keep_events {
            return Err(TraceError::DetailOff { path: out.path().to_path_buf() });
        }
        let mut w = out.create()?;
        self.write_chrome_events(&mut w).map_err(|e| out.io("writing", e))?;
        Ok(w.finish()?)
    }

    /// Writes `{"traceEvents":[metadata..., events sorted by ts...],"displayTimeUnit":"ms"}`.
    fn write_chrome_events(&self, out: &mut dyn Write) -> io::Result<()> {
        let (events, names) = self.events_and_thread_names();
        let tids = track_tids(&events);
        let flows = flows::link(&events);
        let mut records: Vec<Record> = Vec::with_capacity(events.len() + flows.markers.len());
        for (i, ev) in events.iter().enumerate() {
            match ev.kind {
                EventKind::Span { async_id, .. } if async_id != 0 => {
                    records.push(Record { ts_us: ev.ts_us, rank: 0, dur_us: ev.dur_us, what: What::Begin(i) });
                    records.push(Record { ts_us: ev.ts_us + ev.dur_us, rank: 1, dur_us: 0.0, what: What::End(i) });
                }
                _ => records.push(Record { ts_us: ev.ts_us, rank: 0, dur_us: ev.dur_us, what: What::Event(i) }),
            }
        }
        for (k, m) in flows.markers.iter().enumerate() {
            records.push(Record { ts_us: m.ts_us, rank: 0, dur_us: 0.0, what: What::Marker(k) });
        }
        // Parents before children at equal start, so viewers nest them; an async slice's end
        // after its begin even when it lasted no time.
        records
            .sort_by(|a, b| a.ts_us.total_cmp(&b.ts_us).then(a.rank.cmp(&b.rank)).then(b.dur_us.total_cmp(&a.dur_us)));
        out.write_all(b"{\"traceEvents\":[")?;
        write_metadata(out, &tids, &names)?;
        let ctx = Ctx { events: &events, tids: &tids, flows: &flows };
        for r in &records {
            out.write_all(b",\n")?;
            ctx.write(out, r.what)?;
        }
        out.write_all(b"],\"displayTimeUnit\":\"ms\"}\n")
    }
}

/// One output event, placed in time.
struct Record {
    ts_us: f64,
    /// 0 for begins and slices, 1 for async ends.
    rank: u8,
    dur_us: f64,
    what: What,
}

#[derive(Clone, Copy)]
enum What {
    /// A thread-track slice or a counter (event index).
    Event(usize),
    /// An async slice's begin and end (event index).
    Begin(usize),
    End(usize),
    /// A flow start marker (index in `Flows::markers`).
    Marker(usize),
}

#[derive(Serialize)]
struct AsyncEvent<'a> {
    ph: &'static str,
    name: &'a str,
    cat: &'static str,
    id: String,
    ts: f64,
    pid: u32,
    tid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    args: Option<&'a SpanArgs>,
    #[serde(flatten)]
    flow: FlowFields,
}

/// Flow v2 fields: the arrow's id and which ends of it this slice is.
#[derive(Serialize, Default)]
struct FlowFields {
    #[serde(skip_serializing_if = "Option::is_none")]
    bind_id: Option<u64>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    flow_in: bool,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    flow_out: bool,
}

#[derive(Serialize)]
struct ChromeSpan<'a> {
    ph: &'static str,
    name: &'a str,
    cat: &'static str,
    ts: f64,
    dur: f64,
    pid: u32,
    tid: u32,
    args: &'a SpanArgs,
    #[serde(flatten)]
    flow: FlowFields,
}

struct Ctx<'a> {
    events: &'a [Event],
    tids: &'a BTreeMap<(usize, u32), u32>,
    flows: &'a Flows,
}

impl Ctx<'_> {
    fn tid(&self, kind: SpanKind, thread_index: u32) -> u32 {
        self.tids.get(&(kind.stage().index(), thread_index)).copied().unwrap_or(0)
    }

    fn write(&self, out: &mut dyn Write, what: What) -> io::Result<()> {
        match what {
            What::Event(i) => self.write_event(out, i),
            What::Begin(i) | What::End(i) => self.write_async(out, i, matches!(what, What::Begin(_))),
            What::Marker(k) => {
                let m = self.flows.markers[k];
                let EventKind::Span { kind, thread_index, .. } = self.events[m.cause].kind else {
                    return Ok(());
                };
                // The read's own arguments: which expert of which layer, why, how many bytes.
                let read_args = match self.events[m.read].kind {
                    EventKind::Span { args, .. } => args,
                    EventKind::Counter { .. } => SpanArgs::new(),
                };
                let span = ChromeSpan {
                    ph: "X",
                    name: "route",
                    cat: kind.stage().as_str(),
                    ts: m.ts_us,
                    dur: 0.0,
                    pid: TRACE_PID,
                    tid: self.tid(kind, thread_index),
                    args: &read_args,
                    flow: FlowFields { bind_id: Some(m.bind_id), flow_in: false, flow_out: true },
                };
                serde_json::to_writer(out, &span).map_err(io::Error::from)
            }
        }
    }

    fn write_event(&self, out: &mut dyn Write, i: usize) -> io::Result<()> {
        let ev = &self.events[i];
        match ev.kind {
            EventKind::Span { kind, thread_index, ref args, .. } => {
                let flow = match self.flows.computes.get(&i) {
                    Some(&id) => FlowFields { bind_id: Some(id), flow_in: true, flow_out: false },
                    None => FlowFields::default(),
                };
                let span = ChromeSpan {
                    ph: "X",
                    name: kind.name(),
                    cat: kind.stage().as_str(),
                    ts: ev.ts_us,
                    dur: ev.dur_us,
                    pid: TRACE_PID,
                    tid: self.tid(kind, thread_index),
                    args,
                    flow,
                };
                serde_json::to_writer(out, &span)?;
            }
            EventKind::Counter { name, value } => {
                let counter =
                    ChromeCounter { ph: "C", name, ts: ev.ts_us, pid: TRACE_PID, args: CounterArgs { value } };
                serde_json::to_writer(out, &counter)?;
            }
        }
        Ok(())
    }

    fn write_async(&self, out: &mut dyn Write, i: usize, begin: bool) -> io::Result<()> {
        let ev = &self.events[i];
        let EventKind::Span { kind, thread_index, ref args, async_id } = ev.kind else {
            return Ok(());
        };
        // Named by kind first, so a viewer groups the reads of one kind on tracks of one name.
        let name = match args.kind {
            Some(k) => format!("{k} {}", kind.name()),
            None => kind.name().to_owned(),
        };
        let flow = match (begin, self.flows.reads.get(&i)) {
            (true, Some(&(flow_in, flow_out))) => FlowFields { bind_id: Some(async_id), flow_in, flow_out },
            _ => FlowFields::default(),
        };
        let event = AsyncEvent {
            ph: if begin { "b" } else { "e" },
            name: &name,
            cat: kind.stage().as_str(),
            id: format!("{async_id:#x}"),
            ts: if begin { ev.ts_us } else { ev.ts_us + ev.dur_us },
            pid: TRACE_PID,
            tid: self.tid(kind, thread_index),
            args: begin.then_some(args),
            flow,
        };
        serde_json::to_writer(out, &event).map_err(io::Error::from)
    }
}

/// Chrome tid per (stage index, thread index) track, numbered from 1 in that order so viewers
/// group the tracks by stage.
fn track_tids(events: &[Event]) -> BTreeMap<(usize, u32), u32> {
    let mut tids: BTreeMap<(usize, u32), u32> = BTreeMap::new();
    for ev in events {
        if let EventKind::Span { kind, thread_index, .. } = ev.kind {
            tids.entry((kind.stage().index(), thread_index)).or_insert(0);
        }
    }
    for (n, tid) in tids.values_mut().enumerate() {
        *tid = n as u32 + 1;
    }
    tids
}

/// The process name, then a name (`"<thread>/<stage>"`) and sort index for every track.
fn write_metadata(out: &mut dyn Write, tids: &BTreeMap<(usize, u32), u32>, names: &[String]) -> io::Result<()> {
    let args = NameArg { name: "k3ring" };
    let process = ChromeMeta { ph: "M", name: "process_name", pid: TRACE_PID, tid: None, args };
    serde_json::to_writer(&mut *out, &process)?;
    for (&(stage_index, thread_index), &tid) in tids {
        let thread = names.get(thread_index as usize).map_or("other-threads", String::as_str);
        let track = format!("{thread}/{}", Stage::ALL[stage_index].as_str());
        let args = NameArg { name: &track };
        let name = ChromeMeta { ph: "M", name: "thread_name", pid: TRACE_PID, tid: Some(tid), args };
        out.write_all(b",\n")?;
        serde_json::to_writer(&mut *out, &name)?;
        let args = SortArg { sort_index: tid };
        let sort = ChromeMeta { ph: "M", name: "thread_sort_index", pid: TRACE_PID, tid: Some(tid), args };
        out.write_all(b",\n")?;
        serde_json::to_writer(&mut *out, &sort)?;
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::super::testing::write_and_parse;
    use super::super::{ComputeOp, SpanKind};
    use super::*;
    use std::collections::HashMap;

    fn record_named_threads(t: &Tracer) {
        std::thread::scope(|s| {
            for name in ["io-0", "compute-0", "compute-1", "sched"] {
                std::thread::Builder::new()
                    .name(name.to_string())
                    .spawn_scoped(s, move || {
                        for i in 0..50u32 {
                            let kind = match name {
                                "io-0" => SpanKind::Io("work"),
                                "sched" => SpanKind::Scheduler("work"),
                                _ => SpanKind::Compute(ComputeOp::Expert),
                            };
                            let args = SpanArgs::new().layer(i).expert(i * 3).bytes(4096).kind("speculative");
                            let _g = t.span_args(kind, args);
                            if name == "sched" {
                                // A second stage on one thread gets its own track.
                                let _w = t.span(SpanKind::Io("submit"));
                            }
                            t.counter("bytes_in_flight", f64::from(i));
                        }
                    })
                    .unwrap();
            }
        });
    }

    fn check_event_fields(ev: &serde_json::Value) {
        let ph = ev["ph"].as_str().unwrap();
        assert!(ev["name"].is_string(), "{ev}");
        assert_eq!(ev["pid"], 1, "{ev}");
        match ph {
            "X" => {
                assert!(ev["ts"].is_f64() || ev["ts"].is_u64(), "{ev}");
                assert!(ev["dur"].as_f64().unwrap() >= 0.0, "{ev}");
                assert!(ev["tid"].as_u64().unwrap() >= 1, "{ev}");
                assert!(["io", "compute", "scheduler"].contains(&ev["cat"].as_str().unwrap()), "{ev}");
                assert!(ev["args"].is_object(), "{ev}");
            }
            "C" => {
                assert!(ev["ts"].as_f64().is_some(), "{ev}");
                assert!(ev["args"]["value"].as_f64().is_some(), "{ev}");
            }
            "M" => {
                let name = ev["name"].as_str().unwrap();
                assert!(["process_name", "thread_name", "thread_sort_index"].contains(&name), "{ev}");
                if name != "process_name" {
                    assert!(ev["tid"].as_u64().is_some(), "{ev}");
                }
            }
            other => panic!("unexpected ph {other}"),
        }
    }

    #[test]
    fn trace_chrome_json_parses_with_required_fields() {
        let t = Tracer::new(true);
        record_named_threads(&t);
        let json = write_and_parse(&t);
        assert_eq!(json["displayTimeUnit"], "ms");
        let events = json["traceEvents"].as_array().unwrap();
        // 4 threads x 50 spans, plus 50 Io submits, 200 counters, 1 + 2 x 5 metadata events.
        assert_eq!(events.len(), 200 + 50 + 200 + 11);
        events.iter().for_each(check_event_fields);
        let timed: Vec<f64> = events.iter().filter(|e| e["ph"] != "M").map(|e| e["ts"].as_f64().unwrap()).collect();
        assert!(timed.windows(2).all(|w| w[0] <= w[1]), "events not sorted by ts");
        let first_timed = events.iter().position(|e| e["ph"] != "M").unwrap();
        assert!(events[first_timed..].iter().all(|e| e["ph"] != "M"), "metadata after events");
        let span = events.iter().find(|e| e["ph"] == "X" && e["cat"] == "io" && e["name"] == "work").unwrap();
        assert_eq!(span["args"]["kind"], "speculative");
        assert_eq!(span["args"]["bytes"], 4096);
        assert!(span["args"].get("slot").is_none());
    }

    #[test]
    fn trace_chrome_tids_match_thread_names() {
        let t = Tracer::new(true);
        record_named_threads(&t);
        let json = write_and_parse(&t);
        let events = json["traceEvents"].as_array().unwrap();
        let mut track_names: HashMap<u64, String> = HashMap::new();
        for ev in events.iter().filter(|e| e["ph"] == "M" && e["name"] == "thread_name") {
            let old = track_names.insert(ev["tid"].as_u64().unwrap(), ev["args"]["name"].as_str().unwrap().to_string());
            assert!(old.is_none(), "tid named twice");
        }
        let mut names: Vec<&str> = track_names.values().map(String::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, ["compute-0/compute", "compute-1/compute", "io-0/io", "sched/io", "sched/scheduler"]);
        for ev in events.iter().filter(|e| e["ph"] == "X") {
            let track = &track_names[&ev["tid"].as_u64().unwrap()];
            let cat = ev["cat"].as_str().unwrap();
            assert!(track.ends_with(&format!("/{cat}")), "{track} vs {cat}");
            let expected_stage = match track.split('/').next().unwrap() {
                "io-0" => "io",
                "sched" if ev["name"] == "submit" => "io",
                "sched" => "scheduler",
                _ => "compute",
            };
            assert_eq!(cat, expected_stage, "{ev}");
        }
    }

    #[test]
    fn trace_write_without_detail_is_refused() {
        let t = Tracer::new(false);
        t.complete(SpanKind::Io("read"), 0.0, 1.0, SpanArgs::new());
        let out = Output::resolve("--trace", std::path::Path::new("/dev/null"), false).unwrap();
        let err = t.write_chrome_json(&out).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot write trace /dev/null: this tracer keeps no events (it was created \
             with detail off); pass --trace FILE at startup so events are kept"
        );
        assert_eq!(err.exit_code(), ExitCode::Internal);
        // With detail on, the same output takes the trace.
        let t = Tracer::new(true);
        t.complete(SpanKind::Io("read"), 0.0, 1.0, SpanArgs::new());
        let full = Output::resolve("--trace", std::path::Path::new("/dev/null"), false).unwrap();
        t.write_chrome_json(&full).unwrap();
    }
}
