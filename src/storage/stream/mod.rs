//! The streaming weight store: the trunk from the pack (pinned units resident, the rest cycled
//! through a ring of slots with read-ahead), routed experts read in place from the shards into a
//! pool of slots, all through one I/O thread and one pre-allocated, aligned arena.
//!
//! Threads: the compute thread calls the [`WeightSource`] methods; the I/O thread (see
//! [`service`]) owns the read backend. A slot moves Free -> InFlight (its bytes belong to the
//! kernel) -> Filled (readable) and is handed out only when Filled; a slot in use by a guard is
//! never chosen for another read. Allocation: everything large is allocated in [`open`]; the
//! per-token path allocates only small op lists.
//!
//! Errors: a failed read fails the run naming file and offset, with the read layer's exit code
//! (4 for an I/O failure, 3 for a file shorter than its index, 1 for a read built wrongly); a
//! unit whose checksum does not match fails it with exit 3. No read failure ever drops an expert
//! from a sum.
//!
//! [`open`]: StreamingSource::open

pub mod cache_sim;
pub mod policy;
pub mod service;

use std::collections::{HashMap, HashSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::Serialize;

use self::policy::{CachePolicy, ExpertKey};
use self::service::{IoService, OpMeta, Priority, SendOp, Ticket};
use super::io::{
    align::open_direct, AlignedBuf, BufOptions, FaultPlan, IoError, IoStats, MappedReader, PreadOptions, PreadReader,
    ReadBackend, ReadOp, RingOptions, UringReader,
};
use super::pack::{Manifest, PackError, PackUnit, PACK_FILE};
use super::plan::Plan;
use crate::checkpoint::CheckpointIndex;
use crate::config::Config;
use crate::exit::{Classify, ExitCode};
use crate::model::weights::{ExpertBytes, ExpertView, Mat, SourceError, TensorId, TrunkUnit, TrunkView, WeightSource};
use crate::trace::{Stage, Tracer};

/// Which read backend serves the store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum IoKind {
    Uring,
    Pread,
    Mmap,
    /// The seeded simulator (tests).
    Sim,
}

impl IoKind {
    pub fn parse(s: &str) -> Option<IoKind> {
        match s {
            "uring" => Some(IoKind::Uring),
            "pread" => Some(IoKind::Pread),
            "mmap" => Some(IoKind::Mmap),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            IoKind::Uring => "uring",
            IoKind::Pread => "pread",
            IoKind::Mmap => "mmap",
            IoKind::Sim => "sim",
        }
    }
}

/// How to run the store.
#[derive(Clone, Debug)]
pub struct StreamOptions {
    pub io: IoKind,
    pub queue_depth: u32,
    pub chunk_bytes: usize,
    /// Streamed trunk units read ahead of the one computing.
    pub readahead: usize,
    /// Most tokens per forward pass (embedding rows read at once).
    pub chunk_tokens: usize,
    /// Check trunk checksums on every read, not only the first read of each unit.
    pub verify_every_read: bool,
    pub lock_memory: bool,
    pub numa_node: Option<u32>,
    /// CPU the I/O thread is pinned to.
    pub io_core: Option<usize>,
    /// Expert cache policy: "lru", "s3fifo" or "lfu".
    pub policy: String,
    /// Also prefetch the experts the previous token used at the next layer.
    pub spec_prev_token: bool,
    /// Fault injection for the real backends (tests).
    pub inject: Option<FaultPlan>,
    /// Options of the simulator when `io` is `Sim`.
    pub sim: Option<super::io::sim::SimOptions>,
    pub pread_threads: usize,
    /// The public C engine's order: a layer's expert reads are all waited for before any of
    /// them is computed (no overlap of expert reads with expert compute).
    pub serial: bool,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions {
            io: IoKind::Uring,
            queue_depth: 32,
            chunk_bytes: 1 << 20,
            readahead: 1,
            chunk_tokens: 32,
            verify_every_read: false,
            lock_memory: true,
            numa_node: None,
            io_core: None,
            policy: "lru".to_owned(),
            spec_prev_token: false,
            inject: None,
            sim: None,
            pread_threads: 4,
            serial: false,
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
    #[error("{0}")]
    Mismatch(String),
}

impl Classify for StreamError {
    fn exit_code(&self) -> ExitCode {
        match self {
            StreamError::Pack(e) => e.exit_code(),
            StreamError::Io(e) => e.exit_code(),
            StreamError::PinnedRead(e) => e.exit_code(),
            StreamError::Mismatch(_) => ExitCode::Data,
        }
    }
}

/// Bytes of one expert slot: the largest read window of an expert, for contiguous experts the
/// aligned window, for split ones six aligned windows.
pub fn expert_slot_bytes(cfg: &Config, align: u64) -> u64 {
    (cfg.expert_bytes() + 12 * align).div_ceil(align) * align
}

/// Bytes of the embedding row buffer for `rows` rows.
pub fn embed_buffer_bytes(cfg: &Config, rows: usize, align: u64) -> u64 {
    let row = 2 * cfg.hidden_size as u64;
    rows as u64 * (row + 2 * align).div_ceil(align) * align
}

/// What the store did, for the run report.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StreamStats {
    pub backend: String,
    pub backend_info: String,
    pub buffers: String,
    pub trunk_pinned_units: usize,
    pub trunk_streamed_units: usize,
    pub trunk_bytes_read: u64,
    pub trunk_reads: u64,
    pub embed_bytes_read: u64,
    pub expert_bytes_read: u64,
    /// Bytes of the aligned windows read for experts (what the device delivered).
    pub expert_window_bytes_read: u64,
    pub expert_reads: u64,
    /// Experts already resident before the layer that needed them asked.
    pub expert_hits: u64,
    pub expert_misses: u64,
    pub expert_evictions: u64,
    /// Experts read on a prediction, and their bytes.
    pub spec_reads: u64,
    pub spec_bytes: u64,
    /// Predicted experts that a layer then used.
    pub spec_used: u64,
    /// Bytes of predicted experts evicted without being used.
    pub spec_wasted_bytes: u64,
    /// Layers whose speculation was skipped because the device was already saturated.
    pub spec_skipped_busy: u64,
    /// True routed experts, and those already requested (resident or in flight) when the
    /// layer's routing was known: recall = recalled / routed.
    pub routed_experts: u64,
    pub routed_recalled: u64,
    pub read_busy_seconds: f64,
    pub read_bytes_per_second: f64,
    pub io: IoCounters,
    /// Per MoE layer: reads, hits, recall and stalls.
    pub per_layer: Vec<LayerStats>,
}

