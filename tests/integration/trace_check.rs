//! A strict checker of the Chrome trace-event rules that viewers rely on, run on real traces of
//! the tiny model (issue 16): `X` and `B`/`E` slices nest per thread, async `b`/`e` ids match,
//! flow ids (v2 `bind_id`, v1 `s`/`t`/`f`) are bound to slices and run from a start to an end.
//! Perfetto's own trace processor is not used: it cannot be installed without a download.

use std::collections::{BTreeMap, HashMap};

use serde_json::Value;

use crate::checkpoint_tests::k3ring;
use crate::common::*;

/// Slack for `ts + dur` rounding, in µs (the trace is written in f64 µs).
const EPS_US: f64 = 1e-3;

/// What a valid trace holds.
#[derive(Debug, Default)]
pub struct TraceSummary {
    pub slices: usize,
    /// Async slices per name.
    pub async_slices: BTreeMap<String, usize>,
    /// Complete flows (v2 chains and v1 arrows) and how many of them have a middle step.
    pub flows: usize,
    pub flows_with_step: usize,
}

fn num(e: &Value, key: &str) -> Result<f64, String> {
    e[key].as_f64().ok_or_else(|| format!("event without a numeric {key}: {e}"))
}

fn id_of(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// A slice on a thread track: (start, end, name).
type Slice = (f64, f64, String);
/// Slices per (pid, tid).
type Threads = HashMap<(u64, u64), Vec<Slice>>;
/// A v1 flow event: (ts, phase, pid, tid, binds to the enclosing slice).
type V1Step = (f64, char, u64, u64, bool);
/// v1 flow events per (cat, name, id).
type V1Flows = HashMap<(String, String, String), Vec<V1Step>>;
/// v2 flow ends per bind_id: (ts, flow_in, flow_out).
type V2Flows = HashMap<u64, Vec<(f64, bool, bool)>>;

/// Checks `trace` against the trace-event rules; the error names the first broken rule.
pub fn check_trace(trace: &Value) -> Result<TraceSummary, String> {
    let events = trace["traceEvents"].as_array().ok_or("no traceEvents array")?;
    let mut summary = TraceSummary::default();
    let mut threads: Threads = HashMap::new();
    let mut begin_end: HashMap<(u64, u64), Vec<(f64, String)>> = HashMap::new();
    let mut open_async: HashMap<(u64, String, String, String), f64> = HashMap::new();
    let mut v2: V2Flows = HashMap::new();
    let mut v1: V1Flows = HashMap::new();
    let mut sorted: Vec<&Value> = events.iter().filter(|e| e["ph"] != "M").collect();
    // Begins before ends at one time, so a zero-length async slice opens before it closes.
    let rank = |e: &Value| u8::from(e["ph"] == "e" || e["ph"] == "E");
    sorted.sort_by(|a, b| {
        let (ta, tb) = (a["ts"].as_f64().unwrap_or(0.0), b["ts"].as_f64().unwrap_or(0.0));
        ta.total_cmp(&tb).then(rank(a).cmp(&rank(b)))
    });
    for e in events.iter().filter(|e| e["ph"] == "M") {
        let name = e["name"].as_str().ok_or_else(|| format!("metadata without a name: {e}"))?;
        if name != "process_name" && !e["tid"].is_u64() {
            return Err(format!("thread metadata without a tid: {e}"));
        }
    }
    for e in sorted {
        let ph = e["ph"].as_str().ok_or_else(|| format!("event without ph: {e}"))?;
        let pid = e["pid"].as_u64().ok_or_else(|| format!("event without a pid: {e}"))?;
        let tid = e["tid"].as_u64();
        let ts = num(e, "ts")?;
        let name = e["name"].as_str().unwrap_or("").to_owned();
        let cat = e["cat"].as_str().unwrap_or("").to_owned();
        let thread = || tid.map(|t| (pid, t)).ok_or_else(|| format!("{ph} event without a tid: {e}"));
        match ph {
            "X" => {
                let dur = num(e, "dur")?;
                if dur < 0.0 {
                    return Err(format!("negative dur: {e}"));
                }
                threads.entry(thread()?).or_default().push((ts, ts + dur, name));
                summary.slices += 1;
            }
            "B" => {
                begin_end.entry(thread()?).or_default().push((ts, name.clone()));
                threads.entry(thread()?).or_default().push((ts, f64::NAN, name));
            }
            "E" => {
                let stack = begin_end.entry(thread()?).or_default();
                let (start, _) = stack.pop().ok_or_else(|| format!("E without a B on its thread: {e}"))?;
                let list = threads.entry(thread()?).or_default();
                let open = list.iter_mut().rev().find(|s| s.0 == start && s.1.is_nan());
                open.ok_or("internal: B slice lost")?.1 = ts;
                summary.slices += 1;
            }
            "b" | "e" => {
                let id = id_of(&e["id"])
                    .or_else(|| e["id2"]["local"].as_str().map(str::to_owned))
                    .ok_or_else(|| format!("async event without an id: {e}"))?;
                let key = (pid, cat, id, name.clone());
                if ph == "b" {
                    if open_async.insert(key, ts).is_some() {
                        return Err(format!("async id begun twice before its end: {e}"));
                    }
                } else {
                    let start = open_async.remove(&key).ok_or_else(|| format!("async end without a begin: {e}"))?;
                    if ts + EPS_US < start {
                        return Err(format!("async slice ends before it begins: {e}"));
                    }
                    *summary.async_slices.entry(name).or_default() += 1;
                }
            }
            "s" | "t" | "f" => {
                let (pid, tid) = thread()?;
                let id = id_of(&e["id"]).ok_or_else(|| format!("flow event without an id: {e}"))?;
                let enclosing = ph != "f" || e["bp"] == "e";
                let phase = ph.chars().next().unwrap_or('s');
                v1.entry((cat, name, id)).or_default().push((ts, phase, pid, tid, enclosing));
            }
            "C" => {
                if !e["args"].as_object().is_some_and(|a| !a.is_empty() && a.values().all(Value::is_number)) {
                    return Err(format!("counter without numeric args: {e}"));
                }
            }
            "i" | "I" | "n" => {}
            other => return Err(format!("unknown phase {other:?}: {e}")),
        }
        record_bind(e, ph, ts, &mut v2)?;
    }
    if let Some(((_, cat, id, name), _)) = open_async.iter().next() {
        return Err(format!("async slice {name:?} (cat {cat:?}, id {id}) never ends"));
    }
    if let Some((thread, _)) = begin_end.iter().find(|(_, s)| !s.is_empty()) {
        return Err(format!("B without an E on thread {thread:?}"));
    }
    check_nesting(&mut threads)?;
    check_v2(v2, &mut summary)?;
    check_v1(v1, &threads, &mut summary)?;
    Ok(summary)
}

/// A v2 flow end on `e`, if it has a `bind_id`: only slice events bind one.
fn record_bind(e: &Value, ph: &str, ts: f64, v2: &mut V2Flows) -> Result<(), String> {
    let Some(bind) = e.get("bind_id") else { return Ok(()) };
    if !matches!(ph, "X" | "B" | "b") {
        return Err(format!("bind_id on a {ph} event, which binds to no slice: {e}"));
    }
    let bind = bind.as_u64().ok_or_else(|| format!("bind_id not a number: {e}"))?;
    let (fin, fout) = (e["flow_in"] == true, e["flow_out"] == true);
    if !fin && !fout {
        return Err(format!("bind_id without flow_in or flow_out: {e}"));
    }
    v2.entry(bind).or_default().push((ts, fin, fout));
    Ok(())
}

/// `X` and `B`/`E` slices of one thread either nest or follow each other.
fn check_nesting(threads: &mut Threads) -> Result<(), String> {
    for ((pid, tid), slices) in threads.iter_mut() {
        slices.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.1.total_cmp(&a.1)));
        let mut stack: Vec<&Slice> = Vec::new();
        for s in slices.iter() {
            while stack.last().is_some_and(|p| p.1 <= s.0 + EPS_US) {
                stack.pop();
            }
            if let Some(p) = stack.last() {
                if s.1 > p.1 + EPS_US {
                    return Err(format!(
                        "slices overlap without nesting on pid {pid} tid {tid}: {:?} [{}, {}] and {:?} [{}, {}]",
                        p.2, p.0, p.1, s.2, s.0, s.1
                    ));
                }
            }
            stack.push(s);
        }
    }
    Ok(())
}

