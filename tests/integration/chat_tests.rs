//! Conversations (issue 15): reused-cache turns against full recompute, save/restore identity,
//! the REPL driven through stdin, and every state-file refusal.

use std::path::Path;

use k3ring::chat::template::{Specials, Thinking};
use k3ring::chat::Conversation;
use k3ring::engine::{ChatSession, Fingerprint, GenerateOptions, ReplyOptions, Sampling};

use crate::common::{k3ring_stdin, open, tiny_dir};

const TURNS: [&str; 3] = ["Hello there", "What is <|open|> in your template?", "Thanks, bye"];

fn sampling(seeded: bool, seed: u64) -> Sampling {
    if seeded {
        Sampling { temperature: 0.9, top_k: Some(40), top_p: Some(0.95), seed }
    } else {
        Sampling::default()
    }
}

/// Runs `turns` on `conv`; returns each reply's ids and the transcript ids before it.
fn talk(
    opened: &k3ring::engine::Opened,
    conv: &mut Conversation,
    turns: &[&str],
    seeded: bool,
) -> Vec<(Vec<u32>, Vec<u32>)> {
    let tok = &opened.tokenizer;
    let mut out = Vec::new();
    for text in turns {
        let ids = conv.user_turn_ids(tok, text).unwrap();
        conv.push_user(text, &ids);
        let before = conv.session.ids().to_vec();
        let seed = k3ring::rng::splitmix64_at(7, before.len() as u64);
        let opts = ReplyOptions {
            constraint: None,
            max_tokens: 10,
            sampling: sampling(seeded, seed),
            stop_ids: conv.specials.end_ids().to_vec(),
            stop: None,
            draft: None,
        };
        let mut parser = conv.parser(tok);
        let reply = conv
            .session
            .reply(&opened.engine, &opts, |id| {
                let _ = parser.push(id);
                true
            })
            .unwrap();
        conv.finish_reply(tok, &parser).unwrap();
        out.push((before, reply.ids));
    }
    out
}

fn conversation(opened: &k3ring::engine::Opened, chunk: usize) -> Conversation {
    let session = ChatSession::new(&opened.engine, 2048, chunk).unwrap();
    let specials = Specials::of(&opened.tokenizer).unwrap();
    Conversation::new(session, specials, Thinking::default(), Some("You are helpful."))
}

#[test]
fn each_turn_equals_a_fresh_generate_over_the_whole_transcript() {
    let opened = open(&tiny_dir(), 2, kernels::Kernels::detect().isa());
    for seeded in [false, true] {
        let mut conv = conversation(&opened, 16);
        let turns = talk(&opened, &mut conv, &TURNS, seeded);
        for (n, (prompt, reply)) in turns.iter().enumerate() {
            let seed = k3ring::rng::splitmix64_at(7, prompt.len() as u64);
            let opts = GenerateOptions {
                gen: 10,
                sampling: sampling(seeded, seed),
                stop_ids: conv.specials.end_ids().to_vec(),
                prefill_chunk: 32,
                ..GenerateOptions::default()
            };
            let fresh = opened.engine.generate(prompt, &opts, |_| {}).unwrap();
            assert_eq!(&fresh.generated_ids, reply, "turn {n}, seeded {seeded}");
            assert!(!reply.is_empty());
        }
        // Turn 2 prefilled only what it added: the transcript grew past turn 1's prompt.
        assert!(turns[1].0.starts_with(&turns[0].0));
    }
}

