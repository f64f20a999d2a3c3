//! Draft-and-verify decoding (issue 30): a drafted run's tokens and logits equal plain greedy
//! decoding's, resident and streamed, solo, in chat and in a batch; a step's rows past the kept
//! ones are taken back exactly.

use k3ring::engine::{
    ChatSession, DraftOptions, EngineError, GenerateOptions, Generation, Replay, ReplyOptions, Sampling,
};
use k3ring::model::LogitRows;
use kernels::Isa;

use super::batch_tests::open_streamed;
use super::common::{open, pack, tiny_dir};

fn bits(rows: &[Vec<f32>]) -> Vec<Vec<u32>> {
    rows.iter().map(|r| r.iter().map(|v| v.to_bits()).collect()).collect()
}

fn state_bytes(st: &k3ring::model::ModelState) -> Vec<u8> {
    let mut out = Vec::new();
    st.save_into(&mut out);
    out
}

/// Prompts: repetitive ones (where the n-gram guesses are right), and ones with no repeat.
fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    let cycle = |period: u32, n: u32| (0..n).map(|i| (i % period) * 37 % vocab + 3).collect::<Vec<u32>>();
    vec![
        cycle(3, 24),
        cycle(7, 30),
        cycle(2, 9),
        (0..20u32).map(|i| (i * 101 + 17) % vocab).collect(),
        vec![5, 6],
        vec![9],
    ]
}

fn generate<S: k3ring::model::weights::WeightSource + k3ring::model::LayerHook>(
    engine: &k3ring::engine::Engine<S>,
    prompt: &[u32],
    gen: usize,
    chunk: usize,
    draft: Option<DraftOptions>,
) -> Generation {
    let opts = GenerateOptions { gen, prefill_chunk: chunk, keep_logits: true, draft, ..Default::default() };
    engine.generate(prompt, &opts, |_| {}).unwrap()
}

#[test]
fn taking_rows_back_leaves_the_state_of_the_kept_rows() {
    let o = open(&tiny_dir(), 2, Isa::best());
    let e = &o.engine;
    let prompt = [3u32, 9, 27, 81];
    let step = [7u32, 11, 13, 17, 19, 23];
    for keep in 0..=step.len() {
        let mut drafted = e.session(16, 8).unwrap();
        e.prefill(&mut drafted, &prompt, LogitRows::Last, None).unwrap();
        drafted.state.arm(&e.model.cfg, step.len());
        e.prefill(&mut drafted, &step, LogitRows::All, None).unwrap();
        drafted.state.rewind(&e.model.kernels, &e.model.cfg, keep).unwrap();
        assert_eq!(drafted.state.armed_rows(), None, "a rewind disarms");
        let mut plain = e.session(16, 8).unwrap();
        e.prefill(&mut plain, &prompt, LogitRows::Last, None).unwrap();
        if keep > 0 {
            e.prefill(&mut plain, &step[..keep], LogitRows::Last, None).unwrap();
        }
        assert_eq!(drafted.state.pos(), plain.state.pos(), "keep {keep}");
        assert_eq!(state_bytes(&drafted.state), state_bytes(&plain.state), "keep {keep}: the states differ");
        // And the next step sees the same context.
        let a = e.prefill(&mut drafted, &[29], LogitRows::Last, None).unwrap().to_vec();
        let b = e.prefill(&mut plain, &[29], LogitRows::Last, None).unwrap().to_vec();
        assert_eq!(bits(&[a]), bits(&[b]), "keep {keep}: the next logits differ");
    }
    // Refusals: not armed, or more rows than ran.
    let mut s = e.session(16, 8).unwrap();
    e.prefill(&mut s, &prompt, LogitRows::Last, None).unwrap();
    assert!(s.state.rewind(&e.model.kernels, &e.model.cfg, 0).is_err());
    s.state.arm(&e.model.cfg, 3);
    e.prefill(&mut s, &step[..2], LogitRows::All, None).unwrap();
    assert!(s.state.rewind(&e.model.kernels, &e.model.cfg, 3).is_err());
    s.state.arm(&e.model.cfg, 3);
    let err = e.prefill(&mut s, &step[..4], LogitRows::All, None).expect_err("a step wider than armed");
    assert!(err.to_string().contains("armed"), "{err}");
}

