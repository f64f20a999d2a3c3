//! Routed experts copied out of the shards into one file per device (`k3ring pack
//! --experts-to DIR1,DIR2,...`), so that a run reads them from several drives at once.
//!
//! Every expert is striped over the directories ([`assign::stripe`]): its image as a slot holds
//! it ([`ExpertImage`] at the trunk pack's alignment: the same bytes, the same part offsets as a
//! read from the shards) is cut into one aligned piece per device, sized by the devices' rates,
//! and each directory's [`DATA_FILE`] holds its pieces of every expert one after another. A read
//! of an expert is one read per device, each landing where its piece sits in the slot, so the
//! output cannot depend on where the bytes came from, and a layer's misses keep every drive
//! busy in proportion to its rate whatever the routing. The trunk directory gets
//! [`MANIFEST_FILE`]: which piece lives where, each file's length and a hash of sampled windows
//! of it, and the fingerprint of the checkpoint it was copied from. Each expert's bytes are
//! checked against the trunk manifest's expert checksum on every read, as from the shards.
//!
//! At open ([`ExpertFiles::open`]) a missing file, a file of another length or with other
//! sampled bytes, or a manifest of another checkpoint is refused (exit 3, naming the file).
//! Without the manifest, experts are read from the shards.

pub mod assign;
pub mod write;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use kernels::hash::Xxh3;
use serde::{Deserialize, Serialize};

use crate::checkpoint::{CheckpointIndex, ExpertImage};
use crate::storage::pack::{io_err, Manifest, PackError};

/// In the trunk directory: where every expert lives.
pub const MANIFEST_FILE: &str = "experts.manifest.json";
/// In each expert directory: its experts' images.
pub const DATA_FILE: &str = "k3ring-experts.bin";
pub const FORMAT: &str = "k3ring-expert-files";
pub const VERSION: u32 = 2;
/// Sampled windows per data file (first at its start, last at its end).
const SAMPLE_WINDOWS: u64 = 16;
const SAMPLE_BYTES: u64 = 4096;
/// A manifest larger than this is refused unread (the release's 82k experts take a few MB).
const MANIFEST_BYTES_MAX: u64 = 1 << 30;

/// One directory (one device) and the file it holds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceEntry {
    /// Absolute, as given to `--experts-to`.
    pub dir: PathBuf,
    /// Bytes of [`DATA_FILE`].
    pub len: u64,
    /// xxh3 of its sampled windows ([`sampled_hash`]).
    pub samples: String,
    /// The random-read rate its share was weighted by (GB/s), or 1 for `--even`.
    pub rate_gb_s: f64,
    /// Bytes of expert images placed there (its pieces).
    pub expert_bytes: u64,
}

/// One piece of an expert: bytes `at..at + len` of its image, at `offset` of device `device`'s
/// file.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlacedEntry {
    pub layer: usize,
    pub expert: usize,
    pub device: usize,
    pub offset: u64,
    pub len: u64,
    pub at: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ExpertFilesManifest {
    pub format: String,
    pub version: u32,
    /// The trunk manifest's fingerprint of the checkpoint the experts were copied from.
    pub source: String,
    /// The images' alignment: the trunk pack's.
    pub align: u64,
    /// `weighted` (by probed or given rates) or `even`.
    pub placement: String,
    pub devices: Vec<DeviceEntry>,
    pub experts: Vec<PlacedEntry>,
}

/// Where a run reads one piece of an expert: `len` bytes at `offset` of file `file` (an index
/// into the run's file list), landing at `at` of the expert's slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    pub file: usize,
    pub offset: u64,
    pub len: u64,
    pub at: u64,
    pub device: usize,
}

/// Every expert's pieces, by layer then expert id; empty when experts come from the shards.
#[derive(Clone, Debug, Default)]
pub struct ExpertPlacement {
    /// Per layer and expert, its range of `pieces` (empty: not placed).
    by_layer: Vec<Vec<(u32, u32)>>,
    pieces: Vec<Placed>,
    /// The images' alignment (the trunk pack's).
    align: u64,
    /// The data files, in device order, for messages.
    paths: Vec<PathBuf>,
    /// The command that rewrites every expert file, for messages.
    rewrite: String,
}

