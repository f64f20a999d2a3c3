//! The ends of the network: the embedding lookup, and the output aggregator (a last
//! attention-residual read), the final RMSNorm and the untied lm_head (spec 5).

use kernels::Kernels;

use super::attn_res::{self, ResScratch};
use super::attribution::{Meter, OpClass};
use super::buffers::Buffers;
use super::weights::{vector_into, GlobalWeights, Streamed, TrunkView, WeightSource};
use super::ModelError;
use crate::config::Config;

/// Writes the embedding rows of `tokens` into `out` ([t, D]); `rows` is byte scratch of at
/// least t * D * 2.
pub fn embed<S: WeightSource>(
    cfg: &Config,
    src: &S,
    w: &GlobalWeights,
    tokens: &[u32],
    rows: &mut [u8],
    out: &mut [f32],
) -> Result<(), ModelError> {
    let d = cfg.hidden_size;
    if let Some(&id) = tokens.iter().find(|&&id| id as usize >= w.embed_tokens.rows) {
        return Err(ModelError::TokenOutOfRange { id: id as usize, vocab: w.embed_tokens.rows });
    }
    let rows = &mut rows[..tokens.len() * d * 2];
    src.embed_rows(&w.embed_tokens, tokens, rows)?;
    for (o, b) in out[..tokens.len() * d].iter_mut().zip(rows.chunks_exact(2)) {
        *o = kernels::bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
    }
    Ok(())
}

/// Buffers of the head for a chunk of up to `chunk` tokens.
pub struct HeadScratch {
    h: Vec<f32>,      // [T, D]
    hn: Vec<f32>,     // [T, D]
    norm_w: Vec<f32>, // [D]
    pub res: ResScratch,
}

impl HeadScratch {
    pub fn new(cfg: &Config, chunk: usize, max_candidates: usize, b: &mut impl Buffers) -> HeadScratch {
        let d = cfg.hidden_size;
        HeadScratch {
            h: b.zeros(chunk * d),
            hn: b.zeros(chunk * d),
            norm_w: b.zeros(d),
            res: ResScratch::new(d, max_candidates, b),
        }
    }
}

/// Computes the final hidden state of the chunk's tokens and the logits of the tokens `rows`
/// (in that order) into `logits` ([rows.len(), V]). Returns h (debug probes).
///
/// # Errors
/// The view's, while it hands over lm_head's row blocks.
#[allow(clippy::too_many_arguments)]
pub fn forward<'a>(
    k: &Kernels,
    meter: Meter<'_>,
    cfg: &Config,
    view: &dyn TrunkView,
    w: &GlobalWeights,
    snapshots: &[Vec<f32>],
    partial: &[f32],
    t: usize,
    rows: &[usize],
    s: &'a mut HeadScratch,
    logits: &mut [f32],
) -> Result<&'a [f32], ModelError> {
    let d = cfg.hidden_size;
    meter.time(OpClass::ResidualReads, attn_res::weight_bytes(view, &w.output_res), || {
        attn_res::forward(k, view, &w.output_res, snapshots, partial, t, d, &mut s.res, &mut s.h[..t * d])
    });
    let norm = view.bytes(w.norm.id);
    meter.time(OpClass::NormsActivations, norm.len(), || {
        vector_into(norm, w.norm.dtype, &mut s.norm_w);
        // Gathered into consecutive rows of hn: the product's rows do not depend on their neighbours.
        for (i, &tok) in rows.iter().enumerate() {
            k.rmsnorm(&s.h[tok * d..(tok + 1) * d], &s.norm_w, cfg.rms_norm_eps, &mut s.hn[i * d..(i + 1) * d]);
        }
    });
    let n = rows.len();
    let head = Streamed::product(w.lm_head);
    let y = &mut logits[..n * w.lm_head.rows];
    meter.bf16(k, OpClass::LmHead, view, head, &s.hn[..n * d], n, y)?;
    Ok(&s.h[..t * d])
}
