//! The prefix cache (issue 32): sequences that start from a snapshot of an earlier prompt's
//! state give the tokens a cold start gives, greedy, seeded and drafted, in mixed batches,
//! resident and streamed, while a pool too small for them all evicts as requests run.

use std::collections::HashMap;

use k3ring::engine::prefix_cache::PrefixCacheOptions;
use k3ring::engine::{
    BatchOptions, BatchRequest, BatchSink, DraftOptions, Engine, Finished, GenerateOptions, Sampling, Ticket,
};
use k3ring::model::weights::WeightSource;
use k3ring::model::LayerHook;
use kernels::Isa;

use crate::batch_tests::open_streamed;
use crate::common::*;

#[derive(Default)]
struct Collect {
    tokens: HashMap<Ticket, Vec<u32>>,
    finished: HashMap<Ticket, Finished>,
}

impl BatchSink for Collect {
    fn token(&mut self, ticket: Ticket, id: u32) -> bool {
        self.tokens.entry(ticket).or_default().push(id);
        false
    }
    fn finished(&mut self, f: Finished) {
        self.finished.insert(f.ticket, f);
    }
}

/// Conversations as a server sees them: a shared system prompt, then per user a growing
/// history; every turn resends it all. Greedy, seeded and (with drafting) drafted requests.
fn conversations(vocab: u32, users: usize, turns: usize) -> Vec<Vec<BatchRequest>> {
    let system: Vec<u32> = (0..21).map(|j| (j * 37 + 11) % vocab).collect();
    let mut history: Vec<Vec<u32>> = vec![system; users];
    (0..turns)
        .map(|turn| {
            (0..users)
                .map(|u| {
                    let question: Vec<u32> =
                        (0..3 + (u + turn) % 4).map(|j| ((u * 101 + turn * 13 + j * 7) as u32) % vocab).collect();
                    history[u].extend(question);
                    let sampling = match (u + turn) % 3 {
                        0 => Sampling::default(),
                        1 => Sampling { temperature: 0.8, top_k: Some(20), top_p: None, seed: (u * 10 + turn) as u64 },
                        _ => Sampling { temperature: 1.0, top_k: None, top_p: Some(0.9), seed: 7 },
                    };
                    let r = BatchRequest {
                        constraint: None,
                        prompt: history[u].clone(),
                        max_tokens: 5 + u % 3,
                        sampling,
                        stop_ids: Vec::new(),
                        logprobs: None,
                        prompt_logprobs: false,
                    };
                    // The reply joins the history, as a chat front end resends it.
                    history[u].extend([(u as u32 + 3) % vocab, (turn as u32 + 5) % vocab]);
                    r
                })
                .collect()
        })
        .collect()
}

fn solo<S: WeightSource + LayerHook>(engine: &Engine<S>, r: &BatchRequest) -> Vec<u32> {
    let opts = GenerateOptions {
        gen: r.max_tokens,
        sampling: r.sampling.clone(),
        prefill_chunk: 5,
        ..GenerateOptions::default()
    };
    engine.generate(&r.prompt, &opts, |_| {}).unwrap().generated_ids
}

/// Runs each wave of requests through one batcher with the cache, checks every sequence
/// against `reference`'s solo run; returns the sequences' cached tokens and the cache's stats.
fn check<S: WeightSource + LayerHook>(
    engine: &Engine<S>,
    reference: &Engine<impl WeightSource + LayerHook>,
    opts: BatchOptions,
    cache: PrefixCacheOptions,
    waves: &[Vec<BatchRequest>],
) -> (Vec<usize>, k3ring::engine::prefix_cache::PrefixStats) {
    let mut b = engine.batcher(opts).unwrap();
    b.enable_prefix_cache(cache);
    let mut cached = Vec::new();
    for wave in waves {
        let mut sink = Collect::default();
        let tickets: Vec<_> = wave.iter().map(|r| b.submit(r.clone()).unwrap()).collect();
        let mut steps = 0;
        while b.step(&mut sink).unwrap() {
            steps += 1;
            assert!(steps < 10_000);
        }
        for (r, t) in wave.iter().zip(&tickets) {
            assert_eq!(sink.tokens[t], solo(reference, r), "prompt of {} tokens", r.prompt.len());
            cached.push(sink.finished[t].cached_tokens);
        }
    }
    (cached, b.prefix_stats().unwrap())
}

#[test]
fn sequences_from_cached_prefixes_equal_cold_starts_resident() {
    let o = open(&tiny_dir(), 2, Isa::best());
    let vocab = o.engine.model.cfg.vocab_size as u32;
    let waves = conversations(vocab, 4, 4);
    let draft = Some(DraftOptions { sequences: 2, ..DraftOptions::default() });
    for (max_batch, chunk, stride) in [(1, 8, 4), (3, 5, 8), (4, 32, 16)] {
        let opts = BatchOptions { max_batch, prefill_chunk: chunk, context: 96, draft: draft.clone() };
        let (cached, stats) = check(&o.engine, &o.engine, opts, PrefixCacheOptions { bytes: 1 << 30, stride }, &waves);
        // Every turn after the first starts from the previous turn's prompt, one token short of it.
        assert!(cached[..4].iter().all(|&c| c == 0 || c >= stride), "{cached:?}");
        assert!(cached[4..].iter().all(|&c| c > 21), "later turns reuse their history: {cached:?}");
        assert!(stats.hits >= 12 && stats.evictions == 0, "{stats:?}");
        assert_eq!(stats.cached_tokens, cached.iter().sum::<usize>() as u64);
    }
}

#[test]
fn a_pool_too_small_for_every_prefix_evicts_and_stays_exact_streamed_too() {
    let o = open(&tiny_dir(), 2, Isa::best());
    let vocab = o.engine.model.cfg.vocab_size as u32;
    let waves = conversations(vocab, 5, 3);
    // Room for about three snapshots of these prompts.
    let mut probe =
        o.engine.batcher(BatchOptions { max_batch: 1, prefill_chunk: 8, context: 96, draft: None }).unwrap();
    probe.enable_prefix_cache(PrefixCacheOptions { bytes: 1 << 30, stride: 1 << 20 });
    probe.submit(waves[1][0].clone()).unwrap();
    while probe.step(&mut Collect::default()).unwrap() {}
    let one = probe.prefix_stats().unwrap().bytes;
    assert!(one > 0);
    let cache = PrefixCacheOptions { bytes: 3 * one, stride: 8 };
    let opts = BatchOptions { max_batch: 3, prefill_chunk: 6, context: 96, draft: None };
    let (_, stats) = check(&o.engine, &o.engine, opts.clone(), cache, &waves);
    assert!(stats.evictions > 0 && stats.hits > 0, "{stats:?}");
    assert!(stats.bytes <= 3 * one, "{stats:?}");
    // Streamed at the smallest budget, the same.
    let trunk = pack(&tiny_dir());
    let (_, plan) = open_streamed(trunk.path(), 64_000_000, 16);
    let (s, plan) = open_streamed(trunk.path(), plan.minimum_bytes, 16);
    let opts = BatchOptions { max_batch: plan.sequences, ..opts };
    let (_, stats) = check(&s.engine, &o.engine, opts, cache, &waves);
    assert!(stats.hits > 0, "{stats:?}");
}
