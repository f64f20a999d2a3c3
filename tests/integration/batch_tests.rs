//! Continuous batching (issue 18): every sequence's tokens equal its solo run, whatever else is
//! in the batch, when it arrives, the batch size, the budget and whether the weights are
//! resident or streamed; a budget that holds only two sequences queues the rest.

use std::collections::HashMap;
use std::path::Path;

use k3ring::engine::{
    open_streaming, BatchOptions, BatchRequest, BatchSink, Engine, FinishReason, Finished, GenerateOptions, Sampling,
    StreamingRun, Ticket,
};
use k3ring::model::weights::WeightSource;
use k3ring::model::LayerHook;
use kernels::{Isa, Kernels};

use crate::common::*;

#[derive(Default)]
struct Collect {
    tokens: HashMap<Ticket, Vec<u32>>,
    finished: HashMap<Ticket, Finished>,
    /// Finish a ticket's sequence once it has produced this token (a stop string's stand-in).
    stop_on: HashMap<Ticket, u32>,
}

impl BatchSink for Collect {
    fn token(&mut self, ticket: Ticket, id: u32) -> bool {
        self.tokens.entry(ticket).or_default().push(id);
        self.stop_on.get(&ticket) == Some(&id)
    }
    fn finished(&mut self, finished: Finished) {
        assert!(self.finished.insert(finished.ticket, finished).is_none(), "a ticket finished twice");
    }
}

/// Requests of mixed prompt lengths, sampling settings and token limits; `vocab` bounds ids.
pub fn requests(n: usize, vocab: u32) -> Vec<BatchRequest> {
    let base = prompt();
    (0..n)
        .map(|i| {
            let len = 1 + (i * 7) % 23;
            let prompt: Vec<u32> = (0..len)
                .map(|j| if j < base.len() && i % 2 == 0 { base[j] } else { (j as u32 * 31 + i as u32 * 17) % vocab })
                .collect();
            let sampling = match i % 4 {
                0 => Sampling::default(),
                1 => Sampling { temperature: 0.8, top_k: Some(20), top_p: None, seed: i as u64 },
                2 => Sampling { temperature: 1.1, top_k: None, top_p: Some(0.9), seed: 100 + i as u64 },
                _ => Sampling { temperature: 0.6, top_k: Some(5), top_p: Some(0.95), seed: 7 },
            };
            BatchRequest {
                constraint: None,
                prompt,
                max_tokens: [1, 6, 17, 30, 11][i % 5],
                sampling,
                stop_ids: Vec::new(),
                logprobs: None,
                prompt_logprobs: false,
            }
        })
        .collect()
}

fn solo<S: WeightSource + LayerHook>(engine: &Engine<S>, r: &BatchRequest) -> Vec<u32> {
    let opts = GenerateOptions {
        gen: r.max_tokens,
        sampling: r.sampling.clone(),
        stop_ids: r.stop_ids.clone(),
        prefill_chunk: 5,
        ..GenerateOptions::default()
    };
    engine.generate(&r.prompt, &opts, |_| {}).unwrap().generated_ids
}

/// Runs `reqs` through a batcher, submitting request i at step `arrivals[i]`; with its slots
/// and its steps by how many sequences carried a draft.
fn batched<S: WeightSource + LayerHook>(
    engine: &Engine<S>,
    opts: BatchOptions,
    reqs: &[BatchRequest],
    arrivals: &[u64],
    stop_on: &HashMap<usize, u32>,
) -> (Collect, usize, Vec<u64>) {
    let mut b = engine.batcher(opts).unwrap();
    let mut sink = Collect::default();
    let mut tickets = Vec::new();
    let mut step = 0u64;
    loop {
        for (i, r) in reqs.iter().enumerate().filter(|(i, _)| arrivals[*i] == step) {
            let t = b.submit(r.clone()).unwrap();
            if let Some(&id) = stop_on.get(&i) {
                sink.stop_on.insert(t, id);
            }
            tickets.push((i, t));
        }
        let ran = b.step(&mut sink).unwrap();
        step += 1;
        if !ran && arrivals.iter().all(|&a| a < step) && b.pending() == 0 {
            break;
        }
        assert!(step < 10_000, "the batch does not finish");
    }
    assert_eq!(sink.finished.len(), reqs.len(), "every request finishes");
    // Re-key by request index.
    let by_index = |m: &mut HashMap<Ticket, Vec<u32>>| {
        tickets.iter().map(|&(i, t)| (i as Ticket, m.remove(&t).unwrap_or_default())).collect::<HashMap<_, _>>()
    };
    let tokens = by_index(&mut sink.tokens);
    let finished = tickets.iter().map(|&(i, t)| (i as Ticket, sink.finished.remove(&t).unwrap())).collect();
    (Collect { tokens, finished, stop_on: HashMap::new() }, b.slots(), b.stats().steps_by_drafting.clone())
}

