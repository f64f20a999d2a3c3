//! The checkpoint index: where every tensor of a model directory lives (spec section 1).
//!
//! Indexes `model.safetensors.index.json` when present, otherwise every `*.safetensors` sorted by
//! name; parses only headers (in parallel across shards) and validates each entry: known dtype,
//! byte count = elements x size, range inside the file, no duplicate names, no overlapping ranges.
//! Errors name the shard and the tensor. Runs at start-up; the result is immutable and shared.
#![forbid(unsafe_code)]

mod experts;
pub mod safetensors;
mod schema;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::Serialize;

pub use experts::{ExpertPart, ExpertRef, ExpertTable, EXPERT_PARTS};
pub use schema::{expected_tensors, Census, ExpectedTensor, LayerCensus, Validation};

/// Prefix of every language-model tensor except the head.
pub const MODEL_PREFIX: &str = "language_model.model.";
/// The untied output head.
pub const LM_HEAD: &str = "language_model.lm_head.weight";

/// Element types a safetensors header may name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Dtype {
    Bool,
    U8,
    I8,
    F8E4M3,
    F8E5M2,
    U16,
    I16,
    F16,
    Bf16,
    U32,
    I32,
    F32,
    U64,
    I64,
    F64,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 | Dtype::F8E4M3 | Dtype::F8E5M2 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 => 8,
        }
    }

    /// The name used in safetensors headers.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::U16 => "U16",
            Dtype::I16 => "I16",
            Dtype::F16 => "F16",
            Dtype::Bf16 => "BF16",
            Dtype::U32 => "U32",
            Dtype::I32 => "I32",
            Dtype::F32 => "F32",
            Dtype::U64 => "U64",
            Dtype::I64 => "I64",
            Dtype::F64 => "F64",
        }
    }
}

/// Why a checkpoint was refused. I/O failures exit 4, invalid data exits 3.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot {op} {path}: {source}")]
    Io { path: PathBuf, op: &'static str, source: std::io::Error },
    #[error("{dir}: no model.safetensors.index.json and no *.safetensors files")]
    NoShards { dir: PathBuf },
    #[error("{path}: invalid index: {message}")]
    IndexInvalid { path: PathBuf, message: String },
    #[error("{shard}: bad header: {message}")]
    HeaderLength { shard: PathBuf, message: String },
    #[error("{shard}: header is not valid safetensors JSON: {source}")]
    HeaderJson { shard: PathBuf, source: serde_json::Error },
    #[error("{shard}: tensor {tensor}: {message}")]
    Tensor { shard: PathBuf, tensor: String, message: String },
    #[error("tensor {tensor} appears in both {first} and {second}")]
    Duplicate { tensor: String, first: PathBuf, second: PathBuf },
    #[error("{shard}: tensors {first} and {second} overlap (bytes {first_range:?} and {second_range:?})")]
    Overlap {
        shard: PathBuf,
        first: String,
        second: String,
        first_range: std::ops::Range<u64>,
        second_range: std::ops::Range<u64>,
    },
    #[error("tensor {tensor}: {message}")]
    Schema { tensor: String, message: String },
}

impl CheckpointError {
    /// The documented exit code: 4 for I/O failures, 3 for invalid data.
    pub fn exit_code(&self) -> u8 {
        match self {
            CheckpointError::Io { .. } => 4,
            _ => 3,
        }
    }
}

/// One shard file.
#[derive(Clone, Debug, Serialize)]
pub struct Shard {
    pub path: PathBuf,
    pub file_len: u64,
    /// Absolute offset of the first data byte (8 + header length).
    pub data_start: u64,
}

/// One tensor: its shard and absolute byte range.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TensorInfo {
    pub name: String,
    pub shard: usize,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Absolute byte offset in the shard file.
    pub offset: u64,
    pub len: u64,
}

