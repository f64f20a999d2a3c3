//! Expert cache policies behind one trait. The pool asks a policy for a victim among the
//! resident experts that may be evicted; the policy only orders them.
//!
//! How the pool drives a policy (`stream/expert_pool.rs`; `cache_sim` replays the same calls):
//! for each layer it first names the layer (`on_layer`), then reads the batch's misses in disk
//! order, calling `victim` + `on_evict` when no slot is free and then `on_insert`, and afterwards
//! uses every expert of the batch once (`on_access`: hits first, then the misses). So the
//! request that made the pool insert a key reaches the policy as the `on_access` right after
//! `on_insert`: a policy that counts reuse must not count that access. Experts of the current batch are never
//! candidates.
//!
//! Threads: a policy lives inside the pool's state and runs under its lock (compute thread).
//! Allocation: per-key metadata grows with the keys the pool inserts (at most its slot count, plus
//! the bounded history that S3-FIFO and LFU keep of evicted keys).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use rustc_hash::{FxHashMap, FxHashSet};

mod cyclic;
mod even;
pub use cyclic::Cyclic;
pub use even::Even;

/// (layer, expert).
pub type ExpertKey = (usize, usize);

/// Names accepted by [`policy_by_name`], in table order.
pub const POLICY_NAMES: [&str; 5] = ["lru", "s3fifo", "lfu", "cyclic", "even"];

/// The policy of a run that names none (`--policy`, [`super::StoreOptions`]).
pub const DEFAULT_POLICY: &str = "even";

/// A policy by name, for a pool of `capacity` experts; `None` for an unknown name.
pub fn policy_by_name(name: &str, capacity: usize) -> Option<Box<dyn CachePolicy>> {
    match name {
        "lru" => Some(Box::new(Lru::default())),
        "s3fifo" => Some(Box::new(S3Fifo::new(capacity))),
        "lfu" => Some(Box::new(Lfu::new(capacity))),
        "cyclic" => Some(Box::new(Cyclic::default())),
        "even" => Some(Box::new(Even::default())),
        _ => None,
    }
}

/// How the expert pool chooses what to evict.
pub trait CachePolicy: Send {
    fn name(&self) -> &'static str;
    /// The routing of `layer` came: the pool is about to read its misses.
    fn on_layer(&mut self, _layer: usize) {}
    /// `key` was read into the pool.
    fn on_insert(&mut self, key: ExpertKey);
    /// `key` was used by a token.
    fn on_access(&mut self, key: ExpertKey);
    /// `key` left the pool.
    fn on_evict(&mut self, key: ExpertKey);
    /// Picks one of `candidates` (resident, evictable) to evict.
    fn victim(&mut self, candidates: &[ExpertKey]) -> Option<ExpertKey>;

    /// Whether looking for a victim changes the policy's state even when the search finds none
    /// (S3-FIFO promotes keys and lowers their counters as it walks its queues). The pool then
    /// offers a guess only the policy's first choice and lets admission accept or refuse it,
    /// since searching on among the keys admission allows could wear the whole order down and
    /// still read nothing.
    fn searching_changes_state(&self) -> bool {
        false
    }

    /// Picks the key [`CachePolicy::victim`] would pick from the keys of `resident` for which
    /// `evictable` holds, for a caller that would rather not list them (the simulator, whose pool
    /// holds up to every expert of the model). The default lists them and calls `victim`; the
    /// policies here walk their own order instead and stop at the first evictable key, so they
    /// never consume `resident`.
    fn victim_where(
        &mut self,
        resident: &mut dyn Iterator<Item = ExpertKey>,
        evictable: &dyn Fn(ExpertKey) -> bool,
    ) -> Option<ExpertKey> {
        let candidates: Vec<ExpertKey> = resident.filter(|&k| evictable(k)).collect();
        self.victim(&candidates)
    }
}

