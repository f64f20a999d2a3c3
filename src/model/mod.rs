//! The Kimi K3 forward pass (spec section 5), one file per block.
//!
//! [`Model::forward`] runs a chunk of tokens through every layer: the attention-residual reads,
//! KDA or MLA, the dense MLP or the latent MoE, and the head. Weights come only through
//! [`weights::WeightSource`]; carried state lives in [`ModelState`]; every buffer is in
//! [`Scratch`], sized once for the chunk and context length, so the per-token path does not
//! allocate. Everything is per token, so chunked prefill, decode and full recompute agree bit
//! for bit; work is split across threads by output rows and heads, never inside a reduction.
#![forbid(unsafe_code)]

pub mod attn_res;
pub mod attribution;
pub mod buffers;
pub mod dense;
pub mod expert_check;
pub mod head;
pub mod hook;
pub mod kda;
pub mod mla;
pub mod moe;
pub mod rewind;
pub mod snapshot;
pub mod weights;

use kernels::{KernelError, Kernels};

use crate::config::{AttnKind, Config, FfnKind};
use crate::exit::{Classify, ExitCode};
use crate::trace::{ComputeOp, SpanArgs};
use attn_res::ResScratch;
use attribution::{Meter, OpClass};
use buffers::{counted, Allocate, Buffers};
use dense::GluScratch;
use head::HeadScratch;
use kda::{KdaScratch, KdaState};
use mla::{MlaCache, MlaScratch};
use moe::{MoeScratch, Route};
use weights::{AttnWeights, FfnWeights, ModelWeights, SourceError, TrunkUnit, TrunkView, WeightSource};

pub use hook::{LayerHook, NoHook};

/// Why a forward pass stopped.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Source(#[from] SourceError),
    #[error("layer {layer}, expert {expert}: corrupt MXFP4 data: {source}")]
    Expert { layer: usize, expert: usize, source: KernelError },
    #[error("layer {layer}: non-finite {what}; the weights are corrupt or out of range")]
    NonFinite { layer: usize, what: String },
    #[error("the context is full ({capacity} positions)")]
    ContextFull { capacity: usize },
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { id: usize, vocab: usize },
    #[error("internal error: {0}")]
    Internal(String),
}

impl Classify for ModelError {
    fn exit_code(&self) -> ExitCode {
        match self {
            ModelError::Source(e) => e.exit_code(),
            ModelError::Expert { source, .. } => source.exit_code(),
            ModelError::NonFinite { .. } => ExitCode::Data,
            ModelError::ContextFull { .. } | ModelError::TokenOutOfRange { .. } => ExitCode::Usage,
            ModelError::Internal(_) => ExitCode::Internal,
        }
    }
}

/// Kernel errors enter the crate here. The kernels crate cannot depend on this one, so its error
/// is classified beside the first error type that wraps it.
impl Classify for KernelError {
    fn exit_code(&self) -> ExitCode {
        match self {
            KernelError::BadScale { .. } => ExitCode::Data,
            KernelError::IsaUnavailable(_) => ExitCode::Usage,
            // `KernelError` is non-exhaustive: a later variant counts as a bug until classified here.
            _ => ExitCode::Internal,
        }
    }
}

/// Receives intermediates of a forward pass (tests and debugging); costs nothing when absent.
pub trait Probe: Send {
    /// `data` is [t, width] for the chunk's tokens.
    fn tensor(&mut self, layer: Option<usize>, what: &'static str, t: usize, data: &[f32]);
    /// The routing of one MoE layer for the chunk's tokens.
    fn routes(&mut self, layer: usize, routes: &[Route]);
}

/// Which positions of a chunk get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitRows {
    Last,
    All,
}

/// A model ready to run: validated config, resolved weight ids, chosen kernels.
pub struct Model {
    pub cfg: Config,
    pub weights: ModelWeights,
    pub kernels: Kernels,
    /// Compute spans (attention, router, experts, ...) for the trace and the busy fractions;
    /// `None` records nothing (resident runs, which have no I/O to overlap).
    pub tracer: Option<std::sync::Arc<crate::trace::Tracer>>,
    /// Per-operation-class time and weight bytes (`k3ring bench`'s attribution table); `None`
    /// counts nothing and costs one test per timed region.
    pub attribution: Option<std::sync::Arc<attribution::Attribution>>,
}