impl ExpertPlacement {
    /// The pieces of an expert, in image order; `None` when it is read from the shards.
    pub fn get(&self, (layer, expert): (usize, usize)) -> Option<&[Placed]> {
        let &(start, end) = self.by_layer.get(layer)?.get(expert)?;
        (end > start).then(|| &self.pieces[start as usize..end as usize])
    }

    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// The alignment the expert images were cut at.
    pub fn align(&self) -> u64 {
        self.align
    }

    /// The data file a piece is read from.
    pub fn path(&self, piece: &Placed) -> Option<&Path> {
        self.paths.get(piece.device).map(PathBuf::as_path)
    }

    /// `k3ring pack ... --force`, which rewrites every expert file (a damage the open check
    /// does not sample leaves a plain `pack` with nothing to do).
    pub fn rewrite_command(&self) -> &str {
        &self.rewrite
    }
}

/// The expert files of a trunk directory, checked and ready to read.
#[derive(Clone, Debug)]
pub struct ExpertFiles {
    pub manifest: ExpertFilesManifest,
    /// The data files, in device order.
    pub paths: Vec<PathBuf>,
}

/// The xxh3 of a file's length and [`SAMPLE_WINDOWS`] windows of [`SAMPLE_BYTES`] spread over
/// it: cheap enough for every open, and changed by a truncation, an extension, or a copy of
/// another pack.
pub fn sampled_hash(path: &Path) -> Result<(u64, String), PackError> {
    let file = File::open(path).map_err(io_err("open", path))?;
    let len = file.metadata().map_err(io_err("stat", path))?.len();
    let mut h = Xxh3::new();
    h.update(&len.to_le_bytes());
    let windows: Vec<(u64, u64)> = if len <= SAMPLE_WINDOWS * SAMPLE_BYTES {
        vec![(0, len)]
    } else {
        let stride = (len - SAMPLE_BYTES) / (SAMPLE_WINDOWS - 1);
        (0..SAMPLE_WINDOWS).map(|i| (i * stride, SAMPLE_BYTES)).collect()
    };
    let mut buf = Vec::new();
    for (offset, n) in windows {
        buf.resize(n as usize, 0);
        file.read_exact_at(&mut buf, offset).map_err(io_err("read", path))?;
        h.update(&offset.to_le_bytes());
        h.update(&buf);
    }
    Ok((len, format!("{:016x}", h.digest())))
}

fn corrupt(path: &Path, message: String) -> PackError {
    PackError::Corrupt { path: path.to_path_buf(), message }
}

impl ExpertFiles {
    /// The expert files named by `trunk_dir`'s [`MANIFEST_FILE`], checked against the trunk
    /// manifest and the checkpoint; `None` when there is no such manifest.
    pub fn open(trunk_dir: &Path, trunk: &Manifest, index: &CheckpointIndex) -> Result<Option<ExpertFiles>, PackError> {
        let path = trunk_dir.join(MANIFEST_FILE);
        let bytes = match crate::files::input::read_regular(&path, MANIFEST_BYTES_MAX, "an expert manifest") {
            Ok(b) => b,
            Err(crate::files::InputError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                return Ok(None)
            }
            Err(e) => return Err(e.into()),
        };
        let manifest: ExpertFilesManifest =
            serde_json::from_slice(&bytes).map_err(|e| corrupt(&path, format!("not an expert manifest: {e}")))?;
        let again = &again(&manifest, trunk_dir, index);
        if manifest.format != FORMAT || manifest.version != VERSION {
            return Err(corrupt(
                &path,
                format!("format {} v{}, expected {FORMAT} v{VERSION}; {again}", manifest.format, manifest.version),
            ));
        }
        if manifest.source != trunk.fingerprint {
            return Err(corrupt(
                &path,
                format!("the experts were copied from another checkpoint than the trunk pack's; {again}"),
            ));
        }
        if manifest.align != trunk.alignment {
            return Err(corrupt(
                &path,
                format!("images aligned to {} bytes, the trunk pack to {}; {again}", manifest.align, trunk.alignment),
            ));
        }
        let mut paths = Vec::with_capacity(manifest.devices.len());
        for d in &manifest.devices {
            let file = d.dir.join(DATA_FILE);
            let (len, samples) = match sampled_hash(&file) {
                Ok(x) => x,
                Err(PackError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
                    return Err(corrupt(&file, format!("the expert file is missing; {again}")))
                }
                Err(e) => return Err(e),
            };
            if len != d.len {
                return Err(corrupt(
                    &file,
                    format!("{len} bytes, the manifest says {}: the file is stale or cut short; {again}", d.len),
                ));
            }
            if samples != d.samples {
                return Err(corrupt(
                    &file,
                    format!("its sampled bytes differ from the manifest's: the file is stale; {again}"),
                ));
            }
            paths.push(file);
        }
        check_places(&path, &manifest, index, again)?;
        Ok(Some(ExpertFiles { manifest, paths }))
    }

