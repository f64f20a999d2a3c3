//! Flags of the pipeline (`run`, `chat`, `batch`, `serve`): placement, speculation, cache policy, mode,
//! profiling outputs; and turning them into the library's options.

use std::path::PathBuf;

use crate::pipeline::{Mode, Placement, PlacementRequest, Speculation};
use crate::storage::io::topology::parse_cpulist;
use crate::storage::stream::policy::{DEFAULT_POLICY, POLICY_NAMES};
use clap::builder::PossibleValuesParser;

#[derive(Debug, Clone, clap::Args)]
pub struct PipelineArgs {
    /// NUMA node for buffers and threads (default: the node with the most CPUs).
    #[arg(long, value_name = "N")]
    pub numa_node: Option<u32>,
    /// CPUs of the compute threads, e.g. 0-6,8 (default: the node's CPUs but the I/O one).
    #[arg(long, value_name = "LIST", value_parser = parse_cpus)]
    pub compute_cores: Option<CpuList>,
    /// CPU of the I/O thread, one only (default: the node's last CPU).
    #[arg(long, value_name = "CPU", value_parser = parse_io_core)]
    pub io_cores: Option<usize>,
    /// Print the placement and exit.
    #[arg(long)]
    pub print_placement: bool,
    /// Prefetch the experts the next layer's router predicts (the default; see --no-spec).
    #[arg(long, overrides_with = "no_spec")]
    pub spec: bool,
    /// Do not prefetch predicted experts: a layer's experts are read once its routing is known.
    #[arg(long, overrides_with = "spec")]
    pub no_spec: bool,
    /// Experts predicted per token beyond top-k (0 to 1024).
    #[arg(long, value_name = "M", default_value_t = 0, value_parser = parse_spec_margin)]
    pub spec_margin: usize,
    /// Also prefetch the experts the previous token used at the next layer.
    #[arg(long)]
    pub spec_prev_token: bool,
    /// Read every prediction, evicting what the cache policy picks, whatever the device's load
    /// (default: a guess evicts only less likely experts, and only as many guesses as the
    /// device had idle time for at this layer are read).
    #[arg(long)]
    pub spec_fixed: bool,
    /// Expert cache policy: lru, s3fifo, lfu, cyclic or even.
    #[arg(long, value_name = "NAME", default_value = DEFAULT_POLICY, value_parser = PossibleValuesParser::new(POLICY_NAMES))]
    pub policy: String,
    /// pipelined (reads overlap compute) or serial (read a layer's experts, then compute them).
    #[arg(long, value_name = "MODE", default_value = "pipelined", value_parser = ["pipelined", "serial"])]
    pub mode: String,
    /// Write a Chrome trace-event JSON (open in Perfetto or chrome://tracing).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// Write every (token, layer, experts) routing decision, for `k3ring cache-sim`.
    #[arg(long, value_name = "FILE")]
    pub dump_trace: Option<PathBuf>,
}

/// K3 has 896 experts: a margin beyond 1024 is never meant.
fn parse_spec_margin(s: &str) -> Result<usize, String> {
    super::count_in(s, 0..=1024, "a number of experts beyond top-k (0 to 1024)")
}

/// A CPU list flag value ("0-3,8").
#[derive(Clone, Debug)]
pub struct CpuList(pub Vec<usize>);

fn parse_cpus(s: &str) -> Result<CpuList, String> {
    parse_cpulist(s, std::path::Path::new("(flag)")).map(CpuList).map_err(|e| e.to_string())
}

/// `--io-cores` takes a CPU list for its syntax (and its old form) but must name exactly one CPU:
/// the I/O stage is a single thread, so any further CPU would sit unused.
fn parse_io_core(s: &str) -> Result<usize, String> {
    let cpus = parse_cpus(s)?.0;
    match cpus[..] {
        [cpu] => Ok(cpu),
        [] => Err(format!("give one CPU for the I/O thread, e.g. --io-cores {}", example_io_core(&cpus))),
        [_, ..] => Err(format!(
            "the I/O stage is one thread, pinned to one CPU, but {} CPUs were given: give one, e.g. --io-cores {}",
            cpus.len(),
            example_io_core(&cpus)
        )),
    }
}

/// A CPU the refusals of `--io-cores` can name that this machine runs: the first of `given`
/// that is online, else the last online CPU (the default I/O core), else the first given.
fn example_io_core(given: &[usize]) -> usize {
    let online = crate::storage::io::Topology::detect().map(|t| t.cpus()).unwrap_or_default();
    let first_online = given.iter().copied().find(|c| online.contains(c));
    first_online.or_else(|| online.last().copied()).or_else(|| given.first().copied()).unwrap_or(0)
}

impl PipelineArgs {
    /// Resolves the placement against this machine's topology.
    pub fn placement(&self, threads: usize) -> anyhow::Result<Placement> {
        let topo = crate::storage::io::Topology::detect()?;
        let req = PlacementRequest {
            numa_node: self.numa_node,
            compute_cores: self.compute_cores.as_ref().map(|c| c.0.clone()),
            io_core: self.io_cores,
            threads,
        };
        Ok(Placement::resolve(&topo, &req)?)
    }

    pub fn mode(&self) -> Mode {
        Mode::parse(&self.mode).unwrap_or_default()
    }

    /// Refuses speculation flags that the rest of the flags switch off, rather than dropping
    /// them without a word: `--mode serial` reads a layer's experts after its routing and
    /// predicts nothing, and `--no-spec` turns prediction off.
    pub fn refuse_unused_speculation(&self) -> Result<(), crate::error::UsageError> {
        let tuning: Vec<&str> = [
            (self.spec_margin > 0, "--spec-margin"),
            (self.spec_prev_token, "--spec-prev-token"),
            (self.spec_fixed, "--spec-fixed"),
        ]
        .into_iter()
        .filter_map(|(given, flag)| given.then_some(flag))
        .collect();
        if self.mode() == Mode::Serial {
            let mut given = tuning.clone();
            if self.spec {
                given.insert(0, "--spec");
            }
            if !given.is_empty() {
                let (verb, pronoun) = if given.len() == 1 { ("does", "it") } else { ("do", "them") };
                return Err(crate::error::UsageError(format!(
                    "{} {verb} nothing with --mode serial, which reads a layer's experts after its routing and predicts none; drop {pronoun}",
                    given.join(", ")
                )));
            }
        }
        if self.no_spec && !tuning.is_empty() {
            let verb = if tuning.len() == 1 { "tunes" } else { "tune" };
            return Err(crate::error::UsageError(format!(
                "{} {verb} the prediction that --no-spec turns off; drop one or the other",
                tuning.join(", ")
            )));
        }
        Ok(())
    }

    /// Speculation as the flags ask (the pipeline allows none in serial mode: the C engine's
    /// design reads after routing).
    pub fn speculation(&self) -> Speculation {
        Speculation {
            enabled: !self.no_spec,
            margin: self.spec_margin,
            prev_token: self.spec_prev_token,
            adaptive: !self.spec_fixed,
        }
    }
}
