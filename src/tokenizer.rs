//! The K3 tokenizer (spec section 6): byte-level BPE with tiktoken semantics.
//!
//! Ranks come from `tiktoken.model` (`base64(bytes) rank` per line) and the 256 added tokens
//! from `tokenizer_config.json`. Pre-tokenisation uses the K3 regex through `fancy-regex` (the
//! engine tiktoken itself uses); each piece is merged by `tiktoken-rs`'s byte-pair core, so the
//! merge semantics are tiktoken's own. Built once at start-up; encode/decode allocate.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use rustc_hash::FxHashMap;

use crate::exit::{Classify, ExitCode};

/// The K3 pre-tokenizer: alternatives tried in order, first match wins.
pub const K3_PATTERN: &str = concat!(
    r"[\p{Han}]+",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    "|",
    r"\p{N}{1,3}",
    "|",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    "|",
    r"\s*[\r\n]+",
    "|",
    r"\s+(?!\S)",
    "|",
    r"\s+",
);

/// Why a tokenizer could not be loaded or could not encode or decode.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}:{line}: {message}")]
    Vocab { path: PathBuf, line: usize, message: String },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("the pre-tokenizer regex failed on the input: {0}")]
    Regex(String),
    #[error("token id {0} is not in the vocabulary")]
    UnknownId(u32),
}

impl Classify for TokenizerError {
    fn exit_code(&self) -> ExitCode {
        match self {
            TokenizerError::Io { .. } => ExitCode::Io,
            TokenizerError::Vocab { .. } | TokenizerError::Config { .. } => ExitCode::Data,
            TokenizerError::UnknownId(_) => ExitCode::Usage,
            TokenizerError::Regex(_) => ExitCode::Internal,
        }
    }
}

/// A loaded K3 tokenizer.
pub struct Tokenizer {
    ranks: FxHashMap<Vec<u8>, u32>,
    /// Bytes of each rank, indexed by rank.
    decoder: Vec<Vec<u8>>,
    added: HashMap<String, u32>,
    added_by_id: HashMap<u32, String>,
    /// Added tokens, longest first, for splitting text when they are allowed.
    added_sorted: Vec<(String, u32)>,
    regex: fancy_regex::Regex,
}

/// File names inside a model directory.
pub const VOCAB_FILE: &str = "tiktoken.model";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

impl Tokenizer {
    /// Loads `tiktoken.model` and `tokenizer_config.json` from a model directory.
    pub fn from_model_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        let vocab_path = dir.join(VOCAB_FILE);
        let vocab = read(&vocab_path)?;
        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        let config = read(&config_path)?;
        let decoder = parse_vocab(&vocab, &vocab_path)?;
        let added = parse_added(&config, &config_path, decoder.len())?;
        Tokenizer::new(decoder, added)
    }

    /// Builds a tokenizer from rank bytes (index = rank) and added tokens.
    pub fn new(decoder: Vec<Vec<u8>>, added: Vec<(String, u32)>) -> Result<Tokenizer, TokenizerError> {
        let ranks: FxHashMap<Vec<u8>, u32> = decoder.iter().enumerate().map(|(r, b)| (b.clone(), r as u32)).collect();
        let regex = fancy_regex::Regex::new(K3_PATTERN)
            .map_err(|e| TokenizerError::Regex(format!("the K3 pattern does not compile: {e}")))?;
        let mut added_sorted = added.clone();
        added_sorted.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        Ok(Tokenizer {
            ranks,
            decoder,
            added_by_id: added.iter().map(|(s, i)| (*i, s.clone())).collect(),
            added: added.into_iter().collect(),
            added_sorted,
            regex,
        })
    }

    /// Number of BPE ranks (ids below this are ordinary tokens).
    pub fn n_ranks(&self) -> usize {
        self.decoder.len()
    }

    /// The id of an added token such as `[BOS]`.
    pub fn added_id(&self, content: &str) -> Option<u32> {
        self.added.get(content).copied()
    }

    /// Encodes text with added tokens DISALLOWED: their spelling is encoded as ordinary text
    /// (the rule for user text inside a chat template).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::new();
        self.encode_ordinary_into(text, &mut out)?;
        Ok(out)
    }

    /// Encodes text, turning every added-token spelling into its id.
    pub fn encode_with_added(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            match self.next_added(rest) {
                Some((at, content, id)) => {
                    self.encode_ordinary_into(&rest[..at], &mut out)?;
                    out.push(id);
                    rest = &rest[at + content.len()..];
                }
                None => {
                    self.encode_ordinary_into(rest, &mut out)?;
                    break;
                }
            }
        }
        Ok(out)
    }

    /// The earliest added token in `text` (longest at that position).
    fn next_added<'a>(&'a self, text: &str) -> Option<(usize, &'a str, u32)> {
        let mut best: Option<(usize, &str, u32)> = None;
        for (content, id) in &self.added_sorted {
            if let Some(at) = text.find(content.as_str()) {
                if best.is_none_or(|(b, _, _)| at < b) {
                    best = Some((at, content.as_str(), *id));
                }
            }
        }
        best
    }

    fn encode_ordinary_into(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        for m in self.regex.find_iter(text) {
            let piece = m.map_err(|e| TokenizerError::Regex(e.to_string()))?.as_str().as_bytes();
            if let Some(&rank) = self.ranks.get(piece) {
                out.push(rank);
                continue;
            }
            // Every single byte is a rank (checked at load), so a miss has length >= 2 here.
            for part in tiktoken_rs::byte_pair_split(piece, &self.ranks) {
                let rank = self
                    .ranks
                    .get(part)
                    .ok_or_else(|| TokenizerError::Regex(format!("BPE produced bytes {part:?} that have no rank")))?;
                out.push(*rank);
            }
        }
        Ok(())
    }

    /// The bytes of a token id.
    pub fn token_bytes(&self, id: u32) -> Result<&[u8], TokenizerError> {
        if let Some(b) = self.decoder.get(id as usize) {
            return Ok(b);
        }
        self.added_by_id.get(&id).map(|s| s.as_bytes()).ok_or(TokenizerError::UnknownId(id))
    }

    /// Concatenated bytes of `ids` (may be invalid UTF-8 mid-character).
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::new();
        for &id in ids {
            out.extend_from_slice(self.token_bytes(id)?);
        }
        Ok(out)
    }

    /// Decodes to text, replacing invalid UTF-8 with U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }
}

