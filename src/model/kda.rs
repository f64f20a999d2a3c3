//! Kimi Delta Attention (spec 5, KDA): projections, causal short conv with carried history,
//! per-head l2norm, the per-head A_log gate with its lower bound, beta, the delta-rule
//! recurrence with carried state, head-wise norm then sigmoid gate, output projection.
//!
//! Tokens are processed in order (the conv and the state are recurrences); heads run in
//! parallel, each owning its state, so results never depend on the thread count.

use kernels::Kernels;
use rayon::prelude::*;

use super::attribution::{Meter, OpClass};
use super::buffers::Buffers;
use super::weights::{f32_at, KdaWeights, Mat, SourceError, Streamed, TrunkView};
use crate::config::Config;

/// l2norm eps inside the square root (spec 5).
const L2NORM_EPS: f32 = 1e-6;

/// Carried state of one KDA layer.
pub struct KdaState {
    /// [heads, K, V]: one K x V matrix per head, rows are key dims.
    s: Vec<f32>,
    /// Past conv inputs of q, k, v: [3][W][conv - 1], oldest first.
    conv: Vec<f32>,
}

impl KdaState {
    pub fn new(cfg: &Config) -> KdaState {
        let kd = &cfg.kda;
        KdaState {
            s: vec![0.0; kd.n_heads * kd.head_dim * kd.head_dim],
            conv: vec![0.0; 3 * kd.width() * (kd.conv_kernel_size - 1)],
        }
    }

    /// Back to the start of a sequence.
    pub fn reset(&mut self) {
        self.s.fill(0.0);
        self.conv.fill(0.0);
    }

    /// Appends the state matrices and the conv history (see [`super::ModelState::save_into`]).
    pub fn save_into(&self, out: &mut Vec<u8>) {
        super::put_f32s(out, &self.s);
        super::put_f32s(out, &self.conv);
    }

    /// Reads what [`KdaState::save_into`] wrote.
    pub fn load_from(&mut self, bytes: &mut &[u8]) -> Result<(), String> {
        super::take_f32s(bytes, &mut self.s).map_err(|e| format!("KDA state: {e}"))?;
        super::take_f32s(bytes, &mut self.conv).map_err(|e| format!("KDA conv history: {e}"))
    }

    /// The state matrices and conv history, for a snapshot ([`super::snapshot`]).
    pub(super) fn parts(&self) -> (&[f32], &[f32]) {
        (&self.s, &self.conv)
    }

    /// Sets what [`KdaState::parts`] gave; false when the sizes differ.
    pub(super) fn set_parts(&mut self, s: &[f32], conv: &[f32]) -> bool {
        if s.len() != self.s.len() || conv.len() != self.conv.len() {
            return false;
        }
        self.s.copy_from_slice(s);
        self.conv.copy_from_slice(conv);
        true
    }

    /// Bytes this state holds.
    pub fn bytes(cfg: &Config) -> u64 {
        let kd = &cfg.kda;
        4 * (kd.n_heads * kd.head_dim * kd.head_dim + 3 * kd.width() * (kd.conv_kernel_size - 1)) as u64
    }
}

/// What a KDA layer needs to take back rows of a step (draft verification): the state before
/// the step, and the recurrence's inputs for the step's rows (raw conv inputs, normalised q and
/// k, v, alpha, beta), so that the state after any prefix of the rows is recomputed by the same
/// operations in the same order, without the layer's weights.
pub struct KdaJournal {
    s: Vec<f32>,
    conv: Vec<f32>,
    raw: [Vec<f32>; 3],
    qkv: [Vec<f32>; 3],
    alpha: Vec<f32>,
    beta: Vec<f32>,
    heads_out: Vec<f32>,
    step: Vec<f32>,
    rows: usize,
    max_rows: usize,
}

impl KdaJournal {
    pub fn new(cfg: &Config, max_rows: usize) -> KdaJournal {
        let kd = &cfg.kda;
        let tw = max_rows * kd.width();
        KdaJournal {
            s: vec![0.0; kd.n_heads * kd.head_dim * kd.head_dim],
            conv: vec![0.0; 3 * kd.width() * (kd.conv_kernel_size - 1)],
            raw: [vec![0.0; tw], vec![0.0; tw], vec![0.0; tw]],
            qkv: [vec![0.0; tw], vec![0.0; tw], vec![0.0; tw]],
            alpha: vec![0.0; tw],
            beta: vec![0.0; max_rows * kd.n_heads],
            heads_out: vec![0.0; tw],
            step: vec![0.0; kd.n_heads * kd.head_dim],
            rows: 0,
            max_rows,
        }
    }

