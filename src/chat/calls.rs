//! Reading the tool calls a reply makes after its response element (docs/SERVE.md "Tools"):
//! `<|open|>tools<|sep|>` then `call tool=".." index=".."` elements holding `argument key=".."
//! type=".."` elements or one `json` block, then `<|close|>tools<|sep|>`. The block is followed
//! element by element as the ids come, so a call can be streamed once its element closes. An
//! element that is not a well-formed call is kept as stray ids, which a server returns as
//! content (never an error); only a break in the nesting itself (a close tag that names another
//! element, an end id inside the block) is a parse error.
#![forbid(unsafe_code)]

use super::parse::ParseError;
use super::pyjson::{arguments_json, ArgType, Argument};
use super::template::{Piece, Special, Specials};
use crate::tokenizer::Tokenizer;

/// A call read from a reply, in OpenAI's terms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsedCall {
    pub name: String,
    /// A JSON object's text (or, from a `json` block, the text the model wrote).
    pub arguments: String,
}

/// One call in OpenAI's shape (without the `index` a stream adds).
pub fn openai_tool_call(c: &ParsedCall, prefix: &str, k: usize) -> serde_json::Value {
    serde_json::json!({
        "id": format!("call_{prefix}_{k}"),
        "type": "function",
        "function": {"name": c.name, "arguments": c.arguments},
    })
}

/// The calls to `declared` tools in OpenAI's shape, numbered from `first`; the others (a tool
/// the request did not declare) are written back into `text` as their markup.
pub fn declared_calls(
    calls: &[ParsedCall],
    declared: &[String],
    prefix: &str,
    first: usize,
    text: &mut String,
) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    for c in calls {
        if declared.contains(&c.name) {
            out.push(openai_tool_call(c, prefix, first + out.len()));
        } else {
            text.push_str(&call_markup(c));
        }
    }
    out
}

/// A call written back as the markup it came in (a `json` block holding its arguments), for a
/// call that is returned as content.
pub fn call_markup(c: &ParsedCall) -> String {
    let name = c.name.replace('&', "&amp;").replace('"', "&quot;");
    format!(
        "<|open|>call tool=\"{name}\"<|sep|><|open|>json type=\"object\"<|sep|>{}<|close|>json<|sep|><|close|>call<|sep|>",
        c.arguments
    )
}

/// What one id of the block did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockEvent {
    Markup,
    /// A call element closed and read well: the last of [`ToolBlock::calls`].
    Call,
    /// Ids that are not a call were added to [`ToolBlock::stray`].
    Stray,
    /// The block closed.
    Closed,
}

#[derive(Clone, Debug)]
enum Tag {
    Body,
    Open(Vec<u32>),
    Close(Vec<u32>),
}

/// The tools block of one reply, from its first `<|open|>`.
pub struct ToolBlock {
    stack: Vec<String>,
    tag: Tag,
    /// The ids of the element being read at the block's top level.
    element: Vec<u32>,
    pub calls: Vec<ParsedCall>,
    pub stray: Vec<u32>,
}

impl ToolBlock {
    /// A block whose `<|open|>` was just read.
    pub fn opened(open: u32) -> ToolBlock {
        ToolBlock {
            stack: Vec::new(),
            tag: Tag::Open(Vec::new()),
            element: vec![open],
            calls: Vec::new(),
            stray: Vec::new(),
        }
    }

    /// The ids not yet read into a call or the stray ids (a block cut short).
    pub fn pending(&self) -> &[u32] {
        &self.element
    }

