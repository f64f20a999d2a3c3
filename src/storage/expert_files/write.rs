//! `k3ring pack --experts-to DIR1,DIR2,...`: reads every routed expert's image once, checks it
//! against the trunk manifest's checksum, writes its pieces ([`super::assign::stripe`]) into
//! one file per directory, and writes the manifest last.
//!
//! Crash safety and resuming, as for the trunk pack: the manifest is removed first and written
//! (synced, renamed) only once every file is complete; each data file is written under a
//! `.partial` name, synced and renamed, and then described by a marker beside it
//! ([`MARKER_FILE`]). A second run with the same placement keeps every file whose marker and
//! sampled bytes still match, so an interrupted pack rewrites only the unfinished devices (with
//! `--even` or `--expert-rates`; probed rates are probed again, and a cut they change rewrites
//! every file); an up-to-date set is left alone unless `--force`. The trunk directory's pack
//! lock and a lock in each expert directory keep two packs from writing one file.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{sampled_hash, DeviceEntry, ExpertFilesManifest, PlacedEntry, DATA_FILE, FORMAT, MANIFEST_FILE, VERSION};
use crate::checkpoint::expert_sums::expert_checksum;
use crate::checkpoint::{CheckpointIndex, ExpertImage};
use crate::storage::pack::experts::open_shards;
use crate::storage::pack::lock::PackLock;
use crate::storage::pack::{io_err, Manifest, PackError};

/// Beside each data file: what it holds, so that a later pack can keep it.
pub const MARKER_FILE: &str = "k3ring-experts.json";
/// Beside each data file: held by the pack writing it, so that two packs never write one file.
pub const LOCK_FILE: &str = "k3ring-experts.lock";
const PARTIAL_SUFFIX: &str = ".partial";

/// Returns the placement when files must be written (rates are probed only then).
pub type WeightsOf<'a> = dyn Fn() -> Result<Weights, PackError> + 'a;

/// How experts are spread over the directories.
#[derive(Clone, Debug, PartialEq)]
pub enum Weights {
    /// Equal pieces (`--even`).
    Even,
    /// In proportion to these rates (GB/s), one per directory: given (`--expert-rates`) or
    /// probed.
    Rates(Vec<f64>),
}

/// What [`write`] did.
#[derive(Clone, Debug, Serialize)]
pub struct WriteReport {
    pub up_to_date: bool,
    /// Devices whose file was kept (resumed or up to date).
    pub kept: usize,
    pub devices: Vec<DeviceEntry>,
    pub experts: usize,
    pub bytes: u64,
    pub written_bytes: u64,
    pub seconds: f64,
}

/// A data file's marker: its experts and the sampled hash of the file as written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Marker {
    source: String,
    align: u64,
    len: u64,
    samples: String,
    experts: Vec<PlacedEntry>,
}

