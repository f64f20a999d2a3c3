//! Weight values: which distribution each tensor gets, and a counter-based generator that
//! produces any byte range of a tensor independently of every other range.
//!
//! Word `i` of a tensor is `splitmix64_at(key, i)` with `key` derived from the seed and the
//! tensor name: the SplitMix64 stream, addressed by position, so segments can be generated in
//! parallel and in any order with identical output. A word becomes 8 table entries (one random
//! byte each): 16 bytes of bf16 or 32 bytes of f32, or 8 raw bytes for MXFP4 nibbles.
//!
//! Scales (spec 5 maths, for unit-RMS inputs): linear weights are N(0, (gain / sqrt(fan_in))^2)
//! with gain 1, except the projections that write into the residual stream (o_proj, down_proj,
//! routed_expert_up_proj: gain 1/sqrt(2 * layers)) and the router (small gain, so routing is
//! nearly flat across experts as in K3). Norm weights are 1. MXFP4 experts are random nibbles
//! with an E8M0 scale per group of 32 chosen so the decoded weights have std ~1/sqrt(fan_in).
//!
//! Routing locality X in [0, 1] (`--routing-locality`). A token's routing is its top-k of
//! sigmoid(gate x) + bias. At X = 0 the router scores spread ~0.0625 from token to token and
//! the bias (std 1e-4) barely steers, so every expert is about equally popular and consecutive
//! tokens share k/E of their experts, as by chance. Trained MoE models instead have popular
//! experts, share experts between consecutive tokens, and route predictably from layer to
//! layer. X moves weight from the token-dependent part to the fixed per-expert bias:
//!
//!   router gain = 0.25 * (1 - X)            (score spread ~0.0625 * (1 - X))
//!   bias std    = 1e-4 + 0.0625 * X
//!
//! so the bias-to-score ratio is about X / (1 - X): 0 at X = 0, 1 at 0.5, 4 at 0.8, 9 at 0.9,
//! and at X = 1 the gate is zero and every token picks the same k experts (by bias). Both
//! terms are exact at X = 0 (0.25 * 1, 1e-4 + 0), so X = 0 writes the bytes it always did.
//! Only the two router tensors of each MoE layer depend on X; the counter-based streams are
//! unchanged. Measured (`--dims small --layers 6 --experts 64`, top-16, 64 tokens; share of a
//! token's experts also chosen by the previous token, and share of the experts layer l+1's
//! router predicts from layer l's residual read that the routing then chooses, both as the
//! prefetcher's rules compute them): X 0 -> 0.25 / 0.81, 0.25 -> 0.30 / 0.82, 0.5 -> 0.51 /
//! 0.86, 0.75 -> 0.81 / 0.94, 0.9 -> 0.95 / 0.98, 1 -> 1 / 1. The engine's own recall (routed
//! experts resident or in flight at routing) and expert hit rate, `run --mem-gb 0.65` (trunk
//! pinned, 117 expert slots of 320), 8 + 64 tokens, 2-core Xeon VM, default (adaptive)
//! speculation: X 0 -> 0.63 / 0.46, 0.25 -> 0.65 / 0.54, 0.5 -> 0.76 / 0.70, 0.75 -> 0.93 /
//! 0.93, 0.9 -> 0.98 / 0.98, 1 -> 0.98 / 0.98 (single runs; a few points of timing noise).
//! A budget whose pool holds fewer experts than one token needs over all layers gains little.
//! Damping the projections that write the residual stream was tried too: it raised the
//! next-layer share by under 0.02 at any X on top of this, and changes the hidden state's
//! makeup, so it was left out.

use crate::checkpoint::{Dtype, ExpectedTensor};
use crate::rng::{mix64, splitmix64_at};

use super::SynthError;

/// FNV-1a of a name: decorrelates the per-tensor keys.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The stream key of one tensor.
pub fn tensor_key(seed: u64, name: &str) -> u64 {
    mix64(mix64(seed) ^ fnv1a(name))
}

