//! The fuzz targets: one function per parser of outside bytes, shared by the afl.rs fuzzer
//! (`fuzz/`, which includes this file) and the corpus replay test (`tests/fuzz_replay`), so CI
//! replays exactly what was fuzzed. Also the capped allocator both install, so an allocation sized
//! by a length field aborts (a crash to the fuzzer, a failed test in CI) instead of passing
//! unnoticed on a large machine.
//!
//! A target returns `Ok(())` when the input was accepted and `Err(code)` with the exit code the
//! error would end the process with when it was refused; it panics when an accepted input breaks
//! an invariant the parser promises (a tokenizer that does not round-trip, for one). The including
//! crate defines `TINY_MODEL`, the path of `tests/fixtures/tiny-k3`.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use k3ring::checkpoint::safetensors::serialize;
use k3ring::checkpoint::CheckpointIndex;
use k3ring::config::Config;
use k3ring::exit::{Classify, ExitCode};
use k3ring::storage::pack::{Manifest, PackError};
use k3ring::storage::stream::cache_sim::{belady, default_capacities, read_trace_from, simulate};
use k3ring::storage::stream::layout::PackLayout;
use k3ring::storage::stream::policy::{policy_by_name, POLICY_NAMES};
use k3ring::tokenizer::{parse_added, parse_vocab, Tokenizer};

/// One target: its name (the corpus directory), the exit code its refusals must carry, and the
/// function.
pub struct Target {
    pub name: &'static str,
    pub refusal: ExitCode,
    pub run: fn(&[u8]) -> Result<(), ExitCode>,
}

pub const TARGETS: [Target; 9] = [
    Target { name: "safetensors_header", refusal: ExitCode::Data, run: safetensors_header },
    Target { name: "shard_index", refusal: ExitCode::Data, run: shard_index },
    Target { name: "config", refusal: ExitCode::Usage, run: config },
    Target { name: "tiktoken_vocab", refusal: ExitCode::Data, run: tiktoken_vocab },
    Target { name: "tokenizer_config", refusal: ExitCode::Data, run: tokenizer_config },
    Target { name: "pack_manifest", refusal: ExitCode::Data, run: pack_manifest },
    Target { name: "routing_trace", refusal: ExitCode::Data, run: routing_trace },
    Target { name: "jsonl_requests", refusal: ExitCode::Usage, run: jsonl_requests },
    Target { name: "state_file", refusal: ExitCode::Data, run: state_file },
];

pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

fn code(e: impl Classify) -> ExitCode {
    e.exit_code()
}

fn model_dir() -> &'static Path {
    Path::new("/fuzz/model")
}

/// One shard file: a checkpoint of that single file, without an index.
pub fn safetensors_header(data: &[u8]) -> Result<(), ExitCode> {
    CheckpointIndex::from_memory(model_dir(), None, &[("model.safetensors", data)]).map(drop).map_err(code)
}

/// Two fixed shards the fuzzed `model.safetensors.index.json` must describe: shard 1 holds two
/// plain tensors, shard 2 one complete expert.
fn index_shards() -> &'static [(String, Vec<u8>)] {
    static SHARDS: OnceLock<Vec<(String, Vec<u8>)>> = OnceLock::new();
    SHARDS.get_or_init(|| {
        let one = serialize(&[("a", "BF16", &[2], &[0; 4]), ("b", "F32", &[1], &[0; 4])]);
        let expert = |part: &str| format!("language_model.model.layers.1.block_sparse_moe.experts.0.{part}");
        let names: Vec<String> = k3ring::checkpoint::EXPERT_PARTS.iter().map(|p| expert(p.suffix())).collect();
        let parts: Vec<(&str, &str, &[u64], &[u8])> =
            names.iter().map(|n| (n.as_str(), "U8", &[2][..], &[0u8; 2][..])).collect();
        let two = serialize(&parts);
        vec![("model-00001-of-00002.safetensors".to_owned(), one), ("model-00002-of-00002.safetensors".to_owned(), two)]
    })
}

