//! Expert checksum checks. Every expert read is checked before anything computed from its
//! bytes is used (unless `--no-verify-experts`): while the scheduler waits for some read, it
//! hashes experts whose reads have landed but are not checked yet (the current layer's first), a
//! step of one block per compute thread at a time, until the read it waits for is done; a check
//! left part-way is kept and finished by the next wait or by the expert's first use
//! ([`Store::take_waiting_check`], [`Store::verify_expert`]). Hashing in a wait costs the cores
//! what the wait leaves idle, plus at most one step past the read's end. An expert no wait began
//! to check is handed out unchecked to a caller that hashes it in its products
//! ([`Store::expert_unchecked`], `model::expert_check`), and settled by the sum they hashed
//! ([`Store::confirm_expert`]).
//!
//! A guard hands out checked bytes ([`Store::expert`]: the expert's `verified` flag, which only
//! a finished, matching check sets), or unchecked bytes marked so, whose results the caller
//! keeps only once [`Store::confirm_expert`] accepts them. Bytes that fail their check, in a
//! wait, on first use or in the products, leave the pool and are read once more
//! ([`Store::note_damaged_read`]; a warning says so): a damaged transfer heals, and a second
//! failure in a row fails the run (exit 3) naming the file.
//!
//! Threads: the scheduler thread. The check in progress holds a guard count on its slot, so the
//! slot is neither evicted nor read into until the check ends or
//! [`Store::release_waiting_check`] lets it go. Locks: `waiting_check`, then `pool`, then
//! `stats` (`release_waiting_check`, called under `pool`, only tries its lock).

use super::arena::Filled;
use super::expert_pool::{ExpertGuard, ExpertPool, PartPlaces};
use super::policy::ExpertKey;
use super::reads::Ticket;
use super::{lock, Store};
use crate::checkpoint::expert_sums::PartialChecksum;
use crate::model::weights::SourceError;

/// A check in progress.
pub(super) struct WaitingCheck {
    pub slot: usize,
    pub key: ExpertKey,
    pub filled: Filled,
    pub parts: PartPlaces,
    pub sum: PartialChecksum,
}

