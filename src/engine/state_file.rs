//! Saving and restoring a [`ChatSession`]: a versioned, checksummed file, written atomically.
//!
//! Layout (little-endian): magic `K3RSTATE`, format version (u32), total file length (u64),
//! model fingerprint (config hash, checkpoint tensor index hash: u64 each), position (tokens
//! fed, u64), token count (u64) and the token ids (u32 each), whether logits follow (u8) and
//! then the logits of the last fed token (length-prefixed f32s), the layer states
//! ([`crate::model::ModelState::save_into`]), the caller's extra bytes (length-prefixed; the
//! chat keeps its transcript there), and an xxh3-64 of everything before it.
//!
//! The logits are saved so a restored session can reply with nothing new to prefill, and so
//! its first sampled token comes from the very floats the saved session had.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use kernels::hash::xxh3_64;

use super::chat::ChatSession;
use super::{Engine, EngineError};
use crate::checkpoint::CheckpointIndex;
use crate::config::Config;
use crate::exit::{Classify, ExitCode};
use crate::model::weights::WeightSource;
use crate::model::{take_bytes, take_u64, LayerHook};

pub const STATE_MAGIC: [u8; 8] = *b"K3RSTATE";
/// Bumped whenever the layout above changes; other versions are refused, never guessed at.
pub const STATE_VERSION: u32 = 1;
/// Magic, version and total length: what is read before anything else can be trusted.
const PREFIX_BYTES: usize = 8 + 4 + 8;

