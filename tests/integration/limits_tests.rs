//! Limits (issue 13): the model's context length and `--gen` overflow are refused with exit 2 and
//! the numbers; Ctrl-C stops a run between tokens with its summary and exit 130; memory presets
//! and checks obey the process's cgroup, and a streamed run fits in a cgroup of its plan plus
//! the documented margin (docs/STORAGE.md). The cgroup tests need a writable memory cgroup (as
//! root on cgroup v1); elsewhere they print why they were skipped and pass.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use k3ring::engine::{EngineError, GenerateOptions};
use k3ring::exit::{Classify, ExitCode};
use kernels::Isa;

use crate::checkpoint_tests::{copy_tiny, k3ring};
use crate::common::*;

const BIN: &str = env!("CARGO_BIN_EXE_k3ring");

/// The tiny model's context: `model_max_length` of its tokenizer_config.json.
const TINY_CONTEXT: usize = 4096;

fn run_tiny(extra: &[&str]) -> (i32, String, String) {
    let dir = tiny_dir();
    let mut args = vec!["run", "--model", dir.to_str().unwrap()];
    args.extend_from_slice(extra);
    k3ring(&args)
}

#[test]
fn prompt_plus_gen_beyond_the_context_exits_2_with_the_numbers() {
    let trunk = pack(&tiny_dir());
    let streamed = ["--trunk", trunk.path().to_str().unwrap(), "--mem-gb", "0.01"];
    for extra in [&[][..], &streamed[..]] {
        let mut args = vec!["--ids", "512,5,6", "--gen", "4094"];
        args.extend_from_slice(extra);
        let (code, _, err) = run_tiny(&args);
        assert_eq!(code, 2, "{err}");
        assert!(
            err.contains("the prompt's 3 tokens plus --gen 4094 need 4097 positions, beyond the model's context of 4096 positions (model_max_length in tokenizer_config.json)"),
            "{err}"
        );
        assert!(!err.contains("plan:"), "refused before planning: {err}");
    }
}

#[test]
fn gen_that_overflows_the_position_count_exits_2() {
    let trunk = pack(&tiny_dir());
    let streamed = ["--trunk", trunk.path().to_str().unwrap(), "--mem-gb", "0.01"];
    let max = usize::MAX.to_string();
    for extra in [&[][..], &streamed[..]] {
        let mut args = vec!["--prompt", "Once upon a time", "--gen", &max];
        args.extend_from_slice(extra);
        let (code, _, err) = run_tiny(&args);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains(&format!("--gen {max} is too large")) && err.contains("overflow"), "{err}");
        assert!(!err.contains("context is full"), "no wrap-around: {err}");
    }
}

#[test]
fn a_long_prompt_file_is_refused_in_moments() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("long.txt");
    std::fs::write(&path, "The quick brown fox jumps over the lazy dog. ".repeat(4000)).unwrap();
    let start = Instant::now();
    let (code, _, err) = run_tiny(&["--prompt-file", path.to_str().unwrap(), "--gen", "8"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("beyond the model's context of 4096 positions"), "{err}");
    // Generous (a loaded CI machine); running the prompt would take minutes.
    assert!(start.elapsed() < Duration::from_secs(30));
}

