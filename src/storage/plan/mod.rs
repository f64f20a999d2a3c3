//! The memory plan: how a budget is divided among pinned trunk units, the ring of trunk slots
//! for streamed units, the expert buffer pool, and the states, caches and scratch.
//!
//! Default rule, from what the public C engine measured (1.69x faster at a fixed budget): trunk
//! first, then the expert pool. Among trunk units the planner pins the largest that fit, which
//! minimises trunk bytes read per token (every streamed unit is read once per token). The plan is
//! computed and printed before any large allocation.

mod ring;

use serde::Serialize;

use super::pack::PackUnit;
use crate::exit::{Classify, ExitCode};
pub use ring::{spread_ring_slots, PIECE_RING_SLOTS, SPREAD_RING_BYTES, SPREAD_RING_SLOTS};

/// Why a budget was refused (exit 2). The messages state the budget in GB, not the flag that
/// gave it: the CLI names the flag (`run --mem-gb`, `bench --budgets`, `demo --budget-share` ...).
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(
        "a budget of {budget_gb:.4} GB is below this model's minimum of {min_gb:.4} GB ({detail}); raise the budget"
    )]
    BelowMinimum { budget_gb: f64, min_gb: f64, detail: String },
    #[error("a budget of {budget_gb:.3} GB is above 95% of available memory ({available_gb:.3} GB available, limited by {limited_by}); lower the budget to {max_gb:.3} GB or less, or free memory")]
    AboveAvailable { budget_gb: f64, available_gb: f64, max_gb: f64, limited_by: String },
    #[error("unknown preset {0:?}; choose from: laptop, desktop, workstation, server, max, auto")]
    UnknownPreset(String),
    #[error("a piece of {piece_mb:.6} MB is below this model's smallest piece of {min_mb:.6} MB (a block of rows that one computation needs whole); raise it")]
    PieceTooSmall { piece_mb: f64, min_mb: f64 },
}

impl Classify for PlanError {
    fn exit_code(&self) -> ExitCode {
        match self {
            PlanError::BelowMinimum { .. }
            | PlanError::AboveAvailable { .. }
            | PlanError::UnknownPreset(_)
            | PlanError::PieceTooSmall { .. } => ExitCode::Usage,
        }
    }
}

/// Bytes in a decimal gigabyte (budgets are given in GB).
pub const GB: f64 = 1e9;

/// Shares of available memory that `--preset max` and `--preset auto` budget.
pub const PRESET_MAX_PERCENT: u64 = 95;
pub const PRESET_AUTO_PERCENT: u64 = 80;

/// Budget of a named preset, in bytes; `max` and `auto` derive from the memory available to the
/// process (`MemAvailable` or a cgroup's headroom, [`crate::memory::available`]).
pub fn preset_bytes(name: &str, mem_available: u64) -> Result<u64, PlanError> {
    let gb = |x: f64| (x * GB) as u64;
    Ok(match name {
        "laptop" => gb(12.0),
        "desktop" => gb(48.0),
        "workstation" => gb(192.0),
        "server" => gb(768.0),
        "max" => mem_available / 100 * PRESET_MAX_PERCENT,
        "auto" => mem_available / 100 * PRESET_AUTO_PERCENT,
        other => return Err(PlanError::UnknownPreset(other.to_owned())),
    })
}

/// What the planner needs to know about the model and the run.
#[derive(Clone, Debug)]
pub struct PlanInput {
    pub budget: u64,
    /// Memory available to the process; `None` skips the 95% check (tests on machines without
    /// /proc).
    pub mem_available: Option<crate::memory::Available>,
    /// Trunk units that can be pinned or streamed, with their packed sizes (the embedding is
    /// read by rows and never streamed whole).
    pub units: Vec<(PackUnit, u64)>,
    /// Bytes of one expert slot (aligned window plus slack for split experts).
    pub expert_slot_bytes: u64,
    pub experts_total: usize,
    pub top_k: usize,
    /// Extra expert slots for reads in flight ahead of compute.
    pub prefetch_window: usize,
    /// Streamed trunk units read ahead of the one computing.
    pub readahead: usize,
    /// States and KV cache of one sequence for the context.
    pub states_bytes: u64,
    /// Sequences decoded together (`k3ring batch --max-batch`); the plan gives each a slot of
    /// `states_bytes` if the budget allows, else as many as fit (at least one).
    pub sequences: usize,
    /// Scratch, logits and the embedding row buffer.
    pub scratch_bytes: u64,
    /// At most this share of what is left after the fixed parts goes to pinned trunk units
    /// (`None`: trunk first, as much as fits). `k3ring tune` sweeps it.
    pub trunk_share: Option<f64>,
    /// How units can be streamed in pieces (`None`: whole units only).
    pub pieces: Option<PieceInput>,
    /// Where units are streamed in pieces with read-ahead, hold the trunk the budget pins as
    /// pieces of every unit spread over the token (`--trunk-pins spread`), instead of whole
    /// units, largest first (see [`Plan::pinned_piece_bytes`]).
    pub spread_pins: bool,
}

