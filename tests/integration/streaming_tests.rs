//! Streaming storage (issue 4): byte-identical output at every budget, backend and queue depth;
//! io_uring really used; faults give named errors and the documented exit codes; the simulated
//! store reproduces the fault-free output or fails cleanly for every seed.

use std::path::{Path, PathBuf};

use k3ring::engine::{open_streaming, GenerateOptions, Generation, StreamingRun};
use k3ring::pipeline::{IoKind, IoOptions, PipelineOptions};
use k3ring::storage::io::sim::SimOptions;
use k3ring::storage::io::FaultPlan;
use k3ring::storage::plan::Plan;
use k3ring::storage::stream::{StoreOptions, StreamStats};
use kernels::{Isa, Kernels};

use crate::checkpoint_tests::{copy_tiny, k3ring};
use crate::common::*;

const GEN: usize = 12;

pub(crate) fn run_options(budget: u64, io: IoOptions) -> StreamingRun {
    StreamingRun {
        budget_bytes: budget,
        sequences: 1,
        context: prompt().len() + GEN,
        chunk: 8,
        threads: 2,
        store: StoreOptions::default(),
        pipeline: PipelineOptions { io, ..PipelineOptions::default() },
        prefetch_window: None,
        placement: None,
        trace_detail: false,
        trunk_share: None,
        available_memory: None,
        drafting: Default::default(),
    }
}

fn streamed_with(model: &Path, trunk: &Path, run: &StreamingRun) -> Result<(Generation, Plan, StreamStats), String> {
    let (o, plan) = open_streaming(model, trunk, run, Kernels::with_isa(Isa::best()).unwrap(), |_| {})
        .map_err(|e| e.to_string())?;
    let opts = GenerateOptions { gen: GEN, keep_logits: true, prefill_chunk: 8, ..Default::default() };
    let g = o
        .engine
        .generate(&prompt(), &opts, |_| {})
        .map_err(|e| format!("{e}: {:?}", std::error::Error::source(&e).map(|s| s.to_string())))?;
    Ok((g, plan, o.engine.src.stats()))
}

fn resident() -> Generation {
    let o = open(&tiny_dir(), 2, Isa::best());
    let opts = GenerateOptions { gen: GEN, keep_logits: true, prefill_chunk: 8, ..Default::default() };
    o.engine.generate(&prompt(), &opts, |_| {}).unwrap()
}

fn same(a: &Generation, b: &Generation) -> bool {
    let bits = |g: &Generation| g.logits.iter().flatten().map(|v| v.to_bits()).collect::<Vec<_>>();
    a.generated_ids == b.generated_ids && bits(a) == bits(b)
}

/// The smallest budget the planner accepts for this run.
pub(crate) fn minimum_budget(model: &Path, trunk: &Path) -> u64 {
    let (_, plan, _) = streamed_with(model, trunk, &run_options(64_000_000, IoOptions::default())).unwrap();
    plan.minimum_bytes
}

#[test]
fn streamed_output_is_bit_identical_at_every_budget() {
    let model = tiny_dir();
    let trunk = pack(&model);
    let base = resident();
    let min = minimum_budget(&model, trunk.path());
    let (mut pinned_counts, mut hashed_by_products) = (Vec::new(), 0);
    for budget in [min, min + min / 5, min + min / 2, 2 * min, 3 * min, 64_000_000] {
        let (g, plan, stats) = streamed_with(&model, trunk.path(), &run_options(budget, IoOptions::default())).unwrap();
        assert!(same(&g, &base), "budget {budget}: output differs from the resident run ({})", plan.describe());
        assert!(plan.planned_bytes <= budget);
        assert_eq!(stats.trunk_streamed_units, plan.streamed.len());
        // Whole units and, with spread pins (the default), bytes of pieces pinned.
        pinned_counts.push((plan.pinned.len(), plan.pinned_piece_bytes));
        // Experts checked on the compute path are hashed by their products (those a wait began
        // are finished apart), to the checksum of the pack: a wrong sum would heal by reading
        // again, keeping the output, so no read may have been judged damaged.
        assert_eq!(stats.expert_reads_damaged, 0, "budget {budget}: a sound read judged damaged");
        hashed_by_products += stats.experts_verified_in_products;
    }
    assert!(hashed_by_products > 0, "no expert was hashed by its products");
    pinned_counts.dedup();
    assert!(pinned_counts.len() >= 3, "budgets should span streamed to pinned: {pinned_counts:?}");
    assert_eq!(pinned_counts.first(), Some(&(0, 0)), "the minimum budget streams every unit");
    assert!(pinned_counts.iter().any(|&(_, pieces)| pieces > 0), "no budget pinned pieces: {pinned_counts:?}");
    assert_eq!(*pinned_counts.last().unwrap(), (14, 0), "a large budget pins every unit");
}

