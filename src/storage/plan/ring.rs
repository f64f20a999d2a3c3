//! How many trunk slots the ring has: the planner's rule for the streamed trunk's read-ahead.

/// Ring slots when units are split and read-ahead is on: three pieces in flight while one
/// computes. Small pieces read one at a time leave the device at queue depth 1, and a slot
/// costs only a piece.
pub const PIECE_RING_SLOTS: usize = 4;

/// Ring slots when pinned trunk is spread as pieces (`--trunk-pins spread`): the streamed
/// pieces come between pinned ones, so the ring holds as many as whole units pinned left it
/// through spare expert slots on the 6-layer synth at 6 GB (11, plus the computing one).
pub const SPREAD_RING_SLOTS: usize = 12;

/// Bytes the spread ring holds, up to a quarter of the budget, where its pieces are small
/// ([`spread_ring_slots`]): as many as [`SPREAD_RING_SLOTS`] pieces of the default size hold, so
/// that a plan of small pieces reads as far ahead as one of 32 MiB pieces. The device keeps reading
/// ahead through a layer's attention and experts, which read no trunk. At 1.5 GB the 6-layer
/// synth's pieces are the smallest block (4.3 MB); a ring of 12 (52 MB) is 6 ms of two modeled 7
/// GB/s drives and the device idled once it was read. Rings of 155 MB and then of a quarter of the
/// budget (375 MB) each ran faster (docs/BENCHMARKS.md, "A ring of bytes, not of slots" and "A ring
/// as long as the default piece's"). On a device too slow to idle the extra ring is only extra
/// trunk read.
pub const SPREAD_RING_BYTES: u64 = SPREAD_RING_SLOTS as u64 * super::DEFAULT_PIECE_BYTES;

/// Ring slots of `slot` bytes for spread pins: [`SPREAD_RING_SLOTS`], or as many as hold
/// [`SPREAD_RING_BYTES`] where slots are small, up to a quarter of the budget.
pub fn spread_ring_slots(slot: u64, budget: u64) -> usize {
    let by_bytes = SPREAD_RING_BYTES.min(budget / 4) / slot.max(1);
    SPREAD_RING_SLOTS.max(usize::try_from(by_bytes).unwrap_or(usize::MAX))
}
