//! Hostile inputs and outputs (issue 36): an output flag never replaces what is not a regular
//! file (a device node, a socket, a directory: refused; a FIFO: written in place) and follows a
//! symbolic link; every input read is
//! bounded (`/dev/zero` as each input is refused with a message, also in a 512 MiB cgroup); a
//! model file that is a FIFO is refused instead of blocking; a server whose expert is damaged
//! answers the request with a 500 and exits 3; a client that half-closes gets its answer.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::checkpoint_tests::copy_tiny;
use crate::common::*;
use crate::limits_tests::TestCgroup;
use crate::serve_tests::Server;

const BIN: &str = env!("CARGO_BIN_EXE_k3ring");

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Runs the binary with stdin from `stdin` (a path), killed after `secs`: (exit code, stdout,
/// stderr, seconds taken). Code -1 means it had to be killed.
fn run_bounded(args: &[&str], stdin: Option<&Path>, secs: u64) -> (i32, String, String, f64) {
    let start = Instant::now();
    let input = match stdin {
        Some(p) => Stdio::from(std::fs::File::open(p).unwrap()),
        None => Stdio::null(),
    };
    let child = Command::new(BIN)
        .args(args)
        .env_remove("RUST_LOG")
        .stdin(input)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (code, out, err) = wait_bounded(child, Duration::from_secs(secs));
    (code, out, err, start.elapsed().as_secs_f64())
}

/// The names and kinds of a directory's entries, to show a refusal changed nothing there.
fn listing(dir: &Path) -> Vec<(String, String)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let t = std::fs::symlink_metadata(e.path()).unwrap().file_type();
            let kind = if t.is_symlink() {
                "link"
            } else if t.is_fifo() {
                "fifo"
            } else if t.is_char_device() {
                "char"
            } else if t.is_socket() {
                "socket"
            } else if t.is_dir() {
                "dir"
            } else {
                "file"
            };
            (e.file_name().to_string_lossy().into_owned(), kind.to_owned())
        })
        .collect();
    v.sort();
    v
}

fn mkfifo(path: &Path) {
    assert!(Command::new("mkfifo").arg(path).status().unwrap().success());
}

/// A character device node like /dev/full (1, 7) in `dir`, where the test may make one (root);
/// `None` elsewhere.
fn full_device(dir: &Path) -> Option<PathBuf> {
    let path = dir.join("full");
    let ok = Command::new("mknod").arg(&path).args(["c", "1", "7"]).stderr(Stdio::null()).status().ok()?;
    (ok.success() && std::fs::metadata(&path).ok()?.file_type().is_char_device()).then_some(path)
}

fn run_tiny(extra: &[&str]) -> (i32, String, String, f64) {
    let tiny = tiny_dir();
    let args = [&["run", "--model", s(&tiny), "--prompt", "Once upon a time", "--gen", "2"][..], extra].concat();
    run_bounded(&args, None, 60)
}

