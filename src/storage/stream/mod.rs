//! The streaming weight store: the trunk from the pack (pinned units resident, the rest cycled
//! through a ring of slots with read-ahead), routed experts read in place from the shards into a
//! pool of slots, embedding rows read by rows, all into one pre-allocated, aligned arena.
//!
//! What each file owns:
//! - [`layout`]: where the pack's units and tensors are, and the arena's regions.
//! - [`arena`]: the arena and its slots (`Empty -> InFlight -> Filled`); the only unsafe code.
//! - [`trunk_ring`]: pinned units and the ring of streamed units with its read-ahead.
//! - [`expert_pool`]: the expert slots, the cache policy's choices, requests and guards.
//! - [`expert_checks`]: experts' checksums, checked on first use or while the scheduler waits.
//! - [`embed`]: embedding rows.
//! - [`reads`]: what the store needs from the I/O stage, which the pipeline provides.
//! - [`stats`]: the counters of the run report.
//! - [`policy`], [`cache_sim`]: expert cache policies and their offline replay.
//!
//! Threads: the scheduler thread calls the store; guards may be dropped on compute threads; the
//! I/O stage's thread writes slots in flight. Each part has its own lock (ring, pool, embedding
//! buffer, counters); no lock is held while waiting for a read the caller needs, and the
//! counters' lock is taken last. Allocation: everything large is allocated at open; the
//! per-token path allocates only small op lists.
//!
//! Errors: a failed read fails the run naming file and offset, with the read layer's exit code
//! (4 for an I/O failure, 3 for a file shorter than its index, 1 for a read built wrongly); a
//! unit whose checksum does not match fails it with exit 3; an expert's bytes that do not match
//! are read once more, and fail it with exit 3 if they still do not (experts are checked after
//! their read lands and before any guard hands their bytes out). No read failure ever drops an
//! expert from a sum.

pub mod arena;
pub mod cache_sim;
pub mod embed;
mod expert_checks;
/// The tiny model copied with its pack, and opened as a streaming pipeline, for tests elsewhere
/// in the crate.
#[cfg(test)]
pub(crate) use expert_checks::tests::{open as open_tiny_pipeline, tiny_copy};
pub mod expert_pool;
pub mod layout;
pub mod pieces;
pub mod policy;
pub mod reads;
pub mod stats;
pub mod trunk_ring;

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod admission_tests;
#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod spread_tests;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use self::arena::{Arena, Filled, Slot};
use self::expert_pool::ExpertPool;
use self::layout::{ArenaLayout, PackLayout};
use self::pieces::RingItems;
use self::reads::{Priority, ReadQueue, Ticket};
use self::trunk_ring::TrunkRing;
use super::expert_files::{ExpertFiles, ExpertPlacement};
use super::io::{AlignedBuf, BufOptions, IoError};
use super::pack::{Manifest, PackError, PACK_FILE};
use super::plan::Plan;
use crate::checkpoint::CheckpointIndex;
use crate::config::Config;
use crate::exit::{Classify, ExitCode};
use crate::model::weights::SourceError;
use crate::trace::{SpanArgs, SpanKind, Tracer};

pub use self::expert_pool::{Admission, AdmitAll, ExpertGuard, Guess, Routed, Victim};
pub use self::layout::{embed_buffer_bytes, expert_slot_bytes};
pub use self::policy::ExpertKey;
pub use self::stats::{LayerStats, StreamStats};
pub use self::trunk_ring::TrunkGuard;

/// How to run the store.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// Streamed trunk units read ahead of the one computing.
    pub readahead: usize,
    /// Most tokens per forward pass (embedding rows read at once).
    pub chunk_tokens: usize,
    /// Check trunk checksums on every read, not only the first read of each unit.
    pub verify_every_read: bool,
    /// Check each expert read from the shards against its checksum in the pack's manifest
    /// before any compute uses it (on by default; `--no-verify-experts` turns it off).
    pub verify_experts: bool,
    pub lock_memory: bool,
    pub numa_node: Option<u32>,
    /// Expert cache policy: "lru", "s3fifo", "lfu", "cyclic" or "even".
    pub policy: String,
    /// Stream trunk units in pieces of this many bytes whatever the budget (`--piece-mb`);
    /// `None`: the planner decides.
    pub piece_bytes: Option<u64>,
    /// Hold the pinned trunk as pieces spread over the token ([`crate::storage::plan::PlanInput::spread_pins`]).
    pub spread_pins: bool,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            readahead: 1,
            chunk_tokens: 32,
            verify_every_read: false,
            verify_experts: true,
            lock_memory: true,
            numa_node: None,
            policy: policy::DEFAULT_POLICY.to_owned(),
            piece_bytes: None,
            spread_pins: true,
        }
    }
}

