//! The planner's tests: budgets, sequences, pieces, presets.
#![allow(clippy::unwrap_used)]
use super::*;
use crate::memory::{Available, CgroupLimit};

#[test]
fn plan_sizes_print_in_gb_to_three_significant_digits() {
    assert_eq!(fmt_gb(1_380_000), "0.00138 GB");
    assert_eq!(fmt_gb(1_170_000_000), "1.17 GB");
    assert_eq!(fmt_gb(123_400_000_000), "123 GB");
    assert_eq!(fmt_gb(0), "0 GB");
}

/// A model of ten layer units and a head, for planner tests (also the drafting plan's).
pub(crate) fn input(budget: u64) -> PlanInput {
    PlanInput {
        budget,
        mem_available: None,
        units: (0..10).map(|l| (PackUnit::Layer(l), 100 + l as u64)).chain([(PackUnit::Head, 300)]).collect(),
        expert_slot_bytes: 10,
        experts_total: 1000,
        top_k: 4,
        prefetch_window: 4,
        readahead: 1,
        states_bytes: 50,
        sequences: 1,
        scratch_bytes: 50,
        trunk_share: None,
        pieces: None,
        spread_pins: false,
    }
}

#[test]
fn sequences_get_slots_before_pinned_trunk_and_fewer_when_the_budget_is_short() {
    let min = 100 + 80 + 2 * 300;
    let asked = |budget: u64, n: usize| Plan::make(&PlanInput { sequences: n, ..input(budget) }).unwrap();
    // The minimum holds one sequence, whatever was asked.
    let p = asked(min, 16);
    assert_eq!((p.sequences, p.sequences_asked, p.states_bytes), (1, 16, 50));
    assert!(p.describe().contains("1 sequences of"), "{}", p.describe());
    // Each further 50 bytes buy one more slot, before more trunk is pinned than the minimum's.
    let p = asked(min + 2 * 50, 16);
    assert_eq!((p.sequences, p.states_bytes), (3, 150));
    assert_eq!(p.pinned_bytes, asked(min, 16).pinned_bytes);
    assert!(asked(min + 2 * 50, 1).pinned_bytes > p.pinned_bytes);
    assert_eq!(asked(min + 2 * 50 + 49, 16).sequences, 3, "49 bytes buy no fourth slot");
    assert!(p.planned_bytes <= p.budget_bytes);
    // Enough for all: the rest goes to the trunk as before.
    let p = asked(min + 15 * 50 + 500, 16);
    assert_eq!(p.sequences, 16);
    assert!(p.pinned_bytes > 0);
    assert!(p.planned_bytes <= p.budget_bytes);
    let one = asked(min + 15 * 50 + 500, 1);
    assert!(one.pinned_bytes > p.pinned_bytes, "unused slots go to the trunk");
}

#[test]
fn below_minimum_is_refused_with_the_minimum() {
    let min = 100 + 80 + 2 * 300;
    assert!(Plan::make(&input(min)).is_ok());
    let err = Plan::make(&input(min - 1)).unwrap_err().to_string();
    assert!(err.contains("below this model's minimum"), "{err}");
}

#[test]
fn trunk_first_then_experts() {
    let p = Plan::make(&input(100 + 80 + 300 + 1045 + 2000)).unwrap();
    assert!(p.streamed.is_empty(), "{p:?}");
    assert_eq!(p.ring_slots, 0);
    assert_eq!(p.expert_slots, 8 + 200);
    // 900 left after states, scratch and the minimum pool: the head (300) and the three
    // largest layers (324) fit beside a ring of two slots for the next largest (2 x 106).
    let p = Plan::make(&input(100 + 80 + 2 * 300 + 300)).unwrap();
    assert_eq!(p.pinned, ["head", "layer.7", "layer.8", "layer.9"], "largest units are pinned first");
    assert_eq!(p.ring_slot_bytes, 106);
    assert_eq!(p.trunk_read_bytes_per_token, (100..107).sum::<u64>());
}