/// One layer's share of the store's work.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LayerStats {
    pub layer: usize,
    pub expert_reads: u64,
    pub expert_bytes_read: u64,
    pub expert_hits: u64,
    pub routed_experts: u64,
    pub routed_recalled: u64,
    /// Time compute waited for this layer's bytes (trunk and experts).
    pub stall_us: f64,
}

impl StreamStats {
    fn layer(&mut self, layer: usize) -> &mut LayerStats {
        if self.per_layer.len() <= layer {
            let from = self.per_layer.len();
            self.per_layer.extend((from..=layer).map(|l| LayerStats { layer: l, ..LayerStats::default() }));
        }
        &mut self.per_layer[layer]
    }
}

impl StreamStats {
    /// Expert bytes the backend reads: whole aligned windows, not only the tensors.
    pub fn expert_bytes_read_windows(&self) -> u64 {
        self.expert_window_bytes_read
    }
}

/// The backend's counters (proof of which backend did the reading).
#[derive(Clone, Debug, Default, Serialize)]
pub struct IoCounters {
    pub ops: u64,
    pub bytes_read: u64,
    pub sqes_submitted: u64,
    pub submit_syscalls: u64,
    pub enter_syscalls: u64,
    pub short_read_resubmits: u64,
    pub retries: u64,
}

impl From<IoStats> for IoCounters {
    fn from(s: IoStats) -> Self {
        IoCounters {
            ops: s.ops,
            bytes_read: s.bytes_read,
            sqes_submitted: s.sqes_submitted,
            submit_syscalls: s.submit_syscalls,
            enter_syscalls: s.enter_syscalls,
            short_read_resubmits: s.short_read_resubmits,
            retries: s.retries,
        }
    }
}

/// A byte range of the arena.
#[derive(Clone, Copy, Debug)]
struct Region {
    off: usize,
    len: usize,
}

/// A trunk unit of the pack.
struct UnitPlace {
    /// Per-row checksums (the embedding only).
    row_checksums: Vec<u64>,
    unit: PackUnit,
    file_offset: u64,
    len: u64,
    checksum: String,
    pinned: Option<Region>,
}

/// Where a trunk tensor is: unit index and byte range inside the unit.
#[derive(Clone, Copy)]
struct Loc {
    unit: usize,
    offset: usize,
    len: usize,
}

struct RingSlot {
    region: Region,
    unit: Option<usize>,
    ticket: Option<Ticket>,
    users: usize,
}

/// Where each of an expert's six tensors sits in its slot: (offset, len), in EXPERT_PARTS order.
type PartPlaces = [(usize, usize); 6];

struct ExpertSlot {
    region: Region,
    key: Option<ExpertKey>,
    ticket: Option<Ticket>,
    users: usize,
    /// Part (offset in slot, len), in EXPERT_PARTS order.
    parts: [(usize, usize); 6],
    /// Read on a prediction and not used yet.
    speculative: bool,
    /// Tensor bytes of the expert held.
    bytes: u64,
}

struct State {
    ring: Vec<RingSlot>,
    verified: Vec<bool>,
    experts: Vec<ExpertSlot>,
    resident: HashMap<ExpertKey, usize>,
    policy: Box<dyn CachePolicy>,
    /// Experts of the current layer not read yet (no slot was free), in disk order.
    pending: VecDeque<ExpertKey>,
    /// Experts of the current layer not used yet: never evicted.
    protected: HashSet<ExpertKey>,
    /// The experts each layer used for the last chunk (for --spec-prev-token).
    last_routed: Vec<Vec<usize>>,
    stats: StreamStats,
}