    /// Where the experts are, for the console: per directory, its experts and bytes and the
    /// rate its share was weighted by.
    pub fn describe(&self) -> String {
        let m = &self.manifest;
        let total: u64 = m.devices.iter().map(|d| d.expert_bytes).sum::<u64>().max(1);
        let per: Vec<String> = m
            .devices
            .iter()
            .enumerate()
            .map(|(d, dev)| {
                let n = m.experts.iter().filter(|e| e.device == d).count();
                format!(
                    "{} {}: pieces of {n} experts, {:.4} GB ({:.0}%, rate {:.2})",
                    d + 1,
                    dev.dir.display(),
                    dev.expert_bytes as f64 / 1e9,
                    100.0 * dev.expert_bytes as f64 / total as f64,
                    dev.rate_gb_s
                )
            })
            .collect();
        format!("experts {} over {} devices | {}", m.placement, m.devices.len(), per.join(" | "))
    }

    /// The lookup a run uses, with the data files at `first_file..` of its file list.
    pub fn placement(&self, first_file: usize, trunk_dir: &Path, index: &CheckpointIndex) -> ExpertPlacement {
        let mut entries: Vec<&PlacedEntry> = self.manifest.experts.iter().collect();
        entries.sort_by_key(|e| (e.layer, e.expert, e.at));
        let mut by_layer: Vec<Vec<(u32, u32)>> = Vec::new();
        let mut pieces = Vec::with_capacity(entries.len());
        for e in entries {
            if by_layer.len() <= e.layer {
                by_layer.resize(e.layer + 1, Vec::new());
            }
            let layer = &mut by_layer[e.layer];
            if layer.len() <= e.expert {
                layer.resize(e.expert + 1, (0, 0));
            }
            let at = pieces.len() as u32;
            let range = &mut layer[e.expert];
            if range.1 == range.0 {
                *range = (at, at);
            }
            range.1 = at + 1;
            pieces.push(Placed {
                file: first_file + e.device,
                offset: e.offset,
                len: e.len,
                at: e.at,
                device: e.device,
            });
        }
        let rewrite = command(&self.manifest, trunk_dir, index) + " --force";
        ExpertPlacement { by_layer, pieces, align: self.manifest.align, paths: self.paths.clone(), rewrite }
    }
}

/// The advice that writes the expert files again as they were placed.
fn again(m: &ExpertFilesManifest, trunk_dir: &Path, index: &CheckpointIndex) -> String {
    format!("run `{}` again", command(m, trunk_dir, index))
}

/// `k3ring pack` with the model, trunk, directories and placement of `m`.
fn command(m: &ExpertFilesManifest, trunk_dir: &Path, index: &CheckpointIndex) -> String {
    let dirs: Vec<String> = m.devices.iter().map(|d| d.dir.display().to_string()).collect();
    let placement = if m.placement == "even" { " --even" } else { "" };
    format!(
        "k3ring pack --model {} --out {} --experts-to {}{placement}",
        index.dir.display(),
        trunk_dir.display(),
        dirs.join(",")
    )
}

