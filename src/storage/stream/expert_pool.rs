//! The expert pool: routed experts read in place from the checkpoint's shards into a fixed set of
//! arena slots, kept by a cache policy, handed out as guards.
//!
//! A request names experts; those not resident are read, each into a slot of its own under a
//! ticket of its own, all in one submission in the order given (disk order for a layer's
//! misses), so each expert can be computed as soon as its own bytes have arrived. A slot is
//! chosen free first, else by the policy among idle slots (no guard, read complete); the
//! experts of the layer being computed that have not been used yet are spared unless nothing
//! else is left (they are then read again when used: slower, never wrong). A guess evicts only
//! what its caller's [`Admission`] allows.
//!
//! Threads: called from the scheduler thread (and guard drops on compute threads) under the
//! pool lock; the lock is never held while waiting for a read. Allocation: the slot table and
//! maps are sized at open; a request allocates its op lists.

use std::collections::{HashMap, HashSet, VecDeque};

use super::arena::{Filled, Region, Slot};
use super::policy::{CachePolicy, ExpertKey};
use super::reads::{OpMeta, Priority, SendOp, Ticket};
use super::{lock, Store, WaitFor};
use crate::checkpoint::ExpertImage;
use crate::model::weights::{ExpertBytes, ExpertView, SourceError};
use crate::storage::stream::arena::FileRange;

/// Where each of an expert's six tensors sits in its slot: (offset, len), in EXPERT_PARTS order.
pub(super) type PartPlaces = [(usize, usize); 6];

/// A guessed expert: its key and the caller's estimate of the chance that its layer's routing
/// will choose it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Guess {
    pub key: ExpertKey,
    pub p_use: f32,
}

/// The expert a guess would evict.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Victim {
    pub key: ExpertKey,
    /// `Some(p_use)` if it is itself a guess whose layer has not been routed yet.
    pub pending_guess: Option<f32>,
}

/// Decides whether a guess may take a slot from the expert resident in it.
pub trait Admission {
    /// May guess number `guess` (in the order requested) evict `victim`?
    fn admit(&self, guess: usize, victim: Victim) -> bool;
}

/// Admits everything: eviction is left to the policy.
pub struct AdmitAll;

impl Admission for AdmitAll {
    fn admit(&self, _guess: usize, _victim: Victim) -> bool {
        true
    }
}

/// What a layer's routing found in the pool.
#[derive(Clone, Debug, Default)]
pub struct Routed {
    /// Tickets of the demand reads started.
    pub tickets: Vec<Ticket>,
    /// Experts of the layer resident before the routing that were not pending guesses, and how
    /// many of them the routing chose: the cache's own hit history.
    pub cached: usize,
    pub cached_hits: usize,
}

pub(super) struct ExpertSlot {
    pub(super) slot: Slot,
    pub(super) key: Option<ExpertKey>,
    /// Guards alive over the slot's bytes (and a check made while waiting for a read).
    pub(super) users: usize,
    pub(super) parts: PartPlaces,
    /// Read on a prediction and not used yet.
    pub(super) speculative: bool,
    /// A guess whose layer has not been routed since it was made, with its chance of use.
    pending_guess: Option<f32>,
    /// Tensor bytes of the expert held, and of its read windows.
    pub(super) bytes: u64,
    window_bytes: u64,
    /// The bytes read have matched the expert's checksum (or checking is off): only then are
    /// they handed out as checked (before, only unchecked: [`Store::expert_unchecked`]).
    pub(super) verified: bool,
}

pub(super) struct ExpertPool {
    pub(super) slots: Vec<ExpertSlot>,
    pub(super) resident: HashMap<ExpertKey, usize>,
    pub(super) policy: Box<dyn CachePolicy>,
    /// Experts of the current layer not read yet (no slot was free), in disk order.
    pending: VecDeque<ExpertKey>,
    /// Experts of the current layer not used yet: never evicted by a guess, and by a demand
    /// read only when nothing else is left.
    pub(super) protected: HashSet<ExpertKey>,
    /// Experts whose last read failed its checksum: read again once; a second failure in a row
    /// stops the run.
    pub(super) damaged: HashSet<ExpertKey>,
}

