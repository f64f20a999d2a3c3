//! Whether guessing pays, layer by layer, found by trying it: decode passes alternate with and
//! without guesses, each layer's window is timed, and each layer keeps the faster setting until
//! the next trial.
//!
//! Why measure instead of model: a guess read costs more than device time. On a virtual machine
//! whose disk is emulated by the host, any read in flight takes CPU time from the guest (measured
//! on the development VM: about a quarter of both vCPUs whenever a read is outstanding, which
//! slows a parallel matmul by 40-60%), so a guess that moves a read from a stall into compute
//! time can lose more compute than it saves stall. Such costs depend on the machine, its load,
//! the budget and the layer (after a long dense layer a guess has time to land; before a block
//! start it may not), so the controller compares what the user pays: time.
//!
//! A layer's window runs from the point its experts are predicted (the previous layer's MLP
//! residual read, or the previous layer's end for a block start) to the end of the layer: it
//! holds the reads its guesses cause, the compute they slow down and the stall they save. Passes
//! alternate all layers together, so the two settings meet the same drift of the machine. Only
//! decode-sized passes are timed: at most one row per sequence the run holds (one for a single
//! sequence; a batch's decode steps; a step that carries prompt pieces or a draft's extra rows
//! is usually larger). Larger passes run with the current choice and do not alternate. A trial
//! times passes of one size: a timed pass of another size (a sequence left the batch, or
//! joined it) starts it over at that size, and a trial still undecided after
//! [`TRIAL_BOUND_PASSES`] timed passes, restarts included, decides with what it has.
//!
//! Guesses save only waits for their layer's experts: a layer's gain counts up to the time its
//! windows without guesses spent waiting for that layer's experts (their median), so where
//! compute never waits for them, noise in the window times cannot make guessing win. (A window
//! also holds the previous layer's expert waits and the layer's trunk waits, which no guess
//! for this layer removes: the store counts each layer's expert waits apart.) Measured on a
//! modeled device at 9 GB with random routing (Zen 3 host), where nothing but the embedding
//! rows waited: layers that won their trial on noise read 0.14-0.25 GB per token more and ran
//! up to 16% slower than `--no-spec`.
//!
//! Allocation: the sample lists are sized once for the layers and the trial length.

use std::time::Instant;

/// Windows timed with and without guesses per layer in one trial (each).
pub const TRIAL_PASSES: usize = 3;

/// A trial that has not filled every layer's samples after this many timed passes of its size
/// decides with what it has (a layer short of samples stays without guesses).
pub const TRIAL_PASSES_MAX: usize = 4 * TRIAL_PASSES;

/// Timed passes of any size after which a trial that keeps starting over decides with what it
/// has.
pub const TRIAL_BOUND_PASSES: usize = 2 * TRIAL_PASSES_MAX;

/// Decode passes after the prompt until the first trial decides, when every layer's window
/// closes in each: [`TRIAL_PASSES`] each way, plus one for a batch whose last prompt step is no
/// larger than its decode steps (timed, then started over at the decode steps' size).
pub const DECODE_PASSES_TO_FIRST_DECISION: usize = 2 * TRIAL_PASSES + 1;

/// Passes run with the layers' decisions before the next trial.
pub const DECIDED_PASSES: usize = 48;

/// Guessing must be this much faster (median window time) to win a layer's trial. Choosing it
/// wrongly costs time, choosing against it wrongly only forgoes a gain, so ties and noise go to
/// the setting without guesses.
pub const GUESSING_MARGIN: f64 = 0.05;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Alternating all layers together; `passes` timed passes of the trial's size so far.
    Trial { on: bool, passes: usize },
    /// Each layer runs its decision for `passes_left` more passes.
    Decided { passes_left: usize },
}

#[derive(Clone, Debug, Default)]
struct LayerTrial {
    /// Seconds of the layer's windows in this trial, with and without guesses.
    with: Vec<f64>,
    without: Vec<f64>,
    /// Seconds compute waited for the layer's experts in each window without guesses.
    waited_without: Vec<f64>,
    /// The open window: its start and whether it guesses.
    open: Option<(Mark, bool)>,
    /// The last decision.
    guess: bool,
}

/// A moment of the run: the time, and the seconds compute had waited for a layer's experts by
/// then.
#[derive(Clone, Copy, Debug)]
pub struct Mark {
    pub at: Instant,
    pub waited_s: f64,
}

