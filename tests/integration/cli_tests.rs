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
        (vec!["run", "--model", d, "--prompt", "x", "--gen", "4000000000"], "are available"),
        (vec!["inspect"], "--model"),
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
        &["--policy", "lru"],
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