/// What the planner needs to stream units in pieces (row blocks of each matrix).
#[derive(Clone, Debug)]
pub struct PieceInput {
    /// Per unit: bytes of its tensors that are not streamed matrices (norms, biases, conv
    /// weights), kept resident while the unit is split.
    pub small_bytes: Vec<(PackUnit, u64)>,
    /// Data bytes of the largest block that cannot be split (a granule of rows of the widest
    /// matrix): the smallest piece.
    pub min_piece_bytes: u64,
    /// Bytes a piece's slot needs beyond its data (its read is widened to the alignment).
    pub slack_bytes: u64,
    /// Piece size asked for (`--piece-mb`); `None`: whole units when the budget holds them,
    /// else the largest piece up to [`DEFAULT_PIECE_BYTES`] that fits.
    pub forced: Option<u64>,
}

/// Data bytes of a piece when the planner chooses: large enough that a read runs at the
/// device's sequential rate, small enough that the ring stays a small part of a small budget.
pub const DEFAULT_PIECE_BYTES: u64 = 32 << 20;

/// Expert slots below which no plan goes: one expert being computed while the next is read.
pub const MIN_EXPERT_SLOTS: usize = 2;

/// The division of the budget, printed before allocation and written into `--json`.
#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub budget_bytes: u64,
    pub pinned: Vec<String>,
    pub streamed: Vec<String>,
    pub pinned_bytes: u64,
    pub ring_slots: usize,
    pub ring_slot_bytes: u64,
    pub expert_slots: usize,
    pub expert_slot_bytes: u64,
    /// States and KV cache of all sequence slots.
    pub states_bytes: u64,
    /// Sequence slots: as many as asked for, or fewer when the budget allows no more.
    pub sequences: usize,
    /// Sequence slots asked for.
    pub sequences_asked: usize,
    /// States and KV cache of one sequence slot.
    pub sequence_bytes: u64,
    pub scratch_bytes: u64,
    /// Sum of everything above: what the run will allocate.
    pub planned_bytes: u64,
    /// Smallest budget this model and run accept.
    pub minimum_bytes: u64,
    /// Data bytes per piece of the units streamed in pieces (`None`: every streamed unit is
    /// read whole).
    pub piece_bytes: Option<u64>,
    /// Units streamed in pieces (a subset of `streamed`).
    pub split: Vec<String>,
    /// The smallest piece this model allows (`None` when units cannot be split).
    pub min_piece_bytes: Option<u64>,
    /// Resident tensors of the split units (norms, biases: everything but their matrices).
    pub small_bytes: u64,
    /// Bytes for pieces of split units held resident (`--trunk-pins spread`): every router's
    /// pieces, then pieces spread evenly over the token's use order, so the device reads the
    /// streamed rest while any layer computes. Whole pinned units leave it idle while they
    /// compute once the ring is full (docs/BENCHMARKS.md, "A device that shares the cores").
    pub pinned_piece_bytes: u64,
    /// Trunk bytes read per token (every streamed unit once).
    pub trunk_read_bytes_per_token: u64,
    /// Drafting journals counted in the scratch (0: the run does not draft).
    pub draft_journals: usize,
    /// Why default drafting is off for this budget, when it is.
    pub draft_note: Option<String>,
    #[serde(skip)]
    pub pinned_units: Vec<PackUnit>,
    #[serde(skip)]
    pub streamed_units: Vec<PackUnit>,
    #[serde(skip)]
    pub split_units: Vec<PackUnit>,
}