    pub fn push(&mut self, tok: &Tokenizer, sp: &Specials, at: usize, id: u32) -> Result<BlockEvent, ParseError> {
        let top_level = self.stack.len() <= 1;
        if !top_level || !matches!(self.tag, Tag::Body) || id == sp.open || id == sp.close {
            self.element.push(id);
        }
        match &mut self.tag {
            Tag::Open(buf) if !sp.is_control(id) => buf.push(id),
            Tag::Close(buf) if !sp.is_control(id) => {
                buf.push(id);
                let name = self.stack.last().map_or("", String::as_str);
                let typed = tok.decode_bytes(buf).unwrap_or_default();
                if !name.as_bytes().starts_with(&typed) {
                    return Err(ParseError::BadMarkup { at, found: id, expected: format!("the tag {name:?}") });
                }
            }
            Tag::Open(buf) if id == sp.sep => {
                let text = tok.decode_bytes(buf).unwrap_or_default();
                let text = String::from_utf8_lossy(&text);
                let name = text.split(' ').next().unwrap_or_default().to_owned();
                self.stack.push(name);
                self.tag = Tag::Body;
                if self.stack.len() == 1 {
                    // The block's own open tag is no element.
                    self.element.clear();
                }
            }
            Tag::Close(buf) if id == sp.sep => {
                let name = self.stack.pop().unwrap_or_default();
                let typed = tok.decode_bytes(buf).unwrap_or_default();
                if typed != name.as_bytes() {
                    return Err(ParseError::BadMarkup {
                        at,
                        found: id,
                        expected: format!("the rest of the tag {name:?}"),
                    });
                }
                self.tag = Tag::Body;
                if self.stack.is_empty() {
                    self.element.clear();
                    return Ok(BlockEvent::Closed);
                }
                if self.stack.len() == 1 {
                    let ids = std::mem::take(&mut self.element);
                    return Ok(self.element_done(tok, sp, ids));
                }
            }
            Tag::Body if id == sp.open => self.tag = Tag::Open(Vec::new()),
            Tag::Body if id == sp.close => self.tag = Tag::Close(Vec::new()),
            Tag::Body if !sp.is_control(id) => {
                if top_level {
                    self.stray.push(id);
                    return Ok(BlockEvent::Stray);
                }
            }
            _ => return Err(ParseError::ControlInPayload { at, id, channel: "tool calls" }),
        }
        Ok(BlockEvent::Markup)
    }

    fn element_done(&mut self, tok: &Tokenizer, sp: &Specials, ids: Vec<u32>) -> BlockEvent {
        let in_tools = self.stack.first().is_some_and(|n| n == "tools");
        match read_call(tok, sp, &ids).filter(|_| in_tools) {
            Some(call) => {
                self.calls.push(call);
                BlockEvent::Call
            }
            None => {
                tracing::warn!("a reply's tool call markup did not read as a call; it is returned as content");
                self.stray.extend(ids);
                BlockEvent::Stray
            }
        }
    }

    /// The pieces that close the block from here (a reply cut short).
    pub fn closing(&self, tok: &Tokenizer) -> Vec<Piece> {
        let mut out = Vec::new();
        let mut stack = self.stack.clone();
        match &self.tag {
            Tag::Body => {}
            Tag::Open(buf) => {
                out.push(Piece::Special(Special::Sep));
                let text = String::from_utf8_lossy(&tok.decode_bytes(buf).unwrap_or_default()).into_owned();
                stack.push(text.split(' ').next().unwrap_or_default().to_owned());
            }
            Tag::Close(buf) => {
                let name = stack.pop().unwrap_or_default();
                let typed = tok.decode_bytes(buf).unwrap_or_default();
                let rest = name.as_bytes().get(typed.len()..).unwrap_or_default();
                if !rest.is_empty() {
                    out.push(Piece::Text(String::from_utf8_lossy(rest).into_owned()));
                }
                out.push(Piece::Special(Special::Sep));
            }
        }
        for name in stack.iter().rev() {
            out.push(Piece::Special(Special::Close));
            if !name.is_empty() {
                out.push(Piece::Text(name.clone()));
            }
            out.push(Piece::Special(Special::Sep));
        }
        out
    }
}

/// The element's ids as markup and text runs.
#[derive(Debug, PartialEq)]
enum Item {
    Open,
    Close,
    Sep,
    Text(String),
}

fn items(tok: &Tokenizer, sp: &Specials, ids: &[u32]) -> Option<Vec<Item>> {
    let mut out = Vec::new();
    let mut run: Vec<u32> = Vec::new();
    let flush = |run: &mut Vec<u32>, out: &mut Vec<Item>| -> Option<()> {
        if !run.is_empty() {
            out.push(Item::Text(String::from_utf8(tok.decode_bytes(run).ok()?).ok()?));
            run.clear();
        }
        Some(())
    };
    for &id in ids {
        let item = match id {
            _ if id == sp.open => Item::Open,
            _ if id == sp.close => Item::Close,
            _ if id == sp.sep => Item::Sep,
            _ if sp.is_control(id) => return None,
            _ => {
                run.push(id);
                continue;
            }
        };
        flush(&mut run, &mut out)?;
        out.push(item);
    }
    flush(&mut run, &mut out)?;
    Some(out)
}

