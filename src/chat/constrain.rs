//! Constrained decoding of chat replies (docs/SERVE.md "Structured output"): a grammar of the
//! whole reply after the generation prompt, compiled by llguidance against the K3 tokenizer,
//! masks each step's logits so that only replies valid for the request can be sampled.
//!
//! - `response_format` `json_schema` / `json_object`: the response is JSON for the schema
//!   (compact: no whitespace between tokens), then the message closes.
//! - `tool_choice` `required` or a named function: the response is empty (or the JSON above)
//!   and one or more calls follow, each a declared tool (the named one) with its arguments in a
//!   JSON block valid for the tool's `parameters`.
//! - `tool_choice` `none` with tools declared: the response is free text and no call follows.
//!
//! With thinking on, the reasoning before the response is free (any text, no markup), as vLLM
//! and llama.cpp leave a reasoning model's thinking unconstrained; the constraint starts to
//! bind where the reasoning closes. The mask is a function of the reply's ids alone.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Instant;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

use super::template::Specials;
use super::tools::{function_name, ResponseFormat, ToolChoice, ToolOptions};
use crate::engine::{Constraint, TokenConstraint};
use crate::exit::{Classify, ExitCode};
use crate::tokenizer::Tokenizer;

/// Why a constraint could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ConstrainError {
    #[error("the tokenizer cannot be used for constrained decoding: {0}")]
    Tokenizer(String),
    #[error("{0}")]
    Grammar(String),
}

impl Classify for ConstrainError {
    fn exit_code(&self) -> ExitCode {
        match self {
            ConstrainError::Tokenizer(_) => ExitCode::Data,
            ConstrainError::Grammar(_) => ExitCode::Usage,
        }
    }
}

/// The K3 vocabulary as llguidance sees it: ordinary ids are their bytes, added tokens are
/// 0xFF followed by their spelling, ids without a token are empty (never allowed).
struct K3Env {
    trie: TokTrie,
    tok: Tokenizer,
}

impl TokenizerEnv for K3Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Bytes the grammar forces, as the tokenizer would encode them (llguidance then forces
    /// those ids); a tail that ends inside a character is matched greedily.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let valid = match std::str::from_utf8(s) {
            Ok(_) => s.len(),
            Err(e) => e.valid_up_to(),
        };
        let text = std::str::from_utf8(&s[..valid]).unwrap_or_default();
        let mut out = self.tok.encode(text).unwrap_or_else(|_| self.trie.greedy_tokenize(&s[..valid]));
        out.extend(self.trie.greedy_tokenize(&s[valid..]));
        out
    }
}

/// Compiles reply grammars for one model (the vocabulary's trie is built once).
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    /// For a model of `vocab_size` ids (at least the tokenizer's); replies end with
    /// `<|end_of_msg|>`.
    pub fn new(tok: &Tokenizer, sp: &Specials, vocab_size: usize) -> Result<Grammars, ConstrainError> {
        let words: Vec<Vec<u8>> = (0..vocab_size as u32)
            .map(|id| match tok.token_bytes(id) {
                Ok(b) if tok.is_special(id) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(b);
                    w
                }
                Ok(b) => b.to_vec(),
                Err(_) => Vec::new(),
            })
            .collect();
        let info = TokRxInfo::new(words.len() as u32, sp.end_of_msg);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&[sp.end_of_msg]);
        let env: TokEnv = Arc::new(K3Env { trie, tok: tok.clone() });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| ConstrainError::Tokenizer(e.to_string()))?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// The constraint of a request's reply, or `None` when it asks for none.
    pub fn constraint(
        &self,
        o: &ToolOptions,
        thinking: bool,
    ) -> Result<Option<Box<dyn TokenConstraint>>, ConstrainError> {
        reply_grammar(o, thinking).map(|lark| self.compile(lark)).transpose()
    }

    /// The constraint of a reply grammar ([`reply_grammar`]).
    fn compile(&self, lark: String) -> Result<Box<dyn TokenConstraint>, ConstrainError> {
        let parser = self.factory.create_parser(TopLevelGrammar::from_lark(lark)).map_err(|e| {
            // llguidance appends a parser dump: the first line says what is wrong.
            let e = e.to_string();
            let first = e.lines().next().unwrap_or_default();
            ConstrainError::Grammar(format!("the schema cannot be used to constrain the reply: {first}"))
        })?;
        Ok(Box::new(GrammarConstraint {
            matcher: Matcher::new(Ok(parser)),
            end: self.factory.tok_env().tok_trie().eos_token(),
            bits: Vec::new(),
            seconds: 0.0,
        }))
    }
}