fn check_identity<S: WeightSource + LayerHook>(
    what: &str,
    engine: &Engine<S>,
    reference: &Engine<impl WeightSource + LayerHook>,
    max_batch: usize,
    n: usize,
    staggered: bool,
) {
    check_identity_with(what, engine, reference, max_batch, n, staggered, None, None, Vec::new());
}

/// [`check_identity`] with drafting in the batch (solo runs stay plain) and `extra` requests
/// after the usual ones; with `replay`, the drafts replay each request's solo run, keeping that
/// share of the guesses. Returns the drafting counts of every sequence, summed, and the steps by
/// how many sequences carried a draft.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_identity_with<S: WeightSource + LayerHook>(
    what: &str,
    engine: &Engine<S>,
    reference: &Engine<impl WeightSource + LayerHook>,
    max_batch: usize,
    n: usize,
    staggered: bool,
    draft: Option<k3ring::engine::DraftOptions>,
    replay: Option<f64>,
    extra: Vec<BatchRequest>,
) -> (k3ring::engine::DraftStats, Vec<u64>) {
    let vocab = engine.model.cfg.vocab_size as u32;
    let mut reqs = requests(n, vocab);
    reqs.extend(extra);
    let n = reqs.len();
    let draft = match (draft, replay) {
        (Some(d), Some(accept)) => {
            let runs = reqs.iter().map(|r| (r.prompt.clone(), solo(reference, r))).collect();
            Some(k3ring::engine::DraftOptions { replay: Some(k3ring::engine::Replay::new(runs, accept, 3)), ..d })
        }
        (d, _) => d,
    };
    // One sequence stops on a stop id and one on the caller's word, both mid-way.
    let mut stop_on = HashMap::new();
    if n > 3 {
        let r = &mut reqs[3];
        let ids = solo(reference, r);
        r.stop_ids = vec![ids[ids.len() / 2]];
        let ids = solo(reference, &reqs[2]);
        stop_on.insert(2, ids[ids.len() / 2]);
    }
    let arrivals: Vec<u64> = (0..n).map(|i| if staggered { (i as u64 * 3) % 11 } else { 0 }).collect();
    let opts = BatchOptions { max_batch, prefill_chunk: 8, context: 64, draft };
    let (out, _, by_drafting) = batched(engine, opts, &reqs, &arrivals, &stop_on);
    let mut stats = k3ring::engine::DraftStats::default();
    for (i, r) in reqs.iter().enumerate() {
        let mut want = solo(reference, r);
        if let Some(&id) = stop_on.get(&i) {
            let at = want.iter().position(|&x| x == id).unwrap();
            want.truncate(at + 1);
        }
        let got = &out.tokens[&(i as Ticket)];
        assert_eq!(got, &want, "{what}: batch {max_batch} of {n}: request {i} differs from its solo run");
        let f = &out.finished[&(i as Ticket)];
        let stopped = r.stop_ids.contains(want.last().unwrap()) || stop_on.contains_key(&i);
        let reason = if stopped { FinishReason::Stop } else { FinishReason::Length };
        assert_eq!(
            (f.reason, f.generated, f.prompt_tokens),
            (reason, want.len(), r.prompt.len()),
            "{what}: request {i}"
        );
        assert_eq!(f.draft.steps + f.draft.accepted, want.len() as u64 - 1, "{what}: request {i}: {:?}", f.draft);
        stats.add(&f.draft);
    }
    (stats, by_drafting)
}

