//! The batcher's side of the prefix cache ([`crate::engine::prefix_cache`]): starting a
//! sequence from a cached prefix of its prompt, and keeping snapshots of prompts as they run.

use super::{BatchRequest, Batcher};
use crate::engine::prefix_cache::{PrefixCache, PrefixCacheOptions, PrefixStats};
use crate::engine::EngineError;
use crate::model::weights::WeightSource;
use crate::model::LayerHook;

impl<S: WeightSource + LayerHook> Batcher<'_, S> {
    /// Keeps snapshots of prompts' states from now on and starts new sequences from them
    /// ([`super::prefix_cache`]); the outputs stay those of a cold start.
    pub fn enable_prefix_cache(&mut self, opts: PrefixCacheOptions) {
        self.prefix_cache = Some(PrefixCache::new(opts));
    }

    /// What the prefix cache did (None when it is off).
    pub fn prefix_stats(&self) -> Option<PrefixStats> {
        self.prefix_cache.as_ref().map(PrefixCache::stats)
    }

    /// Starts `slot`'s state from the longest cached prefix of `request`'s prompt; returns the
    /// positions restored (0 without a cache, without a hit, or when the prompt's rows need their
    /// logits). A snapshot that does not fit leaves the state cold.
    pub(super) fn restore_prefix(&mut self, slot: usize, request: &BatchRequest) -> usize {
        let Some(cache) = &mut self.prefix_cache else { return 0 };
        if request.prompt_logprobs && request.logprobs.is_some() {
            return 0;
        }
        let Some(snap) = cache.lookup(&request.prompt) else { return 0 };
        match self.states[slot].restore(snap) {
            Ok(()) => snap.pos(),
            Err(_) => {
                self.states[slot].reset();
                0
            }
        }
    }

    /// Snapshots the prefilling sequences that stand at one of their prompt's snapshot points,
    /// or at its end.
    pub(super) fn store_prefixes(&mut self) -> Result<(), EngineError> {
        let Some(cache) = &mut self.prefix_cache else { return Ok(()) };
        for seg in &self.segments {
            let Some(run) = &self.slots[seg.slot] else { continue };
            let prompt = &run.request.prompt;
            if run.next.is_some() || run.prefilled == 0 {
                continue;
            }
            let at_end = run.prefilled == prompt.len();
            let at_point = cache.next_point(prompt, run.prefilled - 1, run.shared) == Some(run.prefilled);
            if (at_end || at_point) && cache.wants(&prompt[..run.prefilled]) {
                let snap = self.states[seg.slot].snapshot()?;
                cache.insert(&prompt[..run.prefilled], snap);
            }
        }
        Ok(())
    }
}
