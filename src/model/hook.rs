//! The fixed points of a layer at which an observer may look at the forward pass, and the
//! default observer that does nothing. The streaming pipeline's prefetcher is one: it predicts
//! the next layer's experts from what it sees here. The model calls the hook whether or not it
//! does anything; what the hook does never changes the arithmetic (it sees shared slices only).

use super::Model;

/// Called by [`Model::forward`] at fixed points of every layer, on the scheduler thread.
pub trait LayerHook: Sync {
    /// Layer `layer`'s MLP residual read, its FFN input before the norm, is known: `y` ([t, D]).
    fn mlp_input(&self, _model: &Model, _layer: usize, _t: usize, _y: &[f32]) {}

    /// Layer `layer` is done: `partial` ([t, D]) is its final partial sum and `snapshots` the
    /// block snapshots taken so far (rows [t, D] first). The next layer, if it starts a block,
    /// snapshots `partial` and restarts the sum.
    fn layer_end(&self, _model: &Model, _layer: usize, _t: usize, _snapshots: &[Vec<f32>], _partial: &[f32]) {}
}

/// The hook of a run with nothing to prefetch.
pub struct NoHook;

impl LayerHook for NoHook {}
