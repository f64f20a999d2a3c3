//! The trunk pack: every non-expert tensor copied into one file laid out for streaming.
//!
//! Each unit (the embedding, the head, each layer's trunk) is one run whose start and length are
//! multiples of the device's O_DIRECT alignment, with its tensors in the order the forward pass
//! reads them (each at a 64-byte boundary for SIMD loads). A JSON manifest gives per-unit
//! offsets, per-tensor offsets, dtypes and shapes, and an xxh3 checksum per unit. Routed experts
//! are not copied: they are read in place from the shards.
//!
//! Crash safety: the old manifest is removed before anything is written, the pack is written
//! under a temporary name, synced and renamed, and only then is the manifest written (also via a
//! synced rename) with `complete: true`. An interrupted pack therefore never leaves a manifest
//! that claims to be complete. A fingerprint of the source (config, shard names, sizes, mtimes
//! and headers) makes a second run on an up-to-date pack a no-op.

use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use crate::checkpoint::{expected_tensors, CheckpointIndex, Dtype, MODEL_PREFIX};
use crate::config::Config;
use crate::exit::{Classify, ExitCode};

pub const MANIFEST_FILE: &str = "trunk.manifest.json";
pub const PACK_FILE: &str = "trunk.pack";
const PARTIAL_SUFFIX: &str = ".partial";
pub const FORMAT: &str = "k3ring-trunk-pack";
pub const VERSION: u32 = 2;
/// Tensors start at this boundary inside a unit.
pub const TENSOR_ALIGN: u64 = 64;
/// Units start and end at a multiple of at least this, whatever the device reports.
pub const UNIT_ALIGN_MIN: u64 = 4096;
/// Copy granularity.
const COPY_CHUNK: usize = 16 << 20;
/// Units copied at once (each holds one COPY_CHUNK buffer).
const COPY_THREADS: usize = 4;

/// Why a pack could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    #[error("cannot {op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Corrupt { path: PathBuf, message: String },
    #[error("the trunk pack in {dir} was made from another checkpoint (or the checkpoint changed since): run `k3ring pack --model ... --out {dir}` again")]
    Stale { dir: PathBuf },
    #[error("{path}: unit {unit} fails its checksum (manifest {want}, file {got}): the pack is damaged; run `k3ring pack` again")]
    Checksum { path: PathBuf, unit: String, want: String, got: String },
}

/// 4 for I/O failures, 3 for a pack that is corrupt, stale or damaged.
impl Classify for PackError {
    fn exit_code(&self) -> ExitCode {
        match self {
            PackError::Io { .. } => ExitCode::Io,
            PackError::Corrupt { .. } | PackError::Stale { .. } | PackError::Checksum { .. } => ExitCode::Data,
        }
    }
}

/// What a unit holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PackUnit {
    /// `embed_tokens`, read by rows.
    Embed,
    /// Output aggregator, final norm, lm_head.
    Head,
    Layer(usize),
}

impl PackUnit {
    pub fn name(self) -> String {
        match self {
            PackUnit::Embed => "embed".to_owned(),
            PackUnit::Head => "head".to_owned(),
            PackUnit::Layer(l) => format!("layer.{l}"),
        }
    }

    pub fn parse(s: &str) -> Option<PackUnit> {
        match s {
            "embed" => Some(PackUnit::Embed),
            "head" => Some(PackUnit::Head),
            _ => s.strip_prefix("layer.")?.parse().ok().map(PackUnit::Layer),
        }
    }
}

/// One tensor inside a unit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PackedTensor {
    pub name: String,
    /// Offset from the start of the unit.
    pub offset: u64,
    pub len: u64,
    pub dtype: String,
    pub shape: Vec<u64>,
}

/// One aligned run of the pack file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct UnitEntry {
    pub unit: String,
    pub offset: u64,
    /// Padded to the alignment.
    pub len: u64,
    /// xxh3-64 of the unit's `len` bytes, hex.
    pub checksum: String,
    pub tensors: Vec<PackedTensor>,
    /// For the embedding: xxh3-64 of each row, since it is read by rows and never whole.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub row_checksums: Vec<u64>,
}

/// The manifest (`trunk.manifest.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub complete: bool,
    pub fingerprint: String,
    pub alignment: u64,
    pub pack_len: u64,
    pub units: Vec<UnitEntry>,
}

