//! Tools and structured output in the XTML template, as the release encodes them
//! (docs/SERVE.md "Tools"): the `tool-declare` system message, an assistant's calls after its
//! response, tool results in call order, and the `tool-choice` and `response-format` system
//! messages before the generation prompt.
#![forbid(unsafe_code)]

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::pyjson::{compact_sorted, scan_arguments};
use super::template::{Message, Pieces, Role, TemplateError};

/// A call an assistant made, as OpenAI's `tool_calls[k]` holds it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The id a result names in `tool_call_id`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    pub name: String,
    /// A JSON object's text, as OpenAI sends it.
    pub arguments: String,
}

/// `tool_choice`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ToolChoice {
    #[default]
    Auto,
    None,
    Required,
    /// One function by name. The release writes nothing for it (as for `auto`); k3ring makes
    /// the reply call it by constraining the decoding.
    Function(String),
}

/// `response_format`.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum ResponseFormat {
    #[default]
    Text,
    JsonObject,
    /// The schema (the `schema` member of `json_schema`).
    JsonSchema(Value),
}

/// What a request adds to its messages besides thinking.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ToolOptions {
    /// The request's `tools`, as given (rendered with sorted keys).
    pub tools: Vec<Value>,
    pub choice: ToolChoice,
    pub format: ResponseFormat,
}

impl ToolOptions {
    /// The declared functions' names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.tools.iter().filter_map(function_name).collect()
    }
}

/// `tools[k].function.name`.
pub fn function_name(tool: &Value) -> Option<&str> {
    tool.get("function")?.get("name")?.as_str()
}

const DECLARE_HEAD: &str = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n";

const JSON_ONLY: &str =
    "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting.";

/// The `tool-declare` message: the first of the document when tools are given.
pub(super) fn declare(p: &mut Pieces, tools: &[Value]) {
    if tools.is_empty() {
        return;
    }
    let list = compact_sorted(&Value::Array(tools.to_vec()));
    p.message(&[("role", "system"), ("type", "tool-declare")], |p| {
        p.text(&format!("{DECLARE_HEAD}{list}\n```"));
    });
}

/// The `tool-choice` and `response-format` messages, after the last message.
pub(super) fn instructions(p: &mut Pieces, o: &ToolOptions) {
    let choice = match o.choice {
        ToolChoice::Required => {
            Some("The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.")
        }
        ToolChoice::None => {
            Some("The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message.")
        }
        ToolChoice::Auto | ToolChoice::Function(_) => None,
    };
    if let Some(text) = choice {
        p.message(&[("role", "system"), ("type", "tool-choice")], |p| p.text(text));
    }
    let format = match &o.format {
        ResponseFormat::Text => None,
        ResponseFormat::JsonObject => {
            Some(format!("The system is invoked with `response_format=json_object`.\n{JSON_ONLY}"))
        }
        ResponseFormat::JsonSchema(s) => Some(format!(
            "The system is invoked with `response_format=json_schema`.\n{JSON_ONLY}\nThe JSON data must match the \
             following schema:\n```json\n{}\n```",
            compact_sorted(s)
        )),
    };
    if let Some(text) = format {
        p.message(&[("role", "system"), ("type", "response-format")], |p| p.text(&text));
    }
}

/// An assistant's calls, after its response element.
pub(super) fn calls(p: &mut Pieces, calls: &[ToolCall]) {
    if calls.is_empty() {
        return;
    }
    p.open("tools", &[]);
    for (i, c) in calls.iter().enumerate() {
        let index = (i + 1).to_string();
        p.open("call", &[("tool", &c.name), ("index", &index)]);
        if !c.arguments.is_empty() {
            match scan_arguments(&c.arguments) {
                Some(args) => {
                    for a in args {
                        p.open("argument", &[("key", &a.key), ("type", a.kind.name())]);
                        p.text(&a.text);
                        p.close("argument");
                    }
                }
                None => {
                    p.open("json", &[("type", "object")]);
                    p.text(&c.arguments);
                    p.close("json");
                }
            }
        }
        p.close("call");
    }
    p.close("tools");
}

