//! JSON as the release's encoder writes and reads it (Python's `json`), where the model sees
//! the bytes: tool declarations and response schemas are written compactly with every object's
//! keys sorted and Python's float layout (`1e-05`, `100.0`); an assistant's `arguments` string
//! is read one level deep, keeping each non-string value's exact source text (`350.50` stays
//! `350.50`), with Python's lenient strings (raw control characters) and `NaN`/`Infinity`.
#![forbid(unsafe_code)]

use serde_json::Value;

/// The compact form: separators `,` and `:`, non-ASCII as is, keys sorted at every depth.
pub fn compact_sorted(v: &Value) -> String {
    let mut out = String::new();
    write_compact(v, &mut out, Layout::COMPACT_SORTED);
    out
}

/// Python's default `json.dumps`: separators `, ` and `: `, keys in their order (as given).
pub fn python_default(v: &Value) -> String {
    let mut out = String::new();
    write_compact(v, &mut out, Layout::DEFAULT);
    out
}

#[derive(Clone, Copy)]
struct Layout {
    item: &'static str,
    key: &'static str,
    sorted: bool,
}

impl Layout {
    const COMPACT_SORTED: Layout = Layout { item: ",", key: ":", sorted: true };
    const DEFAULT: Layout = Layout { item: ", ", key: ": ", sorted: false };
}

fn write_compact(v: &Value, out: &mut String, layout: Layout) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => out.push_str(&i.to_string()),
            (None, Some(u), _) => out.push_str(&u.to_string()),
            (None, None, Some(f)) => out.push_str(&python_float(f)),
            (None, None, None) => out.push_str(&n.to_string()),
        },
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(layout.item);
                }
                write_compact(item, out, layout);
            }
            out.push(']');
        }
        Value::Object(map) => {
            // Rust orders strings by UTF-8 bytes, which is Python's code point order; unsorted,
            // the map keeps the order the keys came in (serde_json's `preserve_order`).
            let mut keys: Vec<&String> = map.keys().collect();
            if layout.sorted {
                keys.sort();
            }
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(layout.item);
                }
                write_string(k, out);
                out.push_str(layout.key);
                write_compact(&map[k], out, layout);
            }
            out.push('}');
        }
    }
}

