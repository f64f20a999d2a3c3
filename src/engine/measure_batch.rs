//! Measuring batched decode for `k3ring bench --batch`: B sequences, each with its own prompt
//! and greedy, decode together in one [`Batcher`](super::Batcher). The clock and the store's
//! counters cover only decode steps in which every sequence decodes (no prefill rows): they start
//! after every prompt is in and a warm-up.
#![forbid(unsafe_code)]

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;

use super::batch::{BatchOptions, BatchRequest, BatchSink, Finished, Ticket};
use super::load::{open_resident, open_streaming, StreamingRun};
use super::measure::{stream_window, MeasureError};
use super::{Engine, GenerateOptions, Sampling};
use crate::config::FfnKind;
use crate::model::attribution::{Attribution, Window};
use crate::model::moe::SPANS_READS_CAN_OVERLAP;
use crate::model::weights::WeightSource;
use crate::model::LayerHook;
use crate::storage::plan::Plan;
use crate::trace::Tracer;

/// What a batch cell runs.
#[derive(Clone, Debug)]
pub struct BatchSpec {
    /// One prompt per sequence; the batch size is their count.
    pub prompts: Vec<Vec<u32>>,
    /// Decode steps of the whole batch before measuring.
    pub warmup: usize,
    /// Decode steps measured; each sequence generates one token per step.
    pub steps: usize,
    /// Prompt tokens per step at most, over all sequences being prefilled.
    pub prefill_chunk: usize,
}

impl BatchSpec {
    pub fn batch(&self) -> usize {
        self.prompts.len()
    }

    /// Tokens each sequence may generate. The prompts go in `prefill_chunk` tokens per step,
    /// first come first served, so the first sequence may start decoding that many steps before
    /// the last; then come the warm-up and the measured steps, and one token more so that no
    /// sequence finishes inside the measured window.
    pub fn max_tokens(&self) -> usize {
        let prompt_tokens: usize = self.prompts.iter().map(Vec::len).sum();
        prompt_tokens.div_ceil(self.prefill_chunk.max(1)) + self.warmup + self.steps + 1
    }

    /// Positions of one sequence slot.
    pub fn context(&self) -> usize {
        self.prompts.iter().map(Vec::len).max().unwrap_or(0) + self.max_tokens()
    }

    pub fn options(&self) -> BatchOptions {
        BatchOptions {
            max_batch: self.batch(),
            prefill_chunk: self.prefill_chunk,
            context: self.context(),
            draft: None,
        }
    }
}

/// One batch cell's run. Per-step figures are over the measured steps only.
#[derive(Clone, Debug, Default, Serialize)]
pub struct BatchMeasurement {
    pub batch: usize,
    /// Each sequence's ids, from its first token to the end of the measured window (compared
    /// with its solo run, not written out).
    #[serde(skip)]
    pub ids: Vec<Vec<u32>>,
    pub seconds_per_step: f64,
    /// Tokens generated per second, all sequences together.
    pub tokens_per_second: f64,
    pub trunk_bytes_per_step: f64,
    pub expert_bytes_per_step: f64,
    /// Distinct experts per MoE layer per step: each layer's routing asks the expert pool once
    /// per step for the union of its rows' experts, and the pool counts every expert of that
    /// union (`routed_experts`), whether it was resident, in flight or read.
    pub distinct_experts_per_layer_step: f64,
    /// Experts read per MoE layer per step (the union's misses, plus any guesses).
    pub expert_reads_per_layer_step: f64,
    /// Bytes read per second of I/O busy time.
    pub read_rate_busy: f64,
    /// Seconds per step the compute threads spent checking experts against their checksums
    /// (`--no-verify-experts`: 0); the bounds leave it out, like the resident compute.
    pub expert_verify_seconds_per_step: f64,
    /// Seconds per step spent hashing experts while compute waited for a read (inside the
    /// stalls, not on the compute path).
    pub expert_verify_waiting_seconds_per_step: f64,
    pub plan: Option<Plan>,
    /// Resident runs only: seconds per step of the compute that a layer's expert reads can
    /// overlap without prediction (the shared experts and the routed experts' own compute,
    /// [`SPANS_READS_CAN_OVERLAP`]), from the run's trace spans.
    pub overlappable_seconds_per_step: Option<f64>,
    /// The measured steps began inside adaptive speculation's first trial (see
    /// [`super::measure::Measurement::speculation_trial_open`]).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub speculation_trial_open: bool,
    /// Resident runs only: the measured steps per operation class.
    #[serde(skip)]
    pub attribution: Option<Window>,
}

/// Records each sequence's ids by ticket (tickets count from 0 in submission order).
struct Ids(Vec<Vec<u32>>);

