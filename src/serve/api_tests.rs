//! The request checks of `api.rs`: fields, refusals and their `param`, chat thinking and order.
#![allow(clippy::unwrap_used, clippy::panic)]

use super::*;

fn limits() -> Limits {
    Limits { model: "m".into(), max_tokens: 100 }
}

#[test]
fn completion_prompts_and_fields() {
    let j =
        completion_job(br#"{"model":"m","prompt":"hi","max_tokens":5,"temperature":0,"seed":3}"#, &limits()).unwrap();
    assert_eq!(j.prompt, Prompt::Text("hi".into()));
    assert_eq!((j.max_tokens, j.temperature, j.seed), (Some(5), 0.0, Some(3)));
    let big = completion_job(br#"{"prompt":"hi","seed":18446744073709551615}"#, &limits()).map(|j| j.seed);
    assert_eq!(big.ok(), Some(Some(u64::MAX)), "every seed run takes");
    for bad in [&br#"{"prompt":"hi","seed":-1}"#[..], br#"{"prompt":"hi","seed":1.5}"#] {
        let e = completion_job(bad, &limits()).err().map(|e| e.param);
        assert_eq!(e, Some(Some("seed")), "{}", String::from_utf8_lossy(bad));
    }
    let j = completion_job(br#"{"prompt":[1,2,3]}"#, &limits()).unwrap();
    assert_eq!(j.prompt, Prompt::Ids(vec![1, 2, 3]));
    let j = completion_job(br#"{"prompt":[[4,5]], "stop": "x"}"#, &limits()).unwrap();
    assert_eq!((j.prompt, j.stop), (Prompt::Ids(vec![4, 5]), vec!["x".to_owned()]));
}

#[test]
fn refusals_have_status_and_param() {
    let err = |b: &str| completion_job(b.as_bytes(), &limits()).unwrap_err();
    assert_eq!(err("{").status, 400);
    assert_eq!(err("[]").status, 400);
    assert_eq!(err("").status, 400);
    assert_eq!(err(r#"{"prompt":"a","n":2}"#).param, Some("n"));
    assert_eq!(err(r#"{"prompt":"a","model":"other"}"#).status, 404);
    assert_eq!(err(r#"{"prompt":"a","max_tokens":101}"#).param, Some("max_tokens"));
    assert_eq!(err(r#"{"prompt":"a","temperature":-1}"#).param, Some("temperature"));
    assert_eq!(err(r#"{"prompt":"a","top_p":0}"#).param, Some("top_p"));
    assert_eq!(err(r#"{"prompt":["a","b"]}"#).param, Some("prompt"));
    assert_eq!(err(r#"{"prompt":[-1]}"#).param, Some("prompt"));
    assert_eq!(err(r#"{"prompt":"a","stop":[""]}"#).param, Some("stop"));
    assert_eq!(err(r#"{"prompt":"a","logprobs":6}"#).param, Some("logprobs"));
    assert_eq!(completion_job(br#"{"prompt":"a","logprobs":2}"#, &limits()).unwrap().logprobs, Some(2));
    assert_eq!(err(r#"{"prompt":"a","max_tokens":"x"}"#).status, 400);
    // Type errors name their field.
    for (body, field) in [
        (r#"{"prompt":"a","max_tokens":"x"}"#, "max_tokens"),
        (r#"{"prompt":"a","temperature":"hot"}"#, "temperature"),
        (r#"{"prompt":"a","top_k":-1}"#, "top_k"),
        (r#"{"prompt":"a","stream":"yes"}"#, "stream"),
        (r#"{"prompt":"a","stop":5}"#, "stop"),
    ] {
        let e = err(body);
        assert_eq!((e.status, e.param), (400, Some(field)), "{body}: {}", e.message);
        assert!(e.message.contains(&format!("`{field}`")), "{}", e.message);
    }
    let e = chat_job(br#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":"x"}"#, &limits()).unwrap_err();
    assert_eq!(e.param, Some("max_tokens"));
    // Two bad fields: the one named is the one the message is about.
    let e = chat_job(br#"{"messages":5,"max_tokens":"x"}"#, &limits()).unwrap_err();
    let about_max_tokens = e.message.contains("expected u64");
    let about_messages = e.message.contains("expected a sequence");
    assert!(about_max_tokens != about_messages, "{}", e.message);
    assert_eq!(e.param, Some(if about_max_tokens { "max_tokens" } else { "messages" }), "{}", e.message);
    assert_eq!(err(r#"{"prompt":"a","max_completion_tokens":101}"#).param, Some("max_completion_tokens"));
    assert!(err(r#"{"prompt":"a","max_completion_tokens":101}"#).message.starts_with("max_completion_tokens 101"));
    assert_eq!(err(r#"{"prompt":"a","presence_penalty":1}"#).param, Some("presence_penalty"));
    assert_eq!(err(r#"{"prompt":"a","frequency_penalty":-1}"#).param, Some("frequency_penalty"));
}

#[test]
fn every_neutral_value_is_json() {
    // The check parses them per request and treats one that does not parse as null, which
    // would refuse the value it names.
    for (name, neutrals) in OUTPUT_CHANGING_EXTENSIONS {
        for n in neutrals {
            assert!(serde_json::from_str::<Value>(n).is_ok_and(|v| !v.is_null()), "{name}: {n}");
        }
    }
}

#[test]
fn output_changing_extensions_are_refused_unless_neutral() {
    let err = |b: &str| completion_job(b.as_bytes(), &limits()).unwrap_err();
    for (field, value) in [
        ("stop_token_ids", "[364]"),
        ("min_tokens", "30"),
        ("repetition_penalty", "1.2"),
        ("min_p", "0.1"),
        ("include_stop_str_in_output", "true"),
        ("tool_choice", "\"sometimes\""),
        ("prompt_logprobs", "0"),
        ("allowed_token_ids", "[]"),
        ("guided_json", "{}"),
    ] {
        let e = err(&format!(r#"{{"prompt":"a","{field}":{value}}}"#));
        assert_eq!((e.status, e.param), (400, Some(field)), "{field}: {}", e.message);
        assert!(e.message.contains(field), "{}", e.message);
    }
    for neutral in [
        r#""stop_token_ids":[]"#,
        r#""min_tokens":0"#,
        r#""repetition_penalty":1.0"#,
        r#""repetition_penalty":1"#,
        r#""skip_special_tokens":true"#,
        r#""tool_choice":"none""#,
        r#""tool_choice":"auto""#,
        r#""guided_json":null"#,
        r#""min_p":null"#,
    ] {
        completion_job(format!(r#"{{"prompt":"a",{neutral}}}"#).as_bytes(), &limits()).unwrap();
    }
    // The chat endpoint shares the check.
    let e = chat_job(br#"{"messages":[{"role":"user","content":"hi"}],"min_tokens":5}"#, &limits()).unwrap_err();
    assert_eq!(e.param, Some("min_tokens"));
}

#[test]
fn chat_thinking_and_order() {
    let j = chat_job(br#"{"messages":[{"role":"user","content":"hi"}],"thinking":false}"#, &limits()).unwrap();
    let Prompt::Chat { messages, thinking, .. } = j.prompt else { panic!("not chat") };
    assert!(!thinking.enabled);
    assert_eq!(messages.len(), 1);
    let j = chat_job(
        br#"{"messages":[{"role":"system","content":[{"type":"text","text":"s"}]},{"role":"user","content":"hi"}],"reasoning_effort":"low"}"#,
        &limits(),
    )
    .unwrap();
    let Prompt::Chat { messages, thinking, .. } = j.prompt else { panic!("not chat") };
    assert_eq!((thinking.enabled, thinking.effort), (true, Effort::Low));
    assert_eq!(messages[0].content, "s");
    let err = |b: &str| chat_job(b.as_bytes(), &limits()).unwrap_err();
    assert_eq!(err(r#"{"messages":[{"role":"assistant","content":"x"}]}"#).param, Some("messages"));
    assert_eq!(
        err(r#"{"messages":[{"role":"user","content":"x"}],"reasoning_effort":"medium"}"#).param,
        Some("reasoning_effort")
    );
    assert_eq!(err(r#"{"messages":[{"role":"tool","content":"x"}]}"#).param, Some("messages"));
    assert_eq!(err(r#"{"messages":[]}"#).param, Some("messages"));
}
