//! `pack --experts-to`: experts copied into one file per directory (one per drive), read from
//! all of them at once (issue 31). Outputs equal the shards' whatever the placement, the
//! number of directories and the backend; a missing, stale or damaged file is refused loudly.

use std::path::{Path, PathBuf};

use crate::checkpoint_tests::k3ring;
use crate::common::*;

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The generated ids of a streamed run of the tiny model, its stderr, and the exit code.
fn run_ids(trunk: &Path, budget: &str, extra: &[&str]) -> (i32, Vec<u32>, String) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("run.json");
    let model = tiny_dir();
    let args = ["run", "-m", s(&model), "--trunk", s(trunk), "--mem-gb", budget, "--ids", "5,6,7", "-n", "6"];
    let (code, _, err) = k3ring(&[&args[..], &["--ignore-eos", "--json", s(&json)], extra].concat());
    if code != 0 {
        return (code, Vec::new(), err);
    }
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    (code, ids(&v["generated_ids"]), err)
}

fn pack_experts(trunk: &Path, dirs: &[PathBuf], extra: &[&str]) -> (i32, String, String) {
    let list = dirs.iter().map(|d| s(d).to_owned()).collect::<Vec<_>>().join(",");
    let model = tiny_dir();
    k3ring(&[&["pack", "--model", s(&model), "--out", s(trunk), "--experts-to", &list][..], extra].concat())
}

/// A trunk pack of the tiny model with its experts packed `--even` into directories `a` and `b`
/// of a temporary directory: (trunk, that directory, [a, b]).
fn packed_even() -> (tempfile::TempDir, tempfile::TempDir, Vec<PathBuf>) {
    let trunk = pack(&tiny_dir());
    let tmp = tempfile::tempdir().unwrap();
    let dirs = vec![tmp.path().join("a"), tmp.path().join("b")];
    let (code, out, err) = pack_experts(trunk.path(), &dirs, &["--even"]);
    assert_eq!(code, 0, "{out}{err}");
    (trunk, tmp, dirs)
}

fn manifest(trunk: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(trunk.join("experts.manifest.json")).unwrap()).unwrap()
}

#[test]
fn experts_read_from_several_directories_give_the_shards_tokens() {
    let plain = pack(&tiny_dir());
    let want: Vec<(String, Vec<u32>)> = ["0.004", "0.01", "1"]
        .iter()
        .map(|b| {
            let (code, ids, err) = run_ids(plain.path(), b, &[]);
            assert_eq!(code, 0, "{err}");
            ((*b).to_owned(), ids)
        })
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    // Two directories on the same disk, then one, then three weighted 1:4:2.
    let layouts: [(&[&str], &[&str]); 3] =
        [(&["a", "b"], &["--even"]), (&["one"], &["--even"]), (&["x", "y", "z"], &["--expert-rates", "1,4,2"])];
    for (names, flags) in layouts {
        let trunk = pack(&tiny_dir());
        let dirs: Vec<PathBuf> = names.iter().map(|n| tmp.path().join(format!("{n}-{}", names.len()))).collect();
        let (code, out, err) = pack_experts(trunk.path(), &dirs, flags);
        assert_eq!(code, 0, "{out}{err}");
        assert!(out.contains(&format!("into {} files", dirs.len())), "{out}");
        for (budget, ids) in &want {
            for io in ["uring", "pread", "mmap"] {
                let (code, got, err) = run_ids(trunk.path(), budget, &["--io", io]);
                assert_eq!(code, 0, "{names:?} --mem-gb {budget} --io {io}: {err}");
                assert_eq!(&got, ids, "{names:?} --mem-gb {budget} --io {io}");
                if budget == "0.004" && io == "uring" {
                    assert!(err.contains("k3ring: devices | 0 shards and trunk: "), "{err}");
                    assert!(err.contains("% of the run) at "), "{err}");
                    let placement = if names.len() == 3 { "weighted" } else { "even" };
                    let line = format!("k3ring: experts {placement} over {} devices | 1 ", dirs.len());
                    assert!(err.contains(&line), "{err}");
                    for d in &dirs {
                        assert!(err.contains(&d.canonicalize().unwrap().display().to_string()), "{err}");
                    }
                }
            }
        }
        let m = manifest(trunk.path());
        let bytes: Vec<u64> =
            m["devices"].as_array().unwrap().iter().map(|d| d["expert_bytes"].as_u64().unwrap()).collect();
        if names.len() == 3 {
            // 1:4:2 within one expert per layer.
            let total: u64 = bytes.iter().sum();
            for (b, share) in bytes.iter().zip([1.0, 4.0, 2.0]) {
                let want = total as f64 * share / 7.0;
                assert!((*b as f64 - want).abs() <= total as f64 / 16.0, "{bytes:?}");
            }
        } else if names.len() == 2 {
            assert!(bytes[0].abs_diff(bytes[1]) <= bytes[0] / 8, "even: {bytes:?}");
        }
    }
}