#[test]
fn batched_sequences_equal_their_solo_runs_resident() {
    let o = open(&tiny_dir(), 2, Isa::best());
    for (max_batch, n) in [(1, 3), (2, 5), (5, 9), (16, 16)] {
        check_identity("resident", &o.engine, &o.engine, max_batch, n, false);
        check_identity("resident, staggered", &o.engine, &o.engine, max_batch, n, true);
    }
}

#[test]
fn batched_sequences_equal_their_solo_runs_on_a_synth_model() {
    let dir = tempfile::tempdir().unwrap();
    let opts = k3ring::synth::SynthOptions {
        seed: 11,
        experts: 32,
        top_k: 6,
        ..k3ring::synth::SynthOptions::preset(dir.path().to_path_buf(), k3ring::synth::DimsPreset::Tiny)
    };
    k3ring::synth::synth(&opts, &|_, _| {}).unwrap();
    let o = open(dir.path(), 2, Isa::best());
    check_identity("synth", &o.engine, &o.engine, 5, 12, true);
    check_identity("synth", &o.engine, &o.engine, 16, 16, false);
}

pub(crate) fn streaming_run(budget: u64, sequences: usize) -> StreamingRun {
    StreamingRun { sequences, ..StreamingRun::new(budget, 64, 16 + 8, 2) }
}

pub(crate) fn open_streamed(
    trunk: &Path,
    budget: u64,
    sequences: usize,
) -> (k3ring::engine::Opened<k3ring::pipeline::Pipeline>, k3ring::storage::plan::Plan) {
    open_streaming(
        &tiny_dir(),
        trunk,
        &streaming_run(budget, sequences),
        Kernels::with_isa(Isa::best()).unwrap(),
        |_| {},
    )
    .map_err(|e| e.to_string())
    .unwrap()
}

#[test]
fn batched_sequences_equal_their_solo_runs_streamed_at_the_smallest_budget() {
    let trunk = pack(&tiny_dir());
    let reference = open(&tiny_dir(), 2, Isa::best());
    let (_, probe) = open_streamed(trunk.path(), 64_000_000, 16);
    let (o, plan) = open_streamed(trunk.path(), probe.minimum_bytes, 16);
    assert_eq!(plan.sequences, 1, "the minimum holds one sequence: {}", plan.describe());
    check_identity("streamed at the minimum", &o.engine, &reference.engine, plan.sequences, 9, true);
    let (o, plan) = open_streamed(trunk.path(), 64_000_000, 16);
    assert_eq!(plan.sequences, 16, "{}", plan.describe());
    check_identity("streamed", &o.engine, &reference.engine, 16, 16, true);
}

#[test]
fn a_budget_for_two_sequences_queues_the_rest_and_keeps_the_outputs() {
    let trunk = pack(&tiny_dir());
    let reference = open(&tiny_dir(), 2, Isa::best());
    let (_, probe) = open_streamed(trunk.path(), 64_000_000, 16);
    let two = probe.minimum_bytes + probe.sequence_bytes;
    let (o, plan) = open_streamed(trunk.path(), two, 16);
    assert_eq!((plan.sequences, plan.sequences_asked), (2, 16), "{}", plan.describe());
    assert!(plan.describe().contains("the budget holds no more"), "{}", plan.describe());
    let vocab = o.engine.model.cfg.vocab_size as u32;
    let reqs = requests(7, vocab);
    let opts = BatchOptions { max_batch: plan.sequences, prefill_chunk: 8, context: 64, draft: None };
    let b = o.engine.batcher(opts.clone()).unwrap();
    assert_eq!(b.slots(), 2);
    drop(b);
    let (out, slots, _) = batched(&o.engine, opts, &reqs, &[0; 7], &HashMap::new());
    assert_eq!(slots, 2);
    for (i, r) in reqs.iter().enumerate() {
        assert_eq!(out.tokens[&(i as Ticket)], solo(&reference.engine, r), "request {i}");
    }
}

