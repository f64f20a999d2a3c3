//! Chrome trace-event JSON: [`Tracer::write_chrome_json`] writes every kept event, with one
//! track per (thread, stage) named `"<thread>/<stage>"`, the stage as each span's `cat` and its
//! [`SpanArgs`] as `args`. Perfetto and `chrome://tracing` open the file. Runs on the caller's
//! thread once, at the end of a run; it copies and sorts the events, so it allocates about as
//! much as they hold.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

use serde::Serialize;

use super::args::SpanArgs;
use super::kind::Stage;
use super::recorder::{Event, EventKind};
use super::Tracer;
use crate::exit::{Classify, ExitCode};

/// Errors from writing a trace file.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error(
        "cannot write trace {}: this tracer keeps no events (it was created with detail off); \
         pass --trace FILE at startup so events are kept",
        path.display()
    )]
    DetailOff { path: PathBuf },
    #[error("cannot write trace {}: check that its directory exists and is writable", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl Classify for TraceError {
    fn exit_code(&self) -> ExitCode {
        match self {
            // The CLI keeps events whenever it will write them, so reaching this from the CLI is a
            // bug; the message still tells a library caller what to change.
            TraceError::DetailOff { .. } => ExitCode::Internal,
            TraceError::Write { .. } => ExitCode::Io,
        }
    }
}

const TRACE_PID: u32 = 1;

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
}

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
    pub(super) fn write_chrome_file(&self, path: &Path) -> Result<(), TraceError> {
        if !self.keep_events {
            return Err(TraceError::DetailOff { path: path.to_path_buf() });
        }
        let err = |source| TraceError::Write { path: path.to_path_buf(), source };
        let file = File::create(path).map_err(err)?;
        let mut out = BufWriter::new(file);
        self.write_chrome_events(&mut out).map_err(err)?;
        out.flush().map_err(err)
    }

    /// Writes `{"traceEvents":[metadata..., events sorted by ts...],"displayTimeUnit":"ms"}`.
    fn write_chrome_events(&self, out: &mut dyn Write) -> io::Result<()> {
        let (mut events, names) = self.events_and_thread_names();
        // Parents before children at equal start, so viewers nest them.
        events.sort_by(|a, b| a.ts_us.total_cmp(&b.ts_us).then(b.dur_us.total_cmp(&a.dur_us)));
        let tids = track_tids(&events);
        out.write_all(b"{\"traceEvents\":[")?;
        write_metadata(out, &tids, &names)?;
        for ev in &events {
            out.write_all(b",\n")?;
            write_event(out, ev, &tids)?;
        }
        out.write_all(b"],\"displayTimeUnit\":\"ms\"}\n")
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

fn write_event(out: &mut dyn Write, ev: &Event, tids: &BTreeMap<(usize, u32), u32>) -> io::Result<()> {
    match ev.kind {
        EventKind::Span { kind, thread_index, ref args } => {
            let stage = kind.stage();
            let tid = tids.get(&(stage.index(), thread_index)).copied().unwrap_or(0);
            let span = ChromeSpan {
                ph: "X",
                name: kind.name(),
                cat: stage.as_str(),
                ts: ev.ts_us,
                dur: ev.dur_us,
                pid: TRACE_PID,
                tid,
                args,
            };
            serde_json::to_writer(out, &span)?;
        }
        EventKind::Counter { name, value } => {
            let counter = ChromeCounter { ph: "C", name, ts: ev.ts_us, pid: TRACE_PID, args: CounterArgs { value } };
            serde_json::to_writer(out, &counter)?;
        }
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
        let err = t.write_chrome_json(Path::new("/nonexistent/trace.json")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot write trace /nonexistent/trace.json: this tracer keeps no events (it was created \
             with detail off); pass --trace FILE at startup so events are kept"
        );
        assert_eq!(err.exit_code(), ExitCode::Internal);
        let t = Tracer::new(true);
        let err = t.write_chrome_json(Path::new("/nonexistent/trace.json")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "cannot write trace /nonexistent/trace.json: check that its directory exists and is writable"
        );
        assert_eq!(err.exit_code(), ExitCode::Io);
    }
}