/// Why the store could not start.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    #[error(transparent)]
    Pack(#[from] PackError),
    #[error(transparent)]
    Io(#[from] IoError),
    /// A read of the pinned trunk units failed. The I/O thread shares each read error between
    /// its waiters, so the error stays behind its `Arc` and keeps its own classification.
    #[error("reading pinned trunk units: {0}")]
    PinnedRead(Arc<IoError>),
    /// A read of the pass over split units at open failed (see [`pieces`]).
    #[error("reading the trunk units streamed in pieces, at open: {0}")]
    SplitRead(Arc<IoError>),
    #[error("{0}")]
    Mismatch(String),
    /// `--io sim:` needs the bytes a run reads in memory, and they do not fit beside the budget.
    #[error(
        "--io {spec} serves reads from the page cache, and this run can read {:.2} GB there (experts {:.2} GB, \
         trunk pack beyond the pinned units {:.2} GB) while {:.2} GB of memory is available beside the budget \
         ({available_from}): lower the budget, or model the device with a model that fits",
        (*expert_bytes + *trunk_bytes) as f64 / 1e9, *expert_bytes as f64 / 1e9, *trunk_bytes as f64 / 1e9,
        *available as f64 / 1e9
    )]
    ModeledDeviceDoesNotFit {
        spec: String,
        expert_bytes: u64,
        trunk_bytes: u64,
        available: u64,
        available_from: String,
    },
}

