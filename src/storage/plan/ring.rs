//! How many trunk slots the ring has: the planner's rule for the streamed trunk's read-ahead.

/// Ring slots when units are split and read-ahead is on: three pieces in flight while one
/// computes. Small pieces read one at a time leave the device at queue depth 1, and a slot
/// costs only a piece.
pub const PIECE_RING_SLOTS: usize = 4;

/// Ring slots when pinned trunk is spread as pieces (`--trunk-pins spread`): the streamed
/// pieces come between pinned ones, so the ring holds as many as whole units pinned left it
/// through spare expert slots on the 6-layer synth at 6 GB (11, plus the computing one).
pub const SPREAD_RING_SLOTS: usize = 12;

/// Bytes the spread ring holds at least where its pieces are small ([`spread_ring_slots`]): the
/// device keeps reading ahead through a layer's attention and experts, which read no trunk. At
/// 1.5 GB the 6-layer synth's pieces are the smallest block (4.3 MB), and 12 of them (52 MB)
/// are 6 ms of two modeled 7 GB/s drives: the device idled once they were read, and a ring of
/// 36 (155 MB) was 1.01-1.27x faster (docs/BENCHMARKS.md, "A ring of bytes, not of slots").
pub const SPREAD_RING_BYTES: u64 = 160 << 20;

/// Ring slots of `slot` bytes for spread pins: [`SPREAD_RING_SLOTS`], or as many as hold
/// [`SPREAD_RING_BYTES`] where slots are small, up to an eighth of the budget.
pub fn spread_ring_slots(slot: u64, budget: u64) -> usize {
    let by_bytes = SPREAD_RING_BYTES.min(budget / 8) / slot.max(1);
    SPREAD_RING_SLOTS.max(usize::try_from(by_bytes).unwrap_or(usize::MAX))
}