/// The constraint of a reply, or `None` when the request asks for none. The vocabulary's tables
/// are made into `grammars` at the first reply that needs them (a fraction of a second at K3's
/// vocabulary), and kept for the others.
pub fn reply_constraint(
    grammars: &mut Option<Grammars>,
    tok: &Tokenizer,
    sp: &Specials,
    vocab_size: usize,
    o: &ToolOptions,
    thinking: bool,
) -> Result<Option<Constraint>, ConstrainError> {
    let Some(lark) = reply_grammar(o, thinking) else { return Ok(None) };
    if grammars.is_none() {
        let t = Instant::now();
        *grammars = Some(Grammars::new(tok, sp, vocab_size)?);
        tracing::info!("constrained decoding: the vocabulary's tables took {:.2} s", t.elapsed().as_secs_f64());
    }
    let Some(g) = grammars else { return Ok(None) };
    Ok(Some(Constraint::new(g.compile(lark)?)))
}

/// What constrained replies' masks cost against a run's seconds, as a summary says it.
pub fn cost_line(mask_seconds: f64, run_seconds: f64) -> String {
    let share = 100.0 * mask_seconds / run_seconds.max(1e-9);
    format!("constrained replies: their masks took {mask_seconds:.3} s of the {run_seconds:.2} s run ({share:.2}%)")
}

/// A JSON schema made compact (no whitespace between tokens: a model left free there may
/// never stop writing spaces).
fn compact_schema(schema: &Value) -> String {
    let mut s = schema.clone();
    if let Some(o) = s.as_object_mut() {
        let x = o.entry("x-guidance").or_insert_with(|| json!({}));
        if let Some(x) = x.as_object_mut() {
            x.insert("whitespace_flexible".into(), Value::Bool(false));
        }
    }
    s.to_string()
}

/// A lark string literal of `text`.
fn lit(text: &str) -> String {
    // JSON escapes all but DEL, which a lark string may not hold raw.
    serde_json::to_string(text).unwrap_or_default().replace('\u{7f}', "\\u007f")
}

/// Calls a reply forced by `tool_choice: "required"` may make at most.
const MAX_FORCED_CALLS: usize = 8;

/// The lark grammar of a whole reply, or `None` when nothing constrains it.
pub fn reply_grammar(o: &ToolOptions, thinking: bool) -> Option<String> {
    let schema = match &o.format {
        ResponseFormat::Text => None,
        ResponseFormat::JsonObject => Some(json!({"type": "object"})),
        ResponseFormat::JsonSchema(s) => Some(s.clone()),
    };
    let forced: Vec<&Value> = match &o.choice {
        ToolChoice::Required => o.tools.iter().collect(),
        ToolChoice::Function(name) => o.tools.iter().filter(|t| function_name(t) == Some(name)).collect(),
        ToolChoice::Auto | ToolChoice::None => Vec::new(),
    };
    // `none` with tools declared: the reply may not call them (the release only asks).
    let no_calls = o.choice == ToolChoice::None && !o.tools.is_empty();
    if schema.is_none() && forced.is_empty() && !no_calls {
        return None;
    }
    let mut rules = Vec::new();
    let mut start = String::from("start: ");
    if thinking {
        start.push_str("THINK <|close|> \"think\" <|sep|> <|open|> \"response\" <|sep|> ");
        rules.push("THINK: /(.|\\n)*/".to_owned());
    }
    // Who may be called: the forced tools; with a schema and `auto`, any declared tool instead
    // of the JSON (as OpenAI lets a structured reply call tools).
    let auto = o.choice == ToolChoice::Auto;
    let callable: Vec<&Value> =
        if forced.is_empty() && auto && schema.is_some() { o.tools.iter().collect() } else { forced.clone() };
    let once = matches!(o.choice, ToolChoice::Function(_));
    let block = (!callable.is_empty()).then(|| tools_block(&mut rules, &callable, once));
    if let Some(s) = &schema {
        rules.push(format!("answer: %json {}", compact_schema(s)));
    }
    const CLOSE: &str = "<|close|> \"response\" <|sep|>";
    let body = match (&schema, block) {
        (Some(_), Some(b)) if forced.is_empty() => format!("(answer {CLOSE} | {CLOSE} {b})"),
        (Some(_), Some(b)) => format!("answer {CLOSE} {b}"),
        (Some(_), None) => format!("answer {CLOSE}"),
        (None, Some(b)) => format!("{CLOSE} {b}"),
        (None, None) => {
            rules.push("TEXT: /(.|\\n)*/".to_owned());
            format!("TEXT {CLOSE}")
        }
    };
    start.push_str(&body);
    start.push_str(" <|close|> \"message\" <|sep|>");
    rules.insert(0, start);
    Some(rules.join("\n") + "\n")
}

