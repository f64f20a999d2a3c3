//! Expert traces and the cache simulator: replays the routing decisions of a run through an
//! expert pool of a given size, under each [`CachePolicy`] and under Belady's offline optimum.
//!
//! Trace format (text, version 1): a header `# k3ring expert trace v1 layers=L experts=E
//! top_k=K [expert_bytes=B]` (B, the bytes of one expert, is optional: older traces lack it), then one line per routing decision, `token layer e1 e2 ... eK`, the experts in the
//! token's top-k order, ordered by token and by layer within a token. Later lines starting with
//! `#` are comments; blank lines are skipped. `layer` is the model's layer index (dense layers
//! have no lines).
//!
//! Simulation semantics follow the engine's pool (`Store::request_demand` and
//! `expert`): the experts of one (token, layer) arrive as a batch; each resident one is a hit,
//! each other one a miss. The misses are read in disk order (ascending expert id, the order the
//! checkpoint stores a layer's experts), each evicting the policy's victim when the pool is full,
//! and the experts of the batch are never victims; then every expert of the batch is used once,
//! hits first. A pool smaller than `top_k` could not hold one batch and is refused. The engine
//! batches a whole prefill chunk per layer, the trace has one batch per token: the simulator
//! replays per token, which is what decode does.
//!
//! Threads: any; nothing here is shared. Allocation: a trace is held in memory (4 bytes per
//! request, at most [`TRACE_REQUESTS_MAX`]); a simulation allocates its pool's bookkeeping once.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Write};
use std::path::{Path, PathBuf};

use rustc_hash::{FxHashMap, FxHashSet};
use serde::Serialize;

use super::policy::{CachePolicy, ExpertKey};
use crate::exit::{Classify, ExitCode};

/// Layers a trace may declare.
pub const TRACE_LAYERS_MAX: usize = 4096;
/// Experts per layer a trace may declare.
pub const TRACE_EXPERTS_MAX: usize = 1 << 16;
/// Experts per routing decision a trace may declare.
pub const TRACE_TOP_K_MAX: usize = 1024;
/// Requests (expert ids) a trace may hold: 1 GiB of ids, about 180 000 Kimi K3 tokens.
pub const TRACE_REQUESTS_MAX: usize = 1 << 28;
/// Records a [`TraceWriter`] holds back for reordering before it writes them regardless:
/// a 4096-token prefill chunk over 92 MoE layers is 376 832 records.
pub const WRITER_RECORDS_MAX: usize = 1 << 20;
/// Batches simulated between two progress reports.
const PROGRESS_BATCHES: usize = 1 << 12;
/// Marks "never used again" in Belady's next-use table.
const NEVER: u32 = u32::MAX;

const HEADER_PREFIX: &str = "# k3ring expert trace";
const FORMAT_VERSION: &str = "v1";

/// Why a trace could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened, read or written (exit 4).
    #[error("{op} expert trace {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A line of the file is not a valid trace line (exit 3).
    #[error("expert trace {} line {line}: {reason}", path.display())]
    Malformed { path: PathBuf, line: usize, reason: String },
    /// A trace shape or record given in code is invalid (exit 3).
    #[error("expert trace: {reason}")]
    Invalid { reason: String },
}

/// The documented exit code: 4 for I/O, 3 for invalid data.
impl Classify for TraceError {
    fn exit_code(&self) -> ExitCode {
        match self {
            TraceError::Io { .. } => ExitCode::Io,
            TraceError::Malformed { .. } | TraceError::Invalid { .. } => ExitCode::Data,
        }
    }
}

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("a pool of {capacity} experts cannot hold one routing decision of {top_k} experts: use a capacity of at least {top_k}")]
    CapacityBelowTopK { capacity: usize, top_k: usize },
    /// A policy named a victim that is not resident or is protected (a bug in the policy).
    #[error("policy {policy} chose {victim:?} at batch {batch}, which is {why}")]
    BadVictim { policy: &'static str, victim: Option<ExpertKey>, batch: usize, why: &'static str },
}

/// A capacity below top-k is a refused request (2); a bad victim is a bug in a policy (1).
impl Classify for SimError {
    fn exit_code(&self) -> ExitCode {
        match self {
            SimError::CapacityBelowTopK { .. } => ExitCode::Usage,
            SimError::BadVictim { .. } => ExitCode::Internal,
        }
    }
}

/// One routing decision of a trace.
#[derive(Clone, Copy, Debug)]
pub struct Batch<'a> {
    pub token: u64,
    pub layer: usize,
    /// The token's experts in top-k order, distinct.
    pub experts: &'a [u32],
}