#[test]
fn every_backend_and_queue_depth_gives_the_same_bytes() {
    let model = tiny_dir();
    let trunk = pack(&model);
    let base = resident();
    let min = minimum_budget(&model, trunk.path());
    let modeled = IoKind::parse("sim:2GB/s,30us,qd4 x3").unwrap();
    for io in [IoKind::Uring, IoKind::Pread, IoKind::Mmap, modeled] {
        for queue_depth in [1, 32] {
            let stream = IoOptions { kind: io, queue_depth, chunk_bytes: 4096, ..IoOptions::default() };
            let (g, _, stats) = streamed_with(&model, trunk.path(), &run_options(min + min / 3, stream)).unwrap();
            assert!(same(&g, &base), "{io:?} at queue depth {queue_depth} changed the output");
            assert!(stats.io.bytes_read > 0);
        }
    }
}

/// A modeled device (`--io sim:`) says what it models, delivers no faster than its drives
/// would (the refusal of a run whose bytes do not fit is `pipeline::tests`).
#[test]
fn a_modeled_device_says_what_it_models_and_reads_no_faster_than_its_drives() {
    let model = tiny_dir();
    let trunk = pack(&model);
    let min = minimum_budget(&model, trunk.path());
    let kind = IoKind::parse("sim:0.05GB/s,100us x2").unwrap();
    let stream = IoOptions { kind, ..IoOptions::default() };
    let (_, _, s) = streamed_with(&model, trunk.path(), &run_options(min, stream)).unwrap();
    assert_eq!(s.backend, "sim-device");
    assert!(s.backend_info.starts_with("sim:0.05GB/s,100us,qd32x2: 2 modeled drives"), "{}", s.backend_info);
    let busy = s.io.busy_ns as f64 / 1e9;
    assert!(s.io.bytes_read > 0 && busy > 0.0, "{:?}", s.io);
    assert!(s.io.bytes_read as f64 / busy <= 0.1e9 * 1.02, "faster than 2 drives of 0.05 GB/s: {:?}", s.io);
}

#[test]
fn io_uring_is_really_used_and_batches_submissions() {
    let model = tiny_dir();
    let trunk = pack(&model);
    let min = minimum_budget(&model, trunk.path());
    let stream = IoOptions { kind: IoKind::Uring, queue_depth: 32, chunk_bytes: 4096, ..IoOptions::default() };
    let (_, _, s) = streamed_with(&model, trunk.path(), &run_options(min, stream)).unwrap();
    assert_eq!(s.backend, "uring");
    assert!(s.io.sqes_submitted >= s.io.ops, "{:?}", s.io);
    assert!(s.io.enter_syscalls > 0, "{:?}", s.io);
    assert!(s.io.submit_syscalls < s.io.sqes_submitted, "SQEs were not batched: {:?}", s.io);
    assert!(s.trunk_reads > 0 && s.expert_reads > 0, "{s:?}");
    // The device delivered every tensor byte, and no more than the aligned windows asked for
    // (a window rounded up past the end of a file comes back short).
    assert!(s.io.bytes_read >= s.trunk_bytes_read + s.expert_bytes_read, "{s:?}");
    assert!(s.io.bytes_read <= s.trunk_bytes_read + s.expert_bytes_read_windows() + s.embed_bytes_read, "{s:?}");
}

#[test]
fn injected_short_reads_are_resubmitted_and_change_nothing() {
    let model = tiny_dir();
    let trunk = pack(&model);
    let base = resident();
    let min = minimum_budget(&model, trunk.path());
    for io in [IoKind::Uring, IoKind::Pread] {
        let stream = IoOptions {
            kind: io,
            chunk_bytes: 8192,
            inject: Some(FaultPlan { short_every: Some(3), eio_every: None }),
            ..IoOptions::default()
        };
        let (g, _, s) = streamed_with(&model, trunk.path(), &run_options(min, stream)).unwrap();
        assert!(same(&g, &base), "{io:?}");
        assert!(s.io.short_read_resubmits > 0, "{io:?}: no short read was injected");
    }
}