/// What `write_pack` did.
#[derive(Clone, Debug, Serialize)]
pub struct PackReport {
    pub up_to_date: bool,
    pub units: usize,
    pub tensors: usize,
    pub bytes: u64,
    pub seconds: f64,
    pub alignment: u64,
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> PackError + 'a {
    move |source| PackError::Io { op, path: path.to_owned(), source }
}

/// A fingerprint of what the pack is made from: config bytes, and each shard's name, size,
/// modification time and header.
pub fn fingerprint(model_dir: &Path, index: &CheckpointIndex) -> Result<String, PackError> {
    let mut h = Xxh3::new();
    let cfg_path = model_dir.join("config.json");
    h.update(&std::fs::read(&cfg_path).map_err(io_err("read", &cfg_path))?);
    for shard in &index.shards {
        let meta = std::fs::metadata(&shard.path).map_err(io_err("stat", &shard.path))?;
        let mtime = meta.modified().ok().and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
        h.update(shard.path.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default());
        h.update(&meta.len().to_le_bytes());
        h.update(&mtime.map_or(0, |d| d.as_nanos()).to_le_bytes());
        let mut header = vec![0u8; shard.data_start as usize];
        File::open(&shard.path)
            .and_then(|mut f| f.read_exact(&mut header))
            .map_err(io_err("read header of", &shard.path))?;
        h.update(&header);
    }
    Ok(format!("{:016x}", h.digest()))
}

