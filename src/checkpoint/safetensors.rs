//! Parses one safetensors header (spec section 1) without touching the tensor data.
//!
//! Layout: u64 little-endian header length N, N bytes of JSON, then data; tensor offsets are
//! relative to byte 8 + N. Only the header is read, so indexing a 1.56 TB checkpoint costs the
//! size of its headers.

use std::io::Read;
use std::path::Path;

use serde::de::{IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

use super::{CheckpointError, Dtype};

/// The safetensors format caps the header at 100 MB; a larger length is corruption.
pub const HEADER_LEN_MAX: u64 = 100 * 1024 * 1024;

/// One tensor entry as written in a header (offsets still relative to the data start).
#[derive(Debug, Deserialize)]
pub struct RawEntry {
    pub dtype: RawDtype,
    pub shape: Vec<u64>,
    pub data_offsets: [u64; 2],
}

/// A header's dtype string: known (parsed without allocating) or the unknown text, kept for the
/// error message.
#[derive(Clone, Debug, PartialEq)]
pub enum RawDtype {
    Known(Dtype),
    Unknown(String),
}

impl RawDtype {
    pub fn name(&self) -> &str {
        match self {
            RawDtype::Known(d) => d.name(),
            RawDtype::Unknown(s) => s,
        }
    }
}

impl<'de> Deserialize<'de> for RawDtype {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = RawDtype;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a dtype string")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<RawDtype, E> {
                Ok(Dtype::parse(s).map_or_else(|| RawDtype::Unknown(s.to_owned()), RawDtype::Known))
            }
        }
        d.deserialize_str(V)
    }
}

/// A parsed header: where data starts and the entries in file order.
#[derive(Debug)]
pub struct Header {
    pub file_len: u64,
    pub data_start: u64,
    pub entries: Vec<(String, RawEntry)>,
}

/// Reads and parses the header of `path`; `shard` names the file in errors.
pub fn read_header(path: &Path) -> Result<Header, CheckpointError> {
    let io = |source| CheckpointError::Io { path: path.to_owned(), op: "read header of", source };
    let mut file = crate::files::input::open_regular(path, 0).map_err(|e| match e {
        crate::files::InputError::Io { source, .. } => io(source),
        e => CheckpointError::Input(e),
    })?;
    let file_len = file.metadata().map_err(io)?.len();
    let mut len_bytes = [0u8; 8];
    if file_len >= 8 {
        file.read_exact(&mut len_bytes).map_err(io)?;
    }
    let header_len = check_header_len(len_bytes, file_len, path)?;
    let mut json = vec![0u8; header_len];
    file.read_exact(&mut json).map_err(io)?;
    header_from_json(&json, file_len, path)
}

/// Parses the header of a whole shard held in memory (`file` is the entire file); `path` only
/// names the shard in errors. The same checks as [`read_header`], without the filesystem.
pub fn parse_header(file: &[u8], path: &Path) -> Result<Header, CheckpointError> {
    let file_len = file.len() as u64;
    let mut len_bytes = [0u8; 8];
    if let Some(prefix) = file.get(..8) {
        len_bytes.copy_from_slice(prefix);
    }
    let header_len = check_header_len(len_bytes, file_len, path)?;
    // check_header_len bounds the header by the bytes after the prefix.
    let json = file.get(8..8 + header_len).unwrap_or_default();
    header_from_json(json, file_len, path)
}

/// The header length from the 8-byte prefix, checked against the file and the format's cap
/// before anything is allocated for it.
fn check_header_len(len_bytes: [u8; 8], file_len: u64, path: &Path) -> Result<usize, CheckpointError> {
    if file_len < 8 {
        return Err(CheckpointError::HeaderLength {
            shard: path.to_owned(),
            message: format!("the file is {file_len} bytes, shorter than the 8-byte length prefix"),
        });
    }
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > HEADER_LEN_MAX || header_len > file_len - 8 {
        return Err(CheckpointError::HeaderLength {
            shard: path.to_owned(),
            message: format!(
                "the header length prefix says {header_len} bytes but the file holds {} after the prefix{}",
                file_len - 8,
                if header_len > HEADER_LEN_MAX { " (and the format caps headers at 100 MB)" } else { "" }
            ),
        });
    }
    // The bound above makes the cast lossless: header_len <= 100 MB.
    Ok(header_len as usize)
}

fn header_from_json(json: &[u8], file_len: u64, path: &Path) -> Result<Header, CheckpointError> {
    let entries =
        parse_header_json(json).map_err(|source| CheckpointError::HeaderJson { shard: path.to_owned(), source })?;
    Ok(Header { file_len, data_start: 8 + json.len() as u64, entries })
}

/// Parses the header JSON into entries in file order, skipping `__metadata__`.
pub fn parse_header_json(json: &[u8]) -> Result<Vec<(String, RawEntry)>, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(json);
    let entries = de.deserialize_map(EntriesVisitor)?;
    de.end()?;
    Ok(entries)
}

struct EntriesVisitor;

impl<'de> Visitor<'de> for EntriesVisitor {
    type Value = Vec<(String, RawEntry)>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a safetensors header object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(0));
        while let Some(name) = map.next_key::<String>()? {
            if name == "__metadata__" {
                map.next_value::<IgnoredAny>()?;
            } else {
                entries.push((name, map.next_value::<RawEntry>()?));
            }
        }
        Ok(entries)
    }
}

impl Dtype {
    /// Parses a safetensors dtype string.
    pub fn parse(s: &str) -> Option<Dtype> {
        Some(match s {
            "BOOL" => Dtype::Bool,
            "U8" => Dtype::U8,
            "I8" => Dtype::I8,
            "F8_E4M3" => Dtype::F8E4M3,
            "F8_E5M2" => Dtype::F8E5M2,
            "U16" => Dtype::U16,
            "I16" => Dtype::I16,
            "F16" => Dtype::F16,
            "BF16" => Dtype::Bf16,
            "U32" => Dtype::U32,
            "I32" => Dtype::I32,
            "F32" => Dtype::F32,
            "U64" => Dtype::U64,
            "I64" => Dtype::I64,
            "F64" => Dtype::F64,
            _ => return None,
        })
    }
}

/// Serialises tensors into the safetensors format (test fixtures and the trunk pack).
/// `tensors` are (name, dtype string, shape, bytes) in the order they are laid out.
pub fn serialize(tensors: &[(&str, &str, &[u64], &[u8])]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut offset = 0u64;
    for (name, dtype, shape, bytes) in tensors {
        let end = offset + bytes.len() as u64;
        header.insert(
            (*name).to_owned(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut v = serde_json::Value::Object(header);
    v.sort_all_objects();
    let mut json = v.to_string().into_bytes();
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len() + offset as usize);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    for (_, _, _, bytes) in tensors {
        out.extend_from_slice(bytes);
    }
    out
}
