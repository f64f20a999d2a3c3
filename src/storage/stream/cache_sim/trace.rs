//! Expert traces: the text format (see the module above), reading with its bounds, and the
//! writer that orders a run's records by token and layer.

use std::fs::File;
use std::io::{BufRead, BufReader, Write};

use crate::files::input::{read_line_capped, LineRead};
use crate::files::{Output, OutputWriter};
use std::path::{Path, PathBuf};

use rustc_hash::FxHashSet;

use super::{
    TraceError, FORMAT_VERSION, HEADER_PREFIX, TRACE_EXPERTS_MAX, TRACE_LAYERS_MAX, TRACE_REQUESTS_MAX,
    TRACE_TOP_K_MAX, WRITER_RECORDS_MAX,
};

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
    pub(super) layers: usize,
    pub(super) experts: usize,
    pub(super) top_k: usize,
    /// Bytes of one expert, from the header's `expert_bytes=` (absent in older traces).
    pub(super) expert_bytes: Option<u64>,
    /// (token, layer) of each batch, strictly increasing.
    pub(super) batches: Vec<(u64, u32)>,
    /// `top_k` expert ids per batch. // [batches, top_k]
    pub(super) expert_ids: Vec<u32>,
    pub(super) tokens: usize,
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

/// The longest line a trace may have: a record of a top-k of thousands fits many times over.
const TRACE_LINE_MAX: usize = 1 << 20;

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
    // Bounded by the file: one iteration per line, each line read up to its cap.
    loop {
        line_number += 1;
        match read_line_capped(&mut reader, &mut buf, TRACE_LINE_MAX).map_err(io("reading"))? {
            LineRead::End => break,
            LineRead::TooLong => {
                return Err(malformed(line_number, format!("the line is longer than {TRACE_LINE_MAX} bytes")));
            }
            LineRead::Line => {}
        }
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
    out: OutputWriter,
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
    /// Starts writing `out` (replaced when [`TraceWriter::finish`] succeeds) with the header
    /// (without the expert size).
    pub fn create(out: &Output, layers: usize, experts: usize, top_k: usize) -> Result<TraceWriter, TraceError> {
        TraceWriter::create_sized(out, layers, experts, top_k, None)
    }

    /// [`TraceWriter::create`], writing `expert_bytes=` in the header when given, so that
    /// `cache-sim` turns misses into bytes with the model's own expert size.
    pub fn create_sized(
        out: &Output,
        layers: usize,
        experts: usize,
        top_k: usize,
        expert_bytes: Option<u64>,
    ) -> Result<TraceWriter, TraceError> {
        check_shape(layers, experts, top_k).map_err(|reason| TraceError::Invalid { reason })?;
        let mut w = TraceWriter {
            path: out.path().to_owned(),
            out: out.create()?,
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

    /// Writes the held records and replaces the output file with what was written.
    pub fn finish(mut self) -> Result<(), TraceError> {
        self.flush_held()?;
        Ok(self.out.finish()?)
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