/// The trunk tensors of `cfg` grouped into units, in forward order.
pub fn plan_units(cfg: &Config) -> Vec<(PackUnit, Vec<crate::checkpoint::ExpectedTensor>)> {
    let embed_name = format!("{MODEL_PREFIX}embed_tokens.weight");
    let mut units: Vec<(PackUnit, Vec<_>)> = vec![(PackUnit::Embed, Vec::new()), (PackUnit::Head, Vec::new())];
    units.extend((0..cfg.n_layers).map(|l| (PackUnit::Layer(l), Vec::new())));
    for t in expected_tensors(cfg) {
        if t.expert.is_some() {
            continue;
        }
        let slot = match t.layer {
            Some(l) => 2 + l,
            None if t.name == embed_name => 0,
            None => 1,
        };
        units[slot].1.push(t);
    }
    units
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// Unit alignment for the pack directory: the device's O_DIRECT alignment, at least 4096.
pub fn unit_alignment(out_dir: &Path) -> u64 {
    let probe = out_dir.join(".k3ring-align-probe");
    let align = File::create(&probe)
        .map(|f| u64::from(super::io::dio_alignment(&f, &probe).offset_align))
        .unwrap_or(UNIT_ALIGN_MIN);
    let _ = std::fs::remove_file(&probe);
    align.max(UNIT_ALIGN_MIN)
}

/// Writes (or confirms up to date) the trunk pack of a validated model into `out_dir`.
/// `progress` is called with (bytes done, bytes total).
pub fn write_pack(
    model_dir: &Path,
    cfg: &Config,
    index: &CheckpointIndex,
    out_dir: &Path,
    mut progress: impl FnMut(u64, u64) + Send,
) -> Result<PackReport, PackError> {
    let start = std::time::Instant::now();
    std::fs::create_dir_all(out_dir).map_err(io_err("create", out_dir))?;
    let fp = fingerprint(model_dir, index)?;
    let manifest_path = out_dir.join(MANIFEST_FILE);
    let pack_path = out_dir.join(PACK_FILE);
    if let Ok(m) = Manifest::load(out_dir) {
        if m.fingerprint == fp {
            let tensors = m.units.iter().map(|u| u.tensors.len()).sum();
            return Ok(PackReport {
                up_to_date: true,
                units: m.units.len(),
                tensors,
                bytes: m.pack_len,
                seconds: start.elapsed().as_secs_f64(),
                alignment: m.alignment,
            });
        }
    }
    match std::fs::remove_file(&manifest_path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(PackError::Io { op: "remove", path: manifest_path, source: e }),
    }
    let alignment = unit_alignment(out_dir);
    let (units, pack_len) = layout(cfg, index, alignment)?;
    let total: u64 = units.iter().map(|u| u.len).sum();
    let partial = out_dir.join(format!("{PACK_FILE}{PARTIAL_SUFFIX}"));
    let file = create_pack_file(&partial)?;
    file.set_len(pack_len).map_err(io_err("size", &partial))?;
    // Units are copied in parallel (each into its own range of the file), so the disk sees
    // several reads and writes at once; each copy goes through one bounded buffer.
    let written = std::sync::Mutex::new((0u64, &mut progress));
    let copy = |mut unit: UnitEntry| -> Result<UnitEntry, PackError> {
        // The embedding is copied in whole rows so each row's checksum comes out of the copy.
        let row = if unit.unit == PackUnit::Embed.name() { Some(2 * cfg.hidden_size) } else { None };
        let (sum, rows) = copy_unit(index, &unit, row, &file, &partial, alignment, &mut |n| {
            let mut w = written.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            w.0 += n;
            let done = w.0;
            (w.1)(done, total);
        })?;
        unit.checksum = sum;
        unit.row_checksums = rows;
        Ok(unit)
    };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(COPY_THREADS).build().map_err(|e| PackError::Io {
        op: "start copy threads for",
        path: partial.clone(),
        source: std::io::Error::other(e),
    })?;
    let units_out: Vec<UnitEntry> = pool.install(|| {
        use rayon::prelude::*;
        units.into_par_iter().map(copy).collect::<Result<_, _>>()
    })?;
    file.sync_all().map_err(io_err("sync", &partial))?;
    drop(file);
    std::fs::rename(&partial, &pack_path).map_err(io_err("rename", &partial))?;
    let manifest = Manifest {
        format: FORMAT.to_owned(),
        version: VERSION,
        complete: true,
        fingerprint: fp,
        alignment,
        pack_len,
        units: units_out,
    };
    let tensors = manifest.units.iter().map(|u| u.tensors.len()).sum();
    let n_units = manifest.units.len();
    write_synced(&manifest_path, &serde_json::to_vec_pretty(&manifest).unwrap_or_default())?;
    sync_dir(out_dir)?;
    Ok(PackReport {
        up_to_date: false,
        units: n_units,
        tensors,
        bytes: pack_len,
        seconds: start.elapsed().as_secs_f64(),
        alignment,
    })
}

/// Unit entries with offsets (checksums still empty) and the pack length.
fn layout(cfg: &Config, index: &CheckpointIndex, alignment: u64) -> Result<(Vec<UnitEntry>, u64), PackError> {
    let mut pos = 0u64;
    let mut out = Vec::new();
    for (unit, tensors) in plan_units(cfg) {
        let mut in_unit = 0u64;
        let mut packed = Vec::with_capacity(tensors.len());
        for t in tensors {
            let info = index.get(&t.name).ok_or_else(|| PackError::Corrupt {
                path: index.dir.clone(),
                message: format!("tensor {} is missing", t.name),
            })?;
            in_unit = align_up(in_unit, TENSOR_ALIGN);
            packed.push(PackedTensor {
                name: t.name.clone(),
                offset: in_unit,
                len: info.len,
                dtype: info.dtype.name().to_owned(),
                shape: info.shape.clone(),
            });
            in_unit += info.len;
        }
        let len = align_up(in_unit.max(1), alignment);
        out.push(UnitEntry {
            unit: unit.name(),
            offset: pos,
            len,
            checksum: String::new(),
            tensors: packed,
            row_checksums: Vec::new(),
        });
        pos += len;
    }
    Ok((out, pos))
}

/// Copies one unit from the shards into the pack window by window through one aligned buffer:
/// each window is assembled (tensor bytes, zero padding), hashed, and written with one aligned
/// write (O_DIRECT when the pack file allows it: buffered writes of hundreds of GB are bound by
/// the kernel's page-cache copying). Returns the unit's checksum and, when `row_len` is given,
/// the checksum of every `row_len`-byte row of its (single) tensor.
fn copy_unit(
    index: &CheckpointIndex,
    unit: &UnitEntry,
    row_len: Option<usize>,
    out: &File,
    out_path: &Path,
    alignment: u64,
    progress: &mut dyn FnMut(u64),
) -> Result<(String, Vec<u64>), PackError> {
    let mut hash = Xxh3::new();
    let mut rows = Vec::new();
    // Windows start on the alignment and on row boundaries, so no row spans two windows.
    let grain = row_len.map_or(alignment, |r| lcm(r as u64, alignment)) as usize;
    let window = (COPY_CHUNK / grain).max(1) * grain;
    let mut buf = super::io::AlignedBuf::new(window, &super::io::BufOptions::default()).map_err(|e| PackError::Io {
        op: "allocate a copy buffer for",
        path: out_path.to_owned(),
        source: std::io::Error::other(e),
    })?;
    let mut sources: Vec<(usize, File)> = Vec::new();
    let mut at = 0u64;
    while at < unit.len {
        let n = ((unit.len - at) as usize).min(window);
        let chunk = &mut buf.as_mut_slice()[..n];
        chunk.fill(0);
        for t in unit.tensors.iter().filter(|t| t.offset < at + n as u64 && t.offset + t.len > at) {
            let info = index.get(&t.name).ok_or_else(|| PackError::Corrupt {
                path: index.dir.clone(),
                message: format!("tensor {} is missing", t.name),
            })?;
            let path = &index.shards[info.shard].path;
            if !sources.iter().any(|(s, _)| *s == info.shard) {
                sources.push((info.shard, File::open(path).map_err(io_err("open", path))?));
            }
            let src = sources
                .iter()
                .find(|(s, _)| *s == info.shard)
                .map(|(_, f)| f)
                .ok_or_else(|| PackError::Corrupt { path: path.clone(), message: "source file vanished".to_owned() })?;
            let from = t.offset.max(at);
            let to = (t.offset + t.len).min(at + n as u64);
            let dst = &mut chunk[(from - at) as usize..(to - at) as usize];
            src.read_exact_at(dst, info.offset + (from - t.offset)).map_err(io_err("read", path))?;
            progress(to - from);
        }
        hash.update(chunk);
        if let (Some(r), Some(t)) = (row_len, unit.tensors.first()) {
            let end = (t.offset + t.len).saturating_sub(at).min(n as u64) as usize;
            rows.extend(chunk[..end].chunks(r).map(xxhash_rust::xxh3::xxh3_64));
        }
        out.write_all_at(chunk, unit.offset + at).map_err(io_err("write", out_path))?;
        at += n as u64;
    }
    Ok((format!("{:016x}", hash.digest()), rows))
}

fn lcm(a: u64, b: u64) -> u64 {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a / x * b
}

/// Opens the pack for writing with O_DIRECT when the filesystem allows it (units and windows
/// are aligned), buffered otherwise (tmpfs).
fn create_pack_file(path: &Path) -> Result<File, PackError> {
    use std::os::unix::fs::OpenOptionsExt;
    let direct =
        std::fs::OpenOptions::new().write(true).create(true).truncate(true).custom_flags(libc::O_DIRECT).open(path);
    match direct {
        Ok(f) => Ok(f),
        Err(_) => File::create(path).map_err(io_err("create", path)),
    }
}

/// xxh3-64 of a unit's bytes, as stored in the manifest.
pub fn checksum(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), PackError> {
    let tmp = path.with_extension("json.partial");
    let mut f = File::create(&tmp).map_err(io_err("create", &tmp))?;
    f.write_all(bytes).map_err(io_err("write", &tmp))?;
    f.sync_all().map_err(io_err("sync", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err("rename", &tmp))
}

fn sync_dir(dir: &Path) -> Result<(), PackError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err("sync", dir))
}

