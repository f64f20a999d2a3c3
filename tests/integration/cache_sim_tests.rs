//! `k3ring cache-sim` through the binary, on synthetic traces written with `TraceWriter`:
//! skewed routing (Zipf-like popularity per layer) and flat random routing.

use std::path::{Path, PathBuf};

use k3ring::rng::SplitMix64;
use k3ring::storage::stream::cache_sim::TraceWriter;
use serde_json::Value;

use crate::checkpoint_tests::k3ring;

const LAYERS: usize = 8;
const EXPERTS: usize = 64;
const TOP_K: usize = 4;
const TOKENS: u64 = 300;
const POLICIES: [&str; 6] = ["lru", "s3fifo", "lfu", "cyclic", "even", "belady"];

/// Writes a trace where each layer's expert of popularity rank r is drawn with weight
/// 1/(r+1)^skew (0 = flat), ranks shuffled per layer; layer 0 is dense (no lines).
fn write_trace(dir: &Path, name: &str, skew: f64, seed: u64) -> PathBuf {
    let path = dir.join(name);
    let mut rng = SplitMix64::new(seed);
    let weights: Vec<f64> = (0..EXPERTS).map(|r| 1.0 / ((r + 1) as f64).powf(skew)).collect();
    let total: f64 = weights.iter().sum();
    let ranks: Vec<Vec<usize>> = (0..LAYERS)
        .map(|_| {
            let mut p: Vec<usize> = (0..EXPERTS).collect();
            for i in (1..EXPERTS).rev() {
                p.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            p
        })
        .collect();
    let mut w = TraceWriter::create_sized(
        &k3ring::files::Output::resolve("--dump-trace", &path, false).unwrap(),
        LAYERS + 1,
        EXPERTS,
        TOP_K,
        Some(17_500_000),
    )
    .unwrap();
    for token in 0..TOKENS {
        for (layer, ranks) in ranks.iter().enumerate() {
            let mut picked: Vec<usize> = Vec::new();
            while picked.len() < TOP_K {
                let mut x = rng.next_f64() * total;
                let rank = weights.iter().position(|w| {
                    x -= w;
                    x < 0.0
                });
                let e = ranks[rank.unwrap_or(EXPERTS - 1)];
                if !picked.contains(&e) {
                    picked.push(e);
                }
            }
            w.record(token, layer + 1, &picked).unwrap();
        }
    }
    w.finish().unwrap();
    path
}

fn run_json(args: &[&str]) -> Value {
    let mut all = vec!["cache-sim"];
    all.extend_from_slice(args);
    all.extend(["--json", "-"]);
    let (code, out, err) = k3ring(&all);
    assert_eq!(code, 0, "k3ring {all:?} failed: {err}");
    serde_json::from_str(&out).unwrap()
}

/// Hit rate of `policy` in each row, in capacity order.
fn rates(report: &Value, policy: &str) -> Vec<(u64, f64)> {
    report["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            let cell = row["results"].as_array().unwrap().iter().find(|c| c["policy"] == policy).unwrap();
            (row["capacity"].as_u64().unwrap(), cell["hit_rate"].as_f64().unwrap())
        })
        .collect()
}

