//! Log-probabilities (issue 32): a sequence's are the same numbers batched as solo, whatever
//! else is in the batch, when it arrives and whether it drafts; they are a log-softmax of the
//! logits that chose each token; `run --logprobs N` writes them to --json.

use std::collections::HashMap;

use k3ring::engine::logprobs::TokenLogprob;
use k3ring::engine::{BatchOptions, BatchSink, DraftOptions, Finished, GenerateOptions, Ticket};
use kernels::Isa;

use crate::batch_tests::requests;
use crate::common::*;

#[derive(Default)]
struct Collect {
    tokens: HashMap<Ticket, Vec<u32>>,
    logprobs: HashMap<Ticket, Vec<TokenLogprob>>,
    finished: usize,
}

impl BatchSink for Collect {
    fn logprob(&mut self, ticket: Ticket, logprob: TokenLogprob) {
        self.logprobs.entry(ticket).or_default().push(logprob);
    }
    fn token(&mut self, ticket: Ticket, id: u32) -> bool {
        if let Some(lps) = self.logprobs.get(&ticket) {
            let tokens = self.tokens.get(&ticket).map_or(0, Vec::len);
            assert_eq!(lps.len(), tokens + 1, "a log-probability before each token");
        }
        self.tokens.entry(ticket).or_default().push(id);
        false
    }
    fn finished(&mut self, _: Finished) {
        self.finished += 1;
    }
}

#[test]
fn batched_logprobs_equal_solo_runs_greedy_sampled_and_drafted() {
    let o = open(&tiny_dir(), 2, Isa::best());
    let engine = &o.engine;
    let vocab = engine.model.cfg.vocab_size as u32;
    let mut reqs = requests(10, vocab);
    for (i, r) in reqs.iter_mut().enumerate() {
        r.logprobs = (i % 3 != 2).then_some(i % 6);
    }
    let draft = Some(DraftOptions { sequences: 2, ..DraftOptions::default() });
    let mut b = engine.batcher(BatchOptions { max_batch: 4, prefill_chunk: 7, context: 64, draft }).unwrap();
    let mut sink = Collect::default();
    let mut tickets = Vec::new();
    for step in 0..10_000 {
        if step % 2 == 0 && tickets.len() < reqs.len() {
            tickets.push(b.submit(reqs[tickets.len()].clone()).unwrap());
        }
        let ran = b.step(&mut sink).unwrap();
        if !ran && tickets.len() == reqs.len() && b.pending() == 0 {
            break;
        }
    }
    assert_eq!(sink.finished, reqs.len());
    for (r, t) in reqs.iter().zip(&tickets) {
        let opts = GenerateOptions {
            gen: r.max_tokens,
            sampling: r.sampling.clone(),
            prefill_chunk: 5,
            logprobs: r.logprobs,
            keep_logits: true,
            ..GenerateOptions::default()
        };
        let solo = engine.generate(&r.prompt, &opts, |_| {}).unwrap();
        assert_eq!(sink.tokens[t], solo.generated_ids);
        match r.logprobs {
            None => assert!(!sink.logprobs.contains_key(t) && solo.logprobs.is_empty()),
            Some(top) => {
                // Bit for bit, alternatives included.
                assert_eq!(sink.logprobs[t], solo.logprobs, "request {t}");
                for ((lp, logits), id) in solo.logprobs.iter().zip(&solo.logits).zip(&solo.generated_ids) {
                    assert_eq!(lp.id, *id);
                    assert_eq!(lp.top.len(), top.min(logits.len()));
                    // A log-softmax: exp sums to 1 over the vocabulary, and the chosen token's
                    // value is its logit minus the log-sum-exp.
                    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                    let lse = max + logits.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
                    assert!((lp.logprob as f64 - (logits[*id as usize] as f64 - lse)).abs() < 1e-5);
                    if let Some(first) = lp.top.first() {
                        assert_eq!(first.id, argmax(logits));
                        assert!(lp.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
                    }
                    if r.sampling.is_greedy() {
                        assert!(top == 0 || lp.top[0].id == *id);
                    }
                }
            }
        }
    }
}

/// `run --logprobs N --json F` writes per generated token its id, log-probability and N
/// alternatives, the same with and without drafting; without --json it is refused.
#[test]
fn run_writes_logprobs_to_json() {
    let dir = tiny_dir();
    let read = |extra: &[&str]| {
        let json = tempfile::NamedTempFile::new().unwrap();
        let base = ["run", "--model", dir.to_str().unwrap(), "--ids", "5,17,300", "--gen", "12", "--logprobs", "3"];
        let args = [&base[..], &["--json", json.path().to_str().unwrap()], extra].concat();
        let (code, _, err) = k3ring_stdin(&args, "");
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(json.path()).unwrap()).unwrap();
        v
    };
    let plain = read(&["--no-draft"]);
    let lps = plain["logprobs"].as_array().unwrap();
    assert_eq!(lps.len(), plain["generated_ids"].as_array().unwrap().len());
    for (lp, id) in lps.iter().zip(plain["generated_ids"].as_array().unwrap()) {
        assert_eq!(&lp["id"], id);
        assert!(lp["logprob"].as_f64().unwrap() <= 0.0);
        assert_eq!(lp["top"].as_array().unwrap().len(), 3);
        assert_eq!(&lp["top"][0]["id"], id, "greedy picks the likeliest");
    }
    assert_eq!(read(&["--draft", "ngram"])["logprobs"], plain["logprobs"]);
    let (code, _, err) = k3ring_stdin(&["run", "--model", dir.to_str().unwrap(), "--logprobs", "2"], "");
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--json"), "{err}");
    let (code, _, err) =
        k3ring_stdin(&["run", "--model", dir.to_str().unwrap(), "--logprobs", "21", "--json", "-"], "");
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--logprobs"), "{err}");
}