/// The tools block of calls to `tools` (rules into `rules`): one call when `once`, else one to
/// [`MAX_FORCED_CALLS`], numbered as the release numbers them.
fn tools_block(rules: &mut Vec<String>, tools: &[&Value], once: bool) -> String {
    let most = if once { 1 } else { MAX_FORCED_CALLS };
    let mut bodies = Vec::new();
    for (k, tool) in tools.iter().enumerate() {
        let params = tool["function"].get("parameters").filter(|p| p.is_object()).cloned().unwrap_or(json!({}));
        let args = match argument_rules(k, &params, rules) {
            Some(elements) => elements,
            None => {
                rules.push(format!("args_{k}: %json {}", compact_schema(&params)));
                format!("<|open|> \"json type=\\\"object\\\"\" <|sep|> args_{k} <|close|> \"json\" <|sep|>")
            }
        };
        bodies.push(args);
    }
    for n in 1..=most {
        let more = if n < most { format!(" calls_{}?", n + 1) } else { String::new() };
        let any: Vec<String> = (0..tools.len()).map(|k| format!("call_{n}_{k}")).collect();
        rules.push(format!("calls_{n}: ({}){more}", any.join(" | ")));
        for (k, tool) in tools.iter().enumerate() {
            rules.push(format!(
                "call_{n}_{k}: <|open|> {} <|sep|> {} <|close|> \"call\" <|sep|>",
                lit(&format!("call tool=\"{}\" index=\"{n}\"", attr(function_name(tool).unwrap_or_default()))),
                bodies[k]
            ));
        }
    }
    "<|open|> \"tools\" <|sep|> calls_1 <|close|> \"tools\" <|sep|>".to_owned()
}

/// An attribute value as the release escapes it.
fn attr(v: &str) -> String {
    v.replace('&', "&amp;").replace('"', "&quot;")
}

/// A call's arguments as the release writes an object's: one `argument` element per property,
/// the required ones always and the others optionally, in the schema's order; a string as its
/// raw text, any other value as JSON for its schema. `None` when raw text cannot follow the
/// schema (a string's `pattern` or `format`, a property of no single type, a required key with
/// no property): the call then takes a JSON block.
fn argument_rules(k: usize, params: &Value, rules: &mut Vec<String>) -> Option<String> {
    let empty = serde_json::Map::new();
    let props = match params.get("properties") {
        None => &empty,
        Some(Value::Object(p)) => p,
        Some(_) => return None,
    };
    let required: Vec<&str> = params
        .get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if required.iter().any(|r| !props.contains_key(*r)) {
        return None;
    }
    let mut seq = Vec::new();
    for (j, (key, p)) in props.iter().enumerate() {
        let (kind, value) = argument_value(p)?;
        let value = match value {
            Value::String(rule) => rule,
            _ => return None,
        };
        rules.push(format!("val_{k}_{j}: {value}"));
        let tag = lit(&format!("argument key=\"{}\" type=\"{kind}\"", attr(key)));
        rules.push(format!("arg_{k}_{j}: <|open|> {tag} <|sep|> val_{k}_{j} <|close|> \"argument\" <|sep|>"));
        seq.push(if required.contains(&key.as_str()) { format!("arg_{k}_{j}") } else { format!("arg_{k}_{j}?") });
    }
    Some(seq.join(" "))
}