/// Least recently used: evicts the candidate whose last use is oldest.
#[derive(Default)]
pub struct Lru {
    clock: u64,
    last_use: FxHashMap<ExpertKey, u64>,
    /// The same entries keyed by last use, oldest first.
    order: BTreeMap<u64, ExpertKey>,
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
        if let Some(old) = self.last_use.insert(key, self.clock) {
            self.order.remove(&old);
        }
        self.order.insert(self.clock, key);
        debug_assert_eq!(self.order.len(), self.last_use.len());
    }

    fn on_evict(&mut self, key: ExpertKey) {
        if let Some(t) = self.last_use.remove(&key) {
            self.order.remove(&t);
        }
        debug_assert_eq!(self.order.len(), self.last_use.len());
    }

    fn victim(&mut self, candidates: &[ExpertKey]) -> Option<ExpertKey> {
        candidates.iter().copied().min_by_key(|k| (self.last_use.get(k).copied().unwrap_or(0), *k))
    }

    fn victim_where(
        &mut self,
        _resident: &mut dyn Iterator<Item = ExpertKey>,
        evictable: &dyn Fn(ExpertKey) -> bool,
    ) -> Option<ExpertKey> {
        self.order.values().copied().find(|&k| evictable(k))
    }
}

/// Share of the capacity given to S3-FIFO's small queue: 10%, the paper's choice ("10%
/// generalizes well" across its traces; libCacheSim `S3FIFO.c` `small-size-ratio=0.10`).
const S3FIFO_SMALL_PERCENT: usize = 10;
/// The 2-bit frequency counter saturates here.
const S3FIFO_FREQ_MAX: u8 = 3;
/// Reuses, while in the small queue, that promote a key to the main queue instead of evicting
/// it. 1 is the setting of the SOSP'23 evaluation (libCacheSim's later `S3FIFO.c` default is 2).
/// With 16 of 896 experts per layer a second reuse within the small queue's window (10% of the
/// pool) is rare: on a synthetic K3-shaped trace (Zipf 0.8 per layer, 200 tokens) 1 gave 31.6%
/// hits at 4096 experts against 31.2% for 2, and 52.4% against 51.8% at 16384.
const S3FIFO_MOVE_TO_MAIN_FREQ: u8 = 1;
/// A queue is compacted (stale entries dropped) when it is longer than twice its live keys plus
/// this slack, so stale entries never outnumber live ones by much.
const S3FIFO_STALE_SLACK: usize = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Queue {
    Small,
    Main,
}

struct S3Meta {
    queue: Queue,
    /// Reuses since insertion (or since the last promotion or reinsertion), 0..=3.
    freq: u8,
    /// Inserted and not used yet: the next access is the request that caused the insert.
    fresh: bool,
    /// Matches the key's one live queue entry; other entries of the key are stale.
    seq: u64,
}

/// S3-FIFO (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23): a small
/// FIFO (10% of the capacity) that filters one-hit keys, a main FIFO with 2-bit-counter
/// reinsertion (CLOCK-like), and a ghost FIFO of keys recently evicted from the small queue
/// (as many as the main queue holds); a key found in the ghost goes straight to main.
///
/// Adapted to the pool: the policy never evicts by itself; `victim` runs the algorithm's
/// eviction walk (promotions and reinsertions included) and returns the first key it would
/// evict that is a candidate. A protected key the walk would evict stays where it is (at the
/// tail) and the walk goes on to the next key; if the queue the algorithm chose has nothing to
/// evict, the other queue is walked. The key leaves the queues in `on_evict` (lazily: its queue
/// entry turns stale), and only keys evicted from the small queue enter the ghost.
pub struct S3Fifo {
    small_target: usize,
    ghost_capacity: usize,
    meta: FxHashMap<ExpertKey, S3Meta>,
    /// Front is the tail of the paper's queues (oldest entry).
    small: VecDeque<(ExpertKey, u64)>,
    main: VecDeque<(ExpertKey, u64)>,
    small_live: usize,
    main_live: usize,
    ghost: VecDeque<(ExpertKey, u64)>,
    ghost_seq: FxHashMap<ExpertKey, u64>,
    seq: u64,
}