impl BatchSink for Ids {
    fn token(&mut self, ticket: Ticket, id: u32) -> bool {
        if let Some(ids) = usize::try_from(ticket).ok().and_then(|t| self.0.get_mut(t)) {
            ids.push(id);
        }
        false
    }

    fn finished(&mut self, _finished: Finished) {}
}

/// Runs `spec` through a batcher: the prompts, the warm-up, then the measured steps, calling
/// `between` right before them. Returns each sequence's ids and the measured seconds.
fn decode_batch<S: WeightSource + LayerHook>(
    engine: &Engine<S>,
    spec: &BatchSpec,
    mut between: impl FnMut(),
) -> Result<(Vec<Vec<u32>>, f64), MeasureError> {
    let batch = spec.batch();
    let mut batcher = engine.batcher(spec.options())?;
    if batcher.slots() < batch {
        return Err(MeasureError::Slots { asked: batch, got: batcher.slots() });
    }
    let max_tokens = spec.max_tokens();
    for prompt in &spec.prompts {
        let request = BatchRequest {
            constraint: None,
            prompt: prompt.clone(),
            max_tokens,
            sampling: Sampling::default(),
            stop_ids: Vec::new(),
            logprobs: None,
            prompt_logprobs: false,
        };
        batcher.submit(request)?;
    }
    let mut sink = Ids(vec![Vec::new(); batch]);
    // Every step takes up to `prefill_chunk` prompt tokens, so the prompts are in after at most
    // `max_tokens` steps; the bound only guards the loop.
    for _ in 0..max_tokens {
        if sink.0.iter().all(|ids| !ids.is_empty()) {
            break;
        }
        batcher.step(&mut sink)?;
    }
    for _ in 0..spec.warmup {
        batcher.step(&mut sink)?;
    }
    let (decode_before, prefill_before) = (batcher.stats().decode_rows, batcher.stats().prefill_rows);
    between();
    let start = Instant::now();
    for _ in 0..spec.steps {
        batcher.step(&mut sink)?;
    }
    let seconds = start.elapsed().as_secs_f64();
    let decode_rows = batcher.stats().decode_rows - decode_before;
    let prefill_rows = batcher.stats().prefill_rows - prefill_before;
    if decode_rows != (batch * spec.steps) as u64 || prefill_rows != 0 {
        return Err(MeasureError::Window { batch, steps: spec.steps, decode_rows, prefill_rows });
    }
    Ok((sink.0, seconds))
}

/// Measures a batch cell streaming under `run` (whose `sequences`, `chunk` and `context` the
/// caller sizes for `spec`).
pub fn measure_streaming_batch(
    model: &Path,
    trunk: &Path,
    run: &StreamingRun,
    kernels: kernels::Kernels,
    spec: &BatchSpec,
) -> Result<BatchMeasurement, MeasureError> {
    let (opened, plan) = open_streaming(model, trunk, run, kernels, |_| {})?;
    if plan.sequences < spec.batch() {
        return Err(MeasureError::Slots { asked: spec.batch(), got: plan.sequences });
    }
    let engine = &opened.engine;
    let ((ids, seconds), window) = stream_window(engine, |start| decode_batch(engine, spec, start))?;
    let (before, after) = (&window.before, &window.after);
    let steps = spec.steps.max(1) as f64;
    let moe_layers = engine.model.cfg.layers.iter().filter(|l| matches!(l.ffn, FfnKind::Moe)).count().max(1) as f64;
    Ok(BatchMeasurement {
        batch: spec.batch(),
        ids,
        seconds_per_step: seconds / steps,
        tokens_per_second: (spec.batch() * spec.steps) as f64 / seconds.max(1e-9),
        trunk_bytes_per_step: (after.trunk_bytes_read - before.trunk_bytes_read) as f64 / steps,
        expert_bytes_per_step: (after.expert_bytes_read - before.expert_bytes_read) as f64 / steps,
        distinct_experts_per_layer_step: (after.routed_experts - before.routed_experts) as f64 / steps / moe_layers,
        expert_reads_per_layer_step: (after.expert_reads - before.expert_reads) as f64 / steps / moe_layers,
        read_rate_busy: window.read_rate_busy(),
        expert_verify_seconds_per_step: (after.expert_verify_seconds - before.expert_verify_seconds) / steps,
        expert_verify_waiting_seconds_per_step: (after.expert_verify_waiting_seconds
            - before.expert_verify_waiting_seconds)
            / steps,
        plan: Some(plan),
        overlappable_seconds_per_step: None,
        speculation_trial_open: super::measure::trial_open(run, before),
        attribution: None,
    })
}

