//! The checkpoint index: where every tensor of a model directory lives (spec section 1).
//!
//! Indexes `model.safetensors.index.json` when present, otherwise every `*.safetensors` sorted by
//! name; parses only headers (in parallel across shards) and validates each entry: known dtype,
//! byte count = elements x size, range inside the file, no duplicate names, no overlapping ranges.
//! Errors name the shard and the tensor. Runs at start-up; the result is immutable and shared.
#![forbid(unsafe_code)]

pub mod expert_sums;
mod experts;
pub mod safetensors;
mod schema;
mod sizes;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::Serialize;

use crate::exit::{Classify, ExitCode};

pub use experts::{ExpertImage, ExpertPart, ExpertRef, ExpertTable, ExpertWindow, EXPERT_PARTS};
pub use schema::{expected_tensors, Census, ExpectedTensor, LayerCensus, Validation, LANGUAGE_MODEL_PREFIX};

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
/// A `model.safetensors.index.json` larger than this is refused unread (the release's is a
/// few MB for its ~100k tensors).
pub const INDEX_BYTES_MAX: u64 = 1 << 30;

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
    /// A shard or index that is not a regular file, or an index larger than any (exit 3).
    #[error(transparent)]
    Input(#[from] crate::files::InputError),
}

impl Classify for CheckpointError {
    fn exit_code(&self) -> ExitCode {
        match self {
            CheckpointError::Io { .. } => ExitCode::Io,
            CheckpointError::Input(e) => e.exit_code(),
            CheckpointError::NoShards { .. }
            | CheckpointError::IndexInvalid { .. }
            | CheckpointError::HeaderLength { .. }
            | CheckpointError::HeaderJson { .. }
            | CheckpointError::Tensor { .. }
            | CheckpointError::Duplicate { .. }
            | CheckpointError::Overlap { .. }
            | CheckpointError::Schema { .. } => ExitCode::Data,
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
    by_name: NameTable,
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
            (map.shards.clone(), Some((index_path, map)))
        } else {
            (list_shards(dir)?, None)
        };
        if shard_names.is_empty() {
            return Err(CheckpointError::NoShards { dir: dir.to_owned() });
        }
        let paths: Vec<PathBuf> = shard_names.iter().map(|n| dir.join(n)).collect();
        if let Some((index_path, _)) = &weight_map {
            if let Some(missing) = paths.iter().find(|p| !p.exists()) {
                return Err(missing_shard(index_path, missing));
            }
        }
        let headers: Vec<safetensors::Header> =
            paths.par_iter().map(|p| safetensors::read_header(p)).collect::<Result<_, CheckpointError>>()?;
        CheckpointIndex::assemble(dir, paths, headers, weight_map)
    }

    /// Indexes a checkpoint held in memory: `index_json` plays `model.safetensors.index.json`
    /// and `shards` are (file name, whole file) pairs. The same checks as [`Self::open`], without
    /// the filesystem (`dir` only names files in errors); the fuzz targets parse through this.
    #[doc(hidden)]
    pub fn from_memory(
        dir: &Path,
        index_json: Option<&[u8]>,
        shards: &[(&str, &[u8])],
    ) -> Result<CheckpointIndex, CheckpointError> {
        let weight_map = match index_json {
            Some(bytes) => {
                let index_path = dir.join(INDEX_FILE);
                let map = parse_weight_map(bytes, &index_path)?;
                Some((index_path, map))
            }
            None => None,
        };
        let shard_names: Vec<String> = match &weight_map {
            Some((_, map)) => map.shards.clone(),
            None => {
                let mut names: Vec<String> =
                    shards.iter().map(|(n, _)| (*n).to_owned()).filter(|n| n.ends_with(".safetensors")).collect();
                names.sort();
                names
            }
        };
        if shard_names.is_empty() {
            return Err(CheckpointError::NoShards { dir: dir.to_owned() });
        }
        let mut paths = Vec::with_capacity(shard_names.len());
        let mut headers = Vec::with_capacity(shard_names.len());
        for name in &shard_names {
            let path = dir.join(name);
            let Some((_, bytes)) = shards.iter().find(|(n, _)| n == name) else {
                let index_path = weight_map.as_ref().map_or_else(|| dir.join(INDEX_FILE), |(p, _)| p.clone());
                return Err(missing_shard(&index_path, &path));
            };
            headers.push(safetensors::parse_header(bytes, &path)?);
            paths.push(path);
        }
        CheckpointIndex::assemble(dir, paths, headers, weight_map)
    }