#[test]
fn injected_eio_fails_the_run_naming_file_and_offset() {
    let model = tiny_dir();
    let trunk = pack(&model);
    let min = minimum_budget(&model, trunk.path());
    let stream = IoOptions {
        kind: IoKind::Uring,
        inject: Some(FaultPlan { short_every: None, eio_every: Some(7) }),
        ..IoOptions::default()
    };
    let err = streamed_with(&model, trunk.path(), &run_options(min, stream)).unwrap_err();
    // The first read to fail may be the pack's or a shard's; either way the message names the
    // file, the offset and the OS error.
    assert!(err.contains(" at offset ") && err.contains("failed: Input/output error"), "{err}");
    assert!(err.contains(".safetensors failed") || err.contains("trunk.pack failed"), "{err}");
}

#[test]
fn sim_every_seed_reproduces_the_output_or_fails_with_a_named_error() {
    let model = tiny_dir();
    let trunk = pack(&model);
    let base = resident();
    let min = minimum_budget(&model, trunk.path());
    // The seed fixes each read's faults in submission order; the I/O thread's timing can still
    // change which read comes when, so a replayed seed reproduces the fault mix, not always the
    // exact interleaving.
    let seeds: Vec<u64> = match std::env::var("K3_SIM_SEED") {
        Ok(s) => vec![k3ring::storage::io::sim::parse_seed(&s).unwrap()],
        Err(_) => (1..=12).collect(),
    };
    let n_shards = 3;
    let (mut clean, mut failed) = (0, 0);
    for seed in seeds {
        // Odd seeds: only faults that must not change anything (latency, reordering, short
        // reads). Even seeds add failures and corruption at rates that fail some runs.
        let mut sim = SimOptions::fault_free(seed);
        sim.latency_max = 40;
        sim.short_ppm = 100_000;
        if seed % 2 == 0 {
            sim.eio_ppm = 300;
            sim.ecanceled_ppm = 200;
            sim.corrupt_ppm = 3_000;
        }
        sim.corruptible_files = vec![n_shards]; // the trunk pack, which is checksummed
        let stream = IoOptions { kind: IoKind::Sim, sim: Some(sim), ..IoOptions::default() };
        let mut run = run_options(min, stream);
        run.store.verify_every_read = true;
        match streamed_with(&model, trunk.path(), &run) {
            Ok((g, _, _)) => {
                assert!(
                    same(&g, &base),
                    "seed {seed}: a run that succeeded produced different output (replay: K3_SIM_SEED={seed})"
                );
                clean += 1;
            }
            Err(e) => {
                assert!(
                    seed % 2 == 0,
                    "seed {seed} had only benign faults but failed: {e} (replay: K3_SIM_SEED={seed})"
                );
                let named = e.contains("offset") || e.contains("checksum");
                assert!(named, "seed {seed}: unnamed failure {e} (replay: K3_SIM_SEED={seed})");
                failed += 1;
            }
        }
    }
    println!("sim seeds: {clean} reproduced the output, {failed} failed with a named error");
    assert!(clean >= 1, "no seed reproduced the output");
}

/// The shards are read only for experts, which are checksummed (issue 13): corrupting their
/// reads must end in the checksum error, never in a different output; unchecked, the same
/// corruption reaches the compute (so the check is what catches it): it changes the output, or a
/// flipped scale byte blows a value up into the engine's non-finite guard (or becomes 0xFF, which
/// the kernels refuse). Which happens depends on the bytes flipped and on the read order, which
/// follows the machine's timing; CI once saw the guard catch all six unchecked runs, so every
/// one of these outcomes counts as evidence.
#[test]
fn sim_corrupted_expert_reads_end_in_the_checksum_error() {
    let model = tiny_dir();
    let trunk = pack(&model);
    let base = resident();
    let min = minimum_budget(&model, trunk.path());
    let (mut caught, mut reached_compute) = (0, 0);
    for seed in 1..=6 {
        let mut sim = SimOptions::fault_free(seed);
        sim.latency_max = 20;
        sim.corrupt_ppm = 200_000;
        sim.corruptible_files = vec![0, 1, 2];
        for verify in [true, false] {
            let stream = IoOptions { kind: IoKind::Sim, sim: Some(sim.clone()), ..IoOptions::default() };
            let mut run = run_options(min, stream);
            run.store.verify_experts = verify;
            match streamed_with(&model, trunk.path(), &run) {
                Ok((g, _, _)) if verify => assert!(same(&g, &base), "seed {seed}: a checked run changed the output"),
                Ok((g, _, _)) => reached_compute += usize::from(!same(&g, &base)),
                Err(e) if verify => {
                    let named = e.contains("layer ") && e.contains(" expert ") && e.contains("fails its checksum");
                    assert!(named && e.contains(".safetensors"), "seed {seed}: {e}");
                    caught += 1;
                }
                // A flipped scale byte may also become 0xFF, which the kernels refuse.
                Err(e) if e.contains("non-finite hidden state") || e.contains("MXFP4 scale byte 0xFF") => {
                    reached_compute += 1
                }
                Err(e) => panic!("seed {seed}: unchecked, the corruption ended in an unexpected error: {e}"),
            }
        }
    }
    assert!(caught >= 3, "{caught} of 6 checked runs caught the corruption");
    assert!(reached_compute >= 1, "unchecked, the corruption never reached the compute: the test proves nothing");
}

