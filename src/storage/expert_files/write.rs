//! `k3ring pack --experts-to DIR1,DIR2,...`: copies every routed expert's image into one file per
//! directory, placed by [`super::assign`], and writes the manifest last.
//!
//! Crash safety and resuming, as for the trunk pack: the manifest is removed first and written
//! (synced, renamed) only once every file is complete; each data file is written under a
//! `.partial` name, synced and renamed, and then described by a marker beside it
//! ([`MARKER_FILE`]). A second run with the same placement keeps every file whose marker and
//! sampled bytes still match, so an interrupted pack resumes at the first unfinished device;
//! an up-to-date set is left alone unless `--force`.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{sampled_hash, DeviceEntry, ExpertFilesManifest, PlacedEntry, DATA_FILE, FORMAT, MANIFEST_FILE, VERSION};
use crate::checkpoint::{CheckpointIndex, ExpertImage};
use crate::storage::pack::experts::{expert_checksum, open_shards};
use crate::storage::pack::{io_err, Manifest, PackError};

/// Beside each data file: what it holds, so that a later pack can keep it.
pub const MARKER_FILE: &str = "k3ring-experts.json";
const PARTIAL_SUFFIX: &str = ".partial";

/// Returns the placement when files must be written (rates are probed only then).
pub type WeightsOf<'a> = dyn Fn() -> Result<Weights, PackError> + 'a;

/// How experts are spread over the directories.
#[derive(Clone, Debug, PartialEq)]
pub enum Weights {
    /// Round-robin (`--even`).
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
    let done = std::sync::atomic::AtomicU64::new(0);
    let tick = |n: u64| {
        let at = done.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n;
        progress(at, total);
    };
    // One thread per directory: each device writes its own file.
    let results: Vec<Result<(DeviceEntry, bool), PackError>> = std::thread::scope(|s| {
        let handles: Vec<_> = planned
            .devices
            .iter()
            .enumerate()
            .map(|(d, dev)| {
                let (planned, sums, tick) = (&planned, &sums, &tick);
                s.spawn(move || write_device(index, planned, d, dev, sums, force, tick))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(PackError::Corrupt {
                        path: trunk_dir.to_path_buf(),
                        message: "a thread writing expert files panicked".to_owned(),
                    })
                })
            })
            .collect()
    });
    let mut devices = Vec::with_capacity(results.len());
    let (mut kept, mut written) = (0, 0);
    for r in results {
        let (dev, was_kept) = r?;
        kept += usize::from(was_kept);
        written += if was_kept { 0 } else { dev.len };
        devices.push(dev);
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
        experts: m.experts.len(),
        bytes: m.devices.iter().map(|d| d.len).sum(),
        written_bytes: written,
        seconds: start.elapsed().as_secs_f64(),
    }
}

/// The manifest the copy will produce (device lengths set, samples not yet known).
fn plan(trunk: &Manifest, index: &CheckpointIndex, dirs: &[PathBuf], weights: &Weights) -> ExpertFilesManifest {
    let mut experts: Vec<_> = index.experts.iter().collect();
    experts.sort_by_key(|r| (r.layer, r.expert));
    let mut per_layer: Vec<usize> = Vec::new();
    let mut last = None;
    for r in &experts {
        if last != Some(r.layer) {
            per_layer.push(0);
            last = Some(r.layer);
        }
        if let Some(n) = per_layer.last_mut() {
            *n += 1;
        }
    }
    let (rates, placement) = match weights {
        Weights::Even => (vec![1.0; dirs.len()], "even"),
        Weights::Rates(r) => (r.clone(), "weighted"),
    };
    let devices_of = super::assign::assign(&per_layer, &rates);
    let mut ends = vec![0u64; dirs.len()];
    let mut bytes = vec![0u64; dirs.len()];
    let mut placed = Vec::with_capacity(experts.len());
    for (r, &device) in experts.iter().zip(&devices_of) {
        let image = ExpertImage::new(&index.tensors, r, trunk.alignment);
        placed.push(PlacedEntry { layer: r.layer, expert: r.expert, device, offset: ends[device], len: image.len });
        ends[device] += image.len;
        bytes[device] += r.parts.iter().map(|&id| index.tensors[id].len).sum::<u64>();
    }
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

/// Writes device `d`'s file (or keeps it, when its marker matches the plan and its bytes
/// their samples); returns its entry with the samples and whether it was kept.
fn write_device(
    index: &CheckpointIndex,
    planned: &ExpertFilesManifest,
    d: usize,
    dev: &DeviceEntry,
    sums: &[Vec<u64>],
    force: bool,
    tick: &(dyn Fn(u64) + Sync),
) -> Result<(DeviceEntry, bool), PackError> {
    std::fs::create_dir_all(&dev.dir).map_err(io_err("create", &dev.dir))?;
    let data = dev.dir.join(DATA_FILE);
    let marker_path = dev.dir.join(MARKER_FILE);
    let mine: Vec<PlacedEntry> = planned.experts.iter().filter(|e| e.device == d).copied().collect();
    let want = |m: &Marker| m.source == planned.source && m.align == planned.align && m.experts == mine;
    if !force {
        let marker: Option<Marker> =
            std::fs::read(&marker_path).ok().and_then(|b| serde_json::from_slice(&b).ok()).filter(want);
        if let Some(m) = marker {
            if sampled_hash(&data).ok().is_some_and(|(len, s)| len == m.len && s == m.samples) {
                tick(m.len);
                return Ok((DeviceEntry { samples: m.samples, len: m.len, ..dev.clone() }, true));
            }
        }
    }
    let _ = std::fs::remove_file(&marker_path);
    let partial = dev.dir.join(format!("{DATA_FILE}{PARTIAL_SUFFIX}"));
    let file = File::create(&partial).map_err(io_err("create", &partial))?;
    let cleanup = Partial(&partial);
    let shards = open_shards(index)?;
    let mut buf = Vec::new();
    for e in &mine {
        let Some(r) = index.experts.get(e.layer, e.expert) else { continue };
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
        let want_sum = sums.get(e.layer).and_then(|l| l.get(e.expert)).copied();
        if want_sum != Some(expert_checksum(&parts)) {
            return Err(PackError::Corrupt {
                path: index.shards[image.windows[0].shard].path.clone(),
                message: format!(
                    "layer {} expert {} does not match its checksum in the trunk manifest: the checkpoint changed \
                     since `k3ring pack`, or a shard is damaged (`k3ring pack --verify` checks every expert)",
                    e.layer, e.expert
                ),
            });
        }
        file.write_all_at(&buf, e.offset).map_err(io_err("write", &partial))?;
        tick(image.len);
    }
    file.set_len(dev.len).map_err(io_err("write", &partial))?;
    file.sync_all().map_err(io_err("sync", &partial))?;
    drop(file);
    std::fs::rename(&partial, &data).map_err(io_err("rename", &partial))?;
    std::mem::forget(cleanup);
    let (len, samples) = sampled_hash(&data)?;
    let marker =
        Marker { source: planned.source.clone(), align: planned.align, len, samples: samples.clone(), experts: mine };
    let out = crate::files::Output::resolve_file("--experts-to", &marker_path)?;
    out.write_all(&serde_json::to_vec(&marker).unwrap_or_default())?;
    Ok((DeviceEntry { samples, len, ..dev.clone() }, false))
}

/// Removes a partial data file when a copy fails.
struct Partial<'a>(&'a Path);

impl Drop for Partial<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}