/// A whole trace in memory.
#[derive(Clone, Debug)]
pub struct Trace {
    layers: usize,
    experts: usize,
    top_k: usize,
    /// Bytes of one expert, from the header's `expert_bytes=` (absent in older traces).
    expert_bytes: Option<u64>,
    /// (token, layer) of each batch, strictly increasing.
    batches: Vec<(u64, u32)>,
    /// `top_k` expert ids per batch. // [batches, top_k]
    expert_ids: Vec<u32>,
    tokens: usize,
}

impl Trace {
    /// An empty trace of the given shape.
    pub fn new(layers: usize, experts: usize, top_k: usize) -> Result<Trace, TraceError> {
        check_shape(layers, experts, top_k).map_err(|reason| TraceError::Invalid { reason })?;
        Ok(Trace { layers, experts, top_k, expert_bytes: None, batches: Vec::new(), expert_ids: Vec::new(), tokens: 0 })
    }

    /// Bytes of one expert of the model the trace was recorded on, when its header says.
    pub fn expert_bytes(&self) -> Option<u64> {
        self.expert_bytes
    }

    /// Appends one routing decision; (token, layer) must come after the last one.
    pub fn push(&mut self, token: u64, layer: usize, experts: &[usize]) -> Result<(), TraceError> {
        self.push_checked(token, layer, experts.iter().map(|&e| e as u64))
            .map_err(|reason| TraceError::Invalid { reason })
    }

    fn push_checked(&mut self, token: u64, layer: usize, experts: impl Iterator<Item = u64>) -> Result<(), String> {
        if let Some(&(t, l)) = self.batches.last() {
            if (token, layer) <= (t, l as usize) {
                return Err(format!(
                    "token {token} layer {layer} comes after token {t} layer {l}: lines must be ordered by token, then layer"
                ));
            }
        }
        if self.expert_ids.len() + self.top_k > TRACE_REQUESTS_MAX {
            return Err(format!("more than {TRACE_REQUESTS_MAX} requests: cut the trace into shorter runs"));
        }
        let start = self.expert_ids.len();
        let checked = check_record(self.layers, self.experts, self.top_k, layer, experts, &mut self.expert_ids);
        if let Err(reason) = checked {
            self.expert_ids.truncate(start);
            return Err(reason);
        }
        if self.batches.last().is_none_or(|&(t, _)| t != token) {
            self.tokens += 1;
        }
        self.batches.push((token, layer as u32));
        assert!(self.expert_ids.len() == self.batches.len() * self.top_k);
        Ok(())
    }

    /// Layers the header declares (the model's layer count; dense layers have no lines).
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// Experts per layer.
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Experts per routing decision.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// Routing decisions (lines).
    pub fn batch_count(&self) -> usize {
        self.batches.len()
    }

    pub fn batch(&self, index: usize) -> Batch<'_> {
        let (token, layer) = self.batches[index];
        let experts = &self.expert_ids[index * self.top_k..(index + 1) * self.top_k];
        Batch { token, layer: layer as usize, experts }
    }

    pub fn iter(&self) -> impl Iterator<Item = Batch<'_>> + '_ {
        (0..self.batches.len()).map(|i| self.batch(i))
    }

    /// Distinct token numbers.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Expert requests: one per expert per line.
    pub fn requests(&self) -> u64 {
        self.expert_ids.len() as u64
    }

    /// Distinct (layer, expert) pairs: the pool size at which only first uses miss.
    pub fn distinct_experts(&self) -> usize {
        let mut seen = FxHashSet::default();
        for b in self.iter() {
            seen.extend(b.experts.iter().map(|&e| (b.layer, e)));
        }
        seen.len()
    }
}

fn check_shape(layers: usize, experts: usize, top_k: usize) -> Result<(), String> {
    if !(1..=TRACE_LAYERS_MAX).contains(&layers) {
        return Err(format!("layers={layers} is outside 1..={TRACE_LAYERS_MAX}"));
    }
    if !(1..=TRACE_EXPERTS_MAX).contains(&experts) {
        return Err(format!("experts={experts} is outside 1..={TRACE_EXPERTS_MAX}"));
    }
    if !(1..=experts.min(TRACE_TOP_K_MAX)).contains(&top_k) {
        return Err(format!("top_k={top_k} is outside 1..={}", experts.min(TRACE_TOP_K_MAX)));
    }
    Ok(())
}

/// Checks one record against the shape and appends its experts to `out`.
fn check_record(
    layers: usize,
    experts: usize,
    top_k: usize,
    layer: usize,
    ids: impl Iterator<Item = u64>,
    out: &mut Vec<u32>,
) -> Result<(), String> {
    if layer >= layers {
        return Err(format!("layer {layer} is out of range (the header says layers={layers})"));
    }
    let start = out.len();
    for e in ids {
        if e >= experts as u64 {
            return Err(format!("expert {e} is out of range (the header says experts={experts})"));
        }
        if out.len() - start == top_k {
            return Err(format!("more than top_k={top_k} experts"));
        }
        if out[start..].contains(&(e as u32)) {
            return Err(format!("expert {e} appears twice in one routing decision"));
        }
        out.push(e as u32);
    }
    let n = out.len() - start;
    if n != top_k {
        return Err(format!("{n} experts where the header says top_k={top_k}"));
    }
    Ok(())
}

