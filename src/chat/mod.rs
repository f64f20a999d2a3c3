//! Conversations with K3: the chat template ([`template`]), the completion parser ([`parse`]) and
//! a conversation that keeps the model state between turns ([`Conversation`]).
//!
//! Depends on `engine` (the session that carries the state) and `tokenizer`; the CLI's
//! `k3ring chat` is its only user besides the tests.
#![forbid(unsafe_code)]

pub mod calls;
pub mod constrain;
pub mod openai;
pub mod parse;
pub mod pyjson;
pub mod template;
pub mod tools;

/// What the chat tests share: the tiny model's tokenizer, and the ids a model writes for a
/// message after the generation prompt.
#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod test_support {
    use super::template::{generation_prompt, message, to_ids, Message, Specials, Thinking};
    use crate::tokenizer::Tokenizer;

    pub fn tiny() -> Tokenizer {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-k3");
        Tokenizer::from_model_dir(&dir).unwrap()
    }

    /// The ids of `m` after the generation prompt of `thinking`: a reply as a model writes it.
    pub fn reply_ids(tok: &Tokenizer, sp: Specials, m: &Message, thinking: bool) -> Vec<u32> {
        let th = Thinking { enabled: thinking, ..Thinking::default() };
        let whole = to_ids(&message(m, th), tok, &sp).unwrap();
        let prompt = to_ids(&generation_prompt(th), tok, &sp).unwrap();
        assert!(whole.starts_with(&prompt));
        whole[prompt.len()..].to_vec()
    }
}

use serde::{Deserialize, Serialize};

use crate::engine::ChatSession;
use crate::tokenizer::Tokenizer;
use parse::CompletionParser;
use template::{generation_prompt, message, to_ids, Message, Role, Specials, TemplateError, Thinking};

/// A conversation: its messages (as the history file stores them) and the session that has
/// seen them, so each turn prefills only what it adds.
///
/// The session's token ids are the transcript the model saw, and they are what a turn extends:
/// a reply's ids are kept as generated (re-encoding the decoded text could spell it with other
/// tokens), and a reply cut short is closed with the markup it lacked. The messages are only
/// re-rendered when the session is empty (the first turn, after `/reset` or `/system`).
pub struct Conversation {
    pub messages: Vec<Message>,
    pub thinking: Thinking,
    /// Tools declared to the model, tool choice and response format (rendered with every
    /// turn's generation prompt, as the release renders them per request).
    pub tools: tools::ToolOptions,
    pub session: ChatSession,
    pub specials: Specials,
}

/// What a state file keeps of a conversation besides the session.
#[derive(Serialize, Deserialize)]
struct Saved {
    messages: Vec<Message>,
    thinking: Thinking,
}

impl Conversation {
    pub fn new(session: ChatSession, specials: Specials, thinking: Thinking, system: Option<&str>) -> Conversation {
        let messages = system.map(Message::system).into_iter().collect();
        Conversation { messages, thinking, tools: tools::ToolOptions::default(), session, specials }
    }

    /// The ids a user turn adds to the session: the whole rendered transcript when the session
    /// is empty, else the user message; then the generation prompt.
    pub fn user_turn_ids(&self, tok: &Tokenizer, text: &str) -> Result<Vec<u32>, TemplateError> {
        let user = Message::user(text);
        let pieces = if self.session.ids().is_empty() {
            let mut all = self.messages.clone();
            all.push(user);
            template::render_with(&all, &self.tools, self.thinking, true)?
        } else {
            if self.messages.last().is_some_and(|m| m.role == Role::User) {
                let index = self.messages.len();
                return Err(TemplateError::Order { index, why: "the last user message has no reply".into() });
            }
            let mut p = message(&user, self.thinking);
            p.extend(template::instructions(&self.tools));
            p.extend(generation_prompt(self.thinking));
            p
        };
        to_ids(&pieces, tok, &self.specials)
    }

    /// The calls of the last reply that have no result yet, in order.
    pub fn pending_calls(&self) -> &[template::ToolCall] {
        self.calls_and_results().map_or(&[], |(calls, answered)| calls.get(answered..).unwrap_or_default())
    }

    /// The last assistant message's calls and how many results follow it, when nothing but
    /// results does.
    fn calls_and_results(&self) -> Option<(&[template::ToolCall], usize)> {
        let last = self.messages.iter().rposition(|m| m.role == Role::Assistant)?;
        let answered = self.messages[last + 1..].iter().take_while(|m| m.role == Role::Tool).count();
        (last + 1 + answered == self.messages.len()).then_some((&self.messages[last].tool_calls[..], answered))
    }

