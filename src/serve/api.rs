//! The OpenAI JSON shapes: requests as clients send them, checked into a [`Job`] (no tokenizer
//! needed: the worker tokenizes), and the usage of responses; errors are [`ApiError`]
//! (`super::error`).
#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::chat::template::{Effort, Message, Role, Thinking};
use crate::chat::tools::ToolOptions;

use super::error::ApiError;

/// What a prompt is before tokenizing.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    /// Text (added tokens such as `<|open|>` are recognised, as in `k3ring run --prompt`).
    Text(String),
    Ids(Vec<u32>),
    /// A conversation, rendered with the XTML template.
    Chat {
        messages: Vec<Message>,
        thinking: Thinking,
        /// Tools, tool choice and response format.
        tools: ToolOptions,
    },
}

/// A checked request, ready for the worker.
#[derive(Clone, Debug, PartialEq)]
pub struct Job {
    pub prompt: Prompt,
    /// As asked; `None` means "up to the cap, as room allows".
    pub max_tokens: Option<usize>,
    pub temperature: f32,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stream: bool,
    /// A separate last chunk with the usage (`stream_options.include_usage`).
    pub include_usage: bool,
    /// Keep generating past end-of-sequence ids (as `k3ring run --ignore-eos`; vLLM's field).
    pub ignore_eos: bool,
    /// Put the prompt's ids in the (non-streamed) response as `prompt_token_ids`.
    pub return_token_ids: bool,
    /// Leave special (added) tokens' text out of the reply (vLLM's field); their ids stay in
    /// `token_ids` and the usage.
    pub skip_special_tokens: bool,
    /// Each generated token's log-probability with this many alternatives
    /// ([`super::logprobs`]).
    pub logprobs: Option<usize>,
    /// Completions: the reply's text starts with the prompt's, and with `logprobs` the prompt
    /// tokens' log-probabilities come first.
    pub echo: bool,
}

/// `stop`: one string or a list.
#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The fields both endpoints share. Unknown fields are ignored (clients send `user`,
/// `metadata` and the like); fields that would change the output and are not supported are
/// refused, never ignored.
#[derive(Deserialize)]
struct Common {
    model: Option<String>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<u64>,
    /// Any JSON number: read by hand so that a seed `k3ring run --seed` takes (0 to 2^64-1) is
    /// taken, and others get an error naming `seed`.
    seed: Option<serde_json::Number>,
    stop: Option<Stop>,
    n: Option<i64>,
    #[serde(default)]
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    logit_bias: Option<serde_json::Map<String, Value>>,
    logprobs: Option<Value>,
    top_logprobs: Option<Value>,
    best_of: Option<i64>,
    echo: Option<bool>,
    suffix: Option<String>,
    tools: Option<Vec<Value>>,
    functions: Option<Vec<Value>>,
    response_format: Option<Value>,
    tool_choice: Option<Value>,
    #[serde(default)]
    ignore_eos: bool,
    #[serde(default)]
    return_token_ids: bool,
    /// vLLM's: leave the text of special (added) tokens out of the reply (by default, as
    /// vLLM and `k3ring run` do; `false` shows them).
    #[serde(default = "skip_special_by_default")]
    skip_special_tokens: bool,
}

fn skip_special_by_default() -> bool {
    true
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: Option<Value>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Option<Vec<ChatMessage>>,
    /// k3ring: thinking on (default) or off.
    thinking: Option<Value>,
    /// `low`, `high` or `max` (`medium` is refused, as the K3 encoder does); `none` turns
    /// thinking off.
    reasoning_effort: Option<String>,
    chat_template_kwargs: Option<ChatTemplateKwargs>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Deserialize)]
struct ChatTemplateKwargs {
    thinking: Option<bool>,
}

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    content: Option<Value>,
    reasoning_content: Option<String>,
    /// Taken for `reasoning_content` when that is absent or empty (as the release does).
    reasoning: Option<String>,
    name: Option<String>,
    tool_calls: Option<Value>,
    tool_call_id: Option<String>,
    /// A tool result's call when `tool_call_id` is absent (as the release reads it).
    id: Option<String>,
}

/// Limits the server applies while checking.
#[derive(Clone, Debug)]
pub struct Limits {
    /// The name of the one model served.
    pub model: String,
    /// `max_tokens` at most.
    pub max_tokens: usize,
}