/// Reads a trace written by [`TraceWriter`] (or by hand, in the same format).
pub fn read_trace(path: &Path) -> Result<Trace, TraceError> {
    let file = File::open(path).map_err(|source| TraceError::Io { op: "opening", path: path.to_owned(), source })?;
    read_trace_from(BufReader::new(file), path)
}

/// Reads a trace from `reader` (a byte slice parses a trace held in memory); `path` only names
/// the source in errors.
pub fn read_trace_from(mut reader: impl BufRead, path: &Path) -> Result<Trace, TraceError> {
    let io = |op: &'static str| move |source| TraceError::Io { op, path: path.to_owned(), source };
    let malformed = |line: usize, reason: String| TraceError::Malformed { path: path.to_owned(), line, reason };
    let mut buf = Vec::new();
    let mut line_number = 0;
    let mut trace: Option<Trace> = None;
    // Bounded by the file: one iteration per line.
    loop {
        buf.clear();
        if reader.read_until(b'\n', &mut buf).map_err(io("reading"))? == 0 {
            break;
        }
        line_number += 1;
        let text =
            std::str::from_utf8(&buf).map_err(|_| malformed(line_number, "the line is not UTF-8 text".to_owned()))?;
        let text = text.trim();
        let Some(trace) = trace.as_mut() else {
            trace = Some(parse_header(text).map_err(|reason| malformed(line_number, reason))?);
            continue;
        };
        if text.is_empty() || text.starts_with('#') {
            continue;
        }
        parse_line(trace, text).map_err(|reason| malformed(line_number, reason))?;
    }
    trace.ok_or_else(|| {
        malformed(
            1,
            format!(
                "the file is empty; expected the header `{HEADER_PREFIX} {FORMAT_VERSION} layers=L experts=E top_k=K`"
            ),
        )
    })
}

fn parse_header(text: &str) -> Result<Trace, String> {
    let expected = format!("expected the header `{HEADER_PREFIX} {FORMAT_VERSION} layers=L experts=E top_k=K`");
    let Some(rest) = text.strip_prefix(HEADER_PREFIX) else {
        return Err(format!("{expected}, found {:?}", clip(text)));
    };
    let fields: Vec<&str> = rest.split_ascii_whitespace().collect();
    if fields.first() != Some(&FORMAT_VERSION) {
        return Err(format!(
            "unsupported trace version {:?}; this k3ring reads {FORMAT_VERSION}",
            fields.first().unwrap_or(&"")
        ));
    }
    let value = |i: usize, name: &str| -> Result<usize, String> {
        fields
            .get(i)
            .and_then(|f| f.strip_prefix(name))
            .and_then(|f| f.strip_prefix('='))
            .and_then(|v| v.parse::<usize>().ok())
            .ok_or_else(|| format!("{expected}: field {i} should be {name}=<number>"))
    };
    let (layers, experts, top_k) = (value(1, "layers")?, value(2, "experts")?, value(3, "top_k")?);
    let expert_bytes = if fields.len() >= 5 { Some(value(4, "expert_bytes")? as u64) } else { None };
    if fields.len() > 5 {
        return Err(format!("{expected}: {} extra fields", fields.len() - 5));
    }
    let mut trace = Trace::new(layers, experts, top_k).map_err(|e| match e {
        TraceError::Invalid { reason } => reason,
        other => other.to_string(),
    })?;
    trace.expert_bytes = expert_bytes;
    Ok(trace)
}

fn parse_line(trace: &mut Trace, text: &str) -> Result<(), String> {
    let mut fields = text.split_ascii_whitespace();
    let number = |f: Option<&str>, what: &str| -> Result<u64, String> {
        let f = f.ok_or_else(|| {
            format!("expected `token layer` and {} experts, the line ends before the {what}", trace.top_k)
        })?;
        f.parse::<u64>().map_err(|_| format!("{what} {:?} is not a non-negative integer", clip(f)))
    };
    let token = number(fields.next(), "token")?;
    let layer = number(fields.next(), "layer")?;
    let layer = usize::try_from(layer).unwrap_or(usize::MAX);
    let mut bad = None;
    let ids = fields.map_while(|f| match f.parse::<u64>() {
        Ok(e) => Some(e),
        Err(_) => {
            bad = Some(format!("expert {:?} is not a non-negative integer", clip(f)));
            None
        }
    });
    let pushed = trace.push_checked(token, layer, ids);
    if let Some(reason) = bad {
        return Err(reason);
    }
    pushed
}

fn clip(s: &str) -> String {
    s.chars().take(40).collect()
}

