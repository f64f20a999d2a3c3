//! The prefetcher: predicts the experts a layer will need before its routing is known, and asks
//! the store to read them as guesses.
//!
//! Prediction rules:
//! - Next-layer router: once layer L's MLP residual read is known, layer L+1's own norm and
//!   router are applied to it, and each token's top-k plus `margin` experts are predicted, each
//!   with its rank.
//! - Block starts: when L+1 starts an attention-residual block its partial sum restarts, so
//!   layer L's read says little of its routing; its prediction waits until layer L's partial
//!   sum is final and uses L+1's MLP residual read with that sum as the newest snapshot and a
//!   zero partial sum (only L+1's attention output, not yet known, is left out).
//! - Previous token (`prev_token`): when layer L's routing is known, the experts the previous
//!   token used at L+1 are guessed too.
//! - Next step: when a decode step ends, the experts its first MoE layer chose are guessed for
//!   the next step's, if consecutive tokens have shared experts more often than not (always on;
//!   the device has nothing else known to read during the head and the first attention).
//! - A prediction never waits: if L+1's trunk unit is not resident yet, it is skipped.
//!
//! Admission (`adaptive`, the default), so that guessing cannot slow a run down where the device
//! is the bottleneck:
//! - Each guess carries the chance that its layer's routing chooses it, measured per prediction
//!   rank from every past prediction against the routing that followed (used or not).
//! - A guess never evicts an expert of a layer whose routing comes before the guessed layer's.
//!   It evicts one of a layer whose turn comes after it if it is more likely to be used than
//!   not (its read was due anyway, and would have evicted such an expert at its routing).
//!   Any other only if that is less likely to be used than the guess: a pending guess by its
//!   own chance, any other expert by the share of its layer's cached experts that past routings
//!   chose (the cache's own hit history). The store offers each guess the cache policy's first
//!   choice among the experts this allows it to evict.
//! - The bytes guessed for a layer are capped by the device time that was free for them: per
//!   layer, the time from its prediction to its routing minus the time demand reads and trunk
//!   read-ahead kept the device busy (measured by the I/O stage), times the device's read rate.
//!   A layer whose window the demand reads fill gets no guesses; one whose device idles during
//!   attention gets as many as fit.
//!
//! The store then promotes a chosen guess still being read to the front of the device queue,
//! and cancels a wrong one (see `Store::request_demand`); the I/O stage sends guesses to the
//! device in pieces at the lowest priority, so a demand read jumps ahead of the pieces not yet
//! in the device. With `adaptive` off, every prediction is read (in disk order) unless more
//! than the device's window is outstanding, evicting whatever the cache policy picks.
//!
//! Threads: the scheduler thread (through the model's [`crate::model::LayerHook`] points and the
//! pipeline's requests). Allocation: buffers are sized once for the chunk; a guess list is
//! allocated per prediction.

use std::sync::{Arc, Mutex};

use serde::Serialize;

use super::io_stage::IoStage;
use super::trial::{Mark, Trials};
use crate::config::Config;
use crate::model::attn_res::{self, ResScratch};
use crate::model::buffers::{counted, Allocate, Buffers};
use crate::model::moe::{router_scores, top_k};
use crate::model::weights::{f32_at, FfnWeights, TrunkUnit, TrunkView};
use crate::model::{norm_rows, Model};
use crate::storage::stream::reads::Priority;
use crate::storage::stream::{lock, Admission, AdmitAll, Guess, Routed, Store, Victim};
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
    /// Admission control: guesses weighed against the experts they would evict, and capped by
    /// the device time free for them. Off: every prediction is read.
    pub adaptive: bool,
}

impl Default for Speculation {
    /// On, adaptive: it reads only into device time demand reads leave free and evicts only an
    /// expert needed after its guess or less likely to be used (docs/PIPELINE.md).
    fn default() -> Self {
        Speculation { enabled: true, margin: 0, prev_token: false, adaptive: true }
    }
}