#[test]
fn packing_experts_again_is_a_no_op_and_resumes_after_an_interruption() {
    let trunk = pack(&tiny_dir());
    let tmp = tempfile::tempdir().unwrap();
    let dirs = vec![tmp.path().join("a"), tmp.path().join("b")];
    // Rates probed on the directories themselves.
    let (code, out, err) = pack_experts(trunk.path(), &dirs, &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(err.contains("GB/s of random") && out.contains("0 kept"), "{out}{err}");
    assert_eq!(manifest(trunk.path())["placement"], "weighted");
    let (code, out, err) = pack_experts(trunk.path(), &dirs, &[]);
    assert!(code == 0 && out.contains("expert files are up to date") && !err.contains("GB/s of random"), "{out}{err}");
    // Another placement is another pack.
    let (code, out, err) = pack_experts(trunk.path(), &dirs, &["--even"]);
    assert!(code == 0 && out.contains("\ncopied "), "{out}{err}");
    assert_eq!(manifest(trunk.path())["placement"], "even");
    // An interrupted pack: the manifest (written last) and one device's file gone.
    std::fs::remove_file(trunk.path().join("experts.manifest.json")).unwrap();
    std::fs::remove_file(dirs[1].join("k3ring-experts.bin")).unwrap();
    let (code, out, err) = pack_experts(trunk.path(), &dirs, &["--even"]);
    assert!(code == 0 && out.contains("1 kept"), "{out}{err}");
    let (code, out, err) = pack_experts(trunk.path(), &dirs, &["--even", "--force"]);
    assert!(code == 0 && out.contains("0 kept"), "{out}{err}");
    let (code, _, err) = run_ids(trunk.path(), "0.004", &[]);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn a_missing_stale_or_damaged_expert_file_fails_the_run_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let setup = |name: &str| {
        let trunk = pack(&tiny_dir());
        let dirs = vec![tmp.path().join(format!("{name}-a")), tmp.path().join(format!("{name}-b"))];
        let (code, out, err) = pack_experts(trunk.path(), &dirs, &["--even"]);
        assert_eq!(code, 0, "{out}{err}");
        (trunk, dirs[1].join("k3ring-experts.bin"))
    };
    let (trunk, file) = setup("missing");
    std::fs::remove_file(&file).unwrap();
    let (code, _, err) = run_ids(trunk.path(), "0.004", &[]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(&file.display().to_string()) && err.contains("the expert file is missing"), "{err}");
    // Following the advice, as written, mends it.
    let advice = err.split("run `").nth(1).and_then(|a| a.split("` again").next()).unwrap();
    let words: Vec<&str> = advice.split_whitespace().collect();
    assert_eq!(words[..2], ["k3ring", "pack"], "{advice}");
    assert!(advice.ends_with("-b --even"), "{advice}");
    let (code, out, err) = k3ring(&words[1..]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(run_ids(trunk.path(), "0.004", &[]).0, 0);

    let (trunk, file) = setup("stale");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes.extend_from_slice(&[0u8; 4096]);
    std::fs::write(&file, &bytes).unwrap();
    let (code, _, err) = run_ids(trunk.path(), "0.004", &[]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains(&file.display().to_string()) && err.contains("stale"), "{err}");

    // A byte changed inside an expert (not one the open check samples): the expert's checksum
    // catches it on read.
    let (trunk, file) = setup("damaged");
    let m = manifest(trunk.path());
    let len = std::fs::metadata(&file).unwrap().len();
    let sampled = |at: u64| {
        if len <= 16 * 4096 {
            return true;
        }
        let stride = (len - 4096) / 15;
        (0..16).any(|i| (i * stride..i * stride + 4096).contains(&at))
    };
    // A piece on device 1 (directory b) with a byte the open check does not sample.
    let at = m["experts"].as_array().unwrap().iter().filter(|e| e["device"] == 1).find_map(|e| {
        let off = e["offset"].as_u64().unwrap();
        (off..off + e["len"].as_u64().unwrap()).find(|&b| !sampled(b) && !sampled(b + 63))
    });
    assert!(at.is_some(), "an expert with a byte the open check does not sample");
    if let Some(at) = at {
        let mut bytes = std::fs::read(&file).unwrap();
        // Only bytes of the expert's tensors are checked; flip one a run reads for sure.
        for b in bytes.iter_mut().skip(at as usize).take(64) {
            *b ^= 0x5a;
        }
        std::fs::write(&file, &bytes).unwrap();
        let (code, _, err) = run_ids(trunk.path(), "0.004", &["-n", "64"]);
        assert_eq!(code, 3, "{err}");
        assert!(err.contains("fails its checksum") && err.contains(&file.display().to_string()), "{err}");
        // A plain pack samples the file and finds nothing to do; the advice forces the rewrite.
        let advice = err.split("run `").nth(1).and_then(|a| a.split("` to rewrite").next()).unwrap();
        let words: Vec<&str> = advice.split_whitespace().collect();
        assert_eq!((words[..2].to_vec(), words.last()), (vec!["k3ring", "pack"], Some(&"--force")), "{advice}");
        let (code, out, err) = k3ring(&words[1..]);
        assert_eq!(code, 0, "{out}{err}");
        let (code, _, err) = run_ids(trunk.path(), "0.004", &["-n", "64"]);
        assert_eq!(code, 0, "{err}");
    }
}

#[test]
fn expert_placement_flags_are_checked() {
    let trunk = pack(&tiny_dir());
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    let (code, _, err) = pack_experts(trunk.path(), &[a.clone(), a.clone()], &["--even"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("names") && err.contains("twice"), "{err}");
    let (code, _, err) = pack_experts(trunk.path(), &[a.clone(), tmp.path().join("b")], &["--expert-rates", "1"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--expert-rates gives 1 rates for 2"), "{err}");
    let (code, _, err) = pack_experts(trunk.path(), &[a], &["--expert-rates", "0"]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = k3ring(&["pack", "--model", s(&tiny_dir()), "--out", s(trunk.path()), "--even"]);
    assert_eq!(code, 2, "--even without --experts-to: {err}");
    // Modeled expert drives need a modeled --io (alignment and warm-up are the model's).
    let (code, _, err) = run_ids(trunk.path(), "0.01", &["--device-io", "sim:1GB/s"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--device-io models the expert directories' drives; give --io sim:... too"), "{err}");
    let (code, _, err) = run_ids(trunk.path(), "0.01", &["--io", "sim:1GB/s", "--device-io", "uring"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--device-io uring: give a modeled device"), "{err}");
}

/// Modeled drives per device: two expert directories read through their own modeled drives
/// give the shards' tokens.
#[test]
fn modeled_drives_per_device_give_the_same_tokens() {
    let plain = pack(&tiny_dir());
    let (code, want, err) = run_ids(plain.path(), "0.004", &["--io", "sim:2GB/s"]);
    assert_eq!(code, 0, "{err}");
    let trunk = pack(&tiny_dir());
    let tmp = tempfile::tempdir().unwrap();
    let dirs = vec![tmp.path().join("a"), tmp.path().join("b")];
    let (code, out, err) = pack_experts(trunk.path(), &dirs, &["--expert-rates", "1,4"]);
    assert_eq!(code, 0, "{out}{err}");
    let flags = ["--io", "sim:2GB/s", "--device-io", "sim:1GB/s", "--device-io", "sim:4GB/s,10us"];
    let (code, got, err) = run_ids(trunk.path(), "0.004", &flags);
    assert_eq!(code, 0, "{err}");
    assert_eq!(got, want);
    assert!(err.contains("device 2: sim:4GB/s,10us"), "{err}");
}

/// A read that fails on one expert directory's device fails the run with the I/O class (exit 4),
/// naming that directory's file: the other devices' reads never stand in for it.
#[test]
fn a_read_failing_on_one_device_fails_the_run_with_exit_4_naming_its_file() {
    use k3ring::engine::{open_streaming, GenerateOptions};
    use k3ring::exit::ExitCode;
    use k3ring::pipeline::{IoKind, IoOptions};
    use k3ring::storage::io::sim::SimOptions;
    use kernels::{Isa, Kernels};

    use crate::streaming_tests::{minimum_budget, run_options};

    let model = tiny_dir();
    let (trunk, _tmp, dirs) = packed_even();
    let min = minimum_budget(&model, trunk.path());
    // Device 0 (shards and trunk) and device 1 (directory a) read through io_uring; device 2
    // (directory b) is the seeded simulator failing every read with EIO.
    let io = IoOptions {
        device_kinds: vec![IoKind::Uring, IoKind::Sim],
        sim: Some(SimOptions { eio_ppm: 1_000_000, ..SimOptions::fault_free(3) }),
        ..IoOptions::default()
    };
    let opened =
        open_streaming(&model, trunk.path(), &run_options(min, io), Kernels::with_isa(Isa::best()).unwrap(), |_| {});
    let err = match opened {
        Err(e) => anyhow::Error::new(e),
        Ok((o, _)) => {
            let opts = GenerateOptions { gen: 12, prefill_chunk: 8, ..Default::default() };
            match o.engine.generate(&prompt(), &opts, |_| {}) {
                Ok(g) => panic!("a device failing every read still generated {:?}", g.generated_ids),
                Err(e) => anyhow::Error::new(e),
            }
        }
    };
    let text = format!("{err:#}");
    assert_eq!(k3ring::error::exit_code_for(&err), ExitCode::Io, "{text}");
    let file = dirs[1].join("k3ring-experts.bin");
    assert!(text.contains(&file.display().to_string()) && text.contains("Input/output error"), "{text}");
}

/// The trace draws each device's reads on a track of its own (its I/O thread's).
#[test]
fn the_trace_has_a_read_track_per_device() {
    let (trunk, tmp, _dirs) = packed_even();
    let trace = tmp.path().join("trace.json");
    let (code, _, err) = run_ids(trunk.path(), "0.004", &["-n", "12", "--trace", s(&trace)]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&trace).unwrap()).unwrap();
    let events = v["traceEvents"].as_array().unwrap();
    let track = |thread: &str| {
        events
            .iter()
            .find(|e| e["ph"] == "M" && e["name"] == "thread_name" && e["args"]["name"] == format!("{thread}/io"))
            .map(|e| e["tid"].clone())
    };
    for thread in ["k3ring-io", "k3ring-io1", "k3ring-io2"] {
        let tid = track(thread).unwrap_or_else(|| panic!("no track {thread}"));
        let reads = events.iter().filter(|e| e["ph"] == "b" && e["tid"] == tid).count();
        assert!(reads > 0, "no reads on {thread}'s track");
    }
}

/// A manifest whose pieces point at one another's bytes is refused at open; a second pack
/// into an expert directory another pack holds is refused (exit 4) naming its lock.
#[test]
fn overlapping_pieces_and_a_concurrent_pack_are_refused() {
    let (trunk, _tmp, dirs) = packed_even();
    let path = trunk.path().join("experts.manifest.json");
    let mut m = manifest(trunk.path());
    let pieces = m["experts"].as_array_mut().unwrap();
    let on_a: Vec<usize> = (0..pieces.len()).filter(|&i| pieces[i]["device"] == 0).take(2).collect();
    // Two experts' pieces on directory a at the same bytes: each expert still tiles its image.
    pieces[on_a[1]]["offset"] = pieces[on_a[0]]["offset"].clone();
    std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
    let (code, _, err) = run_ids(trunk.path(), "0.004", &[]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("pieces overlap"), "{err}");

    let _held = k3ring::storage::pack::lock::PackLock::acquire_named(&dirs[1], "k3ring-experts.lock").unwrap();
    let (code, out, err) = pack_experts(trunk.path(), &dirs, &["--even", "--force"]);
    assert_eq!(code, 4, "{out}{err}");
    assert!(err.contains("k3ring-experts.lock"), "{err}");
}

/// `bench` over a trunk with expert files probes those files (the drives its cells read experts
/// from) and reports each cell's reads per device.
#[test]
fn bench_probes_the_expert_files_and_reports_each_device() {
    let (trunk, tmp, _dirs) = packed_even();
    let json = tmp.path().join("b.json");
    let model = tiny_dir();
    let args = [
        "bench",
        "--model",
        s(&model),
        "--trunk",
        s(trunk.path()),
        "--budgets",
        "0.004",
        "--modes",
        "no-spec",
        "--tokens",
        "2",
        "--warmup",
        "1",
        "--device-reads",
        "8",
        "--no-read-tax",
        "--json",
        s(&json),
    ];
    let (code, out, err) = k3ring(&args);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("reads of ") && out.contains(" from the expert files on 2 devices): "), "{out}");
    assert!(out.contains("devices at 0.004 GB, no-spec | 0 shards and trunk: "), "{out}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(v["device_probe_source"], "the expert files on 2 devices", "{v}");
    let devices = v["cells"][0]["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 3, "{v}");
    for d in &devices[1..] {
        assert!(d["bytes_per_token"].as_f64().unwrap() > 0.0, "{d}");
    }
    assert_eq!(v["ids_identical"], true, "{v}");
}
