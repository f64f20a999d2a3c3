//! `k3ring serve` log-probabilities (issue 32) through HTTP: completions (`logprobs` N) and chat
//! (`logprobs` + `top_logprobs`), streamed and not, in OpenAI's shapes; the numbers equal
//! `k3ring run --logprobs N`'s, and stay the same while other requests share the batch; bad
//! values are refused naming the field.

use serde_json::{json, Value};

use crate::common::*;
use crate::serve_tests::{post, Server};

/// `run --logprobs top --json` on the tiny model: per generated token (id, logprob, top ids).
fn solo_logprobs(ids: &str, gen: &str, top: &str) -> Vec<(u64, f32, Vec<u64>)> {
    let json = tempfile::NamedTempFile::new().unwrap();
    let dir = tiny_dir();
    let args = [
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--ids",
        ids,
        "--gen",
        gen,
        "--ignore-eos",
        "--logprobs",
        top,
        "--json",
        json.path().to_str().unwrap(),
    ];
    let (code, _, err) = k3ring_stdin(&args, "");
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_slice(&std::fs::read(json.path()).unwrap()).unwrap();
    v["logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let top = e["top"].as_array().unwrap().iter().map(|t| t["id"].as_u64().unwrap()).collect();
            (e["id"].as_u64().unwrap(), e["logprob"].as_f64().unwrap() as f32, top)
        })
        .collect()
}

/// The chunks of a streamed reply (without `[DONE]`).
fn chunks(addr: &str, path: &str, body: &Value) -> Vec<Value> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = post(addr, path, &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let events = r.events();
    events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect()
}