/// The widest step of a batch (a decode row per slot plus the prefill chunk) can have more rows
/// than one slot has positions; the store's buffers (the embedding rows) are sized for the step.
/// `k3ring bench --batch` found this: every step used to be clamped to one slot's context.
#[test]
fn a_streamed_step_wider_than_one_slots_context_runs() {
    let trunk = pack(&tiny_dir());
    let reference = open(&tiny_dir(), 2, Isa::best());
    let opts = BatchOptions { max_batch: 4, prefill_chunk: 12, context: 10, draft: None };
    let run = StreamingRun { context: opts.context, chunk: opts.step_rows(), ..streaming_run(64_000_000, 4) };
    let kernels = Kernels::with_isa(Isa::best()).unwrap();
    let (o, plan) = open_streaming(&tiny_dir(), trunk.path(), &run, kernels, |_| {}).unwrap();
    assert_eq!(plan.sequences, 4, "{}", plan.describe());
    let vocab = o.engine.model.cfg.vocab_size as u32;
    let reqs: Vec<BatchRequest> = (0..4u32)
        .map(|i| BatchRequest {
            constraint: None,
            prompt: (0..5u32).map(|j| (j * 13 + i * 7 + 1) % vocab).collect(),
            max_tokens: 5,
            sampling: Sampling::default(),
            stop_ids: vec![],
            logprobs: None,
            prompt_logprobs: false,
        })
        .collect();
    // The first step prefills 12 prompt tokens, more than a slot's 10 positions.
    let (out, _, _) = batched(&o.engine, opts, &reqs, &[0; 4], &HashMap::new());
    for (i, r) in reqs.iter().enumerate() {
        assert_eq!(out.tokens[&(i as Ticket)], solo(&reference.engine, r), "request {i}");
    }
}

#[test]
fn requests_that_cannot_run_are_refused_at_submission() {
    let o = open(&tiny_dir(), 2, Isa::best());
    let mut b = o.engine.batcher(BatchOptions { max_batch: 2, prefill_chunk: 8, context: 16, draft: None }).unwrap();
    let req = |prompt: Vec<u32>, max_tokens| BatchRequest {
        constraint: None,
        prompt,
        max_tokens,
        sampling: Sampling::default(),
        stop_ids: vec![],
        logprobs: None,
        prompt_logprobs: false,
    };
    let vocab = o.engine.model.cfg.vocab_size as u32;
    let empty = b.submit(req(vec![], 4)).unwrap_err();
    assert!(empty.to_string().contains("empty"), "{empty}");
    let oov = b.submit(req(vec![1, vocab], 4)).unwrap_err();
    assert!(oov.to_string().contains(&format!("token id {vocab}")), "{oov}");
    let long = b.submit(req(vec![1; 10], 7)).unwrap_err();
    assert!(long.to_string().contains("17 positions") && long.to_string().contains("16"), "{long}");
    use k3ring::exit::{Classify, ExitCode};
    for e in [&empty, &oov, &long] {
        assert_eq!(e.exit_code(), ExitCode::Usage, "{e}");
    }
    // Nothing was queued; a request for no tokens finishes without running.
    assert_eq!(b.pending(), 0);
    b.submit(req(vec![1, 2], 0)).unwrap();
    let mut sink = Collect::default();
    assert!(!b.step(&mut sink).unwrap());
    assert_eq!(sink.finished.len(), 1);
    assert!(sink.tokens.is_empty());
}

fn records(text: &str) -> Vec<serde_json::Value> {
    text.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// `k3ring run`'s generated ids for the same settings.
fn run_ids(extra: &[&str]) -> Vec<u32> {
    let json = tempfile::NamedTempFile::new().unwrap();
    let mut args = vec!["run", "--json", json.path().to_str().unwrap()];
    args.extend_from_slice(extra);
    let (code, _, err) = crate::checkpoint_tests::k3ring(&args);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(json.path()).unwrap()).unwrap();
    ids(&v["generated_ids"])
}