impl Mark {
    /// Now, compute having waited `waited_s` seconds for the layer's experts so far.
    pub fn now(waited_s: f64) -> Mark {
        Mark { at: Instant::now(), waited_s }
    }
}

/// The per-layer trial-and-decide controller.
#[derive(Clone, Debug)]
pub struct Trials {
    phase: Phase,
    layers: Vec<LayerTrial>,
    /// Passes larger than this are never timed: one row per sequence the run holds.
    max_rows: usize,
    /// The pass size the current trial times (`None` until a timed pass ends in it).
    rows: Option<usize>,
    /// Timed passes since this trial began, restarts included.
    trial_passes: usize,
    /// Trials decided so far, whether or not any layer was timed in them.
    pub trials_decided: u64,
    /// Layer decisions made so far for guessing and against it (for the run report).
    pub decided_on: u64,
    pub decided_off: u64,
}

impl Trials {
    /// Starts in a trial, with a pass without guesses, for a run of up to `sequences` sequences.
    pub fn new(layers: usize, sequences: usize) -> Trials {
        let layer = LayerTrial {
            with: Vec::with_capacity(TRIAL_PASSES_MAX),
            without: Vec::with_capacity(TRIAL_PASSES_MAX),
            waited_without: Vec::with_capacity(TRIAL_PASSES_MAX),
            ..LayerTrial::default()
        };
        Trials {
            phase: Phase::Trial { on: false, passes: 0 },
            layers: vec![layer; layers],
            max_rows: sequences.max(1),
            rows: None,
            trial_passes: 0,
            trials_decided: 0,
            decided_on: 0,
            decided_off: 0,
        }
    }

    /// Whether guesses for `layer` are read now.
    pub fn guessing(&self, layer: usize) -> bool {
        match self.phase {
            Phase::Trial { on, .. } => on,
            Phase::Decided { .. } => self.layers.get(layer).is_some_and(|l| l.guess),
        }
    }

    /// The seconds compute waited for `layer`'s experts in each of its timed windows without
    /// guesses in this trial.
    #[cfg(test)]
    pub(crate) fn waited_without(&self, layer: usize) -> &[f64] {
        self.layers.get(layer).map_or(&[], |l| &l.waited_without)
    }

    /// `layer`'s window opens (its experts are about to be predicted).
    pub fn window_start(&mut self, layer: usize, now: Mark) {
        let guessing = self.guessing(layer);
        if let Some(l) = self.layers.get_mut(layer) {
            l.open = Some((now, guessing));
        }
    }

    /// `layer` ended a pass of `tokens` tokens: its window closes.
    pub fn window_end(&mut self, layer: usize, tokens: usize, now: Mark) {
        let in_trial = matches!(self.phase, Phase::Trial { .. });
        let Some(l) = self.layers.get_mut(layer) else { return };
        let Some((start, guessed)) = l.open.take() else { return };
        if in_trial && tokens <= self.max_rows && self.rows.is_none_or(|rows| rows == tokens) {
            l.record(guessed, now.at.duration_since(start.at).as_secs_f64(), now.waited_s - start.waited_s);
        }
    }

    /// A pass of `tokens` tokens ended.
    pub fn pass_end(&mut self, tokens: usize) {
        match self.phase {
            Phase::Decided { passes_left } if passes_left > 1 => {
                self.phase = Phase::Decided { passes_left: passes_left - 1 };
            }
            Phase::Decided { .. } => {
                self.trial_passes = 0;
                self.restart(None);
            }
            Phase::Trial { .. } if tokens > self.max_rows => {}
            Phase::Trial { .. } if self.trial_passes + 1 >= TRIAL_BOUND_PASSES => self.decide(),
            Phase::Trial { .. } if self.rows.is_some_and(|rows| rows != tokens) => {
                self.trial_passes += 1;
                self.restart(Some(tokens));
            }
            Phase::Trial { on, passes } => {
                self.trial_passes += 1;
                self.rows = Some(tokens);
                let timed = self.layers.iter().filter(|l| !l.with.is_empty() || !l.without.is_empty());
                let full = timed.clone().count() > 0
                    && timed.clone().all(|l| l.with.len() >= TRIAL_PASSES && l.without.len() >= TRIAL_PASSES);
                if full || passes + 1 >= TRIAL_PASSES_MAX {
                    self.decide();
                } else {
                    self.phase = Phase::Trial { on: !on, passes: passes + 1 };
                }
            }
        }
    }