/// The streaming store.
pub struct StreamingSource {
    index: Arc<CheckpointIndex>,
    pack_path: PathBuf,
    pack_file: usize,
    units: Vec<UnitPlace>,
    /// Streamed units in the order a token uses them.
    streamed_order: Vec<usize>,
    unit_of_layer: Vec<usize>,
    head_unit: usize,
    embed: Loc,
    embed_region: Region,
    tensor_loc: Vec<Option<Loc>>,
    arena: Arc<AlignedBuf>,
    align: u64,
    readahead: usize,
    verify_every_read: bool,
    serial: bool,
    spec_prev_token: bool,
    /// Outstanding bytes above which speculation waits (the device's window).
    spec_idle_bytes: usize,
    fixed_buffers: bool,
    state: Mutex<State>,
    io: IoService,
    tracer: Arc<Tracer>,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

impl StreamingSource {
    /// Checks the pack against the checkpoint, allocates the arena as the plan says, starts the
    /// I/O thread and reads the pinned units (verifying each).
    pub fn open(
        model_dir: &Path,
        trunk_dir: &Path,
        index: Arc<CheckpointIndex>,
        cfg: &Config,
        plan: &Plan,
        opts: &StreamOptions,
        tracer: Arc<Tracer>,
    ) -> Result<StreamingSource, StreamError> {
        let manifest = Manifest::load(trunk_dir)?;
        manifest.check_source(trunk_dir, model_dir, &index)?;
        let pack_path = trunk_dir.join(PACK_FILE);
        let mut files: Vec<PathBuf> = index.shards.iter().map(|s| s.path.clone()).collect();
        files.push(pack_path.clone());
        let align = read_alignment(&files, opts)?;
        if manifest.alignment % align != 0 {
            return Err(StreamError::Mismatch(format!(
                "the trunk pack's units are aligned to {} bytes but the device needs {align}: run `k3ring pack` again",
                manifest.alignment
            )));
        }
        let (mut units, tensor_loc) = place_units(&manifest, &index)?;
        let layout = Layout::new(&mut units, cfg, plan, opts, align)?;
        let buf_opts = BufOptions { node: opts.numa_node, lock: opts.lock_memory, ..BufOptions::default() };
        let arena = Arc::new(AlignedBuf::new(layout.total.max(align as usize), &buf_opts)?);
        let io = start_io(&files, opts, &arena, align, Arc::clone(&tracer))?;
        let unit_idx = |u: PackUnit| units.iter().position(|p| p.unit == u);
        let missing = |what: &str| StreamError::Mismatch(format!("the trunk pack has no {what} unit"));
        let unit_of_layer = (0..cfg.n_layers)
            .map(|l| unit_idx(PackUnit::Layer(l)).ok_or_else(|| missing("layer")))
            .collect::<Result<Vec<_>, _>>()?;
        let head_unit = unit_idx(PackUnit::Head).ok_or_else(|| missing("head"))?;
        let embed_unit = unit_idx(PackUnit::Embed).ok_or_else(|| missing("embed"))?;
        let embed_tensor = manifest.units.iter().find(|u| u.unit == "embed").and_then(|u| u.tensors.first());
        let embed = Loc {
            unit: embed_unit,
            offset: embed_tensor.map_or(0, |t| t.offset as usize),
            len: embed_tensor.map_or(0, |t| t.len as usize),
        };
        let mut streamed_order: Vec<usize> =
            unit_of_layer.iter().copied().filter(|&u| units[u].pinned.is_none()).collect();
        if units[head_unit].pinned.is_none() {
            streamed_order.push(head_unit);
        }
        let lock_state = match arena.lock_state() {
            super::io::LockState::Locked => "mlocked".to_owned(),
            super::io::LockState::NotRequested => "not locked (--no-mlock)".to_owned(),
            super::io::LockState::Failed(e) => format!("not locked: {e}"),
        };
        let stats = StreamStats {
            backend: opts.io.name().to_owned(),
            backend_info: io.backend_info.clone(),
            buffers: format!(
                "{} arena, 2 MiB aligned, {}, NUMA node {}",
                super::io::fmt_bytes(arena.len() as u64),
                lock_state,
                arena.node().map_or_else(|| "unbound".to_owned(), |n| n.to_string())
            ),
            trunk_pinned_units: plan.pinned_units.len(),
            trunk_streamed_units: streamed_order.len(),
            ..StreamStats::default()
        };
        let state = State {
            ring: layout.ring.iter().map(|&region| RingSlot { region, unit: None, ticket: None, users: 0 }).collect(),
            verified: vec![false; units.len()],
            experts: layout
                .experts
                .iter()
                .map(|&region| ExpertSlot {
                    region,
                    key: None,
                    ticket: None,
                    users: 0,
                    parts: [(0, 0); 6],
                    speculative: false,
                    bytes: 0,
                })
                .collect(),
            resident: HashMap::new(),
            policy: policy::policy_by_name(&opts.policy, plan.expert_slots)
                .ok_or_else(|| StreamError::Mismatch(format!("unknown cache policy {:?}", opts.policy)))?,
            last_routed: Vec::new(),
            pending: VecDeque::new(),
            protected: HashSet::new(),
            stats,
        };
        let src = StreamingSource {
            pack_file: files.len() - 1,
            index,
            pack_path,
            units,
            streamed_order,
            unit_of_layer,
            head_unit,
            embed,
            embed_region: layout.embed,
            tensor_loc,
            fixed_buffers: opts.io == IoKind::Uring,
            arena,
            align,
            readahead: opts.readahead,
            verify_every_read: opts.verify_every_read,
            serial: opts.serial,
            spec_prev_token: opts.spec_prev_token,
            spec_idle_bytes: opts.queue_depth.max(1) as usize * opts.chunk_bytes.max(1),
            state: Mutex::new(state),
            io,
            tracer,
        };
        src.load_pinned()?;
        Ok(src)
    }

    /// Batches the I/O service still tracks (bounded by the slots, whatever the run length).
    pub fn tickets_held(&self) -> usize {
        self.io.tickets_held()
    }

    /// Replaces the expert cache policy.
    pub fn set_policy(&self, policy: Box<dyn CachePolicy>) {
        lock(&self.state).policy = policy;
    }

    /// Counters so far.
    pub fn stats(&self) -> StreamStats {
        let mut s = lock(&self.state).stats.clone();
        let io = self.io.stats();
        s.read_busy_seconds = io.busy_ns as f64 / 1e9;
        s.read_bytes_per_second = if io.busy_ns > 0 { io.bytes_read as f64 / s.read_busy_seconds } else { 0.0 };
        s.io = io.into();
        s
    }

    fn load_pinned(&self) -> Result<(), StreamError> {
        let mut ops = Vec::new();
        for u in &self.units {
            if let Some(r) = u.pinned {
                ops.push(self.unit_op(u, r));
            }
        }
        let bytes: u64 = self.units.iter().filter(|u| u.pinned.is_some()).map(|u| u.len).sum();
        let ticket = self.io.submit(Priority::Demand, ops);
        self.wait_io(ticket, None).map_err(StreamError::PinnedRead)?;
        for (i, u) in self.units.iter().enumerate() {
            if let Some(r) = u.pinned {
                self.verify(i, r).map_err(StreamError::Pack)?;
            }
        }
        let mut st = lock(&self.state);
        st.stats.trunk_bytes_read += bytes;
        for (i, u) in self.units.iter().enumerate() {
            st.verified[i] = u.pinned.is_some();
        }
        Ok(())
    }

    /// The arena bytes of a region.
    ///
    /// Callers only pass regions that no read is writing: pinned units after loading, ring and
    /// expert slots that are Filled and held by a guard, the embedding buffer after its read.
    fn bytes(&self, r: Region) -> &[u8] {
        assert!(r.off + r.len <= self.arena.len(), "region outside the arena");
        // SAFETY: the region lies inside the arena (asserted), which lives as long as `self`;
        // per the slot state machine no read targets it while this borrow exists (see above),
        // so no write races this shared view.
        unsafe { std::slice::from_raw_parts(self.arena.as_ptr().add(r.off), r.len) }
    }