impl Plan {
    /// Divides the budget; refuses one below the minimum or above 95% of available memory.
    pub fn make(input: &PlanInput) -> Result<Plan, PlanError> {
        let to_gb = |b: u64| b as f64 / GB;
        if let Some(avail) = &input.mem_available {
            let max = avail.bytes / 100 * PRESET_MAX_PERCENT;
            if input.budget > max {
                return Err(PlanError::AboveAvailable {
                    budget_gb: to_gb(input.budget),
                    available_gb: to_gb(avail.bytes),
                    // Rounded down to the MB, so the budget the message names is accepted.
                    max_gb: (max / 1_000_000) as f64 / 1e3,
                    limited_by: avail.limited_by.to_string(),
                });
            }
        }
        let ring_slots = (input.readahead + 1).max(2);
        let pool_min = input.top_k + input.prefetch_window;
        let pool_min_bytes = pool_min as u64 * input.expert_slot_bytes;
        let mut units = input.units.clone();
        units.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let largest = units.first().map_or(0, |u| u.1);
        // The minimum holds one sequence; more sequences come before pinned trunk, since a
        // batch run asked for them and pinning only saves reads.
        let whole_minimum = input.states_bytes + input.scratch_bytes + pool_min_bytes + ring_slots as u64 * largest;
        let piece_ring_slots = if input.readahead == 0 { ring_slots } else { ring_slots.max(PIECE_RING_SLOTS) };
        let pieces = input.pieces.as_ref().map(|p| Pieces {
            input: p,
            units: &units,
            ring_slots: piece_ring_slots,
            align: p.slack_bytes / 2,
        });
        // A forced piece larger than every unit splits none: the same as the largest unit.
        let forced = pieces.as_ref().and_then(|p| p.input.forced.map(|f| f.min(largest.max(p.input.min_piece_bytes))));
        if let (Some(p), Some(forced)) = (&pieces, forced) {
            if forced < p.input.min_piece_bytes {
                return Err(PlanError::PieceTooSmall {
                    piece_mb: forced as f64 / 1e6,
                    min_mb: p.input.min_piece_bytes as f64 / 1e6,
                });
            }
        }
        let pieces_minimum = pieces.as_ref().map(|p| {
            let piece = forced.unwrap_or(p.input.min_piece_bytes);
            input.states_bytes + input.scratch_bytes + p.input_fixed(piece, input)
        });
        let minimum = match (pieces_minimum, forced) {
            (Some(m), Some(_)) => m,
            (Some(m), None) => m.min(whole_minimum),
            (None, _) => whole_minimum,
        };
        // Whole units are possible while the budget holds their ring, the preferred pool and
        // every sequence asked for; then the plan with fewer trunk bytes per token is taken
        // (below). A split unit's experts are not predicted unless `spread_pins` pinned its
        // router's pieces, which costs nothing measurable while the trunk streams: the device is
        // busy with it (docs/BENCHMARKS.md, "Speculation on by default": 1.00x at 6 GB). Below
        // that, pieces (sequences come before the ring's size, as before pinned trunk).
        let asked = input.sequences.max(1);
        let all_sequences = (asked as u64 - 1).saturating_mul(input.states_bytes);
        let whole = forced.is_none()
            && (pieces_minimum.is_none() || input.budget >= whole_minimum.saturating_add(all_sequences));
        let regime_minimum = match pieces_minimum {
            Some(m) if !whole => m,
            _ => whole_minimum,
        };
        if input.budget < minimum {
            let detail = refusal_detail(input, pieces.as_ref(), forced, ring_slots, pool_min, largest);
            // Rounded up, so the number printed is a budget that is accepted.
            let min_gb = (to_gb(minimum) * 1e4).ceil() / 1e4;
            return Err(PlanError::BelowMinimum { budget_gb: to_gb(input.budget), min_gb, detail });
        }
        let more = input.budget.saturating_sub(regime_minimum) / input.states_bytes.max(1);
        let sequences = asked.min(1 + usize::try_from(more).unwrap_or(usize::MAX));
        let states_bytes = sequences as u64 * input.states_bytes;
        let fixed = states_bytes + input.scratch_bytes;
        let base = Plan::empty(input, sequences, minimum);
        let whole_of =
            |base: Plan| whole_plan(input, base, &units, ring_slots, pool_min, input.budget - fixed - pool_min_bytes);
        let plan = match pieces {
            Some(p) if !whole => p.plan(input, base, forced, pool_min, input.budget - fixed),
            // Both fit: the ring of pieces is taken when what it frees of the whole-unit ring
            // pins more (fewer trunk bytes per token), so more budget never reads more. The
            // choice is made as without `spread_pins`, which then applies to pieces as asked.
            Some(p) => {
                let unspread = PlanInput { spread_pins: false, ..input.clone() };
                let in_pieces = p.plan(&unspread, base.clone(), None, pool_min, input.budget - fixed);
                let in_units = whole_of(base.clone());
                if in_pieces.trunk_read_bytes_per_token >= in_units.trunk_read_bytes_per_token {
                    in_units
                } else if input.spread_pins {
                    p.plan(input, base, None, pool_min, input.budget - fixed)
                } else {
                    in_pieces
                }
            }
            None => whole_of(base),
        };
        debug_assert!(plan.planned_bytes <= plan.budget_bytes, "{plan:?}");
        Ok(plan)
    }