/// The index file of a checkpoint of two fixed shards.
pub fn shard_index(data: &[u8]) -> Result<(), ExitCode> {
    let shards: Vec<(&str, &[u8])> = index_shards().iter().map(|(n, b)| (n.as_str(), b.as_slice())).collect();
    CheckpointIndex::from_memory(model_dir(), Some(data), &shards).map(drop).map_err(code)
}

pub fn config(data: &[u8]) -> Result<(), ExitCode> {
    Config::from_json_bytes(data, Path::new("/fuzz/model/config.json")).map(drop).map_err(code)
}

const SAMPLE_TEXT: &str =
    "Hello, world! 123 4567 Ünïcödé 漢字テキスト\r\n\t  tabs   and 'll 've\u{1F600}<|im_end|>[BOS]";

/// Encodes `SAMPLE_TEXT` and checks that decoding gives it back: a byte-level BPE loses nothing.
fn check_round_trip(tok: &Tokenizer) -> Result<(), ExitCode> {
    let ids = tok.encode(SAMPLE_TEXT).map_err(code)?;
    let back = tok.decode_bytes(&ids).map_err(code)?;
    assert_eq!(back, SAMPLE_TEXT.as_bytes(), "encode then decode changed the text");
    let ids = tok.encode_with_added(SAMPLE_TEXT).map_err(code)?;
    let back = tok.decode_bytes(&ids).map_err(code)?;
    assert_eq!(back, SAMPLE_TEXT.as_bytes(), "encode_with_added then decode changed the text");
    Ok(())
}

/// `tiktoken.model`; an accepted vocabulary must encode and decode the sample text losslessly.
pub fn tiktoken_vocab(data: &[u8]) -> Result<(), ExitCode> {
    // The file reader decides what invalid UTF-8 means; the parser sees text.
    let text = String::from_utf8_lossy(data);
    let decoder = parse_vocab(&text, Path::new("/fuzz/model/tiktoken.model")).map_err(code)?;
    let added = vec![("[BOS]".to_owned(), decoder.len() as u32)];
    check_round_trip(&Tokenizer::new(decoder, added).map_err(code)?)
}

/// The 256 single bytes, the smallest vocabulary `parse_vocab` accepts.
fn byte_ranks() -> Vec<Vec<u8>> {
    (0..=255u8).map(|b| vec![b]).collect()
}

/// `tokenizer_config.json` over a vocabulary of the 256 bytes; accepted added tokens must
/// round-trip the sample text too.
pub fn tokenizer_config(data: &[u8]) -> Result<(), ExitCode> {
    let text = String::from_utf8_lossy(data);
    let added = parse_added(&text, Path::new("/fuzz/model/tokenizer_config.json"), 256).map_err(code)?;
    check_round_trip(&Tokenizer::new(byte_ranks(), added).map_err(code)?)
}

/// The length of the fuzzed pack file: the seed manifests of the tiny model say this.
pub const PACK_LEN: u64 = 1_277_952;

fn tiny_model() -> &'static (CheckpointIndex, Config) {
    static TINY: OnceLock<(CheckpointIndex, Config)> = OnceLock::new();
    TINY.get_or_init(|| {
        let dir = PathBuf::from(crate::TINY_MODEL);
        let index = CheckpointIndex::open(&dir).unwrap_or_else(|e| panic!("the tiny model does not open: {e}"));
        let cfg = Config::from_model_dir(&dir).unwrap_or_else(|e| panic!("the tiny model does not open: {e}"));
        (index, cfg)
    })
}

/// `trunk.manifest.json` of a pack of [`PACK_LEN`] bytes, then placed against the tiny model as
/// the streaming store does.
pub fn pack_manifest(data: &[u8]) -> Result<(), ExitCode> {
    let (index, cfg) = tiny_model();
    let pack = Path::new("/fuzz/trunk/trunk.pack");
    let m =
        Manifest::parse(data, Path::new("/fuzz/trunk/trunk.manifest.json"), pack, || Ok::<u64, PackError>(PACK_LEN))
            .map_err(code)?;
    m.expert_checksums(Path::new("/fuzz/trunk"), index).map_err(code)?;
    PackLayout::new(&m, index, cfg, pack.to_owned(), index.shards.len()).map(drop).map_err(code)
}