/// Prompt log-probabilities (`echo`): batched, each prompt token's equals a log-softmax of the
/// solo run's logits at the position before it, bit for bit, while other sequences decode and
/// draft; a request for no tokens runs its prompt and finishes with nothing generated.
#[test]
fn batched_prompt_logprobs_equal_solo_prompt_logits() {
    #[derive(Default)]
    struct Prompts {
        got: HashMap<Ticket, Vec<(usize, TokenLogprob)>>,
        tokens: HashMap<Ticket, Vec<u32>>,
        finished: HashMap<Ticket, Finished>,
    }
    impl BatchSink for Prompts {
        fn prompt_logprob(&mut self, ticket: Ticket, position: usize, lp: TokenLogprob) {
            assert!(!self.tokens.contains_key(&ticket), "prompt log-probabilities come before the tokens");
            self.got.entry(ticket).or_default().push((position, lp));
        }
        fn token(&mut self, ticket: Ticket, id: u32) -> bool {
            self.tokens.entry(ticket).or_default().push(id);
            false
        }
        fn finished(&mut self, f: Finished) {
            self.finished.insert(f.ticket, f);
        }
    }
    let o = open(&tiny_dir(), 2, Isa::best());
    let engine = &o.engine;
    let vocab = engine.model.cfg.vocab_size as u32;
    let mut reqs = requests(9, vocab);
    for (i, r) in reqs.iter_mut().enumerate() {
        if i % 2 == 0 {
            r.prompt_logprobs = true;
            r.logprobs = Some(i % 4);
            r.max_tokens = if i % 4 == 0 { 0 } else { r.max_tokens };
        }
    }
    let draft = Some(DraftOptions { sequences: 2, ..DraftOptions::default() });
    // Two slots: the logits buffer has few rows beyond the decoding ones.
    let mut b = engine.batcher(BatchOptions { max_batch: 2, prefill_chunk: 9, context: 64, draft }).unwrap();
    let mut sink = Prompts::default();
    let tickets: Vec<_> = reqs.iter().map(|r| b.submit(r.clone()).unwrap()).collect();
    let mut steps = 0;
    while b.step(&mut sink).unwrap() {
        steps += 1;
        assert!(steps < 10_000);
    }
    for (r, t) in reqs.iter().zip(&tickets) {
        let f = &sink.finished[t];
        assert_eq!(f.generated, sink.tokens.get(t).map_or(0, Vec::len));
        if !r.prompt_logprobs {
            assert!(!sink.got.contains_key(t));
            continue;
        }
        let opts = GenerateOptions {
            gen: r.max_tokens,
            sampling: r.sampling.clone(),
            prompt_logits: true,
            ..GenerateOptions::default()
        };
        let solo = engine.generate(&r.prompt, &opts, |_| {}).unwrap();
        let v = vocab as usize;
        let want: Vec<(usize, TokenLogprob)> = (1..r.prompt.len())
            .map(|p| {
                (
                    p,
                    k3ring::engine::logprobs::token_logprob(
                        &solo.prompt_logits[(p - 1) * v..p * v],
                        r.prompt[p],
                        r.logprobs.unwrap(),
                    ),
                )
            })
            .collect();
        assert_eq!(sink.got.get(t).cloned().unwrap_or_default(), want, "request {t}");
        if r.max_tokens == 0 {
            assert_eq!(f.generated, 0);
        } else {
            assert_eq!(sink.tokens[t], solo.generated_ids);
        }
    }
}
