//! Soak (issue 13): at least 5,000 tokens streamed from the tiny model at the smallest budget the
//! planner accepts, through the simulated store with random read faults (latency and reordering,
//! short reads, EIO, ECANCELED, and corruption of the checksummed trunk pack). The tiny model's
//! context is 4,096 positions, so the tokens come as runs of 1,000, one per seed, until 5,000
//! have been streamed (a run that fails early contributes the tokens it produced).
//!
//! Every run must either reproduce the fault-free tokens or stop with a named error of the
//! documented class (exit 4 for a failed read naming file and offset, exit 3 for a checksum
//! mismatch), and the tokens it produced before stopping must be the fault-free ones. Resident
//! memory must stay flat after warm-up and no file descriptor may leak. RSS and descriptors are
//! per process, so the measurement runs in a process of its own: the test re-runs this test
//! binary on the ignored [`soak_in_own_process`], where no other test allocates or opens files.

use std::path::Path;
use std::process::Command;

use k3ring::engine::{open_streaming, GenerateOptions, StreamingRun};
use k3ring::exit::{Classify, ExitCode};
use k3ring::pipeline::{IoKind, IoOptions, PipelineOptions};
use k3ring::storage::io::sim::SimOptions;
use k3ring::storage::stream::StoreOptions;
use kernels::{Isa, Kernels};

use crate::common::*;