/// Each v2 flow runs from one `flow_out` through steps (both) to one `flow_in`.
fn check_v2(v2: V2Flows, summary: &mut TraceSummary) -> Result<(), String> {
    for (id, mut ends) in v2 {
        ends.sort_by(|a, b| a.0.total_cmp(&b.0).then(b.2.cmp(&a.2)));
        let n = ends.len();
        let ok = n >= 2
            && !ends[0].1
            && ends[0].2
            && ends[n - 1].1
            && !ends[n - 1].2
            && ends[1..n - 1].iter().all(|&(_, i, o)| i && o);
        if !ok {
            return Err(format!(
                "flow bind_id {id} does not run from one flow_out through steps to one flow_in: {ends:?}"
            ));
        }
        summary.flows += 1;
        summary.flows_with_step += usize::from(n > 2);
    }
    Ok(())
}

/// Each v1 flow is `s`, `t`..., `f`, every event bound to a slice of its thread.
fn check_v1(v1: V1Flows, threads: &Threads, summary: &mut TraceSummary) -> Result<(), String> {
    for ((cat, name, id), mut steps) in v1 {
        steps.sort_by(|a, b| a.0.total_cmp(&b.0));
        let phases: String = steps.iter().map(|s| s.1).collect();
        if !(phases.starts_with('s') && phases.ends_with('f') && phases[1..phases.len() - 1].chars().all(|c| c == 't'))
        {
            return Err(format!("flow {cat}/{name}/{id} is not s, t..., f: {phases}"));
        }
        for &(ts, phase, pid, tid, enclosing) in &steps {
            let slices = threads.get(&(pid, tid)).map(Vec::as_slice).unwrap_or(&[]);
            let bound = if enclosing {
                slices.iter().any(|s| s.0 <= ts + EPS_US && ts <= s.1 + EPS_US)
            } else {
                slices.iter().any(|s| s.0 + EPS_US >= ts)
            };
            if !bound {
                return Err(format!("flow {cat}/{name}/{id}: its {phase} at {ts} is bound to no slice on tid {tid}"));
            }
        }
        summary.flows += 1;
        summary.flows_with_step += usize::from(steps.len() > 2);
    }
    Ok(())
}