#[test]
fn more_budget_never_reads_more() {
    let mut last = u64::MAX;
    for extra in (0..3000).step_by(37) {
        let p = Plan::make(&input(780 + extra)).unwrap();
        assert!(p.trunk_read_bytes_per_token <= last, "budget +{extra} reads more");
        assert!(p.planned_bytes <= p.budget_bytes);
        last = p.trunk_read_bytes_per_token;
    }
    assert_eq!(last, 0);
}

#[test]
fn trunk_share_moves_bytes_from_trunk_to_experts() {
    let budget = 100 + 80 + 300 + 1045 + 2000;
    let all = Plan::make(&input(budget)).unwrap();
    let mut half = input(budget);
    half.trunk_share = Some(0.1);
    let half = Plan::make(&half).unwrap();
    assert!(half.pinned_bytes < all.pinned_bytes);
    assert!(half.expert_slots > all.expert_slots);
    let mut none = input(budget);
    none.trunk_share = Some(0.0);
    let none = Plan::make(&none).unwrap();
    assert!(none.pinned_bytes <= half.pinned_bytes && none.expert_slots >= half.expert_slots);
}

/// `tune`'s trunk share caps pinning beside a ring of pieces too (a budget below the whole-unit
/// ring, so pieces are planned at every share).
#[test]
fn trunk_share_moves_bytes_from_trunk_to_experts_with_pieces() {
    let at = |share: Option<f64>| {
        Plan::make(&PlanInput { pieces: Some(pieces(None)), trunk_share: share, ..input(700) }).unwrap()
    };
    let all = at(None);
    assert!(all.piece_bytes.is_some() && all.pinned_bytes > 0, "{all:?}");
    assert_eq!(at(Some(1.0)).pinned_bytes, all.pinned_bytes);
    let half = at(Some(0.5));
    assert!(half.pinned_bytes < all.pinned_bytes && half.expert_slots > all.expert_slots, "{half:?}");
    let none = at(Some(0.0));
    assert_eq!(none.pinned_bytes, 0, "{none:?}");
    // Nothing to pin: the budget buys larger pieces first (as at the smallest budget).
    assert!(none.piece_bytes > half.piece_bytes && none.planned_bytes <= 700, "{none:?}");
}

fn pieces(forced: Option<u64>) -> PieceInput {
    PieceInput {
        small_bytes: (0..10).map(|l| (PackUnit::Layer(l), 3)).chain([(PackUnit::Head, 2)]).collect(),
        min_piece_bytes: 20,
        slack_bytes: 4,
        forced,
    }
}

