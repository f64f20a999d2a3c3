//! Faults and bad inputs that used to end k3ring without a message or with the wrong exit code
//! (issue 13): a read fault under memory-mapped weights (SIGBUS) is exit 4 naming the file and
//! offset; absurd sizes in config.json are refused before anything proportional is allocated.
//!
//! The faulting run is a real `k3ring` child process: `--dump-trace` names a FIFO, whose opening
//! blocks the child after the weights are mapped and before the first forward pass. While it
//! waits, the test truncates a mapped file (an access past the new end of a file raises SIGBUS,
//! the same kernel fault as a disk error under a mapped page), then lets it go.

use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use k3ring::checkpoint::CheckpointIndex;

use crate::checkpoint_tests::copy_tiny;
use crate::checkpoint_tests::k3ring;
use crate::common::pack;

const WAIT_MAX: Duration = Duration::from_secs(300);

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(rc, 0, "mkfifo {}: {}", path.display(), std::io::Error::last_os_error());
}

/// A `k3ring` child held before its first forward pass by a route-log FIFO nobody reads yet.
struct HeldRun {
    child: Child,
    fifo: PathBuf,
    stderr: std::thread::JoinHandle<String>,
    _tmp: tempfile::TempDir,
}

impl HeldRun {
    fn start(args: &[&str]) -> HeldRun {
        let tmp = tempfile::tempdir().unwrap();
        let fifo = tmp.path().join("routes.fifo");
        mkfifo(&fifo);
        let mut child = Command::new(env!("CARGO_BIN_EXE_k3ring"))
            .args(args)
            .arg("--dump-trace")
            .arg(&fifo)
            .env_remove("RUST_LOG")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut pipe = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = pipe.read_to_string(&mut s);
            s
        });
        HeldRun { child, fifo, stderr, _tmp: tmp }
    }

    /// Waits until every file of `paths` is mapped into the child (it then waits on the FIFO or
    /// is on its way there, before any weight is read).
    fn wait_mapped(&mut self, paths: &[PathBuf]) {
        let maps = format!("/proc/{}/maps", self.child.id());
        let wanted: Vec<String> = paths.iter().map(|p| p.canonicalize().unwrap().display().to_string()).collect();
        let deadline = Instant::now() + WAIT_MAX;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("k3ring ended before mapping {wanted:?}: {status}");
            }
            let text = std::fs::read_to_string(&maps).unwrap_or_default();
            if wanted.iter().all(|w| text.lines().any(|l| l.ends_with(w.as_str()))) {
                return;
            }
            assert!(Instant::now() < deadline, "{wanted:?} not mapped after {WAIT_MAX:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Opens the FIFO's read end (the child goes on) and drains it until the child ends.
    fn release_and_wait(mut self) -> (ExitStatus, String) {
        // Non-blocking: the child may not have reached the FIFO yet (its open then succeeds
        // at once), and a read with no writer yet is an EOF to retry, not the end.
        let fifo = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(&self.fifo).unwrap();
        let deadline = Instant::now() + WAIT_MAX;
        let mut buf = vec![0u8; 1 << 16];
        let status = loop {
            let _ = (&fifo).read(&mut buf);
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("k3ring did not end within {WAIT_MAX:?}");
            }
            std::thread::sleep(Duration::from_millis(2));
        };
        (status, self.stderr.join().unwrap())
    }
}

/// Cuts `path` back to its safetensors header: every tensor byte is then past the end.
fn truncate_to_header(path: &Path) {
    let header_len = u64::from_le_bytes(std::fs::read(path).unwrap()[..8].try_into().unwrap());
    std::fs::OpenOptions::new().write(true).open(path).unwrap().set_len(8 + header_len).unwrap();
}

/// The shard holding the output head, which every token reads.
fn head_shard(model: &Path) -> PathBuf {
    let index = CheckpointIndex::open(model).unwrap();
    index.shard_path(index.get(k3ring::checkpoint::LM_HEAD).unwrap()).to_owned()
}

