//! Copies of a sequence's state at a position, to start another sequence with the same prefix
//! there (the server's prefix cache, [`crate::engine::prefix_cache`]). For K3's hybrid attention
//! a position's state is every KDA layer's recurrent state and conv history (a fixed size,
//! whatever the position) and every MLA layer's latent cache rows up to the position (growing
//! with it). Restoring is a copy: the state is then bit for bit the one the prefix left, so what
//! follows is the same as from a cold start.

use super::{LayerState, ModelError, ModelState};

/// One layer's part of a snapshot.
enum LayerCopy {
    Kda { s: Vec<f32>, conv: Vec<f32> },
    Mla { rows: Vec<f32> },
}

/// A state at position `pos` (see the module docs).
pub struct StateSnapshot {
    layers: Vec<LayerCopy>,
    pos: usize,
}

impl StateSnapshot {
    /// Positions the snapshot covers.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// Bytes the snapshot holds.
    pub fn bytes(&self) -> u64 {
        let floats: usize = self
            .layers
            .iter()
            .map(|l| match l {
                LayerCopy::Kda { s, conv } => s.len() + conv.len(),
                LayerCopy::Mla { rows } => rows.len(),
            })
            .sum();
        4 * floats as u64
    }
}

impl ModelState {
    /// A copy of the state as it is (its position included). A state armed for draft
    /// verification is refused: its step may still be taken back.
    pub fn snapshot(&self) -> Result<StateSnapshot, ModelError> {
        if self.armed_rows().is_some() {
            return Err(ModelError::Internal("a snapshot of a state whose step may still be taken back".into()));
        }
        let layers = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Kda(k) => {
                    let (s, conv) = k.parts();
                    LayerCopy::Kda { s: s.to_vec(), conv: conv.to_vec() }
                }
                LayerState::Mla(c) => LayerCopy::Mla { rows: c.rows().to_vec() },
            })
            .collect();
        Ok(StateSnapshot { layers, pos: self.pos })
    }

    /// Makes the state the snapshot's: refused when it was taken of another model's state or
    /// holds more positions than this state's capacity.
    pub fn restore(&mut self, snap: &StateSnapshot) -> Result<(), ModelError> {
        if snap.pos > self.capacity {
            return Err(ModelError::Internal(format!(
                "a snapshot of {} positions into a state of {}",
                snap.pos, self.capacity
            )));
        }
        if snap.layers.len() != self.layers.len() {
            return Err(ModelError::Internal("a snapshot of another model's state".into()));
        }
        self.reset();
        for (l, copy) in self.layers.iter_mut().zip(&snap.layers) {
            let fits = match (l, copy) {
                (LayerState::Kda(k), LayerCopy::Kda { s, conv }) => k.set_parts(s, conv),
                (LayerState::Mla(c), LayerCopy::Mla { rows }) => c.set_rows(rows),
                _ => false,
            };
            if !fits {
                self.reset();
                return Err(ModelError::Internal("a snapshot of another model's state".into()));
            }
        }
        self.pos = snap.pos;
        Ok(())
    }
}