fn parse_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid("the request body is empty; send a JSON object"));
    }
    let value: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("the body is not valid JSON: {e}")))?;
    let Some(fields) = value.as_object() else {
        return Err(ApiError::invalid("the body must be a JSON object"));
    };
    refuse_output_changing_extensions(fields)?;
    serde_json::from_value(value.clone()).map_err(|e| {
        // serde's message has no path through the flattened fields: find the field whose value
        // alone fails (every field is optional, so a one-field body fails only on a bad value).
        // The culprit's own error is reported: with two bad fields, serde's `e` may be about
        // the other one.
        let culprit = fields.iter().find_map(|(name, v)| {
            let alone = Value::Object(std::iter::once((name.clone(), v.clone())).collect());
            let err = serde_json::from_value::<T>(alone).err()?;
            FIELD_NAMES.iter().find(|n| **n == name).map(|&n| (n, err))
        });
        match culprit {
            Some((name, err)) => ApiError::param(name, format!("bad request field `{name}`: {err}")),
            None => ApiError::invalid(format!("bad request field: {e}")),
        }
    })
}

/// Every field the two bodies read, for naming the one a type error is in.
const FIELD_NAMES: [&str; 31] = [
    "prompt",
    "messages",
    "thinking",
    "reasoning_effort",
    "chat_template_kwargs",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "n",
    "stream",
    "stream_options",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "best_of",
    "echo",
    "suffix",
    "tools",
    "functions",
    "response_format",
    "tool_choice",
    "ignore_eos",
    "return_token_ids",
    "skip_special_tokens",
];

/// Fields other servers (vLLM, llama.cpp) take that would change the output here, each with
/// the values that change nothing (absent and `null` change nothing either): refused with 400
/// at any other value rather than ignored. (`skip_special_tokens` is honoured: [`Common`].)
const OUTPUT_CHANGING_EXTENSIONS: [(&str, &[&str]); 14] = [
    ("stop_token_ids", &["[]"]),
    ("min_tokens", &["0"]),
    ("repetition_penalty", &["1"]),
    ("min_p", &["0"]),
    ("include_stop_str_in_output", &["false"]),
    // vLLM refuses an empty allow-list and returns prompt log-probabilities even for 0.
    ("allowed_token_ids", &[]),
    ("prompt_logprobs", &[]),
    ("bad_words", &["[]"]),
    ("use_beam_search", &["false"]),
    ("guided_json", &[]),
    ("guided_regex", &[]),
    ("guided_choice", &[]),
    ("guided_grammar", &[]),
    ("grammar", &[]),
];

fn refuse_output_changing_extensions(fields: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    for (name, neutrals) in OUTPUT_CHANGING_EXTENSIONS {
        let Some(v) = fields.get(name).filter(|v| !v.is_null()) else { continue };
        let same = |neutral: &&str| {
            let neutral: Value = serde_json::from_str(neutral).unwrap_or(Value::Null);
            // 1 and 1.0 are the same number.
            match (v.as_f64(), neutral.as_f64()) {
                (Some(a), Some(b)) => a == b,
                _ => *v == neutral,
            }
        };
        if !neutrals.iter().any(same) {
            let allowed = if neutrals.is_empty() { String::new() } else { format!("{}, or ", neutrals.join(" or ")) };
            return Err(ApiError::param(
                name,
                format!("{name} = {v} is not supported by this server (only {allowed}leave it out)"),
            ));
        }
    }
    Ok(())
}

/// Checks a `/v1/completions` body.
pub fn completion_job(body: &[u8], limits: &Limits) -> Result<Job, ApiError> {
    let b: CompletionBody = parse_json(body)?;
    let prompt = match b.prompt {
        None => return Err(ApiError::param("prompt", "give \"prompt\": text or an array of token ids")),
        Some(Value::String(s)) => Prompt::Text(s),
        Some(Value::Array(items)) => prompt_array(&items)?,
        Some(_) => return Err(ApiError::param("prompt", "\"prompt\" must be text or an array of token ids")),
    };
    let c = &b.common;
    if c.tools.as_ref().is_some_and(|t| !t.is_empty()) || c.functions.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::param("tools", "tools are taken by /v1/chat/completions, not by completions"));
    }
    if c.tool_choice.as_ref().is_some_and(|t| !t.is_null() && t.as_str() != Some("none") && t.as_str() != Some("auto"))
    {
        return Err(ApiError::param("tool_choice", "tool_choice is taken by /v1/chat/completions, not by completions"));
    }
    if c.response_format.as_ref().is_some_and(|f| !f.is_null() && f.get("type").and_then(Value::as_str) != Some("text"))
    {
        return Err(ApiError::param(
            "response_format",
            "response_format is taken by /v1/chat/completions; completions take only {\"type\": \"text\"}",
        ));
    }
    if b.common.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::param("suffix", "suffix (insertion) is not supported"));
    }
    if b.common.best_of.is_some_and(|n| n != 1) {
        return Err(ApiError::param("best_of", "best_of must be 1: one completion per request"));
    }
    let logprobs = super::logprobs::completion_ask(b.common.logprobs.as_ref(), b.common.top_logprobs.as_ref())?;
    let echo = b.common.echo == Some(true);
    if echo && b.common.stream == Some(true) {
        return Err(ApiError::param("echo", "echo is not streamed: ask without \"stream\" (or with it false)"));
    }
    Ok(Job { logprobs, echo, ..common_job(prompt, b.common, limits)? })
}