/// A tool message ready to render: its result's tool name and index.
pub(super) struct ToolResult {
    pub name: String,
    pub index: usize,
}

/// The order the messages render in and each tool message's name and index: a run of results
/// whose ids all name calls of the last assistant message is put in call order and takes the
/// calls' names; a run with any other id stays as given. The index counts results since the
/// last assistant message.
pub(super) fn arrange(messages: &[Message]) -> Result<Vec<(&Message, Option<ToolResult>)>, TemplateError> {
    let mut out = Vec::with_capacity(messages.len());
    let mut calls: &[ToolCall] = &[];
    let mut since_assistant = 0;
    let mut i = 0;
    while i < messages.len() {
        let m = &messages[i];
        if m.role != Role::Tool {
            if m.role == Role::Assistant {
                calls = &m.tool_calls;
                since_assistant = 0;
            }
            out.push((m, None));
            i += 1;
            continue;
        }
        let end = i + messages[i..].iter().take_while(|m| m.role == Role::Tool).count();
        let run = &messages[i..end];
        let position = |m: &Message| {
            let id = m.tool_call_id.as_deref()?;
            calls.iter().position(|c| c.id.as_deref() == Some(id))
        };
        let matched: Option<Vec<usize>> = run.iter().map(position).collect();
        let mut order: Vec<(usize, Option<usize>)> = match &matched {
            Some(pos) => pos.iter().enumerate().map(|(k, &p)| (k, Some(p))).collect(),
            None => (0..run.len()).map(|k| (k, None)).collect(),
        };
        order.sort_by_key(|&(k, p)| (p, k));
        for (k, call) in order {
            let m = &run[k];
            since_assistant += 1;
            let by_call = call.map(|c| calls[c].name.clone()).filter(|n| !n.is_empty());
            let name = by_call
                .or_else(|| m.name.clone())
                .or_else(|| calls.get(since_assistant - 1).map(|c| c.name.clone()))
                .ok_or_else(|| TemplateError::Order {
                    index: i + k,
                    why: "a tool result whose tool is unknown: give tool_call_id naming a call of the last \
                          assistant message, or name"
                        .into(),
                })?;
            out.push((m, Some(ToolResult { name, index: since_assistant })));
        }
        i = end;
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::chat::template::to_text;

    fn call(id: &str, name: &str, args: &str) -> ToolCall {
        ToolCall { id: Some(id.into()), name: name.into(), arguments: args.into() }
    }

    #[test]
    fn arguments_that_are_not_an_object_go_in_a_json_block() {
        let mut p = Pieces::default();
        calls(&mut p, &[call("a", "f", "[1, 2]"), call("b", "g", ""), call("c", "h", "{}")]);
        assert_eq!(
            to_text(&p.0),
            "<|open|>tools<|sep|><|open|>call tool=\"f\" index=\"1\"<|sep|><|open|>json type=\"object\"<|sep|>[1, 2]\
             <|close|>json<|sep|><|close|>call<|sep|><|open|>call tool=\"g\" index=\"2\"<|sep|><|close|>call<|sep|>\
             <|open|>call tool=\"h\" index=\"3\"<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
        );
    }

    #[test]
    fn attributes_are_escaped_and_split_as_the_release_tokenizes_them() {
        let mut p = Pieces::default();
        p.open("call", &[("tool", "a\"&b"), ("index", "")]);
        assert_eq!(to_text(&p.0), "<|open|>call tool=\"a&quot;&amp;b\" index=\"\"<|sep|>");
        let texts: Vec<String> =
            p.0.iter()
                .filter_map(|x| match x {
                    crate::chat::template::Piece::Text(t) => Some(t.clone()),
                    crate::chat::template::Piece::Special(_) => None,
                })
                .collect();
        assert_eq!(texts, ["call", " tool", "=\"", "a&quot;&amp;b", "\"", " index", "=\"", "\""]);
    }
}