    /// Waits for a batch, recording the stall as a scheduler "wait" span when it blocks.
    fn wait_io(&self, t: Ticket, layer: Option<usize>) -> Result<(), Arc<IoError>> {
        if self.io.is_done(t) {
            return self.io.wait(t);
        }
        let mut args = crate::trace::SpanArgs::new();
        args.layer = layer.map(|l| l as u32);
        let start = self.tracer.now_us();
        let stall = self.tracer.span_args(Stage::Scheduler, "wait", args);
        let r = self.io.wait(t);
        drop(stall);
        if let Some(l) = layer {
            lock(&self.state).stats.layer(l).stall_us += self.tracer.now_us() - start;
        }
        r
    }

    /// Where an expert's first tensor sits (shard, offset): reads issued in this order sweep
    /// the disk forwards. Unknown experts sort last (their read then fails with a named error).
    fn disk_position(&self, key: ExpertKey) -> (usize, u64) {
        self.index.experts.get(key.0, key.1).map_or((usize::MAX, 0), |r| {
            let t = &self.index.tensors[r.parts[0]];
            (t.shard, t.offset)
        })
    }

    fn layer_of_unit(&self, unit: usize) -> Option<usize> {
        match self.units[unit].unit {
            PackUnit::Layer(l) => Some(l),
            _ => None,
        }
    }

    /// The tracer the store records reads and stalls in.
    pub fn tracer(&self) -> &Arc<Tracer> {
        &self.tracer
    }

    fn ptr(&self, off: usize) -> *mut u8 {
        assert!(off <= self.arena.len(), "offset outside the arena");
        // SAFETY: in bounds of the arena allocation (asserted).
        unsafe { self.arena.as_mut_ptr().add(off) }
    }

    fn buf_index(&self, off: usize, len: usize) -> Option<u16> {
        const PIECE: usize = super::io::ring::FIXED_BUF_BYTES_MAX;
        (self.fixed_buffers && off / PIECE == (off + len - 1) / PIECE).then_some((off / PIECE) as u16)
    }

    #[allow(clippy::too_many_arguments)]
    fn op(&self, file: usize, offset: u64, len: usize, min_len: usize, dst_off: usize, meta: OpMeta) -> SendOp {
        let mut op = ReadOp::new(file, offset, len, self.ptr(dst_off), 0);
        op.min_len = min_len;
        op.buf_index = self.buf_index(dst_off, len);
        SendOp { op, meta }
    }

    fn unit_op(&self, u: &UnitPlace, r: Region) -> SendOp {
        let layer = match u.unit {
            PackUnit::Layer(l) => Some(l as u32),
            _ => None,
        };
        let meta = OpMeta { name: "trunk read", kind: "demand", layer, expert: None };
        self.op(self.pack_file, u.file_offset, u.len as usize, u.len as usize, r.off, meta)
    }

    fn verify(&self, unit: usize, r: Region) -> Result<(), PackError> {
        let u = &self.units[unit];
        let got = super::pack::checksum(self.bytes(Region { off: r.off, len: u.len as usize }));
        if got != u.checksum {
            return Err(PackError::Checksum {
                path: self.pack_path.clone(),
                unit: u.unit.name(),
                want: u.checksum.clone(),
                got,
            });
        }
        Ok(())
    }

    fn read_error(&self, what: String, e: &Arc<IoError>) -> SourceError {
        SourceError::Read {
            what,
            exit_code: e.exit_code(),
            source: Arc::clone(e) as Arc<dyn std::error::Error + Send + Sync>,
        }
    }

    /// Makes a streamed unit resident in the ring, issuing read-ahead for the units after it.
    fn acquire_unit(&self, unit: usize) -> Result<StreamTrunk<'_>, SourceError> {
        let (slot, ticket) = {
            let mut st = lock(&self.state);
            let window = self.window(unit);
            let slot = match st.ring.iter().position(|s| s.unit == Some(unit)) {
                Some(s) => s,
                None => self.start_unit_read(&mut st, unit, &window, Priority::Demand)?,
            };
            st.ring[slot].users += 1;
            let ticket = st.ring[slot].ticket;
            for &next in window.iter().skip(1) {
                if !st.ring.iter().any(|s| s.unit == Some(next))
                    && self.start_unit_read(&mut st, next, &window, Priority::Prefetch).is_err()
                {
                    break;
                }
            }
            (slot, ticket)
        };
        let release = |this: &Self| {
            let mut st = lock(&this.state);
            st.ring[slot].users -= 1;
            st.ring[slot].unit = None;
        };
        if let Some(t) = ticket {
            if let Err(e) = self.wait_io(t, self.layer_of_unit(unit)) {
                release(self);
                return Err(self.read_error(format!("trunk unit {} of the pack", self.units[unit].unit.name()), &e));
            }
        }
        let region = {
            let mut st = lock(&self.state);
            st.ring[slot].ticket = None;
            (st.ring[slot].region, self.verify_every_read || !st.verified[unit])
        };
        if region.1 {
            if let Err(e) = self.verify(unit, region.0) {
                release(self);
                return Err(SourceError::Corrupt {
                    what: format!("trunk unit {}", self.units[unit].unit.name()),
                    message: e.to_string(),
                });
            }
            lock(&self.state).verified[unit] = true;
        }
        Ok(StreamTrunk { src: self, unit, base: region.0, slot: Some(slot) })
    }

    /// `unit` and the `readahead` streamed units after it, in use order (wrapping to the next
    /// token).
    fn window(&self, unit: usize) -> Vec<usize> {
        let n = self.streamed_order.len();
        let Some(pos) = self.streamed_order.iter().position(|&u| u == unit) else { return vec![unit] };
        (0..=self.readahead.min(n.saturating_sub(1))).map(|i| self.streamed_order[(pos + i) % n]).collect()
    }