#[test]
fn a_restored_session_continues_byte_identically() {
    let opened = open(&tiny_dir(), 2, kernels::Kernels::detect().isa());
    let fp = Fingerprint::of_dir(&tiny_dir()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.state");
    for seeded in [false, true] {
        let mut whole = conversation(&opened, 16);
        let want = talk(&opened, &mut whole, &TURNS, seeded);
        let mut first = conversation(&opened, 16);
        talk(&opened, &mut first, &TURNS[..1], seeded);
        first
            .session
            .save(&k3ring::files::Output::resolve("--save-state", &path, false).unwrap(), fp, &first.extra_bytes())
            .unwrap();
        drop(first);
        let mut resumed = conversation(&opened, 8);
        let extra = resumed.session.restore(&opened.engine, &path, fp).unwrap();
        resumed.restore_extra(&extra).unwrap();
        let got = talk(&opened, &mut resumed, &TURNS[1..], seeded);
        assert_eq!(got, want[1..], "seeded {seeded}");
        assert_eq!(resumed.messages, whole.messages);
    }
}

/// Runs `k3ring chat ARGS` with `input` on stdin.
fn chat(args: &[&str], input: &str) -> (i32, String, String) {
    let model = tiny_dir();
    let mut all = vec!["chat", "--model", model.to_str().unwrap(), "--max-tokens", "8"];
    all.extend_from_slice(args);
    k3ring_stdin(&all, input)
}

fn history(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn chat_commands_through_stdin() {
    let dir = tempfile::tempdir().unwrap();
    let h = dir.path().join("h.jsonl");
    let input = "hi\n/stats\n/help\n/reset\n/system Be brief.\nagain\n/bogus\n/quit\nnever read\n";
    let (code, _out, err) = chat(&["--history", h.to_str().unwrap(), "--no-think"], input);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("last turn: "), "{err}");
    assert!(err.contains("unknown command /bogus; commands: /reset"), "{err}");
    // /help lists every command with what it does; the short list names /help.
    for cmd in ["/reset", "/system TEXT", "/save FILE", "/load FILE", "/stats", "/help", "/quit, /exit"] {
        assert!(err.contains(&format!("\n  {cmd} ")), "/help lacks {cmd}: {err}");
    }
    assert!(err.contains("/stats, /help, /quit"), "{err}");
    let msgs = history(&h);
    let roles: Vec<&str> = msgs.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["system", "user", "assistant"], "{msgs:?}");
    assert_eq!(msgs[0]["content"], "Be brief.");
    assert_eq!(msgs[1]["content"], "again");
    assert!(msgs[2].get("reasoning_content").is_none(), "thinking off stores no reasoning");
    let leftovers: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(leftovers.len(), 1, "no temp files left: {leftovers:?}");
}

/// `--tools` with a forced call: the reply's call is shown and kept in the history with
/// arguments valid for the tool; `/result` answers it and the model replies after it (calling
/// again: the choice holds for every reply).
/// `--response-format` makes the reply JSON; bad tool flags are exit 2 naming the flag.
#[test]
fn chat_tools_results_and_response_format() {
    let dir = tempfile::tempdir().unwrap();
    let (h, tools, schema) = (dir.path().join("h.jsonl"), dir.path().join("tools.json"), dir.path().join("s.json"));
    let params = serde_json::json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["n"], "additionalProperties": false});
    let list = serde_json::json!([{"type": "function", "function": {"name": "count", "parameters": params}}]);
    std::fs::write(&tools, list.to_string()).unwrap();
    std::fs::write(&schema, params.to_string()).unwrap();
    let (h_arg, tools_arg) = (h.to_str().unwrap(), tools.to_str().unwrap());
    let common = ["--no-think", "--max-tokens", "200", "--temperature", "0.8", "--history", h_arg];
    let (code, _out, err) = chat(
        &[&common[..], &["--tools", tools_arg, "--tool-choice", "count"]].concat(),
        "/result 1\nCount.\n/result 3\n",
    );
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("tool call 1: count {\"n\":"), "{err}");
    assert!(err.contains("no tool call waits for a result"), "a /result before any call: {err}");
    let msgs = history(&h);
    let roles: Vec<&str> = msgs.iter().map(|m| m["role"].as_str().unwrap()).collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant"], "{msgs:?}");
    let call = &msgs[1]["tool_calls"][0];
    assert_eq!((call["name"].as_str(), msgs[2]["tool_call_id"].as_str()), (Some("count"), call["id"].as_str()));
    let args: serde_json::Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert!((1..=9).contains(&args["n"].as_i64().unwrap()), "{args}");
    let (code, _out, err) =
        chat(&[&common[..], &["--response-format", schema.to_str().unwrap()]].concat(), "A number?\n");
    assert_eq!(code, 0, "{err}");
    let reply: serde_json::Value = serde_json::from_str(history(&h)[1]["content"].as_str().unwrap()).unwrap();
    assert!((1..=9).contains(&reply["n"].as_i64().unwrap()), "{reply}");
    for (flags, says) in [
        (vec!["--tool-choice", "required"], "--tool-choice: tool_choice \"required\" needs tools"),
        (vec!["--tools", tools_arg, "--tool-choice", "nope"], "--tool-choice: tool_choice names \"nope\""),
        (vec!["--response-format", "/nonexistent.json"], "--response-format /nonexistent.json: cannot be read"),
        (vec!["--tools", schema.to_str().unwrap()], "give a JSON list of tools"),
    ] {
        let (code, _out, err) = chat(&flags, "hi\n");
        assert_eq!(code, 2, "{flags:?}: {err}");
        assert!(err.contains(says), "{flags:?}: {err}");
    }
}

#[test]
fn chat_context_without_room_is_refused_and_a_lowered_one_is_said() {
    // --context 0 was accepted: every turn refused, exit 0.
    for context in ["0", "8"] {
        let (code, _, err) = chat(&["--context", context], "hi\n");
        assert_eq!(code, 2, "{err}");
        assert!(err.contains(&format!("--context {context} leaves no room")), "{err}");
    }
    // Above the model's 4096 positions it was lowered without a word.
    let (code, _, err) = chat(&["--context", "100000", "--no-think"], "hi\n");
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("--context 100000: this model holds 4096 positions"), "{err}");
}

