//! `k3ring serve`'s prefix cache (issue 32) through HTTP: requests that share a system prompt or
//! resend a conversation start from a cached state (`usage.prompt_tokens_details.cached_tokens`)
//! and give the tokens a server without the cache gives, greedy and seeded, streamed and not,
//! concurrently; a pool too small for every prompt evicts while requests run and stays exact;
//! `/metrics` counts it; a cache larger than the budget is refused at start.

use serde_json::{json, Value};

use crate::common::*;
use crate::serve_tests::{metric, post, Server};

fn body(system: &[u32], user: u32, seed: Option<u64>, stream: bool) -> Value {
    let prompt: Vec<u32> = system.iter().copied().chain([user, user + 1, 7]).collect();
    let mut b = json!({"prompt": prompt, "max_tokens": 6, "ignore_eos": true, "stream": stream});
    match seed {
        Some(s) => {
            b["temperature"] = json!(0.8);
            b["seed"] = json!(s);
        }
        None => b["temperature"] = json!(0),
    }
    b
}

/// The ids of a reply, streamed or not, and its cached tokens.
fn ids_and_cached(addr: &str, body: &Value) -> (Vec<u32>, u64) {
    let r = post(addr, "/v1/completions", body);
    assert_eq!(r.status, 200, "{}", r.body);
    if body["stream"] == json!(true) {
        let events = r.events();
        let mut got = Vec::new();
        let mut cached = None;
        for e in &events[..events.len() - 1] {
            let v: Value = serde_json::from_str(e).unwrap();
            got.extend(ids(&v["choices"][0]["token_ids"]));
            if let Some(c) = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64() {
                cached = Some(c);
            }
        }
        return (got, cached.unwrap_or(0));
    }
    let v = r.json();
    (ids(&v["choices"][0]["token_ids"]), v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0))
}

#[test]
fn serve_reuses_prefixes_and_answers_as_a_cold_server() {
    let cold = Server::start(&["--prefix-cache-gb", "0"]);
    let warm = Server::start(&["--prefix-stride", "16"]);
    let system: Vec<u32> = (0..70).map(|j| (j * 29 + 3) % 700).collect();
    let mut cases = Vec::new();
    for (i, stream) in [false, true, false, true, false, true].into_iter().enumerate() {
        let seed = (i % 2 == 1).then_some(i as u64);
        cases.push(body(&system, 100 + i as u32, seed, stream));
    }
    let (first, cached) = ids_and_cached(&warm.addr, &cases[0]);
    assert_eq!(cached, 0, "nothing is cached at first");
    assert_eq!(first, ids_and_cached(&cold.addr, &cases[0]).0);
    // Later users share the system prompt: they start at its last stride (64 of 70 tokens).
    for c in &cases[1..] {
        let (got, cached) = ids_and_cached(&warm.addr, c);
        assert_eq!(got, ids_and_cached(&cold.addr, c).0, "{c}");
        assert!(cached >= 64, "{cached} cached tokens for {c}");
    }
    // The same prompt again: from where the system prompt ends (its last token must run).
    let (_, cached) = ids_and_cached(&warm.addr, &cases[0]);
    assert_eq!(cached, 70);
    // A conversation's next turn resends the prompt and adds to it: it starts at its end.
    let mut next = cases[0].clone();
    let longer: Vec<Value> = next["prompt"].as_array().unwrap().iter().cloned().chain([json!(5), json!(6)]).collect();
    next["prompt"] = json!(longer);
    let (got, cached) = ids_and_cached(&warm.addr, &next);
    assert_eq!(cached, 73);
    assert_eq!(got, ids_and_cached(&cold.addr, &next).0);
    // Concurrently: a mixed batch of warm and new prompts.
    let handles: Vec<_> = (0..6)
        .map(|i| {
            let (addr, b) =
                (warm.addr.clone(), body(&system, 300 + (i % 3) as u32 * 40, (i % 2 == 0).then_some(9), i % 3 == 0));
            std::thread::spawn(move || (b.clone(), ids_and_cached(&addr, &b).0))
        })
        .collect();
    for h in handles {
        let (b, got) = h.join().unwrap();
        assert_eq!(got, ids_and_cached(&cold.addr, &b).0, "{b}");
    }
    // The model thread refreshes the metrics every 250 ms.
    crate::serve_tests::wait_until("the prefix cache's metrics", || {
        metric(&warm.addr, "k3ring_prefix_cache_hits_total") >= 12.0
            && metric(&warm.addr, "k3ring_prefix_cache_bytes") > 0.0
            && metric(&warm.addr, "k3ring_prefix_cache_cached_tokens_total") >= 64.0 * 12.0
    });
    let m = crate::serve_tests::request(&cold.addr, "GET", "/metrics", &[], b"").body;
    assert!(!m.contains("k3ring_prefix_cache"), "no cache, no metrics: {m}");
    for s in [cold, warm] {
        let (code, err) = s.stop_with(libc::SIGTERM);
        assert_eq!(code, 0, "{err}");
    }
}

#[test]
fn serve_prefix_pool_evicts_while_requests_run_and_stays_exact() {
    let cold = Server::start(&["--prefix-cache-gb", "0"]);
    // About 2 MB: a few snapshots of these prompts on the tiny model.
    let warm = Server::start(&["--prefix-cache-gb", "0.002", "--prefix-stride", "8", "--max-batch", "3"]);
    let handles: Vec<_> = (0..12)
        .map(|i| {
            let system: Vec<u32> = (0..40).map(|j| (j * 13 + i * 101) % 700).collect();
            let b = body(&system, 50 + i, (i % 2 == 0).then_some(u64::from(i)), i % 4 == 1);
            let addr = warm.addr.clone();
            std::thread::spawn(move || {
                let twice = [ids_and_cached(&addr, &b).0, ids_and_cached(&addr, &b).0];
                (b, twice)
            })
        })
        .collect();
    for h in handles {
        let (b, [one, two]) = h.join().unwrap();
        let want = ids_and_cached(&cold.addr, &b).0;
        assert_eq!((&one, &two), (&want, &want), "{b}");
    }
    wait_evictions(&warm.addr);
    assert!(metric(&warm.addr, "k3ring_prefix_cache_bytes") <= 0.002e9);
    for s in [cold, warm] {
        let (code, err) = s.stop_with(libc::SIGTERM);
        assert_eq!(code, 0, "{err}");
    }
}

fn wait_evictions(addr: &str) {
    crate::serve_tests::wait_until("evictions in /metrics", || {
        metric(addr, "k3ring_prefix_cache_evictions_total") > 0.0
    });
}

/// A cache that leaves nothing of the budget is refused before the model opens (exit 2, naming
/// both); a negative size too.
#[test]
fn serve_refuses_a_prefix_cache_beyond_the_budget() {
    let trunk = pack(&tiny_dir());
    let (model, trunk) = (tiny_dir(), trunk.path().to_owned());
    for (args, says) in [
        (vec!["--mem-gb", "1", "--prefix-cache-gb", "2"], "--prefix-cache-gb 2.00 GB leaves nothing of the budget"),
        (vec!["--prefix-cache-gb", "-1"], "--prefix-cache-gb"),
        (vec!["--prefix-stride", "0"], "--prefix-stride"),
    ] {
        let base = ["serve", "--model", model.to_str().unwrap(), "--trunk", trunk.to_str().unwrap(), "--port", "0"];
        let all = [&base[..], &args[..]].concat();
        let (code, _, err) = k3ring_stdin(&all, "");
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(says) && (!says.contains("budget") || err.contains("--mem-gb")), "{args:?}: {err}");
    }
}