fn trace_of(events: Value) -> Value {
    serde_json::json!({ "traceEvents": events })
}

#[test]
fn trace_checker_rejects_what_viewers_misdraw() {
    use serde_json::json;
    let x = |ts: f64, dur: f64, tid: u64| json!({"ph":"X","name":"s","ts":ts,"dur":dur,"pid":1,"tid":tid});
    // Nested and disjoint slices pass; on different threads anything goes.
    let good = trace_of(json!([x(0.0, 10.0, 1), x(2.0, 3.0, 1), x(10.0, 1.0, 1), x(5.0, 20.0, 2)]));
    assert_eq!(check_trace(&good).unwrap().slices, 4);
    // Two reads in flight at once on one thread as X slices: the bug of issue 16.
    let err = check_trace(&trace_of(json!([x(0.0, 10.0, 1), x(5.0, 10.0, 1)]))).unwrap_err();
    assert!(err.contains("overlap without nesting"), "{err}");
    let b = |ph: &str, ts: f64, id: &str| json!({"ph":ph,"name":"read","cat":"io","id":id,"ts":ts,"pid":1,"tid":1});
    let ok =
        check_trace(&trace_of(json!([b("b", 0.0, "0x1"), b("b", 1.0, "0x2"), b("e", 5.0, "0x1"), b("e", 6.0, "0x2")])));
    assert_eq!(ok.unwrap().async_slices["read"], 2);
    let err = check_trace(&trace_of(json!([b("b", 0.0, "0x1")]))).unwrap_err();
    assert!(err.contains("never ends"), "{err}");
    let err = check_trace(&trace_of(json!([b("e", 0.0, "0x1")]))).unwrap_err();
    assert!(err.contains("without a begin"), "{err}");
    let err = check_trace(&trace_of(json!([b("b", 0.0, "0x1"), b("b", 1.0, "0x1"), b("e", 2.0, "0x1")]))).unwrap_err();
    assert!(err.contains("begun twice"), "{err}");
    // Flow v2: out, step, in.
    let mut start = x(0.0, 1.0, 1);
    start["bind_id"] = json!(7);
    start["flow_out"] = json!(true);
    let mut step = b("b", 2.0, "0x7");
    step["bind_id"] = json!(7);
    step["flow_in"] = json!(true);
    step["flow_out"] = json!(true);
    let mut end = x(4.0, 1.0, 2);
    end["bind_id"] = json!(7);
    end["flow_in"] = json!(true);
    let s = check_trace(&trace_of(json!([start, step, b("e", 3.0, "0x7"), end]))).unwrap();
    assert_eq!((s.flows, s.flows_with_step), (1, 1));
    let err = check_trace(&trace_of(json!([start, step.clone(), b("e", 3.0, "0x7")]))).unwrap_err();
    assert!(err.contains("flow bind_id 7"), "{err}");
    let mut counter_bound = json!({"ph":"C","name":"c","ts":1.0,"pid":1,"args":{"value":1}});
    counter_bound["bind_id"] = json!(8);
    counter_bound["flow_out"] = json!(true);
    assert!(check_trace(&trace_of(json!([counter_bound]))).unwrap_err().contains("binds to no slice"));
    // Flow v1: s and f must fall on slices of their thread.
    let f =
        |ph: &str, ts: f64, tid: u64| json!({"ph":ph,"name":"f","cat":"c","id":1,"ts":ts,"pid":1,"tid":tid,"bp":"e"});
    let v1 = json!([x(0.0, 10.0, 1), x(20.0, 10.0, 2), f("s", 5.0, 1), f("f", 25.0, 2)]);
    assert_eq!(check_trace(&trace_of(v1)).unwrap().flows, 1);
    let unbound = json!([x(0.0, 10.0, 1), x(20.0, 10.0, 2), f("s", 15.0, 1), f("f", 25.0, 2)]);
    assert!(check_trace(&trace_of(unbound)).unwrap_err().contains("bound to no slice"));
}