impl Manifest {
    /// Reads and checks a manifest: format, completeness, the pack's length, aligned and
    /// non-overlapping units, tensors inside their unit.
    pub fn load(dir: &Path) -> Result<Manifest, PackError> {
        let path = dir.join(MANIFEST_FILE);
        let text = std::fs::read(&path).map_err(io_err("read", &path))?;
        let corrupt = |message: String| PackError::Corrupt { path: path.clone(), message };
        let m: Manifest = serde_json::from_slice(&text).map_err(|e| corrupt(format!("not a trunk manifest: {e}")))?;
        if m.format != FORMAT || m.version != VERSION {
            return Err(corrupt(format!(
                "format {} v{} is not {FORMAT} v{VERSION}: run `k3ring pack` again",
                m.format, m.version
            )));
        }
        if !m.complete {
            return Err(corrupt("the pack is incomplete (an interrupted `k3ring pack`)".to_owned()));
        }
        if m.alignment < UNIT_ALIGN_MIN || !m.alignment.is_power_of_two() {
            return Err(corrupt(format!("alignment {} is not a power of two >= {UNIT_ALIGN_MIN}", m.alignment)));
        }
        let pack = dir.join(PACK_FILE);
        let len = std::fs::metadata(&pack).map_err(io_err("stat", &pack))?.len();
        if len != m.pack_len {
            return Err(corrupt(format!("{} is {len} bytes but the manifest says {}", pack.display(), m.pack_len)));
        }
        let mut end = 0;
        for u in &m.units {
            if PackUnit::parse(&u.unit).is_none() {
                return Err(corrupt(format!("unknown unit {:?}", u.unit)));
            }
            if u.offset % m.alignment != 0 || u.len % m.alignment != 0 || u.offset < end {
                return Err(corrupt(format!("unit {} at {}+{} is misaligned or overlaps", u.unit, u.offset, u.len)));
            }
            end = u.offset + u.len;
            if end > m.pack_len {
                return Err(corrupt(format!("unit {} ends past the pack", u.unit)));
            }
            if u.unit == "embed" {
                let rows = u.tensors.first().map_or(0, |t| t.shape.first().copied().unwrap_or(0));
                if u.row_checksums.len() as u64 != rows {
                    return Err(corrupt(format!(
                        "the embedding has {rows} rows but {} row checksums",
                        u.row_checksums.len()
                    )));
                }
            }
            for t in &u.tensors {
                if t.offset + t.len > u.len || Dtype::parse(&t.dtype).is_none() {
                    return Err(corrupt(format!("tensor {} of unit {} is out of bounds or untyped", t.name, u.unit)));
                }
            }
        }
        Ok(m)
    }

