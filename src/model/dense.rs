//! SiTU-GLU MLP (spec 5): down(SiTU-GLU(gate x, up x)). The dense FFN of layer 0 and, at width
//! 2F, the fused shared experts of every MoE layer.

use kernels::Kernels;

use super::buffers::Buffers;
use super::weights::{DenseWeights, TrunkView};
use crate::config::Config;

/// Buffers for a chunk of up to `chunk` tokens at hidden width `width`.
pub struct GluScratch {
    gate: Vec<f32>, // [T, I]
    up: Vec<f32>,   // [T, I]
    act: Vec<f32>,  // [T, I]
    beta: (f32, Option<f32>),
}

impl GluScratch {
    pub fn new(cfg: &Config, chunk: usize, width: usize, b: &mut impl Buffers) -> GluScratch {
        let n = chunk * width;
        GluScratch { gate: b.zeros(n), up: b.zeros(n), act: b.zeros(n), beta: (cfg.situ_beta, cfg.situ_linear_beta) }
    }
}

/// `out` [t, D] = down(SiTU-GLU(gate x, up x)) for `x` [t, D].
#[allow(clippy::too_many_arguments)]
pub fn glu_mlp(
    k: &Kernels,
    view: &dyn TrunkView,
    w: &DenseWeights,
    x: &[f32],
    t: usize,
    hidden: usize,
    s: &mut GluScratch,
    out: &mut [f32],
) {
    let inter = w.gate_proj.rows;
    let n = t * inter;
    assert!(s.gate.len() >= n, "GLU scratch sized for a narrower MLP");
    let xs = &x[..t * hidden];
    k.par_matmul_bf16(view.bytes(w.gate_proj.id), inter, hidden, xs, t, &mut s.gate[..n]);
    k.par_matmul_bf16(view.bytes(w.up_proj.id), inter, hidden, xs, t, &mut s.up[..n]);
    k.situ_glu(&s.gate[..n], &s.up[..n], s.beta.0, s.beta.1, &mut s.act[..n]);
    k.par_matmul_bf16(view.bytes(w.down_proj.id), hidden, inter, &s.act[..n], t, &mut out[..t * hidden]);
}