/// Every expert of the checkpoint placed once: its pieces, aligned and inside their files, tile
/// its image from its first byte to its last.
fn check_places(path: &Path, m: &ExpertFilesManifest, index: &CheckpointIndex, again: &str) -> Result<(), PackError> {
    let mut covered: std::collections::HashMap<(usize, usize), Vec<(u64, u64)>> = std::collections::HashMap::new();
    for e in &m.experts {
        let Some(d) = m.devices.get(e.device) else {
            return Err(corrupt(
                path,
                format!("places layer {} expert {} on device {}, which it does not list", e.layer, e.expert, e.device),
            ));
        };
        let fits = e.offset.checked_add(e.len).is_some_and(|end| end <= d.len);
        let aligned = [e.offset, e.len, e.at].iter().all(|x| x % m.align.max(1) == 0);
        if !fits || !aligned || e.len == 0 {
            return Err(corrupt(
                path,
                format!(
                    "layer {} expert {}: a piece of {} bytes at {} of a {}-byte file is empty, unaligned or past \
                     its end; {again}",
                    e.layer, e.expert, e.len, e.offset, d.len
                ),
            ));
        }
        covered.entry((e.layer, e.expert)).or_default().push((e.at, e.len));
    }
    for r in index.experts.iter() {
        let want = ExpertImage::new(&index.tensors, r, m.align).len;
        let mut pieces = covered.remove(&(r.layer, r.expert)).unwrap_or_default();
        pieces.sort_unstable();
        let mut end = 0;
        for (at, len) in &pieces {
            if *at != end {
                break;
            }
            end = at + len;
        }
        if end != want || pieces.iter().map(|p| p.1).sum::<u64>() != want {
            return Err(corrupt(
                path,
                format!("layer {} expert {}: its pieces do not tile its {want}-byte image; {again}", r.layer, r.expert),
            ));
        }
    }
    if let Some((layer, expert)) = covered.keys().min() {
        return Err(corrupt(
            path,
            format!("places layer {layer} expert {expert}, which the checkpoint lacks; {again}"),
        ));
    }
    // No two pieces share bytes of a file (an expert's piece must not be another's), and each
    // device holds the bytes it says.
    for (d, dev) in m.devices.iter().enumerate() {
        let mut spans: Vec<(u64, u64)> =
            m.experts.iter().filter(|e| e.device == d).map(|e| (e.offset, e.len)).collect();
        spans.sort_unstable();
        let overlap = spans.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0);
        let held: u64 = spans.iter().map(|s| s.1).sum();
        if overlap || held != dev.expert_bytes {
            return Err(corrupt(
                path,
                format!(
                    "{}: pieces overlap, or hold other than its {} bytes; {again}",
                    dev.dir.display(),
                    dev.expert_bytes
                ),
            ));
        }
    }
    Ok(())
}

/// Bytes of the scratch file [`probe_rate`] writes: large enough that random reads of an expert
/// image do not all hit one track, small enough for a quick pack of a small model.
const PROBE_FILE_MIN: u64 = 16 << 20;
const PROBE_FILE_MAX: u64 = 256 << 20;

/// The random-read rate of the device under `dir` (bytes per second), for reads of `read_bytes`
/// at queue depth 32: the probe `bench` runs on the shards, over a scratch file written there
/// (and removed), since the directory holds no data yet.
pub fn probe_rate(dir: &Path, read_bytes: u64) -> Result<f64, PackError> {
    std::fs::create_dir_all(dir).map_err(io_err("create", dir))?;
    let path = dir.join(".k3ring-probe");
    let len = (64 * read_bytes).clamp(PROBE_FILE_MIN, PROBE_FILE_MAX).div_ceil(1 << 20) << 20;
    let result = (|| {
        let file = File::create(&path).map_err(io_err("create", &path))?;
        // Not zeros: a device or file system that compresses or dedups would report a rate it
        // never gives real weights.
        let mut chunk = vec![0u8; 1 << 20];
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for at in (0..len).step_by(chunk.len()) {
            for b in chunk.chunks_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                b.copy_from_slice(&x.to_le_bytes()[..b.len()]);
            }
            file.write_all_at(&chunk, at).map_err(io_err("write", &path))?;
        }
        file.sync_all().map_err(io_err("sync", &path))?;
        drop(file);
        let reads = (len / read_bytes.max(1)).clamp(16, 256) as usize;
        crate::storage::io::probe::random_read_rate(
            std::slice::from_ref(&path),
            &[(0, 0, len)],
            read_bytes as usize,
            32,
            reads,
            1,
        )
        .map_err(|e| PackError::Io {
            op: "probe the read rate of",
            path: dir.to_path_buf(),
            source: std::io::Error::other(e.to_string()),
        })
    })();
    let _ = std::fs::remove_file(&path);
    result
}