/// A JSON string as Python writes it with `ensure_ascii` off.
pub fn write_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python's `repr` of a float: the shortest digits that read back, positional for decimal
/// exponents -4..16 (always with a fraction), scientific with a signed two-digit exponent
/// otherwise.
pub fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` gives the shortest round-trip digits: `-3.505e2`, `1e-5`, `0e0`.
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    if (-4..16).contains(&exp) {
        let n = digits.len() as i32;
        let body = if exp >= 0 {
            let int_len = (exp + 1) as usize;
            if n <= exp + 1 {
                format!("{digits}{}.0", "0".repeat(int_len - digits.len()))
            } else {
                format!("{}.{}", &digits[..int_len], &digits[int_len..])
            }
        } else {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        };
        format!("{sign}{body}")
    } else {
        let m = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{m}e{esign}{:02}", exp.abs())
    }
}

/// The JSON type of an argument value, as the `type` attribute names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ArgType {
    String,
    Number,
    Boolean,
    Null,
    Array,
    Object,
}

impl ArgType {
    pub fn name(self) -> &'static str {
        match self {
            ArgType::String => "string",
            ArgType::Number => "number",
            ArgType::Boolean => "boolean",
            ArgType::Null => "null",
            ArgType::Array => "array",
            ArgType::Object => "object",
        }
    }

    pub fn parse(name: &str) -> Option<ArgType> {
        Some(match name {
            "string" => ArgType::String,
            // `integer` is not written by the release; a model may still say it.
            "number" | "integer" => ArgType::Number,
            "boolean" => ArgType::Boolean,
            "null" => ArgType::Null,
            "array" => ArgType::Array,
            "object" => ArgType::Object,
            _ => return None,
        })
    }
}

/// One top-level argument: its key, type and text (a string decoded, anything else verbatim).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Argument {
    pub key: String,
    pub kind: ArgType,
    pub text: String,
}

/// Reads an `arguments` string one level deep, as the release does. `None` means "not an
/// object": the caller writes the string verbatim as a JSON block. Everything after the
/// closing brace is ignored, duplicate keys are kept, `{}` has no arguments.
pub fn scan_arguments(s: &str) -> Option<Vec<Argument>> {
    let mut r = Reader { b: s.as_bytes(), s, at: 0 };
    r.ws();
    r.eat(b'{')?;
    r.ws();
    let mut out = Vec::new();
    if r.peek()? == b'}' {
        return Some(out);
    }
    loop {
        let (kind, key) = r.value()?;
        if kind != ArgType::String {
            return None;
        }
        let key = key.unwrap_or_default();
        r.ws();
        r.eat(b':')?;
        r.ws();
        let start = r.at;
        let (kind, decoded) = r.value()?;
        let text = decoded.unwrap_or_else(|| s[start..r.at].to_owned());
        out.push(Argument { key, kind, text });
        r.ws();
        let c = r.peek()?;
        r.at += 1;
        r.ws();
        match c {
            b'}' => return Some(out),
            b',' => {}
            _ => return None,
        }
    }
}

/// A byte reader over Python's JSON grammar (non-strict strings, NaN and the infinities).
struct Reader<'a> {
    b: &'a [u8],
    s: &'a str,
    at: usize,
}

impl Reader<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.at).copied()
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        (self.peek()? == c).then(|| self.at += 1)
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    fn word(&mut self, w: &str) -> bool {
        let hit = self.s[self.at..].starts_with(w);
        if hit {
            self.at += w.len();
        }
        hit
    }

    /// One value: its type, and for a string its decoded text.
    fn value(&mut self) -> Option<(ArgType, Option<String>)> {
        Some(match self.peek()? {
            b'"' => (ArgType::String, Some(self.string()?)),
            b'{' => {
                self.container(b'}', true)?;
                (ArgType::Object, None)
            }
            b'[' => {
                self.container(b']', false)?;
                (ArgType::Array, None)
            }
            _ if self.word("null") => (ArgType::Null, None),
            _ if self.word("true") || self.word("false") => (ArgType::Boolean, None),
            _ if self.word("NaN") || self.word("Infinity") || self.word("-Infinity") => (ArgType::Number, None),
            _ => {
                self.number()?;
                (ArgType::Number, None)
            }
        })
    }

    /// `-?(0|[1-9]\d*)(\.\d+)?([eE][-+]?\d+)?`
    fn number(&mut self) -> Option<()> {
        let digits = |r: &mut Self| {
            let from = r.at;
            while r.peek().is_some_and(|c| c.is_ascii_digit()) {
                r.at += 1;
            }
            r.at > from
        };
        if self.peek() == Some(b'-') {
            self.at += 1;
        }
        match self.peek()? {
            b'0' => self.at += 1,
            b'1'..=b'9' => {
                digits(self);
            }
            _ => return None,
        }
        let back = self.at;
        if self.peek() == Some(b'.') {
            self.at += 1;
            if !digits(self) {
                self.at = back;
            }
        }
        let back = self.at;
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.at += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.at += 1;
            }
            if !digits(self) {
                self.at = back;
            }
        }
        Some(())
    }

    fn string(&mut self) -> Option<String> {
        self.eat(b'"')?;
        let mut out = String::new();
        loop {
            let rest = &self.s[self.at..];
            let stop = rest.find(['"', '\\'])?;
            out.push_str(&rest[..stop]);
            self.at += stop;
            if self.peek()? == b'"' {
                self.at += 1;
                return Some(out);
            }
            self.at += 1;
            let e = self.peek()?;
            self.at += 1;
            out.push(match e {
                b'"' => '"',
                b'\\' => '\\',
                b'/' => '/',
                b'b' => '\u{8}',
                b'f' => '\u{c}',
                b'n' => '\n',
                b'r' => '\r',
                b't' => '\t',
                b'u' => self.unicode_escape()?,
                _ => return None,
            });
        }
    }

    fn hex4(&mut self) -> Option<u32> {
        let h = self.s.get(self.at..self.at + 4)?;
        if !h.bytes().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        self.at += 4;
        u32::from_str_radix(h, 16).ok()
    }

    /// After `\u`: a code point, joining a surrogate pair. A lone surrogate has no Rust string,
    /// so it makes the arguments "not an object" (written verbatim).
    fn unicode_escape(&mut self) -> Option<char> {
        let hi = self.hex4()?;
        if (0xd800..0xdc00).contains(&hi) && self.s[self.at..].starts_with("\\u") {
            let back = self.at;
            self.at += 2;
            let lo = self.hex4()?;
            if (0xdc00..0xe000).contains(&lo) {
                return char::from_u32(0x10000 + ((hi - 0xd800) << 10) + (lo - 0xdc00));
            }
            self.at = back;
        }
        char::from_u32(hi)
    }

    /// An array or object (checked, not kept: its source text is the value).
    fn container(&mut self, close: u8, object: bool) -> Option<()> {
        self.at += 1;
        self.ws();
        if self.peek()? == close {
            self.at += 1;
            return Some(());
        }
        loop {
            if object {
                if self.peek()? != b'"' {
                    return None;
                }
                self.string()?;
                self.ws();
                self.eat(b':')?;
                self.ws();
            }
            self.value()?;
            self.ws();
            let c = self.peek()?;
            self.at += 1;
            if c == close {
                return Some(());
            }
            if c != b',' {
                return None;
            }
            self.ws();
        }
    }
}

/// OpenAI `arguments` (a JSON object's text) from parsed argument elements: strings encoded,
/// other values inserted as the model wrote them when they are JSON, else as strings.
pub fn arguments_json(args: &[Argument]) -> String {
    let mut out = String::from("{");
    for (i, a) in args.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        write_string(&a.key, &mut out);
        out.push(':');
        let literal = a.kind != ArgType::String && serde_json::from_str::<Value>(a.text.trim()).is_ok();
        if literal {
            out.push_str(a.text.trim());
        } else {
            write_string(&a.text, &mut out);
        }
    }
    out.push('}');
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn floats_in_python_layout() {
        for (f, want) in [
            (1.0, "1.0"),
            (100.0, "100.0"),
            (350.5, "350.5"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (2.5e-7, "2.5e-07"),
            (1e16, "1e+16"),
            (1.5e300, "1.5e+300"),
            (9007199254740992.0, "9007199254740992.0"),
            (123456789012345.6, "123456789012345.6"),
            (5e-324, "5e-324"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (-12.25, "-12.25"),
            (0.1, "0.1"),
            (f64::NAN, "NaN"),
            (f64::NEG_INFINITY, "-Infinity"),
        ] {
            assert_eq!(python_float(f), want, "{f:e}");
        }
    }

    #[test]
    fn compact_sorts_keys_at_every_depth_and_keeps_list_order() {
        let v: Value = serde_json::from_str(r#"{"b":[3,{"z":1,"a":"é\n"}],"a":1.5,"c":null,"d":1e2}"#).unwrap();
        assert_eq!(compact_sorted(&v), r#"{"a":1.5,"b":[3,{"a":"é\n","z":1}],"c":null,"d":100.0}"#);
        let v = Value::String("\u{1}\u{7f}\"\\/".into());
        assert_eq!(compact_sorted(&v), "\"\\u0001\u{7f}\\\"\\\\/\"");
    }

    #[test]
    fn the_default_layout_keeps_key_order_and_spaces() {
        let v: Value = serde_json::from_str(r#"{"z": [1, 2.5e-7], "a": {"k": null}}"#).unwrap();
        assert_eq!(python_default(&v), r#"{"z": [1, 2.5e-07], "a": {"k": null}}"#);
    }

    #[test]
    fn arguments_are_read_one_level_deep() {
        let args = scan_arguments(
            r#"{"city": "Z\u00fcrich", "n": 350.50, "ok": true, "x": null, "l": [1, 2], "o": {"b": 1, "a": [ ]}}tail"#,
        )
        .unwrap();
        let got: Vec<(&str, ArgType, &str)> = args.iter().map(|a| (a.key.as_str(), a.kind, a.text.as_str())).collect();
        assert_eq!(
            got,
            [
                ("city", ArgType::String, "Zürich"),
                ("n", ArgType::Number, "350.50"),
                ("ok", ArgType::Boolean, "true"),
                ("x", ArgType::Null, "null"),
                ("l", ArgType::Array, "[1, 2]"),
                ("o", ArgType::Object, r#"{"b": 1, "a": [ ]}"#),
            ]
        );
        assert_eq!(scan_arguments("{}"), Some(vec![]));
        assert_eq!(scan_arguments(" { } "), Some(vec![]));
        assert_eq!(scan_arguments("{\"a\":\"x\ny\",\"a\":NaN}").unwrap().len(), 2, "raw newline, NaN, duplicates");
        for bad in ["", "  ", "[1, 2]", "\"x\"", "null", "3", "{\"a\":1,}", "{\"a\" 1}", "{1:2}", "{\"a\":01}", "{"] {
            assert_eq!(scan_arguments(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn parsed_arguments_become_openai_json() {
        let args = scan_arguments(r#"{"city": "Z\"ü", "n": 2, "l": [1, 2], "bad": NaN}"#).unwrap();
        let json = arguments_json(&args);
        assert_eq!(json, r#"{"city":"Z\"ü","n":2,"l":[1, 2],"bad":"NaN"}"#);
        assert!(serde_json::from_str::<Value>(&json).is_ok());
        assert_eq!(arguments_json(&[]), "{}");
    }
}