impl ExpertPool {
    pub fn new(slots: Vec<Slot>, policy: Box<dyn CachePolicy>) -> ExpertPool {
        let n = slots.len();
        ExpertPool {
            slots: slots
                .into_iter()
                .map(|slot| ExpertSlot {
                    slot,
                    key: None,
                    users: 0,
                    parts: [(0, 0); 6],
                    speculative: false,
                    pending_guess: None,
                    bytes: 0,
                    window_bytes: 0,
                    verified: false,
                })
                .collect(),
            resident: HashMap::with_capacity(n),
            policy,
            pending: VecDeque::with_capacity(n),
            protected: HashSet::with_capacity(n),
            damaged: HashSet::new(),
        }
    }

    /// Whether `key` is resident or being read.
    pub fn has(&self, key: ExpertKey) -> bool {
        self.resident.contains_key(&key)
    }

    /// The pool's invariant: the resident map and the slots' keys describe the same set.
    fn debug_check(&self) {
        if cfg!(debug_assertions) || std::env::var_os("K3_CHECK_POOL").is_some() {
            let keyed = self.slots.iter().filter(|s| s.key.is_some()).count();
            assert_eq!(keyed, self.resident.len(), "keyed slots vs resident map");
            for (k, &slot) in &self.resident {
                assert_eq!(self.slots[slot].key, Some(*k), "resident map points at a slot holding another key");
            }
        }
    }
}

/// One expert held in a pool slot until dropped.
pub struct ExpertGuard<'a> {
    pub(super) store: &'a Store,
    pub(super) slot: usize,
    filled: Filled,
    parts: PartPlaces,
    /// Handed out before its check ([`Store::expert_unchecked`]).
    pub(super) unchecked: bool,
}

/// What one attempt to make an expert resident gave.
enum Fetch<'a> {
    Ready(ExpertGuard<'a>),
    /// Its bytes failed their checksum (the expert has left the pool).
    Damaged(SourceError),
}

impl ExpertView for ExpertGuard<'_> {
    fn parts(&self) -> ExpertBytes<'_> {
        ExpertBytes::from_parts(self.store.part_bytes(self.filled, &self.parts))
    }

    fn unchecked(&self) -> bool {
        self.unchecked
    }

    fn confirm(self, sum: u64, hashing_seconds: f64) -> Result<bool, SourceError> {
        self.store.confirm_expert(self, sum, hashing_seconds)
    }
}

impl Drop for ExpertGuard<'_> {
    fn drop(&mut self) {
        let mut pool = lock(&self.store.pool);
        pool.slots[self.slot].users -= 1;
        // The slot may now be evictable: start reads still waiting for one.
        let _ = self.store.issue_pending(&mut pool, false);
    }
}

impl Store {
    /// The routing of `layer` is known: `experts` are the distinct experts it needs for the
    /// chunk. Settles the layer's pending guesses (a chosen one still being read is promoted to
    /// the front of the queue, a wrong one still being read is cancelled and leaves the pool),
    /// starts the reads of the missing experts (one submission, disk order) and reorders
    /// `experts` into the order their bytes will be there: resident ones first, then those
    /// being read in issue order.
    pub fn request_demand(&self, layer: usize, experts: &mut [usize]) -> Routed {
        let mut pool = lock(&self.pool);
        pool.policy.on_layer(layer);
        let (cached, cached_hits) = self.settle_guesses(&mut pool, layer, experts);
        pool.protected.clear();
        pool.pending.clear();
        let mut misses = Vec::new();
        {
            let mut stats = lock(&self.stats);
            for &e in experts.iter() {
                let key = (layer, e);
                pool.protected.insert(key);
                stats.routed_experts += 1;
                stats.layer(layer).routed_experts += 1;
                match pool.resident.get(&key) {
                    Some(&slot) => {
                        stats.routed_recalled += 1;
                        stats.layer(layer).routed_recalled += 1;
                        if self.read_done(&pool.slots[slot].slot) {
                            stats.expert_hits += 1;
                            stats.layer(layer).expert_hits += 1;
                        }
                    }
                    None => {
                        stats.expert_misses += 1;
                        misses.push(key);
                    }
                }
            }
        }
        // One submission per layer, in disk order.
        misses.sort_by_key(|k| self.disk_position(*k));
        pool.pending.extend(misses.iter().copied());
        let tickets = self.issue_pending(&mut pool, false).unwrap_or_default();
        // Compute order: what is there first, then what is being read in the order it was
        // issued (tickets grow; guesses still being read were issued before this layer's
        // misses), so compute never waits for one expert while another is ready. Experts that
        // got no slot yet come last, read when a slot frees.
        // Those waiting for a slot come in the order they will be read (disk order): computing
        // one out of turn would evict a protected expert just read, to be read again.
        let order = |e: &usize| match pool.resident.get(&(layer, *e)) {
            Some(&slot) => (pool.slots[slot].slot.ticket().filter(|&t| !self.reads.is_done(t)).unwrap_or(0), 0),
            None => (Ticket::MAX, pool.pending.iter().position(|k| *k == (layer, *e)).unwrap_or(usize::MAX)),
        };
        experts.sort_by_cached_key(order);
        drop(pool);
        Routed { tickets, cached, cached_hits }
    }

