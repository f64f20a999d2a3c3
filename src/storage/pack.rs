//! The trunk pack: every non-expert tensor copied into one file laid out for streaming.
//!
//! Each unit (the embedding, the head, each layer's trunk) is one run whose start and length are
//! multiples of the device's O_DIRECT alignment, with its tensors in the order the forward pass
//! reads them (each at a 64-byte boundary for SIMD loads). A JSON manifest gives per-unit
//! offsets, per-tensor offsets, dtypes and shapes, and an xxh3 checksum per unit. Routed experts
//! are not copied: they are read in place from the shards, and the manifest holds a checksum of
//! each ([`experts`]), which the store checks on every read.
//!
//! Crash safety: the old manifest is removed before anything is written, the pack is written
//! under a temporary name, synced and renamed, and only then is the manifest written (also via a
//! synced rename) with `complete: true`. An interrupted pack therefore never leaves a manifest
//! that claims to be complete, and a failed one (a full disk) removes its partial file. One pack
//! at a time per directory ([`lock`]). A content [`fingerprint`] of the source makes a second
//! run on an up-to-date pack a no-op, also on a copy of the checkpoint.

pub mod align;
pub mod experts;
pub mod fingerprint;
pub mod lock;
pub mod verify;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use kernels::hash::Xxh3;
use serde::{Deserialize, Serialize};

pub use self::experts::LayerExpertSums;
pub use self::fingerprint::fingerprint;
use self::lock::PackLock;
use crate::checkpoint::{expected_tensors, CheckpointIndex, Dtype, MODEL_PREFIX};
use crate::config::Config;
use crate::exit::{Classify, ExitCode};

pub const MANIFEST_FILE: &str = "trunk.manifest.json";
pub const PACK_FILE: &str = "trunk.pack";
const PARTIAL_SUFFIX: &str = ".partial";
pub const FORMAT: &str = "k3ring-trunk-pack";
/// 3: expert checksums and a content fingerprint (v2 manifests are refused: pack again).
pub const VERSION: u32 = 3;
/// Tensors start at this boundary inside a unit.
pub const TENSOR_ALIGN: u64 = 64;
/// Units start and end at a multiple of at least this, whatever the device reports.
pub const UNIT_ALIGN_MIN: u64 = 4096;
/// Copy granularity.
pub(crate) const COPY_CHUNK: usize = 16 << 20;
/// Layers a manifest may give expert checksums for (the checkpoint index's own bound).
const EXPERT_LAYERS_MAX: usize = 4096;
/// Units copied at once (each holds one COPY_CHUNK buffer).
const COPY_THREADS: usize = 4;

/// Why a pack could not be written or read.
/// A manifest larger than this is refused unread (the release's, with a checksum per expert, is
/// a few MB).
pub const MANIFEST_BYTES_MAX: u64 = 1 << 30;

