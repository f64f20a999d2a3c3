//! Stable LatentMoE (spec 5): sigmoid router in f32, bias for selection only, renormalised
//! weights, latent down projection, routed experts on MXFP4 bytes, weighted sum in the fixed
//! top-k order, RMSNorm of the aggregate, up projection, shared experts on the original input.
//!
//! Each distinct expert chosen by any token of the chunk is fetched once and applied to all the
//! tokens that chose it (the matmul kernels are batch invariant, so this equals per-token work
//! bit for bit). Each token's sum still runs in its own top-k order, whatever order the experts
//! were fetched or computed in.

use std::ops::Range;

use kernels::{KernelError, Kernels};

use super::attribution::{Meter, OpClass};
use super::buffers::Buffers;
use super::dense::{self, GluScratch};
use super::expert_check::{CheckScratch, ProductChecksum};
use super::weights::{
    f32_at, vector_into, ExpertBytes, ExpertView, MoeWeights, SourceError, Streamed, TrunkView, WeightSource,
};
use super::ModelError;
use crate::config::Config;
use crate::trace::{ComputeOp, SpanArgs, Tracer};

/// Renormalisation guard added to the weight sum (spec 5, step 3).
const RENORM_EPS: f32 = 1e-20;

/// The spans of the compute a layer's expert reads can overlap without routing prediction:
/// the reads start after the router has chosen, and must be done before the weighted sum
/// (`ComputeOp::LatentUp`) and the next layer. Counting every routed expert is generous (the last
/// expert read cannot overlap that expert's own compute), so a floor built on it stays a
/// lower bound.
pub const SPANS_READS_CAN_OVERLAP: [ComputeOp; 2] = [ComputeOp::SharedExperts, ComputeOp::Expert];

/// The routing decision of one token: experts in the fixed top-k order and their weights.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Route {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Buffers for a chunk of up to `chunk` tokens.
pub struct MoeScratch {
    scores: Vec<f32>,       // [T, E] sigmoid router scores
    biased: Vec<f32>,       // [E]
    bias: Vec<f32>,         // [E]
    pub routes: Vec<Route>, // [T]
    u: Vec<f32>,            // [T, LAT]
    slot_out: Vec<f32>,     // [T, k, LAT] expert outputs per (token, slot)
    expert: ExpertBuffers,
    check: CheckScratch,
    users: Vec<(usize, usize)>, // (token, slot) pairs for one expert
    distinct: Vec<usize>,
    y: Vec<f32>,      // [T, LAT]
    yn: Vec<f32>,     // [T, LAT]
    norm_w: Vec<f32>, // [LAT]
    up: Vec<f32>,     // [T, D]
    glu: GluScratch,
}

/// One expert's products' buffers.
struct ExpertBuffers {
    gathered: Vec<f32>, // [T, LAT] inputs of the tokens that chose the expert
    h1: Vec<f32>,       // [T, F]
    h3: Vec<f32>,       // [T, F]
    act: Vec<f32>,      // [T, F]
    eo: Vec<f32>,       // [T, LAT]
}

impl MoeScratch {
    pub fn new(cfg: &Config, chunk: usize, b: &mut impl Buffers) -> MoeScratch {
        let m = &cfg.moe;
        let (lat, f, e) = (m.latent, m.expert_hidden, m.n_experts);
        MoeScratch {
            scores: b.zeros(chunk * e),
            biased: b.zeros(e),
            bias: b.zeros(e),
            routes: b.each(chunk, |b| Route { experts: b.with_capacity(m.top_k), weights: b.with_capacity(m.top_k) }),
            u: b.zeros(chunk * lat),
            slot_out: b.zeros(chunk * m.top_k * lat),
            expert: ExpertBuffers {
                gathered: b.zeros(chunk * lat),
                h1: b.zeros(chunk * f),
                h3: b.zeros(chunk * f),
                act: b.zeros(chunk * f),
                eo: b.zeros(chunk * lat),
            },
            check: CheckScratch::new(cfg, b),
            users: b.with_capacity(chunk * m.top_k),
            distinct: b.with_capacity(chunk * m.top_k),
            y: b.zeros(chunk * lat),
            yn: b.zeros(chunk * lat),
            norm_w: b.zeros(lat),
            up: b.zeros(chunk * cfg.hidden_size),
            glu: GluScratch::new(cfg, chunk, m.shared_hidden(), b),
        }
    }
}