#[test]
fn a_context_length_in_config_json_wins() {
    let (_tmp, model) = copy_tiny();
    let path = model.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    v["text_config"]["max_position_embeddings"] = 64.into();
    std::fs::write(&path, v.to_string()).unwrap();
    let (code, _, err) = k3ring(&["run", "--model", model.to_str().unwrap(), "--ids", "512,5", "--gen", "63"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("context of 64 positions (text_config.max_position_embeddings in config.json)"), "{err}");
}

static STOP_AFTER_FIVE: AtomicBool = AtomicBool::new(false);
static STOP_AT_ONCE: AtomicBool = AtomicBool::new(false);

/// The library side of Ctrl-C: the flag is checked between tokens and before each prefill chunk.
#[test]
fn the_stop_flag_ends_generation_between_tokens_and_chunks() {
    let o = open(&tiny_dir(), 2, Isa::best());
    let opts = GenerateOptions { gen: 100, stop: Some(&STOP_AFTER_FIVE), ..Default::default() };
    let mut seen = 0;
    let g = o
        .engine
        .generate(&prompt(), &opts, |_| {
            seen += 1;
            if seen == 5 {
                STOP_AFTER_FIVE.store(true, Ordering::Relaxed);
            }
        })
        .unwrap();
    assert!(g.interrupted);
    assert_eq!((g.generated_ids.len(), g.prompt_done), (5, prompt().len()));
    let full = o.engine.generate(&prompt(), &GenerateOptions { gen: 5, ..Default::default() }, |_| {}).unwrap();
    assert_eq!(g.generated_ids, full.generated_ids, "the tokens before the stop are the same");

    STOP_AT_ONCE.store(true, Ordering::Relaxed);
    let opts = GenerateOptions { gen: 100, prefill_chunk: 4, stop: Some(&STOP_AT_ONCE), ..Default::default() };
    let mut progress = Vec::new();
    let g = o.engine.generate_with(&prompt(), &opts, |_| {}, |done, total| progress.push((done, total))).unwrap();
    assert!(g.interrupted && g.generated_ids.is_empty() && g.prompt_done == 0, "{g:?}");
    assert!(progress.is_empty());
}

#[test]
fn prefill_progress_is_reported_per_chunk() {
    let o = open(&tiny_dir(), 2, Isa::best());
    let prompt = prompt();
    let opts = GenerateOptions { gen: 2, prefill_chunk: 4, ..Default::default() };
    let mut progress = Vec::new();
    let g = o.engine.generate_with(&prompt, &opts, |_| {}, |done, total| progress.push((done, total))).unwrap();
    let n = prompt.len();
    let want: Vec<(usize, usize)> = (1..=n.div_ceil(4)).map(|i| ((4 * i).min(n), n)).collect();
    assert_eq!(progress, want);
    assert!(!g.interrupted && g.prompt_done == n);
}

#[test]
fn the_library_refuses_the_context_too() {
    let o = open(&tiny_dir(), 2, Isa::best());
    let opts = GenerateOptions { gen: TINY_CONTEXT, ..Default::default() };
    let err = o.engine.generate(&[512, 5], &opts, |_| {}).unwrap_err();
    assert!(matches!(err, EngineError::ContextTooLong { total: 4098, context: 4096, .. }), "{err}");
    assert_eq!(err.exit_code(), ExitCode::Usage);
    let cfg = &o.engine.model.cfg;
    assert_eq!(k3ring::engine::context_needed(cfg, 3, TINY_CONTEXT - 3).unwrap(), TINY_CONTEXT, "exactly the context");
    assert_eq!(k3ring::engine::context_needed(cfg, 3, 0).unwrap(), 4, "room for one token even at --gen 0");
    let opts = GenerateOptions { gen: usize::MAX, ..Default::default() };
    let err = o.engine.generate(&[512, 5], &opts, |_| {}).unwrap_err();
    assert!(matches!(err, EngineError::ContextOverflow { .. }), "{err}");
    assert_eq!(err.exit_code(), ExitCode::Usage);
}

/// Ctrl-C on a streamed run with a long `--gen`: the tokens so far, the summary (tokens, s/token,
/// bytes read) and the `--json` report are written, and the exit code is 130. So are `--trace`
/// (a valid trace) and `--logits` (the rows computed so far), created before generation.
#[test]
fn ctrl_c_prints_the_summary_so_far_and_exits_130() {
    let trunk = pack(&tiny_dir());
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("r.json");
    let (trace, logits) = (tmp.path().join("t.json"), tmp.path().join("l.bin"));
    let mut child = Command::new(BIN)
        .args(["run", "--model", tiny_dir().to_str().unwrap(), "--trunk", trunk.path().to_str().unwrap()])
        .args(["--mem-gb", "0.01", "--prompt", "Once upon a time", "--gen", "4000", "--ignore-eos"])
        .args(["--json", json.to_str().unwrap()])
        .args(["--trace", trace.to_str().unwrap(), "--logits", logits.to_str().unwrap()])
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for generated text: by then the handler is installed and decoding has begun.
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while seen.len() < 64 {
        let n = stdout.read(&mut buf).unwrap();
        if n == 0 {
            let mut err = String::new();
            child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            panic!("the run ended before it could be interrupted ({:?}): {err}", child.wait().unwrap());
        }
        seen.extend_from_slice(&buf[..n]);
    }
    let kill = Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap();
    assert!(kill.success());
    stdout.read_to_end(&mut seen).unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "{err}");
    let summary = err.lines().find(|l| l.contains("generated tokens |")).unwrap_or_else(|| panic!("{err}"));
    let count = |part: &str| -> usize { part.split(' ').next().unwrap().parse().unwrap() };
    let prompt_len = count(summary.trim_start_matches("k3ring: "));
    let generated = count(summary.split(" + ").nth(1).unwrap());
    assert!((1..4000).contains(&generated), "{summary}");
    assert!(summary.contains("s/token"), "{summary}");
    assert!(err.contains("k3ring: storage uring | trunk read"), "bytes read are in the summary: {err}");
    let said =
        format!("interrupted (Ctrl-C) after {prompt_len} of {prompt_len} prompt tokens and {generated} generated");
    assert!(err.contains(&said), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["interrupted"], true);
    assert_eq!(ids(&v["generated_ids"]).len(), generated);
    let t: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    crate::trace_check::check_trace(&t).unwrap_or_else(|e| panic!("the trace written after Ctrl-C: {e}"));
    let raw = std::fs::read(&logits).unwrap();
    let end = raw.iter().position(|&b| b == b'\n').unwrap();
    let header: serde_json::Value = serde_json::from_slice(&raw[..end]).unwrap();
    assert_eq!(header["rows"].as_u64().unwrap() as usize, prompt_len + generated - 1, "{header}");
}