#[test]
fn serve_completion_logprobs_equal_run_s_streamed_and_not() {
    let server = Server::start(&[]);
    let addr = &server.addr;
    let solo = solo_logprobs("5,17,300", "12", "3");
    let body = json!({"prompt": [5, 17, 300], "max_tokens": 12, "temperature": 0, "ignore_eos": true, "logprobs": 3});
    // Other requests in the batch meanwhile change nothing.
    let noise: Vec<_> = (0..3)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let b =
                    json!({"prompt": [9 + i, 40], "max_tokens": 20, "temperature": 0.7, "seed": i, "ignore_eos": true});
                post(&addr, "/v1/completions", &b).status
            })
        })
        .collect();
    let r = post(addr, "/v1/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let lp = &v["choices"][0]["logprobs"];
    let ids = ids(&v["choices"][0]["token_ids"]);
    let values: Vec<f32> =
        lp["token_logprobs"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
    assert_eq!(values.len(), 12);
    assert_eq!(ids, solo.iter().map(|s| s.0 as u32).collect::<Vec<_>>());
    assert_eq!(values, solo.iter().map(|s| s.1).collect::<Vec<_>>(), "the same f32 numbers as run's");
    let tokens = lp["tokens"].as_array().unwrap();
    let offsets: Vec<u64> = lp["text_offset"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
    assert_eq!((tokens.len(), offsets.len()), (12, 12));
    assert_eq!(offsets[0], 0);
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 3, "{top:?}");
        // Greedy: the chosen token is the likeliest, with its own log-probability.
        let best = top.values().map(|x| x.as_f64().unwrap()).fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(best as f32, values[i]);
        let len = tokens[i].as_str().unwrap().chars().count() as u64;
        if i + 1 < offsets.len() {
            assert_eq!(offsets[i + 1], offsets[i] + len);
        }
    }
    // Streamed: the same entries, split over the chunks, offsets running on.
    let mut s = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for c in chunks(addr, "/v1/completions", &body) {
        let lp = &c["choices"][0]["logprobs"];
        if lp.is_null() {
            assert!(c["choices"][0]["token_ids"].as_array().is_none_or(Vec::is_empty), "{c}");
            continue;
        }
        s.0.extend(lp["tokens"].as_array().unwrap().clone());
        s.1.extend(lp["token_logprobs"].as_array().unwrap().clone());
        s.2.extend(lp["top_logprobs"].as_array().unwrap().clone());
        s.3.extend(lp["text_offset"].as_array().unwrap().clone());
    }
    assert_eq!(json!(s.0), lp["tokens"]);
    assert_eq!(json!(s.1), lp["token_logprobs"]);
    assert_eq!(json!(s.2), lp["top_logprobs"]);
    assert_eq!(json!(s.3), lp["text_offset"]);
    for n in noise {
        assert_eq!(n.join().unwrap(), 200);
    }
    // Without the field: null, as before.
    let plain = post(addr, "/v1/completions", &json!({"prompt": [5], "max_tokens": 2})).json();
    assert!(plain["choices"][0]["logprobs"].is_null());
    let (code, err) = server.stop_with(libc::SIGTERM);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn serve_chat_logprobs_cover_every_generated_token_streamed_and_not() {
    let server = Server::start(&[]);
    let addr = &server.addr;
    let body = json!({
        "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 10, "temperature": 0,
        "ignore_eos": true, "logprobs": true, "top_logprobs": 2,
    });
    let r = post(addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap().clone();
    assert_eq!(content.len() as u64, v["usage"]["completion_tokens"].as_u64().unwrap());
    for e in &content {
        assert!(e["token"].is_string() && e["bytes"].is_array(), "{e}");
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!(top[0]["logprob"], e["logprob"], "greedy: the chosen token is the likeliest");
        assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
        let bytes: Vec<u8> = e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
        assert_eq!(String::from_utf8_lossy(&bytes), e["token"].as_str().unwrap());
    }
    let mut streamed = Vec::new();
    for c in chunks(addr, "/v1/chat/completions", &body) {
        if let Some(list) = c["choices"][0]["logprobs"]["content"].as_array() {
            streamed.extend(list.clone());
        }
    }
    assert_eq!(streamed, content);
    // logprobs false: none; top_logprobs 0: the tokens without alternatives.
    let off =
        post(addr, "/v1/chat/completions", &json!({"messages": body["messages"], "max_tokens": 2, "logprobs": false}));
    assert!(off.json()["choices"][0]["logprobs"].is_null(), "{}", off.body);
    let zero = json!({"messages": body["messages"], "max_tokens": 2, "logprobs": true, "top_logprobs": 0});
    let zero = post(addr, "/v1/chat/completions", &zero).json();
    assert!(zero["choices"][0]["logprobs"]["content"][0]["top_logprobs"].as_array().unwrap().is_empty());
    let (code, err) = server.stop_with(libc::SIGTERM);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn serve_refuses_logprobs_out_of_range_naming_the_field() {
    let server = Server::start(&[]);
    let addr = &server.addr;
    let msgs = json!([{"role": "user", "content": "Hi"}]);
    for (path, body, param) in [
        ("/v1/completions", json!({"prompt": "a", "logprobs": 6}), "logprobs"),
        ("/v1/completions", json!({"prompt": "a", "logprobs": -1}), "logprobs"),
        ("/v1/completions", json!({"prompt": "a", "top_logprobs": 2}), "top_logprobs"),
        ("/v1/chat/completions", json!({"messages": msgs, "logprobs": true, "top_logprobs": 21}), "top_logprobs"),
        ("/v1/chat/completions", json!({"messages": msgs, "top_logprobs": 2}), "top_logprobs"),
        ("/v1/chat/completions", json!({"messages": msgs, "logprobs": 2}), "logprobs"),
    ] {
        let r = post(addr, path, &body);
        assert_eq!(r.status, 400, "{body}: {}", r.body);
        assert_eq!(r.json()["error"]["param"], param, "{body}: {}", r.body);
    }
    let (code, err) = server.stop_with(libc::SIGTERM);
    assert_eq!(code, 0, "{err}");
}

/// `echo` with `logprobs` and `max_tokens` 0, as evaluation harnesses score a text: the text is
/// the prompt, the first token has no log-probability and each later one is the same number a
/// greedy completion of the shorter prompt gave it; `echo` without `logprobs` only puts the
/// prompt's text first; a streamed `echo` is refused.
#[test]
fn serve_echo_scores_the_prompt_as_generation_did() {
    let server = Server::start(&[]);
    let addr = &server.addr;
    let prompt = [5u32, 17, 300];
    let gen = post(
        addr,
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true, "logprobs": 2}),
    );
    assert_eq!(gen.status, 200, "{}", gen.body);
    let g = gen.json();
    let generated = ids(&g["choices"][0]["token_ids"]);
    let full: Vec<u32> = prompt.iter().copied().chain(generated.iter().copied()).collect();
    let scored = post(addr, "/v1/completions", &json!({"prompt": full, "max_tokens": 0, "echo": true, "logprobs": 2}));
    assert_eq!(scored.status, 200, "{}", scored.body);
    let s = scored.json();
    let lp = &s["choices"][0]["logprobs"];
    let values = lp["token_logprobs"].as_array().unwrap();
    assert_eq!(values.len(), full.len());
    assert!(values[0].is_null() && lp["top_logprobs"][0].is_null());
    assert_eq!(&values[prompt.len()..], &g["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap()[..]);
    assert_eq!(s["usage"]["completion_tokens"], 0);
    assert_eq!(s["usage"]["prompt_tokens"], full.len());
    assert_eq!(lp["tokens"].as_array().unwrap().len(), full.len());
    // A text prompt comes back as given, then the completion.
    let text = post(addr, "/v1/completions", &json!({"prompt": "Hello world", "max_tokens": 3, "echo": true})).json();
    assert!(text["choices"][0]["text"].as_str().unwrap().starts_with("Hello world"), "{text}");
    assert!(text["choices"][0]["logprobs"].is_null());
    let r = post(addr, "/v1/completions", &json!({"prompt": "a", "echo": true, "stream": true}));
    assert_eq!(r.status, 400, "{}", r.body);
    assert_eq!(r.json()["error"]["param"], "echo");
    let (code, err) = server.stop_with(libc::SIGTERM);
    assert_eq!(code, 0, "{err}");
}