/// Carried state of one layer.
pub enum LayerState {
    Kda(KdaState),
    Mla(MlaCache),
}

/// Everything carried across chunks: KDA states and conv history, MLA latent caches.
pub struct ModelState {
    layers: Vec<LayerState>,
    pos: usize,
    capacity: usize,
    /// Set once the state is armed for draft verification ([`ModelState::arm`]).
    journal: Option<rewind::Journal>,
}

impl ModelState {
    /// State for a context of up to `capacity` positions.
    pub fn new(cfg: &Config, capacity: usize) -> ModelState {
        let layers = cfg
            .layers
            .iter()
            .map(|p| match p.attn {
                AttnKind::Kda => LayerState::Kda(KdaState::new(cfg)),
                AttnKind::Mla => LayerState::Mla(MlaCache::new(cfg, capacity)),
            })
            .collect();
        ModelState { layers, pos: 0, capacity, journal: None }
    }

    /// Bytes of the states and caches for `capacity` positions.
    pub fn bytes(cfg: &Config, capacity: usize) -> u64 {
        cfg.layers
            .iter()
            .map(|p| match p.attn {
                AttnKind::Kda => KdaState::bytes(cfg),
                AttnKind::Mla => MlaCache::bytes(cfg, capacity),
            })
            .sum()
    }