    /// A plan of `sequences` sequence slots with nothing divided yet.
    fn empty(input: &PlanInput, sequences: usize, minimum: u64) -> Plan {
        Plan {
            budget_bytes: input.budget,
            pinned: Vec::new(),
            streamed: Vec::new(),
            pinned_bytes: 0,
            ring_slots: 0,
            ring_slot_bytes: 0,
            expert_slots: 0,
            expert_slot_bytes: input.expert_slot_bytes,
            states_bytes: sequences as u64 * input.states_bytes,
            sequences,
            sequences_asked: input.sequences.max(1),
            sequence_bytes: input.states_bytes,
            scratch_bytes: input.scratch_bytes,
            planned_bytes: 0,
            minimum_bytes: minimum,
            trunk_read_bytes_per_token: 0,
            draft_journals: 0,
            draft_note: None,
            piece_bytes: None,
            split: Vec::new(),
            min_piece_bytes: input.pieces.as_ref().map(|p| p.min_piece_bytes),
            small_bytes: 0,
            pinned_piece_bytes: 0,
            pinned_units: Vec::new(),
            streamed_units: Vec::new(),
            split_units: Vec::new(),
        }
    }

    /// One line per part, for the console.
    pub fn describe(&self) -> String {
        let gb = fmt_gb;
        format!(
            "plan: budget {} | trunk pinned {} units ({}), streamed {} units through {} slots of {}{} | expert pool {} slots of {} ({}) | states+KV {}{} | scratch {} | planned {} (minimum {}) | trunk read/token {}",
            gb(self.budget_bytes),
            self.pinned.len(),
            gb(self.pinned_bytes),
            self.streamed.len(),
            self.ring_slots,
            gb(self.ring_slot_bytes),
            self.describe_pieces(),
            self.expert_slots,
            gb(self.expert_slot_bytes),
            gb(self.expert_slots as u64 * self.expert_slot_bytes),
            gb(self.states_bytes),
            self.describe_sequences(),
            gb(self.scratch_bytes),
            gb(self.planned_bytes),
            gb(self.minimum_bytes),
            gb(self.trunk_read_bytes_per_token),
        ) + &self.draft_note.as_ref().map_or(String::new(), |n| format!(" | {n}"))
    }
}

impl Plan {
    fn describe_pieces(&self) -> String {
        match self.piece_bytes {
            Some(piece) if !self.split.is_empty() => format!(
                " ({} in pieces of {}, their norms and biases resident: {}{})",
                self.split.len(),
                fmt_gb(piece),
                fmt_gb(self.small_bytes),
                if self.pinned_piece_bytes > 0 {
                    format!("; pieces pinned, spread over the token: {}", fmt_gb(self.pinned_piece_bytes))
                } else {
                    String::new()
                }
            ),
            _ => String::new(),
        }
    }

    fn describe_sequences(&self) -> String {
        let gb = fmt_gb;
        match (self.sequences, self.sequences_asked) {
            (1, 1) => String::new(),
            (n, asked) if n == asked => format!(" ({n} sequences of {})", gb(self.sequence_bytes)),
            (n, asked) => {
                format!(
                    " ({n} sequences of {}: the budget holds no more of the {asked} asked for)",
                    gb(self.sequence_bytes)
                )
            }
        }
    }
}