/// Measures a batch cell with every weight mapped and already in the page cache (no I/O while
/// timing): the resident compute per step of `spec.batch()` rows.
pub fn measure_resident_batch(
    model: &Path,
    kernels: kernels::Kernels,
    threads: usize,
    spec: &BatchSpec,
) -> Result<BatchMeasurement, MeasureError> {
    let mut opened = open_resident(model, threads, kernels)?;
    // As in `measure::measure_resident`: a few hundred kept spans per step, far below the
    // resolution of a step over gigabytes of weights.
    let tracer = Arc::new(Tracer::new(true));
    opened.engine.model.tracer = Some(Arc::clone(&tracer));
    let attribution = Arc::new(Attribution::new());
    opened.engine.model.attribution = Some(Arc::clone(&attribution));
    let (ids, seconds) = decode_batch(&opened.engine, spec, || {
        tracer.reset_metrics();
        attribution.reset();
    })?;
    let steps = spec.steps.max(1) as f64;
    Ok(BatchMeasurement {
        batch: spec.batch(),
        ids,
        seconds_per_step: seconds / steps,
        tokens_per_second: (spec.batch() * spec.steps) as f64 / seconds.max(1e-9),
        overlappable_seconds_per_step: tracer.span_seconds(&SPANS_READS_CAN_OVERLAP).map(|s| s / steps),
        attribution: Some(Window::of_steps(&attribution, spec.steps, seconds)),
        ..BatchMeasurement::default()
    })
}

/// Each prompt's greedy ids from a solo run (one sequence, [`Engine::generate`]) with every
/// weight resident, `max_tokens` each: what every batch must reproduce.
pub fn solo_ids(
    model: &Path,
    kernels: kernels::Kernels,
    threads: usize,
    prompts: &[Vec<u32>],
    max_tokens: usize,
    prefill_chunk: usize,
) -> Result<Vec<Vec<u32>>, MeasureError> {
    let opened = open_resident(model, threads, kernels)?;
    let opts = GenerateOptions { gen: max_tokens, prefill_chunk, ..GenerateOptions::default() };
    prompts.iter().map(|p| Ok(opened.engine.generate(p, &opts, |_| {})?.generated_ids)).collect()
}

/// Whether each sequence's ids are a prefix of its solo run's (a batch cell stops after its
/// window, so its sequences have generated fewer tokens than the solo runs).
pub fn ids_match_solo(batch: &[Vec<u32>], solo: &[Vec<u32>]) -> bool {
    batch.len() <= solo.len() && batch.iter().zip(solo).all(|(b, s)| !b.is_empty() && s.starts_with(b))
}

/// Distinct experts that `batch` tokens choose per layer when each takes `top_k` of
/// `n_experts` uniformly at random: `E (1 - (1 - k/E)^B)`.
pub fn expected_distinct_experts(n_experts: usize, top_k: usize, batch: usize) -> f64 {
    let e = n_experts as f64;
    let miss = 1.0 - top_k as f64 / e.max(1.0);
    e * (1.0 - miss.powi(i32::try_from(batch).unwrap_or(i32::MAX)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_expected_union_is_top_k_for_one_token_and_grows_toward_every_expert() {
        assert!((expected_distinct_experts(256, 16, 1) - 16.0).abs() < 1e-9);
        // The figure: 16 tokens' top-16 of 256 share about 165 experts.
        let sixteen = expected_distinct_experts(256, 16, 16);
        assert!((sixteen - 164.8).abs() < 0.1, "{sixteen}");
        assert!(expected_distinct_experts(256, 16, 1000) <= 256.0);
    }

    #[test]
    fn the_window_leaves_room_for_the_prefill_lag() {
        let spec =
            BatchSpec { prompts: vec![vec![1; 7], vec![2; 9], vec![3; 20]], warmup: 2, steps: 4, prefill_chunk: 8 };
        // 36 prompt tokens at 8 per step: the last sequence starts decoding at step 5.
        assert_eq!(spec.max_tokens(), 5 + 2 + 4 + 1);
        assert_eq!(spec.context(), 20 + spec.max_tokens());
        assert_eq!(spec.options().step_rows(), 3 + 8);
    }

    #[test]
    fn batch_ids_must_be_prefixes_of_the_solo_runs() {
        let solo = vec![vec![1, 2, 3], vec![4, 5, 6]];
        assert!(ids_match_solo(&[vec![1, 2], vec![4, 5, 6]], &solo));
        assert!(!ids_match_solo(&[vec![1, 2], vec![4, 6]], &solo));
        assert!(!ids_match_solo(&[vec![], vec![4]], &solo), "a sequence that produced nothing fails");
        assert!(!ids_match_solo(&[vec![1], vec![4], vec![7]], &solo), "every sequence needs a solo run");
    }
}
