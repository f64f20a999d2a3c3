//! `k3ring pack --verify`: everything checked, nothing assumed. Each trunk unit is re-read from
//! the pack and checked against its checksum (and each embedding row against its own), and
//! compared byte for byte with what packing the shards now would write; each expert is re-read
//! from the shards and checked against its checksum. Every mismatch is collected, named (unit
//! and tensor, or layer, expert and file), and reported together.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Mutex;

use kernels::hash::Xxh3;

use super::experts::{expert_len, experts_in_disk_order, open_shards, read_expert_checksum};
use super::{
    copy_pool, fill_window, io_err, row_checksums, unit_window, Manifest, PackError, PackUnit, ShardFiles, UnitEntry,
    PACK_FILE,
};
use crate::checkpoint::CheckpointIndex;

/// What `verify` checked and what it found.
#[derive(Clone, Debug, Default)]
pub struct VerifyReport {
    pub units: usize,
    pub unit_bytes: u64,
    pub experts: usize,
    pub expert_bytes: u64,
    /// One line per mismatch, naming what.
    pub mismatches: Vec<String>,
}

impl VerifyReport {
    /// The report as an error when anything mismatched.
    pub fn into_result(self, dir: &Path) -> Result<VerifyReport, PackError> {
        match self.mismatches.first() {
            None => Ok(self),
            Some(first) => {
                Err(PackError::Verify { dir: dir.to_owned(), count: self.mismatches.len(), first: first.clone() })
            }
        }
    }
}

/// Bytes `verify` reads: every unit of the pack, and every expert.
pub fn verify_bytes(manifest: &Manifest, index: &CheckpointIndex) -> u64 {
    manifest.units.iter().map(|u| u.len).sum::<u64>() + index.experts.iter().map(|r| expert_len(index, r)).sum::<u64>()
}