/// Every prompt, draft length and n-gram minimum: the drafted run's ids and logits equal the
/// plain run's; and the repetitive prompts did get guesses accepted (so the comparison covers
/// kept and taken-back rows both).
fn check_identity<S: k3ring::model::weights::WeightSource + k3ring::model::LayerHook>(
    what: &str,
    engine: &k3ring::engine::Engine<S>,
    gen: usize,
    settings: &[(usize, usize, usize)],
) {
    let vocab = engine.model.cfg.vocab_size as u32;
    let mut accepted = 0;
    let mut rejected = 0;
    for prompt in prompts(vocab) {
        let plain = generate(engine, &prompt, gen, 8, None);
        assert_eq!(plain.draft.steps as usize, plain.generated_ids.len() - 1, "{what}: one step per token");
        for &(len, ngram_min, chunk) in settings {
            let draft = DraftOptions::ngram(len, ngram_min);
            let d = generate(engine, &prompt, gen, chunk, Some(draft.clone()));
            assert_eq!(d.generated_ids, plain.generated_ids, "{what}: {prompt:?} with {draft:?}, chunk {chunk}");
            assert_eq!(bits(&d.logits), bits(&plain.logits), "{what}: {prompt:?} with {draft:?}");
            let s = d.draft;
            assert_eq!(
                s.steps + s.accepted,
                d.generated_ids.len() as u64 - 1,
                "{what}: steps and kept guesses make the tokens"
            );
            accepted += s.accepted;
            rejected += s.drafted - s.accepted;
        }
    }
    // Guesses that are right at a chosen rate (a replay of the plain run), so that kept and
    // taken-back rows are covered whatever the model's text.
    for prompt in prompts(vocab) {
        let plain = generate(engine, &prompt, gen, 8, None);
        for (accept, len, chunk) in [(1.0, 4, 8), (0.75, 3, 8), (0.5, 8, 16), (0.0, 2, 3)] {
            let replay = Replay::new(vec![(prompt.clone(), plain.generated_ids.clone())], accept, 9);
            let draft = DraftOptions { replay: Some(replay), ..DraftOptions::ngram(len, 2) };
            let d = generate(engine, &prompt, gen, chunk, Some(draft));
            assert_eq!(d.generated_ids, plain.generated_ids, "{what}: {prompt:?}, replay keeping {accept}");
            assert_eq!(bits(&d.logits), bits(&plain.logits), "{what}: {prompt:?}, replay keeping {accept}");
            if accept == 1.0 && plain.generated_ids.len() > 2 {
                assert!(d.draft.steps < plain.draft.steps, "{what}: right guesses save steps: {:?}", d.draft);
            }
            accepted += d.draft.accepted;
            rejected += d.draft.drafted - d.draft.accepted;
        }
    }
    assert!(accepted > 0 && rejected > 0, "{what}: {accepted} guesses kept, {rejected} taken back");
}

#[test]
fn drafted_runs_equal_plain_greedy_runs_resident() {
    let o = open(&tiny_dir(), 2, Isa::best());
    let settings = [(1, 1, 8), (2, 2, 8), (4, 1, 8), (4, 2, 3), (8, 1, 32), (16, 1, 32), (16, 3, 2)];
    check_identity("resident", &o.engine, 40, &settings);
}

#[test]
fn drafted_runs_equal_plain_greedy_runs_streamed() {
    let trunk = pack(&tiny_dir());
    let (_, probe) = open_streamed(trunk.path(), 64_000_000, 1);
    let (o, plan) = open_streamed(trunk.path(), probe.minimum_bytes, 1);
    check_identity(&format!("streamed at {}", plan.describe()), &o.engine, 24, &[(4, 1, 8), (8, 2, 9)]);
}

#[test]
fn a_chat_reply_with_drafts_equals_one_without() {
    let o = open(&tiny_dir(), 2, Isa::best());
    let e = &o.engine;
    let turns: [&[u32]; 3] = [&[4, 5, 6, 4, 5, 6, 4, 5], &[6, 4, 5, 6], &[1, 2, 3]];
    let reply = |draft: Option<DraftOptions>| {
        let mut chat = ChatSession::new(e, 128, 4).unwrap();
        let mut out = Vec::new();
        for t in turns {
            chat.push(t);
            let opts = ReplyOptions {
                constraint: None,
                max_tokens: 12,
                sampling: Sampling::default(),
                stop_ids: vec![],
                stop: None,
                draft: draft.clone(),
            };
            out.push(chat.reply(e, &opts, |_| true).unwrap());
            assert_eq!(chat.fed(), chat.ids().len() - 1, "the last token stays pending");
        }
        (out, chat.ids().to_vec())
    };
    let (plain, plain_ids) = reply(None);
    let (drafted, drafted_ids) = reply(Some(DraftOptions::ngram(4, 1)));
    assert_eq!(drafted_ids, plain_ids);
    for (p, d) in plain.iter().zip(&drafted) {
        assert_eq!(p.ids, d.ids);
    }
    assert!(drafted.iter().map(|r| r.draft.drafted).sum::<u64>() > 0, "no guess was made");
}