#[test]
fn batch_command_matches_run_and_records_bad_lines() {
    let input = [
        r#"{"id": "greedy", "prompt": "The quick brown fox", "max_tokens": 9}"#,
        r#"{"id": "sampled", "ids": [512, 199, 167], "max_tokens": 7, "temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 3}"#,
        "not json",
        r#"{"id": "empty", "prompt": ""}"#,
        r#"{"id": "oov", "ids": [1, 99999]}"#,
        r#"{"id": "long", "prompt": "hello", "max_tokens": 100000}"#,
        "",
        r#"{"prompt": "Once upon a time", "max_tokens": 12, "stop": ["e", "zz"]}"#,
        r#"{"id": 7, "prompt": "x", "bogus": 1}"#,
    ]
    .join("\n");
    let summary = tempfile::NamedTempFile::new().unwrap();
    let (code, out, err) = k3ring_stdin(
        &[
            "batch",
            "--input",
            "-",
            "--output",
            "-",
            "--max-batch",
            "3",
            "--ignore-eos",
            "--json",
            summary.path().to_str().unwrap(),
        ],
        &input,
    );
    assert_eq!(code, 0, "{err}");
    let recs = records(&out);
    assert_eq!(recs.len(), 8, "{out}");
    let by_id =
        |id: serde_json::Value| recs.iter().find(|r| r["id"] == id).unwrap_or_else(|| panic!("no record {id}: {out}"));
    for (id, line, needle) in [
        (serde_json::Value::Null, 3, "not a request"),
        ("empty".into(), 4, "empty"),
        ("oov".into(), 5, "token 99999 is outside the vocabulary"),
        ("long".into(), 6, "max_tokens 100000 need 100004 positions"),
        (7.into(), 9, "unknown field `bogus`"),
    ] {
        let r = by_id(id.clone());
        assert_eq!(r["line"], line, "{r}");
        assert!(r["error"].as_str().unwrap().contains(needle), "{r}");
    }
    let greedy = by_id("greedy".into());
    let want = run_ids(&["--prompt", "The quick brown fox", "--gen", "9", "--ignore-eos"]);
    assert_eq!(ids(&greedy["generated_ids"]), want);
    assert_eq!(greedy["finish_reason"], "length");
    assert_eq!(greedy["prompt_tokens"], 12);
    let sampled = by_id("sampled".into());
    let want = run_ids(&[
        "--ids",
        "512,199,167",
        "--gen",
        "7",
        "--ignore-eos",
        "--temperature",
        "0.8",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--seed",
        "3",
    ]);
    assert_eq!(ids(&sampled["generated_ids"]), want);
    // No id: the line number stands in. The stop string ends the text where it begins.
    let stopped = by_id(8.into());
    let text = stopped["text"].as_str().unwrap();
    assert_eq!(stopped["finish_reason"], "stop", "{stopped}");
    assert!(!text.contains('e') && !text.contains("zz"), "{stopped}");
    let s: serde_json::Value = serde_json::from_slice(&std::fs::read(summary.path()).unwrap()).unwrap();
    assert_eq!(
        (s["requests"].as_u64(), s["succeeded"].as_u64(), s["failed"].as_u64()),
        (Some(8), Some(3), Some(5)),
        "{s}"
    );
    assert!(err.contains("8 requests: 3 done, 5 failed"), "{err}");
}

