//! Replaying a trace through an expert pool: under a [`CachePolicy`], and under Belady's
//! offline optimum.

use std::collections::BTreeSet;

use rustc_hash::{FxHashMap, FxHashSet};
use serde::Serialize;

use super::{SimError, Trace, NEVER, PROGRESS_BATCHES};
use crate::storage::stream::policy::{CachePolicy, ExpertKey};

/// What one simulation counted.
#[derive(Clone, Debug, Serialize)]
pub struct SimResult {
    pub policy: String,
    pub capacity: usize,
    pub tokens: usize,
    pub requests: u64,
    pub hits: u64,
    pub misses: u64,
    pub evictions: u64,
    /// hits / requests (0 for an empty trace).
    pub hit_rate: f64,
}

impl SimResult {
    fn new(policy: &str, capacity: usize, trace: &Trace, hits: u64, evictions: u64) -> SimResult {
        let requests = trace.requests();
        assert!(hits <= requests);
        SimResult {
            policy: policy.to_owned(),
            capacity,
            tokens: trace.tokens(),
            requests,
            hits,
            misses: requests - hits,
            evictions,
            hit_rate: if requests == 0 { 0.0 } else { hits as f64 / requests as f64 },
        }
    }

    /// Bytes read per token when one expert is `expert_bytes` bytes: every miss reads one expert.
    pub fn bytes_read_per_token(&self, expert_bytes: f64) -> f64 {
        if self.tokens == 0 {
            return 0.0;
        }
        self.misses as f64 * expert_bytes / self.tokens as f64
    }
}

fn check_capacity(trace: &Trace, capacity: usize) -> Result<(), SimError> {
    if capacity < trace.top_k {
        return Err(SimError::CapacityBelowTopK { capacity, top_k: trace.top_k });
    }
    Ok(())
}

/// Replays `trace` through a pool of `capacity` experts run by `policy` (fresh: it should not
/// have seen other keys).
pub fn simulate(trace: &Trace, capacity: usize, policy: &mut dyn CachePolicy) -> Result<SimResult, SimError> {
    simulate_with_progress(trace, capacity, policy, &|_| {})
}

/// [`simulate`], calling `progress(n)` after every few thousand batches with the batches done since the last call.
pub fn simulate_with_progress(
    trace: &Trace,
    capacity: usize,
    policy: &mut dyn CachePolicy,
    progress: &dyn Fn(usize),
) -> Result<SimResult, SimError> {
    check_capacity(trace, capacity)?;
    let name = policy.name();
    let mut resident: FxHashSet<ExpertKey> = FxHashSet::default();
    let (mut hits, mut misses) = (Vec::with_capacity(trace.top_k), Vec::with_capacity(trace.top_k));
    let (mut hit_count, mut evictions) = (0u64, 0u64);
    for (index, b) in trace.iter().enumerate() {
        policy.on_layer(b.layer);
        hits.clear();
        misses.clear();
        for &e in b.experts {
            let key = (b.layer, e as usize);
            if resident.contains(&key) {
                hits.push(key);
            } else {
                misses.push(key);
            }
        }
        misses.sort_unstable();
        for &key in &misses {
            if resident.len() >= capacity {
                let protected = |k: ExpertKey| k.0 == b.layer && b.experts.contains(&(k.1 as u32));
                let victim = policy.victim_where(&mut resident.iter().copied(), &|k| !protected(k));
                let bad = |why| SimError::BadVictim { policy: name, victim, batch: index, why };
                let v = victim.ok_or_else(|| bad("none although evictable experts are resident"))?;
                if protected(v) {
                    return Err(bad("protected (its batch is being read)"));
                }
                if !resident.remove(&v) {
                    return Err(bad("not resident"));
                }
                policy.on_evict(v);
                evictions += 1;
            }
            resident.insert(key);
            policy.on_insert(key);
        }
        for &key in hits.iter().chain(&misses) {
            policy.on_access(key);
        }
        hit_count += hits.len() as u64;
        assert!(resident.len() <= capacity);
        if (index + 1) % PROGRESS_BATCHES == 0 {
            progress(PROGRESS_BATCHES);
        }
    }
    progress(trace.batch_count() % PROGRESS_BATCHES);
    Ok(SimResult::new(name, capacity, trace, hit_count, evictions))
}

