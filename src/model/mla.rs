//! Gated MLA without rotation (spec 5, Gated MLA), computed from the latent cache.
//!
//! Only the 576 values [RMSNorm(c_kv) | k_r] per position are cached. kv_b_proj is absorbed:
//! the query side uses q_lat = W_kb^T q_nope, so q_nope . k_nope_s = q_lat . c_s; the output side
//! sums probabilities over cached latents and expands once per head with W_vb.
//! Score scale is (nope + shared)^-0.5 (192 in K3). Heads run in parallel; each head's reduction
//! order is fixed, so results never depend on the thread count or on the chunk size.

use kernels::Kernels;
use rayon::prelude::*;

use super::attribution::{Meter, OpClass};
use super::buffers::Buffers;
use super::weights::{vector_into, BlockCheck, Mat, MlaWeights, SourceError, Streamed, TrunkView};
use super::ModelError;
use crate::config::{Config, MLA_LATENT_NORM_EPS};

/// The latent cache of one MLA layer: [capacity, kv_lora + rope].
pub struct MlaCache {
    data: Vec<f32>,
    width: usize,
    len: usize,
}

impl MlaCache {
    pub fn new(cfg: &Config, capacity: usize) -> MlaCache {
        let width = cfg.mla.cache_width();
        MlaCache { data: vec![0.0; capacity * width], width, len: 0 }
    }

    /// Bytes of a cache holding `positions` positions.
    pub fn bytes(cfg: &Config, positions: usize) -> u64 {
        4 * (positions * cfg.mla.cache_width()) as u64
    }

    /// Back to the start of a sequence (old entries are never read past `len`).
    pub fn reset(&mut self) {
        self.len = 0;
    }

    /// Appends the cache's length, width and its `len` rows (see
    /// [`super::ModelState::save_into`]); rows past `len` are never read, so not saved.
    pub fn save_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&(self.width as u64).to_le_bytes());
        super::put_f32s(out, &self.data[..self.len * self.width]);
    }

    /// Reads what [`MlaCache::save_into`] wrote; its length must be `pos`, the position of the
    /// whole state (every MLA layer caches every position).
    pub fn load_from(&mut self, bytes: &mut &[u8], pos: usize) -> Result<(), String> {
        let width = super::take_u64(bytes)?;
        if width != self.width as u64 {
            return Err(format!("MLA cache rows of {width} values where this model has {}", self.width));
        }
        if pos > self.capacity() {
            return Err(format!("MLA cache of {pos} positions, beyond the {} this session holds", self.capacity()));
        }
        super::take_f32s(bytes, &mut self.data[..pos * self.width]).map_err(|e| format!("MLA cache: {e}"))?;
        self.len = pos;
        Ok(())
    }

    pub fn capacity(&self) -> usize {
        self.data.len() / self.width
    }

    /// The cached rows, `len x width` values ([`super::snapshot`]).
    pub(super) fn rows(&self) -> &[f32] {
        &self.data[..self.len * self.width]
    }

    /// Sets the cache to `rows` (whole rows); false when they are not whole rows or do not fit.
    pub(super) fn set_rows(&mut self, rows: &[f32]) -> bool {
        if !rows.len().is_multiple_of(self.width) || rows.len() > self.data.len() {
            return false;
        }
        self.data[..rows.len()].copy_from_slice(rows);
        self.len = rows.len() / self.width;
        true
    }

    /// Keeps the first `len` positions (rows past it are never read).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// Buffers for a chunk of up to `chunk` tokens and a context of up to `capacity` positions.
pub struct MlaScratch {
    cq: Vec<f32>,        // [T, q_lora]
    cqn: Vec<f32>,       // [T, q_lora]
    q: Vec<f32>,         // [T, heads * (nope + rope)]
    ckv: Vec<f32>,       // [T, kv_lora + rope]
    gate: Vec<f32>,      // [T, heads * v]
    heads_out: Vec<f32>, // [heads, T, v]
    per_head: Vec<f32>,  // [heads, 2 * kv_lora + capacity]
    o: Vec<f32>,         // [T, heads * v]
    norm_w: Vec<f32>,    // [max(q_lora, kv_lora)]
}

impl MlaScratch {
    pub fn new(cfg: &Config, chunk: usize, capacity: usize, b: &mut impl Buffers) -> MlaScratch {
        let m = &cfg.mla;
        let hv = m.n_heads * m.v_head_dim;
        MlaScratch {
            cq: b.zeros(chunk * m.q_lora_rank),
            cqn: b.zeros(chunk * m.q_lora_rank),
            q: b.zeros(chunk * m.n_heads * m.qk_head_dim()),
            ckv: b.zeros(chunk * m.cache_width()),
            gate: b.zeros(chunk * hv),
            heads_out: b.zeros(chunk * hv),
            per_head: b.zeros(m.n_heads * (2 * m.kv_lora_rank + capacity)),
            o: b.zeros(chunk * hv),
            norm_w: b.zeros(m.q_lora_rank.max(m.kv_lora_rank)),
        }
    }
}