impl S3Fifo {
    /// A policy for a pool of `capacity` experts (at least 1).
    pub fn new(capacity: usize) -> S3Fifo {
        let capacity = capacity.max(1);
        let small_target = (capacity * S3FIFO_SMALL_PERCENT / 100).max(1);
        S3Fifo {
            small_target,
            ghost_capacity: capacity.saturating_sub(small_target).max(1),
            meta: FxHashMap::default(),
            small: VecDeque::new(),
            main: VecDeque::new(),
            small_live: 0,
            main_live: 0,
            ghost: VecDeque::new(),
            ghost_seq: FxHashMap::default(),
            seq: 0,
        }
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    fn push(&mut self, queue: Queue, key: ExpertKey, seq: u64) {
        let (q, live) = match queue {
            Queue::Small => (&mut self.small, self.small_live),
            Queue::Main => (&mut self.main, self.main_live),
        };
        q.push_back((key, seq));
        if q.len() > 2 * live + S3FIFO_STALE_SLACK {
            let meta = &self.meta;
            q.retain(|(k, s)| meta.get(k).is_some_and(|m| m.seq == *s && m.queue == queue));
            assert!(q.len() == live, "S3-FIFO queue {queue:?} holds {} live entries, counted {live}", q.len());
        }
    }

    fn push_ghost(&mut self, key: ExpertKey) {
        let seq = self.next_seq();
        self.ghost.push_back((key, seq));
        self.ghost_seq.insert(key, seq);
        while self.ghost.len() > self.ghost_capacity {
            let Some((k, s)) = self.ghost.pop_front() else { break };
            if self.ghost_seq.get(&k) == Some(&s) {
                self.ghost_seq.remove(&k);
            }
        }
        assert!(self.ghost_seq.len() <= self.ghost_capacity);
    }

    /// The live entry at the front of `queue`, dropping stale entries on the way.
    fn pop_live(&mut self, queue: Queue) -> Option<(ExpertKey, u64)> {
        loop {
            let entry = match queue {
                Queue::Small => self.small.pop_front(),
                Queue::Main => self.main.pop_front(),
            }?;
            if self.meta.get(&entry.0).is_some_and(|m| m.seq == entry.1 && m.queue == queue) {
                return Some(entry);
            }
        }
    }

    /// Walks the small queue from its tail: reused keys move to main, the first other key that
    /// may go is the victim; protected keys keep their place.
    fn walk_small(&mut self, evictable: &dyn Fn(ExpertKey) -> bool) -> Option<ExpertKey> {
        let mut kept = Vec::new();
        let mut found = None;
        while let Some((key, seq)) = self.pop_live(Queue::Small) {
            let promote = self.meta.get(&key).is_some_and(|m| m.freq >= S3FIFO_MOVE_TO_MAIN_FREQ);
            if promote {
                let new_seq = self.next_seq();
                if let Some(m) = self.meta.get_mut(&key) {
                    m.queue = Queue::Main;
                    m.freq = 0;
                    m.seq = new_seq;
                }
                self.small_live -= 1;
                self.main_live += 1;
                self.push(Queue::Main, key, new_seq);
                continue;
            }
            kept.push((key, seq));
            if evictable(key) {
                found = Some(key);
                break;
            }
        }
        for entry in kept.into_iter().rev() {
            self.small.push_front(entry);
        }
        found
    }

    /// Walks the main queue from its tail: keys with a nonzero counter are reinserted at the
    /// head with the counter decremented, the first other key that may go is the victim.
    fn walk_main(&mut self, evictable: &dyn Fn(ExpertKey) -> bool) -> Option<ExpertKey> {
        let mut kept = Vec::new();
        let mut found = None;
        // Each live entry is reinserted at most FREQ_MAX times, then kept or chosen.
        let steps_max = (usize::from(S3FIFO_FREQ_MAX) + 1) * self.main.len() + 1;
        for _ in 0..steps_max {
            let Some((key, seq)) = self.pop_live(Queue::Main) else { break };
            let Some(m) = self.meta.get_mut(&key) else { continue };
            if m.freq > 0 {
                m.freq -= 1;
                self.main.push_back((key, seq));
                continue;
            }
            kept.push((key, seq));
            if evictable(key) {
                found = Some(key);
                break;
            }
        }
        for entry in kept.into_iter().rev() {
            self.main.push_front(entry);
        }
        found
    }

    /// The algorithm's eviction, restricted to keys for which `evictable` holds. Evicts from the
    /// small queue when it holds at least its share, else from main (the paper's Algorithm 1).
    fn pick(&mut self, evictable: &dyn Fn(ExpertKey) -> bool) -> Option<ExpertKey> {
        let found = if self.small_live >= self.small_target {
            self.walk_small(evictable).or_else(|| self.walk_main(evictable))
        } else {
            self.walk_main(evictable).or_else(|| self.walk_small(evictable))
        };
        assert!(self.small_live + self.main_live == self.meta.len());
        found
    }
}

impl CachePolicy for S3Fifo {
    fn name(&self) -> &'static str {
        "s3fifo"
    }