/// Checks the pack in `dir` (described by `manifest`, made from `index`) and every expert;
/// `progress` gets the bytes read so far (out of [`verify_bytes`]). An I/O failure is an error;
/// mismatches are in the report.
pub fn verify(
    dir: &Path,
    manifest: &Manifest,
    index: &CheckpointIndex,
    row_len: usize,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<VerifyReport, PackError> {
    use rayon::prelude::*;
    let pack_path = dir.join(PACK_FILE);
    let pack = File::open(&pack_path).map_err(io_err("open", &pack_path))?;
    let sums = manifest.expert_checksums(dir, index)?;
    let mismatches = Mutex::new(Vec::new());
    let report = |m: String| mismatches.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(m);
    let files = open_shards(index)?;
    let experts = experts_in_disk_order(index);
    copy_pool(&pack_path)?.install(|| {
        manifest.units.par_iter().try_for_each(|u| {
            let row = (u.unit == PackUnit::Embed.name()).then_some(row_len);
            verify_unit(index, u, row, &pack, &pack_path, manifest.alignment, progress, &report)
        })?;
        experts.par_iter().with_min_len(16).try_for_each_init(Vec::new, |buf, r| {
            let got = read_expert_checksum(index, &files, r, buf, &mut |n| progress(n))?;
            let want = sums[r.layer][r.expert];
            if got != want {
                let mut shards: Vec<String> = r
                    .parts
                    .iter()
                    .map(|&id| index.shards[index.tensors[id].shard].path.display().to_string())
                    .collect();
                shards.dedup();
                report(format!(
                    "layer {} expert {} in {} fails its checksum (manifest {want:016x}, shards {got:016x}): the \
                     shard changed since `k3ring pack`",
                    r.layer,
                    r.expert,
                    shards.join(", ")
                ));
            }
            Ok::<_, PackError>(())
        })
    })?;
    let mut mismatches = mismatches.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
    mismatches.sort();
    Ok(VerifyReport {
        units: manifest.units.len(),
        unit_bytes: manifest.units.iter().map(|u| u.len).sum(),
        experts: experts.len(),
        expert_bytes: experts.iter().map(|r| expert_len(index, r)).sum(),
        mismatches,
    })
}

/// The first unit of the pack in `dir` that does not match its checksum in `m`, in words
/// (`None`: every unit matches). Reads the whole pack once, a window at a time.
pub(super) fn first_damaged_unit(dir: &Path, m: &Manifest) -> Result<Option<String>, PackError> {
    const WINDOW: usize = 8 << 20;
    let path = dir.join(PACK_FILE);
    let pack = crate::files::input::open_regular(&path, 0)?;
    let mut buf = vec![0u8; WINDOW];
    for u in &m.units {
        let mut hash = Xxh3::new();
        let mut at = 0u64;
        while at < u.len {
            let n = ((u.len - at) as usize).min(WINDOW);
            if let Err(e) = pack.read_exact_at(&mut buf[..n], u.offset + at) {
                return Ok(Some(format!("unit {} cannot be read whole ({e})", u.unit)));
            }
            hash.update(&buf[..n]);
            at += n as u64;
        }
        let sum = format!("{:016x}", hash.digest());
        if sum != u.checksum {
            return Ok(Some(format!("unit {} fails its checksum (manifest {}, file {sum})", u.unit, u.checksum)));
        }
    }
    Ok(None)
}

/// Checks one unit window by window: the pack's bytes against the unit's checksum (and the
/// embedding's rows against theirs), and against the window assembled from the shards.
#[allow(clippy::too_many_arguments)]
fn verify_unit(
    index: &CheckpointIndex,
    u: &UnitEntry,
    row_len: Option<usize>,
    pack: &File,
    pack_path: &Path,
    alignment: u64,
    progress: &(dyn Fn(u64) + Sync),
    report: &(dyn Fn(String) + Sync),
) -> Result<(), PackError> {
    let window = unit_window(row_len, alignment);
    let (mut got, mut want) = (vec![0u8; window], vec![0u8; window]);
    let mut sources = ShardFiles::default();
    let mut hash = Xxh3::new();
    let mut rows = Vec::new();
    let mut first_diff = None;
    let mut at = 0u64;
    while at < u.len {
        let n = ((u.len - at) as usize).min(window);
        pack.read_exact_at(&mut got[..n], u.offset + at).map_err(io_err("read", pack_path))?;
        fill_window(index, u, at, &mut want[..n], &mut sources)?;
        hash.update(&got[..n]);
        rows.extend(row_checksums(u, row_len, at, &got[..n]));
        if first_diff.is_none() {
            first_diff = got[..n].iter().zip(&want[..n]).position(|(a, b)| a != b).map(|i| at + i as u64);
        }
        progress(n as u64);
        at += n as u64;
    }
    let sum = format!("{:016x}", hash.digest());
    let path = pack_path.display();
    if sum != u.checksum {
        report(format!(
            "{path}: unit {} fails its checksum (manifest {}, file {sum}): the pack is damaged",
            u.unit, u.checksum
        ));
    }
    let bad_rows: Vec<usize> =
        rows.iter().zip(&u.row_checksums).enumerate().filter(|(_, (a, b))| a != b).map(|(i, _)| i).collect();
    if let Some(&row) = bad_rows.first() {
        report(format!("{path}: {} embedding row(s) fail their checksums, the first row {row}", bad_rows.len()));
    }
    if let Some(pos) = first_diff {
        let why = if sum == u.checksum {
            "the checkpoint changed since `k3ring pack`; the pack still matches its checksum"
        } else {
            "the pack is damaged"
        };
        report(differs_from_source(index, u, pos, &path.to_string(), why));
    }
    Ok(())
}

/// Names the tensor (and its shard) whose packed byte at `pos` of unit `u` differs from the
/// shard's.
fn differs_from_source(index: &CheckpointIndex, u: &UnitEntry, pos: u64, pack: &str, why: &str) -> String {
    let tensor = u.tensors.iter().find(|t| (t.offset..t.offset + t.len).contains(&pos));
    match tensor.and_then(|t| Some((t, index.get(&t.name)?))) {
        Some((t, info)) => format!(
            "{pack}: unit {} tensor {} differs from {} at byte {} of the tensor ({why})",
            u.unit,
            t.name,
            index.shards[info.shard].path.display(),
            pos - t.offset
        ),
        None => format!("{pack}: unit {} has a non-zero padding byte at offset {pos} of the unit", u.unit),
    }
}