    /// Bytes a journal for `max_rows` rows holds.
    pub fn bytes(cfg: &Config, max_rows: usize) -> u64 {
        let kd = &cfg.kda;
        let tw = (max_rows * kd.width()) as u64;
        KdaState::bytes(cfg) + 4 * (8 * tw + (max_rows * kd.n_heads + kd.n_heads * kd.head_dim) as u64)
    }

    pub fn max_rows(&self) -> usize {
        self.max_rows
    }

    /// Before [`mix`] of the step: keeps the state it starts from.
    pub fn save(&mut self, st: &KdaState) {
        self.s.copy_from_slice(&st.s);
        self.conv.copy_from_slice(&st.conv);
        self.rows = 0;
    }

    /// After [`mix`] of the step over `rows`: keeps the recurrence's inputs of those rows.
    pub fn record(&mut self, cfg: &Config, s: &KdaScratch, rows: std::ops::Range<usize>) {
        let kd = &cfg.kda;
        let (width, heads) = (kd.width(), kd.n_heads);
        let n = rows.len().min(self.max_rows);
        let span = rows.start * width..(rows.start + n) * width;
        for i in 0..3 {
            self.raw[i][..n * width].copy_from_slice(&s.raw[i][span.clone()]);
            self.qkv[i][..n * width].copy_from_slice(&s.conv[i][span.clone()]);
        }
        self.alpha[..n * width].copy_from_slice(&s.gate[span]);
        self.beta[..n * heads].copy_from_slice(&s.beta[rows.start * heads..(rows.start + n) * heads]);
        self.rows = n;
    }

    /// Puts `st` where it would be after only the first `keep` recorded rows: the saved state,
    /// then the conv history and the recurrence advanced over those rows exactly as [`mix`] did.
    pub fn rewind(&mut self, k: &Kernels, cfg: &Config, st: &mut KdaState, keep: usize) {
        let kd = &cfg.kda;
        let width = kd.width();
        let keep = keep.min(self.rows);
        st.s.copy_from_slice(&self.s);
        st.conv.copy_from_slice(&self.conv);
        let hist_len = width * (kd.conv_kernel_size - 1);
        for i in 0..3 {
            let hist = &mut st.conv[i * hist_len..(i + 1) * hist_len];
            advance_history(kd.conv_kernel_size, width, keep, &self.raw[i], hist);
        }
        if keep > 0 {
            let [q, kk, v] = &self.qkv;
            recurrence(
                k,
                cfg,
                st,
                q,
                kk,
                v,
                &self.alpha,
                &self.beta,
                0..keep,
                keep,
                &mut self.heads_out,
                &mut self.step,
            );
        }
        self.rows = keep;
    }
}

/// Buffers for a chunk of up to `chunk` tokens.
pub struct KdaScratch {
    raw: [Vec<f32>; 3],  // [T, W] q, k, v projections before the conv
    conv: [Vec<f32>; 3], // [T, W] after conv + SiLU (q, k normalised in place)
    za: Vec<f32>,        // [T, head_dim]
    gate: Vec<f32>,      // [T, W]: z, then alpha
    beta: Vec<f32>,      // [T, heads]
    out_gate: Vec<f32>,  // [T, W]: sigmoid(g_proj x)
    heads_out: Vec<f32>, // [heads, T, V]
    step: Vec<f32>,      // [heads, V] kda_step scratch
    o: Vec<f32>,         // [T, W] gated, normalised output
    o_norm: Vec<f32>,    // [head_dim]
}

impl KdaScratch {
    pub fn new(cfg: &Config, chunk: usize, b: &mut impl Buffers) -> KdaScratch {
        let kd = &cfg.kda;
        let tw = chunk * kd.width();
        KdaScratch {
            raw: [b.zeros(tw), b.zeros(tw), b.zeros(tw)],
            conv: [b.zeros(tw), b.zeros(tw), b.zeros(tw)],
            za: b.zeros(chunk * kd.head_dim),
            gate: b.zeros(tw),
            beta: b.zeros(chunk * kd.n_heads),
            out_gate: b.zeros(tw),
            heads_out: b.zeros(tw),
            step: b.zeros(kd.n_heads * kd.head_dim),
            o: b.zeros(tw),
            o_norm: b.zeros(kd.head_dim),
        }
    }
}

