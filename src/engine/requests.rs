//! Requests as JSON lines (`k3ring batch`): one object per line,
//! `{"id", "prompt" | "ids" | "messages", "max_tokens", "temperature", "top_k", "top_p", "seed",
//! "stop", "thinking", "reasoning_effort"}` (a `messages` line is rendered by the chat template,
//! docs/MODEL.md section 6, and its reply is read back into reasoning and content),
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
    /// A conversation to reply to, as the chat template renders it.
    messages: Option<Vec<LineMessage>>,
    /// With `messages`: reason before answering (the default) or not.
    thinking: Option<bool>,
    /// With `messages` and thinking: `low`, `high` or `max`.
    reasoning_effort: Option<String>,
    /// With `messages`: tools, tool choice and response format, as OpenAI's chat takes them.
    tools: Option<Vec<serde_json::Value>>,
    tool_choice: Option<serde_json::Value>,
    response_format: Option<serde_json::Value>,
}

/// One message of a `messages` line.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LineMessage {
    role: String,
    #[serde(default)]
    content: Option<String>,
    /// An assistant turn's reasoning, kept in the history when thinking is on.
    reasoning_content: Option<String>,
    name: Option<String>,
    /// An assistant turn's calls, and a tool result's call.
    tool_calls: Option<serde_json::Value>,
    tool_call_id: Option<String>,
}

/// A `messages` request: its reply is read back through the chat template's markup.
#[derive(Clone, Debug)]
pub struct ChatReply {
    pub specials: crate::chat::template::Specials,
    /// The reply starts in the reasoning channel.
    pub thinking: bool,
    /// Tools and response format (a constraint of the reply when they force its shape).
    pub tools: crate::chat::tools::ToolOptions,
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
    /// For a `messages` line: how to read the reply.
    pub chat: Option<ChatReply>,
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
    let mut stop_ids = defaults.stop_ids.clone();
    let mut chat = None;
    let prompt = match (&r.prompt, &r.ids, &r.messages) {
        (Some(text), None, None) => tok.encode_with_added(text).map_err(|e| fail(format!("prompt: {e}")))?,
        (None, Some(ids), None) => {
            if let Some(&bad) = ids.iter().find(|&&id| id as usize >= cfg.vocab_size) {
                return Err(fail(format!("ids: token {bad} is outside the vocabulary of {}", cfg.vocab_size)));
            }
            ids.clone()
        }
        (None, None, Some(messages)) => {
            let (ids, reply) = render_messages(messages, &r, tok).map_err(&fail)?;
            // The reply ends at the template's end of message, unless the caller ignores ends.
            if !stop_ids.is_empty() {
                stop_ids.extend(reply.specials.end_ids());
                stop_ids.dedup();
            }
            chat = Some(reply);
            ids
        }
        (None, None, None) => {
            return Err(fail("give \"prompt\" (text), \"ids\" (token ids) or \"messages\" (a conversation)".into()))
        }
        _ => return Err(fail("give one of \"prompt\", \"ids\" and \"messages\", not several".into())),
    };
    if chat.is_none()
        && (r.thinking.is_some()
            || r.reasoning_effort.is_some()
            || r.tools.is_some()
            || r.tool_choice.is_some()
            || r.response_format.is_some())
    {
        return Err(fail(
            "\"thinking\", \"reasoning_effort\", \"tools\", \"tool_choice\" and \"response_format\" go with \"messages\""
                .into(),
        ));
    }
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
        request: BatchRequest {
            constraint: None,
            prompt,
            max_tokens,
            sampling,
            stop_ids,
            logprobs: None,
            prompt_logprobs: false,
        },
        stop,
        chat,
    })
}

/// The prompt ids of a `messages` line, as the chat template renders the conversation and the
/// start of the assistant's reply, and how to read that reply.
fn render_messages(
    messages: &[LineMessage],
    r: &RequestLine,
    tok: &Tokenizer,
) -> Result<(Vec<u32>, ChatReply), String> {
    use crate::chat::openai;
    use crate::chat::template::{check_order, render_with, to_ids, Effort, Message, Role, Specials, Thinking};
    let specials = Specials::of(tok).map_err(|e| {
        format!("messages: this model's tokenizer has no K3 chat template ({e}); give \"prompt\" or \"ids\"")
    })?;
    let mut thinking = Thinking { enabled: r.thinking.unwrap_or(true), ..Thinking::default() };
    match r.reasoning_effort.as_deref() {
        None => {}
        // As the server takes it (OpenAI's value for no reasoning).
        Some("none") => thinking.enabled = false,
        Some(e) => thinking.effort = Effort::parse(e).map_err(|err| format!("reasoning_effort: {err}"))?,
    }
    let list = messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = Role::from_openai(&m.role).ok_or_else(|| {
                let other = &m.role;
                format!(
                    "messages: message {i}: role {other:?} is not supported (system, developer, user, assistant, tool)"
                )
            })?;
            let tool_calls = match role {
                Role::Assistant => openai::calls(i, m.tool_calls.clone()).map_err(|e| e.message)?,
                _ => Vec::new(),
            };
            Ok(Message {
                role,
                content: m.content.clone().unwrap_or_default(),
                reasoning_content: m.reasoning_content.clone().filter(|_| role == Role::Assistant),
                name: m.name.clone(),
                tool_calls,
                tool_call_id: m.tool_call_id.clone().filter(|_| role == Role::Tool),
                ..Message::default()
            })
        })
        .collect::<Result<Vec<_>, String>>()?;
    check_order(&list).map_err(|e| format!("messages: {e}"))?;
    if list.last().is_none_or(|m| !matches!(m.role, Role::User | Role::Tool)) {
        return Err("messages: the last message must be the user's or a tool result: a reply is asked for".into());
    }
    let tools = openai::options(r.tools.clone(), r.tool_choice.as_ref(), r.response_format.as_ref())
        .map_err(|e| format!("{}: {}", e.param, e.message))?;
    let pieces = render_with(&list, &tools, thinking, true).map_err(|e| format!("messages: {e}"))?;
    let ids = to_ids(&pieces, tok, &specials).map_err(|e| format!("messages: {e}"))?;
    Ok((ids, ChatReply { specials, thinking: thinking.enabled, tools }))
}