/// One property: its `type` attribute and the lark of its text (as a JSON string value).
fn argument_value(p: &Value) -> Option<(&'static str, Value)> {
    let json_of = |p: &Value| Value::String(format!("%json {}", compact_schema(p)));
    let strings: Option<Vec<&str>> =
        p.get("enum").and_then(Value::as_array).map(|e| e.iter().filter_map(Value::as_str).collect());
    let enum_len = p.get("enum").and_then(Value::as_array).map(Vec::len);
    let kind = match p.get("type").and_then(Value::as_str) {
        Some(t) => t,
        None if strings.as_ref().is_some_and(|s| Some(s.len()) == enum_len) => "string",
        None => return None,
    };
    Some(match kind {
        "string" if p.get("pattern").is_some() || p.get("format").is_some() => return None,
        // An empty string is no text at all, which a lark literal cannot spell: a JSON block.
        "string" => match (strings, p.get("const").and_then(Value::as_str)) {
            (_, Some(c)) if !c.is_empty() => ("string", Value::String(lit(c))),
            (_, Some(_)) => return None,
            (Some(options), None) if Some(options.len()) == enum_len && options.iter().all(|o| !o.is_empty()) => {
                let alts: Vec<String> = options.iter().map(|o| lit(o)).collect();
                ("string", Value::String(format!("({})", alts.join(" | "))))
            }
            (Some(_), None) => return None,
            (None, None) => {
                let min = p.get("minLength").and_then(Value::as_u64).unwrap_or(0);
                let max = p.get("maxLength").and_then(Value::as_u64);
                let reps = match max {
                    Some(max) if max >= min.max(1) && max <= 4096 => format!("{{{},{max}}}", min.max(1)),
                    Some(_) => return None,
                    None => format!("{{{},}}", min.max(1)),
                };
                let text = format!("/(.|\\n){reps}/");
                ("string", Value::String(if min == 0 { format!("({text})?") } else { text }))
            }
        },
        "integer" | "number" => ("number", json_of(p)),
        "boolean" => ("boolean", json_of(p)),
        "null" => ("null", json_of(p)),
        "array" => ("array", json_of(p)),
        "object" => ("object", json_of(p)),
        _ => return None,
    })
}

/// A compiled reply grammar's state.
struct GrammarConstraint {
    matcher: Matcher,
    /// `<|end_of_msg|>`: the one id once the grammar is complete.
    end: TokenId,
    bits: Vec<u32>,
    seconds: f64,
}

impl TokenConstraint for GrammarConstraint {
    fn mask(&mut self) -> Result<Option<&[u32]>, String> {
        if self.matcher.is_stopped() {
            // The grammar is complete (llguidance stops there): the message ends.
            self.bits.clear();
            self.bits.resize(self.end as usize / 32 + 1, 0);
            self.bits[self.end as usize / 32] |= 1 << (self.end % 32);
            return Ok(Some(&self.bits));
        }
        let t = Instant::now();
        let mask = self.matcher.compute_mask().map_err(|e| format!("the output constraint failed: {e}"));
        self.seconds += t.elapsed().as_secs_f64();
        let mask = mask?;
        self.bits.clear();
        self.bits.extend_from_slice(mask.as_slice());
        Ok(Some(&self.bits))
    }

    fn commit(&mut self, id: u32) -> Result<(), String> {
        if self.matcher.is_stopped() && id == self.end {
            return Ok(());
        }
        let t = Instant::now();
        let r = self.matcher.consume_token(id).map_err(|e| format!("the output constraint refused token {id}: {e}"));
        self.seconds += t.elapsed().as_secs_f64();
        r.map(|_| ())
    }