fn traces(dir: &Path) -> [(&'static str, PathBuf); 2] {
    [("skewed", write_trace(dir, "skewed.trace", 1.0, 1)), ("flat", write_trace(dir, "flat.trace", 0.0, 2))]
}

#[test]
fn cache_sim_default_capacities_double_from_top_k_to_the_distinct_experts() {
    let dir = tempfile::tempdir().unwrap();
    for (name, path) in traces(dir.path()) {
        let report = run_json(&[path.to_str().unwrap()]);
        let distinct = report["distinct_experts"].as_u64().unwrap();
        let capacities: Vec<u64> = rates(&report, "lru").iter().map(|r| r.0).collect();
        let mut want: Vec<u64> =
            std::iter::successors(Some(TOP_K as u64), |c| Some(c * 2)).take_while(|&c| c < distinct).collect();
        want.push(distinct);
        assert_eq!(capacities, want, "{name}");
        assert_eq!(report["requests"].as_u64(), Some(TOKENS * (LAYERS * TOP_K) as u64));
        assert_eq!(report["tokens"].as_u64(), Some(TOKENS));
    }
}

#[test]
fn cache_sim_belady_bounds_every_policy_and_rates_grow_with_capacity() {
    let dir = tempfile::tempdir().unwrap();
    for (name, path) in traces(dir.path()) {
        let report =
            run_json(&[path.to_str().unwrap(), "--capacities", "4,5,6,8,12,16,24,32,48,64,96,128,192,256,384,512"]);
        let best = rates(&report, "belady");
        for policy in ["lru", "s3fifo", "lfu", "cyclic", "even"] {
            for (b, p) in best.iter().zip(rates(&report, policy)) {
                assert!(b.1 >= p.1, "{name}: {policy} beats belady at capacity {}: {} > {}", b.0, p.1, b.1);
            }
        }
        for policy in ["belady", "lru"] {
            let r = rates(&report, policy);
            for w in r.windows(2) {
                assert!(
                    w[1].1 >= w[0].1,
                    "{name}: {policy} drops from {} at {} to {} at {}",
                    w[0].1,
                    w[0].0,
                    w[1].1,
                    w[1].0
                );
            }
        }
    }
}

#[test]
fn cache_sim_frequency_policies_beat_lru_on_skewed_routing_at_small_capacity() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_trace(dir.path(), "skewed.trace", 1.0, 1);
    let report = run_json(&[path.to_str().unwrap(), "--capacities", "16,32,64"]);
    let lru = rates(&report, "lru");
    for policy in ["s3fifo", "lfu"] {
        for (l, p) in lru.iter().zip(rates(&report, policy)) {
            assert!(p.1 > l.1, "{policy} does not beat lru at capacity {}: {} <= {}", l.0, p.1, l.1);
        }
    }
}

#[test]
fn cache_sim_a_pool_of_every_expert_misses_only_first_uses() {
    let dir = tempfile::tempdir().unwrap();
    for (name, path) in traces(dir.path()) {
        let probe = run_json(&[path.to_str().unwrap(), "--capacities", "4"]);
        let distinct = probe["distinct_experts"].as_u64().unwrap();
        let requests = probe["requests"].as_u64().unwrap() as f64;
        let want = 1.0 - distinct as f64 / requests;
        let capacities = format!("{distinct},{}", distinct + 100);
        let report = run_json(&[path.to_str().unwrap(), "--capacities", &capacities]);
        for policy in POLICIES {
            for (capacity, rate) in rates(&report, policy) {
                assert!((rate - want).abs() < 1e-12, "{name}: {policy} at {capacity}: {rate} != {want}");
            }
        }
    }
}

#[test]
fn cache_sim_text_table_lists_every_policy_and_a_conclusion() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_trace(dir.path(), "skewed.trace", 1.0, 1);
    let (code, out, err) = k3ring(&["cache-sim", path.to_str().unwrap(), "--capacities", "8,64", "--expert-mb", "2"]);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].contains("300 tokens, 9 layers x 64 experts, top_k 4, 9600 requests"), "{out}");
    assert!(lines[1].contains("MB read per token (2 MB per expert)"), "{out}");
    let header: Vec<&str> = lines[2].split_whitespace().collect();
    assert_eq!(
        header,
        [
            "capacity", "lru", "s3fifo", "lfu", "cyclic", "even", "belady", "lru", "s3fifo", "lfu", "cyclic", "even",
            "belady"
        ]
    );
    assert!(lines[3].trim_start().starts_with("8 "), "{out}");
    assert!(lines[4].trim_start().starts_with("64 "), "{out}");
    assert!(lines[5].starts_with("conclusion: "), "{out}");
    assert!(lines[5].contains("Belady is"), "{out}");
    assert_eq!(lines.len(), 6);
}