impl Classify for StreamError {
    fn exit_code(&self) -> ExitCode {
        match self {
            StreamError::Pack(e) => e.exit_code(),
            StreamError::Io(e) => e.exit_code(),
            StreamError::PinnedRead(e) | StreamError::SplitRead(e) => e.exit_code(),
            StreamError::Mismatch(_) => ExitCode::Data,
            StreamError::ModeledDeviceDoesNotFit { .. } => ExitCode::Usage,
        }
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding these locks leaves consistent bookkeeping or plain counters
    // behind (every transition asserts before it mutates); keep going.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The first half of opening a store: the pack checked against the checkpoint and the arena
/// allocated as the plan says; nothing read yet. The I/O stage starts from it (it registers the
/// arena with the ring), then [`Store::open`] finishes.
pub struct Prepared {
    index: Arc<CheckpointIndex>,
    pack: PackLayout,
    layout: ArenaLayout,
    buf: Arc<AlignedBuf>,
    files: Vec<PathBuf>,
    align: u64,
    opts: StoreOptions,
    pinned_units: usize,
    expert_sums: Vec<Vec<u64>>,
    items: RingItems,
    placed: ExpertPlacement,
    /// Per file: the device it is read from (0 for the shards and the trunk pack; the expert
    /// files' devices after).
    devices: Vec<usize>,
    device_names: Vec<String>,
    /// The device of the first expert directory (`--device-io` models them in order).
    expert_lane_first: usize,
    /// [`ExpertFiles::describe`], when the experts come from expert files.
    placement_note: Option<String>,
}

impl Prepared {
    /// The files reads address by index: the checkpoint's shards, then the trunk pack, then
    /// the expert files of `pack --experts-to`, if any.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Per file of [`Prepared::files`], the device that reads it: one I/O ring per device.
    pub fn file_devices(&self) -> &[usize] {
        &self.devices
    }

    /// What each device holds, for the report ("shards and trunk", an expert directory).
    pub fn device_names(&self) -> &[String] {
        &self.device_names
    }

    /// The device of the first expert directory; the devices before it hold the shards and the
    /// trunk pack.
    pub fn expert_lane_first(&self) -> usize {
        self.expert_lane_first
    }

    /// Where the expert files put the experts, for the console; `None` when the shards hold them.
    pub fn placement_note(&self) -> Option<&str> {
        self.placement_note.as_deref()
    }

    /// The memory every read targets.
    pub fn buffer(&self) -> &Arc<AlignedBuf> {
        &self.buf
    }

    pub fn align(&self) -> u64 {
        self.align
    }

    /// What a run may read again and again, as (file index, first byte, end): every expert, and
    /// the trunk units streamed whole or in pieces (not the pinned ones, read once at open, nor
    /// the embedding table, of which a run reads a row per token); with their bytes (experts,
    /// trunk). A modeled device (`--io sim:`) needs these in the page cache.
    pub fn reread_ranges(&self) -> (Vec<(usize, u64, u64)>, u64, u64) {
        let mut ranges = Vec::new();
        let mut expert_bytes = 0;
        for r in self.index.experts.iter() {
            if let Some(pieces) = self.placed.get((r.layer, r.expert)) {
                for p in pieces {
                    ranges.push((p.file, p.offset, p.offset + p.len));
                    expert_bytes += p.len;
                }
            } else if let Some((shard, start, end)) = r.contiguous {
                ranges.push((shard, start, end));
                expert_bytes += end - start;
            } else {
                for &id in &r.parts {
                    let t = &self.index.tensors[id];
                    ranges.push((t.shard, t.offset, t.offset + t.len));
                    expert_bytes += t.len;
                }
            }
        }
        let mut trunk_bytes = 0;
        for (i, u) in self.pack.units.iter().enumerate() {
            let streamed = self.items.whole.get(i).is_some_and(Option::is_some)
                || self.items.split.get(i).is_some_and(Option::is_some);
            if streamed {
                ranges.push((self.pack.pack_file, u.file_offset, u.file_offset + u.len));
                trunk_bytes += u.len;
            }
        }
        (ranges, expert_bytes, trunk_bytes)
    }
}

/// The devices of the shards and the trunk pack (`files[..=pack_file]`) and their names: one
/// device for both, unless the trunk pack's file system sits on another block device than the
/// first shard's (a trunk on a drive of its own gets a ring of its own).
fn shard_and_trunk_devices(files: &[PathBuf], pack_file: usize) -> (Vec<usize>, Vec<String>) {
    use std::os::unix::fs::MetadataExt;
    let dev = |p: &PathBuf| std::fs::metadata(p).ok().map(|m| m.dev());
    let separate = match (files.first().and_then(dev), files.get(pack_file).and_then(dev)) {
        (Some(shards), Some(trunk)) => shards != trunk,
        _ => false,
    };
    lanes_of_shards_and_trunk(pack_file, separate)
}

/// [`shard_and_trunk_devices`] once it is known whether the two are `separate`.
fn lanes_of_shards_and_trunk(pack_file: usize, separate: bool) -> (Vec<usize>, Vec<String>) {
    let mut devices = vec![0; pack_file + 1];
    if separate {
        devices[pack_file] = 1;
        (devices, vec!["shards".to_owned(), "trunk pack".to_owned()])
    } else {
        (devices, vec!["shards and trunk".to_owned()])
    }
}

/// The streaming store.
pub struct Store {
    index: Arc<CheckpointIndex>,
    pack: PackLayout,
    arena: Arena,
    align: u64,
    reads: Arc<dyn ReadQueue>,
    tracer: Arc<Tracer>,
    verify_every_read: bool,
    verify_experts: bool,
    /// Per MoE layer, each expert's checksum (from the pack's manifest), by expert id.
    expert_sums: Vec<Vec<u64>>,
    /// Experts read from `pack --experts-to` files (empty: from the shards).
    placed: ExpertPlacement,
    /// Per unit: the bytes of a pinned unit (loaded and verified at open).
    pinned: Vec<Option<Filled>>,
    /// What the ring cycles through: whole units and the pieces of split ones.
    items: RingItems,
    /// The small tensors of split units (copied at open), if any unit is split.
    small: Option<Filled>,
    /// The pinned pieces of split units (copied at open), if the plan pins any.
    pinned_pieces: Option<Filled>,
    ring: Mutex<TrunkRing>,
    pool: Mutex<ExpertPool>,
    /// The expert check that waits for reads have left part-way, if any.
    waiting_check: Mutex<Option<expert_checks::WaitingCheck>>,
    /// The embedding row buffer.
    embed: Mutex<Slot>,
    stats: Mutex<StreamStats>,
}

/// What compute waits for. A layer's waits count in its stall; its expert waits count apart as well, since they are the only waits a guess for that
/// layer can remove (the trial's bound: [`crate::pipeline`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitFor {
    /// A layer's experts (a read, or a slot to read into).
    Experts(usize),
    /// Trunk bytes, of a layer when the unit belongs to one.
    Trunk(Option<usize>),
    /// The embedding rows.
    Embedding,
}

impl WaitFor {
    fn layer(self) -> Option<usize> {
        match self {
            WaitFor::Experts(l) => Some(l),
            WaitFor::Trunk(l) => l,
            WaitFor::Embedding => None,
        }
    }
}

impl Store {
    /// Checks the pack against the checkpoint and allocates the arena as the plan says.
    /// `alignment` gives the reads' alignment for the files (the device's, or the simulator's).
    pub fn prepare(
        model_dir: &Path,
        trunk_dir: &Path,
        index: Arc<CheckpointIndex>,
        cfg: &Config,
        plan: &Plan,
        opts: &StoreOptions,
        alignment: impl FnOnce(&[PathBuf]) -> Result<u64, StreamError>,
    ) -> Result<Prepared, StreamError> {
        let manifest = Manifest::load(trunk_dir)?;
        manifest.check_source(trunk_dir, model_dir, &index)?;
        let expert_sums = manifest.expert_checksums(trunk_dir, &index)?;
        let pack_path = trunk_dir.join(PACK_FILE);
        let mut files: Vec<PathBuf> = index.shards.iter().map(|s| s.path.clone()).collect();
        files.push(pack_path.clone());
        let pack_file = files.len() - 1;
        let expert_files = ExpertFiles::open(trunk_dir, &manifest, &index)?;
        let (mut devices, mut device_names) = shard_and_trunk_devices(&files, pack_file);
        let expert_lane_first = device_names.len();
        let placed = match &expert_files {
            Some(ef) => {
                let placed = ef.placement(files.len(), trunk_dir, &index);
                for (d, path) in ef.paths.iter().enumerate() {
                    files.push(path.clone());
                    devices.push(expert_lane_first + d);
                    device_names.push(ef.manifest.devices[d].dir.display().to_string());
                }
                placed
            }
            None => ExpertPlacement::default(),
        };
        let placement_note = expert_files.as_ref().map(ExpertFiles::describe);
        let align = alignment(&files)?;
        if manifest.alignment % align != 0 {
            return Err(StreamError::Mismatch(format!(
                "the trunk pack's units are aligned to {} bytes but the device needs {align}: run `k3ring pack` again",
                manifest.alignment
            )));
        }
        let pack = PackLayout::new(&manifest, &index, cfg, pack_path, pack_file)?;
        let weights = crate::model::weights::ModelWeights::resolve(cfg, &index)
            .map_err(|e| StreamError::Mismatch(e.to_string()))?;
        let pinned: Vec<usize> =
            plan.pinned_units.iter().filter_map(|want| pack.units.iter().position(|u| u.unit == *want)).collect();
        let items = RingItems::new(&pack, &weights, cfg, plan, &pinned, align)?;
        // An expert file holds each expert's image at the pack's alignment, which may be
        // stricter than the device's: its slots must hold that image.
        let expert_align = if placed.is_empty() { align } else { align.max(manifest.alignment) };
        let layout = ArenaLayout::new(
            &pack,
            cfg,
            plan,
            opts.chunk_tokens,
            (align, expert_align),
            (items.small_bytes, items.pinned_bytes),
        )?;
        let buf_opts = BufOptions { node: opts.numa_node, lock: opts.lock_memory, ..BufOptions::default() };
        let buf = Arc::new(AlignedBuf::new(layout.total.max(align as usize), &buf_opts)?);
        Ok(Prepared {
            index,
            pack,
            layout,
            buf,
            files,
            align,
            opts: opts.clone(),
            pinned_units: plan.pinned_units.len(),
            expert_sums,
            items,
            placed,
            devices,
            device_names,
            expert_lane_first,
            placement_note,
        })
    }