    /// Settles the pending guesses of `layer` against its routing (`experts`); returns how many
    /// other experts of the layer were resident and how many of those the routing chose.
    fn settle_guesses(&self, pool: &mut ExpertPool, layer: usize, experts: &[usize]) -> (usize, usize) {
        let (mut cached, mut cached_hits) = (0, 0);
        for i in 0..pool.slots.len() {
            let s = &mut pool.slots[i];
            let Some(key) = s.key.filter(|k| k.0 == layer) else { continue };
            let chosen = experts.contains(&key.1);
            let in_flight = s.slot.ticket().filter(|&t| !self.reads.is_done(t));
            match (s.pending_guess.take(), in_flight) {
                (None, _) => {
                    cached += 1;
                    cached_hits += usize::from(chosen);
                }
                (Some(_), Some(t)) if chosen => self.reads.promote(t),
                (Some(_), Some(t)) => {
                    // A wrong guess still being read: drop what has not reached the device. The
                    // slot stays in flight (so it is not reused) until the rest has landed.
                    self.reads.cancel(t);
                    s.key = None;
                    let window = s.window_bytes;
                    pool.resident.remove(&key);
                    pool.policy.on_evict(key);
                    let mut stats = lock(&self.stats);
                    stats.spec_cancelled += 1;
                    stats.spec_cancelled_window_bytes += window;
                }
                (Some(_), None) => {}
            }
        }
        (cached, cached_hits)
    }

    /// Reads the guessed experts that are neither resident nor being read, in this order, at
    /// `priority` (never `Demand`: see [`Store::request_demand`]): each into a free slot, else
    /// into the policy's choice among the idle slots that the current layer does not need and
    /// whose expert `admission` lets that guess evict (for a policy whose search changes its
    /// state, [`CachePolicy::searching_changes_state`], its first choice if admitted). Stops at
    /// the first guess that gets no slot.
    /// Returns how many were read.
    pub fn request(&self, guesses: &[Guess], priority: Priority, admission: &dyn Admission) -> usize {
        debug_assert!(priority != Priority::Demand, "demand reads go through request_demand");
        let mut pool = lock(&self.pool);
        let mut groups: Vec<(Ticket, Vec<SendOp>)> = Vec::new();
        let mut read = 0;
        for (i, g) in guesses.iter().enumerate() {
            if pool.resident.contains_key(&g.key) {
                continue;
            }
            // The policy's first choice among the experts this guess may evict, not its first
            // choice outright: `even` puts the fullest layer first, which may be the layer routed
            // next, whose experts no guess evicts; refusing there left whole layers unguessed.
            // Except for a policy whose search changes its state (S3-FIFO).
            let admit = |v: Victim| admission.admit(i, v);
            let slot = match self.free_slot(&pool) {
                Some(free) => Some(free),
                None if pool.policy.searching_changes_state() => self
                    .victim_slot(&mut pool, false, &|_| true)
                    .filter(|&(slot, key)| admit(Victim { key, pending_guess: pool.slots[slot].pending_guess }))
                    .map(|(s, _)| s),
                None => self.victim_slot(&mut pool, false, &admit).map(|(s, _)| s),
            };
            let Some(slot) = slot else {
                let left = guesses[i..].iter().filter(|g| !pool.resident.contains_key(&g.key)).count() as u64;
                lock(&self.stats).layer(g.key.0).guesses_no_slot += left;
                break;
            };
            self.evict(&mut pool, slot);
            match self.start_expert_read(&mut pool, g.key, slot, priority) {
                Ok(group) => groups.push(group),
                Err(_) => break,
            }
            if priority == Priority::Guess {
                pool.slots[slot].pending_guess = Some(g.p_use);
            }
            read += 1;
        }
        self.submit_expert_reads(&pool, priority, groups);
        read
    }