impl Store {
    /// An expert's six tensors in its filled slot.
    pub(super) fn part_bytes(&self, filled: Filled, parts: &PartPlaces) -> [&[u8]; 6] {
        let b = self.arena.bytes(filled);
        parts.map(|(at, len)| &b[at..at + len])
    }

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
        let done = check.sum.advance(&self.part_bytes(check.filled, &check.parts), blocks);
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
        let got = check.sum.finish(&self.part_bytes(check.filled, &check.parts));
        let matched = self.match_checksum(check.key, got).is_ok();
        {
            let mut stats = lock(&self.stats);
            stats.experts_verified += 1;
            stats.experts_verified_waiting += 1;
            stats.expert_verified_bytes += check.parts.iter().map(|p| p.1 as u64).sum::<u64>();
        }
        if !matched {
            self.note_damaged_read(check.key);
        }
        let mut pool = lock(&self.pool);
        if matched {
            pool.damaged.remove(&check.key);
            let s = &mut pool.slots[check.slot];
            s.users -= 1;
            if s.key == Some(check.key) {
                s.verified = true;
            }
        } else {
            self.drop_damaged(&mut pool, check.slot, check.key);
        }
        // The slot may now be evictable: start reads still waiting for one (as a guard's drop).
        let _ = self.issue_pending(&mut pool, false);
    }

    /// Records that an expert's bytes failed their checksum; returns whether they may be read
    /// again (its previous read did not fail too), and says so.
    pub(super) fn note_damaged_read(&self, key: ExpertKey) -> bool {
        if !lock(&self.pool).damaged.insert(key) {
            return false;
        }
        tracing::warn!("layer {} expert {}: the bytes read failed their checksum; reading them again", key.0, key.1);
        lock(&self.stats).expert_reads_damaged += 1;
        true
    }

    /// Ends the check in progress without finishing it, releasing its hold on its slot (called
    /// under the pool lock, when a read needs a slot and none is evictable). Returns whether
    /// there was one.
    pub(super) fn release_waiting_check(&self, pool: &mut ExpertPool) -> bool {
        // The pool lock is held: only try the check's lock, taken before the pool's elsewhere.
        let Ok(mut current) = self.waiting_check.try_lock() else { return false };
        let Some(check) = current.take() else { return false };
        pool.slots[check.slot].users -= 1;
        true
    }

    /// Checks an expert's bytes in its slot against its checksum in the pack's manifest,
    /// finishing `begun` (the blocks a wait for a read already hashed).
    pub(super) fn verify_expert(
        &self,
        key: ExpertKey,
        filled: Filled,
        parts: &PartPlaces,
        begun: PartialChecksum,
    ) -> Result<(), SourceError> {
        let start = std::time::Instant::now();
        let got = begun.finish(&self.part_bytes(filled, parts));
        let seconds = start.elapsed().as_secs_f64();
        {
            let mut stats = lock(&self.stats);
            stats.experts_verified += 1;
            stats.expert_verified_bytes += parts.iter().map(|p| p.1 as u64).sum::<u64>();
            stats.expert_verify_seconds += seconds;
        }
        self.match_checksum(key, got)
    }

    /// Settles the check of an expert handed out unchecked ([`Store::expert_unchecked`]) with
    /// `got`, the checksum its products hashed, which added `hashing_seconds` to them:
    /// as [`ExpertView::confirm`](crate::model::weights::ExpertView::confirm). Bytes that fail
    /// leave the pool, as a failed check on first use does.
    pub(super) fn confirm_expert(
        &self,
        guard: ExpertGuard<'_>,
        got: u64,
        hashing_seconds: f64,
    ) -> Result<bool, SourceError> {
        if !guard.unchecked {
            return Ok(true);
        }
        let slot = guard.slot;
        let (key, bytes) = {
            let pool = lock(&self.pool);
            let s = &pool.slots[slot];
            (s.key, s.parts.iter().map(|p| p.1 as u64).sum::<u64>())
        };
        let key =
            key.ok_or_else(|| SourceError::Internal(format!("slot {slot} of an expert being checked holds nothing")))?;
        {
            let mut stats = lock(&self.stats);
            stats.experts_verified += 1;
            stats.experts_verified_in_products += 1;
            stats.expert_verified_bytes += bytes;
            stats.expert_verify_seconds += hashing_seconds;
            stats.expert_verify_in_products_seconds += hashing_seconds;
        }
        match self.match_checksum(key, got) {
            Ok(()) => {
                let mut pool = lock(&self.pool);
                pool.slots[slot].verified = true;
                pool.damaged.remove(&key);
                drop(pool);
                drop(guard);
                Ok(true)
            }
            Err(e) => {
                // `drop_damaged` releases the guard's count on the slot, so the guard must not.
                let _ = std::mem::ManuallyDrop::new(guard);
                let mut pool = lock(&self.pool);
                self.drop_damaged(&mut pool, slot, key);
                let _ = self.issue_pending(&mut pool, false);
                drop(pool);
                if self.note_damaged_read(key) {
                    Ok(false)
                } else {
                    Err(e)
                }
            }
        }
    }

    /// Compares an expert's hash `got` with its checksum in the pack's manifest; a mismatch
    /// names where its bytes were read from.
    fn match_checksum(&self, key: ExpertKey, got: u64) -> Result<(), SourceError> {
        let want = self.expert_sums.get(key.0).and_then(|l| l.get(key.1)).copied();
        if want == Some(got) {
            return Ok(());
        }
        let want = want.map_or_else(|| "none".to_owned(), |w| format!("{w:016x}"));
        if let Some(pieces) = self.placed.get(key) {
            let places: Vec<String> = pieces
                .iter()
                .map(|p| {
                    let file = self.placed.path(p).map_or_else(String::new, |f| f.display().to_string());
                    format!("{file} at offset {}", p.offset)
                })
                .collect();
            return Err(SourceError::Corrupt {
                what: format!("layer {} expert {} in {}", key.0, key.1, places.join(", ")),
                message: format!(
                    "fails its checksum (manifest {want}, read {got:016x}): the expert file changed since \
                     `k3ring pack` or the read returned damaged bytes; if it persists, run `{}` to rewrite it",
                    self.placed.rewrite_command()
                ),
            });
        }
        let r = self.index.experts.get(key.0, key.1);
        let mut files: Vec<String> = r
            .map(|r| {
                r.parts
                    .iter()
                    .map(|&id| self.index.shards[self.index.tensors[id].shard].path.display().to_string())
                    .collect()
            })
            .unwrap_or_default();
        files.dedup();
        Err(SourceError::Corrupt {
            what: format!("layer {} expert {} in {}", key.0, key.1, files.join(", ")),
            message: format!(
                "fails its checksum (manifest {want}, read {got:016x}): the shard changed since `k3ring pack` or the \
                 read returned damaged bytes; `k3ring pack --verify` checks every expert"
            ),
        })
    }

    /// Takes an expert whose bytes failed their checksum out of the pool (its guard count
    /// released), so that nothing uses them.
    pub(super) fn drop_damaged(&self, pool: &mut ExpertPool, slot: usize, key: ExpertKey) {
        let s = &mut pool.slots[slot];
        s.users -= 1;
        if s.users > 0 {
            // Another caller holds the slot: it stays unverified, so its next use checks again.
            return;
        }
        if s.slot.ticket().is_none() {
            s.slot.clear();
        }
        s.key = None;
        s.verified = false;
        if std::mem::replace(&mut s.speculative, false) {
            lock(&self.stats).spec_wasted_bytes += s.bytes;
        }
        if pool.resident.remove(&key).is_some() {
            pool.policy.on_evict(key);
        }
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
pub(crate) mod tests {
    use std::path::{Path, PathBuf};

    use super::super::{AdmitAll, Guess, Priority, Store, WaitFor};
    use crate::engine::{open_streaming, Opened, StreamingRun};
    use crate::pipeline::Pipeline;

    pub(crate) fn tiny_copy() -> (tempfile::TempDir, PathBuf) {
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

    pub(crate) fn open(model: &Path) -> Opened<Pipeline> {
        open_with_budget(model, 64_000_000)
    }

    pub(crate) fn open_with_budget(model: &Path, budget_bytes: u64) -> Opened<Pipeline> {
        open_run(model, &StreamingRun::new(budget_bytes, 16, 8, 2))
    }

    /// Opens `model` (a [`tiny_copy`]) as `run` says, with the scalar kernels.
    fn open_run(model: &Path, run: &StreamingRun) -> Opened<Pipeline> {
        let trunk = model.parent().unwrap().join("trunk");
        let kernels = kernels::Kernels::with_isa(kernels::Isa::Scalar).unwrap();
        open_streaming(model, &trunk, run, kernels, |_| {}).unwrap().0
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
        assert_eq!(stats.expert_reads_damaged, 1);
        assert_eq!(stats.experts_verified_waiting, 1, "the check ended while waiting");
        assert!(!store.expert_requested(key), "a damaged expert leaves the pool");
        assert!(super::super::lock(&store.pool).slots.iter().all(|s| s.users == 0), "its hold released");
        // Its use reads it again and checks it on the compute path: damaged twice in a row, it
        // fails loudly, naming it.
        let err = store.expert(key.0, key.1).err().expect("damaged bytes handed out").to_string();
        assert!(err.contains(&format!("layer {layer} expert 0 in ")) && err.contains("fails its checksum"), "{err}");
        let after = store.stats();
        assert_eq!(after.expert_reads, stats.expert_reads + 1, "read again once");
        assert_eq!(after.expert_reads_damaged, 1, "the second failure is not read again");
        assert!(super::super::lock(&store.pool).slots.iter().all(|s| s.users == 0 && s.key.is_none_or(|k| k != key)));
    }

    #[test]
    fn a_wait_checks_what_has_landed_until_its_read_is_done_or_nothing_is_left() {
        let (_tmp, model) = tiny_copy();
        let layer = first_moe_layer(&model);
        let opened = open(&model);
        let store = opened.engine.src.store();
        let keys = read_guesses(store, layer, 3);
        // A read that is done: nothing is checked.
        let done = store.reads.reserve();
        store.reads.submit(Priority::Demand, vec![(done, Vec::new())]);
        while !store.reads.is_done(done) {
            std::thread::yield_now();
        }
        store.check_while_waiting(done);
        assert_eq!(store.stats().experts_verified, 0);
        // A read that never ends (reserved, not submitted yet): the wait checks every landed
        // expert, then returns rather than spin.
        let never = store.reads.reserve();
        let verified = |store: &Store| {
            let pool = super::super::lock(&store.pool);
            keys.iter().filter(|k| pool.resident.get(k).is_some_and(|&s| pool.slots[s].verified)).count()
        };
        for _ in 0..100_000 {
            store.check_while_waiting(never);
            if verified(store) == keys.len() {
                break;
            }
            std::thread::yield_now();
        }
        assert_eq!(verified(store), keys.len());
        assert_eq!(store.stats().experts_verified_waiting, 3);
        store.reads.submit(Priority::Demand, vec![(never, Vec::new())]);
        assert!(super::super::lock(&store.waiting_check).is_none());
        assert!(super::super::lock(&store.pool).slots.iter().all(|s| s.users == 0));
    }

    #[test]
    fn a_wait_for_an_expert_counts_in_its_layers_stall_and_expert_waits() {
        // A modeled device with 50 ms of latency: the expert's first use must wait for it.
        let (_tmp, model) = tiny_copy();
        let layer = first_moe_layer(&model);
        let mut run = StreamingRun::new(64_000_000, 16, 8, 2);
        run.pipeline.io.kind = crate::pipeline::IoKind::parse("sim:1GB/s,50ms").unwrap();
        let opened = open_run(&model, &run);
        let store = opened.engine.src.store();
        let (stalled, experts) = (store.stats().layer(layer).stall_us, store.expert_waited_seconds(layer));
        let key = read_guesses(store, layer, 1)[0];
        drop(store.expert(key.0, key.1).unwrap());
        let stalled = (store.stats().layer(layer).stall_us - stalled) / 1e6;
        assert!(stalled >= 0.03, "layer {layer} stalled {stalled} s for a read of 50 ms latency");
        let experts = store.expert_waited_seconds(layer) - experts;
        assert!((experts - stalled).abs() < 1e-6, "all of it for the layer's experts ({experts} s)");
    }

    #[test]
    fn a_layers_expert_waits_count_apart_from_its_trunk_waits() {
        let (_tmp, model) = tiny_copy();
        let layer = first_moe_layer(&model);
        let opened = open(&model);
        let store = opened.engine.src.store();
        // A read that lands 60 ms after compute starts waiting for it (the margins below leave
        // 30 ms for the waiting thread to be late).
        let wait = |what: WaitFor| {
            let t = store.reads.reserve();
            std::thread::scope(|s| {
                s.spawn(|| {
                    std::thread::sleep(std::time::Duration::from_millis(60));
                    store.reads.submit(Priority::Demand, vec![(t, Vec::new())]);
                });
                store.wait_io(t, what).unwrap();
            });
        };
        let seconds = |l: usize| (store.stats().layer(l).stall_us / 1e6, store.expert_waited_seconds(l));
        let (stall0, experts0) = seconds(layer);
        wait(WaitFor::Trunk(Some(layer)));
        let (stall1, experts1) = seconds(layer);
        assert!(stall1 - stall0 >= 0.03, "the layer's stall grew by {} s", stall1 - stall0);
        assert_eq!(experts1, experts0, "a trunk wait counts as none for the layer's experts");
        wait(WaitFor::Experts(layer));
        let (stall2, experts2) = seconds(layer);
        assert!(experts2 - experts1 >= 0.03, "the layer's expert waits grew by {} s", experts2 - experts1);
        assert!(((experts2 - experts1) - (stall2 - stall1)).abs() < 1e-6, "in the layer's stall too");
        // Another layer's expert wait counts in that layer's, not in this one's.
        wait(WaitFor::Experts(layer + 1));
        assert_eq!(seconds(layer), (stall2, experts2));
        assert!(seconds(layer + 1).1 >= 0.03, "layer {}'s expert waits", layer + 1);
    }

    /// An expert handed out unchecked is settled by the checksum its products hashed: a match
    /// checks it, a mismatch takes it out of the pool to be read again, and a second mismatch
    /// in a row stops the run naming it.
    #[test]
    fn an_expert_handed_out_unchecked_is_settled_by_the_sum_its_products_hashed() {
        use crate::checkpoint::expert_sums::expert_checksum;
        use crate::model::weights::ExpertView;
        let (_tmp, model) = tiny_copy();
        let layer = first_moe_layer(&model);
        let opened = open(&model);
        let store = opened.engine.src.store();
        let sum = |g: &super::super::ExpertGuard<'_>| expert_checksum(&g.parts().parts());
        let holders = || super::super::lock(&store.pool).slots.iter().map(|s| s.users).sum::<usize>();
        // A match: the expert is checked, and its next use is too.
        let g = store.expert_unchecked(layer, 0).unwrap();
        assert!(g.unchecked());
        let right = sum(&g);
        assert!(g.confirm(right, 0.25).unwrap());
        let stats = store.stats();
        assert_eq!((stats.experts_verified, stats.experts_verified_in_products), (1, 1));
        assert!(stats.expert_verify_in_products_seconds > 0.0 && stats.expert_verify_seconds > 0.0);
        assert_eq!(holders(), 0, "the guard's hold released");
        let g = store.expert_unchecked(layer, 0).unwrap();
        assert!(!g.unchecked(), "checked once, handed out checked");
        drop(g);
        // A mismatch: it leaves the pool; its next use reads it again and checks it.
        let g = store.expert_unchecked(layer, 1).unwrap();
        let right = sum(&g);
        assert!(!g.confirm(right ^ 1, 0.0).unwrap());
        assert!(!store.expert_requested((layer, 1)), "damaged bytes leave the pool");
        assert_eq!(holders(), 0, "the guard's hold released once");
        assert_eq!(store.stats().expert_reads_damaged, 1);
        let reads = store.stats().expert_reads;
        drop(store.expert(layer, 1).unwrap());
        assert_eq!(store.stats().expert_reads, reads + 1, "read again");
        // Two mismatches in a row: the second is an error naming the expert.
        let g = store.expert_unchecked(layer, 2).unwrap();
        let right = sum(&g);
        assert!(!g.confirm(right ^ 1, 0.0).unwrap());
        let g = store.expert_unchecked(layer, 2).unwrap();
        assert!(g.unchecked(), "read again, unchecked");
        let err = g.confirm(right ^ 1, 0.0).unwrap_err().to_string();
        assert!(err.contains(&format!("layer {layer} expert 2 in ")) && err.contains("fails its checksum"), "{err}");
        assert_eq!(holders(), 0);
    }
}
