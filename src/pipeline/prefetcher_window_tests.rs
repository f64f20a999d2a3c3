//! A layer's trial window reads the waits for that layer's own experts, at both of the points
//! that open it: the previous layer's MLP input, and the previous layer's end before a block
//! start.

use super::Prefetcher;
use crate::model::Model;
use crate::storage::stream::{lock, open_tiny_pipeline, tiny_copy, Store, WaitFor};

const PREVIOUS_BEFORE_S: f64 = 1.0;
const OWN_BEFORE_S: f64 = 2.0;
const OWN_DURING_S: f64 = 0.25;
const PREVIOUS_DURING_S: f64 = 0.5;
const TRUNK_DURING_S: f64 = 4.0;
const NEXT_DURING_S: f64 = 8.0;

/// The attention-residual snapshots after `layer`: one per block start up to it.
fn snapshots(model: &Model, layer: usize) -> Vec<Vec<f32>> {
    let d = model.cfg.hidden_size;
    let n = model.cfg.block_starts().iter().filter(|&&b| b <= layer).count();
    (0..n).map(|i| (0..d).map(|j| ((i * 7 + j) % 11) as f32 * 0.01).collect()).collect()
}

/// Counts waits before and inside `layer`'s window, which `open` opens, in `layer`, the layers
/// on either side and `layer`'s trunk, then closes the window at `layer`'s end; returns the
/// expert waits the trial recorded for it. Each figure differs for every wrong pair of layers
/// read at the two ends (a negative difference is recorded as zero).
fn window_waits(prefetcher: &Prefetcher, store: &Store, model: &Model, layer: usize, open: impl FnOnce()) -> f64 {
    let d = model.cfg.hidden_size;
    store.count_wait(WaitFor::Experts(layer - 1), PREVIOUS_BEFORE_S * 1e6);
    store.count_wait(WaitFor::Experts(layer), OWN_BEFORE_S * 1e6);
    let recorded = lock(&prefetcher.trial).waited_without(layer).len();
    open();
    store.count_wait(WaitFor::Experts(layer), OWN_DURING_S * 1e6);
    store.count_wait(WaitFor::Experts(layer - 1), PREVIOUS_DURING_S * 1e6);
    store.count_wait(WaitFor::Trunk(Some(layer)), TRUNK_DURING_S * 1e6);
    store.count_wait(WaitFor::Experts(layer + 1), NEXT_DURING_S * 1e6);
    let partial: Vec<f32> = (0..d).map(|j| (j % 5) as f32 * 0.02).collect();
    prefetcher.layer_end(store, model, layer, 1, &snapshots(model, layer), &partial);
    let trial = lock(&prefetcher.trial);
    let waits = trial.waited_without(layer);
    assert_eq!(waits.len(), recorded + 1, "layer {layer}'s window was not timed");
    waits[recorded]
}

#[test]
fn a_layers_window_counts_only_the_waits_for_its_own_experts() {
    let (_tmp, dir) = tiny_copy();
    let opened = open_tiny_pipeline(&dir);
    let (model, pipeline) = (&opened.engine.model, &opened.engine.src);
    let (store, prefetcher) = (&pipeline.store, &pipeline.prefetcher);
    assert!(prefetcher.spec.enabled && prefetcher.spec.adaptive, "the default speculation times windows");
    let cfg = &model.cfg;
    // Layers in the middle: the last layer's end closes the pass, which the trial counts too.
    let moe: Vec<usize> = cfg.moe_layers().into_iter().filter(|&l| l > 0 && l + 1 < cfg.n_layers).collect();
    let inner = *moe.iter().find(|&&l| !cfg.layers[l].block_start).expect("an MoE layer inside a block");
    let start = *moe.iter().find(|&&l| cfg.layers[l].block_start).expect("an MoE layer starting a block");
    let d = cfg.hidden_size;

    let y: Vec<f32> = (0..d).map(|j| (j % 13) as f32 * 0.01 - 0.06).collect();
    let waited = window_waits(prefetcher, store, model, inner, || prefetcher.mlp_input(store, model, inner - 1, 1, &y));
    assert!((waited - OWN_DURING_S).abs() < 1e-9, "layer {inner} (opened at the MLP input): {waited} s");

    let waited = window_waits(prefetcher, store, model, start, || {
        let partial: Vec<f32> = (0..d).map(|j| (j % 3) as f32 * 0.03).collect();
        prefetcher.layer_end(store, model, start - 1, 1, &snapshots(model, start - 1), &partial);
    });
    assert!(
        (waited - OWN_DURING_S).abs() < 1e-9,
        "layer {start} (a block start, opened at the previous end): {waited} s"
    );
}
