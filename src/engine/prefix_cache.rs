//! The prefix cache: snapshots of sequences' states ([`crate::model::snapshot`]) at positions of
//! recent prompts, keyed by the tokens before the position, in a pool with a byte limit (least
//! recently used first out). A new sequence starts from the longest cached prefix of its prompt
//! and prefills only the rest; the tokens are the same as from a cold start.
//!
//! Where snapshots are taken (a prompt of n tokens): at n, when its prefill ends (free: the
//! step ends there anyway), so that a conversation's next turn, which resends the history and
//! adds to it, starts where the last one's prompt ended; every `stride` positions, so that
//! prompts sharing only a beginning (one system prompt, different questions) meet at the last
//! stride before they part; and where the prompt parts from the cached prompt it shares most
//! with, so that the next prompt like the two starts at their whole common part. A stride or
//! parting point ends the sequence's rows of a prefill step. A prompt sent again unchanged
//! starts from its last stride or parting point: its last token must run, as its logits
//! choose the first generated token.

use serde::Serialize;

use crate::model::snapshot::StateSnapshot;

/// How the cache is sized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixCacheOptions {
    /// Bytes the snapshots (and their keys) may hold together.
    pub bytes: u64,
    /// Positions between snapshots within a prompt.
    pub stride: usize,
}

/// What the cache did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PrefixStats {
    /// Sequences that started from a snapshot, and those that found none.
    pub hits: u64,
    pub misses: u64,
    /// Prompt tokens not prefilled thanks to a snapshot.
    pub cached_tokens: u64,
    /// Snapshots taken, and those dropped to make room.
    pub stored: u64,
    pub evictions: u64,
    /// Snapshots not taken because one alone is larger than the cache.
    pub too_large: u64,
    /// Bytes held now, and snapshots.
    pub bytes: u64,
    pub entries: usize,
}

struct Entry {
    tokens: Vec<u32>,
    snap: StateSnapshot,
    used: u64,
}

impl Entry {
    fn bytes(&self) -> u64 {
        self.snap.bytes() + 4 * self.tokens.len() as u64
    }
}

/// See the module docs.
pub struct PrefixCache {
    opts: PrefixCacheOptions,
    entries: Vec<Entry>,
    clock: u64,
    stats: PrefixStats,
}

impl PrefixCache {
    pub fn new(opts: PrefixCacheOptions) -> PrefixCache {
        PrefixCache {
            opts: PrefixCacheOptions { stride: opts.stride.max(1), ..opts },
            entries: Vec::new(),
            clock: 0,
            stats: PrefixStats::default(),
        }
    }

    pub fn stats(&self) -> PrefixStats {
        self.stats
    }