/// A child memory cgroup of this process's own (so it stays inside whatever limits this test
/// runs under), removed on drop.
pub(crate) struct TestCgroup {
    version: u8,
    dir: PathBuf,
}

impl TestCgroup {
    /// `Err` says why no cgroup could be made (the caller skips).
    pub(crate) fn create(name: &str, limit: u64) -> Result<TestCgroup, String> {
        let own = k3ring::memory::cgroup::own_memory_cgroups();
        let mut why = vec![format!("own memory cgroups: {own:?}")];
        for cg in own {
            let dir = cg.dir.join(format!("k3ring-test-{name}-{}", std::process::id()));
            let limit_file = if cg.version == 1 { "memory.limit_in_bytes" } else { "memory.max" };
            let _ = std::fs::remove_dir(&dir);
            let made = std::fs::create_dir(&dir).and_then(|()| std::fs::write(dir.join(limit_file), limit.to_string()));
            match made {
                Ok(()) => return Ok(TestCgroup { version: cg.version, dir }),
                Err(e) => {
                    let _ = std::fs::remove_dir(&dir);
                    why.push(format!("{}: {e}", dir.display()));
                }
            }
        }
        Err(why.join("; "))
    }

    /// Runs the binary inside the cgroup: (exit code, stdout, stderr). A run still going after
    /// two minutes is killed (code -1), so a limit that fails to bind cannot hang the test.
    fn run(&self, args: &[&str]) -> (i32, String, String) {
        self.run_with_stdin(args, None)
    }

    /// [`Self::run`] with stdin from the file `stdin` (none: empty).
    pub(crate) fn run_with_stdin(&self, args: &[&str], stdin: Option<&Path>) -> (i32, String, String) {
        let procs = self.dir.join("cgroup.procs");
        let input = match stdin {
            Some(p) => Stdio::from(std::fs::File::open(p).unwrap()),
            None => Stdio::null(),
        };
        let child = Command::new("sh")
            .args(["-c", "echo $$ > \"$0\" && exec \"$@\"", procs.to_str().unwrap(), BIN])
            .args(args)
            .stdin(input)
            .env_remove("RUST_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_bounded(child, Duration::from_secs(120))
    }

    /// The cgroup's peak charge (v1 `memory.max_usage_in_bytes`, v2 `memory.peak`).
    fn peak(&self) -> Option<u64> {
        let file = if self.version == 1 { "memory.max_usage_in_bytes" } else { "memory.peak" };
        std::fs::read_to_string(self.dir.join(file)).ok()?.trim().parse().ok()
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // The child has exited, but the kernel may take a moment to let the cgroup go.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!("could not remove test cgroup {}", self.dir.display());
    }
}

fn skip(test: &str, why: &str) {
    println!("SKIPPED {test}: no writable memory cgroup ({why})");
}

fn streamed_args<'a>(trunk: &'a Path, extra: &[&'a str]) -> Vec<String> {
    let mut args: Vec<String> = ["run", "--model", tiny_dir().to_str().unwrap(), "--trunk", trunk.to_str().unwrap()]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
    args.extend(["--prompt", "Once upon a time", "--ignore-eos"].iter().map(|s| (*s).to_owned()));
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    args
}

/// Inside a 700 MiB cgroup on a machine with more free memory, `--preset auto` budgets 80% of the
/// cgroup's headroom and says so; `--preset max` passes its own check; a budget above the
/// cgroup's headroom is refused naming the cgroup's limit file.
#[test]
fn presets_and_budget_checks_obey_the_cgroup_limit() {
    let limit: u64 = 700 << 20;
    let cg = match TestCgroup::create("preset", limit) {
        Ok(cg) => cg,
        Err(why) => return skip("presets_and_budget_checks_obey_the_cgroup_limit", &why),
    };
    let trunk = pack(&tiny_dir());
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("auto.json");
    let args = streamed_args(trunk.path(), &["--gen", "4", "--json", json.to_str().unwrap()]);
    let (code, _, err) = cg.run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 0, "{err}");
    let limit_file = cg.dir.join(if cg.version == 1 { "memory.limit_in_bytes" } else { "memory.max" });
    assert!(
        err.contains("--preset auto: budget")
            && err.contains(&format!("limited by the cgroup v{} limit {}", cg.version, limit_file.display())),
        "{err}"
    );
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    let budget = v["plan"]["budget_bytes"].as_u64().unwrap();
    assert!(budget <= limit / 100 * 80 && budget > limit / 2, "auto budget {budget} for a {limit}-byte cgroup");

