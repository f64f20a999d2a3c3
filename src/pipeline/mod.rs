//! The pipeline around the model: the streaming weight source a run computes from.
//!
//! ```text
//!                 +-------------------- Pipeline (WeightSource + LayerHook) --------------------+
//!   model         |                                                                               |
//!   forward ----> | trunk / embed_rows / expert ----------------------> Store (storage::stream) |
//!   (scheduler    | request (a layer's routing) --> Mode: serial waits -> Store::request_demand |
//!    thread)      |        \-> Prefetcher::routed (previous-token guesses)                       |
//!   hook points ->| mlp_input / layer_end -------> Prefetcher: next layer's router -> guesses -> |
//!                 |                                              Store::request(Priority::Guess)  |
//!                 |                       Store --(ReadQueue: reserve, submit, wait)--> IoStage   |
//!                 +--------------------------------------------------------------------------- -+
//!   IoStage: the `k3ring-io` thread owns the ring; demand reads first, then trunk read-ahead,
//!   then guesses; each batch completes a ticket. Placement pins it and the compute pool.
//! ```
//!
//! What each file owns:
//! - [`io_stage`]: the I/O thread, its priorities, submission and reaping, tickets.
//! - [`prefetcher`]: the prediction rules (next-layer router, block starts, margin, previous
//!   token) and the guesses they make.
//! - [`mode`]: pipelined or serial.
//! - [`placement`]: which cores and NUMA node serve which stage.
//!
//! The model sees only [`WeightSource`] and [`LayerHook`]; it never knows whether a prefetcher
//! exists. Nothing here changes the arithmetic: where and when bytes arrive never does.
#![forbid(unsafe_code)]

pub mod io_stage;
pub mod mode;
pub mod placement;
pub mod prefetcher;
pub mod trial;

use std::path::Path;
use std::sync::Arc;

use crate::checkpoint::CheckpointIndex;
use crate::config::Config;
use crate::model::weights::{Mat, SourceError, TrunkUnit, WeightSource};
use crate::model::{LayerHook, Model};
use crate::storage::plan::Plan;
use crate::storage::stream::policy::policy_by_name;
use crate::storage::stream::reads::ReadQueue;
use crate::storage::stream::stats::DeviceStats;
use crate::storage::stream::WaitFor;
use crate::storage::stream::{ExpertGuard, Store, StoreOptions, StreamError, StreamStats, TrunkGuard};
use crate::trace::Tracer;

pub use io_stage::{BackendSpec, IoKind, IoOptions, IoStage};
pub use mode::Mode;
pub use placement::{Placement, PlacementError, PlacementRequest};
pub use prefetcher::{Prefetcher, Speculation};

/// How to run the pipeline.
#[derive(Clone, Debug, Default)]
pub struct PipelineOptions {
    pub io: IoOptions,
    pub mode: Mode,
    pub speculation: Speculation,
}

impl PipelineOptions {
    /// The speculation the mode allows (none in serial mode: the C engine's design reads after
    /// routing).
    pub fn effective_speculation(&self) -> Speculation {
        if self.mode.predicts() {
            self.speculation
        } else {
            Speculation { enabled: false, prev_token: false, ..self.speculation }
        }
    }
}

/// The streaming weight source: the store, the I/O stage that reads into it, the prefetcher
/// that guesses ahead of routing, in one mode.
pub struct Pipeline {
    store: Store,
    io: Arc<IoStage>,
    prefetcher: Prefetcher,
    mode: Mode,
    /// What each device holds, for the per-device report.
    device_names: Vec<String>,
}

