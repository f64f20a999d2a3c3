#![allow(clippy::unwrap_used)]
use super::*;
use crate::rng::SplitMix64;
use std::path::Path;

use crate::storage::stream::policy::{policy_by_name, CachePolicy, ExpertKey, POLICY_NAMES};

/// Tokens routing to `top_k` of `experts` per layer, expert e drawn with weight 1/(e+1)
/// (skewed) or uniformly.
fn synthetic(seed: u64, tokens: u64, layers: usize, experts: usize, top_k: usize, skewed: bool) -> Trace {
    let mut rng = SplitMix64::new(seed);
    let weights: Vec<f64> = (0..experts).map(|e| if skewed { 1.0 / (e + 1) as f64 } else { 1.0 }).collect();
    let total: f64 = weights.iter().sum();
    let mut t = Trace::new(layers, experts, top_k).unwrap();
    for token in 0..tokens {
        for layer in 0..layers {
            let mut picked = Vec::new();
            while picked.len() < top_k {
                let mut x = rng.next_f64() * total;
                let e = weights.iter().position(|w| {
                    x -= w;
                    x < 0.0
                });
                let e = e.unwrap_or(experts - 1);
                if !picked.contains(&e) {
                    picked.push(e);
                }
            }
            t.push(token, layer, &picked).unwrap();
        }
    }
    t
}

/// Hides `victim_where`, so the pool's default (list the candidates, call `victim`) runs.
struct ListCandidates(Box<dyn CachePolicy>);

impl CachePolicy for ListCandidates {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn on_layer(&mut self, layer: usize) {
        self.0.on_layer(layer);
    }
    fn on_insert(&mut self, key: ExpertKey) {
        self.0.on_insert(key);
    }
    fn on_access(&mut self, key: ExpertKey) {
        self.0.on_access(key);
    }
    fn on_evict(&mut self, key: ExpertKey) {
        self.0.on_evict(key);
    }
    fn victim(&mut self, candidates: &[ExpertKey]) -> Option<ExpertKey> {
        self.0.victim(candidates)
    }
}

#[test]
fn victim_where_and_victim_agree_for_every_policy() {
    let trace = synthetic(7, 60, 3, 32, 4, true);
    for name in POLICY_NAMES {
        for capacity in [4, 9, 30] {
            let fast = simulate(&trace, capacity, policy_by_name(name, capacity).unwrap().as_mut()).unwrap();
            let mut listed = ListCandidates(policy_by_name(name, capacity).unwrap());
            let slow = simulate(&trace, capacity, &mut listed).unwrap();
            assert_eq!((fast.hits, fast.evictions), (slow.hits, slow.evictions), "{name} at {capacity}");
        }
    }
}

#[test]
fn belady_bounds_every_policy_and_grows_with_capacity() {
    for skewed in [true, false] {
        let trace = synthetic(11, 80, 4, 32, 4, skewed);
        let mut last = 0;
        for capacity in [4, 5, 8, 16, 33, 64, 128] {
            let best = belady(&trace, capacity).unwrap();
            assert!(best.hits >= last, "belady lost hits from capacity {capacity}");
            last = best.hits;
            for name in POLICY_NAMES {
                let r = simulate(&trace, capacity, policy_by_name(name, capacity).unwrap().as_mut()).unwrap();
                assert!(best.hits >= r.hits, "{name} beats belady at {capacity}: {} > {}", r.hits, best.hits);
                assert_eq!(r.hits + r.misses, trace.requests());
            }
        }
    }
}

#[test]
fn a_pool_of_every_expert_misses_only_first_uses() {
    let trace = synthetic(3, 50, 2, 16, 4, true);
    let distinct = trace.distinct_experts();
    for capacity in [distinct, distinct + 10] {
        let r = belady(&trace, capacity).unwrap();
        assert_eq!((r.misses, r.evictions), (distinct as u64, 0));
        for name in POLICY_NAMES {
            let r = simulate(&trace, capacity, policy_by_name(name, capacity).unwrap().as_mut()).unwrap();
            assert_eq!((r.misses, r.evictions), (distinct as u64, 0), "{name}");
        }
    }
}