    let args = streamed_args(trunk.path(), &["--gen", "4", "--preset", "max"]);
    let (code, _, err) = cg.run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 0, "--preset max refused by its own check: {err}");

    let args = streamed_args(trunk.path(), &["--gen", "4", "--mem-gb", "0.7"]);
    let (code, _, err) = cg.run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("above 95% of available memory") && err.contains(&limit_file.display().to_string()), "{err}");

    // A resident run's check of its states and KV cache: about 1.3 GB for two million positions
    // of a copy of the tiny model that claims that context, above the cgroup's 700 MiB though
    // far below the machine's free memory.
    let (_tmp, model) = copy_tiny();
    let path = model.join("config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    v["text_config"]["max_position_embeddings"] = 4_000_000.into();
    std::fs::write(&path, v.to_string()).unwrap();
    let (code, _, err) = cg.run(&["run", "--model", model.to_str().unwrap(), "--ids", "512,5", "--gen", "2000000"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("are available (limited by the cgroup") && err.contains(&limit_file.display().to_string()),
        "{err}"
    );
}

/// What the process needs beyond its plan: the binary and its libraries, thread stacks, the
/// tokenizer, the checkpoint index and allocator slack (docs/STORAGE.md, "Memory margin").
const MEMORY_MARGIN: u64 = 32 << 20;

/// The memory gate: a run at the smallest budget the planner accepts completes inside a cgroup
/// whose limit is the plan plus [`MEMORY_MARGIN`], with the same tokens as outside it.
#[test]
fn a_streamed_run_fits_in_a_cgroup_of_its_plan_plus_the_margin() {
    let trunk = pack(&tiny_dir());
    let tmp = tempfile::tempdir().unwrap();
    let json = |name: &str| tmp.path().join(name).to_str().unwrap().to_owned();
    let gen = "1000";
    // The minimum for this context, from a plan made outside the cgroup.
    let probe = json("probe.json");
    let (code, _, err) = k3ring(
        &streamed_args(trunk.path(), &["--gen", gen, "--mem-gb", "0.064", "--json", &probe])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert_eq!(code, 0, "{err}");
    let read = |p: &str| -> serde_json::Value { serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap() };
    let minimum = read(&probe)["plan"]["minimum_bytes"].as_u64().unwrap();
    let budget_gb = format!("{:.9}", minimum as f64 / 1e9);
    let limit = minimum + MEMORY_MARGIN;
    let cg = match TestCgroup::create("gate", limit) {
        Ok(cg) => cg,
        Err(why) => return skip("a_streamed_run_fits_in_a_cgroup_of_its_plan_plus_the_margin", &why),
    };
    let inside = json("inside.json");
    let args = streamed_args(trunk.path(), &["--gen", gen, "--mem-gb", &budget_gb, "--json", &inside]);
    let (code, _, err) = cg.run(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 0, "the run did not complete in a cgroup of {limit} bytes (plan {minimum} + margin): {err}");
    let report = read(&inside);
    let planned = report["plan"]["planned_bytes"].as_u64().unwrap();
    assert!(planned <= minimum, "planned {planned} at the minimum budget {minimum}");
    assert_eq!(ids(&report["generated_ids"]).len(), 1000);
    let outside = json("outside.json");
    let args = streamed_args(trunk.path(), &["--gen", gen, "--mem-gb", &budget_gb, "--json", &outside]);
    let (code, _, err) = k3ring(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(code, 0, "{err}");
    assert_eq!(report["generated_ids"], read(&outside)["generated_ids"], "the cgroup changed the tokens");
    let peak = cg.peak();
    println!(
        "memory gate: plan {planned} bytes, cgroup limit {limit}, cgroup peak {peak:?}, peak RSS {}",
        report["peak_rss_bytes"]
    );
    if let Some(peak) = peak {
        assert!(peak <= limit, "cgroup peak {peak} above its limit {limit}");
    }
}