    fn searching_changes_state(&self) -> bool {
        true
    }

    fn on_insert(&mut self, key: ExpertKey) {
        // Inserted again without an eviction in between: start over as a new key.
        if let Some(old) = self.meta.remove(&key) {
            match old.queue {
                Queue::Small => self.small_live -= 1,
                Queue::Main => self.main_live -= 1,
            }
        }
        let queue = if self.ghost_seq.remove(&key).is_some() { Queue::Main } else { Queue::Small };
        let seq = self.next_seq();
        self.meta.insert(key, S3Meta { queue, freq: 0, fresh: true, seq });
        match queue {
            Queue::Small => self.small_live += 1,
            Queue::Main => self.main_live += 1,
        }
        self.push(queue, key, seq);
    }

    fn on_access(&mut self, key: ExpertKey) {
        if let Some(m) = self.meta.get_mut(&key) {
            if m.fresh {
                m.fresh = false;
            } else {
                m.freq = (m.freq + 1).min(S3FIFO_FREQ_MAX);
            }
        }
    }

    fn on_evict(&mut self, key: ExpertKey) {
        let Some(old) = self.meta.remove(&key) else { return };
        match old.queue {
            Queue::Small => {
                self.small_live -= 1;
                self.push_ghost(key);
            }
            Queue::Main => self.main_live -= 1,
        }
        assert!(self.small_live + self.main_live == self.meta.len());
    }

    fn victim(&mut self, candidates: &[ExpertKey]) -> Option<ExpertKey> {
        let allowed: FxHashSet<ExpertKey> = candidates.iter().copied().collect();
        // A candidate the policy was never told about (no insert) goes first, lowest key.
        self.pick(&|k| allowed.contains(&k)).or_else(|| candidates.iter().copied().min())
    }

    fn victim_where(
        &mut self,
        _resident: &mut dyn Iterator<Item = ExpertKey>,
        evictable: &dyn Fn(ExpertKey) -> bool,
    ) -> Option<ExpertKey> {
        self.pick(evictable)
    }
}

/// LFU counters are halved every `capacity * LFU_AGING_FACTOR` accesses. 10 is Caffeine's reset
/// period for its TinyLFU sketch (`FrequencySketch.ensureCapacity`: `sampleSize = 10 * maximum`):
/// long enough that a resident key's count reflects many reuses, short enough that a key hot an
/// epoch ago but idle since falls below keys in use now.
pub const LFU_AGING_FACTOR: u64 = 10;

#[derive(Clone, Copy)]
struct LfuEntry {
    count: u32,
    last_use: u64,
    resident: bool,
}

