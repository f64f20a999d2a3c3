//! Expert cache policies behind one trait. The pool asks a policy for a victim among the
//! resident experts that may be evicted; the policy only orders them.

/// (layer, expert).
pub type ExpertKey = (usize, usize);

/// How the expert pool chooses what to evict.
pub trait CachePolicy: Send {
    fn name(&self) -> &'static str;
    /// `key` was read into the pool.
    fn on_insert(&mut self, key: ExpertKey);
    /// `key` was used by a token.
    fn on_access(&mut self, key: ExpertKey);
    /// `key` left the pool.
    fn on_evict(&mut self, key: ExpertKey);
    /// Picks one of `candidates` (resident, evictable) to evict.
    fn victim(&mut self, candidates: &[ExpertKey]) -> Option<ExpertKey>;
}

/// Least recently used: evicts the candidate whose last use is oldest.
#[derive(Default)]
pub struct Lru {
    clock: u64,
    last_use: std::collections::HashMap<ExpertKey, u64>,
}

impl CachePolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn on_insert(&mut self, key: ExpertKey) {
        self.on_access(key);
    }

    fn on_access(&mut self, key: ExpertKey) {
        self.clock += 1;
        self.last_use.insert(key, self.clock);
    }

    fn on_evict(&mut self, key: ExpertKey) {
        self.last_use.remove(&key);
    }

    fn victim(&mut self, candidates: &[ExpertKey]) -> Option<ExpertKey> {
        candidates.iter().copied().min_by_key(|k| (self.last_use.get(k).copied().unwrap_or(0), *k))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_evicts_the_oldest_use() {
        let mut p = Lru::default();
        p.on_insert((1, 1));
        p.on_insert((1, 2));
        p.on_access((1, 1));
        assert_eq!(p.victim(&[(1, 1), (1, 2)]), Some((1, 2)));
        assert_eq!(p.victim(&[]), None);
    }
}