/// Why a state file could not be written or restored.
#[derive(Debug, thiserror::Error)]
pub enum StateFileError {
    #[error("{op} {path}: {source}")]
    Io { path: PathBuf, op: &'static str, source: std::io::Error },
    #[error("{path} is not a k3ring state file (no K3RSTATE magic)")]
    NotState { path: PathBuf },
    #[error("{path} is a state file of format version {found}; this k3ring reads version {supported} only")]
    Version { path: PathBuf, found: u32, supported: u32 },
    #[error("{path} is truncated: {have} bytes of the {want} it was written with")]
    Truncated { path: PathBuf, have: u64, want: u64 },
    #[error("{path} is corrupt: {why}")]
    Corrupt { path: PathBuf, why: String },
    #[error("{path} was saved from another model: its {what} hash is {saved:016x}, this model's is {ours:016x}")]
    OtherModel { path: PathBuf, what: &'static str, saved: u64, ours: u64 },
    #[error("{path} holds {positions} positions, but this session has room for {capacity}; give a longer --context")]
    TooLong { path: PathBuf, positions: usize, capacity: usize },
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Input(#[from] crate::files::InputError),
    #[error(transparent)]
    Output(#[from] crate::files::OutputError),
}

impl Classify for StateFileError {
    fn exit_code(&self) -> ExitCode {
        match self {
            StateFileError::Io { .. } => ExitCode::Io,
            StateFileError::TooLong { .. } => ExitCode::Usage,
            StateFileError::Engine(e) => e.exit_code(),
            StateFileError::Input(e) => e.exit_code(),
            StateFileError::Output(e) => e.exit_code(),
            _ => ExitCode::Data,
        }
    }
}

/// Which model a state belongs to: hashes of the validated config and of the checkpoint's tensor
/// index (names, shards, dtypes, shapes, offsets), so a state never meets other weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fingerprint {
    pub config: u64,
    pub checkpoint: u64,
}

impl Fingerprint {
    pub fn of(cfg: &Config, index: &CheckpointIndex) -> Fingerprint {
        // The serialized validated config: whitespace or key order in config.json do not matter.
        let config = xxh3_64(serde_json::to_string(cfg).unwrap_or_default().as_bytes());
        let mut tensors = Vec::new();
        for t in &index.tensors {
            let shape: Vec<String> = t.shape.iter().map(u64::to_string).collect();
            let line =
                format!("{} {} {} [{}] {} {}\n", t.name, t.shard, t.dtype.name(), shape.join(","), t.offset, t.len);
            tensors.extend_from_slice(line.as_bytes());
        }
        Fingerprint { config, checkpoint: xxh3_64(&tensors) }
    }

    /// The fingerprint of a model directory (reads its config and shard headers).
    pub fn of_dir(dir: &Path) -> Result<Fingerprint, super::OpenError> {
        let cfg = Config::from_model_dir(dir)?;
        let index = CheckpointIndex::open(dir)?;
        Ok(Fingerprint::of(&cfg, &index))
    }
}

/// Reads a state file: a regular file (never a FIFO or a device), whose size is checked against
/// the length its header announces before the rest is read, so no input can make the read
/// larger than the file it claims to be.
pub fn read_state_file(path: &Path) -> Result<Vec<u8>, StateFileError> {
    use std::io::Read;
    let io = |op, source| StateFileError::Io { path: path.to_owned(), op, source };
    let mut file = crate::files::input::open_regular(path, 0)?;
    let size = file.metadata().map_err(|e| io("reading", e))?.len();
    let mut prefix = Vec::with_capacity(PREFIX_BYTES);
    (&mut file).take(PREFIX_BYTES as u64).read_to_end(&mut prefix).map_err(|e| io("reading", e))?;
    let version = |p: &[u8]| u32::from_le_bytes([p[8], p[9], p[10], p[11]]);
    if prefix.len() < PREFIX_BYTES || prefix[..8] != STATE_MAGIC || version(&prefix) != STATE_VERSION {
        // Too short for a header, not a state file, or another version: the header check says which.
        let why = || StateFileError::Corrupt { path: path.to_owned(), why: "its header cannot be read".into() };
        return Err(read_header(path, &prefix).err().unwrap_or_else(why));
    }
    let mut total = [0u8; 8];
    total.copy_from_slice(&prefix[12..PREFIX_BYTES]);
    let total = u64::from_le_bytes(total);
    if size < total {
        return Err(StateFileError::Truncated { path: path.to_owned(), have: size, want: total });
    }
    if size > total {
        let why = format!("{} bytes past the {total} it was written with", size - total);
        return Err(StateFileError::Corrupt { path: path.to_owned(), why });
    }
    let mut bytes = prefix;
    // `total` equals the size, which held the prefix: no underflow.
    let rest = crate::files::input::read_bounded(file, total.saturating_sub(PREFIX_BYTES as u64))
        .map_err(|e| io("reading", e))?
        .ok_or_else(|| StateFileError::Corrupt { path: path.to_owned(), why: "it grew while being read".into() })?;
    bytes.extend_from_slice(&rest);
    Ok(bytes)
}

/// What a state file holds besides the layer states.
pub struct StateHeader {
    pub fingerprint: Fingerprint,
    pub fed: usize,
    pub ids: Vec<u32>,
}

impl ChatSession {
    /// The state file bytes of this session, with `extra` bytes kept for the caller.
    pub fn to_state_bytes(&self, fp: Fingerprint, extra: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&STATE_MAGIC);
        out.extend_from_slice(&STATE_VERSION.to_le_bytes());
        out.extend_from_slice(&0u64.to_le_bytes()); // total length, filled in below
        for v in [fp.config, fp.checkpoint, self.fed as u64, self.ids.len() as u64] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for id in &self.ids {
            out.extend_from_slice(&id.to_le_bytes());
        }
        out.push(u8::from(self.logits_valid));
        if self.logits_valid {
            let vocab = self.sess.logits.len() / self.sess.scratch.chunk().max(1);
            crate::model::put_f32s(&mut out, &self.sess.logits[..vocab]);
        }
        self.sess.state.save_into(&mut out);
        out.extend_from_slice(&(extra.len() as u64).to_le_bytes());
        out.extend_from_slice(extra);
        let total = (out.len() + 8) as u64;
        out[12..20].copy_from_slice(&total.to_le_bytes());
        let sum = xxh3_64(&out);
        out.extend_from_slice(&sum.to_le_bytes());
        out
    }

    /// Saves the session to `out` by the output rule (a regular file is replaced atomically).
    pub fn save(&self, out: &crate::files::Output, fp: Fingerprint, extra: &[u8]) -> Result<(), StateFileError> {
        Ok(out.write_all(&self.to_state_bytes(fp, extra))?)
    }

    /// Restores the session from `path`, refusing another model, version, a truncated or a
    /// corrupted file; returns the extra bytes. On refusal the session is unchanged, unless the
    /// layer states themselves were refused (then it is reset).
    pub fn restore<S: WeightSource + LayerHook>(
        &mut self,
        engine: &Engine<S>,
        path: &Path,
        fp: Fingerprint,
    ) -> Result<Vec<u8>, StateFileError> {
        let bytes = read_state_file(path)?;
        self.restore_bytes(engine, path, &bytes, fp)
    }

    /// [`Self::restore`] from the bytes of a state file; `path` names it in errors.
    pub fn restore_bytes<S: WeightSource + LayerHook>(
        &mut self,
        engine: &Engine<S>,
        path: &Path,
        bytes: &[u8],
        fp: Fingerprint,
    ) -> Result<Vec<u8>, StateFileError> {
        let corrupt = |why: String| StateFileError::Corrupt { path: path.to_owned(), why };
        let (header, mut rest) = read_header(path, bytes)?;
        if header.fingerprint.config != fp.config {
            let (saved, ours) = (header.fingerprint.config, fp.config);
            return Err(StateFileError::OtherModel { path: path.to_owned(), what: "config", saved, ours });
        }
        if header.fingerprint.checkpoint != fp.checkpoint {
            let (saved, ours) = (header.fingerprint.checkpoint, fp.checkpoint);
            return Err(StateFileError::OtherModel {
                path: path.to_owned(),
                what: "checkpoint tensor index",
                saved,
                ours,
            });
        }
        let vocab = engine.model.cfg.vocab_size;
        // Only a crafted file gets past the checksum with these, but it must not reach the model.
        if let Some(&bad) = header.ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(corrupt(format!("token id {bad} is outside the vocabulary of {vocab}")));
        }
        if header.ids.len() >= self.capacity() {
            let (positions, capacity) = (header.ids.len(), self.capacity());
            return Err(StateFileError::TooLong { path: path.to_owned(), positions, capacity });
        }
        let has_logits = take_bytes(&mut rest, 1).map_err(&corrupt)?[0] == 1;
        let mut logits = vec![0.0f32; vocab];
        if has_logits {
            crate::model::take_f32s(&mut rest, &mut logits).map_err(|e| corrupt(format!("logits: {e}")))?;
        }
        self.sess.state.load_from(&mut rest, header.fed).map_err(&corrupt)?;
        let n = take_u64(&mut rest).map_err(&corrupt)? as usize;
        let extra = take_bytes(&mut rest, n).map_err(&corrupt)?.to_vec();
        if !rest.is_empty() {
            return Err(corrupt(format!("{} bytes after the extra data", rest.len())));
        }
        self.sess.logits[..vocab].copy_from_slice(&logits);
        self.logits_valid = has_logits;
        self.ids = header.ids;
        self.fed = header.fed;
        Ok(extra)
    }
}

/// Checks magic, version, length and checksum; returns the header and the bytes after it
/// (checksum excluded).
pub fn read_header<'a>(path: &Path, bytes: &'a [u8]) -> Result<(StateHeader, &'a [u8]), StateFileError> {
    let truncated = |want: u64| StateFileError::Truncated { path: path.to_owned(), have: bytes.len() as u64, want };
    let magic_len = bytes.len().min(STATE_MAGIC.len());
    if bytes[..magic_len] != STATE_MAGIC[..magic_len] {
        return Err(StateFileError::NotState { path: path.to_owned() });
    }
    if bytes.len() < PREFIX_BYTES {
        return Err(truncated(PREFIX_BYTES as u64));
    }
    let found = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
    if found != STATE_VERSION {
        return Err(StateFileError::Version { path: path.to_owned(), found, supported: STATE_VERSION });
    }
    let mut rest = &bytes[12..];
    let total = take_u64(&mut rest).map_err(|_| truncated(PREFIX_BYTES as u64))?;
    let corrupt = |why: String| StateFileError::Corrupt { path: path.to_owned(), why };
    if (bytes.len() as u64) < total {
        return Err(truncated(total));
    }
    if bytes.len() as u64 > total {
        return Err(corrupt(format!("{} bytes past the {total} it was written with", bytes.len() as u64 - total)));
    }
    let body = &bytes[..bytes.len() - 8];
    let mut sum = [0u8; 8];
    sum.copy_from_slice(&bytes[bytes.len() - 8..]);
    if xxh3_64(body) != u64::from_le_bytes(sum) {
        return Err(corrupt("the checksum does not match its contents".into()));
    }
    let mut rest = &body[PREFIX_BYTES..];
    let mut u64s = [0u64; 4];
    for v in &mut u64s {
        *v = take_u64(&mut rest).map_err(&corrupt)?;
    }
    let [config, checkpoint, fed, n] = u64s;
    let raw = take_bytes(&mut rest, (n as usize).saturating_mul(4)).map_err(&corrupt)?;
    let ids: Vec<u32> = raw.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    if fed > n {
        return Err(corrupt(format!("position {fed} is past its {n} tokens")));
    }
    let fingerprint = Fingerprint { config, checkpoint };
    Ok((StateHeader { fingerprint, fed: fed as usize, ids }, rest))
}

/// The header of a state file, checked (for sizing a run before the model is opened).
pub fn peek(path: &Path) -> Result<StateHeader, StateFileError> {
    let bytes = read_state_file(path)?;
    read_header(path, &bytes).map(|(h, _)| h)
}