    /// The trial starts over, timing passes of `rows` (`None`: the next timed pass's size).
    fn restart(&mut self, rows: Option<usize>) {
        for l in &mut self.layers {
            l.with.clear();
            l.without.clear();
            l.waited_without.clear();
        }
        self.rows = rows;
        self.phase = Phase::Trial { on: false, passes: 0 };
    }

    fn decide(&mut self) {
        self.trials_decided += 1;
        for (layer, l) in self.layers.iter_mut().enumerate() {
            if l.with.is_empty() && l.without.is_empty() {
                continue;
            }
            let enough = l.with.len() >= TRIAL_PASSES && l.without.len() >= TRIAL_PASSES;
            let (with, without, waited) = (median(&mut l.with), median(&mut l.without), median(&mut l.waited_without));
            let gain = (without - with).min(waited);
            l.guess = enough && gain > without * GUESSING_MARGIN;
            tracing::debug!(
                layer,
                with_s = with,
                without_s = without,
                waited_without_s = waited,
                guess = l.guess,
                "speculation trial decided: the layer's window medians with and without guesses"
            );
            if l.guess {
                self.decided_on += 1;
            } else {
                self.decided_off += 1;
            }
        }
        self.phase = Phase::Decided { passes_left: DECIDED_PASSES };
    }
}

impl LayerTrial {
    fn record(&mut self, guessed: bool, seconds: f64, waited_s: f64) {
        if guessed {
            if self.with.len() < TRIAL_PASSES_MAX {
                self.with.push(seconds);
            }
        } else if self.without.len() < TRIAL_PASSES_MAX {
            self.without.push(seconds);
            self.waited_without.push(waited_s.max(0.0));
        }
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::INFINITY)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn start() -> Mark {
        Mark { at: Instant::now(), waited_s: 0.0 }
    }

    /// `seconds` after `m`, `waited` of them waiting for reads.
    fn after(m: Mark, seconds: f64, waited: f64) -> Mark {
        Mark { at: m.at + Duration::from_secs_f64(seconds), waited_s: m.waited_s + waited }
    }

    /// Runs decode passes over layers 1 and 2 whose windows take `on[l]` or `off[l]` seconds
    /// as the controller chooses, windows without guesses waiting `waited[l]` of theirs for
    /// reads; returns the settings used per pass for each layer.
    fn drive_waiting(t: &mut Trials, passes: usize, on: [f64; 2], off: [f64; 2], waited: [f64; 2]) -> Vec<[bool; 2]> {
        let mut now = start();
        (0..passes)
            .map(|_| {
                let mut used = [false; 2];
                for (i, layer) in [1, 2].into_iter().enumerate() {
                    used[i] = t.guessing(layer);
                    t.window_start(layer, now);
                    now = if used[i] { after(now, on[i], 0.0) } else { after(now, off[i], waited[i]) };
                    t.window_end(layer, 1, now);
                }
                t.pass_end(1);
                used
            })
            .collect()
    }

    /// [`drive_waiting`] where a window without guesses waits what guessing saves.
    fn drive(t: &mut Trials, passes: usize, on: [f64; 2], off: [f64; 2]) -> Vec<[bool; 2]> {
        drive_waiting(t, passes, on, off, [0, 1].map(|i| (off[i] - on[i]).max(0.0)))
    }

    #[test]
    fn each_layer_keeps_the_faster_setting() {
        let mut t = Trials::new(3, 1);
        let trial = drive(&mut t, 2 * TRIAL_PASSES, [0.1, 0.12], [0.15, 0.1]);
        assert_eq!(trial.iter().map(|u| u[0]).collect::<Vec<_>>(), [false, true, false, true, false, true]);
        let decided = drive(&mut t, DECIDED_PASSES, [0.1, 0.12], [0.15, 0.1]);
        assert!(decided.iter().all(|u| u[0] && !u[1]), "layer 1 guesses, layer 2 does not: {decided:?}");
        assert_eq!((t.decided_on, t.decided_off), (1, 1));
        let again = drive(&mut t, 2, [0.1, 0.12], [0.15, 0.1]);
        assert_eq!(again, [[false, false], [true, true]], "a new trial alternates all layers");
    }

