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
pub mod buffers;
pub mod dense;
pub mod head;
pub mod hook;
pub mod kda;
pub mod mla;
pub mod moe;
pub mod weights;

use kernels::{KernelError, Kernels};

use crate::config::{AttnKind, Config, FfnKind};
use crate::exit::{Classify, ExitCode};
use crate::trace::{ComputeOp, SpanArgs};
use attn_res::ResScratch;
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
        ModelState { layers, pos: 0, capacity }
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

impl Model {
    /// Runs `tokens` (at most the scratch's chunk) through the model at the state's position,
    /// advancing it. Logits of the requested rows go to `logits` ([rows, V]).
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
        mut probe: Option<&mut (dyn Probe + '_)>,
    ) -> Result<(), ModelError> {
        let t = tokens.len();
        if t == 0 || t > sc.chunk {
            return Err(ModelError::Internal(format!("chunk of {t} tokens with scratch for {}", sc.chunk)));
        }
        if st.pos + t > st.capacity {
            return Err(ModelError::ContextFull { capacity: st.capacity });
        }
        let d = self.cfg.hidden_size;
        head::embed(&self.cfg, src, &self.weights.globals, tokens, &mut sc.embed_rows, &mut sc.partial[..t * d])?;
        let mut n_snap = 0;
        for l in 0..self.cfg.n_layers {
            n_snap = self.layer(src, hook, st, sc, l, t, n_snap, &mut probe)?;
        }
        let g = src.trunk(TrunkUnit::Head)?;
        let head_span = self.tracer.as_ref().map(|t| t.span(ComputeOp::Head));
        let out_rows = match rows {
            LogitRows::Last => t - 1..t,
            LogitRows::All => 0..t,
        };
        let h = head::forward(
            &self.kernels,
            &self.cfg,
            &g,
            &self.weights.globals,
            &sc.snapshots[..n_snap],
            &sc.partial,
            t,
            out_rows,
            &mut sc.head,
            logits,
        );
        drop(head_span);
        if let Some(p) = probe {
            p.tensor(None, "final_hidden", t, h);
            for (j, snap) in sc.snapshots[..n_snap].iter().enumerate() {
                p.tensor(Some(j), "snapshot", t, &snap[..t * d]);
            }
        }
        st.pos += t;
        Ok(())
    }

    /// One decoder layer (spec 5, steps 1-5); returns the snapshot count after it.
    #[allow(clippy::too_many_arguments)]
    fn layer<S: WeightSource>(
        &self,
        src: &S,
        hook: &dyn LayerHook,
        st: &mut ModelState,
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
        // 1. x = R(p_in, B) (or p_in while B is empty, i.e. layer 0).
        if n_snap == 0 {
            sc.x[..td].copy_from_slice(&sc.partial[..td]);
        } else {
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
            );
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
        norm_rows(k, view.bytes(lw.input_layernorm.id), cfg.rms_norm_eps, &sc.x[..td], &mut sc.xn[..td], d);
        match (&lw.attn, &mut st.layers[l]) {
            (AttnWeights::Kda(w), LayerState::Kda(s)) => {
                kda::forward(k, cfg, &view, w, s, &sc.xn, t, &mut sc.kda, &mut sc.a)?
            }
            (AttnWeights::Mla(w), LayerState::Mla(c)) => {
                mla::forward(k, cfg, &view, w, c, &sc.xn, t, &mut sc.mla, &mut sc.a)?
            }
            _ => return Err(ModelError::Internal(format!("layer {l}: state and weights disagree"))),
        }
        report(probe, l, "attn_out", t, &sc.a[..td]);
        add_into(&mut sc.partial[..td], &sc.a[..td]);
        // 4. y = R(p, B); 5. m = FFN(RMSNorm(y)); p += m.
        attn_res::forward(k, &view, &lw.mlp_res, &sc.snapshots[..n_snap], &sc.partial, t, d, &mut sc.res, &mut sc.x);
        drop(attn_span);
        report(probe, l, "mlp_input", t, &sc.x[..td]);
        hook.mlp_input(self, l, t, &sc.x[..td]);
        norm_rows(k, view.bytes(lw.post_attention_layernorm.id), cfg.rms_norm_eps, &sc.x[..td], &mut sc.xn[..td], d);
        match &lw.ffn {
            FfnWeights::Dense(w) => {
                let _s =
                    self.tracer.as_ref().map(|t| t.span_args(ComputeOp::DenseFfn, SpanArgs::new().layer(l as u32)));
                dense::glu_mlp(k, &view, w, &sc.xn, t, d, &mut sc.dense, &mut sc.a)
            }
            FfnWeights::Moe(w) => {
                moe::forward(k, cfg, &view, src, l, w, &sc.xn, t, &mut sc.moe, &mut sc.a, self.tracer.as_deref())?;
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
    /// Forgets the context: zero states, empty caches, position 0. Keeps the allocations.
    pub fn reset(&mut self) {
        for l in &mut self.layers {
            match l {
                LayerState::Kda(s) => s.reset(),
                LayerState::Mla(c) => c.reset(),
            }
        }
        self.pos = 0;
    }
}