#[test]
fn pieces_lower_the_minimum_to_two_pieces_the_small_tensors_and_two_expert_slots() {
    let whole_min = 100 + 80 + 2 * 300;
    let with =
        |budget: u64, forced: Option<u64>| Plan::make(&PlanInput { pieces: Some(pieces(forced)), ..input(budget) });
    // states 50 + scratch 50 + small tensors of all 11 units (10 x 3 + 2) + 4 slots of
    // (20 + 4) + 2 expert slots of 10.
    let min = 100 + 32 + 4 * 24 + 2 * 10;
    let p = with(min, None).unwrap();
    assert_eq!(p.minimum_bytes, min);
    assert_eq!((p.piece_bytes, p.ring_slots, p.ring_slot_bytes, p.expert_slots), (Some(20), 4, 24, 2));
    // Without read-ahead (serial mode) two slots do.
    let serial = Plan::make(&PlanInput { pieces: Some(pieces(None)), readahead: 0, ..input(min) }).unwrap();
    assert_eq!((serial.ring_slots, serial.minimum_bytes), (2, min - 2 * 24));
    assert_eq!(p.split.len(), 11, "every unit is larger than a piece: {p:?}");
    assert!(p.pinned.is_empty());
    assert_eq!(p.planned_bytes, min);
    assert!(p.describe().contains("11 in pieces of"), "{}", p.describe());
    let err = with(min - 1, None).unwrap_err().to_string();
    assert!(err.contains("below this model's minimum") && err.contains("pieces of"), "{err}");
    // More budget: larger pieces first (up to the default), then expert slots.
    let p = with(min + 100, None).unwrap();
    assert!(p.piece_bytes.unwrap() > 20 && p.planned_bytes <= p.budget_bytes, "{p:?}");
    // A budget that holds whole units: a ring of pieces frees most of the whole-unit ring,
    // which pins more trunk, so pieces are planned; the preferred pool floor holds.
    let p = with(whole_min, None).unwrap();
    let units_only = Plan::make(&input(whole_min)).unwrap();
    assert_eq!((p.piece_bytes, p.minimum_bytes), (Some(32), min), "{p:?}");
    assert!(p.pinned_bytes > units_only.pinned_bytes, "{p:?}\n{units_only:?}");
    assert!(p.trunk_read_bytes_per_token < units_only.trunk_read_bytes_per_token);
    assert!(p.expert_slots >= 8, "the preferred pool floor holds: {p:?}");
    assert!(p.planned_bytes <= p.budget_bytes);
    // Only the split units' small tensors are resident, not the pinned ones'.
    assert_eq!(p.small_bytes, (3 * p.split.len() as u64).div_ceil(2) * 2, "aligned to 2: {p:?}");
    // A budget that pins every unit either way plans whole units (no ring at all).
    let p = with(5000, None).unwrap();
    assert_eq!((p.piece_bytes, p.ring_slots, p.trunk_read_bytes_per_token), (None, 0, 0), "{p:?}");
}

/// Batching (issue 18): with whole units, 16 sequences' states leave room for the ring of the
/// largest unit only beside 3 sequences; a ring of pieces holds all 16 and keeps that unit
/// pinned, reading no more trunk per step than one sequence did with whole units.
#[test]
fn a_ring_of_pieces_keeps_the_largest_unit_pinned_beside_many_sequences() {
    let input = |sequences: usize, pieces: Option<PieceInput>| PlanInput {
        units: [(PackUnit::Layer(0), 1000)]
            .into_iter()
            .chain((1..5).map(|l| (PackUnit::Layer(l), 400)))
            .chain([(PackUnit::Head, 50)])
            .collect(),
        states_bytes: 20,
        sequences,
        pieces,
        ..self::input(2200)
    };
    let one_whole = Plan::make(&input(1, None)).unwrap();
    assert_eq!(one_whole.pinned, ["head", "layer.0"], "{one_whole:?}");
    assert_eq!(one_whole.ring_slot_bytes, 400);
    let batch_whole = Plan::make(&input(16, None)).unwrap();
    assert_eq!(batch_whole.sequences, 3, "the whole-unit ring leaves room for 3: {batch_whole:?}");
    let batch = Plan::make(&input(16, Some(pieces(None)))).unwrap();
    assert_eq!(batch.sequences, 16);
    assert!(batch.pinned.contains(&"layer.0".to_owned()), "{batch:?}");
    assert!(batch.trunk_read_bytes_per_token <= one_whole.trunk_read_bytes_per_token, "{batch:?}");
    assert!(batch.expert_slots >= 8 && batch.planned_bytes <= batch.budget_bytes, "{batch:?}");
}

#[test]
fn a_forced_piece_splits_whatever_is_larger_and_is_refused_below_the_smallest() {
    let with =
        |budget: u64, forced: Option<u64>| Plan::make(&PlanInput { pieces: Some(pieces(forced)), ..input(budget) });
    // Nothing pinned (trunk share 0), so every unit streams.
    let p = Plan::make(&PlanInput { pieces: Some(pieces(Some(105))), trunk_share: Some(0.0), ..input(5000) }).unwrap();
    assert_eq!(p.piece_bytes, Some(105));
    // Layers 0..5 (100..105 bytes) fit a piece whole; layers 6..9 and the head are split.
    assert_eq!(p.split, ["head", "layer.6", "layer.7", "layer.8", "layer.9"]);
    assert_eq!(p.small_bytes, 4 * 3 + 2);
    // Slots of 105 + 4 bytes, aligned to 2 as the arena aligns its regions.
    assert_eq!(p.minimum_bytes, 100 + p.small_bytes + 4 * 110 + 2 * 10);
    let err = with(5000, Some(19)).unwrap_err();
    assert!(matches!(err, PlanError::PieceTooSmall { .. }), "{err}");
}