#[test]
fn drafting_with_sampling_is_refused() {
    let o = open(&tiny_dir(), 1, Isa::Scalar);
    let sampling = Sampling { temperature: 0.8, ..Sampling::default() };
    let opts = GenerateOptions { gen: 4, sampling, draft: Some(DraftOptions::default()), ..Default::default() };
    let err = o.engine.generate(&[1, 2, 3], &opts, |_| {}).expect_err("refused");
    assert!(matches!(err, EngineError::Draft(_)), "{err}");
    assert!(err.to_string().contains("greedy"), "{err}");
    let bad = GenerateOptions { gen: 4, draft: Some(DraftOptions::ngram(0, 2)), ..Default::default() };
    assert!(o.engine.generate(&[1, 2, 3], &bad, |_| {}).is_err());
    let none = Some(DraftOptions { sequences: 0, ..DraftOptions::default() });
    let bad = k3ring::engine::BatchOptions { max_batch: 2, prefill_chunk: 4, context: 16, draft: none };
    let err = o.engine.batcher(bad).err().expect("refused");
    assert!(err.to_string().contains("--draft-sequences 0"), "{err}");
}

/// Greedy requests whose prompts repeat themselves, for drafts that get accepted in a batch.
fn repetitive_requests(vocab: u32) -> Vec<k3ring::engine::BatchRequest> {
    prompts(vocab)
        .into_iter()
        .take(3)
        .enumerate()
        .map(|(i, prompt)| k3ring::engine::BatchRequest {
            constraint: None,
            prompt,
            max_tokens: [20, 13, 25][i],
            sampling: Sampling::default(),
            stop_ids: Vec::new(),
            logprobs: None,
            prompt_logprobs: false,
        })
        .collect()
}

#[test]
fn drafting_in_a_batch_keeps_every_sequence_equal_to_its_solo_run() {
    let o = open(&tiny_dir(), 2, Isa::best());
    let vocab = o.engine.model.cfg.vocab_size as u32;
    // (slots, (draft length, ngram-min, sequences that may draft in a step)).
    for (max_batch, draft) in [(1, (4, 1, 2)), (3, (2, 2, 1)), (5, (8, 1, 2)), (16, (16, 1, 16)), (16, (4, 1, 3))] {
        let (len, ngram_min, sequences) = draft;
        let draft = Some(DraftOptions { sequences, ..DraftOptions::ngram(len, ngram_min) });
        for (staggered, replay) in [(false, None), (true, None), (false, Some(0.7)), (true, Some(1.0))] {
            let what = format!("resident, {draft:?}, staggered {staggered}, replay {replay:?}");
            let extra = repetitive_requests(vocab);
            let (s, by_drafting) = super::batch_tests::check_identity_with(
                &what,
                &o.engine,
                &o.engine,
                max_batch,
                9,
                staggered,
                draft.clone(),
                replay,
                extra,
            );
            // With guesses every step, the pool is used: steps carry as many drafts as it
            // holds (two, where it holds more and two sequences decode at once).
            if replay.is_some() {
                assert!(s.accepted > 0, "{what}: {s:?}");
                let pool = sequences.min(max_batch);
                assert!(by_drafting[pool.min(2)] > 0, "{what}: {by_drafting:?}");
            }
        }
    }
}

#[test]
fn drafting_in_a_streamed_batch_keeps_every_sequence_equal_to_its_solo_run() {
    let trunk = pack(&tiny_dir());
    let reference = open(&tiny_dir(), 2, Isa::best());
    let (o, plan) = open_streamed(trunk.path(), 64_000_000, 4);
    let vocab = o.engine.model.cfg.vocab_size as u32;
    let draft = Some(DraftOptions::ngram(4, 1));
    let (s, _) = super::batch_tests::check_identity_with(
        &format!("streamed, {}", plan.describe()),
        &o.engine,
        &reference.engine,
        plan.sequences,
        6,
        true,
        draft,
        Some(0.75),
        repetitive_requests(vocab),
    );
    assert!(s.accepted > 0, "{s:?}");
}