    /// Answers the next pending call with `content`: its result message's ids, then (when it was
    /// the last one pending) the generation prompt of the reply that follows. `None` when no
    /// call is pending.
    pub fn push_tool_result(&mut self, tok: &Tokenizer, content: &str) -> Result<Option<bool>, TemplateError> {
        let Some(call) = self.pending_calls().first().cloned() else { return Ok(None) };
        let index = self.calls_and_results().map_or(0, |(_, answered)| answered) + 1;
        let m = Message {
            role: Role::Tool,
            content: content.to_owned(),
            tool_call_id: call.id.clone(),
            ..Message::default()
        };
        let mut p = template::tool_result(&m, &call.name, index);
        let last = self.pending_calls().len() == 1;
        if last {
            p.extend(template::instructions(&self.tools));
            p.extend(generation_prompt(self.thinking));
        }
        let ids = to_ids(&p, tok, &self.specials)?;
        let needed = self.session.ids().len() + ids.len();
        if needed >= self.session.capacity() {
            let index = self.messages.len();
            let why = format!(
                "the result would take the conversation to {needed} of its {} positions; /reset, or restart with a \
                 larger --context",
                self.session.capacity()
            );
            return Err(TemplateError::Order { index, why });
        }
        self.session.push(&ids);
        self.messages.push(m);
        Ok(Some(last))
    }

    /// Adds a user turn whose ids [`Conversation::user_turn_ids`] made.
    pub fn push_user(&mut self, text: &str, ids: &[u32]) {
        self.session.push(ids);
        self.messages.push(Message::user(text));
    }

    /// A parser for the reply to the last user turn.
    pub fn parser<'t>(&self, tok: &'t Tokenizer) -> CompletionParser<'t> {
        CompletionParser::new(tok, self.specials, self.thinking.enabled)
    }

    /// Ends a reply: appends the markup it lacked (if it stopped early) to the session, and its
    /// message to the transcript.
    pub fn finish_reply(&mut self, tok: &Tokenizer, parser: &CompletionParser<'_>) -> Result<&Message, TemplateError> {
        let closing = to_ids(&parser.closing(), tok, &self.specials)?;
        self.session.push(&closing);
        let c = parser.completion();
        let reasoning = if self.thinking.enabled { Some(tok.decode(&c.reasoning_ids)?) } else { None };
        let content = tok.decode(&c.content_ids)?;
        let turn = self.messages.len();
        let tool_calls = c
            .calls
            .iter()
            .enumerate()
            .map(|(k, call)| template::ToolCall {
                id: Some(format!("call_{turn}_{k}")),
                name: call.name.clone(),
                arguments: call.arguments.clone(),
            })
            .collect();
        self.messages.push(Message { tool_calls, ..Message::assistant(reasoning.as_deref(), &content) });
        Ok(&self.messages[self.messages.len() - 1])
    }

    /// The system message, if any.
    pub fn system(&self) -> Option<&str> {
        self.messages.first().filter(|m| m.role == Role::System).map(|m| m.content.as_str())
    }

    /// Starts over, keeping the system message.
    pub fn reset(&mut self) {
        self.messages.retain(|m| m.role == Role::System);
        self.session.reset();
    }

    /// Replaces the system message. It opens the transcript, so the session starts over and the
    /// next turn prefills the whole conversation again.
    pub fn set_system(&mut self, text: &str) {
        if self.system().is_some() {
            self.messages[0] = Message::system(text);
        } else {
            self.messages.insert(0, Message::system(text));
        }
        self.session.reset();
    }

    /// The transcript as JSONL (one message per line).
    pub fn history_jsonl(&self) -> String {
        let mut out = String::new();
        for m in &self.messages {
            out.push_str(&serde_json::to_string(m).unwrap_or_default());
            out.push('\n');
        }
        out
    }

    /// What a state file keeps besides the session.
    pub fn extra_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(&Saved { messages: self.messages.clone(), thinking: self.thinking }).unwrap_or_default()
    }

    /// Takes the messages and thinking settings of a state file's extra bytes.
    pub fn restore_extra(&mut self, bytes: &[u8]) -> Result<(), TemplateError> {
        let saved: Saved = serde_json::from_slice(bytes).map_err(|e| TemplateError::Order {
            index: 0,
            why: format!("the state file's transcript is not a chat transcript: {e}"),
        })?;
        template::check_order(&saved.messages)?;
        self.messages = saved.messages;
        self.thinking = saved.thinking;
        Ok(())
    }
}