/// The row-wise first half for the `t` rows of a step, whatever sequences they belong to:
/// the q, k, v projections, the decay gate alpha, beta and the output gate. Reads q, k, v,
/// f_a, f_b, b, g in that order ([`super::weights::LayerWeights::streamed`]).
///
/// # Errors
/// The view's, while it hands over the matrices' row blocks.
#[allow(clippy::too_many_arguments)]
pub fn project(
    k: &Kernels,
    meter: Meter<'_>,
    cfg: &Config,
    view: &dyn TrunkView,
    w: &KdaWeights,
    x: &[f32],
    t: usize,
    s: &mut KdaScratch,
) -> Result<(), SourceError> {
    let kd = &cfg.kda;
    let (width, hd, heads) = (kd.width(), kd.head_dim, kd.n_heads);
    let tw = t * width;
    let d = cfg.hidden_size;
    let mm = |m: &Mat, input: &[f32], y: &mut [f32]| {
        meter.bf16(k, OpClass::KdaProjections, view, Streamed::product(*m), input, t, y)
    };
    for (i, proj) in [&w.q_proj, &w.k_proj, &w.v_proj].into_iter().enumerate() {
        mm(proj, &x[..t * d], &mut s.raw[i][..tw])?;
    }
    // Gate: z = f_b(f_a x); g = lb * sigmoid(exp(A_log[h]) * (z + dt_bias)); alpha = exp(g).
    mm(&w.f_a_proj, &x[..t * d], &mut s.za[..t * hd])?;
    mm(&w.f_b_proj, &s.za[..t * hd], &mut s.gate[..tw])?;
    let (a_log, dt_bias) = (view.bytes(w.a_log.id), view.bytes(w.dt_bias.id));
    meter.time(OpClass::NormsActivations, a_log.len() + dt_bias.len(), || {
        for tok in 0..t {
            for h in 0..heads {
                let decay_rate = super::exp1(k, f32_at(a_log, h));
                for c in h * hd..(h + 1) * hd {
                    let z = &mut s.gate[tok * width + c];
                    *z = (*z + f32_at(dt_bias, c)) * decay_rate;
                }
            }
        }
        k.sigmoid(&mut s.gate[..tw]);
        k.scale(kd.gate_lower_bound, &mut s.gate[..tw]);
        k.exp(&mut s.gate[..tw]);
    });
    mm(&w.b_proj, &x[..t * d], &mut s.beta[..t * heads])?;
    meter.time(OpClass::NormsActivations, 0, || k.sigmoid(&mut s.beta[..t * heads]));
    mm(&w.g_proj, &x[..t * d], &mut s.out_gate[..tw])?;
    meter.time(OpClass::NormsActivations, 0, || k.sigmoid(&mut s.out_gate[..tw]));
    Ok(())
}

/// Weight bytes [`mix`] touches: the three conv kernels.
pub fn conv_weight_bytes(view: &dyn TrunkView, w: &KdaWeights) -> usize {
    [&w.q_conv1d, &w.k_conv1d, &w.v_conv1d].iter().map(|c| view.bytes(c.id).len()).sum()
}

/// The part that carries state, for the `rows` of a step (of `t` rows) that belong to the
/// sequence whose state is `st`: the causal short conv with its history, the per-head l2norm
/// and the delta-rule recurrence. Rows of other sequences are untouched.
#[allow(clippy::too_many_arguments)]
pub fn mix(
    k: &Kernels,
    cfg: &Config,
    view: &dyn TrunkView,
    w: &KdaWeights,
    st: &mut KdaState,
    rows: std::ops::Range<usize>,
    t: usize,
    s: &mut KdaScratch,
) {
    let kd = &cfg.kda;
    let (width, hd, heads) = (kd.width(), kd.head_dim, kd.n_heads);
    let span = rows.start * width..rows.end * width;
    for (i, conv_w) in [&w.q_conv1d, &w.k_conv1d, &w.v_conv1d].into_iter().enumerate() {
        let hist_len = width * (kd.conv_kernel_size - 1);
        let hist = &mut st.conv[i * hist_len..(i + 1) * hist_len];
        let (u, c) = (&s.raw[i][span.clone()], &mut s.conv[i][span.clone()]);
        short_conv(view.bytes(conv_w.id), kd.conv_kernel_size, width, rows.len(), u, hist, c);
        k.silu(c);
    }
    let q_scale = 1.0 / (hd as f32).sqrt();
    let [q, kk, v] = &mut s.conv;
    for tok in rows.clone() {
        for h in 0..heads {
            let r = tok * width + h * hd..tok * width + (h + 1) * hd;
            l2norm(k, &mut q[r.clone()], Some(q_scale));
            l2norm(k, &mut kk[r], None);
        }
    }
    recurrence(k, cfg, st, q, kk, v, &s.gate, &s.beta, rows, t, &mut s.heads_out, &mut s.step);
}

