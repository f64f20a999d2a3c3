//! `--trunk-pins spread` (docs/STORAGE.md): which pieces are pinned, and what a prediction's view
//! of a split unit serves.

use std::path::Path;

use super::expert_checks::tests::tiny_copy;
use super::pieces::choose_pins;
use crate::engine::{open_streaming, Opened, StreamingRun};
use crate::model::weights::{FfnWeights, TrunkUnit, TrunkView};
use crate::pipeline::Pipeline;
use crate::storage::plan::{Plan, SPREAD_RING_SLOTS};

#[test]
fn routers_are_pinned_first_and_whole_then_the_rest_evenly_within_the_allowance() {
    // Two routers of two 10-byte pieces, then 20 pieces of 10 bytes. 70 bytes: both routers
    // (40), then 30 of the 200 left, a share of 0.15.
    let routers = vec![vec![(100, 10), (101, 10)], vec![(200, 10), (201, 10)]];
    let rest: Vec<(usize, u64)> = (0..20).map(|i| (i, 10)).collect();
    let (pinned, held) = choose_pins(&routers, &rest, 70);
    assert_eq!(held, [true, true]);
    let items: Vec<usize> = pinned.iter().map(|p| p.0).collect();
    assert_eq!(items, [100, 101, 200, 201, 3, 9, 16], "one piece in about every 6.7");
    // Evenly: at every point of the use order the pinned bytes are within a piece of the share.
    let (mut seen, mut kept) = (0.0, 0.0);
    for &(i, bytes) in &rest {
        seen += bytes as f64;
        kept += if items.contains(&i) { bytes as f64 } else { 0.0 };
        assert!((kept - 0.15 * seen).abs() <= 10.0, "after piece {i}: {kept} of {seen}");
    }
    // A router that does not fit is skipped whole; a later one that fits is taken.
    let (pinned, held) = choose_pins(&[vec![(1, 50)], vec![(2, 20)]], &rest, 30);
    assert_eq!(held, [false, true]);
    assert_eq!((pinned[0], pinned.iter().map(|p| p.1).sum::<u64>()), ((2, 20), 30), "{pinned:?}");
    // Nothing allowed, nothing pinned; enough for everything, everything.
    assert_eq!(choose_pins(&routers, &rest, 0), (vec![], vec![false, false]));
    let (all, held) = choose_pins(&routers, &rest, 240);
    assert_eq!((all.len(), held), (24, vec![true, true]));
}

fn open(model: &Path, budget: u64, piece: Option<u64>, spread: bool) -> (Opened<Pipeline>, Plan) {
    let mut run = StreamingRun::new(budget, 16, 8, 2);
    run.store.piece_bytes = piece;
    run.store.spread_pins = spread;
    let trunk = model.parent().unwrap().join("trunk");
    let kernels = kernels::Kernels::with_isa(kernels::Isa::Scalar).unwrap();
    open_streaming(model, &trunk, &run, kernels, |_| {}).unwrap()
}

/// Rows a view hands out for `mat`, or the error.
fn rows_of(view: &dyn TrunkView, mat: &crate::model::weights::Mat) -> Result<usize, String> {
    let mut rows = 0;
    view.row_blocks(mat, &mut |r, _| rows += r.len()).map_err(|e| e.to_string())?;
    Ok(rows)
}

#[test]
fn a_prediction_sees_the_pinned_routers_of_split_units_and_refuses_what_it_would_have_to_read() {
    let (_tmp, model) = tiny_copy();
    let (whole, _) = open(&model, 64_000_000, None, false);
    let trunk_bytes = whole.engine.src.store().pack.units.iter().map(|u| u.len).sum::<u64>();
    let smallest = open(&model, 64_000_000, None, false).1.min_piece_bytes.unwrap();
    let at_min = open(&model, 64_000_000, Some(smallest), false).1;
    // Without spread, at the minimum every unit is split and nothing of it is in memory.
    let (units, plan) = open(&model, at_min.minimum_bytes, Some(smallest), false);
    let store = units.engine.src.store();
    let moe: Vec<usize> = (0..units.engine.model.cfg.n_layers)
        .filter(|&l| matches!(units.engine.model.weights.layers[l].ffn, FfnWeights::Moe(_)))
        .collect();
    assert!(!moe.is_empty() && plan.pinned.is_empty(), "{}", plan.describe());
    assert!(moe.iter().all(|&l| store.trunk_if_resident(TrunkUnit::Layer(l)).is_none()));
    // Spread at a budget that pins about half the trunk: every split MoE layer's router is
    // resident and served whole; a streamed piece is refused, never read.
    let pool = 8 * at_min.expert_slot_bytes;
    let budget = at_min.minimum_bytes + SPREAD_RING_SLOTS as u64 * at_min.ring_slot_bytes + pool + trunk_bytes / 2;
    let (spread, plan) = open(&model, budget, Some(smallest), true);
    assert!(plan.pinned_piece_bytes > 0 && plan.pinned.is_empty(), "{}", plan.describe());
    let store = spread.engine.src.store();
    let before = store.stats().trunk_reads;
    let mut refused = 0;
    for &l in &moe {
        let view = store.trunk_if_resident(TrunkUnit::Layer(l)).expect("a pinned router makes the unit predictable");
        let FfnWeights::Moe(w) = &spread.engine.model.weights.layers[l].ffn else { unreachable!() };
        assert_eq!(rows_of(&view, &w.gate), Ok(w.gate.rows), "layer {l}'s router");
        for s in spread.engine.model.weights.layers[l].streamed(&spread.engine.model.cfg) {
            if let Err(e) = rows_of(&view, &s.mat) {
                assert!(e.contains("is not resident, and a prediction does not read"), "{e}");
                refused += 1;
            }
        }
    }
    assert!(refused > 0, "some matrix of a split MoE layer streams");
    assert_eq!(store.stats().trunk_reads, before, "a prediction's view read nothing");
}
