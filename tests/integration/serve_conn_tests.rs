//! `k3ring serve`'s per-connection limits, driven by misbehaving clients on raw sockets: a
//! slowloris (heads trickled a line at a time) and sockets that never speak lose their
//! connections within `--header-timeout` while a normal client gets served; an idle keep-alive
//! connection is closed after `--idle-timeout`; a late body gets 408 after `--body-timeout`; the
//! last request `--max-requests-per-connection` allows closes its connection; a request already
//! admitted runs to its end past every timeout. `/metrics` counts each reason.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::serve_tests::{connect, metric, parse_reply, post, request, send_request, wait_until, Server};

fn closed(addr: &str, reason: &str) -> f64 {
    metric(addr, &format!("k3ring_connections_closed_total{{reason=\"{reason}\"}}"))
}

/// Reads until the server closes the socket (EOF or reset): what it sent, and when it closed.
fn read_until_closed(s: &mut TcpStream, limit: Duration) -> (Vec<u8>, Instant) {
    s.set_read_timeout(Some(limit)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return (got, Instant::now()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                panic!("the server kept the connection open for {limit:?}: {}", String::from_utf8_lossy(&got))
            }
            Err(_) => return (got, Instant::now()),
        }
    }
}

/// One keep-alive request's reply: head and a `content-length` body, leaving the socket open.
fn read_one_reply(s: &mut TcpStream) -> crate::serve_tests::Reply {
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).unwrap();
        assert!(n > 0, "closed mid-reply: {}", String::from_utf8_lossy(&raw));
        raw.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&raw).into_owned();
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len: usize = head
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse().unwrap()))
                .expect("a content-length");
            if body.len() >= len {
                return parse_reply(&raw);
            }
        }
    }
}

fn keep_alive_get(s: &mut TcpStream, path: &str) {
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").as_bytes()).unwrap();
}

/// Four slowloris sockets take every connection of `--max-connections 4`; each is closed once
/// its head has taken `--header-timeout`, and a normal client is served then, long before a
/// trickle of this pace would have ended (over 70 s used to pass with every client refused).
#[test]
fn serve_slowloris_sockets_lose_their_connections_not_the_server() {
    let server = Server::start(&["--max-connections", "4", "--header-timeout", "1.5"]);
    let addr = server.addr.clone();
    let started = Instant::now();
    let trickles: Vec<_> = (0..4)
        .map(|i| {
            let addr = addr.clone();
            std::thread::spawn(move || {
                let mut s = connect(&addr);
                let opened = Instant::now();
                let mut reader = s.try_clone().unwrap();
                let watcher = std::thread::spawn(move || read_until_closed(&mut reader, Duration::from_secs(30)));
                let head = format!("POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow-{i}: a\r\n");
                for line in head.split_inclusive("\r\n").chain(std::iter::repeat_n("X-More: b\r\n", 200)) {
                    if s.write_all(line.as_bytes()).is_err() || watcher.is_finished() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(250));
                }
                let (got, at) = watcher.join().unwrap();
                (at - opened, got)
            })
        })
        .collect();
    // Once the trickles hold every connection (they connect at once) a normal client is
    // refused; it keeps trying and is served once they are cut off.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(request(&addr, "GET", "/health", &[], b"").status, 503, "the trickles hold every connection");
    wait_until("a served request", || request(&addr, "GET", "/health", &[], b"").status == 200);
    let served_after = started.elapsed();
    let r = post(&addr, "/v1/completions", &json!({"prompt": "hi", "max_tokens": 2}));
    assert_eq!(r.status, 200, "{}", r.body);
    for t in trickles {
        let (lived, got) = t.join().unwrap();
        // Closed without a reply, at the timeout (not before it), well before the trickle ended.
        assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
        assert!(lived >= Duration::from_millis(1400), "closed early: {lived:?}");
        assert!(lived < Duration::from_secs(10), "closed late: {lived:?}");
    }
    assert!(served_after < Duration::from_secs(15), "{served_after:?}");
    assert!(closed(&addr, "header_timeout") >= 4.0, "{}", request(&addr, "GET", "/metrics", &[], b"").body);
    let (code, err) = server.stop_with(libc::SIGTERM);
    assert_eq!(code, 0, "{err}");
}

