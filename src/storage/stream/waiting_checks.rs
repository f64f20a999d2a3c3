//! Expert checks while compute waits: when the scheduler must wait for a read, it hashes
//! experts whose reads have landed but whose checksums are not checked yet, a step of one block
//! per compute thread at a time, until the read it waits for is done. A check left part-way is
//! kept and finished by the next wait or by the expert's first use ([`Store::take_waiting_check`]),
//! so the hashing that first use would have done on the compute path is done in time the cores
//! would otherwise idle.
//!
//! Nothing unchecked is ever handed out: a guard still requires the expert's `verified` flag,
//! which only a finished, matching check sets. An expert that fails a check made while waiting
//! leaves the pool (read again, and checked again, if a layer needs it; a second failure then
//! fails the run on the compute path, naming the file).
//!
//! Threads: the scheduler thread. The check in progress holds a guard count on its slot, so the
//! slot is neither evicted nor read into until the check ends.

use super::arena::Filled;
use super::expert_pool::PartPlaces;
use super::policy::ExpertKey;
use super::reads::Ticket;
use super::{lock, Store};
use crate::storage::pack::experts::PartialChecksum;

/// A check in progress.
pub(super) struct WaitingCheck {
    pub slot: usize,
    pub key: ExpertKey,
    pub filled: Filled,
    pub parts: PartPlaces,
    pub sum: PartialChecksum,
}

impl WaitingCheck {
    /// The expert's six tensors in the arena.
    pub fn part_bytes<'a>(&self, store: &'a Store) -> [&'a [u8]; 6] {
        let b = store.arena.bytes(self.filled);
        self.parts.map(|(at, len)| &b[at..at + len])
    }
}

impl Store {
    /// Hashes landed, unchecked experts until `ticket` is done or nothing is left to check.
    pub(super) fn check_while_waiting(&self, ticket: Ticket) {
        if !self.verify_experts {
            return;
        }
        let step = rayon::current_num_threads().max(1);
        while !self.reads.is_done(ticket) {
            if !self.check_step(step) {
                return;
            }
        }
    }

    /// One step of the check in progress (starting one if none is): returns false if there is
    /// nothing to check.
    fn check_step(&self, blocks: usize) -> bool {
        let mut current = lock(&self.waiting_check);
        if current.is_none() {
            *current = self.next_unchecked();
        }
        let Some(check) = current.as_mut() else { return false };
        let start = std::time::Instant::now();
        let done = check.sum.advance(&check.part_bytes(self), blocks);
        lock(&self.stats).expert_verify_waiting_seconds += start.elapsed().as_secs_f64();
        if done {
            if let Some(check) = current.take() {
                drop(current);
                self.settle_waiting_check(check);
            }
        }
        true
    }

    /// Picks a landed, unchecked expert that no guard holds (those the current layer has yet to
    /// use first) and holds its slot for the check.
    fn next_unchecked(&self) -> Option<WaitingCheck> {
        let mut pool = lock(&self.pool);
        let mut pick: Option<(usize, bool)> = None;
        for i in 0..pool.slots.len() {
            let s = &pool.slots[i];
            let Some(key) = s.key else { continue };
            if s.verified || s.users > 0 {
                continue;
            }
            if let Some(t) = s.slot.ticket() {
                // A failed read is left to the expert's user, which reports it.
                if !self.reads.is_done(t) || self.reads.wait(t).is_err() {
                    continue;
                }
                pool.slots[i].slot.landed();
            }
            let needed_now = pool.protected.contains(&key);
            if pick.is_none_or(|(_, best)| needed_now && !best) {
                pick = Some((i, needed_now));
            }
            if needed_now {
                break;
            }
        }
        let (slot, _) = pick?;
        let s = &mut pool.slots[slot];
        let (key, filled) = (s.key?, s.slot.filled()?);
        s.users += 1;
        Some(WaitingCheck { slot, key, filled, parts: s.parts, sum: PartialChecksum::default() })
    }