/// Writes a trace as the engine routes. Records may arrive token-major (decode) or layer-major
/// within a forward pass (prefill: every token of the chunk at layer l, then at layer l+1); the
/// writer holds a pass back and writes it sorted by (token, layer). A pass ends when a record
/// names a token after every held one at a layer before the last held one. Call [`finish`] to
/// write the last pass: records still held when the writer is dropped are lost.
///
/// [`finish`]: TraceWriter::finish
pub struct TraceWriter {
    path: PathBuf,
    out: BufWriter<File>,
    layers: usize,
    experts: usize,
    top_k: usize,
    /// Held records: (token, layer, index of the first expert in `held_ids`).
    held: Vec<(u64, usize, usize)>,
    held_ids: Vec<u32>,
    held_token_max: u64,
    held_layer_max: usize,
    written_last: Option<(u64, usize)>,
    line: String,
}

impl TraceWriter {
    /// Creates (or truncates) `path` and writes the header (without the expert size).
    pub fn create(path: &Path, layers: usize, experts: usize, top_k: usize) -> Result<TraceWriter, TraceError> {
        TraceWriter::create_sized(path, layers, experts, top_k, None)
    }

    /// [`TraceWriter::create`], writing `expert_bytes=` in the header when given, so that
    /// `cache-sim` turns misses into bytes with the model's own expert size.
    pub fn create_sized(
        path: &Path,
        layers: usize,
        experts: usize,
        top_k: usize,
        expert_bytes: Option<u64>,
    ) -> Result<TraceWriter, TraceError> {
        check_shape(layers, experts, top_k).map_err(|reason| TraceError::Invalid { reason })?;
        let file =
            File::create(path).map_err(|source| TraceError::Io { op: "creating", path: path.to_owned(), source })?;
        let mut w = TraceWriter {
            path: path.to_owned(),
            out: BufWriter::new(file),
            layers,
            experts,
            top_k,
            held: Vec::new(),
            held_ids: Vec::new(),
            held_token_max: 0,
            held_layer_max: 0,
            written_last: None,
            line: String::new(),
        };
        let size = expert_bytes.map_or_else(String::new, |b| format!(" expert_bytes={b}"));
        let header =
            format!("{HEADER_PREFIX} {FORMAT_VERSION} layers={layers} experts={experts} top_k={top_k}{size}\n");
        w.write(header.as_bytes())?;
        Ok(w)
    }

    /// Records that `token` at `layer` routed to `experts` (top-k order).
    pub fn record(&mut self, token: u64, layer: usize, experts: &[usize]) -> Result<(), TraceError> {
        let start = self.held_ids.len();
        let ids = experts.iter().map(|&e| e as u64);
        if let Err(reason) = check_record(self.layers, self.experts, self.top_k, layer, ids, &mut self.held_ids) {
            self.held_ids.truncate(start);
            return Err(TraceError::Invalid { reason: format!("token {token} layer {layer}: {reason}") });
        }
        let pass_ended = !self.held.is_empty() && token > self.held_token_max && layer < self.held_layer_max;
        if pass_ended || self.held.len() >= WRITER_RECORDS_MAX {
            let ids: Vec<u32> = self.held_ids.drain(start..).collect();
            self.flush_held()?;
            self.held_ids.extend_from_slice(&ids);
        }
        let first = self.held_ids.len() - self.top_k;
        if self.held.is_empty() {
            (self.held_token_max, self.held_layer_max) = (token, layer);
        }
        self.held_token_max = self.held_token_max.max(token);
        self.held_layer_max = self.held_layer_max.max(layer);
        self.held.push((token, layer, first));
        assert!(self.held_ids.len() == self.held.len() * self.top_k);
        Ok(())
    }

    /// Writes the held records and flushes the file.
    pub fn finish(mut self) -> Result<(), TraceError> {
        self.flush_held()?;
        let path = self.path.clone();
        self.out.flush().map_err(|source| TraceError::Io { op: "writing", path, source })
    }

    fn flush_held(&mut self) -> Result<(), TraceError> {
        let mut held = std::mem::take(&mut self.held);
        held.sort_by_key(|&(t, l, _)| (t, l));
        for &(token, layer, first) in &held {
            if self.written_last.is_some_and(|last| (token, layer) <= last) {
                let (t, l) = self.written_last.unwrap_or_default();
                return Err(TraceError::Invalid {
                    reason: format!("token {token} layer {layer} recorded after token {t} layer {l} was written"),
                });
            }
            self.written_last = Some((token, layer));
            self.line.clear();
            use std::fmt::Write as _;
            let _ = write!(self.line, "{token} {layer}");
            for &e in &self.held_ids[first..first + self.top_k] {
                let _ = write!(self.line, " {e}");
            }
            self.line.push('\n');
            let line = std::mem::take(&mut self.line);
            self.write(line.as_bytes())?;
            self.line = line;
        }
        self.held_ids.clear();
        Ok(())
    }