    /// Picks a ring slot no guard holds and no unit of `window` occupies, and starts reading.
    fn start_unit_read(
        &self,
        st: &mut State,
        unit: usize,
        window: &[usize],
        prio: Priority,
    ) -> Result<usize, SourceError> {
        let slot = st
            .ring
            .iter()
            .position(|s| s.users == 0 && s.ticket.is_none() && s.unit.is_none_or(|u| !window.contains(&u)))
            .or_else(|| st.ring.iter().position(|s| s.users == 0 && s.unit.is_none_or(|u| !window.contains(&u))))
            .ok_or_else(|| {
                SourceError::Internal("no free trunk slot: the ring is smaller than the read-ahead window".to_owned())
            })?;
        if st.ring[slot].ticket.is_some() {
            // An unwanted read-ahead is still in flight into this slot: let it land first.
            let t = st.ring[slot].ticket.take();
            if let Some(t) = t {
                let _ = self.wait_io(t, None);
            }
        }
        let u = &self.units[unit];
        let ticket = self.io.submit(prio, vec![self.unit_op(u, st.ring[slot].region)]);
        st.ring[slot].unit = Some(unit);
        st.ring[slot].ticket = Some(ticket);
        st.stats.trunk_bytes_read += u.len;
        st.stats.trunk_reads += 1;
        Ok(slot)
    }

    /// Read ops for one expert into a slot; returns the ops and the parts' places in the slot.
    fn expert_ops(
        &self,
        key: ExpertKey,
        region: Region,
        kind: &'static str,
    ) -> Result<(Vec<SendOp>, PartPlaces), SourceError> {
        let meta = OpMeta { name: "expert read", kind, layer: Some(key.0 as u32), expert: Some(key.1 as u32) };
        let r = self.index.experts.get(key.0, key.1).ok_or_else(|| SourceError::Corrupt {
            what: format!("layer {} expert {}", key.0, key.1),
            message: "not in the checkpoint".to_owned(),
        })?;
        let a = self.align;
        let mut parts = [(0usize, 0usize); 6];
        let mut ops = Vec::with_capacity(6);
        if let Some((shard, start, end)) = r.contiguous {
            let ws = start / a * a;
            let we = align_up(end, a);
            for (k, &id) in r.parts.iter().enumerate() {
                let t = &self.index.tensors[id];
                parts[k] = ((t.offset - ws) as usize, t.len as usize);
            }
            ops.push(self.op(shard, ws, (we - ws) as usize, (end - ws) as usize, region.off, meta));
        } else {
            let mut cursor = 0usize;
            for (k, &id) in r.parts.iter().enumerate() {
                let t = &self.index.tensors[id];
                let ws = t.offset / a * a;
                let we = align_up(t.offset + t.len, a);
                parts[k] = (cursor + (t.offset - ws) as usize, t.len as usize);
                ops.push(self.op(
                    t.shard,
                    ws,
                    (we - ws) as usize,
                    (t.offset + t.len - ws) as usize,
                    region.off + cursor,
                    meta,
                ));
                cursor += (we - ws) as usize;
            }
        }
        let used = ops.iter().map(|o| o.op.len).sum::<usize>();
        if used > region.len {
            return Err(SourceError::Internal(format!(
                "expert ({}, {}) needs {used} bytes, slot holds {}",
                key.0, key.1, region.len
            )));
        }
        Ok((ops, parts))
    }

    /// Starts reads for as many pending experts as there are evictable slots, in one batch.
    /// Only a demand read (`take_protected`) may evict an expert the layer has yet to use.
    fn issue_pending(&self, st: &mut State, prio: Priority, take_protected: bool) -> Result<Vec<Ticket>, SourceError> {
        if st.pending.is_empty() {
            return Ok(Vec::new());
        }
        let mut groups: Vec<(Ticket, Vec<SendOp>)> = Vec::new();
        let mut slots = Vec::new();
        // Each expert gets its own ticket, reserved as its slot is chosen, so a slot taken for
        // one expert of this batch never looks evictable to the next, and each expert can be
        // computed as soon as its own bytes arrive. All go out as one submission, and whatever
        // happens below every reserved ticket is submitted, so nobody waits on one forever.
        let mut failure = None;
        while let Some(&key) = st.pending.front() {
            if st.resident.contains_key(&key) {
                st.pending.pop_front();
                continue;
            }
            let Some(slot) = self.victim(st, take_protected && slots.is_empty()) else { break };
            st.pending.pop_front();
            let kind = if prio == Priority::Speculative { "speculative" } else { "demand" };
            let (o, parts) = match self.expert_ops(key, st.experts[slot].region, kind) {
                Ok(built) => built,
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            };
            let bytes = self
                .index
                .experts
                .get(key.0, key.1)
                .map_or(0, |r| r.parts.iter().map(|&id| self.index.tensors[id].len).sum::<u64>());
            let ticket = self.io.reserve();
            if let Some(old) = st.experts[slot].ticket.replace(ticket) {
                self.io.forget(old);
            }
            st.stats.expert_window_bytes_read += o.iter().map(|op| op.op.len as u64).sum::<u64>();
            groups.push((ticket, o));
            let s = &mut st.experts[slot];
            s.key = Some(key);
            s.parts = parts;
            s.speculative = prio == Priority::Speculative;
            s.bytes = bytes;
            let replaced = st.resident.insert(key, slot);
            assert!(replaced.is_none(), "expert {key:?} read into two slots");
            st.policy.on_insert(key);
            st.stats.expert_reads += 1;
            st.stats.expert_bytes_read += bytes;
            if prio == Priority::Speculative {
                st.stats.spec_reads += 1;
                st.stats.spec_bytes += bytes;
            }
            let ls = st.stats.layer(key.0);
            ls.expert_reads += 1;
            ls.expert_bytes_read += bytes;
            slots.push(slot);
        }
        debug_check_pool(st);
        if !slots.is_empty() {
            self.tracer.counter("expert pool occupancy", st.resident.len() as f64);
        }
        let tickets: Vec<Ticket> = groups.iter().map(|g| g.0).collect();
        self.io.submit_groups(prio, groups);
        match failure {
            Some(e) => Err(e),
            None => Ok(tickets),
        }
    }