/// What watches the MoE block: the trace's spans and the attribution's meter (either may be off).
#[derive(Clone, Copy, Default)]
pub struct Observers<'a> {
    pub tracer: Option<&'a Tracer>,
    pub meter: Meter<'a>,
}

/// Runs the MoE block of `layer` for `t` tokens: `x` normalised input [t, D], `out` [t, D].
#[allow(clippy::too_many_arguments)]
pub fn forward<S: WeightSource>(
    k: &Kernels,
    cfg: &Config,
    view: &dyn TrunkView,
    src: &S,
    layer: usize,
    w: &MoeWeights,
    x: &[f32],
    t: usize,
    s: &mut MoeScratch,
    out: &mut [f32],
    obs: Observers<'_>,
) -> Result<(), ModelError> {
    let (tracer, meter) = (obs.tracer, obs.meter);
    let m = &cfg.moe;
    let d = cfg.hidden_size;
    let (lat, e) = (m.latent, m.n_experts);
    let router_span = tracer.map(|t| t.span_args(ComputeOp::Router, SpanArgs::new().layer(layer as u32)));
    let bias = view.bytes(w.e_score_correction_bias.id);
    let gate_bytes = w.gate.rows * w.gate.cols * 2;
    // The region holds the gate's product whole (with any wait for its blocks): it is small
    // next to the experts, and the router's time has always been one region.
    meter.time(OpClass::Router, gate_bytes + bias.len(), || {
        router_scores(k, view, w, &x[..t * d], t, &mut s.scores[..t * e])?;
        for (i, b) in s.bias.iter_mut().enumerate() {
            *b = f32_at(bias, i);
        }
        for tok in 0..t {
            route(cfg, layer, tok, &s.scores[tok * e..(tok + 1) * e], &s.bias, &mut s.biased, &mut s.routes[tok])?;
        }
        distinct_experts(&s.routes[..t], &mut s.distinct);
        Ok::<(), ModelError>(())
    })?;
    drop(router_span);
    // Start the expert reads first, then do the work that does not need them (the shared
    // experts and the latent down projection) while they are in flight.
    src.request(layer, &mut s.distinct);
    let shared_span = tracer.map(|t| t.span_args(ComputeOp::SharedExperts, SpanArgs::new().layer(layer as u32)));
    if let Some(shared) = &w.shared {
        dense::glu_mlp(k, (meter, OpClass::SharedExperts), view, shared, x, t, d, &mut s.glu, &mut s.up[..t * d])?;
    }
    let down = Streamed::product(w.routed_expert_down_proj);
    meter.bf16(k, OpClass::LatentProjections, view, down, &x[..t * d], t, &mut s.u[..t * lat])?;
    drop(shared_span);
    for i in 0..s.distinct.len() {
        run_expert(k, cfg, src, layer, s.distinct[i], t, s, obs)?;
    }
    let _latent_span = tracer.map(|t| t.span_args(ComputeOp::LatentUp, SpanArgs::new().layer(layer as u32)));
    let norm = view.bytes(w.routed_expert_norm.id);
    meter.time(OpClass::NormsActivations, norm.len(), || {
        // y_t = sum_i w_i E_i(u_t) in the token's own top-k order.
        for tok in 0..t {
            let y = &mut s.y[tok * lat..(tok + 1) * lat];
            y.fill(0.0);
            for (slot, &wt) in s.routes[tok].weights.iter().enumerate() {
                let base = (tok * m.top_k + slot) * lat;
                k.axpy(wt, &s.slot_out[base..base + lat], y);
            }
        }
        vector_into(norm, w.routed_expert_norm.dtype, &mut s.norm_w);
        for tok in 0..t {
            let r = tok * lat..(tok + 1) * lat;
            k.rmsnorm(&s.y[r.clone()], &s.norm_w, cfg.rms_norm_eps, &mut s.yn[r]);
        }
    });
    let up = Streamed::product(w.routed_expert_up_proj);
    meter.bf16(k, OpClass::LatentProjections, view, up, &s.yn[..t * lat], t, &mut out[..t * d])?;
    if w.shared.is_some() {
        for (o, sh) in out[..t * d].iter_mut().zip(&s.up[..t * d]) {
            *o += *sh;
        }
    }
    Ok(())
}