/// Bytes in GB (10^9), the unit budgets are given in, to three significant digits: a plan line
/// then reads in the unit of `--mem-gb` ("budget 0.00138 GB", "trunk pinned 1.17 GB").
pub fn fmt_gb(bytes: u64) -> String {
    let gb = bytes as f64 / GB;
    if gb <= 0.0 {
        return "0 GB".to_owned();
    }
    let decimals = (2 - gb.log10().floor() as i32).clamp(0, 12) as usize;
    format!("{gb:.decimals$} GB")
}

/// The parts of the minimum, for the refusal of a budget below it.
fn refusal_detail(
    input: &PlanInput,
    pieces: Option<&Pieces<'_>>,
    forced: Option<u64>,
    ring_slots: usize,
    pool_min: usize,
    largest: u64,
) -> String {
    let to_gb = |b: u64| b as f64 / GB;
    match pieces {
        Some(p) => {
            let piece = forced.unwrap_or(p.input.min_piece_bytes);
            format!(
                "states and KV cache {}, scratch {}, {} trunk slots of {} (pieces of {}), resident norms and biases of the split units {}, {MIN_EXPERT_SLOTS} expert slots of {}",
                fmt_gb(input.states_bytes),
                fmt_gb(input.scratch_bytes),
                p.ring_slots,
                fmt_gb(p.slot(piece)),
                fmt_gb(piece),
                fmt_gb(p.small(p.units, piece)),
                fmt_gb(input.expert_slot_bytes)
            )
        }
        None => format!(
            "states and KV cache {:.3} GB, scratch {:.3} GB, {ring_slots} trunk slots of {:.3} GB, {pool_min} expert slots of {:.4} GB",
            to_gb(input.states_bytes),
            to_gb(input.scratch_bytes),
            to_gb(largest),
            to_gb(input.expert_slot_bytes)
        ),
    }
}

type Unit = (PackUnit, u64);

fn align_to(x: u64, align: u64) -> u64 {
    if align <= 1 {
        x
    } else {
        x.div_ceil(align).saturating_mul(align)
    }
}

/// Today's plan for a budget that holds a ring of whole units: `avail` is what is left after
/// states, scratch and the preferred expert pool.
fn whole_plan(
    input: &PlanInput,
    mut plan: Plan,
    units: &[Unit],
    ring_slots: usize,
    pool_min: usize,
    avail: u64,
) -> Plan {
    let largest = units.first().map_or(0, |u| u.1);
    // The ring is always affordable (the minimum includes it); the share caps pinning only.
    let trunk_avail = match input.trunk_share {
        Some(share) => {
            let ring = ring_slots as u64 * largest;
            (ring + ((avail - ring) as f64 * share.clamp(0.0, 1.0)) as u64).min(avail)
        }
        None => avail,
    };
    let (pinned, streamed, ring_slot_bytes) = choose_pinned(units, trunk_avail, ring_slots);
    let pinned_bytes: u64 = pinned.iter().map(|u| u.1).sum();
    let ring_bytes = if streamed.is_empty() { 0 } else { ring_slots as u64 * ring_slot_bytes };
    let spare = avail - pinned_bytes - ring_bytes;
    let extra_slots = (spare / input.expert_slot_bytes.max(1)) as usize;
    plan.expert_slots = (pool_min + extra_slots).min(input.experts_total.max(pool_min));
    plan.ring_slots = if streamed.is_empty() { 0 } else { ring_slots };
    plan.ring_slot_bytes = ring_slot_bytes;
    plan.planned_bytes = plan.states_bytes
        + plan.scratch_bytes
        + pinned_bytes
        + ring_bytes
        + plan.expert_slots as u64 * input.expert_slot_bytes;
    plan.pinned = pinned.iter().map(|u| u.0.name()).collect();
    plan.streamed = streamed.iter().map(|u| u.0.name()).collect();
    plan.pinned_bytes = pinned_bytes;
    plan.trunk_read_bytes_per_token = streamed.iter().map(|u| u.1).sum();
    plan.pinned_units = pinned.iter().map(|u| u.0).collect();
    plan.streamed_units = streamed.iter().map(|u| u.0).collect();
    plan
}