fn read(path: &Path) -> Result<String, TokenizerError> {
    std::fs::read_to_string(path).map_err(|source| TokenizerError::Io { path: path.to_owned(), source })
}

/// Parses `base64 rank` lines; ranks must be exactly 0..n, each once, with every byte present.
fn parse_vocab(text: &str, path: &Path) -> Result<Vec<Vec<u8>>, TokenizerError> {
    let bad = |line: usize, message: String| TokenizerError::Vocab { path: path.to_owned(), line, message };
    let mut entries: Vec<Option<Vec<u8>>> = Vec::new();
    let mut seen: FxHashMap<Vec<u8>, usize> = FxHashMap::default();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let (b64, rank) = line.split_once(' ').ok_or_else(|| bad(n, "expected `base64 rank`".to_owned()))?;
        let bytes =
            base64::engine::general_purpose::STANDARD.decode(b64).map_err(|e| bad(n, format!("bad base64: {e}")))?;
        let rank: usize = rank.trim().parse().map_err(|_| bad(n, format!("bad rank {rank:?}")))?;
        if rank >= 1 << 24 {
            return Err(bad(n, format!("rank {rank} is implausibly large")));
        }
        if entries.len() <= rank {
            entries.resize(rank + 1, None);
        }
        if entries[rank].is_some() {
            return Err(bad(n, format!("rank {rank} appears twice")));
        }
        if let Some(prev) = seen.insert(bytes.clone(), n) {
            return Err(bad(n, format!("the same bytes already have a rank on line {prev}")));
        }
        entries[rank] = Some(bytes);
    }
    let mut decoder = Vec::with_capacity(entries.len());
    for (rank, e) in entries.into_iter().enumerate() {
        decoder.push(e.ok_or_else(|| bad(0, format!("rank {rank} is missing: ranks must be 0..n")))?);
    }
    if let Some(b) = (0u8..=255).find(|b| !seen.contains_key(&vec![*b])) {
        return Err(bad(0, format!("byte 0x{b:02x} has no rank: a byte-level BPE needs all 256")));
    }
    Ok(decoder)
}

/// Reads `added_tokens_decoder` ({"id": {"content": ...}}); added ids must not collide with ranks.
fn parse_added(text: &str, path: &Path, n_ranks: usize) -> Result<Vec<(String, u32)>, TokenizerError> {
    let bad = |message: String| TokenizerError::Config { path: path.to_owned(), message };
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
    let Some(map) = value.get("added_tokens_decoder").and_then(|v| v.as_object()) else {
        return Err(bad("added_tokens_decoder is missing or not an object".to_owned()));
    };
    let mut out = Vec::with_capacity(map.len());
    for (id, entry) in map {
        let id: u32 = id.parse().map_err(|_| bad(format!("added token id {id:?} is not an integer")))?;
        let content = entry
            .get("content")
            .and_then(|c| c.as_str())
            .ok_or_else(|| bad(format!("added token {id} has no string content")))?;
        if (id as usize) < n_ranks {
            return Err(bad(format!("added token {content:?} has id {id}, inside the {n_ranks} BPE ranks")));
        }
        if content.is_empty() {
            return Err(bad(format!("added token {id} is empty")));
        }
        out.push((content.to_owned(), id));
    }
    out.sort_by_key(|(_, id)| *id);
    Ok(out)
}

/// Turns a stream of token ids into text, holding back bytes of an unfinished UTF-8 character.
#[derive(Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    /// Adds one token and returns the text that is now complete.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        self.pending.extend_from_slice(tok.token_bytes(id)?);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            // An invalid sequence (not just an unfinished one) can never complete: emit lossily.
            Err(_) => self.pending.len(),
        };
        let out = String::from_utf8_lossy(&self.pending[..valid]).into_owned();
        self.pending.drain(..valid);
        Ok(out)
    }

    /// Whatever is still held back, lossily.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}
