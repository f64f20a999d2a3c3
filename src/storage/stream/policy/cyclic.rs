//! The cyclic policy: evicts from the layer whose next turn comes last.
//!
//! Decoding visits the MoE layers in a fixed cycle, so an expert of layer `l` is next needed
//! at layer `l`'s next turn. When the layer running is `c`, the layers' next turns come in the
//! order `c + 1, c + 2, ..., c - 1, c`: an expert of `c` itself that this step does not use
//! waits a whole cycle, one of `c - 1` one layer less, and so on. So victims come from `c`, then
//! `c - 1`, down to 0, then from the last layer down to `c + 1`; within a layer, the least
//! recently used first. Where every cached expert is used at its layer's next turn (a batch
//! that uses nearly all experts) that is Belady's choice; otherwise an approximation of it.
//!
//! Why not LRU: when a step's experts outnumber the pool, LRU's oldest experts are those of
//! layer `c + 1`, needed next, so it evicts each expert just before its use. On the 6-layer
//! 64-expert synth at 12 GB (233 slots for 320 routed experts) a 16-sequence step read 63.2
//! experts per layer under LRU and 21.4 under this policy (docs/BENCHMARKS.md, "The expert
//! cache by layer turn"). Keys the policy never saw (none, unless a pool handed it keys without
//! `on_insert`) go after all others, lowest rank first.

use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

use super::{CachePolicy, ExpertKey};

/// See the module documentation.
#[derive(Default)]
pub struct Cyclic {
    /// The layer whose routing came last: the layer running.
    current: usize,
    clock: u64,
    last_use: FxHashMap<ExpertKey, u64>,
    /// Per layer, the same entries keyed by last use, oldest first.
    by_layer: BTreeMap<usize, BTreeMap<u64, ExpertKey>>,
}

impl Cyclic {
    /// Rank of a victim (lower goes first): layers `current, current - 1, ..., 0`, then the last
    /// layer down to `current + 1`; the least recently used first within a layer.
    pub(super) fn rank(&self, key: ExpertKey) -> (bool, usize, u64, ExpertKey) {
        let (later, distance) =
            if key.0 <= self.current { (false, self.current - key.0) } else { (true, usize::MAX - key.0) };
        (later, distance, self.last_use.get(&key).copied().unwrap_or(0), key)
    }

    /// Whether the policy has seen `key` (inserted or used, not evicted since).
    pub(super) fn seen(&self, key: ExpertKey) -> bool {
        self.last_use.contains_key(&key)
    }

    /// Cached experts of `layer` the policy has seen.
    pub(super) fn cached_in(&self, layer: usize) -> usize {
        self.by_layer.get(&layer).map_or(0, |m| m.len())
    }

    /// Replaces `out` with the layers holding seen experts and how many each holds, in the order
    /// victims come from: the running layer, the ones before it down to 0, then the last down to
    /// the one after it.
    pub(super) fn layers_in_turn_order(&self, out: &mut Vec<(usize, usize)>) {
        out.clear();
        out.extend(self.by_turn().map(|(&l, m)| (l, m.len())));
    }

    /// Each layer's seen experts (by last use), layers in the order victims come from.
    fn by_turn(&self) -> impl Iterator<Item = (&usize, &BTreeMap<u64, ExpertKey>)> {
        let now_and_before = self.by_layer.range(..=self.current).rev();
        let after = self.by_layer.range(self.current + 1..).rev();
        now_and_before.chain(after)
    }

    /// The seen experts of `layer`, least recently used first.
    pub(super) fn oldest_first(&self, layer: usize) -> impl Iterator<Item = ExpertKey> + '_ {
        self.by_layer.get(&layer).into_iter().flat_map(|m| m.values().copied())
    }

    fn forget(&mut self, key: ExpertKey) {
        if let Some(t) = self.last_use.remove(&key) {
            let emptied = self.by_layer.get_mut(&key.0).is_some_and(|m| {
                m.remove(&t);
                m.is_empty()
            });
            if emptied {
                self.by_layer.remove(&key.0);
            }
        }
    }
}

impl CachePolicy for Cyclic {
    fn name(&self) -> &'static str {
        "cyclic"
    }

    fn on_layer(&mut self, layer: usize) {
        self.current = layer;
    }

    fn on_insert(&mut self, key: ExpertKey) {
        self.on_access(key);
    }

    fn on_access(&mut self, key: ExpertKey) {
        self.forget(key);
        self.clock += 1;
        self.last_use.insert(key, self.clock);
        self.by_layer.entry(key.0).or_default().insert(self.clock, key);
    }

    fn on_evict(&mut self, key: ExpertKey) {
        self.forget(key);
    }

    fn victim(&mut self, candidates: &[ExpertKey]) -> Option<ExpertKey> {
        candidates.iter().copied().min_by_key(|&k| (!self.seen(k), self.rank(k)))
    }

    fn victim_where(
        &mut self,
        resident: &mut dyn Iterator<Item = ExpertKey>,
        evictable: &dyn Fn(ExpertKey) -> bool,
    ) -> Option<ExpertKey> {
        let seen = self.by_turn().flat_map(|(_, m)| m.values().copied()).find(|&k| evictable(k));
        seen.or_else(|| resident.filter(|&k| !self.seen(k) && evictable(k)).min_by_key(|&k| self.rank(k)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn victims_come_from_the_layer_needed_last_and_its_oldest_use_first() {
        let mut p = Cyclic::default();
        for key in [(0, 1), (2, 5), (1, 3), (2, 4), (3, 0), (1, 2)] {
            p.on_access(key);
        }
        p.on_layer(1);
        // Running layer 1: its next turn is a cycle away (oldest use first), then layer 0,
        // then layer 3 and last layer 2, whose turn comes next.
        let order = [(1, 3), (1, 2), (0, 1), (3, 0), (2, 5), (2, 4)];
        let mut resident: Vec<ExpertKey> = order.to_vec();
        for want in order {
            let listed = p.victim(&resident);
            let walked = p.victim_where(&mut resident.iter().copied(), &|k| resident.contains(&k));
            assert_eq!((listed, walked), (Some(want), Some(want)));
            p.on_evict(want);
            resident.retain(|&k| k != want);
        }
        assert!(p.last_use.is_empty() && p.by_layer.is_empty());
    }

    #[test]
    fn keys_never_seen_go_last_in_both_ways_of_choosing() {
        let mut p = Cyclic::default();
        p.on_access((2, 1));
        p.on_layer(2);
        let resident = [(0, 7), (2, 1), (2, 9)];
        let all = |_: ExpertKey| true;
        assert_eq!(p.victim(&resident), Some((2, 1)));
        assert_eq!(p.victim_where(&mut resident.iter().copied(), &all), Some((2, 1)));
        // Only unseen keys left: the nearest to the running layer's turn first, as for seen ones.
        let unseen = [(0, 7), (2, 9)];
        let not_seen = |k: ExpertKey| k != (2, 1);
        assert_eq!(p.victim(&unseen), Some((2, 9)));
        assert_eq!(p.victim_where(&mut resident.iter().copied(), &not_seen), Some((2, 9)));
    }
}