/// The plan with a ring of pieces: the largest units that fit are pinned, the others streamed,
/// those larger than a piece in row blocks through a ring of piece-sized slots, with their
/// small tensors resident.
struct Pieces<'a> {
    input: &'a PieceInput,
    /// Largest first.
    units: &'a [Unit],
    ring_slots: usize,
    /// The arena aligns each region to this: the plan counts what the store allocates.
    align: u64,
}

impl Pieces<'_> {
    /// A ring slot for pieces of `piece` bytes (units no larger go whole and fit it too).
    fn slot(&self, piece: u64) -> u64 {
        align_to(piece.saturating_add(self.input.slack_bytes), self.align)
    }

    fn is_split(&self, unit: &Unit, piece: u64) -> bool {
        unit.1 > piece
    }

    /// Resident small tensors of those of `units` split at `piece`.
    fn small(&self, units: &[Unit], piece: u64) -> u64 {
        let small_of = |u: PackUnit| self.input.small_bytes.iter().find(|s| s.0 == u).map_or(0, |s| s.1);
        let small: u64 = units.iter().filter(|u| self.is_split(u, piece)).map(|u| small_of(u.0)).sum();
        align_to(small, self.align)
    }

    /// Everything but states and scratch at `piece`, with the smallest expert pool.
    fn input_fixed(&self, piece: u64, input: &PlanInput) -> u64 {
        self.small(self.units, piece)
            + self.ring_slots as u64 * self.slot(piece)
            + MIN_EXPERT_SLOTS as u64 * input.expert_slot_bytes
    }

    /// The units pinned and streamed with pieces of `piece`: the largest first, each that fits
    /// in what the ring, the small tensors of every unit and the preferred pool leave of
    /// `avail`. Pinning a split unit frees its small tensors too; they are not counted back,
    /// since the arena aligns their sum: the plan stays within `avail`.
    fn pin(&self, input: &PlanInput, piece: u64, pool_min: usize, avail: u64) -> (Vec<Unit>, Vec<Unit>) {
        let ring = self.ring_slots as u64 * self.slot(piece);
        let pool = pool_min.max(MIN_EXPERT_SLOTS) as u64 * input.expert_slot_bytes;
        let room = avail.saturating_sub(ring + self.small(self.units, piece) + pool);
        let mut left = match input.trunk_share {
            Some(share) => (room as f64 * share.clamp(0.0, 1.0)) as u64,
            None => room,
        };
        let (mut pinned, mut streamed) = (Vec::new(), Vec::new());
        for u in self.units {
            if u.1 <= left {
                left -= u.1;
                pinned.push(*u);
            } else {
                streamed.push(*u);
            }
        }
        (pinned, streamed)
    }

    /// Divides `avail` (the budget less states and scratch). When the preferred pool
    /// (`pool_min` slots) fits beside the ring, the largest units that fit are pinned (as much
    /// as `trunk_share` allows); the piece is the largest (from the default, halving, never below
    /// the smallest) that fits beside the smallest pool and pins as much as the smallest piece
    /// would, so more budget never reads more; the rest goes to expert slots.
    fn plan(&self, input: &PlanInput, mut plan: Plan, forced: Option<u64>, pool_min: usize, avail: u64) -> Plan {
        let min = self.input.min_piece_bytes;
        let pinned_at = |piece: u64| self.pin(input, piece, pool_min, avail).0.iter().map(|u| u.1).sum::<u64>();
        let piece = forced.unwrap_or_else(|| {
            let most = pinned_at(min);
            let mut piece = DEFAULT_PIECE_BYTES.max(min);
            while piece > min && (self.input_fixed(piece, input) > avail || pinned_at(piece) < most) {
                piece = (piece / 2).max(min);
            }
            piece
        });
        let (mut pinned, mut streamed) = self.pin(input, piece, pool_min, avail);
        let spread_ring;
        (plan.pinned_piece_bytes, spread_ring) = self.spread(input, piece, pool_min, avail, &mut pinned, &mut streamed);
        pinned.sort_by_key(|u| u.0);
        streamed.sort_by_key(|u| u.0);
        let pinned_bytes: u64 = pinned.iter().map(|u| u.1).sum();
        plan.ring_slots = if streamed.is_empty() { 0 } else { self.ring_slots + spread_ring };
        plan.ring_slot_bytes = if streamed.is_empty() { 0 } else { self.slot(piece) };
        plan.piece_bytes = (!streamed.is_empty()).then_some(piece);
        plan.small_bytes = self.small(&streamed, piece);
        let used =
            pinned_bytes + plan.pinned_piece_bytes + plan.small_bytes + plan.ring_slots as u64 * plan.ring_slot_bytes;
        let slots = (avail.saturating_sub(used) / input.expert_slot_bytes.max(1)) as usize;
        plan.expert_slots = slots.max(MIN_EXPERT_SLOTS).min(input.experts_total.max(MIN_EXPERT_SLOTS));
        let read_ahead = self.read_ahead_slots(input, &plan, &streamed, piece, pool_min);
        plan.expert_slots -=
            usize::try_from((read_ahead as u64 * plan.ring_slot_bytes).div_ceil(input.expert_slot_bytes.max(1)))
                .unwrap_or(0);
        plan.ring_slots += read_ahead;
        let used = used + read_ahead as u64 * plan.ring_slot_bytes;
        plan.planned_bytes =
            plan.states_bytes + plan.scratch_bytes + used + plan.expert_slots as u64 * input.expert_slot_bytes;
        plan.pinned = pinned.iter().map(|u| u.0.name()).collect();
        plan.pinned_bytes = pinned_bytes;
        plan.pinned_units = pinned.iter().map(|u| u.0).collect();
        plan.streamed = streamed.iter().map(|u| u.0.name()).collect();
        plan.split = streamed.iter().filter(|u| self.is_split(u, piece)).map(|u| u.0.name()).collect();
        plan.split_units = streamed.iter().filter(|u| self.is_split(u, piece)).map(|u| u.0).collect();
        plan.trunk_read_bytes_per_token =
            streamed.iter().map(|u| u.1).sum::<u64>().saturating_sub(plan.pinned_piece_bytes);
        plan.streamed_units = streamed.iter().map(|u| u.0).collect();
        plan
    }

    /// With [`PlanInput::spread_pins`] (and read-ahead on, no `trunk_share`, something
    /// streamed): every unit larger than a piece is split, and the room `pin` gave whole units
    /// (what the ring, the small tensors and the preferred pool leave of `avail`, less the
    /// whole units no larger than a piece, which stay pinned) becomes the bytes of pinned
    /// pieces, rounded down to the arena's alignment, less the ring slots that bring the ring
    /// to [`spread_ring_slots`] (or to the pieces left to stream, if fewer). Returns those
    /// bytes and slots; `(0, 0)` leaves the choice of
    /// `pin` as it was, as does a room that would hold every split unit whole. A ring that takes
    /// the whole room (up to a quarter of the budget where pieces are small) also gives `(0, 0)`:
    /// just above such a budget spread pins pin little and read up to that ring's bytes more
    /// than the whole-unit plan just below. Accepted: that needs a budget under 4/3 of what it
    /// holds besides pinned pieces, near the minimum, where nearly all the trunk streams anyway.
    fn spread(
        &self,
        input: &PlanInput,
        piece: u64,
        pool_min: usize,
        avail: u64,
        pinned: &mut Vec<Unit>,
        streamed: &mut Vec<Unit>,
    ) -> (u64, usize) {
        if !input.spread_pins || input.readahead == 0 || input.trunk_share.is_some() || streamed.is_empty() {
            return (0, 0);
        }
        let ring = self.ring_slots as u64 * self.slot(piece);
        let pool = pool_min.max(MIN_EXPERT_SLOTS) as u64 * input.expert_slot_bytes;
        let room = avail.saturating_sub(ring + self.small(self.units, piece) + pool);
        let (whole, big): (Vec<Unit>, Vec<Unit>) =
            pinned.iter().chain(streamed.iter()).partition(|u| !self.is_split(u, piece));
        let kept: Vec<Unit> = pinned.iter().filter(|u| !self.is_split(u, piece)).copied().collect();
        let whole_bytes: u64 = kept.iter().map(|u| u.1).sum();
        let big_bytes: u64 = big.iter().map(|u| u.1).sum();
        // No more ring than the pieces left to stream would fill.
        let left_to_stream = big_bytes.saturating_sub(room.saturating_sub(whole_bytes)).div_ceil(piece.max(1));
        let ring_more = spread_ring_slots(self.slot(piece), input.budget)
            .min(usize::try_from(left_to_stream).unwrap_or(usize::MAX))
            .saturating_sub(self.ring_slots);
        let room = room.saturating_sub(whole_bytes + ring_more as u64 * self.slot(piece));
        let allowance = room / self.align.max(1) * self.align.max(1);
        if allowance == 0 || allowance >= big_bytes {
            return (0, 0);
        }
        *streamed = whole.into_iter().filter(|u| !kept.contains(u)).chain(big).collect();
        *pinned = kept;
        (allowance, ring_more)
    }
}