impl Speculation {
    /// No guesses at all.
    pub const OFF: Speculation = Speculation { enabled: false, margin: 0, prev_token: false, adaptive: true };
}

/// Weight of the past in the measured rates: each new observation multiplies the old counts
/// by this, so they reflect roughly the last 1 / (1 - DECAY) = 50 observations.
const RATE_DECAY: f64 = 0.98;

/// Weight of a new window in the per-layer idle time.
const IDLE_EMA_WEIGHT: f64 = 0.25;

/// A measured chance with a uniform prior: (hits + 1) / (total + 2), decayed.
#[derive(Clone, Copy, Debug, Default)]
struct Rate {
    hits: f64,
    total: f64,
}

impl Rate {
    fn p(self) -> f32 {
        ((self.hits + 1.0) / (self.total + 2.0)) as f32
    }

    fn add(&mut self, hits: usize, total: usize) {
        self.hits = self.hits * RATE_DECAY + hits as f64;
        self.total = self.total * RATE_DECAY + total as f64;
    }
}

/// A prediction awaiting its layer's routing.
#[derive(Default)]
struct Pending {
    /// (expert, best rank over the chunk's tokens).
    experts: Vec<(usize, usize)>,
    /// The I/O stage's clock and needed-busy time when it was made.
    at_ns: u64,
    busy_ns: u64,
    live: bool,
}

/// What the prefetcher has learnt.
struct History {
    /// Per prediction rank: how often the routing chose an expert predicted at that rank.
    ranks: Vec<Rate>,
    /// How often the previous token's expert was chosen again at the same layer, from decode
    /// steps only (a prompt chunk's experts are many tokens' and share far more).
    prev_token: Rate,
    /// Rows of the pass running now, and of the pass each layer's `last_routed` came from.
    rows: usize,
    last_rows: Vec<usize>,
    /// Per layer: how often a cached (not pending-guess) resident expert was chosen.
    cached: Vec<Rate>,
    /// Per layer: device seconds free for guesses between prediction and routing (EMA).
    idle_s: Vec<Option<f64>>,
    pending: Vec<Pending>,
    /// The experts each layer used for the last chunk.
    last_routed: Vec<Vec<usize>>,
}

impl History {
    /// Per layer: the chance a cached expert is chosen (for admission).
    fn cached_rates(&self) -> Vec<f32> {
        self.cached.iter().map(|r| r.p()).collect()
    }

    /// Guesses that `layer` chooses again the experts it chose last, each with the measured
    /// share consecutive tokens keep, and [`History::cached_rates`]; `None` before it has chosen.
    fn repeat_guesses(&self, layer: usize) -> Option<(Vec<Guess>, Vec<f32>)> {
        let last = self.last_routed.get(layer).filter(|e| !e.is_empty())?;
        let p_use = self.prev_token.p();
        let guesses = last.iter().map(|&e| Guess { key: (layer, e), p_use }).collect();
        Some((guesses, self.cached_rates()))
    }
}

impl PredictScratch {
    fn build(cfg: &Config, chunk: usize, b: &mut impl Buffers) -> PredictScratch {
        let (d, e) = (cfg.hidden_size, cfg.moe.n_experts);
        let blocks = cfg.block_starts().len();
        PredictScratch {
            y: b.zeros(chunk * d),
            zeros: b.zeros(chunk * d),
            res: ResScratch::new(d, blocks + 2, b),
            router: RouterScratch {
                xn: b.zeros(chunk * d),
                scores: b.zeros(chunk * e),
                biased: b.zeros(e),
                ranked: b.with_capacity(e),
                predicted: b.with_capacity(chunk * e),
            },
        }
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
    /// Distinct experts over the chunk with their best rank, by token then rank.
    predicted: Vec<(usize, usize)>,
}

/// A guess more likely than this to be used may evict an expert needed after it (see
/// [`AdmitLikelier`]): its expected cost is then below one read. Strictly more: an untrained
/// rate starts at exactly one half.
const SOONER_MIN_P: f32 = 0.5;

/// Lets a guess evict an expert needed before it never, one needed after it if the guess is
/// more likely to be used than not, and any other only if it is less likely to be used than the
/// guess.
///
/// Needed after, by the layers' turns: decoding visits the layers in a fixed order, so an expert
/// of a layer whose turn comes after the guessed layer's is needed later. If the guess is right,
/// its read was due anyway and would have evicted such an expert at the guessed layer's routing
/// (the cache policy's victim then), so the eviction costs nothing; only a wrong guess costs a
/// read and perhaps the victim's. Comparing chances alone refused every guess of a batch, whose
/// cached experts some row nearly always uses again (both chances near 0.99).
struct AdmitLikelier<'a> {
    /// The guesses being read.
    guesses: &'a [Guess],
    /// The whole prediction they come from, resident experts included.
    predicted: &'a [Guess],
    /// Per layer: the chance a cached expert is chosen.
    cached_p: &'a [f32],
    /// A layer whose routing comes before the guessed layer's: its experts are needed first, so
    /// no guess evicts them. `None`: the guessed layer's routing comes next.
    spare_layer: Option<usize>,
}