/// Runs the tiny model streamed with `extra` flags, writing a trace and a report; returns both.
pub fn streamed_trace(extra: &[&str]) -> (Value, Value) {
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("trace.json");
    let (_, report) = streamed_run(&[&["--trace", trace.to_str().unwrap()][..], extra].concat());
    (serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap(), report)
}

/// Runs the tiny model streamed with `extra` flags, writing a report; returns its stderr and
/// the report.
pub fn streamed_run(extra: &[&str]) -> (String, Value) {
    let model = tiny_dir();
    let trunk = pack(&model);
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("report.json");
    let args = [
        "run",
        "--model",
        model.to_str().unwrap(),
        "--trunk",
        trunk.path().to_str().unwrap(),
        "--prompt",
        "Once upon a time",
        "--gen",
        "6",
        "--ignore-eos",
        "--json",
        json.to_str().unwrap(),
    ];
    let (code, _, err) = k3ring(&[&args[..], extra].concat());
    assert_eq!(code, 0, "{err}");
    (err, serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap())
}

fn read_slices(s: &TraceSummary) -> usize {
    s.async_slices.iter().filter(|(name, _)| name.ends_with(" read")).map(|(_, n)| n).sum()
}

#[test]
fn a_streamed_trace_passes_the_strict_checker_with_one_slice_per_read() {
    // A budget that streams experts and trunk, with every guess read: all three kinds of read.
    let (trace, report) = streamed_trace(&["--mem-gb", "0.0014", "--spec-fixed"]);
    let summary = check_trace(&trace).unwrap_or_else(|e| panic!("{e}"));
    let ops = report["storage"]["io"]["ops"].as_u64().unwrap() as usize;
    assert!(ops > 0);
    assert_eq!(read_slices(&summary), ops, "one async slice per read in the report: {summary:?}");
    for kind in ["demand expert read", "speculative expert read"] {
        assert!(summary.async_slices.contains_key(kind), "no {kind:?}: {summary:?}");
    }
    // Every trunk read is counted, pinned units included (issue 16 saw "1.1 MiB (0 reads)"); the
    // tiny model's units are smaller than a read-ahead piece, so each is one read.
    let trunk_slices: usize =
        summary.async_slices.iter().filter(|(n, _)| n.ends_with("trunk read")).map(|(_, n)| n).sum();
    assert_eq!(report["storage"]["trunk_reads"].as_u64().unwrap() as usize, trunk_slices, "{summary:?}");
    // Router -> read -> expert compute chains exist, and each read is in at most one flow.
    assert!(summary.flows_with_step > 0, "{summary:?}");
    let events = trace["traceEvents"].as_array().unwrap();
    let routes = events.iter().filter(|e| e["name"] == "route" && e["flow_out"] == true).count();
    assert!(routes > 0 && routes <= summary.flows);
    // No read is drawn as a thread slice any more.
    assert!(!events.iter().any(|e| e["ph"] == "X" && e["cat"] == "io"));
}

#[test]
fn a_serial_trace_without_speculation_passes_the_strict_checker() {
    let (trace, report) = streamed_trace(&["--mem-gb", "0.0014", "--no-spec", "--mode", "serial"]);
    let summary = check_trace(&trace).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(read_slices(&summary), report["storage"]["io"]["ops"].as_u64().unwrap() as usize);
    assert!(!summary.async_slices.contains_key("speculative expert read"), "{summary:?}");
}