    fn seconds(&self) -> f64 {
        self.seconds
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::*;
    use crate::chat::parse::parse;
    use crate::chat::test_support::tiny;
    use crate::engine::constraint::{choose_masked, Constraint};
    use crate::engine::sampling::{sample, Sampling};
    use crate::rng::SplitMix64;

    /// A reply sampled from random logits under the constraint, up to its end id.
    fn sample_reply(g: &Grammars, o: &ToolOptions, thinking: bool, seed: u64, sp: &Specials) -> Vec<u32> {
        let c = Constraint::new(g.constraint(o, thinking).unwrap().unwrap());
        let mut rng = SplitMix64::new(seed);
        let s = Sampling { temperature: 1.0, top_k: None, top_p: None, seed };
        let (mut scratch, mut candidates, mut ids) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..3000 {
            // Random logits that favour closing brackets and quotes a little, and the markup
            // that ends the reasoning, so that replies end in a test's time.
            let logits: Vec<f32> =
                (0..768).map(|i| (rng.next_f64() * 4.0) as f32 + if i == 516 { 2.0 } else { 0.0 }).collect();
            let mut pick_rng = SplitMix64::new(rng.next_f64().to_bits());
            let id =
                choose_masked(&c, &logits, &mut scratch, |l| sample(l, &s, &mut pick_rng, &mut candidates)).unwrap();
            ids.push(id);
            if id == sp.end_of_msg {
                return ids;
            }
        }
        panic!("seed {seed}: no end in 3000 tokens: {ids:?}");
    }

    #[test]
    fn json_schema_replies_parse_and_match_the_schema() {
        let tok = tiny();
        let sp = Specials::of(&tok).unwrap();
        let g = Grammars::new(&tok, &sp, 768).unwrap();
        let schema = json!({
            "type": "object",
            "properties": {
                "ok": {"type": "boolean"},
                "kind": {"enum": ["a", "bb", "c"]},
                "n": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["ok", "kind", "n"],
            "additionalProperties": false,
        });
        let o = ToolOptions { format: ResponseFormat::JsonSchema(schema), ..ToolOptions::default() };
        for (seed, thinking) in (0..6).map(|s| (s, s % 2 == 0)) {
            let ids = sample_reply(&g, &o, thinking, seed, &sp);
            let c = parse(&tok, sp, thinking, &ids).unwrap();
            let v: Value = serde_json::from_str(&tok.decode(&c.content_ids).unwrap()).unwrap();
            assert!(v["ok"].is_boolean() && ["a", "bb", "c"].contains(&v["kind"].as_str().unwrap()), "{v}");
            assert!((0..=99).contains(&v["n"].as_i64().unwrap()), "{v}");
            assert_eq!(v.as_object().unwrap().len(), 3);
        }
    }

    #[test]
    fn a_forced_call_names_a_declared_tool_with_valid_arguments() {
        let tok = tiny();
        let sp = Specials::of(&tok).unwrap();
        let g = Grammars::new(&tok, &sp, 768).unwrap();
        let tool = |name: &str| {
            json!({"type": "function", "function": {"name": name, "parameters": {
                "type": "object",
                "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                "required": ["unit", "days"], "additionalProperties": false}}})
        };
        let tools = vec![tool("get_weather"), tool("other")];
        for choice in [ToolChoice::Required, ToolChoice::Function("other".into())] {
            let o = ToolOptions { tools: tools.clone(), choice: choice.clone(), ..ToolOptions::default() };
            for seed in 0..4 {
                let ids = sample_reply(&g, &o, false, seed, &sp);
                // Written as the release writes an object's arguments: argument elements.
                let text = tok.decode_or_mark(&ids, true);
                assert!(text.contains("<|open|>argument key=\"unit\" type=\"string\"<|sep|>"), "{text}");
                let c = parse(&tok, sp, false, &ids).unwrap();
                assert!(!c.calls.is_empty() && c.stray_ids.is_empty(), "{c:?}");
                for call in &c.calls {
                    if choice != ToolChoice::Required {
                        assert_eq!(
                            (call.name.as_str(), c.calls.len()),
                            ("other", 1),
                            "a named function is called once"
                        );
                    }
                    let v: Value = serde_json::from_str(&call.arguments).unwrap();
                    assert!(["c", "f"].contains(&v["unit"].as_str().unwrap()), "{v}");
                }
            }
        }
        assert!(
            reply_grammar(&ToolOptions { tools: tools.clone(), ..ToolOptions::default() }, true).is_none(),
            "auto binds nothing"
        );
        // A string with a pattern cannot be raw text under a grammar: that tool takes a JSON block.
        let patterned = json!({"type": "function", "function": {"name": "p", "parameters": {"type": "object",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["code"], "additionalProperties": false}}});
        let o = ToolOptions { tools: vec![patterned], choice: ToolChoice::Required, ..ToolOptions::default() };
        let ids = sample_reply(&g, &o, false, 1, &sp);
        assert!(tok.decode_or_mark(&ids, true).contains("<|open|>json type=\"object\"<|sep|>"));
        let c = parse(&tok, sp, false, &ids).unwrap();
        let code: Value = serde_json::from_str(&c.calls[0].arguments).unwrap();
        assert!(
            code["code"].as_str().is_some_and(|s| s.len() == 3 && s.chars().all(|ch| ch.is_ascii_uppercase())),
            "{code}"
        );
        // A schema with tools left to `auto`: JSON, or calls instead.
        let o = ToolOptions {
            tools: tools.clone(),
            format: ResponseFormat::JsonSchema(
                json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": false}),
            ),
            ..ToolOptions::default()
        };
        for seed in 0..6 {
            let c = parse(&tok, sp, false, &sample_reply(&g, &o, false, seed, &sp)).unwrap();
            let json_reply = serde_json::from_str::<Value>(&tok.decode(&c.content_ids).unwrap()).is_ok();
            assert!(json_reply == c.calls.is_empty(), "JSON or calls, not both: {c:?}");
        }
        // `none`: free text, then the message closes without calls.
        let o = ToolOptions { tools, choice: ToolChoice::None, ..ToolOptions::default() };
        for seed in 0..3 {
            let c = parse(&tok, sp, false, &sample_reply(&g, &o, false, seed, &sp)).unwrap();
            assert!(c.calls.is_empty() && c.stray_ids.is_empty() && c.complete, "{c:?}");
        }
    }
}