/// The router's sigmoid scores of `t` tokens ([t, E]) for the normalised input `x` ([t, D]).
///
/// # Errors
/// The view's, while it hands over the gate's row blocks.
pub fn router_scores(
    k: &Kernels,
    view: &dyn TrunkView,
    w: &MoeWeights,
    x: &[f32],
    t: usize,
    scores: &mut [f32],
) -> Result<(), SourceError> {
    super::attribution::bf16_product(k, view, Streamed::product(w.gate), x, t, scores)?;
    k.sigmoid(scores);
    Ok(())
}

/// The `n` largest of `biased` in descending order into `out` (ties: the lower index first),
/// by repeated selection: each chosen entry is set to -inf. The one top-k of routing and of the
/// pipeline's predictions.
pub fn top_k(biased: &mut [f32], n: usize, out: &mut Vec<usize>) {
    out.clear();
    for _ in 0..n {
        let mut best: Option<usize> = None;
        for (e, &b) in biased.iter().enumerate() {
            if best.is_none_or(|i| b > biased[i]) {
                best = Some(e);
            }
        }
        let Some(e) = best else { break };
        out.push(e);
        biased[e] = f32::NEG_INFINITY;
    }
}

/// Top-k by biased score (ties: lower expert id first), weights from the unbiased scores.
fn route(
    cfg: &Config,
    layer: usize,
    tok: usize,
    scores: &[f32],
    bias: &[f32],
    biased: &mut [f32],
    out: &mut Route,
) -> Result<(), ModelError> {
    let m = &cfg.moe;
    for ((b, &s), &c) in biased.iter_mut().zip(scores).zip(bias) {
        if !s.is_finite() || !c.is_finite() {
            return Err(ModelError::NonFinite { layer, what: format!("router score of token {tok}") });
        }
        *b = s + c;
    }
    out.weights.clear();
    top_k(biased, m.top_k, &mut out.experts);
    let mut sum = 0.0f32;
    for &e in &out.experts {
        sum += scores[e];
    }
    let denom = sum + RENORM_EPS;
    for &e in &out.experts {
        out.weights.push(scores[e] / denom * m.routed_scaling_factor);
    }
    Ok(())
}

/// Distinct experts of the chunk in first-use order (token order, then slot order).
fn distinct_experts(routes: &[Route], out: &mut Vec<usize>) {
    out.clear();
    for r in routes {
        for &e in &r.experts {
            if !out.contains(&e) {
                out.push(e);
            }
        }
    }
}

/// Applies one expert to every token of the chunk that chose it. An expert the source hands out
/// unchecked is hashed by its own products (in cache: [`ProductChecksum`]), and their results
/// are kept only once the source has accepted the checksum; bytes it refuses are read again and
/// the products computed again from them.
#[allow(clippy::too_many_arguments)]
fn run_expert<S: WeightSource>(
    k: &Kernels,
    cfg: &Config,
    src: &S,
    layer: usize,
    expert: usize,
    t: usize,
    s: &mut MoeScratch,
    obs: Observers<'_>,
) -> Result<(), ModelError> {
    let (tracer, meter) = (obs.tracer, obs.meter);
    let m = &cfg.moe;
    let lat = m.latent;
    // Wait for the bytes first, so that the span holds all of this expert's compute and none
    // of the wait (`k3ring bench` sums these spans as the compute expert reads can overlap).
    let guard = src.expert_unchecked(layer, expert)?;
    let span =
        || tracer.map(|t| t.span_args(ComputeOp::Expert, SpanArgs::new().layer(layer as u32).expert(expert as u32)));
    let mut span_guard = span();
    s.users.clear();
    for tok in 0..t {
        if let Some(slot) = s.routes[tok].experts.iter().position(|&e| e == expert) {
            s.users.push((tok, slot));
        }
    }
    let n = s.users.len();
    for (i, &(tok, _)) in s.users.iter().enumerate() {
        s.expert.gathered[i * lat..(i + 1) * lat].copy_from_slice(&s.u[tok * lat..(tok + 1) * lat]);
    }
    let bad = |source| ModelError::Expert { layer, expert, source };
    if guard.unchecked() {
        let sum = s.check.begin(guard.parts());
        let computed = expert_products(k, cfg, guard.parts(), n, &mut s.expert, meter, Some(&sum));
        let (got, hashing_seconds) = sum.finish(rayon::current_num_threads());
        if guard.confirm(got, hashing_seconds)? {
            computed.map_err(bad)?;
        } else {
            // The results are dropped; the bytes are read again (outside the span: a wait).
            drop(span_guard);
            let guard = src.expert(layer, expert)?;
            span_guard = span();
            expert_products(k, cfg, guard.parts(), n, &mut s.expert, meter, None).map_err(bad)?;
        }
    } else {
        expert_products(k, cfg, guard.parts(), n, &mut s.expert, meter, None).map_err(bad)?;
        drop(guard);
    }
    for (i, &(tok, slot)) in s.users.iter().enumerate() {
        let base = (tok * m.top_k + slot) * lat;
        s.slot_out[base..base + lat].copy_from_slice(&s.expert.eo[i * lat..(i + 1) * lat]);
    }
    drop(span_guard);
    Ok(())
}