/// The row-wise second half for the `t` rows of a step: head-wise norm, output gate and the
/// output projection into `out` [t, D].
///
/// # Errors
/// The view's, while it hands over o_proj's row blocks.
#[allow(clippy::too_many_arguments)]
pub fn output(
    k: &Kernels,
    meter: Meter<'_>,
    cfg: &Config,
    view: &dyn TrunkView,
    w: &KdaWeights,
    t: usize,
    s: &mut KdaScratch,
    out: &mut [f32],
) -> Result<(), SourceError> {
    let kd = &cfg.kda;
    let (width, hd, heads) = (kd.width(), kd.head_dim, kd.n_heads);
    let d = cfg.hidden_size;
    // o' = RMSNorm_head(o; o_norm) * sigmoid(g_proj x), back to token-major [t, W].
    let o_norm_bytes = view.bytes(w.o_norm.id);
    meter.time(OpClass::NormsActivations, o_norm_bytes.len(), || {
        for (i, wn) in s.o_norm.iter_mut().enumerate() {
            *wn = f32_at(o_norm_bytes, i);
        }
        for tok in 0..t {
            for h in 0..heads {
                let src = &s.heads_out[(h * t + tok) * hd..(h * t + tok + 1) * hd];
                let r = tok * width + h * hd..tok * width + (h + 1) * hd;
                k.rmsnorm(src, &s.o_norm, cfg.rms_norm_eps, &mut s.o[r.clone()]);
                for (o, g) in s.o[r.clone()].iter_mut().zip(&s.out_gate[r]) {
                    *o *= *g;
                }
            }
        }
    });
    let o_proj = Streamed::product(w.o_proj);
    meter.bf16(k, OpClass::KdaProjections, view, o_proj, &s.o[..t * width], t, &mut out[..t * d])
}

/// Depthwise causal conv of width `kw` (no bias): c_t = sum_i W[ch, 0, i] * u_{t-kw+1+i}, tap
/// kw-1 the current token. `hist` holds the last kw-1 inputs per channel and is advanced.
/// Float contract: acc = acc + w * u over taps in increasing i from +0 (mul then add, no fma).
fn short_conv(weight: &[u8], kw: usize, width: usize, t: usize, u: &[f32], hist: &mut [f32], out: &mut [f32]) {
    let h = kw - 1;
    for c in 0..width {
        let past = &mut hist[c * h..(c + 1) * h];
        for tok in 0..t {
            let current = u[tok * width + c];
            let mut acc = 0.0f32;
            for (i, &input) in past.iter().chain(std::iter::once(&current)).enumerate() {
                acc += f32_at(weight, c * kw + i) * input;
            }
            out[tok * width + c] = acc;
            past.rotate_left(1);
            if h > 0 {
                past[h - 1] = u[tok * width + c];
            }
        }
    }
}

/// The history update of [`short_conv`] alone: after `t` inputs `u` ([t, width]), `hist` holds
/// the last `kw - 1` inputs per channel, oldest first.
fn advance_history(kw: usize, width: usize, t: usize, u: &[f32], hist: &mut [f32]) {
    let h = kw - 1;
    if h == 0 {
        return;
    }
    for c in 0..width {
        let past = &mut hist[c * h..(c + 1) * h];
        for tok in 0..t {
            past.rotate_left(1);
            past[h - 1] = u[tok * width + c];
        }
    }
}

/// x <- x / sqrt(sum(x^2) + 1e-6), then times `scale` when given.
fn l2norm(k: &Kernels, x: &mut [f32], scale: Option<f32>) {
    let inv = 1.0 / (k.sum_squares(x) + L2NORM_EPS).sqrt();
    k.scale(inv, x);
    if let Some(sc) = scale {
        k.scale(sc, x);
    }
}

/// The delta-rule recurrence over `rows` of a step of `t` rows, heads in parallel. Writes o to
/// `heads_out` as [heads, t, V].
#[allow(clippy::too_many_arguments)]
fn recurrence(
    k: &Kernels,
    cfg: &Config,
    st: &mut KdaState,
    q: &[f32],
    kk: &[f32],
    v: &[f32],
    alpha: &[f32],
    beta: &[f32],
    rows: std::ops::Range<usize>,
    t: usize,
    heads_out: &mut [f32],
    step: &mut [f32],
) {
    let kd = &cfg.kda;
    let (width, hd, heads) = (kd.width(), kd.head_dim, kd.n_heads);
    st.s.par_chunks_mut(hd * hd)
        .zip(heads_out[..heads * t * hd].par_chunks_mut(t * hd))
        .zip(step.par_chunks_mut(hd))
        .enumerate()
        .for_each(|(h, ((state, o), scratch))| {
            for tok in rows.clone() {
                let r = tok * width + h * hd..tok * width + (h + 1) * hd;
                k.kda_step(
                    state,
                    hd,
                    hd,
                    &alpha[r.clone()],
                    beta[tok * heads + h],
                    &kk[r.clone()],
                    &v[r.clone()],
                    &q[r],
                    &mut o[tok * hd..(tok + 1) * hd],
                    scratch,
                );
            }
        });
}