    /// The entry of `unit`.
    pub fn unit(&self, unit: PackUnit) -> Option<&UnitEntry> {
        let name = unit.name();
        self.units.iter().find(|u| u.unit == name)
    }

    /// Checks the manifest describes this checkpoint.
    pub fn check_source(&self, dir: &Path, model_dir: &Path, index: &CheckpointIndex) -> Result<(), PackError> {
        if self.fingerprint != fingerprint(model_dir, index)? {
            return Err(PackError::Stale { dir: dir.to_owned() });
        }
        Ok(())
    }

    /// Verifies every unit's checksum against the pack file (`k3ring pack --verify`).
    pub fn verify_all(&self, dir: &Path) -> Result<(), PackError> {
        let path = dir.join(PACK_FILE);
        let f = File::open(&path).map_err(io_err("open", &path))?;
        let mut buf = Vec::new();
        for u in &self.units {
            buf.resize(u.len as usize, 0);
            f.read_exact_at(&mut buf, u.offset).map_err(io_err("read", &path))?;
            self.verify_unit(&path, u, &buf)?;
        }
        Ok(())
    }

    /// Checks one unit's bytes against its checksum.
    pub fn verify_unit(&self, path: &Path, u: &UnitEntry, bytes: &[u8]) -> Result<(), PackError> {
        let got = checksum(bytes);
        if got != u.checksum {
            return Err(PackError::Checksum {
                path: path.to_owned(),
                unit: u.unit.clone(),
                want: u.checksum.clone(),
                got,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::PackError;
    use crate::exit::{Classify, ExitCode};
    use std::path::PathBuf;

    #[test]
    fn io_exits_4_and_a_damaged_pack_exits_3() {
        let io = PackError::Io {
            op: "read",
            path: PathBuf::from("/t/trunk.pack"),
            source: std::io::Error::from_raw_os_error(libc::EIO),
        };
        assert_eq!(io.exit_code(), ExitCode::Io);
        assert_eq!(PackError::Stale { dir: PathBuf::from("/t") }.exit_code(), ExitCode::Data);
        let sum = PackError::Checksum {
            path: PathBuf::from("/t/trunk.pack"),
            unit: "layer.3".into(),
            want: "00".into(),
            got: "01".into(),
        };
        assert_eq!(sum.exit_code(), ExitCode::Data);
    }
}