    fn write(&mut self, bytes: &[u8]) -> Result<(), TraceError> {
        self.out.write_all(bytes).map_err(|source| TraceError::Io { op: "writing", path: self.path.clone(), source })
    }
}

/// What one simulation counted.
#[derive(Clone, Debug, Serialize)]
pub struct SimResult {
    pub policy: String,
    pub capacity: usize,
    pub tokens: usize,
    pub requests: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// hits / requests (0 for an empty trace).
    pub hit_rate: f64,
}

impl SimResult {
    fn new(policy: &str, capacity: usize, trace: &Trace, hits: u64, evictions: u64) -> SimResult {
        let requests = trace.requests();
        assert!(hits <= requests);
        SimResult {
            policy: policy.to_owned(),
            capacity,
            tokens: trace.tokens(),
            requests,
            hits,
            misses: requests - hits,
            evictions,
            hit_rate: if requests == 0 { 0.0 } else { hits as f64 / requests as f64 },
        }
    }

    /// Bytes read per token when one expert is `expert_bytes` bytes: every miss reads one expert.
    pub fn bytes_read_per_token(&self, expert_bytes: f64) -> f64 {
        if self.tokens == 0 {
            return 0.0;
        }
        self.misses as f64 * expert_bytes / self.tokens as f64
    }
}

fn check_capacity(trace: &Trace, capacity: usize) -> Result<(), SimError> {
    if capacity < trace.top_k {
        return Err(SimError::CapacityBelowTopK { capacity, top_k: trace.top_k });
    }
    Ok(())
}

/// Replays `trace` through a pool of `capacity` experts run by `policy` (fresh: it should not
/// have seen other keys).
pub fn simulate(trace: &Trace, capacity: usize, policy: &mut dyn CachePolicy) -> Result<SimResult, SimError> {
    simulate_with_progress(trace, capacity, policy, &|_| {})
}

/// [`simulate`], calling `progress(n)` after every few thousand batches with the batches done since the last call.
pub fn simulate_with_progress(
    trace: &Trace,
    capacity: usize,
    policy: &mut dyn CachePolicy,
    progress: &dyn Fn(usize),
) -> Result<SimResult, SimError> {
    check_capacity(trace, capacity)?;
    let name = policy.name();
    let mut resident: FxHashSet<ExpertKey> = FxHashSet::default();
    let (mut hits, mut misses) = (Vec::with_capacity(trace.top_k), Vec::with_capacity(trace.top_k));
    let (mut hit_count, mut evictions) = (0u64, 0u64);
    for (index, b) in trace.iter().enumerate() {
        hits.clear();
        misses.clear();
        for &e in b.experts {
            let key = (b.layer, e as usize);
            if resident.contains(&key) {
                hits.push(key);
            } else {
                misses.push(key);
            }
        }
        misses.sort_unstable();
        for &key in &misses {
            if resident.len() >= capacity {
                let protected = |k: ExpertKey| k.0 == b.layer && b.experts.contains(&(k.1 as u32));
                let victim = policy.victim_where(&mut resident.iter().copied(), &|k| !protected(k));
                let bad = |why| SimError::BadVictim { policy: name, victim, batch: index, why };
                let v = victim.ok_or_else(|| bad("none although evictable experts are resident"))?;
                if protected(v) {
                    return Err(bad("protected (its batch is being read)"));
                }
                if !resident.remove(&v) {
                    return Err(bad("not resident"));
                }
                policy.on_evict(v);
                evictions += 1;
            }
            resident.insert(key);
            policy.on_insert(key);
        }
        for &key in hits.iter().chain(&misses) {
            policy.on_access(key);
        }
        hit_count += hits.len() as u64;
        assert!(resident.len() <= capacity);
        if (index + 1) % PROGRESS_BATCHES == 0 {
            progress(PROGRESS_BATCHES);
        }
    }
    progress(trace.batch_count() % PROGRESS_BATCHES);
    Ok(SimResult::new(name, capacity, trace, hit_count, evictions))
}

/// For each request (in `expert_ids` order), the index of the next batch using the same expert.
fn next_uses(trace: &Trace) -> Vec<u32> {
    assert!(trace.batch_count() < NEVER as usize);
    let mut next = vec![NEVER; trace.expert_ids.len()];
    let mut seen: FxHashMap<ExpertKey, u32> = FxHashMap::default();
    for index in (0..trace.batch_count()).rev() {
        let b = trace.batch(index);
        for (j, &e) in b.experts.iter().enumerate() {
            let key = (b.layer, e as usize);
            next[index * trace.top_k + j] = seen.insert(key, index as u32).unwrap_or(NEVER);
        }
    }
    next
}