    /// The snapshot of the longest cached prefix of `prompt` shorter than it (its last token
    /// must run), counted as a hit or a miss.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<&StateSnapshot> {
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.tokens.len() < prompt.len() && prompt.starts_with(&e.tokens))
            .max_by_key(|(_, e)| e.tokens.len())
            .map(|(i, _)| i);
        let Some(i) = best else {
            self.stats.misses += 1;
            return None;
        };
        self.clock += 1;
        let e = &mut self.entries[i];
        e.used = self.clock;
        self.stats.hits += 1;
        self.stats.cached_tokens += e.tokens.len() as u64;
        Some(&e.snap)
    }

    /// The next position after `from` where a prompt is snapshotted and no snapshot of its
    /// prefix is cached yet; `shared` is where the prompt parts from the cached prompt it shares
    /// most with ([`PrefixCache::shared`]), also a point.
    pub fn next_point(&self, prompt: &[u32], from: usize, shared: Option<usize>) -> Option<usize> {
        let end = prompt.len();
        let stride = self.opts.stride;
        let strides = (from / stride + 1..).map(|k| k * stride).take_while(|&p| p < end);
        let points = strides.chain(shared.filter(|&s| s > from && s < end));
        points.filter(|&p| p > from).filter(|&p| !self.contains(&prompt[..p])).min()
    }

    /// Whether the state after `tokens` should be kept: not cached yet.
    pub fn wants(&self, tokens: &[u32]) -> bool {
        !tokens.is_empty() && !self.contains(tokens)
    }

    /// The longest prefix `prompt` shares with a cached snapshot's tokens, when it is longer than
    /// that snapshot's own match: a prompt that parts from an earlier one between two strides (the
    /// same system prompt, another question) is snapshotted where they part, so that the next
    /// prompt like them starts there.
    pub fn shared(&self, prompt: &[u32]) -> Option<usize> {
        self.entries
            .iter()
            .filter(|e| !prompt.starts_with(&e.tokens))
            .map(|e| e.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count())
            .max()
            .filter(|&n| n > 0)
    }

    fn contains(&self, tokens: &[u32]) -> bool {
        self.entries.iter().any(|e| e.tokens == tokens)
    }

    /// Keeps `snap`, the state after `tokens`, making room by dropping the least recently used.
    pub fn insert(&mut self, tokens: &[u32], snap: StateSnapshot) {
        if self.contains(tokens) {
            return;
        }
        self.clock += 1;
        let entry = Entry { tokens: tokens.to_vec(), snap, used: self.clock };
        let need = entry.bytes();
        if need > self.opts.bytes {
            self.stats.too_large += 1;
            return;
        }
        while self.stats.bytes + need > self.opts.bytes {
            let Some(oldest) = self.entries.iter().enumerate().min_by_key(|(_, e)| e.used).map(|(i, _)| i) else {
                break;
            };
            let gone = self.entries.swap_remove(oldest);
            self.stats.bytes -= gone.bytes();
            self.stats.evictions += 1;
        }
        self.stats.bytes += need;
        self.stats.stored += 1;
        self.entries.push(entry);
        self.stats.entries = self.entries.len();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::model::ModelState;

    fn snap(cfg: &Config) -> StateSnapshot {
        ModelState::new(cfg, 8).snapshot().unwrap()
    }

    fn cfg() -> Config {
        Config::from_model_dir(&std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-k3"))
            .unwrap()
    }

    #[test]
    fn points_are_strides_and_the_parting_point() {
        let c = PrefixCache::new(PrefixCacheOptions { bytes: 1 << 30, stride: 4 });
        let prompt: Vec<u32> = (0..11).collect();
        let points = |shared| -> Vec<usize> {
            std::iter::successors(c.next_point(&prompt, 0, shared), |&p| c.next_point(&prompt, p, shared)).collect()
        };
        // The prompt's end is no split point: its prefill ends there.
        assert_eq!(points(None), vec![4, 8]);
        assert_eq!(points(Some(6)), vec![4, 6, 8]);
        assert_eq!(points(Some(10)), vec![4, 8, 10]);
        assert_eq!(points(Some(11)), vec![4, 8]);
        assert_eq!(c.next_point(&prompt[..4], 0, None), None);
        assert!(c.wants(&prompt) && !c.wants(&[]));
    }

    #[test]
    fn lookup_takes_the_longest_shorter_prefix_and_eviction_is_lru() {
        let cfg = cfg();
        let one = snap(&cfg).bytes() + 4 * 3;
        let mut c = PrefixCache::new(PrefixCacheOptions { bytes: 2 * one + 8, stride: 4 });
        c.insert(&[1, 2], snap(&cfg));
        c.insert(&[1, 2, 3], snap(&cfg));
        assert!(c.lookup(&[1, 2, 3]).is_some(), "[1, 2] is a shorter prefix");
        assert_eq!(c.stats().cached_tokens, 2);
        assert!(c.lookup(&[1, 2, 3, 4]).is_some());
        assert_eq!(c.stats().cached_tokens, 5);
        assert!(c.lookup(&[2]).is_none());
        // [1, 2, 5, 6] holds [1, 2] whole: it parts from [1, 2, 3] at 2, which is cached.
        assert_eq!(c.shared(&[1, 2, 5, 6]), Some(2));
        assert_eq!(c.shared(&[1, 9]), Some(1));
        assert_eq!(c.shared(&[9]), None);
        // [1, 2] was used least recently: it goes to make room.
        c.insert(&[7, 8, 9], snap(&cfg));
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.stored, s.evictions, s.entries), (2, 1, 3, 1, 2));
        assert!(c.contains(&[1, 2, 3]) && c.contains(&[7, 8, 9]) && !c.contains(&[1, 2]));
        assert!(s.bytes <= 2 * one + 8);
        // Larger than the whole cache: not kept.
        let mut small = PrefixCache::new(PrefixCacheOptions { bytes: 16, stride: 4 });
        small.insert(&[1], snap(&cfg));
        assert_eq!((small.stats().too_large, small.stats().entries), (1, 0));
    }
}