/// `prompt` as an array: token ids, or a single text or id list inside it.
fn prompt_array(items: &[Value]) -> Result<Prompt, ApiError> {
    let many = || ApiError::param("prompt", "one prompt per request: send the others as separate requests");
    match items {
        [] => Err(ApiError::param("prompt", "the prompt is empty: give at least one token")),
        [Value::String(s)] => Ok(Prompt::Text(s.clone())),
        [Value::Array(ids)] => Ok(Prompt::Ids(token_ids(ids)?)),
        [Value::String(_) | Value::Array(_), ..] => Err(many()),
        ids => Ok(Prompt::Ids(token_ids(ids)?)),
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| ApiError::param("prompt", format!("{v} is not a token id (an integer >= 0)")))
        })
        .collect()
}

/// Checks a `/v1/chat/completions` body.
pub fn chat_job(body: &[u8], limits: &Limits) -> Result<Job, ApiError> {
    let b: ChatBody = parse_json(body)?;
    let Some(raw) = b.messages else {
        return Err(ApiError::param("messages", "give \"messages\": a list of {role, content}"));
    };
    if raw.is_empty() {
        return Err(ApiError::param("messages", "\"messages\" is empty"));
    }
    if b.common.functions.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::param("functions", "the deprecated `functions` are not supported: send `tools`"));
    }
    let tools = crate::chat::openai::options(
        b.common.tools.clone(),
        b.common.tool_choice.as_ref(),
        b.common.response_format.as_ref(),
    )
    .map_err(|e| ApiError::param(e.param, e.message))?;
    let messages = raw.into_iter().enumerate().map(|(i, m)| chat_message(i, m)).collect::<Result<Vec<_>, _>>()?;
    let mut thinking = Thinking::default();
    match b.thinking {
        None | Some(Value::Null) => {}
        Some(Value::Bool(on)) => thinking.enabled = on,
        Some(Value::Object(o)) => match o.get("type").and_then(Value::as_str) {
            Some("enabled") => thinking.enabled = true,
            Some("disabled") => thinking.enabled = false,
            _ => {
                return Err(ApiError::param(
                    "thinking",
                    "thinking: give true/false or {\"type\": \"enabled\" | \"disabled\"}",
                ))
            }
        },
        Some(_) => return Err(ApiError::param("thinking", "thinking: give true or false")),
    }
    if let Some(on) = b.chat_template_kwargs.and_then(|k| k.thinking) {
        thinking.enabled = on;
    }
    match b.reasoning_effort.as_deref() {
        None => {}
        Some("none") => thinking.enabled = false,
        Some(e) => {
            thinking.effort = Effort::parse(e)
                .map_err(|err| ApiError::param("reasoning_effort", format!("reasoning_effort: {err}")))?;
        }
    }
    crate::chat::template::check_order(&messages).map_err(|e| ApiError::param("messages", e.to_string()))?;
    if messages.last().is_none_or(|m| !matches!(m.role, Role::User | Role::Tool)) {
        return Err(ApiError::param(
            "messages",
            "the last message must be the user's or a tool result: a reply is asked for",
        ));
    }
    let logprobs = super::logprobs::chat_ask(b.common.logprobs.as_ref(), b.common.top_logprobs.as_ref())?;
    Ok(Job { logprobs, ..common_job(Prompt::Chat { messages, thinking, tools }, b.common, limits)? })
}

fn chat_message(index: usize, m: ChatMessage) -> Result<Message, ApiError> {
    let role = Role::from_openai(&m.role).ok_or_else(|| {
        let other = &m.role;
        ApiError::param(
            "messages",
            format!("message {index}: role {other:?} is not supported (system, developer, user, assistant, tool)"),
        )
    })?;
    let mut content_parts = Vec::new();
    let content = match m.content {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s,
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => {
                        text.push_str(t);
                        content_parts.push(t.to_owned());
                    }
                    _ => {
                        return Err(ApiError::param(
                            "messages",
                            format!("message {index}: only text content parts are supported"),
                        ))
                    }
                }
            }
            text
        }
        Some(_) => return Err(ApiError::param("messages", format!("message {index}: content must be text"))),
    };
    let reasoning = m.reasoning_content.filter(|r| !r.is_empty()).or(m.reasoning).filter(|_| role == Role::Assistant);
    let tool_calls = if role == Role::Assistant {
        crate::chat::openai::calls(index, m.tool_calls).map_err(|e| ApiError::param(e.param, e.message))?
    } else {
        Vec::new()
    };
    let tool_call_id = if role == Role::Tool { m.tool_call_id.or(m.id) } else { None };
    // One part is the text itself; several are kept, as the release encodes each on its own.
    let content_parts = if content_parts.len() > 1 { content_parts } else { Vec::new() };
    Ok(Message { role, content, content_parts, reasoning_content: reasoning, name: m.name, tool_calls, tool_call_id })
}