    #[test]
    fn guessing_gains_no_more_than_the_waits_it_can_remove() {
        let (on, off) = ([0.1, 0.1], [0.15, 0.15]);
        // Windows a third faster with guesses, but windows without them never waited: noise.
        let mut t = Trials::new(3, 1);
        drive_waiting(&mut t, 2 * TRIAL_PASSES, on, off, [0.0, 0.0]);
        assert!(!t.guessing(1) && !t.guessing(2));
        assert_eq!(t.decided_off, 2);
        // Layer 1's waits are below the margin (5% of its 0.15 s window); layer 2's are not.
        let mut t = Trials::new(3, 1);
        drive_waiting(&mut t, 2 * TRIAL_PASSES, on, off, [0.007, 0.01]);
        assert!(!t.guessing(1) && t.guessing(2));
    }

    #[test]
    fn a_gain_within_the_noise_margin_does_not_switch_guessing_on() {
        let mut t = Trials::new(3, 1);
        drive(&mut t, 2 * TRIAL_PASSES, [0.96, 0.96], [1.0, 1.0]);
        assert!(!t.guessing(1) && !t.guessing(2));
    }

    #[test]
    fn an_outlier_does_not_decide() {
        let mut t = Trials::new(2, 1);
        let mut now = start();
        // Without guesses: 1.0, 1.0, 5.0 (one slow window, waiting); with: 1.1 each. Medians
        // compare.
        for s in [1.0, 1.1, 1.0, 1.1, 5.0, 1.1] {
            t.window_start(1, now);
            now = after(now, s, s);
            t.window_end(1, 1, now);
            t.pass_end(1);
        }
        assert!(!t.guessing(1));
        assert_eq!(t.decided_off, 1);
    }

    #[test]
    fn only_decode_sized_passes_are_timed_and_a_trial_is_bounded() {
        let mut t = Trials::new(2, 1);
        let now = start();
        t.window_start(1, now);
        t.window_end(1, 32, after(now, 10.0, 10.0));
        t.pass_end(32);
        assert!(!t.guessing(1), "a prompt pass of one sequence neither counts nor alternates");
        assert!(t.layers[1].without.is_empty());
        // A layer whose window never closes in a timed pass is never timed; the trial still
        // ends after TRIAL_PASSES_MAX passes, without guesses for it.
        for _ in 0..TRIAL_PASSES_MAX {
            t.pass_end(1);
        }
        assert!(!t.guessing(1));
        assert_eq!((t.decided_on, t.decided_off, t.trials_decided), (0, 0, 1), "decided, with nothing timed");
    }

    #[test]
    fn a_batch_is_timed_at_its_decode_steps_and_again_when_it_changes() {
        let mut t = Trials::new(2, 20);
        let mut now = start();
        let mut pass = |t: &mut Trials, rows: usize, seconds: f64| {
            t.window_start(1, now);
            now = after(now, seconds, seconds);
            t.window_end(1, rows, now);
            t.pass_end(rows);
        };
        pass(&mut t, 48, 3.0);
        assert_eq!(t.rows, None, "a step with prompt pieces, more rows than sequences, is not timed");
        pass(&mut t, 16, 1.0);
        pass(&mut t, 16, 1.0);
        assert_eq!((t.rows, t.layers[1].with.len() + t.layers[1].without.len()), (Some(16), 2));
        pass(&mut t, 20, 1.0);
        assert_eq!(t.rows, Some(20), "four sequences joined: the trial starts over at 20 rows");
        assert!(t.layers[1].with.is_empty() && t.layers[1].without.is_empty());
        for _ in 0..2 * TRIAL_PASSES {
            let on = t.guessing(1);
            pass(&mut t, 20, if on { 0.5 } else { 1.0 });
        }
        assert!(matches!(t.phase, Phase::Decided { .. }));
        assert!(t.guessing(1), "guessing won the 20-row windows");
        assert_eq!((t.decided_on, t.decided_off, t.trials_decided), (1, 0, 1));
    }

    #[test]
    fn a_trial_that_keeps_starting_over_still_decides() {
        // Sizes that change at every step (sequences leaving and joining, drafts' extra rows).
        let mut t = Trials::new(2, 8);
        for i in 0..TRIAL_BOUND_PASSES - 1 {
            t.pass_end(1 + i % 2);
            assert!(matches!(t.phase, Phase::Trial { .. }), "pass {i}");
        }
        t.pass_end(1);
        assert!(matches!(t.phase, Phase::Decided { .. }));
        assert_eq!(t.trials_decided, 1);
    }
}
