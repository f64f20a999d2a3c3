//! Replays the committed fuzz corpora (`tests/fuzz_corpus/<target>/`) through the same target
//! functions the fuzzer ran (`targets.rs`), under the same allocation cap, and holds the
//! regression tests of the bugs fuzzing found. Needs no fuzzer: see docs/FUZZING.md.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout, clippy::print_stderr)]

mod regressions;
mod targets;

use std::path::{Path, PathBuf};

use targets::{CappedAlloc, Target, TARGETS};

#[global_allocator]
static GLOBAL: CappedAlloc = CappedAlloc::new();

pub const TINY_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-k3");

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_corpus").join(target)
}

/// Feeds every corpus file of `target` to it: each must be accepted or refused with the target's
/// exit code, without a panic or an allocation above the cap (which aborts the test binary).
fn replay(target: &Target) {
    let dir = corpus_dir(target.name);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(files.len() >= 5, "{}: the corpus has only {} files", dir.display(), files.len());
    let (mut accepted, mut refused) = (0, 0);
    for file in &files {
        let data = std::fs::read(file).unwrap();
        let outcome = std::panic::catch_unwind(|| (target.run)(&data));
        match outcome {
            Ok(Ok(())) => accepted += 1,
            Ok(Err(code)) => {
                assert_eq!(code, target.refusal, "{}: refused with the wrong exit code", file.display());
                refused += 1;
            }
            Err(_) => panic!("{}: target {} panicked (message above)", file.display(), target.name),
        }
    }
    println!("{}: {} files, {accepted} accepted, {refused} refused", target.name, files.len());
}

#[test]
fn every_target_has_a_corpus() {
    for t in &TARGETS {
        assert!(corpus_dir(t.name).is_dir(), "no corpus for {}", t.name);
    }
}

#[test]
fn replay_state_file() {
    replay(targets::target("state_file").unwrap());
}

#[test]
fn replay_jsonl_requests() {
    replay(targets::target("jsonl_requests").unwrap());
}

#[test]
fn replay_safetensors_header() {
    replay(targets::target("safetensors_header").unwrap());
}

#[test]
fn replay_shard_index() {
    replay(targets::target("shard_index").unwrap());
}

#[test]
fn replay_config() {
    replay(targets::target("config").unwrap());
}

#[test]
fn replay_tiktoken_vocab() {
    replay(targets::target("tiktoken_vocab").unwrap());
}

#[test]
fn replay_tokenizer_config() {
    replay(targets::target("tokenizer_config").unwrap());
}

#[test]
fn replay_pack_manifest() {
    replay(targets::target("pack_manifest").unwrap());
}

#[test]
fn replay_routing_trace() {
    replay(targets::target("routing_trace").unwrap());
}