    /// Finishes opening over the I/O stage `reads` (`fixed_buffers`: it registered the arena):
    /// builds the slots and reads the pinned units (verifying each).
    pub fn open(
        p: Prepared,
        reads: Arc<dyn ReadQueue>,
        fixed_buffers: bool,
        stats: StreamStats,
        tracer: Arc<Tracer>,
        expert_policy: Box<dyn policy::CachePolicy>,
    ) -> Result<Store, StreamError> {
        let arena = Arena::new(p.buf, fixed_buffers);
        let streamed_order = p.items.order.clone();
        let streamed_units =
            p.items.whole.iter().zip(&p.items.split).filter(|(w, s)| w.is_some() || s.is_some()).count();
        let lock_state = match arena.buffer().lock_state() {
            super::io::LockState::Locked => "mlocked".to_owned(),
            super::io::LockState::NotRequested => "not locked (--no-mlock)".to_owned(),
            super::io::LockState::Failed(e) => format!("not locked: {e}"),
        };
        let stats = StreamStats {
            buffers: format!(
                "{} arena, huge-page aligned, {}, NUMA node {}",
                crate::storage::plan::fmt_gb(arena.buffer().len() as u64),
                lock_state,
                arena.buffer().node().map_or_else(|| "unbound".to_owned(), |n| n.to_string())
            ),
            trunk_pinned_units: p.pinned_units,
            trunk_streamed_units: streamed_units,
            trunk_split_units: p.items.split.iter().filter(|s| s.is_some()).count(),
            trunk_pieces: p.items.items.iter().filter(|i| i.rows.is_some()).count(),
            trunk_pinned_pieces: p.items.items.iter().filter(|i| i.pinned_at.is_some()).count(),
            ..stats
        };
        let ring_slots = p.layout.ring.iter().map(|&r| arena.slot(r)).collect();
        // Pieces are small: with read-ahead on, every ring slot but the computing one reads ahead.
        let split = p.items.split.iter().any(Option::is_some);
        let readahead =
            if split && p.opts.readahead > 0 { p.layout.ring.len().saturating_sub(1) } else { p.opts.readahead };
        let ring = TrunkRing::new(ring_slots, p.items.items.len(), streamed_order, readahead);
        let pool = ExpertPool::new(p.layout.experts.iter().map(|&r| arena.slot(r)).collect(), expert_policy);
        let embed = arena.slot(p.layout.embed);
        let mut store = Store {
            index: p.index,
            pinned: vec![None; p.pack.units.len()],
            pack: p.pack,
            arena,
            align: p.align,
            reads,
            tracer,
            verify_every_read: p.opts.verify_every_read,
            verify_experts: p.opts.verify_experts,
            expert_sums: p.expert_sums,
            items: p.items,
            placed: p.placed,
            small: None,
            pinned_pieces: None,
            ring: Mutex::new(ring),
            pool: Mutex::new(pool),
            waiting_check: Mutex::new(None),
            embed: Mutex::new(embed),
            stats: Mutex::new(stats),
        };
        store.load_pinned(&p.layout)?;
        store.load_split(&p.layout)?;
        Ok(store)
    }