/// An expert trace as `cache-sim` reads it, then simulated under every policy and Belady at the
/// smallest pool and at the pool of every distinct expert.
pub fn routing_trace(data: &[u8]) -> Result<(), ExitCode> {
    let trace = read_trace_from(data, Path::new("/fuzz/run.trace")).map_err(code)?;
    let capacities = default_capacities(&trace);
    for capacity in [capacities[0], capacities[capacities.len() - 1]] {
        let best = belady(&trace, capacity).map_err(code)?;
        for name in POLICY_NAMES {
            let mut policy = policy_by_name(name, capacity).unwrap_or_else(|| panic!("policy {name} is listed"));
            let result = simulate(&trace, capacity, policy.as_mut()).map_err(code)?;
            assert!(result.hits <= best.hits, "{name} beats Belady at capacity {capacity}");
        }
    }
    Ok(())
}

/// Largest single allocation a parser may make on fuzz-sized input.
pub const ALLOC_MAX: usize = 64 << 20;
/// Largest total a parser may hold at once.
pub const LIVE_MAX: usize = 512 << 20;

/// The system allocator with caps: a request above [`ALLOC_MAX`] or one that would take the
/// live total above [`LIVE_MAX`] fails, which aborts the process ("memory allocation of N bytes
/// failed") unless the caller handles it.
pub struct CappedAlloc {
    live: AtomicUsize,
}

impl CappedAlloc {
    pub const fn new() -> CappedAlloc {
        CappedAlloc { live: AtomicUsize::new(0) }
    }

    /// Reserves `size` bytes of the live budget; false when a cap would be exceeded.
    fn admit(&self, size: usize) -> bool {
        if size > ALLOC_MAX {
            return false;
        }
        let before = self.live.fetch_add(size, Ordering::Relaxed);
        if before + size > LIVE_MAX {
            self.live.fetch_sub(size, Ordering::Relaxed);
            return false;
        }
        true
    }
}

// SAFETY: every call forwards to the system allocator with the caller's layout, or returns null
// (allowed: an allocation may fail); the live count only decides which.
unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !self.admit(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc(layout) };
        if p.is_null() {
            self.live.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !self.admit(layout.size()) {
            return std::ptr::null_mut();
        }
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc_zeroed(layout) };
        if p.is_null() {
            self.live.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        self.live.fetch_sub(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let old = layout.size();
        if new_size > ALLOC_MAX || (new_size > old && !self.admit(new_size - old)) {
            return std::ptr::null_mut();
        }
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        match (p.is_null(), new_size > old) {
            (true, true) => {
                self.live.fetch_sub(new_size - old, Ordering::Relaxed);
            }
            (false, false) => {
                self.live.fetch_sub(old - new_size, Ordering::Relaxed);
            }
            _ => {}
        }
        p
    }
}

fn tiny_tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        Tokenizer::from_model_dir(Path::new(crate::TINY_MODEL))
            .unwrap_or_else(|e| panic!("the tiny model's tokenizer does not open: {e}"))
    })
}

