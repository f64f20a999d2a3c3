//! What the store did, for the run report and `--json`: one counter set shared by the trunk ring,
//! the expert pool, the embedding reads and the prefetcher, plus the I/O stage's own counters.

use serde::Serialize;

use crate::storage::io::IoStats;

/// What the store did.
#[derive(Clone, Debug, Default, Serialize)]
pub struct StreamStats {
    pub backend: String,
    pub backend_info: String,
    pub buffers: String,
    /// Where the experts were placed by `pack --experts-to` (empty: read from the shards).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub expert_placement: String,
    pub trunk_pinned_units: usize,
    pub trunk_streamed_units: usize,
    /// Streamed units read in pieces, and how many pieces they have together.
    pub trunk_split_units: usize,
    pub trunk_pieces: usize,
    /// Pieces of split units held resident from open (`--trunk-pins spread`), among `trunk_pieces`.
    pub trunk_pinned_pieces: usize,
    pub trunk_bytes_read: u64,
    pub trunk_reads: u64,
    pub embed_bytes_read: u64,
    pub expert_bytes_read: u64,
    /// Bytes of the aligned windows read for experts (what the device delivered).
    pub expert_window_bytes_read: u64,
    pub expert_reads: u64,
    /// Experts already resident before the layer that needed them asked.
    pub expert_hits: u64,
    pub expert_misses: u64,
    pub expert_evictions: u64,
    /// Experts checked against their checksum after their read, their bytes, and the time the
    /// checks took on the compute path (the first use of each, which waited for it).
    pub experts_verified: u64,
    pub expert_verified_bytes: u64,
    pub expert_verify_seconds: f64,
    /// Of those, the experts whose check ended while compute waited for a read, and the time
    /// spent hashing in such waits (not on the compute path: checks left part-way there are
    /// finished by the first use).
    pub experts_verified_waiting: u64,
    pub expert_verify_waiting_seconds: f64,
    /// Of the checks on the compute path, the experts hashed by their own products as they read
    /// them ([`Store::expert_unchecked`](super::Store::expert_unchecked)), and the time the
    /// hashing added to them (in the products, its seconds summed over the threads over the
    /// thread count; after them, the blocks of products that never ran, which is none unless a
    /// product failed).
    pub experts_verified_in_products: u64,
    pub expert_verify_in_products_seconds: f64,
    /// Expert reads whose bytes failed their checksum (in a wait, on first use or in their
    /// products) and were read again; a second failure in a row stops the run.
    pub expert_reads_damaged: u64,
    /// Experts read on a prediction, and their bytes.
    pub spec_reads: u64,
    pub spec_bytes: u64,
    /// Predicted experts that a layer then used.
    pub spec_used: u64,
    /// Bytes of predicted experts read and never used: evicted unused, or cancelled (the part
    /// that reached the device).
    pub spec_wasted_bytes: u64,
    /// Guesses still being read when their layer's routing did not choose them: the part of
    /// their reads not yet in the device was dropped.
    pub spec_cancelled: u64,
    /// Read windows of those guesses, whole (the I/O stage counts what it dropped).
    pub spec_cancelled_window_bytes: u64,
    /// Of `spec_reads`, those guessed at the end of a decode step for the next step's first
    /// MoE layer (the experts it chose in this step).
    pub spec_next_step_reads: u64,
    /// Predictions whose guesses were skipped because the device had no time for them.
    pub spec_skipped_busy: u64,
    /// Trials of adaptive speculation (passes with and without guesses compared) that decided
    /// for guessing, and against it.
    pub spec_trials_won: u64,
    pub spec_trials_lost: u64,
    /// Trials decided, including those in which no layer was timed (they add to neither count
    /// above).
    pub spec_trials_decided: u64,
    /// True routed experts, and those already requested (resident or in flight) when the
    /// layer's routing was known: recall = recalled / routed.
    pub routed_experts: u64,
    pub routed_recalled: u64,
    pub read_busy_seconds: f64,
    pub read_bytes_per_second: f64,
    /// The read backend's counters (proof of which backend did the reading).
    pub io: IoStats,
    /// Per MoE layer: reads, hits, recall and stalls.
    pub per_layer: Vec<LayerStats>,
    /// Per device when reads go to several (`pack --experts-to`): what each read.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<DeviceStats>,
}

/// One device's reads.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DeviceStats {
    /// What it holds: "shards and trunk", or an expert directory.
    pub name: String,
    pub reads: u64,
    pub bytes_read: u64,
    pub busy_seconds: f64,
    /// Bytes per second while busy.
    pub read_bytes_per_second: f64,
}

impl DeviceStats {
    pub fn new(name: String, io: &IoStats) -> DeviceStats {
        let busy = io.busy_ns as f64 / 1e9;
        DeviceStats {
            name,
            reads: io.ops,
            bytes_read: io.bytes_read,
            busy_seconds: busy,
            read_bytes_per_second: if busy > 0.0 { io.bytes_read as f64 / busy } else { 0.0 },
        }
    }
}

/// One layer's share of the store's work.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LayerStats {
    pub layer: usize,
    pub expert_reads: u64,
    pub expert_bytes_read: u64,
    pub expert_hits: u64,
    pub routed_experts: u64,
    pub routed_recalled: u64,
    /// Time compute waited for this layer's bytes (trunk and experts).
    pub stall_us: f64,
    /// Of it, the time compute waited for this layer's experts.
    pub expert_stall_us: f64,
    /// Of the predicted experts not resident or being read when predicted: those read as
    /// guesses, those dropped because the layer's trial decided against guessing, those beyond
    /// the device time free for them (the budget), and those for which admission found no
    /// expert to evict (the pool had no room the guess could take).
    pub guess_reads: u64,
    pub guesses_trial_off: u64,
    pub guesses_over_budget: u64,
    pub guesses_no_slot: u64,
}

impl StreamStats {
    /// The counters of `layer`, created on first use.
    pub fn layer(&mut self, layer: usize) -> &mut LayerStats {
        if self.per_layer.len() <= layer {
            let from = self.per_layer.len();
            self.per_layer.extend((from..=layer).map(|l| LayerStats { layer: l, ..LayerStats::default() }));
        }
        &mut self.per_layer[layer]
    }

    /// Each layer's expert bytes read (index = layer).
    pub fn expert_bytes_by_layer(&self) -> Vec<u64> {
        self.per_layer.iter().map(|l| l.expert_bytes_read).collect()
    }

    /// Expert bytes the backend reads: whole aligned windows, not only the tensors.
    pub fn expert_bytes_read_windows(&self) -> u64 {
        self.expert_window_bytes_read
    }

    /// Takes the I/O stage's counters in.
    pub fn with_io(mut self, io: IoStats) -> StreamStats {
        self.read_busy_seconds = io.busy_ns as f64 / 1e9;
        self.read_bytes_per_second = if io.busy_ns > 0 { io.bytes_read as f64 / self.read_busy_seconds } else { 0.0 };
        self.io = io;
        self
    }
}