/// A socket that connects and never speaks is closed at `--header-timeout`; a keep-alive
/// connection idle after its reply at `--idle-timeout` (not at the header timeout, which is
/// shorter here); a streamed request whose client reads slowly runs to its end past both.
#[test]
fn serve_idle_sockets_are_closed_and_admitted_requests_are_not() {
    let server = Server::start(&["--header-timeout", "1", "--idle-timeout", "2.5", "--max-tokens", "4000"]);
    let addr = server.addr.clone();
    let mut silent = connect(&addr);
    let opened = Instant::now();
    let (got, at) = read_until_closed(&mut silent, Duration::from_secs(20));
    assert!(got.is_empty());
    let lived = at - opened;
    assert!(lived >= Duration::from_millis(900) && lived < Duration::from_secs(8), "{lived:?}");

    let mut keep = connect(&addr);
    keep_alive_get(&mut keep, "/health");
    assert_eq!(read_one_reply(&mut keep).status, 200);
    let replied = Instant::now();
    keep_alive_get(&mut keep, "/v1/models");
    assert_eq!(read_one_reply(&mut keep).status, 200, "the connection was kept alive");
    let (got, at) = read_until_closed(&mut keep, Duration::from_secs(20));
    assert!(got.is_empty());
    let idle = at - replied;
    assert!(idle >= Duration::from_millis(2400) && idle < Duration::from_secs(10), "{idle:?}");

    // Admitted: the head and body arrived in time; the reply then takes as long as it takes.
    let body = json!({"prompt": "Hello", "max_tokens": 40, "ignore_eos": true, "temperature": 0, "stream": true});
    let mut s = connect(&addr);
    send_request(&mut s, "POST", "/v1/completions", &[], body.to_string().as_bytes());
    let mut first = [0u8; 16];
    s.read_exact(&mut first).unwrap();
    std::thread::sleep(Duration::from_millis(3500));
    let (rest, _) = read_until_closed(&mut s, Duration::from_secs(60));
    let all = [&first[..], &rest[..]].concat();
    let r = parse_reply(&all);
    assert_eq!(r.status, 200);
    let events = r.events();
    assert!(events.len() > 40, "{}", r.body);
    assert!(closed(&addr, "header_timeout") >= 1.0);
    assert!(closed(&addr, "idle_timeout") >= 1.0);
    let (code, err) = server.stop_with(libc::SIGTERM);
    assert_eq!(code, 0, "{err}");
}

/// A body that stops arriving is answered 408 at `--body-timeout`, in the API's error shape,
/// and its connection closed; the last request `--max-requests-per-connection` allows is
/// answered with `Connection: close` and the socket closed after it.
#[test]
fn serve_late_bodies_get_408_and_the_request_cap_closes_the_connection() {
    let server = Server::start(&["--body-timeout", "1", "--max-requests-per-connection", "2"]);
    let addr = server.addr.clone();
    let mut s = connect(&addr);
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        .unwrap();
    let sent = Instant::now();
    let (got, at) = read_until_closed(&mut s, Duration::from_secs(20));
    let r = parse_reply(&got);
    assert_eq!(r.status, 408, "{}", r.body);
    assert_eq!(r.json()["error"]["code"], "request_timeout");
    assert!(r.json()["error"]["message"].as_str().unwrap().contains("--body-timeout"), "{}", r.body);
    assert_eq!(r.header("connection"), Some("close"));
    let waited = at - sent;
    assert!(waited >= Duration::from_millis(900) && waited < Duration::from_secs(8), "{waited:?}");
    assert_eq!(closed(&addr, "body_timeout"), 1.0);

    let mut keep = connect(&addr);
    keep_alive_get(&mut keep, "/health");
    let first = read_one_reply(&mut keep);
    assert_eq!(first.status, 200);
    assert_eq!(first.header("connection"), None, "{:?}", first.headers);
    keep_alive_get(&mut keep, "/health");
    let second = read_one_reply(&mut keep);
    assert_eq!(second.status, 200);
    assert_eq!(second.header("connection"), Some("close"), "{:?}", second.headers);
    let (got, _) = read_until_closed(&mut keep, Duration::from_secs(10));
    assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
    assert_eq!(closed(&addr, "max_requests"), 1.0);
    let (code, err) = server.stop_with(libc::SIGTERM);
    assert_eq!(code, 0, "{err}");
}
