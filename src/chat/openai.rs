//! The OpenAI shapes of tools and structured output: `tools`, `tool_choice`,
//! `response_format`, an assistant's `tool_calls` and `role: "tool"` messages, checked into the
//! chat template's types ([`crate::chat::tools`]). The server and `k3ring batch` take them.
#![forbid(unsafe_code)]

use serde_json::Value;

use super::tools::{function_name, ResponseFormat, ToolCall, ToolChoice, ToolOptions};

/// A refused field: its name and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct FieldError {
    pub param: &'static str,
    pub message: String,
}

/// The refusal of `param` for `message`.
fn refuse(param: &'static str, message: impl Into<String>) -> FieldError {
    FieldError { param, message: message.into() }
}

/// `tools`, `tool_choice` and `response_format` of a chat body.
pub fn options(
    tools: Option<Vec<Value>>,
    tool_choice: Option<&Value>,
    response_format: Option<&Value>,
) -> Result<ToolOptions, FieldError> {
    let tools = tools.unwrap_or_default();
    for (k, t) in tools.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(refuse(
                "tools",
                format!("tools[{k}]: only {{\"type\": \"function\", ...}} tools are supported"),
            ));
        }
        let name =
            function_name(t).ok_or_else(|| refuse("tools", format!("tools[{k}]: give function.name (a string)")))?;
        if name.is_empty() {
            return Err(refuse("tools", format!("tools[{k}]: function.name is empty")));
        }
        if let Some(p) = t["function"].get("parameters").filter(|p| !p.is_null() && !p.is_object()) {
            return Err(refuse(
                "tools",
                format!("tools[{k}]: function.parameters must be a JSON schema object, not {p}"),
            ));
        }
        if tools[..k].iter().any(|u| function_name(u) == Some(name)) {
            return Err(refuse("tools", format!("tools[{k}]: the function name {name:?} is declared twice")));
        }
    }
    let choice = match tool_choice {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) if s == "auto" => ToolChoice::Auto,
        Some(Value::String(s)) if s == "none" => ToolChoice::None,
        Some(Value::String(s)) if s == "required" => ToolChoice::Required,
        Some(v @ Value::Object(_)) => {
            let name = v.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
            match (v.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(name)) => ToolChoice::Function(name.to_owned()),
                _ => {
                    return Err(refuse(
                        "tool_choice",
                        "tool_choice: give \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    ))
                }
            }
        }
        Some(v) => {
            return Err(refuse("tool_choice", format!("tool_choice {v} is not auto, none, required or a function")))
        }
    };
    let declared = |name: &str| tools.iter().any(|t| function_name(t) == Some(name));
    match &choice {
        ToolChoice::Required if tools.is_empty() => {
            return Err(refuse("tool_choice", "tool_choice \"required\" needs tools: none are declared"))
        }
        ToolChoice::Function(name) if !declared(name) => {
            return Err(refuse("tool_choice", format!("tool_choice names {name:?}, which is not among the tools")))
        }
        _ => {}
    }
    let format = match response_format {
        None | Some(Value::Null) => ResponseFormat::Text,
        Some(f) => match f.get("type").and_then(Value::as_str) {
            Some("text") => ResponseFormat::Text,
            Some("json_object") => ResponseFormat::JsonObject,
            Some("json_schema") => {
                let schema = f.get("json_schema").and_then(|j| j.get("schema")).filter(|s| s.is_object());
                let schema = schema.ok_or_else(|| {
                    refuse(
                        "response_format",
                        "response_format json_schema: give {\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                    )
                })?;
                ResponseFormat::JsonSchema(schema.clone())
            }
            _ => {
                return Err(refuse(
                    "response_format",
                    "response_format: give {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": \"json_schema\", ...}",
                ))
            }
        },
    };
    Ok(ToolOptions { tools, choice, format })
}