#[test]
fn output_flags_refuse_what_is_not_a_regular_file_and_follow_links() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let socket = dir.join("socket");
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    std::fs::create_dir(dir.join("subdir")).unwrap();
    let mut nodes = vec![(socket.clone(), "a socket"), (dir.join("subdir"), "a directory")];
    match full_device(dir) {
        Some(dev) => nodes.push((dev, "a character device")),
        None => println!("no device node test: mknod needs root"),
    }
    let before = listing(dir);
    for (node, kind) in &nodes {
        for flag in ["--save-state", "--json", "--trace", "--logits", "--dump-trace"] {
            let mut extra = vec![flag, s(node)];
            if flag == "--trace" {
                extra.extend(["--trunk", "/nonexistent-trunk"]);
            }
            let (code, out, err, secs) = run_tiny(&extra);
            assert_eq!(code, 2, "{flag} {kind}: {err}");
            let want = format!("k3ring: error: {flag} {}: is {kind}; k3ring writes only regular files", node.display());
            assert!(err.contains(&want), "{flag} {kind}: {err}");
            assert!(out.is_empty() && secs < 30.0, "{flag}: refused before any work ({secs:.1} s)");
        }
    }
    // batch's --output too.
    let model = tiny_dir();
    for (node, kind) in &nodes {
        let args = ["batch", "--model", s(&model), "--input", "-", "--output", s(node)];
        let (code, _, err, _) = run_bounded(&args, Some(Path::new("/dev/null")), 60);
        assert_eq!(code, 2, "--output {kind}: {err}");
        assert!(err.contains(&format!("--output {}: is {kind}", node.display())), "{err}");
    }
    assert_eq!(listing(dir), before, "nothing in the directory changed");
    // chat's files, before the model is opened.
    let tiny = tiny_dir();
    for flag in ["--history", "--save-state"] {
        let (code, _, err, _) = run_bounded(&["chat", "--model", s(&tiny), flag, s(&socket)], None, 60);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains(&format!("{flag} {}: is a socket", socket.display())), "{err}");
    }
    assert_eq!(listing(dir), before);
    // A FIFO is written in place, as a shell's `>` would: its reader gets the report.
    let fifo = dir.join("fifo");
    mkfifo(&fifo);
    let reader = std::thread::spawn({
        let fifo = fifo.clone();
        move || std::fs::read(fifo).unwrap()
    });
    let (code, _, err, _) = run_tiny(&["--json", s(&fifo)]);
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value = serde_json::from_slice(&reader.join().unwrap()).unwrap();
    assert_eq!(report["generated_ids"].as_array().unwrap().len(), 2);
    assert!(std::fs::symlink_metadata(&fifo).unwrap().file_type().is_fifo(), "still a FIFO");
    // A file meant to be read back refuses a FIFO, at once (no reader is waited for).
    let (code, _, err, secs) = run_tiny(&["--save-state", s(&fifo)]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains(&format!("--save-state {}: is a FIFO", fifo.display())) && secs < 30.0, "{err}");
    // A pipe passed as /dev/fd/N (as `--json >(jq .)` does) is written in place.
    let script = r#"exec "$0" "$@" --json /dev/fd/3 3>&1 1>/dev/null"#;
    let out = Command::new("sh")
        .args(["-c", script, BIN, "run", "--model", s(&tiny), "--prompt", "Once upon a time", "--gen", "2"])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["generated_ids"].as_array().unwrap().len(), 2);
    // A link is followed: the state lands in its target, and the link stays a link.
    let target = dir.join("state.bin");
    let link = dir.join("state-link");
    std::os::unix::fs::symlink("state.bin", &link).unwrap();
    let (code, _, err, _) = run_tiny(&["--save-state", s(&link)]);
    assert_eq!(code, 0, "{err}");
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link is still a link");
    let saved = std::fs::read(&target).unwrap();
    assert_eq!(&saved[..8], b"K3RSTATE");
    // It loads through the link too, and nothing else appeared (no temporary file left).
    let (code, _, err, _) = run_bounded(
        &["run", "--model", s(&tiny), "--load-state", s(&link), "--prompt", " there", "--gen", "1"],
        None,
        60,
    );
    assert_eq!(code, 0, "{err}");
    let names: Vec<String> = listing(dir).into_iter().map(|(n, _)| n).collect();
    assert!(names.iter().all(|n| !n.contains(".tmp")), "{names:?}");
    // A regular file is replaced whole; its permissions stay.
    use std::os::unix::fs::PermissionsExt;
    let json = dir.join("report.json");
    std::fs::write(&json, "old").unwrap();
    std::fs::set_permissions(&json, std::fs::Permissions::from_mode(0o640)).unwrap();
    let (code, _, err, _) = run_tiny(&["--json", s(&json)]);
    assert_eq!(code, 0, "{err}");
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["generated_ids"].as_array().unwrap().len(), 2);
    assert_eq!(std::fs::metadata(&json).unwrap().permissions().mode() & 0o777, 0o640);
    // The documented in-place devices.
    let (code, out, err, _) = run_tiny(&["--json", "/dev/stdout"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("\"generated_ids\""), "{out}");
    let (code, _, err, _) = run_tiny(&["--json", "/dev/null"]);
    assert_eq!(code, 0, "{err}");
}