/// A batch asks for more sequences than the whole-unit plan holds: the extra sequences are
/// counted against the regime that is planned, never more than the budget.
#[test]
fn sequences_with_pieces_never_plan_more_than_the_budget() {
    let with = |budget: u64, n: usize| {
        Plan::make(&PlanInput { pieces: Some(pieces(None)), sequences: n, ..input(budget) }).unwrap()
    };
    // 780 holds the whole-unit ring and one sequence; 16 sequences need 15 x 50 more.
    let p = with(780, 16);
    assert!(p.piece_bytes.is_some(), "pieces make room for more sequences: {p:?}");
    assert!(p.sequences > 1 && p.planned_bytes <= 780, "{p:?}");
    let p = with(780 + 15 * 50, 16);
    let units_only = Plan::make(&PlanInput { sequences: 16, ..input(780 + 15 * 50) }).unwrap();
    assert_eq!((units_only.piece_bytes, units_only.sequences), (None, 16), "{units_only:?}");
    assert_eq!(p.sequences, 16, "{p:?}");
    assert!(p.trunk_read_bytes_per_token <= units_only.trunk_read_bytes_per_token, "{p:?}");
    assert!(p.planned_bytes <= p.budget_bytes);
    for budget in (248..3000).step_by(7) {
        for n in [1, 3, 16] {
            let Ok(p) = Plan::make(&PlanInput { pieces: Some(pieces(None)), sequences: n, ..input(budget) }) else {
                continue;
            };
            assert!(p.planned_bytes <= budget, "budget {budget}, {n} sequences: {p:?}");
        }
    }
}

/// A forced piece larger than every unit splits none, and huge values do not overflow.
#[test]
fn a_forced_piece_is_capped_at_the_largest_unit() {
    for forced in [300, 10_000, u64::MAX] {
        let p = Plan::make(&PlanInput { pieces: Some(pieces(Some(forced))), trunk_share: Some(0.0), ..input(5000) })
            .unwrap();
        assert_eq!(p.piece_bytes, Some(300), "{p:?}");
        assert!(p.split.is_empty() && p.planned_bytes <= 5000);
    }
}

#[test]
fn more_budget_never_reads_more_with_pieces() {
    for sequences in [1, 16] {
        let mut last = u64::MAX;
        for budget in (200..3000).step_by(13) {
            let Ok(p) = Plan::make(&PlanInput { pieces: Some(pieces(None)), sequences, ..input(budget) }) else {
                continue;
            };
            assert!(p.trunk_read_bytes_per_token <= last, "budget {budget}, {sequences} sequences reads more");
            assert!(p.planned_bytes <= p.budget_bytes, "{p:?}");
            last = p.trunk_read_bytes_per_token;
        }
    }
}

fn available(bytes: u64) -> Option<Available> {
    let limit = CgroupLimit { version: 2, limit_file: "/cg/memory.max".into(), limit: bytes + 5, usage: 5 };
    crate::memory::combine(Some(u64::MAX), &[limit])
}

#[test]
fn above_available_is_refused_naming_the_limit() {
    let mut i = input(10_000);
    i.mem_available = available(10_000);
    let err = Plan::make(&i).unwrap_err();
    assert!(matches!(err, PlanError::AboveAvailable { .. }));
    assert!(err.to_string().contains("limited by the cgroup v2 limit /cg/memory.max"), "{err}");
}