/// For each request (in `expert_ids` order), the index of the next batch using the same expert.
fn next_uses(trace: &Trace) -> Vec<u32> {
    assert!(trace.batch_count() < NEVER as usize);
    let mut next = vec![NEVER; trace.expert_ids.len()];
    let mut seen: FxHashMap<ExpertKey, u32> = FxHashMap::default();
    for index in (0..trace.batch_count()).rev() {
        let b = trace.batch(index);
        for (j, &e) in b.experts.iter().enumerate() {
            let key = (b.layer, e as usize);
            next[index * trace.top_k + j] = seen.insert(key, index as u32).unwrap_or(NEVER);
        }
    }
    next
}

/// Belady's MIN, the offline optimum under the pool's rules: on a miss with a full pool, evicts
/// the resident expert (outside the batch) whose next use is furthest away, never-again first
/// (ties: the higher key). No online policy has more hits on the same trace and capacity.
pub fn belady(trace: &Trace, capacity: usize) -> Result<SimResult, SimError> {
    belady_with_progress(trace, capacity, &|_| {})
}

/// [`belady`] with progress reports, as [`simulate_with_progress`].
pub fn belady_with_progress(trace: &Trace, capacity: usize, progress: &dyn Fn(usize)) -> Result<SimResult, SimError> {
    check_capacity(trace, capacity)?;
    let next = next_uses(trace);
    let mut resident: FxHashMap<ExpertKey, u32> = FxHashMap::default();
    // Resident experts by next use; the victim is the last one outside the batch.
    let mut order: BTreeSet<(u32, ExpertKey)> = BTreeSet::new();
    let mut misses = Vec::with_capacity(trace.top_k);
    let (mut hit_count, mut evictions) = (0u64, 0u64);
    for (index, b) in trace.iter().enumerate() {
        misses.clear();
        for (j, &e) in b.experts.iter().enumerate() {
            let key = (b.layer, e as usize);
            let next_use = next[index * trace.top_k + j];
            if let Some(n) = resident.get_mut(&key) {
                assert!(*n == index as u32, "expert {key:?} is used at batch {index} but was due at {n}");
                order.remove(&(*n, key));
                *n = next_use;
                order.insert((next_use, key));
                hit_count += 1;
            } else {
                misses.push((key, next_use));
            }
        }
        for &(key, next_use) in &misses {
            if resident.len() >= capacity {
                let protected = |k: &ExpertKey| k.0 == b.layer && b.experts.contains(&(k.1 as u32));
                let victim = order.iter().rev().find(|(_, k)| !protected(k)).copied();
                let Some((n, v)) = victim else {
                    return Err(SimError::BadVictim { policy: "belady", victim: None, batch: index, why: "missing" });
                };
                order.remove(&(n, v));
                resident.remove(&v);
                evictions += 1;
            }
            resident.insert(key, next_use);
            order.insert((next_use, key));
        }
        assert!(resident.len() == order.len());
        assert!(resident.len() <= capacity);
        if (index + 1) % PROGRESS_BATCHES == 0 {
            progress(PROGRESS_BATCHES);
        }
    }
    progress(trace.batch_count() % PROGRESS_BATCHES);
    Ok(SimResult::new("belady", capacity, trace, hit_count, evictions))
}

/// Pool sizes worth simulating: `top_k`, doubling, up to the distinct experts of the trace
/// (included: from there on only first uses miss).
pub fn default_capacities(trace: &Trace) -> Vec<usize> {
    let top = trace.distinct_experts().max(trace.top_k);
    let mut out = Vec::new();
    let mut c = trace.top_k;
    while c < top {
        out.push(c);
        c *= 2;
    }
    out.push(top);
    out
}