/// One input fed `/dev/zero`: (what, args, stdin, exit code, what the message says).
type ZeroInput = (&'static str, Vec<String>, Option<PathBuf>, i32, String);

/// Each input that used to be read whole, fed `/dev/zero`.
fn zero_inputs(model: &Path) -> Vec<ZeroInput> {
    let m = s(model).to_owned();
    let zero = PathBuf::from("/dev/zero");
    let args = |a: &[&str]| a.iter().map(|x| (*x).to_owned()).collect::<Vec<String>>();
    vec![
        (
            "--prompt-file /dev/zero",
            args(&["run", "--model", &m, "--prompt-file", "/dev/zero", "--gen", "1"]),
            None,
            2,
            "k3ring: error: --prompt-file /dev/zero: more than ".into(),
        ),
        (
            "--prompt-file /dev/urandom",
            args(&["run", "--model", &m, "--prompt-file", "/dev/urandom", "--gen", "1"]),
            None,
            2,
            "k3ring: error: --prompt-file /dev/urandom: more than ".into(),
        ),
        (
            "--prompt-file - from /dev/zero",
            args(&["run", "--model", &m, "--prompt-file", "-", "--gen", "1"]),
            Some(zero.clone()),
            2,
            "k3ring: error: --prompt-file -: more than ".into(),
        ),
        (
            "batch --input /dev/zero",
            args(&["batch", "--model", &m, "--input", "/dev/zero", "--output", "/dev/null"]),
            None,
            2,
            "k3ring: error: --input /dev/zero: line 1 is longer than ".into(),
        ),
        (
            "batch --input - from /dev/zero",
            args(&["batch", "--model", &m, "--input", "-", "--output", "/dev/null"]),
            Some(zero.clone()),
            2,
            "k3ring: error: --input -: line 1 is longer than ".into(),
        ),
        (
            "--load-state /dev/zero",
            args(&["run", "--model", &m, "--load-state", "/dev/zero", "--gen", "1"]),
            None,
            3,
            "/dev/zero: is a character device, not a regular file".into(),
        ),
        (
            "chat from /dev/zero",
            args(&["chat", "--model", &m]),
            Some(zero),
            2,
            "k3ring: error: stdin: line 1 is longer than ".into(),
        ),
        (
            "cache-sim /dev/zero",
            args(&["cache-sim", "/dev/zero"]),
            None,
            3,
            "k3ring: error: expert trace /dev/zero line 1: the line is longer than 1048576 bytes".into(),
        ),
    ]
}

#[test]
fn dev_zero_as_every_input_is_refused_with_a_message() {
    let tiny = tiny_dir();
    for (what, args, stdin, want_code, want) in zero_inputs(&tiny) {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, _, err, secs) = run_bounded(&args, stdin.as_deref(), 60);
        assert_eq!(code, want_code, "{what}: {err}");
        assert!(err.contains(&want), "{what}: {err}");
        assert!(secs < 30.0, "{what}: {secs:.1} s");
    }
}

/// The same inputs inside a 512 MiB memory cgroup: each is refused with its message, none is
/// killed by the OOM killer.
#[test]
fn dev_zero_inputs_fit_in_a_512_mib_cgroup() {
    let cg = match TestCgroup::create("zero-inputs", 512 << 20) {
        Ok(cg) => cg,
        Err(why) => {
            println!("SKIPPED dev_zero_inputs_fit_in_a_512_mib_cgroup: no writable memory cgroup ({why})");
            return;
        }
    };
    let tiny = tiny_dir();
    for (what, args, stdin, want_code, want) in zero_inputs(&tiny) {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, _, err) = cg.run_with_stdin(&args, stdin.as_deref());
        assert_eq!(code, want_code, "{what} in 512 MiB: {err}");
        assert!(err.contains(&want), "{what}: {err}");
    }
}

#[test]
fn a_state_file_is_checked_against_its_announced_size_before_it_is_read() {
    let tmp = tempfile::tempdir().unwrap();
    let tiny = tiny_dir();
    let state = tmp.path().join("s.bin");
    let (code, _, err, _) = run_tiny(&["--save-state", s(&state)]);
    assert_eq!(code, 0, "{err}");
    let mut bytes = std::fs::read(&state).unwrap();
    // A header that claims a terabyte: refused from the file's size, not by reading a terabyte.
    bytes[12..20].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&state, &bytes).unwrap();
    let (code, _, err, _) =
        run_bounded(&["run", "--model", s(&tiny), "--load-state", s(&state), "--gen", "1"], None, 60);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains(&format!("{} is truncated: {} bytes of the 1099511627776", state.display(), bytes.len())),
        "{err}"
    );
    let fifo = tmp.path().join("fifo");
    mkfifo(&fifo);
    let (code, _, err, secs) =
        run_bounded(&["run", "--model", s(&tiny), "--load-state", s(&fifo), "--gen", "1"], None, 60);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(&format!("{}: is a FIFO, not a regular file", fifo.display())) && secs < 30.0, "{err}");
}