impl Pipeline {
    /// Checks the pack against the checkpoint, allocates the arena as the plan says, starts the
    /// I/O thread and reads the pinned units (verifying each).
    #[allow(clippy::too_many_arguments)]
    pub fn open(
        model_dir: &Path,
        trunk_dir: &Path,
        index: Arc<CheckpointIndex>,
        cfg: &Config,
        plan: &Plan,
        store_opts: &StoreOptions,
        opts: &PipelineOptions,
        tracer: Arc<Tracer>,
    ) -> Result<Pipeline, StreamError> {
        let policy = policy_by_name(&store_opts.policy, plan.expert_slots)
            .ok_or_else(|| StreamError::Mismatch(format!("unknown cache policy {:?}", store_opts.policy)))?;
        let mut store_opts = store_opts.clone();
        store_opts.readahead = opts.mode.readahead(store_opts.readahead);
        let prepared = Store::prepare(model_dir, trunk_dir, index, cfg, plan, &store_opts, |files| {
            io_stage::read_alignment(files, &opts.io)
        })?;
        let devices = prepared.file_devices().iter().max().map_or(1, |d| d + 1);
        let lanes = opts.io.per_device(devices, prepared.expert_lane_first());
        // A modeled device copies from the page cache: the re-read bytes must fit beside the
        // budget (checked now), and are read in once the pinned units are in (below).
        let warm = match lanes.iter().find_map(|o| o.kind.modeled()) {
            Some(model) => Some(modeled_warm_up(&prepared, &model)?),
            None => None,
        };
        let io = Arc::new(IoStage::start_devices(
            prepared.files(),
            prepared.file_devices(),
            &lanes,
            prepared.buffer(),
            prepared.align(),
            Arc::clone(&tracer),
        )?);
        let stats = StreamStats {
            backend: opts.io.kind.name().to_owned(),
            backend_info: io.backend_info.clone(),
            expert_placement: prepared.placement_note().unwrap_or_default().to_owned(),
            ..StreamStats::default()
        };
        let window = opts.io.queue_depth.max(1) as usize * opts.io.chunk_bytes.max(1);
        let device_names = prepared.device_names().to_vec();
        let reads: Arc<dyn ReadQueue> = Arc::clone(&io) as Arc<dyn ReadQueue>;
        let store = Store::open(prepared, reads, opts.io.kind == IoKind::Uring, stats, tracer, policy)?;
        if let Some((files, ranges)) = warm {
            // The pinned units now live in the arena; their pages in the cache would be the
            // newest and push out the experts the model serves. Drop the pack's pages, then
            // read what runs re-read, newest last.
            crate::storage::io::modeled::drop_cached(&trunk_dir.join(crate::storage::pack::PACK_FILE));
            crate::storage::io::modeled::warm_ranges(&files, &ranges)?;
        }
        let spec = opts.effective_speculation();
        let prefetcher = Prefetcher::new(
            cfg,
            store_opts.chunk_tokens,
            plan.sequences,
            spec,
            Arc::clone(&io),
            window,
            cfg.expert_bytes(),
        );
        Ok(Pipeline { store, io, prefetcher, mode: opts.mode, device_names })
    }

    /// Each layer's expert bytes read so far (index = layer), cheaply enough to take between
    /// timed steps.
    pub fn expert_bytes_by_layer(&self) -> Vec<u64> {
        self.store.expert_bytes_by_layer()
    }

    /// The store, for tests that drive it directly.
    #[cfg(test)]
    pub(crate) fn store(&self) -> &Store {
        &self.store
    }

    /// Counters so far: the store's and the I/O stage's.
    pub fn stats(&self) -> StreamStats {
        let mut s = self.store.stats().with_io(self.io.stats());
        if self.io.devices() > 1 {
            s.devices = self
                .io
                .device_stats()
                .iter()
                .enumerate()
                .map(|(d, io)| DeviceStats::new(self.device_names.get(d).cloned().unwrap_or_default(), io))
                .collect();
        }
        // Cancelled guesses wasted the part of their reads that reached the device.
        s.spec_wasted_bytes += s.spec_cancelled_window_bytes.saturating_sub(self.io.cancelled_bytes());
        (s.spec_trials_won, s.spec_trials_lost, s.spec_trials_decided) = self.prefetcher.trials();
        s
    }

    /// Waits until the reads already sent have completed and are counted (see
    /// [`io_stage::IoStage::settle`]): call it at the end of a run, before taking the report and writing
    /// the trace, so the two agree. Bounded by one second; returns whether it settled.
    pub fn settle(&self) -> bool {
        self.io.settle(std::time::Duration::from_secs(1))
    }

    /// The tracer reads and stalls are recorded in.
    pub fn tracer(&self) -> &Arc<Tracer> {
        self.store.tracer()
    }

    /// Batches the I/O stage still tracks (bounded by the slots, whatever the run length).
    pub fn tickets_held(&self) -> usize {
        self.io.tickets_held()
    }

    pub fn mode(&self) -> Mode {
        self.mode
    }

    pub fn speculation(&self) -> Speculation {
        self.prefetcher.speculation()
    }
}

