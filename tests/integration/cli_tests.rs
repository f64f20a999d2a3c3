//! The command line: `run` end to end, JSON output, exit codes of refused flags, log output.

use crate::checkpoint_tests::k3ring;
use crate::common::*;

#[test]
fn run_reproduces_the_greedy_reference_and_writes_json() {
    let dir = tiny_dir();
    let r = reference_json(&dir);
    let prompt: Vec<String> = ids(&r["prompt_ids"]).iter().map(u32::to_string).collect();
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("out.json");
    let (code, out, err) = k3ring(&[
        "run",
        "--model",
        dir.to_str().unwrap(),
        "--ids",
        &prompt.join(","),
        "--gen",
        "24",
        "--ignore-eos",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("24 generated tokens") && err.contains("s/token") && err.contains("peak RSS"), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(ids(&v["generated_ids"]), ids(&r["greedy_ids"]));
    assert_eq!(ids(&v["prompt_ids"]), ids(&r["prompt_ids"]));
    assert!(v["seconds_per_token"].as_f64().unwrap() > 0.0);
    assert!(v["peak_rss_bytes"].as_u64().unwrap() > 0);
    let text = v["text"].as_str().unwrap();
    assert_eq!(out.trim_end_matches('\n'), text, "stdout streams the generated text");
}

#[test]
fn run_without_model_uses_the_embedded_tiny_model() {
    let tmp = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_k3ring"))
        .args(["run", "--prompt", "Once upon a time", "--gen", "8", "--ignore-eos"])
        .env("XDG_CACHE_HOME", tmp.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("8 generated tokens"));
    let cached = std::fs::read_dir(tmp.path().join("k3ring")).unwrap().count();
    assert_eq!(cached, 1, "the embedded model is written once to the cache");
}

#[test]
fn sampling_is_reproducible_for_a_seed() {
    let dir = tiny_dir();
    let tmp = tempfile::tempdir().unwrap();
    let ids_for = |seed: &str| {
        let path = tmp.path().join(format!("{seed}.json"));
        let (code, _, err) = k3ring(&[
            "run",
            "--model",
            dir.to_str().unwrap(),
            "--prompt",
            "Hello",
            "--gen",
            "12",
            "--ignore-eos",
            "--temperature",
            "0.9",
            "--top-k",
            "40",
            "--seed",
            seed,
            "--json",
            path.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        ids(&v["generated_ids"])
    };
    assert_eq!(ids_for("7"), ids_for("7"));
    assert_ne!(ids_for("7"), ids_for("8"), "different seeds should sample differently");
}

#[test]
fn refused_flags_exit_2_naming_the_flag() {
    let dir = tiny_dir();
    let d = dir.to_str().unwrap();
    for (args, needle) in [
        (vec!["run", "--model", d, "--prompt", "x", "--temperature", "-1"], "--temperature"),
        (vec!["run", "--model", d, "--prompt", "x", "--top-p", "1.5"], "--top-p"),
        (vec!["run", "--model", d, "--prompt", "x", "--isa", "neon"], "--isa \"neon\" is unknown"),
        (vec!["run", "--model", d, "--ids", "1,99999"], "--ids: token 99999 is outside the vocabulary of 768"),
        (vec!["run", "--model", d], "--prompt"),
        (vec!["run", "--model", d, "--prompt", "x", "--gen", "4000000000"], "beyond the model's context of 4096"),
        (vec!["inspect"], "--model"),
        (vec!["run", "--model", d, "--prompt", "x", "--mem-gb", "1e12"], "--mem-gb"),
        (vec!["run", "--model", d, "--prompt", "x", "--readahead", "1000000"], "--readahead"),
        (vec!["run", "--model", d, "--prompt", "x", "--threads", "5000"], "--threads"),
        (vec!["serve", "--threads", "5000"], "--threads"),
    ] {
        let (code, _, err) = k3ring(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn help_and_version_exit_0() {
    let (code, out, _) = k3ring(&["--help"]);
    assert_eq!(code, 0);
    assert!(out.contains("inspect") && out.contains("run"));
    let (code, out, _) = k3ring(&["--version"]);
    assert_eq!(code, 0);
    assert!(out.starts_with("k3ring "));
}

#[test]
fn missing_model_directory_is_an_io_error() {
    let (code, _, err) = k3ring(&["run", "--model", "/nonexistent/k3", "--prompt", "x"]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("/nonexistent/k3"), "{err}");
}

/// Runs the binary with `RUST_LOG` set to `rust_log` (or removed); returns (exit code, stderr).
fn k3ring_with_rust_log(args: &[&str], rust_log: Option<&str>) -> (i32, String) {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_k3ring"));
    cmd.args(args).env_remove("RUST_LOG");
    if let Some(value) = rust_log {
        cmd.env("RUST_LOG", value);
    }
    let out = cmd.output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).into_owned())
}

// See: issue 12 (tracing events went nowhere: no subscriber was installed).
#[test]
fn warnings_reach_stderr_and_v_or_rust_log_choose_the_level() {
    let dir = tiny_dir();
    let run =
        ["run", "--model", dir.to_str().unwrap(), "--prompt", "x", "--gen", "2", "--top-k", "5", "--top-p", "0.9"];
    let warning = "k3ring: warning: --top-k and --top-p have no effect at --temperature 0 (greedy decoding); \
                   give a temperature above 0 to sample\n";
    let info = "k3ring: info: using ";
    let with = |extra: &[&str], rust_log: Option<&str>| {
        let (code, err) = k3ring_with_rust_log(&[&run[..], extra].concat(), rust_log);
        assert_eq!(code, 0, "{extra:?} {rust_log:?}: {err}");
        (err.contains(warning), err.contains(info), err)
    };
    let (warned, informed, err) = with(&[], None);
    assert!(warned && !informed, "warnings only by default: {err}");
    for v in [&["-v"][..], &["-vv"], &["-v", "-v", "-v"]] {
        let (warned, informed, err) = with(v, None);
        assert!(warned && informed, "{v:?} adds info: {err}");
    }
    let (warned, informed, err) = with(&["-v"], Some("error"));
    assert!(!warned && !informed, "RUST_LOG replaces -v: {err}");
    let (warned, informed, err) = with(&[], Some("info"));
    assert!(warned && informed, "RUST_LOG=info: {err}");
    let (warned, informed, err) = with(&[], Some("k3ring=nonsense"));
    assert!(warned && !informed, "a bad RUST_LOG falls back to -v: {err}");
    assert!(err.contains("k3ring: warning: RUST_LOG=\"k3ring=nonsense\" is not a valid filter ("), "{err}");
    assert!(err.contains("); using -v instead\n"), "{err}");
}

#[test]
fn debug_lines_name_their_module() {
    let (dir, trunk) = (tiny_dir(), pack(&tiny_dir()));
    let (d, t) = (dir.to_str().unwrap(), trunk.path().to_str().unwrap());
    let args = ["run", "--model", d, "--trunk", t, "--mem-gb", "0.01", "--prompt", "x", "--gen", "1", "-vv"];
    let (code, err) = k3ring_with_rust_log(&args, None);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("k3ring: debug: storage::io::align: DIO alignment "), "{err}");
    let (code, err) = k3ring_with_rust_log(&args[..args.len() - 1], None);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("k3ring: debug:"), "{err}");
}

// See: issue 12 (streaming flags were silently ignored without --trunk).
#[test]
fn a_resident_run_refuses_streaming_flags_even_at_their_defaults() {
    let dir = tiny_dir();
    let tmp = tempfile::tempdir().unwrap();
    let trace = tmp.path().join("t.json");
    let trace = trace.to_str().unwrap();
    let flags: [&[&str]; 21] = [
        &["--mem-gb", "1"],
        &["--preset", "laptop"],
        &["--io", "uring"],
        &["--io", "pread"],
        &["--queue-depth", "32"],
        &["--readahead", "1"],
        &["--no-mlock"],
        &["--verify-reads"],
        &["--trunk-share", "0.5"],
        &["--numa-node", "0"],
        &["--compute-cores", "0"],
        &["--io-cores", "0"],
        &["--spec"],
        &["--no-spec"],
        &["--spec-margin", "0"],
        &["--spec-prev-token"],
        &["--policy", "even"],
        &["--policy", "s3fifo"],
        &["--mode", "pipelined"],
        &["--mode", "serial"],
        &["--trace", trace],
    ];
    let run = ["run", "--model", dir.to_str().unwrap(), "--prompt", "x", "--gen", "2"];
    for flag in flags {
        let (code, out, err) = k3ring(&[&run[..], flag].concat());
        assert_eq!(code, 2, "{flag:?}: {err}");
        assert_eq!(
            err,
            format!(
                "k3ring: error: {} needs --trunk DIR (a streaming run, from a pack made by `k3ring pack`); \
                 add --trunk DIR or drop the flag\n",
                flag[0]
            ),
            "{flag:?}"
        );
        assert!(out.is_empty(), "{flag:?} refused before generating: {out}");
    }
    let (code, _, err) = k3ring(&[&run[..], &["--mode", "serial", "--io", "uring", "--no-spec"]].concat());
    assert_eq!(code, 2, "{err}");
    assert_eq!(
        err,
        "k3ring: error: --io, --no-spec and --mode need --trunk DIR (a streaming run, from a pack made by \
         `k3ring pack`); add --trunk DIR or drop these flags\n"
    );
}

#[test]
fn a_resident_run_keeps_the_flags_it_honours() {
    let dir = tiny_dir();
    let tmp = tempfile::tempdir().unwrap();
    let dump = tmp.path().join("routes.txt");
    let run = ["run", "--model", dir.to_str().unwrap(), "--prompt", "x", "--gen", "2", "--ignore-eos"];
    let (code, _, err) = k3ring(&[&run[..], &["--threads", "1", "--dump-trace", dump.to_str().unwrap()]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("2 generated tokens"), "{err}");
    let routes = std::fs::read_to_string(&dump).unwrap();
    assert!(routes.starts_with("# k3ring expert trace v1 layers=13 experts=16 top_k=4"), "{routes}");
    // --print-placement shows what the placement flags would do, so they are accepted with it.
    let (code, out, err) = k3ring(
        &[&run[..], &["--print-placement", "--compute-cores", "0", "--io-cores", "1", "--io", "pread"]].concat(),
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "placement: NUMA node 0 | compute 1 threads on CPUs 0 | I/O on CPU 1\n");
}

/// `bench` on the tiny model at a 4 MB budget, 2 tokens after 1 unless `args` name `--tokens`
/// or `--warmup`, with `args` added: exit code, stdout, stderr and the `--json` report (`Null`
/// when it failed).
pub(crate) fn bench_tiny(args: &[&str]) -> (i32, String, String, serde_json::Value) {
    bench_on_tiny(&[("--tokens", "2"), ("--warmup", "1")], args)
}

/// [`bench_tiny`] with the flags `defaults` in place of its 2 tokens after 1 (each left out
/// where `args` name it; none: bench's own defaults).
pub(crate) fn bench_on_tiny(defaults: &[(&str, &str)], args: &[&str]) -> (i32, String, String, serde_json::Value) {
    let model = tiny_dir();
    let trunk = pack(&model);
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("b.json");
    let (m, t, j) = (model.to_str().unwrap(), trunk.path().to_str().unwrap(), json.to_str().unwrap());
    let common = ["bench", "--model", m, "--trunk", t, "--budgets", "0.004", "--device-reads", "8", "--json", j];
    let defaults = defaults.iter().filter(|(flag, _)| !args.contains(flag));
    let defaults: Vec<&str> = defaults.flat_map(|(flag, value)| [*flag, *value]).collect();
    let (code, out, err) = k3ring(&[&common[..], &defaults, args].concat());
    let v = std::fs::read(&json).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default();
    (code, out, err, v)
}

/// `bench --resident-once` measures the resident compute once, before the cells, and every
/// cell's floors use it; by default each repeat has its own, beside its cells.
#[test]
fn bench_resident_once_measures_no_resident_run_beside_the_cells() {
    let (code, out, err, v) = bench_tiny(&["--modes", "no-spec", "--resident-once", "--no-read-tax"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("resident compute beside the cells: not measured (--resident-once)"), "{out}");
    assert_eq!(v["resident_by_repeat"].as_array().map(Vec::len), Some(0), "{v}");
    let resident = v["resident_seconds_per_token"].as_f64().unwrap();
    for c in v["cells"].as_array().unwrap() {
        assert_eq!(c["floor_resident_seconds_per_token"].as_f64(), Some(resident), "{c}");
    }
    let (code, _, err, v) = bench_tiny(&["--modes", "no-spec", "--repeats", "2", "--no-read-tax"]);
    assert_eq!(code, 0, "{err}");
    let beside: Vec<f64> =
        v["resident_by_repeat"].as_array().unwrap().iter().map(|r| r["seconds_per_token"].as_f64().unwrap()).collect();
    assert_eq!(beside.len(), 2, "{v}");
    assert!(beside.contains(&v["cells"][0]["floor_resident_seconds_per_token"].as_f64().unwrap()), "{v}");
    assert_eq!(v["ids_identical"], true, "{v}");
}

/// `bench --no-verify-experts` reads experts without checking them, as `run` does with the
/// flag, so that the check's cost shows; its cells still match the resident ids.
#[test]
fn bench_without_the_expert_check_spends_nothing_on_it() {
    let (code, out, err, v) = bench_tiny(&["--modes", "no-spec", "--batch", "2", "--no-verify-experts"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("expert checksums: not checked (--no-verify-experts)"), "{out}");
    assert_eq!(v["experts_checked"], false, "{v}");
    assert_eq!(v["ids_identical"], true, "{v}");
    let cell = &v["cells"][0];
    assert!(cell["expert_bytes_per_token"].as_f64().unwrap() > 0.0, "{cell}");
    assert_eq!(cell["expert_verify_seconds_per_token"].as_f64(), Some(0.0), "{cell}");
    assert_eq!(cell["expert_verify_waiting_seconds_per_token"].as_f64(), Some(0.0), "{cell}");
    let batch = &v["batch"]["cells"][0];
    assert!(batch["expert_bytes_per_step"].as_f64().unwrap() > 0.0, "{batch}");
    assert_eq!(batch["expert_verify_seconds_per_step"].as_f64(), Some(0.0), "{batch}");
    assert_eq!(batch["expert_verify_waiting_seconds_per_step"].as_f64(), Some(0.0), "{batch}");
    assert_eq!(v["batch"]["ids_match_solo"], true, "{v}");
    // The read-tax probe ran (it is on by default): see the test below for the flag.
    assert_read_tax_measured(&v, &out, 1);
}

/// `bench --policy` runs its cells under that expert cache policy and says which; the default is
/// `even`, as for `run`.
#[test]
fn bench_names_the_expert_cache_policy_of_its_cells() {
    for (args, want) in [(&["--policy", "lru"][..], "lru"), (&["--policy", "cyclic"][..], "cyclic"), (&[][..], "even")]
    {
        let (code, out, err, v) = bench_tiny(&[&["--modes", "no-spec", "--no-read-tax"][..], args].concat());
        assert_eq!(code, 0, "{err}");
        assert_eq!(v["expert_cache_policy"], want, "{v}");
        assert!(out.contains(&format!("expert cache policy: {want} (--policy)")), "{out}");
        assert_eq!(v["ids_identical"], true, "{v}");
    }
    let (code, _, err, _) = bench_tiny(&["--policy", "mru"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--policy"), "{err}");
}

fn gain_of<'a>(gains: &'a [serde_json::Value], mode: &str) -> &'a serde_json::Value {
    gains.iter().find(|g| g["mode"] == mode).unwrap()
}

/// `bench --draft-ngram --draft-accept`: drafted cells beside the pipelined one, each with its
/// window's steps and guesses; full acceptance keeps every guess and reads fewer bytes per
/// token, none keeps none; every cell's ids start with the resident run's.
#[test]
fn bench_measures_drafted_cells_at_chosen_acceptances() {
    let (code, out, err, v) = bench_tiny(&[
        "--modes",
        "pipelined",
        "--draft-ngram",
        "--draft-accept",
        "0,100",
        "--draft-len",
        "3",
        "--tokens",
        "6",
        "--no-read-tax",
    ]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(v["ids_identical"], true, "{v}");
    let modes: Vec<&str> = v["cells"].as_array().unwrap().iter().map(|c| c["mode"].as_str().unwrap()).collect();
    assert_eq!(modes, ["pipelined", "draft-ngram", "draft-miss", "draft-replay-0%", "draft-replay-100%"]);
    let gains = v["drafting"].as_array().unwrap();
    assert_eq!(gains.len(), 4, "{v}");
    let miss = &gain_of(gains, "draft-miss")["stats"];
    assert!(miss["drafted"].as_u64().unwrap() <= 3 && miss["accepted"] == 0, "one draft, then a wait: {miss}");
    let gain = |mode: &str| gain_of(gains, mode);
    let (none, all) = (&gain("draft-replay-0%")["stats"], &gain("draft-replay-100%")["stats"]);
    assert!(none["drafted"].as_u64().unwrap() > 0 && none["accepted"] == 0, "{none}");
    assert_eq!(all["accepted"], all["drafted"], "{all}");
    assert!(all["steps"].as_u64().unwrap() * 2 <= 6, "3 guesses kept per step: {all}");
    // Fewer bytes per token when every guess is kept (2 steps for 6 tokens here); the ratio's
    // exact value moves with the prefetcher's timing-based admission (1.50-1.9 seen; 1.497 once
    // under a full parallel test run), so the bound leaves room for it.
    assert!(gain("draft-replay-100%")["bytes_ratio"].as_f64().unwrap() > 1.25, "{v}");
    assert!(out.contains("drafting at 0.004 GB, draft-replay-100%: 100% of"), "{out}");
    // A drafted cell's expert bytes are split per step (the floor without prediction needs
    // them), one entry per step however many tokens each chose.
    let drafted: Vec<&serde_json::Value> =
        v["cells"].as_array().unwrap().iter().filter(|c| c["draft"].is_object()).collect();
    assert_eq!(drafted.len(), 4, "{v}");
    for c in drafted {
        let steps = c["draft"]["steps"].as_u64().unwrap() as usize;
        assert_eq!(c["expert_bytes_by_step"].as_array().map_or(0, Vec::len), steps, "{c}");
    }
}

/// The read tax of a bench report was measured: `pairs` quiet/loaded pairs, each loaded run
/// beside a stream that really read, the host named, and every cell's host floors follow their
/// formula from the measured tax.
fn assert_read_tax_measured(v: &serde_json::Value, out: &str, pairs: usize) {
    assert!(out.contains("read tax (resident decode quiet vs with a stream of reads"), "{out}");
    assert!(v["host"]["cpu_model"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(v["host"]["isa"].as_str().is_some(), "{v}");
    // The many-token loop is named on AVX-512 hosts, and only there.
    let many = &v["host"]["many_tokens"];
    if v["host"]["isa"] == "avx512" {
        assert!(many == "tiles" || many == "passes", "{v}");
    } else {
        assert!(many.is_null(), "{v}");
    }
    let tax = &v["read_tax"];
    assert_eq!(tax["ids_identical"], true, "{tax}");
    let samples = tax["samples"].as_array().unwrap();
    assert_eq!(samples.len(), pairs, "{tax}");
    for s in samples {
        assert!(s["stream_bytes"].as_u64().unwrap() > 0, "the stream read nothing: {s}");
        assert!(s["stream_busy_seconds"].as_f64().unwrap() > 0.0, "{s}");
        assert!(s["read_rate"].as_f64().unwrap() > 0.0, "{s}");
        let (quiet, loaded) =
            (s["quiet_seconds_per_token"].as_f64().unwrap(), s["loaded_seconds_per_token"].as_f64().unwrap());
        assert!(quiet > 0.0 && loaded > 0.0, "{s}");
        let tau = (loaded - quiet) / loaded;
        assert!((s["tau"].as_f64().unwrap() - tau).abs() <= 1e-9, "{s}");
    }
    let per_gb = tax["seconds_per_gb"].as_f64().unwrap();
    assert!(tax["tau_min"].as_f64().unwrap() <= tax["tau"].as_f64().unwrap(), "{tax}");
    assert!(tax["tau"].as_f64().unwrap() <= tax["tau_max"].as_f64().unwrap(), "{tax}");
    for c in v["cells"].as_array().unwrap() {
        let get = |k: &str| c[k].as_f64().unwrap_or_else(|| panic!("{k} missing in {c}"));
        let resident = get("floor_resident_seconds_per_token");
        let bytes = get("trunk_bytes_per_token") + get("expert_bytes_per_token");
        let charged = per_gb.max(0.0) * bytes / 1e9;
        let floor_h = (bytes / get("device_read_rate_during")).max(resident + charged);
        assert!((get("floor_host_seconds_per_token") - floor_h).abs() <= 1e-9 * floor_h.max(1.0), "{c}");
        assert!(get("floor_host_seconds_per_token") >= get("floor_seconds_per_token") - 1e-12, "{c}");
        assert!((get("efficiency_host") - floor_h / get("seconds_per_token")).abs() <= 1e-9, "{c}");
        assert!((get("tax_seconds_per_token") - charged).abs() <= 1e-12, "{c}");
        // The split's parts come from their sources; the rest is what they leave.
        assert_eq!(get("compute_seconds_per_token"), resident, "{c}");
        assert_eq!(get("waited_seconds_per_token"), get("stall_seconds_per_token"), "{c}");
        assert_eq!(get("checks_seconds_per_token"), get("expert_verify_seconds_per_token"), "{c}");
        let parts = get("compute_seconds_per_token")
            + get("tax_seconds_per_token")
            + get("waited_seconds_per_token")
            + get("checks_seconds_per_token")
            + get("rest_seconds_per_token");
        assert!((parts - get("seconds_per_token")).abs() <= 1e-9, "{c}");
        assert!(get("floor_no_prediction_host_seconds_per_token") >= floor_h - 1e-12, "{c}");
        let idle = get("seconds_per_token") * (1.0 - get("io_busy_fraction"));
        assert!((get("device_idle_seconds_per_token") - idle).abs() <= 1e-9, "{c}");
        // What the device loses beside compute: the stream's rate beside compute against the
        // cell's device rate, over the compute and tax seconds.
        let (beside, rate) = (tax["read_rate"].as_f64().unwrap(), get("device_read_rate_during"));
        let slowed = (resident + charged) * (1.0 - beside / rate).max(0.0);
        assert!((get("device_slowed_seconds_per_token") - slowed).abs() <= 1e-9 * slowed.max(1.0), "{c}");
        let shared = shared_floor(bytes, resident, rate, beside, per_gb);
        let got = get("floor_shared_host_seconds_per_token");
        assert!((got - shared).abs() <= 1e-9 * shared.max(1.0), "{shared}: {c}");
        assert!((get("efficiency_shared_host") - shared / get("seconds_per_token")).abs() <= 1e-9, "{c}");
        assert!(get("floor_no_prediction_shared_host_seconds_per_token") >= shared - 1e-12, "{c}");
    }
    for c in v["batch"]["cells"].as_array().into_iter().flatten() {
        let get = |k: &str| c[k].as_f64().unwrap_or_else(|| panic!("{k} missing in {c}"));
        let bytes = get("trunk_bytes_per_step") + get("expert_bytes_per_step");
        let bound_h = (bytes / get("device_read_rate_during"))
            .max(get("resident_seconds_per_step") + per_gb.max(0.0) * bytes / 1e9);
        assert!((get("bound_host_seconds_per_step") - bound_h).abs() <= 1e-9 * bound_h.max(1.0), "{c}");
        let (rate, beside) = (get("device_read_rate_during"), tax["read_rate"].as_f64().unwrap());
        let shared = shared_floor(bytes, get("resident_seconds_per_step"), rate, beside, per_gb);
        let got = get("bound_shared_host_seconds_per_step");
        assert!((got - shared).abs() <= 1e-9 * shared.max(1.0), "{shared}: {c}");
    }
}

/// The host floor when the device reads at `beside` while compute runs and at `rate` after it:
/// the fastest of reading as much as it can beside compute (each GB costing compute `per_gb`)
/// and reading everything after compute.
fn shared_floor(bytes: f64, compute: f64, rate: f64, beside: f64, per_gb: f64) -> f64 {
    let beside = if beside > 0.0 { beside.min(rate) } else { rate };
    let tax = per_gb.max(0.0) / 1e9;
    let during = if beside * tax < 1.0 { (beside * compute / (1.0 - beside * tax)).min(bytes) } else { bytes };
    (compute + tax * during + (bytes - during) / rate).min(compute + bytes / rate)
}

/// `--no-read-tax` skips the probe: no tax, no host floors, and the report says so; without the
/// flag (the test above) every one is there.
#[test]
fn bench_without_the_read_tax_has_no_host_floors() {
    let (code, out, err, v) = bench_tiny(&["--modes", "no-spec", "--batch", "1", "--no-read-tax"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("read tax: not measured (--no-read-tax)"), "{out}");
    assert!(v["read_tax"].is_null(), "{v}");
    assert!(v["cells"][0].get("floor_host_seconds_per_token").is_none(), "{v}");
    assert!(v["batch"]["cells"][0]["bound_host_seconds_per_step"].is_null(), "{v}");
    assert!(v["host"]["cpu_model"].as_str().is_some(), "the host is named either way: {v}");
}

/// `--io sim:` runs every cell, the device probes and the read tax through the modeled
/// drives: same ids as the resident run, the device probed near the modeled rate, and the page
/// cache kept (the model copies from it).
#[test]
fn bench_on_a_modeled_device_reads_through_it() {
    let (code, out, err, v) = bench_tiny(&["--modes", "no-spec", "--io", "sim:1GB/s,20us x2"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("bench keeps the page cache: --io sim serves its reads from it"), "{err}");
    assert_eq!(v["ids_identical"], true, "{v}");
    assert_eq!(v["page_cache_dropped"], false, "{v}");
    assert_eq!(v["host"]["io"], "sim:1GB/s,20us,qd32x2", "{v}");
    assert_eq!(v["read_tax"]["backend"], "sim:1GB/s,20us,qd32x2", "{v}");
    // The tiny model's experts are small, so latency and copies keep the probe below the
    // modeled 2 GB/s; it can never beat it.
    for (_, rate) in v["device_read_rate"].as_array().unwrap().iter().map(|p| (p[0].clone(), p[1].as_f64().unwrap())) {
        assert!(rate > 0.0 && rate <= 2.0e9 * 1.05, "{v}");
    }
    assert!(v["cells"][0]["expert_bytes_per_token"].as_f64().unwrap() > 0.0, "{v}");
    assert!(out.contains("cells read through sim:1GB/s,20us,qd32x2"), "{out}");
}

/// `bench --batch` (issue 18): a cell per budget and batch size with its counters, bound and
/// ids check against solo runs. Nothing here is timed: only fields and the relations between
/// them are checked.
#[test]
fn bench_batch_cells_have_their_fields_and_match_solo_runs() {
    let model = tiny_dir();
    let (code, out, err, v) = bench_tiny(&["--modes", "pipelined", "--batch", "1,2"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("equal their solo runs: yes"), "{out}");
    assert_eq!(v["experts_checked"], true, "{v}");
    assert_eq!(v["cells"].as_array().unwrap().len(), 1, "the mode cell is still there");
    let batch = &v["batch"];
    assert_eq!(batch["ids_match_solo"], true, "{batch}");
    let cells = batch["cells"].as_array().unwrap();
    assert_eq!(cells.iter().map(|c| c["batch"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2]);
    let cfg = k3ring::config::Config::from_model_dir(&model).unwrap();
    let (experts, top_k) = (cfg.moe.n_experts as f64, cfg.moe.top_k as f64);
    for c in cells {
        for key in [
            "seconds_per_step",
            "tokens_per_second",
            "trunk_bytes_per_step",
            "trunk_bytes_per_token",
            "expert_bytes_per_step",
            "expert_bytes_per_token",
            "distinct_experts_per_layer_step",
            "expected_distinct_experts_per_layer_step",
            "expert_reads_per_layer_step",
            "device_read_rate_during",
            "resident_seconds_per_step",
            "bound_seconds_per_step",
            "efficiency",
        ] {
            assert!(c[key].as_f64().is_some(), "{key} missing in {c}");
        }
        assert_eq!(c["ids_match_solo"], true, "{c}");
        let b = c["batch"].as_f64().unwrap();
        let per_step = |k: &str| c[k].as_f64().unwrap();
        // Experts read from the shards are checked by default, and the check is timed (on the
        // compute path, or inside waits for reads).
        assert!(per_step("expert_bytes_per_step") > 0.0, "{c}");
        let checks = per_step("expert_verify_seconds_per_step") + per_step("expert_verify_waiting_seconds_per_step");
        assert!(checks > 0.0, "{c}");
        assert_eq!(per_step("trunk_bytes_per_token") * b, per_step("trunk_bytes_per_step"), "{c}");
        assert_eq!(per_step("expert_bytes_per_token") * b, per_step("expert_bytes_per_step"), "{c}");
        // Each MoE layer asks once per step for its rows' union: k experts for one row, at
        // most k per row for more.
        let distinct = per_step("distinct_experts_per_layer_step");
        if b == 1.0 {
            assert_eq!(distinct, top_k, "{c}");
        }
        assert!(distinct >= top_k && distinct <= (b * top_k).min(experts), "{c}");
        let expected = experts * (1.0 - (1.0 - top_k / experts).powf(b));
        assert!((per_step("expected_distinct_experts_per_layer_step") - expected).abs() < 1e-9, "{c}");
        let io = (per_step("trunk_bytes_per_step") + per_step("expert_bytes_per_step"))
            / per_step("device_read_rate_during");
        let bound = io.max(per_step("resident_seconds_per_step"));
        assert!((per_step("bound_seconds_per_step") - bound).abs() <= 1e-12 * bound.max(1.0), "{c}");
        assert!((per_step("efficiency") - bound / per_step("seconds_per_step")).abs() <= 1e-9, "{c}");
        assert_eq!(c["bound_by"], if io >= per_step("resident_seconds_per_step") { "device" } else { "compute" });
        // Without prediction, a layer's expert reads overlap only the expert compute after its
        // router: the rest of the resident step and the expert reads add up.
        let overlappable = per_step("resident_overlappable_seconds_per_step");
        assert!(overlappable > 0.0 && overlappable < per_step("resident_seconds_per_step"), "{c}");
        let serial = per_step("resident_seconds_per_step") - overlappable
            + per_step("expert_bytes_per_step") / per_step("device_read_rate_during");
        let bound_star = bound.max(serial);
        assert!((per_step("bound_no_prediction_seconds_per_step") - bound_star).abs() <= 1e-12 * bound_star, "{c}");
        let eff_star = per_step("efficiency_no_prediction");
        assert!((eff_star - bound_star / per_step("seconds_per_step")).abs() <= 1e-9, "{c}");
    }
    // One repeat: the budget's busy read rate is the fastest of its mode and batch cells'.
    let rates = v["device_rates_by_budget"].as_array().unwrap();
    assert_eq!(rates.len(), 1, "{v}");
    let fastest = v["cells"]
        .as_array()
        .unwrap()
        .iter()
        .chain(cells)
        .map(|c| c["read_rate_busy"].as_f64().unwrap())
        .fold(0.0f64, f64::max);
    assert_eq!(rates[0]["engine_busy"].as_f64().unwrap(), fastest, "{v}");
    let ratios = batch["ratios"].as_array().unwrap();
    assert_eq!(ratios.len(), 1, "{batch}");
    assert_eq!(ratios[0]["batch"], 2);
    assert_eq!(batch["resident_seconds_per_step"].as_array().unwrap().len(), 2);
    // Each size's resident step per operation class, held against the triad and the FMA peak
    // (measured wherever the kernels are not scalar: every host CI runs on).
    let peak = v["fma_peak_flops_per_second"].as_f64().expect("bench measures the FMA peak");
    let tables = batch["resident_attribution"].as_array().unwrap();
    assert_eq!(tables.iter().map(|t| t[0].as_u64().unwrap()).collect::<Vec<_>>(), [1, 2], "{batch}");
    for t in tables {
        let (b, table) = (t[0].as_f64().unwrap(), &t[1]);
        assert_eq!((table["per"].as_str(), table["fma_peak_flops_per_second"].as_f64()), (Some("step"), Some(peak)));
        let lm_head = table["rows"].as_array().unwrap().iter().find(|r| r["class"] == "lm_head").unwrap();
        // The head's bf16 weights, once per row of the step: 2 bytes and 2 flops per weight.
        assert_eq!(lm_head["flops_per_token"].as_f64().unwrap(), b * lm_head["bytes_per_token"].as_f64().unwrap());
        // Each class's roof is the longer of its bytes at the triad and its flops at the peak,
        // and the step's roof their sum.
        let triad = table["triad_bytes_per_second"].as_f64().unwrap();
        let mut sum = 0.0;
        for r in table["rows"].as_array().unwrap() {
            let (bytes, flops) = (r["bytes_per_token"].as_f64().unwrap(), r["flops_per_token"].as_f64().unwrap());
            let want = (bytes > 0.0 || flops > 0.0).then(|| (bytes / triad).max(flops / peak));
            assert_eq!(r["roof_seconds_per_token"].as_f64(), want, "{r}");
            sum += want.unwrap_or(0.0);
        }
        let roof = table["roof_seconds_per_token"].as_f64().unwrap();
        assert!((roof - sum).abs() <= 1e-12 * sum, "{table}");
        assert!(out.contains(&format!("resident step of {b} sequences by operation class")), "{out}");
    }
    assert!(out.contains("of the roof") && out.contains("FMA peak: "), "{out}");
}

#[test]
fn bench_refuses_a_zero_or_repeated_batch_size_naming_the_flag() {
    let model = tiny_dir();
    let m = model.to_str().unwrap();
    for (batch, needle) in [("0", "--batch"), ("1,0", "--batch"), ("4,1,4", "--batch: 4 is given twice")] {
        let (code, _, err) = k3ring(&["bench", "--model", m, "--trunk", m, "--budgets", "1", "--batch", batch]);
        assert_eq!(code, 2, "--batch {batch}: {err}");
        assert!(err.contains(needle), "--batch {batch}: {err}");
    }
}

// Issue 16: flags mean one thing in every subcommand.

fn json_value(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

/// `--json FILE` writes the report to FILE (stdout keeps its text); `--json -` puts the report,
/// alone, on stdout. The same in inspect, synth, cache-sim and run.
#[test]
fn json_takes_a_file_or_dash_for_stdout_in_every_subcommand() {
    let dir = tiny_dir();
    let d = dir.to_str().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let file = |name: &str| tmp.path().join(name).to_str().unwrap().to_owned();
    let routes = file("routes.txt");
    let run = ["run", "--model", d, "--prompt", "Hello", "--gen", "3", "--ignore-eos"];
    let (code, _, err) = k3ring(&[&run[..], &["--dump-trace", &routes]].concat());
    assert_eq!(code, 0, "{err}");
    let synth_out = file("synth");
    let cases: [(Vec<&str>, &str); 4] = [
        (vec!["inspect", "--model", d], "layer_map"),
        (vec!["synth", "--dims", "tiny", "--layers", "2", "--vocab", "512", "--out", &synth_out], "top_k"),
        (vec!["cache-sim", &routes], "rows"),
        (run.to_vec(), "generated_ids"),
    ];
    for (args, key) in cases {
        let path = file(&format!("{}.json", args[0]));
        let (code, text_out, err) = k3ring(&[&args[..], &["--json", &path]].concat());
        assert_eq!(code, 0, "{args:?}: {err}");
        assert!(!text_out.trim().is_empty(), "{args:?}: with --json FILE, stdout keeps the text");
        let from_file = json_value(&std::fs::read_to_string(&path).unwrap());
        assert!(from_file.get(key).is_some(), "{args:?}: {from_file}");
        let (code, out, err) = k3ring(&[&args[..], &["--json", "-"]].concat());
        assert_eq!(code, 0, "{args:?}: {err}");
        let from_stdout = json_value(&out);
        assert!(from_stdout.get(key).is_some(), "{args:?}: {out}");
    }
    let (_, out, _) = k3ring(&[&run[..], &["--json", "-"]].concat());
    let report = json_value(&out);
    assert!(report["text"].is_string(), "the report holds the text that stdout would have had");
}

/// A bad output path fails before any work (exit 4 naming the flag and path); stdout is empty.
#[test]
fn output_files_are_checked_before_the_work_starts() {
    let dir = tiny_dir();
    let d = dir.to_str().unwrap();
    let bad = "/nonexistent-k3ring-dir/out.json";
    let run = ["run", "--model", d, "--prompt", "Hello", "--gen", "3"];
    for (args, flag) in [
        ([&run[..], &["--json", bad]].concat(), "--json"),
        ([&run[..], &["--dump-trace", bad]].concat(), "--dump-trace"),
        (vec!["inspect", "--model", d, "--json", bad], "--json"),
        (vec!["cache-sim", "/nonexistent-trace", "--json", bad], "--json"),
        (vec!["tune", "--model", d, "--trunk", d, "--mem-gb", "1", "--json", bad], "--json"),
        (vec!["tune", "--model", d, "--trunk", d, "--mem-gb", "1", "--csv", bad], "--csv"),
        (vec!["bench", "--model", d, "--trunk", d, "--budgets", "1", "--json", bad], "--json"),
        (vec!["batch", "--model", d, "--input", "-", "--output", "-", "--json", bad], "--json"),
    ] {
        let (code, out, err) = k3ring(&args);
        assert_eq!(code, 4, "{args:?}: {err}");
        assert!(err.contains(&format!("{flag} {bad}: cannot create the file")), "{args:?}: {err}");
        assert!(out.is_empty(), "{args:?}: nothing generated before the refusal: {out}");
    }
    // A directory is no output file: refused at once too, as a usage error (the output rule).
    let tmp = tempfile::tempdir().unwrap();
    let (code, out, err) = k3ring(&[&run[..], &["--json", tmp.path().to_str().unwrap()]].concat());
    assert_eq!(code, 2, "{err}");
    assert!(err.contains(&format!("--json {}: is a directory", tmp.path().display())) && out.is_empty(), "{err}");
    let (code, _, err) = k3ring(&["batch", "--model", d, "--input", "-", "--output", "-", "--json", "-"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--json - and --output - would both write stdout"), "{err}");
}

#[test]
fn top_k_has_one_spelling_and_0_means_off() {
    let (code, out, _) = k3ring(&["synth", "--help"]);
    assert_eq!(code, 0);
    assert!(out.contains("--top-k <K>") && !out.contains("--topk"), "{out}");
    let (code, out, _) = k3ring(&["run", "--help"]);
    assert_eq!(code, 0);
    assert!(out.contains("0: off"), "{out}");
    // The old spelling still parses (hidden), and refuses the same values.
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x");
    let (code, _, err) = k3ring(&["synth", "--out", out.to_str().unwrap(), "--dims", "tiny", "--topk", "0"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--top-k: must be at least 1"), "{err}");
    let dir = tiny_dir();
    let sampled = |extra: &[&str]| {
        let run = ["run", "--model", dir.to_str().unwrap(), "--prompt", "Hello", "--gen", "12", "--ignore-eos"];
        let sampling = ["--temperature", "0.9", "--seed", "7", "--json", "-"];
        let (code, out, err) = k3ring(&[&run[..], &sampling[..], extra].concat());
        assert_eq!(code, 0, "{err}");
        ids(&json_value(&out)["generated_ids"])
    };
    assert_eq!(sampled(&["--top-k", "0"]), sampled(&[]), "--top-k 0 samples from every token");
    assert_ne!(sampled(&["--top-k", "1"]), sampled(&[]), "--top-k 1 is greedy, not off");
}

#[test]
fn prompt_file_dash_reads_stdin() {
    let dir = tiny_dir();
    let run = ["run", "--model", dir.to_str().unwrap(), "--gen", "4", "--ignore-eos", "--json", "-"];
    let (code, out, err) = k3ring_stdin(&[&run[..], &["--prompt-file", "-"]].concat(), "Once upon a time");
    assert_eq!(code, 0, "{err}");
    let from_stdin = json_value(&out);
    let (code, out, err) = k3ring(&[&run[..], &["--prompt", "Once upon a time"]].concat());
    assert_eq!(code, 0, "{err}");
    let from_flag = json_value(&out);
    assert_eq!(ids(&from_stdin["prompt_ids"]), ids(&from_flag["prompt_ids"]));
    assert_eq!(ids(&from_stdin["generated_ids"]), ids(&from_flag["generated_ids"]));
}

#[test]
fn run_prints_tokens_per_second_and_no_rate_for_gen_0() {
    let dir = tiny_dir();
    let run = ["run", "--model", dir.to_str().unwrap(), "--prompt", "Hello", "--ignore-eos", "--gen"];
    let (code, _, err) = k3ring(&[&run[..], &["4"]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(err.contains(" s/token, ") && err.contains(" tokens/s"), "{err}");
    let (code, _, err) = k3ring(&[&run[..], &["0"]].concat());
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("0 generated tokens") && err.contains("no tokens decoded"), "{err}");
    assert!(!err.contains("s/token") && !err.contains("tokens/s"), "{err}");
}

#[test]
fn sizes_are_printed_in_gb_not_mib() {
    let (dir, trunk) = (tiny_dir(), pack(&tiny_dir()));
    let (d, t) = (dir.to_str().unwrap(), trunk.path().to_str().unwrap());
    let (code, _, err) =
        k3ring(&["run", "--model", d, "--trunk", t, "--mem-gb", "0.0014", "--prompt", "x", "--gen", "2"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("plan: budget 0.00140 GB"), "{err}");
    // The lines with budgets and byte counts (the device line may speak of chunk sizes).
    let starts = ["k3ring: plan:", "k3ring: storage", "k3ring: pipeline"];
    let sized = |l: &&str| starts.iter().any(|s| l.starts_with(s)) || l.contains(" prompt + ");
    for line in err.lines().filter(sized) {
        for unit in ["KiB", "MiB", "GiB"] {
            assert!(!line.contains(unit), "{unit} in: {line}");
        }
    }
    assert_eq!(err.lines().filter(sized).count(), 4, "{err}");
    // Every line of the run: sizes in the decimal family, rates in GB/s.
    for line in err.lines() {
        for unit in ["KiB", "MiB", "GiB", "MB/s"] {
            assert!(!line.contains(unit), "{unit} in: {line}");
        }
    }
    assert!(err.contains("GB/s"), "{err}");
    // pack and synth summaries too.
    let tmp = tempfile::tempdir().unwrap();
    let (model, out) = (tmp.path().join("m"), tmp.path().join("t"));
    let (m, o) = (model.to_str().unwrap(), out.to_str().unwrap());
    for args in [
        &["synth", "--dims", "tiny", "--out", m][..],
        &["pack", "--model", m, "--out", o],
        &["pack", "--model", m, "--out", o, "--verify"],
    ] {
        let (code, stdout, err) = k3ring(args);
        assert_eq!(code, 0, "{args:?}: {err}");
        assert!(stdout.contains(" GB"), "{args:?}: {stdout}");
        for unit in ["KiB", "MiB", "MB/s", " MB"] {
            assert!(!stdout.contains(unit), "{unit} in {args:?}: {stdout}");
        }
    }
    let (code, out, err) = k3ring(&["inspect", "--model", d]);
    assert_eq!(code, 0, "{err}");
    assert!(!out.contains("KiB") && !out.contains("MiB") && out.contains(" kB"), "{out}");
}

#[test]
fn every_subcommand_takes_negative_numbers_the_same_way() {
    // A negative value reaches the flag's own check (a clean "invalid value" for the flag),
    // rather than being taken for an unknown flag.
    let dir = tiny_dir();
    let d = dir.to_str().unwrap();
    for args in [
        vec!["run", "--model", d, "--prompt", "x", "--seed", "-1"],
        vec!["synth", "--out", "/nonexistent", "--seed", "-1"],
        vec!["cache-sim", "/nonexistent", "--expert-mb", "-1"],
        vec!["tune", "--model", d, "--trunk", d, "--mem-gb", "-1"],
        vec!["bench", "--model", d, "--trunk", d, "--budgets", "-1"],
        vec!["demo", "--budget-share", "-1"],
    ] {
        let (code, _, err) = k3ring(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains("invalid value '-1'"), "{args:?}: {err}");
        assert!(!err.contains("unexpected argument"), "{args:?}: {err}");
    }
}

#[test]
fn tune_refuses_a_split_outside_0_to_1() {
    let d = tiny_dir();
    let d = d.to_str().unwrap();
    for split in ["2", "0", "-0.5"] {
        let (code, _, err) = k3ring(&["tune", "--model", d, "--trunk", d, "--mem-gb", "1", "--splits", split]);
        assert_eq!(code, 2, "--splits {split}: {err}");
        assert!(err.contains("is not a share of the budget in (0, 1]"), "--splits {split}: {err}");
    }
}

/// Reads a `--logits` file: (header, rows of f32 for layout "full").
fn read_logits(path: &std::path::Path) -> (serde_json::Value, Vec<Vec<f32>>) {
    let raw = std::fs::read(path).unwrap();
    let end = raw.iter().position(|&b| b == b'\n').unwrap();
    let header: serde_json::Value = serde_json::from_slice(&raw[..end]).unwrap();
    let cols = header["cols"].as_u64().unwrap() as usize;
    let values: Vec<f32> = raw[end + 1..].chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(values.len() % cols.max(1), 0);
    (header, values.chunks(cols).map(<[f32]>::to_vec).collect())
}

/// The bound docs/LOGITS.md documents.
const LOGITS_REL_TOL: f64 = 3e-3;

#[test]
fn logits_of_the_tiny_model_match_the_reference() {
    let dir = tiny_dir();
    let r = reference_json(&dir);
    let refs = reference_tensors(&dir);
    let prompt = ids(&r["prompt_ids"]);
    let greedy = ids(&r["greedy_ids"]);
    let list: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let tmp = tempfile::tempdir().unwrap();
    let (path, top_path) = (tmp.path().join("logits.bin"), tmp.path().join("top.bin"));
    let run = ["run", "--model", dir.to_str().unwrap(), "--ids", &list.join(","), "--ignore-eos", "--json", "-"];
    let gen = greedy.len().to_string();
    let (code, out, err) = k3ring(&[&run[..], &["--gen", &gen, "--logits", path.to_str().unwrap()]].concat());
    assert_eq!(code, 0, "{err}");
    assert_eq!(ids(&json_value(&out)["generated_ids"]), greedy, "--logits leaves the tokens unchanged");
    let (h, rows) = read_logits(&path);
    let (p, v) = (prompt.len(), 768);
    assert_eq!((h["format"].as_str(), h["version"].as_u64()), (Some("k3ring-logits"), Some(1)));
    assert_eq!(h["rows"].as_u64().unwrap() as usize, p + greedy.len() - 1);
    assert_eq!((h["vocab"].as_u64(), h["cols"].as_u64(), h["prompt_rows"].as_u64()), (Some(768), Some(768), Some(18)));
    assert_eq!(ids(&h["ids"]), [&prompt[..], &greedy[..greedy.len() - 1]].concat());
    let fp = k3ring::engine::Fingerprint::of_dir(&dir).unwrap();
    assert_eq!(h["fingerprint_checkpoint"], format!("{:016x}", fp.checkpoint));
    let check = |row: &[f32], reference: &[f64], what: String| {
        let diff = rel_max_diff(row, reference);
        assert!(diff <= LOGITS_REL_TOL, "{what}: logits differ by {diff:e} (relative)");
        let best = reference.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
        assert_eq!(argmax(row), best, "{what}: argmax");
    };
    for (i, row) in rows[..p].iter().enumerate() {
        check(row, &refs["logits_prompt"].data[i * v..(i + 1) * v], format!("prompt row {i}"));
    }
    for k in 0..greedy.len() {
        check(&rows[p - 1 + k], &refs["logits_greedy"].data[k * v..(k + 1) * v], format!("generated step {k}"));
    }
    // --logits-top 5: the five largest of each row, ids then values.
    let (code, _, err) =
        k3ring(&[&run[..], &["--gen", "3", "--logits", top_path.to_str().unwrap(), "--logits-top", "5"]].concat());
    assert_eq!(code, 0, "{err}");
    let raw = std::fs::read(&top_path).unwrap();
    let end = raw.iter().position(|&b| b == b'\n').unwrap();
    let th: serde_json::Value = serde_json::from_slice(&raw[..end]).unwrap();
    assert_eq!((th["layout"].as_str(), th["cols"].as_u64(), th["rows"].as_u64()), (Some("top"), Some(5), Some(20)));
    let body = &raw[end + 1..];
    assert_eq!(body.len(), 20 * 5 * 8);
    for (i, row) in body.chunks_exact(40).enumerate() {
        let id = |j: usize| u32::from_le_bytes(row[4 * j..4 * j + 4].try_into().unwrap()) as usize;
        let val = |j: usize| f32::from_le_bytes(row[20 + 4 * j..24 + 4 * j].try_into().unwrap());
        assert_eq!(id(0) as u32, argmax(&rows[i]), "row {i}");
        for j in 0..5 {
            assert_eq!(val(j).to_bits(), rows[i][id(j)].to_bits(), "row {i} slot {j}");
        }
        assert!((1..5).all(|j| val(j - 1) >= val(j)), "row {i}: largest first");
    }
    let (code, _, err) = k3ring(&[&run[..], &["--logits-top", "5"]].concat());
    assert_eq!(code, 2, "--logits-top needs --logits: {err}");
    let state = tmp.path().join("s.state");
    let with_state = ["--logits", path.to_str().unwrap(), "--save-state", state.to_str().unwrap()];
    let (code, _, err) = k3ring(&[&run[..], &with_state[..]].concat());
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--logits does not go with --load-state or --save-state"), "{err}");
}

#[test]
fn run_ids_works_on_a_model_without_tokenizer_files() {
    let (_tmp, dir) = crate::checkpoint_tests::copy_tiny();
    for name in ["tiktoken.model", "tokenizer_config.json", "reference.json"] {
        std::fs::remove_file(dir.join(name)).unwrap();
    }
    let d = dir.to_str().unwrap();
    let (code, out, err) = k3ring(&["run", "--model", d, "--ids", "1,2,3", "--gen", "3", "--ignore-eos"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(err.matches("no tokenizer (").count(), 1, "said once: {err}");
    let printed: Vec<&str> = out.trim_end().split_inclusive('>').collect();
    assert_eq!(printed.len(), 3, "three ids, as <id>: {out}");
    assert!(printed.iter().all(|p| p.starts_with('<') && p[1..p.len() - 1].parse::<u32>().is_ok()), "{out}");
    // Text still needs the tokenizer: refused naming the missing file.
    let (code, _, err) = k3ring(&["run", "--model", d, "--prompt", "hello", "--gen", "1"]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("tiktoken.model") && err.contains("give token ids (--ids)"), "{err}");
}

#[test]
fn speculation_flags_the_mode_switches_off_are_refused_not_dropped() {
    let dir = tiny_dir();
    let trunk = pack(&dir);
    let (d, t) = (dir.to_str().unwrap(), trunk.path().to_str().unwrap());
    let base = ["run", "--model", d, "--trunk", t, "--mem-gb", "0.05", "--prompt", "x", "--gen", "1"];
    for (extra, needle) in [
        (&["--mode", "serial", "--spec-fixed"][..], "--spec-fixed does nothing with --mode serial"),
        (&["--mode", "serial", "--spec", "--spec-margin", "4"], "--spec, --spec-margin do nothing with --mode serial"),
        (&["--no-spec", "--spec-prev-token"], "--spec-prev-token tunes the prediction that --no-spec turns off"),
        (&["--spec-margin", "1000000"], "--spec-margin"),
    ] {
        let (code, _, err) = k3ring(&[&base[..], extra].concat());
        assert_eq!(code, 2, "{extra:?}: {err}");
        assert!(err.contains(needle), "{extra:?}: {err}");
    }
    for extra in
        [&["--mode", "serial"][..], &["--no-spec"], &["--spec-margin", "4", "--spec-fixed", "--spec-prev-token"]]
    {
        let (code, _, err) = k3ring(&[&base[..], extra].concat());
        assert_eq!(code, 0, "{extra:?}: {err}");
    }
}

#[test]
fn bos_comes_from_the_config_with_or_without_a_tokenizer() {
    let (_tmp, dir) = crate::checkpoint_tests::copy_tiny();
    let d = dir.to_str().unwrap();
    let prompt_ids = |extra: &[&str]| {
        let mut args = vec!["run", "--model", d, "--ids", "1,2,3", "--gen", "0", "--json", "-"];
        args.extend_from_slice(extra);
        let (code, out, err) = k3ring(&args);
        assert_eq!(code, 0, "{err}");
        ids(&json_value(&out)["prompt_ids"])
    };
    // The tiny config's bos_token_id is 512, the tokenizer's [BOS].
    assert_eq!(prompt_ids(&["--bos"]), [512, 1, 2, 3]);
    assert_eq!(prompt_ids(&[]), [1, 2, 3]);
    // Without tokenizer files --bos was silently dropped.
    for name in ["tiktoken.model", "tokenizer_config.json"] {
        std::fs::remove_file(dir.join(name)).unwrap();
    }
    assert_eq!(prompt_ids(&["--bos"]), [512, 1, 2, 3]);
}

#[test]
fn a_tokenizer_with_ids_beyond_the_vocabulary_is_refused_naming_its_file() {
    let (_tmp, dir) = crate::checkpoint_tests::copy_tiny();
    let path = dir.join("tokenizer_config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let added = v["added_tokens_decoder"].as_object_mut().unwrap();
    let open = added.remove("512").unwrap();
    added.insert("900".into(), open);
    std::fs::write(&path, v.to_string()).unwrap();
    let (code, _, err) = k3ring(&["run", "--model", dir.to_str().unwrap(), "--prompt", "hi", "--gen", "1"]);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("tokenizer_config.json") && err.contains("id 900") && err.contains("vocabulary of 768"),
        "{err}"
    );
}

#[test]
fn json_text_marks_ids_the_tokenizer_has_no_text_for_as_the_stream_does() {
    let (_tmp, dir) = crate::checkpoint_tests::copy_tiny();
    let path = dir.join("tokenizer_config.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    // The added tokens from 540 up gone: the model can still emit those ids (they are inside its
    // vocabulary), the tokenizer has no text for them.
    v["added_tokens_decoder"].as_object_mut().unwrap().retain(|id, _| id.parse::<u32>().unwrap() < 540);
    std::fs::write(&path, v.to_string()).unwrap();
    let args = ["run", "--model", dir.to_str().unwrap(), "--prompt", "Once upon a time", "--gen", "16", "--json", "-"];
    let (code, out, err) = k3ring(&args);
    assert_eq!(code, 0, "the report once failed here after the tokens were printed: {err}");
    let report = json_value(&out);
    let generated = ids(&report["generated_ids"]);
    let text = report["text"].as_str().unwrap();
    let unnamed: Vec<u32> = generated.iter().copied().filter(|&id| id >= 540).collect();
    assert!(!unnamed.is_empty(), "this prompt generates an id without text: {generated:?}");
    for id in unnamed {
        assert!(text.contains(&format!("<{id}>")), "id {id} is marked in {text:?}");
    }
}

#[test]
fn a_random_model_says_so_before_its_text() {
    let note = "k3ring: note: this model has random weights";
    let dir = tiny_dir();
    let (code, _, err) = k3ring(&["run", "--model", dir.to_str().unwrap(), "--prompt", "Hi", "--gen", "2"]);
    assert_eq!(code, 0, "{err}");
    assert!(err.starts_with(note), "first thing on stderr: {err}");
    let (_tmp, copy) = crate::checkpoint_tests::copy_tiny();
    std::fs::remove_file(copy.join("reference.json")).unwrap();
    let (code, _, err) = k3ring(&["run", "--model", copy.to_str().unwrap(), "--prompt", "Hi", "--gen", "2"]);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains(note), "a model not known to be random: {err}");
}

/// The long flags of `k3ring <sub> --help` (global ones aside).
fn help_flags(sub: &str) -> Vec<String> {
    let (code, out, err) = k3ring(&[sub, "--help"]);
    assert_eq!(code, 0, "{err}");
    let mut flags = Vec::new();
    for line in out.lines().map(str::trim_start).filter(|l| l.starts_with('-')) {
        let Some(at) = line.find("--") else { continue };
        let name: String = line[at..].chars().skip(2).take_while(|c| c.is_ascii_alphanumeric() || *c == '-').collect();
        if !["help", "verbose", "version"].contains(&name.as_str()) {
            flags.push(format!("--{name}"));
        }
    }
    flags
}

/// The usage lines of `sub` in docs/USAGE.md: each code-block line starting `k3ring <sub>` and
/// the indented lines after it.
fn readme_usage(readme: &str, sub: &str) -> String {
    let mut out = String::new();
    let mut in_block = false;
    let mut taking = false;
    for line in readme.lines() {
        if line.starts_with("```") {
            in_block = !in_block;
            taking = false;
            continue;
        }
        if !in_block {
            continue;
        }
        if let Some(rest) = line.strip_prefix("k3ring ") {
            taking = rest.split_whitespace().next() == Some(sub);
        } else if !line.starts_with(' ') {
            taking = false;
        }
        if taking {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

#[test]
fn readme_usage_lines_list_every_flag_of_help() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    let usage_doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/USAGE.md")).unwrap();
    let subs =
        ["demo", "inspect", "plan", "run", "pack", "batch", "chat", "serve", "synth", "bench", "tune", "cache-sim"];
    for sub in subs {
        let usage = readme_usage(&usage_doc, sub);
        assert!(!usage.is_empty(), "no usage line for {sub}");
        for flag in help_flags(sub) {
            let listed = usage
                .match_indices(&flag)
                .any(|(at, _)| !usage[at + flag.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '-'));
            assert!(listed, "docs/USAGE.md's usage of `k3ring {sub}` lacks {flag}:\n{usage}");
        }
    }
    // Figures the program prints: the demo model's size.
    assert!(readme.contains("K3 model of 1.17 GB") && readme.contains("about 30 s"));
}

/// `bench` drops the whole system's page cache (as root): it says so before it starts, and
/// `--no-drop-caches` keeps the cache (and the notice away). The run here stops at once on a
/// missing model: only what is said up front is checked, nothing is measured.
#[test]
fn bench_says_it_drops_the_page_cache_and_can_keep_it() {
    let notice = "bench drops the whole system's page cache before every cell";
    let args = ["bench", "--model", "/nonexistent-k3ring-model", "--trunk", "/nonexistent", "--budgets", "1"];
    let (code, _, err) = k3ring(&args);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains(notice) && err.contains("--no-drop-caches keeps it"), "{err}");
    let (code, _, err) = k3ring(&[&args[..], &["--no-drop-caches"]].concat());
    assert_eq!(code, 4, "{err}");
    assert!(!err.contains(notice), "{err}");
}

/// A malformed modeled device is a usage error naming the flag and what is wrong, on every
/// subcommand that takes `--io`.
#[test]
fn a_bad_modeled_device_is_refused_naming_the_flag() {
    let trunk = pack(&tiny_dir());
    let (m, t) = (tiny_dir(), trunk.path().to_owned());
    let (m, t) = (m.to_str().unwrap(), t.to_str().unwrap());
    let run = ["run", "--model", m, "--trunk", t, "--mem-gb", "0.01", "--ids", "1", "--gen", "1"];
    for (io, says) in [("sim:7", "needs a unit"), ("sim:7GB/s x99", "1 to 64"), ("nvme", "not a read backend")] {
        let (code, _, err) = k3ring(&[&run[..], &["--io", io]].concat());
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("--io") && err.contains(says), "{io}: {err}");
    }
    let bench = ["bench", "--model", m, "--trunk", t, "--budgets", "0.01", "--io", "sim:fast"];
    let (code, _, err) = k3ring(&bench);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--io") && err.contains("needs a unit"), "{err}");
    // bench's probes and tax read through uring or the model: another backend is refused.
    let bench = ["bench", "--model", m, "--trunk", t, "--budgets", "0.01", "--io", "pread"];
    let (code, _, err) = k3ring(&bench);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--io pread: bench measures the disk through uring"), "{err}");
    let tune = ["tune", "--model", m, "--trunk", t, "--mem-gb", "0.01", "--io", "uring,sim:1GB/s,slow"];
    let (code, _, err) = k3ring(&tune);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--io") && err.contains("neither a latency"), "{err}");
}

/// The short flags llama.cpp users type (`-m -p -n -t -c`) and a hand-typed id list with spaces
/// do what the long forms do.
#[test]
fn short_flags_and_spaced_ids_equal_the_long_forms() {
    let dir = tiny_dir();
    let d = dir.to_str().unwrap();
    let gen = |args: &[&str]| {
        let (code, out, err) = k3ring(&[&["run", "--ignore-eos", "--no-draft", "--json", "-"][..], args].concat());
        assert_eq!(code, 0, "{args:?}: {err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        (ids(&v["prompt_ids"]), ids(&v["generated_ids"]))
    };
    let long = gen(&["--model", d, "--ids", "5,6,7", "--gen", "6", "--threads", "1"]);
    assert_eq!(long.1.len(), 6);
    assert_eq!(gen(&["-m", d, "--ids", "5, 6,  7", "-n", "6", "-t", "1"]), long);
    let text = gen(&["--model", d, "--prompt", "Once upon", "--gen", "3"]);
    assert_eq!(gen(&["-m", d, "-p", "Once upon", "-n", "3"]), text);
    // Not a number, even with the spaces trimmed: exit 2 naming the flag and the piece.
    let (code, _, err) = k3ring(&["run", "-m", d, "--ids", "5, x"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--ids") && err.contains("\" x\" is not a token id"), "{err}");
    // chat, batch and serve take -m, -t and -c too.
    for cmd in ["chat", "batch", "serve"] {
        let (code, help, _) = k3ring(&[cmd, "--help"]);
        assert_eq!(code, 0);
        for short in ["-m, --model", "-t, --threads", "-c, --context"] {
            assert!(help.contains(short), "{cmd} --help lacks {short}");
        }
    }
}

/// Added tokens (`<|reserved_token_N|>`, `[EOS]`, the chat markup) are not text: `run` leaves
/// them out of what it prints unless `--show-special`, and a batch's stop string never matches
/// inside one's spelling.
#[test]
fn special_tokens_are_not_text_unless_asked_and_stop_strings_never_match_them() {
    let run = |extra: &[&str]| {
        let (code, out, err) = k3ring(
            &[&["run", "-p", "Once upon a time", "-n", "16", "--ignore-eos", "--json", "-"][..], extra].concat(),
        );
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        (ids(&v["generated_ids"]), v["text"].as_str().unwrap().to_owned())
    };
    let (plain_ids, plain) = run(&[]);
    let (shown_ids, shown) = run(&["--show-special"]);
    assert_eq!(plain_ids, shown_ids);
    // The embedded tiny model's random weights choose reserved tokens here.
    assert!(shown.contains("<|reserved_token_"), "{shown}");
    assert!(!plain.contains("<|reserved_token_"), "{plain}");
    assert_eq!(
        plain,
        shown.split("<|reserved_token_").map(|p| p.split_once("|>").map_or(p, |(_, rest)| rest)).collect::<String>()
    );
    // stdout prints the same text.
    let (code, out, err) = k3ring(&["run", "-p", "Once upon a time", "-n", "16", "--ignore-eos"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim_end_matches('\n'), plain);
    let input = "{\"id\": 1, \"prompt\": \"Once upon a time\", \"max_tokens\": 16, \"stop\": \"<|reserved\"}\n";
    let (code, out, err) = k3ring_stdin(&["batch", "--input", "-", "--output", "-", "--ignore-eos"], input);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!((v["finish_reason"].as_str(), v["text"].as_str()), (Some("length"), Some(plain.as_str())), "{v}");
    assert_eq!(ids(&v["generated_ids"]), plain_ids);
}