#[test]
fn sigbus_under_resident_mapped_weights_exits_4_naming_the_shard() {
    let (_tmp, model) = copy_tiny();
    let shard = head_shard(&model);
    let mut run = HeldRun::start(&["run", "--model", model.to_str().unwrap(), "--prompt", "Hello", "--gen", "4"]);
    run.wait_mapped(std::slice::from_ref(&shard));
    truncate_to_header(&shard);
    let (status, err) = run.release_and_wait();
    assert_eq!(status.code(), Some(4), "{status}: {err}");
    // After the note that the tiny model's weights are random (issue 16), the error comes first.
    let first = err.lines().find(|l| !l.starts_with("k3ring: note: ")).unwrap_or_default();
    assert!(first.starts_with("k3ring: error: read at offset "), "{err}");
    assert!(first.contains(&format!(" of {} failed: SIGBUS", shard.display())), "{err}");
}

#[test]
fn sigbus_under_mmap_streaming_reads_exits_4_naming_the_file() {
    let (_tmp, model) = copy_tiny();
    let trunk = pack(&model);
    let shards: Vec<PathBuf> = CheckpointIndex::open(&model).unwrap().shards.iter().map(|s| s.path.clone()).collect();
    let args = [
        "run",
        "--model",
        model.to_str().unwrap(),
        "--trunk",
        trunk.path().to_str().unwrap(),
        "--io",
        "mmap",
        "--mem-gb",
        "0.003",
        "--no-mlock",
        "--prompt",
        "Hello",
        "--gen",
        "4",
    ];
    let mut run = HeldRun::start(&args);
    run.wait_mapped(&shards);
    // Experts are read from the shards (the trunk from the pack): every expert read faults.
    for shard in &shards {
        truncate_to_header(shard);
    }
    let (status, err) = run.release_and_wait();
    assert_eq!(status.code(), Some(4), "{status}: {err}");
    let line = err.lines().find(|l| l.starts_with("k3ring: error: read at offset ")).unwrap_or_default();
    assert!(shards.iter().any(|s| line.contains(&format!(" of {} failed: SIGBUS", s.display()))), "{err}");
}

#[test]
fn sigbus_outside_mapped_weights_still_kills_with_sigbus() {
    let dir = crate::common::tiny_dir();
    let mut run = HeldRun::start(&["run", "--model", dir.to_str().unwrap(), "--prompt", "Hello", "--gen", "4"]);
    let shard = head_shard(&dir);
    run.wait_mapped(std::slice::from_ref(&shard));
    // Sent by a process, so it names no mapped address: the handler must not claim it.
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(run.child.id() as libc::pid_t, libc::SIGBUS) }, 0);
    let (status, err) = run.release_and_wait();
    assert_eq!(status.signal(), Some(libc::SIGBUS), "{status}: {err}");
    assert!(!err.contains("read at offset"), "{err}");
}

/// Every size key of the config, with the object that holds it in the nested (release) shape.
const SIZE_KEYS: [(&str, &str); 21] = [
    ("text_config", "vocab_size"),
    ("text_config", "hidden_size"),
    ("text_config", "num_hidden_layers"),
    ("text_config", "intermediate_size"),
    ("text_config", "num_attention_heads"),
    ("text_config", "q_lora_rank"),
    ("text_config", "kv_lora_rank"),
    ("text_config", "qk_nope_head_dim"),
    ("text_config", "qk_rope_head_dim"),
    ("text_config", "v_head_dim"),
    ("text_config", "num_experts"),
    ("text_config", "num_experts_per_token"),
    ("text_config", "num_shared_experts"),
    ("text_config", "moe_intermediate_size"),
    ("text_config", "routed_expert_hidden_size"),
    ("text_config", "first_k_dense_replace"),
    ("text_config", "moe_layer_freq"),
    ("text_config", "attn_res_block_size"),
    ("linear_attn_config", "num_heads"),
    ("linear_attn_config", "head_dim"),
    ("linear_attn_config", "short_conv_kernel_size"),
];

fn set_size(config: &mut serde_json::Value, scope: &str, key: &str, value: serde_json::Value) {
    let text = &mut config["text_config"];
    let holder = if scope == "linear_attn_config" { &mut text["linear_attn_config"] } else { text };
    holder[key] = value;
}

#[test]
fn absurd_sizes_in_config_are_refused_naming_key_and_value() {
    for (scope, key) in SIZE_KEYS {
        let mut v = crate::config_tests::k3_config();
        set_size(&mut v, scope, key, serde_json::json!(1_000_000_000_000u64));
        let err = k3ring::config::Config::from_json_str(&v.to_string(), Path::new("config.json")).unwrap_err();
        assert_eq!(k3ring::exit::Classify::exit_code(&err), k3ring::exit::ExitCode::Usage, "{key}: {err}");
        let shown = if scope == "linear_attn_config" { format!("{scope}.{key}") } else { key.to_owned() };
        assert!(err.to_string().contains(&format!("{shown} is 1000000000000, above the largest")), "{key}: {err}");
    }
}