/// Belady's MIN, the offline optimum under the pool's rules: on a miss with a full pool, evicts
/// the resident expert (outside the batch) whose next use is furthest away, never-again first
/// (ties: the higher key). No online policy has more hits on the same trace and capacity.
pub fn belady(trace: &Trace, capacity: usize) -> Result<SimResult, SimError> {
    belady_with_progress(trace, capacity, &|_| {})
}

/// [`belady`] with progress reports, as [`simulate_with_progress`].
pub fn belady_with_progress(trace: &Trace, capacity: usize, progress: &dyn Fn(usize)) -> Result<SimResult, SimError> {
    check_capacity(trace, capacity)?;
    let next = next_uses(trace);
    let mut resident: FxHashMap<ExpertKey, u32> = FxHashMap::default();
    // Resident experts by next use; the victim is the last one outside the batch.
    let mut order: BTreeSet<(u32, ExpertKey)> = BTreeSet::new();
    let mut misses = Vec::with_capacity(trace.top_k);
    let (mut hit_count, mut evictions) = (0u64, 0u64);
    for (index, b) in trace.iter().enumerate() {
        misses.clear();
        for (j, &e) in b.experts.iter().enumerate() {
            let key = (b.layer, e as usize);
            let next_use = next[index * trace.top_k + j];
            if let Some(n) = resident.get_mut(&key) {
                assert!(*n == index as u32, "expert {key:?} is used at batch {index} but was due at {n}");
                order.remove(&(*n, key));
                *n = next_use;
                order.insert((next_use, key));
                hit_count += 1;
            } else {
                misses.push((key, next_use));
            }
        }
        for &(key, next_use) in &misses {
            if resident.len() >= capacity {
                let protected = |k: &ExpertKey| k.0 == b.layer && b.experts.contains(&(k.1 as u32));
                let victim = order.iter().rev().find(|(_, k)| !protected(k)).copied();
                let Some((n, v)) = victim else {
                    return Err(SimError::BadVictim { policy: "belady", victim: None, batch: index, why: "missing" });
                };
                order.remove(&(n, v));
                resident.remove(&v);
                evictions += 1;
            }
            resident.insert(key, next_use);
            order.insert((next_use, key));
        }
        assert!(resident.len() == order.len());
        assert!(resident.len() <= capacity);
        if (index + 1) % PROGRESS_BATCHES == 0 {
            progress(PROGRESS_BATCHES);
        }
    }
    progress(trace.batch_count() % PROGRESS_BATCHES);
    Ok(SimResult::new("belady", capacity, trace, hit_count, evictions))
}