    /// A slot for a new expert: a free one, else the policy's choice among evictable ones
    /// (idle, read complete), sparing experts the current layer has yet to use unless nothing
    /// else is left (they are then read again when used: slower, never wrong).
    fn victim(&self, st: &mut State, take_protected: bool) -> Option<usize> {
        if let Some(free) = st.experts.iter().position(|s| s.key.is_none()) {
            return Some(free);
        }
        let idle: Vec<ExpertKey> = st
            .experts
            .iter()
            .filter(|s| s.users == 0 && s.ticket.is_none_or(|t| self.io.is_done(t)))
            .filter_map(|s| s.key)
            .collect();
        let spare: Vec<ExpertKey> = idle.iter().copied().filter(|k| !st.protected.contains(k)).collect();
        let candidates = if spare.is_empty() && take_protected { idle } else { spare };
        let key = st.policy.victim(&candidates)?;
        debug_check_pool(st);
        let slot = st.resident.remove(&key)?;
        assert_eq!(st.experts[slot].key, Some(key), "the resident map and the slots disagree");
        st.policy.on_evict(key);
        st.experts[slot].key = None;
        if let Some(old) = st.experts[slot].ticket.take() {
            self.io.forget(old);
        }
        st.stats.expert_evictions += 1;
        if st.experts[slot].speculative {
            st.stats.spec_wasted_bytes += st.experts[slot].bytes;
        }
        Some(slot)
    }
}

impl StreamingSource {
    /// Ensures `key` has a slot (its read may still be in flight). When every slot is busy,
    /// waits for a read to land, then evicts; bounded by the pool size.
    fn make_resident(&self, key: ExpertKey) -> Result<MutexGuard<'_, State>, SourceError> {
        let mut st = lock(&self.state);
        for _ in 0..=2 * st.experts.len() + 1 {
            if st.resident.contains_key(&key) {
                return Ok(st);
            }
            // Not announced, or no slot was free when it was: read it now.
            st.pending.retain(|k| *k != key);
            st.pending.push_front(key);
            self.issue_pending(&mut st, Priority::Demand, true)?;
            if st.resident.contains_key(&key) {
                return Ok(st);
            }
            // Every slot is held or still being read: wait for a read to land. If none is in
            // flight any more, one landed since the victim search: search again.
            let busy =
                st.experts.iter().filter(|s| s.users == 0).find_map(|s| s.ticket.filter(|&t| !self.io.is_done(t)));
            if let Some(ticket) = busy {
                drop(st);
                // A failed read frees nothing; say why instead of searching on.
                self.wait_io(ticket, Some(key.0))
                    .map_err(|e| self.read_error(format!("layer {} expert {}", key.0, key.1), &e))?;
                st = lock(&self.state);
            }
        }
        let in_use = st.experts.iter().filter(|s| s.users > 0).count();
        let reading = st.experts.iter().filter(|s| s.ticket.is_some_and(|t| !self.io.is_done(t))).count();
        Err(SourceError::Internal(format!(
            "no evictable slot for layer {} expert {} among {} (in use {in_use}, reading {reading}, protected {}, pending {})",
            key.0,
            key.1,
            st.experts.len(),
            st.protected.len(),
            st.pending.len()
        )))
    }
}

/// Validates the device alignment over all files (the simulator enforces its own).
fn read_alignment(files: &[PathBuf], opts: &StreamOptions) -> Result<u64, StreamError> {
    if opts.io == IoKind::Sim {
        return Ok(opts.sim.as_ref().map_or(4096, |s| u64::from(s.align)).max(512));
    }
    let (_files, align) = open_direct(files, 0)?;
    Ok(u64::from(align.strictest()).max(512))
}

fn place_units(
    manifest: &Manifest,
    index: &CheckpointIndex,
) -> Result<(Vec<UnitPlace>, Vec<Option<Loc>>), StreamError> {
    let mut units = Vec::with_capacity(manifest.units.len());
    let mut tensor_loc = vec![None; index.tensors.len()];
    for (i, u) in manifest.units.iter().enumerate() {
        let unit = PackUnit::parse(&u.unit).ok_or_else(|| StreamError::Mismatch(format!("unknown unit {}", u.unit)))?;
        for t in &u.tensors {
            let id = index.position(&t.name).ok_or_else(|| {
                StreamError::Mismatch(format!(
                    "the trunk pack holds {} which the checkpoint lacks: run `k3ring pack` again",
                    t.name
                ))
            })?;
            if index.tensors[id].len != t.len {
                return Err(StreamError::Mismatch(format!(
                    "{}: the pack and the checkpoint disagree on its size",
                    t.name
                )));
            }
            tensor_loc[id] = Some(Loc { unit: i, offset: t.offset as usize, len: t.len as usize });
        }
        units.push(UnitPlace {
            row_checksums: u.row_checksums.clone(),
            unit,
            file_offset: u.offset,
            len: u.len,
            checksum: u.checksum.clone(),
            pinned: None,
        });
    }
    Ok((units, tensor_loc))
}

/// Where each part of the arena goes.
struct Layout {
    ring: Vec<Region>,
    experts: Vec<Region>,
    embed: Region,
    total: usize,
}

impl Layout {
    /// Assigns arena regions: pinned units (recorded in `units`), ring slots, expert slots, the
    /// embedding row buffer.
    fn new(
        units: &mut [UnitPlace],
        cfg: &Config,
        plan: &Plan,
        opts: &StreamOptions,
        align: u64,
    ) -> Result<Layout, StreamError> {
        let mut off = 0u64;
        let mut take = |len: u64| {
            let r = Region { off: off as usize, len: len as usize };
            off += align_up(len.max(1), align);
            r
        };
        for want in &plan.pinned_units {
            let u = units
                .iter_mut()
                .find(|u| u.unit == *want)
                .ok_or_else(|| StreamError::Mismatch(format!("the plan pins {} which the pack lacks", want.name())))?;
            u.pinned = Some(take(u.len));
        }
        let streamed_max =
            units.iter().filter(|u| u.pinned.is_none() && u.unit != PackUnit::Embed).map(|u| u.len).max().unwrap_or(0);
        if plan.ring_slots > 0 && streamed_max > plan.ring_slot_bytes || plan.ring_slots == 0 && streamed_max > 0 {
            return Err(StreamError::Mismatch(format!(
                "the plan's trunk slots ({} of {} bytes) cannot hold a streamed unit of {streamed_max} bytes",
                plan.ring_slots, plan.ring_slot_bytes
            )));
        }
        let ring = (0..plan.ring_slots).map(|_| take(plan.ring_slot_bytes)).collect();
        let slot = expert_slot_bytes(cfg, align);
        if slot > plan.expert_slot_bytes {
            return Err(StreamError::Mismatch(format!(
                "expert slots of {} bytes planned, {slot} needed",
                plan.expert_slot_bytes
            )));
        }
        let experts = (0..plan.expert_slots).map(|_| take(slot)).collect();
        let embed = take(embed_buffer_bytes(cfg, opts.chunk_tokens.max(1), align));
        Ok(Layout { ring, experts, embed, total: off as usize })
    }
}