fn common_job(prompt: Prompt, c: Common, limits: &Limits) -> Result<Job, ApiError> {
    if let Some(model) = c.model.as_deref().filter(|m| *m != limits.model) {
        return Err(ApiError {
            param: Some("model"),
            ..ApiError::not_found(
                "model_not_found",
                format!("the model {model:?} does not exist here; this server serves {:?}", limits.model),
            )
        });
    }
    if let Some(n) = c.n.filter(|&n| n != 1) {
        return Err(ApiError::param(
            "n",
            format!("n = {n} is refused: this server returns exactly one choice (n = 1)"),
        ));
    }
    let given = match (c.max_completion_tokens, c.max_tokens) {
        (Some(m), _) => Some(("max_completion_tokens", m)),
        (None, m) => m.map(|m| ("max_tokens", m)),
    };
    let max_tokens = match given {
        None => None,
        Some((name, m)) => {
            let m = usize::try_from(m).unwrap_or(usize::MAX);
            if m > limits.max_tokens {
                return Err(ApiError::param(
                    name,
                    format!("{name} {m} is above this server's cap of {} (--max-tokens)", limits.max_tokens),
                ));
            }
            Some(m)
        }
    };
    let temperature = c.temperature.unwrap_or(1.0);
    if !(temperature.is_finite() && (0.0..=2.0).contains(&temperature)) {
        return Err(ApiError::param("temperature", format!("temperature {temperature} is not in [0, 2]")));
    }
    if let Some(p) = c.top_p.filter(|p| !(p.is_finite() && *p > 0.0 && *p <= 1.0)) {
        return Err(ApiError::param("top_p", format!("top_p {p} is not in (0, 1]")));
    }
    if c.top_k == Some(0) {
        return Err(ApiError::param("top_k", "top_k 0 keeps no token; give 1 or more"));
    }
    for (name, v) in [("presence_penalty", c.presence_penalty), ("frequency_penalty", c.frequency_penalty)] {
        if v.is_some_and(|v| v != 0.0) {
            return Err(ApiError::param(name, format!("{name} is not supported (only 0)")));
        }
    }
    if c.logit_bias.is_some_and(|m| !m.is_empty()) {
        return Err(ApiError::param("logit_bias", "logit_bias is not supported"));
    }
    let stop = match c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::param("stop", "an empty stop string would stop at once"));
    }
    if stop.len() > 16 {
        return Err(ApiError::param("stop", format!("{} stop strings; 16 at most", stop.len())));
    }
    let seed = match c.seed {
        None => None,
        Some(n) => Some(n.as_u64().ok_or_else(|| {
            ApiError::param("seed", format!("seed {n} is not an integer from 0 to 18446744073709551615"))
        })?),
    };
    let stream = c.stream.unwrap_or(false);
    let include_usage = stream && c.stream_options.is_some_and(|o| o.include_usage);
    Ok(Job {
        prompt,
        max_tokens,
        temperature: temperature as f32,
        top_k: c.top_k.map(|k| usize::try_from(k).unwrap_or(usize::MAX)),
        top_p: c.top_p.map(|p| p as f32),
        seed,
        stop,
        stream,
        include_usage,
        ignore_eos: c.ignore_eos,
        return_token_ids: c.return_token_ids,
        skip_special_tokens: c.skip_special_tokens,
        logprobs: None,
        echo: false,
    })
}

/// Token counts of a response.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    /// With drafting: the guesses kept and taken back, in OpenAI's fields for predicted
    /// outputs, and the decode steps (k3ring's own).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub completion_tokens_details: Option<CompletionDetails>,
    /// With the prefix cache: the prompt tokens started from a cached state, not prefilled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptDetails>,
}

/// `usage.prompt_tokens_details`, OpenAI's field for prompt caching.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct PromptDetails {
    pub cached_tokens: usize,
}

/// `usage.completion_tokens_details` of a drafted sequence.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct CompletionDetails {
    pub accepted_prediction_tokens: u64,
    pub rejected_prediction_tokens: u64,
    pub decode_steps: u64,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Usage {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            completion_tokens_details: None,
            prompt_tokens_details: None,
        }
    }
}

#[cfg(test)]
#[path = "api_tests.rs"]
mod tests;
