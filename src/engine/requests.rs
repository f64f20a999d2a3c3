//! Requests as JSON lines (`k3ring batch`, later `serve`): one object per line,
//! `{"id", "prompt" | "ids", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop"}`,
//! checked against the model before anything runs, so a bad line is refused with a message
//! naming what is wrong and never reaches a step shared with other sequences.
#![forbid(unsafe_code)]

use serde::Deserialize;

use super::{context_needed, BatchRequest, EngineError, Sampling};
use crate::config::Config;
use crate::exit::{Classify, ExitCode};
use crate::tokenizer::Tokenizer;

/// One input line as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RequestLine {
    id: Option<serde_json::Value>,
    prompt: Option<String>,
    ids: Option<Vec<u32>>,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_k: Option<usize>,
    top_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<Stop>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

/// What applies to a line that does not say.
#[derive(Clone, Debug)]
pub struct RequestDefaults {
    pub max_tokens: usize,
    /// Positions a request may need at most (`--context`), besides the model's context.
    pub context: Option<usize>,
    /// End-of-sequence ids every request stops on (none with `--ignore-eos`).
    pub stop_ids: Vec<u32>,
}

/// A checked request, ready to submit.
#[derive(Clone, Debug)]
pub struct ParsedRequest {
    /// The line's `id`, if it gave one.
    pub id: Option<serde_json::Value>,
    pub request: BatchRequest,
    /// Stop strings: the text ends where one begins.
    pub stop: Vec<String>,
}

/// Why a line cannot run (its record says this and the batch goes on).
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct RequestError {
    /// The line's `id` when the line is JSON with one.
    pub id: Option<serde_json::Value>,
    pub message: String,
}

impl Classify for RequestError {
    fn exit_code(&self) -> ExitCode {
        ExitCode::Usage
    }
}

/// Parses and checks one line against the model's vocabulary and context.
pub fn parse_request_line(
    line: &str,
    defaults: &RequestDefaults,
    cfg: &Config,
    tok: &Tokenizer,
) -> Result<ParsedRequest, RequestError> {
    let fail = |message: String| {
        let id = serde_json::from_str::<serde_json::Value>(line).ok().and_then(|v| v.get("id").cloned());
        RequestError { id, message }
    };
    let r: RequestLine = serde_json::from_str(line).map_err(|e| fail(format!("not a request: {e}")))?;
    let prompt = match (&r.prompt, &r.ids) {
        (Some(text), None) => tok.encode_with_added(text).map_err(|e| fail(format!("prompt: {e}")))?,
        (None, Some(ids)) => {
            if let Some(&bad) = ids.iter().find(|&&id| id as usize >= cfg.vocab_size) {
                return Err(fail(format!("ids: token {bad} is outside the vocabulary of {}", cfg.vocab_size)));
            }
            ids.clone()
        }
        (Some(_), Some(_)) => return Err(fail("give \"prompt\" or \"ids\", not both".into())),
        (None, None) => return Err(fail("give \"prompt\" (text) or \"ids\" (token ids)".into())),
    };
    if prompt.is_empty() {
        return Err(fail("the prompt is empty: give at least one token".into()));
    }
    let max_tokens = r.max_tokens.unwrap_or(defaults.max_tokens);
    let temperature = r.temperature.unwrap_or(0.0);
    if !temperature.is_finite() || temperature < 0.0 {
        return Err(fail(format!("temperature {temperature} is not a number >= 0")));
    }
    if r.top_k == Some(0) {
        return Err(fail("top_k 0 keeps no token; give 1 or more".into()));
    }
    if let Some(p) = r.top_p.filter(|p| !(p.is_finite() && *p > 0.0 && *p <= 1.0)) {
        return Err(fail(format!("top_p {p} is not in (0, 1]")));
    }
    let needed = context_needed(cfg, prompt.len(), max_tokens).map_err(|e| {
        fail(match e {
            EngineError::ContextTooLong { prompt, gen, total, context, stated_by } => format!(
                "the prompt's {prompt} tokens plus max_tokens {gen} need {total} positions, beyond the model's context of {context} ({stated_by})"
            ),
            EngineError::ContextOverflow { gen, .. } => {
                format!("max_tokens {gen} is too large: the prompt plus it overflow the position count")
            }
            other => format!("max_tokens: {other}"),
        })
    })?;
    if let Some(context) = defaults.context.filter(|&c| needed > c) {
        return Err(fail(format!(
            "the prompt's {} tokens plus max_tokens {max_tokens} need {needed} positions, beyond --context {context}",
            prompt.len()
        )));
    }
    let stop = match r.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.iter().any(String::is_empty) {
        return Err(fail("stop: an empty stop string would stop at once".into()));
    }
    let sampling = Sampling { temperature, top_k: r.top_k, top_p: r.top_p, seed: r.seed.unwrap_or(0) };
    Ok(ParsedRequest {
        id: r.id,
        request: BatchRequest { prompt, max_tokens, sampling, stop_ids: defaults.stop_ids.clone() },
        stop,
    })
}
