//! The prefetcher: predicts the experts a layer will need before its routing is known, and asks
//! the store to read them as guesses.
//!
//! Rules:
//! - Next-layer router: once layer L's MLP residual read is known, layer L+1's own norm and
//!   router are applied to it, and each token's top-k plus `margin` experts are predicted.
//! - Block starts: when L+1 starts an attention-residual block its partial sum restarts, so
//!   layer L's read says little of its routing; its prediction waits until layer L's partial
//!   sum is final and uses L+1's MLP residual read with that sum as the newest snapshot and a
//!   zero partial sum (only L+1's attention output, not yet known, is left out).
//! - Previous token (`prev_token`): when layer L's routing is known, the experts the previous
//!   token used at L+1 are guessed too.
//! - A prediction never waits: if L+1's trunk unit is not resident yet, it is skipped.
//!
//! Threads: the scheduler thread (through the model's [`crate::model::LayerHook`] points and the
//! store's requests). Allocation: its buffers are sized once for the chunk; a guess list is
//! allocated per prediction.

use std::sync::{Arc, Mutex};

use serde::Serialize;

use super::io_stage::IoStage;
use crate::config::Config;
use crate::model::attn_res::{self, ResScratch};
use crate::model::moe::{router_scores, top_k};
use crate::model::weights::{f32_at, FfnWeights, TrunkUnit, TrunkView};
use crate::model::{norm_rows, Model};
use crate::storage::stream::reads::Priority;
use crate::storage::stream::{lock, AdmitAll, ExpertKey, Store};
use crate::trace::{ComputeOp, SpanArgs};

/// What the prefetcher guesses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Speculation {
    /// Predict the next layer's experts with its router.
    pub enabled: bool,
    /// Experts predicted per token beyond top-k.
    pub margin: usize,
    /// Also guess the experts the previous token used at the next layer.
    pub prev_token: bool,
}

impl Default for Speculation {
    /// Off: wrong guesses and the cached experts they evict cost reads, which slow decoding
    /// wherever the device is the bottleneck (docs/PIPELINE.md).
    fn default() -> Self {
        Speculation { enabled: false, margin: 0, prev_token: false }
    }
}

/// Buffers of one prediction, sized for a chunk.
struct PredictScratch {
    /// The estimated MLP residual read of a block start, [T, D].
    y: Vec<f32>,
    /// A zero partial sum, [T, D].
    zeros: Vec<f32>,
    res: ResScratch,
    router: RouterScratch,
}

struct RouterScratch {
    /// The next layer's normalised FFN input, [T, D].
    xn: Vec<f32>,
    /// Router scores, [T, E].
    scores: Vec<f32>,
    /// One token's biased scores, [E].
    biased: Vec<f32>,
    /// One token's experts by rank.
    ranked: Vec<usize>,
    /// Distinct experts over the chunk, by token then rank.
    predicted: Vec<usize>,
}

/// The prefetcher's state.
pub struct Prefetcher {
    spec: Speculation,
    io: Arc<IoStage>,
    /// Tokens per forward pass at most.
    chunk: usize,
    /// Outstanding bytes above which guesses wait (the device's window).
    busy_bytes: usize,
    scratch: Mutex<PredictScratch>,
    /// The experts each layer used for the last chunk (for `prev_token`).
    last_routed: Mutex<Vec<Vec<usize>>>,
}

impl Prefetcher {
    /// A prefetcher for chunks of up to `chunk` tokens; guesses wait while more than
    /// `busy_bytes` are outstanding.
    pub fn new(cfg: &Config, chunk: usize, spec: Speculation, io: Arc<IoStage>, busy_bytes: usize) -> Prefetcher {
        let (d, e) = (cfg.hidden_size, cfg.moe.n_experts);
        let blocks = cfg.block_starts().len();
        let scratch = PredictScratch {
            y: vec![0.0; chunk * d],
            zeros: vec![0.0; chunk * d],
            res: ResScratch::new(d, blocks + 2),
            router: RouterScratch {
                xn: vec![0.0; chunk * d],
                scores: vec![0.0; chunk * e],
                biased: vec![0.0; e],
                ranked: Vec::with_capacity(e),
                predicted: Vec::with_capacity(chunk * e),
            },
        };
        Prefetcher {
            spec,
            io,
            chunk,
            busy_bytes,
            scratch: Mutex::new(scratch),
            last_routed: Mutex::new(vec![Vec::new(); cfg.n_layers]),
        }
    }

    /// Bytes of the buffers [`Prefetcher::new`] allocates (for the memory plan).
    pub fn scratch_bytes(cfg: &Config, chunk: usize) -> u64 {
        let (d, e) = (cfg.hidden_size, cfg.moe.n_experts);
        let blocks = cfg.block_starts().len();
        let f32s = 3 * chunk * d + chunk * e + e + 2 * d + blocks + 2;
        let usizes = e + chunk * e;
        (4 * f32s + std::mem::size_of::<usize>() * usizes) as u64
    }

    pub fn speculation(&self) -> Speculation {
        self.spec
    }