    /// Positions consumed so far.
    pub fn pos(&self) -> usize {
        self.pos
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

/// Every buffer of a forward pass, for chunks of up to `chunk` tokens.
pub struct Scratch {
    chunk: usize,
    partial: Vec<f32>,        // [T, D] p
    embed_rows: Vec<u8>,      // [T, D] bf16 rows
    snapshots: Vec<Vec<f32>>, // [blocks][T, D]
    x: Vec<f32>,              // [T, D] attention input (residual read)
    xn: Vec<f32>,             // [T, D] normalised
    a: Vec<f32>,              // [T, D] block output
    res: ResScratch,
    kda: KdaScratch,
    mla: MlaScratch,
    moe: MoeScratch,
    dense: GluScratch,
    head: HeadScratch,
}

impl Scratch {
    pub fn new(cfg: &Config, chunk: usize, capacity: usize) -> Scratch {
        Scratch::build(cfg, chunk, capacity, &mut Allocate)
    }

    /// Bytes [`Scratch::new`] allocates for a chunk and context, counted without allocating
    /// (the memory plan is made before anything large is allocated).
    pub fn bytes(cfg: &Config, chunk: usize, capacity: usize) -> u64 {
        counted(|b| Scratch::build(cfg, chunk, capacity, b))
    }

    fn build(cfg: &Config, chunk: usize, capacity: usize, b: &mut impl Buffers) -> Scratch {
        let d = cfg.hidden_size;
        let blocks = cfg.block_starts().len();
        let td = chunk * d;
        Scratch {
            chunk,
            partial: b.zeros(td),
            embed_rows: b.zero_bytes(2 * td),
            snapshots: b.each(blocks, |b| b.zeros(td)),
            x: b.zeros(td),
            xn: b.zeros(td),
            a: b.zeros(td),
            res: ResScratch::new(d, blocks + 1, b),
            kda: KdaScratch::new(cfg, chunk, b),
            mla: MlaScratch::new(cfg, chunk, capacity, b),
            moe: MoeScratch::new(cfg, chunk, b),
            dense: GluScratch::new(cfg, chunk, cfg.dense_intermediate, b),
            head: HeadScratch::new(cfg, chunk, blocks + 1, b),
        }
    }

    pub fn chunk(&self) -> usize {
        self.chunk
    }
}

/// exp of one value through the kernels' deterministic exp.
pub(crate) fn exp1(k: &Kernels, x: f32) -> f32 {
    let mut v = [x];
    k.exp(&mut v);
    v[0]
}

/// The rows of a step that belong to one sequence, whose state is `states[slot]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    pub slot: usize,
    pub rows: std::ops::Range<usize>,
}

impl Model {
    /// Runs `tokens` (at most the scratch's chunk) of one sequence through the model at the
    /// state's position, advancing it. Logits of the requested rows go to `logits` ([rows, V]).
    #[allow(clippy::too_many_arguments)]
    pub fn forward<S: WeightSource>(
        &self,
        src: &S,
        hook: &dyn LayerHook,
        st: &mut ModelState,
        sc: &mut Scratch,
        tokens: &[u32],
        rows: LogitRows,
        logits: &mut [f32],
        probe: Option<&mut (dyn Probe + '_)>,
    ) -> Result<(), ModelError> {
        let t = tokens.len();
        if t == 0 {
            return Err(ModelError::Internal("a chunk of 0 tokens".into()));
        }
        let segment = [Segment { slot: 0, rows: 0..t }];
        let states = std::slice::from_mut(st);
        match rows {
            LogitRows::Last => self.forward_batch(src, hook, states, &segment, sc, tokens, &[t - 1], logits, probe),
            LogitRows::All => {
                let all: Vec<usize> = (0..t).collect();
                self.forward_batch(src, hook, states, &segment, sc, tokens, &all, logits, probe)
            }
        }
    }

    /// Runs one step of several sequences: `tokens` (at most the scratch's chunk) are rows, and
    /// `segments` say which consecutive rows belong to which state in `states` (each state at
    /// most once; together they cover every row in order). Every row-wise product runs once
    /// over all rows; only the attention's recurrence and cache are per sequence, so a row's
    /// result is the one it has in a solo run. Advances each segment's state by its row count.
    /// Logits of the rows `logit_rows` go to `logits` ([logit_rows.len(), V]).
    /// The pool's other workers stay awake through the step, so that no parallel product waits
    /// for one to wake ([`kernels::with_workers_awake`]).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_batch<S: WeightSource>(
        &self,
        src: &S,
        hook: &dyn LayerHook,
        states: &mut [ModelState],
        segments: &[Segment],
        sc: &mut Scratch,
        tokens: &[u32],
        logit_rows: &[usize],
        logits: &mut [f32],
        probe: Option<&mut (dyn Probe + '_)>,
    ) -> Result<(), ModelError> {
        kernels::with_workers_awake(|| {
            self.step_awake(src, hook, states, segments, sc, tokens, logit_rows, logits, probe)
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn step_awake<S: WeightSource>(
        &self,
        src: &S,
        hook: &dyn LayerHook,
        states: &mut [ModelState],
        segments: &[Segment],
        sc: &mut Scratch,
        tokens: &[u32],
        logit_rows: &[usize],
        logits: &mut [f32],
        mut probe: Option<&mut (dyn Probe + '_)>,
    ) -> Result<(), ModelError> {
        let t = tokens.len();
        if t == 0 || t > sc.chunk {
            return Err(ModelError::Internal(format!("chunk of {t} tokens with scratch for {}", sc.chunk)));
        }
        check_segments(states, segments, t)?;
        if let Some(&row) = logit_rows.iter().find(|&&r| r >= t) {
            return Err(ModelError::Internal(format!("logits asked for row {row} of a step of {t}")));
        }
        for seg in segments {
            let st = &states[seg.slot];
            if st.pos + seg.rows.len() > st.capacity {
                return Err(ModelError::ContextFull { capacity: st.capacity });
            }
            if st.armed_rows().is_some_and(|max| seg.rows.len() > max) {
                return Err(ModelError::Internal(format!(
                    "a step of {} rows on a state armed for fewer",
                    seg.rows.len()
                )));
            }
        }
        let d = self.cfg.hidden_size;
        let meter = self.meter();
        meter.time(OpClass::Embedding, 2 * t * d, || {
            head::embed(&self.cfg, src, &self.weights.globals, tokens, &mut sc.embed_rows, &mut sc.partial[..t * d])
        })?;
        let mut n_snap = 0;
        for l in 0..self.cfg.n_layers {
            n_snap = self.layer(src, hook, states, segments, sc, l, t, n_snap, &mut probe)?;
        }
        let g = src.trunk(TrunkUnit::Head)?;
        let head_span = self.tracer.as_ref().map(|t| t.span(ComputeOp::Head));
        let h = head::forward(
            &self.kernels,
            meter,
            &self.cfg,
            &g,
            &self.weights.globals,
            &sc.snapshots[..n_snap],
            &sc.partial,
            t,
            logit_rows,
            &mut sc.head,
            logits,
        )?;
        drop(head_span);
        if let Some(p) = probe {
            p.tensor(None, "final_hidden", t, h);
            for (j, snap) in sc.snapshots[..n_snap].iter().enumerate() {
                p.tensor(Some(j), "snapshot", t, &snap[..t * d]);
            }
        }
        for seg in segments {
            states[seg.slot].pos += seg.rows.len();
        }
        Ok(())
    }

    /// One decoder layer (spec 5, steps 1-5); returns the snapshot count after it.
    #[allow(clippy::too_many_arguments)]
    fn layer<S: WeightSource>(
        &self,
        src: &S,
        hook: &dyn LayerHook,
        states: &mut [ModelState],
        segments: &[Segment],
        sc: &mut Scratch,
        l: usize,
        t: usize,
        mut n_snap: usize,
        probe: &mut Option<&mut (dyn Probe + '_)>,
    ) -> Result<usize, ModelError> {
        let (k, cfg) = (&self.kernels, &self.cfg);
        let d = cfg.hidden_size;
        let td = t * d;
        let view = src.trunk(TrunkUnit::Layer(l))?;
        let lw = &self.weights.layers[l];
        let meter = self.meter();
        // 1. x = R(p_in, B) (or p_in while B is empty, i.e. layer 0).
        if n_snap == 0 {
            sc.x[..td].copy_from_slice(&sc.partial[..td]);
        } else {
            meter.time(OpClass::ResidualReads, attn_res::weight_bytes(&view, &lw.attn_res), || {
                attn_res::forward(
                    k,
                    &view,
                    &lw.attn_res,
                    &sc.snapshots[..n_snap],
                    &sc.partial,
                    t,
                    d,
                    &mut sc.res,
                    &mut sc.x,
                )
            });
        }
        report(probe, l, "attn_input", t, &sc.x[..td]);
        // 2. At a block start, snapshot p_in and restart the partial sum.
        if cfg.layers[l].block_start {
            let snap = sc.snapshots.get_mut(n_snap).ok_or_else(|| ModelError::Internal("snapshot overflow".into()))?;
            snap[..td].copy_from_slice(&sc.partial[..td]);
            n_snap += 1;
            sc.partial[..td].fill(0.0);
        }
        // 3. a = Attention(RMSNorm(x)); p += a.
        let attn_span =
            self.tracer.as_ref().map(|t| t.span_args(ComputeOp::Attention, SpanArgs::new().layer(l as u32)));
        let norm = view.bytes(lw.input_layernorm.id);
        meter.time(OpClass::NormsActivations, norm.len(), || {
            norm_rows(k, norm, cfg.rms_norm_eps, &sc.x[..td], &mut sc.xn[..td], d)
        });
        let disagree = || ModelError::Internal(format!("layer {l}: state and weights disagree"));
        match &lw.attn {
            AttnWeights::Kda(w) => {
                kda::project(k, meter, cfg, &view, w, &sc.xn, t, &mut sc.kda)?;
                for seg in segments {
                    self.kda_mix(&view, w, &mut states[seg.slot], l, seg.rows.clone(), t, &mut sc.kda)?;
                }
                kda::output(k, meter, cfg, &view, w, t, &mut sc.kda, &mut sc.a)?;
            }
            AttnWeights::Mla(w) => {
                mla::project(k, meter, cfg, &view, w, &sc.xn, t, &mut sc.mla)?;
                for seg in segments {
                    let LayerState::Mla(c) = &mut states[seg.slot].layers[l] else { return Err(disagree()) };
                    mla::append(k, meter, cfg, &view, w, c, seg.rows.clone(), &mut sc.mla)?;
                }
                // Every segment's state is MLA here (the loop above checked), so none is skipped.
                let seqs = |f: &mut dyn FnMut(&mla::MlaCache, std::ops::Range<usize>)| {
                    for seg in segments {
                        if let LayerState::Mla(c) = &states[seg.slot].layers[l] {
                            f(c, seg.rows.clone());
                        }
                    }
                };
                mla::attend_all(k, meter, cfg, &view, w, &seqs, t, &mut sc.mla)?;
                mla::output(k, meter, cfg, &view, w, t, &mut sc.mla, &mut sc.a)?;
            }
        }
        report(probe, l, "attn_out", t, &sc.a[..td]);
        add_into(&mut sc.partial[..td], &sc.a[..td]);
        // 4. y = R(p, B); 5. m = FFN(RMSNorm(y)); p += m.
        meter.time(OpClass::ResidualReads, attn_res::weight_bytes(&view, &lw.mlp_res), || {
            attn_res::forward(k, &view, &lw.mlp_res, &sc.snapshots[..n_snap], &sc.partial, t, d, &mut sc.res, &mut sc.x)
        });
        drop(attn_span);
        report(probe, l, "mlp_input", t, &sc.x[..td]);
        hook.mlp_input(self, l, t, &sc.x[..td]);
        let norm = view.bytes(lw.post_attention_layernorm.id);
        meter.time(OpClass::NormsActivations, norm.len(), || {
            norm_rows(k, norm, cfg.rms_norm_eps, &sc.x[..td], &mut sc.xn[..td], d)
        });
        match &lw.ffn {
            FfnWeights::Dense(w) => {
                let _s =
                    self.tracer.as_ref().map(|t| t.span_args(ComputeOp::DenseFfn, SpanArgs::new().layer(l as u32)));
                dense::glu_mlp(k, (meter, OpClass::DenseFfn), &view, w, &sc.xn, t, d, &mut sc.dense, &mut sc.a)?
            }
            FfnWeights::Moe(w) => {
                let obs = moe::Observers { tracer: self.tracer.as_deref(), meter };
                moe::forward(k, cfg, &view, src, l, w, &sc.xn, t, &mut sc.moe, &mut sc.a, obs)?;
                if let Some(p) = probe.as_deref_mut() {
                    p.routes(l, &sc.moe.routes[..t]);
                }
            }
        }
        debug_assert!(cfg.layers[l].ffn == FfnKind::Dense || matches!(lw.ffn, FfnWeights::Moe(_)));
        report(probe, l, "ffn_out", t, &sc.a[..td]);
        add_into(&mut sc.partial[..td], &sc.a[..td]);
        if sc.partial[..td].iter().any(|v| !v.is_finite()) {
            return Err(ModelError::NonFinite { layer: l, what: "hidden state".to_owned() });
        }
        report(probe, l, "partial", t, &sc.partial[..td]);
        hook.layer_end(self, l, t, &sc.snapshots[..n_snap], &sc.partial[..td]);
        Ok(n_snap)
    }
}

impl Model {
    /// The recurrent part of KDA layer `l` for one sequence's rows; an armed state's journal
    /// keeps what taking rows back needs ([`rewind`]).
    #[allow(clippy::too_many_arguments)]
    fn kda_mix(
        &self,
        view: &dyn TrunkView,
        w: &weights::KdaWeights,
        st: &mut ModelState,
        l: usize,
        rows: std::ops::Range<usize>,
        t: usize,
        sc: &mut KdaScratch,
    ) -> Result<(), ModelError> {
        let (k, cfg) = (&self.kernels, &self.cfg);
        let LayerState::Kda(s) = &mut st.layers[l] else {
            return Err(ModelError::Internal(format!("layer {l}: state and weights disagree")));
        };
        let mut journal = st.journal.as_mut().and_then(|j| j.kda_mut(l));
        if let Some(j) = journal.as_deref_mut() {
            j.save(s);
        }
        self.meter().time(OpClass::KdaRecurrence, kda::conv_weight_bytes(view, w), || {
            kda::mix(k, cfg, view, w, s, rows.clone(), t, sc)
        });
        if let Some(j) = journal {
            j.record(cfg, sc, rows);
        }
        Ok(())
    }

    fn meter(&self) -> Meter<'_> {
        Meter::new(self.attribution.as_deref())
    }
}

/// Segments must cover rows 0..t in order, each non-empty, each state at most once.
fn check_segments(states: &[ModelState], segments: &[Segment], t: usize) -> Result<(), ModelError> {
    let bad = |why: &str| Err(ModelError::Internal(format!("segments of a step of {t} rows: {why}")));
    let mut next = 0;
    for (i, seg) in segments.iter().enumerate() {
        if seg.rows.start != next || seg.rows.is_empty() {
            return bad("they must cover the rows in order, none empty");
        }
        if seg.slot >= states.len() || segments[..i].iter().any(|s| s.slot == seg.slot) {
            return bad("each must name a distinct state");
        }
        next = seg.rows.end;
    }
    if next != t {
        return bad("they must cover every row");
    }
    Ok(())
}

fn report(probe: &mut Option<&mut (dyn Probe + '_)>, l: usize, what: &'static str, t: usize, data: &[f32]) {
    if let Some(p) = probe.as_deref_mut() {
        p.tensor(Some(l), what, t, data);
    }
}

/// RMSNorm of each row of `x` ([t, d]) with a bf16 weight.
pub(crate) fn norm_rows(k: &Kernels, w_bf16: &[u8], eps: f32, x: &[f32], out: &mut [f32], d: usize) {
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        k.rmsnorm_bf16w(xr, w_bf16, eps, or);
    }
}

fn add_into(p: &mut [f32], a: &[f32]) {
    for (p, a) in p.iter_mut().zip(a) {
        *p += *a;
    }
}

impl ModelState {
    /// Appends the carried state of every layer (a kind byte, then little-endian lengths and
    /// f32s; an MLA cache only up to its length) for a state file. [`ModelState::load_from`]
    /// reads it back.
    pub fn save_into(&self, out: &mut Vec<u8>) {
        for l in &self.layers {
            match l {
                LayerState::Kda(s) => {
                    out.push(0);
                    s.save_into(out);
                }
                LayerState::Mla(c) => {
                    out.push(1);
                    c.save_into(out);
                }
            }
        }
    }

    /// Replaces the state with one [`ModelState::save_into`] wrote at position `pos`, consuming
    /// its bytes from `bytes`. Refuses (saying why) a state of another layer plan or shape, or
    /// longer than this state's capacity; on refusal the state is reset.
    pub fn load_from(&mut self, bytes: &mut &[u8], pos: usize) -> Result<(), String> {
        if pos > self.capacity {
            return Err(format!("position {pos} is beyond this session's {} positions", self.capacity));
        }
        self.commit();
        let r = self.load_layers(bytes, pos);
        match r {
            Ok(()) => self.pos = pos,
            Err(_) => self.reset(),
        }
        r
    }

    fn load_layers(&mut self, bytes: &mut &[u8], pos: usize) -> Result<(), String> {
        for (i, l) in self.layers.iter_mut().enumerate() {
            let kind = take_bytes(bytes, 1).map_err(|e| format!("layer {i}: {e}"))?[0];
            let r = match (l, kind) {
                (LayerState::Kda(s), 0) => s.load_from(bytes),
                (LayerState::Mla(c), 1) => c.load_from(bytes, pos),
                (_, k) => Err(format!("kind {k} does not match this model's layer plan")),
            };
            r.map_err(|e| format!("layer {i}: {e}"))?;
        }
        Ok(())
    }

    /// Forgets the context: zero states, empty caches, position 0. Keeps the allocations.
    pub fn reset(&mut self) {
        self.commit();
        for l in &mut self.layers {
            match l {
                LayerState::Kda(s) => s.reset(),
                LayerState::Mla(c) => c.reset(),
            }
        }
        self.pos = 0;
    }
}

/// Appends `v` as little-endian f32s after its length (u64).
pub(crate) fn put_f32s(out: &mut Vec<u8>, v: &[f32]) {
    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
    for x in v {
        out.extend_from_slice(&x.to_le_bytes());
    }
}

/// Takes `n` bytes from the front of `bytes`.
pub(crate) fn take_bytes<'a>(bytes: &mut &'a [u8], n: usize) -> Result<&'a [u8], String> {
    if bytes.len() < n {
        return Err(format!("needs {n} more bytes, {} left", bytes.len()));
    }
    let (head, rest) = bytes.split_at(n);
    *bytes = rest;
    Ok(head)
}

/// Takes a little-endian u64.
pub(crate) fn take_u64(bytes: &mut &[u8]) -> Result<u64, String> {
    let b = take_bytes(bytes, 8)?;
    let mut a = [0u8; 8];
    a.copy_from_slice(b);
    Ok(u64::from_le_bytes(a))
}

/// Fills `into` from a length-prefixed run of f32s that must be exactly `into.len()` long.
pub(crate) fn take_f32s(bytes: &mut &[u8], into: &mut [f32]) -> Result<(), String> {
    let n = take_u64(bytes)?;
    if n != into.len() as u64 {
        return Err(format!("{n} values where this model has {}", into.len()));
    }
    let b = take_bytes(bytes, 4 * into.len())?;
    for (x, c) in into.iter_mut().zip(b.chunks_exact(4)) {
        *x = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    Ok(())
}