#[derive(Debug, thiserror::Error)]
pub enum PackError {
    #[error("cannot {op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
    #[error("no trunk pack in {dir}: {MANIFEST_FILE} is missing (not a pack directory, or a `k3ring pack` that was interrupted); run `k3ring pack --model ... --out {dir}`")]
    NoManifest { dir: PathBuf },
    #[error("{path}: {message}")]
    Corrupt { path: PathBuf, message: String },
    #[error("the trunk pack in {dir} was made from another checkpoint (or the checkpoint changed since): run `k3ring pack --model ... --out {dir}` again")]
    Stale { dir: PathBuf },
    #[error("{path}: unit {unit} fails its checksum (manifest {want}, file {got}): the pack is damaged; run `k3ring pack` again")]
    Checksum { path: PathBuf, unit: String, want: String, got: String },
    #[error("another `k3ring pack` is writing into {dir} (it holds {lock}); wait for it to finish, or pack into another --out")]
    Busy { dir: PathBuf, lock: PathBuf },
    #[error("`k3ring pack --verify` found {count} mismatch(es) in the trunk pack in {dir} or its checkpoint (`k3ring pack --force` writes it again); the first: {first}")]
    Verify { dir: PathBuf, count: usize, first: String },
    #[error(transparent)]
    Output(#[from] crate::files::OutputError),
    #[error(transparent)]
    Input(#[from] crate::files::InputError),
}

/// 4 for I/O failures and a directory another pack holds, 3 for a pack that is corrupt, stale
/// or damaged.
impl Classify for PackError {
    fn exit_code(&self) -> ExitCode {
        match self {
            PackError::Io { .. } | PackError::Busy { .. } | PackError::NoManifest { .. } => ExitCode::Io,
            PackError::Corrupt { .. }
            | PackError::Stale { .. }
            | PackError::Checksum { .. }
            | PackError::Verify { .. } => ExitCode::Data,
            PackError::Output(e) => e.exit_code(),
            PackError::Input(e) => e.exit_code(),
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
    /// Checksums of the routed experts (read in place from the shards), per MoE layer.
    pub experts: Vec<LayerExpertSums>,
}

/// What `write_pack` did.
#[derive(Clone, Debug, Serialize)]
pub struct PackReport {
    pub up_to_date: bool,
    /// Why an existing pack of the same checkpoint was packed again (damaged, or `--force`).
    pub repacked: Option<String>,
    pub units: usize,
    pub tensors: usize,
    pub bytes: u64,
    /// Experts checksummed, and their bytes.
    pub experts: usize,
    pub expert_bytes: u64,
    pub seconds: f64,
    pub alignment: u64,
}

pub(crate) fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> PackError + 'a {
    move |source| PackError::Io { op, path: path.to_owned(), source }
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

/// Writes (or confirms up to date) the trunk pack of a validated model into `out_dir`.
/// `progress` is called with (bytes done, bytes total): the trunk copied, then the experts
/// checksummed. Holds the directory's lock throughout; a failure removes the partial pack.
pub fn write_pack(
    model_dir: &Path,
    cfg: &Config,
    index: &CheckpointIndex,
    out_dir: &Path,
    progress: impl FnMut(u64, u64) + Send,
) -> Result<PackReport, PackError> {
    write_pack_forced(model_dir, cfg, index, out_dir, (false, false), progress)
}

/// [`write_pack`]; with `force`, an up-to-date pack is written again too (`pack --force`).
/// Without it, a pack whose manifest matches the checkpoint is up to date only if every unit
/// still matches its checksum (the trunk is read once; not with `keep_damaged`, which
/// `pack --verify` sets so that it reports the damage rather than mend it): a damaged pack is
/// packed again.
pub fn write_pack_forced(
    model_dir: &Path,
    cfg: &Config,
    index: &CheckpointIndex,
    out_dir: &Path,
    (force, keep_damaged): (bool, bool),
    progress: impl FnMut(u64, u64) + Send,
) -> Result<PackReport, PackError> {
    let start = std::time::Instant::now();
    std::fs::create_dir_all(out_dir).map_err(io_err("create", out_dir))?;
    let _lock = PackLock::acquire(out_dir)?;
    // The output rule: the pack's files are regular files (or links to them), replaced whole.
    let pack_out = crate::files::Output::resolve_file("--out", &out_dir.join(PACK_FILE))?;
    let manifest_out = crate::files::Output::resolve_file("--out", &out_dir.join(MANIFEST_FILE))?;
    let fp = fingerprint(model_dir, index)?;
    let manifest_path = out_dir.join(MANIFEST_FILE);
    let mut repacked = force.then(|| "--force".to_owned());
    let shards: Vec<PathBuf> = index.shards.iter().map(|s| s.path.clone()).collect();
    let alignment = align::unit_alignment(out_dir, &shards);
    if let Ok(m) = Manifest::load(out_dir) {
        let check = m.fingerprint == fp && !force && !keep_damaged;
        let damaged = if check { verify::first_damaged_unit(out_dir, &m)? } else { None };
        let damaged = damaged
            .or_else(|| check.then(|| align::misaligned(m.alignment, alignment)).flatten())
            .or_else(|| check.then(|| m.expert_checksums(out_dir, index).err().map(|e| e.to_string())).flatten());
        if damaged.is_some() {
            repacked = damaged;
        } else if m.fingerprint == fp && !force {
            return Ok(PackReport {
                up_to_date: true,
                repacked: None,
                units: m.units.len(),
                tensors: m.units.iter().map(|u| u.tensors.len()).sum(),
                bytes: m.pack_len,
                experts: m.experts.iter().map(|l| l.checksums.len()).sum(),
                expert_bytes: index.experts.iter().map(|r| experts::expert_len(index, r)).sum(),
                seconds: start.elapsed().as_secs_f64(),
                alignment: m.alignment,
            });
        }
    }
    // The manifest goes first (a pack without one is incomplete); through a link, its target.
    let manifest_path = manifest_out.target().map_or(manifest_path, Path::to_path_buf);
    match std::fs::remove_file(&manifest_path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(PackError::Io { op: "remove", path: manifest_path, source: e }),
    }
    let (units, pack_len) = layout(cfg, index, alignment)?;
    let pack_path = pack_out.target().map_or_else(|| out_dir.join(PACK_FILE), Path::to_path_buf);
    let partial = PartialFile(pack_path.with_file_name(format!("{PACK_FILE}{PARTIAL_SUFFIX}")));
    let (units, experts) = write_partial(cfg, index, units, pack_len, alignment, &partial.0, progress)?;
    std::fs::rename(&partial.0, &pack_path).map_err(io_err("rename", &partial.0))?;
    let manifest = Manifest {
        format: FORMAT.to_owned(),
        version: VERSION,
        complete: true,
        fingerprint: fp,
        alignment,
        pack_len,
        units,
        experts,
    };
    let report = PackReport {
        up_to_date: false,
        repacked,
        units: manifest.units.len(),
        tensors: manifest.units.iter().map(|u| u.tensors.len()).sum(),
        bytes: pack_len,
        experts: index.experts.len(),
        expert_bytes: index.experts.iter().map(|r| experts::expert_len(index, r)).sum(),
        seconds: 0.0,
        alignment,
    };
    manifest_out.write_all(&serde_json::to_vec_pretty(&manifest).unwrap_or_default())?;
    sync_dir(out_dir)?;
    Ok(PackReport { seconds: start.elapsed().as_secs_f64(), ..report })
}

/// A partial file (the pack, the manifest), removed when dropped unless renamed into place
/// first: a failed or panicking pack (a full disk) leaves nothing behind.
struct PartialFile(PathBuf);

impl Drop for PartialFile {
    fn drop(&mut self) {
        match std::fs::remove_file(&self.0) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                tracing::warn!("cannot remove the partial pack {}: {e}", self.0.display());
            }
            _ => {}
        }
    }
}

/// Writes the pack's units into `partial` (synced) and checksums every expert; returns the
/// units with their checksums and the experts' checksums.
fn write_partial(
    cfg: &Config,
    index: &CheckpointIndex,
    units: Vec<UnitEntry>,
    pack_len: u64,
    alignment: u64,
    partial: &Path,
    mut progress: impl FnMut(u64, u64) + Send,
) -> Result<(Vec<UnitEntry>, Vec<LayerExpertSums>), PackError> {
    let file = create_pack_file(partial)?;
    file.set_len(pack_len).map_err(io_err("size", partial))?;
    let expert_bytes: u64 = index.experts.iter().map(|r| experts::expert_len(index, r)).sum();
    let total = units.iter().map(|u| u.len).sum::<u64>() + expert_bytes;
    // Units are copied in parallel (each into its own range of the file), so the disk sees
    // several reads and writes at once; each copy goes through one bounded buffer. Experts are
    // then read in disk order, runs of them per thread.
    let written = std::sync::Mutex::new((0u64, &mut progress));
    let advance = |n: u64| {
        let mut w = written.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        w.0 += n;
        let done = w.0;
        (w.1)(done, total);
    };
    let copy = |mut unit: UnitEntry| -> Result<UnitEntry, PackError> {
        // The embedding is copied in whole rows so each row's checksum comes out of the copy.
        let row = if unit.unit == PackUnit::Embed.name() { Some(2 * cfg.hidden_size) } else { None };
        let (sum, rows) = copy_unit(index, &unit, row, &file, partial, alignment, &mut |n| advance(n))?;
        unit.checksum = sum;
        unit.row_checksums = rows;
        Ok(unit)
    };
    let pool = copy_pool(partial)?;
    let (units_out, expert_sums) = pool.install(|| {
        use rayon::prelude::*;
        let units: Vec<UnitEntry> = units.into_par_iter().map(copy).collect::<Result<_, _>>()?;
        let sums = experts::checksum_all(index, &advance)?;
        Ok::<_, PackError>((units, sums))
    })?;
    file.sync_all().map_err(io_err("sync", partial))?;
    Ok((units_out, expert_sums))
}

/// The threads that copy units (and read experts) at once.
pub(crate) fn copy_pool(path: &Path) -> Result<rayon::ThreadPool, PackError> {
    rayon::ThreadPoolBuilder::new().num_threads(COPY_THREADS).build().map_err(|e| PackError::Io {
        op: "start copy threads for",
        path: path.to_owned(),
        source: std::io::Error::other(e),
    })
}

/// Unit entries with offsets (checksums still empty) and the pack length.
pub(crate) fn layout(
    cfg: &Config,
    index: &CheckpointIndex,
    alignment: u64,
) -> Result<(Vec<UnitEntry>, u64), PackError> {
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
    let window = unit_window(row_len, alignment);
    let mut buf = super::io::AlignedBuf::new(window, &super::io::BufOptions::default()).map_err(|e| PackError::Io {
        op: "allocate a copy buffer for",
        path: out_path.to_owned(),
        source: std::io::Error::other(e),
    })?;
    let mut sources = ShardFiles::default();
    let mut at = 0u64;
    while at < unit.len {
        let n = ((unit.len - at) as usize).min(window);
        let chunk = &mut buf.as_mut_slice()[..n];
        fill_window(index, unit, at, chunk, &mut sources)?;
        progress(n as u64);
        hash.update(chunk);
        rows.extend(row_checksums(unit, row_len, at, chunk));
        out.write_all_at(chunk, unit.offset + at).map_err(io_err("write", out_path))?;
        at += n as u64;
    }
    Ok((format!("{:016x}", hash.digest()), rows))
}

/// Bytes per copy window of a unit: windows start on the alignment and on row boundaries, so no
/// row spans two windows.
pub(crate) fn unit_window(row_len: Option<usize>, alignment: u64) -> usize {
    let grain = row_len.map_or(alignment, |r| lcm(r as u64, alignment)) as usize;
    (COPY_CHUNK / grain).max(1) * grain
}

/// The checksums of the `row_len`-byte rows of the unit's first tensor inside the window at `at`.
pub(crate) fn row_checksums(unit: &UnitEntry, row_len: Option<usize>, at: u64, chunk: &[u8]) -> Vec<u64> {
    match (row_len, unit.tensors.first()) {
        (Some(r), Some(t)) => {
            let end = (t.offset + t.len).saturating_sub(at).min(chunk.len() as u64) as usize;
            chunk[..end].chunks(r).map(kernels::hash::xxh3_64).collect()
        }
        _ => Vec::new(),
    }
}

/// Shard files opened on first use.
#[derive(Default)]
pub(crate) struct ShardFiles(Vec<(usize, File)>);

impl ShardFiles {
    fn get(&mut self, index: &CheckpointIndex, shard: usize) -> Result<&File, PackError> {
        let at = match self.0.iter().position(|(s, _)| *s == shard) {
            Some(at) => at,
            None => {
                let path = &index.shards[shard].path;
                self.0.push((shard, File::open(path).map_err(io_err("open", path))?));
                self.0.len() - 1
            }
        };
        Ok(&self.0[at].1)
    }
}

/// Assembles the window of `unit` starting at `at` from the shards: the bytes of every tensor
/// overlapping it, zeros elsewhere (exactly what the pack holds there).
pub(crate) fn fill_window(
    index: &CheckpointIndex,
    unit: &UnitEntry,
    at: u64,
    chunk: &mut [u8],
    sources: &mut ShardFiles,
) -> Result<(), PackError> {
    let n = chunk.len() as u64;
    chunk.fill(0);
    for t in unit.tensors.iter().filter(|t| t.offset < at + n && t.offset + t.len > at) {
        let info = index.get(&t.name).ok_or_else(|| PackError::Corrupt {
            path: index.dir.clone(),
            message: format!("tensor {} is missing", t.name),
        })?;
        let path = &index.shards[info.shard].path;
        let src = sources.get(index, info.shard)?;
        let from = t.offset.max(at);
        let to = (t.offset + t.len).min(at + n);
        let dst = &mut chunk[(from - at) as usize..(to - at) as usize];
        src.read_exact_at(dst, info.offset + (from - t.offset)).map_err(io_err("read", path))?;
    }
    Ok(())
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
    format!("{:016x}", kernels::hash::xxh3_64(bytes))
}

fn sync_dir(dir: &Path) -> Result<(), PackError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err("sync", dir))
}

