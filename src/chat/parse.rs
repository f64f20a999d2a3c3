//! Parsing a completion (the ids generated after the generation prompt) into reasoning and
//! content, one id at a time so a REPL can stream each channel as it comes (spec section 6).
//!
//! Grammar, thinking on: `REASONING <|close|>think<|sep|><|open|>response<|sep|> CONTENT
//! <|close|>response<|sep|><|close|>message<|sep|> END`, with END one of `<|end_of_msg|>` or
//! `[EOS]`; thinking off starts at CONTENT. Payloads are ordinary ids: any added id inside one is
//! an error. A tag's text is matched on its decoded bytes, not on particular ids, because the
//! model may spell `think` with other tokens than the encoder would.
#![forbid(unsafe_code)]

use super::calls::{BlockEvent, ParsedCall, ToolBlock};
use super::template::{Piece, Special, Specials};
use crate::exit::{Classify, ExitCode};
use crate::tokenizer::Tokenizer;

/// Why a completion does not follow the template.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    #[error("id {id} at completion position {at} is a control id inside the {channel}")]
    ControlInPayload { at: usize, id: u32, channel: &'static str },
    #[error("id {found} at completion position {at} breaks the closing markup (expected {expected})")]
    BadMarkup { at: usize, found: u32, expected: String },
    #[error("id {found} at completion position {at} follows the closed message; expected exactly one end id")]
    BadEnd { at: usize, found: u32 },
    #[error("id {found} at completion position {at} comes after the end of the message")]
    Trailing { at: usize, found: u32 },
    #[error("the completion stops before the end of the message")]
    Incomplete,
}

impl Classify for ParseError {
    fn exit_code(&self) -> ExitCode {
        ExitCode::Data
    }
}

/// Which payload an id belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Channel {
    Reasoning,
    Content,
}

impl Channel {
    fn name(self) -> &'static str {
        match self {
            Channel::Reasoning => "reasoning",
            Channel::Content => "content",
        }
    }
}

/// What one id was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    Payload(Channel),
    Markup,
    /// A tool call was read: the last of [`Completion::calls`].
    Call,
    /// Tool-call markup that is not a call was added to [`Completion::stray_ids`].
    Stray,
    /// The end id: the reply is complete.
    End,
}

#[derive(Clone, Copy, Debug)]
enum Step {
    Special(Special),
    Tag(&'static str),
}

/// The fixed markup between the parts of a reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Markup {
    /// `<|close|>think<|sep|><|open|>response<|sep|>`
    AfterReasoning,
    /// `<|close|>response<|sep|>`
    CloseResponse,
    /// `<|close|>message<|sep|>`
    CloseMessage,
}

impl Markup {
    fn steps(self) -> &'static [Step] {
        const AFTER_REASONING: [Step; 6] = [
            Step::Special(Special::Close),
            Step::Tag("think"),
            Step::Special(Special::Sep),
            Step::Special(Special::Open),
            Step::Tag("response"),
            Step::Special(Special::Sep),
        ];
        const CLOSE_RESPONSE: [Step; 3] =
            [Step::Special(Special::Close), Step::Tag("response"), Step::Special(Special::Sep)];
        const CLOSE_MESSAGE: [Step; 3] =
            [Step::Special(Special::Close), Step::Tag("message"), Step::Special(Special::Sep)];
        match self {
            Markup::AfterReasoning => &AFTER_REASONING,
            Markup::CloseResponse => &CLOSE_RESPONSE,
            Markup::CloseMessage => &CLOSE_MESSAGE,
        }
    }

    /// The markup still to come after this one to close the message.
    fn then(self) -> &'static [Markup] {
        match self {
            Markup::AfterReasoning => &[Markup::CloseResponse, Markup::CloseMessage],
            Markup::CloseResponse => &[Markup::CloseMessage],
            Markup::CloseMessage => &[],
        }
    }
}

enum Phase {
    Payload(Channel),
    /// Matching step `k` of fixed markup.
    Markup(Markup, usize),
    /// After the response element: `<|close|>` closes the message, `<|open|>` opens calls.
    AfterResponse,
    Tools(Box<ToolBlock>),
    AwaitEnd,
    Done,
}

/// A parsed completion.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Completion {
    pub reasoning_ids: Vec<u32>,
    pub content_ids: Vec<u32>,
    /// The tool calls, in the order the reply made them.
    pub calls: Vec<ParsedCall>,
    /// Tool-call markup that did not read as a call (a server returns it as content).
    pub stray_ids: Vec<u32>,
    /// Reached the end id.
    pub complete: bool,
}