impl Pieces<'_> {
    /// Ring slots added beyond the base ring, paid for by expert slots beyond the preferred
    /// pool (`pool_min`). With trunk first (no `trunk_share`) those spare slots are less than
    /// one streamed unit, so as a cache they hold a few percent of a token's experts (hits
    /// 3-12% on the 6-layer synth at 6 GB, even with routing locality 0.75); as ring they let
    /// the device read the next streamed pieces while the pinned layers compute, where it
    /// otherwise idles (docs/BENCHMARKS.md, "Read-ahead from the spare pool"). At most as many
    /// as a token's streamed items, beyond which the ring would wrap onto itself. Nothing
    /// without read-ahead (`--serial`), without split units, or when `tune` sets the split.
    fn read_ahead_slots(
        &self,
        input: &PlanInput,
        plan: &Plan,
        streamed: &[Unit],
        piece: u64,
        pool_min: usize,
    ) -> usize {
        // The store reads ahead with every ring slot only when some unit is split.
        let split = streamed.iter().any(|u| self.is_split(u, piece));
        if input.trunk_share.is_some() || input.readahead == 0 || !split || plan.ring_slot_bytes == 0 {
            return 0;
        }
        let items: u64 = streamed
            .iter()
            .map(|u| if self.is_split(u, piece) { u.1.div_ceil(piece) } else { 1 })
            .sum::<u64>()
            .saturating_sub(plan.pinned_piece_bytes / piece.max(1));
        let spare = plan.expert_slots.saturating_sub(pool_min.max(MIN_EXPERT_SLOTS)) as u64 * input.expert_slot_bytes;
        let affordable = spare / plan.ring_slot_bytes;
        let useful = items.saturating_sub(plan.ring_slots as u64);
        usize::try_from(affordable.min(useful)).unwrap_or(0)
    }
}