/// Least frequently used with aging: each key's access count (kept across evictions, so a key
/// read again returns with its history) is halved every `capacity * LFU_AGING_FACTOR` accesses;
/// the victim is the lowest count, ties going to the older last use, then the lower key.
/// Non-resident keys whose count halves to 0 are forgotten, so the history stays bounded by the
/// keys used in the last few aging periods.
pub struct Lfu {
    aging_period: u64,
    accesses: u64,
    clock: u64,
    entries: FxHashMap<ExpertKey, LfuEntry>,
    /// Resident keys by (count, last use, key), the victim first.
    order: BTreeSet<(u32, u64, ExpertKey)>,
}

impl Lfu {
    /// A policy for a pool of `capacity` experts (at least 1).
    pub fn new(capacity: usize) -> Lfu {
        Lfu {
            aging_period: (capacity.max(1) as u64).saturating_mul(LFU_AGING_FACTOR),
            accesses: 0,
            clock: 0,
            entries: FxHashMap::default(),
            order: BTreeSet::new(),
        }
    }

    /// Applies `f` to the key's entry (created empty if unknown), keeping `order` in step.
    fn update(&mut self, key: ExpertKey, f: impl FnOnce(&mut LfuEntry)) {
        let e = self.entries.entry(key).or_insert(LfuEntry { count: 0, last_use: 0, resident: false });
        if e.resident {
            self.order.remove(&(e.count, e.last_use, key));
        }
        f(e);
        if e.resident {
            self.order.insert((e.count, e.last_use, key));
        } else if e.count == 0 {
            self.entries.remove(&key);
        }
    }

    fn age(&mut self) {
        self.entries.retain(|_, e| {
            e.count /= 2;
            e.resident || e.count > 0
        });
        self.order = self.entries.iter().filter(|(_, e)| e.resident).map(|(&k, e)| (e.count, e.last_use, k)).collect();
    }
}

