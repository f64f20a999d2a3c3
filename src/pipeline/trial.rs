//! Whether guessing pays on this machine, found by trying it: decode passes alternate with and
//! without guesses, and the faster of the two runs until the next trial.
//!
//! Why measure instead of model: a guess read costs more than device time. On a virtual machine
//! whose disk is emulated by the host, any read in flight takes CPU time from the guest (measured
//! on the development VM: about a quarter of both vCPUs whenever a read is outstanding, which
//! slows a parallel matmul by 40-60%), so a guess that moves a read from a stall into compute
//! time can lose more compute than it saves stall. Such costs depend on the machine, its load and
//! the budget; the pass time is what the user pays, so the controller compares pass times
//! directly, alternating the two settings so that drift of the machine hits both alike.
//!
//! Only single-token passes (decode) are timed, from the end of one pass to the end of the next;
//! passes of other sizes run with the current choice and are not compared.

use std::time::Instant;

/// Passes timed with and without guesses in one trial (each).
pub const TRIAL_PASSES: usize = 3;

/// Passes run with the winning setting before the next trial.
pub const DECIDED_PASSES: usize = 48;

/// Guessing must be this much faster (median pass time) to win a trial. Choosing it wrongly
/// costs time, choosing against it wrongly only forgoes a gain, so ties and noise go to the
/// setting without guesses.
pub const GUESSING_MARGIN: f64 = 0.02;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Alternating; the next pass guesses if `next_on`.
    Trial,
    /// Running the winner for `passes_left` more passes.
    Decided { on: bool, passes_left: usize },
}

/// The trial-and-decide controller.
#[derive(Clone, Debug)]
pub struct Trial {
    phase: Phase,
    /// Whether the pass now running guesses.
    on: bool,
    /// Seconds of the timed passes of the current trial, with and without guesses.
    with: Vec<f64>,
    without: Vec<f64>,
    /// End of the previous pass.
    last_end: Option<Instant>,
    /// Trials decided so far for guessing and against it (for the run report).
    pub decided_on: u64,
    pub decided_off: u64,
}

impl Default for Trial {
    fn default() -> Self {
        Trial::new()
    }
}

impl Trial {
    /// Starts in a trial, with a pass without guesses.
    pub fn new() -> Trial {
        Trial {
            phase: Phase::Trial,
            on: false,
            with: Vec::with_capacity(TRIAL_PASSES),
            without: Vec::with_capacity(TRIAL_PASSES),
            last_end: None,
            decided_on: 0,
            decided_off: 0,
        }
    }

    /// Whether the pass now running may guess.
    pub fn guessing(&self) -> bool {
        self.on
    }

    /// A pass of `tokens` tokens ended now.
    pub fn pass_end(&mut self, tokens: usize) {
        let now = Instant::now();
        let elapsed = self.last_end.map(|t| now.duration_since(t).as_secs_f64());
        self.last_end = Some(now);
        self.record(tokens, elapsed);
    }

    /// As [`Trial::pass_end`], with the pass's seconds given (`None`: not timed).
    pub fn record(&mut self, tokens: usize, seconds: Option<f64>) {
        match self.phase {
            Phase::Decided { on, passes_left } => {
                self.phase =
                    if passes_left > 1 { Phase::Decided { on, passes_left: passes_left - 1 } } else { Phase::Trial };
                self.on = if passes_left > 1 { on } else { false };
            }
            Phase::Trial => {
                if let (1, Some(s)) = (tokens, seconds) {
                    let list = if self.on { &mut self.with } else { &mut self.without };
                    if list.len() < TRIAL_PASSES {
                        list.push(s);
                    }
                }
                if self.with.len() >= TRIAL_PASSES && self.without.len() >= TRIAL_PASSES {
                    let on = median(&mut self.with) < median(&mut self.without) * (1.0 - GUESSING_MARGIN);
                    if on {
                        self.decided_on += 1;
                    } else {
                        self.decided_off += 1;
                    }
                    self.with.clear();
                    self.without.clear();
                    self.phase = Phase::Decided { on, passes_left: DECIDED_PASSES };
                    self.on = on;
                } else if tokens == 1 {
                    self.on = !self.on;
                }
            }
        }
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::INFINITY)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs passes whose time is `on` or `off` seconds as the controller chooses; returns the
    /// choices made.
    fn drive(t: &mut Trial, passes: usize, on: f64, off: f64) -> Vec<bool> {
        (0..passes)
            .map(|_| {
                let guessed = t.guessing();
                t.record(1, Some(if guessed { on } else { off }));
                guessed
            })
            .collect()
    }

    #[test]
    fn guessing_that_costs_time_is_switched_off_after_one_trial() {
        let mut t = Trial::new();
        let choices = drive(&mut t, 2 * TRIAL_PASSES + DECIDED_PASSES, 1.05, 1.0);
        assert_eq!(&choices[..2 * TRIAL_PASSES], &[false, true, false, true, false, true]);
        assert!(choices[2 * TRIAL_PASSES..].iter().all(|&g| !g), "{choices:?}");
        assert_eq!((t.decided_on, t.decided_off), (0, 1));
    }

    #[test]
    fn guessing_that_saves_time_is_kept_and_tried_again_later() {
        let mut t = Trial::new();
        let choices = drive(&mut t, 2 * TRIAL_PASSES + DECIDED_PASSES + 2, 0.9, 1.0);
        assert!(choices[2 * TRIAL_PASSES..2 * TRIAL_PASSES + DECIDED_PASSES].iter().all(|&g| g));
        assert_eq!(&choices[2 * TRIAL_PASSES + DECIDED_PASSES..], &[false, true], "a new trial starts");
        assert_eq!((t.decided_on, t.decided_off), (1, 0));
    }

    #[test]
    fn only_timed_single_token_passes_count() {
        let mut t = Trial::new();
        t.record(32, Some(10.0)); // a prefill chunk: not compared, the setting stays
        assert!(!t.guessing());
        t.record(1, None); // the first pass has no start to time from
        assert!(t.guessing(), "an untimed decode pass still alternates");
        let choices = drive(&mut t, 2 * TRIAL_PASSES, 0.5, 1.0);
        assert_eq!(choices.len(), 2 * TRIAL_PASSES);
        assert!(t.guessing(), "decided for guessing: {choices:?}");
    }

    #[test]
    fn a_gain_within_the_noise_margin_does_not_switch_guessing_on() {
        let mut t = Trial::new();
        drive(&mut t, 2 * TRIAL_PASSES, 0.99, 1.0);
        assert!(!t.guessing());
    }

    #[test]
    fn an_outlier_does_not_decide() {
        let mut t = Trial::new();
        // Without guesses: 1.0, 1.0, 5.0 (one slow pass); with: 1.1 each. The medians compare.
        for s in [1.0, 1.1, 1.0, 1.1, 5.0, 1.1] {
            t.record(1, Some(s));
        }
        assert!(!t.guessing());
        assert_eq!(t.decided_off, 1);
    }
}