fn start_io(
    files: &[PathBuf],
    opts: &StreamOptions,
    arena: &Arc<AlignedBuf>,
    align: u64,
    tracer: Arc<Tracer>,
) -> Result<IoService, StreamError> {
    let files = files.to_vec();
    let ops_max = 256usize;
    let qd = opts.queue_depth.max(1);
    let chunk = (opts.chunk_bytes as u64).max(align) / align * align;
    let inject = opts.inject;
    let kind = opts.io;
    let sim = opts.sim.clone();
    let threads = opts.pread_threads.max(1);
    let keep = Arc::clone(arena);
    let arena = Arc::clone(arena);
    let factory: service::BackendFactory = Box::new(move || -> Result<Box<dyn ReadBackend>, IoError> {
        Ok(match kind {
            IoKind::Uring => Box::new(UringReader::new(
                &files,
                RingOptions {
                    queue_depth: qd,
                    chunk_bytes: chunk as usize,
                    ops_max,
                    register_files: true,
                    register_buffers: vec![arena],
                    align_min: align as u32,
                    inject,
                },
            )?),
            IoKind::Pread => Box::new(PreadReader::new(
                &files,
                PreadOptions {
                    threads,
                    queue_depth: qd,
                    chunk_bytes: chunk as usize,
                    ops_max,
                    align_min: align as u32,
                    inject,
                },
            )?),
            IoKind::Mmap => Box::new(MappedReader::new(&files, ops_max)?),
            IoKind::Sim => {
                let opts = sim.unwrap_or_else(|| super::io::sim::SimOptions::fault_free(0));
                Box::new(super::io::sim::SimReader::new(&files, opts)?)
            }
        })
    });
    Ok(IoService::start(factory, ops_max, qd as usize * chunk as usize, opts.io_core, tracer, vec![keep])?)
}

/// A trunk unit made resident: pinned (no slot) or held in a ring slot until dropped.
pub struct StreamTrunk<'a> {
    src: &'a StreamingSource,
    unit: usize,
    base: Region,
    slot: Option<usize>,
}

impl TrunkView for StreamTrunk<'_> {
    fn bytes(&self, id: TensorId) -> &[u8] {
        let loc = self.src.tensor_loc[id].unwrap_or(Loc { unit: usize::MAX, offset: 0, len: 0 });
        assert_eq!(loc.unit, self.unit, "tensor {id} read through the view of another unit");
        &self.src.bytes(self.base)[loc.offset..loc.offset + loc.len]
    }
}

impl Drop for StreamTrunk<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot {
            lock(&self.src.state).ring[slot].users -= 1;
        }
    }
}

/// One expert held in a pool slot until dropped.
pub struct StreamExpert<'a> {
    src: &'a StreamingSource,
    slot: usize,
    region: Region,
    parts: [(usize, usize); 6],
}

impl ExpertView for StreamExpert<'_> {
    fn parts(&self) -> ExpertBytes<'_> {
        let b = self.src.bytes(self.region);
        let p = |k: usize| &b[self.parts[k].0..self.parts[k].0 + self.parts[k].1];
        ExpertBytes::from_parts([p(0), p(1), p(2), p(3), p(4), p(5)])
    }
}

impl Drop for StreamExpert<'_> {
    fn drop(&mut self) {
        let mut st = lock(&self.src.state);
        st.experts[self.slot].users -= 1;
        // The slot may now be evictable: start reads still waiting for one.
        let _ = self.src.issue_pending(&mut st, Priority::Demand, false);
    }
}

/// The pool's invariant: the resident map and the slots' keys describe the same set.
fn debug_check_pool(st: &State) {
    if cfg!(debug_assertions) || std::env::var_os("K3_CHECK_POOL").is_some() {
        let keyed = st.experts.iter().filter(|s| s.key.is_some()).count();
        assert_eq!(keyed, st.resident.len(), "keyed slots vs resident map");
        for (k, &slot) in &st.resident {
            assert_eq!(st.experts[slot].key, Some(*k), "resident map points at a slot holding another key");
        }
    }
}

impl StreamingSource {
    fn resident_unit(&self, unit: usize) -> Option<StreamTrunk<'_>> {
        if let Some(region) = self.units[unit].pinned {
            return Some(StreamTrunk { src: self, unit, base: region, slot: None });
        }
        let mut st = lock(&self.state);
        let slot = st.ring.iter().position(|s| s.unit == Some(unit) && s.ticket.is_none_or(|t| self.io.is_done(t)))?;
        st.ring[slot].users += 1;
        Some(StreamTrunk { src: self, unit, base: st.ring[slot].region, slot: Some(slot) })
    }
}

impl WeightSource for StreamingSource {
    type Trunk<'a> = StreamTrunk<'a>;
    type Expert<'a> = StreamExpert<'a>;