impl TensorInfo {
    pub fn range(&self) -> std::ops::Range<u64> {
        self.offset..self.offset + self.len
    }
    pub fn elements(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// Index of a model directory.
#[derive(Debug)]
pub struct CheckpointIndex {
    pub dir: PathBuf,
    pub shards: Vec<Shard>,
    pub tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    pub experts: ExpertTable,
}

/// Name of the optional index file.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

impl CheckpointIndex {
    /// Indexes `dir` and validates every header entry.
    pub fn open(dir: &Path) -> Result<CheckpointIndex, CheckpointError> {
        let index_path = dir.join(INDEX_FILE);
        let (shard_names, weight_map) = if index_path.exists() {
            let map = read_weight_map(&index_path)?;
            let mut names: Vec<String> = map.values().cloned().collect();
            names.sort();
            names.dedup();
            (names, Some((index_path, map)))
        } else {
            (list_shards(dir)?, None)
        };
        if shard_names.is_empty() {
            return Err(CheckpointError::NoShards { dir: dir.to_owned() });
        }
        let paths: Vec<PathBuf> = shard_names.iter().map(|n| dir.join(n)).collect();
        if let Some((index_path, _)) = &weight_map {
            if let Some(missing) = paths.iter().find(|p| !p.exists()) {
                return Err(CheckpointError::IndexInvalid {
                    path: index_path.clone(),
                    message: format!("it names shard {}, which does not exist", missing.display()),
                });
            }
        }
        let headers: Vec<safetensors::Header> =
            paths.par_iter().map(|p| safetensors::read_header(p)).collect::<Result<_, _>>()?;
        let per_shard: Vec<Vec<TensorInfo>> = headers
            .par_iter()
            .enumerate()
            .map(|(i, h)| shard_tensors(i, &paths[i], h))
            .collect::<Result<_, _>>()?;
        let shards: Vec<Shard> = headers
            .iter()
            .zip(&paths)
            .map(|(h, p)| Shard { path: p.clone(), file_len: h.file_len, data_start: h.data_start })
            .collect();
        drop(headers);
        let mut tensors = Vec::with_capacity(per_shard.iter().map(Vec::len).sum());
        for list in per_shard {
            tensors.extend(list);
        }
        let by_name = name_table(&tensors, &shards)?;
        if let Some((path, map)) = &weight_map {
            check_weight_map(path, map, &tensors, &shards)?;
        }
        let experts = ExpertTable::build(&tensors)?;
        Ok(CheckpointIndex { dir: dir.to_owned(), shards, tensors, by_name, experts })
    }

    /// The tensor called `name`, if any.
    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).map(|&i| &self.tensors[i])
    }

    /// Position of `name` in [`Self::tensors`].
    pub fn position(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// The shard file holding tensor `t`.
    pub fn shard_path(&self, t: &TensorInfo) -> &Path {
        &self.shards[t.shard].path
    }

    /// Total bytes of tensor data.
    pub fn total_bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.len).sum()
    }
}

fn read_weight_map(path: &Path) -> Result<HashMap<String, String>, CheckpointError> {
    #[derive(serde::Deserialize)]
    struct IndexFile {
        weight_map: HashMap<String, String>,
    }
    let text = std::fs::read(path)
        .map_err(|source| CheckpointError::Io { path: path.to_owned(), op: "read", source })?;
    let index: IndexFile = serde_json::from_slice(&text).map_err(|e| CheckpointError::IndexInvalid {
        path: path.to_owned(),
        message: format!("not a valid index JSON with a weight_map: {e}"),
    })?;
    for (tensor, shard) in &index.weight_map {
        let plain = !shard.is_empty()
            && !shard.contains('/')
            && !shard.contains('\\')
            && shard != "."
            && shard != "..";
        if !plain {
            return Err(CheckpointError::IndexInvalid {
                path: path.to_owned(),
                message: format!("tensor {tensor} maps to {shard:?}, which is not a file name in the model directory"),
            });
        }
    }
    Ok(index.weight_map)
}

fn list_shards(dir: &Path) -> Result<Vec<String>, CheckpointError> {
    let io = |source| CheckpointError::Io { path: dir.to_owned(), op: "list", source };
    let mut names = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let name = entry.map_err(io)?.file_name();
        if let Some(name) = name.to_str() {
            if name.ends_with(".safetensors") {
                names.push(name.to_owned());
            }
        }
    }
    names.sort();
    Ok(names)
}