#[test]
fn batch_command_exits_2_when_every_line_fails_and_streams_with_a_trunk() {
    let (code, out, err) = k3ring_stdin(&["batch", "--input", "-", "--output", "-"], "{\"prompt\": \"\"}\nnope\n");
    assert_eq!(code, 2, "{err}");
    assert_eq!(records(&out).len(), 2);
    assert!(err.contains("every one failed"), "{err}");
    let (code, _, err) = k3ring_stdin(&["batch", "--input", "-", "--output", "-"], "\n");
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("has no requests"), "{err}");
    // Streaming flags need --trunk.
    let (code, _, err) =
        k3ring_stdin(&["batch", "--input", "-", "--output", "-", "--mem-gb", "1"], "{\"prompt\": \"a\"}");
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--mem-gb needs --trunk"), "{err}");
    // Streamed under a budget that holds two of the four slots asked for: same tokens as resident.
    let trunk = pack(&tiny_dir());
    let model = tiny_dir();
    let input: String = (0..5)
        .map(|i| format!("{{\"id\": {i}, \"ids\": [512, {}, 167], \"max_tokens\": {}}}\n", 100 + i, 3 + i))
        .collect();
    let (code, resident, err) = k3ring_stdin(
        &["batch", "--model", model.to_str().unwrap(), "--input", "-", "--output", "-", "--ignore-eos"],
        &input,
    );
    assert_eq!(code, 0, "{err}");
    let budget = {
        // The plan for this command's slots (3 prompt + 7 tokens) and step width (4 slots + a
        // prefill chunk of 32): four slots asked, two affordable.
        let run = StreamingRun { context: 10, chunk: 4 + 32, ..streaming_run(64_000_000, 4) };
        let (_, p) =
            open_streaming(&model, trunk.path(), &run, Kernels::with_isa(Isa::best()).unwrap(), |_| {}).unwrap();
        (p.minimum_bytes + p.sequence_bytes + p.sequence_bytes / 2) as f64 / 1e9
    };
    let (code, streamed, err) = k3ring_stdin(
        &[
            "batch",
            "--model",
            model.to_str().unwrap(),
            "--trunk",
            trunk.path().to_str().unwrap(),
            "--mem-gb",
            &format!("{budget:.9}"),
            "--max-batch",
            "4",
            "--input",
            "-",
            "--output",
            "-",
            "--ignore-eos",
        ],
        &input,
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("2 of the 4 sequence slots"), "{err}");
    // Default drafting yields to a budget this tight: its journals would take a slot.
    assert!(err.contains("| drafting off: its journals and rows ("), "{err}");
    assert!(err.contains("(--draft ngram drafts anyway)"), "{err}");
    let key = |text: &str| {
        let mut v: Vec<(i64, Vec<u32>)> =
            records(text).iter().map(|r| (r["id"].as_i64().unwrap(), ids(&r["generated_ids"]))).collect();
        v.sort();
        v
    };
    assert_eq!(key(&streamed), key(&resident));
    assert_eq!(key(&resident).len(), 5);
}

/// A batch of token-id requests needs no tokenizer files (as `run --ids`); a text prompt is
/// refused on its line. Two lines with one id: the second is refused, naming the first.
#[test]
fn batch_runs_ids_without_a_tokenizer_and_refuses_a_repeated_id() {
    let (_tmp, dir) = crate::checkpoint_tests::copy_tiny();
    for name in ["tiktoken.model", "tokenizer_config.json", "reference.json"] {
        std::fs::remove_file(dir.join(name)).unwrap();
    }
    let d = dir.to_str().unwrap();
    let input = concat!(
        "{\"id\": \"a\", \"ids\": [5, 6, 7], \"max_tokens\": 3}\n",
        "{\"id\": \"b\", \"prompt\": \"hello\", \"max_tokens\": 3}\n",
        "{\"id\": \"a\", \"ids\": [8, 9], \"max_tokens\": 3}\n",
        "{\"ids\": [1, 2], \"max_tokens\": 2}\n",
    );
    let (code, out, err) = k3ring_stdin(
        &["batch", "--model", d, "--input", "-", "--output", "-", "--ignore-eos", "--threads", "1"],
        input,
    );
    assert_eq!(code, 0, "{err}");
    assert_eq!(err.matches("no tokenizer (").count(), 1, "said once: {err}");
    let records: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let by_line =
        |line: u64| records.iter().find(|r| r["line"] == line).unwrap_or_else(|| panic!("line {line}: {out}"));
    assert!(by_line(2)["error"].as_str().unwrap().contains("tiktoken.model"), "{out}");
    assert_eq!(by_line(3)["id"], "a");
    assert!(by_line(3)["error"].as_str().unwrap().contains("id \"a\" is already the id of line 1"), "{out}");
    let done: Vec<&serde_json::Value> = records.iter().filter(|r| r.get("generated_ids").is_some()).collect();
    assert_eq!(done.len(), 2, "{out}");
    let a = done.iter().find(|r| r["id"] == "a").unwrap();
    assert_eq!(a["generated_ids"].as_array().unwrap().len(), 3);
    // Without a tokenizer the text is the ids as <id> marks.
    assert!(a["text"].as_str().unwrap().starts_with('<'), "{a}");
    assert!(done.iter().any(|r| r["id"] == 4), "a line without an id is named by its line: {out}");
}