    fn trunk(&self, unit: TrunkUnit) -> Result<StreamTrunk<'_>, SourceError> {
        let u = match unit {
            TrunkUnit::Head => self.head_unit,
            TrunkUnit::Layer(l) => {
                *self.unit_of_layer.get(l).ok_or_else(|| SourceError::Internal(format!("no layer {l}")))?
            }
        };
        match self.units[u].pinned {
            Some(region) => Ok(StreamTrunk { src: self, unit: u, base: region, slot: None }),
            None => self.acquire_unit(u),
        }
    }

    fn trunk_if_resident(&self, unit: TrunkUnit) -> Option<StreamTrunk<'_>> {
        let u = match unit {
            TrunkUnit::Head => self.head_unit,
            TrunkUnit::Layer(l) => *self.unit_of_layer.get(l)?,
        };
        self.resident_unit(u)
    }

    fn prefetch_experts(&self, layer: usize, experts: &[usize]) {
        if self.serial {
            return;
        }
        // Speculation uses idle bandwidth only: with more than the device's window already
        // outstanding, a guess would delay reads compute is waiting for (and some guesses are
        // wrong).
        if self.io.outstanding_bytes() > self.spec_idle_bytes {
            lock(&self.state).stats.spec_skipped_busy += 1;
            return;
        }
        let mut st = lock(&self.state);
        let mut wanted: Vec<ExpertKey> =
            experts.iter().map(|&e| (layer, e)).filter(|k| !st.resident.contains_key(k)).collect();
        wanted.sort_unstable();
        wanted.dedup();
        wanted.sort_by_key(|k| self.disk_position(*k));
        // Use the demand queue's machinery with prefetch priority, keeping the layer's own
        // pending demand reads first.
        let saved = std::mem::take(&mut st.pending);
        st.pending.extend(wanted);
        let _ = self.issue_pending(&mut st, Priority::Speculative, false);
        st.pending = saved;
    }

    fn embed_rows(&self, table: &Mat, ids: &[u32], out: &mut [u8]) -> Result<(), SourceError> {
        let row = table.cols * 2;
        let a = self.align;
        let unit = &self.units[self.embed.unit];
        let window = align_up(row as u64 + 2 * a, a) as usize;
        if ids.len() * window > self.embed_region.len || self.embed.len < table.rows * row {
            return Err(SourceError::Internal("embedding buffer smaller than the chunk".to_owned()));
        }
        let mut ops = Vec::with_capacity(ids.len());
        let mut starts = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            let at = unit.file_offset + (self.embed.offset + id as usize * row) as u64;
            let ws = at / a * a;
            let we = align_up(at + row as u64, a);
            let meta = OpMeta { name: "embedding read", kind: "demand", layer: None, expert: None };
            ops.push(self.op(
                self.pack_file,
                ws,
                (we - ws) as usize,
                (we - ws) as usize,
                self.embed_region.off + i * window,
                meta,
            ));
            starts.push(i * window + (at - ws) as usize);
        }
        let ticket = self.io.submit(Priority::Demand, ops);
        self.wait_io(ticket, None).map_err(|e| self.read_error("embedding rows from the trunk pack".to_owned(), &e))?;
        let buf = self.bytes(self.embed_region);
        for ((dst, &s), &id) in out.chunks_exact_mut(row).zip(&starts).zip(ids) {
            let bytes = &buf[s..s + row];
            let want = unit.row_checksums.get(id as usize).copied();
            if want != Some(xxhash_rust::xxh3::xxh3_64(bytes)) {
                return Err(SourceError::Corrupt {
                    what: format!("embedding row {id} read from {}", self.pack_path.display()),
                    message:
                        "fails its checksum: the pack or the read is damaged; run `k3ring pack` again if it persists"
                            .to_owned(),
                });
            }
            dst.copy_from_slice(bytes);
        }
        lock(&self.state).stats.embed_bytes_read += (ids.len() * window) as u64;
        Ok(())
    }

    fn will_need_experts(&self, layer: usize, experts: &mut [usize]) {
        let mut st = lock(&self.state);
        st.protected.clear();
        st.pending.clear();
        let mut misses = Vec::new();
        for &mut e in experts.iter_mut() {
            let key = (layer, e);
            st.protected.insert(key);
            st.stats.routed_experts += 1;
            st.stats.layer(layer).routed_experts += 1;
            if st.resident.contains_key(&key) {
                st.stats.routed_recalled += 1;
                st.stats.layer(layer).routed_recalled += 1;
            }
            match st.resident.get(&key) {
                Some(&slot) if st.experts[slot].ticket.is_none_or(|t| self.io.is_done(t)) => {
                    st.stats.expert_hits += 1;
                    st.stats.layer(layer).expert_hits += 1;
                }
                Some(_) => {}
                None => {
                    st.stats.expert_misses += 1;
                    misses.push(key);
                }
            }
        }
        // One submission per layer, in disk order.
        misses.sort_by_key(|k| self.disk_position(*k));
        st.pending.extend(misses.iter().copied());
        let issued = self.issue_pending(&mut st, Priority::Demand, false);
        if st.last_routed.len() <= layer {
            st.last_routed.resize(layer + 1, Vec::new());
        }
        st.last_routed[layer].clear();
        st.last_routed[layer].extend(experts.iter().copied());
        let prev_next =
            if self.spec_prev_token && !self.serial { st.last_routed.get(layer + 1).cloned() } else { None };
        drop(st);
        if let Some(next) = prev_next.filter(|n| !n.is_empty()) {
            self.prefetch_experts(layer + 1, &next);
        }
        if self.serial {
            // Read everything the layer needs before computing any of it.
            for t in issued.unwrap_or_default() {
                let _ = self.wait_io(t, Some(layer));
            }
        }
        // Compute resident experts first, then the misses in the order they were issued.
        let rank = |e: &usize| misses.iter().position(|k| k.1 == *e).map_or(0, |p| p + 1);
        experts.sort_by_key(rank);
    }

    fn expert(&self, layer: usize, expert: usize) -> Result<StreamExpert<'_>, SourceError> {
        let key = (layer, expert);
        let (slot, ticket) = {
            let mut st = self.make_resident(key)?;
            let slot =
                *st.resident.get(&key).ok_or_else(|| SourceError::Internal(format!("expert {key:?} vanished")))?;
            st.protected.remove(&key);
            st.experts[slot].users += 1;
            if std::mem::replace(&mut st.experts[slot].speculative, false) {
                st.stats.spec_used += 1;
            }
            st.policy.on_access(key);
            (slot, st.experts[slot].ticket)
        };
        if let Some(t) = ticket {
            if let Err(e) = self.wait_io(t, Some(layer)) {
                let mut st = lock(&self.state);
                st.experts[slot].users -= 1;
                st.resident.remove(&key);
                st.experts[slot].key = None;
                return Err(self.read_error(format!("layer {layer} expert {expert}"), &e));
            }
        }
        let mut st = lock(&self.state);
        st.experts[slot].ticket = None;
        let s = &st.experts[slot];
        Ok(StreamExpert { src: self, slot, region: s.region, parts: s.parts })
    }
}