    /// Validates the parsed headers of `paths` (in shard order) into an index and checks the
    /// index file, if any, against them.
    fn assemble(
        dir: &Path,
        paths: Vec<PathBuf>,
        headers: Vec<safetensors::Header>,
        weight_map: Option<(PathBuf, WeightMap)>,
    ) -> Result<CheckpointIndex, CheckpointError> {
        let per_shard: Vec<(Shard, Vec<TensorInfo>)> = paths
            .into_par_iter()
            .zip(headers)
            .enumerate()
            .map(|(i, (p, header))| {
                let shard = Shard { path: p.clone(), file_len: header.file_len, data_start: header.data_start };
                Ok((shard, shard_tensors(i, &p, header)?))
            })
            .collect::<Result<_, CheckpointError>>()?;
        let mut shards = Vec::with_capacity(per_shard.len());
        let mut tensors = Vec::with_capacity(per_shard.iter().map(|(_, t)| t.len()).sum());
        for (shard, list) in per_shard {
            shards.push(shard);
            tensors.extend(list);
        }
        let by_name = name_table(&tensors, &shards)?;
        let experts = ExpertTable::build(&tensors)?;
        let index = CheckpointIndex { dir: dir.to_owned(), shards, tensors, by_name, experts };
        if let Some((path, map)) = &weight_map {
            check_weight_map(path, map, &index)?;
        }
        Ok(index)
    }