/// A `messages` line: the chat template renders the conversation (as `chat` and the server do),
/// and the reply is read back into `reasoning_content` and `text` (the content), its markup in
/// neither; the tokens are those of the rendered ids run as an `ids` line.
#[test]
fn batch_messages_lines_render_the_template_and_split_the_reply() {
    use k3ring::chat::parse::{Channel, CompletionParser, Event};
    use k3ring::chat::template::{render, to_ids, Message, Specials, Thinking};
    let tok = k3ring::tokenizer::Tokenizer::from_model_dir(&tiny_dir()).unwrap();
    let sp = Specials::of(&tok).unwrap();
    let d = tiny_dir();
    let d = d.to_str().unwrap();
    let conversation = [
        Message::system("Be brief."),
        Message::user("Hello"),
        Message::assistant(None, "Hi."),
        Message::user("Again?"),
    ];
    let messages = serde_json::json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again?"},
    ]);
    let mut some_text = false;
    for thinking in [true, false] {
        let rendered = to_ids(
            &render(&conversation, Thinking { enabled: thinking, ..Thinking::default() }, true).unwrap(),
            &tok,
            &sp,
        )
        .unwrap();
        let input = format!(
            "{}\n{}\n",
            serde_json::json!({"id": "chat", "messages": messages, "thinking": thinking, "max_tokens": 24}),
            serde_json::json!({"id": "ids", "ids": rendered, "max_tokens": 24}),
        );
        let (code, out, err) =
            k3ring_stdin(&["batch", "--model", d, "--input", "-", "--output", "-", "--ignore-eos"], &input);
        assert_eq!(code, 0, "{err}");
        let records: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        let of = |id: &str| records.iter().find(|r| r["id"] == id).unwrap_or_else(|| panic!("{id}: {out}"));
        let (chat, plain) = (of("chat"), of("ids"));
        assert_eq!(chat["prompt_tokens"].as_u64().unwrap(), rendered.len() as u64, "{chat}");
        // The same tokens, up to where a random model's reply breaks the template's markup
        // (then it ends there, said on stderr, as the server does).
        let (got, all) = (ids(&chat["generated_ids"]), ids(&plain["generated_ids"]));
        assert!(all.starts_with(&got) && !got.is_empty(), "thinking {thinking}: {got:?} vs {all:?}");
        assert!(got.len() == all.len() || err.contains("broke the chat template"), "{err}");
        // The channels, as the template's parser reads the same ids.
        let mut parser = CompletionParser::new(&tok, sp, thinking);
        let (mut reasoning, mut content) = (Vec::new(), Vec::new());
        for id in ids(&chat["generated_ids"]) {
            match parser.push(id) {
                Ok(Event::Payload(Channel::Reasoning)) => reasoning.push(id),
                Ok(Event::Payload(Channel::Content)) => content.push(id),
                Ok(_) => {}
                Err(_) => break,
            }
        }
        let text = |v: &[u32]| tok.decode_or_mark(v, false);
        assert_eq!(chat["text"].as_str().unwrap(), text(&content), "{chat}");
        let want_reasoning = text(&reasoning);
        some_text |= !content.is_empty() || !reasoning.is_empty();
        assert_eq!(chat["reasoning_content"].as_str().unwrap_or(""), want_reasoning, "{chat}");
        if !thinking {
            assert!(chat.get("reasoning_content").is_none(), "{chat}");
        }
    }
    assert!(some_text, "no reply had any content or reasoning to check");
    // reasoning_effort "none" is thinking off, as the server takes it: the same prompt.
    let off = serde_json::json!({"id": "none", "messages": messages, "reasoning_effort": "none", "max_tokens": 1});
    let no_think = serde_json::json!({"id": "off", "messages": messages, "thinking": false, "max_tokens": 1});
    let (code, out, err) =
        k3ring_stdin(&["batch", "--model", d, "--input", "-", "--output", "-"], &format!("{off}\n{no_think}\n"));
    assert_eq!(code, 0, "{err}");
    let prompts: Vec<u64> = out
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["prompt_tokens"].as_u64().unwrap())
        .collect();
    assert_eq!(prompts.len(), 2, "{out}");
    assert_eq!(prompts[0], prompts[1], "{out}");
    // Refused on their lines: a conversation that asks for no reply, two prompts, thinking
    // without messages, an unknown role.
    let bad = [
        serde_json::json!({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}),
        serde_json::json!({"messages": [{"role": "user", "content": "a"}], "prompt": "x"}),
        serde_json::json!({"prompt": "x", "thinking": false}),
        serde_json::json!({"messages": [{"role": "robot", "content": "a"}]}),
    ];
    let input: String = bad.iter().map(|b| format!("{b}\n")).collect();
    let (code, out, err) = k3ring_stdin(&["batch", "--model", d, "--input", "-", "--output", "-"], &input);
    assert_eq!(code, 2, "{err}");
    let errors: Vec<String> = out
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["error"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(errors.len(), 4, "{out}");
    for (e, says) in errors.iter().zip([
        "the last message must be the user's",
        "not several",
        "go with \"messages\"",
        "role \"robot\" is not supported",
    ]) {
        assert!(e.contains(says), "{e}");
    }
}