/// Places and copies the experts of `index` into `dirs` (absolute, distinct). `weights` is
/// called only when files must be written and returns the placement; an intact set for the
/// same checkpoint and directories that `same` accepts (the placement asked for) is up to date
/// unless `force`.
pub fn write(
    trunk_dir: &Path,
    trunk: &Manifest,
    index: &CheckpointIndex,
    dirs: &[PathBuf],
    (same, weights): (&dyn Fn(&ExpertFilesManifest) -> bool, &WeightsOf<'_>),
    force: bool,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<WriteReport, PackError> {
    let start = std::time::Instant::now();
    // The trunk directory's pack lock and each expert directory's own: a second pack of either
    // waits for nothing and says which lock is held.
    let mut _locks = vec![PackLock::acquire(trunk_dir)?];
    for dir in dirs {
        std::fs::create_dir_all(dir).map_err(io_err("create", dir))?;
        _locks.push(PackLock::acquire_named(dir, LOCK_FILE)?);
    }
    let manifest_path = trunk_dir.join(MANIFEST_FILE);
    if !force {
        if let Ok(Some(files)) = super::ExpertFiles::open(trunk_dir, trunk, index) {
            let same_dirs = files.manifest.devices.iter().map(|d| &d.dir).eq(dirs.iter());
            if same_dirs && same(&files.manifest) {
                return Ok(report(&files.manifest, true, dirs.len(), 0, start));
            }
        }
    }
    let weights = weights()?;
    let planned = plan(trunk, index, dirs, &weights);
    match std::fs::remove_file(&manifest_path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io_err("remove", &manifest_path)(e)),
        _ => {}
    }
    let sums = trunk.expert_checksums(trunk_dir, index)?;
    let total: u64 = planned.devices.iter().map(|d| d.len).sum();
    let mut done = 0u64;
    let mut tick = |n: u64| {
        done += n;
        progress(done, total);
    };
    let mut files = Vec::with_capacity(planned.devices.len());
    for (d, dev) in planned.devices.iter().enumerate() {
        let file = open_device(&planned, d, dev, force)?;
        if let DeviceFile::Kept(_) = &file {
            tick(dev.len);
        }
        files.push(file);
    }
    copy_pieces(index, &planned, &sums, &files, &mut tick)?;
    let mut devices = Vec::with_capacity(files.len());
    let (mut kept, mut written) = (0, 0);
    for (d, file) in files.into_iter().enumerate() {
        let dev = &planned.devices[d];
        let entry = match file {
            DeviceFile::Kept(samples) => {
                kept += 1;
                DeviceEntry { samples, ..dev.clone() }
            }
            DeviceFile::Writing { file, partial, cleanup } => {
                written += dev.len;
                let entry = finish_device(&planned, d, dev, file, &partial)?;
                std::mem::forget(cleanup);
                entry
            }
        };
        devices.push(entry);
    }
    let manifest = ExpertFilesManifest { devices, ..planned };
    let out = crate::files::Output::resolve_file("--out", &manifest_path)?;
    out.write_all(&serde_json::to_vec_pretty(&manifest).unwrap_or_default())?;
    Ok(report(&manifest, false, kept, written, start))
}

fn report(
    m: &ExpertFilesManifest,
    up_to_date: bool,
    kept: usize,
    written: u64,
    start: std::time::Instant,
) -> WriteReport {
    WriteReport {
        up_to_date,
        kept,
        devices: m.devices.clone(),
        experts: m.experts.iter().map(|e| (e.layer, e.expert)).collect::<std::collections::HashSet<_>>().len(),
        bytes: m.devices.iter().map(|d| d.len).sum(),
        written_bytes: written,
        seconds: start.elapsed().as_secs_f64(),
    }
}

/// The manifest the copy will produce (device lengths set, samples not yet known).
fn plan(trunk: &Manifest, index: &CheckpointIndex, dirs: &[PathBuf], weights: &Weights) -> ExpertFilesManifest {
    let mut experts: Vec<_> = index.experts.iter().collect();
    experts.sort_by_key(|r| (r.layer, r.expert));
    let (rates, placement) = match weights {
        Weights::Even => (vec![1.0; dirs.len()], "even"),
        Weights::Rates(r) => (r.clone(), "weighted"),
    };
    let align = trunk.alignment.max(1);
    let images: Vec<u64> = experts.iter().map(|r| ExpertImage::new(&index.tensors, r, align).len).collect();
    let units: Vec<u64> = images.iter().map(|len| len / align).collect();
    let cuts = super::assign::stripe(&units, &rates);
    let mut ends = vec![0u64; dirs.len()];
    let mut placed = Vec::with_capacity(experts.len() * dirs.len());
    for (r, counts) in experts.iter().zip(&cuts) {
        let mut at = 0;
        for (device, &count) in counts.iter().enumerate() {
            let len = count * align;
            if len == 0 {
                continue;
            }
            placed.push(PlacedEntry { layer: r.layer, expert: r.expert, device, offset: ends[device], len, at });
            ends[device] += len;
            at += len;
        }
    }
    let bytes = ends.clone();
    let devices = dirs
        .iter()
        .enumerate()
        .map(|(d, dir)| DeviceEntry {
            dir: dir.clone(),
            len: ends[d],
            samples: String::new(),
            rate_gb_s: rates[d],
            expert_bytes: bytes[d],
        })
        .collect();
    ExpertFilesManifest {
        format: FORMAT.to_owned(),
        version: VERSION,
        source: trunk.fingerprint.clone(),
        align: trunk.alignment,
        placement: placement.to_owned(),
        devices,
        experts: placed,
    }
}

/// A device's data file during a pack: kept as it was (with its samples), or being written.
enum DeviceFile {
    Kept(String),
    Writing { file: File, partial: PathBuf, cleanup: Partial },
}

/// Device `d`'s pieces, as its marker lists them.
fn pieces_of(planned: &ExpertFilesManifest, d: usize) -> Vec<PlacedEntry> {
    planned.experts.iter().filter(|e| e.device == d).copied().collect()
}

/// Keeps device `d`'s file when its marker matches the plan and its bytes their samples (not
/// with `force`); otherwise starts its partial file.
fn open_device(
    planned: &ExpertFilesManifest,
    d: usize,
    dev: &DeviceEntry,
    force: bool,
) -> Result<DeviceFile, PackError> {
    std::fs::create_dir_all(&dev.dir).map_err(io_err("create", &dev.dir))?;
    let data = dev.dir.join(DATA_FILE);
    let marker_path = dev.dir.join(MARKER_FILE);
    let mine = pieces_of(planned, d);
    let want = |m: &Marker| m.source == planned.source && m.align == planned.align && m.experts == mine;
    if !force {
        let marker: Option<Marker> =
            std::fs::read(&marker_path).ok().and_then(|b| serde_json::from_slice(&b).ok()).filter(want);
        if let Some(m) = marker {
            if sampled_hash(&data).ok().is_some_and(|(len, s)| len == m.len && s == m.samples) {
                return Ok(DeviceFile::Kept(m.samples));
            }
        }
    }
    let _ = std::fs::remove_file(&marker_path);
    let partial = dev.dir.join(format!("{DATA_FILE}{PARTIAL_SUFFIX}"));
    let file = File::create(&partial).map_err(io_err("create", &partial))?;
    Ok(DeviceFile::Writing { file, cleanup: Partial(partial.clone()), partial })
}

/// Reads each expert's image once (when some device's file is being written), checks it
/// against the trunk manifest's checksum, and writes its pieces into the files being written.
fn copy_pieces(
    index: &CheckpointIndex,
    planned: &ExpertFilesManifest,
    sums: &[Vec<u64>],
    files: &[DeviceFile],
    tick: &mut dyn FnMut(u64),
) -> Result<(), PackError> {
    if files.iter().all(|f| matches!(f, DeviceFile::Kept(_))) {
        return Ok(());
    }
    let shards = open_shards(index)?;
    let mut buf = Vec::new();
    let mut pieces = planned.experts.iter().peekable();
    while let Some(first) = pieces.next() {
        let key = (first.layer, first.expert);
        let mut mine = vec![first];
        while let Some(p) = pieces.next_if(|p| (p.layer, p.expert) == key) {
            mine.push(p);
        }
        let Some(r) = index.experts.get(key.0, key.1) else { continue };
        let image = ExpertImage::new(&index.tensors, r, planned.align);
        buf.clear();
        buf.resize(image.len as usize, 0);
        for w in &image.windows {
            let shard = &index.shards[w.shard];
            // The aligned window may run past the shard's end; those bytes stay zero.
            let n = w.len.min(shard.file_len.saturating_sub(w.offset)).max(w.min_len) as usize;
            let at = w.at as usize;
            shards[w.shard].read_exact_at(&mut buf[at..at + n], w.offset).map_err(io_err("read", &shard.path))?;
        }
        let parts: Vec<&[u8]> = image.parts.iter().map(|&(o, l)| &buf[o..o + l]).collect();
        let want_sum = sums.get(key.0).and_then(|l| l.get(key.1)).copied();
        if want_sum != Some(expert_checksum(&parts)) {
            return Err(PackError::Corrupt {
                path: index.shards[image.windows[0].shard].path.clone(),
                message: format!(
                    "layer {} expert {} does not match its checksum in the trunk manifest: the checkpoint changed \
                     since `k3ring pack`, or a shard is damaged (`k3ring pack --verify` checks every expert)",
                    key.0, key.1
                ),
            });
        }
        for p in mine {
            if let Some(DeviceFile::Writing { file, partial, .. }) = files.get(p.device) {
                let (at, len) = (p.at as usize, p.len as usize);
                file.write_all_at(&buf[at..at + len], p.offset).map_err(io_err("write", partial))?;
                tick(p.len);
            }
        }
    }
    Ok(())
}

/// Syncs and renames device `d`'s written file and writes its marker; returns its entry.
fn finish_device(
    planned: &ExpertFilesManifest,
    d: usize,
    dev: &DeviceEntry,
    file: File,
    partial: &Path,
) -> Result<DeviceEntry, PackError> {
    let data = dev.dir.join(DATA_FILE);
    file.set_len(dev.len).map_err(io_err("write", partial))?;
    file.sync_all().map_err(io_err("sync", partial))?;
    drop(file);
    std::fs::rename(partial, &data).map_err(io_err("rename", partial))?;
    let (len, samples) = sampled_hash(&data)?;
    let marker = Marker {
        source: planned.source.clone(),
        align: planned.align,
        len,
        samples: samples.clone(),
        experts: pieces_of(planned, d),
    };
    let out = crate::files::Output::resolve_file("--experts-to", &dev.dir.join(MARKER_FILE))?;
    out.write_all(&serde_json::to_vec(&marker).unwrap_or_default())?;
    Ok(DeviceEntry { samples, len, ..dev.clone() })
}

/// Removes a partial data file when a copy fails.
struct Partial(PathBuf);

impl Drop for Partial {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