/// The row-wise first half for the `t` rows of a step, whatever sequences they belong to: the
/// query path, the latent rows (not yet normalised or cached) and the output gate. Reads q_a,
/// q_b, kv_a, g in that order ([`super::weights::LayerWeights::streamed`]).
///
/// # Errors
/// The view's, while it hands over the matrices' row blocks.
#[allow(clippy::too_many_arguments)]
pub fn project(
    k: &Kernels,
    meter: Meter<'_>,
    cfg: &Config,
    view: &dyn TrunkView,
    w: &MlaWeights,
    x: &[f32],
    t: usize,
    s: &mut MlaScratch,
) -> Result<(), SourceError> {
    let m = &cfg.mla;
    let d = cfg.hidden_size;
    let qlr = m.q_lora_rank;
    let hv = m.n_heads * m.v_head_dim;
    let mm = |mat: &Mat, input: &[f32], y: &mut [f32]| {
        meter.bf16(k, OpClass::MlaProjections, view, Streamed::product(*mat), input, t, y)
    };
    mm(&w.q_a_proj, &x[..t * d], &mut s.cq[..t * qlr])?;
    let q_norm = view.bytes(w.q_a_layernorm.id);
    meter.time(OpClass::NormsActivations, q_norm.len(), || {
        vector_into(q_norm, w.q_a_layernorm.dtype, &mut s.norm_w[..qlr]);
        for tok in 0..t {
            let r = tok * qlr..(tok + 1) * qlr;
            k.rmsnorm(&s.cq[r.clone()], &s.norm_w[..qlr], MLA_LATENT_NORM_EPS, &mut s.cqn[r]);
        }
    });
    mm(&w.q_b_proj, &s.cqn[..t * qlr], &mut s.q[..t * m.n_heads * m.qk_head_dim()])?;
    mm(&w.kv_a_proj_with_mqa, &x[..t * d], &mut s.ckv[..t * m.cache_width()])?;
    mm(&w.g_proj, &x[..t * d], &mut s.gate[..t * hv])?;
    meter.time(OpClass::NormsActivations, 0, || k.sigmoid(&mut s.gate[..t * hv]));
    Ok(())
}

/// Appends the normalised latents of the `rows` of a step that belong to one sequence to its
/// cache, at positions cache.len()..; [`attend`] then reads them. Rows of other sequences are
/// untouched.
#[allow(clippy::too_many_arguments)]
pub fn append(
    k: &Kernels,
    meter: Meter<'_>,
    cfg: &Config,
    view: &dyn TrunkView,
    w: &MlaWeights,
    cache: &mut MlaCache,
    rows: std::ops::Range<usize>,
    s: &mut MlaScratch,
) -> Result<(), ModelError> {
    let m = &cfg.mla;
    let klr = m.kv_lora_rank;
    let start = cache.len;
    if start + rows.len() > cache.capacity() {
        return Err(ModelError::ContextFull { capacity: cache.capacity() });
    }
    let cw = m.cache_width();
    let kv_norm = view.bytes(w.kv_a_layernorm.id);
    meter.time(OpClass::NormsActivations, kv_norm.len(), || {
        vector_into(kv_norm, w.kv_a_layernorm.dtype, &mut s.norm_w[..klr]);
        for (i, tok) in rows.clone().enumerate() {
            let row = &s.ckv[tok * cw..(tok + 1) * cw];
            let dst = &mut cache.data[(start + i) * cw..(start + i + 1) * cw];
            k.rmsnorm(&row[..klr], &s.norm_w[..klr], MLA_LATENT_NORM_EPS, &mut dst[..klr]);
            dst[klr..].copy_from_slice(&row[klr..]);
        }
    });
    cache.len = start + rows.len();
    Ok(())
}

/// Calls its argument with each sequence of a step: its latent cache and its rows of the step.
pub type EachSequence<'a> = dyn Fn(&mut dyn FnMut(&MlaCache, std::ops::Range<usize>)) + 'a;

/// Causal attention of every sequence of the step over its own cache, once [`append`] has
/// added the step's latents: `seqs` gives each sequence's cache and its rows of the step (of `t`
/// rows), whose latents are the cache's last. kv_b_proj is read once for all of them, block by
/// block of whole heads as the view hands it over; each block's heads are computed for every
/// sequence before the next block (a head's result does not depend on the other heads).
///
/// # Errors
/// The view's, while it hands over kv_b_proj's row blocks.
#[allow(clippy::too_many_arguments)]
pub fn attend_all(
    k: &Kernels,
    meter: Meter<'_>,
    cfg: &Config,
    view: &dyn TrunkView,
    w: &MlaWeights,
    seqs: &EachSequence<'_>,
    t: usize,
    s: &mut MlaScratch,
) -> Result<(), ModelError> {
    let kv_b = Streamed::kv_b(cfg, w.kv_b_proj);
    let head_rows = kv_b.granule;
    let mut check = BlockCheck::new(kv_b);
    let mut nanos = 0u64;
    view.row_blocks(&w.kv_b_proj, &mut |rows, bytes| {
        if !check.admit(&rows, bytes) {
            return;
        }
        // Whole heads: the check admitted only multiples of the granule, and the matrix is
        // heads x head_rows, so the last block ends on a head too.
        let heads = rows.start / head_rows..rows.end.div_ceil(head_rows);
        meter.lap(&mut nanos, || {
            seqs(&mut |cache, rows| {
                let start = cache.len - rows.len();
                attend(k, cfg, bytes, heads.clone(), cache, start, rows, t, &s.q, &mut s.heads_out, &mut s.per_head);
            })
        });
    })?;
    check.finish()?;
    let m = &w.kv_b_proj;
    meter.record(OpClass::MlaAttention, nanos, m.rows * m.cols * 2);
    Ok(())
}

