//! Attention residuals (spec 5): the read R(p, B; w, g) over block snapshots and the partial sum.
//!
//! s_j = sum_d (v_j[d] / rms(v_j)) * g[d] * w[d]; pi = softmax(s); out = sum_j pi_j * v_j on the
//! RAW candidates. Per token, so chunked prefill and decode give the same bits.
//! Float contract: s_j = canonical_dot(v_j, g*w) * (1 / sqrt(sum_squares(v_j)/D + 1e-5)); the
//! output accumulates candidates oldest first with fma, starting from +0.

use kernels::Kernels;

use super::buffers::Buffers;
use super::weights::{vector_into, ResWeights, TrunkView};
use crate::config::ATTN_RES_EPS;

/// Buffers for one read, sized once.
pub struct ResScratch {
    /// g * w, [D].
    gw: Vec<f32>,
    /// One score per candidate.
    scores: Vec<f32>,
    /// g as f32, [D].
    tmp: Vec<f32>,
}

impl ResScratch {
    pub fn new(hidden: usize, max_candidates: usize, b: &mut impl Buffers) -> ResScratch {
        ResScratch { gw: b.zeros(hidden), scores: b.zeros(max_candidates), tmp: b.zeros(hidden) }
    }
}

/// Weight bytes one read touches (its norm and projection vectors).
pub fn weight_bytes(view: &dyn TrunkView, w: &ResWeights) -> usize {
    view.bytes(w.norm.id).len() + view.bytes(w.proj.id).len()
}

/// Reads the residual stream for `t` tokens into `out` ([t, D]).
/// `snapshots[j]` and `partial` hold [t, D] first (row stride D); the candidates are the snapshots,
/// oldest first, then the partial sum.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    k: &Kernels,
    view: &dyn TrunkView,
    w: &ResWeights,
    snapshots: &[Vec<f32>],
    partial: &[f32],
    t: usize,
    hidden: usize,
    s: &mut ResScratch,
    out: &mut [f32],
) {
    let candidates = Candidates { snapshots, newest: None, partial };
    read(k, view, w, &candidates, t, hidden, s, out);
}

/// Like [`forward`] with one more snapshot, `newest`, after `snapshots`: the read a block start
/// will make, computed before its snapshot is taken (the pipeline's predictions).
#[allow(clippy::too_many_arguments)]
pub fn forward_with_newest(
    k: &Kernels,
    view: &dyn TrunkView,
    w: &ResWeights,
    snapshots: &[Vec<f32>],
    newest: &[f32],
    partial: &[f32],
    t: usize,
    hidden: usize,
    s: &mut ResScratch,
    out: &mut [f32],
) {
    let candidates = Candidates { snapshots, newest: Some(newest), partial };
    read(k, view, w, &candidates, t, hidden, s, out);
}

/// The candidates of one read, oldest first: the snapshots, an optional newest one, the
/// partial sum.
struct Candidates<'a> {
    snapshots: &'a [Vec<f32>],
    newest: Option<&'a [f32]>,
    partial: &'a [f32],
}

impl Candidates<'_> {
    fn count(&self) -> usize {
        self.snapshots.len() + usize::from(self.newest.is_some()) + 1
    }

    /// Row `row` of candidate `j`.
    fn row(&self, j: usize, row: std::ops::Range<usize>) -> &[f32] {
        let n = self.snapshots.len();
        match (j.checked_sub(n), self.newest) {
            (None, _) => &self.snapshots[j][row],
            (Some(0), Some(newest)) => &newest[row],
            _ => &self.partial[row],
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn read(
    k: &Kernels,
    view: &dyn TrunkView,
    w: &ResWeights,
    c: &Candidates<'_>,
    t: usize,
    hidden: usize,
    s: &mut ResScratch,
    out: &mut [f32],
) {
    let n = c.count();
    assert!(n <= s.scores.len(), "more residual candidates than scratch slots");
    let gw = &mut s.gw[..hidden];
    vector_into(view.bytes(w.norm.id), w.norm.dtype, &mut s.tmp[..hidden]);
    vector_into(view.bytes(w.proj.id), w.proj.dtype, gw);
    for (g, x) in gw.iter_mut().zip(&s.tmp[..hidden]) {
        *g *= *x;
    }
    for tok in 0..t {
        let row = tok * hidden..(tok + 1) * hidden;
        let scores = &mut s.scores[..n];
        for (j, score) in scores.iter_mut().enumerate() {
            let v = c.row(j, row.clone());
            let inv_rms = 1.0 / (k.sum_squares(v) / hidden as f32 + ATTN_RES_EPS).sqrt();
            *score = k.dot(v, gw) * inv_rms;
        }
        k.softmax(scores);
        let o = &mut out[row.clone()];
        o.fill(0.0);
        for j in 0..n {
            k.axpy(s.scores[j], c.row(j, row.clone()), o);
        }
    }
}