/// Runs the binary with its address space capped at `bytes`: a size that slipped through would
/// fail to allocate instead of growing until the machine kills something.
fn k3ring_capped(args: &[&str], bytes: u64) -> (i32, String) {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_k3ring"));
    cmd.args(args).env_remove("RUST_LOG");
    // SAFETY: setrlimit is async-signal-safe; the closure allocates nothing.
    unsafe {
        cmd.pre_exec(move || {
            let limit = libc::rlimit { rlim_cur: bytes, rlim_max: bytes };
            if libc::setrlimit(libc::RLIMIT_AS, &limit) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        });
    }
    let out = cmd.output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// Enough address space for `inspect` and `run` on the tiny model, not for a list of a billion
/// tensor names.
const ADDRESS_SPACE: u64 = 1 << 30;

#[test]
fn absurd_and_mismatched_counts_are_refused_before_allocating() {
    let (_tmp, model) = copy_tiny();
    let d = model.to_str().unwrap();
    let config_path = model.join("config.json");
    let original: serde_json::Value = serde_json::from_slice(&std::fs::read(&config_path).unwrap()).unwrap();
    let layers_4096 = |v: &mut serde_json::Value| {
        v["text_config"]["num_hidden_layers"] = 4096.into();
        let kda = &mut v["text_config"]["linear_attn_config"]["kda_layers"];
        let mut listed = kda.as_array().unwrap().clone();
        listed.extend((14..=4096).map(serde_json::Value::from));
        *kda = listed.into();
    };
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    let cases: Vec<(Edit, i32, &str)> = vec![
        (
            Box::new(|v| v["text_config"]["num_experts"] = serde_json::json!(1_000_000_000_000u64)),
            2,
            "num_experts is 1000000000000, above the largest this engine accepts (65536)",
        ),
        (
            Box::new(|v| v["text_config"]["num_experts"] = serde_json::json!(1e12)),
            2,
            "num_experts must be a non-negative integer",
        ),
        (
            Box::new(|v| v["text_config"]["num_experts"] = 65536.into()),
            3,
            "config.json has num_experts = 65536 but the router has 16 rows",
        ),
        (
            Box::new(move |v| {
                layers_4096(v);
                v["text_config"]["num_experts"] = 65536.into();
            }),
            3,
            "config.json has num_hidden_layers = 4096 but the checkpoint's layers stop at 13",
        ),
    ];
    for (edit, want, needle) in cases {
        let mut v = original.clone();
        edit(&mut v);
        std::fs::write(&config_path, v.to_string()).unwrap();
        for args in [vec!["inspect", "--model", d], vec!["run", "--model", d, "--prompt", "x", "--gen", "1"]] {
            let (code, err) = k3ring_capped(&args, ADDRESS_SPACE);
            assert_eq!(code, want, "{args:?} {needle}: {err}");
            assert!(err.contains(needle), "{args:?}: {err}");
        }
    }
}

#[test]
fn prompt_file_that_is_not_utf8_is_a_usage_error() {
    let tmp = tempfile::tempdir().unwrap();
    let prompt = tmp.path().join("prompt.txt");
    std::fs::write(&prompt, b"Once upon\xff a time").unwrap();
    let dir = crate::common::tiny_dir();
    let (code, _, err) = k3ring(&["run", "--model", dir.to_str().unwrap(), "--prompt-file", prompt.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    let want = format!("k3ring: error: --prompt-file {}: not UTF-8 text (invalid byte at offset 9)", prompt.display());
    assert!(err.contains(&want), "{err}");
}

#[test]
fn tokenizer_files_that_are_not_utf8_are_data_errors() {
    for (file, line) in [("tiktoken.model", 3), ("tokenizer_config.json", 1)] {
        let (_tmp, model) = copy_tiny();
        let path = model.join(file);
        let mut bytes = std::fs::read(&path).unwrap();
        // Inside the third line of the vocabulary, or the first of the JSON.
        let at =
            if line == 3 { bytes.iter().enumerate().filter(|(_, &b)| b == b'\n').nth(1).unwrap().0 + 2 } else { 1 };
        bytes.insert(at, 0xc3);
        bytes.insert(at + 1, 0x28);
        std::fs::write(&path, bytes).unwrap();
        let (code, _, err) = k3ring(&["run", "--model", model.to_str().unwrap(), "--prompt", "x"]);
        assert_eq!(code, 3, "{file}: {err}");
        let want = format!("{}:{line}: not UTF-8 text (invalid byte at offset {at})", path.display());
        assert!(err.contains(&want), "{file}: {err}");
    }
}

/// The first line of stderr, which must be a clean `k3ring: error: FLAG ...` line.
fn first_line(err: &str) -> &str {
    err.lines().find(|l| l.starts_with("k3ring: error:")).unwrap_or_default()
}

#[test]
fn refused_budgets_name_the_flag_each_command_was_given() {
    let model = crate::common::tiny_dir();
    let trunk = pack(&model);
    let (m, t) = (model.to_str().unwrap(), trunk.path().to_str().unwrap());
    let quick = ["--tokens", "1", "--warmup", "0"];
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            [&["run", "--model", m, "--trunk", t, "--mem-gb", "0.0001", "--prompt", "x"][..]].concat(),
            "k3ring: error: --mem-gb 0.0001: a budget of 0.0001 GB is below this model's minimum",
        ),
        (
            [&["run", "--model", m, "--trunk", t, "--mem-gb", "100000", "--prompt", "x"][..]].concat(),
            "k3ring: error: --mem-gb 100000: a budget of 100000.000 GB is above 95% of available memory",
        ),
        (
            [
                &["bench", "--model", m, "--trunk", t, "--budgets", "0.0001", "--modes", "serial"][..],
                &quick,
                &["--device-reads", "4"],
            ]
            .concat(),
            "k3ring: error: --budgets 0.0001: a budget of 0.0001 GB is below this model's minimum",
        ),
        (
            [&["tune", "--model", m, "--trunk", t, "--mem-gb", "0.0001"][..], &quick].concat(),
            "k3ring: error: --mem-gb 0.0001: a budget of 0.0001 GB is below this model's minimum",
        ),
    ];
    for (args, want) in cases {
        let (code, _, err) = k3ring(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(first_line(&err).starts_with(want), "{args:?}: {err}");
        assert!(!err.contains("Knobs {") && !err.contains("error: error:"), "{args:?}: {err}");
    }
}

#[test]
fn budgets_that_are_not_positive_are_refused_by_the_parser_naming_the_flag() {
    let model = crate::common::tiny_dir();
    let tmp = tempfile::tempdir().unwrap();
    let demo_dir = tmp.path().join("demo");
    let (m, d) = (model.to_str().unwrap(), demo_dir.to_str().unwrap());
    for (args, flag) in [
        (vec!["demo", "--dir", d, "--budget-share", "0"], "--budget-share"),
        (vec!["demo", "--dir", d, "--budget-share", "NaN"], "--budget-share"),
        (vec!["bench", "--model", m, "--trunk", m, "--budgets", "6,0"], "--budgets"),
        (vec!["tune", "--model", m, "--trunk", m, "--mem-gb", "0"], "--mem-gb"),
    ] {
        let (code, _, err) = k3ring(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.starts_with("error: invalid value") && err.contains(flag), "{args:?}: {err}");
        assert!(!err.contains("error: error:"), "{args:?}: {err}");
        if args[0] == "demo" {
            assert!(!err.contains("--mem-gb"), "{err}");
        }
    }
    assert!(!demo_dir.exists(), "the demo refused its flag before synthesizing anything");
}

#[test]
fn another_models_pack_is_refused_as_such_before_the_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let other = tmp.path().join("other");
    let (code, _, err) =
        k3ring(&["synth", "--dims", "tiny", "--layers", "4", "--seed", "9", "--out", other.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let other_trunk = pack(&other);
    let model = crate::common::tiny_dir();
    let t = other_trunk.path().to_str().unwrap();
    let (code, _, err) =
        k3ring(&["run", "--model", model.to_str().unwrap(), "--trunk", t, "--mem-gb", "0.0001", "--prompt", "x"]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(&format!("the trunk pack in {t} was made from another checkpoint")), "{err}");
    assert!(!err.contains("budget"), "{err}");
}