fn streamed_cli(model: &Path, trunk: &Path, extra: &[&str]) -> (i32, String, String) {
    let mut args = vec![
        "run",
        "--model",
        model.to_str().unwrap(),
        "--trunk",
        trunk.to_str().unwrap(),
        "--mem-gb",
        "0.01",
        "--prompt",
        "Once upon a time",
        "--gen",
        "4",
    ];
    args.extend_from_slice(extra);
    k3ring(&args)
}

#[test]
fn corrupt_manifest_is_a_data_error() {
    let trunk = pack(&tiny_dir());
    std::fs::write(trunk.path().join("trunk.manifest.json"), b"{ not json").unwrap();
    let (code, _, err) = streamed_cli(&tiny_dir(), trunk.path(), &[]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("trunk.manifest.json") && err.contains("not a trunk manifest"), "{err}");
}

#[test]
fn incomplete_manifest_is_refused() {
    let trunk = pack(&tiny_dir());
    let path = trunk.path().join("trunk.manifest.json");
    let text = std::fs::read_to_string(&path).unwrap().replace("\"complete\": true", "\"complete\": false");
    std::fs::write(&path, text).unwrap();
    let (code, _, err) = streamed_cli(&tiny_dir(), trunk.path(), &[]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("incomplete"), "{err}");
}

#[test]
fn checksum_mismatch_of_a_packed_layer_is_a_data_error_naming_the_unit() {
    let trunk = pack(&tiny_dir());
    let manifest = k3ring::storage::pack::Manifest::load(trunk.path()).unwrap();
    let unit = manifest.units.iter().find(|u| u.unit == "layer.5").unwrap();
    let path = trunk.path().join("trunk.pack");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[(unit.offset + 100) as usize] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
    for budget in ["0.01", "0.003"] {
        let (code, _, err) = k3ring(&[
            "run",
            "--model",
            tiny_dir().to_str().unwrap(),
            "--trunk",
            trunk.path().to_str().unwrap(),
            "--mem-gb",
            budget,
            "--prompt",
            "Once",
            "--gen",
            "2",
        ]);
        assert_eq!(code, 3, "{err}");
        assert!(err.contains("layer.5") && err.contains("checksum"), "{err}");
    }
}

#[test]
fn a_damaged_embedding_row_is_a_data_error() {
    let trunk = pack(&tiny_dir());
    let manifest = k3ring::storage::pack::Manifest::load(trunk.path()).unwrap();
    let unit = manifest.units.iter().find(|u| u.unit == "embed").unwrap();
    let path = trunk.path().join("trunk.pack");
    let mut bytes = std::fs::read(&path).unwrap();
    // Token 512 is [BOS]: row 512 of a [768, 64] bf16 table.
    bytes[(unit.offset + 512 * 128 + 7) as usize] ^= 0x01;
    std::fs::write(&path, bytes).unwrap();
    let (code, _, err) = k3ring(&[
        "run",
        "--model",
        tiny_dir().to_str().unwrap(),
        "--trunk",
        trunk.path().to_str().unwrap(),
        "--mem-gb",
        "0.01",
        "--ids",
        "512,5",
        "--gen",
        "2",
    ]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("embedding row 512") && err.contains("checksum"), "{err}");
}

#[test]
fn truncated_pack_is_a_data_error() {
    let trunk = pack(&tiny_dir());
    let path = trunk.path().join("trunk.pack");
    let len = std::fs::metadata(&path).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len - 4096).unwrap();
    let (code, _, err) = streamed_cli(&tiny_dir(), trunk.path(), &[]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("trunk.pack") && err.contains("bytes but the manifest says"), "{err}");
}