#[test]
fn chat_save_and_load_continue_like_a_chat_never_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let s = dir.path().join("c.state");
    let s = s.to_str().unwrap();
    let flags = ["--temperature", "0.8", "--seed", "11"];
    let (code, whole, err) = chat(&flags, "one\ntwo\nthree\n");
    assert_eq!(code, 0, "{err}");
    let (code, first, err) = chat(&[&flags[..], &["--save-state", s]].concat(), "one\n");
    assert_eq!(code, 0, "{err}");
    let (code, rest, err) = chat(&[&flags[..], &["--load-state", s]].concat(), "two\nthree\n");
    assert_eq!(code, 0, "{err}");
    assert_eq!(format!("{first}{rest}"), whole);
    // /save and /load inside one chat: loading the state saved after turn one and asking turn two
    // again gives turn two's reply again.
    let input = format!("one\n/save {s}\ntwo\n/load {s}\ntwo\n");
    let (code, out, err) = chat(&flags, &input);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with(&first), "turn one as before");
    assert!(err.contains("state saved to") && err.contains("state loaded from"), "{err}");
}

/// Writes a valid state of the tiny model to `path`.
fn saved_state(path: &Path) {
    let (code, _, err) = chat(&["--save-state", path.to_str().unwrap()], "hello\n");
    assert_eq!(code, 0, "{err}");
}

#[test]
fn state_file_refusals_name_the_reason_with_exit_3() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.state");
    saved_state(&good);
    let bytes = std::fs::read(&good).unwrap();
    let write = |name: &str, b: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, b).unwrap();
        p
    };
    let mut version = bytes.clone();
    version[8] = 9;
    let mut flipped = bytes.clone();
    let mid = bytes.len() / 2;
    flipped[mid] ^= 0x40;
    let cases = [
        (write("truncated", &bytes[..bytes.len() - 100]), "is truncated"),
        (write("version", &version), "format version 9; this k3ring reads version 1"),
        (write("flipped", &flipped), "is corrupt: the checksum does not match"),
        (write("text", b"not a state at all"), "is not a k3ring state file"),
    ];
    for (path, want) in &cases {
        let (code, _, err) = chat(&["--load-state", path.to_str().unwrap()], "");
        assert_eq!(code, 3, "{want}: {err}");
        assert!(err.contains(want), "{want}: {err}");
    }
    // Another model: the tiny model with one config value changed.
    let other = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(tiny_dir()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), other.path().join(e.file_name())).unwrap();
    }
    let cfg = other.path().join("config.json");
    let text = std::fs::read_to_string(&cfg).unwrap().replacen("\"pad_token_id\": 767", "\"pad_token_id\": 766", 1);
    std::fs::write(&cfg, text).unwrap();
    let (code, _, err) = crate::checkpoint_tests::k3ring(&[
        "run",
        "--model",
        other.path().to_str().unwrap(),
        "--load-state",
        good.to_str().unwrap(),
        "--gen",
        "2",
    ]);
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("was saved from another model: its config hash"), "{err}");
}

#[test]
fn run_resumes_from_a_saved_state_like_a_run_never_stopped() {
    let dir = tempfile::tempdir().unwrap();
    let s = dir.path().join("r.state");
    let json = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let model = tiny_dir();
    let model = model.to_str().unwrap();
    let base = ["run", "--model", model, "--ignore-eos", "--temperature", "0.7", "--seed", "3"];
    let (code, _, err) = crate::checkpoint_tests::k3ring(
        &[&base[..], &["--prompt", "The tiny model says", "--gen", "0", "--save-state", s.to_str().unwrap()]].concat(),
    );
    assert_eq!(code, 0, "{err}");
    let (a, b) = (json("a.json"), json("b.json"));
    let (code, _, err) = crate::checkpoint_tests::k3ring(
        &[&base[..], &["--load-state", s.to_str().unwrap(), "--gen", "9", "--json", &a]].concat(),
    );
    assert_eq!(code, 0, "{err}");
    let (code, _, err) = crate::checkpoint_tests::k3ring(
        &[&base[..], &["--prompt", "The tiny model says", "--gen", "9", "--json", &b]].concat(),
    );
    assert_eq!(code, 0, "{err}");
    let read = |p: &str| serde_json::from_str::<serde_json::Value>(&std::fs::read_to_string(p).unwrap()).unwrap();
    assert_eq!(read(&a)["generated_ids"], read(&b)["generated_ids"]);
    assert_eq!(read(&a)["generated_ids"].as_array().unwrap().len(), 9);
}
