//! Log-probabilities in the OpenAI shapes: the request fields (`logprobs` and `top_logprobs` in
//! chat completions, `logprobs` 0-5 in completions) and the response objects, streamed and not.
//! The numbers are the engine's ([`crate::engine::logprobs`]): a log-softmax over the whole
//! vocabulary of the logits the sampler saw, the same whatever else is in the batch.
#![forbid(unsafe_code)]

use serde_json::{json, Map, Value};

use super::error::ApiError;
use crate::engine::logprobs::{TokenLogprob, MAX_TOP_LOGPROBS};
use crate::tokenizer::Tokenizer;

/// Alternatives per token at most in completions (OpenAI's limit for the legacy endpoint).
pub const MAX_COMPLETION_LOGPROBS: u64 = 5;

/// What JSON cannot carry (`-inf`, for a token the model rules out) is sent as this, as vLLM does.
const FLOOR: f64 = -9999.0;

/// Chat: `logprobs` (a boolean) and `top_logprobs` (0-20, only with `logprobs: true`). The
/// alternatives asked for, or None when off.
pub fn chat_ask(logprobs: Option<&Value>, top: Option<&Value>) -> Result<Option<usize>, ApiError> {
    let on = match logprobs {
        None | Some(Value::Null | Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(v) => return Err(ApiError::param("logprobs", format!("logprobs must be true or false, not {v}"))),
    };
    let top = match top {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().filter(|&n| n <= MAX_TOP_LOGPROBS as u64).ok_or_else(|| {
            ApiError::param(
                "top_logprobs",
                format!("top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, not {v}"),
            )
        })?),
    };
    match (on, top) {
        (false, Some(_)) => Err(ApiError::param("top_logprobs", "top_logprobs needs \"logprobs\": true")),
        (false, None) => Ok(None),
        (true, top) => Ok(Some(top.unwrap_or(0) as usize)),
    }
}

/// Completions: `logprobs` is the number of alternatives (0-5); `top_logprobs` is chat's field.
pub fn completion_ask(logprobs: Option<&Value>, top: Option<&Value>) -> Result<Option<usize>, ApiError> {
    if top.is_some_and(|v| !v.is_null()) {
        return Err(ApiError::param(
            "top_logprobs",
            "top_logprobs is a chat completions field; completions take \"logprobs\": N (0-5)",
        ));
    }
    match logprobs {
        None | Some(Value::Null) => Ok(None),
        Some(v) => match v.as_u64().filter(|&n| n <= MAX_COMPLETION_LOGPROBS) {
            Some(n) => Ok(Some(n as usize)),
            None => Err(ApiError::param(
                "logprobs",
                format!("logprobs must be an integer from 0 to {MAX_COMPLETION_LOGPROBS}, not {v}"),
            )),
        },
    }
}

/// A token as a client sees it: its text (lossy where a token is part of a UTF-8 character)
/// and its bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct Piece {
    pub text: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
}

impl Piece {
    pub fn new(tok: &Tokenizer, id: u32, logprob: f32) -> Piece {
        let bytes = tok.token_bytes(id).map(<[u8]>::to_vec).unwrap_or_default();
        Piece { text: String::from_utf8_lossy(&bytes).into_owned(), bytes, logprob }
    }

    fn logprob(&self) -> f64 {
        let lp = f64::from(self.logprob);
        if lp.is_finite() {
            lp
        } else {
            FLOOR
        }
    }
}

/// A generated token's entry: the token and its alternatives (made on the model thread, which
/// owns the tokenizer).
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub token: Piece,
    pub top: Vec<Piece>,
}

impl Entry {
    pub fn new(tok: &Tokenizer, lp: &TokenLogprob) -> Entry {
        Entry {
            token: Piece::new(tok, lp.id, lp.logprob),
            top: lp.top.iter().map(|t| Piece::new(tok, t.id, t.logprob)).collect(),
        }
    }
}

/// What `echo` puts before a completion: the prompt's text and tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct Echo {
    pub text: String,
    pub tokens: Vec<Piece>,
}

impl Echo {
    /// `text` when the prompt was given as text, else the ids decoded (special tokens shown
    /// unless `skip_special`).
    pub fn new(tok: &Tokenizer, ids: &[u32], text: Option<&str>, skip_special: bool) -> Echo {
        Echo {
            text: text.map_or_else(|| tok.decode_or_mark(ids, !skip_special), str::to_owned),
            tokens: ids.iter().map(|&id| Piece::new(tok, id, 0.0)).collect(),
        }
    }
}