    /// Layer `layer`'s MLP residual read `y` is known: predict `layer + 1` from it, unless it
    /// starts a block (see [`Prefetcher::layer_end`]).
    pub fn mlp_input(&self, store: &Store, model: &Model, layer: usize, t: usize, y: &[f32]) {
        let next = layer + 1;
        if !self.spec.enabled || t > self.chunk || model.cfg.layers.get(next).is_none_or(|n| n.block_start) {
            return;
        }
        let mut sc = lock(&self.scratch);
        self.predict(store, model, next, t, y, &mut sc.router);
    }

    /// Layer `layer` is done: if `layer + 1` starts a block, predict it from its MLP residual
    /// read with `partial` as the newest snapshot and a zero partial sum.
    pub fn layer_end(
        &self,
        store: &Store,
        model: &Model,
        layer: usize,
        t: usize,
        snapshots: &[Vec<f32>],
        partial: &[f32],
    ) {
        let next = layer + 1;
        if !self.spec.enabled || t > self.chunk || !model.cfg.layers.get(next).is_some_and(|n| n.block_start) {
            return;
        }
        let Some(FfnWeights::Moe(_)) = model.weights.layers.get(next).map(|lw| &lw.ffn) else { return };
        let Some(view) = store.trunk_if_resident(TrunkUnit::Layer(next)) else { return };
        let mut guard = lock(&self.scratch);
        let sc = &mut *guard;
        let d = model.cfg.hidden_size;
        let td = t * d;
        {
            // Closed before `predict` opens its own span, so the two do not overlap in the trace.
            let _span = model
                .tracer
                .as_ref()
                .map(|tr| tr.span_args(ComputeOp::Speculation, SpanArgs::new().layer(next as u32)));
            attn_res::forward_with_newest(
                &model.kernels,
                &view,
                &model.weights.layers[next].mlp_res,
                snapshots,
                partial,
                &sc.zeros[..td],
                t,
                d,
                &mut sc.res,
                &mut sc.y[..td],
            );
        }
        drop(view);
        self.predict(store, model, next, t, &sc.y[..td], &mut sc.router);
    }

    /// The routing of `layer` is known (`experts`, distinct): guess the experts the previous
    /// token used at the next layer, if asked to.
    pub fn routed(&self, store: &Store, layer: usize, experts: &[usize]) {
        let mut last = lock(&self.last_routed);
        if let Some(l) = last.get_mut(layer) {
            l.clear();
            l.extend_from_slice(experts);
        }
        if !self.spec.prev_token {
            return;
        }
        let next: Vec<usize> = last.get(layer + 1).cloned().unwrap_or_default();
        drop(last);
        if !next.is_empty() {
            self.guess(store, layer + 1, &next);
        }
    }

    /// Predicts the experts of `next` from the residual read `y` ([t, D]) with `next`'s own
    /// norm and router, and guesses them. Skipped when `next` is not an MoE layer or its trunk
    /// is not resident (a prediction never waits).
    #[allow(clippy::too_many_arguments)]
    fn predict(&self, store: &Store, model: &Model, next: usize, t: usize, y: &[f32], sc: &mut RouterScratch) {
        let Some(FfnWeights::Moe(w)) = model.weights.layers.get(next).map(|lw| &lw.ffn) else { return };
        let Some(view) = store.trunk_if_resident(TrunkUnit::Layer(next)) else { return };
        let span =
            model.tracer.as_ref().map(|tr| tr.span_args(ComputeOp::Speculation, SpanArgs::new().layer(next as u32)));
        let (k, cfg) = (&model.kernels, &model.cfg);
        let (d, e) = (cfg.hidden_size, cfg.moe.n_experts);
        let norm = view.bytes(model.weights.layers[next].post_attention_layernorm.id);
        norm_rows(k, norm, cfg.rms_norm_eps, &y[..t * d], &mut sc.xn[..t * d], d);
        router_scores(k, &view, w, &sc.xn[..t * d], t, &mut sc.scores[..t * e]);
        let bias = view.bytes(w.e_score_correction_bias.id);
        let want = (cfg.moe.top_k + self.spec.margin).min(e);
        sc.predicted.clear();
        for tok in 0..t {
            for (i, b) in sc.biased.iter_mut().enumerate() {
                let v = sc.scores[tok * e + i] + f32_at(bias, i);
                *b = if v.is_finite() { v } else { f32::NEG_INFINITY };
            }
            top_k(&mut sc.biased, want, &mut sc.ranked);
            for &x in &sc.ranked {
                if !sc.predicted.contains(&x) {
                    sc.predicted.push(x);
                }
            }
        }
        drop((span, view));
        self.guess(store, next, &sc.predicted);
    }

    /// Asks the store to read the guessed experts of `layer` that are not resident, in disk
    /// order, using idle bandwidth only.
    fn guess(&self, store: &Store, layer: usize, experts: &[usize]) {
        // With more than the device's window already outstanding, a guess would delay reads
        // compute is waiting for (and some guesses are wrong).
        if self.io.outstanding_bytes() > self.busy_bytes {
            store.count(|s| s.spec_skipped_busy += 1);
            return;
        }
        let mut wanted: Vec<ExpertKey> =
            experts.iter().map(|&e| (layer, e)).filter(|&k| !store.expert_requested(k)).collect();
        wanted.sort_unstable();
        wanted.dedup();
        wanted.sort_by_key(|&k| store.disk_position(k));
        store.request(&wanted, Priority::Guess, &AdmitAll);
    }
}
