//! The K3 tokenizer (spec section 6): byte-level BPE with tiktoken semantics.
//!
//! Ranks come from `tiktoken.model` (`base64(bytes) rank` per line) and the 256 added tokens
//! from `tokenizer_config.json`. Pre-tokenisation uses the K3 regex through `fancy-regex` (the
//! engine tiktoken itself uses); each piece is merged by `tiktoken-rs`'s byte-pair core, so the
//! merge semantics are tiktoken's own. Built once at start-up; encode/decode allocate.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

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
/// A tokenizer file larger than this is refused unread (the release's vocabulary is ~3 MB).
pub const TOKENIZER_FILE_MAX: u64 = 256 << 20;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}:{line}: {message}")]
    Vocab { path: PathBuf, line: usize, message: String },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("{path}:{line}: not UTF-8 text (invalid byte at offset {offset})")]
    NotText { path: PathBuf, line: usize, offset: usize },
    #[error("the pre-tokenizer regex failed on the input: {0}")]
    Regex(String),
    #[error("token id {0} is not in the vocabulary")]
    UnknownId(u32),
    /// Not a regular file, or larger than any tokenizer file (exit 3).
    #[error(transparent)]
    Input(#[from] crate::files::InputError),
}

impl Classify for TokenizerError {
    fn exit_code(&self) -> ExitCode {
        match self {
            TokenizerError::Io { .. } => ExitCode::Io,
            TokenizerError::Vocab { .. } | TokenizerError::Config { .. } | TokenizerError::NotText { .. } => {
                ExitCode::Data
            }
            TokenizerError::UnknownId(_) => ExitCode::Usage,
            TokenizerError::Input(e) => e.exit_code(),
            TokenizerError::Regex(_) => ExitCode::Internal,
        }
    }
}

/// A loaded K3 tokenizer.
#[derive(Clone)]
pub struct Tokenizer {
    ranks: FxHashMap<Vec<u8>, u32>,
    /// Bytes of each rank, indexed by rank.
    decoder: Vec<Vec<u8>>,
    added: HashMap<String, u32>,
    added_by_id: HashMap<u32, String>,
    /// Added tokens, longest first, for splitting text when they are allowed.
    added_sorted: Vec<(String, u32)>,
    regex: Arc<fancy_regex::Regex>,
    /// Set for a stand-in made because the model directory has no tokenizer (see
    /// [`Tokenizer::from_model_dir_or_ids`]): the vocabulary file it lacks.
    missing: Option<PathBuf>,
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

    /// [`Tokenizer::from_model_dir`], or, when the directory has no `tiktoken.model` at all, a
    /// stand-in for a model of `vocab` ids that decodes each id as `<id>` and refuses to encode
    /// text (with the error a missing file gives): a run given token ids needs no tokenizer.
    pub fn from_model_dir_or_ids(dir: &Path, vocab: usize) -> Result<Tokenizer, TokenizerError> {
        let vocab_path = dir.join(VOCAB_FILE);
        if vocab_path.exists() {
            let tok = Tokenizer::from_model_dir(dir)?;
            tok.check_fits(dir, vocab)?;
            return Ok(tok);
        }
        let decoder = (0..vocab).map(|id| format!("<{id}>").into_bytes()).collect();
        let mut tok = Tokenizer::new(decoder, Vec::new())?;
        tok.missing = Some(vocab_path);
        Ok(tok)
    }

    /// Refuses a tokenizer with ids the model has no embedding row for (a tokenizer from another
    /// model): its text would encode to ids the model cannot take.
    fn check_fits(&self, dir: &Path, vocab: usize) -> Result<(), TokenizerError> {
        if self.decoder.len() > vocab {
            return Err(TokenizerError::Vocab {
                path: dir.join(VOCAB_FILE),
                line: vocab + 1,
                message: format!(
                    "{} ranks, more than the model's vocabulary of {vocab} (config.json vocab_size)",
                    self.decoder.len()
                ),
            });
        }
        if let Some((text, id)) =
            self.added_sorted.iter().filter(|(_, id)| *id as usize >= vocab).min_by_key(|(_, id)| *id)
        {
            return Err(TokenizerError::Config {
                path: dir.join(TOKENIZER_CONFIG_FILE),
                message: format!(
                    "added token {text:?} has id {id}, outside the model's vocabulary of {vocab} (config.json vocab_size)"
                ),
            });
        }
        Ok(())
    }

