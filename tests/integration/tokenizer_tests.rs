//! Tokenizer parity with the Python tiktoken package on the oracle's corpus (issue 3).

use k3ring::tokenizer::Tokenizer;

use crate::common::*;

#[test]
fn encodes_every_corpus_case_like_python_tiktoken_and_round_trips() {
    let dir = tiny_dir();
    let tok = Tokenizer::from_model_dir(&dir).unwrap();
    let cases: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("tokenizer_cases.json")).unwrap()).unwrap();
    assert_eq!(cases["pattern"], k3ring::tokenizer::K3_PATTERN, "the oracle used another regex");
    let cases = cases["cases"].as_array().unwrap();
    assert!(cases.len() >= 40);
    let mut special = 0;
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        let got = if c["allow_special"] == true {
            special += 1;
            tok.encode_with_added(text).unwrap()
        } else {
            tok.encode(text).unwrap()
        };
        assert_eq!(got, want, "encoding {text:?}");
        assert_eq!(tok.decode(&got).unwrap(), text, "round trip of {text:?}");
    }
    assert!(special >= 1);
}

#[test]
fn added_tokens_are_text_unless_allowed() {
    let tok = Tokenizer::from_model_dir(&tiny_dir()).unwrap();
    let open = tok.added_id("<|open|>").unwrap();
    assert_eq!(tok.encode_with_added("<|open|>").unwrap(), vec![open]);
    assert!(!tok.encode("<|open|>").unwrap().contains(&open));
    assert_eq!(tok.decode(&tok.encode("<|open|>").unwrap()).unwrap(), "<|open|>");
}

#[test]
fn unknown_ids_are_errors_not_panics() {
    let tok = Tokenizer::from_model_dir(&tiny_dir()).unwrap();
    assert!(tok.decode(&[1_000_000]).is_err());
}

#[test]
fn stream_decoder_holds_back_split_characters() {
    let tok = Tokenizer::from_model_dir(&tiny_dir()).unwrap();
    let ids = tok.encode("日本語 ok").unwrap();
    let mut s = k3ring::tokenizer::StreamDecoder::default();
    let mut text = String::new();
    for id in ids {
        let piece = s.push(&tok, id).unwrap();
        assert!(!piece.contains('\u{FFFD}'), "emitted a broken character");
        text.push_str(&piece);
    }
    text.push_str(&s.finish());
    assert_eq!(text, "日本語 ok");
}