    /// Ends a finished check: a match marks the expert checked; a mismatch takes it out of the
    /// pool. Either way the check's hold on the slot is released.
    fn settle_waiting_check(&self, check: WaitingCheck) {
        let parts = check.part_bytes(self);
        let got = check.sum.finish(&parts);
        let want = self.expert_sums.get(check.key.0).and_then(|l| l.get(check.key.1)).copied();
        let bytes: u64 = check.parts.iter().map(|p| p.1 as u64).sum();
        {
            let mut stats = lock(&self.stats);
            stats.experts_verified += 1;
            stats.experts_verified_waiting += 1;
            stats.expert_verified_bytes += bytes;
        }
        let mut pool = lock(&self.pool);
        if want == Some(got) {
            let s = &mut pool.slots[check.slot];
            s.users -= 1;
            if s.key == Some(check.key) {
                s.verified = true;
            }
            return;
        }
        tracing::warn!(
            "layer {} expert {} failed its checksum after its read; it will be read again if used",
            check.key.0,
            check.key.1
        );
        lock(&self.stats).expert_checks_failed_waiting += 1;
        self.drop_damaged(&mut pool, check.slot, check.key);
    }

    /// The check in progress of `slot`'s expert, if any, taken over by its first use (which
    /// then holds the slot's guard count that the check held).
    pub(super) fn take_waiting_check(&self, slot: usize) -> Option<WaitingCheck> {
        let mut current = lock(&self.waiting_check);
        if current.as_ref().is_some_and(|c| c.slot == slot) {
            current.take()
        } else {
            None
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::super::{AdmitAll, Guess, Priority, Store};
    use crate::engine::{open_streaming, Opened, StreamingRun};
    use crate::pipeline::{Pipeline, PipelineOptions};
    use crate::storage::stream::StoreOptions;

    fn tiny_copy() -> (tempfile::TempDir, PathBuf) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("model");
        std::fs::create_dir(&dir).unwrap();
        let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-k3");
        for entry in std::fs::read_dir(tiny).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), dir.join(entry.file_name())).unwrap();
        }
        let trunk = tmp.path().join("trunk");
        let cfg = crate::config::Config::from_model_dir(&dir).unwrap();
        let index = crate::checkpoint::CheckpointIndex::open(&dir).unwrap();
        crate::storage::pack::write_pack(&dir, &cfg, &index, &trunk, |_, _| {}).unwrap();
        (tmp, dir)
    }

    fn open(model: &Path) -> Opened<Pipeline> {
        let run = StreamingRun {
            budget_bytes: 64_000_000,
            context: 16,
            sequences: 1,
            chunk: 8,
            threads: 2,
            store: StoreOptions::default(),
            pipeline: PipelineOptions::default(),
            prefetch_window: None,
            placement: None,
            trace_detail: false,
            trunk_share: None,
            available_memory: None,
            drafting: Default::default(),
        };
        let trunk = model.parent().unwrap().join("trunk");
        let kernels = kernels::Kernels::with_isa(kernels::Isa::Scalar).unwrap();
        open_streaming(model, &trunk, &run, kernels, |_| {}).unwrap().0
    }

    /// Reads `n` experts of the first MoE layer as guesses; returns their keys.
    fn read_guesses(store: &Store, layer: usize, n: usize) -> Vec<(usize, usize)> {
        let guesses: Vec<Guess> = (0..n).map(|e| Guess { key: (layer, e), p_use: 0.5 }).collect();
        assert_eq!(store.request(&guesses, Priority::Guess, &AdmitAll), n);
        guesses.iter().map(|g| g.key).collect()
    }

    /// Steps until a check is in progress (its expert's read has landed); returns its key.
    fn begin_a_check(store: &Store) -> (usize, usize) {
        for _ in 0..100_000 {
            store.check_step(1);
            if let Some(c) = super::super::lock(&store.waiting_check).as_ref() {
                return c.key;
            }
            std::thread::yield_now();
        }
        panic!("no read landed");
    }

    fn first_moe_layer(model: &Path) -> usize {
        crate::checkpoint::CheckpointIndex::open(model).unwrap().experts.iter().map(|r| r.layer).min().unwrap()
    }

    #[test]
    fn an_expert_checked_while_waiting_is_handed_out_and_one_checked_part_way_is_finished_by_its_use() {
        let (_tmp, model) = tiny_copy();
        let layer = first_moe_layer(&model);
        let opened = open(&model);
        let store = opened.engine.src.store();
        let keys = read_guesses(store, layer, 4);
        let before = store.stats();
        // Begun: one block of the first landed expert's six (one per tensor) is hashed.
        let key = begin_a_check(store);
        let slot = *super::super::lock(&store.pool).resident.get(&key).unwrap();
        assert_eq!(super::super::lock(&store.pool).slots[slot].users, 1, "the check holds its slot");
        assert!(!super::super::lock(&store.pool).slots[slot].verified);
        // Its first use finishes it and takes over the check's hold.
        let guard = store.expert(key.0, key.1).unwrap();
        assert!(super::super::lock(&store.waiting_check).is_none());
        assert_eq!(super::super::lock(&store.pool).slots[slot].users, 1, "only the guard holds the slot");
        drop(guard);
        assert_eq!(super::super::lock(&store.pool).slots[slot].users, 0);
        let after = store.stats();
        assert_eq!(after.experts_verified - before.experts_verified, 1);
        assert_eq!(after.experts_verified_waiting, before.experts_verified_waiting, "finished by its use");
        // The others are checked wholly while waiting: their use hashes nothing.
        for _ in 0..keys.len() * 6 + 100_000 {
            store.check_step(2);
            let pool = super::super::lock(&store.pool);
            if keys.iter().all(|k| pool.resident.get(k).is_some_and(|&s| pool.slots[s].verified)) {
                break;
            }
        }
        let checked = store.stats();
        assert_eq!(checked.experts_verified - after.experts_verified, 3);
        assert_eq!(checked.experts_verified_waiting - after.experts_verified_waiting, 3);
        assert!(checked.expert_verify_waiting_seconds > before.expert_verify_waiting_seconds);
        for k in &keys {
            drop(store.expert(k.0, k.1).unwrap());
        }
        assert_eq!(store.stats().experts_verified, checked.experts_verified, "no expert hashed twice");
        assert!(!store.check_step(2), "nothing left to check");
        let pool = super::super::lock(&store.pool);
        assert!(pool.slots.iter().all(|s| s.users == 0), "every hold released");
    }

    #[test]
    fn an_expert_that_fails_its_check_while_waiting_leaves_the_pool_and_fails_its_use_after_a_second_read() {
        let (_tmp, model) = tiny_copy();
        let layer = first_moe_layer(&model);
        // Damage expert 0 of the layer after packing, outside the fingerprint's samples.
        let index = crate::checkpoint::CheckpointIndex::open(&model).unwrap();
        let r = index.experts.get(layer, 0).unwrap();
        let t = &index.tensors[r.parts[0]];
        let shard = &index.shards[t.shard];
        let sampled = crate::storage::pack::fingerprint::sampled_windows(shard);
        let at =
            (t.offset..t.offset + t.len).find(|&b| !sampled.iter().any(|&(o, l)| (o..o + l).contains(&b))).unwrap();
        let mut bytes = std::fs::read(&shard.path).unwrap();
        bytes[at as usize] ^= 0x24;
        std::fs::write(&shard.path, bytes).unwrap();
        let opened = open(&model);
        let store = opened.engine.src.store();
        read_guesses(store, layer, 1);
        let key = begin_a_check(store);
        assert_eq!(key, (layer, 0));
        while super::super::lock(&store.waiting_check).is_some() {
            store.check_step(1);
        }
        let stats = store.stats();
        assert_eq!(stats.expert_checks_failed_waiting, 1);
        assert_eq!(stats.experts_verified_waiting, 1, "the check ended while waiting");
        assert!(!store.expert_requested(key), "a damaged expert leaves the pool");
        assert!(super::super::lock(&store.pool).slots.iter().all(|s| s.users == 0), "its hold released");
        // Its use reads it again, checks it on the compute path and fails loudly, naming it.
        let err = store.expert(key.0, key.1).err().expect("damaged bytes handed out").to_string();
        assert!(err.contains(&format!("layer {layer} expert 0 in ")) && err.contains("fails its checksum"), "{err}");
        assert_eq!(store.stats().expert_reads, stats.expert_reads + 1, "read again");
    }
}