#[test]
fn truncated_shard_is_refused_before_streaming() {
    let (_tmp, model) = copy_tiny();
    let trunk = pack(&model);
    let shard = model.join("model-00003-of-00003.safetensors");
    let len = std::fs::metadata(&shard).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&shard).unwrap().set_len(len - 10).unwrap();
    let (code, _, err) = streamed_cli(&model, trunk.path(), &[]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("model-00003-of-00003.safetensors"), "{err}");
}

#[test]
fn unreadable_shard_is_an_io_error() {
    let (_tmp, model) = copy_tiny();
    let trunk = pack(&model);
    let shard = model.join("model-00002-of-00003.safetensors");
    std::fs::remove_file(&shard).unwrap();
    std::fs::create_dir(&shard).unwrap();
    let (code, _, err) = streamed_cli(&model, trunk.path(), &[]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("model-00002-of-00003.safetensors"), "{err}");
}

#[test]
fn a_pack_of_another_checkpoint_is_stale() {
    let (_tmp, model) = copy_tiny();
    let trunk = pack(&tiny_dir());
    // Touching the config changes the fingerprint even with equal bytes? No: change the bytes.
    let cfg = model.join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap() + "\n";
    std::fs::write(&cfg, text).unwrap();
    let (code, _, err) = streamed_cli(&model, trunk.path(), &[]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("made from another checkpoint"), "{err}");
}

#[test]
fn misaligned_device_needs_a_new_pack() {
    let model = tiny_dir();
    let trunk = pack(&model);
    let mut sim = SimOptions::fault_free(1);
    sim.align = 8192;
    let stream = IoOptions { kind: IoKind::Sim, sim: Some(sim), ..IoOptions::default() };
    let err = streamed_with(&model, trunk.path(), &run_options(64_000_000, stream)).unwrap_err();
    assert!(err.contains("aligned to 4096 bytes but the device needs 8192"), "{err}");
}

#[test]
fn budgets_below_minimum_or_above_available_exit_2() {
    let trunk = pack(&tiny_dir());
    let (code, _, err) = streamed_cli(&tiny_dir(), trunk.path(), &["--mem-gb", "0.0001"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("below this model's minimum"), "{err}");
    let (code, _, err) = streamed_cli(&tiny_dir(), trunk.path(), &["--mem-gb", "100000"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("above 95% of available memory"), "{err}");
}

#[test]
fn streaming_run_reports_plan_and_storage_in_json() {
    let trunk = pack(&tiny_dir());
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("r.json");
    let (code, _, err) =
        streamed_cli(&tiny_dir(), trunk.path(), &["--mem-gb", "0.003", "--json", json.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("plan: budget") && err.contains("storage uring"), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    for key in ["budget_bytes", "pinned", "streamed", "ring_slots", "expert_slots", "planned_bytes", "minimum_bytes"] {
        assert!(v["plan"].get(key).is_some(), "plan.{key} missing");
    }
    for key in [
        "trunk_bytes_read",
        "expert_bytes_read",
        "read_busy_seconds",
        "read_bytes_per_second",
        "trunk_pinned_units",
        "trunk_streamed_units",
        "expert_hits",
        "expert_evictions",
    ] {
        assert!(v["storage"].get(key).is_some(), "storage.{key} missing");
    }
}

#[test]
fn pack_is_a_no_op_when_up_to_date_and_survives_interruption() {
    let out = tempfile::tempdir().unwrap();
    let model = tiny_dir().to_str().unwrap().to_owned();
    let dir = out.path().to_str().unwrap();
    let (code, stdout, err) = k3ring(&["pack", "--model", &model, "--out", dir, "--verify"]);
    assert_eq!(code, 0, "{err}");
    assert!(stdout.contains("packed") && stdout.contains("verified"), "{stdout}");
    let (code, stdout, _) = k3ring(&["pack", "--model", &model, "--out", dir]);
    assert_eq!(code, 0);
    assert!(stdout.contains("up to date"), "{stdout}");
    // An interrupted pack: the pack file is there, the manifest is not.
    std::fs::remove_file(out.path().join("trunk.manifest.json")).unwrap();
    let (code, _, err) = streamed_cli(&tiny_dir(), out.path(), &[]);
    assert_eq!(code, 4, "{err}");
    assert!(err.contains("trunk.manifest.json is missing"), "{err}");
    assert!(err.contains("run `k3ring pack --model ... --out "), "a missing manifest says how to pack: {err}");
    let (code, stdout, _) = k3ring(&["pack", "--model", &model, "--out", dir]);
    assert_eq!(code, 0);
    assert!(stdout.contains("packed"), "a missing manifest means a full re-pack: {stdout}");
}

#[allow(dead_code)]
fn unused(_: PathBuf) {}