/// Pins the largest units that fit together with the ring the rest need; returns (pinned,
/// streamed, ring slot size). `units` is sorted by size, largest first.
fn choose_pinned(units: &[Unit], avail: u64, ring_slots: usize) -> (Vec<Unit>, Vec<Unit>, u64) {
    let n = units.len();
    // Pin the k largest; the ring must then hold the largest streamed unit, units[k].
    let mut prefix = vec![0u64; n + 1];
    for i in 0..n {
        prefix[i + 1] = prefix[i] + units[i].1;
    }
    let fits = |k: usize| {
        let ring = if k < n { ring_slots as u64 * units[k].1 } else { 0 };
        prefix[k] + ring <= avail
    };
    let k = (0..=n).rev().find(|&k| fits(k)).unwrap_or(0);
    let ring_slot = if k < n { units[k].1 } else { 0 };
    let mut budget_left = avail - prefix[k] - if k < n { ring_slots as u64 * ring_slot } else { 0 };
    let mut pinned: Vec<Unit> = units[..k].to_vec();
    let mut streamed = Vec::new();
    // Fill what is left with smaller units (the ring keeps its size: units[k] stays streamed).
    for (i, u) in units[k..].iter().enumerate() {
        if i > 0 && u.1 <= budget_left {
            budget_left -= u.1;
            pinned.push(*u);
        } else {
            streamed.push(*u);
        }
    }
    pinned.sort_by_key(|u| u.0);
    streamed.sort_by_key(|u| u.0);
    (pinned, streamed, ring_slot)
}

#[cfg(test)]
pub(crate) mod tests;