/// `NAME KEY="VALUE" ...`, values unescaped (`&quot;`, `&amp;`).
fn tag_attrs(text: &str) -> Option<(&str, Vec<(&str, String)>)> {
    let (name, mut rest) = text.split_once(' ').unwrap_or((text, ""));
    let mut attrs = Vec::new();
    while !rest.is_empty() {
        let (key, after) = rest.split_once("=\"")?;
        let end = after.find('"')?;
        attrs.push((key.trim_start_matches(' '), after[..end].replace("&quot;", "\"").replace("&amp;", "&")));
        rest = &after[end + 1..];
    }
    Some((name, attrs))
}

fn attr<'a>(attrs: &'a [(&str, String)], key: &str) -> Option<&'a str> {
    attrs.iter().find(|(k, _)| *k == key).map(|(_, v)| v.as_str())
}

/// One `call` element as a call, or `None` when it is not one.
fn read_call(tok: &Tokenizer, sp: &Specials, ids: &[u32]) -> Option<ParsedCall> {
    let items = items(tok, sp, ids)?;
    let mut it = items.iter().peekable();
    let open = |it: &mut std::iter::Peekable<std::slice::Iter<'_, Item>>| -> Option<(String, Vec<(String, String)>)> {
        if it.next()? != &Item::Open {
            return None;
        }
        let Item::Text(t) = it.next()? else { return None };
        if it.next()? != &Item::Sep {
            return None;
        }
        let (name, attrs) = tag_attrs(t)?;
        Some((name.to_owned(), attrs.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()))
    };
    let close = |it: &mut std::iter::Peekable<std::slice::Iter<'_, Item>>, name: &str| -> Option<()> {
        (it.next()? == &Item::Close && it.next()? == &Item::Text(name.to_owned()) && it.next()? == &Item::Sep)
            .then_some(())
    };
    let (tag, attrs) = open(&mut it)?;
    let call_attrs: Vec<(&str, String)> = attrs.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    let name = attr(&call_attrs, "tool").filter(|n| tag == "call" && !n.is_empty())?.to_owned();
    let mut args = Vec::new();
    let mut block = None;
    while it.peek() == Some(&&Item::Open) {
        let (child, attrs) = open(&mut it)?;
        let attrs: Vec<(&str, String)> = attrs.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        let text = match it.peek() {
            Some(Item::Text(t)) => {
                it.next();
                t.clone()
            }
            _ => String::new(),
        };
        close(&mut it, &child)?;
        match child.as_str() {
            "argument" => {
                let key = attr(&attrs, "key")?.to_owned();
                let kind = ArgType::parse(attr(&attrs, "type").unwrap_or("string"))?;
                args.push(Argument { key, kind, text });
            }
            "json" if block.is_none() => block = Some(text),
            _ => return None,
        }
    }
    close(&mut it, "call")?;
    if it.next().is_some() {
        return None;
    }
    let arguments = match block {
        Some(_) if !args.is_empty() => return None,
        Some(raw) => raw,
        None => arguments_json(&args),
    };
    Some(ParsedCall { name, arguments })
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::chat::parse::{parse, CompletionParser, Event};
    use crate::chat::template::Message;
    use crate::chat::test_support::{reply_ids, tiny};
    use crate::chat::tools::ToolCall;

    fn with_calls(content: &str, calls: &[(&str, &str)]) -> Message {
        let tool_calls = calls
            .iter()
            .map(|(name, args)| ToolCall { id: None, name: (*name).into(), arguments: (*args).into() })
            .collect();
        Message { tool_calls, ..Message::assistant(Some("r"), content) }
    }

    #[test]
    fn calls_read_back_as_openai_arguments() {
        let tok = tiny();
        let sp = Specials::of(&tok).unwrap();
        let m = with_calls(
            "Checking.",
            &[
                ("get_weather", r#"{"city": "Z\u00fcrich", "days": 3, "exact": false, "tags": ["a", "b"], "x": null}"#),
                ("raw", "[1, 2]"),
                ("none", ""),
                ("q\"uote&", r#"{"k\"ey": "v"}"#),
            ],
        );
        for thinking in [true, false] {
            let c = parse(&tok, sp, thinking, &reply_ids(&tok, sp, &m, thinking)).unwrap();
            assert_eq!(tok.decode(&c.content_ids).unwrap(), "Checking.");
            let got: Vec<(&str, &str)> = c.calls.iter().map(|c| (c.name.as_str(), c.arguments.as_str())).collect();
            assert_eq!(
                got,
                [
                    ("get_weather", r#"{"city":"Zürich","days":3,"exact":false,"tags":["a", "b"],"x":null}"#),
                    ("raw", "[1, 2]"),
                    ("none", "{}"),
                    ("q\"uote&", r#"{"k\"ey":"v"}"#),
                ]
            );
            assert!(c.stray_ids.is_empty() && c.complete);
        }
    }

    #[test]
    fn calls_to_undeclared_tools_are_written_back_as_text() {
        let call = |name: &str| ParsedCall { name: name.into(), arguments: "{}".into() };
        let mut text = String::from("so ");
        let v = declared_calls(&[call("f"), call("x\"y"), call("g")], &["f".into(), "g".into()], "p", 0, &mut text);
        let names: Vec<&str> = v.iter().map(|c| c["function"]["name"].as_str().unwrap()).collect();
        assert_eq!((names, v[1]["id"].as_str()), (vec!["f", "g"], Some("call_p_1")));
        assert_eq!(
            text,
            "so <|open|>call tool=\"x&quot;y\"<|sep|><|open|>json type=\"object\"<|sep|>{}<|close|>json<|sep|><|close|>call<|sep|>"
        );
    }

    #[test]
    fn a_call_streams_when_its_element_closes() {
        let tok = tiny();
        let sp = Specials::of(&tok).unwrap();
        let ids = reply_ids(&tok, sp, &with_calls("", &[("f", r#"{"a": 1}"#), ("g", "{}")]), false);
        let mut p = CompletionParser::new(&tok, sp, false);
        let events: Vec<Event> = ids.iter().map(|&id| p.push(id).unwrap()).collect();
        let calls_at: Vec<usize> =
            events.iter().enumerate().filter(|(_, e)| **e == Event::Call).map(|(i, _)| i).collect();
        assert_eq!(calls_at.len(), 2);
        // The first call is known before the second call's element has begun.
        let second_open = ids.iter().enumerate().filter(|(_, &id)| id == sp.open).nth(3).unwrap().0;
        assert!(calls_at[0] < second_open, "{calls_at:?} {second_open}");
        assert_eq!(*events.last().unwrap(), Event::End);
    }

    #[test]
    fn markup_that_is_no_call_is_stray_and_nesting_breaks_are_errors() {
        let tok = tiny();
        let sp = Specials::of(&tok).unwrap();
        // Markup spelled out, its specials read as the added tokens they name.
        let ids = |text: &str| tok.encode_with_added(text).unwrap();
        let start = "<|close|>response<|sep|><|open|>tools<|sep|>";
        // A call without a tool name, then a good one.
        let bad = "<|open|>call index=\"1\"<|sep|><|close|>call<|sep|>";
        let good = "<|open|>call tool=\"f\" index=\"2\"<|sep|><|close|>call<|sep|>";
        let end = "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>";
        let c = parse(&tok, sp, false, &ids(&format!("{start}{bad}{good}{end}"))).unwrap();
        assert_eq!(c.stray_ids, ids(bad));
        assert_eq!(c.calls, [ParsedCall { name: "f".into(), arguments: "{}".into() }]);
        // A close tag naming another element; an end id inside the block.
        let broken = ids(&format!("{start}<|open|>call tool=\"f\"<|sep|><|close|>tools"));
        assert!(matches!(parse(&tok, sp, false, &broken), Err(ParseError::BadMarkup { .. })));
        let ended = ids(&format!("{start}<|end_of_msg|>"));
        assert!(matches!(parse(&tok, sp, false, &ended), Err(ParseError::ControlInPayload { .. })));
    }
}