#[test]
fn above_available_names_a_budget_it_accepts() {
    for bytes in [3_456_789_012u64, 1_000_000_000, 999_999_999, 123_456_789] {
        let mut i = input(bytes);
        i.mem_available = available(bytes);
        let err = Plan::make(&i).unwrap_err();
        let text = err.to_string();
        let named = text.split("lower the budget to ").nth(1).and_then(|t| t.split(' ').next()).unwrap();
        let named: f64 = named.parse().unwrap();
        i.budget = (named * GB) as u64;
        assert!(Plan::make(&i).is_ok(), "{bytes} available: the named {named} GB is refused");
        // Not far below what is accepted: a megabyte above it is refused.
        i.budget = ((named + 0.001) * GB) as u64 + 1;
        assert!(matches!(Plan::make(&i), Err(PlanError::AboveAvailable { .. })), "{bytes}: {named} + 1 MB");
    }
}

/// `--preset max` is 95% of one reading of available memory, and the check compares against
/// the same reading, so it never refuses its own preset (it did when memory was read twice).
#[test]
fn presets_pass_their_own_check() {
    for bytes in [1_000_000u64, 1_000_099, 3_999_999_999, 123_456_789_012, 7 << 40] {
        for preset in ["max", "auto"] {
            let mut i = input(preset_bytes(preset, bytes).unwrap());
            i.mem_available = available(bytes);
            assert!(Plan::make(&i).is_ok(), "--preset {preset} at {bytes} bytes available refused");
        }
    }
}

/// Read-ahead from the spare pool: with trunk first, expert slots beyond the preferred pool
/// (top-k + window = 8 here) become ring slots, no more than a token's streamed pieces, and
/// never with `--serial` or a split set by `tune`.
#[test]
fn spare_expert_slots_become_read_ahead_ring_slots() {
    let with = |budget: u64, readahead: usize, trunk_share: Option<f64>| {
        Plan::make(&PlanInput { pieces: Some(pieces(None)), readahead, trunk_share, ..input(budget) }).unwrap()
    };
    // 700 holds pieces of 32 with the head and a few layers pinned, and more than 8 expert slots.
    let p = with(700, 1, None);
    assert_eq!(p.piece_bytes, Some(32), "{p:?}");
    assert!(p.expert_slots >= 8 && p.expert_slots < 8 + 4, "the spare slots went to the ring: {p:?}");
    assert!(p.ring_slots > PIECE_RING_SLOTS, "{p:?}");
    assert!(p.planned_bytes <= p.budget_bytes, "{p:?}");
    // What the ring gained came from the pool: the same trunk pinned as with the whole share
    // set by hand (which keeps the pool), and no more planned.
    let kept = with(700, 1, Some(1.0));
    assert_eq!((kept.ring_slots, kept.pinned_bytes), (PIECE_RING_SLOTS, p.pinned_bytes), "{kept:?}");
    let gained = (p.ring_slots - kept.ring_slots) as u64 * p.ring_slot_bytes;
    assert!(gained > 0 && gained <= (kept.expert_slots - p.expert_slots) as u64 * 10, "{p:?}\n{kept:?}");
    assert_eq!(with(700, 0, None).ring_slots, 2, "no read-ahead, no ring beyond two slots");
    // No more ring slots than a token's streamed pieces (each split unit of 100-109 bytes is
    // 4 pieces of 32).
    let streamed: u64 = p.split.len() as u64 * 4;
    assert!(p.ring_slots as u64 <= streamed, "{p:?}");
    let big = with(1500, 1, None);
    if !big.split.is_empty() {
        assert!(big.ring_slots as u64 <= big.split.len() as u64 * 4 + 1, "{big:?}");
    }
    // A split chosen by `tune` keeps its pool.
    let shared = with(700, 1, Some(0.5));
    assert_eq!(shared.ring_slots, PIECE_RING_SLOTS, "{shared:?}");
    assert!(shared.expert_slots > 8, "{shared:?}");
}