/// Chat's `logprobs` object: `{"content": [{token, logprob, bytes, top_logprobs}]}`.
pub fn chat_object(entries: &[Entry]) -> Value {
    let piece = |p: &Piece| json!({"token": p.text, "logprob": p.logprob(), "bytes": p.bytes});
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut v = piece(&e.token);
            v["top_logprobs"] = e.top.iter().map(piece).collect();
            v
        })
        .collect();
    json!({"content": content})
}

/// Completions' `logprobs` object: parallel lists of the tokens, their log-probabilities (null
/// for a prompt's first token, which nothing predicts), the alternatives by text, and each
/// token's character offset in the text, counted from `offset`. Returns the offset after.
pub fn completion_object(entries: &[Option<Entry>], tokens: &[Piece], mut offset: usize) -> (Value, usize) {
    let (mut texts, mut lps, mut tops, mut offsets) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (e, token) in entries.iter().zip(tokens) {
        texts.push(Value::from(token.text.clone()));
        offsets.push(Value::from(offset));
        offset += token.text.chars().count();
        match e {
            Some(e) => {
                lps.push(Value::from(e.token.logprob()));
                let top: Map<String, Value> =
                    e.top.iter().map(|p| (p.text.clone(), Value::from(p.logprob()))).collect();
                tops.push(Value::Object(top));
            }
            None => {
                lps.push(Value::Null);
                tops.push(Value::Null);
            }
        }
    }
    (json!({"tokens": texts, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}), offset)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn asks_are_checked_as_openai_does() {
        let v = |s: &str| serde_json::from_str::<Value>(s).unwrap();
        assert_eq!(chat_ask(None, None).unwrap(), None);
        assert_eq!(chat_ask(Some(&v("false")), None).unwrap(), None);
        assert_eq!(chat_ask(Some(&v("true")), None).unwrap(), Some(0));
        assert_eq!(chat_ask(Some(&v("true")), Some(&v("20"))).unwrap(), Some(20));
        assert_eq!(chat_ask(Some(&v("true")), Some(&v("21"))).unwrap_err().param, Some("top_logprobs"));
        assert_eq!(chat_ask(Some(&v("false")), Some(&v("2"))).unwrap_err().param, Some("top_logprobs"));
        assert_eq!(chat_ask(Some(&v("3")), None).unwrap_err().param, Some("logprobs"));
        assert_eq!(completion_ask(Some(&v("0")), None).unwrap(), Some(0));
        assert_eq!(completion_ask(Some(&v("5")), None).unwrap(), Some(5));
        assert_eq!(completion_ask(Some(&v("null")), None).unwrap(), None);
        for bad in ["6", "-1", "true", "1.5"] {
            assert_eq!(completion_ask(Some(&v(bad)), None).unwrap_err().param, Some("logprobs"), "{bad}");
        }
        assert_eq!(completion_ask(None, Some(&v("2"))).unwrap_err().param, Some("top_logprobs"));
    }

    #[test]
    fn shapes_are_openai_s() {
        let p = |t: &str, lp: f32| Piece { text: t.into(), bytes: t.as_bytes().to_vec(), logprob: lp };
        let e = Entry { token: p("hé", -0.5), top: vec![p("hé", -0.5), p("x", f32::NEG_INFINITY)] };
        let chat = chat_object(std::slice::from_ref(&e));
        assert_eq!(chat["content"][0]["token"], "hé");
        assert_eq!(chat["content"][0]["bytes"], json!([104, 195, 169]));
        assert_eq!(chat["content"][0]["top_logprobs"][1]["logprob"], -9999.0);
        let (c, end) = completion_object(&[None, Some(e)], &[p("ab", 0.0), p("hé", -0.5)], 3);
        assert_eq!(c["tokens"], json!(["ab", "hé"]));
        assert_eq!(c["token_logprobs"], json!([null, -0.5]));
        assert_eq!(c["top_logprobs"][0], Value::Null);
        assert_eq!(c["top_logprobs"][1]["x"], -9999.0);
        assert_eq!(c["text_offset"], json!([3, 5]));
        assert_eq!(end, 7);
    }
}
