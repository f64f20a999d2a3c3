//! `k3ring serve` (issue 17), driven as a client would: the real binary on a loopback port picked
//! by the OS, a minimal HTTP/1.1 client on std's TcpStream. Tokens equal a solo run with the
//! same settings (greedy and seeded, streamed or not, alone or among 32 concurrent clients);
//! every limit answers with its status and the OpenAI error shape; a client that leaves
//! mid-stream frees its slot without disturbing the others; SIGTERM/SIGINT end the server
//! cleanly (exit 0) after the requests in flight. Every loop here is bounded in count and time.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k3ring::chat::template::{render, to_ids, Message, Specials, Thinking};
use k3ring::engine::{BatchRequest, BatchSink, Finished, GenerateOptions, Sampling, Ticket};
use kernels::Isa;
use serde_json::{json, Value};

use crate::common::*;

/// A running `k3ring serve`; killed if a test fails before stopping it.
pub struct Server {
    child: Child,
    pub addr: String,
    stderr: Arc<Mutex<String>>,
}

impl Server {
    /// Starts the server on the tiny model and waits (30 s at most) for its address.
    pub fn start(extra: &[&str]) -> Server {
        Server::start_on(&tiny_dir(), extra)
    }

    /// Starts the server on the model in `dir`.
    pub fn start_on(dir: &std::path::Path, extra: &[&str]) -> Server {
        let mut args = vec!["serve", "--model", dir.to_str().unwrap(), "--port", "0", "--threads", "1"];
        args.extend_from_slice(extra);
        let mut child = Command::new(env!("CARGO_BIN_EXE_k3ring"))
            .args(&args)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let pipe = child.stderr.take().unwrap();
        let sink = Arc::clone(&stderr);
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { break };
                if let Some(at) = line.find("listening on http://") {
                    let _ = tx.send(line[at + "listening on http://".len()..].trim().to_owned());
                }
                sink.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(addr) => addr,
            Err(_) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the server did not start: {}", stderr.lock().unwrap());
            }
        };
        Server { child, addr, stderr }
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// Sends `signal` and waits (30 s at most) for the exit code.
    pub fn stop_with(self, signal: i32) -> (i32, String) {
        let pid = self.child.id() as i32;
        // SAFETY: kill(2) on our own child's pid, with a valid signal number.
        unsafe { libc::kill(pid, signal) };
        self.wait_exit()
    }

    /// Waits (30 s at most) for the server to exit by itself: (exit code, stderr).
    pub fn wait_exit(mut self) -> (i32, String) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                std::thread::sleep(Duration::from_millis(50));
                return (status.code().unwrap_or(-1), self.stderr());
            }
            assert!(Instant::now() < deadline, "the server did not stop within 30 s: {}", self.stderr());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A response: status, headers (lowercase names) and body (de-chunked).
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.body))
    }

    /// The `data:` payloads of a server-sent event stream, checking its framing.
    pub fn events(&self) -> Vec<String> {
        assert_eq!(self.header("content-type"), Some("text/event-stream"), "{self:?}");
        assert!(self.body.ends_with("data: [DONE]\n\n"), "the stream does not end with [DONE]: {}", self.body);
        let mut out = Vec::new();
        for block in self.body.split("\n\n").filter(|b| !b.is_empty()) {
            let data = block.strip_prefix("data: ").unwrap_or_else(|| panic!("not a data event: {block:?}"));
            assert!(!data.contains('\n'), "one line per event: {block:?}");
            out.push(data.to_owned());
        }
        out
    }
}

pub fn connect(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s
}