    /// Reads every pinned unit in one batch and verifies each.
    fn load_pinned(&mut self, layout: &ArenaLayout) -> Result<(), StreamError> {
        let mut slots: Vec<(usize, Slot)> = layout.pinned.iter().map(|&(u, r)| (u, self.arena.slot(r))).collect();
        let ticket = self.reads.reserve();
        let ops = slots
            .iter_mut()
            .map(|(u, slot)| {
                let unit = &self.pack.units[*u];
                let target = slot.start_read(ticket);
                self.arena.op(target, 0, self.unit_range(unit), trunk_ring::unit_meta(unit, Priority::Demand))
            })
            .collect();
        self.reads.submit(Priority::Demand, vec![(ticket, ops)]);
        self.wait_io(ticket, WaitFor::Trunk(None)).map_err(StreamError::PinnedRead)?;
        let mut bytes = 0;
        for (u, slot) in &mut slots {
            slot.landed();
            let filled = slot.filled().ok_or_else(|| StreamError::Mismatch("a pinned unit is not filled".into()))?;
            self.verify_unit(*u, filled)?;
            self.pinned[*u] = Some(filled);
            bytes += self.pack.units[*u].len;
        }
        let mut stats = lock(&self.stats);
        stats.trunk_bytes_read += bytes;
        // Each pinned unit was one read: counted, so bytes never appear with "0 reads".
        stats.trunk_reads += slots.len() as u64;
        Ok(())
    }