/// An incremental parser of one completion.
pub struct CompletionParser<'t> {
    tok: &'t Tokenizer,
    sp: Specials,
    phase: Phase,
    /// Ids of the tag text being matched.
    tag: Vec<u32>,
    at: usize,
    failed: bool,
    out: Completion,
}

impl<'t> CompletionParser<'t> {
    /// A parser for a completion after the generation prompt of `thinking` (on: reasoning first).
    pub fn new(tok: &'t Tokenizer, sp: Specials, thinking: bool) -> CompletionParser<'t> {
        let channel = if thinking { Channel::Reasoning } else { Channel::Content };
        CompletionParser {
            tok,
            sp,
            phase: Phase::Payload(channel),
            tag: Vec::new(),
            at: 0,
            failed: false,
            out: Completion::default(),
        }
    }

    /// Takes the next id. After an error the parser refuses every further id with that error's
    /// position unchanged, and [`CompletionParser::closing`] closes from the current channel.
    pub fn push(&mut self, id: u32) -> Result<Event, ParseError> {
        let at = self.at;
        self.at += 1;
        let r = self.step_id(at, id);
        if r.is_err() {
            self.failed = true;
            self.tag.clear();
            self.phase = match std::mem::replace(&mut self.phase, Phase::Done) {
                Phase::Markup(Markup::AfterReasoning, _) => Phase::Payload(Channel::Reasoning),
                Phase::Markup(Markup::CloseResponse, _) => Phase::Payload(Channel::Content),
                Phase::Markup(Markup::CloseMessage, _) => Phase::AfterResponse,
                other => other,
            };
        }
        r
    }

    /// Whether the reply is inside its content (the part a response format constrains).
    pub fn in_content(&self) -> bool {
        matches!(self.phase, Phase::Payload(Channel::Content))
    }

    fn step_id(&mut self, at: usize, id: u32) -> Result<Event, ParseError> {
        if self.failed {
            return Err(ParseError::Trailing { at, found: id });
        }
        match &mut self.phase {
            Phase::Done => Err(ParseError::Trailing { at, found: id }),
            Phase::AwaitEnd if self.sp.end_ids().contains(&id) => {
                self.phase = Phase::Done;
                self.out.complete = true;
                Ok(Event::End)
            }
            Phase::AwaitEnd => Err(ParseError::BadEnd { at, found: id }),
            Phase::AfterResponse if id == self.sp.close => {
                self.phase = Phase::Markup(Markup::CloseMessage, 1);
                Ok(Event::Markup)
            }
            Phase::AfterResponse if id == self.sp.open => {
                self.phase = Phase::Tools(Box::new(ToolBlock::opened(id)));
                Ok(Event::Markup)
            }
            Phase::AfterResponse => {
                Err(ParseError::BadMarkup { at, found: id, expected: "<|close|> or <|open|>tools".into() })
            }
            Phase::Tools(block) => {
                let event = block.push(self.tok, &self.sp, at, id)?;
                self.out.calls.append(&mut block.calls);
                self.out.stray_ids.append(&mut block.stray);
                Ok(match event {
                    BlockEvent::Markup => Event::Markup,
                    BlockEvent::Call => Event::Call,
                    BlockEvent::Stray => Event::Stray,
                    BlockEvent::Closed => {
                        self.phase = Phase::Markup(Markup::CloseMessage, 0);
                        Event::Markup
                    }
                })
            }
            Phase::Payload(channel) => {
                let channel = *channel;
                if !self.sp.is_control(id) {
                    match channel {
                        Channel::Reasoning => self.out.reasoning_ids.push(id),
                        Channel::Content => self.out.content_ids.push(id),
                    }
                    return Ok(Event::Payload(channel));
                }
                if id != self.sp.close {
                    return Err(ParseError::ControlInPayload { at, id, channel: channel.name() });
                }
                let m = if channel == Channel::Reasoning { Markup::AfterReasoning } else { Markup::CloseResponse };
                self.phase = Phase::Markup(m, 1);
                Ok(Event::Markup)
            }
            Phase::Markup(m, k) => {
                let (m, k) = (*m, *k);
                self.markup(at, id, m, k)
            }
        }
    }

    /// Matches `id` against step `k` of markup `m`.
    fn markup(&mut self, at: usize, id: u32, m: Markup, k: usize) -> Result<Event, ParseError> {
        let steps = m.steps();
        match steps[k] {
            Step::Special(s) => {
                if id != self.sp.id(s) {
                    return Err(ParseError::BadMarkup { at, found: id, expected: s.spelling().to_owned() });
                }
            }
            Step::Tag(t) => {
                let text = self.tok.decode_bytes(&self.tag).unwrap_or_default();
                if !self.sp.is_control(id) {
                    self.tag.push(id);
                    let longer = self.tok.decode_bytes(&self.tag).unwrap_or_default();
                    if !t.as_bytes().starts_with(&longer) {
                        return Err(ParseError::BadMarkup { at, found: id, expected: format!("the tag {t:?}") });
                    }
                    return Ok(Event::Markup);
                }
                if text != t.as_bytes() {
                    return Err(ParseError::BadMarkup {
                        at,
                        found: id,
                        expected: format!("the rest of the tag {t:?}"),
                    });
                }
                self.tag.clear();
                // The tag is complete; this control id is matched by the next step.
                self.phase = Phase::Markup(m, k + 1);
                return self.markup(at, id, m, k + 1);
            }
        }
        self.phase = if k + 1 < steps.len() {
            Phase::Markup(m, k + 1)
        } else {
            match m {
                Markup::AfterReasoning => Phase::Payload(Channel::Content),
                Markup::CloseResponse => Phase::AfterResponse,
                Markup::CloseMessage => Phase::AwaitEnd,
            }
        };
        Ok(Event::Markup)
    }

    /// The pieces that close the message from here, so the transcript the model has seen stays
    /// well formed after a reply that stopped early (token limit, Ctrl-C, a parse error).
    pub fn closing(&self) -> Vec<Piece> {
        let mut out = Vec::new();
        let push_steps = |out: &mut Vec<Piece>, steps: &[Step], tag_done: &[u8]| {
            for (i, s) in steps.iter().enumerate() {
                match *s {
                    Step::Special(sp) => out.push(Piece::Special(sp)),
                    // Only the first step may be a partly typed tag: finish its text.
                    Step::Tag(t) if i == 0 => {
                        let rest = t.as_bytes().get(tag_done.len()..).unwrap_or_default();
                        if !rest.is_empty() {
                            out.push(Piece::Text(String::from_utf8_lossy(rest).into_owned()));
                        }
                    }
                    Step::Tag(t) => out.push(Piece::Text(t.to_owned())),
                }
            }
        };
        // The markup to close from, and its step reached (only a partly matched one is past 0).
        let from = match &self.phase {
            Phase::Done => return out,
            Phase::AwaitEnd => None,
            Phase::Payload(Channel::Reasoning) => Some((Markup::AfterReasoning, 0)),
            Phase::Payload(Channel::Content) => Some((Markup::CloseResponse, 0)),
            Phase::AfterResponse => Some((Markup::CloseMessage, 0)),
            Phase::Tools(block) => {
                out.extend(block.closing(self.tok));
                Some((Markup::CloseMessage, 0))
            }
            Phase::Markup(m, k) => Some((*m, *k)),
        };
        if let Some((m, k)) = from {
            let done = self.tok.decode_bytes(&self.tag).unwrap_or_default();
            push_steps(&mut out, &m.steps()[k..], &done);
            for next in m.then() {
                push_steps(&mut out, next.steps(), &[]);
            }
        }
        out.push(Piece::Special(Special::EndOfMsg));
        out
    }

    /// The ids of a tools block read so far that are neither a call nor stray yet (a reply cut
    /// inside a call: a server returns them as content).
    pub fn pending_tool_ids(&self) -> &[u32] {
        match &self.phase {
            Phase::Tools(block) => block.pending(),
            _ => &[],
        }
    }

    /// Whether the last id ended the message.
    pub fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    pub fn completion(&self) -> &Completion {
        &self.out
    }

    pub fn into_completion(self) -> Completion {
        self.out
    }
}

/// Parses a whole completion; it must reach its end id and stop there.
pub fn parse(tok: &Tokenizer, sp: Specials, thinking: bool, ids: &[u32]) -> Result<Completion, ParseError> {
    let mut p = CompletionParser::new(tok, sp, thinking);
    for &id in ids {
        p.push(id)?;
    }
    if !p.is_done() {
        return Err(ParseError::Incomplete);
    }
    Ok(p.into_completion())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::chat::template::{to_ids, Message};
    use crate::chat::test_support::{reply_ids as completion_ids, tiny};

    #[test]
    fn splits_reasoning_from_content() {
        let tok = tiny();
        let sp = Specials::of(&tok).unwrap();
        let m = Message::assistant(Some("Let me think."), "The answer is 42.");
        let c = parse(&tok, sp, true, &completion_ids(&tok, sp, &m, true)).unwrap();
        assert_eq!(tok.decode(&c.reasoning_ids).unwrap(), "Let me think.");
        assert_eq!(tok.decode(&c.content_ids).unwrap(), "The answer is 42.");
        assert!(c.complete);
        let c = parse(&tok, sp, false, &completion_ids(&tok, sp, &m, false)).unwrap();
        assert!(c.reasoning_ids.is_empty());
        assert_eq!(tok.decode(&c.content_ids).unwrap(), "The answer is 42.");
    }

    #[test]
    fn eos_also_ends_and_a_second_end_is_trailing() {
        let tok = tiny();
        let sp = Specials::of(&tok).unwrap();
        let mut ids = completion_ids(&tok, sp, &Message::assistant(Some("r"), "c"), true);
        *ids.last_mut().unwrap() = sp.eos;
        parse(&tok, sp, true, &ids).unwrap();
        ids.push(sp.end_of_msg);
        assert!(matches!(parse(&tok, sp, true, &ids), Err(ParseError::Trailing { .. })));
    }

    #[test]
    fn control_ids_inside_payloads_are_errors() {
        let tok = tiny();
        let sp = Specials::of(&tok).unwrap();
        let mut ids = tok.encode("abc").unwrap();
        ids.push(sp.open);
        let err = parse(&tok, sp, true, &ids).unwrap_err();
        assert_eq!(err, ParseError::ControlInPayload { at: 3, id: sp.open, channel: "reasoning" });
        assert_eq!(err.exit_code(), ExitCode::Data);
        let reserved = 600;
        assert!(matches!(
            parse(&tok, sp, false, &[reserved]),
            Err(ParseError::ControlInPayload { channel: "content", .. })
        ));
        // The end id straight inside the content, without the closing markup.
        assert!(matches!(parse(&tok, sp, false, &[sp.end_of_msg]), Err(ParseError::ControlInPayload { .. })));
    }

    #[test]
    fn wrong_markup_and_missing_end_are_errors() {
        let tok = tiny();
        let sp = Specials::of(&tok).unwrap();
        let mut ids = vec![sp.close];
        ids.extend(tok.encode("thing").unwrap());
        assert!(matches!(parse(&tok, sp, true, &ids), Err(ParseError::BadMarkup { .. })));
        let mut ids = completion_ids(&tok, sp, &Message::assistant(None, "c"), false);
        *ids.last_mut().unwrap() = tok.encode("x").unwrap()[0];
        assert!(matches!(parse(&tok, sp, false, &ids), Err(ParseError::BadEnd { .. })));
        ids.pop();
        assert_eq!(parse(&tok, sp, false, &ids), Err(ParseError::Incomplete));
    }

    #[test]
    fn closing_after_any_cut_makes_a_whole_message() {
        let tok = tiny();
        let sp = Specials::of(&tok).unwrap();
        let call = |name: &str, arguments: &str| crate::chat::tools::ToolCall {
            id: None,
            name: name.into(),
            arguments: arguments.into(),
        };
        let calls = vec![call("f", r#"{"a": "x", "b": [1]}"#), call("g", "[2]")];
        let with_calls = Message { tool_calls: calls, ..Message::assistant(Some("why"), "so") };
        for (thinking, m) in [true, false]
            .into_iter()
            .flat_map(|t| [(t, Message::assistant(Some("why"), "so")), (t, with_calls.clone())])
        {
            let ids = completion_ids(&tok, sp, &m, thinking);
            for cut in 0..=ids.len() {
                let mut p = CompletionParser::new(&tok, sp, thinking);
                for &id in &ids[..cut] {
                    p.push(id).unwrap();
                }
                let mut all = ids[..cut].to_vec();
                all.extend(to_ids(&p.closing(), &tok, &sp).unwrap());
                let c = parse(&tok, sp, thinking, &all).unwrap_or_else(|e| panic!("cut {cut}: {e}"));
                assert!(c.complete);
                if cut == ids.len() {
                    assert_eq!(all, ids, "nothing to close");
                }
            }
        }
    }

    #[test]
    fn closing_after_an_error_starts_from_the_channel() {
        let tok = tiny();
        let sp = Specials::of(&tok).unwrap();
        let mut p = CompletionParser::new(&tok, sp, true);
        p.push(tok.encode("a").unwrap()[0]).unwrap();
        assert!(p.push(sp.open).is_err());
        assert!(p.push(tok.encode("b").unwrap()[0]).is_err(), "refuses after an error");
        let text = crate::chat::template::to_text(&p.closing());
        assert_eq!(
            text,
            "<|close|>think<|sep|><|open|>response<|sep|><|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
        );
    }
}