/// An assistant message's `tool_calls`.
pub fn calls(index: usize, v: Option<Value>) -> Result<Vec<ToolCall>, FieldError> {
    let bad = |why: String| refuse("messages", format!("message {index}: {why}"));
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(list)) => list,
        Some(_) => return Err(bad("tool_calls must be a list".into())),
    };
    list.iter()
        .enumerate()
        .map(|(k, c)| {
            let f = c.get("function").unwrap_or(c);
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("tool_calls[{k}] has no function.name")))?;
            let arguments = match f.get("arguments") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                // An object (the release takes it too): each value as Python's default dumps
                // writes it, which is what reading its text back one level deep gives.
                Some(o @ Value::Object(_)) => super::pyjson::python_default(o),
                Some(_) => return Err(bad(format!("tool_calls[{k}].function.arguments must be a string of JSON"))),
            };
            let id = c.get("id").and_then(Value::as_str).map(str::to_owned);
            Ok(ToolCall { id, name: name.to_owned(), arguments })
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::chat::template::{render_with, to_ids, Piece, Special, Specials};
    use crate::serve::api::{chat_job, Limits, Prompt};
    use crate::tokenizer::Tokenizer;
    use serde_json::json;

    /// The release encoding's renderings (tests/fixtures/xtml-tools, written by hand from its
    /// format and checked against it outside CI): each request's pieces are the release's
    /// segments, cut where it cuts, and its ids are those segments encoded one by one.
    #[test]
    fn requests_render_as_the_release_encodes_them() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
        let tok = Tokenizer::from_model_dir(&root.join("tiny-k3")).unwrap();
        let sp = Specials::of(&tok).unwrap();
        let limits = Limits { model: "m".into(), max_tokens: 100 };
        for name in ["A", "A2", "B1", "B2", "B3", "C1", "C2", "C3", "D2", "D3"] {
            let dir = root.join("xtml-tools");
            let body = std::fs::read(dir.join(format!("{name}.input.json"))).unwrap();
            let segments: Vec<(String, bool)> =
                serde_json::from_slice(&std::fs::read(dir.join(format!("{name}.segments.json"))).unwrap()).unwrap();
            let job = chat_job(&body, &limits).unwrap_or_else(|e| panic!("{name}: {}", e.message));
            let Prompt::Chat { messages, thinking, tools } = job.prompt else { panic!("{name}: not a chat") };
            let pieces = render_with(&messages, &tools, thinking, true).unwrap();
            let want: Vec<Piece> = segments
                .iter()
                .map(|(text, special)| {
                    if !special {
                        return Piece::Text(text.clone());
                    }
                    let s = [Special::Open, Special::Close, Special::Sep, Special::EndOfMsg, Special::Eos]
                        .into_iter()
                        .find(|s| s.spelling() == text)
                        .unwrap();
                    Piece::Special(s)
                })
                .collect();
            assert_eq!(pieces, want, "{name}");
            let mut ids = Vec::new();
            for (text, special) in &segments {
                if *special {
                    ids.push(tok.added_id(text).unwrap());
                } else {
                    ids.extend(tok.encode(text).unwrap());
                }
            }
            assert_eq!(to_ids(&pieces, &tok, &sp).unwrap(), ids, "{name}");
        }
    }

    #[test]
    fn choices_and_formats_are_checked() {
        let tools = vec![json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})];
        let o =
            options(Some(tools.clone()), Some(&json!({"type": "function", "function": {"name": "f"}})), None).unwrap();
        assert_eq!(o.choice, ToolChoice::Function("f".into()));
        let err = |t: Option<Vec<Value>>, c: Value, f: Value| Some(options(t, Some(&c), Some(&f)).unwrap_err().param);
        assert_eq!(
            err(Some(tools.clone()), json!({"type": "function", "function": {"name": "g"}}), Value::Null),
            Some("tool_choice")
        );
        assert_eq!(err(None, json!("required"), Value::Null), Some("tool_choice"));
        assert_eq!(err(None, json!("sometimes"), Value::Null), Some("tool_choice"));
        assert_eq!(err(None, Value::Null, json!({"type": "yaml"})), Some("response_format"));
        assert_eq!(err(None, Value::Null, json!({"type": "json_schema"})), Some("response_format"));
        let twice = vec![tools[0].clone(), tools[0].clone()];
        assert_eq!(err(Some(twice), Value::Null, Value::Null), Some("tools"));
        assert_eq!(err(Some(vec![json!({"type": "code_interpreter"})]), Value::Null, Value::Null), Some("tools"));
        let o = options(
            None,
            None,
            Some(&json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}})),
        );
        assert_eq!(o.unwrap().format, ResponseFormat::JsonSchema(json!({"type": "object"})));
    }
}
