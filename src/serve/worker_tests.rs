//! The worker's sink, fed ids as the batcher would: tool calls become deltas, markup that is
//! no call becomes content (never an error), and the finish reason says `tool_calls`.
#![allow(clippy::unwrap_used, clippy::panic)]

use super::*;
use crate::chat::template::{generation_prompt, message, Message, Thinking, ToolCall};
use crate::engine::DraftStats;

fn tiny() -> Tokenizer {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-k3");
    Tokenizer::from_model_dir(&dir).unwrap()
}

fn sequence<'t>(tok: &'t Tokenizer, sp: Specials, events: UnboundedSender<Event>) -> Sequence<'t> {
    Sequence {
        events,
        prompt_tokens: 1,
        stop: Vec::new(),
        end_ids: sp.end_ids().to_vec(),
        skip_special: true,
        parser: Some(CompletionParser::new(tok, sp, false)),
        reasoning: Text::default(),
        content: Text::default(),
        ids: Vec::new(),
        logprobs: Vec::new(),
        prompt_logprobs: Vec::new(),
        cut: None,
        generated: 0,
        calls: Vec::new(),
        calls_read: 0,
        stray_shown: 0,
        ticket: 7,
        constraint: None,
    }
}

/// Feeds `ids` to a sequence through the sink; returns the content, calls and finish reason
/// sent.
fn feed(tok: &Tokenizer, sp: Specials, ids: &[u32]) -> (String, Vec<serde_json::Value>, &'static str) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut out = Outputs {
        tok,
        seqs: HashMap::new(),
        shared: Arc::new(Shared::default()),
        drafting: false,
        prefix_cache: false,
    };
    out.seqs.insert(7, sequence(tok, sp, tx));
    let mut reason = FinishReason::Length;
    for &id in ids {
        if out.token(7, id) || sp.end_ids().contains(&id) {
            reason = FinishReason::Stop;
            break;
        }
    }
    out.finished(Finished {
        ticket: 7,
        reason,
        prompt_tokens: 1,
        generated: ids.len(),
        seconds: 0.0,
        draft: DraftStats::default(),
        cached_tokens: 0,
    });
    let (mut content, mut calls, mut finish) = (String::new(), Vec::new(), "");
    while let Ok(e) = rx.try_recv() {
        match e {
            Event::Delta { content: c, tool_calls, .. } => {
                content.push_str(&c);
                calls.extend(tool_calls);
            }
            Event::Done { finish_reason, .. } => finish = finish_reason,
            _ => {}
        }
    }
    (content, calls, finish)
}

fn reply_ids(tok: &Tokenizer, sp: Specials, m: &Message) -> Vec<u32> {
    let th = Thinking { enabled: false, ..Thinking::default() };
    let whole = to_ids(&message(m, th), tok, &sp).unwrap();
    let prompt = to_ids(&generation_prompt(th), tok, &sp).unwrap();
    whole[prompt.len()..].to_vec()
}

#[test]
fn calls_are_sent_as_deltas_with_finish_reason_tool_calls() {
    let tok = tiny();
    let sp = Specials::of(&tok).unwrap();
    let calls = vec![
        ToolCall { id: None, name: "f".into(), arguments: r#"{"a": 1}"#.into() },
        ToolCall { id: None, name: "g".into(), arguments: "{}".into() },
    ];
    let m = Message { tool_calls: calls, ..Message::assistant(None, "ok") };
    let (content, calls, finish) = feed(&tok, sp, &reply_ids(&tok, sp, &m));
    assert_eq!((content.as_str(), finish), ("ok", "tool_calls"));
    let got: Vec<(u64, &str, &str, &str)> = calls
        .iter()
        .map(|c| {
            let f = &c["function"];
            (
                c["index"].as_u64().unwrap(),
                c["id"].as_str().unwrap(),
                f["name"].as_str().unwrap(),
                f["arguments"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(got, [(0, "call_7_0", "f", r#"{"a":1}"#), (1, "call_7_1", "g", "{}")]);
}

#[test]
fn markup_that_is_no_call_is_content_and_a_cut_call_too() {
    let tok = tiny();
    let sp = Specials::of(&tok).unwrap();
    let enc = |t: &str| tok.encode(t).unwrap();
    // <|close|>response<|sep|><|open|>tools<|sep|><|open|>call index="1"<|sep|><|close|>call<|sep|>
    // <|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>: a call without a tool.
    let mut ids = vec![sp.close];
    ids.extend(enc("response"));
    ids.extend([sp.sep, sp.open]);
    ids.extend(enc("tools"));
    ids.extend([sp.sep, sp.open]);
    ids.extend(enc("call index=\"1\""));
    let inside = ids.len();
    ids.extend([sp.sep, sp.close]);
    ids.extend(enc("call"));
    ids.extend([sp.sep, sp.close]);
    ids.extend(enc("tools"));
    ids.extend([sp.sep, sp.close]);
    ids.extend(enc("message"));
    ids.extend([sp.sep, sp.end_of_msg]);
    let (content, calls, finish) = feed(&tok, sp, &ids);
    assert!(calls.is_empty());
    assert_eq!(content, "<|open|>call index=\"1\"<|sep|><|close|>call<|sep|>");
    assert_eq!(finish, "stop");
    // Cut by the token limit inside a call: what it wrote is content.
    let (content, calls, finish) = feed(&tok, sp, &ids[..inside]);
    assert!(calls.is_empty(), "{calls:?}");
    assert_eq!((content.as_str(), finish), ("<|open|>call index=\"1\"", "length"));
}