    /// The tensor called `name`, if any.
    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.position(name).map(|i| &self.tensors[i])
    }

    /// Position of `name` in [`Self::tensors`].
    pub fn position(&self, name: &str) -> Option<usize> {
        self.by_name.get(&self.tensors, name)
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

/// `weight_map` of the index file: tensor names with a shard id into the sorted shard names.
#[derive(Debug, Default)]
struct WeightMap {
    /// Distinct shard file names, sorted; shard ids index this list.
    shards: Vec<String>,
    entries: Vec<(String, usize)>,
}

/// Reads `weight_map` without allocating a shard name per tensor (the release maps 497k names
/// onto 96 files).
struct WeightMapVisitor;

impl<'de> serde::de::Visitor<'de> for WeightMapVisitor {
    type Value = WeightMap;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an object of tensor name to shard file name")
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<WeightMap, A::Error> {
        let mut out = WeightMap::default();
        let mut ids: HashMap<String, usize> = HashMap::new();
        while let Some(name) = map.next_key::<String>()? {
            let shard: std::borrow::Cow<'de, str> = map.next_value()?;
            let next = ids.len();
            let id = match ids.get(shard.as_ref()) {
                Some(&id) => id,
                None => *ids.entry(shard.into_owned()).or_insert(next),
            };
            out.entries.push((name, id));
        }
        // Renumber so that ids follow the sorted shard names.
        let mut named: Vec<(String, usize)> = ids.into_iter().collect();
        named.sort();
        let mut renumber = vec![0; named.len()];
        for (sorted, (name, old)) in named.into_iter().enumerate() {
            renumber[old] = sorted;
            out.shards.push(name);
        }
        for e in &mut out.entries {
            e.1 = renumber[e.1];
        }
        Ok(out)
    }
}

fn read_weight_map(path: &Path) -> Result<WeightMap, CheckpointError> {
    let text = crate::files::input::read_regular(path, INDEX_BYTES_MAX, "a checkpoint index").map_err(|e| match e {
        crate::files::InputError::Io { path, source, .. } => CheckpointError::Io { path, op: "read", source },
        e => CheckpointError::Input(e),
    })?;
    parse_weight_map(&text, path)
}

/// Parses the text of an index file; `path` only names it in errors.
fn parse_weight_map(text: &[u8], path: &Path) -> Result<WeightMap, CheckpointError> {
    struct Seed;
    impl<'de> serde::de::DeserializeSeed<'de> for Seed {
        type Value = WeightMap;
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<WeightMap, D::Error> {
            d.deserialize_map(WeightMapVisitor)
        }
    }
    struct IndexVisitor;
    impl<'de> serde::de::Visitor<'de> for IndexVisitor {
        type Value = Option<WeightMap>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an index object with a weight_map")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut found = None;
            while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                if key == "weight_map" {
                    found = Some(map.next_value_seed(Seed)?);
                } else {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
            Ok(found)
        }
    }
    let invalid = |message: String| CheckpointError::IndexInvalid { path: path.to_owned(), message };
    let mut de = serde_json::Deserializer::from_slice(text);
    let parsed = serde::Deserializer::deserialize_map(&mut de, IndexVisitor).and_then(|m| de.end().map(|()| m));
    let map = parsed
        .map_err(|e| invalid(format!("not valid index JSON: {e}")))?
        .ok_or_else(|| invalid("it has no weight_map".to_owned()))?;
    for shard in &map.shards {
        let plain = !shard.is_empty() && !shard.contains('/') && !shard.contains('\\') && shard != "." && shard != "..";
        if !plain {
            return Err(invalid(format!(
                "it maps tensors to {shard:?}, which is not a file name in the model directory"
            )));
        }
    }
    Ok(map)
}

fn missing_shard(index_path: &Path, missing: &Path) -> CheckpointError {
    CheckpointError::IndexInvalid {
        path: index_path.to_owned(),
        message: format!("it names shard {}, which does not exist", missing.display()),
    }
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
fn shard_tensors(shard: usize, path: &Path, header: safetensors::Header) -> Result<Vec<TensorInfo>, CheckpointError> {
    let bad = |tensor: &str, message: String| CheckpointError::Tensor {
        shard: path.to_owned(),
        tensor: tensor.to_owned(),
        message,
    };
    let data_len = header.file_len - header.data_start;
    let mut out = Vec::with_capacity(header.entries.len());
    for (name, e) in header.entries {
        let dtype = match &e.dtype {
            safetensors::RawDtype::Known(d) => *d,
            safetensors::RawDtype::Unknown(s) => return Err(bad(&name, format!("unknown dtype {s:?}"))),
        };
        let [begin, end] = e.data_offsets;
        if begin > end {
            return Err(bad(&name, format!("data_offsets [{begin}, {end}] run backwards")));
        }
        let elements = e
            .shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| bad(&name, format!("shape {:?} overflows", e.shape)))?;
        if elements != end - begin {
            return Err(bad(
                &name,
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
                &name,
                format!(
                    "data_offsets [{begin}, {end}] run past the end of the data ({data_len} bytes): the file is truncated or the header is wrong"
                ),
            ));
        }
        out.push(TensorInfo {
            name,
            shard,
            dtype,
            shape: e.shape,
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

fn name_hash(name: &str) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = rustc_hash::FxBuildHasher.build_hasher();
    h.write(name.as_bytes());
    h.finish()
}

/// Name lookup without copying the 500k names: a hash of each name maps to its tensor; the rare
/// hash collision between different names goes to a side list.
#[derive(Debug, Default)]
struct NameTable {
    first: HashMap<u64, usize, rustc_hash::FxBuildHasher>,
    collisions: Vec<(u64, usize)>,
}

impl NameTable {
    fn get(&self, tensors: &[TensorInfo], name: &str) -> Option<usize> {
        let h = name_hash(name);
        let &i = self.first.get(&h)?;
        if tensors[i].name == name {
            return Some(i);
        }
        self.collisions.iter().find(|&&(ch, j)| ch == h && tensors[j].name == name).map(|&(_, j)| j)
    }
}

fn name_table(tensors: &[TensorInfo], shards: &[Shard]) -> Result<NameTable, CheckpointError> {
    let mut table = NameTable::default();
    table.first.reserve(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        if let Some(prev) = table.get(tensors, &t.name) {
            return Err(CheckpointError::Duplicate {
                tensor: t.name.clone(),
                first: shards[tensors[prev].shard].path.clone(),
                second: shards[t.shard].path.clone(),
            });
        }
        let h = name_hash(&t.name);
        match table.first.entry(h) {
            std::collections::hash_map::Entry::Occupied(_) => table.collisions.push((h, i)),
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(i);
            }
        }
    }
    Ok(table)
}

/// The index file and the shard headers must agree tensor for tensor.
fn check_weight_map(path: &Path, map: &WeightMap, index: &CheckpointIndex) -> Result<(), CheckpointError> {
    let invalid = |message: String| CheckpointError::IndexInvalid { path: path.to_owned(), message };
    let names: Vec<&str> =
        index.shards.iter().map(|s| s.path.file_name().and_then(|n| n.to_str()).unwrap_or("")).collect();
    // Lookups are independent: run them in parallel, then mark positions in order.
    let positions: Vec<usize> = map
        .entries
        .par_iter()
        .map(|(name, shard)| {
            let want = &map.shards[*shard];
            let pos = index.position(name).ok_or_else(|| {
                invalid(format!("tensor {name} is listed for {want} but that shard's header lacks it"))
            })?;
            let have = names[index.tensors[pos].shard];
            if have != want {
                return Err(invalid(format!("tensor {name} is in {have} but the index says {want}")));
            }
            Ok(pos)
        })
        .collect::<Result<_, _>>()?;
    let mut listed = vec![false; index.tensors.len()];
    for pos in positions {
        if std::mem::replace(&mut listed[pos], true) {
            return Err(invalid(format!("tensor {} is listed twice", index.tensors[pos].name)));
        }
    }
    if let Some(pos) = listed.iter().position(|l| !l) {
        let t = &index.tensors[pos];
        return Err(invalid(format!("tensor {} in {} is not in the index", t.name, names[t.shard])));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::CheckpointError;
    use crate::exit::{Classify, ExitCode};
    use std::path::PathBuf;

    #[test]
    fn io_exits_4_and_invalid_data_exits_3() {
        let io = CheckpointError::Io {
            path: PathBuf::from("/m/model-00001.safetensors"),
            op: "open",
            source: std::io::Error::from_raw_os_error(libc::ENOENT),
        };
        assert_eq!(io.exit_code(), ExitCode::Io);
        let header = CheckpointError::HeaderLength { shard: PathBuf::from("/m/s"), message: "too long".into() };
        assert_eq!(header.exit_code(), ExitCode::Data);
        let schema = CheckpointError::Schema { tensor: "model.norm.weight".into(), message: "missing".into() };
        assert_eq!(schema.exit_code(), ExitCode::Data);
    }
}