/// Embedding rows: unit std, like the hidden state they start.
const EMBED_STD: f64 = 1.0;
/// Router gain: scores sigmoid(N(0, 0.25^2)) = 0.5 +- 0.06, nearly flat weights, while the
/// selection still varies from token to token.
const ROUTER_GAIN: f64 = 0.25;
/// Selection bias: tiny next to the router score spread (~0.06), so it barely steers.
const ROUTER_BIAS_STD: f64 = 1e-4;
/// Spread of the router scores at locality 0: sigmoid'(0) * ROUTER_GAIN = 0.25 * 0.25.
const ROUTER_SCORE_SPREAD: f64 = 0.0625;
/// Conv taps: 0.5 / sqrt(4 taps), so the conv output has about half the input's RMS.
const CONV_STD: f64 = 0.25;
const DT_BIAS_STD: f64 = 0.01;
/// A_log per head, uniform in [-1, 0]: exp(A_log) in [0.37, 1], decays of mixed speed.
const A_LOG_MIN: f32 = -1.0;
const A_LOG_MAX: f32 = 0.0;
/// RMS of a uniformly random E2M1 nibble: sqrt(mean of [0, .5, 1, 1.5, 2, 3, 4, 6]^2).
const E2M1_RMS: f64 = 2.926_174_978_050_4;
/// Per-group exponent offsets drawn from 2 random bits, and the RMS factor they add:
/// sqrt((2^-2 + 1 + 1 + 2^2) / 4) = 1.25.
const SCALE_SPREAD: [i8; 4] = [-1, 0, 0, 1];
const SCALE_SPREAD_RMS: f64 = 1.25;
/// E8M0 bias (spec 4).
const E8M0_BIAS: i32 = 127;

/// How a tensor's bytes are made.
#[derive(Clone, Debug)]
pub enum Fill {
    /// One random byte indexes 256 bf16 values (little-endian bits).
    Bf16Table(Box<[u16; 256]>),
    /// One random byte indexes 256 f32 values.
    F32Table(Box<[f32; 256]>),
    /// As F32Table for the first `heads` elements, zero after (A_log padded to the head dim).
    ALog { table: Box<[f32; 256]>, heads: u64 },
    /// A constant element repeated (bf16 or f32 1.0), as an 8-byte pattern.
    Const([u8; 8]),
    /// Random bytes (MXFP4 nibbles).
    Random,
    /// E8M0 scales: `base` plus an offset from [`SCALE_SPREAD`].
    Scale { base: u8 },
}

impl Fill {
    /// Output bytes per 64-bit word.
    fn bytes_per_word(&self) -> usize {
        match self {
            Fill::Bf16Table(_) => 16,
            Fill::F32Table(_) | Fill::ALog { .. } => 32,
            Fill::Const(_) | Fill::Random | Fill::Scale { .. } => 8,
        }
    }

    /// Writes bytes `start..start + out.len()` of the tensor keyed `key`.
    pub fn fill_range(&self, key: u64, start: u64, out: &mut [u8]) {
        let bpw = self.bytes_per_word();
        let mut word = start / bpw as u64;
        let skip = (start % bpw as u64) as usize;
        let mut pos = 0;
        let mut tmp = [0u8; 32];
        if skip != 0 {
            self.fill_words(key, word, &mut tmp[..bpw]);
            let n = (bpw - skip).min(out.len());
            out[..n].copy_from_slice(&tmp[skip..skip + n]);
            pos = n;
            word += 1;
        }
        let whole = (out.len() - pos) / bpw * bpw;
        self.fill_words(key, word, &mut out[pos..pos + whole]);
        word += (whole / bpw) as u64;
        pos += whole;
        if pos < out.len() {
            self.fill_words(key, word, &mut tmp[..bpw]);
            let n = out.len() - pos;
            out[pos..].copy_from_slice(&tmp[..n]);
        }
    }

    /// Fills whole words starting at word `first`; `out.len()` is a multiple of the word bytes.
    fn fill_words(&self, key: u64, first: u64, out: &mut [u8]) {
        let bpw = self.bytes_per_word();
        debug_assert_eq!(out.len() % bpw, 0);
        let word = |i: usize| splitmix64_at(key, first + i as u64);
        match self {
            Fill::Bf16Table(table) => {
                for (i, chunk) in out.chunks_exact_mut(16).enumerate() {
                    let w = word(i);
                    for (j, pair) in chunk.chunks_exact_mut(2).enumerate() {
                        pair.copy_from_slice(&table[((w >> (8 * j)) & 0xff) as usize].to_le_bytes());
                    }
                }
            }
            Fill::F32Table(table) => {
                for (i, chunk) in out.chunks_exact_mut(32).enumerate() {
                    let w = word(i);
                    for (j, quad) in chunk.chunks_exact_mut(4).enumerate() {
                        quad.copy_from_slice(&table[((w >> (8 * j)) & 0xff) as usize].to_le_bytes());
                    }
                }
            }
            Fill::ALog { table, heads } => {
                for (i, chunk) in out.chunks_exact_mut(32).enumerate() {
                    let w = word(i);
                    for (j, quad) in chunk.chunks_exact_mut(4).enumerate() {
                        let element = (first + i as u64) * 8 + j as u64;
                        let v = if element < *heads { table[((w >> (8 * j)) & 0xff) as usize] } else { 0.0 };
                        quad.copy_from_slice(&v.to_le_bytes());
                    }
                }
            }
            Fill::Const(pattern) => {
                for chunk in out.chunks_exact_mut(8) {
                    chunk.copy_from_slice(pattern);
                }
            }
            Fill::Random => {
                for (i, chunk) in out.chunks_exact_mut(8).enumerate() {
                    chunk.copy_from_slice(&word(i).to_le_bytes());
                }
            }
            Fill::Scale { base } => {
                for (i, chunk) in out.chunks_exact_mut(8).enumerate() {
                    let w = word(i);
                    for (j, b) in chunk.iter_mut().enumerate() {
                        *b = base.wrapping_add_signed(SCALE_SPREAD[((w >> (8 * j)) & 3) as usize]);
                    }
                }
            }
        }
    }
}