/// `messages` lines take tools and response formats as the server does: a forced call's record
/// has `tool_calls` with arguments valid for the tool, a schema's reply is JSON for it, and the
/// summary says what the masks cost.
#[test]
fn batch_messages_lines_take_tools_and_response_formats() {
    let d = tiny_dir();
    let d = d.to_str().unwrap();
    let params = serde_json::json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["n"], "additionalProperties": false});
    let tool = serde_json::json!({"type": "function", "function": {"name": "count", "parameters": params}});
    let user = serde_json::json!([{"role": "user", "content": "Count."}]);
    let lines = [
        serde_json::json!({"id": "call", "messages": user, "tools": [tool], "tool_choice": "required", "thinking": false,
            "max_tokens": 1000, "temperature": 0.8, "seed": 3}),
        serde_json::json!({"id": "json", "messages": user, "thinking": false, "max_tokens": 120, "temperature": 0.8, "seed": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": params}}}),
        serde_json::json!({"id": "bad", "messages": user, "tool_choice": "required"}),
    ];
    let input: String = lines.iter().map(|l| format!("{l}\n")).collect();
    let (code, out, err) = k3ring_stdin(&["batch", "--model", d, "--input", "-", "--output", "-"], &input);
    assert_eq!(code, 0, "one line is refused, the others run: {err}");
    let records: Vec<serde_json::Value> = out.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    let by_id = |id: &str| records.iter().find(|r| r["id"] == id).unwrap_or_else(|| panic!("{id}: {out}"));
    let calls = by_id("call")["tool_calls"].as_array().unwrap_or_else(|| panic!("{out}"));
    assert_eq!(by_id("call")["finish_reason"], "stop", "{out}");
    for c in calls {
        assert_eq!(c["function"]["name"], "count");
        let args: serde_json::Value = serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
        assert!((1..=9).contains(&args["n"].as_i64().unwrap()), "{args}");
    }
    let json: serde_json::Value = serde_json::from_str(by_id("json")["text"].as_str().unwrap()).unwrap();
    assert!((1..=9).contains(&json["n"].as_i64().unwrap()), "{json}");
    assert!(by_id("bad")["error"].as_str().unwrap().contains("needs tools"), "{out}");
    assert!(err.contains("constrained replies: their masks took"), "{err}");
}
