//! How a guess's admission meets the cache policy's order when the pool is full.

use super::expert_checks::tests::{open_with_budget, tiny_copy};
use super::policy::ExpertKey;
use super::reads::Priority;
use super::{lock, Admission, AdmitAll, Guess, Store, Victim};

/// A budget whose pool holds 28 slots: fewer than two of the tiny model's MoE layers (16
/// experts each).
const BUDGET: u64 = 3_000_000;

/// Admits only victims of one layer.
struct OnlyLayer(usize);

impl Admission for OnlyLayer {
    fn admit(&self, _guess: usize, victim: Victim) -> bool {
        victim.key.0 == self.0
    }
}

fn resident_in(store: &Store, layer: usize) -> usize {
    lock(&store.pool).resident.keys().filter(|k| k.0 == layer).count()
}

/// Fills the pool with `keys` (as guesses), then uses each once, so that every read has landed
/// and been checked and no guard holds a slot.
fn fill(store: &Store, keys: &[ExpertKey]) {
    let guesses: Vec<Guess> = keys.iter().map(|&key| Guess { key, p_use: 0.5 }).collect();
    assert_eq!(store.request(&guesses, Priority::Guess, &AdmitAll), keys.len());
    for &(layer, expert) in keys {
        drop(store.expert(layer, expert).unwrap());
    }
}

#[test]
fn a_guess_takes_the_policys_first_choice_among_the_experts_admission_lets_it_evict() {
    let (_tmp, model) = tiny_copy();
    let index = crate::checkpoint::CheckpointIndex::open(&model).unwrap();
    let mut layers: Vec<usize> = index.experts.iter().map(|r| r.layer).collect();
    layers.sort_unstable();
    layers.dedup();
    let experts = index.experts.iter().filter(|r| r.layer == layers[0]).count();
    let opened = open_with_budget(&model, BUDGET);
    let store = opened.engine.src.store();
    let slots = lock(&store.pool).slots.len();
    // Two layers share the pool unevenly: `even`, the default, takes its first victim from the
    // fuller one, layer a.
    let (a, b, c) = (layers[0], layers[1], layers[2]);
    let in_a = experts.min(slots - 1);
    let in_b = slots - in_a;
    assert!(in_a > in_b && in_b >= 1, "{slots} slots, {experts} experts per layer");
    let keys: Vec<ExpertKey> = (0..in_a).map(|e| (a, e)).chain((0..in_b).map(|e| (b, e))).collect();
    fill(store, &keys);
    assert_eq!(lock(&store.pool).policy.name(), "even");
    assert_eq!((resident_in(store, a), resident_in(store, b)), (in_a, in_b));

    // Nothing admitted: no read.
    let guess = [Guess { key: (c, 0), p_use: 0.9 }];
    assert_eq!(store.request(&guess, Priority::Guess, &OnlyLayer(usize::MAX)), 0);
    // Only layer b's experts admitted: the guess evicts one of them, though the policy would
    // rather evict one of layer a's (it used to stop there and read nothing).
    assert_eq!(store.request(&guess, Priority::Guess, &OnlyLayer(b)), 1);
    assert_eq!((resident_in(store, a), resident_in(store, b), resident_in(store, c)), (in_a, in_b - 1, 1));
    // Admitting a's: the policy's own first choice.
    let guess = [Guess { key: (c, 1), p_use: 0.9 }];
    assert_eq!(store.request(&guess, Priority::Guess, &OnlyLayer(a)), 1);
    assert_eq!(resident_in(store, a), in_a - 1);
}