impl CachePolicy for Lfu {
    fn name(&self) -> &'static str {
        "lfu"
    }

    fn on_insert(&mut self, key: ExpertKey) {
        self.clock += 1;
        let now = self.clock;
        self.update(key, |e| {
            e.resident = true;
            e.last_use = now;
        });
    }

    fn on_access(&mut self, key: ExpertKey) {
        self.clock += 1;
        self.accesses += 1;
        let now = self.clock;
        self.update(key, |e| {
            e.count = e.count.saturating_add(1);
            e.last_use = now;
        });
        if self.accesses.is_multiple_of(self.aging_period) {
            self.age();
        }
        debug_assert!(self.order.len() <= self.entries.len());
    }

    fn on_evict(&mut self, key: ExpertKey) {
        if self.entries.contains_key(&key) {
            self.update(key, |e| e.resident = false);
        }
    }

    fn victim(&mut self, candidates: &[ExpertKey]) -> Option<ExpertKey> {
        let rank = |k: &ExpertKey| self.entries.get(k).map_or((0, 0, *k), |e| (e.count, e.last_use, *k));
        candidates.iter().copied().min_by_key(rank)
    }

    fn victim_where(
        &mut self,
        _resident: &mut dyn Iterator<Item = ExpertKey>,
        evictable: &dyn Fn(ExpertKey) -> bool,
    ) -> Option<ExpertKey> {
        self.order.iter().map(|&(_, _, k)| k).find(|&k| evictable(k))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drives `p` the way the pool does for one batch of one layer: misses (given) are inserted,
    /// then every key is used once.
    fn batch(p: &mut dyn CachePolicy, hits: &[usize], misses: &[usize]) {
        for &e in misses {
            p.on_insert((0, e));
        }
        for &e in hits.iter().chain(misses) {
            p.on_access((0, e));
        }
    }

    fn keys(es: &[usize]) -> Vec<ExpertKey> {
        es.iter().map(|&e| (0, e)).collect()
    }

    #[test]
    fn lru_evicts_the_oldest_use() {
        let mut p = Lru::default();
        p.on_insert((1, 1));
        p.on_insert((1, 2));
        p.on_access((1, 1));
        assert_eq!(p.victim(&[(1, 1), (1, 2)]), Some((1, 2)));
        assert_eq!(p.victim(&[]), None);
    }

    #[test]
    fn lru_victim_where_skips_protected_keys_in_age_order() {
        let mut p = Lru::default();
        batch(&mut p, &[], &[1, 2, 3, 4]);
        p.on_access((0, 1));
        // Age order is 2, 3, 4, 1; 2 is protected.
        let got = p.victim_where(&mut std::iter::empty(), &|k| k != (0, 2));
        assert_eq!(got, Some((0, 3)));
        assert_eq!(p.victim(&keys(&[1, 3, 4])), Some((0, 3)));
        p.on_evict((0, 3));
        assert_eq!(p.victim_where(&mut std::iter::empty(), &|_| true), Some((0, 2)));
    }

    #[test]
    fn s3fifo_keeps_a_reused_key_and_evicts_the_one_hit_key_first() {
        // Capacity 10: small queue of 1, ghost of 9.
        let mut p = S3Fifo::new(10);
        batch(&mut p, &[], &[1]);
        batch(&mut p, &[], &[2]);
        batch(&mut p, &[1], &[]);
        // 1 (reused) is at the small queue's tail: it moves to main and 2 (one hit) goes.
        assert_eq!(p.victim(&keys(&[1, 2])), Some((0, 2)));
        p.on_evict((0, 2));
        assert_eq!(p.meta.get(&(0, 1)).map(|m| m.queue), Some(Queue::Main));
        // 2 was evicted from the small queue, so it is remembered by the ghost and returns to main.
        batch(&mut p, &[], &[2]);
        assert_eq!(p.meta.get(&(0, 2)).map(|m| m.queue), Some(Queue::Main));
        batch(&mut p, &[], &[3]);
        assert_eq!(p.meta.get(&(0, 3)).map(|m| m.queue), Some(Queue::Small));
    }

    #[test]
    fn s3fifo_does_not_count_the_inserting_access_as_reuse() {
        let mut p = S3Fifo::new(10);
        batch(&mut p, &[], &[1, 2]);
        assert_eq!(p.meta.get(&(0, 1)).map(|m| m.freq), Some(0));
        // Both are one-hit keys: the older one (1) leaves first, nothing is promoted.
        assert_eq!(p.victim(&keys(&[1, 2])), Some((0, 1)));
        assert_eq!(p.main_live, 0);
    }

    #[test]
    fn s3fifo_skips_a_protected_tail_and_keeps_its_place() {
        let mut p = S3Fifo::new(10);
        batch(&mut p, &[], &[1, 2, 3]);
        // 1 would go but is protected: 2 goes instead, and 1 stays at the tail.
        assert_eq!(p.victim(&keys(&[2, 3])), Some((0, 2)));
        p.on_evict((0, 2));
        assert_eq!(p.victim(&keys(&[1, 3])), Some((0, 1)));
    }

    #[test]
    fn s3fifo_main_queue_reinserts_used_keys_once_per_use() {
        let mut p = S3Fifo::new(100);
        // Fill main through the ghost: insert, evict from small, insert again.
        for e in 1..=3 {
            batch(&mut p, &[], &[e]);
            p.on_evict((0, e));
            batch(&mut p, &[], &[e]);
        }
        assert_eq!(p.main_live, 3);
        assert_eq!(p.small_live, 0);
        // 1 used twice, 2 once, 3 never (since its insert).
        batch(&mut p, &[1, 2], &[]);
        batch(&mut p, &[1], &[]);
        assert_eq!(p.victim(&keys(&[1, 2, 3])), Some((0, 3)));
        p.on_evict((0, 3));
        // The walk has moved 1 (freq 2 -> 1) and 2 (1 -> 0) to the head: 2 is next, then 1.
        assert_eq!(p.victim(&keys(&[1, 2])), Some((0, 2)));
        p.on_evict((0, 2));
        assert_eq!(p.victim(&keys(&[1])), Some((0, 1)));
    }

    #[test]
    fn s3fifo_ghost_is_bounded_by_the_main_share() {
        let mut p = S3Fifo::new(10);
        for e in 0..100 {
            batch(&mut p, &[], &[e]);
            p.on_evict((0, e));
        }
        assert_eq!(p.ghost_seq.len(), 9);
        assert!(p.ghost_seq.contains_key(&(0, 99)));
        assert!(!p.ghost_seq.contains_key(&(0, 90)));
        assert!(p.small.len() <= 2 * p.small_live + S3FIFO_STALE_SLACK);
    }

    #[test]
    fn lfu_evicts_the_rare_key() {
        let mut p = Lfu::new(4);
        batch(&mut p, &[], &[1, 2, 3]);
        batch(&mut p, &[1, 3], &[]);
        batch(&mut p, &[1], &[]);
        // Counts: 1 -> 3, 2 -> 1, 3 -> 2.
        assert_eq!(p.victim(&keys(&[1, 2, 3])), Some((0, 2)));
        assert_eq!(p.victim_where(&mut std::iter::empty(), &|_| true), Some((0, 2)));
        assert_eq!(p.victim_where(&mut std::iter::empty(), &|k| k != (0, 2)), Some((0, 3)));
    }

    #[test]
    fn lfu_breaks_ties_by_older_use() {
        let mut p = Lfu::new(4);
        batch(&mut p, &[], &[5, 6]);
        batch(&mut p, &[5], &[]);
        batch(&mut p, &[6], &[]);
        assert_eq!(p.victim(&keys(&[5, 6])), Some((0, 5)));
    }

    #[test]
    fn lfu_aging_lets_an_old_hot_key_go() {
        // Capacity 2: counts halve every 20 accesses.
        let mut p = Lfu::new(2);
        batch(&mut p, &[], &[1]);
        for _ in 0..29 {
            batch(&mut p, &[1], &[]);
        }
        batch(&mut p, &[], &[2]);
        for _ in 0..11 {
            batch(&mut p, &[2], &[]);
        }
        // 42 accesses, halvings at 20 (key 1: 20 -> 10) and 40 (key 1: 20 -> 10, key 2: 10 -> 5).
        assert_eq!(p.entries.get(&(0, 1)).map(|e| e.count), Some(10));
        assert_eq!(p.entries.get(&(0, 2)).map(|e| e.count), Some(7));
        assert_eq!(p.victim(&keys(&[1, 2])), Some((0, 2)));
        for _ in 0..13 {
            batch(&mut p, &[2], &[]);
        }
        // Key 2 has 25 accesses in all against key 1's 30, but 1 has been idle: 10 against 20.
        assert_eq!(p.entries.get(&(0, 1)).map(|e| e.count), Some(10));
        assert_eq!(p.entries.get(&(0, 2)).map(|e| e.count), Some(20));
        assert_eq!(p.victim(&keys(&[1, 2])), Some((0, 1)));
        assert_eq!(p.victim_where(&mut std::iter::empty(), &|_| true), Some((0, 1)));
    }

    #[test]
    fn lfu_forgets_cold_evicted_keys() {
        let mut p = Lfu::new(1);
        for e in 0..100 {
            batch(&mut p, &[], &[e]);
            p.on_evict((0, e));
        }
        // Period 10: a key seen once halves to 0 at the next aging and is dropped.
        assert!(p.entries.len() <= 10, "history holds {} keys", p.entries.len());
        assert!(p.order.is_empty());
    }

    #[test]
    fn policy_by_name_knows_every_name() {
        for name in POLICY_NAMES {
            let p = policy_by_name(name, 16);
            assert_eq!(p.map(|p| p.name()), Some(name));
        }
        assert!(policy_by_name("fifo", 16).is_none());
    }
}