#[test]
fn cache_sim_expert_mb_scales_the_read_volume() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_trace(dir.path(), "flat.trace", 0.0, 2);
    let report = run_json(&[path.to_str().unwrap(), "--capacities", "16", "--expert-mb", "3"]);
    for cell in report["rows"][0]["results"].as_array().unwrap() {
        let misses = cell["misses"].as_f64().unwrap();
        let mb = cell["mb_read_per_token"].as_f64().unwrap();
        assert!((mb - misses * 3.0 / TOKENS as f64).abs() < 1e-9, "{cell}");
    }
    let (code, _, err) = k3ring(&["cache-sim", path.to_str().unwrap(), "--expert-mb", "0"]);
    assert_eq!(code, 2);
    assert!(err.contains("\"0\" is not a size in MB (a positive number)"), "{err}");
}

#[test]
fn cache_sim_capacities_flag_forms_and_last_wins() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_trace(dir.path(), "flat.trace", 0.0, 2);
    let p = path.to_str().unwrap();
    let capacities = |r: &Value| rates(r, "lru").iter().map(|x| x.0).collect::<Vec<_>>();
    assert_eq!(capacities(&run_json(&[p, "--capacities=32,8,8"])), [8, 32]);
    assert_eq!(capacities(&run_json(&[p, "--capacities", "8", "--capacities", "16"])), [16]);
    let (code, _, err) = k3ring(&["cache-sim", p, "--capacities", "3,8"]);
    assert_eq!(code, 2);
    assert_eq!(
        err.trim(),
        "k3ring: error: --capacities 3 is below the trace's top_k=4: a pool must hold one routing decision"
    );
}

#[test]
fn cache_sim_malformed_trace_line_exits_3_naming_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.trace");
    std::fs::write(&path, "# k3ring expert trace v1 layers=2 experts=8 top_k=2\n0 0 1 2\n0 1 1 9\n").unwrap();
    let (code, out, err) = k3ring(&["cache-sim", path.to_str().unwrap()]);
    assert_eq!(code, 3, "{err}");
    assert!(out.is_empty());
    let want = format!(
        "k3ring: error: expert trace {} line 3: expert 9 is out of range (the header says experts=8)",
        path.display()
    );
    assert_eq!(err.trim(), want);
}

#[test]
fn cache_sim_missing_trace_exits_4() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("absent.trace");
    let (code, _, err) = k3ring(&["cache-sim", path.to_str().unwrap()]);
    assert_eq!(code, 4, "{err}");
    assert!(err.starts_with(&format!("k3ring: error: opening expert trace {}: ", path.display())), "{err}");
    assert!(err.contains("No such file or directory"), "{err}");
}

/// Issue 16: the expert size comes from the trace's header (a run writes it), not a default
/// 17.5 MB; a trace without it needs --expert-mb.
#[test]
fn cache_sim_takes_the_expert_size_from_the_trace_header() {
    let dir = tempfile::tempdir().unwrap();
    let routes = dir.path().join("routes.trace");
    let model = crate::common::tiny_dir();
    let (code, _, err) = k3ring(&[
        "run",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "Once upon a time",
        "--gen",
        "4",
        "--dump-trace",
        routes.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let cfg = k3ring::config::Config::from_model_dir(&model).unwrap();
    let header = std::fs::read_to_string(&routes).unwrap().lines().next().unwrap().to_owned();
    assert!(header.ends_with(&format!(" expert_bytes={}", cfg.expert_bytes())), "{header}");
    let report = run_json(&[routes.to_str().unwrap()]);
    assert!((report["expert_mb"].as_f64().unwrap() - cfg.expert_bytes() as f64 / 1e6).abs() < 1e-12, "{report}");
    let old = dir.path().join("old.trace");
    std::fs::write(&old, "# k3ring expert trace v1 layers=2 experts=8 top_k=2\n0 1 0 5\n").unwrap();
    let (code, _, err) = k3ring(&["cache-sim", old.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("records no expert size") && err.contains("give --expert-mb"), "{err}");
    let (code, _, err) = k3ring(&["cache-sim", old.to_str().unwrap(), "--expert-mb", "1"]);
    assert_eq!(code, 0, "{err}");
}