pub fn send_request(s: &mut TcpStream, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n");
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    if method == "POST" {
        head.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    // The server may answer (413) and close before reading a large body.
    let _ = s.write_all(body);
}

pub fn parse_reply(raw: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(raw);
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no header end: {text:?}"));
    let mut lines = head.lines();
    let status = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let chunked = headers.iter().any(|(n, v)| n == "transfer-encoding" && v.contains("chunked"));
    let body = if chunked { dechunk(rest) } else { rest.to_owned() };
    Reply { status, headers, body }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap();
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
    out
}

/// One request on its own connection, read to the end.
pub fn request(addr: &str, method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Reply {
    let mut s = connect(addr);
    send_request(&mut s, method, path, headers, body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    parse_reply(&raw)
}

pub fn post(addr: &str, path: &str, body: &Value) -> Reply {
    request(addr, "POST", path, &[], body.to_string().as_bytes())
}

/// `k3ring run` on the tiny model: the generated ids.
fn solo_run(args: &[&str]) -> Vec<u32> {
    let json_path = tempfile::NamedTempFile::new().unwrap();
    let dir = tiny_dir();
    let mut all = vec!["run", "--model", dir.to_str().unwrap(), "--json", json_path.path().to_str().unwrap()];
    all.extend_from_slice(args);
    let (code, _, err) = k3ring_stdin(&all, "");
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_slice(&std::fs::read(json_path.path()).unwrap()).unwrap();
    ids(&v["generated_ids"])
}

/// A usage without `prompt_tokens_details`: a request sent again finds its prompt cached.
pub fn without_cache(usage: &Value) -> Value {
    let mut u = usage.clone();
    if let Some(o) = u.as_object_mut() {
        o.remove("prompt_tokens_details");
    }
    u
}

fn choice_ids(v: &Value) -> Vec<u32> {
    ids(&v["choices"][0]["token_ids"])
}

/// A non-streamed and a streamed completion, checked against each other and the SSE format;
/// returns the ids, the text and the finish reason.
fn completion_both_ways(addr: &str, body: Value) -> (Vec<u32>, String, String) {
    let whole = post(addr, "/v1/completions", &body);
    assert_eq!(whole.status, 200, "{}", whole.body);
    let w = whole.json();
    assert_eq!(w["object"], "text_completion");
    let text = w["choices"][0]["text"].as_str().unwrap().to_owned();
    let finish = w["choices"][0]["finish_reason"].as_str().unwrap().to_owned();
    let generated = choice_ids(&w);
    let usage = &w["usage"];
    assert_eq!(usage["completion_tokens"].as_u64().unwrap() as usize, generated.len());
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    );

    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let streamed = post(addr, "/v1/completions", &sbody);
    assert_eq!(streamed.status, 200, "{}", streamed.body);
    let events = streamed.events();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let (mut s_text, mut s_ids) = (String::new(), Vec::new());
    for c in &chunks {
        assert_eq!(c["object"], "text_completion");
        assert_eq!(c["id"], chunks[0]["id"], "one id for every chunk");
        s_text.push_str(c["choices"][0]["text"].as_str().unwrap());
        s_ids.extend(choice_ids(c));
    }
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"].as_str().unwrap(), finish);
    assert!(chunks[..chunks.len() - 1].iter().all(|c| c["choices"][0]["finish_reason"].is_null()));
    assert_eq!(without_cache(&last["usage"]), without_cache(usage), "the last chunk carries the usage");
    assert_eq!((&s_ids, &s_text), (&generated, &text), "streamed and whole responses differ");
    (generated, text, finish)
}

#[test]
fn serve_batcher_cancel_frees_the_slot_and_leaves_the_others_alone() {
    #[derive(Default)]
    struct Collect(std::collections::HashMap<Ticket, Vec<u32>>, Vec<Ticket>);
    impl BatchSink for Collect {
        fn token(&mut self, t: Ticket, id: u32) -> bool {
            self.0.entry(t).or_default().push(id);
            false
        }
        fn finished(&mut self, f: Finished) {
            self.1.push(f.ticket);
        }
    }
    let opened = open(&tiny_dir(), 1, Isa::Scalar);
    let engine = &opened.engine;
    let p = prompt();
    let req = |seed: u64, n: usize| BatchRequest {
        constraint: None,
        prompt: p[..n].to_vec(),
        max_tokens: 12,
        sampling: Sampling { temperature: 0.8, top_k: None, top_p: None, seed },
        stop_ids: Vec::new(),
        logprobs: None,
        prompt_logprobs: false,
    };
    let reqs = [req(1, 5), req(2, 7), req(3, 3), req(4, 6)];
    let opts = k3ring::engine::BatchOptions { max_batch: 2, prefill_chunk: 8, context: 64, draft: None };
    let mut b = engine.batcher(opts).unwrap();
    let tickets: Vec<Ticket> = reqs.iter().map(|r| b.submit(r.clone()).unwrap()).collect();
    let mut sink = Collect::default();
    for _ in 0..3 {
        b.step(&mut sink).unwrap();
    }
    assert_eq!((b.running(), b.queued()), (2, 2));
    // One running, one queued: both go, and the running one's slot takes the next request.
    assert!(b.cancel(tickets[0]));
    assert!(b.cancel(tickets[2]));
    assert!(!b.cancel(tickets[2]), "a ticket is cancelled once");
    assert!(!b.cancel(99));
    assert_eq!((b.running(), b.queued()), (1, 1));
    let mut steps = 0;
    while b.pending() > 0 {
        b.step(&mut sink).unwrap();
        steps += 1;
        assert!(steps < 200);
    }
    assert_eq!(b.running(), 0);
    sink.1.sort_unstable();
    assert_eq!(sink.1, vec![tickets[1], tickets[3]], "cancelled sequences are not reported finished");
    for i in [1, 3] {
        let r = &reqs[i];
        let opts = GenerateOptions { gen: r.max_tokens, sampling: r.sampling.clone(), ..GenerateOptions::default() };
        let solo = engine.generate(&r.prompt, &opts, |_| {}).unwrap().generated_ids;
        assert_eq!(sink.0[&tickets[i]], solo, "request {i}");
    }
}

#[test]
fn serve_completions_equal_solo_runs_greedy_and_seeded() {
    let server = Server::start(&[]);
    let addr = &server.addr;
    let (greedy, _, _) = completion_both_ways(
        addr,
        json!({"model": "tiny-k3", "prompt": "Hello world", "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(greedy, solo_run(&["--prompt", "Hello world", "--gen", "12"]));
    let (seeded, _, finish) = completion_both_ways(
        addr,
        json!({"prompt": "Once upon", "max_tokens": 10, "temperature": 0.9, "top_p": 0.95, "seed": 7}),
    );
    assert_eq!(finish, "length");
    assert_eq!(
        seeded,
        solo_run(&["--prompt", "Once upon", "--gen", "10", "--temperature", "0.9", "--top-p", "0.95", "--seed", "7"])
    );
    // Token ids as the prompt; top_k (an extension) too.
    let p: Vec<u32> = prompt()[..6].to_vec();
    let (by_ids, _, _) =
        completion_both_ways(addr, json!({"prompt": p, "max_tokens": 8, "temperature": 1.1, "top_k": 20, "seed": 3}));
    let list = p.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    assert_eq!(
        by_ids,
        solo_run(&["--ids", &list, "--gen", "8", "--temperature", "1.1", "--top-k", "20", "--seed", "3"])
    );
    // A stop string ends the text where it begins (the ids still hold the token that made it).
    let w = post(addr, "/v1/completions", &json!({"prompt": "Hello world", "max_tokens": 12, "temperature": 0})).json();
    let full = w["choices"][0]["text"].as_str().unwrap().to_owned();
    if let Some(stop) = full.chars().skip(3).take(1).next().filter(|c| c.is_ascii_alphanumeric()) {
        let r = post(
            addr,
            "/v1/completions",
            &json!({"prompt": "Hello world", "max_tokens": 12, "temperature": 0, "stop": stop.to_string()}),
        );
        let v = r.json();
        let text = v["choices"][0]["text"].as_str().unwrap();
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        assert!(full.starts_with(text) && !text.contains(stop), "{text:?} vs {full:?}");
    }
    // A long stop string that never matches holds back no text at the end.
    let body = json!({"prompt": "Hello world", "max_tokens": 12, "temperature": 0, "stop": ["\u{1}never matches"]});
    let (_, text, finish) = completion_both_ways(addr, body);
    assert_eq!((text.as_str(), finish.as_str()), (full.as_str(), w["choices"][0]["finish_reason"].as_str().unwrap()));
    let (code, err) = server.stop_with(libc::SIGTERM);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn serve_text_leaves_out_the_token_that_ended_the_sequence() {
    let server = Server::start(&[]);
    let addr = &server.addr;
    let tok = k3ring::tokenizer::Tokenizer::from_model_dir(&tiny_dir()).unwrap();
    let eos = tok.added_id("[EOS]").unwrap();
    // This prompt ends on [EOS] within 40 greedy tokens on the tiny model.
    let body = json!({"prompt": "p38", "max_tokens": 40, "temperature": 0});
    let (ids, text, finish) = completion_both_ways(addr, body.clone());
    assert_eq!((finish.as_str(), ids.last()), ("stop", Some(&eos)), "{ids:?}");
    assert!(!text.contains("[EOS]"), "{text:?}");
    // By default (skip_special_tokens) no special token's text is in the reply.
    let ordinary = |ids: &[u32]| -> Vec<u32> { ids.iter().copied().filter(|&id| !tok.is_special(id)).collect() };
    assert_eq!(text, tok.decode(&ordinary(&ids[..ids.len() - 1])).unwrap(), "every other id's text");
    let ended_at = ids.len();
    // With ignore_eos the end-of-sequence id is an ordinary token: greedy decoding repeats the
    // same ids up to it, so it is there at the same place; its text shows with
    // skip_special_tokens false, as every special token's does.
    let mut through = body.clone();
    through["ignore_eos"] = json!(true);
    let (ids, text, _) = completion_both_ways(addr, through.clone());
    assert_eq!(ids.get(ended_at - 1), Some(&eos), "{ids:?}");
    assert_eq!(text, tok.decode(&ordinary(&ids)).unwrap());
    through["skip_special_tokens"] = json!(false);
    let (shown_ids, shown, _) = completion_both_ways(addr, through);
    assert_eq!(shown_ids, ids);
    assert!(shown.contains("[EOS]"), "{shown:?}");
    assert_eq!(shown, tok.decode(&ids).unwrap());
    drop(server);
}

/// The rendered chat prompt, as the server renders it.
fn chat_prompt(messages: &[Message], thinking: Thinking) -> Vec<u32> {
    let opened = open(&tiny_dir(), 1, Isa::Scalar);
    let sp = Specials::of(&opened.tokenizer).unwrap();
    to_ids(&render(messages, thinking, true).unwrap(), &opened.tokenizer, &sp).unwrap()
}

#[test]
fn serve_chat_completions_render_the_template_and_equal_a_solo_run() {
    let server = Server::start(&[]);
    let addr = &server.addr;
    let messages = [Message::system("Be brief."), Message::user("Hello there")];
    for (thinking, effort) in [(true, "low"), (false, "high")] {
        let body = json!({
            "model": "tiny-k3",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
            "max_tokens": 10, "temperature": 0.7, "seed": 11, "thinking": thinking, "reasoning_effort": effort,
        });
        let r = post(addr, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        assert_eq!(v["object"], "chat.completion");
        let msg = &v["choices"][0]["message"];
        assert_eq!(msg["role"], "assistant");
        assert!(msg["content"].is_string());
        if !thinking {
            assert!(msg.get("reasoning_content").is_none(), "no reasoning with thinking off: {msg}");
        }
        let got = choice_ids(&v);
        let t = Thinking { enabled: thinking, effort: k3ring::chat::template::Effort::parse(effort).unwrap() };
        let p = chat_prompt(&messages, t);
        assert_eq!(v["usage"]["prompt_tokens"].as_u64().unwrap() as usize, p.len());
        let list = p.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
        let solo = solo_run(&["--ids", &list, "--gen", "10", "--temperature", "0.7", "--seed", "11"]);
        // The chat also stops on <|end_of_msg|> and where the reply breaks the template.
        assert_eq!(got[..], solo[..got.len()], "thinking {thinking}");
        if v["choices"][0]["finish_reason"] == "length" {
            assert_eq!(got, solo);
        }
        // Streamed: a role chunk first, then deltas; the same ids and text.
        let mut sbody = body.clone();
        sbody["stream"] = json!(true);
        let events = post(addr, "/v1/chat/completions", &sbody).events();
        let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
        assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
        let (mut content, mut reasoning, mut s_ids) = (String::new(), String::new(), Vec::new());
        for c in &chunks {
            assert_eq!(c["object"], "chat.completion.chunk");
            let d = &c["choices"][0]["delta"];
            content.push_str(d["content"].as_str().unwrap_or(""));
            reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
            s_ids.extend(choice_ids(c));
        }
        assert_eq!(s_ids, got);
        assert_eq!(content, msg["content"].as_str().unwrap());
        assert_eq!(reasoning, msg["reasoning_content"].as_str().unwrap_or(""));
        assert_eq!(without_cache(&chunks.last().unwrap()["usage"]), without_cache(&v["usage"]));
    }
    drop(server);
}

fn assert_error(r: &Reply, status: u16, what: &str) -> Value {
    assert_eq!(r.status, status, "{what}: {}", r.body);
    assert_eq!(r.header("content-type"), Some("application/json"), "{what}");
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{what}: {v}");
    assert!(e["type"].is_string(), "{what}: {v}");
    assert!(e.get("code").is_some(), "{what}: {v}");
    v
}

#[test]
fn serve_limits_and_errors_have_their_status_and_the_openai_shape() {
    let server = Server::start(&["--max-body", "2000", "--max-tokens", "50", "--context", "64"]);
    let addr = &server.addr;
    let big = json!({"prompt": "x".repeat(5000)});
    assert_error(&request(addr, "POST", "/v1/completions", &[], big.to_string().as_bytes()), 413, "oversized body");
    assert_error(&request(addr, "POST", "/v1/completions", &[], b"{\"prompt\": "), 400, "bad JSON");
    // A chunked body declares no length: the limit is found while reading it (413); a malformed
    // chunk is the client's error (400), not a body too large.
    let chunked = |body: &[u8]| {
        let mut s = connect(addr);
        let head = "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
                    Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n";
        s.write_all(head.as_bytes()).unwrap();
        let _ = s.write_all(body);
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        parse_reply(&raw)
    };
    let big_chunk = format!("{:x}\r\n{}\r\n0\r\n\r\n", 5000, "x".repeat(5000));
    assert_error(&chunked(big_chunk.as_bytes()), 413, "oversized chunked body");
    let v = assert_error(&chunked(b"ZZ\r\n{}\r\n0\r\n\r\n"), 400, "malformed chunk");
    assert!(v["error"]["message"].as_str().unwrap().contains("could not be read"), "{v}");
    assert_error(&request(addr, "POST", "/v1/chat/completions", &[], b"[1, 2]"), 400, "not an object");
    let v =
        assert_error(&post(addr, "/v1/completions", &json!({"model": "gpt-4", "prompt": "hi"})), 404, "unknown model");
    assert_eq!(v["error"]["code"], "model_not_found");
    let v = assert_error(&post(addr, "/v1/completions", &json!({"prompt": "hi", "n": 2})), 400, "n = 2");
    assert_eq!(v["error"]["param"], "n");
    assert_error(
        &post(addr, "/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "a"}], "n": 3})),
        400,
        "chat n = 3",
    );
    let v =
        assert_error(&post(addr, "/v1/completions", &json!({"prompt": "hi", "max_tokens": 51})), 400, "over the cap");
    assert!(v["error"]["message"].as_str().unwrap().contains("50"), "{v}");
    let long: Vec<u32> = (0..70).map(|i| 10 + i).collect();
    let v =
        assert_error(&post(addr, "/v1/completions", &json!({"prompt": long, "max_tokens": 5})), 400, "prompt too long");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("70") && m.contains("64"), "the numbers are in the message: {m}");
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    let p: Vec<u32> = (0..60).map(|i| 10 + i).collect();
    let v = assert_error(
        &post(addr, "/v1/completions", &json!({"prompt": p, "max_tokens": 10})),
        400,
        "prompt + max_tokens too long",
    );
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("60") && m.contains("70") && m.contains("64"), "{m}");
    // Without max_tokens, the room left is the limit: 4 tokens.
    let r = post(addr, "/v1/completions", &json!({"prompt": p, "temperature": 0, "ignore_eos": true}));
    assert_eq!(r.json()["usage"]["completion_tokens"], 4, "{}", r.body);
    assert_error(&post(addr, "/v1/completions", &json!({"prompt": [999999]})), 400, "token outside the vocabulary");
    assert_error(&post(addr, "/v1/completions", &json!({"prompt": ""})), 400, "empty prompt");
    assert_error(&post(addr, "/v1/completions", &json!({"prompt": "a", "temperature": -1})), 400, "temperature");
    assert_error(&post(addr, "/v1/completions", &json!({"prompt": "a", "logprobs": 6})), 400, "logprobs");
    assert_error(&post(addr, "/v1/chat/completions", &json!({"messages": []})), 400, "no messages");
    assert_error(
        &post(addr, "/v1/chat/completions", &json!({"messages": [{"role": "assistant", "content": "a"}]})),
        400,
        "order",
    );
    assert_error(&request(addr, "GET", "/v1/nothing", &[], b""), 404, "unknown path");
    assert_error(&request(addr, "GET", "/v1/completions", &[], b""), 405, "wrong method");
    // The server is still fine, and counted what it answered.
    assert_eq!(request(addr, "GET", "/health", &[], b"").status, 200);
    let m = request(addr, "GET", "/metrics", &[], b"");
    assert!(m.header("content-type").unwrap().starts_with("text/plain"));
    assert!(m.body.contains("k3ring_requests_total{endpoint=\"completions\",status=\"400\"}"), "{}", m.body);
    for name in [
        "k3ring_queue_length",
        "k3ring_active_sequences",
        "k3ring_generated_tokens_total",
        "k3ring_tokens_per_second",
        "k3ring_bytes_read_total",
        "k3ring_read_bytes_per_second",
    ] {
        assert!(m.body.contains(&format!("\n{name} ")), "{name} missing: {}", m.body);
    }
    let (code, err) = server.stop_with(libc::SIGINT);
    assert_eq!(code, 0, "SIGINT ends the server cleanly: {err}");
}

#[test]
fn serve_api_key_is_required_on_every_endpoint() {
    // /health answers without the key by default (load balancers probe it without one).
    let open = Server::start(&["--api-key", "sekrit"]);
    let health = request(&open.addr, "GET", "/health", &[], b"");
    assert_eq!((health.status, health.json()["status"].clone()), (200, json!("ok")), "{}", health.body);
    assert_error(&request(&open.addr, "GET", "/metrics", &[], b""), 401, "/metrics");
    drop(open);
    let server = Server::start(&["--api-key", "sekrit", "--health-needs-key"]);
    let addr = &server.addr;
    let body = json!({"prompt": "hi", "max_tokens": 2}).to_string();
    for (method, path) in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/health"), ("GET", "/metrics")]
    {
        let body = if method == "POST" { body.as_bytes() } else { b"" };
        let v = assert_error(&request(addr, method, path, &[], body), 401, path);
        assert_eq!(v["error"]["code"], "invalid_api_key");
        assert_error(&request(addr, method, path, &[("Authorization", "Bearer wrong")], body), 401, path);
        assert_error(&request(addr, method, path, &[("Authorization", "Bearer sekri")], body), 401, path);
        assert_error(&request(addr, method, path, &[("Authorization", "Basic sekrit")], body), 401, path);
        // The scheme is case-insensitive.
        for scheme in ["Bearer", "bearer", "BEARER"] {
            let ok = request(addr, method, path, &[("Authorization", &format!("{scheme} sekrit"))], body);
            assert_eq!(ok.status, 200, "{path} {scheme}: {}", ok.body);
        }
    }
    assert!(!server.stderr().contains("warning"), "no warning on loopback: {}", server.stderr());
    drop(server);
}

#[test]
fn serve_warns_on_a_non_loopback_address_without_a_key() {
    let server = Server::start(&["--host", "0.0.0.0"]);
    assert!(server.stderr().contains("without --api-key"), "{}", server.stderr());
    let (code, err) = server.stop_with(libc::SIGTERM);
    assert_eq!(code, 0, "{err}");
}

/// Flags a server cannot honour are refused before it binds, naming the flag (exit 2).
#[test]
fn serve_refuses_trace_flags_and_bad_limits_at_start() {
    let trunk = pack(&tiny_dir());
    let model = tiny_dir();
    let (model, trunk) = (model.to_str().unwrap(), trunk.path().to_str().unwrap());
    for (args, says) in [
        (&["--trace", "/tmp/k3ring-serve.trace"][..], "--trace"),
        (&["--dump-trace", "/tmp/k3ring-serve.routing"][..], "--dump-trace"),
        (&["--grace", "-1"][..], "--grace"),
        (&["--max-tokens", "0"][..], "--max-tokens"),
        (&["--max-connections", "0"][..], "--max-connections"),
        (&["--header-timeout", "0"][..], "--header-timeout"),
        (&["--body-timeout", "-1"][..], "--body-timeout"),
        (&["--idle-timeout", "inf"][..], "--idle-timeout"),
        (&["--max-requests-per-connection", "0"][..], "--max-requests-per-connection"),
        (&["--draft-sequences", "0"][..], "--draft-sequences"),
    ] {
        let all = [&["serve", "--model", model, "--trunk", trunk, "--mem-gb", "1", "--port", "0"][..], args].concat();
        let (code, _, err) = k3ring_stdin(&all, "");
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    // Nor does its help offer them (run's does).
    let (code, help, _) = k3ring_stdin(&["serve", "--help"], "");
    assert_eq!(code, 0);
    assert!(
        help.contains("--max-connections") && !help.contains("--trace") && !help.contains("--dump-trace"),
        "{help}"
    );
    let (_, help, _) = k3ring_stdin(&["run", "--help"], "");
    assert!(help.contains("--trace <FILE>") && help.contains("--dump-trace <FILE>"), "{help}");
}

/// A streamed request whose first event has arrived, still open.
fn open_stream(addr: &str, body: &Value) -> (TcpStream, String) {
    let mut s = connect(addr);
    send_request(&mut s, "POST", "/v1/completions", &[], body.to_string().as_bytes());
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("data: ") {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "closed before the first event: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    (s, String::from_utf8_lossy(&seen).into_owned())
}

pub fn metric(addr: &str, name: &str) -> f64 {
    let m = request(addr, "GET", "/metrics", &[], b"").body;
    let line = m.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{name}: {m}"));
    line.rsplit_once(' ').unwrap().1.parse().unwrap()
}

pub fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn serve_full_queue_gets_429_and_a_disconnect_frees_the_slot() {
    let server = Server::start(&["--max-batch", "1", "--max-queue", "1", "--max-tokens", "4000"]);
    let addr = &server.addr;
    let long = json!({"prompt": "Hello", "max_tokens": 3000, "ignore_eos": true, "temperature": 0, "stream": true});
    let (a, _) = open_stream(addr, &long);
    // B waits in the queue: its headers come once it is accepted, its first event once it runs.
    let mut b = connect(addr);
    send_request(&mut b, "POST", "/v1/completions", &[], long.to_string().as_bytes());
    wait_until("B queued", || metric(addr, "k3ring_queue_length") == 1.0);
    let r = post(addr, "/v1/completions", &json!({"prompt": "hi", "max_tokens": 2}));
    let v = assert_error(&r, 429, "queue full");
    assert_eq!(v["error"]["code"], "queue_full");
    assert!(r.header("retry-after").is_some_and(|s| s.parse::<u64>().is_ok()), "{:?}", r.headers);
    assert_eq!(request(addr, "GET", "/health", &[], b"").status, 200, "health answers while full");
    // A full server answers 429 before reading the body: this request announces one and never
    // sends it, and still gets its answer.
    let mut c = connect(addr);
    c.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n",
    )
    .unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut head = [0u8; 64];
    let n = c.read(&mut head).unwrap();
    let head = String::from_utf8_lossy(&head[..n]);
    assert!(head.starts_with("HTTP/1.1 429"), "{head}");
    drop(c);
    // A leaves mid-stream: its slot goes to B at the next step.
    drop(a);
    wait_until("B running", || metric(addr, "k3ring_queue_length") == 0.0);
    drop(b);
    wait_until("both cancelled", || metric(addr, "k3ring_cancelled_total") == 2.0);
    assert_eq!(metric(addr, "k3ring_active_sequences"), 0.0);
    let r = post(addr, "/v1/completions", &json!({"prompt": "hi", "max_tokens": 2}));
    assert_eq!(r.status, 200, "{}", r.body);
    let (code, err) = server.stop_with(libc::SIGTERM);
    assert_eq!(code, 0, "{err}");
}

/// `--max-connections 2`: with two connections open (idle), a third is answered 503 in the
/// API's error shape and closed; once one closes, requests are served again, and the metrics
/// count the refusal.
#[test]
fn serve_connections_beyond_the_cap_get_503_and_a_close_frees_one() {
    let server = Server::start(&["--max-connections", "2"]);
    let addr = &server.addr;
    let idle_a = connect(addr);
    let idle_b = connect(addr);
    // The server accepts connections in order: the third is past the cap once both are in.
    let mut raw = Vec::new();
    wait_until("a 503 for a third connection", || {
        let mut third = connect(addr);
        send_request(&mut third, "GET", "/health", &[], b"");
        raw.clear();
        let _ = third.read_to_end(&mut raw);
        raw.starts_with(b"HTTP/1.1 503")
    });
    let r = parse_reply(&raw);
    let v = assert_error(&r, 503, "too many connections");
    assert_eq!(v["error"]["code"], "too_many_connections");
    assert!(v["error"]["message"].as_str().unwrap().contains("--max-connections"), "{v}");
    assert_eq!(r.header("retry-after"), Some("1"));
    drop(idle_a);
    // A closed connection's permit returns: a request gets through again.
    wait_until("a served request", || request(addr, "GET", "/health", &[], b"").status == 200);
    let r = post(addr, "/v1/completions", &json!({"prompt": "hi", "max_tokens": 2}));
    assert_eq!(r.status, 200, "{}", r.body);
    // Served connections close with their reply; then idle_b and the metrics request are open.
    wait_until("the metrics", || {
        let m = request(addr, "GET", "/metrics", &[], b"");
        m.status == 200
            && m.body.lines().any(|l| l == "k3ring_open_connections 2")
            && m.body.lines().any(|l| l.starts_with("k3ring_refused_connections_total ") && !l.ends_with(" 0"))
    });
    drop(idle_b);
    let (code, err) = server.stop_with(libc::SIGTERM);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn serve_sigterm_lets_the_requests_in_flight_finish() {
    let server = Server::start(&[]);
    let addr = server.addr.clone();
    let body = json!({"prompt": "Hello", "max_tokens": 200, "ignore_eos": true, "temperature": 0, "stream": true});
    let (mut s, mut seen) = open_stream(&addr, &body);
    let stopper = std::thread::spawn(move || server.stop_with(libc::SIGTERM));
    let mut rest = String::new();
    s.read_to_string(&mut rest).unwrap();
    seen.push_str(&rest);
    assert!(seen.contains("data: [DONE]\n\n") && seen.ends_with("0\r\n\r\n"), "the stream finished: {seen}");
    assert!(seen.contains("\"finish_reason\":\"length\""), "{seen}");
    let (code, err) = stopper.join().unwrap();
    assert_eq!(code, 0, "{err}");
    assert!(TcpStream::connect(&addr).is_err(), "the listener is closed");
}

#[test]
fn serve_32_concurrent_clients_each_equal_their_solo_run() {
    let server = Server::start(&["--max-batch", "8"]);
    let addr = server.addr.clone();
    // The server's kernels (--isa auto), so the solo runs round as it does.
    let opened = open(&tiny_dir(), 1, kernels::Kernels::detect().isa());
    let tok = &opened.tokenizer;
    let cfg = &opened.engine.model.cfg;
    let stop_ids: Vec<u32> = [cfg.eos_token_id].into_iter().chain(tok.added_id("[EOS]")).collect();
    let words = ["Hello", "Once upon a time", "The sky", "k3ring", "Numbers: 1 2 3", "Why", "A B C D E F"];
    let bodies: Vec<Value> = (0..32)
        .map(|i| {
            let mut b = json!({"prompt": words[i % words.len()], "max_tokens": 6 + (i * 5) % 25, "stream": i % 2 == 1});
            if i % 3 == 0 {
                b["temperature"] = json!(0);
            } else {
                b["temperature"] = json!(0.8);
                b["seed"] = json!(i);
            }
            b
        })
        .collect();
    let solo: Vec<Vec<u32>> = bodies
        .iter()
        .map(|b| {
            let prompt = tok.encode_with_added(b["prompt"].as_str().unwrap()).unwrap();
            let opts = GenerateOptions {
                gen: b["max_tokens"].as_u64().unwrap() as usize,
                sampling: Sampling {
                    temperature: b["temperature"].as_f64().unwrap() as f32,
                    top_k: None,
                    top_p: None,
                    seed: b["seed"].as_u64().unwrap_or(0),
                },
                stop_ids: stop_ids.clone(),
                ..GenerateOptions::default()
            };
            opened.engine.generate(&prompt, &opts, |_| {}).unwrap().generated_ids
        })
        .collect();
    // One more client leaves mid-stream; a health checker polls throughout.
    let quitter = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            let body =
                json!({"prompt": "Hello", "max_tokens": 1000, "ignore_eos": true, "temperature": 0, "stream": true});
            let (s, _) = open_stream(&addr, &body);
            std::thread::sleep(Duration::from_millis(100));
            drop(s);
        })
    };
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let health = {
        let (addr, done) = (addr.clone(), Arc::clone(&done));
        std::thread::spawn(move || {
            let mut answered = 0;
            for _ in 0..500 {
                if done.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                let t = Instant::now();
                assert_eq!(request(&addr, "GET", "/health", &[], b"").status, 200);
                assert!(t.elapsed() < Duration::from_secs(2), "health took {:?} under load", t.elapsed());
                answered += 1;
                std::thread::sleep(Duration::from_millis(25));
            }
            answered
        })
    };
    let clients: Vec<_> = bodies
        .into_iter()
        .enumerate()
        .map(|(i, body)| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(15 * i as u64));
                let r = post(&addr, "/v1/completions", &body);
                assert_eq!(r.status, 200, "client {i}: {}", r.body);
                if body["stream"] == true {
                    let events = r.events();
                    events[..events.len() - 1]
                        .iter()
                        .flat_map(|e| choice_ids(&serde_json::from_str::<Value>(e).unwrap()))
                        .collect::<Vec<u32>>()
                } else {
                    choice_ids(&r.json())
                }
            })
        })
        .collect();
    let started = Instant::now();
    for (i, c) in clients.into_iter().enumerate() {
        assert_eq!(c.join().unwrap(), solo[i], "client {i}");
    }
    assert!(started.elapsed() < Duration::from_secs(60));
    quitter.join().unwrap();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(health.join().unwrap() > 0);
    wait_until("the quitter cancelled", || metric(&addr, "k3ring_cancelled_total") == 1.0);
    let (code, err) = server.stop_with(libc::SIGTERM);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn serve_streams_from_a_trunk_pack_with_the_storage_metrics() {
    let trunk = pack(&tiny_dir());
    let t = trunk.path().to_str().unwrap();
    let server = Server::start(&["--trunk", t, "--mem-gb", "1", "--max-batch", "2", "--context", "64"]);
    let addr = &server.addr;
    let (streamed, _, _) =
        completion_both_ways(addr, json!({"prompt": "Hello world", "max_tokens": 12, "temperature": 0}));
    assert_eq!(streamed, solo_run(&["--prompt", "Hello world", "--gen", "12"]), "streamed weights, same tokens");
    wait_until("bytes read in the metrics", || metric(addr, "k3ring_bytes_read_total") > 0.0);
    let hits = metric(addr, "k3ring_expert_hit_ratio");
    assert!((0.0..=1.0).contains(&hits), "{hits}");
    let (code, err) = server.stop_with(libc::SIGTERM);
    assert_eq!(code, 0, "{err}");
}

/// Drafting in the server (issue 30), on by default: greedy requests draft, sampled ones do
/// not, every reply equals its plain solo run, and the usage and `/metrics` say what was
/// guessed and kept.
#[test]
fn serve_drafts_greedy_requests_and_reports_them() {
    let server = Server::start(&["--ngram-min", "1"]);
    let addr = &server.addr;
    // The tiny model's greedy text after this prompt repeats earlier tokens, so guesses are made.
    let prompt: Vec<u32> = (0..24u32).map(|i| i % 4 + 1).collect();
    let body = json!({"prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": true});
    let (greedy, _, _) = completion_both_ways(addr, body.clone());
    let list = prompt.iter().map(u32::to_string).collect::<Vec<_>>().join(",");
    assert_eq!(greedy, solo_run(&["--ids", &list, "--gen", "20", "--ignore-eos", "--no-draft"]));
    let usage = &post(addr, "/v1/completions", &body).json()["usage"];
    let details = &usage["completion_tokens_details"];
    let (kept, steps) =
        (details["accepted_prediction_tokens"].as_u64().unwrap(), details["decode_steps"].as_u64().unwrap());
    assert!(details["rejected_prediction_tokens"].is_u64(), "{usage}");
    assert_eq!(steps + kept, greedy.len() as u64 - 1, "{usage}");
    let (seeded, _, _) =
        completion_both_ways(addr, json!({"prompt": "Once upon", "max_tokens": 10, "temperature": 0.9, "seed": 7}));
    assert_eq!(seeded, solo_run(&["--prompt", "Once upon", "--gen", "10", "--temperature", "0.9", "--seed", "7"]));
    assert!(metric(addr, "k3ring_decode_steps_total") >= 2.0 * steps as f64);
    let guessed = metric(addr, "k3ring_draft_tokens_total");
    assert!(guessed > 0.0 && guessed >= metric(addr, "k3ring_draft_accepted_tokens_total"), "{guessed}");
    let (code, err) = server.stop_with(libc::SIGTERM);
    assert_eq!(code, 0, "{err}");
}

/// One line per request on stderr: method, path, status, tokens and time; a streamed request's
/// line comes when its stream ends; `--no-access-log` turns them off.
#[test]
fn serve_writes_an_access_log_line_per_request() {
    let server = Server::start(&[]);
    let addr = &server.addr;
    let body = json!({"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": true});
    assert_eq!(post(addr, "/v1/completions", &body).status, 200);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    assert_eq!(post(addr, "/v1/completions", &streamed).status, 200);
    assert_eq!(request(addr, "GET", "/nowhere", &[], b"").status, 404);
    let (code, err) = server.stop_with(libc::SIGTERM);
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> =
        err.lines().filter(|l| l.starts_with("k3ring: POST ") || l.starts_with("k3ring: GET ")).collect();
    assert_eq!(lines.len(), 3, "{err}");
    assert!(lines[0].starts_with("k3ring: POST /v1/completions 200 | 3 prompt + 4 completion tokens | "), "{err}");
    assert!(lines[0].ends_with(" s"), "{err}");
    assert!(lines[1].starts_with("k3ring: POST /v1/completions 200 | 3 prompt + 4 completion tokens | "), "{err}");
    assert!(lines[1].ends_with(" s | streamed"), "{err}");
    assert!(lines[2].starts_with("k3ring: GET /nowhere 404 | "), "{err}");
    let quiet = Server::start(&["--no-access-log"]);
    assert_eq!(post(&quiet.addr, "/v1/completions", &body).status, 200);
    let (code, err) = quiet.stop_with(libc::SIGTERM);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("k3ring: POST "), "{err}");
}