impl AdmitLikelier<'_> {
    /// The chance `victim` is used: its own guess's, the prediction's, or its layer's cached rate,
    /// whichever is highest.
    fn p_victim(&self, victim: Victim) -> f32 {
        let cached = self.cached_p.get(victim.key.0).copied().unwrap_or(1.0);
        let predicted = self.predicted.iter().find(|g| g.key == victim.key).map_or(0.0, |g| g.p_use);
        cached.max(predicted).max(victim.pending_guess.unwrap_or(0.0))
    }

    /// Turns from now until `layer`'s routing (0: it is the next), over the `cached_p` layers.
    fn turns_until(&self, layer: usize, guessed: usize) -> usize {
        let layers = self.cached_p.len().max(1);
        let next = self.spare_layer.unwrap_or(guessed);
        (layer + layers - next % layers) % layers
    }
}

impl Admission for AdmitLikelier<'_> {
    fn admit(&self, guess: usize, victim: Victim) -> bool {
        let Some(g) = self.guesses.get(guess) else { return false };
        let (victim_turn, guess_turn) = (self.turns_until(victim.key.0, g.key.0), self.turns_until(g.key.0, g.key.0));
        if victim_turn < guess_turn {
            return false;
        }
        let p_victim = self.p_victim(victim);
        g.p_use > p_victim || (victim_turn > guess_turn && g.p_use > SOONER_MIN_P)
    }
}

/// The prefetcher's state.
pub struct Prefetcher {
    spec: Speculation,
    io: Arc<IoStage>,
    /// Tokens per forward pass at most.
    chunk: usize,
    /// Sequences decoded together: a pass of at most this many tokens is a decode step.
    sequences: usize,
    /// Bytes one expert's read costs the device (its slot).
    expert_read_bytes: u64,
    /// The first MoE layer, whose guesses for the next decode step are made at a step's end.
    first_moe: Option<usize>,
    /// Without `adaptive`: outstanding bytes above which guesses wait (the device's window).
    busy_bytes: usize,
    scratch: Mutex<PredictScratch>,
    history: Mutex<History>,
    /// With `adaptive`: whether guessing pays at each layer, tried pass by pass.
    trial: Mutex<Trials>,
}