/// A modeled device copies from the page cache: refuses a run whose re-read bytes do not fit
/// in the memory left beside the budget (the arena is allocated by now), and reads them once so
/// that no timed read waits for the real disk.
/// What a modeled device's reads will copy from the page cache (files and ranges), once it is
/// known to fit in the memory beside the budget.
type WarmUp = (Vec<std::path::PathBuf>, Vec<(usize, u64, u64)>);

fn modeled_warm_up(
    prepared: &crate::storage::stream::Prepared,
    model: &crate::storage::io::DeviceModel,
) -> Result<WarmUp, StreamError> {
    let (ranges, expert_bytes, trunk_bytes) = prepared.reread_ranges();
    modeled_device_fits(model, expert_bytes, trunk_bytes, crate::memory::available())?;
    tracing::info!(
        "--io {}: reading {:.2} GB of experts and streamed trunk into the page cache",
        model.spec(),
        (expert_bytes + trunk_bytes) as f64 / 1e9
    );
    Ok((prepared.files().to_vec(), ranges))
}

/// Refuses a modeled device whose re-read bytes exceed the memory available (unknown: allowed).
fn modeled_device_fits(
    model: &crate::storage::io::DeviceModel,
    expert_bytes: u64,
    trunk_bytes: u64,
    available: Option<crate::memory::Available>,
) -> Result<(), StreamError> {
    match available {
        Some(a) if expert_bytes + trunk_bytes > a.bytes => Err(StreamError::ModeledDeviceDoesNotFit {
            spec: model.spec(),
            expert_bytes,
            trunk_bytes,
            available: a.bytes,
            available_from: a.limited_by.to_string(),
        }),
        _ => Ok(()),
    }
}

impl WeightSource for Pipeline {
    type Trunk<'a> = TrunkGuard<'a>;
    type Expert<'a> = ExpertGuard<'a>;

    fn trunk(&self, unit: TrunkUnit) -> Result<TrunkGuard<'_>, SourceError> {
        self.store.trunk(unit)
    }

    fn embed_rows(&self, table: &Mat, ids: &[u32], out: &mut [u8]) -> Result<(), SourceError> {
        self.store.embed_rows(table, ids, out)
    }

    fn request(&self, layer: usize, experts: &mut [usize]) {
        let routed = self.store.request_demand(layer, experts);
        self.prefetcher.routed(&self.store, layer, experts, &routed);
        if self.mode.waits_for_every_read() {
            // Read everything the layer needs before computing any of it.
            for &t in &routed.tickets {
                let _ = self.store.wait_io(t, WaitFor::Experts(layer));
            }
        }
    }

    fn expert(&self, layer: usize, expert: usize) -> Result<ExpertGuard<'_>, SourceError> {
        self.store.expert(layer, expert)
    }

    fn expert_unchecked(&self, layer: usize, expert: usize) -> Result<ExpertGuard<'_>, SourceError> {
        self.store.expert_unchecked(layer, expert)
    }
}

impl LayerHook for Pipeline {
    fn mlp_input(&self, model: &Model, layer: usize, t: usize, y: &[f32]) {
        self.prefetcher.mlp_input(&self.store, model, layer, t, y);
    }

    fn layer_end(&self, model: &Model, layer: usize, t: usize, snapshots: &[Vec<f32>], partial: &[f32]) {
        self.prefetcher.layer_end(&self.store, model, layer, t, snapshots, partial);
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::modeled_device_fits;
    use crate::exit::{Classify, ExitCode};
    use crate::memory::{Available, Limit};
    use crate::storage::io::DeviceModel;

    #[test]
    fn a_modeled_device_is_refused_with_the_numbers_when_its_bytes_do_not_fit() {
        let model = DeviceModel::parse("sim:7GB/s x4").unwrap();
        let available = |bytes| Some(Available { bytes, limited_by: Limit::MemAvailable });
        assert!(modeled_device_fits(&model, 6_000_000_000, 1_000_000_000, available(7_000_000_000)).is_ok());
        assert!(modeled_device_fits(&model, 6_000_000_000, 1_000_000_000, None).is_ok());
        let e = modeled_device_fits(&model, 6_000_000_000, 1_000_000_001, available(7_000_000_000)).unwrap_err();
        assert_eq!(e.exit_code(), ExitCode::Usage);
        let text = e.to_string();
        for part in [
            "--io sim:7GB/s,80us,qd32x4",
            "read 7.00 GB there",
            "experts 6.00 GB",
            "pinned units 1.00 GB",
            "7.00 GB of memory",
        ] {
            assert!(text.contains(part), "{part:?} not in {text}");
        }
    }
}
