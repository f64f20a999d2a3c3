//! SiTU-GLU MLP (spec 5): down(SiTU-GLU(gate x, up x)). The dense FFN of layer 0 and, at width
//! 2F, the fused shared experts of every MoE layer.

use kernels::Kernels;

use super::attribution::{Meter, OpClass};
use super::buffers::Buffers;
use super::weights::{DenseWeights, SourceError, Streamed, TrunkView};
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

/// `out` [t, D] = down(SiTU-GLU(gate x, up x)) for `x` [t, D]. The products count to `class`
/// of `meter` (dense FFN or shared experts), the activation to the norms and activations.
/// Reads gate, up, down in that order ([`super::weights::LayerWeights::streamed`]).
///
/// # Errors
/// The view's, while it hands over the matrices' row blocks.
#[allow(clippy::too_many_arguments)]
pub fn glu_mlp(
    k: &Kernels,
    (meter, class): (Meter<'_>, OpClass),
    view: &dyn TrunkView,
    w: &DenseWeights,
    x: &[f32],
    t: usize,
    hidden: usize,
    s: &mut GluScratch,
    out: &mut [f32],
) -> Result<(), SourceError> {
    let inter = w.gate_proj.rows;
    let n = t * inter;
    assert!(s.gate.len() >= n, "GLU scratch sized for a narrower MLP");
    let xs = &x[..t * hidden];
    meter.bf16(k, class, view, Streamed::product(w.gate_proj), xs, t, &mut s.gate[..n])?;
    meter.bf16(k, class, view, Streamed::product(w.up_proj), xs, t, &mut s.up[..n])?;
    meter.time(OpClass::NormsActivations, 0, || {
        k.situ_glu(&s.gate[..n], &s.up[..n], s.beta.0, s.beta.1, &mut s.act[..n])
    });
    meter.bf16(k, class, view, Streamed::product(w.down_proj), &s.act[..n], t, &mut out[..t * hidden])
}