/// `--trunk-pins spread`: the room whole units took holds pieces of every unit instead (all
/// split, none pinned whole), less what brings the ring to [`SPREAD_RING_SLOTS`]; whole units
/// again without read-ahead, with a share set by `tune`, or at a budget that pins everything.
#[test]
fn spread_pins_hold_the_pinned_trunk_as_pieces_of_every_unit() {
    let with = |budget: u64, readahead: usize, trunk_share: Option<f64>, spread_pins: bool| {
        let input = PlanInput { pieces: Some(pieces(None)), readahead, trunk_share, spread_pins, ..input(budget) };
        Plan::make(&input).unwrap()
    };
    let units = with(700, 1, None, false);
    let spread = with(700, 1, None, true);
    assert!(!units.pinned.is_empty() && units.pinned_piece_bytes == 0, "{units:?}");
    assert!(spread.pinned.is_empty() && spread.split.len() == 11, "{spread:?}");
    assert_eq!((spread.piece_bytes, spread.ring_slots), (Some(32), SPREAD_RING_SLOTS), "{spread:?}");
    // Of 700 (below the whole units' minimum, 780): states and scratch 100, small tensors 32,
    // 8 expert slots of 10 and 12 ring slots of 36 (32 + 4 slack) leave 56 (a multiple of the
    // arena's alignment, 2).
    assert_eq!(spread.pinned_piece_bytes, 56, "{spread:?}");
    assert_eq!(spread.expert_slots, 8, "{spread:?}");
    assert_eq!(spread.planned_bytes, 700, "{spread:?}");
    let trunk: u64 = (0..10).map(|l| 100 + l).sum::<u64>() + 300;
    assert_eq!(spread.trunk_read_bytes_per_token, trunk - 56);
    // What spread gives up: the 8 ring slots beyond the whole units' 4, less what those left
    // unpinned (a whole unit does not fit every byte) and gave the ring from the pool.
    let ring_cost = (SPREAD_RING_SLOTS - PIECE_RING_SLOTS) as u64 * 36;
    assert!(spread.trunk_read_bytes_per_token <= units.trunk_read_bytes_per_token + ring_cost, "{units:?}");
    assert!(spread.describe().contains("pieces pinned, spread over the token: "), "{}", spread.describe());
    for (what, p) in [
        ("serial", with(700, 0, None, true)),
        ("a share", with(700, 1, Some(1.0), true)),
        ("everything pinned", with(5000, 1, None, true)),
    ] {
        assert_eq!(p.pinned_piece_bytes, 0, "{what}: {p:?}");
        assert!(!p.describe().contains("spread"), "{what}");
    }
    assert_eq!(with(5000, 1, None, true).trunk_read_bytes_per_token, 0);
    // The smallest budget has no room to pin: the same plan either way.
    let min = units.minimum_bytes;
    let (a, b) = (with(min, 1, None, false), with(min, 1, None, true));
    assert_eq!(
        (a.pinned_piece_bytes, a.ring_slots, a.expert_slots),
        (b.pinned_piece_bytes, b.ring_slots, b.expert_slots)
    );
}

/// The spread ring holds [`SPREAD_RING_BYTES`] (12 default pieces, 384 MiB) where its slots are
/// small, within a quarter of the budget, and never fewer than [`SPREAD_RING_SLOTS`] slots.
#[test]
fn the_spread_ring_holds_its_bytes_where_pieces_are_small() {
    let mib = 1u64 << 20;
    assert_eq!(SPREAD_RING_BYTES, 384 * mib);
    assert_eq!(spread_ring_slots(4 * mib, 2048 * mib), 96, "384 MiB of 4 MiB slots");
    assert_eq!(spread_ring_slots(34 * mib, 6144 * mib), SPREAD_RING_SLOTS, "large slots: the slot count");
    assert_eq!(spread_ring_slots(32 * mib, 6144 * mib), SPREAD_RING_SLOTS, "default pieces: the slot count");
    assert_eq!(spread_ring_slots(2 * mib, 800 * mib), 100, "a quarter of 800 MiB in 2 MiB slots");
    assert_eq!(spread_ring_slots(4 * mib, 160 * mib), SPREAD_RING_SLOTS, "a small budget: the slot count");
    assert_eq!(spread_ring_slots(0, 1536 * mib), 384 << 20, "no slot size: one byte a slot");
}