#[test]
fn hand_computed_lru_and_belady() {
    // top_k 2, capacity 3, one layer. Batches: {0,1} {2,0} {1,3} {0,1}.
    let mut t = Trace::new(1, 4, 2).unwrap();
    for (token, es) in [[0, 1], [2, 0], [1, 3], [0, 1]].iter().enumerate() {
        t.push(token as u64, 0, es).unwrap();
    }
    // LRU: misses 0 1. Hit 0, miss 2 (a free slot); the hit is used before the miss, so
    // the age order is 1 0 2. Hit 1, miss 3 evicts 0 (1 is protected). Hit 1, miss 0 evicts
    // 2. Hits 1 + 1 + 1.
    let r = simulate(&t, 3, &mut super::super::policy::Lru::default()).unwrap();
    assert_eq!((r.hits, r.misses, r.evictions), (3, 5, 2));
    // Belady evicts 2 (never used again) for 3 and then hits both 0 and 1.
    let b = belady(&t, 3).unwrap();
    assert_eq!((b.hits, b.misses, b.evictions), (4, 4, 1));
    assert_eq!(b.tokens, 4);
    assert!((r.bytes_read_per_token(10.0) - 12.5).abs() < 1e-12);
    assert_eq!(default_capacities(&t), vec![2, 4]);
}

#[test]
fn a_sweep_larger_than_the_pool_misses_every_expert_under_lru_but_not_under_cyclic() {
    // Every token uses all 4 experts of each of 4 layers; the pool holds 10 of the 16. At each
    // layer LRU's oldest are the next layer's experts, so it evicts each expert just before its
    // use. Cyclic evicts from the layer that ran last (its next turn comes last), which on this
    // trace is Belady's choice.
    let mut t = Trace::new(4, 4, 4).unwrap();
    for token in 0..10 {
        for layer in 0..4 {
            t.push(token, layer, &[0, 1, 2, 3]).unwrap();
        }
    }
    let lru = simulate(&t, 10, &mut super::super::policy::Lru::default()).unwrap();
    assert_eq!((lru.hits, lru.misses), (0, 160));
    let cyclic = simulate(&t, 10, &mut super::super::policy::Cyclic::default()).unwrap();
    let best = belady(&t, 10).unwrap();
    assert_eq!((cyclic.hits, cyclic.misses), (72, 88));
    assert_eq!((best.hits, best.misses), (72, 88));
}

#[test]
fn a_pool_smaller_than_top_k_is_refused() {
    let t = Trace::new(2, 8, 4).unwrap();
    let e = belady(&t, 3).unwrap_err();
    assert_eq!(
        e.to_string(),
        "a pool of 3 experts cannot hold one routing decision of 4 experts: use a capacity of at least 4"
    );
    assert!(simulate(&t, 3, &mut super::super::policy::Lru::default()).is_err());
}

#[test]
fn trace_push_rejects_bad_records() {
    let mut t = Trace::new(2, 8, 2).unwrap();
    t.push(0, 1, &[1, 2]).unwrap();
    let reason = |r: Result<(), TraceError>| r.unwrap_err().to_string();
    assert!(reason(t.push(0, 1, &[3, 4])).contains("comes after token 0 layer 1"));
    assert!(reason(t.push(1, 2, &[3, 4])).contains("layer 2 is out of range"));
    assert!(reason(t.push(1, 0, &[3, 8])).contains("expert 8 is out of range"));
    assert!(reason(t.push(1, 0, &[3, 3])).contains("appears twice"));
    assert!(reason(t.push(1, 0, &[3])).contains("1 experts where the header says top_k=2"));
    assert!(reason(t.push(1, 0, &[3, 4, 5])).contains("more than top_k=2"));
    assert_eq!((t.batch_count(), t.requests(), t.tokens()), (1, 2, 1));
    t.push(1, 0, &[3, 4]).unwrap();
    assert_eq!((t.batch_count(), t.tokens(), t.distinct_experts()), (2, 2, 4));
}