/// A `k3ring batch` input: every line checked against the tiny model as the command does. An
/// accepted request must be one the batcher can run: a non-empty prompt of ids inside the
/// vocabulary, positions within the model's context. Refused (exit 2) when no line is accepted,
/// as the command is.
pub fn jsonl_requests(data: &[u8]) -> Result<(), ExitCode> {
    use k3ring::engine::requests::{parse_request_line, RequestDefaults};
    let (_, cfg) = tiny_model();
    let tok = tiny_tokenizer();
    // The command refuses non-UTF-8 input as a whole; the line parser sees text.
    let text = String::from_utf8_lossy(data);
    let defaults = RequestDefaults { max_tokens: 32, context: Some(2048), stop_ids: vec![cfg.eos_token_id] };
    let mut accepted = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        match parse_request_line(line, &defaults, cfg, tok) {
            Ok(p) => {
                let r = &p.request;
                assert!(!r.prompt.is_empty(), "an accepted request has an empty prompt: {line}");
                assert!(
                    r.prompt.iter().all(|&id| (id as usize) < cfg.vocab_size),
                    "an id outside the vocabulary: {line}"
                );
                assert!(r.prompt.len() + r.max_tokens.max(1) <= 2048, "beyond --context: {line}");
                assert!(p.stop.iter().all(|s| !s.is_empty()), "an empty stop string: {line}");
                accepted += 1;
            }
            Err(e) => assert_eq!(e.exit_code(), ExitCode::Usage, "{e}"),
        }
    }
    if accepted == 0 {
        return Err(ExitCode::Usage);
    }
    Ok(())
}

thread_local! {
    /// The tiny model, resident on one thread (fuzzing runs one input at a time).
    static TINY_ENGINE: k3ring::engine::Opened = k3ring::engine::open_resident(
        Path::new(crate::TINY_MODEL),
        1,
        kernels::Kernels::detect(),
    )
    .unwrap_or_else(|e| panic!("the tiny model does not open: {e}"));
}

/// A chat state file (`k3ring chat` `/save`, `run --save-state`), restored into a session of the
/// tiny model as `/load` does. The harness writes the total length, the tiny model's fingerprint
/// and the checksum over what the fuzzer made, so inputs reach the structure behind those checks
/// (the checks themselves are compared bytes, covered by the chat tests' refusals).
pub fn state_file(data: &[u8]) -> Result<(), ExitCode> {
    use k3ring::engine::{ChatSession, Fingerprint, StateFileError};
    use std::cell::RefCell;
    static FINGERPRINT: OnceLock<Fingerprint> = OnceLock::new();
    thread_local! {
        // One session, restored into again and again as `/load` does in a chat: a refused
        // file leaves it as it was (or reset), which is what is under test.
        static SESSION: RefCell<ChatSession> = TINY_ENGINE.with(|o| {
            RefCell::new(ChatSession::new(&o.engine, 64, 8).unwrap_or_else(|e| panic!("a session of the tiny model: {e}")))
        });
    }
    let (index, cfg) = tiny_model();
    let fp = *FINGERPRINT.get_or_init(|| Fingerprint::of(cfg, index));
    let mut bytes = data.to_vec();
    if bytes.len() >= 36 {
        let total = (bytes.len() + 8) as u64;
        bytes[12..20].copy_from_slice(&total.to_le_bytes());
        bytes[20..28].copy_from_slice(&fp.config.to_le_bytes());
        bytes[28..36].copy_from_slice(&fp.checkpoint.to_le_bytes());
        let sum = kernels::hash::xxh3_64(&bytes);
        bytes.extend_from_slice(&sum.to_le_bytes());
    }
    TINY_ENGINE.with(|o| {
        SESSION.with_borrow_mut(|session| {
            let restored = session.restore_bytes(&o.engine, Path::new("/fuzz/state"), &bytes, fp);
            // A state longer than the session's context is refused as usage (exit 2: the user
            // can give a larger --context); every other refusal is exit 3.
            if let Err(e) = &restored {
                if matches!(e, StateFileError::TooLong { .. }) {
                    assert_eq!(e.exit_code(), ExitCode::Usage, "a state too long for the context");
                    return Ok(());
                }
            }
            if restored.is_ok() {
                assert!(session.fed() <= session.ids().len(), "fed past the tokens");
                assert!(session.ids().len() < session.capacity(), "more tokens than the session holds");
                assert!(session.ids().iter().all(|&id| (id as usize) < cfg.vocab_size), "an id outside the vocabulary");
            }
            restored.map(|_| ()).map_err(|e| e.exit_code())
        })
    })
}