    /// The vocabulary file this stand-in tokenizer lacks (`None` for a real tokenizer).
    pub fn missing_vocab(&self) -> Option<&Path> {
        self.missing.as_deref()
    }

    fn refuse_if_missing(&self) -> Result<(), TokenizerError> {
        match &self.missing {
            Some(path) => Err(TokenizerError::Io {
                path: path.clone(),
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no such file: text needs the tokenizer; give token ids (--ids) instead",
                ),
            }),
            None => Ok(()),
        }
    }

    /// Builds a tokenizer from rank bytes (index = rank) and added tokens.
    pub fn new(decoder: Vec<Vec<u8>>, added: Vec<(String, u32)>) -> Result<Tokenizer, TokenizerError> {
        let ranks: FxHashMap<Vec<u8>, u32> = decoder.iter().enumerate().map(|(r, b)| (b.clone(), r as u32)).collect();
        let regex = k3_regex()?;
        let mut added_sorted = added.clone();
        added_sorted.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        Ok(Tokenizer {
            ranks,
            decoder,
            added_by_id: added.iter().map(|(s, i)| (*i, s.clone())).collect(),
            added: added.into_iter().collect(),
            added_sorted,
            regex,
            missing: None,
        })
    }

    /// Bytes of the longest token (ordinary or added): no text of n tokens is longer than n times
    /// this, which bounds how much text a context can hold.
    pub fn max_token_bytes(&self) -> usize {
        let ranks = self.decoder.iter().map(Vec::len);
        ranks.chain(self.added_sorted.iter().map(|(s, _)| s.len())).max().unwrap_or(1).max(1)
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
        self.refuse_if_missing()?;
        let mut out = Vec::new();
        self.encode_ordinary_into(text, &mut out)?;
        Ok(out)
    }

    /// Encodes text, turning every added-token spelling into its id.
    pub fn encode_with_added(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.refuse_if_missing()?;
        let mut out = Vec::new();
        let mut added = AddedFinder::new(&self.added_sorted, text);
        let mut at = 0;
        while let Some((start, len, id)) = added.next_from(at) {
            self.encode_ordinary_into(&text[at..start], &mut out)?;
            out.push(id);
            at = start + len;
        }
        self.encode_ordinary_into(&text[at..], &mut out)?;
        Ok(out)
    }

    fn encode_ordinary_into(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        for m in self.regex.find_iter(text) {
            let piece = m.map_err(|e| TokenizerError::Regex(e.to_string()))?.as_str().as_bytes();
            if let Some(&rank) = self.ranks.get(piece) {
                out.push(rank);
                continue;
            }
            // Every single byte is a rank (checked at load), so a miss has length >= 2 here.
            if piece.len() > SHORT_PIECE {
                byte_pair_merge_long(piece, &self.ranks, out)?;
                continue;
            }
            for part in tiktoken_rs::byte_pair_split(piece, &self.ranks) {
                out.push(rank_of(&self.ranks, part)?);
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

    /// Whether `id` is an added (special) token: `[BOS]`, `[EOS]`, the chat markup and the like.
    pub fn is_special(&self, id: u32) -> bool {
        self.added_by_id.contains_key(&id)
    }

    /// [`Tokenizer::decode`] that writes an id with no text (inside the model's vocabulary, absent
    /// from this tokenizer) as `<id>`, as the streamed output does, instead of failing.
    pub fn decode_or_mark(&self, ids: &[u32], show_special: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids.iter().filter(|&&id| show_special || !self.is_special(id)) {
            match self.token_bytes(id) {
                Ok(b) => bytes.extend_from_slice(b),
                Err(_) => bytes.extend_from_slice(format!("<{id}>").as_bytes()),
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// The compiled K3 pattern, compiled once per process (tens of milliseconds) and shared, with
/// its search caches, by every tokenizer.
/// Pieces up to this many bytes go through tiktoken's merge, O(length x merges), which is the
/// fastest for words; longer ones (a run of one letter is a single piece) through
/// [`byte_pair_merge_long`]: quadratic there, a 28 KB run took seconds (docs/FUZZING.md).
const SHORT_PIECE: usize = 64;

fn rank_of(ranks: &FxHashMap<Vec<u8>, u32>, part: &[u8]) -> Result<u32, TokenizerError> {
    ranks
        .get(part)
        .copied()
        .ok_or_else(|| TokenizerError::Regex(format!("BPE produced bytes {part:?} that have no rank")))
}

/// Byte-pair merge of one piece of two or more bytes in O(n log n): repeatedly joins the two
/// adjacent parts whose joined bytes have the lowest rank, the leftmost of equal ranks (the
/// rule of tiktoken's `byte_pair_split`, which this reproduces token for token), with a heap of
/// candidate joins that are dropped when they come off it outdated.
fn byte_pair_merge_long(
    piece: &[u8],
    ranks: &FxHashMap<Vec<u8>, u32>,
    out: &mut Vec<u32>,
) -> Result<(), TokenizerError> {
    use std::cmp::Reverse;
    const NONE: u32 = u32::MAX;
    let n = piece.len();
    // Parts are named by their first byte: `end[s]` is where part `s` ends, `prev[s]` where the
    // part before it starts, `join[s]` the rank of part `s` joined with the next (NONE: none, or
    // `s` no longer starts a part).
    let mut end: Vec<usize> = (1..=n).collect();
    let mut prev: Vec<usize> = (0..n).map(|s| s.wrapping_sub(1)).collect();
    let mut join = vec![NONE; n];
    let mut heap = std::collections::BinaryHeap::with_capacity(n);
    let rank = |a: usize, b: usize| ranks.get(&piece[a..b]).copied();
    for (s, j) in join.iter_mut().enumerate().take(n - 1) {
        if let Some(r) = rank(s, s + 2) {
            *j = r;
            heap.push(Reverse((r, s)));
        }
    }
    while let Some(Reverse((r, s))) = heap.pop() {
        if join[s] != r {
            continue;
        }
        let right = end[s];
        let new_end = end[right];
        end[s] = new_end;
        join[right] = NONE;
        join[s] = NONE;
        if new_end < n {
            prev[new_end] = s;
            if let Some(r) = rank(s, end[new_end]) {
                join[s] = r;
                heap.push(Reverse((r, s)));
            }
        }
        if s > 0 {
            let p = prev[s];
            join[p] = NONE;
            if let Some(r) = rank(p, new_end) {
                join[p] = r;
                heap.push(Reverse((r, p)));
            }
        }
    }
    let mut s = 0;
    while s < n {
        out.push(rank_of(ranks, &piece[s..end[s]])?);
        s = end[s];
    }
    Ok(())
}

/// Finds added-token spellings left to right, each spelling's next occurrence kept until it is
/// passed, so a text is scanned once per spelling (searching every spelling again after each
/// match was quadratic in the number of matches).
struct AddedFinder<'a> {
    text: &'a str,
    /// Per spelling (longest first): its next occurrence found so far, if any.
    next: Vec<(Option<usize>, &'a str, u32)>,
}

impl<'a> AddedFinder<'a> {
    fn new(sorted: &'a [(String, u32)], text: &'a str) -> AddedFinder<'a> {
        let next = sorted.iter().map(|(content, id)| (text.find(content.as_str()), content.as_str(), *id)).collect();
        AddedFinder { text, next }
    }

    /// The earliest spelling starting at or after `at` (the longest there): (start, len, id).
    fn next_from(&mut self, at: usize) -> Option<(usize, usize, u32)> {
        let mut best: Option<(usize, usize, u32)> = None;
        for (found, content, id) in &mut self.next {
            if found.is_some_and(|f| f < at) {
                *found = self.text[at..].find(*content).map(|f| at + f);
            }
            if let Some(f) = *found {
                if best.is_none_or(|(b, _, _)| f < b) {
                    best = Some((f, content.len(), *id));
                }
            }
        }
        best
    }
}

fn k3_regex() -> Result<Arc<fancy_regex::Regex>, TokenizerError> {
    static REGEX: OnceLock<Result<Arc<fancy_regex::Regex>, String>> = OnceLock::new();
    REGEX
        .get_or_init(|| fancy_regex::Regex::new(K3_PATTERN).map(Arc::new).map_err(|e| e.to_string()))
        .clone()
        .map_err(|e| TokenizerError::Regex(format!("the K3 pattern does not compile: {e}")))
}

/// The text of a tokenizer file: a failed read is I/O (exit 4), bytes that are not UTF-8 are bad
/// data (exit 3) named by line and offset.
fn read(path: &Path) -> Result<String, TokenizerError> {
    let bytes =
        crate::files::input::read_regular(path, TOKENIZER_FILE_MAX, "a tokenizer file").map_err(|e| match e {
            crate::files::InputError::Io { path, source, .. } => TokenizerError::Io { path, source },
            e => TokenizerError::Input(e),
        })?;
    String::from_utf8(bytes).map_err(|e| {
        let offset = e.utf8_error().valid_up_to();
        let line = 1 + e.as_bytes()[..offset].iter().filter(|&&b| b == b'\n').count();
        TokenizerError::NotText { path: path.to_owned(), line, offset }
    })
}

/// Parses `base64 rank` lines; ranks must be exactly 0..n, each once, with every byte present.
/// `path` only names the file in errors.
#[doc(hidden)]
pub fn parse_vocab(text: &str, path: &Path) -> Result<Vec<Vec<u8>>, TokenizerError> {
    let bad = |line: usize, message: String| TokenizerError::Vocab { path: path.to_owned(), line, message };
    // Ranks are 0..n with n the number of entries, so no rank can reach the line count: a bound
    // that keeps one line's rank from sizing the table (16M slots from a 10-byte file).
    let n_entries = text.lines().filter(|l| !l.trim().is_empty()).count();
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
        if rank >= n_entries {
            return Err(bad(n, format!("rank {rank} is not below the {n_entries} entries: ranks must be 0..n")));
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
/// `path` only names the file in errors.
#[doc(hidden)]
pub fn parse_added(text: &str, path: &Path, n_ranks: usize) -> Result<Vec<(String, u32)>, TokenizerError> {
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
    // Distinct keys can spell one id ("300" and "0300"): refuse rather than let one win.
    if let Some(pair) = out.windows(2).find(|w| w[0].1 == w[1].1) {
        return Err(bad(format!("added token id {} is given twice ({:?} and {:?})", pair[0].1, pair[0].0, pair[1].0)));
    }
    Ok(out)
}

/// Turns a stream of token ids into text, holding back bytes of an unfinished UTF-8 character.
#[derive(Default)]
pub struct StreamDecoder {
    pending: Vec<u8>,
    /// Print added tokens (`[EOS]`, `<|reserved_token_N|>`, the chat markup) as their spelling;
    /// by default they are not text and print nothing, so a stop string never matches inside one.
    show_special: bool,
}

impl StreamDecoder {
    /// A decoder that prints added tokens' spellings too (`run --show-special`).
    pub fn showing_special(show_special: bool) -> StreamDecoder {
        StreamDecoder { pending: Vec::new(), show_special }
    }

    /// Adds one token and returns the text that is now complete.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String, TokenizerError> {
        if !self.show_special && tok.is_special(id) {
            return Ok(String::new());
        }
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    /// Every byte, then every string of 2 to 4 letters of `abc` in a shuffled order (so the
    /// ranks of longer strings interleave with shorter ones), some left out.
    fn abc_ranks() -> FxHashMap<Vec<u8>, u32> {
        let mut multi: Vec<Vec<u8>> = Vec::new();
        for len in 2..=4u32 {
            for code in 0..3usize.pow(len) {
                let word: Vec<u8> = (0..len).map(|k| b"abc"[code / 3usize.pow(k) % 3]).collect();
                multi.push(word);
            }
        }
        let mut rng = SplitMix64::new(7);
        rng.shuffle(&mut multi);
        multi.retain(|_| rng.below(5) != 0);
        (0..=255u8).map(|b| vec![b]).chain(multi).enumerate().map(|(r, b)| (b, r as u32)).collect()
    }

    fn tiktoken_ranks(piece: &[u8], ranks: &FxHashMap<Vec<u8>, u32>) -> Vec<u32> {
        tiktoken_rs::byte_pair_split(piece, ranks).into_iter().map(|p| ranks[p]).collect()
    }

    fn long_ranks(piece: &[u8], ranks: &FxHashMap<Vec<u8>, u32>) -> Vec<u32> {
        let mut out = Vec::new();
        byte_pair_merge_long(piece, ranks, &mut out).unwrap();
        out
    }

    #[test]
    fn long_merge_equals_tiktoken_on_random_pieces_and_runs() {
        let ranks = abc_ranks();
        let mut rng = SplitMix64::new(3);
        for case in 0..3000 {
            let len = 2 + rng.index(if case % 10 == 0 { 600 } else { 40 });
            let letters = 1 + case % 3;
            let piece: Vec<u8> = (0..len).map(|_| b"abc"[rng.index(letters)]).collect();
            assert_eq!(
                long_ranks(&piece, &ranks),
                tiktoken_ranks(&piece, &ranks),
                "{:?}",
                String::from_utf8_lossy(&piece)
            );
        }
        for len in 2..200 {
            let piece = vec![b'a'; len];
            assert_eq!(long_ranks(&piece, &ranks), tiktoken_ranks(&piece, &ranks), "a x {len}");
        }
    }

    fn tiny() -> Tokenizer {
        Tokenizer::from_model_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-k3")).unwrap()
    }

    #[test]
    fn long_pieces_encode_as_tiktoken_does_with_the_tiny_vocabulary() {
        let tok = tiny();
        for text in ["Ø".repeat(3000), "a".repeat(2500), "ab".repeat(1500), "漢字".repeat(700), "1".repeat(999)] {
            let mut want = Vec::new();
            for m in tok.regex.find_iter(&text) {
                let piece = m.unwrap().as_str().as_bytes();
                match tok.ranks.get(piece) {
                    Some(&r) => want.push(r),
                    None => want.extend(tiktoken_ranks(piece, &tok.ranks)),
                }
            }
            assert_eq!(tok.encode(&text).unwrap(), want, "{}...", &text[..12]);
        }
    }

    #[test]
    fn a_megabyte_of_one_letter_encodes() {
        // Quadratic merging took hours here (found by the jsonl_requests fuzzer at 28 KB).
        let text = "Ø".repeat(500_000);
        let ids = tiny().encode(&text).unwrap();
        assert_eq!(tiny().decode(&ids).unwrap(), text);
    }

    /// The search for added tokens as it was: every spelling searched again after each match.
    fn added_by_rescanning(tok: &Tokenizer, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        let mut rest = text;
        loop {
            let mut best: Option<(usize, &str, u32)> = None;
            for (content, id) in &tok.added_sorted {
                if let Some(at) = rest.find(content.as_str()) {
                    if best.is_none_or(|(b, _, _)| at < b) {
                        best = Some((at, content.as_str(), *id));
                    }
                }
            }
            let Some((at, content, id)) = best else { break };
            tok.encode_ordinary_into(&rest[..at], &mut out).unwrap();
            out.push(id);
            rest = &rest[at + content.len()..];
        }
        tok.encode_ordinary_into(rest, &mut out).unwrap();
        out
    }

    #[test]
    fn added_tokens_are_found_as_before_in_one_pass() {
        let tok = tiny();
        let spellings: Vec<&str> = tok.added_sorted.iter().map(|(s, _)| s.as_str()).take(12).collect();
        let mut rng = SplitMix64::new(11);
        for _ in 0..200 {
            let mut text = String::new();
            for _ in 0..rng.index(30) {
                match rng.index(4) {
                    0 => text.push_str(spellings[rng.index(spellings.len())]),
                    // A spelling cut short, or two run together: overlaps and near misses.
                    1 => {
                        let s = spellings[rng.index(spellings.len())];
                        text.push_str(&s[..s.len() - 1]);
                    }
                    2 => text.push_str("<|"),
                    _ => text.push_str(["hello ", "x", " ", "|>", "\n"][rng.index(5)]),
                }
            }
            assert_eq!(tok.encode_with_added(&text).unwrap(), added_by_rescanning(&tok, &text), "{text:?}");
        }
    }
}