#[test]
fn writer_reorders_a_layer_major_prefill_and_reads_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.trace");
    let mut w =
        TraceWriter::create(&crate::files::Output::resolve("--dump-trace", &path, false).unwrap(), 3, 8, 2).unwrap();
    // Prefill of tokens 0..3 over MoE layers 1 and 2, layer-major; then decode of 3 and 4.
    for layer in 1..3 {
        for token in 0..3u64 {
            w.record(token, layer, &[token as usize, layer + 4]).unwrap();
        }
    }
    for token in 3..5u64 {
        for layer in 1..3 {
            w.record(token, layer, &[7 - token as usize, layer]).unwrap();
        }
    }
    assert!(w.record(0, 1, &[1, 1]).is_err());
    w.finish().unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "# k3ring expert trace v1 layers=3 experts=8 top_k=2");
    assert_eq!(&lines[1..4], &["0 1 0 5", "0 2 0 6", "1 1 1 5"]);
    assert_eq!(lines[lines.len() - 1], "4 2 3 2");
    let t = read_trace(&path).unwrap();
    assert_eq!((t.layers(), t.experts(), t.top_k(), t.batch_count(), t.tokens()), (3, 8, 2, 10, 5));
    let b = t.batch(9);
    assert_eq!((b.token, b.layer, b.experts), (4, 2, &[3u32, 2][..]));
}

#[test]
fn writer_refuses_a_record_that_would_be_written_out_of_order() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.trace");
    let mut w =
        TraceWriter::create(&crate::files::Output::resolve("--dump-trace", &path, false).unwrap(), 4, 8, 1).unwrap();
    w.record(5, 3, &[1]).unwrap();
    // Token 6 at layer 0 ends the pass of token 5, which is written.
    w.record(6, 0, &[1]).unwrap();
    w.record(7, 0, &[1]).unwrap();
    w.record(6, 1, &[1]).unwrap();
    w.record(8, 0, &[1]).unwrap();
    w.record(4, 0, &[2]).unwrap();
    let e = w.finish().unwrap_err();
    assert_eq!(e.to_string(), "expert trace: token 4 layer 0 recorded after token 7 layer 0 was written");
    assert_eq!(e.exit_code(), ExitCode::Data);
}

fn read_text(text: &str) -> Result<Trace, TraceError> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.trace");
    std::fs::write(&path, text).unwrap();
    read_trace(&path).map_err(|e| match e {
        TraceError::Malformed { line, reason, .. } => TraceError::Malformed { path: "T".into(), line, reason },
        other => other,
    })
}

#[test]
fn reader_names_the_line_and_what_is_wrong() {
    let head = "# k3ring expert trace v1 layers=2 experts=8 top_k=2\n";
    let cases = [
        ("", "expert trace T line 1: the file is empty; expected the header `# k3ring expert trace v1 layers=L experts=E top_k=K`"),
        ("# k3ring expert trace v2 layers=2 experts=8 top_k=2\n", "expert trace T line 1: unsupported trace version \"v2\"; this k3ring reads v1"),
        ("# k3ring expert trace v1 layers=2 experts=8 top_k=9\n", "expert trace T line 1: top_k=9 is outside 1..=8"),
        ("0 0 1 2\n", "expert trace T line 1: expected the header `# k3ring expert trace v1 layers=L experts=E top_k=K`, found \"0 0 1 2\""),
    ];
    for (text, want) in cases {
        assert_eq!(read_text(text).unwrap_err().to_string(), want);
    }
    let body_cases = [
        ("0 0 1 2\n\n# comment\n0 1 3 x\n", "line 5: expert \"x\" is not a non-negative integer"),
        ("0 0 1\n", "line 2: 1 experts where the header says top_k=2"),
        ("0 0 1 2 3\n", "line 2: more than top_k=2 experts"),
        ("0 1 1 2\n0 0 1 2\n", "line 3: token 0 layer 0 comes after token 0 layer 1"),
        ("-1 0 1 2\n", "line 2: token \"-1\" is not a non-negative integer"),
        ("0\n", "line 2: expected `token layer` and 2 experts, the line ends before the layer"),
    ];
    for (body, want) in body_cases {
        let e = read_text(&format!("{head}{body}")).unwrap_err();
        assert_eq!(e.exit_code(), ExitCode::Data);
        assert!(e.to_string().contains(want), "{e} does not contain {want}");
    }
    let ok = read_text(&format!("{head}0 0 1 2\n\n0 1 3 4")).unwrap();
    assert_eq!(ok.batch_count(), 2);
}

#[test]
fn reader_reports_a_missing_file_as_io() {
    let e = read_trace(Path::new("/nonexistent/k3ring.trace")).unwrap_err();
    assert_eq!(e.exit_code(), ExitCode::Io);
    assert!(e.to_string().starts_with("opening expert trace /nonexistent/k3ring.trace: "), "{e}");
}