#[test]
fn a_model_file_that_is_a_fifo_is_refused_instead_of_blocking() {
    // A socket cannot even be opened (ENXIO): it is refused by its type first.
    let (_tmp, model) = copy_tiny();
    let file = model.join("tiktoken.model");
    std::fs::remove_file(&file).unwrap();
    let _listener = std::os::unix::net::UnixListener::bind(&file).unwrap();
    let (code, _, err, _) = run_bounded(&["run", "--model", s(&model), "--prompt", "hi", "--gen", "1"], None, 60);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(&format!("{}: is a socket, not a regular file", file.display())), "{err}");
    for name in ["config.json", "model-00002-of-00003.safetensors", "model.safetensors.index.json", "tiktoken.model"] {
        let (_tmp, model) = copy_tiny();
        let file = model.join(name);
        assert!(file.exists(), "{name} is in the tiny model");
        std::fs::remove_file(&file).unwrap();
        mkfifo(&file);
        let (code, out, err, secs) =
            run_bounded(&["run", "--model", s(&model), "--prompt", "hi", "--gen", "1"], None, 60);
        assert_eq!(code, 3, "{name}: {err}");
        assert!(err.contains(&format!("{}: is a FIFO, not a regular file", file.display())), "{name}: {err}");
        assert!(out.is_empty() && secs < 30.0, "{name}: {secs:.1} s");
    }
    // The trunk pack's manifest too.
    let trunk = pack(&tiny_dir());
    let manifest = trunk.path().join("trunk.manifest.json");
    std::fs::remove_file(&manifest).unwrap();
    mkfifo(&manifest);
    let tiny = tiny_dir();
    let args = ["run", "--model", s(&tiny), "--trunk", s(trunk.path()), "--prompt", "hi", "--gen", "1"];
    let (code, _, err, _) = run_bounded(&args, None, 60);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(&format!("{}: is a FIFO, not a regular file", manifest.display())), "{err}");
}

fn flip(path: &Path, at: u64) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[at as usize] ^= 0x24;
    std::fs::write(path, bytes).unwrap();
}

/// Damages a byte of the packed weights of every expert (outside the fingerprint's samples).
fn damage_experts(model: &Path) {
    use k3ring::checkpoint::CheckpointIndex;
    use k3ring::storage::pack::fingerprint::sampled_windows;
    let index = CheckpointIndex::open(model).unwrap();
    let mut damaged = 0;
    for r in index.experts.iter() {
        let t = &index.tensors[r.parts[0]];
        let windows = sampled_windows(&index.shards[t.shard]);
        let at = (t.offset..t.offset + t.len).find(|&b| !windows.iter().any(|&(o, l)| (o..o + l).contains(&b)));
        if let Some(at) = at {
            flip(&index.shards[t.shard].path, at);
            damaged += 1;
        }
    }
    assert!(damaged > 150, "{damaged} experts damaged");
}

fn http_post(addr: &str, body: &serde_json::Value) -> (u16, String) {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = body.to_string();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    c.write_all(head.as_bytes()).unwrap();
    c.write_all(body.as_bytes()).unwrap();
    // Half-closed: the request is all there is.
    c.shutdown(std::net::Shutdown::Write).unwrap();
    let mut raw = String::new();
    c.read_to_string(&mut raw).unwrap();
    let status = raw.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, raw)
}

#[test]
fn a_client_that_half_closes_after_its_request_gets_its_answer() {
    let server = Server::start(&[]);
    let (status, raw) =
        http_post(&server.addr, &json!({"prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}));
    assert_eq!(status, 200, "{raw}");
    assert!(raw.contains("\"completion_tokens\":3"), "{raw}");
    let (code, err) = server.stop_with(libc::SIGTERM);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn a_server_whose_expert_is_damaged_answers_500_and_exits_3() {
    let (_tmp, model) = copy_tiny();
    let trunk = pack(&model);
    damage_experts(&model);
    let server = Server::start_on(&model, &["--trunk", s(trunk.path()), "--mem-gb", "0.01"]);
    let (status, raw) =
        http_post(&server.addr, &json!({"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}));
    assert_eq!(status, 500, "{raw}");
    assert!(raw.contains("the engine failed: ") && raw.contains("fails its checksum"), "{raw}");
    let (code, err) = server.wait_exit();
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("stopping the server: the engine failed while serving"), "{err}");
    assert!(err.contains("fails its checksum (manifest "), "{err}");
}

#[test]
fn serve_refuses_zero_limits_at_start_naming_the_flag() {
    for (flag, what) in [
        ("--max-body", "a number of bytes (1 or more)"),
        ("--context", "a number of positions (2 or more"),
        ("--max-batch", "a number of sequences in 1..=4096"),
    ] {
        let (code, _, err, _) = run_bounded(&["serve", "--port", "0", flag, "0"], None, 30);
        assert_eq!(code, 2, "{flag}: {err}");
        assert!(err.contains(&format!("invalid value '0' for '{flag} ")) && err.contains(what), "{flag}: {err}");
    }
}