/// The row-wise second half for the `t` rows of a step: output gate and projection into `out`.
///
/// # Errors
/// The view's, while it hands over o_proj's row blocks.
#[allow(clippy::too_many_arguments)]
pub fn output(
    k: &Kernels,
    meter: Meter<'_>,
    cfg: &Config,
    view: &dyn TrunkView,
    w: &MlaWeights,
    t: usize,
    s: &mut MlaScratch,
    out: &mut [f32],
) -> Result<(), SourceError> {
    let m = &cfg.mla;
    let d = cfg.hidden_size;
    let hv = m.n_heads * m.v_head_dim;
    meter.time(OpClass::NormsActivations, 0, || {
        for tok in 0..t {
            for h in 0..m.n_heads {
                let src = &s.heads_out[(h * t + tok) * m.v_head_dim..(h * t + tok + 1) * m.v_head_dim];
                let r = tok * hv + h * m.v_head_dim..tok * hv + (h + 1) * m.v_head_dim;
                for ((o, v), g) in s.o[r.clone()].iter_mut().zip(src).zip(&s.gate[r]) {
                    *o = *v * *g;
                }
            }
        }
    });
    let o_proj = Streamed::product(w.o_proj);
    meter.bf16(k, OpClass::MlaProjections, view, o_proj, &s.o[..t * hv], t, &mut out[..t * d])
}

/// Causal attention over the latent cache for `rows` of a step of `t` rows, whose latents sit
/// at positions `start..` of the cache, for the heads `heads`, whose rows of kv_b_proj are
/// `kv_b`; heads in parallel; writes their part of [heads, t, v].
#[allow(clippy::too_many_arguments)]
fn attend(
    k: &Kernels,
    cfg: &Config,
    kv_b: &[u8],
    heads: std::ops::Range<usize>,
    cache: &MlaCache,
    start: usize,
    rows: std::ops::Range<usize>,
    t: usize,
    q: &[f32],
    heads_out: &mut [f32],
    per_head: &mut [f32],
) {
    let m = &cfg.mla;
    let (klr, nope, v_dim) = (m.kv_lora_rank, m.qk_nope_head_dim, m.v_head_dim);
    let qk = m.qk_head_dim();
    let cw = m.cache_width();
    let scale = m.softmax_scale();
    let rows_per_head = nope + v_dim;
    let row_bytes = 2 * klr;
    let head_scratch = 2 * klr + cache.capacity();
    heads_out[heads.start * t * v_dim..heads.end * t * v_dim]
        .par_chunks_mut(t * v_dim)
        .zip(per_head[heads.start * head_scratch..heads.end * head_scratch].par_chunks_mut(head_scratch))
        .enumerate()
        .for_each(|(h, (o, scratch))| {
            // `h` counts from the block's first head, as do the block's rows in `kv_b`; `qh`
            // needs the head's index in the model.
            let head = heads.start + h;
            let w_kb = &kv_b[h * rows_per_head * row_bytes..(h * rows_per_head + nope) * row_bytes];
            let w_vb = &kv_b[(h * rows_per_head + nope) * row_bytes..(h + 1) * rows_per_head * row_bytes];
            let (q_lat, rest) = scratch.split_at_mut(klr);
            let (o_lat, scores) = rest.split_at_mut(klr);
            for (i, tok) in rows.clone().enumerate() {
                let qh = &q[(tok * m.n_heads + head) * qk..(tok * m.n_heads + head + 1) * qk];
                let (q_nope, q_shared) = qh.split_at(nope);
                k.matvec_t_bf16(w_kb, nope, klr, q_nope, q_lat);
                let n_pos = start + i + 1;
                for (sc, pos) in scores[..n_pos].iter_mut().zip(0..n_pos) {
                    let c = &cache.data[pos * cw..(pos + 1) * cw];
                    *sc = (k.dot(q_lat, &c[..klr]) + k.dot(q_shared, &c[klr..])) * scale;
                }
                k.softmax(&mut scores[..n_pos]);
                o_lat.fill(0.0);
                for (pos, &p) in scores[..n_pos].iter().enumerate() {
                    k.axpy(p, &cache.data[pos * cw..pos * cw + klr], o_lat);
                }
                k.matmul_bf16(w_vb, v_dim, klr, o_lat, 1, &mut o[tok * v_dim..(tok + 1) * v_dim]);
            }
        });
}