impl Manifest {
    /// Reads and checks a manifest: format, completeness, the pack's length, aligned and
    /// non-overlapping units, tensors inside their unit.
    pub fn load(dir: &Path) -> Result<Manifest, PackError> {
        let path = dir.join(MANIFEST_FILE);
        let text =
            crate::files::input::read_regular(&path, MANIFEST_BYTES_MAX, "a trunk manifest").map_err(|e| match e {
                crate::files::InputError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                    PackError::NoManifest { dir: dir.to_owned() }
                }
                crate::files::InputError::Io { source, .. } => io_err("read", &path)(source),
                e => PackError::Input(e),
            })?;
        let pack = dir.join(PACK_FILE);
        let pack_file_len = || Ok(std::fs::metadata(&pack).map_err(io_err("stat", &pack))?.len());
        Manifest::parse(&text, &path, &pack, pack_file_len)
    }

    /// The checks of [`Self::load`] on manifest bytes; `pack_file_len` gives the pack file's
    /// actual length once the manifest is known to be a complete one. `path` and `pack` only
    /// name the files in errors.
    pub fn parse(
        text: &[u8],
        path: &Path,
        pack: &Path,
        pack_file_len: impl FnOnce() -> Result<u64, PackError>,
    ) -> Result<Manifest, PackError> {
        let corrupt = |message: String| PackError::Corrupt { path: path.to_owned(), message };
        let m: Manifest = serde_json::from_slice(text).map_err(|e| corrupt(format!("not a trunk manifest: {e}")))?;
        if m.format != FORMAT {
            return Err(corrupt(format!("format {} is not {FORMAT}: run `k3ring pack` again", m.format)));
        }
        if m.version != VERSION {
            let why = if m.version < VERSION { "an older k3ring (before expert checksums)" } else { "a newer k3ring" };
            return Err(corrupt(format!(
                "the pack was made by {why}: its format is v{}, this k3ring reads v{VERSION}; run `k3ring pack` again",
                m.version
            )));
        }
        if !m.complete {
            return Err(corrupt("the pack is incomplete (an interrupted `k3ring pack`)".to_owned()));
        }
        if m.alignment < UNIT_ALIGN_MIN || !m.alignment.is_power_of_two() {
            return Err(corrupt(format!("alignment {} is not a power of two >= {UNIT_ALIGN_MIN}", m.alignment)));
        }
        let len = pack_file_len()?;
        if len != m.pack_len {
            return Err(corrupt(format!("{} is {len} bytes but the manifest says {}", pack.display(), m.pack_len)));
        }
        let mut end = 0;
        let mut seen = std::collections::BTreeSet::new();
        for u in &m.units {
            // Only the canonical spelling: lookups go by name, so "layer.01" would never be found.
            let Some(unit) = PackUnit::parse(&u.unit).filter(|p| p.name() == u.unit) else {
                return Err(corrupt(format!("unknown unit {:?}", u.unit)));
            };
            if !seen.insert(unit) {
                return Err(corrupt(format!("unit {} appears twice", u.unit)));
            }
            if u.offset % m.alignment != 0 || u.len % m.alignment != 0 || u.offset < end {
                return Err(corrupt(format!("unit {} at {}+{} is misaligned or overlaps", u.unit, u.offset, u.len)));
            }
            end = match u.offset.checked_add(u.len) {
                Some(e) if e <= m.pack_len => e,
                _ => return Err(corrupt(format!("unit {} ends past the pack", u.unit))),
            };
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
                if t.offset.checked_add(t.len).is_none_or(|e| e > u.len) || Dtype::parse(&t.dtype).is_none() {
                    return Err(corrupt(format!("tensor {} of unit {} is out of bounds or untyped", t.name, u.unit)));
                }
            }
        }
        let mut last_layer = None;
        for l in &m.experts {
            if last_layer.is_some_and(|p| l.layer <= p) || l.layer >= EXPERT_LAYERS_MAX {
                return Err(corrupt(format!("expert checksums of layer {} are out of order or out of range", l.layer)));
            }
            last_layer = Some(l.layer);
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

    /// The checksum of every expert of `index`, per layer by expert id; an expert without one
    /// is a corrupt manifest.
    pub fn expert_checksums(&self, dir: &Path, index: &CheckpointIndex) -> Result<Vec<Vec<u64>>, PackError> {
        let table = experts::lookup_table(&self.experts);
        match index.experts.iter().find(|r| table.get(r.layer).and_then(|l| l.get(r.expert)).is_none()) {
            Some(r) => Err(PackError::Corrupt {
                path: dir.join(MANIFEST_FILE),
                message: format!(
                    "no checksum for layer {} expert {} of the checkpoint: run `k3ring pack` again",
                    r.layer, r.expert
                ),
            }),
            None => Ok(table),
        }
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
        let busy = PackError::Busy { dir: PathBuf::from("/t"), lock: PathBuf::from("/t/trunk.lock") };
        assert_eq!(busy.exit_code(), ExitCode::Io);
        let verify = PackError::Verify { dir: PathBuf::from("/t"), count: 2, first: "layer 1 expert 3".into() };
        assert_eq!(verify.exit_code(), ExitCode::Data);
    }
}