impl Prefetcher {
    /// A prefetcher for chunks of up to `chunk` tokens of up to `sequences` sequences over the
    /// I/O stage `io`, whose window is `busy_bytes`; an expert read costs `expert_read_bytes`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cfg: &Config,
        chunk: usize,
        sequences: usize,
        spec: Speculation,
        io: Arc<IoStage>,
        busy_bytes: usize,
        expert_read_bytes: u64,
    ) -> Prefetcher {
        let scratch = PredictScratch::build(cfg, chunk, &mut Allocate);
        let layers = cfg.n_layers;
        let history = History {
            ranks: vec![Rate::default(); cfg.moe.top_k + spec.margin],
            prev_token: Rate::default(),
            rows: 0,
            last_rows: vec![0; layers],
            cached: vec![Rate::default(); layers],
            idle_s: vec![None; layers],
            pending: (0..layers).map(|_| Pending::default()).collect(),
            last_routed: vec![Vec::new(); layers],
        };
        Prefetcher {
            spec,
            io,
            chunk,
            sequences,
            expert_read_bytes,
            first_moe: cfg.moe_layers().first().copied(),
            busy_bytes,
            scratch: Mutex::new(scratch),
            history: Mutex::new(history),
            trial: Mutex::new(Trials::new(cfg.n_layers, sequences)),
        }
    }

    /// Whether guesses for `layer` are read now: always when not adaptive, else as its trial
    /// decides.
    fn guessing(&self, layer: usize) -> bool {
        !self.spec.adaptive || lock(&self.trial).guessing(layer)
    }

    /// Opens `layer`'s trial window if it is an MoE layer.
    fn open_window(&self, store: &Store, model: &Model, layer: usize) {
        if self.spec.adaptive && matches!(model.weights.layers.get(layer).map(|lw| &lw.ffn), Some(FfnWeights::Moe(_))) {
            let now = Mark::now(store.expert_waited_seconds(layer));
            lock(&self.trial).window_start(layer, now);
        }
    }

    /// Layer decisions for guessing and against it so far, and the trials that made them.
    pub fn trials(&self) -> (u64, u64, u64) {
        let t = lock(&self.trial);
        (t.decided_on, t.decided_off, t.trials_decided)
    }

    /// Bytes of the buffers [`Prefetcher::new`] allocates (for the memory plan).
    pub fn scratch_bytes(cfg: &Config, chunk: usize) -> u64 {
        counted(|b| PredictScratch::build(cfg, chunk, b))
    }

    pub fn speculation(&self) -> Speculation {
        self.spec
    }

    /// Layer `layer`'s MLP residual read `y` is known: predict `layer + 1` from it, unless it
    /// starts a block (see [`Prefetcher::layer_end`]).
    pub fn mlp_input(&self, store: &Store, model: &Model, layer: usize, t: usize, y: &[f32]) {
        lock(&self.history).rows = t;
        let next = layer + 1;
        if !self.spec.enabled || t > self.chunk || model.cfg.layers.get(next).is_none_or(|n| n.block_start) {
            return;
        }
        self.open_window(store, model, next);
        let mut sc = lock(&self.scratch);
        // `layer`'s routing comes next: its cached experts are needed before `next`'s guesses.
        self.predict(store, model, next, t, y, &mut sc.router, Some(layer));
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
        if self.spec.enabled && self.spec.adaptive {
            // Read before the trial's lock: the store's counters have a lock of their own.
            let now = Mark::now(store.expert_waited_seconds(layer));
            let mut trial = lock(&self.trial);
            trial.window_end(layer, t, now);
            if next == model.cfg.n_layers {
                trial.pass_end(t);
            }
        }
        if next == model.cfg.n_layers {
            self.guess_next_step(store, t);
            return;
        }
        if !self.spec.enabled || t > self.chunk || !model.cfg.layers.get(next).is_some_and(|n| n.block_start) {
            return;
        }
        self.open_window(store, model, next);
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
        self.predict(store, model, next, t, &sc.y[..td], &mut sc.router, None);
    }

    /// A decode step is done: guess that the next step's first MoE layer chooses the experts
    /// this one did, so the device reads those evicted since during the head, the sampling and
    /// the next step's first attention, when nothing else is known to read. Only where
    /// consecutive tokens have shared experts more often than not (routing with locality): each
    /// guess carries that measured rate as its chance.
    fn guess_next_step(&self, store: &Store, t: usize) {
        if !self.spec.enabled || t > self.sequences {
            return;
        }
        let h = lock(&self.history);
        if h.prev_token.p() <= SOONER_MIN_P {
            return;
        }
        let Some((guesses, cached_p)) = self.first_moe.and_then(|l| h.repeat_guesses(l)) else { return };
        drop(h);
        // The first MoE layer's routing comes next: nothing is needed before it.
        let read = self.guess(store, guesses, &cached_p, None, None) as u64;
        store.count(|s| s.spec_next_step_reads += read);
    }

    /// The routing of `layer` chose `experts` (distinct) and found `routed` in the pool: learn
    /// from it, then guess the experts the previous token used at the next layer, if asked to.
    pub fn routed(&self, store: &Store, layer: usize, experts: &[usize], routed: &Routed) {
        let mut h = lock(&self.history);
        if layer >= h.last_routed.len() {
            return;
        }
        h.cached[layer].add(routed.cached_hits, routed.cached);
        self.learn_prediction(&mut h, layer, experts);
        let reused = h.last_routed[layer].iter().filter(|e| experts.contains(e)).count();
        let before = h.last_routed[layer].len();
        if h.rows <= self.sequences && h.last_rows[layer] <= self.sequences {
            h.prev_token.add(reused, before);
        }
        h.last_rows[layer] = h.rows;
        h.last_routed[layer].clear();
        h.last_routed[layer].extend_from_slice(experts);
        if !self.spec.prev_token {
            return;
        }
        let Some((guesses, cached_p)) = h.repeat_guesses(layer + 1) else { return };
        drop(h);
        self.guess(store, guesses, &cached_p, None, None);
    }

    /// Scores the pending prediction of `layer` against its routing: per-rank hit rates and the
    /// device time that was free for its guesses.
    fn learn_prediction(&self, h: &mut History, layer: usize, experts: &[usize]) {
        let (now_ns, busy_ns) = self.io.needed_busy();
        let History { ranks, pending, idle_s, .. } = h;
        let p = &mut pending[layer];
        if !p.live {
            return;
        }
        p.live = false;
        for &(e, rank) in &p.experts {
            if let Some(r) = ranks.get_mut(rank) {
                r.add(usize::from(experts.contains(&e)), 1);
            }
        }
        let window = now_ns.saturating_sub(p.at_ns) as f64;
        let busy = busy_ns.saturating_sub(p.busy_ns) as f64;
        let idle = (window - busy).max(0.0) / 1e9;
        idle_s[layer] = Some(idle_s[layer].map_or(idle, |old| old + IDLE_EMA_WEIGHT * (idle - old)));
    }

    /// Predicts the experts of `next` from the residual read `y` ([t, D]) with `next`'s own
    /// norm and router, and guesses them. Skipped when `next` is not an MoE layer or its trunk
    /// is not resident (a prediction never waits).
    #[allow(clippy::too_many_arguments)]
    fn predict(
        &self,
        store: &Store,
        model: &Model,
        next: usize,
        t: usize,
        y: &[f32],
        sc: &mut RouterScratch,
        spare_layer: Option<usize>,
    ) {
        let Some(FfnWeights::Moe(w)) = model.weights.layers.get(next).map(|lw| &lw.ffn) else { return };
        let Some(view) = store.trunk_if_resident(TrunkUnit::Layer(next)) else { return };
        let span =
            model.tracer.as_ref().map(|tr| tr.span_args(ComputeOp::Speculation, SpanArgs::new().layer(next as u32)));
        let (k, cfg) = (&model.kernels, &model.cfg);
        let (d, e) = (cfg.hidden_size, cfg.moe.n_experts);
        let norm = view.bytes(model.weights.layers[next].post_attention_layernorm.id);
        norm_rows(k, norm, cfg.rms_norm_eps, &y[..t * d], &mut sc.xn[..t * d], d);
        // A prediction is only a guess: if the gate's blocks cannot be had, make none (the
        // layer's own routing will meet the same error and report it).
        if router_scores(k, &view, w, &sc.xn[..t * d], t, &mut sc.scores[..t * e]).is_err() {
            return;
        }
        let bias = view.bytes(w.e_score_correction_bias.id);
        let want = (cfg.moe.top_k + self.spec.margin).min(e);
        sc.predicted.clear();
        for tok in 0..t {
            for (i, b) in sc.biased.iter_mut().enumerate() {
                let v = sc.scores[tok * e + i] + f32_at(bias, i);
                *b = if v.is_finite() { v } else { f32::NEG_INFINITY };
            }
            top_k(&mut sc.biased, want, &mut sc.ranked);
            for (rank, &x) in sc.ranked.iter().enumerate() {
                match sc.predicted.iter_mut().find(|p| p.0 == x) {
                    Some(p) => p.1 = p.1.min(rank),
                    None => sc.predicted.push((x, rank)),
                }
            }
        }
        drop((span, view));
        self.guess_prediction(store, next, &sc.predicted, spare_layer);
    }

    /// Records the prediction of `layer` and asks the store to read the guesses it admits.
    fn guess_prediction(&self, store: &Store, layer: usize, predicted: &[(usize, usize)], spare_layer: Option<usize>) {
        let mut h = lock(&self.history);
        let (at_ns, busy_ns) = self.io.needed_busy();
        let p = &mut h.pending[layer];
        p.experts.clear();
        p.experts.extend_from_slice(predicted);
        (p.at_ns, p.busy_ns, p.live) = (at_ns, busy_ns, true);
        let mut by_rank: Vec<(usize, usize)> = predicted.to_vec();
        by_rank.sort_by_key(|&(_, rank)| rank);
        let last_rank = h.ranks.len().saturating_sub(1);
        let guesses: Vec<Guess> = by_rank
            .iter()
            .map(|&(e, rank)| Guess { key: (layer, e), p_use: h.ranks[rank.min(last_rank)].p() })
            .collect();
        let budget = self.budget_bytes(&h, layer);
        let cached_p = h.cached_rates();
        drop(h);
        self.guess(store, guesses, &cached_p, budget, spare_layer);
    }

    /// The bytes of guesses `layer` may get: the device time that was free for them at past
    /// predictions of this layer times the device's read rate; `None` before anything is known.
    fn budget_bytes(&self, h: &History, layer: usize) -> Option<u64> {
        let idle_s = h.idle_s.get(layer).copied().flatten()?;
        let io = self.io.stats();
        if io.busy_ns == 0 {
            return None;
        }
        let rate = io.bytes_read as f64 / (io.busy_ns as f64 / 1e9);
        Some((idle_s * rate) as u64)
    }

    /// Asks the store to read `guesses` (likeliest first) that are not resident or being read;
    /// returns how many it read.
    fn guess(
        &self,
        store: &Store,
        mut guesses: Vec<Guess>,
        cached_p: &[f32],
        budget: Option<u64>,
        spare_layer: Option<usize>,
    ) -> usize {
        if !self.spec.adaptive {
            // Every guess, in disk order, using idle bandwidth only: with more than the
            // device's window already outstanding, a guess would delay reads compute is
            // waiting for.
            if self.io.outstanding_bytes() > self.busy_bytes {
                store.count(|s| s.spec_skipped_busy += 1);
                return 0;
            }
            guesses.retain(|g| !store.expert_requested(g.key));
            guesses.sort_by_key(|g| g.key);
            guesses.dedup_by_key(|g| g.key);
            guesses.sort_by_key(|g| store.disk_position(g.key));
            return store.request(&guesses, Priority::Guess, &AdmitAll);
        }
        let predicted = guesses.clone();
        guesses.retain(|g| !store.expert_requested(g.key));
        let Some(layer) = guesses.first().map(|g| g.key.0) else { return 0 };
        if !self.guessing(layer) {
            store.count(|s| s.layer(layer).guesses_trial_off += guesses.len() as u64);
            return 0;
        }
        if let Some(budget) = budget {
            // Whole guesses, rounded: a guess not read by the routing is still worth its head
            // start if chosen, and cancelled if not.
            let per_guess = self.expert_read_bytes.max(1);
            let fit = ((budget + per_guess / 2) / per_guess) as usize;
            if fit == 0 && !guesses.is_empty() {
                store.count(|s| s.spec_skipped_busy += 1);
            }
            let over = guesses.len().saturating_sub(fit) as u64;
            store.count(|s| s.layer(layer).guesses_over_budget += over);
            guesses.truncate(fit);
        }
        let admission = AdmitLikelier { guesses: &guesses, predicted: &predicted, cached_p, spare_layer };
        store.request(&guesses, Priority::Guess, &admission)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_starts_even_and_follows_observations() {
        let mut r = Rate::default();
        assert!((r.p() - 0.5).abs() < 1e-6);
        for _ in 0..200 {
            r.add(9, 10);
        }
        assert!((r.p() - 0.9).abs() < 0.01, "{}", r.p());
        for _ in 0..400 {
            r.add(1, 10);
        }
        assert!((r.p() - 0.1).abs() < 0.01, "old observations fade: {}", r.p());
    }

    #[test]
    fn a_guess_evicts_only_less_likely_experts() {
        let guesses = [Guess { key: (3, 1), p_use: 0.6 }, Guess { key: (3, 2), p_use: 0.2 }];
        let cached_p = [0.4, 0.4, 0.4, 0.4];
        let predicted = [Guess { key: (3, 5), p_use: 0.9 }];
        let a = AdmitLikelier { guesses: &guesses, predicted: &predicted, cached_p: &cached_p, spare_layer: Some(2) };
        // The guessed layer's own cached expert: the chances decide.
        let cached = Victim { key: (3, 7), pending_guess: None };
        assert!(a.admit(0, cached), "0.6 beats a cached expert used 40% of the time");
        assert!(!a.admit(1, cached), "0.2 does not");
        let likely_guess = Victim { key: (3, 9), pending_guess: Some(0.7) };
        assert!(!a.admit(0, likely_guess), "a pending guess at 0.7 stays");
        let unlikely_guess = Victim { key: (3, 9), pending_guess: Some(0.5) };
        assert!(a.admit(0, unlikely_guess));
        let tie = Victim { key: (3, 0), pending_guess: Some(0.6) };
        assert!(!a.admit(0, tie), "a tie keeps the resident expert");
        let predicted_too = Victim { key: (3, 5), pending_guess: None };
        assert!(!a.admit(0, predicted_too), "a resident expert the prediction ranks at 0.9 stays");
        let imminent = Victim { key: (2, 0), pending_guess: None };
        assert!(!a.admit(0, imminent), "the layer routed before the guessed one keeps its experts");
    }

    #[test]
    fn a_likely_guess_evicts_an_expert_needed_after_it_however_likely() {
        // A batch: some row uses nearly every cached expert again, and nearly every guess.
        let guesses = [Guess { key: (3, 1), p_use: 0.98 }, Guess { key: (3, 2), p_use: 0.4 }];
        let cached_p = [0.99; 5];
        let a = AdmitLikelier { guesses: &guesses, predicted: &[], cached_p: &cached_p, spare_layer: Some(2) };
        let later = Victim { key: (1, 7), pending_guess: None };
        assert!(a.admit(0, later), "layer 1's turn comes after layer 3's (2, 3, 4, 0, 1)");
        assert!(a.admit(0, Victim { key: (4, 0), pending_guess: None }), "layer 4 too");
        assert!(!a.admit(1, later), "a guess less likely than not does not");
        let untrained = [Guess { key: (3, 1), p_use: 0.5 }];
        let a_half = AdmitLikelier { guesses: &untrained, ..a };
        assert!(!a_half.admit(0, later), "an untrained rate (one half) does not");
        assert!(!a.admit(0, Victim { key: (3, 9), pending_guess: None }), "the guessed layer's own: chances decide");
        assert!(!a.admit(0, Victim { key: (2, 0), pending_guess: None }), "the layer routed next: never");
        let at_block_start = AdmitLikelier { spare_layer: None, ..a };
        assert!(at_block_start.admit(0, Victim { key: (2, 0), pending_guess: None }), "layer 2 has had its turn");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
#[path = "prefetcher_window_tests.rs"]
mod window_tests;
