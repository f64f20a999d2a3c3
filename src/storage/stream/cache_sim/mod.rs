//! Expert traces and the cache simulator: replays the routing decisions of a run through an
//! expert pool of a given size, under each [`CachePolicy`] and under Belady's offline optimum.
//!
//! Trace format (text, version 1): a header `# k3ring expert trace v1 layers=L experts=E
//! top_k=K [expert_bytes=B]` (B, the bytes of one expert, is optional: older traces lack it), then one line per routing decision, `token layer e1 e2 ... eK`, the experts in the
//! token's top-k order, ordered by token and by layer within a token. Later lines starting with
//! `#` are comments; blank lines are skipped. `layer` is the model's layer index (dense layers
//! have no lines).
//!
//! Simulation semantics follow the engine's pool (`Store::request_demand` and
//! `expert`): the experts of one (token, layer) arrive as a batch; each resident one is a hit,
//! each other one a miss. The misses are read in disk order (ascending expert id, the order the
//! checkpoint stores a layer's experts), each evicting the policy's victim when the pool is full,
//! and the experts of the batch are never victims; then every expert of the batch is used once,
//! hits first. A pool smaller than `top_k` could not hold one batch and is refused. The engine
//! batches a whole prefill chunk per layer, the trace has one batch per token: the simulator
//! replays per token, which is what decode does.
//!
//! Threads: any; nothing here is shared. Allocation: a trace is held in memory (4 bytes per
//! request, at most [`TRACE_REQUESTS_MAX`]); a simulation allocates its pool's bookkeeping once.
//!
//! Files: [`trace`] reads and writes traces; [`simulate`] replays them (a policy, Belady).

mod simulate;
#[cfg(test)]
mod tests;
mod trace;

use std::path::PathBuf;

use super::policy::ExpertKey;
use crate::exit::{Classify, ExitCode};

pub use simulate::{belady, belady_with_progress, default_capacities, simulate, simulate_with_progress, SimResult};
pub use trace::{read_trace, read_trace_from, Batch, Trace, TraceWriter};

/// Layers a trace may declare.
pub const TRACE_LAYERS_MAX: usize = 4096;
/// Experts per layer a trace may declare.
pub const TRACE_EXPERTS_MAX: usize = 1 << 16;
/// Experts per routing decision a trace may declare.
pub const TRACE_TOP_K_MAX: usize = 1024;
/// Requests (expert ids) a trace may hold: 1 GiB of ids, about 180 000 Kimi K3 tokens.
pub const TRACE_REQUESTS_MAX: usize = 1 << 28;
/// Records a [`TraceWriter`] holds back for reordering before it writes them regardless:
/// a 4096-token prefill chunk over 92 MoE layers is 376 832 records.
pub const WRITER_RECORDS_MAX: usize = 1 << 20;
/// Batches simulated between two progress reports.
const PROGRESS_BATCHES: usize = 1 << 12;
/// Marks "never used again" in Belady's next-use table.
const NEVER: u32 = u32::MAX;

const HEADER_PREFIX: &str = "# k3ring expert trace";
const FORMAT_VERSION: &str = "v1";

/// Why a trace could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened, read or written (exit 4).
    #[error("{op} expert trace {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A line of the file is not a valid trace line (exit 3).
    #[error("expert trace {} line {line}: {reason}", path.display())]
    Malformed { path: PathBuf, line: usize, reason: String },
    /// A trace shape or record given in code is invalid (exit 3).
    #[error("expert trace: {reason}")]
    Invalid { reason: String },
    /// The output file was refused or could not be written (exit 2 or 4).
    #[error("expert trace: {0}")]
    Output(#[from] crate::files::OutputError),
}

/// The documented exit code: 4 for I/O, 3 for invalid data.
impl Classify for TraceError {
    fn exit_code(&self) -> ExitCode {
        match self {
            TraceError::Io { .. } => ExitCode::Io,
            TraceError::Malformed { .. } | TraceError::Invalid { .. } => ExitCode::Data,
            TraceError::Output(e) => e.exit_code(),
        }
    }
}

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("a pool of {capacity} experts cannot hold one routing decision of {top_k} experts: use a capacity of at least {top_k}")]
    CapacityBelowTopK { capacity: usize, top_k: usize },
    /// A policy named a victim that is not resident or is protected (a bug in the policy).
    #[error("policy {policy} chose {victim:?} at batch {batch}, which is {why}")]
    BadVictim { policy: &'static str, victim: Option<ExpertKey>, batch: usize, why: &'static str },
}

/// A capacity below top-k is a refused request (2); a bad victim is a bug in a policy (1).
impl Classify for SimError {
    fn exit_code(&self) -> ExitCode {
        match self {
            SimError::CapacityBelowTopK { .. } => ExitCode::Usage,
            SimError::BadVictim { .. } => ExitCode::Internal,
        }
    }
}