/// Converts one header's entries into absolute, validated tensor records.
fn shard_tensors(
    shard: usize,
    path: &Path,
    header: &safetensors::Header,
) -> Result<Vec<TensorInfo>, CheckpointError> {
    let bad = |tensor: &str, message: String| CheckpointError::Tensor {
        shard: path.to_owned(),
        tensor: tensor.to_owned(),
        message,
    };
    let data_len = header.file_len - header.data_start;
    let mut out = Vec::with_capacity(header.entries.len());
    for (name, e) in &header.entries {
        let dtype = Dtype::parse(&e.dtype)
            .ok_or_else(|| bad(name, format!("unknown dtype {:?}", e.dtype)))?;
        let [begin, end] = e.data_offsets;
        if begin > end {
            return Err(bad(name, format!("data_offsets [{begin}, {end}] run backwards")));
        }
        let elements = e
            .shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| bad(name, format!("shape {:?} overflows", e.shape)))?;
        if elements != end - begin {
            return Err(bad(
                name,
                format!(
                    "shape {:?} of {} needs {elements} bytes but data_offsets [{begin}, {end}] hold {}",
                    e.shape,
                    dtype.name(),
                    end - begin
                ),
            ));
        }
        if end > data_len {
            return Err(bad(
                name,
                format!(
                    "data_offsets [{begin}, {end}] run past the end of the data ({data_len} bytes): the file is truncated or the header is wrong"
                ),
            ));
        }
        out.push(TensorInfo {
            name: name.clone(),
            shard,
            dtype,
            shape: e.shape.clone(),
            offset: header.data_start + begin,
            len: end - begin,
        });
    }
    check_overlaps(path, &out)?;
    Ok(out)
}

fn check_overlaps(path: &Path, tensors: &[TensorInfo]) -> Result<(), CheckpointError> {
    let mut order: Vec<&TensorInfo> = tensors.iter().filter(|t| t.len > 0).collect();
    order.sort_by_key(|t| t.offset);
    for pair in order.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        if a.range().end > b.offset {
            return Err(CheckpointError::Overlap {
                shard: path.to_owned(),
                first: a.name.clone(),
                second: b.name.clone(),
                first_range: a.range(),
                second_range: b.range(),
            });
        }
    }
    Ok(())
}

fn name_table(
    tensors: &[TensorInfo],
    shards: &[Shard],
) -> Result<HashMap<String, usize>, CheckpointError> {
    let mut by_name = HashMap::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        if let Some(prev) = by_name.insert(t.name.clone(), i) {
            return Err(CheckpointError::Duplicate {
                tensor: t.name.clone(),
                first: shards[tensors[prev].shard].path.clone(),
                second: shards[t.shard].path.clone(),
            });
        }
    }
    Ok(by_name)
}

/// The index file and the shard headers must agree tensor for tensor.
fn check_weight_map(
    path: &Path,
    map: &HashMap<String, String>,
    tensors: &[TensorInfo],
    shards: &[Shard],
) -> Result<(), CheckpointError> {
    let invalid = |message: String| CheckpointError::IndexInvalid { path: path.to_owned(), message };
    for t in tensors {
        let shard_name = shards[t.shard].path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        match map.get(&t.name) {
            Some(s) if s == shard_name => {}
            Some(s) => {
                return Err(invalid(format!(
                    "tensor {} is in {shard_name} but the index says {s}",
                    t.name
                )))
            }
            None => return Err(invalid(format!("tensor {} in {shard_name} is not in the index", t.name))),
        }
    }
    if map.len() != tensors.len() {
        let present: std::collections::HashSet<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
        let mut missing: Vec<&String> = map.keys().filter(|k| !present.contains(k.as_str())).collect();
        missing.sort();
        if let Some(first) = missing.first() {
            return Err(invalid(format!(
                "tensor {first} is listed for {} but that shard's header lacks it",
                map[*first]
            )));
        }
    }
    Ok(())
}
