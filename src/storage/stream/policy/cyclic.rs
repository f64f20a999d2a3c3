//! The cyclic policy: evicts from the layer whose next turn comes last.
//!
//! Decoding visits the MoE layers in a fixed cycle, so an expert of layer `l` is next needed
//! at layer `l`'s next turn. When the layer running is `c`, the layers' next turns come in the
//! order `c + 1, c + 2, ..., c - 1, c`: an expert of `c` itself that this step does not use
//! waits a whole cycle, one of `c - 1` one layer less, and so on. Belady's rule (evict what is
//! needed last) therefore takes victims from `c`, then `c - 1`, down to 0, then from the last
//! layer down to `c + 1`; within a layer, the least recently used first.
//!
//! Why not LRU: when a step's experts outnumber the pool (a batch of 16 sequences uses 63 of 64
//! experts per layer), LRU evicts each expert just before its next use and misses every time.
//! On such a trace (6 layers, 64 experts, 16 x 16 routed per layer, a pool of 233) LRU read 380
//! experts per step and this policy 184, with Belady's optimum at 180; on one sequence it read
//! 41 against LRU's 44.

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
    fn rank(&self, key: ExpertKey) -> (bool, usize, u64, ExpertKey) {
        let (later, distance) =
            if key.0 <= self.current { (false, self.current - key.0) } else { (true, usize::MAX - key.0) };
        (later, distance, self.last_use.get(&key).copied().unwrap_or(0), key)
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
        candidates.iter().copied().min_by_key(|&k| self.rank(k))
    }

    fn victim_where(
        &mut self,
        _resident: &mut dyn Iterator<Item = ExpertKey>,
        evictable: &dyn Fn(ExpertKey) -> bool,
    ) -> Option<ExpertKey> {
        let now_and_before = self.by_layer.range(..=self.current).rev();
        let after = self.by_layer.range(self.current + 1..).rev();
        now_and_before.chain(after).flat_map(|(_, m)| m.values().copied()).find(|&k| evictable(k))
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
}