    /// The store's counters so far (without the I/O stage's).
    pub fn stats(&self) -> StreamStats {
        lock(&self.stats).clone()
    }

    /// Each layer's expert bytes read so far (index = layer): one lock, no copy of the rest.
    pub fn expert_bytes_by_layer(&self) -> Vec<u64> {
        lock(&self.stats).expert_bytes_by_layer()
    }

    /// Adds to the counters.
    pub fn count(&self, f: impl FnOnce(&mut StreamStats)) {
        f(&mut lock(&self.stats));
    }

    /// The tracer the store records stalls in.
    pub fn tracer(&self) -> &Arc<Tracer> {
        &self.tracer
    }

    /// Waits for a batch, recording the stall as a scheduler "wait" span when it blocks, and
    /// checking landed experts meanwhile ([`expert_checks`]).
    pub fn wait_io(&self, t: Ticket, what: WaitFor) -> Result<(), Arc<IoError>> {
        if self.reads.is_done(t) {
            return self.reads.wait(t);
        }
        let layer = what.layer();
        let mut args = SpanArgs::new();
        args.layer = layer.map(|l| l as u32);
        let start = self.tracer.now_us();
        let stall = self.tracer.span_args(SpanKind::Wait, args);
        self.check_while_waiting(t);
        let r = kernels::while_blocked(|| self.reads.wait(t));
        drop(stall);
        self.count_wait(what, self.tracer.now_us() - start);
        r
    }

    /// Counts `waited_us` of compute waiting for `what` in its layer's stall, and in the layer's
    /// expert waits when it waited for experts (the prefetcher's trials read those apart).
    pub(crate) fn count_wait(&self, what: WaitFor, waited_us: f64) {
        if let Some(l) = what.layer() {
            let mut stats = lock(&self.stats);
            let l = stats.layer(l);
            l.stall_us += waited_us;
            if matches!(what, WaitFor::Experts(_)) {
                l.expert_stall_us += waited_us;
            }
        }
    }

    /// Seconds compute has waited for `layer`'s experts so far.
    pub fn expert_waited_seconds(&self, layer: usize) -> f64 {
        lock(&self.stats).per_layer.get(layer).map_or(0.0, |l| l.expert_stall_us / 1e6)
    }

    fn read_error(&self, what: String, e: &Arc<IoError>) -> SourceError {
        SourceError::Read {
            what,
            exit_code: e.exit_code(),
            source: Arc::clone(e) as Arc<dyn std::error::Error + Send + Sync>,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::lanes_of_shards_and_trunk;

    #[test]
    fn a_trunk_pack_on_another_device_gets_a_ring_of_its_own() {
        // Three shards and the pack (file 3).
        let (devices, names) = lanes_of_shards_and_trunk(3, false);
        assert_eq!((devices, names), (vec![0, 0, 0, 0], vec!["shards and trunk".to_owned()]));
        let (devices, names) = lanes_of_shards_and_trunk(3, true);
        assert_eq!((devices, names.len()), (vec![0, 0, 0, 1], 2));
        // The tests' shards and packs share one file system: one device.
        let dir = tempfile::tempdir().unwrap();
        let files: Vec<std::path::PathBuf> = (0..2).map(|i| dir.path().join(format!("f{i}"))).collect();
        for f in &files {
            std::fs::write(f, b"x").unwrap();
        }
        assert_eq!(super::shard_and_trunk_devices(&files, 1).0, vec![0, 0]);
    }
}
