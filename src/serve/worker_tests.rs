//! The worker's sink, fed ids as the batcher would: tool calls become deltas, markup that is
//! no call becomes content (never an error), and the finish reason says `tool_calls`.
#![allow(clippy::unwrap_used, clippy::panic)]

use super::*;
use crate::chat::template::{Message, ToolCall};
use crate::chat::test_support::{reply_ids, tiny};
use crate::engine::DraftStats;

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
        call_ids: "ab".into(),
    };
    let parser = Some(CompletionParser::new(tok, sp, false));
    let declared = vec!["f".to_owned(), "g".to_owned()];
    out.seqs.insert(7, Sequence { end_ids: sp.end_ids().to_vec(), declared, ..Sequence::new(tx, 1, parser, 7) });
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

#[test]
fn calls_are_sent_as_deltas_with_finish_reason_tool_calls() {
    let tok = tiny();
    let sp = Specials::of(&tok).unwrap();
    let calls = vec![
        ToolCall { id: None, name: "f".into(), arguments: r#"{"a": 1}"#.into() },
        ToolCall { id: None, name: "g".into(), arguments: "{}".into() },
    ];
    let m = Message { tool_calls: calls, ..Message::assistant(None, "ok") };
    let (content, calls, finish) = feed(&tok, sp, &reply_ids(&tok, sp, &m, false));
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
    assert_eq!(got, [(0, "call_ab7_0", "f", r#"{"a":1}"#), (1, "call_ab7_1", "g", "{}")]);
    // A call to a tool the request did not declare is content; the others keep their order.
    let calls = vec![
        ToolCall { id: None, name: "nope".into(), arguments: "{}".into() },
        ToolCall { id: None, name: "g".into(), arguments: "{}".into() },
    ];
    let m = Message { tool_calls: calls, ..Message::assistant(None, "") };
    let (content, calls, finish) = feed(&tok, sp, &reply_ids(&tok, sp, &m, false));
    assert_eq!(content, "<|open|>call tool=\"nope\"<|sep|><|open|>json type=\"object\"<|sep|>{}<|close|>json<|sep|><|close|>call<|sep|>");
    assert_eq!((calls.len(), calls[0]["id"].as_str(), finish), (1, Some("call_ab7_0"), "tool_calls"));
}

#[test]
fn markup_that_is_no_call_is_content_and_a_cut_call_too() {
    let tok = tiny();
    let sp = Specials::of(&tok).unwrap();
    // A call without a tool, the markup spelled out (its specials read as added tokens).
    let head = "<|close|>response<|sep|><|open|>tools<|sep|><|open|>call index=\"1\"";
    let tail = "<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>";
    let ids = tok.encode_with_added(&format!("{head}{tail}")).unwrap();
    let inside = tok.encode_with_added(head).unwrap().len();
    let (content, calls, finish) = feed(&tok, sp, &ids);
    assert!(calls.is_empty());
    assert_eq!(content, "<|open|>call index=\"1\"<|sep|><|close|>call<|sep|>");
    assert_eq!(finish, "stop");
    // Cut by the token limit inside a call: what it wrote is content.
    let (content, calls, finish) = feed(&tok, sp, &ids[..inside]);
    assert!(calls.is_empty(), "{calls:?}");
    assert_eq!((content.as_str(), finish), ("<|open|>call index=\"1\"", "length"));
}
