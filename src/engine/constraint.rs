//! Constrained sampling: a request may carry a [`TokenConstraint`] that says which ids may
//! come next (a JSON schema, a forced tool call). The batcher masks the sequence's logits with
//! it before sampling and tells it each id chosen. The mask is a function of the ids the
//! sequence has taken alone, so a constrained sequence's tokens do not depend on what else is
//! in the batch, and its neighbours' never depend on it.
#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex};

/// Which ids may come next.
pub trait TokenConstraint: Send {
    /// The allowed ids as bits (`bits[id / 32] >> (id % 32) & 1`) over at least the model's
    /// vocabulary, or `None` when every id is allowed. An error ends the sequence.
    fn mask(&mut self) -> Result<Option<&[u32]>, String>;

    /// Takes the id that was chosen.
    fn commit(&mut self, id: u32) -> Result<(), String>;

    /// Seconds spent in [`TokenConstraint::mask`] and [`TokenConstraint::commit`] so far.
    fn seconds(&self) -> f64;
}

/// A request's constraint, shared with whoever made it (who may read its cost).
#[derive(Clone)]
pub struct Constraint(pub Arc<Mutex<Box<dyn TokenConstraint>>>);

impl Constraint {
    pub fn new(c: Box<dyn TokenConstraint>) -> Constraint {
        Constraint(Arc::new(Mutex::new(c)))
    }

    pub fn seconds(&self) -> f64 {
        self.0.lock().map_or(0.0, |c| c.seconds())
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

/// Chooses an id from `logits` under `constraint`: the disallowed ids' logits become -inf in
/// `masked` (scratch) and `pick` chooses from it; the choice is committed. `Err` says why the
/// sequence cannot go on (no id allowed, or the constraint failed).
pub fn choose_masked(
    constraint: &Constraint,
    logits: &[f32],
    masked: &mut Vec<f32>,
    pick: impl FnOnce(&[f32]) -> usize,
) -> Result<u32, String> {
    let mut c = constraint.0.lock().map_err(|_| "the constraint was poisoned by a panic".to_owned())?;
    let id = match c.mask()? {
        None => pick(logits) as u32,
        Some(bits) => {
            let allowed = |i: usize| bits.get(i / 32).is_some_and(|w| (w >> (i % 32)) & 1 == 1);
            if !(0..logits.len()).any(allowed) {
                return Err("the constraint allows no token of this model".into());
            }
            // A logit that is -inf or NaN may be the only one left allowed; sampling needs a
            // finite value to choose it, and greedy choice needs the allowed ones ordered.
            let finite = (0..logits.len()).any(|i| allowed(i) && logits[i].is_finite());
            masked.clear();
            masked.extend(logits.iter().enumerate().map(|(i, &v)| match (allowed(i), finite) {
                (false, _) => f32::NEG_INFINITY,
                (true, true) => v,
                (true, false) => 0.0,
            }));
            pick(masked) as u32
        }
    };
    c.commit(id)?;
    Ok(id)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Allows only even ids until `stop`, then only `stop`.
    struct Evens {
        bits: Vec<u32>,
        taken: Vec<u32>,
    }

    impl TokenConstraint for Evens {
        fn mask(&mut self) -> Result<Option<&[u32]>, String> {
            self.bits = vec![0x5555_5555; 2];
            Ok(Some(&self.bits))
        }
        fn commit(&mut self, id: u32) -> Result<(), String> {
            if id % 2 == 1 {
                return Err(format!("{id} is odd"));
            }
            self.taken.push(id);
            Ok(())
        }
        fn seconds(&self) -> f64 {
            0.0
        }
    }

    #[test]
    fn masked_choice_takes_only_allowed_ids() {
        let c = Constraint::new(Box::new(Evens { bits: Vec::new(), taken: Vec::new() }));
        let mut logits = vec![0.0f32; 40];
        logits[7] = 9.0;
        logits[12] = 3.0;
        let mut scratch = Vec::new();
        let id = choose_masked(&c, &logits, &mut scratch, crate::engine::sampling::argmax).unwrap();
        assert_eq!(id, 12, "7 is the best logit but odd");
        let all_odd_best = vec![f32::NEG_INFINITY; 40];
        let id = choose_masked(&c, &all_odd_best, &mut scratch, crate::engine::sampling::argmax).unwrap();
        assert_eq!(id % 2, 0, "an allowed id is chosen even when every logit is -inf");
    }
}