/// Pool sizes worth simulating: `top_k`, doubling, up to the distinct experts of the trace
/// (included: from there on only first uses miss).
pub fn default_capacities(trace: &Trace) -> Vec<usize> {
    let top = trace.distinct_experts().max(trace.top_k);
    let mut out = Vec::new();
    let mut c = trace.top_k;
    while c < top {
        out.push(c);
        c *= 2;
    }
    out.push(top);
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::policy::{policy_by_name, POLICY_NAMES};
    use super::*;
    use crate::rng::SplitMix64;

    /// Tokens routing to `top_k` of `experts` per layer, expert e drawn with weight 1/(e+1)
    /// (skewed) or uniformly.
    fn synthetic(seed: u64, tokens: u64, layers: usize, experts: usize, top_k: usize, skewed: bool) -> Trace {
        let mut rng = SplitMix64::new(seed);
        let weights: Vec<f64> = (0..experts).map(|e| if skewed { 1.0 / (e + 1) as f64 } else { 1.0 }).collect();
        let total: f64 = weights.iter().sum();
        let mut t = Trace::new(layers, experts, top_k).unwrap();
        for token in 0..tokens {
            for layer in 0..layers {
                let mut picked = Vec::new();
                while picked.len() < top_k {
                    let mut x = rng.next_f64() * total;
                    let e = weights.iter().position(|w| {
                        x -= w;
                        x < 0.0
                    });
                    let e = e.unwrap_or(experts - 1);
                    if !picked.contains(&e) {
                        picked.push(e);
                    }
                }
                t.push(token, layer, &picked).unwrap();
            }
        }
        t
    }

    /// Hides `victim_where`, so the pool's default (list the candidates, call `victim`) runs.
    struct ListCandidates(Box<dyn CachePolicy>);

    impl CachePolicy for ListCandidates {
        fn name(&self) -> &'static str {
            self.0.name()
        }
        fn on_insert(&mut self, key: ExpertKey) {
            self.0.on_insert(key);
        }
        fn on_access(&mut self, key: ExpertKey) {
            self.0.on_access(key);
        }
        fn on_evict(&mut self, key: ExpertKey) {
            self.0.on_evict(key);
        }
        fn victim(&mut self, candidates: &[ExpertKey]) -> Option<ExpertKey> {
            self.0.victim(candidates)
        }
    }

    #[test]
    fn victim_where_and_victim_agree_for_every_policy() {
        let trace = synthetic(7, 60, 3, 32, 4, true);
        for name in POLICY_NAMES {
            for capacity in [4, 9, 30] {
                let fast = simulate(&trace, capacity, policy_by_name(name, capacity).unwrap().as_mut()).unwrap();
                let mut listed = ListCandidates(policy_by_name(name, capacity).unwrap());
                let slow = simulate(&trace, capacity, &mut listed).unwrap();
                assert_eq!((fast.hits, fast.evictions), (slow.hits, slow.evictions), "{name} at {capacity}");
            }
        }
    }

    #[test]
    fn belady_bounds_every_policy_and_grows_with_capacity() {
        for skewed in [true, false] {
            let trace = synthetic(11, 80, 4, 32, 4, skewed);
            let mut last = 0;
            for capacity in [4, 5, 8, 16, 33, 64, 128] {
                let best = belady(&trace, capacity).unwrap();
                assert!(best.hits >= last, "belady lost hits from capacity {capacity}");
                last = best.hits;
                for name in POLICY_NAMES {
                    let r = simulate(&trace, capacity, policy_by_name(name, capacity).unwrap().as_mut()).unwrap();
                    assert!(best.hits >= r.hits, "{name} beats belady at {capacity}: {} > {}", r.hits, best.hits);
                    assert_eq!(r.hits + r.misses, trace.requests());
                }
            }
        }
    }

    #[test]
    fn a_pool_of_every_expert_misses_only_first_uses() {
        let trace = synthetic(3, 50, 2, 16, 4, true);
        let distinct = trace.distinct_experts();
        for capacity in [distinct, distinct + 10] {
            let r = belady(&trace, capacity).unwrap();
            assert_eq!((r.misses, r.evictions), (distinct as u64, 0));
            for name in POLICY_NAMES {
                let r = simulate(&trace, capacity, policy_by_name(name, capacity).unwrap().as_mut()).unwrap();
                assert_eq!((r.misses, r.evictions), (distinct as u64, 0), "{name}");
            }
        }
    }

    #[test]
    fn hand_computed_lru_and_belady() {
        // top_k 2, capacity 3, one layer. Batches: {0,1} {2,0} {1,3} {0,1}.
        let mut t = Trace::new(1, 4, 2).unwrap();
        for (token, es) in [[0, 1], [2, 0], [1, 3], [0, 1]].iter().enumerate() {
            t.push(token as u64, 0, es).unwrap();
        }
        // LRU: misses 0 1. Hit 0, miss 2 (a free slot); the hit is used before the miss, so
        // the age order is 1 0 2. Hit 1, miss 3 evicts 0 (1 is protected). Hit 1, miss 0 evicts
        // 2. Hits 1 + 1 + 1.
        let r = simulate(&t, 3, &mut super::super::policy::Lru::default()).unwrap();
        assert_eq!((r.hits, r.misses, r.evictions), (3, 5, 2));
        // Belady evicts 2 (never used again) for 3 and then hits both 0 and 1.
        let b = belady(&t, 3).unwrap();
        assert_eq!((b.hits, b.misses, b.evictions), (4, 4, 1));
        assert_eq!(b.tokens, 4);
        assert!((r.bytes_read_per_token(10.0) - 12.5).abs() < 1e-12);
        assert_eq!(default_capacities(&t), vec![2, 4]);
    }

    #[test]
    fn a_pool_smaller_than_top_k_is_refused() {
        let t = Trace::new(2, 8, 4).unwrap();
        let e = belady(&t, 3).unwrap_err();
        assert_eq!(
            e.to_string(),
            "a pool of 3 experts cannot hold one routing decision of 4 experts: use a capacity of at least 4"
        );
        assert!(simulate(&t, 3, &mut super::super::policy::Lru::default()).is_err());
    }

    #[test]
    fn trace_push_rejects_bad_records() {
        let mut t = Trace::new(2, 8, 2).unwrap();
        t.push(0, 1, &[1, 2]).unwrap();
        let reason = |r: Result<(), TraceError>| r.unwrap_err().to_string();
        assert!(reason(t.push(0, 1, &[3, 4])).contains("comes after token 0 layer 1"));
        assert!(reason(t.push(1, 2, &[3, 4])).contains("layer 2 is out of range"));
        assert!(reason(t.push(1, 0, &[3, 8])).contains("expert 8 is out of range"));
        assert!(reason(t.push(1, 0, &[3, 3])).contains("appears twice"));
        assert!(reason(t.push(1, 0, &[3])).contains("1 experts where the header says top_k=2"));
        assert!(reason(t.push(1, 0, &[3, 4, 5])).contains("more than top_k=2"));
        assert_eq!((t.batch_count(), t.requests(), t.tokens()), (1, 2, 1));
        t.push(1, 0, &[3, 4]).unwrap();
        assert_eq!((t.batch_count(), t.tokens(), t.distinct_experts()), (2, 2, 4));
    }

    #[test]
    fn writer_reorders_a_layer_major_prefill_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.trace");
        let mut w = TraceWriter::create(&path, 3, 8, 2).unwrap();
        // Prefill of tokens 0..3 over MoE layers 1 and 2, layer-major; then decode of 3 and 4.
        for layer in 1..3 {
            for token in 0..3u64 {
                w.record(token, layer, &[token as usize, layer + 4]).unwrap();
            }
        }
        for token in 3..5u64 {
            for layer in 1..3 {
                w.record(token, layer, &[7 - token as usize, layer]).unwrap();
            }
        }
        assert!(w.record(0, 1, &[1, 1]).is_err());
        w.finish().unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "# k3ring expert trace v1 layers=3 experts=8 top_k=2");
        assert_eq!(&lines[1..4], &["0 1 0 5", "0 2 0 6", "1 1 1 5"]);
        assert_eq!(lines[lines.len() - 1], "4 2 3 2");
        let t = read_trace(&path).unwrap();
        assert_eq!((t.layers(), t.experts(), t.top_k(), t.batch_count(), t.tokens()), (3, 8, 2, 10, 5));
        let b = t.batch(9);
        assert_eq!((b.token, b.layer, b.experts), (4, 2, &[3u32, 2][..]));
    }

    #[test]
    fn writer_refuses_a_record_that_would_be_written_out_of_order() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.trace");
        let mut w = TraceWriter::create(&path, 4, 8, 1).unwrap();
        w.record(5, 3, &[1]).unwrap();
        // Token 6 at layer 0 ends the pass of token 5, which is written.
        w.record(6, 0, &[1]).unwrap();
        w.record(7, 0, &[1]).unwrap();
        w.record(6, 1, &[1]).unwrap();
        w.record(8, 0, &[1]).unwrap();
        w.record(4, 0, &[2]).unwrap();
        let e = w.finish().unwrap_err();
        assert_eq!(e.to_string(), "expert trace: token 4 layer 0 recorded after token 7 layer 0 was written");
        assert_eq!(e.exit_code(), ExitCode::Data);
    }

    fn read_text(text: &str) -> Result<Trace, TraceError> {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("bad.trace");
        std::fs::write(&path, text).unwrap();
        read_trace(&path).map_err(|e| match e {
            TraceError::Malformed { line, reason, .. } => TraceError::Malformed { path: "T".into(), line, reason },
            other => other,
        })
    }

    #[test]
    fn reader_names_the_line_and_what_is_wrong() {
        let head = "# k3ring expert trace v1 layers=2 experts=8 top_k=2\n";
        let cases = [
            ("", "expert trace T line 1: the file is empty; expected the header `# k3ring expert trace v1 layers=L experts=E top_k=K`"),
            ("# k3ring expert trace v2 layers=2 experts=8 top_k=2\n", "expert trace T line 1: unsupported trace version \"v2\"; this k3ring reads v1"),
            ("# k3ring expert trace v1 layers=2 experts=8 top_k=9\n", "expert trace T line 1: top_k=9 is outside 1..=8"),
            ("0 0 1 2\n", "expert trace T line 1: expected the header `# k3ring expert trace v1 layers=L experts=E top_k=K`, found \"0 0 1 2\""),
        ];
        for (text, want) in cases {
            assert_eq!(read_text(text).unwrap_err().to_string(), want);
        }
        let body_cases = [
            ("0 0 1 2\n\n# comment\n0 1 3 x\n", "line 5: expert \"x\" is not a non-negative integer"),
            ("0 0 1\n", "line 2: 1 experts where the header says top_k=2"),
            ("0 0 1 2 3\n", "line 2: more than top_k=2 experts"),
            ("0 1 1 2\n0 0 1 2\n", "line 3: token 0 layer 0 comes after token 0 layer 1"),
            ("-1 0 1 2\n", "line 2: token \"-1\" is not a non-negative integer"),
            ("0\n", "line 2: expected `token layer` and 2 experts, the line ends before the layer"),
        ];
        for (body, want) in body_cases {
            let e = read_text(&format!("{head}{body}")).unwrap_err();
            assert_eq!(e.exit_code(), ExitCode::Data);
            assert!(e.to_string().contains(want), "{e} does not contain {want}");
        }
        let ok = read_text(&format!("{head}0 0 1 2\n\n0 1 3 4")).unwrap();
        assert_eq!(ok.batch_count(), 2);
    }

    #[test]
    fn reader_reports_a_missing_file_as_io() {
        let e = read_trace(Path::new("/nonexistent/k3ring.trace")).unwrap_err();
        assert_eq!(e.exit_code(), ExitCode::Io);
        assert!(e.to_string().starts_with("opening expert trace /nonexistent/k3ring.trace: "), "{e}");
    }
}