    /// Makes one routed expert resident and returns its bytes, checked against its checksum.
    /// Bytes that fail it are read once more ([`Store::note_damaged_read`]): a damaged transfer
    /// heals, damaged bytes on the device fail the run (exit 3) naming the file. Two failed
    /// reads in a row (the first may be a wait's check) stop it.
    pub fn expert(&self, layer: usize, expert: usize) -> Result<ExpertGuard<'_>, SourceError> {
        self.fetch_healed(layer, expert, false)
    }

    /// [`Store::expert`], but an expert not checked yet is handed out unchecked (unless a wait
    /// began its check, which is then finished here): its products hash it in cache and
    /// [`Store::confirm_expert`] settles it.
    pub fn expert_unchecked(&self, layer: usize, expert: usize) -> Result<ExpertGuard<'_>, SourceError> {
        self.fetch_healed(layer, expert, true)
    }

    /// [`Store::expert`], its check deferred if `defer`.
    fn fetch_healed(&self, layer: usize, expert: usize, defer: bool) -> Result<ExpertGuard<'_>, SourceError> {
        match self.fetch_expert(layer, expert, defer)? {
            Fetch::Ready(guard) => Ok(guard),
            Fetch::Damaged(e) if !self.note_damaged_read((layer, expert)) => Err(e),
            Fetch::Damaged(_) => match self.fetch_expert(layer, expert, false)? {
                Fetch::Ready(guard) => Ok(guard),
                Fetch::Damaged(e) => Err(e),
            },
        }
    }

    /// One attempt of [`Store::expert`]: its bytes, or the checksum mismatch that took them out
    /// of the pool. With `defer`, an expert whose check has not begun comes out unchecked.
    fn fetch_expert(&self, layer: usize, expert: usize, defer: bool) -> Result<Fetch<'_>, SourceError> {
        let key = (layer, expert);
        let (slot, ticket) = {
            let mut pool = self.make_resident(key)?;
            let slot =
                *pool.resident.get(&key).ok_or_else(|| SourceError::Internal(format!("expert {key:?} vanished")))?;
            pool.protected.remove(&key);
            let s = &mut pool.slots[slot];
            s.users += 1;
            if std::mem::replace(&mut s.speculative, false) {
                lock(&self.stats).spec_used += 1;
            }
            let ticket = s.slot.ticket();
            pool.policy.on_access(key);
            (slot, ticket)
        };
        if let Some(t) = ticket {
            if let Err(e) = self.wait_io(t, WaitFor::Experts(layer)) {
                let mut pool = lock(&self.pool);
                let s = &mut pool.slots[slot];
                s.users -= 1;
                if s.slot.ticket() == Some(t) {
                    s.slot.abandon();
                }
                s.key = None;
                pool.resident.remove(&key);
                pool.policy.on_evict(key);
                return Err(self.read_error(format!("layer {layer} expert {expert}"), &e));
            }
        }
        let mut pool = lock(&self.pool);
        let s = &mut pool.slots[slot];
        if ticket.is_some() && s.slot.ticket() == ticket {
            s.slot.landed();
        }
        let filled = s.slot.filled().ok_or_else(|| {
            SourceError::Internal(format!("layer {layer} expert {expert}: its slot is not filled after its read"))
        })?;
        let (parts, verified) = (s.parts, s.verified || !self.verify_experts);
        drop(pool);
        if !verified {
            // Outside the pool lock: the guard count taken above keeps the slot from being
            // evicted or re-read while its bytes are hashed. A check that waits for reads began
            // is finished here, and its own hold on the slot released.
            let begun = self.take_waiting_check(slot);
            if begun.is_none() && defer {
                return Ok(Fetch::Ready(ExpertGuard { store: self, slot, filled, parts, unchecked: true }));
            }
            let held_by_check = begun.is_some();
            let checked = self.verify_expert(key, filled, &parts, begun.map(|c| c.sum).unwrap_or_default());
            let mut pool = lock(&self.pool);
            if held_by_check {
                pool.slots[slot].users -= 1;
            }
            if let Err(e) = checked {
                self.drop_damaged(&mut pool, slot, key);
                return Ok(Fetch::Damaged(e));
            }
            pool.slots[slot].verified = true;
            pool.damaged.remove(&key);
        }
        Ok(Fetch::Ready(ExpertGuard { store: self, slot, filled, parts, unchecked: false }))
    }

    /// Whether `key` is resident or being read.
    pub fn expert_requested(&self, key: ExpertKey) -> bool {
        lock(&self.pool).has(key)
    }

    /// Whether a slot's read (if any) has completed.
    fn read_done(&self, slot: &Slot) -> bool {
        slot.ticket().is_none_or(|t| self.reads.is_done(t))
    }

    /// A slot holding nothing, with no read in flight.
    fn free_slot(&self, pool: &ExpertPool) -> Option<usize> {
        pool.slots.iter().position(|s| s.key.is_none() && self.read_done(&s.slot))
    }

    /// The policy's choice among idle slots (no guard, read complete) whose expert `may_evict`
    /// allows, sparing experts the current layer has yet to use unless `take_protected` and
    /// nothing else is left; with the key it holds. Lists nothing: the policies walk their own
    /// order.
    fn victim_slot(
        &self,
        pool: &mut ExpertPool,
        take_protected: bool,
        may_evict: &dyn Fn(Victim) -> bool,
    ) -> Option<(usize, ExpertKey)> {
        let idle = |s: &ExpertSlot| s.users == 0 && self.read_done(&s.slot);
        let any_spare = pool.slots.iter().any(|s| idle(s) && s.key.is_some_and(|k| !pool.protected.contains(&k)));
        if !any_spare && !take_protected {
            return None;
        }
        let ExpertPool { slots, resident, policy, protected, .. } = pool;
        // Admission last: it is the costliest test.
        let evictable = |k: ExpertKey| {
            (!any_spare || !protected.contains(&k))
                && resident.get(&k).is_some_and(|&i| {
                    idle(&slots[i]) && may_evict(Victim { key: k, pending_guess: slots[i].pending_guess })
                })
        };
        let key = policy.victim_where(&mut resident.keys().copied(), &evictable)?;
        let slot = *resident.get(&key)?;
        Some((slot, key))
    }

    /// Empties `slot` (a free one, or a victim just chosen): its expert leaves the pool.
    fn evict(&self, pool: &mut ExpertPool, slot: usize) {
        let s = &mut pool.slots[slot];
        s.pending_guess = None;
        if let Some(t) = s.slot.ticket() {
            self.reads.forget(t);
            s.slot.abandon();
        }
        let Some(key) = s.key.take() else { return };
        let removed = pool.resident.remove(&key);
        assert_eq!(removed, Some(slot), "the resident map and the slots disagree");
        pool.policy.on_evict(key);
        let mut stats = lock(&self.stats);
        stats.expert_evictions += 1;
        if s.speculative {
            stats.spec_wasted_bytes += s.bytes;
        }
    }

    /// Tags `slot` with a new ticket for `key` and builds its reads.
    fn start_expert_read(
        &self,
        pool: &mut ExpertPool,
        key: ExpertKey,
        slot: usize,
        priority: Priority,
    ) -> Result<(Ticket, Vec<SendOp>), SourceError> {
        let bytes = self
            .index
            .experts
            .get(key.0, key.1)
            .map_or(0, |r| r.parts.iter().map(|&id| self.index.tensors[id].len).sum::<u64>());
        let ticket = self.reads.reserve();
        let s = &mut pool.slots[slot];
        let target = s.slot.start_read(ticket);
        let built = self.expert_ops(key, s.slot.region(), target, priority);
        let (ops, parts) = match built {
            Ok(b) => b,
            Err(e) => {
                // Nothing will be read into the slot: complete the ticket empty and leave it free.
                self.reads.submit(priority, vec![(ticket, Vec::new())]);
                s.slot.abandon();
                return Err(e);
            }
        };
        let window_bytes = ops.iter().map(|op| op.len() as u64).sum::<u64>();
        s.key = Some(key);
        s.parts = parts;
        s.speculative = priority == Priority::Guess;
        s.pending_guess = None;
        s.bytes = bytes;
        s.window_bytes = window_bytes;
        s.verified = false;
        let replaced = pool.resident.insert(key, slot);
        assert!(replaced.is_none(), "expert {key:?} read into two slots");
        pool.policy.on_insert(key);
        let mut stats = lock(&self.stats);
        stats.expert_window_bytes_read += window_bytes;
        stats.expert_reads += 1;
        stats.expert_bytes_read += bytes;
        if priority == Priority::Guess {
            stats.spec_reads += 1;
            stats.spec_bytes += bytes;
            stats.layer(key.0).guess_reads += 1;
        }
        let ls = stats.layer(key.0);
        ls.expert_reads += 1;
        ls.expert_bytes_read += bytes;
        Ok((ticket, ops))
    }

    /// Sends the reads of one request as one submission.
    fn submit_expert_reads(&self, pool: &ExpertPool, priority: Priority, groups: Vec<(Ticket, Vec<SendOp>)>) {
        pool.debug_check();
        if !groups.is_empty() {
            self.tracer.counter("expert pool occupancy", pool.resident.len() as f64);
            self.reads.submit(priority, groups);
        }
    }

    /// Starts demand reads for as many pending experts as there are evictable slots, in one
    /// batch. Only `take_protected` may evict an expert the layer has yet to use (for the first
    /// read of the batch).
    pub(super) fn issue_pending(
        &self,
        pool: &mut ExpertPool,
        take_protected: bool,
    ) -> Result<Vec<Ticket>, SourceError> {
        let mut groups: Vec<(Ticket, Vec<SendOp>)> = Vec::new();
        // Each expert gets its own ticket, reserved as its slot is chosen, so a slot taken for
        // one expert of this batch never looks evictable to the next. Whatever happens below,
        // every reserved ticket is submitted, so nobody waits on one forever.
        let mut failure = None;
        while let Some(&key) = pool.pending.front() {
            if pool.resident.contains_key(&key) {
                pool.pending.pop_front();
                continue;
            }
            let slot = match self.free_slot(pool) {
                Some(free) => Some(free),
                None => self.victim_slot(pool, take_protected && groups.is_empty(), &|_| true).map(|(s, _)| s),
            };
            let Some(slot) = slot else { break };
            pool.pending.pop_front();
            self.evict(pool, slot);
            match self.start_expert_read(pool, key, slot, Priority::Demand) {
                Ok(group) => groups.push(group),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        let tickets: Vec<Ticket> = groups.iter().map(|g| g.0).collect();
        self.submit_expert_reads(pool, Priority::Demand, groups);
        match failure {
            Some(e) => Err(e),
            None => Ok(tickets),
        }
    }

    /// Ensures `key` has a slot (its read may still be in flight). When every slot is busy,
    /// waits for a read to land, then evicts; bounded by the pool size.
    fn make_resident(&self, key: ExpertKey) -> Result<std::sync::MutexGuard<'_, ExpertPool>, SourceError> {
        let mut pool = lock(&self.pool);
        for _ in 0..=2 * pool.slots.len() + 1 {
            if pool.resident.contains_key(&key) {
                return Ok(pool);
            }
            // Not announced, or no slot was free when it was: read it now.
            pool.pending.retain(|k| *k != key);
            pool.pending.push_front(key);
            self.issue_pending(&mut pool, true)?;
            if pool.resident.contains_key(&key) {
                return Ok(pool);
            }
            // A check made while waiting holds the slot it hashes: let it go, so that slot
            // can be evicted (its expert is checked again when used).
            if self.release_waiting_check(&mut pool) {
                continue;
            }
            // Every slot is held or still being read: wait for a read to land. If none is in
            // flight any more, one landed since the victim search: search again.
            let busy = pool
                .slots
                .iter()
                .filter(|s| s.users == 0)
                .find_map(|s| s.slot.ticket().filter(|&t| !self.reads.is_done(t)));
            if let Some(ticket) = busy {
                drop(pool);
                // A failed read frees nothing; say why instead of searching on.
                self.wait_io(ticket, WaitFor::Experts(key.0))
                    .map_err(|e| self.read_error(format!("layer {} expert {}", key.0, key.1), &e))?;
                pool = lock(&self.pool);
            }
        }
        let in_use = pool.slots.iter().filter(|s| s.users > 0).count();
        let reading = pool.slots.iter().filter(|s| s.slot.ticket().is_some_and(|t| !self.reads.is_done(t))).count();
        Err(SourceError::Internal(format!(
            "no evictable slot for layer {} expert {} among {} (in use {in_use}, reading {reading}, protected {}, pending {})",
            key.0,
            key.1,
            pool.slots.len(),
            pool.protected.len(),
            pool.pending.len()
        )))
    }

    /// Read ops for one expert into a slot; returns the ops and the parts' places in the slot.
    fn expert_ops(
        &self,
        key: ExpertKey,
        region: Region,
        target: super::arena::ReadTarget,
        priority: Priority,
    ) -> Result<(Vec<SendOp>, PartPlaces), SourceError> {
        let meta = OpMeta {
            name: "expert read",
            kind: priority.kind(),
            layer: Some(key.0 as u32),
            expert: Some(key.1 as u32),
        };
        let r = self.index.experts.get(key.0, key.1).ok_or_else(|| SourceError::Corrupt {
            what: format!("layer {} expert {}", key.0, key.1),
            message: "not in the checkpoint".to_owned(),
        })?;
        let placed = self.placed.get(key);
        let align = if placed.is_some() { self.placed.align() } else { self.align };
        let image = ExpertImage::new(&self.index.tensors, r, align);
        if image.len as usize > region.len {
            return Err(SourceError::Internal(format!(
                "expert ({}, {}) needs {} bytes, slot holds {}",
                key.0, key.1, image.len, region.len
            )));
        }
        let ops = match placed {
            // The expert files hold the image at the pack's alignment, one piece per device:
            // one read each, into its place in the slot.
            Some(pieces) => pieces
                .iter()
                .map(|p| {
                    let len = p.len as usize;
                    let range = FileRange { file: p.file, offset: p.offset, len, min_len: len };
                    self.arena.op(target, p.at as usize, range, meta)
                })
                .collect(),
            None => image
                .windows
                .iter()
                .map(|w| {
                    let range =
                        FileRange { file: w.shard, offset: w.offset, len: w.len as usize, min_len: w.min_len as usize };
                    self.arena.op(target, w.at as usize, range, meta)
                })
                .collect(),
        };
        Ok((ops, image.parts))
    }

    /// Where an expert's first tensor sits (file, offset): reads issued in this order sweep
    /// the disk forwards. Unknown experts sort last (their read then fails with a named error).
    pub fn disk_position(&self, key: ExpertKey) -> (usize, u64) {
        if let Some(p) = self.placed.get(key).and_then(<[_]>::first) {
            return (p.file, p.offset);
        }
        self.index.experts.get(key.0, key.1).map_or((usize::MAX, 0), |r| {
            let t = &self.index.tensors[r.parts[0]];
            (t.shard, t.offset)
        })
    }
}