const TOKENS_PER_RUN: usize = 1000;
const TOKENS_TOTAL: usize = 5000;
/// Runs at most, so a fault mix that fails every run early cannot loop for long.
const RUNS_MAX: u64 = 12;
/// Shards of the tiny model: the sim numbers the trunk pack after them.
const TINY_SHARDS: usize = 3;
/// Allowed RSS growth across runs, measured after each run against the end of the fault-free
/// warm-up run (both hold a full 1,000-position KV cache). Each run builds and drops an engine
/// with its threads and arena; the allocator keeps per-thread arenas and cached thread stacks, so
/// RSS moves by a few MB from run to run (measured: 15.0 MB after warm-up, 16.1-20.2 MB after
/// later runs, no trend past that). A leak of 2 KB per token (10 MB over the soak) fails it.
///
/// There is no bound within a run: RSS at token 100 is no baseline, since the KV cache is zeroed
/// memory the kernel maps in page by page as positions fill it, and the previous engine's freed
/// memory is reused or returned unpredictably (measured: +2.2 MB from token 100 to 1000 in the
/// fault-free run, +3.4 MB in another).
const RSS_GROWTH_ACROSS_RUNS: u64 = 8 << 20;
#[test]
fn soak_streamed_runs_with_read_faults_keep_output_rss_and_fds() {
    let exe = std::env::current_exe().unwrap();
    let out = Command::new(exe)
        .args(["soak_tests::soak_in_own_process", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    println!("{text}");
    assert!(out.status.success(), "the soak failed:\n{text}");
    assert!(text.contains("1 passed"), "the soak did not run:\n{text}");
}

fn vm_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    k3ring::memory::kib_field(&status, "VmRSS:").unwrap()
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn run_options(budget: u64, sim: SimOptions) -> StreamingRun {
    StreamingRun {
        budget_bytes: budget,
        sequences: 1,
        context: prompt().len() + TOKENS_PER_RUN,
        chunk: 8,
        threads: 2,
        store: StoreOptions { verify_every_read: true, ..StoreOptions::default() },
        pipeline: PipelineOptions {
            io: IoOptions { kind: IoKind::Sim, sim: Some(sim), ..IoOptions::default() },
            ..PipelineOptions::default()
        },
        prefetch_window: None,
        placement: None,
        trace_detail: false,
        trunk_share: None,
        available_memory: None,
        drafting: Default::default(),
    }
}

/// One streamed run: the tokens it produced, its result, and RSS at the end.
struct Outcome {
    ids: Vec<u32>,
    error: Option<(ExitCode, String)>,
    rss_end: u64,
}

fn stream(trunk: &Path, run: &StreamingRun) -> Outcome {
    let (o, _) = open_streaming(&tiny_dir(), trunk, run, Kernels::with_isa(Isa::best()).unwrap(), |_| {})
        .map_err(|e| e.to_string())
        .unwrap();
    let opts = GenerateOptions { gen: TOKENS_PER_RUN, prefill_chunk: run.chunk, ..Default::default() };
    let mut ids = Vec::new();
    let result = o.engine.generate(&prompt(), &opts, |id| ids.push(id));
    let rss_end = vm_rss();
    let error = result.err().map(|e| {
        // The chain as the CLI prints it: a cause already quoted by its parent is not repeated.
        let mut chain = String::new();
        for cause in std::iter::successors(Some(&e as &dyn std::error::Error), |e| e.source()) {
            let text = cause.to_string();
            if !chain.contains(&text) {
                chain = if chain.is_empty() { text } else { format!("{chain}: {text}") };
            }
        }
        (e.exit_code(), chain)
    });
    Outcome { ids, error, rss_end }
}

/// The fault mix of one seed: always latency, reordering and short reads; rare failures and
/// corruption (most runs finish); seed 3 fails often, so the error path is always exercised.
fn faults(seed: u64) -> SimOptions {
    let mut sim = SimOptions::fault_free(seed);
    sim.latency_max = 40;
    sim.short_ppm = 50_000;
    // Faults are per read, and the smallest budget streams the tiny model in about 170 pieces
    // per token: 1 ppm each still fails a run every few runs.
    let (eio, ecanceled, corrupt) = if seed == 3 { (2_000, 1_000, 5_000) } else { (1, 1, 1) };
    sim.eio_ppm = eio;
    sim.ecanceled_ppm = ecanceled;
    sim.corrupt_ppm = corrupt;
    sim.corruptible_files = vec![TINY_SHARDS];
    sim
}

#[test]
#[ignore = "run in a process of its own by soak_streamed_runs_with_read_faults_keep_output_rss_and_fds"]
fn soak_in_own_process() {
    let trunk = pack(&tiny_dir());
    let probe = run_options(64_000_000, SimOptions::fault_free(0));
    let (_, plan) = open_streaming(&tiny_dir(), trunk.path(), &probe, Kernels::with_isa(Isa::best()).unwrap(), |_| {})
        .map_err(|e| e.to_string())
        .unwrap();
    let budget = plan.minimum_bytes;
    let fds_before = open_fds();

    // Warm-up and reference: the fault-free run at the same budget.
    let reference = stream(trunk.path(), &run_options(budget, SimOptions::fault_free(0)));
    assert!(reference.error.is_none(), "the fault-free run failed: {:?}", reference.error);
    assert_eq!(reference.ids.len(), TOKENS_PER_RUN);
    let rss_base = reference.rss_end;
    println!("soak: budget {budget} bytes (the minimum), RSS after warm-up {rss_base} bytes, {fds_before} fds");

    let (mut streamed, mut matched, mut failed) = (0, 0, 0);
    for seed in 1..=RUNS_MAX {
        if streamed >= TOKENS_TOTAL && failed > 0 {
            break;
        }
        let out = stream(trunk.path(), &run_options(budget, faults(seed)));
        streamed += out.ids.len();
        let replay = format!("seed {seed} (replay: K3_SIM_SEED={seed})");
        assert_eq!(out.ids[..], reference.ids[..out.ids.len()], "{replay}: a token differs from the fault-free run");
        match &out.error {
            None => {
                assert_eq!(out.ids.len(), TOKENS_PER_RUN, "{replay}");
                matched += 1;
            }
            Some((code, message)) => {
                let named = match code {
                    ExitCode::Io => message.contains("offset") && message.contains("failed"),
                    ExitCode::Data => message.contains("checksum"),
                    _ => false,
                };
                assert!(named, "{replay}: not a documented error (exit {}): {message}", u8::from(*code));
                failed += 1;
            }
        }
        assert!(
            out.rss_end <= rss_base + RSS_GROWTH_ACROSS_RUNS,
            "{replay}: RSS {} after the run, {rss_base} after warm-up",
            out.rss_end
        );
        println!(
            "soak: seed {seed}: {} tokens, {}, RSS {} bytes",
            out.ids.len(),
            out.error.as_ref().map_or("matched".to_owned(), |(c, m)| format!("exit {}: {m}", u8::from(*c))),
            out.rss_end
        );
    }
    println!(
        "soak: {streamed} tokens streamed under faults; {matched} runs matched, {failed} stopped with a named error"
    );
    assert!(streamed >= TOKENS_TOTAL, "only {streamed} tokens in {RUNS_MAX} runs");
    assert!(matched > 0 && failed > 0, "{matched} runs matched, {failed} failed: both paths must be exercised");
    assert_eq!(open_fds(), fds_before, "file descriptors leaked");
}