/// Inverse of the standard normal CDF (Acklam's rational approximation, relative error < 1.2e-9).
fn inverse_normal_cdf(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969683028665376e1,
        2.209460984245205e2,
        -2.759285104469687e2,
        1.38357751867269e2,
        -3.066479806614716e1,
        2.506628277459239,
    ];
    const B: [f64; 5] =
        [-5.447609879822406e1, 1.615858368580409e2, -1.556989798598866e2, 6.680131188771972e1, -1.328068155288572e1];
    const C: [f64; 6] = [
        -7.784894002430293e-3,
        -3.223964580411365e-1,
        -2.400758277161838,
        -2.549732539343734,
        4.374664141464968,
        2.938163982698783,
    ];
    const D: [f64; 4] = [7.784695709041462e-3, 3.224671290700398e-1, 2.445134137142996, 3.754408661907416];
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    const P_LOW: f64 = 0.02425;
    if p < P_LOW {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - P_LOW {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

/// 256 equiprobable quantiles of N(0, std^2), rescaled so their RMS is exactly `std`.
fn normal_table(std: f64) -> [f64; 256] {
    let mut t = [0.0; 256];
    for (i, v) in t.iter_mut().enumerate() {
        *v = inverse_normal_cdf((i as f64 + 0.5) / 256.0);
    }
    let rms = (t.iter().map(|v| v * v).sum::<f64>() / 256.0).sqrt();
    t.map(|v| v * std / rms)
}

fn bf16_normal(std: f64) -> Fill {
    Fill::Bf16Table(Box::new(normal_table(std).map(|v| half::bf16::from_f64(v).to_bits())))
}

fn f32_normal(std: f64) -> Fill {
    Fill::F32Table(Box::new(normal_table(std).map(|v| v as f32)))
}

/// The E8M0 byte whose groups give decoded weights of std ~1/sqrt(fan_in) (spec 4).
pub fn scale_base(fan_in: usize) -> u8 {
    let target = 1.0 / (fan_in as f64).sqrt();
    let exponent = (target / (E2M1_RMS * SCALE_SPREAD_RMS)).log2().round() as i32;
    let base = E8M0_BIAS + exponent;
    // Spread -1..=+1 must stay a finite, nonzero exponent: never 0x00 and never 0xFF (NaN).
    assert!(base > 1 && base < 0xFE, "E8M0 scale base {base} out of range for fan-in {fan_in}");
    base as u8
}

/// What the fill of a tensor depends on besides its own name and shape.
pub struct FillContext {
    pub layers: usize,
    pub kda_heads: usize,
    pub routing_locality: f64,
}

fn bf16_one() -> [u8; 8] {
    let b = half::bf16::ONE.to_bits().to_le_bytes();
    [b[0], b[1], b[0], b[1], b[0], b[1], b[0], b[1]]
}

fn f32_one() -> [u8; 8] {
    let b = 1.0f32.to_le_bytes();
    [b[0], b[1], b[2], b[3], b[0], b[1], b[2], b[3]]
}

/// Picks the fill of one tensor from its name, dtype and shape; an unknown tensor is a bug
/// (the schema grew a tensor this generator does not know).
pub fn fill_for(t: &ExpectedTensor, ctx: &FillContext) -> Result<Fill, SynthError> {
    let n = t.name.as_str();
    let shape = &t.shapes[0];
    let unknown = || SynthError::Internal(format!("no synthetic fill for tensor {n} ({:?} {shape:?})", t.dtype));
    let fill = match t.dtype {
        Dtype::U8 if n.ends_with(".weight_packed") => Fill::Random,
        Dtype::U8 if n.ends_with(".weight_scale") => {
            let groups = *shape.get(1).ok_or_else(unknown)? as usize;
            Fill::Scale { base: scale_base(groups * super::MXFP4_GROUP) }
        }
        Dtype::F32 if n.ends_with("conv1d.weight") => f32_normal(CONV_STD),
        Dtype::F32 if n.ends_with(".A_log") => {
            let table = std::array::from_fn(|i| A_LOG_MIN + (A_LOG_MAX - A_LOG_MIN) * (i as f32 + 0.5) / 256.0);
            Fill::ALog { table: Box::new(table), heads: ctx.kda_heads as u64 }
        }
        Dtype::F32 if n.ends_with(".dt_bias") => f32_normal(DT_BIAS_STD),
        Dtype::F32 if n.ends_with(".e_score_correction_bias") => f32_normal(router_bias_std(ctx.routing_locality)),
        Dtype::F32 if n.ends_with(".o_norm.weight") => Fill::Const(f32_one()),
        Dtype::Bf16 if n.ends_with("embed_tokens.weight") => bf16_normal(EMBED_STD),
        Dtype::Bf16 if n.ends_with("norm.weight") => Fill::Const(bf16_one()),
        Dtype::Bf16 if shape.len() == 2 => {
            let fan_in = shape[1] as f64;
            bf16_normal(linear_gain(n, ctx) / fan_in.sqrt())
        }
        _ => return Err(unknown()),
    };
    Ok(fill)
}

/// Std of the selection bias for routing locality `x`: see the module doc.
fn router_bias_std(x: f64) -> f64 {
    ROUTER_BIAS_STD + x * ROUTER_SCORE_SPREAD
}

/// Gain of the router for routing locality `x`: see the module doc.
fn router_gain(x: f64) -> f64 {
    ROUTER_GAIN * (1.0 - x)
}

/// Gain of a bf16 linear layer (output std for unit-RMS input).
fn linear_gain(name: &str, ctx: &FillContext) -> f64 {
    let writes_residual = name.ends_with(".o_proj.weight")
        || name.ends_with("routed_expert_up_proj.weight")
        || (name.ends_with("down_proj.weight") && !name.ends_with("routed_expert_down_proj.weight"));
    if writes_residual {
        1.0 / (2.0 * ctx.layers as f64).sqrt()
    } else if name.ends_with("block_sparse_moe.gate.weight") {
        router_gain(ctx.routing_locality)
    } else {
        1.0
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn ranges_match_the_whole_tensor() {
        let fills =
            [bf16_normal(0.1), f32_normal(1.0), Fill::Random, Fill::Scale { base: 120 }, Fill::Const(bf16_one())];
        for fill in &fills {
            let mut whole = vec![0u8; 1000];
            fill.fill_range(7, 0, &mut whole);
            for (a, b) in [(0, 1), (3, 17), (5, 999), (16, 32), (999, 1000), (1, 1000)] {
                let mut part = vec![0u8; b - a];
                fill.fill_range(7, a as u64, &mut part);
                assert_eq!(part, whole[a..b], "{fill:?} {a}..{b}");
            }
        }
    }

    #[test]
    fn normal_table_has_the_requested_std() {
        let t = normal_table(0.5);
        let rms = (t.iter().map(|v| v * v).sum::<f64>() / 256.0).sqrt();
        assert!((rms - 0.5).abs() < 1e-12);
        assert!(t[0] < -1.0 && t[255] > 1.0, "tails reach beyond 2 sigma");
        assert!((inverse_normal_cdf(0.975) - 1.959964).abs() < 1e-6);
    }

    #[test]
    fn routing_locality_0_keeps_the_router_fills_exactly() {
        // Exact equality: the tables (and so the bytes) of version 1 must come out bit for bit.
        assert_eq!(router_gain(0.0).to_bits(), ROUTER_GAIN.to_bits());
        assert_eq!(router_bias_std(0.0).to_bits(), ROUTER_BIAS_STD.to_bits());
        assert_eq!(router_gain(1.0), 0.0);
        let xs = [0.0, 0.25, 0.5, 0.75, 1.0];
        assert!(xs.windows(2).all(|w| router_gain(w[1]) < router_gain(w[0])));
        assert!(xs.windows(2).all(|w| router_bias_std(w[1]) > router_bias_std(w[0])));
    }

    #[test]
    fn expert_scales_are_near_k3_magnitudes() {
        // fan-in 3584 (LAT): 1/sqrt(3584) = 0.0167 = 3.66 x 2^-7.8, so the base is 2^-8.
        assert_eq!(scale_base(3584), 119);
        assert_eq!(scale_base(3072), 119);
        assert_eq!(scale_base(64), 122);
    }
}