/// The expert `b`'s three products for the `n` gathered tokens, into `e.eo`; each packed
/// weight hashed into `check` as its product reads it, when given.
fn expert_products(
    k: &Kernels,
    cfg: &Config,
    b: ExpertBytes<'_>,
    n: usize,
    e: &mut ExpertBuffers,
    meter: Meter<'_>,
    check: Option<&ProductChecksum<'_>>,
) -> Result<(), KernelError> {
    let (lat, f) = (cfg.moe.latent, cfg.moe.expert_hidden);
    // `part`: the packed weight's place in `EXPERT_PARTS`; its scales follow it. A block of rows
    // read both: two values per packed byte, one scale byte per 32 values.
    let product = |w: (&[u8], &[u8]), part: usize, rows: usize, cols: usize, x: &[f32], y: &mut [f32]| match check {
        Some(c) => meter.mxfp4_watched(k, w, rows, cols, x, n, y, &|r: Range<usize>| {
            c.rows_read(part, cols / 2, r.clone());
            c.rows_read(part + 1, cols / 32, r);
        }),
        None => meter.mxfp4(k, w, rows, cols, x, n, y),
    };
    let gathered = &e.gathered[..n * lat];
    product((b.w1_packed, b.w1_scale), 0, f, lat, gathered, &mut e.h1[..n * f])?;
    product((b.w3_packed, b.w3_scale), 2, f, lat, gathered, &mut e.h3[..n * f])?;
    meter.time(OpClass::NormsActivations, 0, || {
        k.situ_glu(&e.h1[..n * f], &e.h3[..n * f], cfg.situ_beta, cfg.situ_linear_beta, &mut e.act[..n * f])
    });
    product((b.w2_packed, b.w2_scale), 4, lat, f, &e.act[..n * f], &mut e.eo[..n * lat])
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::checkpoint::expert_sums::expert_checksum;
    use crate::model::buffers::Allocate;

    #[test]
    fn the_products_feed_every_byte_of_the_expert_to_its_checksum() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-k3");
        let text = std::fs::read_to_string(dir.join("config.json")).unwrap();
        let cfg = Config::from_json_str(&text, &dir.join("config.json")).unwrap();
        let (lat, f) = (cfg.moe.latent, cfg.moe.expert_hidden);
        // Packed nibbles of any value; scales near 2^0 (E8M0 127), never the reserved 0xFF.
        let packed = |len: usize, salt: usize| -> Vec<u8> { (0..len).map(|i| ((i * 37 + salt) % 256) as u8).collect() };
        let scales = |len: usize, salt: usize| -> Vec<u8> { (0..len).map(|i| 124 + ((i + salt) % 6) as u8).collect() };
        let p = [
            packed(f * lat / 2, 1),
            scales(f * lat / 32, 2),
            packed(f * lat / 2, 3),
            scales(f * lat / 32, 4),
            packed(lat * f / 2, 5),
            scales(lat * f / 32, 6),
        ];
        let b = ExpertBytes::from_parts([&p[0], &p[1], &p[2], &p[3], &p[4], &p[5]]);
        let want = expert_checksum(&p.iter().map(Vec::as_slice).collect::<Vec<_>>());
        let mut s = MoeScratch::new(&cfg, 4, &mut Allocate);
        let n = 3;
        for (i, x) in s.expert.gathered[..n * lat].iter_mut().enumerate() {
            *x = (i % 7) as f32 * 0.25 - 0.5;
        }
        let sum = s.check.begin(b);
        expert_products(&Kernels::detect(), &cfg, b, n, &mut s.expert, Meter::new(None), Some(&sum)).unwrap();
        assert!(sum.fully_fed(), "the products fed every packed and scale byte to the hash");
        assert_eq!(sum.finish(1).0, want);
    }
}
